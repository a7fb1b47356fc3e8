"""Stress jobs.db with many processes at once: agents, CLIs and in-process registries on one run dir, random SIGKILLs.

Workers of five kinds share one run dir:
  registry  a process with a JobRegistry used from two threads (starts, lists, stops of its own jobs)
  agent     a real `python -m backend.agent` driven over its stdin/stdout protocol (start_job, stop_job, list)
  cli       the real `eagle3-host job start/list/stop` command lines
  chain     a training-kind job, then the real `eagle3-host stop-and-bench` started as an owned chain job (what the
            `b` key does): it stops the training job from its own process and ends at its checkpoint stage
  console   the console's own AgentClient over a LocalTransport (a real agent it starts) folding every `jobs` event
            into a ConsoleState: each few seconds it checks that its view holds every record committed 3 s before
Each worker appends the name of every job whose start was committed (the call returned, or the reply said ok) to
its own ledger, after the commit. Readers (`eagle3-host job list --json` in a fresh process, and a plain sqlite3
read) read every ledger first and then the registry: every name in a ledger read before must be listed; consoles
check their own view the same way and write what they missed beside the ledgers. Every few seconds a random worker
(or the agent behind one) is SIGKILLed and replaced. At the end a fresh process lists the registry once more and
PRAGMA integrity_check runs.

Prints records committed, checks by readers and consoles, records unseen by a reader or a console (goal 0), records
lost at the end (goal 0), integrity errors (goal 0), kills. Exit 1 if any goal is missed.
Usage: python benchmarks/registry_stress.py [--workers 6] [--seconds 60] [--kill-every 3] [--seed 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PY = sys.executable
KINDS = ("registry", "agent", "cli", "chain", "console")
JOB_ARGV = ["sleep", "30"]


def append_ledger(ledger: Path, name: str) -> None:
    with open(ledger, "a") as handle:
        handle.write(name + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_ledgers(folder: Path) -> set[str]:
    names: set[str] = set()
    for ledger in folder.glob("*.ledger"):
        names.update(line for line in ledger.read_text().splitlines() if line)
    return names


# ------------------------------------------------------------------ workers (run as child processes)


def registry_worker(run_dir: Path, ledger: Path, prefix: str, seed: int) -> None:
    from backend.jobs.records import JobError
    from backend.jobs.registry import JobRegistry

    registry = JobRegistry(run_dir)
    rng = random.Random(seed)
    lock = threading.Lock()
    counter = [0]

    def loop(thread: int) -> None:
        while True:
            with lock:
                counter[0] += 1
                number = counter[0]
            action = rng.random()
            try:
                if action < 0.5:
                    name = f"{prefix}-{thread}-{number}"
                    registry.start_job(name, "other", JOB_ARGV)
                    append_ledger(ledger, name)
                elif action < 0.8:
                    registry.list_jobs()
                else:
                    mine = [job.name for job in registry.list_jobs() if job.name.startswith(prefix) and job.state == "running"]
                    if mine:
                        registry.stop(name=rng.choice(mine), grace=0.2)
            except JobError as exc:
                print(f"{prefix}: {exc}", file=sys.stderr, flush=True)

    threads = [threading.Thread(target=loop, args=(index,), daemon=True) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def agent_worker(run_dir: Path, ledger: Path, prefix: str, seed: int) -> None:
    rng = random.Random(seed)
    agent = subprocess.Popen(
        [PY, "-m", "backend.agent", "--run-dir", str(run_dir), "--interval", "0.5"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        bufsize=1,
    )
    print(f"agent-pid {agent.pid}", flush=True)
    assert agent.stdin is not None and agent.stdout is not None
    pending: dict[int, str] = {}
    number = 0
    while True:
        number += 1
        action = rng.random()
        if action < 0.6:
            name = f"{prefix}-{number}"
            pending[number] = name
            request = {"type": "start_job", "id": number, "name": name, "kind": "other", "argv": JOB_ARGV}
        elif action < 0.8:
            request = {"type": "stop_job", "id": number, "name": rng.choice(list(pending.values()) or ["none"]), "grace": 0.2}
        else:
            request = {"type": "list_jobs", "id": number}
        agent.stdin.write(json.dumps(request) + "\n")
        agent.stdin.flush()
        while True:
            line = agent.stdout.readline()
            if not line:
                raise SystemExit("agent exited")
            message = json.loads(line)
            if message.get("type") == "reply" and message.get("id") == number:
                break
        if message.get("ok") and number in pending:
            append_ledger(ledger, pending[number])


def cli_worker(run_dir: Path, ledger: Path, prefix: str, seed: int) -> None:
    rng = random.Random(seed)
    number = 0
    while True:
        number += 1
        name = f"{prefix}-{number}"
        action = rng.random()
        if action < 0.5:
            command = ["job", "start", "--run-dir", str(run_dir), "--name", name, "--", *JOB_ARGV]
        elif action < 0.8:
            command = ["job", "list", "--run-dir", str(run_dir)]
        else:
            command = ["job", "stop", "--run-dir", str(run_dir), "--name", f"{prefix}-{rng.randint(1, number)}", "--grace", "0.2"]
        done = subprocess.run([PY, "-m", "backend", *command], cwd=ROOT, capture_output=True, text=True)
        if action < 0.5 and done.returncode == 0:
            append_ledger(ledger, name)


def chain_worker(run_dir: Path, ledger: Path, prefix: str, seed: int) -> None:
    rng = random.Random(seed)
    host = [PY, "-m", "backend", "--run-dir", str(run_dir)]
    number = 0
    while True:
        number += 1
        train, chain = f"{prefix}-{number}", f"{prefix}-{number}-chain"
        if subprocess.run([*host, "job", "start", "--name", train, "--kind", "train", "--", *JOB_ARGV], cwd=ROOT, capture_output=True).returncode:
            continue
        append_ledger(ledger, train)
        time.sleep(rng.uniform(0.0, 1.0))
        bench = [*host, "stop-and-bench", "--job", train, "--profile", "tiny", "--grace", "2"]
        if subprocess.run([*host, "job", "start", "--name", chain, "--kind", "chain", "--", *bench], cwd=ROOT, capture_output=True).returncode == 0:
            append_ledger(ledger, chain)
            wait_until_finished(host, chain, timeout=60)


def wait_until_finished(host: list[str], name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = subprocess.run([*host, "job", "list", "--json"], cwd=ROOT, capture_output=True, text=True)
        jobs = {job["name"]: job for job in json.loads(listed.stdout or "[]")} if listed.returncode == 0 else {}
        if jobs.get(name, {}).get("state", "running") != "running":
            return
        time.sleep(0.5)


CONSOLE_LAG_S = 3.0  # a record committed this long before a `jobs` event must be in the console's view


def console_worker(run_dir: Path, ledger: Path, prefix: str, seed: int) -> None:
    import asyncio

    asyncio.run(console_loop(run_dir, ledger.with_suffix(".console")))


async def console_loop(run_dir: Path, report: Path) -> None:
    """Fold every event into a ConsoleState, as the app does; compare its jobs with the ledgers of CONSOLE_LAG_S ago."""
    from console.client import AgentClient
    from console.state import ConsoleState
    from console.transport import LocalTransport

    client = AgentClient(LocalTransport(run_dir), timeout=60)
    await client.start(retry=True)
    state = ConsoleState(target="stress")
    waiting: list[tuple[float, set[str]]] = []
    while True:
        event = await client.next_event()
        if not isinstance(event, dict):
            continue
        state.apply(event)
        if event.get("type") != "jobs":
            continue
        now = time.monotonic()
        due, waiting = [w for w in waiting if w[0] <= now], [w for w in waiting if w[0] > now]
        for _, committed in due:
            missing = committed - set(state.jobs)
            if missing:  # finished records beyond the newest ones are archived: listed by sqlite, not sent
                missing -= listed_by_sqlite(run_dir, archived_only=True)
            with open(report, "a") as handle:
                handle.write(json.dumps(sorted(missing)) + "\n")
        waiting.append((now + CONSOLE_LAG_S, read_ledgers(report.parent)))


def console_checks(ledgers: Path) -> tuple[int, list[str]]:
    """(checks made by consoles, names a console did not hold though they were committed CONSOLE_LAG_S before)."""
    checks, missing = 0, []
    for report in ledgers.glob("*.console"):
        for line in report.read_text().splitlines():
            try:
                names = json.loads(line)
            except ValueError:
                continue  # a line cut by the worker's SIGKILL
            checks += 1
            missing.extend(names)
    return checks, missing


WORKERS = {"registry": registry_worker, "agent": agent_worker, "cli": cli_worker, "chain": chain_worker, "console": console_worker}


# ------------------------------------------------------------------ the driver


def listed_by_cli(run_dir: Path) -> set[str] | None:
    done = subprocess.run([PY, "-m", "backend", "job", "list", "--run-dir", str(run_dir), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return None
    return {job["name"] for job in json.loads(done.stdout)}


def listed_by_sqlite(run_dir: Path, archived_only: bool = False) -> set[str]:
    conn = sqlite3.connect(f"file:{run_dir / 'jobs.db'}?mode=ro", uri=True, timeout=30)
    try:
        return {row[0] for row in conn.execute("SELECT name FROM jobs" + (" WHERE archived = 1" if archived_only else ""))}
    finally:
        conn.close()


def integrity(run_dir: Path) -> str:
    conn = sqlite3.connect(run_dir / "jobs.db", timeout=30)
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


class Driver:
    def __init__(self, run_dir: Path, ledgers: Path, seed: int):
        self.run_dir, self.ledgers = run_dir, ledgers
        self.rng = random.Random(seed)
        self.spawned = 0
        self.workers: dict[str, subprocess.Popen] = {}
        self.kinds: dict[str, str] = {}
        self.kills = 0

    def spawn(self, kind: str) -> None:
        self.spawned += 1
        prefix = f"{kind[:2]}{self.spawned}"
        self.kinds[prefix] = kind
        ledger = self.ledgers / f"{prefix}.ledger"
        argv = [
            PY,
            __file__,
            "--worker",
            kind,
            "--run-dir",
            str(self.run_dir),
            "--ledger",
            str(ledger),
            "--prefix",
            prefix,
            "--seed",
            str(self.rng.randrange(1 << 30)),
        ]
        self.workers[prefix] = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def kill_one(self) -> None:
        prefix = self.rng.choice(sorted(self.workers))
        worker = self.workers.pop(prefix)
        victim = worker.pid
        if self.kinds[prefix] == "agent" and self.rng.random() < 0.5 and worker.stdout is not None:
            line = worker.stdout.readline()  # "agent-pid N": kill the agent itself, mid-request
            if line.startswith("agent-pid"):
                victim = int(line.split()[1])
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if victim != worker.pid:
            worker.kill()
        worker.wait()
        self.kills += 1
        self.spawn(self.kinds.pop(prefix))

    def stop_all(self) -> None:
        for worker in self.workers.values():
            worker.kill()
            worker.wait()


def reader_check(run_dir: Path, ledgers: Path) -> tuple[int, int, list[str]]:
    """Names committed before this check that a fresh reader does not see."""
    committed = read_ledgers(ledgers)
    seen_cli = listed_by_cli(run_dir)
    seen_sql = listed_by_sqlite(run_dir)
    if seen_cli is not None:  # job list shows the newest finished records; older ones are archived (FINISHED_KEPT), not gone
        seen_cli |= listed_by_sqlite(run_dir, archived_only=True)
    unseen = sorted(committed - seen_sql) + (sorted(committed - seen_cli) if seen_cli is not None else [])
    return len(committed), 2 if seen_cli is not None else 1, unseen


def run(args: argparse.Namespace) -> dict:
    from backend.jobs.registry import JobRegistry

    base = Path(tempfile.mkdtemp(prefix="registry-stress-"))
    run_dir, ledgers = base / "run", base / "ledgers"
    ledgers.mkdir(parents=True)
    JobRegistry(run_dir).close()
    driver = Driver(run_dir, ledgers, args.seed)
    for index in range(args.workers):
        driver.spawn(KINDS[index % len(KINDS)])
    checks, unseen_total, unseen_examples = 0, 0, []
    started = time.monotonic()
    next_kill = started + args.kill_every
    while time.monotonic() - started < args.seconds:
        time.sleep(0.5)
        if time.monotonic() >= next_kill:
            driver.kill_one()
            next_kill = time.monotonic() + args.kill_every * driver.rng.uniform(0.5, 1.5)
        _, readers, unseen = reader_check(run_dir, ledgers)
        checks += readers
        unseen_total += len(unseen)
        unseen_examples.extend(unseen[:3])
    driver.stop_all()
    console_check_count, console_missing = console_checks(ledgers)
    committed = read_ledgers(ledgers)
    final = (listed_by_cli(run_dir) or set()) | listed_by_sqlite(run_dir, archived_only=True)
    lost = sorted(committed - final)
    verdict = integrity(run_dir)
    registry = JobRegistry(run_dir)
    registry.stop(all_jobs=True, grace=0.5)
    registry.close()
    return {
        "workers": args.workers,
        "seconds": args.seconds,
        "kills": driver.kills,
        "records_committed": len(committed),
        "reader_checks": checks,
        "unseen_by_a_reader": unseen_total,
        "unseen_examples": unseen_examples[:10],
        "console_checks": console_check_count,
        "unseen_by_a_console": len(console_missing),
        "unseen_by_a_console_examples": console_missing[:10],
        "lost_at_end": len(lost),
        "lost_examples": lost[:10],
        "integrity": verdict,
        "integrity_errors": 0 if verdict == "ok" else 1,
        "run_dir": str(run_dir),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--ledger", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        WORKERS[args.worker](args.run_dir, args.ledger, args.prefix, args.seed)
        return 0
    result = run(args)
    keys = ("workers", "seconds", "kills", "records_committed", "reader_checks", "unseen_by_a_reader", "console_checks", "unseen_by_a_console")
    for key in (*keys, "lost_at_end", "integrity", "integrity_errors"):
        print(f"{key:>20}: {result[key]}")
    if result["unseen_examples"] or result["lost_examples"] or result["unseen_by_a_console_examples"]:
        examples = f"unseen {result['unseen_examples']} by a console {result['unseen_by_a_console_examples']} lost {result['lost_examples']}"
        print(f"{'examples':>20}: {examples}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if result["unseen_by_a_reader"] or result["unseen_by_a_console"] or result["lost_at_end"] or result["integrity_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
