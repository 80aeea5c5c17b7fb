"""Executor answers on their way to a client: the contract they must keep, and what never leaves.

**Nothing internal reaches a client.** The disaggregated handoff travels in answer fields that
only the orchestrator may read: a choice's `disaggregated_params` (the context executor's
`encoded_opaque_state` embeds its transceiver address, `ctx_info_endpoint` names it) and the
answer's `prompt_token_ids` / `prompt_token_ids_b64` (`tensorrt_llm/serve/openai_protocol.py`:
`CompletionResponse`, `ChatCompletionResponse`, their choices). `public_answer` sets the fields a
plain, non-disaggregated `trtllm-serve` answer also has to `null`, which is what that answer
carries there, and removes the other internal keys; `StreamGuard` does the same to streamed
chunks, whose schema has none of them. Executor error messages are unwrapped as TensorRT-LLM's
orchestrator unwraps them (`_upstream_error_message`, `tensorrt_llm/serve/openai_disagg_server.py`)
and any `host:port` or URL in them is redacted (`redact`).

**An answer that breaks the request's contract is an executor error**, never passed through
(`ContractError`: a 502 before the first byte, an SSE error event after): a context reply that
is not exactly one choice (requests are `n: 1` here), a generation answer with more completion
tokens than the request's `max_tokens`, or without a `finish_reason`, and a stream that ends
without one.

Cost: a streamed chunk is scanned once, in C (`_native.sse_scan`: internal keys with a value
other than `null`, an `"error"` key, a `finish_reason` with a string value, `completion_tokens`);
only a chunk with an internal or error key is parsed and rewritten. Chunks are
relayed at SSE event boundaries: the bytes of an event not yet complete wait for its end
(`BENCHMARKS.md`, "Relaying a streamed chunk").
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import orjson

from shmdisagg._native import SSE_FINISHED, SSE_INTERNAL, SSE_USAGE, sse_scan
from shmdisagg.orchestrator.errors import error_object

# Keys of the disaggregated handoff. In a non-streaming answer the first group exist in the plain
# (non-disaggregated) trtllm-serve schema and are set to null; every other internal key is removed.
NULLED_ANSWER_KEYS = ("prompt_token_ids", "prompt_token_ids_b64")
NULLED_CHOICE_KEYS = ("disaggregated_params",)
INTERNAL_KEYS = (
    "disaggregated_params",
    "prompt_token_ids",
    "prompt_token_ids_b64",
    "kv_transfer_params",
    "ctx_request_id",
    "disagg_request_id",
    "encoded_opaque_state",
    "ctx_info_endpoint",
    "first_gen_tokens",
    "ctx_usage",
)
# Streamed chunks are scanned in C (`native/sse.c`, the same keys): an internal key whose value is
# not null, or an "error" key (an executor's SSE error event). Content is JSON-escaped, so an
# unescaped `"key":` is always a key; a false positive (a token spelled like one in top_logprobs)
# only costs a parse.
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
# A URL, host:port (an IPv4 address, a [v6] address, or a name with a letter in it; a port of
# 2-5 digits), or a Python repr's host and port: what an executor's error text may say about
# where it, or its peer, lives. The scheme and the name are matched only from the start of a run
# of their characters (the lookbehinds), and the name's letter by a lookahead: a name pattern
# that could split a run two ways backtracked cubically on a long word without a colon (an
# executor echoing a 1,200-character value took 2.3 s, and blocked the worker's loop).
_ADDRESS = re.compile(
    # Python reprs name an address as `host='h', port=N` (aiohttp's ConnectionKey) or `('h', N)`
    r"\bhost=(?:'[^']*'|\"[^\"]*\")|\bport=\d{2,5}\b|\(\s*(?:'[^']*'|\"[^\"]*\")\s*,\s*\d{2,5}\s*\)"
    r"|(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"()<>,]+"
    r"|(?:\[[0-9A-Fa-f:.]+\]|\d{1,3}(?:\.\d{1,3}){3}|(?<![A-Za-z0-9_.\-])(?=[A-Za-z0-9_.\-]*[A-Za-z])[A-Za-z0-9_.\-]+)"
    r":\d{2,5}\b(?:/[^\s'\"]*)?"
)
DONE = b"data: [DONE]\n\n"


class ContractError(Exception):
    """An executor answer that breaks the request's contract. `str()` is the client's message
    (no executor address); the caller logs which server sent it."""


def redact(message: str) -> str:
    """`message` with every `host:port` and URL replaced by `<executor>`."""
    return _ADDRESS.sub("<executor>", message)


# One error of a pydantic ValidationError's `errors()` list as the worker writes it in its
# `{"error": str(exc.errors())}` body (a Python repr): its `loc` tuple and `msg` string.
_REPR_ERROR = re.compile(r"""'loc': \(([^)]*)\), 'msg': (?:'((?:[^'\\]|\\.)*)'|"((?:[^"\\]|\\.)*)")""")
# A handoff field with its value, as a repr or JSON dump of a request writes it
_INTERNAL_NAMES = re.compile("['\"](?:" + "|".join(INTERNAL_KEYS) + ")['\"]\\s*:")


def _validation_summary(message: Any) -> str | None:
    """A request validation error without the request in it: "loc: msg" per error. The
    worker's validation errors carry their `input`, the whole leg for a model-level check
    (`stream_options` without `stream`), handoff included; None when `message` is none."""
    if isinstance(message, list):  # FastAPI's own `detail`: [{"loc": [...], "msg": ...}, ...]
        parts = [
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}"
            for e in message[:MAX_SUMMARY_ERRORS]
            if isinstance(e, dict) and "msg" in e
        ]
    elif isinstance(message, str):
        found = itertools.islice(_REPR_ERROR.finditer(message), MAX_SUMMARY_ERRORS)
        parts = [
            ".".join(p.strip().strip("'\"") for p in m[1].split(",") if p.strip()) + ": " + (m[2] or m[3])
            for m in found
        ]
    else:
        return None
    return "; ".join(parts) or None


def executor_error_message(raw: bytes, status: int) -> str:
    """The message of an executor's error body, unwrapped as TensorRT-LLM's orchestrator does it
    (`error.message`, then `message`, then FastAPI's `detail`, then the worker's validation
    `{"error": str}`), redacted; else a line naming only the status. A message that holds a
    handoff field with its value (`INTERNAL_KEYS`: the worker echoing the leg it refused) is cut
    down to its validation errors' locations and messages, or to the status."""
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        payload = None
    message: Any = None
    if isinstance(payload, dict):
        inner = payload.get("error")
        if isinstance(inner, dict):
            message = inner.get("message")
        elif isinstance(inner, str):
            message = inner
        message = message or payload.get("message") or payload.get("detail")
    if not message:
        return f"executor answered HTTP {status}"
    return public_message(message, f"executor refused the request (HTTP {status})")


def public_message(message: Any, fallback: str) -> str:
    """An executor's error message (a string, or FastAPI's list of errors) as a client may read
    it: addresses redacted, and cut down to its validation errors' locations and messages (else
    `fallback`) when it holds a handoff field with its value. Past `MAX_PUBLIC_MESSAGE_CHARS`
    (a worker's validation error quotes the input it refused, as long as the client sent it) it is
    cut down to those errors too, else to its first 4,096 characters."""
    text = message if isinstance(message, str) else orjson.dumps(message).decode()
    if _INTERNAL_NAMES.search(text):
        text = _validation_summary(message) or fallback
        if _INTERNAL_NAMES.search(text):  # a `msg` that quotes the leg (a validator's ValueError text)
            text = fallback
    if len(text) > MAX_PUBLIC_MESSAGE_CHARS:  # a worker echoing a long input: its errors without it
        text = _validation_summary(message) or text
        if len(text) > MAX_PUBLIC_MESSAGE_CHARS:  # 1.5 million unknown keys: as many errors
            text = _cut(text)
    return redact(text)


MAX_PUBLIC_MESSAGE_CHARS = 4096
# The errors a summary reads, at most: a body with a million unknown keys has a million (their
# summary took seconds of the worker's loop, and was megabytes long)
MAX_SUMMARY_ERRORS = 100


def _cut(text: str) -> str:
    """The first `MAX_PUBLIC_MESSAGE_CHARS` of `text`, ended at a separator so that no address is
    cut in half (a half would escape `redact`), and how much was left out."""
    head = text[:MAX_PUBLIC_MESSAGE_CHARS]
    end = max(head.rfind(c) for c in " '\",;")
    if end > MAX_PUBLIC_MESSAGE_CHARS // 2:
        head = head[:end]
    return f"{head} ... ({len(text) - len(head):,} more characters cut)"


def max_tokens_of(req: dict[str, Any]) -> int | None:
    """The request's output-token budget: `max_tokens` (chat reads it into
    `max_completion_tokens`, `ChatCompletionRequest` in openai_protocol.py), else
    `max_completion_tokens`; None when unbounded."""
    value = req.get("max_tokens")
    if value is None:
        value = req.get("max_completion_tokens")
    return value if type(value) is int else None


def check_context_answer(ctx: Any) -> dict[str, Any]:
    """A context executor's answer as the flow needs it (TensorRT-LLM's `_verify_ctx_response`,
    plus exactly one choice: requests are `n: 1`). Raises `ContractError`."""
    choices = ctx.get("choices") if isinstance(ctx, dict) else None
    if not isinstance(ctx, dict) or not isinstance(choices, list) or not choices:
        raise ContractError("context executor returned no choices")
    if len(choices) != 1 or not isinstance(choices[0], dict):
        raise ContractError(f"context executor returned {len(choices)} choices for a request with n=1")
    choice = choices[0]
    params = choice.get("disaggregated_params")
    if not isinstance(params, dict):
        raise ContractError("context response is missing disaggregated_params")
    if choice.get("finish_reason") in ("length", "not_finished") and (
        params.get("ctx_request_id") is None or params.get("disagg_request_id") is None
    ):
        raise ContractError("context response lacks ctx_request_id/disagg_request_id")
    return ctx


def check_final_answer(obj: Any, max_tokens: int | None, role: str = "generation") -> None:
    """A complete (non-streaming) answer to the client's request: exactly one choice, a
    `finish_reason`, and no more completion tokens than `max_tokens`. Raises `ContractError`."""
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        count = len(choices) if isinstance(choices, list) else "no"
        raise ContractError(f"{role} executor returned {count} choices for a request with n=1")
    if not choices[0].get("finish_reason"):
        raise ContractError(f"{role} executor's answer has no finish_reason")
    usage = obj.get("usage")
    used = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if max_tokens is not None and type(used) is int and used > max_tokens:
        raise ContractError(f"{role} executor returned {used} completion tokens for max_tokens={max_tokens}")


def public_answer(obj: dict[str, Any]) -> dict[str, Any]:
    """A non-streaming answer as a client may see it (in place, returned): the handoff fields a
    plain answer also has set to null, every other internal key removed."""
    _scrub(obj, NULLED_ANSWER_KEYS)
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                _scrub(choice, NULLED_CHOICE_KEYS)
    return obj


def _scrub(obj: dict[str, Any], nulled: tuple[str, ...]) -> None:
    for key in INTERNAL_KEYS:
        if key in obj:
            if key in nulled:
                obj[key] = None
            else:
                del obj[key]


def _scrub_chunk(obj: dict[str, Any]) -> None:
    """A streamed chunk: its schema has no internal key at all, so every one is removed."""
    for key in INTERNAL_KEYS:
        obj.pop(key, None)
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                for key in INTERNAL_KEYS:
                    choice.pop(key, None)


class StreamGuard:
    """Relays one generation stream's SSE bytes: complete events only, internal fields removed,
    an executor's error event put in our error shape, the contract checked.

    `feed(chunk)` returns the bytes to send now (possibly b"": an event still incomplete);
    `end()` returns the last bytes to send once the executor's stream ended, `data: [DONE]`
    included (the executor's own is held back until then, and added if it sent none), or raises
    `ContractError` when it ended without a `finish_reason` (and without an error event of its
    own), so that the error event comes before the one `[DONE]`. `finished` / `errored` /
    `done` say what was seen."""

    __slots__ = ("_tail", "finished", "errored", "done", "max_tokens")

    def __init__(self, max_tokens: int | None) -> None:
        self._tail = b""
        self.finished = False
        self.errored = False
        self.done = False
        self.max_tokens = max_tokens

    def feed(self, chunk: bytes) -> bytes:
        if self._tail:
            chunk = self._tail + chunk
            self._tail = b""
        scanned = sse_scan(chunk)
        cut = scanned >> 8
        if cut < len(chunk):
            self._tail = chunk[cut:]
            chunk = chunk[:cut]
        if scanned & SSE_INTERNAL:
            chunk = self._rewrite(chunk)
        if scanned & SSE_FINISHED:
            self.finished = True
        if scanned & SSE_USAGE and self.max_tokens is not None:
            self._check_usage(chunk)
        if DONE in chunk:  # held back: end() decides what ends the stream
            self.done = True  # every [DONE]: a worker's error path sends two (openai_server.py)
            chunk = chunk.replace(DONE, b"")
        return chunk

    def end(self) -> bytes:
        tail, self._tail = self._tail, b""
        if tail.strip():  # an unterminated last event: relay it as it is, checked like the rest
            tail = self.feed(tail + b"\n\n")
        if not (self.finished or self.errored):
            raise ContractError("generation executor's stream ended without a finish_reason")
        return tail + DONE

    def _check_usage(self, chunk: bytes) -> None:
        for m in _COMPLETION_TOKENS.finditer(chunk):
            used = int(m.group(1))
            if self.max_tokens is not None and used > self.max_tokens:
                raise ContractError(
                    f"generation executor streamed {used} completion tokens for max_tokens={self.max_tokens}"
                )

    def _rewrite(self, chunk: bytes) -> bytes:
        """The complete events of a chunk `sse_scan` found an internal key or an error in, each
        rewritten; b"" if none is left."""
        out = []
        for event in chunk.replace(b"\r\n", b"\n").split(b"\n\n"):
            if event:
                event = self._rewrite_event(event)
            if event:
                out.append(event)
        return b"\n\n".join(out) + b"\n\n" if out else b""

    def _rewrite_event(self, event: bytes) -> bytes:
        """One event without its blank line: scrubbed, an error event in our shape, or b"" for an
        event with no data line (comments and unknown fields, which a client ignores, but which
        may hold what was found). Raises `ContractError` for a data line that is no JSON object
        (it may hold what was found, and cannot be scrubbed)."""
        head, sep, data = event.partition(b"data:")
        if not sep:
            return b""
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            if data.strip() == b"[DONE]":
                return event
            raise ContractError("generation executor streamed an event that is not JSON") from None
        if not isinstance(obj, dict):
            raise ContractError("generation executor streamed an event that is not a JSON object")
        inner = obj.get("error")
        if inner is not None:
            self.errored = True
            message = inner.get("message") if isinstance(inner, dict) else inner
            failed = "generation executor failed mid-stream"
            text = public_message(message, failed) if isinstance(message, str) and message else failed
            return head + b"data: " + orjson.dumps({"error": error_object(502, text)})
        _scrub_chunk(obj)
        return head + b"data: " + orjson.dumps(obj)
