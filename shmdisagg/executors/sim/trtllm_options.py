"""The `trtllm-serve` stand-in: `serve MODEL [options]` and its extra_llm_api_options YAML,
mapped onto a `SimConfig`.

Honoured from the command line: `--host --port --tp_size --max_batch_size --max_num_tokens
--max_seq_len --kv_cache_free_gpu_memory_fraction --log_level --extra_llm_api_options` (alias
`--config`), `--server_role --disagg_cluster_uri --metadata_server_config_file` (the simulator
registers itself as trtllm-serve does: `shmdisagg/cluster/registrar.py`, `cluster/metadata.py`); the
other trtllm-serve options listed in `_IGNORED_*` are accepted and ignored.
Honoured from the YAML (TensorRT-LLM LLM-API keys, TensorRT-LLM defaults when absent):

- `kv_cache_config`: `tokens_per_block` (32), `enable_block_reuse` (true),
  `event_buffer_max_size` (0: no KV events, as TensorRT-LLM), `free_gpu_memory_fraction` (0.9),
  `max_tokens` (caps the pool: ceil(max_tokens / tokens_per_block) blocks),
  `kv_cache_event_hash_algo` (auto | v1_block_key | v2_sha256 | v2_sha256_64; auto is v1_block_key);
- `max_batch_size` (2048), `max_num_tokens` (8192), `max_seq_len`, `tensor_parallel_size`;
- `cache_transceiver_config`: present with a `backend` enables context_only / generation_only
  (absent: they are refused with 400, where TensorRT-LLM silently does no disaggregation);
  `kv_transfer_timeout_ms` (60000);
- `disable_overlap_scheduler` (false), `enable_chunked_prefill` (false, as TensorRT-LLM),
  `return_perf_metrics` (false: per-request perf metrics on answers that send
  `X-TRTLLM-return-metrics: 1`), `perf_metrics_max_requests` (0: `/perf_metrics` keeps nothing);
- `internal_request_auth_key` (a non-empty string; TensorRT-LLM's worker option, checked on the
  `x-trtllm-disagg-auth` header of requests with protected disaggregated fields, see
  `disagg_auth.py`);
- `disagg_cluster` (`cluster_uri`, `cluster_name`, `heartbeat_interval_sec`, `inactive_timeout_sec`;
  `--disagg_cluster_uri` wins over its `cluster_uri`);
- `sim:` simulator-only keys, named as `SimConfig` fields (`profile`, `num_blocks`, `speedup`,
  `faults` (a list of fault specs), `startup_delay`, `seed`, `advertise_host`, ...).

Command-line values win over the YAML, as in trtllm-serve. Any other top-level key must be a
known TensorRT-LLM LLM-API key (`_KNOWN_IGNORED_KEYS`); anything else is an error, as
TensorRT-LLM's strict argument model rejects it. So is a key of `kv_cache_config`,
`cache_transceiver_config` or `scheduler_config` that is no field of TensorRT-LLM's class for it
(StrictBaseModels: `trtllm_llm_args.NESTED_CONFIG_NAMES`), read or not.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import yaml

from shmdisagg.executors.sim.config import FIELD_NAMES, SimConfig
from shmdisagg.executors.sim.errors import ConfigError, RaisingArgumentParser
from shmdisagg.executors.sim.profiles import get_profile, guess_profile
from shmdisagg.trtllm_llm_args import NESTED_CONFIG_CLASSES, NESTED_CONFIG_NAMES

_IGNORED_VALUE_OPTIONS = (
    "--backend", "--pp_size", "--ep_size", "--cluster_size", "--gpus_per_node", "--tokenizer",
    "--num_postprocess_workers", "--reasoning_parser", "--tool_parser", "--max_beam_width",
    "--chat_template",
    "--otlp_traces_endpoint", "--media_io_kwargs", "--custom_tokenizer", "--served_model_name",
)  # fmt: skip
_IGNORED_FLAGS = ("--trust_remote_code", "--enable_chunked_prefill", "--fail_fast_on_attention_window_too_large")

_KNOWN_IGNORED_KEYS = frozenset(
    {
        "backend", "model", "tokenizer", "pipeline_parallel_size", "context_parallel_size",
        "moe_expert_parallel_size", "moe_tensor_parallel_size", "enable_attention_dp", "cuda_graph_config",
        "use_cuda_graph", "cuda_graph_batch_sizes", "cuda_graph_padding_enabled", "print_iter_log",
        "enable_iter_perf_stats", "enable_iter_req_stats", "scheduler_config", "speculative_config",
        "moe_config", "attn_backend", "sampler_type", "stream_interval", "num_postprocess_workers",
        "trust_remote_code", "build_config", "max_beam_width", "max_input_len", "dtype", "quant_config",
        "kv_cache_dtype", "torch_compile_config", "enable_autotuner", "guided_decoding_backend",
        "batch_wait_timeout_ms", "batch_wait_timeout_iters", "batch_wait_max_tokens_ratio",
        "garbage_collection_gen0_threshold",
        "allreduce_strategy", "checkpoint_format", "load_format", "skip_tokenizer_init", "lora_config",
        "otlp_traces_endpoint", "disable_log_stats", "gather_generation_logits", "request_stats_max_iterations",
        "mm_encoder_only", "peft_cache_config", "enable_lora", "reasoning_parser", "revision",
    }
)  # fmt: skip


def parse_serve_args(argv: list[str], prog: str = "python -m shmdisagg.executors.sim serve") -> SimConfig:
    parser = RaisingArgumentParser(prog=prog)
    parser.add_argument("model")
    parser.add_argument("--host", default="localhost")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tp_size", type=int, default=None)
    parser.add_argument("--max_batch_size", type=int, default=None)
    parser.add_argument("--max_num_tokens", type=int, default=None)
    parser.add_argument("--max_seq_len", type=int, default=None)
    parser.add_argument("--kv_cache_free_gpu_memory_fraction", type=float, default=None)
    parser.add_argument("--log_level", default="warning")
    parser.add_argument("--extra_llm_api_options", "--config", dest="extra", default=None)
    # registration (TensorRT-LLM commands/serve.py: --server_role is upper-cased into ServerRole)
    parser.add_argument("--server_role", "--server-role", dest="server_role", default=None)
    parser.add_argument("--disagg_cluster_uri", default=None)
    parser.add_argument("--metadata_server_config_file", default=None)
    for opt in _IGNORED_VALUE_OPTIONS:
        parser.add_argument(opt, default=None)
    for opt in _IGNORED_FLAGS:
        parser.add_argument(opt, action="store_true")
    try:
        args = parser.parse_args(argv)
    except argparse.ArgumentError as exc:
        raise ConfigError(str(exc)) from None

    yaml_opts = load_extra_options(args.extra) if args.extra else {}
    values: dict[str, Any] = {
        "enable_block_reuse": True,
        "event_buffer_max_size": 0,
        "enable_chunked_prefill": False,
        "return_perf_metrics": False,
        "perf_metrics_max_requests": 0,
        "disagg_enabled": False,
        **yaml_opts.pop("llm", {}),
    }
    cli = {
        "host": args.host,
        "port": args.port,
        "tp_size": args.tp_size,
        "max_batch_size": args.max_batch_size,
        "max_num_tokens": args.max_num_tokens,
        "max_seq_len": args.max_seq_len,
        "free_gpu_memory_fraction": args.kv_cache_free_gpu_memory_fraction,
    }
    values.update({k: v for k, v in cli.items() if v is not None})
    values.update(_registration(args, yaml_opts.pop("disagg_cluster", None), args.extra or ""))
    values["model"] = args.model
    values["log_level"] = _log_level(args.log_level)
    sim = yaml_opts.pop("sim", {})
    kv_max_tokens = values.pop("kv_max_tokens", None)
    values.update(sim)
    if "profile" not in sim:
        values["profile"] = guess_profile(args.model, values.get("tp_size") or 1)
    if kv_max_tokens is not None and "num_blocks" not in sim:
        tpb = values.get("tokens_per_block", 32)
        profile = get_profile(values["profile"])
        if values.get("tp_size"):
            profile = profile.with_tp(values["tp_size"])
        budget = math.ceil(kv_max_tokens / tpb)
        values["num_blocks"] = min(budget, profile.default_num_blocks(tpb, values.get("free_gpu_memory_fraction", 0.9)))
    if "faults" in values:
        values["faults"] = tuple(values["faults"])
    try:
        return SimConfig(**values)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None


def _registration(args: argparse.Namespace, cluster: dict[str, Any] | None, path: str) -> dict[str, Any]:
    """SimConfig values for registering as trtllm-serve does: `--server_role`, the YAML's
    `disagg_cluster` section (TensorRT-LLM `commands/serve.py`: it is popped from the LLM args,
    and `--disagg_cluster_uri` wins over its `cluster_uri`), `--metadata_server_config_file`."""
    out: dict[str, Any] = {}
    if args.server_role is not None:
        out["server_role"] = args.server_role.lower()
    if cluster is not None:
        allowed = {"cluster_uri", "cluster_name", "minimal_instances", "heartbeat_interval_sec", "inactive_timeout_sec"}
        if not isinstance(cluster, dict) or set(cluster) - allowed:
            raise ConfigError(f"{path}: disagg_cluster: unknown key(s) {sorted(set(cluster) - allowed)}")
        for key in ("cluster_name", "heartbeat_interval_sec", "inactive_timeout_sec"):
            if cluster.get(key) is not None:
                out[key] = cluster[key]
        if cluster.get("cluster_uri") is not None:
            out["disagg_cluster_uri"] = cluster["cluster_uri"]
    if args.disagg_cluster_uri is not None:
        out["disagg_cluster_uri"] = args.disagg_cluster_uri
    if args.metadata_server_config_file is not None:
        out["metadata_server_config_file"] = args.metadata_server_config_file
    return out


def load_extra_options(path: str) -> dict[str, Any]:
    """Read the YAML into {"llm": SimConfig values from LLM-API keys, "sim": the sim section}."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read extra_llm_api_options {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    llm: dict[str, Any] = {}
    sim: dict[str, Any] = {}
    llm_cluster: Any = None
    for key, value in data.items():
        _check_strict_mapping(key, value, path)
        if key == "sim":
            sim = _sim_section(value, path)
        elif key == "disagg_cluster":
            llm_cluster = value
        elif key == "kv_cache_config":
            llm.update(_kv_cache_config(value, path))
        elif key == "cache_transceiver_config":
            llm.update(_cache_transceiver_config(value, path))
        elif key in ("max_batch_size", "max_num_tokens", "max_seq_len", "perf_metrics_max_requests"):
            llm[key] = _int(value, key, path)
        elif key == "tensor_parallel_size":
            llm["tp_size"] = _int(value, key, path)
        elif key in ("disable_overlap_scheduler", "enable_chunked_prefill", "return_perf_metrics"):
            llm[key] = _bool(value, key, path)
        elif key == "internal_request_auth_key":
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ConfigError(f"{path}: internal_request_auth_key must be a non-empty string")
                llm[key] = value
        elif key not in _KNOWN_IGNORED_KEYS:
            raise ConfigError(f"{path}: unknown extra_llm_api_options key {key!r}")
    out: dict[str, Any] = {"llm": llm, "sim": sim}
    if "disagg_cluster" in data:
        out["disagg_cluster"] = llm_cluster
    return out


def _check_strict_mapping(key: str, value: Any, path: str) -> None:
    """A mapping TensorRT-LLM validates as a StrictBaseModel (`KvCacheConfig`, ...) refuses keys
    that are none of its fields ("Extra inputs are not permitted"), whether or not the simulator
    reads them. Raises `ConfigError`."""
    names = NESTED_CONFIG_NAMES.get(key)
    if names is None or not isinstance(value, dict):
        return
    unknown = sorted(str(k) for k in value if k not in names)
    if unknown:
        raise ConfigError(
            f"{path}: {key}: unknown key(s) {', '.join(unknown)} (no field of TensorRT-LLM's "
            f"{NESTED_CONFIG_CLASSES[key]}, which refuses them: Extra inputs are not permitted)"
        )


def _kv_cache_config(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: kv_cache_config must be a mapping")
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key == "tokens_per_block" or key == "event_buffer_max_size":
            out[key] = _int(v, f"kv_cache_config.{key}", path)
        elif key == "kv_cache_event_hash_algo":
            out[key] = v
        elif key == "enable_block_reuse":
            out[key] = _bool(v, "kv_cache_config.enable_block_reuse", path)
        elif key == "free_gpu_memory_fraction":
            out[key] = float(v)
        elif key == "max_tokens" and v is not None:
            out["kv_max_tokens"] = _int(v, "kv_cache_config.max_tokens", path)
    return out


def _cache_transceiver_config(value: Any, path: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: cache_transceiver_config must be a mapping")
    out: dict[str, Any] = {"disagg_enabled": bool(value.get("backend"))}
    timeout_ms = value.get("kv_transfer_timeout_ms")
    if timeout_ms is not None:
        out["kv_transfer_timeout"] = _int(timeout_ms, "cache_transceiver_config.kv_transfer_timeout_ms", path) / 1000.0
    return out


def _sim_section(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: sim must be a mapping")
    unknown = set(value) - FIELD_NAMES
    if unknown:
        raise ConfigError(f"{path}: unknown sim option(s) {', '.join(sorted(unknown))}")
    out = dict(value)
    if "faults" in out:
        faults = out["faults"]
        if isinstance(faults, str):
            faults = [faults]
        if not isinstance(faults, list) or not all(isinstance(f, str) for f in faults):
            raise ConfigError(f"{path}: sim.faults must be a list of fault specs")
        out["faults"] = tuple(faults)
    return out


def _int(value: Any, key: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: {key} must be an integer")
    return value


def _bool(value: Any, key: str, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: {key} must be true or false")
    return value


def _log_level(level: str) -> str:
    level = level.lower()
    return {"verbose": "debug", "trace": "debug", "critical": "error", "internal_error": "error"}.get(level, level)
