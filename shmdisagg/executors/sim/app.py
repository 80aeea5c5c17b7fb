"""The simulator's HTTP surface: a plain ASGI app (no framework) over the engine.

trtllm-serve endpoints (`tensorrt_llm/serve/openai_server.py` @fb31828e `register_routes`):
POST /v1/completions, POST /v1/chat/completions, GET /health, GET /version, GET /server_info,
POST /kv_cache_events, GET /perf_metrics, GET /metrics, GET /v1/models,
GET|POST /steady_clock_offset. Simulator-only: POST /sim/fault, GET /sim/stats,
POST /sim/clear_cache, POST /sim/kv_transfer (the KV pull between executors), POST /sim/kv_events
(lose KV events, or restart the event stream).

Errors in upstream's shapes (`errors.py`): a body that fails validation 400 `{"error": ...}`,
a refused request 400 `ErrorResponse`, an unknown path 404 `{"detail": "Not Found"}`, a wrong
method 405 `{"detail": "Method Not Allowed"}`. With `return_perf_metrics`, a request carrying
`X-TRTLLM-return-metrics: 1` gets its perf metrics on the answer (`perf_metrics.py`); with
`internal_request_auth_key`, protected disaggregated fields need their HMAC (`disagg_auth.py`).

While `--startup-delay` runs, every non-/sim request gets 503 with `x-trtllm-server-state:
starting`, `retry-after: 1` and the body of TensorRT-LLM's `serve/readiness.py`. A `hang` fault
holds every non-/sim request until it is cleared or the client leaves. Each inference request
gets a watcher on `receive()` so a client that disconnects aborts its request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from shmdisagg import __version__
from shmdisagg.executors.sim import disagg_auth, perf_metrics, responses, timing
from shmdisagg.executors.sim.block_keys import block_hashes, effective_hash_algo
from shmdisagg.executors.sim.block_pool import BlockPool
from shmdisagg.executors.sim.config import SimConfig
from shmdisagg.executors.sim.engine import Engine
from shmdisagg.executors.sim.errors import ConfigError, RequestError, SimError, ValidationFailed, error_body, sse_error
from shmdisagg.executors.sim.faults import FaultSpec, FaultState
from shmdisagg.executors.sim.kv_events import KvEventBuffer
from shmdisagg.executors.sim.perf_metrics import PerfMetricsBuffer
from shmdisagg.executors.sim.requests import Limits, ParsedRequest, parse_request
from shmdisagg.executors.sim.sampler import prompt_seed
from shmdisagg.executors.sim.sequence import Kind, Sequence, TokenChannel
from shmdisagg.executors.sim.tokenizer import Tokenizer

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Handler = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 256 << 20
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]  # StreamingResponse's
# TensorRT-LLM's serve/readiness.py: the constant body of every request while the model loads
_STARTING_BODY = json.dumps(
    {
        "error": {
            "message": "The server is still initializing the model and cannot serve requests yet. It is listening, "
            "so this is not a crash; retry until /health returns 200.",
            "type": "ServiceUnavailableError",
            "code": "starting",
        }
    }
).encode()
_UNAVAILABLE = b"LLM is unavailable. Please check the server logs for more details."

log = logging.getLogger("shmdisagg.executors.sim")


class InjectedDisconnect(Exception):
    """Raised after a response started to make uvicorn drop the connection (fault injection)."""


class SimApp:
    """One executor. Per-process state: config, tokenizer, KV event buffer, perf-metrics
    buffer, engine (owns the block pool and queues), faults, steady-clock offset, request-id
    counter, `ready_at` (end of the simulated model load)."""

    def __init__(self, config: SimConfig, exit_fn: Callable[[int], Any] = os._exit) -> None:
        self.config = config
        self.profile = config.timing_profile
        self.model = config.served_model
        self.endpoint = config.endpoint
        self.tokenizer = Tokenizer()
        self.limits = Limits(
            vocab_size=self.tokenizer.vocab_size,
            max_seq_len=config.effective_max_seq_len,
            role=config.role,
            disagg_enabled=config.disagg_enabled,
            max_prompt_tokens=None if config.enable_chunked_prefill else config.max_num_tokens,
        )
        self.hash_algo = effective_hash_algo(config.kv_cache_event_hash_algo)
        self.events = KvEventBuffer(
            config.event_buffer_max_size if config.enable_block_reuse else 0,
            window_size=config.effective_max_seq_len,
            include_tokens=config.event_tokens,
            timestamps=config.event_timestamps,
            hash_algo=self.hash_algo,
        )
        self.pool = BlockPool(
            config.effective_num_blocks, config.tokens_per_block, config.enable_block_reuse, self.events
        )
        # return_perf_metrics: per-request metrics on answers that ask for them, and (with
        # perf_metrics_max_requests > 0) the /perf_metrics ring, as openai_server.py sets them up
        self.perf_enabled = config.return_perf_metrics
        self.perf = (
            PerfMetricsBuffer(config.perf_metrics_max_requests, self.profile.kv_bytes_per_token)
            if config.return_perf_metrics and config.perf_metrics_max_requests > 0
            else None
        )
        self.faults = FaultState(config.seed, exit_fn=exit_fn)
        for spec in config.fault_specs:
            self.faults.add(spec)
        self._exit = exit_fn
        self.clock_offset = 0.0
        self.engine = Engine(
            self.profile,
            self.pool,
            max_batch_size=config.max_batch_size,
            max_num_tokens=config.max_num_tokens,
            chunked_prefill=config.enable_chunked_prefill,
            overlap_scheduler=not config.disable_overlap_scheduler,
            speedup=config.speedup,
            transfer_timeout_s=config.kv_transfer_timeout,
            own_endpoint=self.endpoint,
            slow_factor=lambda: self.faults.slow_factor,
            clock_offset=lambda: self.clock_offset,
            hash_algo=self.hash_algo,
        )
        state = {"sim": 1, "ctx_info_endpoint": self.endpoint, "instance": uuid.uuid4().hex}
        self.opaque_state = base64.b64encode(orjson.dumps(state)).decode("ascii")
        self.ready_at = time.monotonic() + config.startup_delay
        self._next_request_id = 1
        # openai_server.py: msgpack bodies (X-TRTLLM-Msgpack: 1) are decoded only with this set
        self.msgspec_bodies = os.environ.get("TRTLLM_SERVE_ENABLE_MSGSPEC", "0") == "1"
        self._routes: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat_completions,
            ("GET", "/health"): self._health,
            ("GET", "/version"): self._version,
            ("GET", "/server_info"): self._server_info,
            ("POST", "/kv_cache_events"): self._kv_cache_events,
            ("GET", "/perf_metrics"): self._perf_metrics,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/v1/models"): self._models,
            ("GET", "/steady_clock_offset"): self._get_clock,
            ("POST", "/steady_clock_offset"): self._set_clock,
            ("POST", "/sim/fault"): self._sim_fault,
            ("GET", "/sim/stats"): self._sim_stats,
            ("POST", "/sim/clear_cache"): self._sim_clear_cache,
            ("POST", "/sim/kv_transfer"): self._sim_kv_transfer,
            ("POST", "/sim/kv_events"): self._sim_kv_events,
        }
        self._paths = {path for _, path in self._routes}

    # -- ASGI entry -------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        if not path.startswith("/sim/"):
            if self.faults.hanging:
                held = await self._hang(receive)
                if held is None:
                    return
                receive = held
            if time.monotonic() < self.ready_at:
                await _send_raw(
                    send, 503, _STARTING_BODY, _JSON + [(b"retry-after", b"1"), (b"x-trtllm-server-state", b"starting")]
                )
                return
        handler = self._routes.get((scope["method"], path))
        if handler is None:  # Starlette's answers
            missing = path not in self._paths
            await _send_json(
                send, 404 if missing else 405, {"detail": "Not Found" if missing else "Method Not Allowed"}
            )
            return
        await handler(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # the simulated model load starts when the server is about to listen, as a trtllm-serve
                # that binds its socket first and answers 503 "starting" until the model is up
                self.ready_at = time.monotonic() + self.config.startup_delay
                self.engine.start(on_fatal=lambda exc: os.kill(os.getpid(), signal.SIGINT))
                if self.config.role != "context" and self.config.disagg_enabled:
                    self.engine.puller.warm_up()
                if self.faults.crash_at_once:
                    asyncio.get_running_loop().call_later(0.05, self._exit, 1)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.engine.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _hang(self, receive: Receive) -> Receive | None:
        """Hold the request while a hang fault is active. Returns None if the client left, else
        a `receive` that replays the body read meanwhile."""
        buffered: list[Message] = []
        unhung = asyncio.ensure_future(self.faults.wait_unhung())
        try:
            while not unhung.done():
                nxt = asyncio.ensure_future(receive())
                await asyncio.wait((unhung, nxt), return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    break
                message = nxt.result()
                if message["type"] == "http.disconnect":
                    return None
                buffered.append(message)
        finally:
            unhung.cancel()

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        return replay

    # -- inference --------------------------------------------------------------------------
    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=False)

    async def _chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=True)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        server_arrival = self.engine.now()  # ServerArrivalTimeMiddleware's stamp
        raw = await _read_body(receive)
        if raw is None:
            return
        verdict = self.faults.on_inference_request()
        if verdict.error is not None:
            fault = verdict.error
            await _send_json(send, fault.status, error_body(SimError(fault.message, fault.status)))
            return
        headers = scope.get("headers", [])
        try:
            msgpack = self.msgspec_bodies and any(k.lower() == b"x-trtllm-msgpack" and v == b"1" for k, v in headers)
            req = parse_request(raw, chat, self.tokenizer, self.limits, msgpack)
            if req.auth_fields is not None:
                disagg_auth.validate(
                    self.config.internal_request_auth_key, req.auth_fields, disagg_auth.header_value(headers)
                )
            seq = self._sequence(req)
        except RequestError as exc:
            await _send_json(send, exc.status, error_body(exc))
            return
        metrics = self.perf_enabled and perf_metrics.wants_metrics(headers)
        watcher = asyncio.ensure_future(_watch_disconnect(receive, self.engine, seq))
        try:
            overhead = self.profile.request_overhead_s * self.engine.time_scale()
            if overhead > 0:
                await asyncio.sleep(overhead)
            if seq.cancelled:
                return
            try:
                self.engine.submit(seq)
            except SimError as exc:
                await _send_json(send, exc.status, error_body(exc))
                return
            if req.stream:
                first_token = await self._stream(req, seq, send, verdict.disconnect_after_chunks, metrics)
            else:
                first_token = await self._unary(req, seq, send, metrics)
            if first_token is not None:
                self._finished(req, seq, server_arrival, first_token)
        finally:
            watcher.cancel()

    def _sequence(self, req: ParsedRequest) -> Sequence:
        # TensorRT-LLM uses disagg_request_id as the request id when it is given
        request_id = req.disagg_request_id if req.disagg_request_id is not None else self._next_request_id
        self._next_request_id += 1
        ctx_request_id = req.ctx_request_id
        if req.kind is Kind.CONTEXT_ONLY:
            ctx_request_id = request_id
        try:
            pseed = prompt_seed(req.prompt, self.config.seed)
        except (TypeError, OverflowError):  # pragma: no cover - parse_request checked the ids
            raise RequestError("prompt token ids must be int64") from None
        return Sequence(
            request_id=request_id,
            kind=req.kind,
            prompt=req.prompt,
            prompt_seed=pseed,
            max_tokens=1 if req.kind is Kind.CONTEXT_ONLY else req.max_tokens,
            stops=req.stops,
            include_stop=req.include_stop,
            min_tokens=req.min_tokens,
            block_hashes=block_hashes(req.prompt, self.pool.tokens_per_block, self.hash_algo)
            if self.pool.reuse
            else [],
            ctx_request_id=ctx_request_id,
            first_gen_tokens=req.first_gen_tokens,
            ctx_endpoint=req.ctx_endpoint,
            channel=TokenChannel(streaming=req.stream),
            arrival_time=self.engine.now(),
        )

    def _disagg_out(self, req: ParsedRequest, seq: Sequence) -> dict[str, Any] | None:
        if seq.kind is Kind.CONTEXT_ONLY:
            return responses.context_params(req, seq, self.endpoint, self.opaque_state)
        return req.disagg_echo

    def _finished(self, req: ParsedRequest, seq: Sequence, server_arrival: float, first_token: float) -> None:
        """`_extract_metrics`: the `/perf_metrics` record of a request answered in full."""
        if self.perf is not None:
            has_params = seq.kind is not Kind.LOCAL or req.disagg_echo is not None
            self.perf.record(seq, server_arrival, first_token, seq.ctx_request_id, has_params)

    async def _unary(self, req: ParsedRequest, seq: Sequence, send: Send, metrics: bool) -> float | None:
        """Answer once the request finished; returns its server first-token time, None if it failed."""
        channel = seq.channel
        try:
            while not channel.closed:
                await channel.wait()
        except asyncio.CancelledError:
            await self._cut_off(seq, send, started=False)
            return None
        if channel.error is not None:
            if not seq.cancelled:
                await _send_json(send, channel.error.status, error_body(channel.error))
            return None
        body = responses.full_response(req, seq, self.tokenizer, self._disagg_out(req, seq))
        extra = [(k.encode(), v.encode()) for k, v in perf_metrics.metrics_headers(seq).items()] if metrics else None
        await _send_json(send, 200, body, extra)
        return self.engine.now()

    async def _stream(
        self, req: ParsedRequest, seq: Sequence, send: Send, cut_after: int | None, metrics: bool
    ) -> float | None:
        """Stream the request's chunks; returns its server first-token time, None if it failed."""
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        encoder = responses.StreamEncoder(req, self.tokenizer, seq.request_id)
        channel = seq.channel
        sent = 0
        first_token: float | None = None
        try:
            while True:
                await channel.wait()
                tokens = channel.take()
                if tokens:
                    if cut_after is not None and sent >= cut_after:
                        self.engine.abort(seq)
                        raise InjectedDisconnect(f"disconnect_mid_stream after {sent} chunks")
                    if first_token is None:
                        first_token = self.engine.now()
                    await send({"type": "http.response.body", "body": encoder.chunks(tokens, seq), "more_body": True})
                    sent += 1
                elif channel.closed:
                    break
        except asyncio.CancelledError:
            await self._cut_off(seq, send, started=True)
            return None
        if channel.error is not None:
            if not seq.cancelled:
                await send({"type": "http.response.body", "body": sse_error(channel.error)})
            return None
        tail = encoder.finish_chunk(seq)
        if req.include_usage:
            tail += encoder.usage_chunk(seq)
        tail += responses.DONE
        if metrics:
            tail += perf_metrics.sse_event(perf_metrics.metrics_headers(seq))
        await send({"type": "http.response.body", "body": tail})
        return first_token if first_token is not None else self.engine.now()

    async def _cut_off(self, seq: Sequence, send: Send, started: bool) -> None:
        """End a request whose task was cancelled: uvicorn cancels what still runs once its
        graceful shutdown times out (`timeout_graceful_shutdown`, server.py), and logs an
        exception out of the app with its traceback. The request is aborted and answered as
        failed, as an engine failure is (`started`: its stream began), and the task returns."""
        self.engine.abort(seq)
        error = SimError("the executor is shutting down; the request did not finish in time", status=503)
        # a client that stopped reading holds this send until the event loop's close cancels the
        # task again: the connection's close then ends the response, still without a traceback
        with contextlib.suppress(asyncio.CancelledError):
            if started:
                await send({"type": "http.response.body", "body": sse_error(error)})
            else:
                await _send_json(send, error.status, error_body(error))

    # -- trtllm-serve control endpoints ------------------------------------------------------
    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.engine.fatal is not None:  # trtllm-serve: 503 (a plain-text body) once the executor failed
            await _send_raw(send, 503, _UNAVAILABLE)
            return
        await _send_raw(send, 200, b"")

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_json(send, 200, {"version": f"{__version__}+shmdisagg-sim"})

    async def _server_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        disagg = (
            {"ctx_info_endpoint": [self.endpoint], "encoded_opaque_state": self.opaque_state}
            if self.config.disagg_enabled
            else None
        )
        await _send_json(
            send,
            200,
            {
                "disaggregated_params": disagg,
                "max_batch_size": self.config.max_batch_size,
                "kv_cache_hash_algo": self.hash_algo,
                "tokens_per_block": self.config.tokens_per_block,
            },
        )

    async def _kv_cache_events(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _read_body(receive)
        await _send_json(send, 200, orjson.Fragment(self.events.drain_json()))

    async def _perf_metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_json(send, 200, self.perf.drain() if self.perf is not None else [])

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_json(send, 200, [])

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        card = {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "tensorrt_llm"}
        await _send_json(send, 200, {"object": "list", "data": [card]})

    async def _get_clock(self, scope: Scope, receive: Receive, send: Send) -> None:
        receive_ts = time.monotonic()
        await asyncio.sleep(0.2)
        await _send_json(send, 200, {"receive_ts": receive_ts, "transmit_ts": time.monotonic()})

    async def _set_clock(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`set_steady_clock_offset(offset: Annotated[float, Body(embed=True)])`: 200, no body."""
        raw = await _read_body(receive)
        if raw is None:
            return
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        offset = body.get("offset") if isinstance(body, dict) else None
        if isinstance(offset, str):
            try:
                offset = float(offset)  # pydantic's lax float
            except ValueError:
                offset = None
        if isinstance(offset, bool) or not isinstance(offset, (int, float)):
            await _send_json(send, 400, error_body(ValidationFailed("offset: Input should be a valid number")))
            return
        self.clock_offset = float(offset)
        await _send_raw(send, 200, b"")

    # -- simulator endpoints -----------------------------------------------------------------
    async def _sim_fault(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_json(receive, send)
        if body is None:
            return
        if not isinstance(body, dict):
            await _send_json(send, 400, error_body(RequestError("body must be a fault object")))
            return
        if body.get("kind") == "clear":
            target = body.get("target")
            self.faults.clear(target if isinstance(target, str) else None)
        else:
            try:
                spec = FaultSpec.from_dict(body)
            except ConfigError as exc:
                await _send_json(send, 400, error_body(RequestError(str(exc))))
                return
            self.faults.add(spec)
            if spec.kind == "crash" and spec.after is None:
                asyncio.get_running_loop().call_later(0.05, self._exit, 1)
        await _send_json(send, 200, {"faults": self.faults.describe()})

    async def _sim_stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        stats = self.engine.stats()
        stats.update(
            role=self.config.role,
            model=self.model,
            profile=self.profile.name,
            endpoint=self.endpoint,
            # the limits it runs with (/server_info, as trtllm-serve's, has no max_num_tokens)
            max_batch_size=self.config.max_batch_size,
            max_num_tokens=self.config.max_num_tokens,
            max_seq_len=self.config.effective_max_seq_len,
            faults=self.faults.describe(),
            events={
                "buffered": len(self.events),
                "dropped": self.events.dropped,
                "next_event_id": self.events.next_event_id,
                "restarts": self.events.restarts,
            },
            requests_seen=self.faults.requests_seen,
            estimates_ms={
                "ttft_256": round(1000 * timing.ttft_seconds(self.profile, 256), 3),
                "itl_batch_1": round(1000 * timing.itl_seconds(self.profile, 1, 256), 3),
            },
        )
        await _send_json(send, 200, stats)

    async def _sim_clear_cache(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _read_body(receive)
        await _send_json(send, 200, {"dropped_blocks": self.pool.clear()})

    async def _sim_kv_events(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`{"drop_next": n}`: lose the next n KV events, as a full event buffer would;
        `{"restart": true}`: drop every cached block and start the event stream again (ids from
        0, one `created`), as a restarted executor on the same port would, without ever failing
        a health check. A restart needs an idle executor (409 otherwise)."""
        body = await _read_json(receive, send)
        if body is None:
            return
        drop = body.get("drop_next", 0) if isinstance(body, dict) else None
        restart = body.get("restart", False) if isinstance(body, dict) else None
        if isinstance(drop, bool) or not isinstance(drop, int) or drop < 0 or not isinstance(restart, bool):
            await _send_json(send, 400, error_body(RequestError("body must be {drop_next: int >= 0, restart: bool}")))
            return
        if restart:
            stats = self.engine.stats()
            if (
                stats["num_waiting"]
                or stats["num_running"]
                or stats["num_transferring"]
                or stats["num_ready"]
                or stats["num_pinned"]
            ):
                await _send_json(send, 409, error_body(SimError("restart needs an idle executor", 409)))
                return
            self.pool.clear()
            self.events.restart(self.pool.num_blocks)
        self.events.drop_next(drop)
        await _send_json(send, 200, {"next_event_id": self.events.next_event_id, "dropped": self.events.dropped})

    async def _sim_kv_transfer(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_json(receive, send)
        if body is None:
            return
        ctx_id = body.get("ctx_request_id") if isinstance(body, dict) else None
        hold = body.get("hold_s", 0.0) if isinstance(body, dict) else 0.0
        digest = body.get("prompt_digest") if isinstance(body, dict) else None
        if isinstance(ctx_id, bool) or not isinstance(ctx_id, int) or not isinstance(hold, (int, float)):
            await _send_json(send, 400, error_body(RequestError("body must be {ctx_request_id: int, hold_s: float}")))
            return
        pull = asyncio.ensure_future(
            self.engine.transfers.pull(ctx_id, float(hold), digest if isinstance(digest, int) else None)
        )
        left = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((pull, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            pull.cancel()  # a no-op once done; else the puller left (its request aborted): stop waiting for it
        if not pull.done():
            # it forgets the pull as it ends; it may still end with its own error rather than the
            # cancellation (the context request failed in the same loop iteration, and 3.11's
            # wait_for returns its inner result when cancelled after it finished): nobody to tell
            with contextlib.suppress(asyncio.CancelledError, SimError):
                await pull
            return  # nobody to answer
        try:
            result = pull.result()
        except SimError as exc:
            await _send_json(send, exc.status, error_body(exc))
            return
        await _send_json(send, 200, result)


# -- helpers ------------------------------------------------------------------------------------
async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client disconnected first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= MAX_BODY_BYTES:
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    if size > MAX_BODY_BYTES:
        return b""
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _read_json(receive: Receive, send: Send) -> Any:
    raw = await _read_body(receive)
    if raw is None:
        return None
    try:
        return orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError:
        await _send_json(send, 400, error_body(RequestError("body is not valid JSON")))
        return None


async def _send_json(
    send: Send, status: int, body: Any, extra_headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await _send_raw(send, status, orjson.dumps(body), [*_JSON, *(extra_headers or ())])


async def _send_raw(send: Send, status: int, data: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-length", str(len(data)).encode()), *(headers or ())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _watch_disconnect(receive: Receive, engine: Engine, seq: Sequence) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            engine.abort(seq)
            return
