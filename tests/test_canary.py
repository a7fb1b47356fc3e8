"""Canary arithmetic and verdicts: tau-hat, the zero-acceptance ceiling, red/amber/green, causes in order."""
import pytest

from backend.serve.canary import (
    AMBER,
    BROKEN_FEED_ACCEPT_LENGTHS,
    CAUSES,
    GREEN,
    MIN_TAU_HAT,
    RED,
    REPRODUCE_RATIO,
    feature_mismatch,
    judge,
    tau_hat,
    zero_acceptance_ceiling,
)

EAGLE3 = {"speculative_algorithm": "EAGLE3"}
GOOD_FEATURES = {"feature_width": 384, "expected_feature_width": 384, "feature_source": "aux", "fc_applied": True}


def test_tau_hat_is_one_plus_cumulative_products_truncated_to_served_steps():
    assert tau_hat([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert tau_hat([0.8] * 7, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert tau_hat([1.0] * 7, 5) == pytest.approx(6.0)  # the maximum of a 5-step chain
    assert tau_hat([0.9, 0.8], 5) == pytest.approx(1 + 0.9 + 0.72)  # fewer recorded steps than served
    assert tau_hat(None, 3) is None and tau_hat([], 3) is None


def test_zero_acceptance_ceiling_counts_the_prefill_token():
    # 4 requests of 64 tokens with nothing accepted: each request is 1 prefill token + 63 verify steps.
    completion, verify = 4 * 64, 4 * 63
    assert completion / verify <= zero_acceptance_ceiling(4, verify)
    assert 1.3 > zero_acceptance_ceiling(4, verify)


def verdict(accept, tau=4.0, features=None, info=EAGLE3, codes=(), requests=4, verify=200):
    return judge(accept_length=accept, requests=requests, sum_verify_ct=verify, tau=tau,
                 features=features or {}, server_info=info, preflight_codes=list(codes))


def test_green_when_close_to_tau_hat():
    color, headline, reasons, causes = verdict(3.6, features=GOOD_FEATURES)
    assert color == GREEN and reasons == [] and causes == []
    assert "3.60" in headline and "tau-hat 4.00" in headline


def test_red_zero_acceptance_lists_causes_in_catalog_order():
    color, headline, reasons, causes = verdict(1.0 + 4 / 200)
    assert color == RED and headline.startswith("zero acceptance")
    assert [c["id"] for c in causes] == [c["id"] for c in CAUSES]
    assert causes[0]["id"] == "algorithm" and "EAGLE3" in causes[0]["cause"]


def test_red_below_ratio_of_tau_hat():
    color, headline, _, causes = verdict(REPRODUCE_RATIO * 4.0 - 0.05)
    assert color == RED and headline.startswith("serving does not reproduce training")
    assert "distribution" in [c["id"] for c in causes]
    assert verdict(REPRODUCE_RATIO * 4.0 + 0.05)[0] == GREEN


def test_without_recorded_accuracy_only_zero_acceptance_is_judged():
    color, headline, _, _ = verdict(1.5, tau=None)
    assert color == GREEN and "only zero acceptance checked" in headline


def test_feature_mismatch_is_red_regardless_of_accept_length():
    broken = {"feature_width": 128, "expected_feature_width": 384, "feature_source": "last_hidden", "fc_applied": False}
    assert "width 128, expected 384" in feature_mismatch(broken)
    color, headline, reasons, causes = verdict(3.9, features=broken)
    assert color == RED and headline.startswith("draft receives the wrong features")
    assert causes[0]["id"] == "feature_feed" and causes[0]["evidence"]
    assert feature_mismatch(GOOD_FEATURES) is None and feature_mismatch({}) is None


def test_evidence_moves_confirmed_causes_first():
    _, _, _, causes = verdict(1.01, codes=["key_prefix", "vocab_map"])
    assert [c["id"] for c in causes[:2]] == ["key_prefix", "vocab_map"]
    assert causes[0]["evidence"] == "preflight reported key_prefix"
    assert causes[2]["id"] == "algorithm" and causes[2]["evidence"] is None


def test_wrong_algorithm_reported_by_server():
    color, headline, _, causes = verdict(1.01, info={"speculative_algorithm": "EAGLE"})
    assert color == RED and "not running EAGLE3" in headline
    assert causes[0]["id"] == "algorithm" and "'EAGLE'" in causes[0]["evidence"]


def test_no_verify_steps_is_red():
    color, headline, _, _ = verdict(None, verify=0)
    assert color == RED and "no speculative verify steps" in headline


# --- amber: a draft that has not learned yet cannot show that serving works ------------------------------------

UNTRAINED_TAU = tau_hat([0.002] * 7, 5)  # the 13-step draft of issue 12: val acc 0.2 %


def test_untrained_draft_is_amber_not_green_even_at_a_broken_feed_accept_length():
    color, headline, reasons, causes = verdict(1.41, tau=UNTRAINED_TAU, features=GOOD_FEATURES)
    assert color == AMBER and causes == []
    assert headline.startswith("inconclusive: the draft has not learned yet") and "tau-hat 1.00" in headline
    assert "1.25-1.44" in reasons[0] and "train longer" in reasons[1]


def test_untrained_draft_accepting_nothing_is_amber_not_red():
    color, headline, reasons, _ = verdict(1.0 + 4 / 200, tau=UNTRAINED_TAU)
    assert color == AMBER and "zero-acceptance line" in reasons[0]


def test_threshold_keeps_green_out_of_the_broken_feed_range_and_the_calibrated_draft_above_it():
    assert MIN_TAU_HAT == pytest.approx(max(BROKEN_FEED_ACCEPT_LENGTHS) / REPRODUCE_RATIO, abs=0.01)
    assert REPRODUCE_RATIO * MIN_TAU_HAT >= max(BROKEN_FEED_ACCEPT_LENGTHS)
    assert tau_hat([0.825] * 7, 5) > MIN_TAU_HAT  # the 300-step tiny draft the ratio was calibrated on (tau-hat 3.94)
    assert verdict(REPRODUCE_RATIO * MIN_TAU_HAT + 0.05, tau=MIN_TAU_HAT)[0] == GREEN
    assert verdict(3.0, tau=MIN_TAU_HAT - 0.01)[0] == AMBER


def test_evidence_of_broken_serving_stays_red_for_a_weak_draft():
    broken = {"feature_width": 128, "expected_feature_width": 384, "feature_source": "last_hidden", "fc_applied": False}
    assert verdict(1.41, tau=UNTRAINED_TAU, features=broken)[0] == RED
    assert verdict(1.41, tau=UNTRAINED_TAU, info={"speculative_algorithm": "EAGLE"})[0] == RED
    assert verdict(None, tau=UNTRAINED_TAU, verify=0)[0] == RED
    assert verdict(1.0, tau=2.2)[1].startswith("zero acceptance")  # it predicted 1.76+ and got nothing
    assert verdict(1.2, tau=2.2)[1].startswith("serving does not reproduce training")


def test_zero_acceptance_with_few_verify_steps_is_never_green():
    # 4 requests, 8 verify steps: the ceiling (1.52) lies above 0.6 x tau-hat (1.5); accepting nothing is still red.
    assert verdict(1.2, tau=2.5, verify=8)[0] == RED
