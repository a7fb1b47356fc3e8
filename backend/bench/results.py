"""Benchmark result documents: one section per eval set with its speed-up; saved atomically as JSON, printed as a table."""

from __future__ import annotations

import json
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.durable import write_atomic
from backend.bench.client import NO_BASELINE, SAME_ENGINE, Baseline, LevelResult, side_options
from backend.train.loss import rounds_accept_length
from backend.serve.acceptance import (
    LOOP_WARNING_SHARE,
    acceptance_lines,
    break_line,
    checkpoint_validation,
    compare_with_validation,
    prediction_label,
    replayed_rounds,
    tau_hat,
)
from backend.serve.launch import server_summary
from backend.serve.prompts import PromptSet

SCHEMA = 2  # 2: one section per eval set ("sets"), each with its baseline levels and per-concurrency comparison
LATENCY_KEYS = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")  # compared side by side with the baseline


@dataclass
class SetRun:
    """One eval set's measurement: its prompts, the speculative levels and the baseline's (empty without one)."""

    name: str
    prompts: PromptSet
    levels: list[LevelResult]
    baseline_levels: list[LevelResult] = field(default_factory=list)


def outputs_equal(level: LevelResult, base: LevelResult) -> dict[str, Any]:
    """Greedy speculative decoding must reproduce the baseline's text, prompt by prompt."""
    pairs = [(a, b) for a, b in zip(level.texts, base.texts) if a and b]
    first_diff = next((i for i, (a, b) in enumerate(zip(level.texts, base.texts)) if a and b and a != b), None)
    return {"compared": len(pairs), "equal": sum(1 for a, b in pairs if a == b), "first_different_prompt": first_diff}


def exact_lengths(level: LevelResult, max_new_tokens: int) -> bool:
    """Every completed request produced exactly max_new_tokens (what ignore_eos promises)."""
    return level.completion_tokens_min == level.completion_tokens_max == max_new_tokens


def compare(spec: list[LevelResult], baseline: list[LevelResult], max_new_tokens: int, fixed_lengths: bool = True) -> list[dict[str, Any]]:
    """Per concurrency level both sides ran: tok/s both ways, the speed-up, TTFT and ITL of both, accept length, equality
    (exact_lengths: None for whole answers, which end at the end of turn)."""
    by_level = {b.concurrency: b for b in baseline}
    rows = []
    for level in spec:
        base = by_level.get(level.concurrency)
        if base is None:
            continue
        rows.append(
            {
                "concurrency": level.concurrency,
                "output_tok_per_s": level.output_tok_per_s,
                "baseline_output_tok_per_s": base.output_tok_per_s,
                "speedup": level.output_tok_per_s / base.output_tok_per_s if base.output_tok_per_s > 0 else None,
                **{key: getattr(level, key) for key in LATENCY_KEYS},
                **{f"baseline_{key}": getattr(base, key) for key in LATENCY_KEYS},
                "accept_length": level.accept_length,
                "accept_length_mean_of_request_means": level.accept_length_mean_of_request_means,
                "output_tokens": level.output_tokens,
                "baseline_output_tokens": base.output_tokens,
                "exact_lengths": exact_lengths(level, max_new_tokens) and exact_lengths(base, max_new_tokens) if fixed_lengths else None,
                "failed": level.failed,
                "baseline_failed": base.failed,
                "outputs_equal": outputs_equal(level, base),
            }
        )
    return rows


def speedup_at(rows: list[dict[str, Any]], concurrency: int) -> float | None:
    return next((row["speedup"] for row in rows if row["concurrency"] == concurrency), None)


def set_section(
    run: SetRun, max_new_tokens: int, val_acc: list[float] | None, steps: Any, val_rounds: Any = None, fixed_lengths: bool = True
) -> dict[str, Any]:
    rows = compare(run.levels, run.baseline_levels, max_new_tokens, fixed_lengths)
    return {
        "name": run.name,
        "prompts": run.prompts.describe(),
        "levels": [with_validation(level.to_dict(), val_acc, steps, val_rounds) for level in run.levels],
        "baseline_levels": [level.to_dict() for level in run.baseline_levels],
        "comparison": rows,
        "speedup_c1": speedup_at(rows, 1),
    }


def with_validation(level: dict[str, Any], val_acc: list[float] | None, num_steps: Any, val_rounds: Any = None) -> dict[str, Any]:
    """A level's acceptance block with val acc_k, tau-hat, the replayed chain rounds (when the checkpoint has them)
    and the first break added (unchanged without val_acc)."""
    acceptance = dict(level.get("acceptance") or {})
    if not val_acc or not acceptance:
        return level
    steps = num_steps if isinstance(num_steps, int) and num_steps > 0 else len(acceptance.get("per_position") or []) or len(val_acc)
    replay = replayed_rounds(val_rounds, steps)
    rows, first = compare_with_validation(acceptance.get("per_position") or [], val_acc, replay)
    acceptance.update(
        per_position=rows,
        val_acc=list(val_acc),
        tau_hat=tau_hat(val_acc, steps),
        val_rounds=replay,
        accept_replayed=rounds_accept_length(replay),
        **{"break": first},
        break_line=break_line(first, rows) if rows else None,
        prediction_label=prediction_label(rows),
    )
    return {**level, "acceptance": acceptance}


def build_document(
    *,
    url: str,
    server_info: dict[str, Any],
    sets: list[SetRun],
    max_new_tokens: int,
    concurrency: list[int],
    baseline: Baseline = Baseline(NO_BASELINE),
    baseline_info: dict[str, Any] | None = None,
    started_at: float | None = None,
    val_acc: list[float] | None = None,
    stop_at_eos: bool = False,
) -> dict[str, Any]:
    """val_acc: the served checkpoint's per-step validation accuracy; read from its config.json when not given
    (with its replayed chain rounds, val_rounds, when it recorded them). stop_at_eos: every request ended at the end
    of turn (whole answers), not at exactly max_new_tokens."""
    recorded_acc, val_rounds = checkpoint_validation(server_info.get("speculative_draft_model_path"))
    if val_acc is None:
        val_acc = recorded_acc
    steps = server_info.get("speculative_num_steps")
    sections = [set_section(run, max_new_tokens, val_acc, steps, val_rounds, fixed_lengths=not stop_at_eos) for run in sets]
    return {
        "schema": SCHEMA,
        "kind": "eagle3-bench",
        "time": started_at or time.time(),
        "time_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started_at or time.time())),
        "host": socket.gethostname(),
        "command": sys.argv,
        "url": url,
        "server": server_summary(server_info),
        "checkpoint": server_info.get("speculative_draft_model_path"),
        "flags": {
            k: server_info.get(k)
            for k in ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens", "dtype", "tp_size")
        },
        "max_new_tokens": max_new_tokens,
        "temperature": 0,
        "ignore_eos": side_options(baseline, stop_at_eos)[0].ignore_eos,  # what the speculative side sent
        "stop_at_eos": stop_at_eos,
        "concurrency": concurrency,
        "baseline": {
            "mode": baseline.mode,
            "url": url if baseline.mode == SAME_ENGINE else baseline.url,
            "server": server_summary(baseline_info) if baseline_info else None,
        },
        "sets": sections,
        "speedup_c1": {section["name"]: section["speedup_c1"] for section in sections},
        "validation": {
            "val_acc": val_acc,
            "tau_hat": tau_hat(val_acc, steps) if val_acc and isinstance(steps, int) else None,
            "accept_replayed": rounds_accept_length(replayed_rounds(val_rounds, steps if isinstance(steps, int) else None)),
        },
    }


def request_counts(document: dict[str, Any]) -> tuple[int, int]:
    """(failed, total) requests over every set and side."""
    levels = [level for section in document["sets"] for level in section["levels"] + section["baseline_levels"]]
    return sum(level["failed"] for level in levels), sum(level["requests"] for level in levels)


def first_error(document: dict[str, Any]) -> str | None:
    levels = [level for section in document["sets"] for level in section["levels"] + section["baseline_levels"]]
    return next((level["errors"][0] for level in levels if level.get("errors")), None)


def default_path(run_dir: Path, started_at: float, kind: str = "bench") -> Path:
    """RUN_DIR/benchmarks/<kind>-<local time>.json: where a result is kept unless --out says otherwise."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started_at))
    return run_dir / "benchmarks" / f"{kind}-{stamp}.json"


def save(document: dict[str, Any], path: Path) -> Path:
    """Written atomically and durably (backend.durable): a reader never sees half a result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(document, indent=1))
    return path


def load(path: Path) -> dict[str, Any]:
    document = json.loads(Path(path).read_text())
    if document.get("kind") != "eagle3-bench":
        raise ValueError(f"{path} is not an eagle3-bench result (kind={document.get('kind')!r})")
    return document


def _fmt(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


LEVEL_HEADER = (
    f"{'conc':>4} {'tok/s':>9} {'pooled':>7} {'req_mean':>8} {'srv_acc':>7} {'ttft50':>8} {'ttft99':>8} "
    f"{'itl50':>7} {'itl99':>7} {'tpot50':>7} {'fail':>4}   (times in ms)"
)


def level_line(level: dict[str, Any]) -> str:
    return (
        f"{level['concurrency']:>4} {level['output_tok_per_s']:>9.1f} {_fmt(level['accept_length']):>7} "
        f"{_fmt(level.get('accept_length_mean_of_request_means')):>8} {_fmt(level['server_avg_accept_length']):>7} {_fmt(level['ttft_p50_s'], 1000, 1):>8} "
        f"{_fmt(level['ttft_p99_s'], 1000, 1):>8} {_fmt(level['itl_p50_s'], 1000, 1):>7} "
        f"{_fmt(level['itl_p99_s'], 1000, 1):>7} {_fmt(level['tpot_p50_s'], 1000, 1):>7} {level['failed']:>4}"
    )


def comparison_line(row: dict[str, Any]) -> str:
    equal = row["outputs_equal"]
    return (
        f"speedup at concurrency {row['concurrency']}: {_fmt(row['speedup'])}x "
        f"({row['output_tok_per_s']:.1f} vs {row['baseline_output_tok_per_s']:.1f} tok/s baseline; "
        f"ttft50 {_fmt(row['ttft_p50_s'], 1000, 1)} vs {_fmt(row['baseline_ttft_p50_s'], 1000, 1)} ms, "
        f"itl50 {_fmt(row['itl_p50_s'], 1000, 1)} vs {_fmt(row['baseline_itl_p50_s'], 1000, 1)} ms; "
        f"outputs equal {equal['equal']}/{equal['compared']}" + ("; NOT all exactly max_new_tokens" if row["exact_lengths"] is False else "") + ")"
    )


def loop_lines(levels: list[dict[str, Any]]) -> list[str]:
    """A warning when the answers loop: the repeated words are tokens any draft predicts, so accept length and
    speed-up then measure the target's loops as much as the draft."""
    shares: list[float] = [lv["repeated_word_share"] for lv in levels if lv.get("repeated_word_share") is not None]
    if not shares or max(shares) < LOOP_WARNING_SHARE:
        return []
    return [
        f"loops: {max(shares):.0%} of the answers' words repeat an earlier 8-word run of their own answer; accept length counts "
        "them (a fixed short --max-new-tokens reads less of them: docs/serving.md, Benchmark)"
    ]


def set_block(section: dict[str, Any], baseline_mode: str) -> list[str]:
    prompts = section["prompts"]
    lines = [
        f"set {section['name']}: {prompts['count']} prompts from {prompts['source']}",
        f"  {LEVEL_HEADER}",
        "  speculative",
        *[f"  {level_line(lv)}" for lv in section["levels"]],
    ]
    if section["baseline_levels"]:
        lines += [f"  baseline ({baseline_mode})", *[f"  {level_line(lv)}" for lv in section["baseline_levels"]]]
    lines += [f"  {comparison_line(row)}" for row in section["comparison"]]
    lines += [f"  {line}" for line in loop_lines(section["levels"])]
    for level in section["levels"]:
        if level.get("acceptance"):
            lines.append(f"  concurrency {level['concurrency']}:")
            lines += [f"    {line}" for line in acceptance_lines(level["acceptance"])]
    return lines


def table(document: dict[str, Any]) -> str:
    baseline = document["baseline"]
    against = {SAME_ENGINE: "plain decoding in the same engine", NO_BASELINE: "no baseline"}.get(baseline["mode"], f"baseline {baseline['url']}")
    lines = [
        f"benchmark of {document['url']}  ({document['flags'].get('speculative_algorithm')}, "
        f"steps {document['flags'].get('speculative_num_steps')}, max_new_tokens {document['max_new_tokens']}, "
        f"{against}{', ignore_eos' if document['ignore_eos'] else ''}{', whole answers: every request ends at the end of turn' if document.get('stop_at_eos') else ''})",
        "  accept length: pooled = over verify steps (SGLang, vLLM: sum completion / sum verify_ct); "
        "req_mean = mean of per-request means (SpecForge benchmark)",
    ]
    validation = document.get("validation") or {}
    if validation.get("val_acc"):
        replayed = f", chain rounds replayed {_fmt(validation['accept_replayed'])}" if validation.get("accept_replayed") is not None else ""
        lines.append(f"validation: tau-hat {_fmt(validation.get('tau_hat'))}{replayed}, val acc " + " ".join(f"{a:.2f}" for a in validation["val_acc"]))
    for section in document["sets"]:
        lines += set_block(section, baseline["mode"])
    return "\n".join(lines)
