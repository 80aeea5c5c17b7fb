"""One scrape reports every row of the metrics segment and the table's live state."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shmdisagg.metrics.exposition import FleetCollector, render
from shmdisagg.metrics.rows import MetricsSegment, worker_row
from shmdisagg.metrics.schema import LAYOUT
from shmdisagg.shm.index import BlockIndex, IndexSettings
from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION, ControlTable, process_starttime


@pytest.fixture
def deployment(shm_prefix: str) -> Iterator[tuple[ControlTable, ControlTable, MetricsSegment]]:
    coord = ControlTable.create(shm_prefix, max_workers=4)
    coord.set_coordinator(os.getpid(), process_starttime(os.getpid()), 7)
    coord.coord_heartbeat()
    coord.publish_server(0, "127.0.0.1:1001", ROLE_CONTEXT, True)
    coord.publish_server(1, "127.0.0.1:2001", ROLE_GENERATION, False)
    worker = ControlTable.attach(shm_prefix)
    segment = MetricsSegment.create(shm_prefix, num_workers=2)
    yield coord, worker, segment
    segment.close()
    worker.close()
    coord.unlink()
    coord.close()


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_a_scrape_sums_every_worker_and_reads_the_table(deployment) -> None:  # type: ignore[no-untyped-def]
    coord, worker, segment = deployment
    row = worker.claim_row(os.getpid(), process_starttime(os.getpid()))
    worker.heartbeat(row)
    assert worker.pick_round_robin(row, ROLE_CONTEXT, -1, 300) == 0
    a, b = segment.row(worker_row(0)), segment.row(worker_row(1))
    a[LAYOUT.counter["total_requests"]] += 2
    b[LAYOUT.counter["total_requests"]] += 3
    a[LAYOUT.routing[("generation", "no_server")]] += 1
    a[LAYOUT.per_server["shmdisagg_server_cached_tokens"] + 0] += 64
    base = LAYOUT.hist["queue_latency_seconds"]
    b[base + 1] += 1  # one observation in the second bucket (le=0.005)
    b[base + len(LAYOUT.bounds["queue_latency_seconds"]) + 1] += 0.003

    s = samples(render(FleetCollector(coord, segment, {"context": "load_balancing", "generation": "round_robin"})))
    assert s[("total_requests_total", ())] == 5
    assert (
        s[
            (
                "shmdisagg_routing_decisions_total",
                (("outcome", "no_server"), ("role", "generation"), ("router", "round_robin")),
            )
        ]
        == 1
    )
    assert s[("shmdisagg_server_cached_tokens_total", (("server", "127.0.0.1:1001"),))] == 64
    assert s[("queue_latency_seconds_bucket", (("le", "0.001"),))] == 0
    assert s[("queue_latency_seconds_bucket", (("le", "0.005"),))] == 1
    assert s[("queue_latency_seconds_bucket", (("le", "+Inf"),))] == 1
    assert s[("queue_latency_seconds_sum", ())] == pytest.approx(0.003)
    ctx = (("role", "context"), ("server", "127.0.0.1:1001"))
    assert s[("shmdisagg_server_active_requests", ctx)] == 1 and s[("shmdisagg_server_active_tokens", ctx)] == 300
    assert s[("shmdisagg_server_routed_total", ctx)] == 1
    assert s[("shmdisagg_server_healthy", (("role", "generation"), ("server", "127.0.0.1:2001")))] == 0
    assert s[("shmdisagg_fleet_workers", ())] == 1 and s[("shmdisagg_fleet_in_flight", ())] == 1
    assert s[("shmdisagg_coordinator_heartbeat_age_seconds", ())] < 60
    assert not any(name.startswith("shmdisagg_index_") for name, _ in s)  # none published here


def test_without_a_metrics_segment_the_table_is_still_reported(deployment) -> None:  # type: ignore[no-untyped-def]
    coord, _, _ = deployment
    s = samples(render(FleetCollector(coord, None, {})))
    assert ("total_requests_total", ()) not in s
    assert s[("shmdisagg_server_healthy", (("role", "context"), ("server", "127.0.0.1:1001")))] == 1


def test_the_index_lag_histogram_has_four_buckets_per_octave_from_1us_to_69s(deployment) -> None:  # type: ignore[no-untyped-def]
    coord, _, _ = deployment
    index = BlockIndex.create(coord, IndexSettings(capacity=1 << 10))
    try:
        now = time.time_ns()
        index.apply_stored(0, [1], now + 10**12)  # stamped in the future: lag 0
        index.apply_stored(0, [2], now - 5_000_000)  # ~5 ms
        index.apply_stored(0, [3], now - 100 * 10**9)  # 100 s: past the last finite edge
        s = samples(render(FleetCollector(coord, None, {})))
    finally:
        index.close()
    name = "shmdisagg_index_event_lag_seconds_bucket"
    le = {float(dict(labels)["le"]): v for (n, labels), v in s.items() if n == name}
    edges = sorted(le)
    assert edges[0] == 1.024e-06 and edges[-2] == 68.719476736 and edges[-1] == float("inf")
    assert len(edges) == 106 and all(1.0 < b / a <= 1.25 for a, b in zip(edges[:-2], edges[1:-1], strict=True))
    assert {0.004194304, 0.00524288, 0.006291456, 0.007340032, 0.008388608} <= set(edges)
    # (the ~5 ms event is counted by 67 ms whatever the delay before the clock read)
    assert (le[1.024e-06], le[0.004194304], le[0.067108864], le[68.719476736], le[float("inf")]) == (1, 1, 2, 2, 3)
    assert s[("shmdisagg_index_event_lag_seconds_count", ())] == 3
