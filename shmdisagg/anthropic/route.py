"""`POST /v1/messages` and `POST /v1/messages/count_tokens` as plain ASGI.

`/v1/messages` (TensorRT-LLM's `anthropic_messages` / `_serve_anthropic_messages`,
`tensorrt_llm/serve/openai_disagg_server.py`, file id 70144234291): the body is validated
(`protocol.py`) and converted (`convert.py`), then run through `DisaggService.handle` as a
`/v1/chat/completions` request: a `receive` that yields the converted body (and then the client's
own messages, so a disconnect still cancels the legs), and a `send` that translates the answer on
its way out. So routing, both schedule styles, internal-field removal, the executor contract,
admission, the deadline and shutdown all apply unchanged. What the client gets:

- a JSON answer (non-streaming): buffered and converted to an Anthropic message; an answer that
  has no Anthropic form (a tool call whose arguments are not a JSON object) is a 500
  `Internal server error`, as upstream;
- an SSE answer: reframed chunk by chunk (`stream.py`); the chat route's error event becomes an
  Anthropic `error` event;
- an error before any byte (ours or an executor's, relayed by the chat route in the
  `ErrorResponse` shape): the same status, its message in Anthropic's envelope
  (`protocol.error_envelope`), other headers (`retry-after`, `x-disagg-request-id`) kept;
- a request this adapter refuses: 400 in the envelope, before anything is routed.

`/v1/messages/count_tokens` (upstream's `anthropic_count_tokens`): validated as
`CountTokensRequest`, then forwarded as it came to a context executor's
`/v1/messages/count_tokens` (whose tokenizer and chat template count it, through the same
conversion as a real request), and its answer relayed. The executor is a healthy context server,
round-robin per fleet worker, without routing load: a count generates nothing, so it must not
move what routers see. Retries, the leg timeout and failure reports are `LegRunner.call`'s.
An executor's error is relayed with its status and its message unwrapped and redacted (no
executor address: `answers.executor_error_message`, upstream's `_upstream_error_message`); no
healthy context server is a 503, all in Anthropic's envelope.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, ClassVar

import orjson

from shmdisagg.anthropic.convert import AnthropicResponseError, anthropic_message, chat_request
from shmdisagg.anthropic.protocol import (
    AnthropicRequestError,
    CountTokensRequest,
    MessagesRequest,
    error_envelope,
    parse,
)
from shmdisagg.anthropic.stream import StreamReframer
from shmdisagg.orchestrator.answers import executor_error_message
from shmdisagg.orchestrator.asgi import (
    JSON_HEADERS,
    ClientDisconnected,
    Message,
    Receive,
    Scope,
    Send,
    read_body,
    send_bytes,
)
from shmdisagg.orchestrator.directory import ServerDirectory
from shmdisagg.orchestrator.errors import RequestError
from shmdisagg.orchestrator.service import BODY_HEADERS, DisaggService, refuse_unreadable_body
from shmdisagg.routing import RoutingKey
from shmdisagg.shm.table import ROLE_CONTEXT
from shmdisagg.upstream import UpstreamError

log = logging.getLogger("shmdisagg.anthropic")

COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
_SKIPPED_HEADERS = (b"content-type", b"content-length")


class AnthropicRoutes:
    """The two routes of one fleet worker, over its `DisaggService`."""

    def __init__(self, service: DisaggService, handle: Any = None) -> None:
        """`handle`: the chat handler messages run through (the service's, observed by
        `observe.Observability.wrap` when the fleet worker set that up)."""
        self.service = service
        self.handle = handle or service.handle
        self._counting = _AnyHealthyContext(service.flows.legs.directory)

    async def messages(self, scope: Scope, receive: Receive, send: Send, chat: bool = True) -> None:
        """Serve one `POST /v1/messages` (the signature of `DisaggService.handle`, so request
        metrics wrap it the same way)."""
        try:
            _check_json(scope)
            req = parse(MessagesRequest, await read_body(receive, self.service.body_limit))
            body = orjson.dumps(chat_request(req))
        except AnthropicRequestError as err:
            await _reject(send, 400, str(err))
            return
        except RequestError as err:
            await _reject(send, err.status, err.message)
            return
        except ClientDisconnected:
            return
        await self.handle(scope, _replay(body, receive), AnswerTranslator(send, req.model), True)

    async def count_tokens(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one `POST /v1/messages/count_tokens`."""
        try:
            _check_json(scope)
            body = await read_body(receive, self.service.body_limit)
            parse(CountTokensRequest, body)
            async with asyncio.timeout(self.service.timeout_s):
                status, raw, _ = await self.service.flows.legs.call(
                    self._counting,
                    RoutingKey(0),
                    COUNT_TOKENS_PATH,
                    lambda _: body,
                    "context",
                    retry_5xx=True,
                    retry_sent=True,
                    headers=JSON_HEADERS,
                )
        except AnthropicRequestError as err:
            await _reject(send, 400, str(err))
            return
        except RequestError as err:  # 413, 415, 503 no context server, 504 the leg's timeout
            await _reject(send, err.status, err.message)
            return
        except TimeoutError:
            await _reject(send, 504, f"request did not finish within {self.service.timeout_s:g} s")
            return
        except UpstreamError as err:  # names the executor: logged, not told
            log.warning("count_tokens: %s", err)
            await _reject(send, 502, f"executor connection failed ({type(err).__name__.removeprefix('Upstream')})")
            return
        except ClientDisconnected:
            return
        if status != 200:
            await _reject(send, status, executor_error_message(raw, status))
            return
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict) or type(answer.get("input_tokens")) is not int:
            await _reject(send, 502, "the context executor returned an invalid count_tokens answer")
            return
        await send_bytes(send, 200, raw)


class AnswerTranslator:
    """The `send` that the chat route answers through: a JSON answer is buffered and converted,
    an SSE answer reframed as it comes (see the module docstring)."""

    __slots__ = ("send", "model", "status", "headers", "parts", "reframer")

    def __init__(self, send: Send, model: str) -> None:
        self.send = send
        self.model = model
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.parts: list[bytes] = []
        self.reframer: StreamReframer | None = None

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
            if self.status == 200 and _content_type(self.headers).startswith(b"text/event-stream"):
                self.reframer = StreamReframer(self.model)
                await self.send(message)
            return
        if message["type"] != "http.response.body":
            await self.send(message)
            return
        more = bool(message.get("more_body", False))
        chunk = message.get("body", b"")
        if self.reframer is not None:
            out = self.reframer.feed(chunk)
            if not more:
                out += self.reframer.end()
            if out or not more:
                await self.send({"type": "http.response.body", "body": out, "more_body": more})
            return
        self.parts.append(chunk)
        if not more:
            status, body = self._translated(b"".join(self.parts))
            headers = [h for h in self.headers if h[0].lower() not in _SKIPPED_HEADERS] + JSON_HEADERS
            await self.send({"type": "http.response.start", "status": status, "headers": headers})
            await self.send({"type": "http.response.body", "body": body})

    def _translated(self, raw: bytes) -> tuple[int, bytes]:
        try:
            payload: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            payload = None
        if self.status != 200:
            message = (payload.get("message") or payload.get("detail")) if isinstance(payload, dict) else None
            return self.status, error_envelope(self.status, str(message or "Internal server error"))
        try:
            return 200, orjson.dumps(anthropic_message(payload))
        except AnthropicResponseError as err:
            log.error("chat answer without an Anthropic form: %s", err)
            return 500, error_envelope(500, "Internal server error")


class _AnyHealthyContext:
    """A `Policy` for `LegRunner` that picks a healthy context server round-robin and adds no
    load (a token count is not routed work)."""

    name: ClassVar[str] = "count_tokens"
    needs_tokens: ClassVar[bool] = False

    def __init__(self, directory: ServerDirectory) -> None:
        self.directory = directory
        self._turn = 0

    def pick(self, key: RoutingKey, exclude_slot: int) -> int:
        slots = [
            s.slot for s in self.directory.servers() if s.role == ROLE_CONTEXT and s.healthy and s.slot != exclude_slot
        ]
        if not slots:
            return -1
        self._turn += 1
        return slots[self._turn % len(slots)]

    def release(self, slot: int, key: RoutingKey) -> None:
        pass


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` whose first message is `body`, then the client's own (its disconnect)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _reject(send: Send, status: int, message: str) -> None:
    await send_bytes(send, status, error_envelope(status, message))


def _content_type(headers: list[tuple[bytes, bytes]]) -> bytes:
    for name, value in headers:
        if name.lower() == b"content-type":
            return value.lower()
    return b""


def _check_json(scope: Scope) -> None:
    """A body declared as anything but JSON, or compressed, is a 415, as on the chat route (no
    content type is read as JSON, as FastAPI does)."""
    for name, value in scope.get("headers", ()):
        if name in BODY_HEADERS:
            refuse_unreadable_body(name, value)
