"""The launch plan: what `shmdisagg launch` starts for each executor, decided before anything runs.

`build_plan(config, run_dir)` turns the config into one `InstancePlan` per url of
`context_servers` and `generation_servers` (context first): the command line, the extra
environment, the GPUs and, for `trtllm-serve`, the extra LLM-API options YAML. It starts
nothing and writes nothing, so `shmdisagg launch --dry-run` prints exactly what a launch would
do (`describe_plan`). A plan that cannot work raises `PlanError`, one line naming the key.

Backend `sim`: the executor simulator (`python -m shmdisagg.executors.sim`), with the
`shmdisagg.executors.sim` settings of the config and the TensorRT-LLM options of the role it
models (`SIM_LLM_OPTIONS`: `max_batch_size`, `max_num_tokens`, `kv_cache_config`'s
`tokens_per_block`, `enable_block_reuse`, `event_buffer_max_size` and `kv_cache_event_hash_algo`,
`enable_chunked_prefill`,
`disable_overlap_scheduler`, `max_seq_len`; a section's own or the top level's), with
TensorRT-LLM's defaults where the config is silent, so the simulator serves what a real executor
with that config would. Backend `trtllm`: see `executors/trtllm.py`.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from shmdisagg.config import INT32_MAX, ConfigError, DisaggConfig, ExecutorsSection, ServerSection
from shmdisagg.hashing import KV_CACHE_HASH_ALGO_AUTO, KV_CACHE_HASH_ALGOS
from shmdisagg.hostport import authority

ROLE_SECTIONS = (("context", "context_servers"), ("generation", "generation_servers"))
UNSET_RUN_DIR = Path("<log-dir>")  # where files would go when a dry run has no --log-dir


class PlanError(ConfigError):
    """The executors cannot be planned from this config; the message names the key."""


# Options an executor needs that must not be printed (--dry-run) or be readable by others.
SECRET_OPTIONS = frozenset({"internal_request_auth_key"})


@dataclass(frozen=True)
class InstancePlan:
    """One executor process: `name` is `<role>-<index>` (also its log file's stem)."""

    name: str
    role: str  # "context" | "generation"
    host: str
    port: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the launcher's environment
    gpus: tuple[str, ...] = ()
    options: dict[str, Any] | None = None  # the extra LLM-API options YAML (trtllm-serve only)
    options_path: Path | None = None

    @property
    def addr(self) -> str:
        return authority(self.host, self.port)

    def options_yaml(self, redact: bool = False) -> str:
        """The options as YAML; `redact` hides secrets (`SECRET_OPTIONS`) for printing."""
        if self.options is None:
            return ""
        options = self.options
        if redact and any(k in options for k in SECRET_OPTIONS):
            options = {k: ("<redacted>" if k in SECRET_OPTIONS else v) for k, v in options.items()}
        return yaml.safe_dump(options, sort_keys=False, default_flow_style=False)

    def write_options(self) -> None:
        """Write the options YAML where the command line expects it (at launch, never in a dry
        run), readable by its owner only: it may hold `internal_request_auth_key`."""
        if self.options is not None and self.options_path is not None:
            fd = os.open(self.options_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)  # an older file of the same name keeps its mode otherwise
            with os.fdopen(fd, "w") as f:
                f.write(self.options_yaml())

    def shell_line(self) -> str:
        """The instance as one shell command line, environment first."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{env} {shlex.join(self.argv)}" if env else shlex.join(self.argv)


@dataclass(frozen=True)
class LaunchPlan:
    backend: str  # "sim" | "trtllm" | "" (no executors section: executors run elsewhere)
    model: str
    instances: tuple[InstancePlan, ...]
    run_dir: Path | None
    gpu_note: str = ""  # where the GPU ids came from


def build_plan(
    config: DisaggConfig, run_dir: Path | None = None, environ: Mapping[str, str] | None = None
) -> LaunchPlan:
    """The plan for `config`'s executors. `run_dir` holds logs and option files (None in a dry
    run without --log-dir); `environ` is the launcher's environment (default `os.environ`).
    Raises `PlanError`."""
    spec = config.shmdisagg.executors
    if spec is None:
        return LaunchPlan("", "", (), run_dir)
    if spec.backend == "trtllm":
        from shmdisagg.executors.trtllm import trtllm_plan

        return trtllm_plan(config, spec, run_dir, os.environ if environ is None else environ)
    instances = []
    for role, key in ROLE_SECTIONS:
        section = getattr(config, key)
        flags = sim_llm_flags(config, key, section)
        for i, (host, port) in enumerate(launch_addresses(config, section)):
            argv, env = executor_command(spec, role, section, host, port, flags)
            argv += sim_cluster_flags(config, role)
            instances.append(InstancePlan(f"{role}-{i}", role, host, port, argv, env))
    return LaunchPlan("sim", spec.model, tuple(instances), run_dir)


CLUSTER_HOST = "127.0.0.1"  # launched executors run here; the coordinator reaches them on loopback


def launch_addresses(config: DisaggConfig, section: ServerSection) -> list[tuple[str, int]]:
    """Where the launcher starts a section's executors: its urls; with `disagg_cluster`,
    `num_instances` executors on CLUSTER_HOST port 0, each binding a port the kernel picks and
    registering it in the cluster store (as `trtllm-serve --disagg_cluster_uri` may)."""
    if config.disagg_cluster is None:
        return section.addresses()
    return [(CLUSTER_HOST, 0)] * section.num_instances


def sim_cluster_flags(config: DisaggConfig, role: str) -> list[str]:
    """The simulator's registration flags under `disagg_cluster` (none without it)."""
    cluster = config.disagg_cluster
    if cluster is None:
        return []
    return [
        "--server-role", role,
        "--disagg-cluster-uri", cluster.cluster_uri,
        "--cluster-name", cluster.cluster_name,
        "--heartbeat-interval-sec", str(cluster.heartbeat_interval_sec),
        "--inactive-timeout-sec", str(cluster.inactive_timeout_sec),
    ]  # fmt: skip


def executor_command(
    spec: ExecutorsSection, role: str, section: ServerSection, host: str, port: int, llm_flags: Sequence[str] = ()
) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) for one simulated executor of `role` listening on host:port;
    `llm_flags` are its role's `sim_llm_flags`."""
    if spec.backend != "sim":
        raise ValueError(
            f"executor_command builds simulator commands; backend {spec.backend!r} goes through build_plan"
        )
    sim = spec.sim
    tpb = section.kv_cache_config.get("tokens_per_block")  # validated: a positive integer if set
    if tpb is None:
        tpb = sim.tokens_per_block
    argv = [
        sys.executable, "-m", "shmdisagg.executors.sim",
        "--host", host,
        "--port", str(port),
        "--role", role,
        "--model", spec.model,
        "--profile", sim.profile,
        "--tokens-per-block", str(tpb),
        "--num-blocks", str(sim.num_blocks),
        "--max-batch-size", str(section.max_batch_size or sim.max_batch_size),
        "--max-num-tokens", str(section.max_num_tokens or sim.max_num_tokens),
        "--speedup", str(sim.speedup),
        "--event-timestamps",  # so the coordinator can show the event-to-visibility lag (sim/kv_events.py)
        *llm_flags,
        *sim.extra_args,
    ]  # fmt: skip
    return argv, {}


# TensorRT-LLM LLM options the simulator models: key -> (simulator flag, kind, TensorRT-LLM's
# default or None to leave the simulator's). The event buffer defaults to 4096, the launcher's
# value for trtllm-serve too (TensorRT-LLM's 0 turns KV events off).
SIM_LLM_OPTIONS: dict[str, tuple[str, type, Any]] = {
    "kv_cache_config.enable_block_reuse": ("enable-block-reuse", bool, True),
    "kv_cache_config.event_buffer_max_size": ("event-buffer-max-size", int, 4096),
    "enable_chunked_prefill": ("enable-chunked-prefill", bool, False),
    "disable_overlap_scheduler": ("disable-overlap-scheduler", bool, None),
    "max_seq_len": ("max-seq-len", int, None),
    "kv_cache_config.kv_cache_event_hash_algo": ("kv-cache-event-hash-algo", str, None),
}


# the least value of an integer option (TensorRT-LLM: a sequence of no token is no limit)
_LEAST = {"max_seq_len": 1}


def check_llm_option(name: str, value: Any, where: str, router_type: str) -> None:
    """Refuse a `SIM_LLM_OPTIONS` value of the wrong type or range (`PlanError` naming `where`):
    the simulator's flags and trtllm-serve's option files are checked alike, so a value that
    TensorRT-LLM's LLM arguments would refuse at its start-up is refused in check-config."""
    kind = SIM_LLM_OPTIONS[name][1]
    if kind is bool:
        if not isinstance(value, bool):
            raise PlanError(f"{where}: must be true or false, got {value!r}")
    elif kind is str:
        choices = (KV_CACHE_HASH_ALGO_AUTO, *KV_CACHE_HASH_ALGOS)
        if value not in choices:
            raise PlanError(f"{where}: must be one of {', '.join(choices)}, got {value!r}")
    else:
        least = _LEAST.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise PlanError(f"{where}: must be an integer >= {least}, got {value!r}")
        if value > INT32_MAX:
            raise PlanError(f"{where}: must be at most {INT32_MAX} (TensorRT-LLM's sizes are 32-bit), got {value!r}")
        if name.endswith("event_buffer_max_size") and value == 0 and router_type == "kv_cache_aware":
            raise PlanError(f"{where}: 0 turns KV events off, and the kv_cache_aware router needs them")


def sim_llm_flags(config: DisaggConfig, key: str, section: ServerSection) -> list[str]:
    """The simulator flags for the `SIM_LLM_OPTIONS` of section `key` (its own value, else the
    top level's, which TensorRT-LLM passes to both sections, else the default). Raises
    `PlanError` naming the key for a value of the wrong type, and for an event buffer of 0 under
    a `kv_cache_aware` router, as the trtllm plan does."""
    top = config.model_extra or {}
    flags: list[str] = []
    for name, (flag, kind, default) in SIM_LLM_OPTIONS.items():
        value = (
            _option(section.kv_cache_config, top.get("kv_cache_config"), name.split(".", 1)[1])
            if "." in name
            else _option(section.model_extra, top, name)
        )
        value = default if value is None else value
        if value is None:
            continue
        check_llm_option(name, value, config.key_of(key, name), section.router.type)
        if kind is bool:
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        elif kind is str:
            flags += [f"--{flag}", value]
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def _option(own: Mapping[str, Any] | None, top: Any, name: str) -> Any:
    if own and own.get(name) is not None:
        return own[name]
    return top.get(name) if isinstance(top, Mapping) else None


def describe_plan(plan: LaunchPlan, config: DisaggConfig, config_path: str) -> str:
    """The plan as `shmdisagg launch --dry-run` prints it: copy-pasteable command lines."""
    out = [f"shmdisagg launch plan for {config_path} (dry run: nothing started, nothing written)", ""]
    if not plan.instances:
        out.append("executors: none (no shmdisagg.executors section: the urls must already be serving)")
    else:
        what = {"sim": "executor simulator", "trtllm": "trtllm-serve"}[plan.backend]
        n_ctx = sum(1 for i in plan.instances if i.role == "context")
        out.append(
            f"executors: {len(plan.instances)} x {what} ({n_ctx} context, {len(plan.instances) - n_ctx} "
            f"generation), model {plan.model}"
        )
        gpus = [g for inst in plan.instances for g in inst.gpus]
        if gpus:
            out.append(f"GPUs: {', '.join(gpus)} ({plan.gpu_note})")
        run_dir = plan.run_dir or UNSET_RUN_DIR
        note = (
            ""
            if plan.run_dir
            else f" (at launch: --log-dir, else {tempfile.gettempdir()}/{config.shm_prefix}-logs, reused by each "
            "launch)"
        )
        out.append(f"logs and option files: {run_dir}{note}")
    for inst in plan.instances:
        out.append("")
        placed = f"GPUs {','.join(inst.gpus)}" if inst.gpus else "no GPU"
        out.append(
            f"[{inst.name}] {inst.role} on {inst.addr}, {placed}, log "
            f"{(plan.run_dir or UNSET_RUN_DIR) / (inst.name + '.log')}"
        )
        out.append(f"  $ {inst.shell_line()}")
        if inst.options is not None:
            out.append(f"  {inst.options_path}:")
            out.extend(f"    {line}" for line in inst.options_yaml(redact=True).rstrip("\n").split("\n"))
    out.append("")
    out.append(
        f"then: {shlex.join([sys.executable, '-m', 'shmdisagg.coordinator', '-c', os.path.abspath(config_path)])}"
    )
    out.append(
        f"      coordinator + {config.num_workers} fleet worker{'s' if config.num_workers != 1 else ''} on "
        f"{config.hostname}:{config.port} "
        f"(routers {config.context_servers.router.type}/{config.generation_servers.router.type}, "
        f"schedule {config.schedule_style}, shared memory /dev/shm/{config.shm_prefix}-*)"
    )
    return "\n".join(out)
