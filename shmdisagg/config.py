"""The deployment config: TensorRT-LLM's disaggregated YAML, unchanged, plus a `shmdisagg:` section.

TensorRT-LLM's keys (`tensorrt_llm/llmapi/disagg_utils.py`, `tensorrt_llm/commands/serve.py`) are
read with their names, types and defaults. Keys TensorRT-LLM passes to the executors as LLM
arguments (`kv_cache_config`, `cache_transceiver_config`, `tensor_parallel_size`, ...) are accepted
and kept, so a TensorRT-LLM config file loads as it is. Our own settings live under one optional
top-level key, `shmdisagg:` (which executors the launcher starts, the shared-memory table, request
limits).

`load_config(path)` raises `ConfigError` whose message is one line naming the key and the problem.
"""

from __future__ import annotations

import difflib
import errno
import functools
import ipaddress
import math
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from shmdisagg.procutil import listen_addr
from shmdisagg.shm.layout import MAX_SERVERS_LIMIT, check_max_servers, servers_for

ROUTER_TYPES = ("round_robin", "load_balancing", "kv_cache_aware", "conversation")
_URL = re.compile(r"^(?:https?://)?(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):(?P<port>[0-9]{1,5})/?$")
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_\-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?$")
_WILDCARDS = ("0.0.0.0", "::")
INDEX_MAX_SLOTS = 1 << 32  # the native index's largest capacity (shm/index.py index_size)


def _url_problem(url: str) -> str | None:
    """Why `url` is not an executor's `host:port` (`http://` and a trailing `/` allowed), or None."""
    if url.startswith("https://"):
        # TensorRT-LLM's router would speak TLS to it (`Router._ensure_url` keeps the scheme);
        # the fleet's executor client speaks plain HTTP on this host
        return f"{url!r}: https executors are not supported (plain HTTP on this host); write host:port"
    m = _URL.match(url)
    if not m:
        return f"{url!r} is not host:port"
    if not 0 < int(m["port"]) < 65536:
        return f"{url!r}: the port must be 1-65535"
    return None


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the key and the problem.

    `problems` lists every problem found, one line each (the message is the first, with a
    count of the others); `check-config` and the commands that start a deployment print them all.
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems) if problems else [message]


class KeyedError(ValueError):
    """Raised by a validator about another key than the one it validates: `key` (dotted, relative
    to the model that raises it) is what the one-line message names."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def is_host(host: str) -> bool:
    """Whether `host` is a host name or an IP address (IPv6 without brackets), as a listener's
    bind address is given."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_HOSTNAME.match(host))


def _endpoint(host: str, port: int) -> tuple[str, int]:
    """host:port as compared for "is this the same listener": IP addresses in one spelling,
    `localhost` as 127.0.0.1, names in lower case."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        host = ipaddress.ip_address(host).compressed
    except ValueError:
        pass
    return host, port


def _same_listener(a: tuple[str, int], b: tuple[str, int]) -> bool:
    return a[1] == b[1] and (a[0] == b[0] or a[0] in _WILDCARDS or b[0] in _WILDCARDS)


def _no_bool(v: Any) -> Any:
    """A numeric option given as true/false (pydantic would read it as 1 or 0) is a mistake."""
    if isinstance(v, bool):
        raise ValueError(f"must be a number, got {str(v).lower()}")
    return v


# TensorRT-LLM's sizes (batch, tokens, block size) are SizeType32 in its executor: a larger value
# cannot reach an executor (the simulator's msgpack answers overflowed on one)
INT32_MAX = 2**31 - 1


class _Strict(BaseModel):
    # no nan or inf in a float setting: a timeout, TTL or speed-up of inf never fires or divides to
    # zero, and nan compares false with every bound (load_cap keeps inf as its default, "no cap")
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RouterConfig(_Strict):
    """`router: {type: ..., <args>}` of one role. Args TensorRT-LLM defines for each type.

    Sources: TensorRT-LLM `serve/router.py` (`create_router`, `KvCacheAwareRouter`,
    `ConversationRouter`).
    """

    type: Literal["round_robin", "load_balancing", "kv_cache_aware", "conversation"] = "round_robin"
    use_tokens: bool = False
    # kv_cache_aware
    max_batch_size: int = Field(64, ge=1, le=INT32_MAX)
    max_num_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    tokens_per_block: int | None = Field(None, ge=1, le=INT32_MAX)
    load_weight: float = Field(0.25, ge=0)
    load_cap: float = Field(float("inf"), gt=0)
    track_routed_blocks: bool = True
    tokenizer_dir: str | None = None
    custom_tokenizer: str | None = None
    model_path: str | None = None
    use_harmony: bool = False
    # conversation
    match_threshold: float = Field(0.75, ge=0, le=1)
    use_token_ids: bool = False
    hash_skip_count: int = Field(0, ge=0)
    max_sessions: int = Field(100_000, ge=1)


class ServerSection(BaseModel):
    """`context_servers` / `generation_servers`. Unknown keys are LLM arguments for the executors."""

    model_config = ConfigDict(extra="allow", frozen=True)

    num_instances: int = Field(1, ge=0)
    urls: list[str] = Field(default_factory=list)
    router: RouterConfig = Field(default_factory=RouterConfig)
    max_batch_size: int | None = Field(None, ge=1, le=INT32_MAX)
    max_num_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    kv_cache_config: dict[str, Any] = Field(default_factory=dict)

    _numbers = field_validator("max_batch_size", "max_num_tokens", mode="before")(_no_bool)

    @field_validator("kv_cache_config")
    @classmethod
    def _check_kv_cache_config(cls, kv: dict[str, Any]) -> dict[str, Any]:
        # read by the launcher (the simulator's --tokens-per-block) and the kv_cache_aware router
        if "tokens_per_block" in kv:
            tpb = kv["tokens_per_block"]
            if isinstance(tpb, bool) or not isinstance(tpb, int) or tpb < 1:
                raise KeyedError("tokens_per_block", f"must be a positive integer, got {tpb!r}")
            if tpb > INT32_MAX:
                raise KeyedError("tokens_per_block", f"must be at most {INT32_MAX}, got {tpb!r}")
        return kv

    @field_validator("urls")
    @classmethod
    def _check_urls(cls, urls: list[str]) -> list[str]:
        seen: dict[tuple[str, int], str] = {}
        problems = []  # every bad url of the list, in one message
        for url in urls:
            problem = _url_problem(url)
            if problem is None:
                m = _URL.match(url)
                assert m is not None
                ep = _endpoint(m["host"], int(m["port"]))
                if ep in seen:
                    same = "" if seen[ep] == url else f" (as {seen[ep]!r})"
                    problem = f"{url!r} is listed twice{same}: one executor per url"
                seen[ep] = url
            if problem is not None:
                problems.append(problem)
        if problems:
            raise ValueError("; ".join(problems))
        return urls

    @model_validator(mode="before")
    @classmethod
    def _infer_count(cls, data: Any) -> Any:
        # TensorRT-LLM requires num_instances == len(urls); we infer it when it is left out.
        if isinstance(data, dict) and "num_instances" not in data and isinstance(data.get("urls"), list):
            return {**data, "num_instances": len(data["urls"])}
        return data

    @model_validator(mode="after")
    def _check_count(self) -> ServerSection:
        if self.urls and len(self.urls) != self.num_instances:
            raise ValueError(f"{len(self.urls)} urls but num_instances is {self.num_instances}")
        return self

    def endpoints(self) -> list[tuple[str, tuple[str, int]]]:
        """(url, normalised host:port) of each url, for telling two urls of one listener."""
        return [(url, _endpoint(host, port)) for url, (host, port) in zip(self.urls, self.addresses(), strict=True)]

    def addresses(self) -> list[tuple[str, int]]:
        """The section's executors as (host, port), scheme stripped."""
        out = []
        for url in self.urls:
            m = _URL.match(url)
            assert m is not None  # validated above
            out.append((m["host"].strip("[]"), int(m["port"])))
        return out

    def router_args(self, environ: Mapping[str, str] = os.environ) -> RouterConfig:
        """The router args as TensorRT-LLM's router sees them.

        `extract_router_config` (`llmapi/disagg_utils.py` @0228a712, id 54588247121) copies the
        section's `max_batch_size` and `max_num_tokens` over the router's own (the section wins
        when it sets them), and `kv_cache_config.tokens_per_block` unless the router set
        `tokens_per_block`. Then `TRTLLM_KVCACHE_AWARE_ROUTER_HASH_TOKENS_PER_BLOCK`, when set,
        overrides `tokens_per_block` of a `kv_cache_aware` or `conversation` router
        (`serve/router_utils.py` @00d403d7 `BlockHashMixin._init_block_hashing`, which both call).
        `max_num_tokens` has no effect on routing (TensorRT-LLM's router ignores it too). Raises
        ConfigError naming the variable when it is not a positive integer."""
        updates: dict[str, Any] = {}
        if self.max_batch_size:
            updates["max_batch_size"] = self.max_batch_size
        if self.max_num_tokens:
            updates["max_num_tokens"] = self.max_num_tokens
        tpb = self.kv_cache_config.get("tokens_per_block")
        if "tokens_per_block" not in self.router.model_fields_set and isinstance(tpb, int):
            updates["tokens_per_block"] = tpb
        if self.router.type in ("kv_cache_aware", "conversation"):
            env_tpb = env_tokens_per_block(environ)
            if env_tpb is not None:
                updates["tokens_per_block"] = env_tpb
        return self.router.model_copy(update=updates)


HASH_TOKENS_PER_BLOCK_ENV = "TRTLLM_KVCACHE_AWARE_ROUTER_HASH_TOKENS_PER_BLOCK"


def env_tokens_per_block(environ: Mapping[str, str] = os.environ) -> int | None:
    """`TRTLLM_KVCACHE_AWARE_ROUTER_HASH_TOKENS_PER_BLOCK` as an int, None when unset. Raises
    ConfigError (naming the variable) for anything but a positive integer, where TensorRT-LLM's
    `int()` would raise a ValueError or take a value no block size can have."""
    raw = environ.get(HASH_TOKENS_PER_BLOCK_ENV)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(
            f"{HASH_TOKENS_PER_BLOCK_ENV}: {raw!r} is not a positive integer (the router's tokens_per_block)"
        )
    return value


class ConditionalDisaggConfig(_Strict):
    max_local_prefill_length: int = Field(0, ge=0)


class SimSettings(_Strict):
    """Simulator options for every executor the launcher starts (see executors/sim/README.md)."""

    profile: str = "h100-sxm-llama-3.1-8b"

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, name: str) -> str:
        from shmdisagg.executors.sim.profiles import PROFILES

        if name not in PROFILES:
            raise ValueError(f"unknown simulator profile {name!r}; known: {', '.join(sorted(PROFILES))}")
        return name

    num_blocks: int = Field(8192, ge=1, le=INT32_MAX)
    tokens_per_block: int = Field(32, ge=1, le=INT32_MAX)
    max_batch_size: int = Field(64, ge=1, le=INT32_MAX)
    max_num_tokens: int = Field(8192, ge=1, le=INT32_MAX)
    speedup: float = Field(1.0, gt=0)
    extra_args: list[str] = Field(default_factory=list)

    _numbers = field_validator(
        "num_blocks", "tokens_per_block", "max_batch_size", "max_num_tokens", "speedup", mode="before"
    )(_no_bool)


class TrtllmSettings(_Strict):
    """How `shmdisagg launch` runs `trtllm-serve` (backend `trtllm`); see docs/deploy.md.

    What each instance serves (parallel sizes, `kv_cache_config`, `cache_transceiver_config`,
    `max_batch_size`, ...) is written in TensorRT-LLM's own keys in `context_servers` /
    `generation_servers`; these are only the settings TensorRT-LLM's file has no place for.
    """

    command: list[str] = Field(default_factory=lambda: ["trtllm-serve"], min_length=1)
    backend: Literal["pytorch", "tensorrt", "_autodeploy"] | None = (
        None  # --backend; default: top-level `backend`, else pytorch
    )
    log_level: Literal["internal_error", "error", "warning", "info", "verbose", "debug", "trace"] = "info"
    extra_llm_api_options: dict[str, Any] = Field(default_factory=dict)  # merged into every instance's YAML
    env: dict[str, str] = Field(default_factory=dict)  # extra environment for every instance
    extra_args: list[str] = Field(default_factory=list)  # appended to every command line


class ExecutorsSection(_Strict):
    """Which executors `shmdisagg launch` starts, one per url of each section.

    `gpus` (backend `trtllm`): the node's GPUs the instances get, handed out in this order,
    context instances first, tensor x pipeline x context parallel size each. Unset: the
    launcher's `CUDA_VISIBLE_DEVICES` if set, else 0, 1, 2, ...
    """

    backend: Literal["sim", "trtllm"] = "sim"
    model: str = (
        "sim-llama-3.1-8b"  # what the executors serve; never empty (the simulator would serve its profile's name)
    )
    startup_timeout_s: float = Field(180.0, gt=0)
    stop_timeout_s: float = Field(15.0, gt=0)
    log_dir: str | None = None
    gpus: list[int | str] | None = None
    sim: SimSettings = Field(default_factory=SimSettings)
    trtllm: TrtllmSettings = Field(default_factory=TrtllmSettings)

    @field_validator("model")
    @classmethod
    def _check_model(cls, model: str) -> str:
        if not model.strip():
            raise ValueError(
                "must not be empty: the model the executors serve (a Hugging Face name or a checkpoint path)"
            )
        return model

    @field_validator("gpus")
    @classmethod
    def _check_gpus(cls, gpus: list[int | str] | None) -> list[int | str] | None:
        if gpus is None:
            return None
        seen: set[str] = set()
        for gpu in gpus:
            name = str(gpu).strip()
            if not name or (isinstance(gpu, int) and gpu < 0) or "," in name:
                raise ValueError(f"{gpu!r} is not a GPU id (an index or a UUID)")
            if name in seen:
                raise ValueError(f"GPU {name} is listed twice; instances must not share a GPU")
            seen.add(name)
        return gpus


class IndexSection(_Strict):
    """The shared KV block index (slots of 32 B beside a table of 64 servers, 16 + 16 x max_servers / 64
    B beside a wider one; a resize briefly holds two generations)."""

    capacity: int = Field(1 << 16, ge=64, le=INDEX_MAX_SLOTS)
    max_capacity: int = Field(1 << 22, ge=64, le=INDEX_MAX_SLOTS)
    routed_ttl_s: float = Field(120.0, gt=0)

    @field_validator("capacity", "max_capacity")
    @classmethod
    def _pow2(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError("must be a power of two")
        return v

    @model_validator(mode="after")
    def _capacity_within_max(self) -> IndexSection:
        if self.capacity > self.max_capacity:
            raise KeyedError("capacity", f"{self.capacity} exceeds max_capacity ({self.max_capacity})")
        return self


class KvEventsSection(_Strict):
    """How the coordinator drains the executors' KV events (`coordinator/kv_events.py`): at once
    when a fleet worker hints that a server has new events, plus a fallback poll."""

    hints: bool = True  # fleet workers send a poll hint when a leg ends (a datagram to the coordinator)
    busy_poll_s: float = Field(0.02, gt=0)  # fallback poll while events keep coming without hints
    idle_poll_s: float = Field(0.2, gt=0)  # fallback poll of a quiet server, no hints flowing
    hinted_poll_s: float = Field(1.0, gt=0)  # fallback poll while hints flow for that server


class ShmSection(_Strict):
    """The shared-memory table. `prefix` names the segments (`/dev/shm/<prefix>-ctl`, ...).

    `max_servers`: the table's server slots, a multiple of 64 up to 256 (every server set in the
    table and the KV index is that many bits wide). Unset: the executors listed, rounded up to
    64, at least 64; with `disagg_cluster` or `-m` (executors that register themselves) 64, so
    set it there to route to more (registrations past it wait for a free slot). More than 64
    costs a little per pick and index slots of 16 + 16 x max_servers / 64 bytes instead of 32
    (BENCHMARKS.md, "The cost of one pick by executor count")."""

    prefix: str | None = Field(None, pattern=r"^[A-Za-z0-9_.\-]{1,24}$")
    max_workers: int = Field(128, ge=1, le=1024)
    max_servers: int | None = None

    @field_validator("max_servers")
    @classmethod
    def _check_max_servers(cls, v: int | None) -> int | None:
        return None if v is None else check_max_servers(v)


class ShmdisaggSection(_Strict):
    # every duration and count here is finite: `.inf` would turn a timer off unnoticed (an
    # infinite health_check_interval_s probes once, then never again)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    executors: ExecutorsSection | None = None
    shm: ShmSection = Field(default_factory=ShmSection)
    index: IndexSection = Field(default_factory=IndexSection)
    kv_events: KvEventsSection = Field(default_factory=KvEventsSection)
    request_timeout_s: float = Field(180.0, gt=0)
    # On SIGTERM/Ctrl-C a fleet worker stops accepting connections and lets requests in flight
    # run this many seconds (uvicorn's timeout_graceful_shutdown), then ends the rest with a 503
    # (an SSE error event and [DONE] for a started stream). The coordinator's and the launcher's
    # waits before a SIGKILL grow by as much.
    timeout_graceful_shutdown_s: float = Field(5.0, ge=0)
    # A fleet worker whose row has not heart-beaten (every 0.25 s) for this long is stuck (a
    # blocked event loop, SIGSTOP) while the kernel still queues connections on its share of the
    # port: the coordinator kills and replaces it (gunicorn's worker `timeout`). 0 turns it off.
    worker_timeout_s: float = Field(10.0, ge=0)
    server_start_timeout_s: float = Field(180.0, gt=0)
    health_check_interval_s: float = Field(0.5, gt=0)
    # One GET /health (and /server_info, /v1/models) may take this long (TensorRT-LLM's
    # `health_check_timeout`, 5 s, of its metadata-server monitor); `health_check_failures`
    # failed probes in a row (upstream checks twice) with no leg answered meanwhile mark a
    # server unhealthy (coordinator/health.py)
    health_check_timeout_s: float = Field(5.0, gt=0)
    health_check_failures: int = Field(2, ge=1)
    # The hot routes' body limit (asgi.read_body), also enforced by the public port's protocol:
    # a declared Content-Length above it is answered 413 before the body is read, a chunked body
    # as soon as it passes it (fleet/edge.py).
    max_request_body_bytes: int = Field(32 << 20, ge=1024)
    # Connection hygiene at the public port (fleet/edge.py), per connection. The whole request
    # head must arrive within client_header_timeout_s of the connection's opening (or of the
    # first byte of a later request on it), else 408: nginx's client_header_timeout (60 s) and
    # Apache's RequestReadTimeout header=20-40 bracket it. The whole body must arrive within
    # client_body_timeout_s of the head's end, else 408: nginx's client_body_timeout default
    # (60 s, which nginx applies between two reads, here to the whole body: a 100k-token prompt,
    # about 0.5 MB of JSON, then needs under 10 kB/s).
    client_header_timeout_s: float = Field(30.0, gt=0)
    client_body_timeout_s: float = Field(60.0, gt=0)
    # Open connections per fleet worker; one more is answered 503 with Retry-After. gunicorn's
    # worker_connections (1000) and nginx's (512 built in, 1024 in its stock nginx.conf) are per
    # worker too; a few times theirs here, because a streamed completion holds its connection
    # for its whole generation (seconds to minutes) where theirs mostly serve milliseconds. A
    # worker raises its soft RLIMIT_NOFILE to the hard limit and, if 2 descriptors per
    # connection plus 256 do not fit under it, serves fewer (logged at start).
    worker_connections: int = Field(4096, ge=1)
    max_inflight_requests: int = Field(0, ge=0)  # per deployment; 0 = unbounded
    breaker_failures: int = Field(3, ge=1)  # consecutive request failures that open a server's breaker
    breaker_cooldown_s: float = Field(2.0, gt=0)
    coordinator_socket: str | None = None
    # TensorRT-LLM's level names (`tensorrt_llm/logger.py`); -l/--log_level and TLLM_LOG_LEVEL win
    log_level: Literal["trace", "debug", "verbose", "info", "warning", "error", "internal_error"] = "info"

    _numbers = field_validator(
        "timeout_graceful_shutdown_s",
        "worker_timeout_s",
        "health_check_timeout_s",
        "health_check_failures",
        "client_header_timeout_s",
        "client_body_timeout_s",
        "worker_connections",
        "max_request_body_bytes",
        mode="before",
    )(_no_bool)


class MinimalInstances(_Strict):
    """`disagg_cluster.minimal_instances`: how many prepared servers of each role make the
    deployment ready (TensorRT-LLM `llmapi/disagg_utils.py` @0228a712 `MinimalInstances`;
    `DisaggClusterManager.is_ready_with_router` in `serve/disagg_auto_scaling.py`)."""

    context_servers: StrictInt = Field(1, ge=0)
    generation_servers: StrictInt = Field(1, ge=0)


CLUSTER_SCHEMES = ("etcd://", "http://")


class DisaggClusterConfig(_Strict):
    """`disagg_cluster` (TensorRT-LLM `llmapi/disagg_utils.py` @0228a712 `DisaggClusterConfig`):
    executors register themselves at `cluster_uri` and heart-beat; the coordinator watches.

    `cluster_uri`: `etcd://host:port` (several, comma-separated: endpoints of one etcd cluster,
    as `Etcd3ClusterStorage._connect` in `serve/cluster_storage.py` @057d4a79 splits them), or
    `http://host:port`, the store the deployment serves itself on its public port (the port must
    be the public one, where workers find it). `cluster_name` namespaces the keys
    (`/trtllm-disagg/{cluster_name}/workers/...`). `heartbeat_interval_sec` and
    `inactive_timeout_sec` (seconds) are the workers' heartbeat and TTL: the simulator the
    launcher starts uses them; `trtllm-serve` workers read their own copy of the key.
    """

    cluster_uri: str
    cluster_name: str = ""
    minimal_instances: MinimalInstances = Field(default_factory=MinimalInstances)
    heartbeat_interval_sec: StrictInt = Field(5, ge=0)
    inactive_timeout_sec: StrictInt = Field(10, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        # TensorRT-LLM's update_dataclass keeps a field's default where the value is None
        if isinstance(data, dict):
            out = {k: v for k, v in data.items() if v is not None}
            if isinstance(out.get("minimal_instances"), dict):
                out["minimal_instances"] = {k: v for k, v in out["minimal_instances"].items() if v is not None}
            return out
        return data

    @field_validator("cluster_uri")
    @classmethod
    def _check_uri(cls, uri: str) -> str:
        parts = [u.strip() for u in uri.split(",")]
        if uri.startswith("https://"):
            raise ValueError(
                f"{uri!r}: an https cluster store is not supported (the deployment serves it on its public port, "
                "which speaks plain HTTP); use http://HOST:PORT or an etcd:// uri"
            )
        if not uri.startswith(CLUSTER_SCHEMES):
            raise ValueError(f"{uri!r} is not an etcd://host:port or http://host:port uri")
        scheme = "etcd://" if uri.startswith("etcd://") else "http://"
        if scheme == "http://" and len(parts) > 1:
            raise ValueError(f"{uri!r}: one http:// store only")
        for part in parts:
            body = part.removeprefix(scheme)
            m = _URL.match(body)
            if not part.startswith(scheme) or not m or not 0 < int(m["port"]) < 65536:
                raise ValueError(f"{part!r} is not {scheme}host:port")
        return uri

    @property
    def is_etcd(self) -> bool:
        return self.cluster_uri.startswith("etcd://")

    def endpoints(self) -> list[tuple[str, int]]:
        """The uri's (host, port) pairs, in the order given."""
        out = []
        for part in self.cluster_uri.split(","):
            m = _URL.match(part.strip().split("://", 1)[1])
            assert m is not None  # validated
            out.append((m["host"].strip("[]"), int(m["port"])))
        return out


class OtlpConfig(_Strict):
    """`otlp_config` (TensorRT-LLM `llmapi/disagg_utils.py` `OtlpConfig`): where each fleet
    worker exports its OpenTelemetry spans (`shmdisagg/tracing.py`)."""

    otlp_traces_endpoint: str | None = None


class DisaggConfig(BaseModel):
    """The whole config file. Top-level keys TensorRT-LLM inherits into both sections (`model`,
    `backend`, ...) are accepted as extras."""

    model_config = ConfigDict(extra="allow", frozen=True)

    hostname: str = "localhost"
    # 0: the kernel picks the port, which `shmdisagg serve --report_addr PATH` writes to PATH
    # (TensorRT-LLM's newer trtllm-serve disaggregated; a single server only, see _check_port)
    port: StrictInt = Field(8000, ge=0, le=65535)
    num_workers: StrictInt = Field(1, ge=1, le=64)
    context_servers: ServerSection = Field(default_factory=ServerSection)
    generation_servers: ServerSection = Field(default_factory=ServerSection)
    max_retries: StrictInt = Field(1, ge=0)
    schedule_style: Literal["context_first", "generation_first"] = "context_first"
    conditional_disagg_config: ConditionalDisaggConfig | None = None
    # the request id's node field, claimed host-wide at start (node_ids.py); unset: the first free
    # id from TensorRT-LLM's default uuid.getnode() % 256 upward
    node_id: StrictInt | None = Field(None, ge=0, lt=256)
    server_keep_alive_timeout: int = Field(10, ge=1)
    perf_metrics_max_requests: int = Field(0, ge=0)
    return_perf_metrics: bool = False
    # per-request JSONL records (metrics/jsonl.py) and OpenTelemetry spans (tracing.py)
    perf_metrics_output_dir: str | None = None
    otlp_config: OtlpConfig | None = None
    gen_tokids_ctxbytes: bool = False
    gen_strip_message_history: bool = False
    allow_request_chat_template: bool = False
    # HMAC key signing the context executor's handoff on generation legs (shmdisagg/orchestrator/wire.py)
    internal_request_auth_key: str | None = Field(None, min_length=1)
    disagg_coordinator_url: str | None = None
    # service discovery: executors register at disagg_cluster.cluster_uri (shmdisagg/cluster/)
    disagg_cluster: DisaggClusterConfig | None = None
    shmdisagg: ShmdisaggSection = Field(default_factory=ShmdisaggSection)
    # the keys the file itself sets: "" the top level's, a section's name its own (parse_config)
    _given: dict[str, frozenset[str]] = PrivateAttr(default_factory=dict)

    def key_of(self, section: str, dotted: str) -> str:
        """The key to name in a message about `dotted` of `section` ("context_servers"): the
        top level's where the section inherits it from there (`kv_cache_config.tokens_per_block`,
        not `context_servers.kv_cache_config.tokens_per_block`, which the file does not set)."""
        return _named(section, dotted, self._given.get("", ()), self._given.get(section, ()))

    @field_validator("allow_request_chat_template", "return_perf_metrics", mode="before")
    @classmethod
    def _real_bool(cls, v: Any) -> Any:
        if not isinstance(v, bool):
            raise ValueError("must be true or false")
        return v

    @field_validator("hostname")
    @classmethod
    def _check_hostname(cls, host: str) -> str:
        if not is_host(host):
            raise ValueError(f"{host!r} is not a host name or IP address")
        return host

    @model_validator(mode="after")
    def _check_supported(self) -> DisaggConfig:
        # disagg_coordinator_url and the other _REFUSED_KEYS are refused before validation (_refusals)
        model = (self.model_extra or {}).get("model")
        # TensorRT-LLM's top-level `model` (inherited by both roles): a name or a path, never empty
        if model is not None and (not isinstance(model, str) or not model.strip()):
            raise KeyedError(
                "model", f"must be a non-empty string (a Hugging Face name or a checkpoint path), got {model!r}"
            )
        return self

    @model_validator(mode="after")
    def _check_executors(self, info: ValidationInfo) -> DisaggConfig:
        """Each role lists at least one executor (the coordinator waits for a healthy one of
        each); no url is the public address or listed in both roles. With `disagg_cluster`, or
        a metadata server (`-m`: the validation context's `metadata_server`), the executors
        register themselves instead and urls are refused."""
        if self.disagg_cluster is not None:
            return self._check_cluster()
        if (info.context or {}).get("metadata_server"):
            for key in ("context_servers", "generation_servers"):
                if getattr(self, key).urls:
                    raise KeyedError(
                        f"{key}.urls",
                        "not used with -m/--metadata_server_config_file (the executors register in the metadata "
                        "server, whose list TensorRT-LLM's routers use instead): remove them",
                    )
            return self
        absent = [key for key in ("context_servers", "generation_servers") if key not in self.model_fields_set]
        if len(absent) == 2:  # one line for both: mending one must not reveal the other
            raise KeyedError(
                "context_servers, generation_servers",
                "both missing; a deployment needs at least one executor of each role: list them under "
                "context_servers.urls and generation_servers.urls as host:port",
            )
        for key in ("context_servers", "generation_servers"):
            role = key.split("_")[0]
            if getattr(self, key).urls:
                continue
            if key in absent:
                near = difflib.get_close_matches(key, list(self.model_extra or {}), n=1, cutoff=0.8)
                hint = f" (is {near[0]!r} a misspelling of it?)" if near else ""
                raise KeyedError(
                    key,
                    f"missing{hint}; a deployment needs at least one {role} executor: list it under {key}.urls "
                    "as host:port",
                )
            raise KeyedError(f"{key}.urls", f"none listed; a deployment needs at least one {role} executor (host:port)")
        public = _endpoint(self.hostname, self.port)
        context = dict((ep, url) for url, ep in self.context_servers.endpoints())
        for key, section in (
            ("context_servers", self.context_servers),
            ("generation_servers", self.generation_servers),
        ):
            for url, ep in section.endpoints():
                if _same_listener(ep, public):
                    raise KeyedError(
                        f"{key}.urls",
                        f"{url!r} is the public address (hostname:port {self.hostname}:{self.port}) the fleet "
                        "listens on",
                    )
                if key == "generation_servers":
                    clash = next((c for c_ep, c in context.items() if _same_listener(ep, c_ep)), None)
                    if clash is not None:
                        raise KeyedError(
                            f"{key}.urls",
                            f"{url!r} is also a context_servers url ({clash!r}): an executor serves one role",
                        )
        return self

    def _check_cluster(self) -> DisaggConfig:
        """With `disagg_cluster` the executors register themselves: TensorRT-LLM ignores the
        sections' `urls` then (`extract_disagg_cfg` builds no server configs), so listed urls
        would be a silent no-op and are refused; `num_instances` is how many executors of the
        role `shmdisagg launch` starts (each registers itself). An `http://` store is served on
        the public port, so its port must be that one."""
        cluster = self.disagg_cluster
        assert cluster is not None
        for key in ("context_servers", "generation_servers"):
            if getattr(self, key).urls:
                raise KeyedError(
                    f"{key}.urls",
                    "not used with disagg_cluster (executors register themselves at disagg_cluster.cluster_uri; "
                    "TensorRT-LLM ignores these urls): remove them",
                )
        if not cluster.is_etcd and self.port != 0 and cluster.endpoints()[0][1] != self.port:
            raise KeyedError(
                "disagg_cluster.cluster_uri",
                f"{cluster.cluster_uri!r}: the http cluster store is served on the public port ({self.port}), "
                "where workers register: give that port",
            )
        return self

    @model_validator(mode="after")
    def _check_conditional_disagg(self) -> DisaggConfig:
        """`conditional_disagg_config` decides on the generation router's KV match, so TensorRT-LLM
        asserts that router is `kv_cache_aware` (`_check_conditional_disagg` in
        `tensorrt_llm/serve/openai_disagg_service.py`); here the same config is refused by name
        instead of failing on the first request."""
        router = self.generation_servers.router
        kind = router.type if router is not None else None
        if self.conditional_disagg_config is not None and kind != "kv_cache_aware":
            raise KeyedError(
                "conditional_disagg_config",
                f"needs a kv_cache_aware generation router (generation_servers.router.type is "
                f"{kind or 'round_robin'}): set it, or remove conditional_disagg_config",
            )
        return self

    @model_validator(mode="after")
    def _check_port(self) -> DisaggConfig:
        """Port 0 only for one fleet worker: TensorRT-LLM publishes the bound address of a single
        self-contained server only (`test_disaggregated_rejects_a_worker_fleet`, test id
        57374853910)."""
        if self.port == 0 and self.num_workers > 1:
            raise KeyedError(
                "port",
                f"0 (a port the kernel picks) needs num_workers: 1, not {self.num_workers}: "
                "TensorRT-LLM reports the address of a single self-contained disaggregated server only",
            )
        return self

    @model_validator(mode="after")
    def _check_fleet_room(self) -> DisaggConfig:
        """Every fleet worker needs a row in the table, and both coordinator sockets a path the
        kernel accepts (an existing directory, at most 107 bytes with the `.kvhint` suffix)."""
        rows = self.shmdisagg.shm.max_workers
        if rows < self.num_workers:
            raise KeyedError(
                "shmdisagg.shm.max_workers",
                f"{rows} is fewer than num_workers ({self.num_workers}): each fleet worker needs a row",
            )
        slots, listed = (
            self.shmdisagg.shm.max_servers,
            len(self.context_servers.urls) + len(self.generation_servers.urls),
        )
        if slots is not None and slots < listed:
            raise KeyedError(
                "shmdisagg.shm.max_servers",
                f"{slots} is fewer than the {listed} executors listed: each needs a server slot "
                "(a multiple of 64; or leave it unset)",
            )
        path = self.shmdisagg.coordinator_socket
        if path is not None:
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                raise KeyedError("shmdisagg.coordinator_socket", f"directory {parent} does not exist")
            if len(os.fsencode(path + ".kvhint")) > 107:
                raise KeyedError(
                    "shmdisagg.coordinator_socket",
                    f"{path!r} is too long for a Unix socket path (at most {107 - len('.kvhint')} bytes)",
                )
        return self

    @property
    def max_servers(self) -> int:
        """The control table's server slots: `shmdisagg.shm.max_servers`, else room for the
        executors listed (a multiple of 64, at least 64; 64 where none are listed)."""
        configured = self.shmdisagg.shm.max_servers
        listed = len(self.context_servers.urls) + len(self.generation_servers.urls)
        return configured if configured is not None else servers_for(listed)

    @property
    def shm_prefix(self) -> str:
        """Shared-memory name prefix: configured, else `shmdisagg-<uid>-<port>`."""
        return self.shmdisagg.shm.prefix or f"shmdisagg-{os.getuid()}-{self.port}"

    @property
    def coordinator_socket(self) -> str:
        """Path of the coordinator's internal API Unix socket."""
        return self.shmdisagg.coordinator_socket or f"/tmp/{self.shm_prefix}.sock"

    @property
    def kv_hint_socket(self) -> str:
        """Path of the coordinator's Unix datagram socket for fleet workers' KV poll hints."""
        return self.coordinator_socket + ".kvhint"


def _error_line(error: Any) -> str:
    """One pydantic error as `dotted.key: message`."""
    keyed = (error.get("ctx") or {}).get("error")
    parts = [*error["loc"], *(keyed.key.split(".") if isinstance(keyed, KeyedError) else ())]
    loc = ".".join(str(p) for p in parts) or "(top level)"
    msg = error["msg"].removeprefix("Value error, ")
    if error["type"] == "model_type":  # "... a valid dictionary or instance of ServerSection": our class name
        got = error["input"]
        msg = f"must be a mapping of keys, not {'null (an empty value)' if got is None else repr(got)}"
    return f"{loc}: {msg}"


MAX_EXECUTORS = MAX_SERVERS_LIMIT  # the widest table's server sets (shmdisagg.shm.max_servers)

# TensorRT-LLM config keys shmdisagg refuses before anything else is checked: key -> what to do.
_REFUSED_KEYS = {
    "disagg_coordinator_url": "an external coordinator is not supported: shmdisagg runs its own on this host; "
    "remove the key",
    "multimodal_servers": "multimodal encoder servers (EPD) are not supported: shmdisagg has no encoder leg; "
    "remove the section and serve through context_servers and generation_servers",
    "conversation_affinity_header_for_subagents": "sub-agent parent-session affinity is not supported (requests "
    "route by their own "
    "conversation id under router type conversation); remove the key",
    "subagent_affinity_scope": "sub-agent parent-session affinity is not supported; remove the key",
    "bind_host": "a bind address apart from the advertised hostname is not supported; set hostname to the "
    "address to listen on and remove bind_host",
}


def _refusals(data: dict[str, Any]) -> list[str]:
    """Problems found in the raw document: TensorRT-LLM keys refused by name, and more
    executors than the shared table can tell apart."""
    out = [f"{key}: {why}" for key, why in _REFUSED_KEYS.items() if data.get(key) is not None]
    counts: dict[str, int] = {}
    for key in ("context_servers", "generation_servers"):
        section = data.get(key)
        urls = section.get("urls") if isinstance(section, dict) else None
        counts[key] = len(urls) if isinstance(urls, list) else 0
    out += [
        f"{key}: {value} is no value TensorRT-LLM can use (an executor's LLM argument)"
        for key, value in _llm_arg_non_finite(data)
    ]
    total = sum(counts.values())
    if total > MAX_EXECUTORS:
        out.append(
            f"context_servers.urls/generation_servers.urls: {total} executors ({counts['context_servers']} context + "
            f"{counts['generation_servers']} generation), more than the {MAX_EXECUTORS} one deployment can route to "
            "(the widest shared table's server sets); split them over deployments"
        )
    return out


def _llm_arg_non_finite(data: dict[str, Any]) -> list[tuple[str, float]]:
    """(dotted key, value) of the executors' LLM arguments (the top level's and each section's
    keys that are no setting of ours) whose value is nan or inf: YAML's `.nan` and `.inf` pass
    TensorRT-LLM's float fields (pydantic allows them there), nan compares false with every
    limit and inf is no size, fraction or timeout. Ours refuse them already (`allow_inf_nan`)."""
    ours = {*DisaggConfig.model_fields, "context_servers", "generation_servers"}
    found: list[tuple[str, float]] = []

    def walk(value: Any, key: str) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            found.append((key, value))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{key}.{i}")

    for key, value in data.items():
        if key not in ours:
            walk(value, str(key))
    for role in ("context_servers", "generation_servers"):
        section = data.get(role)
        if isinstance(section, dict):
            for key, value in section.items():
                if key not in _SECTION_ONLY:
                    walk(value, f"{role}.{key}")
    return found


def parse_config(data: Any, source: str = "config", *, metadata_server: bool = False) -> DisaggConfig:
    """Validate a loaded YAML document. Raises `ConfigError` (one line: file, key, problem;
    `problems` has every problem found, each such a line). `metadata_server`: the deployment
    runs with `-m` (its executors come from the metadata server, not from urls)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys")
    problems = _refusals(data) + _inheritance_conflicts(data)
    config = None
    try:
        config = DisaggConfig.model_validate(
            _normalise(data, metadata_server), context={"metadata_server": metadata_server}
        )
    except ValidationError as err:
        lines = [_error_line(e) for e in err.errors()]
        if data.get("multimodal_servers") is not None and "context_servers" not in data:
            # TensorRT-LLM's EPD example has no context_servers: multimodal_servers is the problem
            lines = [line for line in lines if not line.startswith("context_servers")]
        problems += _at_the_top_level(lines, data)
    if problems:
        lines = [f"{source}: {p}" for p in problems]
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        raise ConfigError(lines[0] + more, lines)
    assert config is not None
    sections = ("context_servers", "generation_servers")
    config._given = {
        "": frozenset(data),
        **{role: frozenset(data[role]) for role in sections if isinstance(data.get(role), dict)},
    }
    return config


# The inherited keys a section declares (the routers and launchers read them from the section);
# the first three are no LLM argument, so they leave the top level once inherited.
_SECTION_ONLY = ("router", "urls", "num_instances")
_INHERITED_FIELDS = (*_SECTION_ONLY, "max_batch_size", "max_num_tokens", "kv_cache_config")


def _named(role: str, dotted: str, top: Collection[str], own: Collection[str]) -> str:
    """Where a problem with `dotted` of section `role` is named: at the top level when the
    section inherits its first key from there (`top`, `own`: the keys the file sets at the top
    level and in the section), else in the section."""
    first = dotted.split(".", 1)[0]
    return dotted if first in top and first not in own else f"{role}.{dotted}"


def _inheritance_conflicts(data: dict[str, Any]) -> list[str]:
    """A top-level key that a section sets to another value. TensorRT-LLM's `extract_disagg_cfg`
    (`llmapi/disagg_utils.py` @0228a712, id 54588247121) takes its own settings as named
    parameters, gives every other key to both sections, and raises "Parameter ... is specified
    both in the top-level and in the ... section, but with different values" (compared as
    loaded, a mapping as a whole). Its named parameters, and the newer ones
    (`return_perf_metrics`, `perf_metrics_output_dir`, `server_keep_alive_timeout`,
    `internal_request_auth_key`: reference trtllm_protocol.md section 5.1), are DisaggConfig's
    fields; so is `shmdisagg`, ours."""
    out = []
    for key, value in data.items():
        if key in DisaggConfig.model_fields:
            continue
        for role in ("context_servers", "generation_servers"):
            section = data.get(role)
            if isinstance(section, dict) and key in section and section[key] != value:
                out.append(
                    f"{role}.{key}: differs from the top-level {key}, which TensorRT-LLM gives both sections "
                    "(it refuses this too): set it in one place"
                )
    return out


def _at_the_top_level(lines: list[str], data: dict[str, Any]) -> list[str]:
    """Problems of an inherited value named where the file sets it: `kv_cache_config...` once,
    not `context_servers.kv_cache_config...` and `generation_servers.kv_cache_config...`."""
    out: list[str] = []
    for line in lines:
        for role in ("context_servers", "generation_servers"):
            section = data.get(role)
            own = section if isinstance(section, dict) else {}
            for key in _INHERITED_FIELDS:
                prefix = f"{role}.{key}"
                if line.startswith(prefix) and line[len(prefix) : len(prefix) + 1] in (":", "."):
                    line = _named(role, key, data, own) + line[len(prefix) :]
        if line not in out:
            out.append(line)
    return out


def _inherit(data: dict[str, Any], metadata_server: bool) -> dict[str, Any]:
    """TensorRT-LLM's top-level inheritance (`extract_disagg_cfg`, before `extract_router_config`
    reads a section's `router`, `max_batch_size`, `max_num_tokens` and
    `kv_cache_config.tokens_per_block`): each of `_INHERITED_FIELDS` set at the top level goes into
    each section that does not set it. A missing section receives them where it may be missing
    (executors that register themselves); elsewhere it is refused as missing anyway. The LLM
    arguments among them stay at the top level too, for the launchers."""
    inherited = {k: data[k] for k in _INHERITED_FIELDS if k in data}
    if not inherited:
        return data
    out = {k: v for k, v in data.items() if k not in _SECTION_ONLY}
    self_registering = metadata_server or data.get("disagg_cluster") is not None
    for role in ("context_servers", "generation_servers"):
        section = data.get(role, {} if self_registering else None)
        if isinstance(section, dict):
            out[role] = {**inherited, **section}
    return out


def _normalise(data: dict[str, Any], metadata_server: bool = False) -> dict[str, Any]:
    """Accept TensorRT-LLM's spellings: a section's router may be `null`; a router `type: null`;
    the type in any case (`create_router` looks up `router_type.lower()`, `serve/router.py`);
    `conditional_disagg_config: {}` is off (`ConditionalDisaggConfig(**c) if c else None`,
    `extract_disagg_cfg`); top-level section keys are inherited (`_inherit`)."""
    out = _inherit(data, metadata_server)
    if out.get("conditional_disagg_config") == {}:
        out["conditional_disagg_config"] = None
    for key in ("context_servers", "generation_servers"):
        section = out.get(key)
        if isinstance(section, dict) and isinstance(section.get("router"), dict):
            router = dict(section["router"])
            if router.get("type") is None:
                router.pop("type", None)
            elif isinstance(router["type"], str):
                router["type"] = router["type"].lower()
            out[key] = {**section, "router": router}
        elif isinstance(section, dict) and "router" in section and section["router"] is None:
            out[key] = {k: v for k, v in section.items() if k != "router"}
    return out


# Top-level keys of TensorRT-LLM's disaggregated config that are no DisaggConfig field (kept as
# extras, and read where they have an effect) and no LLM argument either.
TRTLLM_TOP_LEVEL_EXTRAS = frozenset({"otlp_config", "internal_request_auth_key"})
_SECTION_FIELDS = ("num_instances", "urls", "router", "max_batch_size", "max_num_tokens", "kv_cache_config")


def config_warnings(config: DisaggConfig) -> list[str]:
    """Every key of the file that is neither a key of TensorRT-LLM's disaggregated config nor an
    LLM argument TensorRT-LLM knows (`trtllm_llm_args.LLM_ARG_NAMES`), every key of a
    `kv_cache_config`, `cache_transceiver_config` or `scheduler_config` (top level or a
    section's) that is no field of TensorRT-LLM's class for it (`KvCacheConfig`, ...:
    `trtllm_llm_args.NESTED_CONFIG_NAMES`), each with the closest known key when one is near
    (`num_workrs`: did you mean num_workers?), and a port-0 reminder.

    TensorRT-LLM passes such a key to the executors as an LLM argument, where `trtllm-serve`
    refuses it (its LLM arguments and those classes forbid unknown fields); `shmdisagg serve`
    does nothing with it (`kv_cache_config: {tokens_per_blok: 64}` leaves the router's and the
    simulator's block size at the default). A top-level `kv_cache_config` that the sections
    inherit is named once, where the file sets it (`config.key_of`).
    """
    from shmdisagg.trtllm_llm_args import LLM_ARG_NAMES, NESTED_CONFIG_CLASSES, NESTED_CONFIG_NAMES

    def unknown(dotted: str, key: str, known: list[str], what: str = "disaggregated-config key or LLM argument") -> str:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
        hint = f", did you mean {close[0]}?" if close else ""
        return (
            f"{dotted}: unknown key{hint} (no TensorRT-LLM {what}: "
            "trtllm-serve executors would refuse it, shmdisagg serve ignores it)"
        )

    def unknown_nested(where: Callable[[str], str], arg: str, mapping: Any) -> list[str]:
        names = NESTED_CONFIG_NAMES[arg]
        known, what = sorted(names), f"{NESTED_CONFIG_CLASSES[arg]} field"
        keys = mapping if isinstance(mapping, dict) else ()
        return [unknown(where(f"{arg}.{key}"), str(key), known, what) for key in keys if key not in names]

    out = []
    top = [*DisaggConfig.model_fields, *TRTLLM_TOP_LEVEL_EXTRAS]
    extra = config.model_extra or {}
    for key in extra:
        if key not in LLM_ARG_NAMES and key not in TRTLLM_TOP_LEVEL_EXTRAS:
            out.append(unknown(key, key, [*top, *LLM_ARG_NAMES]))
    for name in ("context_servers", "generation_servers"):
        section = getattr(config, name)
        for key in section.model_extra or {}:
            if key not in LLM_ARG_NAMES:
                out.append(unknown(f"{name}.{key}", key, [*_SECTION_FIELDS, *LLM_ARG_NAMES]))
    for arg in NESTED_CONFIG_NAMES:
        out += unknown_nested(str, arg, extra.get(arg))
    for name in ("context_servers", "generation_servers"):
        section = getattr(config, name)
        own = section.model_extra or {}
        for arg in NESTED_CONFIG_NAMES:
            # kv_cache_config is a section field: the top level's, inherited, is named there (deduplicated below)
            mapping = section.kv_cache_config if arg == "kv_cache_config" else own.get(arg)
            out += unknown_nested(functools.partial(config.key_of, name), arg, mapping)
        if section.router.type == "kv_cache_aware" and section.kv_cache_config.get("enable_block_reuse") is False:
            out.append(  # once for a top-level value both sections inherit (dict.fromkeys below)
                f"{config.key_of(name, 'kv_cache_config.enable_block_reuse')}: false under a kv_cache_aware router: "
                "the executors reuse no cached block, so no prefix the router matches is a hit; it balances load only"
            )
    if config.port == 0:
        out.append(
            "port: 0 lets the kernel pick the port; only shmdisagg serve --report_addr PATH can run it (it "
            "writes host:port to PATH)"
        )
    return list(dict.fromkeys(out))


def load_config(path: str | os.PathLike[str], *, metadata_server: bool = False) -> DisaggConfig:
    """Read and validate a config file. Raises `ConfigError`.

    The file must be UTF-8 (as TensorRT-LLM reads it under a UTF-8 locale) and YAML with
    unique keys: PyYAML's `safe_load`, which TensorRT-LLM uses, silently keeps the last of two
    equal keys of a mapping; a repeated key is refused here instead, naming it (YAML itself
    requires keys to be unique, and the first value is almost always the one that was meant)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as err:
        raise ConfigError(f"{p}: cannot read: {err.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise ConfigError(
            f"{p}: line {line} not UTF-8 text (byte 0x{raw[err.start]:02x} at column {column}); save the file as UTF-8"
        ) from None
    try:
        return parse_config(_safe_load_unique(text), str(p), metadata_server=metadata_server)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{p}:{where} not valid YAML: {getattr(err, 'problem', None) or err}") from None
    except _DuplicateKey as err:
        raise ConfigError(f"{p}: {err.key}: {err}") from None
    except RecursionError:  # an alias inside its own anchor (`a: &a [*a]`): safe_load builds a cycle
        raise ConfigError(f"{p}: a value contains itself (a YAML alias inside its own anchor)") from None


class _DuplicateKey(ValueError):
    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _safe_load_unique(text: str) -> Any:
    """`yaml.safe_load(text)`, refusing a mapping that lists a key twice (`_DuplicateKey`)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_unique_keys(node, ())
        return loader.construct_document(node)
    finally:
        loader.dispose()


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _check_unique_keys(node: yaml.Node, path: tuple[str, ...], seen: set[int] | None = None) -> None:
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias of a node already checked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], yaml.Node] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE_TAG:  # keys merged in with << may be overridden
                ident = (key.tag, key.value)
                if ident in first:
                    dotted = ".".join((*path, key.value))
                    raise _DuplicateKey(
                        dotted,
                        f"listed twice (lines {first[ident].start_mark.line + 1} and {key.start_mark.line + 1}); "
                        "keys must be unique (a plain YAML load would silently keep only the last)",
                    )
                first[ident] = key
            _check_unique_keys(value, (*path, str(key.value) if isinstance(key, yaml.ScalarNode) else "?"), seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique_keys(item, (*path, str(i)), seen)


def log_dir_problem(path: str | os.PathLike[str]) -> str | None:
    """Why `path` cannot be the launcher's log directory (it writes each executor's log and
    option file there, creating the directory if needed), or None if it looks usable now."""
    p = os.path.abspath(path)
    if os.path.lexists(p) and not os.path.exists(p):
        return f"{path} is a broken symbolic link"
    if os.path.exists(p):
        if not os.path.isdir(p):
            return f"{path} exists and is not a directory"
        if not os.access(p, os.W_OK | os.X_OK):
            return f"{path} is not writable"
        return None
    parent = os.path.dirname(p)
    while not os.path.exists(parent):
        if os.path.lexists(parent):
            return f"cannot create {path}: {parent} is a broken symbolic link"
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot create {path}: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create {path}: {parent} is not writable"
    try:  # the kernel has the last word (root passes access(), yet /proc, /sys refuse): ask it
        os.rmdir(tempfile.mkdtemp(prefix=".shmdisagg-probe-", dir=parent))
    except OSError as err:
        return f"cannot create {path}: {parent} refuses new directories ({err.strerror or err})"
    return None


def _command_problem(program: str) -> str | None:
    """Why `program` (a name looked up on PATH, or a path) cannot be run here, or None."""
    if os.sep in program:
        if os.path.isdir(program):
            return f"{program!r} is a directory"
        if not os.path.isfile(program):
            return f"{program!r} not found"
        return None if os.access(program, os.X_OK) else f"{program!r} is not executable"
    return None if shutil.which(program) else f"{program!r} not found on PATH"


def check_machine(config: DisaggConfig, executors_here: bool) -> None:
    """The checks of a config against this machine, which loading leaves out (`stats` and dry
    runs read configs written for other machines): the public `hostname` resolves to an address
    of this machine; every executor host resolves; with `executors_here` (`shmdisagg launch`
    starts them), each executor address is one of this machine's and
    `shmdisagg.executors.log_dir`, when set, is usable, and backend `trtllm`'s command
    (`trtllm-serve`) can be run; the routing tokenizer, when a router
    tokenizes, loads (`tokenizer_source.py`); `TRTLLM_KVCACHE_AWARE_ROUTER_HASH_TOKENS_PER_BLOCK`,
    when set, is a positive integer. Run by `check-config`, `launch`, `serve` and
    `bench --launch` before anything starts. Raises `ConfigError` ("key: problem"; every
    problem found in `problems`)."""
    env_tokens_per_block()  # the router's environment override, read by every process
    problems = []
    problem = _host_problem(config.hostname, local=True)
    if problem:
        problems.append(f"hostname: {problem}; the fleet listens there")
    for key in ("context_servers", "generation_servers"):
        section = getattr(config, key)
        for url, (host, _) in zip(section.urls, section.addresses(), strict=True):
            problem = _host_problem(host, local=executors_here)
            if problem and problem.startswith("cannot resolve"):
                problems.append(f"{key}.urls: {url!r}: {problem}")
            elif problem:
                problems.append(
                    f"{key}.urls: {url!r}: {problem}; shmdisagg launch starts its executors on this machine "
                    "(for executors elsewhere, start them there and run shmdisagg serve)"
                )
    spec = config.shmdisagg.executors
    if executors_here and spec is not None and spec.log_dir is not None:
        problem = log_dir_problem(spec.log_dir)
        if problem:
            problems.append(f"shmdisagg.executors.log_dir: {problem}")
    if executors_here and spec is not None and spec.backend == "trtllm":
        problem = _command_problem(spec.trtllm.command[0])
        if problem:
            problems.append(f"shmdisagg.executors.trtllm.command: {problem}; launch runs it on this machine")
    problems += _observability_problems(config)
    from shmdisagg.tokenizer_source import check_routing_tokenizer  # transformers only when a router tokenizes

    try:
        check_routing_tokenizer(config)
    except ConfigError as err:
        problems += err.problems
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(problems[0] + more, problems)


def _observability_problems(config: DisaggConfig) -> list[str]:
    """Every fleet worker writes `perf_metrics_output_dir` and `TRTLLM_REQUEST_TRACE_DIR` and
    exports to `otlp_config`: what it could not honour (shmdisagg/observe.py), one line each."""
    from shmdisagg.request_trace import REQUEST_TRACE_DIR_ENV, trace_dir_from_env
    from shmdisagg.tracing import otlp_problem

    problems = []
    for key, path in (
        ("perf_metrics_output_dir", config.perf_metrics_output_dir),
        (REQUEST_TRACE_DIR_ENV, trace_dir_from_env()),
    ):
        problem = log_dir_problem(path) if path else None
        if problem:
            problems.append(f"{key}: {problem}")
    if config.otlp_config is not None and config.otlp_config.otlp_traces_endpoint:
        problem = otlp_problem()
        if problem:
            problems.append(f"otlp_config.otlp_traces_endpoint: {problem}")
    return problems


def _host_problem(host: str, local: bool) -> str | None:
    """Why `host` cannot be used: it does not resolve, or (`local`) it is no address of this
    machine (binding it fails with EADDRNOTAVAIL). None if it can."""
    try:
        family, addr = listen_addr(host, 0)  # the address a listener binds
    except (socket.gaierror, UnicodeError) as err:
        return f"cannot resolve {host!r} ({getattr(err, 'strerror', None) or err})"
    if not local:
        return None
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind(addr)
    except OSError as err:
        if err.errno == errno.EADDRNOTAVAIL:
            return f"{host!r} is not an address of this machine"
    return None
