"""Parse and validate `/v1/completions` and `/v1/chat/completions` bodies into a `ParsedRequest`.

Every problem raises `RequestError` (400) with a message in TensorRT-LLM's spirit. Fields the
simulator does not model (temperature, top_p, logprobs, `stop` strings, tools, ...) are accepted
and ignored; `disaggregated_params` is checked strictly against TensorRT-LLM's schema, since it
is the orchestrator's contract. Prompts: one string or one list of token ids (a one-element batch
is unwrapped; a real batch is refused, as the disaggregated path supports only single prompts).
"""

from __future__ import annotations

import base64
import binascii
import re
from array import array
from dataclasses import dataclass, field
from typing import Any

import orjson

from shmdisagg.executors.sim.errors import RequestError
from shmdisagg.executors.sim.sequence import Kind
from shmdisagg.executors.sim.tokenizer import Tokenizer, render_chat

DEFAULT_MAX_TOKENS = 32  # TensorRT-LLM SamplingParams.max_tokens default

DISAGG_PARAM_KEYS = frozenset(
    {
        "request_type", "first_gen_tokens", "first_gen_log_probs", "first_gen_logits", "ctx_request_id",
        "encoded_opaque_state", "draft_tokens", "disagg_request_id", "ctx_dp_rank", "ctx_info_endpoint",
        "schedule_style", "ctx_usage", "return_prompt_token_ids_b64", "resolved_thinking", "conversation_id",
        # lifecycle protocol v1 (accepted, not modelled)
        "logical_request_id", "prefill_artifact_id", "artifact_version", "handoff_attempt_uuid",
        "consumer_grant_id", "transfer_session_id", "generation_endpoint_name", "generation_endpoint_rank",
        "generation_endpoint_incarnation", "context_control_endpoint", "context_transceiver_lifecycle",
    }
)  # fmt: skip
_REQUEST_TYPES = {
    "context_only": Kind.CONTEXT_ONLY,
    "generation_only": Kind.GENERATION_ONLY,
    "context_and_generation": Kind.LOCAL,
}
_SCHEME_RE = re.compile(r"^[a-z]+://")


@dataclass(frozen=True)
class Limits:
    """What the executor accepts: vocabulary, sequence length, role, disaggregation on/off."""

    vocab_size: int
    max_seq_len: int
    role: str = "mixed"
    disagg_enabled: bool = True


@dataclass
class ParsedRequest:
    chat: bool
    model: str
    prompt: list[int]
    max_tokens: int
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    stop_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    detokenize: bool = True
    kind: Kind = Kind.LOCAL
    disagg_request_id: int | None = None
    ctx_request_id: int | None = None
    first_gen_tokens: list[int] = field(default_factory=list)
    ctx_usage: dict[str, Any] | None = None
    ctx_endpoint: str | None = None
    return_prompt_b64: bool = False


def parse_request(raw: bytes, chat: bool, tokenizer: Tokenizer, limits: Limits) -> ParsedRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")

    stream = _opt_bool(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not stream:
            raise RequestError("Stream options can only be defined when stream is true.", param="stream_options")
        if not isinstance(stream_options, dict):
            raise RequestError("stream_options must be an object", param="stream_options")
    include_usage = continuous = False
    if stream_options is not None:
        include_usage = bool(stream_options.get("include_usage", True))
        continuous = include_usage and bool(stream_options.get("continuous_usage_stats", False))

    for key in ("n", "best_of"):
        value = body.get(key)
        if value is not None and (not _is_int(value) or value != 1):
            raise RequestError(f"{key} must be 1 (the simulator generates one sequence per request)", param=key)
    if body.get("use_beam_search"):
        raise RequestError("beam search is not supported", param="use_beam_search")
    if not chat and body.get("suffix"):
        raise RequestError("suffix is not supported", param="suffix")

    prompt = _chat_prompt(body, tokenizer) if chat else _completion_prompt(body, tokenizer)
    _check_token_ids(prompt, limits.vocab_size, "prompt")

    if chat:
        max_tokens = body.get("max_completion_tokens")
        key = "max_completion_tokens"
        if max_tokens is None:
            max_tokens, key = body.get("max_tokens"), "max_tokens"
    else:
        max_tokens, key = body.get("max_tokens"), "max_tokens"
    room = limits.max_seq_len - len(prompt)
    if room < 1:
        raise RequestError(f"prompt length {len(prompt)} leaves no room within max_seq_len {limits.max_seq_len}")
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise RequestError(f"{key} must be a positive integer", param=key)
    elif max_tokens > room:
        raise RequestError(
            f"prompt length {len(prompt)} + {key} {max_tokens} exceeds max_seq_len {limits.max_seq_len}", param=key
        )

    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise RequestError("stop_token_ids must be a list of integers", param="stop_token_ids")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model must be a string", param="model")

    req = ParsedRequest(
        chat=chat,
        model=model or "",
        prompt=prompt,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        stop_ids=frozenset(stop_ids),
        ignore_eos=_opt_bool(body, "ignore_eos", False),
        detokenize=_opt_bool(body, "detokenize", True) if not chat else True,
    )
    params = body.get("disaggregated_params")
    if params is not None:
        _apply_disagg_params(req, params, limits)
    return req


def _completion_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("prompt is required", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a one-element batch
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt must not be empty", param="prompt")
        return tokenizer.encode(prompt, add_bos=_opt_bool(body, "add_special_tokens", True))
    if isinstance(prompt, list):
        if not prompt:
            raise RequestError("prompt must not be empty", param="prompt")
        if _all_ints(prompt):
            return prompt
        raise RequestError(
            "only a single prompt is supported: a string or a list of token ids (no batches)", param="prompt"
        )
    raise RequestError("prompt must be a string or a list of token ids", param="prompt")


def _chat_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise RequestError("messages must be a list", param="messages")
    ids = body.get("prompt_token_ids")
    b64 = body.get("prompt_token_ids_b64")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not _all_ints(ids):
            raise RequestError("prompt_token_ids must be a non-empty list of integers", param="prompt_token_ids")
        return ids
    if b64 is not None:
        return _decode_b64_ids(b64)
    if not messages:
        raise RequestError("messages must not be empty", param="messages")
    try:
        text = render_chat(messages, _opt_bool(body, "add_generation_prompt", True))
    except ValueError as exc:
        raise RequestError(str(exc), param="messages") from None
    return tokenizer.encode(text)


def _decode_b64_ids(value: Any) -> list[int]:
    if not isinstance(value, str):
        raise RequestError("prompt_token_ids_b64 must be a base64 string", param="prompt_token_ids_b64")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("prompt_token_ids_b64 is not valid base64", param="prompt_token_ids_b64") from None
    if not raw or len(raw) % 4:
        raise RequestError("prompt_token_ids_b64 must hold int32 token ids", param="prompt_token_ids_b64")
    ids = array("i")
    ids.frombytes(raw)
    return ids.tolist()


def encode_b64_ids(ids: list[int]) -> str:
    """int32 little-endian base64, TensorRT-LLM's `prompt_token_ids_b64`."""
    return base64.b64encode(array("i", ids).tobytes()).decode("ascii")


def _apply_disagg_params(req: ParsedRequest, params: Any, limits: Limits) -> None:
    if not isinstance(params, dict):
        raise RequestError("disaggregated_params must be an object", param="disaggregated_params")
    unknown = set(params) - DISAGG_PARAM_KEYS
    if unknown:
        raise RequestError(
            f"unknown disaggregated_params field(s): {', '.join(sorted(unknown))}", param="disaggregated_params"
        )
    kind = _REQUEST_TYPES.get(params.get("request_type"))  # type: ignore[arg-type]
    if kind is None:
        raise RequestError(
            "disaggregated_params.request_type must be context_only, generation_only or context_and_generation",
            param="disaggregated_params.request_type",
        )
    if kind is not Kind.LOCAL and not limits.disagg_enabled:
        raise RequestError(
            f"{kind.value} requests need cache_transceiver_config on this executor", param="disaggregated_params"
        )
    if kind is Kind.CONTEXT_ONLY and limits.role == "generation":
        raise RequestError("this executor serves the generation role; context_only is refused")
    if kind is Kind.GENERATION_ONLY and limits.role == "context":
        raise RequestError("this executor serves the context role; generation_only is refused")
    req.kind = kind
    req.disagg_request_id = _opt_int(params, "disagg_request_id")
    req.return_prompt_b64 = bool(params.get("return_prompt_token_ids_b64") or False)
    if kind is Kind.CONTEXT_ONLY:
        req.stream = False  # the context leg is never streamed
        req.include_usage = req.continuous_usage = False
    if kind is not Kind.GENERATION_ONLY:
        return
    ctx_id = _opt_int(params, "ctx_request_id")
    if ctx_id is None:
        raise RequestError("generation_only needs disaggregated_params.ctx_request_id", param="disaggregated_params")
    first = params.get("first_gen_tokens")
    if first is None:
        first = []  # generation-first: the first token arrives with the KV
    elif not isinstance(first, list) or not all(_is_int(t) for t in first):
        raise RequestError("disaggregated_params.first_gen_tokens must be a list of ints", param="disaggregated_params")
    _check_token_ids(first, limits.vocab_size, "first_gen_tokens")
    if len(first) > req.max_tokens:
        raise RequestError("first_gen_tokens is longer than max_tokens", param="disaggregated_params")
    usage = params.get("ctx_usage")
    if usage is not None and not isinstance(usage, dict):
        raise RequestError("disaggregated_params.ctx_usage must be an object", param="disaggregated_params")
    req.ctx_request_id = ctx_id
    req.first_gen_tokens = first
    req.ctx_usage = usage
    req.ctx_endpoint = _ctx_endpoint(params)


def _ctx_endpoint(params: dict[str, Any]) -> str:
    endpoint = params.get("ctx_info_endpoint")
    if isinstance(endpoint, list):
        endpoint = endpoint[0] if endpoint else None
    state = params.get("encoded_opaque_state")
    if not endpoint and isinstance(state, str):
        try:
            endpoint = orjson.loads(base64.b64decode(state)).get("ctx_info_endpoint")
        except (binascii.Error, ValueError, AttributeError, orjson.JSONDecodeError):
            endpoint = None
    if not endpoint:
        endpoint = params.get("context_control_endpoint")
    if not isinstance(endpoint, str) or not endpoint:
        raise RequestError(
            "generation_only needs disaggregated_params.ctx_info_endpoint (or the context executor's "
            "encoded_opaque_state, or context_control_endpoint)",
            param="disaggregated_params",
        )
    return _SCHEME_RE.sub("", endpoint).rstrip("/")


def _check_token_ids(ids: list[int], vocab_size: int, what: str) -> None:
    try:
        arr = array("q", ids)
    except (TypeError, OverflowError):
        raise RequestError(f"{what} token ids must be integers", param=what) from None
    if arr and (min(arr) < 0 or max(arr) >= vocab_size):
        raise RequestError(f"{what} token ids must be within [0, {vocab_size})", param=what)


def _all_ints(values: list[Any]) -> bool:
    """True if every item is an integer, at C speed for long token lists (bools pass as 0/1)."""
    try:
        array("q", values)
    except OverflowError:
        return all(_is_int(v) for v in values)  # out of int64: the range check reports it
    except TypeError:
        return False
    return True


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be true or false", param=key)
    return value


def _opt_int(params: dict[str, Any], key: str) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise RequestError(f"disaggregated_params.{key} must be an integer", param="disaggregated_params")
    return value  # type: ignore[no-any-return]
