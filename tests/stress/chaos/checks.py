"""The invariants every chaos scenario ends with, as reusable checkers.

Which outcomes are clean (`Rules`, per scenario):
- a complete answer, always;
- an error with TensorRT-LLM's `ErrorResponse` body (HTTP status, or an SSE error event then
  `[DONE]`) whose status the scenario allows: none where nothing on the request path failed
  (clients misbehaving, a fleet worker killed: its peer and the executors are untouched), 408
  for trickling clients, 429 / 503 for a burst past admission, 500 / 502 / 503 / 504 where an
  executor died or stopped (500: the generation executor's own answer when the context
  executor it pulls from died, relayed as TensorRT-LLM relays it). The fleet's catch-all 500
  (`internal error`, an exception in the worker) is never clean;
- a connection cut without an answer (reset in the handshake, reset or EOF before the head, a
  body or a stream cut without an error event) only where the scenario killed a process the
  connection may have reached: a fleet worker SIGKILLed before it was opened and gone (every
  thread exited, its listener closed) only after, the cut seen within `cut_window_s` of the
  kill. Everything else (refused connections, timeouts past the client's deadline, malformed
  bodies, bytes after `[DONE]`) is a violation everywhere.
After the load drains: every load counter in the table is 0 (and every worker row released
each pick it made), no executor still runs a request, the KV index holds exactly what the live
executors hold (kv_cache_aware roles), no `disagg_request_id` was used twice. After shutdown:
no process of the deployment and no segment or socket is left.
"""

from __future__ import annotations

import collections
import glob
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from shmdisagg.shm.index import server_blocks
from tests.stress.chaos.client import ABANDONED, COMPLETE, CUT, ERROR, Outcome
from tests.stress.chaos.deploy import ChaosDeployment, Fault, http_json


@dataclass(frozen=True)
class Rules:
    """`statuses`: the error statuses that are clean here; `cut_by`: the fault events (their
    `ChaosDeployment.note` names) whose killed process may cut a client connection."""

    statuses: frozenset[int] = frozenset()
    cut_by: tuple[str, ...] = ()
    cut_window_s: float = 3.0
    client_statuses: tuple[
        tuple[str, frozenset[int]], ...
    ] = ()  # (user prefix, statuses clean for those clients alone)

    def clean(self, out: Outcome) -> bool:
        return out.status in self.statuses or any(
            out.user.startswith(p) and out.status in s for p, s in self.client_statuses
        )


@dataclass
class Tally:
    """What the outcomes came to."""

    owed: int = 0
    complete: int = 0
    errors: collections.Counter[int] = field(default_factory=collections.Counter)
    forgiven_cuts: int = 0
    abandoned: int = 0
    violations: list[str] = field(default_factory=list)

    def summary(self) -> str:
        errors = " ".join(f"{s}:{n}" for s, n in sorted(self.errors.items())) or "-"
        return (
            f"{self.owed} owed, {self.complete} complete, errors {errors}, {self.forgiven_cuts} cut by a "
            f"kill, {len(self.violations)} violations"
        )


def judge(outcomes: Iterable[Outcome], events: list[Fault], rules: Rules, t0: float = 0.0) -> Tally:
    """Sort every outcome into complete / clean error / forgiven cut / violation (see above).
    A cut is forgiven when its connection was opened before the killed process was gone and it
    was seen after the kill, within `cut_window_s`. Times in the messages are relative to `t0`."""
    tally = Tally()
    kills = [f for f in events if f.what in rules.cut_by]
    for out in outcomes:
        if out.kind == ABANDONED:
            tally.abandoned += 1
            continue
        tally.owed += 1
        if out.kind == COMPLETE:
            tally.complete += 1
        elif out.kind == ERROR and rules.clean(out):
            tally.errors[out.status] += 1  # type: ignore[index]
        elif out.kind == CUT and any(
            out.conn_opened <= f.done and f.at <= out.ended <= f.done + rules.cut_window_s for f in kills
        ):
            tally.forgiven_cuts += 1
        else:
            what = "unexpected status" if out.kind == ERROR else out.kind
            tally.violations.append(
                f"{what}: {out.detail} ({out.path}, {'stream' if out.stream else 'json'}, {out.user}, connection "
                "opened "
                f"+{out.conn_opened - t0:.3f}, sent +{out.started - t0:.3f}, ended +{out.ended - t0:.3f} s)"
            )
    return tally


def poll(check: Callable[[], list[str]], timeout_s: float) -> tuple[float, list[str]]:
    """Call `check` (returns what is still wrong) until it returns nothing or `timeout_s`
    passes: (seconds waited, the last problems)."""
    began = time.monotonic()
    while True:
        problems = check()
        if not problems or time.monotonic() - began > timeout_s:
            return time.monotonic() - began, problems
        time.sleep(0.05)


def load_problems(dep: ChaosDeployment) -> list[str]:
    """Every server slot's (active requests, active tokens) summed over the rows, and every
    claimed row's picks against its releases."""
    with dep.table() as table:
        loads = {slot: table.load(slot) for slot in range(table.max_servers)}
        rows = table.rows()
    out = [f"slot {slot} load {load}" for slot, load in loads.items() if load != (0, 0)]
    out += [
        f"row {r.row} (pid {r.pid}) picked {r.dispatched}, released {r.completed}"
        for r in rows
        if r.dispatched != r.completed
    ]
    return out


def executor_problems(dep: ChaosDeployment) -> list[str]:
    """Requests still queued, running or transferring on a live executor after the load ended
    (a leg the fleet did not abort), and KV pulls still waiting on a context executor. A context
    result pinned for a generation leg that never came is not one: it waits for its transfer
    timeout, as on TensorRT-LLM."""
    out = []
    for ex in dep.live_executors():
        status, stats = http_json(ex.addr, "/sim/stats")
        if status != 200:
            out.append(f"{ex.name}: /sim/stats answered {status}")
            continue
        busy = {k: stats[k] for k in ("num_waiting", "num_running", "num_transferring", "num_ready") if stats[k]}
        if stats["transfers"]["waiting"]:  # a context executor's KV pull waiting for a puller that left
            busy["transfers.waiting"] = stats["transfers"]["waiting"]
        if busy:
            out.append(f"{ex.name}: {busy}")
    return out


def index_problems(dep: ChaosDeployment) -> list[str]:
    """With kv_cache_aware routing: the index's event-confirmed blocks per slot equal the blocks
    the executor in that slot caches, and a dead or unhealthy executor's slot holds none."""
    roles = dep.layout.kv_roles
    if not roles:
        return []
    with dep.table() as table:
        blocks = server_blocks(table) or {}
        healthy = {s.slot for s in table.servers() if s.healthy}
    out = []
    for ex in dep.executors:
        held = blocks.get(ex.slot, 0)
        if ex.role not in roles:
            if held:
                out.append(f"{ex.name} (slot {ex.slot}, not kv-routed) has {held} blocks in the index")
            continue
        if ex.pid is None or ex.slot not in healthy:
            if held:
                out.append(
                    f"{ex.name} (slot {ex.slot}) is {'dead' if ex.pid is None else 'unhealthy'} but holds {held} "
                    "blocks in the index"
                )
            continue
        if ex.stopped:
            continue
        status, stats = http_json(ex.addr, "/sim/stats")
        cached = stats["blocks"]["cached"] if status == 200 else None
        if cached != held:
            out.append(f"{ex.name} (slot {ex.slot}) caches {cached} blocks, the index says {held}")
    return out


def duplicate_ids(outcomes: Iterable[Outcome], seen: dict[str, list[int]]) -> list[str]:
    """`disagg_request_id`s used twice: in the answers' `x-disagg-request-id`, or among the
    requests each role's executors served (their /perf_metrics records)."""
    out = []
    answered = collections.Counter(o.request_id for o in outcomes if o.request_id is not None)
    out += [f"x-disagg-request-id {rid} answered {n} times" for rid, n in answered.items() if n > 1]
    for role, ids in seen.items():
        out += [
            f"{role} executors served disagg id {rid} {n} times" for rid, n in collections.Counter(ids).items() if n > 1
        ]
    return out[:20]


def leftovers(dep: ChaosDeployment) -> list[str]:
    """After stop: processes of the deployment still running, segments, sockets."""
    out = [f"process {pid} still runs: {cmd}" for pid, cmd in dep.tracker.alive().items()]
    out += [f"segment left: {path}" for path in glob.glob(f"/dev/shm/{dep.prefix}-*")]
    sockets = [dep.config.coordinator_socket, dep.config.kv_hint_socket]
    out += [f"socket left: {path}" for path in sockets if path and os.path.exists(path)]
    return out


@dataclass
class Drained:
    """The after-load checks: seconds until the counters were 0, and every problem left."""

    seconds: float
    problems: list[str]


def after_load(dep: ChaosDeployment, outcomes: list[Outcome], timeout_s: float = 15.0) -> Drained:
    """Bounded polls for the last releases, executors to go idle and the index to converge;
    then the id check (after a final drain of the executors' records)."""
    seconds, problems = poll(lambda: load_problems(dep), timeout_s)
    problems += poll(lambda: executor_problems(dep), timeout_s)[1]
    problems += poll(lambda: index_problems(dep), timeout_s)[1]
    dep.drain_perf()
    problems += duplicate_ids(outcomes, dep.seen_ids)
    return Drained(seconds, problems)


def tracebacks(dep: ChaosDeployment) -> list[str]:
    """Python tracebacks in the deployment's logs (launcher, coordinator, fleet, executors): an
    exception nothing handled, or one logged as a bug, under faults every part must expect."""
    out = []
    for path in sorted(dep.log_dir.glob("*.log")):
        lines = path.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if line.startswith("Traceback (most recent call last)"):
                logged = lines[i - 1][:160] if i else ""
                raised = next((ln for ln in lines[i + 1 :] if ln and not ln.startswith(" ")), "?")[:160]
                out.append(f"traceback in {path.name}: {raised} (logged after: {logged})")
    return out[:10]


def after_stop(dep: ChaosDeployment, timeout_s: float = 15.0) -> list[str]:
    return poll(lambda: leftovers(dep), timeout_s)[1] + tracebacks(dep)


def describe(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in values.items() if v)
