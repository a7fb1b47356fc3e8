#!/usr/bin/env bash
# The real model end to end: SmolLM2-135M-Instruct from its wheel, ShareGPT from `data prepare`, online training,
# export, preflight, the reference engine (speculative and plain), bench on held-out ShareGPT prompts.
# Every step is the product's own command line; each one's wall time and the results land in $OUT/summary.json.
#
#   DATA=<a `data prepare` dir> OUT=<dir> [GGUF=<SmolLM2 .gguf>] [MAX_STEPS=1200] [DEVICE=cuda] [BATCH=4]
#   [NUM_PROMPTS=40] [MAX_NEW_TOKENS=128] [CONCURRENCY=1] [ATTN=sdpa] bash benchmarks/real_model_e2e.sh
#
# On CPU (this project's machines) use a handful of steps and prompts: MAX_STEPS=3 BATCH=1 NUM_PROMPTS=2 MAX_NEW_TOKENS=8.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA:?a data prepare dir}" "${OUT:?an output dir}"
MAX_STEPS=${MAX_STEPS:-1200} DEVICE=${DEVICE:-cuda} BATCH=${BATCH:-4} NUM_PROMPTS=${NUM_PROMPTS:-40}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-128} CONCURRENCY=${CONCURRENCY:-1} ATTN=${ATTN:-sdpa}
PY=${PY:-python3}
RUN="$OUT/run"
mkdir -p "$RUN"
export EAGLE3_CACHE_DIR=${EAGLE3_CACHE_DIR:-$OUT/cache} PYTHONUNBUFFERED=1
TIMES="$OUT/times.tsv"
: >"$TIMES"
step() {  # step NAME CMD...: run, log, time; a failing step stops the run (serve_spec may end amber: exit 1, kept going)
    local name=$1 start end rc
    shift
    echo "== $name: $*" | tee -a "$OUT/log.txt"
    start=$(date +%s%N)
    set +e
    "$@" 2>&1 | tee -a "$OUT/log.txt"
    rc=${PIPESTATUS[0]}
    set -e
    end=$(date +%s%N)
    printf '%s\t%s\t%s\n' "$name" "$(((end - start) / 1000000))" "$rc" >>"$TIMES"
    if [ "$rc" -ne 0 ] && [ "$name" != serve_spec ]; then
        echo "== $name failed (exit $rc)" | tee -a "$OUT/log.txt"
        exit "$rc"
    fi
}
HOST=("$PY" -m backend --run-dir "$RUN")
step prepare "${HOST[@]}" target prepare smollm2-135m-instruct ${GGUF:+--gguf "$GGUF"}
MODEL_DIR=$("${HOST[@]}" target prepare smollm2-135m-instruct 2>/dev/null | tail -1)
if [ -z "${SKIP_TRAIN:-}" ]; then
step train "${HOST[@]}" train --profile smollm2-135m --conversations "$DATA" --out "$RUN/train" --max-steps "$MAX_STEPS" \
    --batch-size "$BATCH" --device "$DEVICE" --attn-backend "$ATTN" --eval-interval "$((MAX_STEPS > 200 ? 200 : MAX_STEPS))" \
    --save-interval "$MAX_STEPS" --log-interval 10
step export "${HOST[@]}" export "$RUN/train" "$RUN/draft"
fi
step preflight "${HOST[@]}" preflight --profile smollm2-135m --target-config "$MODEL_DIR/config.json" --json "$RUN/draft"
step serve_spec "${HOST[@]}" serve --profile smollm2-135m --draft "$RUN/draft" --engine reference --job-name spec --json
step serve_plain "${HOST[@]}" serve --profile smollm2-135m --baseline --engine reference --job-name plain --json
url_of() { "$PY" -c 'import sys; from backend.jobs.registry import JobRegistry; r=JobRegistry(sys.argv[1]).get(sys.argv[2]); a=r.info.argv; print("http://127.0.0.1:"+a[a.index("--port")+1])' "$RUN" "$1"; }
SPEC_URL=$(url_of spec) PLAIN_URL=$(url_of plain)
step bench "${HOST[@]}" bench --url "$SPEC_URL" --baseline-url "$PLAIN_URL" --prompts "$DATA/eval.jsonl" --num-prompts "$NUM_PROMPTS" \
    --chat-template "$MODEL_DIR" --concurrency "$CONCURRENCY" --max-new-tokens "$MAX_NEW_TOKENS" --out "$OUT/bench.json" --json
"${HOST[@]}" job stop --all --grace 10 >/dev/null || true
"$PY" - "$OUT" "$RUN" <<'EOF'
import json, sys
from pathlib import Path
out, run = Path(sys.argv[1]), Path(sys.argv[2])
times = {name: (int(ms) / 1000, int(rc)) for name, ms, rc in (line.split("\t") for line in (out / "times.tsv").read_text().splitlines())}
config = json.loads((run / "draft" / "config.json").read_text())
metrics = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines() if line.strip()]
val = [m for m in metrics if m.get("split") == "val"]
train = [m for m in metrics if m.get("split") == "train"]
summary = {
    "seconds": {name: round(seconds, 1) for name, (seconds, _) in times.items()},
    "exit_codes": {name: rc for name, (_, rc) in times.items()},
    "train_steps": train[-1]["step"] if train else None,
    "train_step_time_s_mean": None,
    "val_last": val[-1] if val else None,
    "draft_config_eagle": config.get("eagle_config"),
    "bench": json.loads((out / "bench.json").read_text()) if (out / "bench.json").exists() else None,
}
stamps = [m["time"] for m in train if "time" in m]
if len(stamps) > 1:
    summary["train_step_time_s_mean"] = (stamps[-1] - stamps[0]) / (train[-1]["step"] - train[0]["step"])
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps({k: summary[k] for k in ("seconds", "train_steps", "train_step_time_s_mean")}, indent=1))
EOF
