"""The native block index and the Python dict model agree under any sequence of KV events,
routed picks, TTL sweeps, server clears and generation swaps (hypothesis stateful).

Two machines: random hash lists with holes everywhere, where pick_kv's depth is the model's jump
walk (`IndexModel.jump_depths`); and prefix-closed states (a tree of chained prompts, prefixes
stored, subtrees removed, whole servers cleared), where it must equal the linear walk. Each runs
beside a table of 64 server slots (one-word masks, 32-byte slots) and of 256, its servers in
different words of the masks (80-byte slots)."""

from __future__ import annotations

import time
from array import array

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shmdisagg import _native
from shmdisagg.shm.layout import ROLE_CONTEXT, index_slot_bytes, server_flags
from tests.unit.shm.index_model import IndexModel

SERVERS = 4
CAP_LOG2 = 8  # 256 slots, 153 keys at most: the pool below never fills it
JUMP = _native.IX_JUMP
POOL = [0, 1, 2, 3, 0xFFFFFFFFFFFFFFFF, 1 << 63, 12345, 99, 7, 8, 1 << 40, 5]
HASH_LISTS = st.lists(st.sampled_from(POOL), min_size=0, max_size=2 * JUMP + 3)  # up to 3 windows
SLOTS = st.integers(0, SERVERS - 1)  # indexes into the machine's `slots`
TTL_NS = 10**12


def pack(hashes: list[int]) -> bytes:
    return array("Q", hashes).tobytes()


class _IndexMachine(RuleBasedStateMachine):
    """A control region of `max_servers` slots with SERVERS healthy context servers (at
    `slots`), a claimed row, and index generations of 2**cap_log2 slots in private buffers,
    mirrored by an `IndexModel`."""

    cap_log2 = CAP_LOG2
    max_servers = 64
    slots = (0, 1, 2, 3)

    def __init__(self) -> None:
        super().__init__()
        self.ctl_buf = bytearray(_native.control_size(2, self.max_servers))
        self.ctl = _native.Region(self.ctl_buf)
        self.ctl.init_control(2, 0, self.max_servers)
        self.candidates = sum(1 << s for s in self.slots)
        for s in self.slots:
            self.ctl.write_server(s, server_flags(True, True, ROLE_CONTEXT), 64, 32, 0, b"h:1")
        self.row, _ = self.ctl.claim_row(4321, 1)
        self.generation = 0
        self.buffers: list[bytearray] = []
        self.ix = self._new_generation()
        self.model = IndexModel()

    def _new_generation(self) -> _native.Index:
        self.generation += 1
        buf = bytearray(_native.IX_HEADER_BYTES + index_slot_bytes(self.max_servers) * (1 << self.cap_log2))
        self.buffers.append(buf)
        ix = _native.Index(buf, self.ctl)
        ix.init_index(self.generation, self.cap_log2, int((1 << self.cap_log2) * 0.6), 0)
        return ix

    def _publish(self, ix: _native.Index) -> None:
        ix.publish()
        self.ctl.publish_index(ix.generation, ix.capacity, len(self.buffers[-1]), b"/model")


class IndexMatchesModel(_IndexMachine):
    def teardown(self) -> None:
        self.ix.release()
        self.ctl.release()

    @rule(slot=SLOTS, hashes=HASH_LISTS)
    def stored(self, slot: int, hashes: list[int]) -> None:
        slot = self.slots[slot]
        assert self.ix.apply_stored(slot, pack(hashes), 0) == self.model.stored(slot, hashes)

    @rule(slot=SLOTS, hashes=HASH_LISTS)
    def removed(self, slot: int, hashes: list[int]) -> None:
        slot = self.slots[slot]
        assert self.ix.apply_removed(slot, pack(hashes)) == self.model.removed(slot, hashes)

    @rule(slot=SLOTS, everything=st.booleans())
    def clear(self, slot: int, everything: bool) -> None:
        slot = self.slots[slot]
        op = self.ix.clear_server if everything else self.ix.apply_all_cleared
        assert op(slot) == self.model.clear(slot)

    @rule(hashes=HASH_LISTS, exclude=st.integers(-1, SERVERS - 1))
    def pick(self, hashes: list[int], exclude: int) -> None:
        if self.ix.state != 1:
            self._publish(self.ix)
        exclude = self.slots[exclude] if exclude >= 0 else exclude
        cand = self.candidates & ~(1 << exclude if exclude >= 0 else 0)
        depths = self.model.jump_depths(hashes, cand, JUMP)
        slot, matched = self.ix.pick_kv(
            self.row, ROLE_CONTEXT, exclude, pack(hashes), 10, 0.25, float("inf"), False, True
        )
        self.ctl.complete(self.row, slot, 10)  # loads stay 0, so the score is the depth alone
        assert matched == depths[slot] == max(depths.values())
        # routed bits only past the winner's event-only depth (jump walk, at most its match)
        events = self.model.jump_depths(hashes, 1 << slot, JUMP, events_only=True)[slot]
        self.model.routed(slot, hashes[min(events, matched) :])

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
            want = self.model.depths(POOL, self.candidates)
            assert dict(self.ix.match(pack(POOL))) == want
            for k in range(len(POOL)):
                assert dict(self.ix.match(pack(POOL[k:]))) == self.model.depths(POOL[k:], self.candidates)
            for hashes in (POOL * 3, POOL[::-1] * 3, POOL[:JUMP]):
                want = self.model.jump_depths(hashes, self.candidates, JUMP)
                assert dict(self.ix.match(pack(hashes), -1, True)) == want


TestIndexMatchesModel = IndexMatchesModel.TestCase
TestIndexMatchesModel.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


class WideIndexMatchesModel(IndexMatchesModel):
    max_servers = 256
    slots = (0, 63, 64, 255)


TestWideIndexMatchesModel = WideIndexMatchesModel.TestCase
TestWideIndexMatchesModel.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


# -- prefix-closed states: the jump walk must equal the linear walk ----------------------------------

PC_CAP_LOG2 = 10  # 1024 slots; the tree below has at most 3 JUMP + 2 + 3 (JUMP + 2) nodes


class PrefixClosedMatchesLinear(_IndexMachine):
    """A tree of chained prompts (a trunk and up to three branches off it, every node its own
    hash, like parent-chained block hashes). Servers store prompt prefixes, lose whole subtrees
    (an executor evicts leaves first and frees a block's descendants with it) or everything, and
    picks mark routed bits: every server's set stays prefix-closed along every prompt, so the pick's
    jump walk must give exactly the linear depth."""

    cap_log2 = PC_CAP_LOG2

    def __init__(self) -> None:
        super().__init__()
        self.chains: list[list[int]] = []

    def _new_generation(self) -> _native.Index:
        ix = super()._new_generation()
        self._publish(ix)
        return ix

    def teardown(self) -> None:
        self.ix.release()
        self.ctl.release()

    @initialize(
        trunk=st.integers(1, 3 * JUMP + 2),
        branches=st.lists(st.tuples(st.integers(0, 3 * JUMP + 2), st.integers(1, JUMP + 2)), max_size=3),
    )
    def tree(self, trunk: int, branches: list[tuple[int, int]]) -> None:
        fresh = iter(range(1, 1 << 20))  # hash 0 is stored under 1: never use both
        self.chains = [[next(fresh) << 8 for _ in range(trunk)]]
        for at, length in branches:
            self.chains.append(self.chains[0][: min(at, trunk)] + [next(fresh) << 8 for _ in range(length)])

    def _prefix(self, data: st.DataObject) -> tuple[list[int], int]:
        chain = data.draw(st.sampled_from(self.chains))
        return chain, data.draw(st.integers(0, len(chain)))

    @rule(slot=SLOTS, data=st.data())
    def store_prefix(self, slot: int, data: st.DataObject) -> None:
        slot = self.slots[slot]
        chain, k = self._prefix(data)
        assert self.ix.apply_stored(slot, pack(chain[:k]), 0) == self.model.stored(slot, chain[:k])

    @rule(slot=SLOTS, data=st.data())
    def remove_subtree(self, slot: int, data: st.DataObject) -> None:
        slot = self.slots[slot]
        chain, k = self._prefix(data)
        if k == len(chain):
            return
        node = chain[k]  # it and every descendant (a node's depth is its index), leaves first
        below = {(j, c[j]) for c in self.chains if len(c) > k and c[k] == node for j in range(k, len(c))}
        gone = [h for _, h in sorted(below, reverse=True)]
        assert self.ix.apply_removed(slot, pack(gone)) == self.model.removed(slot, gone)

    @rule(slot=SLOTS)
    def clear(self, slot: int) -> None:
        slot = self.slots[slot]
        assert self.ix.apply_all_cleared(slot) == self.model.clear(slot)

    @precondition(lambda self: bool(self.chains))
    @rule(data=st.data(), exclude=st.integers(-1, SERVERS - 1), track=st.booleans())
    def pick(self, data: st.DataObject, exclude: int, track: bool) -> None:
        chain, m = self._prefix(data)
        hashes = chain[:m]
        exclude = self.slots[exclude] if exclude >= 0 else exclude
        cand = self.candidates & ~(1 << exclude if exclude >= 0 else 0)
        linear = self.model.depths(hashes, cand)
        assert self.model.jump_depths(hashes, cand, JUMP) == linear
        slot, matched = self.ix.pick_kv(
            self.row, ROLE_CONTEXT, exclude, pack(hashes), 10, 0.25, float("inf"), False, track
        )
        self.ctl.complete(self.row, slot, 10)
        assert matched == linear[slot] == max(linear.values())
        if track:
            events = self.model.depths(hashes, 1 << slot, events_only=True)[slot]
            assert events <= matched
            self.model.routed(slot, hashes[events:])

    @rule(expire=st.booleans())
    def sweep(self, expire: bool) -> None:
        now = time.monotonic_ns() + (2 * TTL_NS if expire else 0)
        census = self.ix.sweep(now, TTL_NS, 1000, 1000)
        assert census["routed_expired"] == (self.model.expire_routed() if expire else 0)

    @rule()
    def resize(self) -> None:
        old = self.ix
        self.ix = self._new_generation()
        old.copy_into(self.ix)
        self.model.compact()
        old.release()

    @invariant()
    def jump_equals_linear_and_masks_agree(self) -> None:
        for chain in self.chains:
            for h in chain:
                got = self.ix.lookup(h)
                assert (None if got is None else got[:2]) == self.model.masks(h), h
            for m in {0, 1, JUMP - 1, JUMP, JUMP + 1, len(chain)}:
                if m <= len(chain):
                    want = self.model.depths(chain[:m], self.candidates)
                    assert dict(self.ix.match(pack(chain[:m]), -1, True)) == want
                    assert dict(self.ix.match(pack(chain[:m]))) == want


TestPrefixClosedMatchesLinear = PrefixClosedMatchesLinear.TestCase
TestPrefixClosedMatchesLinear.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class WidePrefixClosedMatchesLinear(PrefixClosedMatchesLinear):
    max_servers = 256
    slots = (1, 64, 127, 200)


TestWidePrefixClosedMatchesLinear = WidePrefixClosedMatchesLinear.TestCase
TestWidePrefixClosedMatchesLinear.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
