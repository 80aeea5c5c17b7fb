"""Plans for `trtllm-serve` executors: each context and generation instance's command line,
environment (`CUDA_VISIBLE_DEVICES`) and extra LLM-API options YAML on one node.

What an instance serves is read from TensorRT-LLM's own keys, as `trtllm-serve disaggregated`
reads them (`extract_disagg_cfg` in `tensorrt_llm/llmapi/disagg_utils.py`): LLM arguments in a
section (`tensor_parallel_size`, `kv_cache_config`, `cache_transceiver_config`, ...) apply to its
instances, top-level keys that are not the orchestrator's are inherited by both sections, and a
section may not set an inherited key to a different value. On top of TensorRT-LLM's defaults we
generate what disaggregated serving behind shmdisagg needs (docs/deploy.md says why):

- `kv_cache_config`: `enable_block_reuse: true`, `event_buffer_max_size: 4096` (0 would turn
  KV events off), `tokens_per_block: 32`, `free_gpu_memory_fraction: 0.9`;
- `max_batch_size` / `max_num_tokens` (TensorRT-LLM's defaults, 2048 / 8192, written out);
- `disable_overlap_scheduler: true` on context instances;
- `return_perf_metrics: true`.

Anything the config sets wins over these. `cache_transceiver_config.backend` has no default:
without it TensorRT-LLM starts but silently does no disaggregation, so the plan refuses.

GPUs: each instance takes tensor x pipeline x context parallel size GPUs from the pool
(`shmdisagg.executors.gpus`, else the launcher's `CUDA_VISIBLE_DEVICES`, else 0, 1, ...),
in order, context instances first, so no two instances share a GPU.

This module decides; it never starts a process or writes a file (launch.py does).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from shmdisagg.config import INT32_MAX, DisaggConfig, ExecutorsSection, ServerSection
from shmdisagg.executors.plan import (
    ROLE_SECTIONS,
    SIM_LLM_OPTIONS,
    UNSET_RUN_DIR,
    InstancePlan,
    LaunchPlan,
    PlanError,
    check_llm_option,
    launch_addresses,
)

DEFAULT_KV_CACHE_CONFIG: dict[str, Any] = {
    "enable_block_reuse": True,
    "event_buffer_max_size": 4096,
    "tokens_per_block": 32,
    "free_gpu_memory_fraction": 0.9,
}
DEFAULT_MAX_BATCH_SIZE = 2048  # TensorRT-LLM BuildConfig defaults
DEFAULT_MAX_NUM_TOKENS = 8192

# Top-level keys of a disagg config that are not LLM arguments (the orchestrator's own, or
# passed on the command line); every other unknown top-level key is inherited by both sections.
_NOT_INHERITED = frozenset({"model", "backend", "otlp_config", "perf_metrics_output_dir", "free_gpu_memory_fraction"})
_PARALLEL_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size")


def trtllm_plan(
    config: DisaggConfig, spec: ExecutorsSection, run_dir: Path | None, environ: Mapping[str, str]
) -> LaunchPlan:
    settings = spec.trtllm
    model = _model(config, spec)
    backend = settings.backend or _top_level_backend(config)
    if "CUDA_VISIBLE_DEVICES" in settings.env:
        raise PlanError(
            "shmdisagg.executors.trtllm.env.CUDA_VISIBLE_DEVICES: the launcher sets it per instance from "
            "shmdisagg.executors.gpus"
        )
    roles = []
    for role, key in ROLE_SECTIONS:
        section: ServerSection = getattr(config, key)
        if section.num_instances:
            options = role_options(config, spec, role)
            roles.append((role, key, section, options, _ranks(options, functools.partial(config.key_of, key))))
    gpu_lists, note = assign_gpus(
        [(role, len(launch_addresses(config, section)), ranks) for role, _, section, _, ranks in roles],
        spec.gpus,
        environ,
    )
    gpu_iter = iter(gpu_lists)
    instances = []
    for role, _, section, options, _ in roles:
        for i, (host, port) in enumerate(launch_addresses(config, section)):
            name = f"{role}-{i}"
            gpus = next(gpu_iter)
            path = (run_dir or UNSET_RUN_DIR) / f"{name}.yaml"
            argv = [
                *settings.command, model,
                "--host", host,
                "--port", str(port),
                "--backend", backend,
                "--tp_size", str(options.get("tensor_parallel_size", 1)),
                "--pp_size", str(options.get("pipeline_parallel_size", 1)),
                "--max_batch_size", str(options["max_batch_size"]),
                "--max_num_tokens", str(options["max_num_tokens"]),
                "--extra_llm_api_options", str(path),
                "--log_level", settings.log_level,
                *(["--server_role", role] if config.disagg_cluster is not None else []),
                *settings.extra_args,
            ]  # fmt: skip
            env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus), **settings.env}
            instances.append(InstancePlan(name, role, host, port, argv, env, gpus, copy.deepcopy(options), path))
    return LaunchPlan("trtllm", model, tuple(instances), run_dir, note)


def role_options(config: DisaggConfig, spec: ExecutorsSection, role: str) -> dict[str, Any]:
    """The extra LLM-API options of every instance of `role`. Raises `PlanError`."""
    key = dict(ROLE_SECTIONS)[role]
    section: ServerSection = getattr(config, key)
    top = config.model_extra or {}
    inherited = {k: v for k, v in top.items() if k not in _NOT_INHERITED}
    own = _section_llm_args(section)  # agrees with `inherited` where both set a key (config._inheritance_conflicts)

    options: dict[str, Any] = {
        "cache_transceiver_config": {},
        "kv_cache_config": dict(DEFAULT_KV_CACHE_CONFIG),
        "max_batch_size": DEFAULT_MAX_BATCH_SIZE,
        "max_num_tokens": DEFAULT_MAX_NUM_TOKENS,
    }
    if role == "context":
        # TensorRT-LLM's context servers do not support the overlap scheduler (examples/disaggregated).
        options["disable_overlap_scheduler"] = True
    options["return_perf_metrics"] = True
    _merge(options, spec.trtllm.extra_llm_api_options)
    if "free_gpu_memory_fraction" in top:  # TensorRT-LLM's older example sets it at the top level
        _fraction(top["free_gpu_memory_fraction"], "free_gpu_memory_fraction")
        options["kv_cache_config"]["free_gpu_memory_fraction"] = top["free_gpu_memory_fraction"]
    _merge(options, inherited)
    _merge(options, own)
    if config.disagg_cluster is not None:
        # trtllm-serve reads `disagg_cluster` from its options YAML (commands/serve.py pops it from
        # the LLM args) and registers itself with --server_role: the deployment's own settings
        options["disagg_cluster"] = config.disagg_cluster.model_dump()
    if config.return_perf_metrics or config.perf_metrics_output_dir:  # TensorRT-LLM forces it into both sections
        options["return_perf_metrics"] = True
    if config.internal_request_auth_key:
        # The workers verify the signature of every handoff with the same key (a trtllm-serve
        # LLM argument, tensorrt_llm/serve/disagg_auth.py); only the option file, mode 0600, holds it.
        options["internal_request_auth_key"] = config.internal_request_auth_key
    _check(options, functools.partial(config.key_of, key), section)
    return options


def assign_gpus(
    needs: list[tuple[str, int, int]], gpus: list[int | str] | None, environ: Mapping[str, str]
) -> tuple[list[tuple[str, ...]], str]:
    """GPU ids for each instance of `needs` = [(role, instances, GPUs per instance), ...], in
    order, and a note saying where the ids came from. Raises `PlanError` when they don't add up."""
    total = sum(n * ranks for _, n, ranks in needs)
    breakdown = " + ".join(f"{n} {role} x {ranks}" for role, n, ranks in needs) or "nothing"
    if gpus is not None:
        pool = [str(g).strip() for g in gpus]
        if len(pool) != total:
            raise PlanError(
                f"shmdisagg.executors.gpus: lists {len(pool)} GPUs but the instances need {total} ({breakdown})"
            )
        note = "shmdisagg.executors.gpus"
    elif environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        pool = [g.strip() for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
        if len(set(pool)) != len(pool):
            raise PlanError(f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']}: a GPU is listed twice")
        if len(pool) < total:
            raise PlanError(
                f"shmdisagg.executors.gpus: unset, and the launcher's CUDA_VISIBLE_DEVICES offers {len(pool)} GPUs "
                f"but the instances need {total} ({breakdown})"
            )
        note = "the launcher's CUDA_VISIBLE_DEVICES" + (
            f"; {', '.join(pool[total:])} left unused" if len(pool) > total else ""
        )
    else:
        pool = [str(i) for i in range(total)]
        note = f"default: the first {total}; set shmdisagg.executors.gpus to choose"
    out: list[tuple[str, ...]] = []
    at = 0
    for _, n, ranks in needs:
        for _ in range(n):
            out.append(tuple(pool[at : at + ranks]))
            at += ranks
    return out, note


# -- helpers ------------------------------------------------------------------------------------


def _model(config: DisaggConfig, spec: ExecutorsSection) -> str:
    if "model" in spec.model_fields_set:
        return spec.model
    top = (config.model_extra or {}).get("model")
    if isinstance(top, str) and top:
        return top
    raise PlanError(
        "shmdisagg.executors.model: backend trtllm needs the model to serve (a Hugging Face name or a checkpoint path)"
    )


def _top_level_backend(config: DisaggConfig) -> str:
    value = (config.model_extra or {}).get("backend", "pytorch")
    value = {"trt": "tensorrt"}.get(value, value)
    if value not in ("pytorch", "tensorrt", "_autodeploy"):
        raise PlanError(f"backend: {value!r} is not a trtllm-serve backend (pytorch, tensorrt, _autodeploy)")
    return str(value)


def _section_llm_args(section: ServerSection) -> dict[str, Any]:
    """A section's LLM arguments: its unknown keys plus the declared ones TensorRT-LLM also
    passes to the executors (only when the file sets them)."""
    args = dict(section.model_extra or {})
    for name in ("max_batch_size", "max_num_tokens", "kv_cache_config"):
        if name in section.model_fields_set:
            args[name] = getattr(section, name)
    return args


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    """Merge `extra` into `base`, mapping into mapping key by key (so a section that sets
    `kv_cache_config.tokens_per_block` keeps the other generated `kv_cache_config` keys)."""
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = copy.deepcopy(v)


def _positive_int(options: dict[str, Any], name: str, where: str, default: int | None = None) -> int:
    value = options.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{where}: must be a positive integer, got {value!r}")
    if value > INT32_MAX:
        raise PlanError(f"{where}: must be at most {INT32_MAX} (TensorRT-LLM's sizes are 32-bit), got {value!r}")
    return value


def _ranks(options: dict[str, Any], where: Callable[[str], str]) -> int:
    ranks = 1
    for name in _PARALLEL_KEYS:
        ranks *= _positive_int(options, name, where(name), 1)
    return ranks


def _fraction(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise PlanError(f"{where}: must be within (0, 1], got {value!r}")


def _check(options: dict[str, Any], where: Callable[[str], str], section: ServerSection) -> None:
    ctc = options.get("cache_transceiver_config")
    backend = ctc.get("backend") if isinstance(ctc, dict) else None
    if not isinstance(backend, str) or not backend.strip():
        raise PlanError(
            f"{where('cache_transceiver_config.backend')}: not set; without it TensorRT-LLM starts but silently "
            "does not disaggregate (set NIXL or UCX, the same for both roles)"
        )
    kv = options["kv_cache_config"]
    if not isinstance(kv, dict):
        raise PlanError(f"{where('kv_cache_config')}: must be a mapping")
    _positive_int(kv, "tokens_per_block", where("kv_cache_config.tokens_per_block"))
    events = kv.get("event_buffer_max_size")
    if isinstance(events, bool) or not isinstance(events, int) or events < 0:
        raise PlanError(f"{where('kv_cache_config.event_buffer_max_size')}: must be an integer >= 0, got {events!r}")
    if events == 0 and section.router.type == "kv_cache_aware":
        raise PlanError(
            f"{where('kv_cache_config.event_buffer_max_size')}: 0 turns KV events off, and the kv_cache_aware router "
            "needs them"
        )
    _fraction(kv.get("free_gpu_memory_fraction"), where("kv_cache_config.free_gpu_memory_fraction"))
    _positive_int(options, "max_batch_size", where("max_batch_size"))
    _positive_int(options, "max_num_tokens", where("max_num_tokens"))
    for name in SIM_LLM_OPTIONS:  # what the simulator refuses, trtllm-serve's LLM arguments refuse at start-up
        head, _, tail = name.partition(".")  # the dotted ones are kv_cache_config's
        value = kv.get(tail) if tail else options.get(head)
        if value is not None:
            check_llm_option(name, value, where(name), section.router.type)
