"""The static decoder's steps through torch.compile (inductor on the CPU, the Triton kernels as opaque ops run by
Triton's interpreter): every token and round the eager SpecDecoder gives. Slow (~100-150 s a case), in a file of its
own so that CI's workers share it with test_static_decode_kernels.py."""

import pytest
import torch

from backend.serve.reference.spec_decode import SpecDecoder
from backend.serve.reference.static_decode import StaticDecoder
from tests.fixtures.drafts import AUX, VOCAB, prompts, random_target
from tests.fixtures.static_decoding import oracle_draft, same


pytestmark = pytest.mark.usefixtures("limited_torch_threads")


@pytest.mark.slow
@pytest.mark.parametrize("attention, linear", [("math", "torch"), ("triton", "triton"), ("triton", "triton-rows")])
def test_compiled_steps_with_math_or_triton_kernels_give_the_eager_tokens_and_rounds(attention, linear, request):
    """compile=True on CPU (~70-100 s of inductor each): the fused masked softmax between the two products, or the
    Triton kernels as opaque ops in the compiled graph (run by Triton's interpreter here; triton-rows: a verify's
    rows as a row grid), keep every token and round; the GPU captures these same compiled steps."""
    if attention == "triton":
        request.getfixturevalue("triton_interpreter")
    target = random_target()
    draft = oracle_draft(target)
    eager = SpecDecoder(target, draft, AUX, num_steps=3)
    static = StaticDecoder(target, draft, AUX, num_steps=3, max_len=256, compile=True, attention=attention, linear=linear)
    prompt = prompts(1, seed=14)[0].tolist()
    plain = eager.plain_generate(torch.tensor(prompt), 20)
    assert static.plain_generate(torch.tensor(prompt), 20) == plain
    draft.setup(prompt + plain, {len(prompt) + i for i in (1, 7, 8)})
    same(eager.generate(torch.tensor(prompt), 16), static.generate(torch.tensor(prompt), 16))
    # a caller with grad on (a profiler, a hook) and a draft whose parameters require grad: the compiled steps still
    # run (the Triton ops have no backward; a step traced for autograd failed to compile, 2026-12-03)
    assert torch.is_grad_enabled() and any(p.requires_grad for p in draft.parameters())
    static._draft_fn(static.max_len)
    static._verify_fn(static.max_len)
    assert 0 <= int(static.verify_tokens.min()) and int(static.verify_tokens.max()) < VOCAB
