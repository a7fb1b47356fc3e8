"""Fuzz the agent's request stream: N hostile or random lines into a real `python -m backend.agent`, every one must be answered.

Lines mix: valid requests with random params (wrong types, NaN/inf, huge or negative numbers, long strings,
unknown names), deep nesting, integers past Python's digit limit, invalid UTF-8, NUL bytes, truncated JSON,
non-objects, over-long lines, and plain noise. Each line gets an id where it can carry one; the run counts
lines answered, error replies by code, agent crashes (restarted and counted) and the slowest answer.
Requests that would act on processes (start/stop/adopt) only ever name jobs that do not exist, so nothing
is started or signalled.

    python benchmarks/fuzz_agent.py --lines 100000 [--seed 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.protocol import Request

KINDS = [v for k, v in vars(Request).items() if k.isupper() and v not in (Request.SHUTDOWN, Request.START_JOB, Request.ADOPT_JOB, Request.WATCH_EXTERNAL)]
PARAMS = [
    "name",
    "offset",
    "grace",
    "lines",
    "stream",
    "points",
    "keys",
    "from",
    "to",
    "log_x",
    "last",
    "val",
    "all",
    "pid",
    "path",
    "data_dir",
    "shape",
    "argv",
    "env",
    "cwd",
    "confirm_pid",
]


def random_value(rng: random.Random, depth: int = 0):
    choice = rng.randrange(14)
    if choice == 0:
        return rng.choice([float("nan"), float("inf"), -float("inf")])
    if choice == 1:
        return rng.choice([0, -1, 1, 2**31, -(2**63), 10**18, 10**300])
    if choice == 2:
        return rng.random() * rng.choice([1, 1e6, -1e6, 1e-9])
    if choice == 3:
        return "".join(rng.choice("abcxyz-_./~\\\"'\n\t\u00e9\u4e2d") for _ in range(rng.randrange(0, 40)))
    if choice == 4:
        return "x" * rng.randrange(1000, 200_000)
    if choice == 5:
        return None
    if choice == 6:
        return rng.choice([True, False])
    if choice == 7 and depth < 4:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    if choice == 8 and depth < 4:
        return {rng.choice(PARAMS): random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))}
    if choice == 9:
        return rng.choice(["no-such-job", "ext:nope", "../etc", "", "train-1"])
    if choice == 10:
        return rng.choice(["train.loss", "val.acc.3", "lr", "weight_norm.fc"])
    return rng.randrange(-1000, 100_000)


def request_line(rng: random.Random, request_id: int) -> bytes:
    message = {"type": rng.choice(KINDS + ["nope", "", "reply"]), "id": request_id}
    for _ in range(rng.randrange(0, 6)):
        message[rng.choice(PARAMS)] = random_value(rng)
    if message.get("name") not in (None, "", "no-such-job", "ext:nope", "../etc"):
        message["name"] = "no-such-job"  # never a real job: nothing can be stopped or started
    return (json.dumps(message, allow_nan=True) + "\n").encode()


def hostile_line(rng: random.Random, request_id: int) -> bytes:
    choice = rng.randrange(9)
    if choice == 0:
        return b"[" * rng.randrange(500, 200_000) + b"\n"
    if choice == 1:
        return b'{"type":"ping","id":' + b"9" * rng.randrange(4300, 20_000) + b"}\n"
    if choice == 2:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))).replace(b"\n", b"") + b"\n"
    if choice == 3:
        return request_line(rng, request_id)[: rng.randrange(1, 20)].rstrip(b"\n") + b"\n"
    if choice == 4:
        return rng.choice([b"42\n", b'"str"\n', b"null\n", b"[]\n", b'{"id": 5}\n', b'{"type": 7}\n'])
    if choice == 5:
        return b'{"type":"ping","id":%d,"x":"\x00\x01"}\n' % request_id
    if choice == 6:
        return b'{"type":"ping","id":%d,"pad":"' % request_id + b"y" * rng.randrange(4 << 20, 6 << 20) + b'"}\n'
    if choice == 7:
        return b'{"type":"ping","id":%d,"a":' % request_id + b'{"a":' * 3000 + b"1" + b"}" * 3001 + b"\n"
    return "\u00e9\u4e2d\n".encode("utf-16")


class Agent:
    def __init__(self, run_dir: Path):
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "backend.agent", "--run-dir", str(run_dir), "--interval", "1"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
        )
        self.replies = 0
        self.codes: Counter = Counter()
        self.internal: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            if message.get("type") == "reply":
                with self.cond:
                    self.replies += 1
                    code = "ok" if message.get("ok") else message["error"]["code"]
                    self.codes[code] += 1
                    if code == "internal":
                        self.internal.append(message["error"]["message"][:300])
                    self.cond.notify_all()

    def send(self, line: bytes) -> None:
        self.proc.stdin.write(line)
        self.proc.stdin.flush()

    def wait_replies(self, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.replies < count:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    return False
                self.cond.wait(min(left, 0.5))
        return True

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    crashes, unanswered, slowest = 0, 0, 0.0
    failures: list[str] = []
    codes: Counter = Counter()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        agent = Agent(Path(tmp) / "run")
        sent_total = 0
        for i in range(args.lines):
            line = hostile_line(rng, i) if rng.random() < 0.3 else request_line(rng, i)
            sent_at = time.monotonic()
            try:
                agent.send(line)
            except BrokenPipeError:
                pass
            if not line.strip():
                continue  # a blank line is no request: the agent skips it without a reply
            sent_total += 1
            if not agent.wait_replies(sent_total, timeout=60):
                if agent.proc.poll() is not None:
                    crashes += 1
                else:
                    unanswered += 1
                failures.append(f"line {i} {'crashed the agent' if agent.proc.poll() is not None else 'got no reply'}: {line[:300]!r}")
                failures += agent.internal
                codes.update(agent.codes)
                agent.close()
                agent = Agent(Path(tmp) / "run")
                sent_total = 0
                continue
            slowest = max(slowest, time.monotonic() - sent_at)
        codes.update(agent.codes)
        failures += agent.internal
        alive = agent.proc.poll() is None
        agent.close()
    result = {
        "lines": args.lines,
        "seed": args.seed,
        "seconds": round(time.monotonic() - started, 1),
        "crashes": crashes,
        "unanswered": unanswered,
        "answered": sum(codes.values()),
        "replies_by_code": dict(codes),
        "slowest_answer_s": round(slowest, 3),
        "agent_alive_at_end": alive,
        "failures": failures[:20],
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if crashes == 0 and unanswered == 0 and not codes.get("internal") else 1


if __name__ == "__main__":
    sys.exit(main())
