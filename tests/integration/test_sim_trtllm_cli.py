"""The simulator standing in for `trtllm-serve MODEL ... --extra_llm_api_options FILE.yaml`."""

from __future__ import annotations

import subprocess
import sys

import yaml

from shmdisagg.executors.sim.testing import SimProcess, get_json, post_json
from tests.conftest import free_port


def serve_args(port: int, extra: str) -> list[str]:
    return [
        "serve",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend",
        "pytorch",
        "--tp_size",
        "1",
        "--pp_size",
        "1",
        "--max_batch_size",
        "24",
        "--extra_llm_api_options",
        extra,
        "--log_level",
        "warning",
    ]


def test_serve_honours_the_yaml_and_serves_the_disaggregated_protocol(tmp_path):
    extra = tmp_path / "ctx.yaml"
    extra.write_text(
        yaml.safe_dump(
            {
                "kv_cache_config": {"tokens_per_block": 64, "enable_block_reuse": True, "event_buffer_max_size": 1024},
                "max_num_tokens": 2048,
                "cache_transceiver_config": {"backend": "UCX"},
                "disable_overlap_scheduler": True,
                "cuda_graph_config": None,
                "sim": {"speedup": 100.0},
            }
        )
    )
    port = free_port()
    with SimProcess(serve_args(port, str(extra)), port) as sim:
        status, info = get_json(sim.endpoint, "/server_info")
        assert status == 200
        assert (info["tokens_per_block"], info["max_batch_size"]) == (64, 24) and "max_num_tokens" not in info
        assert info["disaggregated_params"]["ctx_info_endpoint"] == [sim.endpoint]
        _, models = get_json(sim.endpoint, "/v1/models")
        assert models["data"][0]["id"] == "meta-llama/Llama-3.1-8B-Instruct"
        # The role is decided per request, as on a real trtllm-serve.
        status, ctx = post_json(
            sim.endpoint,
            "/v1/completions",
            {
                "model": "m",
                "prompt": list(range(1, 200)),
                "max_tokens": 4,
                "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 1 << 45},
            },
        )
        assert status == 200 and ctx["choices"][0]["finish_reason"] == "length"
        params = dict(ctx["choices"][0]["disaggregated_params"], request_type="generation_only")
        status, gen = post_json(
            sim.endpoint,
            "/v1/completions",
            {"model": "m", "prompt": ctx["prompt_token_ids"], "max_tokens": 4, "disaggregated_params": params},
        )
        assert status == 200 and gen["usage"]["completion_tokens"] == 4
        status, events = post_json(sim.endpoint, "/kv_cache_events", None)
        stored = [b for e in events if e["data"]["type"] == "stored" for b in e["data"]["blocks"]]
        assert len(stored[0]["tokens"]) == 64


def test_without_cache_transceiver_config_disaggregated_requests_are_refused_and_events_are_off(tmp_path):
    extra = tmp_path / "plain.yaml"
    extra.write_text(yaml.safe_dump({"kv_cache_config": {"enable_block_reuse": True}, "sim": {"speedup": 100.0}}))
    port = free_port()
    with SimProcess(serve_args(port, str(extra)), port) as sim:
        _, info = get_json(sim.endpoint, "/server_info")
        assert info["disaggregated_params"] is None and info["tokens_per_block"] == 32
        status, err = post_json(
            sim.endpoint,
            "/v1/completions",
            {"model": "m", "prompt": "x", "disaggregated_params": {"request_type": "context_only"}},
        )
        assert status == 400 and "cache_transceiver_config" in err["message"]
        assert post_json(sim.endpoint, "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 2})[0] == 200
        assert post_json(sim.endpoint, "/kv_cache_events", None) == (200, [])  # event_buffer_max_size defaults to 0


def test_a_bad_yaml_exits_with_status_2_and_says_why(tmp_path):
    extra = tmp_path / "bad.yaml"
    extra.write_text(yaml.safe_dump({"kv_cache_config": {"tokens_per_block": 32}, "warp_factor": 9}))
    proc = subprocess.run(
        [sys.executable, "-m", "shmdisagg.executors.sim", *serve_args(free_port(), str(extra))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "warp_factor" in proc.stderr
