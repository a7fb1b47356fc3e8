"""Native /generate bodies: SGLang's GenerateReqInput for one prompt, checked and turned into what the engine runs."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

from backend.serve.reference.engine import Engine, GenerationSpec

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
GREEDY_TEMPERATURE = 1e-6  # SGLang decodes greedily below this temperature
# Sampling parameters that would change greedy output; refused unless left at their neutral value.
NEUTRAL_SAMPLING: dict[str, tuple[object, ...]] = {
    "top_k": (-1, 1, None),
    "top_p": (1.0, 1, None),
    "min_p": (0.0, 0, None),
    "repetition_penalty": (1.0, 1, None),
    "frequency_penalty": (0.0, 0, None),
    "presence_penalty": (0.0, 0, None),
    "n": (1, None),
    "min_new_tokens": (0, None),
    "stop_regex": (None, [], ""),
    "regex": (None,),
    "json_schema": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": (None, {}),
}
IGNORED_SAMPLING = ("spaces_between_special_tokens", "sampling_seed", "custom_params")
HANDLED_SAMPLING = ("temperature", "max_new_tokens", "stop", "stop_token_ids", "ignore_eos", "no_stop_trim", "skip_special_tokens")
UNSUPPORTED_GENERATE = (
    "input_embeds",
    "image_data",
    "audio_data",
    "video_data",
    "lora_path",
    "session_params",
    "return_hidden_states",
    "custom_logit_processor",
    "token_ids_logprob",
)


# Reference-only extension of the body (SGLang has none): `"speculative": false` decodes this one request without
# speculation on a speculative engine, so a benchmark can measure plain decoding in the same engine and process.
# /get_server_info advertises it as PLAIN_SWITCH_INFO; on a plain engine every request is plain whatever it says.
PLAIN_SWITCH = "speculative"
PLAIN_SWITCH_INFO = "plain_decode_per_request"

UNSUPPORTED_HINTS = {
    "token_ids_logprob": "; ask for top_logprobs_num instead (top_logprobs_num = the vocab size returns every token's logprob)",
}


class RequestError(ValueError):
    """A /generate body this engine will not serve: 400 with SGLang's {"error": {"message"}} body."""


@dataclass
class NativeRequest:
    spec: GenerationSpec
    rid: str
    stream: bool
    return_prompt_token_ids: bool = False  # the reply carries the prompt's ids as top-level `prompt_token_ids`


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _prompt_ids(body: dict[str, Any], engine: Engine) -> list[int]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list) or (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list)):
        raise RequestError("batched requests are not served by the reference engine; send one prompt per request")
    if (text is None) == (input_ids is None):
        raise RequestError("give exactly one of 'text' (a string) or 'input_ids' (a list of ints)")
    if text is not None:
        if not isinstance(text, str):
            raise RequestError("'text' must be a string")
        ids = engine.encode(text)
    else:
        if not isinstance(input_ids, list) or not all(_is_int(i) for i in input_ids):
            raise RequestError("'input_ids' must be a list of ints")
        ids = _checked_ids(input_ids, engine, "input_ids")
    if not ids:
        raise RequestError("the prompt is empty")
    return ids


def _checked_ids(ids: list[int], engine: Engine, name: str) -> list[int]:
    vocab = engine.vocab_size
    if any(not 0 <= i < vocab for i in ids):
        raise RequestError(f"'{name}' holds ids outside the target vocab 0..{vocab - 1}")
    return list(ids)


def _rid(body: dict[str, Any]) -> str:
    rid = body.get("rid")
    if rid is None:
        return uuid.uuid4().hex
    if isinstance(rid, list):
        raise RequestError("batched requests are not served by the reference engine; 'rid' must be one string")
    if not isinstance(rid, str) or not rid:
        raise RequestError("'rid' must be a non-empty string")
    return rid


def _check_sampling_keys(params: dict[str, Any]) -> None:
    temperature = params.get("temperature", 1.0)  # SGLang's default is 1.0, i.e. sampling
    if not _is_number(temperature) or not 0 <= temperature < GREEDY_TEMPERATURE:
        raise RequestError(f"sampling_params.temperature is {temperature!r}: the reference engine decodes greedily only; send temperature 0")
    for key, value in params.items():
        if key in NEUTRAL_SAMPLING and value not in NEUTRAL_SAMPLING[key]:
            raise RequestError(f"sampling_params.{key}={value!r} is not supported by the reference engine (greedy only)")
        if key not in NEUTRAL_SAMPLING and key not in IGNORED_SAMPLING and key not in HANDLED_SAMPLING:
            raise RequestError(f"sampling_params.{key} is not supported by the reference engine")


def _max_new_tokens(params: dict[str, Any], prompt_len: int, context_len: int) -> int:
    max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new is None:  # SGLang: up to the context length
        max_new = context_len - prompt_len
    if not _is_int(max_new) or max_new < 0:
        raise RequestError(f"sampling_params.max_new_tokens must be a non-negative int, got {max_new!r}")
    if prompt_len + max_new > context_len:
        raise RequestError(f"prompt ({prompt_len}) + max_new_tokens ({max_new}) exceeds the context length {context_len}")
    return max_new


def _stop_strings(params: dict[str, Any]) -> tuple[str, ...]:
    stop = params.get("stop")
    if stop in (None, "", []):
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("sampling_params.stop must be a string or a list of non-empty strings")
    return tuple(stop)


def _flag(mapping: dict[str, Any], key: str, default: bool, where: str) -> bool:
    value = mapping.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{where}{key} must be true or false, got {value!r}")
    return value


def _stop_token_ids(params: dict[str, Any], engine: Engine) -> frozenset[int]:
    if _flag(params, "ignore_eos", False, "sampling_params."):
        return frozenset()  # SGLang's ignore_eos skips the stop-token check entirely
    extra = params.get("stop_token_ids") or []
    if not isinstance(extra, list) or not all(_is_int(i) for i in extra):
        raise RequestError("sampling_params.stop_token_ids must be a list of ints")
    return engine.eos_ids | frozenset(_checked_ids(extra, engine, "stop_token_ids"))


def _logprob_options(body: dict[str, Any], engine: Engine) -> dict[str, Any]:
    top = body.get("top_logprobs_num", 0) or 0
    start = body.get("logprob_start_len", -1)
    if not _is_int(top) or not 0 <= top <= engine.vocab_size:
        raise RequestError(f"top_logprobs_num must be an int in 0..{engine.vocab_size}, got {top!r}")
    if start is None:
        start = -1
    if not _is_int(start) or start < -1:
        raise RequestError(f"logprob_start_len must be an int >= -1, got {start!r}")
    return {
        "return_logprob": _flag(body, "return_logprob", False, ""),
        "top_logprobs_num": top,
        "logprob_start_len": start,
        "return_text_in_logprobs": _flag(body, "return_text_in_logprobs", False, ""),
    }


def parse_generate(body: Any, engine: Engine) -> NativeRequest:
    """A /generate body (SGLang's GenerateReqInput, one prompt) -> what the engine runs."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    for key in UNSUPPORTED_GENERATE:
        if body.get(key) not in (None, False, [], {}):
            raise RequestError(f"'{key}' is not supported by the reference engine{UNSUPPORTED_HINTS.get(key, '')}")
    ids = _prompt_ids(body, engine)
    rid = _rid(body)
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise RequestError("'sampling_params' must be an object")
    _check_sampling_keys(params)
    spec = GenerationSpec(
        input_ids=ids,
        max_new_tokens=_max_new_tokens(params, len(ids), engine.context_len),
        stop_token_ids=_stop_token_ids(params, engine),
        stop_strings=_stop_strings(params),
        no_stop_trim=_flag(params, "no_stop_trim", False, "sampling_params."),
        skip_special_tokens=_flag(params, "skip_special_tokens", True, "sampling_params."),
        **_logprob_options(body, engine),
        speculative=_flag(body, PLAIN_SWITCH, True, ""),
    )
    stream, prompt_ids = _flag(body, "stream", False, ""), _flag(body, "return_prompt_token_ids", False, "")
    return NativeRequest(spec=spec, rid=rid, stream=stream, return_prompt_token_ids=prompt_ids)
