"""SSH servers on 127.0.0.1 for the console's tests: an in-process asyncssh server and a real OpenSSH sshd.

Both run real commands with real subprocesses; keys, known_hosts and the "remote" HOME live under
tmp_path, so the developer's ~/.ssh is never read or written.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import asyncssh

from backend.serve.http import free_port
from console.transport import SSHTransport

SSHD = "/usr/sbin/sshd"


@dataclass
class SSHEnv:
    """Where a test's client finds its keys and known_hosts, and what the server's HOME is."""

    port: int
    client_key: Path
    known_hosts: Path
    remote_home: Path
    host_public_key: str  # "ssh-ed25519 AAAA..."
    user: str = field(default_factory=lambda: os.environ.get("USER") or "root")

    def pin_host_key(self, public_key: str | None = None) -> None:
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {public_key or self.host_public_key}\n")


def make_client_files(root: Path) -> tuple[Path, Path, Path]:
    """A client key pair and an empty known_hosts under root."""
    root.mkdir(parents=True, exist_ok=True)
    key = asyncssh.generate_private_key("ssh-ed25519")
    client_key = root / "id_ed25519"
    key.write_private_key(str(client_key))
    os.chmod(client_key, 0o600)
    key.write_public_key(str(client_key) + ".pub")
    known_hosts = root / "known_hosts"
    known_hosts.write_text("")
    return client_key, Path(str(client_key) + ".pub"), known_hosts


def other_host_public_key() -> str:
    """A host key that belongs to nobody: for pinning a wrong key."""
    return asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()


# -- in-process asyncssh server ----------------------------------------------------------------


class InProcessSSHServer:
    """asyncssh.listen on 127.0.0.1:0 that runs each exec request as a real shell command.

    Output is pumped by hand (process.redirect + exit races and drops the connection), signals
    become killpg, and a closed channel kills the command's process group like sshd's hang-up.
    """

    def __init__(self, root: Path, *, sftp: bool = True):
        self.root = root
        self.sftp = sftp
        self.remote_home = root / "remote-home"
        self.remote_home.mkdir(parents=True, exist_ok=True)
        self.host_key = asyncssh.generate_private_key("ssh-ed25519")
        self.client_key, self.client_pub, self.known_hosts = make_client_files(root / "client")
        self.server: asyncssh.SSHAcceptor | None = None
        self.connections: list[asyncssh.SSHServerConnection] = []
        self.commands: list[str] = []
        self._groups: set[int] = set()
        self._handlers: set[asyncio.Task] = set()

    async def start(self, port: int = 0) -> "InProcessSSHServer":
        outer = self

        class _Server(asyncssh.SSHServer):
            def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
                outer.connections.append(conn)

        self.server = await asyncssh.listen(
            "127.0.0.1",
            port,
            server_host_keys=[self.host_key],
            authorized_client_keys=asyncssh.import_authorized_keys(self.client_pub.read_text()),
            process_factory=self._handle,
            sftp_factory=True if self.sftp else None,
            server_factory=_Server,
            encoding=None,
            allow_scp=False,
        )
        return self

    @property
    def port(self) -> int:
        return self.server.get_port()

    def env(self) -> SSHEnv:
        pub = self.host_key.export_public_key().decode().strip()
        env = SSHEnv(self.port, self.client_key, self.known_hosts, self.remote_home, pub)
        return env

    def drop_connections(self) -> int:
        """Cut every client connection from the server side (the listener stays up)."""
        live = [c for c in self.connections if not c.is_closed()]
        for conn in live:
            conn.abort()
        return len(live)

    async def stop(self) -> None:
        self.drop_connections()
        if self.server:
            self.server.close()
            await self.server.wait_closed()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=10)  # each ends once its command has exited
        for pgid in list(self._groups):
            _killpg(pgid, signal.SIGKILL)

    async def _handle(self, process: asyncssh.SSHServerProcess) -> None:
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            await self._run_command(process)
        finally:
            self._handlers.discard(task)

    async def _run_command(self, process: asyncssh.SSHServerProcess) -> None:
        command = process.command or "true"
        self.commands.append(command)
        env = dict(os.environ, HOME=str(self.remote_home))
        child = await asyncio.create_subprocess_shell(
            command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=str(self.remote_home),
            env=env,
            start_new_session=True,
        )
        self._groups.add(child.pid)
        feeder = asyncio.create_task(self._feed_stdin(process, child))
        watcher = asyncio.create_task(self._hang_up_on_close(process, child))
        try:
            await asyncio.gather(self._pump(child.stdout, process.stdout), self._pump(child.stderr, process.stderr))
            code = await child.wait()
        finally:
            feeder.cancel()
            watcher.cancel()
            self._groups.discard(child.pid)
        try:
            process.exit(code if code >= 0 else 128 - code)
        except (OSError, asyncssh.Error, BrokenPipeError):
            pass

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncssh.SSHWriter) -> None:
        while data := await reader.read(65536):
            try:
                writer.write(data)
            except (OSError, asyncssh.Error, BrokenPipeError):
                return  # client gone; keep draining so the child never blocks on a full pipe

    @staticmethod
    async def _feed_stdin(process: asyncssh.SSHServerProcess, child: asyncio.subprocess.Process) -> None:
        try:
            while True:
                try:
                    data = await process.stdin.read(65536)
                except asyncssh.SignalReceived as sig:
                    number = getattr(signal, "SIG" + sig.signal, None)
                    if number is not None:
                        _killpg(child.pid, number)
                    continue
                except (asyncssh.Error, OSError, asyncssh.BreakReceived, asyncssh.TerminalSizeChanged):
                    break
                if not data:
                    break
                child.stdin.write(data)
                await child.stdin.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            try:
                child.stdin.close()
            except (OSError, RuntimeError):
                pass

    @staticmethod
    async def _hang_up_on_close(process: asyncssh.SSHServerProcess, child: asyncio.subprocess.Process) -> None:
        await process.channel.wait_closed()
        try:
            child.stdin.close()  # end of input first: the agent exits on its own
        except (OSError, RuntimeError):
            pass
        try:
            await asyncio.wait_for(child.wait(), 2.0)
        except asyncio.TimeoutError:
            _killpg(child.pid, signal.SIGHUP)
            try:
                await asyncio.wait_for(child.wait(), 2.0)
            except asyncio.TimeoutError:
                _killpg(child.pid, signal.SIGKILL)


def _killpg(pgid: int, number: int) -> None:
    try:
        os.killpg(pgid, number)
    except (ProcessLookupError, PermissionError):
        pass


# -- real OpenSSH sshd ---------------------------------------------------------------------------


class RealSSHD:
    """/usr/sbin/sshd -D on 127.0.0.1:<free port> with keys, config and a HOME under root."""

    def __init__(self, root: Path):
        self.root = root
        self.remote_home = root / "remote-home"
        self.remote_home.mkdir(parents=True, exist_ok=True)
        self.client_key, self.client_pub, self.known_hosts = make_client_files(root / "client")
        self.host_key = root / "host_ed25519"
        self.port = 0
        self.process: subprocess.Popen | None = None

    def start(self) -> "RealSSHD":
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.host_key)], check=True)
        (self.root / "authorized_keys").write_text(self.client_pub.read_text())
        self.port = free_port()
        config = self.root / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    "ListenAddress 127.0.0.1",
                    f"Port {self.port}",
                    f"HostKey {self.host_key}",
                    f"PidFile {self.root / 'sshd.pid'}",
                    f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PermitRootLogin prohibit-password",
                    "Subsystem sftp internal-sftp",
                    f"SetEnv HOME={self.remote_home}",
                    "LogLevel VERBOSE",
                    "",
                ]
            )
        )
        self.log = open(self.root / "sshd.log", "wb")
        self.process = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.root / 'sshd.log').read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.03)
        raise RuntimeError("sshd did not listen within 10 s")

    def env(self) -> SSHEnv:
        pub = " ".join(Path(str(self.host_key) + ".pub").read_text().split()[:2])
        return SSHEnv(self.port, self.client_key, self.known_hosts, self.remote_home, pub)

    def session_pids(self) -> list[int]:
        """The sshd processes under the listener that serve connections (monitor and session children)."""
        children: dict[int, list[int]] = {}
        names: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            names[int(entry.name)] = stat[stat.index("(") + 1 : stat.rindex(")")]
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
        found, todo = [], list(children.get(self.process.pid, []))
        while todo:
            pid = todo.pop()
            if names.get(pid) == "sshd":
                found.append(pid)
                todo.extend(children.get(pid, []))
        return found

    def drop_connections(self) -> int:
        pids = self.session_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.drop_connections()
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if getattr(self, "log", None):
            self.log.close()


def sshd_available() -> bool:
    return os.path.exists(SSHD) and shutil.which("ssh-keygen") is not None


# -- helpers shared by the console tests ----------------------------------------------------------


JOB_SCRIPT = (
    "import json, os, sys, time\n"
    "path = os.path.join(os.environ['EAGLE3_JOB_DIR'], 'metrics.jsonl')\n"
    "for step in range(1, {steps} + 1):\n"
    "    with open(path, 'a') as f:\n"
    "        f.write(json.dumps({{'step': step, 'split': 'train', 'loss': 5.0 / step, 'lr': 1e-3}}) + '\\n')\n"
    "    print('step', step, flush=True)\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


def job_argv(python: str, steps: int = 3) -> list[str]:
    """A job that writes `steps` metrics lines and log lines, then sleeps until stopped."""
    return [python, "-c", JOB_SCRIPT.format(steps=steps)]


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


async def wait_until(predicate, timeout: float = 30.0, step: float = 0.05, what: str = "condition", context=None):
    """Poll `predicate` (sync or async) until it returns something truthy; on timeout the error adds `context()` (e.g. the
    console's notes) so a failure in CI says what the app was doing."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            said = f"\n{context()}" if context is not None else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{said}")
        await asyncio.sleep(step)


async def screen_shown(app, kind, what: str = "the screen", timeout: float = 30.0):
    """Wait until a screen of `kind` is on top with its widgets mounted, and return it: a pushed screen is on the stack
    before it has composed, and a query or a key sent in between finds nothing (seen on a loaded machine)."""
    return await wait_until(lambda: app.screen if isinstance(app.screen, kind) and app.screen.is_mounted else None, timeout=timeout, what=what)


async def connected(app):
    """Wait until the app's agent said hello."""
    await wait_until(lambda: app.state.connection.connected and app.state.hello, what="the local agent")


async def stop_everything(app, grace: float = 2, timeout: float = 60):
    """Stop every running job through the app's agent (test cleanup)."""
    from backend.protocol import Request

    for job in (await app.client.request(Request.LIST_JOBS))["jobs"]:
        if job["state"] == "running":
            await app.client.request(Request.STOP_JOB, name=job["name"], grace=grace, timeout=timeout)


def transport_for(env, tmp_path: Path, **overrides) -> SSHTransport:
    """An SSHTransport to a test server's env (its key pinned by the caller), fast backoff; overrides win."""
    options: dict = dict(
        port=env.port,
        user=env.user,
        identity=str(env.client_key),
        known_hosts=str(env.known_hosts),
        python=sys.executable,
        run_dir=str(tmp_path / "host-run"),
        backoff_initial=0.1,
        backoff_max=0.5,
    )
    options.update(overrides)
    return SSHTransport("127.0.0.1", **options)
