"""Runtime canary: a few greedy /generate calls, the measured accept length, and a green/amber/red verdict with causes.

The accept length, tau-hat and per-position acceptance it judges are defined in backend/serve/acceptance.py.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from backend.serve import http
from backend.serve.acceptance import acceptance_report, histogram_from_meta, tau_hat

ZERO_ACCEPT_EPS = 0.02
# Red when measured < REPRODUCE_RATIO x tau-hat. Chosen from real runs of the tiny draft through the reference
# engine (docs/serving.md has the numbers): healthy serving lands near 0.8-1.1 x tau-hat, the broken feed
# (final hidden state instead of 3 aux layers) well below. SGLang-sized drafts also land above 0.6 when healthy
# (published accept lengths vs. their step-0..2 accuracies).
REPRODUCE_RATIO = 0.6
# Accept lengths the broken feed (final hidden state instead of the 3 aux layers) reached on those same calibration
# runs: the byte-level tiny target is predictable enough from the token context alone to accept some drafts anyway.
BROKEN_FEED_ACCEPT_LENGTHS = (1.25, 1.44)
# Below this tau-hat, green (accept length >= REPRODUCE_RATIO x tau-hat) would be reached by an accept length a
# broken feed gives, so a green says nothing: the verdict is amber, inconclusive. 1.44 / 0.6 = 2.4.
MIN_TAU_HAT = round(BROKEN_FEED_ACCEPT_LENGTHS[1] / REPRODUCE_RATIO, 2)

GREEN = "green"
AMBER = "amber"
RED = "red"


def zero_acceptance_ceiling(requests: int, verify_ct: int) -> float:
    return 1.0 + requests / max(verify_ct, 1) + ZERO_ACCEPT_EPS


# Likely causes, most likely first (reference/sglang-eagle3.md sections 3.3 and 6). "evidence" keys say which
# preflight problem code or server fact confirms one; confirmed causes are listed before the rest.
CAUSES: list[dict[str, Any]] = [
    {
        "id": "algorithm",
        "codes": ["algorithm"],
        "cause": "--speculative-algorithm EAGLE (or NEXTN) instead of EAGLE3: the target never captures the aux layers, "
        "hands the draft 1 x H and fc is skipped (sglang PR #21272)",
        "check": "GET /get_server_info speculative_algorithm must be EAGLE3; relaunch with --speculative-algorithm EAGLE3",
    },
    {
        "id": "aux_disabled",
        "codes": ["aux_disabled"],
        "cause": "eagle_config.use_aux_hidden_state is false in the draft config.json: same 1 x H feed",
        "check": "`eagle3-host preflight` (code aux_disabled); remove the flag",
    },
    {
        "id": "target_class",
        "codes": ["target_support"],
        "cause": "the target's SGLang class lacks aux capture, or a wrapper (VLM, KimiK25ForConditionalGeneration) drops "
        "aux_hidden_states before the logits processor (sglang PR #19689, #13904)",
        "check": "preflight on the host where sglang imports (code target_support); upgrade SGLang",
    },
    {
        "id": "aux_ids",
        "codes": ["aux_layers"],
        "cause": "aux layer ids differ from the ones trained on, or CUDA graphs were captured with SGLang's default ids "
        "before the configured ones were set (sglang PR #22836, fixed in 0.5.14)",
        "check": "compare eagle_config ids with eagle3_console.trained_aux_layer_ids; relaunch with --disable-cuda-graph and see if acceptance recovers",
    },
    {
        "id": "key_prefix",
        "codes": ["key_prefix"],
        "cause": "layers.0.* (or other unknown) weight names silently dropped by SGLang < 0.5.14: a random decoder layer",
        "check": "preflight code key_prefix; `eagle3-host convert SRC DST`",
    },
    {
        "id": "vocab_map",
        "codes": ["vocab_map"],
        "cause": "d2t missing or wrong while the draft vocab is smaller: draft ids are read as target ids",
        "check": "preflight code vocab_map",
    },
    {
        "id": "fc_shape",
        "codes": ["fc_shape"],
        "cause": "fc was trained for a different feature width than the target delivers (e.g. 7168 instead of 21504)",
        "check": "preflight code fc_shape",
    },
    {
        "id": "dtype",
        "codes": ["dtype"],
        "cause": "draft served in another dtype than trained (float32 config + --dtype auto serves float16)",
        "check": "preflight code dtype; pass --dtype explicitly",
    },
]
DISTRIBUTION_CAUSE = {
    "id": "distribution",
    "codes": [],
    "cause": "canary prompts unlike the training data, or validation accuracy measured on data unlike serving (chat template, language, domain)",
    "check": "rerun the canary with prompts from the training set; compare with `eagle3-host bench`",
}
FEATURE_CAUSE = {
    "id": "feature_feed",
    "codes": [],
    "cause": "the target hands the draft the wrong hidden state (final layer instead of the 3 aux layers): fc is "
    "skipped because the width already equals the draft hidden size",
    "check": "the engine reported feature width/source below; serve with the aux feed (EAGLE3, aux capture enabled)",
}


@dataclass
class CanaryRequest:
    prompt_chars: int
    completion_tokens: int
    verify_ct: int
    accept_length: float | None
    latency_s: float
    error: str | None = None
    histogram: list[int] | None = None  # spec_correct_drafts_histogram, checked against the counts beside it
    histogram_note: str | None = None  # why histogram is None


@dataclass
class CanaryResult:
    verdict: str  # green | amber | red
    headline: str
    reasons: list[str]
    causes: list[dict[str, Any]]
    accept_length: float | None  # sum(completion) / sum(verify_ct)
    server_avg_accept_length: float | None
    tau_hat: float | None
    ratio_to_tau_hat: float | None
    threshold_ratio: float
    zero_acceptance_ceiling: float | None
    num_steps: int
    sum_completion_tokens: int
    sum_verify_ct: int
    features: dict[str, Any]
    requests: list[CanaryRequest] = field(default_factory=list)
    elapsed_s: float = 0.0
    min_tau_hat: float = MIN_TAU_HAT
    # SpecForge's definition beside the pooled accept_length above; acceptance holds both, labelled, and the
    # per-position comparison with validation (acceptance_report).
    accept_length_mean_of_request_means: float | None = None
    acceptance: dict[str, Any] = field(default_factory=dict)
    prompt_source: str | None = None  # what the prompts were (the draft's validation conversations, the shipped set)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def feature_report(server_info: dict[str, Any]) -> dict[str, Any]:
    """The reference engine's extra internal_states fields (SGLang does not report them)."""
    state = _first_internal_state(server_info)
    keys = ("feature_width", "expected_feature_width", "feature_source", "fc_applied")
    return {k: state[k] for k in keys if k in state}


def _first_internal_state(server_info: dict[str, Any]) -> dict[str, Any]:
    states = server_info.get("internal_states") or [{}]
    return states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}


def feature_mismatch(features: dict[str, Any]) -> str | None:
    if not features:
        return None
    width, expected = features.get("feature_width"), features.get("expected_feature_width")
    problems = []
    if width is not None and expected is not None and width != expected:
        problems.append(f"width {width}, expected {expected}")
    if not str(features.get("feature_source") or "aux").startswith("aux"):
        problems.append(f"source {features['feature_source']!r} instead of the 3 aux layers")
    if features.get("fc_applied") is False:
        problems.append("fc skipped")
    return "; ".join(problems) or None


def ordered_causes(
    base: list[dict[str, Any]], preflight_codes: list[str], server_info: dict[str, Any], lead: Sequence[dict[str, Any]] = ()
) -> list[dict[str, Any]]:
    """Catalog order, with causes confirmed by preflight codes or the server info moved to the front."""
    algorithm = server_info.get("speculative_algorithm")
    listed = []
    for cause in list(lead) + base:
        evidence = None
        hits = [c for c in cause["codes"] if c in preflight_codes]
        if hits:
            evidence = f"preflight reported {', '.join(hits)}"
        if cause["id"] == "algorithm" and algorithm not in (None, "EAGLE3"):
            evidence = f"server reports speculative_algorithm={algorithm!r}"
        if cause in lead:
            evidence = evidence or "reported by the engine"
        listed.append({"id": cause["id"], "cause": cause["cause"], "check": cause["check"], "evidence": evidence})
    return [c for c in listed if c["evidence"]] + [c for c in listed if not c["evidence"]]


def judge(
    *,
    accept_length: float | None,
    requests: int,
    sum_verify_ct: int,
    tau: float | None,
    features: dict[str, Any],
    server_info: dict[str, Any],
    preflight_codes: Sequence[str] = (),
    ratio: float = REPRODUCE_RATIO,
    min_tau: float = MIN_TAU_HAT,
) -> tuple[str, str, list[str], list[dict[str, Any]]]:
    """(verdict, headline, reasons, causes) from the measured numbers.

    Red on evidence that serving is broken; amber instead of green when tau-hat is too low for any accept length to
    tell a working draft from a broken feed; green otherwise.
    """
    reasons: list[str] = []
    lead: list[dict[str, Any]] = []
    base = CAUSES
    algorithm = server_info.get("speculative_algorithm")
    if algorithm != "EAGLE3":
        reasons.append(f"server is not running EAGLE3 (speculative_algorithm={algorithm!r})")
    mismatch = feature_mismatch(features)
    if mismatch:
        reasons.append(f"draft receives the wrong features: {mismatch}")
        lead.append(FEATURE_CAUSE)
    ceiling = zero_acceptance_ceiling(requests, sum_verify_ct)
    if sum_verify_ct == 0 or accept_length is None:
        reasons.append("no speculative verify steps were reported (spec_verify_ct is 0 or absent)")
    elif accept_length <= ceiling:
        if not predicts_no_acceptance(tau, ratio, ceiling, min_tau):
            reasons.append(f"zero acceptance: accept length {accept_length:.3f} <= {ceiling:.3f} (1 + requests/verify_ct + {ZERO_ACCEPT_EPS})")
    elif tau is not None and accept_length < ratio * tau:
        reasons.append(f"serving does not reproduce training: accept length {accept_length:.2f} < {ratio} x tau-hat {tau:.2f} = {ratio * tau:.2f}")
        base = CAUSES[:4] + [DISTRIBUTION_CAUSE] + CAUSES[4:]
    if reasons or accept_length is None:  # (a missing accept length is always among the reasons)
        return RED, reasons[0], reasons, ordered_causes(base, list(preflight_codes), server_info, lead)
    if tau is not None and tau < min_tau:
        return AMBER, *not_learned_yet(accept_length, tau, ratio, min_tau, ceiling), []
    tail = f" (tau-hat {tau:.2f})" if tau is not None else " (no validation accuracy recorded: only zero acceptance checked)"
    return GREEN, f"accept length {accept_length:.2f}{tail}", [], []


def predicts_no_acceptance(tau: float | None, ratio: float, ceiling: float, min_tau: float) -> bool:
    """An untrained checkpoint whose green bar lies at the zero-acceptance line: accepting nothing is then no evidence."""
    return tau is not None and tau < min_tau and ratio * tau <= ceiling


def not_learned_yet(accept_length: float, tau: float, ratio: float, min_tau: float, ceiling: float) -> tuple[str, list[str]]:
    """Amber headline and reasons: the draft is too weak for the canary to tell working serving from a broken feed."""
    low, high = BROKEN_FEED_ACCEPT_LENGTHS
    headline = f"inconclusive: the draft has not learned yet (tau-hat {tau:.2f} < {min_tau:.2f})"
    measured = (
        f"accept length {accept_length:.2f} is at the zero-acceptance line ({ceiling:.3f}), as this checkpoint predicts"
        if accept_length <= ceiling
        else f"accept length {accept_length:.2f}"
    )
    return headline, [
        f"{measured}; tau-hat {tau:.2f} is too close to 1 for a verdict: green would need only accept length "
        f">= {ratio * tau:.2f}, and a broken aux feed reached {low:.2f}-{high:.2f} on the calibration runs (docs/serving.md)",
        f"train longer (a verdict needs tau-hat >= {min_tau:.2f}), then run the canary again",
    ]


def run_canary(
    url: str,
    prompts: list[str],
    *,
    num_steps: int,
    val_acc: list[float] | None = None,
    max_new_tokens: int = 128,
    preflight_codes: Sequence[str] = (),
    val_rounds: dict | None = None,
    ratio: float = REPRODUCE_RATIO,
    timeout_s: float = 600.0,
    prompt_source: str | None = None,
) -> CanaryResult:
    """Flush, send greedy requests one at a time, read the server's average, judge."""
    started = time.monotonic()
    flush = http.post_json(f"{url}/flush_cache", timeout=60)
    records: list[CanaryRequest] = []
    for prompt in prompts:
        records.append(_one_request(url, prompt, max_new_tokens, timeout_s))
    info_reply = http.get(f"{url}/get_server_info", timeout=60)
    server_info = info_reply.body if isinstance(info_reply.body, dict) else {}
    done = [r for r in records if r.error is None]
    sum_completion = sum(r.completion_tokens for r in done)
    sum_verify = sum(r.verify_ct for r in done)
    measured = sum_completion / sum_verify if sum_verify else None
    server_avg = _first_internal_state(server_info).get("avg_spec_accept_length")
    features = feature_report(server_info)
    tau = tau_hat(val_acc, num_steps)
    verdict, headline, reasons, causes = judge(
        accept_length=measured,
        requests=len(done),
        sum_verify_ct=sum_verify,
        tau=tau,
        features=features,
        server_info=server_info,
        preflight_codes=list(preflight_codes),
        ratio=ratio,
    )
    failed = [r.error for r in records if r.error]
    if failed:
        reasons.append(f"{len(failed)} of {len(records)} canary requests failed: {failed[0]}")
    if not flush.ok:
        reasons.append(f"POST /flush_cache did not succeed ({http.describe(flush)}): the server average includes earlier traffic")
    if not done:
        verdict, headline = RED, reasons[-1] if failed else "no canary request completed"
    acceptance = acceptance_report(
        [(r.completion_tokens, r.verify_ct, r.histogram) for r in done],
        num_steps,
        val_acc,
        [r.histogram_note for r in done if r.histogram_note],
        val_rounds=val_rounds,
    )
    return CanaryResult(
        verdict=verdict,
        headline=headline,
        reasons=reasons,
        causes=causes,
        accept_length=measured,
        server_avg_accept_length=server_avg,
        tau_hat=tau,
        ratio_to_tau_hat=(measured / tau) if measured is not None and tau else None,
        threshold_ratio=ratio,
        zero_acceptance_ceiling=zero_acceptance_ceiling(len(done), sum_verify) if sum_verify else None,
        num_steps=num_steps,
        sum_completion_tokens=sum_completion,
        sum_verify_ct=sum_verify,
        features=features,
        requests=records,
        elapsed_s=time.monotonic() - started,
        accept_length_mean_of_request_means=acceptance["mean_of_request_means"],
        acceptance=acceptance,
        prompt_source=prompt_source,
    )


def _one_request(url: str, prompt: str, max_new_tokens: int, timeout_s: float) -> CanaryRequest:
    payload = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    started = time.monotonic()
    reply = http.post_json(f"{url}/generate", payload, timeout=timeout_s)
    latency = time.monotonic() - started
    if not reply.ok or not isinstance(reply.body, dict):
        return CanaryRequest(len(prompt), 0, 0, None, latency, error=http.describe(reply))
    meta = reply.body.get("meta_info") or {}
    completion = int(meta.get("completion_tokens") or 0)
    verify = int(meta.get("spec_verify_ct") or 0)
    histogram, note = histogram_from_meta(meta) if verify else (None, None)
    return CanaryRequest(len(prompt), completion, verify, completion / verify if verify else None, latency, histogram=histogram, histogram_note=note)
