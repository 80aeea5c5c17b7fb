"""The streaming OpenAI client and the per-request record it fills.

Sends one prepared `/v1/completions` body, reads the SSE stream and stamps times with
`time.perf_counter()`. Owns the record's fields; never computes aggregates (`metrics.py` does)
and never decides when to send (`load.py` does).

Parsing is kept cheap so the client is not the bottleneck on a small machine: the stream is read
as raw socket chunks, `data:` lines are found with `bytes.find`, and a chunk whose `"text"` (or
chat `"content"`) value is a non-empty string is recognised without decoding it. Only the other
chunks (the first ones, the final usage chunk, errors) go through orjson.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from shmdisagg.bench import BenchError

COMPLETIONS_PATH = "/v1/completions"
_REQUEST_ID_HEADERS = ("x-disagg-request-id", "x-request-id")
_ERROR_TEXT_LIMIT = 300


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times are `time.perf_counter()` seconds.

    `chunk_times` holds the arrival of every chunk carrying non-empty text (the first is the
    first token); `error_kind` is None exactly when the request completed.
    """

    index: int
    input_length: int  # prompt tokens sent
    max_tokens: int
    # prompt tokens an earlier request of this run shares (`trace.RunPrefixes`): more cached
    # tokens than this means the cache held the prompt from before the run
    reusable_tokens: int = 0
    # timing
    scheduled: float | None = None  # open loop: when it was due; None in closed loop
    send: float = 0.0
    first_token: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    # from the server
    status: int | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    request_id: str | None = None
    usage_missing: bool = False  # no usage chunk: output_tokens was counted from chunks
    error_kind: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None


def completion_body(model: str, prompt: list[int], max_tokens: int) -> bytes:
    """A streaming `/v1/completions` request for a token-id prompt, generating exactly `max_tokens`."""
    return orjson.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


def _value_head(payload: bytes, key: bytes) -> bytes:
    """The first two bytes of the JSON value of `key` (given with its quotes), or b"" when the
    key is absent. An occurrence not followed by ':' is a string value, not the key: skipped."""
    i = payload.find(key)
    while i >= 0:
        after = i + len(key)
        rest = payload[after : after + 16].lstrip(b" \t")
        if rest[:1] == b":":
            return rest[1:].lstrip(b" \t")[:2]
        i = payload.find(key, after)
    return b""


def has_text(payload: bytes) -> bool:
    """Whether a chunk's `text` (completions) or `content` (chat delta) is a non-empty string.

    An escaped quote inside a string can never produce the unescaped `"text":` pattern, so a
    match is always a real key.
    """
    for key in (b'"text"', b'"content"'):
        head = _value_head(payload, key)
        if head:
            return head[:1] == b'"' and head[1:2] != b'"'
    return False


def _has_usage(payload: bytes) -> bool:
    return _value_head(payload, b'"usage"')[:1] == b"{"


class _Stream:
    """Per-request SSE parse state, fed raw socket chunks."""

    __slots__ = ("done", "rec", "tail", "usage")

    def __init__(self, rec: RequestRecord) -> None:
        self.rec = rec
        self.tail = b""
        self.done = False
        self.usage: dict[str, Any] | None = None

    def feed(self, data: bytes, now: float) -> None:
        buf = self.tail + data if self.tail else data
        pos = 0
        while True:
            nl = buf.find(b"\n", pos)
            if nl < 0:
                break
            if buf.startswith(b"data:", pos):
                self._event(buf[pos + 5 : nl].strip(), now)
            pos = nl + 1
        self.tail = buf[pos:]

    def _event(self, payload: bytes, now: float) -> None:
        rec = self.rec
        if rec.first_token is not None and has_text(payload):
            rec.chunk_times.append(now)
            if _has_usage(payload):  # servers streaming usage on every chunk
                self.usage = orjson.loads(payload).get("usage")
            return
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self._fail("bad_sse", payload[:_ERROR_TEXT_LIMIT].decode(errors="replace"))
            return
        if not isinstance(obj, dict):
            return
        if obj.get("object") == "error" or obj.get("error"):
            nested = obj.get("error")
            err: dict[str, Any] = nested if isinstance(nested, dict) else obj
            self._fail("stream_error", str(err.get("message", err))[:_ERROR_TEXT_LIMIT])
            return
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or ():
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content")
            if text:
                if rec.first_token is None:
                    rec.first_token = now
                rec.chunk_times.append(now)
                break

    def _fail(self, kind: str, message: str) -> None:
        if self.rec.error_kind is None:
            self.rec.error_kind, self.rec.error = kind, message

    def finish(self) -> None:
        rec = self.rec
        usage = self.usage
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.output_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            rec.cached_tokens = details.get("cached_tokens")
        if rec.error_kind is not None:
            return
        if not self.done:
            self._fail("incomplete_stream", "stream ended without data: [DONE]")
        elif rec.first_token is None and rec.max_tokens > 0:
            self._fail("empty_response", "no chunk carried text")
        elif rec.output_tokens is None:
            # No usage chunk: fall back to counting text chunks, and say so.
            rec.output_tokens = len(rec.chunk_times)
            rec.usage_missing = True


class Client:
    """Sends prepared bodies to one server over a shared aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession, url: str, timeout_s: float) -> None:
        self.session = session
        self.endpoint = url.rstrip("/") + COMPLETIONS_PATH
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def send(self, rec: RequestRecord, body: bytes) -> RequestRecord:
        """POST `body`, stream the answer into `rec`, and return it. Never raises for a failed
        request: the failure is recorded (`error_kind`, `error`)."""
        stream = _Stream(rec)
        clock = time.perf_counter
        rec.send = clock()
        try:
            async with self.session.post(
                self.endpoint,
                data=body,
                headers={"Content-Type": "application/json"},
                timeout=self.timeout,
            ) as resp:
                rec.status = resp.status
                for name in _REQUEST_ID_HEADERS:
                    if name in resp.headers:
                        rec.request_id = resp.headers[name]
                        break
                if resp.status != 200:
                    text = await resp.text(errors="replace")
                    rec.end = clock()
                    stream._fail(f"http_{resp.status}", text[:_ERROR_TEXT_LIMIT])
                    return rec
                async for data in resp.content.iter_any():
                    stream.feed(data, clock())
                rec.end = clock()
        except TimeoutError:
            stream._fail("timeout", f"no complete answer within {self.timeout.total} s")
        except aiohttp.ClientPayloadError as exc:
            stream._fail("payload_error", str(exc)[:_ERROR_TEXT_LIMIT])
        except aiohttp.ClientConnectionError as exc:
            stream._fail("connection_error", str(exc)[:_ERROR_TEXT_LIMIT])
        except aiohttp.ClientError as exc:
            stream._fail(type(exc).__name__, str(exc)[:_ERROR_TEXT_LIMIT])
        if rec.end is None:
            rec.end = clock()
        stream.finish()
        return rec


async def fetch_json(session: aiohttp.ClientSession, url: str, timeout_s: float = 10.0) -> Any:
    """GET `url` and decode JSON; None on 404. Other failures raise `aiohttp.ClientError`."""
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status == 404:
            return None
        resp.raise_for_status()
        return orjson.loads(await resp.read())


async def first_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model id served at `url` (`GET /v1/models`)."""
    try:
        listing = await fetch_json(session, url.rstrip("/") + "/v1/models")
        if listing is None:  # 404: a server that has no such route at this base
            raise BenchError(
                f"GET {url}/v1/models: 404 Not Found; give --url as the server's base (http://host:port), "
                "without a route such as /v1/completions"
            )
        return str(listing["data"][0]["id"])
    except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        raise BenchError(f"cannot list models at {url}/v1/models ({exc}); is the server up?") from None
    except (TypeError, KeyError, IndexError):
        raise BenchError(f"GET {url}/v1/models listed no model; pass --model") from None


async def cluster_pids(session: aiohttp.ClientSession, url: str) -> list[int] | None:
    """Orchestrator pids from `GET /cluster_info` (`coordinator_pid`, `fleet_pids`), or None
    when the server has no such endpoint or it cannot be read."""
    try:
        info = await fetch_json(session, url.rstrip("/") + "/cluster_info")
    except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError):
        return None
    if not isinstance(info, dict):
        return None
    pids: list[int] = []
    if isinstance(info.get("coordinator_pid"), int):
        pids.append(info["coordinator_pid"])
    pids.extend(p for p in info.get("fleet_pids") or () if isinstance(p, int))
    return sorted(set(pids)) or None
