"""Request validation as trtllm-serve's protocol models and argument checks do it (requests.py)."""

from __future__ import annotations

import base64
import json

import pytest

from shmdisagg.executors.sim.errors import RequestError, ValidationFailed, error_body
from shmdisagg.executors.sim.requests import DEFAULT_MAX_TOKENS, Limits, encode_b64_ids, parse_request
from shmdisagg.executors.sim.sequence import Kind
from shmdisagg.executors.sim.tokenizer import BOS_ID, Tokenizer

TOK = Tokenizer()
LIMITS = Limits(vocab_size=128256, max_seq_len=4096)
MESSAGES = [{"role": "user", "content": "hi"}]


def parse(body: dict, chat: bool = False, limits: Limits = LIMITS):
    return parse_request(json.dumps({"model": "m", **body}).encode(), chat, TOK, limits)


def refused(body: dict | bytes, match: str, chat: bool = False, limits: Limits = LIMITS) -> RequestError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(RequestError, match=match or None) as info:
        parse_request(raw, chat, TOK, limits)
    assert info.value.status == 400
    return info.value


def test_a_text_prompt_gets_bos_and_token_prompts_are_used_as_given():
    req = parse({"prompt": "hello there"})
    assert req.prompt == [BOS_ID, *TOK.encode("hello there")] and req.model == "m"
    assert req.max_tokens == DEFAULT_MAX_TOKENS and req.kind is Kind.LOCAL and not req.stream
    assert parse({"prompt": [5, 6, 7], "max_tokens": 3}).prompt == [5, 6, 7]
    assert parse({"prompt": [[5, 6, 7]]}).prompt == [5, 6, 7]  # a one-prompt batch answers as one prompt
    assert parse({"prompt": ["x"]}).prompt == [BOS_ID, *TOK.encode("x")]
    assert parse({"prompt": "x", "add_special_tokens": False}).prompt == TOK.encode("x")
    assert parse({"prompt": ""}).prompt == [BOS_ID]  # as the tokenizer of TensorRT-LLM encodes it
    assert parse({"prompt": "a b c d", "truncate_prompt_tokens": 2}).prompt == TOK.encode(" c d")


def test_max_tokens_is_clamped_to_the_room_left_in_max_seq_len_as_the_pytorch_backend_does():
    assert parse({"prompt": [1] * 4090, "max_tokens": 100}).max_tokens == 6
    assert parse({"prompt": [1] * 4090}).max_tokens == 6  # the default too
    assert parse({"prompt": [1, 2], "max_tokens": "7"}).max_tokens == 7  # pydantic's lax int


def test_chat_renders_messages_or_takes_prompt_token_ids():
    req = parse({"messages": MESSAGES, "max_completion_tokens": 4}, chat=True)
    assert req.prompt[0] == BOS_ID and req.max_tokens == 4 and req.role == "assistant"
    assert parse({"messages": MESSAGES, "max_tokens": 2}, chat=True).max_tokens == 2
    assert parse({"messages": [], "prompt_token_ids": [9, 8]}, chat=True).prompt == [9, 8]
    b64 = encode_b64_ids([1, 2, 300000 % 128256])
    assert parse({"messages": [], "prompt_token_ids_b64": b64}, chat=True).prompt == [1, 2, 300000 % 128256]
    req = parse({"messages": MESSAGES, "add_generation_prompt": False}, chat=True)
    assert req.role == "user"  # the answer continues the last message
    req = parse({"messages": [*MESSAGES, {"role": "assistant", "content": "Sure,"}], "echo": True}, chat=True)
    assert req.echo_text == "Sure,"
    assert parse({"messages": MESSAGES, "echo": True}, chat=True).echo_text is None  # a user message is not echoed


def test_stream_options_include_usage_defaults_to_true_as_in_tensorrt_llm():
    req = parse({"prompt": "x", "stream": True, "stream_options": {}})
    assert req.stream and req.include_usage and not req.continuous_usage
    req = parse({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert req.continuous_usage


def test_stop_words_are_stop_token_ids_then_tokenized_stop_strings_with_their_reasons():
    req = parse(
        {
            "prompt": "x",
            "stop_token_ids": [7, 8],
            "stop": [" the end", ""],
            "min_tokens": 2,
            "include_stop_str_in_output": True,
        }
    )
    assert req.stops == (((7,), 7), ((8,), 8), (tuple(TOK.encode(" the end")), " the end"))
    assert req.min_tokens == 2 and req.include_stop
    assert parse({"prompt": "x", "stop": " once"}).stops == ((tuple(TOK.encode(" once")), " once"),)
    assert parse({"prompt": "x"}).stops is None  # the engine's fast path


def test_logprobs_how_many_per_token():
    assert parse({"prompt": "x", "logprobs": 3}).logprobs == 3
    assert parse({"prompt": "x", "logprobs": 0}).logprobs == 0
    req = parse({"messages": MESSAGES, "logprobs": True}, chat=True)
    assert (req.logprobs, req.top_logprobs) == (1, False)
    req = parse({"messages": MESSAGES, "logprobs": True, "top_logprobs": 4}, chat=True)
    assert (req.logprobs, req.top_logprobs) == (4, True)


@pytest.mark.parametrize(
    ("body", "chat", "match"),
    [
        ({"prompt": "x"}, False, "model"),
        ({"model": "m"}, False, "prompt"),
        ({"model": "m", "prompt": "x", "bogus": 1}, False, "'bogus'.*Extra inputs are not permitted"),
        ({"model": "m", "prompt": "x", "max_tokens": "many"}, False, "max_tokens"),
        ({"model": "m", "prompt": 5}, False, "prompt"),
        ({"model": "m", "prompt": ["a", 1]}, False, "prompt"),
        ({"model": "m", "prompt": "x", "stream": "maybe"}, False, "stream"),
        (
            {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
            False,
            "only be defined when stream",
        ),
        (
            {"model": "m", "prompt": "x", "stream": True, "stream_options": {"x": 1}},
            False,
            "'stream_options', 'x'.*Extra inputs",
        ),
        ({"model": "m", "prompt": "x", "suffix": "tail"}, False, "suffix"),
        ({"model": "m", "prompt": "x", "logprobs": 21}, False, "<= 20"),
        ({"model": "m", "prompt": "x", "priority": 1.5}, False, "priority"),
        ({"model": "m", "prompt": "x", "truncate_prompt_tokens": 0}, False, "truncate_prompt_tokens"),
        ({"model": "m", "prompt": "x", "response_format": {"type": "yaml"}}, False, "response_format"),
        (
            {"model": "m", "prompt": "x", "disaggregated_params": {"request_type": "context_only", "bogus": 1}},
            False,
            "'disaggregated_params', 'bogus'.*Extra inputs",
        ),
        ({"model": "m", "prompt": "x", "disaggregated_params": {}}, False, "request_type"),
        (
            {
                "model": "m",
                "prompt": "x",
                "disaggregated_params": {"request_type": "context_only", "ctx_info_endpoint": ["h:1"]},
            },
            False,
            "ctx_info_endpoint",
        ),
        (
            {
                "model": "m",
                "prompt": "x",
                "disaggregated_params": {"request_type": "generation_only", "schedule_style": 2},
            },
            False,
            "schedule_style",
        ),
        (
            {
                "model": "m",
                "prompt": "x",
                "disaggregated_params": {
                    "request_type": "generation_only",
                    "ctx_usage": {"prompt_tokens": 3, "bogus": 1},
                },
            },
            False,
            "unknown field `bogus`",
        ),
        ({"model": "m", "messages": "hi"}, True, "messages"),
        ({"model": "m", "messages": [{"content": "hi"}]}, True, "role"),
        ({"model": "m", "messages": MESSAGES, "top_logprobs": 2}, True, "logprobs must be true"),
        ({"model": "m", "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, True, "<= 20"),
        ({"model": "m", "messages": MESSAGES, "tool_choice": "required"}, True, "tools"),
        ({"model": "m", "messages": MESSAGES, "cache_salt": ""}, True, "cache_salt"),
        (
            {"model": "m", "messages": MESSAGES, "max_tokens": 2, "max_completion_tokens": 2},
            True,
            "max_completion_tokens",
        ),
        (
            {"model": "m", "messages": MESSAGES, "detokenize": False},
            True,
            "'detokenize'.*Extra inputs are not permitted",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x", "tools": []}]}, True, "system messages"),
    ],
)
def test_a_body_that_does_not_fit_the_protocol_models_fails_validation(body, chat, match):
    err = refused(body, match, chat)
    assert isinstance(err, ValidationFailed)
    assert set(error_body(err)) == {"error"}  # FastAPI's 400 body


def test_bad_json_and_a_non_object_body_fail_validation():
    for raw in (b"{nope", b"", b"[1]", b'"text"'):
        assert isinstance(refused(raw, ""), ValidationFailed)


@pytest.mark.parametrize(
    ("body", "chat", "match"),
    [
        ({"prompt": "x", "n": 2}, False, "n > 1"),
        ({"prompt": "x", "n": 0}, False, "n >= 1"),
        ({"prompt": "x", "best_of": 3}, False, "beam search"),
        ({"prompt": "x", "use_beam_search": True}, False, "beam search"),
        ({"prompt": "x", "max_tokens": 0}, False, r"`max_tokens` \(0\) must be greater than 0"),
        ({"prompt": "x", "max_tokens": -1}, False, "must be greater than 0"),
        ({"prompt": "x", "temperature": -1}, False, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, False, "top_p"),
        ({"prompt": "x", "top_k": -1}, False, "top_k"),
        ({"prompt": []}, False, "must not be empty"),
        ({"prompt": [[]]}, False, "must not be empty"),
        ({"prompt": ["a", "b"]}, False, "batches of prompts"),
        ({"prompt": [[1], [2]]}, False, "batches of prompts"),
        ({"prompt": [1, -2]}, False, r"Token ID -2 is out of vocabulary range \[0, 128256\)"),
        ({"prompt": [1, 128256]}, False, r"Token ID 128256 is out of vocabulary"),
        ({"prompt": [1] * 4096, "max_tokens": 1}, False, r"`default_max_tokens` \(0\) must be greater than 0"),
        ({"prompt": [1, 2], "echo": True}, False, "echo"),
        ({"prompt": "x", "lora_request": {"lora_name": "a"}}, False, "lora_request"),
        ({"prompt": "x", "return_context_logits": True}, False, "return_context_logits"),
        ({"prompt": "x", "logit_bias": {"nope": 1.0}}, False, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 500.0}}, False, "logit_bias"),
        ({"prompt": "x", "disaggregated_params": {"request_type": "prefill"}}, False, "Unknown request type: prefill"),
        ({"messages": []}, True, "messages must not be empty"),
        ({"messages": MESSAGES, "chat_template": "{{ x }}"}, True, "chat_template cannot be supplied"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            True,
            "only text content parts",
        ),
        (
            {
                "messages": MESSAGES,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            True,
            "tool_choice naming a function",
        ),
        ({"messages": [], "prompt_token_ids_b64": "!!"}, True, "base64"),
    ],
)
def test_a_request_the_executor_cannot_run_gets_an_error_response(body, chat, match):
    err = refused({"model": "m", **body}, match, chat)
    assert not isinstance(err, ValidationFailed)
    assert error_body(err) == {"object": "error", "message": err.message, "type": "BadRequestError", "param": None,
                               "code": 400}  # fmt: skip


def test_a_prompt_longer_than_max_num_tokens_is_refused_without_chunked_prefill():
    limits = Limits(128256, 4096, max_prompt_tokens=8)
    refused({"model": "m", "prompt": list(range(1, 10))}, r"prompt length \(9.0\), query length \(0\) should not "
            r"exceed max_num_tokens \(8\)", limits=limits)  # fmt: skip
    assert parse({"prompt": list(range(1, 9))}, limits=limits).prompt == list(range(1, 9))
    params = {
        "request_type": "generation_only",
        "ctx_request_id": 1,
        "first_gen_tokens": [5],
        "ctx_info_endpoint": "h:1",
    }
    assert (
        parse({"prompt": list(range(1, 10)), "disaggregated_params": params}, limits=limits).kind
        is Kind.GENERATION_ONLY
    )


def test_a_context_only_request_keeps_its_disagg_request_id_and_may_stream():
    req = parse(
        {
            "prompt": "x",
            "stream": True,
            "disaggregated_params": {"request_type": "CONTEXT_ONLY", "disagg_request_id": 7},
        }
    )
    assert req.kind is Kind.CONTEXT_ONLY and req.stream and req.disagg_request_id == 7 and req.auth_fields is None
    req = parse(
        {
            "messages": MESSAGES,
            "disaggregated_params": {"request_type": "context_only", "return_prompt_token_ids_b64": True},
        },
        chat=True,
    )
    assert req.return_prompt_b64
    req = parse(
        {"prompt": "x", "disaggregated_params": {"request_type": "context_only", "return_prompt_token_ids_b64": True}}
    )
    assert not req.return_prompt_b64  # completions answer with the id list (openai_server.py: chat only)


def test_generation_only_reads_its_handoff_fields_and_echoes_them_as_the_worker_does():
    params = {
        "request_type": "generation_only",
        "ctx_request_id": 42,
        "first_gen_tokens": [11],
        "ctx_info_endpoint": "http://127.0.0.1:9000/",
        "ctx_usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 1}},
        "encoded_opaque_state": None,
        "draft_tokens": None,
        "ctx_dp_rank": 0,
        "schedule_style": 0,
        "return_prompt_token_ids_b64": True,
    }
    req = parse({"prompt": [1, 2, 3], "disaggregated_params": params})
    assert req.kind is Kind.GENERATION_ONLY and req.ctx_request_id == 42 and req.first_gen_tokens == [11]
    assert req.ctx_endpoint == "127.0.0.1:9000"
    assert req.ctx_usage == {
        "prompt_tokens": 3,
        "total_tokens": 0,
        "completion_tokens": 0,
        "prompt_tokens_details": {"cached_tokens": 1},
    }  # UsageInfo's defaults filled in
    assert req.auth_fields == {"encoded_opaque_state": None, "ctx_info_endpoint": "http://127.0.0.1:9000/"}
    echo = req.disagg_echo
    assert list(echo) == [
        "request_type",
        "first_gen_tokens",
        "first_gen_log_probs",
        "first_gen_logits",
        "ctx_request_id",
        "encoded_opaque_state",
        "draft_tokens",
        "disagg_request_id",
        "ctx_dp_rank",
        "ctx_info_endpoint",
        "schedule_style",
        "ctx_usage",
        "return_prompt_token_ids_b64",
        "resolved_thinking",
    ]
    assert echo["ctx_usage"] == req.ctx_usage and echo["return_prompt_token_ids_b64"] is False


def test_generation_first_may_omit_first_gen_tokens_and_find_the_context_executor_in_the_opaque_state():
    state = base64.b64encode(json.dumps({"ctx_info_endpoint": "127.0.0.1:9100"}).encode()).decode()
    params = {
        "request_type": "generation_only",
        "ctx_request_id": 1,
        "encoded_opaque_state": state,
        "schedule_style": 1,
    }
    req = parse({"prompt": [1, 2], "disaggregated_params": params})
    assert req.first_gen_tokens == [] and req.ctx_endpoint == "127.0.0.1:9100"


@pytest.mark.parametrize(
    ("params", "limits", "match"),
    [
        ({"request_type": "generation_only", "first_gen_tokens": [1], "ctx_info_endpoint": "h:1"}, LIMITS,
         "ctx_request_id"),
        ({"request_type": "generation_only", "ctx_request_id": 1, "ctx_info_endpoint": "h:1"}, LIMITS,
         "first_gen_tokens"),
        ({"request_type": "generation_only", "ctx_request_id": 1, "first_gen_tokens": [1]}, LIMITS,
         "ctx_info_endpoint"),
        ({"request_type": "generation_only", "ctx_request_id": 1, "first_gen_tokens": [1, 2, 3, 4, 5],
          "ctx_info_endpoint": "h:1"}, LIMITS, "longer than max_tokens"),
        ({"request_type": "context_only"}, Limits(128256, 4096, role="generation"), "generation role"),
        ({"request_type": "generation_only", "ctx_request_id": 1, "ctx_info_endpoint": "h:1"},
         Limits(128256, 4096, role="context"), "context role"),
        ({"request_type": "context_only"}, Limits(128256, 4096, disagg_enabled=False), "cache_transceiver_config"),
    ],
)  # fmt: skip
def test_disaggregated_params_the_executor_cannot_serve_are_refused(params, limits, match):
    refused({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "disaggregated_params": params}, match, limits=limits)


def test_a_msgpack_body_is_validated_as_json_is():
    import msgspec

    from shmdisagg.executors.sim.errors import UnreadableBody

    raw = msgspec.msgpack.encode({"model": "m", "prompt": [5, 6], "max_tokens": 2})
    assert parse_request(raw, False, TOK, LIMITS, msgpack=True).prompt == [5, 6]
    with pytest.raises(ValidationFailed, match="bogus"):
        parse_request(
            msgspec.msgpack.encode({"model": "m", "prompt": "x", "bogus": 1}), False, TOK, LIMITS, msgpack=True
        )
    with pytest.raises(UnreadableBody) as info:
        parse_request(b"\xc1", False, TOK, LIMITS, msgpack=True)
    assert error_body(info.value) == {"detail": "There was an error parsing the body"}
