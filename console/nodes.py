"""A job across hosts: the nodes of a multi-node job, what is wrong with them, and the jobs table's row model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backend.protocol import JobInfo
from console.session import HostSession
from console.state import CONNECTED

JOB_COLUMNS = ("job", "kind", "state", "pid", "runtime", "cpu%", "rss", "exit", "step", "train loss", "detail")


@dataclass
class Node:
    """One node of a job: the host it runs on and that host's record of it."""

    session: HostSession
    job: JobInfo

    @property
    def host(self) -> str:
        return self.session.name

    @property
    def rank(self) -> int:
        return self.job.node_rank if self.job.node_rank is not None else 0

    @property
    def host_stale(self) -> bool:
        return self.session.state.connection.state != CONNECTED


@dataclass
class JobRow:
    key: str
    cells: tuple[Any, ...]  # host first, then JOB_COLUMNS
    sort_values: dict[str, Any] = field(default_factory=dict)  # what the jobs table sorts by (console/widgets/hosts.py SORT_KEYS); None: unknown

    def pick(self, columns: tuple[str, ...], *, host: bool) -> tuple[Any, ...]:
        """The cells of `columns` (JOB_COLUMNS names), after the host cell when `host`."""
        chosen = tuple(self.cells[1 + JOB_COLUMNS.index(name)] for name in columns)
        return (self.cells[0], *chosen) if host else chosen


def nodes_of(sessions: list[HostSession], host: str, name: str | None) -> list[Node]:
    """Every host's node of the job `name` on `host` (the same run id), node rank order; [] when it is not there."""
    session = next((s for s in sessions if s.name == host), None)
    job = session.state.jobs.get(name) if session and name else None
    if session is None or job is None:
        return []
    if not job.run_id or not job.nnodes or job.nnodes < 2:
        return [Node(session, job)]
    nodes = []
    for other in sessions:
        same = [j for j in other.state.jobs.values() if j.run_id == job.run_id]
        if same:
            nodes.append(Node(other, max(same, key=lambda j: j.started_at)))
    return sorted(nodes, key=lambda n: n.rank)


def nodes_problem(nodes: list[Node]) -> str | None:
    """The first thing wrong with a multi-node job, in words: a host not answering, a node ended, a rank not reporting."""
    for node in nodes:
        if node.host_stale:
            return f"node {node.rank} ({node.host}): host not answering"
    for node in nodes:
        if node.job.state != "running":
            return f"node {node.rank} ({node.host}) {node.job.state}"
    for node in nodes:
        stalled = [r for r in node.job.ranks if r.get("rank") in node.job.stalled_ranks]
        if stalled:
            age = max(float(r.get("age_s") or 0.0) for r in stalled)
            return f"node {node.rank} ({node.host}) not reporting for {age:.0f} s"
    return None


def slowest_rank(nodes: list[Node]) -> tuple[str, int] | None:
    """(host, rank) of the rank with the lowest step, when the ranks disagree."""
    ranks = [(int(r.get("step") or 0), node.host, int(r.get("rank") or 0)) for node in nodes for r in node.job.ranks]
    if len({step for step, _, _ in ranks}) < 2:
        return None
    _, host, rank = min(ranks)
    return host, rank
