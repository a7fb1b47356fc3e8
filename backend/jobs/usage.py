"""Per-job CPU % and resident memory (htop's columns for a whole job): its processes as discovery finds them, read from /proc."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

from backend.host import procs
from backend.jobs import discovery
from backend.jobs.discovery import RecordedProc
from backend.jobs.records import JobRecord

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # the unit of /proc/PID/stat's CPU times and start time
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")  # the unit of its resident set size

ProcessKey = tuple[int, int]  # (pid, start time): a pid alone may be reused between two looks


@dataclass(frozen=True)
class JobUsage:
    cpu_pct: float | None  # None after the first look: CPU % needs two
    rss_bytes: int
    processes: int


@dataclass
class _Look:
    at: float  # monotonic seconds
    boot_ticks: int  # clock ticks since boot at that moment: a process started later was born between two looks
    ticks: dict[ProcessKey, int]


def uptime_ticks() -> int:
    """Clock ticks since boot now, from /proc/uptime (0 when unreadable: then no process counts as newly born)."""
    try:
        return int(float((procs.PROC / "uptime").read_text().split()[0]) * CLOCK_TICKS)
    except (OSError, ValueError, IndexError):
        return 0


class UsageMeter:
    """Measures every running job at each `measure`: its CPU % since the previous look and its resident memory now.

    A process seen at both looks adds the CPU ticks it used in between; one born between them adds all of its ticks;
    one newly found but older (a descendant recorded late) adds nothing this time; one that ended in between takes its
    last ticks with it. RSS adds up each process's resident pages, so memory shared between them is counted once per
    process, as htop's per-process column does."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._looks: dict[int, _Look] = {}  # record id -> its previous look

    def measure(self, records: list[JobRecord], recorded: dict[int, list[RecordedProc]]) -> dict[str, JobUsage]:
        """{job name: usage} for the running ones among `records` (one /proc scan for all of them)."""
        running = [record for record in records if record.info.state == "running"]
        if not running:
            self._looks.clear()
            return {}
        ctx = discovery.scan(records, recorded)
        now, boot_ticks = self._clock(), uptime_ticks()
        usage: dict[str, JobUsage] = {}
        looks: dict[int, _Look] = {}
        for record in running:
            plan = discovery.plan_job(record, ctx)
            stats = [ctx.table.stats[t.pid] for t in [*plan.targets, *plan.protected] if t.pid in ctx.table.stats]
            look = _Look(now, boot_ticks, {(s.pid, s.start_time): s.cpu_ticks for s in stats})
            usage[record.name] = JobUsage(_cpu_pct(self._looks.get(record.id), look), sum(s.rss_pages for s in stats) * PAGE_BYTES, len(stats))
            looks[record.id] = look
        self._looks = looks
        return usage


def _cpu_pct(before: _Look | None, now: _Look) -> float | None:
    if before is None or now.at <= before.at:
        return None
    used = 0
    for key, ticks in now.ticks.items():
        if key in before.ticks:
            used += max(ticks - before.ticks[key], 0)
        elif key[1] >= before.boot_ticks:
            used += ticks
    return 100.0 * used / CLOCK_TICKS / (now.at - before.at)
