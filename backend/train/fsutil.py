"""Small standard-library helpers for durable writes: fsync by path, new files and staging dirs that never follow a
symbolic link, free space, an atomic directory swap, pid liveness."""

from __future__ import annotations

import ctypes
import hashlib
import errno
import os
import shutil
import tempfile
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


# Create-only, and never through a link: a name that exists (a symbolic link included) fails with FileExistsError.
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_COPY_BLOCK = 1 << 20
PRIVATE_FILE, PRIVATE_DIR = 0o600, 0o700  # checkpoints and exports: readable by this user alone, as the job's logs are


def file_sha256(path: str | os.PathLike) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_COPY_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def write_new_file(path: Path, data: bytes) -> None:
    """Create `path` (it must not exist, not even as a link), write `data`, fsync."""
    fd = os.open(path, _NEW_FILE_FLAGS, PRIVATE_FILE)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def copy_new_file(source: Path, target: Path) -> None:
    """Copy `source`'s bytes into a new `target` (create-only, never through a link), fsync."""
    fd = os.open(target, _NEW_FILE_FLAGS, PRIVATE_FILE)
    with open(source, "rb") as reader, os.fdopen(fd, "wb") as writer:
        shutil.copyfileobj(reader, writer, _COPY_BLOCK)
        writer.flush()
        os.fsync(writer.fileno())


def staging_dir(parent: Path, prefix: str) -> Path:
    """A new, uniquely named directory in `parent` (mkdtemp: no existing name or link is ever reused), mode 0700."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, PRIVATE_DIR)
    return path


def symlink_at_or_under(path: Path) -> Path | None:
    """`path` itself, or the first entry under it, that is a symbolic link (None when there is none).

    A write destination is refused when this finds one: writes never follow a link out of the tree the operator
    named. Links above `path` (a data disk mounted through a link) are left alone.
    """
    if path.is_symlink():
        return path
    if not path.is_dir():
        return None
    for root, dirs, files in os.walk(path):  # os.walk lists linked dirs but does not descend into them
        for name in sorted(dirs + files):
            entry = Path(root) / name
            if entry.is_symlink():
                return entry
    return None


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
