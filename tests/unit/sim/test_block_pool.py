from __future__ import annotations

from hypothesis import given, settings, strategies as st

from shmdisagg.executors.sim.block_keys import extension_blocks
from shmdisagg.executors.sim.block_pool import BlockPool
from shmdisagg.executors.sim.kv_events import KvEventBuffer
from shmdisagg.hashing import block_hashes

TPB = 4


def chain(tokens: list[int]) -> list[tuple[int, list[int]]]:
    """(hash, tokens) of every block of `tokens`, as the executor stores a context prompt."""
    hashes = block_hashes(tokens, TPB)
    usable = len(tokens) - 1
    return [(h, tokens[i * TPB : min((i + 1) * TPB, usable)]) for i, h in enumerate(hashes)]


def new_pool(num_blocks: int = 8, events: KvEventBuffer | None = None) -> BlockPool:
    return BlockPool(num_blocks, TPB, reuse=True, events=events)


def stored_hashes(events: list[dict]) -> list[int]:
    return [b["block_hash"] for e in events if e["data"]["type"] == "stored" for b in e["data"]["blocks"]]


def test_a_stored_prompt_is_matched_by_a_second_request_with_the_same_prefix():
    pool = new_pool()
    prompt = list(range(100, 113))  # 13 tokens: 12 usable = 3 full blocks
    blocks = chain(prompt)
    a = pool.acquire([], 4)
    assert pool.store(a, None, blocks) == 3
    pool.release(a)
    hashes = block_hashes(prompt, TPB)
    assert pool.match(hashes) == 3
    longer = block_hashes(prompt + [7, 8, 9], TPB)
    assert pool.match(longer) == 3
    assert pool.match(block_hashes([1] + prompt[1:], TPB)) == 0  # a different first token changes every hash
    b = pool.acquire(hashes[:3], 1)
    assert b is not None and b.held == hashes[:3]
    assert pool.num_evictable == 0  # reuse pinned them again
    pool.check_invariants([b])


def test_unreferenced_blocks_are_evicted_least_recently_released_first_leaf_before_parent():
    events = KvEventBuffer(100, window_size=1)
    pool = new_pool(4, events)
    a_blocks = chain([1, 2, 3, 4, 5, 6, 7, 8, 9])  # 2 full blocks
    b_blocks = chain([11, 12, 13, 14, 15, 16, 17, 18, 19])
    a = pool.acquire([], 2)
    pool.store(a, None, a_blocks)
    pool.release(a)
    b = pool.acquire([], 2)
    pool.store(b, None, b_blocks)
    pool.release(b)
    a1, a2 = (h for h, _ in a_blocks)
    b1, b2 = (h for h, _ in b_blocks)
    assert list(pool.lru) == [a2, a1, b2, b1]
    events.drain()

    c = pool.acquire([], 1)
    assert c is not None
    assert [e["data"] for e in events.drain()] == [{"type": "removed", "block_hashes": [a2]}]
    d = pool.acquire([], 2)
    assert d is not None
    assert [e["data"] for e in events.drain()] == [{"type": "removed", "block_hashes": [a1, b2]}]
    assert list(pool.lru) == [b1]
    pool.check_invariants([c, d])


def test_reusing_a_block_refreshes_its_place_in_the_lru():
    pool = new_pool(4)
    a_blocks, b_blocks = chain([1, 2, 3, 4, 5]), chain([6, 7, 8, 9, 10])
    for blocks in (a_blocks, b_blocks):
        x = pool.acquire([], 1)
        pool.store(x, None, blocks)
        pool.release(x)
    (a1, _), (b1, _) = a_blocks[0], b_blocks[0]
    assert list(pool.lru) == [a1, b1]
    again = pool.acquire([a1], 0)
    pool.release(again)
    assert list(pool.lru) == [b1, a1]


def test_referenced_blocks_are_never_evicted_and_a_too_large_allocation_changes_nothing():
    pool = new_pool(4)
    blocks = chain([1, 2, 3, 4, 5, 6, 7, 8, 9])
    pinned = pool.acquire([], 3)
    pool.store(pinned, None, blocks)  # 2 cached (refcount 1) + 1 private
    assert pool.num_free == 1 and pool.num_evictable == 0
    assert pool.acquire([], 2) is None
    assert pool.num_free == 1 and pool.num_cached == 2
    other = pool.acquire([blocks[0][0]], 1)  # sharing a pinned block needs no free block for it
    assert other is not None and pool.hash2block[blocks[0][0]].refcount == 2
    pool.release(pinned)
    assert list(pool.lru) == [blocks[1][0]]  # block 0 is still referenced by `other`
    pool.check_invariants([other])


def test_stored_events_carry_the_same_hashes_and_chain_as_block_hashes():
    events = KvEventBuffer(100, window_size=4096)
    pool = new_pool(16, events)
    prompt = list(range(500, 522))  # 22 tokens: 21 usable -> 5 full blocks + 1 partial
    alloc = pool.acquire([], 6)
    pool.store(alloc, None, chain(prompt))
    drained = events.drain()
    assert drained[0]["data"] == {"type": "created", "num_blocks_per_cache_level": [16, 0]}
    stored = drained[1]
    assert stored["event_id"] == 1 and stored["window_size"] == 4096
    assert stored["data"]["parent_hash"] is None
    assert stored_hashes(drained) == block_hashes(prompt, TPB)
    block = stored["data"]["blocks"][0]
    assert block["type"] == "stored_block" and block["cache_level"] == 0 and block["priority"] == 35
    assert [t["token_id"] for t in block["tokens"]] == prompt[:4]
    assert block["tokens"][0] == {"type": "unique_token", "token_id": 500, "token_extra_id": 0}
    assert len(stored["data"]["blocks"][-1]["tokens"]) == 1  # the partial last block (token 520)

    # A second request with a longer prompt stores only the new blocks, chained on the last shared one.
    longer = prompt + list(range(900, 910))
    hashes = block_hashes(longer, TPB)
    shared = pool.match(hashes)
    assert shared == 5  # the partial block differs (it now holds more tokens)
    other = pool.acquire(hashes[:shared], 4)
    pool.store(other, hashes[shared - 1], chain(longer)[shared:])
    [event] = events.drain()
    assert event["data"]["parent_hash"] == hashes[4]
    assert stored_hashes([event]) == hashes[5:]
    pool.check_invariants([alloc, other])


def test_storing_a_block_another_request_already_stored_shares_it_and_emits_nothing():
    events = KvEventBuffer(100, window_size=1)
    pool = new_pool(8, events)
    blocks = chain([1, 2, 3, 4, 5, 6, 7, 8, 9])
    a, b = pool.acquire([], 2), pool.acquire([], 2)
    pool.store(a, None, blocks)
    events.drain()
    assert pool.store(b, None, blocks) == 2
    assert events.drain() == []
    assert b.private == 0 and pool.num_free == 6  # b's two private blocks went back
    assert pool.hash2block[blocks[0][0]].refcount == 2
    pool.check_invariants([a, b])


def test_extension_blocks_equal_the_tail_of_block_hashes():
    tokens = list(range(1, 40))
    full = block_hashes(tokens, TPB)
    for start in (0, 3, 9):
        parent = full[start - 1] if start else None
        assert [h for h, _ in extension_blocks(tokens, TPB, start, parent)] == full[start:]


def test_without_block_reuse_nothing_is_cached_or_reported():
    events = KvEventBuffer(100, window_size=1)
    pool = BlockPool(8, TPB, reuse=False, events=events)
    events.drain()
    blocks = chain([1, 2, 3, 4, 5, 6, 7, 8, 9])
    alloc = pool.acquire([], 3)
    assert pool.store(alloc, None, blocks) == 0
    pool.release(alloc)
    assert pool.match([h for h, _ in blocks]) == 0
    assert pool.num_free == 8 and events.drain() == []


def test_clear_drops_evictable_blocks_and_reports_all_cleared():
    events = KvEventBuffer(100, window_size=1)
    pool = new_pool(8, events)
    alloc = pool.acquire([], 2)
    pool.store(alloc, None, chain([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    pool.release(alloc)
    events.drain()
    assert pool.clear() == 2
    assert [e["data"] for e in events.drain()] == [{"type": "all_cleared"}]
    assert pool.num_free == 8


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["acquire", "release"]), st.integers(0, 5), st.integers(0, 3)),
        min_size=1,
        max_size=60,
    )
)
def test_block_accounting_holds_under_any_sequence_of_operations(ops):
    pool = new_pool(12, KvEventBuffer(10, window_size=1))
    prompts = [[p * 100 + i for i in range(1 + 3 * p)] for p in range(6)]
    live = []
    for op, which, extra in ops:
        if op == "acquire":
            prompt = prompts[which]
            hashes = block_hashes(prompt, TPB)
            shared = min(pool.match(hashes), (len(prompt) - 1) // TPB)
            alloc = pool.acquire(hashes[:shared], len(hashes) - shared + extra)
            if alloc is None:
                continue
            pool.store(alloc, hashes[shared - 1] if shared else None, chain(prompt)[shared:])
            live.append(alloc)
        elif live:
            pool.release(live.pop(which % len(live)))
        pool.check_invariants(live)
