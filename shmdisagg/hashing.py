"""KV-cache block hashing, identical to TensorRT-LLM's `v1_block_key`.

The algorithm follows TensorRT-LLM `tensorrt_llm/runtime/kv_cache_hash.py` (`hash_v1_block_key`)
and the C++ `BlockKeyHasher` (`cpp/tensorrt_llm/batch_manager/blockKey.cpp`): a block's hash is
seeded from its token count and its parent's hash, then every token id is mixed in with a 32-bit
integer mix; an optional salt id is mixed into the first block only. Hashes are unsigned 64-bit.

Block boundaries follow TensorRT-LLM's KvCacheManager: the prompt's **last token is excluded**,
blocks are ``tokens[t : min(t + tokens_per_block, len - 1)]`` and a final partial block is kept.

This module is the pure-Python reference. The native extension (`shmdisagg._native`) computes
the same hashes fast; `block_hashes` picks the native one when it is built.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    import hashlib

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
    """Same as `block_hashes_py`, computed by the native extension when it is available."""
    try:
        from shmdisagg import _native
    except ImportError:  # pragma: no cover - the extension is always built by `pip install`
        return block_hashes_py(tokens, tokens_per_block, salt_id)
    fn = getattr(_native, "block_hashes_v1", None)
    if fn is None:
        return block_hashes_py(tokens, tokens_per_block, salt_id)
    return fn(tokens, tokens_per_block, salt_id)
