"""Per-GPU memory and utilization bars, split into memory held by our jobs and by foreign processes."""
from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from backend.protocol import GpuHolder, GpuSample
from console.state import ConsoleState
from console.widgets.format import mib, segmented_bar

OWNED_STYLE = "green"
FOREIGN_STYLE = "yellow"
OTHER_STYLE = "grey50"
BAR_WIDTH = 20


def gpu_text(state: ConsoleState) -> Text:
    if state.no_driver:
        text = Text("No NVIDIA driver on this host: GPU telemetry is off.", style="bold yellow")
        detail = state.gpu_status_text
        if detail:
            text.append(f"\n{detail}", style="dim")
        text.append("\nCPU jobs (the tiny demo) still run and are listed below.")
        return text
    if not state.gpus:
        return Text("waiting for GPU telemetry…", style="dim")
    owned = state.owned_memory_by_gpu()
    foreign = state.foreign_memory_by_gpu()
    text = Text()
    for i, gpu in enumerate(state.gpus):
        if i:
            text.append("\n")
        text.append_text(_gpu_line(gpu, owned.get(gpu.index, 0.0), foreign.get(gpu.index, 0.0)))
        holders = [h for h in state.holders if gpu.index in h.gpu_indices]
        text.append_text(_holder_lines(holders, gpu))
    text.append("\n")
    text.append("█ ours ", style=OWNED_STYLE)
    text.append("█ foreign ", style=FOREIGN_STYLE)
    text.append("█ unattributed ", style=OTHER_STYLE)
    text.append("░ free", style="dim")
    return text


def _gpu_line(gpu: GpuSample, owned: float, foreign: float) -> Text:
    text = Text()
    text.append(f"GPU{gpu.index:<2} ", style="bold")
    text.append(f"{(gpu.name or '?').replace('NVIDIA ', '')[:12]:<12} ")
    total = gpu.memory_total_mib or 0.0
    used = gpu.memory_used_mib or 0.0
    other = max(used - owned - foreign, 0.0)
    text.append("mem ")
    text.append_text(segmented_bar([(owned, OWNED_STYLE), (foreign, FOREIGN_STYLE), (other, OTHER_STYLE)], total, BAR_WIDTH))
    text.append(f" {_gib(gpu.memory_used_mib)}/{_gib(gpu.memory_total_mib)} GiB  ")
    util = gpu.utilization_pct
    text.append("util ")
    text.append_text(segmented_bar([(util or 0.0, "cyan")], 100.0, 8))
    text.append(f" {util:3.0f}%" if util is not None else "   ?%")
    if gpu.temperature_c is not None:
        text.append(f"  {gpu.temperature_c:.0f}°C")
    if gpu.power_w is not None:
        text.append(f" {gpu.power_w:.0f}W")
    return text


def _gib(value: float | None) -> str:
    return "?" if value is None else f"{value / 1024:.1f}"


def _holder_lines(holders: list[GpuHolder], gpu: GpuSample) -> Text:
    text = Text()
    if not holders:
        pids = [p.pid for p in gpu.processes]
        if pids:
            text.append(f"\n      processes (not yet attributed): {', '.join(map(str, pids))}", style="dim")
        return text
    for holder in sorted(holders, key=lambda h: (not h.owned, h.pid)):
        text.append("\n      ")
        if holder.owned:
            text.append("ours    ", style=OWNED_STYLE)
            text.append(f"{holder.job or '?'} pid {holder.pid}")
        else:
            text.append("foreign ", style=FOREIGN_STYLE)
            text.append(f"{holder.user or '?'} pid {holder.pid} {holder.cmdline[:40]}")
            text.append(" (left alone)", style="dim")
        if holder.used_memory_mib is not None:
            text.append(f"  {mib(holder.used_memory_mib)}")
    return text


class GpuPanel(Static):
    def show_state(self, state: ConsoleState) -> None:
        self.update(gpu_text(state))
