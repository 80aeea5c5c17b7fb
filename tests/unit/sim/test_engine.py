"""The engine in-process: continuous batching, block admission, the context/generation hand-off."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from shmdisagg.executors.sim.block_pool import BlockPool
from shmdisagg.executors.sim.engine import Engine
from shmdisagg.executors.sim.kv_events import KvEventBuffer
from shmdisagg.executors.sim.profiles import get_profile
from shmdisagg.executors.sim.sampler import output_tokens, prompt_seed
from shmdisagg.executors.sim.sequence import Kind, Phase, Sequence, TokenChannel
from shmdisagg.hashing import block_hashes

TPB = 4
ENDPOINT = "127.0.0.1:1"


def make_engine(
    num_blocks: int = 64,
    max_batch_size: int = 8,
    max_num_tokens: int = 64,
    chunked: bool = True,
    events: KvEventBuffer | None = None,
) -> Engine:
    pool = BlockPool(num_blocks, TPB, reuse=True, events=events)
    return Engine(
        get_profile("h100-sxm-llama-3.1-8b"),
        pool,
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        chunked_prefill=chunked,
        overlap_scheduler=True,
        speedup=1e5,
        transfer_timeout_s=2.0,
        own_endpoint=ENDPOINT,
    )


_ids = iter(range(1, 1_000_000))


def seq(prompt: list[int], max_tokens: int = 4, kind: Kind = Kind.LOCAL, **kw: Any) -> Sequence:
    return Sequence(
        request_id=next(_ids),
        kind=kind,
        prompt=prompt,
        prompt_seed=prompt_seed(prompt),
        max_tokens=max_tokens,
        block_hashes=block_hashes(prompt, TPB),
        channel=TokenChannel(streaming=True),
        **kw,
    )


async def collect(s: Sequence) -> list[list[int]]:
    """Every batch of tokens the channel delivered, until it closes."""
    batches = []
    while True:
        await s.channel.wait()
        got = s.channel.take()
        if got:
            batches.append(got)
        elif s.channel.closed:
            return batches


def run(body: Callable[[Engine], Awaitable[Any]], **engine_kw: Any) -> Any:
    async def main() -> Any:
        engine = make_engine(**engine_kw)
        engine.start()
        try:
            return await asyncio.wait_for(body(engine), 10)
        finally:
            await engine.stop()

    return asyncio.run(main())


def test_a_local_request_streams_one_token_per_iteration_and_frees_its_blocks():
    prompt = list(range(10, 30))

    async def body(engine: Engine) -> None:
        s = seq(prompt, max_tokens=5)
        engine.submit(s)
        batches = await collect(s)
        assert batches == [[t] for t in output_tokens(prompt, 5)]
        assert s.finish_reason == "length" and s.phase is Phase.DONE
        assert engine.pool.num_free + engine.pool.num_cached == engine.pool.num_blocks
        engine.pool.check_invariants()

    run(body)


def test_a_repeated_prompt_reports_cached_tokens():
    prompt = list(range(10, 31))  # 21 tokens: 20 usable = 5 full blocks

    async def body(engine: Engine) -> tuple[int, int]:
        first, second = seq(prompt), seq(prompt)
        engine.submit(first)
        await collect(first)
        engine.submit(second)
        await collect(second)
        return first.cached_tokens, second.cached_tokens

    assert run(body) == (0, 20)


def stopped(prompt: list[int], **kw: Any) -> tuple[Sequence, list[int]]:
    """A request run to its end: (its sequence, every token its channel delivered)."""

    async def body(engine: Engine) -> tuple[Sequence, list[int]]:
        s = seq(prompt, max_tokens=10, **kw)
        engine.submit(s)
        return s, [t for batch in await collect(s) for t in batch]

    return run(body)


def test_a_stop_word_ends_the_request_and_is_dropped_from_the_output_as_tensorrt_llm_does():
    prompt = list(range(40, 50))
    tokens = output_tokens(prompt, 10)
    s, streamed = stopped(prompt, stops=(((tokens[2],), tokens[2]),))
    # the stop token is not part of the output (nor counted as a completion token), nor streamed
    assert (s.finish_reason, s.stop_reason, s.output, streamed) == ("stop", tokens[2], tokens[:2], tokens[:2])
    s, streamed = stopped(prompt, stops=(((tokens[2],), tokens[2]),), include_stop=True)
    assert (s.finish_reason, s.output, streamed) == ("stop", tokens[:3], tokens[:3])


def test_a_multi_token_stop_word_and_min_tokens():
    prompt = list(range(60, 70))
    tokens = output_tokens(prompt, 10)
    s, _ = stopped(prompt, stops=((tuple(tokens[3:5]), " two words"),))
    assert (s.finish_reason, s.stop_reason, s.output) == ("stop", " two words", tokens[:3])
    # min_tokens: the first token may not stop the request; the stop word never comes again
    s, _ = stopped(prompt, stops=(((tokens[0],), tokens[0]),), min_tokens=1)
    assert tokens[0] not in tokens[1:] and (s.finish_reason, len(s.output)) == ("length", 10)


def test_chunked_prefill_splits_a_long_prompt_over_the_token_budget():
    prompt = list(range(1, 101))  # 100 tokens, budget 32 per iteration -> 4 prefill iterations

    async def body(engine: Engine) -> Sequence:
        s = seq(prompt, max_tokens=1)
        engine.submit(s)
        await collect(s)
        return s

    s = run(body, max_num_tokens=32)
    assert (s.first_iter, s.last_iter) == (1, 4)


def test_no_more_than_max_batch_size_requests_run_at_once():
    async def body(engine: Engine) -> list[int]:
        seen: list[int] = []
        seqs = [seq([i, i + 1, i + 2], max_tokens=6) for i in range(5)]
        for s in seqs:
            engine.submit(s)
        while any(not s.channel.closed for s in seqs):
            seen.append(len(engine.running))
            await asyncio.sleep(0)
        return seen

    assert max(run(body, max_batch_size=2)) == 2


def test_a_request_waits_for_blocks_until_another_one_releases_them():
    async def body(engine: Engine) -> tuple[Phase, int]:
        big = seq(list(range(1, 25)), max_tokens=8)  # ceil(32/4) = 8 blocks: the whole pool
        small = seq([7, 8, 9], max_tokens=1)
        engine.submit(big)
        engine.submit(small)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        phase_while_big_runs = small.phase
        await collect(big)
        await collect(small)
        return phase_while_big_runs, small.first_iter or 0

    phase, first_iter = run(body, num_blocks=8)
    assert phase is Phase.WAITING and first_iter > 1


def test_an_aborted_request_frees_its_blocks_and_fails_its_channel():
    async def body(engine: Engine) -> None:
        s = seq(list(range(1, 30)), max_tokens=200)
        engine.submit(s)
        await s.channel.wait()
        engine.abort(s)
        assert s.channel.closed and s.channel.error is not None
        assert engine.running == [] and engine.pool.num_free + engine.pool.num_evictable == engine.pool.num_blocks

    run(body)


def test_a_generation_request_aborted_before_its_pull_runs_frees_its_blocks():
    """A client that leaves in the loop iteration that admitted its generation request: the
    pull task is cancelled before its first step, so it never runs its own cleanup (found by
    the chaos suite's disconnecting clients: `num_transferring` stuck at 1, blocks held)."""

    async def body() -> None:
        engine = make_engine()  # not started: admission is stepped by hand to hit the window
        gen = seq(list(range(300, 330)), kind=Kind.GENERATION_ONLY, ctx_request_id=11, ctx_endpoint=ENDPOINT)
        engine.submit(gen)
        engine._admit()
        assert gen.phase is Phase.TRANSFERRING and len(engine.transferring) == 1
        engine.abort(gen)
        await asyncio.sleep(0.01)  # let the cancelled task end
        assert engine.transferring == {} and gen.channel.closed and gen.channel.error is not None
        assert engine.pool.num_free + engine.pool.num_evictable == engine.pool.num_blocks
        await engine.stop()

    asyncio.run(body())


def test_context_then_generation_in_one_engine_continues_the_same_tokens():
    prompt = list(range(100, 130))

    async def body(engine: Engine) -> tuple[list[int], Sequence]:
        ctx = seq(prompt, max_tokens=6, kind=Kind.CONTEXT_ONLY, ctx_request_id=77)
        engine.submit(ctx)
        await collect(ctx)
        assert ctx.phase is Phase.PINNED and ctx.finish_reason == "length"
        assert engine.transfers.num_pinned == 1
        gen = seq(
            prompt,
            max_tokens=6,
            kind=Kind.GENERATION_ONLY,
            ctx_request_id=77,
            first_gen_tokens=list(ctx.output),
            ctx_endpoint=ENDPOINT,
        )
        engine.submit(gen)
        batches = await collect(gen)
        assert engine.transfers.num_pinned == 0 and engine.transfers.completed == 1
        return [t for b in batches for t in b], gen

    tokens, gen = run(body)
    assert tokens == output_tokens(prompt, 6)
    assert gen.ctx_cached_tokens == 0


def test_a_generation_request_sent_before_its_context_request_still_completes():
    prompt = list(range(200, 230))

    async def body(engine: Engine) -> list[int]:
        gen = seq(prompt, max_tokens=4, kind=Kind.GENERATION_ONLY, ctx_request_id=5, ctx_endpoint=ENDPOINT)
        engine.submit(gen)
        await asyncio.sleep(0.05)
        assert gen.phase is Phase.TRANSFERRING
        ctx = seq(prompt, max_tokens=4, kind=Kind.CONTEXT_ONLY, ctx_request_id=5)
        engine.submit(ctx)
        batches = await collect(gen)
        return [t for b in batches for t in b]

    assert run(body) == output_tokens(prompt, 4)


def test_an_unknown_ctx_request_id_fails_the_generation_request_after_the_timeout():
    async def body(engine: Engine) -> Sequence:
        engine.transfers.timeout_s = 0.1
        gen = seq([1, 2, 3], max_tokens=4, kind=Kind.GENERATION_ONLY, ctx_request_id=999, ctx_endpoint=ENDPOINT)
        engine.submit(gen)
        await collect(gen)
        return gen

    gen = run(body)
    assert gen.channel.error is not None and "unknown ctx_request_id 999" in gen.channel.error.message


def test_an_unpulled_context_result_is_released_after_the_timeout():
    async def body(engine: Engine) -> int:
        engine.transfers.timeout_s = 0.05
        ctx = seq(list(range(1, 20)), kind=Kind.CONTEXT_ONLY, ctx_request_id=3)
        engine.submit(ctx)
        await collect(ctx)
        assert engine.transfers.num_pinned == 1
        await asyncio.sleep(0.2)
        return engine.transfers.expired

    assert run(body) == 1


def test_context_stores_its_partial_block_and_local_requests_store_their_output():
    events = KvEventBuffer(100, window_size=1)
    prompt = list(range(300, 311))  # 11 tokens: 10 usable = 2 full + 1 partial

    async def body(engine: Engine) -> None:
        ctx = seq(prompt, kind=Kind.CONTEXT_ONLY, ctx_request_id=1)
        engine.submit(ctx)
        await collect(ctx)
        stored = [b["block_hash"] for e in events.drain() for b in e["data"].get("blocks", [])]
        assert stored == block_hashes(prompt, TPB)
        local = seq(list(range(400, 411)), max_tokens=6)
        engine.submit(local)
        await collect(local)
        stored = [b["block_hash"] for e in events.drain() for b in e["data"].get("blocks", [])]
        assert stored == block_hashes(local.prompt + local.output, TPB)

    run(body, events=events)
