"""Stress jobs.db with many processes at once: agents, CLIs and in-process registries on one run dir, random SIGKILLs.

Workers of three kinds share one run dir:
  registry  a process with a JobRegistry used from two threads (starts, lists, stops of its own jobs)
  agent     a real `python -m backend.agent` driven over its stdin/stdout protocol (start_job, stop_job, list)
  cli       the real `eagle3-host job start/list/stop` command lines
Each worker appends the name of every job whose start was committed (the call returned, or the reply said ok) to
its own ledger, after the commit. Readers (`eagle3-host job list --json` in a fresh process, and a plain sqlite3
read) read every ledger first and then the registry: every name in a ledger read before must be listed. Every few
seconds a random worker (or the agent behind one) is SIGKILLed and replaced. At the end a fresh process lists the
registry once more and PRAGMA integrity_check runs.

Prints records committed, checks by readers, records unseen by a reader (goal 0), records lost at the end (goal 0),
integrity errors (goal 0), kills. Exit 1 if any goal is missed.
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
KINDS = ("registry", "agent", "cli")
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


WORKERS = {"registry": registry_worker, "agent": agent_worker, "cli": cli_worker}


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
        self.kills = 0

    def spawn(self, kind: str) -> None:
        self.spawned += 1
        prefix = f"{kind[0]}{self.spawned}"
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
        if prefix.startswith("a") and self.rng.random() < 0.5 and worker.stdout is not None:
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
        self.spawn(KINDS[{"r": 0, "a": 1, "c": 2}[prefix[0]]])

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
    for key in ("workers", "seconds", "kills", "records_committed", "reader_checks", "unseen_by_a_reader", "lost_at_end", "integrity", "integrity_errors"):
        print(f"{key:>20}: {result[key]}")
    if result["unseen_examples"] or result["lost_examples"]:
        print(f"{'examples':>20}: unseen {result['unseen_examples']} lost {result['lost_examples']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if result["unseen_by_a_reader"] or result["lost_at_end"] or result["integrity_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
