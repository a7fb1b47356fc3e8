"""The agent over a real subprocess: hello, telemetry, jobs, metrics streaming, stop while streaming, malformed input, EOF."""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from backend.host import procs
from backend.layout import checkpoint_listing as list_checkpoints
from backend.host.disk import dir_size, disk_usage
from backend.protocol import PROTOCOL_VERSION
from backend.jobs.registry import JobRegistry
from tests.fixtures.agent import AgentProcess, PY
from tests.fixtures.env import ROOT


WRITER = """\
import os, signal, sys, time
from backend.jsonl import append_record
job_dir = os.environ["EAGLE3_JOB_DIR"]
def leave(*_):
    time.sleep(1.0)  # a short checkpoint: the stop's grace period covers it
    sys.exit(0)
signal.signal(signal.SIGTERM, leave)
append_record(os.path.join(job_dir, "stages.jsonl"), {"stage": "train", "status": "running", "time": time.time()})
for step in range(100000):
    append_record(os.path.join(job_dir, "metrics.jsonl"), {"step": step, "split": "train", "loss": 10.0 / (step + 1), "time": time.time()})
    print(f"step {step}", flush=True)
    time.sleep(0.05)
"""


@pytest.fixture
def agent(tmp_path):
    process = AgentProcess(tmp_path / "run")
    yield process
    process.close()
    JobRegistry(tmp_path / "run").stop(all_jobs=True, grace=1)


def test_round_trip(agent, tmp_path):
    _, hello = agent.wait(lambda m: m["type"] == "hello")
    assert hello["protocol"] == PROTOCOL_VERSION and hello["agent_pid"] == agent.proc.pid
    assert hello["run_dir"] == str((tmp_path / "run").resolve()) and hello["python"]
    _, gpus = agent.wait(lambda m: m["type"] == "gpus")
    if hello["gpu_source"] == "none":
        assert gpus["gpus"] == [] and gpus["driver"]["available"] is False
        assert "no NVIDIA driver" in gpus["driver"]["message"]
    _, disk = agent.wait(lambda m: m["type"] == "disk")
    assert disk["disks"][0]["label"] == "run_dir" and disk["disks"][0]["free_bytes"] > 0

    job = agent.ok("start_job", name="writer", kind="train", argv=[PY, "-c", WRITER])["job"]
    assert job["state"] == "running" and job["pid"] > 0
    agent.wait(lambda m: m["type"] == "jobs" and any(j["name"] == "writer" and j["state"] == "running" for j in m["jobs"]))
    _, stages = agent.wait(lambda m: m["type"] == "stages" and m["job"] == "writer")
    assert stages["records"][0]["stage"] == "train"
    assert stages["start_offset"] == 0 and stages["offset"] > 0  # byte offsets, so a console can tell a gap
    history = agent.ok("stages_history", name="writer")
    assert history["records"][0]["stage"] == "train" and history["offset"] >= stages["offset"]

    steps: list[int] = []
    index = 0
    while len(steps) < 15:
        index, event = agent.wait(lambda m: m["type"] == "metrics" and m["job"] == "writer", start=index)
        steps.extend(record["step"] for record in event["records"])
        index += 1
    assert steps == list(range(len(steps))), "metrics lines were lost, repeated or reordered"

    history = agent.ok("metrics_history", name="writer")
    assert [r["step"] for r in history["records"][: len(steps)]] == steps and history["offset"] > 0
    resumed = agent.ok("metrics_history", name="writer", offset=history["offset"])
    assert all(r["step"] >= len(history["records"]) for r in resumed["records"])
    assert agent.ok("tail_log", name="writer", lines=2)["lines"][-1].startswith("step ")
    agent.ok("follow_log", name="writer", stream="stdout")
    _, log = agent.wait(lambda m: m["type"] == "log" and m["job"] == "writer")
    assert log["stream"] == "stdout" and log["lines"][0].startswith("step ")
    agent.ok("follow_log", name=None)

    checkpoints = Path(job["job_dir"]) / "checkpoints"
    for name in ("epoch_0_step_10", "epoch_1_step_20", "epoch_1_step_20.tmp"):
        (checkpoints / name).mkdir(parents=True)
        (checkpoints / name / "config.json").write_text("{}")
        (checkpoints / name / "model.safetensors").write_bytes(b"")
    (checkpoints / "latest").write_text("epoch_1_step_20\n")
    found = agent.ok("list_checkpoints", name="writer")["checkpoints"]
    assert [(c["epoch"], c["step"], c["latest"]) for c in found] == [(0, 10, False), (1, 20, True)]

    plan = agent.ok("stop_plan", name="writer")
    assert [w["pid"] for w in plan["will_signal"]] == [job["pid"]] and plan["checkpoint_first"] is True

    mark, _ = agent.request("ping")
    stop_id = 900
    agent.send_raw(json.dumps({"type": "stop_job", "id": stop_id, "name": "writer", "grace": 10}).encode() + b"\n")
    ping_index, _ = agent.request("ping")
    stop_index, stopped = agent.wait(lambda m: m["type"] == "reply" and m["id"] == stop_id, start=mark)
    assert ping_index < stop_index, "a stop in its grace period blocked other requests"
    between = [m for m in agent.messages[mark:stop_index] if m["type"] == "gpus"]
    assert len(between) >= 2, "telemetry paused during the stop's grace period"
    assert [(v["pid"], v["outcome"]) for v in stopped["result"]["verdicts"]] == [(job["pid"], "exited_on_term")]
    agent.wait(
        lambda m: m["type"] == "jobs" and any(j["name"] == "writer" and j["state"] == "stopped" and j["exit_code"] == 0 for j in m["jobs"]), start=stop_index
    )

    snapshot = agent.ok("snapshot")
    assert snapshot["metrics"]["writer"]["step"] >= steps[-1] and snapshot["hello"]["agent_pid"] == agent.proc.pid
    assert [j["name"] for j in snapshot["jobs"]] == ["writer"]
    assert agent.bad_lines == []


def test_malformed_input_gets_errors_and_the_agent_keeps_answering(agent):
    agent.wait(lambda m: m["type"] == "hello")
    cases = [
        (b"this is not json\n", None, "malformed"),
        (b"[1, 2, 3]\n", None, "malformed"),
        (b'{"id": 7, "no": "type"}\n', 7, "malformed"),
        (b'{"type": "make_coffee", "id": 8}\n', 8, "unknown_request"),
        (b'{"type": "start_job", "id": 9, "argv": ["true"]}\n', 9, "bad_params"),
        (b'{"type": "stop_job", "id": 10, "name": "x", "grace": "soon"}\n', 10, "bad_params"),
        (b'{"type": "tail_log", "id": 11, "name": "nope"}\n', 11, "not_found"),
        (b'{"type": "adopt_job", "id": 12, "pid": 1, "name": "init", "confirm_pid": 2}\n', 12, "refused"),
    ]
    for line, request_id, code in cases:
        mark = agent.send_raw(line)
        _, reply = agent.wait(lambda m: m["type"] == "reply" and m["ok"] is False, start=mark)
        assert (reply["id"], reply["error"]["code"]) == (request_id, code), (line, reply)
    _, reply = agent.request("start_job", argv=["true"])
    assert reply["error"]["message"].startswith("name:")
    _, reply = agent.request("stop_job", name="x", grace="soon")
    assert reply["error"]["message"].startswith("grace:")
    assert agent.ok("ping")["pong"] is True
    assert agent.proc.poll() is None and agent.bad_lines == []


def test_signals_and_watch_external_answer_over_the_wire(agent, tmp_path):
    """A job with no records yet has signals; a directory is watched as TensorBoard; a missing path is a bad param."""
    agent.wait(lambda m: m["type"] == "hello")
    agent.ok("start_job", name="quiet", kind="other", argv=["true"])
    assert isinstance(agent.ok("signals", name="quiet"), dict)
    assert agent.ok("watch_external", name="sf", path=str(tmp_path)) == {"job": "ext:sf", "format": "tensorboard", "warning": None}
    _, missing = agent.request("watch_external", name="gone", path=str(tmp_path / "nope"))
    assert missing["error"]["code"] == "bad_params" and missing["error"]["message"].startswith("path:")
    assert agent.ok("ping")["pong"] is True


def test_jobs_outlive_the_agent_and_a_new_agent_resumes(tmp_path):
    run = tmp_path / "run"
    first = AgentProcess(run)
    try:
        first.wait(lambda m: m["type"] == "hello")
        job = first.ok("start_job", name="long", kind="train", argv=[PY, "-c", WRITER])["job"]
        first.wait(lambda m: m["type"] == "metrics" and m["job"] == "long")
        first.proc.stdin.close()  # the SSH connection went away
        assert first.proc.wait(timeout=30) == 0
        assert procs.is_alive(job["pid"], job["start_time_ticks"]), "the job died with the agent"

        second = AgentProcess(run)
        try:
            second.wait(lambda m: m["type"] == "hello")
            snapshot = second.ok("snapshot")
            assert snapshot["jobs"][0]["state"] == "running" and snapshot["metrics"]["long"]["step"] >= 0
            index, event = second.wait(lambda m: m["type"] == "metrics" and m["job"] == "long")
            # It follows from where the file ended when it started: no replay of old lines.
            assert event["start_offset"] > 0 and event["records"][0]["step"] > 0
            assert second.ok("shutdown") == {}
            assert second.proc.wait(timeout=30) == 0
        finally:
            second.close()
        assert procs.is_alive(job["pid"], job["start_time_ticks"])
    finally:
        first.close()
        JobRegistry(run).stop(all_jobs=True, grace=2)


def test_sigterm_ends_the_agent_cleanly(tmp_path):
    agent = AgentProcess(tmp_path / "run")
    try:
        agent.wait(lambda m: m["type"] == "hello")
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.proc.wait(timeout=30) == 0
    finally:
        agent.close()


def test_checkpoints_and_disk_helpers(tmp_path):
    assert list_checkpoints(tmp_path) == []
    root = tmp_path / "checkpoints"
    for name in ("epoch_2_step_300", "epoch_10_step_50"):
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text("{}")
        (root / name / "model.safetensors").write_bytes(b"")
    (root / "epoch_11_step_60").mkdir()  # incomplete (a save in progress): never listed
    os.symlink("epoch_2_step_300", root / "latest")
    assert [(c["epoch"], c["latest"]) for c in list_checkpoints(tmp_path)] == [(2, True), (10, False)]
    (root / "epoch_2_step_300" / "model.safetensors").write_bytes(b"x" * 10000)
    size = dir_size(tmp_path)
    assert size is not None and size >= 10000
    assert dir_size(tmp_path, max_entries=2) is None  # bounded: no partial number
    usage = disk_usage(tmp_path / "not-yet-created", "data_dir", measure_dir=True)
    assert usage.total_bytes > 0 and usage.dir_bytes is None and usage.label == "data_dir"


def test_metrics_series_and_window_answer_from_the_index(tmp_path):
    from tests.fixtures.metrics_records import write_run

    registry = JobRegistry(tmp_path / "run")
    info = registry.start_job("long", "train", [PY, "-c", "import time; time.sleep(60)"])
    write_run(Path(info.job_dir) / "metrics.jsonl", 6_000, nans={4_000})  # a history this agent never saw
    agent = AgentProcess(tmp_path / "run")
    try:
        _check_series_answers(agent, Path(info.job_dir))
    finally:
        agent.close()
        registry.stop(all_jobs=True, grace=1)


def _check_series_answers(agent, job_dir: Path) -> None:
    _, progress = agent.wait(lambda m: m["type"] == "index_progress" and m["job"] == "long" and m["caught_up"], timeout=60)
    assert progress["indexed_bytes"] == progress["file_bytes"] > 0
    result = agent.ok("metrics_series", name="long", keys=["train.loss", "val.loss", "nope"], points=50)
    assert len(result["series"]["train.loss"]) == 50 and result["series"]["nope"] == []
    assert result["step_range"] == [1, 6_000] and result["nonfinite"]["train.loss"] == 1
    assert "val.acc.0" in result["keys"] and result["total_records"] == 6_024
    zoom = agent.ok("metrics_series", name="long", keys=["train.loss"], points=10, **{"from": 5_000, "to": 5_999}, log_x=True)
    buckets = zoom["series"]["train.loss"]  # ranges resolve to fine buckets (1/64 octave here, 128 steps past 8192)
    assert buckets[0]["step_lo"] >= 5_000 and buckets[-1]["step_hi"] <= 5_999 + 128
    window = agent.ok("metrics_window", name="long", last=30, val=3)
    assert [r["step"] for r in window["records"]][-1] == 6_000 and len(window["records"]) == 30
    assert [r["step"] for r in window["val"]] == [5_500, 5_750, 6_000]
    signals = agent.ok("signals", name="long")
    assert signals["n_records"] == 6_024 and signals["n_val"] == 24
    for bad in ({"points": 0}, {"points": 10**6}, {"keys": "train.loss"}, {"from": 10, "to": 5}):
        _, reply = agent.request("metrics_series", name="long", **bad)
        assert not reply["ok"] and reply["error"]["code"] == "bad_params"
    assert (job_dir / "metrics.index").exists()


def test_the_agent_answers_every_hostile_line(agent):
    agent.wait(lambda m: m["type"] == "hello")
    hostile = [
        b"[" * 5000 + b"\n",
        b'{"type":"ping","id":' + b"9" * 5000 + b"}\n",
        b'{"type":"ping","id":1,"x":"\x00"}\n',
        b"\xff\xfe not utf-8\n",
        b'{"type":"ping","id":2,"pad":"' + b"x" * (5 << 20) + b'"}\n',
        b'{"type":"stop_job","id":3,"name":"x","grace":NaN}\n',
        b'{"type":"stop_job","id":4,"name":"x","grace":1e9}\n',
    ]
    for line in hostile:
        mark = agent.send_raw(line)
        _, reply = agent.wait(lambda m: m["type"] == "reply", start=mark)
        assert reply["ok"] is False and reply["error"]["code"] in ("malformed", "bad_params"), reply
    assert agent.ok("ping")["pong"] is True


def test_log_following_survives_a_line_longer_than_a_chunk(agent, tmp_path):
    go = tmp_path / "go"  # the job writes only once the agent follows its log (following starts at the log's end)
    script = (
        "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.02)\n"
        "sys.stdout.write('x' * (3 << 20)); sys.stdout.flush(); time.sleep(0.5)\n"
        "for i in range(3):\n    sys.stdout.write(f'\\rprogress {i}'); sys.stdout.flush(); time.sleep(0.2)\n"
        "print(); print('after', flush=True); time.sleep(60)\n"
    )
    agent.ok("start_job", name="bar", kind="other", argv=[PY, "-c", script, str(go)])
    agent.ok("follow_log", name="bar", stream="stdout")
    go.touch()
    seen: list[str] = []

    def got_after(message) -> bool:
        if message["type"] == "log" and message["job"] == "bar":
            seen.extend(message["lines"])
        return "after" in seen

    agent.wait(got_after, timeout=30)
    assert any(line.endswith("cut)") and len(line) < 5000 for line in seen)
    assert any(line.startswith("progress") for line in seen)
    _, reply = agent.request("tail_log", name="bar", lines=10**9)
    assert reply["ok"] is False and reply["error"]["code"] == "bad_params"


def test_fuzzed_request_stream_is_answered_line_for_line():
    """benchmarks/fuzz_agent.py at CI size: every line gets a reply, the agent never dies."""
    out = subprocess.run([PY, "benchmarks/fuzz_agent.py", "--lines", "1500", "--seed", "7"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    result = json.loads(out.stdout)
    assert out.returncode == 0 and result["crashes"] == 0 and result["unanswered"] == 0 and result["answered"] == 1500, result


def test_disk_events_carry_what_the_next_checkpoint_needs(tmp_path):
    registry = JobRegistry(tmp_path / "run")
    info = registry.start_job("train-ck", "train", [PY, "-c", "import time; time.sleep(60)"])
    checkpoint = Path(info.job_dir) / "checkpoints" / "epoch_0_step_5"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "model.safetensors").write_bytes(b"\0" * (1 << 20))
    (checkpoint.parent / "latest").write_text("epoch_0_step_5\n")
    agent = AgentProcess(tmp_path / "run")
    try:
        _, event = agent.wait(lambda m: m["type"] == "disk")
        run_disk = next(d for d in event["disks"] if d["label"] == "run_dir")
        assert run_disk["checkpoint_bytes"] >= 1 << 20
    finally:
        agent.close()
        registry.stop(all_jobs=True, grace=1)


def test_a_path_naming_an_unknown_user_is_a_bad_param_not_an_internal_error(agent):
    agent.wait(lambda m: m["type"] == "hello")
    _, reply = agent.request("data_scaling", data_dir="~no-such-user-xyz/data")
    assert reply["ok"] is False and reply["error"]["code"] == "bad_params", reply


# -- per-job CPU % and RSS (issue 26) -------------------------------------------------------------------

BURNER = """\
import os, subprocess, sys
ballast = bytearray(64 << 20)  # 64 MiB resident in the leader
for page in range(0, len(ballast), 4096):
    ballast[page] = 1
child = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # the CPU is burnt by a descendant
child.wait()
"""


def test_jobs_carry_the_cpu_and_rss_of_their_whole_process_tree(agent):
    """The leader holds 64 MiB, its child spins: the job's RSS counts the leader, its CPU % the child (nvitop's columns)."""
    agent.wait(lambda m: m["type"] == "hello")
    agent.ok("start_job", name="burner", kind="other", argv=[PY, "-c", BURNER])

    def measured(message: dict) -> bool:
        job = next((j for j in message.get("jobs", []) if j["name"] == "burner"), None) if message["type"] == "jobs" else None
        return bool(job and job.get("cpu_pct") is not None and job["rss_bytes"] >= 64 << 20)

    _, event = agent.wait(measured, timeout=30)
    job = next(j for j in event["jobs"] if j["name"] == "burner")
    assert job["cpu_pct"] > 10.0, job  # a busy loop on a shared machine gets well over a tenth of a core
    assert 64 << 20 <= job["rss_bytes"] < 1 << 30
    listed = next(j for j in agent.ok("list_jobs")["jobs"] if j["name"] == "burner")
    assert listed["rss_bytes"] >= 64 << 20  # the replies carry the latest measure too
    agent.ok("stop_job", name="burner", grace=2)
    _, stopped = agent.wait(lambda m: m["type"] == "jobs" and any(j["name"] == "burner" and j["state"] != "running" for j in m["jobs"]))
    assert next(j for j in stopped["jobs"] if j["name"] == "burner")["cpu_pct"] is None  # a finished job has no usage


def test_an_unwatched_run_sends_no_more_events_and_its_files_stay(agent, tmp_path):
    agent.wait(lambda m: m["type"] == "hello")
    log = tmp_path / "train.log"
    log.write_text("step 1 loss 2.0\n")
    assert agent.ok("watch_external", name="mine", path=str(log))["job"] == "ext:mine"
    agent.wait(lambda m: m["type"] == "metrics" and m["job"] == "ext:mine")
    assert agent.ok("unwatch_external", name="ext:mine") == {"job": "ext:mine", "path": str(log)}
    mark = len(agent.messages)
    log.write_text("step 1 loss 2.0\nstep 2 loss 1.5\n")
    agent.wait(lambda m: m["type"] == "gpus", start=mark)  # a few ticks go by
    agent.wait(lambda m: m["type"] == "gpus", start=len(agent.messages))
    assert not [m for m in agent.messages[mark:] if m.get("job") == "ext:mine"]
    assert log.read_text().endswith("step 2 loss 1.5\n")  # nothing on the host was touched
    _, again = agent.request("unwatch_external", name="mine")
    assert again["error"]["code"] == "not_found" and "no watched run named 'ext:mine'" in again["error"]["message"]
