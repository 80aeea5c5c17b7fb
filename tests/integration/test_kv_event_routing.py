"""KV events as TensorRT-LLM sends them, end to end: a role's hash algorithm from its executors'
`/server_info`, event streams that lose events or restart, executors the router refuses, the
router's `max_batch_size`, and TensorRT-LLM's own worker server (the CPU copy) feeding the index."""

from __future__ import annotations

import os
import struct
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shmdisagg.executors.sim.testing import post_json
from shmdisagg.hashing import block_hashes_for
from shmdisagg.launch import Deployment
from shmdisagg.routing.policy import RoutingKey
from shmdisagg.shm.index import BlockIndex
from shmdisagg.shm.table import ControlTable
from tests.conftest import free_port
from tests.integration.harness import (
    coordinator_info,
    deployment,
    fake_executors,
    post,
    request_json,
    stream_lines,
    wait_until,
    write_config,
)

MODEL = "sim-llama-3.1-8b"
SIM = {"backend": "sim", "model": MODEL, "sim": {"speedup": 20.0}}


def _keys(algo: str, prompt: list[int], tpb: int = 32) -> list[int]:
    raw = block_hashes_for(algo, prompt, tpb)
    return list(struct.unpack(f"<{len(raw) // 8}Q", raw))


def _masks(dep: Deployment, hashes: list[int]) -> list[tuple[int, int]]:
    """(event mask, routed mask) of each block."""
    with ControlTable.attach(dep.config.shm_prefix) as table, BlockIndex.attach(table) as index:
        return [(found[0], found[1]) if (found := index.lookup(h)) else (0, 0) for h in hashes]


def _held_by_events(dep: Deployment, hashes: list[int], slot: int) -> bool:
    return all(e >> slot & 1 for e, _ in _masks(dep, hashes))


def _claimed(dep: Deployment, hashes: list[int], slot: int) -> bool:
    """Any block still claimed for `slot`, by a KV event or a routing."""
    return any((e | r) >> slot & 1 for e, r in _masks(dep, hashes))


def _server(info: dict[str, Any], addr: str) -> dict[str, Any]:
    return next(s for s in info["servers"] if s["addr"] == addr)


@pytest.mark.parametrize("algo", ["v2_sha256", "v2_sha256_64"])
def test_a_role_of_v2_executors_is_routed_on_their_decoded_events(tmp_path: Path, shm_prefix: str, algo: str) -> None:
    ctx = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    gen = [f"127.0.0.1:{free_port()}"]
    # routed-block tracking off: only the executors' KV events can tell where a prefix is
    router = {"type": "kv_cache_aware", "track_routed_blocks": False}
    cfg = write_config(
        tmp_path,
        shm_prefix,
        ctx,
        gen,
        routers=(router, "round_robin"),
        shmdisagg={"executors": SIM},
        context_servers={
            "num_instances": 2,
            "urls": ctx,
            "router": router,
            "kv_cache_config": {"kv_cache_event_hash_algo": algo},
        },
    )
    with deployment(cfg) as dep:
        info = coordinator_info(dep)
        assert info["routing_key_configs"] == {"context": {"tokens_per_block": 32, "kv_cache_hash_algo": algo}}
        status, public = request_json("127.0.0.1", dep.config.port, "GET", "/cluster_info")
        assert (
            status == 200 and public["routing_key_configs"] == info["routing_key_configs"]
        )  # what a client of the fleet sees
        assert all(s["server_info"]["kv_cache_hash_algo"] == algo for s in info["servers"] if s["addr"] in ctx)
        slots = {s["addr"]: s["slot"] for s in info["servers"]}
        prompts = [list(range(10_000 * k, 10_000 * k + 640)) for k in range(1, 5)]
        homes = {}
        for p in prompts:
            status, body = post(dep, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 2})
            assert status == 200, body
            keys = _keys(algo, p)
            wait_until(
                lambda k=keys: any(_held_by_events(dep, k, slots[a]) for a in ctx),
                what="the prompt's v2 blocks in the index",
            )
            homes[tuple(p)] = next(a for a in ctx if _held_by_events(dep, keys, slots[a]))
        for p in prompts:  # each continuation goes where its prefix is, and hits its cache there
            status, body = post(dep, "/v1/completions", {"model": MODEL, "prompt": p + [7, 8, 9], "max_tokens": 2})
            assert status == 200
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 608, (homes[tuple(p)], body["usage"])
        assert coordinator_info(dep)["kv_events"]["dropped_events"] == 0


def test_lost_events_and_a_restart_on_the_same_port_clear_the_server_s_entries_and_are_counted(
    tmp_path: Path, shm_prefix: str
) -> None:
    ctx, gen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cfg = write_config(
        tmp_path, shm_prefix, [ctx], [gen], routers=("kv_cache_aware", "round_robin"), shmdisagg={"executors": SIM}
    )
    with deployment(cfg) as dep:
        slot = _server(coordinator_info(dep), ctx)["slot"]
        a, c, d = (list(range(base, base + 320)) for base in (20_000, 30_000, 40_000))
        ka, kc, kd = (_keys("v1_block_key", p) for p in (a, c, d))

        def send(p: list[int]) -> None:
            status, body = post(dep, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 2})
            assert status == 200, body

        send(a)
        wait_until(lambda: _held_by_events(dep, ka, slot), what="prompt A's blocks confirmed by events")
        # the executor's event buffer loses the event of its cache being dropped
        assert post_json(ctx, "/sim/kv_events", {"drop_next": 1})[0] == 200
        assert post_json(ctx, "/sim/clear_cache", {})[0] == 200
        send(c)  # its events arrive after the gap
        wait_until(lambda: _held_by_events(dep, kc, slot), what="prompt C's blocks")
        assert not _claimed(dep, ka, slot), "the index still claims blocks the executor dropped"
        info = coordinator_info(dep)
        assert _server(info, ctx)["kv_events"]["event_gaps"] == 1 and info["kv_events"]["event_gaps"] == 1

        # restarted between two health polls: same port, never unhealthy, event ids from 0 again
        wait_until(
            lambda: post_json(ctx, "/sim/kv_events", {"restart": True})[0] == 200, what="an idle executor to restart"
        )
        send(d)
        wait_until(lambda: _held_by_events(dep, kd, slot), what="prompt D's blocks")
        assert not _claimed(dep, kc, slot), "the index still claims blocks of the executor before its restart"
        info = coordinator_info(dep)
        state = _server(info, ctx)["kv_events"]
        assert state["restarts"] == 1 and state["event_gaps"] == 1
        assert _server(info, ctx)["healthy"] is True  # no health check ever saw it down
        scrape = _scrape(dep)
        assert f'shmdisagg_server_kv_event_gaps_total{{server="{ctx}"}} 1.0' in scrape
        assert f'shmdisagg_server_kv_cache_restarts_total{{server="{ctx}"}} 1.0' in scrape


def _scrape(dep: Deployment) -> str:
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", dep.config.port, timeout=30)
    try:
        c.request("GET", "/metrics")
        return c.getresponse().read().decode()
    finally:
        c.close()


def test_executors_the_router_cannot_align_with_are_refused_and_divisible_ones_are_not_drained(
    tmp_path: Path, shm_prefix: str, hf_tokenizer_dir: str
) -> None:
    with fake_executors(["c32", "c48", "c64", "cv3", "g0"]) as (c32, c48, c64, cv3, g0):
        c48.script(server_info={"tokens_per_block": 48})
        c64.script(server_info={"tokens_per_block": 64})
        cv3.script(server_info={"kv_cache_hash_algo": "v3_sha512"})
        ctxs = [c32, c48, c64, cv3]
        router = {"type": "kv_cache_aware", "tokens_per_block": 32, "tokenizer_dir": hf_tokenizer_dir}
        cfg = write_config(tmp_path, shm_prefix, [c.addr for c in ctxs], [g0.addr], routers=(router, "round_robin"))
        with deployment(cfg) as dep:
            wait_until(
                lambda: all(_server(coordinator_info(dep), c.addr)["refused"] for c in (c48, cv3)), what="the refusals"
            )
            info = coordinator_info(dep)
            assert "do not divide" in _server(info, c48.addr)["refused"]
            assert "'v3_sha512'" in _server(info, cv3.addr)["refused"]
            for c in (c48, cv3):
                assert _server(info, c.addr)["healthy"] is False
            for c in (c32, c64):
                assert _server(info, c.addr)["healthy"] is True and _server(info, c.addr)["refused"] is None
            assert _server(info, c64.addr)["kv_events"]["drained"] is False  # 64 vs 32: cannot align
            assert _server(info, c32.addr)["kv_events"]["drained"] is True
            for i in range(8):
                assert (
                    post(
                        dep,
                        "/v1/completions",
                        {"model": "fake-model", "prompt": list(range(i * 100, i * 100 + 64)), "max_tokens": 2},
                    )[0]
                    == 200
                )
            assert not c48.recorded() and not cv3.recorded()
            assert c32.recorded() and c64.recorded()


def test_the_load_cap_denominator_is_the_router_s_max_batch_size_the_section_s_winning(
    tmp_path: Path, shm_prefix: str, hf_tokenizer_dir: str
) -> None:
    with fake_executors(["c0", "g0", "g1"]) as (c0, g0, g1):
        for g in (g0, g1):
            g.script(hold=True)  # a streamed generation leg stays active until released
        # the executors report max_batch_size 8; the section's 1 beats the router's 64
        gen = {
            "num_instances": 2,
            "urls": [g0.addr, g1.addr],
            "max_batch_size": 1,
            "router": {
                "type": "kv_cache_aware",
                "max_batch_size": 64,
                "load_cap": 1.0,
                "tokenizer_dir": hf_tokenizer_dir,
            },
        }
        cfg = write_config(tmp_path, shm_prefix, [c0.addr], [g0.addr, g1.addr], generation_servers=gen)
        with deployment(cfg) as dep:
            prompt = list(range(5000, 5320))
            body = {"model": "fake-model", "prompt": prompt, "max_tokens": 4}
            held = threading.Thread(target=stream_lines, args=(dep, "/v1/completions", {**body, "stream": True}))
            held.start()
            try:
                wait_until(lambda: g0.recorded() or g1.recorded(), what="the held generation leg")
                busy, idle = (g0, g1) if g0.recorded() else (g1, g0)
                # same prompt: the busy server holds its blocks (routed), but 1 active / 1 >= load_cap
                assert post(dep, "/v1/completions", body)[0] == 200
                assert len(idle.recorded()) == 1 and len(busy.recorded()) == 1
            finally:
                g0.release()
                g1.release()
                held.join(timeout=30)


def test_the_environment_overrides_the_router_s_tokens_per_block(
    tmp_path: Path, shm_prefix: str, monkeypatch: pytest.MonkeyPatch, hf_tokenizer_dir: str
) -> None:
    monkeypatch.setenv("TRTLLM_KVCACHE_AWARE_ROUTER_HASH_TOKENS_PER_BLOCK", "64")
    with fake_executors(["c0", "g0"]) as (c0, g0):  # both report tokens_per_block 32
        cfg = write_config(
            tmp_path,
            shm_prefix,
            [c0.addr],
            [g0.addr],
            routers=(
                {"type": "kv_cache_aware", "tokens_per_block": 16, "tokenizer_dir": hf_tokenizer_dir},
                "round_robin",
            ),
        )
        with deployment(cfg) as dep:
            info = coordinator_info(dep)
            assert info["routing_key_configs"]["context"]["tokens_per_block"] == 64
            assert _server(info, c0.addr)["kv_events"]["drained"] is False  # 32 divides 64: admitted, events not read
            assert (
                post(dep, "/v1/completions", {"model": "fake-model", "prompt": list(range(100, 300)), "max_tokens": 2})[
                    0
                ]
                == 200
            )


# -- TensorRT-LLM's worker server -----------------------------------------------------------------

from tests.integration.trtllm_worker import WORKER_DIR as WORKER, WORKER_TOKENIZER as TOKENIZER, WORKER_VENV, missing  # noqa: E402


@pytest.fixture
def trtllm_workers(tmp_path: Path) -> Iterator[list[str]]:
    """A context and a generation worker of the CPU copy of TensorRT-LLM's trtllm-serve."""
    if missing():
        pytest.skip(missing())
    run_dir = tmp_path / "worker-run"
    env = {
        **os.environ,
        "RUN_DIR": str(run_dir),
        "TOKENIZER_DIR": str(TOKENIZER),
        "DETACH": "1",
        "WORKER_VENV": str(WORKER_VENV),
    }
    ports = [free_port(), free_port()]
    starts = [
        subprocess.Popen(
            [str(WORKER / "run_worker.sh"), "--port", str(p), "--role", role],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for p, role in zip(ports, ("context", "generation"), strict=True)
    ]
    try:
        for proc in starts:
            _, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
        yield [f"127.0.0.1:{p}" for p in ports]
    finally:
        for proc in starts:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for p in ports:
            subprocess.run([str(WORKER / "run_worker.sh"), "stop", str(p)], env=env, capture_output=True, timeout=60)


def test_trtllm_worker_events_land_on_the_block_hashes_the_router_computes(
    tmp_path: Path, shm_prefix: str, trtllm_workers: list[str]
) -> None:
    ctx, gen = trtllm_workers
    # routed-block tracking off, so every bit in the index comes from the worker's own events
    cfg = write_config(
        tmp_path,
        shm_prefix,
        [ctx],
        [gen],
        routers=(
            {"type": "kv_cache_aware", "track_routed_blocks": False, "tokenizer_dir": str(TOKENIZER)},
            "round_robin",
        ),
    )
    with deployment(cfg) as dep:
        info = coordinator_info(dep)
        assert info["routing_key_configs"] == {
            "context": {"tokens_per_block": 32, "kv_cache_hash_algo": "v1_block_key"}
        }
        slot = _server(info, ctx)["slot"]
        model = TOKENIZER.name
        prompt = [(7 * i + 3) % 700 + 20 for i in range(200)]
        status, body = post(dep, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2})
        assert status == 200, body
        key = RoutingKey(len(prompt), token_ids=prompt)
        raw = key.block_hashes(32, "v1_block_key")
        ours = list(struct.unpack(f"<{len(raw) // 8}Q", raw))
        assert len(ours) == 7  # 199 tokens hashed: six full blocks and a partial one, as the worker keys them
        wait_until(
            lambda: _held_by_events(dep, ours, slot), what="the worker's stored blocks under the router's hashes"
        )
        assert all(r == 0 for _, r in _masks(dep, ours))
        state = coordinator_info(dep)
        assert state["kv_events"]["dropped_events"] == 0 and state["kv_events"]["event_gaps"] == 0
        assert _server(state, ctx)["kv_events"]["last_event_id"] >= 1  # its created event, then the stored one
