#!/usr/bin/env python
"""A TensorRT-LLM-style disaggregated orchestrator: the baseline for `bench_orchestrator_cpu.py`.

TensorRT-LLM cannot be installed here, so this file rebuilds the request path of its
`trtllm-serve disaggregated` server (`OpenAIDisaggServer` + `OpenAIDisaggregatedService` +
`OpenAIHttpClient` + `RoundRobinRouter`, context-first schedule, lifecycle protocol v0) on the
same libraries, following TensorRT-LLM's `tensorrt_llm/serve/openai_disagg_server.py`,
`openai_disagg_service.py`, `openai_client.py` and `router.py`. One process, FastAPI on uvicorn
(uvloop, httptools).

What one `POST /v1/completions` does here, as in TensorRT-LLM:

1. FastAPI validates the body into the pydantic `CompletionRequest` (extra="forbid", the OpenAI
   fields plus `disaggregated_params` / `conversation_params`); a pure-ASGI middleware stamps the
   arrival time (`ServerArrivalTimeMiddleware`); the entry wrapper counts the request, checks
   `chat_template`, resolves the conversation id and builds the per-request hooks object.
2. The service gates on `is_ready()`, normalises the prompt, mints a snowflake
   `disagg_request_id`, copies the request with `model_copy(update={disaggregated_params:
   DisaggregatedParams(request_type="context_only", ...), stream: False, stream_options: None})`,
   asks the context round-robin router (an `asyncio.Lock` around an index) for a server and sends
   the copy through the context `OpenAIHttpClient`: body `model_dump_json(exclude_unset=True)`,
   aiohttp `ClientSession(TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=1))`,
   `ClientTimeout(total=180)`, the retry loop, `await response.json()`, parsed into the pydantic
   `CompletionResponse`, router finish in a shielded cleanup task.
3. It verifies the context response, turns the original request into the generation request
   (`disaggregated_params` := the context choice's, `request_type="generation_only"`,
   `ctx_usage`, `prompt` := `prompt_token_ids`), picks a generation server and sends it the same
   way. Non-streaming: the parsed `CompletionResponse` goes back as `JSONResponse(model_dump())`.
   Streaming: the client's response generator (`content.iter_any()`, `asyncio.sleep(0)` after
   each chunk, wrapped in `_ManagedResponseStream`) is relayed by `StreamingResponse` chunk by chunk.

Deliberate simplifications, each one making this baseline *cheaper* than TensorRT-LLM, never
dearer: Prometheus counters and histograms are plain Python stand-ins (prometheus_client is not
installed here; TensorRT-LLM uses its multiprocess mode, whose every `inc`/`observe` writes an
mmap'ed file under a lock); no OTLP tracing; chat `messages` are validated as plain dicts instead
of the OpenAI TypedDict union; `uvicorn` runs at `log_level=warning` (TensorRT-LLM passes its
logger level, `info` by default, which also turns on uvicorn's per-request access log; `--log-level
info` here reproduces that); uvloop is installed as the loop (TensorRT-LLM calls `asyncio.run`,
which gets uvloop only if something set the policy). GC is disabled like TensorRT-LLM's default
(`TRTLLM_DISAGG_SERVER_DISABLE_GC=1`; set it to 0 to keep GC on).

Run standalone:

    .venv/bin/python benchmarks/baseline_trtllm_orchestrator.py --port 8100 \
        --ctx 127.0.0.1:8001 --gen 127.0.0.1:8002 [--ctx ...] [--gen ...]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gc
import logging
import os
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable
from enum import IntEnum
from typing import Annotated, Any, Literal

import aiohttp
import uvicorn
import uvloop
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

logger = logging.getLogger("baseline_trtllm")

# ------------------------------------------------------------------------------------------
# Protocol (openai_protocol.py): the request and response models the orchestrator uses
# ------------------------------------------------------------------------------------------


class DisaggScheduleStyle(IntEnum):
    CONTEXT_FIRST = 0
    GENERATION_FIRST = 1


class OpenAIBaseModel(BaseModel):
    # OpenAI API does not allow extra fields; initialise by alias or field name
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json", "json_schema", "json_object", "regex", "ebnf", "structural_tag"]
    schema_: dict | None = Field(default=None, alias="schema")
    json_schema: dict | None = None
    regex: str | None = None
    ebnf: str | None = None
    format: dict | None = None  # an xgrammar structural-tag Format in TensorRT-LLM


class DisaggregatedParams(OpenAIBaseModel):
    request_type: str
    first_gen_tokens: list[int] | None = None
    first_gen_log_probs: list | None = None
    first_gen_logits: list | None = None
    ctx_request_id: int | None = None
    encoded_opaque_state: str | None = None
    draft_tokens: list[int] | None = None
    disagg_request_id: int | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None
    schedule_style: DisaggScheduleStyle | None = None
    ctx_usage: UsageInfo | None = None
    return_prompt_token_ids_b64: bool = False
    resolved_thinking: bool | None = None
    # set by the service (_get_ctx_request): conversation routing and the v1 control endpoint
    conversation_id: str | None = None
    context_control_endpoint: str | None = None


class ConversationParams(OpenAIBaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)

    conversation_id: str

    @field_validator("conversation_id", mode="before")
    @classmethod
    def validate_conversation_id(cls, value: Any) -> str:
        if value is None:
            raise ValueError("conversation_id must be non-empty")
        conversation_id = str(value).strip()
        if not conversation_id:
            raise ValueError("conversation_id must be non-empty")
        return conversation_id


EarlyStopping = bool | Literal["never"]


def _check_logprobs_limit(name: str, value: Any) -> None:
    if value is not None and isinstance(value, int) and value < 0:
        raise ValueError(f"{name} must be non-negative")


class CompletionRequest(OpenAIBaseModel):
    model: str
    prompt: list[int] | list[list[int]] | str | list[str]
    best_of: int | None = None
    echo: bool | None = False
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    max_tokens: int | None = None
    n: int = 1
    presence_penalty: float | None = 0.0
    seed: int | None = Field(default=None)
    stop: str | list[str] | None = Field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    lora_request: dict[str, Any] | None = None  # a LoRARequest dataclass in TensorRT-LLM
    prompt_ignore_length: int | None = 0
    use_beam_search: bool = False
    top_k: int = 0
    top_p_min: float = 0.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    length_penalty: float | None = None
    early_stopping: EarlyStopping | None = None
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None
    return_context_logits: bool = False
    detokenize: bool = True
    thinking_token_budget: int | None = None
    add_special_tokens: bool = Field(default=True)
    response_format: ResponseFormat | None = Field(default=None)
    disaggregated_params: DisaggregatedParams | None = Field(default=None)
    priority: float | None = Field(default=None, ge=0.0, le=1.0)
    conversation_params: ConversationParams | None = Field(default=None)

    @model_validator(mode="before")
    @classmethod
    def check_logprobs(cls, data):  # type: ignore[no-untyped-def]
        _check_logprobs_limit("logprobs", data.get("logprobs"))
        return data

    @field_validator("thinking_token_budget", mode="before")
    @classmethod
    def check_thinking_token_budget(cls, value):  # type: ignore[no-untyped-def]
        if value is not None and value < 0:
            raise ValueError("thinking_token_budget must be non-negative")
        return value

    @model_validator(mode="before")
    @classmethod
    def validate_stream_options(cls, data):  # type: ignore[no-untyped-def]
        if data.get("stream_options") and not data.get("stream"):
            raise ValueError("Stream options can only be defined when stream is true.")
        return data

    @model_validator(mode="before")
    @classmethod
    def check_suffix(cls, data):  # type: ignore[no-untyped-def]
        if data.get("suffix"):
            raise ValueError("suffix is not supported")
        return data


class ChatCompletionRequest(OpenAIBaseModel):
    messages: list[dict[str, Any]]  # the OpenAI message TypedDict union in TensorRT-LLM
    prompt_token_ids: list[int] | None = None
    prompt_token_ids_b64: str | None = None
    model: str
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_completion_tokens: int | None = Field(default=None, validation_alias="max_tokens")
    n: int = 1
    presence_penalty: float | None = 0.0
    response_format: ResponseFormat | None = None
    seed: int | None = Field(None)
    stop: str | list[str] | None = Field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = "none"
    user: str | None = None
    reasoning_effort: Literal["low", "medium", "high", "max", "none"] | None = "low"
    thinking: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    prompt_ignore_length: int | None = 0
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int = 0
    top_p_min: float = 0.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    length_penalty: float | None = None
    early_stopping: EarlyStopping | None = None
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None
    lora_request: dict[str, Any] | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    disaggregated_params: DisaggregatedParams | None = None
    conversation_params: ConversationParams | None = None
    cache_salt: str | None = None
    priority: float | None = Field(default=None, ge=0.0, le=1.0)
    agent_hierarchy: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def validate_stream_options(cls, values):  # type: ignore[no-untyped-def]
        if values.get("stream_options") is not None and not values.get("stream"):
            raise ValueError("stream_options can only be set if stream is true")
        return values


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    token_ids: list[int] | None = None
    logprobs: CompletionLogProbs | None = None
    context_logits: list[float] | list[list[float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(default=None)
    disaggregated_params: DisaggregatedParams | None = Field(default=None)
    avg_decoded_tokens_per_iter: float | None = Field(default=None)


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{str(uuid.uuid4().hex)}")
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[list[int]] | list[int] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    mm_embedding_handle: dict[str, Any] | None = None
    disaggregated_params: DisaggregatedParams | None = Field(default=None)
    avg_decoded_tokens_per_iter: float | None = Field(default=None)


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{str(uuid.uuid4().hex)}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    prompt_token_ids_b64: str | None = None


UCompletionRequest = CompletionRequest | ChatCompletionRequest
UCompletionResponse = CompletionResponse | ChatCompletionResponse

_GEN_PENDING_FINISH_REASONS = ("length", "not_finished")


def ensure_request_chat_template_allowed(request: Any, allow_request_chat_template: bool) -> None:
    if getattr(request, "chat_template", None) is not None and not allow_request_chat_template:
        raise ValueError(
            "chat_template cannot be supplied per request unless request-level chat templates are enabled at "
            "server startup."
        )


# ------------------------------------------------------------------------------------------
# Metrics (perf_metrics.py): stand-ins for prometheus_client Counter / Histogram
# ------------------------------------------------------------------------------------------

SHORT_TIME_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
LONG_TIME_BUCKETS = [
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
]


class _Counter:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class _Histogram:
    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: list[float]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        self.counts[bisect.bisect_left(self.buckets, value)] += 1


class ClientMetricsCollector:
    def __init__(self, role: str) -> None:
        self.total_requests = _Counter()
        self.error_requests = _Counter()
        self.retry_requests = _Counter()
        self.completed_requests = _Counter()
        self.first_token_latency_seconds = _Histogram(SHORT_TIME_BUCKETS)
        self.complete_latency_seconds = _Histogram(LONG_TIME_BUCKETS)
        self.per_token_latency_seconds = _Histogram(SHORT_TIME_BUCKETS)


class DisaggPerfMetricsCollector:
    def __init__(self, max_requests: int) -> None:
        self._max_requests = max_requests
        self._request_metrics: deque = deque(maxlen=max_requests)
        self._lock = asyncio.Lock()
        self._clients: list = []
        self._background_tasks: set = set()
        self.total_requests = _Counter()
        self.stream_requests = _Counter()
        self.nonstream_requests = _Counter()
        self.validation_exceptions = _Counter()
        self.http_exceptions = _Counter()
        self.internal_errors = _Counter()
        self.total_responses = _Counter()
        self.queue_latency_seconds = _Histogram(SHORT_TIME_BUCKETS)

    def add_client(self, client: Any) -> None:
        self._clients.append(client)

    async def add_per_request_metrics(
        self,
        ctx_server: str,
        gen_server: str,
        ctx_request_id: int | None,
        server_arrival_time: float,
        server_first_token_time: float,
        ctx_dispatch_time: float,
    ) -> None:
        async with self._lock:
            self._request_metrics.append(
                (
                    ctx_server,
                    gen_server,
                    ctx_request_id,
                    server_arrival_time,
                    server_first_token_time,
                    ctx_dispatch_time,
                )
            )


def get_steady_clock_now_in_seconds() -> float:
    return time.monotonic()


# ------------------------------------------------------------------------------------------
# Request ids (llmapi/disagg_utils.py): the snowflake disagg_request_id
# ------------------------------------------------------------------------------------------

_MAX_INT64 = (1 << 63) - 1
_MIN_GLOBAL_ID = 1 << 40
_id_lock = threading.Lock()
_id_counter = 0


def get_global_disagg_request_id(node_id: int, process_id: int = 0) -> int:
    global _id_counter
    with _id_lock:
        _id_counter = (_id_counter + 1) & 0x3FF
        counter = _id_counter
    timestamp = int(time.monotonic() * 1000) & ((1 << 39) - 1)
    raw = (timestamp << 24) | ((node_id & 0xFF) << 16) | ((process_id & 0x3F) << 10) | counter
    return raw % (_MAX_INT64 - _MIN_GLOBAL_ID) + _MIN_GLOBAL_ID


# ------------------------------------------------------------------------------------------
# Router (router.py): round robin
# ------------------------------------------------------------------------------------------


class RoundRobinRouter:
    def __init__(self, role: str, servers: list[str]) -> None:
        self._servers = servers
        self._server_role = role
        self._server_info: dict[str, dict] = {}
        self._prepared_ready_servers: set = set()
        self._lock = asyncio.Lock()
        self._server_idx = 0

    @property
    def servers(self) -> list[str]:
        return self._servers

    @property
    def num_prepared_servers(self) -> int:
        return len(self._prepared_ready_servers)

    async def prepare_servers(self, session: aiohttp.ClientSession) -> None:
        for server in self._servers:
            if server in self._prepared_ready_servers:
                continue
            try:
                async with session.get(f"http://{server}/server_info") as response:
                    self._server_info[server] = await response.json()
                self._prepared_ready_servers.add(server)
            except Exception as e:  # swallowed like TensorRT-LLM; retried later
                logger.warning("Error preparing server %s: %s", server, e)

    def _get_next_server(self) -> str:
        server = self._servers[self._server_idx % len(self._servers)]
        self._server_idx += 1
        return server

    async def get_next_server(
        self, request: Any, exclude_server: str | None = None, req_id: int | None = None
    ) -> tuple[str, dict]:
        del req_id
        if not self._servers:
            raise ValueError(f"No {self._server_role} servers available")
        async with self._lock:
            server = self._get_next_server()
            if exclude_server and server == exclude_server:
                server = self._get_next_server()
                if server == exclude_server:
                    raise ValueError(f"No available servers after excluding {exclude_server}")
        return server, {"server_info": self._server_info.get(server, {})}

    async def finish_request(
        self,
        request: Any,
        session: aiohttp.ClientSession | None = None,
        success: bool = True,
        req_id: int | None = None,
    ) -> None:
        del request, session, success, req_id


# ------------------------------------------------------------------------------------------
# Client (openai_client.py): OpenAIHttpClient on aiohttp
# ------------------------------------------------------------------------------------------


class UpstreamRequestTimeoutError(TimeoutError):
    def __init__(self, role: str, timeout_secs: int, detail: str | None = None) -> None:
        message = f"{role} worker request exceeded the configured {timeout_secs}-second timeout"
        if detail:
            message = f"{message}: {detail}"
        super().__init__(message)


class _ManagedResponseStream:
    """Own router cleanup even when a response stream is never started."""

    def __init__(self, client: OpenAIHttpClient, request: Any, resp_generator: Any, req_id: int | None = None) -> None:
        self._client = client
        self._request = request
        self._resp_generator = resp_generator
        self._req_id = req_id
        self._cleanup_lock = asyncio.Lock()
        self._closed = False

    def __aiter__(self) -> _ManagedResponseStream:
        return self

    async def __anext__(self) -> Any:
        return await self.asend(None)

    async def asend(self, value: Any) -> Any:
        if self._closed:
            raise StopAsyncIteration
        try:
            return await self._resp_generator.asend(value)
        except StopAsyncIteration:
            await self._finish(success=True)
            raise
        except asyncio.CancelledError:
            await self._finish(success=False)
            raise
        except Exception:
            await self._finish(success=False)
            raise

    async def athrow(self, *args: Any) -> Any:
        if self._closed:
            return None
        try:
            return await self._resp_generator.athrow(*args)
        except (StopAsyncIteration, GeneratorExit):
            await self._finish(success=False)
            raise
        except asyncio.CancelledError:
            await self._finish(success=False)
            raise
        except Exception:
            await self._finish(success=False)
            raise

    async def aclose(self) -> None:
        await self._finish(success=False)

    async def _finish(self, success: bool) -> None:
        async with self._cleanup_lock:
            if self._closed:
                return
            if not success:
                self._client._metrics_collector.error_requests.inc()
            try:
                await self._client._cleanup_request_safely(
                    self._request, self._resp_generator, success=success, req_id=self._req_id
                )
            finally:
                self._closed = True


class OpenAIHttpClient:
    def __init__(
        self,
        router: RoundRobinRouter,
        role: str,
        timeout_secs: int = 180,
        max_retries: int = 1,
        retry_interval_sec: int = 1,
        disagg_id_generator: Callable[[], Any] | None = None,
    ) -> None:
        self._router = router
        self._role = role
        self._metrics_collector = ClientMetricsCollector(role)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0,
                limit_per_host=0,
                force_close=False,
                # below the server-side keep-alive timeout, to avoid reusing stale connections
                keepalive_timeout=1,
            ),
            timeout=aiohttp.ClientTimeout(total=timeout_secs),
        )
        self._max_retries = max_retries
        self._retry_interval_sec = retry_interval_sec
        self._disagg_id_generator = disagg_id_generator
        self._timeout_secs = timeout_secs

    async def send_request(
        self, request: UCompletionRequest, server: str | None = None, hooks: Any = None, req_id: int | None = None
    ) -> Any:
        if isinstance(request, CompletionRequest):
            return await self._send_request("v1/completions", request, CompletionResponse, server, hooks, req_id)
        elif isinstance(request, ChatCompletionRequest):
            return await self._send_request(
                "v1/chat/completions", request, ChatCompletionResponse, server, hooks, req_id
            )
        raise ValueError(f"Invalid request type: {type(request)}")

    async def _send_request(
        self,
        endpoint: str,
        request: UCompletionRequest,
        response_type: type[Any],
        server: str | None = None,
        hooks: Any = None,
        req_id: int | None = None,
    ) -> Any:
        self._metrics_collector.total_requests.inc()
        resp_generator = None
        cleanup_deferred = False
        success = False
        try:
            if server is None:
                if req_id is None:
                    server, _ = await self._router.get_next_server(request)
                else:
                    server, _ = await self._router.get_next_server(request, req_id=req_id)
            url = f"http://{server}/{endpoint}"
            _dp = request.disaggregated_params
            _ctx_rid = _dp.ctx_request_id if _dp is not None else None
            logger.debug(f"Sending {self._role} request {_ctx_rid} to {url}")
            resp_generator = self._post_with_retry(server, url, request, hooks, req_id)
            if request.stream:
                # The POST is lazy for streaming requests; cleanup stays with the generator.
                response_stream = _ManagedResponseStream(self, request, resp_generator, req_id)
                cleanup_deferred = True
                return response_stream
            response = None
            async for resp_json in resp_generator:
                response = response_type(**resp_json)
                if hooks:
                    if self._role == "context":
                        hooks.on_ctx_resp(server, response)
                    else:
                        hooks.on_first_token(server, request)
                        hooks.on_resp_done(server, request, response)
            success = True
            return response
        except asyncio.CancelledError:
            self._metrics_collector.error_requests.inc()
            raise
        except Exception:
            self._metrics_collector.error_requests.inc()
            raise
        finally:
            if not cleanup_deferred:
                await self._cleanup_request_safely(request, resp_generator, success=success, req_id=req_id)

    async def _cleanup_request_safely(
        self,
        request: Any,
        resp_generator: AsyncGenerator[Any, None] | None,
        success: bool,
        req_id: int | None = None,
    ) -> None:
        async def cleanup() -> None:
            try:
                if resp_generator is not None:
                    await resp_generator.aclose()
            finally:
                await self._finish_request(request, success=success, req_id=req_id)

        cleanup_task = asyncio.create_task(cleanup())
        try:
            await asyncio.shield(cleanup_task)
        except asyncio.CancelledError:
            await cleanup_task
            raise

    async def _post_with_retry(
        self, server: str, url: str, request: UCompletionRequest, hooks: Any = None, req_id: int | None = None
    ) -> AsyncGenerator[Any, None]:
        is_stream = request.stream
        for attempt in range(self._max_retries + 1):
            if attempt > 0 and self._disagg_id_generator is not None:
                dp = getattr(request, "disaggregated_params", None)
                if dp is not None and getattr(dp, "disagg_request_id", None) is not None:
                    dp.disagg_request_id = await self._disagg_id_generator()
            body = request.model_dump_json(exclude_unset=True)
            req_headers = {"Content-Type": "application/json"}
            try:
                lines_yielded = 0
                start_time = get_steady_clock_now_in_seconds()
                async with self._session.post(url, data=body, headers=req_headers) as http_response:
                    content_type = http_response.headers.get("Content-Type", "")
                    if http_response.status >= 400:
                        if http_response.status == 504:
                            raise UpstreamRequestTimeoutError(
                                self._role, self._timeout_secs, detail=(await http_response.text())[:2048]
                            )
                        error_body = await http_response.text()
                        raise aiohttp.ClientResponseError(
                            http_response.request_info,
                            http_response.history,
                            status=http_response.status,
                            message=f"{http_response.reason}: {error_body[:2048]}",
                            headers=http_response.headers,
                        )
                    if not is_stream and "text/event-stream" in content_type:
                        raise ValueError("Received an event-stream although request stream was False")
                    if is_stream:
                        async for line in self._response_generator(
                            request, http_response, start_time, server, hooks, req_id
                        ):
                            lines_yielded += 1
                            yield line
                    else:
                        response_dict = await http_response.json()
                        yield response_dict
                        self._metrics_collector.complete_latency_seconds.observe(
                            get_steady_clock_now_in_seconds() - start_time
                        )
                break
            except UpstreamRequestTimeoutError:
                raise
            except TimeoutError as e:
                logger.error(f"{self._role} request to {url} timed out after {self._timeout_secs} seconds")
                raise UpstreamRequestTimeoutError(self._role, self._timeout_secs) from e
            except (aiohttp.ClientError, OSError) as e:
                if lines_yielded > 0:
                    logger.error(f"Client error to {url}: {e} - cannot retry since {lines_yielded} lines were yielded")
                    raise
                if attempt >= self._max_retries:
                    logger.error(f"Client error to {url}: {e} - last retry {attempt} of {self._max_retries} failed")
                    raise
                logger.error(f"{self._role} client error to {url}: {e} - retry {attempt} of {self._max_retries}")
                await asyncio.sleep(self._retry_interval_sec)
                self._metrics_collector.retry_requests.inc()
            except Exception as e:
                logger.error(f"Unexpected error while processing {self._role} request to {url}: {e}")
                raise

    async def _response_generator(
        self,
        request: Any,
        http_response: aiohttp.ClientResponse,
        start_time: float,
        server: str,
        hooks: Any = None,
        req_id: int | None = None,
    ) -> AsyncGenerator[Any, None]:
        assert request.stream, "Request is not streaming"
        assert "text/event-stream" in http_response.headers.get("Content-Type", ""), "Response is not streaming"
        try:
            last_token_time = start_time
            i = 0
            async for line in http_response.content.iter_any():
                now_time = get_steady_clock_now_in_seconds()
                if line:
                    if i == 0:
                        if hooks:
                            hooks.on_first_token(server, request)
                        self._metrics_collector.first_token_latency_seconds.observe(now_time - last_token_time)
                    else:
                        self._metrics_collector.per_token_latency_seconds.observe(now_time - last_token_time)
                    i += 1
                    yield line
                    await asyncio.sleep(0)
                last_token_time = now_time
            if hooks:
                hooks.on_resp_done(server, request, None)
            self._metrics_collector.complete_latency_seconds.observe(get_steady_clock_now_in_seconds() - start_time)
        except aiohttp.ClientError as e:
            logger.error(f"{self._role} client {server} error: {e}")
            raise

    async def _finish_request(self, request: Any, success: bool = True, req_id: int | None = None) -> None:
        self._metrics_collector.completed_requests.inc()
        if req_id is None:
            await self._router.finish_request(request, self._session, success=success)
        else:
            await self._router.finish_request(request, self._session, success=success, req_id=req_id)

    async def check_ready(self) -> tuple[list[str], list[str]]:
        async def check_server_ready(server: str) -> bool:
            try:
                async with self._session.get(f"http://{server}/health") as response:
                    return response.status == 200
            except Exception:
                return False

        ready = await asyncio.gather(*[check_server_ready(s) for s in self._router.servers])
        ok = [s for s, r in zip(self._router.servers, ready, strict=True) if r]
        if ok:
            await self._router.prepare_servers(self._session)
        return ok, [s for s, r in zip(self._router.servers, ready, strict=True) if not r]

    async def shutdown(self) -> None:
        await self._session.close()


# ------------------------------------------------------------------------------------------
# Service (openai_disagg_service.py): context-first, lifecycle protocol v0
# ------------------------------------------------------------------------------------------


async def done_generator() -> AsyncGenerator[bytes, None]:
    yield b"data: [DONE]\n\n"


class DisaggCoordinatorService:
    """The in-process coordinator of the single-process path: routers, readiness, ids."""

    def __init__(self, ctx_servers: list[str], gen_servers: list[str], node_id: int) -> None:
        self.ctx_router = RoundRobinRouter("context", ctx_servers)
        self.gen_router = RoundRobinRouter("generation", gen_servers)
        self._node_id = node_id

    async def get_disagg_request_id(self) -> int:
        return get_global_disagg_request_id(self._node_id)

    async def is_ready(self) -> bool:
        return True

    async def cluster_info(self) -> dict[str, Any]:
        return {
            "is_ready": await self.is_ready(),
            "server_lists": {"context": list(self.ctx_router.servers), "generation": list(self.gen_router.servers)},
        }


class OpenAIDisaggregatedService:
    def __init__(
        self,
        coordinator: DisaggCoordinatorService,
        client_factory: Callable[[RoundRobinRouter, str], OpenAIHttpClient],
        server_start_timeout_secs: int = 180,
    ) -> None:
        self._coordinator = coordinator
        self._ctx_router = coordinator.ctx_router
        self._gen_router = coordinator.gen_router
        self._client_factory = client_factory
        self._server_start_timeout_secs = server_start_timeout_secs
        self._tokids_ctxbytes = False
        self._strip_gen_message_history = False
        self._schedule_style = DisaggScheduleStyle.CONTEXT_FIRST
        self._ctx_client: OpenAIHttpClient | None = None
        self._gen_client: OpenAIHttpClient | None = None

    async def openai_completion(self, request: CompletionRequest, hooks: Any = None) -> Any:
        if not await self.is_ready():
            raise RuntimeError("Cluster is not ready")
        if not isinstance(request.prompt, str):
            if isinstance(request.prompt, list) and len(request.prompt) == 0:
                raise ValueError("Disaggregated server does not support empty prompt list")
            if type(request.prompt) is list and len(request.prompt) == 1:
                request.prompt = request.prompt[0]
            elif not isinstance(request.prompt, list) or not all(isinstance(x, int) for x in request.prompt):
                raise ValueError(
                    "Disaggregated server currently only supports single string prompt or list of integers in request"
                )
        return await self._send_disagg_request_ctx_first(request, hooks)

    async def openai_chat_completion(self, request: ChatCompletionRequest, hooks: Any = None) -> Any:
        if not await self.is_ready():
            raise RuntimeError("Cluster is not ready")
        return await self._send_disagg_request_ctx_first(request, hooks)

    async def is_ready(self) -> bool:
        return await self._coordinator.is_ready()

    async def setup(self) -> None:
        self._ctx_client = self._client_factory(self._ctx_router, "context")
        self._gen_client = self._client_factory(self._gen_router, "generation")
        deadline = time.monotonic() + self._server_start_timeout_secs
        while True:  # _wait_for_all_servers_ready
            _, unready_ctx = await self._ctx_client.check_ready()
            _, unready_gen = await self._gen_client.check_ready()
            if not unready_ctx and not unready_gen:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("Timeout waiting for context and generation servers to be ready")
            await asyncio.sleep(0.5)

    async def teardown(self) -> None:
        if self._ctx_client is not None:
            await self._ctx_client.shutdown()
        if self._gen_client is not None:
            await self._gen_client.shutdown()

    async def _send_disagg_request_ctx_first(self, request: UCompletionRequest, hooks: Any = None) -> Any:
        if hooks:
            hooks.on_req_begin(request)
        ctx_server = None
        disagg_request_id = await self._coordinator.get_disagg_request_id()
        if hooks:
            hooks.on_disagg_request_id(disagg_request_id)
        gen_server, need_ctx = None, True  # no conditional_disagg_config
        gen_reservation_id = None
        ctx_response = None
        gen_req = request
        if need_ctx:
            try:
                if hooks:
                    hooks.on_ctx_dispatch(request)
                ctx_req = self._get_ctx_request(request, disagg_request_id)
                ctx_server, _ = await self._ctx_router.get_next_server(
                    ctx_req, exclude_server=gen_server, req_id=disagg_request_id
                )
                ctx_response = await self._ctx_client.send_request(
                    ctx_req, server=ctx_server, hooks=hooks, req_id=disagg_request_id
                )
                await self._verify_ctx_response(ctx_response)
                ctx_response_disagg_params = ctx_response.choices[0].disaggregated_params
                if ctx_response_disagg_params.disagg_request_id is not None:
                    disagg_request_id = ctx_response_disagg_params.disagg_request_id
                    if hooks:
                        hooks.on_disagg_request_id(disagg_request_id)
                gen_req = self._get_gen_request(request, ctx_response, disagg_request_id)
            except Exception:
                if gen_server:
                    await self._gen_router.finish_request(request, success=False, req_id=gen_reservation_id)
                raise
        if ctx_response is None or self._need_gen(ctx_response):
            if not gen_server:
                gen_server, _ = await self._gen_router.get_next_server(
                    gen_req, exclude_server=ctx_server, req_id=disagg_request_id
                )
                gen_reservation_id = disagg_request_id
            return await self._gen_client.send_request(
                gen_req, server=gen_server, hooks=hooks, req_id=gen_reservation_id
            )
        if gen_server:
            await self._gen_router.finish_request(request, req_id=gen_reservation_id)
        if hooks:
            hooks.on_resp_done("", request, ctx_response)
        if request.stream:
            return done_generator()
        return ctx_response

    def _need_gen(self, response: Any) -> bool:
        if response and response.choices[0].finish_reason not in _GEN_PENDING_FINISH_REASONS:
            del response.choices[0].disaggregated_params
            return False
        return True

    @staticmethod
    def _get_conversation_id(request: UCompletionRequest) -> str | None:
        if request.conversation_params is not None:
            return request.conversation_params.conversation_id
        if request.disaggregated_params is not None:
            return request.disaggregated_params.conversation_id
        return None

    def _get_ctx_request(
        self,
        request: UCompletionRequest,
        disagg_request_id: int | None,
        context_control_endpoint: str | None = None,
    ) -> UCompletionRequest:
        conversation_id = self._get_conversation_id(request)
        return request.model_copy(
            update={
                "disaggregated_params": DisaggregatedParams(
                    request_type="context_only",
                    disagg_request_id=disagg_request_id,
                    schedule_style=self._schedule_style,
                    conversation_id=conversation_id,
                    return_prompt_token_ids_b64=self._tokids_ctxbytes,
                    context_control_endpoint=context_control_endpoint,
                ),
                "stream": False,
                "stream_options": None,
            }
        )

    def _get_gen_request(
        self, request: UCompletionRequest, ctx_response: Any, disagg_request_id: int | None
    ) -> UCompletionRequest:
        conversation_id = self._get_conversation_id(request)
        request.disaggregated_params = ctx_response.choices[0].disaggregated_params
        request.disaggregated_params.request_type = "generation_only"
        request.disaggregated_params.schedule_style = self._schedule_style
        request.disaggregated_params.conversation_id = conversation_id
        request.disaggregated_params.ctx_usage = ctx_response.usage
        if isinstance(request, CompletionRequest):
            request.prompt = ctx_response.prompt_token_ids
        elif isinstance(request, ChatCompletionRequest):
            if ctx_response.prompt_token_ids_b64 is not None:
                request.prompt_token_ids_b64 = ctx_response.prompt_token_ids_b64
            else:
                request.prompt_token_ids = ctx_response.prompt_token_ids
            if self._strip_gen_message_history and request.messages and len(request.messages) > 1:
                request.messages = request.messages[-1:]
        request.disaggregated_params.disagg_request_id = disagg_request_id
        return request

    async def _verify_ctx_response(self, ctx_response: Any) -> Any:
        if ctx_response:
            for idx, choice in enumerate(ctx_response.choices):
                if choice.disaggregated_params is None:
                    raise ValueError(
                        f"Context server choice {idx} did not return disaggregated params. "
                        f"finish_reason={choice.finish_reason!r}"
                    )
                if choice.finish_reason in _GEN_PENDING_FINISH_REASONS:
                    if choice.disaggregated_params.ctx_request_id is None:
                        raise ValueError(f"Invalid disaggregated params: ctx_request_id is None for choice {idx}.")
                    if choice.disaggregated_params.disagg_request_id is None:
                        raise ValueError(f"Invalid disaggregated params: disagg_request_id is None for choice {idx}.")
            return ctx_response


# ------------------------------------------------------------------------------------------
# Server (openai_disagg_server.py): FastAPI app, hooks, entry wrapper
# ------------------------------------------------------------------------------------------


class ServerArrivalTimeMiddleware:
    """Pure ASGI middleware stamping the arrival time into the scope's state."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope["state"] = {}
            scope["state"]["server_arrival_time"] = get_steady_clock_now_in_seconds()
        await self.app(scope, receive, send)


class RawRequestResponseHooks:
    def __init__(self, raw_req: Request, perf_metrics_collector: DisaggPerfMetricsCollector) -> None:
        self.raw_req = raw_req
        self.ctx_server = ""
        self.gen_server = ""
        self.request_arrival_time = raw_req.state.server_arrival_time
        self.server_first_token_time = 0.0
        self.ctx_dispatch_time = 0.0
        self.perf_metrics_collector = perf_metrics_collector

    def on_req_begin(self, request: Any) -> None:
        self.perf_metrics_collector.queue_latency_seconds.observe(
            get_steady_clock_now_in_seconds() - self.request_arrival_time
        )

    def on_disagg_request_id(self, disagg_request_id: int | None) -> None:
        pass

    def on_ctx_dispatch(self, request: Any) -> None:
        self.ctx_dispatch_time = get_steady_clock_now_in_seconds()

    def on_ctx_resp(self, ctx_server: str, response: Any) -> None:
        self.ctx_server = ctx_server

    def on_first_token(self, gen_server: str, request: Any, response: Any = None) -> None:
        self.gen_server = gen_server
        self.server_first_token_time = get_steady_clock_now_in_seconds()

    def on_resp_done(self, gen_server: str, request: Any, response: Any = None) -> None:
        if request.disaggregated_params:
            ctx_req_id = request.disaggregated_params.ctx_request_id
            task = asyncio.create_task(
                self.perf_metrics_collector.add_per_request_metrics(
                    self.ctx_server,
                    gen_server,
                    ctx_req_id,
                    self.raw_req.state.server_arrival_time,
                    self.server_first_token_time,
                    self.ctx_dispatch_time,
                )
            )
            background_tasks = self.perf_metrics_collector._background_tasks
            background_tasks.add(task)
            task.add_done_callback(background_tasks.discard)


def resolve_request_conversation_id(req: Any, headers: Any) -> None:
    """Body `conversation_params.conversation_id` wins; otherwise take it from a header."""
    if req.conversation_params is not None:
        return
    value = headers.get("x-conversation-id") or headers.get("conversation-id")
    if value:
        req.conversation_params = ConversationParams(conversation_id=value)


class OpenAIDisaggServer:
    def __init__(
        self,
        ctx_servers: list[str],
        gen_servers: list[str],
        req_timeout_secs: int = 180,
        server_start_timeout_secs: int = 180,
        max_retries: int = 1,
        node_id: int = 0,
    ) -> None:
        self._req_timeout_secs = req_timeout_secs
        self._max_retries = max_retries
        self._allow_request_chat_template = False
        self._perf_metrics_collector = DisaggPerfMetricsCollector(0)
        self._coordinator = DisaggCoordinatorService(ctx_servers, gen_servers, node_id)
        self._service = OpenAIDisaggregatedService(self._coordinator, self._create_client, server_start_timeout_secs)

        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
            await self._service.setup()
            yield
            await self._service.teardown()
            if self._perf_metrics_collector._background_tasks:
                await asyncio.gather(*self._perf_metrics_collector._background_tasks, return_exceptions=True)

        self.app = FastAPI(lifespan=lifespan)
        self.app.add_middleware(ServerArrivalTimeMiddleware)
        self._val_err_n = 0

        @self.app.exception_handler(RequestValidationError)
        async def validation_exception_handler(request: Request, exc: Any) -> JSONResponse:
            self._perf_metrics_collector.validation_exceptions.inc()
            self._val_err_n += 1
            if self._val_err_n == 1 or self._val_err_n % 1000 == 0:
                logger.warning(
                    f"[validation] {request.method} {request.url.path} 400 (n={self._val_err_n}): {str(exc)[:500]}"
                )
            return JSONResponse(status_code=400, content={"error": str(exc)})

        self.register_routes()

    def _create_client(self, router: RoundRobinRouter, role: str) -> OpenAIHttpClient:
        async def disagg_id_generator() -> int:
            return await self._coordinator.get_disagg_request_id()

        client = OpenAIHttpClient(
            router, role, self._req_timeout_secs, self._max_retries, disagg_id_generator=disagg_id_generator
        )
        self._perf_metrics_collector.add_client(client)
        return client

    def register_routes(self) -> None:
        self.app.add_api_route(
            "/v1/completions",
            self._wrap_entry_point(self._service.openai_completion, CompletionRequest),
            methods=["POST"],
        )
        self.app.add_api_route(
            "/v1/chat/completions",
            self._wrap_entry_point(self._service.openai_chat_completion, ChatCompletionRequest),
            methods=["POST"],
        )
        self.app.add_api_route("/health", self.health, methods=["GET"])
        self.app.add_api_route("/cluster_info", self.cluster_info, methods=["GET"])
        self.app.add_api_route("/version", self.version, methods=["GET"])

    def _wrap_entry_point(self, entry_point: Callable, request_type: type) -> Callable:
        async def wrapper(req: request_type, raw_req: Request) -> Response:  # type: ignore[valid-type]
            try:
                self._perf_metrics_collector.total_requests.inc()
                if req.stream:
                    self._perf_metrics_collector.stream_requests.inc()
                else:
                    self._perf_metrics_collector.nonstream_requests.inc()
                try:
                    ensure_request_chat_template_allowed(req, self._allow_request_chat_template)
                except ValueError as e:
                    raise HTTPException(status_code=400, detail=str(e)) from e
                resolve_request_conversation_id(req, raw_req.headers)
                hooks = RawRequestResponseHooks(raw_req, self._perf_metrics_collector)
                response_or_generator = await entry_point(req, hooks)
                self._perf_metrics_collector.total_responses.inc()
                if req.stream:
                    return StreamingResponse(content=response_or_generator, media_type="text/event-stream")
                return JSONResponse(content=response_or_generator.model_dump())
            except Exception as e:
                self._handle_exception(e)
                raise  # unreachable: _handle_exception always raises

        # FastAPI reads the annotations to bind the body model; make them concrete objects
        wrapper.__annotations__ = {"req": request_type, "raw_req": Request, "return": Response}
        return wrapper

    def _handle_exception(self, exception: Exception) -> None:
        if isinstance(exception, HTTPException):
            self._perf_metrics_collector.http_exceptions.inc()
            logger.error(f"HTTPException {exception.status_code} {exception.detail}: {traceback.format_exc()}")
            raise exception
        self._perf_metrics_collector.internal_errors.inc()
        logger.error(f"Internal server error: {traceback.format_exc()}")
        raise HTTPException(status_code=500, detail=f"Internal server error {str(exception)}")

    async def health(self) -> Response:
        if not await self._coordinator.is_ready():
            return Response(status_code=503)
        return Response(status_code=200)

    async def cluster_info(self) -> JSONResponse:
        return JSONResponse(content=await self._coordinator.cluster_info())

    async def version(self) -> JSONResponse:
        return JSONResponse(content={"version": "baseline-trtllm-style"})

    async def __call__(self, host: str, port: int, log_level: str = "warning") -> None:
        config = uvicorn.Config(
            self.app, host=host, port=port, log_level=log_level, timeout_keep_alive=10, loop="uvloop", http="httptools"
        )
        await uvicorn.Server(config).serve()


def _strip_scheme(url: str) -> str:
    return url.split("://", 1)[1] if "://" in url else url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ctx", action="append", required=True, help="context server host:port (repeat)")
    parser.add_argument("--gen", action="append", required=True, help="generation server host:port (repeat)")
    parser.add_argument("--request-timeout", type=int, default=180)
    parser.add_argument("--server-start-timeout", type=int, default=180)
    parser.add_argument("--max-retries", type=int, default=1)
    parser.add_argument(
        "--log-level",
        default="warning",
        help="uvicorn log level; 'info' turns on its per-request access log, as TensorRT-LLM's default does",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    server = OpenAIDisaggServer(
        [_strip_scheme(u) for u in args.ctx],
        [_strip_scheme(u) for u in args.gen],
        req_timeout_secs=args.request_timeout,
        server_start_timeout_secs=args.server_start_timeout,
        max_retries=args.max_retries,
        node_id=uuid.getnode() % 256,
    )
    if os.getenv("TRTLLM_DISAGG_SERVER_DISABLE_GC", "1") == "1":
        gc.disable()  # TensorRT-LLM's default for the disaggregated server
    try:
        uvloop.run(server(args.host, args.port, args.log_level))
    except KeyboardInterrupt:  # a terminal's Ctrl-C reaches the benchmark's whole group: it says so
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
