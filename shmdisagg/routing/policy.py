"""The routing policy contract.

A policy chooses one server of one role for a request and records the load it adds in the
caller's own counter row, in a single native call against the shared table; the caller releases
that load exactly once, with the same token count, when the leg ends. A policy never sees
servers that are absent, unhealthy, of the other role, or excluded: the native pick filters them
before scoring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

from shmdisagg._native import token_ids_int32
from shmdisagg.config import RouterConfig
from shmdisagg.hashing import KV_CACHE_HASH_ALGO_V1, block_hashes_bytes, block_hashes_for, cached_block_hashes_bytes
from shmdisagg.shm.table import ControlTable


class RoutingKey:
    """What a policy may look at for one request.

    `num_tokens`: the load it adds (tokens, or characters for untokenised text);
    `token_ids`: its prompt ids when a policy needed them (see `Policy.needs_tokens`) or, for
    the conversation router, when the request was a token-id prompt (`ids_given`);
    `ids32`: the same ids as native int32 bytes when validation produced them (token-id prompts);
    `conversation_id`: from the body's `conversation_params` or the session headers;
    `text`: the canonical text the conversation router hashes when it has no ids.
    Block hashes are computed once per `tokens_per_block` and algorithm and cached here; v1 keys are hashed from
    the int32 ids through this process's prefix hash cache, so a conversation's next turn only
    chains its new blocks.
    """

    __slots__ = (
        "num_tokens",
        "token_ids",
        "ids32",
        "conversation_id",
        "text",
        "salt_id",
        "_hashes",
        "_view",
        "matched_blocks",
        "ids_given",
        "affinity",
    )

    def __init__(
        self,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        conversation_id: str | None = None,
        text: str | None = None,
        salt_id: int | None = None,
        ids32: bytes | None = None,
    ) -> None:
        self.num_tokens = num_tokens
        self.token_ids = token_ids
        self.ids32 = ids32
        self.conversation_id = conversation_id
        self.text = text
        self.salt_id = salt_id
        self._hashes: dict[int, bytes] = {}
        self._view: memoryview | None = None
        self.matched_blocks = 0  # the chosen server's match on the last KV-aware pick
        self.ids_given = False  # the request itself carried `token_ids` (a token-id prompt)
        self.affinity = 0  # a chat's conversation key for kv_cache_aware pins (`affinity.py`); 0: none

    def ids_view(self) -> memoryview | None:
        """The token ids as an int32 memoryview (from `ids32`, else converted once from
        `token_ids`, e.g. tokenizer output); None without ids or with ids outside [0, 2**31)."""
        if self._view is None:
            raw = self.ids32 if self.ids32 is not None else token_ids_int32(self.token_ids) if self.token_ids else None
            if raw is not None:
                self.ids32 = raw
                self._view = memoryview(raw).cast("i")
        return self._view

    def block_hashes(self, tokens_per_block: int, algo: str = KV_CACHE_HASH_ALGO_V1) -> bytes:
        """Packed u64 block keys of `token_ids` under `algo` (`hashing.KV_CACHE_HASH_ALGOS`;
        empty without ids). v1_block_key goes through the process's prefix hash cache; the V2
        algorithms are hashed directly (`hashing.block_hashes_for`). Raises ValueError for an
        unknown `algo`."""
        if algo != KV_CACHE_HASH_ALGO_V1:
            return self._v2_hashes(tokens_per_block, algo)
        cached = self._hashes.get(tokens_per_block)
        if cached is None:
            view = self.ids_view()
            if view is not None:
                cached = cached_block_hashes_bytes(view, tokens_per_block, self.salt_id)
            else:
                ids = self.token_ids or []
                cached = block_hashes_bytes(ids, tokens_per_block, self.salt_id) if ids else b""
            self._hashes[tokens_per_block] = cached
        return cached

    def _v2_hashes(self, tokens_per_block: int, algo: str) -> bytes:
        # both V2 algorithms reduce to the same 64-bit keys, so one cache entry serves both
        cached = self._hashes.get(-tokens_per_block)
        if cached is None:
            view = self.ids_view()
            ids = view if view is not None else self.token_ids
            cached = block_hashes_for(algo, ids, tokens_per_block, self.salt_id) if ids else b""
            self._hashes[-tokens_per_block] = cached
        return cached


class Policy(Protocol):
    name: ClassVar[str]
    needs_tokens: ClassVar[bool]

    def pick(self, key: RoutingKey, exclude_slot: int) -> int:
        """Slot of the chosen server with its load already added, or -1 when none is eligible."""
        ...

    def release(self, slot: int, key: RoutingKey) -> None:
        """Remove the load `pick` added for `key` on `slot`."""
        ...


class TablePolicy:
    """Shared plumbing: which table, row and role a policy works on."""

    name: ClassVar[str] = ""
    needs_tokens: ClassVar[bool] = False

    def __init__(self, table: ControlTable, row: int, role: int, args: RouterConfig) -> None:
        self.table = table
        self.row = row
        self.role = role
        self.args = args

    def pick(self, key: RoutingKey, exclude_slot: int) -> int:
        """Each policy's own (`Policy.pick`); declared here so every subclass is a `Policy`."""
        raise NotImplementedError

    def release(self, slot: int, key: RoutingKey) -> None:
        self.table.release(self.row, slot, key.num_tokens)
