"""The Triton decode attention against SDPA on the same rows, in Triton's interpreter (float32: its bf16 products are wrong)."""

import pytest
import torch
import torch.nn.functional as F

from backend.serve.reference.static_decode import visible_keys
from backend.serve.reference.triton_attention import MAX_ROWS, block_size, decode_attention, fits, heads_attention, unavailable_reason

pytestmark = pytest.mark.usefixtures("triton_interpreter", "limited_torch_threads")


def reference(query, keys, values, positions, groups, scale, gaps=None, tree=None):
    visible = visible_keys(keys.shape[2], positions, gaps, tree).repeat(groups, 1)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scale)


@pytest.mark.parametrize(
    "groups, positions, bucket",
    [
        (3, [0], 256),  # the first token: one key
        (3, [200], 256),  # plain decode
        (3, [120, 121, 122, 123], 300),  # a verify of 4 rows, a bucket that is no multiple of a block
        (3, [63, 64, 65, 66], 512),  # rows on both sides of a block edge
        (1, list(range(5, 21)), 64),  # 16 rows of one head per group: no padding
        (4, [1000], 1160),  # most blocks past the position: nothing read there
    ],
)
def test_equals_sdpa_over_the_keys_each_row_may_see(groups, positions, bucket):
    torch.manual_seed(len(positions) * bucket)
    kv_heads, dim, cache = 2, 64, 2048
    cache_keys = torch.randn(1, kv_heads, cache, dim)
    cache_values = torch.randn(1, kv_heads, cache, dim)
    where = torch.tensor(positions)
    query = torch.randn(1, kv_heads, groups * len(positions), dim)
    keys, values = cache_keys[:, :, :bucket], cache_values[:, :, :bucket]  # strided views, as StaticTarget passes them
    out = decode_attention(query, keys, values, where, dim**-0.5)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out, reference(query, keys, values, where, groups, dim**-0.5), atol=2e-6, rtol=1e-5)


def test_a_steps_query_is_read_where_it_lies_in_the_qkv_product():
    """A 4-row verify's query as StaticTarget slices it from its QKV product ([1, seq, heads, d], rows strided by the
    whole product's width): the output equals the grouped call's bit for bit and comes back [1, seq, heads, d]
    contiguous, so the output projection takes it as a view."""
    torch.manual_seed(9)
    kv_heads, groups, dim, seq = 3, 3, 64, 4
    heads = kv_heads * groups
    keys, values = torch.randn(1, kv_heads, 300, dim), torch.randn(1, kv_heads, 300, dim)
    where = torch.tensor([120, 121, 122, 123])
    qkv = torch.randn(1, seq, (heads + 2 * kv_heads) * dim)
    query = qkv[..., : heads * dim].view(1, seq, heads, dim)
    assert not query.is_contiguous()
    out = heads_attention(query, keys, values, where, dim**-0.5)
    assert out.shape == (1, seq, heads, dim) and out.is_contiguous()
    grouped = query.transpose(1, 2).reshape(1, kv_heads, groups * seq, dim)
    expected = decode_attention(grouped, keys, values, where, dim**-0.5).reshape(1, heads, seq, dim).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    sdpa = reference(grouped, keys, values, where, groups, dim**-0.5).reshape(1, heads, seq, dim).transpose(1, 2)
    torch.testing.assert_close(out, sdpa, atol=2e-6, rtol=1e-5)


def test_a_tree_verify_skips_each_rows_gap():
    """A verify of two branches of 3 after the row at slot 100 (StaticDecoder's tree layout): branch 1's rows skip
    branch 0's slots 101..103, across a block edge too (the gap is not a multiple of a block)."""
    torch.manual_seed(5)
    keys, values = torch.randn(1, 2, 256, 64), torch.randn(1, 2, 256, 64)
    slots = torch.arange(100, 107)
    gaps = torch.tensor([[100, 100], [101, 101], [101, 101], [101, 101], [101, 104], [101, 104], [101, 104]])
    query = torch.randn(1, 2, 3 * 7, 64)
    out = decode_attention(query, keys, values, slots, 0.125, gaps)
    torch.testing.assert_close(out, reference(query, keys, values, slots, 3, 0.125, gaps), atol=2e-6, rtol=1e-5)
    keys[:, :, 101:104], values[:, :, 101:104] = 1e4, -1e4  # what branch 1 must not see
    again = decode_attention(query, keys, values, slots, 0.125, gaps)
    branch_1 = [group * 7 + row for group in range(3) for row in (4, 5, 6)]
    torch.testing.assert_close(again[:, :, branch_1], out[:, :, branch_1], atol=0, rtol=0)


def test_a_tree_row_sees_its_ancestors_slots_and_no_other_node():
    """An EAGLE tree's verify at slots 100..106: root, nodes 0-1 under it, 2-3 under node 0, 4 under node 2, 5 under
    node 1; each row's bits name itself and its ancestors among the window [101, 164)."""
    torch.manual_seed(6)
    keys, values = torch.randn(1, 2, 256, 64), torch.randn(1, 2, 256, 64)
    slots = torch.arange(100, 107)
    ancestors = [set(), {0}, {1}, {0, 2}, {0, 3}, {0, 2, 4}, {1, 5}]
    tree = torch.tensor([[101, sum(1 << m for m in seen)] for seen in ancestors])
    query = torch.randn(1, 2, 3 * 7, 64)
    out = decode_attention(query, keys, values, slots, 0.125, tree=tree)
    torch.testing.assert_close(out, reference(query, keys, values, slots, 3, 0.125, tree=tree), atol=2e-6, rtol=1e-5)
    keys[:, :, 102], values[:, :, 102] = 1e4, -1e4  # node 1's slot: only rows 2 (itself) and 6 (its child) see it
    again = decode_attention(query, keys, values, slots, 0.125, tree=tree)
    blind = [group * 7 + row for group in range(3) for row in (0, 1, 3, 4, 5)]
    torch.testing.assert_close(again[:, :, blind], out[:, :, blind], atol=0, rtol=0)
    seeing = [group * 7 + row for group in range(3) for row in (2, 6)]
    assert not torch.allclose(again[:, :, seeing], out[:, :, seeing])


def test_keys_past_the_last_position_change_nothing():
    """What lies in the cache past a row's position (a rejected draft's rows, stale steps) never reaches its output."""
    torch.manual_seed(3)
    keys, values = torch.randn(1, 2, 256, 32), torch.randn(1, 2, 256, 32)
    query, where = torch.randn(1, 2, 8, 32), torch.tensor([40, 41, 42, 43])
    before = decode_attention(query, keys, values, where, 0.2)
    keys[:, :, 44:], values[:, :, 44:] = 1e4, -1e4
    torch.testing.assert_close(decode_attention(query, keys, values, where, 0.2), before, atol=0, rtol=0)


def test_a_long_cache_takes_wider_blocks_and_a_prompt_goes_to_sdpa():
    assert [block_size(n) for n in (256, 8192, 8193, 32768, 100_000)] == [64, 64, 128, 256, 1024]
    assert fits(MAX_ROWS) and not fits(MAX_ROWS + 1)


def test_what_cannot_run_says_why(monkeypatch):
    cpu = torch.device("cpu")
    assert unavailable_reason(cpu, 64) is None  # the interpreter (this suite)
    assert unavailable_reason(cpu, 48) == "head_dim 48 is not a power of two of at least 16"
    assert unavailable_reason(cpu, 8) == "head_dim 8 is not a power of two of at least 16"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert unavailable_reason(cpu, 64).startswith("it needs a CUDA device (the target is on cpu")
