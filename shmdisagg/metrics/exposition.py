"""`GET /metrics` (and `/prometheus/metrics`): the whole deployment in one scrape.

A scrape, on whichever fleet worker the kernel hands the connection to, reads
- the metrics segment (`rows.py`): every worker's counters and histograms, summed, plus what
  dead workers counted and the coordinator's own row;
- the control table at that moment: per-server load, picks and health, the fleet's rows and
  heart-beats, the coordinator line, and the KV block index's metrics once it is published.
It writes nothing anywhere. Formatting is prometheus-client's text exposition.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from shmdisagg.metrics.rows import MetricsSegment
from shmdisagg.metrics.schema import COUNTERS, HISTOGRAMS, LAYOUT, MAX_SERVERS, OUTCOMES, PER_SERVER, ROLES
from shmdisagg.shm.index import lag_bucket_edges
from shmdisagg.shm.table import ROLE_CONTEXT, ControlTable

log = logging.getLogger("shmdisagg.metrics")

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Index lag buckets shown, each with its upper edge as `le` (see `lag_bucket_edges`): buckets up to
# _LAG_FIRST summed (le 1.024 us), then each one up to _LAG_LAST (le 68.7 s), then +Inf.
_LAG_FIRST, _LAG_LAST = 39, 143


def role_name(role: int) -> str:
    return "context" if role == ROLE_CONTEXT else "generation"


def _fmt(bound: float) -> str:
    return repr(float(bound))


class FleetCollector(Collector):
    """Collects from `segment` (may be None: no per-request metrics) and `table`.
    `routers`: role name -> router type, the `router` label of routing decisions."""

    def __init__(self, table: ControlTable, segment: MetricsSegment | None, routers: Mapping[str, str]) -> None:
        self.table = table
        self.segment = segment
        self.routers = routers

    def collect(self) -> Iterator[Metric]:
        if self.segment is not None:
            yield from self._rows(self.segment.totals())
        yield from self._table()

    # -- the metrics segment ---------------------------------------------------------------

    def _rows(self, total: list[float]) -> Iterator[Metric]:
        for c in COUNTERS:
            yield CounterMetricFamily(c.name, c.help, value=total[LAYOUT.counter[c.name]])
        fam = CounterMetricFamily(
            "shmdisagg_routing_decisions",
            "Routing decisions per role, router and outcome (routed: first pick; retry: a pick for a retry; "
            "no_server: no eligible server)",
            labels=["role", "router", "outcome"],
        )
        for role in ROLES:
            for outcome in OUTCOMES:
                fam.add_metric([role, self.routers.get(role, ""), outcome], total[LAYOUT.routing[(role, outcome)]])
        yield fam
        for h in HISTOGRAMS:
            base = LAYOUT.hist[h.name]
            counts = total[base : base + len(h.buckets) + 1]
            running = 0.0
            buckets = []
            for bound, n in zip([*map(_fmt, h.buckets), "+Inf"], counts, strict=True):
                running += n
                buckets.append((bound, running))
            hist = HistogramMetricFamily(h.name, h.help)
            hist.add_metric([], buckets, total[base + len(h.buckets) + 1])
            yield hist
        addrs = self._addresses()
        for c in PER_SERVER:
            fam = CounterMetricFamily(c.name, c.help, labels=["server"])
            base = LAYOUT.per_server[c.name]
            for slot in range(MAX_SERVERS):
                if total[base + slot] or slot in addrs:
                    fam.add_metric([addrs.get(slot, f"slot{slot}")], total[base + slot])
            yield fam

    def _addresses(self) -> dict[int, str]:
        try:
            return {s.slot: s.addr for s in self.table.servers()}
        except Exception:  # a coordinator dead mid-write: labels fall back to slots
            return {}

    # -- the control table -------------------------------------------------------------------

    def _table(self) -> Iterator[Metric]:
        t = self.table
        now_ns = time.monotonic_ns()
        try:
            servers = t.servers()
        except Exception as err:
            log.debug("server table unreadable: %r", err)
            servers = []
        labels = ["server", "role"]
        active = GaugeMetricFamily(
            "shmdisagg_server_active_requests", "Requests in flight on the server, summed over the fleet", labels=labels
        )
        tokens = GaugeMetricFamily(
            "shmdisagg_server_active_tokens",
            "Tokens in flight on the server (the routers' token load), summed over the fleet",
            labels=labels,
        )
        routed = CounterMetricFamily(
            "shmdisagg_server_routed", "Picks of the server by any fleet worker", labels=labels
        )
        healthy = GaugeMetricFamily(
            "shmdisagg_server_healthy", "1 when the coordinator lets the server be picked", labels=labels
        )
        for s in servers:
            lv = [s.addr, role_name(s.role)]
            reqs, toks = t.load(s.slot)
            active.add_metric(lv, reqs)
            tokens.add_metric(lv, toks)
            routed.add_metric(lv, t.routed(s.slot))
            healthy.add_metric(lv, 1.0 if s.healthy else 0.0)
        yield from (active, tokens, routed, healthy)

        rows = t.rows()
        retired_dispatched, retired_completed = t.retired()
        yield GaugeMetricFamily("shmdisagg_fleet_workers", "Fleet workers holding a row in the table", value=len(rows))
        yield GaugeMetricFamily(
            "shmdisagg_fleet_in_flight",
            "Legs in flight over the fleet (dispatched - completed)",
            value=sum(r.dispatched - r.completed for r in rows),
        )
        yield CounterMetricFamily(
            "shmdisagg_fleet_dispatched",
            "Legs dispatched by every worker, dead ones included",
            value=sum(r.dispatched for r in rows) + retired_dispatched,
        )
        hb = GaugeMetricFamily(
            "shmdisagg_worker_heartbeat_age_seconds",
            "Seconds since the fleet worker's last heartbeat",
            labels=["row", "pid"],
        )
        for r in rows:
            hb.add_metric([str(r.row), str(r.pid)], max(now_ns - r.heartbeat_ns, 0) / 1e9)
        yield hb
        coord = t.coordinator()
        yield GaugeMetricFamily(
            "shmdisagg_coordinator_heartbeat_age_seconds",
            "Seconds since the coordinator's last heartbeat",
            value=max(now_ns - coord["heartbeat_ns"], 0) / 1e9,
        )
        yield GaugeMetricFamily(
            "shmdisagg_coordinator_state", "0 starting, 1 running, 2 stopping", value=coord["state"]
        )
        yield from self._index()

    def _index(self) -> Iterator[Metric]:
        try:
            generation, capacity, _, _ = self.table.index_publication()
            if not generation:
                return
            m: dict[str, Any] = self.table.index_metrics()
        except Exception as err:  # no index in this build or deployment
            log.debug("index metrics unreadable: %r", err)
            return
        yield GaugeMetricFamily(
            "shmdisagg_index_generation", "Generation of the published KV block index", value=generation
        )
        yield GaugeMetricFamily("shmdisagg_index_capacity", "Slots of the published index generation", value=capacity)
        yield GaugeMetricFamily(
            "shmdisagg_index_entries", "Live block entries at the last sweep", value=m.get("live", 0)
        )
        yield GaugeMetricFamily(
            "shmdisagg_index_used_slots", "Used slots (live + dead) at the last sweep", value=m.get("used", 0)
        )
        yield GaugeMetricFamily(
            "shmdisagg_index_load_factor",
            "Used slots / capacity at the last sweep",
            value=m.get("used", 0) / capacity if capacity else 0.0,
        )
        yield GaugeMetricFamily(
            "shmdisagg_index_max_probe", "Longest probe sequence at the last sweep", value=m.get("max_probe", 0)
        )
        for key, help_ in (
            ("events_applied", "KV cache events applied to the index"),
            ("events_dropped", "KV cache events dropped"),
            ("blocks_stored", "Blocks stored by events"),
            ("blocks_removed", "Blocks removed by events"),
            ("index_full_drops", "Inserts refused because the index generation was full"),
        ):
            if key in m:
                yield CounterMetricFamily(f"shmdisagg_index_{key}", help_, value=m[key])
        hist = m.get("lag_hist")
        if isinstance(hist, list) and hist:
            running = sum(hist[: _LAG_FIRST + 1])
            buckets = [(_fmt(lag_bucket_edges(_LAG_FIRST)[1] / 1e9), float(running))]
            for b in range(_LAG_FIRST + 1, min(_LAG_LAST + 1, len(hist))):
                running += hist[b]
                buckets.append((_fmt(lag_bucket_edges(b)[1] / 1e9), float(running)))
            buckets.append(("+Inf", float(sum(hist))))
            fam = HistogramMetricFamily(
                "shmdisagg_index_event_lag_seconds", "KV event creation on the executor to visibility in the index"
            )
            fam.add_metric([], buckets, m.get("lag_sum_ns", 0) / 1e9)
            yield fam


def render(collector: FleetCollector) -> bytes:
    """The Prometheus text exposition of one scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)
