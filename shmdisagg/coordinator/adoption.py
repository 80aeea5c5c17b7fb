"""What a restarted coordinator takes over from the one that died, and what it must not.

The deployment's supervisor (`coordinator/keeper.py`) starts a replacement with `adopt` set
(SHMDISAGG_ADOPT=1). It takes over the dead coordinator's segments instead of starting from
zero: the control segment (flock, magic, layout version, owner and
mode checked, odd seqlocks repaired: `ControlTable.adopt`), so the worker rows (load counts),
server records and health marks go on as they were; the published KV block index generation,
so the blocks and conversation sessions go on routing (`BlockIndex.adopt`); and the metrics
segment, so the fleet's counts go on (`MetricsSegment.adopt`). The live fleet workers are then
adopted by the fleet supervisor (`FleetSupervisor.adopt`).

When adoption is impossible (no segment, another build's layout, another `max_workers`,
`max_servers` or `num_workers` in an edited config, an index publication cut mid-write) the coordinator starts
afresh; the old fleet, still serving from segments about to be unlinked, is stopped first
(`stop_stale_fleet`), else two fleets would answer on the port with two tables.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

from shmdisagg.metrics.rows import MetricsSegment
from shmdisagg.processes import ProcessId
from shmdisagg.shm.layout import DEFAULT_MAX_SERVERS
from shmdisagg.shm.segment import DeploymentRunning, ShmError
from shmdisagg.shm.table import ControlTable

log = logging.getLogger("shmdisagg.coordinator")

STALE_FLEET_STOP_S = 5.0  # how long an old fleet's workers get to exit on SIGTERM before SIGKILL


@dataclass
class Takeover:
    """The segments a restarted coordinator owns now."""

    table: ControlTable
    metrics: MetricsSegment


def take_over(
    prefix: str, max_workers: int, num_workers: int, max_servers: int = DEFAULT_MAX_SERVERS
) -> Takeover | None:
    """Adopt the control and metrics segments of a dead coordinator of `prefix`; None (nothing
    taken, the reason logged) when they cannot be adopted (`max_workers` rows and `max_servers`
    server slots are what the config asks for). Raises DeploymentRunning when a live coordinator
    holds them: a second one must not start."""
    try:
        table = ControlTable.adopt(prefix, max_workers, max_servers)
    except DeploymentRunning:
        raise
    except (FileNotFoundError, ShmError) as err:
        log.warning("cannot adopt the previous coordinator's table (%s): starting afresh", err)
        return None
    try:
        metrics = MetricsSegment.adopt(prefix, num_workers)
    except (FileNotFoundError, ShmError) as err:
        log.warning("cannot adopt the previous coordinator's metrics (%s): starting afresh", err)
        table.close()
        return None
    return Takeover(table, metrics)


def stop_stale_fleet(prefix: str, timeout_s: float = STALE_FLEET_STOP_S) -> int:
    """Stop the fleet workers a dead coordinator of `prefix` left serving (found in its table's
    rows by pid and start time): SIGTERM (their graceful stop), then SIGKILL after `timeout_s`.
    Returns how many were running. Nothing to do when the table is gone or unreadable, or when
    the coordinator its line names is alive: then the fleet is a running deployment's (a second
    `serve` of the same prefix, refused, ends here too) and is not stale."""
    try:
        with ControlTable.attach(prefix, timeout=0.0, read_only=True) as table:
            coord = table.coordinator()
            procs = [ProcessId(r.pid, r.starttime) for r in table.rows()]
    except (FileNotFoundError, ShmError):
        return 0
    if coord["pid"] and ProcessId(coord["pid"], coord["starttime"]).alive():
        log.debug("the fleet of %s belongs to a running coordinator (pid %d): left alone", prefix, coord["pid"])
        return 0
    live = [p for p in procs if p.alive()]
    for p in live:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(p.alive() for p in live) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in live:
        _signal(p, signal.SIGKILL)
    if live:
        log.warning("stopped %d fleet worker(s) of the previous coordinator, which could not be adopted", len(live))
    return len(live)


def _signal(proc: ProcessId, sig: int) -> None:
    """`sig` to `proc` through a pidfd (never to a process that reused its pid)."""
    fd = proc.pidfd()
    if fd is None:
        return
    try:
        signal.pidfd_send_signal(fd, sig)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)
