"""Chats rendered for routing exactly as `trtllm-serve` renders them: a differential test.

Each case is a chat request and the conversation TensorRT-LLM's chat route builds from it
(`serve/chat_utils.py` `parse_chat_messages_coroutines`, written out by hand from its rules: text
parts joined with "\\n", `media: []`, assistant `reasoning_content` and parsed tool-call
arguments, `tool_call_id`, other fields dropped). The reference ids are then what the worker
computes: `transformers`' `apply_chat_template` called as `inputs/utils.py` `apply_chat_template`
calls it, and the text encoded as `inputs/tokenization.py` `tokenize_prompt` does. The router's
ids must be identical.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from shmdisagg.orchestrator import chat_render
from shmdisagg.orchestrator.tokenization import HFTokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
WEATHER_DUMP = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": None,
    },
}
OTHER_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if "
    "add_generation_prompt %}[assistant]{% endif %}"
)


def msg(role: str, content: str, **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": content, "media": [], **extra}


CASES: list[tuple[str, dict[str, Any], list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    (
        "content as parts",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "hello"},
                        {"type": "text", "text": ""},
                        "plain string part",
                        {"type": "text", "text": "how are you"},
                    ],
                }
            ]
        },
        [msg("user", "hello\nplain string part\nhow are you")],
        None,
    ),
    (
        "system prompt and multi-turn",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the weather?"},
                {"role": "assistant", "content": "Sunny."},
                {"role": "user", "content": "And tomorrow?", "name": "bob"},
            ]
        },
        [
            msg("system", "Be brief."),
            msg("user", "What is the weather?"),
            msg("assistant", "Sunny."),
            msg("user", "And tomorrow?"),
        ],
        None,
    ),
    (
        "tools, tool calls and a tool result",
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "content": "20 C, sunny", "tool_call_id": "call_1"},
            ],
            "tools": [WEATHER],
            "tool_choice": "auto",
        },
        [
            msg("user", "Weather in Paris?"),
            msg(
                "assistant",
                "",
                tool_calls=[
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            ),
            msg("tool", "20 C, sunny", tool_call_id="call_1"),
        ],
        [WEATHER_DUMP],
    ),
    (
        "unparseable tool-call arguments kept verbatim, reasoning carried",
        {
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": "calling",
                    "reasoning": "think first",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "city=Paris"}}
                    ],
                },
            ]
        },
        [
            msg("user", "go"),
            msg(
                "assistant",
                "calling",
                reasoning_content="think first",
                tool_calls=[
                    {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "city=Paris"}}
                ],
            ),
        ],
        None,
    ),
    (
        "unicode",
        {
            "messages": [
                {"role": "system", "content": "Réponds en français 🙂"},
                {"role": "user", "content": "日本語で答えて、café déjà vu ±→"},
            ]
        },
        [msg("system", "Réponds en français 🙂"), msg("user", "日本語で答えて、café déjà vu ±→")],
        None,
    ),
    (
        "chat_template_kwargs",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"date_string": "3 Mar 2026", "reasoning": "high"},
        },
        [msg("user", "hi")],
        None,
    ),
    (
        "add_generation_prompt false",
        {
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How"}],
            "add_generation_prompt": False,
        },
        [msg("user", "hi"), msg("assistant", "Hello! How")],
        None,
    ),
    (
        "a request chat_template",
        {
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "chat_template": OTHER_TEMPLATE,
        },
        [msg("system", "sys"), msg("user", "a\nb")],
        None,
    ),
    (
        "documents",
        {
            "messages": [{"role": "user", "content": "Summarise."}],
            "documents": [{"title": "Report", "text": "Rain all week."}],
        },
        [msg("user", "Summarise.")],
        None,
    ),
    (
        "add_special_tokens true on a chat",
        {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True},
        [msg("user", "hi")],
        None,
    ),
    (
        "a system message's own tools, an empty tools list",
        {
            "messages": [{"role": "system", "content": "sys", "tools": [WEATHER]}, {"role": "user", "content": "hi"}],
            "tools": [],
        },
        [msg("system", "sys", tools=[WEATHER]), msg("user", "hi")],
        [],
    ),
]


def worker_ids(
    tok: Any, req: dict[str, Any], conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """TensorRT-LLM's worker: inputs/utils.py apply_chat_template, then tokenize_prompt."""
    template = req.get("chat_template") or tok.get_chat_template(None, tools=tools)
    text = tok.apply_chat_template(
        conversation=conversation,
        tokenize=False,
        return_dict=False,
        add_generation_prompt=req.get("add_generation_prompt", True),
        tools=tools,
        documents=req.get("documents"),
        chat_template=template,
        **(req.get("chat_template_kwargs") or {}),
    )
    return list(tok.encode(text, add_special_tokens=req.get("add_special_tokens", False)))


@pytest.fixture(scope="module")
def tok(hf_tokenizer_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_tokenizer_dir, local_files_only=True)


@pytest.mark.parametrize("name, req, conversation, tools", CASES, ids=[c[0] for c in CASES])
def test_router_ids_equal_the_workers(
    tok: Any, name: str, req: dict[str, Any], conversation: list[dict[str, Any]], tools: Any
) -> None:
    assert chat_render.conversation(copy.deepcopy(req["messages"])) == conversation
    assert chat_render.tool_dicts(copy.deepcopy(req.get("tools"))) == tools
    expected = worker_ids(tok, req, conversation, tools)
    encoded = HFTokenizer(tok, legacy=True).encode_chat(copy.deepcopy(req))
    assert encoded is not None and encoded.ids == expected
    assert encoded.write_back  # TRTLLM_RENDER_LEGACY=1: the exact ids may replace the worker's rendering


def test_content_parts_render_as_the_worker_joins_them_not_as_a_list(tok: Any) -> None:
    """Before: the messages went to the template as they came, so a list of parts rendered as
    its Python repr (or failed), unlike the worker's "\\n"-joined text."""
    req = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}
        ]
    }
    ids = HFTokenizer(tok).encode_chat(copy.deepcopy(req)).ids
    assert tok.decode(ids).endswith(
        "user<|end_header_id|>\n\nhello\nworld<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


@pytest.mark.parametrize(
    "req",
    [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                }
            ]
        },
        {
            "messages": [
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}
            ]
        },
        {"messages": [{"role": "user", "content": [{"type": "unknown_kind", "text": "x"}]}]},
        {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "extra": 1}}],
        },
        {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ raise_exception('no') }}"},
        {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
        {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": "yes"},
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": "x",
                    "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}],
                }
            ]
        },
    ],
    ids=[
        "image part",
        "audio part",
        "unknown part type",
        "part without type",
        "tool with an unknown field",
        "template error",
        "continue_final_message",
        "non-boolean add_generation_prompt",
        "tool-call arguments not an object",
    ],
)
def test_what_the_router_cannot_render_as_the_worker_goes_untokenized(tok: Any, req: dict[str, Any]) -> None:
    sent = copy.deepcopy(req)
    assert HFTokenizer(tok, legacy=True).encode_chat(sent) is None
    assert sent == req  # sent on as it came: the worker renders it (or answers its own 400)


def test_an_empty_media_part_is_skipped_as_upstream_does(tok: Any) -> None:
    req = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]}
        ]
    }
    assert chat_render.conversation(req["messages"]) == [msg("user", "hi")]
