"""Token ids for routing: text prompts and chats tokenized exactly as the executor will.

Two tokenizers, chosen per role from the router args:
- `tokenizer_dir` set: a Hugging Face tokenizer loaded from that local directory
  (`transformers.AutoTokenizer`, `trust_remote_code` only because the directory is configured,
  as TensorRT-LLM's router does); chats are rendered with its chat template
  (`apply_chat_template(..., add_generation_prompt=True, tokenize=True)`);
- otherwise the simulator's built-in tokenizer and chat template (`executors/sim/tokenizer.py`).
Token-id prompts are used as given. The ids are written back into the request (`prompt` for
completions, `prompt_token_ids` for chats) so the executor does not tokenize again and its KV
blocks hash to exactly what the router matched on (TensorRT-LLM's router does the same).

Long texts are tokenized in a worker thread, off the event loop (TensorRT-LLM measured ~50 ms
for a 40k-token chat); short ones inline, where a thread hand-off would cost more than the work.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Protocol

from shmdisagg.config import ConfigError

INLINE_CHARS = 4096  # below this many characters, tokenize on the loop (thread hand-off costs ~50 µs)


class RoutingTokenizer(Protocol):
    def encode_prompt(self, prompt: str, add_special_tokens: bool) -> list[int]: ...

    def encode_chat(self, messages: list[Any], req: dict[str, Any]) -> list[int]: ...


class SimTokenizer:
    """The executor simulator's own tokenizer and chat template."""

    def __init__(self) -> None:
        from shmdisagg.executors.sim.tokenizer import Tokenizer, render_chat

        self._tok = Tokenizer()
        self._render = render_chat

    def encode_prompt(self, prompt: str, add_special_tokens: bool) -> list[int]:
        return self._tok.encode(prompt, add_bos=add_special_tokens)

    def encode_chat(self, messages: list[Any], req: dict[str, Any]) -> list[int]:
        return self._tok.encode(self._render(messages, bool(req.get("add_generation_prompt", True))))


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (no downloads)."""

    def __init__(self, directory: str) -> None:
        path = Path(directory)
        if not path.is_dir():
            raise ConfigError(f"router.tokenizer_dir: {directory!r} is not a directory")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError("router.tokenizer_dir needs the 'hf' extra: pip install 'shmdisagg[hf]'") from None
        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=True, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ConfigError(f"router.tokenizer_dir: cannot load a tokenizer from {directory!r}: {err}") from None

    def encode_prompt(self, prompt: str, add_special_tokens: bool) -> list[int]:
        return list(self._tok(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_chat(self, messages: list[Any], req: dict[str, Any]) -> list[int]:
        kwargs = dict(req.get("chat_template_kwargs") or {})
        out = self._tok.apply_chat_template(
            messages,
            tools=req.get("tools"),
            add_generation_prompt=bool(req.get("add_generation_prompt", True)),
            tokenize=True,
            **kwargs,
        )
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return list(ids)


def load_tokenizer(tokenizer_dir: str | None) -> RoutingTokenizer:
    """The tokenizer a role's router uses. Raises ConfigError naming the key."""
    return HFTokenizer(tokenizer_dir) if tokenizer_dir else SimTokenizer()


def _text_size(req: dict[str, Any], chat: bool) -> int:
    if not chat:
        prompt = req["prompt"]
        return len(prompt) if isinstance(prompt, str) else 0
    return sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 256 for m in req["messages"])


def _tokenize(tokenizer: RoutingTokenizer, req: dict[str, Any], chat: bool) -> list[int]:
    if chat:
        return tokenizer.encode_chat(req["messages"], req)
    return tokenizer.encode_prompt(req["prompt"], bool(req.get("add_special_tokens", True)))


async def prompt_token_ids(tokenizer: RoutingTokenizer, req: dict[str, Any], chat: bool) -> list[int]:
    """The request's prompt as token ids, written back into the request. Raises ValueError for
    a chat the template cannot render (the caller turns it into a 400)."""
    if not chat and isinstance(req["prompt"], list):
        return req["prompt"]
    if chat and isinstance(req.get("prompt_token_ids"), list):  # the client's own ids: the worker uses them
        return req["prompt_token_ids"]
    if _text_size(req, chat) < INLINE_CHARS:
        ids = _tokenize(tokenizer, req, chat)
    else:
        ids = await asyncio.to_thread(_tokenize, tokenizer, req, chat)
    if chat:
        req["prompt_token_ids"] = ids
    else:
        req["prompt"] = ids
    return ids
