from __future__ import annotations

import orjson
from hypothesis import given, strategies as st

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
    bufs = [KvEventBuffer(10, window_size=64, include_tokens=include_tokens, timestamps=True) for _ in range(2)]
    for buf in bufs:
        buf.created(100)
        buf.stored(parent, blocks)
        buf.removed([h for h, _ in blocks])
        buf.all_cleared()
    as_dicts, as_json = bufs[0].drain(), orjson.loads(bufs[1].drain_json())
    for event in as_dicts + as_json:
        assert isinstance(event.pop("timestamp"), float)  # each buffer stamped its own emission time
    assert as_json == as_dicts
    assert bufs[1].drain_json() == b"[]"


def test_v2_sha256_events_carry_hex_keys_and_their_algorithm_as_kv_cache_manager_v2_does():
    from shmdisagg.executors.sim.block_keys import block_hashes
    from shmdisagg.hashing import block_keys_v2

    tokens = list(range(100, 170))
    keys = block_keys_v2(tokens, 16)
    hashes = block_hashes(tokens, 16, "v2_sha256")
    buf = KvEventBuffer(10, window_size=128, hash_algo="v2_sha256")
    buf.created(4)
    buf.stored(None, [(hashes[0], tokens[:16]), (hashes[1], tokens[16:32])])
    buf.removed([hashes[1]])
    events = buf.drain()
    assert [e["hash_algo"] for e in events] == ["v2_sha256"] * 3
    assert [e["event_id"] for e in events] == [0, 1, 2]
    assert [b["block_hash"] for b in events[1]["data"]["blocks"]] == [keys[0].hex(), keys[1].hex()]
    assert events[1]["data"]["parent_hash"] is None
    assert events[2]["data"]["block_hashes"] == [keys[1].hex()]
    # the fast serialiser writes the same
    buf.stored(hashes[0], [(hashes[1], tokens[16:32])])
    [event] = orjson.loads(buf.drain_json())
    assert event["data"]["parent_hash"] == keys[0].hex()
    assert [b["block_hash"] for b in event["data"]["blocks"]] == [keys[1].hex()]


def test_v2_sha256_64_events_carry_the_truncated_keys_as_ints():
    from shmdisagg.executors.sim.block_keys import block_hashes
    from shmdisagg.hashing import block_keys_v2, v2_key_to_u64

    tokens = list(range(40))
    hashes = block_hashes(tokens, 16, "v2_sha256_64")
    assert hashes == [v2_key_to_u64(k) for k in block_keys_v2(tokens, 16)]
    buf = KvEventBuffer(10, window_size=128, hash_algo="v2_sha256_64")
    buf.stored(None, [(hashes[0], tokens[:16])])
    [event] = orjson.loads(buf.drain_json())
    assert event["hash_algo"] == "v2_sha256_64" and event["data"]["blocks"][0]["block_hash"] == hashes[0]


def test_v1_events_carry_no_hash_algo_as_the_cpp_manager_s_do():
    buf = KvEventBuffer(10, window_size=128)
    buf.created(4)
    assert "hash_algo" not in buf.drain()[0]


def test_lost_events_leave_a_gap_in_the_event_ids_and_are_counted():
    buf = KvEventBuffer(10, window_size=1)
    buf.created(5)
    buf.drop_next(2)
    buf.removed([1])
    buf.removed([2])
    buf.removed([3])
    drained = buf.drain()
    assert [e["event_id"] for e in drained] == [0, 3]
    assert buf.dropped == 2


def test_a_restart_empties_the_buffer_and_starts_the_ids_again_with_one_created_event():
    buf = KvEventBuffer(10, window_size=64)
    buf.created(5)
    buf.removed([1])
    buf.drain()
    buf.removed([2])
    buf.restart(7)
    drained = buf.drain()
    assert [(e["event_id"], e["data"]["type"]) for e in drained] == [(0, "created")]
    assert drained[0]["data"]["num_blocks_per_cache_level"] == [7, 0] and drained[0]["window_size"] == 64
    assert buf.restarts == 1


def test_events_carry_no_timestamp_unless_asked_as_tensorrt_llm_s_serializer():
    buf = KvEventBuffer(10, window_size=64)
    buf.created(100)
    buf.stored(None, [(5, [1, 2])])
    events = orjson.loads(buf.drain_json())
    assert [sorted(e) for e in events] == [["data", "event_id", "window_size"]] * 2
    assert sorted(events[1]["data"]["blocks"][0]) == [
        "block_hash",
        "cache_level",
        "lora_id",
        "mm_keys",
        "priority",
        "tokens",
        "type",
    ]
