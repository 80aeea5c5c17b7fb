"""A non-streaming chat answer as the Anthropic message the client gets (upstream's
`convert_chat_response`, anthropic_adapter.py @a9239bda)."""

from __future__ import annotations

from typing import Any

import pytest

from shmdisagg.anthropic.convert import AnthropicResponseError, anthropic_message, stop_result, usage


def answer(message: dict[str, Any], finish: str | None = "stop", stop_reason: Any = None, **top: Any) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": {"role": "assistant", **message},
        "finish_reason": finish,
        "stop_reason": stop_reason,
    }
    return {
        "id": "chatcmpl-1",
        "model": "served-model",
        "choices": [choice],
        "usage": {"prompt_tokens": 10, "completion_tokens": 4},
        **top,
    }


def test_reasoning_text_and_tool_calls_become_blocks_in_that_order() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msg = anthropic_message(
        answer({"content": "checking", "reasoning_content": "think", "tool_calls": [call]}, finish="tool_calls")
    )
    assert (
        msg["id"].startswith("msg_")
        and msg["type"] == "message"
        and msg["role"] == "assistant"
        and msg["model"] == "served-model"
    )
    assert msg["content"] == [
        {"type": "thinking", "thinking": "think"},
        {"type": "text", "text": "checking"},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert msg["stop_reason"] == "tool_use" and "stop_sequence" not in msg
    assert msg["usage"] == {"input_tokens": 10, "output_tokens": 4}


@pytest.mark.parametrize(
    ("finish", "stop_reason", "expected"),
    [
        ("stop", None, ("end_turn", None)),
        ("stop", 128009, ("end_turn", None)),  # a stop token id is not a stop sequence
        ("stop", "END", ("stop_sequence", "END")),
        ("length", None, ("max_tokens", None)),
        ("tool_calls", None, ("tool_use", None)),
        (None, None, ("end_turn", None)),
        ("content_filter", None, ("end_turn", None)),
    ],
)
def test_finish_reasons_map_to_stop_reasons(
    finish: str | None, stop_reason: Any, expected: tuple[str, str | None]
) -> None:
    assert stop_result(finish, stop_reason) == expected
    msg = anthropic_message(answer({"content": "x"}, finish=finish, stop_reason=stop_reason))
    assert (msg["stop_reason"], msg.get("stop_sequence")) == expected


def test_a_tool_call_makes_the_stop_reason_tool_use_unless_output_was_cut() -> None:
    call = {"id": "c", "function": {"name": "f", "arguments": "{}"}}
    assert anthropic_message(answer({"tool_calls": [call]}, finish="stop"))["stop_reason"] == "tool_use"
    assert anthropic_message(answer({"tool_calls": [call]}, finish="length"))["stop_reason"] == "max_tokens"


def test_an_answer_without_content_has_one_empty_text_block() -> None:
    assert anthropic_message(answer({"content": None}))["content"] == [{"type": "text", "text": ""}]
    assert anthropic_message({"model": "m", "choices": []})["content"] == [{"type": "text", "text": ""}]


@pytest.mark.parametrize("arguments", ['["not", "an", "object"]', "{broken", None])
def test_tool_arguments_that_are_not_a_json_object_have_no_anthropic_form(arguments: Any) -> None:
    with pytest.raises(AnthropicResponseError, match="'f' arguments are not a valid JSON object"):
        anthropic_message(answer({"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": arguments}}]}))


def test_cached_prompt_tokens_are_reported_apart() -> None:
    assert usage({"prompt_tokens": 100, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 64}}) == {
        "input_tokens": 36,
        "output_tokens": 5,
        "cache_read_input_tokens": 64,
    }
    assert (
        usage({"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 7}})[
            "input_tokens"
        ]
        == 0
    )  # clamped
    assert usage(None) == {"input_tokens": 0, "output_tokens": 0}
