"""answers.py: what of an executor's answer may reach a client, and the contract it must keep."""

from __future__ import annotations

import signal

import orjson
import pytest

from shmdisagg._native import SSE_DONE, SSE_FINISHED, SSE_INTERNAL, SSE_USAGE, sse_scan
from shmdisagg.orchestrator.answers import (
    INTERNAL_KEYS,
    ContractError,
    StreamGuard,
    check_context_answer,
    check_final_answer,
    executor_error_message,
    max_tokens_of,
    public_answer,
    redact,
)

HANDOFF = {
    "request_type": "generation_only",
    "encoded_opaque_state": "c2VjcmV0",
    "ctx_info_endpoint": "ucx://10.1.2.3:5000",
    "ctx_request_id": 9,
}


def _event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chunk(text: str, finish: str | None = None, **extra: object) -> bytes:
    return _event(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "choices": [{"index": 0, "text": text, "finish_reason": finish, **extra}],
        }
    )


def _relay(guard: StreamGuard, pieces: list[bytes]) -> bytes:
    return b"".join(guard.feed(p) for p in pieces) + guard.end()


def test_a_final_answer_keeps_the_plain_schema_with_the_handoff_nulled() -> None:
    answer = {
        "id": "cmpl-1",
        "choices": [
            {
                "index": 0,
                "text": "hi",
                "finish_reason": "length",
                "disaggregated_params": HANDOFF,
                "kv_transfer_params": {"remote_port": 5000},
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        "prompt_token_ids": [1, 2, 3],
        "prompt_token_ids_b64": "AQAAAA==",
        "ctx_request_id": 9,
    }
    out = public_answer(answer)
    assert out["choices"][0]["disaggregated_params"] is None and "kv_transfer_params" not in out["choices"][0]
    assert out["prompt_token_ids"] is None and out["prompt_token_ids_b64"] is None and "ctx_request_id" not in out
    assert out["choices"][0]["text"] == "hi" and out["usage"]["completion_tokens"] == 2
    assert b"10.1.2.3" not in orjson.dumps(out)


def test_streamed_chunks_lose_every_internal_key_and_keep_their_content() -> None:
    guard = StreamGuard(max_tokens=None)
    out = _relay(
        guard,
        [
            _chunk("a", disaggregated_params=HANDOFF),
            _chunk("b", "length", ctx_info_endpoint="x:1"),
            b"data: [DONE]\n\n",
        ],
    )
    events = [orjson.loads(line[6:]) for line in out.split(b"\n\n") if line.startswith(b"data: {")]
    assert [e["choices"][0]["text"] for e in events] == ["a", "b"]
    assert all(
        "disaggregated_params" not in e["choices"][0] and "ctx_info_endpoint" not in e["choices"][0] for e in events
    )
    assert out.endswith(b"data: [DONE]\n\n") and out.count(b"[DONE]") == 1


def test_a_clean_stream_is_relayed_byte_for_byte_whatever_its_chunking() -> None:
    stream = _chunk("a") + _chunk("b") + _chunk("c", "stop", stop_reason="!") + b"data: [DONE]\n\n"
    for size in (1, 7, 64, len(stream)):
        guard = StreamGuard(max_tokens=16)
        pieces = [stream[i : i + size] for i in range(0, len(stream), size)]
        assert _relay(guard, pieces) == stream


def test_an_event_with_an_internal_key_outside_a_data_line_is_dropped() -> None:
    guard = StreamGuard(max_tokens=None)
    leaky = b'{"choices":[{"finish_reason":"length","disaggregated_params":{"ctx_request_id":9}}]}\n\n'
    out = guard.feed(b": keep-alive\n\n" + leaky + _chunk("a", "length"))
    assert out == _chunk("a", "length")  # a client ignores lines with no field it knows
    assert guard.finished


@pytest.mark.parametrize(
    "event",
    [
        b'data: {"text":"a","ctx_info_endpoint":"ucx://10.1.2.3:5000",\n\n',  # cut short
        b'data: [{"ctx_info_endpoint":"ucx://10.1.2.3:5000"}]\n\n',  # JSON, not an object
    ],
)
def test_a_data_line_with_an_internal_key_that_is_no_json_object_is_a_contract_error(event: bytes) -> None:
    guard = StreamGuard(max_tokens=None)
    with pytest.raises(ContractError, match="not (JSON|a JSON object)"):
        guard.feed(event)


def test_done_after_an_event_that_is_rewritten_is_still_held_back() -> None:
    guard = StreamGuard(max_tokens=None)
    out = guard.feed(_chunk("a", "length", ctx_request_id=9) + b"data: [DONE]\n\n") + guard.end()
    assert b"ctx_request_id" not in out and out.count(b"[DONE]") == 1 and out.endswith(b"data: [DONE]\n\n")


def test_an_event_split_across_chunks_is_held_until_it_is_complete() -> None:
    guard = StreamGuard(max_tokens=None)
    first = _chunk("a")
    assert guard.feed(first[:10]) == b""
    assert guard.feed(first[10:]) == first


def test_a_stream_that_ends_without_a_finish_reason_is_a_contract_error() -> None:
    guard = StreamGuard(max_tokens=None)
    guard.feed(_chunk("a") + b"data: [DONE]\n\n")
    with pytest.raises(ContractError, match="without a finish_reason"):
        guard.end()


def test_a_completions_stream_with_null_finish_reasons_is_not_finished_until_a_string_one() -> None:
    guard = StreamGuard(max_tokens=None)
    guard.feed(_chunk("a", None))  # completions chunks carry "finish_reason":null (exclude_unset=False)
    assert not guard.finished
    guard.feed(_chunk("b", "length"))
    assert guard.finished


def test_a_streamed_usage_over_max_tokens_is_a_contract_error() -> None:
    guard = StreamGuard(max_tokens=4)
    guard.feed(_chunk("a", "length"))
    with pytest.raises(ContractError, match="5 completion tokens for max_tokens=4"):
        guard.feed(
            _event(
                {
                    "id": "cmpl-1",
                    "choices": [],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
                }
            )
        )


def test_an_executor_error_event_is_put_in_our_shape_without_its_address() -> None:
    guard = StreamGuard(max_tokens=None)
    error = _event(
        {
            "error": {
                "message": "KV transfer from 10.0.0.7:8001 failed",
                "type": "server_error",
                "code": None,
                "param": None,
            }
        }
    )
    out = _relay(guard, [_chunk("a"), error])
    payload = orjson.loads(out.split(b"\n\n")[1][6:])
    assert payload == {
        "error": {
            "object": "error",
            "message": "KV transfer from <executor> failed",
            "type": "BadGatewayError",
            "param": None,
            "code": 502,
        }
    }
    assert out.endswith(b"data: [DONE]\n\n") and out.count(b"[DONE]") == 1  # added once: the executor sent none


def test_context_answers_must_have_exactly_one_choice_with_the_handoff() -> None:
    one = {
        "choices": [{"finish_reason": "length", "disaggregated_params": {"ctx_request_id": 1, "disagg_request_id": 1}}]
    }
    assert check_context_answer(one) is one
    with pytest.raises(ContractError, match="2 choices"):
        check_context_answer({"choices": one["choices"] * 2})
    with pytest.raises(ContractError, match="missing disaggregated_params"):
        check_context_answer({"choices": [{"finish_reason": "length"}]})
    with pytest.raises(ContractError, match="lacks ctx_request_id"):
        check_context_answer({"choices": [{"finish_reason": "length", "disaggregated_params": {}}]})


def test_final_answers_are_checked_for_choices_finish_reason_and_token_budget() -> None:
    ok = {"choices": [{"finish_reason": "length"}], "usage": {"completion_tokens": 4}}
    check_final_answer(ok, 4)
    with pytest.raises(ContractError, match="5 completion tokens for max_tokens=4"):
        check_final_answer({**ok, "usage": {"completion_tokens": 5}}, 4)
    with pytest.raises(ContractError, match="2 choices"):
        check_final_answer({**ok, "choices": ok["choices"] * 2}, None)
    with pytest.raises(ContractError, match="no finish_reason"):
        check_final_answer({"choices": [{"finish_reason": None}]}, None)


def test_max_tokens_reads_the_field_the_worker_reads() -> None:
    assert max_tokens_of({"max_tokens": 8}) == 8
    assert max_tokens_of({"max_completion_tokens": 6}) == 6
    assert max_tokens_of({}) is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            b'{"object":"error","message":"bad prompt at '
            b'127.0.0.1:8001","type":"BadRequestError","param":null,"code":400}',
            "bad prompt at <executor>",
        ),
        (
            b"{\"error\":\"[{'type': 'extra_forbidden', 'loc': ('body', 'foo')}]\"}",
            "[{'type': 'extra_forbidden', 'loc': ('body', 'foo')}]",
        ),
        (b'{"detail":"Not Found"}', "Not Found"),
        (b'{"error":{"message":"from http://gen-3.internal:8002/v1/completions","type":"x"}}', "from <executor>"),
        (b"Internal Server Error", "executor answered HTTP 500"),
    ],
)
def test_executor_error_messages_are_unwrapped_and_redacted(body: bytes, message: str) -> None:
    assert executor_error_message(body, 500) == message


def test_addresses_in_python_reprs_are_redacted_too() -> None:
    # an executor's KV-transfer failure, as a simulator's generation leg reported it mid-stream
    message = (
        "KV pull from 127.0.0.1:23501 failed: ClientConnectorError(ConnectionKey(host='127.0.0.1', port=23502, "
        "is_ssl=False), ConnectionRefusedError(111, \"Connect call failed ('127.0.0.1', 23502)\"))"
    )
    out = redact(message)
    assert "127.0.0.1" not in out and "23502" not in out and "23501" not in out, out
    assert out.startswith("KV pull from <executor> failed: ClientConnectorError(")


def test_redact_leaves_ordinary_text_alone() -> None:
    assert redact("the ratio is 3:4 and the time 10:30") == "the ratio is 3:4 and the time 10:30"
    assert redact("see [::1]:8001 and fake-transceiver://h:1/ctx_info") == "see <executor> and <executor>"


@pytest.mark.parametrize("word", ["A", "a.", "a-", "9"])
def test_a_long_word_without_a_colon_is_redacted_in_one_pass(word: str) -> None:
    """The name pattern could split a run of name characters two ways and backtracked cubically
    on one with no colon after it: a worker echoing a 1,200-character value took 2.3 s, blocking
    the fleet worker's loop (at 2,000 it missed its heartbeat and was killed, its streams cut).
    At 20,000 characters that would be hours; an address after the word is still found."""
    long = word * (20_000 // len(word))

    def hung(signum: int, frame: object) -> None:  # a guard against the hang, not a speed check
        raise AssertionError("redact backtracked for 60 s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        out = redact(f"'input': '{long}' from ctx-0:8001 and {long}x.y:9000")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert out == f"'input': '{long}' from <executor> and <executor>"


def test_a_workers_error_quoting_a_long_input_keeps_its_errors_and_not_the_input() -> None:
    """FastAPI's validation error quotes the refused input, as long as the client sent it."""
    echo = repr(
        [
            {
                "type": "extra_forbidden",
                "loc": ("body", "extra"),
                "msg": "Extra inputs are not permitted",
                "input": "A" * 50_000,
            }
        ]
    )
    assert executor_error_message(orjson.dumps({"error": echo}), 400) == "body.extra: Extra inputs are not permitted"
    plain = "bad value at 10.0.0.7:8000 " + "word " * 5_000  # no validation errors to keep: its start
    out = executor_error_message(orjson.dumps({"message": plain}), 400)
    assert out.startswith("bad value at <executor> word ") and len(out) < 4200 and "characters cut)" in out


def test_a_workers_error_for_a_million_unknown_keys_is_summed_up_from_its_first_errors() -> None:
    """A 26 MB body with 1.5 million unknown keys: the worker names each one, and the summary of
    all of them was megabytes long and took seconds of the fleet worker's loop (two such requests
    got both workers killed for missed heartbeats)."""
    errors = [
        {"type": "extra_forbidden", "loc": ("body", f"k{i}"), "msg": "Extra inputs are not permitted"}
        for i in range(50_000)
    ]
    for body in (
        orjson.dumps({"error": repr(errors)}),
        orjson.dumps({"detail": [{**e, "loc": list(e["loc"])} for e in errors]}),
    ):
        out = executor_error_message(body, 400)
        assert out.startswith("body.k0: Extra inputs are not permitted; body.k1: ") and len(out) < 4200, out[-200:]
        assert "characters cut)" in out


@pytest.mark.parametrize("key", INTERNAL_KEYS)
def test_the_native_scan_flags_every_internal_key_with_a_value_and_none_that_is_null(key: str) -> None:
    with_value = _event({"choices": [{"index": 0, key: {"x": 1}}]})
    assert sse_scan(with_value) & SSE_INTERNAL
    assert not sse_scan(_event({"choices": [{"index": 0, key: None}]})) & SSE_INTERNAL
    assert (
        not sse_scan(_event({"choices": [{"index": 0, "text": f'"{key}": 1'}]})) & SSE_INTERNAL
    )  # in content: escaped


def test_the_native_scan_reports_where_the_complete_events_end_and_what_they_hold() -> None:
    done = b"data: [DONE]\n\n"
    first, usage = _chunk("a", "stop"), _event({"choices": [], "usage": {"completion_tokens": 3}})
    assert sse_scan(first + done) == (len(first + done) << 8) | SSE_FINISHED | SSE_DONE
    assert sse_scan(first + usage[:9]) == (len(first) << 8) | SSE_FINISHED  # the partial event is not scanned
    assert sse_scan(usage) & SSE_USAGE and sse_scan(first[:20]) == 0
    crlf = first.replace(b"\n\n", b"\r\n\r\n")
    assert sse_scan(crlf) >> 8 == len(crlf)


def test_a_crlf_framed_stream_with_internal_keys_is_rewritten_too() -> None:
    guard = StreamGuard(max_tokens=None)
    out = guard.feed(_chunk("a", "length", disaggregated_params=HANDOFF).replace(b"\n\n", b"\r\n\r\n")) + guard.end()
    assert b"disaggregated_params" not in out and b"encoded_opaque_state" not in out and b'"text":"a"' in out


@pytest.mark.parametrize(
    "body, expected",
    [
        (  # the worker's validation body for a model-level check: the whole leg as `input`
            {
                "error": "[{'type': 'value_error', 'loc': ('body',), 'msg': 'Value error, Stream options can only be "
                "defined when stream is true.', 'input': {'model': 'm', 'prompt': [1, 2], 'disaggregated_params': "
                "{'request_type': 'generation_only', 'encoded_opaque_state': 'c2VjcmV0', 'ctx_info_endpoint': "
                "'ucx://10.1.2.3:5000'}}, 'ctx': {'error': ValueError('Stream options can only be defined when stream "
                "is true.')}}]"
            },
            "body: Value error, Stream options can only be defined when stream is true.",
        ),
        (  # two errors, one message in double quotes (it holds a single quote)
            {
                "error": "[{'type': 'extra_forbidden', 'loc': ('body', 'bogus'), 'msg': \"Extra inputs aren't "
                "permitted\", 'input': 1}, {'type': 'missing', 'loc': ('body', 'model'), 'msg': 'Field required', "
                "'input': {'disaggregated_params': {'ctx_request_id': 9}}}]"
            },
            "body.bogus: Extra inputs aren't permitted; body.model: Field required",
        ),
        (  # FastAPI's own 422 detail
            {
                "detail": [
                    {"loc": ["body", "x"], "msg": "bad", "input": {"disaggregated_params": {"ctx_request_id": 9}}}
                ]
            },
            "body.x: bad",
        ),
        ({"message": 'leg {"ctx_info_endpoint": "x"} refused'}, "executor refused the request (HTTP 400)"),
        ({"message": "unknown ctx_request_id 5"}, "unknown ctx_request_id 5"),  # a name, no value: kept
    ],
)
def test_an_executor_error_that_echoes_the_leg_keeps_only_its_validation_errors(
    body: dict[str, object], expected: str
) -> None:
    message = executor_error_message(orjson.dumps(body), 400)
    assert message == expected
    assert "c2VjcmV0" not in message and "10.1.2.3" not in message


def test_an_executor_error_event_that_echoes_the_leg_keeps_only_its_message() -> None:
    guard = StreamGuard(max_tokens=None)
    leak = "'input': {'disaggregated_params': {'encoded_opaque_state': 'c2VjcmV0'}}"
    out = guard.feed(_event({"error": {"message": f"[{{'loc': ('body',), 'msg': 'Value error, bad', {leak}}}]"}}))
    assert orjson.loads(out[6:])["error"]["message"] == "body: Value error, bad" and guard.errored


@pytest.mark.parametrize("split", [None, 40])
def test_a_stream_gets_one_done_however_many_the_executor_sends(split: int | None) -> None:
    """The worker's completion generator, failing, yields an error event and [DONE], and its
    wrapper another [DONE]: one or two reached the client, by how the bytes were chunked."""
    error = _event({"error": {"message": "The sum of prompt length (8) and max_tokens (100) should not exceed"}})
    stream = error + b"data: [DONE]\n\n" + b"data: [DONE]\n\n"
    pieces = [stream] if split is None else [stream[:split], stream[split:]]
    out = _relay(StreamGuard(max_tokens=None), pieces)
    assert out.count(b"[DONE]") == 1 and out.endswith(b"data: [DONE]\n\n") and b"should not exceed" in out
