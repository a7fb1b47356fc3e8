"""Grokking and run-health signals computed from metrics records (formulas of grokking notes §3.9); pure functions.

Standard library only. Every function accepts empty input, NaN/inf and single points without raising;
what cannot be computed comes back as None. `compute_signals(records)` is what the agent serves for the
Grokking screen (a JSON-able dict; non-finite numbers become null).

Conventions: x axis is log10(step) (grokking spans decades of steps); slopes are "loss per decade of steps".
acc[k] is the top-1 agreement of draft and target at TTT position k, so acc[0] is the first drafted token.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from backend.metrics.records import series
from backend.smoothing import TRAIN_EMA_BETA, VAL_EMA_BETA, debiased_ema, is_finite

LR_FLOOR_WARNING = "a cosine run that decayed to ~0 LR cannot grok; resume with a constant LR"


# ---------------------------------------------------------------- slopes, lookups (smoothing: backend/smoothing.py)


@dataclass
class Slope:
    """OLS fit y = a + s*x: slope s, its standard error from residuals, z = s/SE, points used, x range."""

    slope: float
    stderr: float
    z: float
    n: int
    x_from: float
    x_to: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def ols_slope(xs: Sequence[float], ys: Sequence[float]) -> Slope | None:
    """s = Σ(x-x̄)(y-ȳ)/Σ(x-x̄)², SE = sqrt(Σres²/(n-2) / Σ(x-x̄)²), z = s/SE; finite pairs only.

    None with fewer than 2 usable points or no spread in x. With 2 points SE and z are NaN; on an exact
    line SE is 0 and z is ±inf (0 when the slope is 0 too).
    """
    pairs = [(float(x), float(y)) for x, y in zip(xs, ys) if is_finite(x) and is_finite(y)]
    n = len(pairs)
    if n < 2:
        return None
    x_mean = sum(x for x, _ in pairs) / n
    y_mean = sum(y for _, y in pairs) / n
    sxx = sum((x - x_mean) ** 2 for x, _ in pairs)
    if sxx <= 0:
        return None
    slope = sum((x - x_mean) * (y - y_mean) for x, y in pairs) / sxx
    intercept = y_mean - slope * x_mean
    if n > 2:
        residual = sum((y - intercept - slope * x) ** 2 for x, y in pairs)
        # Residuals of an exact line are rounding noise; call them zero so z is ±inf, not ±1e15.
        scale = max(abs(y) for _, y in pairs) or 1.0
        stderr = 0.0 if residual <= (1e-12 * scale) ** 2 * n else math.sqrt(residual / (n - 2) / sxx)
    else:
        stderr = math.nan
    if stderr == 0.0:
        z = 0.0 if slope == 0 else math.copysign(math.inf, slope)
    else:
        z = slope / stderr
    return Slope(slope, stderr, z, n, pairs[0][0], pairs[-1][0])


def log_step_slope(steps: Sequence[int], values: Sequence[float]) -> Slope | None:
    """OLS slope of values against log10(step) (per decade of steps); steps <= 0 are left out."""
    xs, ys = [], []
    for step, value in zip(steps, values):
        if is_finite(step) and step > 0:
            xs.append(math.log10(step))
            ys.append(value)
    return ols_slope(xs, ys)


def finite_points(steps: Sequence[int], values: Sequence[float]) -> tuple[list[int], list[float]]:
    pairs = [(s, float(v)) for s, v in zip(steps, values) if is_finite(v)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def value_at(steps: Sequence[int], values: Sequence[float], step: int) -> float | None:
    """The value of the last point at or before `step` (steps sorted ascending), or None."""
    i = bisect.bisect_right(steps, step) - 1
    return values[i] if i >= 0 else None


def log_thin(steps: Sequence[int], values: Sequence[float], per_decade: int = 20) -> tuple[list[int], list[float]]:
    """Keep about `per_decade` points per decade of step (and always the last), so windows span log time."""
    out_steps, out_values, last_x = [], [], -math.inf
    for step, value in zip(steps, values):
        if step <= 0:
            continue
        x = math.log10(step)
        if x - last_x >= 1.0 / per_decade:
            out_steps.append(step)
            out_values.append(value)
            last_x = x
    if steps and steps[-1] > 0 and (not out_steps or out_steps[-1] != steps[-1]):
        out_steps.append(steps[-1])
        out_values.append(values[-1])
    return out_steps, out_values


# ---------------------------------------------------------------- single signals


def gap(val_ema: float | None, train_ema: float | None) -> tuple[float | None, float | None]:
    """Generalization gap G = V̂ - L̂ and relative gap G / V̂ (None where undefined)."""
    if not (is_finite(val_ema) and is_finite(train_ema)):
        return None, None
    g = val_ema - train_ema
    return g, (g / val_ema if val_ema != 0 else None)


def is_flat(slope: Slope | None, level: float | None, abs_eps: float, rel_eps: float) -> bool:
    """|slope per decade| <= max(abs_eps, rel_eps * |level|)."""
    if slope is None or not is_finite(slope.slope):
        return False
    threshold = max(abs_eps, rel_eps * abs(level)) if is_finite(level) else abs_eps
    return abs(slope.slope) <= threshold


def detect_plateau(
    steps: Sequence[int], smoothed: Sequence[float], *, window: int = 10, per_decade: int = 20, abs_eps: float = 0.01, rel_eps: float = 0.05
) -> dict[str, Any]:
    """Train-loss plateau: |slope of the smoothed loss vs log10 step| small over a window of log-spaced points.

    The plateau began at the first step of the earliest flat window in the final unbroken run of flat
    windows. Returns {"active", "start_step", "slope", "steps_past"}.
    """
    result: dict[str, Any] = {"active": False, "start_step": None, "slope": None, "steps_past": None}
    thin_steps, thin_values = log_thin(*finite_points(steps, smoothed), per_decade=per_decade)
    window = max(3, window)
    if len(thin_steps) < window:
        return result
    flat = []
    for end in range(window, len(thin_steps) + 1):
        part_steps, part_values = thin_steps[end - window : end], thin_values[end - window : end]
        slope = log_step_slope(part_steps, part_values)
        flat.append(is_flat(slope, sum(part_values) / window, abs_eps, rel_eps))
        result["slope"] = slope.slope if slope else None
    if not flat[-1]:
        return result
    first = len(flat) - 1
    while first > 0 and flat[first - 1]:
        first -= 1
    start = thin_steps[first]
    result.update(active=True, start_step=start, steps_past=thin_steps[-1] - start)
    return result


def clip_fraction(grad_norms: Sequence[float], clip: float, window: int = 50) -> float | None:
    """Fraction of the last `window` finite pre-clip grad norms above `clip` (None when there are none)."""
    recent = [g for g in grad_norms if is_finite(g)][-window:]
    if not recent or not is_finite(clip):
        return None
    return sum(1 for g in recent if g > clip) / len(recent)


def grad_norm_medians(grad_norms: Sequence[float], window: int = 50, min_before: int = 10) -> tuple[float | None, float | None]:
    """Median of the last `window` finite grad norms, and of the `window` before them (None with fewer than
    `min_before` earlier points): a rising norm is what says a run turns unstable, not how often the clip binds."""
    finite = [g for g in grad_norms if is_finite(g)]
    recent, before = finite[-window:], finite[-2 * window : -window]
    return (_lower_median(recent) if recent else None), (_lower_median(before) if len(before) >= min_before else None)


def relative_change(steps: Sequence[int], values: Sequence[float], lag_steps: int | None = None, lag_points: int = 8) -> tuple[float | None, int | None]:
    """r = (N_t - N_{t-K}) / N_{t-K}; K = lag_steps, or the span of the last `lag_points` points.

    Returns (r, K used), or (None, None) with fewer than 2 finite points or N_{t-K} = 0."""
    steps, values = finite_points(steps, values)
    if len(steps) < 2:
        return None, None
    if lag_steps is None:
        earlier = max(0, len(steps) - 1 - lag_points)
    else:
        earlier = max(0, bisect.bisect_right(steps, steps[-1] - lag_steps) - 1)
    if earlier == len(steps) - 1 or values[earlier] == 0:
        return None, None
    return (values[-1] - values[earlier]) / values[earlier], steps[-1] - steps[earlier]


def estimate_tau(acc: Sequence[float] | None, num_steps: int | None = None) -> float | None:
    """Proxy acceptance length of a chain: τ̂ = 1 + Σ_{k=1..K} Π_{j=1..k} acc_j = 1 + a0 + a0·a1 + a0·a1·a2 + ...

    acc[0] is the first drafted token's acceptance (fractions in [0, 1]); K = min(num_steps, len(acc)),
    the chain length the server drafts (SGLang --speculative-num-steps). The product stops at the first
    value that is missing, non-finite or outside [0, 1]. None when acc is empty or num_steps < 0.
    Treats positions as independent given acceptance so far: a proxy, not the served accept length.
    """
    if not acc or (num_steps is not None and num_steps < 0):
        return None
    limit = len(acc) if num_steps is None else min(num_steps, len(acc))
    tau, product = 1.0, 1.0
    for value in list(acc)[:limit]:
        if not is_finite(value) or not 0.0 <= value <= 1.0:
            break
        product *= value
        tau += product
    return tau


def lr_floor(steps: Sequence[int], lrs: Sequence[float], *, window: int = 5, floor_fraction: float = 0.05, abs_floor: float = 1e-7) -> dict[str, Any]:
    """LR stuck at its floor: every LR of the recent window <= floor_fraction * the peak seen before the
    window, or <= abs_floor, after having been higher (a warmup from 0 never counts).
    """
    steps, lrs = finite_points(steps, lrs)
    result: dict[str, Any] = {"active": False, "lr": lrs[-1] if lrs else None, "max_lr": max(lrs) if lrs else None, "since_step": None, "warning": None}
    window = max(1, window)
    if len(lrs) <= window:
        return result
    recent, before = lrs[-window:], lrs[:-window]
    peak, top = max(before), max(recent)
    if peak <= top:
        return result
    if top <= floor_fraction * peak or top <= abs_floor:
        since = len(lrs) - window
        while since > 0 and (lrs[since - 1] <= floor_fraction * peak or lrs[since - 1] <= abs_floor):
            since -= 1
        result.update(active=True, since_step=steps[since], warning=(f"LR is {recent[-1]:.3g} (peak {peak:.3g}) since step {steps[since]}: {LR_FLOOR_WARNING}"))
    return result


# ---------------------------------------------------------------- the grokking detector


@dataclass
class GrokConfig:
    """Thresholds of the heuristics (defaults from grokking notes §3.9; all are judgement calls)."""

    train_beta: float = TRAIN_EMA_BETA  # EMA factor for train points (records are per log interval, not per step)
    val_beta: float = VAL_EMA_BETA  # small for sparse val points
    z_threshold: float = 3.0  # |z| of the val slope that counts as significant
    fit_acc: float = 0.99  # memorized: train acc[0] EMA at least this ...
    fit_loss: float = 0.05  # ... or train loss EMA at most this
    acc_gap: float = 0.1  # ... and train acc - val acc above this (δ), or, without acc,
    rel_gap: float = 0.5  # ... relative loss gap (V̂ - L̂) / V̂ above this
    hold_steps: int | None = None  # P: memorization held this many steps; None: until the step doubled
    hold_ratio: float = 2.0
    plateau_abs_eps: float = 0.01  # train plateau: |slope per decade| <= max(abs, rel * level)
    plateau_rel_eps: float = 0.05
    plateau_window: int = 10  # log-spaced points (20 per decade) per plateau window
    min_drop: float = 0.1  # onset also needs V̂ this far (relative) below its level while memorized ...
    persist: int = 2  # ... and the other conditions on this many consecutive evals
    acc_drop: float = 0.1  # regression: val acc[0] EMA this far below its running max
    bump_rel: float = 0.02  # val bump: V̂ this far (relative) above its running min during a plateau
    lr_floor_fraction: float = 0.05
    lr_abs_floor: float = 1e-7
    clip_window: int = 50
    grad_rise: float = 2.0  # grad norm warning: the recent median this many times the median of the window before


@dataclass
class EvalPoint:
    """One validation eval joined with the train side at the same step."""

    step: int
    val: float  # V̂
    train: float | None  # L̂ at the same step
    gap: float | None
    rel_gap: float | None
    train_acc: float | None
    val_acc: float | None
    memorized: bool


class RunView:
    """Records split once by split, with memoized series (compute_signals asks for the same ones repeatedly)."""

    def __init__(self, records: Iterable[dict[str, Any]]):
        self.records = [r for r in records if isinstance(r, dict)]
        self.by_split = {split: [r for r in self.records if r.get("split") == split] for split in ("train", "val")}
        self._cache: dict[tuple[str, str, Any], tuple[list[int], list[float]]] = {}

    def series(self, key: str, split: str = "train", index: int | str | None = None) -> tuple[list[int], list[float]]:
        cache_key = (key, split, index)
        if cache_key not in self._cache:
            self._cache[cache_key] = series(self.by_split.get(split, []), key, split=split, index=index)
        return self._cache[cache_key]

    def positions(self, key: str, split: str) -> list[tuple[list[int], list[float]]]:
        """series(key, split, index=k) for every TTT position k, in one pass."""
        by_k: list[dict[int, float]] = []
        for record in self.by_split.get(split, []):
            values, step = record.get(key), record.get("step")
            if not isinstance(values, list) or not isinstance(step, int):
                continue
            while len(by_k) < len(values):
                by_k.append({})
            for k, value in enumerate(values):
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    by_k[k][step] = float(value)
        return [(sorted(d), [d[s] for s in sorted(d)]) for d in by_k]

    def ema(self, key: str, split: str, beta: float, index: int | None = None) -> tuple[list[int], list[float]]:
        steps, values = self.series(key, split, index)
        return finite_points(steps, debiased_ema(values, beta))


def join_evals(view: RunView, cfg: GrokConfig) -> list[EvalPoint]:
    """Val evals with V̂, L̂ at the same step, gaps and the memorization flag M (§3.9 items 2-3)."""
    val_steps, val_ema = view.ema("loss", "val", cfg.val_beta)
    tr_steps, tr_ema = view.ema("loss", "train", cfg.train_beta)
    tra_steps, tra_ema = view.ema("acc", "train", cfg.train_beta, index=0)
    va_steps, va_ema = view.ema("acc", "val", cfg.val_beta, index=0)
    points = []
    for step, val in zip(val_steps, val_ema):
        train = value_at(tr_steps, tr_ema, step)
        g, rel = gap(val, train)
        train_acc, val_acc = value_at(tra_steps, tra_ema, step), value_at(va_steps, va_ema, step)
        fit = (train_acc is not None and train_acc >= cfg.fit_acc) or (train is not None and train <= cfg.fit_loss)
        if train_acc is not None and val_acc is not None:
            wide = train_acc - val_acc > cfg.acc_gap
        else:
            wide = rel is not None and rel > cfg.rel_gap
        points.append(EvalPoint(step, val, train, g, rel, train_acc, val_acc, bool(fit and wide)))
    return points


def _memorized_before(points: list[EvalPoint], end: int, window_start: int, cfg: GrokConfig) -> tuple[int, float] | None:
    """(start step, baseline) of a memorization run that held >= P steps and is ongoing or ended inside the
    window (evals window_start..end); baseline = lower median of V̂ over the run's evals before the window,
    of which there must be at least a window's worth. None if there is no such run."""
    min_baseline = end + 1 - window_start
    run: list[EvalPoint] = []
    found = None
    for i, point in enumerate(points[: end + 1]):
        if not point.memorized:
            run = []
            continue
        run.append(point)
        start = run[0].step
        needed = cfg.hold_steps if cfg.hold_steps is not None else (cfg.hold_ratio - 1.0) * max(start, 1)
        baseline = [p.val for p in run[: max(0, len(run) - (i + 1 - window_start))]]
        if point.step - start >= needed and i >= window_start and len(baseline) >= min_baseline:
            found = (start, _lower_median(baseline))
    return found


def _lower_median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def detect_onset(points: list[EvalPoint], window: int, cfg: GrokConfig) -> dict[str, Any]:
    """Grokking onset (§3.9 item 5) and regression/ungrokking, scanning the evals in order.

    Onset where, on `persist` consecutive evals: memorization held >= P steps (ongoing or ended inside the
    window), the train EMA is flat against log step, the val slope has z < -3, the gap slope is negative,
    and V̂ is at least min_drop below its median while memorized (the last two guard against noise:
    with ~100 windows a run, z < -3 alone fires on a flat noisy curve).
    Regression: after onset, on `persist` consecutive evals the val slope has z > +3 and the window's median
    V̂ is min_drop above the best window median since the onset; or (any time) val acc[0] fell more than
    acc_drop below its running max.
    """
    onset: dict[str, Any] = {"detected": False, "step": None, "z": None, "memorized_since": None}
    regression: dict[str, Any] = {"detected": False, "step": None, "reason": None}
    window = max(3, window)
    best_acc, best_val, streak, rise_streak = -math.inf, math.inf, 0, 0
    for end, point in enumerate(points):
        if point.val_acc is not None:
            best_acc = max(best_acc, point.val_acc)
            if not regression["detected"] and best_acc - point.val_acc > cfg.acc_drop:
                regression.update(detected=True, step=point.step, reason=(f"val acc[0] fell from {best_acc:.3f} to {point.val_acc:.3f}"))
        if end + 1 < window:
            continue
        part = points[end + 1 - window : end + 1]
        steps = [p.step for p in part]
        val_slope = log_step_slope(steps, [p.val for p in part])
        if val_slope is None or math.isnan(val_slope.z):
            continue
        if onset["detected"]:
            level = _lower_median([p.val for p in points[end + 1 - window : end + 1]])
            best_val = min(best_val, level)
            rising = val_slope.z > cfg.z_threshold and level >= (1.0 + cfg.min_drop) * best_val
            rise_streak = rise_streak + 1 if rising else 0
            if not regression["detected"] and rise_streak >= cfg.persist:
                regression.update(
                    detected=True,
                    step=point.step,
                    reason=(f"val loss rising again after the onset (z=+{val_slope.z:.1f}; window median {level:.3g} vs best {best_val:.3g})"),
                )
            continue
        held = _onset_conditions(points, end, window, val_slope, cfg)
        streak = streak + 1 if held is not None else 0
        if streak >= cfg.persist:
            onset.update(detected=True, step=point.step, z=val_slope.z, memorized_since=held)
    return {"onset": onset, "regression": regression}


def _onset_conditions(points: list[EvalPoint], end: int, window: int, val_slope: Slope, cfg: GrokConfig) -> int | None:
    """The memorization start step when every onset condition holds at eval `end`, else None."""
    if not val_slope.z < -cfg.z_threshold:
        return None
    part = points[end + 1 - window : end + 1]
    steps, train_values = [p.step for p in part], [p.train for p in part if p.train is not None]
    if len(train_values) < len(part):
        return None
    train_slope = log_step_slope(steps, train_values)
    if not is_flat(train_slope, sum(train_values) / window, cfg.plateau_abs_eps, cfg.plateau_rel_eps):
        return None
    gap_slope = log_step_slope(steps, [p.gap if p.gap is not None else math.nan for p in part])
    if gap_slope is None or not gap_slope.slope < 0:
        return None
    memorized = _memorized_before(points, end, end + 1 - window, cfg)
    if memorized is None:
        return None
    since, level = memorized
    return since if points[end].val <= (1.0 - cfg.min_drop) * level else None


# ---------------------------------------------------------------- everything, for the Grokking screen


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _last(values: Sequence[Any]) -> Any:
    return values[-1] if values else None


def _latest_list(records: list[dict[str, Any]], split: str, key: str) -> tuple[int | None, list[float] | None]:
    for record in reversed(records):
        if record.get("split") == split and isinstance(record.get(key), list) and record[key]:
            return record.get("step"), record[key]
    return None, None


def _latest_replayed(records: list[dict[str, Any]], num_steps: int | None) -> float | None:
    """The latest val record's accept length of its replayed chain rounds (`accept_sim`) at num_steps, if it has one."""
    if not num_steps:
        return None
    for record in reversed(records):
        replayed = record.get("accept_sim") if record.get("split") == "val" else None
        if isinstance(replayed, dict):
            value = replayed.get(str(num_steps))
            return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
    return None


def _tokens_past(view: RunView, start_step: int | None) -> int | None:
    steps, tokens = finite_points(*view.series("tokens", "train"))
    if start_step is None or not tokens:
        return None
    at_start = value_at(steps, tokens, start_step)
    return int(tokens[-1] - (at_start if at_start is not None else 0))


def _weight_norms(view: RunView, window: int) -> dict[str, Any]:
    split = "train" if view.series("weight_norm", "train")[0] else "val"
    steps, norms = view.series("weight_norm", split)
    change, lag = relative_change(steps, norms, lag_points=window)
    modules: dict[str, Any] = {}
    names = sorted({name for r in view.records if isinstance(r.get("weight_norm_modules"), dict) for name in r["weight_norm_modules"]})
    for name in names:
        m_steps, m_norms = finite_points(*view.series("weight_norm_modules", split, name))
        if not m_steps:
            m_steps, m_norms = finite_points(*view.series("weight_norm_modules", "val", name))
        m_change, _ = relative_change(m_steps, m_norms, lag_points=window)
        modules[name] = {"latest": _last(m_norms), "relative_change": m_change}
    return {"latest": _last(finite_points(steps, norms)[1]), "relative_change": change, "lag_steps": lag, "modules": modules}


def _per_position(view: RunView, cfg: GrokConfig) -> list[dict[str, Any]]:
    columns = {(key, split): view.positions(key, split) for key in ("ploss", "acc") for split in ("train", "val")}
    depth = max((len(c) for c in columns.values()), default=0)
    rows = []
    for k in range(depth):
        row: dict[str, Any] = {"k": k}
        for (key, split), per_k in columns.items():
            beta = cfg.train_beta if split == "train" else cfg.val_beta
            steps, values = per_k[k] if k < len(per_k) else ([], [])
            row[f"{split}_{key}"] = _last(finite_points(steps, debiased_ema(values, beta))[1])
        row["ploss_gap"] = row["val_ploss"] - row["train_ploss"] if row["val_ploss"] is not None and row["train_ploss"] is not None else None
        rows.append(row)
    return rows


def compute_signals(
    records: Iterable[dict[str, Any]], *, window: int = 8, clip: float = 0.5, num_steps: int | None = None, config: GrokConfig | None = None
) -> dict[str, Any]:
    """All signals of the Grokking screen from cleaned metrics records (backend.metrics.records), as a JSON-able dict.

    window: val evals per slope window (and points per LR-floor / weight-norm window); clip: the run's
    grad-clip threshold; num_steps: served chain length for τ̂ (None: every TTT position).
    """
    cfg = config or GrokConfig()
    view = RunView(records)
    records = view.records
    tr_steps, tr_raw = view.series("loss", "train")
    tr_ema = debiased_ema(tr_raw, cfg.train_beta)
    val_steps, val_raw = view.series("loss", "val")
    val_ema = debiased_ema(val_raw, cfg.val_beta)
    points = join_evals(view, cfg)
    last_point = _last(points)
    recent_val = points[-window:]
    val_slope = log_step_slope([p.step for p in recent_val], [p.val for p in recent_val])
    tr_fin_steps, tr_fin_ema = finite_points(tr_steps, tr_ema)
    span_start = recent_val[0].step if recent_val else None
    tr_window = [(s, v) for s, v in zip(tr_fin_steps, tr_fin_ema) if span_start is None or s >= span_start]
    train_slope = log_step_slope(*log_thin([s for s, _ in tr_window], [v for _, v in tr_window]))
    plateau = detect_plateau(tr_steps, tr_ema, window=cfg.plateau_window, abs_eps=cfg.plateau_abs_eps, rel_eps=cfg.plateau_rel_eps)
    plateau["tokens_past"] = _tokens_past(view, plateau["start_step"])
    detected = detect_onset(points, window, cfg)
    bump = _val_bump(points, plateau["active"], cfg)
    lr_steps, lrs = view.series("lr", "train")
    floor = lr_floor(lr_steps, lrs, window=max(3, window), floor_fraction=cfg.lr_floor_fraction, abs_floor=cfg.lr_abs_floor)
    gn_steps, gns = view.series("grad_norm", "train")
    tau_step, val_acc = _latest_list(records, "val", "acc")
    _, val_accept = _latest_list(records, "val", "acceptance_rate")
    all_steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    latest_train = _latest_record(records, "train")
    signals = {
        "n_records": len(records),
        "n_train": len(tr_steps),
        "n_val": len(val_steps),
        "latest_step": max(all_steps) if all_steps else None,
        "latest": {
            "train_loss": _last(tr_raw),
            "train_loss_ema": _last(tr_fin_ema),
            "val_loss": _last(val_raw),
            "val_loss_ema": _last(finite_points(val_steps, val_ema)[1]),
            "lr": _last(finite_points(lr_steps, lrs)[1]),
            "tokens": latest_train.get("tokens") if latest_train else None,
            "epoch": latest_train.get("epoch") if latest_train else None,
            "train_acc": _latest_list(records, "train", "acc")[1],
            "val_acc": val_acc,
        },
        "gap": last_point.gap if last_point else None,
        "relative_gap": last_point.rel_gap if last_point else None,
        "acc_gap": (last_point.train_acc - last_point.val_acc if last_point and last_point.train_acc is not None and last_point.val_acc is not None else None),
        "gap_step": last_point.step if last_point else None,
        "memorized": bool(last_point and last_point.memorized),
        "val_slope": val_slope.as_dict() if val_slope else None,
        "train_slope": train_slope.as_dict() if train_slope else None,
        "z_val": val_slope.z if val_slope else None,
        "plateau": plateau,
        "plateau_start_step": plateau["start_step"],
        "steps_past_plateau": plateau["steps_past"],
        "tokens_past_plateau": plateau["tokens_past"],
        **detected,
        "onset_step": detected["onset"]["step"],
        "regression_step": detected["regression"]["step"],
        "val_bump": bump,
        "lr_floor": floor,
        "lr_floor_warning": floor["warning"],
        "tau_hat": estimate_tau(val_acc, num_steps),
        "tau_hat_step": tau_step,
        "tau_hat_acceptance": estimate_tau(val_accept, num_steps),
        "accept_replayed": _latest_replayed(records, num_steps),  # validation's chain rounds replayed (trainer's accept_sim)
        "weight_norm": _weight_norms(view, window),
        "grad_norm": {
            "latest": _last(finite_points(gn_steps, gns)[1]),
            "ema": _last(finite_points(gn_steps, debiased_ema(gns, cfg.train_beta))[1]),
            "clip": clip,
            "clip_fraction": clip_fraction(gns, clip, cfg.clip_window),
            **dict(zip(("median", "median_before"), grad_norm_medians(gns, cfg.clip_window))),
        },
        "per_position": _per_position(view, cfg),
    }
    signals["warnings"] = _warnings(signals, records, tr_raw, val_raw, cfg)
    return _jsonable(signals)


def _latest_record(records: list[dict[str, Any]], split: str) -> dict[str, Any] | None:
    return next((r for r in reversed(records) if r.get("split") == split), None)


def _val_bump(points: list[EvalPoint], plateau_active: bool, cfg: GrokConfig) -> dict[str, Any]:
    """§3.9 item 6: V̂_t - min V̂ > 0 during a train plateau (amber, not "stop")."""
    if not points:
        return {"active": False, "amount": None, "min_val": None, "min_step": None}
    best = min(points, key=lambda p: p.val)
    amount = points[-1].val - best.val
    active = plateau_active and amount > cfg.bump_rel * abs(best.val)
    return {"active": bool(active), "amount": amount, "min_val": best.val, "min_step": best.step}


def _warnings(s: dict[str, Any], records: list[dict[str, Any]], tr_raw: list[float], val_raw: list[float], cfg: GrokConfig) -> list[str]:
    out = []
    if records and not val_raw:
        out.append('No validation records yet: the gap, val slope and onset detector need split "val" evals.')
    if tr_raw and not is_finite(tr_raw[-1]):
        out.append(f"The latest train loss is {tr_raw[-1]}: the run has diverged or hit a numerical error.")
    if s["lr_floor"]["warning"]:
        out.append(s["lr_floor"]["warning"])
    if s["regression"]["detected"]:
        out.append(f"Regression at step {s['regression']['step']}: {s['regression']['reason']}.")
    if s["val_bump"]["active"]:
        out.append(
            f"Val loss is {s['val_bump']['amount']:.3g} above its minimum (step {s['val_bump']['min_step']}) "
            "while train loss is flat: a bump that can precede a second descent, not a reason to stop."
        )
    val_slope, train_slope = s["val_slope"], s["train_slope"]
    if val_slope and val_slope["z"] > cfg.z_threshold and train_slope and train_slope["slope"] < 0 and not s["plateau"]["active"]:
        out.append(f"Val loss rising (z=+{val_slope['z']:.1f}) while train loss still falls: overfitting the train set.")
    # A clip that binds on most steps is no warning by itself: AdamW divides the clipped gradient by its own running
    # RMS, so the step size stays the LR's (the tiny profile clips 100% of its steps at 0.5 and learns).
    # A grad norm that keeps rising is the sign of a loss turning unstable, clipped or not.
    grads = s["grad_norm"]
    recent, before = grads.get("median"), grads.get("median_before")
    if recent is not None and before is not None and before > 0 and recent > cfg.grad_rise * before:
        fraction = grads["clip_fraction"]
        clipped = f"; {fraction:.0%} of them above the clip {grads['clip']}" if fraction else ""
        out.append(
            f"Grad norm rising: median {recent:.3g} over the last {cfg.clip_window} records vs {before:.3g} "
            f"before{clipped}: the loss may be turning unstable (LR too high?)."
        )
    for split in ("train", "val"):
        _, accs = _latest_list(records, split, "acc")
        if accs and any(is_finite(a) and not 0.0 <= a <= 1.0 for a in accs):
            out.append(f"{split} acc values are outside [0, 1] (percentages?): τ̂ uses fractions.")
    return out
