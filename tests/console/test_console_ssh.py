"""SSH transport end to end: host-key policy, upload-if-changed, reconnect + re-attach, stop over SSH.

Against an in-process asyncssh server running real subprocesses, and against a real OpenSSH sshd on
127.0.0.1 (skipped when /usr/sbin/sshd is absent; CI installs it). HOME, keys and known_hosts are all
under tmp_path; the real ~/.ssh is never read or written.
"""

import asyncio
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from backend.protocol import Request
from console.app import build_app
from console.client import AgentClient
from console.state import CONNECTED, RECONNECTING
from console.transport import REPO_ROOT, FatalTransportError, SSHTransport, content_hash, backend_files
from tests.fixtures.ssh import (
    transport_for,
    InProcessSSHServer,
    RealSSHD,
    job_argv,
    other_host_public_key,
    pid_alive,
    sshd_available,
    wait_until,
)

needs_sshd = pytest.mark.skipif(not sshd_available(), reason="OpenSSH sshd not installed (/usr/sbin/sshd); CI installs openssh-server")


pytestmark = pytest.mark.usefixtures("isolated_home")


@pytest.fixture
async def inproc(tmp_path):
    server = await InProcessSSHServer(tmp_path / "ssh").start()
    yield server
    await server.stop()


@pytest.fixture
def real_sshd(tmp_path):
    server = RealSSHD(tmp_path / "sshd").start()
    yield server
    server.stop()


@pytest.fixture
def started_pgids():
    """Process groups of jobs a test started; anything still alive at the end is ours to clean up."""
    pgids: list[int] = []
    yield pgids
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def copy_backend(root: Path) -> Path:
    shutil.copytree(REPO_ROOT / "backend", root / "backend", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO_ROOT / "profiles", root / "profiles")
    return root


def cache_dirs(env) -> list[str]:
    cache = env.remote_home / ".cache" / "eagle3-console"
    return sorted(p.name for p in cache.iterdir() if p.name.startswith("agent-")) if cache.exists() else []


async def connected_client(transport) -> AgentClient:
    client = AgentClient(transport, timeout=60)
    await client.start()
    await wait_until(lambda: client.status.connected, what="the agent's hello over SSH")
    return client


# -- host keys -----------------------------------------------------------------------------------


async def test_unknown_host_key_is_refused_until_accepted_explicitly(inproc, tmp_path):
    env = inproc.env()
    with pytest.raises(FatalTransportError) as refused:
        await transport_for(env, tmp_path).start()
    message = str(refused.value)
    assert "not in known_hosts" in message and "--accept-new-host-key" in message and "SHA256:" in message
    assert cache_dirs(env) == [] and env.known_hosts.read_text() == ""  # nothing sent, nothing trusted

    accepting = transport_for(env, tmp_path, accept_new_host_key=True)
    client = await connected_client(accepting)
    await client.close()
    assert env.known_hosts.read_text() == f"[127.0.0.1]:{env.port} {env.host_public_key}\n"
    assert "added [127.0.0.1]" in accepting.host_key_added

    client = await connected_client(transport_for(env, tmp_path))  # now known: no flag needed
    await client.close()


async def test_changed_host_key_is_always_refused(inproc, tmp_path):
    env = inproc.env()
    wrong = other_host_public_key()
    env.pin_host_key(wrong)
    before = env.known_hosts.read_text()
    for accept_new in (False, True):
        with pytest.raises(FatalTransportError) as refused:
            await transport_for(env, tmp_path, accept_new_host_key=accept_new).start()
        assert "has CHANGED" in str(refused.value) and "man-in-the-middle" in str(refused.value)
        assert f"ssh-keygen -f {env.known_hosts} -R " in str(refused.value)  # the known_hosts file in use, not ~/.ssh's
    assert env.known_hosts.read_text() == before
    assert cache_dirs(env) == [] and inproc.commands == []


async def test_ssh_config_and_its_known_hosts_file_are_honoured(inproc, tmp_path, isolated_home):
    env = inproc.env()
    env.pin_host_key()
    (isolated_home / ".ssh" / "config").write_text(
        f"Host gpu-box\n  HostName 127.0.0.1\n  Port {env.port}\n  User operator\n  IdentityFile {env.client_key}\n  UserKnownHostsFile {env.known_hosts}\n"
    )
    transport = SSHTransport("gpu-box", python=sys.executable, run_dir=str(tmp_path / "host-run"))
    client = await connected_client(transport)
    assert client.hello["run_dir"] == str(tmp_path / "host-run")
    await client.close()


# -- upload --------------------------------------------------------------------------------------


async def test_agent_is_uploaded_only_when_its_content_changed(inproc, tmp_path):
    env = inproc.env()
    env.pin_host_key()
    root = copy_backend(tmp_path / "checkout")

    first = transport_for(env, tmp_path, root=root)
    client = await connected_client(first)
    assert first.uploads == 1 and first.upload_method == "sftp" and client.hello["backend_hash"] == first.backend_hash
    await client.close()
    uploaded = Path(first.remote_dir)
    assert (uploaded / "backend" / "agent" / "server.py").read_bytes() == (root / "backend" / "agent" / "server.py").read_bytes()
    assert (uploaded / "profiles" / "tiny.toml").exists()

    second = transport_for(env, tmp_path, root=root)
    client = await connected_client(second)
    await client.close()
    assert second.uploads == 0 and second.remote_dir == first.remote_dir

    with open(root / "backend" / "protocol.py", "a") as handle:
        handle.write("\n# a local edit\n")
    third = transport_for(env, tmp_path, root=root)
    client = await connected_client(third)
    assert third.uploads == 1 and third.backend_hash != first.backend_hash
    assert client.hello["backend_hash"] == third.backend_hash
    await client.close()
    assert cache_dirs(env) == sorted([f"agent-{first.backend_hash}", f"agent-{third.backend_hash}"])


async def test_hosts_without_sftp_get_the_agent_as_a_tar_stream(tmp_path):
    server = await InProcessSSHServer(tmp_path / "ssh", sftp=False).start()
    try:
        env = server.env()
        env.pin_host_key()
        transport = transport_for(env, tmp_path)
        client = await connected_client(transport)
        assert transport.upload_method == "tar" and transport.uploads == 1
        assert client.hello["backend_hash"] == transport.backend_hash
        await client.close()
        again = transport_for(env, tmp_path)
        client = await connected_client(again)
        assert again.uploads == 0
        await client.close()
    finally:
        await server.stop()


def test_content_hash_covers_names_and_bytes():
    files = backend_files(REPO_ROOT)
    assert any(name == "backend/agent/server.py" for name, _ in files) and any(name == "profiles/tiny.toml" for name, _ in files)
    assert not any("__pycache__" in name for name, _ in files)
    assert content_hash(files) == content_hash(list(reversed(files)))
    renamed = [("backend/other.py" if n == "backend/agent/server.py" else n, d) for n, d in files]
    assert content_hash(renamed) != content_hash(files)


# -- drop, reconnect, re-attach; stop ------------------------------------------------------------------


async def test_dropped_connection_reconnects_and_the_app_shows_running_jobs_again(inproc, tmp_path, started_pgids):
    env = inproc.env()
    env.pin_host_key()
    app = build_app(transport_for(env, tmp_path), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=(140, 40)) as pilot:
        await wait_until(lambda: app.state.connection.connected and app.state.hello, what="connected app")
        job = (await app.client.request(Request.START_JOB, name="long-run", kind="train", argv=job_argv(sys.executable, steps=3)))["job"]
        started_pgids.append(job["pgid"])
        await wait_until(lambda: "long-run" in app.state.jobs, what="the job in the jobs table")
        app.select_job("long-run")
        steps = lambda: app.state.metrics["long-run"].train_loss.steps
        await wait_until(lambda: "long-run" in app.state.metrics and steps() == [1.0, 2.0, 3.0], what="the first metrics")
        first_agent = app.state.hello.agent_pid

        assert inproc.drop_connections() == 1
        await wait_until(lambda: app.state.connection.state == RECONNECTING, what="the drop")
        assert app.state.stale
        metrics_file = Path(job["job_dir"]) / "metrics.jsonl"
        with open(metrics_file, "a") as handle:  # the run goes on while the console is away
            for step in (4, 5):
                handle.write(json.dumps({"step": step, "split": "train", "loss": 1.0 / step}) + "\n")
        await pilot.pause()
        assert "DISCONNECTED" in str(app.screen.query_one("#banner").render())
        assert app.check_action("stop_job", ()) is None  # guarded actions off while disconnected

        await wait_until(lambda: app.state.connection.connected and app.state.hello.agent_pid != first_agent, what="reconnect")
        await wait_until(lambda: app.state.jobs.get("long-run") and app.state.jobs["long-run"].state == "running", what="re-attached job")
        assert app.state.jobs["long-run"].pid == job["pid"] and pid_alive(job["pid"])
        with open(metrics_file, "a") as handle:
            handle.write(json.dumps({"step": 6, "split": "train", "loss": 1.0 / 6}) + "\n")
        await wait_until(lambda: steps()[-1] == 6.0, what="metrics after the reconnect")
        assert steps() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # nothing lost while away, nothing doubled
        assert not app.state.stale and app.check_action("stop_job", ()) is True
        await app.client.request(Request.STOP_JOB, name="long-run", grace=5, timeout=60)


async def test_stop_sent_over_ssh_ends_the_process_on_the_host(inproc, tmp_path, started_pgids):
    env = inproc.env()
    env.pin_host_key()
    client = await connected_client(transport_for(env, tmp_path))
    job = (await client.request(Request.START_JOB, name="victim", kind="other", argv=job_argv(sys.executable)))["job"]
    started_pgids.append(job["pgid"])
    assert pid_alive(job["pid"])
    plan = await client.request(Request.STOP_PLAN, name="victim")
    assert [entry["pid"] for entry in plan["will_signal"]] == [job["pid"]]
    result = await client.request(Request.STOP_JOB, name="victim", grace=5, timeout=60)
    assert [(v["pid"], v["outcome"]) for v in result["verdicts"]] == [(job["pid"], "exited_on_term")]
    assert not pid_alive(job["pid"])
    await client.close()


# -- real OpenSSH --------------------------------------------------------------------------------------


@needs_sshd
@pytest.mark.sshd
async def test_real_sshd_host_key_mismatch_is_refused(real_sshd, tmp_path):
    env = real_sshd.env()
    env.pin_host_key(other_host_public_key())
    with pytest.raises(FatalTransportError, match="has CHANGED"):
        await transport_for(env, tmp_path).start()
    assert cache_dirs(env) == []


@needs_sshd
@pytest.mark.sshd
async def test_real_sshd_upload_once_reconnect_reattach_and_stop(real_sshd, tmp_path, started_pgids):
    env = real_sshd.env()
    env.pin_host_key()
    root = copy_backend(tmp_path / "checkout")
    first = transport_for(env, tmp_path, root=root)
    client = await connected_client(first)
    assert first.uploads == 1 and Path(first.remote_dir).parent == env.remote_home / ".cache" / "eagle3-console"
    job = (await client.request(Request.START_JOB, name="sshd-job", kind="train", argv=job_argv(sys.executable)))["job"]
    started_pgids.append(job["pgid"])
    agent_pid = client.hello["agent_pid"]

    statuses = []
    assert real_sshd.drop_connections() >= 1

    async def watch():
        while True:
            event = await client.next_event()
            if hasattr(event, "state"):
                statuses.append(event.state)

    watcher = asyncio.create_task(watch())
    await wait_until(lambda: RECONNECTING in statuses and statuses[-1] == CONNECTED, timeout=60, what="reconnect through sshd")
    watcher.cancel()
    assert first.uploads == 1  # the reconnect found the marker: no second upload
    assert client.hello["agent_pid"] != agent_pid
    jobs = {j["name"]: j for j in (await client.request(Request.LIST_JOBS))["jobs"]}
    assert jobs["sshd-job"]["state"] == "running" and pid_alive(job["pid"])

    result = await client.request(Request.STOP_JOB, name="sshd-job", grace=5, timeout=60)
    assert [v["outcome"] for v in result["verdicts"]] == ["exited_on_term"]
    assert not pid_alive(job["pid"])
    await client.close()

    second = transport_for(env, tmp_path, root=root)
    client = await connected_client(second)
    assert second.uploads == 0 and second.remote_dir == first.remote_dir
    await client.close()

    (root / "profiles" / "tiny.toml").write_text((root / "profiles" / "tiny.toml").read_text() + "\n# edited\n")
    third = transport_for(env, tmp_path, root=root)
    client = await connected_client(third)
    assert third.uploads == 1 and third.remote_dir != first.remote_dir and client.hello["backend_hash"] == third.backend_hash
    await client.close()
