"""A fleet worker's start: loading the routing tokenizer (importing transformers, reading the
tokenizer files: seconds, more on a loaded host) must not look like a stuck worker to the
coordinator, which kills a row silent for `worker_timeout_s`."""

from __future__ import annotations

import asyncio
import os
import time

from shmdisagg.fleet.worker import _beating
from shmdisagg.shm.table import ControlTable, process_starttime


def test_the_row_keeps_beating_while_the_routing_tokenizer_loads(shm_prefix: str) -> None:
    table = ControlTable.create(shm_prefix)
    try:
        row = table.claim_row(os.getpid(), process_starttime(os.getpid()))

        def beat() -> int:
            return next(r.heartbeat_ns for r in table.rows() if r.pid == os.getpid())

        def slow_load() -> str:  # stands for the tokenizer load: done once the row has beaten twice
            seen = {beat()}
            deadline = time.monotonic() + 10
            while len(seen) < 3:
                if time.monotonic() > deadline:
                    return "the row did not beat"
                seen.add(beat())
                time.sleep(0.01)
            return "loaded"

        assert asyncio.run(_beating(table, row, asyncio.to_thread(slow_load))) == "loaded"
    finally:
        table.unlink()
        table.close()
