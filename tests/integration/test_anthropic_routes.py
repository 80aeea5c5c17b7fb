"""TensorRT-LLM's newer public routes through a real coordinator and fleet, against recording
fakes: `/v1/messages` over the disaggregated chat flow, `/v1/messages/count_tokens` on a context
executor, and `/v1/responses` refused with 501."""

from __future__ import annotations

import http.client
import socket
from pathlib import Path

import orjson
import pytest

from tests.integration.harness import deployment, fake_executors, post, request_json, wait_until, write_config

MESSAGES = {
    "model": "fake-model",
    "max_tokens": 4,
    "system": "be brief",
    "messages": [{"role": "user", "content": "hi"}],
}
INTERNAL = (b"disaggregated_params", b"prompt_token_ids", b"encoded_opaque_state", b"ctx_info_endpoint")


@pytest.fixture
def pair(tmp_path: Path, shm_prefix: str):  # type: ignore[no-untyped-def]
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr])
        with deployment(cfg) as dep:
            yield dep, ctx, gen


def sse_events(dep, body: object) -> tuple[int, bytes, list[dict]]:  # type: ignore[no-untyped-def]
    c = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
    try:
        c.request("POST", "/v1/messages", body=orjson.dumps(body), headers={"content-type": "application/json"})
        r = c.getresponse()
        raw = r.read()
    finally:
        c.close()
    return r.status, raw, [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]


@pytest.mark.parametrize(
    ("style", "stream"), [("context_first", False), ("context_first", True), ("generation_first", True)]
)
def test_messages_run_both_legs_as_a_chat_and_come_back_in_anthropics_shape(
    tmp_path: Path, shm_prefix: str, style: str, stream: bool
) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        with deployment(write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], schedule_style=style)) as dep:
            raw = _messages_round_trip(dep, stream)
        [ctx_req] = ctx.recorded()
        [gen_req] = gen.recorded()
    assert not any(key in raw for key in INTERNAL)
    assert ctx_req["_path"] == gen_req["_path"] == "/v1/chat/completions"
    assert (
        ctx_req["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        and ctx_req["max_completion_tokens"] == 4
    )
    assert ctx_req["disaggregated_params"]["request_type"] == "context_only" and ctx_req["stream"] is False
    assert gen_req["disaggregated_params"]["request_type"] == "generation_only"
    if style == "context_first":  # the context executor's token ids travel on; generation-first has none to pass
        assert gen_req["prompt_token_ids"] == [101, 102, 103]
    assert gen_req["stream"] is stream and ("stream_options" in gen_req) is stream
    assert "system" not in ctx_req and "max_tokens" not in ctx_req  # Anthropic's fields are not relayed


def _messages_round_trip(dep, stream: bool) -> bytes:  # type: ignore[no-untyped-def]
    """One /v1/messages request, its answer checked; returns the raw answer."""
    if stream:
        status, raw, events = sse_events(dep, {**MESSAGES, "stream": True})
        assert status == 200
        assert [e["type"] for e in events] == ["message_start", "content_block_start"] + ["content_block_delta"] * 4 + [
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
        assert "".join(e["delta"]["text"] for e in events[2:6]) == "t0t1t2t3"
        assert events[-2]["delta"] == {"stop_reason": "max_tokens"}  # the executor's finish_reason "length"
    else:
        status, msg = post(dep, "/v1/messages", MESSAGES)
        raw = orjson.dumps(msg)
        assert (
            status == 200 and msg["type"] == "message" and msg["role"] == "assistant" and msg["model"] == "fake-model"
        )
        assert msg["content"] == [{"type": "text", "text": "ABCD"}] and msg["stop_reason"] == "max_tokens"
        assert msg["usage"] == {
            "input_tokens": 0,
            "output_tokens": 1,
            "cache_read_input_tokens": 7,
        }  # the fake reports 7 cached of 3
    return raw


def test_messages_errors_are_anthropic_envelopes_with_the_status(pair) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, gen = pair
    status, body = post(dep, "/v1/messages", {**MESSAGES, "max_tokens": 0})
    assert (
        status == 400
        and body["type"] == "error"
        and body["error"]["type"] == "invalid_request_error"
        and body["error"]["message"].startswith("max_tokens:")
    )
    status, body = post(
        dep, "/v1/messages", {**MESSAGES, "messages": [{"role": "user", "content": [{"type": "redacted_thinking"}]}]}
    )
    assert status == 400 and "redacted_thinking" in body["error"]["message"]
    assert ctx.recorded() == []  # refused before anything was routed
    ctx.script(status=422, error_message=f"prompt too long (worker http://{ctx.addr})")
    status, body = post(dep, "/v1/messages", MESSAGES)
    assert status == 422 and body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "prompt too long (worker <executor>)"},
    }
    ctx.script(status=200)
    gen.script(stream_error="engine fault")
    status, _, events = sse_events(dep, {**MESSAGES, "stream": True})
    assert status == 200 and events[-1] == {"type": "error", "error": {"type": "api_error", "message": "engine fault"}}
    assert "message_stop" not in [e["type"] for e in events]


def test_count_tokens_is_answered_by_a_context_executor(tmp_path: Path, shm_prefix: str) -> None:
    body = {"model": "fake-model", "system": "s", "messages": [{"role": "user", "content": "count me"}]}
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        with deployment(write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr])) as dep:
            status, answer = post(dep, "/v1/messages/count_tokens", body)
            assert status == 200 and answer == {"input_tokens": len("count me")}
            [counted] = ctx.recorded()
            assert (
                counted["_path"] == "/v1/messages/count_tokens"
                and counted["messages"] == body["messages"]
                and counted["system"] == "s"
            )
            assert gen.recorded() == []
            status, answer = post(dep, "/v1/messages/count_tokens", {"model": "fake-model", "messages": []})
            assert status == 400 and answer["error"]["type"] == "invalid_request_error" and len(ctx.recorded()) == 1
            ctx.script(status=400, error_message=f"bad tool schema at {ctx.addr}")
            status, answer = post(dep, "/v1/messages/count_tokens", body)
            assert status == 400 and answer == {
                "type": "error",
                "error": {"type": "invalid_request_error", "message": "bad tool schema at <executor>"},
            }
            ctx.proc.terminate()
            ctx.proc.wait(timeout=10)
            wait_until(
                lambda: not request_json("127.0.0.1", dep.config.port, "GET", "/cluster_info")[1]["healthy"][ctx.addr],
                what="the context server marked unhealthy",
            )
            status, answer = post(dep, "/v1/messages/count_tokens", body)
            assert status == 503 and answer == {
                "type": "error",
                "error": {"type": "api_error", "message": "no healthy context server"},
            }


def test_responses_is_refused_with_501_naming_what_to_use(pair) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, gen = pair
    status, body = post(dep, "/v1/responses", {"model": "fake-model", "input": "hi"})
    assert status == 501 and body["object"] == "error" and body["code"] == 501 and body["type"] == "NotImplementedError"
    assert "/v1/chat/completions" in body["message"]
    assert ctx.recorded() == [] and gen.recorded() == []


def _refused(port: int, head: bytes) -> tuple[int, dict]:  # type: ignore[type-arg]
    """Send `head` (no body), read the refusal until the server closes: status, JSON body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    top, _, body = raw.partition(b"\r\n\r\n")  # a refusal has a content-length and closes
    return int(top.split()[1]), orjson.loads(body)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens?beta=true"])
def test_refusals_before_the_adapter_are_anthropic_envelopes_too(pair, path: str) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, _ = pair
    port = dep.config.port
    big = b"POST %s HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: 100000000\r\n\r\n"
    status, body = _refused(port, big % path.encode())  # refused by the public port, unread
    assert status == 413 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("request body is larger than")
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("GET", path)
        r = c.getresponse()
        status, allow, body = r.status, r.getheader("allow"), orjson.loads(r.read())
    finally:
        c.close()
    assert status == 405 and allow == "POST"
    assert body == {"type": "error", "error": {"type": "invalid_request_error", "message": "Method Not Allowed"}}
    status, body = _refused(port, big % b"/v1/chat/completions")  # the OpenAI routes keep theirs
    assert status == 413 and body["object"] == "error" and body["code"] == 413
    assert ctx.recorded() == []
