"""Comparing what a client gets through shmdisagg with what the worker answers directly.

The fake engine is deterministic (its tokens are a function of the prompt ids), so a
disaggregated answer must equal the plain one field for field, except the fields a server makes
up per request (`id`, `created`). Streams are compared by what a client assembles from them
(each choice's concatenated text and logprobs, its finish and stop reasons, the usage chunk) and
by the set of chunk shapes (field names and JSON types), since where a worker cuts its chunks
depends on timing.

Internal fields (TensorRT-LLM's orchestrator contract, the lead's rule): the keys a plain worker
answer carries for disaggregation (`choices[].disaggregated_params`, `prompt_token_ids`,
`prompt_token_ids_b64`) are `null`, as in the direct answer; no other internal key, and no
executor address, appears anywhere in a body, a header or an SSE event.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import orjson

from tests.conformance.workers import Answer

PER_REQUEST = ("id", "created")  # made up by whoever answers; only their types are compared
NULL_KEYS = frozenset({"disaggregated_params", "prompt_token_ids", "prompt_token_ids_b64"})
INTERNAL_KEYS = frozenset(
    {
        "kv_transfer_params",
        "ctx_request_id",
        "disagg_request_id",
        "encoded_opaque_state",
        "opaque_state",
        "ctx_info_endpoint",
        "first_gen_tokens",
        "first_gen_log_probs",
        "first_gen_logits",
        "ctx_usage",
        "ctx_dp_rank",
        "schedule_style",
        "request_type",
        "draft_tokens",
        "return_prompt_token_ids_b64",
    }
)
# base64 of the fake context worker's opaque state magic (b"TRTLLM-FAKE-KV1"): its KV handle
OPAQUE_B64 = b"VFJUTExNLUZBS0UtS1Yx"


def leaks(answer: Answer, executor_addrs: Iterable[str]) -> list[str]:
    """Every internal field or executor address in `answer` (body, headers, each SSE event)."""
    found: list[str] = []
    text = answer.raw + b"\n" + b"\n".join(f"{k}: {v}".encode() for k, v in answer.headers.items())
    for addr in executor_addrs:
        port = addr.rsplit(":", 1)[1]
        for spelled in (addr, f"localhost:{port}"):
            if spelled.encode() in text:
                found.append(f"executor address {spelled!r}")
    for marker in (b"fake-transceiver", OPAQUE_B64):
        if marker in text:
            found.append(f"executor handle {marker.decode()!r}")
    docs = (
        answer.chunks
        if answer.headers.get("content-type", "").startswith("text/event-stream")
        else [_maybe_json(answer.raw)]
    )
    for doc in docs:
        found.extend(_internal_keys(doc, "$"))
    return sorted(set(found))


def _maybe_json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _internal_keys(value: Any, path: str) -> list[str]:
    out = []
    if isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}"
            if k in INTERNAL_KEYS:
                out.append(f"internal field {where}")
            elif k in NULL_KEYS and v is not None:
                out.append(f"{where} is not null: {orjson.dumps(v).decode()[:120]}")
            else:
                out.extend(_internal_keys(v, where))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.extend(_internal_keys(v, f"{path}[{i}]"))
    return out


def shape(value: Any, key: str = "") -> Any:
    """Field names and JSON types of `value`; a list's shape is the set of its elements' shapes.
    A completion's `top_logprobs` entries map tokens to numbers: their keys are data, not fields."""
    if isinstance(value, dict):
        if key == "top_logprobs" and "token" not in value:
            return {"<token>": orjson.loads(_one_shape(value.values()))} if value else {}
        return {k: shape(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return sorted({orjson.dumps(shape(v, key), option=orjson.OPT_SORT_KEYS).decode() for v in value})
    if value is None:
        return "null"
    return type(value).__name__


def _one_shape(values: Any) -> str:
    """The shape shared by `values` (JSON text), or all of their shapes when they differ."""
    shapes = sorted({orjson.dumps(shape(v), option=orjson.OPT_SORT_KEYS).decode() for v in values})
    return shapes[0] if len(shapes) == 1 else orjson.dumps(shapes).decode()


def diff(direct: Any, via: Any, path: str = "$") -> list[str]:
    """Paths where `via` differs from `direct` (missing or extra keys, other types or values)."""
    if isinstance(direct, dict) and isinstance(via, dict):
        out = []
        for k in direct.keys() | via.keys():
            where = f"{path}.{k}"
            if k not in via:
                out.append(f"{where}: missing (direct: {_short(direct[k])})")
            elif k not in direct:
                out.append(f"{where}: extra field (via shmdisagg: {_short(via[k])})")
            else:
                out.extend(diff(direct[k], via[k], where))
        return out
    if isinstance(direct, list) and isinstance(via, list):
        if len(direct) != len(via):
            return [f"{path}: {len(via)} elements, direct {len(direct)} (direct {_short(direct)}, via {_short(via)})"]
        return [d for i, (a, b) in enumerate(zip(direct, via, strict=True)) for d in diff(a, b, f"{path}[{i}]")]
    if type(direct) is not type(via) or direct != via:
        return [f"{path}: via shmdisagg {_short(via)}, direct {_short(direct)}"]
    return []


def _short(value: Any, limit: int = 160) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= limit else text[:limit] + "..."


def _without_per_request(doc: Any) -> Any:
    """`doc` with per-request values replaced by their type (so only presence and type count):
    the answer's own, and each tool call's random `id` (`chatcmpl-tool-<uuid>`)."""
    if not isinstance(doc, dict):
        return doc
    out = {k: (shape(v) if k in PER_REQUEST else v) for k, v in copy.deepcopy(doc).items()}
    for choice in out.get("choices") or ():
        calls = (choice.get("message") or {}).get("tool_calls") if isinstance(choice, dict) else None
        for call in calls if isinstance(calls, list) else ():
            if isinstance(call, dict) and "id" in call:
                call["id"] = shape(call["id"])
    return out


def body_diff(direct: Any, via: Any) -> list[str]:
    """Differences of two non-streaming answers (`id`/`created` by type only)."""
    return diff(_without_per_request(direct), _without_per_request(via))


def assembled(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client assembles from a stream: per choice index its role, text, logprobs, finish
    and stop reasons; the usage chunks; the chunk objects; and the set of chunk shapes."""
    choices: dict[int, dict[str, Any]] = {}
    usage = []
    for chunk in chunks:
        if chunk.get("usage") is not None:
            usage.append(chunk["usage"])
        for c in chunk.get("choices") or ():
            a = choices.setdefault(
                c.get("index", 0), {"role": [], "text": "", "logprobs": [], "finish_reason": None, "stop_reason": None}
            )
            delta = c.get("delta")
            if isinstance(delta, dict):  # chat
                if "role" in delta:
                    a["role"].append(delta["role"])
                a["text"] += delta.get("content") or ""
                lp = c.get("logprobs")
                a["logprobs"].extend((lp or {}).get("content") or [])
            else:
                a["text"] += c.get("text") or ""
                lp = c.get("logprobs")
                if lp:
                    a["logprobs"].append({k: lp.get(k) for k in ("tokens", "token_logprobs", "top_logprobs")})
            if c.get("finish_reason") is not None:
                a["finish_reason"] = c["finish_reason"]
            if c.get("stop_reason") is not None:
                a["stop_reason"] = c["stop_reason"]
    for a in choices.values():  # completions: logprobs as one list per field, however chunked
        if a["logprobs"] and "tokens" in a["logprobs"][0]:
            a["logprobs"] = {
                k: [x for part in a["logprobs"] for x in part[k] or ()]
                for k in ("tokens", "token_logprobs", "top_logprobs")
            }
    return {
        "choices": {str(i): a for i, a in sorted(choices.items())},
        "usage": usage,
        "objects": sorted({c.get("object") for c in chunks}),
        "chunk_shapes": shape(chunks),
    }


def fields(shape_: Any, prefix: str = "") -> set[str]:
    """A shape flattened to `path: type` lines (list elements under `path[]`)."""
    if isinstance(shape_, dict):
        return {f for k, v in shape_.items() for f in fields(v, f"{prefix}.{k}" if prefix else k)}
    if isinstance(shape_, list):
        return {f for element in shape_ for f in fields(orjson.loads(element), f"{prefix}[]")} or {f"{prefix}[]: empty"}
    return {f"{prefix}: {shape_}"}


def chunk_shape_diff(direct: list[dict[str, Any]], via: list[dict[str, Any]]) -> list[str]:
    """Each kind of chunk one stream has and the other lacks, as the fields it has or lacks
    against the closest chunk of the other stream."""
    kinds = {
        name: {orjson.dumps(shape(c), option=orjson.OPT_SORT_KEYS): fields(shape(c)) for c in chunks}
        for name, chunks in (("direct", direct), ("via", via))
    }
    out = []
    for name, other in (("via", "direct"), ("direct", "via")):
        for key, f in kinds[name].items():
            if key in kinds[other]:
                continue
            closest = max(kinds[other].values(), key=lambda g: len(f & g), default=set())
            lacks, extra = sorted(closest - f), sorted(f - closest)
            who, them = ("via shmdisagg", "direct") if name == "via" else ("direct", "via shmdisagg")
            out.append(
                f"a {who} chunk kind that {them} never sends; against the closest {them} chunk it lacks {lacks} "
                f"and adds {extra}"
            )
    return out


def stream_diff(direct: Answer, via: Answer) -> list[str]:
    """Differences of two SSE answers, as a client sees them."""
    out = []
    for name, a in (("direct", direct), ("via shmdisagg", via)):
        if not a.events or a.events[-1] != b"[DONE]":
            out.append(f"{name}: the stream does not end with data: [DONE]")
    mine, theirs = assembled(direct.chunks), assembled(via.chunks)
    del mine["chunk_shapes"], theirs["chunk_shapes"]
    return out + diff(mine, theirs) + chunk_shape_diff(direct.chunks, via.chunks)


def answer_diff(direct: Answer, via: Answer) -> list[str]:
    """Status, content type and body differences (stream or not) of two answers."""
    out = []
    if via.status != direct.status:
        out.append(f"status: via shmdisagg {via.status}, direct {direct.status} (via body {via.raw[:300]!r})")
        return out
    ctype = [a.headers.get("content-type", "") for a in (direct, via)]
    if ctype[0] != ctype[1]:  # charset included: a client may read it
        out.append(f"content-type: via shmdisagg {ctype[1]!r}, direct {ctype[0]!r}")
        return out
    if ctype[0].split(";")[0] == "text/event-stream":
        return out + stream_diff(direct, via)
    return out + body_diff(direct.json, via.json)
