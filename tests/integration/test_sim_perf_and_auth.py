"""Per-request perf metrics and `internal_request_auth_key`, configured as on a trtllm-serve worker
(the extra_llm_api_options YAML of `serve MODEL ...`). The CPU worker copy has neither feature,
so these check the simulator against upstream's documented behaviour
(`tensorrt_llm/serve/perf_metrics.py` file id 56757725682, `serve/disagg_auth.py` file id
68525723387): the signature is re-derived here from that description, not taken from the
simulator's own code."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from shmdisagg.executors.sim.testing import SimProcess, get_json, request
from tests.conftest import free_port

KEY = "a-shared-secret"
METRICS = {"x-trtllm-return-metrics": "1"}
SERVER_TIMING = re.compile(r"^server_queue;dur=\d+\.\d{6}, server_ttft;dur=\d+\.\d{6}, server_e2e;dur=\d+\.\d{6}"
                           r"(, server_kv_transfer;dur=\d+\.\d{6})?$")  # fmt: skip
START_END = re.compile(r"^server-start;ts=(\d+\.\d{9}), server-end;ts=(\d+\.\d{9})$")
_ids = iter(range(1 << 42, (1 << 42) + 10_000))


def serve(tmp: Path, name: str, **options: Any) -> SimProcess:
    extra = tmp / f"{name}.yaml"
    extra.write_text(yaml.safe_dump({"cache_transceiver_config": {"backend": "UCX"}, "sim": {"speedup": 200.0},
                                     **options}))  # fmt: skip
    port = free_port()
    return SimProcess(
        ["serve", "m", "--host", "127.0.0.1", "--port", str(port), "--extra_llm_api_options", str(extra)], port
    )


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimProcess]]:
    tmp = tmp_path_factory.mktemp("sims")
    procs = {
        "ctx": serve(
            tmp, "ctx", return_perf_metrics=True, perf_metrics_max_requests=100, internal_request_auth_key=KEY
        ),
        "gen": serve(
            tmp, "gen", return_perf_metrics=True, perf_metrics_max_requests=100, internal_request_auth_key=KEY
        ),
        "plain": serve(tmp, "plain"),  # TensorRT-LLM's defaults: no perf metrics, no key
    }
    for p in procs.values():
        p.start(wait=False)
    try:
        for p in procs.values():
            p.wait_healthy()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def post(
    sim: SimProcess, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    import http.client

    conn = http.client.HTTPConnection(sim.host, sim.port, timeout=30)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json", **(headers or {})}
        )
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def upstream_signature(key: str, ctx_info_endpoint: Any, encoded_opaque_state: Any) -> str:
    """disagg_auth.py's signature as its docstring-level contract states it."""
    if isinstance(ctx_info_endpoint, list):
        ctx_info_endpoint = ctx_info_endpoint[0] if ctx_info_endpoint else None
    payload = json.dumps({"ctx_info_endpoint": ctx_info_endpoint, "encoded_opaque_state": encoded_opaque_state},
                         sort_keys=True, separators=(",", ":")).encode()  # fmt: skip
    return "sha256=" + hmac.new(key.encode(), payload, hashlib.sha256).hexdigest()


def handoff(sims: dict[str, SimProcess], max_tokens: int = 4) -> tuple[dict[str, Any], dict[str, Any]]:
    """A context leg on ctx (no protected field: no signature needed) and the generation body."""
    body = {"model": "m", "prompt": list(range(10, 90)), "max_tokens": max_tokens}
    status, _, raw = post(
        sims["ctx"], dict(body, disaggregated_params={"request_type": "context_only", "disagg_request_id": next(_ids)})
    )
    assert status == 200, raw
    ctx = json.loads(raw)
    params = dict(ctx["choices"][0]["disaggregated_params"], request_type="generation_only", ctx_usage=ctx["usage"])
    return ctx, dict(body, prompt=ctx["prompt_token_ids"], disaggregated_params=params)


def signed(gen_body: dict[str, Any], key: str = KEY) -> dict[str, str]:
    p = gen_body["disaggregated_params"]
    return {"x-trtllm-disagg-auth": upstream_signature(key, p["ctx_info_endpoint"], p["encoded_opaque_state"])}


def test_a_json_answer_carries_server_timing_headers_when_asked(sims):
    body = {"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 3}
    status, headers, _ = post(sims["ctx"], body, METRICS)
    assert status == 200
    assert SERVER_TIMING.match(headers["server-timing"]), headers["server-timing"]
    start, end = map(float, START_END.match(headers["x-trtllm-start-end-time"]).groups())
    e2e = float(headers["server-timing"].split("server_e2e;dur=")[1].split(",")[0])
    assert start <= end and abs((end - start) * 1000 - e2e) < 0.01
    assert "server_kv_transfer" not in headers["server-timing"] and "x-trtllm-step-metrics" not in headers
    status, headers, _ = post(sims["ctx"], body)  # not asked: nothing
    assert status == 200 and "server-timing" not in headers and "x-trtllm-start-end-time" not in headers
    status, headers, _ = post(sims["ctx"], body, {"x-trtllm-return-metrics": "0"})
    assert "server-timing" not in headers


def test_a_stream_ends_with_the_perf_metrics_event_after_done(sims):
    body = {"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 3, "stream": True}
    status, headers, raw = post(sims["ctx"], body, METRICS)
    assert status == 200 and "server-timing" not in headers
    head, sep, event = raw.decode().partition("data: [DONE]\n\n")
    assert sep and event.startswith("event: trtllm.perf_metrics\ndata: ") and event.endswith("\n\n")
    payload = json.loads(event.split("data: ", 1)[1])
    assert list(payload) == ["Server-Timing", "X-TRTLLM-Start-End-Time"]
    assert SERVER_TIMING.match(payload["Server-Timing"]) and START_END.match(payload["X-TRTLLM-Start-End-Time"])
    _, _, raw = post(sims["ctx"], body)
    assert raw.endswith(b"data: [DONE]\n\n")


def test_without_return_perf_metrics_the_header_is_ignored_and_perf_metrics_is_empty(sims):
    status, headers, raw = post(sims["plain"], {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "stream": True},
                                METRICS)  # fmt: skip
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n") and "server-timing" not in headers
    assert get_json(sims["plain"].endpoint, "/perf_metrics") == (200, [])


def test_a_signed_generation_leg_passes_and_reports_its_kv_transfer(sims):
    get_json(sims["gen"].endpoint, "/perf_metrics")  # drain
    ctx, gen_body = handoff(sims)
    status, headers, raw = post(sims["gen"], gen_body, {**signed(gen_body), **METRICS})
    assert status == 200, raw
    assert "server_kv_transfer;dur=" in headers["server-timing"]
    [record] = get_json(sims["gen"].endpoint, "/perf_metrics")[1]
    params = ctx["choices"][0]["disaggregated_params"]
    assert record["ctx_request_id"] == params["ctx_request_id"] and record["request_id"] == params["disagg_request_id"]
    timing = record["perf_metrics"]["timing_metrics"]
    assert list(timing)[-3:] == ["kv_cache_size", "kv_cache_transfer_start", "kv_cache_transfer_end"]
    assert timing["kv_cache_size"] > 0 and timing["kv_cache_transfer_start"] <= timing["kv_cache_transfer_end"]


@pytest.mark.parametrize("headers", [{}, {"x-trtllm-disagg-auth": "sha256=" + "0" * 64}, "other key", "tampered"])
def test_an_unsigned_or_wrongly_signed_generation_leg_is_refused_with_400(sims, headers):
    _, gen_body = handoff(sims)
    if headers == "other key":
        headers = signed(gen_body, key="not-the-key")
    elif headers == "tampered":
        headers = signed(gen_body)
        gen_body["disaggregated_params"]["ctx_info_endpoint"] = "127.0.0.1:1"
    status, _, raw = post(sims["gen"], gen_body, headers)
    assert status == 400
    assert json.loads(raw) == {"object": "error", "message": "Invalid internal disaggregated request authentication",
                               "type": "BadRequestError", "param": None, "code": 400}  # fmt: skip


def test_without_a_key_protected_fields_pass_with_a_future_warning(sims, tmp_path):
    plain = sims["plain"]
    body = {"model": "m", "prompt": list(range(20, 60)), "max_tokens": 2}
    status, _, raw = post(
        plain, dict(body, disaggregated_params={"request_type": "context_only", "disagg_request_id": next(_ids)})
    )
    ctx = json.loads(raw)
    params = dict(ctx["choices"][0]["disaggregated_params"], request_type="generation_only")
    status, _, raw = post(plain, dict(body, prompt=ctx["prompt_token_ids"], disaggregated_params=params))
    assert status == 200, raw
    assert "FutureWarning" in plain.stderr() and "internal_request_auth_key will be enforced" in plain.stderr()


def test_the_simulators_own_flags_configure_both(tmp_path):
    port = free_port()
    args = ["--port", str(port), "--speedup", "200", "--internal-request-auth-key", KEY, "--return-perf-metrics"]
    with SimProcess(args, port) as sim:
        status, headers, _ = post(sim, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}, METRICS)
        assert status == 200 and SERVER_TIMING.match(headers["server-timing"])
        params = {
            "request_type": "generation_only",
            "ctx_request_id": 1,
            "first_gen_tokens": [5],
            "ctx_info_endpoint": sim.endpoint,
        }
        status, _, raw = post(sim, {"model": "m", "prompt": [1, 2, 3], "disaggregated_params": params})
        assert status == 400 and b"Invalid internal disaggregated request authentication" in raw
        assert (
            request(sim.endpoint, "GET", "/sim/stats")[0] == 200
            and KEY.encode() not in request(sim.endpoint, "GET", "/sim/stats")[2]
        )
