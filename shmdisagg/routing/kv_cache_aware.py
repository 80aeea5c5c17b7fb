"""`kv_cache_aware`: the server holding the longest prefix of the request's KV blocks, less a
load penalty — TensorRT-LLM's newest formula, score = matched blocks - `load_weight` x active
requests, among servers with active requests / `max_batch_size` < `load_cap`
(`KvCacheAwareRouter._route` in TensorRT-LLM's `tensorrt_llm/serve/router.py`).
`max_batch_size` is the router arg (64 by default, or the section's, `ServerSection.router_args`)
for every server, as there, not each executor's `/server_info` value. `use_tokens` changes no
decision, as there: `_route` scores with `num_active_requests()` whatever it says (it only makes
the servers' states count tokens, which that router never reads).

A chat's turns are pinned to the server of its previous turn while it is under the cap
(`affinity.py`, TensorRT-LLM's `_route_affinity`).

The block index is shared by the whole fleet: KV events from every executor (applied by the
coordinator) and the blocks any worker routed a moment ago (routed-block tracking) both count,
so every worker decides as a single router would. One native call per decision
(`BlockIndex.pick_kv`); the chosen server's match is left in `key.matched_blocks` for
conditional disaggregation.

Inside an event loop (the fleet's requests) the pick stops at its claim of the first block past
the winner's match (`BlockIndex.pick_kv_claim`), and the routed bits of the prompt's remaining
blocks are set by a callback the loop runs when the request's task next waits (`commit_routed`;
on a pooled connection, once its leg is written). For a new prompt those inserts are ~80 % of
the pick, and nothing needs them before the leg leaves. Only prompts with `DEFER_MIN_BLOCKS`
blocks or more to mark are deferred. The claim keeps racing workers converging as before, and
this worker's own next pick first sets any bits still pending, so no later decision here misses
them.

Prompts are hashed with the role's routing key, which the coordinator decides from the
executors' `/server_info` and KV events (`coordinator/routing_keys.py`) and hands to the workers
in `/cluster_info.routing_key_configs`: the block size and the hash algorithm (v1_block_key,
v2_sha256, v2_sha256_64). A role whose executors disagree on the algorithm has none
(`kv_cache_hash_algo: null`) and routes by load only: the pick gets no blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from shmdisagg.config import RouterConfig
from shmdisagg.hashing import KV_CACHE_HASH_ALGO_V1
from shmdisagg.routing.policy import RoutingKey, TablePolicy
from shmdisagg.shm.index import BlockIndex
from shmdisagg.shm.segment import ShmError
from shmdisagg.shm.table import ControlTable

log = logging.getLogger(__name__)

DEFAULT_TOKENS_PER_BLOCK = 32  # TensorRT-LLM's default until the executors report theirs
# Fewer routed bits than this are set inside the pick: scheduling the commit costs ~1.5 us of
# CPU (call_soon, the callback, a second native call), what marking ~100 blocks costs
# (BENCHMARKS.md "Routed bits after the leg is sent").
DEFER_MIN_BLOCKS = 128


@dataclass(frozen=True)
class RoutingKeyConfig:
    """How one role's prompts are hashed: TensorRT-LLM's `routing_key_config()` fields.
    `kv_cache_hash_algo` None: no common algorithm, route by load only."""

    tokens_per_block: int
    kv_cache_hash_algo: str | None = KV_CACHE_HASH_ALGO_V1


class KvCacheAwarePolicy(TablePolicy):
    name = "kv_cache_aware"
    needs_tokens = True

    def __init__(
        self,
        table: ControlTable,
        row: int,
        role: int,
        args: RouterConfig,
        index: BlockIndex,
        key_config: Callable[[], RoutingKeyConfig | None],
    ) -> None:
        super().__init__(table, row, role, args)
        self.index = index
        self._config = key_config
        # before the coordinator's first answer: the router's own block size, v1 (never on a
        # request: workers start serving after they read /cluster_info)
        self._fallback = RoutingKeyConfig(args.tokens_per_block or DEFAULT_TOKENS_PER_BLOCK)
        self._pending: tuple[bytes, int, int] | None = None  # (hashes, first block, slot) to mark
        self._flush_scheduled = False

    def key_config(self) -> RoutingKeyConfig:
        return self._config() or self._fallback

    def tokens_per_block(self) -> int:
        """The role's block size (the router's, or adopted from its executors)."""
        return self.key_config().tokens_per_block

    def pick(self, key: RoutingKey, exclude_slot: int) -> int:
        a = self.args
        cfg = self._config() or self._fallback
        algo = cfg.kv_cache_hash_algo
        hashes = key.block_hashes(cfg.tokens_per_block, algo) if algo is not None else b""
        if self._pending is not None:  # the last pick's bits first: this decision must see them
            self.flush_routed()
        loop = _running_loop() if a.track_routed_blocks and len(hashes) >= 8 * DEFER_MIN_BLOCKS else None
        args = (
            self.row,
            self.role,
            exclude_slot,
            hashes,
            key.num_tokens,
            a.load_weight,
            a.load_cap,
            False,  # load in requests, whatever use_tokens says: `workloads = [...num_active_requests()...]`
            a.track_routed_blocks,
            a.max_batch_size,
            key.affinity,
        )
        if loop is None:
            slot, matched = self.index.pick_kv(*args)
        else:
            slot, matched, start = self.index.pick_kv_claim(*args, DEFER_MIN_BLOCKS)
            if start >= 0:
                self._pending = (hashes, start, slot)
                if not self._flush_scheduled:
                    self._flush_scheduled = True
                    loop.call_soon(self._flush_soon)
        key.matched_blocks = matched if slot >= 0 else 0
        return slot

    def flush_routed(self) -> None:
        """Set the routed bits the last deferred pick left (`BlockIndex.commit_routed`); no-op
        when none is pending. The bits are hints: an index that cannot take them is logged, not
        raised, and the next pick meets the same condition itself."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        hashes, start, slot = pending
        try:
            self.index.commit_routed(self.row, hashes, start, slot)
        except ShmError as err:
            log.warning("routed blocks of a pick not marked: %s", err)

    def _flush_soon(self) -> None:
        self._flush_scheduled = False
        self.flush_routed()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running this pick, or None (a synchronous caller: commit inline)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
