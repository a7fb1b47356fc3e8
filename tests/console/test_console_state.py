"""The console state folds agent messages: jobs, GPUs, no-driver state, metrics with exact offsets, logs."""

from backend.protocol import DiskUsage
from console.state import CONNECTED, RECONNECTING, ConnectionStatus, ConsoleState, disk_low

JOB = {
    "name": "train-1",
    "kind": "train",
    "state": "running",
    "pid": 10,
    "pgid": 10,
    "start_time_ticks": 5,
    "argv": ["x"],
    "job_dir": "/r/jobs/train-1",
    "stdout_path": "/r/o",
    "stderr_path": "/r/e",
    "started_at": 100.0,
    "detail": "",
    "future_field": 1,
}


def test_jobs_event_replaces_the_table_and_keeps_details():
    state = ConsoleState(clock=lambda: 500.0)
    changed = state.apply({"type": "jobs", "jobs": [JOB, {**JOB, "name": "old", "started_at": 1.0, "state": "exited", "detail": "exit 0"}]})
    assert changed == {"jobs"}
    assert list(state.jobs) == ["old", "train-1"]  # oldest first
    assert state.job_details["old"] == "exit 0"
    assert state.updated_at["jobs"] == 500.0
    state.apply({"type": "jobs", "jobs": []})
    assert state.jobs == {}


def test_no_driver_state_comes_from_the_driver_report():
    state = ConsoleState()
    assert not state.no_driver  # nothing known yet
    state.apply({"type": "gpus", "gpus": [], "driver": {"available": False, "message": "no NVIDIA driver (libnvidia-ml.so not found)"}})
    assert state.no_driver and "libnvidia-ml" in state.gpu_status_text
    state.apply({"type": "gpus", "gpus": [{"index": 0, "memory_used_mib": 1.0, "processes": [{"pid": 3}]}], "driver": {"available": True}})
    assert not state.no_driver and state.gpus[0].processes[0].pid == 3


def test_metrics_events_after_history_use_byte_offsets_without_duplicates_or_holes():
    state = ConsoleState()
    history = {"records": [{"step": 1, "loss": 5.0, "lr": 1e-3}, {"step": 2, "split": "val", "loss": 6.0, "acc": [0.5, 0.25]}], "offset": 200}
    state.apply_metrics_history("train-1", history, reset=True)
    metrics = state.metrics["train-1"]
    assert len(metrics.train_loss) == 1 and len(metrics.val_loss) == 1 and metrics.val_acc == [(2, [0.5, 0.25])]
    # an event the history already covered is dropped
    assert state.apply({"type": "metrics", "job": "train-1", "records": [{"step": 2, "loss": 9}], "start_offset": 100, "offset": 200}) == set()
    # the next one continues exactly at our offset
    state.apply({"type": "metrics", "job": "train-1", "records": [{"step": 3, "loss": 4.0}], "start_offset": 200, "offset": 260})
    assert metrics.train_loss.steps == [1.0, 3.0] and metrics.offset == 260
    # a hole (we missed 260..300): not applied, flagged for a re-read from our offset
    assert state.apply({"type": "metrics", "job": "train-1", "records": [{"step": 5, "loss": 3.0}], "start_offset": 300, "offset": 360}) == {"metrics_gap"}
    assert metrics.needs_catchup and metrics.train_loss.steps == [1.0, 3.0]
    state.apply_metrics_history("train-1", {"records": [{"step": 4, "loss": 3.5}, {"step": 5, "loss": 3.0}], "offset": 360}, reset=False)
    assert metrics.train_loss.steps == [1.0, 3.0, 4.0, 5.0] and not metrics.needs_catchup


def test_live_events_that_do_not_follow_the_records_held_are_a_gap_even_before_any_history_load():
    """A reconnect before the job's history was loaded: the new agent streams from the file's end; the records written
    while the console was away must be loaded, not skipped (the curve would show steps 1, 2, 3, 6 as if contiguous)."""
    state = ConsoleState()
    first = {"type": "metrics", "job": "j", "records": [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.9}], "start_offset": 0, "offset": 80}
    assert state.apply(first) == {"metrics"}  # an agent meeting a run mid-file: the first event starts where it does
    assert state.apply({"type": "metrics", "job": "j", "records": [{"step": 3, "loss": 0.8}], "start_offset": 80, "offset": 120}) == {"metrics"}
    after_reconnect = {"type": "metrics", "job": "j", "records": [{"step": 6, "loss": 0.5}], "start_offset": 200, "offset": 240}
    assert state.apply(after_reconnect) == {"metrics_gap"}
    metrics = state.metrics["j"]
    assert metrics.train_loss.steps == [1.0, 2.0, 3.0] and metrics.needs_catchup and metrics.offset == 120
    joined_late = ConsoleState()  # a job's first event may start anywhere: there is nothing for it to follow yet
    assert joined_late.apply({**after_reconnect, "job": "k"}) == {"metrics"} and joined_late.metrics["k"].offset == 240


def test_stage_events_that_skip_lines_are_a_gap_until_the_history_covers_them():
    """A new agent after a reconnect follows stages.jsonl from its end: the lines written meanwhile (launch ok, canary,
    bench running) came in no event. The state says so on every event until stages_history covers them, then merges."""

    def line(stage, status, t):
        return {"stage": stage, "status": status, "time": t}

    state = ConsoleState()
    assert state.apply({"type": "stages", "job": "c", "records": [line("stop", "running", 1)], "start_offset": 0, "offset": 50}) == {"stages"}
    assert state.apply({"type": "stages", "job": "c", "records": [line("stop", "ok", 2)], "start_offset": 50, "offset": 100}) == {"stages"}
    skipped = {"type": "stages", "job": "c", "records": [line("bench", "ok", 6)], "start_offset": 300, "offset": 350}
    assert state.apply(skipped) == {"stages", "stages_gap"} and state.stages_offset["c"] == 100
    assert state.apply({**skipped, "records": [line("result", "ok", 7)], "start_offset": 350, "offset": 400}) == {"stages", "stages_gap"}
    history = [line("stop", "running", 1), line("stop", "ok", 2), line("launch", "ok", 3), line("canary", "ok", 4), line("bench", "running", 5)]
    state.apply_stages_history("c", history + [line("bench", "ok", 6)], offset=350)
    assert [(r["stage"], r["status"]) for r in state.stages["c"]] == [(r["stage"], r["status"]) for r in history] + [("bench", "ok"), ("result", "ok")]
    assert state.stages_offset["c"] == 350 and state.stages_seen_end["c"] == 400  # the reply predates "result": read again
    assert state.apply({"type": "stages", "job": "c", "records": [], "start_offset": 400, "offset": 400}) == {"stages", "stages_gap"}
    state.apply_stages_history("c", history + [line("bench", "ok", 6), line("result", "ok", 7)], offset=400)
    assert len(state.stages["c"]) == 7 and state.stages_offset["c"] == 400
    follows = {"type": "stages", "job": "c", "records": [line("done", "ok", 8)], "start_offset": 400, "offset": 450}
    assert state.apply(follows) == {"stages"} and state.stages_offset["c"] == 450


def test_nonfinite_values_are_counted_not_plotted_and_out_of_order_steps_are_sorted():
    state = ConsoleState()
    state.apply(
        {"type": "metrics", "job": "j", "records": [{"step": 5, "loss": 1.0}, {"step": 6, "loss": float("nan")}, {"step": 3, "loss": 2.0}], "offset": 10}
    )
    series = state.metrics["j"].train_loss
    assert series.steps == [3.0, 5.0] and series.values == [2.0, 1.0] and series.nonfinite == 1


def test_snapshot_fills_latest_metrics_and_keeps_disks_until_the_agent_measured_them():
    state = ConsoleState()
    state.apply({"type": "disk", "disks": [{"path": "/r", "label": "run_dir", "total_bytes": 10, "used_bytes": 5, "free_bytes": 5}]})
    state.apply_snapshot(
        {
            "hello": {
                "protocol": 1,
                "host": "h",
                "python": "3.12",
                "agent_pid": 1,
                "run_dir": "/r",
                "driver": None,
                "nvml": "no",
                "gpu_source": "none",
                "sglang": None,
            },
            "gpus": [],
            "driver": {"available": False, "message": "no driver"},
            "jobs": [JOB],
            "metrics": {"train-1": {"step": 7, "split": "train", "loss": 2.5}},
            "disks": [],
        }
    )
    assert state.hello.host == "h" and state.no_driver
    assert state.metrics["train-1"].latest_train["loss"] == 2.5
    assert state.disks and state.disks[0].path == "/r"


def test_logs_keep_a_bounded_tail_and_a_generation_for_replacements():
    state = ConsoleState()
    state.apply({"type": "log", "job": "j", "stream": "stdout", "lines": [f"l{i}" for i in range(2500)]})
    buffer = state.logs[("j", "stdout")]
    assert len(buffer.lines) == 2000 and buffer.total == 2500 and buffer.lines[-1] == "l2499"
    buffer.replace(["fresh"])
    assert list(buffer.lines) == ["fresh"] and buffer.generation == 1
    assert state.apply({"type": "log", "job": "j", "stream": "bogus", "lines": ["x"]}) == set()


def test_connection_status_decides_staleness():
    state = ConsoleState()
    assert state.stale
    state.set_connection(ConnectionStatus(state=CONNECTED))
    assert not state.stale
    state.set_connection(ConnectionStatus(state=RECONNECTING, attempt=2))
    assert state.stale


def test_holders_split_memory_into_ours_and_foreign_per_gpu():
    state = ConsoleState()
    state.apply_holders(
        [
            {"pid": 1, "owned": True, "job": "t", "gpu_indices": [0], "used_memory_mib": 100.0},
            {"pid": 2, "owned": False, "gpu_indices": [0, 1], "used_memory_mib": 50.0},
        ]
    )
    assert state.owned_memory_by_gpu() == {0: 100.0}
    assert state.foreign_memory_by_gpu() == {0: 25.0, 1: 25.0}


def test_events_during_a_history_load_are_held_and_what_lies_beyond_is_flagged():
    state = ConsoleState()
    metrics = state.job_metrics("j")
    metrics.loading = True
    # the agent's tick emits lines the in-flight history reply may or may not contain
    assert state.apply({"type": "metrics", "job": "j", "records": [{"step": 1, "loss": 1.0}], "start_offset": 0, "offset": 50}) == set()
    assert state.apply({"type": "metrics", "job": "j", "records": [{"step": 2, "loss": 1.0}], "start_offset": 50, "offset": 100}) == set()
    state.apply_metrics_history("j", {"records": [{"step": 1, "loss": 1.0}], "offset": 50}, reset=True)
    metrics = state.metrics["j"]
    assert metrics.train_loss.steps == [1.0] and metrics.needs_catchup  # 50..100 still to read
    state.apply_metrics_history("j", {"records": [{"step": 2, "loss": 1.0}], "offset": 100}, reset=False)
    assert metrics.train_loss.steps == [1.0, 2.0] and not metrics.needs_catchup


def test_latest_metrics_panel_shows_the_trainers_own_speed_and_memory():
    from console.widgets.panels import latest_metrics_text

    state = ConsoleState()
    state.apply(
        {
            "type": "metrics",
            "job": "t",
            "records": [
                {"step": 10, "split": "train", "loss": 2.0, "tokens": 20480, "step_time": 0.073, "tokens_per_s": 28080.0, "mfu": 0.65, "peak_mem_gib": 11.13}
            ],
            "offset": 100,
            "start_offset": 0,
        }
    )
    text = str(latest_metrics_text(state, "t"))
    assert "tok/s" in text and "MFU 65" in text and "peak 11.1 GiB" in text


def test_disk_warning_fires_below_two_checkpoints_of_free_space():
    from console.widgets.banner import banner_text, disk_warning

    state = ConsoleState()
    disk = {"path": "/runs", "label": "run_dir", "total_bytes": 100 << 30, "used_bytes": 95 << 30, "free_bytes": 5 << 30}
    state.apply({"type": "disk", "disks": [{**disk, "checkpoint_bytes": 2 << 30}]})
    assert disk_warning(state) is None
    state.apply({"type": "disk", "disks": [{**disk, "checkpoint_bytes": 3 << 30}]})
    assert disk_warning(state).startswith("disk nearly full: 5.0 GiB free on /runs, a checkpoint needs ~3.0 GiB")
    assert "DISK  disk nearly full" in str(banner_text(state))


def test_one_rule_says_a_disk_is_low_two_checkpoints_of_room_when_known_else_90_percent_used():
    def disk(used: int, checkpoint: int | None = None) -> DiskUsage:
        return DiskUsage(path="/runs", label="run_dir", total_bytes=100, used_bytes=used, free_bytes=100 - used, checkpoint_bytes=checkpoint)

    assert disk_low(disk(91)) and not disk_low(disk(90))
    assert not disk_low(disk(95, checkpoint=2))  # room for two more saves: not low, however full
    assert disk_low(disk(50, checkpoint=30))  # 50 free, two checkpoints need 60


def test_banner_after_giving_up_does_not_promise_a_reconnect():
    from console.state import FAILED, ConnectionStatus
    from console.widgets.banner import banner_text

    state = ConsoleState(target="gpu-box")
    state.set_connection(ConnectionStatus(state=FAILED, detail="host key for gpu-box changed: refused"))
    text = str(banner_text(state))
    assert "will not retry" in text and "until the connection is back" not in text


def test_events_that_do_not_fit_the_contract_are_refused_into_the_hosts_notes_and_change_nothing():
    """Wrong types, missing fields and unknown enum values: the bad part is left out and named, the rest is applied."""
    from console.state import GPUS_MAX, STRING_CAP

    state = ConsoleState(clock=lambda: 500.0)
    state.apply({"type": "jobs", "jobs": [JOB]})
    assert state.apply({"type": "jobs", "jobs": "all of them"}) == set()  # the whole event is refused: the table stays
    assert list(state.jobs) == ["train-1"] and "jobs: expected an array" in state.notes[-1][1]
    state.apply({"type": "jobs", "jobs": [JOB, {**JOB, "name": "b", "state": "undead"}, {**JOB, "name": "c", "pid": "10"}]})
    assert list(state.jobs) == ["train-1"] and "left out 2 of 3 jobs" in state.notes[-1][1] and "undead" in state.notes[-1][1]
    hello = {
        "type": "hello",
        "protocol": 2,
        "host": "h",
        "python": "3",
        "agent_pid": 1,
        "run_dir": "/r",
        "driver": None,
        "nvml": "ok",
        "gpu_source": "nvml",
        "sglang": None,
    }
    state.apply(hello)
    assert state.apply({**hello, "host": 5}) == set() and state.hello.host == "h" and "HelloInfo.host" not in state.notes[-1][1]
    assert "hello.host: expected a string, got int" in state.notes[-1][1]
    state.apply({"type": "gpus", "gpus": [{"index": 0, "name": 7}, {"index": 1, "memory_used_mib": float("nan")}, {"index": 2, "name": "H200"}]})
    assert [g.index for g in state.gpus] == [2] and "left out 2 of 3 gpus" in state.notes[-1][1]
    state.apply({"type": "gpus", "gpus": [{"index": i} for i in range(200_000)]})
    assert len(state.gpus) == GPUS_MAX and "200000 gpus" in state.notes[-1][1]
    state.apply({"type": "log", "job": "train-1", "stream": "stdout", "lines": ["\x1b[2J" + "x" * (5 << 20)]})
    kept = state.log("train-1", "stdout").lines[-1]
    assert len(kept) < STRING_CAP + 40 and kept.endswith("chars cut]")
    assert state.apply({"type": "metrics", "job": "train-1", "records": [{"step": 1, "loss": 1.0}], "offset": "10"}) == set()
    assert "train-1" not in state.metrics or not state.metrics["train-1"].records
    assert state.notes_added == 6 and len(state.notes) == 6
