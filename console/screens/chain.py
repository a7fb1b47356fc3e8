"""Stop & bench: the chain job's stages as they run (status, elapsed), then the result panel (verdict, accept length and the
wall-time speed-up over plain decoding) and earlier results of the run."""

from __future__ import annotations

import math
from pathlib import PurePosixPath
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Footer, Header, Static

from backend.commands import CHAIN_STAGES, chain_training_job, is_acceptance_shortfall
from console.screens.base import ConsoleScreen, touches
from console.widgets.banner import ConnectionBanner
from backend.safetext import visible
from console.format import accept_length, duration, inert, inert_text, number, plain_cell
from console.state import Section

STAGE_TITLES = {
    "stop": "stop training (checkpoint first)",
    "release": "GPU memory released",
    "checkpoint": "latest checkpoint",
    "preflight": "preflight",
    "launch": "launch server",
    "canary": "canary",
    "bench": "benchmark",
    "result": "result saved",
}
STATUS_STYLES = {"running": "bold yellow", "ok": "green", "failed": "bold red", "skipped": "dim", "pending": "dim"}
# Canary verdicts (backend/serve/canary.py): amber is "inconclusive", neither a pass nor a failure.
VERDICT_STYLES = {"green": "green", "amber": "yellow", "red": "bold red"}
VERDICT_BADGES = {"green": "bold black on green", "amber": "bold black on yellow", "red": "bold white on red"}
TICK_S = 1.0


def latest_by_stage(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The newest record of each stage (a stage goes running -> ok|failed|skipped)."""
    latest: dict[str, dict[str, Any]] = {}
    for record in records:
        stage = record.get("stage")
        if isinstance(stage, str):
            latest[stage] = record
    return latest


def stage_elapsed(record: dict[str, Any] | None, now: float) -> float | None:
    """Seconds a stage took; for the running one, how long it has run so far (from when the console saw it start)."""
    if record is None:
        return None
    if record.get("status") == "running":
        started = record.get("_received") or record.get("time")
        return max(0.0, now - started) if isinstance(started, (int, float)) else None
    elapsed = record.get("elapsed")
    return float(elapsed) if isinstance(elapsed, (int, float)) else None


def chain_outcome(records: list[dict[str, Any]]) -> dict[str, Any]:
    """{"state": waiting|running|ok|failed, "failed_stage", "reason", "result", "saved_to", "canary"}."""
    latest = latest_by_stage(records)
    failed = next((latest[s] for s in CHAIN_STAGES if latest.get(s, {}).get("status") == "failed"), None)
    result_record = latest.get("result")
    canary = (latest.get("canary") or {}).get("result")
    outcome: dict[str, Any] = {
        "state": "waiting",
        "failed_stage": None,
        "reason": None,
        "result": None,
        "saved_to": None,
        "canary": canary if isinstance(canary, dict) else None,
    }
    if failed is not None:
        outcome.update(state="failed", failed_stage=failed.get("stage"), reason=str(failed.get("detail") or ""))
    elif result_record is not None and result_record.get("status") == "ok":
        detail = str(result_record.get("detail") or "")
        outcome.update(
            state="ok",
            result=result_record.get("result") if isinstance(result_record.get("result"), dict) else {},
            saved_to=detail.removeprefix("saved ").strip() or None,
        )
    elif latest:
        outcome["state"] = "running"
    return outcome


def _verdict_badge(text: Text, verdict: str | None) -> None:
    text.append(f" VERDICT {(verdict or '?').upper()} ", style=VERDICT_BADGES.get(verdict or "", "bold black on yellow"))


def verdict_style(verdict: str | None) -> str:
    return VERDICT_STYLES.get(verdict or "", "bold red")


def _canary_lines(text: Text, verdict: str | None, canary: dict[str, Any], result: dict[str, Any]) -> None:
    """The canary's headline in the verdict's colour; for amber also why, and what to do."""
    headline = canary.get("headline") or result.get("verdict_headline")
    if headline:
        text.append(f"canary: {tau_symbol(visible(headline))}\n", style=verdict_style(verdict))
    if canary.get("prompt_source"):
        text.append(f"  prompts: {visible(str(canary['prompt_source']))}\n", style="dim")
    if verdict == "amber":
        for reason in canary.get("reasons") or result.get("verdict_reasons") or []:
            text.append(f"  {tau_symbol(visible(reason))}\n", style="yellow")


def tau_symbol(text: str) -> str:
    """The host writes ASCII "tau-hat"; the screen says τ̂ everywhere, so one screen does not name it two ways."""
    return text.replace("tau-hat", "τ̂")


def _break_caveat(text: Text, result: dict[str, Any]) -> None:
    """A green verdict judges the pooled accept length against τ̂; a break in served acceptance per position says more."""
    acceptance = result.get("acceptance")
    broken = acceptance.get("break") if isinstance(acceptance, dict) else None
    if result.get("verdict") != "green" or not isinstance(broken, dict):
        return
    if is_acceptance_shortfall(broken):
        text.append(
            "  served acceptance is below validation's at every position by a like fraction: the prompts differ from "
            "validation's conversations, or every position's features are off (table below)\n",
            style="yellow",
        )
        return
    text.append(
        f"  but served acceptance breaks at position {visible(broken.get('position', '?'))}: green judges the pooled accept "
        "length against τ̂ only; the draft positions from there on are not served as validation predicts (table below)\n",
        style="bold yellow",
    )


def concurrency_remark(rows: list[dict[str, Any]]) -> str:
    """Said when more concurrent requests bring less total throughput than one: the server queued them, not batched."""
    rates: list[tuple[int, float]] = []
    for row in rows:
        level, rate = row.get("concurrency"), row.get("output_tok_per_s")
        if isinstance(level, int) and isinstance(rate, (int, float)):
            rates.append((level, float(rate)))
    single = next((r for c, r in rates if c == 1), None)
    if single is None:
        return ""
    worse = [(c, r) for c, r in rates if c > 1 and r < single]
    if not worse:
        return ""
    level, rate = max(worse)
    return (
        f"{level} concurrent requests gave less total throughput than 1 ({number(rate, 4)} vs {number(single, 4)} tok/s): "
        "the server queued them instead of batching them, or something else shares the GPU"
    )


def _accept_line(text: Text, data: dict[str, Any]) -> None:
    ratio = data.get("ratio_to_tau_hat")
    text.append(f"  accept length {accept_length(data.get('accept_length'))}", style="bold")
    text.append(f"  vs τ̂ {accept_length(data.get('tau_hat'))} (from validation accuracy)")
    text.append(f"  ratio {number(ratio, 2)}", style="bold" if isinstance(ratio, (int, float)) else "")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def speedup_row(result: dict[str, Any]) -> dict[str, Any] | None:
    """The throughput row the headline speed-up comes from: concurrency 1 when measured there, else the first with one."""
    rows = [row for row in result.get("throughput") or [] if isinstance(row, dict) and _is_number(row.get("speedup"))]
    return next((row for row in rows if row.get("concurrency") == 1), rows[0] if rows else None)


def speedup_headline(result: dict[str, Any]) -> tuple[str, str]:
    """(line, style): the wall-time speed-up over plain decoding in the same engine, or plainly why there is none."""
    row = speedup_row(result)
    if result.get("speedup_baseline") == "same-engine" and row is not None:
        return (
            f"speed-up {row['speedup']:.2f}x over plain decoding in the same engine ({number(row.get('baseline_output_tok_per_s'), 4)} -> "
            f"{number(row.get('output_tok_per_s'), 4)} tok/s at c={row.get('concurrency', '?')})",
            "bold green" if row["speedup"] >= 1 else "bold yellow",
        )
    mode = result.get("speedup_baseline")
    if mode == "same-engine":
        return "speed-up: not measured (the plain decoding baseline produced no throughput)", "yellow"
    if mode is None:
        return "speed-up: not in this result (saved before the chain measured one); eagle3-host bench measures it", "yellow"
    return (
        "speed-up: no baseline was measured, so no speed-up: the server cannot decode plainly on request (SGLang); "
        "measure one with eagle3-host bench --baseline-url URL, a server of the same target without speculation",
        "yellow",
    )


def _speedup_lines(text: Text, result: dict[str, Any]) -> None:
    """The speed-up line beside accept length, and what would make it read wrong: unequal lengths, different outputs."""
    line, style = speedup_headline(result)
    text.append(f"  {line}\n", style=style)
    row = speedup_row(result)
    if row is None or result.get("speedup_baseline") != "same-engine":
        return
    if row.get("exact_lengths") is False:
        text.append("    the two sides did not all decode the same number of tokens: the ratio compares different work\n", style="yellow")
    equal = row.get("outputs_equal")
    if isinstance(equal, dict) and _is_number(equal.get("compared")):
        same, compared = equal.get("equal"), equal.get("compared")
        if same == compared:
            text.append(f"    greedy output equal to plain decoding on {compared} of {compared} prompts\n", style="dim")
        else:
            first = equal.get("first_different_prompt")
            text.append(
                f"    greedy output differs from plain decoding on {_count(compared, same)} of {compared} prompts"
                + (f" (first: prompt {visible(first)})" if first is not None else "")
                + ": speculation should not change greedy text\n",
                style="bold red",
            )


def _count(compared: Any, same: Any) -> str:
    return str(int(compared) - int(same)) if _is_number(compared) and _is_number(same) else "?"


def _ms(value: Any) -> str:
    return f"{value * 1000:.3g}" if _is_number(value) else "-"


def _throughput_lines(text: Text, result: dict[str, Any]) -> None:
    """Per concurrency level: tok/s speculative and plain, the speed-up, TTFT and ITL p50 both ways, accept length."""
    rows = [row for row in result.get("throughput") or [] if isinstance(row, dict)]
    compared = any(_is_number(row.get("baseline_output_tok_per_s")) for row in rows)
    against = "speculative / plain decoding in the same engine" if compared else "speculative decoding; no plain baseline measured"
    text.append(f"throughput per concurrency ({against}):\n", style="bold")
    header = ("c", "tok/s", "plain", "speed-up", "TTFT p50 ms", "ITL p50 ms", "accept length pooled / per-request")
    text.append(_throughput_row(header) + "\n", style="dim")
    for row in rows:
        speedup = row.get("speedup")
        cells = (
            visible(row.get("concurrency", "?")),
            number(row.get("output_tok_per_s"), 4),
            number(row.get("baseline_output_tok_per_s"), 4),
            f"{speedup:.2f}x" if _is_number(speedup) else "-",
            f"{_ms(row.get('ttft_p50_s'))} / {_ms(row.get('baseline_ttft_p50_s'))}",
            f"{_ms(row.get('itl_p50_s'))} / {_ms(row.get('baseline_itl_p50_s'))}",
            f"{accept_length(row.get('accept_length'))} / {accept_length(row.get('accept_length_mean_of_request_means'))}",
        )
        text.append(_throughput_row(cells) + "\n")
    if result.get("bench_prompts"):
        text.append(f"  prompts: {visible(str(result['bench_prompts']))}\n", style="dim")
    for line in result.get("bench_loops") or []:
        text.append(f"  {visible(str(line))}\n", style="yellow")


def _throughput_row(cells: tuple[str, ...]) -> str:
    """One row of the throughput table, right-aligned to its header's columns."""
    widths = (4, 7, 7, 8, 11, 11)
    return "  " + "  ".join(cell.rjust(width) for cell, width in zip(cells, widths)) + "  " + cells[-1]


def _acceptance_lines(text: Text, data: dict[str, Any]) -> None:
    """Both accept-length definitions, labelled; served acceptance per draft position next to val acc_k; the first break."""
    raw = data.get("acceptance")
    acceptance: dict[str, Any] = raw if isinstance(raw, dict) else {}
    mean_of_means = data.get("accept_length_mean_of_request_means", acceptance.get("mean_of_request_means"))
    text.append("  accept length ")
    text.append(accept_length(data.get("accept_length")), style="bold")
    text.append(" pooled over verify steps (SGLang, vLLM)   ")
    text.append(accept_length(mean_of_means), style="bold")
    text.append(" mean of per-request means (SpecForge)\n")
    rows = acceptance.get("per_position") or []
    if rows:
        text.append(
            f"served acceptance per draft position (canary, {acceptance.get('sum_verify_ct', '?')} verify steps) next to validation accuracy:\n", style="bold"
        )
        label = visible(acceptance.get("prediction_label") or "val acc")[:7]  # "replay": validation's chain rounds replayed
        text.append(f"   pos  {label:>7}  served|k   pred reach  served reach  steps\n", style="dim")
        flagged, flag_style = ("  ← below", "yellow") if is_acceptance_shortfall(acceptance.get("break")) else ("  ← break", "bold red")
        for row in rows:
            broken = bool(row.get("broken"))
            line = (
                f"  {row.get('position', '?'):>4}  {_rate(row.get('predicted')):>7}  {_rate(row.get('conditional')):>8}"
                f"   {_rate(row.get('predicted_reached')):>10}  {_rate(row.get('reached')):>12}  {row.get('steps_at_position', '?'):>5}"
            )
            text.append(line + (flagged if broken else "") + "\n", style=flag_style if broken else "" if row.get("judged") else "dim")
    line = visible(acceptance.get("break_line") or "")
    if line:
        text.append(f"  {line}\n", style=_break_line_style(acceptance.get("break"), line))
    for note in acceptance.get("notes") or []:
        text.append(f"  note: {visible(note)}\n", style="yellow")


def _break_line_style(first: Any, line: str) -> str:
    if isinstance(first, dict):
        return "yellow" if is_acceptance_shortfall(first) else "bold red"
    return "green" if line.startswith("no break") else "dim"


def _rate(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "-"


def _causes_from_reason(reason: str) -> tuple[str, list[str], str]:
    """Split 'HEADLINE. Likely causes, in order: a; b; c. The server job ... was stopped.' into its three parts."""
    marker = "Likely causes, in order:"
    if marker not in reason:
        return reason, [], ""
    head, tail = reason.split(marker, 1)
    after = ""
    cleanup = tail.find(" The server job ")  # the chain's own note on the server it started
    if cleanup >= 0:
        tail, after = tail[:cleanup], tail[cleanup:].strip()
    causes = [c.strip().rstrip(".") for c in tail.split("; ") if c.strip()]
    return head.strip(), causes, after


@inert_text
def result_panel_text(records: list[dict[str, Any]]) -> Text:
    """What the chain ended with: verdict, accept length next to τ̂, throughput, checkpoint and flags; or what failed."""
    outcome = chain_outcome(records)
    text = Text()
    if outcome["state"] == "failed":
        _verdict_badge(text, "red")
        stage = outcome["failed_stage"]
        text.append(f"  FAILED at stage '{stage}' ({STAGE_TITLES.get(stage, stage)})\n", style="bold red")
        head, causes, after = _causes_from_reason(tau_symbol(visible(outcome["reason"] or "", keep="\n")))
        text.append(head + "\n")
        if causes:
            text.append("Likely causes, most likely first:\n", style="bold")
            for index, cause in enumerate(causes, 1):
                text.append(f"  {index}. {cause}\n")
        if after:
            text.append(after + "\n", style="dim")
        return text
    if outcome["state"] != "ok":
        text.append("no result yet: " + ("the chain is running" if outcome["state"] == "running" else "waiting for the first stage"), style="dim")
        return text
    result = outcome["result"] or {}
    canary = outcome["canary"] or {}
    _verdict_badge(text, result.get("verdict"))
    _accept_line(text, result)
    text.append("\n")
    _speedup_lines(text, result)
    _break_caveat(text, result)
    _canary_lines(text, result.get("verdict"), canary, result)
    _acceptance_lines(text, result)
    _throughput_lines(text, result)
    slower = concurrency_remark(result.get("throughput") or [])
    if slower:
        text.append(f"  {slower}\n", style="yellow")
    text.append("checkpoint: ", style="bold")
    text.append(f"{visible(result.get('checkpoint') or '?')}\n")
    text.append("engine: ", style="bold")
    text.append(visible(f"{result.get('engine') or '?'}   server job: {result.get('server_job') or '-'}: {result.get('server') or '?'}") + "\n")
    argv = result.get("argv") or []
    text.append("flags: ", style="bold")
    text.append(visible(" ".join(str(a) for a in argv) if argv else "?") + "\n", style="dim")
    if outcome["saved_to"]:
        text.append(f"saved with the run: {visible(outcome['saved_to'])}", style="dim")
    return text


def detail_style(status: str, detail: str) -> str:
    if status == "failed":
        return "red"
    return "yellow" if detail.startswith("amber:") else ""


def best_throughput(result: dict[str, Any]) -> float | None:
    rates = [row.get("output_tok_per_s") for row in result.get("throughput") or [] if isinstance(row.get("output_tok_per_s"), (int, float))]
    return max(rates) if rates else None


class ChainScreen(ConsoleScreen):
    """Follows one chain job: the current one the `b` key started, else the selected or newest chain job."""

    MODE = "chain"
    TITLE = "eagle3-console · Stop & bench (5)"  # the header names the screen

    def compose(self) -> ComposeResult:
        yield Header()
        yield ConnectionBanner(id="banner")
        yield Static(id="chain-title")
        yield DataTable(id="stages", cursor_type="none", zebra_stripes=True)
        with VerticalScroll(id="chain-result-scroll"):
            yield Static(id="chain-result")
        yield Static("Earlier results of this training run (newest first)", classes="section-title", id="results-title")
        yield DataTable(id="results-table", cursor_type="none", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#stages", DataTable).add_columns("stage", "what", "status", "elapsed", "detail")
        self.query_one("#results-table", DataTable).add_columns("saved", "verdict", "accept", "τ̂", "ratio", "speed-up", "best tok/s", "checkpoint", "engine")
        self._ticker = self.set_interval(TICK_S, self._tick, pause=True)
        self.show_state(None)

    def on_screen_resume(self) -> None:
        super().on_screen_resume()
        self.console.attach_chain(self.console.current_chain_job())

    def _tick(self) -> None:
        self.show_state({Section.TICK})

    def draw(self, changed: set[str] | None) -> None:
        if not touches(changed, Section.STAGES, Section.JOBS, Section.SELECTION, Section.RESULTS, Section.TICK, Section.CHAIN):
            return
        console = self.console
        job = console.current_chain_job()
        records = console.state.stages.get(job, []) if job else []
        info = console.state.jobs.get(job) if job else None
        train_job = chain_training_job(info.argv, job) if info and job else None
        running = any(r.get("status") == "running" for r in latest_by_stage(records).values())
        if running:  # the running stage's elapsed time ticks; nothing runs a timer otherwise
            self._ticker.resume()
        else:
            self._ticker.pause()
        self.query_one("#chain-title", Static).update(self._title(job, info, train_job, records))
        self._draw_stages(records)
        if touches(changed, Section.STAGES, Section.JOBS, Section.SELECTION, Section.CHAIN):
            self.query_one("#chain-result", Static).update(result_panel_text(records) if job else Text(""))
        if touches(changed, Section.RESULTS, Section.JOBS, Section.SELECTION, Section.CHAIN, Section.STAGES):
            self._draw_results(train_job, chain_outcome(records).get("saved_to"))

    def _title(self, job: str | None, info, train_job: str | None, records: list[dict[str, Any]]) -> Text:
        if not job:
            return Text("no stop-and-bench run yet: select a training job and press b (Stop & bench)", style="dim")
        outcome = chain_outcome(records)
        state = info.state if info else "?"
        text = Text()
        text.append(job, style="bold")
        text.append(f" · stop-and-bench of {train_job} · job {state}")
        if info and info.exit_code is not None:
            text.append(f" (exit {info.exit_code})")
        label = {
            "ok": ("finished", "green"),
            "failed": (f"failed at {outcome['failed_stage']}", "bold red"),
            "running": ("running", "yellow"),
            "waiting": ("starting", "dim"),
        }[outcome["state"]]
        text.append(" · ")
        text.append(label[0], style=label[1])
        return inert(text)

    def _draw_stages(self, records: list[dict[str, Any]]) -> None:
        table = self.query_one("#stages", DataTable)
        table.clear()
        latest = latest_by_stage(records)
        now = self.console.state.clock()
        for stage in CHAIN_STAGES:
            record = latest.get(stage)
            status = record.get("status", "pending") if record else "pending"
            elapsed = stage_elapsed(record, now)
            detail = str(record.get("detail") or "") if record else ""
            table.add_row(
                stage,
                STAGE_TITLES[stage],
                Text(status, style=STATUS_STYLES.get(status, "")),
                "-" if elapsed is None else f"{elapsed:.1f}s" if elapsed < 60 else duration(elapsed),
                Text(tau_symbol(visible(detail.splitlines()[0]))[:110] if detail else "", style=detail_style(status, detail)),
            )

    def _draw_results(self, train_job: str | None, current: str | None) -> None:
        table = self.query_one("#results-table", DataTable)
        table.clear()
        rows = list(reversed(self.console.state.results.get(train_job, []))) if train_job else []
        for row in rows:
            name = PurePosixPath(str(row.get("path", ""))).name.removeprefix("stop-and-bench-").removesuffix(".json")
            mark = " (this run)" if current and row.get("path") == current else ""
            verdict = str(row.get("verdict") or "?")
            table.add_row(  # str cells are Rich markup to the DataTable: host strings go in as plain_cell
                plain_cell(name + mark),
                Text(visible(verdict), style=verdict_style(verdict)),
                accept_length(row.get("accept_length")),
                accept_length(row.get("tau_hat")),
                number(row.get("ratio_to_tau_hat"), 2),
                f"{row['speedup_c1']:.2f}x" if _is_number(row.get("speedup_c1")) else "-",
                number(best_throughput(row), 4),
                plain_cell(PurePosixPath(str(row.get("checkpoint") or "?")).name),
                plain_cell(row.get("engine") or "?"),
            )
