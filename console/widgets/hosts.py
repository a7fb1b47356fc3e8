"""Rich cells across hosts: the jobs table's rows (a host column; a multi-node job as one row), the Hosts view, the nodes panel."""

from __future__ import annotations

from typing import Any

from rich.text import Text

from backend.protocol import JobInfo
from console.nodes import JobRow, Node, nodes_of, nodes_problem, slowest_rank
from console.session import HostSession
from console.state import CONNECTED, ConsoleState
from backend.safetext import visible
from console.format import GIB, MIB, duration, figure, inert_text, number, plain_cell, size_bytes

# Under NARROW_WIDTH the jobs table keeps what tells a job's health and drops kind, pid and runtime (the stop modal shows
# the pids); its two-line header narrows "train loss" so that exit, step and loss stay on screen beside cpu% and rss.
NARROW_JOB_COLUMNS = ("job", "state", "cpu%", "rss", "exit", "step", "train loss", "detail")
NARROW_HOSTS_JOB_COLUMNS = ("job", "state", "cpu%", "exit", "step", "train loss", "detail")  # beside a host column: no rss
NARROW_WIDTH = 140
NARROW_LABELS = {"train loss": "train\nloss"}
# The jobs table's sort keys in the order > cycles them, the column each marks, and which sort biggest (or newest) first.
SORT_KEYS = ("name", "state", "started", "cpu", "rss", "step")
DEFAULT_SORT = "started"  # the order jobs are listed in: each host's newest first, hosts in the order given
SORT_COLUMNS = {"name": "job", "state": "state", "started": "runtime", "cpu": "cpu%", "rss": "rss", "step": "step"}
SORT_TITLES = {"name": "name", "state": "state", "started": "started", "cpu": "CPU %", "rss": "RSS", "step": "step"}
DESCENDING = frozenset({"started", "cpu", "rss", "step"})
STATE_ORDER = ("running", "stale", "unknown", "watching", "stopped", "exited")  # what needs an eye first
HOST_COLUMNS = ("host", "link", "GPUs", "GPU memory", "util", "holders owned/foreign", "jobs running", "run dir free", "agent")
STATE_STYLES = {"running": "green", "exited": "dim", "stopped": "yellow", "stale": "red", "unknown": "red"}
ROW_KEY_SEP = "\x1f"  # host and job name in a row key: neither may contain it


def row_key(host: str, name: str) -> str:
    return f"{host}{ROW_KEY_SEP}{name}"


def split_row_key(key: str) -> tuple[str, str]:
    host, _, name = key.partition(ROW_KEY_SEP)
    return host, name


def job_table_rows(jobs: list[tuple[HostSession, str]], sessions: list[HostSession]) -> list[JobRow]:
    """The jobs table from `jobs` (every host's, newest first): the nodes of a multi-node job folded into one row at its first node."""
    rows: list[JobRow] = []
    folded: set[tuple[str, str]] = set()
    for session, name in jobs:
        if (session.name, name) in folded:
            continue
        nodes = nodes_of(sessions, session.name, name)
        if len(nodes) > 1:
            folded.update((n.host, n.job.name) for n in nodes)
            lead = nodes[0]
            rows.append(_job_row(row_key(lead.host, lead.job.name), lead.session.state, lead.job, nodes))
        else:
            rows.append(_job_row(row_key(session.name, name), session.state, session.state.jobs[name], []))
    return rows


def sort_rows(rows: list[JobRow], key: str, reverse: bool = False) -> list[JobRow]:
    """`rows` by `key` (SORT_KEYS), biggest or newest first for DESCENDING keys; rows with no value last either way.
    The default, started, is the listing order itself (so `[` and `]` walk the table as shown)."""
    if key == DEFAULT_SORT:
        return list(reversed(rows)) if reverse else list(rows)
    known = [row for row in rows if row.sort_values.get(key) is not None]
    unknown = [row for row in rows if row.sort_values.get(key) is None]
    return sorted(known, key=lambda row: row.sort_values[key], reverse=(key in DESCENDING) != reverse) + unknown


def sort_label(key: str, reverse: bool) -> str:
    """'CPU % ▼': the sort key and its direction (▼ biggest, newest or first-in-order on top)."""
    return f"{SORT_TITLES[key]} {'▲' if reverse else '▼'}"


def column_label(name: str, *, narrow: bool, sort: str, reverse: bool) -> str:
    """A jobs-table header: two lines for a wide name on a narrow table; the sort column marked with its direction (on a
    narrow table under the name, so the column does not widen)."""
    label = NARROW_LABELS.get(name, name) if narrow else name
    if SORT_COLUMNS.get(sort) == name and (sort != DEFAULT_SORT or reverse):
        label += ("\n" if narrow and "\n" not in label else " ") + ("▲" if reverse else "▼")
    return label


def cpu_cell(percent: float | None) -> str:
    return "-" if percent is None else f"{percent:.0f}%"


def rss_cell(size: int | None) -> str:
    """Resident memory in at most four characters and a unit: '9.8G', '512M' (htop's RES)."""
    if size is None:
        return "-"
    amount = float(size)
    for unit in "BKMGT":
        if amount < 1000 or unit == "T":
            return f"{amount:.0f}{unit}" if unit == "B" or amount >= 10 else f"{amount:.1f}{unit}"
        amount /= 1024
    return "-"


def _usage(jobs: list[JobInfo]) -> tuple[float | None, int | None]:
    """CPU % and RSS of a job's nodes added up (one node: its own); None when no node has been measured."""
    cpus = [j.cpu_pct for j in jobs if j.cpu_pct is not None]
    sizes = [j.rss_bytes for j in jobs if j.rss_bytes is not None]
    return (sum(cpus) if cpus else None), (sum(sizes) if sizes else None)


def _job_row(key: str, state: ConsoleState, job: JobInfo, nodes: list[Node]) -> JobRow:
    cpu, rss = _usage([n.job for n in nodes] or [job])
    latest = state.metrics.get(job.name)
    step = (latest.latest if latest else {}).get("step")
    order = STATE_ORDER.index(job.state) if job.state in STATE_ORDER else len(STATE_ORDER)
    values = {"name": job.name.lower(), "state": order, "cpu": cpu, "rss": rss, "step": step if isinstance(step, (int, float)) else None}
    return JobRow(key, _job_cells(state, job, nodes, cpu, rss), values)


def _job_cells(state: ConsoleState, job: JobInfo, nodes: list[Node], cpu: float | None, rss: int | None) -> tuple[Any, ...]:
    latest = state.metrics.get(job.name)
    record = latest.latest if latest else {}
    train = latest.latest_train if latest else {}  # the loss column is train loss only: a val record's loss is not it
    end = job.ended_at if job.ended_at else state.clock()
    host = "+".join(n.host for n in nodes) if nodes else state.target
    detail = state.job_details.get(job.name, "")
    reason = state.exit_reasons.get(job.name) if job.exit_code not in (None, 0) else None
    if reason:
        detail = f"exit {job.exit_code}: {reason}"
    status = Text(visible(job.state), style=STATE_STYLES.get(job.state, ""))
    if nodes:
        running = sum(n.job.state == "running" and not n.host_stale for n in nodes)
        status = Text(f"{visible(job.state)} {running}/{len(nodes)}", style=STATE_STYLES.get(job.state, "") if running == len(nodes) else "bold red")
        detail = nodes_problem(nodes) or f"{len(nodes)} nodes, all ranks reporting"
    return (  # str cells are Rich markup to the DataTable: host strings go in as plain_cell
        plain_cell(host),
        plain_cell(job.name),
        plain_cell(job.kind + (" (adopted)" if job.adopted and job.kind != "adopted" else "")),
        status,
        "-" if job.kind == "external" else str(job.pid),
        duration(end - job.started_at),
        cpu_cell(cpu),
        rss_cell(rss),
        "-" if job.exit_code is None else str(job.exit_code),
        str(record.get("step", "-")),
        number(train.get("loss")),
        plain_cell(visible(detail)[:60] if nodes or reason else visible(detail)[:40]),
    )


@inert_text
def nodes_text(nodes: list[Node]) -> Text:
    """Per node: host, state, pid; per rank: step and how long ago it last reported (the agent's clock), slowest marked."""
    text = Text()
    slow = slowest_rank(nodes)
    problem = nodes_problem(nodes)
    if problem:
        text.append(f"⚠ {problem}\n", style="bold red")
    for node in nodes:
        style = "red" if node.host_stale or node.job.state != "running" else ""
        state = "host not answering" if node.host_stale else node.job.state
        text.append(f"node {node.rank} · {node.host} · {state} · pid {node.job.pid}\n", style=style)
        for rank in sorted(node.job.ranks, key=lambda r: int(r.get("rank") or 0)):
            number_ = int(rank.get("rank") or 0)
            stalled = number_ in node.job.stalled_ranks
            line = f"└ rank {number_}: step {rank.get('step', '-')}, {float(rank.get('age_s') or 0.0):.1f} s ago"
            if stalled:
                text.append(line + "  NOT REPORTING\n", style="bold red")
            elif slow == (node.host, number_):
                text.append(line + "  slowest\n", style="bold yellow")
            else:
                text.append(line + "\n")
        if not node.job.ranks:
            text.append("└ no rank has reported yet\n", style="dim")
    return text


def host_cells(session: HostSession) -> tuple[Any, ...]:
    """One Hosts-view row: link, GPUs at a glance, holders owned/foreign, running jobs, run-dir free space, agent."""
    state = session.state
    now = state.clock()
    if state.connection.state == CONNECTED:
        link = Text("● connected", style="green")
    elif state.last_data_at is not None:
        link = Text(f"▲ STALE {duration(now - state.last_data_at)}", style="bold red")
    else:
        link = Text(f"✖ {state.connection.state}", style="bold red")
    used = sum(g.memory_used_mib or 0.0 for g in state.gpus)
    total = sum(g.memory_total_mib or 0.0 for g in state.gpus)
    utils = [g.utilization_pct for g in state.gpus if g.utilization_pct is not None]
    memory = f"{figure(used, GIB, amount_unit=MIB)}/{figure(total, GIB, 0, amount_unit=MIB)} GiB" if total else ("no GPU" if state.no_driver else "-")
    owned = sum(h.owned for h in state.holders)
    run_dir = next((d for d in state.disks if d.label == "run_dir"), None)
    hello = state.hello
    return (
        plain_cell(session.name),
        link,
        str(len(state.gpus)),
        memory,
        f"{sum(utils) / len(utils):.0f}%" if utils else "-",
        f"{owned}/{len(state.holders) - owned}",
        str(len(state.running_jobs())),
        size_bytes(run_dir.free_bytes) if run_dir else "-",
        plain_cell(f"pid {hello.agent_pid} · {visible(hello.host)}") if hello else "-",
    )
