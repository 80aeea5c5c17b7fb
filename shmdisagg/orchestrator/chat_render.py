"""A chat request rendered into prompt text exactly as `trtllm-serve`'s chat route renders it.

The worker (TensorRT-LLM, NVIDIA/TensorRT-LLM) turns a chat into ids in three steps, each
re-implemented here (never copied):

1. **Messages to a conversation** (`serve/chat_utils.py` `parse_chat_messages_coroutines` @0c351902,
   text path): each message becomes `{"role", "content", "media": []}`; `content` is the message's
   text parts joined with "\\n" (a string is one text part; empty parts and `None` are dropped);
   an assistant message keeps `reasoning_content` (from `reasoning`, else `reasoning_content`)
   and `tool_calls` with each `function.arguments` JSON string parsed into an object (an
   unparseable string is kept as it is; a non-object is refused); a tool message keeps
   `tool_call_id`; a system message keeps its `tools`. Every other message field is dropped.
2. **The template** (`inputs/utils.py` `apply_chat_template` @00a8667c, called from
   `serve/openai_server.py` @fb31828e and `serve/render/chat.py` `render_chat` @00fd87cf): the
   request's `chat_template` (TensorRT-LLM: `request.chat_template or` the server's
   `--chat_template`), else `tokenizer.get_chat_template(None, tools=...)`; then
   `tokenizer.apply_chat_template(conversation=..., tokenize=False, return_dict=False,
   add_generation_prompt=..., tools=[tool.model_dump() ...], documents=...,
   chat_template=..., **chat_template_kwargs)`. `tool.model_dump()` of `ChatCompletionToolsParam`
   (`serve/openai_protocol.py` @0076e939) is `{"type": "function", "function": {"name",
   "description", "parameters", "strict"}}` with absent fields as `None`.
3. **Text to ids** (`inputs/tokenization.py` `tokenize_prompt` @7b966b41, the engine's
   `DefaultInputProcessor`): `tokenizer.encode(text, add_special_tokens=request.add_special_tokens)`,
   false by default for chats (`ChatCompletionRequest.add_special_tokens`). `tokenization.py` does it.

Whatever this module cannot render exactly as the worker would raises `Unrenderable`: media
parts (TensorRT-LLM's own router refuses them too, `render/chat.py` `_has_media`), part types
and request shapes the worker's validation refuses, a missing chat template, a template that
fails. Such a chat is routed on an estimate and sent as it came, so the worker renders it and
answers any error itself, in its own words.
"""

from __future__ import annotations

import json
from typing import Any

# TensorRT-LLM's VALID_MESSAGE_CONTENT_MM_PART_TYPES (chat_utils.py) less "text", with the key
# that holds each one's payload (a part whose payload is missing is skipped, as upstream does).
MEDIA_PARTS = {
    "image_url": ("image_url", "url"),
    "video_url": ("video_url", "url"),
    "audio_url": ("audio_url", "url"),
    "input_audio": ("input_audio", None),
    "image_embeds": ("image_embeds", "data"),
}
# Model types whose TensorRT-LLM serving extension rewrites a chat before rendering
# (`serve/extensions/__init__.py` @8a99ce38: gpt_oss, kimi_k3); ids rendered without it are estimates.
EXTENSION_MODEL_TYPES = frozenset({"gpt_oss", "kimi_k3"})
_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")


class Unrenderable(Exception):
    """This chat cannot be rendered here exactly as the worker would (see the module docstring)."""


def conversation(messages: list[Any]) -> list[dict[str, Any]]:
    """The conversation TensorRT-LLM's chat route builds from `messages` (step 1). Raises
    `Unrenderable`."""
    return [_message(m) for m in messages]


def _message(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise Unrenderable("a message is not an object")
    role = message.get("role")
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content")), "media": []}
    if role == "assistant":
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if message.get("tool_calls") is not None:
            out["tool_calls"] = _tool_calls(message["tool_calls"])
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
    elif role == "system" and message.get("tools") is not None:
        out["tools"] = message["tools"]
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Unrenderable("message content is neither a string nor a list of parts")
    texts = []
    for part in content:
        text = part if isinstance(part, str) else _part_text(part)
        if text:  # upstream keeps only non-empty parse results
            texts.append(text)
    return "\n".join(texts)


def _part_text(part: Any) -> str | None:
    if not isinstance(part, dict):
        raise Unrenderable("a content part is not an object")
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if text is not None and not isinstance(text, str):
            raise Unrenderable("a text part's text is not a string")
        return text
    media = MEDIA_PARTS.get(kind) if isinstance(kind, str) else None
    if media is None:
        raise Unrenderable(f"content part type {kind!r}")  # the worker refuses it
    field, key = media
    payload = part.get(field)
    if key is not None:
        payload = payload.get(key) if isinstance(payload, dict) else None
    if payload is None:
        return None  # an empty media part: skipped upstream
    raise Unrenderable(f"a {kind} part (media)")


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise Unrenderable("tool_calls is not a list")
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise Unrenderable("a tool call without a function object")
        item = dict(call)
        function = item["function"] = dict(call["function"])
        arguments = function.get("arguments")
        if arguments is None:
            function["arguments"] = {}
        elif isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                out.append(item)  # kept verbatim, as upstream does
                continue
            if not isinstance(parsed, dict):
                raise Unrenderable("tool call arguments are not a JSON object")
            function["arguments"] = parsed
        elif not isinstance(arguments, dict):
            raise Unrenderable("tool call arguments are not an object")
        out.append(item)
    return out


def tool_dicts(tools: Any) -> list[dict[str, Any]] | None:
    """`[tool.model_dump() for tool in request.tools]` (step 2). Raises `Unrenderable` for a tool
    the worker's validation refuses."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise Unrenderable("tools is not a list")
    out = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(function, dict)
            or tool.get("type", "function") != "function"
            or set(tool) - {"type", "function"}
            or set(function) - set(_FUNCTION_FIELDS)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("description"), (str, type(None)))
            or not isinstance(function.get("parameters"), (dict, type(None)))
            or not isinstance(function.get("strict"), (bool, type(None)))
        ):
            raise Unrenderable("a tool the worker's request model refuses")
        out.append({"type": "function", "function": {k: function.get(k) for k in _FUNCTION_FIELDS}})
    return out


def _flag(req: dict[str, Any], key: str, default: bool) -> bool:
    value = req.get(key, default)
    if not isinstance(value, bool):
        raise Unrenderable(f"{key} is not true or false")
    return value


def render(tokenizer: Any, req: dict[str, Any]) -> str:
    """The prompt text the worker renders for the chat request `req` with the Hugging Face
    `tokenizer` (steps 1 and 2). Raises `Unrenderable`."""
    if "continue_final_message" in req:
        raise Unrenderable("continue_final_message is not a field of TensorRT-LLM's chat request")
    conv = conversation(req["messages"])
    tools = tool_dicts(req.get("tools"))
    kwargs = req.get("chat_template_kwargs") or {}
    documents = req.get("documents")
    template = req.get("chat_template")
    if (
        not isinstance(kwargs, dict)
        or not isinstance(documents, (list, type(None)))
        or not isinstance(template, (str, type(None)))
    ):
        raise Unrenderable("chat_template_kwargs, documents or chat_template of the wrong type")
    add_generation_prompt = _flag(req, "add_generation_prompt", True)
    try:
        template = template or tokenizer.get_chat_template(None, tools=tools)
        text = tokenizer.apply_chat_template(
            conversation=conv,
            tokenize=False,
            return_dict=False,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            chat_template=template,
            **kwargs,
        )
    except Exception as err:  # the worker answers this chat with its own 400
        raise Unrenderable(f"the chat template failed: {err}") from None
    if not isinstance(text, str):
        raise Unrenderable("the chat template did not render text")
    return text


def add_special_tokens(req: dict[str, Any]) -> bool:
    """A chat's `add_special_tokens` (TensorRT-LLM's default for chats: false). Raises `Unrenderable`."""
    return _flag(req, "add_special_tokens", False)
