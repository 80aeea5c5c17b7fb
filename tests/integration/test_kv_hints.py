"""KV poll hints end to end: fleet workers hint the coordinator when a leg ends, and the executor's
KV events become visible without waiting for the fallback poll."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import aiohttp

from shmdisagg.hashing import block_hashes
from shmdisagg.launch import Deployment
from shmdisagg.orchestrator.reporting import hint_message
from shmdisagg.shm.index import BlockIndex
from shmdisagg.shm.table import ControlTable
from tests.conftest import free_port
from tests.integration.harness import (
    connection_to_worker,
    deployment,
    post,
    request_json,
    stream_lines,
    wait_until,
    write_config,
)

MODEL = "sim-llama-3.1-8b"
HOUR = 3600.0


def _coordinator_info(dep: Deployment) -> dict[str, Any]:
    async def get() -> dict[str, Any]:
        conn = aiohttp.UnixConnector(path=dep.config.coordinator_socket)
        async with aiohttp.ClientSession(connector=conn) as session:
            async with session.get("http://coordinator/cluster_info") as r:
                return await r.json()  # type: ignore[no-any-return]

    return asyncio.run(get())


def _event_mask(dep: Deployment, block_hash: int) -> int:
    with ControlTable.attach(dep.config.shm_prefix) as table, BlockIndex.attach(table) as index:
        found = index.lookup(block_hash)
        return found[0] if found else 0


def test_hints_make_kv_events_visible_without_the_fallback_poll(tmp_path: Path, shm_prefix: str) -> None:
    ctx, gen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cfg = write_config(
        tmp_path,
        shm_prefix,
        [ctx],
        [gen],
        routers=("kv_cache_aware", "kv_cache_aware"),
        shmdisagg={
            "executors": {"backend": "sim", "model": MODEL, "sim": {"speedup": 20.0}},
            # no fallback poll within the test: only a hint can trigger a drain
            "kv_events": {"busy_poll_s": HOUR, "idle_poll_s": HOUR, "hinted_poll_s": HOUR},
        },
    )
    with deployment(cfg) as dep:
        hint_path = dep.config.kv_hint_socket
        assert os.path.exists(hint_path)
        with ControlTable.attach(dep.config.shm_prefix) as table:
            slots = {s.addr: s.slot for s in table.servers()}
        both = (1 << slots[ctx]) | (1 << slots[gen])

        # non-streaming: the context server's prompt blocks (hinted when its response is read)
        # and the generation server's (hinted when its answer is complete)
        prompt = list(range(20_000, 20_000 + 640))
        assert post(dep, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})[0] == 200
        hashes = block_hashes(prompt, 32)[:19]  # the generation server stores whole blocks before the last token
        wait_until(
            lambda: all(_event_mask(dep, h) == both for h in hashes), timeout_s=10, what="both servers' stored events"
        )

        # streaming: hinted at the first chunk and at the end
        prompt2 = list(range(30_000, 30_000 + 640))
        status, events, _ = stream_lines(
            dep, "/v1/completions", {"model": MODEL, "prompt": prompt2, "max_tokens": 4, "stream": True}
        )
        assert status == 200 and events[-1] == b"[DONE]"
        hashes2 = block_hashes(prompt2, 32)[:19]
        wait_until(
            lambda: all(_event_mask(dep, h) == both for h in hashes2),
            timeout_s=10,
            what="streamed request's stored events",
        )

        counters = _coordinator_info(dep)["kv_events"]
        assert counters["hinted_drains"] >= 2 and counters["polled_drains"] == 0, counters
        assert counters["bad_hints"] == 0 and counters["dropped_events"] == 0, counters
        sent = 0
        for index in range(dep.config.num_workers):
            conn = connection_to_worker(dep, index)
            sent += request_json("", 0, "GET", "/cluster_info", conn=conn)[1]["kv_hints"]["sent"]
            conn.close()
        assert sent >= 4  # context response, generation end; first chunk and end of the stream

        # malformed datagrams are ignored and counted; the coordinator keeps serving
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            for bad in (b"", b"not a hint", hint_message(1000)):
                s.sendto(bad, hint_path)
        wait_until(
            lambda: _coordinator_info(dep)["kv_events"]["bad_hints"] == 3, timeout_s=10, what="bad hints counted"
        )
        assert post(dep, "/v1/completions", {"model": MODEL, "prompt": prompt + [1, 2, 3], "max_tokens": 2})[0] == 200
    # the coordinator removed both of its sockets at shutdown
    assert not os.path.exists(hint_path)
    assert not os.path.exists(dep.config.coordinator_socket)


def test_only_kv_aware_roles_are_hinted_and_drained(tmp_path: Path, shm_prefix: str) -> None:
    """A role routed without the KV index (here generation, round-robin) sends no hints and its
    executors are not drained: their events would cost the coordinator drains that no routing
    decision reads (and, polled without hints, would show as late in the lag histogram)."""
    ctx, gen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cfg = write_config(
        tmp_path,
        shm_prefix,
        [ctx],
        [gen],
        routers=("kv_cache_aware", "round_robin"),
        num_workers=1,
        shmdisagg={
            "executors": {"backend": "sim", "model": MODEL, "sim": {"speedup": 20.0}},
            "kv_events": {"busy_poll_s": 0.01, "idle_poll_s": 0.01, "hinted_poll_s": 0.01},
        },
    )
    with deployment(cfg) as dep:
        for i in range(3):
            body = {"model": MODEL, "prompt": list(range(1000 * i, 1000 * i + 100)), "max_tokens": 4, "stream": True}
            status, events, _ = stream_lines(dep, "/v1/completions", body)
            assert status == 200 and events[-1] == b"[DONE]"
        conn = connection_to_worker(dep, 0)
        hints = request_json("", 0, "GET", "/cluster_info", conn=conn)[1]["kv_hints"]
        conn.close()
        assert hints["sent"] + hints["failed"] == 3  # one per context response, none for generation
        # ...and the coordinator never drains that role's executor: once the context server's
        # blocks are visible, the generation server still holds every stored event it emitted
        ctx_hashes = block_hashes(list(range(2000, 2100)), 32)
        wait_until(
            lambda: all(_event_mask(dep, h) for h in ctx_hashes), timeout_s=10, what="context server's stored events"
        )
        host, port = gen.split(":")
        status, events = request_json(host, int(port), "POST", "/kv_cache_events")
        assert status == 200
        assert sum(1 for e in events if e["data"]["type"] == "stored") >= 3, events
