"""One request's state inside the engine, and the channel its tokens reach the HTTP handler by."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from shmdisagg.executors.sim.block_pool import Allocation
from shmdisagg.executors.sim.errors import SimError


class Kind(enum.Enum):
    LOCAL = "local"  # no disaggregated_params: prefill and decode here
    CONTEXT_ONLY = "context_only"
    GENERATION_ONLY = "generation_only"


class Phase(enum.Enum):
    NEW = "new"  # parsed, not yet submitted (the per-request overhead is still running)
    WAITING = "waiting"  # queued for admission (batch slot and KV blocks)
    TRANSFERRING = "transferring"  # generation_only: blocks held, pulling KV from the context executor
    READY = "ready"  # generation_only: KV arrived, waiting for a batch slot
    PREFILL = "prefill"
    DECODE = "decode"
    PINNED = "pinned"  # context_only: done, KV held until pulled or timed out
    DONE = "done"


class TokenChannel:
    """Engine-to-handler hand-off: the engine pushes tokens and finally closes or fails it; the
    handler awaits `wait()` and takes what arrived with `take()`. One waiter at a time. A
    non-streaming channel keeps no tokens (they are in `Sequence.output`) and wakes only on close."""

    __slots__ = ("_buf", "_waiter", "closed", "error", "streaming")

    def __init__(self, streaming: bool = True) -> None:
        self.streaming = streaming
        self._buf: list[int] = []
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.error: SimError | None = None

    def push(self, tokens: list[int]) -> None:
        if self.streaming:
            self._buf.extend(tokens)
            self._wake()

    def push1(self, token: int) -> None:
        self._buf.append(token)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def close(self) -> None:
        self.closed = True
        self._wake()

    def fail(self, error: SimError) -> None:
        if not self.closed:
            self.error = error
            self.closed = True
            self._wake()

    def take(self) -> list[int]:
        buf, self._buf = self._buf, []
        return buf

    async def wait(self) -> None:
        """Return once there are tokens to take or the channel is closed."""
        if self._buf or self.closed:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)


@dataclass(eq=False)
class Sequence:
    """Fields are grouped by who sets them: the request (prompt and sampling), the engine
    (progress, blocks, outcome) and the clock (timing, monotonic seconds)."""

    # per-request inputs
    request_id: int
    kind: Kind
    prompt: list[int]
    prompt_seed: int
    max_tokens: int
    # stop words (token ids, stop_reason), None when there are none: the per-token fast path
    stops: tuple[tuple[tuple[int, ...], int | str], ...] | None = None
    include_stop: bool = False  # include_stop_str_in_output: a matched stop word stays in the output
    min_tokens: int = 0  # stop words match only once this many tokens came before them
    block_hashes: list[int] = field(default_factory=list)
    ctx_request_id: int | None = None
    first_gen_tokens: list[int] = field(default_factory=list)
    ctx_endpoint: str | None = None
    # engine state
    phase: Phase = Phase.NEW
    computed: int = 0
    cached_tokens: int = 0
    ctx_cached_tokens: int | None = None  # generation_only: the context leg's cached tokens
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_gen_tokens_out: list[int] = field(default_factory=list)  # context_only: the token it generated
    alloc: Allocation | None = None
    stored_blocks: int = 0  # leading blocks of `block_hashes` this request holds as cached blocks
    total_blocks: int = 0
    new_blocks: int = 0
    reused_blocks: int = 0
    missed_blocks: int = 0
    cancelled: bool = False
    channel: TokenChannel = field(default_factory=TokenChannel)
    # timing
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    first_iter: int | None = None
    last_iter: int | None = None
    transfer_start: float | None = None
    transfer_end: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def context_len(self) -> int:
        """Tokens whose KV a decode step reads (prompt plus generated so far)."""
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
