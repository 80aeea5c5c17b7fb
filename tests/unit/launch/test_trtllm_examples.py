"""TensorRT-LLM's own disaggregated config files load unchanged, and the launcher plans from
their keys when a `shmdisagg.executors` section is added (`tensorrt_llm/llmapi/disagg_utils.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shmdisagg.config import load_config, parse_config
from shmdisagg.executors.plan import PlanError, build_plan

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "trtllm"


@pytest.mark.parametrize("name", ["disagg_config.yaml", "disagg_config_fleet.yaml", "disagg_config_llm_args.yaml"])
def test_tensorrt_llm_example_configs_load_unchanged(name: str) -> None:
    cfg = load_config(EXAMPLES / name)
    assert cfg.port == 8000 and cfg.hostname == "localhost"
    assert cfg.shmdisagg.executors is None
    assert build_plan(cfg, None, {}).instances == ()  # executors already running elsewhere


def test_the_fleet_example_keeps_its_workers_and_routers() -> None:
    cfg = load_config(EXAMPLES / "disagg_config_fleet.yaml")
    assert cfg.num_workers == 4
    assert (cfg.context_servers.router.type, cfg.generation_servers.router.type) == ("kv_cache_aware", "kv_cache_aware")
    assert [a for a in cfg.context_servers.addresses()] == [("localhost", 8001), ("localhost", 8002)]


def test_the_llm_args_example_plans_instances_from_tensorrt_llm_keys() -> None:
    data = yaml.safe_load((EXAMPLES / "disagg_config_llm_args.yaml").read_text())
    data["shmdisagg"] = {"executors": {"backend": "trtllm"}}
    plan = build_plan(parse_config(data), None, {})
    ctx, gen = plan.instances
    assert plan.model == "TinyLlama/TinyLlama-1.1B-Chat-v1.0"  # the top-level model
    assert ctx.argv[ctx.argv.index("--backend") + 1] == "pytorch"
    assert ctx.options is not None and gen.options is not None
    assert ctx.options["cache_transceiver_config"] == {"backend": "DEFAULT"}
    # the top-level free_gpu_memory_fraction applies where a section does not set its own
    assert ctx.options["kv_cache_config"]["free_gpu_memory_fraction"] == 0.2
    assert gen.options["kv_cache_config"]["free_gpu_memory_fraction"] == 0.25
    # top-level LLM arguments are inherited by both roles
    assert ctx.options["disable_overlap_scheduler"] is gen.options["disable_overlap_scheduler"] is True
    assert (ctx.gpus, gen.gpus) == (("0",), ("1",))


def test_the_basic_example_cannot_be_launched_without_a_transceiver_backend() -> None:
    data = yaml.safe_load((EXAMPLES / "disagg_config.yaml").read_text())
    data["shmdisagg"] = {"executors": {"backend": "trtllm", "model": "TinyLlama/TinyLlama-1.1B-Chat-v1.0"}}
    with pytest.raises(PlanError, match=r"^context_servers\.cache_transceiver_config\.backend: not set"):
        build_plan(parse_config(data), None, {})
