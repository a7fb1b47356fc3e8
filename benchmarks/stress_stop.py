"""Stress the job stop: randomized adversarial trees beside same-name decoys and recycled-PID stale records.

Each trial starts one job whose leader forks a random tree (plain children, setsid grandchildren, double
forks, SIGTERM trappers and ignorers, re-forkers that keep forking setsid children, and sometimes a stopper
that runs `eagle3-host job stop` on its own job from inside the group). Beside it run decoys: processes with
the very same command line that are not jobs, and processes whose PIDs sit in stale job records with another
start time (a recycled PID). Then the job is stopped with the real CLI, and the trial counts

  foreign signalled    decoys that got any signal (a logged catchable one, or dead, or stopped)
  owned left alive     processes carrying the trial's marker environment still alive after the stop
  stale signalled      stale-record processes that got any signal
  wrong exit codes     a stop that exited 0 with an owned process alive or after an escape (its watcher killed: the
                       verdict "unverified"), or non-zero with neither
  escape errors        (trials with an escaper: a child of the leader that kills the watcher, double-forks to init,
                       leaves the job's group or session and cgroup and execs without the job's environment)
                       a "session" escapee left alive (the live leader's session proves it), a "traced" one (stdout
                       on the job's log, own session) not named, or any escapee signalled and left alive. Traced and
                       "untraced" escapees are beyond proof: they must never be signalled.

Owned processes are counted through an environment marker the stop itself never looks at. Half the trials use
the job cgroup (where the host offers a writable cgroup v2) and half the SIGSTOP walk. Exit 1 if any count is
non-zero. Usage: python benchmarks/stress_stop.py --trials 200 [--seed 1] [--mode mixed|cgroup|walk]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.host import procs
from backend.jobs.registry import JobRegistry

PY = sys.executable
MARK = "STRESS_TRIAL"
DECOY = "STRESS_DECOY"
CLI_TIMEOUT_S = 90

# The program of every process in a job tree and of every decoy: one argv, so decoys share the job's command line.
NODE = r"""
import json, os, signal, subprocess, sys, time

def log_signals(path):
    def note(signum, _frame):
        with open(path, "a") as handle:
            handle.write(f"{signum}\n")
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT):
        signal.signal(signum, note)

def sleep_forever():
    while True:
        time.sleep(3600)

def ancestors():
    chain, pid = [], os.getpid()
    while pid > 1:
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        chain.append(pid)
    return chain

def spawn(node):
    if os.fork():
        return
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if node.get("setsid"):
            os.setsid()
        if node.get("double") and os.fork():
            os._exit(0)
        run(node)
    finally:
        os._exit(0)

def refork(node):
    forks = 0
    while node["forks"] is None or forks < node["forks"]:
        if os.fork() == 0:
            os.setsid()
            if node["life"] is None:
                sleep_forever()
            time.sleep(node["life"])
            os._exit(0)
        forks += 1
        time.sleep(node["every"])

def stop_self(node):
    time.sleep(node["after"])
    argv = [sys.executable, "-m", "backend", "job", "stop", "--run-dir", node["run_dir"], "--name", node["job"], "--grace", str(node["grace"]), "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=90)
    report = {"rc": done.returncode, "out": done.stdout, "err": done.stderr, "pid": os.getpid(), "chain": ancestors()}
    with open(node["report"] + ".tmp", "w") as handle:
        json.dump(report, handle)
    os.rename(node["report"] + ".tmp", node["report"])

ESCAPEE = "import signal, sys, time\n" \
    "def note(signum, _):\n    open(sys.argv[1], 'a').write(f'{signum}\\n')\n" \
    "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCONT, signal.SIGUSR1):\n    signal.signal(s, note)\n" \
    "while True:\n    time.sleep(3600)\n"

def stat_field(pid, index):
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[index]

def gone(pid):
    try:
        return stat_field(pid, 0) in "ZX"
    except OSError:
        return True

def escape(node):
    # kill the watcher (the leader's parent), double-fork to init, leave the group (or the session too), leave the
    # job's cgroup, keep stdio on the job's log only when "traced", exec with no EAGLE3_* variables and no trial marker
    watcher = int(stat_field(os.getppid(), 1))
    os.kill(watcher, signal.SIGKILL)
    while not gone(watcher):
        time.sleep(0.005)
    middle = os.getpid()
    if os.fork():
        os._exit(0)
    while os.getppid() == middle:
        time.sleep(0.005)
    os.setpgid(0, 0) if node["escape"] == "session" else os.setsid()
    try:
        with open(node["cgroup_procs"], "w") as handle:
            handle.write(str(os.getpid()))
    except OSError:
        pass
    if node["escape"] != "traced":
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_") and k != "STRESS_TRIAL"}
    env["STRESS_ESCAPEE"] = node["marker"] + ":" + node["escape"]
    with open(node["ready"] + ".tmp", "w") as handle:
        handle.write(str(os.getpid()))
    os.rename(node["ready"] + ".tmp", node["ready"])
    os.execve(sys.executable, [sys.executable, "-S", "-c", ESCAPEE, node["log"]], env)

def run(node):
    kind = node["kind"]
    if kind == "escaper":
        escape(node)
    if kind in ("ignorer", "reforker"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif kind == "trapper":
        signal.signal(signal.SIGTERM, lambda *_: (time.sleep(node["delay"]), os._exit(0)))
    for child in node.get("children", []):
        spawn(child)
    if kind == "reforker":
        refork(node)
    elif kind == "stopper":
        stop_self(node)
    sleep_forever()

if os.environ.get("STRESS_DECOY"):
    log_signals(os.environ["STRESS_DECOY"])
    sleep_forever()
run(json.loads(sys.argv[1]))
"""


@dataclass
class Totals:
    trials: int = 0
    by_mode: dict[str, int] = field(default_factory=dict)
    job_procs: int = 0
    decoys: int = 0
    stale_records: int = 0
    inside_stops: int = 0
    foreign_signalled: int = 0
    owned_alive: int = 0
    stale_signalled: int = 0
    wrong_exit: int = 0
    escapers: dict[str, int] = field(default_factory=dict)  # variant -> escapees started
    escapes_caught: int = 0  # killed because something still proved them the job's (the session variant must be)
    escapes_named: int = 0  # beyond proof but traced: named, not signalled (the traced variant must be)
    escapes_unnamed: int = 0  # beyond proof and untraced: alive, unsignalled, unnamed (nothing can find them)
    escape_errors: int = 0  # a session escapee left alive, a traced one not named, or any escapee signalled yet alive
    slowest_s: float = 0.0

    @property
    def failures(self) -> int:
        return self.foreign_signalled + self.owned_alive + self.stale_signalled + self.wrong_exit + self.escape_errors


# ---------------------------------------------------------------- random trees


def random_node(rng: random.Random, depth: int) -> dict:
    kind = rng.choices(["sleeper", "trapper", "ignorer", "reforker"], weights=[3, 2, 3, 1])[0]
    node: dict = {"kind": kind, "setsid": rng.random() < 0.35, "double": rng.random() < 0.25}
    if kind == "trapper":
        node["delay"] = rng.choice([0.0, 0.05, 0.3, 5.0])  # 5 s: outlives any grace here, so it must be killed
    if kind == "reforker" and rng.random() < 0.5:  # forks a fixed number of immortal setsid children
        node.update(forks=rng.randint(5, 25), every=rng.uniform(0.005, 0.05), life=None)
    elif kind == "reforker":  # forks forever, every few ms, children that live a while: the population keeps changing
        node.update(forks=None, every=rng.uniform(0.002, 0.02), life=rng.uniform(0.2, 1.5))
    if depth < 2:
        node["children"] = [random_node(rng, depth + 1) for _ in range(rng.randint(0, 3 - depth))]
    return node


def add_escaper(rng: random.Random, tree: dict, run_dir: Path, marker: str) -> dict:
    """A child of the leader that escapes: "session" stays in the leader's session (provable), "traced" keeps its
    stdio on the job's log (traced, not provable), "untraced" leaves nothing that ties it to the job."""
    mount, own = procs.cgroup2_mount(), procs.cgroup_of(os.getpid())
    cgroup_procs = str(mount.joinpath(*[p for p in own.split("/") if p], "cgroup.procs")) if mount and own else "/nonexistent"
    node = {
        "kind": "escaper",
        "escape": rng.choice(["session", "traced", "untraced"]),
        "setsid": False,
        "double": False,
        "marker": marker,
        "ready": str(run_dir / "escapee.pid"),
        "log": str(run_dir / "escapee.signals"),
        "cgroup_procs": cgroup_procs,
    }
    tree.setdefault("children", []).append(node)
    return node


def escapees(marker: str) -> dict[int, str]:
    """Live escapees of this trial: pid -> variant."""
    found = {}
    for pid in procs.list_pids():
        value = procs.environ_value(pid, "STRESS_ESCAPEE") if procs.is_alive(pid) else None
        if value and value.startswith(marker + ":"):
            found[pid] = value.rsplit(":", 1)[1]
    return found


def add_stopper(rng: random.Random, tree: dict, run_dir: Path, job: str, report: Path) -> None:
    """A stopper somewhere in the leader's group (never under a setsid node): it stops its own job."""
    stopper = {
        "kind": "stopper",
        "run_dir": str(run_dir),
        "job": job,
        "report": str(report),
        "grace": round(rng.uniform(0.0, 0.8), 2),
        "after": rng.uniform(0.2, 0.6),
    }
    parent = tree
    for child in tree.get("children", []):
        if not child.get("setsid") and not child.get("double") and child["kind"] != "reforker" and rng.random() < 0.5:
            parent = child
            break
    parent.setdefault("children", []).append(stopper)


# ---------------------------------------------------------------- processes


def marked(marker: str) -> list[int]:
    """Live processes started with this trial's marker, minus watchers (they exit on their own once the tree is gone)."""
    found = []
    for pid in procs.list_pids():
        if procs.is_alive(pid) and procs.environ_value(pid, MARK) == marker and "backend.jobs.watcher" not in procs.cmdline(pid):
            found.append(pid)
    return found


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def clean_up(marker: str) -> None:
    """Whatever a failed stop left, including a re-forker's newborns (a few rounds)."""
    for _ in range(50):
        left = marked(marker)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        kill_all(left)


def start_decoy(argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, DECOY: str(log)}
    env.pop(MARK, None)
    return subprocess.Popen(argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL)


def decoy_signalled(proc: subprocess.Popen, log: Path, start: int) -> bool:
    stat = procs.read_stat(proc.pid)
    hit = proc.poll() is not None or stat is None or stat.start_time != start or stat.stopped
    return hit or (log.exists() and log.read_text().strip() != "")


def insert_stale_record(run_dir: Path, name: str, proc: subprocess.Popen, argv: list[str]) -> None:
    """A record whose PID now belongs to another program: the decoy, with a start time that is not the recorded one."""
    stat = procs.read_stat(proc.pid)
    job_dir = run_dir / "jobs" / name
    job_dir.mkdir(parents=True)
    with sqlite3.connect(run_dir / "jobs.db", timeout=30) as db:
        db.execute(
            "INSERT INTO jobs (name, kind, state, pid, pgid, start_time_ticks, argv, job_dir, stdout_path, stderr_path, started_at, token)"
            " VALUES (?, 'train', 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                name,
                proc.pid,
                stat.pgid,
                max(1, stat.start_time - 1000),
                json.dumps(argv),
                str(job_dir),
                str(job_dir / "stdout.log"),
                str(job_dir / "stderr.log"),
                time.time() - 3600,
                secrets.token_hex(16),
            ),
        )


def cli_stop(run_dir: Path, args: list[str], env: dict) -> subprocess.CompletedProcess:
    argv = [PY, "-m", "backend", "job", "stop", "--run-dir", str(run_dir), *args, "--json"]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


def survivors_in(result: dict | subprocess.CompletedProcess) -> set[int]:
    out = result["out"] if isinstance(result, dict) else result.stdout
    try:
        return {v["pid"] for v in json.loads(out)["verdicts"] if v["outcome"] == "survived"}
    except (json.JSONDecodeError, KeyError):
        return set()


# ---------------------------------------------------------------- one trial


def run_trial(index: int, rng: random.Random, mode: str, base: Path, totals: Totals, verbose: bool) -> None:
    began = time.monotonic()
    run_dir = base / f"trial-{index}"
    marker = f"{os.getpid()}-{index}-{secrets.token_hex(4)}"
    env = {**os.environ, "EAGLE3_CGROUPS": "1" if mode == "cgroup" else "0", "PYTHONPATH": str(ROOT)}
    env.pop(DECOY, None)
    tree = random_node(rng, 0)
    tree.update(setsid=False, double=False)  # the leader itself
    report = run_dir / "inside-stop.json"
    inside = rng.random() < 0.25
    if inside:
        if tree["kind"] == "reforker":  # the stopper's ancestors are never signalled: one that keeps forking could never be stopped from inside
            tree["kind"] = "ignorer"
        add_stopper(rng, tree, run_dir, "job", report)
    escaper = add_escaper(rng, tree, run_dir, marker) if rng.random() < 0.3 and not inside else None
    argv = [PY, "-S", "-c", NODE, json.dumps(tree)]
    decoys: list[tuple[subprocess.Popen, Path, int, str]] = []
    registry = None
    counts = dict(foreign=0, owned=0, stale=0, wrong=0, escape=0)
    try:
        registry = JobRegistry(run_dir)
        for role in ["foreign"] * rng.randint(1, 3) + ["stale"] * rng.randint(1, 2):
            log = run_dir / f"decoy-{len(decoys)}.log"
            proc = start_decoy(argv, log)  # the same command line as every process of the job
            decoys.append((proc, log, 0, role))
        time.sleep(0.05)
        decoys = [(p, log, procs.start_time(p.pid) or 0, role) for p, log, _, role in decoys]
        for n, (proc, _, _, role) in enumerate(decoys):
            if role == "stale":
                insert_stale_record(run_dir, f"stale{n}", proc, argv)
        old_env = dict(os.environ)
        os.environ.update({MARK: marker, "EAGLE3_CGROUPS": env["EAGLE3_CGROUPS"]})
        try:
            registry.start_job("job", "train", argv, cwd=str(ROOT))
        finally:
            os.environ.clear()
            os.environ.update(old_env)
        time.sleep(rng.uniform(0.1, 0.8))  # stop at a random moment of the tree's growth
        escaped = wait_for_escapee(escaper, marker) if escaper else {}
        if inside:
            counts["owned"] += check_inside_stop(report, marker, counts)
        seen = len(marked(marker))
        stopped = cli_stop(run_dir, rng.choice([["--name", "job"], ["--all"]]) + ["--grace", f"{rng.uniform(0, 1):.2f}"], env)
        left = marked(marker)
        counts["owned"] += len(left)
        named = check_escapees(escaper, escaped, survivors_in(stopped), totals) if escaper else set()
        counts["escape"] = 0 if named is not None else 1
        counts["wrong"] += int((stopped.returncode != 0) != bool(left or named or escaper))  # a killed watcher: "unverified", exit 1
        if stopped.returncode not in (0, 1) or (left and verbose):
            print(f"  trial {index}: stop exit {stopped.returncode}, left {left}: {stopped.stderr[-500:]}", flush=True)
        totals.job_procs += seen
    finally:
        for proc, log, start, role in decoys:
            hit = decoy_signalled(proc, log, start)
            counts["foreign" if role == "foreign" else "stale"] += int(hit)
            proc.kill()
            proc.wait()
        if registry is not None:
            registry.close()
        clean_up(marker)
        kill_all(list(escapees(marker)))
        shutil.rmtree(run_dir, ignore_errors=True)
    elapsed = time.monotonic() - began
    tally(totals, mode, inside, decoys, counts, elapsed)
    if verbose or any(counts.values()):
        print(
            f"trial {index:4d} [{mode:6s}] procs {seen:3d} decoys {len(decoys)} inside-stop {'yes' if inside else 'no '}: "
            f"foreign {counts['foreign']}, owned alive {counts['owned']}, stale {counts['stale']}, wrong exit {counts['wrong']},"
            f" escape errors {counts['escape']} ({elapsed:.1f} s)",
            flush=True,
        )


def wait_for_escapee(escaper: dict, marker: str) -> dict[int, str]:
    """The escapee once it has exec'd (so the stop meets the finished escape, not one half done)."""
    ready = Path(escaper["ready"])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        found = escapees(marker)
        if ready.exists() and found:
            return found
        time.sleep(0.02)
    return {}


def check_escapees(escaper: dict, escaped: dict[int, str], survivors: set[int], totals: Totals) -> set[int] | None:
    """Tally what the stop did with the escapee; returns the pids it rightly named (None on an escape error)."""
    variant = escaper["escape"]
    totals.escapers[variant] = totals.escapers.get(variant, 0) + 1
    log = Path(escaper["log"])
    named: set[int] = set()
    for pid in escaped:
        alive = procs.is_alive(pid)
        signalled_alive = alive and ((log.exists() and log.read_text().strip() != "") or bool(procs.read_stat(pid) and procs.read_stat(pid).stopped))
        if signalled_alive or (variant == "session" and alive) or (variant == "traced" and alive and pid not in survivors):
            print(f"  escapee {pid} ({variant}): alive {alive}, signalled {signalled_alive}, named {pid in survivors}", flush=True)
            return None
        if not alive:
            totals.escapes_caught += 1
        elif pid in survivors:
            totals.escapes_named += 1
            named.add(pid)
        else:
            totals.escapes_unnamed += 1
    if not escaped:
        print(f"  the {variant} escapee never reached its exec", flush=True)
        return None
    return named


def check_inside_stop(report: Path, marker: str, counts: dict) -> int:
    """The stopper inside the job: only it and its ancestors may live on, and it must name them and exit 1."""
    deadline = time.monotonic() + CLI_TIMEOUT_S
    while not report.exists():
        if time.monotonic() > deadline:
            counts["wrong"] += 1
            return 0
        time.sleep(0.05)
    result = json.loads(report.read_text())
    chain = {result["pid"], *result["chain"]}
    left = set(marked(marker)) - chain
    named = survivors_in(result)
    alive_chain = {pid for pid in chain if pid in marked(marker)}
    counts["wrong"] += int(result["rc"] == 0 or not alive_chain <= named | {result["pid"]})
    for pid in left:
        stat = procs.read_stat(pid)
        print(
            f"  left after the inside stop: {stat} {procs.cmdline(pid)[:60]!r}; stopper {result['pid']} chain {result['chain'][:4]};"
            f" stop said: {result['out'][-800:]} {result['err'][-300:]}",
            flush=True,
        )
    return len(left)


def tally(totals: Totals, mode: str, inside: bool, decoys: list, counts: dict, elapsed: float) -> None:
    totals.trials += 1
    totals.by_mode[mode] = totals.by_mode.get(mode, 0) + 1
    totals.decoys += sum(1 for *_, role in decoys if role == "foreign")
    totals.stale_records += sum(1 for *_, role in decoys if role == "stale")
    totals.inside_stops += int(inside)
    totals.foreign_signalled += counts["foreign"]
    totals.owned_alive += counts["owned"]
    totals.stale_signalled += counts["stale"]
    totals.wrong_exit += counts["wrong"]
    totals.escape_errors += counts["escape"]
    totals.slowest_s = max(totals.slowest_s, elapsed)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random, printed)")
    parser.add_argument("--mode", choices=["mixed", "cgroup", "walk"], default="mixed")
    parser.add_argument("--budget-s", type=float, default=0, help="stop starting trials after this many seconds (0: no limit)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    cgroups = procs.job_cgroup_base() is not None and procs.create_job_cgroup(f"probe-{os.getpid()}") is not None
    if cgroups:
        procs.remove_cgroup(procs.job_cgroup_base() / f"{procs.CGROUP_PREFIX}probe-{os.getpid()}")
    print(
        f"stress_stop: {args.trials} trials, seed {seed}, mode {args.mode}, job cgroups {'available' if cgroups else 'NOT available (both modes walk)'}",
        flush=True,
    )
    totals = Totals()
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stress-stop-") as tmp:
        for index in range(args.trials):
            if args.budget_s and time.monotonic() - began > args.budget_s:
                print(f"budget of {args.budget_s:g} s spent after {index} trials", flush=True)
                break
            mode = args.mode if args.mode != "mixed" else ("cgroup" if index % 2 == 0 else "walk")
            run_trial(index, rng, mode, Path(tmp), totals, args.verbose)
            if (index + 1) % 25 == 0:
                print(f"  {index + 1} trials, {time.monotonic() - began:.0f} s, failures so far {totals.failures}", flush=True)
    modes = ", ".join(f"{mode} {count}" for mode, count in sorted(totals.by_mode.items()))
    print(
        f"{totals.trials} trials ({modes}) in {time.monotonic() - began:.0f} s (slowest {totals.slowest_s:.1f} s): "
        f"{totals.job_procs} job processes seen at stop time, {totals.decoys} same-name decoys, {totals.stale_records} recycled-PID stale records, "
        f"{totals.inside_stops} stops from inside the job"
    )
    print(
        f"foreign signalled {totals.foreign_signalled}, owned left alive {totals.owned_alive}, stale signalled {totals.stale_signalled}"
        f" (wrong exit codes {totals.wrong_exit})"
    )
    variants = ", ".join(f"{variant} {count}" for variant, count in sorted(totals.escapers.items())) or "none"
    print(
        f"escapees ({variants}): caught by proof {totals.escapes_caught}, named not signalled {totals.escapes_named},"
        f" untraced {totals.escapes_unnamed} (escape errors {totals.escape_errors})"
    )
    return 1 if totals.failures else 0


if __name__ == "__main__":
    sys.exit(main())
