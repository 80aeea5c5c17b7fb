"""Chaos scenarios: faults under sustained mixed load on a simulated deployment, each ending with
every invariant of `tests/stress/chaos/checks.py` (outcomes, counters, executors idle, KV index,
unique ids, nothing left after shutdown). The short version runs with the normal suite; the long
one is `scripts/stress.sh DURATION`. Each scenario takes its own configuration variant, so that
together they cover both schedule styles, every router and conditional disaggregation.

What counts as clean in each scenario is its `Rules` (see `checks.py`).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.stress.chaos.checks import Rules, load_problems, poll
from tests.stress.chaos.client import COMPLETE, Outcome
from tests.stress.chaos.deploy import Executor, Layout, http_json, running
from tests.stress.chaos.load import LEAVE_POINTS, burst, leaving_client, slow_reader, stalled_reader, trickling_client
from tests.stress.chaos.scenario import SCENARIOS, ChaosRun, ExpectedFailure

pytestmark = [pytest.mark.stress, pytest.mark.chaos]

EXECUTOR_DOWN = frozenset({500, 502, 503, 504})  # see checks.py: what an executor's death or stop may cause


def _spare(run: ChaosRun, role: str | None = None) -> Executor:
    """A live executor whose role keeps another healthy one (the role stays served)."""
    candidates = []
    for ex in run.dep.live_executors():
        others = [o for o in run.dep.live_executors() if o.role == ex.role and o is not ex and run.dep.healthy(o.slot)]
        if others and (role is None or ex.role == role):
            candidates.append(ex)
    return run.rng.choice(candidates)


# -- 1. fleet workers SIGKILLed ----------------------------------------------------------------


def test_sigkill_of_random_fleet_workers(tmp_path: Path, shm_prefix: str, chaos_row: dict[str, Any]) -> None:
    """The supervisor replaces each killed worker; only connections that may have reached the
    killed process are cut; every other request is answered in full."""
    layout = Layout(schedule_style="context_first", routers=("round_robin", "load_balancing"), num_ctx=1, num_gen=2)
    with ChaosRun(layout, Rules(cut_by=("worker SIGKILL",)), tmp_path, shm_prefix, chaos_row) as run:
        replaced: list[float] = []
        while run.more(len(replaced), at_least=2):
            old = run.dep.kill_worker(run.rng)
            # the next kill only once the replacement listens: two workers down at once refuse connections
            replaced.append(run.wait_until(lambda: _fleet_whole(run, old), 60, "a replacement worker listening"))  # noqa: B023 (polled before the loop moves on)
            run.wait_served(10)
            run.hold(run.rng.uniform(0.2, 0.8))
        run.notes.append(f"replacement listening in <= {max(replaced):.2f} s")


def _fleet_whole(run: ChaosRun, killed: int) -> bool:
    rows = set(run.dep.worker_pids())
    return killed not in rows and len(rows) == run.dep.config.num_workers and rows <= run.dep.listening_pids()


# -- 2. executors SIGKILLed and restarted -----------------------------------------------------


def test_sigkill_and_restart_of_executors(tmp_path: Path, shm_prefix: str, chaos_row: dict[str, Any]) -> None:
    """A killed executor is marked unhealthy and its KV blocks leave the index; restarted on its
    port it serves again. Then a restart on the same port within one health interval: the new
    process's fresh cache replaces the old one's blocks in the index (checked at the end: the
    index equals what each executor caches)."""
    kv = {"type": "kv_cache_aware"}
    layout = Layout(schedule_style="generation_first", routers=(kv, kv), health_check_interval_s=0.5)
    rules = Rules(statuses=EXECUTOR_DOWN)
    with ChaosRun(layout, rules, tmp_path, shm_prefix, chaos_row) as run:
        cycles = 0
        cleared = []
        while run.more(cycles, at_least=1):
            ex = _spare(run, role=("context", "generation")[cycles % 2])
            run.dep.kill_executor(ex)
            cleared.append(
                run.wait_until(
                    lambda: not run.dep.healthy(ex.slot) and _index_blocks(run, ex.slot) == 0,  # noqa: B023 (polled before the loop moves on)
                    20,
                    f"{ex.name} unhealthy with no blocks in the index",
                )
            )
            run.hold(run.rng.uniform(0.2, 0.6))
            run.dep.restart_executor(ex)
            run.wait_until(lambda: run.dep.healthy(ex.slot), 60, f"{ex.name} healthy again")  # noqa: B023 (polled before the loop moves on)
            run.wait_served(10)
            # the same port again, at once: the new process is up before the next health check
            # could have seen the old one gone (it may see a refusal; a worker's report may too)
            ex = _spare(run)
            run.dep.kill_executor(ex)
            run.dep.restart_executor(ex, at_once=True)
            run.wait_until(lambda: run.dep.healthy(ex.slot), 60, f"{ex.name} healthy after a same-port restart")  # noqa: B023 (polled before the loop moves on)
            run.wait_served(10)
            cycles += 1
        run.notes.append(f"dead executor unhealthy and out of the index in <= {max(cleared):.2f} s")


def _index_blocks(run: ChaosRun, slot: int) -> int:
    from shmdisagg.shm.index import server_blocks

    with run.dep.table() as table:
        return (server_blocks(table) or {}).get(slot, 0)


# -- 3. an executor SIGSTOPped past the leg timeout -------------------------------------------


def test_sigstop_of_an_executor_past_the_leg_timeout(
    tmp_path: Path, shm_prefix: str, chaos_row: dict[str, Any]
) -> None:
    """Under `shmdisagg serve -r 1`: legs to a stopped executor end with a 504 (or an SSE error
    event) when their leg timeout passes, the executor is taken out of routing, and after
    SIGCONT it serves again."""
    layout = Layout(
        schedule_style="context_first",
        routers=("load_balancing", {"type": "load_balancing", "use_tokens": True}),
        leg_timeout_s=1.0,
        request_timeout_s=8.0,
    )
    with ChaosRun(layout, Rules(statuses=EXECUTOR_DOWN), tmp_path, shm_prefix, chaos_row) as run:
        stops = 0
        while run.more(stops, at_least=1):
            ex = _spare(run)
            run.dep.stop_executor(ex)
            stops += 1
            run.hold(layout.leg_timeout_s + 1.0)  # past the leg timeout of what it holds
            run.dep.cont_executor(ex)
            run.wait_until(lambda: run.dep.healthy(ex.slot), 60, f"{ex.name} healthy after SIGCONT")  # noqa: B023 (polled before the loop moves on)
            run.wait_served(10)
    timed_out = sum(1 for o in run.load.outcomes if o.status == 504)
    assert timed_out >= 1, "no request met the stopped executor: the scenario did not test the leg timeout"


# -- 4. the coordinator SIGKILLed --------------------------------------------------------------


class NoNewCoordinator(ExpectedFailure):
    """No new coordinator took over the control table after the old one was SIGKILLed."""


def test_sigkill_of_the_coordinator_and_its_restart(tmp_path: Path, shm_prefix: str, chaos_row: dict[str, Any]) -> None:
    """A supervisor restarts a SIGKILLed coordinator, which adopts the shared-memory segments
    while the fleet keeps serving: no request fails."""
    conv = {"type": "conversation"}
    layout = Layout(schedule_style="context_first", routers=(conv, conv), num_ctx=1, num_gen=2)
    with ChaosRun(layout, Rules(), tmp_path, shm_prefix, chaos_row) as run:
        kills = 0
        while run.more(kills, at_least=1):
            old = run.dep.coordinator_pid()
            os.kill(old, signal.SIGKILL)
            run.dep.note("coordinator SIGKILL", str(old))
            kills += 1
            took = _wait_new_coordinator(run, old, timeout_s=15)
            run.notes.append(f"new coordinator in {took:.2f} s")
            run.wait_served(10)
            run.hold(run.rng.uniform(0.3, 1.0))


def _wait_new_coordinator(run: ChaosRun, old: int, timeout_s: float) -> float:
    """Seconds until the control table names a live coordinator other than `old`. Raises
    NoNewCoordinator after `timeout_s`, or at once when nothing is left to restart it or to
    serve meanwhile (the launcher exited, or no fleet worker runs)."""
    began = run.elapsed
    workers = run.dep.worker_pids()
    while True:
        try:
            pid = run.dep.coordinator_pid()
        except Exception:  # the segment is gone, or being replaced
            pid = 0
        if pid and pid != old and running(pid):
            return run.elapsed - began
        main = run.dep.main
        if main is not None and main.poll() is not None:
            raise NoNewCoordinator(
                f"the deployment exited with {main.returncode} after the coordinator's SIGKILL; nothing restarted it"
            )
        if not any(running(w) for w in workers):
            raise NoNewCoordinator(
                "every fleet worker exited after the coordinator's SIGKILL and no new coordinator appeared"
            )
        if run.elapsed - began > timeout_s:
            raise NoNewCoordinator(f"no new coordinator in the control table {timeout_s:g} s after the SIGKILL")
        run.hold(0.05)


# -- 5. clients that leave at random points ---------------------------------------------------


def test_clients_that_disconnect_at_random_points(tmp_path: Path, shm_prefix: str, chaos_row: dict[str, Any]) -> None:
    """Clients leave inside the head, after it, inside the body, before the answer and in the
    middle of a stream: their legs are cancelled upstream (executors idle after the load), their
    picks released, and the other clients' requests unaffected."""
    layout = Layout(
        schedule_style="generation_first", routers=("round_robin", {"type": "conversation"}), num_ctx=2, num_gen=1
    )
    with ChaosRun(layout, Rules(), tmp_path, shm_prefix, chaos_row) as run:
        waves = 0
        while run.more(waves, at_least=2):
            points = [LEAVE_POINTS[(waves + k) % len(LEAVE_POINTS)] for k in range(10)]
            futures = [
                run.load.submit(
                    lambda p=p, k=k: leaving_client(run.dep.port, random.Random(run.seed + 31 * waves + k), p)  # noqa: B023 (its future is waited on in this iteration)
                )
                for k, p in enumerate(points)
            ]
            run.extra += [f.result(30) for f in futures]
            waves += 1
            run.hold(run.rng.uniform(0.1, 0.4))
        left = {p: sum(1 for o in run.extra if o.detail == p) for p in LEAVE_POINTS}
        run.notes.append("left " + ", ".join(f"{p} {n}" for p, n in left.items()))


# -- 6. slow-reading, stalled and trickling clients -------------------------------------------


def test_slow_reading_and_trickling_clients(tmp_path: Path, shm_prefix: str, chaos_row: dict[str, Any]) -> None:
    """Streams read slowly are answered in full (or end with a clean error at the deadline);
    heads and bodies sent a byte at a time are answered (a 408 is clean, not required); clients
    that stop reading hold no load counter past the request deadline while still connected."""
    kv = {"type": "kv_cache_aware"}
    layout = Layout(
        schedule_style="context_first", routers=(kv, kv), conditional=64, request_timeout_s=3.0, num_ctx=1, num_gen=2
    )
    rules = Rules(client_statuses=(("slow_reader", frozenset({504})), ("trickle", frozenset({408}))))
    with ChaosRun(layout, rules, tmp_path, shm_prefix, chaos_row) as run:
        port = run.dep.port
        rounds = 0
        stalled: list[tuple[Any, asyncio.Event]] = []  # the current round's: at most two connected at a time
        last_stalled = 0.0
        while run.more(rounds, at_least=1):
            rng = random.Random(run.seed + rounds)
            _release(run, stalled)
            events = [_event_on(run) for _ in range(2)]
            # 20000 tokens (~5 MB of SSE) outgrow every buffer on the way: the fleet's relay blocks
            stalled = [
                (
                    run.load.submit(
                        lambda r=random.Random(rng.random()), e=e: stalled_reader(port, r, e, max_tokens=20000)  # noqa: B008 (on purpose: each client's own RNG, drawn in order from the round's)
                    ),
                    e,
                )
                for e in events
            ]
            last_stalled = run.elapsed
            owed = [
                run.load.submit(
                    lambda r=random.Random(rng.random()): slow_reader(  # noqa: B008 (on purpose: each client's own RNG, drawn in order from the round's)
                        port, r, run.deadline_s, max_tokens=96, read_bytes=512, pause_s=0.02
                    )
                )
                for _ in range(2)
            ]
            owed += [
                run.load.submit(
                    lambda r=random.Random(rng.random()), part=part: trickling_client(  # noqa: B008 (on purpose: each client's own RNG, drawn in order from the round's)
                        port, r, run.deadline_s, part=part, gap_s=0.012
                    )
                )
                for part in ("head", "body")
            ]
            run.extra += [f.result(run.deadline_s + 10) for f in owed]
            rounds += 1
        # the last stalled readers are still connected, not reading, past their request deadline
        run.hold(max(0.0, last_stalled + layout.request_timeout_s + 0.5 - run.elapsed))
        run.load.stop_users()
        waited, problems = poll(lambda: load_problems(run.dep), 10)
        assert not problems, f"load held while the stalled clients stay connected: {problems}"
        # each stalled stream really stalled: cut upstream (at its deadline, or when its client left)
        _, cut = poll(lambda: [] if _aborted(run) >= 2 * rounds else [f"{_aborted(run)} aborted"], 10)
        assert not cut, (
            f"{2 * rounds} stalled streams, but the generation executors aborted {cut}: a stream that never "
            "stalled tests nothing"
        )
        run.notes.append(
            f"{2 * rounds} stalled clients; the last ones' picks released while connected ({waited:.2f} s after "
            "the load)"
        )
        _release(run, stalled)
        slow = [o for o in run.extra if o.user == "slow_reader"]
        run.notes.append(
            f"slow streams {sum(o.kind == COMPLETE for o in slow)}/{len(slow)} complete, longest "
            f"{max(o.elapsed for o in slow):.1f} s"
        )


def _aborted(run: ChaosRun) -> int:
    """Requests the generation executors saw aborted (their client, the fleet, left)."""
    return sum(
        http_json(ex.addr, "/sim/stats")[1]["counters"]["aborted"]
        for ex in run.dep.live_executors()
        if ex.role == "generation"
    )


def _release(run: ChaosRun, stalled: list[tuple[Any, asyncio.Event]]) -> None:
    for future, event in stalled:
        run.load.submit(lambda e=event: _set(e)).result(5)
        run.extra.append(future.result(10))


def _event_on(run: ChaosRun) -> asyncio.Event:
    return run.load.submit(lambda: _make_event()).result(5)  # type: ignore[no-any-return]


async def _make_event() -> asyncio.Event:
    return asyncio.Event()


async def _set(event: asyncio.Event) -> None:
    event.set()


# -- 7. a burst far above admission capacity ---------------------------------------------------


def test_burst_far_above_admission_capacity(tmp_path: Path, shm_prefix: str, chaos_row: dict[str, Any]) -> None:
    """200 requests at once against `max_inflight_requests: 8`: each gets an answer or a clean
    429 / 503, none hangs, and admission did refuse some."""
    lb = {"type": "load_balancing", "use_tokens": True}
    layout = Layout(
        schedule_style="generation_first",
        routers=(lb, lb),
        shmdisagg={"max_inflight_requests": 8},
        num_ctx=2,
        num_gen=1,
    )
    with ChaosRun(layout, Rules(statuses=frozenset({429, 503})), tmp_path, shm_prefix, chaos_row) as run:
        bursts = 0
        while run.more(bursts, at_least=2):
            outs: list[Outcome] = run.load.submit(
                lambda b=bursts: burst(run.dep.port, run.seed + b, 200, run.deadline_s)
            ).result(run.deadline_s + 30)
            run.extra += outs
            run.dep.note("burst of 200", "")
            bursts += 1
            run.hold(run.rng.uniform(0.2, 0.5))
    refused = sum(1 for o in run.extra if o.status == 429)
    assert refused, "no request of the bursts was refused with 429: the burst did not exceed admission"


# the long run splits its duration over the scenarios: keep the count in step
assert len([name for name in dict(globals()) if name.startswith("test_")]) == SCENARIOS
