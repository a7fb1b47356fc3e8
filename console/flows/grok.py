"""Grok run: resume a checkpoint of the selected training job with a constant LR, weight decay and optional Grokfast (key g)."""

from __future__ import annotations

from backend.commands import GROK_WEIGHT_DECAY_DEFAULT
from backend.protocol import Request
from console.client import AgentError
from console.flows.base import FlowHost, started_note
from console.screens.grok_modal import GrokModal


class GrokFlow:
    """List the job's checkpoints, take the grok settings in a form, start the run on the job's host and select it."""

    def __init__(self, app: FlowHost):
        self.app = app

    async def run(self) -> None:
        app = self.app
        job, host = app.selected_job, app.active
        if job is None:
            return
        try:
            checkpoints = (await host.request(Request.LIST_CHECKPOINTS, name=job)).get("checkpoints") or []
        except AgentError as exc:
            app.note(f"grok run from {job}: could not list its checkpoints ({exc}); nothing was started", severity="error")
            return
        profile = app.profile_of(job, host)
        facts = app.profile_facts(profile)
        modal = GrokModal(job, profile, checkpoints, lr=facts.learning_rate, weight_decay=GROK_WEIGHT_DECAY_DEFAULT, taken=host.state.jobs)
        params = await app.push_screen_wait(modal)
        if not params:
            app.note(f"grok run from {job} cancelled; nothing was started")
            return
        reason = app.refusal("grok", host)
        if reason:
            app.note(f"grok run not started: {reason}", severity="error")
            return
        try:
            result = await host.request(Request.START_JOB, name=params["name"], kind="train", argv=params["argv"])
        except AgentError as exc:
            app.note(f"grok run {params['name']} not started: {exc}", severity="error")
            return
        app.note(started_note(params["name"], result, params["argv"]))
        app.select_started_job(params["name"], result.get("job"), host)
