"""Block hashes as the executor computes them, on top of `shmdisagg.hashing` (TensorRT-LLM's
v1_block_key: last token excluded, final partial block included)."""

from __future__ import annotations

from collections.abc import Sequence

from shmdisagg.hashing import block_hashes, v1_block_key

__all__ = ["block_hashes", "extension_blocks"]

try:
    from shmdisagg import _native

    _NATIVE = hasattr(_native, "block_hashes_v1")
except ImportError:  # pragma: no cover - the extension is always built by `pip install`
    _NATIVE = False


def extension_blocks(
    tokens: Sequence[int], tokens_per_block: int, start_block: int, parent: int | None
) -> list[tuple[int, Sequence[int]]]:
    """(hash, tokens) of the blocks of `tokens` from block index `start_block` on, chained on
    `parent` (the hash of block `start_block - 1`, None at the root). Equal to
    `block_hashes(tokens)[start_block:]` without rehashing the blocks before it."""
    usable = len(tokens) - 1
    if _NATIVE:  # rehashing everything natively beats chaining the tail in Python
        hashes = block_hashes(tokens, tokens_per_block)
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
