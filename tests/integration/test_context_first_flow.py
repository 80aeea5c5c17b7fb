"""Context-first request flow through a real coordinator and fleet, against recording fakes."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from shmdisagg.shm.table import ControlTable
from tests.integration.harness import (
    connection_to_worker,
    deployment,
    fake_executors,
    post,
    post_raw,
    stream_lines,
    write_config,
)

COMPLETION = {"model": "fake-model", "prompt": "hello there", "max_tokens": 4}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def one_by_one(tmp_path: Path, shm_prefix: str):  # type: ignore[no-untyped-def]
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr])
        with deployment(cfg) as dep:
            yield dep, ctx, gen


def _table_is_idle(dep) -> bool:  # type: ignore[no-untyped-def]
    with ControlTable.attach(dep.config.shm_prefix) as table:
        return all(table.load(s.slot) == (0, 0) for s in table.servers())


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_legs_carry_the_handoff_fields_and_ids_stay_continuous(one_by_one, chat: bool, stream: bool) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, gen = one_by_one
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = (
        {**(CHAT if chat else COMPLETION), "stream": stream, "stream_options": {"include_usage": True}}
        if stream
        else (CHAT if chat else COMPLETION)
    )
    if stream:
        status, events, headers = stream_lines(dep, path, body)
        assert status == 200 and events[-1] == b"[DONE]" and len(events) == 5
    else:
        status, resp = post(dep, path, body)
        assert status == 200 and resp["choices"][0]
    [ctx_req] = ctx.recorded()
    [gen_req] = gen.recorded()
    cp, gp = ctx_req["disaggregated_params"], gen_req["disaggregated_params"]
    assert cp["request_type"] == "context_only" and isinstance(cp["disagg_request_id"], int)
    assert ctx_req["stream"] is False and "stream_options" not in ctx_req
    assert gp["request_type"] == "generation_only"
    assert gp["ctx_request_id"] == cp["disagg_request_id"] == gp["disagg_request_id"]
    assert gp["first_gen_tokens"] == [42] and gp["encoded_opaque_state"] == "b3BhcXVl"
    assert gp["ctx_usage"]["prompt_tokens_details"]["cached_tokens"] == 7
    if chat:
        assert gen_req["prompt_token_ids"] == [101, 102, 103] and gen_req["messages"] == CHAT["messages"]
    else:
        assert gen_req["prompt"] == [101, 102, 103]  # the context executor's token ids, not the text
    assert gen_req.get("stream", False) is stream
    assert _table_is_idle(dep)


def test_token_id_prompts_are_relayed(one_by_one) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, gen = one_by_one
    status, _ = post(dep, "/v1/completions", {**COMPLETION, "prompt": [[7, 8, 9, 10]]})
    assert status == 200
    assert ctx.recorded()[0]["prompt"] == [7, 8, 9, 10]
    assert gen.recorded()[0]["prompt"] == [7, 8, 9, 10]


@pytest.mark.parametrize("batch", [False, True], ids=["flat", "one-prompt-batch"])
@pytest.mark.parametrize("stream", [False, True])
def test_long_token_id_prompts_reach_both_legs_whole(one_by_one, stream: bool, batch: bool) -> None:  # type: ignore[no-untyped-def]
    """Past 4 KiB a token-id prompt and the context answer's ids are relayed as their bytes
    (orchestrator/splice.py): both legs must still carry exactly the client's ids."""
    dep, ctx, gen = one_by_one
    ids = [(i * 7919) % 128000 for i in range(15000)]  # answers past the 64 KiB head limit too
    body = {**COMPLETION, "prompt": [ids] if batch else ids, "stream": stream}
    if stream:
        status, events, _ = stream_lines(dep, "/v1/completions", body)
        assert events[-1] == b"[DONE]"
    else:
        status, answer = post(dep, "/v1/completions", body)
        assert answer.get("prompt_token_ids") is None  # nothing internal reaches the client
    assert status == 200
    assert ctx.recorded()[0]["prompt"] == ids and ctx.recorded()[0]["stream"] is False
    assert gen.recorded()[0]["prompt"] == ids and gen.recorded()[0].get("stream", False) is stream
    assert _table_is_idle(dep)


@pytest.mark.parametrize("stream", [False, True])
def test_context_stop_is_final_without_a_generation_call(one_by_one, stream: bool) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, gen = one_by_one
    ctx.script(finish_reason="stop")
    if stream:
        status, events, _ = stream_lines(dep, "/v1/completions", {**COMPLETION, "stream": True})
        assert status == 200 and events[-1] == b"[DONE]"
        first = orjson.loads(events[0])
        assert first["choices"][0]["text"] == "A" and first["choices"][0]["finish_reason"] == "stop"
    else:
        status, resp = post(dep, "/v1/completions", COMPLETION)
        assert status == 200
        assert resp["choices"][0]["finish_reason"] == "stop" and resp["choices"][0]["text"] == "A"
        # the handoff fields read null, as in a plain trtllm-serve answer
        assert resp["choices"][0].get("disaggregated_params") is None and resp.get("prompt_token_ids") is None
    assert len(ctx.recorded()) == 1 and gen.recorded() == []
    assert _table_is_idle(dep)


def test_response_names_the_disagg_request_id(one_by_one) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, _ = one_by_one
    _, _, headers = stream_lines(dep, "/v1/completions", {**COMPLETION, "stream": True})
    assert int(headers["x-disagg-request-id"]) == ctx.recorded()[0]["disaggregated_params"]["disagg_request_id"]


BAD_BODIES = [
    b"{not json",
    b"[1, 2]",
    b'{"model":"fake-model"}',
    b'{"model":"fake-model","prompt":[]}',
    b'{"model":"fake-model","prompt":[[1,2],[3,4]]}',
    b'{"model":"fake-model","prompt":"hi","n":2}',
    b'{"model":"fake-model","prompt":"hi","best_of":3}',
    b'{"model":"fake-model","prompt":"hi","max_tokens":0}',
    b'{"model":"fake-model","prompt":"hi","max_tokens":-1}',
]


def test_bad_requests_get_4xx_and_touch_nothing(one_by_one) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, gen = one_by_one
    for raw in BAD_BODIES:
        status, body = post_raw(dep, "/v1/completions", raw)
        assert status == 400, raw
        assert body["object"] == "error" and body["message"], raw
    status, body = post_raw(dep, "/v1/chat/completions", b'{"model":"fake-model","messages":[]}')
    assert status == 400
    assert ctx.recorded() == [] and gen.recorded() == []
    with ControlTable.attach(dep.config.shm_prefix) as table:
        assert all(table.load(s.slot) == (0, 0) and table.routed(s.slot) == 0 for s in table.servers())
    # the model name is the executors' business: an alias goes through, as with trtllm-serve
    status, body = post(dep, "/v1/completions", {**COMPLETION, "model": "an-alias"})
    assert status == 200 and ctx.recorded()[0]["model"] == "an-alias"


def test_executor_4xx_reaches_the_client_with_its_status(one_by_one) -> None:  # type: ignore[no-untyped-def]
    dep, _, gen = one_by_one
    gen.script(status=400)
    status, body = post(dep, "/v1/completions", COMPLETION)
    assert status == 400 and body["message"] == "scripted 400"
    assert len(gen.recorded()) == 1  # a 4xx is never retried
    assert _table_is_idle(dep)


def test_health_models_and_cluster_info(one_by_one) -> None:  # type: ignore[no-untyped-def]
    dep, ctx, gen = one_by_one
    conn = connection_to_worker(dep, 0)
    from tests.integration.harness import request_json

    assert request_json("", 0, "GET", "/health", conn=conn)[0] == 200
    status, models = request_json("", 0, "GET", "/v1/models", conn=conn)
    assert status == 200 and [m["id"] for m in models["data"]] == ["fake-model"]
    status, info = request_json("", 0, "GET", "/cluster_info", conn=conn)
    assert info["server_lists"] == {"context": [ctx.addr], "generation": [gen.addr]}
    assert len(info["fleet_pids"]) == 2 and info["coordinator_pid"] > 0
    conn.close()
