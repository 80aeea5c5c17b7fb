"""What `shmdisagg stats` reads, and the snapshot it turns two reads into.

`StatsReader` maps the deployment's control segment and metrics segment **read-only**
(`PROT_READ`: a stray store would fault, never write), and `sample()` copies what it needs with
the table's lock-free reads (seqlocked records, relaxed counter loads): the coordinator and the
workers never wait for a reader, so watching a deployment cannot slow it down.

`snapshot(prev, cur)` is one JSON-able dict: current values plus rates over the interval
between the two samples (requests/s per worker, picks/s per server, index events/s and the
mean event-to-visibility lag of the events applied in that interval). Per-server KV blocks are
the index's event-confirmed block entries per server, from a read-only scan of the index
(`shm.index.server_blocks`). Numbers a deployment does not have (no metrics segment, no block
index yet) are None, which the views show as "-".

Liveness: the table outlives a deployment killed with SIGKILL (nobody unlinks its segments), and
then still says "running" with every server healthy. So `sample()` also checks that the
coordinator's pid (and each worker row's) is alive and is the same process, by the start time
the table stores beside the pid (`shm.table.process_starttime`, which guards against pid reuse);
a dead coordinator makes the snapshot's state "stale".

Worker numbering: `worker` is the coordinator's fleet index (its log's "fleet worker N", the
`worker_index` of `/cluster_info`, metrics row 2 + N); `row` is the control table row the
process claimed, which need not be the same number.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from shmdisagg.metrics.rows import FIRST_WORKER_ROW, ROW_RETIRED, MetricsSegment
from shmdisagg.metrics.schema import FINISHED, LAYOUT, MAX_SERVERS
from shmdisagg.shm.index import server_blocks
from shmdisagg.shm.segment import SHM_DIR, SegmentNotReady, ShmError
from shmdisagg.shm.table import ROLE_CONTEXT, ControlTable, RowInfo, ServerInfo, process_starttime

SCHEMA = "shmdisagg.stats/1"
COORD_STATES = {0: "starting", 1: "running", 2: "stopping"}

_C = LAYOUT.counter
_FINISHED = FINISHED


class NotRunning(RuntimeError):
    """No deployment with this prefix (its control segment does not exist or is not ready)."""


def process_alive(pid: int, starttime: int) -> bool | None:
    """Whether `pid` runs and is the process that was recorded with `starttime` (clock ticks
    since boot; 0: not recorded, only the pid is checked). None when no pid is recorded yet."""
    if pid <= 0:
        return None
    try:
        now = process_starttime(pid)
    except (FileNotFoundError, ProcessLookupError):
        return False
    except (OSError, ValueError, IndexError):  # unreadable /proc: assume it runs
        return True
    return not starttime or now == starttime


def stale_reason(coordinator: dict[str, int]) -> str:
    """Why a snapshot whose coordinator is not alive is stale, for the views."""
    pid = coordinator["pid"]
    try:
        reused = process_starttime(pid) != coordinator.get("starttime")
    except (OSError, ValueError, IndexError):
        reused = False
    gone = f"coordinator pid {pid} is gone" + (" (the pid now belongs to another process)" if reused else "")
    return f"{gone}: stale segments; the next `shmdisagg launch` or `shmdisagg serve` of this deployment removes them"


def stopped_reason(prefix: str, segment_state: str, last: Sample) -> str:
    """Why a watched deployment ended, from how its control segment went (`segment_state`) and
    the last sample read before it did: for the live view's last line."""
    if segment_state == "replaced":
        return (
            f"the deployment {prefix} stopped and a new one now runs under this prefix; "
            "run shmdisagg stats again to watch it"
        )
    pid = last.coordinator["pid"]
    if COORD_STATES.get(last.coordinator["state"]) == "stopping":
        return (
            f"the deployment {prefix} stopped: its coordinator (pid {pid}) was asked to stop (SIGTERM or "
            "Ctrl-C to shmdisagg launch or serve, or the end of bench --launch), stopped the fleet and removed "
            "its shared memory"
        )
    still = process_alive(pid, last.coordinator.get("starttime", 0))
    return f"the deployment {prefix} stopped: its shared memory was removed; its coordinator (pid {pid}) " + (
        "still runs" if still else "has exited"
    )


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


@dataclass
class Sample:
    """One read of the table (and metrics segment), at `t_ns` (CLOCK_MONOTONIC)."""

    t_ns: int
    coordinator: dict[str, int]
    servers: list[ServerInfo]
    loads: dict[int, tuple[int, int]]
    routed: dict[int, int]
    rows: list[RowInfo]
    retired: tuple[int, int]
    index: dict[str, Any] | None
    kv_blocks: dict[int, int] | None = None
    metric_rows: list[list[float]] | None = None
    errors: list[str] = field(default_factory=list)
    coordinator_alive: bool | None = None  # None: no coordinator recorded yet
    rows_alive: dict[int, bool | None] = field(default_factory=dict)  # by table row
    max_servers: int = 0  # the table's server slots (0: not recorded)


class StatsReader:
    """Read-only view of one deployment, by its shared-memory prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        try:
            self.table = ControlTable.attach(prefix, read_only=True, timeout=0.5)
        except (FileNotFoundError, SegmentNotReady) as err:
            raise NotRunning(f"no running deployment with shared-memory prefix {prefix!r} ({err})") from None
        except ShmError as err:  # another build's layout, another user's segment
            raise NotRunning(f"cannot read the deployment with prefix {prefix!r}: {err}") from None
        self.metrics: MetricsSegment | None = None
        try:
            self.metrics = MetricsSegment.attach(prefix, read_only=True)
        except (FileNotFoundError, ShmError):
            pass  # an older deployment: everything but the per-request counters
        self._servers: list[ServerInfo] = []
        self._inode = _inode(self._ctl_path)  # which control segment we mapped, to tell a newer one apart

    @property
    def _ctl_path(self) -> str:
        return os.path.join(SHM_DIR, f"{self.prefix}-ctl")

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.table.close()

    def __enter__(self) -> StatsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def alive(self) -> bool:
        """False once the coordinator unlinked the control segment (our mapping outlives it)."""
        return self.segment_state() == "present"

    def segment_state(self) -> str:
        """ "present" (the control segment we mapped), "gone" (unlinked: the coordinator removes
        it as it stops) or "replaced" (a newer deployment created its own under this prefix)."""
        inode = _inode(self._ctl_path)
        if inode is None:
            return "gone"
        return "present" if inode == self._inode else "replaced"

    def sample(self, scan_index: bool = True) -> Sample:
        """`scan_index=False` skips the per-server KV block count (a full index scan) for a
        sample that only serves as the base of rates."""
        t = self.table
        errors = []
        try:
            self._servers = t.servers()
        except Exception as err:  # a coordinator stopped mid-write: keep the last list
            errors.append(f"server table: {err}")
        servers = self._servers
        index = kv_blocks = None
        try:
            generation, capacity, _, _ = t.index_publication()
            if generation:
                index = {**t.index_metrics(), "generation": generation, "capacity": capacity}
                kv_blocks = server_blocks(t) if scan_index else None
        except Exception:  # no block index in this deployment or build
            index = None
        coordinator = t.coordinator()
        rows = t.rows()
        return Sample(
            t_ns=time.monotonic_ns(),
            coordinator=coordinator,
            servers=servers,
            loads={s.slot: t.load(s.slot) for s in servers},
            routed={s.slot: t.routed(s.slot) for s in servers},
            rows=rows,
            retired=t.retired(),
            index=index,
            kv_blocks=kv_blocks,
            metric_rows=self.metrics.snapshot() if self.metrics is not None else None,
            errors=errors,
            coordinator_alive=process_alive(coordinator["pid"], coordinator.get("starttime", 0)),
            rows_alive={r.row: process_alive(r.pid, r.starttime) for r in rows},
            max_servers=t.max_servers,
        )


def _rate(now: float, before: float | None, dt: float) -> float | None:
    if before is None or dt <= 0:
        return None
    return max(now - before, 0.0) / dt


def _role(role: int) -> str:
    return "context" if role == ROLE_CONTEXT else "generation"


def snapshot(prev: Sample | None, cur: Sample, prefix: str) -> dict[str, Any]:
    """The JSON snapshot of `cur`, with rates against `prev` (None: no rates)."""
    dt = (cur.t_ns - prev.t_ns) / 1e9 if prev is not None else 0.0
    coord = cur.coordinator
    stale = cur.coordinator_alive is False
    state = "stale" if stale else COORD_STATES.get(coord["state"], str(coord["state"]))
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "prefix": prefix,
        "time": datetime.now(UTC).isoformat(),
        "interval_s": dt or None,
        # the deployment's state: the coordinator's, or "stale" when its process is gone (the
        # segments of a deployment killed hard: every other number is its last word)
        "state": state,
        "stale_reason": stale_reason(coord) if stale else None,
        "coordinator": {
            "pid": coord["pid"],
            "alive": cur.coordinator_alive,
            "incarnation": coord["incarnation"],
            "state": state,
            "heartbeat_age_s": max(cur.t_ns - coord["heartbeat_ns"], 0) / 1e9,
            "events_applied_per_s": None,
            "event_lag_ms": None,
        },
    }

    totals = _sum(cur.metric_rows) if cur.metric_rows is not None else None
    prev_totals = _sum(prev.metric_rows) if prev is not None and prev.metric_rows is not None else None
    servers = []
    for s in cur.servers:
        reqs, toks = cur.loads.get(s.slot, (0, 0))
        prompt = cached = hit_rate = None
        if totals is not None and s.slot < MAX_SERVERS:
            prompt = totals[LAYOUT.per_server["shmdisagg_server_prompt_tokens"] + s.slot]
            cached = totals[LAYOUT.per_server["shmdisagg_server_cached_tokens"] + s.slot]
            hit_rate = cached / prompt if prompt else None
        routed = cur.routed.get(s.slot, 0)
        servers.append(
            {
                "slot": s.slot,
                "addr": s.addr,
                "role": _role(s.role),
                "healthy": s.healthy,
                "incarnation": s.incarnation,
                "active_requests": reqs,
                "active_tokens": toks,
                "routed": routed,
                "routed_per_s": _rate(routed, prev.routed.get(s.slot) if prev else None, dt),
                "kv_blocks": None if cur.kv_blocks is None else cur.kv_blocks.get(s.slot, 0),
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "hit_rate": hit_rate,
            }
        )
    out["servers"] = servers
    out["server_slots"] = cur.max_servers or None  # the table's capacity: servers past it wait for a slot

    by_pid = _rows_by_pid(cur.metric_rows)
    prev_by_pid = _rows_by_pid(prev.metric_rows) if prev is not None else {}
    index_of = _worker_index_by_pid(cur.metric_rows)
    prev_rows = {(r.row, r.pid): r for r in prev.rows} if prev is not None else {}
    workers = []
    for r in sorted(cur.rows, key=lambda r: (index_of.get(r.pid, 1 << 30), r.row)):
        before = prev_rows.get((r.row, r.pid))
        m = by_pid.get(r.pid)
        pm = prev_by_pid.get(r.pid)
        workers.append(
            {
                "worker": index_of.get(r.pid),  # the coordinator's "fleet worker N" (None: unknown)
                "row": r.row,  # the control table row it claimed
                "pid": r.pid,
                "alive": cur.rows_alive.get(r.row),
                "heartbeat_age_s": max(cur.t_ns - r.heartbeat_ns, 0) / 1e9,
                "legs_in_flight": r.dispatched - r.completed,
                "legs_dispatched": r.dispatched,
                "legs_per_s": _rate(r.completed, before.completed if before else None, dt),
                "requests": m[_C["total_requests"]] if m else None,
                "requests_in_flight": _in_flight(m) if m else None,
                "requests_per_s": _rate(m[_C["total_requests"]], pm[_C["total_requests"]] if pm else None, dt)
                if m
                else None,
            }
        )
    out["workers"] = workers
    disp = sum(r.dispatched for r in cur.rows) + cur.retired[0]
    prev_disp = sum(r.dispatched for r in prev.rows) + prev.retired[0] if prev is not None else None
    out["fleet"] = {
        "workers": len(cur.rows),
        "legs_in_flight": sum(r.dispatched - r.completed for r in cur.rows),
        "legs_dispatched": disp,
        "legs_per_s": _rate(disp, prev_disp, dt),
    }
    out["requests"] = None
    if totals is not None:
        counts = {
            name: totals[_C[name]]
            for name in (
                "total_requests",
                "total_responses",
                "validation_exceptions",
                "http_exceptions",
                "internal_errors",
                "shmdisagg_admission_rejections",
                "shmdisagg_client_disconnects",
                "shmdisagg_routed_client_errors",
                "shmdisagg_worker_lost_requests",
                "shmdisagg_edge_refusals",
                "ctx_retry_requests",
                "gen_retry_requests",
            )
        }
        # total = in flight + ok + cancelled (client went away) + failed + 4xx + 429 + lost (on a
        # worker that died)
        req: dict[str, float | None] = {
            **counts,
            "in_flight": _in_flight(totals),
            "cancelled": counts["shmdisagg_client_disconnects"],
            # 4xx: refused before routing, or answered with a 4xx after (an executor refusing a
            # parameter); failed: every other error answer
            "client_errors": counts["validation_exceptions"] + counts["shmdisagg_routed_client_errors"],
            "failed": counts["http_exceptions"] - counts["shmdisagg_routed_client_errors"] + counts["internal_errors"],
            "lost": counts["shmdisagg_worker_lost_requests"],
            # refused by the public port before any route saw them (413, 431, 408, malformed
            # HTTP): outside the total, as TensorRT-LLM's counters never see them either
            "refused_at_port": counts["shmdisagg_edge_refusals"],
            "requests_per_s": _rate(
                totals[_C["total_requests"]], prev_totals[_C["total_requests"]] if prev_totals else None, dt
            ),
        }
        prompt = sum(totals[LAYOUT.per_server["shmdisagg_server_prompt_tokens"] + i] for i in range(MAX_SERVERS))
        cached = sum(totals[LAYOUT.per_server["shmdisagg_server_cached_tokens"] + i] for i in range(MAX_SERVERS))
        req["hit_rate"] = cached / prompt if prompt else None
        out["requests"] = req

    out["index"] = None
    if cur.index is not None:
        ix = cur.index
        pix = prev.index if prev is not None else None
        cap = ix.get("capacity") or 0
        idx = {
            "generation": ix.get("generation"),
            "capacity": cap,
            "entries": ix.get("live"),
            "used": ix.get("used"),
            "load_factor": (ix.get("used") or 0) / cap if cap else None,
            "max_probe": ix.get("max_probe"),
            "events_applied": ix.get("events_applied"),
            "events_dropped": ix.get("events_dropped"),
            "events_applied_per_s": _rate(ix.get("events_applied", 0), pix.get("events_applied") if pix else None, dt),
            "event_lag_ms": None,
        }
        if pix is not None:
            samples = ix.get("lag_samples", 0) - pix.get("lag_samples", 0)
            if samples > 0:
                idx["event_lag_ms"] = (ix.get("lag_sum_ns", 0) - pix.get("lag_sum_ns", 0)) / samples / 1e6
        elif ix.get("lag_samples"):
            idx["event_lag_ms"] = ix.get("lag_sum_ns", 0) / ix["lag_samples"] / 1e6
        out["index"] = idx
        out["coordinator"]["events_applied_per_s"] = idx["events_applied_per_s"]
        out["coordinator"]["event_lag_ms"] = idx["event_lag_ms"]
    if cur.errors:
        out["errors"] = cur.errors
    return out


def _sum(rows: list[list[float]]) -> list[float]:
    total = [0.0] * LAYOUT.words
    for r in rows:
        total = [a + b for a, b in zip(total, r, strict=True)]
    return total


def _rows_by_pid(rows: list[list[float]] | None) -> dict[int, list[float]]:
    if rows is None:
        return {}
    return {
        int(r[LAYOUT.pid]): r
        for i, r in enumerate(rows)
        if i >= FIRST_WORKER_ROW and i != ROW_RETIRED and r[LAYOUT.pid]
    }


def _worker_index_by_pid(rows: list[list[float]] | None) -> dict[int, int]:
    """pid -> fleet index, from the metrics rows (row 2 + index is fleet worker index's)."""
    if rows is None:
        return {}
    return {
        int(r[LAYOUT.pid]): i - FIRST_WORKER_ROW for i, r in enumerate(rows) if i >= FIRST_WORKER_ROW and r[LAYOUT.pid]
    }


def _in_flight(row: list[float]) -> float:
    """Requests received and not yet finished (routed ones end at their sink; refused ones at once)."""
    return max(row[_C["total_requests"]] - sum(row[_C[n]] for n in _FINISHED), 0.0)
