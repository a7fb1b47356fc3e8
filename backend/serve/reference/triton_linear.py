"""Skinny linear layers in Triton: a step's few rows times a weight, with the RMSNorm before it and the residual after.

A decode or verify step of StaticTarget multiplies 1 to 16 rows by each weight. cuBLAS runs those products as small
GEMMs (on an H200 with torch 2.11, SmolLM2-135M: 3.6-3.9 us each for matrices of 0.7-3.5 MB, 471 us of a 0.81 ms
compiled step, 58 %; benchmarks/results/h200_round6_decode_profile.json), and the RMSNorm before a product and the
SiLU gate before the down projection are kernels of their own. Here one program computes a few output columns for
every row: it streams its slice of the weight once, normalises (or gates) the rows on the fly (the rows are tiny
and stay in cache, so every program redoes that), and adds the bias and the residual before it stores. Launched as a
row grid (launch's rows_per_program), each program takes a group of the rows instead, the weight slice read once per
group.

Rounding follows the eager layer step by step (StaticTarget.forward): the RMSNorm in float32, rounded to the
dtype, then scaled by its weight and rounded; SiLU rounded, times up rounded; the product accumulated in float32,
plus bias, rounded; plus the residual, rounded. On a machine without a GPU the kernel runs in Triton's interpreter
(TRITON_INTERPRET=1), which is how the CPU tests check it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from backend.serve.reference.triton_runtime import next_power_of_two

MAX_ROWS = 16  # rows a call may have (steps); a prompt goes to F.linear
MAX_TILE = 4096  # float32 values of a program's weight tile (columns x inner block), and of its rows tile
MAX_PREFERRED_COLUMNS = 8192  # wider outputs (an LM head) go to cuBLAS: prefers()
# Rows the row grid (launch's rows_per_program=1) takes; more go to cuBLAS: prefers(). On one H100 (2026-12-05, a
# trained SmolLM2 draft served, compiled steps, one call): a 4-row verify 1.068 ms against 1.098 with cuBLAS (the
# chain's rounds 1.39 against 1.45 ms, its tokens plain decoding's on 20 of 20 prompts against 9 of 20), the 4-beam
# draft steps of a 5,4,16 tree 0.844 against 0.897 ms a round, but its 16-row verify 2.015 against 1.212
# (benchmarks/results/h200_round19_serve_decode_compiled_linear*.json; 8 rows were not measured).
ROW_GRID_MAX_ROWS = 4


def fits(rows: int) -> bool:
    """Whether the kernel takes a call with `rows` rows at all."""
    return rows <= MAX_ROWS


def prefers(rows: int, columns: int, many_rows: bool = False, row_grid: bool = False) -> bool:
    """Whether a product of `rows` rows and `columns` outputs should go to the kernel rather than cuBLAS, as measured
    on one H200 (2026-12-03, profile_decode_step.py's linear_shapes, SmolLM2-135M's products, each alone under a
    CUDA graph): at one row the kernel with the norm / gate / residual inside took 2.0-4.1 us where cuBLAS alone
    took 3.2-4.8 us and the eager ops around it 4.8-10.7 us. Over several rows, each product alone: a rows x
    columns x inner register tile lost (4 rows: gate_up 12.8 vs 3.2 us); the loop over the rows against each
    weight tile (this kernel) beats cuBLAS alone at 2 rows (2.2-3.4 vs 3.2-4.7 us), is even at 4 (2.7-5.9 vs
    3.2-4.8) and loses at 8 (15-27 us); tl.dot over rows padded to 16, 16 columns a program, lost at every row count
    (2.9-5.7 us, the gated down projection 28), and inside whole compiled steps (4-row verify 1.75 vs 1.08 ms with
    cuBLAS; 2026-12-03, benchmarks/results/h200_round8_*). The 49,152-wide lm_head loses at any row count (17-42 vs
    16 us). many_rows: a step's rows too, up to MAX_ROWS (static_decode's linear kind "triton-all"): the row loop lost
    inside whole compiled steps too (2026-12-03, a trained draft served: a 4-row verify 1.48 vs 1.08 ms with cuBLAS,
    a 7-row one 5.48 vs 1.12; benchmarks/results/h200_round9_decode_compiled_linear*.json). row_grid: a step's rows
    too, up to ROW_GRID_MAX_ROWS, each row the one-row kernel (static_decode's linear kind "triton-rows")."""
    several = (many_rows and fits(rows)) or (row_grid and rows <= ROW_GRID_MAX_ROWS)
    return (rows == 1 or several) and columns <= MAX_PREFERRED_COLUMNS


def _power_of_two_at_most(value: int) -> int:
    return 1 << max(0, value.bit_length() - 1)


def tiles(rows: int, columns: int, inner: int, interpreted: bool = False) -> tuple[int, int, int]:
    """(row block, column block, inner block): on a GPU, enough programs to spread the weight over the H200's 132
    SMs (about 256, at most 64 columns each; the same for any number of rows), a weight tile and a rows tile of at
    most MAX_TILE float32 values each; in Triton's interpreter (interpreted), where each program costs milliseconds
    of Python, few wide programs."""
    row_block = next_power_of_two(max(rows, 1))
    if interpreted:
        return row_block, min(256, next_power_of_two(columns)), min(256, next_power_of_two(inner))
    column_block = min(64, max(2, _power_of_two_at_most(max(columns // 256, 1))))
    inner_block = max(16, min(next_power_of_two(inner), MAX_TILE // column_block, MAX_TILE // row_block))
    return row_block, column_block, inner_block


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def skinny_linear(
        x_ptr, w_ptr, bias_ptr, norm_ptr, residual_ptr, out_ptr,
        rows, columns, stride_x, stride_w, stride_residual, stride_out, eps,
        INNER: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
    ):  # fmt: skip
        dtype = out_ptr.dtype.element_ty
        first_row = tl.program_id(1) * ROWS  # a row grid (launch's rows_per_program): this program's first row; else 0
        x_ptr += first_row * stride_x
        residual_ptr += first_row * stride_residual
        out_ptr += first_row * stride_out
        row = tl.arange(0, ROWS)
        column = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        real_row, real_column = row < rows - first_row, column < columns
        if HAS_NORM:
            squares = tl.zeros([ROWS], dtype=tl.float32)
            for start in range(0, INNER, BLOCK_K):
                k = start + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + row[:, None] * stride_x + k[None, :], mask=real_row[:, None] & (k < INNER)[None, :], other=0.0)
                x = x.to(tl.float32)
                squares += tl.sum(x * x, axis=1)
            inverse = 1.0 / tl.sqrt(squares / INNER + eps)
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for start in range(0, INNER, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            real_k = k < INNER
            x = tl.load(x_ptr + row[:, None] * stride_x + k[None, :], mask=real_row[:, None] & real_k[None, :], other=0.0)
            if GATED:  # x holds gate | up: silu(gate) * up, rounded as the eager ops round
                up = tl.load(x_ptr + row[:, None] * stride_x + INNER + k[None, :], mask=real_row[:, None] & real_k[None, :], other=0.0)
                gate = x.to(tl.float32)
                x = (gate * tl.sigmoid(gate)).to(dtype)
                x = (x.to(tl.float32) * up.to(tl.float32)).to(dtype)
            if HAS_NORM:
                scale = tl.load(norm_ptr + k, mask=real_k, other=0.0)
                x = (x.to(tl.float32) * inverse[:, None]).to(dtype)
                x = (x.to(tl.float32) * scale[None, :].to(tl.float32)).to(dtype)
            w = tl.load(w_ptr + column[:, None] * stride_w + k[None, :], mask=real_column[:, None] & real_k[None, :], other=0.0)
            w, x = w.to(tl.float32), x.to(tl.float32)
            if ROWS == 1:
                acc += tl.sum(w * x, axis=1)[None, :]
            else:  # the weight tile once, each row against it in turn: no rows x columns x inner tile in registers
                for r in tl.static_range(ROWS):
                    x_row = tl.sum(tl.where(row[:, None] == r, x, 0.0), axis=0)
                    acc = tl.where(row[:, None] == r, acc + tl.sum(w * x_row[None, :], axis=1)[None, :], acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + column, mask=real_column, other=0.0).to(tl.float32)[None, :]
        out = acc.to(dtype)
        where = real_row[:, None] & real_column[None, :]
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + row[:, None] * stride_residual + column[None, :], mask=where, other=0.0)
            out = (residual.to(tl.float32) + out.to(tl.float32)).to(dtype)
        tl.store(out_ptr + row[:, None] * stride_out + column[None, :], out, mask=where)

    return skinny_linear


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """[..., width] as [rows, width] with unit stride along the width (a view where it can be)."""
    flat = tensor.reshape(-1, tensor.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def launch(x, weight, bias, norm, eps: float, residual, gated: bool, tile: tuple[int, int, int] | None = None, rows_per_program: int = 0) -> torch.Tensor:
    """The kernel on x's rows (skinny_linear's arguments); `tile` (row, column, inner block) overrides tiles().
    rows_per_program (a power of two; 0: all of them): a row grid, each program taking that many rows of one column
    block. At 1 every row runs the one-row kernel at its tile (the weight tile read once per row, the later reads from
    L2), instead of one program per column block looping over every row."""
    columns = weight.shape[0]
    inner = x.shape[-1] // 2 if gated else x.shape[-1]
    flat = _rows(x)
    rows = flat.shape[0]
    out = torch.empty(rows, columns, dtype=x.dtype, device=x.device)
    flat_residual = _rows(residual) if residual is not None else out
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    if rows_per_program and rows_per_program != next_power_of_two(rows_per_program):
        raise ValueError(f"rows_per_program must be a power of two, got {rows_per_program}")
    group = min(rows_per_program, next_power_of_two(rows)) if rows_per_program else next_power_of_two(max(rows, 1))
    row_block, column_block, inner_block = tile or tiles(group, columns, inner, interpreted=x.device.type == "cpu")
    row_block = group if rows_per_program else row_block
    _kernel()[(-(-columns // column_block), -(-rows // row_block))](
        flat, weight, bias if bias is not None else out, norm if norm is not None else out, flat_residual, out,
        rows, columns, flat.stride(0), weight.stride(0), flat_residual.stride(0), out.stride(0), eps,
        INNER=inner, ROWS=row_block, BLOCK_N=column_block, BLOCK_K=inner_block,
        HAS_BIAS=bias is not None, HAS_NORM=norm is not None, HAS_RESIDUAL=residual is not None, GATED=gated,
    )  # fmt: skip
    return out.view(*x.shape[:-1], columns)


# An opaque custom op (registered at import; triton itself is imported at the first call), as decode_attention is.
@torch.library.custom_op("eagle3::skinny_linear", mutates_args=())
def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    gated: bool,
    row_grid: bool,
) -> torch.Tensor:
    return launch(x, weight, bias, norm, eps, residual, gated, rows_per_program=1 if row_grid else 0)


@_linear.register_fake
def _linear_shape(x, weight, bias, norm, eps, residual, gated, row_grid):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    row_grid: bool = False,
) -> torch.Tensor:
    """residual + linear(rms_norm(x) * norm, weight, bias), each part optional; gated: x is gate | up and the input is
    silu(gate) * up. x [..., in] with at most MAX_ROWS rows; weight [out, in]; returns [..., out] in x's dtype.
    row_grid: the rows in programs of their own (launch)."""
    rows = x.numel() // x.shape[-1]
    if not fits(rows):
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {rows}")
    inner = x.shape[-1] // 2 if gated else x.shape[-1]
    if weight.shape[1] != inner or (norm is not None and norm.shape[0] != inner):
        raise ValueError(f"shapes: x {tuple(x.shape)} (gated={gated}), weight {tuple(weight.shape)}, norm {None if norm is None else tuple(norm.shape)}")
    return _linear(x, weight, bias, norm, float(eps), residual, gated, row_grid)
