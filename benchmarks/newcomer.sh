#!/usr/bin/env bash
# The first ten minutes, timed from a fresh clone: what a newcomer waits for.
#
#   benchmarks/newcomer.sh [--source DIR] [--workdir DIR] [--skip-tests] [--skip-full] [--keep]
#
# In a temp dir it `git clone`s the source checkout (its committed HEAD; default: the checkout holding this
# script) and measures, in order:
#   1. first `./scripts/run` to the first frame (creates .venv and installs with pip: needs the package
#      registry or $PIP_FIND_LINKS wheels), run in a pseudo-terminal; the frame is detected when the app's
#      title is drawn on the alternate screen; then `q`
#   2. the second `./scripts/run` to the first frame (the stamp makes setup skip pip)
#   3. the tiny demo as the console's `n` key runs it (`eagle3-host train --profile tiny`, one process)
#      on an empty cache: target build, draft data, 300 draft steps, each from the job's own log lines,
#      plus the final validation accuracy
#   4. `./scripts/test -m "not slow"` (skip with --skip-tests)
#   5. `./scripts/test` (everything; skip with --skip-full or --skip-tests)
# Everything it writes (clone, venv, caches, run dir) stays under the work dir, which is removed at the
# end unless --keep. Nothing of the user's ~/.cache or ~/.eagle3 is read or written. It is a benchmark,
# not a test: it takes long (the full suite alone is tens of minutes on 2 cores). `uptime` is printed at
# the start and the end, since other work on the machine inflates every number.
set -euo pipefail

SOURCE="$(cd "$(dirname "$0")/.." && pwd)"
WORKDIR=""
SKIP_TESTS=0
SKIP_FULL=0
KEEP=0
FRAME_TIMEOUT=${FRAME_TIMEOUT:-1800}
while [ $# -gt 0 ]; do
    case "$1" in
        --source) SOURCE="$2"; shift 2 ;;
        --workdir) WORKDIR="$2"; shift 2 ;;
        --skip-tests) SKIP_TESTS=1; shift ;;
        --skip-full) SKIP_FULL=1; shift ;;
        --keep) KEEP=1; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "newcomer.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

if [ -z "$WORKDIR" ]; then
    WORKDIR=$(mktemp -d /tmp/eagle3-newcomer.XXXXXX)
else
    mkdir -p "$WORKDIR"
fi
cleanup() { if [ "$KEEP" = 0 ]; then rm -rf "$WORKDIR"; else echo "newcomer: kept $WORKDIR" >&2; fi; }
trap cleanup EXIT

CLONE="$WORKDIR/eagle3-console"
LOGS="$WORKDIR/logs"
mkdir -p "$LOGS"
# Isolated from the user's caches and jobs: a newcomer has none.
export EAGLE3_CACHE_DIR="$WORKDIR/cache"
export EAGLE3_RUN_DIR="$WORKDIR/run-dir"
unset EAGLE3_JOB_DIR EAGLE3_THREADS OMP_NUM_THREADS

declare -a RESULTS
record() { RESULTS+=("$(printf '%-44s %s' "$1" "$2")"); echo "newcomer: $1: $2" >&2; }

echo "newcomer: source $SOURCE ($(git -C "$SOURCE" rev-parse --short HEAD)), work dir $WORKDIR" >&2
echo "newcomer: machine: $(nproc) CPUs; uptime at start: $(uptime)" >&2
START_UPTIME=$(uptime)

started=$(date +%s.%N)
git clone -q "$SOURCE" "$CLONE"
record "git clone" "$(python3 -c "import time; print(f'{time.time() - $started:.1f} s')")"

# Runs ./scripts/run in a pty (120x40) until the app's first frame, then presses q; prints the seconds
# to the first frame and the setup lines that appeared before it.
first_frame() {
    python3 - "$CLONE" "$FRAME_TIMEOUT" "$1" <<'PYEOF'
import os, pty, re, select, signal, struct, sys, fcntl, termios, time

clone, timeout, log_path = sys.argv[1], float(sys.argv[2]), sys.argv[3]
ANSI = re.compile(rb"\x1b\[[0-9;?<>=]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>78]")
pid, fd = pty.fork()
if pid == 0:
    os.chdir(clone)
    os.environ["TERM"] = "xterm-256color"
    os.execvp("./scripts/run", ["./scripts/run"])
fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
started = time.monotonic()
raw = bytearray()
frame = connected = None
deadline = started + timeout
with open(log_path, "wb") as log:
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            raw += chunk
            log.write(chunk)
        alt = raw.find(b"\x1b[?1049h")
        if frame is None and alt >= 0 and b"eagle3-console" in ANSI.sub(b"", bytes(raw[alt:])):
            frame = time.monotonic() - started
        if frame is not None and connected is None and "● connected".encode() in ANSI.sub(b"", bytes(raw[alt:])):
            connected = time.monotonic() - started
        if frame is not None and (connected is not None or time.monotonic() - started > frame + 30):
            break
    if frame is not None:
        os.write(fd, b"q")
        end = time.monotonic() + 20
        while time.monotonic() < end:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    log.write(os.read(fd, 65536))
                except OSError:
                    pass
try:
    os.waitpid(pid, os.WNOHANG)
    os.kill(pid, signal.SIGTERM)
except (ProcessLookupError, ChildProcessError):
    pass
before = raw[: raw.find(b"\x1b[?1049h")] if b"\x1b[?1049h" in raw else raw
setup_lines = [l for l in ANSI.sub(b"", bytes(before)).decode(errors="replace").splitlines() if l.startswith("setup:")]
print(f"{frame:.1f}" if frame is not None else "none", f"{connected:.1f}" if connected is not None else "none", len(setup_lines))
for line in setup_lines:
    print(line, file=sys.stderr)
PYEOF
}

read -r frame connected lines < <(first_frame "$LOGS/first-run.pty")
record "1st ./scripts/run -> first frame" "${frame} s (install included; $lines setup lines shown; banner '● connected' at ${connected} s)"
[ "$frame" = none ] && { echo "newcomer: no first frame; see $LOGS/first-run.pty" >&2; exit 1; }
read -r frame connected lines < <(first_frame "$LOGS/second-run.pty")
record "2nd ./scripts/run -> first frame" "${frame} s ($lines setup lines; banner '● connected' at ${connected} s)"

# The tiny demo, as the `n` key starts it: one process; phases from its log lines' arrival times.
cd "$CLONE"
python3 - "$CLONE/.venv/bin/eagle3-host" "$WORKDIR/demo-run" "$LOGS/demo.log" > "$LOGS/demo.result" <<'PYEOF'
import json, subprocess, sys, time

host, out, log_path = sys.argv[1:4]
marks = {}
started = time.monotonic()
process = subprocess.Popen([host, "train", "--profile", "tiny", "--out", out], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
with open(log_path, "w") as log:
    for line in process.stderr:
        now = time.monotonic() - started
        log.write(f"{now:7.1f} {line}")
        log.flush()
        for key, needle in (("target", "building the tiny target"), ("target_done", "tiny target built in"), ("data", "generating the tiny draft data"),
                            ("vocab", "draft vocab:"), ("train", "training steps"), ("done", "done:")):
            if needle in line and key not in marks:
                marks[key] = now
rc = process.wait()
total = time.monotonic() - started
import resource
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
val = [json.loads(l) for l in open(f"{out}/metrics.jsonl") if '"val"' in l]
first, last = val[0], val[-1]
print(json.dumps({"rc": rc, "total": total, "cpu": usage.ru_utime + usage.ru_stime, "marks": marks, "acc0_first": first["acc"][0], "acc_last": last["acc"], "step": last["step"]}))
PYEOF
read -r demo_line < "$LOGS/demo.result"
python3 - "$demo_line" <<'PYEOF' >> "$LOGS/demo.summary"
import json, sys
r = json.loads(sys.argv[1]); m = r["marks"]
span = lambda a, b: f"{m[b] - m[a]:.1f} s" if a in m and b in m else "n/a"
print(f"tiny demo: target build|{span('target', 'target_done')}")
print(f"tiny demo: draft data|{span('data', 'vocab')}")
print(f"tiny demo: {r['step']} draft steps (incl. validation)|{span('train', 'done')}")
print(f"tiny demo: total (one process, imports included)|{r['total']:.1f} s wall, {r['cpu']:.1f} s CPU (exit {r['rc']}; CPU/wall well under the thread count means other work shared the cores)")
print(f"tiny demo: val acc@0 step 0 -> {r['step']}|{r['acc0_first']:.3f} -> {r['acc_last'][0]:.3f} (chance 1/192 = 0.005); all steps {' '.join(f'{a:.3f}' for a in r['acc_last'])}")
PYEOF
while IFS='|' read -r what value; do record "$what" "$value"; done < "$LOGS/demo.summary"

timed_tests() {
    local label=$1; shift
    local started=$SECONDS rc=0
    ./scripts/test "$@" -q -p no:cacheprovider > "$LOGS/$label.log" 2>&1 || rc=$?
    record "$label" "$((SECONDS - started)) s (exit $rc; $(tail -1 "$LOGS/$label.log"))"
}
if [ "$SKIP_TESTS" = 0 ]; then
    timed_tests 'tests -m "not slow"' -m "not slow"
    [ "$SKIP_FULL" = 0 ] && timed_tests "tests (full suite)"
fi

echo
echo "newcomer.sh: fresh clone of $SOURCE at $(git -C "$CLONE" rev-parse --short HEAD), $(nproc) CPUs"
echo "  uptime at start: $START_UPTIME"
echo "  uptime at end:   $(uptime)"
for line in "${RESULTS[@]}"; do echo "  $line"; done
