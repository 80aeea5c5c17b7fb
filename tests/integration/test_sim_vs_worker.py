"""The simulator answers as trtllm-serve does: a differential test against TensorRT-LLM's own
worker server code (`openai_server.py`, `openai_protocol.py`, `postprocess_handlers.py` in the
CPU copy in ../shared/trtllm_worker, see `trtllm_worker.py`).

A context and a generation worker and two simulators in `serve` mode (standing in for
trtllm-serve) get the same corpus of requests; every answer is compared by its *shape*: the
fields and their JSON types at every level (`shape()`), the status, the content type, the SSE
framing and chunk order (`sse_pattern()`), finish and stop reasons, and counts (logprobs per
token, top entries per position). Generated text differs by design and is not compared.

Where the worker copy itself departs from TensorRT-LLM (its fake engine is a stand-in), the test
asserts upstream's behaviour for the simulator and names the stand-in's (`STAND_IN`); where the
simulator differs on purpose, README "Differences from trtllm-serve" lists it and the test
asserts exactly that (`KEPT`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from shmdisagg.executors.sim.testing import SimProcess
from tests.conftest import free_port
from tests.integration.trtllm_worker import Worker, call, missing

pytestmark = pytest.mark.skipif(missing() is not None, reason=missing() or "")

MAX_SEQ_LEN = 4096  # the worker copy's default; the simulators get the same
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TEXT = "The quick brown fox jumps over the lazy dog"
UNICODE = "Ünïcødé prompt: naïve café, 東京, emoji ✓"
MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Say something."}]
_ids = iter(range(1 << 41, (1 << 41) + 1_000_000))

# Where the worker copy's fake engine departs from TensorRT-LLM (the simulator follows upstream).
STAND_IN = {
    "max_tokens_over_max_seq_len": "the copy's fake engine refuses it; TensorRT-LLM's PyTorch backend clamps "
    "max_tokens to max_seq_len - prompt (executor/base_worker.py _deduce_max_tokens, file id 55301320707)",
}


# -- processes ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[str, str]]]:
    """{"worker": (ctx endpoint, gen endpoint), "sim": (ctx endpoint, gen endpoint)}."""
    extra = tmp_path_factory.mktemp("sim") / "llm.yaml"
    extra.write_text(yaml.safe_dump({
        "kv_cache_config": {"tokens_per_block": 32, "enable_block_reuse": True, "event_buffer_max_size": 1024},
        "cache_transceiver_config": {"backend": "UCX", "kv_transfer_timeout_ms": 5000},
        "max_seq_len": MAX_SEQ_LEN,
        "sim": {"speedup": 100.0},
    }))  # fmt: skip
    ports = [free_port() for _ in range(4)]
    workers = [
        Worker(ports[0], "context", "--itl-ms", "1", "--ttft-ms", "1"),
        Worker(ports[1], "generation", "--itl-ms", "1", "--ttft-ms", "1"),
    ]
    # msgpack bodies on, as run_worker.sh sets it for the workers
    sims = [SimProcess(["serve", "sim-model", "--host", "127.0.0.1", "--port", str(p), "--extra_llm_api_options",
                        str(extra)], p, env={"TRTLLM_SERVE_ENABLE_MSGSPEC": "1"}) for p in ports[2:]]  # fmt: skip
    try:
        for s in sims:
            s.start(wait=False)
        for w in workers:
            w.wait_healthy()
        for s in sims:
            s.wait_healthy()
        yield {"worker": (workers[0].endpoint, workers[1].endpoint), "sim": (sims[0].endpoint, sims[1].endpoint)}
    finally:
        for s in sims:
            s.stop()
        for w in workers:
            w.stop()


# -- reading answers ----------------------------------------------------------------------------
def shape(value: Any, mapping: bool = False) -> Any:
    """The JSON type of `value`, recursively: a dict's keys in order with their shapes, a list's
    distinct element shapes in order of first appearance. A completion's `top_logprobs` entries
    map token texts (data) to logprobs, so they are shaped as `{"<text>": <value shape>}`."""
    if isinstance(value, dict):
        if mapping:
            return {"<text>": list(dict.fromkeys(shape(v) for v in value.values()))}
        maps = "text_offset" in value  # completion logprobs
        return {k: shape(v, mapping=maps and k == "top_logprobs") for k, v in value.items()}
    if isinstance(value, list):
        out: list[Any] = []
        for v in value:
            s = shape(v, mapping)
            if s not in out:
                out.append(s)
        return out
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str"}[type(value)]


def assert_same_shape(ours: Any, theirs: Any, where: str = "$") -> None:
    """Fail with the first path where the shapes differ."""
    if isinstance(theirs, dict) and isinstance(ours, dict):
        assert list(ours) == list(theirs), f"{where}: keys {list(ours)} != worker's {list(theirs)}"
        for k in theirs:
            assert_same_shape(ours[k], theirs[k], f"{where}.{k}")
    elif isinstance(theirs, list) and isinstance(ours, list):
        assert len(ours) == len(theirs), (
            f"{where}: {len(ours)} element shapes != worker's {len(theirs)}: {ours} / {theirs}"
        )
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same_shape(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, f"{where}: {ours} != worker's {theirs}"


def post(
    endpoint: str, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    return call(endpoint, "POST", path, body, headers)


def both(
    sides: dict[str, tuple[str, str]], path: str, body: Any, leg: int = 0
) -> dict[str, tuple[int, dict[str, str], bytes]]:
    return {name: post(eps[leg], path, body) for name, eps in sides.items()}


def sse_frames(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name or None, data) of each SSE frame; the raw frame text is kept for framing checks."""
    text = raw.decode()
    assert text.endswith("\n\n"), f"stream does not end with a blank line: {text[-80:]!r}"
    frames = []
    for frame in text[:-2].split("\n\n"):
        event = None
        data = None
        for line in frame.split("\n"):
            if line.startswith("event: "):
                event = line[7:]
            else:
                assert line.startswith("data: "), f"not an SSE data line: {line!r}"
                data = line[6:]
        assert data is not None
        frames.append((event, data))
    return frames


def classify(data: str, chat: bool) -> str:
    if data == "[DONE]":
        return "done"
    chunk = json.loads(data)
    if "error" in chunk:
        return "error"
    if not chunk["choices"]:
        return "usage"
    choice = chunk["choices"][0]
    if chat and "role" in choice["delta"]:
        return "role"
    return "finish" if choice.get("finish_reason") is not None else "content"


def sse_pattern(raw: bytes, chat: bool) -> tuple[list[str], dict[str, list[Any]], dict[str, set[str]]]:
    """(the order of chunk kinds with repeats collapsed, each kind's distinct chunk shapes, each
    kind's frame endings: the chat role chunk is written `data: {...} \\n\\n`)."""
    order: list[str] = []
    shapes: dict[str, list[Any]] = {}
    endings: dict[str, set[str]] = {}
    for _, data in sse_frames(raw):
        kind = classify(data, chat)
        if not order or order[-1] != kind:
            order.append(kind)
        if data != "[DONE]":
            s = shape(json.loads(data))
            shapes.setdefault(kind, [])
            if s not in shapes[kind]:
                shapes[kind].append(s)
        endings.setdefault(kind, set()).add("space" if data.endswith(" ") else "plain")
    return order, shapes, endings


def chunks_of(raw: bytes, chat: bool, kind: str) -> list[dict[str, Any]]:
    return [json.loads(d) for _, d in sse_frames(raw) if d != "[DONE]" and classify(d, chat) == kind]


def compare_json(answers: dict[str, tuple[int, dict[str, str], bytes]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both 200 JSON answers of the same shape; returns (ours, theirs)."""
    (s_status, s_headers, s_raw), (w_status, w_headers, w_raw) = answers["sim"], answers["worker"]
    assert w_status == 200, w_raw
    assert s_status == 200, s_raw
    assert s_headers["content-type"] == w_headers["content-type"] == "application/json"
    ours, theirs = json.loads(s_raw), json.loads(w_raw)
    assert_same_shape(shape(ours), shape(theirs))
    return ours, theirs


def compare_stream(answers: dict[str, tuple[int, dict[str, str], bytes]], chat: bool) -> tuple[bytes, bytes]:
    (s_status, s_headers, s_raw), (w_status, w_headers, w_raw) = answers["sim"], answers["worker"]
    assert (s_status, w_status) == (200, 200), (s_raw[:300], w_raw[:300])
    assert s_headers["content-type"] == w_headers["content-type"] == "text/event-stream; charset=utf-8"
    ours, theirs = sse_pattern(s_raw, chat), sse_pattern(w_raw, chat)
    assert ours[0] == theirs[0], "chunk order"
    assert_same_shape(ours[1], theirs[1])
    assert ours[2] == theirs[2], "frame endings"
    return s_raw, w_raw


def check_usage(usage: dict[str, Any]) -> None:
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)


# -- the corpus: plain requests -----------------------------------------------------------------
PLAIN = {
    "completion_text": (COMPLETIONS, {"prompt": TEXT, "max_tokens": 4}),
    "completion_token_ids": (COMPLETIONS, {"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 3}),
    "completion_batch_of_one": (COMPLETIONS, {"prompt": [TEXT], "max_tokens": 3}),
    "completion_unicode": (COMPLETIONS, {"prompt": UNICODE, "max_tokens": 3}),
    "completion_detokenize_false": (COMPLETIONS, {"prompt": TEXT, "max_tokens": 3, "detokenize": False}),
    "completion_echo": (COMPLETIONS, {"prompt": TEXT, "max_tokens": 3, "echo": True}),
    "completion_logprobs": (COMPLETIONS, {"prompt": TEXT, "max_tokens": 4, "logprobs": 3}),
    "completion_sampling_knobs": (COMPLETIONS, {"prompt": TEXT, "max_tokens": 3, "temperature": 0.7, "top_p": 0.9,
                                                "top_k": 5, "seed": 3, "ignore_eos": True, "user": "u"}),
    "completion_unknown_model": (COMPLETIONS, {"prompt": TEXT, "max_tokens": 2, "model": "some-other-model"}),
    "chat": (CHAT, {"messages": MESSAGES, "max_tokens": 4}),
    "chat_max_completion_tokens": (CHAT, {"messages": MESSAGES, "max_completion_tokens": 3}),
    "chat_unicode_parts": (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": UNICODE}]}],
                                  "max_tokens": 3}),
    "chat_logprobs": (CHAT, {"messages": MESSAGES, "max_tokens": 3, "logprobs": True}),
    "chat_top_logprobs": (CHAT, {"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 3}),
    "chat_no_generation_prompt": (CHAT, {"messages": MESSAGES, "max_tokens": 3, "add_generation_prompt": False}),
    "chat_echo": (CHAT, {"messages": [*MESSAGES, {"role": "assistant", "content": "Well,"}], "max_tokens": 3,
                         "echo": True}),
    "chat_prompt_token_ids": (CHAT, {"messages": [], "prompt_token_ids": [1, 2, 3, 4], "max_tokens": 3}),
    # pydantic's lax mode (TensorRT-LLM's request models): numbers and booleans in other JSON types
    "completion_lax_types": (COMPLETIONS, {"prompt": TEXT, "max_tokens": 3.0, "n": "1", "stream": "false",
                                           "echo": 0}),
    "completion_empty_text": (COMPLETIONS, {"prompt": "", "max_tokens": 3}),
    "completion_empty_model": (COMPLETIONS, {"prompt": TEXT, "max_tokens": 2, "model": ""}),
}  # fmt: skip


def body_of(case: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", **case}


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_a_non_streaming_answer_has_the_workers_shape(sides, name):
    path, case = PLAIN[name]
    body = body_of(case)
    ours, theirs = compare_json(both(sides, path, body))
    chat = path == CHAT
    for answer in (ours, theirs):
        assert answer["object"] == ("chat.completion" if chat else "text_completion")
        assert answer["id"].startswith("chatcmpl-" if chat else "cmpl-")
        assert answer["model"] == body["model"]
        [choice] = answer["choices"]
        assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
        check_usage(answer["usage"])
        assert answer["usage"]["completion_tokens"] == body.get("max_tokens", body.get("max_completion_tokens"))
        assert answer["prompt_token_ids"] is None and choice["disaggregated_params"] is None
        if chat:
            assert choice["message"]["role"] == ("assistant" if body.get("add_generation_prompt", True) else "user")
            if body.get("echo"):
                assert choice["message"]["content"].startswith("Well,")
        elif body.get("echo"):
            assert choice["text"].startswith(TEXT)
        if body.get("detokenize") is False:
            assert choice["text"] == "" and len(choice["token_ids"]) == answer["usage"]["completion_tokens"]
        check_logprob_counts(choice, body, answer["usage"]["completion_tokens"], chat)


def check_logprob_counts(choice: dict[str, Any], body: dict[str, Any], tokens: int, chat: bool) -> None:
    if not body.get("logprobs"):
        assert choice["logprobs"] is None
        return
    if chat:
        content = choice["logprobs"]["content"]
        assert len(content) == tokens
        k = body.get("top_logprobs")
        assert all((len(e["top_logprobs"]) == k) if k else e["top_logprobs"] is None for e in content)
    else:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == tokens
        assert all(len(top) == body["logprobs"] for top in lp["top_logprobs"])


STREAMS = {
    "completion": (COMPLETIONS, {"prompt": TEXT, "max_tokens": 4}),
    "completion_usage": (COMPLETIONS, {"prompt": TEXT, "max_tokens": 4, "stream_options": {"include_usage": True}}),
    "completion_continuous_usage": (COMPLETIONS, {"prompt": TEXT, "max_tokens": 3, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}),
    "completion_logprobs": (COMPLETIONS, {"prompt": TEXT, "max_tokens": 3, "logprobs": 2}),
    "completion_echo": (COMPLETIONS, {"prompt": TEXT, "max_tokens": 3, "echo": True}),
    "completion_detokenize_false": (COMPLETIONS, {"prompt": [5, 6, 7], "max_tokens": 3, "detokenize": False}),
    "chat": (CHAT, {"messages": MESSAGES, "max_tokens": 4}),
    "chat_usage": (CHAT, {"messages": MESSAGES, "max_tokens": 4, "stream_options": {"include_usage": True}}),
    "chat_continuous_usage": (CHAT, {"messages": MESSAGES, "max_tokens": 3, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}),
    "chat_usage_off": (CHAT, {"messages": MESSAGES, "max_tokens": 3, "stream_options": {"include_usage": False}}),
    "chat_top_logprobs": (CHAT, {"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}),
    "chat_logprobs": (CHAT, {"messages": MESSAGES, "max_tokens": 3, "logprobs": True}),
    "chat_echo": (CHAT, {"messages": [*MESSAGES, {"role": "assistant", "content": "Well,"}], "max_tokens": 3,
                         "echo": True}),
    "chat_unicode": (CHAT, {"messages": [{"role": "user", "content": UNICODE}], "max_tokens": 3}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_a_stream_has_the_workers_framing_chunk_order_and_shapes(sides, name):
    path, case = STREAMS[name]
    chat = path == CHAT
    body = body_of({**case, "stream": True})
    ours, _ = compare_stream(both(sides, path, body), chat)
    order, _, _ = sse_pattern(ours, chat)
    assert (
        order[-1] == "done" and order[-2 if not body.get("stream_options", {}).get("include_usage") else -3] == "finish"
    )
    if body.get("stream_options", {}).get("include_usage"):
        [usage] = chunks_of(ours, chat, "usage")
        check_usage(usage["usage"])
        assert usage["usage"]["completion_tokens"] == body["max_tokens"]
    ids = {json.loads(d)["id"] for _, d in sse_frames(ours) if d != "[DONE]"}
    assert len(ids) == 1


# -- stop conditions -----------------------------------------------------------------------------
def generated(endpoint: str, path: str, body: dict[str, Any]) -> tuple[list[str], list[int]]:
    """(the text of each generated token, their ids) of `body`, read with logprobs and detokenize."""
    chat = path == CHAT
    probe = dict(body, logprobs=True if chat else 1)
    status, _, raw = post(endpoint, path, probe)
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    texts = [e["token"] for e in choice["logprobs"]["content"]] if chat else choice["logprobs"]["tokens"]
    if chat:
        return texts, []
    status, _, raw = post(endpoint, path, dict(body, detokenize=False))
    return texts, json.loads(raw)["choices"][0]["token_ids"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ends_the_request_with_stop_and_the_string_as_stop_reason(sides, path, stream, include):
    chat = path == CHAT
    base = body_of({"messages": MESSAGES} if chat else {"prompt": TEXT}) | {"max_tokens": 6}
    answers = {}
    for name, (ctx, _) in sides.items():
        texts, _ = generated(ctx, path, base)
        stop = texts[2]  # the third token's text: both sides stop there
        body = dict(base, stop=[stop, "never-generated-zzz"], include_stop_str_in_output=include, stream=stream)
        answers[name] = (post(ctx, path, body), stop, texts)
    if stream:
        compare_stream({k: v[0] for k, v in answers.items()}, chat)
    else:
        compare_json({k: v[0] for k, v in answers.items()})
    for name, ((_status, _, raw), stop, _texts) in answers.items():
        if stream:
            [final] = chunks_of(raw, chat, "finish")
            choice = final["choices"][0]
        else:
            choice = json.loads(raw)["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            assert text.endswith(stop) == include, (name, text, stop)
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop, name


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_end_the_request_with_the_id_as_stop_reason(sides, stream):
    base = body_of({"prompt": TEXT, "max_tokens": 6})
    answers = {}
    for name, (ctx, _) in sides.items():
        _, ids = generated(ctx, COMPLETIONS, base)
        answers[name] = (post(ctx, COMPLETIONS, dict(base, stop_token_ids=[ids[2]], stream=stream)), ids[2])
    if stream:
        compare_stream({k: v[0] for k, v in answers.items()}, False)
    else:
        compare_json({k: v[0] for k, v in answers.items()})
    for name, ((_, _, raw), stop_id) in answers.items():
        choice = chunks_of(raw, False, "finish")[0]["choices"][0] if stream else json.loads(raw)["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id, name


def test_min_tokens_holds_a_stop_token_back(sides):
    base = body_of({"prompt": TEXT, "max_tokens": 3})
    for name, (ctx, _) in sides.items():
        _, ids = generated(ctx, COMPLETIONS, base)
        status, _, raw = post(ctx, COMPLETIONS, dict(base, stop_token_ids=[ids[0]], min_tokens=1))
        choice = json.loads(raw)["choices"][0]
        assert status == 200 and choice["finish_reason"] == "length", (name, choice)


# -- errors --------------------------------------------------------------------------------------
VALIDATION, ERROR_RESPONSE = "validation", "error_response"
ERRORS = {
    "unknown_field": (COMPLETIONS, {"model": "m", "prompt": "x", "bogus": 1}, VALIDATION),
    "missing_model": (COMPLETIONS, {"prompt": "x"}, VALIDATION),
    "missing_prompt": (COMPLETIONS, {"model": "m"}, VALIDATION),
    "wrong_type": (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": "many"}, VALIDATION),
    "not_json": (COMPLETIONS, b"{not json", VALIDATION),
    "empty_body": (COMPLETIONS, b"", VALIDATION),
    "stream_options_without_stream": (COMPLETIONS, {"model": "m", "prompt": "x", "stream_options": {
        "include_usage": True}}, VALIDATION),
    "unknown_stream_option": (COMPLETIONS, {"model": "m", "prompt": "x", "stream": True, "stream_options": {
        "bogus": True}}, VALIDATION),
    "suffix": (COMPLETIONS, {"model": "m", "prompt": "x", "suffix": "tail"}, VALIDATION),
    "logprobs_over_20": (COMPLETIONS, {"model": "m", "prompt": "x", "logprobs": 21}, VALIDATION),
    "truncate_below_1": (COMPLETIONS, {"model": "m", "prompt": "x", "truncate_prompt_tokens": 0}, VALIDATION),
    "priority_above_1": (COMPLETIONS, {"model": "m", "prompt": "x", "priority": 2}, VALIDATION),
    "unknown_disagg_field": (COMPLETIONS, {"model": "m", "prompt": "x", "disaggregated_params": {
        "request_type": "context_only", "bogus": 1}}, VALIDATION),
    "disagg_without_request_type": (COMPLETIONS, {"model": "m", "prompt": "x", "disaggregated_params": {}},
                                    VALIDATION),
    "disagg_endpoint_as_list": (COMPLETIONS, {"model": "m", "prompt": "x", "disaggregated_params": {
        "request_type": "context_only", "ctx_info_endpoint": ["h:1"]}}, VALIDATION),
    "bad_request_type": (COMPLETIONS, {"model": "m", "prompt": "x", "disaggregated_params": {
        "request_type": "prefill"}}, ERROR_RESPONSE),
    "negative_max_tokens": (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": -1}, ERROR_RESPONSE),
    "negative_temperature": (COMPLETIONS, {"model": "m", "prompt": "x", "temperature": -1}, ERROR_RESPONSE),
    "top_p_above_1": (COMPLETIONS, {"model": "m", "prompt": "x", "top_p": 1.5}, ERROR_RESPONSE),
    "beam_search": (COMPLETIONS, {"model": "m", "prompt": "x", "use_beam_search": True}, ERROR_RESPONSE),
    "empty_token_prompt": (COMPLETIONS, {"model": "m", "prompt": []}, ERROR_RESPONSE),
    "token_out_of_vocabulary": (COMPLETIONS, {"model": "m", "prompt": [1, 200000]}, ERROR_RESPONSE),
    "prompt_fills_max_seq_len": (COMPLETIONS, {"model": "m", "prompt": [7] * MAX_SEQ_LEN, "max_tokens": 4},
                                 ERROR_RESPONSE),
    "generation_only_without_first_gen_tokens": (COMPLETIONS, {"model": "m", "prompt": [1, 2, 3],
        "disaggregated_params": {"request_type": "generation_only", "ctx_request_id": 5}}, ERROR_RESPONSE),
    "chat_messages_not_a_list": (CHAT, {"model": "m", "messages": "hi"}, VALIDATION),
    "chat_message_without_role": (CHAT, {"model": "m", "messages": [{"content": "hi"}]}, VALIDATION),
    "chat_top_logprobs_without_logprobs": (CHAT, {"model": "m", "messages": MESSAGES, "top_logprobs": 2}, VALIDATION),
    "chat_tool_choice_without_tools": (CHAT, {"model": "m", "messages": MESSAGES, "tool_choice": "required"},
                                       VALIDATION),
    "chat_empty_cache_salt": (CHAT, {"model": "m", "messages": MESSAGES, "cache_salt": " "}, VALIDATION),
    "chat_both_max_tokens": (CHAT, {"model": "m", "messages": MESSAGES, "max_tokens": 2, "max_completion_tokens": 3},
                             VALIDATION),
    "chat_empty_messages": (CHAT, {"model": "m", "messages": []}, ERROR_RESPONSE),
    "chat_template_per_request": (CHAT, {"model": "m", "messages": MESSAGES, "chat_template": "{{ x }}"},
                                  ERROR_RESPONSE),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_a_bad_request_gets_the_workers_status_and_error_body(sides, name):
    path, body, kind = ERRORS[name]
    for side, (status, headers, raw) in both(sides, path, body).items():
        assert status == 400, (side, raw)
        assert headers["content-type"] == "application/json", side
        err = json.loads(raw)
        if kind == VALIDATION:
            assert shape(err) == {"error": "str"}, (side, err)
        else:
            assert shape(err) == {"object": "str", "message": "str", "type": "str", "param": "null", "code": "int"}, (
                side,
                err,
            )
            assert err["object"] == "error" and err["code"] == 400 and err["type"] == "BadRequestError", (side, err)


TYPE_ERRORS = {
    "float_from_text": (COMPLETIONS, {"model": "m", "prompt": "x", "temperature": "hot"}),
    "float_from_list": (COMPLETIONS, {"model": "m", "prompt": "x", "temperature": [1]}),
    "int_from_text": (COMPLETIONS, {"model": "m", "prompt": "x", "top_k": "a"}),
    "int_from_fraction": (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 1.5}),
    "bool_from_text": (COMPLETIONS, {"model": "m", "prompt": "x", "echo": "maybe"}),
    "bool_from_list": (COMPLETIONS, {"model": "m", "prompt": "x", "ignore_eos": []}),
    "str_from_int": (COMPLETIONS, {"model": "m", "prompt": "x", "user": 5}),
    "list_from_text": (COMPLETIONS, {"model": "m", "prompt": "x", "stop_token_ids": "x"}),
    "dict_from_int": (COMPLETIONS, {"model": "m", "prompt": "x", "logit_bias": 5}),
    "model_from_int": (COMPLETIONS, {"model": "m", "prompt": "x", "stream": True, "stream_options": 5}),
    "missing_model": (COMPLETIONS, {"prompt": "x", "max_tokens": 2}),
    "chat_messages_from_text": (CHAT, {"model": "m", "messages": "x"}),
    "chat_tools_from_text": (CHAT, {"model": "m", "messages": MESSAGES, "tools": "x"}),
    "chat_missing_model": (CHAT, {"messages": MESSAGES}),
    "unknown_fields": (COMPLETIONS, {"model": "m", "prompt": "x", "bogus": 1, "other": [2]}),
    "unknown_stream_option": (COMPLETIONS, {"model": "m", "prompt": "x", "stream": True, "stream_options": {
        "include_usage": True, "bogus": 1}}),
    "chat_unknown_field": (CHAT, {"model": "m", "messages": MESSAGES, "bogus": [1]}),
    "stop_as_int": (COMPLETIONS, {"model": "m", "prompt": "x", "stop": 5}),
    "stop_as_object": (COMPLETIONS, {"model": "m", "prompt": "x", "stop": {}}),
    "stop_with_ints": (COMPLETIONS, {"model": "m", "prompt": "x", "stop": ["a", 1, 2]}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(TYPE_ERRORS))
def test_a_type_error_is_worded_as_the_worker_words_it(sides, name):
    """pydantic's error list, which the worker sends as `{"error": str(exc)}` (the simulator
    decodes with msgspec and rewords: executors/sim/pydantic_errors.py)."""
    path, body = TYPE_ERRORS[name]
    answers = {side: (status, json.loads(raw)) for side, (status, _, raw) in both(sides, path, body).items()}
    assert answers["sim"] == answers["worker"]
    assert answers["sim"][0] == 400


def test_max_tokens_beyond_max_seq_len_is_clamped_as_the_pytorch_backend_does(sides):
    body = body_of({"prompt": [7] * (MAX_SEQ_LEN - 3), "max_tokens": 50})
    answers = both(sides, COMPLETIONS, body)
    status, _, raw = answers["sim"]
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["usage"]["completion_tokens"] == 3 and answer["choices"][0]["finish_reason"] == "length"
    assert answers["worker"][0] == 400, STAND_IN["max_tokens_over_max_seq_len"]


def test_a_stream_that_fails_after_it_started_ends_with_the_workers_error_event(sides):
    """A completion stream whose generation fails: 200, then the error event and [DONE]. The worker
    copy's fake engine fails a request over max_seq_len only once it runs; the simulator fails a
    generation leg whose context request never arrives (after its KV-transfer timeout)."""
    worker = post(sides["worker"][0], COMPLETIONS, body_of({"prompt": [7] * (MAX_SEQ_LEN - 3), "max_tokens": 50,
                                                           "stream": True}))  # fmt: skip
    params = {
        "request_type": "generation_only",
        "ctx_request_id": 999_999,
        "first_gen_tokens": [9],
        "ctx_info_endpoint": sides["sim"][0],
    }
    sim = post(sides["sim"][1], COMPLETIONS, body_of({"prompt": [1, 2, 3], "max_tokens": 4, "stream": True,
                                                     "disaggregated_params": params}))  # fmt: skip
    s_raw, w_raw = compare_stream({"sim": sim, "worker": worker}, False)
    for raw in (s_raw, w_raw):
        assert sse_pattern(raw, False)[0] == ["error", "done"]
        error = json.loads(sse_frames(raw)[0][1])["error"]  # the worker copy repeats [DONE] after it
        assert (error["type"], error["code"], error["param"]) == ("server_error", None, None)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_msgpack_body_is_read_as_the_worker_reads_it(sides, path):
    """TRTLLM_SERVE_ENABLE_MSGSPEC=1: a body flagged `X-TRTLLM-Msgpack: 1` is msgpack (what the
    orchestrator sends), validated like JSON; one that does not decode is FastAPI's 400."""
    import msgspec

    body = body_of({"messages": MESSAGES} if path == CHAT else {"prompt": TEXT}) | {"max_tokens": 3}
    flag = {"x-trtllm-msgpack": "1"}
    answers = {side: post(eps[0], path, msgspec.msgpack.encode(body), flag) for side, eps in sides.items()}
    compare_json(answers)
    bad = {side: post(eps[0], path, msgspec.msgpack.encode(dict(body, bogus=1)), flag) for side, eps in sides.items()}
    assert {side: (a[0], shape(json.loads(a[2]))) for side, a in bad.items()} == {
        side: (400, {"error": "str"}) for side in sides
    }
    broken = {side: post(eps[0], path, b"\xc1 not msgpack", flag) for side, eps in sides.items()}
    assert {side: (a[0], json.loads(a[2])) for side, a in broken.items()} == {
        side: (400, {"detail": "There was an error parsing the body"}) for side in sides
    }


def test_unknown_paths_and_methods_get_starlettes_bodies(sides):
    for side, (ctx, _) in sides.items():
        status, headers, raw = call(ctx, "GET", "/nope")
        assert (status, json.loads(raw)) == (404, {"detail": "Not Found"}), side
        status, headers, raw = call(ctx, "GET", COMPLETIONS)
        assert (status, json.loads(raw)) == (405, {"detail": "Method Not Allowed"}), side


# -- disaggregated legs --------------------------------------------------------------------------
def context_leg(endpoint: str, path: str, body: dict[str, Any], **params: Any) -> tuple[int, dict[str, str], bytes]:
    leg = dict(body, disaggregated_params={"request_type": "context_only", "disagg_request_id": next(_ids), **params})
    return post(endpoint, path, leg)


def generation_body(body: dict[str, Any], ctx: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The generation leg as the orchestrator builds it (flows.py generation_request)."""
    params = dict(ctx["choices"][0]["disaggregated_params"], request_type="generation_only", ctx_usage=ctx["usage"])
    gen = dict(body, disaggregated_params=params)
    if chat:
        if ctx.get("prompt_token_ids_b64"):
            gen["prompt_token_ids_b64"] = ctx["prompt_token_ids_b64"]
        else:
            gen["prompt_token_ids"] = ctx["prompt_token_ids"]
    else:
        gen["prompt"] = ctx["prompt_token_ids"]
    return gen


LEGS = {
    "completion": (COMPLETIONS, {"prompt": TEXT, "max_tokens": 5}, {}),
    "completion_b64_is_chat_only": (
        COMPLETIONS, {"prompt": TEXT, "max_tokens": 4}, {"return_prompt_token_ids_b64": True}),
    "chat": (CHAT, {"messages": MESSAGES, "max_tokens": 5}, {}),
    "chat_b64": (CHAT, {"messages": MESSAGES, "max_tokens": 4}, {"return_prompt_token_ids_b64": True}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(LEGS))
def test_context_and_generation_legs_have_the_workers_shape(sides, name):
    path, case, params = LEGS[name]
    chat = path == CHAT
    body = body_of(case)
    for stream in (False, True):  # a new context leg each time: its KV is pulled once
        ctx_answers = {side: context_leg(eps[0], path, body, **params) for side, eps in sides.items()}
        ours, theirs = compare_json(ctx_answers)
        for answer in (ours, theirs):
            [choice] = answer["choices"]
            p = choice["disaggregated_params"]
            assert choice["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 1
            assert p["request_type"] == "context_only" and p["ctx_request_id"] == p["disagg_request_id"]
            assert len(p["first_gen_tokens"]) == 1 and isinstance(p["encoded_opaque_state"], str)
            if params.get("return_prompt_token_ids_b64") and chat:
                assert answer["prompt_token_ids"] is None and isinstance(answer["prompt_token_ids_b64"], str)
            else:
                assert answer["prompt_token_ids"] and all(isinstance(t, int) for t in answer["prompt_token_ids"])
        ctx_json = {"sim": ours, "worker": theirs}
        gen_body = {side: generation_body(dict(body, stream=stream, **({"stream_options": {"include_usage": True}}
                                                                       if stream else {})), ctx_json[side], chat)
                    for side in sides}  # fmt: skip
        answers = {side: post(sides[side][1], path, gen_body[side]) for side in sides}
        if stream:
            s_raw, w_raw = compare_stream(answers, chat)
            for side, raw in (("sim", s_raw), ("worker", w_raw)):
                [usage] = chunks_of(raw, chat, "usage")
                assert usage["usage"]["prompt_tokens"] == ctx_json[side]["usage"]["prompt_tokens"], side
            continue
        g_ours, g_theirs = compare_json(answers)
        for side, answer in (("sim", g_ours), ("worker", g_theirs)):
            [choice] = answer["choices"]
            echoed = choice["disaggregated_params"]
            assert echoed["request_type"] == "generation_only" and echoed["ctx_usage"] == ctx_json[side]["usage"], side
            assert answer["usage"]["prompt_tokens"] == ctx_json[side]["usage"]["prompt_tokens"], side
            assert answer["usage"]["prompt_tokens_details"] == ctx_json[side]["usage"]["prompt_tokens_details"], side
            assert answer["usage"]["completion_tokens"] == body["max_tokens"], side
            assert choice["finish_reason"] == "length" and answer["prompt_token_ids"] is None, side


def test_a_streamed_context_leg_streams_without_disaggregated_params(sides):
    body = body_of({"prompt": TEXT, "max_tokens": 5, "stream": True})
    s_raw, w_raw = compare_stream({side: context_leg(eps[0], COMPLETIONS, body) for side, eps in sides.items()}, False)
    for raw in (s_raw, w_raw):
        assert sse_pattern(raw, False)[0] == ["finish", "done"]


# -- control endpoints ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path", ["/server_info", "/v1/models", "/version", "/metrics", "/perf_metrics", "/steady_clock_offset"]
)
def test_a_control_endpoint_answers_with_the_workers_shape(sides, path):
    answers = {side: call(eps[0], "GET", path) for side, eps in sides.items()}
    ours, theirs = compare_json(answers)
    if path == "/server_info":
        assert set(ours) == {"disaggregated_params", "max_batch_size", "kv_cache_hash_algo", "tokens_per_block"}
        assert ours["kv_cache_hash_algo"] == theirs["kv_cache_hash_algo"] == "v1_block_key"
    if path in ("/metrics", "/perf_metrics"):
        assert ours == theirs == []  # no iteration stats; no return_perf_metrics in either


def test_health_and_the_clock_offset_post(sides):
    for side, (ctx, _) in sides.items():
        assert call(ctx, "GET", "/health")[::2] == (200, b""), side
        assert call(ctx, "POST", "/steady_clock_offset", {"offset": 0.0})[::2] == (200, b""), side
        status, _, raw = call(ctx, "POST", "/steady_clock_offset", {"offset": "soon"})
        assert status == 400 and shape(json.loads(raw)) == {"error": "str"}, side


# -- KV cache events (the simulator's kv_events.py / block_keys.py) -------------------------------


@pytest.fixture(scope="module")
def kv_events(sides) -> dict[str, list[dict[str, Any]]]:
    """Every side's events after the same new prompt on its generation server (fresh: has `created`)."""
    out = {}
    for side, (_, gen) in sides.items():
        assert post(gen, COMPLETIONS, body_of({"prompt": list(range(1, 80)), "max_tokens": 2}))[0] == 200
        status, _, raw = call(gen, "POST", "/kv_cache_events")
        assert status == 200
        out[side] = json.loads(raw)
    return out


def _first(events: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(e for e in events if e["data"]["type"] == kind)


def test_kv_events_are_numbered_with_a_window_size(kv_events):
    for events in kv_events.values():
        assert events and all(isinstance(e["event_id"], int) and isinstance(e["window_size"], int) for e in events)
        assert [e["event_id"] for e in events] == sorted(e["event_id"] for e in events)


def test_the_created_event_has_the_workers_data(kv_events):
    assert_same_shape(
        shape(_first(kv_events["sim"], "created")["data"]), shape(_first(kv_events["worker"], "created")["data"])
    )


def test_a_kv_event_has_the_workers_envelope(kv_events):
    assert list(_first(kv_events["sim"], "stored")) == list(_first(kv_events["worker"], "stored"))


def test_a_stored_event_has_the_workers_data(kv_events):
    assert_same_shape(
        shape(_first(kv_events["sim"], "stored")["data"]), shape(_first(kv_events["worker"], "stored")["data"])
    )
