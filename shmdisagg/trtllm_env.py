"""TensorRT-LLM's environment variables for `trtllm-serve disaggregated`, read in one place.

Every process of a deployment (the CLI before it starts anything, the coordinator, each fleet
worker) reads them through `read_env`, which returns what they mean here or raises `ConfigError`
whose `problems` name each variable that cannot be honoured (exit 2, one line each). Sources are
NVIDIA/TensorRT-LLM files, cited per variable:

| variable | upstream rule | here |
|---|---|---|
| `TRTLLM_DISAGG_SCHEDULE_STYLE` | `context_first` / `generation_first`; the launcher resolves it for the fleet (PR TRTLLM-8921) | the same; `-s` wins over it, it wins over the file |
| `TRTLLM_DISAGG_NO_RETRY` | `== "1"` sets the HTTP client's retries to 0 (`serve/openai_client.py` @00cc02a3, `_post_with_retry`) | legs are not retried (`max_retries` 0); another value keeps retries, with a warning |
| `TRTLLM_DISAGG_SERVER_DISABLE_GC` | default `"1"`: `gc.disable()` in the orchestrator's processes (`commands/serve.py` id 4219957788 `== "1"`; newer `int(...)` truthy, and the fleet workers' default is "1") | `gc.disable()` in the coordinator and every fleet worker unless `0`; not an integer: refused |
| `TRTLLM_SERVER_DISABLE_GC` | read only by a worker `trtllm-serve MODEL` (`launch_server`, `== "1"`) | no effect on the orchestrator, as upstream; `shmdisagg launch` passes the environment to the `trtllm-serve` executors it starts |
| `TRTLLM_DISAGG_WORKER_PROCESS_ID` | the snowflake id's `process_id` in [0, 64) of a standalone server; the fleet launcher sets it per worker (`llmapi/disagg_utils.py` `worker_local_process_id`) | honoured with `num_workers: 1`; a fleet of more assigns each worker its index, as upstream's launcher does; out of range or not an integer: refused |
| `TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION` (+ `TRTLLM_DISAGG_GEN_GRANT_TTL_S`, `_GEN_GRANT_RENEW_INTERVAL_S`, `_LIFECYCLE_ADMISSION_TIMEOUT_S`, `_ARTIFACT_TTL_S`) | `0` (default) or `1`, the opt-in generation-grant protocol (`serve/openai_disagg_service.py` id 60331329338) | v0 only: `1` is refused, and so is each companion variable set with it |
| `TRTLLM_DISAGG_COORDINATOR_PORT` | TCP port of the implicit coordinator (default public port - 1) (`commands/serve.py` @fb31828e) | refused: there is no TCP coordinator; its API is a private Unix socket (`shmdisagg.coordinator_socket`) |
| `TRTLLM_DISAGG_COORDINATOR_UDS` | `0` moves the coordinator from its Unix socket to TCP (same file) | `0` refused (no TCP coordinator); any other value means a Unix socket, which is what runs here |
| `TRTLLM_DISAGG_COORDINATOR_RESERVATION_TIMEOUT` | expiry of a coordinator reservation nobody finished (`serve/disagg_coordinator.py` @0186c597) | warning: nothing to expire; a pick is released when its leg ends, and a dead worker's picks when it dies |
| `WEB_CONCURRENCY` | the early fleet's worker count (`commands/serve.py` @c8042cd1); the current launcher strips it (`num_workers` replaced it) | ignored with a warning, and never passed to fleet workers |
| `TRTLLM_DISAGG_BENCHMARK_GEN_ONLY` | `== "1"`: no context leg; the generation leg gets a fixed stub handoff (`first_gen_tokens [7]`, `ctx_request_id 1`) and `ignore_eos`, and readiness skips the context servers (`_check_gen_only_disagg`, `_wait_for_all_servers_ready`, `serve/openai_disagg_service.py`) | the same (`flows.Flows.generation_only`, the coordinator's start-up wait) |
| `TRTLLM_SERVE_ENABLE_MSGSPEC` | `== "1"`: the orchestrator sends msgpack bodies with `X-TRTLLM-Msgpack: 1`, the worker decodes them (`serve/openai_client.py`, `serve/openai_server.py`) | the same for every leg (`wire.py`); the executors need the variable too |
| `TLLM_LOG_LEVEL` | the TRT-LLM logger's level; it wins over `-l` (`tensorrt_llm/logger.py`: `set_level` is discarded when it is set; an unknown name means `warning`) | the same for the coordinator and fleet workers |
"""  # noqa: E501 (a markdown table above: its rows cannot wrap)

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from shmdisagg.config import ConfigError

SCHEDULE_STYLES = ("context_first", "generation_first")
# TensorRT-LLM's log level names (`tensorrt_llm/logger.py` severity_map) as Python levels.
LOG_LEVELS = {
    "internal_error": logging.CRITICAL,
    "error": logging.ERROR,
    "warning": logging.WARNING,
    "info": logging.INFO,
    "verbose": logging.DEBUG,
    "debug": logging.DEBUG,
    "trace": logging.DEBUG,
}
LIFECYCLE_COMPANIONS = (
    "TRTLLM_DISAGG_GEN_GRANT_TTL_S",
    "TRTLLM_DISAGG_GEN_GRANT_RENEW_INTERVAL_S",
    "TRTLLM_DISAGG_LIFECYCLE_ADMISSION_TIMEOUT_S",
    "TRTLLM_DISAGG_ARTIFACT_TTL_S",
)
PROCESS_ID_SPACE = 64  # the snowflake id's 6-bit process_id (llmapi/disagg_utils.py)
# Variables the fleet workers must not inherit (upstream's fleet launcher strips it too).
NOT_FOR_WORKERS = ("WEB_CONCURRENCY",)


@dataclass(frozen=True)
class TrtllmEnv:
    """What the TensorRT-LLM variables of one environment mean here."""

    schedule_style: str | None = None  # TRTLLM_DISAGG_SCHEDULE_STYLE
    no_retry: bool = False  # TRTLLM_DISAGG_NO_RETRY=1
    disable_gc: bool = True  # TRTLLM_DISAGG_SERVER_DISABLE_GC (default "1")
    worker_process_id: int | None = None  # TRTLLM_DISAGG_WORKER_PROCESS_ID
    log_level: str | None = None  # TLLM_LOG_LEVEL, lower case, a LOG_LEVELS name
    warnings: tuple[str, ...] = ()
    benchmark_gen_only: bool = False  # TRTLLM_DISAGG_BENCHMARK_GEN_ONLY=1
    msgspec: bool = False  # TRTLLM_SERVE_ENABLE_MSGSPEC=1


def read_env(environ: Mapping[str, str] | None = None) -> TrtllmEnv:
    """Read every variable of the table above from `environ` (default: `os.environ`).

    Raises `ConfigError` whose `problems` has one line per variable that cannot be honoured.
    """
    env = os.environ if environ is None else environ
    problems: list[str] = []
    warnings: list[str] = []

    style = env.get("TRTLLM_DISAGG_SCHEDULE_STYLE") or None
    if style is not None and style not in SCHEDULE_STYLES:
        problems.append(f"TRTLLM_DISAGG_SCHEDULE_STYLE: {style!r} is not context_first or generation_first")

    no_retry_value = env.get("TRTLLM_DISAGG_NO_RETRY")
    no_retry = no_retry_value == "1"
    if no_retry_value not in (None, "", "0", "1"):
        warnings.append(
            f"TRTLLM_DISAGG_NO_RETRY={no_retry_value!r} is not 1, so legs are still retried (TensorRT-LLM reads only 1)"
        )

    disable_gc = True
    gc_value = env.get("TRTLLM_DISAGG_SERVER_DISABLE_GC")
    if gc_value is not None:
        try:
            disable_gc = int(gc_value) != 0
        except ValueError:
            problems.append(
                f"TRTLLM_DISAGG_SERVER_DISABLE_GC: {gc_value!r} is not an integer; 0 keeps the garbage collector "
                "on, 1 (the default) turns it off"
            )

    process_id = None
    pid_value = env.get("TRTLLM_DISAGG_WORKER_PROCESS_ID")
    if pid_value is not None:
        try:
            process_id = int(pid_value)
        except ValueError:
            process_id = -1
        if not 0 <= process_id < PROCESS_ID_SPACE:
            problems.append(
                f"TRTLLM_DISAGG_WORKER_PROCESS_ID: {pid_value!r} is not an integer in [0, {PROCESS_ID_SPACE}) "
                "(the request id's process_id field)"
            )
            process_id = None

    version = env.get("TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION")
    if version not in (None, "", "0"):
        what = (
            "the v1 generation-grant lifecycle protocol is not supported"
            if version == "1"
            else f"{version!r} is not a protocol version (0 or 1)"
        )
        problems.append(
            f"TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION: {what}; unset it or set 0 (v0, TensorRT-LLM's default handoff)"
        )
        for name in LIFECYCLE_COMPANIONS:
            if name in env:
                problems.append(f"{name}: a setting of the v1 lifecycle protocol, which is not supported; unset it")

    if env.get("TRTLLM_DISAGG_COORDINATOR_PORT") is not None:
        problems.append(
            "TRTLLM_DISAGG_COORDINATOR_PORT: shmdisagg runs no TCP coordinator (its API is a private Unix socket, "
            "shmdisagg.coordinator_socket, and routing state lives in shared memory); unset it"
        )
    if env.get("TRTLLM_DISAGG_COORDINATOR_UDS") == "0":
        problems.append(
            "TRTLLM_DISAGG_COORDINATOR_UDS: 0 asks for a TCP coordinator, which shmdisagg does not run "
            "(its API is a private Unix socket, shmdisagg.coordinator_socket); unset it"
        )
    if env.get("TRTLLM_DISAGG_COORDINATOR_RESERVATION_TIMEOUT") is not None:
        warnings.append(
            "TRTLLM_DISAGG_COORDINATOR_RESERVATION_TIMEOUT has no effect: there are no reservations to expire "
            "(a pick is released when its leg ends, a dead fleet worker's picks when it dies)"
        )
    if env.get("WEB_CONCURRENCY") is not None:
        warnings.append(
            "WEB_CONCURRENCY is ignored, as by TensorRT-LLM's trtllm-serve disaggregated; num_workers sets the "
            "fleet size"
        )

    log_level = None
    level_value = env.get("TLLM_LOG_LEVEL")
    if level_value is not None:
        log_level = level_value.lower()
        if log_level not in LOG_LEVELS:
            warnings.append(
                f"TLLM_LOG_LEVEL={level_value!r} is not a log level ({', '.join(LOG_LEVELS)}); using warning, as "
                "TensorRT-LLM does"
            )
            log_level = "warning"

    gen_only = env.get("TRTLLM_DISAGG_BENCHMARK_GEN_ONLY") == "1"
    msgspec = env.get("TRTLLM_SERVE_ENABLE_MSGSPEC") == "1"

    if problems:
        raise ConfigError(
            problems[0] if len(problems) == 1 else f"{problems[0]} (and {len(problems) - 1} more)", problems
        )
    return TrtllmEnv(style, no_retry, disable_gc, process_id, log_level, tuple(warnings), gen_only, msgspec)


def resolve_log_level(env: TrtllmEnv, flag: str | None, configured: str) -> str:
    """The log level name a process uses: `TLLM_LOG_LEVEL`, else `-l/--log_level`, else the
    config's `shmdisagg.log_level` (TensorRT-LLM's logger ignores `set_level` once the
    variable is set)."""
    return env.log_level or flag or configured


def apply_gc(env: TrtllmEnv) -> None:
    """Freeze the start-up objects (they live as long as the process) and, unless
    `TRTLLM_DISAGG_SERVER_DISABLE_GC=0`, turn the cyclic collector off, as TensorRT-LLM does
    in its orchestrator processes: a collection pauses the event loop of every request."""
    import gc

    gc.freeze()
    if env.disable_gc:
        gc.disable()
