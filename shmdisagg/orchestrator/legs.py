"""One leg of a request: pick a server of one role, send, and release the pick exactly once.

Retry rules (TensorRT-LLM's `OpenAIHttpClient` in `tensorrt_llm/serve/openai_client.py`, without its known faults):
- only before anything reached the client, and only on another server (the failed one is
  excluded from the re-pick);
- a connection that could not be made, or that dropped before any response byte, is retried up
  to `max_retries` times (context legs re-mint their `disagg_request_id`, as TensorRT-LLM does,
  so a half-started attempt can never collide with the retry on an executor);
- an executor's HTTP 5xx on a context leg is retried the same way; a 4xx is never retried
  (it is deterministic);
- a generation leg is retried only when nothing was sent: once a generation executor received
  the handoff it may have pulled the context KV, which cannot be pulled twice.
- a leg that times out (`leg_timeout_s`, TensorRT-LLM's `-r/--request_timeout`: the total time
  of one leg, connect to last byte, as upstream's aiohttp `ClientTimeout(total=...)` bounds it;
  the executor connection's own timer, `UpstreamPool.request(total=True)`) is never replayed:
  the work may be running (`UpstreamTimeout`, before the head or after it; a 504).
- when every server of the role the table offers could not be connected to, in this leg's
  attempts or (within `REFUSAL_MEMORY_S`, same incarnation) another request's of this worker,
  the leg ends with the role's 503 (`no_context_servers` / `no_generation_servers`), as when the
  table offers none: the executors are gone, and the coordinator has not marked them yet.
Every failure is reported to the coordinator (`FailureReporter`), which marks a refusing server
unhealthy for the whole fleet at once. A leg whose executor answered (a response head with a
status below 500) is counted for the coordinator's health checks (`AnsweredLegs`); one that
answered 200 hints the coordinator to drain that server's KV events (`KvHints`; `call` does it
when the body is read, streaming relays call `Opened.hint_kv` themselves).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shmdisagg.hostport import authority
from shmdisagg.metrics.answered import AnsweredLegs
from shmdisagg.observe import send_leg
from shmdisagg.orchestrator.directory import ServerDirectory
from shmdisagg.orchestrator.errors import RequestError
from shmdisagg.orchestrator.reporting import FailureReporter, KvHints
from shmdisagg.routing import Policy, RoutingKey
from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION
from shmdisagg.upstream import (
    Body,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)

log = logging.getLogger("shmdisagg.service")

DEFAULT_LEG_TIMEOUT_S = 180.0  # trtllm-serve disaggregated's -r/--request_timeout default
# How long a worker takes another request's failed connect to a server as still true of it: the
# coordinator, told at once (`FailureReporter`), marks it unhealthy well within this.
REFUSAL_MEMORY_S = 1.0
_ROLES = {"context": ROLE_CONTEXT, "generation": ROLE_GENERATION}


def no_servers_error(role: str) -> RequestError:
    """The 503 of a leg that has no server of `role` to go to."""
    return RequestError(503, f"no healthy {role} server", f"no_{role}_servers")


def leg_timeout_error(role: str, timeout_s: float | None) -> RequestError:
    """The 504 of a leg that ran past `request_timeout` (the `-r` flag)."""
    return RequestError(
        504,
        f"the {role} executor did not finish within {timeout_s:g} s (-r/--request_timeout, each leg's limit)",
        "leg_timeout",
    )


@dataclass(slots=True)
class Opened:
    """A leg whose response headers arrived; the caller must `close()` it exactly once."""

    slot: int
    response: UpstreamResponse
    policy: Policy
    key: RoutingKey
    hints: KvHints | None = None
    role: str = "generation"
    timeout_s: float | None = None
    addr: tuple[str, int] = ("", 0)
    _open: bool = True

    @property
    def label(self) -> str:
        """The executor's `host:port`, for log lines (never for a client)."""
        return authority(*self.addr)

    def hint_kv(self) -> None:
        """Tell the coordinator this leg's server has new KV events (one datagram, never blocks)."""
        if self.hints is not None:
            self.hints.hint(self.slot)

    def close(self, abort: bool = False) -> None:
        """Release the pick (and drop the connection if the body was not read to the end)."""
        if self._open:
            self._open = False
            if abort:
                self.response.abort()
            self.policy.release(self.slot, self.key)


class LegRunner:
    """Sends legs for one fleet worker."""

    def __init__(
        self,
        directory: ServerDirectory,
        upstream: UpstreamPool,
        reporter: FailureReporter,
        max_retries: int,
        hints: KvHints | None = None,
        *,
        leg_timeout_s: float | None = DEFAULT_LEG_TIMEOUT_S,
        answers: AnsweredLegs | None = None,
    ) -> None:
        self.directory = directory
        self.upstream = upstream
        self.reporter = reporter
        self.max_retries = max_retries
        self.hints = hints
        self.answers = answers
        self._refused: dict[int, tuple[float, int]] = {}  # slot -> (loop time, incarnation) of its last failed connect
        # `trtllm-serve disaggregated -r/--request_timeout`: TensorRT-LLM's total timeout of each
        # call to an executor (one leg, connect to last byte); None: no per-leg limit (`-r 0`).
        # The whole request's deadline is shmdisagg.request_timeout_s (service.py).
        self.leg_timeout_s = leg_timeout_s

    async def open(
        self,
        policy: Policy,
        key: RoutingKey,
        path: str,
        make_body: Callable[[int], Body],
        role: str,
        *,
        retry_5xx: bool = False,
        retry_sent: bool = False,
        exclude: int = -1,
        picked: int = -1,
        retries: int | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
        whole: bool = False,
    ) -> Opened:
        """Pick (or use `picked`, whose load the caller already added), send
        `make_body(attempt)` with `headers`, return once the response headers are in (`whole`:
        once the whole response is, `Opened.response.body()`). The leg's `leg_timeout_s` bounds
        all of it, the body read later included (`UpstreamTimeout` from the response).

        Raises `RequestError(503)` when no server of the role is eligible or every one could
        not be connected to (`_all_refused`), `RequestError(504)` when the head did not come
        within `leg_timeout_s`, or the last attempt's `UpstreamError`. A returned 5xx is an
        ordinary response unless `retry_5xx`; then it is returned when no other server can take
        the retry (the client gets the executor's error, not a 503 "no healthy server"), as a
        dropped connection with no other server to retry on is raised.
        """
        max_retries = self.max_retries if retries is None else retries
        attempt = 0
        refused: set[int] = set()
        failed: Opened | None = None  # a 5xx answer, kept until another server takes the retry
        dropped: UpstreamDisconnected | None = None  # the last attempt's, while a retry looks
        while True:
            slot = picked if attempt == 0 and picked >= 0 else policy.pick(key, exclude)
            if slot < 0:
                if failed is not None:  # no other server: the executor's own answer, not a 503
                    return failed
                if dropped is not None:  # the server is there, it dropped this request: a 502
                    raise dropped
                raise no_servers_error(role)
            dropped = None
            if failed is not None:
                failed.close(abort=True)
                failed = None
            if attempt:
                log.info("retrying the %s leg (attempt %d) on %s", role, attempt + 1, self.directory.label(slot))
            opened: Opened | None = None
            timeout_s = self.leg_timeout_s
            try:
                host, port = self.directory.address(slot)
                # observe.py adds its metrics request header and span when the request is observed
                resp = await send_leg(
                    self.upstream, role, host, port, path, make_body(attempt), headers, timeout_s, whole, True
                )
                if self.answers is not None and resp.status < 500:
                    self.answers.add(slot)  # alive, whatever its /health says (coordinator/health.py)
                # Only a KV-aware role routes on this server's KV events: hint for those alone.
                hints = self.hints if policy.name == "kv_cache_aware" else None
                opened = Opened(slot, resp, policy, key, hints, role, timeout_s, (host, port))
            except UpstreamTimeout:
                self.reporter.report(slot, "error")
                policy.release(slot, key)
                raise leg_timeout_error(role, timeout_s) from None
            except UpstreamConnectError:
                self.reporter.report(slot, "refused")
                refused.add(slot)
                self._note_refusal(slot)
                if self._all_refused(role, refused):
                    policy.release(slot, key)
                    log.warning("no %s server could be connected to (last: %s)", role, self.directory.label(slot))
                    raise no_servers_error(role) from None
                if attempt >= max_retries:
                    policy.release(slot, key)
                    raise
            except UpstreamDisconnected as err:
                self.reporter.report(slot, "disconnected")
                if attempt >= max_retries or not retry_sent or err.bytes_received:
                    policy.release(slot, key)
                    raise
                dropped = err
            except BaseException:
                policy.release(slot, key)
                raise
            if opened is not None:
                if not (retry_5xx and opened.response.status >= 500 and attempt < max_retries):
                    return opened
                self.reporter.report(slot, "error")
                failed = opened
            else:
                policy.release(slot, key)
            attempt += 1
            exclude = slot

    def _note_refusal(self, slot: int) -> None:
        incarnation = next((s.incarnation for s in self.directory.servers() if s.slot == slot), -1)
        self._refused[slot] = (asyncio.get_running_loop().time(), incarnation)

    def _all_refused(self, role: str, refused: set[int]) -> bool:
        """Every server of `role` the table offers (present, healthy) failed to connect: in
        this leg (`refused`), or in this worker within `REFUSAL_MEMORY_S` while its record kept
        the same incarnation (the coordinator re-publishes a server it takes back)."""
        now = asyncio.get_running_loop().time()
        want = _ROLES[role]
        for s in self.directory.servers():
            if s.role != want or not s.healthy or s.slot in refused:
                continue
            seen = self._refused.get(s.slot)
            if seen is None or now - seen[0] > REFUSAL_MEMORY_S or seen[1] != s.incarnation:
                return False
        return True

    async def call(
        self, policy: Policy, key: RoutingKey, path: str, make_body: Callable[[int], Body], role: str, **kw: Any
    ) -> tuple[int, bytes, int]:
        """A non-streaming leg: (status, body, slot); the pick is released before returning."""
        opened = await self.open(policy, key, path, make_body, role, whole=True, **kw)
        try:
            body = opened.response.body()
        except BaseException:
            opened.close(abort=True)
            raise
        opened.close()
        if opened.response.status == 200:
            opened.hint_kv()
        return opened.response.status, body, opened.slot
