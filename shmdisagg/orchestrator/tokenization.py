"""Token ids for routing: text prompts and chats tokenized exactly as the executors tokenize them.

Which tokenizer a deployment routes with is decided in `tokenizer_source.py`: the executors' own
Hugging Face tokenizer (`HFTokenizer`), or the simulator's built-in one for simulator executors
(`SimTokenizer`). Token-id prompts are used as given.

When the ids are written back into the request (so the executor does not tokenize again and its
KV blocks hash to exactly what the router matched on), following TensorRT-LLM
(`serve/router_utils.py` `BlockHashMixin._tokenize` / `_tokenize_chat` @00d403d7):
- completions: a text prompt is replaced by its ids (`prompt`), as upstream does; its
  `add_special_tokens` is the request's (default true), as the worker's `DefaultInputProcessor`
  applies it. With `truncate_prompt_tokens` the text is sent as it came: the worker truncates
  with its own tokenizer's `truncation_side` (left), which the router's tokenizer does not share.
  With `echo` too, unlike upstream: the worker prepends the prompt to the answer's text, and
  with ids instead of it refuses the request (`openai_server.py`'s echo concatenates the id list
  to the text: 400 "can only concatenate list (not "str") to list").
- chats: upstream's router writes `prompt_token_ids` only when every worker reports a
  `render_fingerprint` (in `/server_info`) equal to the router's own (`_may_write_back_token_ids`),
  or always under `TRTLLM_RENDER_LEGACY=1` (`render/chat.py` `legacy_render_enabled`). That
  fingerprint digests the tokenizer's `init_kwargs`, and the router loads its tokenizer with other
  arguments than the worker (`TransformersTokenizer.from_pretrained(path, trust_remote_code=...)`
  against the worker's `legacy=False, padding_side="left", truncation_side="left"`, which land in
  `init_kwargs`), so a router's fingerprint does not match a worker's: upstream's router then
  routes on its ids and lets the worker render. shmdisagg does the same without computing the
  fingerprint: an HF-rendered chat's ids are written back only under `TRTLLM_RENDER_LEGACY=1`
  (read at start-up), and never when they are only an estimate (a named `tool_choice`, which
  makes the worker append a tool-call prefix; `truncate_prompt_tokens`; a model whose serving
  extension rewrites chats). The simulator's ids are always written back: the simulator renders
  with the very same code.
A chat that cannot be rendered as the worker would (`chat_render.Unrenderable`: media parts, a
shape the worker refuses) gets no ids: it is routed on load alone and sent untokenized.

Long texts are tokenized in a worker thread, off the event loop (TensorRT-LLM measured ~50 ms
for a 40k-token chat); short ones inline, where a thread hand-off would cost more than the work.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from shmdisagg.orchestrator import chat_render
from shmdisagg.orchestrator.splice import TokenIds

INLINE_CHARS = 4096  # below this many characters, tokenize on the loop (thread hand-off costs ~50 µs)
LEGACY_ENV = "TRTLLM_RENDER_LEGACY"

log = logging.getLogger("shmdisagg.tokenization")


class Encoded(NamedTuple):
    """A prompt's routing ids, and whether they may replace the executor's own tokenization."""

    ids: list[int]
    write_back: bool


class RoutingTokenizer(Protocol):
    def encode_prompt(self, prompt: str, req: dict[str, Any]) -> Encoded | None: ...

    def encode_chat(self, req: dict[str, Any]) -> Encoded | None: ...


class SimTokenizer:
    """The executor simulator's own tokenizer and chat template (`executors/sim/tokenizer.py`).
    Raises ValueError for a chat the simulator refuses (the caller answers 400, as the simulator would)."""

    def __init__(self) -> None:
        from shmdisagg.executors.sim.tokenizer import Tokenizer, render_chat

        self._tok = Tokenizer()
        self._render = render_chat

    def encode_prompt(self, prompt: str, req: dict[str, Any]) -> Encoded:
        return Encoded(self._tok.encode(prompt, add_bos=bool(req.get("add_special_tokens", True))), True)

    def encode_chat(self, req: dict[str, Any]) -> Encoded:
        text = self._render(req["messages"], bool(req.get("add_generation_prompt", True)))
        return Encoded(self._tok.encode(text), True)


class HFTokenizer:
    """The executors' Hugging Face tokenizer (loaded by `tokenizer_source.load_routing_tokenizer`),
    rendering chats as `trtllm-serve` does (`chat_render.py`). `model_type`: the checkpoint's
    `config.json` model type, if known. Never raises for a request: what it cannot tokenize as
    the worker would gets None (routed on load, sent as it came)."""

    def __init__(self, tokenizer: Any, model_type: str | None = None, legacy: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_type = model_type
        self.legacy = os.environ.get(LEGACY_ENV, "0") == "1" if legacy is None else legacy
        self.unrenderable = 0  # chats routed without ids (a count for logs and tests)

    def encode_prompt(self, prompt: str, req: dict[str, Any]) -> Encoded | None:
        add_special = req.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            return None
        ids = self.tokenizer.encode(prompt, add_special_tokens=add_special)
        return Encoded(list(ids), req.get("truncate_prompt_tokens") is None)

    def encode_chat(self, req: dict[str, Any]) -> Encoded | None:
        try:
            text = chat_render.render(self.tokenizer, req)
            add_special = chat_render.add_special_tokens(req)
        except chat_render.Unrenderable as err:
            self.unrenderable += 1
            if self.unrenderable == 1:
                log.info("a chat was routed without token ids and sent for the executor to render (%s)", err)
            return None
        ids = list(self.tokenizer.encode(text, add_special_tokens=add_special))
        return Encoded(ids, self.legacy and self._exact(req))

    def _exact(self, req: dict[str, Any]) -> bool:
        """Whether the ids are the executed prompt, not an estimate (module docstring)."""
        named_tool = isinstance(req.get("tool_choice"), dict)
        return (
            not named_tool
            and req.get("truncate_prompt_tokens") is None
            and self.model_type not in chat_render.EXTENSION_MODEL_TYPES
        )


def _chars(content: Any) -> int:
    """Characters of a message's text (a string, or its text parts)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(_chars(p.get("text") if isinstance(p, dict) else p) for p in content if not isinstance(p, list))
    return 0


def _text_size(req: dict[str, Any], chat: bool) -> int:
    if not chat:
        prompt = req["prompt"]
        return len(prompt) if isinstance(prompt, str) else 0
    return sum(_chars(m.get("content")) for m in req["messages"])


def _tokenize(tokenizer: RoutingTokenizer, req: dict[str, Any], chat: bool) -> Encoded | None:
    if chat:
        return tokenizer.encode_chat(req)
    return tokenizer.encode_prompt(req["prompt"], req)


async def prompt_token_ids(tokenizer: RoutingTokenizer, req: dict[str, Any], chat: bool) -> Sequence[int] | None:
    """The request's prompt as routing token ids, written back into the request when they may
    replace the executor's tokenization (`prompt` for completions, `prompt_token_ids` for chats);
    None when it cannot be tokenized as the executor would. Raises ValueError for a chat the
    simulator's template refuses (the caller turns it into a 400)."""
    if not chat:
        if isinstance(prompt := req["prompt"], (list, TokenIds)):
            return prompt
    elif isinstance(ids := req.get("prompt_token_ids"), list):  # the client's own ids: the worker uses them
        return ids
    if _text_size(req, chat) < INLINE_CHARS:
        out = _tokenize(tokenizer, req, chat)
    else:
        out = await asyncio.to_thread(_tokenize, tokenizer, req, chat)
    if out is None:
        return None
    # echo needs the text (module docstring); no ids (an empty text without BOS) is the worker's
    # to refuse in its own words, where an empty id list would fail in it another way
    if out.write_back and out.ids and (chat or not req.get("echo")):
        req["prompt_token_ids" if chat else "prompt"] = out.ids
    return out.ids
