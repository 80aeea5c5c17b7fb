"""In-memory Python model of the control table's routing semantics (tests only, no shared memory).

Mirrors `shmdisagg._native.Region` for one process: server flags and masks (of `max_servers`
slots), the per-role round-robin tickets, worker rows and retired totals. Table-driven and
property tests run the same operations on both and compare every result.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RowModel:
    token: int
    n: int
    active_req: list[int] = field(default_factory=list)
    active_tok: list[int] = field(default_factory=list)
    routed: list[int] = field(default_factory=list)
    dispatched: int = 0
    completed: int = 0

    def __post_init__(self) -> None:
        self.active_req, self.active_tok, self.routed = [0] * self.n, [0] * self.n, [0] * self.n


class RowLostModel(Exception):
    pass


class TableModel:
    """Single-process reference: same inputs as the native Region, same outputs."""

    def __init__(self, max_workers: int, max_servers: int = 64) -> None:
        self.max_workers = max_workers
        self.n = max_servers
        self.flags = [0] * max_servers
        self.incarnation = [0] * max_servers
        self.version = 0
        self.rr = [0, 0]
        self.rows: dict[int, RowModel] = {}
        self.retired_routed = [0] * max_servers
        self.retired_dispatched = 0
        self.retired_completed = 0

    # -- coordinator
    def write_server(self, slot: int, flags: int) -> int:
        self.incarnation[slot] += 1
        self.set_server_flags(slot, flags)
        return self.incarnation[slot]

    def set_server_flags(self, slot: int, flags: int) -> int:
        self.flags[slot] = flags
        self.version += 1
        return self.version

    def reclaim_row(self, row: int) -> bool:
        r = self.rows.pop(row, None)
        if r is None:
            return False
        for s in range(self.n):
            self.retired_routed[s] += r.routed[s]
        self.retired_dispatched += r.dispatched
        self.retired_completed += r.completed
        return True

    # -- worker
    def claim_row(self) -> int | None:
        for row in range(self.max_workers):
            if row not in self.rows:
                self.rows[row] = RowModel(token=row + 1, n=self.n)
                return row
        return None

    def _candidates(self, role: int, exclude: int) -> list[int]:
        return [
            s
            for s in range(self.n)
            if self.flags[s] & 1 and self.flags[s] & 2 and (self.flags[s] >> 8) == role and s != exclude
        ]

    def _own(self, row: int) -> RowModel:
        if row not in self.rows:
            raise RowLostModel(row)
        return self.rows[row]

    def _add(self, r: RowModel, slot: int, tokens: int) -> None:
        r.active_req[slot] += 1
        r.active_tok[slot] += tokens
        r.routed[slot] += 1
        r.dispatched += 1

    def pick_round_robin(self, row: int, role: int, exclude: int, tokens: int) -> int:
        r = self._own(row)
        cand = self._candidates(role, exclude)
        if not cand:
            return -1
        slot = cand[self.rr[role] % len(cand)]
        self.rr[role] += 1
        self._add(r, slot, tokens)
        return slot

    def pick_least_loaded(self, row: int, role: int, exclude: int, tokens: int, use_tokens: bool) -> int:
        r = self._own(row)
        cand = self._candidates(role, exclude)
        if not cand:
            return -1
        loads = {s: sum((x.active_tok if use_tokens else x.active_req)[s] for x in self.rows.values()) for s in cand}
        best = min(loads.values())
        tied = [s for s in cand if loads[s] == best]
        if len(tied) == 1:
            slot = tied[0]
        else:
            slot = tied[self.rr[role] % len(tied)]
            self.rr[role] += 1
        self._add(r, slot, tokens)
        return slot

    def complete(self, row: int, slot: int, tokens: int) -> bool:
        r = self.rows.get(row)
        if r is None:
            return False
        r.active_req[slot] -= 1
        r.active_tok[slot] -= tokens
        r.completed += 1
        return True

    # -- stats
    def load(self, slot: int) -> tuple[int, int]:
        return (
            sum(r.active_req[slot] for r in self.rows.values()),
            sum(r.active_tok[slot] for r in self.rows.values()),
        )

    def routed(self, slot: int) -> int:
        return self.retired_routed[slot] + sum(r.routed[slot] for r in self.rows.values())

    def masks(self) -> tuple[int, int, int, int, int]:
        present = healthy = ctx = gen = 0
        for s in range(self.n):
            f = self.flags[s]
            if f & 1:
                present |= 1 << s
                healthy |= (1 << s) if f & 2 else 0
                if f >> 8 == 0:
                    ctx |= 1 << s
                else:
                    gen |= 1 << s
        return present, healthy, ctx, gen, self.version
