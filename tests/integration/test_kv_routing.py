"""KV-cache-aware and conversation routing through the shared index, across fleet workers."""

from __future__ import annotations

import threading
from pathlib import Path

from shmdisagg.shm.index import BlockIndex
from shmdisagg.shm.table import ControlTable
from tests.conftest import free_port
from tests.integration.harness import connection_to_worker, deployment, fake_executors, post, wait_until, write_config

MODEL = "sim-llama-3.1-8b"


def _server_of(resp: dict) -> str:
    return resp["id"].removeprefix("cmpl-")


def test_repeated_prefixes_hit_the_cache_through_kv_events(tmp_path: Path, shm_prefix: str) -> None:
    ctx = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    gen = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    cfg = write_config(
        tmp_path,
        shm_prefix,
        ctx,
        gen,
        routers=("kv_cache_aware", "kv_cache_aware"),
        shmdisagg={"executors": {"backend": "sim", "model": MODEL, "sim": {"speedup": 20.0}}},
    )
    with deployment(cfg) as dep:
        prompts = [list(range(10_000 * k, 10_000 * k + 640)) for k in range(1, 5)]
        for p in prompts:  # first sight of each prefix: nothing cached
            assert post(dep, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 2})[0] == 200
        for p in prompts:  # every continuation finds its prefix, whichever worker routes it
            status, body = post(dep, "/v1/completions", {"model": MODEL, "prompt": p + [7, 8, 9], "max_tokens": 2})
            assert status == 200
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 608, body["usage"]
        # text prompts are tokenized by the router exactly as the executor does
        text = "a shared preamble " * 40
        post(dep, "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 2})
        status, body = post(
            dep, "/v1/completions", {"model": MODEL, "prompt": text + "and a question", "max_tokens": 2}
        )
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96
        with ControlTable.attach(dep.config.shm_prefix) as table, BlockIndex.attach(table) as index:
            stats = index.stats()
            assert stats.used > 0 and stats.lag_samples > 0


def test_concurrent_requests_for_a_new_prefix_through_two_workers_land_together(
    tmp_path: Path, shm_prefix: str, hf_tokenizer_dir: str
) -> None:
    with fake_executors(["c0", "c1", "c2", "g0"]) as (*ctxs, gen):
        kv = {"type": "kv_cache_aware", "tokenizer_dir": hf_tokenizer_dir}  # real-executor stand-ins: their tokenizer
        cfg = write_config(tmp_path, shm_prefix, [c.addr for c in ctxs], [gen.addr], routers=(kv, "round_robin"))
        with deployment(cfg) as dep:
            conns = [connection_to_worker(dep, 0), connection_to_worker(dep, 1)]
            for round_ in range(6):
                prompt = list(range(round_ * 1000 + 50_000, round_ * 1000 + 50_000 + 320))
                barrier = threading.Barrier(2)

                def send(i: int) -> None:
                    barrier.wait()  # noqa: B023 (the threads are joined in this iteration)
                    assert (
                        post(
                            dep,
                            "/v1/completions",
                            {"model": "fake-model", "prompt": prompt, "max_tokens": 2},  # noqa: B023 (the threads are joined in this iteration)
                            conn=conns[i],
                        )[0]
                        == 200
                    )

                threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=30)
                holders = [c.name for c in ctxs if any(r["prompt"] == prompt for r in c.recorded())]
                assert len(holders) == 1, (round_, holders)
            for c in conns:
                c.close()


def test_conversation_stays_on_one_server_across_workers_and_moves_when_it_dies(
    tmp_path: Path, shm_prefix: str
) -> None:
    with fake_executors(["c0", "g0", "g1", "g2"]) as (ctx, *gens):
        cfg = write_config(
            tmp_path, shm_prefix, [ctx.addr], [g.addr for g in gens], routers=("round_robin", "conversation")
        )
        with deployment(cfg) as dep:
            conns = [connection_to_worker(dep, 0), connection_to_worker(dep, 1)]
            homes = {}
            for conv in ("alice", "bob", "carol", "dave", "erin", "frank"):
                seen = set()
                for turn in range(4):
                    body = {
                        "model": "fake-model",
                        "prompt": f"turn {turn}",
                        "max_tokens": 2,
                        "conversation_params": {"conversation_id": conv},
                    }
                    status, resp = post(dep, "/v1/completions", body, conn=conns[turn % 2])
                    assert status == 200
                    seen.add(_server_of(resp))
                assert len(seen) == 1, (conv, seen)
                homes[conv] = seen.pop()
            assert len(set(homes.values())) > 1  # new sessions are spread, not herded
            # a session header works the same way
            hdr_home = {_server_of(post_with_header(dep, conns[t % 2], "x-session-id", "hdr-conv")) for t in range(3)}
            assert len(hdr_home) == 1
            # its server dies: the session re-routes and sticks to its new home
            victim_name = homes["alice"]
            victim = next(g for g in gens if g.name == victim_name)
            victim.proc.kill()
            victim.proc.wait()
            wait_until(lambda: _unhealthy(dep, victim.addr), timeout_s=5, what="the dead server marked unhealthy")
            moved = set()
            for turn in range(4):
                body = {
                    "model": "fake-model",
                    "prompt": "after",
                    "max_tokens": 2,
                    "conversation_params": {"conversation_id": "alice"},
                }
                status, resp = post(dep, "/v1/completions", body, conn=conns[turn % 2])
                assert status == 200
                moved.add(_server_of(resp))
            assert len(moved) == 1 and victim_name not in moved
            for c in conns:
                c.close()


def post_with_header(dep, conn, name: str, value: str) -> dict:  # type: ignore[no-untyped-def]
    import orjson

    conn.request(
        "POST",
        "/v1/completions",
        body=orjson.dumps({"model": "fake-model", "prompt": "x", "max_tokens": 2}),
        headers={"content-type": "application/json", name: value},
    )
    r = conn.getresponse()
    assert r.status == 200
    return orjson.loads(r.read())


def _unhealthy(dep, addr: str) -> bool:  # type: ignore[no-untyped-def]
    with ControlTable.attach(dep.config.shm_prefix) as table:
        return any(s.addr == addr and not s.healthy for s in table.servers())


def test_implicit_conversation_follows_its_prefix(tmp_path: Path, shm_prefix: str) -> None:
    with fake_executors(["c0", "g0", "g1", "g2"]) as (ctx, *gens):
        router = {"type": "conversation", "match_threshold": 0.5}
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [g.addr for g in gens], routers=("round_robin", router))
        with deployment(cfg) as dep:
            history = [{"role": "system", "content": "You are helpful. " * 30}]
            homes = set()
            for turn in range(4):
                history.append({"role": "user", "content": f"question {turn} " * 20})
                status, resp = post(
                    dep, "/v1/chat/completions", {"model": "fake-model", "messages": history, "max_tokens": 2}
                )
                assert status == 200
                homes.add(_server_of(resp))
                history.append({"role": "assistant", "content": f"answer {turn} " * 20})
            assert len(homes) == 1


def test_implicit_conversation_of_token_id_prompts_follows_its_prefix(tmp_path: Path, shm_prefix: str) -> None:
    """Without `use_token_ids`, a token-id prompt is still matched on its ids (TensorRT-LLM hashes
    pre-existing token ids in text mode too); two interleaved conversations each keep a home."""
    with fake_executors(["c0", "g0", "g1", "g2"]) as (ctx, *gens):
        router = {"type": "conversation", "match_threshold": 0.5}
        cfg = write_config(tmp_path, shm_prefix, [ctx.addr], [g.addr for g in gens], routers=("round_robin", router))
        with deployment(cfg) as dep:
            prompts = {"a": list(range(1000, 1400)), "b": list(range(5000, 5400))}
            homes: dict[str, set[str]] = {"a": set(), "b": set()}
            for turn in range(4):
                for conv, ids in prompts.items():
                    ids.extend(range(20_000 + 100 * turn, 20_000 + 100 * turn + 60))
                    status, resp = post(dep, "/v1/completions", {"model": "fake-model", "prompt": ids, "max_tokens": 2})
                    assert status == 200
                    homes[conv].add(_server_of(resp))
            assert len(homes["a"]) == 1 and len(homes["b"]) == 1


def test_conditional_disaggregation_keeps_cached_prompts_on_the_generation_server(
    tmp_path: Path, shm_prefix: str, hf_tokenizer_dir: str
) -> None:
    with fake_executors(["c0", "g0", "g1"]) as (ctx, g0, g1):
        kv = {"type": "kv_cache_aware", "tokenizer_dir": hf_tokenizer_dir}
        cfg = write_config(
            tmp_path,
            shm_prefix,
            [ctx.addr],
            [g0.addr, g1.addr],
            routers=("round_robin", kv),
            conditional_disagg_config={"max_local_prefill_length": 64},
        )
        with deployment(cfg) as dep:
            prompt = list(range(70_000, 70_000 + 1024))
            assert post(dep, "/v1/completions", {"model": "fake-model", "prompt": prompt, "max_tokens": 2})[0] == 200
            assert len(ctx.recorded()) == 1  # first sight: disaggregated
            # same prompt plus a short tail: the generation server holds all but < 64 tokens
            status, resp = post(
                dep, "/v1/completions", {"model": "fake-model", "prompt": prompt + list(range(10)), "max_tokens": 2}
            )
            assert status == 200
            assert len(ctx.recorded()) == 1  # no context leg
            local = [r for g in (g0, g1) for r in g.recorded() if not r.get("disaggregated_params")]
            assert len(local) == 1 and local[0]["prompt"] == prompt + list(range(10))
            # a long new tail is disaggregated again
            assert (
                post(
                    dep,
                    "/v1/completions",
                    {"model": "fake-model", "prompt": prompt + list(range(500)), "max_tokens": 2},
                )[0]
                == 200
            )
            assert len(ctx.recorded()) == 2
            with ControlTable.attach(dep.config.shm_prefix) as table:
                assert all(table.load(s.slot) == (0, 0) for s in table.servers())


def test_bad_and_unknown_kv_events_are_dropped_and_counted(shm_prefix: str) -> None:
    from shmdisagg.coordinator.health import Executor
    from shmdisagg.coordinator.kv_events import KvEventIngestor

    with ControlTable.create(shm_prefix) as table:
        table.publish_server(0, "127.0.0.1:1", 0, True, tokens_per_block=32)
        with BlockIndex.create(table) as index:
            ing = KvEventIngestor(index, [Executor(0, 0, "127.0.0.1", 1)])
            good = {
                "event_id": 1,
                "data": {
                    "type": "stored",
                    "parent_hash": None,
                    "blocks": [{"block_hash": 12345}, {"block_hash": 67890}],
                },
            }
            bad = [
                "not an event",
                {"event_id": 2},
                {"data": {"type": "stored", "blocks": [{"no_hash": 1}]}},
                {"data": {"type": "stored", "blocks": [{"block_hash": -5}]}},
                {"data": {"type": "stored", "blocks": [{"block_hash": 1 << 70}]}},
                {"data": {"type": "removed", "block_hashes": "abc"}},
                {"data": {"type": "teleported"}},
            ]
            assert ing.apply(0, [good, *bad], 0.0) == 8
            assert ing.applied_events == 1 and ing.dropped_events == len(bad)
            assert ing.apply(0, {"not": "a list"}, 0.0) == 1 and ing.dropped_events == len(bad) + 1
            assert index.lookup(12345) is not None and index.lookup(12345)[0] == 1
            # events for a server the coordinator does not know are dropped and counted
            assert ing.apply(5, [good], 0.0) == 1 and ing.dropped_events == len(bad) + 2
            index.unlink()
        table.unlink()


def test_the_fast_event_decoder_applies_what_the_tolerant_one_does(shm_prefix: str) -> None:
    import orjson

    from shmdisagg.coordinator.health import Executor
    from shmdisagg.coordinator.kv_events import KvEventIngestor

    events = [
        {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [10, 0]}, "window_size": 64},
        {
            "event_id": 1,
            "data": {
                "type": "stored",
                "parent_hash": None,
                "blocks": [
                    {
                        "type": "stored_block",
                        "block_hash": 111,
                        "tokens": [{"type": "unique_token", "token_id": 5, "token_extra_id": 0}],
                        "cache_level": 0,
                        "priority": 35,
                    },
                    {"type": "stored_block", "block_hash": 222, "tokens": [], "cache_level": 0, "priority": 35},
                ],
            },
            "window_size": 64,
            "timestamp": 1.5,
        },
        {"event_id": 2, "data": {"type": "removed", "block_hashes": [111]}, "window_size": 64},
    ]
    with ControlTable.create(shm_prefix) as table:
        table.publish_server(0, "127.0.0.1:1", 0, True, tokens_per_block=32)
        with BlockIndex.create(table) as index:
            ing = KvEventIngestor(index, [Executor(0, 0, "127.0.0.1", 1)])
            assert ing.apply_raw(0, orjson.dumps(events), 2.0) == 3
            assert ing.applied_events == 3 and ing.dropped_events == 0
            assert index.lookup(111)[0] == 0 and index.lookup(222)[0] == 1  # stored then removed; stored
            # one malformed event: the tolerant path still applies the others
            bad = events + [{"event_id": 3, "data": {"type": "stored", "blocks": [{"block_hash": "x"}]}}]
            assert ing.apply_raw(0, orjson.dumps(bad), 2.0) == 4
            assert ing.dropped_events == 1
            assert ing.apply_raw(0, b"{not json", 2.0) == 1 and ing.dropped_events == 2
            index.unlink()
        table.unlink()


def test_a_chats_turns_return_to_its_server_from_any_fleet_worker(
    tmp_path: Path, shm_prefix: str, hf_tokenizer_dir: str
) -> None:
    """TensorRT-LLM's kv_cache_aware router pins a chat (its first two messages) to the server of
    its previous turn. No KV events and no routed-block tracking here, so only the pin keeps a
    conversation together: every score ties, and ties rotate over the three servers."""
    with fake_executors(["c0", "c1", "c2", "g0"]) as (*ctxs, gen):
        kv = {"type": "kv_cache_aware", "tokenizer_dir": hf_tokenizer_dir, "track_routed_blocks": False}
        cfg = write_config(tmp_path, shm_prefix, [c.addr for c in ctxs], [gen.addr], routers=(kv, "round_robin"))
        with deployment(cfg) as dep:
            conns = [connection_to_worker(dep, 0), connection_to_worker(dep, 1)]

            def chat(messages: list[dict], worker: int) -> str:
                body = {"model": "fake-model", "messages": messages, "max_tokens": 2}
                assert post(dep, "/v1/chat/completions", body, conn=conns[worker])[0] == 200
                (name,) = [c.name for c in ctxs if any(r.get("messages") == messages for r in c.recorded())]
                return name

            try:
                for n in range(3):
                    # the key is the first two messages: a system prompt and the first question
                    first = [
                        {"role": "system", "content": "Be terse."},
                        {"role": "user", "content": f"chat {n}: a KV cache?"},
                    ]
                    home = chat(first, 0)
                    chat([{"role": "user", "content": f"an unrelated question {n}"}], 1)  # the tie rotation moves on
                    second = [*first, {"role": "assistant", "content": "a cache"}, {"role": "user", "content": "and?"}]
                    assert chat(second, 1) == home  # the other fleet worker, the same server
            finally:
                for c in conns:
                    c.close()
