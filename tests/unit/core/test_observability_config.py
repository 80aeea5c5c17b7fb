"""The observability keys are read, not ignored: `otlp_config` and `perf_metrics_output_dir` are
typed keys, what a worker could not honour (no OpenTelemetry exporter, an unwritable directory,
an unwritable `TRTLLM_REQUEST_TRACE_DIR`) is refused before anything starts in one line naming
the key, and launched executors get `return_perf_metrics` forced on by either key, as
TensorRT-LLM forces it into both sections."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from shmdisagg.config import ConfigError, check_machine, parse_config
from shmdisagg.executors.trtllm import role_options
from shmdisagg.observe import Observability
from shmdisagg.tracing import otlp_problem
from tests.conftest import free_port
from tests.fakes.trtllm_shim import REPO


def _cfg(**top: Any) -> dict[str, Any]:
    return {
        "hostname": "127.0.0.1",
        "port": free_port(),
        "context_servers": {"urls": [f"127.0.0.1:{free_port()}"]},
        "generation_servers": {"urls": [f"127.0.0.1:{free_port()}"]},
        **top,
    }


def test_the_keys_are_typed_and_an_unknown_otlp_key_is_refused() -> None:
    cfg = parse_config(
        _cfg(
            perf_metrics_output_dir="/tmp/perf", otlp_config={"otlp_traces_endpoint": "http://collector:4318/v1/traces"}
        )
    )
    assert cfg.perf_metrics_output_dir == "/tmp/perf" and cfg.otlp_config is not None
    assert cfg.otlp_config.otlp_traces_endpoint == "http://collector:4318/v1/traces"
    assert "otlp_config" not in (cfg.model_extra or {}) and "perf_metrics_output_dir" not in (cfg.model_extra or {})
    with pytest.raises(ConfigError, match="otlp_config.otlp_endpoint"):
        parse_config(_cfg(otlp_config={"otlp_endpoint": "x"}))


def test_otlp_needs_a_known_protocol_and_its_exporter() -> None:
    assert otlp_problem({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}) is None  # installed by the test extra
    assert "'http/json' is not one of grpc, http/protobuf" in (
        otlp_problem({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}) or ""
    )
    import importlib.util

    grpc = importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is not None
    problem = otlp_problem({})  # grpc: upstream's default protocol
    assert (problem is None) == grpc
    if not grpc:
        assert problem is not None and "pip install 'shmdisagg[otlp]'" in problem


def test_a_real_otlp_exporter_is_built_for_the_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    obs = Observability.from_config(
        parse_config(_cfg(otlp_config={"otlp_traces_endpoint": "http://127.0.0.1:9/v1/traces"})), environ={}
    )
    assert obs.tracing is not None and obs.enabled
    processor = obs.tracing.provider._active_span_processor._span_processors[0]
    assert type(processor).__name__ == "BatchSpanProcessor"
    obs.tracing.provider.shutdown()


def test_nothing_is_observed_without_the_keys() -> None:
    obs = Observability.from_config(parse_config(_cfg()), environ={})
    assert not obs.enabled

    async def handle(*_: Any) -> None: ...

    assert obs.wrap(handle) is handle  # the request path is untouched


def _check(tmp_path: Path, env: dict[str, str] | None = None, **top: Any) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(_cfg(**top)))
    return subprocess.run(
        [sys.executable, "-m", "shmdisagg.cli", "check-config", "-c", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_check_config_refuses_what_a_worker_could_not_honour(tmp_path: Path) -> None:
    import os

    afile = tmp_path / "afile"
    afile.write_text("")
    out = _check(tmp_path, perf_metrics_output_dir=str(afile))
    assert out.returncode == 2 and out.stderr.strip().endswith(
        f"perf_metrics_output_dir: {afile} exists and is not a directory"
    ), out.stderr
    out = _check(tmp_path, env={**os.environ, "TRTLLM_REQUEST_TRACE_DIR": str(afile)})
    assert out.returncode == 2 and out.stderr.strip().endswith(
        f"TRTLLM_REQUEST_TRACE_DIR: {afile} exists and is not a directory"
    ), out.stderr
    env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "zipkin"}
    out = _check(tmp_path, env=env, otlp_config={"otlp_traces_endpoint": "http://127.0.0.1:4317"})
    assert (
        out.returncode == 2
        and "otlp_config.otlp_traces_endpoint: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='zipkin'" in out.stderr
    ), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    ok = _check(tmp_path, perf_metrics_output_dir=str(tmp_path / "new" / "perf"))
    assert ok.returncode == 0, ok.stderr


def test_check_machine_accepts_usable_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRTLLM_REQUEST_TRACE_DIR", str(tmp_path / "trace"))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    check_machine(
        parse_config(
            _cfg(perf_metrics_output_dir=str(tmp_path), otlp_config={"otlp_traces_endpoint": "http://127.0.0.1:4318"})
        ),
        False,
    )


@pytest.mark.parametrize("top", [{"return_perf_metrics": True}, {"perf_metrics_output_dir": "/tmp/perf"}])
def test_either_key_forces_return_perf_metrics_into_launched_executors(top: dict[str, Any]) -> None:
    raw = _cfg(model="m", backend="pytorch", **top)
    for key in ("context_servers", "generation_servers"):
        raw[key].update(return_perf_metrics=False, cache_transceiver_config={"backend": "UCX"})
    raw["shmdisagg"] = {"executors": {"backend": "trtllm", "model": "m"}}
    cfg = parse_config(raw)
    spec = cfg.shmdisagg.executors
    assert spec is not None
    for role in ("context", "generation"):
        options = role_options(cfg, spec, role)
        assert options["return_perf_metrics"] is True
        assert "perf_metrics_output_dir" not in options and "otlp_config" not in options  # the orchestrator's keys
