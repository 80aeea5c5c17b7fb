"""Validation of public OpenAI requests before any executor or counter is touched.

The two hot routes read bodies as plain dicts (orjson), not pydantic models: they only relay
them (pydantic validation and re-serialisation add 0.3-0.4 ms per request over plain ASGI,
which doubles a non-streaming request's proxy CPU: the project's stack calibration, in its
design notes, not part of the repository). This module checks exactly what disaggregated
serving needs and raises `RequestError(400)` with an OpenAI error body otherwise.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import orjson
from pydantic import TypeAdapter, ValidationError

from shmdisagg._native import json_long_digits, token_ids_int32, token_ids_ok
from shmdisagg.orchestrator.errors import RequestError
from shmdisagg.orchestrator.splice import TokenIds

# Fields only the orchestrator sets on executor requests: a client's copy is refused with 400 by
# name rather than trusted or silently dropped (TensorRT-LLM's orchestrator overwrites them; its
# protocol marks `prompt_token_ids_b64` "not for clients", tensorrt_llm/serve/openai_protocol.py).
# A chat's `prompt_token_ids` is a client field there (it skips the worker's template) and is kept.
ORCHESTRATOR_FIELDS = ("disaggregated_params", "prompt_token_ids_b64", "ctx_usage")


_INT = TypeAdapter(int)
_BOOL = TypeAdapter(bool)


def _bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, "invalid_request", param)


def parse_body(body: bytes) -> dict[str, Any]:
    """Decode a JSON object body. Raises `RequestError(400)`, also for an integer outside
    [-2**63, 2**64) (`out_of_range_integer`)."""
    try:
        req = orjson.loads(body)
    except orjson.JSONDecodeError as err:
        raise _bad(f"request body is not valid JSON: {err.msg}") from None
    if not isinstance(req, dict):
        raise _bad("request body must be a JSON object")
    where = out_of_range_integer(body)
    if where is not None:
        raise _bad(f"'{where}' is an integer outside [-2**63, 2**64), which disaggregated serving cannot carry", where)
    return req


ORJSON_MAX_DEPTH = 1024  # orjson refuses deeper documents ("depth limit exceeded")


def out_of_range_integer(body: bytes) -> str | None:
    """Where (a dotted path, "request" for the top) the JSON document `body` holds an integer
    outside [-2**63, 2**64), else None. orjson decodes such an integer as a float, so its value
    would change on the way to the executors (`seed: 2**64` became 1.8446744073709552e+19), and
    neither JSON legs (orjson) nor msgpack legs can carry it; TensorRT-LLM's own JSON decoder
    keeps it exact. Costs a native scan (`json_long_digits`, ~0.1 ns a byte); only a body with
    a run of 19 digits is decoded again, exactly, to look."""
    if not json_long_digits(body):
        return None
    # orjson takes documents 1,024 levels deep, past the interpreter's limit for json's decoder
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + ORJSON_MAX_DEPTH)
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    finally:
        sys.setrecursionlimit(limit)
    return _big_int_at(doc)


def _big_int_at(doc: Any) -> str | None:
    """The dotted path of the first integer outside [-2**63, 2**64) in `doc` (depth first,
    without recursion: the document may be as deep as orjson takes), else None."""
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        path, value = stack.pop()
        if type(value) is int:
            if not -(2**63) <= value < 2**64:
                return path or "request"
            continue
        if isinstance(value, dict):
            items: Any = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            continue
        stack.extend(reversed([(f"{path}.{k}" if path else str(k), v) for k, v in items]))
    return None


# What `token_ids_ok` accepts: the executor's token ids are int32 (TensorRT-LLM's `TokenIdType`).
TOKEN_ID_RANGE = "integers from 0 to 2147483647"


def _is_token_list(value: Any) -> bool:
    # In C: a 14k-token prompt took ~0.6 ms to check in Python, on every request.
    return token_ids_ok(value)


def normalise_prompt(req: dict[str, Any]) -> str | Sequence[int]:
    """The single prompt of a completion request: a string or a non-empty list of token ids
    (`splice.TokenIds` when the fleet read them from the body natively).

    A one-element batch is unwrapped (as TensorRT-LLM does); a batch of several prompts is
    refused because disaggregated serving handles one prompt per request.
    """
    return _normalise_prompt(req, False)[0]


def _normalise_prompt(req: dict[str, Any], want_ids: bool) -> tuple[str | Sequence[int], bytes | None]:
    """`normalise_prompt`, plus the ids of a token-id prompt as int32 bytes when `want_ids`
    (checked and converted in the same native pass)."""
    if "prompt" not in req:
        raise _bad("'prompt' is required", "prompt")
    prompt = req["prompt"]
    if isinstance(prompt, TokenIds):  # read and checked natively already (service._decode)
        return prompt, prompt.ids32 if want_ids else None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        # "" is the executor's to judge: TensorRT-LLM's worker serves it (the BOS token is the
        # prompt) and refuses it with add_special_tokens false ("The prompt must not be empty")
        return prompt, None
    if isinstance(prompt, list):
        if not prompt:
            raise _bad("'prompt' must not be empty", "prompt")
        if want_ids:
            ids = token_ids_int32(prompt)
            if ids is not None:
                return prompt, ids
        elif _is_token_list(prompt):
            return prompt, None
        lax = _lax_token_ids(prompt)  # only once the native check said no: a Python pass
        if lax is not None and token_ids_ok(lax):  # 5.0 and true are ids to upstream's List[int]
            return lax, token_ids_int32(lax) if want_ids else None
        if all(isinstance(p, (str, list)) for p in prompt):  # only once it is not token ids
            raise _bad("a batch of prompts is not supported; send one prompt per request", "prompt")
    raise _bad(f"'prompt' must be a string or a list of token ids ({TOKEN_ID_RANGE})", "prompt")


def _lax_token_ids(prompt: list[Any]) -> list[int] | None:
    """A token-id prompt with floats of integral value or booleans among its ids, as ints (as
    pydantic's lax `List[int]` reads it); None when it holds anything else."""
    out = []
    for x in prompt:
        if type(x) is int:
            out.append(x)
        elif type(x) is bool or (type(x) is float and x.is_integer()):
            out.append(int(x))
        else:
            return None
    return out


def _check_messages(req: dict[str, Any]) -> None:
    messages = req.get("messages")
    if messages is None:
        raise _bad("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad("each message must be an object with a 'role'", "messages")


def _json_type(value: Any) -> str:
    """The JSON type of a decoded value, as an error message names it."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, str):
        return "a string"
    return type(value).__name__


_INVALID = object()


def _lax(value: Any, kind: type) -> Any:
    """`value` as pydantic's lax mode reads it for an `int` or `bool` field, as TensorRT-LLM's
    request models (`openai_protocol.py`) do: "3", 3.0 and true are the int 3, 3, 1; "false",
    "no", 0 the bool False. `_INVALID` when pydantic would refuse it."""
    if type(value) is kind:
        return value
    try:
        return (_INT if kind is int else _BOOL).validate_python(value)
    except ValidationError:
        return _INVALID


def _int_field(req: dict[str, Any], key: str) -> int | None:
    """The request's `key`, an int field, coerced in place (None when absent or null)."""
    value = req.get(key)
    if value is None or type(value) is int:
        return value
    coerced = _lax(value, int)
    if coerced is _INVALID:
        raise _bad(f"'{key}' must be an integer, got {_json_type(value)}", key)
    if not -(2**63) <= coerced < 2**64:  # what JSON numbers can carry on to the executors (orjson)
        raise _bad(f"'{key}' is out of range", key)
    req[key] = coerced
    return coerced  # type: ignore[no-any-return]


def _bool_field(mapping: dict[str, Any], key: str, name: str) -> None:
    """`mapping[key]`, a bool field, coerced in place; `name` is its name in a message."""
    value = mapping.get(key)
    if value is None or type(value) is bool:
        return
    coerced = _lax(value, bool)
    if coerced is _INVALID:
        raise _bad(f"'{name}' must be true or false", name)
    mapping[key] = coerced


def _check_positive_int(req: dict[str, Any], key: str) -> None:
    value = _int_field(req, key)
    if value is not None and value < 1:
        raise _bad(f"'{key}' must be a positive integer", key)


def validate(req: dict[str, Any], chat: bool, want_ids: bool = False) -> bytes | None:
    """Check a request in place. Raises `RequestError(400)`, also for a field only the
    orchestrator may set. The model's name is not checked against the executors' (neither
    TensorRT-LLM's orchestrator nor its worker does: a client's alias is served).

    With `want_ids` (a router hashes the prompt), returns a token-id prompt's ids as native int32
    bytes, produced by the same pass that checks them (`_native.token_ids_int32`); else None."""
    for key in ORCHESTRATOR_FIELDS:
        if key in req:
            if req[key] is None:  # the answers' own placeholder, echoed back: absent, as the protocol reads it
                del req[key]
                continue
            raise _bad(
                f"'{key}' is set by the disaggregated orchestrator, not by clients; remove it from the request", key
            )
    model = req.get("model")
    if model is None:
        raise _bad("'model' is required", "model")
    if not isinstance(model, str):  # "" too is a string TensorRT-LLM's protocol serves
        raise _bad(f"'model' must be a string, got {_json_type(model)}", "model")
    ids = None
    if chat:
        _check_messages(req)
        given = req.get("prompt_token_ids")
        if given is not None and not token_ids_ok(given):
            raise _bad(
                f"'prompt_token_ids' must be a non-empty list of token ids ({TOKEN_ID_RANGE})", "prompt_token_ids"
            )
    else:
        req["prompt"], ids = _normalise_prompt(req, want_ids)
    for key in ("n", "best_of"):
        _check_positive_int(req, key)
        if (req.get(key) or 1) > 1:
            raise _bad(f"'{key}' > 1 is not supported by disaggregated serving", key)
    _check_positive_int(req, "max_tokens")
    _check_positive_int(req, "max_completion_tokens")
    # The request models' `validate_stream_options` (openai_protocol.py; "before" validators: the
    # values as sent), which upstream's orchestrator runs at its edge; a context leg (sent without
    # stream_options) would pass them and only the generation leg fail. Their wordings differ.
    if not req.get("stream"):
        if chat and req.get("stream_options") is not None:
            raise _bad("stream_options can only be set if stream is true", "stream_options")
        if not chat and req.get("stream_options"):
            raise _bad("Stream options can only be defined when stream is true.", "stream_options")
    for key in ("stream", "echo"):  # the flows branch on them
        _bool_field(req, key, key)
    if not req.get("stream"):
        # left only where the validators passed it (`"stream": "false"` is a true string to them,
        # `{}` no options): it means nothing to a whole answer, and with the coerced false the
        # executors' validators would refuse it
        req.pop("stream_options", None)
    options = req.get("stream_options")
    if isinstance(options, dict):
        _bool_field(options, "include_usage", "stream_options.include_usage")
    return ids


def prompt_load_tokens(req: dict[str, Any], chat: bool) -> int:
    """The load a request adds when a router counts tokens.

    Token-id prompts count their length. Text counts characters, as TensorRT-LLM's
    `get_request_num_tokens` does for untokenised prompts; chats count the characters of every
    message's string content.
    """
    if not chat:
        prompt = req["prompt"]
        return len(prompt)
    total = 0
    for m in req["messages"]:
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return total
