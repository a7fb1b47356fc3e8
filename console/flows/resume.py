"""Resume: remember the checkpoint a stop wrote, and start a new training job from it with the job's own settings (key c)."""

from __future__ import annotations

from typing import Any, Sequence

from backend.commands import resume_argv, resume_job_name
from backend.protocol import Request
from console.client import AgentError
from console.flows.base import FlowHost, started_note
from console.screens.grok_modal import free_job_name
from console.screens.modals import ResumeModal
from console.session import HostSession

RESUME_DROPPED_OPTIONS = ("--resume", "--out", "--profile")  # the resume sets these itself; the agent gives the job dir


class ResumeFlow:
    """The checkpoint before and after a stop; the app's `resume_target` is what the resume key starts from."""

    def __init__(self, app: FlowHost):
        self.app = app

    async def checkpoint_before_stop(self, job: str, plan: dict[str, Any], host: HostSession) -> str | None:
        """The job's latest checkpoint on `host` before the stop ("" for none); None when the stop writes none (not training)."""
        info = host.state.jobs.get(job)
        if info is None or info.kind != "train" or not plan.get("checkpoint_first"):
            return None
        try:
            return await latest_checkpoint(job, host) or ""
        except AgentError:
            return None

    async def offer(self, job: str, before: str | None, host: HostSession) -> str:
        """After a stop on `host`: when it wrote a new checkpoint, remember it so one key (c) resumes from it there; says so."""
        if before is None:
            return ""
        try:
            after = await latest_checkpoint(job, host)
        except AgentError as exc:
            return f"; its checkpoints could not be listed ({exc})"
        if not after or after == before:
            return "; no new checkpoint was written" + (f" (the latest is still {after})" if after else "")
        self.remember(job, after, host)
        return f"; it wrote {after}: press c to resume from it"

    def remember(self, job: str, checkpoint: str, host: HostSession) -> None:
        """Remember `checkpoint` of `job` on `host` for the resume key, with the job's own command line (its settings)."""
        info = host.state.jobs.get(job)
        options = carried_train_options(info.argv) if info and info.argv else []
        self.app.resume_target = {"job": job, "checkpoint": checkpoint, "profile": self.app.profile_of(job, host), "host": host.name, "options": options}
        self.app.refresh_bindings()

    async def run(self) -> None:
        app, target = self.app, self.app.resume_target
        if target is None:
            return
        host = app.session_named(target["host"])
        argv = resume_argv(target["profile"], target["checkpoint"]) + list(target.get("options") or [])
        name = free_job_name(resume_job_name(target["checkpoint"]), host.state.jobs)
        if not await app.push_screen_wait(ResumeModal(target["job"], target["checkpoint"], name, argv)):
            app.note(f"resume of {target['job']} cancelled; nothing was started")
            return
        reason = app.refusal("resume", host)
        if reason:
            app.note(f"resume not started: {reason}", severity="error")
            return
        try:
            result = await host.request(Request.START_JOB, name=name, kind="train", argv=argv)
        except AgentError as exc:
            app.note(f"resume {name} not started: {exc}", severity="error")
            return
        app.note(started_note(name, result, argv))
        app.select_started_job(name, result.get("job"), host)


async def latest_checkpoint(job: str, host: HostSession) -> str | None:
    listing = (await host.request(Request.LIST_CHECKPOINTS, name=job)).get("checkpoints") or []
    entries = [c for c in listing if isinstance(c, dict) and c.get("path")]
    latest = next((c for c in entries if c.get("latest")), entries[-1] if entries else None)
    return str(latest["path"]) if latest else None


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
