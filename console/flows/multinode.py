"""Multi-node: one training job across every connected host under torchrun, each node's command shown first (key m)."""

from __future__ import annotations

import asyncio
import time
import zlib

from backend.commands import node_spec, torchrun_train_argv, train_argv
from backend.protocol import Request
from console.flows.base import FlowHost
from console.flows.start import short_profile
from console.screens.modals import MultiNodeModal
from console.session import HostSession


class MultiNodeFlow:
    """Plan a node per connected host, confirm the plan, start every node at once, and select the run on node 0."""

    def __init__(self, app: FlowHost):
        self.app = app

    async def run(self) -> None:
        app = self.app
        sessions = [s for s in app.sessions if s.connected]
        run_id = f"mn-{short_profile(app.profile)}-{time.strftime('%H%M%S', time.localtime(app.state.clock()))}"
        endpoint = app.rdzv_endpoint or f"{rendezvous_host(sessions[0])}:{rendezvous_port(run_id)}"
        base = train_argv(app.profile)
        try:
            plan = [
                (
                    s,
                    torchrun_train_argv(base, run_id=run_id, node_rank=rank, nnodes=len(sessions), rdzv_endpoint=endpoint),
                    node_spec(run_id, rank, len(sessions), endpoint),
                )
                for rank, s in enumerate(sessions)
            ]
        except ValueError as exc:
            app.note(f"multi-node run not started: {exc}", severity="error")
            return
        if not await app.push_screen_wait(MultiNodeModal(run_id, endpoint, [(s.name, argv) for s, argv, _ in plan])):
            app.note(f"multi-node run {run_id} cancelled; nothing was started")
            return
        if app.disabled_reason("start_multinode") or any(not s.connected for s, _, _ in plan):
            app.note(f"multi-node run {run_id} not started: a host disconnected meanwhile", severity="error")
            return
        results = await asyncio.gather(
            *(s.request(Request.START_JOB, name=run_id, kind="train", argv=argv, node=node) for s, argv, node in plan), return_exceptions=True
        )
        failed = [(s, r) for (s, _, _), r in zip(plan, results) if isinstance(r, BaseException)]
        if failed:
            started = [s for (s, _, _), r in zip(plan, results) if not isinstance(r, BaseException)]
            app.note(
                f"multi-node run {run_id}: {failed[0][0].name} refused it ({failed[0][1]}); "
                f"{len(started)} node(s) started and will wait for it at the rendezvous: stop them with s",
                severity="error",
            )
        else:
            app.note(f"started {run_id} on {len(plan)} nodes ({', '.join(s.name for s, _, _ in plan)}), rendezvous {endpoint}")
        lead = plan[0][0]
        if not isinstance(results[0], BaseException):
            app.set_active(lead)
            app.select_started_job(run_id, results[0].get("job"))


def rendezvous_host(session: HostSession) -> str:
    """How the other nodes reach the first host: its SSH host name (as this laptop resolves it), 127.0.0.1 for the local agent."""
    transport = session.client.transport if session.client is not None else None
    return str(getattr(transport, "host", None) or "127.0.0.1")


def rendezvous_port(run_id: str) -> int:
    """A port in 29400-29999 picked from the run id, so two runs started the same second by two consoles rarely collide."""
    return 29400 + zlib.crc32(run_id.encode()) % 600
