from __future__ import annotations

import orjson
from hypothesis import given
from hypothesis import strategies as st

from shmdisagg.executors.sim.kv_events import KvEventBuffer


def test_a_full_buffer_drops_the_oldest_events_and_counts_them():
    buf = KvEventBuffer(3, window_size=128)
    for h in range(5):
        buf.removed([h])
    assert buf.dropped == 2
    drained = buf.drain()
    assert [e["event_id"] for e in drained] == [2, 3, 4]
    assert [e["data"]["block_hashes"] for e in drained] == [[2], [3], [4]]
    assert buf.drain() == []


def test_event_ids_keep_increasing_across_drains():
    buf = KvEventBuffer(10, window_size=1)
    buf.created(5)
    buf.drain()
    buf.stored(None, [(11, [1, 2])])
    [event] = buf.drain()
    assert event["event_id"] == 1


def test_a_zero_size_buffer_records_nothing():
    buf = KvEventBuffer(0, window_size=1)
    buf.created(5)
    buf.stored(None, [(1, [1])])
    buf.removed([1])
    assert not buf.enabled and buf.drain() == [] and buf.dropped == 0


def test_stored_blocks_can_omit_token_lists():
    buf = KvEventBuffer(10, window_size=1, include_tokens=False)
    buf.stored(7, [(11, [1, 2]), (12, [3])])
    [event] = buf.drain()
    assert event["data"]["parent_hash"] == 7
    assert [b["tokens"] for b in event["data"]["blocks"]] == [[], []]
    assert [b["block_hash"] for b in event["data"]["blocks"]] == [11, 12]


@given(
    blocks=st.lists(st.tuples(st.integers(0, 2**64 - 1), st.lists(st.integers(0, 2**31 - 1), max_size=40)), max_size=6),
    parent=st.none() | st.integers(0, 2**64 - 1),
    include_tokens=st.booleans(),
)
def test_the_fast_json_drain_sends_exactly_the_events_drain_returns(blocks, parent, include_tokens):
    bufs = [KvEventBuffer(10, window_size=64, include_tokens=include_tokens) for _ in range(2)]
    for buf in bufs:
        buf.created(100)
        buf.stored(parent, blocks)
        buf.removed([h for h, _ in blocks])
        buf.all_cleared()
    as_dicts, as_json = bufs[0].drain(), orjson.loads(bufs[1].drain_json())
    for event in as_dicts + as_json:
        event.pop("timestamp")  # each buffer stamped its own emission time
    assert as_json == as_dicts
    assert bufs[1].drain_json() == b"[]"
