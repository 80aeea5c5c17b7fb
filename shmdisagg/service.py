"""Request flows: one public request becomes a context leg and a generation leg.

Context-first, exactly as TensorRT-LLM's `OpenAIDisaggregatedService` (shared/reference/
trtllm_protocol.md §2.4): the context leg is sent non-streaming with
`disaggregated_params = {request_type: "context_only", disagg_request_id}`; if its
`finish_reason` is `length` or `not_finished`, the generation leg is sent with the context
choice's `disaggregated_params` (now `generation_only`, same `disagg_request_id`, the context
usage as `ctx_usage`) and the prompt token ids the context executor returned; any other
`finish_reason` makes the context answer final. Generation streams are relayed chunk by chunk.

Every pick adds load in this worker's row; the `finally` beside it releases it exactly once,
whatever ends the leg (success, executor error, timeout, client disconnect). This module never
opens a listening socket; `fleet/app.py` calls `DisaggService.handle`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson

from shmdisagg.asgi import (
    JSON_HEADERS,
    SSE_HEADERS,
    ClientDisconnected,
    DisconnectWatch,
    Receive,
    Send,
    read_body,
    send_bytes,
)
from shmdisagg.config import DisaggConfig
from shmdisagg.directory import ServerDirectory
from shmdisagg.errors import RequestError, error_body, sse_error_event
from shmdisagg.ids import DisaggIdGenerator
from shmdisagg.routing import Policy, RoutingKey
from shmdisagg.upstream import UpstreamConnectError, UpstreamError, UpstreamPool, UpstreamResponse
from shmdisagg.validation import parse_body, prompt_load_tokens, validate

log = logging.getLogger("shmdisagg.service")

CONTINUE_ON_GENERATION = ("length", "not_finished")
SCHEDULE_STYLE = {"context_first": 0, "generation_first": 1}  # TensorRT-LLM DisaggScheduleStyle
_PATHS = {False: "/v1/completions", True: "/v1/chat/completions"}


@dataclass(slots=True)
class Exchange:
    """Per-request state a flow shares with the error handling around it."""

    send: Send
    disagg_request_id: int
    stream: bool
    started: bool = False  # response headers sent: errors must go in-band from now on

    @property
    def id_header(self) -> tuple[bytes, bytes]:
        return (b"x-disagg-request-id", str(self.disagg_request_id).encode())

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        await self.send({"type": "http.response.start", "status": status, "headers": headers + [self.id_header]})

    async def body(self, chunk: bytes, more: bool) -> None:
        await self.send({"type": "http.response.body", "body": chunk, "more_body": more})

    async def fail(self, status: int, message: str, code: str) -> None:
        """End the response with an error: a JSON error before any byte, an SSE error event after."""
        if not self.started:
            await self.start(status, JSON_HEADERS)
            await self.body(error_body(status, message, code), False)
        elif self.stream:
            await self.body(sse_error_event(status, message, code), False)
        else:
            await self.body(b"", False)


class DisaggService:
    """The two hot routes of one fleet worker.

    State: `directory` maps table slots to executor addresses; `ctx_policy`/`gen_policy` pick
    servers from the shared table; `upstream` holds keep-alive connections to executors;
    `ids` mints fleet-unique `disagg_request_id`s; `models` are the model names executors serve.
    """

    def __init__(
        self,
        config: DisaggConfig,
        directory: ServerDirectory,
        ctx_policy: Policy,
        gen_policy: Policy,
        upstream: UpstreamPool,
        ids: DisaggIdGenerator,
    ) -> None:
        self.config = config
        self.directory = directory
        self.ctx_policy = ctx_policy
        self.gen_policy = gen_policy
        self.upstream = upstream
        self.ids = ids
        self.models: frozenset[str] = frozenset()
        self.timeout_s = config.shmdisagg.request_timeout_s
        self.body_limit = config.shmdisagg.max_request_body_bytes
        self.max_retries = config.max_retries
        self.schedule_style = SCHEDULE_STYLE[config.schedule_style]

    async def handle(self, receive: Receive, send: Send, chat: bool) -> None:
        """Serve one POST to `/v1/completions` (chat=False) or `/v1/chat/completions`."""
        try:
            req = parse_body(await read_body(receive, self.body_limit))
            validate(req, chat, self.models)
        except RequestError as err:
            await send_bytes(send, err.status, err.body())
            return
        except ClientDisconnected:
            return
        ex = Exchange(send, self.ids.next_id(), bool(req.get("stream")))
        watch = DisconnectWatch(receive)
        try:
            with watch:
                async with asyncio.timeout(self.timeout_s):
                    await self._context_first(ex, req, chat)
        except asyncio.CancelledError:
            if not watch.disconnected:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]  # we cancelled ourselves
        except RequestError as err:
            await ex.fail(err.status, err.message, err.code)
        except TimeoutError:
            await ex.fail(504, f"request did not finish within {self.timeout_s:g} s", "timeout")
        except UpstreamError as err:
            await ex.fail(502, f"executor connection failed: {err}", "upstream_error")
        except Exception:  # never a traceback to the client
            log.exception("request %d failed", ex.disagg_request_id)
            await ex.fail(500, "internal error", "internal_error")

    # -- context-first --------------------------------------------------------------------

    async def _context_first(self, ex: Exchange, req: dict[str, Any], chat: bool) -> None:
        key = RoutingKey(prompt_load_tokens(req, chat))
        path = _PATHS[chat]
        ctx_req = dict(req)
        ctx_req["disaggregated_params"] = {
            "request_type": "context_only",
            "disagg_request_id": ex.disagg_request_id,
            "schedule_style": self.schedule_style,
        }
        ctx_req["stream"] = False
        ctx_req.pop("stream_options", None)
        status, raw = await self._call(self.ctx_policy, key, path, orjson.dumps(ctx_req), "context")
        if status != 200:
            await self._relay_error(ex, status, raw)
            return
        ctx = _parse_ctx_response(raw)
        params = ctx["choices"][0]["disaggregated_params"]
        if ctx["choices"][0].get("finish_reason") not in CONTINUE_ON_GENERATION:
            await self._answer_from_context(ex, req, chat, ctx)
            return
        if isinstance(params.get("disagg_request_id"), int):
            ex.disagg_request_id = params["disagg_request_id"]  # a context retry may re-mint it
        await self._generation(ex, _generation_request(req, chat, ctx, ex.disagg_request_id, self.schedule_style), key, path)

    async def _generation(self, ex: Exchange, gen_req: dict[str, Any], key: RoutingKey, path: str) -> None:
        body = orjson.dumps(gen_req)
        if not ex.stream:
            status, raw = await self._call(self.gen_policy, key, path, body, "generation")
            if status != 200:
                await self._relay_error(ex, status, raw)
                return
            await ex.start(200, JSON_HEADERS)
            await ex.body(raw, False)
            return
        slot, resp = await self._open(self.gen_policy, key, path, body, "generation")
        try:
            if resp.status != 200:
                await self._relay_error(ex, resp.status, await resp.read())
                return
            await ex.start(200, SSE_HEADERS)
            async for chunk in resp:
                await ex.body(chunk, True)
            await ex.body(b"", False)
        except UpstreamError as err:
            resp.abort()
            await ex.fail(502, f"generation executor failed mid-stream: {err}", "upstream_error")
        except BaseException:
            resp.abort()
            raise
        finally:
            self.gen_policy.release(slot, key)

    async def _answer_from_context(self, ex: Exchange, req: dict[str, Any], chat: bool, ctx: dict[str, Any]) -> None:
        """The context leg finished the request (EOS or a stop token in prefill)."""
        for choice in ctx["choices"]:
            choice.pop("disaggregated_params", None)
        ctx.pop("prompt_token_ids", None)
        ctx.pop("prompt_token_ids_b64", None)
        if not ex.stream:
            await ex.start(200, JSON_HEADERS)
            await ex.body(orjson.dumps(ctx), False)
            return
        include_usage = bool((req.get("stream_options") or {}).get("include_usage"))
        await ex.start(200, SSE_HEADERS)
        await ex.body(_as_sse(ctx, chat, include_usage), False)

    # -- executor calls ---------------------------------------------------------------------

    async def _open(self, policy: Policy, key: RoutingKey, path: str, body: bytes, role: str) -> tuple[int, UpstreamResponse]:
        """Pick a server and send `body`; returns (slot, response with headers read). The slot's
        load stays added: the caller releases it. Connection failures before anything was sent
        are retried on another server, up to `max_retries` times."""
        exclude = -1
        attempt = 0
        while True:
            slot = policy.pick(key, exclude)
            if slot < 0:
                raise RequestError(503, f"no healthy {role} server", f"no_{role}_servers")
            try:
                host, port = self.directory.address(slot)
                return slot, await self.upstream.request(host, port, "POST", path, body)
            except UpstreamConnectError:
                policy.release(slot, key)
                attempt += 1
                if attempt > self.max_retries:
                    raise
                exclude = slot
            except BaseException:
                policy.release(slot, key)
                raise

    async def _call(self, policy: Policy, key: RoutingKey, path: str, body: bytes, role: str) -> tuple[int, bytes]:
        """Non-streaming leg: (status, body bytes); the pick is released before returning."""
        slot, resp = await self._open(policy, key, path, body, role)
        try:
            return resp.status, await resp.read()
        except BaseException:
            resp.abort()
            raise
        finally:
            policy.release(slot, key)

    async def _relay_error(self, ex: Exchange, status: int, raw: bytes) -> None:
        """An executor's error answer, relayed with its status when it is a JSON error body."""
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            parsed = None
        if status < 600 and isinstance(parsed, dict):
            await ex.start(status, JSON_HEADERS)
            await ex.body(raw, False)
        else:
            await ex.fail(502, f"executor answered HTTP {status}", "upstream_error")


def _parse_ctx_response(raw: bytes) -> dict[str, Any]:
    """The context executor's JSON answer, checked as TensorRT-LLM's `_verify_ctx_response` does."""
    try:
        ctx = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise RequestError(502, "context executor returned invalid JSON", "upstream_error") from None
    choices = ctx.get("choices") if isinstance(ctx, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise RequestError(502, "context executor returned no choices", "upstream_error")
    for choice in choices:
        params = choice.get("disaggregated_params")
        if not isinstance(params, dict):
            raise RequestError(502, "context response is missing disaggregated_params", "upstream_error")
        if choice.get("finish_reason") in CONTINUE_ON_GENERATION and (
            params.get("ctx_request_id") is None or params.get("disagg_request_id") is None
        ):
            raise RequestError(502, "context response lacks ctx_request_id/disagg_request_id", "upstream_error")
    return ctx


def _generation_request(
    req: dict[str, Any], chat: bool, ctx: dict[str, Any], disagg_request_id: int, schedule_style: int
) -> dict[str, Any]:
    """The generation leg: the client's request with the context executor's handoff."""
    params = dict(ctx["choices"][0]["disaggregated_params"])
    params["request_type"] = "generation_only"
    params["disagg_request_id"] = disagg_request_id
    params["schedule_style"] = schedule_style
    if isinstance(ctx.get("usage"), dict):
        params["ctx_usage"] = ctx["usage"]
    gen = dict(req)
    gen["disaggregated_params"] = params
    if chat:
        if ctx.get("prompt_token_ids_b64"):
            gen["prompt_token_ids_b64"] = ctx["prompt_token_ids_b64"]
        elif ctx.get("prompt_token_ids"):
            gen["prompt_token_ids"] = ctx["prompt_token_ids"]
    elif ctx.get("prompt_token_ids"):
        gen["prompt"] = ctx["prompt_token_ids"]
    return gen


def _as_sse(resp: dict[str, Any], chat: bool, include_usage: bool) -> bytes:
    """A complete (non-streaming) answer as the SSE stream a streaming client expects."""
    created = resp.get("created") or int(time.time())
    base = {"id": resp.get("id"), "created": created, "model": resp.get("model")}
    out = []
    for choice in resp["choices"]:
        if chat:
            msg = choice.get("message") or {}
            delta = {"role": "assistant", "content": msg.get("content", "")}
            c = {"index": choice.get("index", 0), "delta": delta, "finish_reason": choice.get("finish_reason")}
            out.append({**base, "object": "chat.completion.chunk", "choices": [c]})
        else:
            c = {"index": choice.get("index", 0), "text": choice.get("text", ""), "finish_reason": choice.get("finish_reason")}
            out.append({**base, "object": "text_completion", "choices": [c]})
    if include_usage and resp.get("usage"):
        obj = "chat.completion.chunk" if chat else "text_completion"
        out.append({**base, "object": obj, "choices": [], "usage": resp["usage"]})
    return b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in out) + b"data: [DONE]\n\n"
