"""`SimConfig`: every option of one simulated executor, checked once.

Both command lines (`cli.py`) and the `sim:` section of an extra_llm_api_options YAML
(`trtllm_options.py`) produce a SimConfig; the CLI flags are derived from these fields, so each
option is written here and only here. Validation raises `ConfigError`, never exits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from shmdisagg.executors.sim.block_keys import HASH_ALGO_CHOICES
from shmdisagg.executors.sim.errors import ConfigError
from shmdisagg.executors.sim.faults import FaultSpec
from shmdisagg.executors.sim.profiles import DEFAULT_PROFILE, Profile, get_profile
from shmdisagg.hostport import authority

ROLES = ("context", "generation", "mixed")


def _opt(help: str, **extra: Any) -> Any:
    return {"help": help, **extra}


@dataclass(frozen=True)
class SimConfig:
    host: str = field(default="127.0.0.1", metadata=_opt("address to listen on"))
    port: int = field(default=8000, metadata=_opt("port to listen on"))
    role: str = field(
        default="mixed",
        metadata=_opt("context: refuses generation_only; generation: refuses context_only; mixed: both", choices=ROLES),
    )
    model: str = field(default="", metadata=_opt("served model name (default: the profile's model)"))
    profile: str = field(default=DEFAULT_PROFILE, metadata=_opt("GPU + model timing profile (see README)"))
    tokens_per_block: int = field(default=32, metadata=_opt("KV cache tokens per block"))
    num_blocks: int | None = field(default=None, metadata=_opt("KV pool size in blocks (default: from the profile)"))
    max_batch_size: int = field(default=2048, metadata=_opt("most requests scheduled in one iteration"))
    max_num_tokens: int = field(default=8192, metadata=_opt("token budget of one iteration"))
    max_seq_len: int | None = field(default=None, metadata=_opt("longest prompt + output (default: the model's)"))
    tp_size: int | None = field(default=None, metadata=_opt("tensor-parallel size (default: the profile's)"))
    speedup: float = field(default=1.0, metadata=_opt("divide every modelled time by this"))
    seed: int = field(default=0, metadata=_opt("seed of generated tokens and fault randomness"))
    faults: tuple[str, ...] = field(
        default=(), metadata=_opt("inject a fault, e.g. crash:after=3, error:status=503,rate=0.5", flag="--fault")
    )
    startup_delay: float = field(default=0.0, metadata=_opt("seconds of 503 'starting' before becoming ready"))
    enable_block_reuse: bool = field(default=True, metadata=_opt("prefix reuse of cached KV blocks"))
    event_buffer_max_size: int = field(default=1024, metadata=_opt("KV event buffer size (0: no events)"))
    event_tokens: bool = field(default=True, metadata=_opt("include token ids in stored-block events"))
    event_timestamps: bool = field(
        default=False, metadata=_opt("add a wall-clock timestamp to every KV event (an extension for lag measurements)")
    )
    kv_cache_event_hash_algo: str = field(
        default="auto",
        metadata=_opt(
            "KV block hash algorithm (auto: v1_block_key), reported in /server_info", choices=HASH_ALGO_CHOICES
        ),
    )
    enable_chunked_prefill: bool = field(default=True, metadata=_opt("split long prefills across iterations"))
    disable_overlap_scheduler: bool = field(default=False, metadata=_opt("host overhead adds to GPU time"))
    return_perf_metrics: bool = field(
        default=True, metadata=_opt("per-request perf metrics (X-TRTLLM-return-metrics: 1, /perf_metrics)")
    )
    perf_metrics_max_requests: int = field(
        default=1000, metadata=_opt("/perf_metrics records kept until drained (0: none)")
    )
    internal_request_auth_key: str | None = field(
        default=None,
        repr=False,  # a secret
        metadata=_opt("HMAC key checked on protected disaggregated fields (x-trtllm-disagg-auth header)"),
    )
    kv_transfer_timeout: float = field(default=60.0, metadata=_opt("seconds a context result waits to be pulled"))
    disagg_enabled: bool = field(default=True, metadata=_opt("accept context_only / generation_only requests"))
    free_gpu_memory_fraction: float = field(default=0.9, metadata=_opt("share of free GPU memory for the KV pool"))
    advertise_host: str | None = field(default=None, metadata=_opt("host in ctx_info_endpoint (default: --host)"))
    keep_alive_timeout: float = field(default=5.0, metadata=_opt("HTTP keep-alive seconds"))
    log_level: str = field(default="warning", metadata=_opt("log level", choices=("debug", "info", "warning", "error")))
    # Registration, as trtllm-serve's --server_role / --disagg_cluster_uri / disagg_cluster do
    # (shmdisagg/cluster/registrar.py) and its --metadata_server_config_file (cluster/metadata.py)
    server_role: str | None = field(
        default=None,
        metadata=_opt("the role it registers as (context, generation): needed with a cluster uri or metadata server"),
    )
    disagg_cluster_uri: str | None = field(
        default=None, metadata=_opt("register at this cluster store (etcd://host:port or http://host:port)")
    )
    cluster_name: str = field(default="", metadata=_opt("disagg_cluster.cluster_name: the key namespace"))
    heartbeat_interval_sec: float = field(default=5.0, metadata=_opt("seconds between registration heartbeats"))
    inactive_timeout_sec: int = field(default=10, metadata=_opt("registration TTL in seconds"))
    metadata_server_config_file: str | None = field(
        default=None, metadata=_opt("register in this etcd metadata server (trtllm/<id>), as trtllm-serve -m does")
    )

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {self.role!r}")
        get_profile(self.profile)
        for name in ("tokens_per_block", "max_batch_size", "max_num_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.perf_metrics_max_requests < 0:
            raise ConfigError("perf_metrics_max_requests must be >= 0")
        if self.internal_request_auth_key is not None and (
            not isinstance(self.internal_request_auth_key, str) or not self.internal_request_auth_key
        ):
            raise ConfigError("internal_request_auth_key must be a non-empty string")
        for name in ("num_blocks", "max_seq_len", "tp_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1")
        if not self.speedup > 0:
            raise ConfigError("speedup must be > 0")
        if not -(1 << 63) <= self.seed < (1 << 63):
            raise ConfigError("seed must fit in a signed 64-bit integer")
        if self.startup_delay < 0 or self.kv_transfer_timeout <= 0 or self.keep_alive_timeout <= 0:
            raise ConfigError("startup_delay must be >= 0; kv_transfer_timeout and keep_alive_timeout > 0")
        if self.event_buffer_max_size < 0:
            raise ConfigError("event_buffer_max_size must be >= 0")
        if self.kv_cache_event_hash_algo not in HASH_ALGO_CHOICES:
            raise ConfigError(
                f"kv_cache_event_hash_algo must be one of {', '.join(HASH_ALGO_CHOICES)}, got "
                f"{self.kv_cache_event_hash_algo!r}"
            )
        if not 0 < self.free_gpu_memory_fraction <= 1:
            raise ConfigError("free_gpu_memory_fraction must be within (0, 1]")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        registers = self.disagg_cluster_uri is not None or self.metadata_server_config_file is not None
        # port 0 (the kernel picks one, then registered) only with a cluster uri, as trtllm-serve
        if not (0 < self.port < 65536 or (self.port == 0 and self.disagg_cluster_uri is not None)):
            raise ConfigError("port must be within 1..65535 (0 only with a disagg cluster uri)")
        if registers and self.server_role not in ("context", "generation"):
            raise ConfigError(
                "server_role (context or generation) is required with a disagg cluster uri or a metadata server"
            )
        if self.server_role is not None and self.server_role not in ("context", "generation"):
            raise ConfigError(f"server_role must be context or generation, got {self.server_role!r}")
        if self.disagg_cluster_uri is not None and not self.disagg_cluster_uri.startswith(("etcd://", "http://")):
            raise ConfigError(f"disagg_cluster_uri {self.disagg_cluster_uri!r} is not etcd://... or http://...")
        if self.inactive_timeout_sec < 1:
            raise ConfigError("inactive_timeout_sec must be >= 1")
        for spec in self.faults:
            FaultSpec.parse(spec)

    # -- derived values ---------------------------------------------------------------------
    @property
    def timing_profile(self) -> Profile:
        p = get_profile(self.profile)
        return p if self.tp_size is None else p.with_tp(self.tp_size)

    @property
    def served_model(self) -> str:
        return self.model or self.timing_profile.model.name

    @property
    def effective_num_blocks(self) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return self.timing_profile.default_num_blocks(self.tokens_per_block, self.free_gpu_memory_fraction)

    @property
    def effective_max_seq_len(self) -> int:
        return self.max_seq_len or self.timing_profile.model.max_position_embeddings

    @property
    def endpoint(self) -> str:
        """host:port other executors reach this one at (ctx_info_endpoint)."""
        host = self.advertise_host or self.host
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"
        return authority(host, self.port)

    @property
    def fault_specs(self) -> list[FaultSpec]:
        return [FaultSpec.parse(s) for s in self.faults]


FIELD_NAMES = frozenset(f.name for f in fields(SimConfig))
