"""A request's type error worded as TensorRT-LLM's worker words it.

The worker validates a request body with its pydantic models (`tensorrt_llm/serve/
openai_protocol.py`) and answers a `RequestValidationError` with 400 `{"error": str(exc)}`
(`OpenAIServer`'s exception handler in `tensorrt_llm/serve/openai_server.py`): the str of
pydantic's error list, for example

    [{'type': 'float_parsing', 'loc': ('body', 'temperature'), 'msg': 'Input should be a valid
    number, unable to parse string as a number', 'input': 'hot'}]

The simulator decodes with msgspec, whose messages read `Expected `float | null`, got `str` - at
`$.temperature``. `pydantic_message` rewords the errors the two describe the same way: a
top-level field of one JSON type given another, a missing required field, unknown keys (at the
top level, or in a top-level object), and `stop` (a union: pydantic reports one error per
member). Anything else (other unions, deeper paths, constraints) keeps msgspec's wording:
pydantic's there depends on the model's structure, which the message does not carry. msgspec
stops at the first error where pydantic lists them all; only unknown top-level keys are all
listed here. Measured against the worker copy: tests/integration/test_sim_vs_worker.py
`test_a_type_error_is_worded_as_the_worker_words_it`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

_MSGSPEC_TYPE = re.compile(
    r"Expected `(?P<expected>[a-z]+)(?: \| null)?`, got `(?P<got>[a-z]+)` - at `\$\.(?P<field>\w+)`"
)
_MSGSPEC_MISSING = re.compile(r"Object missing required field `(?P<field>\w+)`")
_MSGSPEC_EXTRA = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`(?: - at `\$\.(?P<at>\w+)`)?")
_MSGSPEC_STOP = re.compile(r"Expected `str(?: \| array \| null)?`, got `[a-z]+` - at `\$\.stop(?:\[(?P<index>\d+)\])?`")

# Fields whose type is a pydantic model: a non-object there is pydantic's model error, not its
# dict error (openai_protocol.py: StreamOptions, ResponseFormat, DisaggregatedParams).
MODEL_FIELDS = frozenset({"stream_options", "response_format", "disaggregated_params"})

# msgspec's JSON type -> (pydantic's error type, its message) for an input of another JSON type.
_TYPE_ERRORS = {
    "float": ("float_type", "Input should be a valid number"),
    "int": ("int_type", "Input should be a valid integer"),
    "bool": ("bool_type", "Input should be a valid boolean"),
    "str": ("string_type", "Input should be a valid string"),
    "array": ("list_type", "Input should be a valid list"),
    "object": ("dict_type", "Input should be a valid dictionary"),
}
# ... and for a string pydantic's lax mode tried to parse (or a number given a bool / an int).
_PARSE_ERRORS = {
    ("float", "str"): ("float_parsing", "Input should be a valid number, unable to parse string as a number"),
    ("int", "str"): ("int_parsing", "Input should be a valid integer, unable to parse string as an integer"),
    ("int", "float"): ("int_from_float", "Input should be a valid integer, got a number with a fractional part"),
    ("bool", "str"): ("bool_parsing", "Input should be a valid boolean, unable to interpret input"),
    ("bool", "int"): ("bool_parsing", "Input should be a valid boolean, unable to interpret input"),
}
_MODEL_ERROR = ("model_attributes_type", "Input should be a valid dictionary or object to extract fields from")


def pydantic_message(message: str, decode: Callable[[], Any], fields: frozenset[str] = frozenset()) -> str:
    """`message` (a msgspec.ValidationError's) as pydantic's error list, when the two describe
    the error the same way; else `message` unchanged. `decode` returns the body as Python values
    (the errors' `input` is read from it), and may raise: then `message` stands. `fields`: the
    request model's field names, so that every unknown top-level key is listed, as pydantic
    lists them (msgspec stops at the first)."""
    try:
        body = decode()
    except Exception:  # any body the decoder refuses keeps msgspec's wording
        return message
    if not isinstance(body, dict):
        return message
    errors = _errors(message, body, fields)
    return str(errors) if errors else message


def _error(kind: str, loc: tuple[Any, ...], msg: str, value: Any) -> dict[str, Any]:
    return {"type": kind, "loc": ("body", *loc), "msg": msg, "input": value}


def _errors(message: str, body: dict[str, Any], fields: frozenset[str]) -> list[dict[str, Any]]:
    if (missing := _MSGSPEC_MISSING.fullmatch(message)) is not None:
        return [_error("missing", (missing["field"],), "Field required", body)]
    if (extra := _MSGSPEC_EXTRA.fullmatch(message)) is not None:
        return _extra_errors(extra["field"], extra["at"], body, fields)
    if (stop := _MSGSPEC_STOP.fullmatch(message)) is not None and "stop" in body:
        return _stop_errors(body["stop"], stop["index"] is not None)
    typed = _MSGSPEC_TYPE.fullmatch(message)
    if typed is None or typed["field"] not in body:
        return []
    expected, got, name = typed["expected"], typed["got"], typed["field"]
    value = body[name]
    if got == "float" and float(value).is_integer():  # pydantic takes 2.0 as an int: not this error
        return []
    if expected == "object" and name in MODEL_FIELDS:
        kind, msg = _MODEL_ERROR
    elif (expected, got) in _PARSE_ERRORS:
        kind, msg = _PARSE_ERRORS[expected, got]
    elif expected in _TYPE_ERRORS:
        kind, msg = _TYPE_ERRORS[expected]
    else:
        return []
    return [_error(kind, (name,), msg, value)]


def _extra_errors(field: str, at: str | None, body: dict[str, Any], fields: frozenset[str]) -> list[dict[str, Any]]:
    """`extra_forbidden`: every unknown top-level key (all of them, in the body's order, with
    `fields`), or the one msgspec found in a top-level object such as `stream_options`."""
    msg = "Extra inputs are not permitted"
    if at is None:
        keys = [k for k in body if k not in fields] if fields else [field]
        return [_error("extra_forbidden", (k,), msg, body[k]) for k in keys if k in body]
    inner = body.get(at)
    if not isinstance(inner, dict) or field not in inner:
        return []
    return [_error("extra_forbidden", (at, field), msg, inner[field])]


def _stop_errors(stop: Any, element: bool) -> list[dict[str, Any]]:
    """`stop: Optional[Union[str, List[str]]]`: pydantic tries both members and reports each
    one's errors, tagged by the member (`str`, `list[str]`)."""
    errors = [_error("string_type", ("stop", "str"), "Input should be a valid string", stop)]
    if element and isinstance(stop, list):
        errors += [
            _error("string_type", ("stop", "list[str]", i), "Input should be a valid string", v)
            for i, v in enumerate(stop)
            if not isinstance(v, str)
        ]
    elif not element:
        errors.append(_error("list_type", ("stop", "list[str]"), "Input should be a valid list", stop))
    return errors
