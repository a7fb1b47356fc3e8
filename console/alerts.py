"""Alerts as a pure function: what one host's alerts saw before and its state now in, the alerts to raise out.

Job exits, ranks not reporting, a red canary, grokking onset, a low disk. No Textual: flows/alerting.py shows them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from console.session import Severity
from console.state import ConsoleState, Section, disk_low, used_share

ENDED_STATES = ("exited", "stopped", "stale", "unknown")


@dataclass(frozen=True)
class Alert:
    text: str
    severity: Severity = "warning"


@dataclass(frozen=True)
class AlertMemory:
    """What one host's alerts have seen: each job's state at the last jobs list (None before the first list), and the
    conditions already alerted (a stalled rank or a low disk is alerted again once it has cleared and comes back)."""

    job_states: dict[str, str] | None = None
    raised: frozenset[tuple[Any, ...]] = frozenset()


def new_alerts(before: AlertMemory, state: ConsoleState, sections: set[str], where: str = "") -> tuple[AlertMemory, list[Alert]]:
    """The alerts that the change of `sections` raises, each once, and what to remember for the next change.

    `where` names the host in each text (" on gpu-a"; empty with one host)."""
    job_states, raised, alerts = before.job_states, set(before.raised), []
    if Section.JOBS in sections:
        job_states = {name: job.state for name, job in state.jobs.items()}
        alerts += _job_exits(before.job_states, state, where)
        alerts += _stalled_ranks(state, where, raised)
    if Section.STAGES in sections:
        alerts += _red_canaries(state, where, raised)
    if Section.SIGNALS in sections:
        alerts += _onsets(state, where, raised)
    if Section.DISKS in sections:
        alerts += _low_disks(state, where, raised)
    return AlertMemory(job_states, frozenset(raised)), alerts


def _job_exits(before: dict[str, str] | None, state: ConsoleState, where: str) -> list[Alert]:
    if before is None:
        return []  # the first list: jobs that ended before the console came are not news
    alerts = []
    for name, job in state.jobs.items():
        if before.get(name) == "running" and job.state in ENDED_STATES:
            code = f" with exit code {job.exit_code}" if job.exit_code is not None else ""
            alerts.append(Alert(f"job {name}{where} {job.state}{code}", "error" if job.exit_code not in (None, 0) else "warning"))
    return alerts


def _stalled_ranks(state: ConsoleState, where: str, raised: set[tuple[Any, ...]]) -> list[Alert]:
    """A rank of a running job whose heartbeat the agent has not seen for its threshold: once, until it reports again."""
    alerts = []
    for job in state.jobs.values():
        stalled = set(job.stalled_ranks) if job.state == "running" else set()
        for rank in job.ranks:
            number = rank.get("rank")
            key = ("stalled", job.name, number)
            if number in stalled and key not in raised:
                raised.add(key)
                node = f"node {job.node_rank} " if job.node_rank is not None else ""
                age = float(rank.get("age_s") or 0)
                alerts.append(Alert(f"{job.name}: {node}rank {number}{where} not reporting for {age:.0f} s (last step {rank.get('step', '?')})", "error"))
            elif number not in stalled:
                raised.discard(key)
    return alerts


def _red_canaries(state: ConsoleState, where: str, raised: set[tuple[Any, ...]]) -> list[Alert]:
    alerts = []
    for job, records in state.stages.items():
        for record in records:
            if record.get("stage") != "canary" or record.get("_received") is None:
                continue  # only what arrived live: a history re-read on attach is not news
            raw = record.get("result")
            result: dict[str, Any] = raw if isinstance(raw, dict) else {}
            key = ("canary", job, record.get("time"))
            if (record.get("status") == "failed" or result.get("verdict") == "red") and key not in raised:
                raised.add(key)
                alerts.append(Alert(f"canary RED in {job}{where}: {str(record.get('detail') or result.get('headline') or '')[:120]}", "error"))
    return alerts


def _onsets(state: ConsoleState, where: str, raised: set[tuple[Any, ...]]) -> list[Alert]:
    alerts = []
    for job, signals in state.signals.items():
        onset = signals.get("onset") if isinstance(signals, dict) else None
        if isinstance(onset, dict) and onset.get("detected") and ("onset", job) not in raised:
            raised.add(("onset", job))
            alerts.append(Alert(f"grokking onset in {job}{where} at step {onset.get('step')}"))
    return alerts


def _low_disks(state: ConsoleState, where: str, raised: set[tuple[Any, ...]]) -> list[Alert]:
    alerts = []
    for disk in state.disks:
        key = ("disk", disk.path)
        if not disk_low(disk):
            raised.discard(key)  # recovered: alert again if it runs low again
        elif key not in raised:
            raised.add(key)
            why = "less free than two checkpoints need" if disk.checkpoint_bytes else f"{used_share(disk):.0%} used"
            alerts.append(Alert(f"disk low{where}: {disk.label} {disk.path} ({why})", "error"))
    return alerts
