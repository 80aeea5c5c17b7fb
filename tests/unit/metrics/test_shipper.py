"""Records wait while the coordinator is unreachable, bounded, and the drops are counted."""

from __future__ import annotations

import asyncio
from pathlib import Path

from shmdisagg.metrics.schema import LAYOUT
from shmdisagg.metrics.shipper import RecordShipper


def test_undelivered_records_are_kept_then_dropped_oldest_first(tmp_path: Path) -> None:
    row = memoryview(bytearray(8 * LAYOUT.words)).cast("d")

    async def scenario() -> RecordShipper:
        shipper = RecordShipper(str(tmp_path / "nobody.sock"), 0, row, max_pending=3)
        shipper.start()
        try:
            for i in range(5):
                shipper.add((i,))
            assert not await shipper.flush()
        finally:
            await shipper.stop()
        return shipper

    shipper = asyncio.run(scenario())
    assert shipper._pending == [(2,), (3,), (4,)]
    assert shipper.dropped == 2 and row[LAYOUT.counter["shmdisagg_perf_records_dropped"]] == 2
