"""Skinny linear layers in Triton: a step's few rows times a weight, with the RMSNorm before it and the residual after.

A decode or verify step of StaticTarget multiplies 1 to 16 rows by each weight. cuBLAS runs those products as small
GEMMs (on an H200 with torch 2.11, SmolLM2-135M: 3.6-3.9 us each for matrices of 0.7-3.5 MB, 471 us of a 0.81 ms
compiled step, 58 %; benchmarks/results/h200_round6_decode_profile.json), and the RMSNorm before a product and the
SiLU gate before the down projection are kernels of their own. Here one program computes a few output columns for
every row: it streams its slice of the weight once, normalises (or gates) the rows on the fly (the rows are tiny
and stay in cache, so every program redoes that), and adds the bias and the residual before it stores. Launched as a
row grid (launch's rows_per_program), each program takes a group of the rows instead, the weight slice read once per
group. The shared-tile kernel (launch's shared_tile; the linear kind "triton-tile") takes up to TILE_ROWS rows a
program at one row's tiles: each weight tile loaded once, each row multiplied by it with the one-row kernel's own code
(shared jit helpers), so each row equals the one-row kernel's bit for bit, as in the row grid, without reading the
weight once per row (not yet measured on a GPU).

Rounding follows the eager layer step by step (StaticTarget.forward): the RMSNorm in float32, rounded to the
dtype, then scaled by its weight and rounded; SiLU rounded, times up rounded; the product accumulated in float32,
plus bias, rounded; plus the residual, rounded. On a machine without a GPU the kernel runs in Triton's interpreter
(TRITON_INTERPRET=1), which is how the CPU tests check it.
"""

from __future__ import annotations

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
TILE_ROWS = 4  # rows one program of the shared-tile kernel holds (its accumulators acc0..acc3)


def fits(rows: int) -> bool:
    """Whether the kernel takes a call with `rows` rows at all."""
    return rows <= MAX_ROWS


def prefers(rows: int, columns: int, many_rows: bool = False, row_grid: bool = False, shared_tile: bool = False) -> bool:
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
    too, up to ROW_GRID_MAX_ROWS, each row the one-row kernel (static_decode's linear kind "triton-rows"). shared_tile:
    the same rows through the shared-tile kernel (the linear kind "triton-tile"; not yet measured on a GPU)."""
    several = (many_rows and fits(rows)) or ((row_grid or shared_tile) and rows <= ROW_GRID_MAX_ROWS)
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


def _kernel(shared_tile: bool) -> Any:
    """The shared-tile kernel or the row-loop one (triton is imported at the first launch)."""
    from backend.serve.reference import triton_linear_kernels

    return triton_linear_kernels.skinny_linear_tile if shared_tile else triton_linear_kernels.skinny_linear


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """[..., width] as [rows, width] with unit stride along the width (a view where it can be)."""
    flat = tensor.reshape(-1, tensor.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def launch(
    x, weight, bias, norm, eps: float, residual, gated: bool, tile: tuple[int, int, int] | None = None, rows_per_program: int = 0, shared_tile: bool = False
) -> torch.Tensor:
    """The kernel on x's rows (skinny_linear's arguments); `tile` (row, column, inner block) overrides tiles().
    rows_per_program (a power of two; 0: all of them): a row grid, each program taking that many rows of one column
    block. At 1 every row runs the one-row kernel at its tile (the weight tile read once per row, the later reads from
    L2), instead of one program per column block looping over every row. shared_tile: the shared-tile kernel instead,
    each program taking rows_per_program rows (1 to TILE_ROWS; 0: as many as there are, up to TILE_ROWS) of one column
    block at the one-row kernel's tiles, each weight tile loaded once and every row multiplied by it with the one-row
    kernel's code, so each row is the one-row kernel's bit for bit."""
    columns = weight.shape[0]
    inner = x.shape[-1] // 2 if gated else x.shape[-1]
    flat = _rows(x)
    rows = flat.shape[0]
    out = torch.empty(rows, columns, dtype=x.dtype, device=x.device)
    flat_residual = _rows(residual) if residual is not None else out
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    interpreted = x.device.type == "cpu"
    if shared_tile:
        kernel, row_block, column_block, inner_block = _shared_tile_blocks(rows, columns, inner, tile, rows_per_program, interpreted)
    else:
        kernel, row_block, column_block, inner_block = _row_loop_blocks(rows, columns, inner, tile, rows_per_program, interpreted)
    kernel[(-(-columns // column_block), -(-rows // row_block))](
        flat, weight, bias if bias is not None else out, norm if norm is not None else out, flat_residual, out,
        rows, columns, flat.stride(0), weight.stride(0), flat_residual.stride(0), out.stride(0), eps,
        INNER=inner, ROWS=row_block, BLOCK_N=column_block, BLOCK_K=inner_block,
        HAS_BIAS=bias is not None, HAS_NORM=norm is not None, HAS_RESIDUAL=residual is not None, GATED=gated,
    )  # fmt: skip
    return out.view(*x.shape[:-1], columns)


def _row_loop_blocks(rows: int, columns: int, inner: int, tile, rows_per_program: int, interpreted: bool) -> tuple[Any, int, int, int]:
    """(kernel, row, column and inner block) of the row-loop kernel (launch)."""
    if rows_per_program and rows_per_program != next_power_of_two(rows_per_program):
        raise ValueError(f"rows_per_program must be a power of two, got {rows_per_program}")
    group = min(rows_per_program, next_power_of_two(rows)) if rows_per_program else next_power_of_two(max(rows, 1))
    row_block, column_block, inner_block = tile or tiles(group, columns, inner, interpreted=interpreted)
    return _kernel(shared_tile=False), group if rows_per_program else row_block, column_block, inner_block


def _shared_tile_blocks(rows: int, columns: int, inner: int, tile, rows_per_program: int, interpreted: bool) -> tuple[Any, int, int, int]:
    """(kernel, row, column and inner block) of the shared-tile kernel (launch): one row's column and inner blocks."""
    if not 0 <= rows_per_program <= TILE_ROWS:
        raise ValueError(f"the shared tile takes 1 to {TILE_ROWS} rows a program, got {rows_per_program}")
    _, column_block, inner_block = tile or tiles(1, columns, inner, interpreted=interpreted)
    return _kernel(shared_tile=True), rows_per_program or max(1, min(rows, TILE_ROWS)), column_block, inner_block


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
    shared_tile: bool,
) -> torch.Tensor:
    return launch(x, weight, bias, norm, eps, residual, gated, rows_per_program=1 if row_grid else 0, shared_tile=shared_tile)


@_linear.register_fake
def _linear_shape(x, weight, bias, norm, eps, residual, gated, row_grid, shared_tile):
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
    shared_tile: bool = False,
) -> torch.Tensor:
    """residual + linear(rms_norm(x) * norm, weight, bias), each part optional; gated: x is gate | up and the input is
    silu(gate) * up. x [..., in] with at most MAX_ROWS rows; weight [out, in]; returns [..., out] in x's dtype.
    row_grid: the rows in programs of their own; shared_tile: up to TILE_ROWS rows a program against each weight tile
    loaded once (launch); either way each row is the one-row kernel's bit for bit."""
    rows = x.numel() // x.shape[-1]
    if not fits(rows):
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {rows}")
    if row_grid and shared_tile:
        raise ValueError("skinny_linear takes a row grid or a shared tile, not both")
    inner = x.shape[-1] // 2 if gated else x.shape[-1]
    if weight.shape[1] != inner or (norm is not None and norm.shape[0] != inner):
        raise ValueError(f"shapes: x {tuple(x.shape)} (gated={gated}), weight {tuple(weight.shape)}, norm {None if norm is None else tuple(norm.shape)}")
    return _linear(x, weight, bias, norm, float(eps), residual, gated, row_grid, shared_tile)
