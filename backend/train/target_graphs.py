"""The target's pass of an online training step (aux states + teacher logits), replayed from a CUDA graph per batch shape.

Why: a SmolLM2-135M step of 16 sequences (10.5 k positions) took 75-83 ms on an H200 and one of 4 x 1,024 took 70 ms:
most of a step was host time, and the target's 30 eager transformers layers are 1,542 of its 2,609 kernel launches
(benchmarks/step_launches.py counts them on the CPU). One graph replay launches them all at once.

Training batches are right-padded (data.collate), so the target runs causal with no attention mask: every real position
sees exactly the keys it saw with the mask (padding only ever follows it), transformers takes SDPA's `is_causal` path
(flash attention, no [B, 1, S, S] mask, no host read of the mask), and the pass has no data-dependent branch to capture.
While a CUDA stream captures, transformers (5.17 on the H200 image) will not take that path: its mask skip checks
`is_tracing()`, which counts stream capture, and builds the full causal mask instead (the memory-efficient kernel over
every block). So the pass attends through an attention function of its own (causal_attention), registered with
transformers' AttentionInterface: no mask is built for it, and it calls transformers' SDPA with is_causal set.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import torch

    from backend.train.target import TargetModel

# Batch shapes given a graph of their own: grouped by length, round 18's batches of 16 come in 9 lengths of the bucket
# ladder (benchmarks/step_launches.py: 16 x 1,024 44 %, 16 x 256 21 %, ...; 5.6 GB of outputs in all), validation a
# few more. Each graph keeps its outputs (the logits: 1.6 GB at 16 x 1,024 x 49,152 in bf16): shapes past either
# limit run eager.
MAX_SHAPES = 16
MAX_OUTPUT_BYTES = 8 << 30
# Replay against eager, the first time a shape replays: the same kernels on the same inputs should agree to the last
# bit; a difference above this share of the largest logit means the capture recorded something else, so graphs go off.
CHECK_TOLERANCE = 1e-3


CAUSAL_ATTENTION = "eagle3-causal-sdpa"


def _causal_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with is_causal and no mask (what a right-padded batch's real positions need)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


@contextmanager
def causal_attention(model) -> Iterator[None]:
    """Inside, a model loaded with SDPA attends through _causal_sdpa (others are left as they are)."""
    config = model.config
    before = getattr(config, "_attn_implementation", None)
    if before != "sdpa":
        yield
        return
    from transformers import AttentionInterface

    AttentionInterface.register(CAUSAL_ATTENTION, _causal_sdpa)
    config._attn_implementation = CAUSAL_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # the static input the graph reads
    output: tuple[torch.Tensor, torch.Tensor]  # the static aux states and logits it writes (overwritten by every replay)
    checked: bool = False


def graphs_wanted(target: TargetModel, option: bool | None, environ: dict[str, str]) -> tuple[bool, str]:
    """(use graphs, why not): on a CUDA device for a target wholly on it, unless the option or EAGLE3_TARGET_GRAPHS=0 says no."""
    if option is False or (option is None and environ.get("EAGLE3_TARGET_GRAPHS", "1") == "0"):
        return False, "turned off"
    if target.device.type != "cuda":
        return False, f"the target runs on {target.device.type}"
    if target.placement():
        return False, "the target is placed over several devices"
    return True, ""


class TargetPass:
    """target.capture(input_ids) of a right-padded training batch: from a CUDA graph per (rows, length) when enabled.

    Each new shape is run eagerly twice on a side stream (warm-up: cuBLAS handles, lazy inits), captured into a graph
    of its own memory pool, and its first replay compared with an eager pass on the same ids. A refused capture, a
    mismatch or an out-of-memory turns graphs off for the rest of the run, with one log line saying why; eager serves
    from there. A replay's outputs stay valid until the next call with the same shape (a step uses them before the next).
    """

    def __init__(
        self, target: TargetModel, enabled: bool, log: Callable[[str], None] = print, max_shapes: int = MAX_SHAPES, max_output_bytes: int = MAX_OUTPUT_BYTES
    ):
        self.target = target
        self.enabled = enabled
        self.log = log
        self.max_shapes = max_shapes
        self.max_output_bytes = max_output_bytes
        self.graphs: dict[tuple[int, ...], _Graph] = {}
        self.off_reason: str | None = None if enabled else "not enabled"
        self.replays = 0

    def describe(self) -> str:
        if self.enabled and self.off_reason is None:
            return f"CUDA graphs ({len(self.graphs)} shape(s) captured, {self.replays} replays)"
        return f"eager ({self.off_reason})"

    def eager(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux states [B, S, 3H], logits [B, S, V]) of one causal pass, no mask."""
        with causal_attention(self.target.model):
            batch = self.target.capture(input_ids, None, with_logits=True)
        if batch.logits is None:
            raise RuntimeError("the target's capture returned no logits")
        return batch.aux_hidden, batch.logits

    def __call__(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.off_reason is not None:
            return self.eager(input_ids)
        shape = tuple(input_ids.shape)
        entry = self.graphs.get(shape)
        if entry is None:
            if not self._room_for(shape):
                return self.eager(input_ids)
            entry = self._guarded(f"capturing shape {shape}", self._capture, input_ids)
            if entry is None:
                return self.eager(input_ids)
            self.graphs[shape] = entry
        entry.input_ids.copy_(input_ids, non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        if not entry.checked and not self._guarded(f"checking shape {shape}", self._check, entry, input_ids):
            return self.eager(input_ids)
        return entry.output

    def output_bytes(self, shape: tuple[int, ...]) -> int:
        """What a graph of this batch shape keeps: its aux states and logits."""
        rows, length = shape
        width = self.target.aux_width + self.target.vocab_size
        return rows * length * width * self.target.dtype.itemsize

    def _room_for(self, shape: tuple[int, ...]) -> bool:
        held = sum(self.output_bytes(kept) for kept in self.graphs)
        return len(self.graphs) < self.max_shapes and held + self.output_bytes(shape) <= self.max_output_bytes

    def _guarded(self, what: str, work: Callable[..., Any], *args: Any) -> Any:
        """work(*args), or None after turning graphs off. A capture and its check wait for the GPU (once a shape):
        allowed even under torch.cuda.set_sync_debug_mode, which is there to catch the steps' own waits."""
        import torch

        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return work(*args)
        except Exception as exc:  # noqa: BLE001 - any failure of a capture means: run eager, and say why once
            self._turn_off(f"{what} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return None
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    def _turn_off(self, reason: str) -> None:
        self.off_reason = reason
        self.graphs.clear()
        self.log(f"target pass: CUDA graphs off, eager from here ({reason})")

    def _capture(self, input_ids: torch.Tensor) -> _Graph:
        import torch

        static = input_ids.clone()
        with torch.cuda.device(static.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.eager(static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # the trainer's other threads never touch this stream
                output = self.eager(static)
        return _Graph(graph, static, output)

    def _check(self, entry: _Graph, input_ids: torch.Tensor) -> bool:
        expected = self.eager(input_ids)
        worst = self._largest_difference(entry.output, expected)
        scale = max(1.0, float(expected[1].abs().max()))
        if worst > CHECK_TOLERANCE * scale:
            self._turn_off(f"a replay of shape {tuple(input_ids.shape)} differs from eager by {worst:.3g} (largest logit {scale:.3g})")
            return False
        entry.checked = True
        if len(self.graphs) == 1:
            self.log(f"target pass: CUDA graph of shape {tuple(input_ids.shape)} matches eager (largest difference {worst:.3g})")
        return True

    @staticmethod
    def _largest_difference(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> float:
        return max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
