"""The static decoder through the Triton kernels (Triton's interpreter here): every token and round the eager
SpecDecoder gives. Slow tests, apart from test_static_decode.py so that CI's workers share them (the
compiled steps: test_static_decode_compiled.py)."""

import pytest
import torch

from backend.serve.reference.static_decode import StaticDecoder
from tests.fixtures.drafts import AUX, prompts, random_target
from tests.fixtures.static_decoding import BRANCH_CASES, branches_give_the_plain_tokens, gives_the_eager_tokens_and_rounds, oracle_draft


pytestmark = pytest.mark.usefixtures("limited_torch_threads")


@pytest.mark.slow
def test_branches_with_the_triton_kernels_give_the_plain_tokens(triton_interpreter):
    """The tree's gaps through the Triton attention, its rows through the Triton linear (triton-all: a verify's rows
    too), in Triton's interpreter (each round costs seconds there: one case, 18 tokens, a second branch kept twice)."""
    branches_give_the_plain_tokens(3, 2, cases=BRANCH_CASES[1:], new_tokens=18, attention="triton", linear="triton-all", max_len=256)


@pytest.mark.slow
@pytest.mark.parametrize("linear", ["triton", "triton-all", "triton-rows"])
def test_the_triton_linear_gives_the_eager_tokens_and_rounds(linear, triton_interpreter):
    """triton: a plain step's and a chained draft step's products (norm, gate, bias and residual inside) in the
    Triton kernel; a verify's rows, the LM head if it were wide, and the prompt's in F.linear (triton_linear.prefers).
    triton-all: a verify's rows and the draft's commit rows in the kernel too; triton-rows: those rows as a row grid."""
    gives_the_eager_tokens_and_rounds(linear=linear)


@pytest.mark.slow
def test_the_row_grid_makes_speculation_bitwise_lossless_in_bfloat16(triton_interpreter):
    """linear "triton-rows" (auto on CUDA): each verify row's products are the one-row decode step's, bit for bit, so
    in bfloat16 EAGLE's greedy tokens are plain decoding's even where a wrong row's rounding would flip a token. With
    "triton" (a verify's rows through F.linear) this prompt's speculative tokens left plain decoding's at the fifth
    (2026-12-05, the interpreter here); on one H100 the row grid's equalled plain on 20 of 20 served prompts against
    9 of 20 (benchmarks/results/h200_round19_serve_decode_compiled_linear*.json, eagle_equals_plain)."""
    target = random_target().to(torch.bfloat16)
    draft = oracle_draft(target).to(torch.bfloat16)
    static = StaticDecoder(target, draft, AUX, num_steps=3, max_len=256, attention="triton", linear="triton-rows")
    prompt = prompts(1, seed=21)[0].tolist()
    plain = static.plain_generate(torch.tensor(prompt), 24)
    draft.setup(prompt + plain, {len(prompt) + i for i in (2, 3, 11, 12, 13)})
    spec = static.generate(torch.tensor(prompt), 24)
    assert spec.output_ids[:24] == plain
    assert 0 in spec.accepted_per_round and 3 in spec.accepted_per_round
