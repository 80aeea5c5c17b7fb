"""Response bodies and SSE chunks in the shapes trtllm-serve writes.

Sources: `tensorrt_llm/serve/postprocess_handlers.py` @01bf1923 (the post-processors, logprobs,
usage rewriting from `ctx_usage`) and the response models of `serve/openai_protocol.py`
@0076e939; non-streaming bodies are `model_dump()` (every field, nulls included), completion
chunks `model_dump_json()` (every field), chat chunks `model_dump_json(exclude_none=True)`.

- Non-streaming: `CompletionResponse` {id, object, created, model, choices[{index, text, token_ids,
  logprobs, context_logits, finish_reason, stop_reason, disaggregated_params,
  avg_decoded_tokens_per_iter}], usage, prompt_token_ids} / `ChatCompletionResponse` {..., choices[
  {index, message{role, content, reasoning_content: "", reasoning, tool_calls: []}, logprobs,
  finish_reason, stop_reason, mm_embedding_handle, disaggregated_params,
  avg_decoded_tokens_per_iter}], usage, prompt_token_ids, prompt_token_ids_b64}. `model` is the
  request's. A context_only answer carries `prompt_token_ids` (chat: `prompt_token_ids_b64`
  instead with `return_prompt_token_ids_b64`).
- Streaming (`StreamEncoder`): completion chunks `{id: "cmpl-<request id>", object, created,
  model, choices[{index, text, token_ids, logprobs, finish_reason, stop_reason,
  avg_decoded_tokens_per_iter}], usage: null}`; chat opens with a role chunk written
  `data: {...} \\n\\n` (a space before the blank line, as upstream), then
  `{..., choices[{index, delta{content, reasoning_content: ""}, [logprobs], [finish_reason],
  [stop_reason]}]}`; `stream_options.include_usage` adds `{..., choices: [], usage}` before
  `data: [DONE]`, `continuous_usage_stats` a usage on every chunk.
- Usage: `prompt_tokens`, `total_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`;
  a request with `ctx_usage` reports the context leg's prompt and cached tokens
  (`rewrite_usage_info_from_ctx`).
- Logprobs (values are fake; shapes and counts are TensorRT-LLM's): completions
  `{text_offset, token_logprobs, tokens, top_logprobs: [{text: logprob} x logprobs]}`, chat
  `{content: [{token, logprob, bytes, top_logprobs}]}` (`top_logprobs` a list of `top_logprobs`
  entries when asked for, else null). The generated token is the top entry.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from shmdisagg.executors.sim.requests import ParsedRequest, encode_b64_ids
from shmdisagg.executors.sim.sequence import Kind, Sequence
from shmdisagg.executors.sim.tokenizer import GEN_VOCAB, Tokenizer

DONE = b"data: [DONE]\n\n"
TOKEN_LOGPROB = -0.25  # fake logprob of the generated token; alternatives get -(1 + rank)
_GEN_INDEX = {t: i for i, t in enumerate(GEN_VOCAB)}


def usage(req: ParsedRequest, seq: Sequence, completion: int | None = None) -> dict[str, Any]:
    """`UsageInfo` of `seq` (completion tokens so far unless `completion` is given)."""
    prompt_tokens = seq.prompt_len
    cached = seq.cached_tokens
    ctx = req.ctx_usage
    if ctx is not None:
        prompt_tokens = ctx["prompt_tokens"]
        details = ctx.get("prompt_tokens_details")
        cached = details["cached_tokens"] if details else 0
    elif seq.ctx_cached_tokens is not None:
        cached = seq.ctx_cached_tokens  # generation-first: the context leg's, carried with the KV
    completion = len(seq.output) if completion is None else completion
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def context_params(req: ParsedRequest, seq: Sequence, endpoint: str, opaque_state: str) -> dict[str, Any]:
    """`choices[0].disaggregated_params` of a context_only answer: every `DisaggregatedParams`
    field, filled as `to_disaggregated_params` fills them from the executor's context-phase
    params (no schedule_style, no ctx_usage)."""
    return {
        "request_type": "context_only",
        "first_gen_tokens": list(seq.first_gen_tokens_out),
        "first_gen_log_probs": None,
        "first_gen_logits": None,
        "ctx_request_id": seq.ctx_request_id,
        "encoded_opaque_state": opaque_state,
        "draft_tokens": None,
        "disagg_request_id": req.disagg_request_id,
        "ctx_dp_rank": 0,
        "ctx_info_endpoint": endpoint,
        "schedule_style": None,
        "ctx_usage": None,
        "return_prompt_token_ids_b64": False,
        "resolved_thinking": None,
    }


def _alternatives(token: int, k: int) -> list[tuple[int, float]]:
    """The top-`k` (token, logprob) at a position: the generated token first, then its
    neighbours in the generation vocabulary."""
    out = [(token, TOKEN_LOGPROB)]
    base = _GEN_INDEX.get(token, 0)
    for rank in range(1, k):
        out.append((GEN_VOCAB[(base + rank) % len(GEN_VOCAB)], -1.0 - rank))
    return out


def completion_logprobs(tokens: list[int], tokenizer: Tokenizer, k: int, initial_offset: int = 0) -> dict[str, Any]:
    """`create_completion_logprobs`, including its `text_offset` (each offset adds the length of
    the token at that position, from `initial_offset`)."""
    text_offset: list[int] = []
    token_logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    texts: list[str] = []
    for t in tokens:
        token_logprobs.append(TOKEN_LOGPROB)
        tops.append({tokenizer.decode_one(a): lp for a, lp in _alternatives(t, k)})
        text = tokenizer.decode_one(t)
        text_offset.append(initial_offset if not text_offset else text_offset[-1] + len(text))
        texts.append(text)
    return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": texts, "top_logprobs": tops}


def chat_logprobs(
    tokens: list[int], tokenizer: Tokenizer, k: int, top: bool, drop_none: bool = False
) -> dict[str, Any]:
    """`create_logprobs`: one entry per token; `drop_none` as `exclude_none` writes a stream chunk."""
    content = []
    for t in tokens:
        text = tokenizer.decode_one(t)
        entry: dict[str, Any] = {"token": text, "logprob": TOKEN_LOGPROB, "bytes": list(text.encode())}
        if top:
            entry["top_logprobs"] = [
                {"token": (tk := tokenizer.decode_one(a)), "logprob": lp, "bytes": list(tk.encode())}
                for a, lp in _alternatives(t, k)
            ]
        elif not drop_none:
            entry["top_logprobs"] = None
        content.append(entry)
    return {"content": content}


def full_response(
    req: ParsedRequest, seq: Sequence, tokenizer: Tokenizer, disagg: dict[str, Any] | None
) -> dict[str, Any]:
    """The non-streaming answer (`disagg`: the choice's `disaggregated_params`)."""
    text = tokenizer.decode(seq.output)
    choice: dict[str, Any]
    if req.chat:
        logprobs = chat_logprobs(seq.output, tokenizer, req.logprobs, req.top_logprobs) if req.logprobs else None
        choice = {
            "index": 0,
            "message": {
                "role": req.role,
                "content": (req.echo_text or "") + text,
                "reasoning_content": "",
                "reasoning": None,
                "tool_calls": [],
            },
            "logprobs": logprobs,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "mm_embedding_handle": None,
            "disaggregated_params": disagg,
            "avg_decoded_tokens_per_iter": None,
        }
    else:
        logprobs = completion_logprobs(seq.output, tokenizer, req.logprobs) if req.logprobs else None
        choice = {
            "index": 0,
            "text": (req.echo_text or "") + text if req.detokenize else "",
            "token_ids": None if req.detokenize else list(seq.output),
            "logprobs": logprobs,
            "context_logits": None,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "disaggregated_params": disagg,
            "avg_decoded_tokens_per_iter": None,
        }
    body: dict[str, Any] = {
        "id": new_id(req.chat),
        "object": "chat.completion" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [choice],
        "usage": usage(req, seq),
        "prompt_token_ids": None,
    }
    if req.chat:
        body["prompt_token_ids_b64"] = None
    if seq.kind is Kind.CONTEXT_ONLY:
        if req.return_prompt_b64:
            body["prompt_token_ids_b64"] = encode_b64_ids(seq.prompt)
        else:
            body["prompt_token_ids"] = seq.prompt
    return body


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


class StreamEncoder:
    """One request's SSE chunks. The common chunk (mid-stream, no usage, no logprobs, text) is a
    cached byte prefix plus the JSON-escaped text. `finished` turns true with the chunk that
    carries the finish reason; `finish_chunk` writes one when the last tokens were a trimmed
    stop word (nothing left to show, upstream still sends the finish reason)."""

    def __init__(self, req: ParsedRequest, tokenizer: Tokenizer, request_id: int) -> None:
        self.req = req
        self.tokenizer = tokenizer
        self._head = {
            "id": f"{'chatcmpl' if req.chat else 'cmpl'}-{request_id}",
            "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": int(time.time()),
            "model": req.model,
        }
        head = orjson.dumps(self._head)[:-1]  # without the closing brace
        if req.chat:
            self._prefix = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":'
            self._suffix = b',"reasoning_content":""}}]}\n\n'
        else:
            self._prefix = b"data: " + head + b',"choices":[{"index":0,"text":'
            self._suffix = (
                b',"token_ids":null,"logprobs":null,"finish_reason":null,"stop_reason":null,'
                b'"avg_decoded_tokens_per_iter":null}],"usage":null}\n\n'
            )
        self._fast = not req.logprobs and not req.continuous_usage and req.detokenize
        # a completion's first chunk carries the echoed prompt, so it takes the slow path
        self._echo_pending = bool(req.echo_text) and not req.chat
        self.started = False
        self.finished = False
        self._text_len = 0  # characters of output text sent so far (completion logprobs' offsets)
        self._sent_tokens = 0

    def opening(self, seq: Sequence) -> bytes:
        """What a chat stream opens with: the role chunk (and, with `echo`, the echoed message)."""
        self.started = True
        if not self.req.chat:
            return b""
        out = self._chat_chunk({"index": 0, "delta": {"role": self.req.role}}, seq, 0, opening=True)
        if self.req.echo_text:
            out += self._chat_chunk({"index": 0, "delta": {"content": self.req.echo_text}}, seq, 0, opening=True)
        return out

    def chunks(self, tokens: list[int], seq: Sequence) -> bytes:
        """The chunk for `tokens` just generated (after `opening`)."""
        out = b"" if self.started else self.opening(seq)
        final = seq.finish_reason is not None
        text = self.tokenizer.decode(tokens)
        self._sent_tokens += len(tokens)
        if not final and self._fast and not self._echo_pending:
            self._text_len += len(text)
            return out + self._prefix + orjson.dumps(text) + self._suffix
        return out + self._chunk(tokens, text, seq, final)

    def finish_chunk(self, seq: Sequence) -> bytes:
        """The finish reason, if no chunk carried it yet (empty text)."""
        if self.finished or seq.finish_reason is None:
            return b""
        out = b"" if self.started else self.opening(seq)
        return out + self._chunk([], "", seq, True)

    def _chunk(self, tokens: list[int], text: str, seq: Sequence, final: bool) -> bytes:
        req = self.req
        completed = len(seq.output) if final else self._sent_tokens
        if req.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text, "reasoning_content": ""}}
            if req.logprobs:
                choice["logprobs"] = chat_logprobs(
                    tokens, self.tokenizer, req.logprobs, req.top_logprobs, drop_none=True
                )
            if final:
                choice["finish_reason"] = seq.finish_reason
                if seq.stop_reason is not None:
                    choice["stop_reason"] = seq.stop_reason
                self.finished = True
            self._text_len += len(text)
            return self._chat_chunk(choice, seq, completed)
        shown = text
        if self._echo_pending:
            shown, self._echo_pending = (req.echo_text or "") + text, False
        logprobs = completion_logprobs(tokens, self.tokenizer, req.logprobs, self._text_len) if req.logprobs else None
        self._text_len += len(text)
        if final:
            self.finished = True
        body = {
            **self._head,
            "choices": [{
                "index": 0,
                "text": shown if req.detokenize else "",
                "token_ids": None if req.detokenize else list(tokens),
                "logprobs": logprobs,
                "finish_reason": seq.finish_reason if final else None,
                "stop_reason": seq.stop_reason if final else None,
                "avg_decoded_tokens_per_iter": None,
            }],
            "usage": usage(req, seq, completed) if req.continuous_usage else None,
        }  # fmt: skip
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def _chat_chunk(self, choice: dict[str, Any], seq: Sequence, completed: int, opening: bool = False) -> bytes:
        body: dict[str, Any] = {**self._head, "choices": [choice]}
        if self.req.continuous_usage:
            body["usage"] = usage(self.req, seq, completed)
        return b"data: " + orjson.dumps(body) + (b" \n\n" if opening else b"\n\n")

    def usage_chunk(self, seq: Sequence) -> bytes:
        """`stream_options.include_usage`: the final usage, with no choices."""
        return b"data: " + orjson.dumps({**self._head, "choices": [], "usage": usage(self.req, seq)}) + b"\n\n"
