"""Stop & bench (key b): stop training with a checkpoint, serve it, canary, benchmark; and follow that chain job.

Following it: its stages, the saved results it adds to, the checkpoint it picked (offered for resume)."""

from __future__ import annotations

from functools import partial
from typing import Any

from rich.text import Text

from backend.commands import (
    CHAIN_STAGES,
    CHAIN_CONCURRENCY_DEFAULT,
    CHAIN_GRACE_DEFAULT_S,
    CHAIN_PROMPTS_DEFAULT,
    chain_argv,
    chain_job_name,
    chain_training_job,
    option_value,
)
from backend.protocol import Request
from console.client import AgentError
from console.flows.base import FlowHost, started_note
from console.flows.resume import ResumeFlow
from console.flows.stop import StopFlow
from console.screens.modals import StopAndBenchModal, bench_plan_text, training_phases
from console.session import HostSession
from console.state import Section


class ChainFlow:
    """The plan shown is the plan carried out: every request goes to the host the job was selected on when b was pressed."""

    def __init__(self, app: FlowHost, stop: StopFlow, resume: ResumeFlow, chain_args: list[str] | tuple[str, ...] = ()):
        self.app = app
        self.stop = stop
        self.resume = resume
        self.chain_args = list(chain_args)  # extra `stop-and-bench` options (tests: --stop-server-after, --port ...)
        self.chain_job: str | None = None  # the chain the `b` key started last

    def current_job(self) -> str | None:
        """The selected job when it is a chain, else the chain `b` started last, else the newest chain job."""
        state, selected = self.app.state, self.app.selected_job
        info = state.jobs.get(selected) if selected else None
        if info is not None and info.kind == "chain":
            return info.name
        if self.chain_job:
            return self.chain_job
        chains = [j.name for j in state.jobs.values() if j.kind == "chain"]
        return chains[-1] if chains else None

    def _train_job_of(self, chain: str) -> str:
        info = self.app.state.jobs.get(chain)
        return chain_training_job(info.argv if info else [], chain)

    def attach(self, chain: str | None) -> None:
        """(Re)attach to a chain job: its full stage history, then the saved results of its training run."""
        self.app.run_worker(partial(self._attach, chain), name="attach_chain", group="chain", exclusive=True, exit_on_error=False)

    async def _attach(self, chain: str | None) -> None:
        if not chain or not self.app.active.connected:
            return
        try:
            await self.app.active.load_stages(chain)
        except AgentError as exc:
            if exc.code not in ("disconnected", "timeout"):
                self.app.note(f"stages of {chain}: {exc}", severity="warning")
            return
        await self._load_results(self._train_job_of(chain))

    def progressed(self, chain: str) -> None:
        """A chain stage changed; when the chain has ended, fetch the run's saved results for comparison."""
        records = self.app.state.stages.get(chain, [])
        self._offer_resume(chain, records)
        ended = any(r.get("status") == "failed" or (r.get("stage") == CHAIN_STAGES[-1] and r.get("status") == "ok") for r in records)
        if ended and self.app.active.connected:
            train_job = self._train_job_of(chain)
            self.app.run_worker(partial(self._load_results, train_job), name="load_results", group="results", exclusive=True, exit_on_error=False)

    def _offer_resume(self, chain: str, records: list[dict[str, Any]]) -> None:
        """The chain's stop wrote the checkpoint its checkpoint stage picked: the resume key (c) resumes from it."""
        picked = next((r for r in records if r.get("stage") == "checkpoint" and r.get("status") == "ok"), None)
        path = (picked.get("result") or {}).get("path") if picked and isinstance(picked.get("result"), dict) else None
        train_job = self._train_job_of(chain)
        if not isinstance(path, str) or not path or (self.app.resume_target or {}).get("checkpoint") == path:
            return
        self.resume.remember(train_job, path, self.app.active)
        self.app.note(f"stop & bench {chain}: {train_job}'s checkpoint {path}: press c to resume from it")

    async def _load_results(self, train_job: str) -> None:
        app = self.app
        try:
            result = await app.active.request(Request.RESULTS, name=train_job)
        except AgentError as exc:
            if exc.code not in ("disconnected", "timeout", "not_found"):
                app.note(f"results of {train_job}: {exc}", severity="warning")
            return
        app.state.results[train_job] = [r for r in result.get("results") or [] if isinstance(r, dict)]
        app.state_changed({Section.RESULTS})

    async def run(self) -> None:
        """Every request goes to the host the job was selected on when b was pressed (node 0's for a multi-node job), even
        if the selection moves while the plan is on screen: the plan shown is the plan carried out."""
        app = self.app
        job = app.selected_job
        if job is None:
            return
        info = app.state.jobs.get(job)
        running = bool(info and info.state == "running")
        nodes = app.nodes_of(job) if running else []
        host, job = (nodes[0].session, nodes[0].job.name) if len(nodes) > 1 else (app.active, job)
        try:
            if len(nodes) > 1:
                planned = await self.stop.node_stop_plan(job, nodes)
                if planned is None:
                    return
                reachable, plan = planned
            else:
                plan = await host.request(Request.STOP_PLAN, name=job)
            checkpoints = (await host.request(Request.LIST_CHECKPOINTS, name=job)).get("checkpoints") or []
        except AgentError as exc:
            app.note(f"stop & bench {job}: could not get the plan ({exc}); nothing was stopped", severity="error")
            return
        argv = chain_argv(job, self.chain_args)
        text = self.plan_text(job, host, plan, checkpoints, running, argv)
        if len(nodes) > 1:
            text = (
                Text(
                    f"{job} runs on {len(nodes)} nodes: every reachable node is stopped at once first; the chain starts on "
                    f"{host.name} (node 0, which holds the checkpoints) only after every node's stop reported its "
                    "processes gone and its GPUs released.\n\n",
                    style="bold yellow",
                )
                + text
            )
        if not await app.push_screen_wait(StopAndBenchModal(job, text, can_start=running or bool(checkpoints))):
            app.note(f"stop & bench {job} cancelled; nothing was stopped")
            return
        reason = app.refusal("stop_and_bench", host)
        if reason:
            app.note(f"stop & bench {job} not started: {reason}", severity="error")
            return
        if len(nodes) > 1:
            verdict, trouble = await self.stop.stop_nodes_now(job, nodes, reachable)
            if trouble:
                app.note(f"stop & bench {job}: the chain was not started, not every node stopped cleanly: {verdict or 'not sent'}", severity="error")
                return
            app.note(f"stop {job}: {verdict}")
        await self.start(host, job, argv)

    def plan_text(self, job: str, host: HostSession, plan: dict[str, Any], checkpoints: list, running: bool, argv: list[str]) -> Text:
        """What stop & bench will do: the stop plan, the checkpoint it benchmarks, the engine and where that came from."""
        profile = option_value(self.chain_args, "--profile") or self.app.profile_of(job, host)
        facts = self.app.profile_facts(profile)
        engine = option_value(self.chain_args, "--engine")
        source = "--engine" if engine else f"serve.engine of profile {facts.name}"
        if not engine:
            engine = facts.engine or "the profile's serve.engine"
            if facts.error:
                source = f"profile {profile} cannot be read here: {facts.error}"
        return bench_plan_text(
            job,
            plan,
            checkpoints,
            running,
            engine,
            source,
            float(option_value(self.chain_args, "--grace") or CHAIN_GRACE_DEFAULT_S),
            option_value(self.chain_args, "--concurrency") or CHAIN_CONCURRENCY_DEFAULT,
            int(option_value(self.chain_args, "--num-prompts") or CHAIN_PROMPTS_DEFAULT),
            argv,
            training_phases(host.state, [job]),  # what the stop modal knows about the checkpoint, the plan says too
        )

    async def start(self, host: HostSession, job: str, argv: list[str]) -> None:
        """Start the stop-and-bench chain of `job` on `host`, then show it (that host becomes the active one)."""
        app = self.app
        name = chain_job_name(job)
        host.forget_stages(name)  # stages of an earlier chain of that name belong to its archived run
        try:
            result = await host.request(Request.START_JOB, name=name, kind="chain", argv=argv)
        except AgentError as exc:
            app.note(f"stop & bench {job} not started: {exc}", severity="error")
            return
        app.set_active(host)
        self.chain_job = name
        app.note(started_note(name, result, argv))
        app.switch_mode("chain")
        app.state_changed({Section.CHAIN})
