"""Legs each executor answered, per server slot: what the fleet tells the coordinator's health
checks about the executors it is talking to, without a message on the request path.

A fleet worker adds 1 to word `shmdisagg_server_answered_legs[slot]` of its own metrics row
(`metrics/rows.py`, one memoryview add, about 0.1 us) when a leg's response head arrives from
server `slot` with a status below 500 (`LegRunner.open`): the executor accepted the request and
answered it, so it is alive, whatever its `/health` does meanwhile. The coordinator sums that
word over every row (`answered_reader`, one 8-byte read per row) when a probe fails
(`coordinator/health.py`): a sum that grew since the failed probes began is a leg answered in
that window. The sum only grows in one coordinator's life: a dead worker's row is folded into
the retired row by the coordinator itself, on the same event loop as the health checks.
"""

from __future__ import annotations

from collections.abc import Callable

from shmdisagg.metrics.rows import MetricsSegment
from shmdisagg.metrics.schema import LAYOUT, MAX_SERVERS

_BASE = LAYOUT.per_server["shmdisagg_server_answered_legs"]


class AnsweredLegs:
    """The writer, over one fleet worker's metrics row (float64 words)."""

    __slots__ = ("_row",)

    def __init__(self, row: memoryview[float]) -> None:
        self._row = row

    def add(self, slot: int) -> None:
        """One more leg answered by server `slot` (a slot outside the table is ignored)."""
        if 0 <= slot < MAX_SERVERS:
            self._row[_BASE + slot] += 1.0


def answered_reader(segment: MetricsSegment) -> Callable[[int], float]:
    """`slot -> legs answered by it`, summed over the whole fleet (dead workers included)."""

    def answered(slot: int) -> float:
        return segment.word_total(_BASE + slot) if 0 <= slot < MAX_SERVERS else 0.0

    return answered
