"""Routing token ids: the executors' own tokenization (the simulator's, or the executors' Hugging
Face tokenizer), and when the ids replace the executor's own tokenization in the request."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import orjson
import pytest

from shmdisagg.executors.sim.requests import Limits, parse_request
from shmdisagg.executors.sim.tokenizer import Tokenizer
from shmdisagg.orchestrator.tokenization import INLINE_CHARS, HFTokenizer, SimTokenizer, prompt_token_ids


@pytest.fixture(scope="module")
def tok(hf_tokenizer_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_tokenizer_dir, local_files_only=True)


CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}]}


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("size", [40, INLINE_CHARS * 2])  # inline and in a worker thread
def test_sim_tokenizer_matches_what_the_simulator_executes(chat: bool, size: int) -> None:
    text = ("hello there, friend! " * (size // 20 + 1))[:size]
    body = {"model": "m", "messages": [{"role": "user", "content": text}]} if chat else {"model": "m", "prompt": text}
    executor_ids = parse_request(
        orjson.dumps(body), chat, Tokenizer(), Limits(vocab_size=Tokenizer.vocab_size, max_seq_len=1 << 20)
    ).prompt
    req = dict(body)
    ids = asyncio.run(prompt_token_ids(SimTokenizer(), req, chat))
    assert ids == executor_ids
    # written back so the executor uses exactly these ids
    assert (req["prompt_token_ids"] if chat else req["prompt"]) == ids


def test_token_id_prompts_are_used_as_given() -> None:
    req = {"prompt": [5, 6, 7]}
    assert asyncio.run(prompt_token_ids(SimTokenizer(), req, False)) == [5, 6, 7]


@pytest.mark.parametrize("add_special_tokens", [None, True, False])
def test_a_completion_prompt_is_tokenized_as_the_worker_does_and_written_back(
    tok: Any, add_special_tokens: bool | None
) -> None:
    """The worker's DefaultInputProcessor: encode(prompt, add_special_tokens=request's, default true)."""
    req: dict[str, Any] = {"prompt": "hello world"}
    if add_special_tokens is not None:
        req["add_special_tokens"] = add_special_tokens
    expected = tok.encode("hello world", add_special_tokens=add_special_tokens is not False)
    assert asyncio.run(prompt_token_ids(HFTokenizer(tok), req, False)) == expected
    assert req["prompt"] == expected
    assert (expected[0] == tok.bos_token_id) == (add_special_tokens is not False)


def test_a_truncated_completion_goes_as_text_for_the_worker_to_truncate(tok: Any) -> None:
    req = {"prompt": "hello world " * 20, "truncate_prompt_tokens": 5}
    ids = asyncio.run(prompt_token_ids(HFTokenizer(tok), req, False))
    assert ids == tok.encode("hello world " * 20)  # routed on these
    assert req["prompt"] == "hello world " * 20


@pytest.mark.parametrize("hf", [False, True])
def test_an_echo_completion_is_routed_on_its_ids_but_sent_as_text(tok: Any, hf: bool) -> None:
    """The worker echoes the prompt's text, and refuses echo with a token-id prompt."""
    req = {"prompt": "hello world", "echo": True}
    tokenizer = HFTokenizer(tok) if hf else SimTokenizer()
    ids = asyncio.run(prompt_token_ids(tokenizer, req, False))
    assert ids and all(isinstance(i, int) for i in ids)
    assert req["prompt"] == "hello world"
    executed = parse_request(
        orjson.dumps({"model": "m", **req}),
        False,
        Tokenizer(),
        Limits(vocab_size=Tokenizer.vocab_size, max_seq_len=1 << 20),
    )
    assert executed.echo_text == "hello world"  # the simulator, as the worker, echoes the text


def test_chat_ids_route_but_are_not_written_back_unless_legacy(tok: Any) -> None:
    """TensorRT-LLM's router writes prompt_token_ids only when the workers' render fingerprint
    matches its own, or under TRTLLM_RENDER_LEGACY=1."""
    req = copy.deepcopy(CHAT)
    ids = asyncio.run(prompt_token_ids(HFTokenizer(tok, legacy=False), req, True))
    assert ids and "prompt_token_ids" not in req
    legacy = copy.deepcopy(CHAT)
    assert asyncio.run(prompt_token_ids(HFTokenizer(tok, legacy=True), legacy, True)) == ids
    assert legacy["prompt_token_ids"] == ids


def test_the_legacy_switch_is_read_from_the_environment(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRTLLM_RENDER_LEGACY", "1")
    assert HFTokenizer(tok).legacy
    monkeypatch.setenv("TRTLLM_RENDER_LEGACY", "0")
    assert not HFTokenizer(tok).legacy


@pytest.mark.parametrize(
    "extra, model_type",
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            None,
        ),  # the worker appends a tool-call prefix
        ({"truncate_prompt_tokens": 4}, None),
        ({}, "kimi_k3"),  # a serving extension rewrites the chat
    ],
)
def test_estimated_chat_ids_are_never_written_back(tok: Any, extra: dict[str, Any], model_type: str | None) -> None:
    req = {**copy.deepcopy(CHAT), **extra}
    assert asyncio.run(prompt_token_ids(HFTokenizer(tok, model_type, legacy=True), req, True))
    assert "prompt_token_ids" not in req


def test_a_long_chat_is_tokenized_off_the_loop_to_the_same_ids(tok: Any) -> None:
    text = "the weather is sunny today " * (INLINE_CHARS // 10)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    plain = {"messages": [{"role": "user", "content": text}]}
    hf = HFTokenizer(tok)
    assert asyncio.run(prompt_token_ids(hf, parts, True)) == asyncio.run(prompt_token_ids(hf, plain, True))


def test_an_unrenderable_chat_has_no_ids(tok: Any) -> None:
    req = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}
    assert asyncio.run(prompt_token_ids(HFTokenizer(tok, legacy=True), req, True)) is None
    assert "prompt_token_ids" not in req
