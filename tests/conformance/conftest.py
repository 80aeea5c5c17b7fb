"""Fixtures of the conformance suite: the worker copy (or a skip naming why not), worker
processes per module, and shmdisagg deployments in front of them.

Every test here is marked `conformance` (`-m conformance` runs only these, `-m "not conformance"`
leaves them out). Ports come from `free_port`, run directories and config folders from
`tmp_path_factory`, and shared-memory prefixes are unique per deployment, so the suite runs under
`pytest -n auto`; `--dist loadgroup` (what scripts/test.sh passes) keeps each deployment's tests
on one xdist worker, so each deployment starts once.
"""

from __future__ import annotations

import contextlib
import glob
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shmdisagg.launch import Deployment
from tests.conformance.worker_copy import WorkerCopy, locate
from tests.conformance.workers import Answer, ForkServer, Worker, WorkerSet, call
from tests.integration.harness import deployment, wait_until, write_config

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).parent == HERE:
            item.add_marker(pytest.mark.conformance)


@pytest.fixture(scope="session")
def worker_copy() -> WorkerCopy:
    found = locate()
    if isinstance(found, str):
        pytest.skip(f"conformance suite: {found}")
    return found


@pytest.fixture(scope="session")
def forks(worker_copy: WorkerCopy) -> Iterator[ForkServer]:
    server = ForkServer(worker_copy)
    try:
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def worker_set(forks: ForkServer, copy: WorkerCopy, run_dir: Path) -> Iterator[WorkerSet]:
    """Workers stopped at the end of the block, whatever ends it."""
    workers = WorkerSet(forks, copy, run_dir)
    try:
        yield workers
    finally:
        workers.stop()


# Fast fake engine: 1 ms prefill, 1 ms between tokens (the suite compares answers, not timing).
FAST = ("--ttft-ms", "1", "--itl-ms", "1")


class Pool:
    """2 context and 2 generation workers for deployments; outside every deployment, the
    reference worker (the direct answers come from it) and a probe worker (what a request will
    generate, asked before the request is built, without touching the reference's KV cache)."""

    def __init__(self, workers: list[Worker]) -> None:
        self.ctx, self.gen, (self.reference, self.probe) = workers[:2], workers[2:4], workers[4:]


@pytest.fixture(scope="module")
def pool(forks: ForkServer, worker_copy: WorkerCopy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    with worker_set(forks, worker_copy, tmp_path_factory.mktemp("workers")) as workers:
        yield Pool(workers.start(["context", "context", "generation", "generation", "context", "context"], *FAST))


@dataclass
class Deployed:
    """A shmdisagg deployment in front of TensorRT-LLM workers."""

    name: str
    dep: Deployment
    ctx: list[Worker]
    gen: list[Worker]

    @property
    def port(self) -> int:
        return self.dep.config.port

    @property
    def executor_addrs(self) -> list[str]:
        return [w.addr for w in self.ctx + self.gen]

    def post(self, path: str, body: Any) -> Answer:
        return call(self.port, "POST", path, body)


@contextlib.contextmanager
def deployed(name: str, tmp: Path, ctx: list[Worker], gen: list[Worker], **top: Any) -> Iterator[Deployed]:
    """`shmdisagg serve` (coordinator and fleet; `write_config`'s defaults, one fleet worker
    unless `top` says otherwise) in front of `ctx` and `gen`, ready once every executor is
    healthy in the fleet's view. Any shared-memory segment left under its prefix after it
    stopped fails the test.

    `worker_timeout_s: 0`: a fleet worker importing transformers (a `tokenizer_dir` router) on
    a loaded 2-core machine can take longer than the default 10 s to claim its row, and would be
    killed and replaced in a loop; supervision is not what this suite tests."""
    prefix = f"shmdisagg-c{uuid.uuid4().hex[:10]}"
    top = {
        "num_workers": 1,
        **top,
        "shmdisagg": {"worker_timeout_s": 0, "request_timeout_s": 60, **top.get("shmdisagg", {})},
    }
    path = write_config(tmp, prefix, [w.addr for w in ctx], [w.addr for w in gen], **top)
    try:
        with deployment(path) as dep:
            want = {w.addr for w in ctx + gen}
            wait_until(lambda: _all_healthy(dep.config.port, want), what=f"{name}: every executor healthy")
            yield Deployed(name, dep, ctx, gen)
    finally:
        leftovers = glob.glob(f"/dev/shm/{prefix}*")
        for leftover in leftovers:
            os.unlink(leftover)
        assert not leftovers, f"shared-memory segments left behind: {leftovers}"


def _all_healthy(port: int, want: set[str]) -> bool:
    # Each fleet worker keeps its own view: ask several times (connections spread over them).
    for _ in range(4):
        answer = call(port, "GET", "/cluster_info")
        healthy = answer.json.get("healthy", {}) if answer.status == 200 else {}
        if {a for a, ok in healthy.items() if ok} != want:
            return False
    return True
