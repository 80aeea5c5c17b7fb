"""Routing token ids: the executor's own tokenization, from a local Hugging Face tokenizer or the
simulator's built-in one, written back into the request."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import orjson
import pytest

from shmdisagg.config import ConfigError
from shmdisagg.executors.sim.requests import Limits, parse_request
from shmdisagg.executors.sim.tokenizer import Tokenizer
from shmdisagg.tokenization import INLINE_CHARS, HFTokenizer, SimTokenizer, load_tokenizer, prompt_token_ids

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    """A tiny word-level Hugging Face tokenizer with a chat template, built locally."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers

    words = ["[UNK]", "<s>", "hello", "world", "how", "are", "you", "<|user|>", "<|assistant|>", "<|system|>", "be", "brief"]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "chat_template": TEMPLATE}))
    return tmp_path


def test_hf_tokenizer_from_a_local_directory_encodes_prompts_and_chats(hf_dir: Path) -> None:
    tok = load_tokenizer(str(hf_dir))
    assert isinstance(tok, HFTokenizer)
    assert tok.encode_prompt("hello world", add_special_tokens=False) == [2, 3]
    req = {"messages": [{"role": "user", "content": "how are you"}]}
    ids = asyncio.run(prompt_token_ids(tok, req, chat=True))
    assert req["prompt_token_ids"] == ids
    assert ids == [7, 4, 5, 6, 8]  # <|user|> how are you <|assistant|> (the generation prompt)


def test_a_bad_tokenizer_dir_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="router.tokenizer_dir"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="router.tokenizer_dir"):
        load_tokenizer(str(tmp_path))  # a directory without a tokenizer


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("size", [40, INLINE_CHARS * 2])  # inline and in a worker thread
def test_sim_tokenizer_matches_what_the_simulator_executes(chat: bool, size: int) -> None:
    text = ("hello there, friend! " * (size // 20 + 1))[:size]
    body = {"model": "m", "messages": [{"role": "user", "content": text}]} if chat else {"model": "m", "prompt": text}
    executor_ids = parse_request(orjson.dumps(body), chat, Tokenizer(), Limits(vocab_size=Tokenizer.vocab_size, max_seq_len=1 << 20)).prompt
    req = dict(body)
    ids = asyncio.run(prompt_token_ids(SimTokenizer(), req, chat))
    assert ids == executor_ids
    # written back so the executor uses exactly these ids
    assert (req["prompt_token_ids"] if chat else req["prompt"]) == ids


def test_token_id_prompts_are_used_as_given() -> None:
    req = {"prompt": [5, 6, 7]}
    assert asyncio.run(prompt_token_ids(SimTokenizer(), req, False)) == [5, 6, 7]
