"""Stop: the selected job's stop plan (every node's for a multi-node job), confirmed in a modal, then the stop (key s)."""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

from backend.protocol import Request
from console.client import AgentError
from console.flows.base import FlowHost
from console.flows.resume import ResumeFlow
from console.screens.modals import StopModal
from console.nodes import Node


class StopFlow:
    """The stop of the selected job: the PIDs confirmed are the PIDs signalled; a new checkpoint is offered for resume."""

    def __init__(self, app: FlowHost, resume: ResumeFlow):
        self.app = app
        self.resume = resume

    async def run(self) -> None:
        """The stop goes to the host the job was selected on when s was pressed, even if the selection moves while the
        plan is on screen: the PIDs confirmed are the PIDs signalled."""
        app = self.app
        name, host = app.selected_job, app.active
        if name is None:
            return
        nodes = app.nodes_of(name)
        if len(nodes) > 1:
            await self._stop_nodes(name, nodes)
            return
        try:
            plan = await host.request(Request.STOP_PLAN, name=name)
        except AgentError as exc:
            app.note(f"stop {name}: could not get the stop plan ({exc}); nothing was signalled", severity="error")
            return
        before = await self.resume.checkpoint_before_stop(name, plan, host)
        if not await app.push_screen_wait(StopModal(name, plan, app.stop_grace)):
            app.note(f"stop {name} cancelled; nothing was signalled")
            return
        reason = app.refusal("stop_job", host)
        if reason:
            app.note(f"stop {name} not sent: {reason}", severity="error")
            return
        try:
            result = await host.request(Request.STOP_JOB, name=name, grace=app.stop_grace, timeout=app.stop_grace + 60)
        except AgentError as exc:
            app.note(f"stop {name} failed: {exc}", severity="error")
            return
        app.note(f"stop {name}: {verdicts_phrase(result)}{await self.resume.offer(name, before, host)}")
        app.resync(host)

    async def _stop_nodes(self, name: str, nodes: list[Node]) -> None:
        """A multi-node job: one plan from every reachable node's host, one confirmation, then stop_job on those hosts at
        once (rank 0 checkpoints first: every rank hears the stop and they agree on it at the step's end); a verdict per
        node. A node whose host does not answer is named and left alone: its ranks end when their next collective finds
        the others gone, or stop it once its host is back."""
        app = self.app
        planned = await self.node_stop_plan(name, nodes)
        if planned is None:
            return
        reachable, merged = planned
        lead = reachable[0]
        before = await self.resume.checkpoint_before_stop(lead.job.name, merged, lead.session) if lead.rank == 0 else None
        if not await app.push_screen_wait(StopModal(f"{name} on {len(nodes)} nodes", merged, app.stop_grace)):
            app.note(f"stop {name} cancelled; nothing was signalled on any node")
            return
        verdict, trouble = await self.stop_nodes_now(name, nodes, reachable)
        if verdict:
            resume = await self.resume.offer(lead.job.name, before, lead.session)
            app.note(f"stop {name}: {verdict}{resume}", severity="error" if trouble else "information")

    async def node_stop_plan(self, name: str, nodes: list[Node]) -> tuple[list[Node], dict[str, Any]] | None:
        """(the nodes whose host answers, their stop plans as one); None, said in a note, when no plan could be had."""
        reachable = [n for n in nodes if n.session.connected]
        if not reachable:
            self.app.note(f"stop {name}: no node's host is connected; nothing was signalled", severity="error")
            return None
        try:
            plans = await asyncio.gather(*(n.session.request(Request.STOP_PLAN, name=n.job.name) for n in reachable))
        except AgentError as exc:
            self.app.note(f"stop {name}: could not get every node's stop plan ({exc}); nothing was signalled", severity="error")
            return None
        return reachable, merge_stop_plans(name, reachable, plans, unreachable=[n for n in nodes if n not in reachable])

    async def stop_nodes_now(self, name: str, nodes: list[Node], reachable: list[Node]) -> tuple[str, bool]:
        """stop_job on every reachable node at once; (a verdict per node, whether anything went wrong). ("", True) when not sent."""
        app = self.app
        if any(not n.session.connected for n in reachable) or app.disabled_reason("stop_job"):
            app.note(f"stop {name} not sent: a node's host disconnected meanwhile; nothing was signalled", severity="error")
            return "", True
        results = await asyncio.gather(
            *(n.session.request(Request.STOP_JOB, name=n.job.name, grace=app.stop_grace, timeout=app.stop_grace + 60) for n in reachable),
            return_exceptions=True,
        )
        outcomes = {n.rank: (f"failed: {r}" if isinstance(r, BaseException) else verdicts_phrase(r)) for n, r in zip(reachable, results)}
        parts = [f"node {n.rank} ({n.host}): {outcomes.get(n.rank, 'NOT signalled, its host is not connected')}" for n in nodes]
        for node in reachable:
            app.resync(node.session)
        return "; ".join(parts), len(reachable) < len(nodes) or any(isinstance(r, BaseException) for r in results)


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
        "checkpoint_note": next((p.get("checkpoint_note") for n, p in zip(nodes, plans) if n.rank == 0 and p.get("checkpoint_note")), ""),
    }
    for node, plan in zip(nodes, plans):
        where = f"node {node.rank} {node.host}"
        merged["will_signal"] += [{**e, "job": f"{e.get('job', '')} ({where})"} for e in plan.get("will_signal") or []]
        merged["stale"] += [{**e, "job": f"{e.get('job', '')} ({where})"} for e in plan.get("stale") or []]
        merged["foreign_gpu_holders"] += [{**e, "user": f"{e.get('user', '')}@{node.host}"} for e in plan.get("foreign_gpu_holders") or []]
    merged["unreachable"] = [{"pid": n.job.pid, "job": n.job.name, "node": n.rank, "host": n.host} for n in unreachable]
    return merged
