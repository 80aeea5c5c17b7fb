"""The two hot routes of a fleet worker: from a request's bytes to a flow, and every way it ends.

What the client sees (the lifecycle guarantees, also in the README):
- bad input: a 4xx error body before anything is routed (400 invalid, also for a request-level
  `chat_template` unless `allow_request_chat_template`, as TensorRT-LLM's orchestrator gates it;
  413 body too large, 415 a non-JSON content type, 429 with `Retry-After` when the deployment is
  at `max_inflight_requests`; the model name is not checked, as in TensorRT-LLM);
- an executor's 4xx: relayed with its status and body, never retried;
- a failure before any byte was sent: retried on another server where that is safe (see
  `legs.py`), else 502/503 with an error body;
- the deadline (`request_timeout_s`, one per request, both legs and the whole stream): 504 before
  any byte, an SSE error event and `[DONE]` after;
- a failure mid-stream: an SSE error event and `[DONE]`;
- a client that disconnects: both legs are cancelled upstream (connections closed) at once;
- the worker is stopping and its grace period is over (`end_inflight`): a 503 `shutting_down`
  before any byte, an SSE error event and `[DONE]` after, both legs cancelled upstream.
Every pick is released exactly once in each of these cases. This module never opens a socket.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from shmdisagg.config import DisaggConfig
from shmdisagg.hashing import cache_salt_id
from shmdisagg.orchestrator import splice
from shmdisagg.orchestrator.asgi import (
    AsgiResponder,
    ClientDisconnected,
    DisconnectWatch,
    Receive,
    Responder,
    Scope,
    Send,
    read_body,
)
from shmdisagg.orchestrator.deadlines import OpenRequests
from shmdisagg.orchestrator.errors import RequestError
from shmdisagg.orchestrator.exchange import Exchange
from shmdisagg.orchestrator.flows import Flows
from shmdisagg.orchestrator.ids import DisaggIdGenerator
from shmdisagg.orchestrator.splice import TokenIds
from shmdisagg.orchestrator.tokenization import RoutingTokenizer, prompt_token_ids
from shmdisagg.orchestrator.validation import parse_body, prompt_load_tokens, validate
from shmdisagg.routing import RoutingKey
from shmdisagg.routing.affinity import content_affinity_key
from shmdisagg.routing.conversation import SESSION_HEADERS, canonical_text, conversation_id, header_conversation_id
from shmdisagg.upstream import UpstreamError

log = logging.getLogger("shmdisagg.service")

_PATHS = {False: "/v1/completions", True: "/v1/chat/completions"}
SHUTTING_DOWN = "the server is shutting down; retry the request"
# TensorRT-LLM's message (`ensure_request_chat_template_allowed`, tensorrt_llm/serve/openai_protocol.py)
CHAT_TEMPLATE_REFUSED = (
    "chat_template cannot be supplied per request unless request-level chat templates are enabled at server startup."
)
_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")


class Admission:
    """Deployment-wide bound on requests in flight: the sum of active requests in every
    worker's row (read from the table, so it covers the whole fleet)."""

    def __init__(self, limit: int, inflight: Any) -> None:
        self.limit = limit
        self.inflight = inflight  # () -> int
        self.rejected = 0

    def admit(self) -> bool:
        if self.limit and self.inflight() >= self.limit:
            self.rejected += 1
            return False
        return True


class DisaggService:
    """State: `flows` runs the legs; `ids` mints `disagg_request_id`s; `models` are the names
    executors serve (refreshed by the worker's housekeeping); `admission` bounds in-flight work."""

    def __init__(
        self, config: DisaggConfig, flows: Flows, ids: DisaggIdGenerator, admission: Admission, schedule_style: str
    ) -> None:
        self.config = config
        self.flows = flows
        self.ids = ids
        self.admission = admission
        self.models: frozenset[str] = frozenset()
        # each kv_cache_aware role's {tokens_per_block, kv_cache_hash_algo}, from the coordinator
        self.routing_key_configs: dict[str, Any] = {}
        self.sinks: list[Callable[[Exchange], None]] = []  # called once per routed request, at its end
        cluster = config.disagg_cluster
        # (context, generation) healthy servers below which a request is refused: TensorRT-LLM's
        # readiness gate with a cluster manager (is_ready_with_router); None: static urls, always ready
        self.minimal: tuple[int, int] | None = (
            (cluster.minimal_instances.context_servers, cluster.minimal_instances.generation_servers)
            if cluster is not None
            else None
        )
        self.timeout_s = config.shmdisagg.request_timeout_s
        self.body_limit = config.shmdisagg.max_request_body_bytes
        self.schedule_style = schedule_style
        # a request-level chat_template is refused with 400 before routing unless the config allows it
        self.allow_request_chat_template = config.allow_request_chat_template
        self.keys: KeyBuilder | None = None  # set when a policy needs token ids or conversation ids
        # tasks of requests running a flow, each under its deadline (`request_timeout_s`)
        self.inflight: OpenRequests[Exchange] = OpenRequests(self.timeout_s, _expire)
        self.ending = False  # the grace period is over: every request ends with a 503

    def end_inflight(self) -> int:
        """End every request still running a flow, and refuse any later one, with a 503
        `shutting_down` (an SSE error event and `[DONE]` once a stream started). Each request is
        cancelled as a client disconnect is, so its legs are aborted upstream and its picks
        released on the usual paths. Returns how many were running."""
        self.ending = True
        for task in self.inflight:
            task.cancel()
        return len(self.inflight)

    async def handle(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        """Serve one POST to `/v1/completions` (chat=False) or `/v1/chat/completions` as ASGI."""
        arrival = time.time()
        out = AsgiResponder(send)
        headers = scope.get("headers", [])
        try:
            checked = _check_headers(headers)
            body = await read_body(receive, self.body_limit)
        except RequestError as err:
            await _refuse(out, err)
            return
        except ClientDisconnected:
            return
        await self._serve(checked, headers, body, out, DisconnectWatch(receive), chat, arrival)

    async def hot(self, request: HotRequest) -> None:
        """Serve one hot-route request that the public port's protocol parsed itself
        (`fleet/hot.py`): its body is complete, and it is its own answer's `Responder` and its
        own disconnect watch."""
        arrival = time.time()
        headers = request.headers
        try:
            checked = _check_headers(headers)
        except RequestError as err:
            await _refuse(request, err)
            return
        await self._serve(checked, headers, request.request_body(), request, request, request.chat, arrival)

    async def _serve(
        self,
        checked: tuple[list[tuple[bytes, bytes]], bool],
        headers: Iterable[tuple[bytes, bytes]],
        body: bytes,
        out: Responder,
        watch: Watch,
        chat: bool,
        arrival: float,
    ) -> None:
        extra, session = checked
        try:
            req = _decode(body, chat)
            if session:
                resolve_conversation_id(req, headers)
            if req.get("chat_template") is not None and not self.allow_request_chat_template:
                raise RequestError(400, CHAT_TEMPLATE_REFUSED, "chat_template_not_allowed", "chat_template")
            ids32 = validate(req, chat, want_ids=self.keys is not None and self.keys.wants_ids)
            if self.minimal is not None:
                self._check_ready(self.minimal)
            if not self.admission.admit():
                raise RequestError(429, "the deployment is at its in-flight request limit; retry shortly", "overloaded")
        except RequestError as err:
            await _refuse(out, err)
            return
        try:
            key = await self.keys.build(req, chat, ids32) if self.keys else RoutingKey(prompt_load_tokens(req, chat))
        except ValueError as err:  # a chat the template cannot render
            await _refuse(out, RequestError(400, str(err), "invalid_request", "messages"))
            return
        ex = Exchange(out, self.ids.next_id(), bool(req.get("stream")), extra, chat=chat, arrival=arrival)
        try:
            await self._run(ex, req, chat, key, watch)
        except asyncio.CancelledError:
            if not (watch.disconnected or ex.expired or self.ending):
                raise
            # we cancelled ourselves: the client left (the watch), the deadline (_expire), end_inflight
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            if watch.disconnected:
                pass
            elif ex.expired:
                await ex.fail(504, f"request did not finish within {self.timeout_s:g} s", "timeout")
            else:
                await ex.fail(503, SHUTTING_DOWN, "shutting_down")
        except RequestError as err:
            await ex.fail(err.status, err.message, err.code)
        except UpstreamError as err:  # the error names the executor: the client is not told which
            log.warning("request %d: %s", ex.disagg_request_id, err)
            await ex.fail(
                502, f"executor connection failed ({type(err).__name__.removeprefix('Upstream')})", "upstream_error"
            )
        except Exception:  # never a traceback to the client
            log.exception("request %d failed", ex.disagg_request_id)
            await ex.fail(500, "internal error", "internal_error")
        finally:
            if watch.disconnected:
                ex.error_code = ex.error_code or "client_disconnected"
            for sink in self.sinks:
                sink(ex)

    def _check_ready(self, minimal: tuple[int, int]) -> None:
        """TensorRT-LLM's readiness gate with a cluster manager: every request first asks
        `is_ready()`, ready while each role has `disagg_cluster.minimal_instances` prepared servers
        (`tensorrt_llm/serve/openai_disagg_service.py`, `disagg_auto_scaling.is_ready_with_router`).
        Upstream raises `RuntimeError("Cluster is not ready")`, a 500; here a 503
        `cluster_not_ready` that names the missing servers (a client retries a 503; the same
        condition is `/health`'s 503). Raises RequestError."""
        n_ctx, n_gen = self.flows.legs.directory.healthy_counts()
        if self.flows.options.benchmark_gen_only:  # no context leg is sent then
            n_ctx = max(n_ctx, minimal[0])
        if n_ctx >= minimal[0] and n_gen >= minimal[1]:
            return
        counts = (("context", n_ctx, minimal[0]), ("generation", n_gen, minimal[1]))
        missing = ", ".join(f"{role} {have} of {want}" for role, have, want in counts if have < want)
        raise RequestError(
            503,
            f"Cluster is not ready: fewer healthy servers than disagg_cluster.minimal_instances ({missing}); "
            "retry shortly",
            "cluster_not_ready",
        )

    async def _run(self, ex: Exchange, req: dict[str, Any], chat: bool, key: RoutingKey, watch: Watch) -> None:
        """The request's flow under its deadline (`request_timeout_s`: past it the task is
        cancelled and `ex.expired` marked), its task in `inflight` meanwhile so that `end_inflight`
        can cancel it."""
        task = asyncio.current_task()
        assert task is not None
        self.inflight.open(task, ex)
        try:
            if self.ending:
                raise RequestError(503, SHUTTING_DOWN, "shutting_down")
            with watch:
                await self.flows.run(ex, req, chat, key, _PATHS[chat])
        finally:
            self.inflight.close(task)


def _decode(body: bytes, chat: bool) -> dict[str, Any]:
    """The request's JSON object. A completion's token-id prompt in a body of `splice.MIN_BYTES`
    or more is not decoded: it is read into `splice.TokenIds` (int32 ids and its bytes, relayed
    as they came) and the rest of the body decoded around it. Raises `RequestError(400)`."""
    found = None if chat else splice.cut_token_ids(body, b"prompt")
    if found is None:
        return parse_body(body)
    rest, ids = found
    req = parse_body(rest)
    req["prompt"] = ids
    return req


def _expire(task: asyncio.Task[Any], ex: Exchange) -> None:
    """The request's deadline: end its flow (as asyncio.timeout would, flagged on the exchange)."""
    if not task.done():
        ex.expired = True
        task.cancel()


async def _refuse(out: Responder, err: RequestError) -> None:
    """A request refused before routing: its error body, with `Retry-After` on a 429."""
    headers = [(b"content-type", b"application/json")]
    if err.status == 429:
        headers.append((b"retry-after", b"1"))
    await out.start(err.status, headers)
    await out.body(err.body(), False)


class Watch(Protocol):
    """What cancels a request's flow when its client leaves: `with watch:` around the flow, then
    `disconnected` says whether it did (`asgi.DisconnectWatch`, `fleet.hot.HotCycle`)."""

    disconnected: bool

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...


class HotRequest(Responder, Watch, Protocol):
    """A hot-route request parsed by the public port's protocol (`fleet.hot.HotCycle`)."""

    chat: bool
    headers: list[tuple[bytes, bytes]]

    def request_body(self) -> bytes: ...


class KeyBuilder:
    """Builds the routing key when a policy needs more than the load: token ids (tokenized as
    the executor will, written back into the request) and the conversation id."""

    def __init__(self, tokenizer: RoutingTokenizer | None, conversations: bool, affinity: bool = False) -> None:
        self.tokenizer = tokenizer
        self.conversations = conversations
        self.affinity = affinity  # a kv_cache_aware router pins chats (routing/affinity.py)
        # Token-id prompts are read as ids when something routes on them: a tokenizing policy,
        # or the conversation router, which hashes a request's pre-existing token ids even in
        # text mode (TensorRT-LLM's ConversationRouter, `tensorrt_llm/serve/router.py`).
        self.wants_ids = tokenizer is not None or conversations

    async def build(self, req: dict[str, Any], chat: bool, ids32: bytes | None = None) -> RoutingKey:
        """`ids32`: the prompt's ids as int32 bytes from `validate(..., want_ids=True)` (token-id
        prompts), so the block hashes need not read the list again."""
        given = not chat and isinstance(req.get("prompt"), (list, TokenIds))  # validated: token ids
        # the chat's key from the body as the client sent it: the ids written back below are the
        # router's, and they grow with each turn (turn 1's 22 ids and turn 2's 36 keyed apart)
        affinity = content_affinity_key(req) if self.affinity and chat else 0
        if self.tokenizer is not None:
            ids = await prompt_token_ids(self.tokenizer, req, chat)
        else:
            ids = req["prompt"] if given and self.conversations else None
        salt = req.get("cache_salt")
        key = RoutingKey(
            len(ids) if ids is not None else prompt_load_tokens(req, chat),
            ids,
            salt_id=cache_salt_id(salt) if isinstance(salt, str) and salt else None,
            ids32=ids32 if ids is not None else None,
        )
        key.ids_given = given
        key.affinity = affinity
        if self.conversations:
            # the session headers are in the body by now (`resolve_conversation_id`)
            key.conversation_id = conversation_id(req, [])
            if key.conversation_id is None:
                key.text = canonical_text(req, chat)
        return key


def _check_headers(headers: Iterable[tuple[bytes, bytes]]) -> tuple[list[tuple[bytes, bytes]], bool]:
    """The request headers the hot routes act on, in one pass: a `content-type` that is not JSON
    is refused with 415 (TensorRT-LLM's FastAPI routes cannot parse such a body either, and
    answer it with a bare 500; no content type is read as JSON, as FastAPI does) and so is a
    compressed body (`content-encoding`: it would fail as JSON with a message about UTF-8), and a client's
    `x-request-id` is returned to be echoed back when it is 1-128 characters of
    `[A-Za-z0-9._:-]` (any other value is ignored: it would go into a response header). The flag
    says whether a conversation-id header (`SESSION_HEADERS`) came with it."""
    echo: list[tuple[bytes, bytes]] = []
    session = False
    for name, value in headers:
        if name in BODY_HEADERS:
            refuse_unreadable_body(name, value)
        elif name == b"x-request-id":
            # echoed only when it is a plain id; any other value is not ours to refuse
            # (TensorRT-LLM does not read the header and serves the request)
            echo = [(b"x-request-id", value)] if _REQUEST_ID.match(value) else []
        elif name in SESSION_HEADERS:
            session = True
    return echo, session


def resolve_conversation_id(req: dict[str, Any], headers: Iterable[tuple[bytes, bytes]]) -> None:
    """Write a header's conversation id into the body, as TensorRT-LLM's serve edge does
    (`resolve_request_conversation_id`, `tensorrt_llm/serve/conversation_id.py`, which its
    disaggregated server calls on every request): the body's `conversation_params` is canonical;
    without one, the first non-empty `x-session-id` / `x-correlation-id` / `x-session-affinity` /
    `x-multi-turn-session-id` becomes `conversation_params.conversation_id`, so both executors
    see the conversation the client named (they never see the client's headers)."""
    if req.get("conversation_params") is None:
        cid = header_conversation_id(headers)
        if cid is not None:
            req["conversation_params"] = {"conversation_id": cid}


BODY_HEADERS = frozenset({b"content-type", b"content-encoding"})


def refuse_unreadable_body(name: bytes, value: bytes) -> None:
    """Raise the 415 of a body header (`BODY_HEADERS`, lower-case name) the routes cannot read
    by: a content type that is not JSON, or a content encoding (a compressed body would fail as
    JSON with a message about UTF-8)."""
    if name == b"content-type" and not _is_json_type(value):
        raise _unsupported("content-type", value, "send the body as application/json")
    if name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
        raise _unsupported("content-encoding", value, "send the body uncompressed")


def _unsupported(header: str, value: bytes, advice: str) -> RequestError:
    shown = value[:64].decode("latin-1")
    return RequestError(415, f"unsupported {header} {shown!r}: {advice}", "unsupported_media_type", header)


def _is_json_type(value: bytes) -> bool:
    """`application/json` or any `+json` type, parameters (`; charset=utf-8`) allowed."""
    media = value.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))
