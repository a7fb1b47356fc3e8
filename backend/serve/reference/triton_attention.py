"""Decode attention in Triton: a step's few query rows over the static KV cache, reading only the keys they may see.

A decode or verify step of StaticTarget has a handful of query rows per KV head (heads per group x step width) and
attends over a fixed cache prefix (`bucket`: the whole cache when compiled). SDPA reads the whole prefix (cuDNN's
flash kernel: 12.8 us a layer over 612 keys on an H200, 34 % of a compiled decode step). Here the prefix is cut into
blocks of keys, one program per (KV head, block) in the manner of flash-decoding: a block past the step's last
position loads nothing (masked loads) and costs only its launch slot, so the work follows the sequence's length,
not the cache's. A second kernel merges the blocks' partial softmaxes. Under CUDA graphs the grid is fixed per
bucket and the positions are read on the device, so one captured graph serves every position.

Row r of a KV head's query block is head r // seq of its group at position positions[r % seq], read where it lies
in the step's [1, seq, heads, d] query (heads_attention; decode_attention takes the grouped layout); with `gaps`,
row r also skips the keys in [gaps[r % seq, 0], gaps[r % seq, 1]) (a tree's other branches); with `tree` [seq, 2]
of (window start, bits), row r sees a key k of [start, start + 63) only where bit k - start of its bits is set (an
EAGLE tree's verify: a node sees its ancestors among the draft's slots). Softmax in float32; the probabilities are
rounded to the values' dtype before their product, as flash kernels do. On a machine without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1), which
is how the CPU tests check them against SDPA.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from backend.serve.reference import triton_runtime
from backend.serve.reference.triton_runtime import next_power_of_two

MAX_ROWS = 64  # query rows per KV head the kernel takes (steps); wider calls (a prompt) go to SDPA
MAX_BLOCKS = 128  # key blocks per KV head; a longer cache takes wider blocks
MIN_BLOCK = 64
TREE_WINDOW = 63  # draft slots a tree mask covers: the bits of an int64 below its sign


def unavailable_reason(device: torch.device, head_dim: int) -> str | None:
    """Why the Triton attention cannot run for this device and head size, or None when it can."""
    reason = triton_runtime.unavailable_reason(device)
    if reason is None and (head_dim < 16 or head_dim & (head_dim - 1)):
        return f"head_dim {head_dim} is not a power of two of at least 16"
    return reason


def fits(rows: int) -> bool:
    """Whether a call with `rows` query rows per KV head goes to the kernel (else SDPA)."""
    return rows <= MAX_ROWS


def block_size(bucket: int) -> int:
    """Keys per program: 64, or wider so that a long cache stays within MAX_BLOCKS programs per KV head."""
    return max(MIN_BLOCK, next_power_of_two(-(-bucket // MAX_BLOCKS)))


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def block_partials(
        q_ptr, k_ptr, v_ptr, pos_ptr, gap_ptr, tree_ptr, m_ptr, l_ptr, acc_ptr,
        seq, rows, bucket, scale, blocks, groups,
        stride_qhead, stride_qseq, stride_kh, stride_kn, stride_vh, stride_vn,
        ROWS: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr, PRECISE: tl.constexpr, GAPS: tl.constexpr, TREE: tl.constexpr,
    ):  # fmt: skip
        head, block = tl.program_id(0), tl.program_id(1)
        row = tl.arange(0, ROWS)
        key = block * BLOCK + tl.arange(0, BLOCK)
        dim = tl.arange(0, DIM)
        real = row < rows
        position = tl.load(pos_ptr + row % seq, mask=real, other=-1)
        key_needed = (key <= tl.max(position, axis=0)) & (key < bucket)  # past the last position: nothing is read
        q_row = (head * groups + row // seq) * stride_qhead + (row % seq) * stride_qseq  # query head, then position
        q = tl.load(q_ptr + q_row[:, None] + dim[None, :], mask=real[:, None], other=0.0)
        k = tl.load(k_ptr + head * stride_kh + key[:, None] * stride_kn + dim[None, :], mask=key_needed[:, None], other=0.0)
        v = tl.load(v_ptr + head * stride_vh + key[:, None] * stride_vn + dim[None, :], mask=key_needed[:, None], other=0.0)
        if PRECISE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        visible = (key[None, :] <= position[:, None]) & key_needed[None, :]
        if GAPS:  # [lo, hi) per row: the keys of a tree's other branches
            lo = tl.load(gap_ptr + (row % seq) * 2, mask=real, other=0)
            hi = tl.load(gap_ptr + (row % seq) * 2 + 1, mask=real, other=0)
            visible = visible & ((key[None, :] < lo[:, None]) | (key[None, :] >= hi[:, None]))
        if TREE:  # (window start, bits) per row: a key in the window is seen where its bit is set
            window = tl.load(tree_ptr + (row % seq) * 2, mask=real, other=0)
            bits = tl.load(tree_ptr + (row % seq) * 2 + 1, mask=real, other=0)
            offset = key[None, :] - window[:, None]
            inside = (offset >= 0) & (offset < 63)  # TREE_WINDOW
            seen = ((bits[:, None] >> tl.where(inside, offset, 0)) & 1) == 1
            visible = visible & (~inside | seen)
        scores = tl.where(visible, scores * scale, float("-inf"))
        peak = tl.max(scores, axis=1)  # -inf for a row that sees no key in this block: the merge gives it weight 0
        weights = tl.exp(scores - tl.where(peak == float("-inf"), 0.0, peak)[:, None])
        if PRECISE:
            acc = tl.dot(weights, v, input_precision="ieee")
        else:
            acc = tl.dot(weights.to(v.dtype), v)
        out = (head * blocks + block) * ROWS + row
        tl.store(m_ptr + out, peak)
        tl.store(l_ptr + out, tl.sum(weights, axis=1))
        tl.store(acc_ptr + out[:, None] * DIM + dim[None, :], acc)

    @triton.jit
    def merge_blocks(
        m_ptr, l_ptr, acc_ptr, o_ptr, blocks, seq, groups, stride_ohead, stride_oseq,
        ROWS: tl.constexpr, BLOCKS: tl.constexpr, DIM: tl.constexpr,
    ):  # fmt: skip
        head, row = tl.program_id(0), tl.program_id(1)
        block = tl.arange(0, BLOCKS)
        dim = tl.arange(0, DIM)
        used = block < blocks
        at = (head * blocks + block) * ROWS + row
        peaks = tl.load(m_ptr + at, mask=used, other=float("-inf"))
        top = tl.max(peaks, axis=0)
        scale = tl.where(peaks == float("-inf"), 0.0, tl.exp(peaks - top))
        total = tl.sum(scale * tl.load(l_ptr + at, mask=used, other=0.0), axis=0)
        acc = tl.load(acc_ptr + at[:, None] * DIM + dim[None, :], mask=used[:, None], other=0.0)
        out = tl.sum(acc * scale[:, None], axis=0) / total
        o_row = (head * groups + row // seq) * stride_ohead + (row % seq) * stride_oseq
        tl.store(o_ptr + o_row + dim, out.to(o_ptr.dtype.element_ty))

    return block_partials, merge_blocks


# An opaque custom op (registered at import; triton itself is imported at the first call): torch.compile keeps it
# as one call in its graph, shapes from the fake below, instead of breaking the graph around the kernels.
@torch.library.custom_op("eagle3::decode_attention", mutates_args=())
def heads_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    gaps: torch.Tensor | None = None,
    tree: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [1, len(positions), heads, d] in the step's own layout (a strided view of the QKV product is fine: rows
    are read where they lie, so a verify's rows need no copy into a grouped layout) over keys/values [1, kv_heads,
    bucket, d]; query head h reads KV head h // (heads / kv_heads); the row at positions[s] sees keys 0..positions[s],
    less its row of gaps and of tree as decode_attention says. Returns [1, len(positions), heads, d], contiguous (the
    output projection's input as a view), in the query's dtype."""
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("keys and values need unit stride along the head dimension")
    block_partials, merge_blocks = _kernels()
    _, seq, heads, dim = query.shape
    kv_heads, bucket = keys.shape[1], keys.shape[2]
    groups, rows = heads // kv_heads, heads // kv_heads * seq
    query = query if query.stride(-1) == 1 else query.contiguous()
    block = block_size(bucket)
    blocks = -(-bucket // block)
    padded_rows = max(16, next_power_of_two(rows))  # tl.dot takes 16 rows at least
    peaks = torch.empty(kv_heads, blocks, padded_rows, dtype=torch.float32, device=query.device)
    totals = torch.empty_like(peaks)
    partial = torch.empty(kv_heads, blocks, padded_rows, dim, dtype=torch.float32, device=query.device)
    out = torch.empty(1, seq, heads, dim, dtype=query.dtype, device=query.device)
    block_partials[(kv_heads, blocks)](
        query, keys, values, positions, positions if gaps is None else gaps.contiguous(), positions if tree is None else tree.contiguous(),
        peaks, totals, partial,
        seq, rows, bucket, scale, blocks, groups,
        query.stride(2), query.stride(1), keys.stride(1), keys.stride(2), values.stride(1), values.stride(2),
        ROWS=padded_rows, BLOCK=block, DIM=dim, PRECISE=query.dtype == torch.float32, GAPS=gaps is not None,
        TREE=tree is not None,
    )  # fmt: skip
    merge_blocks[(kv_heads, rows)](
        peaks, totals, partial, out, blocks, seq, groups, out.stride(2), out.stride(1),
        ROWS=padded_rows, BLOCKS=max(2, next_power_of_two(blocks)), DIM=dim,
    )  # fmt: skip
    return out


@heads_attention.register_fake
def _attend_shape(query, keys, values, positions, scale, gaps=None, tree=None) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    gaps: torch.Tensor | None = None,
    tree: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [1, kv_heads, rows, d] (rows = heads per group x len(positions), group-major) over keys/values
    [1, kv_heads, bucket, d] (strided views of the cache are fine); row r sees keys 0..positions[r % len(positions)],
    except, with gaps [len(positions), 2], the keys in [gaps[r % len, 0], gaps[r % len, 1]), and with tree
    [len(positions), 2] (int64 window start, bits) the keys of its window [start, start + TREE_WINDOW) whose bit is clear.
    Returns [1, kv_heads, rows, d] in the query's dtype."""
    kv_heads, rows, dim = query.shape[1], query.shape[2], query.shape[3]
    seq = positions.shape[0]
    by_position = query.reshape(1, kv_heads * rows // seq, seq, dim).transpose(1, 2)  # [1, seq, heads, d]
    out = heads_attention(by_position, keys, values, positions, scale, gaps, tree)
    return out.transpose(1, 2).reshape(1, kv_heads, rows, dim)
