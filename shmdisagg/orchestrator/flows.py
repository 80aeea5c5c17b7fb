"""The two schedule styles of TensorRT-LLM's disaggregated service, over `LegRunner`.

Context-first (`tensorrt_llm/serve/openai_disagg_service.py`, `_send_disagg_request_ctx_first`):
the context leg runs non-streaming with
`disaggregated_params = {request_type: "context_only", disagg_request_id}`; if its
`finish_reason` is `length` or `not_finished`, the generation leg gets the context choice's
`disaggregated_params` (now `generation_only`, same id, `ctx_usage`) and the prompt token ids
the context executor returned; any other `finish_reason` makes the context answer final.

Generation-first (`_send_disagg_request_gen_first`): both legs are dispatched at once. The generation request is built
without the context response: `generation_only` with `ctx_request_id = disagg_request_id` and
the context server's advertised `/server_info.disaggregated_params` merged in
(`ctx_info_endpoint` collapsed to its first element, `encoded_opaque_state` copied). The
generation POST is started *before* the context leg is awaited, because the context executor
waits for the generation executor's receive session (awaiting the context first deadlocks).
When either leg fails, the other is cancelled.

Conditional disaggregation (`_check_conditional_disagg`, `conditional_disagg_config.max_local_prefill_length` > 0,
with a `kv_cache_aware` generation router): the generation server is picked first; if it already
holds all but at most that many prompt tokens, the request goes to it alone as a plain request
(prefill and decode there, no `disaggregated_params`); otherwise both legs run, with the
generation leg on the server picked first. The decision uses the chosen server's own match.

Streams are relayed chunk by chunk as bytes, at SSE event boundaries. What reaches the client
never carries the handoff (`answers.py`: `public_answer`, `StreamGuard`), and an executor answer
that breaks the request's contract becomes a 502 or an SSE error event. Each leg's pick is
released exactly once.

TensorRT-LLM's options of the flow (`FlowOptions`, read from the config and the environment as
`tensorrt_llm/serve/openai_disagg_service.py` reads them): `gen_tokids_ctxbytes` (the context
leg asks for `prompt_token_ids_b64`, relayed to the generation leg as it is),
`gen_strip_message_history` (a chat's generation leg carries only its last message; the ids
carry the prompt), `TRTLLM_DISAGG_BENCHMARK_GEN_ONLY=1` (no context leg: the generation leg gets
upstream's fixed stub handoff and `ignore_eos`, for generation-only benchmarks).

KV poll hints: an executor emits its KV events at known moments of a request (the simulator and
TensorRT-LLM alike): evictions (`removed`) when a request's blocks are allocated, the prompt's
blocks (`stored`) when its KV is complete, which on a context server is just before its
response and on a generation server just before its first token, and the output's blocks when
the request finishes. So the coordinator is hinted to drain a server when a context leg's
response has been read (`LegRunner.call`), when a generation leg's first chunk arrives, and when
its answer is complete (`relay`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from shmdisagg.orchestrator import splice
from shmdisagg.orchestrator.answers import (
    ContractError,
    StreamGuard,
    check_context_answer,
    check_final_answer,
    executor_error_message,
    max_tokens_of,
    public_answer,
)
from shmdisagg.orchestrator.asgi import JSON_HEADERS, SSE_HEADERS
from shmdisagg.orchestrator.directory import ServerDirectory
from shmdisagg.orchestrator.errors import RequestError
from shmdisagg.orchestrator.exchange import Exchange
from shmdisagg.orchestrator.legs import LegRunner, Opened, leg_timeout_error
from shmdisagg.orchestrator.splice import Raw
from shmdisagg.orchestrator.wire import Wire
from shmdisagg.routing import Policy, RoutingKey
from shmdisagg.upstream import Body, UpstreamError, UpstreamResponse, UpstreamTimeout

log = logging.getLogger("shmdisagg.service")

CONTINUE_ON_GENERATION = ("length", "not_finished")
SCHEDULE_STYLE = {"context_first": 0, "generation_first": 1}  # TensorRT-LLM DisaggScheduleStyle
# TRTLLM_DISAGG_BENCHMARK_GEN_ONLY's stub handoff (`_check_gen_only_disagg`, openai_disagg_service.py)
GEN_ONLY_PARAMS = {
    "request_type": "generation_only",
    "first_gen_tokens": [7],
    "ctx_request_id": 1,
    "encoded_opaque_state": None,
    "draft_tokens": None,
}


@dataclass(frozen=True, slots=True)
class FlowOptions:
    """TensorRT-LLM's switches of the request flow (see the module docstring)."""

    gen_tokids_ctxbytes: bool = False
    gen_strip_message_history: bool = False
    benchmark_gen_only: bool = False


class Reserved:
    """A generation pick made before the flow needs it; whoever `take()`s it owns its release."""

    __slots__ = ("policy", "key", "slot")

    def __init__(self, policy: Policy, key: RoutingKey, slot: int) -> None:
        self.policy, self.key, self.slot = policy, key, slot

    def take(self) -> int:
        slot, self.slot = self.slot, -1
        return slot

    def release_unused(self) -> None:
        if self.slot >= 0:
            self.policy.release(self.take(), self.key)


class Flows:
    """Both schedule styles for one worker. `ctx_server_info(slot)` returns the context server's
    `/server_info` (as published by the coordinator). Counters: `local_prefills` (requests
    conditional disaggregation kept on one generation server), `disaggregated`."""

    def __init__(
        self,
        legs: LegRunner,
        ctx_policy: Policy,
        gen_policy: Policy,
        new_id: Callable[[], int],
        ctx_server_info: Callable[[int], dict[str, Any]],
        schedule_style: str = "context_first",
        max_local_prefill_length: int = 0,
        options: FlowOptions = FlowOptions(),
        wire: Wire | None = None,
    ) -> None:
        self.legs = legs
        self.options = options
        self.wire = wire or Wire()
        self.ctx_policy = ctx_policy
        self.gen_policy = gen_policy
        self.new_id = new_id
        self.ctx_server_info = ctx_server_info
        self._style = self.generation_first if schedule_style == "generation_first" else self.context_first
        tpb = getattr(gen_policy, "tokens_per_block", None)
        self.max_local_prefill = max_local_prefill_length if tpb is not None else 0
        self._gen_tpb: Callable[[], int] | None = tpb  # KvCacheAwarePolicy.tokens_per_block
        self.local_prefills = 0
        self.disaggregated = 0

    async def run(self, ex: Exchange, req: dict[str, Any], chat: bool, key: RoutingKey, path: str) -> None:
        """One request, with conditional disaggregation when configured."""
        reserved = Reserved(self.gen_policy, key, -1)
        try:
            if self.options.benchmark_gen_only:
                await self.generation_only(ex, req, key, path, reserved)
                return
            if self.max_local_prefill and self._gen_tpb is not None:  # (max_local_prefill is 0 without it)
                reserved.slot = self.gen_policy.pick(key, -1)
                if reserved.slot < 0:
                    raise RequestError(503, "no healthy generation server", "no_generation_servers")
                matched = key.matched_blocks * self._gen_tpb()
                total = len(key.token_ids or ())
                if matched and total - matched <= self.max_local_prefill:
                    self.local_prefills += 1  # the request as it came, prefill and decode there
                    await relay(ex, await self._open_generation(reserved, key, path, req), max_tokens_of(req))
                    return
            self.disaggregated += 1
            await self._style(ex, req, chat, key, path, reserved)
        finally:
            reserved.release_unused()

    async def _open_generation(self, reserved: Reserved, key: RoutingKey, path: str, gen_req: dict[str, Any]) -> Opened:
        # take() runs when this coroutine starts: a task cancelled before that leaves the
        # reservation to release_unused().
        body, headers = self.wire.encode(gen_req)
        return await self.legs.open(
            self.gen_policy,
            key,
            path,
            lambda _: body,
            "generation",
            picked=reserved.take(),
            headers=headers,
            whole=not gen_req.get("stream"),  # a non-streaming answer is relayed whole
        )

    async def generation_only(
        self, ex: Exchange, req: dict[str, Any], key: RoutingKey, path: str, reserved: Reserved
    ) -> None:
        """`TRTLLM_DISAGG_BENCHMARK_GEN_ONLY=1`: the generation leg alone, with upstream's stub
        handoff (`first_gen_tokens [7]`, `ctx_request_id 1`) and `ignore_eos`."""
        gen_req = dict(req)
        gen_req["disaggregated_params"] = dict(GEN_ONLY_PARAMS)
        gen_req["ignore_eos"] = True
        await relay(ex, await self._open_generation(reserved, key, path, gen_req), max_tokens_of(req))

    # -- context-first ---------------------------------------------------------------------

    async def context_first(
        self, ex: Exchange, req: dict[str, Any], chat: bool, key: RoutingKey, path: str, reserved: Reserved
    ) -> None:
        style = SCHEDULE_STYLE["context_first"]
        ex.ctx_dispatch = time.time()
        status, raw, ex.ctx_slot = await self.legs.call(
            self.ctx_policy,
            key,
            path,
            self._ctx_body(ex, req, style),
            "context",
            retry_5xx=True,
            retry_sent=True,
            headers=self.wire.headers(req),
        )
        if status != 200:
            await relay_error(ex, status, raw)
            return
        ex.ctx_done = time.time()
        raw, ids = splice.cut(raw, b"prompt_token_ids")  # relayed as bytes (splice.py)
        ctx = parse_ctx_response(raw, ex.ctx_slot, self.legs.directory)
        note_usage(ex, ctx)
        if ctx["choices"][0].get("finish_reason") not in CONTINUE_ON_GENERATION:
            await answer_from_context(ex, req, chat, ctx)
            return
        params = ctx["choices"][0]["disaggregated_params"]
        if isinstance(params.get("disagg_request_id"), int):
            ex.disagg_request_id = params["disagg_request_id"]
        gen_req = generation_request(
            req, chat, ctx, ex.disagg_request_id, style, self.options.gen_strip_message_history, ids
        )
        await relay(ex, await self._open_generation(reserved, key, path, gen_req), max_tokens_of(req))

    def _ctx_body(self, ex: Exchange, req: dict[str, Any], style: int) -> Callable[[int], Body]:
        def make(attempt: int) -> Body:
            if attempt:  # never reuse an id a failed attempt may have registered on an executor
                ex.disagg_request_id = self.new_id()
            ctx_req = dict(req)
            params: dict[str, Any] = {
                "request_type": "context_only",
                "disagg_request_id": ex.disagg_request_id,
                "schedule_style": style,
            }
            if self.options.gen_tokids_ctxbytes:
                params["return_prompt_token_ids_b64"] = True
            ctx_req["disaggregated_params"] = params
            ctx_req["stream"] = False
            ctx_req.pop("stream_options", None)
            return self.wire.body(ctx_req)

        return make

    # -- generation-first ------------------------------------------------------------------

    async def generation_first(
        self, ex: Exchange, req: dict[str, Any], chat: bool, key: RoutingKey, path: str, reserved: Reserved
    ) -> None:
        style = SCHEDULE_STYLE["generation_first"]
        rid = ex.disagg_request_id
        ctx_slot = self.ctx_policy.pick(key, -1)
        if ctx_slot < 0:
            raise RequestError(503, "no healthy context server", "no_context_servers")
        try:
            gen_req = dict(req)
            gen_req["disaggregated_params"] = gen_first_params(self.ctx_server_info(ctx_slot), rid, style)
            ctx_body = self._ctx_body(ex, req, style)(0)
            ctx_headers = self.wire.headers(req)
        except BaseException:
            self.ctx_policy.release(ctx_slot, key)
            raise
        # The generation POST goes out first; the context leg is awaited only after it started.
        # The context leg is not retried elsewhere: the generation request names its server.
        gen_task = asyncio.ensure_future(self._open_generation(reserved, key, path, gen_req))
        started = False

        async def ctx_leg() -> tuple[int, bytes, int]:
            nonlocal started
            started = True  # from here the leg owns the pick of ctx_slot
            return await self.legs.call(
                self.ctx_policy,
                key,
                path,
                lambda _: ctx_body,
                "context",
                picked=ctx_slot,
                retries=0,
                headers=ctx_headers,
            )

        ex.ctx_dispatch = time.time()
        ex.ctx_slot = ctx_slot
        ctx_task = asyncio.ensure_future(ctx_leg())
        try:
            status, raw, _ = await ctx_task
            ex.ctx_done = time.time()
            if status != 200:
                await _cancel(gen_task)
                await relay_error(ex, status, raw)
                return
            raw, _ = splice.cut(raw, b"prompt_token_ids")  # read by nobody here: not decoded
            ctx = parse_ctx_response(raw, ex.ctx_slot, self.legs.directory)
            note_usage(ex, ctx)
            if ctx["choices"][0].get("finish_reason") not in CONTINUE_ON_GENERATION:
                await _cancel(gen_task)
                await answer_from_context(ex, req, chat, ctx)
                return
            opened = await gen_task
        except BaseException:
            await _cancel(gen_task)
            await _cancel(ctx_task)
            if not started:  # cancelled before its first step: the pick is still ours
                self.ctx_policy.release(ctx_slot, key)
            raise
        await relay(ex, opened, max_tokens_of(req))


def gen_first_params(server_info: dict[str, Any], rid: int, style: int) -> dict[str, Any]:
    """Generation-first `disaggregated_params`: ours, with the context server's advertised ones
    merged in (`ctx_info_endpoint` list collapsed to its first element)."""
    advertised = dict(server_info.get("disaggregated_params") or {})
    endpoint = advertised.get("ctx_info_endpoint")
    if isinstance(endpoint, list):
        advertised["ctx_info_endpoint"] = endpoint[0] if endpoint else None
    return {
        **advertised,
        "request_type": "generation_only",
        "ctx_request_id": rid,
        "disagg_request_id": rid,
        "schedule_style": style,
    }


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel a leg task and close what it opened (its pick is released by the leg itself)."""
    if not task.done():
        task.cancel()
    with contextlib.suppress(BaseException):
        result = await task
        if isinstance(result, Opened):
            result.close(abort=True)


def note_usage(ex: Exchange, ctx: dict[str, Any]) -> None:
    """Prompt and cached tokens of the request, from the context leg's usage."""
    usage = ctx.get("usage")
    if isinstance(usage, dict):
        ex.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            ex.cached_tokens = int(details.get("cached_tokens") or 0)


async def relay(ex: Exchange, opened: Opened, max_tokens: int | None) -> None:
    """Relay a generation response to the client, checked against the request's contract and
    with the handoff removed (`answers.py`). Its pick is released as soon as the executor's answer
    is complete, before the client is sent the end of it, so a client that sees the end also sees
    the load gone. The leg's `request_timeout` bounds the whole relay."""
    resp = opened.response
    ex.gen_slot = opened.slot
    try:
        if not ex.stream:  # opened whole (`_open_generation`)
            body = resp.body()
            if resp.status != 200:
                opened.close()
                await relay_error(ex, resp.status, body)
                return
            ex.first_token = ex.last_token = time.time()
            opened.hint_kv()
            opened.close()  # the executor's work is done: release before the client sees the end
            answer = _final_answer(body, max_tokens, "generation")
            await ex.start(200, JSON_HEADERS)
            await ex.body(answer, False)
        elif resp.status != 200:
            raw = await resp.read()
            opened.close()
            await relay_error(ex, resp.status, raw)
        elif not resp.is_event_stream:  # its body is no SSE: StreamGuard would pass it on unscrubbed
            ctype = (resp.header(b"content-type") or b"no content-type").decode("latin-1")
            raise ContractError(f"generation executor answered a stream with {ctype[:60]}, not text/event-stream")
        else:
            await _relay_stream(ex, opened, StreamGuard(max_tokens))
    except ContractError as err:
        opened.close(abort=True)
        log.warning("request %d: %s (generation server %s)", ex.disagg_request_id, err, opened.label)
        await ex.fail(502, str(err), "executor_contract")
    except UpstreamTimeout:  # the leg's -r/--request_timeout, on the executor connection's timer
        opened.close(abort=True)
        timeout = leg_timeout_error(opened.role, opened.timeout_s)
        await ex.fail(timeout.status, timeout.message, timeout.code)
    except UpstreamError as err:
        opened.close(abort=True)
        if not ex.started:
            raise
        log.warning("request %d: generation stream from %s failed: %s", ex.disagg_request_id, opened.label, err)
        await ex.fail(502, "generation executor failed mid-stream", "upstream_error")
    except BaseException:
        opened.close(abort=True)
        raise
    finally:
        opened.close()


async def _relay_stream(ex: Exchange, opened: Opened, guard: StreamGuard) -> None:
    resp = opened.response
    if ex.out.direct and type(resp) is UpstreamResponse:
        await ex.start(200, SSE_HEADERS)  # held: it leaves with the bytes buffered already, if any
        done = resp.pipe(_Pipe(ex, opened, guard, resp))
        ex.out.flush_head()
        await done
    else:
        await ex.start(200, SSE_HEADERS, eager=True)
        async for chunk in resp:
            if not ex.first_token:
                ex.first_token = time.time()
                opened.hint_kv()  # its prompt blocks were stored just before the first token
            out = guard.feed(chunk)
            if out:
                await ex.body(out, True)
    ex.last_token = time.time()
    opened.hint_kv()  # and its output blocks just before the end
    opened.close()
    await ex.body(guard.end(), False)


class _Pipe:
    """A generation stream's bytes, relayed from the executor connection's read callback straight
    to the client's connection (`UpstreamResponse.pipe` into `Responder.write_chunk`): no task
    wakes up per chunk. The executor's socket is paused while the client's is full."""

    __slots__ = ("ex", "opened", "guard", "resp", "out")

    def __init__(self, ex: Exchange, opened: Opened, guard: StreamGuard, resp: UpstreamResponse) -> None:
        self.ex, self.opened, self.guard, self.resp, self.out = ex, opened, guard, resp, ex.out

    def __call__(self, chunk: bytes) -> None:
        ex = self.ex
        if not ex.first_token:
            ex.first_token = time.time()
            self.opened.hint_kv()  # its prompt blocks were stored just before the first token
        out = self.guard.feed(chunk)
        if out:
            self.out.write_chunk(out)
            if not self.out.writable:
                self.resp.pause_reading()
                self.out.on_writable = self.resp.resume_reading


def _final_answer(body: bytes, max_tokens: int | None, role: str) -> bytes:
    """A complete executor answer as the client gets it: parsed, checked, handoff removed.
    Raises `ContractError`."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ContractError(f"{role} executor returned invalid JSON") from None
    check_final_answer(obj, max_tokens, role)
    return orjson.dumps(public_answer(obj))


async def relay_error(ex: Exchange, status: int, raw: bytes) -> None:
    """An executor's error answer in our error shape, with its status (TensorRT-LLM relays a
    worker's status, `_handle_exception` in openai_disagg_server.py) and its message unwrapped
    and redacted (`answers.executor_error_message`)."""
    await ex.fail(status, executor_error_message(raw, status), f"http_{status}")


def parse_ctx_response(raw: bytes, slot: int = -1, directory: ServerDirectory | None = None) -> dict[str, Any]:
    """The context executor's JSON answer, checked as TensorRT-LLM's `_verify_ctx_response` does
    and for exactly one choice. Raises `RequestError(502)`; the log line names the server
    (`directory.label(slot)`)."""
    try:
        ctx = orjson.loads(raw)
    except orjson.JSONDecodeError:
        log.warning("context server %s returned invalid JSON", _label(slot, directory))
        raise RequestError(502, "context executor returned invalid JSON", "executor_contract") from None
    try:
        return check_context_answer(ctx)
    except ContractError as err:
        log.warning("%s (context server %s)", err, _label(slot, directory))
        raise RequestError(502, str(err), "executor_contract") from None


def _label(slot: int, directory: ServerDirectory | None) -> str:
    return directory.label(slot) if directory is not None else "?"


def generation_request(
    req: dict[str, Any],
    chat: bool,
    ctx: dict[str, Any],
    disagg_request_id: int,
    style: int,
    strip_history: bool = False,
    ids: Raw | None = None,
) -> dict[str, Any]:
    """The generation leg: the client's request with the context executor's handoff
    (`_get_gen_request`, openai_disagg_service.py); with `strip_history` a chat keeps only its
    last message (`gen_strip_message_history`: the ids carry the prompt; tools are kept). `ids`:
    the context answer's `prompt_token_ids` when they were cut from it as bytes (`splice.cut`).

    A completion with `echo` keeps its text prompt, unlike upstream: the worker prepends the
    prompt's text to the answer, and with the ids in its place it refuses the request (its echo
    concatenates the id list to the text: 400, which upstream's orchestrator relays). The
    generation executor tokenizes the same text to the same ids."""
    if ids is not None and ids.empty:
        ids = None
    params = dict(ctx["choices"][0]["disaggregated_params"])
    params["request_type"] = "generation_only"
    params["disagg_request_id"] = disagg_request_id
    params["schedule_style"] = style
    if isinstance(ctx.get("usage"), dict):
        params["ctx_usage"] = ctx["usage"]
    gen = dict(req)
    gen["disaggregated_params"] = params
    if chat:
        if ctx.get("prompt_token_ids_b64"):
            gen["prompt_token_ids_b64"] = ctx["prompt_token_ids_b64"]
        elif ids is not None:
            gen["prompt_token_ids"] = ids
        elif ctx.get("prompt_token_ids"):
            gen["prompt_token_ids"] = ctx["prompt_token_ids"]
        messages = gen.get("messages")
        if strip_history and isinstance(messages, list) and len(messages) > 1:
            gen["messages"] = messages[-1:]
    elif req.get("echo") and isinstance(req.get("prompt"), str):
        pass  # the text stays: the worker echoes it (docstring)
    elif ids is not None:
        gen["prompt"] = ids
    elif ctx.get("prompt_token_ids"):
        gen["prompt"] = ctx["prompt_token_ids"]
    return gen


async def answer_from_context(ex: Exchange, req: dict[str, Any], chat: bool, ctx: dict[str, Any]) -> None:
    """The context leg finished the request (EOS or a stop token in prefill): its answer, checked
    and without the handoff; a streaming client gets it as SSE chunks."""
    try:
        check_final_answer(ctx, max_tokens_of(req), "context")
    except ContractError as err:
        log.warning("request %d: %s", ex.disagg_request_id, err)
        raise RequestError(502, str(err), "executor_contract") from None
    public_answer(ctx)
    ex.first_token = ex.last_token = time.time()
    if not ex.stream:
        await ex.start(200, JSON_HEADERS)
        await ex.body(orjson.dumps(ctx), False)
        return
    await ex.start(200, SSE_HEADERS)
    await ex.body(as_sse(ctx, chat, *usage_options(req)), False)


def usage_options(req: dict[str, Any]) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of a streaming request, as the worker reads its
    `StreamOptions` (openai_protocol.py: `include_usage` defaults to true once `stream_options` is
    there; postprocess_handlers.py: continuous usage only with include_usage)."""
    options = req.get("stream_options")
    if not isinstance(options, dict):
        return False, False
    include = bool(options.get("include_usage", True))
    return include, include and bool(options.get("continuous_usage_stats", False))


def as_sse(resp: dict[str, Any], chat: bool, include_usage: bool, continuous_usage: bool = False) -> bytes:
    """A complete (non-streaming) answer as the SSE stream the worker itself would have sent for
    it (`tensorrt_llm/serve/postprocess_handlers.py`, checked against the worker copy): a chat
    gets one `{"delta": {"role": "assistant"}}` chunk per choice, then per choice its content,
    reasoning and tool calls with logprobs and finish and stop reasons; a completion one chunk per
    choice with `text`, `token_ids`, `logprobs`, `finish_reason`, `stop_reason`,
    `avg_decoded_tokens_per_iter` and `"usage": null`; then the usage chunk if asked for. With
    `continuous_usage` every chunk carries the usage so far, as the worker's does: a chat's role
    chunk its prompt alone (`yield_first_chat`), the others the answer's.

    TensorRT-LLM's orchestrator sends only `data: [DONE]` here (`done_generator()` in
    `openai_disagg_service.py`'s `_send_disagg_request_ctx_first`), so a streaming client whose
    first token ends the request would lose it; this keeps the answer, in the worker's shape."""
    base = {
        "id": resp.get("id"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": resp.get("created") or int(time.time()),
        "model": resp.get("model"),
    }
    out: list[dict[str, Any]] = []
    choices = resp["choices"]
    usage = resp.get("usage") if continuous_usage and isinstance(resp.get("usage"), dict) else None
    if chat:
        role: dict[str, Any] = {}
        if usage is not None:
            prompt = usage.get("prompt_tokens", 0)
            details = usage.get("prompt_tokens_details")
            role["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0}
            if details is not None:
                role["usage"]["prompt_tokens_details"] = details
        out += [
            {**base, "choices": [{"index": c.get("index", 0), "delta": {"role": "assistant"}}], **role} for c in choices
        ]
    for choice in choices:
        c: dict[str, Any] = {"index": choice.get("index", 0)}
        if chat:
            message = choice.get("message") or {}
            delta = {
                "content": message.get("content") or "",
                "reasoning_content": message.get("reasoning_content") or "",
            }
            if message.get("tool_calls"):
                delta["tool_calls"] = message["tool_calls"]
            c["delta"] = delta
            if choice.get("logprobs") is not None:
                c["logprobs"] = choice["logprobs"]
            c.update(finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"))
            out.append({**base, "choices": [c], **({"usage": usage} if usage is not None else {})})
        else:
            c.update(
                text=choice.get("text", ""),
                token_ids=choice.get("token_ids"),
                logprobs=choice.get("logprobs"),
                finish_reason=choice.get("finish_reason"),
                stop_reason=choice.get("stop_reason"),
                avg_decoded_tokens_per_iter=choice.get("avg_decoded_tokens_per_iter"),
            )
            out.append({**base, "choices": [c], "usage": usage})
    if include_usage and resp.get("usage"):
        out.append({**base, "choices": [], "usage": resp["usage"]})
    return b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in out) + b"data: [DONE]\n\n"
