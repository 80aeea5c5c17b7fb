"""An Anthropic Messages request to a chat completion request, and a chat answer back.

The semantics are TensorRT-LLM's adapter's (`tensorrt_llm/serve/anthropic_adapter.py`
@a9239bda, file id 68409621504, the newest seen: it adds `injected_chat_template_kwargs` to
@de85b98a), re-implemented over plain dicts:

Request (`chat_request`):
- `system` (a string, or text blocks whose first one is dropped when it is Claude Code's
  `x-anthropic-billing-header: k=v; ...` telemetry) and the system messages *before* the first
  turn become one leading system message, joined by blank lines; a later system message stays
  where it is (moving it would change the prompt's prefix and lose its KV cache);
- text and image blocks become content parts (`image_url`, a `data:` URL for base64); a
  `tool_use` in an assistant turn becomes a tool call (`arguments` = `json.dumps(input)`, byte for
  byte what upstream renders, so the prompt and its cached prefix are the same); a
  `tool_result` becomes a `tool` message (`Tool execution failed: ` before an error's text),
  flushed in order between the user parts around it; `thinking` in an assistant turn becomes its
  `reasoning`;
- refused (400, upstream's messages): `redacted_thinking`, a block type not modelled, thinking or
  tool_use outside an assistant turn, a non-text block inside a tool_result, an image without url
  or data, tool_use with an image in one assistant turn, server tools (dropped when
  `tool_choice` is `none`), a client tool without `input_schema`, `tool_choice` `any` or `tool`,
  `disable_parallel_tool_use`, a thinking budget not below `max_tokens`, an `output_config.format`
  other than `json_schema`;
- `max_tokens` -> `max_completion_tokens`; `temperature`, `top_p`, `top_k`; `stop_sequences` ->
  `stop`; `thinking` -> `chat_template_kwargs.enable_thinking` (+ `thinking_token_budget`);
  `output_config.effort` -> `reasoning_effort`; `context_management` `clear_thinking*` with
  `keep: "all"` -> `clear_thinking` / `drop_thinking` false; the keys the adapter put in
  `chat_template_kwargs` are listed in `injected_chat_template_kwargs`; a stream asks for usage on
  every chunk.

Answer (`anthropic_message`): a thinking block, a text block, then one `tool_use` block per tool
call (arguments must be a JSON object, else `AnthropicResponseError`); `stop_reason` from
`finish_reason` (`stop` -> `end_turn`, or `stop_sequence` with the matched string when
`stop_reason` is one; `length` -> `max_tokens`; `tool_calls` -> `tool_use`; anything else
`end_turn`), forced to `tool_use` when a tool_use block is present unless `max_tokens`; usage with
cached prompt tokens split out as `cache_read_input_tokens`; an empty text block when there is no
content at all.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

import orjson

from shmdisagg.anthropic.protocol import (
    AnthropicRequestError,
    ContentBlock,
    CountTokensRequest,
    ImageBlock,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)

log = logging.getLogger("shmdisagg.anthropic")

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# A marker, then one or more `key=value;` pairs in any order: matched by shape, because the
# client's field list drifts (upstream's `_ANTHROPIC_BILLING_SYSTEM_BLOCK`).
_BILLING_BLOCK = re.compile(r"x-anthropic-billing-header:\s*(?:[A-Za-z_][\w.-]*=[^;]*;\s*)+")
# Chat-template kwargs that keep earlier turns' reasoning: GLM templates read the first,
# DeepSeek-V4 the second; a template ignores the one it does not know.
_KEEP_ALL_THINKING = {"clear_thinking": False, "drop_thinking": False}


class AnthropicResponseError(ValueError):
    """A chat answer that has no Anthropic form (a 500 for the client)."""


# -- request --------------------------------------------------------------------------------


def chat_request(req: MessagesRequest) -> dict[str, Any]:
    """The chat completion request (a dict, as the chat route reads it) for `req`.
    Raises `AnthropicRequestError`."""
    messages = _messages(req)
    if not messages:
        raise AnthropicRequestError("messages must not be empty")
    tools = _tools(req)
    chat: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_tokens,
        "stream": bool(req.stream),
    }
    choice = _tool_choice(req.tool_choice, tools)
    if tools is not None:
        chat["tools"] = tools
    if choice is not None:
        chat["tool_choice"] = choice
    for key in ("temperature", "top_p", "top_k"):
        if getattr(req, key) is not None:
            chat[key] = getattr(req, key)
    if req.stop_sequences:
        chat["stop"] = list(req.stop_sequences)
    kwargs = _template_kwargs(req, chat)
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
        # none of them is the caller's, so the worker's unused-kwargs guard must not refuse them
        chat["injected_chat_template_kwargs"] = sorted(kwargs)
    if req.stream:
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat


def count_tokens_chat_request(req: CountTokensRequest) -> dict[str, Any]:
    """The chat request whose prompt a `count_tokens` body counts: the same conversion as a real
    request (a count taken any other way drifts from the prompt that request builds), with the
    smallest `max_tokens` it accepts (1, or the thinking budget + 1) (upstream's
    `convert_anthropic_count_tokens_request`). For executors that serve the route (the
    orchestrator only forwards it). Raises `AnthropicRequestError`."""
    budget = req.thinking.budget_tokens if req.thinking is not None and req.thinking.type == "enabled" else 0
    fields = {k: getattr(req, k) for k in CountTokensRequest.model_fields}
    return chat_request(MessagesRequest.model_construct(**fields, max_tokens=budget + 1, stream=False))


def _template_kwargs(req: MessagesRequest, chat: dict[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if req.thinking is not None:
        kwargs["enable_thinking"] = req.thinking.type != "disabled"
        if req.thinking.type == "enabled":
            if req.thinking.budget_tokens >= req.max_tokens:
                raise AnthropicRequestError("thinking budget_tokens must be less than max_tokens")
            chat["thinking_token_budget"] = req.thinking.budget_tokens
    config = req.output_config or {}
    effort = config.get("effort")
    if isinstance(effort, str) and effort:
        kwargs["reasoning_effort"] = effort
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise AnthropicRequestError("output_config.format must be an object")
        if fmt.get("type") != "json_schema":
            raise AnthropicRequestError("Only output_config.format type 'json_schema' is supported")
        if not isinstance(fmt.get("schema"), dict):
            raise AnthropicRequestError("output_config.format.schema must be an object")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
    kwargs.update(_retention_kwargs(req.context_management))
    return kwargs


def _retention_kwargs(context_management: Any) -> dict[str, Any]:
    """`keep: "all"` of a `clear_thinking*` edit keeps every turn's reasoning; any other policy
    is left to the template's default (pruning more than asked is the safer mistake)."""
    edits = context_management.get("edits") if isinstance(context_management, dict) else None
    for edit in edits if isinstance(edits, list) else ():
        kind = edit.get("type") if isinstance(edit, dict) else None
        if not isinstance(kind, str) or not kind.startswith("clear_thinking"):
            continue
        if edit.get("keep") == "all":
            return dict(_KEEP_ALL_THINKING)
        log.warning(
            "unsupported %r retention policy %r: the chat template's default applies (earlier reasoning is pruned)",
            kind,
            edit.get("keep"),
        )
    return {}


def _system_parts(system: str | list[TextBlock] | None) -> list[str]:
    if isinstance(system, str):
        return [system] if system else []
    parts = []
    for i, block in enumerate(system or ()):
        # only the first block, where the client puts it: a user's block that looks alike stays
        if i == 0 and block.text and _BILLING_BLOCK.fullmatch(block.text):
            continue
        if block.text:
            parts.append(block.text)
    return parts


def _messages(req: MessagesRequest) -> list[dict[str, Any]]:
    system = _system_parts(req.system)
    out: list[dict[str, Any]] = []
    leading = True
    for message in req.messages:
        if message.role == "system" and leading:
            if isinstance(message.content, str):
                system.append(message.content)
            else:
                system.extend(b.text for b in message.content if isinstance(b, TextBlock))
            continue
        leading = False
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        else:
            out.extend(_turn(message.role, message.content))
    if system:
        out.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return out


def _turn(role: str, blocks: list[ContentBlock]) -> list[dict[str, Any]]:
    """One message of content blocks as chat messages (a tool_result splits it). A block's class
    is its `type`: the request model picks the class by it (protocol.ContentBlock)."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []

    def flush() -> None:
        if parts:
            msg: dict[str, Any] = {"role": role, "content": list(parts)}
            if role == "assistant" and reasoning:
                msg["reasoning"] = "".join(reasoning)
                reasoning.clear()
            out.append(msg)
            parts.clear()

    for block in blocks:
        kind = block.type
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append(_image_part(block))
        elif isinstance(block, ToolUseBlock):
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": json.dumps(block.input)},
                }
            )
        elif isinstance(block, ToolResultBlock):
            flush()
            text = _tool_result_text(block.content)
            if block.is_error:
                text = f"Tool execution failed: {text}"
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        elif isinstance(block, ThinkingBlock):
            if role != "assistant":
                raise AnthropicRequestError("thinking content blocks are only valid in assistant messages")
            reasoning.append(block.thinking)
        elif kind == "redacted_thinking":
            raise AnthropicRequestError("redacted_thinking history is not supported by this server")
        else:  # refused, not dropped: a dropped block changes the prompt without the client knowing
            raise AnthropicRequestError(f"Anthropic content block type {kind!r} is not supported by this server")
    if calls and role == "assistant":
        others = sorted({p["type"] for p in parts if p["type"] != "text"})
        if others:
            raise AnthropicRequestError(
                f"assistant messages combining tool_use with {others} content are not supported by this server"
            )
        msg = {"role": "assistant", "content": "".join(p["text"] for p in parts) or None, "tool_calls": calls}
        if reasoning:
            msg["reasoning"] = "".join(reasoning)
        out.append(msg)
        return out
    if calls:
        raise AnthropicRequestError(f"tool_use content blocks are only valid in assistant messages, not {role!r}")
    flush()
    if role == "assistant" and reasoning:
        out.append({"role": "assistant", "content": None, "reasoning": "".join(reasoning)})
    return out


def _image_part(block: Any) -> dict[str, Any]:
    source = block.source
    if source.type == "url" and source.url:
        return {"type": "image_url", "image_url": {"url": source.url}}
    if source.type == "base64" and source.data:
        return {
            "type": "image_url",
            "image_url": {"url": f"data:{source.media_type or 'image/png'};base64,{source.data}"},
        }
    raise AnthropicRequestError(f"image block with source type {source.type!r} has no url or data")


def _tool_result_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        if block.type != "text":
            raise AnthropicRequestError(f"Content block type {block.type!r} inside tool_result is not supported")
        texts.append(block.text)
    return "\n".join(texts)


def _tools(req: MessagesRequest) -> list[dict[str, Any]] | None:
    """Client tools as chat tools. `tool_choice: none` keeps their definitions (the prompt's
    prefix stays the same) and drops server tools, which could never be called then."""
    if not req.tools:
        return None
    forbids_calls = req.tool_choice is not None and req.tool_choice.type == "none"
    tools = []
    for tool in req.tools:
        if tool.is_server_tool():
            if forbids_calls:
                continue
            raise AnthropicRequestError(
                f"Anthropic server tool {tool.name!r} (type={tool.type!r}) is not supported by this server"
            )
        if tool.input_schema is None:
            if tool.is_schema_client_tool():
                raise AnthropicRequestError(
                    f"Anthropic schema client tool {tool.name!r} (type={tool.type!r}) is recognized, but its "
                    "built-in input schema is not implemented by this server"
                )
            raise AnthropicRequestError(f"Client tool {tool.name!r} requires input_schema")
        function = {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.input_schema,
            "strict": tool.strict,
        }
        tools.append({"type": "function", "function": function})
    return tools or None


def _tool_choice(choice: ToolChoice | None, tools: list[dict[str, Any]] | None) -> str | None:
    if choice is None:
        return "auto" if tools else None
    if choice.disable_parallel_tool_use and choice.type != "none":
        raise AnthropicRequestError("tool_choice.disable_parallel_tool_use=true is not supported")
    if choice.type == "none":
        return "none"
    if tools is None:
        raise AnthropicRequestError(
            f"tool_choice type {choice.type!r} requires at least one client-executable tool; all provided tools "
            "were server tools or the tools list was empty"
        )
    if choice.type == "auto":
        return "auto"
    if choice.type == "any":
        raise AnthropicRequestError(
            "Anthropic tool_choice type 'any' is not supported because the chat pipeline cannot require an "
            "arbitrary tool call"
        )
    if not choice.name:
        raise AnthropicRequestError("tool_choice type 'tool' requires a 'name'")
    if choice.name not in {t["function"]["name"] for t in tools}:
        raise AnthropicRequestError(f"tool_choice names unknown tool {choice.name!r}")
    # a forced call comes without parsed arguments: refused here rather than a 500 later
    raise AnthropicRequestError(
        "Anthropic tool_choice type 'tool' is not supported because the chat pipeline emits a forced call "
        "without parsed arguments; "
        "use tool_choice 'auto' and describe the required tool in the prompt"
    )


# -- answer ---------------------------------------------------------------------------------


def stop_result(finish_reason: Any, stop_reason: Any) -> tuple[str, str | None]:
    """(Anthropic `stop_reason`, `stop_sequence`) for a chat choice's finish and stop reasons."""
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    if finish_reason is None:
        return "end_turn", None
    mapped = STOP_REASONS.get(finish_reason)
    if mapped is None:
        log.warning("unmapped finish_reason %r reported as end_turn", finish_reason)
        return "end_turn", None
    return mapped, None


def usage(chat_usage: Any) -> dict[str, int]:
    """Anthropic usage for a chat `usage`: cached prompt tokens are `cache_read_input_tokens`,
    the rest `input_tokens`."""
    if not isinstance(chat_usage, dict):
        return {"input_tokens": 0, "output_tokens": 0}
    prompt = chat_usage.get("prompt_tokens") or 0
    details = chat_usage.get("prompt_tokens_details")
    cached = (details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
    if cached > prompt:  # an executor's accounting error: clamped, but said
        log.warning("cached_tokens (%d) exceeds prompt_tokens (%d); reporting input_tokens=0", cached, prompt)
    out = {"input_tokens": max(prompt - cached, 0), "output_tokens": chat_usage.get("completion_tokens") or 0}
    if cached > 0:
        out["cache_read_input_tokens"] = cached
    return out


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def anthropic_message(answer: Any) -> dict[str, Any]:
    """The Anthropic message for a non-streaming chat answer. Raises `AnthropicResponseError`."""
    if not isinstance(answer, dict):
        raise AnthropicResponseError("the chat answer is not a JSON object")
    content: list[dict[str, Any]] = []
    stop, sequence = "end_turn", None
    choices = answer.get("choices")
    if isinstance(choices, list) and choices:
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message")
        if not isinstance(message, dict):
            message = {}
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            content.append(_tool_use_block(call))
        stop, sequence = stop_result(choice.get("finish_reason"), choice.get("stop_reason"))
    if stop != "max_tokens" and any(b["type"] == "tool_use" for b in content):
        # the client's tool loop runs only on stop_reason tool_use; a forced call's finish_reason
        # never says tool_calls (no tool parser ran)
        stop, sequence = "tool_use", None
    if not content:  # an Anthropic message has at least one block
        content.append({"type": "text", "text": ""})
    out: dict[str, Any] = {
        "id": new_message_id(),
        "type": "message",
        "role": "assistant",
        "model": answer.get("model"),
        "content": content,
        "stop_reason": stop,
    }
    if sequence is not None:
        out["stop_sequence"] = sequence
    out["usage"] = usage(answer.get("usage"))
    return out


def _tool_use_block(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    try:
        args = orjson.loads(function.get("arguments") or "")  # type: ignore[union-attr]  # None: AttributeError, caught
    except (orjson.JSONDecodeError, AttributeError, TypeError):
        args = None
    if not isinstance(args, dict):
        raise AnthropicResponseError(f"Tool call {name!r} arguments are not a valid JSON object")
    return {"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex}", "name": name, "input": args}
