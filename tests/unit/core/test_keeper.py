"""The deployment's supervisor keeps the coordinator running (`coordinator/keeper.py`): a
coordinator that dies after it served is replaced by one that adopts; one that fails to start,
or exits 0 (stopped), is not; replacements that keep failing end the deployment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from shmdisagg.config import load_config
from shmdisagg.coordinator import keeper as keeper_mod
from shmdisagg.coordinator.keeper import CoordinatorKeeper
from tests.integration.harness import write_config

# A stand-in coordinator: reports ready (or not), then exits with the code it is told.
FAKE = r"""
import os, sys, time
ready, code, linger = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
if "SHMDISAGG_STANDBY_FD" in os.environ and not os.read(int(os.environ["SHMDISAGG_STANDBY_FD"]), 1):
    sys.exit(0)  # a standby the keeper let go
if ready != "0":  # "1": fleet started and ready; "F": fleet started, never ready
    os.write(int(os.environ["SHMDISAGG_READY_FD"]), b"FR" if ready == "1" else b"F")
time.sleep(linger)
sys.exit(code)
"""


class Script:
    """Each process started (a warm standby too: it runs its part once promoted) runs the next
    (ready, exit code, seconds before it exits); records the env and the pid. A standby started
    after the last run is never promoted."""

    def __init__(self, runs: list[tuple[bool | str, int, float]]) -> None:
        self.runs = runs
        self.envs: list[dict[str, str]] = []
        self.pids: list[int] = []

    def __call__(self, env: dict[str, str], fds: Sequence[int]) -> subprocess.Popen[bytes]:
        ready, code, linger = self.runs[len(self.envs)] if len(self.envs) < len(self.runs) else (False, 3, 0.0)
        self.envs.append(env)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                FAKE,
                ready if isinstance(ready, str) else "1" if ready else "0",
                str(code),
                str(linger),
            ],
            env={**os.environ, **env},
            pass_fds=tuple(fds),
        )
        self.pids.append(proc.pid)
        return proc


def _run(keeper: CoordinatorKeeper, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (code := keeper.check()) is None:
        assert time.monotonic() < deadline, "the keeper never ended"
        time.sleep(0.01)
    return code


@pytest.fixture
def config(tmp_path: Path, shm_prefix: str):  # type: ignore[no-untyped-def]
    return load_config(write_config(tmp_path, shm_prefix, ["127.0.0.1:1"], ["127.0.0.1:2"]))


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keeper_mod, "RESTART_BACKOFF_S", (0.0,))


def test_a_coordinator_that_dies_after_it_served_is_replaced_by_one_that_adopts(config) -> None:  # type: ignore[no-untyped-def]
    script = Script([(True, -9, 0.1), (True, 0, 0.3)])  # killed after serving; the replacement is stopped later
    keeper = CoordinatorKeeper(script, config)
    keeper.start()
    assert _run(keeper) == 0
    assert keeper.restarts == 1
    first, second = script.envs[:2]  # (a third: the standby started once the second served)
    assert "SHMDISAGG_ADOPT" not in first and second["SHMDISAGG_ADOPT"] == "1"
    assert first["SHMDISAGG_SUPERVISOR"] == second["SHMDISAGG_SUPERVISOR"] == str(keeper.identity)


def test_a_warm_standby_is_promoted_when_the_coordinator_dies(config) -> None:  # type: ignore[no-untyped-def]
    script = Script([(True, -9, 2.0), (True, 0, 0.5)])  # the first lives long enough for a standby to start
    keeper = CoordinatorKeeper(script, config)
    keeper.start()
    assert _run(keeper) == 0 and keeper.restarts == 1
    assert script.envs[1]["SHMDISAGG_ADOPT"] == "1" and "SHMDISAGG_STANDBY_FD" in script.envs[1]
    assert keeper.proc is not None and keeper.proc.pid == script.pids[1]  # the standby took over, no new process
    assert all(p is None or p.poll() is not None for p in (keeper.standby,))


def test_a_coordinator_that_dies_after_its_fleet_started_but_before_ready_is_restarted(config) -> None:  # type: ignore[no-untyped-def]
    # its workers may serve already (the ones that listen): the deployment goes on
    script = Script([("F", -9, 0.0), (True, 0, 0.0)])
    keeper = CoordinatorKeeper(script, config)
    keeper.start()
    assert _run(keeper) == 0 and keeper.restarts == 1
    assert script.envs[1].get("SHMDISAGG_ADOPT") == "1"


def test_a_coordinator_that_fails_to_start_is_not_restarted(config) -> None:  # type: ignore[no-untyped-def]
    script = Script([(False, 1, 0.0)])
    keeper = CoordinatorKeeper(script, config)
    keeper.start()
    assert _run(keeper) == 1 and keeper.restarts == 0


def test_a_coordinator_killed_before_it_served_ends_the_deployment_with_128_plus_the_signal(config) -> None:  # type: ignore[no-untyped-def]
    keeper = CoordinatorKeeper(Script([(False, 0, 30.0)]), config)
    keeper.start()
    assert keeper.proc is not None
    keeper.proc.kill()
    assert _run(keeper) == 137 and keeper.restarts == 0


def test_a_coordinator_that_exits_0_was_stopped_and_is_not_restarted(config) -> None:  # type: ignore[no-untyped-def]
    keeper = CoordinatorKeeper(Script([(True, 0, 0.0)]), config)
    keeper.start()
    assert _run(keeper) == 0 and keeper.restarts == 0


def test_replacements_that_keep_failing_end_the_deployment(config, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    runs = [(True, 0, 60.0)] + [(False, 1, 0.0)] * keeper_mod.MAX_FAILED_RESTARTS
    script = Script(runs)
    keeper = CoordinatorKeeper(script, config)
    keeper.start()
    while not keeper.served:  # the first one reports ready, then runs until killed
        assert keeper.check() is None
        time.sleep(0.01)
    os.kill(script.pids[0], signal.SIGKILL)
    assert _run(keeper) == 1
    assert keeper.restarts == keeper_mod.MAX_FAILED_RESTARTS
    # the give-up line names the death that started it, not only the last replacement's exit
    gave_up = [r.getMessage() for r in caplog.records if "keep failing" in r.getMessage()]
    assert gave_up == [
        f"coordinator restarts keep failing: the coordinator (pid {script.pids[0]}) that served died "
        f"(killed by SIGKILL), then {keeper_mod.MAX_FAILED_RESTARTS} replacements in a row never became ready "
        "(the last: exit 1): stopping the deployment"
    ]


def test_one_that_serves_again_resets_the_failure_count(config) -> None:  # type: ignore[no-untyped-def]
    n = keeper_mod.MAX_FAILED_RESTARTS - 1
    runs = [(True, -9, 0.0)] + [(False, 1, 0.0)] * n + [(True, -9, 0.0)] + [(False, 1, 0.0)] * n + [(True, 0, 0.0)]
    keeper = CoordinatorKeeper(Script(runs), config)
    keeper.start()
    assert _run(keeper) == 0 and keeper.restarts == 2 * n + 2


def test_stop_terminates_the_coordinator_and_reports_its_status(config) -> None:  # type: ignore[no-untyped-def]
    keeper = CoordinatorKeeper(Script([(True, 0, 60.0)]), config)
    keeper.start()
    deadline = time.monotonic() + 10
    while not keeper.served:
        assert keeper.check() is None and time.monotonic() < deadline
        time.sleep(0.01)
    assert keeper.stop(10.0) == 128 + 15  # the stand-in does not handle SIGTERM: killed by it
    assert keeper.proc is not None and keeper.proc.returncode == -15
