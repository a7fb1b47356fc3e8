"""The built-in tiny target: byte tokenizer, deterministic corpus, atomic cached build, and (slow) the real memorising build."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from backend.train.tiny import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    ByteTokenizer,
    TinySettings,
    build_tiny_target,
    cache_lock,
    cache_root,
    progress_line,
    ensure_tiny_target,
    is_complete,
    read_corpus,
    tiny_corpus,
    tiny_key,
)
from tests.fixtures.env import MINI_SETTINGS, ROOT, subprocess_env


def test_byte_tokenizer_round_trips_utf8_and_special_ids():
    tokenizer = ByteTokenizer()
    text = "def f(x):\n    return 'é→∑'\n"
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID
    assert all(0 <= i < 256 for i in ids[1:-1])
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([BOS_ID, 104, 105, PAD_ID], skip_special_tokens=False) == "<bos>hi<pad>"
    with pytest.raises(ValueError, match="outside"):
        tokenizer.decode([300])


def test_tokenizer_description_is_saved_and_checked(tmp_path):
    ByteTokenizer().save(tmp_path)
    assert ByteTokenizer.from_dir(tmp_path).vocab_size == 259
    spec = json.loads((tmp_path / "byte_tokenizer.json").read_text())
    assert (spec["bos_token_id"], spec["eos_token_id"], spec["pad_token_id"]) == (256, 257, 258)
    (tmp_path / "byte_tokenizer.json").write_text(json.dumps({**spec, "vocab_size": 300}))
    with pytest.raises(ValueError, match="not a byte tokenizer"):
        ByteTokenizer.from_dir(tmp_path)


def test_corpus_is_deterministic_and_validation_files_are_held_out():
    settings = TinySettings()
    first, second = tiny_corpus(settings), tiny_corpus(settings)
    assert first.train == second.train and first.val == second.val
    assert len(first.train) == settings.corpus_bytes and len(first.val) == settings.val_corpus_bytes
    assert not set(first.train_files) & set(first.val_files)
    assert first.digest() == second.digest()


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("EAGLE3_CACHE_DIR", raising=False)
    assert cache_root() == tmp_path / "xdg" / "eagle3-console"
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_root() == tmp_path / "explicit"


def test_cache_key_follows_settings_and_corpus():
    settings = TinySettings()
    corpus = tiny_corpus(settings)
    assert tiny_key(settings, corpus) == tiny_key(TinySettings(), tiny_corpus(TinySettings()))
    assert tiny_key(replace(settings, steps=321), corpus) != tiny_key(settings, corpus)
    changed = replace(corpus, train=corpus.train[:-1] + b"!")
    assert tiny_key(settings, changed) != tiny_key(settings, corpus)


def test_ensure_builds_once_then_reuses_the_cache(tmp_path):
    settings = TinySettings(**MINI_SETTINGS)
    messages = []
    path = ensure_tiny_target(settings, cache_dir=tmp_path, log=messages.append)
    assert is_complete(path) and path.parent == tmp_path
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == 259 and config["tie_word_embeddings"] is False
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (256, 257, 258)
    assert read_corpus(path, "train") == tiny_corpus(settings).train
    build = json.loads((path / "build.json").read_text())
    assert build["settings"]["steps"] == settings.steps and build["corpus_loss"] < 5.6  # below uniform (ln 259)
    bars = [m for m in messages if m.startswith("tiny target [")]  # the job log's (and the Logs screen's) progress bar
    assert len(bars) == settings.steps + 1 and bars[0].startswith("tiny target [--------------------]  0/12 steps   0%")
    assert f"{settings.steps}/{settings.steps} steps 100%" in bars[-1] and "nats/byte" in bars[-1]
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    messages.clear()
    assert ensure_tiny_target(settings, cache_dir=tmp_path, log=messages.append) == path
    assert messages == [] and (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob(".building-*"))


def test_progress_line_is_a_bar_with_counts_percent_and_time_left():
    started = time.monotonic() - 10
    line = progress_line("tiny data", 64, 256, started, unit="samples", extra="x")
    assert line.startswith("tiny data [#####---------------]  64/256 samples  25%  x  10 s, ~30 s left")
    assert progress_line("tiny data", 256, 256, started, unit="samples").endswith("256/256 samples 100%  10 s")


def test_a_second_builder_waits_for_the_first_says_so_and_reuses_its_build(tmp_path):
    settings = TinySettings(**dict(MINI_SETTINGS, steps=3))
    corpus = tiny_corpus(settings)
    destination = tmp_path / f"tiny-target-{tiny_key(settings, corpus)}"
    lock = tmp_path / f".{destination.name}.lock"
    messages, result = [], {}
    with open(lock, "a+") as held:  # another process's lock: flock conflicts between open file descriptions
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242\n")
        held.flush()
        waiter = threading.Thread(target=lambda: result.update(path=ensure_tiny_target(settings, cache_dir=tmp_path, log=messages.append)))
        waiter.start()
        deadline = time.monotonic() + 60
        while not messages and time.monotonic() < deadline:
            time.sleep(0.05)
        assert messages and messages[0].startswith(f"waiting for another process building the tiny target {destination.name} (pid 4242)"), messages
        assert waiter.is_alive()
        build_tiny_target(destination, settings, corpus, log=lambda _m: None)  # what the other process was doing
        fcntl.flock(held, fcntl.LOCK_UN)
    waiter.join(timeout=60)
    assert result["path"] == destination
    assert not any(m.startswith("building the tiny target") for m in messages), "the waiter must reuse, not rebuild"
    assert "the other build of" in messages[-1]


def test_the_lock_holder_writes_its_pid_and_a_killed_holder_frees_the_lock(tmp_path):
    lock = tmp_path / ".x.lock"
    with cache_lock(lock, "x", log=None):
        assert lock.read_text().strip() == str(os.getpid())
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from backend.train.tiny import cache_lock\nimport time\n"
            f"with cache_lock(__import__('pathlib').Path({str(lock)!r}), 'x', log=None):\n    print('held', flush=True); time.sleep(600)",
        ],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        messages = []
        threading.Timer(1.0, holder.kill).start()
        with cache_lock(lock, "the thing", log=messages.append):
            pass
        assert messages[0].startswith(f"waiting for another process building the thing (pid {holder.pid})")
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize(
    "environ, load, expected",
    [
        ({}, 0.1, 2),  # idle 2-core box: both cores
        ({}, 1.4, 1),  # another process keeps a core busy: one thread
        ({}, 9.0, 1),
        ({"EAGLE3_THREADS": "3"}, 0.0, 3),
        ({"OMP_NUM_THREADS": "1"}, 0.0, None),  # the tests' 1 thread per process (conftest): torch keeps it
        ({"LOCAL_WORLD_SIZE": "2"}, 0.0, 1),  # torchrun: the host's cores shared between its processes
    ],
)
def test_torch_threads_are_chosen_for_the_machine(environ, load, expected):
    from backend.train.cli import choose_threads

    assert choose_threads(environ=environ, load=load, cores=2)[0] == expected
    assert choose_threads(environ={}, load=0.0, cores=16)[0] == 4
    assert choose_threads(5, environ=environ, load=load, cores=2)[0] == 5


KILLED_BUILD = """
import sys
from backend.train.tiny import TinySettings, ensure_tiny_target
settings = TinySettings(**{settings!r})
ensure_tiny_target(settings, cache_dir=sys.argv[1], log=lambda m: print(m, flush=True))
"""


def test_a_killed_build_leaves_no_cache_entry_and_the_next_build_succeeds(tmp_path):
    settings = dict(MINI_SETTINGS, steps=100_000)  # far more steps than the kill allows
    script = KILLED_BUILD.format(settings=settings)
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".building-*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert list(tmp_path.glob(".building-*")), "the build never started"
        time.sleep(0.5)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert not [p for p in tmp_path.glob("tiny-target-*") if p.is_dir()], "a killed build must not leave a cache entry"
    quick = TinySettings(**dict(MINI_SETTINGS, steps=3))
    path = ensure_tiny_target(quick, cache_dir=tmp_path, log=lambda _m: None)
    assert is_complete(path)
    assert not list(tmp_path.glob(".building-*")), "stale staging dirs are removed by the next builder"


@pytest.mark.slow
def test_the_real_tiny_target_memorises_its_corpus(tiny_target_dir, tiny_profile, tiny_target):
    import torch

    config = json.loads((tiny_target_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"], config["intermediate_size"]) == (8, 128, 4, 512)
    assert config["vocab_size"] == tiny_profile.target.vocab_size == 259
    build = json.loads((tiny_target_dir / "build.json").read_text())
    # The 3-minute recipe (320 steps x 4 x 128 bytes of an 8 KB corpus): ~1.05 nats/byte, worse on held-out files.
    assert build["corpus_loss"] < 1.4, build
    assert build["held_out_loss"] > build["corpus_loss"]
    accuracy = {}
    for split in ("train", "val"):  # teacher-forced next-byte accuracy
        ids = torch.tensor(list(read_corpus(tiny_target_dir, split)[: 32 * 128])).view(32, 128)
        with torch.no_grad():
            logits = tiny_target.model(input_ids=ids).logits
        accuracy[split] = float((logits[:, :-1].argmax(-1) == ids[:, 1:]).float().mean())
    assert accuracy["train"] > 0.55 and accuracy["train"] > accuracy["val"] + 0.1, accuracy  # measured: 0.64 vs ~0.4
