"""SGLang's speculative settings: what it runs, what it refuses and why, and the rows one verify holds."""

import pytest

from backend.serve.spec_setting import TreeSetting, verify_width


@pytest.mark.parametrize(
    ("text", "expected"),
    [("3,1,4", (3, 1, 4)), ("3,1", (3, 1, 4)), ("7,1", (7, 1, 8)), ("3,4,8", (3, 4, 8)), ("5,4,16", (5, 4, 16)), ("1,4,5", (1, 4, 5))],
)
def test_a_setting_reads_as_steps_topk_tokens(text, expected):
    setting = TreeSetting.parse(text)
    assert (setting.num_steps, setting.topk, setting.num_draft_tokens) == expected
    assert setting.label == ",".join(map(str, expected))


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("3,1,6", r"verifies num_steps \+ 1 = 4"),
        ("3,4,40", "between 2 and 37"),
        ("3,4,1", "between 2 and 37"),
        ("0,1", "at least 1"),
        ("3,4", "expected STEPS,TOPK,TOKENS"),
        ("three", "expected STEPS,TOPK,TOKENS"),
    ],
)
def test_a_setting_sglang_would_not_run_is_refused_with_the_reason(text, says):
    with pytest.raises(ValueError, match=says):
        TreeSetting.parse(text)


@pytest.mark.parametrize(
    ("flags", "served"),
    [((3, 1, None), (3, 1, 4)), ((3, 1, 4), (3, 1, 4)), ((3, 4, None), (3, 4, 4)), ((3, 4, 8), (3, 4, 8)), ((7, 8, 32), (7, 8, 32))],
)
def test_a_server_without_a_draft_token_count_runs_sglangs_steps_plus_one(flags, served):
    setting = TreeSetting.served(*flags)
    assert (setting.num_steps, setting.topk, setting.num_draft_tokens) == served


def test_a_server_refuses_a_chain_told_to_verify_more_than_its_steps():
    with pytest.raises(ValueError, match=r"verifies num_steps \+ 1 = 4"):
        TreeSetting.served(3, 1, 8)


@pytest.mark.parametrize(
    ("args", "rows"),
    [
        ((3,), 4),  # the chain: the last emitted token and 3 proposals
        ((7,), 8),
        ((3, 1, None, 2), 7),  # two first-step branches of 3 proposals each
        ((3, 1, None, 4), 13),
        ((3, 4, 8), 8),  # a tree verifies its draft tokens, the root included
        ((3, 4, None), 4),  # SGLang's default count
        ((5, 4, 16, 1), 16),
    ],
)
def test_a_verify_holds_the_root_and_every_proposal(args, rows):
    assert verify_width(*args) == rows
