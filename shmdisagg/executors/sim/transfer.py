"""The simulated KV transfer between a context and a generation executor.

Context side (`TransferTable`): a finished context_only request stays pinned (its KV blocks held)
under its `ctx_request_id` until a generation executor pulls it or `timeout_s` passes. A pull may
arrive before the context request does (generation-first scheduling): it then waits, up to
`timeout_s`, for that request to arrive and finish its prefill; a pull whose generation
executor leaves meanwhile (its request aborted) stops waiting, so the context request, if it
comes, can still be pulled by the retry.

Generation side (`KvPuller`): `POST http://<ctx_info_endpoint>/sim/kv_transfer` with
`{"ctx_request_id", "hold_s", "prompt_digest"}`. The context executor answers once the prefill is
done, after holding the blocks for `hold_s` (the transfer time the generation executor computed
from the bytes it still needs and its profile's bandwidth), then releases them. A pull to this
executor's own endpoint skips HTTP. Errors: 404 unknown id after the timeout, 409 pulled twice,
409 prompt mismatch; each becomes a `TransferError` on the generation side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from shmdisagg.executors.sim.errors import RequestError, SimError, TransferError
from shmdisagg.executors.sim.sequence import Sequence


class _Entry:
    __slots__ = ("ready", "seq", "pulled", "expiry")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.ready: asyncio.Future[Sequence] = loop.create_future()
        self.seq: Sequence | None = None
        self.pulled = False
        self.expiry: asyncio.TimerHandle | None = None


class TransferTable:
    """Context-side registry. `entries` maps ctx_request_id to its entry; `release` gives a
    pinned sequence's blocks back to the engine."""

    def __init__(self, timeout_s: float, release: Callable[[Sequence], None]) -> None:
        self.timeout_s = timeout_s
        self._release = release
        self.entries: dict[int, _Entry] = {}
        self.expired = 0
        self.completed = 0

    def _entry(self, ctx_request_id: int) -> _Entry:
        entry = self.entries.get(ctx_request_id)
        if entry is None:
            entry = self.entries[ctx_request_id] = _Entry(asyncio.get_running_loop())
        return entry

    def register(self, seq: Sequence) -> None:
        """A context_only request was accepted; raises 400 if its id is already in use."""
        assert seq.ctx_request_id is not None
        entry = self._entry(seq.ctx_request_id)
        if entry.seq is not None:
            raise RequestError(f"ctx_request_id {seq.ctx_request_id} is already in use on this executor")
        entry.seq = seq

    def prefill_done(self, seq: Sequence) -> None:
        """The context request's KV is complete: pin it until pulled or expired."""
        assert seq.ctx_request_id is not None
        entry = self.entries.get(seq.ctx_request_id)
        if entry is None or entry.seq is not seq:
            self._release(seq)
            return
        if not entry.ready.done():
            entry.ready.set_result(seq)
        if not entry.pulled:
            entry.expiry = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, seq.ctx_request_id, seq)

    def failed(self, seq: Sequence, error: SimError) -> None:
        """The context request ended without KV (cancelled, rejected): fail any pull of it."""
        if seq.ctx_request_id is None:
            return
        entry = self.entries.get(seq.ctx_request_id)
        if entry is None or entry.seq is not seq:
            return
        del self.entries[seq.ctx_request_id]
        if not entry.ready.done():
            entry.ready.set_exception(TransferError(f"context request {seq.ctx_request_id} failed: {error.message}"))
            entry.ready.exception()  # consumed here so an unawaited failure is not logged

    async def pull(self, ctx_request_id: int, hold_s: float, prompt_digest: int | None) -> dict[str, Any]:
        entry = self._entry(ctx_request_id)
        if entry.pulled:
            raise SimError(f"KV of ctx_request_id {ctx_request_id} was already pulled", status=409)
        entry.pulled = True
        try:
            seq = await asyncio.wait_for(asyncio.shield(entry.ready), self.timeout_s)
        except TimeoutError:
            self._abandon(ctx_request_id, entry)
            raise SimError(
                f"unknown ctx_request_id {ctx_request_id} (no context request within {self.timeout_s:g} s)", status=404
            ) from None
        except asyncio.CancelledError:  # the puller left (`/sim/kv_transfer`'s client) or the executor stops
            self._abandon(ctx_request_id, entry)
            raise
        except TransferError as exc:
            raise SimError(exc.message, status=404) from None
        if entry.expiry is not None:
            entry.expiry.cancel()
            entry.expiry = None
        if prompt_digest is not None and prompt_digest != seq.prompt_seed:
            self._finish(ctx_request_id, entry, seq)
            raise SimError(
                f"prompt of the generation request differs from context request {ctx_request_id}'s", status=409
            )
        try:
            if hold_s > 0:
                await asyncio.sleep(hold_s)
        finally:
            self._finish(ctx_request_id, entry, seq)
        self.completed += 1
        return {
            "ctx_request_id": ctx_request_id,
            "prompt_len": seq.prompt_len,
            "cached_tokens": seq.cached_tokens,
            "first_gen_tokens": list(seq.first_gen_tokens_out),
        }

    def _abandon(self, ctx_request_id: int, entry: _Entry) -> None:
        """A pull that waited in vain: forget it (and the entry, if no context request came)."""
        if self.entries.get(ctx_request_id) is entry and entry.seq is None:
            del self.entries[ctx_request_id]
        else:
            entry.pulled = False

    def _finish(self, ctx_request_id: int, entry: _Entry, seq: Sequence) -> None:
        if self.entries.get(ctx_request_id) is entry:
            del self.entries[ctx_request_id]
        self._release(seq)

    def _expire(self, ctx_request_id: int, seq: Sequence) -> None:
        entry = self.entries.get(ctx_request_id)
        if entry is None or entry.seq is not seq or entry.pulled:
            return
        del self.entries[ctx_request_id]
        self.expired += 1
        self._release(seq)

    @property
    def num_pinned(self) -> int:
        return sum(1 for e in self.entries.values() if e.ready.done() and not e.pulled)

    @property
    def num_waiting(self) -> int:
        """Pulls waiting for their context request to arrive or finish its prefill."""
        return sum(1 for e in self.entries.values() if e.pulled and not e.ready.done())


class KvPuller:
    """Generation-side client of `/sim/kv_transfer` (one aiohttp session per process)."""

    def __init__(self, own_endpoint: str, table: TransferTable, timeout_s: float) -> None:
        self.own_endpoint = own_endpoint
        self.table = table
        self.timeout_s = timeout_s
        self._session: Any = None

    def warm_up(self) -> None:
        """Import aiohttp and open the session now, not on the first generation request."""
        import aiohttp

        if self._session is None:
            # Idle connections are dropped well before the peer's 5 s keep-alive closes them, so a
            # pull never goes out on a connection the server is closing (seen as a reset).
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0))

    async def pull(self, endpoint: str, ctx_request_id: int, hold_s: float, prompt_digest: int) -> dict[str, Any]:
        if endpoint == self.own_endpoint:
            try:
                return await self.table.pull(ctx_request_id, hold_s, prompt_digest)
            except SimError as exc:
                raise TransferError(exc.message) from None
        import aiohttp

        self.warm_up()
        url = f"http://{endpoint}/sim/kv_transfer"
        body = {"ctx_request_id": ctx_request_id, "hold_s": hold_s, "prompt_digest": prompt_digest}
        timeout = aiohttp.ClientTimeout(total=self.timeout_s + hold_s + 10.0)
        try:
            async with self._session.post(url, json=body, timeout=timeout) as resp:
                data = await resp.json(content_type=None)
                if resp.status != 200:
                    message = data.get("message") if isinstance(data, dict) else None
                    raise TransferError(f"KV pull from {endpoint} failed ({resp.status}): {message or data}")
                return data  # type: ignore[no-any-return]  # the peer's JSON answer, a dict by the protocol
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise TransferError(f"KV pull from {endpoint} failed: {exc!r}") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
