"""route.py: `/v1/messages` runs the converted request through the chat route's `handle` and
translates whatever it answers; count_tokens picks a healthy context server without load."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import orjson

from shmdisagg.anthropic.route import AnthropicRoutes, _AnyHealthyContext
from shmdisagg.orchestrator.asgi import JSON_HEADERS, SSE_HEADERS, Message
from shmdisagg.orchestrator.errors import error_body, sse_error_event
from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION, ServerInfo

Handle = Callable[[Any, Any, Any, bool], Coroutine[Any, Any, None]]
REQUEST = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


class ChatRoute:
    """Stands in for `DisaggService` at its ASGI boundary: records what `handle` was given and
    answers with `answer(send)`."""

    body_limit = 1 << 20
    timeout_s = 5.0

    def __init__(self, answer: Callable[[Any], Coroutine[Any, Any, None]]) -> None:
        self.answer = answer
        self.received: list[Message] = []
        self.calls = 0
        self.flows = type("Flows", (), {"legs": type("Legs", (), {"directory": None})()})()

    async def handle(self, scope: Any, receive: Any, send: Any, chat: bool) -> None:
        assert chat is True
        self.calls += 1
        self.received.append(await receive())
        self.received.append(await receive())  # what a DisconnectWatch would wait for
        await self.answer(send)


def serve(
    route: ChatRoute, body: bytes, content_type: bytes = b"application/json"
) -> tuple[int, dict[bytes, bytes], bytes]:
    sent: list[Message] = []
    incoming = [{"type": "http.request", "body": body, "more_body": False}, {"type": "http.disconnect"}]

    async def receive() -> Message:
        return incoming.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/messages", "headers": [(b"content-type", content_type)]}
    asyncio.run(AnthropicRoutes(route).messages(scope, receive, send))  # type: ignore[arg-type]
    start = sent[0]
    assert start["type"] == "http.response.start"
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def replying(
    status: int, body: bytes, headers: list[tuple[bytes, bytes]] = JSON_HEADERS
) -> Callable[[Any], Coroutine[Any, Any, None]]:
    async def answer(send: Any) -> None:
        await send(
            {"type": "http.response.start", "status": status, "headers": headers + [(b"x-disagg-request-id", b"77")]}
        )
        await send({"type": "http.response.body", "body": body})

    return answer


def test_the_converted_request_goes_to_the_chat_route_and_its_answer_comes_back_as_a_message() -> None:
    chat_answer = {
        "id": "c",
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1},
    }
    route = ChatRoute(replying(200, orjson.dumps(chat_answer)))
    status, headers, body = serve(route, orjson.dumps({**REQUEST, "system": "be brief"}))
    sent = orjson.loads(route.received[0]["body"])
    assert (
        sent["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        and sent["max_completion_tokens"] == 16
    )
    assert route.received[1] == {"type": "http.disconnect"}  # the client's own messages follow the body
    msg = orjson.loads(body)
    assert (
        status == 200 and headers[b"content-type"] == b"application/json" and headers[b"x-disagg-request-id"] == b"77"
    )
    assert (
        msg["content"] == [{"type": "text", "text": "hello"}]
        and msg["stop_reason"] == "end_turn"
        and msg["usage"] == {"input_tokens": 4, "output_tokens": 1}
    )


def test_an_error_of_the_chat_route_keeps_its_status_and_headers_in_anthropics_envelope() -> None:
    route = ChatRoute(
        replying(
            429,
            error_body(429, "the deployment is at its in-flight request limit"),
            JSON_HEADERS + [(b"retry-after", b"1")],
        )
    )
    status, headers, body = serve(route, orjson.dumps(REQUEST))
    assert status == 429 and headers[b"retry-after"] == b"1"
    assert orjson.loads(body) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "the deployment is at its in-flight request limit"},
    }
    route = ChatRoute(replying(503, error_body(503, "no healthy generation server")))
    assert orjson.loads(serve(route, orjson.dumps(REQUEST))[2])["error"] == {
        "type": "api_error",
        "message": "no healthy generation server",
    }


def test_a_stream_is_reframed_chunk_by_chunk() -> None:
    async def answer(send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        for piece in (
            b'data: {"model":"m","choices":[{"index":0,"delta":{"content":"he',
            b'"}}]}\n\n',
            b'data: {"choices":[{"index":0,"delta":{"content":"y"}}]}\n\n',
        ):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send(
            {
                "type": "http.response.body",
                "body": sse_error_event(502, "generation executor failed mid-stream"),
                "more_body": False,
            }
        )

    status, headers, body = serve(ChatRoute(answer), orjson.dumps({**REQUEST, "stream": True}))
    assert status == 200 and headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    names = [line[7:] for line in body.split(b"\n") if line.startswith(b"event: ")]
    assert names == [
        b"message_start",
        b"content_block_start",
        b"content_block_delta",
        b"content_block_delta",
        b"content_block_stop",
        b"error",
    ]
    assert b'"message":"generation executor failed mid-stream"' in body


def test_a_request_the_adapter_refuses_is_never_routed() -> None:
    route = ChatRoute(replying(200, b"{}"))
    status, _, body = serve(
        route, orjson.dumps({**REQUEST, "tool_choice": {"type": "any"}, "tools": [{"name": "f", "input_schema": {}}]})
    )
    assert (
        status == 400
        and orjson.loads(body)["error"]["type"] == "invalid_request_error"
        and "'any' is not supported" in orjson.loads(body)["error"]["message"]
    )
    status, _, body = serve(route, orjson.dumps(REQUEST), content_type=b"text/plain")
    assert status == 415 and "application/json" in orjson.loads(body)["error"]["message"]
    assert route.calls == 0


def test_an_answer_without_an_anthropic_form_is_an_internal_error() -> None:
    call = {"id": "c", "function": {"name": "f", "arguments": "[1]"}}
    chat_answer = {
        "model": "m",
        "choices": [{"index": 0, "message": {"tool_calls": [call]}, "finish_reason": "tool_calls"}],
    }
    status, _, body = serve(ChatRoute(replying(200, orjson.dumps(chat_answer))), orjson.dumps(REQUEST))
    assert status == 500 and orjson.loads(body) == {
        "type": "error",
        "error": {"type": "api_error", "message": "Internal server error"},
    }


class Directory:
    def __init__(self, servers: list[ServerInfo]) -> None:
        self._servers = servers

    def servers(self) -> list[ServerInfo]:
        return self._servers


def _server(slot: int, role: int, healthy: bool = True) -> ServerInfo:
    return ServerInfo(slot, f"127.0.0.1:{9000 + slot}", role, True, healthy, 1, 8, 32, 4096)


def test_token_counts_go_round_robin_to_healthy_context_servers_without_load() -> None:
    pick = _AnyHealthyContext(
        Directory(
            [
                _server(0, ROLE_CONTEXT),
                _server(1, ROLE_GENERATION),
                _server(2, ROLE_CONTEXT, healthy=False),
                _server(3, ROLE_CONTEXT),
            ]
        )
    )  # type: ignore[arg-type]
    assert {pick.pick(None, -1) for _ in range(4)} == {0, 3}  # type: ignore[arg-type]
    assert pick.pick(None, 0) == 3  # type: ignore[arg-type]  # a retry goes elsewhere
    assert _AnyHealthyContext(Directory([_server(1, ROLE_GENERATION)])).pick(None, -1) == -1  # type: ignore[arg-type]
