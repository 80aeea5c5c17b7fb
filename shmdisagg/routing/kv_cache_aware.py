"""`kv_cache_aware`: the server holding the longest prefix of the request's KV blocks, less a
load penalty — TensorRT-LLM's newest formula, score = matched blocks - `load_weight` x active
requests, among servers under `load_cap` x `max_batch_size` (`serve/router.py`,
`KvCacheAwareRouter._route` in TensorRT-LLM's `tensorrt_llm/serve/router.py`).

The block index is shared by the whole fleet: KV events from every executor (applied by the
coordinator) and the blocks any worker routed a moment ago (routed-block tracking) both count,
so every worker decides as a single router would. One native call per decision
(`BlockIndex.pick_kv`); the chosen server's match is left in `key.matched_blocks` for
conditional disaggregation.
"""

from __future__ import annotations

from collections.abc import Callable

from shmdisagg.config import RouterConfig
from shmdisagg.routing.policy import RoutingKey, TablePolicy
from shmdisagg.shm.index import BlockIndex
from shmdisagg.shm.table import ControlTable

DEFAULT_TOKENS_PER_BLOCK = 32  # TensorRT-LLM's default until the executors report theirs


class KvCacheAwarePolicy(TablePolicy):
    name = "kv_cache_aware"
    needs_tokens = True

    def __init__(self, table: ControlTable, row: int, role: int, args: RouterConfig, index: BlockIndex, tokens_per_block: Callable[[], int]) -> None:
        super().__init__(table, row, role, args)
        self.index = index
        self._tpb = tokens_per_block

    def tokens_per_block(self) -> int:
        """The configured value, else what the role's executors report (`/server_info`)."""
        return self.args.tokens_per_block or self._tpb() or DEFAULT_TOKENS_PER_BLOCK

    def pick(self, key: RoutingKey, exclude_slot: int) -> int:
        a = self.args
        slot, matched = self.index.pick_kv(
            self.row, self.role, exclude_slot, key.block_hashes(self.tokens_per_block()), key.num_tokens,
            a.load_weight, a.load_cap, a.use_tokens, a.track_routed_blocks,
        )
        key.matched_blocks = matched if slot >= 0 else 0
        return slot
