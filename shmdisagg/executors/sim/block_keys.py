"""Block hashes as the executor computes them, on top of `shmdisagg.hashing`, for the hash
algorithm it is configured with (`kv_cache_config.kv_cache_event_hash_algo`, TensorRT-LLM's
`KvCacheConfig` key; `auto` is v1_block_key, as `get_effective_kv_cache_event_hash_algo` @991de58c
resolves it).

- v1_block_key: TensorRT-LLM's v1 key chain (last token excluded, final partial block included);
- v2_sha256: KV cache manager V2's SHA-256 keys (`sequence_to_blockchain_keys`), kept as the
  256-bit integer of the key read big-endian, so the pool can key blocks by int; events report
  them as the key's hex (`key.hex()`), `kv_events.KvEventBuffer` writes them so;
- v2_sha256_64: the same keys' first 8 bytes read big-endian (`truncate_sha256_hash_to_int64`).
"""

from __future__ import annotations

from collections.abc import Sequence

from shmdisagg.hashing import (
    KV_CACHE_HASH_ALGO_AUTO,
    KV_CACHE_HASH_ALGO_V1,
    KV_CACHE_HASH_ALGO_V2,
    KV_CACHE_HASH_ALGO_V2_SHA256_64,
    KV_CACHE_HASH_ALGOS,
    block_hashes as v1_block_hashes,
    block_hashes_v2_64,
    block_keys_v2,
    v1_block_key,
)

__all__ = ["HASH_ALGO_CHOICES", "block_hashes", "effective_hash_algo", "extension_blocks"]

HASH_ALGO_CHOICES = (KV_CACHE_HASH_ALGO_AUTO, *KV_CACHE_HASH_ALGOS)

try:
    from shmdisagg import _native

    _NATIVE = hasattr(_native, "block_hashes_v1")
except ImportError:  # pragma: no cover - the extension is always built by `pip install`
    _NATIVE = False


def effective_hash_algo(configured: str) -> str:
    """What the executor reports in `/server_info.kv_cache_hash_algo` and hashes with."""
    return KV_CACHE_HASH_ALGO_V1 if configured == KV_CACHE_HASH_ALGO_AUTO else configured


def block_hashes(tokens: Sequence[int], tokens_per_block: int, algo: str = KV_CACHE_HASH_ALGO_V1) -> list[int]:
    """The chained block hashes of `tokens` under `algo` (see the module docstring for the int
    form of each). Raises ValueError for another algorithm."""
    if algo == KV_CACHE_HASH_ALGO_V1:
        return v1_block_hashes(tokens, tokens_per_block)
    if algo == KV_CACHE_HASH_ALGO_V2_SHA256_64:
        return block_hashes_v2_64(tokens, tokens_per_block)
    if algo == KV_CACHE_HASH_ALGO_V2:
        return [int.from_bytes(key, "big") for key in block_keys_v2(tokens, tokens_per_block)]
    raise ValueError(f"kv_cache_event_hash_algo {algo!r} is not one of {', '.join(HASH_ALGO_CHOICES)}")


def extension_blocks(
    tokens: Sequence[int],
    tokens_per_block: int,
    start_block: int,
    parent: int | None,
    algo: str = KV_CACHE_HASH_ALGO_V1,
) -> list[tuple[int, Sequence[int]]]:
    """(hash, tokens) of the blocks of `tokens` from block index `start_block` on, chained on
    `parent` (the hash of block `start_block - 1`, None at the root). Equal to
    `block_hashes(tokens, tpb, algo)[start_block:]` paired with each block's tokens."""
    usable = len(tokens) - 1
    if _NATIVE or algo != KV_CACHE_HASH_ALGO_V1:  # rehashing everything natively beats chaining the tail in Python
        hashes = block_hashes(tokens, tokens_per_block, algo)
        return [
            (hashes[i], tokens[i * tokens_per_block : min((i + 1) * tokens_per_block, usable)])
            for i in range(start_block, len(hashes))
        ]
    out: list[tuple[int, Sequence[int]]] = []
    prev = parent or 0
    for start in range(start_block * tokens_per_block, max(usable, 0), tokens_per_block):
        block = tokens[start : min(start + tokens_per_block, usable)]
        prev = v1_block_key(block, prev)
        out.append((prev, block))
    return out
