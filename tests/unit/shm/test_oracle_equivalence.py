"""The native Region and the Python oracle give identical results for any sequence of operations,
in a table of 64 server slots (one word per server set) and in one of 256 whose servers sit in
every word of its sets."""

from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shmdisagg import _native
from shmdisagg.shm.layout import server_flags
from tests.unit.shm.oracle import RowLostModel, TableModel

MAX_WORKERS = 3
SLOTS = st.integers(0, 5)  # indexes into the machine's `slots`
ROLES = st.integers(0, 1)
EXCLUDES = st.integers(-1, 5)
TOKENS = st.integers(0, 1000)


class RegionMatchesOracle(RuleBasedStateMachine):
    max_servers = 64
    slots = (0, 1, 2, 3, 4, 5)  # the server slots the rules use

    def __init__(self) -> None:
        super().__init__()
        self.buf = bytearray(_native.control_size(MAX_WORKERS, self.max_servers))
        self.region = _native.Region(self.buf)
        self.region.init_control(MAX_WORKERS, 0, self.max_servers)
        self.model = TableModel(MAX_WORKERS, self.max_servers)
        self.outstanding: list[tuple[int, int, int]] = []  # (row, slot, tokens)

    def teardown(self) -> None:
        self.region.release()

    @rule(slot=SLOTS, role=ROLES, healthy=st.booleans())
    def publish(self, slot: int, role: int, healthy: bool) -> None:
        slot = self.slots[slot]
        flags = server_flags(True, healthy, role)
        assert self.region.write_server(slot, flags, 1, 2, 3, b"h:1") == self.model.write_server(slot, flags)

    @rule(slot=SLOTS, present=st.booleans(), healthy=st.booleans(), role=ROLES)
    def set_flags(self, slot: int, present: bool, healthy: bool, role: int) -> None:
        slot = self.slots[slot]
        flags = server_flags(present, healthy, role) if present else 0
        assert self.region.set_server_flags(slot, flags) == self.model.set_server_flags(slot, flags)

    @rule()
    def claim(self) -> None:
        want = self.model.claim_row()
        if want is None:
            try:
                self.region.claim_row(1234, 1)
            except _native.SegmentFull:
                return
            raise AssertionError("claim_row succeeded with every row claimed")
        assert self.region.claim_row(1234, 1)[0] == want

    @rule(row=st.integers(0, MAX_WORKERS - 1))
    def reclaim(self, row: int) -> None:
        assert self.region.reclaim_row(row) == self.model.reclaim_row(row)

    @rule(
        row=st.integers(0, MAX_WORKERS - 1),
        role=ROLES,
        exclude=EXCLUDES,
        tokens=TOKENS,
        least=st.booleans(),
        use_tokens=st.booleans(),
    )
    def pick(self, row: int, role: int, exclude: int, tokens: int, least: bool, use_tokens: bool) -> None:
        exclude = self.slots[exclude] if exclude >= 0 else exclude
        try:
            if least:
                want = self.model.pick_least_loaded(row, role, exclude, tokens, use_tokens)
            else:
                want = self.model.pick_round_robin(row, role, exclude, tokens)
        except RowLostModel:
            want = None
        try:
            if least:
                got = self.region.pick_least_loaded(row, role, exclude, tokens, use_tokens)
            else:
                got = self.region.pick_round_robin(row, role, exclude, tokens)
        except _native.RowLost:
            got = None
        assert got == want
        if got is not None and got >= 0:
            self.outstanding.append((row, got, tokens))

    @precondition(lambda self: bool(self.outstanding))
    @rule(index=st.integers(0, 1000))
    def complete(self, index: int) -> None:
        row, slot, tokens = self.outstanding.pop(index % len(self.outstanding))
        assert self.region.complete(row, slot, tokens) == self.model.complete(row, slot, tokens)

    @invariant()
    def same_state(self) -> None:
        assert self.region.read_config() == self.model.masks()
        for slot in self.slots:
            assert self.region.load(slot) == self.model.load(slot)
            assert self.region.routed(slot) == self.model.routed(slot)
        assert self.region.retired() == (self.model.retired_dispatched, self.model.retired_completed)
        assert [r[0] for r in self.region.rows()] == sorted(self.model.rows)


TestRegionMatchesOracle = RegionMatchesOracle.TestCase
TestRegionMatchesOracle.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class WideRegionMatchesOracle(RegionMatchesOracle):
    """256 slots: servers at both ends of every word, so candidate sets, round-robin positions
    and ties span words."""

    max_servers = 256
    slots = (0, 63, 64, 130, 191, 255)


TestWideRegionMatchesOracle = WideRegionMatchesOracle.TestCase
TestWideRegionMatchesOracle.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
