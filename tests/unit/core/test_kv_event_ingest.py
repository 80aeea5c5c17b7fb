"""The coordinator's KV event ingest against a real shared index: event-stream integrity
(gaps, restarts, `created`), attention windows, every upstream hash form, per-server counters."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from shmdisagg.coordinator.health import Executor
from shmdisagg.coordinator.kv_events import KvEventIngestor
from shmdisagg.coordinator.routing_keys import RoutingKeys
from shmdisagg.hashing import block_hashes_for, block_keys_v2
from shmdisagg.metrics.schema import LAYOUT
from shmdisagg.shm.index import BlockIndex
from shmdisagg.shm.table import ROLE_CONTEXT, ControlTable


class Rig:
    def __init__(self, table: ControlTable, index: BlockIndex, keys: RoutingKeys | None) -> None:
        self.table, self.index, self.keys = table, index, keys
        self.row = memoryview(bytearray(8 * LAYOUT.words)).cast("d")
        self.restarted: list[int] = []
        self.key_changes: list[int] = []
        self.ing = KvEventIngestor(
            index,
            [Executor(0, ROLE_CONTEXT, "127.0.0.1", 1), Executor(1, ROLE_CONTEXT, "127.0.0.1", 2)],
            keys,
            row=self.row,
            on_restart=self.restarted.append,
            on_key_change=self.key_changes.append,
        )

    def feed(self, slot: int, events: list[dict[str, Any]], fast: bool = True) -> None:
        if fast:
            self.ing.apply_raw(slot, orjson.dumps(events), 1.0)
        else:
            self.ing.apply(slot, events, 1.0)

    def bits(self, h: int, slot: int = 0) -> tuple[bool, bool]:
        """(event bit, routed bit) of `slot` on block `h`."""
        found = self.index.lookup(h)
        if found is None:
            return False, False
        return bool(found[0] >> slot & 1), bool(found[1] >> slot & 1)

    def counter(self, name: str, slot: int = 0) -> float:
        return self.row[LAYOUT.per_server[name] + slot]


@pytest.fixture
def rig(shm_prefix: str) -> Iterator[Rig]:
    with ControlTable.create(shm_prefix) as table:
        table.publish_server(0, "127.0.0.1:1", ROLE_CONTEXT, True, tokens_per_block=32)
        table.publish_server(1, "127.0.0.1:2", ROLE_CONTEXT, True, tokens_per_block=32)
        with BlockIndex.create(table) as index:
            keys = RoutingKeys({ROLE_CONTEXT: ("context", None)})
            for slot in (0, 1):
                assert (
                    keys.admit(
                        slot,
                        ROLE_CONTEXT,
                        f"127.0.0.1:{slot + 1}",
                        {"kv_cache_hash_algo": "v1_block_key", "tokens_per_block": 32},
                        True,
                    )
                    is None
                )
            yield Rig(table, index, keys)
            index.unlink()
        table.unlink()


def created(i: int | None, window: int | None = 4096, **extra: Any) -> dict[str, Any]:
    return {
        "event_id": i,
        "data": {"type": "created", "num_blocks_per_cache_level": [100, 0]},
        "window_size": window,
        **extra,
    }


def stored(i: int | None, hashes: list[Any], window: int | None = 4096, **extra: Any) -> dict[str, Any]:
    blocks = [{"type": "stored_block", "block_hash": h, "tokens": [], "cache_level": 0, "priority": 35} for h in hashes]
    return {
        "event_id": i,
        "data": {"type": "stored", "parent_hash": None, "blocks": blocks},
        "window_size": window,
        **extra,
    }


def removed(i: int | None, hashes: list[Any], window: int | None = 4096, **extra: Any) -> dict[str, Any]:
    return {"event_id": i, "data": {"type": "removed", "block_hashes": hashes}, "window_size": window, **extra}


@pytest.mark.parametrize("fast", [True, False], ids=["typed", "tolerant"])
def test_an_event_id_gap_clears_the_server_s_event_and_routed_bits_and_is_counted(rig: Rig, fast: bool) -> None:
    rig.feed(0, [created(0), stored(1, [11, 12])], fast)
    rig.feed(1, [created(0), stored(1, [11])], fast)
    row = rig.table.claim_row(1, 1)
    routed = struct.pack("<2Q", 21, 22)
    assert rig.index.pick_kv(row, ROLE_CONTEXT, 1, routed, 2)[0] == 0  # routed bits on server 0
    assert rig.bits(11) == (True, False) and rig.bits(21) == (False, True)
    rig.feed(0, [stored(4, [13])], fast)  # events 2 and 3 were lost: their removals are unknown
    assert rig.bits(11) == (False, False) and rig.bits(12) == (False, False) and rig.bits(21) == (False, False)
    assert rig.bits(13) == (True, False)  # what came after the gap is applied
    assert rig.bits(11, slot=1) == (True, False)  # the other server is untouched
    assert rig.ing.event_gaps == 1 and rig.ing.restarts == 0
    assert rig.counter("shmdisagg_server_kv_event_gaps") == 1 and rig.counter("shmdisagg_server_kv_event_gaps", 1) == 0
    assert rig.ing.server_state(0)["event_gaps"] == 1 and rig.ing.server_state(0)["last_event_id"] == 4
    rig.feed(0, [stored(5, [14]), removed(6, [14])], fast)  # continuous again: nothing cleared
    assert rig.bits(13) == (True, False) and rig.ing.event_gaps == 1


def test_holes_in_a_stream_not_known_complete_are_counted_but_clear_nothing(rig: Rig) -> None:
    # joined after its opening events (or behind TensorRT-LLM's KvEventFanout, which keeps only
    # the largest window's stored/removed events with their engine ids): a hole may be a filtered
    # event, not a lost one
    rig.feed(1, [stored(57, [31]), stored(59, [32])])
    assert rig.ing.event_gaps == 0 and rig.bits(31, slot=1) == (True, False)
    assert rig.ing.server_state(1)["event_id_skips"] == 1 and rig.ing.server_state(1)["stream_complete"] is False
    # an updated event shows nothing is filtered: from then on a hole is a loss
    rig.feed(1, [{"event_id": 60, "data": {"type": "updated", "block_hash": 31}}, stored(62, [33])])
    assert rig.ing.event_gaps == 1 and rig.bits(31, slot=1) == (False, False) and rig.bits(33, slot=1) == (True, False)


@pytest.mark.parametrize("fast", [True, False], ids=["typed", "tolerant"])
def test_an_event_id_that_goes_back_is_a_restart_clearing_the_server_and_reading_its_server_info_again(
    rig: Rig, fast: bool
) -> None:
    rig.feed(0, [created(0), stored(1, [11]), stored(2, [12])], fast)
    # restarted on the same port between two health polls: its new stream begins again
    rig.feed(0, [created(0), stored(1, [41])], fast)
    assert rig.bits(11) == (False, False) and rig.bits(12) == (False, False) and rig.bits(41) == (True, False)
    assert rig.ing.restarts == 1 and rig.ing.event_gaps == 0
    assert rig.counter("shmdisagg_server_kv_cache_restarts") == 1
    assert rig.restarted == [0]


def test_a_created_event_after_other_events_is_a_restart_even_without_event_ids(rig: Rig) -> None:
    rig.feed(0, [created(None), created(None, window=128), stored(None, [11])])  # the opening created events are not
    assert rig.ing.restarts == 0 and rig.bits(11) == (True, False)
    rig.feed(0, [created(None), stored(None, [12])])
    assert rig.ing.restarts == 1 and rig.bits(11) == (False, False) and rig.bits(12) == (True, False)


def test_only_the_largest_attention_window_s_events_are_applied(rig: Rig) -> None:
    # VSWA: one created event per window opens the stream (TensorRT-LLM's fanout keeps the largest)
    rig.feed(0, [created(0, 512), created(1, 4096), stored(2, [11], window=512), stored(3, [12], window=4096)])
    rig.feed(0, [removed(4, [12], window=512), stored(5, [13], window=None)])
    assert rig.bits(11) == (False, False)  # the small window's copy is not what a prompt reuses
    assert rig.bits(12) == (True, False)  # its eviction in the small window does not evict it
    assert rig.bits(13) == (True, False)  # no window: applied
    assert rig.ing.window_skipped_events == 2 and rig.ing.server_state(0)["max_window_size"] == 4096
    assert rig.ing.restarts == 0 and rig.ing.event_gaps == 0


def test_attention_dp_ranks_number_their_events_apart(rig: Rig) -> None:
    events = [
        created(0, attention_dp_rank=0),
        created(0, attention_dp_rank=1),
        stored(1, [11], attention_dp_rank=1),
        stored(1, [12], attention_dp_rank=0),
        stored(2, [13], attention_dp_rank=1),
    ]
    rig.feed(0, events)
    assert rig.ing.event_gaps == 0 and rig.ing.restarts == 0
    assert all(rig.bits(h) == (True, False) for h in (11, 12, 13))


@pytest.mark.parametrize("fast", [True, False], ids=["typed", "tolerant"])
def test_v2_sha256_hex_keys_and_v2_sha256_64_ints_land_on_the_keys_the_router_hashes(rig: Rig, fast: bool) -> None:
    prompt = list(range(1000, 1100))
    want = struct.unpack(f"<{len(prompt) // 32 + 1}Q", block_hashes_for("v2_sha256", prompt, 32))
    hexes = [k.hex() for k in block_keys_v2(prompt, 32)]
    rig.feed(
        0,
        [
            created(0, hash_algo="v2_sha256"),
            stored(1, hexes[:2], hash_algo="v2_sha256"),
            removed(2, hexes[1:2], hash_algo="v2_sha256"),
        ],
        fast,
    )
    assert rig.bits(want[0]) == (True, False) and rig.bits(want[1]) == (False, False)
    assert rig.keys is not None and rig.keys.configs()["context"]["kv_cache_hash_algo"] == "v2_sha256"
    assert rig.key_changes == [0]  # the role moved from the claimed v1_block_key: workers re-read it
    rig.feed(1, [created(0, hash_algo="v2_sha256_64"), stored(1, list(want[2:4]), hash_algo="v2_sha256_64")], fast)
    assert rig.bits(want[2], slot=1) == (True, False) and rig.bits(want[3], slot=1) == (True, False)
    assert rig.ing.dropped_events == 0


def test_events_of_an_algorithm_the_router_cannot_compute_or_with_bad_hashes_are_dropped(rig: Rig) -> None:
    rig.feed(
        0,
        [
            created(0),
            stored(1, [11], hash_algo="v3_sha512"),
            stored(2, ["0x0011223344556677"]),
            stored(3, ["abcd"]),
            removed(4, [True]),
            stored(5, [12]),
        ],
    )
    assert rig.ing.dropped_events == 4 and rig.bits(11) == (False, False) and rig.bits(12) == (True, False)
    assert rig.ing.event_gaps == 0  # a dropped event still counts for the stream


def test_updated_events_change_nothing_as_upstream(rig: Rig) -> None:
    upd = {
        "event_id": 2,
        "data": {
            "type": "updated",
            "block_hash": 11,
            "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
            "priority": {"type": "event_diff", "new_value": 35, "old_value": 35},
        },
        "window_size": 4096,
    }
    rig.feed(0, [created(0), stored(1, [11]), upd])
    assert rig.bits(11) == (True, False) and rig.ing.dropped_events == 0 and rig.ing.applied_events == 3
