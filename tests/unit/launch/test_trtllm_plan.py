"""The trtllm-serve launch plan: commands, environment, GPUs and option files from the config,
and one-line refusals naming the key when the plan cannot work."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from shmdisagg.config import ConfigError, parse_config
from shmdisagg.executors.plan import PlanError, build_plan, executor_command, sim_llm_flags
from shmdisagg.executors.trtllm import assign_gpus
from tests.fakes.trtllm_shim import EXAMPLE_8GPU, MODEL, put_shim_on_path, small_config

RUN = Path("/run/dir")


def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE_8GPU.read_text())


def plan_of(cfg: dict[str, Any], environ: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return build_plan(parse_config(cfg, "cfg.yaml"), RUN, environ or {})


def refusal(cfg: dict[str, Any], environ: dict[str, str] | None = None) -> str:
    with pytest.raises(PlanError) as info:
        plan_of(cfg, environ)
    msg = str(info.value)
    assert "\n" not in msg
    assert isinstance(info.value, ConfigError)  # the CLI exits 2 on it
    return msg


def test_the_8gpu_example_gives_each_instance_its_own_gpus_port_and_command() -> None:
    plan = plan_of(example())
    assert plan.backend == "trtllm" and plan.model == MODEL
    got = [(i.name, i.port, i.gpus, i.env["CUDA_VISIBLE_DEVICES"]) for i in plan.instances]
    assert got == [
        ("context-0", 8001, ("0",), "0"),
        ("context-1", 8002, ("1",), "1"),
        ("context-2", 8003, ("2",), "2"),
        ("context-3", 8004, ("3",), "3"),
        ("generation-0", 8005, ("4", "5"), "4,5"),
        ("generation-1", 8006, ("6", "7"), "6,7"),
    ]
    gen = plan.instances[4]
    assert gen.argv == [
        "trtllm-serve", MODEL,
        "--host", "127.0.0.1", "--port", "8005",
        "--backend", "pytorch",
        "--tp_size", "2", "--pp_size", "1",
        "--max_batch_size", "256", "--max_num_tokens", "8192",
        "--extra_llm_api_options", str(RUN / "generation-0.yaml"),
        "--log_level", "info",
    ]  # fmt: skip
    assert gen.options_path == RUN / "generation-0.yaml"


def test_generated_options_carry_what_disaggregation_and_kv_events_need() -> None:
    plan = plan_of(example())
    ctx, gen = plan.instances[0].options, plan.instances[4].options
    assert ctx is not None and gen is not None
    assert ctx["cache_transceiver_config"] == gen["cache_transceiver_config"] == {"backend": "NIXL"}
    assert ctx["kv_cache_config"] == {
        "enable_block_reuse": True, "event_buffer_max_size": 4096, "tokens_per_block": 32,
        "free_gpu_memory_fraction": 0.85,
    }  # fmt: skip
    assert (ctx["max_batch_size"], ctx["max_num_tokens"]) == (16, 16384)
    assert (gen["max_batch_size"], gen["max_num_tokens"]) == (256, 8192)
    assert ctx["disable_overlap_scheduler"] is True
    assert "disable_overlap_scheduler" not in gen  # TensorRT-LLM's default (overlap on) for generation
    assert ctx["return_perf_metrics"] is gen["return_perf_metrics"] is True
    assert gen["tensor_parallel_size"] == 2
    # the YAML written at launch is exactly these options
    assert yaml.safe_load(plan.instances[0].options_yaml()) == ctx


def test_generated_defaults_fill_what_a_minimal_section_leaves_out() -> None:
    cfg = small_config()
    cfg["context_servers"].pop("kv_cache_config")
    plan = plan_of(cfg)
    ctx = plan.instances[0].options
    assert ctx is not None
    assert ctx["kv_cache_config"] == {
        "enable_block_reuse": True, "event_buffer_max_size": 4096, "tokens_per_block": 32,
        "free_gpu_memory_fraction": 0.9,
    }  # fmt: skip
    assert (ctx["max_batch_size"], ctx["max_num_tokens"]) == (2048, 8192)
    # a section that sets one kv_cache_config key keeps the other generated ones
    gen = plan.instances[1].options
    assert gen is not None and gen["kv_cache_config"]["event_buffer_max_size"] == 256
    assert gen["kv_cache_config"]["enable_block_reuse"] is True


def test_config_values_win_over_generated_ones() -> None:
    cfg = small_config(context_servers={"disable_overlap_scheduler": False, "return_perf_metrics": False})
    ctx = plan_of(cfg).instances[0].options
    assert ctx is not None and ctx["disable_overlap_scheduler"] is False and ctx["return_perf_metrics"] is False
    # ...except that a top-level return_perf_metrics forces it on, as in TensorRT-LLM
    cfg["return_perf_metrics"] = True
    ctx = plan_of(cfg).instances[0].options
    assert ctx is not None and ctx["return_perf_metrics"] is True


def test_extra_options_and_environment_reach_every_instance() -> None:
    cfg = small_config(
        executors={
            "trtllm": {
                "extra_llm_api_options": {"sim": {"speedup": 5.0}, "kv_cache_config": {"tokens_per_block": 64}},
                "env": {"NCCL_DEBUG": "WARN"},
                "extra_args": ["--trust_remote_code"],
                "command": ["/opt/bin/trtllm-serve"],
                "log_level": "warning",
            }
        }
    )
    plan = plan_of(cfg)
    for inst in plan.instances:
        assert inst.options is not None
        assert inst.options["sim"] == {"speedup": 5.0}
        assert inst.options["kv_cache_config"]["tokens_per_block"] == 64
        assert inst.env["NCCL_DEBUG"] == "WARN"
        assert inst.argv[0] == "/opt/bin/trtllm-serve" and inst.argv[-1] == "--trust_remote_code"
        assert inst.argv[inst.argv.index("--log_level") + 1] == "warning"


@pytest.mark.parametrize("role", ["context_servers", "generation_servers"])
def test_a_role_without_a_transceiver_backend_is_refused_naming_the_key(role: str) -> None:
    cfg = small_config()
    del cfg[role]["cache_transceiver_config"]
    assert refusal(cfg).startswith(f"{role}.cache_transceiver_config.backend: not set")
    cfg[role]["cache_transceiver_config"] = {"backend": ""}
    assert refusal(cfg).startswith(f"{role}.cache_transceiver_config.backend")


def test_an_explicit_gpu_list_must_match_what_the_instances_need() -> None:
    cfg = example()
    cfg["shmdisagg"]["executors"]["gpus"] = [0, 1, 2, 3, 4, 5, 6]
    msg = refusal(cfg)
    assert msg == "shmdisagg.executors.gpus: lists 7 GPUs but the instances need 8 (4 context x 1 + 2 generation x 2)"
    cfg["shmdisagg"]["executors"]["gpus"] = list(range(9))
    assert "lists 9 GPUs but the instances need 8" in refusal(cfg)


def test_overlapping_gpus_are_refused_when_the_config_loads() -> None:
    cfg = example()
    cfg["shmdisagg"]["executors"]["gpus"] = [0, 1, 2, 3, 4, 5, 6, 6]
    with pytest.raises(ConfigError, match=r"shmdisagg\.executors\.gpus: GPU 6 is listed twice"):
        parse_config(cfg, "cfg.yaml")


def test_the_gpu_list_order_decides_who_gets_what() -> None:
    cfg = example()
    cfg["shmdisagg"]["executors"]["gpus"] = [4, 5, 6, 7, 0, 1, 2, 3]  # generation on the low GPUs
    assert [i.env["CUDA_VISIBLE_DEVICES"] for i in plan_of(cfg).instances] == ["4", "5", "6", "7", "0,1", "2,3"]


def test_without_a_gpu_list_the_launchers_cuda_visible_devices_is_the_pool() -> None:
    cfg = example()
    del cfg["shmdisagg"]["executors"]["gpus"]
    env = {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d,GPU-e,GPU-f,GPU-g,GPU-h,GPU-i"}
    plan = plan_of(cfg, env)
    assert plan.instances[5].env["CUDA_VISIBLE_DEVICES"] == "GPU-g,GPU-h"
    assert "GPU-i left unused" in plan.gpu_note
    assert "offers 3 GPUs but the instances need 8" in refusal(cfg, {"CUDA_VISIBLE_DEVICES": "0,1,2"})
    # and with neither, GPUs 0..N-1
    assert [g for i in plan_of(cfg).instances for g in i.gpus] == [str(n) for n in range(8)]


def test_pipeline_and_context_parallel_sizes_count_toward_an_instances_gpus() -> None:
    cfg = small_config(
        generation_servers={"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "context_parallel_size": 1},
        executors={"gpus": list(range(5))},
    )
    gen = plan_of(cfg).instances[1]
    assert gen.gpus == ("1", "2", "3", "4")
    assert gen.argv[gen.argv.index("--pp_size") + 1] == "2"
    cfg["generation_servers"]["tensor_parallel_size"] = 0
    assert refusal(cfg).startswith("generation_servers.tensor_parallel_size: must be a positive integer")


def test_assign_gpus_hands_out_consecutive_ids_in_order() -> None:
    gpus, note = assign_gpus([("context", 2, 1), ("generation", 1, 3)], None, {})
    assert gpus == [("0",), ("1",), ("2", "3", "4")]
    assert "first 5" in note


def test_top_level_llm_arguments_are_inherited_and_may_not_conflict() -> None:
    cfg = small_config()
    cfg["disable_overlap_scheduler"] = True  # inherited by both roles, as TensorRT-LLM does
    plan = plan_of(cfg)
    assert all(i.options and i.options["disable_overlap_scheduler"] is True for i in plan.instances)
    cfg["generation_servers"]["disable_overlap_scheduler"] = False
    with pytest.raises(ConfigError) as info:  # refused by the config itself, as extract_disagg_cfg does
        plan_of(cfg)
    assert str(info.value).startswith(
        "cfg.yaml: generation_servers.disable_overlap_scheduler: differs from the top-level disable_overlap_scheduler"
    )


def test_the_model_comes_from_the_executors_section_or_the_top_level() -> None:
    cfg = small_config()
    del cfg["shmdisagg"]["executors"]["model"]
    assert refusal(cfg).startswith("shmdisagg.executors.model: backend trtllm needs the model")
    cfg["model"] = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    plan = plan_of(cfg)
    assert plan.model == "TinyLlama/TinyLlama-1.1B-Chat-v1.0" and plan.instances[0].argv[1] == plan.model
    assert all(i.options is not None and "model" not in i.options for i in plan.instances)  # on the command line


def test_the_kv_cache_aware_router_needs_kv_events() -> None:
    cfg = small_config(
        context_servers={"router": {"type": "kv_cache_aware"}, "kv_cache_config": {"event_buffer_max_size": 0}}
    )
    assert refusal(cfg).startswith("context_servers.kv_cache_config.event_buffer_max_size: 0 turns KV events off")


def test_the_launcher_owns_cuda_visible_devices() -> None:
    cfg = small_config(executors={"trtllm": {"env": {"CUDA_VISIBLE_DEVICES": "3"}}})
    assert refusal(cfg).startswith("shmdisagg.executors.trtllm.env.CUDA_VISIBLE_DEVICES")


def test_a_section_without_urls_cannot_be_launched() -> None:
    # refused by the config's validation (check-config says the same), before any plan
    cfg = small_config()
    del cfg["context_servers"]["urls"]
    with pytest.raises(
        ConfigError,
        match=r"^cfg.yaml: context_servers.urls: none listed; a deployment needs at least one context executor",
    ):
        plan_of(cfg)


def test_the_simulator_backend_plan_is_the_simulator_command_line() -> None:
    cfg = small_config(executors={"backend": "sim", "gpus": None})
    config = parse_config(cfg, "cfg.yaml")
    plan = build_plan(config, RUN, {})
    assert plan.backend == "sim"
    assert [(i.name, i.options, i.gpus) for i in plan.instances] == [
        ("context-0", None, ()),
        ("generation-0", None, ()),
    ]
    spec = config.shmdisagg.executors
    assert spec is not None
    flags = sim_llm_flags(config, "context_servers", config.context_servers)
    assert plan.instances[0].argv == executor_command(spec, "context", config.context_servers, "127.0.0.1", 1, flags)[0]


def test_without_an_executors_section_nothing_is_planned() -> None:
    cfg = copy.deepcopy(small_config())
    del cfg["shmdisagg"]
    plan = plan_of(cfg)
    assert plan.instances == () and plan.backend == ""


def test_check_config_runs_the_plan_checks_that_launch_runs(
    tmp_path: Path, shm_prefix: str, hf_tokenizer_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config the trtllm plan refuses is refused by `check-config` too, in the same one line,
    instead of 'ok' there and a failure only at `launch`."""
    put_shim_on_path(monkeypatch)  # a trtllm-serve to run: check-config checks that too
    import subprocess
    import sys

    router = {
        "type": "kv_cache_aware",
        "tokenizer_dir": hf_tokenizer_dir,
    }  # the executors' tokenizer (loaded by check-config)
    cfg = small_config(context_servers={"router": router, "kv_cache_config": {"event_buffer_max_size": 0}})
    cfg["shmdisagg"].update(shm={"prefix": shm_prefix}, coordinator_socket=str(tmp_path / "coord.sock"))
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    expected = (
        f"shmdisagg: config error: {path}: context_servers.kv_cache_config.event_buffer_max_size: 0 turns KV events off"
    )
    for command in ("check-config", "launch"):
        out = subprocess.run(
            [sys.executable, "-m", "shmdisagg.cli", command, "-c", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, (command, out)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(expected), (command, out.stderr)
    cfg["context_servers"]["kv_cache_config"]["event_buffer_max_size"] = 64
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [sys.executable, "-m", "shmdisagg.cli", "check-config", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and ": ok" in out.stdout, out


def _sim_argv(cfg: dict[str, Any], role: int = 0) -> list[str]:
    cfg = copy.deepcopy(cfg)
    cfg["shmdisagg"]["executors"] = {"backend": "sim"}
    return build_plan(parse_config(cfg, "cfg.yaml"), RUN, {}).instances[role].argv


def test_the_simulator_gets_the_roles_trtllm_options_with_trtllm_defaults() -> None:
    """The simulator models what a trtllm-serve with the same section would do: block reuse,
    the event buffer and chunked prefill come from the section (or the top level), with
    TensorRT-LLM's defaults (chunked prefill off) and the launcher's event buffer of 4096."""
    plain = _sim_argv(small_config())
    assert plain[plain.index("--event-buffer-max-size") + 1] == "256"  # small_config sets it
    assert "--enable-block-reuse" in plain and "--no-enable-chunked-prefill" in plain
    cfg = small_config(
        context_servers={
            "kv_cache_config": {"enable_block_reuse": False},
            "enable_chunked_prefill": True,
            "max_seq_len": 4096,
        }
    )
    ctx, gen = _sim_argv(cfg, 0), _sim_argv(cfg, 1)
    assert "--no-enable-block-reuse" in ctx and "--enable-chunked-prefill" in ctx
    assert ctx[ctx.index("--max-seq-len") + 1] == "4096" and "--max-seq-len" not in gen
    assert "--enable-block-reuse" in gen and "--no-enable-chunked-prefill" in gen  # per role
    del cfg["context_servers"]["kv_cache_config"]
    cfg["generation_servers"].pop("kv_cache_config")
    cfg["enable_chunked_prefill"] = True  # top level: TensorRT-LLM passes it to both sections
    gen = _sim_argv(cfg, 1)
    assert "--enable-chunked-prefill" in gen and gen[gen.index("--event-buffer-max-size") + 1] == "4096"


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        (
            {"router": {"type": "kv_cache_aware"}, "kv_cache_config": {"event_buffer_max_size": 0}},
            "context_servers.kv_cache_config.event_buffer_max_size: 0 turns KV events off",
        ),
        (
            {"kv_cache_config": {"enable_block_reuse": "no"}},
            "context_servers.kv_cache_config.enable_block_reuse: must be true or false, got 'no'",
        ),
        ({"enable_chunked_prefill": 1}, "context_servers.enable_chunked_prefill: must be true or false, got 1"),
        (
            {"kv_cache_config": {"event_buffer_max_size": -1}},
            "context_servers.kv_cache_config.event_buffer_max_size: must be an integer >= 0, got -1",
        ),
        (
            {"kv_cache_config": {"kv_cache_event_hash_algo": "v3"}},
            "context_servers.kv_cache_config.kv_cache_event_hash_algo: must be one of auto, v1_block_key, "
            "v2_sha256, v2_sha256_64, got 'v3'",
        ),
    ],
)
def test_the_simulator_plan_refuses_what_trtllm_would(section: dict[str, Any], expected: str) -> None:
    with pytest.raises(PlanError, match="^" + expected.replace(".", r"\.").replace("(", r"\(")):
        _sim_argv(small_config(context_servers=section))


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"enable_chunked_prefill": "sure"}, "context_servers.enable_chunked_prefill: must be true or false"),
        ({"disable_overlap_scheduler": "x"}, "context_servers.disable_overlap_scheduler: must be true or false"),
        ({"max_seq_len": 0}, "context_servers.max_seq_len: must be an integer >= 1, got 0"),
        (
            {"kv_cache_config": {"enable_block_reuse": "maybe"}},
            "context_servers.kv_cache_config.enable_block_reuse: must be true or false, got 'maybe'",
        ),
    ],
)
def test_the_trtllm_plan_refuses_what_the_simulator_plan_refuses(section: dict[str, Any], expected: str) -> None:
    """trtllm-serve's LLM arguments would refuse these only once the executors start."""
    assert refusal(small_config(context_servers=section)).startswith(expected)
    with pytest.raises(PlanError, match="^" + expected.replace(".", r"\.").replace("(", r"\(")):
        _sim_argv(small_config(context_servers=section))


def test_sizes_past_32_bits_are_refused_before_any_executor_gets_them() -> None:
    """A max_batch_size of 10**20 passed; the simulators' /server_info then failed to encode it and
    launch waited for executors that would never answer."""
    with pytest.raises(ConfigError, match="max_batch_size: Input should be less than or equal to 2147483647"):
        plan_of(small_config(context_servers={"max_batch_size": 10**20}))
    cfg = small_config()
    cfg["shmdisagg"]["executors"]["trtllm"] = {"extra_llm_api_options": {"max_num_tokens": 2**31}}
    assert refusal(cfg).startswith("context_servers.max_num_tokens: must be at most 2147483647")


def test_a_top_level_free_gpu_memory_fraction_is_named_where_it_is_set() -> None:
    cfg = small_config()
    cfg["free_gpu_memory_fraction"] = 2.5
    assert refusal(cfg) == "free_gpu_memory_fraction: must be within (0, 1], got 2.5"


def test_the_internal_auth_key_reaches_each_executor_in_its_private_option_file_only(tmp_path: Path) -> None:
    from dataclasses import replace

    from shmdisagg.executors.plan import describe_plan

    cfg = {**example(), "internal_request_auth_key": "k3y-Sec"}
    config = parse_config(cfg, "cfg.yaml")
    plan = build_plan(config, RUN, {})
    for inst in plan.instances:
        assert inst.options["internal_request_auth_key"] == "k3y-Sec"  # the workers verify with it
        assert "k3y-Sec" not in " ".join(inst.argv) and "k3y-Sec" not in str(inst.env)  # never on a command line (ps)
    inst = replace(plan.instances[0], options_path=tmp_path / "ctx.yaml")
    (tmp_path / "ctx.yaml").write_text("old")
    (tmp_path / "ctx.yaml").chmod(0o644)
    inst.write_options()
    assert yaml.safe_load((tmp_path / "ctx.yaml").read_text())["internal_request_auth_key"] == "k3y-Sec"
    assert (tmp_path / "ctx.yaml").stat().st_mode & 0o777 == 0o600
    printed = describe_plan(plan, config, "cfg.yaml")
    assert "k3y-Sec" not in printed and "internal_request_auth_key: <redacted>" in printed


def test_the_simulator_hashes_blocks_with_the_section_s_kv_cache_event_hash_algo() -> None:
    ctx, gen = (
        _sim_argv(small_config(context_servers={"kv_cache_config": {"kv_cache_event_hash_algo": "v2_sha256"}}), r)
        for r in (0, 1)
    )
    assert ctx[ctx.index("--kv-cache-event-hash-algo") + 1] == "v2_sha256"
    assert "--kv-cache-event-hash-algo" not in gen  # the simulator's own default (auto) there


def _cluster_config(backend: str) -> dict[str, Any]:
    cfg = (
        example() if backend == "trtllm" else {"generation_servers": {}, "shmdisagg": {"executors": {"backend": "sim"}}}
    )
    cfg["disagg_cluster"] = {"cluster_uri": "etcd://10.0.0.1:2379", "cluster_name": "prod", "inactive_timeout_sec": 20}
    for key in ("context_servers", "generation_servers"):
        section = cfg.setdefault(key, {})
        section.pop("urls", None)
        section["num_instances"] = 2 if key == "context_servers" else 1
    if backend == "trtllm":
        cfg["shmdisagg"]["executors"]["gpus"] = [0, 1, 2, 3]  # 2 context x TP1 + 1 generation x TP2
    return cfg


def test_with_disagg_cluster_launch_starts_num_instances_that_register_themselves() -> None:
    sim = plan_of(_cluster_config("sim"))
    assert [(i.name, i.host, i.port) for i in sim.instances] == [
        ("context-0", "127.0.0.1", 0),
        ("context-1", "127.0.0.1", 0),
        ("generation-0", "127.0.0.1", 0),
    ]
    argv = sim.instances[2].argv
    flags = dict(zip(argv[argv.index("--server-role") :: 2], argv[argv.index("--server-role") + 1 :: 2], strict=False))
    assert flags["--server-role"] == "generation" and flags["--disagg-cluster-uri"] == "etcd://10.0.0.1:2379"
    assert flags["--cluster-name"] == "prod" and flags["--inactive-timeout-sec"] == "20"
    trt = plan_of(_cluster_config("trtllm"))
    inst = trt.instances[0]
    assert (
        inst.argv[inst.argv.index("--port") + 1] == "0" and inst.argv[inst.argv.index("--server_role") + 1] == "context"
    )
    assert inst.options is not None and inst.options["disagg_cluster"]["cluster_uri"] == "etcd://10.0.0.1:2379"
    assert inst.options["disagg_cluster"]["cluster_name"] == "prod"  # trtllm-serve reads it from its options YAML
