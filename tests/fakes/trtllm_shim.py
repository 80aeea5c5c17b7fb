"""Running the launcher's `trtllm` backend in tests: the `trtllm-serve` shim next to this file
(the executor simulator's trtllm-serve mode) goes first on PATH, and configs are the repo's
examples with this test's ports, shared-memory names and simulator speed."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import free_port

SHIM_DIR = Path(__file__).resolve().parent
REPO = SHIM_DIR.parents[1]
EXAMPLE_8GPU = REPO / "examples" / "trtllm_8gpu.yaml"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def put_shim_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """`trtllm-serve` resolves to the shim for this test and every process it starts."""
    monkeypatch.setenv("PATH", f"{SHIM_DIR}:{os.environ.get('PATH', '')}")
    monkeypatch.setenv("SHMDISAGG_SHIM_PYTHON", sys.executable)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def shim_env() -> dict[str, str]:
    """The environment for a subprocess (the `shmdisagg` CLI) that should find the shim."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = f"{SHIM_DIR}:{env.get('PATH', '')}"
    env["SHMDISAGG_SHIM_PYTHON"] = sys.executable
    return env


def localize(
    cfg: dict[str, Any], tmp: Path, shm_prefix: str, num_workers: int = 2, speedup: float = 20.0
) -> dict[str, Any]:
    """A copy of a deployment config made safe to run in a test: fresh loopback ports for the
    public listener and every executor, this test's shared-memory prefix and coordinator
    socket, quick health polling, `num_workers` fleet workers, and the simulator sped up (the
    `sim:` key of the option files, which only the shim reads)."""
    out = copy.deepcopy(cfg)
    out["hostname"] = "127.0.0.1"
    out["port"] = free_port()
    out["num_workers"] = num_workers
    for key in ("context_servers", "generation_servers"):
        if key in out and out[key].get("urls"):
            out[key]["urls"] = [f"127.0.0.1:{free_port()}" for _ in out[key]["urls"]]
    sd = out.setdefault("shmdisagg", {})
    sd["shm"] = {"prefix": shm_prefix}
    sd["coordinator_socket"] = str(tmp / "coord.sock")
    sd["health_check_interval_s"] = 0.2
    sd["request_timeout_s"] = 30
    ex = sd.setdefault("executors", {})
    ex["startup_timeout_s"] = 60
    ex["stop_timeout_s"] = 10
    trt = ex.setdefault("trtllm", {})
    trt.setdefault("extra_llm_api_options", {}).setdefault("sim", {})["speedup"] = speedup
    return out


def write(cfg: dict[str, Any], tmp: Path, name: str = "config.yaml") -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def small_config(**sections: Any) -> dict[str, Any]:
    """One context and one generation instance at TP1 on GPUs 0 and 1; `sections` are merged
    into `context_servers` / `generation_servers` / `shmdisagg.executors`."""
    common = {"cache_transceiver_config": {"backend": "UCX"}, "kv_cache_config": {"event_buffer_max_size": 256}}
    cfg: dict[str, Any] = {
        "port": free_port(),  # a launch refuses a public port in use: never assume 8000 is free
        "context_servers": {"num_instances": 1, "urls": ["127.0.0.1:1"], **copy.deepcopy(common)},
        "generation_servers": {"num_instances": 1, "urls": ["127.0.0.1:2"], **copy.deepcopy(common)},
        "shmdisagg": {"executors": {"backend": "trtllm", "model": MODEL, "gpus": [0, 1]}},
    }
    for key, extra in sections.items():
        target = cfg["shmdisagg"]["executors"] if key == "executors" else cfg[key]
        target.update(extra)
    return cfg
