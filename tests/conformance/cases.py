"""The requests the conformance suite sends, each built fresh per test.

Every prompt starts with a nonce, so its KV blocks are new on every worker (no block of it is
cached anywhere: `cached_tokens` is comparable between the deployment's workers and the direct
reference worker). Requests that depend on what the engine generates (stop strings, prompts
filled up to `max_seq_len`) are worked out on a probe worker (the same engine, outside every
deployment), so the reference's KV cache has not seen the prompt when the request is sent.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.conformance.workers import Worker

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_SEQ_LEN = 4096  # the workers' default --max-seq-len
FILLER = " The quick brown fox jumps over the lazy dog while the cat watches."
UNICODE = "Grüße aus Köln — 日本語のテキスト, emoji 🦊🐕, naïve café, Ελληνικά, עברית"


class Req:
    """What a case builds its request from: the model, a nonce, and answers of the probe worker."""

    def __init__(self, model: str, probe: Worker) -> None:
        self.model = model
        self.probe_worker = probe
        self.nonce = f"[{uuid.uuid4().hex[:12]}]"
        self._rng = random.Random(self.nonce)

    def text(self, words: str = "Tell me a short story about a fox and a dog.") -> str:
        return f"{self.nonce} {words}"

    def ids(self, n: int) -> list[int]:
        """A token-id prompt of `n` ids from the tokenizer's ordinary vocabulary (seeded by the nonce)."""
        return [self._rng.randrange(0, 800) for _ in range(n)]

    def messages(self, content: Any = None) -> list[dict[str, Any]]:
        return [{"role": "user", "content": content if content is not None else self.text()}]

    def probe(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The probe worker's plain, non-streaming answer to `body`."""
        plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        answer = self.probe_worker.post(path, plain)
        assert answer.status == 200, answer.raw
        return answer.json  # type: ignore[no-any-return]

    def output_tokens(self, path: str, body: dict[str, Any]) -> list[str]:
        """The text of each token the engine generates for `body`."""
        if path == CHAT:
            resp = self.probe(path, {**body, "logprobs": True})
            return [t["token"] for t in resp["choices"][0]["logprobs"]["content"]]
        resp = self.probe(path, {**body, "logprobs": 1})
        return list(resp["choices"][0]["logprobs"]["tokens"])

    def stop_at(self, path: str, body: dict[str, Any], k: int) -> dict[str, Any]:
        """`body` with a stop string that first occurs where output token `k` (or a later one) starts."""
        tokens = self.output_tokens(path, body)
        text = "".join(tokens)
        for i in range(k, len(tokens)):
            start = len("".join(tokens[:i]))
            if tokens[i].strip() and text.find(tokens[i]) == start:
                return {**body, "stop": [tokens[i]]}
        raise AssertionError(f"no usable stop string in {tokens}")

    def prompt_tokens(self, path: str, body: dict[str, Any]) -> int:
        return int(self.probe(path, {**body, "max_tokens": 1})["usage"]["prompt_tokens"])

    def filled(self, path: str, make: Callable[[int], dict[str, Any]], max_tokens: int) -> tuple[dict[str, Any], int]:
        """`make(r)` with the largest repeat count r whose prompt leaves exactly room for at
        most `max_tokens` under max_seq_len; returns (body, its prompt tokens)."""
        target = MAX_SEQ_LEN - max_tokens
        one, two = self.prompt_tokens(path, make(1)), self.prompt_tokens(path, make(2))
        r = 1 + (target - one) // (two - one)
        while (n := self.prompt_tokens(path, make(r))) > target:
            r -= 1
        return {**make(r), "max_tokens": max_tokens}, n


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    build: Callable[[Req], dict[str, Any]]
    # "same": equal to the direct answer; "refused": shmdisagg's documented 400; "error": the
    # worker's error relayed
    kind: str = "same"
    field: str = "bogus_field"  # "error": the field the worker's validation error names


def _cmpl(req: Req, **kw: Any) -> dict[str, Any]:
    return {"model": req.model, "prompt": req.text(), "max_tokens": 8, **kw}


def _chat(req: Req, **kw: Any) -> dict[str, Any]:
    return {"model": req.model, "messages": req.messages(), "max_tokens": 8, **kw}


def _long_cmpl(req: Req, max_tokens: int = 8) -> dict[str, Any]:
    return req.filled(COMPLETIONS, lambda r: _cmpl(req, prompt=req.text(FILLER * r)), max_tokens)[0]


def _long_chat(req: Req, max_tokens: int = 8) -> dict[str, Any]:
    return req.filled(CHAT, lambda r: _chat(req, messages=req.messages(req.text(FILLER * r))), max_tokens)[0]


def over_max_seq_len(req: Req, path: str, make: Callable[[int], dict[str, Any]], **kw: Any) -> dict[str, Any]:
    body, n = req.filled(path, make, 8)
    return {**body, "max_tokens": MAX_SEQ_LEN - n + 1, **kw}  # one token over max_seq_len


def _stop_string(req: Req) -> dict[str, Any]:
    """A stop string given as a string, not a list."""
    body = req.stop_at(COMPLETIONS, _cmpl(req, max_tokens=12), 3)
    return {**body, "stop": body["stop"][0]}


USAGE = {"stream": True, "stream_options": {"include_usage": True}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
STREAM = {"stream": True}

CASES = [
    # completions
    Case("cmpl-text", COMPLETIONS, lambda r: _cmpl(r)),
    Case("cmpl-text-stream", COMPLETIONS, lambda r: _cmpl(r, **STREAM)),
    Case("cmpl-token-ids", COMPLETIONS, lambda r: _cmpl(r, prompt=r.ids(40))),
    Case("cmpl-token-ids-stream", COMPLETIONS, lambda r: _cmpl(r, prompt=r.ids(40), **STREAM)),
    Case("cmpl-stop", COMPLETIONS, lambda r: r.stop_at(COMPLETIONS, _cmpl(r, max_tokens=12), 3)),
    Case("cmpl-stop-stream", COMPLETIONS, lambda r: r.stop_at(COMPLETIONS, _cmpl(r, max_tokens=12, **STREAM), 3)),
    Case("cmpl-stop-first-token", COMPLETIONS, lambda r: r.stop_at(COMPLETIONS, _cmpl(r), 0)),
    Case("cmpl-stop-first-token-stream", COMPLETIONS, lambda r: r.stop_at(COMPLETIONS, _cmpl(r, **USAGE), 0)),
    Case("cmpl-max-tokens-1", COMPLETIONS, lambda r: _cmpl(r, max_tokens=1)),
    Case("cmpl-max-tokens-1-stream", COMPLETIONS, lambda r: _cmpl(r, max_tokens=1, **USAGE)),
    Case("cmpl-logprobs", COMPLETIONS, lambda r: _cmpl(r, logprobs=2)),
    Case("cmpl-logprobs-stream", COMPLETIONS, lambda r: _cmpl(r, logprobs=2, **STREAM)),
    Case("cmpl-include-usage", COMPLETIONS, lambda r: _cmpl(r, **USAGE)),
    Case("cmpl-unicode", COMPLETIONS, lambda r: _cmpl(r, prompt=r.text(UNICODE))),
    Case("cmpl-unicode-stream", COMPLETIONS, lambda r: _cmpl(r, prompt=r.text(UNICODE), **STREAM)),
    Case("cmpl-long", COMPLETIONS, lambda r: _long_cmpl(r)),
    Case("cmpl-long-stream", COMPLETIONS, lambda r: {**_long_cmpl(r), **USAGE}),
    Case("cmpl-n-1", COMPLETIONS, lambda r: _cmpl(r, n=1)),
    Case("cmpl-empty-model", COMPLETIONS, lambda r: _cmpl(r, model="")),  # a string: served
    Case("cmpl-n-2", COMPLETIONS, lambda r: _cmpl(r, n=2), kind="refused"),
    Case(
        "cmpl-over-max-seq-len",
        COMPLETIONS,
        lambda r: over_max_seq_len(r, COMPLETIONS, lambda n: _cmpl(r, prompt=r.text(FILLER * n))),
        kind="error",
    ),
    Case("cmpl-unknown-field", COMPLETIONS, lambda r: _cmpl(r, bogus_field=1), kind="error"),
    # the worker serves an empty text (its BOS is the prompt) and refuses one without BOS
    Case("cmpl-empty-text", COMPLETIONS, lambda r: _cmpl(r, prompt="")),
    Case("cmpl-empty-text-stream", COMPLETIONS, lambda r: _cmpl(r, prompt="", **USAGE)),
    Case("cmpl-empty-text-no-bos", COMPLETIONS, lambda r: _cmpl(r, prompt="", add_special_tokens=False), kind="error"),
    # the worker prepends the prompt's text; a tokenizing router must not send it as ids
    Case("cmpl-echo", COMPLETIONS, lambda r: _cmpl(r, echo=True)),
    Case("cmpl-echo-stream", COMPLETIONS, lambda r: _cmpl(r, echo=True, **STREAM)),
    # chat
    Case("chat-text", CHAT, lambda r: _chat(r)),
    Case("chat-text-stream", CHAT, lambda r: _chat(r, **STREAM)),
    Case(
        "chat-system-prompt",
        CHAT,
        lambda r: _chat(r, messages=[{"role": "system", "content": "You are terse."}, *r.messages()]),
    ),
    Case(
        "chat-content-parts",
        CHAT,
        lambda r: _chat(
            r,
            messages=r.messages([{"type": "text", "text": r.nonce}, {"type": "text", "text": "Tell me about foxes."}]),
        ),
    ),
    Case(
        "chat-content-parts-stream",
        CHAT,
        lambda r: _chat(
            r, messages=r.messages([{"type": "text", "text": r.nonce}, {"type": "text", "text": "Foxes?"}]), **STREAM
        ),
    ),
    Case(
        "chat-multi-turn",
        CHAT,
        lambda r: _chat(
            r,
            messages=[
                *r.messages(),
                {"role": "assistant", "content": "Once upon a time."},
                {"role": "user", "content": "Go on."},
            ],
        ),
    ),
    Case("chat-prompt-token-ids", CHAT, lambda r: _chat(r, prompt_token_ids=r.ids(30))),
    Case("chat-stop", CHAT, lambda r: r.stop_at(CHAT, _chat(r, max_tokens=12), 3)),
    Case("chat-stop-stream", CHAT, lambda r: r.stop_at(CHAT, _chat(r, max_tokens=12, **STREAM), 3)),
    Case("chat-stop-first-token", CHAT, lambda r: r.stop_at(CHAT, _chat(r), 0)),
    Case("chat-stop-first-token-stream", CHAT, lambda r: r.stop_at(CHAT, _chat(r, **USAGE), 0)),
    Case("chat-max-tokens-1", CHAT, lambda r: _chat(r, max_tokens=1)),
    Case("chat-max-tokens-1-stream", CHAT, lambda r: _chat(r, max_tokens=1, **USAGE)),
    Case(
        "chat-max-completion-tokens",
        CHAT,
        lambda r: {"model": r.model, "messages": r.messages(), "max_completion_tokens": 5},
    ),
    Case("chat-logprobs", CHAT, lambda r: _chat(r, logprobs=True, top_logprobs=2)),
    Case("chat-logprobs-stream", CHAT, lambda r: _chat(r, logprobs=True, top_logprobs=2, **STREAM)),
    Case("chat-include-usage", CHAT, lambda r: _chat(r, **USAGE)),
    Case("chat-unicode", CHAT, lambda r: _chat(r, messages=r.messages(r.text(UNICODE)))),
    Case("chat-long", CHAT, lambda r: _long_chat(r)),
    Case("chat-long-stream", CHAT, lambda r: {**_long_chat(r), **USAGE}),
    Case("chat-cache-salt", CHAT, lambda r: _chat(r, cache_salt=r.nonce)),
    Case("chat-n-2", CHAT, lambda r: _chat(r, n=2), kind="refused"),
    # more of the protocol: each answered as the worker answers it, its refusals relayed (the
    # worker's validation errors echo the leg they refuse, handoff included: none may reach the
    # client)
    Case(
        "cmpl-stream-options-without-stream",
        COMPLETIONS,
        lambda r: _cmpl(r, stream_options={"include_usage": True}),
        kind="error",
        field="Stream options",
    ),
    Case("cmpl-max-tokens-null", COMPLETIONS, lambda r: _cmpl(r, max_tokens=None)),
    Case("cmpl-stream-false", COMPLETIONS, lambda r: _cmpl(r, stream=False)),
    Case("cmpl-stop-as-string", COMPLETIONS, lambda r: _stop_string(r)),
    Case("cmpl-stop-token-ids", COMPLETIONS, lambda r: _cmpl(r, stop_token_ids=[5])),
    Case("cmpl-ignore-eos-min-tokens", COMPLETIONS, lambda r: _cmpl(r, ignore_eos=True, min_tokens=4)),
    Case("cmpl-logprobs-0", COMPLETIONS, lambda r: _cmpl(r, logprobs=0)),
    Case("cmpl-user-seed-temperature", COMPLETIONS, lambda r: _cmpl(r, user="u1", seed=7, temperature=0.0)),
    Case("cmpl-detokenize-false", COMPLETIONS, lambda r: _cmpl(r, detokenize=False)),
    Case("cmpl-token-ids-batch-of-1", COMPLETIONS, lambda r: _cmpl(r, prompt=[r.ids(20)])),
    Case("cmpl-text-batch-of-1", COMPLETIONS, lambda r: _cmpl(r, prompt=[r.text()])),
    Case(  # the nonce at the end: the 20 tokens kept are new to every worker
        "cmpl-truncate-prompt-tokens",
        COMPLETIONS,
        lambda r: _cmpl(r, prompt=f"Tell me a story. {r.nonce}", truncate_prompt_tokens=20),
    ),
    Case(
        "cmpl-continuous-usage-stats",
        COMPLETIONS,
        lambda r: _cmpl(r, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
    ),
    Case(
        "cmpl-return-token-ids",
        COMPLETIONS,
        lambda r: _cmpl(r, return_token_ids=True),
        kind="error",
        field="return_token_ids",
    ),
    Case(
        "chat-empty-content",
        CHAT,
        lambda r: _chat(r, messages=[{"role": "system", "content": r.nonce}, {"role": "user", "content": ""}]),
    ),
    Case("chat-system-only", CHAT, lambda r: _chat(r, messages=[{"role": "system", "content": r.text()}])),
    Case("chat-logprobs-without-top", CHAT, lambda r: _chat(r, logprobs=True)),
    Case("chat-echo", CHAT, lambda r: _chat(r, echo=True)),
    Case("chat-echo-stream", CHAT, lambda r: _chat(r, echo=True, stream=True)),
    Case(
        "chat-tool-choice-none",
        CHAT,
        lambda r: _chat(
            r,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
            tool_choice="none",
        ),
    ),
    Case(
        "chat-truncate-prompt-tokens",
        CHAT,
        lambda r: _chat(r, messages=r.messages(f"Tell me a story. {r.nonce}"), truncate_prompt_tokens=20),
    ),
    Case(
        "chat-continuous-usage-stats",
        CHAT,
        lambda r: _chat(r, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
    ),
    Case(
        "chat-continue-final-message",
        CHAT,
        lambda r: _chat(
            r,
            messages=[*r.messages(), {"role": "assistant", "content": "Once"}],
            add_generation_prompt=False,
            continue_final_message=True,
        ),
        kind="error",
        field="continue_final_message",
    ),
    Case(
        "chat-max-tokens-and-max-completion-tokens",
        CHAT,
        lambda r: _chat(r, max_completion_tokens=3),
        kind="error",
        field="max_completion_tokens",
    ),
    Case("chat-tool-choice-auto", CHAT, lambda r: _chat(r, tools=TOOLS, tool_choice="auto")),
    Case("chat-tool-choice-required", CHAT, lambda r: _chat(r, tools=TOOLS, tool_choice="required")),
    Case(
        "chat-tool-choice-named",
        CHAT,
        lambda r: _chat(r, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}}),
    ),
    Case("chat-response-format-json-object", CHAT, lambda r: _chat(r, response_format={"type": "json_object"})),
    Case(
        "chat-message-name", CHAT, lambda r: _chat(r, messages=[{"role": "user", "content": r.text(), "name": "bob"}])
    ),
    Case("chat-template-kwargs", CHAT, lambda r: _chat(r, chat_template_kwargs={"enable_thinking": False})),
    Case("chat-add-special-tokens", CHAT, lambda r: _chat(r, add_special_tokens=True)),
    Case("chat-unknown-role", CHAT, lambda r: _chat(r, messages=[{"role": "wizard", "content": r.text()}])),
    Case("cmpl-logit-bias", COMPLETIONS, lambda r: _cmpl(r, logit_bias={"5": 10.0})),
    Case("cmpl-best-of-1", COMPLETIONS, lambda r: _cmpl(r, best_of=1)),
    Case(
        "cmpl-penalties",
        COMPLETIONS,
        lambda r: _cmpl(r, frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1),
    ),
    Case("cmpl-top-k-top-p-min-p", COMPLETIONS, lambda r: _cmpl(r, top_k=5, top_p=0.9, min_p=0.1)),
    # the worker's sampling checks, relayed as it words them
    Case("cmpl-temperature-negative", COMPLETIONS, lambda r: _cmpl(r, temperature=-1.0), kind="error"),
    Case("cmpl-top-p-over-1", COMPLETIONS, lambda r: _cmpl(r, top_p=2.0), kind="error"),
    Case("cmpl-token-id-out-of-vocabulary", COMPLETIONS, lambda r: _cmpl(r, prompt=[100000]), kind="error"),
    # numbers and booleans as pydantic's lax mode reads them (TensorRT-LLM's request models)
    Case("cmpl-lax-numbers", COMPLETIONS, lambda r: _cmpl(r, max_tokens="8", n="1", best_of=1.0)),
    Case("cmpl-lax-stream-false", COMPLETIONS, lambda r: _cmpl(r, stream="false")),
    Case("chat-lax-stream", CHAT, lambda r: _chat(r, stream="true", stream_options={"include_usage": "yes"})),
    Case(
        "chat-stream-options-without-stream",
        CHAT,
        lambda r: _chat(r, stream_options={"include_usage": True}),
        kind="error",
        field="stream_options can only be set",
    ),
    # the context leg ends the request: usage as stream_options asks (include_usage defaults to
    # true once stream_options is there; continuous usage on every chunk)
    Case(
        "cmpl-stop-first-token-stream-options-empty",
        COMPLETIONS,
        lambda r: r.stop_at(COMPLETIONS, _cmpl(r, stream=True, stream_options={}), 0),
    ),
    Case(
        "cmpl-stop-first-token-continuous-usage",
        COMPLETIONS,
        lambda r: r.stop_at(COMPLETIONS, _cmpl(r, stream=True, stream_options={"continuous_usage_stats": True}), 0),
    ),
    Case(
        "chat-stop-first-token-stream-options-empty",
        CHAT,
        lambda r: r.stop_at(CHAT, _chat(r, stream=True, stream_options={}), 0),
    ),
    Case(
        "chat-stop-first-token-continuous-usage",
        CHAT,
        lambda r: r.stop_at(CHAT, _chat(r, stream=True, stream_options={"continuous_usage_stats": True}), 0),
    ),
    Case(
        "chat-stop-first-token-usage-off",
        CHAT,
        lambda r: r.stop_at(CHAT, _chat(r, stream=True, stream_options={"include_usage": False}), 0),
    ),
    Case(
        "cmpl-lax-stream-false-with-stream-options", COMPLETIONS, lambda r: _cmpl(r, stream="false", stream_options={})
    ),
    Case(
        "cmpl-lax-stream-string-false-with-usage",
        COMPLETIONS,
        lambda r: _cmpl(r, stream="false", stream_options={"include_usage": True}),
    ),
    Case("cmpl-lax-token-ids", COMPLETIONS, lambda r: _cmpl(r, prompt=[float(i) for i in r.ids(30)])),
]
BY_NAME = {c.name: c for c in CASES}
# The cases a router can change (which server, and for tokenizing routers the prompt they write
# back): run on every deployment; the rest on the deployments marked "full".
CORE = [
    "cmpl-text",
    "cmpl-text-stream",
    "cmpl-token-ids",
    "chat-text",
    "chat-text-stream",
    "chat-content-parts",
    "chat-system-prompt",
    "cmpl-unicode",
]
