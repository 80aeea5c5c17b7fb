"""What reaches a client of an executor's answer: nothing internal, and no answer that breaks the
request's contract (a real coordinator and fleet in front of recording fakes that misbehave)."""

from __future__ import annotations

import http.client
from pathlib import Path

import orjson
import pytest

from shmdisagg.shm.table import ControlTable
from tests.integration.harness import deployment, fake_executors, post, stream_lines, write_config

COMPLETION = {"model": "fake-model", "prompt": "hello there", "max_tokens": 4}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
INTERNAL = (
    b'disaggregated_params":{',
    b"kv_transfer_params",
    b"encoded_opaque_state",
    b"ctx_info_endpoint",
    b"ctx_request_id",
    b"b3BhcXVl",
)


@pytest.fixture
def pair(tmp_path: Path, shm_prefix: str):  # type: ignore[no-untyped-def]
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], num_workers=1)
        with deployment(cfg) as dep:
            yield dep, ctx, gen


def _raw(dep, path: str, body: dict) -> tuple[int, bytes, bytes]:  # type: ignore[no-untyped-def]
    """(status, body, the response headers as text) of one POST."""
    c = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
    try:
        c.request("POST", path, body=orjson.dumps(body), headers={"content-type": "application/json"})
        r = c.getresponse()
        return r.status, r.read(), b"".join(f"{k}: {v}\n".encode() for k, v in r.getheaders())
    finally:
        c.close()


def _leaks(raw: bytes, *addrs: str) -> list[bytes]:
    return [k for k in (*INTERNAL, *(a.encode() for a in addrs)) if k in raw]


def _idle(dep) -> bool:  # type: ignore[no-untyped-def]
    with ControlTable.attach(dep.config.shm_prefix) as table:
        return all(table.load(s.slot) == (0, 0) for s in table.servers())


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_an_executor_that_echoes_the_handoff_leaks_nothing_to_the_client(pair, chat: bool, stream: bool) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, gen = pair
    gen.script(leak=True)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, raw, headers = _raw(dep, path, {**(CHAT if chat else COMPLETION), "stream": stream})
    assert status == 200, raw
    assert _leaks(raw + headers, ctx.addr, gen.addr) == []
    if not stream:
        body = orjson.loads(raw)
        # the fields a plain trtllm-serve answer also has read null; the rest are gone
        assert body["choices"][0]["disaggregated_params"] is None and body["prompt_token_ids"] is None
        assert "kv_transfer_params" not in body["choices"][0]
        assert (body["choices"][0].get("text") or body["choices"][0]["message"]["content"]) == "ABCD"
    else:
        assert raw.count(b"data: [DONE]") == 1 and b"t3" in raw


def test_an_executor_error_reaches_the_client_in_our_shape_without_addresses(pair) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, gen = pair
    ctx.script(status=400, error_message=f"prompt rejected by worker at {ctx.addr} (peer http://{gen.addr}/v1)")
    status, body = post(dep, "/v1/completions", COMPLETION)
    assert status == 400
    assert body == {
        "object": "error",
        "message": "prompt rejected by worker at <executor> (peer <executor>)",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }


def test_an_executor_error_event_mid_stream_is_normalised_and_ends_the_stream_once(pair) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, gen = pair
    gen.script(stream_error=f"KV transfer from {ctx.addr} timed out")
    status, events, _ = stream_lines(dep, "/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200 and events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    error = orjson.loads(events[-2])["error"]
    assert error == {
        "object": "error",
        "message": "KV transfer from <executor> timed out",
        "type": "BadGatewayError",
        "param": None,
        "code": 502,
    }
    assert _idle(dep)


def test_a_dead_generation_executor_is_not_named_to_the_client(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], num_workers=1, max_retries=0)
        with deployment(cfg) as dep:
            gen.proc.kill()
            gen.proc.wait()
            status, raw, headers = _raw(dep, "/v1/completions", COMPLETION)
            assert status in (502, 503) and _leaks(raw + headers, ctx.addr, gen.addr) == [], raw


@pytest.mark.parametrize("stream", [False, True])
def test_a_generation_answer_over_max_tokens_is_an_executor_error(pair, stream: bool) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, gen = pair
    gen.script(completion_tokens=9)
    if stream:
        status, events, _ = stream_lines(
            dep, "/v1/completions", {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
        )
        assert status == 200 and events[-1] == b"[DONE]"
        error = orjson.loads(events[-2])["error"]
        assert error["code"] == 502 and "9 completion tokens for max_tokens=4" in error["message"]
    else:
        status, body = post(dep, "/v1/completions", COMPLETION)
        assert status == 502 and "9 completion tokens for max_tokens=4" in body["message"] and body["code"] == 502
    assert _idle(dep)


def test_a_generation_answer_with_two_choices_for_n_1_is_an_executor_error(pair) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, gen = pair
    gen.script(gen_choices=2)
    status, body = post(dep, "/v1/completions", COMPLETION)
    assert status == 502 and "2 choices for a request with n=1" in body["message"]


def test_a_stream_that_ends_without_finish_reason_ends_with_an_error_event(pair) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, gen = pair
    gen.script(stream_finish_reason=None)
    status, events, _ = stream_lines(dep, "/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 200 and events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    error = orjson.loads(events[-2])["error"]
    assert error["code"] == 502 and "without a finish_reason" in error["message"]
    assert [orjson.loads(e)["choices"][0]["delta"]["content"] for e in events[:-2]] == [
        "t0",
        "t1",
        "t2",
        "t3",
    ]  # what came is relayed
    assert _idle(dep)


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_answered_with_a_json_body_is_an_executor_error_with_nothing_relayed(pair, chat: bool) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, gen = pair
    gen.script(stream_as_json=True, leak=True)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, raw, headers = _raw(dep, path, {**(CHAT if chat else COMPLETION), "stream": True})
    assert status == 502, raw
    error = orjson.loads(raw)["error"] if b'"error"' in raw[:10] else orjson.loads(raw)
    assert error["code"] == 502 and "text/event-stream" in error["message"]
    assert b"ABCD" not in raw and _leaks(raw + headers, ctx.addr, gen.addr) == []
    assert _idle(dep)


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_a_body_that_is_not_json_by_its_content_type_gets_415(pair, content_type: str) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, gen = pair
    c = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
    try:
        c.request("POST", "/v1/completions", body=orjson.dumps(COMPLETION), headers={"content-type": content_type})
        r = c.getresponse()
        body = orjson.loads(r.read())
    finally:
        c.close()
    assert (
        r.status == 415
        and body["code"] == 415
        and body["param"] == "content-type"
        and "application/json" in body["message"]
    )
    assert ctx.recorded() == []


@pytest.mark.parametrize("encoding, status", [("gzip", 415), ("br", 415), ("identity", 200)])
def test_a_compressed_body_gets_415_naming_its_encoding(pair, encoding: str, status: int) -> None:  # type: ignore[no-untyped-def]
    import gzip

    dep, ctx, gen = pair
    raw = orjson.dumps(COMPLETION)
    c = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
    try:
        headers = {"content-type": "application/json", "content-encoding": encoding}
        c.request(
            "POST", "/v1/completions", body=raw if encoding == "identity" else gzip.compress(raw), headers=headers
        )
        r = c.getresponse()
        body = orjson.loads(r.read())
    finally:
        c.close()
    assert r.status == status, body
    if status == 415:
        assert body["param"] == "content-encoding" and encoding in body["message"] and ctx.recorded() == []


@pytest.mark.parametrize("content_type", [None, "application/json; charset=utf-8", "application/vnd.api+json"])
def test_json_content_types_and_none_are_accepted(pair, content_type: str | None) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, gen = pair
    c = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
    try:
        c.putrequest("POST", "/v1/completions")
        body = orjson.dumps(COMPLETION)
        if content_type:
            c.putheader("content-type", content_type)
        c.putheader("content-length", str(len(body)))
        c.endheaders(body)
        r = c.getresponse()
        r.read()
    finally:
        c.close()
    assert r.status == 200


def test_models_are_the_context_executors_and_version_answers(pair) -> None:  # type: ignore[no-untyped-def]
    from shmdisagg import __version__
    from tests.integration.harness import request_json

    dep, ctx, gen = pair
    status, models = request_json("127.0.0.1", dep.config.port, "GET", "/v1/models")
    # the context executor's own answer, relayed (its `created` is 0: not minted here)
    assert status == 200 and models == {
        "object": "list",
        "data": [{"id": "fake-model", "object": "model", "created": 0, "owned_by": "tensorrt_llm"}],
    }
    assert request_json("127.0.0.1", dep.config.port, "GET", "/version") == (200, {"version": __version__})


def test_models_is_503_while_no_context_executor_is_healthy(tmp_path: Path, shm_prefix: str) -> None:
    from tests.integration.harness import request_json, wait_until

    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], num_workers=1)
        with deployment(cfg) as dep:
            ctx.proc.kill()
            ctx.proc.wait()
            wait_until(
                lambda: request_json("127.0.0.1", dep.config.port, "GET", "/health")[0] == 503,
                what="the context server marked down",
            )
            status, body = request_json("127.0.0.1", dep.config.port, "GET", "/v1/models")
    assert status == 503 and body["code"] == 503 and body["object"] == "error" and ctx.addr not in body["message"]


def _with_nested(body: dict, levels: int) -> bytes:  # type: ignore[type-arg]
    """`body` as JSON, its "NESTED" string value replaced by `levels` levels of arrays (orjson,
    like the public port's reader, writes no more than 254 levels of the whole document)."""
    return orjson.dumps(body).replace(b'"NESTED"', b"[" * levels + b"]" * levels)


def _post_raw(dep, path: str, raw: bytes) -> tuple[int, bytes, bytes]:  # type: ignore[no-untyped-def]
    c = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
    try:
        c.request("POST", path, body=raw, headers={"content-type": "application/json"})
        r = c.getresponse()
        return r.status, r.read(), b"".join(f"{k}: {v}\n".encode() for k, v in r.getheaders())
    finally:
        c.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_a_body_nested_too_deep_for_a_leg_is_a_400_and_reaches_no_executor(pair, chat: bool, stream: bool) -> None:  # type: ignore[no-untyped-def]
    """orjson reads 1,024 levels but writes 254: a client's 300-deep tool schema was a 500
    "internal error" with a traceback, counted as a failure of ours."""
    dep, ctx, gen = pair
    path = "/v1/chat/completions" if chat else "/v1/completions"
    deep = {**(CHAT if chat else COMPLETION), "stream": stream}
    if chat:
        schema = {"type": "object", "properties": {"a": "NESTED"}}
        deep["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    else:
        deep["logit_bias_extra"] = "NESTED"
    status, raw, headers = _post_raw(dep, path, _with_nested(deep, 300))
    assert status == 400, raw
    error = orjson.loads(raw)
    assert error["object"] == "error" and error["code"] == 400 and "nests too deeply" in error["message"]
    assert ctx.recorded() == [] and gen.recorded() == []
    assert _leaks(raw + headers, ctx.addr, gen.addr) == []
    assert _idle(dep)
    # 254 levels, the top object's included, still go through
    status, raw, _ = _post_raw(dep, path, _with_nested({**(CHAT if chat else COMPLETION), "x": "NESTED"}, 253))
    assert status == 200, raw
