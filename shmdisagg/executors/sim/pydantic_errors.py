"""A request's type error worded as TensorRT-LLM's worker words it.

The worker validates a request body with its pydantic models (`tensorrt_llm/serve/
openai_protocol.py`) and answers a `RequestValidationError` with 400 `{"error": str(exc)}`
(`OpenAIServer`'s exception handler in `tensorrt_llm/serve/openai_server.py`): the str of
pydantic's error list, for example

    [{'type': 'float_parsing', 'loc': ('body', 'temperature'), 'msg': 'Input should be a valid
    number, unable to parse string as a number', 'input': 'hot'}]

The simulator decodes with msgspec, whose messages read `Expected `float | null`, got `str` - at
`$.temperature``. `pydantic_message` rewords the errors the two describe the same way: a
top-level field of one JSON type given another, and a missing required field. Anything else (a
union such as `stop`, a nested path, a constraint) keeps msgspec's wording: pydantic's there
depends on the model's structure (a union reports one error per member), which the message
does not carry. Measured against the worker copy: tests/integration/test_sim_vs_worker.py
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


def pydantic_message(message: str, decode: Callable[[], Any]) -> str:
    """`message` (a msgspec.ValidationError's) as pydantic's one-error list, when the two
    describe the error the same way; else `message` unchanged. `decode` returns the body as
    Python values (the error's `input` is read from it), and may raise: then `message` stands."""
    missing = _MSGSPEC_MISSING.fullmatch(message)
    typed = _MSGSPEC_TYPE.fullmatch(message)
    try:
        body = decode()
    except Exception:  # any body the decoder refuses keeps msgspec's wording
        return message
    if not isinstance(body, dict):
        return message
    if missing is not None:
        return str([{"type": "missing", "loc": ("body", missing["field"]), "msg": "Field required", "input": body}])
    if typed is None or typed["field"] not in body:
        return message
    expected, got, name = typed["expected"], typed["got"], typed["field"]
    value = body[name]
    if got == "float" and float(value).is_integer():  # pydantic takes 2.0 as an int: not this error
        return message
    if expected == "object" and name in MODEL_FIELDS:
        kind, msg = _MODEL_ERROR
    elif (expected, got) in _PARSE_ERRORS:
        kind, msg = _PARSE_ERRORS[expected, got]
    elif expected in _TYPE_ERRORS:
        kind, msg = _TYPE_ERRORS[expected]
    else:
        return message
    return str([{"type": kind, "loc": ("body", name), "msg": msg, "input": value}])
