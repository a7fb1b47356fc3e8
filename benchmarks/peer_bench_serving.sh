#!/usr/bin/env bash
# SGLang's own benchmark client, `python -m sglang.bench_serving` (SGLang 0.5.23), against the reference server.
#
#   benchmarks/peer_bench_serving.sh [--draft DIR] [--conversations N] [--out FILE] [--keep]
#
# 1. A side venv with SGLang 0.5.23 installed with --no-deps plus only what `import sglang.bench_serving` needs
#    (PEER_SGLANG_VENV, default $EAGLE3_CACHE_DIR or ~/.cache/eagle3-console, then peer-sglang/; reused when its
#    stamp matches and the import works). The import chain reaches torchvision, whose PyPI wheel needs the CUDA
#    build of torch, so the first build downloads about 6 GB from PyPI; later runs reuse it.
# 2. The reference server of the tiny profile on 127.0.0.1 (a free port) with a trained tiny draft: --draft, else
#    the newest cached test run (tests/conftest.py trained_tiny_run), else one trained now (a few CPU minutes).
# 3. bench_serving with every benchmark flag at its default (backend sglang = native /generate, streaming,
#    ignore_eos, temperature 0, request rate inf, 1 warmup request, --num-prompts 1000) and three others:
#    --host 127.0.0.1 and --port (where the server listens) and --dataset-path: the default ShareGPT download
#    needs the internet, so a local ShareGPT-shaped file is written (N two-turn conversations cut from the tiny
#    target's own corpus: human = 128-383 bytes of Python source, gpt = the 32-159 bytes that follow). With fewer
#    conversations than --num-prompts, bench_serving sends each once. It finds the model id with GET /v1/models
#    and loads the tokenizer named by GET /model_info's tokenizer_path with AutoTokenizer (the server writes the
#    byte tokenizer's Hugging Face files: backend/serve/reference/hf_tokenizer.py). HF_HUB_OFFLINE=1: nothing leaves the box.
# 4. The result (bench_serving's own JSON line, with the run's provenance around it) goes to --out, default
#    benchmarks/results/peer_bench_serving_cpu.json, and a short summary is printed. Exit 1 when bench_serving
#    fails or any request did not complete, 2 on a usage error, 3 when the side venv cannot be built (no PyPI).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
CACHE="${EAGLE3_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/eagle3-console}"
VENV="${PEER_SGLANG_VENV:-$CACHE/peer-sglang}"
SGLANG_VERSION=0.5.23
# What `import sglang.bench_serving` imports (found by importing until it stopped failing), at SGLang 0.5.23's pins
# where it pins them.
PACKAGES=(torch==2.14.1 torchvision transformers==5.19.0 tokenizers==0.23.2 aiohttp msgspec orjson requests tqdm
          numpy psutil pybase64 pillow starlette pyzmq IPython datasets apache-tvm-ffi==0.1.11 sentencepiece==0.2.1
          compressed-tensors==0.18.0 gguf)
STAMP="sglang==$SGLANG_VERSION ${PACKAGES[*]}"
DRAFT=""
CONVERSATIONS=40
OUT="$ROOT/benchmarks/results/peer_bench_serving_cpu.json"
KEEP=0
THREADS="${EAGLE3_THREADS:-1}"
while [ $# -gt 0 ]; do
    case "$1" in
        --draft) DRAFT="$2"; shift 2 ;;
        --conversations) CONVERSATIONS="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --keep) KEEP=1; shift ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "peer_bench_serving: unknown argument $1 (see --help); nothing was run" >&2; exit 2 ;;
    esac
done
case "$CONVERSATIONS" in ''|*[!0-9]*|0) echo "peer_bench_serving: --conversations must be a positive integer, got '$CONVERSATIONS'; nothing was run" >&2; exit 2 ;; esac
say() { echo "peer_bench_serving: $*" >&2; }

WORK=$(mktemp -d /tmp/eagle3-peer-bench.XXXXXX)
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 1 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
    if [ "$KEEP" = 0 ]; then rm -rf "$WORK"; else say "kept $WORK"; fi
}
trap cleanup EXIT

# --- 1. the side venv -------------------------------------------------------------------------------
ensure_venv() {
    if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.eagle3-stamp" 2>/dev/null)" = "$STAMP" ] \
        && "$VENV/bin/python" -c "import sglang.bench_serving" >/dev/null 2>&1; then
        say "reusing the side venv $VENV"
        return 0
    fi
    say "building the side venv $VENV (sglang==$SGLANG_VERSION --no-deps + ${#PACKAGES[@]} packages; ~6 GB on a first build)"
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    # pip lists every SGLang requirement left out (GPU kernels, the server's own stack): expected, so kept in a log.
    if ! { "$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-deps "sglang==$SGLANG_VERSION" \
           && "$VENV/bin/python" -m pip install --disable-pip-version-check -q "${PACKAGES[@]}"; } >"$WORK/pip.log" 2>&1; then
        say "pip failed:"; tail -20 "$WORK/pip.log" >&2
        return 1
    fi
    if ! "$VENV/bin/python" -c "import sglang.bench_serving" >"$WORK/import.log" 2>&1; then
        say "the side venv still cannot import sglang.bench_serving:"; tail -5 "$WORK/import.log" >&2
        return 1
    fi
    echo "$STAMP" > "$VENV/.eagle3-stamp"
}
ensure_venv || { say "exit 3: the side venv could not be built"; exit 3; }

# --- 2. a trained tiny draft and the reference server ---------------------------------------------------
if [ -z "$DRAFT" ]; then
    DRAFT=$(ls -td "$CACHE"/test-runs/trained-tiny-*/ 2>/dev/null | while read -r run; do
        [ -f "$run/checkpoints/latest" ] && { echo "${run%/}"; break; }; done || true)
fi
if [ -z "$DRAFT" ]; then
    DRAFT="$CACHE/peer-bench/run"
    if [ ! -f "$DRAFT/checkpoints/latest" ]; then
        say "no trained tiny draft cached: training one (300 steps) into $DRAFT"
        rm -rf "$DRAFT"
        OMP_NUM_THREADS="$THREADS" "$PY" -m backend train --profile tiny --out "$DRAFT" --max-steps 300 >"$WORK/train.log" 2>&1 \
            || { say "training failed:"; tail -20 "$WORK/train.log" >&2; exit 1; }
    fi
fi
[ -e "$DRAFT" ] || { say "--draft $DRAFT does not exist; nothing was run"; exit 2; }
PORT=$("$PY" -c "from backend.serve.http import free_port; print(free_port())")
URL="http://127.0.0.1:$PORT"
say "reference server on $URL (profile tiny, draft $DRAFT, $THREADS torch thread(s))"
OMP_NUM_THREADS="$THREADS" "$PY" -m backend.serve.reference.server --profile tiny --draft "$DRAFT" --port "$PORT" \
    >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 900); do
    kill -0 "$SERVER_PID" 2>/dev/null || { say "the server exited:"; tail -20 "$WORK/server.log" >&2; exit 1; }
    [ "$(curl -s -o /dev/null -w '%{http_code}' "$URL/health_generate")" = 200 ] && break
    sleep 0.2
done
[ "$(curl -s -o /dev/null -w '%{http_code}' "$URL/health_generate")" = 200 ] || { say "the server was not ready in 180 s"; exit 1; }

# --- 3. the local ShareGPT-shaped dataset and bench_serving ---------------------------------------------
TOKENIZER_DIR=$(curl -s "$URL/model_info" | "$PY" -c "import json, sys; print(json.load(sys.stdin)['tokenizer_path'])")
DATASET="$WORK/sharegpt_local.json"
"$PY" - "$CONVERSATIONS" "$DATASET" <<'PYEOF'
import json
import sys
from pathlib import Path

from backend.train.tiny import TRAIN_CORPUS_FILE, VAL_CORPUS_FILE, ensure_tiny_target

target, count, out = ensure_tiny_target(), int(sys.argv[1]), Path(sys.argv[2])
text = (target / TRAIN_CORPUS_FILE).read_bytes() + (target / VAL_CORPUS_FILE).read_bytes()
rows = []
for i in range(count):
    prompt_len, reply_len = 128 + (i * 37) % 256, 32 + (i * 53) % 128
    start = (i * 977) % (len(text) - prompt_len - reply_len)
    human = text[start:start + prompt_len].decode("utf-8", errors="ignore")
    gpt = text[start + prompt_len:start + prompt_len + reply_len].decode("utf-8", errors="ignore")
    rows.append({"id": f"tiny-corpus-{i}", "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]})
out.write_text(json.dumps(rows))
# what bench_serving asks for: each reply's token count (one token per UTF-8 byte) as max_new_tokens, with ignore_eos
Path(f"{out}.output_tokens").write_text(str(sum(len(r["conversations"][1]["value"].encode()) for r in rows)))
PYEOF
ARGS=(--host 127.0.0.1 --port "$PORT" --dataset-path "$DATASET")
say "python -m sglang.bench_serving ${ARGS[*]}  ($CONVERSATIONS conversations; tokenizer from $TOKENIZER_DIR)"
STARTED=$(date +%s)
set +e
(cd "$WORK" && HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VENV/bin/python" -m sglang.bench_serving "${ARGS[@]}") >"$WORK/bench.log" 2>&1
CODE=$?
set -e
if [ "$CODE" != 0 ]; then
    say "bench_serving exited $CODE:"; tail -30 "$WORK/bench.log" >&2
    exit 1
fi

# --- 4. the result ------------------------------------------------------------------------------------
"$PY" - "$WORK" "$OUT" "$DATASET" "$DRAFT" "$CONVERSATIONS" "$VENV" "$URL" "$(( $(date +%s) - STARTED ))" "${ARGS[*]}" "$THREADS" <<'PYEOF'
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

work, out, dataset, draft, count, venv, url, wall, args, threads = sys.argv[1:11]
lines = [line for path in sorted(Path(work).glob("sglang_*.jsonl")) for line in path.read_text().splitlines() if line.strip()]
if not lines:
    sys.exit("peer_bench_serving: bench_serving wrote no result line (see its log)")
result = json.loads(lines[-1])
log = (Path(work) / "bench.log").read_text(errors="replace").splitlines()
table_start = next((i for i, line in enumerate(log) if "Serving Benchmark Result" in line), len(log))
version = subprocess.run([f"{venv}/bin/python", "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                         capture_output=True, text=True).stdout.strip()
document = {
    "what": "SGLang's own bench_serving (python -m sglang.bench_serving) against the reference server",
    "sglang_version": version,
    "command": f"python -m sglang.bench_serving {args}",
    "non_default_flags": {"--host": "127.0.0.1 (the server's address)", "--port": "the server's free port",
                          "--dataset-path": "a local ShareGPT-shaped file (the default one is downloaded from the internet)"},
    "dataset": {"conversations": int(count), "sha256": hashlib.sha256(Path(dataset).read_bytes()).hexdigest(),
                "output_tokens_asked": int(Path(f"{dataset}.output_tokens").read_text()),
                "source": "windows of the tiny target's corpus: human 128-383 bytes of Python source, gpt the 32-159 bytes after it"},
    "server": {"engine": "reference", "profile": "tiny", "draft": draft, "url": url, "torch_threads": int(threads)},
    "machine": {"host": platform.node(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
    "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "wall_s": int(wall),
    "printed_table": log[table_start:],
    "result": result,
}
Path(out).parent.mkdir(parents=True, exist_ok=True)
staging = Path(f"{out}.tmp")
staging.write_text(json.dumps(document, indent=1) + "\n")
os.replace(staging, out)
failed = int(count) - int(result["completed"])
accept = result.get("accept_length")
print(f"bench_serving (sglang {version}) against the reference server: {result['completed']}/{count} requests completed "
      f"in {result['duration']:.1f} s")
print(f"  output {result['total_output_tokens']} tokens, {result['output_throughput']:.1f} tok/s; "
      f"accept length {accept if accept is None else format(accept, '.2f')} (server's avg_spec_accept_length)")
print(f"  TTFT mean {result['mean_ttft_ms']:.0f} ms, ITL mean {result['mean_itl_ms']:.1f} ms, "
      f"TPOT mean {result['mean_tpot_ms']:.1f} ms, E2E median {result['median_e2e_latency_ms']:.0f} ms")
print(f"  saved {out}")
sys.exit(1 if failed else 0)
PYEOF
