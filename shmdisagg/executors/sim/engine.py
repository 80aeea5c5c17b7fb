"""The continuous-batching engine: one asyncio task per executor.

Each iteration: admit what fits, plan (prefill chunks within the `max_num_tokens` budget, one
decode step per decoding request), sleep for the timing model's iteration time, then apply the
plan (advance prefills, emit one token per decoding request, finish, release). While there is
nothing to run, the task blocks on an event; submissions, releases and finished KV transfers set
it. Nothing else mutates the block pool or the queues, so there are no locks.

Admission is first-come first-served with head-of-line blocking, in TensorRT-LLM's
GUARANTEED_NO_EVICT style: a request is admitted only when the pool can hold its prompt plus
`max_tokens` (a context_only request: its prompt), so a running request never runs out of
blocks and nothing is preempted. Local and context requests also need a batch slot
(`max_batch_size` running requests). Generation requests need only blocks to start their KV
pull; when the KV has arrived they take a batch slot, ahead of new prefills.

Block lifecycle: at admission a request refs its matched prefix (whole blocks; a matched partial
last block counts as cached tokens but is copied into a private block, as partial reuse copies
in TensorRT-LLM). When its prompt KV is complete, the prompt's full blocks are stored (a
context_only request stores its partial last block too, since it will never extend it). When a
request finishes, the blocks of prompt + output (last token excluded) beyond those are stored,
then everything is released.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from shmdisagg.executors.sim import sampler, timing
from shmdisagg.executors.sim.block_keys import extension_blocks
from shmdisagg.executors.sim.block_pool import BlockPool
from shmdisagg.executors.sim.errors import SimError, TransferError
from shmdisagg.executors.sim.metrics import Counters
from shmdisagg.executors.sim.profiles import Profile
from shmdisagg.executors.sim.sequence import Kind, Phase, Sequence
from shmdisagg.executors.sim.transfer import KvPuller, TransferTable
from shmdisagg.hashing import KV_CACHE_HASH_ALGO_V1

log = logging.getLogger("shmdisagg.executors.sim.engine")

_MAX_LAG_S = 0.05  # an engine this far behind its modelled schedule stops trying to catch up


class Engine:
    """State, grouped: configuration (profile, limits, time scale), the block pool, the queues
    (`waiting` FCFS, `ready` generation requests whose KV arrived, `running` in admission
    order, `transferring` pulling KV), the context-side `transfers` table, and counters."""

    def __init__(
        self,
        profile: Profile,
        pool: BlockPool,
        *,
        max_batch_size: int,
        max_num_tokens: int,
        chunked_prefill: bool,
        overlap_scheduler: bool,
        speedup: float,
        transfer_timeout_s: float,
        own_endpoint: str,
        slow_factor: Callable[[], float] = lambda: 1.0,
        clock_offset: Callable[[], float] = lambda: 0.0,
        hash_algo: str = KV_CACHE_HASH_ALGO_V1,
    ) -> None:
        # configuration
        self.profile = profile
        self.pool = pool
        self.tokens_per_block = pool.tokens_per_block
        self.hash_algo = hash_algo  # of the block hashes (block_keys.py)
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.chunked_prefill = chunked_prefill
        self.overlap_scheduler = overlap_scheduler
        self.speedup = speedup
        self._slow_factor = slow_factor
        self._clock_offset = clock_offset
        # queues
        self.waiting: deque[Sequence] = deque()
        self.ready: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.transferring: dict[Sequence, asyncio.Task[None]] = {}
        # disaggregation
        self.transfers = TransferTable(transfer_timeout_s, self._release_pinned)
        self.puller = KvPuller(own_endpoint, self.transfers, transfer_timeout_s)
        # bookkeeping
        self.counters = Counters()
        self.iteration = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.fatal: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, on_fatal: Callable[[BaseException], None] | None = None) -> None:
        """Run the loop; `on_fatal` hears of an unexpected exception that stopped it (a bug)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

        def done(task: asyncio.Task[None]) -> None:
            if task.cancelled() or task.exception() is None:
                return
            exc = task.exception()
            assert exc is not None
            self.fatal = exc
            log.error("engine loop died", exc_info=exc)
            for s in [*self.waiting, *self.ready, *self.running]:
                s.channel.fail(SimError(f"executor failed: {exc!r}", status=500))
            if on_fatal is not None:
                on_fatal(exc)

        self._task.add_done_callback(done)

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self.transferring.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            if task is not None:
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        await self.puller.close()

    def now(self) -> float:
        """The steady clock of timestamps (monotonic seconds plus the orchestrator's offset)."""
        return time.monotonic() + self._clock_offset()

    def time_scale(self) -> float:
        return self._slow_factor() / self.speedup

    # -- requests in ---------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence) -> int:
        tokens = seq.prompt_len if seq.kind is Kind.CONTEXT_ONLY else seq.prompt_len + seq.max_tokens
        return math.ceil(tokens / self.tokens_per_block)

    def submit(self, seq: Sequence) -> None:
        """Queue a parsed request; raises SimError (400) if it can never fit this executor."""
        if self.fatal is not None:
            raise SimError(f"LLM is unavailable: {self.fatal!r}", 503)
        if self.blocks_needed(seq) > self.pool.num_blocks:
            raise SimError(
                f"request needs {self.blocks_needed(seq)} KV blocks, the executor has {self.pool.num_blocks}", 400
            )
        if not self.chunked_prefill and seq.kind is not Kind.GENERATION_ONLY and seq.prompt_len > self.max_num_tokens:
            raise SimError(  # llmapi/llm.py `_check_arguments` (PyTorch backend, no chunked prefill)
                f"The sum of prompt length ({float(seq.prompt_len)}), query length (0) should not exceed "
                f"max_num_tokens ({self.max_num_tokens})",
                400,
            )
        if seq.kind is Kind.CONTEXT_ONLY:
            self.transfers.register(seq)
        seq.arrival_time = seq.arrival_time or self.now()
        seq.phase = Phase.WAITING
        self.waiting.append(seq)
        self.counters.requests += 1
        self._wake.set()

    def abort(self, seq: Sequence) -> None:
        """The client went away: drop the request wherever it is and free what it holds."""
        if seq.phase in (Phase.DONE, Phase.PINNED) or seq.cancelled:
            return
        seq.cancelled = True
        self.counters.aborted += 1
        if seq.phase is Phase.NEW:
            return  # never submitted; the handler sees `cancelled`
        if seq.phase is Phase.WAITING:
            self.waiting.remove(seq)
            self._finish(seq, None, release=False)
        elif seq.phase is Phase.READY:
            self.ready.remove(seq)
            self._finish(seq, None)
        elif seq.phase in (Phase.PREFILL, Phase.DECODE):
            self.running.remove(seq)
            self._finish(seq, None)
        elif seq.phase is Phase.TRANSFERRING:
            # Released here, not by the pull task: a task cancelled before its first step never
            # runs its body, so an abort right after admission would leak the slot and blocks.
            self.transferring.pop(seq).cancel()
            self._finish(seq, None)
        self._wake.set()

    # -- the loop ------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline: float | None = None  # wall time the current iteration ends at
        while True:
            self._admit()
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                deadline = None
                continue
            chunks, decodes = self._plan()
            decode_ctx = sum(s.context_len for s in decodes)
            dt = timing.iteration_seconds(
                self.profile, ((n, s.computed) for s, n in chunks), len(decodes), decode_ctx, self.overlap_scheduler
            )
            self.iteration += 1
            now = self.now()
            for s, _ in chunks:
                if s.first_scheduled_time is None:
                    s.first_scheduled_time = now
                    s.first_iter = self.iteration
            # Sleep to a running deadline rather than for `dt`: the loop's timers round to whole
            # milliseconds, which would distort sub-millisecond iterations at high --speedup;
            # deadlines let the rounding average out. A loop that fell far behind starts afresh.
            now_wall = loop.time()
            if deadline is None or now_wall - deadline > _MAX_LAG_S:
                deadline = now_wall
            deadline += dt * self.time_scale()
            await asyncio.sleep(max(deadline - now_wall, 0.0))
            self.counters.iterations += 1
            self._apply(chunks, decodes)

    def _admit(self) -> None:
        while self.ready and len(self.running) < self.max_batch_size:
            seq = self.ready.popleft()
            self.running.append(seq)
            self._start_decoding(seq)
        while self.waiting:
            seq = self.waiting[0]
            needs_slot = seq.kind is not Kind.GENERATION_ONLY
            if needs_slot and len(self.running) >= self.max_batch_size:
                return
            if not self._allocate(seq):
                return
            self.waiting.popleft()
            if seq.kind is Kind.GENERATION_ONLY:
                seq.phase = Phase.TRANSFERRING
                task = asyncio.get_running_loop().create_task(self._pull(seq))
                self.transferring[seq] = task
            else:
                seq.phase = Phase.PREFILL
                seq.computed = seq.cached_tokens
                self.running.append(seq)

    def _allocate(self, seq: Sequence) -> bool:
        tpb = self.tokens_per_block
        matched = self.pool.match(seq.block_hashes)
        usable = seq.prompt_len - 1
        full_prompt_blocks = usable // tpb
        shared = min(matched, full_prompt_blocks)
        alloc = self.pool.acquire(seq.block_hashes[:shared], self.blocks_needed(seq) - shared)
        if alloc is None:
            return False
        seq.alloc = alloc
        seq.cached_tokens = min(matched * tpb, usable)
        seq.stored_blocks = shared
        seq.reused_blocks = matched
        seq.missed_blocks = len(seq.block_hashes) - matched
        seq.new_blocks = alloc.private
        seq.total_blocks = shared + alloc.private
        return True

    def _plan(self) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        decodes = [s for s in self.running if s.phase is Phase.DECODE]
        budget = self.max_num_tokens - len(decodes)
        chunks: list[tuple[Sequence, int]] = []
        for s in self.running:
            if budget <= 0:
                break
            if s.phase is not Phase.PREFILL:
                continue
            remaining = s.prompt_len - s.computed
            if not self.chunked_prefill and remaining > budget:
                break
            n = min(remaining, budget)
            chunks.append((s, n))
            budget -= n
        return chunks, decodes

    def _apply(self, chunks: list[tuple[Sequence, int]], decodes: list[Sequence]) -> None:
        now = self.now()
        for s, n in chunks:
            if s.cancelled:
                continue
            s.computed += n
            self.counters.prefill_tokens += n
            if s.computed >= s.prompt_len:
                self._prefill_done(s, now)
        iteration = self.iteration
        token_at = sampler.token_at
        emitted = 0
        for s in decodes:  # the hot loop: one token per decoding request (a lean `_emit`)
            if s.cancelled or s.finished:
                continue
            out = s.output
            t = token_at(s.prompt_seed, len(out))
            out.append(t)
            emitted += 1
            s.last_token_time = now
            s.last_iter = iteration
            if s.stops is not None and stop_matched(s):
                if s.include_stop and s.channel.streaming:
                    s.channel.push1(t)
                continue
            if len(out) >= s.max_tokens:
                s.finish_reason = "length"
            if s.channel.streaming:
                s.channel.push1(t)
        self.counters.generated_tokens += emitted
        done = [s for s in self.running if s.finished]
        if done:
            self.running = [s for s in self.running if not s.finished]
            for s in done:
                self._retire(s)

    # -- per-request transitions --------------------------------------------------------------
    def _prefill_done(self, s: Sequence, now: float) -> None:
        tpb = self.tokens_per_block
        if s.kind is Kind.CONTEXT_ONLY:
            upto = len(s.block_hashes)
        else:
            upto = (s.prompt_len - 1) // tpb
        self._store_prompt_blocks(s, upto)
        s.phase = Phase.DECODE
        self._emit(s, [sampler.token_at(s.prompt_seed, 0)], now)

    def _store_prompt_blocks(self, s: Sequence, upto: int) -> None:
        if s.alloc is None or upto <= s.stored_blocks:
            return
        tpb = self.tokens_per_block
        usable = s.prompt_len - 1
        start = s.stored_blocks
        parent = s.block_hashes[start - 1] if start else None
        blocks = [(s.block_hashes[i], s.prompt[i * tpb : min((i + 1) * tpb, usable)]) for i in range(start, upto)]
        s.stored_blocks += self.pool.store(s.alloc, parent, blocks)

    def _emit(self, s: Sequence, tokens: list[int], now: float) -> None:
        """Append generated tokens, stream them, and set finish_reason when the request ends."""
        if s.first_token_time is None:
            s.first_token_time = now
        s.last_token_time = now
        s.last_iter = self.iteration
        shown: list[int] = []
        n = 0
        for t in tokens:
            s.output.append(t)
            n += 1
            if s.stops is not None and stop_matched(s):
                if s.include_stop:
                    shown.append(t)
                break
            shown.append(t)
            if len(s.output) >= s.max_tokens:
                s.finish_reason = "length"
                break
        self.counters.generated_tokens += n
        s.channel.push(shown)
        if s.kind is Kind.CONTEXT_ONLY:
            # TensorRT-LLM's context phase ends after one token with "length" ("continue on a
            # generation executor") unless a stop word ended it; first_gen_tokens is the token
            # it generated, even a stop word trimmed from the output (ContextPhaseParams).
            s.first_gen_tokens_out = list(tokens[:1])
            if s.finish_reason is None:
                s.finish_reason = "length"

    def _retire(self, s: Sequence) -> None:
        if s.kind is Kind.CONTEXT_ONLY:
            s.phase = Phase.PINNED
            self.counters.completed += 1
            self._record(s)
            s.channel.close()
            self.transfers.prefill_done(s)
            return
        self._store_output_blocks(s)
        self._finish(s, None)

    def _store_output_blocks(self, s: Sequence) -> None:
        """Store the blocks of prompt + output (last token excluded) beyond the stored ones."""
        if s.alloc is None or not self.pool.reuse:
            return
        tpb = self.tokens_per_block
        full_prompt = (s.prompt_len - 1) // tpb
        if s.stored_blocks < full_prompt:
            return  # the prompt itself did not get stored (pool pressure); do not extend
        tokens = s.prompt + s.output
        parent = s.block_hashes[full_prompt - 1] if full_prompt else None
        self.pool.store(s.alloc, parent, extension_blocks(tokens, tpb, full_prompt, parent, self.hash_algo))

    def _finish(self, s: Sequence, error: SimError | None, release: bool = True) -> None:
        s.phase = Phase.DONE
        if release and s.alloc is not None:
            self.pool.release(s.alloc)
            self._wake.set()
        if error is not None:
            self.counters.errors += 1
            s.channel.fail(error)
        elif s.cancelled:
            s.channel.fail(SimError("request aborted", status=499))
        else:
            self.counters.completed += 1
            self._record(s)
            s.channel.close()
        if s.kind is Kind.CONTEXT_ONLY and (error is not None or s.cancelled):
            self.transfers.failed(s, error or SimError("context request aborted"))

    def _release_pinned(self, s: Sequence) -> None:
        s.phase = Phase.DONE
        if s.alloc is not None:
            self.pool.release(s.alloc)
            self._wake.set()

    # -- generation_only ----------------------------------------------------------------------
    async def _pull(self, s: Sequence) -> None:
        """Pull the prompt's KV (minus what this executor already caches), then join decoding."""
        assert s.ctx_endpoint is not None and s.ctx_request_id is not None
        hold_s = timing.transfer_seconds(self.profile, s.prompt_len - s.cached_tokens) * self.time_scale()
        s.transfer_start = self.now()
        error: SimError | None = None
        try:
            result = await self.puller.pull(s.ctx_endpoint, s.ctx_request_id, hold_s, s.prompt_seed)
            error = self._check_pulled(s, result)
        except asyncio.CancelledError:
            if self.transferring.pop(s, None) is not None:  # stop(); abort() has released it already
                self._finish(s, None)
            raise
        except SimError as exc:
            error = exc
        except Exception as exc:  # any pull failure fails this one request
            log.exception("KV pull failed")
            error = TransferError(f"KV pull failed: {exc!r}")
        self.transferring.pop(s, None)
        s.transfer_end = self.now()
        if error is not None:
            self._finish(s, error)
        else:
            self.counters.kv_transfers += 1
            s.phase = Phase.READY
            self.ready.append(s)
        self._wake.set()

    @staticmethod
    def _check_pulled(s: Sequence, result: dict[str, Any]) -> SimError | None:
        """Adopt what came with the KV (first tokens in generation-first, the context leg's
        cached tokens); a mismatch with the request is an orchestrator bug, reported as such."""
        if result.get("prompt_len") != s.prompt_len:
            return TransferError(
                f"context request {s.ctx_request_id} has {result.get('prompt_len')} prompt tokens, "
                f"this request {s.prompt_len}"
            )
        first = result.get("first_gen_tokens") or []
        if not s.first_gen_tokens:
            s.first_gen_tokens = first[: s.max_tokens]
        elif s.first_gen_tokens != first:
            return TransferError(
                f"first_gen_tokens {s.first_gen_tokens} differ from context request {s.ctx_request_id}'s {first}"
            )
        cached = result.get("cached_tokens")
        s.ctx_cached_tokens = cached if isinstance(cached, int) else None
        return None

    def _start_decoding(self, s: Sequence) -> None:
        """A generation request with its KV in place: store its prompt blocks, stream the
        first_gen_tokens, then decode like any other request."""
        now = self.now()
        s.first_scheduled_time = now
        s.first_iter = self.iteration + 1
        s.computed = s.prompt_len
        self._store_prompt_blocks(s, (s.prompt_len - 1) // self.tokens_per_block)
        s.phase = Phase.DECODE
        self._emit(s, list(s.first_gen_tokens), now)
        if s.finished:
            self.running.remove(s)
            self._retire(s)

    # -- reporting -----------------------------------------------------------------------------
    def _record(self, s: Sequence) -> None:
        self.counters.prompt_tokens += s.prompt_len
        self.counters.cached_tokens += s.cached_tokens

    def stats(self) -> dict[str, Any]:
        pool = self.pool
        return {
            "num_waiting": len(self.waiting),
            "num_running": len(self.running),
            "num_transferring": len(self.transferring),
            "num_ready": len(self.ready),
            "num_pinned": self.transfers.num_pinned,
            "iteration": self.iteration,
            "blocks": {
                "total": pool.num_blocks,
                "free": pool.num_free,
                "cached": pool.num_cached,
                "evictable": pool.num_evictable,
                "evicted": pool.num_evicted,
                "tokens_per_block": pool.tokens_per_block,
            },
            "transfers": {
                "completed": self.transfers.completed,
                "expired": self.transfers.expired,
                "waiting": self.transfers.num_waiting,
            },
            "counters": self.counters.as_dict(),
        }


def stop_matched(s: Sequence) -> bool:
    """Whether the token just appended to `s.output` completes one of its stop words, as
    TensorRT-LLM's result handling does (`executor/result.py` `_handle_sequence`): finish
    "stop", `stop_reason` = the word's reason (a stop token id or the stop string), and, unless
    `include_stop_str_in_output`, the word's tokens dropped from the output (so not counted in
    `completion_tokens`). A word matches only after `min_tokens` tokens came before it."""
    out = s.output
    assert s.stops is not None
    for word, reason in s.stops:
        n = len(word)
        if len(out) - n >= s.min_tokens and (out[-1] == word[0] if n == 1 else tuple(out[-n:]) == word):
            s.finish_reason, s.stop_reason = "stop", reason
            if not s.include_stop:
                del out[-n:]
            return True
    return False
