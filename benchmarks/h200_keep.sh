#!/usr/bin/env bash
# Keeps one device call's returned files in git the moment they come back: copies them from the device tool's
# read-only result folder into benchmarks/results as h200_round<ROUND>_<PHASE>_<name> and commits them.
# The thirteenth round's files were lost because a try was cut off before it copied them out: run this in the same
# turn as the next call (it takes a second; the machine stays warm ~30 s after a call).
#
#   bash benchmarks/h200_keep.sh 15 train /work/.device/3
#
# Pieces that are not results (the draft's and the regenerated conversations' *.part* files, torch.compile's
# compile_*.bin) go to .h200-draft/, .h200-regen/, .h200-regen-sampled/ and .h200-compile/ instead (ignored by .gitignore's /.h200-*/; PHASE=draft and PHASE=carry3 carry them in a later call).
# Trainer metrics are kept xz-compressed (*_metrics.jsonl.xz; read them with xzcat): the working tree travels with
# every device call beside the carried folder, and round 16's carry1 no longer fit with them raw.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 3 ] || { echo "usage: $0 ROUND PHASE RESULT_DIR" >&2; exit 2; }
round=$1 phase=$2 from=$3
[[ $round =~ ^[0-9]+$ && $phase =~ ^[a-z0-9_]+$ ]] || { echo "h200_keep: ROUND is a number and PHASE a word: got '$round' '$phase'; nothing copied" >&2; exit 2; }
[ -d "$from" ] || { echo "h200_keep: no folder $from; nothing copied" >&2; exit 2; }
# A returned draft or regeneration replaces the kept one whole: its earlier pieces move to .h200-draft.prev/ or
# .h200-regen.prev/ (not carried), so a piece count that shrank leaves no stale piece behind to corrupt `cat part*`,
# and the one replaced survives a round that came back with less (round 17's cut regeneration replaced round 16's
# complete one).
for kind in draft draft-other regen regen-sampled; do
    case $kind in draft) pattern=ours_draft.tar.part ;; draft-other) pattern=ours_other_draft.tar.part ;; regen) pattern=regen.tar.xz.part ;; *) pattern=regen_sampled.tar.xz.part ;; esac
    compgen -G "$from/$pattern*" >/dev/null && compgen -G ".h200-$kind/$pattern*" >/dev/null || continue
    rm -rf ".h200-$kind.prev" && mkdir -p ".h200-$kind.prev" && mv ".h200-$kind"/"$pattern"* ".h200-$kind.prev"/
    echo "h200_keep: the earlier .h200-$kind pieces are in .h200-$kind.prev/" >&2
done
kept=()
for file in "$from"/*; do
    [ -f "$file" ] || continue
    name=$(basename "$file")
    case $name in
    ours_draft.tar.part*) dest=.h200-draft/$name ;;
    ours_other_draft.tar.part*) dest=.h200-draft-other/$name ;; # PHASE=other: the A/B's other twin
    regen.tar.xz.part*) dest=.h200-regen/$name ;;
    regen_sampled.tar.xz.part*) dest=.h200-regen-sampled/$name ;; # PHASE=sampled's answers: carry3 brings them back
    compile_*.bin) dest=.h200-compile/$name ;; # torch.compile's artifacts: carry3 brings them to the next round
    *) dest=benchmarks/results/h200_round${round}_${phase}_${name#"${phase}"_} ;; # train_summary.json: ..._train_summary.json
    esac
    mkdir -p "$(dirname "$dest")"
    cp "$file" "$dest" && chmod 644 "$dest"
    if [[ $dest == benchmarks/results/*metrics.jsonl ]]; then # ~10x smaller: the tree travels with every device call (64 MiB)
        xz -9 -f "$dest" && dest=$dest.xz
    fi
    [[ $dest == benchmarks/results/* ]] && kept+=("$dest")
    echo "h200_keep: $dest" >&2
done
[ ${#kept[@]} -gt 0 ] || { echo "h200_keep: no result files in $from" >&2; exit 0; }
git add -- "${kept[@]}"
git commit -q -m "results: H200 round $round, $phase phase, as returned" -- "${kept[@]}"
echo "h200_keep: committed ${#kept[@]} file(s)" >&2
