"""Tokenizing chat data for training: the batched in-process path against one conversation at a time and against a
pool of spawned worker processes (the path before 2026-12-03), same conversations, same run.

    .venv/bin/python benchmarks/bench_tokenize.py --data /tmp/sgdev/train.jsonl --limit 2000 --workers 2

`--tokenizer` is a target dir (default: the smollm2 target in the cache, `eagle3-host target prepare` makes it). A
worker gets the tokenizer pickled, as the pool did; what it imported to unpickle it is reported (transformers 5.17,
the H200 host's, imports torch with it: 16 workers spent 70-86 s there before a first result). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.train.conversations import read_conversation_file  # noqa: E402
from backend.train.data import conversation_tokens, conversations_tokens, TOKENIZE_BATCH  # noqa: E402
from backend.train.tiny import cache_root  # noqa: E402

_tokenizer = None


def _adopt(tokenizer) -> None:
    global _tokenizer
    _tokenizer = tokenizer


def _chunk(task):
    chunk, max_len = task
    return [conversation_tokens(_tokenizer, messages, max_len) for messages in chunk], "torch" in sys.modules


def in_workers(tokenizer, conversations, max_len: int, workers: int) -> tuple[list, bool, float]:
    """The pool: the tokenizer pickled to each spawned worker, chunks mapped in order; (results, any worker imported
    torch, seconds to the first chunk back)."""
    size = max(32, len(conversations) // (workers * 8))
    tasks = [(conversations[i : i + size], max_len) for i in range(0, len(conversations), size)]
    results, torch_seen, first = [], False, None
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_adopt, initargs=(tokenizer,)) as pool:
        for chunk, imported in pool.map(_chunk, tasks):
            first = first if first is not None else time.perf_counter() - started
            results.extend(chunk)
            torch_seen |= imported
    return results, torch_seen, first or 0.0


def batched(tokenizer, conversations, max_len: int) -> list:
    results = []
    for start in range(0, len(conversations), TOKENIZE_BATCH):
        results.extend(conversations_tokens(tokenizer, conversations[start : start + TOKENIZE_BATCH], max_len))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="a chat file (any format `data prepare` reads)")
    parser.add_argument("--tokenizer", type=Path, help="a target dir with a tokenizer and chat template")
    parser.add_argument("--limit", type=int, default=2000)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoTokenizer, __version__

    where = args.tokenizer or next(cache_root().glob("smollm2-135m-instruct-*"), None)
    if where is None:
        parser.error("no --tokenizer and no smollm2 target in the cache: run `eagle3-host target prepare smollm2-135m-instruct`")
    tokenizer = AutoTokenizer.from_pretrained(where)
    conversations = [c.messages for c in read_conversation_file(args.data, args.limit)[0]]
    timings = {}
    started = time.perf_counter()
    one = [conversation_tokens(tokenizer, messages, args.max_len) for messages in conversations]
    timings["one_at_a_time_s"] = time.perf_counter() - started
    started = time.perf_counter()
    many = batched(tokenizer, conversations, args.max_len)
    timings["batched_s"] = time.perf_counter() - started
    started = time.perf_counter()
    pooled, torch_in_workers, first = in_workers(tokenizer, conversations, args.max_len, args.workers)
    timings["workers_s"] = time.perf_counter() - started
    result = {
        "conversations": len(conversations),
        "tokens": sum(len(found[0]) for found in many if found),
        "transformers": __version__,
        **{key: round(value, 3) for key, value in timings.items()},
        "workers": args.workers,
        "workers_first_chunk_s": round(first, 3),
        "a_worker_imported_torch": torch_in_workers,
        "batched_vs_one_at_a_time": round(timings["one_at_a_time_s"] / timings["batched_s"], 2),
        "batched_vs_workers": round(timings["workers_s"] / timings["batched_s"], 2),
        "identical": one == many == pooled,
    }
    print(json.dumps(result))
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
