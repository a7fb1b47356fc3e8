"""Small standard-library helpers for durable writes: fsync by path, new files and staging dirs that never follow a
symbolic link, private (0700/0600, ours only) outputs, free space, an atomic directory swap, pid liveness."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_NOT_SUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM}


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


def open_new_file(path: Path) -> BinaryIO:
    """Create `path` for writing, mode 0600 (it must not exist, not even as a link)."""
    return os.fdopen(os.open(path, _NEW_FILE_FLAGS, PRIVATE_FILE), "wb")


def write_new_file(path: Path, data: bytes) -> None:
    """Create `path` (it must not exist, not even as a link), mode 0600, write `data`, fsync."""
    with open_new_file(path) as handle:
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


class ForeignPathError(PermissionError):
    """A path this tool would write into or chmod is a symbolic link or belongs to another user: refused, untouched."""

    def __init__(self, path: Path, why: str):
        self.message = f"{path} {why}; refused, nothing was changed"
        super().__init__(errno.EPERM, self.message, str(path))

    def __str__(self) -> str:
        return self.message


def private_dir(path: Path) -> None:
    """Make `path` (and missing parents) a directory of ours with mode 0700, tightening one that exists.

    Refused with ForeignPathError when it is a symbolic link or another user owns it (their dir could be swapped under us).
    """
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    _tighten(path, PRIVATE_DIR, os.O_RDONLY | os.O_DIRECTORY, stat.S_ISDIR)


def private_file_if_present(path: Path) -> None:
    """Tighten an existing file of ours to 0600 (nothing when it is absent); a link or another user's file is refused."""
    try:
        _tighten(path, PRIVATE_FILE, os.O_RDONLY | os.O_NONBLOCK, stat.S_ISREG)
    except FileNotFoundError:
        pass


def _tighten(path: Path, mode: int, flags: int, is_kind: Callable[[int], bool]) -> None:
    """chmod through a descriptor opened without following a link, after checking who owns what was opened."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and path.is_symlink():
            raise ForeignPathError(path, "is a symbolic link (writes never follow one)") from None
        raise
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise ForeignPathError(path, f"belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()}), who could change what is written there")
        if not is_kind(info.st_mode):
            raise ForeignPathError(path, "is not a " + ("directory" if is_kind is stat.S_ISDIR else "regular file"))
        if stat.S_IMODE(info.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


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


def pid_alive(pid: int) -> bool:
    """Signal 0 probe: a pid owned by another user (PermissionError) still counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
