"""Start: a training job with the console's profile on the active host (key n)."""

from __future__ import annotations

import time

from backend.commands import train_argv
from backend.protocol import Request
from console.client import AgentError
from console.flows.base import FlowHost, started_note


class StartFlow:
    """Start a training run of the console's profile, named after it and the time, and select it."""

    def __init__(self, app: FlowHost):
        self.app = app

    async def run(self) -> None:
        app, host = self.app, self.app.active
        name = f"train-{short_profile(app.profile)}-{time.strftime('%H%M%S', time.localtime(app.state.clock()))}"
        argv = train_argv(app.profile)
        try:
            result = await host.request(Request.START_JOB, name=name, kind="train", argv=argv)
        except AgentError as exc:
            app.note(f"start {name} failed: {exc}", severity="error")
            return
        app.note(started_note(name, result, argv))
        app.select_started_job(name, result.get("job") or {}, host)


def short_profile(profile: str) -> str:
    """A profile's name without its directory and .toml (a job name carries it)."""
    stem = profile.rsplit("/", 1)[-1]
    return stem[:-5] if stem.endswith(".toml") else stem
