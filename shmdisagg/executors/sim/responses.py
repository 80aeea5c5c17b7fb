"""Response bodies and SSE chunks in TensorRT-LLM's OpenAI shapes.

Non-streaming: `CompletionResponse` / `ChatCompletionResponse` with `usage` (and
`prompt_tokens_details.cached_tokens`), `choices[0].disaggregated_params` on context_only
responses, and top-level `prompt_token_ids` (or `prompt_token_ids_b64`) on context_only
responses only. Streaming: one `data: {...}\\n\\n` chunk per engine iteration's tokens, the last
one carrying `finish_reason`; `stream_options.include_usage` adds a final chunk with
`choices: []` and `usage`; then `data: [DONE]\\n\\n`. Chat streams open with a role chunk.
A generation_only response reports usage rewritten from `ctx_usage` (prompt and cached tokens
of the context leg; total = prompt + completion), as `rewrite_usage_info_from_ctx` does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from shmdisagg.executors.sim.errors import SimError, error_body
from shmdisagg.executors.sim.requests import ParsedRequest, encode_b64_ids
from shmdisagg.executors.sim.sequence import Kind, Sequence
from shmdisagg.executors.sim.tokenizer import Tokenizer

DONE = b"data: [DONE]\n\n"


def usage(req: ParsedRequest, seq: Sequence) -> dict[str, Any]:
    prompt_tokens = seq.prompt_len
    cached = seq.cached_tokens
    ctx = req.ctx_usage
    if ctx is None and seq.ctx_cached_tokens is not None:
        cached = seq.ctx_cached_tokens  # generation-first: no ctx_usage, the KV pull carried it
    elif ctx is not None:
        if isinstance(ctx.get("prompt_tokens"), int):
            prompt_tokens = ctx["prompt_tokens"]
        details = ctx.get("prompt_tokens_details")
        cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    completion = len(seq.output)
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def disagg_params_out(req: ParsedRequest, seq: Sequence, endpoint: str, opaque_state: str) -> dict[str, Any]:
    """`choices[0].disaggregated_params` of a context_only response."""
    return {
        "request_type": "context_only",
        "first_gen_tokens": list(seq.output),
        "ctx_request_id": seq.ctx_request_id,
        "disagg_request_id": req.disagg_request_id,
        "encoded_opaque_state": opaque_state,
        "draft_tokens": None,
        "ctx_dp_rank": 0,
        "ctx_info_endpoint": endpoint,
    }


def full_response(
    req: ParsedRequest, seq: Sequence, tokenizer: Tokenizer, model: str, disagg: dict[str, Any] | None
) -> dict[str, Any]:
    text = tokenizer.decode(_visible(seq))
    choice: dict[str, Any]
    if req.chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": []},
            "logprobs": None,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "disaggregated_params": disagg,
        }
    else:
        choice = {
            "index": 0,
            "text": text if req.detokenize else "",
            "token_ids": None if req.detokenize else list(seq.output),
            "logprobs": None,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "disaggregated_params": disagg,
        }
    body: dict[str, Any] = {
        "id": new_id(req.chat),
        "object": "chat.completion" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(req, seq),
        "prompt_token_ids": None,
    }
    if seq.kind is Kind.CONTEXT_ONLY:
        if req.return_prompt_b64:
            body["prompt_token_ids_b64"] = encode_b64_ids(seq.prompt)
        else:
            body["prompt_token_ids"] = seq.prompt
    return body


def _visible(seq: Sequence) -> list[int]:
    """Output ids whose text is shown: a stop token is counted but not printed."""
    if seq.finish_reason == "stop" and seq.stop_reason is not None and seq.output:
        return seq.output[:-1]
    return seq.output


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


class StreamEncoder:
    """Builds one request's SSE chunks; the common (mid-stream, no usage) chunk is a cached
    byte prefix plus the JSON-escaped text."""

    def __init__(self, req: ParsedRequest, tokenizer: Tokenizer, model: str) -> None:
        self.req = req
        self.tokenizer = tokenizer
        self._head = {
            "id": new_id(req.chat),
            "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        head = orjson.dumps(self._head)[:-1]  # without the closing brace
        if req.chat:
            self._prefix = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":'
            self._suffix = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._prefix = b"data: " + head + b',"choices":[{"index":0,"text":'
            self._suffix = b',"token_ids":null,"logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}\n\n'
        self.started = False

    def chunks(self, tokens: list[int], seq: Sequence) -> bytes:
        """The bytes to send for `tokens` just generated (the role chunk first, for chat)."""
        out = b""
        if self.req.chat and not self.started:
            out = self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}, seq, usage_now=False)
        self.started = True
        final = seq.finish_reason is not None
        shown = tokens
        if final and seq.stop_reason is not None and tokens and tokens[-1] == seq.stop_reason:
            shown = tokens[:-1]
        text = self.tokenizer.decode(shown)
        if not final and not self.req.continuous_usage and self.req.detokenize:
            return out + self._prefix + orjson.dumps(text) + self._suffix
        choice: dict[str, Any]
        if self.req.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": seq.finish_reason}
            if final:
                choice["stop_reason"] = seq.stop_reason
        else:
            choice = {
                "index": 0,
                "text": text if self.req.detokenize else "",
                "token_ids": None if self.req.detokenize else list(tokens),
                "logprobs": None,
                "finish_reason": seq.finish_reason,
                "stop_reason": seq.stop_reason,
            }
        return out + self._chunk(choice, seq, usage_now=self.req.continuous_usage)

    def usage_chunk(self, seq: Sequence) -> bytes:
        return b"data: " + orjson.dumps({**self._head, "choices": [], "usage": usage(self.req, seq)}) + b"\n\n"

    def _chunk(self, choice: dict[str, Any], seq: Sequence, usage_now: bool) -> bytes:
        body: dict[str, Any] = {**self._head, "choices": [choice]}
        if not self.req.chat or usage_now:
            body["usage"] = usage(self.req, seq) if usage_now else None
        return b"data: " + orjson.dumps(body) + b"\n\n"


def sse_error(exc: SimError) -> bytes:
    return b"data: " + orjson.dumps({"error": error_body(exc)}) + b"\n\n" + DONE
