"""Anthropic Messages API request models, the error envelope and the SSE frame.

Re-implemented after TensorRT-LLM's `tensorrt_llm/serve/anthropic_protocol.py` (@7b6d11c0,
file id 57586563521), which fixes what the orchestrator accepts:

- request models accept unknown fields (clients attach `metadata`, `betas`, ... that must not
  fail validation); only the fields the conversion reads are modelled;
- a content block is chosen by its `type` before its fields are checked, so `{"type": "text"}`
  without `text` fails as a text block, and a type this server does not model reaches the
  conversion, which refuses it by name;
- `messages` has at least one entry, `max_tokens` >= 1, `temperature` and `top_p` in [0, 1],
  `top_k` >= 0; `thinking` is `enabled` (with `budget_tokens` >= 1024), `adaptive` or `disabled`
  (these two take no other field).

Pydantic here, not the hot path's plain dicts: this route is not the OpenAI hot path, and the
models give field-level 400s for free.

Errors reach the client in Anthropic's envelope, `{"type": "error", "error": {"type": ...,
"message": ...}}`, with the error `type` TensorRT-LLM's orchestrator gives a status
(`_error_type`: `invalid_request_error` for 4xx, else `api_error`).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from shmdisagg.orchestrator.validation import out_of_range_integer

# Anthropic-provided tools with a versioned `type`: server tools run on Anthropic's side, schema
# client tools have a built-in input schema (anthropic_protocol.py's two prefix lists).
SERVER_TOOL_TYPE_PREFIXES = (
    "web_search",
    "web_fetch",
    "code_execution",
    "tool_search_tool_",
    "advisor_",
    "mcp_toolset",
)
SCHEMA_CLIENT_TOOL_TYPE_PREFIXES = ("bash_", "text_editor_", "computer_", "memory_")


class AnthropicRequestError(ValueError):
    """A request this server refuses: a 400 in Anthropic's envelope; `str()` is the message."""


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Open):
    type: Literal["text"] = "text"
    text: str


class ImageSource(_Open):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(_Open):
    type: Literal["image"] = "image"
    source: ImageSource


class ToolUseBlock(_Open):
    type: Literal["tool_use"] = "tool_use"
    id: str = Field(default_factory=lambda: f"toolu_{uuid.uuid4().hex}")
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Open):
    type: Literal["tool_result"] = "tool_result"
    tool_use_id: str
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Open):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Open):
    type: Literal["redacted_thinking"] = "redacted_thinking"
    data: str | None = None


class UnknownBlock(_Open):
    """A block type not modelled here: kept, so the conversion can refuse it by name."""

    type: str


_KNOWN_BLOCKS = frozenset({"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"})


def _block_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in _KNOWN_BLOCKS else "unknown"


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")]
    | Annotated[UnknownBlock, Tag("unknown")],
    Discriminator(_block_tag),
]
ToolResultBlock.model_rebuild()


class Message(_Open):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(_Open):
    name: str
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: bool | None = None

    def _typed(self, prefixes: tuple[str, ...]) -> bool:
        return self.type not in (None, "custom") and self.type.startswith(prefixes)

    def is_server_tool(self) -> bool:
        return self._typed(SERVER_TOOL_TYPE_PREFIXES)

    def is_schema_client_tool(self) -> bool:
        return self._typed(SCHEMA_CLIENT_TOOL_TYPE_PREFIXES)


class ToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingEnabled(_Open):
    type: Literal["enabled"] = "enabled"
    budget_tokens: int = Field(ge=1024)  # Anthropic's documented floor


class ThinkingAdaptive(_Closed):
    type: Literal["adaptive"] = "adaptive"


class ThinkingDisabled(_Closed):
    type: Literal["disabled"] = "disabled"


Thinking = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class CountTokensRequest(_Open):
    """Body of `POST /v1/messages/count_tokens`: what renders the prompt, no generation controls."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: dict[str, Any] | None = None
    betas: list[str] | None = None
    context_management: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """Body of `POST /v1/messages`."""

    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None


def parse(model: type[CountTokensRequest], body: bytes) -> Any:
    """`body` validated as `model`. Raises `AnthropicRequestError` naming the bad field, also an
    integer the chat request could not carry (`validation.out_of_range_integer`)."""
    where = out_of_range_integer(body)
    if where is not None:
        raise AnthropicRequestError(
            f"{where}: an integer outside [-2**63, 2**64), which disaggregated serving cannot carry"
        )
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        # the deepest error names the field at fault: in `content: str | list[block]` the
        # string member's "should be a valid string" is not what went wrong with a block
        worst = max(err.errors(), key=lambda e: len(e.get("loc", ())))
        # pydantic names union members in the location (`list[tagged-union[...]]`): left out
        where = ".".join(str(p) for p in worst.get("loc", ()) if "[" not in str(p)) or "request"
        raise AnthropicRequestError(f"{where}: {worst.get('msg', 'invalid')}") from None


# The adapter's routes: every error on them, a refusal before the app included, is in the envelope.
PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def error_type(status: int) -> str:
    """The envelope's error `type` for an HTTP status (upstream's `_error_type`)."""
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_envelope(status: int, message: str) -> bytes:
    """JSON bytes of Anthropic's error envelope for `status`."""
    return orjson.dumps({"type": "error", "error": {"type": error_type(status), "message": message}})


def sse(event: dict[str, Any]) -> bytes:
    """One Anthropic SSE frame: `event: <type>` then the event as JSON (anthropic_protocol.py's
    `anthropic_sse`)."""
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
