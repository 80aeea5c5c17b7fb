"""Token-id arrays relayed as the bytes they came in, not decoded and encoded again.

A disaggregated request carries the prompt's token ids up to three times: the client's token-id
prompt goes into the context leg, and the context executor's answer carries `prompt_token_ids`,
which go into the generation leg (`prompt` of a completion, `prompt_token_ids` of a chat;
TensorRT-LLM's `_get_gen_request`, tensorrt_llm/serve/openai_disagg_service.py). Decoded, a
128k-token array is 128k Python ints; encoding it again walks them once more, and the cost grows
with the prompt while nothing reads them (BENCHMARKS.md, "prompt length"). So the fleet finds the
array's bytes (`_native.json_member`, one pass), and the leg's body gets them as they are:

- `cut(raw, key)`: a JSON object document with one top-level array member taken out (its value
  replaced by `null`, so the rest decodes cheaply) and that array's bytes;
- `Raw(data)`: a request field whose JSON value is `data`, written into the body as it is by
  `dumps` (`wire.Wire.body`): a piece of the leg's body, sent from the buffer it arrived in;
- `cut_token_ids(raw, key)`: as `cut`, for an array of token ids, read as it is found
  (`_native.json_token_ids`): a `TokenIds`, the client's token-id prompt as the request holds it,
  never a list of Python ints (BENCHMARKS.md, "Token-id prompts without Python ints").

The cuts apply only to bodies of `MIN_BYTES` or more (below, decoding is cheaper than the walk)
and only to a value the walk found whole and that is an array (of token ids, for
`cut_token_ids`); anything else takes the decoded path, so a body is never sent other than a
decoder would write it, only faster.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import orjson

from shmdisagg._native import json_member, json_token_ids

MIN_BYTES = 4096
# A leg whose Raw values hold fewer bytes than this is joined into one buffer: below it a join
# costs less than uvloop's vectored write (`dumps`; BENCHMARKS.md, "Legs written as pieces").
PIECES_MIN_BYTES = 32 << 10
# The request fields that may hold a Raw value: what `Wire.body` looks for.
RAW_FIELDS = ("prompt", "prompt_token_ids")


class Raw:
    """A JSON value kept as its bytes (`data`: a complete JSON array)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = data

    @property
    def empty(self) -> bool:
        """The array has no element."""
        data, i = self.data, 1
        while i < len(data) and data[i] in b" \t\r\n":
            i += 1
        return data[i : i + 1] == b"]"

    def value(self) -> Any:
        """The decoded value (for an encoding that cannot take JSON bytes: msgpack)."""
        return orjson.loads(self.data)


class TokenIds(Raw, Sequence[int]):
    """A token-id prompt kept as its JSON bytes (`data`, a view of the request body) and its ids
    as native int32 (`ids32`, what the block hashes read): a non-empty sequence of ints in
    [0, 2**31) that is relayed as those bytes, as `Raw` is. Reading items goes through an int32
    view; nothing on the request path does more than count them."""

    __slots__ = ("ids32", "view")

    def __init__(self, data: bytes | memoryview, ids32: bytes) -> None:
        super().__init__(data)
        self.ids32 = ids32
        self.view = memoryview(ids32).cast("i")

    @property
    def empty(self) -> bool:
        return False  # json_token_ids reads non-empty arrays only

    def __len__(self) -> int:
        return len(self.view)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        return self.view[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.view)


def _array_span(raw: bytes, key: bytes) -> tuple[int, int] | None:
    if len(raw) < MIN_BYTES:
        return None
    span = json_member(raw, key)
    if span is None or raw[span[0] : span[0] + 1] != b"[":
        return None
    return span


def cut(raw: bytes, key: bytes) -> tuple[bytes, Raw | None]:
    """`raw` with the array value of its top-level member `key` replaced by `null`, and that
    array (a view of `raw`); (`raw`, None) when `raw` is under `MIN_BYTES` or the member is not
    an array the walk found whole."""
    span = _array_span(raw, key)
    if span is None:
        return raw, None
    start, end = span
    return _nulled(raw, start, end), Raw(memoryview(raw)[start:end])


def cut_token_ids(raw: bytes, key: bytes) -> tuple[bytes, TokenIds] | None:
    """`raw` with its top-level member `key` replaced by `null`, and that member as `TokenIds`,
    when `raw` is at least `MIN_BYTES` and the member is a non-empty array of ints in [0, 2**31);
    else None (the caller decodes `raw` as it is, and refuses or accepts it as before)."""
    if len(raw) < MIN_BYTES or type(raw) is not bytes:  # the native walk reads bytes objects only
        return None
    found = json_token_ids(raw, key)
    if found is None:
        return None
    start, end, ids32 = found
    return _nulled(raw, start, end), TokenIds(memoryview(raw)[start:end], ids32)


def _nulled(raw: bytes, start: int, end: int) -> bytes:
    """`raw` with the value at [start, end) replaced by `null`."""
    return raw[:start] + b"null" + raw[end:]


def dumps(req: dict[str, Any]) -> bytes | list[bytes | memoryview]:
    """`orjson.dumps(req)`, with each `Raw` value among `RAW_FIELDS` written as its bytes (those
    members come last; JSON objects are unordered). From `PIECES_MIN_BYTES` of them on, the
    document's pieces in order, each `Raw` value's bytes one piece, as a view of the body they
    came in, never copied (the leg goes out in one vectored write, `upstream.pool.Body`)."""
    raws = [(key, value) for key in RAW_FIELDS if isinstance(value := req.get(key), Raw)]
    if not raws:
        return orjson.dumps(req)
    rest = {k: v for k, v in req.items() if not isinstance(v, Raw)}
    head = orjson.dumps(rest)[:-1]
    parts: list[bytes | memoryview] = []
    for i, (key, value) in enumerate(raws):
        sep = b"," if i or len(head) > 1 else b""
        parts += ((head if i == 0 else b"") + sep + b'"' + key.encode() + b'":', value.data)
    parts.append(b"}")
    if sum(len(value.data) for _, value in raws) < PIECES_MIN_BYTES:
        return b"".join(parts)
    return parts


def decoded(req: dict[str, Any]) -> dict[str, Any]:
    """`req` with each `Raw` value among `RAW_FIELDS` decoded (a copy if there is one)."""
    if not any(isinstance(req.get(key), Raw) for key in RAW_FIELDS):
        return req
    return {k: (v.value() if isinstance(v, Raw) else v) for k, v in req.items()}
