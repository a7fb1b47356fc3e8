"""Actions on runs beyond start/stop, mixed into ConsoleApp: stop & bench, grokking signals, data scaling, grok runs, watches.

Everything goes through agent requests (signals, data_scaling, stages_history, results, start_job,
list_checkpoints, watch_external); the host computes, the console shows. Each guarded action asks for
confirmation in a modal and re-checks its guard before it sends anything.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Sequence

from rich.text import Text
from textual import work
from textual.app import App
from textual.notifications import SeverityLevel

from backend.safetext import visible
from backend.protocol import JobInfo, Request, from_dict
from console.alerts import ENDED_STATES, AlertMemory, new_alerts
from console.client import AgentError
from backend.commands import (
    CHAIN_CONCURRENCY_DEFAULT,
    CHAIN_GRACE_DEFAULT_S,
    CHAIN_PROMPTS_DEFAULT,
    GROK_WEIGHT_DECAY_DEFAULT,
    ProfileFacts,
    chain_argv,
    chain_job_name,
    chain_training_job,
    job_profile,
    option_value,
    profile_facts,
    resume_argv,
    resume_job_name,
)
from console.screens.chain import CHAIN_STAGES
from console.screens.grok_modal import GrokModal, free_job_name
from console.screens.modals import ResumeModal, StopAndBenchModal, WatchModal, bench_plan_text, training_phases
from console.state import EXTERNAL_PREFIX, ConsoleState
from console.widgets.hosts import Node, nodes_of

SIGNALS_INTERVAL_S = 5.0  # at most one `signals` request per job this often (the host computes them on request)
DATA_SCALING_EVERY_S = 60.0
EXIT_REASON_LINES = 20  # stderr lines read back from a job that exited non-zero; the last non-empty one is its reason
EXIT_REASON_CHARS = 200


RESUME_DROPPED_OPTIONS = ("--resume", "--out", "--profile")  # the resume sets these itself; the agent gives the job dir


def carried_train_options(argv: Sequence[str]) -> list[str]:
    """The options of a training command line after `train`, less --resume/--out/--profile: what makes a resumed run
    the same run (a grok run's constant schedule, LR, weight decay and max steps, its data, its intervals)."""
    words = list(argv)
    if "train" not in words:
        return []
    tail = words[words.index("train") + 1 :]
    kept: list[str] = []
    index = 0
    while index < len(tail):
        word = tail[index]
        option = word.split("=", 1)[0]
        if option in RESUME_DROPPED_OPTIONS:
            takes_value = "=" not in word and index + 1 < len(tail) and not tail[index + 1].startswith("--")
            index += 2 if takes_value else 1
            continue
        kept.append(word)
        index += 1
    return kept


def terminal_notification(text: str) -> str:
    """Bell, then the same line as an OSC 9 (iTerm2, WezTerm, kitty, Windows Terminal) and an OSC 777 (VTE, foot,
    urxvt) desktop notification. Control characters are dropped; ';' would end OSC 777's fields."""
    clean = "".join(ch if ch.isprintable() else " " for ch in text)[:240]
    return f"\a\x1b]9;eagle3: {clean}\x07\x1b]777;notify;eagle3-console;{clean.replace(';', ',')}\x07"


if TYPE_CHECKING:
    from console.client import AgentClient
    from console.session import HostSession


class RunActions(App):
    """The run actions of the console (stop & bench, grok, watch, resume, multi-node stop, alerts) over the active host's
    session. ConsoleApp(RunActions) adds the screens, the keys and the session plumbing, and supplies the members
    declared here."""

    sessions: list[HostSession]
    active: HostSession
    selected_job: str | None
    profile: str
    notify_terminal: bool
    stop_grace: float

    @property
    def state(self) -> ConsoleState:
        """The active host's state: what the screens draw (the selected job's host)."""
        return self.active.state

    @property
    def client(self) -> AgentClient | None:
        return self.active.client

    @client.setter
    def client(self, client: AgentClient | None) -> None:
        self.active.client = client

    @property
    def multi_host(self) -> bool:
        return len(self.sessions) > 1

    def nodes_of(self, name: str | None) -> list[Node]:
        """The nodes of the active host's job `name` across every host (one for a one-node job)."""
        return nodes_of(self.sessions, self.active.name, name)

    def refusal(self, action: str, host: HostSession) -> str | None:
        """Why `action`, just confirmed in a modal, must not go to `host` now: its key's own guard, or that host's link."""
        return self.disabled_reason(action) or (None if host.connected else f"disconnected from {host.name}")

    # -- supplied by ConsoleApp ------------------------------------------------------------------

    def note(self, text: str, *, severity: SeverityLevel = "information") -> None:
        raise NotImplementedError

    def state_changed(self, sections: set[str]) -> None:
        raise NotImplementedError

    def select_job(self, name: str | None, host: str | None = None) -> None:
        raise NotImplementedError

    def disabled_reason(self, action: str) -> str | None:
        raise NotImplementedError

    def redraw_now(self) -> None:
        raise NotImplementedError

    def resync(self, session: HostSession | None = None) -> None:
        raise NotImplementedError

    def set_active(self, session: HostSession) -> None:
        raise NotImplementedError

    def session_named(self, host: str | None) -> HostSession:
        raise NotImplementedError

    def _init_run_actions(self, chain_args: list[str] | tuple[str, ...], signals_interval: float) -> None:
        self.chain_args = list(chain_args)  # extra `stop-and-bench` options (tests: --stop-server-after, --port ...)
        self.chain_job: str | None = None  # the chain the `b` key started last
        self.signals_interval = signals_interval
        self.signals_fetches = 0
        self._signals_next: dict[str, float] = {}
        self._signals_timer: Any = None
        self._data_scaling_at: dict[str, float] = {}
        self._profiles: dict[str, ProfileFacts] = {}
        self._exit_reasons_asked: set[tuple[str, str]] = set()  # (host, job) whose exit reason was asked for
        self.resume_target: dict[str, Any] | None = None  # {"job", "checkpoint", "profile", "host", "options"}: what the last stop wrote
        self.terminal_writes: list[str] = []  # notifications sent to the terminal (--notify), newest last
        self.alerts: list[str] = []  # every alert raised, newest last
        self._alert_memory: dict[str, AlertMemory] = {}  # per host: what its alerts have seen

    def select_started_job(self, name: str, wire: dict[str, Any] | None, host: HostSession | None = None) -> None:
        """Select a job the console just started on `host` (the active one by default, else it becomes active): listed and
        drawn at once, so a jobs-table highlight that a redraw posted for the previous selection (the agent's jobs event
        races with the reply) cannot take it back."""
        self.set_active(host or self.active)
        if name not in self.state.jobs and isinstance(wire, dict):
            self.state.jobs[name] = from_dict(JobInfo, wire)
        self.selected_job = None
        self.select_job(name)
        self.redraw_now()

    def _cancel_signals_timer(self) -> None:
        if self._signals_timer is not None:  # it was scheduled for the previously selected job
            self._signals_timer.stop()
            self._signals_timer = None

    # -- grokking signals and data scaling (computed on the host, on request) ------------------------

    def profile_of(self, job: str | None, host: HostSession | None = None) -> str:
        """The profile `job` (on `host`, the active one by default) was started with; the console's own when unknown."""
        info = (host or self.active).state.jobs.get(job) if job else None
        return job_profile(info.argv, self.profile) if info and info.argv else self.profile

    def profile_facts(self, name: str, run_dir: str | None = None) -> ProfileFacts:
        """The profile's facts; its data dir moved with `run_dir` (a job's --run-dir, else its host's run dir)."""
        key = f"{name}\x1f{run_dir or ''}"
        if key not in self._profiles:
            self._profiles[key] = profile_facts(name, run_dir)
        return self._profiles[key]

    def run_dir_of(self, job: str | None, host: HostSession | None = None) -> str | None:
        """The run dir `job` ran under: its --run-dir, else its host's (hello.run_dir); None when neither is known."""
        state = (host or self.active).state
        info = state.jobs.get(job) if job else None
        given = option_value(info.argv, "--run-dir") if info and info.argv else None
        return given or (state.hello.run_dir if state.hello else None)

    def _grokking_active(self) -> bool:
        return getattr(self.screen, "MODE", None) == "grokking"

    def _can_ask(self) -> bool:
        return self.client is not None and self.state.connection.connected

    def grokking_shown(self, force: bool = False) -> None:
        """The Grokking screen came up (or its job changed): signals now (throttled), data scaling when old."""
        job = self.selected_job
        if not job or not self._grokking_active() or not self._can_ask():
            return
        self.request_signals(job)
        last = self._data_scaling_at.get(job)
        if force or last is None or time.monotonic() - last > DATA_SCALING_EVERY_S:
            self._data_scaling_at[job] = time.monotonic()
            self.fetch_data_scaling(job)

    def request_signals(self, job: str | None) -> None:
        """Ask for signals of the selected job at most once per `signals_interval`; later asks are folded into one timer."""
        if not job or job != self.selected_job or not self._grokking_active() or not self._can_ask():
            return
        if self._signals_timer is not None:
            return  # one fetch is already scheduled: it will see these metrics too
        wait = self._signals_next.get(job, 0.0) - time.monotonic()
        if wait <= 0:
            self.fetch_signals(job)
        else:
            self._signals_timer = self.set_timer(wait, self._signals_timer_fired)

    def _signals_timer_fired(self) -> None:
        self._signals_timer = None
        self.request_signals(self.selected_job)

    @work(group="signals", exclusive=True, exit_on_error=False)
    async def fetch_signals(self, job: str) -> None:
        self._signals_next[job] = time.monotonic() + self.signals_interval
        self.signals_fetches += 1
        try:
            result = await self.active.request(Request.SIGNALS, name=job, timeout=120)
        except AgentError as exc:
            if exc.code not in ("disconnected", "timeout"):
                self.note(f"signals of {job}: {exc}", severity="warning")
            return
        self.state.signals[job] = result
        self.state.signals_at[job] = self.state.clock()
        self.state_changed({"signals"})

    @work(group="data_scaling", exclusive=True, exit_on_error=False)
    async def fetch_data_scaling(self, job: str) -> None:
        """Measured from the run's --data dir; else estimated from the profile's shapes (the agent says which)."""
        info = self.state.jobs.get(job)
        if self.state.is_external(job):  # neither its data dir nor its shapes are known: the console's profile is not its
            self.state.data_scaling[job] = {"error": f"{job} is a watched run: its data dir and sample shapes are not known here"}
            self.state_changed({"data_scaling"})
            return
        data_dir = option_value(info.argv, "--data") if info and info.argv else None
        params: dict[str, Any] = {"data_dir": data_dir} if data_dir else {}
        if not data_dir:
            facts = self.profile_facts(self.profile_of(job), self.run_dir_of(job))
            if facts.error:
                self.state.data_scaling[job] = {"error": f"{job} has no --data dir and its profile cannot be read here: {facts.error}"}
                self.state_changed({"data_scaling"})
                return
            params = {"data_dir": facts.data_dir, "shape": facts.shape}
        try:
            result = await self.active.request(Request.DATA_SCALING, **params, timeout=60)
        except AgentError as exc:
            if exc.code in ("disconnected", "timeout"):
                return
            result = {"error": exc.message}
        self.state.data_scaling[job] = result
        self.state_changed({"data_scaling"})

    # -- stop & bench ----------------------------------------------------------------------------

    def current_chain_job(self) -> str | None:
        """The selected job when it is a chain, else the chain `b` started last, else the newest chain job."""
        info = self.state.jobs.get(self.selected_job) if self.selected_job else None
        if info is not None and info.kind == "chain":
            return info.name
        if self.chain_job:
            return self.chain_job
        chains = [j.name for j in self.state.jobs.values() if j.kind == "chain"]
        return chains[-1] if chains else None

    def _train_job_of_chain(self, chain: str) -> str:
        info = self.state.jobs.get(chain)
        return chain_training_job(info.argv if info else [], chain)

    @work(group="chain", exclusive=True, exit_on_error=False)
    async def attach_chain(self, chain: str | None) -> None:
        """(Re)attach to a chain job: its full stage history, then the saved results of its training run."""
        if not chain or not self._can_ask():
            return
        try:
            await self.active.load_stages(chain)
        except AgentError as exc:
            if exc.code not in ("disconnected", "timeout"):
                self.note(f"stages of {chain}: {exc}", severity="warning")
            return
        await self._load_results(self._train_job_of_chain(chain))

    def _on_chain_progress(self, chain: str) -> None:
        """A chain stage changed; when the chain has ended, fetch the run's saved results for comparison."""
        records = self.state.stages.get(chain, [])
        self._offer_resume_from_chain(chain, records)
        ended = any(r.get("status") == "failed" or (r.get("stage") == CHAIN_STAGES[-1] and r.get("status") == "ok") for r in records)
        if ended and self._can_ask():
            self.load_results(self._train_job_of_chain(chain))

    def _offer_resume_from_chain(self, chain: str, records: list[dict[str, Any]]) -> None:
        """The chain's stop wrote the checkpoint its checkpoint stage picked: the resume key (c) resumes from it."""
        picked = next((r for r in records if r.get("stage") == "checkpoint" and r.get("status") == "ok"), None)
        path = (picked.get("result") or {}).get("path") if picked and isinstance(picked.get("result"), dict) else None
        train_job = self._train_job_of_chain(chain)
        if not isinstance(path, str) or not path or (self.resume_target or {}).get("checkpoint") == path:
            return
        self.set_resume_target(train_job, path, self.active)
        self.note(f"stop & bench {chain}: {train_job}'s checkpoint {path}: press c to resume from it")

    @work(group="results", exclusive=True, exit_on_error=False)
    async def load_results(self, train_job: str) -> None:
        await self._load_results(train_job)

    async def _load_results(self, train_job: str) -> None:
        try:
            result = await self.active.request(Request.RESULTS, name=train_job)
        except AgentError as exc:
            if exc.code not in ("disconnected", "timeout", "not_found"):
                self.note(f"results of {train_job}: {exc}", severity="warning")
            return
        self.state.results[train_job] = [r for r in result.get("results") or [] if isinstance(r, dict)]
        self.state_changed({"results"})

    @work(group="actions", exit_on_error=False)
    async def action_stop_and_bench(self) -> None:
        """Every request goes to the host the job was selected on when b was pressed (node 0's for a multi-node job), even
        if the selection moves while the plan is on screen: the plan shown is the plan carried out."""
        job = self.selected_job
        if job is None:
            return
        info = self.state.jobs.get(job)
        running = bool(info and info.state == "running")
        nodes = self.nodes_of(job) if running else []
        host, job = (nodes[0].session, nodes[0].job.name) if len(nodes) > 1 else (self.active, job)
        try:
            if len(nodes) > 1:
                planned = await self.node_stop_plan(job, nodes)
                if planned is None:
                    return
                reachable, plan = planned
            else:
                plan = await host.request(Request.STOP_PLAN, name=job)
            checkpoints = (await host.request(Request.LIST_CHECKPOINTS, name=job)).get("checkpoints") or []
        except AgentError as exc:
            self.note(f"stop & bench {job}: could not get the plan ({exc}); nothing was stopped", severity="error")
            return
        argv = chain_argv(job, self.chain_args)
        text = self.chain_plan_text(job, host, plan, checkpoints, running, argv)
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
        if not await self.push_screen_wait(StopAndBenchModal(job, text, can_start=running or bool(checkpoints))):
            self.note(f"stop & bench {job} cancelled; nothing was stopped")
            return
        reason = self.refusal("stop_and_bench", host)
        if reason:
            self.note(f"stop & bench {job} not started: {reason}", severity="error")
            return
        if len(nodes) > 1:
            verdict, trouble = await self.stop_nodes_now(job, nodes, reachable)
            if trouble:
                self.note(f"stop & bench {job}: the chain was not started, not every node stopped cleanly: {verdict or 'not sent'}", severity="error")
                return
            self.note(f"stop {job}: {verdict}")
        await self.start_chain(host, job, argv)

    def chain_plan_text(self, job: str, host: HostSession, plan: dict[str, Any], checkpoints: list, running: bool, argv: list[str]) -> Text:
        """What stop & bench will do: the stop plan, the checkpoint it benchmarks, the engine and where that came from."""
        profile = option_value(self.chain_args, "--profile") or self.profile_of(job, host)
        facts = self.profile_facts(profile)
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

    async def start_chain(self, host: HostSession, job: str, argv: list[str]) -> None:
        """Start the stop-and-bench chain of `job` on `host`, then show it (that host becomes the active one)."""
        name = chain_job_name(job)
        host.forget_stages(name)  # stages of an earlier chain of that name belong to its archived run
        try:
            result = await host.request(Request.START_JOB, name=name, kind="chain", argv=argv)
        except AgentError as exc:
            self.note(f"stop & bench {job} not started: {exc}", severity="error")
            return
        self.set_active(host)
        self.chain_job = name
        self.note(f"started {name} (pid {(result.get('job') or {}).get('pid', '?')}): {' '.join(argv)}")
        self.switch_mode("chain")
        self.state_changed({"chain"})

    async def node_stop_plan(self, name: str, nodes: list[Node]) -> tuple[list[Node], dict[str, Any]] | None:
        """(the nodes whose host answers, their stop plans as one); None, said in a note, when no plan could be had."""
        reachable = [n for n in nodes if n.session.connected]
        if not reachable:
            self.note(f"stop {name}: no node's host is connected; nothing was signalled", severity="error")
            return None
        try:
            plans = await asyncio.gather(*(n.session.request(Request.STOP_PLAN, name=n.job.name) for n in reachable))
        except AgentError as exc:
            self.note(f"stop {name}: could not get every node's stop plan ({exc}); nothing was signalled", severity="error")
            return None
        return reachable, merge_stop_plans(name, reachable, plans, unreachable=[n for n in nodes if n not in reachable])

    async def stop_nodes_now(self, name: str, nodes: list[Node], reachable: list[Node]) -> tuple[str, bool]:
        """stop_job on every reachable node at once; (a verdict per node, whether anything went wrong). ("", True) when not sent."""
        if any(not n.session.connected for n in reachable) or self.disabled_reason("stop_job"):
            self.note(f"stop {name} not sent: a node's host disconnected meanwhile; nothing was signalled", severity="error")
            return "", True
        results = await asyncio.gather(
            *(n.session.request(Request.STOP_JOB, name=n.job.name, grace=self.stop_grace, timeout=self.stop_grace + 60) for n in reachable),
            return_exceptions=True,
        )
        outcomes = {n.rank: (f"failed: {r}" if isinstance(r, BaseException) else verdicts_phrase(r)) for n, r in zip(reachable, results)}
        parts = [f"node {n.rank} ({n.host}): {outcomes.get(n.rank, 'NOT signalled, its host is not connected')}" for n in nodes]
        for node in reachable:
            self.resync(node.session)
        return "; ".join(parts), len(reachable) < len(nodes) or any(isinstance(r, BaseException) for r in results)

    # -- grokking runs and external runs ----------------------------------------------------------

    @work(group="actions", exit_on_error=False)
    async def action_grok(self) -> None:
        job, host = self.selected_job, self.active
        if job is None:
            return
        try:
            checkpoints = (await host.request(Request.LIST_CHECKPOINTS, name=job)).get("checkpoints") or []
        except AgentError as exc:
            self.note(f"grok run from {job}: could not list its checkpoints ({exc}); nothing was started", severity="error")
            return
        profile = self.profile_of(job, host)
        facts = self.profile_facts(profile)
        modal = GrokModal(job, profile, checkpoints, lr=facts.learning_rate, weight_decay=GROK_WEIGHT_DECAY_DEFAULT, taken=host.state.jobs)
        params = await self.push_screen_wait(modal)
        if not params:
            self.note(f"grok run from {job} cancelled; nothing was started")
            return
        reason = self.refusal("grok", host)
        if reason:
            self.note(f"grok run not started: {reason}", severity="error")
            return
        try:
            result = await host.request(Request.START_JOB, name=params["name"], kind="train", argv=params["argv"])
        except AgentError as exc:
            self.note(f"grok run {params['name']} not started: {exc}", severity="error")
            return
        self.note(f"started {params['name']} (pid {(result.get('job') or {}).get('pid', '?')}): {' '.join(params['argv'])}")
        self.select_started_job(params["name"], result.get("job"), host)

    @work(group="actions", exit_on_error=False)
    async def action_watch_external(self) -> None:
        host = self.active
        choice = await self.push_screen_wait(WatchModal())
        if not choice:
            self.note("watch cancelled; nothing is watched")
            return
        reason = self.refusal("watch_external", host)
        if reason:
            self.note(f"watch not sent: {reason}", severity="error")
            return
        line_format = choice.get("line_format")
        try:
            extra = {"line_format": line_format} if line_format else {}
            result = await host.request(Request.WATCH_EXTERNAL, name=choice["name"], path=choice["path"], **extra)
        except AgentError as exc:
            self.note(f"cannot watch {choice['path']}: {exc}", severity="error")
            return
        self.set_active(host)
        job = str(result.get("job") or EXTERNAL_PREFIX + choice["name"])
        self.state.metrics.pop(job, None)  # the agent's reader starts from the beginning of the run
        self.state.signals.pop(job, None)
        self.active.externals_agent = self.state.hello.agent_pid if self.state.hello else None
        fmt, warning = result.get("format"), result.get("warning")
        self.state_changed(self.state.add_external(job, choice["path"], line_format=line_format, fmt=fmt if isinstance(fmt, str) else None))
        read_as = f"read as {fmt}" if isinstance(fmt, str) else "format not known yet"
        self.note(f"watching {choice['path']} as {job} ({read_as}; read-only: no stop or adopt)")
        if isinstance(warning, str) and warning:
            self.note(f"{job}: {visible(warning)}", severity="warning")
        self.select_started_job(job, None)

    # -- alerts: job exits, a red canary, grokking onset, a disk running low --------------------------

    def check_alerts(self, sections: set[str], session: HostSession) -> None:
        """Called with each state change of a host: each alert is raised once (a toast); with --notify also on the terminal."""
        if "jobs" in sections:
            self._fetch_exit_reasons(session)
        where = f" on {session.name}" if self.multi_host else ""
        memory, alerts = new_alerts(self._alert_memory.get(session.name, AlertMemory()), session.state, sections, where)
        self._alert_memory[session.name] = memory
        for alert in alerts:
            self.alert(alert.text, severity=alert.severity)

    def _fetch_exit_reasons(self, session: HostSession) -> None:
        """A job that exited non-zero: its last stderr line is the reason ("exited 1" alone says nothing), asked once."""
        state = session.state
        for name, job in state.jobs.items():
            key = (session.name, name)
            if job.state in ENDED_STATES and job.exit_code not in (None, 0) and key not in self._exit_reasons_asked and not state.is_external(name):
                self._exit_reasons_asked.add(key)
                if session.connected:
                    self.run_worker(self._exit_reason(session, name), group=f"exit-reason:{session.name}", exit_on_error=False)

    async def _exit_reason(self, session: HostSession, name: str) -> None:
        try:
            result = await session.request(Request.TAIL_LOG, name=name, stream="stderr", lines=EXIT_REASON_LINES)
        except AgentError:
            self._exit_reasons_asked.discard((session.name, name))  # asked again with the next jobs list
            return
        lines = [str(line).strip() for line in result.get("lines") or [] if str(line).strip()]
        if not lines:
            return
        session.state.exit_reasons[name] = lines[-1][:EXIT_REASON_CHARS]
        job = session.state.jobs.get(name)
        where = f" on {session.name}" if self.multi_host else ""
        code = f" {job.exit_code}" if job is not None else ""
        self.note(f"{name}{where} exited{code}: {visible(lines[-1][:EXIT_REASON_CHARS])}", severity="error")
        session.changed({"jobs"})

    def alert(self, text: str, *, severity: SeverityLevel = "warning") -> None:
        """A toast (not an Actions line: those are the operator's actions and their outcomes); with --notify also the terminal."""
        self.alerts.append(text)
        self.notify(visible(text), severity=severity, timeout=10, markup=False)  # host text in it: inert, never markup
        if self.notify_terminal:
            self.write_terminal(terminal_notification(text))

    def write_terminal(self, data: str) -> None:
        self.terminal_writes.append(data)
        driver = getattr(self, "_driver", None)
        if driver is not None:
            driver.write(data)
            driver.flush()

    # -- resume from the checkpoint a stop wrote ------------------------------------------------------

    async def _latest_checkpoint(self, job: str, host: HostSession) -> str | None:
        listing = (await host.request(Request.LIST_CHECKPOINTS, name=job)).get("checkpoints") or []
        entries = [c for c in listing if isinstance(c, dict) and c.get("path")]
        latest = next((c for c in entries if c.get("latest")), entries[-1] if entries else None)
        return str(latest["path"]) if latest else None

    async def checkpoint_before_stop(self, job: str, plan: dict[str, Any], host: HostSession) -> str | None:
        """The job's latest checkpoint on `host` before the stop ("" for none); None when the stop writes none (not training)."""
        info = host.state.jobs.get(job)
        if info is None or info.kind != "train" or not plan.get("checkpoint_first"):
            return None
        try:
            return await self._latest_checkpoint(job, host) or ""
        except AgentError:
            return None

    async def offer_resume(self, job: str, before: str | None, host: HostSession) -> str:
        """After a stop on `host`: when it wrote a new checkpoint, remember it so one key (c) resumes from it there; says so."""
        if before is None:
            return ""
        try:
            after = await self._latest_checkpoint(job, host)
        except AgentError as exc:
            return f"; its checkpoints could not be listed ({exc})"
        if not after or after == before:
            return "; no new checkpoint was written" + (f" (the latest is still {after})" if after else "")
        self.set_resume_target(job, after, host)
        return f"; it wrote {after}: press c to resume from it"

    def set_resume_target(self, job: str, checkpoint: str, host: HostSession) -> None:
        """Remember `checkpoint` of `job` on `host` for the resume key, with the job's own command line (its settings)."""
        info = host.state.jobs.get(job)
        options = carried_train_options(info.argv) if info and info.argv else []
        self.resume_target = {"job": job, "checkpoint": checkpoint, "profile": self.profile_of(job, host), "host": host.name, "options": options}
        self.refresh_bindings()

    @work(group="actions", exit_on_error=False)
    async def action_resume(self) -> None:
        target = self.resume_target
        if target is None:
            return
        host = self.session_named(target["host"])
        argv = resume_argv(target["profile"], target["checkpoint"]) + list(target.get("options") or [])
        name = free_job_name(resume_job_name(target["checkpoint"]), host.state.jobs)
        if not await self.push_screen_wait(ResumeModal(target["job"], target["checkpoint"], name, argv)):
            self.note(f"resume of {target['job']} cancelled; nothing was started")
            return
        reason = self.refusal("resume", host)
        if reason:
            self.note(f"resume not started: {reason}", severity="error")
            return
        try:
            result = await host.request(Request.START_JOB, name=name, kind="train", argv=argv)
        except AgentError as exc:
            self.note(f"resume {name} not started: {exc}", severity="error")
            return
        self.note(f"started {name} (pid {(result.get('job') or {}).get('pid', '?')}): {' '.join(argv)}")
        self.select_started_job(name, result.get("job"), host)


def verdicts_phrase(result: dict[str, Any]) -> str:
    verdicts = result.get("verdicts") or []
    return ", ".join(f"{v.get('pid')} {v.get('outcome')}" for v in verdicts) or "nothing to signal"


def merge_stop_plans(name: str, nodes: list[Node], plans: list[dict[str, Any]], unreachable: Sequence[Node] = ()) -> dict[str, Any]:
    """Every reachable node's stop plan as one: each PID and stale record names its host; checkpoint first when node 0's
    says so; a node whose host is not connected is listed as not signalled, with what happens to it."""
    merged: dict[str, Any] = {
        "jobs": [name],
        "will_signal": [],
        "stale": [],
        "foreign_gpu_holders": [],
        "checkpoint_first": any(n.rank == 0 and p.get("checkpoint_first") for n, p in zip(nodes, plans)),
    }
    for node, plan in zip(nodes, plans):
        where = f"node {node.rank} {node.host}"
        merged["will_signal"] += [{**e, "job": f"{e.get('job', '')} ({where})"} for e in plan.get("will_signal") or []]
        merged["stale"] += [{**e, "job": f"{e.get('job', '')} ({where})"} for e in plan.get("stale") or []]
        merged["foreign_gpu_holders"] += [{**e, "user": f"{e.get('user', '')}@{node.host}"} for e in plan.get("foreign_gpu_holders") or []]
    merged["unreachable"] = [{"pid": n.job.pid, "job": n.job.name, "node": n.rank, "host": n.host} for n in unreachable]
    return merged
