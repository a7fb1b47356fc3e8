"""Reading /proc: process identity (pid + start time), parents, groups, owners, command lines and process trees."""
from __future__ import annotations

import os
import pwd
import signal
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
GONE_STATES = frozenset("ZX")  # zombie or dead: the process no longer runs, whatever /proc still shows


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/PID/stat this project uses."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgid: int
    sid: int
    start_time: int  # field 22, clock ticks since boot: with pid, the identity of a process

    @property
    def running(self) -> bool:
        return self.state not in GONE_STATES


def parse_stat(text: str) -> ProcStat:
    """Parse one /proc/PID/stat line. comm may hold spaces and ')' so fields are split after the LAST ')'."""
    open_paren = text.index("(")
    close_paren = text.rindex(")")
    pid = int(text[:open_paren])
    comm = text[open_paren + 1 : close_paren]
    rest = text[close_paren + 2 :].split()
    # rest[0] is field 3 (state); field N is rest[N - 3].
    return ProcStat(
        pid=pid,
        comm=comm,
        state=rest[0],
        ppid=int(rest[1]),
        pgid=int(rest[2]),
        sid=int(rest[3]),
        start_time=int(rest[19]),
    )


def read_stat(pid: int) -> ProcStat | None:
    """The stat of a process, or None when there is no such process (or it vanished while being read)."""
    try:
        return parse_stat((PROC / str(pid) / "stat").read_text())
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return None
    except PermissionError:
        return None


def start_time(pid: int) -> int | None:
    stat = read_stat(pid)
    return stat.start_time if stat else None


def pgid_of(pid: int) -> int | None:
    stat = read_stat(pid)
    return stat.pgid if stat else None


def ppid_of(pid: int) -> int | None:
    stat = read_stat(pid)
    return stat.ppid if stat else None


def identity(pid: int) -> tuple[int, int] | None:
    """(pid, start time): a pid alone can be reused by an unrelated program, the pair cannot."""
    stat = read_stat(pid)
    return (pid, stat.start_time) if stat and stat.running else None


def is_alive(pid: int, start: int | None = None) -> bool:
    """True when pid runs (not a zombie) and, if start is given, is the same process that started then."""
    stat = read_stat(pid)
    if stat is None or not stat.running:
        return False
    return start is None or stat.start_time == start


def uid_of(pid: int) -> int | None:
    """Real uid from the Uid: line of /proc/PID/status."""
    try:
        text = (PROC / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return None


def user_name(uid: int | None) -> str:
    if uid is None:
        return ""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def user_of(pid: int) -> str:
    return user_name(uid_of(pid))


def cmdline_args(pid: int) -> list[str]:
    """argv of a process; empty for kernel threads, zombies and vanished processes."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def cmdline(pid: int) -> str:
    """The command line as one string; falls back to [comm] when argv is empty."""
    args = cmdline_args(pid)
    if args:
        return " ".join(args)
    stat = read_stat(pid)
    return f"[{stat.comm}]" if stat else ""


def environ_value(pid: int, key: str) -> str | None:
    """One variable of the environment a process was started with (None when unreadable or unset)."""
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    prefix = key.encode() + b"="
    for entry in raw.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def list_pids() -> list[int]:
    return sorted(int(name) for name in os.listdir(PROC) if name.isdigit())


def ancestors(pid: int) -> list[int]:
    """pid's parent, grandparent, ... up to (not including) pid 0."""
    chain = []
    stat = read_stat(pid)
    while stat is not None and stat.ppid > 0 and stat.ppid not in chain:
        chain.append(stat.ppid)
        stat = read_stat(stat.ppid)
    return chain


@dataclass
class ProcTable:
    """One scan of /proc: every process's stat, with a children map built from ppid."""

    stats: dict[int, ProcStat] = field(default_factory=dict)
    children: dict[int, list[int]] = field(default_factory=dict)

    @classmethod
    def scan(cls) -> "ProcTable":
        table = cls()
        for pid in list_pids():
            stat = read_stat(pid)
            if stat is not None:
                table.stats[pid] = stat
                table.children.setdefault(stat.ppid, []).append(pid)
        return table

    def alive(self, pid: int, start: int | None = None) -> bool:
        stat = self.stats.get(pid)
        return stat is not None and stat.running and (start is None or stat.start_time == start)

    def descendants(self, pid: int, prune: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """Every process below pid in the ppid tree (a child that called setsid is still a child).

        A pid in `prune` is neither listed nor walked into.
        """
        found: set[int] = set()
        stack = list(self.children.get(pid, []))
        while stack:
            child = stack.pop()
            if child in found or child == pid or child in prune:
                continue
            found.add(child)
            stack.extend(self.children.get(child, []))
        return sorted(found)

    def group(self, pgid: int) -> list[int]:
        return sorted(pid for pid, stat in self.stats.items() if stat.pgid == pgid and stat.running)


def descendants(pid: int) -> list[int]:
    """Descendants of pid from a fresh /proc scan."""
    return ProcTable.scan().descendants(pid)


def send_signal(pid: int, start: int, signum: int) -> bool:
    """Signal pid only if it is still the process that started at `start`.

    A pidfd pins the process first, so a pid reused between the check and the kill cannot be hit.
    Returns False when the process is gone or is now another program.
    """
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError:
            pidfd = None
    try:
        stat = read_stat(pid)
        if stat is None or stat.start_time != start:
            return False
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signum)
        else:
            os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False
    finally:
        if pidfd is not None:
            os.close(pidfd)
