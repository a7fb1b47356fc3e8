"""Fast reference-server fixtures: the mini target plus an untrained draft saved by the project's checkpoint writer.

No training: the draft is freshly initialised (it accepts almost nothing, which is fine for wire tests), so a
speculative and a plain server of the mini target are up in seconds. The `mini_servers` fixture (tests/conftest.py,
so that one pair serves every module of a test process) starts them with run_mini_servers.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from backend.serve import http
from tests.conftest import ROOT, mini_profile_dict, subprocess_env

MAX_BODY_BYTES = 256 * 1024  # small, so the 413 path is cheap to reach (a 100,000-deep body still fits)
REQUEST_TIMEOUT_S = 3.0  # small, so a stalled client is cut off quickly


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def toml_text(profile: dict) -> str:
    """A profile dict of scalars and one level of tables as TOML."""
    lines = [f"{key} = {toml_value(value)}" for key, value in profile.items() if not isinstance(value, dict)]
    for table, values in profile.items():
        if isinstance(values, dict):
            lines += ["", f"[{table}]"] + [f"{key} = {toml_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def write_mini_profile(target_dir: Path, out: Path) -> Path:
    out.write_text(toml_text(mini_profile_dict(target_dir)))
    return out


def save_untrained_draft(profile, run_dir: Path) -> Path:
    """A freshly initialised draft of the profile's shape, written as a checkpoint (run_dir/checkpoints/...)."""
    import torch

    from backend.train.checkpoint import save_checkpoint
    from backend.train.draft import DraftModelConfig, Eagle3Draft

    torch.manual_seed(0)
    config = DraftModelConfig.from_profile(profile)
    return save_checkpoint(run_dir, Eagle3Draft(config), config, epoch=0, step=0, training_state=None)


def server_argv(profile_path: Path, port: int, draft: Path | None, *extra: str) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "backend.serve.reference.server",
        "--profile",
        str(profile_path),
        "--port",
        str(port),
        "--max-body-bytes",
        str(MAX_BODY_BYTES),
        "--request-timeout",
        str(REQUEST_TIMEOUT_S),
        *extra,
    ]
    return argv + (["--draft", str(draft)] if draft else ["--no-speculation"])


class ServerProcess:
    """One reference server on 127.0.0.1, started in its own session and stopped by its own pid."""

    def __init__(self, argv: list[str], log_path: Path):
        self.port = int(argv[argv.index("--port") + 1])
        self.url = http.base_url("127.0.0.1", self.port)
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"reference server exited with {self.proc.returncode}:\n{self.log()}")
            if http.get(f"{self.url}/health_generate", timeout=5).status == 200:
                return
            time.sleep(0.2)
        raise AssertionError(f"reference server not ready within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        return self.proc.returncode


def run_mini_servers(root: Path, mini_target_dir: Path, mini_profile):
    """Starts a speculative (untrained draft) and a plain server of the mini target, yields them, stops them."""
    profile_path = write_mini_profile(mini_target_dir, root / "mini.toml")
    draft = save_untrained_draft(mini_profile, root / "run")
    servers = {
        "spec": ServerProcess(server_argv(profile_path, http.free_port(), draft), root / "spec.log"),
        "plain": ServerProcess(server_argv(profile_path, http.free_port(), None), root / "plain.log"),
    }
    try:
        for server in servers.values():
            server.wait_ready()
        yield {**servers, "profile": mini_profile, "draft": draft}
    finally:
        for server in servers.values():
            server.stop()


def raw_exchange(port: int, payload: bytes, *, read_timeout: float = 20.0, half_close: bool = False) -> bytes:
    """Send raw bytes to 127.0.0.1:port and read until the server closes or read_timeout passes."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as sock:
        sock.sendall(payload)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except (socket.timeout, ConnectionResetError):
            pass
        return b"".join(chunks)


def parse_raw_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, lower-cased headers, body) of the first HTTP response in data."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = body[: int(headers["content-length"])]
    return status, headers, body
