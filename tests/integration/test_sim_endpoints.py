"""The trtllm-serve endpoints of one simulator process, and its answers to bad requests."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from shmdisagg.executors.sim.testing import SimProcess, get_json, post_json, request, stream_sse
from shmdisagg.executors.sim.tokenizer import Tokenizer
from shmdisagg.hashing import block_hashes
from tests.conftest import free_port

PROMPT = [100 + i for i in range(70)]  # 69 usable tokens with tpb 16: 4 full blocks + 1 partial


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    port = free_port()
    with SimProcess(
        [
            "--port",
            str(port),
            "--speedup",
            "200",
            "--tokens-per-block",
            "16",
            "--model",
            "sim-8b",
            "--max-batch-size",
            "16",
            "--max-num-tokens",
            "1024",
        ],
        port,
    ) as proc:
        yield proc


def test_server_info_models_and_health(sim):
    status, info = get_json(sim.endpoint, "/server_info")
    assert status == 200
    assert info["max_batch_size"] == 16 and "max_num_tokens" not in info  # not in trtllm-serve's /server_info
    assert info["kv_cache_hash_algo"] == "v1_block_key" and info["tokens_per_block"] == 16
    assert info["disaggregated_params"]["ctx_info_endpoint"] == [sim.endpoint]
    assert isinstance(info["disaggregated_params"]["encoded_opaque_state"], str)
    status, models = get_json(sim.endpoint, "/v1/models")
    assert models["object"] == "list"
    [card] = models["data"]
    assert (card["id"], card["object"], card["owned_by"]) == ("sim-8b", "model", "tensorrt_llm")
    assert isinstance(card["created"], int)
    assert request(sim.endpoint, "GET", "/health")[0] == 200


def test_a_repeated_prompt_reports_cached_tokens_and_its_blocks_appear_as_kv_events(sim):
    post_json(sim.endpoint, "/kv_cache_events", None)  # drain what earlier tests left
    body = {"model": "sim-8b", "prompt": PROMPT, "max_tokens": 3}
    _, first = post_json(sim.endpoint, "/v1/completions", body)
    _, second = post_json(sim.endpoint, "/v1/completions", body)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # the 4 full blocks
    status, events = post_json(sim.endpoint, "/kv_cache_events", None)
    assert status == 200
    stored = [b["block_hash"] for e in events if e["data"]["type"] == "stored" for b in e["data"]["blocks"]]
    assert stored[:4] == block_hashes(PROMPT, 16)[:4]
    assert all(set(e) >= {"event_id", "data", "window_size"} for e in events)
    ids = [e["event_id"] for e in events]
    assert ids == sorted(ids)
    assert post_json(sim.endpoint, "/kv_cache_events", None)[1] == []  # drained


def test_perf_metrics_are_recorded_and_drained(sim):
    get_json(sim.endpoint, "/perf_metrics")
    post_json(sim.endpoint, "/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": 2})
    status, records = get_json(sim.endpoint, "/perf_metrics")
    assert status == 200 and len(records) == 1
    assert list(records[0]) == ["request_id", "perf_metrics"]  # no ctx_request_id without disaggregated_params
    perf = records[0]["perf_metrics"]
    timing = perf["timing_metrics"]
    assert list(timing) == [
        "server_arrival_time",
        "arrival_time",
        "first_scheduled_time",
        "first_token_time",
        "server_first_token_time",
        "last_token_time",
    ]  # openai_server.py get_perf_metrics
    assert timing["server_arrival_time"] <= timing["arrival_time"] <= timing["first_scheduled_time"]
    assert timing["first_scheduled_time"] <= timing["first_token_time"] <= timing["last_token_time"]
    assert list(perf["kv_cache_metrics"]) == [
        "num_total_allocated_blocks",
        "num_new_allocated_blocks",
        "num_reused_blocks",
        "num_missed_blocks",
    ]
    assert get_json(sim.endpoint, "/perf_metrics")[1] == []


def test_steady_clock_offset_round_trip(sim):
    status, clock = get_json(sim.endpoint, "/steady_clock_offset")
    assert status == 200 and clock["transmit_ts"] - clock["receive_ts"] >= 0.19  # sleeps 0.2 s
    assert post_json(sim.endpoint, "/steady_clock_offset", {"offset": 100.0}) == (200, None)  # no body, as upstream
    get_json(sim.endpoint, "/perf_metrics")  # drain what other tests on this simulator left
    post_json(sim.endpoint, "/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1})
    [record] = get_json(sim.endpoint, "/perf_metrics")[1]
    assert record["perf_metrics"]["timing_metrics"]["arrival_time"] > time.monotonic() + 50
    post_json(sim.endpoint, "/steady_clock_offset", {"offset": 0.0})
    assert post_json(sim.endpoint, "/steady_clock_offset", {"offset": "soon"})[0] == 400


def test_stop_token_ids_end_the_request_even_with_ignore_eos(sim):
    from shmdisagg.executors.sim import output_tokens

    tokens = output_tokens(PROMPT, 3)
    for ignore_eos in (False, True):  # ignore_eos is about EOS (end_id), not stop words (sampling_params.py)
        _, resp = post_json(
            sim.endpoint,
            "/v1/completions",
            {"model": "m", "prompt": PROMPT, "max_tokens": 8, "stop_token_ids": [tokens[2]], "ignore_eos": ignore_eos},
        )
        assert resp["choices"][0]["finish_reason"] == "stop" and resp["choices"][0]["stop_reason"] == tokens[2]
        # the stop word is dropped from the output and not counted (result.py _handle_sequence)
        assert resp["usage"]["completion_tokens"] == 2
        assert resp["choices"][0]["text"] == Tokenizer().decode(tokens[:2])


def test_chat_non_streaming_and_detokenize_false(sim):
    _, resp = post_json(
        sim.endpoint,
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_completion_tokens": 3},
    )
    assert resp["object"] == "chat.completion" and resp["id"].startswith("chatcmpl-")
    message = resp["choices"][0]["message"]
    assert message["role"] == "assistant" and len(message["content"].split()) == 3
    assert resp["prompt_token_ids"] is None  # only context_only responses carry them
    _, resp = post_json(
        sim.endpoint, "/v1/completions", {"model": "m", "prompt": [5, 6], "max_tokens": 2, "detokenize": False}
    )
    assert resp["choices"][0]["text"] == "" and len(resp["choices"][0]["token_ids"]) == 2


def test_streaming_without_usage_ends_with_done(sim):
    events = list(
        stream_sse(
            sim.endpoint, "/v1/completions", {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4, "stream": True}
        )
    )
    assert events[-1] == "[DONE]" and len(events) == 5
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert len({c["id"] for c in chunks}) == 1


@pytest.mark.parametrize(
    ("path", "body", "match"),
    [
        ("/v1/completions", {"model": "m", "prompt": ["a", "b"]}, "batches of prompts"),
        ("/v1/completions", {"model": "m", "prompt": "x", "n": 2}, "n > 1"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": -1}, "must be greater than 0"),
        (
            "/v1/completions",
            {"model": "m", "prompt": "x", "disaggregated_params": {"request_type": "both"}},
            "Unknown request type",
        ),
    ],
)
def test_a_request_the_executor_cannot_run_gets_400_with_an_error_response(sim, path, body, match):
    status, headers, raw = request(sim.endpoint, "POST", path, body)
    assert status == 400 and headers["content-type"] == "application/json"
    err = json.loads(raw)
    assert set(err) == {"object", "message", "type", "param", "code"}
    assert err["object"] == "error" and err["code"] == 400 and err["type"] == "BadRequestError"
    assert match in err["message"]


@pytest.mark.parametrize(
    ("path", "body", "match"),
    [
        ("/v1/completions", {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream"),
        ("/v1/completions", {"prompt": "x"}, "model"),
        ("/v1/chat/completions", {"model": "m", "messages": "hello"}, "messages"),
        ("/v1/completions", b"{not json", "JSON"),
    ],
)
def test_a_body_that_fails_validation_gets_400_with_fastapis_body(sim, path, body, match):
    status, headers, raw = request(sim.endpoint, "POST", path, body)
    assert status == 400 and headers["content-type"] == "application/json"
    err = json.loads(raw)
    assert list(err) == ["error"] and match in err["error"]


def test_unknown_paths_and_methods(sim):
    assert request(sim.endpoint, "GET", "/nope")[::2] == (404, b'{"detail":"Not Found"}')
    assert request(sim.endpoint, "GET", "/v1/completions")[::2] == (405, b'{"detail":"Method Not Allowed"}')
    assert request(sim.endpoint, "GET", "/kv_cache_events")[0] == 405


def test_startup_delay_answers_503_starting_then_becomes_healthy():
    port = free_port()
    proc = SimProcess(["--port", str(port), "--startup-delay", "1.5"], port)
    with proc.start(wait=False):
        deadline = time.monotonic() + 20
        while True:
            try:
                status, headers, raw = request(proc.endpoint, "GET", "/health", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        assert status == 503
        assert headers["x-trtllm-server-state"] == "starting" and headers["retry-after"] == "1"
        assert json.loads(raw)["error"]["code"] == "starting"  # TensorRT-LLM's serve/readiness.py body
        assert request(proc.endpoint, "POST", "/v1/completions", {"model": "m", "prompt": "x"})[0] == 503
        proc.wait_healthy()
