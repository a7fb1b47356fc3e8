"""Exit 0 when a prepare dir holds the train and val splits a regeneration recorded (its regenerate.json), else 1.

    python3 benchmarks/regen_source_matches.py REGENERATE_JSON|- PREPARE_DIR

Used by h200_carry.sh and h200_round.sh to decide whether a carried regeneration resumes on a prepare dir or is
taken by content (`data regenerate --reuse`); the comparison is backend.train.regenerate.split_digests'."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.train.regenerate import split_digests  # noqa: E402


def main(argv: list[str]) -> int:
    meta_path, source = argv
    meta = json.load(sys.stdin) if meta_path == "-" else json.loads(Path(meta_path).read_text())
    try:
        return 0 if split_digests(Path(source)) == meta["source"]["splits"] else 1
    except OSError:
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
