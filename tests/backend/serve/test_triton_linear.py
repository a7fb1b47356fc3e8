"""The Triton skinny linear against the eager ops it replaces (RMSNorm, SiLU gate, F.linear, bias, residual), in
Triton's interpreter."""

import pytest
import torch
import torch.nn.functional as F

from backend.serve.reference.triton_linear import MAX_ROWS, ROW_GRID_MAX_ROWS, fits, launch, prefers, skinny_linear, tiles
from backend.serve.reference.triton_runtime import unavailable_reason

pytestmark = pytest.mark.usefixtures("triton_interpreter", "limited_torch_threads")

EPS = 1e-5


def eager(x, weight, bias=None, norm=None, residual=None, gated=False):
    """StaticTarget's eager layer ops, in their order."""
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    if norm is not None:
        x = norm * F.rms_norm(x.float(), (x.shape[-1],), eps=EPS).to(x.dtype)
    out = F.linear(x, weight, bias)
    return out if residual is None else residual + out


def operands(rows, columns, inner, seed, dtype=torch.float32, gated=False):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    x = randn(1, rows, 2 * inner if gated else inner)
    return x, randn(columns, inner, scale=inner**-0.5), randn(columns), randn(inner), randn(1, rows, columns)


PARTS = {  # (bias, norm, residual, gated): the four ways StaticTarget calls it, and a bare product
    "bare": (False, False, False, False),
    "qkv: norm + bias": (True, True, False, False),
    "o_proj: bias + residual": (True, False, True, False),
    "gate_up: norm": (False, True, False, False),
    "down: gate + residual": (False, False, True, True),
}


@pytest.mark.parametrize("parts", list(PARTS))
@pytest.mark.parametrize("rows, columns, inner", [(1, 40, 24), (4, 136, 72), (16, 8, 200)])
@pytest.mark.parametrize("gpu_tiles", [False, True], ids=["interpreter-tiles", "gpu-tiles"])
def test_equals_the_eager_ops(parts, rows, columns, inner, gpu_tiles):
    """Widths that are no multiple of any block; the GPU's small tiles (many programs, inner loops) and the
    interpreter's wide ones, so both sets of masks are exercised."""
    has_bias, has_norm, has_residual, gated = PARTS[parts]
    x, weight, bias, norm, residual = operands(rows, columns, inner, seed=rows * columns, gated=gated)
    kwargs = {"bias": bias if has_bias else None, "norm": norm if has_norm else None, "residual": residual if has_residual else None}
    expected = eager(x, weight, gated=gated, **kwargs)
    tile = tiles(rows, columns, inner) if gpu_tiles else None
    out = launch(x, weight, kwargs["bias"], kwargs["norm"], EPS, kwargs["residual"], gated, tile)
    assert out.shape == expected.shape == (1, rows, columns) and out.dtype == x.dtype
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(skinny_linear(x, weight, gated=gated, eps=EPS, **kwargs), out, atol=0, rtol=0)


@pytest.mark.parametrize(
    "parts, dtype", [(parts, torch.float32) for parts in PARTS] + [("qkv: norm + bias", torch.bfloat16), ("down: gate + residual", torch.bfloat16)]
)
def test_a_row_grid_computes_each_row_as_the_one_row_kernel_does(parts, dtype):
    """rows_per_program=1 (the linear kind "triton-rows"): each row in programs of its own, the one-row kernel's tiles
    and order, so every row equals that row alone, bit for bit, and the eager ops within rounding; the residual and
    the output are addressed per row (a residual with a row stride of its own included). At 2 rows a program, the
    last program's second row is masked off."""
    has_bias, has_norm, has_residual, gated = PARTS[parts]
    rows, columns, inner = 3, 136, 72
    x, weight, bias, norm, residual = operands(rows, columns, inner, seed=11, dtype=dtype, gated=gated)
    residual = torch.cat([residual, residual], dim=-1)[..., :columns] if has_residual else None  # row stride 2 x columns
    kwargs = {"bias": bias if has_bias else None, "norm": norm if has_norm else None, "residual": residual}
    for gpu_tiles in (False, True):
        tile = tiles(1, columns, inner) if gpu_tiles else None
        grid = launch(x, weight, kwargs["bias"], kwargs["norm"], EPS, residual, gated, tile, rows_per_program=1)
        alone = [
            launch(x[:, r : r + 1], weight, kwargs["bias"], kwargs["norm"], EPS, None if residual is None else residual[:, r : r + 1], gated, tile)
            for r in range(rows)
        ]
        assert torch.equal(grid, torch.cat(alone, dim=1))
    loose = {"atol": 2e-2, "rtol": 1.6e-2} if dtype == torch.bfloat16 else {"atol": 2e-6, "rtol": 1e-5}
    torch.testing.assert_close(grid.float(), eager(x, weight, gated=gated, **kwargs).float(), **loose)
    pairs = launch(x, weight, kwargs["bias"], kwargs["norm"], EPS, residual, gated, tiles(2, columns, inner), rows_per_program=2)
    torch.testing.assert_close(pairs.float(), eager(x, weight, gated=gated, **kwargs).float(), **loose)  # 2 + a masked 1
    torch.testing.assert_close(skinny_linear(x, weight, gated=gated, eps=EPS, row_grid=True, **kwargs), grid, atol=0, rtol=0)


def test_bfloat16_rounds_where_the_eager_ops_round():
    """Each eager op rounds its result to bf16 (norm, scale, SiLU, product, residual); the kernel rounds at the same
    places, so the two differ by accumulation order only: within one bf16 step of the values."""
    x, weight, bias, norm, residual = operands(4, 96, 64, seed=5, dtype=torch.bfloat16)
    expected = eager(x, weight, bias, norm, residual)
    out = skinny_linear(x, weight, bias, norm=norm, eps=EPS, residual=residual)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=1.6e-2)
    gated_x = operands(2, 32, 64, seed=6, dtype=torch.bfloat16, gated=True)[0]
    torch.testing.assert_close(skinny_linear(gated_x, weight[:32], gated=True).float(), eager(gated_x, weight[:32], gated=True).float(), atol=2e-2, rtol=1.6e-2)


def test_strided_rows_are_read_as_rows():
    """The attention's output reaches o_proj as a transposed view: it is made contiguous, not misread."""
    base = torch.randn(1, 3, 2, 8)  # [1, heads, seq, dim] -> [1, seq, heads * dim]
    x = base.transpose(1, 2).reshape(1, 2, 24)
    weight = torch.randn(10, 24)
    torch.testing.assert_close(skinny_linear(base.transpose(1, 2).flatten(2), weight), F.linear(x, weight), atol=2e-6, rtol=1e-5)


def test_tiles_spread_the_weight_and_bound_the_tile():
    for rows in (1, 4, 8, 16):
        for columns, inner in ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)):
            row_block, column_block, inner_block = tiles(rows, columns, inner)
            assert row_block >= rows and column_block * inner_block <= 4096 and row_block * inner_block <= 4096
            assert 128 <= -(-columns // column_block) <= 1024 and 2 <= column_block <= 64 and inner_block >= 16
            assert tiles(1, columns, inner)[1] == column_block
    assert tiles(3, 100, 30, interpreted=True) == (4, 128, 32)


def test_only_what_beat_cublas_on_the_h200_is_routed_to_the_kernel():
    """One row, outputs up to 8,192 wide (a decode step's qkv, o, gate_up, down); not a verify's rows nor an LM head."""
    assert prefers(1, 960) and prefers(1, 3072) and prefers(1, 8192)
    assert not prefers(4, 960) and not prefers(1, 49152) and not prefers(16, 576)
    # many_rows (the linear kind "triton-all"): a verify's rows too, within the kernel's rows; never the LM head
    assert prefers(4, 960, many_rows=True) and prefers(MAX_ROWS, 576, many_rows=True)
    assert not prefers(MAX_ROWS + 1, 576, many_rows=True) and not prefers(4, 49152, many_rows=True)
    # row_grid (the linear kind "triton-rows"): up to ROW_GRID_MAX_ROWS rows (a 16-row verify lost to cuBLAS on an H100)
    assert prefers(ROW_GRID_MAX_ROWS, 3072, row_grid=True) and prefers(2, 576, row_grid=True)
    assert not prefers(ROW_GRID_MAX_ROWS + 1, 576, row_grid=True) and not prefers(16, 576, row_grid=True)
    assert not prefers(4, 49152, row_grid=True)


def test_bad_calls_say_what_was_wrong():
    assert fits(MAX_ROWS) and not fits(MAX_ROWS + 1)
    with pytest.raises(ValueError, match="rows_per_program must be a power of two, got 3"):
        launch(torch.randn(1, 4, 8), torch.randn(4, 8), None, None, EPS, None, False, rows_per_program=3)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows, got 17"):
        skinny_linear(torch.randn(1, 17, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"shapes: x \(1, 2, 8\) \(gated=True\), weight \(4, 8\)"):
        skinny_linear(torch.randn(1, 2, 8), torch.randn(4, 8), gated=True)


def test_a_cpu_outside_the_interpreter_is_refused_with_the_reason(monkeypatch):
    assert unavailable_reason(torch.device("cpu")) is None
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "it needs a CUDA device" in unavailable_reason(torch.device("cpu"))
