"""Per-GPU memory and utilization bars, split into memory held by our jobs and by foreign processes."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from backend.protocol import GpuHolder, GpuSample
from console.state import ConsoleState
from backend.safetext import visible
from console.format import GIB, MIB, figure, inert_text, mib, segmented_bar

OWNED_STYLE = "green"
FOREIGN_STYLE = "yellow"
OTHER_STYLE = "grey50"
BAR_WIDTH = 20


NARROW = 90  # below this many columns a GPU's util/temperature go on their own line and command lines are cut shorter


def holder_matches(holder: GpuHolder, wanted: str) -> bool:
    """Whether a holder's row holds `wanted` (any case): its pid, user, command line, job name, or "ours"/"foreign"."""
    if not wanted:
        return True
    text = f"{holder.pid} {holder.user} {holder.cmdline} {holder.job or ''} {'ours' if holder.owned else 'foreign'}"
    return wanted.lower() in text.lower()


@inert_text
def gpu_text(state: ConsoleState, expanded: bool = False, width: int = 120, wanted: str = "") -> Text:
    """The panel's text; every name, user and command line a host sent shown inert (backend.safetext). With `wanted`,
    only the holders whose row holds it (the Dashboard's / filter); each GPU line stays, saying how many were hidden."""
    if state.no_driver:
        text = Text("No NVIDIA driver on this host: GPU telemetry is off.", style="bold yellow")
        detail = state.gpu_status_text
        if detail:
            text.append(f"\n{visible(detail)}", style="dim")
        text.append("\nCPU jobs (the tiny demo) still run and are listed below.")
        return text
    if not state.gpus:
        return Text("waiting for GPU telemetry…", style="dim")
    owned = state.owned_memory_by_gpu()
    leaders = {job.name: job.pid for job in state.jobs.values()}
    foreign = state.foreign_memory_by_gpu()
    text = Text()
    for i, gpu in enumerate(state.gpus):
        if i:
            text.append("\n")
        text.append_text(_gpu_line(gpu, owned.get(gpu.index, 0.0), foreign.get(gpu.index, 0.0), narrow=width < NARROW))
        holders = [h for h in state.holders if gpu.index in h.gpu_indices]
        matching = [h for h in holders if holder_matches(h, wanted)]
        text.append_text(_holder_lines(matching, gpu, leaders, expanded, narrow=width < NARROW, filtered=bool(wanted)))
        if len(matching) < len(holders):
            text.append(f"\n      ({len(holders) - len(matching)} of {len(holders)} holders hidden by the filter)", style="dim")
    text.append("\n")
    text.append("█ ours ", style=OWNED_STYLE)
    text.append("█ foreign ", style=FOREIGN_STYLE)
    text.append("█ unattributed ", style=OTHER_STYLE)
    text.append("░ free", style="dim")
    return text


def _gpu_line(gpu: GpuSample, owned: float, foreign: float, narrow: bool = False) -> Text:
    text = Text()
    text.append(f"GPU{gpu.index:<2} ", style="bold")
    text.append(f"{visible(gpu.name or '?').replace('NVIDIA ', '')[:12]:<12} ")
    total = gpu.memory_total_mib or 0.0
    used = gpu.memory_used_mib or 0.0
    other = max(used - owned - foreign, 0.0)
    text.append("mem ")
    text.append_text(segmented_bar([(owned, OWNED_STYLE), (foreign, FOREIGN_STYLE), (other, OTHER_STYLE)], total, BAR_WIDTH))
    memory = f"{figure(gpu.memory_used_mib, GIB, amount_unit=MIB)}/{figure(gpu.memory_total_mib, GIB, amount_unit=MIB)} GiB"
    text.append(f" {memory}" + ("\n     " if narrow else "  "))
    util = gpu.utilization_pct
    text.append("util ")
    text.append_text(segmented_bar([(util or 0.0, "cyan")], 100.0, 8))
    text.append(f" {util:3.0f}%" if util is not None else "   ?%")
    if gpu.temperature_c is not None:
        text.append(f"  {gpu.temperature_c:.0f}°C")
    if gpu.power_w is not None:
        text.append(f" {gpu.power_w:.0f}W")
    return text


def _holder_lines(
    holders: list[GpuHolder], gpu: GpuSample, leaders: dict[str, int] | None = None, expanded: bool = False, narrow: bool = False, filtered: bool = False
) -> Text:
    indent, cmd = ("\n  ", 12) if narrow else ("\n      ", 40)
    text = Text()
    if not holders:
        if filtered:
            return text  # the filter hid them: the line under says how many
        pids = [p.pid for p in gpu.processes]
        if pids:
            text.append(f"\n      processes (not yet attributed): {', '.join(map(str, pids))}", style="dim")
        return text
    for main, helpers in group_holders(holders, leaders or {}):
        text.append(indent)
        if main.owned:
            text.append("ours    ", style=OWNED_STYLE)
            text.append(f"{visible(main.job or '?')} pid {main.pid}")
        else:
            text.append("foreign ", style=FOREIGN_STYLE)
            text.append(f"{visible(main.user or '?')} pid {main.pid} {visible(main.cmdline)[:cmd]}")
            text.append(" (left alone)", style="dim")
        text.append_text(_memory_note(main))
        if helpers:
            noun = "worker" if main.owned else "same command"
            text.append(f"  (+{len(helpers)} {noun}{'s' if main.owned and len(helpers) != 1 else ''}", style="bold")
            text.append_text(_helpers_memory(helpers))
            text.append(")" if expanded else "; h shows them)", style="bold" if expanded else "dim")
            if expanded:
                for helper in helpers:
                    text.append(f"{indent}    └ pid {helper.pid} ")
                    text.append(visible(helper.cmdline)[:48], style="dim")
                    text.append_text(_memory_note(helper))
    return text


def group_holders(holders: list[GpuHolder], leaders: dict[str, int]) -> list[tuple[GpuHolder, list[GpuHolder]]]:
    """One row per job (its leader, else its holder with the most memory) with the job's other holders (compile
    workers, dataloaders...) under it; foreign holders of one user running one command line are grouped the same way."""
    groups: dict[tuple, list[GpuHolder]] = {}
    for holder in holders:
        key = ("ours", holder.job or f"pid {holder.pid}") if holder.owned else ("foreign", holder.user, holder.cmdline)
        groups.setdefault(key, []).append(holder)
    rows = []
    for key, members in groups.items():
        leader = leaders.get(str(key[1])) if key[0] == "ours" else None
        members.sort(key=lambda h: (h.pid != leader, -(h.used_memory_mib or 0.0), h.pid))
        rows.append((members[0], sorted(members[1:], key=lambda h: h.pid)))
    rows.sort(key=lambda row: (not row[0].owned, row[0].pid))
    return rows


def uses_memory(holder: GpuHolder) -> bool:
    return bool(holder.used_memory_mib)


def _memory_note(holder: GpuHolder) -> Text:
    if uses_memory(holder):
        return Text(f"  {mib(holder.used_memory_mib)}", style="bold")
    return Text("  no GPU memory", style="dim")


def _helpers_memory(helpers: list[GpuHolder]) -> Text:
    using = [h for h in helpers if uses_memory(h)]
    if not using:
        return Text(", none uses GPU memory", style="dim")
    return Text(f", {len(using)} use{'s' if len(using) == 1 else ''} {mib(sum(h.used_memory_mib or 0.0 for h in using))}", style="bold")


def holders_shown(state: ConsoleState, wanted: str) -> tuple[int, int]:
    """(holders the filter keeps, all holders) of this host."""
    return sum(holder_matches(h, wanted) for h in state.holders), len(state.holders)


class GpuPanel(Static):
    holder_filter = ""  # the Dashboard's / filter: only holders whose row holds it are listed
    holders_shown: tuple[int, int] = (0, 0)  # (listed, all) at the last draw

    def show_state(self, state: ConsoleState, expanded: bool = False) -> None:
        self.holders_shown = holders_shown(state, self.holder_filter)
        self.update(gpu_text(state, expanded, self.size.width or 120, self.holder_filter))

    def on_resize(self) -> None:
        app = self.app
        if hasattr(app, "state"):
            self.show_state(app.state, bool(getattr(app, "holders_expanded", False)))
