"""TensorRT-LLM's environment variables (shmdisagg/trtllm_env.py): each has TensorRT-LLM's effect
or stops check-config and start-up with exit 2, naming it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shmdisagg.config import ConfigError, parse_config
from shmdisagg.fleet.overrides import FleetOverrides
from shmdisagg.fleet.worker import process_id
from shmdisagg.trtllm_env import TrtllmEnv, read_env, resolve_log_level
from tests.conftest import free_port


def _problems(env: dict[str, str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        read_env(env)
    return info.value.problems


def test_unset_means_tensorrt_llms_defaults() -> None:
    env = read_env({})
    assert env == TrtllmEnv(
        schedule_style=None, no_retry=False, disable_gc=True, worker_process_id=None, log_level=None, warnings=()
    )


@pytest.mark.parametrize(
    ("variables", "field", "value"),
    [
        ({"TRTLLM_DISAGG_NO_RETRY": "1"}, "no_retry", True),
        ({"TRTLLM_DISAGG_NO_RETRY": "0"}, "no_retry", False),
        ({"TRTLLM_DISAGG_SERVER_DISABLE_GC": "0"}, "disable_gc", False),
        ({"TRTLLM_DISAGG_SERVER_DISABLE_GC": "1"}, "disable_gc", True),
        ({"TRTLLM_SERVER_DISABLE_GC": "1"}, "disable_gc", True),  # the worker server's variable, not the orchestrator's
        ({"TRTLLM_SERVER_DISABLE_GC": "1", "TRTLLM_DISAGG_SERVER_DISABLE_GC": "0"}, "disable_gc", False),
        ({"TRTLLM_DISAGG_WORKER_PROCESS_ID": "63"}, "worker_process_id", 63),
        ({"TRTLLM_DISAGG_SCHEDULE_STYLE": "generation_first"}, "schedule_style", "generation_first"),
        (
            {"TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION": "0", "TRTLLM_DISAGG_GEN_GRANT_TTL_S": "600"},
            "warnings",
            (),
        ),  # v0: as upstream
        ({"TLLM_LOG_LEVEL": "DEBUG"}, "log_level", "debug"),
        ({"TLLM_LOG_LEVEL": "loud"}, "log_level", "warning"),  # TensorRT-LLM's logger falls back to warning
        ({"TRTLLM_DISAGG_COORDINATOR_UDS": "1"}, "warnings", ()),  # a Unix socket: what runs here
    ],
)
def test_each_variable_means_what_it_means_in_tensorrt_llm(
    variables: dict[str, str], field: str, value: object
) -> None:
    assert getattr(read_env(variables), field) == value


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        (
            {"TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION": "1"},
            [
                "TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION: the v1 generation-grant lifecycle protocol is not "
                "supported; unset it or set 0"
            ],
        ),
        (
            {
                "TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION": "1",
                "TRTLLM_DISAGG_GEN_GRANT_TTL_S": "600",
                "TRTLLM_DISAGG_ARTIFACT_TTL_S": "60",
            },
            [
                "TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION: ",
                "TRTLLM_DISAGG_GEN_GRANT_TTL_S: a setting of the v1 lifecycle protocol",
                "TRTLLM_DISAGG_ARTIFACT_TTL_S: a setting of the v1 lifecycle protocol",
            ],
        ),
        (
            {"TRTLLM_DISAGG_COORDINATOR_PORT": "7999"},
            ["TRTLLM_DISAGG_COORDINATOR_PORT: shmdisagg runs no TCP coordinator"],
        ),
        ({"TRTLLM_DISAGG_COORDINATOR_UDS": "0"}, ["TRTLLM_DISAGG_COORDINATOR_UDS: 0 asks for a TCP coordinator"]),
        (
            {"TRTLLM_DISAGG_WORKER_PROCESS_ID": "64"},
            ["TRTLLM_DISAGG_WORKER_PROCESS_ID: '64' is not an integer in [0, 64)"],
        ),
        (
            {"TRTLLM_DISAGG_WORKER_PROCESS_ID": "x"},
            ["TRTLLM_DISAGG_WORKER_PROCESS_ID: 'x' is not an integer in [0, 64)"],
        ),
        ({"TRTLLM_DISAGG_SERVER_DISABLE_GC": "yes"}, ["TRTLLM_DISAGG_SERVER_DISABLE_GC: 'yes' is not an integer"]),
        (
            {"TRTLLM_DISAGG_SCHEDULE_STYLE": "whenever"},
            ["TRTLLM_DISAGG_SCHEDULE_STYLE: 'whenever' is not context_first or generation_first"],
        ),
    ],
)
def test_variables_that_cannot_be_honoured_are_refused_by_name(variables: dict[str, str], expected: list[str]) -> None:
    problems = _problems(variables)
    assert len(problems) == len(expected) and all(p.startswith(e) for p, e in zip(problems, expected, strict=True)), (
        problems
    )


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        (
            {"WEB_CONCURRENCY": "4"},
            "WEB_CONCURRENCY is ignored, as by TensorRT-LLM's trtllm-serve disaggregated; num_workers sets the "
            "fleet size",
        ),
        (
            {"TRTLLM_DISAGG_COORDINATOR_RESERVATION_TIMEOUT": "600"},
            "TRTLLM_DISAGG_COORDINATOR_RESERVATION_TIMEOUT has no effect",
        ),
        ({"TRTLLM_DISAGG_NO_RETRY": "true"}, "TRTLLM_DISAGG_NO_RETRY='true' is not 1, so legs are still retried"),
        ({"TLLM_LOG_LEVEL": "loud"}, "TLLM_LOG_LEVEL='loud' is not a log level"),
    ],
)
def test_variables_without_an_effect_here_are_named_in_a_warning(variables: dict[str, str], expected: str) -> None:
    warnings = read_env(variables).warnings
    assert len(warnings) == 1 and warnings[0].startswith(expected), warnings


def test_tllm_log_level_wins_over_the_flag_which_wins_over_the_file() -> None:
    assert resolve_log_level(read_env({}), None, "info") == "info"
    assert resolve_log_level(read_env({}), "trace", "info") == "trace"
    assert resolve_log_level(read_env({"TLLM_LOG_LEVEL": "ERROR"}), "trace", "info") == "error"


@pytest.mark.parametrize(("value", "enabled"), [(None, False), ("1", False), ("0", True), ("2", False)])
def test_the_garbage_collector_is_off_in_orchestrator_processes_unless_the_variable_is_0(
    value: str | None, enabled: bool
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRTLLM_DISAGG_SERVER_DISABLE_GC"}
    if value is not None:
        env["TRTLLM_DISAGG_SERVER_DISABLE_GC"] = value
    code = "import gc; from shmdisagg.trtllm_env import apply_gc, read_env; apply_gc(read_env()); print(gc.isenabled())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == str(enabled)


def test_the_process_id_is_the_variable_for_one_worker_and_the_index_in_a_fleet() -> None:
    base = {"generation_servers": {"urls": ["localhost:8002"]}, "context_servers": {"urls": ["localhost:8001"]}}
    one, fleet = parse_config({**base, "num_workers": 1}), parse_config({**base, "num_workers": 4})
    assert process_id(one, read_env({"TRTLLM_DISAGG_WORKER_PROCESS_ID": "9"}), 0) == 9
    assert process_id(one, read_env({}), 0) == 0
    # TensorRT-LLM's fleet launcher gives each worker its index, whatever the parent's environment says
    assert [process_id(fleet, read_env({"TRTLLM_DISAGG_WORKER_PROCESS_ID": "9"}), i) for i in range(4)] == [0, 1, 2, 3]


def test_node_id_defaults_to_tensorrt_llms_mac_hash_and_reaches_the_id_field(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import uuid

    from shmdisagg.fleet.worker import node_claim
    from shmdisagg.orchestrator.ids import DisaggIdGenerator

    base = {"generation_servers": {"urls": ["localhost:8002"]}, "context_servers": {"urls": ["localhost:8001"]}}
    with node_claim(parse_config(base), {}, str(tmp_path)) as free:
        assert free.node_id == uuid.getnode() % 256  # DisaggServerConfig's default, when no deployment here holds it
        handed = node_claim(
            parse_config(base), free.env(), str(tmp_path)
        )  # a worker uses the coordinator's (same fd here)
        assert (handed.node_id, handed.fd) == (free.node_id, free.fd)
    with node_claim(parse_config({**base, "node_id": 200}), {}, str(tmp_path)) as claim:
        raw = DisaggIdGenerator(claim.node_id, 5).next_id() - (1 << 40)
    assert ((raw >> 16) & 0xFF, (raw >> 10) & 0x3F) == (200, 5)


def test_command_line_overrides_reach_every_worker_through_its_environment() -> None:
    sent = FleetOverrides(public_port=41234, leg_timeout_s=7200.0, log_level="verbose")
    assert FleetOverrides.from_environ(sent.to_environ()) == sent
    assert (
        FleetOverrides.from_environ(FleetOverrides(leg_timeout_s=None).to_environ()).leg_timeout_s is None
    )  # -r 0: no limit
    assert FleetOverrides.from_environ({}) == FleetOverrides()  # a worker started without them: TensorRT-LLM's 180 s
    cfg = parse_config(
        {"port": 0, "generation_servers": {"urls": ["localhost:8002"]}, "context_servers": {"urls": ["localhost:8001"]}}
    )
    moved = sent.apply(cfg)
    assert moved.port == 41234 and moved.shm_prefix.endswith("-41234")


def test_check_config_refuses_a_variable_in_one_line_and_warns_about_others(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "hostname": "127.0.0.1",
                "port": free_port(),
                "context_servers": {"urls": ["127.0.0.1:8001"]},
                "generation_servers": {"urls": ["127.0.0.1:8002"]},
            }
        )
    )
    env = {**os.environ, "TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION": "1", "WEB_CONCURRENCY": "4"}
    out = subprocess.run(
        [sys.executable, "-m", "shmdisagg.cli", "check-config", "-c", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines() == [
        "shmdisagg: config error: TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION: the v1 generation-grant lifecycle "
        "protocol is not supported; "
        "unset it or set 0 (v0, TensorRT-LLM's default handoff)"
    ]
    del env["TRTLLM_DISAGG_LIFECYCLE_PROTOCOL_VERSION"]
    out = subprocess.run(
        [sys.executable, "-m", "shmdisagg.cli", "check-config", "-c", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "shmdisagg: warning: WEB_CONCURRENCY is ignored" in out.stderr, out
