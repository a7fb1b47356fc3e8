"""Grokking signals on hand-computed values and on synthetic runs with a known plateau and a known onset."""

import json
import math
import random

import pytest

from backend.metrics.signals import (
    LR_FLOOR_WARNING,
    GrokConfig,
    clip_fraction,
    compute_signals,
    detect_plateau,
    estimate_tau,
    log_step_slope,
    lr_floor,
    ols_slope,
    relative_change,
)
from backend.smoothing import debiased_ema

PLATEAU_STEP = 1000  # train loss reaches its floor here
ONSET_STEP = 20000  # val loss starts its second descent here (linear in log10 step over 0.2 decades)
TOLERANCE = 10**0.1  # the detector must fire within 0.1 decade after the onset


def synthetic_run(seed=0, grok=True, end=60000, noise=0.03, schedule="constant", regress_at=None):
    """Train loss falls (quadratically in log step) to 0.01 at PLATEAU_STEP and stays; val loss stays ~4
    (memorized: train acc 0.999, val acc 0.2) and, when grok, drops to 0.5 from ONSET_STEP. Noise is
    multiplicative Gaussian. regress_at: val loss climbs back after that step (ungrokking)."""
    rng = random.Random(seed)
    records, tokens = [], 0
    for step in range(10, end + 1, 10):
        f = max(0.0, 1 - math.log10(step) / math.log10(PLATEAU_STEP))
        tokens += 10 * 4096
        lr = 1e-4 if schedule == "constant" else 0.5e-4 * (1 + math.cos(math.pi * step / end))
        records.append(
            {
                "step": step,
                "split": "train",
                "loss": (0.01 + 5 * f * f) * (1 + noise * rng.gauss(0, 1)),
                "acc": [min(0.999, 1 - 0.99 * f)],
                "lr": lr,
                "tokens": tokens,
                "grad_norm": 0.3 + 0.4 * rng.random(),
            }
        )
        if step % 500:
            continue
        val, val_acc = (6 - 2 * step / 1000, 0.2) if step < 1000 else (4.0, 0.2)
        if grok and step >= ONSET_STEP:
            frac = min(1.0, math.log10(step / ONSET_STEP) / 0.2)
            val, val_acc = 4.0 - 3.5 * frac, 0.2 + 0.75 * frac
        if regress_at and step >= regress_at:
            frac = min(1.0, math.log10(step / regress_at) / 0.1)
            val, val_acc = 0.5 + 3.0 * frac, 0.95 - 0.6 * frac
        records.append({"step": step, "split": "val", "loss": val * (1 + noise * rng.gauss(0, 1)), "acc": [val_acc]})
    return records


# ---------------------------------------------------------------- hand-computed values


def test_debiased_ema_matches_hand_computation():
    # beta 0.5: m1 = 0.5 -> 0.5/0.5 = 1; m2 = 0.25 + 1 = 1.25 -> /0.75; m3 = 0.625 + 1.5 = 2.125 -> /0.875
    assert debiased_ema([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 1.25 / 0.75, 2.125 / 0.875])
    # non-finite points pass through and do not count: the 2 is the second finite point
    out = debiased_ema([1.0, math.nan, 2.0, math.inf], 0.5)
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == pytest.approx(1.25 / 0.75) and out[3] == math.inf
    assert debiased_ema([], 0.9) == [] and debiased_ema([7.0], 0.9) == [7.0]
    assert debiased_ema([2.0, 2.0, 2.0], 0.9) == [2.0, 2.0, 2.0]
    assert debiased_ema([1.0, 3.0], 0.0) == [1.0, 3.0]
    smoothed = debiased_ema([0.0] * 10 + [10.0], 0.9)  # the console's curves: a jump is followed, not copied
    assert 0.0 < smoothed[-1] < 10.0
    with pytest.raises(ValueError, match=r"EMA factor must be in \[0, 1\), got 1.0"):
        debiased_ema([1.0, 2.0], 1.0)


def test_ols_slope_on_exact_lines_and_hand_computed_noise():
    exact = log_step_slope([10, 100, 1000, 10000], [3.0, 2.5, 2.0, 1.5])  # -0.5 per decade
    assert exact.slope == pytest.approx(-0.5) and exact.stderr == 0.0 and exact.z == -math.inf and exact.n == 4
    flat = ols_slope([0, 1, 2], [1.0, 1.0, 1.0])
    assert flat.slope == 0.0 and flat.z == 0.0
    # x̄=1.5 ȳ=1.55 Sxy=5.2 Sxx=5 -> s=1.04; residuals .01 .07 -.17 .09 -> SSR=.042; SE=sqrt(.042/2/5)
    fit = ols_slope([0, 1, 2, 3], [0.0, 1.1, 1.9, 3.2])
    assert fit.slope == pytest.approx(1.04)
    assert fit.stderr == pytest.approx(math.sqrt(0.0042))
    assert fit.z == pytest.approx(1.04 / math.sqrt(0.0042))


def test_ols_slope_degenerate_inputs():
    assert ols_slope([], []) is None and ols_slope([1.0], [2.0]) is None
    assert ols_slope([1.0, 1.0], [1.0, 2.0]) is None  # no spread in x
    two = ols_slope([0.0, 1.0], [0.0, 2.0])
    assert two.slope == 2.0 and math.isnan(two.z)
    assert ols_slope([0, 1, 2, 3], [0.0, math.nan, 2.0, math.inf]).n == 2
    assert log_step_slope([0, -5], [1.0, 2.0]) is None


def test_estimate_tau_matches_hand_computation():
    acc = [0.8, 0.5, 0.25]
    assert estimate_tau(acc) == pytest.approx(1 + 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.25)  # 2.3
    assert estimate_tau(acc, num_steps=2) == pytest.approx(2.2)
    assert estimate_tau(acc, num_steps=0) == 1.0
    assert estimate_tau(acc, num_steps=10) == pytest.approx(2.3)
    assert estimate_tau([0.8, math.nan, 0.5]) == pytest.approx(1.8)
    assert estimate_tau([74.5, 50.0]) == 1.0  # percentages are not fractions: nothing multiplies
    assert estimate_tau([]) is None and estimate_tau(None) is None and estimate_tau(acc, num_steps=-1) is None
    assert estimate_tau([1.0] * 7) == 8.0


def test_clip_fraction_and_relative_change():
    assert clip_fraction([0.1, 0.6, math.nan, 0.7, 0.4], clip=0.5) == pytest.approx(2 / 4)
    assert clip_fraction([0.1, 0.6, 0.7], clip=0.5, window=2) == 1.0
    assert clip_fraction([], clip=0.5) is None
    change, lag = relative_change([100, 200, 300], [10.0, 9.0, 8.0], lag_steps=200)
    assert change == pytest.approx(-0.2) and lag == 200
    change, lag = relative_change([100, 200, 300], [10.0, 9.0, 8.0], lag_points=1)
    assert change == pytest.approx(8 / 9 - 1) and lag == 100
    assert relative_change([5], [1.0]) == (None, None)
    assert relative_change([1, 2], [0.0, 1.0]) == (None, None)


# ---------------------------------------------------------------- plateau, LR floor


def test_plateau_starts_near_the_known_step_and_reports_distance_in_steps_and_tokens():
    signals = compute_signals(synthetic_run(grok=False))
    start = signals["plateau_start_step"]
    assert PLATEAU_STEP * 0.8 <= start <= PLATEAU_STEP * 1.3, start
    assert signals["steps_past_plateau"] == 60000 - start
    assert signals["tokens_past_plateau"] == (60000 - start) * 4096


def test_no_plateau_while_loss_still_falls():
    steps = list(range(10, 20000, 10))
    falling = [5.0 - math.log10(s) for s in steps]  # -1 per decade
    assert detect_plateau(steps, falling)["active"] is False
    assert detect_plateau([], [])["active"] is False and detect_plateau([5], [1.0])["start_step"] is None


def test_lr_floor_warns_on_cosine_decay_and_not_on_constant_or_warmup():
    cosine = compute_signals(synthetic_run(grok=False, end=20000, schedule="cosine"))
    assert cosine["lr_floor"]["active"] and LR_FLOOR_WARNING in cosine["lr_floor_warning"]
    assert any(LR_FLOOR_WARNING in w for w in cosine["warnings"])
    constant = compute_signals(synthetic_run(grok=False, end=20000))
    assert constant["lr_floor_warning"] is None and not any(LR_FLOOR_WARNING in w for w in constant["warnings"])
    steps = list(range(100))
    warmup = [1e-9 * s for s in steps]  # all below 1e-7 but rising: not a floor
    assert lr_floor(steps, warmup)["active"] is False
    mid_cosine = [1e-4 * 0.5 * (1 + math.cos(math.pi * s / 200)) for s in steps]  # half way down
    assert lr_floor(steps, mid_cosine)["active"] is False
    assert lr_floor([], [])["active"] is False and lr_floor([1], [math.nan])["active"] is False


# ---------------------------------------------------------------- onset detector


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_onset_fires_within_tolerance_of_the_known_step(seed):
    signals = compute_signals(synthetic_run(seed))
    onset = signals["onset"]
    assert onset["detected"], signals["warnings"]
    assert ONSET_STEP <= onset["step"] <= ONSET_STEP * TOLERANCE, onset
    assert onset["z"] < -3 and onset["memorized_since"] <= 1500
    assert signals["onset_step"] == onset["step"] and not signals["regression"]["detected"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_onset_does_not_fire_before_the_drop(seed):
    before = [r for r in synthetic_run(seed) if r["step"] < ONSET_STEP]
    signals = compute_signals(before)
    assert not signals["onset"]["detected"], signals["onset"]
    assert signals["memorized"] and signals["plateau"]["active"]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_no_grokking_curve_gives_no_onset(seed):
    signals = compute_signals(synthetic_run(seed, grok=False))
    assert not signals["onset"]["detected"] and signals["onset_step"] is None


def test_onset_needs_memorization():
    # same curves, but train accuracy never fits and the relative loss gap stays small: no memorization
    records = synthetic_run(0)
    for record in records:
        if record["split"] == "train":
            record["acc"] = [0.5]
            record["loss"] += 3.9
    signals = compute_signals(records)
    assert not signals["memorized"] and not signals["onset"]["detected"]


def test_regression_after_onset_is_flagged_after_the_onset():
    signals = compute_signals(synthetic_run(0, end=100000, regress_at=60000))
    assert signals["onset"]["detected"]
    regression = signals["regression"]
    assert regression["detected"] and 60000 <= regression["step"] <= 60000 * TOLERANCE, regression
    assert any("Regression" in w for w in signals["warnings"])


def test_val_bump_during_plateau_is_amber_not_stop():
    records = synthetic_run(0, grok=False, noise=0.0)
    for record in records:
        if record["split"] == "val" and record["step"] > 30000:
            record["loss"] = 4.0 * (1 + 0.2 * math.log10(record["step"] / 30000))
    signals = compute_signals(records)
    assert signals["val_bump"]["active"] and signals["val_bump"]["amount"] > 0
    assert any("bump" in w and "not a reason to stop" in w for w in signals["warnings"])


def test_overfitting_warning_when_val_rises_while_train_falls():
    records = []
    for step in range(100, 5001, 100):
        records.append({"step": step, "split": "train", "loss": 4.0 - math.log10(step)})
        records.append({"step": step, "split": "val", "loss": 2.0 + 0.5 * math.log10(step)})
    signals = compute_signals(records)
    assert signals["z_val"] is None or signals["val_slope"]["slope"] > 0
    assert any("overfitting" in w for w in signals["warnings"])


# ---------------------------------------------------------------- the dict the agent serves


def test_compute_signals_reports_norms_grads_tau_and_positions():
    records = synthetic_run(0, end=5000)
    for i, record in enumerate(r for r in records if r["split"] == "train"):
        record["weight_norm"] = 100.0 - 0.01 * i
        record["weight_norm_modules"] = {"fc": 50.0, "lm_head": 20.0 + 0.01 * i}
        record["ploss"] = [record["loss"], record["loss"] * 1.5]
    for record in records:
        if record["split"] == "val":
            record["acc"] = [0.8, 0.5, 0.25]
            record["ploss"] = [record["loss"], record["loss"] * 2]
    signals = compute_signals(records, window=8, clip=0.5, num_steps=2)
    json.dumps(signals, allow_nan=False)
    assert signals["tau_hat"] == pytest.approx(2.2) and signals["tau_hat_step"] == 5000
    assert signals["accept_replayed"] is None  # no val line carries replayed rounds
    next(r for r in reversed(records) if r["split"] == "val")["accept_sim"] = {"2": 1.93, "7": 2.4}
    assert compute_signals(records, window=8, clip=0.5, num_steps=2)["accept_replayed"] == pytest.approx(1.93)
    assert compute_signals(records, window=8, clip=0.5, num_steps=3)["accept_replayed"] is None
    assert signals["weight_norm"]["latest"] == pytest.approx(100.0 - 0.01 * 499)
    assert signals["weight_norm"]["relative_change"] < 0 and signals["weight_norm"]["lag_steps"] == 80
    assert signals["weight_norm"]["modules"]["fc"]["relative_change"] == 0.0
    assert signals["weight_norm"]["modules"]["lm_head"]["relative_change"] > 0
    grad = signals["grad_norm"]
    assert 0.3 <= grad["latest"] <= 0.7 and 0.3 <= grad["ema"] <= 0.7 and 0.0 < grad["clip_fraction"] < 1.0
    assert [row["k"] for row in signals["per_position"]] == [0, 1, 2]
    assert signals["per_position"][1]["ploss_gap"] is not None
    assert signals["latest"]["tokens"] == 5000 * 4096 and signals["latest"]["lr"] == 1e-4
    assert signals["gap"] == pytest.approx(signals["latest"]["val_loss_ema"] - signals["latest"]["train_loss_ema"], rel=0.05)


@pytest.mark.parametrize(
    "records",
    [
        [],
        [{"step": 0, "split": "train"}],
        [{"step": 1, "split": "val", "loss": 2.0, "acc": [0.5]}],
        [{"step": 1, "split": "train", "loss": math.nan, "acc": [math.inf], "lr": math.inf, "grad_norm": math.nan}],
        [
            {
                "step": s,
                "split": "train" if s % 3 else "val",
                "loss": [1.0, math.nan, math.inf, -math.inf, 0.0][s % 5],
                "acc": [[0.5, math.nan][s % 2]],
                "lr": [0.0, 1e-4, math.nan][s % 3],
                "weight_norm": [0.0, 1.0][s % 2],
                "weight_norm_modules": {"fc": [0.0, math.nan][s % 2]},
                "tokens": s * 10,
            }
            for s in range(200)
        ],
    ],
)
def test_compute_signals_never_crashes_and_is_strict_json(records):
    signals = compute_signals(records)
    json.dumps(signals, allow_nan=False)
    assert isinstance(signals["warnings"], list)


def test_nan_loss_and_missing_val_are_warned():
    signals = compute_signals([{"step": 1, "split": "train", "loss": 1.0}, {"step": 2, "split": "train", "loss": math.nan}])
    assert any("diverged" in w for w in signals["warnings"])
    assert any("No validation records" in w for w in signals["warnings"])


def test_config_thresholds_are_used():
    records = synthetic_run(0)
    strict = compute_signals(records, config=GrokConfig(z_threshold=1e9))
    assert not strict["onset"]["detected"]
