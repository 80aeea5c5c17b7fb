"""`/v1/completions` and `/v1/chat/completions` bodies, validated as trtllm-serve validates them,
into a `ParsedRequest`.

Two stages, as in TensorRT-LLM (sources below):

1. The protocol models: `CompletionRequest`, `ChatCompletionRequest`, `DisaggregatedParams`,
   `StreamOptions`, `UsageInfo` are pydantic models with `extra="forbid"`; a body that does not fit
   (bad JSON, unknown field, wrong type, missing `model` / `prompt` / `messages`, a model
   validator: `stream_options` without `stream`, `suffix`, `logprobs` / `top_logprobs` over 20,
   `top_logprobs` without `logprobs`, `tool_choice` without `tools`, an empty `cache_salt`,
   `priority` outside [0, 1], `truncate_prompt_tokens` < 1) raises `ValidationFailed`: 400
   `{"error": ...}`. The same field names and types here, as msgspec structs (`strict=False`:
   pydantic's lax coercions, e.g. "5" for an int).
2. Building the generation request (`to_sampling_params`, `SamplingParams`, the executor's
   argument checks): a ValueError there raises `RequestError`: 400 `ErrorResponse`. Among them
   `max_tokens` <= 0, a prompt that leaves no room in `max_seq_len`, token ids outside the
   vocabulary, an unknown `request_type`, a per-request `chat_template`, and what the simulator
   refuses by name (n > 1, beam search, batches of prompts, LoRA, non-text content parts, a
   `tool_choice` naming a function). A `max_tokens` beyond `max_seq_len - prompt` is clamped,
   as the PyTorch backend does (`_deduce_max_tokens`).

Sampling knobs that change values but not the shape of an answer (temperature, top_p/top_k,
penalties, seed, logit_bias, response_format, tools without a named tool_choice, priority,
cache_salt, ...) are validated and then ignored: the simulator's tokens are deterministic.

Sources (repo NVIDIA/TensorRT-LLM): `tensorrt_llm/serve/openai_protocol.py` @0076e939 (the
worker copy in ../shared/trtllm_worker), `serve/openai_server.py` @fb31828e (prompt batches,
chat role and echo, `prompt_token_ids_b64`), `sampling_params.py` @000a01de (stop strings are
tokenized into stop words, `_get_stop_reasons_and_words`), `executor/base_worker.py` file id
55301320707 (`_deduce_max_tokens`), `llmapi/llm.py` file id 55216765702 (`_check_arguments`).
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from array import array
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson

from shmdisagg.executors.sim.errors import RequestError, UnreadableBody, ValidationFailed
from shmdisagg.executors.sim.pydantic_errors import pydantic_message
from shmdisagg.executors.sim.sequence import Kind
from shmdisagg.executors.sim.tokenizer import Tokenizer, render_chat

# Simulator default when a request gives no max_tokens. TensorRT-LLM's is max_seq_len - prompt
# (up to 131k tokens for Llama 3.1); see README "Differences from trtllm-serve".
DEFAULT_MAX_TOKENS = 32
MAX_LOGPROBS = 20  # sampling_params.check_logprobs_limit
_LOGIT_BIAS_LIMIT = 100.0
_RESPONSE_FORMAT_TYPES = frozenset({"text", "json", "json_schema", "json_object", "regex", "ebnf", "structural_tag"})
_REQUEST_TYPES = {
    "context_only": Kind.CONTEXT_ONLY,
    "generation_only": Kind.GENERATION_ONLY,
    "context_and_generation": Kind.LOCAL,
}
_SCHEME_RE = re.compile(r"^[a-z][a-z0-9+.-]*://")
GENERATION_FIRST = 1  # DisaggScheduleStyle.GENERATION_FIRST


# -- the protocol models (field names, types and defaults as openai_protocol.py @0076e939) ------
class _Model(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class StreamOptions(_Model, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class PromptTokensDetails(_Model, forbid_unknown_fields=True, kw_only=True):
    cached_tokens: int = 0


class UsageInfo(_Model, forbid_unknown_fields=True, kw_only=True):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class DisaggregatedParams(_Model, forbid_unknown_fields=True, kw_only=True):
    request_type: str
    first_gen_tokens: list[int] | None = None
    first_gen_log_probs: list[Any] | None = None
    first_gen_logits: list[Any] | None = None
    ctx_request_id: int | None = None
    encoded_opaque_state: str | None = None
    draft_tokens: list[int] | None = None
    disagg_request_id: int | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None
    schedule_style: int | None = None  # DisaggScheduleStyle: 0 context-first, 1 generation-first
    ctx_usage: UsageInfo | None = None
    return_prompt_token_ids_b64: bool = False
    resolved_thinking: bool | None = None


class _Sampling(_Model, forbid_unknown_fields=True, kw_only=True):
    """Fields CompletionRequest and ChatCompletionRequest share."""

    model: str
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int = 1
    presence_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = msgspec.field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    lora_request: dict[str, Any] | None = None
    prompt_ignore_length: int | None = 0
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int = 0
    top_p_min: float = 0.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    stop_token_ids: list[int] | None = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    thinking_token_budget: int | None = None
    response_format: dict[str, Any] | None = None
    disaggregated_params: DisaggregatedParams | None = None
    priority: float | None = None
    conversation_params: dict[str, Any] | None = None


class CompletionRequest(_Sampling, forbid_unknown_fields=True, kw_only=True):
    prompt: str | list[Any]
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = None
    suffix: str | None = None
    return_context_logits: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True


class ChatCompletionRequest(_Sampling, forbid_unknown_fields=True, kw_only=True):
    messages: list[Any]
    prompt_token_ids: list[int] | None = None
    prompt_token_ids_b64: str | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None  # upstream: 0, but its validator tells "absent" from 0
    max_tokens: int | None = None  # upstream's field is max_completion_tokens, alias max_tokens
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "none"
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = "low"
    thinking: dict[str, Any] | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    injected_chat_template_kwargs: list[str] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None
    agent_hierarchy: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


_COMPLETION = msgspec.json.Decoder(CompletionRequest, strict=False)
_CHAT = msgspec.json.Decoder(ChatCompletionRequest, strict=False)
# msgpack bodies (`X-TRTLLM-Msgpack: 1` with TRTLLM_SERVE_ENABLE_MSGSPEC=1), validated the same way
_COMPLETION_MSGPACK = msgspec.msgpack.Decoder(CompletionRequest, strict=False)
_CHAT_MSGPACK = msgspec.msgpack.Decoder(ChatCompletionRequest, strict=False)
# each model's field names (chat: True), for the unknown keys of a refused body (pydantic_errors.py)
_FIELDS = {
    chat: frozenset(f.encode_name for f in msgspec.structs.fields(model))
    for chat, model in ((False, CompletionRequest), (True, ChatCompletionRequest))
}


# -- what the rest of the simulator reads -----------------------------------------------------
@dataclass(frozen=True)
class Limits:
    """What the executor accepts: vocabulary, sequence length, role, disaggregation on/off, and
    the prompt limit without chunked prefill (`max_num_tokens`, None: no limit)."""

    vocab_size: int
    max_seq_len: int
    role: str = "mixed"
    disagg_enabled: bool = True
    max_prompt_tokens: int | None = None


@dataclass
class ParsedRequest:
    """A request as the engine and the response builders need it. `stops`: the stop words as
    (token ids, stop_reason) in TensorRT-LLM's order (stop_token_ids, then stop strings), None
    when there are none; `logprobs`: how many per token (0: none); `disagg_echo`: the request's
    `disaggregated_params` as a response echoes them (generation_only, context_and_generation);
    `auth_fields`: the protected fields `disagg_auth.py` signs, None when there are none."""

    chat: bool
    model: str
    prompt: list[int]
    max_tokens: int
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    stops: tuple[tuple[tuple[int, ...], int | str], ...] | None = None
    include_stop: bool = False
    min_tokens: int = 0
    ignore_eos: bool = False
    detokenize: bool = True
    logprobs: int = 0
    top_logprobs: bool = False
    echo_text: str | None = None
    role: str = "assistant"
    kind: Kind = Kind.LOCAL
    disagg_request_id: int | None = None
    ctx_request_id: int | None = None
    first_gen_tokens: list[int] = field(default_factory=list)
    ctx_usage: dict[str, Any] | None = None
    ctx_endpoint: str | None = None
    return_prompt_b64: bool = False
    disagg_echo: dict[str, Any] | None = None
    auth_fields: dict[str, str | None] | None = None


def parse_request(raw: bytes, chat: bool, tokenizer: Tokenizer, limits: Limits, msgpack: bool = False) -> ParsedRequest:
    """Validate `raw` (a JSON body, or msgpack when `msgpack`) into a ParsedRequest. Raises
    `ValidationFailed` (400 `{"error"}`), `UnreadableBody` (400 `{"detail"}`, msgpack that does not
    decode) or `RequestError` (400 `ErrorResponse`)."""
    decoder = (_CHAT_MSGPACK if chat else _COMPLETION_MSGPACK) if msgpack else (_CHAT if chat else _COMPLETION)
    try:
        body: CompletionRequest | ChatCompletionRequest = decoder.decode(raw)
    except msgspec.ValidationError as exc:
        decode = (lambda: msgspec.msgpack.decode(raw)) if msgpack else (lambda: orjson.loads(raw))
        raise ValidationFailed(pydantic_message(str(exc), decode, _FIELDS[chat])) from None
    except msgspec.DecodeError as exc:
        if msgpack:  # FastAPI's answer to a body its Request.json() could not read
            raise UnreadableBody("There was an error parsing the body") from None
        raise ValidationFailed(_validation_message(raw, exc)) from None
    _model_validators(body)
    _sampling_checks(body, limits.vocab_size)
    if isinstance(body, ChatCompletionRequest):
        prompt, role, echo_text = _chat_prompt(body, tokenizer)
        max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        logprobs = (body.top_logprobs or 1) if body.logprobs else 0
        top_logprobs, detokenize = bool(body.logprobs and body.top_logprobs), True
    else:
        prompt, echo_text = _completion_prompt(body, tokenizer)
        role, max_tokens, logprobs, top_logprobs, detokenize = (
            "assistant",
            body.max_tokens,
            body.logprobs or 0,
            False,
            body.detokenize,
        )
    _check_token_ids(prompt, limits.vocab_size)
    options = body.stream_options if body.stream else None
    include_usage = bool(options is not None and options.include_usage)
    req = ParsedRequest(
        chat=chat,
        model=body.model,
        prompt=prompt,
        max_tokens=_max_tokens(max_tokens, len(prompt), limits.max_seq_len),
        stream=bool(body.stream),
        include_usage=include_usage,
        continuous_usage=include_usage and bool(options and options.continuous_usage_stats),
        stops=_stop_words(body, tokenizer),
        include_stop=body.include_stop_str_in_output,
        min_tokens=max(body.min_tokens, 0),
        ignore_eos=body.ignore_eos,
        detokenize=detokenize,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        echo_text=echo_text,
        role=role,
    )
    if body.disaggregated_params is not None:
        _apply_disagg_params(req, body.disaggregated_params, limits)
    if (
        limits.max_prompt_tokens is not None
        and req.kind is not Kind.GENERATION_ONLY
        and len(prompt) > limits.max_prompt_tokens
    ):
        raise RequestError(
            f"The sum of prompt length ({float(len(prompt))}), query length (0) should not exceed "
            f"max_num_tokens ({limits.max_prompt_tokens})"
        )
    return req


def _validation_message(raw: bytes, exc: Exception) -> str:
    """msgspec's message for a body that is not JSON at all."""
    if not raw.strip():
        return "Field required: the request body is missing"
    return f"JSON decode error: {exc}"


def _model_validators(body: CompletionRequest | ChatCompletionRequest) -> None:
    """The protocol models' validators and field constraints (400 `{"error"}`)."""
    if isinstance(body, ChatCompletionRequest):
        if body.stream_options is not None and not body.stream:
            raise ValidationFailed("Value error, stream_options can only be set if stream is true")
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise ValidationFailed(
                "max_completion_tokens: Extra inputs are not permitted (its alias max_tokens is set)"
            )
        if body.top_logprobs is not None:
            _logprobs_limit("top_logprobs", body.top_logprobs)
            if not body.logprobs:
                raise ValidationFailed("Value error, logprobs must be true when using top_logprobs")
        if body.tool_choice not in ("none", "auto", None) and not body.tools:
            raise ValidationFailed("Value error, When using `tool_choice`, `tools` must be set.")
        if body.cache_salt is not None and not body.cache_salt.strip():
            raise ValidationFailed("Value error, Parameter 'cache_salt' must be a non-empty string if provided.")
        for i, message in enumerate(body.messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValidationFailed(f"messages.{i}.role: Field required")
            if message.get("tools") is not None and message["role"] != "system":
                raise ValidationFailed("Value error, Message-level `tools` are only allowed on system messages.")
    else:
        if body.stream_options and not body.stream:
            raise ValidationFailed("Value error, Stream options can only be defined when stream is true.")
        if body.suffix:
            raise ValidationFailed("Value error, suffix is not supported")
        if body.logprobs is not None:
            _logprobs_limit("logprobs", body.logprobs)
    if body.thinking_token_budget is not None and body.thinking_token_budget < 0:
        raise ValidationFailed("Value error, thinking_token_budget must be a non-negative integer")
    if body.priority is not None and not 0.0 <= body.priority <= 1.0:
        raise ValidationFailed("priority: Input should be greater than or equal to 0 and less than or equal to 1")
    if body.truncate_prompt_tokens is not None and body.truncate_prompt_tokens < 1:
        raise ValidationFailed("truncate_prompt_tokens: Input should be greater than or equal to 1")
    if body.response_format is not None and body.response_format.get("type") not in _RESPONSE_FORMAT_TYPES:
        raise ValidationFailed(f"response_format.type: Input should be one of {sorted(_RESPONSE_FORMAT_TYPES)}")
    if body.early_stopping is not None and not isinstance(body.early_stopping, bool) and body.early_stopping != "never":
        raise ValidationFailed("early_stopping: Input should be a valid boolean or 'never'")
    params = body.disaggregated_params
    if params is not None and params.schedule_style not in (None, 0, 1):
        raise ValidationFailed("disaggregated_params.schedule_style: Input should be 0 or 1")
    conversation = body.conversation_params
    if conversation is not None:
        cid = conversation.get("conversation_id")
        if set(conversation) - {"conversation_id", "subagent_affinity_id"} or cid is None or not str(cid).strip():
            raise ValidationFailed("conversation_params.conversation_id: Field required, non-empty")


def _logprobs_limit(name: str, value: int) -> None:
    if value < 0:
        raise ValidationFailed(f"Value error, `{name}` must be non-negative, got {value}")
    if value > MAX_LOGPROBS:
        raise ValidationFailed(f"Value error, `{name}` must be <= {MAX_LOGPROBS}, got {value}")


def _sampling_checks(body: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> None:
    """SamplingParams' checks, and what the simulator refuses by name (400 ErrorResponse)."""
    if body.n < 1:
        raise RequestError(f"require n >= 1, got n={body.n}")
    if body.n > 1:
        raise RequestError("n > 1 is not supported by the simulator (one sequence per request)")
    if body.best_of is not None and body.best_of < body.n:
        raise RequestError(f"best_of ({body.best_of}) cannot be less than n ({body.n})")
    if body.use_beam_search or (body.best_of or 1) > 1:
        raise RequestError("beam search (use_beam_search, best_of > 1) is not supported by the simulator")
    if body.top_p is not None and not 0.0 <= body.top_p <= 1.0:
        raise RequestError(f"require 0 <= top_p <= 1, got top_p={body.top_p}")
    if body.temperature is not None and body.temperature < 0:
        raise RequestError(f"require temperature >= 0, got temperature={body.temperature}")
    if body.top_k < 0:
        raise RequestError(f"require top_k >= 0, got top_k={body.top_k}")
    if body.lora_request is not None:
        raise RequestError("lora_request is not supported by the simulator (no LoRA adapters)")
    if isinstance(body, CompletionRequest) and body.return_context_logits:
        raise RequestError("return_context_logits is not supported by the simulator")
    if isinstance(body, ChatCompletionRequest):
        if body.chat_template is not None:
            raise RequestError(
                "chat_template cannot be supplied per request unless request-level chat templates are enabled at "
                "server startup."
            )
        if isinstance(body.tool_choice, dict):
            raise RequestError("a tool_choice naming a function is not supported by the simulator")
    for key, bias in (body.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise RequestError(f"Invalid logit_bias key '{key}': must be a valid integer token ID") from None
        if not 0 <= token_id < vocab_size:
            raise RequestError(f"Token ID {token_id} out of vocabulary range [0, {vocab_size})")
        if not math.isfinite(bias) or abs(bias) > _LOGIT_BIAS_LIMIT:
            raise RequestError(f"logit_bias value for token ID {token_id} must be in [-100, 100]")


def _max_tokens(requested: int | None, prompt_len: int, max_seq_len: int) -> int:
    """`_deduce_max_tokens` of the PyTorch backend: the room left in max_seq_len is the cap."""
    room = max_seq_len - prompt_len
    if room <= 0:
        raise RequestError(
            f"`default_max_tokens` ({room}) must be greater than 0, `default_max_tokens` ({room}) = max_seq_len "
            f"({max_seq_len}) - `splited_prompt_len` ({prompt_len}) - `query_token_len` (0)"
        )
    if requested is None:
        return min(DEFAULT_MAX_TOKENS, room)
    if requested <= 0:
        raise RequestError(f"`max_tokens` ({requested}) must be greater than 0")
    return min(requested, room)


def _completion_prompt(body: CompletionRequest, tokenizer: Tokenizer) -> tuple[list[int], str | None]:
    """(prompt ids, the text `echo` prepends). One string or one id list; a one-element batch is
    unwrapped, as a one-prompt batch answers like a single prompt upstream."""
    prompt: Any = body.prompt
    if isinstance(prompt, list) and not _all_ints(prompt):
        if not prompt:
            raise RequestError("prompt must not be empty")
        kinds = {_prompt_item_kind(p) for p in prompt}
        if len(kinds) != 1 or None in kinds:
            raise ValidationFailed(
                "prompt: Input should be a string, a list of strings, a list of token ids or a list of lists of "
                "token ids"
            )
        if kinds != {"id"}:
            if len(prompt) > 1:
                raise RequestError(
                    "batches of prompts are not supported by the simulator (send one prompt per request)"
                )
            prompt = prompt[0]
            if isinstance(prompt, list) and not prompt:
                raise RequestError("prompt must not be empty")
    if isinstance(prompt, list) and not prompt:
        raise RequestError("prompt must not be empty")
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_bos=body.add_special_tokens)
        if body.truncate_prompt_tokens is not None:
            ids = ids[-body.truncate_prompt_tokens :]
        if not ids:
            raise RequestError("prompt must not be empty")
        return ids, prompt if body.echo else None
    if body.echo:
        # upstream concatenates the id list to the text and fails with a 400; refuse it by name
        raise RequestError("echo is not supported with a token-id prompt")
    return prompt, None  # msgspec made a new list


def _all_ints(values: list[Any]) -> bool:
    """Every item an int (a token-id prompt), at C speed; out-of-int64 ids count as ints (the
    vocabulary check refuses them)."""
    try:
        array("q", values)
    except OverflowError:
        return all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    except TypeError:
        return False
    return True


def _prompt_item_kind(item: Any) -> str | None:
    if isinstance(item, bool):
        return None
    if isinstance(item, int):
        return "id"
    if isinstance(item, str):
        return "text"
    if isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
        return "ids"
    return None


def _chat_prompt(body: ChatCompletionRequest, tokenizer: Tokenizer) -> tuple[list[int], str, str | None]:
    """(prompt ids, the answer's role, the text `echo` prepends)."""
    messages = body.messages
    role = "assistant" if body.add_generation_prompt else (messages[-1]["role"] if messages else "assistant")
    last = messages[-1] if messages else None
    echo_text = None
    if (
        body.echo
        and last is not None
        and last.get("role") == role
        and isinstance(last.get("content"), str)
        and last["content"]
    ):
        echo_text = last["content"]
    if body.prompt_token_ids is None and body.prompt_token_ids_b64:
        ids = _decode_b64_ids(body.prompt_token_ids_b64)
    elif body.prompt_token_ids is not None:
        ids = body.prompt_token_ids
    else:
        if not messages:
            raise RequestError("messages must not be empty")
        for i, message in enumerate(messages):
            content = message.get("content")
            if isinstance(content, list) and any(
                not (isinstance(p, dict) and p.get("type") == "text") for p in content
            ):
                raise RequestError(f"messages[{i}]: only text content parts are supported by the simulator")
        try:
            text = render_chat(messages, body.add_generation_prompt)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        ids = tokenizer.encode(text, add_bos=body.add_special_tokens)
    if not ids:
        raise RequestError("prompt_token_ids must not be empty")
    if body.truncate_prompt_tokens is not None:
        ids = ids[-body.truncate_prompt_tokens :]
    return ids, role, echo_text


def _decode_b64_ids(value: str) -> list[int]:
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("prompt_token_ids_b64 is not valid base64") from None
    if len(raw) % 4:
        raise RequestError("prompt_token_ids_b64 must hold int32 token ids")
    ids = array("i")
    ids.frombytes(raw)
    return ids.tolist()


def encode_b64_ids(ids: list[int]) -> str:
    """int32 little-endian base64, TensorRT-LLM's `prompt_token_ids_b64`."""
    return base64.b64encode(array("i", ids).tobytes()).decode("ascii")


def _check_token_ids(ids: list[int], vocab_size: int) -> None:
    """Every id within the vocabulary (the message of TensorRT-LLM's input check)."""
    try:
        arr = array("q", ids)
    except (TypeError, OverflowError):
        bad = next((t for t in ids if not isinstance(t, int) or not -(1 << 63) <= t < (1 << 63)), None)
        raise RequestError(f"Token ID {bad} is out of vocabulary range [0, {vocab_size})") from None
    if arr and (min(arr) < 0 or max(arr) >= vocab_size):
        bad = next(t for t in arr if not 0 <= t < vocab_size)
        raise RequestError(f"Token ID {bad} is out of vocabulary range [0, {vocab_size})")


def _stop_words(
    body: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer
) -> tuple[tuple[tuple[int, ...], int | str], ...] | None:
    """TensorRT-LLM's stop words with their stop reasons: each stop token id as a one-token word
    (reason: the id), then each stop string tokenized without special tokens (reason: the
    string). An empty string tokenizes to nothing and never matches."""
    words: list[tuple[tuple[int, ...], int | str]] = [((t,), t) for t in body.stop_token_ids or ()]
    stop = body.stop
    for s in [stop] if isinstance(stop, str) else stop or ():
        ids = tuple(tokenizer.encode(s))
        if ids:
            words.append((ids, s))
    return tuple(words) or None


def _apply_disagg_params(req: ParsedRequest, params: DisaggregatedParams, limits: Limits) -> None:
    kind = _REQUEST_TYPES.get(params.request_type.lower())
    if kind is None:
        raise RequestError(
            f"Unknown request type: {params.request_type}. Must be context_only, generation_only or "
            "context_and_generation"
        )
    if kind is not Kind.LOCAL and not limits.disagg_enabled:
        raise RequestError(f"{kind.value} requests need cache_transceiver_config on this executor")
    if kind is Kind.CONTEXT_ONLY and limits.role == "generation":
        raise RequestError("this executor serves the generation role; context_only is refused")
    if kind is Kind.GENERATION_ONLY and limits.role == "context":
        raise RequestError("this executor serves the context role; generation_only is refused")
    req.kind = kind
    req.disagg_request_id = params.disagg_request_id
    if params.encoded_opaque_state is not None or params.ctx_info_endpoint is not None:
        req.auth_fields = {
            "encoded_opaque_state": params.encoded_opaque_state,
            "ctx_info_endpoint": params.ctx_info_endpoint,
        }
    if kind is Kind.CONTEXT_ONLY:
        req.return_prompt_b64 = params.return_prompt_token_ids_b64 and req.chat  # chat only, as upstream
        return
    req.disagg_echo = echo_params(params, kind)
    if kind is not Kind.GENERATION_ONLY:
        return
    ctx_id = params.ctx_request_id if params.ctx_request_id is not None else params.disagg_request_id
    if ctx_id is None:
        raise RequestError("generation_only needs disaggregated_params.ctx_request_id")
    first = list(params.first_gen_tokens or ())
    if not first and params.schedule_style != GENERATION_FIRST:
        raise RequestError(
            "generation_only needs disaggregated_params.first_gen_tokens (or schedule_style 1, generation-first)",
        )
    _check_token_ids(first, limits.vocab_size)
    if len(first) > req.max_tokens:
        raise RequestError("first_gen_tokens is longer than max_tokens")
    req.ctx_request_id = ctx_id
    req.first_gen_tokens = first
    req.ctx_usage = usage_dict(params.ctx_usage) if params.ctx_usage is not None else None
    req.ctx_endpoint = _ctx_endpoint(params)


def usage_dict(usage: UsageInfo) -> dict[str, Any]:
    """A `UsageInfo` as `model_dump()` writes it."""
    details = usage.prompt_tokens_details
    return {
        "prompt_tokens": usage.prompt_tokens,
        "total_tokens": usage.total_tokens,
        "completion_tokens": usage.completion_tokens,
        "prompt_tokens_details": None if details is None else {"cached_tokens": details.cached_tokens},
    }


def echo_params(params: DisaggregatedParams, kind: Kind) -> dict[str, Any]:
    """The `disaggregated_params` an answer to these request params carries: the request's own,
    through `to_llm_disaggregated_params` and back (`return_prompt_token_ids_b64` and
    `resolved_thinking` are not carried, so they come back as their defaults)."""
    return {
        "request_type": kind.value if kind is not Kind.LOCAL else "context_and_generation",
        "first_gen_tokens": params.first_gen_tokens,
        "first_gen_log_probs": params.first_gen_log_probs,
        "first_gen_logits": params.first_gen_logits,
        "ctx_request_id": params.ctx_request_id,
        "encoded_opaque_state": params.encoded_opaque_state,
        "draft_tokens": params.draft_tokens,
        "disagg_request_id": params.disagg_request_id,
        "ctx_dp_rank": params.ctx_dp_rank,
        "ctx_info_endpoint": params.ctx_info_endpoint,
        "schedule_style": params.schedule_style,
        "ctx_usage": None if params.ctx_usage is None else usage_dict(params.ctx_usage),
        "return_prompt_token_ids_b64": False,
        "resolved_thinking": None,
    }


def _ctx_endpoint(params: DisaggregatedParams) -> str:
    """Where the KV is pulled from: `ctx_info_endpoint`, else the endpoint in the simulator's
    own `encoded_opaque_state` (base64 JSON)."""
    endpoint: Any = params.ctx_info_endpoint
    if not endpoint and params.encoded_opaque_state:
        try:
            endpoint = orjson.loads(base64.b64decode(params.encoded_opaque_state)).get("ctx_info_endpoint")
        except (binascii.Error, ValueError, AttributeError, orjson.JSONDecodeError):
            endpoint = None
    if not isinstance(endpoint, str) or not endpoint:
        raise RequestError(
            "generation_only needs disaggregated_params.ctx_info_endpoint (or the context executor's "
            "encoded_opaque_state)",
        )
    return _SCHEME_RE.sub("", endpoint).rstrip("/")
