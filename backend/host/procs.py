"""Reading /proc (process identity, parents, groups, owners, command lines, trees), identity-checked signals and job cgroups (v2)."""

from __future__ import annotations

import os
import pwd
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, TypeGuard

PROC = Path("/proc")
GONE_STATES = frozenset("ZX")  # zombie or dead: the process no longer runs, whatever /proc still shows
STOPPED_STATES = frozenset("tT")  # stopped by a signal (or traced): it cannot fork until continued
PF_KTHREAD = 0x00200000  # /proc/PID/stat flags bit of a kernel thread
CGROUP_DIR_NAME = "eagle3-jobs"  # the cgroup under which every job gets its own cgroup
CGROUP_PREFIX = "job-"
CGROUPS_ENV = "EAGLE3_CGROUPS"  # "0" turns job cgroups off (the freeze-walk stop is used instead)


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
    flags: int = 0  # field 9, the kernel's PF_* flags
    cpu_ticks: int = 0  # fields 14 + 15, utime + stime: CPU time used so far, in clock ticks
    rss_pages: int = 0  # field 24, resident set size in pages (the same counter as /proc/PID/statm's second field)

    @property
    def running(self) -> bool:
        return self.state not in GONE_STATES

    @property
    def stopped(self) -> bool:
        return self.state in STOPPED_STATES

    @property
    def kernel_thread(self) -> bool:
        return bool(self.flags & PF_KTHREAD) or self.pid == 2 or self.ppid == 2


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
        flags=int(rest[6]),
        cpu_ticks=int(rest[11]) + int(rest[12]),
        rss_pages=int(rest[21]),
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


def environ_values(pid: int, keys: tuple[str, ...]) -> dict[str, str]:
    """The variables among `keys` that the process was started with (empty when its environment is unreadable)."""
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    wanted = {key.encode() + b"=": key for key in keys}
    found = {}
    for entry in raw.split(b"\0"):
        name, equals, _ = entry.partition(b"=")
        key = wanted.get(name + equals)
        if key is not None:
            found[key] = entry[len(name) + 1 :].decode(errors="replace")
    return found


def stdio_files(pid: int) -> dict[str, str]:
    """{"stdout"|"stderr": path} for those of the process's fd 1 and 2 that are files (not pipes, sockets or ttys)."""
    found = {}
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            target = os.readlink(PROC / str(pid) / "fd" / str(fd))
        except OSError:
            continue
        if target.startswith("/") and not target.startswith("/dev/"):
            found[name] = target.removesuffix(" (deleted)")
    return found


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

    def session(self, sid: int) -> list[int]:
        return sorted(pid for pid, stat in self.stats.items() if stat.sid == sid and stat.running)

    def descendants_of(self, roots: Iterable[int], prune: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """Every process below any of `roots` (the roots themselves not listed unless below another root)."""
        found: set[int] = set()
        stack = [child for root in roots for child in self.children.get(root, [])]
        while stack:
            child = stack.pop()
            if child in found or child in prune:
                continue
            found.add(child)
            stack.extend(self.children.get(child, []))
        return sorted(found)


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


def is_stopped(pid: int, start: int) -> bool:
    """True when the process started at `start` is stopped (or gone): it can no longer fork."""
    stat = read_stat(pid)
    return stat is None or stat.start_time != start or not stat.running or stat.stopped


def freeze(discover: Callable[[], dict[int, int]], timeout: float = 5.0) -> tuple[dict[int, int], bool]:
    """SIGSTOP every process discover() lists ({pid: start time}) until a fresh look finds none still moving.

    A stopped process cannot fork, so once a round finds nothing new and nothing running, the set is complete.
    SIGSTOP is sent again to one that was continued meanwhile. Returns (every process seen, settled in time).
    """
    seen: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while True:
        found = discover()
        seen.update(found)
        moving = {pid: start for pid, start in found.items() if not is_stopped(pid, start)}
        for pid, start in moving.items():
            send_signal(pid, start, signal.SIGSTOP)
        if not moving:
            return seen, True
        if time.monotonic() >= deadline:
            return seen, False
        _wait_until_stopped(moving, min(0.2, max(0.0, deadline - time.monotonic())))


def _wait_until_stopped(pids: dict[int, int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(not is_stopped(pid, start) for pid, start in pids.items()) and time.monotonic() < deadline:
        time.sleep(0.002)


# ---------------------------------------------------------------- job cgroups (cgroup v2)


def cgroup2_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified on hybrid hosts)."""
    try:
        lines = (PROC / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] == "cgroup2":
            return Path(left.split()[4].encode().decode("unicode_escape"))
    return None


def cgroup_of(pid: int) -> str | None:
    """The v2 cgroup path of a process ('/a/b'), from its '0::' line of /proc/PID/cgroup."""
    try:
        lines = (PROC / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return line[3:].removesuffix(" (deleted)")
    return None


def job_cgroup_base() -> Path | None:
    """The cgroup that holds job cgroups: eagle3-jobs under our own cgroup (or the one we already sit under)."""
    if os.environ.get(CGROUPS_ENV) == "0":
        return None
    mount, own = cgroup2_mount(), cgroup_of(os.getpid())
    if mount is None or own is None:
        return None
    parts = [part for part in own.split("/") if part]
    if CGROUP_DIR_NAME in parts:  # started from inside a job: job cgroups are siblings, never nested in another job's
        parts = parts[: parts.index(CGROUP_DIR_NAME)]
    return mount.joinpath(*parts, CGROUP_DIR_NAME)


def create_job_cgroup(key: str) -> Path | None:
    """A fresh cgroup for one job, or None where cgroup v2 is missing, read-only or too old for cgroup.kill."""
    base = job_cgroup_base()
    if base is None:
        return None
    path = base / f"{CGROUP_PREFIX}{key}"
    try:
        base.mkdir(mode=0o755, exist_ok=True)
        path.mkdir(mode=0o755)
    except OSError:
        return None
    if all((path / name).exists() for name in ("cgroup.procs", "cgroup.freeze", "cgroup.kill", "cgroup.events")):
        return path
    remove_cgroup(path)
    return None


def is_job_cgroup(path: str | Path | None) -> TypeGuard[str | Path]:
    """A path this module could have made: a job-* cgroup directly under an eagle3-jobs cgroup."""
    if not path:
        return False
    path = Path(path)
    return path.name.startswith(CGROUP_PREFIX) and path.parent.name == CGROUP_DIR_NAME and (path / "cgroup.kill").exists()


def enter_cgroup(path: str | Path, pid: int = 0) -> bool:
    """Move pid (0: the caller) into the cgroup. Safe to call between fork and exec."""
    try:
        fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY)
        try:
            os.write(fd, str(pid).encode())
        finally:
            os.close(fd)
        return True
    except OSError:
        return False


def _cgroup_write(path: Path, name: str, value: str) -> bool:
    try:
        (path / name).write_text(value)
        return True
    except OSError:
        return False


def _cgroup_events(path: Path) -> dict[str, int]:
    try:
        lines = (path / "cgroup.events").read_text().splitlines()
    except OSError:
        return {}
    return {key: int(value) for key, value in (line.split() for line in lines if len(line.split()) == 2)}


def cgroup_pids(path: str | Path) -> list[int]:
    """Every process in the cgroup and the cgroups below it."""
    pids: set[int] = set()
    for directory, _, _ in os.walk(path):
        try:
            pids.update(int(line) for line in Path(directory, "cgroup.procs").read_text().split())
        except (OSError, ValueError):
            continue
    return sorted(pids)


def cgroup_populated(path: str | Path) -> bool:
    return _cgroup_events(Path(path)).get("populated", 0) == 1


def cgroup_freeze(path: str | Path, timeout: float = 2.0) -> bool:
    """Freeze every process of the cgroup (none can fork afterwards); True once the kernel reports it frozen."""
    path = Path(path)
    if not _cgroup_write(path, "cgroup.freeze", "1"):
        return False
    deadline = time.monotonic() + timeout
    while _cgroup_events(path).get("frozen") != 1:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def cgroup_kill(path: str | Path, timeout: float = 5.0) -> bool:
    """SIGKILL every process of the cgroup at once (frozen ones too); True once it is empty."""
    path = Path(path)
    if not _cgroup_write(path, "cgroup.kill", "1"):
        return False
    deadline = time.monotonic() + timeout
    while cgroup_populated(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def remove_cgroup(path: str | Path) -> bool:
    """rmdir the cgroup and any empty cgroups below it; False while a process is still inside."""
    removed = True
    for directory, _, _ in sorted(os.walk(path), key=lambda entry: -len(entry[0])):
        try:
            os.rmdir(directory)
        except FileNotFoundError:
            continue
        except OSError:
            removed = False
    return removed
