"""The `kv_cache_aware` router's conversation key: a chat's turns go back to the server that
served its previous turn.

TensorRT-LLM's `KvCacheAwareRouter` (`tensorrt_llm/serve/router.py`, `_content_affinity_key` and
`_route`) keys a chat request by the contents of its first two messages and the first 256 of
its `prompt_token_ids`, keeps the server each key was last routed to (an LRU of
`ROUTE_AFFINITY_CACHE_SIZE` keys), and routes a key to that server, scores unread, while it is
a candidate under `load_cap`. A completion request has no key. Here the map is the fleet's
shared index (`BlockIndex.pick_kv`'s `pin_key`), so every fleet worker sees one pin, as
TensorRT-LLM's coordinator holds one map for its fleet.

TensorRT-LLM hashes the key with blake3 keyed by `ROUTE_AFFINITY_HASH_SEED`; the key's value
never leaves the router, so a keyed blake2b (the standard library's) of the same text gives the
same grouping of requests without another dependency.
"""

from __future__ import annotations

import hashlib
from typing import Any

ROUTE_AFFINITY_HASH_SEED = b"TensorRT-LLM-route-affinity-v1!!"
ROUTE_AFFINITY_TOKEN_PREFIX = 256  # leading prompt_token_ids folded in: pre-tokenized chats key per conversation
ROUTE_AFFINITY_CACHE_SIZE = 50_000  # conversations whose pin is kept, per router


def content_affinity_key(req: dict[str, Any]) -> int:
    """The conversation key of a chat request (`req`: its decoded body), a u64 > 0; 0 for a
    request without `messages` (no pin)."""
    messages = req.get("messages")
    if not messages or not isinstance(messages, list):
        return 0
    parts = [str(m.get("content") if isinstance(m, dict) else "") for m in messages[:2]]
    token_ids = req.get("prompt_token_ids")
    if token_ids:
        parts.append(str(list(token_ids[:ROUTE_AFFINITY_TOKEN_PREFIX])))
    digest = hashlib.blake2b("".join(parts).encode("utf-8"), digest_size=8, key=ROUTE_AFFINITY_HASH_SEED).digest()
    return int.from_bytes(digest, "little") or 1  # 0 means "no key" to the index
