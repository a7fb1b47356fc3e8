"""console/alerts.py without a UI: which state changes raise which alert, each once, and which come back after clearing."""

from __future__ import annotations

from typing import Any

from console.alerts import Alert, AlertMemory, new_alerts
from console.state import ConsoleState
from tests.fixtures.console_states import job_wire


def with_jobs(*jobs: dict[str, Any]) -> ConsoleState:
    state = ConsoleState()
    state.apply({"type": "jobs", "jobs": list(jobs)})
    return state


def with_disk(used: int, free: int, checkpoint: int | None = None) -> ConsoleState:
    state = ConsoleState()
    disk = {"path": "/root/.eagle3", "label": "run_dir", "total_bytes": 100, "used_bytes": used, "free_bytes": free, "checkpoint_bytes": checkpoint}
    state.apply({"type": "disk", "disks": [disk]})
    return state


def texts(alerts: list[Alert]) -> list[str]:
    return [a.text for a in alerts]


def test_the_first_jobs_list_is_not_news_and_an_exit_after_it_is_alerted_once():
    memory, alerts = new_alerts(AlertMemory(), with_jobs(job_wire("a", "exited", 1)), {"jobs"})
    assert alerts == []
    memory, alerts = new_alerts(memory, with_jobs(job_wire("a", "running")), {"jobs"})
    assert alerts == []
    memory, alerts = new_alerts(memory, with_jobs(job_wire("a", "exited", 1)), {"jobs"})
    assert alerts == [Alert("job a exited with exit code 1", "error")]
    _, alerts = new_alerts(memory, with_jobs(job_wire("a", "exited", 1)), {"jobs"})
    assert alerts == []


def test_a_clean_stop_is_a_warning_and_the_host_is_named_when_given():
    memory, _ = new_alerts(AlertMemory(), with_jobs(job_wire("a", "running")), {"jobs"})
    _, alerts = new_alerts(memory, with_jobs(job_wire("a", "stopped")), {"jobs"}, " on gpu-b")
    assert alerts == [Alert("job a on gpu-b stopped", "warning")]


def test_only_the_sections_that_changed_are_looked_at():
    memory, _ = new_alerts(AlertMemory(), with_jobs(job_wire("a", "running")), {"jobs"})
    _, alerts = new_alerts(memory, with_jobs(job_wire("a", "exited", 1)), {"metrics", "disks"})
    assert alerts == []


def test_a_rank_not_reporting_is_alerted_once_and_again_after_it_reported():
    ranks = [{"rank": 0, "step": 90, "age_s": 1.0}, {"rank": 1, "step": 80, "age_s": 42.0}]
    stalled = with_jobs(job_wire("mn", "running", node_rank=1, ranks=ranks, stalled_ranks=[1]))
    memory, alerts = new_alerts(AlertMemory(), stalled, {"jobs"})
    assert alerts == [Alert("mn: node 1 rank 1 not reporting for 42 s (last step 80)", "error")]
    memory, alerts = new_alerts(memory, stalled, {"jobs"})
    assert alerts == []
    memory, alerts = new_alerts(memory, with_jobs(job_wire("mn", "running", node_rank=1, ranks=ranks)), {"jobs"})
    assert alerts == []
    _, alerts = new_alerts(memory, stalled, {"jobs"})
    assert len(alerts) == 1


def test_a_red_canary_that_arrived_live_is_alerted_once_and_one_read_from_history_never():
    record = {"stage": "canary", "status": "failed", "time": 5.0, "detail": "canary RED: accept length 1.00"}
    history = ConsoleState()
    history.apply_stages_history("chain-a", [record])
    assert new_alerts(AlertMemory(), history, {"stages"})[1] == []
    live = ConsoleState()
    live.apply({"type": "stages", "job": "chain-a", "records": [record]})
    memory, alerts = new_alerts(AlertMemory(), live, {"stages"})
    assert alerts == [Alert("canary RED in chain-a: canary RED: accept length 1.00", "error")]
    assert new_alerts(memory, live, {"stages"})[1] == []


def test_a_detected_onset_is_alerted_once():
    state = ConsoleState()
    state.signals["a"] = {"onset": {"detected": False}}
    memory, alerts = new_alerts(AlertMemory(), state, {"signals"})
    assert alerts == []
    state.signals["a"] = {"onset": {"detected": True, "step": 14000}}
    memory, alerts = new_alerts(memory, state, {"signals"})
    assert texts(alerts) == ["grokking onset in a at step 14000"]
    assert new_alerts(memory, state, {"signals"})[1] == []


def test_a_low_disk_is_alerted_once_and_again_after_it_recovered():
    memory, alerts = new_alerts(AlertMemory(), with_disk(used=95, free=5), {"disks"})
    assert alerts == [Alert("disk low: run_dir /root/.eagle3 (95% used)", "error")]
    memory, alerts = new_alerts(memory, with_disk(used=95, free=5), {"disks"})
    assert alerts == []
    memory, alerts = new_alerts(memory, with_disk(used=50, free=50), {"disks"})
    assert alerts == []
    _, alerts = new_alerts(memory, with_disk(used=50, free=50, checkpoint=30), {"disks"})
    assert texts(alerts) == ["disk low: run_dir /root/.eagle3 (less free than two checkpoints need)"]


def test_the_memory_handed_in_is_not_changed():
    before = AlertMemory()
    new_alerts(before, with_disk(used=95, free=5), {"disks"})
    assert before == AlertMemory()
