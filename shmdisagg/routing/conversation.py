"""`conversation`: a conversation stays on one server, fleet-wide (TensorRT-LLM's
`ConversationRouter` in `tensorrt_llm/serve/router.py`).

- An explicit conversation id (body `conversation_params.conversation_id`, else the first
  non-empty `x-session-id`, `x-correlation-id`, `x-session-affinity`, `x-multi-turn-session-id`
  header) is sticky: the first decision for it, by any worker, wins; a session whose server is
  gone or unhealthy re-routes; new sessions go to the server with the fewest active tokens.
- Without an id, the request's prefix is matched against earlier requests (v1 block hashes of
  its token ids when the prompt is token ids or with `use_token_ids`, else of the code points
  of its canonical text, at
  `tokens_per_block`, after skipping `hash_skip_count` tokens — x5 code points in text mode — so
  a shared system prompt does not match everything); a match of at least `match_threshold` of
  the request's blocks routes there, anything less goes least-loaded.
Sessions and prefixes live in the shared index with LRU eviction (`max_sessions`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shmdisagg.config import RouterConfig
from shmdisagg.hashing import block_hashes_bytes, cached_block_hashes_bytes, conversation_key
from shmdisagg.routing.policy import RoutingKey, TablePolicy
from shmdisagg.shm.index import BlockIndex
from shmdisagg.shm.table import ControlTable

CHARS_PER_TOKEN = 5  # TensorRT-LLM's text-mode estimate
SESSION_HEADERS = (b"x-session-id", b"x-correlation-id", b"x-session-affinity", b"x-multi-turn-session-id")


def conversation_id(req: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> str | None:
    """The request's conversation id: body first, then the session headers (stripped, non-empty).
    A body `conversation_params` without an id means: do not consult headers."""
    params = req.get("conversation_params")
    if isinstance(params, dict):
        cid = params.get("conversation_id")
        return cid.strip() or None if isinstance(cid, str) else None
    return header_conversation_id(headers)


def header_conversation_id(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The first non-empty session header (`SESSION_HEADERS` order), stripped; None if none."""
    wanted: dict[bytes, bytes | None] = dict.fromkeys(SESSION_HEADERS)
    for name, value in headers:
        if name in wanted and wanted[name] is None:
            wanted[name] = value
    for name in SESSION_HEADERS:
        found = wanted[name]
        if found is not None and found.strip():
            return found.strip().decode("latin-1")
    return None


def canonical_text(req: dict[str, Any], chat: bool) -> str:
    """Chat: `role:content` lines; completion: the prompt string."""
    if not chat:
        prompt = req.get("prompt")
        return prompt if isinstance(prompt, str) else ""
    lines = []
    for m in req.get("messages", []):
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        lines.append(f"{m.get('role')}:{content or ''}")
    return "\n".join(lines)


class ConversationPolicy(TablePolicy):
    name = "conversation"

    def __init__(self, table: ControlTable, row: int, role: int, args: RouterConfig, index: BlockIndex) -> None:
        super().__init__(table, row, role, args)
        self.index = index
        # ConversationRouter's default is 128; a `tokens_per_block: null` it passes on gets
        # BlockHashMixin._init_block_hashing's 32 (TensorRT-LLM serve/router.py, router_utils.py)
        self.tpb = args.tokens_per_block or (32 if "tokens_per_block" in args.model_fields_set else 128)
        self.needs_tokens = args.use_token_ids  # type: ignore[misc]  # per-instance override

    def _hashes(self, key: RoutingKey) -> bytes:
        if (self.args.use_token_ids or key.ids_given) and key.token_ids:
            view = key.ids_view()
            if view is not None:  # int32 ids through the process's prefix hash cache
                tail = view[self.args.hash_skip_count :]
                return cached_block_hashes_bytes(tail, self.tpb) if len(tail) > 1 else b""
            ids = key.token_ids[self.args.hash_skip_count :]
        else:
            ids = [ord(c) for c in (key.text or "")[self.args.hash_skip_count * CHARS_PER_TOKEN :]]
        return block_hashes_bytes(ids, self.tpb) if len(ids) > 1 else b""

    def pick(self, key: RoutingKey, exclude_slot: int) -> int:
        if key.conversation_id is not None:
            return self.index.conv_pick_explicit(
                self.row, self.role, exclude_slot, conversation_key(key.conversation_id), key.num_tokens
            )
        slot, _ = self.index.conv_pick_implicit(
            self.row, self.role, exclude_slot, self._hashes(key), key.num_tokens, self.args.match_threshold
        )
        return slot
