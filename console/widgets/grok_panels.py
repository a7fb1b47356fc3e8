"""Text panels of the Grokking screen, drawn from the agent's `signals` and `data_scaling` replies (computed host-side)."""

from __future__ import annotations

import math
from typing import Any

from rich.text import Text

from backend.safetext import visible
from console.format import accept_length, count, duration, epoch_text, inert_text, number, percent, size_bytes


def _num(value: Any, digits: int = 3) -> str:
    return number(value, digits)


def _steps(value: Any) -> str:
    return f"{value:,.0f}" if isinstance(value, (int, float)) and math.isfinite(value) else "-"


def _signed_pct(value: Any) -> str:
    return f"{value * 100:+.1f}%" if isinstance(value, (int, float)) and math.isfinite(value) else "-"


@inert_text
def alerts_text(signals: dict[str, Any] | None) -> Text:
    """The lines that need the operator's eyes: onset, regression, LR floor, val bump, warnings."""
    text = Text()
    if not signals:
        return text
    onset = signals.get("onset") or {}
    regression = signals.get("regression") or {}
    floor = signals.get("lr_floor") or {}
    lines: list[tuple[str, str]] = []
    if onset.get("detected"):
        lines.append(
            (
                f" GROKKING ONSET at step {_steps(onset.get('step'))} "
                f"(val slope z {_num(onset.get('z'), 3)}, memorized since step {_steps(onset.get('memorized_since'))}) ",
                "bold black on green",
            )
        )
    if regression.get("detected"):
        lines.append((f" REGRESSION at step {_steps(regression.get('step'))}: {visible(regression.get('reason') or '')} ", "bold white on red"))
    if floor.get("active"):
        lines.append((f" LR AT ITS FLOOR: {visible(floor.get('warning') or '')} ", "bold black on yellow"))
    bump = signals.get("val_bump") or {}
    if bump.get("active"):
        lines.append(
            (
                f" val loss {_num(bump.get('amount'))} above its minimum (step {_steps(bump.get('min_step'))}) during a train plateau: watch, do not stop ",
                "black on dark_orange",
            )
        )
    for index, (line, style) in enumerate(lines):
        if index:
            text.append("\n")
        text.append(line, style=style)
    return text


@inert_text
def signals_text(signals: dict[str, Any] | None) -> Text:
    """Gap, val slope and its z, onset, plateau and how far past it, tokens, LR."""
    if not signals:
        return Text("no signals yet (the agent computes them from the run's metrics)", style="dim")
    text = Text()
    latest = signals.get("latest") or {}
    text.append("gap ", style="bold")
    text.append(f"val−train {_num(signals.get('gap'))} (rel {_num(signals.get('relative_gap'), 2)}) · acc gap {_num(signals.get('acc_gap'), 3)}")
    if signals.get("memorized"):
        text.append("  MEMORIZED", style="bold yellow")
    slope = signals.get("val_slope") or {}
    z = slope.get("z")
    z_style = "bold green" if isinstance(z, (int, float)) and z < -3 else "bold red" if isinstance(z, (int, float)) and z > 3 else ""
    text.append("\nval slope ", style="bold")
    text.append(f"{_num(slope.get('slope'))} /decade  ")
    text.append(f"z {_num(z)}", style=z_style)
    text.append(f" (n {slope.get('n', '-')})")
    train_slope = signals.get("train_slope") or {}
    text.append(f"\ntrain slope {_num(train_slope.get('slope'))} /decade")
    onset = signals.get("onset") or {}
    text.append("\nonset ", style="bold")
    if onset.get("detected"):
        text.append(f"DETECTED at step {_steps(onset.get('step'))}", style="bold green")
    else:
        text.append("not detected", style="dim")
    plateau = signals.get("plateau") or {}
    text.append("\nplateau ", style="bold")
    if plateau.get("active"):
        text.append(
            f"since step {_steps(plateau.get('start_step'))}: {_steps(plateau.get('steps_past'))} steps, {count(plateau.get('tokens_past'))} tokens past it"
        )
    else:
        text.append("train loss still moving", style="dim")
    text.append("\ntokens seen ", style="bold")
    text.append(f"{count(latest.get('tokens'))} · epoch {epoch_text(latest.get('epoch'))} · step {_steps(signals.get('latest_step'))}")
    floor = signals.get("lr_floor") or {}
    text.append("\nlr ", style="bold")
    text.append(f"{_num(latest.get('lr'))} (peak {_num(floor.get('max_lr'))})")
    if floor.get("active"):
        text.append("  AT FLOOR", style="bold yellow")
    for warning in signals.get("warnings") or []:
        if warning != floor.get("warning"):  # already in the alert line above the plots
            text.append(f"\n! {visible(warning)}", style="yellow")
    return text


@inert_text
def acceptance_text(signals: dict[str, Any] | None, latest_train: dict[str, Any] | None = None) -> Text:
    """τ̂ from the latest val accuracies, and per TTT position smoothed acc and ploss, train vs val. A train column the
    host has no smoothed value for (its whole-history index keeps train acc[0] only, so after a console restart the
    others are empty) shows the latest raw train record's value, starred."""
    if not signals:
        return Text("no signals yet", style="dim")
    text = Text()
    text.append("τ̂ ", style="bold")
    text.append(accept_length(signals.get("tau_hat")), style="bold cyan")
    text.append(f" (val acc at step {_steps(signals.get('tau_hat_step'))})")
    if signals.get("tau_hat_acceptance") is not None:
        text.append(f" · from acceptance rate {accept_length(signals.get('tau_hat_acceptance'))}")
    if signals.get("accept_replayed") is not None:  # rounds start after rejections too: what serving gives, closer than τ̂
        text.append(" · chain rounds replayed ")
        text.append(accept_length(signals["accept_replayed"]), style="bold cyan")
    rows = signals.get("per_position") or []
    text.append("\n k tr.acc val.acc tr.pl val.pl   gap", style="bold")
    if not rows:
        text.append("\n (no per-position acc/ploss logged)", style="dim")
    starred = False
    for row in rows[:8]:
        k = row.get("k", "?")
        train_acc, star_acc = _train_value(row.get("train_acc"), latest_train, "acc", k)
        train_ploss, star_ploss = _train_value(row.get("train_ploss"), latest_train, "ploss", k)
        starred = starred or star_acc or star_ploss
        acc_cell = percent(train_acc) + ("*" if star_acc else "")
        ploss_cell = _num(train_ploss) + ("*" if star_ploss else "")
        text.append(f"\n{k:>2} {acc_cell:>6} {percent(row.get('val_acc')):>7} {ploss_cell:>5} {_num(row.get('val_ploss')):>6} {_num(row.get('ploss_gap')):>5}")
    text.append("\n(smoothed; pl = ploss, gap = val − train ploss)", style="dim")
    if starred:
        text.append("\n* latest raw train value: the host's history holds no smoothed one", style="dim")
    return text


def _train_value(smoothed: Any, latest_train: dict[str, Any] | None, key: str, k: Any) -> tuple[Any, bool]:
    """The host's smoothed value; else the latest train record's raw one at position k (and True)."""
    if smoothed is not None or not latest_train or not isinstance(k, int):
        return smoothed, False
    values = latest_train.get(key)
    if isinstance(values, list) and k < len(values) and isinstance(values[k], (int, float)):
        return values[k], True
    return smoothed, False


@inert_text
def norms_text(signals: dict[str, Any] | None, watched: bool = False) -> Text:
    """Weight norm (total and per module, with the relative change) and grad norm with its clip fraction."""
    if not signals:
        return Text("no signals yet", style="dim")
    text = Text()
    weights = signals.get("weight_norm") or {}
    text.append("weight norm ", style="bold")
    text.append(f"{_num(weights.get('latest'), 5)} ({_signed_pct(weights.get('relative_change'))} over {_steps(weights.get('lag_steps'))} steps)")
    for module, values in sorted((weights.get("modules") or {}).items()):
        text.append(f"\n  {visible(module):<12} {_num(values.get('latest'), 5):>8}  {_signed_pct(values.get('relative_change'))}")
    grads = signals.get("grad_norm") or {}
    fraction = grads.get("clip_fraction")
    text.append("\ngrad norm ", style="bold")
    text.append(f"{_num(grads.get('latest'))} · EMA {_num(grads.get('ema'))}")
    if grads.get("median") is not None:
        before = grads.get("median_before")
        text.append(f"\nmedian {_num(grads.get('median'))} over the last 50 records" + (f" ({_num(before)} the 50 before)" if before is not None else ""))
    if watched:  # the host judges by this tool's default clip; a watched run's own threshold is not known
        text.append("\nclip threshold: not known for a watched run", style="dim")
        return text
    text.append(f"\nclipped at {_num(grads.get('clip'))}: {percent(fraction)} of the last 50 records")
    if isinstance(fraction, (int, float)) and fraction > 0.5:  # a fact, not an alarm: the warning is a rising norm
        text.append(" (AdamW: a binding clip rescales the gradient, not the step)", style="dim")
    return text


@inert_text
def data_scaling_text(report: dict[str, Any] | None, profile: str | None = None) -> Text:
    """Bytes per sample, free disk where the data lives, how many more samples fit, time to extract them."""
    if not report:
        return Text("no data-scaling report yet", style="dim")
    if report.get("error"):
        return Text(f"data scaling unavailable: {visible(report['error'])}", style="yellow")
    text = Text()
    estimated = report.get("kind") != "measured"
    if estimated:
        text.append(" ESTIMATE ", style="bold black on yellow")
        text.append(f" from profile {profile or '?'} shapes: no extracted shards at {visible(report.get('path'))}")
        shape = report.get("shape") or {}
        if shape:
            text.append(
                f"\n({shape.get('aux_width')} aux + {shape.get('teacher_width')} teacher values × "
                f"{shape.get('dtype_bytes')} B × {shape.get('seq_len')} tokens)",
                style="dim",
            )
    else:
        text.append(" MEASURED ", style="bold black on green")
        text.append(f" {count(report.get('samples'))} samples, {size_bytes(report.get('bytes'))} at {visible(report.get('path'))}")
    text.append("\nper sample ", style="bold")
    text.append(size_bytes(report.get("bytes_per_sample")))
    text.append("\nfree disk ", style="bold")
    text.append(f"{size_bytes(report.get('free_bytes'))} (keeping {size_bytes(report.get('keep_free_bytes'))} free)")
    text.append("\nmore samples that fit ", style="bold")
    more = report.get("more_samples_fit")
    text.append(f"{more:,}" if isinstance(more, int) else "-")
    multiple = report.get("fit_multiple_of_current")
    if isinstance(multiple, (int, float)):
        text.append(f" ({multiple:.1f}× the current set)")
    text.append("\ntime to extract them ", style="bold")
    seconds = report.get("estimated_seconds_for_fit")
    if isinstance(seconds, (int, float)):
        per = report.get("seconds_per_sample")
        text.append(f"~{duration(seconds)} at the measured {_num(per)} s/sample")
    else:
        text.append("unknown until an extraction is measured", style="dim")
    return text
