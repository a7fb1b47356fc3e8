"""Who holds the GPUs: NVML/nvidia-smi compute processes plus `fuser` on /dev/nvidia*, each marked owned or foreign."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Callable, Iterable

from backend.host import procs
from backend.protocol import GpuHolder, GpuSample, to_dict

DEVICE_GLOB = "/dev/nvidia*"
_DEVICE_INDEX = re.compile(r"nvidia(\d+)$")
OwnerLookup = Callable[[Iterable[int]], dict[int, str]]


class FuserOutputError(ValueError):
    """fuser's stdout held something other than PIDs: refuse to guess rather than signal or report a wrong PID."""


def parse_fuser_pids(stdout: str) -> list[int]:
    """PIDs from fuser's STDOUT only: ' 448 448 448' (one per file a process holds, no trailing newline).

    Every token must be a PID. Text glued after the PIDs (the '865010, 0 MiB' of a terminal where the
    next command's output ran on) is refused instead of being read as PID 865010.
    """
    pids = []
    for token in stdout.split():
        if not token.isdigit():
            raise FuserOutputError(f"fuser stdout holds {token!r}, which is not a PID; other output was mixed into it")
        pids.append(int(token))
    return pids


@dataclass
class FuserResult:
    state: str  # held | nobody | missing | no_devices | error
    message: str = ""
    printed_pids: list[int] = field(default_factory=list)  # as fuser printed them: one per file a process holds
    stderr_lines: int = 0  # counted, never parsed: fuser's stderr is labels and noise ('Cannot stat file /proc/1/fd/N')

    @property
    def pids(self) -> list[int]:
        return sorted(set(self.printed_pids))


def run_fuser(paths: list[str], fuser: str = "fuser", timeout: float = 30.0) -> FuserResult:
    """One `fuser PATH...` call with stdout and stderr on separate pipes; PIDs come from stdout only.

    Exit status 1 with empty stdout means nobody holds the files; other statuses are reported.
    """
    if not paths:
        return FuserResult("no_devices", "no device files matched; fuser not run")
    exe = fuser if os.sep in fuser else shutil.which(fuser)
    if not exe or not os.access(exe, os.X_OK):
        return FuserResult("missing", f"{fuser} not found (install psmisc); holders come from NVML/nvidia-smi only")
    try:
        done = subprocess.run([exe, *paths], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    except subprocess.TimeoutExpired:
        return FuserResult("error", f"fuser timed out after {timeout:.0f}s on {len(paths)} file(s)")
    result = FuserResult("nobody", stderr_lines=len(done.stderr.splitlines()))
    result.printed_pids = parse_fuser_pids(done.stdout.decode(errors="replace"))
    if result.printed_pids:
        result.state = "held"
    elif done.returncode not in (0, 1):
        result.state = "error"
    held = f"{len(result.pids)} process(es) hold them" if result.pids else "nobody holds them"
    result.message = f"fuser exit {done.returncode}: {len(paths)} file(s) checked, {held}"
    return result


def held_device_indices(pid: int) -> list[int]:
    """GPU indices from the /dev/nvidiaN files a process has open (readlink of /proc/PID/fd/*)."""
    indices = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        index = device_index(target)
        if index is not None and target.startswith("/dev/"):
            indices.add(index)
    return sorted(indices)


def device_paths(device_glob: str = DEVICE_GLOB) -> list[str]:
    return sorted(path for path in glob.glob(device_glob) if not os.path.isdir(path))


def device_index(path: str) -> int | None:
    """/dev/nvidiaN -> N (the device minor, which nvidia-smi's index equals on usual hosts); control files -> None."""
    match = _DEVICE_INDEX.search(path)
    return int(match.group(1)) if match else None


def collect_holders(samples: list[GpuSample], source_name: str, fuser: FuserResult, owners: dict[int, str]) -> list[GpuHolder]:
    """Merge compute processes and fuser PIDs by pid; mark each owned (a job's process) or foreign."""
    by_pid: dict[int, GpuHolder] = {}

    def holder(pid: int) -> GpuHolder:
        return by_pid.setdefault(pid, GpuHolder(pid=pid, owned=False))

    for sample in samples:
        for proc in sample.processes:
            entry = holder(proc.pid)
            _add(entry.gpu_indices, sample.index)
            _add(entry.sources, source_name)
            if proc.used_memory_mib is not None:
                entry.used_memory_mib = (entry.used_memory_mib or 0.0) + proc.used_memory_mib
    for pid in fuser.pids:
        entry = holder(pid)
        _add(entry.sources, "fuser")
        if not entry.gpu_indices:
            entry.gpu_indices.extend(held_device_indices(pid))
    for pid, entry in by_pid.items():
        entry.job = owners.get(pid)
        entry.owned = entry.job is not None
        entry.user = procs.user_of(pid)
        entry.cmdline = procs.cmdline(pid) or "(not visible in this PID namespace)"
        entry.gpu_indices.sort()
    return [by_pid[pid] for pid in sorted(by_pid)]


def _add(items: list, value) -> None:
    if value not in items:
        items.append(value)


@dataclass
class HoldersReport:
    holders: list[GpuHolder]
    fuser: FuserResult
    gpu_source: str

    def to_dict(self) -> dict:
        return {
            "holders": to_dict(self.holders),
            "fuser_stderr_lines": self.fuser.stderr_lines,
            "fuser": {"state": self.fuser.state, "message": self.fuser.message},
            "gpu_source": self.gpu_source,
        }

    @property
    def foreign(self) -> list[GpuHolder]:
        return [holder for holder in self.holders if not holder.owned]


def list_holders(
    gpu_source=None,
    owner_lookup: OwnerLookup | None = None,
    device_glob: str = DEVICE_GLOB,
    fuser: str = "fuser",
) -> HoldersReport:
    """Everything holding a GPU now. owner_lookup(pids) -> {pid: job name} for the pids that are ours."""
    samples = gpu_source.sample() if gpu_source is not None else []
    source_name = gpu_source.name if gpu_source is not None else "none"
    fuser_result = run_fuser(device_paths(device_glob), fuser)
    # The observer itself (NVML keeps /dev/nvidiactl open) is not a holder worth listing.
    fuser_result.printed_pids = [pid for pid in fuser_result.printed_pids if pid != os.getpid()]
    candidates = {proc.pid for sample in samples for proc in sample.processes} | set(fuser_result.pids)
    owners = owner_lookup(sorted(candidates)) if owner_lookup and candidates else {}
    return HoldersReport(collect_holders(samples, source_name, fuser_result, owners), fuser_result, source_name)
