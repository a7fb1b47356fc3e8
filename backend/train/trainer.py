"""The EAGLE-3 training loop: TTT unroll, AdamW + clipping, schedules, Grokfast, validation, metrics, checkpoints, SIGTERM, DDP, per-rank heartbeats."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from backend.commands import NVLINK_MULTICAST_OFF, data_dir_for
from backend.durable import write_atomic
from backend.layout import CHECKPOINTS_DIR, METRICS_FILENAME, HeartbeatWriter
from backend.profiles import Profile
from backend.train.compile_cache import cache_file, load_artifacts, save_artifacts
from backend.train.data import (
    BatchSampler,
    OfflineSource,
    OnlineSource,
    TinyDataSettings,
    TrainBatch,
    add_train_samples,
    check_feature_width,
    conversation_samples,
    eval_batches,
    tiny_data_settings,
    tiny_samples,
)
from backend.train.draft import DraftModelConfig, Eagle3Draft
from backend.train.fsutil import PRIVATE_FILE, ForeignPathError, private_dir, private_file_if_present
from backend.train.loss import TTTLoss, chain_round_histogram, fused_ttt_loss, make_teacher, rounds_accept_length
from backend.train.schedule import GrokfastEMA, LRSchedule, TimeBudget
from backend.train.vocab import build_vocab_mapping, count_tokens, coverage
from backend.train.target_graphs import TargetPass, graphs_wanted
from backend.layout import latest_checkpoint
from backend.train.target import load_target
from backend.train.tiny import is_tiny_target_dir
from backend.metrics.records import MetricsWriter

if TYPE_CHECKING:
    from backend.metrics.records import MetricsWriter
    from backend.train.chat_templates import ChatTemplate
    from backend.train.target import TargetPlacement

RUN_FILE = "run.json"
ADAM_BETAS = (0.9, 0.95)  # EAGLE-3 paper


class TrainSetupError(ValueError):
    """Training refused to start: inputs disagree with the profile, a resume checkpoint does not fit, ..."""


T = TypeVar("T")


def _given(value: T | None, default: T) -> T:
    return default if value is None else value


# With --max-seconds and no --max-steps the time ends the run, not a step count.
BUDGET_STEP_CAP = 10**9


@dataclass(frozen=True)
class TrainSettings:
    """What a run trains with: the profile's [train] values with the options' overrides applied.

    Recorded as they are (field order kept) in run.json and in every checkpoint's training_state.pt; a resume
    past the profile's plan replaces max_steps (dataclasses.replace), and so does a time budget's re-fit
    (`--max-seconds`: the steps that end at its deadline); nothing else changes during a run.
    """

    max_steps: int
    schedule: str
    lr: float
    min_lr_ratio: float
    weight_decay: float
    warmup_steps: int
    rewarm_steps: int
    grokfast_alpha: float | None
    grokfast_lambda: float
    teacher_temperature: float
    batch_size: int
    eval_interval: int
    save_interval: int
    log_interval: int
    seed: int
    ttt_length: int
    grad_clip: float
    seq_len: int
    dtype: str

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TrainOptions:
    """A training run as the command line (or a caller) asks for it: the typed profile and what overrides it (None: the profile's value)."""

    profile: Profile
    out_dir: Path | None = None  # None: $EAGLE3_JOB_DIR, else <run_dir>/runs/train-<timestamp> (decided on rank 0)
    run_dir: Path = Path("~/.eagle3")
    max_steps: int | None = None
    max_seconds: float | None = None  # a time budget for the steps (a run control): the cosine is re-fitted to end with it
    schedule: str | None = None
    lr: float | None = None
    weight_decay: float | None = None
    warmup_steps: int | None = None
    grokfast_alpha: float | None = None
    grokfast_lambda: float | None = None
    teacher_temperature: float | None = None  # the loss's teacher: softmax(target logits / T) over the draft vocab (None: the profile's)
    resume: str | None = None  # None: fresh run; "latest": newest checkpoint under out_dir; else a checkpoint dir
    rewarm_steps: int | None = None
    data_dir: Path | None = None  # offline shards written by `extract`
    conversations: Path | None = None  # online HF target: a chat file (any format conversations.py reads) or a `data prepare` dir
    extra_conversations: tuple[Path, ...] = ()  # online: more training conversations (their train splits; validation stays the above's)
    group_by_length: bool = False  # batches of similar-length samples (online conversations; see BatchSampler)
    chat_template: ChatTemplate | None = None  # None: the tokenizer's own
    regenerate_tokens: int = 0
    target_placement: TargetPlacement | None = None  # online: the target spread over GPUs/CPU/disk; None: whole on `device`
    tensorboard: bool = False
    device: str | None = None
    batch_size: int | None = None
    eval_interval: int | None = None
    save_interval: int | None = None
    log_interval: int | None = None
    max_val_batches: int | None = None
    eval_at_start: bool = True
    seed: int | None = None
    attn_backend: str | None = None
    draft_head: str = "random"  # a fresh draft's lm_head and norm: "random" (SpecForge's), or "target" (the target's rows)
    ttt_length: int | None = None  # draft steps unrolled per training step (None: the profile's)
    draft_intermediate_size: int | None = None  # the draft MLP's width (None: the profile's [draft] intermediate_size)
    compile: bool | None = None  # torch.compile the layer's per-step functions; None: on CUDA unless EAGLE3_COMPILE=0
    target_graphs: bool | None = None  # online: the target's pass from CUDA graphs; None: on CUDA unless EAGLE3_TARGET_GRAPHS=0
    master_weights: bool | None = None  # bf16 weights + fp32 masters in the optimizer; None: on CUDA when dtype is bfloat16
    tiny_data: TinyDataSettings | None = None  # None: tiny_data_settings(profile seq_len)

    def resolved(self) -> TrainSettings:
        train = self.profile.train
        warmup = _given(self.warmup_steps, train.warmup_steps)
        return TrainSettings(
            max_steps=_given(self.max_steps, BUDGET_STEP_CAP if self.max_seconds else train.max_steps),
            schedule=_given(self.schedule, train.schedule),
            lr=_given(self.lr, train.learning_rate),
            min_lr_ratio=train.min_lr_ratio,
            weight_decay=_given(self.weight_decay, train.weight_decay),
            warmup_steps=warmup,
            rewarm_steps=_given(self.rewarm_steps, max(1, warmup // 2)),
            grokfast_alpha=_given(self.grokfast_alpha, train.grokfast_alpha),
            grokfast_lambda=_given(self.grokfast_lambda, train.grokfast_lambda),
            teacher_temperature=_given(self.teacher_temperature, train.teacher_temperature),
            batch_size=_given(self.batch_size, train.batch_size),
            eval_interval=_given(self.eval_interval, train.eval_interval),
            save_interval=_given(self.save_interval, train.save_interval),
            log_interval=_given(self.log_interval, train.log_interval),
            seed=_given(self.seed, train.seed),
            ttt_length=_given(self.ttt_length, train.ttt_length),
            grad_clip=train.grad_clip,
            seq_len=train.seq_len,
            dtype=train.dtype,
        )


def default_out_dir(run_dir: Path) -> Path:
    job_dir = os.environ.get("EAGLE3_JOB_DIR")
    if job_dir:
        return Path(job_dir).expanduser()
    return Path(run_dir).expanduser() / "runs" / time.strftime("train-%Y%m%d-%H%M%S")


# ----------------------------------------------------------------------------------------------
# Distributed context (torchrun: gloo on CPU, nccl on CUDA)
# ----------------------------------------------------------------------------------------------


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_reduce(self, tensor: torch.Tensor, op=None) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
        return tensor

    def broadcast_object(self, value):
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def init_distributed(device_preference: str | None) -> DistContext:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_preference:
        device = torch.device(device_preference)
    else:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        # torch 2.11 refuses set_device("cuda") without an index: always name the GPU.
        device = torch.device("cuda", local_rank if world > 1 else (device.index or 0))
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        # NVLink multicast stays off (see the device notes); harmless where there is none.
        for key, value in NVLINK_MULTICAST_OFF.items():
            os.environ.setdefault(key, value)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistContext(rank, world, local_rank, device)


class _TTTModule(torch.nn.Module):
    """forward() = the TTT unroll and the fused lm_head + loss, so DDP sees every parameter used in its forward.

    Returns (total loss, per-row CE, per-row hits) as tensors; fused_ttt_loss builds the TTTLoss from them.
    """

    def __init__(self, draft: Eagle3Draft, ttt_length: int, compiled: bool = False, keep_hits: bool = False):
        super().__init__()
        self.draft = draft
        self.ttt_length = ttt_length
        self.compiled = compiled
        self.keep_hits = keep_hits

    def forward(self, aux_hidden, input_ids, teacher):
        states = self.draft.ttt_hidden(aux_hidden, input_ids, self.ttt_length)
        result = fused_ttt_loss(states, self.draft.lm_head.weight, teacher, compiled=self.compiled, keep_hits=self.keep_hits)
        if self.keep_hits:
            result.scored = teacher.scored
        return result.total, result


class _MasterView(torch.nn.Module):
    """The draft as a checkpoint sees it: its state_dict with the fp32 master weights in place of the bf16 ones.

    Checkpoints keep the dtype they always had (fp32 weights) and the optimizer's exact values, not bf16 copies.
    """

    def __init__(self, draft: Eagle3Draft, masters: list[tuple[str, torch.Tensor]]):
        super().__init__()
        self._draft = [draft]  # a list, so the draft is not registered as a submodule
        self._masters = masters

    def state_dict(self, *args, **kwargs):
        state = self._draft[0].state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", "")
        for name, master in self._masters:
            state[prefix + name] = master.detach()
        return state

    def named_parameters(self, *args, **kwargs):
        return iter(self._masters)


def step_flops(config, seq: int, ttt: int) -> float:
    """Matmul FLOPs of one training step on one sequence of `seq` tokens, counted as the SpecForge anchor counts them.

    Per TTT step forward: q/k/v from the 2H input, o_proj, SwiGLU MLP, draft lm_head, dense S x S attention and
    the per-position products with earlier steps; backward = 2 x forward; fc forward + weight grad; the frozen
    teacher head forward (36.21 TFLOP at the Llama-3.1-8B draft shape, seq 2048, TTT 7).
    """
    hidden, heads, kv_heads, head_dim = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_step = (
        2 * seq * 2 * hidden * (heads + 2 * kv_heads) * head_dim
        + 2 * seq * heads * head_dim * hidden
        + 6 * seq * hidden * config.intermediate_size
        + 2 * seq * hidden * config.draft_vocab_size
        + 4 * seq * seq * head_dim * heads
    )
    forward = sum(per_step + 4 * seq * head_dim * heads * k for k in range(ttt))
    return 3 * forward + 2 * 2 * seq * config.aux_width * hidden + 2 * seq * config.target_hidden_size * config.vocab_size


def matmul_peak_rate(device: torch.device) -> float | None:
    """FLOP/s of one large matmul measured here (bf16 8192^3 on CUDA, fp32 512^3 on CPU): the MFU denominator."""
    try:
        size, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        times = []
        for repeat in range(8):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            torch.mm(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if repeat >= 3:
                times.append(time.perf_counter() - start)
        del a, b
        return 2 * size**3 / sorted(times)[len(times) // 2]
    except Exception:
        return None


def module_group(name: str) -> str:
    """'midlayer.self_attn.q_proj.weight' -> 'midlayer.self_attn'; 'fc.weight' -> 'fc'."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "midlayer" and len(parts) > 2 else parts[0]


def weight_norms(draft: torch.nn.Module) -> tuple[float, dict[str, float]]:
    squares: dict[str, float] = {}
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if param.requires_grad:
                group = module_group(name)
                squares[group] = squares.get(group, 0.0) + float(param.detach().float().pow(2).sum())
    return math.sqrt(sum(squares.values())), {group: math.sqrt(value) for group, value in squares.items()}


class _Interval:
    """On-device sums over the steps between two log records (one host sync when a record is written)."""

    def __init__(self, ttt: int, device):
        self.ttt, self.device = ttt, device
        self.reset()

    def reset(self) -> None:
        # [steps, loss, (unused), ploss x ttt, hits x ttt, counts x ttt]
        self.sums = torch.zeros(3 + 3 * self.ttt, dtype=torch.float64, device=self.device)

    def add(self, result) -> None:
        n, ttt = len(result.plosses), self.ttt
        self.sums[0] += 1
        self.sums[1] += result.total.detach().double()
        counts = torch.stack([c.double() for c in result.counts])
        self.sums[3 : 3 + n] += torch.stack([p.detach().double() for p in result.plosses])
        self.sums[3 + ttt : 3 + ttt + n] += torch.stack([a.double() for a in result.accs]) * counts
        self.sums[3 + 2 * ttt : 3 + 2 * ttt + n] += counts

    def reduced(self, ctx: DistContext) -> dict:
        flat = ctx.all_reduce(self.sums.clone()).tolist()
        steps, ttt = max(1.0, flat[0]), self.ttt
        ploss, hits, counts = flat[3 : 3 + ttt], flat[3 + ttt : 3 + 2 * ttt], flat[3 + 2 * ttt :]
        return {
            "loss": flat[1] / steps,
            "ploss": [p / steps for p in ploss],
            "acc": [h / c if c else 0.0 for h, c in zip(hits, counts)],
            "steps": int(flat[0]),
        }


class _Prefetcher:
    """Reads the next training batch on a worker thread while the current step runs (offline shards)."""

    def __init__(self, source: OfflineSource, sampler: BatchSampler):
        self.source, self.sampler = source, sampler
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagle3-prefetch")
        self.pending: tuple[dict, Future[dict]] | None = None  # (sampler state before drawing the prefetched batch, its read)

    def _submit(self) -> tuple[dict, Future[dict]]:
        before = self.sampler.state_dict()
        return before, self.pool.submit(self.source.load, "train", self.sampler.next())

    def next_batch(self, device: torch.device) -> TrainBatch:
        if self.pending is None:
            self.pending = self._submit()
        loaded = self.pending[1].result()
        self.pending = self._submit()
        return self.source.to_batch(loaded, device)

    def consumed_state(self) -> dict:
        """Sampler state after the last batch handed out; the one read ahead is not counted."""
        return dict(self.pending[0]) if self.pending else self.sampler.state_dict()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class _StoppedDuringSetup(BaseException):
    """SIGTERM/SIGINT arrived before the first training step.

    A BaseException, as KeyboardInterrupt is: the signal handler raises it wherever setup happens to be, and code
    there that catches Exception (logging's emit, optional imports) would swallow it and let the build run on.
    """


Source = OfflineSource | OnlineSource  # benchmarks attach a synthetic source with OfflineSource's methods


class TrainingParts:
    """What setup builds and every step uses: the source, the draft and its AdamW, the LR schedule, Grokfast, the
    sampler (and its prefetcher) and the TTT module (DDP-wrapped across ranks).

    AdamW: on CUDA with dtype bfloat16, bf16 weights in the model and fp32 master weights only in the optimizer
    (SpecForge's BF16Optimizer layout, with torch's fused AdamW): the draft's parameters, its frozen embedding and its
    gradients are bf16; the optimizer owns fp32 copies of the trainable weights and its moments. Each step casts the
    bf16 grads onto the masters, filters (Grokfast) and clips them there in fp32, steps, and copies the masters back
    into the bf16 weights. Otherwise (CPU, fp32 profiles) the fp32 parameters are the optimizer's own.
    `resume`: a checkpoint's training state (optimizer, Grokfast, sampler), continued from `start_step`.
    """

    def __init__(
        self,
        options: TrainOptions,
        settings: TrainSettings,
        ctx: DistContext,
        source: Source,
        draft: Eagle3Draft,
        draft_config: DraftModelConfig,
        resume: dict | None = None,
        start_step: int = 0,
    ):
        s = settings
        self.source = source
        self.draft_config = draft_config  # the profile's (what checkpoints are saved with); the draft's own when attached
        self.draft = draft.to(ctx.device)
        self.draft.train()
        self.mixed = options.master_weights
        if self.mixed is None:
            self.mixed = ctx.device.type == "cuda" and s.dtype == "bfloat16"
        named = [(n, p) for n, p in self.draft.named_parameters() if p.requires_grad]
        if self.mixed:
            masters = [torch.nn.Parameter(p.detach().float().clone()) for _, p in named]  # before the cast: the exact fp32 values
            self.draft.to(torch.bfloat16)
            named = [(n, p) for n, p in self.draft.named_parameters() if p.requires_grad]
            self.master_named: list[tuple[str, torch.Tensor]] = [(n, m) for (n, _), m in zip(named, masters)]
        else:
            self.master_named = list(named)
        self.trainable: list[tuple[str, torch.Tensor]] = list(named)
        fused = {"fused": True} if self.mixed and ctx.device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW([p for _, p in self.master_named], lr=s.lr, betas=ADAM_BETAS, weight_decay=s.weight_decay, **fused)
        self.draft_ids = (self.draft.d2t + torch.arange(self.draft.d2t.numel(), device=self.draft.d2t.device)).detach()
        use_compile = options.compile
        if use_compile is None:
            use_compile = ctx.device.type == "cuda" and os.environ.get("EAGLE3_COMPILE", "1") != "0"
        self.compiled = bool(use_compile) and ctx.device.type == "cuda"
        self.draft.compile_regions = self.compiled
        self.schedule = LRSchedule(
            s.lr,
            s.schedule,
            s.warmup_steps,
            s.max_steps,
            s.min_lr_ratio,
            rewarm_from=start_step if resume is not None else None,
            rewarm_steps=s.rewarm_steps if resume is not None else 0,
        )
        self.grokfast = GrokfastEMA(s.grokfast_alpha, s.grokfast_lambda) if s.grokfast_alpha else None
        if resume is not None and resume.get("optimizer"):
            self.optimizer.load_state_dict(resume["optimizer"])
            for group in self.optimizer.param_groups:  # this run's settings win over the saved ones (e.g. grok's weight decay)
                group.update(lr=s.lr, betas=ADAM_BETAS, weight_decay=s.weight_decay, **fused)
        if resume is not None and self.grokfast and resume.get("grokfast"):
            self.grokfast.load_state_dict(resume["grokfast"], device=ctx.device)
        lengths = source.lengths("train") if options.group_by_length and isinstance(source, OnlineSource) else None
        self.sampler = BatchSampler(source.size("train"), s.batch_size, s.seed, ctx.rank, ctx.world_size, lengths=lengths)
        if resume is not None and resume.get("sampler"):
            self.sampler.load_state_dict(resume["sampler"])
        # shard reads on the host overlap the GPU step
        self.prefetcher = _Prefetcher(source, self.sampler) if isinstance(source, OfflineSource) else None
        module: torch.nn.Module = _TTTModule(self.draft, s.ttt_length, self.compiled)
        if ctx.enabled:
            from torch.nn.parallel import DistributedDataParallel

            # gradient_as_bucket_view: each .grad is a view into DDP's all-reduce bucket instead of a second copy of every
            # gradient (one copy of the trainable parameters less per GPU; zero_grad(set_to_none) keeps working)
            module = DistributedDataParallel(
                module,
                device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                broadcast_buffers=False,
                gradient_as_bucket_view=True,
            )
        self.model = module


class Trainer:
    """One training run: setup (or attach), the step loop, validation, metrics, checkpoints, signals, heartbeats.

    Every attribute is set here; what setup builds from the data and the checkpoint lives in `parts` (TrainingParts).
    """

    def __init__(self, options: TrainOptions):
        self.options = options
        self.profile = options.profile
        self.settings = options.resolved()
        self.ctx = DistContext()  # this process alone until run() or attach() names the real one
        self.phase = "created"  # "setup" while run() builds the inputs (a signal stops it at once), then "training"
        self.stop_signal: int | None = None
        self.stopped = False
        self.last_save_ok = True
        self.out_dir: Path | None = None  # decided on rank 0 during setup; none when attached
        self.heartbeat: HeartbeatWriter | None = None
        self.metrics: MetricsWriter | None = None  # rank 0 of a run only
        self.tb: Any = None  # TensorBoard's SummaryWriter with --tensorboard (rank 0)
        self.start_step = 0
        self.step = 0
        self.tokens = 0
        self.seconds_before = 0.0  # seconds of steps in the runs this one resumes (what `--max-seconds` has spent)
        self.steps_started: float | None = None  # monotonic time this run's steps began (after the step-0 validation)
        self.run_started: float | None = None  # monotonic time run() began (the setup's duration is logged)
        self.updating = False  # inside an optimizer step: the weights may be half-updated
        self.resume_data: dict | None = None  # the sampler state a checkpoint records when a step failed while stopping
        self.latest_val: dict = {}
        self.val_data: dict | None = None  # online chat data: where validation's conversations are (checkpoints record it)
        self.peak_rate: float | None = None
        self.last_step_flops = 0.0
        self._parts: TrainingParts | None = None

    @property
    def parts(self) -> TrainingParts:
        if self._parts is None:
            raise RuntimeError("the trainer is not set up: run() or attach() builds its draft, optimizer and data")
        return self._parts

    # The parts benchmarks and tests reach for by name.
    @property
    def source(self) -> Source:
        return self.parts.source

    @property
    def draft(self) -> Eagle3Draft:
        return self.parts.draft

    @property
    def model(self) -> torch.nn.Module:
        return self.parts.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.parts.optimizer

    @property
    def master_named(self) -> list[tuple[str, torch.Tensor]]:
        return self.parts.master_named

    # --- signals ---------------------------------------------------------------------------------

    def _on_signal(self, signum, _frame) -> None:
        if self.phase == "setup" and not self.ctx.enabled:
            # Building the tiny target or generating data: nothing to checkpoint yet, and those caches are
            # written atomically, so stop now rather than after minutes of setup.
            self.stop_signal = signum
            raise _StoppedDuringSetup(signal.Signals(signum).name)
        if self.stop_signal is None:
            self.log(f"received {signal.Signals(signum).name}: finishing the current step, then writing a checkpoint")
        self.stop_signal = signum

    def _stop_requested(self) -> bool:
        """Every rank stops after the same step: a signal seen by any rank counts for all."""
        return self._on_any_rank(self.stop_signal is not None)

    def log(self, message: str) -> None:
        if self.ctx.is_main:
            print(f"[train] {message}", file=sys.stderr, flush=True)

    def _log_any_rank(self, message: str) -> None:
        """A rank's own trouble (its heartbeat file), logged by that rank whichever it is."""
        print(f"[train rank {self.ctx.rank}] {message}", file=sys.stderr, flush=True)

    # --- entry -----------------------------------------------------------------------------------

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        self.run_started = time.monotonic()
        self.ctx = init_distributed(self.options.device)
        phase = "failed"
        try:
            try:
                self.phase = "setup"
                self._setup()
            except _StoppedDuringSetup as stopped:
                self.log(f"received {stopped} during setup, before the first step; no checkpoint was written")
                phase = "stopped"
                return 0
            if self.stop_signal is not None:
                self.log("stopped during setup, before the first step; no checkpoint was written")
                phase = "stopped"
                return 0
            self.phase = "training"
            self._loop()
            self._save_compile_cache()
            phase = "stopped" if self.stopped else "done"
            return 0 if self.last_save_ok else 1
        finally:
            if self.heartbeat is not None:
                self.heartbeat.close(phase)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.tb is not None:
                self.tb.close()
            if self._parts is not None and self._parts.prefetcher is not None:
                self._parts.prefetcher.close()
            if self.ctx.enabled and dist.is_initialized():
                dist.destroy_process_group()

    # --- setup -----------------------------------------------------------------------------------

    def _setup(self) -> None:
        ctx, s = self.ctx, self.settings
        torch.manual_seed(s.seed + ctx.rank)
        random.seed(s.seed + ctx.rank)
        out = self.options.out_dir or (default_out_dir(self.options.run_dir) if ctx.is_main else None)
        out_dir = self.out_dir = Path(ctx.broadcast_object(str(out) if out else None)).expanduser()
        if ctx.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            _private_outputs(out_dir)
        # Every rank beats into its own host's job dir (its agent reads it); the output dir only when run by hand.
        job_dir = os.environ.get("EAGLE3_JOB_DIR")
        self.heartbeat = HeartbeatWriter(Path(job_dir).expanduser() if job_dir else out_dir, ctx.rank, ctx.local_rank, ctx.world_size, log=self._log_any_rank)
        self.log(f"output: {out_dir} (world size {ctx.world_size}, device {ctx.device})")
        compile_cache = cache_file(os.environ)
        if compile_cache is not None and ctx.device.type == "cuda":  # the trainer compiles on CUDA only
            load_artifacts(compile_cache, self.log)
        resume_dir = self._resume_checkpoint(out_dir)
        # Rank 0 builds caches (tiny target, generated data) first; the others then read them.
        source = self._make_source() if ctx.is_main else None
        ctx.barrier()
        if source is None:
            source = self._make_source()
        config = self._draft_shape()
        _check_widths(source, config)
        if resume_dir is not None:
            draft, state = self._load_resume(resume_dir, source, config)
            self._parts = TrainingParts(self.options, self.settings, ctx, source, draft, config, resume=state, start_step=self.start_step)
        else:
            self._parts = TrainingParts(self.options, self.settings, ctx, source, self._fresh_draft(source, config), config)
        self._open_outputs(out_dir, resume_dir)

    def _draft_shape(self) -> DraftModelConfig:
        """The profile's draft with this run's overrides: the TTT length it trains (--ttt-length, recorded in the
        exported config) and the MLP width (--draft-intermediate-size)."""
        config = dataclasses.replace(DraftModelConfig.from_profile(self.profile), ttt_length=self.settings.ttt_length)
        if self.options.draft_intermediate_size is not None:
            config = dataclasses.replace(config, intermediate_size=self.options.draft_intermediate_size)
        return config

    def _save_compile_cache(self) -> None:
        """EAGLE3_COMPILE_CACHE: what this run compiled, for the next run on another machine (main rank only)."""
        path = cache_file(os.environ)
        if path is not None and self.ctx.is_main and self._parts is not None and self._parts.compiled:
            save_artifacts(path, self.log)

    def attach(self, ctx: DistContext, source: Source, draft: Eagle3Draft) -> None:
        """Train a prepared draft on a prepared source (benchmarks): width checks, optimizer, DDP; writes no files."""
        self.ctx = ctx
        _check_widths(source, draft.config)
        self._parts = TrainingParts(self.options, self.settings, ctx, source, draft, draft.config)

    def _resume_checkpoint(self, out_dir: Path) -> Path | None:

        resume = self.options.resume
        if not resume:
            return None
        if resume == "latest":
            found = latest_checkpoint(out_dir)
            if found is None:
                raise TrainSetupError(f"--resume given without a checkpoint, and {out_dir} holds none; nothing was started")
            return found
        path = Path(resume).expanduser()
        found = latest_checkpoint(path) if not (path / "model.safetensors").is_file() else path
        if found is None:
            raise TrainSetupError(f"resume checkpoint {path} holds no complete checkpoint; nothing was started")
        return found

    def _make_source(self) -> Source:
        options, profile = self.options, self.profile
        if options.data_dir is not None:
            return OfflineSource(options.data_dir, profile, device=self.ctx.device)

        target = load_target(profile, device=self.ctx.device, placement=options.target_placement)
        if target.placement():
            self.log(f"target placed by {options.target_placement.describe() if options.target_placement else 'its device map'}: {target.placement()}")
        if is_tiny_target_dir(target.path):
            if options.extra_conversations:
                raise TrainSetupError("--extra-conversations needs a Hugging Face target (the tiny target makes its own data); nothing was trained")
            settings = options.tiny_data or tiny_data_settings(self.settings.seq_len, seed=self.settings.seed)
            splits = tiny_samples(target, settings, log=self.log)
        else:
            data_dir = data_dir_for(profile.paths.data_dir, profile.paths.run_dir, options.run_dir)  # moves with --run-dir
            conversations = options.conversations or Path(data_dir).expanduser() / "conversations.jsonl"
            splits = self._conversation_splits(target, conversations)
            template = options.chat_template.name if options.chat_template is not None else None
            self.val_data = {"conversations": str(Path(conversations).expanduser().resolve()), "chat_template": template}
            for extra in options.extra_conversations:
                splits = add_train_samples(splits, self._conversation_splits(target, extra), str(extra), self.log)
        return OnlineSource(target, splits, self._target_pass(target))

    def _target_pass(self, target) -> TargetPass:
        enabled, why_not = graphs_wanted(target, self.options.target_graphs, dict(os.environ))
        if not enabled and target.device.type == "cuda":
            self.log(f"target pass: eager ({why_not})")
        return TargetPass(target, enabled, log=self._log_any_rank)

    def _conversation_splits(self, target, conversations: Path) -> dict:
        options = self.options
        return conversation_samples(
            target.tokenizer,
            conversations,
            self.settings.seq_len,
            seed=self.settings.seed,
            target=target,
            regenerate_tokens=options.regenerate_tokens,
            chat_template=options.chat_template,
            log=self.log,
        )

    def _fresh_draft(self, source: Source, config: DraftModelConfig) -> Eagle3Draft:
        size = source.size("train")
        mine = list(range(self.ctx.rank, size, self.ctx.world_size))
        counts = self.ctx.all_reduce(count_tokens(source.token_batches("train", mine), config.vocab_size).to(self.ctx.device)).cpu()
        d2t, t2d = build_vocab_mapping(counts, config.draft_vocab_size)
        self.log(f"draft vocab: {config.draft_vocab_size} of {counts.numel()} ids cover {100 * coverage(counts, t2d):.1f}% of trained tokens")
        draft = Eagle3Draft(config, attn_backend=self.options.attn_backend)
        draft.load_target_embedding(source.embed_weight().float())
        draft.set_vocab_mapping(d2t, t2d)
        if self.options.draft_head == "target":
            lm_head, norm = source.head_weights()
            try:
                draft.load_target_head(lm_head.float(), None if norm is None else norm.float())
            except ValueError as error:
                raise TrainSetupError(f"--draft-head target: {error}; nothing was trained") from error
            norm_note = "the target's final norm" if norm is not None else "ones (the target has no final norm this reads)"
            self.log(f"draft lm_head: the target's rows of the draft vocabulary; norm: {norm_note}")
        return draft

    def _load_resume(self, checkpoint: Path, source: Source, config: DraftModelConfig) -> tuple[Eagle3Draft, dict]:
        """The checkpoint's weights and training state; d2t/t2d come from it, never from the data. Sets start_step,
        tokens and latest_val, and max_steps when the checkpoint is past the profile's plan and none was given."""
        from backend.train.checkpoint import load_checkpoint

        draft, saved_config, meta, state = load_checkpoint(checkpoint, target_embedding=source.embed_weight().float())
        ours = config.as_dict()
        theirs = saved_config.as_dict()
        differs = [k for k in ours if k not in ("torch_dtype", "ttt_length") and ours[k] != theirs.get(k)]
        if differs:
            raise TrainSetupError(
                f"checkpoint {checkpoint} has a different draft shape ({', '.join(f'{k}: {theirs.get(k)} vs this run {ours[k]}' for k in differs)}; "
                "the profile's unless --draft-intermediate-size is given); nothing was resumed"
            )
        draft = draft.float()
        if self.options.attn_backend:
            draft.set_attention_backend(self.options.attn_backend)
        state = state or {}
        self.start_step = int(state.get("step", meta.get("step", 0)))
        self.tokens = int(state.get("tokens", 0))
        self.latest_val = dict(state.get("latest_val") or {})
        self.seconds_before = float(state.get("seconds_of_steps", 0.0))
        spent = f", {self.seconds_before:.0f} s of steps before" if "seconds_of_steps" in state else " (it does not record its seconds of steps)"
        self.log(f"resumed from {checkpoint} at step {self.start_step}{spent}; d2t/t2d taken from the checkpoint")
        if self.options.max_steps is None and self.start_step >= self.settings.max_steps:
            # Past the profile's plan and no --max-steps: continue for another profile's worth of steps.
            self.settings = dataclasses.replace(self.settings, max_steps=self.start_step + self.profile.train.max_steps)
            self.log(
                f"no --max-steps given and the checkpoint is past the profile's {self.profile.train.max_steps}: training to step {self.settings.max_steps}"
            )
        return draft, state

    def _open_outputs(self, out_dir: Path, resume_dir: Path | None) -> None:
        if not self.ctx.is_main:
            return

        # On a full disk the writer keeps records in memory and retries; the job log says when it fails and recovers.
        self.metrics = MetricsWriter(out_dir / METRICS_FILENAME, on_error=self.log)
        if self.options.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        run = {
            "profile": self.profile.name,
            "settings": self.settings.record(),
            "target": self.source.describe_target(),
            "data": str(self.options.data_dir) if self.options.data_dir else "online",
            "resumed_from": str(resume_dir) if resume_dir else None,
            "world_size": self.ctx.world_size,
            "started": time.time(),
            "pid": os.getpid(),
        }
        write_atomic(out_dir / RUN_FILE, json.dumps(run, indent=1, default=str) + "\n", mode=PRIVATE_FILE)  # argv may hold paths and tokens

    # --- steps -----------------------------------------------------------------------------------

    def _forward(self, batch: TrainBatch, module: torch.nn.Module) -> TTTLoss:
        """Teacher (once per batch; bf16 probabilities in mixed mode), TTT unroll, fused lm_head + loss. No host sync."""
        parts = self.parts
        probs_dtype = torch.bfloat16 if parts.mixed else None
        teacher = make_teacher(
            batch.target_logits,
            batch.loss_mask,
            parts.draft.t2d,
            draft_ids=parts.draft_ids,
            probs_dtype=probs_dtype,
            temperature=self.settings.teacher_temperature,
        )
        batch.target_logits = None  # [B, S, V]: not needed past the teacher; free it before the unroll
        aux = batch.aux_hidden.to(parts.draft.fc.weight.dtype)
        _total, result = module(aux, batch.input_ids, teacher)
        return result

    def train_step(self, step: int) -> tuple[TTTLoss, torch.Tensor, float]:
        """One optimizer step; returns (loss result, pre-clip grad norm tensor, lr)."""
        parts = self.parts
        if parts.prefetcher is not None:
            batch = parts.prefetcher.next_batch(self.ctx.device)
        else:
            batch = parts.source.batch("train", parts.sampler.next(), self.ctx.device)
        tokens = batch.tokens or batch.input_ids.numel()
        rows, seq = batch.input_ids.shape
        self.last_step_flops = rows * step_flops(parts.draft_config, seq, self.settings.ttt_length)
        parts.optimizer.zero_grad(set_to_none=True)
        result = self._forward(batch, parts.model)
        del batch
        result.total.backward()
        self.updating = True
        grad_norm, lr = self._optimizer_step(step)
        self.updating = False
        self.tokens += tokens * self.ctx.world_size
        return result, grad_norm, lr

    def _optimizer_step(self, step: int) -> tuple[torch.Tensor, float]:
        """Grokfast, clip (pre-clip norm returned as a tensor: no sync), AdamW; in mixed mode on the fp32 masters."""
        parts = self.parts
        masters = [p for _, p in parts.master_named]
        if parts.mixed:
            with torch.no_grad():
                for (_, param), master in zip(parts.trainable, masters):
                    master.grad = param.grad.float() if param.grad is not None else torch.zeros_like(master)
                    param.grad = None
        if parts.grokfast is not None:
            parts.grokfast.apply(parts.master_named)
        grad_norm = torch.nn.utils.clip_grad_norm_(masters, self.settings.grad_clip, foreach=True)
        lr = parts.schedule.lr_at(step)
        for group in parts.optimizer.param_groups:
            group["lr"] = lr
        parts.optimizer.step()
        if parts.mixed:
            with torch.no_grad():
                torch._foreach_copy_([p for _, p in parts.trainable], masters)
                for master in masters:
                    master.grad = None
        return grad_norm, lr

    def checkpoint_module(self) -> torch.nn.Module:
        """What checkpoints and weight norms read: the draft, with fp32 master weights in mixed mode."""
        parts = self.parts
        return _MasterView(parts.draft, parts.master_named) if parts.mixed else parts.draft

    def data_state(self) -> dict:
        """Where the next training batch comes from (what a resume continues with)."""
        parts = self.parts
        if self.resume_data is not None:  # a step failed while stopping: its batch is trained again on resume
            return dict(self.resume_data)
        return parts.prefetcher.consumed_state() if parts.prefetcher is not None else parts.sampler.state_dict()

    @property
    def epoch_progress(self) -> float:
        state = self.data_state()
        return state["epoch"] + state["cursor"] / self.parts.sampler.batches_per_epoch

    def evaluate(self) -> dict:
        s, ctx, parts = self.settings, self.ctx, self.parts
        limit = None if self.options.max_val_batches is None else self.options.max_val_batches * s.batch_size * ctx.world_size
        interval = _Interval(s.ttt_length, ctx.device)
        module = _TTTModule(parts.draft, s.ttt_length, parts.compiled, keep_hits=True)
        chains = self.simulated_chains()
        rounds = torch.zeros(len(chains), s.ttt_length + 1, dtype=torch.float64)
        parts.draft.eval()
        with torch.no_grad():
            for indices in eval_batches(parts.source.size("val"), s.batch_size, ctx.rank, ctx.world_size, limit):
                result = self._forward(parts.source.batch("val", indices, ctx.device), module)
                interval.add(result)
                for row, steps in enumerate(chains):
                    histogram = chain_round_histogram(result.hits, result.scored, steps)
                    rounds[row, : len(histogram)] += torch.tensor(histogram, dtype=torch.float64)
        parts.draft.train()
        reduced = interval.reduced(ctx)
        reduced.pop("steps")
        summed = ctx.all_reduce(rounds.to(ctx.device)).tolist()
        reduced["rounds"] = {str(steps): [int(v) for v in summed[row][: steps + 1]] for row, steps in enumerate(chains)}
        reduced["accept_sim"] = {key: rounds_accept_length(histogram) for key, histogram in reduced["rounds"].items()}
        return reduced

    def served_steps(self) -> int | None:
        """The draft steps the profile serves with (its [serve] num_steps), None where it names none."""
        served = getattr(getattr(self.profile, "serve", None), "num_steps", None)
        return served if isinstance(served, int) else None

    def simulated_chains(self) -> list[int]:
        """Draft-step counts whose chain rounds validation replays: the profile's served num_steps and the TTT length."""
        served, ttt = self.served_steps(), self.settings.ttt_length
        return sorted({ttt} | ({served} if served is not None and 0 < served <= ttt else set()))

    def _loop(self) -> None:
        s, ctx = self.settings, self.ctx
        interval = _Interval(s.ttt_length, ctx.device)
        self.step = self.start_step
        if self.step >= s.max_steps:
            self.log(f"already at step {self.step} >= max steps {s.max_steps}; nothing to train")
            return
        left = None if self.options.max_seconds is None else self.options.max_seconds - self.seconds_before
        if left is not None and left <= 0:
            self.log(
                f"the time budget of {self.options.max_seconds:g} s is spent ({self.seconds_before:.0f} s of steps up to step {self.step}); nothing to train"
            )
            return
        steps = f"steps {self.step + 1}..{s.max_steps}" if left is None else f"{left:g} s of steps from step {self.step + 1}"
        if left is not None and self.seconds_before:
            steps += f" (--max-seconds {self.options.max_seconds:g} less {self.seconds_before:.0f} s spent before)"
        setup = f" (setup {time.monotonic() - self.run_started:.1f} s)" if self.run_started is not None else ""
        teacher = "" if s.teacher_temperature == 1.0 else f", teacher temperature {s.teacher_temperature:g}"
        self.log(f"training {steps}: batch {s.batch_size} x {ctx.world_size} rank(s), lr {s.lr} ({s.schedule}), TTT {s.ttt_length}{teacher}{setup}")
        served = self.served_steps()
        if served is not None and served > s.ttt_length:
            self.log(
                f"the profile serves {served} draft steps, more than the {s.ttt_length} this run trains (TTT): steps past "
                f"{s.ttt_length} are drafted untrained, and validation replays chains of {s.ttt_length} steps only"
            )
        self._beat("train")
        if self.options.eval_at_start and self.step == 0 and not self._unless_stopping(self._validate)[0]:
            return
        self.steps_started = time.monotonic()
        budget = None if left is None else TimeBudget(left, self.step, self.steps_started, cap=s.max_steps)
        last_saved = last_eval = None
        self.peak_rate = matmul_peak_rate(ctx.device)
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        timer = time.perf_counter()
        interval_tokens = 0
        interval_flops = 0.0
        while self.step < self.settings.max_steps:
            tokens_before = self.tokens
            done, stepped = self._unless_stopping(self.train_step, self.step)
            if not done or stepped is None:
                return
            result, grad_norm, lr = stepped
            self.step += 1
            self._beat()
            interval.add(result)
            interval_tokens += self.tokens - tokens_before
            interval_flops += self.last_step_flops
            if budget is not None:
                budget.observe(self.step, time.monotonic())
            if budget is not None and self.step % s.log_interval == 0:
                self._refit_to_budget(budget)
            if self.step % s.log_interval == 0 or self.step == self.settings.max_steps:
                values = interval.reduced(ctx)  # host sync: the wall time below covers finished GPU work
                elapsed = time.perf_counter() - timer
                values["step_time"] = elapsed / max(1, values.pop("steps") // ctx.world_size)
                values.update(self._speed(elapsed, interval_tokens, interval_flops))
                self._write_train(values, float(grad_norm), lr)
                interval.reset()
                interval_tokens, interval_flops = 0, 0.0
                timer = time.perf_counter()
            if self.step % s.eval_interval == 0:
                if not self._unless_stopping(self._validate)[0]:
                    return
                last_eval = self.step
            stopping = self._stop_requested()
            if stopping or self.step % s.save_interval == 0:
                self._save()
                last_saved = self.step
            if stopping:
                self.stopped = True
                by = signal.Signals(self.stop_signal).name if self.stop_signal else "a signal on another rank"
                outcome = "checkpoint written" if self.last_save_ok else "the checkpoint could NOT be written (see above)"
                self.log(f"stopped by {by} after step {self.step}; {outcome}")
                self._flush_metrics()
                return
            if budget is not None and self._on_any_rank(budget.expired(time.monotonic())):
                self.log(f"the time budget of {self.options.max_seconds:g} s is spent after step {self.step}")
                break
            if last_eval == self.step or last_saved == self.step:
                timer = time.perf_counter()  # step_time measures training steps only
                interval_tokens, interval_flops = 0, 0.0
        if last_eval != self.step:
            self._validate()
        if last_saved != self.step:
            self._save()
        self._flush_metrics()
        target_pass = getattr(self.parts.source, "target_pass", None)
        passes = f"; the target's pass: {target_pass.describe()}" if target_pass is not None and target_pass.enabled else ""
        self.log(f"done: {self.step} steps{passes}" + ("" if self.last_save_ok else "; the final checkpoint was NOT saved"))

    def _unless_stopping(self, work: Callable[..., T], *args: Any) -> tuple[bool, T | None]:
        """(True, work(*args)), or (False, None) when it fails after a stop signal arrived: the stop's SIGTERM to the process group also
        reaches this trainer's children (on the H200, 2026-12-03, a ptxas of an Inductor compile died mid-kernel and the
        run ended in a traceback with no checkpoint). Then the last whole step is checkpointed, the data where it was."""
        data_before = self.data_state() if self._parts is not None else None
        try:
            return True, work(*args)
        except Exception as exc:
            if self.stop_signal is None or self.ctx.enabled:  # no stop asked, or ranks that would wait for this one
                raise
            what = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
            by = signal.Signals(self.stop_signal).name
            self.stopped = True
            if self.updating:
                self.last_save_ok = False
                self.log(f"step {self.step + 1} failed inside its weight update after {by} ({what}); no checkpoint written, the last one stays")
            elif self.step == self.start_step:
                self.log(f"stopped by {by} before step {self.step + 1} ({what}); nothing trained, no checkpoint written")
            else:
                self.resume_data = data_before
                self.log(f"{work.__name__} after step {self.step} failed after {by} ({what}): its signal reached a child; saving step {self.step}")
                self._save()
                outcome = "checkpoint written" if self.last_save_ok else "the checkpoint could NOT be written (see above)"
                self.log(f"stopped by {by} after step {self.step}; {outcome}")
            self._flush_metrics()
            return False, None

    def _refit_to_budget(self, budget: TimeBudget) -> None:
        """The cosine (and the step count) re-fitted to end at the budget's deadline; every rank takes the largest fit."""
        total = budget.fitted_total(self.step, time.monotonic())
        if total is None:
            return
        if self.ctx.enabled:
            agreed = torch.tensor([float(total)], device=self.ctx.device)
            self.ctx.all_reduce(agreed, op=dist.ReduceOp.MAX)
            total = int(agreed.item())
        self.settings = dataclasses.replace(self.settings, max_steps=total)
        if self._parts is not None:
            self._parts.schedule.total_steps = max(1, total)

    def _on_any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any (an all-reduce under torchrun)."""
        if not self.ctx.enabled:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=self.ctx.device)
        self.ctx.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def _beat(self, phase: str | None = None) -> None:
        if self.heartbeat is not None:
            self.heartbeat.beat(self.step, phase)

    def _flush_metrics(self) -> None:
        if self.metrics is None:
            return
        self.metrics.flush()
        if self.metrics.pending or self.metrics.lost_records:
            self.log(f"metrics: {self.metrics.pending} records could not be written, {self.metrics.lost_records} dropped")

    # --- outputs ---------------------------------------------------------------------------------

    def _speed(self, elapsed: float, tokens: int, flops: float) -> dict:
        """tokens_per_s (all ranks), mfu (this rank's analytic matmul FLOPs / time / measured peak), peak_mem_gib (this rank)."""
        elapsed = max(elapsed, 1e-9)
        if self.ctx.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.ctx.device) / 2**30
        else:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # process max RSS (KiB on Linux)
        return {"tokens_per_s": tokens / elapsed, "mfu": flops / elapsed / self.peak_rate if self.peak_rate else None, "peak_mem_gib": peak}

    def _write_train(self, values: dict, grad_norm: float, lr: float) -> None:
        if self.metrics is None:  # ranks other than 0
            return
        total, modules = weight_norms(self.checkpoint_module())
        record = {
            "step": self.step,
            "epoch": self.epoch_progress,
            "split": "train",
            **values,
            "lr": lr,
            "grad_norm": grad_norm,
            "weight_norm": total,
            "weight_norm_modules": modules,
            "tokens": self.tokens,
        }
        self.metrics.write(record)
        self._tensorboard("train", record)
        self.log(
            f"step {self.step}/{self.settings.max_steps} loss {values['loss']:.4f} acc0 {values['acc'][0]:.3f} lr {lr:.2e} grad {grad_norm:.3f} {values['step_time']:.3f} s/step"
        )

    def _validate(self) -> None:
        self._beat("validate")
        started = time.monotonic()
        values = self.evaluate()
        seconds = time.monotonic() - started  # compiles for new shapes show here (the step-0 validation's first)
        self._beat("train")
        self.latest_val = {"step": self.step, **values}
        if self.metrics is None:  # ranks other than 0
            return
        record = {"step": self.step, "epoch": self.epoch_progress, "split": "val", **values, "tokens": self.tokens}
        self.metrics.write(record)
        self._tensorboard("val", record)
        simulated = ", ".join(f"{value:.2f} at {steps} steps" for steps, value in values["accept_sim"].items() if value is not None)
        self.log(
            f"validation at step {self.step}: loss {values['loss']:.4f} acc {' '.join(f'{a:.3f}' for a in values['acc'])}"
            + (f"; chain rounds replayed: accept length {simulated}" if simulated else "")
            + f" ({seconds:.1f} s)"
        )

    def _tensorboard(self, split: str, record: dict) -> None:
        if self.tb is None:
            return
        for key in ("loss", "lr", "grad_norm", "weight_norm"):
            if key in record:
                self.tb.add_scalar(f"{split}/{key}", record[key], self.step)
        for key in ("ploss", "acc"):
            for index, value in enumerate(record.get(key, [])):
                self.tb.add_scalar(f"{split}/{key}_{index}", value, self.step)
        self.tb.flush()

    def seconds_of_steps(self) -> float:
        """Wall seconds of training steps in this run and the runs it resumes (validations and saves between steps included)."""
        return self.seconds_before + (0.0 if self.steps_started is None else time.monotonic() - self.steps_started)

    def training_state(self) -> dict:
        parts = self.parts
        return {
            "step": self.step,
            "epoch": self.epoch_progress,
            "tokens": self.tokens,
            "seconds_of_steps": self.seconds_of_steps(),
            "optimizer": parts.optimizer.state_dict(),
            "sampler": self.data_state(),
            "grokfast": parts.grokfast.state_dict() if parts.grokfast else None,
            "schedule": parts.schedule.describe(),
            "settings": self.settings.record(),
            "latest_val": self.latest_val,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "world_size": self.ctx.world_size,
            "profile": self.profile.name,
        }

    def _save(self) -> None:
        """Checkpoint; on a full disk say so and keep training (the next save retries), `latest` left as it was."""
        from backend.train.checkpoint import CheckpointDiskFullError, save_checkpoint

        self.last_save_ok = True
        self._beat("checkpoint")
        if self.ctx.is_main and self.out_dir is not None:  # an attached trainer (benchmarks) has no output dir
            parts = self.parts
            extra = {
                "val_acc": self.latest_val.get("acc"),
                "val_rounds": self.latest_val.get("rounds"),  # chain rounds replayed on validation (chain_round_histogram)
                "val_loss": self.latest_val.get("loss"),
                "val_acc_step": self.latest_val.get("step"),
                "trained_aux_width": parts.draft_config.aux_width,
                "target": parts.source.describe_target(),
                "profile": self.profile.name,
                "tokens": self.tokens,
            }
            if self.val_data is not None:  # where validation's prompts are: the canary asks those (serve/launch.py)
                extra["val_data"] = self.val_data
            try:
                path = save_checkpoint(
                    self.out_dir,
                    self.checkpoint_module(),
                    parts.draft_config,
                    epoch=int(self.epoch_progress),
                    step=self.step,
                    training_state=self.training_state(),
                    extra_meta=extra,
                )
                self.log(f"checkpoint: {path}")
            except CheckpointDiskFullError as exc:
                self.last_save_ok = False
                self.log(f"checkpoint at step {self.step} NOT saved: {exc}")
        self.ctx.barrier()
        self._beat("train")


def _private_outputs(out_dir: Path) -> None:
    """A reused output dir's checkpoints/ and metrics.jsonl tightened to 0700/0600 before anything is written; refused
    when either is a link or another user's (checkpoint.py and jsonl.py keep new ones private)."""
    try:
        if os.path.lexists(out_dir / CHECKPOINTS_DIR):
            private_dir(out_dir / CHECKPOINTS_DIR)
        private_file_if_present(out_dir / METRICS_FILENAME)
    except ForeignPathError as exc:
        raise TrainSetupError(f"{exc}; nothing was trained") from None


def _check_widths(source: Source, config: DraftModelConfig) -> None:
    found = source.first_aux_width() if isinstance(source, OfflineSource) else source.aux_width
    check_feature_width(found, len(config.aux_layer_ids), config.target_hidden_size)
    if source.vocab_size != config.vocab_size:
        raise TrainSetupError(f"the data's vocab is {source.vocab_size} but the draft was configured for {config.vocab_size}")


def train(options: TrainOptions) -> int:
    return Trainer(options).run()
