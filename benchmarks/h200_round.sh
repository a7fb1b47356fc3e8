#!/usr/bin/env bash
# One H200 call for the real model: SmolLM2-135M from its wheel's GGUF, a regenerated ShareGPT subset, our draft and
# SpecForge v0.3.0's trained on the same data for the same wall-clock budget, both served by the static-cache CUDA-graph
# decoder on held-out ShareGPT and HumanEval (with the transformers anchors), the SIGTERM-to-checkpoint latency, real vs
# fixed-length step time, and the agent's cold index on the host's cores (in the background while the GPU regenerates).
#
#   DEV=/tmp/dev OUT=<dir> [DEADLINE_S=400] [TRAIN_S=60] [SF_S=60] [REGEN_LIMIT=768] bash benchmarks/h200_round.sh
#   CPU dry run: DEVICE=cpu TRAIN_S=5 SF_S=5 REGEN_LIMIT=4 REGEN_NEW=8 NUM_PROMPTS=1 MAX_NEW=8 COLD_MIB=8 REAL_STEPS=1 REAL_WARMUP=1 DEADLINE_S=3000
#
# $DEV must hold smol.part.aa/.ab (the GGUF split in two: real-model.md), sgdev.tgz (a `data prepare` dir) and
# humaneval.jsonl; .devb/whl the wheels the image lacks, .devb/specforge-v0.3.0 SpecForge's source export.
# Stages run in priority order; one that would end past DEADLINE_S is skipped and says so. Every stage's wall time and
# exit code land in $OUT/summary.json; at most 8 files come back (the device tool's limit).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?an output dir}" "${DEV:=/tmp/dev}"
DEADLINE_S=${DEADLINE_S:-400} TRAIN_S=${TRAIN_S:-60} SF_S=${SF_S:-60} REGEN_LIMIT=${REGEN_LIMIT:-768} DEVICE=${DEVICE:-cuda}
NUM_PROMPTS=${NUM_PROMPTS:-10} MAX_NEW=${MAX_NEW:-128} REGEN_NEW=${REGEN_NEW:-160} COLD_MIB=${COLD_MIB:-1024}
REAL_STEPS=${REAL_STEPS:-60} REAL_WARMUP=${REAL_WARMUP:-30} VAL_BATCHES=${VAL_BATCHES:-16} REGEN_PROMPT=${REGEN_PROMPT:-384}
REGEN_BATCH=${REGEN_BATCH:-256}
START=$(date +%s)
export PYTHONUNBUFFERED=1 EAGLE3_CACHE_DIR=$DEV/cache
PY=python3
HOST=("$PY" -m backend --run-dir "$DEV/run")
LOG=$OUT/log.txt TIMES=$DEV/times.tsv
: >"$TIMES"
elapsed() { echo $(($(date +%s) - START)); }
note() { echo "== $* (at $(elapsed) s)" | tee -a "$LOG"; }
stage() { # stage NAME SECONDS_NEEDED CMD...: run unless it would pass the deadline; time and exit code to times.tsv
    local name=$1 need=$2 t0 rc
    shift 2
    if [ $(($(elapsed) + need)) -gt "$DEADLINE_S" ]; then
        note "skip $name: needs ${need} s, $((DEADLINE_S - $(elapsed))) s left"
        printf '%s\t-1\tskipped\n' "$name" >>"$TIMES"
        return 1
    fi
    note "$name: $*"
    t0=$(date +%s%N)
    if declare -F "$1" >/dev/null; then
        "$@" >>"$LOG" 2>&1 # a shell function bounds its own time
    else
        timeout --signal=TERM --kill-after=15 "$need" "$@" >>"$LOG" 2>&1
    fi
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$((($(date +%s%N) - t0) / 1000000))" "$rc" >>"$TIMES"
    [ "$rc" -eq 0 ] || note "$name exited $rc"
    return "$rc"
}

note "setup"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devb/whl/*.whl >>"$LOG" 2>&1
export PYTHONPATH=/tmp/site
cat "$DEV/smol.part.aa" "$DEV/smol.part.ab" >"$DEV/smol.gguf" && tar xzf "$DEV/sgdev.tgz" -C "$DEV"
nproc >"$DEV/nproc"
(timeout 200 $PY benchmarks/bench_cold_index.py --size-mib "$COLD_MIB" --dir "$DEV/cold" --out "$DEV/cold_index.json" >"$DEV/cold.log" 2>&1) &
COLD=$!
stage prepare 90 "${HOST[@]}" target prepare smollm2-135m-instruct --gguf "$DEV/smol.gguf"
MODEL_DIR=$("${HOST[@]}" target prepare smollm2-135m-instruct 2>/dev/null | tail -1)
DATA=$DEV/sgdev
if stage regenerate 75 "${HOST[@]}" data regenerate --profile smollm2-135m --input "$DEV/sgdev" --out "$DEV/regen" --limit "$REGEN_LIMIT" \
    --val-limit 32 --batch-size "$REGEN_BATCH" --max-new-tokens "$REGEN_NEW" --max-prompt-tokens "$REGEN_PROMPT" --device "$DEVICE"; then
    DATA=$DEV/regen
fi
note "training data: $DATA"

train_ours() { # setup, then TRAIN_S seconds of steps, then SIGTERM: the seconds from SIGTERM to a complete checkpoint
    setsid "${HOST[@]}" train --profile smollm2-135m --conversations "$DATA" --out "$DEV/ours" --max-steps 1000000 --batch-size 4 \
        --eval-interval 250 --max-val-batches "$VAL_BATCHES" --save-interval 1000000 --log-interval 10 --device "$DEVICE" >"$DEV/ours.log" 2>&1 &
    local pid=$! t_start
    t_start=$(date +%s%N)
    until grep -q '"split": *"val"' "$DEV/ours/metrics.jsonl" 2>/dev/null || ! kill -0 "$pid" 2>/dev/null || [ $(($(date +%s) - START)) -gt "$DEADLINE_S" ]; do
        sleep 0.2
    done
    echo "step-0 validation record after $((($(date +%s%N) - t_start) / 1000000)) ms (setup and the step-0 validation)" | tee "$DEV/ours_setup"
    sleep "$TRAIN_S"
    local t0 rc
    t0=$(date +%s%N)
    kill -TERM -- "-$pid"
    wait "$pid"
    rc=$?
    echo "sigterm to exit: $((($(date +%s%N) - t0) / 1000000)) ms, exit $rc" | tee "$DEV/ours_sigterm"
    tail -5 "$DEV/ours.log"
    "${HOST[@]}" export "$DEV/ours" "$DEV/ours_draft"
}
stage train_ours $((TRAIN_S + 150)) train_ours
stage train_specforge $((SF_S + 120)) "$PY" benchmarks/peer_specforge_train.py --data "$DATA" --target-dir "$MODEL_DIR" \
    --specforge-src .devb/specforge-v0.3.0 --seconds "$SF_S" --device "$DEVICE" --attention-backend sdpa --out "$DEV/sf"
DECODE=(--device "$DEVICE" --prompts "$DEV/sgdev/eval.jsonl" --prompts "$DEV/humaneval.jsonl" --num-prompts "$NUM_PROMPTS" --max-new-tokens "$MAX_NEW" --num-steps 3 7)
[ -d "$DEV/ours_draft" ] && stage decode_ours 150 "$PY" benchmarks/bench_decode_speed.py "${DECODE[@]}" --draft "$DEV/ours_draft" \
    --anchor-prompts 1 --out "$OUT/decode_ours.json"
[ -d "$DEV/sf/draft" ] && stage decode_specforge 90 "$PY" benchmarks/bench_decode_speed.py "${DECODE[@]}" --draft "$DEV/sf/draft" \
    --no-hf --no-fp32-check --out "$OUT/decode_specforge.json"
stage real_steps 100 "$PY" benchmarks/bench_real_steps.py --data "$DATA" --device "$DEVICE" --steps "$REAL_STEPS" --warmup "$REAL_WARMUP" --out "$OUT/real_steps.json"
wait "$COLD"

cp "$DEV/ours/metrics.jsonl" "$OUT/ours_metrics.jsonl" 2>/dev/null
cp "$DEV/sf/metrics.jsonl" "$OUT/specforge_metrics.jsonl" 2>/dev/null
$PY - "$DEV" "$OUT" <<'EOF'
import json, sys
from pathlib import Path
dev, out = Path(sys.argv[1]), Path(sys.argv[2])
def read(path):
    p = dev / path
    if not p.exists():
        return None
    text = p.read_text()
    try:
        return json.loads(text)
    except ValueError:
        return text.strip()
stages = {}
for line in (dev / "times.tsv").read_text().splitlines():
    name, ms, rc = line.split("\t")
    stages[name] = {"seconds": int(ms) / 1000 if int(ms) >= 0 else None, "exit": rc}
summary = {
    "stages": stages,
    "nproc": read("nproc"),
    "ours_setup": read("ours_setup"),
    "ours_sigterm": read("ours_sigterm"),
    "regenerate_meta": read("regen/regenerate.json"),
    "specforge_result": read("sf/result.json"),
    "cold_index": read("cold_index.json"),
    "cold_index_log_tail": (read("cold.log") or "")[-2000:] if isinstance(read("cold.log"), str) else None,
}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(stages, indent=1))
EOF
note "done"
