"""The built-in tiny target: byte tokenizer, deterministic stdlib corpus, and a cached self-trained 8-layer Llama."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from backend.durable import fsync_path
from backend.train.fsutil import pid_alive
from backend.train.schedule import LRSchedule

BYTE_VOCAB = 256
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
TINY_VOCAB_SIZE = 259
TOKENIZER_FILE = "byte_tokenizer.json"
TRAIN_CORPUS_FILE = "corpus_train.bin"
VAL_CORPUS_FILE = "corpus_val.bin"
BUILD_FILE = "build.json"
# Bump when the build recipe changes in a way the settings do not capture, so old caches are not reused.
BUILD_VERSION = 2


class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; 256 = bos, 257 = eos, 258 = pad."""

    vocab_size = TINY_VOCAB_SIZE
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    pad_token_id = PAD_ID

    def encode(self, text: str | bytes, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = list(data)
        if add_bos:
            ids.insert(0, BOS_ID)
        if add_eos:
            ids.append(EOS_ID)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for token in ids:
            token = int(token)
            if token < BYTE_VOCAB:
                out.append(token)
            elif not skip_special_tokens:
                out.extend({BOS_ID: b"<bos>", EOS_ID: b"<eos>", PAD_ID: b"<pad>"}.get(token, b"<unk>"))
            elif not 0 <= token < TINY_VOCAB_SIZE:
                raise ValueError(f"token id {token} is outside the byte tokenizer's vocabulary 0..{TINY_VOCAB_SIZE - 1}")
        return out.decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {
            "type": "byte",
            "vocab_size": self.vocab_size,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
            "note": "token i < 256 is the byte i; text is UTF-8 encoded",
        }

    def save(self, directory: str | os.PathLike) -> None:
        Path(directory, TOKENIZER_FILE).write_text(json.dumps(self.describe(), indent=1) + "\n")

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> "ByteTokenizer":
        path = Path(directory, TOKENIZER_FILE)
        spec = json.loads(path.read_text())
        if spec.get("type") != "byte" or spec.get("vocab_size") != TINY_VOCAB_SIZE:
            raise ValueError(f"{path}: not a byte tokenizer description of vocab {TINY_VOCAB_SIZE}: {spec}")
        return cls()


@dataclass(frozen=True)
class TinySettings:
    """Everything that decides the tiny target's weights (the cache key hashes these and the corpus)."""

    num_layers: int = 8
    hidden_size: int = 128
    num_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # Sized for the 3-minute demo on 2 CPU cores: 320 steps x 4 x 128 bytes (20 epochs of 8 KB), about
    # 60 CPU-seconds. The target reaches ~1.05 nats/byte on its corpus (uniform: 5.56) and ~64 % teacher-forced
    # next-byte accuracy, so its greedy continuations are varied code-like text, not one repeated word
    # (at 16 KB or 4x fewer steps it stalls near 1.8-2.4 nats/byte and greedy output loops on "the the").
    corpus_bytes: int = 8 * 1024
    val_corpus_bytes: int = 4 * 1024
    seq_len: int = 128
    batch_size: int = 4
    steps: int = 320
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0


@dataclass
class TinyCorpus:
    train: bytes
    val: bytes
    train_files: list[str]
    val_files: list[str]

    def digest(self) -> str:
        return hashlib.sha256(self.train + b"\0" + self.val).hexdigest()


def cache_root() -> Path:
    """$EAGLE3_CACHE_DIR, else $XDG_CACHE_HOME/eagle3-console, else ~/.cache/eagle3-console."""
    explicit = os.environ.get("EAGLE3_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "eagle3-console"


def _stdlib_candidates() -> list[Path]:
    """Top-level stdlib modules of moderate size, in an order fixed by a hash of their names."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in stdlib.glob("*.py") if not p.name.startswith("_") and 2_000 <= p.stat().st_size <= 24_000]
    if not files:
        raise RuntimeError(f"no Python standard library sources found under {stdlib}; the tiny target needs them as its corpus")
    return sorted(files, key=lambda p: hashlib.sha1(p.name.encode()).hexdigest())


def tiny_corpus(settings: TinySettings = TinySettings()) -> TinyCorpus:
    """Training text: whole stdlib files up to corpus_bytes; every 10th candidate file is held out for validation."""
    train, val = bytearray(), bytearray()
    train_files, val_files = [], []
    for index, path in enumerate(_stdlib_candidates()):
        if index % 10 == 9:
            if len(val) < settings.val_corpus_bytes:
                val += path.read_bytes()
                val_files.append(path.name)
        elif len(train) < settings.corpus_bytes:
            train += path.read_bytes()
            train_files.append(path.name)
        if len(train) >= settings.corpus_bytes and len(val) >= settings.val_corpus_bytes:
            break
    return TinyCorpus(bytes(train[: settings.corpus_bytes]), bytes(val[: settings.val_corpus_bytes]), train_files, val_files)


def tiny_key(settings: TinySettings, corpus: TinyCorpus) -> str:
    payload = json.dumps({"settings": dataclasses.asdict(settings), "corpus": corpus.digest(), "version": BUILD_VERSION}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def tiny_llama_config(settings: TinySettings):
    from transformers import LlamaConfig

    # Taken through LlamaConfig's **kwargs in transformers 5 (its typed signature lists neither); the built config is unchanged.
    passed_through: dict[str, Any] = {"rope_theta": settings.rope_theta, "attn_implementation": "sdpa"}
    return LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_heads,
        max_position_embeddings=settings.max_position_embeddings,
        rms_norm_eps=settings.rms_norm_eps,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **passed_through,
    )


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def progress_line(label: str, done: int, total: int, started: float, unit: str = "steps", extra: str = "", width: int = 20) -> str:
    """One line of a text progress bar (logs are line-based: one line per update, no carriage returns).

    e.g. "tiny target [########------------]  64/160 steps  40%  loss 2.31  26 s, ~39 s left"
    """
    total = max(1, total)
    fraction = min(1.0, max(0.0, done / total))
    filled = int(round(fraction * width))
    elapsed = time.monotonic() - started
    left = f", ~{elapsed / fraction - elapsed:.0f} s left" if 0 < fraction < 1 else ""
    extra = f"  {extra}" if extra else ""
    return f"{label} [{'#' * filled}{'-' * (width - filled)}] {done:>{len(str(total))}}/{total} {unit} {100 * fraction:3.0f}%{extra}  {elapsed:.0f} s{left}"


def progress_every(total: int, updates: int = 20) -> int:
    """Report every this many units so that a phase prints about `updates` lines."""
    return max(1, total // updates)


def _train_tiny(model, corpus: bytes, settings: TinySettings, log: Callable[[str], None]) -> list[float]:
    """Fixed-step AdamW on random windows of the corpus (a ~20-epoch memorising run). Returns the loss per step."""
    import torch
    import torch.nn.functional as F

    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay)
    schedule = LRSchedule(settings.learning_rate, "cosine", settings.warmup_steps, settings.steps, settings.min_lr_ratio)
    offsets_range = len(data) - settings.seq_len - 1
    losses = []
    started = time.monotonic()
    every = progress_every(settings.steps)
    log(progress_line("tiny target", 0, settings.steps, started))
    model.train()
    for step in range(settings.steps):
        starts = torch.randint(0, offsets_range, (settings.batch_size,), generator=generator)
        windows = torch.stack([data[s : s + settings.seq_len + 1] for s in starts.tolist()])
        logits = model(input_ids=windows[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % every == 0 or step == settings.steps - 1:
            recent = losses[-every:]
            log(progress_line("tiny target", step + 1, settings.steps, started, extra=f"loss {sum(recent) / len(recent):.3f} nats/byte"))
    model.eval()
    return losses


def _held_out_loss(model, text: bytes, seq_len: int) -> float:
    import torch
    import torch.nn.functional as F

    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    count = (len(data) - 1) // seq_len
    if count == 0:
        return math.nan
    inputs = data[: count * seq_len].view(count, seq_len)
    labels = data[1 : count * seq_len + 1].view(count, seq_len)
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)))


def _fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            fsync_path(path)
    fsync_path(directory)


def build_tiny_target(destination: Path, settings: TinySettings, corpus: TinyCorpus, log: Callable[[str], None] = _stderr) -> Path:
    """Train the tiny target and write it to `destination` via a temp dir + rename (a killed build leaves no cache)."""
    import torch
    from transformers import LlamaForCausalLM

    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = destination.parent / f".building-{destination.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    threads = torch.get_num_threads()
    try:
        # On a shared 2-core box, 2 OpenMP threads fighting another process run ~6x slower than 1 thread.
        if os.environ.get("EAGLE3_TINY_THREADS"):
            torch.set_num_threads(int(os.environ["EAGLE3_TINY_THREADS"]))
        started = time.monotonic()
        torch.manual_seed(settings.seed)
        model = LlamaForCausalLM(tiny_llama_config(settings))
        losses = _train_tiny(model, corpus.train, settings, log)
        model.save_pretrained(staging)
        ByteTokenizer().save(staging)
        (staging / TRAIN_CORPUS_FILE).write_bytes(corpus.train)
        (staging / VAL_CORPUS_FILE).write_bytes(corpus.val)
        build = {
            "key": destination.name,
            "settings": dataclasses.asdict(settings),
            "corpus": {"sha256": corpus.digest(), "train_files": corpus.train_files, "val_files": corpus.val_files},
            "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
            "corpus_loss": _held_out_loss(model, corpus.train, settings.seq_len),
            "held_out_loss": _held_out_loss(model, corpus.val, settings.seq_len),
            "build_seconds": time.monotonic() - started,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "build_version": BUILD_VERSION,
        }
        (staging / BUILD_FILE).write_text(json.dumps(build, indent=1) + "\n")
        _fsync_tree(staging)
        os.rename(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    log(
        f"tiny target built in {build['build_seconds']:.0f} s: corpus loss {build['corpus_loss']:.3f}, held-out {build['held_out_loss']:.3f} nats/byte -> {destination}"
    )
    return destination


def _threads() -> int:
    import torch

    wanted = os.environ.get("EAGLE3_TINY_THREADS")
    return int(wanted) if wanted else torch.get_num_threads()


def is_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in ("config.json", "model.safetensors", TOKENIZER_FILE, BUILD_FILE))


def remove_stale_staging(root: Path) -> list[Path]:
    """Staging dirs of builds that were killed (their builder pid is gone); a live build's dir is left alone."""
    removed = []
    for staging in root.glob(".building-*"):
        try:
            pid = int(staging.name.rsplit("-", 1)[1])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not pid_alive(pid):
            shutil.rmtree(staging, ignore_errors=True)
            removed.append(staging)
    return removed


def _lock_holder(handle) -> int | None:
    handle.seek(0)
    text = handle.read().strip()
    return int(text) if text.isdigit() else None


@contextlib.contextmanager
def cache_lock(path: Path, what: str, log: Callable[[str], None] | None = _stderr):
    """One builder per cache entry across processes (the demo, test sessions, DDP ranks); the others wait and reuse.

    An flock on `path` (released by the kernel when its holder dies, so a killed builder never wedges the
    next one); the holder writes its pid into the file so that a waiter can say whom it waits for.
    """
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(handle)
            if log:
                log(f"waiting for another process building {what} (pid {holder if holder is not None else 'unknown'}); lock {path}")
            started = time.monotonic()
            fcntl.flock(handle, fcntl.LOCK_EX)
            if log:
                log(f"the other build of {what} finished after {time.monotonic() - started:.0f} s of waiting")
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()}\n")
            handle.flush()
            yield
        finally:
            with contextlib.suppress(OSError):
                handle.seek(0)
                handle.truncate()
                handle.flush()
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_tiny_target(settings: TinySettings = TinySettings(), cache_dir: Path | None = None, log: Callable[[str], None] = _stderr) -> Path:
    """Path of the cached tiny target, building it first (about a minute on 2 cores) when it is not there yet."""
    corpus = tiny_corpus(settings)
    root = Path(cache_dir) if cache_dir else cache_root()
    destination = root / f"tiny-target-{tiny_key(settings, corpus)}"
    if is_complete(destination):
        return destination
    with cache_lock(root / f".{destination.name}.lock", f"the tiny target {destination.name}", log):
        if is_complete(destination):
            return destination
        if destination.exists():
            # An incomplete directory under the final name was not written by us (we rename complete dirs only).
            raise RuntimeError(f"{destination} exists but is incomplete; it was left untouched. Remove it and run `eagle3-host build-tiny` again.")
        remove_stale_staging(root)
        log(
            f"building the tiny target ({settings.num_layers}-layer byte Llama, {settings.steps} CPU steps on {_threads()} thread(s), "
            f"cached afterwards) into {destination}"
        )
        return build_tiny_target(destination, settings, corpus, log)


def read_corpus(target_dir: str | os.PathLike, split: str) -> bytes:
    """The text the tiny target was trained on ("train") or held out from it ("val")."""
    name = TRAIN_CORPUS_FILE if split == "train" else VAL_CORPUS_FILE
    return Path(target_dir, name).read_bytes()


def is_tiny_target_dir(path: str | os.PathLike) -> bool:
    return Path(path, TOKENIZER_FILE).is_file()
