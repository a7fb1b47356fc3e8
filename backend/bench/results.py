"""Benchmark result documents: assemble, compute speedups, save atomically as JSON, print as a table."""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from backend.bench.client import LevelResult
from backend.serve.acceptance import acceptance_lines, break_line, compare_with_validation, tau_hat
from backend.serve.launch import server_summary
from backend.serve.prompts import PromptSet

SCHEMA = 1


def speedups(spec: list[LevelResult], baseline: list[LevelResult]) -> list[dict[str, Any]]:
    by_level = {b.concurrency: b for b in baseline}
    rows = []
    for level in spec:
        base = by_level.get(level.concurrency)
        if base is None:
            continue
        ratio = level.output_tok_per_s / base.output_tok_per_s if base.output_tok_per_s > 0 else None
        rows.append(
            {"concurrency": level.concurrency, "output_tok_per_s": level.output_tok_per_s, "baseline_output_tok_per_s": base.output_tok_per_s, "speedup": ratio}
        )
    return rows


def outputs_equal(spec: list[LevelResult], baseline: list[LevelResult]) -> dict[str, Any]:
    """Greedy speculative decoding must reproduce the baseline's text; compared at the first common level."""
    common = [(s, b) for s in spec for b in baseline if s.concurrency == b.concurrency]
    if not common:
        return {"compared": 0, "equal": 0}
    level, base = common[0]
    pairs = [(a, b) for a, b in zip(level.texts, base.texts) if a and b]
    equal = sum(1 for a, b in pairs if a == b)
    first_diff = next((i for i, (a, b) in enumerate(zip(level.texts, base.texts)) if a and b and a != b), None)
    return {"concurrency": level.concurrency, "compared": len(pairs), "equal": equal, "first_different_prompt": first_diff}


def checkpoint_val_acc(path: Any) -> list[float] | None:
    """The per-step validation accuracy a checkpoint recorded (config.json eagle3_console.val_acc), if readable here."""
    if not isinstance(path, str) or not path:
        return None
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    acc = (config.get("eagle3_console") or {}).get("val_acc") if isinstance(config, dict) else None
    if not isinstance(acc, list) or not acc or not all(isinstance(a, (int, float)) for a in acc):
        return None
    return [float(a) for a in acc]


def with_validation(level: dict[str, Any], val_acc: list[float] | None, num_steps: Any) -> dict[str, Any]:
    """A level's acceptance block with val acc_k, tau-hat and the first break added (unchanged without val_acc)."""
    acceptance = dict(level.get("acceptance") or {})
    if not val_acc or not acceptance:
        return level
    rows, first = compare_with_validation(acceptance.get("per_position") or [], val_acc)
    steps = num_steps if isinstance(num_steps, int) and num_steps > 0 else len(rows) or len(val_acc)
    acceptance.update(
        per_position=rows, val_acc=list(val_acc), tau_hat=tau_hat(val_acc, steps), **{"break": first}, break_line=break_line(first, rows) if rows else None
    )
    return {**level, "acceptance": acceptance}


def build_document(
    *,
    url: str,
    server_info: dict[str, Any],
    levels: list[LevelResult],
    prompts: PromptSet,
    max_new_tokens: int,
    concurrency: list[int],
    baseline_url: str | None = None,
    baseline_info: dict[str, Any] | None = None,
    baseline_levels: list[LevelResult] | None = None,
    started_at: float | None = None,
    val_acc: list[float] | None = None,
) -> dict[str, Any]:
    """val_acc: the served checkpoint's per-step validation accuracy; read from its config.json when not given."""
    if val_acc is None:
        val_acc = checkpoint_val_acc(server_info.get("speculative_draft_model_path"))
    steps = server_info.get("speculative_num_steps")
    document: dict[str, Any] = {
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
        "prompts": prompts.describe(),
        "max_new_tokens": max_new_tokens,
        "temperature": 0,
        "concurrency": concurrency,
        "levels": [with_validation(level.to_dict(), val_acc, steps) for level in levels],
        "validation": {"val_acc": val_acc, "tau_hat": tau_hat(val_acc, steps) if val_acc and isinstance(steps, int) else None},
    }
    if baseline_url is not None and baseline_levels is not None:
        document["baseline"] = {"url": baseline_url, "server": server_summary(baseline_info or {}), "levels": [level.to_dict() for level in baseline_levels]}
        document["speedup"] = speedups(levels, baseline_levels)
        document["outputs_equal"] = outputs_equal(levels, baseline_levels)
    return document


def default_path(run_dir: Path, started_at: float) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started_at))
    return run_dir / "benchmarks" / f"bench-{stamp}.json"


def save(document: dict[str, Any], path: Path) -> Path:
    """Write to a temp file in the same directory, fsync, rename: a reader never sees half a result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(document, out, indent=1)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path


def load(path: Path) -> dict[str, Any]:
    document = json.loads(Path(path).read_text())
    if document.get("kind") != "eagle3-bench":
        raise ValueError(f"{path} is not an eagle3-bench result (kind={document.get('kind')!r})")
    return document


def _fmt(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(document: dict[str, Any]) -> str:
    lines = [
        f"benchmark of {document['url']}  ({document['flags'].get('speculative_algorithm')}, "
        f"steps {document['flags'].get('speculative_num_steps')}, prompts {document['prompts']['count']}, "
        f"max_new_tokens {document['max_new_tokens']})",
        f"{'conc':>4} {'tok/s':>9} {'pooled':>7} {'req_mean':>8} {'srv_acc':>7} {'ttft50':>8} {'ttft99':>8} "
        f"{'itl50':>7} {'itl99':>7} {'tpot50':>7} {'fail':>4}   (times in ms)",
        "  accept length: pooled = over verify steps (SGLang, vLLM: sum completion / sum verify_ct); "
        "req_mean = mean of per-request means (SpecForge benchmark)",
    ]
    for level in document["levels"]:
        lines.append(
            f"{level['concurrency']:>4} {level['output_tok_per_s']:>9.1f} {_fmt(level['accept_length']):>7} "
            f"{_fmt(level.get('accept_length_mean_of_request_means')):>8} {_fmt(level['server_avg_accept_length']):>7} {_fmt(level['ttft_p50_s'], 1000, 1):>8} "
            f"{_fmt(level['ttft_p99_s'], 1000, 1):>8} {_fmt(level['itl_p50_s'], 1000, 1):>7} "
            f"{_fmt(level['itl_p99_s'], 1000, 1):>7} {_fmt(level['tpot_p50_s'], 1000, 1):>7} {level['failed']:>4}"
        )
    for row in document.get("speedup", []):
        lines.append(
            f"speedup at concurrency {row['concurrency']}: {_fmt(row['speedup'])}x "
            f"({row['output_tok_per_s']:.1f} vs {row['baseline_output_tok_per_s']:.1f} tok/s baseline)"
        )
    if "outputs_equal" in document:
        eq = document["outputs_equal"]
        lines.append(f"outputs equal to baseline: {eq['equal']}/{eq['compared']}")
    validation = document.get("validation") or {}
    if validation.get("val_acc"):
        lines.append(f"validation: tau-hat {_fmt(validation.get('tau_hat'))}, val acc " + " ".join(f"{a:.2f}" for a in validation["val_acc"]))
    for level in document["levels"]:
        if level.get("acceptance"):
            lines.append(f"concurrency {level['concurrency']}:")
            lines += [f"  {line}" for line in acceptance_lines(level["acceptance"])]
    return "\n".join(lines)
