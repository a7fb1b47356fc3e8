"""triton_linear's kernels (imported at their first launch, so that the custom op registers without triton).

skinny_linear: one program per column block (and, as a row grid, per group of rows), its rows a [ROWS, ...] tile;
skinny_linear_tile: one program per column block and group of up to 4 rows, each weight tile loaded once and each
row against it at one row's shapes. Both are built from the row helpers below (`row`: a program's rows, [ROWS] in
the first, one row [1] in the second), so each row of the tile kernel runs the one-row kernel's code.
"""

import triton
import triton.language as tl


@triton.jit
def row_inverse(x_ptr, row, real_row, stride_x, eps, INNER: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / the RMS of each row's x, in float32: [ROWS]."""
    squares = tl.zeros([ROWS], dtype=tl.float32)
    for start in range(0, INNER, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row[:, None] * stride_x + k[None, :], mask=real_row[:, None] & (k < INNER)[None, :], other=0.0)
        x = x.to(tl.float32)
        squares += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(squares / INNER + eps)


@triton.jit
def prepared_x(
    x_ptr, row, real_row, stride_x, k, real_k, scale, inverse, dtype: tl.constexpr,
    INNER: tl.constexpr, HAS_NORM: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """The rows' input at inner block k, gated and normalised as the eager ops round, in float32: [ROWS, BLOCK_K]."""
    x = tl.load(x_ptr + row[:, None] * stride_x + k[None, :], mask=real_row[:, None] & real_k[None, :], other=0.0)
    if GATED:  # x holds gate | up: silu(gate) * up
        up = tl.load(x_ptr + row[:, None] * stride_x + INNER + k[None, :], mask=real_row[:, None] & real_k[None, :], other=0.0)
        gate = x.to(tl.float32)
        x = (gate * tl.sigmoid(gate)).to(dtype)
        x = (x.to(tl.float32) * up.to(tl.float32)).to(dtype)
    if HAS_NORM:
        x = (x.to(tl.float32) * inverse[:, None]).to(dtype)
        x = (x.to(tl.float32) * scale[None, :].to(tl.float32)).to(dtype)
    return x.to(tl.float32)


@triton.jit
def finish_rows(
    acc, bias_ptr, residual_ptr, out_ptr, row, real_row, column, real_column, stride_residual, stride_out,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """Stores the rows' accumulators [ROWS, BLOCK_N] plus the bias, rounded, plus the residual, rounded."""
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + column, mask=real_column, other=0.0).to(tl.float32)[None, :]
    out = acc.to(dtype)
    where = real_row[:, None] & real_column[None, :]
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row[:, None] * stride_residual + column[None, :], mask=where, other=0.0)
        out = (residual.to(tl.float32) + out.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row[:, None] * stride_out + column[None, :], out, mask=where)


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
    inverse = tl.full([ROWS], 1.0, tl.float32)  # without the norm: unused
    if HAS_NORM:
        inverse = row_inverse(x_ptr, row, real_row, stride_x, eps, INNER, ROWS, BLOCK_K)
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for start in range(0, INNER, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        real_k = k < INNER
        scale = tl.load(norm_ptr + k, mask=real_k & HAS_NORM, other=0.0)
        x = prepared_x(x_ptr, row, real_row, stride_x, k, real_k, scale, inverse, dtype, INNER, HAS_NORM, GATED)
        w = tl.load(w_ptr + column[:, None] * stride_w + k[None, :], mask=real_column[:, None] & real_k[None, :], other=0.0)
        w = w.to(tl.float32)
        if ROWS == 1:
            acc += tl.sum(w * x, axis=1)[None, :]
        else:  # the weight tile once, each row against it in turn: no rows x columns x inner tile in registers
            for r in tl.static_range(ROWS):
                x_row = tl.sum(tl.where(row[:, None] == r, x, 0.0), axis=0)
                acc = tl.where(row[:, None] == r, acc + tl.sum(w * x_row[None, :], axis=1)[None, :], acc)
    finish_rows(acc, bias_ptr, residual_ptr, out_ptr, row, real_row, column, real_column, stride_residual, stride_out, HAS_BIAS, HAS_RESIDUAL)


@triton.jit
def skinny_linear_tile(
    x_ptr, w_ptr, bias_ptr, norm_ptr, residual_ptr, out_ptr,
    rows, columns, stride_x, stride_w, stride_residual, stride_out, eps,
    INNER: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """ROWS (1 to 4: triton_linear.TILE_ROWS) rows of one column block: each weight tile loaded once, each row
    (row0..row3; those past ROWS dead code, those past `rows` masked) its own [1, BLOCK_K] input, [1, BLOCK_N]
    accumulator and [1] norm inverse, as in the one-row kernel."""
    tl.static_assert(ROWS <= 4)
    dtype = out_ptr.dtype.element_ty
    first_row = tl.program_id(1) * ROWS  # groups of ROWS rows: this program's first row
    x_ptr += first_row * stride_x
    residual_ptr += first_row * stride_residual
    out_ptr += first_row * stride_out
    column = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    real_column = column < columns
    row0 = tl.arange(0, 1)
    row1, row2, row3 = row0 + 1, row0 + 2, row0 + 3
    real0, real1, real2, real3 = row0 < rows - first_row, row1 < rows - first_row, row2 < rows - first_row, row3 < rows - first_row
    unused = tl.full([1], 1.0, tl.float32)  # an inverse without the norm
    inverse0, inverse1, inverse2, inverse3 = unused, unused, unused, unused
    if HAS_NORM:
        inverse0 = row_inverse(x_ptr, row0, real0, stride_x, eps, INNER, 1, BLOCK_K)
        if ROWS > 1:
            inverse1 = row_inverse(x_ptr, row1, real1, stride_x, eps, INNER, 1, BLOCK_K)
        if ROWS > 2:
            inverse2 = row_inverse(x_ptr, row2, real2, stride_x, eps, INNER, 1, BLOCK_K)
        if ROWS > 3:
            inverse3 = row_inverse(x_ptr, row3, real3, stride_x, eps, INNER, 1, BLOCK_K)
    zero = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    acc0, acc1, acc2, acc3 = zero, zero, zero, zero
    for start in range(0, INNER, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        real_k = k < INNER
        scale = tl.load(norm_ptr + k, mask=real_k & HAS_NORM, other=0.0)
        x = prepared_x(x_ptr, row0, real0, stride_x, k, real_k, scale, inverse0, dtype, INNER, HAS_NORM, GATED)
        w = tl.load(w_ptr + column[:, None] * stride_w + k[None, :], mask=real_column[:, None] & real_k[None, :], other=0.0)
        w = w.to(tl.float32)  # loaded once for every row, after row 0's x as in the one-row kernel
        acc0 += tl.sum(w * x, axis=1)[None, :]
        if ROWS > 1:
            x = prepared_x(x_ptr, row1, real1, stride_x, k, real_k, scale, inverse1, dtype, INNER, HAS_NORM, GATED)
            acc1 += tl.sum(w * x, axis=1)[None, :]
        if ROWS > 2:
            x = prepared_x(x_ptr, row2, real2, stride_x, k, real_k, scale, inverse2, dtype, INNER, HAS_NORM, GATED)
            acc2 += tl.sum(w * x, axis=1)[None, :]
        if ROWS > 3:
            x = prepared_x(x_ptr, row3, real3, stride_x, k, real_k, scale, inverse3, dtype, INNER, HAS_NORM, GATED)
            acc3 += tl.sum(w * x, axis=1)[None, :]
    finish_rows(acc0, bias_ptr, residual_ptr, out_ptr, row0, real0, column, real_column, stride_residual, stride_out, HAS_BIAS, HAS_RESIDUAL)
    if ROWS > 1:
        finish_rows(acc1, bias_ptr, residual_ptr, out_ptr, row1, real1, column, real_column, stride_residual, stride_out, HAS_BIAS, HAS_RESIDUAL)
    if ROWS > 2:
        finish_rows(acc2, bias_ptr, residual_ptr, out_ptr, row2, real2, column, real_column, stride_residual, stride_out, HAS_BIAS, HAS_RESIDUAL)
    if ROWS > 3:
        finish_rows(acc3, bias_ptr, residual_ptr, out_ptr, row3, real3, column, real_column, stride_residual, stride_out, HAS_BIAS, HAS_RESIDUAL)
