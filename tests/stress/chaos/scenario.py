"""One chaos scenario's run: the deployment up, the load on, the faults (the test's body), then
every invariant (`checks.py`) and the report row.

Durations: `SHMDISAGG_CHAOS_DURATION` (seconds, `scripts/stress.sh`) is the suite's total load
time, split evenly over the scenarios, each repeating its fault (kill, recover, kill again) for
its share; unset, each scenario loads for `SHORT_LOAD_S` with at least its minimum number of
faults (the short version, part of the normal suite). `SHMDISAGG_CHAOS_SEED` fixes the seed of
the faults and the load (else one is drawn and reported).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.stress.chaos.checks import Rules, Tally, after_load, after_stop, judge
from tests.stress.chaos.client import Outcome
from tests.stress.chaos.deploy import ChaosDeployment, Layout
from tests.stress.chaos.load import LoadDriver

SHORT_LOAD_S = 2.0
SCENARIOS = 7  # the tests in test_chaos.py: the long run splits its duration over them
DEADLINE_MARGIN_S = 4.0  # the client's deadline past the deployment's request_timeout_s (queueing on 2 shared cores)


class ExpectedFailure(AssertionError):
    """A scenario's known failure (its test is `xfail(raises=...)` with this class): it ends the
    run without the outcome checks, but leftovers after shutdown still fail the test."""


def load_seconds() -> float:
    total = os.environ.get("SHMDISAGG_CHAOS_DURATION")
    return max(SHORT_LOAD_S, float(total) / SCENARIOS) if total else SHORT_LOAD_S


class ChaosRun:
    """`with ChaosRun(...) as run:` starts the deployment and the load; the body injects the
    faults while `run.more()`; leaving the block stops the load and checks everything, raising
    AssertionError with every problem found. `row` is the scenario's line of the report."""

    def __init__(
        self, layout: Layout, rules: Rules, tmp: Path, shm_prefix: str, row: dict[str, Any], *, users: int = 3
    ) -> None:
        self.layout = layout
        self.rules = rules
        self.row = row
        seed = os.environ.get("SHMDISAGG_CHAOS_SEED")
        self.seed = int(seed) if seed else random.randrange(1 << 20)
        self.rng = random.Random(self.seed)
        self.dep = ChaosDeployment(layout, tmp, shm_prefix)
        self.deadline_s = layout.request_timeout_s + DEADLINE_MARGIN_S
        self.load = LoadDriver(self.dep.port, users=users, deadline_s=self.deadline_s, seed=self.seed)
        self.load_s = load_seconds()
        self.extra: list[Outcome] = []  # outcomes of the scenario's own clients (owed, or ABANDONED on purpose)
        self.notes: list[str] = []
        self.began = 0.0
        row.update(layout=layout.describe(), seed=self.seed)

    # -- the body's helpers ----------------------------------------------------------------

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def more(self, done: int, at_least: int = 1) -> bool:
        """Whether to inject another fault: `done` so far, at least `at_least`, then while the
        scenario's load time lasts."""
        return done < at_least or self.elapsed < self.load_s

    def hold(self, seconds: float) -> None:
        """Let the load run for `seconds` (the deployment serving between faults)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._check_alive()
            time.sleep(0.05)

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
        """Poll `predicate` (load running) until it holds; seconds it took; AssertionError after
        `timeout_s`."""
        began = time.monotonic()
        while not predicate():
            if time.monotonic() - began > timeout_s:
                raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}\n{self.dep.log_tail()}")
            time.sleep(0.02)
        return time.monotonic() - began

    def completions(self) -> int:
        return sum(1 for o in self.load.outcomes if o.kind == "complete")

    def wait_served(self, n: int = 10, timeout_s: float = 20.0) -> None:
        """Until `n` more requests completed: the deployment serves."""
        target = self.completions() + n
        self.wait_until(lambda: self.completions() >= target, timeout_s, f"{n} more complete answers")

    def _check_alive(self) -> None:
        if self.dep.main is not None and self.dep.main.poll() is not None:
            raise AssertionError(f"the deployment exited with {self.dep.main.returncode}:\n{self.dep.log_tail()}")

    # -- around the body -------------------------------------------------------------------

    def __enter__(self) -> ChaosRun:
        began = time.monotonic()
        self.dep.start()
        self.row["start_s"] = round(time.monotonic() - began, 1)
        try:
            self.load.start()
            self.began = time.monotonic()
            self.wait_served(5)
        except BaseException as err:
            self.__exit__(type(err), err, err.__traceback__)  # stops and checks everything; raises what it found
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        problems: list[str] = []
        try:
            self.load.stop()
        except AssertionError as e:
            problems.append(str(e))
        load_s = time.monotonic() - self.began
        tally = judge([*self.load.outcomes, *self.extra], self.dep.events, self.rules, self.began)
        # after a known failure the deployment may be half gone: only what it left behind is judged
        serving = not isinstance(err, ExpectedFailure) and self.dep.main is not None and self.dep.main.poll() is None
        drained = after_load(self.dep, [*self.load.outcomes, *self.extra]) if serving else None
        if not serving and not isinstance(err, ExpectedFailure):
            problems.append(
                f"the deployment exited with {self.dep.main.returncode if self.dep.main else None} before the checks"
            )
        stopping = time.monotonic()
        try:
            self.dep.stop()
        except AssertionError as e:
            problems.append(str(e))
        left = after_stop(self.dep)
        self.row["stop_s"] = round(time.monotonic() - stopping, 1)
        self._fill_row(tally, load_s, drained.seconds if drained else None)
        problems += [f"violation: {v}" for v in tally.violations[:30]]
        if len(tally.violations) > 30:
            problems.append(f"... and {len(tally.violations) - 30} more violations")
        problems += (drained.problems if drained else []) + [f"after shutdown: {p}" for p in left]
        if isinstance(err, ExpectedFailure) and not left:
            self.row["result"] = f"xfail: {kind.__name__}"
            return  # the known reason stands (what it caused is not judged), unless it left processes behind
        if err is not None:
            problems.insert(0, f"the scenario raised {type(err).__name__}: {err}")
        self.row["result"] = "fail" if problems else "pass"
        if problems:
            header = f"chaos scenario failed (seed {self.seed}; {tally.summary()}; faults at "
            header += (
                ", ".join(f"+{f.at - self.began:.3f}..{f.done - self.began:.3f} {f.what}" for f in self.dep.events)
                + "):"
            )
            raise AssertionError(
                "\n  ".join([header, *problems]) + f"\n--- deployment log tail ---\n{self.dep.log_tail()}"
            ) from err

    def _fill_row(self, tally: Tally, load_s: float, drain_s: float | None) -> None:
        faults: dict[str, int] = {}
        for fault in self.dep.events:
            faults[fault.what] = faults.get(fault.what, 0) + 1
        self.row.update(
            load_s=round(load_s, 1),
            faults=", ".join(f"{n} {what}" for what, n in faults.items()) or "-",
            owed=tally.owed,
            complete=tally.complete,
            errors=" ".join(f"{s}:{n}" for s, n in sorted(tally.errors.items())) or "-",
            cut=tally.forgiven_cuts,
            abandoned=tally.abandoned,
            violations=len(tally.violations),
            drain_s=None if drain_s is None else round(drain_s, 2),
            notes="; ".join(self.notes),
        )
