"""Mooncake trace loading and token-id prompt synthesis.

Owns the request list a benchmark replays and the prompt each request sends. A trace line
carries no text, only `hash_ids` (one per 512-token block, equal ids meaning an equal prefix), so
each hash id is expanded into 512 token ids derived from the id and a seed alone: the same id
gives the same block in every request and every run, and requests that share a leading run of ids
share that prefix of their prompts. The last block is cut so the prompt is exactly
`input_length` tokens. The engine hashes these tokens at its own block size; 512 is only the
trace's unit. Knows nothing of HTTP or timing.
"""

from __future__ import annotations

import hashlib
import math
import struct
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NewType

import orjson

from shmdisagg.bench import BenchError

BLOCK_TOKENS = 512
DEFAULT_VOCAB = (1000, 32000)

HashId = NewType("HashId", int)
"""A trace block id: the identity of a prompt prefix up to and including one 512-token block."""

# The shipped 300-request slice (see data/README.md); present in a source checkout only.
SHIPPED_TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_conversation_300.jsonl"

_BLOCK_WORDS = struct.Struct(f"<{BLOCK_TOKENS}I")


class TraceError(BenchError, ValueError):
    """A trace file that cannot be replayed; carries the path and 1-based line number."""

    def __init__(self, path: str | Path, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = str(path)
        self.line = line


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request to send: arrival offset (ms), prompt length, output length, block ids."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[HashId, ...]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The first `limit` requests (all when None) of a Mooncake JSONL trace, validated."""
    requests: list[TraceRequest] = []
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            requests.append(_parse_line(path, line_no, line))
    return requests


def _parse_line(path: str | Path, line_no: int, line: bytes) -> TraceRequest:
    try:
        obj = orjson.loads(line)
        req = TraceRequest(
            timestamp_ms=float(obj["timestamp"]),
            input_length=int(obj["input_length"]),
            output_length=int(obj["output_length"]),
            hash_ids=tuple(HashId(int(h)) for h in obj["hash_ids"]),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise TraceError(path, line_no, f"not a Mooncake trace line ({exc!r})") from None
    if req.input_length < 1 or req.output_length < 1:
        raise TraceError(path, line_no, "input_length and output_length must be >= 1")
    need = math.ceil(req.input_length / BLOCK_TOKENS)
    if len(req.hash_ids) != need:
        raise TraceError(
            path,
            line_no,
            f"{len(req.hash_ids)} hash_ids for input_length {req.input_length} "
            f"(expected ceil({req.input_length}/{BLOCK_TOKENS}) = {need})",
        )
    return req


def synthetic_requests(count: int, input_len: int, output_len: int) -> list[TraceRequest]:
    """`count` requests of fixed lengths whose prompts share no block with each other or a trace.

    Their hash ids are negative (trace ids are not), one fresh id per block.
    """
    if count < 1 or input_len < 1 or output_len < 1:
        raise ValueError("count, input_len and output_len must be >= 1")
    blocks = math.ceil(input_len / BLOCK_TOKENS)
    return [
        TraceRequest(
            timestamp_ms=0.0,
            input_length=input_len,
            output_length=output_len,
            hash_ids=tuple(HashId(-(1 + i * blocks + j)) for j in range(blocks)),
        )
        for i in range(count)
    ]


class RunPrefixes:
    """What a run's own earlier requests can have left in a prefix cache: the hash ids sent so
    far. A trace id names a whole prefix (equal ids, equal prompts up to and through that block;
    `PromptSynthesizer` expands each id alone, so different ids never share a block's tokens),
    so a request can find cached at most its leading run of ids already sent."""

    def __init__(self) -> None:
        self._sent: set[int] = set()

    def reusable(self, req: TraceRequest) -> int:
        """Prompt tokens of `req` that earlier requests of this run share (its leading block ids
        already sent, in 512-token blocks, capped at its length), an upper bound on the cached
        tokens a cache holding nothing from before the run can report; then records its ids."""
        shared = 0
        for hash_id in req.hash_ids:
            if hash_id not in self._sent:
                break
            shared += 1
        self._sent.update(req.hash_ids)
        return min(shared * BLOCK_TOKENS, req.input_length)


class PromptSynthesizer:
    """Expands hash ids into token-id blocks; deterministic in (seed, hash id, vocab range).

    State: `_blocks` is a small LRU of expanded blocks (`array('i')`, 2 KiB each) so that a hot
    id such as the conversation trace's shared block 0 is expanded once.
    """

    def __init__(
        self,
        seed: int = 0,
        vocab: tuple[int, int] = DEFAULT_VOCAB,
        cache_blocks: int = 4096,
    ) -> None:
        low, high = vocab
        if not 0 <= low < high <= 2**31:  # token ids are int32 here, as the executors take them
            raise ValueError(f"vocab range must satisfy 0 <= low < high <= 2**31, got [{low}, {high})")
        self.seed = seed
        self.low = low
        self.span = high - low
        self._cache_blocks = cache_blocks
        self._blocks: OrderedDict[int, array[int]] = OrderedDict()

    def block(self, hash_id: int) -> array[int]:
        """The 512 token ids of one block (a shared cached array: do not modify)."""
        cached = self._blocks.get(hash_id)
        if cached is not None:
            self._blocks.move_to_end(hash_id)
            return cached
        # SHAKE-128 gives a stable, platform-independent stream per (seed, id); modulo bias over
        # 2**32 is far below anything an engine could notice.
        digest = hashlib.shake_128(b"%d:%d" % (self.seed, hash_id)).digest(_BLOCK_WORDS.size)
        low, span = self.low, self.span
        tokens = array("i", [low + word % span for word in _BLOCK_WORDS.unpack(digest)])
        self._blocks[hash_id] = tokens
        if len(self._blocks) > self._cache_blocks:
            self._blocks.popitem(last=False)
        return tokens

    def prompt(self, hash_ids: Sequence[int], input_length: int) -> list[int]:
        """Token ids for a request: its blocks in order, cut to exactly `input_length` tokens."""
        if not 0 < input_length <= len(hash_ids) * BLOCK_TOKENS:
            raise ValueError(f"input_length {input_length} does not fit {len(hash_ids)} blocks of {BLOCK_TOKENS}")
        out = array("i")
        for hash_id in hash_ids:
            out.extend(self.block(hash_id))
        del out[input_length:]
        return out.tolist()

    def prompts(self, requests: Iterable[TraceRequest]) -> list[list[int]]:
        return [self.prompt(r.hash_ids, r.input_length) for r in requests]
