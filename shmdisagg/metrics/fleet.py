"""A fleet worker's metrics, wired in one place: its metrics row, the request-path counting,
the record shipper, the scrape and the `/perf_metrics` proxy.

`SHMDISAGG_METRICS=off` in the environment turns the request-path part off (no row writes but
the answered-legs counter the coordinator's health checks read, no records); `/metrics` then
still reports the table (loads, picks, health, heart-beats, index).
It exists to measure what the metrics cost (BENCHMARKS.md), not as a tuning knob.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import aiohttp

from shmdisagg.config import DisaggConfig
from shmdisagg.metrics.answered import AnsweredLegs
from shmdisagg.metrics.exposition import FleetCollector, render
from shmdisagg.metrics.request import CountingAdmission, CountingPolicy, RequestMetrics
from shmdisagg.metrics.rows import MetricsSegment, worker_row
from shmdisagg.metrics.shipper import RecordShipper
from shmdisagg.orchestrator.service import Admission, DisaggService
from shmdisagg.shm.segment import ShmError
from shmdisagg.shm.table import ControlTable

log = logging.getLogger("shmdisagg.metrics")


def enabled_by_env() -> bool:
    return os.environ.get("SHMDISAGG_METRICS", "on").lower() not in ("off", "0", "false", "no")


class FleetMetrics:
    """State: `segment` (None when absent or disabled), `request` (the request-path counting,
    None when disabled), `shipper` (per-request records to the coordinator, None likewise),
    `answered` (legs answered per server, for the coordinator's health checks; None only
    without a segment row)."""

    def __init__(
        self, config: DisaggConfig, worker_index: int, table: ControlTable, enabled: bool | None = None
    ) -> None:
        self.config = config
        self.table = table
        self.segment: MetricsSegment | None = None
        self.request: RequestMetrics | None = None
        self.shipper: RecordShipper | None = None
        self.answered: AnsweredLegs | None = None  # legs answered per server (metrics/answered.py)
        self._session: aiohttp.ClientSession | None = None
        try:
            self.segment = MetricsSegment.attach(config.shm_prefix)
        except (FileNotFoundError, ShmError) as err:
            log.warning("no metrics segment (%s): /metrics shows the table only", err)
        if self.segment is not None and worker_row(worker_index) >= self.segment.rows:
            log.warning("metrics segment has no row for fleet worker %d: request metrics off", worker_index)
        elif self.segment is not None:
            row = self.segment.row(worker_row(worker_index))
            # the coordinator's health checks read it: counted even with the request metrics off
            self.answered = AnsweredLegs(row)
            if enabled_by_env() if enabled is None else enabled:
                # perf_metrics_max_requests: 0 keeps no perf records (metrics/perf.py): none are sent
                if config.perf_metrics_max_requests > 0:
                    self.shipper = RecordShipper(config.coordinator_socket, worker_index, row)
                self.request = RequestMetrics(row, self.shipper)
        routers = {"context": config.context_servers.router.type, "generation": config.generation_servers.router.type}
        self.collector = FleetCollector(table, self.segment, routers)

    # -- wiring -----------------------------------------------------------------------------

    def wrap_policy(self, policy: Any, generation: bool) -> Any:
        return CountingPolicy(policy, generation) if self.request is not None else policy

    def admission(self, limit: int, inflight: Any) -> Admission:
        return CountingAdmission(limit, inflight) if self.request is not None else Admission(limit, inflight)

    def install(self, service: DisaggService) -> None:
        if self.request is not None:
            service.sinks.append(self.request.sink)

    def start(self) -> None:
        if self.shipper is not None:
            self.shipper.start()

    async def stop(self) -> None:
        if self.shipper is not None:
            await self.shipper.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()

    # -- routes -----------------------------------------------------------------------------

    def scrape(self) -> bytes:
        return render(self.collector)

    async def perf_metrics(self, keep: bool) -> tuple[int, bytes]:
        """The coordinator's joined records (after sending this worker's pending ones)."""
        if self.shipper is not None:
            await self.shipper.flush()
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.config.coordinator_socket),
                timeout=aiohttp.ClientTimeout(total=10.0),
            )
        try:
            async with self._session.get("http://coordinator/perf_metrics", params={"keep": "1" if keep else "0"}) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            log.warning("coordinator did not answer /perf_metrics: %r", err)
            return (
                503,
                b'{"object":"error","message":"the coordinator did not '
                b'answer","type":"ServiceUnavailable","param":null,"code":503}',
            )
