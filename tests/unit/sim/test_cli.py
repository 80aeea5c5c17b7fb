from __future__ import annotations

import pytest
import yaml

from shmdisagg.executors.sim.cli import main, parse_args
from shmdisagg.executors.sim.errors import ConfigError


def test_own_flags_are_derived_from_the_config_fields():
    cfg = parse_args(
        [
            "--port",
            "9001",
            "--role",
            "context",
            "--tokens-per-block",
            "16",
            "--num-blocks",
            "100",
            "--speedup",
            "10",
            "--fault",
            "slow:factor=2",
            "--fault",
            "hang:after=3",
            "--no-enable-block-reuse",
            "--disable-overlap-scheduler",
        ]
    )
    assert (cfg.port, cfg.role, cfg.tokens_per_block, cfg.num_blocks, cfg.speedup) == (9001, "context", 16, 100, 10.0)
    assert cfg.faults == ("slow:factor=2", "hang:after=3")
    assert not cfg.enable_block_reuse and cfg.disable_overlap_scheduler
    assert cfg.endpoint == "127.0.0.1:9001"
    assert cfg.served_model == "meta-llama/Llama-3.1-8B-Instruct"
    assert parse_args([]).effective_num_blocks == 12798


@pytest.mark.parametrize(
    "argv",
    [
        ["--role", "prefill"],
        ["--speedup", "0"],
        ["--profile", "tpu"],
        ["--fault", "explode"],
        ["--tokens-per-block", "0"],
        ["--bogus"],
        ["--port", "x"],
    ],
)
def test_bad_flags_raise_config_error_and_main_exits_2(argv, capsys):
    with pytest.raises(ConfigError):
        parse_args(argv)
    assert main(argv) == 2
    assert "error" in capsys.readouterr().err


def write_yaml(tmp_path, data) -> str:
    path = tmp_path / "extra.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_serve_honours_the_extra_llm_api_options_yaml(tmp_path):
    extra = write_yaml(
        tmp_path,
        {
            "kv_cache_config": {
                "tokens_per_block": 64,
                "enable_block_reuse": True,
                "event_buffer_max_size": 512,
                "free_gpu_memory_fraction": 0.5,
            },
            "max_batch_size": 32,
            "max_num_tokens": 4096,
            "cache_transceiver_config": {"backend": "UCX", "kv_transfer_timeout_ms": 5000},
            "disable_overlap_scheduler": True,
            "return_perf_metrics": True,
            "perf_metrics_max_requests": 50,
            "internal_request_auth_key": "k3y",
            "cuda_graph_config": {"enable_padding": True},
            "sim": {"speedup": 20.0, "num_blocks": 300, "faults": ["slow:factor=2"]},
        },
    )
    cfg = parse_args(
        [
            "serve",
            "meta-llama/Llama-3.1-8B-Instruct",
            "--host",
            "127.0.0.1",
            "--port",
            "8123",
            "--backend",
            "pytorch",
            "--tp_size",
            "1",
            "--pp_size",
            "1",
            "--extra_llm_api_options",
            extra,
            "--log_level",
            "info",
        ]
    )
    assert cfg.tokens_per_block == 64 and cfg.event_buffer_max_size == 512
    assert (cfg.max_batch_size, cfg.max_num_tokens) == (32, 4096)
    assert cfg.disagg_enabled and cfg.kv_transfer_timeout == 5.0
    assert cfg.disable_overlap_scheduler and cfg.return_perf_metrics and not cfg.enable_chunked_prefill
    assert cfg.perf_metrics_max_requests == 50 and cfg.internal_request_auth_key == "k3y"
    assert (cfg.speedup, cfg.num_blocks, cfg.faults) == (20.0, 300, ("slow:factor=2",))
    assert cfg.free_gpu_memory_fraction == 0.5 and cfg.log_level == "info"
    assert cfg.served_model == "meta-llama/Llama-3.1-8B-Instruct" and cfg.port == 8123


def test_serve_defaults_follow_tensorrt_llm(tmp_path):
    cfg = parse_args(["serve", "/models/llama-3.1-70b-instruct", "--tp_size", "4"])
    assert cfg.profile == "h100-sxm-llama-3.1-70b-tp4" and cfg.tp_size == 4
    assert cfg.event_buffer_max_size == 0 and not cfg.disagg_enabled and not cfg.return_perf_metrics
    assert cfg.perf_metrics_max_requests == 0 and cfg.internal_request_auth_key is None  # TensorRT-LLM's defaults
    assert cfg.tokens_per_block == 32 and cfg.max_batch_size == 2048 and cfg.max_num_tokens == 8192


def test_command_line_values_win_over_the_yaml(tmp_path):
    extra = write_yaml(tmp_path, {"max_batch_size": 32, "kv_cache_config": {"max_tokens": 6400}})
    cfg = parse_args(["serve", "m", "--max_batch_size", "8", "--extra_llm_api_options", extra])
    assert cfg.max_batch_size == 8
    assert cfg.num_blocks == 200  # kv_cache_config.max_tokens / tokens_per_block


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"not_a_trtllm_key": 1}, "unknown extra_llm_api_options key"),
        ({"sim": {"warp": 9}}, "unknown sim option"),
        ({"kv_cache_config": {"tokens_per_block": "32"}}, "must be an integer"),
        (
            {"kv_cache_config": {"tokens_per_blok": 64}},
            r"kv_cache_config: unknown key\(s\) tokens_per_blok \(no field of TensorRT-LLM's KvCacheConfig",
        ),
        ({"cache_transceiver_config": {"backend": "UCX", "kv_transfer_timeout_msec": 5}}, "CacheTransceiverConfig"),
        ({"scheduler_config": {"policy": "FCFS"}}, "scheduler_config: unknown key"),
        ({"kv_cache_config": {"enable_block_reuse": "yes"}}, "true or false"),
        ({"sim": {"faults": [1]}}, "sim.faults"),
        ({"sim": {"speedup": -1}}, "speedup"),
        ({"internal_request_auth_key": ""}, "internal_request_auth_key must be a non-empty string"),
        ({"internal_request_auth_key": 42}, "internal_request_auth_key must be a non-empty string"),
    ],
)
def test_bad_yaml_raises_config_error(tmp_path, data, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(["serve", "m", "--extra_llm_api_options", write_yaml(tmp_path, data)])


def test_missing_yaml_and_unknown_serve_flags_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        parse_args(["serve", "m", "--extra_llm_api_options", str(tmp_path / "nope.yaml")])
    with pytest.raises(ConfigError):
        parse_args(["serve", "m", "--warp_drive", "1"])


@pytest.mark.parametrize(
    "argv, usage",
    [(["sim", "--help"], "usage: shmdisagg sim ["), (["sim", "serve", "--help"], "usage: shmdisagg sim serve [")],
)
def test_help_through_the_shmdisagg_cli_names_shmdisagg_sim(argv, usage, capsys):
    from shmdisagg.cli import main as shmdisagg_main

    assert shmdisagg_main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(usage) and "python -m" not in out


def test_errors_through_the_shmdisagg_cli_name_shmdisagg_sim(capsys):
    from shmdisagg.cli import main as shmdisagg_main

    assert shmdisagg_main(["sim", "--bogus"]) == 2
    assert capsys.readouterr().err.startswith("shmdisagg sim: error: unrecognized arguments: --bogus")


def test_help_of_the_module_still_names_the_module(capsys):
    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m shmdisagg.executors.sim [")


def test_the_simulators_own_flags_take_the_auth_key_and_perf_metrics_options():
    cfg = parse_args(
        ["--internal-request-auth-key", "k3y", "--perf-metrics-max-requests", "0", "--no-return-perf-metrics"]
    )
    assert cfg.internal_request_auth_key == "k3y" and cfg.perf_metrics_max_requests == 0 and not cfg.return_perf_metrics
    assert "k3y" not in repr(cfg)  # a secret
    with pytest.raises(ConfigError, match="internal_request_auth_key"):
        parse_args(["--internal-request-auth-key", ""])
