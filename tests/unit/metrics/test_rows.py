"""The metrics segment: one writer per row, sums over rows, exact folding of a dead worker's row."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shmdisagg.metrics.rows import ROW_COORDINATOR, ROW_RETIRED, MetricsSegment, segment_name, worker_row
from shmdisagg.metrics.schema import LAYOUT
from shmdisagg.shm.segment import Segment, SegmentNotReady


@pytest.fixture
def segment(shm_prefix: str) -> Iterator[MetricsSegment]:
    seg = MetricsSegment.create(shm_prefix, num_workers=3)
    yield seg
    seg.close()
    seg.unlink()


def test_attach_sees_the_creators_rows_and_sums_them(segment: MetricsSegment, shm_prefix: str) -> None:
    total = LAYOUT.counter["total_requests"]
    worker = MetricsSegment.attach(shm_prefix)
    try:
        worker.row(worker_row(0))[total] += 3
        worker.row(worker_row(2))[total] += 4
        segment.row(ROW_COORDINATOR)[total] += 1
        assert segment.totals()[total] == 8
        assert segment.rows == 5 and segment.words == LAYOUT.words
    finally:
        worker.close()


def test_fold_keeps_totals_and_zeroes_the_dead_row(segment: MetricsSegment) -> None:
    total = LAYOUT.counter["total_requests"]
    row = segment.row(worker_row(1))
    row[LAYOUT.pid] = 4242
    row[total] += 5
    row[LAYOUT.hist["queue_latency_seconds"]] += 2
    before = segment.totals()
    segment.fold(worker_row(1))
    after = segment.totals()
    assert after[total] == before[total] == 5
    assert after[LAYOUT.hist["queue_latency_seconds"]] == 2
    assert all(x == 0.0 for x in row.tolist())  # the replacement starts from zero
    assert segment.snapshot()[ROW_RETIRED][LAYOUT.pid] == 0  # pids are not summed into the retired row


def test_read_only_attach_cannot_write(segment: MetricsSegment, shm_prefix: str) -> None:
    reader = MetricsSegment.attach(shm_prefix, read_only=True)
    try:
        with pytest.raises(TypeError):
            reader.row(ROW_COORDINATOR)[0] = 1.0
        assert reader.totals() == segment.totals()
    finally:
        reader.close()


def test_a_segment_of_another_layout_is_refused(shm_prefix: str) -> None:
    other = Segment.create(segment_name(shm_prefix), 4096)
    try:
        other.mm[0:8] = b"NOTMETRC"
        with pytest.raises(SegmentNotReady):
            MetricsSegment.attach(shm_prefix)
    finally:
        other.close()
        other.unlink()


def test_missing_segment_raises_file_not_found(shm_prefix: str) -> None:
    with pytest.raises(FileNotFoundError):
        MetricsSegment.attach(shm_prefix)


def test_row_out_of_range(segment: MetricsSegment) -> None:
    with pytest.raises(IndexError):
        segment.row(segment.rows)


def test_folding_a_row_equal_to_another_keeps_the_other_releasable(segment: MetricsSegment) -> None:
    # pins a bug: rows were forgotten by content (list.remove), so folding an all-zero row
    # dropped the coordinator's (also all-zero) row view and close() failed with BufferError
    segment.row(ROW_COORDINATOR)
    segment.fold(worker_row(0))
    segment.close()  # must not raise


def test_requests_in_flight_on_a_dead_worker_are_counted_lost_so_in_flight_returns_to_zero(
    segment: MetricsSegment,
) -> None:
    # pins a bug: after kill -9, `shmdisagg stats` showed the dead worker's 7 requests in flight forever
    c = LAYOUT.counter
    row = segment.row(worker_row(0))
    row[c["total_requests"]] += 10
    row[c["stream_requests"]] += 3  # 3 finished, 7 still in flight when it died
    segment.fold(worker_row(0))
    totals = segment.totals()
    assert totals[c["shmdisagg_worker_lost_requests"]] == 7
    assert totals[c["total_requests"]] == 10  # totals never drop
