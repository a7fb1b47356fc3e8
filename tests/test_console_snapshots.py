"""Snapshot tests of each screen with frozen data: fixed clock, no live timers, no cursor blink, UTC.

Regenerate the baselines with `pytest tests/test_console_snapshots.py --snapshot-update` and commit
tests/__snapshots__/test_console_snapshots/*.svg.
"""

import math

import pytest
from textual.widgets import Input

from console.app import build_app
from console.screens.modals import AdoptModal, ResumeModal, StopModal
from console.state import CONNECTED, RECONNECTING, ConnectionStatus, ConsoleState
from backend.protocol import GpuHolder, to_dict

NOW = 1_760_000_000.0
SIZE = (160, 48)


def wire_jobs(state: ConsoleState) -> list[dict]:
    """The state's jobs as an agent's jobs event lists them (to fold more jobs in beside them)."""
    return [to_dict(job) for job in state.jobs.values()]


def frozen_state(points: int = 400, *, gpus: bool = True) -> ConsoleState:
    """A host with two H200s, one of our training jobs (with a loss spike) and a foreign server."""
    state = ConsoleState(target="gpu-host", clock=lambda: NOW)
    state.set_connection(ConnectionStatus(state=CONNECTED, since=NOW - 100))
    state.apply(
        {
            "type": "hello",
            "protocol": 1,
            "host": "gpu-host",
            "python": "3.12.3",
            "agent_pid": 4242,
            "run_dir": "/root/.eagle3",
            "driver": "580.159.04" if gpus else None,
            "nvml": "ok" if gpus else "no NVIDIA driver (libnvidia-ml.so not found)",
            "gpu_source": "nvml" if gpus else "none",
            "sglang": None,
            "backend_hash": "0123abcd4567ef89",
        }
    )
    if gpus:
        samples = [
            {
                "index": i,
                "name": "NVIDIA H200",
                "memory_used_mib": used,
                "memory_total_mib": 143771.0,
                "utilization_pct": util,
                "temperature_c": 40 + i,
                "power_w": 300.0,
                "processes": [],
            }
            for i, (used, util) in enumerate([(82000.0, 97.0), (20480.0, 12.0)])
        ]
        state.apply({"type": "gpus", "gpus": samples, "driver": {"available": True, "message": "NVML, driver 580.159.04, 2 GPU(s)"}})
        state.apply_holders(
            [
                {
                    "pid": 1234,
                    "owned": True,
                    "job": "train-kimi",
                    "user": "root",
                    "cmdline": "python -m backend train",
                    "gpu_indices": [0],
                    "used_memory_mib": 61440.0,
                },
                {"pid": 448, "owned": False, "user": "bob", "cmdline": "python3 serve.py --port 8000", "gpu_indices": [0, 1], "used_memory_mib": 40960.0},
            ]
        )
    else:
        state.apply(
            {
                "type": "gpus",
                "gpus": [],
                "driver": {"available": False, "message": "no NVIDIA driver (libnvidia-ml.so not found); nvidia-smi not found on PATH"},
            }
        )
    state.apply(
        {
            "type": "jobs",
            "jobs": [
                {
                    "name": "train-kimi",
                    "kind": "train",
                    "state": "running",
                    "pid": 1234,
                    "pgid": 1234,
                    "start_time_ticks": 1,
                    "argv": ["eagle3-host", "train"],
                    "job_dir": "/root/.eagle3/jobs/train-kimi",
                    "stdout_path": "/root/.eagle3/jobs/train-kimi/stdout.log",
                    "stderr_path": "/root/.eagle3/jobs/train-kimi/stderr.log",
                    "started_at": NOW - 3725,
                    "detail": "",
                    "cpu_pct": 312.4,
                    "rss_bytes": 10_522_669_875,
                },
                {
                    "name": "bench-old",
                    "kind": "bench",
                    "state": "exited",
                    "pid": 999,
                    "pgid": 999,
                    "start_time_ticks": 1,
                    "argv": ["eagle3-host", "bench"],
                    "job_dir": "/x",
                    "stdout_path": "/x/o",
                    "stderr_path": "/x/e",
                    "started_at": NOW - 90000,
                    "ended_at": NOW - 86000,
                    "exit_code": 0,
                    "detail": "exit 0",
                },
            ],
        }
    )
    records = []
    for i in range(1, points + 1):
        step = i * 10
        loss = 6.0 * math.exp(-step / 1500) + 1.5 + 0.05 * math.sin(step / 37) + (3.0 if i == points // 2 else 0.0)
        lr = 3e-4 * 0.5 * (1 + math.cos(math.pi * step / (points * 10))) + 1e-6
        records.append(
            {
                "step": step,
                "epoch": step // 2000,
                "split": "train",
                "loss": loss,
                "lr": lr,
                "grad_norm": 0.4,
                "weight_norm": 123.4,
                "tokens": step * 4096,
                "step_time": 0.31,
            }
        )
        if i % 40 == 0:
            records.append({"step": step, "epoch": step // 2000, "split": "val", "loss": loss + 0.3, "acc": [0.745 - 0.05 * k - step / 1e6 for k in range(7)]})
    state.apply_metrics_history("train-kimi", {"records": records, "offset": 12345}, reset=True)
    state.apply(
        {
            "type": "disk",
            "disks": [
                {
                    "path": "/root/.eagle3",
                    "label": "run_dir",
                    "total_bytes": 2 * 1024**4,
                    "used_bytes": int(1.6 * 1024**4),
                    "free_bytes": int(0.4 * 1024**4),
                    "dir_bytes": 300 * 1024**3,
                }
            ],
        }
    )
    state.apply({"type": "log", "job": "train-kimi", "stream": "stdout", "lines": [f"step {i * 10} loss {6 - i * 0.01:.3f}" for i in range(40)]})
    state.apply({"type": "log", "job": "train-kimi", "stream": "stderr", "lines": ["UserWarning: an example warning"]})
    state.agent_stderr.append("agent: disks failed: PermissionError: [Errno 13] Permission denied: '/data/shards'")
    state.note_action("started train-kimi (pid 1234): eagle3-host train --profile kimi-k2.5")
    state.last_data_at = NOW - 5
    return state


STOP_PLAN = {
    "jobs": ["train-kimi"],
    "will_signal": [
        {"pid": 1234, "job": "train-kimi", "cmdline": "python -m backend train --profile kimi-k2.5", "role": "leader"},
        {"pid": 1240, "job": "train-kimi", "cmdline": "python -m torch.distributed.run worker", "role": "group"},
    ],
    "stale": [],
    "foreign_gpu_holders": [{"pid": 448, "user": "bob", "cmdline": "python3 serve.py --port 8000", "used_memory_mib": 40960.0}],
    "checkpoint_first": True,
}


def frozen_app(state: ConsoleState | None = None):
    app = build_app(state=state or frozen_state(), poll_interval=None, refresh_throttle=0)
    return app


pytestmark = pytest.mark.usefixtures("utc")  # snapshot clocks read in UTC (tests/conftest.py)


async def select_and_draw(pilot, *keys: str) -> None:
    app = pilot.app
    app.select_job("train-kimi")
    await pilot.pause()
    for key in keys:
        await pilot.press(key)
        await pilot.pause()
    app.redraw_now()
    await pilot.pause()


def test_dashboard(snap_compare):
    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=select_and_draw)


def test_dashboard_disconnected_shows_stale_data(snap_compare):
    state = frozen_state()
    state.set_connection(
        ConnectionStatus(
            state=RECONNECTING,
            detail="reconnect attempt 2 failed: cannot reach gpu-host: [Errno 111] Connection refused",
            since=NOW - 1,
            attempt=3,
            retry_in=2.0,
        )
    )
    assert snap_compare(frozen_app(state), terminal_size=SIZE, run_before=select_and_draw)


def test_dashboard_without_nvidia_driver(snap_compare):
    assert snap_compare(frozen_app(frozen_state(gpus=False)), terminal_size=SIZE, run_before=select_and_draw)


def test_training(snap_compare):
    async def run_before(pilot):
        await select_and_draw(pilot, "2")

    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=run_before)


def test_training_log_axes_and_ema(snap_compare):
    async def run_before(pilot):
        await select_and_draw(pilot, "2", "x", "y", "e")

    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=run_before)


def test_logs(snap_compare):
    async def run_before(pilot):
        await select_and_draw(pilot, "3")

    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=run_before)


def test_stop_modal(snap_compare):
    async def run_before(pilot):
        await select_and_draw(pilot)
        pilot.app.push_screen(StopModal("train-kimi", STOP_PLAN, 30.0))
        await pilot.pause()

    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=run_before)


def test_adopt_modal_with_a_mistyped_pid(snap_compare):
    async def run_before(pilot):
        await select_and_draw(pilot)
        foreign = [GpuHolder(pid=448, owned=False, user="bob", cmdline="python3 serve.py --port 8000", used_memory_mib=40960.0)]
        pilot.app.push_screen(AdoptModal(foreign, 448))
        await pilot.pause()
        for widget in pilot.app.screen.query(Input):
            widget.cursor_blink = False
        await pilot.press("4", "4", "9", "enter")
        await pilot.pause()

    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=run_before)


def compile_workers_state(count: int = 17) -> ConsoleState:
    """An H200 host where one tiny training job holds /dev/nvidia* from its leader and `count` torch compile workers."""
    state = frozen_state()
    holders = [
        {
            "pid": 1234,
            "owned": True,
            "job": "train-kimi",
            "user": "root",
            "cmdline": "python -m backend train",
            "gpu_indices": [0],
            "used_memory_mib": 61440.0,
            "sources": ["nvml", "fuser"],
        }
    ]
    for i in range(count):
        holders.append(
            {
                "pid": 1300 + i,
                "owned": True,
                "job": "train-kimi",
                "user": "root",
                "gpu_indices": [0],
                "sources": ["fuser"],
                "cmdline": "python -c from torch._inductor.compile_worker import ...",
                "used_memory_mib": 512.0 if i == 0 else None,
            }
        )
    holders.append({"pid": 448, "owned": False, "user": "bob", "cmdline": "python3 serve.py --port 8000", "gpu_indices": [0, 1], "used_memory_mib": 40960.0})
    state.apply_holders(holders)
    return state


def test_dashboard_groups_a_jobs_compile_workers_under_its_row(snap_compare):
    assert snap_compare(frozen_app(compile_workers_state()), terminal_size=SIZE, run_before=select_and_draw)


def test_dashboard_workers_expanded(snap_compare):
    async def run_before(pilot):
        await select_and_draw(pilot, "h")

    assert snap_compare(frozen_app(compile_workers_state(3)), terminal_size=SIZE, run_before=run_before)


def test_dashboard_readonly(snap_compare):
    app = build_app(state=frozen_state(), poll_interval=None, refresh_throttle=0, readonly=True)
    assert snap_compare(app, terminal_size=SIZE, run_before=select_and_draw)


def test_resume_modal(snap_compare):
    async def run_before(pilot):
        await select_and_draw(pilot)
        checkpoint = "/root/.eagle3/jobs/train-kimi/checkpoints/epoch_2_step_4012"
        pilot.app.push_screen(
            ResumeModal("train-kimi", checkpoint, "resume-epoch-2-step-4012", ["eagle3-host", "train", "--profile", "kimi-k2.5", "--resume", checkpoint])
        )
        await pilot.pause()

    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=run_before)
