"""`eagle3-console --snapshot` as a subprocess: embedded default (local agent) and over SSH to a real sshd."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from console.cli import HostListError, build_parser, host_list, split_host
from tests.fixtures.ssh import RealSSHD, free_port, sshd_available
from tests.fixtures.env import ROOT

SNAPSHOT_KEYS = {"hello", "gpus", "jobs", "metrics", "disks"}


def console_command() -> list[str]:
    script = Path(sys.executable).with_name("eagle3-console")
    return [str(script)] if script.exists() else [sys.executable, "-m", "console.cli"]


def run_console(args: list[str], home: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    env["HOME"] = str(home)
    home.mkdir(parents=True, exist_ok=True)
    return subprocess.run(console_command() + args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_snapshot_on_the_embedded_default_runs_the_local_agent(tmp_path):
    run_dir = tmp_path / "run"
    result = run_console(["--snapshot", "--run-dir", str(run_dir)], tmp_path / "home")
    assert result.returncode == 0, result.stderr
    snapshot = json.loads(result.stdout)
    assert SNAPSHOT_KEYS <= set(snapshot)
    assert snapshot["hello"]["run_dir"] == str(run_dir) and snapshot["jobs"] == []
    assert snapshot["disks"] and snapshot["disks"][0]["label"] == "run_dir"
    if not snapshot["gpus"]:
        assert snapshot["driver"]["available"] is False and snapshot["driver"]["message"]


def test_snapshot_that_cannot_connect_exits_nonzero_with_a_reason(tmp_path):
    port = free_port()  # nothing listens there
    result = run_console(["--host", "127.0.0.1", "--port", str(port), "--snapshot", "--known-hosts", str(tmp_path / "kh")], tmp_path / "home")
    assert result.returncode == 2 and result.stdout == ""
    assert f"cannot take a snapshot of 127.0.0.1:{port}" in result.stderr and "cannot reach" in result.stderr


def test_unknown_profile_is_refused_before_anything_starts(tmp_path):
    result = run_console(["--profile", "no-such-profile", "--snapshot", "--run-dir", str(tmp_path / "run")], tmp_path / "home")
    assert result.returncode == 2 and "no-such-profile" in result.stderr and "nothing was started" in result.stderr
    assert not (tmp_path / "run").exists()


def test_parser_defaults_to_the_local_agent_and_tiny_profile():
    args = build_parser().parse_args([])
    assert host_list(args) == ["local"] and args.profile == "tiny" and not args.accept_new_host_key
    assert not args.readonly and not args.notify  # both off by default


def test_readonly_and_notify_flags_reach_the_app(monkeypatch):
    from console import cli
    import console.app

    built = {}

    class FakeApp:
        def __init__(self, **kwargs):
            built.update(kwargs)

        def run(self):
            return None

    monkeypatch.setattr(console.app, "build_app", lambda transport, **kwargs: FakeApp(**kwargs))
    monkeypatch.setattr(cli, "make_transports", lambda args: ([object()], args.profile))
    monkeypatch.setattr(FakeApp, "sessions", [], raising=False)
    assert cli.main(["--readonly", "--notify"]) == 0
    assert built == {"profile": "tiny", "readonly": True, "notify_terminal": True, "rdzv_endpoint": None}


def test_hosts_come_from_every_host_flag_then_the_hosts_file(tmp_path):
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("# the training pair\ngpu-a\n  ops@gpu-b:2222   # second node\n\n")
    args = build_parser().parse_args(["--host", "10.0.0.9", "--hosts-file", str(hosts_file)])
    assert host_list(args) == ["10.0.0.9", "gpu-a", "ops@gpu-b:2222"]
    assert split_host("ops@gpu-b:2222", None) == ("ops", "gpu-b", 2222)
    assert split_host("gpu-a", 22) == (None, "gpu-a", 22)


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--host", "a", "--host", "a"], "host named twice: a"),
        (["--host", "a:22", "--host", "a", "--port", "22"], "host named twice: a:22"),
        (["--host", "a:http"], "bad port in host 'a:http'"),
        (["--host", "u@"], "bad host 'u@'"),
        (["--hosts-file", "/no/such/hosts"], "cannot read the hosts file /no/such/hosts"),
    ],
)
def test_a_bad_host_list_is_refused_before_anything_connects(argv, why, tmp_path):
    with pytest.raises(HostListError, match=re.escape(why)):
        host_list(build_parser().parse_args(argv))
    result = run_console(argv + ["--snapshot", "--run-dir", str(tmp_path / "run")], tmp_path / "home")
    assert result.returncode == 2 and why in result.stderr and "nothing was started" in result.stderr


@pytest.mark.skipif(not sshd_available(), reason="OpenSSH sshd not installed (/usr/sbin/sshd); CI installs openssh-server")
@pytest.mark.sshd
def test_snapshot_of_several_hosts_gives_every_hosts_object_and_names_the_one_that_failed(tmp_path):
    servers = [RealSSHD(tmp_path / f"sshd-{i}").start() for i in range(2)]
    try:
        envs = [server.env() for server in servers]
        known = tmp_path / "known_hosts"
        known.write_text("".join(f"[127.0.0.1]:{env.port} {env.host_public_key}\n" for env in envs))
        dead_port = free_port()
        argv = [
            "--host",
            f"{envs[0].user}@127.0.0.1:{envs[0].port}",
            "--host",
            f"{envs[1].user}@127.0.0.1:{envs[1].port}",
            "--host",
            f"{envs[0].user}@127.0.0.1:{dead_port}",
            "--identity",
            str(envs[0].client_key),
            "--known-hosts",
            str(known),
            "--python",
            sys.executable,
            "--run-dir",
            str(tmp_path / "host-run"),
            "--snapshot",
        ]
        (servers[1].root / "authorized_keys").write_text(servers[0].client_pub.read_text())  # one client key for both
        result = run_console(argv, tmp_path / "home")
        assert result.returncode == 2, result.stderr
        hosts = json.loads(result.stdout)["hosts"]
        names = [f"{env.user}@127.0.0.1:{env.port}" for env in envs]
        dead = f"{envs[0].user}@127.0.0.1:{dead_port}"
        assert set(hosts) == {*names, dead}
        assert all(SNAPSHOT_KEYS <= set(hosts[name]) for name in names)
        assert hosts[names[0]]["hello"]["agent_pid"] != hosts[names[1]]["hello"]["agent_pid"]
        assert "cannot reach" in hosts[dead]["error"] and dead in result.stderr
    finally:
        for server in servers:
            server.stop()


@pytest.mark.skipif(not sshd_available(), reason="OpenSSH sshd not installed (/usr/sbin/sshd); CI installs openssh-server")
@pytest.mark.sshd
def test_snapshot_over_ssh_to_a_real_sshd(tmp_path):
    server = RealSSHD(tmp_path / "sshd").start()
    try:
        env = server.env()
        common = [
            "--host",
            "127.0.0.1",
            "--port",
            str(env.port),
            "--user",
            env.user,
            "--identity",
            str(env.client_key),
            "--known-hosts",
            str(env.known_hosts),
            "--python",
            sys.executable,
            "--run-dir",
            str(tmp_path / "host-run"),
            "--snapshot",
        ]
        refused = run_console(common, tmp_path / "home")
        assert refused.returncode == 2 and "not in known_hosts" in refused.stderr and "--accept-new-host-key" in refused.stderr

        accepted = run_console(common + ["--accept-new-host-key"], tmp_path / "home")
        assert accepted.returncode == 0, accepted.stderr
        snapshot = json.loads(accepted.stdout)
        assert SNAPSHOT_KEYS <= set(snapshot) and snapshot["hello"]["run_dir"] == str(tmp_path / "host-run")
        assert snapshot["hello"]["backend_hash"]  # the uploaded copy ran, not the checkout
        assert "added [127.0.0.1]" in accepted.stderr
        assert env.known_hosts.read_text().strip() == f"[127.0.0.1]:{env.port} {env.host_public_key}"

        again = run_console(common, tmp_path / "home")
        assert again.returncode == 0 and json.loads(again.stdout)["hello"]["backend_hash"] == snapshot["hello"]["backend_hash"]
    finally:
        server.stop()
