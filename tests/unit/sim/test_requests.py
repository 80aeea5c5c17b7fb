from __future__ import annotations

import json

import pytest

from shmdisagg.executors.sim.errors import RequestError
from shmdisagg.executors.sim.requests import Limits, encode_b64_ids, parse_request
from shmdisagg.executors.sim.sequence import Kind
from shmdisagg.executors.sim.tokenizer import BOS_ID, Tokenizer

TOK = Tokenizer()
LIMITS = Limits(vocab_size=128256, max_seq_len=4096)


def parse(body: dict, chat: bool = False, limits: Limits = LIMITS):
    return parse_request(json.dumps(body).encode(), chat, TOK, limits)


def bad(body: dict, match: str, chat: bool = False, limits: Limits = LIMITS) -> RequestError:
    with pytest.raises(RequestError, match=match) as info:
        parse(body, chat, limits)
    assert info.value.status == 400
    return info.value


def test_a_text_prompt_is_tokenized_with_bos_and_token_prompts_are_used_as_given():
    req = parse({"model": "m", "prompt": "hello there"})
    assert req.prompt == [BOS_ID, *TOK.encode("hello there")]
    assert req.max_tokens == 32 and req.kind is Kind.LOCAL and not req.stream
    assert parse({"prompt": [5, 6, 7], "max_tokens": 3}).prompt == [5, 6, 7]
    assert parse({"prompt": [[5, 6, 7]]}).prompt == [5, 6, 7]  # a one-element batch is unwrapped
    assert parse({"prompt": "x", "add_special_tokens": False}).prompt == TOK.encode("x")


def test_chat_renders_messages_or_takes_prompt_token_ids():
    req = parse({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}, chat=True)
    assert req.prompt[0] == BOS_ID and req.max_tokens == 4
    assert parse({"messages": [], "prompt_token_ids": [9, 8]}, chat=True).prompt == [9, 8]
    b64 = encode_b64_ids([1, 2, 300000 % 128256])
    assert parse({"messages": [], "prompt_token_ids_b64": b64}, chat=True).prompt == [1, 2, 300000 % 128256]
    assert parse({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}, chat=True).max_tokens == 2


def test_stream_options_include_usage_defaults_to_true_as_in_tensorrt_llm():
    req = parse({"prompt": "x", "stream": True, "stream_options": {}})
    assert req.stream and req.include_usage and not req.continuous_usage
    req = parse({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert req.continuous_usage


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"prompt": ["a", "b"]}, "single prompt"),
        ({"prompt": [[1], [2]]}, "single prompt"),
        ({"prompt": ""}, "must not be empty"),
        ({"prompt": []}, "must not be empty"),
        ({"max_tokens": 3}, "prompt is required"),
        ({"prompt": 5}, "string or a list"),
        ({"prompt": "x", "n": 2}, "n must be 1"),
        ({"prompt": "x", "best_of": 3}, "best_of must be 1"),
        ({"prompt": "x", "max_tokens": 0}, "positive integer"),
        ({"prompt": "x", "max_tokens": "5"}, "positive integer"),
        ({"prompt": "x", "max_tokens": 5000}, "exceeds max_seq_len"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "only be defined when stream"),
        ({"prompt": "x", "stream": "yes"}, "stream must be true or false"),
        ({"prompt": [1, -2]}, r"within \[0, 128256\)"),
        ({"prompt": [1, 128256]}, r"within \[0, 128256\)"),
        ({"prompt": "x", "stop_token_ids": "a"}, "stop_token_ids"),
        ({"prompt": "x", "suffix": "tail"}, "suffix"),
        ({"prompt": "x", "use_beam_search": True}, "beam search"),
    ],
)
def test_bad_completion_requests_are_refused_with_400(body, match):
    bad(body, match)


def test_bad_chat_requests_are_refused_with_400():
    bad({"messages": "hi"}, "messages must be a list", chat=True)
    bad({"messages": []}, "must not be empty", chat=True)
    bad({"messages": [{"content": "x"}]}, "role", chat=True)
    bad({"messages": [], "prompt_token_ids_b64": "!!"}, "base64", chat=True)


def test_not_json_is_refused():
    with pytest.raises(RequestError, match="not valid JSON"):
        parse_request(b"{nope", False, TOK, LIMITS)
    with pytest.raises(RequestError, match="JSON object"):
        parse_request(b"[1]", False, TOK, LIMITS)


def test_context_only_is_never_streamed_and_keeps_its_disagg_request_id():
    req = parse(
        {"prompt": "x", "stream": True, "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 7}}
    )
    assert req.kind is Kind.CONTEXT_ONLY and not req.stream and req.disagg_request_id == 7


def test_generation_only_reads_its_handoff_fields():
    params = {
        "request_type": "generation_only",
        "ctx_request_id": 42,
        "first_gen_tokens": [11],
        "ctx_info_endpoint": "http://127.0.0.1:9000/",
        "ctx_usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 1}},
        "encoded_opaque_state": None,
        "draft_tokens": None,
        "ctx_dp_rank": 0,
        "schedule_style": "context_first",
    }
    req = parse({"prompt": [1, 2, 3], "disaggregated_params": params})
    assert req.kind is Kind.GENERATION_ONLY and req.ctx_request_id == 42 and req.first_gen_tokens == [11]
    assert req.ctx_endpoint == "127.0.0.1:9000" and req.ctx_usage["prompt_tokens"] == 3


def test_generation_first_requests_may_omit_first_gen_tokens_and_use_the_opaque_state():
    import base64

    state = base64.b64encode(json.dumps({"ctx_info_endpoint": "127.0.0.1:9100"}).encode()).decode()
    params = {"request_type": "generation_only", "ctx_request_id": 1, "encoded_opaque_state": state}
    req = parse({"prompt": [1, 2], "disaggregated_params": params})
    assert req.first_gen_tokens == [] and req.ctx_endpoint == "127.0.0.1:9100"


@pytest.mark.parametrize(
    ("params", "limits", "match"),
    [
        ("x", LIMITS, "must be an object"),
        ({"request_type": "prefill"}, LIMITS, "request_type"),
        ({"request_type": "context_only", "bogus": 1}, LIMITS, "unknown disaggregated_params field"),
        ({"request_type": "context_only", "disagg_request_id": "7"}, LIMITS, "must be an integer"),
        ({"request_type": "generation_only", "first_gen_tokens": [1], "ctx_info_endpoint": "h:1"}, LIMITS,
         "ctx_request_id"),
        ({"request_type": "generation_only", "ctx_request_id": 1, "first_gen_tokens": [1]}, LIMITS,
         "ctx_info_endpoint"),
        ({"request_type": "generation_only", "ctx_request_id": 1, "first_gen_tokens": "a", "ctx_info_endpoint": "h:1"},
         LIMITS, "first_gen_tokens"),
        ({"request_type": "context_only"}, Limits(128256, 4096, role="generation"), "generation role"),
        ({"request_type": "generation_only", "ctx_request_id": 1, "ctx_info_endpoint": "h:1"},
         Limits(128256, 4096, role="context"), "context role"),
        ({"request_type": "context_only"}, Limits(128256, 4096, disagg_enabled=False), "cache_transceiver_config"),
    ],
)
def test_bad_disaggregated_params_are_refused_with_400(params, limits, match):
    bad({"prompt": [1, 2, 3], "max_tokens": 4, "disaggregated_params": params}, match, limits=limits)
