"""One training job across nodes: two real agents (each its own run dir) stand in for two hosts, torchrun rendezvous on 127.0.0.1.

Fast: the node record (start_job `node`, stored, listed, checked), per-rank heartbeats -> JobInfo.ranks/stalled_ranks,
the data dir that follows --run-dir. Slow: a 2-node CPU torchrun run of the mini profile trains across both agents,
a stalled rank (SIGSTOP) shows, a stop sent to both ends every process and leaves one checkpoint (node 0) that passes
preflight, and a rank killed with SIGKILL ends the other node too, each job record saying why.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from backend.host import procs
from backend.commands import NODE_ENV, data_dir_for, node_spec, profile_facts, torchrun_train_argv, train_argv
from backend.jobs.logs import torchrun_failure
from backend.jobs.registry import JobRegistry
from backend.serve.http import free_port
from backend.layout import heartbeat_path, list_checkpoints, rank_heartbeats

from tests.fixtures.env import subprocess_env
from tests.fixtures.agent import PY, AgentProcess

SLEEPER = "import os, sys, time\nprint(' '.join(f'{k}={os.environ.get(k)}' for k in sys.argv[1:]), flush=True)\ntime.sleep(120)\n"

# One "rank": the trainer's own HeartbeatWriter, a step every 0.1 s. The job's leader starts two of them.
RANK = """\
import os, sys, time
from backend.layout import HeartbeatWriter
rank = int(sys.argv[1])
writer = HeartbeatWriter(os.environ["EAGLE3_JOB_DIR"], rank, local_rank=rank, world_size=2, every=0.2)
for step in range(1, 100000):
    writer.beat(step, "train")
    time.sleep(0.1)
"""
TWO_RANKS = f"""\
import subprocess, sys
children = [subprocess.Popen([sys.executable, "-c", {RANK!r}, str(rank)]) for rank in (0, 1)]
for child in children:
    child.wait()
"""


def job_of(agent: AgentProcess, name: str, **params) -> dict:
    return next(job for job in agent.ok("list_jobs", **params)["jobs"] if job["name"] == name)


def wait_for(what: str, check, timeout: float, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(every)


@pytest.fixture
def two_agents(tmp_path):
    started: list[AgentProcess] = []

    def start(*args: str, env: dict | None = None) -> tuple[AgentProcess, AgentProcess]:
        for name in ("node0", "node1"):
            started.append(AgentProcess(tmp_path / name, args=args, env=env))
        for agent in started[-2:]:
            agent.wait(lambda m: m["type"] == "hello")
        return started[-2], started[-1]

    yield start
    for agent in started:
        agent.close()
    for name in ("node0", "node1"):
        if (tmp_path / name).exists():
            JobRegistry(tmp_path / name).stop(all_jobs=True, grace=2)


# ------------------------------------------------------------------ fast: the node record


def test_start_job_with_node_is_stored_listed_and_checked(two_agents):
    a, b = two_agents()
    endpoint = f"127.0.0.1:{free_port()}"
    for agent, rank in ((a, 0), (b, 1)):
        job = agent.ok(
            "start_job",
            name="run7",
            kind="train",
            argv=[PY, "-c", SLEEPER, "EAGLE3_RUN_ID", "EAGLE3_NODE_RANK", "EAGLE3_NNODES", "NCCL_NVLS_ENABLE", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"],
            node=node_spec("run7", rank, 2, endpoint),
        )["job"]
        assert (job["run_id"], job["node_rank"], job["nnodes"], job["rdzv_endpoint"]) == ("run7", rank, 2, endpoint)
        listed = job_of(agent, "run7")
        assert (listed["run_id"], listed["node_rank"], listed["nnodes"]) == ("run7", rank, 2) and listed["state"] == "running"
        line = wait_for("the job's first line", lambda: agent.ok("tail_log", name="run7", lines=1)["lines"], 20)[0]
        assert line == (
            f"EAGLE3_RUN_ID=run7 EAGLE3_NODE_RANK={rank} EAGLE3_NNODES=2 NCCL_NVLS_ENABLE={NODE_ENV['NCCL_NVLS_ENABLE']} "
            f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={NODE_ENV['TORCH_ELASTIC_SHUTDOWN_TIMEOUT']}"
        )
    # an ordinary job has no node fields; a record survives the agent (it is in jobs.db)
    plain = a.ok("start_job", name="plain", kind="other", argv=[PY, "-c", "import time; time.sleep(60)"])["job"]
    assert (plain["run_id"], plain["node_rank"], plain["nnodes"], plain["ranks"], plain["stalled_ranks"]) == (None, None, None, [], [])
    stored = JobRegistry(Path(job_of(a, "run7")["job_dir"]).parent.parent).get("run7").info
    assert (stored.run_id, stored.node_rank, stored.nnodes, stored.rdzv_endpoint) == ("run7", 0, 2, endpoint)

    bad = [
        ({"run_id": "r", "node_rank": 2, "nnodes": 2, "rdzv_endpoint": endpoint}, "node.node_rank: 2 is not in 0..1"),
        ({"run_id": "r", "node_rank": 0, "nnodes": 2, "rdzv_endpoint": "no-port"}, "node.rdzv_endpoint"),
        ({"run_id": "r/../x", "node_rank": 0, "nnodes": 2, "rdzv_endpoint": endpoint}, "node.run_id"),
        ({"run_id": "r", "node_rank": 0, "nnodes": 2, "rdzv_endpoint": endpoint, "extra": 1}, "unknown field(s) extra"),
        ({"run_id": "r", "node_rank": True, "nnodes": 2, "rdzv_endpoint": endpoint}, "node.node_rank"),
    ]
    for node, message in bad:
        _, reply = a.request("start_job", name="bad", kind="train", argv=[PY, "-c", "pass"], node=node)
        assert reply["ok"] is False and reply["error"]["code"] == "bad_params" and message in reply["error"]["message"], reply
        assert "nothing was started" in reply["error"]["message"]
    argv = torchrun_train_argv(train_argv("tiny"), run_id="r", node_rank=1, nnodes=2, rdzv_endpoint=endpoint)
    _, reply = a.request("start_job", name="bad", kind="train", argv=argv, node=node_spec("r", 0, 2, endpoint))
    assert reply["error"]["code"] == "bad_params" and "--node-rank 1 vs node 0" in reply["error"]["message"], reply
    _, reply = a.request("start_job", name="bad", kind="train", argv=[PY, "-c", "pass"], node="r:0:2")
    assert reply["error"]["code"] == "bad_params" and reply["error"]["message"].startswith("node:")
    assert "bad" not in {job["name"] for job in a.ok("list_jobs")["jobs"]}


def test_torchrun_argv_keeps_node_zero_rank_zero():
    argv = torchrun_train_argv(
        train_argv("kimi-k2.5", ["--max-steps", "10"]), run_id="k1", node_rank=1, nnodes=2, rdzv_endpoint="10.0.0.1:29400", nproc_per_node="gpu"
    )
    assert argv == [
        "python",
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--nproc-per-node",
        "gpu",
        "--rdzv-backend",
        "static",
        "--rdzv-endpoint",
        "10.0.0.1:29400",
        "--rdzv-id",
        "k1",
        "--max-restarts",
        "0",
        "-m",
        "backend",
        "train",
        "--profile",
        "kimi-k2.5",
        "--max-steps",
        "10",
    ]
    for bad, message in (({"nproc_per_node": 0}, "nproc_per_node"), ({"node_rank": -1}, "node_rank"), ({"rdzv_endpoint": "h:99999"}, "rdzv_endpoint")):
        kwargs = {**dict(run_id="k1", node_rank=0, nnodes=2, rdzv_endpoint="h:1"), **bad}
        with pytest.raises(ValueError, match=message):
            torchrun_train_argv(train_argv("tiny"), **kwargs)
    with pytest.raises(ValueError, match="eagle3-host train"):
        torchrun_train_argv(["python", "x.py"], run_id="k1", node_rank=0, nnodes=1, rdzv_endpoint="h:1")


# ------------------------------------------------------------------ fast: heartbeats


def test_heartbeats_become_ranks_ages_and_stalled_ranks(two_agents):
    a, _ = two_agents("--stall-after", "1.5")
    job = a.ok("start_job", name="beats", kind="train", argv=[PY, "-c", TWO_RANKS], node=node_spec("beats", 0, 1, "127.0.0.1:1"))["job"]

    def both_beating():
        found = job_of(a, "beats")
        return found if [r["rank"] for r in found["ranks"]] == [0, 1] and all((r["step"] or 0) > 3 for r in found["ranks"]) else None

    beating = wait_for("two ranks beating", both_beating, 30)
    assert beating["stalled_ranks"] == [] and all(r["age_s"] < 1.5 and r["phase"] == "train" for r in beating["ranks"])
    rank1 = beating["ranks"][1]["pid"]
    assert rank1 != beating["ranks"][0]["pid"] and rank1 in procs.descendants(job["pid"])
    os.kill(rank1, signal.SIGSTOP)
    try:
        stalled = wait_for("rank 1 stalled", lambda: (found := job_of(a, "beats"))["stalled_ranks"] == [1] and found, 15)
        ages = {r["rank"]: r["age_s"] for r in stalled["ranks"]}
        assert ages[1] > 1.5 and ages[0] < 1.5  # the agent's clock: rank 0 keeps beating
        a.wait(lambda m: m["type"] == "jobs" and any(j["name"] == "beats" and j["stalled_ranks"] == [1] for j in m["jobs"]))
        assert job_of(a, "beats", stall_after_s=600)["stalled_ranks"] == []  # the threshold is a request param too
        for bad in (0, -1, "soon", 10**9):
            _, reply = a.request("list_jobs", stall_after_s=bad)
            assert reply["ok"] is False and reply["error"]["code"] == "bad_params" and reply["error"]["message"].startswith("stall_after_s")
    finally:
        os.kill(rank1, signal.SIGCONT)
    wait_for("rank 1 beating again", lambda: job_of(a, "beats")["stalled_ranks"] == [], 15)
    a.ok("stop_job", name="beats", grace=5)
    stopped = job_of(a, "beats")
    assert stopped["state"] == "stopped" and stopped["stalled_ranks"] == [] and len(stopped["ranks"]) == 2  # an ended job stalls nothing


def test_heartbeat_files_are_read_with_the_readers_clock(tmp_path):
    job_dir = tmp_path / "job"
    heartbeat_path(job_dir, 0).parent.mkdir(parents=True)
    now = 1_000_000.0
    beats = {
        0: {"step": 9, "step_time": now - 40, "time": now - 0.5, "phase": "train"},
        1: {"step": 7, "step_time": now - 70, "time": now - 65, "phase": "train"},
        2: {"step": 9, "step_time": now - 70, "time": now - 65, "phase": "done"},
    }
    for rank, beat in beats.items():
        heartbeat_path(job_dir, rank).write_text(json.dumps({"rank": rank, "pid": 100 + rank, **beat}))
    heartbeat_path(job_dir, 3).write_text('{"rank": 3, "ti')  # being replaced: skipped, not an error
    (heartbeat_path(job_dir, 0).parent / "notes.txt").write_text("x")
    ranks, stalled = rank_heartbeats(job_dir, running=True, now=now, stall_after=30)
    assert [(r["rank"], r["step"], r["age_s"], r["step_age_s"], r["pid"]) for r in ranks] == [
        (0, 9, 0.5, 40.0, 100),
        (1, 7, 65.0, 70.0, 101),
        (2, 9, 65.0, 70.0, 102),
    ]
    assert stalled == [1]  # rank 2 said it was done
    assert rank_heartbeats(job_dir, running=False, now=now)[1] == []
    assert rank_heartbeats(tmp_path / "nothing", running=True) == ([], [])


# ------------------------------------------------------------------ fast: the data dir follows --run-dir


def test_the_data_dir_follows_the_run_dir_unless_given(two_agents, tmp_path):
    assert data_dir_for("~/.eagle3/data", "~/.eagle3", str(tmp_path / "r")) == str(tmp_path / "r" / "data")
    assert data_dir_for("~/.eagle3/data/sub", "~/.eagle3", "/scratch/e3") == "/scratch/e3/data/sub"
    assert data_dir_for("/data/eagle3", "~/.eagle3", "/scratch/e3") == "/data/eagle3"  # explicit elsewhere: kept
    assert data_dir_for("~/.eagle3/data", "~/.eagle3", None) == "~/.eagle3/data"
    assert profile_facts("tiny", run_dir=str(tmp_path / "r")).data_dir == str(tmp_path / "r" / "data")
    assert profile_facts("tiny").data_dir == "~/.eagle3/data"

    other_fs = Path("/dev/shm")
    if not other_fs.is_dir() or os.stat(other_fs).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's tmp dir")
    shm = other_fs / f"eagle3-test-data-{os.getpid()}"
    shm.mkdir()
    try:
        (tmp_path / "node1").mkdir()
        (tmp_path / "node1" / "data").symlink_to(shm)  # node1's <run-dir>/data lives on another filesystem
        a, b = two_agents()
        disks = {}
        for agent in (a, b):
            _, event = agent.wait(lambda m: m["type"] == "disk")
            disks[agent] = {d["label"]: d for d in event["disks"]}
        assert set(disks[a]) == {"run_dir"}  # <run-dir>/data on the run dir's own disk: one line says it all
        assert set(disks[b]) == {"run_dir", "data_dir"} and disks[b]["data_dir"]["path"] == str((tmp_path / "node1").resolve() / "data")
        assert disks[b]["data_dir"]["total_bytes"] == os.statvfs(shm).f_blocks * os.statvfs(shm).f_frsize
        explicit = AgentProcess(tmp_path / "node2", args=("--data-dir", str(tmp_path)))
        try:
            _, event = explicit.wait(lambda m: m["type"] == "disk")
            assert [(d["label"], d["path"]) for d in event["disks"]] == [("run_dir", str((tmp_path / "node2").resolve())), ("data_dir", str(tmp_path))]
        finally:
            explicit.close()
    finally:
        shm.rmdir()


# ------------------------------------------------------------------ slow: real torchrun across two agents


@pytest.fixture
def mini_profile_file(mini_target_dir, tmp_path) -> Path:
    from tests.fixtures.env import mini_profile_dict
    from tests.fixtures.reference import toml_text

    path = tmp_path / "mini-multinode.toml"
    path.write_text(toml_text(mini_profile_dict(mini_target_dir, max_steps=100000, save_interval=100000, eval_interval=100000, log_interval=1, warmup_steps=2)))
    return path


def start_run(a: AgentProcess, b: AgentProcess, name: str, profile: Path) -> dict[int, dict]:
    """Node 1 first (it waits for node 0's store), then node 0; returns {node rank: job}."""
    endpoint = f"127.0.0.1:{free_port()}"
    train = train_argv(str(profile), ["--max-val-batches", "1", "--threads", "1"])
    jobs = {}
    for agent, rank in ((b, 1), (a, 0)):
        argv = torchrun_train_argv(train, run_id=name, node_rank=rank, nnodes=2, rdzv_endpoint=endpoint)
        jobs[rank] = agent.ok("start_job", name=name, kind="train", argv=argv, node=node_spec(name, rank, 2, endpoint))["job"]
    return jobs


def training(agent: AgentProcess, name: str, rank: int, past: int) -> dict | None:
    job = job_of(agent, name)
    assert job["state"] == "running", f"{name} on node {job['node_rank']} ended: {job['detail']}; stderr: {stderr_tail(job)}"
    mine = [r for r in job["ranks"] if r["rank"] == rank]
    return job if mine and (mine[0]["step"] or 0) > past else None


def stderr_tail(job: dict) -> str:
    try:
        return Path(job["stderr_path"]).read_text()[-3000:]
    except OSError:
        return "(none)"


def alive(pid: int) -> bool:
    stat = procs.read_stat(pid)
    return stat is not None and stat.running


@pytest.mark.slow
def test_two_node_torchrun_trains_stalls_stops_and_fails_as_one_job(two_agents, mini_profile_file, mini_cache, mini_target_dir):
    from backend.serve.preflight import run_preflight

    env = subprocess_env(EAGLE3_CACHE_DIR=str(mini_cache), OMP_NUM_THREADS="1")
    a, b = two_agents("--stall-after", "4", env=env)
    started = time.monotonic()
    jobs = start_run(a, b, "mn1", mini_profile_file)

    # One job across both nodes: rank 0 on node 0 (metrics there only), rank 1 on node 1, both stepping.
    a.wait(lambda m: m["type"] == "metrics" and m["job"] == "mn1" and any(r.get("step", 0) >= 3 for r in m["records"]), timeout=150)
    on_a = wait_for("rank 0 past step 3", lambda: training(a, "mn1", 0, 3), 30)
    on_b = wait_for("rank 1 past step 3", lambda: training(b, "mn1", 1, 3), 30)
    assert [(r["rank"], r["node_rank"]) for r in on_a["ranks"]] == [(0, 0)] and [(r["rank"], r["node_rank"]) for r in on_b["ranks"]] == [(1, 1)]
    assert not (Path(jobs[1]["job_dir"]) / "metrics.jsonl").exists()  # only rank 0 writes metrics
    worker0, worker1 = on_a["ranks"][0]["pid"], on_b["ranks"][0]["pid"]
    assert worker0 in procs.descendants(jobs[0]["pid"]) and worker1 in procs.descendants(jobs[1]["pid"])
    print(f"both ranks training after {time.monotonic() - started:.1f}s")

    # A stalled rank: node 1's worker stopped; its agent flags it, node 0's rank keeps beating while it waits.
    os.kill(worker1, signal.SIGSTOP)
    try:
        flagged = wait_for("rank 1 stalled on node 1", lambda: (job := job_of(b, "mn1"))["stalled_ranks"] == [1] and job, 20)
        assert flagged["ranks"][0]["age_s"] > 4
        waiting = job_of(a, "mn1")
        assert waiting["stalled_ranks"] == [] and waiting["ranks"][0]["age_s"] < 4
    finally:
        os.kill(worker1, signal.SIGCONT)
    step_then = job_of(b, "mn1")["ranks"][0]["step"]
    wait_for("rank 1 beating and stepping again", lambda: (job := training(b, "mn1", 1, step_then)) and job["stalled_ranks"] == [], 30)

    # Stop: both agents at once. Every PID of each node is in its verdicts; rank 0 writes the one checkpoint.
    plans = {rank: agent.ok("stop_plan", name="mn1") for rank, agent in ((0, a), (1, b))}
    assert all(plan["checkpoint_first"] for plan in plans.values())
    replies: dict[int, dict] = {}
    threads = [
        threading.Thread(target=lambda r=rank, ag=agent: replies.__setitem__(r, ag.ok("stop_job", name="mn1", grace=90))) for rank, agent in ((0, a), (1, b))
    ]
    stop_started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=150)
    stop_took = time.monotonic() - stop_started
    for rank, worker in ((0, worker0), (1, worker1)):
        verdicts = {v["pid"]: v for v in replies[rank]["verdicts"]}
        assert {w["pid"] for w in plans[rank]["will_signal"]} <= set(verdicts), (plans[rank], verdicts)
        assert verdicts[jobs[rank]["pid"]]["role"] == "leader" and "torch.distributed.run" in verdicts[jobs[rank]["pid"]]["detail"]
        assert worker in verdicts and all(v["outcome"] == "exited_on_term" for v in verdicts.values()), verdicts
        assert not [pid for pid in verdicts if alive(pid)], "a process of the stopped job is still alive"
        assert job_of([a, b][rank], "mn1")["state"] == "stopped"
    checkpoints = list_checkpoints(jobs[0]["job_dir"])
    assert len(checkpoints) == 1 and list_checkpoints(jobs[1]["job_dir"]) == []
    report = run_preflight(checkpoints[0], Path(mini_target_dir) / "config.json", check_sglang=False)
    assert report.ok, report.problems
    assert "checkpoint written" in Path(jobs[0]["stderr_path"]).read_text()
    print(f"stop of both nodes took {stop_took:.1f}s; checkpoint {checkpoints[0].name}")

    # torchrun's own SIGTERM handling: node 0's torchrun alone is signalled (no agent stop). It forwards SIGTERM to
    # its worker, whose stop flag reaches node 1's rank through the all-reduce: one checkpoint, both nodes end.
    jobs = start_run(a, b, "mn2", mini_profile_file)
    wait_for("run 2 training on node 1", lambda: training(b, "mn2", 1, 1), 150)
    worker0 = wait_for("run 2 training on node 0", lambda: training(a, "mn2", 0, 1), 30)["ranks"][0]["pid"]
    os.kill(jobs[0]["pid"], signal.SIGTERM)
    ended = {
        rank: wait_for(f"run 2 node {rank} to end", lambda ag=agent: (job := job_of(ag, "mn2"))["state"] != "running" and job, 90)
        for rank, agent in ((0, a), (1, b))
    }
    assert not alive(worker0) and [p.name for p in list_checkpoints(jobs[0]["job_dir"])][-1:] == [f"epoch_0_step_{ended[0]['ranks'][0]['step']}"]
    assert ended[0]["detail"] == f"torchrun (pid {jobs[0]['pid']}) got SIGTERM and passed it to its workers", ended[0]
    assert (ended[1]["state"], ended[1]["exit_code"], ended[1]["detail"]) == ("exited", 0, ""), ended[1]
    assert [r["phase"] for r in ended[0]["ranks"] + ended[1]["ranks"]] == ["stopped", "stopped"]
    print(f"SIGTERM to node 0's torchrun alone: node 0 exit {ended[0]['exit_code']} ({ended[0]['detail']}), node 1 exit {ended[1]['exit_code']}")

    # A rank killed: node 1's worker gets SIGKILL; node 0 ends on its own (gloo sees the peer gone), both records say why.
    jobs = start_run(a, b, "mn3", mini_profile_file)
    wait_for("run 3 training on node 1", lambda: training(b, "mn3", 1, 1), 150)
    wait_for("run 3 training on node 0", lambda: training(a, "mn3", 0, 1), 30)
    victim = job_of(b, "mn3")["ranks"][0]["pid"]
    survivor = job_of(a, "mn3")["ranks"][0]["pid"]
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    ended = {}
    for rank, agent in ((1, b), (0, a)):
        ended[rank] = wait_for(f"node {rank} to end", lambda ag=agent: (job := job_of(ag, "mn3"))["state"] != "running" and job, 60)
    took = time.monotonic() - killed_at
    assert ended[1]["state"] == "exited" and ended[1]["exit_code"] != 0
    assert ended[1]["detail"].startswith("torchrun: rank 1 (local rank 0") and "SIGKILL" in ended[1]["detail"], ended[1]["detail"]
    assert ended[0]["state"] == "exited" and ended[0]["exit_code"] != 0
    assert ended[0]["detail"].startswith("torchrun: rank 0 (local rank 0") and "exited 1" in ended[0]["detail"], ended[0]["detail"]
    assert not alive(survivor) and not alive(jobs[0]["pid"]) and not alive(jobs[1]["pid"])
    assert a.ok("stop_plan", name="mn3")["will_signal"] == [] and b.ok("stop_plan", name="mn3")["will_signal"] == []
    print(f"a killed rank ended both nodes in {took:.1f}s: {ended[0]['detail']!r} / {ended[1]['detail']!r}")


def test_torchrun_failure_reads_the_root_cause_block():
    """The parser on the summary shape torch 2.13 prints (the slow test checks it on real torchrun output)."""
    lines = [
        "[rank0]: Traceback (most recent call last):",
        "[rank0]: RuntimeError: Connection closed by peer [127.0.0.1]:4",
        "Root Cause (first observed failure):",
        "[0]:",
        "  time      : 2026-11-30_18:29:48",
        "  host      : localhost",
        "  rank      : 0 (local_rank: 0)",
        "  exitcode  : 1 (pid: 15622) ",
        "  error_file: <N/A>",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
    ]
    assert torchrun_failure(lines) == "torchrun: rank 0 (local rank 0, pid 15622) exited 1: RuntimeError: Connection closed by peer [127.0.0.1]:4"
    killed = [
        "Root Cause (first observed failure):",
        "[0]:",
        "  rank      : 1 (local_rank: 0)",
        "  exitcode  : -9 (pid: 15621)  (SIGKILL)",
        "  traceback : Signal 9 (SIGKILL) received by PID 15621",
    ]
    assert torchrun_failure(killed) == "torchrun: rank 1 (local rank 0, pid 15621) exited -9 (SIGKILL): Signal 9 (SIGKILL) received by PID 15621"
    assert torchrun_failure(["just an error"]) is None
