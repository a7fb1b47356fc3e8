"""OpenAI-compatible routes of the reference engine: /v1 requests become native /generate bodies, native outputs become SGLang's OpenAI shapes.

Mirrors SGLang 0.5.23's serving_completions / serving_chat: the OpenAI request is adapted to a GenerateReqInput-like
body, the engine's {text, output_ids, meta_info} outputs are turned into CompletionResponse / ChatCompletionResponse
objects (and their stream chunks). Pure translation: no model, no HTTP.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable

DEFAULT_COMPLETION_MAX_TOKENS = 16  # CompletionRequest.max_tokens default
# Fields whose non-default value asks for something the reference engine does not do.
UNSUPPORTED_IF_SET = (
    "tools",
    "functions",
    "return_hidden_states",
    "lora_path",
    "session_params",
    "session_id",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "custom_logit_processor",
    "suffix",
)
# OpenAI name -> native sampling_params name; keys absent from the request stay absent.
SAMPLING_RENAMES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seed": "sampling_seed"}
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "n",
    "no_stop_trim",
    "ignore_eos",
    "skip_special_tokens",
    "regex",
    "json_schema",
    "ebnf",
    "logit_bias",
    "min_tokens",
    "seed",
)


class OpenAIRequestError(ValueError):
    """A /v1 request the engine refuses; err_type follows SGLang ("Bad Request" for shape, "BadRequestError" otherwise)."""

    def __init__(self, message: str, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.err_type = err_type


def invalid(message: str) -> OpenAIRequestError:
    """A request that would fail SGLang's pydantic validation (answered like FastAPI's RequestValidationError)."""
    return OpenAIRequestError(message, err_type="Bad Request")


# --------------------------------------------------------------------------- models


def model_card(name: str, context_len: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": name, "parent": None, "max_model_len": context_len}


def model_list(name: str, context_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(name, context_len)]}


def model_not_found(model: str) -> dict[str, Any]:
    return {"error": {"message": f"The model '{model}' does not exist", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}


# --------------------------------------------------------------------------- request -> native body


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    return body


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for key in UNSUPPORTED_IF_SET:
        if body.get(key) not in (None, False, [], {}):
            raise OpenAIRequestError(f"'{key}' is not supported by the reference engine")
    n = body.get("n", 1)
    if n != 1:
        raise OpenAIRequestError(f"n={n!r}: the reference engine returns one choice per request (greedy decoding)")


def _sampling_params(body: dict[str, Any], max_tokens: Any) -> dict[str, Any]:
    params = {SAMPLING_RENAMES.get(key, key): body[key] for key in SAMPLING_KEYS if key in body}
    params.setdefault("temperature", 1.0)  # the OpenAI and SGLang default: sampling, which the engine refuses
    params["max_new_tokens"] = max_tokens
    return params


def _model(body: dict[str, Any]) -> str:
    model = body.get("model", "default")
    if not isinstance(model, str):
        raise invalid("'model' must be a string")
    return model


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("'stream' must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise invalid("'stream_options' must be an object")
    return stream, bool(options.get("include_usage"))


def _rid(body: dict[str, Any], prefix: str) -> str:
    rid = body.get("rid")
    if rid is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not isinstance(rid, str):
        raise OpenAIRequestError("'rid' must be a string (batched requests are not served)")
    return rid


def _prompt_kwargs(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"text": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"input_ids": prompt}
    if isinstance(prompt, list) and len(prompt) == 1:
        return _prompt_kwargs(prompt[0])
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise OpenAIRequestError(f"{len(prompt)} prompts in one request: the reference engine serves one prompt per request")
    raise invalid("'prompt' must be a string, a list of token ids, or a one-element list of either")


def _bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"'{key}' must be true or false")
    return value


def _positive_max_tokens(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise invalid(f"{name} must be positive, got {value!r}")
    return value


def completion_to_native(body: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(native /generate body, formatting options) for a /v1/completions request."""
    req = _object(body)
    if "prompt" not in req:
        raise invalid("'prompt' is required")
    _refuse_unsupported(req)
    max_tokens = _positive_max_tokens(req.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS), "max_tokens")
    logprobs = req.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs < 0):
        raise invalid(f"'logprobs' must be a non-negative int, got {logprobs!r}")
    echo = req.get("echo", False)
    if not isinstance(echo, bool):
        raise invalid("'echo' must be true or false")
    stream, include_usage = _stream_flags(req)
    token_ids = _bool(req, "return_token_ids")
    native = {
        **_prompt_kwargs(req["prompt"]),
        "sampling_params": _sampling_params(req, max_tokens),
        "stream": stream,
        "rid": _rid(req, "cmpl"),
        "return_logprob": logprobs is not None,
        "top_logprobs_num": logprobs or 0,
        "return_text_in_logprobs": True,
        "logprob_start_len": 0 if echo and logprobs is not None else -1,
        "return_prompt_token_ids": token_ids,
    }
    options = {
        "model": _model(req),
        "echo": bool(echo),
        "logprobs": logprobs,
        "include_usage": include_usage,
        "spec_details": _bool(req, "return_spec_tokens_details"),
        "token_ids": token_ids,
    }
    return native, options


def _message_text(message: Any, index: int) -> tuple[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise invalid(f"messages[{index}] must be an object with a 'role'")
    role, content = message["role"], message.get("content")
    if role not in ("system", "user", "assistant", "developer"):
        raise OpenAIRequestError(f"messages[{index}].role {role!r} is not supported by the reference engine (no tools)")
    if content is None or isinstance(content, str):
        return role, content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return role, "".join(str(p.get("text") or "") for p in content)
    raise OpenAIRequestError(f"messages[{index}].content holds non-text parts; the reference engine serves text only")


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list")
    return [dict(zip(("role", "content"), _message_text(m, i))) for i, m in enumerate(messages)]


def _chat_logprobs(req: dict[str, Any]) -> int | None:
    """top_logprobs_num when logprobs are asked for, else None."""
    wanted, top = req.get("logprobs", False), req.get("top_logprobs")
    if not isinstance(wanted, bool):
        raise invalid("'logprobs' must be true or false")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20):
        raise invalid(f"'top_logprobs' must be an int in 0..20, got {top!r}")
    if top and not wanted:
        raise invalid("'top_logprobs' needs 'logprobs': true")
    return (top or 0) if wanted else None


def chat_to_native(body: Any, render: Callable[[list[dict[str, str]]], dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(native /generate body, formatting options) for a /v1/chat/completions request.

    render applies the chat template and returns the prompt as {"text": ...} or {"input_ids": [...]}.
    """
    req = _object(body)
    _refuse_unsupported(req)
    if req.get("tool_choice") not in (None, "none"):
        raise OpenAIRequestError("'tool_choice' is not supported by the reference engine (no tools)")
    fmt = req.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise OpenAIRequestError("'response_format' other than text is not supported by the reference engine")
    max_tokens = req.get("max_completion_tokens", req.get("max_tokens"))
    if max_tokens is not None:
        max_tokens = _positive_max_tokens(max_tokens, "max_tokens")
    top = _chat_logprobs(req)
    stream, include_usage = _stream_flags(req)
    prompt_ids, token_ids = _bool(req, "return_prompt_token_ids"), _bool(req, "return_token_ids")
    for key, wanted in (("return_prompt_token_ids", prompt_ids), ("return_token_ids", token_ids)):
        if stream and wanted:  # SGLang's own refusal (serving_chat)
            raise OpenAIRequestError(f"{key} is not supported with streaming on /v1/chat/completions. Please set stream=false when using {key}=true.")
    native = {
        **render(chat_messages(req)),
        "sampling_params": _sampling_params(req, max_tokens),
        "stream": stream,
        "rid": _rid(req, "chatcmpl"),
        "return_logprob": top is not None,
        "top_logprobs_num": top or 0,
        "return_text_in_logprobs": True,
        "return_prompt_token_ids": prompt_ids or token_ids,
    }
    options = {
        "model": _model(req),
        "logprobs": top,
        "include_usage": include_usage,
        "spec_details": _bool(req, "return_spec_tokens_details"),
        "prompt_token_ids": prompt_ids or token_ids,
        "token_ids": token_ids,
    }
    return native, options


# --------------------------------------------------------------------------- native output -> OpenAI shapes


def usage(meta: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion, "prompt_tokens_details": None, "reasoning_tokens": 0}


# SGLang's SpecTokensDetails: every field, zero when the engine did not report it.
SPEC_DETAIL_FLOATS = ("spec_accept_rate", "spec_accept_length", "spec_cap_length", "spec_block_accept_length")
SPEC_DETAIL_INTS = ("spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_verify_ct")
SPEC_DETAIL_LISTS = ("spec_correct_drafts_histogram", "spec_cap_lens_histogram")


def spec_tokens_details(meta: dict[str, Any]) -> dict[str, Any] | None:
    """SGLang's spec_tokens_details_from_meta_info: None when meta_info carries no speculative field."""
    if not any(key in meta for key in SPEC_DETAIL_FLOATS + SPEC_DETAIL_INTS + SPEC_DETAIL_LISTS):
        return None
    details: dict[str, Any] = {key: meta.get(key) or 0.0 for key in SPEC_DETAIL_FLOATS}
    details.update({key: meta.get(key) or 0 for key in SPEC_DETAIL_INTS})
    details.update({key: list(meta.get(key) or []) for key in SPEC_DETAIL_LISTS})
    return details


def sglext(meta: dict[str, Any], options: dict[str, Any]) -> dict[str, Any] | None:
    """The response-level `sglext` object (SGLang's SglExt, None fields dropped), or None when nothing was asked for."""
    details = spec_tokens_details(meta) if options.get("spec_details") else None
    return {"spec_tokens_details": details} if details is not None else None


def _with_sglext(response: dict[str, Any], meta: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    ext = sglext(meta, options)
    if ext is not None:
        response["sglext"] = ext
    return response


def _finish(meta: dict[str, Any]) -> tuple[str | None, Any]:
    finish = meta.get("finish_reason")
    if not finish:
        return None, None
    return finish["type"], finish.get("matched")


def completion_logprobs(entries: list, tops: list | None) -> dict[str, Any]:
    """SGLang's to_openai_style_logprobs: tokens, token_logprobs, top_logprobs ({text: logprob}), text_offset -1."""
    tops = tops if tops is not None else [None] * len(entries)
    return {
        "text_offset": [-1] * len(entries),
        "token_logprobs": [e[0] for e in entries],
        "tokens": [e[2] for e in entries],
        "top_logprobs": [{t[2]: t[0] for t in top} if top is not None else None for top in tops],
    }


def _merge_completion_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: [v for part in parts for v in part[key]] for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs")}


def _completion_choice_logprobs(meta: dict[str, Any], options: dict[str, Any], start: int = 0, with_input: bool = False) -> dict[str, Any] | None:
    if options.get("logprobs") is None:
        return None
    parts = []
    if with_input and options.get("echo"):
        parts.append(completion_logprobs(meta.get("input_token_logprobs") or [], meta.get("input_top_logprobs")))
    tops = meta.get("output_top_logprobs")
    parts.append(completion_logprobs((meta.get("output_token_logprobs") or [])[start:], tops[start:] if tops else None))
    return _merge_completion_logprobs(parts)


def completion_response(out: dict[str, Any], options: dict[str, Any], echo_text: str = "") -> dict[str, Any]:
    meta = out["meta_info"]
    finish, matched = _finish(meta)
    choice = {
        "index": 0,
        "text": echo_text + out["text"],
        "finish_reason": finish,
        "matched_stop": matched,
        "logprobs": _completion_choice_logprobs(meta, options, with_input=True),
    }
    if options.get("token_ids"):
        choice.update(token_ids=list(out["output_ids"]), prompt_token_ids=out.get("prompt_token_ids"))
    response = {
        "id": meta["id"],
        "object": "text_completion",
        "created": int(time.time()),
        "model": options["model"],
        "choices": [choice],
        "usage": usage(meta),
        "metadata": {"weight_version": meta.get("weight_version", "default")},
    }
    return _with_sglext(response, meta, options)


def chat_token_logprobs(entries: list, tops: list | None) -> list[dict[str, Any]]:
    tops = tops if tops is not None else [[] for _ in entries]
    return [
        {
            "token": e[2],
            "bytes": list(e[2].encode("utf-8")),
            "logprob": e[0],
            "top_logprobs": [{"token": t[2], "bytes": list(t[2].encode("utf-8")), "logprob": t[0]} for t in (top or [])],
        }
        for e, top in zip(entries, tops)
    ]


def _chat_choice_logprobs(meta: dict[str, Any], options: dict[str, Any], start: int = 0) -> dict[str, Any] | None:
    if options.get("logprobs") is None:
        return None
    tops = meta.get("output_top_logprobs")
    return {"content": chat_token_logprobs((meta.get("output_token_logprobs") or [])[start:], tops[start:] if tops else None)}


def chat_response(out: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    meta = out["meta_info"]
    finish, matched = _finish(meta)
    message = {"role": "assistant", "content": out["text"], "reasoning_content": None, "tool_calls": None}
    choice = {"index": 0, "message": message, "logprobs": _chat_choice_logprobs(meta, options), "finish_reason": finish, "matched_stop": matched}
    if options.get("prompt_token_ids"):
        choice["prompt_token_ids"] = out.get("prompt_token_ids")
    if options.get("token_ids"):
        choice["response_token_ids"] = list(out["output_ids"])
    response = {
        "id": meta["id"],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": options["model"],
        "choices": [choice],
        "usage": usage(meta),
        "metadata": {"weight_version": meta.get("weight_version", "default")},
    }
    return _with_sglext(response, meta, options)


class StreamFormatter:
    """Turns successive cumulative native stream outputs into OpenAI chunks (text deltas, per-chunk logprobs)."""

    def __init__(self, options: dict[str, Any], chat: bool, echo_text: str = ""):
        self.options = options
        self.chat = chat
        self.echo_text = echo_text
        self.created = int(time.time())
        self.sent_chars = 0
        self.sent_logprobs = 0
        self.sent_ids = 0
        self.started = False
        self.last_meta: dict[str, Any] = {}

    def _envelope(self, rid: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": rid, "object": kind, "created": self.created, "model": self.options["model"], "choices": choices}

    def chunks(self, out: dict[str, Any]) -> list[dict[str, Any]]:
        meta = out["meta_info"]
        self.last_meta = meta
        chunks = []
        if self.chat and not self.started:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None, "matched_stop": None}
            chunks.append(self._envelope(meta["id"], [role]))
        delta = out["text"][self.sent_chars :]
        self.sent_chars = max(self.sent_chars, len(out["text"]))
        finish, matched = _finish(meta)
        choice = self._chat_choice(meta, delta) if self.chat else self._completion_choice(out, delta)
        choice.update(finish_reason=finish, matched_stop=matched)
        self.sent_logprobs = len(meta.get("output_token_logprobs") or [])
        self.started = True
        chunks.append(self._envelope(meta["id"], [choice]))
        return chunks

    def _completion_choice(self, out: dict[str, Any], delta: str) -> dict[str, Any]:
        meta, first = out["meta_info"], not self.started
        text = (self.echo_text if first and self.options.get("echo") else "") + delta
        logprobs = _completion_choice_logprobs(meta, self.options, start=self.sent_logprobs, with_input=first)
        choice = {"index": 0, "text": text, "logprobs": logprobs}
        if self.options.get("token_ids"):  # the new ids of this chunk; the prompt's once, on the first
            choice["token_ids"] = list(out["output_ids"][self.sent_ids :])
            self.sent_ids = len(out["output_ids"])
            if first:
                choice["prompt_token_ids"] = out.get("prompt_token_ids")
        return choice

    def _chat_choice(self, meta: dict[str, Any], delta: str) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": delta}, "logprobs": _chat_choice_logprobs(meta, self.options, self.sent_logprobs)}

    def sglext_chunk(self) -> dict[str, Any] | None:
        """After the last choice chunk: empty choices and the response-level sglext, when one was asked for."""
        ext = sglext(self.last_meta, self.options) if self.last_meta else None
        if ext is None:
            return None
        chunk = self._envelope(self.last_meta["id"], [])
        chunk["sglext"] = ext
        return chunk

    def usage_chunk(self) -> dict[str, Any] | None:
        """The trailing chunk with empty choices and usage, when stream_options.include_usage asked for it."""
        if not self.options.get("include_usage") or not self.last_meta:
            return None
        chunk = self._envelope(self.last_meta["id"], [])
        chunk["usage"] = usage(self.last_meta)
        return chunk

    def trailer(self) -> list[dict[str, Any]]:
        """SGLang's order after the choice chunks: the sglext chunk, then the usage chunk."""
        return [chunk for chunk in (self.sglext_chunk(), self.usage_chunk()) if chunk is not None]
