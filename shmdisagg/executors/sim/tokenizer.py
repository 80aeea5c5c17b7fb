"""The built-in deterministic tokenizer and chat template (no downloads, same ids in every process).

Encoding: text is first split on the special-token strings below (each maps to its fixed id),
then each remaining run is cut into pieces by `PIECE_RE` (GPT-2 style: an optional leading space
plus a run of letters, digits (up to 3), or punctuation; whitespace runs on their own). A piece's
id is `crc32(piece.encode()) % NUM_REGULAR`, so ids are stable across processes and Python hash
seeds, and collisions are allowed (as in any fixed vocabulary, two pieces may share an id).

Decoding is defined for every id: the generation vocabulary (`GEN_WORDS`, the words `sampler.py`
draws output tokens from) decodes to its word, special ids to their strings, any other id to
`<id>`. Because generated words re-encode to the same ids, a multi-turn client that sends the
previous answer back as text gets the same token ids the executor produced.

Chat template (Llama-3 shape), rendered then encoded:

    <|begin_of_text|>
    for each message:  <|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>
    if add_generation_prompt (default):  <|start_header_id|>assistant<|end_header_id|>\\n\\n

`content` may be a string or a list of parts; text parts are joined, other parts are skipped.
Completion prompts given as text get `<|begin_of_text|>` prepended (`add_special_tokens`, default
true, as TensorRT-LLM does); token-id prompts are used as given.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

VOCAB_SIZE = 128256
NUM_REGULAR = 128000
SPECIAL_TOKENS: dict[str, int] = {
    "<|begin_of_text|>": 128000,
    "<|end_of_text|>": 128001,
    "<|start_header_id|>": 128006,
    "<|end_header_id|>": 128007,
    "<|eot_id|>": 128009,
}
BOS_ID = SPECIAL_TOKENS["<|begin_of_text|>"]
EOS_ID = SPECIAL_TOKENS["<|eot_id|>"]

PIECE_RE = re.compile(r" ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
_ID_TO_SPECIAL = {v: k for k, v in SPECIAL_TOKENS.items()}

# The words output tokens are drawn from (with a leading space, as they appear mid-sentence).
GEN_WORDS: tuple[str, ...] = tuple(
    " " + w
    for w in (
        "the of and to in is was for that with as on by at from his her this are were be had have "
        "which an or not their one all but has more been first new who also they after its into "
        "two other when time there can would some only over world most city year may people made "
        "state such later these many where between through during while under three part known "
        "well both school water small long house around large since high power light river "
        "music early group history system family game number being began several found called "
        "each same often work until name life major still area great against before used second "
        "place home film book story line town order point field form play life north south east "
        "west early left right open close short simple clear bright quiet quick slow warm cold "
        "green blue red white black gold stone wood glass paper metal cloud rain snow wind fire "
        "earth moon star sun sea lake hill road bridge tower garden window door table chair "
        "river valley forest island harbor market village castle temple library station"
    ).split()
)

_CACHE_LIMIT = 1 << 20


def piece_id(piece: str) -> int:
    return zlib.crc32(piece.encode("utf-8")) % NUM_REGULAR


def _build_gen_vocab() -> tuple[tuple[int, ...], dict[int, str]]:
    ids: list[int] = []
    id2word: dict[int, str] = {}
    for word in GEN_WORDS:
        tid = piece_id(word)
        if tid not in id2word:  # drop duplicates and crc collisions: one word per id
            id2word[tid] = word
            ids.append(tid)
    return tuple(ids), id2word


GEN_VOCAB, _GEN_ID_TO_WORD = _build_gen_vocab()


class Tokenizer:
    """`encode(text) -> ids`, `decode(ids) -> text`; stateless apart from a piece-id cache."""

    vocab_size = VOCAB_SIZE
    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self) -> None:
        self._cache: dict[str, int] = {}

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        out: list[int] = [BOS_ID] if add_bos else []
        cache = self._cache
        if len(cache) > _CACHE_LIMIT:
            cache.clear()
        for i, part in enumerate(_SPECIAL_RE.split(text)):
            if not part:
                continue
            if i % 2:  # odd parts are the captured special tokens
                out.append(SPECIAL_TOKENS[part])
                continue
            for piece in PIECE_RE.findall(part):
                tid = cache.get(piece)
                if tid is None:
                    tid = cache[piece] = piece_id(piece)
                out.append(tid)
        return out

    def decode_one(self, token_id: int) -> str:
        word = _GEN_ID_TO_WORD.get(token_id)
        if word is not None:
            return word
        special = _ID_TO_SPECIAL.get(token_id)
        return special if special is not None else f"<{token_id}>"

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(map(self.decode_one, ids))


def render_chat(messages: Sequence[Any], add_generation_prompt: bool = True) -> str:
    """The built-in chat template (module docstring). Raises ValueError on a malformed message."""
    parts = ["<|begin_of_text|>"]
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be an object")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        parts.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{_content_text(msg.get('content'), i)}<|eot_id|>")
    if add_generation_prompt:
        parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ValueError(f"messages[{index}].content parts must be objects with a type")
            if part["type"] == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(f"messages[{index}].content text part needs a string text")
                texts.append(text)
        return "".join(texts)
    raise ValueError(f"messages[{index}].content must be a string or a list of parts")
