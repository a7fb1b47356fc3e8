"""Small standard-library helpers for durable writes: fsync by path, free space, an atomic directory swap, pid liveness."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

from backend.jsonl import free_bytes as free_bytes  # re-exported for checkpoint.py

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_NOT_SUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM}


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _renameat2():
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def exchange_paths(first: Path, second: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux renameat2 RENAME_EXCHANGE).

    False where the kernel, libc or filesystem does not offer it (the caller falls back); other
    failures raise OSError.
    """
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NOT_SUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


def tree_bytes(path: Path) -> int:
    """Bytes the files under `path` hold (0 when it is gone)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def pid_alive(pid: int) -> bool:
    """Signal 0 probe: a pid owned by another user (PermissionError) still counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
