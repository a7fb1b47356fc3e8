"""The pipe to the host agent: a local subprocess or an SSH session, with reconnect, backoff and host-key policy.

A transport delivers raw agent stdout lines, agent stderr lines and connection status changes on one
queue (`items`), and sends request lines. It never parses data and never signals processes: every
stop goes through the agent's stop_job request (OpenSSH ignores SSH signal requests for root).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import shlex
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from backend.commands import agent_args
from backend.protocol import encode

from console.state import CLOSED, CONNECTED, CONNECTING, FAILED, RECONNECTING, ConnectionStatus

REPO_ROOT = Path(__file__).resolve().parent.parent
LINE_CAP = 64 << 20  # the longest agent line accepted: a 20,000-record metrics_history page is ~10 MiB
STDERR_LINE_CAP = 64 << 10  # a longer diagnostic line is dropped (its size is reported)
READ_CHUNK = 256 << 10
PIPE_LIMIT = 4 << 20  # the local pipe's read buffer; lines longer than it are reassembled by LineReader
ITEMS_MAX = 256  # queued transport items before the reader waits for the client (memory stays bounded)
ITEMS_BYTES_MAX = 2 * LINE_CAP
HELLO_TIMEOUT_S = 30.0
REMOTE_CACHE = ".cache/eagle3-console"
COMPLETE_MARKER = ".eagle3-upload-complete"


class TransportError(Exception):
    """Could not reach the agent; the message says what happened and what to do."""


class FatalTransportError(TransportError):
    """A failure that retrying cannot fix (a refused host key): reconnecting stops."""


class NotConnected(TransportError):
    pass


@dataclass
class AgentLine:
    """One raw line the agent wrote on stdout (decoded by the client)."""

    data: bytes


@dataclass
class LineTooLong:
    """A line over the cap was discarded up to its newline: its size, and its first bytes (a reply names its id there)."""

    size: int
    cap: int
    head: bytes
    stream: str = "stdout"


@dataclass
class AgentStderr:
    """One line of the agent's diagnostic stream; shown, never parsed."""

    text: str


@dataclass
class StatusChanged:
    status: ConnectionStatus


def _read_errors(exc: BaseException) -> bool:
    """Errors of a dropped link (they end the stream); asyncssh raises its own DisconnectError/ConnectionLost."""
    if isinstance(exc, (ConnectionError, OSError, EOFError, asyncio.IncompleteReadError)):
        return True
    return exc.__class__.__module__.startswith("asyncssh")


class LineReader:
    """Newline-framed lines of any length below `cap` from a stream's `read(n)` (asyncio or asyncssh).

    Neither stream's own readline can be trusted with long lines: asyncio raises once its limit is hit and asyncssh
    returns the partial buffer as if it were a line. A line over the cap is discarded up to its newline, holding at
    most `cap` bytes meanwhile, and reported as one LineTooLong; the next line is read normally.
    """

    def __init__(self, read: Callable[[int], Awaitable[bytes | str]], cap: int = LINE_CAP, *, chunk: int = READ_CHUNK, stream: str = "stdout"):
        self._read = read
        self.cap = cap
        self.chunk = chunk
        self.stream = stream
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer known to hold no newline
        self._eof = False

    async def next(self) -> bytes | LineTooLong:
        """The next line with its newline (the last one may lack it); b"" at end of stream."""
        while True:
            end = self._buffer.find(b"\n", self._scanned)
            if end >= 0:
                line = bytes(self._buffer[: end + 1])
                del self._buffer[: end + 1]
                self._scanned = 0
                return line
            self._scanned = len(self._buffer)
            if len(self._buffer) > self.cap:
                return await self._discard()
            if self._eof:
                line, self._buffer, self._scanned = bytes(self._buffer), bytearray(), 0
                return line
            await self._fill()

    async def _fill(self) -> None:
        try:
            data = await self._read(self.chunk)
        except Exception as exc:
            if not _read_errors(exc):
                raise
            data = b""
        if not data:
            self._eof = True
            return
        self._buffer += data if isinstance(data, bytes) else data.encode()

    async def _discard(self) -> LineTooLong:
        head, size = bytes(self._buffer[:256]), len(self._buffer)
        self._buffer.clear()
        while not self._eof:
            await self._fill()
            end = self._buffer.find(b"\n")
            if end >= 0:
                size += end + 1
                del self._buffer[: end + 1]
                break
            size += len(self._buffer)
            self._buffer.clear()
        self._scanned = 0
        return LineTooLong(size=size, cap=self.cap, head=head, stream=self.stream)


class Session:
    """One running agent: its stdin, stdout and stderr, whatever carries them."""

    def __init__(self, stdin: Any, stdout: Any, stderr: Any, *, description: str):
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.description = description
        self.stderr_tail: deque[str] = deque(maxlen=20)
        self._stdout_lines: LineReader | None = None
        self._stderr_lines: LineReader | None = None

    async def readline(self) -> bytes | LineTooLong:
        """Next stdout line (any length below LINE_CAP); a LineTooLong for one over it; b"" at end of stream."""
        if self._stdout_lines is None:
            self._stdout_lines = LineReader(self.stdout.read, LINE_CAP)
        return await self._stdout_lines.next()

    async def read_stderr_line(self) -> bytes | LineTooLong:
        if self._stderr_lines is None:
            self._stderr_lines = LineReader(self.stderr.read, STDERR_LINE_CAP, stream="stderr")
        return await self._stderr_lines.next()

    async def write(self, data: bytes) -> None:
        self.stdin.write(data)
        await self.stdin.drain()

    async def close(self, wait: float = 3.0) -> None:
        raise NotImplementedError


class Transport:
    """Opens sessions, pumps their output onto `items`, and reopens them with backoff after a drop."""

    label = "agent"

    def __init__(self, *, reconnect: bool = True, backoff_initial: float = 0.5, backoff_max: float = 30.0, hello_timeout: float = HELLO_TIMEOUT_S):
        self.items: asyncio.Queue = asyncio.Queue()
        self.reconnect = reconnect
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.hello_timeout = hello_timeout
        self.sessions_opened = 0
        self._session: Session | None = None
        self._supervisor: asyncio.Task | None = None
        self._pumps: list[asyncio.Task] = []
        self._closing = False
        self._last_failure: str | None = None
        self._queued_bytes = 0
        self._room_free = asyncio.Event()
        self._retry_now = asyncio.Event()
        self.waiting_to_retry = False  # between a failed or dropped link and the next try (retry_now cuts it short)

    # -- public -----------------------------------------------------------------------------

    async def start(self, *, retry: bool = False) -> None:
        """Open the first session; raises TransportError (with a clear message) when it cannot.

        With retry, a failure that retrying can fix (host down, network) is retried with backoff like a
        dropped link; only a FatalTransportError (a refused host key) is raised.
        """
        self._emit(CONNECTING, f"connecting to {self.label}")
        try:
            session = await self._open_checked()
        except FatalTransportError:
            raise
        except (TransportError, OSError, asyncio.TimeoutError) as exc:
            if not retry:
                raise
            retried = await self._reconnect(f"first connect failed: {exc}")
            if retried is None:
                raise FatalTransportError(self._last_failure or f"cannot connect to {self.label}") from None
            session = retried
        self._supervisor = asyncio.create_task(self._supervise(session), name=f"transport {self.label}")

    async def send(self, message: dict[str, Any]) -> None:
        session = self._session
        if session is None:
            raise NotConnected(f"not connected to {self.label}")
        try:
            await session.write(encode(message))
        except (ConnectionError, OSError, RuntimeError) as exc:
            raise NotConnected(f"lost the connection to {self.label} while sending: {exc}") from None
        except Exception as exc:
            if exc.__class__.__module__.startswith("asyncssh"):
                raise NotConnected(f"lost the connection to {self.label} while sending: {exc}") from None
            raise

    @property
    def connected(self) -> bool:
        return self._session is not None

    async def close(self, wait: float = 3.0) -> None:
        """Stop reconnecting and end the session; the agent gets `wait` seconds to finish in-flight requests."""
        self._closing = True
        if self._supervisor:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        session, self._session = self._session, None
        if session:
            await session.close(wait)
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        self._emit(CLOSED, "closed")

    def retry_now(self) -> bool:
        """Try to reconnect at once, with the backoff back at its start (key r while disconnected); False when no reconnect
        is waiting (connected, a try already under way, or given up)."""
        if not self.waiting_to_retry:
            return False
        self._retry_now.set()
        return True

    async def drop(self) -> None:
        """Close the current session as if the link had dropped (the supervisor reconnects)."""
        if self._session:
            await self._session.close()

    # -- subclasses ------------------------------------------------------------------------

    async def _open_session(self) -> Session:
        raise NotImplementedError

    # -- machinery -------------------------------------------------------------------------

    def _emit(self, state: str, detail: str, attempt: int = 0, retry_in: float | None = None) -> None:
        status = ConnectionStatus(state=state, detail=detail, since=time.time(), attempt=attempt, retry_in=retry_in)
        self.items.put_nowait(StatusChanged(status))

    async def _open_checked(self) -> Session:
        """Open a session and wait for the agent's first line (its hello) before calling it connected."""
        session = await self._open_session()
        stderr_pump = asyncio.create_task(self._pump_stderr(session))
        try:
            first = await asyncio.wait_for(session.readline(), self.hello_timeout)
        except asyncio.TimeoutError:
            first = None
        if not first:
            await session.close()
            try:
                await asyncio.wait_for(stderr_pump, 1.0)  # collect what it said on the way out
            except asyncio.TimeoutError:
                stderr_pump.cancel()
            tail = " | ".join(session.stderr_tail) or "(no stderr)"
            what = "said nothing" if first is None else "exited"
            raise TransportError(f"the agent on {self.label} {what} before its hello ({session.description}); its stderr: {tail}")
        self.sessions_opened += 1
        self._session = session
        self._pumps = [stderr_pump]
        self._put(AgentLine(first) if isinstance(first, bytes) else first)
        self._emit(CONNECTED, f"connected to {self.label}")
        return session

    async def _pump_stderr(self, session: Session) -> None:
        while True:
            try:
                line = await session.read_stderr_line()
            except Exception:
                return
            if isinstance(line, LineTooLong):
                self._put(AgentStderr(f"(console) dropped an agent stderr line of {line.size} bytes (longer than the {line.cap}-byte cap)"))
                continue
            if not line:
                return
            text = line.decode(errors="replace").rstrip("\n")
            if text.strip():
                session.stderr_tail.append(text)
                self._put(AgentStderr(text))
            await self._room()

    def _put(self, item: Any) -> None:
        self._queued_bytes += len(item.data) if isinstance(item, AgentLine) else 0
        self.items.put_nowait(item)

    async def next_item(self) -> Any:
        """The next queued item (a line, a stderr line, a LineTooLong, a status change), in the order they came."""
        item = await self.items.get()
        if isinstance(item, AgentLine):
            self._queued_bytes -= len(item.data)
        if self._queued_bytes <= ITEMS_BYTES_MAX and self.items.qsize() < ITEMS_MAX:
            self._room_free.set()
        return item

    async def _room(self) -> None:
        """Wait while the client is behind (too many items or bytes queued): the host's output waits in the pipe."""
        if self._queued_bytes > ITEMS_BYTES_MAX or self.items.qsize() >= ITEMS_MAX:
            self._room_free.clear()
            await self._room_free.wait()
        else:
            await asyncio.sleep(0)  # a flood of buffered lines must not starve the UI: let the loop run between lines

    async def _pump_stdout(self, session: Session) -> str:
        while True:
            line = await session.readline()
            if isinstance(line, LineTooLong):
                self._put(line)
            elif not line:
                return "the agent's output ended"
            elif line.strip():  # asyncssh can yield a trailing empty read at EOF
                self._put(AgentLine(line))
            await self._room()

    async def _supervise(self, session: Session) -> None:
        while True:
            reason = await self._pump_stdout(session)
            self._session = None
            await session.close()
            if self._closing:
                return
            if not self.reconnect:
                self._emit(FAILED, f"{reason}; not reconnecting")
                return
            again = await self._reconnect(reason)
            if again is None:
                return
            session = again

    async def _reconnect(self, reason: str) -> Session | None:
        delay = self.backoff_initial
        attempt = 0
        detail = reason if reason.startswith("first connect") else f"connection lost ({reason})"
        while not self._closing:
            attempt += 1
            wait = delay * random.uniform(0.8, 1.2)
            self._emit(RECONNECTING, detail, attempt=attempt, retry_in=wait)
            hurried = await self._wait_to_retry(wait)
            self._emit(RECONNECTING, detail, attempt=attempt)  # no retry_in: this try is under way
            try:
                return await self._open_checked()
            except FatalTransportError as exc:
                self._last_failure = str(exc)
                self._emit(FAILED, str(exc), attempt=attempt)
                return None
            except (TransportError, OSError, asyncio.TimeoutError) as exc:
                detail = f"reconnect attempt {attempt} failed: {exc}"
            delay = self.backoff_initial if hurried else min(delay * 2, self.backoff_max)
        return None

    async def _wait_to_retry(self, wait: float) -> bool:
        """Sleep `wait` seconds before the next try, or less when retry_now() is called; True when it was."""
        self._retry_now.clear()
        self.waiting_to_retry = True
        try:
            await asyncio.wait_for(self._retry_now.wait(), wait)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self.waiting_to_retry = False


# -- local subprocess ----------------------------------------------------------------------


class _LocalSession(Session):
    def __init__(self, process: asyncio.subprocess.Process, description: str):
        super().__init__(process.stdin, process.stdout, process.stderr, description=description)
        self.process = process

    async def close(self, wait: float = 3.0) -> None:
        process = self.process
        if process.returncode is not None:
            return
        try:
            if process.stdin is not None:
                process.stdin.close()  # the agent exits at end of input; its jobs run on in their own sessions
        except (OSError, RuntimeError):
            pass
        try:
            await asyncio.wait_for(process.wait(), wait)  # it first finishes in-flight requests (a stop's grace)
        except asyncio.TimeoutError:
            process.terminate()  # our own agent process, never a job
            try:
                await asyncio.wait_for(process.wait(), 3.0)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()


class LocalTransport(Transport):
    """The agent as a child process of the console (`python -m backend.agent --run-dir DIR`)."""

    def __init__(self, run_dir: str | os.PathLike, *, python: str = sys.executable, root: Path = REPO_ROOT, **kwargs: Any):
        super().__init__(**kwargs)
        self.run_dir = Path(run_dir).expanduser()
        self.python = python
        self.root = root
        self.label = "local"

    async def _open_session(self) -> Session:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.root), env.get("PYTHONPATH", "")) if p)
        argv = [self.python, *agent_args(str(self.run_dir))]
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=str(self.root),
                env=env,
                limit=PIPE_LIMIT,
            )
        except OSError as exc:
            raise TransportError(f"cannot start the local agent ({shlex.join(argv)}): {exc}") from None
        return _LocalSession(process, shlex.join(argv))


# -- SSH -----------------------------------------------------------------------------------


def backend_files(root: Path = REPO_ROOT, extra: Sequence[tuple[str, Path]] = ()) -> list[tuple[str, bytes]]:
    """The files the host needs to run the agent and `eagle3-host`: backend/**/*.py and profiles/*.toml."""
    files = []
    for path in sorted((root / "backend").rglob("*.py")):
        if "__pycache__" not in path.parts:
            files.append((path.relative_to(root).as_posix(), path.read_bytes()))
    for path in sorted((root / "profiles").glob("*.toml")):
        files.append((path.relative_to(root).as_posix(), path.read_bytes()))
    for relative, path in extra:
        files.append((relative, Path(path).read_bytes()))
    return files


def content_hash(files: Sequence[tuple[str, bytes]]) -> str:
    digest = hashlib.sha256()
    for relative, data in sorted(files):
        digest.update(relative.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return digest.hexdigest()[:16]


def remote_path_expr(path: str) -> str:
    """A shell word for a host path; a leading ~ becomes "$HOME" so it expands on the host."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


class _KnownHostsPolicy:
    """known_hosts lookup that remembers whether the host had any entry (unknown vs changed key)."""

    def __init__(self, files: list[str]):
        self.files = files
        self.had_entries = False
        self.host: str | None = None
        self.port: int | None = None

    def __call__(self, host: str, addr: str, port: int | None) -> Any:
        import asyncssh

        self.host, self.port = host, port
        existing = [f for f in self.files if Path(f).expanduser().is_file()]
        known = asyncssh.read_known_hosts([str(Path(f).expanduser()) for f in existing]) if existing else asyncssh.SSHKnownHosts()
        result = known.match(host, addr, port)
        host_keys, ca_keys = result[0], result[1]
        self.had_entries = bool(host_keys or ca_keys)
        return result

    @property
    def pattern(self) -> str:
        host = self.host or "?"
        return host if self.port in (None, 22) else f"[{host}]:{self.port}"


class _SSHSession(Session):
    def __init__(self, conn: Any, process: Any, description: str):
        super().__init__(process.stdin, process.stdout, process.stderr, description=description)
        self.conn = conn
        self.process = process

    async def close(self, wait: float = 3.0) -> None:
        # Over SSH the host's agent sees end of input and finishes in-flight requests on its own.
        try:
            self.process.stdin.write_eof()  # the agent exits at end of input
        except Exception:
            pass
        self.process.close()
        self.conn.close()
        try:
            await asyncio.wait_for(self.conn.wait_closed(), 3.0)
        except Exception:
            pass


class SSHTransport(Transport):
    """The agent on a remote host over asyncssh: host-key policy, upload-if-changed, keepalive."""

    def __init__(
        self,
        host: str,
        *,
        port: int | None = None,
        user: str | None = None,
        identity: str | None = None,
        known_hosts: str | None = None,
        accept_new_host_key: bool = False,
        python: str = "python3",
        run_dir: str = "~/.eagle3",
        root: Path = REPO_ROOT,
        extra_files: Sequence[tuple[str, Path]] = (),
        config: Any = (),
        keepalive_interval: float = 10.0,
        keepalive_count_max: int = 3,
        connect_timeout: float = 15.0,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.host = host
        self.port = port
        self.user = user
        self.identity = identity
        self.known_hosts = known_hosts
        self.accept_new_host_key = accept_new_host_key
        self.python = python
        self.run_dir = run_dir
        self.root = root
        self.extra_files = list(extra_files)
        self.config = config
        self.keepalive_interval = keepalive_interval
        self.keepalive_count_max = keepalive_count_max
        self.connect_timeout = connect_timeout
        self.label = f"{user + '@' if user else ''}{host}{':' + str(port) if port else ''}"
        self.uploads = 0
        self.upload_method: str | None = None
        self.remote_dir: str | None = None
        self.backend_hash: str | None = None
        self.host_key_added: str | None = None

    async def _open_session(self) -> Session:
        conn = await self._connect()
        try:
            remote_dir = await self._ensure_agent(conn)
            command = (
                f"cd {shlex.quote(remote_dir)} && EAGLE3_BACKEND_HASH={self.backend_hash} "
                f"exec {' '.join(remote_path_expr(word) for word in [self.python, *agent_args(self.run_dir)])}"
            )
            process = await conn.create_process(command, encoding=None)
        except BaseException:
            conn.close()
            raise
        return _SSHSession(conn, process, command)

    # -- connecting with the host-key policy --------------------------------------------------

    async def _connect(self) -> Any:
        import asyncssh

        options = await self._options()
        files = self._known_hosts_files(options)
        policy = _KnownHostsPolicy(files)
        try:
            return await asyncssh.connect(self.host, options=options, known_hosts=policy)
        except asyncssh.HostKeyNotVerifiable:
            return await self._unverified_host_key(options, policy)
        except asyncssh.PermissionDenied as exc:
            raise TransportError(
                f"authentication to {self.label} failed ({exc.reason}); tried "
                f"{self.identity or 'the ssh agent and ~/.ssh/id_* keys'}. Nothing was started on the host."
            ) from None
        except asyncssh.Error as exc:
            raise TransportError(f"SSH to {self.label} failed: {exc.reason}") from None
        except (OSError, asyncio.TimeoutError) as exc:
            raise TransportError(f"cannot reach {self.label}: {exc or type(exc).__name__}") from None

    async def _options(self) -> Any:
        import asyncssh

        kwargs: dict[str, Any] = {
            "host": self.host,
            "config": self.config,
            "keepalive_interval": self.keepalive_interval,
            "keepalive_count_max": self.keepalive_count_max,
            "connect_timeout": self.connect_timeout,
        }
        if self.port:
            kwargs["port"] = self.port
        if self.user:
            kwargs["username"] = self.user
        if self.identity:
            kwargs["client_keys"] = [str(Path(self.identity).expanduser())]
        if self.known_hosts:
            kwargs["known_hosts"] = str(Path(self.known_hosts).expanduser())
        try:
            return await asyncssh.SSHClientConnectionOptions.construct(**kwargs)
        except (OSError, ValueError, asyncssh.Error) as exc:
            raise FatalTransportError(f"bad SSH settings for {self.label}: {exc}") from None

    def _known_hosts_files(self, options: Any) -> list[str]:
        if self.known_hosts:
            return [str(Path(self.known_hosts).expanduser())]
        configured = options.known_hosts
        if configured is None:
            return []  # the ssh config turned checking off (UserKnownHostsFile none)
        if isinstance(configured, (list, tuple)) and configured and all(isinstance(f, str) for f in configured):
            return [str(Path(f).expanduser()) for f in configured]
        return [str(Path("~/.ssh/known_hosts").expanduser())]

    async def _unverified_host_key(self, options: Any, policy: _KnownHostsPolicy) -> Any:
        import asyncssh

        presented = await self._fetch_host_key()
        shown = f"{presented.get_algorithm()} {presented.get_fingerprint()}" if presented else "(could not read it)"
        files = ", ".join(policy.files) or "(no known_hosts file)"
        if policy.had_entries:
            # ssh-keygen -R alone edits ~/.ssh/known_hosts: name each file this console checked, the one in use first
            removal = "; ".join(f"ssh-keygen -f {shlex.quote(f)} -R {shlex.quote(policy.pattern)}" for f in policy.files) or (
                f"ssh-keygen -R {shlex.quote(policy.pattern)}"
            )
            raise FatalTransportError(
                f"REFUSED: the host key of {policy.pattern} has CHANGED. {files} lists a different key; the server "
                f"now presents {shown}. This can be a man-in-the-middle attack or a reinstalled host. Nothing was sent "
                f"to the host. If the change is expected, remove the old entry ({removal}) and "
                f"reconnect; the console never replaces a known key."
            )
        if not self.accept_new_host_key or presented is None:
            raise FatalTransportError(
                f"REFUSED: {policy.pattern} is not in known_hosts ({files}); it presents {shown}. Nothing was sent "
                f"to the host. Check that fingerprint with the host's owner, then rerun with --accept-new-host-key "
                f"(it appends the key to {policy.files[0] if policy.files else '~/.ssh/known_hosts'})."
            )
        self._append_known_host(policy, presented)
        try:
            return await asyncssh.connect(self.host, options=options, known_hosts=_KnownHostsPolicy(policy.files))
        except asyncssh.HostKeyNotVerifiable:
            raise FatalTransportError(f"REFUSED: {policy.pattern} presented a different host key right after {shown} was accepted; nothing was sent.") from None

    async def _fetch_host_key(self) -> Any:
        import asyncssh

        try:
            return await asyncssh.get_server_host_key(self.host, self.port or (), config=self.config)
        except (OSError, asyncssh.Error, asyncio.TimeoutError):
            return None

    def _append_known_host(self, policy: _KnownHostsPolicy, key: Any) -> None:
        target = Path(policy.files[0] if policy.files else "~/.ssh/known_hosts").expanduser()
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        public = " ".join(key.export_public_key("openssh").decode().split()[:2])
        line = f"{policy.pattern} {public}\n"
        existing = target.read_bytes() if target.exists() else b""
        with open(target, "ab") as handle:
            if existing and not existing.endswith(b"\n"):
                handle.write(b"\n")
            handle.write(line.encode())
        os.chmod(target, 0o600)
        self.host_key_added = f"added {policy.pattern} {key.get_algorithm()} {key.get_fingerprint()} to {target}"

    # -- uploading the backend ------------------------------------------------------------------

    async def _ensure_agent(self, conn: Any) -> str:
        """Upload backend/ + profiles/ to ~/.cache/eagle3-console/agent-<hash>/ unless the marker there names that hash."""
        files = await asyncio.to_thread(backend_files, self.root, self.extra_files)
        self.backend_hash = content_hash(files)
        home = await self._run_text(conn, 'printf %s "$HOME"')
        base = f"{home.rstrip('/')}/{REMOTE_CACHE}"
        target = f"{base}/agent-{self.backend_hash}"
        q_target = shlex.quote(target)
        marker = await self._run_text(conn, f"cat {q_target}/{COMPLETE_MARKER} 2>/dev/null || true")
        if marker.strip() == self.backend_hash:
            self.remote_dir = target
            return target
        staging = f"{base}/.upload-{self.backend_hash}-{os.getpid()}-{random.randrange(1 << 30):x}"
        try:
            await self._upload_sftp(conn, staging, files)
        except Exception as exc:  # asyncssh.ChannelOpenError/SFTPError: the host has no sftp subsystem
            if not exc.__class__.__module__.startswith("asyncssh"):
                raise
            await self._upload_tar(conn, staging, files)
        q_staging = shlex.quote(staging)
        # Publish the complete directory in one rename; a concurrent console that won the race keeps its copy.
        await conn.run(
            f"if [ -f {q_target}/{COMPLETE_MARKER} ]; then rm -rf {q_staging}; else rm -rf {q_target} && mv -T {q_staging} {q_target}; fi",
            check=True,
        )
        self.uploads += 1
        self.remote_dir = target
        return target

    @staticmethod
    async def _run_text(conn: Any, command: str) -> str:
        result = await conn.run(command, check=True)
        out = result.stdout
        return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")

    def _hash(self) -> str:
        if self.backend_hash is None:
            raise TransportError("internal: the backend was not hashed before its upload")
        return self.backend_hash

    async def _upload_sftp(self, conn: Any, staging: str, files: list[tuple[str, bytes]]) -> None:
        async with conn.start_sftp_client() as sftp:
            await sftp.makedirs(staging, exist_ok=True)
            await self._put_files(sftp, staging, files)
            async with sftp.open(f"{staging}/{COMPLETE_MARKER}", "wb") as handle:
                await handle.write(self._hash().encode())
        self.upload_method = "sftp"

    async def _upload_tar(self, conn: Any, staging: str, files: list[tuple[str, bytes]]) -> None:
        """Fallback for hosts without an sftp subsystem: one tar stream into `tar -x` over an exec channel."""
        import io
        import tarfile

        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
            for relative, data in [*files, (COMPLETE_MARKER, self._hash().encode())]:
                info = tarfile.TarInfo(relative)
                info.size = len(data)
                info.mode = 0o644
                archive.addfile(info, io.BytesIO(data))
        q_staging = shlex.quote(staging)
        await conn.run(f"mkdir -p {q_staging} && tar -xzf - -C {q_staging}", input=buffer.getvalue(), encoding=None, check=True)
        self.upload_method = "tar"

    @staticmethod
    async def _put_files(sftp: Any, staging: str, files: list[tuple[str, bytes]]) -> None:
        directories = sorted({str(Path(relative).parent) for relative, _ in files if str(Path(relative).parent) != "."})
        for directory in directories:
            await sftp.makedirs(f"{staging}/{directory}", exist_ok=True)

        async def put(relative: str, data: bytes) -> None:
            async with sftp.open(f"{staging}/{relative}", "wb") as handle:
                await handle.write(data)

        for start in range(0, len(files), 16):
            await asyncio.gather(*(put(r, d) for r, d in files[start : start + 16]))
