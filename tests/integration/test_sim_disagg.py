"""Context-only -> generation-only across two simulator processes, as the orchestrator drives them."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from shmdisagg.executors.sim import output_tokens
from shmdisagg.executors.sim.testing import SimProcess, get_json, post_json, stream_sse
from shmdisagg.executors.sim.tokenizer import Tokenizer
from tests.conftest import free_port

SPEEDUP = "200"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12
_next_id = iter(range(1 << 41, (1 << 41) + 100_000))


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[SimProcess, SimProcess]]:
    ctx_port, gen_port = free_port(), free_port()
    ctx = SimProcess(
        ["--port", str(ctx_port), "--role", "context", "--speedup", SPEEDUP, "--kv-transfer-timeout", "2"], ctx_port
    )
    gen = SimProcess(
        ["--port", str(gen_port), "--role", "generation", "--speedup", SPEEDUP, "--kv-transfer-timeout", "2"], gen_port
    )
    with ctx.start(wait=False), gen.start(wait=False):
        ctx.wait_healthy()
        gen.wait_healthy()
        yield ctx, gen


def context_leg(ctx: SimProcess, body: dict[str, Any], chat: bool = False) -> dict[str, Any]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    leg = dict(
        body, stream=False, disaggregated_params={"request_type": "context_only", "disagg_request_id": next(_next_id)}
    )
    leg.pop("stream_options", None)
    status, resp = post_json(ctx.endpoint, path, leg)
    assert status == 200, resp
    return resp


def generation_body(body: dict[str, Any], ctx_resp: dict[str, Any], chat: bool = False) -> dict[str, Any]:
    """What the orchestrator sends to the generation executor after a context leg."""
    params = dict(ctx_resp["choices"][0]["disaggregated_params"])
    params.update(request_type="generation_only", ctx_usage=ctx_resp["usage"])
    gen = dict(body, disaggregated_params=params)
    if chat:
        gen["prompt_token_ids"] = ctx_resp["prompt_token_ids"]
    else:
        gen["prompt"] = ctx_resp["prompt_token_ids"]
    return gen


def test_context_response_carries_the_handoff_fields(pair):
    ctx, _ = pair
    disagg_id = next(_next_id)
    status, resp = post_json(
        ctx.endpoint,
        "/v1/completions",
        {
            "model": "m",
            "prompt": PROMPT,
            "max_tokens": 8,
            "disaggregated_params": {"request_type": "context_only", "disagg_request_id": disagg_id},
        },
    )
    assert status == 200
    prompt_ids = [Tokenizer.bos_id, *Tokenizer().encode(PROMPT)]
    assert resp["prompt_token_ids"] == prompt_ids
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "length"
    params = choice["disaggregated_params"]
    assert params == {  # every DisaggregatedParams field, as to_disaggregated_params fills them
        "request_type": "context_only",
        "first_gen_tokens": [output_tokens(prompt_ids, 1)[0]],
        "first_gen_log_probs": None,
        "first_gen_logits": None,
        "ctx_request_id": disagg_id,
        "encoded_opaque_state": params["encoded_opaque_state"],
        "draft_tokens": None,
        "disagg_request_id": disagg_id,
        "ctx_dp_rank": 0,
        "ctx_info_endpoint": ctx.endpoint,
        "schedule_style": None,
        "ctx_usage": None,
        "return_prompt_token_ids_b64": False,
        "resolved_thinking": None,
    }
    _, info = get_json(ctx.endpoint, "/server_info")
    assert params["encoded_opaque_state"] == info["disaggregated_params"]["encoded_opaque_state"]
    assert resp["usage"]["completion_tokens"] == 1
    assert resp["usage"]["prompt_tokens"] == len(prompt_ids)
    assert "cached_tokens" in resp["usage"]["prompt_tokens_details"]


def test_non_streaming_handoff_continues_the_tokens_and_reports_the_context_usage(pair):
    ctx, gen = pair
    body = {"model": "m", "prompt": PROMPT + " handoff", "max_tokens": 12}
    context_leg(ctx, body)  # warm the context executor's cache: the next leg reports cached tokens
    ctx_resp = context_leg(ctx, body)
    ctx_cached = ctx_resp["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert ctx_cached > 0
    status, resp = post_json(gen.endpoint, "/v1/completions", generation_body(body, ctx_resp))
    assert status == 200, resp
    prompt_ids = ctx_resp["prompt_token_ids"]
    tokenizer = Tokenizer()
    assert resp["choices"][0]["text"] == tokenizer.decode(output_tokens(prompt_ids, 12))
    assert resp["choices"][0]["finish_reason"] == "length"
    assert resp["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 12,
        "total_tokens": len(prompt_ids) + 12,
        "prompt_tokens_details": {"cached_tokens": ctx_cached},
    }
    echoed = resp["choices"][0]["disaggregated_params"]  # the worker echoes the request's params
    assert echoed["request_type"] == "generation_only" and echoed["ctx_usage"] == ctx_resp["usage"]
    # the same request served locally (no disaggregation) produces the same text
    _, local = post_json(gen.endpoint, "/v1/completions", body)
    assert local["choices"][0]["text"] == resp["choices"][0]["text"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streaming_handoff_starts_with_first_gen_tokens_and_ends_with_usage(pair, chat):
    ctx, gen = pair
    if chat:
        body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6}
    else:
        body = {"model": "m", "prompt": PROMPT + " stream", "max_tokens": 6}
    body.update(stream=True, stream_options={"include_usage": True})
    ctx_resp = context_leg(ctx, body, chat)
    first = ctx_resp["choices"][0]["disaggregated_params"]["first_gen_tokens"]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    events = list(stream_sse(gen.endpoint, path, generation_body(body, ctx_resp, chat)))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["prompt_tokens"] == len(ctx_resp["prompt_token_ids"]) and usage["completion_tokens"] == 6
    assert (
        usage["prompt_tokens_details"]["cached_tokens"] == ctx_resp["usage"]["prompt_tokens_details"]["cached_tokens"]
    )
    token_chunks = chunks[1:-1] if chat else chunks[:-1]
    texts = [c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"] for c in token_chunks]
    expected = output_tokens(ctx_resp["prompt_token_ids"], 6)
    assert expected[0] == first[0]
    assert texts == [Tokenizer().decode([t]) for t in expected]
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0].get("finish_reason") is None for c in token_chunks[:-1])  # chat chunks omit nulls
    if chat:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_generation_first_the_generation_request_may_arrive_before_the_context_request(pair):
    ctx, gen = pair
    _, info = get_json(ctx.endpoint, "/server_info")
    disagg_id = next(_next_id)
    body = {"model": "m", "prompt": PROMPT + " generation first", "max_tokens": 5}
    # gen-first: the generation request is built from the context server's /server_info, without
    # a context response (no first_gen_tokens, no ctx_usage).
    gen_params = {
        "request_type": "generation_only",
        "ctx_request_id": disagg_id,
        "disagg_request_id": disagg_id,
        "schedule_style": 1,  # DisaggScheduleStyle.GENERATION_FIRST
        "ctx_info_endpoint": info["disaggregated_params"]["ctx_info_endpoint"][0],
        "encoded_opaque_state": info["disaggregated_params"]["encoded_opaque_state"],
    }
    result: dict[str, Any] = {}

    def send_gen() -> None:
        result["gen"] = post_json(gen.endpoint, "/v1/completions", dict(body, disaggregated_params=gen_params))

    thread = threading.Thread(target=send_gen)
    thread.start()
    # The generation executor is now waiting on its KV pull; only then does the context leg start.
    deadline = time.monotonic() + 10
    while get_json(gen.endpoint, "/sim/stats")[1]["num_transferring"] == 0:
        assert time.monotonic() < deadline, "the generation request never started its KV pull"
        time.sleep(0.01)
    status, ctx_resp = post_json(
        ctx.endpoint,
        "/v1/completions",
        dict(body, disaggregated_params={"request_type": "context_only", "disagg_request_id": disagg_id}),
    )
    assert status == 200
    thread.join(30)
    status, resp = result["gen"]
    assert status == 200, resp
    prompt_ids = ctx_resp["prompt_token_ids"]
    assert resp["choices"][0]["text"] == Tokenizer().decode(output_tokens(prompt_ids, 5))
    assert (
        resp["usage"]["prompt_tokens_details"]["cached_tokens"]
        == ctx_resp["usage"]["prompt_tokens_details"]["cached_tokens"]
    )


def test_an_unknown_ctx_request_id_fails_the_generation_request_after_the_transfer_timeout(pair):
    ctx, gen = pair
    params = {
        "request_type": "generation_only",
        "ctx_request_id": 12345,
        "first_gen_tokens": [Tokenizer().encode(" the")[0]],
        "ctx_info_endpoint": ctx.endpoint,
    }
    status, resp = post_json(
        gen.endpoint,
        "/v1/completions",
        {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "disaggregated_params": params},
    )
    assert status == 500
    assert resp["object"] == "error" and "unknown ctx_request_id 12345" in resp["message"]
    events = list(
        stream_sse(
            gen.endpoint,
            "/v1/completions",
            {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True, "disaggregated_params": params},
        )
    )
    assert events[-1] == "[DONE]"
    assert "unknown ctx_request_id" in json.loads(events[-2])["error"]["message"]


def test_a_relayed_prompt_that_differs_from_the_context_prompt_is_an_error(pair):
    ctx, gen = pair
    body = {"model": "m", "prompt": PROMPT + " mismatch", "max_tokens": 4}
    ctx_resp = context_leg(ctx, body)
    wrong = generation_body(body, ctx_resp)
    wrong["prompt"] = wrong["prompt"][:-1] + [wrong["prompt"][-1] + 1]
    status, resp = post_json(gen.endpoint, "/v1/completions", wrong)
    assert status == 500 and "differs" in resp["message"]


def test_role_mismatched_requests_are_refused(pair):
    ctx, gen = pair
    status, resp = post_json(
        gen.endpoint,
        "/v1/completions",
        {"model": "m", "prompt": "x", "disaggregated_params": {"request_type": "context_only"}},
    )
    assert status == 400 and "generation role" in resp["message"]
    status, resp = post_json(
        ctx.endpoint,
        "/v1/completions",
        {
            "model": "m",
            "prompt": "x",
            "disaggregated_params": {
                "request_type": "generation_only",
                "ctx_request_id": 1,
                "first_gen_tokens": [1],
                "ctx_info_endpoint": "h:1",
            },
        },
    )
    assert status == 400 and "context role" in resp["message"]


def test_a_context_leg_ends_with_length_unless_its_token_is_a_stop_word(pair):
    ctx, _ = pair
    # TensorRT-LLM's context phase reports "length" ("continue on generation") even for max_tokens 1
    resp = context_leg(ctx, {"model": "m", "prompt": PROMPT, "max_tokens": 1})
    assert resp["choices"][0]["finish_reason"] == "length"
    stop = output_tokens(resp["prompt_token_ids"], 1)[0]
    resp = context_leg(ctx, {"model": "m", "prompt": PROMPT, "max_tokens": 9, "stop_token_ids": [stop]})
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == "" and resp["usage"]["completion_tokens"] == 0  # the stop word is dropped
    assert choice["disaggregated_params"]["first_gen_tokens"] == [stop]  # the token the context phase generated


def test_a_pull_whose_generation_executor_left_stops_waiting_for_its_context_request():
    """A generation request aborted while its KV pull waits for the context request (generation
    first, the client gone): the context executor forgets the pull, so the context request, when
    it comes, stays pinned for the next pull instead of going to a puller nobody waits for (found
    by the chaos suite: such pulls waited out the transfer timeout and ended in a traceback at
    shutdown)."""
    port = free_port()
    # a transfer timeout far beyond the test's polls: the pull must stop because its client left
    with SimProcess(
        ["--port", str(port), "--role", "context", "--speedup", SPEEDUP, "--kv-transfer-timeout", "120"], port
    ).start() as ctx:
        _abandoned_pull(ctx)


def _abandoned_pull(ctx: SimProcess) -> None:
    disagg_id = next(_next_id)

    def waiting() -> int:
        return get_json(ctx.endpoint, "/sim/stats")[1]["transfers"]["waiting"]

    def until(predicate: Any, what: str) -> None:
        deadline = time.monotonic() + 10
        while not predicate():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    raw = json.dumps({"ctx_request_id": disagg_id, "hold_s": 0}).encode()
    with socket.create_connection(("127.0.0.1", ctx.port)) as sock:
        sock.sendall(
            b"POST /sim/kv_transfer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(raw), raw)
        )
        until(lambda: waiting() == 1, "the pull never started waiting")
    until(lambda: waiting() == 0, "the context executor still waits for a pull whose client left")
    body = {"model": "m", "prompt": PROMPT + " abandoned pull", "max_tokens": 4}
    status, _ = post_json(
        ctx.endpoint,
        "/v1/completions",
        dict(body, disaggregated_params={"request_type": "context_only", "disagg_request_id": disagg_id}),
    )
    assert status == 200
    status, pulled = post_json(ctx.endpoint, "/sim/kv_transfer", {"ctx_request_id": disagg_id, "hold_s": 0})
    assert status == 200 and pulled["ctx_request_id"] == disagg_id
