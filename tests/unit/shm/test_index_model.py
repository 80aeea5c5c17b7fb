"""The native block index and the Python dict model agree under any sequence of KV events,
routed picks, TTL sweeps, server clears and generation swaps (hypothesis stateful)."""

from __future__ import annotations

import time
from array import array

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from shmdisagg import _native
from shmdisagg.shm.layout import ROLE_CONTEXT, server_flags
from tests.unit.shm.index_model import IndexModel

SERVERS = 4
CAP_LOG2 = 8  # 256 slots, 153 keys at most: the pool below never fills it
POOL = [0, 1, 2, 3, 0xFFFFFFFFFFFFFFFF, 1 << 63, 12345, 99, 7, 8, 1 << 40, 5]
HASH_LISTS = st.lists(st.sampled_from(POOL), min_size=0, max_size=8)
SLOTS = st.integers(0, SERVERS - 1)
TTL_NS = 10**12
CANDIDATES = (1 << SERVERS) - 1


def pack(hashes: list[int]) -> bytes:
    return array("Q", hashes).tobytes()


class IndexMatchesModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ctl_buf = bytearray(_native.control_size(2))
        self.ctl = _native.Region(self.ctl_buf)
        self.ctl.init_control(2, 0)
        for s in range(SERVERS):
            self.ctl.write_server(s, server_flags(True, True, ROLE_CONTEXT), 64, 32, 0, b"h:1")
        self.row, _ = self.ctl.claim_row(4321, 1)
        self.generation = 0
        self.buffers: list[bytearray] = []
        self.ix = self._new_generation()
        self.model = IndexModel()

    def _new_generation(self) -> _native.Index:
        self.generation += 1
        buf = bytearray(_native.IX_HEADER_BYTES + _native.IX_SLOT_BYTES * (1 << CAP_LOG2))
        self.buffers.append(buf)
        ix = _native.Index(buf, self.ctl)
        ix.init_index(self.generation, CAP_LOG2, int((1 << CAP_LOG2) * 0.6), 0)
        return ix

    def _publish(self, ix: _native.Index) -> None:
        ix.publish()
        self.ctl.publish_index(ix.generation, ix.capacity, len(self.buffers[-1]), b"/model")

    def teardown(self) -> None:
        self.ix.release()
        self.ctl.release()

    @rule(slot=SLOTS, hashes=HASH_LISTS)
    def stored(self, slot: int, hashes: list[int]) -> None:
        assert self.ix.apply_stored(slot, pack(hashes), 0) == self.model.stored(slot, hashes)

    @rule(slot=SLOTS, hashes=HASH_LISTS)
    def removed(self, slot: int, hashes: list[int]) -> None:
        assert self.ix.apply_removed(slot, pack(hashes)) == self.model.removed(slot, hashes)

    @rule(slot=SLOTS, everything=st.booleans())
    def clear(self, slot: int, everything: bool) -> None:
        op = self.ix.clear_server if everything else self.ix.apply_all_cleared
        assert op(slot) == self.model.clear(slot)

    @rule(hashes=HASH_LISTS, exclude=st.integers(-1, SERVERS - 1))
    def pick(self, hashes: list[int], exclude: int) -> None:
        if self.ix.state != 1:
            self._publish(self.ix)
        cand = CANDIDATES & ~(1 << exclude if exclude >= 0 else 0)
        depths = self.model.depths(hashes, cand)
        slot, matched = self.ix.pick_kv(self.row, ROLE_CONTEXT, exclude, pack(hashes), 10, 0.25,
                                         float("inf"), False, True)
        self.ctl.complete(self.row, slot, 10)  # loads stay 0, so the score is the depth alone
        assert matched == depths[slot] == max(depths.values())
        self.model.routed(slot, hashes)

    @rule(expire=st.booleans())
    def sweep(self, expire: bool) -> None:
        now = time.monotonic_ns() + (2 * TTL_NS if expire else 0)
        census = self.ix.sweep(now, TTL_NS, 1000, 1000)
        expired = self.model.expire_routed() if expire else 0
        assert census["routed_expired"] == expired
        assert (census["used"], census["live"], census["dead"]) == self.model.census()

    @rule()
    def resize(self) -> None:
        new = self._new_generation()
        copied, refused = self.ix.copy_into(new)
        self.model.compact()
        assert (copied, refused) == (len(self.model.slots), 0)
        self._publish(new)
        old, self.ix = self.ix, new
        assert old.pick_kv(self.row, ROLE_CONTEXT, -1, b"", 0, 0.0, 1.0, False, False) is None
        old.release()

    @invariant()
    def same_masks_and_depths(self) -> None:
        for h in POOL:
            got = self.ix.lookup(h)
            assert (None if got is None else got[:2]) == self.model.masks(h), h
        if self.ix.state == 1:
            want = self.model.depths(POOL, CANDIDATES)
            assert dict(self.ix.match(pack(POOL))) == want
            for k in range(len(POOL)):
                assert dict(self.ix.match(pack(POOL[k:]))) == self.model.depths(POOL[k:], CANDIDATES)


TestIndexMatchesModel = IndexMatchesModel.TestCase
TestIndexMatchesModel.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
