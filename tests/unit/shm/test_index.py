"""BlockIndex semantics in one process: KV events, prefix depths, the kv_cache_aware pick (prefix,
load, load cap, ties, eligibility, routed tracking), conversation sessions, the sweep, a full
index, generation swaps and the metrics. Several workers are several attached tables here."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from shmdisagg import _native, hashing
from shmdisagg.shm import ROLE_CONTEXT, ROLE_GENERATION, ControlTable, RowLost, ShmError, segment_names
from shmdisagg.shm.index import BlockIndex, IndexSettings, event_masks, lag_bucket_edges, pack_hashes, server_blocks

PID = os.getpid()
TTL_NS = 120 * 10**9


class Worker:
    """One fleet worker: its own attached table, claimed row and index handle."""

    def __init__(self, prefix: str) -> None:
        self.table = ControlTable.attach(prefix)
        self.row = self.table.claim_row(PID, 1)
        self.index = BlockIndex.attach(self.table)

    def kv(
        self,
        hashes: bytes,
        *,
        role: int = ROLE_CONTEXT,
        exclude: int = -1,
        tokens: int = 100,
        release: bool = True,
        **kw: object,
    ) -> tuple[int, int]:
        slot, matched = self.index.pick_kv(self.row, role, exclude, hashes, tokens, **kw)  # type: ignore[arg-type]
        if release and slot >= 0:
            self.table.release(self.row, slot, tokens)
        return slot, matched

    def close(self) -> None:
        self.index.close()
        self.table.close()


@pytest.fixture
def coord(shm_prefix: str) -> Iterator[ControlTable]:
    table = ControlTable.create(shm_prefix, max_workers=8)
    for slot in range(4):
        table.publish_server(
            slot, f"127.0.0.1:{9000 + slot}", ROLE_CONTEXT, True, max_batch_size=4, tokens_per_block=32
        )
    table.publish_server(8, "127.0.0.1:9100", ROLE_GENERATION, True, max_batch_size=4)
    yield table
    table.unlink()
    table.close()


@pytest.fixture
def index(coord: ControlTable) -> Iterator[BlockIndex]:
    ix = BlockIndex.create(coord, IndexSettings(capacity=1 << 10, max_capacity=1 << 14, grace_s=0.0))
    yield ix
    ix.close()


@pytest.fixture
def worker(coord: ControlTable, index: BlockIndex) -> Iterator[Worker]:
    w = Worker(coord.prefix)
    yield w
    w.close()


@pytest.fixture
def other(coord: ControlTable, index: BlockIndex) -> Iterator[Worker]:
    w = Worker(coord.prefix)
    yield w
    w.close()


def chain(tag: int, n: int) -> list[int]:
    """n distinct block hashes, distinct per tag (stand-ins for a prompt's chained hashes)."""
    return [(tag << 32) | (i + 1) for i in range(n)]


P = pack_hashes


# -- KV events and prefix depths -------------------------------------------------------------------


def test_stored_blocks_are_visible_to_a_worker_at_once(index: BlockIndex, worker: Worker) -> None:
    blocks = chain(1, 5)
    assert index.apply_stored(2, blocks) == 5
    assert worker.index.lookup(blocks[0]) == (1 << 2, 0, 0)
    assert dict(worker.index.match(P(blocks)))[2] == 5


@pytest.mark.parametrize(
    ("held", "want"),
    [
        ({0: [0, 1, 2, 3]}, {0: 4, 1: 0, 2: 0, 3: 0}),
        ({0: [0, 1, 3], 1: [0]}, {0: 2, 1: 1, 2: 0, 3: 0}),  # a hole ends the prefix
        ({0: [1, 2, 3]}, {0: 0, 1: 0, 2: 0, 3: 0}),  # no first block: no prefix
        ({0: [0, 1], 1: [0, 1, 2], 2: [0, 1, 2, 3]}, {0: 2, 1: 3, 2: 4, 3: 0}),
    ],
)
def test_match_depth_counts_leading_blocks_only(
    index: BlockIndex, worker: Worker, held: dict[int, list[int]], want: dict[int, int]
) -> None:
    blocks = chain(2, 4)
    for slot, which in held.items():
        index.apply_stored(slot, [blocks[i] for i in which])
    assert dict(worker.index.match(P(blocks), ROLE_CONTEXT)) == want


# -- pick_kv's jump walk: one probe per JUMP blocks, bisection where servers drop out ---------------

J = _native.IX_JUMP


def depths(worker: Worker, blocks: list[int], jump: bool) -> dict[int, int]:
    return dict(worker.index.match(P(blocks), ROLE_CONTEXT, jump=jump))


@pytest.mark.parametrize("n", [1, 2, J - 1, J, J + 1, 2 * J + 1])
def test_prompts_around_the_jump_stride_match_exactly(index: BlockIndex, worker: Worker, n: int) -> None:
    for k in sorted({0, 1, n // 2, n - 1, n}):
        blocks = chain(1000 * n + k, n)
        index.apply_stored(2, blocks[:k])
        index.apply_stored(1, blocks[: max(k - 1, 0)])
        want = {0: 0, 1: max(k - 1, 0), 2: k, 3: 0}
        assert depths(worker, blocks, jump=True) == depths(worker, blocks, jump=False) == want
        slot, matched = worker.kv(P(blocks), track_routed=False)
        assert matched == k and (k == 0 or slot == 2)


def test_servers_dropping_out_at_different_depths_in_one_window(
    coord: ControlTable, index: BlockIndex, worker: Worker
) -> None:
    blocks = chain(51, 3 * J)
    held = {0: J + 1, 1: J + 5, 2: J + 6, 3: 2 * J - 1}  # all inside the window [J, 2J - 1]
    for slot, k in held.items():
        index.apply_stored(slot, blocks[:k])
    assert depths(worker, blocks, jump=True) == depths(worker, blocks, jump=False) == held
    assert worker.kv(P(blocks), track_routed=False) == (3, 2 * J - 1)
    assert worker.kv(P(blocks), exclude=3, track_routed=False) == (2, J + 6)
    coord.set_healthy(2, False)
    assert worker.kv(P(blocks), exclude=3, track_routed=False) == (1, J + 5)
    coord.set_healthy(1, False)
    assert worker.kv(P(blocks), exclude=3, track_routed=False) == (0, J + 1)


def test_a_hole_between_probe_points_is_not_seen(index: BlockIndex, worker: Worker) -> None:
    blocks = chain(52, 2 * J + 3)
    index.apply_stored(0, blocks[:5] + blocks[6:])  # block 5 lost: no probe lands on it
    assert depths(worker, blocks, jump=False)[0] == 5
    assert depths(worker, blocks, jump=True)[0] == 2 * J + 3
    assert worker.kv(P(blocks)) == (0, 2 * J + 3)
    assert worker.index.lookup(blocks[5]) is None  # its event depth is the whole prompt: no routed bits


def test_a_hole_at_a_probe_point_ends_the_match_there(index: BlockIndex, worker: Worker) -> None:
    blocks = chain(53, 3 * J)
    index.apply_stored(0, [h for i, h in enumerate(blocks) if i != 2 * J - 1])
    assert depths(worker, blocks, jump=True)[0] == depths(worker, blocks, jump=False)[0] == 2 * J - 1
    index.apply_stored(1, [h for i, h in enumerate(blocks) if i not in (1, J - 1)])
    # the probe J - 1 is missing: the bisection of [0, J - 1] probes only held blocks past 1
    assert depths(worker, blocks, jump=False)[1] == 1
    assert depths(worker, blocks, jump=True)[1] == J - 1


def test_the_commit_marks_routed_only_past_the_winners_event_depth(index: BlockIndex, worker: Worker) -> None:
    blocks = chain(54, 2 * J + 4)
    events = J + 3
    index.apply_stored(1, blocks[:events])
    assert worker.kv(P(blocks)) == (1, events)
    assert [worker.index.lookup(h)[1] for h in blocks] == [0] * events + [1 << 1] * (len(blocks) - events)
    longer = blocks + chain(55, J)  # the next turn: matched by events, then by routed bits
    assert worker.kv(P(longer)) == (1, len(blocks))
    assert [worker.index.lookup(h)[1] for h in longer] == [0] * events + [1 << 1] * (len(longer) - events)
    fresh = chain(56, J + 1)  # no events anywhere: every block is marked, as before
    slot, matched = worker.kv(P(fresh))
    assert matched == 0 and [worker.index.lookup(h)[1] for h in fresh] == [1 << slot] * len(fresh)


# -- routed bits after the leg is sent (pick_kv_claim + commit_routed) -----------------------------


def routed(worker: Worker, blocks: list[int]) -> list[int]:
    return [(worker.index.lookup(h) or (0, 0, 0))[1] for h in blocks]


def test_a_claim_then_its_commit_marks_what_one_pick_marks(index: BlockIndex, worker: Worker) -> None:
    events = J + 3
    inline, deferred = chain(60, 2 * J + 4), chain(61, 2 * J + 4)
    index.apply_stored(1, inline[:events])
    index.apply_stored(1, deferred[:events])
    assert worker.kv(P(inline)) == (1, events)
    args = (worker.row, ROLE_CONTEXT, -1, P(deferred), 100, 0.25, math.inf, False, True, 0, 0, 1)
    slot, matched, start = worker.index.pick_kv_claim(*args)
    assert (slot, matched, start) == (1, events, events)
    # before the commit only the claim is there: the first block past the match
    assert routed(worker, deferred) == [0] * events + [1 << 1] + [0] * (len(deferred) - events - 1)
    assert worker.index.commit_routed(worker.row, P(deferred), start, slot) == len(deferred) - events
    assert routed(worker, deferred) == routed(worker, inline)
    worker.table.release(worker.row, slot, 100)


def test_another_worker_follows_a_claim_before_its_commit(index: BlockIndex, worker: Worker, other: Worker) -> None:
    blocks = chain(62, 3 * J)
    args = (ROLE_CONTEXT, -1, P(blocks), 100, 0.25, math.inf, False, True, 0, 0, 1)
    first, matched, start = worker.index.pick_kv_claim(worker.row, *args)
    assert (matched, start) == (0, 0)
    # the claimed first block outweighs the others' empty prefix, so the racer converges
    assert other.kv(P(blocks))[0] == first
    worker.index.commit_routed(worker.row, P(blocks), start, first)
    assert other.kv(P(blocks)) == (first, len(blocks))


def test_fewer_blocks_than_defer_min_are_marked_in_the_pick(index: BlockIndex, worker: Worker) -> None:
    blocks = chain(63, J)
    args = (worker.row, ROLE_CONTEXT, -1, P(blocks), 100, 0.25, math.inf, False, True, 0, 0, J + 1)
    slot, matched, start = worker.index.pick_kv_claim(*args)
    assert (matched, start) == (0, -1)
    assert routed(worker, blocks) == [1 << slot] * J
    untracked = (worker.row, ROLE_CONTEXT, -1, P(chain(64, J)), 100, 0.25, math.inf, False, False, 0, 0, 1)
    assert worker.index.pick_kv_claim(*untracked)[2] == -1
    with pytest.raises(ValueError, match="defer_min"):
        worker.index.pick_kv_claim(*args[:-1], 0)


def test_a_commit_for_a_server_gone_since_the_pick_marks_nothing(
    coord: ControlTable, index: BlockIndex, worker: Worker
) -> None:
    blocks = chain(65, 2 * J)
    args = (worker.row, ROLE_CONTEXT, -1, P(blocks), 100, 0.25, math.inf, False, True, 0, 0, 1)
    slot, _, start = worker.index.pick_kv_claim(*args)
    coord.remove_server(slot)
    assert worker.index.commit_routed(worker.row, P(blocks), start, slot) == 0
    assert routed(worker, blocks)[1:] == [0] * (len(blocks) - 1)


def test_commit_routed_refuses_bad_arguments(coord: ControlTable, worker: Worker) -> None:
    blocks = P(chain(66, 4))
    with pytest.raises(ValueError, match="start"):
        worker.index.commit_routed(worker.row, blocks, 5, 1)
    with pytest.raises(ValueError, match="server slot"):
        worker.index.commit_routed(worker.row, blocks, 0, 10_000)
    coord.reclaim_row(worker.row)
    with pytest.raises(RowLost):
        worker.index.commit_routed(worker.row, blocks, 0, 1)


def test_a_commit_after_a_resize_lands_in_the_new_generation(index: BlockIndex, worker: Worker) -> None:
    blocks = chain(67, 2 * J)
    args = (worker.row, ROLE_CONTEXT, -1, P(blocks), 100, 0.25, math.inf, False, True, 0, 0, 1)
    slot, _, start = worker.index.pick_kv_claim(*args)
    assert index.resize(1 << 12) == 2
    assert worker.index.commit_routed(worker.row, P(blocks), start, slot) == len(blocks)
    assert worker.index.generation == 2 and routed(worker, blocks) == [1 << slot] * len(blocks)


def _deferring_policy(worker: Worker) -> object:
    from shmdisagg.config import RouterConfig
    from shmdisagg.routing.kv_cache_aware import KvCacheAwarePolicy, RoutingKeyConfig

    args = RouterConfig(type="kv_cache_aware")
    return KvCacheAwarePolicy(worker.table, worker.row, ROLE_CONTEXT, args, worker.index, lambda: RoutingKeyConfig(32))


def test_the_router_marks_a_long_prompt_after_the_pick_inside_a_loop(index: BlockIndex, worker: Worker) -> None:
    import asyncio

    from shmdisagg.routing.kv_cache_aware import DEFER_MIN_BLOCKS

    policy = _deferring_policy(worker)
    first, second = chain(68, DEFER_MIN_BLOCKS + 1), chain(69, DEFER_MIN_BLOCKS + 1)

    async def flow() -> tuple[list[int], list[int], list[int]]:
        slot = policy.pick(_Key(P(first)), -1)  # type: ignore[attr-defined]
        before = routed(worker, first)  # the leg would be written here
        # a second pick in the same worker marks the first's blocks before it decides
        policy.pick(_Key(P(second)), -1)  # type: ignore[attr-defined]
        between = routed(worker, first)
        await asyncio.sleep(0)  # the loop's turn: the callback marks the second prompt's blocks
        assert slot >= 0
        return before, between, routed(worker, second)

    before, between, after = asyncio.run(flow())
    assert sum(1 for m in before if m) == 1  # the claim alone
    assert all(between) and all(after)


def test_the_router_marks_at_once_outside_a_loop_or_for_a_short_prompt(index: BlockIndex, worker: Worker) -> None:
    import asyncio

    from shmdisagg.routing.kv_cache_aware import DEFER_MIN_BLOCKS

    policy = _deferring_policy(worker)
    long, short = chain(70, DEFER_MIN_BLOCKS + 1), chain(71, DEFER_MIN_BLOCKS - 1)
    policy.pick(_Key(P(long)), -1)  # type: ignore[attr-defined]
    assert all(routed(worker, long))

    async def short_pick() -> list[int]:
        policy.pick(_Key(P(short)), -1)  # type: ignore[attr-defined]
        return routed(worker, short)

    assert all(asyncio.run(short_pick()))


def test_removed_clears_the_servers_event_and_routed_bits(index: BlockIndex, worker: Worker) -> None:
    blocks = chain(3, 3)
    index.apply_stored(1, blocks[:1])
    index.apply_stored(2, blocks)
    assert worker.kv(P(blocks), exclude=2) == (1, 1)  # routed to 1 past its event-held block 0
    assert worker.index.lookup(blocks[1])[:2] == (1 << 2, 1 << 1)
    assert index.apply_removed(1, blocks) == 3
    assert worker.index.lookup(blocks[1])[:2] == (1 << 2, 0)
    assert worker.index.lookup(blocks[0])[:2] == (1 << 2, 0)
    assert index.apply_removed(1, chain(99, 2)) == 0  # unknown blocks: nothing to do


def test_a_read_only_reader_sees_event_masks_and_counts(coord: ControlTable, index: BlockIndex) -> None:
    """What the conformance suite compares with the workers' own KV events: per block, the
    servers whose events hold it; per server, how many blocks (read-only maps of both segments)."""
    blocks = chain(5, 3)
    index.apply_stored(1, blocks)
    index.apply_stored(3, blocks[:1])
    index.apply_removed(1, blocks[2:])
    reader = ControlTable.attach(coord.prefix, read_only=True)
    try:
        assert event_masks(reader, [*blocks, 12345]) == {blocks[0]: 0b1010, blocks[1]: 0b10, blocks[2]: 0, 12345: 0}
        assert server_blocks(reader) == {1: 2, 3: 1}
    finally:
        reader.close()


def test_a_zero_hash_is_stored_under_one(index: BlockIndex, worker: Worker) -> None:
    index.apply_stored(0, [0])
    assert worker.index.lookup(0) == worker.index.lookup(1) == (1, 0, 0)


# -- kv_cache_aware pick ---------------------------------------------------------------------------


def test_pick_prefers_the_server_holding_the_prefix(index: BlockIndex, worker: Worker) -> None:
    blocks = chain(4, 6)
    index.apply_stored(3, blocks[:4])
    index.apply_stored(1, blocks[:2])
    assert worker.kv(P(blocks)) == (3, 4)


@pytest.fixture
def load_on(coord: ControlTable, other: Worker) -> Iterator[object]:
    """load_on(slot, n, tokens): n active requests on `slot` held by the `other` worker's row."""
    held: list[tuple[int, int]] = []

    def put(slot: int, n: int, tokens: int = 10) -> None:
        exclude_all_but = [s for s in range(4) if s != slot]
        for _ in range(n):
            # least-loaded over one candidate: exclude the others by taking them down a moment
            for s in exclude_all_but:
                coord.set_healthy(s, False)
            got = other.table.pick_least_loaded(other.row, ROLE_CONTEXT, -1, tokens, False)
            for s in exclude_all_but:
                coord.set_healthy(s, True)
            assert got == slot
            held.append((slot, tokens))

    yield put
    for slot, tokens in held:
        other.table.release(other.row, slot, tokens)


def test_load_weight_trades_matched_blocks_against_active_requests(index: BlockIndex, worker: Worker, load_on) -> None:  # type: ignore[no-untyped-def]
    blocks = chain(6, 8)
    index.apply_stored(0, blocks[:2])
    load_on(0, 5)  # score of 0: 2 - 0.25 * 5 = 0.75 > 0
    assert worker.kv(P(blocks), track_routed=False) == (0, 2)
    load_on(0, 4)  # 2 - 0.25 * 9 < 0
    slot, matched = worker.kv(P(blocks), track_routed=False)
    assert slot != 0 and matched == 0
    assert worker.kv(P(blocks), load_weight=0.0, track_routed=False) == (0, 2)


def test_use_tokens_counts_load_in_blocks_of_active_tokens(index: BlockIndex, worker: Worker, load_on) -> None:  # type: ignore[no-untyped-def]
    blocks = chain(7, 8)
    index.apply_stored(1, blocks[:3])
    load_on(1, 1, tokens=32 * 20)  # 20 blocks of tokens (tokens_per_block 32): 3 - 0.25 * 20 < 0
    assert worker.kv(P(blocks), track_routed=False) == (1, 3)  # by requests: 3 - 0.25 > 0
    slot, _ = worker.kv(P(blocks), use_tokens=True, track_routed=False)
    assert slot != 1


class _Key:
    """A routing key whose block hashes are given (the policy asks for them by block size)."""

    def __init__(self, hashes: bytes) -> None:
        self.hashes, self.num_tokens, self.matched_blocks, self.affinity = hashes, 100, 0, 0

    def block_hashes(self, tokens_per_block: int, algo: str) -> bytes:
        return self.hashes


def test_the_kv_cache_aware_router_scores_load_in_requests_even_with_use_tokens(
    index: BlockIndex, worker: Worker, load_on
) -> None:  # type: ignore[no-untyped-def]
    # TensorRT-LLM's KvCacheAwareRouter._route: workloads = [num_active_requests() ...] whatever
    # use_tokens says; 3 blocks - 0.25 x 1 request wins, though 20 blocks of tokens would lose
    from shmdisagg.config import RouterConfig
    from shmdisagg.routing.kv_cache_aware import KvCacheAwarePolicy, RoutingKeyConfig

    blocks = chain(7, 8)
    index.apply_stored(1, blocks[:3])
    load_on(1, 1, tokens=32 * 20)
    args = RouterConfig(type="kv_cache_aware", use_tokens=True, track_routed_blocks=False)
    policy = KvCacheAwarePolicy(
        worker.table, worker.row, ROLE_CONTEXT, args, worker.index, lambda: RoutingKeyConfig(32)
    )
    key = _Key(P(blocks))
    assert policy.pick(key, -1) == 1 and key.matched_blocks == 3  # type: ignore[arg-type]


# -- kv_cache_aware chat pins (TensorRT-LLM's _route_affinity) -----------------------------------

PIN = 0xC0FFEE


def test_a_pinned_conversation_returns_to_its_server_over_a_better_score(
    index: BlockIndex, worker: Worker, other: Worker
) -> None:
    blocks = chain(11, 6)
    index.apply_stored(2, blocks[:2])
    assert worker.kv(P(blocks), track_routed=False, pin_key=PIN) == (2, 2)  # the best score; now the pin
    index.apply_stored(1, blocks)  # server 1 now holds the whole prompt
    assert worker.kv(P(blocks), track_routed=False) == (1, 6)  # unpinned: the score decides
    assert worker.kv(P(blocks), track_routed=False, pin_key=PIN) == (2, 2)  # pinned: its server
    assert other.kv(P(blocks), track_routed=False, pin_key=PIN) == (2, 2)  # from every fleet worker


def test_a_pin_over_the_cap_or_excluded_yields_and_the_winner_becomes_the_pin(
    index: BlockIndex, worker: Worker, load_on
) -> None:  # type: ignore[no-untyped-def]
    blocks = chain(12, 4)
    index.apply_stored(3, blocks)
    index.apply_stored(0, blocks[:1])
    assert worker.kv(P(blocks), track_routed=False, pin_key=PIN)[0] == 3
    assert worker.kv(P(blocks), track_routed=False, pin_key=PIN, exclude=3)[0] == 0  # a retry elsewhere
    assert worker.kv(P(blocks), track_routed=False, pin_key=PIN)[0] == 0  # ...which is the pin now
    load_on(0, 2)  # 2 / max_batch_size 4: at a load_cap of 0.5
    assert worker.kv(P(blocks), track_routed=False, pin_key=PIN, load_cap=0.5)[0] == 3  # over the cap: scored


def test_a_pin_goes_with_its_server(index: BlockIndex, worker: Worker) -> None:
    blocks = chain(13, 4)
    index.apply_stored(1, blocks[:1])
    assert worker.kv(P(blocks), track_routed=False, pin_key=PIN)[0] == 1
    index.clear_server(1)  # the executor left: its blocks and sessions with it
    index.apply_stored(2, blocks[:1])
    assert worker.kv(P(blocks), track_routed=False, pin_key=PIN)[0] == 2


def test_load_cap_excludes_servers_at_capacity_unless_all_are(
    coord: ControlTable, index: BlockIndex, worker: Worker, load_on
) -> None:  # type: ignore[no-untyped-def]
    blocks = chain(8, 4)
    index.apply_stored(2, blocks)
    load_on(2, 2)  # 2 / max_batch_size 4 = 0.5
    assert worker.kv(P(blocks), load_cap=0.75, track_routed=False)[0] == 2
    slot, _ = worker.kv(P(blocks), load_cap=0.5, track_routed=False)
    assert slot != 2
    for s in (0, 1, 3):  # everyone else at capacity too: all compete again, the prefix wins
        load_on(s, 2)
    assert worker.kv(P(blocks), load_cap=0.5, track_routed=False) == (2, 4)


def test_ties_rotate_instead_of_favouring_the_first_server(index: BlockIndex, worker: Worker) -> None:
    picks = [worker.kv(P(chain(9, 3)), track_routed=False)[0] for _ in range(8)]
    assert Counter(picks) == Counter({0: 2, 1: 2, 2: 2, 3: 2})


@pytest.mark.parametrize("how", ["unhealthy", "removed", "excluded", "other_role"])
def test_a_non_candidate_servers_blocks_never_attract(
    coord: ControlTable, index: BlockIndex, worker: Worker, how: str
) -> None:
    blocks = chain(10, 4)
    holder = 8 if how == "other_role" else 1
    index.apply_stored(holder, blocks)
    exclude = -1
    if how == "unhealthy":
        coord.set_healthy(1, False)
    elif how == "removed":
        coord.remove_server(1)
    elif how == "excluded":
        exclude = 1
    for _ in range(6):
        slot, matched = worker.kv(P(blocks), exclude=exclude, track_routed=False)
        assert slot != holder and matched == 0


@pytest.mark.parametrize("op", ["clear_server", "apply_all_cleared"])
def test_cleared_servers_stop_attracting(index: BlockIndex, worker: Worker, op: str) -> None:
    blocks = chain(11, 4)
    index.apply_stored(3, blocks)
    assert worker.kv(P(blocks)) == (3, 4)  # also routes: routed bits for 3
    getattr(index, op)(3)
    assert worker.index.lookup(blocks[0])[:2] == (0, 0)
    assert dict(worker.index.match(P(blocks)))[3] == 0


def test_a_routed_request_counts_for_every_worker_before_any_event(
    index: BlockIndex, worker: Worker, other: Worker
) -> None:
    blocks = chain(12, 10)
    first, matched = worker.kv(P(blocks))
    assert matched == 0
    assert other.kv(P(blocks)) == (first, 10)
    assert other.kv(P(blocks[:6] + chain(13, 4))) == (first, 6)  # a shared prefix follows too


def test_without_tracking_nothing_is_marked(index: BlockIndex, worker: Worker) -> None:
    blocks = chain(14, 3)
    worker.kv(P(blocks), track_routed=False)
    assert worker.index.lookup(blocks[0]) is None


def test_pick_adds_load_to_the_own_row_and_release_removes_it(coord: ControlTable, worker: Worker) -> None:
    slot, _ = worker.kv(P(chain(15, 2)), tokens=77, release=False)
    assert coord.load(slot) == (1, 77)
    worker.table.release(worker.row, slot, 77)
    assert coord.load(slot) == (0, 0)


def test_no_candidate_gives_minus_one(coord: ControlTable, worker: Worker) -> None:
    for s in range(4):
        coord.set_healthy(s, False)
    assert worker.kv(P(chain(16, 2))) == (-1, 0)
    assert worker.index.conv_pick_explicit(worker.row, ROLE_CONTEXT, -1, 5, 1) == -1
    assert worker.index.conv_pick_implicit(worker.row, ROLE_CONTEXT, -1, P(chain(16, 2)), 1) == (-1, 0)


def test_a_lost_row_raises(coord: ControlTable, worker: Worker) -> None:
    coord.reclaim_row(worker.row)
    with pytest.raises(RowLost):
        worker.kv(P(chain(17, 2)))


def test_bad_hash_buffers_are_refused(worker: Worker) -> None:
    with pytest.raises(TypeError):
        worker.kv(b"1234567")  # not a multiple of 8 bytes
    with pytest.raises(TypeError):
        worker.index.match("abc")  # type: ignore[arg-type]


def test_workers_cannot_write_events_or_maintain(worker: Worker) -> None:
    for call in (
        lambda: worker.index.apply_stored(0, [1]),
        lambda: worker.index.clear_server(0),
        lambda: worker.index.sweep(),
        lambda: worker.index.resize(),
    ):
        with pytest.raises(ShmError):
            call()


# -- routed-bit expiry -----------------------------------------------------------------------------


def test_sweep_expires_routed_bits_after_the_ttl_but_keeps_event_bits(index: BlockIndex, worker: Worker) -> None:
    routed_only, confirmed = chain(18, 3), chain(19, 3)
    worker.kv(P(routed_only), exclude=0)
    index.apply_stored(0, confirmed)
    assert worker.kv(P(confirmed)) == (0, 3)  # held by events: no routed bit needed
    assert worker.index.lookup(confirmed[0])[:2] == (1, 0)
    census = index.sweep(time.monotonic_ns())
    assert census["routed_expired"] == 0 and census["live"] == 6
    census = index.sweep(time.monotonic_ns() + TTL_NS + 10**9)
    assert census["routed_expired"] == 3 and (census["live"], census["dead"]) == (3, 3)
    assert dict(worker.index.match(P(routed_only), ROLE_CONTEXT)) == {0: 0, 1: 0, 2: 0, 3: 0}
    assert dict(worker.index.match(P(confirmed)))[0] == 3


# -- conversations ---------------------------------------------------------------------------------


def test_an_explicit_conversation_is_sticky_across_workers(index: BlockIndex, worker: Worker, other: Worker) -> None:
    key = hashing.conversation_key("conv-a")
    first = worker.index.conv_pick_explicit(worker.row, ROLE_CONTEXT, -1, key, 100)
    for w in (other, worker, other):
        assert w.index.conv_pick_explicit(w.row, ROLE_CONTEXT, -1, key, 100) == first


def test_new_conversations_go_to_the_fewest_active_tokens(index: BlockIndex, worker: Worker, load_on) -> None:  # type: ignore[no-untyped-def]
    for s in (0, 1, 3):
        load_on(s, 1, tokens=500)
    assert worker.index.conv_pick_explicit(worker.row, ROLE_CONTEXT, -1, 1, 10) == 2


def test_a_session_reroutes_when_its_server_is_no_longer_a_candidate(
    coord: ControlTable, index: BlockIndex, worker: Worker, other: Worker
) -> None:
    key = hashing.conversation_key("conv-b")
    first = worker.index.conv_pick_explicit(worker.row, ROLE_CONTEXT, -1, key, 1)
    coord.set_healthy(first, False)
    moved = other.index.conv_pick_explicit(other.row, ROLE_CONTEXT, -1, key, 1)
    assert moved not in (first, -1)
    coord.set_healthy(first, True)
    assert worker.index.conv_pick_explicit(worker.row, ROLE_CONTEXT, -1, key, 1) == moved  # stays moved
    assert worker.index._ix.lookup(key, 1, ROLE_CONTEXT)[1] == 1 << moved
    index.clear_server(moved)  # a removed server's sessions are dropped and decided anew
    assert worker.index._ix.lookup(key, 1, ROLE_CONTEXT)[1] == 0
    again = other.index.conv_pick_explicit(other.row, ROLE_CONTEXT, -1, key, 1)
    assert worker.index._ix.lookup(key, 1, ROLE_CONTEXT)[1] == 1 << again


def test_roles_keep_separate_sessions(index: BlockIndex, worker: Worker) -> None:
    ctx = worker.index.conv_pick_explicit(worker.row, ROLE_CONTEXT, -1, 42, 1)
    gen = worker.index.conv_pick_explicit(worker.row, ROLE_GENERATION, -1, 42, 1)
    assert (ctx, gen) != (-1, -1) and gen == 8
    assert worker.index.conv_pick_explicit(worker.row, ROLE_CONTEXT, -1, 42, 1) == ctx


def test_sessions_beyond_max_sessions_are_evicted_oldest_first(coord: ControlTable, worker: Worker) -> None:
    index = BlockIndex.create(coord, IndexSettings(capacity=1 << 10, max_sessions=2))
    try:
        w = Worker(coord.prefix)
        try:
            for key in (1, 2, 3):
                w.index.conv_pick_explicit(w.row, ROLE_CONTEXT, -1, key, 1)
            w.index.conv_pick_explicit(w.row, ROLE_CONTEXT, -1, 1, 1)  # 1 is now the newest
            census = index.sweep()
            assert (census["sessions"], census["evicted"]) == (3, 1)
            alive = {k: w.index._ix.lookup(k, 1, ROLE_CONTEXT)[1] != 0 for k in (1, 2, 3)}
            assert alive == {1: True, 2: False, 3: True}
            assert index.sweep()["sessions"] == 2
        finally:
            w.close()
    finally:
        index.close()


def test_implicit_entries_beyond_max_implicit_are_evicted_oldest_first(coord: ControlTable) -> None:
    index = BlockIndex.create(coord, IndexSettings(capacity=1 << 10, max_implicit=4))
    try:
        w = Worker(coord.prefix)
        try:
            old, new = chain(25, 3), chain(26, 3)
            first, _ = w.index.conv_pick_implicit(w.row, ROLE_CONTEXT, -1, P(old), 1, 0.75)
            w.index.conv_pick_implicit(w.row, ROLE_CONTEXT, -1, P(new), 1, 0.75)
            census = index.sweep()
            assert (census["implicit_entries"], census["evicted"]) == (6, 2)

            def alive(h: int) -> bool:
                got = w.index._ix.lookup(h, 2, ROLE_CONTEXT)
                return got is not None and got[1] != 0

            # one pick stamps its blocks alike: two of the older request's three entries go
            assert [alive(h) for h in new] == [True] * 3 and sum(alive(h) for h in old) == 1
        finally:
            w.close()
    finally:
        index.close()


def test_implicit_matching_follows_the_prefix_above_the_threshold(index: BlockIndex, worker: Worker, load_on) -> None:  # type: ignore[no-untyped-def]
    a = chain(20, 4)
    first, depth = worker.index.conv_pick_implicit(worker.row, ROLE_CONTEXT, -1, P(a), 10, 0.75)
    assert depth == 0
    load_on(first, 3)  # the first server is now the busiest: only the prefix can bring us back
    follow = a[:3] + chain(21, 1)  # 3 / 4 >= 0.75
    assert worker.index.conv_pick_implicit(worker.row, ROLE_CONTEXT, -1, P(follow), 10, 0.75) == (first, 3)
    half = a[:2] + chain(22, 2)  # 2 / 4 >= 0.5
    assert worker.index.conv_pick_implicit(worker.row, ROLE_CONTEXT, -1, P(half), 10, 0.5) == (first, 2)
    diverge = a[:1] + chain(23, 3)  # 1 / 4 < 0.75: the least loaded instead
    slot, depth = worker.index.conv_pick_implicit(worker.row, ROLE_CONTEXT, -1, P(diverge), 10, 0.75)
    assert slot != first and depth == 0


def test_implicit_entries_are_separate_from_kv_blocks(index: BlockIndex, worker: Worker) -> None:
    blocks = chain(24, 3)
    worker.index.conv_pick_implicit(worker.row, ROLE_CONTEXT, -1, P(blocks), 1, 0.75)
    assert worker.index.lookup(blocks[0]) is None
    assert dict(worker.index.match(P(blocks), ROLE_CONTEXT)) == {0: 0, 1: 0, 2: 0, 3: 0}


# -- bounded size ----------------------------------------------------------------------------------


def test_a_full_index_refuses_inserts_counts_them_and_keeps_what_it_has(coord: ControlTable) -> None:
    index = BlockIndex.create(coord, IndexSettings(capacity=16, max_capacity=16, max_load=0.6, grow_at=0.5))
    w = Worker(coord.prefix)
    try:
        limit = int(16 * 0.6)
        blocks = chain(30, 20)
        assert index.apply_stored(1, blocks) == limit
        assert index.stats().index_full_drops == 20 - limit
        for i, h in enumerate(blocks):
            assert (w.index.lookup(h) is not None) == (i < limit)
            if i < limit:
                assert w.index.lookup(h)[:2] == (2, 0)
        slot, matched = w.kv(P(chain(31, 5)))  # nothing fits: still a valid pick
        assert slot in range(4) and matched == 0
        assert dict(w.index.match(P(blocks)))[1] == limit
        census = index.sweep()
        assert census["used"] == limit == index.stats().used
        assert index.resize_target(census) is None  # at max capacity, nothing dead to drop
    finally:
        w.close()
        index.close()


# -- generations -----------------------------------------------------------------------------------


def test_resize_keeps_live_keys_drops_dead_ones_and_workers_follow(
    coord: ControlTable, index: BlockIndex, worker: Worker
) -> None:
    keep, drop = chain(40, 5), chain(41, 5)
    index.apply_stored(2, keep)
    index.apply_stored(1, drop)
    index.apply_removed(1, drop)
    old_name = index.name
    assert worker.kv(P(keep)) == (2, 5)
    generation = index.resize(1 << 12)
    assert generation == 2 and index.capacity == 1 << 12
    assert coord.index_publication()[:2] == (2, 1 << 12)
    assert worker.kv(P(keep)) == (2, 5)  # remapped on this pick
    assert worker.index.generation == 2
    assert worker.index.lookup(drop[0]) is None and worker.index.lookup(keep[0])[:2] == (4, 0)
    assert index.stats().resizes == 1
    assert old_name in segment_names(coord.prefix)
    index.unlink_retired(now=math.inf)
    assert old_name not in segment_names(coord.prefix)


def test_events_applied_during_a_resize_reach_the_new_generation(index: BlockIndex, worker: Worker) -> None:
    blocks = chain(42, 3)
    real_copy = type(index._ix).copy_into

    class Spy:
        def __init__(self, ix: _native.Index) -> None:
            self.ix = ix

        def __getattr__(self, name: str) -> object:
            return getattr(self.ix, name)

        def copy_into(self, dst: _native.Index) -> tuple[int, int]:
            got = real_copy(self.ix, dst)
            index.apply_stored(3, blocks)  # as if another thread applied it after the copy
            return got

    index._ix = Spy(index._ix)  # type: ignore[assignment]
    index.resize()
    assert worker.kv(P(blocks), track_routed=False) == (3, 3)


def test_maintain_grows_a_crowded_table(coord: ControlTable) -> None:
    index = BlockIndex.create(coord, IndexSettings(capacity=64, max_capacity=1 << 10, grace_s=0.0))
    try:
        index.apply_stored(0, chain(43, 32))  # 32 of 64 slots: past grow_at 0.45
        census = index.maintain()
        assert census["live"] == 32
        assert index.capacity == 128 and index.generation == 2  # next_pow2(32 / 0.35)
        assert index.maintain()["live"] == 32 and index.capacity == 128
        assert len([n for n in segment_names(coord.prefix) if "-idx-" in n]) == 1
    finally:
        index.close()


def test_control_table_unlink_removes_every_index_generation(shm_prefix: str) -> None:
    table = ControlTable.create(shm_prefix)
    index = BlockIndex.create(table, IndexSettings(capacity=64, grace_s=3600.0))
    index.resize(128)
    index.resize(256)
    assert len([n for n in segment_names(shm_prefix) if "-idx-" in n]) == 3
    index.close()
    table.unlink()
    table.close()
    assert segment_names(shm_prefix) == ()


def test_attach_waits_for_a_publication(coord: ControlTable) -> None:
    with pytest.raises(ShmError):
        BlockIndex.attach(coord, timeout=0.01)


# -- metrics ---------------------------------------------------------------------------------------


def test_metrics_count_events_blocks_drops_and_lag(index: BlockIndex, worker: Worker) -> None:
    index.apply_stored(0, chain(50, 4), time.time_ns() - 3_000_000)  # emitted 3 ms ago
    index.apply_stored(1, chain(51, 2))  # no executor timestamp: no lag sample
    index.apply_removed(0, chain(50, 1))
    index.count_dropped(2)
    s = index.stats()
    assert (s.events_applied, s.blocks_applied, s.blocks_stored, s.blocks_removed) == (3, 7, 6, 1)
    assert (s.events_dropped, s.lag_samples, s.generation) == (2, 1, 1)
    assert 3_000_000 <= s.lag_sum_ns < 10**9
    assert 2**21 < s.lag_quantile_ns(0.99) <= 2**30
    assert worker.table.index_metrics()["events_applied"] == 3  # any process reads them


def test_lag_bucket_edges_are_log_linear_and_tile_every_u64() -> None:
    assert [lag_bucket_edges(b) for b in (0, 3, 4, 7, 8, 11, 12, 15)] == [
        (0, 1),
        (3, 4),
        (4, 4),
        (4, 4),
        (4, 5),
        (7, 8),
        (8, 10),
        (14, 16),
    ]
    assert lag_bucket_edges(88) == (4_194_304, 5_242_880)  # 2**22 ns: 4.19 .. 5.24 ms
    assert lag_bucket_edges(89) == (5_242_880, 6_291_456)
    assert lag_bucket_edges(255) == (7 << 61, 1 << 64)
    used = [lag_bucket_edges(b) for b in (*range(4), *range(8, 256))]
    assert used[0][0] == 0 and all(hi == lo for (_, hi), (lo, _) in zip(used, used[1:], strict=False))
    assert all(4 * (hi - lo) <= lo for lo, hi in used[4:])  # each at most 25 % wide
    for bad in (-1, 256):
        with pytest.raises(ValueError):
            lag_bucket_edges(bad)


def test_a_lag_lands_in_its_sub_bucket(index: BlockIndex) -> None:
    """Each event's recorded lag (the lag_sum_ns step) falls in the one bucket it incremented;
    lags of seconds are placed with 2 s to spare, so the bucket is known before the event."""
    octave = 1 << 33  # 8.6 s: sub-buckets 2.1 s wide
    cases = [(-(10**12), 0)] + [((4 + s) * (octave >> 2) + 10**8, 132 + s) for s in range(4)]
    cases += [(5_000_000, None)]  # ~5 ms: its bucket depends on how late the clock is read
    for lag, want in cases:
        before = index.stats()
        index.apply_stored(0, chain(60, 1), time.time_ns() - lag)
        after = index.stats()
        steps = [(b, a - c) for b, (a, c) in enumerate(zip(after.lag_hist, before.lag_hist, strict=True)) if a != c]
        assert len(steps) == 1 and steps[0][1] == 1
        b, recorded = steps[0][0], after.lag_sum_ns - before.lag_sum_ns
        lo, hi = lag_bucket_edges(b)
        assert lo <= recorded < hi, (lag, b, recorded)
        assert b == want if want is not None else 4 * (hi - lo) <= lo  # a 25 %-wide bucket


def _bucket_of(lag_ns: int) -> int:
    return next(b for b in range(256) if lag_bucket_edges(b)[0] <= lag_ns < lag_bucket_edges(b)[1])


def test_lag_quantiles_are_sub_bucket_upper_edges(index: BlockIndex) -> None:
    lags = []  # each event's lag as recorded (its lag_sum_ns step): exact however late the clock read
    for i, lag in enumerate([5_000_000] * 9 + [45_000_000]):
        before = index.stats().lag_sum_ns
        index.apply_stored(0, chain(61 + i, 1), time.time_ns() - lag)
        lags.append(index.stats().lag_sum_ns - before)
    s = index.stats()
    p50 = lag_bucket_edges(_bucket_of(sorted(lags)[4]))[1]
    assert s.lag_quantile_ns(0.5) == p50 and 5_000_000 < p50 <= sorted(lags)[4] * 1.25 + 1  # log2 buckets: 8.4 ms
    assert s.lag_quantile_ns(0.99) == lag_bucket_edges(_bucket_of(max(lags)))[1]  # the 45 ms event's bucket
    hist = [0] * len(s.lag_hist)
    hist[88], hist[89], hist[101] = 60, 30, 10
    synthetic = dataclasses.replace(s, lag_hist=tuple(hist))
    assert [synthetic.lag_quantile_ns(q) for q in (0.0, 0.5, 0.6, 0.61, 0.9, 0.91, 1.0)] == [
        5_242_880,
        5_242_880,
        5_242_880,
        6_291_456,
        6_291_456,
        50_331_648,
        50_331_648,
    ]
    assert dataclasses.replace(s, lag_hist=(0,) * len(s.lag_hist)).lag_quantile_ns(0.5) == 0


# -- layout validation -----------------------------------------------------------------------------


def test_check_index_refuses_foreign_bytes_and_waits_for_building_ones(coord: ControlTable) -> None:
    buf = bytearray(8192)
    ix = _native.Index(buf, coord._region)
    assert ix.check_index() is False  # state 0: still BUILDING
    buf[0x38] = 1
    with pytest.raises(_native.LayoutMismatch, match="magic"):
        ix.check_index()
    ix.init_index(1, 4, 9, 0)
    ix.publish()
    assert ix.check_index() is True
    buf[0x18] = 40  # cap_log2 40: out of range
    with pytest.raises(_native.LayoutMismatch):
        ix.check_index()
    ix.release()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity": 1000},
        {"capacity": 8},
        {"max_capacity": 1 << 40},
        {"capacity": 1 << 12, "max_capacity": 1 << 10},
        {"max_load": 1.0},
        {"grow_at": 0.7},
        {"routed_ttl_s": -1},
    ],
)
def test_bad_index_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        IndexSettings(**kwargs)  # type: ignore[arg-type]


def test_index_names_and_sizes() -> None:
    from shmdisagg.shm.layout import index_name, index_size

    assert index_name("p", 26) == "/p-idx-1a"
    assert index_size(16) == max(8192, 4096 + 32 * 16) and index_size(1 << 20) == 4096 + (32 << 20)
    with pytest.raises(ValueError):
        index_size(100)
