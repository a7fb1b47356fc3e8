"""Acceptance math shared by the canary and the benchmark: tau-hat, drafts-accepted histograms, per-position rates.

Accept length = sum(completion_tokens) / sum(spec_verify_ct) over the requests (the prefill token is not
a verify step, so zero accepted drafts gives 1 + requests/sum(verify_ct), not exactly 1.0).
tau-hat = 1 + sum_{k=1..K} prod_{j<=k} acc_j from the per-TTT-step validation accuracy the checkpoint recorded,
truncated to the K draft steps the server runs: the accept length training predicts for greedy chain decoding.

Per-position acceptance comes from SGLang's spec_correct_drafts_histogram (entry i = verify steps that accepted
exactly i drafts): served acceptance at draft position k (0-based, like val acc_k) is the fraction of verify steps
that accepted at least k+1 drafts, and the conditional rate is that fraction given k were accepted. The conditional
rate is what validation acc_k predicts (tau-hat treats acc_k that way), so the first position whose conditional
rate falls below acc_k by more than the tolerance (BREAK_ABS_TOL, or two standard errors when larger: binomial over
the verify steps, or over the requests when their steps move together) is where serving breaks. See
docs/serving.md, "Per-position acceptance".
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Sequence

from backend.commands import ACCEPTANCE_BREAK as BREAK, ACCEPTANCE_SHORTFALL as SHORTFALL, is_acceptance_shortfall
from backend.repetition import repeated_positions
from backend.train.loss import rounds_accept_length

BOOTSTRAP_DRAWS = 2000  # resamples behind a bootstrap interval over requests

# Per-position break: served conditional acceptance at position k below val acc_k - max(BREAK_ABS_TOL, BREAK_Z x SE),
# SE = sqrt(acc_k (1 - acc_k) / n_k) over the n_k verify steps that reached position k. 0.10: a uniform shortfall of
# 0.10 per position at the calibrated draft's acc 0.825 (K = 5) gives 0.79 x tau-hat, the low end of what healthy
# serving reached on the calibration runs (0.80-0.98 x tau-hat, docs/serving.md); a larger shortfall at one position is
# more than healthy runs showed. BREAK_Z = 2: one-sided 2.3 % false alarms per position from sampling noise alone.
# The verify steps of one request are not independent draws (a repetitive answer accepts at every step, a creative one
# seldom), so where requests' own histograms are known the standard error is also taken over requests (cluster-robust,
# request_se) and the larger one counts: on 2026-12-05 a healthy SmolLM2 draft's canary, 8 prompts x 64 tokens,
# served 0.53 at position 2 against 0.78 replayed, a "break" that 100 prompts x 128 tokens on the same server (0.71)
# did not show.
BREAK_ABS_TOL = 0.10
BREAK_Z = 2.0
# Fewer verify steps than this reached a position: its served rate is not judged (SE would exceed ~0.1 anyway).
MIN_STEPS_AT_POSITION = 20
# A first break is a shortfall, not a break, when position 0 keeps at least this share of its predicted rate (broken
# there or not) and no later position falls further below its prediction scaled by that share (the canary's 0.6 x tau-hat:
# below it acceptance collapses). Every position short by a like fraction is what prompts unlike validation's give
# (held-out first turns, round 15 in docs/real-model.md); a feed or export defect collapses or breaks at one position.
SHORTFALL_MIN_RATIO = 0.6
POOLED_LABEL = "pooled over verify steps (SGLang, vLLM: sum completion_tokens / sum verify_ct)"
MEAN_OF_MEANS_LABEL = "mean of per-request means (SpecForge benchmark)"
HISTOGRAM_KEY = "spec_correct_drafts_histogram"
LEGACY_HISTOGRAM_KEY = "spec_accept_histogram"  # SGLang's older name, still sent beside the new one


def _console_block(draft_dir: Any) -> dict[str, Any]:
    """The eagle3_console block of a checkpoint's config.json; {} when absent or unreadable."""
    if not isinstance(draft_dir, (str, Path)) or not str(draft_dir):
        return {}
    try:
        config = json.loads((Path(draft_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    meta = config.get("eagle3_console") if isinstance(config, dict) else None
    return meta if isinstance(meta, dict) else {}


def checkpoint_val_data(draft_dir: Any) -> dict[str, Any] | None:
    """Where a checkpoint's validation conversations are (`val_data`: conversations path, chat template name); None if unrecorded."""
    val_data = _console_block(draft_dir).get("val_data")
    return val_data if isinstance(val_data, dict) and isinstance(val_data.get("conversations"), str) else None


def checkpoint_validation(draft_dir: Any) -> tuple[list[float] | None, dict[str, Any] | None]:
    """(val_acc, val_rounds) a checkpoint recorded in its config.json (eagle3_console), each None when absent or unreadable."""
    meta = _console_block(draft_dir)
    acc, rounds = meta.get("val_acc"), meta.get("val_rounds")
    if not (isinstance(acc, list) and acc and all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in acc)):
        acc = None
    return ([float(a) for a in acc] if acc else None), (rounds if isinstance(rounds, dict) else None)


def tau_hat(val_acc: list[float] | None, num_steps: int) -> float | None:
    """Expected accept length of a greedy chain of num_steps drafts, from per-step validation accuracies."""
    if not val_acc:
        return None
    total, running = 1.0, 1.0
    for acc in list(val_acc)[:num_steps]:
        running *= max(0.0, min(1.0, float(acc)))
        total += running
    return total


# --------------------------------------------------------------------------- per-position acceptance (pure)


def histogram_from_meta(meta: dict[str, Any]) -> tuple[list[int] | None, str | None]:
    """(histogram, note) from one request's meta_info; None with a note when absent or not what it claims to be.

    Checked against the counts sent beside it: the entries must sum to spec_verify_ct and, when
    spec_num_correct_drafts (or the older spec_accepted_drafts) is present, sum(i x h[i]) must equal it. A histogram
    that fails is dropped (with a note) rather than trusted: older servers may index it differently.
    """
    key = HISTOGRAM_KEY if HISTOGRAM_KEY in meta else LEGACY_HISTOGRAM_KEY if LEGACY_HISTOGRAM_KEY in meta else None
    if key is None:
        return None, f"the server reports no {HISTOGRAM_KEY} (SGLang before 0.5.14, or another engine)"
    raw = meta.get(key)
    if not isinstance(raw, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in raw):
        return None, f"{key} is not a list of non-negative counts: {str(raw)[:60]}"
    verify = meta.get("spec_verify_ct")
    if isinstance(verify, int) and sum(raw) != verify:
        return None, f"{key} sums to {sum(raw)} verify steps but spec_verify_ct is {verify}: not trusted"
    correct = meta.get("spec_num_correct_drafts", meta.get("spec_accepted_drafts"))
    if isinstance(correct, int) and sum(i * v for i, v in enumerate(raw)) != correct:
        return None, f"{key} counts {sum(i * v for i, v in enumerate(raw))} accepted drafts but the server reports {correct}: not trusted"
    return list(raw), None


def merge_histograms(histograms: list[list[int]]) -> list[int]:
    """Element-wise sum (histograms grow as needed, so lengths differ): pooled over every verify step."""
    merged = [0] * max((len(h) for h in histograms), default=0)
    for histogram in histograms:
        for accepted, count in enumerate(histogram):
            merged[accepted] += count
    return merged


def per_position_acceptance(histogram: list[int], num_steps: int | None = None, requests: Sequence[list[int]] = ()) -> list[dict[str, Any]]:
    """Served acceptance per draft position k = 0..K-1 from a histogram of drafts accepted per verify step.

    reached: fraction of verify steps that accepted at least k+1 drafts (position k accepted);
    conditional: reached_k / reached_{k-1} (reached_{-1} = 1), the rate at position k given k drafts were accepted,
    None when no step got that far; steps_at_position: verify steps that accepted at least k (the conditional's n).
    1 + sum(reached) is the accept length per verify step (prefill token excluded). With `requests` (each request's
    own histogram, `histogram` their sum) each row also has request_se: the conditional's standard error over them.
    """
    total = sum(histogram)
    if total <= 0:
        return []
    positions = num_steps if num_steps is not None else len(histogram) - 1
    rows = []
    at_least = total  # steps that accepted >= k drafts
    for k in range(max(positions, 0)):
        accepted = sum(histogram[k + 1 :])  # steps that accepted >= k+1
        row: dict[str, Any] = {
            "position": k,
            "reached": accepted / total,
            "conditional": accepted / at_least if at_least else None,
            "steps_at_position": at_least,
            "steps_accepted": accepted,
        }
        if len(requests) > 1:
            row["request_se"] = request_standard_error([(sum(h[k:]), sum(h[k + 1 :])) for h in requests])
        rows.append(row)
        at_least = accepted
    return rows


def request_standard_error(pairs: Sequence[tuple[int, int]]) -> float | None:
    """The standard error of sum(accepted) / sum(steps) over requests' (steps, accepted) at one position, with the
    requests as the independent units (the cluster-robust variance of a ratio estimator); None for fewer than 2
    requests or no step."""
    steps = sum(n for n, _ in pairs)
    if len(pairs) < 2 or steps <= 0:
        return None
    rate = sum(a for _, a in pairs) / steps
    spread = sum((a - rate * n) ** 2 for n, a in pairs)
    return (len(pairs) / (len(pairs) - 1) * spread) ** 0.5 / steps


def break_tolerance(predicted: float, steps_at_position: int, request_se: float | None = None) -> float:
    """How far below val acc_k the served conditional rate may fall before it counts as a break: BREAK_ABS_TOL, or
    BREAK_Z standard errors when larger (binomial over the steps; over the requests where request_se is known)."""
    p = max(0.0, min(1.0, predicted))
    spread = BREAK_Z * (p * (1.0 - p) / steps_at_position) ** 0.5 if steps_at_position > 0 else 1.0
    return max(BREAK_ABS_TOL, spread, BREAK_Z * request_se if request_se is not None else 0.0)


LOOP_WARNING_SHARE = 0.2  # a bench level whose answers repeat this share of their words says so under its numbers


def repeated_word_share(texts: Sequence[str]) -> float | None:
    """The share of the answers' words that repeat an earlier 8-word run of their own answer (None without words)."""
    flags = [flag for text in texts for flag in repeated_positions(text.split())]
    return sum(flags) / len(flags) if flags else None


REPLAYED = "replayed"  # a row's prediction: validation's chain rounds replayed (the trainer's val_rounds)
VAL_ACC = "val_acc"  # a row's prediction: val acc_k (what tau-hat assumes)


def replayed_rounds(val_rounds: Any, num_steps: int | None) -> list[int] | None:
    """The histogram of chain rounds validation replayed at num_steps (a checkpoint's val_rounds), or None.

    Replayed rounds start where serving starts them (after a rejection as often as serving does), so their rate
    at position k is the served rate to expect; val acc_k is the rate over every position, which is higher."""
    if not isinstance(val_rounds, dict) or not num_steps:
        return None
    histogram = val_rounds.get(str(num_steps))
    if not isinstance(histogram, list) or len(histogram) != num_steps + 1 or sum(histogram) <= 0:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in histogram):
        return None
    return list(histogram)


def compare_with_validation(
    per_position: list[dict[str, Any]], val_acc: list[float] | None, replay: list[int] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Rows with predicted and predicted_reached added, and the first break or None.

    predicted is the replayed rounds' conditional rate at k when `replay` (replayed_rounds) has it, else val acc_k
    (predicted_reached: prod acc_j, j <= k); `basis` says which, val_acc keeps acc_k beside it."""
    replayed = {row["position"]: row for row in per_position_acceptance(replay, len(replay) - 1)} if replay else {}
    rows, first = [], None
    running = 1.0
    for row in per_position:
        k = row["position"]
        out = dict(row)
        acc = float(val_acc[k]) if val_acc and k < len(val_acc) else None
        expected = replayed.get(k)
        if expected is not None and expected["conditional"] is not None:
            predicted, basis = float(expected["conditional"]), REPLAYED
            running = float(expected["reached"])
        elif acc is not None:
            predicted, basis = acc, VAL_ACC
            running *= max(0.0, min(1.0, acc))
        else:
            out.update(predicted=None, predicted_reached=None, tolerance=None, judged=False, broken=False, val_acc=None, basis=None)
            rows.append(out)
            continue
        n = row["steps_at_position"]
        tol = break_tolerance(predicted, n, row.get("request_se"))
        judged = n >= MIN_STEPS_AT_POSITION and row["conditional"] is not None
        broken = bool(judged and row["conditional"] < predicted - tol)
        out.update(predicted=predicted, predicted_reached=running, tolerance=tol, judged=judged, broken=broken, val_acc=acc, basis=basis)
        rows.append(out)
        if broken and first is None:
            first = _first_break(out)
    return rows, _shortfall_or_break(rows, first)


def _shortfall_or_break(rows: list[dict[str, Any]], first: dict[str, Any] | None) -> dict[str, Any] | None:
    """A first break stays one unless position 0 is short by a share (>= SHORTFALL_MIN_RATIO) that every later
    position keeps: then it is a shortfall, named at position 0. Position 0 may be within its own tolerance (round 16's
    HumanEval: 0.65 of 0.73 at 0, 0.63 of 0.77 at 2, a flat 0.81-0.90 of the prediction everywhere)."""
    if first is None or not rows or not rows[0].get("judged") or not rows[0].get("predicted"):
        return first
    head = rows[0]
    ratio = head["conditional"] / head["predicted"]
    if not SHORTFALL_MIN_RATIO <= ratio < 1.0:
        return first
    away = _breaks_away(rows, ratio)
    if away is not None:
        return _first_break(away)
    return {**_first_break(head), "kind": SHORTFALL, "ratio": ratio}


def _first_break(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "position": row["position"],
        "kind": BREAK,
        "served": row["conditional"],
        "predicted": row["predicted"],
        "basis": row["basis"],
        "tolerance": row["tolerance"],
        "served_reached": row["reached"],
        "predicted_reached": row["predicted_reached"],
        "steps_at_position": row["steps_at_position"],
    }


def _breaks_away(rows: list[dict[str, Any]], ratio: float) -> dict[str, Any] | None:
    """The first judged position past 0 whose served rate falls below its prediction scaled by position 0's ratio by
    more than the tolerance: where serving breaks when every position is short (None: a like fraction everywhere)."""
    for row in rows[1:]:
        if row.get("judged") and row.get("predicted") is not None:
            scaled = row["predicted"] * ratio
            if row["conditional"] < scaled - break_tolerance(scaled, row["steps_at_position"], row.get("request_se")):
                return row
    return None


def break_line(first: dict[str, Any] | None, rows: list[dict[str, Any]]) -> str:
    """One sentence: where served acceptance breaks, or that it holds (and up to where it could be judged)."""
    if first is not None:
        source = "validation's chain rounds replayed" if first.get("basis") == REPLAYED else f"val acc_{first['position']}"
        if is_acceptance_shortfall(first):
            return (
                f"served acceptance is below validation's at every position by a like fraction ({first['served']:.2f} served vs "
                f"{first['predicted']:.2f} predicted at position 0, {source}; no later position breaks away from it): these "
                "prompts are harder for the draft than validation's conversations (under ignore-eos the text after the end of "
                "turn counts too), or every position's features are off "
                "(a broken feed or export collapses acceptance: the canary)"
            )
        return (
            f"served acceptance breaks at position {first['position']}: {first['served']:.2f} served vs "
            f"{first['predicted']:.2f} predicted ({source}; tolerance {first['tolerance']:.2f}, "
            f"{first['steps_at_position']} verify steps reached it)"
        )
    judged = [r["position"] for r in rows if r.get("judged")]
    if not any(r.get("predicted") is not None for r in rows):
        return "no validation accuracy recorded: served acceptance per position shown without a prediction"
    if not judged:
        return f"too few verify steps reached any position to judge (each needs {MIN_STEPS_AT_POSITION})"
    replayed = " (its chain rounds replayed)" if _replayed(rows) else ""
    return f"no break: served acceptance within tolerance of validation{replayed} at positions 0-{max(judged)}"


def pooled_accept_length(pairs: Sequence[tuple[int, int]]) -> float:
    """SGLang's accept length over requests' (completion_tokens, verify_ct): all tokens over all verify steps."""
    return sum(t for t, _ in pairs) / max(1, sum(v for _, v in pairs))


def bootstrap_interval(items: Sequence[Any], statistic: Callable[[list[Any]], float | None], rng: random.Random, size: int | None = None) -> list[float]:
    """The 2.5th and 97.5th percentiles of `statistic` over BOOTSTRAP_DRAWS resamples of the requests: with
    replacement, as many as there are (size None: the bootstrap interval), or subsets of `size` without replacement
    (how far a bench of that many prompts may land from the whole set's number)."""
    draws = []
    for _ in range(BOOTSTRAP_DRAWS):
        sample = [rng.choice(items) for _ in items] if size is None else rng.sample(list(items), size)
        value = statistic(sample)
        if value is not None:
            draws.append(value)
    draws.sort()
    return [draws[int(0.025 * len(draws))], draws[int(0.975 * len(draws)) - 1]] if draws else []


def paired_pooled_difference(sample: Sequence[tuple[tuple[int, int], tuple[int, int]]]) -> float:
    """Pooled accept length of the second of each request's (completion_tokens, verify_ct) pairs less the first's: the
    statistic a paired bootstrap over requests resamples when two drafts or settings decoded the same prompts."""
    return pooled_accept_length([other for _, other in sample]) - pooled_accept_length([base for base, _ in sample])


def mean_of_request_means(pairs: list[tuple[int, int]]) -> float | None:
    """SpecForge's benchmark: the mean over requests of completion_tokens / verify_ct (requests without a verify step left out)."""
    means = [completion / verify for completion, verify in pairs if verify > 0]
    return sum(means) / len(means) if means else None


def acceptance_report(
    requests: list[tuple[int, int, list[int] | None]],
    num_steps: int | None,
    val_acc: list[float] | None = None,
    histogram_notes: Sequence[str] = (),
    val_rounds: Any = None,
) -> dict[str, Any]:
    """Both accept-length definitions, served acceptance per position, and the first break against validation
    (its replayed chain rounds when the checkpoint recorded val_rounds for num_steps, else val acc_k).

    requests: (completion_tokens, verify_ct, histogram or None) per finished request. Requests without a histogram
    degrade the per-position part to nothing, with a note; the pooled number is always there when verify steps ran.
    """
    completion = sum(c for c, _, _ in requests)
    verify = sum(v for _, v, _ in requests)
    replay = replayed_rounds(val_rounds, num_steps)
    notes = list(dict.fromkeys(n for n in histogram_notes if n))
    histograms = [h for _, v, h in requests if h is not None and v > 0]
    missing = sum(1 for _, v, h in requests if h is None and v > 0)
    per_position: list[dict[str, Any]] = []
    first = None
    histogram = None
    if missing:
        notes.append(
            f"{missing} of {missing + len(histograms)} requests came without a usable histogram: "
            "per-position acceptance not computed, pooled accept length only"
        )
    elif histograms:
        histogram = merge_histograms(histograms)
        per_position, first = compare_with_validation(per_position_acceptance(histogram, num_steps, histograms), val_acc, replay)
    report: dict[str, Any] = {
        "pooled": completion / verify if verify else None,
        "pooled_label": POOLED_LABEL,
        "mean_of_request_means": mean_of_request_means([(c, v) for c, v, _ in requests]),
        "mean_of_request_means_label": MEAN_OF_MEANS_LABEL,
        "requests": len(requests),
        "sum_verify_ct": verify,
        "histogram": histogram,
        "per_position": per_position,
        "val_acc": list(val_acc) if val_acc else None,
        "tau_hat": tau_hat(val_acc, num_steps or 0) if val_acc and num_steps else None,
        "val_rounds": replay,
        "accept_replayed": rounds_accept_length(replay),
        "break": first,
        "break_line": break_line(first, per_position) if per_position else None,
        "prediction_label": prediction_label(per_position),
        "tolerance": {"abs": BREAK_ABS_TOL, "z": BREAK_Z, "min_steps": MIN_STEPS_AT_POSITION},
        "notes": notes,
    }
    return report


def acceptance_lines(report: dict[str, Any]) -> list[str]:
    """The report as labelled text lines (canary output, benchmark table)."""
    lines = [
        f"accept length {_num(report.get('pooled'))}  {report.get('pooled_label', POOLED_LABEL)}",
        f"accept length {_num(report.get('mean_of_request_means'))}  {report.get('mean_of_request_means_label', MEAN_OF_MEANS_LABEL)}",
    ]
    if report.get("accept_replayed") is not None:
        lines.append(
            f"accept length {_num(report['accept_replayed'])}  predicted: validation's chain rounds replayed on its own prompts "
            f"(tau-hat {_num(report.get('tau_hat'))}); other prompts may serve less"
        )
    rows = report.get("per_position") or []
    if rows:
        lines.append(f"pos  {prediction_label(rows):>7}  served|k  predicted reach  served reach  steps")
        for row in rows:
            mark = f"  <- {_mark(report)}" if row.get("broken") else ""
            lines.append(
                f"{row['position']:>3}  {_num(row.get('predicted')):>7}  {_num(row.get('conditional')):>8}  "
                f"{_num(row.get('predicted_reached')):>15}  {_num(row.get('reached')):>12}  {row['steps_at_position']:>5}{mark}"
            )
    if report.get("break_line"):
        lines.append(report["break_line"])
    lines += [f"note: {note}" for note in report.get("notes") or []]
    return lines


def _mark(report: dict[str, Any]) -> str:
    """What a flagged row is called: a break, or below (every position short by a like fraction)."""
    return "below" if is_acceptance_shortfall(report.get("break")) else "break"


def _replayed(rows: list[dict[str, Any]]) -> bool:
    """Whether the rows' predictions come from validation's replayed chain rounds (compare_with_validation's basis)."""
    return any(row.get("basis") == REPLAYED for row in rows)


def prediction_label(rows: list[dict[str, Any]]) -> str:
    """The per-position table's prediction column: replayed chain rounds or val acc_k."""
    return "replay" if _replayed(rows) else "val acc"


def _num(value: Any) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:.2f}"
