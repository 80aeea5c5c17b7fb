"""TensorRT-LLM's switches of the request flow, as the executors see them: the internal auth
signature, msgpack bodies, gen_tokids_ctxbytes, gen_strip_message_history and the gen-only
benchmark mode (a real coordinator and fleet in front of recording fakes)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import struct
from pathlib import Path

import pytest

from tests.integration.harness import deployment, fake_executors, post, stream_lines, write_config

COMPLETION = {"model": "fake-model", "prompt": "hello there", "max_tokens": 4}
CHAT = {
    "model": "fake-model",
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "again"},
    ],
    "max_tokens": 4,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
}


def _signature(key: str, params: dict) -> str:
    """disagg_auth.py's signature, computed here from its definition: HMAC-SHA256 over the
    canonical JSON of the two protected fields."""
    payload = json.dumps(
        {
            "ctx_info_endpoint": params.get("ctx_info_endpoint"),
            "encoded_opaque_state": params.get("encoded_opaque_state"),
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return "sha256=" + hmac.new(key.encode(), payload.encode(), hashlib.sha256).hexdigest()


@pytest.mark.parametrize("style", ["context_first", "generation_first"])
def test_generation_legs_carry_the_handoff_signed_with_the_internal_key(
    tmp_path: Path, shm_prefix: str, style: str
) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(
            tmp_path,
            shm_prefix,
            [ctx.addr],
            [gen.addr],
            num_workers=1,
            internal_request_auth_key="s3cret-key",
            schedule_style=style,
        )
        with deployment(cfg) as dep:
            assert post(dep, "/v1/completions", COMPLETION)[0] == 200
            status, info = post(dep, "/v1/completions", COMPLETION)  # and a second time, on a warm connection
            assert status == 200 and "s3cret" not in json.dumps(info)
        ctx_rec, gen_rec = ctx.recorded(), gen.recorded()
    [ctx_req, _], [gen_req, _] = ctx_rec, gen_rec
    params = gen_req["disaggregated_params"]
    assert params["encoded_opaque_state"] == "b3BhcXVl"  # a protected field, so the leg is signed
    assert gen_req["_headers"]["x-trtllm-disagg-auth"] == _signature("s3cret-key", params)
    assert "x-trtllm-disagg-auth" not in ctx_req["_headers"]  # context_only params carry no protected field
    assert "s3cret-key" not in json.dumps([ctx_req, gen_req])  # the key itself never travels


def test_without_a_key_generation_legs_go_unsigned(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], num_workers=1)
        with deployment(cfg) as dep:
            assert post(dep, "/v1/completions", COMPLETION)[0] == 200
        gen_rec = gen.recorded()
    assert "x-trtllm-disagg-auth" not in gen_rec[0]["_headers"]
    assert gen_rec[0]["_headers"]["content-type"] == "application/json"


def test_msgspec_bodies_are_msgpack_with_the_upstream_header(
    tmp_path: Path, shm_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRTLLM_SERVE_ENABLE_MSGSPEC", "1")
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], num_workers=1)
        with deployment(cfg) as dep:
            status, resp = post(dep, "/v1/completions", COMPLETION)
            assert status == 200 and resp["choices"][0]["text"] == "ABCD"
        ctx_rec, gen_rec = ctx.recorded(), gen.recorded()
    for req in (ctx_rec[0], gen_rec[0]):
        assert req["_headers"]["x-trtllm-msgpack"] == "1" and req["_headers"]["content-type"] == "application/json"
        assert req["model"] == "fake-model"  # decoded from msgpack by the fake, as the worker does
    assert gen_rec[0]["disaggregated_params"]["request_type"] == "generation_only"


def test_gen_tokids_ctxbytes_asks_for_b64_ids_and_relays_them_verbatim(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], num_workers=1, gen_tokids_ctxbytes=True)
        with deployment(cfg) as dep:
            assert post(dep, "/v1/chat/completions", CHAT)[0] == 200
        ctx_rec, gen_rec = ctx.recorded(), gen.recorded()
    [ctx_req], [gen_req] = ctx_rec, gen_rec
    assert ctx_req["disaggregated_params"]["return_prompt_token_ids_b64"] is True
    assert struct.unpack("<3i", base64.b64decode(gen_req["prompt_token_ids_b64"])) == (101, 102, 103)
    assert "prompt_token_ids" not in gen_req


def test_without_gen_tokids_ctxbytes_the_context_leg_does_not_ask_for_b64(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], num_workers=1)
        with deployment(cfg) as dep:
            assert post(dep, "/v1/chat/completions", CHAT)[0] == 200
        ctx_rec, gen_rec = ctx.recorded(), gen.recorded()
    assert "return_prompt_token_ids_b64" not in ctx_rec[0]["disaggregated_params"]  # older workers forbid the key
    assert gen_rec[0]["prompt_token_ids"] == [101, 102, 103]


@pytest.mark.parametrize("strip", [False, True])
def test_gen_strip_message_history_sends_only_the_last_message_to_generation(
    tmp_path: Path, shm_prefix: str, strip: bool
) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], num_workers=1, gen_strip_message_history=strip)
        with deployment(cfg) as dep:
            assert post(dep, "/v1/chat/completions", CHAT)[0] == 200
        ctx_rec, gen_rec = ctx.recorded(), gen.recorded()
    [ctx_req], [gen_req] = ctx_rec, gen_rec
    assert ctx_req["messages"] == CHAT["messages"]  # the context executor renders the whole chat
    assert gen_req["messages"] == (CHAT["messages"][-1:] if strip else CHAT["messages"])
    assert gen_req["tools"] == CHAT["tools"] and gen_req["prompt_token_ids"] == [101, 102, 103]


@pytest.mark.parametrize("stream", [False, True])
def test_benchmark_gen_only_skips_the_context_leg_with_upstreams_stub_handoff(
    tmp_path: Path, shm_prefix: str, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    monkeypatch.setenv("TRTLLM_DISAGG_BENCHMARK_GEN_ONLY", "1")
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], num_workers=1)
        with deployment(cfg) as dep:
            if stream:
                status, events, _ = stream_lines(dep, "/v1/completions", {**COMPLETION, "stream": True})
                assert status == 200 and events[-1] == b"[DONE]"
            else:
                assert post(dep, "/v1/completions", COMPLETION)[0] == 200
        ctx_rec, gen_rec = ctx.recorded(), gen.recorded()
    assert ctx_rec == []
    [gen_req] = gen_rec
    assert gen_req["disaggregated_params"] == {
        "request_type": "generation_only",
        "first_gen_tokens": [7],
        "ctx_request_id": 1,
        "encoded_opaque_state": None,
        "draft_tokens": None,
    }
    assert gen_req["ignore_eos"] is True and gen_req["prompt"] == "hello there"


@pytest.mark.parametrize("allow", [False, True])
def test_a_request_chat_template_is_refused_unless_allowed(tmp_path: Path, shm_prefix: str, allow: bool) -> None:
    body = {**CHAT, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(
            tmp_path, shm_prefix, [ctx.addr], [gen.addr], num_workers=1, allow_request_chat_template=allow
        )
        with deployment(cfg) as dep:
            status, resp = post(dep, "/v1/chat/completions", body)
        ctx_rec = ctx.recorded()
    if allow:
        assert status == 200 and ctx_rec[0]["chat_template"] == body["chat_template"]
    else:
        assert status == 400 and resp["param"] == "chat_template" and resp["code"] == 400
        assert resp["message"].startswith("chat_template cannot be supplied per request") and ctx_rec == []


@pytest.mark.parametrize(("ours", "ok"), [("shared-key", True), ("another-key", False), (None, False)])
def test_an_executor_that_requires_the_key_accepts_only_our_signed_handoffs(
    tmp_path: Path, shm_prefix: str, ours: str | None, ok: bool
) -> None:
    top = {"internal_request_auth_key": ours} if ours else {}
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        gen.script(auth_key="shared-key")
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [gen.addr], num_workers=1, **top)
        with deployment(cfg) as dep:
            status, body = post(dep, "/v1/completions", COMPLETION)
            stream_status, events, _ = stream_lines(dep, "/v1/completions", {**COMPLETION, "stream": True})
    if ok:
        assert status == 200 and body["choices"][0]["text"] == "ABCD"
        assert stream_status == 200 and events[-1] == b"[DONE]" and b"error" not in b"".join(events)
    else:  # the worker's refusal, relayed with its status
        assert status == 400 and body["message"] == "Invalid internal disaggregated request authentication"
        assert stream_status == 400
