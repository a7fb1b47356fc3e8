"""The Stop & bench key: its plan modal, the chain screen (stages, result panel, earlier results), and the tiny run end to end."""

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from backend.protocol import Request
from console.app import build_app
from backend.commands import chain_argv
from console.screens.chain import ChainScreen, chain_outcome, result_panel_text, stage_elapsed
from console.screens.modals import StopAndBenchModal, bench_plan_text
from console.transport import LocalTransport
from tests.fixtures.ssh import connected, free_port, job_argv, pid_alive, screen_shown, stop_everything, wait_until
from tests.fixtures.console_states import NOW, STOP_PLAN, frozen_state
from tests.fixtures.env import threads_for_tests
from tests.fixtures.console_states import (
    ACCEPTANCE,
    AMBER_HEADLINE,
    AMBER_REASONS,
    CHAIN,
    CHECKPOINT,
    EARLIER,
    RESULT,
    SAVED,
    amber_records,
    chain_records,
    chain_state,
)

SIZE = (160, 48)
BREAK_LINE = "served acceptance breaks at position 2: 0.31 served vs 0.68 predicted"
CANARY_RED = (
    "canary RED: accept length 1.00 is at the zero-acceptance ceiling (1.03): the draft accepted nothing. "
    "Likely causes, in order: --speculative-algorithm EAGLE (or NEXTN) instead of EAGLE3: the target never captures the "
    "aux layers, hands the draft 1 x H and fc is skipped (sglang PR #21272); layers.0.* (or other unknown) weight names "
    "silently dropped by SGLang < 0.5.14: a random decoder layer; d2t missing or wrong while the draft vocab is smaller: "
    "draft ids are read as target ids. The server job 'serve-train-kimi' this chain started was stopped (exited_on_term)."
)


def span_style(text, fragment: str) -> str:
    """The style of the span that holds `fragment` in a rich Text."""
    start = text.plain.index(fragment)
    return next(str(span.style) for span in text.spans if span.start <= start < span.end)


def frozen_app(state):
    return build_app(state=state, poll_interval=None, refresh_throttle=0)


pytestmark = pytest.mark.usefixtures("utc")  # snapshot clocks read in UTC (tests/conftest.py)


async def show_chain(pilot) -> None:
    pilot.app.select_job("train-kimi")
    await pilot.pause()
    await pilot.press("5")
    await pilot.pause()
    pilot.app.redraw_now()
    await pilot.pause()


def text_of(app, selector: str) -> str:
    return str(app.screen.query_one(selector).render())


# -- frozen data, no host ------------------------------------------------------------------------


def test_outcome_and_elapsed_of_stage_records():
    assert chain_outcome([])["state"] == "waiting"
    assert chain_outcome(chain_records(until="launch"))["state"] == "running"
    done = chain_outcome(chain_records())
    assert done["state"] == "ok" and done["result"]["verdict"] == "green" and done["saved_to"] == SAVED
    failed = chain_outcome(chain_records(fail=("canary", CANARY_RED)))
    assert failed["state"] == "failed" and failed["failed_stage"] == "canary" and failed["reason"] == CANARY_RED
    assert stage_elapsed({"status": "running", "time": 100.0, "_received": 103.0}, now=110.0) == 7.0  # from when it was seen
    assert stage_elapsed({"status": "ok", "elapsed": 2.5, "time": 1.0}, now=1e9) == 2.5
    assert stage_elapsed(None, now=1.0) is None


async def test_result_panel_shows_verdict_accept_length_next_to_tau_hat_throughput_and_flags():
    app = frozen_app(chain_state(chain_records()))
    async with app.run_test(size=SIZE) as pilot:
        await show_chain(pilot)
        assert isinstance(app.screen, ChainScreen)
        panel = text_of(app, "#chain-result")
        assert "VERDICT GREEN" in panel and "accept length 2.71" in panel and "vs τ̂ 3.12" in panel and "ratio 0.87" in panel
        assert "speed-up 1.84x over plain decoding in the same engine (82.2 -> 151.3 tok/s at c=1)" in panel
        assert "     4    402.8    231.5     1.74x" in panel
        assert f"checkpoint: {CHECKPOINT}" in panel and "--speculative-algorithm EAGLE3" in panel and "engine: reference" in panel
        assert "finished" in text_of(app, "#chain-title")
        stages = app.screen.query_one("#stages")
        assert [str(stages.get_row_at(i)[2]) for i in range(stages.row_count)] == ["ok"] * 8
        results = app.screen.query_one("#results-table")
        assert results.row_count == 2 and "(this run)" in str(results.get_row_at(0)[0]) and str(results.get_row_at(1)[1]) == "red"


def test_result_panel_shows_served_acceptance_per_position_next_to_validation_and_the_first_break():
    assert ACCEPTANCE["break_line"].startswith(BREAK_LINE)
    panel = result_panel_text(chain_records())
    plain = panel.plain
    assert "2.71 pooled over verify steps (SGLang, vLLM)" in plain and "2.64 mean of per-request means (SpecForge)" in plain
    assert "served acceptance per draft position (canary, 412 verify steps) next to validation accuracy" in plain
    lines = [line for line in plain.splitlines() if line.strip()[:1].isdigit() and "concurrent" not in line][:5]
    assert [line.split()[:3] for line in lines] == [
        ["0", "0.80", "0.79"],
        ["1", "0.72", "0.74"],
        ["2", "0.68", "0.31"],
        ["3", "0.66", "0.56"],
        ["4", "0.62", "0.50"],
    ]
    assert [("← break" in line) for line in lines] == [False, False, True, False, False]
    assert span_style(panel, lines[2].strip()) == "bold red" and span_style(panel, BREAK_LINE) == "bold red"
    assert "accept length pooled / per-request" in plain and "2.69 / 2.61" in plain


def test_without_histogram_the_panel_shows_the_pooled_number_and_the_note():
    panel = result_panel_text(amber_records())
    assert "1.41 pooled over verify steps" in panel.plain and "served acceptance per draft position" not in panel.plain
    assert span_style(panel, "note: the server reports no spec_correct_drafts_histogram") == "yellow"
    legacy = chain_records()  # a result saved before this field existed
    legacy[-1]["result"] = {k: v for k, v in RESULT.items() if k not in ("acceptance", "accept_length_mean_of_request_means")}
    assert "2.71 pooled over verify steps" in result_panel_text(legacy).plain


async def test_a_failure_shows_the_stage_and_why_with_the_likely_causes():
    app = frozen_app(chain_state(chain_records(fail=("canary", CANARY_RED))))
    async with app.run_test(size=SIZE) as pilot:
        await show_chain(pilot)
        panel = text_of(app, "#chain-result")
        assert "VERDICT RED" in panel and "FAILED at stage 'canary'" in panel and "zero-acceptance ceiling" in panel
        assert "1. --speculative-algorithm EAGLE" in panel and "3. d2t missing" in panel
        assert "The server job 'serve-train-kimi' this chain started was stopped" in panel
        stages = app.screen.query_one("#stages")
        statuses = {str(stages.get_row_at(i)[0]): str(stages.get_row_at(i)[2]) for i in range(stages.row_count)}
        assert statuses["canary"] == "failed" and statuses["bench"] == statuses["result"] == "skipped" and statuses["launch"] == "ok"
        assert "failed at canary" in text_of(app, "#chain-title")


async def test_the_running_stage_ticks():
    now = [NOW]
    records = chain_records(until="bench")
    app = frozen_app(chain_state(records, clock=lambda: now[0]))
    async with app.run_test(size=SIZE) as pilot:
        await show_chain(pilot)
        stages = app.screen.query_one("#stages")
        row = next(i for i in range(stages.row_count) if str(stages.get_row_at(i)[0]) == "bench")
        first = str(stages.get_row_at(row)[3])
        assert str(stages.get_row_at(row)[2]) == "running" and first == "0.0s"
        now[0] += 7
        await wait_until(lambda: str(stages.get_row_at(row)[3]) == "7.0s", timeout=5, what="the running stage's elapsed to tick")
        assert "no result yet" in text_of(app, "#chain-result")


async def test_resume_right_after_stop_and_bench_offers_the_checkpoint_its_stop_wrote():
    """b's stop wrote the checkpoint its checkpoint stage picked: c resumes from it, not "no stop has written one"."""
    records = chain_records(until="preflight")
    picked = next(r for r in records if r["stage"] == "checkpoint" and r["status"] == "ok")
    picked["result"] = {"path": CHECKPOINT, "val_acc": 0.7, "val_acc_step": 4000}
    app = frozen_app(chain_state([]))
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        assert app.resume_target is None
        app.handle_event({"type": "stages", "job": CHAIN, "records": records})
        await pilot.pause()
        assert app.resume_target is not None and app.resume_target["job"] == "train-kimi" and app.resume_target["checkpoint"] == CHECKPOINT
        assert any(f"{CHECKPOINT}: press c to resume from it" in line for _, line in app.state.actions)


async def test_an_amber_canary_shows_in_yellow_with_its_reasons_and_the_bench_still_ran():
    records = amber_records()
    panel = result_panel_text(records)
    assert "VERDICT AMBER" in panel.plain and span_style(panel, " VERDICT AMBER ") == "bold black on yellow"
    shown = lambda host_text: host_text.replace("tau-hat", "τ̂")  # the host's ASCII name, as every screen names it
    assert "tau-hat" not in panel.plain
    assert span_style(panel, f"canary: {shown(AMBER_HEADLINE)}") == "yellow"
    assert span_style(panel, shown(AMBER_REASONS[0])) == span_style(panel, shown(AMBER_REASONS[1])) == "yellow"
    assert "402.8    231.5     1.74x" in panel.plain
    state = chain_state(records)
    state.results["train-kimi"] = [EARLIER, {"path": SAVED, **records[-1]["result"]}]
    app = frozen_app(state)
    async with app.run_test(size=SIZE) as pilot:
        await show_chain(pilot)
        assert "VERDICT AMBER" in text_of(app, "#chain-result") and "train longer" in text_of(app, "#chain-result")
        stages = app.screen.query_one("#stages")
        canary = next(stages.get_row_at(i) for i in range(stages.row_count) if str(stages.get_row_at(i)[0]) == "canary")
        assert str(canary[4]).startswith("amber: inconclusive") and canary[4].style == "yellow"
        verdict = app.screen.query_one("#results-table").get_row_at(0)[1]
        assert str(verdict) == "amber" and verdict.style == "yellow"


def test_the_result_panel_says_which_prompts_the_canary_asked():
    records = amber_records()
    canary = next(r for r in records if r["stage"] == "canary" and r["status"] == "ok")
    canary["result"] = dict(canary["result"], prompt_source="the draft's validation conversations (8 of /data/regen)")
    panel = result_panel_text(records)
    assert span_style(panel, "  prompts: the draft's validation conversations (8 of /data/regen)") == "dim"
    assert "prompts:" not in result_panel_text(amber_records()).plain  # a canary that does not say, as before


def test_the_result_panel_says_which_prompts_the_benchmark_asked():
    records = amber_records()
    result = records[-1]["result"]
    result["bench_prompts"] = "the draft's held-out eval prompts (8 of /data/regen)"
    panel = result_panel_text(records)
    assert span_style(panel, "  prompts: the draft's held-out eval prompts (8 of /data/regen)") == "dim"
    assert panel.plain.index("throughput per concurrency") < panel.plain.index("held-out eval prompts") < panel.plain.index("checkpoint:")


def test_the_result_panel_warns_when_the_benchmarked_answers_loop():
    records = amber_records()
    result = records[-1]["result"]
    warning = "loops: 45% of the answers' words repeat an earlier 8-word run of their own answer; accept length counts them"
    result["bench_loops"] = [warning]
    panel = result_panel_text(records)
    assert span_style(panel, f"  {warning}") == "yellow"
    assert "loops:" not in result_panel_text(amber_records()).plain


def test_chain_amber_snapshot(snap_compare):
    state = chain_state(amber_records())
    state.results["train-kimi"] = [EARLIER, {"path": SAVED, **amber_records()[-1]["result"]}]
    assert snap_compare(frozen_app(state), terminal_size=SIZE, run_before=show_chain)


def test_chain_result_snapshot(snap_compare):
    assert snap_compare(frozen_app(chain_state(chain_records())), terminal_size=SIZE, run_before=show_chain)


def test_chain_failure_snapshot(snap_compare):
    assert snap_compare(frozen_app(chain_state(chain_records(fail=("canary", CANARY_RED)))), terminal_size=SIZE, run_before=show_chain)


def test_stop_and_bench_modal_snapshot(snap_compare):
    checkpoints = [{"path": "/root/.eagle3/jobs/train-kimi/checkpoints/epoch_1_step_3000", "epoch": 1, "step": 3000, "latest": True}]
    text = bench_plan_text("train-kimi", STOP_PLAN, checkpoints, True, "sglang", "serve.engine of profile kimi-k2.5", 120.0, "1,4", 8, chain_argv("train-kimi"))

    async def run_before(pilot):
        pilot.app.select_job("train-kimi")
        await pilot.pause()
        pilot.app.push_screen(StopAndBenchModal("train-kimi", text, can_start=True))
        await pilot.pause()

    assert snap_compare(frozen_app(frozen_state()), terminal_size=SIZE, run_before=run_before)


async def test_stop_and_bench_is_disabled_without_a_host_or_on_a_job_that_is_not_training():
    app = frozen_app(chain_state(chain_records()))
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        assert app.check_action("stop_and_bench", ()) is None
        await pilot.press("b")
        await pilot.pause()
        assert not isinstance(app.screen, StopAndBenchModal)
        assert app.state.actions[-1][1] == "Stop & bench is disabled: no host connection"


# -- the real agent ------------------------------------------------------------------------------


def live_app(tmp_path, **kwargs):
    transport = LocalTransport(tmp_path / "run", backoff_initial=kwargs.pop("backoff", 0.2), backoff_max=kwargs.pop("backoff_max", 1.0))
    return build_app(transport, poll_interval=None, refresh_throttle=0, stop_grace=5, **kwargs)


def fake_training(python: str) -> list[str]:
    return [*job_argv(python), "--profile", "tiny"]


def add_checkpoints(job_dir: str, *names: str) -> Path:
    root = Path(job_dir) / "checkpoints"
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text("{}")  # complete as far as the layout checks
        (root / name / "model.safetensors").write_bytes(b"")
    (root / "latest").write_text(names[-1] + "\n")
    return root


async def test_stop_and_bench_modal_lists_the_plan_and_cancel_touches_nothing(tmp_path):
    app = live_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        job = (await app.client.request(Request.START_JOB, name="train-x", kind="train", argv=fake_training(sys.executable)))["job"]
        add_checkpoints(job["job_dir"], "epoch_0_step_100", "epoch_0_step_200")
        # running, not only listed: a poll between the record's insert and its leader shows it "starting" (nothing to stop)
        await wait_until(lambda: "train-x" in app.state.jobs and app.state.jobs["train-x"].state == "running", what="the job running")
        app.select_job("train-x")
        await pilot.pause()
        await pilot.press("b")
        modal = await screen_shown(app, StopAndBenchModal, "the plan modal")
        plan = str(modal.query_one("#bench-plan").render())
        assert f"{job['pid']}" in plan and "graceful and checkpoint-aware" in plan
        latest = Path(job["job_dir"]) / "checkpoints" / "epoch_0_step_200"
        if "Checkpoint first: YES" in plan:  # it logged a step: the stop writes the checkpoint, as the s modal says
            assert f"the one the trainer writes at the stop (the new `latest`); latest now: {latest}" in plan
        elif "Checkpoint first: NO" in plan:  # its metrics are loaded and hold no step: still in setup
            assert f"the trainer is still setting up, so the stop writes none: the latest, {latest}" in plan
        else:  # its metrics are not loaded yet
            assert "Checkpoint first: only if training steps have begun" in plan and f"latest now: {latest}" in plan
        assert "Foreign GPU holders, left alone" in plan and "foreign holders are left untouched" in plan
        assert "engine reference" in plan and "serve.engine of profile tiny" in plan
        assert "Canary" in plan and "Benchmark: concurrency 1,4, 8 prompts" in plan
        assert "eagle3-host stop-and-bench --job train-x --json" in plan
        await pilot.press("escape")
        await wait_until(lambda: "cancelled" in app.state.actions[-1][1], what="cancel noted")
        assert app.state.actions[-1][1] == "stop & bench train-x cancelled; nothing was stopped"
        assert pid_alive(job["pid"])
        assert [j["name"] for j in (await app.client.request(Request.LIST_JOBS))["jobs"]] == ["train-x"]
        await stop_everything(app, grace=5, timeout=120)


async def test_stop_and_bench_grok_and_watch_are_disabled_while_disconnected(tmp_path):
    app = live_app(tmp_path, backoff=1.5, backoff_max=1.5)
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        job = (await app.client.request(Request.START_JOB, name="train-y", kind="train", argv=fake_training(sys.executable)))["job"]
        await wait_until(lambda: "train-y" in app.state.jobs, what="the job listed")
        app.select_job("train-y")
        assert app.check_action("stop_and_bench", ()) is True and app.check_action("grok", ()) is True
        agent_pid = app.state.hello.agent_pid
        os.kill(agent_pid, signal.SIGKILL)  # the console's own agent child: the link drops
        await wait_until(lambda: app.state.stale, what="the drop")
        for action in ("stop_and_bench", "grok", "watch_external"):
            assert app.check_action(action, ()) is None
        for key, label in (("b", "Stop & bench"), ("g", "Grok run"), ("w", "Watch run")):
            await pilot.press(key)
            await pilot.pause()
            assert not isinstance(app.screen, StopAndBenchModal)
            assert app.state.actions[-1][1] == f"{label} is disabled: disconnected from the host"
        await wait_until(lambda: app.state.connection.connected and app.state.hello.agent_pid != agent_pid, what="the reconnect")
        assert pid_alive(job["pid"])
        await stop_everything(app, grace=5, timeout=120)
        assert not pid_alive(job["pid"])


STAGE_WRITER = (
    "import json, os, time\n"
    "path = os.path.join(os.environ['EAGLE3_JOB_DIR'], 'stages.jsonl')\n"
    "for stage in {stages!r}:\n"
    "    for status in ('running', 'ok'):\n"
    "        with open(path, 'a') as f:\n"
    "            f.write(json.dumps({{'stage': stage, 'status': status, 'time': time.time(), 'elapsed': 0.4, 'detail': stage}}) + '\\n')\n"
    "        time.sleep(0.4)\n"
    "time.sleep(600)\n"
)


async def test_chain_stages_survive_a_reconnect_without_gaps_or_duplicates(tmp_path):
    """Records written while the link is down reach the screen through stages_history on re-attach, each once."""
    from backend.commands import CHAIN_STAGES

    app = live_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        argv = [sys.executable, "-c", STAGE_WRITER.format(stages=CHAIN_STAGES), "--job", "train-z"]
        job = (await app.client.request(Request.START_JOB, name="chain-train-z", kind="chain", argv=argv))["job"]
        await wait_until(lambda: "chain-train-z" in app.state.jobs, what="the chain job listed")
        await pilot.press("5")
        await wait_until(lambda: len(app.state.stages.get("chain-train-z", [])) >= 3, what="the first stages")
        agent_pid = app.state.hello.agent_pid
        os.kill(agent_pid, signal.SIGKILL)
        await wait_until(lambda: app.state.connection.connected and app.state.hello.agent_pid != agent_pid, what="the reconnect")
        await wait_until(lambda: chain_outcome(app.state.stages["chain-train-z"])["state"] == "ok", timeout=30, what="the last stage")
        seen = [(r["stage"], r["status"]) for r in app.state.stages["chain-train-z"]]
        assert seen == [(stage, status) for stage in CHAIN_STAGES for status in ("running", "ok")]
        assert "finished" in text_of(app, "#chain-title")
        await stop_everything(app, grace=5, timeout=120)
        assert not pid_alive(job["pid"])


async def test_chain_stages_written_while_the_link_was_down_arrive_with_the_chain_screen_not_shown(tmp_path):
    """The chain screen is not shown, so its re-attach does not run on reconnect: the resync re-reads every chain the
    console holds, and a stages event that starts past what it holds fetches the lines in between (they used to be
    lost: the chain read stop..launch, then bench ok)."""
    from backend.commands import CHAIN_STAGES

    app = live_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        argv = [sys.executable, "-c", STAGE_WRITER.format(stages=CHAIN_STAGES), "--job", "train-w"]
        job = (await app.client.request(Request.START_JOB, name="chain-train-w", kind="chain", argv=argv))["job"]
        await wait_until(lambda: len(app.state.stages.get("chain-train-w", [])) >= 3, what="the first stages")
        await pilot.press("1")
        agent_pid = app.state.hello.agent_pid
        os.kill(agent_pid, signal.SIGKILL)
        await asyncio.sleep(1.0)  # lines are written while no agent follows the file
        await wait_until(lambda: app.state.connection.connected and app.state.hello.agent_pid != agent_pid, what="the reconnect")
        expected = [(stage, status) for stage in CHAIN_STAGES for status in ("running", "ok")]
        await wait_until(
            lambda: len(app.state.stages["chain-train-w"]) == len(expected),
            timeout=30,
            what="every stage line",
            context=lambda: app.state.stages["chain-train-w"],
        )
        assert [(r["stage"], r["status"]) for r in app.state.stages["chain-train-w"]] == expected
        assert not isinstance(app.screen, ChainScreen)
        await stop_everything(app, grace=5, timeout=120)
        assert not pid_alive(job["pid"])


@pytest.mark.slow
async def test_stop_and_bench_key_end_to_end_on_tiny(trained_tiny_run, tmp_path, monkeypatch):
    """b on a live tiny training job: stopped with a checkpoint, reference engine served, canary green, benchmark shown, nothing left."""
    monkeypatch.setenv("OMP_NUM_THREADS", threads_for_tests())  # the agent, and the chain and server it starts, inherit it
    chain_args = ["--stop-server-after", "--port", str(free_port()), "--concurrency", "1", "--num-prompts", "3"]
    app = live_app(tmp_path, chain_args=chain_args, request_timeout=60)
    checkpoints = trained_tiny_run / "checkpoints"
    resume = checkpoints / (checkpoints / "latest").read_text().strip()
    argv = [
        "eagle3-host",
        "train",
        "--profile",
        "tiny",
        "--resume",
        str(resume),
        "--max-steps",
        "100000",
        "--save-interval",
        "100000",
        "--eval-interval",
        "100000",
    ]
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        try:
            train = (await app.client.request(Request.START_JOB, name="train-demo", kind="train", argv=argv, env={"OMP_NUM_THREADS": threads_for_tests()}))[
                "job"
            ]
            await wait_until(lambda: "train-demo" in app.state.jobs, what="the training job listed")
            app.select_job("train-demo")
            await wait_until(
                lambda: (m := app.state.metrics.get("train-demo")) and m.latest_train.get("step", 0) > 300,
                timeout=300,
                what="the resumed training to pass step 300",
            )

            await pilot.press("b")
            modal = await screen_shown(app, StopAndBenchModal, "the plan modal")
            plan = str(modal.query_one("#bench-plan").render())
            assert str(train["pid"]) in plan and "engine reference" in plan
            await pilot.press("y")
            await screen_shown(app, ChainScreen, "the chain screen")
            await wait_until(
                lambda: chain_outcome(app.state.stages.get("chain-train-demo", []))["state"] in ("ok", "failed"),
                timeout=600,
                step=0.5,
                what="the chain to finish",
            )
            outcome = chain_outcome(app.state.stages["chain-train-demo"])
            assert outcome["state"] == "ok", outcome
            await wait_until(lambda: "VERDICT GREEN" in text_of(app, "#chain-result"), what="the result panel")
            panel = text_of(app, "#chain-result")
            assert "accept length" in panel and outcome["result"]["accept_length"] > 1.5
            assert f"{outcome['result']['accept_length']:.3g}" in panel
            assert outcome["result"]["speedup_baseline"] == "same-engine" and "over plain decoding in the same engine" in panel
            new_checkpoint = Path(outcome["result"]["checkpoint"])
            assert new_checkpoint.parent == Path(train["job_dir"]) / "checkpoints" and int(new_checkpoint.name.split("_step_")[1]) > 300
            await wait_until(lambda: app.screen.query_one("#results-table").row_count == 1, what="the saved result listed")

            await wait_until(
                lambda: app.state.jobs.get("chain-train-demo") and app.state.jobs["chain-train-demo"].state != "running",
                timeout=60,
                what="the chain job to end",
            )
            jobs = {j["name"]: j for j in (await app.client.request(Request.LIST_JOBS))["jobs"]}
            assert set(jobs) == {"train-demo", "serve-train-demo", "chain-train-demo"}
            assert jobs["chain-train-demo"]["exit_code"] == 0
            for job in jobs.values():
                assert job["state"] != "running" and not pid_alive(job["pid"]), f"{job['name']} (pid {job['pid']}) was left behind"
        finally:
            await stop_everything(app, grace=5, timeout=120)


def test_the_bench_plan_passes_the_training_phase_on_to_its_checkpoint_line():
    checkpoints = [{"path": "/root/.eagle3/jobs/train-kimi/checkpoints/epoch_1_step_3000", "epoch": 1, "step": 3000, "latest": True}]
    args = ("train-kimi", STOP_PLAN, checkpoints, True, "sglang", "profile", 120.0, "1,4", 8, chain_argv("train-kimi"))
    assert "Checkpoint first: NO" in str(bench_plan_text(*args, phases={"train-kimi": False}))
    assert "Checkpoint first: YES" in str(bench_plan_text(*args, phases={"train-kimi": True}))
    assert "green / amber (τ̂ too low to tell) / red" in str(bench_plan_text(*args))


def test_a_green_verdict_with_a_break_in_served_acceptance_says_so_next_to_the_verdict():
    plain = result_panel_text(chain_records()).plain
    head = plain.split("served acceptance per draft position")[0]
    assert "VERDICT GREEN" in head and "but served acceptance breaks at position 2: green judges the pooled accept length" in head
    clean = chain_records()
    clean[-1]["result"] = {**RESULT, "acceptance": {**ACCEPTANCE, "break": None}}
    assert "but served acceptance breaks" not in result_panel_text(clean).plain


def test_a_like_shortfall_at_every_position_is_shown_as_below_in_yellow_not_as_a_break():
    """Round 15's ShareGPT histogram against its checkpoint's replay: every position short by a like fraction."""
    from backend.serve.acceptance import acceptance_report

    histogram = [239, 149, 63, 139]
    shortfall = acceptance_report([(1280, 590, histogram)], 3, [0.757, 0.720, 0.683], val_rounds={"3": [1428, 975, 593, 1717]})
    records = chain_records()
    records[-1]["result"] = {**RESULT, "acceptance": shortfall}
    panel = result_panel_text(records)
    head, table = panel.plain.split("served acceptance per draft position")
    assert "VERDICT GREEN" in head and "below validation's at every position by a like fraction: the prompts differ" in head
    assert "but served acceptance breaks" not in panel.plain and "← break" not in table and table.count("← below") == 2
    assert span_style(panel, "← below") == "yellow" and span_style(panel, "served acceptance is below validation's at every") == "yellow"


def test_more_concurrency_with_less_throughput_gets_a_remark():
    slow = chain_records()
    throughput = [{"concurrency": 1, "output_tok_per_s": 21.8}, {"concurrency": 4, "output_tok_per_s": 8.4}]
    slow[-1]["result"] = {**RESULT, "throughput": throughput}
    assert "4 concurrent requests gave less total throughput than 1 (8.4 vs 21.8 tok/s)" in result_panel_text(slow).plain
    assert "less total throughput" not in result_panel_text(chain_records()).plain  # 402.8 at 4 beats 151.3 at 1


async def test_the_b_plan_knows_what_the_s_modal_knows_about_the_checkpoint():
    """train-kimi has logged training steps: the plan no longer hedges "if training steps have begun"."""
    checkpoints = [{"path": CHECKPOINT, "epoch": 2, "step": 4012, "latest": True}]
    app = frozen_app(frozen_state())
    async with app.run_test(size=SIZE):
        text = app.chain_flow.plan_text("train-kimi", app.active, STOP_PLAN, checkpoints, True, chain_argv("train-kimi")).plain
    assert "Checkpoint first: YES" in text
    assert f"3. Checkpoint to preflight: the one the trainer writes at the stop (the new `latest`); latest now: {CHECKPOINT}" in text
    assert "if training steps have begun" not in text


# -- the wall-time speed-up beside accept length (issue 24) ------------------------------------------------------------


def with_result(**changes) -> list[dict]:
    records = chain_records()
    records[-1]["result"] = {**RESULT, **changes}
    return records


def test_the_speed_up_over_plain_decoding_stands_beside_accept_length():
    panel = result_panel_text(chain_records())
    lines = panel.plain.splitlines()
    assert "accept length 2.71" in lines[0]
    assert lines[1].strip() == "speed-up 1.84x over plain decoding in the same engine (82.2 -> 151.3 tok/s at c=1)"
    assert span_style(panel, lines[1].strip()) == "bold green"
    assert "greedy output equal to plain decoding on 8 of 8 prompts" in lines[2]
    assert "     1    151.3     82.2     1.84x      21 / 19  17.1 / 12.2  2.69 / 2.61" in panel.plain  # TTFT, ITL p50 both ways


def test_without_a_baseline_the_panel_says_so_and_how_to_measure_one():
    sglang_rows = [
        {k: row[k] for k in ("concurrency", "output_tok_per_s", "accept_length", "accept_length_mean_of_request_means")} for row in RESULT["throughput"]
    ]
    panel = result_panel_text(with_result(throughput=sglang_rows, speedup_baseline="none", speedup_c1=None))
    line = next(line.strip() for line in panel.plain.splitlines() if line.strip().startswith("speed-up"))
    assert line.startswith("speed-up: no baseline was measured, so no speed-up") and "--baseline-url" in line
    assert span_style(panel, line) == "yellow" and "x over plain decoding" not in panel.plain
    assert "throughput per concurrency (speculative decoding; no plain baseline measured)" in panel.plain
    assert "     1    151.3        -         -        - / -        - / -  2.69 / 2.61" in panel.plain
    legacy = {k: v for k, v in RESULT.items() if k not in ("speedup_baseline", "speedup_c1")} | {"throughput": sglang_rows}
    records = chain_records()
    records[-1]["result"] = legacy  # saved before the chain measured speed-ups
    assert "speed-up: not in this result (saved before the chain measured one)" in result_panel_text(records).plain


def test_different_greedy_outputs_or_lengths_are_said_under_the_speed_up():
    rows = [dict(row) for row in RESULT["throughput"]]
    rows[0] |= {"exact_lengths": False, "outputs_equal": {"compared": 8, "equal": 6, "first_different_prompt": 3}}
    panel = result_panel_text(with_result(throughput=rows))
    differs = "greedy output differs from plain decoding on 2 of 8 prompts (first: prompt 3): speculation should not change greedy text"
    assert differs in panel.plain and span_style(panel, differs) == "bold red"
    lengths = "the two sides did not all decode the same number of tokens: the ratio compares different work"
    assert span_style(panel, lengths) == "yellow"
    only_c4 = [{k: v for k, v in rows[0].items() if k not in ("speedup", "baseline_output_tok_per_s")}, rows[1]]
    panel = result_panel_text(with_result(throughput=only_c4, speedup_c1=None))
    assert "speed-up 1.74x over plain decoding in the same engine (231.5 -> 402.8 tok/s at c=4)" in panel.plain


async def test_earlier_results_list_their_speed_up():
    app = frozen_app(chain_state(chain_records()))
    async with app.run_test(size=SIZE) as pilot:
        await show_chain(pilot)
        results = app.screen.query_one("#results-table")
        labels = [str(column.label) for column in results.ordered_columns]
        column = labels.index("speed-up")
        assert [str(results.get_row_at(i)[column]) for i in range(results.row_count)] == ["1.84x", "-"]  # this run, then EARLIER
