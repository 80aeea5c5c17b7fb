"""A leg whose every server of the role cannot be connected to ends with the role's 503, known
from this leg's own attempts or from this worker's recent refusals; a server republished by the
coordinator (it came back) is tried again. Real table, policy and upstream pool; the executors
are ports nothing listens on."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

from shmdisagg.config import RouterConfig
from shmdisagg.orchestrator.directory import ServerDirectory
from shmdisagg.orchestrator.errors import RequestError
from shmdisagg.orchestrator.legs import LegRunner
from shmdisagg.orchestrator.reporting import FailureReporter
from shmdisagg.routing import RoutingKey, make_policy
from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION, ControlTable, process_starttime
from shmdisagg.upstream import UpstreamConnectError, UpstreamPool
from tests.conftest import free_port


@pytest.fixture
def table(shm_prefix: str) -> Iterator[ControlTable]:
    with ControlTable.create(shm_prefix) as t:
        t.publish_server(0, f"127.0.0.1:{free_port()}", ROLE_CONTEXT, True)
        t.publish_server(1, f"127.0.0.1:{free_port()}", ROLE_GENERATION, True)  # nothing listens on these
        t.publish_server(2, f"127.0.0.1:{free_port()}", ROLE_GENERATION, True)
        yield t
        t.unlink()


class Recording:
    """The worker's policy, with the slots it picked."""

    def __init__(self, inner: object) -> None:
        self.inner, self.picks = inner, []  # type: ignore[var-annotated]
        self.name = "round_robin"

    def pick(self, key: RoutingKey, exclude: int) -> int:
        slot = self.inner.pick(key, exclude)  # type: ignore[attr-defined]
        self.picks.append(slot)
        return slot  # type: ignore[no-any-return]

    def release(self, slot: int, key: RoutingKey) -> None:
        self.inner.release(slot, key)  # type: ignore[attr-defined]


def _leg(table: ControlTable, max_retries: int) -> tuple[LegRunner, Recording]:
    row = table.claim_row(os.getpid(), process_starttime(os.getpid()))
    policy = Recording(make_policy(table, row, ROLE_GENERATION, RouterConfig()))
    reporter = FailureReporter("/nonexistent/coord.sock")  # never started: reports are only queued
    return LegRunner(ServerDirectory(table), UpstreamPool(), reporter, max_retries), policy


async def _open(legs: LegRunner, policy: Recording) -> BaseException:
    try:
        await legs.open(policy, RoutingKey(1), "/v1/completions", lambda _: b"{}", "generation")  # type: ignore[arg-type]
    except (RequestError, UpstreamConnectError) as err:
        return err
    raise AssertionError("the leg opened")


def test_every_server_refusing_within_one_leg_is_the_roles_503(table: ControlTable) -> None:
    async def run() -> None:
        legs, policy = _leg(table, max_retries=1)
        err = await _open(legs, policy)
        assert sorted(policy.picks) == [1, 2]
        assert isinstance(err, RequestError) and (err.status, err.code) == (503, "no_generation_servers")
        assert err.message == "no healthy generation server"
        assert table.load(1) == table.load(2) == (0, 0)  # every pick released
        await legs.upstream.close()

    asyncio.run(run())


def test_the_workers_recent_refusals_count_until_the_coordinator_republishes_the_server(table: ControlTable) -> None:
    async def run() -> None:
        legs, policy = _leg(table, max_retries=0)
        first = await _open(legs, policy)
        # one server refused, the other was never tried: the connect error stays (a 502)
        assert isinstance(first, UpstreamConnectError)
        second = await _open(legs, policy)  # the other one: now both refused within a second
        assert sorted(policy.picks) == [1, 2]
        assert isinstance(second, RequestError) and second.status == 503
        # the coordinator takes the second back (a new incarnation): it is worth a try again, so
        # the next refusal (round robin: the first server) is not the whole role's
        back = policy.picks[1]
        table.publish_server(back, next(s.addr for s in table.servers() if s.slot == back), ROLE_GENERATION, True)
        third = await _open(legs, policy)
        assert policy.picks[2] == policy.picks[0]
        assert isinstance(third, UpstreamConnectError)
        await legs.upstream.close()

    asyncio.run(run())
