"""A chat completion SSE stream reframed, chunk by chunk, into Anthropic's event sequence.

Semantics of TensorRT-LLM's `AnthropicStreamReframer` / `reframe_openai_stream`
(`tensorrt_llm/serve/anthropic_adapter.py` @a9239bda, file id 68409621504):

    message_start
    (content_block_start content_block_delta* content_block_stop)*
    message_delta
    message_stop

- `message_start` comes first and once, with the first chunk (its usage's input tokens, 0 output
  tokens); the model is the chunks' own (the request's until one names it);
- one block is open at a time: reasoning deltas go to a `thinking` block, content to a `text`
  block, and a switch closes the open block and opens the next (indices increase);
- tool calls are told apart by `index` (or, without one, a new call by its name); the first call
  to appear takes the open block and streams its arguments as `input_json_delta`s; fragments of
  another call meanwhile are kept and replayed in its own block when the open one closes, so each
  call's `partial_json` concatenates to exactly what the executor sent; a call that never got a
  name is dropped (a tool_use block must name its tool);
- `[DONE]`: buffered calls are emitted, the open block closed, then `message_delta` (stop reason
  as the non-streaming answer maps it, `tool_use` when a tool_use block was emitted unless
  `max_tokens`; the last usage seen) and `message_stop`;
- an error ends the stream with the open block closed and an `error` event: the chat stream's own
  error event (ours, `shmdisagg/orchestrator/errors.py`: its message, the type of its status), a chunk that is
  not JSON (`Malformed upstream stream chunk`), or a stream that ends without `[DONE]` (upstream's
  message: truncated output must never look like a finished answer).

Each `feed` returns the frames its complete SSE lines produced (an incomplete line waits for the
next chunk), so a chunk costs one parse of each `data:` line and nothing more.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from shmdisagg.anthropic.convert import new_message_id, stop_result, usage
from shmdisagg.anthropic.protocol import error_type, sse

log = logging.getLogger("shmdisagg.anthropic")

TRUNCATED = "Upstream stream ended before [DONE]; the response is incomplete"
MALFORMED = "Malformed upstream stream chunk"


@dataclass(slots=True)
class _ToolCall:
    key: Any
    id: str
    name: str | None = None
    pending: list[str] = field(default_factory=list)  # argument fragments while another block was open
    started: bool = False  # its content_block_start was sent


class StreamReframer:
    """One chat stream's bytes in, Anthropic SSE frames out. `feed(chunk)` for each chunk,
    `end()` once the chat stream ended; both return bytes (possibly b"")."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.message_id = new_message_id()
        self._tail = b""
        self.over = False  # [DONE] or an error was framed: nothing else follows
        self.failed = False
        self._started = False
        self._index = -1
        self._open: str | None = None  # the open block's type
        self._open_tool: Any = None  # the key of the tool call owning the open block
        self._calls: dict[Any, _ToolCall] = {}
        self._unindexed = 0
        self._tool_use = False
        self._stop: tuple[str, str | None] = ("end_turn", None)
        self._usage: dict[str, int] | None = None

    # -- bytes in, frames out ------------------------------------------------------------

    def feed(self, chunk: bytes) -> bytes:
        if self.over:
            return b""
        data = self._tail + chunk if self._tail else chunk
        cut = data.rfind(b"\n") + 1
        self._tail = data[cut:]
        out: list[bytes] = []
        for line in data[:cut].split(b"\n"):
            if not line or line == b"\r":  # the blank line after each event
                continue
            self._line(line, out)
            if self.over:
                self._tail = b""
                break
        return b"".join(out)

    def end(self) -> bytes:
        out: list[bytes] = []
        if not self.over and self._tail:
            self._line(self._tail, out)
        self._tail = b""
        if not self.over:
            log.warning("a chat stream ended before [DONE]: the Anthropic stream ends with an error event")
            out.extend(self.error(TRUNCATED))
        return b"".join(out)

    def _line(self, line: bytes, out: list[bytes]) -> None:
        line = line.strip()
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if not data:
            return
        if data == b"[DONE]":
            out.extend(self.finish())
            return
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            log.warning("a chat stream chunk is not a JSON object: %.80r", data)
            out.extend(self.error(MALFORMED))
            return
        if "error" in obj:
            out.extend(self._chat_error(obj["error"]))
            return
        out.extend(self.chunk(obj))

    def _chat_error(self, inner: Any) -> list[bytes]:
        """The chat route's SSE error event (`data: {"error": <ErrorResponse>}`)."""
        message = inner.get("message") if isinstance(inner, dict) else inner
        status = inner.get("code") if isinstance(inner, dict) else None
        return self.error(
            message if isinstance(message, str) and message else "generation failed mid-stream",
            status if type(status) is int else 500,
        )

    # -- events --------------------------------------------------------------------------

    def chunk(self, obj: dict[str, Any]) -> list[bytes]:
        """The frames for one chat completion chunk."""
        frames: list[bytes] = []
        if not self._started and obj.get("model"):
            self.model = obj["model"]
        chunk_usage = obj.get("usage")
        if isinstance(chunk_usage, dict):
            self._usage = usage(chunk_usage)
        if not self._started:
            # the input side of the usage known so far; output tokens start at 0
            start = {**self._usage, "output_tokens": 0} if self._usage else None
            frames.extend(self._start(start))
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict):
                self._choice(choice, frames)
        return frames

    def _choice(self, choice: dict[str, Any], frames: list[bytes]) -> None:
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            delta = {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            frames.extend(self._ensure("thinking"))
            frames.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if delta.get("content"):
            frames.extend(self._ensure("text"))
            frames.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                self._tool_fragment(call, frames)
        if choice.get("finish_reason"):
            self._stop = stop_result(choice["finish_reason"], choice.get("stop_reason"))

    def finish(self) -> list[bytes]:
        """The end of a complete stream (`[DONE]`)."""
        frames = self._start(None)  # a stream with no chunk at all still starts its message
        frames.extend(self._flush_pending())  # before the stop reason: a buffered call is a tool_use
        frames.extend(self._close())
        stop, sequence = self._stop
        if self._tool_use and stop != "max_tokens":
            stop, sequence = "tool_use", None
        delta: dict[str, Any] = {"stop_reason": stop}
        if sequence is not None:
            delta["stop_sequence"] = sequence
        frames.append(
            sse(
                {
                    "type": "message_delta",
                    "delta": delta,
                    "usage": self._usage or {"input_tokens": 0, "output_tokens": 0},
                }
            )
        )
        frames.append(sse({"type": "message_stop"}))
        self.over = True
        return frames

    def error(self, message: str, status: int = 500) -> list[bytes]:
        """Close the open block, then an `error` event; the stream is over."""
        frames = self._close()
        frames.append(sse({"type": "error", "error": {"type": error_type(status), "message": message}}))
        self.over = self.failed = True
        return frames

    def _start(self, start_usage: dict[str, int] | None) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "usage": start_usage or {"input_tokens": 0, "output_tokens": 0},
        }
        return [sse({"type": "message_start", "message": message})]

    # -- blocks --------------------------------------------------------------------------

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse({"type": "content_block_delta", "index": self._index, "delta": delta})

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = self._open_tool = None
        return [sse({"type": "content_block_stop", "index": self._index})]

    def _open_block(self, block: dict[str, Any]) -> list[bytes]:
        frames = self._close()
        self._index += 1
        self._open = block["type"]
        self._tool_use = self._tool_use or block["type"] == "tool_use"
        frames.append(sse({"type": "content_block_start", "index": self._index, "content_block": block}))
        return frames

    def _ensure(self, kind: str) -> list[bytes]:
        if self._open == kind:
            return []
        frames = self._flush_pending()  # a buffered call cannot get deltas once text opens
        frames.extend(
            self._open_block({"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": ""})
        )
        return frames

    # -- tool calls ----------------------------------------------------------------------

    def _tool_fragment(self, call: dict[str, Any], frames: list[bytes]) -> None:
        state = self._call_state(call)
        if state is None:
            return
        if not state.started and state.name and self._open != "tool_use":
            frames.extend(self._open_call(state))  # nothing else streams: it takes the block now
        arguments = call["function"].get("arguments")
        if arguments:
            if state.key == self._open_tool:
                frames.extend(self._argument_deltas([arguments]))
            else:
                state.pending.append(arguments)

    def _call_state(self, call: dict[str, Any]) -> _ToolCall | None:
        name = call["function"].get("name")
        key = call.get("index")
        if key is None:
            # without an index only a name says a new call began; an unnamed fragment belongs to
            # the call streaming now, else to the last one seen
            if name:
                self._unindexed += 1
                key = f"unindexed-{self._unindexed}"
            elif self._open_tool is not None:
                key = self._open_tool
            elif self._calls:
                key = next(reversed(self._calls))
            else:
                log.warning("dropping a tool argument fragment of no known tool call (neither index nor name)")
                return None
        state = self._calls.get(key)
        if state is None:
            state = self._calls[key] = _ToolCall(key, call.get("id") or f"toolu_{uuid.uuid4().hex}", name)
        elif not state.started:  # producers may repeat id and name on every fragment
            state.name = state.name or name
            state.id = call.get("id") or state.id
        return state

    def _argument_deltas(self, fragments: list[str]) -> list[bytes]:
        return [self._delta({"type": "input_json_delta", "partial_json": f}) for f in fragments if f]

    def _open_call(self, state: _ToolCall) -> list[bytes]:
        frames = self._open_block({"type": "tool_use", "id": state.id, "name": state.name, "input": {}})
        self._open_tool = state.key
        state.started = True
        frames.extend(self._argument_deltas(state.pending))
        state.pending.clear()
        return frames

    def _flush_pending(self) -> list[bytes]:
        """A complete block for every call still holding buffered arguments."""
        frames: list[bytes] = []
        for state in list(self._calls.values()):
            if state.key == self._open_tool:
                frames.extend(self._argument_deltas(state.pending))
                state.pending.clear()
                continue
            if state.started and not state.pending:
                continue
            if not state.name:
                log.warning("dropping the arguments of tool call %r: no tool name was sent", state.key)
                state.pending.clear()
                continue
            if state.started:  # resumed after its block closed: a second block keeps it whole
                log.warning(
                    "tool call %r (index %r) continued after its block closed; its remaining arguments go in a "
                    "second block",
                    state.name,
                    state.key,
                )
            frames.extend(self._open_call(state))
        return frames
