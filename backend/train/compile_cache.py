"""torch.compile's work carried between machines: its cache artifacts, loaded before the first compile and saved after.

On a fresh H200 the draft's compiled regions cost ~55 s before training runs at speed (round 17: a 27.7 s step-0
validation, then 2.9 s a step for the first ten). A lent machine starts cold every session, so each round paid it
again. With EAGLE3_COMPILE_CACHE=FILE the trainer loads FILE (torch.compiler.load_cache_artifacts: Inductor's graphs,
AOTAutograd's, the Triton kernels) before it compiles anything, and writes what this run compiled or reused back to
FILE when it ends (torch.compiler.save_cache_artifacts), so the file can travel with the next run's inputs. The same
torch, Triton and GPU are what make an artifact a hit; anything else is a miss and compiles as before. Measured on this
project's CPU (a toy function): the artifacts of one process gave the next one cache hits for every graph.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

from backend.durable import write_atomic
from backend.train.fsutil import ForeignPathError, private_file_if_present

ENV = "EAGLE3_COMPILE_CACHE"


def cache_file(environ: Mapping[str, str], role: str | None = None) -> Path | None:
    """The artifacts file EAGLE3_COMPILE_CACHE names, or None. With a role, a file of that role's beside it
    (compile_artifacts.bin -> compile_artifacts-serve.bin): a save writes only what its own process compiled, so
    processes that compile other graphs (the trainer, a server) keep a file each instead of overwriting one."""
    value = environ.get(ENV, "").strip()
    if not value:
        return None
    path = Path(value).expanduser()
    return path if role is None else path.with_name(f"{path.stem}-{role}{path.suffix}")


def _count(info) -> int:
    return sum(len(keys) for keys in getattr(info, "artifacts", {}).values())


def load_artifacts(path: Path, log: Callable[[str], None]) -> None:
    """Hand FILE's artifacts to torch's compile caches; a missing, unreadable or foreign file only says so."""
    if not path.is_file():
        log(f"compile cache: none at {path} yet; this run compiles and writes it")
        return
    try:  # torch unpickles the artifacts and runs the code in them: a link or another user's file is refused first
        private_file_if_present(path)
    except ForeignPathError as exc:
        log(f"compile cache: {exc}; compiling as usual")
        return
    try:
        import torch

        data = path.read_bytes()
        info = torch.compiler.load_cache_artifacts(data)
    except Exception as exc:  # noqa: BLE001 - another torch's file, a truncated one: compile as usual
        log(f"compile cache: {path} not loaded ({type(exc).__name__}: {exc}); compiling as usual")
        return
    if not _count(info):  # torch reads bytes it does not recognise as an empty set
        log(f"compile cache: {path} holds nothing this torch can use; compiling as usual")
        return
    log(f"compile cache: {_count(info)} artifact(s), {len(data) / 1e6:.1f} MB, from {path}")


def save_artifacts(path: Path, log: Callable[[str], None]) -> None:
    """Write what this process compiled or took from the cache to FILE (atomically); nothing compiled, nothing written."""
    try:
        import torch

        saved = torch.compiler.save_cache_artifacts()
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be written costs the next run its compile time only
        log(f"compile cache: not saved ({type(exc).__name__}: {exc})")
        return
    if saved is None or not _count(saved[1]):
        return
    data, info = saved
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    log(f"compile cache: {_count(info)} artifact(s), {len(data) / 1e6:.1f} MB, written to {path}")
