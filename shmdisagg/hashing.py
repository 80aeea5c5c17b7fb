"""KV-cache block hashing, identical to TensorRT-LLM's `v1_block_key`.

The algorithm follows TensorRT-LLM `tensorrt_llm/runtime/kv_cache_hash.py` (`hash_v1_block_key`)
and the C++ `BlockKeyHasher` (`cpp/tensorrt_llm/batch_manager/blockKey.cpp`): a block's hash is
seeded from its token count and its parent's hash, then every token id is mixed in with a 32-bit
integer mix; an optional salt id is mixed into the first block only. Hashes are unsigned 64-bit.

Block boundaries follow TensorRT-LLM's KvCacheManager: the prompt's **last token is excluded**,
blocks are ``tokens[t : min(t + tokens_per_block, len - 1)]`` and a final partial block is kept.

The `v2_sha256` / `v2_sha256_64` variants follow KV cache manager V2
(`kv_cache_manager_v2` `sequence_to_blockchain_keys`): a root key SHA-256(reuse scope bytes), then
SHA-256(parent key || the block's tokens as u32 little-endian) per block, the root not emitted;
`v2_sha256_64` keeps a key's first 8 bytes read big-endian. Releases before the 4-byte
`TokenIdExt` layout hashed tokens as u64 (`token_bytes=8`).

Which one a role hashes with is what its executors report in `/server_info.kv_cache_hash_algo`
(`KV_CACHE_HASH_ALGOS`; `block_hashes_for`); KV events carry v1 and v2_sha256_64 keys as ints
and v2_sha256 keys as hex, all reduced to the index's u64 by `event_block_hash`.

The `*_py` functions are the pure-Python references (tests only). `block_hashes`,
`block_hashes_bytes` and the v2 functions call the native extension (`shmdisagg._native`,
native/hash.c). The hot path is `block_hashes_bytes`: packed little-endian u64 per block, the
format every native index call takes, with no list of Python ints in between.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence

from shmdisagg import _native

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
_HASH32 = 0x45D9F3B
_HASH64_1 = 0xBF58476D1CE4E5B9
_HASH64_2 = 0x94D049BB133111EB
_COMBINE = 0x9E3779B9
_PARENT = 0xBF58476D1CE4E5B9


def _mix32(value: int, seed: int) -> int:
    value &= _U32
    value = (((value >> 16) ^ value) * _HASH32) & _U32
    value = (((value >> 16) ^ value) * _HASH32) & _U32
    value = ((value >> 16) ^ value) & _U32
    value = (value + _COMBINE) & _U32  # wraps to uint32 in C++ before the size_t terms are added
    return (seed ^ ((value + ((seed << 6) & _U64) + (seed >> 2)) & _U64)) & _U64


def _mix64(value: int, seed: int) -> int:
    value &= _U64
    value = ((value ^ (value >> 30)) * _HASH64_1) & _U64
    value = ((value ^ (value >> 27)) * _HASH64_2) & _U64
    value ^= value >> 31
    return (seed ^ ((value + _COMBINE + ((seed << 6) & _U64) + (seed >> 2)) & _U64)) & _U64


def v1_block_key(tokens: Sequence[int], parent_hash: int = 0, salt_id: int | None = None) -> int:
    """Hash of one block of token ids chained on ``parent_hash`` (0 for the first block).

    Returns an unsigned 64-bit int. ``salt_id`` (see `cache_salt_id`) is mixed in only when
    ``parent_hash == 0``, as TensorRT-LLM does.
    """
    seed = (len(tokens) ^ ((parent_hash * _PARENT) & _U64)) & _U64
    if parent_hash == 0 and salt_id is not None:
        seed = _mix64(salt_id, seed)
    for token in tokens:
        seed = _mix32(token, seed)
    return seed


def cache_salt_id(cache_salt: str) -> int:
    """Salt id of a request's ``cache_salt``: the first 8 bytes of its SHA-256, little-endian.

    Source: TensorRT-LLM `get_cache_salt_id`. (C++ v1 workers mix `std::hash` of the salt instead,
    which cannot be reproduced; salted v1 hashes match KV cache manager V2 workers only.)
    """
    return int.from_bytes(hashlib.sha256(cache_salt.encode()).digest()[:8], "little")


def block_hashes_py(tokens: Sequence[int], tokens_per_block: int, salt_id: int | None = None) -> list[int]:
    """Chained v1 hashes of a prompt's blocks (last token excluded, final partial block kept)."""
    if tokens_per_block <= 0:
        raise ValueError("tokens_per_block must be positive")
    usable = len(tokens) - 1
    out: list[int] = []
    parent = 0
    for start in range(0, max(usable, 0), tokens_per_block):
        parent = v1_block_key(tokens[start : min(start + tokens_per_block, usable)], parent, salt_id)
        out.append(parent)
    return out


def block_hashes(tokens: Sequence[int], tokens_per_block: int, salt_id: int | None = None) -> list[int]:
    """Same as `block_hashes_py`, computed natively. `tokens`: a list of ints or a buffer of
    int32/int64 (array, numpy)."""
    raw = _native.block_hashes_v1(tokens, tokens_per_block, salt_id)
    return list(struct.unpack(f"<{len(raw) // 8}Q", raw))


def block_hashes_bytes(tokens: Sequence[int], tokens_per_block: int, salt_id: int | None = None) -> bytes:
    """The v1 block hashes packed as little-endian u64, for the native index calls (hot path)."""
    return _native.block_hashes_v1(tokens, tokens_per_block, salt_id)


def _reuse_scope_bytes(salt_id: int | None, lora_id: int | None) -> bytes:
    """KV cache manager V2's ReuseScope(lora_id, salt) bytes: a presence mask byte, then one u64
    little-endian per present field."""
    fields = (lora_id, salt_id)
    mask = sum((v is not None) << i for i, v in enumerate(fields))
    return bytes([mask]) + b"".join(v.to_bytes(8, "little") for v in fields if v is not None)


def block_keys_v2_py(
    tokens: Sequence[int],
    tokens_per_block: int,
    salt_id: int | None = None,
    lora_id: int | None = None,
    token_bytes: int = 4,
) -> list[bytes]:
    """Reference v2_sha256 keys (32 bytes each) of a prompt's blocks, last token excluded."""
    if tokens_per_block <= 0:
        raise ValueError("tokens_per_block must be positive")
    key = hashlib.sha256(_reuse_scope_bytes(salt_id, lora_id)).digest()
    usable = list(tokens[: max(len(tokens) - 1, 0)])
    out = []
    for start in range(0, len(usable), tokens_per_block):
        block = usable[start : start + tokens_per_block]
        key = hashlib.sha256(key + b"".join(t.to_bytes(token_bytes, "little") for t in block)).digest()
        out.append(key)
    return out


def block_hashes_v2_64_py(
    tokens: Sequence[int],
    tokens_per_block: int,
    salt_id: int | None = None,
    lora_id: int | None = None,
    token_bytes: int = 4,
) -> list[int]:
    """Reference v2_sha256_64 hashes: each v2 key's first 8 bytes as a big-endian integer."""
    return [
        int.from_bytes(k[:8], "big") for k in block_keys_v2_py(tokens, tokens_per_block, salt_id, lora_id, token_bytes)
    ]


def block_keys_v2(
    tokens: Sequence[int],
    tokens_per_block: int,
    salt_id: int | None = None,
    lora_id: int | None = None,
    token_bytes: int = 4,
) -> list[bytes]:
    """v2_sha256 keys (32 bytes each; TensorRT-LLM reports them as `key.hex()`), computed natively."""
    raw = _native.block_hashes_v2(tokens, tokens_per_block, salt_id, lora_id, token_bytes)
    return [raw[i : i + 32] for i in range(0, len(raw), 32)]


def block_hashes_v2_64_bytes(
    tokens: Sequence[int],
    tokens_per_block: int,
    salt_id: int | None = None,
    lora_id: int | None = None,
    token_bytes: int = 4,
) -> bytes:
    """v2_sha256_64 hashes packed as little-endian u64 (the index format), computed natively."""
    return _native.block_hashes_v2_64(tokens, tokens_per_block, salt_id, lora_id, token_bytes)


def block_hashes_v2_64(
    tokens: Sequence[int],
    tokens_per_block: int,
    salt_id: int | None = None,
    lora_id: int | None = None,
    token_bytes: int = 4,
) -> list[int]:
    """v2_sha256_64 hashes as ints, computed natively."""
    raw = block_hashes_v2_64_bytes(tokens, tokens_per_block, salt_id, lora_id, token_bytes)
    return list(struct.unpack(f"<{len(raw) // 8}Q", raw))


def v2_key_to_u64(key: bytes | str) -> int:
    """Fold a v2_sha256 key (32 bytes, or its hex as reported in KV events) to the index's u64,
    as v2_sha256_64 does: the first 8 bytes read big-endian."""
    raw = bytes.fromhex(key) if isinstance(key, str) else key
    return int.from_bytes(raw[:8], "big")


# -- the hash algorithm of a role -----------------------------------------------------------------

KV_CACHE_HASH_ALGO_V1 = "v1_block_key"
KV_CACHE_HASH_ALGO_V2 = "v2_sha256"
KV_CACHE_HASH_ALGO_V2_SHA256_64 = "v2_sha256_64"
KV_CACHE_HASH_ALGO_AUTO = "auto"
KV_CACHE_HASH_ALGOS = (KV_CACHE_HASH_ALGO_V1, KV_CACHE_HASH_ALGO_V2, KV_CACHE_HASH_ALGO_V2_SHA256_64)
"""What an executor may report in `/server_info.kv_cache_hash_algo` and in an event's `hash_algo`
(TensorRT-LLM `runtime/kv_cache_hash.py` @991de58c; `serve/router_utils.py` KV_CACHE_HASH_ALGOS).
`auto` is resolved by the executor before it reports (`get_effective_kv_cache_event_hash_algo`:
v1_block_key), so it never reaches the router."""

_U64_MAX = (1 << 64) - 1
_V2_HEX = re.compile(r"(?:[0-9a-fA-F]{2}){8,}")  # a v2 key's hex has 64 digits; 8 bytes are read


def event_block_hash(value: object) -> int:
    """The index's u64 key of one block hash as an executor reports it in a KV event.

    An int (v1_block_key, v2_sha256_64: TensorRT-LLM serialises both as unsigned 64-bit ints) is
    the key itself. A string is a v2_sha256 key in hex (KV cache manager V2's `key.hex()`): its
    first 8 bytes read big-endian, exactly TensorRT-LLM's `truncate_sha256_hash_to_int64`, so a
    v2_sha256 block and the same block under v2_sha256_64 have the same key, and the request path
    hashes a v2_sha256 role's prompts with `block_hashes_v2_64_bytes` (`block_hashes_for`).

    Raises ValueError (a negative or over-64-bit int, a string that is not hex of at least 8
    bytes) or TypeError (anything else, bools included)."""
    if type(value) is int:
        if 0 <= value <= _U64_MAX:
            return value
        raise ValueError(f"block hash {value} is not an unsigned 64-bit integer")
    if isinstance(value, str):
        if _V2_HEX.fullmatch(value) is None:
            raise ValueError(f"block hash {value!r} is not a v2_sha256 key in hex")
        return int(value[:16], 16)
    raise TypeError(f"block hash of type {type(value).__name__}")


def block_hashes_for(
    algo: str, tokens: Sequence[int] | memoryview, tokens_per_block: int, salt_id: int | None = None
) -> bytes:
    """A prompt's block keys under `algo` (one of KV_CACHE_HASH_ALGOS), packed little-endian u64
    as the index takes them: v1_block_key's chain, or for both V2 algorithms the v2_sha256_64
    keys (`event_block_hash` reduces v2_sha256 events to the same). `tokens`: ints or an
    int32/int64 buffer. Raises ValueError for another algorithm."""
    if algo == KV_CACHE_HASH_ALGO_V1:
        return _native.block_hashes_v1(tokens, tokens_per_block, salt_id)
    if algo == KV_CACHE_HASH_ALGO_V2 or algo == KV_CACHE_HASH_ALGO_V2_SHA256_64:
        return _native.block_hashes_v2_64(tokens, tokens_per_block, salt_id, None, 4)
    raise ValueError(f"kv_cache_hash_algo {algo!r} is not one of {', '.join(KV_CACHE_HASH_ALGOS)}")


PrefixHashCache = _native.PrefixHashCache
"""PrefixHashCache(tokens_per_block, max_blocks=2**21, seed=None): v1 block keys cached by
prompt prefix, per process. `.block_hashes(tokens, salt_id=None) -> bytes` returns exactly what
`block_hashes_bytes` does, hashing only the blocks past the deepest cached prefix (checkpoints
every 16 blocks). It pays off for int32/int64 buffers (a 32k-token repeat: ~8 us against ~43 us
on the development VM, a next turn with 3/4 cached ~22 us, a miss ~2 us over the direct hash);
for Python lists, reading the int objects dominates either way (native/README.md, "Measured
cost")."""

PROCESS_CACHE_BLOCKS = 1 << 18
"""Blocks each of this process's caches remembers: 8.4M tokens at 32 tokens a block (256 prompts
of 32k), in 2 MiB of keys plus a 2 MiB table."""
CACHE_MIN_BLOCKS = 64
"""Shorter prompts are hashed directly: the cache reuses whole checkpoints of 16 blocks, so below
four of them a hit saves under a microsecond and a miss (fingerprinting and recording the prompt)
costs about two (benchmarks/bench_routing.py, 1k tokens)."""
_PROCESS_CACHES_MAX = 4  # block sizes cached at once (executors report one or two)
_process_caches: dict[int, PrefixHashCache] = {}


def cached_block_hashes_bytes(tokens: memoryview, tokens_per_block: int, salt_id: int | None = None) -> bytes:
    """`block_hashes_bytes` of an int32/int64 buffer through this process's `PrefixHashCache` for
    `tokens_per_block` (created on first use, PROCESS_CACHE_BLOCKS blocks): a prompt that repeats
    or extends one this process hashed before is chained only past the shared prefix. Prompts of
    at most CACHE_MIN_BLOCKS blocks are hashed directly. The fleet workers' hot path
    (`RoutingKey.block_hashes`)."""
    if len(tokens) <= CACHE_MIN_BLOCKS * tokens_per_block:
        return _native.block_hashes_v1(tokens, tokens_per_block, salt_id)
    cache = _process_caches.get(tokens_per_block)
    if cache is None:
        if len(_process_caches) >= _PROCESS_CACHES_MAX:
            _process_caches.clear()
        cache = _process_caches[tokens_per_block] = PrefixHashCache(tokens_per_block, PROCESS_CACHE_BLOCKS)
    return cache.block_hashes(tokens, salt_id)


def conversation_key(conversation_id: str) -> int:
    """The u64 key of a conversation id for `BlockIndex.conv_pick_explicit` (BLAKE2b, 8 bytes).
    Every fleet worker derives the same key from the same id."""
    return int.from_bytes(hashlib.blake2b(conversation_id.encode(), digest_size=8).digest(), "little")
