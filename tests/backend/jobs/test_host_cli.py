"""`eagle3-host gpus | holders | job ... | agent`: output, JSON, and exit codes 0 / 1 (failure) / 2 (usage).

Most calls go through backend.cli.main in this process (the same code as the console script, minus the
interpreter start); the agent and one smoke test run as real subprocesses.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.host import procs
from backend.cli import main
from backend.jobs.registry import JobRegistry
from tests.fixtures.env import ROOT

PY = sys.executable


def host_process(run_dir: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "backend", *args], cwd=ROOT, capture_output=True, text=True, timeout=90, input=stdin, env={**os.environ, "EAGLE3_RUN_DIR": str(run_dir)}
    )


@pytest.fixture
def host(capsys):
    """Run `eagle3-host ARGS` in-process; returns (returncode, stdout, stderr) like a finished process."""

    def run(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
        argv = [*args[:2], "--run-dir", str(run_dir), *args[2:]] if args[0] == "job" else [args[0], "--run-dir", str(run_dir), *args[1:]]
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse usage errors
            code = exc.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(argv, code, out, err)

    return run


def test_gpus_reports_the_driver_state(tmp_path):
    done = host_process(tmp_path, "gpus", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report) == {"gpus", "driver"} and report["driver"]["source"] in ("nvml", "nvidia-smi", "none")
    if report["driver"]["source"] == "none":
        assert report["gpus"] == [] and "no NVIDIA driver" in report["driver"]["message"]
        human = host_process(tmp_path, "gpus")
        assert human.returncode == 0 and "no NVIDIA driver" in human.stdout


def test_holders_json_and_table(host, tmp_path):
    done = host(tmp_path, "holders", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert {"holders", "fuser_stderr_lines", "fuser", "gpu_source"} <= set(report)
    human = host(tmp_path, "holders")
    assert human.returncode == 0 and "fuser:" in human.stdout


def test_job_lifecycle_through_the_cli(host, tmp_path):
    started = host(tmp_path, "job", "start", "--name", "echoer", "--", PY, "-c", "import sys; print('out'); print('err', file=sys.stderr)")
    assert started.returncode == 0, started.stderr
    assert "started job echoer" in started.stdout
    registry = JobRegistry(tmp_path)
    deadline = time.monotonic() + 20
    while registry.get("echoer").info.state == "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    listing = host(tmp_path, "job", "list")
    assert listing.returncode == 0 and listing.stdout.splitlines()[0].split()[:5] == ["NAME", "KIND", "STATE", "PID", "EXIT"]
    assert "echoer" in listing.stdout and "exited" in listing.stdout
    assert host(tmp_path, "job", "tail", "echoer").stdout == "out\n"
    assert host(tmp_path, "job", "tail", "echoer", "--stderr", "-n", "1").stdout == "err\n"

    sleeper = host(tmp_path, "job", "start", "--name", "sleeper", "--kind", "train", "--json", "--", PY, "-c", "import time; time.sleep(600)")
    info = json.loads(sleeper.stdout)
    try:
        plan = host(tmp_path, "job", "plan", "--name", "sleeper")
        assert plan.returncode == 0 and str(info["pid"]) in plan.stdout and "checkpoint" in plan.stdout
        plan_json = json.loads(host(tmp_path, "job", "plan", "--all", "--json").stdout)
        assert [w["pid"] for w in plan_json["will_signal"]] == [info["pid"]]
        assert procs.is_alive(info["pid"], info["start_time_ticks"])  # planning signals nothing
        stopped = host(tmp_path, "job", "stop", "--name", "sleeper", "--grace", "5")
        assert stopped.returncode == 0 and "exited_on_term" in stopped.stdout
        assert not procs.is_alive(info["pid"], info["start_time_ticks"])
    finally:
        registry.stop(all_jobs=True, grace=1)


def test_usage_errors_exit_2_and_failures_exit_1(host, tmp_path):
    refused = host(tmp_path, "job", "adopt", "1", "--name", "init")
    assert refused.returncode == 2 and "--yes" in refused.stderr and "Nothing was adopted" in refused.stderr
    assert JobRegistry(tmp_path).list_jobs() == []
    assert host(tmp_path, "job", "start", "--name", "empty").returncode == 2
    assert host(tmp_path, "job", "stop").returncode == 2  # neither --name nor --all
    assert host(tmp_path, "job", "stop", "--name", "a", "--all").returncode == 2
    assert host(tmp_path, "job", "start", "--name", "bad/name", "--", "true").returncode == 2
    missing = host(tmp_path, "job", "stop", "--name", "ghost", "--grace", "1")
    assert missing.returncode == 1 and "ghost" in missing.stderr and missing.stdout == ""
    assert host(tmp_path, "job", "tail", "ghost").returncode == 1
    not_running = host(tmp_path, "job", "adopt", "999999999", "--name", "x", "--yes")
    assert not_running.returncode == 1 and "no running process" in not_running.stderr


def test_agent_subcommand_speaks_the_protocol(tmp_path):
    done = host_process(tmp_path, "agent", "--interval", "0.2", stdin='{"type": "ping", "id": 1}\n')
    assert done.returncode == 0, done.stderr
    messages = [json.loads(line) for line in done.stdout.splitlines()]
    assert messages[0]["type"] == "hello"
    assert any(m["type"] == "reply" and m["id"] == 1 and m["result"]["pong"] for m in messages)


def test_torchrun_argv_and_node_jobs_through_the_cli(host, tmp_path):
    printed = host(
        tmp_path,
        "torchrun-argv",
        "--run-id",
        "r9",
        "--node-rank",
        "1",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        "127.0.0.1:29400",
        "--",
        "--profile",
        "tiny",
        "--max-steps",
        "5",
    )
    assert printed.returncode == 0, printed.stderr
    argv = json.loads(printed.stdout)
    assert argv[:3] == ["python", "-m", "torch.distributed.run"] and argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--rdzv-backend") + 1] == "static" and argv[argv.index("backend") + 1 :] == ["train", "--profile", "tiny", "--max-steps", "5"]
    bad = host(tmp_path, "torchrun-argv", "--run-id", "r9", "--node-rank", "2", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--", "--profile", "tiny")
    assert bad.returncode == 2 and "node.node_rank: 2 is not in 0..1" in bad.stderr and bad.stdout == ""

    started = host(
        tmp_path, "job", "start", "--name", "part", "--node", "r9", "1", "2", "127.0.0.1:29400", "--json", "--", PY, "-c", "import time; time.sleep(60)"
    )
    assert started.returncode == 0, started.stderr
    try:
        info = json.loads(started.stdout)
        assert (info["run_id"], info["node_rank"], info["nnodes"], info["rdzv_endpoint"]) == ("r9", 1, 2, "127.0.0.1:29400")
        listing = host(tmp_path, "job", "list")
        row = next(line for line in listing.stdout.splitlines() if line.startswith("part "))
        assert "r9 1/2" in row
        listed = json.loads(host(tmp_path, "job", "list", "--json").stdout)
        assert listed[0]["run_id"] == "r9" and listed[0]["ranks"] == [] and listed[0]["stalled_ranks"] == []
        refused = host(tmp_path, "job", "start", "--name", "part2", "--node", "r9", "one", "2", "127.0.0.1:1", "--", "true")
        assert refused.returncode == 2 and "NODE_RANK 'one'" in refused.stderr
        refused = host(tmp_path, "job", "start", "--name", "part2", "--node", "r9", "0", "2", "nohost", "--", "true")
        assert refused.returncode == 2 and "node.rdzv_endpoint" in refused.stderr and "nothing was started" in refused.stderr
        assert [j.name for j in JobRegistry(tmp_path).list_jobs()] == ["part"]
    finally:
        JobRegistry(tmp_path).stop(all_jobs=True, grace=1)


def test_data_scaling_reads_the_data_dir_that_follows_the_run_dir(host, tmp_path):
    done = host(tmp_path / "moved", "data-scaling", "--profile", "tiny", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["path"] == str(tmp_path / "moved" / "data")  # not ~/.eagle3/data
