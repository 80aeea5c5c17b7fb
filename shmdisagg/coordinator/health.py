"""Executor registry and health: the coordinator's view of every context and generation server.

Each executor of the config gets a slot in the shared table (context servers first). Each one
has its own probe loop (so one slow executor never delays the others' checks): `GET /health`
every `health_check_interval_s`, each probe bounded by `health_check_timeout_s`. The loops wake
on one grid (multiples of the interval on the loop's clock), so N executors cost one wake-up per
interval, and probe over the fleet's keep-alive httptools client (`upstream/`); BENCHMARKS.md
"Health checks and timers" has the CPU this saves. The first 200
is followed by `/server_info` and `/v1/models` (TensorRT-LLM's "prepare" step,
`Router._prepare_server` in `tensorrt_llm/serve/router.py`) before the server is published
healthy. A 503 with `x-trtllm-server-state: starting` is "loading", never healthy.

Taking a server out matches what the executor does, not only what its `/health` says:
- a refused connection (the process is gone) marks it unhealthy at once;
- other probe failures (a non-200, a timeout) mark it unhealthy only after
  `health_check_failures` in a row AND no leg answered by it since the first of them was sent.
  A busy executor's `/health` can be slow (its HTTP loop is busy streaming) while it serves
  every request; a server that answers legs is alive, and the failed probes start counting
  again from there.
TensorRT-LLM's metadata-server monitor (`Router.check_servers_health` / `_check_server_health`,
`tensorrt_llm/serve/router.py` id 56196118370) checks each server's `/health` twice, each with
`health_check_timeout` (5 s, `MetadataServerConfig` in `llmapi/disagg_utils.py` @0228a712),
before it removes one: the defaults here (2 failures, 5 s). Upstream has no such keys for a
static deployment (its static routers never re-check health after start-up, and its
`-m/--metadata_server_config_file` is refused here), hence shmdisagg's own names, next to
`health_check_interval_s`. Upstream counts no request outcome as liveness; its service
discovery (`disagg_cluster.heartbeat_interval_sec` / `inactive_timeout_sec`) has the workers
heart-beat instead, which static executors do not.

How the fleet's answered legs reach the coordinator (`metrics/answered.py`): each fleet worker
adds 1 per answered leg (a response head with a status below 500) to a per-server word of its
own row of the metrics segment, one memoryview add on the request path and no message; the
coordinator reads that word summed over every row (one 8-byte read per row) when a probe
fails. Why this and not what the control table already counts: a slot's picks (`routed`) and
a row's releases (`completed`) grow for failed legs too, so their growth proves nothing about
the executor; a per-slot success counter is what is honest, and the metrics segment already
has per-worker, per-slot words that only their worker writes, with no layout change to the
control table. Without a metrics segment (`answered` left None) only probes count, as before.

Fleet workers report request failures (`report`): a refused connection triggers an immediate
probe; `breaker_failures` failed requests within `BREAKER_WINDOW_S` open the server's circuit
breaker (unhealthy for the whole fleet) for a cool-down that doubles on each re-open (up to
`BREAKER_MAX_COOLDOWN_S`); after it, the server is re-admitted on its next healthy probe.
`/server_info` is re-read every `SERVER_INFO_REFRESH_S`; a change is republished. With a
`kv_cache_aware` router, each read is checked by `routing_keys.RoutingKeys.admit` (block size and
hash algorithm, as TensorRT-LLM's `KvCacheAwareRouter._prepare_server`): a refused executor is
never published healthy, its reason is logged once and shown as `refused` in `/cluster_info`, and
it is checked again at the next refresh.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from shmdisagg.config import MAX_EXECUTORS, DisaggConfig
from shmdisagg.coordinator.routing_keys import RoutingKeys
from shmdisagg.hostport import authority
from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION, ControlTable
from shmdisagg.upstream import UpstreamConnectError, UpstreamError, UpstreamPool, UpstreamTimeout

log = logging.getLogger("shmdisagg.coordinator")

BREAKER_WINDOW_S = 10.0
BREAKER_MAX_COOLDOWN_S = 30.0
SERVER_INFO_REFRESH_S = 10.0
LAG_TICK_S = 0.05
LAG_LIMIT_S = 0.2  # the coordinator's loop running this late makes its own timeouts suspect
ROLE_NAMES = {ROLE_CONTEXT: "context", ROLE_GENERATION: "generation"}


@dataclass
class Executor:
    """One executor as the coordinator tracks it."""

    slot: int
    role: int
    host: str
    port: int
    healthy: bool = False
    failures: int = 0
    server_info: dict[str, Any] | None = None
    models: list[str] = field(default_factory=list)
    info_at: float = 0.0  # loop time of the last /server_info read
    request_failures: list[float] = field(default_factory=list)  # loop times, within the window
    breaker_until: float = 0.0  # open breaker: no re-admission before this loop time
    breaker_cooldown: float = 0.0
    breaker_opens: int = 0
    refused: str | None = None  # why the router refuses it (routing_keys), or None
    streak_answered: float = 0.0  # its answered legs when the current run of failed probes began
    spared: bool = False  # failed probes were forgiven for answered legs (logged once per run)

    @property
    def addr(self) -> str:
        """`host:port`, an IPv6 host in brackets (as a config url and `WorkerInfo.addr` write it)."""
        return authority(self.host, self.port)

    @property
    def base(self) -> str:
        return f"http://{self.addr}"


def executors_from_config(config: DisaggConfig) -> list[Executor]:
    """Context servers get slots 0..n-1, generation servers the next ones."""
    out: list[Executor] = []
    for role, section in ((ROLE_CONTEXT, config.context_servers), (ROLE_GENERATION, config.generation_servers)):
        for host, port in section.addresses():
            out.append(Executor(len(out), role, host, port))
    # parse_config refuses more than the table's slots (config.max_servers, at most MAX_EXECUTORS);
    # a config built another way must not get here
    assert len(out) <= min(config.max_servers, MAX_EXECUTORS), f"{len(out)} executors, {config.max_servers} slots"
    return out


class HealthMonitor:
    """Polls executors and publishes their records and health flags to the table."""

    def __init__(
        self,
        table: ControlTable,
        executors: list[Executor],
        interval_s: float,
        breaker_failures: int = 3,
        breaker_cooldown_s: float = 2.0,
        *,
        timeout_s: float = 5.0,
        failures: int = 2,
        adopt: bool = False,
    ) -> None:
        """`interval_s` between one server's probes, `timeout_s` per probe request, `failures`
        failed probes in a row (and no answered leg) to mark a server unhealthy. `adopt`: the
        table is a dead coordinator's (`coordinator/adoption.py`): an executor whose record is
        still there (same slot, address and role) keeps its health mark until the next poll says
        otherwise, without a republish; the others are registered anew."""
        self.table = table
        self._by_slot: dict[int, Executor] = {ex.slot: ex for ex in executors}
        self._tasks: dict[int, asyncio.Task[None]] = {}  # slot -> its probe loop, while `run` runs
        # (context, generation) healthy servers that make the deployment ready; None: one of each
        # (disagg_cluster.minimal_instances sets it, as TensorRT-LLM's is_ready_with_router)
        self.minimal: tuple[int, int] | None = None
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures = failures
        self.breaker_failures = breaker_failures
        self.breaker_cooldown_s = breaker_cooldown_s
        self.on_unhealthy: Callable[[int], object] = lambda slot: None
        # slot -> legs the fleet saw it answer (metrics/answered.py); None: probes alone decide
        self.answered: Callable[[int], float] | None = None
        self.keys: RoutingKeys | None = None  # the kv_cache_aware roles' routing keys, if any
        self._late_until = 0.0  # loop time until which health-check timeouts are not trusted
        self._pool: UpstreamPool | None = None  # the probes' keep-alive connections, while `run` runs
        kept = {s.slot: s for s in table.servers()} if adopt else {}
        for ex in executors:
            record = kept.pop(ex.slot, None)
            if record is not None and (record.addr, record.role) == (ex.addr, ex.role):
                ex.healthy = record.healthy
            else:
                table.publish_server(ex.slot, ex.addr, ex.role, False)
        self.removed = sorted(kept)  # executors the edited config no longer lists
        for slot in self.removed:
            table.remove_server(slot)

    @property
    def executors(self) -> list[Executor]:
        """The registered executors, in slot order."""
        return [self._by_slot[s] for s in sorted(self._by_slot)]

    def get(self, slot: int) -> Executor | None:
        return self._by_slot.get(slot)

    def add(self, ex: Executor) -> None:
        """Register `ex` at run time (service discovery): published present and unhealthy at
        once, healthy after its first good probe and `/server_info`, like a configured one.
        ValueError if its slot is taken."""
        if ex.slot in self._by_slot:
            raise ValueError(f"slot {ex.slot} already holds {self._by_slot[ex.slot].addr}")
        self._by_slot[ex.slot] = ex
        self.table.publish_server(ex.slot, ex.addr, ex.role, False)
        if self._pool is not None:
            self._tasks[ex.slot] = asyncio.ensure_future(self._probe_loop(ex))

    def remove(self, slot: int) -> Executor | None:
        """Take `slot` out of the table and stop probing it; returns the executor it held.
        The fleet stops picking it at its next pick; legs already sent finish and release
        their load as usual."""
        ex = self._by_slot.pop(slot, None)
        task = self._tasks.pop(slot, None)
        if task is not None:
            task.cancel()
        if ex is None:
            return None
        ex.healthy = False
        self.table.remove_server(slot)
        if self.keys is not None:
            self.keys.remove(slot)
        return ex

    def healthy_counts(self) -> tuple[int, int]:
        """(healthy context servers, healthy generation servers)."""
        ctx = sum(1 for e in self._by_slot.values() if e.healthy and e.role == ROLE_CONTEXT)
        gen = sum(1 for e in self._by_slot.values() if e.healthy and e.role == ROLE_GENERATION)
        return ctx, gen

    def ready(self) -> bool:
        """Every role has at least one healthy server (with `minimal`: at least that many)."""
        ctx, gen = self.healthy_counts()
        want_ctx, want_gen = self.minimal if self.minimal is not None else (1, 1)
        return ctx >= want_ctx and gen >= want_gen

    def models(self) -> list[str]:
        return sorted({m for e in self.executors if e.healthy for m in e.models})

    async def run(self, *, watch_lag: bool = True) -> None:
        """Probe every executor, each in its own loop, until cancelled. `watch_lag`: time this
        loop's lateness with a timer of its own; False where the caller has a periodic timer
        already and reports its lateness (`note_lag`), as the coordinator's heartbeat does."""
        lag = asyncio.ensure_future(self._watch_lag()) if watch_lag else None
        # The fleet's own HTTP client (httptools, keep-alive): a probe through it costs a few
        # times less CPU than through aiohttp's session, which at 64 executors probed twice a
        # second was most of the coordinator's idle CPU (BENCHMARKS.md, "Health checks and timers").
        pool = self._pool = UpstreamPool(connect_timeout_s=self.timeout_s, idle_timeout_s=max(4.0, 2 * self.interval_s))
        try:
            for ex in self.executors:
                self._tasks[ex.slot] = asyncio.ensure_future(self._probe_loop(ex))
            await asyncio.Event().wait()  # until cancelled; executors come and go meanwhile
        finally:
            self._pool = None
            tasks = list(self._tasks.values())
            self._tasks.clear()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if lag is not None:
                lag.cancel()
            await pool.close()

    async def _probe_loop(self, ex: Executor) -> None:
        loop = asyncio.get_running_loop()
        interval = self.interval_s
        while True:
            try:
                await self._check(ex)
            except Exception:  # a bug here must not end the health checks of every server
                log.exception("health check of %s failed", ex.addr)
            # The next probe at the next multiple of the interval on the loop's clock, not an
            # interval after this one ended: every server's probe then starts on the same timer
            # tick, and their answers come back together, so N servers cost one wake-up per
            # interval rather than N (each still probed on its own: a slow one delays no other).
            await asyncio.sleep(interval - loop.time() % interval)

    async def _watch_lag(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(LAG_TICK_S)
            self.note_lag(loop.time() - before - LAG_TICK_S)

    def note_lag(self, late_s: float) -> None:
        """A timer of this process's event loop fired `late_s` seconds after its time. Past
        `LAG_LIMIT_S` the loop itself ran late: a health check that timed out meanwhile says more
        about us than about the executor, and is not held against it for a while."""
        if late_s > LAG_LIMIT_S:
            self._late_until = asyncio.get_running_loop().time() + max(self.interval_s * 2, 1.0)

    async def poll_once(self) -> None:
        """One probe of every executor at once (needs the connection pool `run` opened)."""
        await asyncio.gather(*(self._check(e) for e in self.executors))

    def _answered(self, slot: int) -> float:
        return self.answered(slot) if self.answered is not None else 0.0

    async def _check(self, ex: Executor) -> None:
        assert self._pool is not None
        if self._by_slot.get(ex.slot) is not ex:
            return  # removed (its slot may hold another executor by now)
        loop = asyncio.get_running_loop()
        if loop.time() < ex.breaker_until:
            return  # breaker open: no re-admission during the cool-down
        answered = self._answered(ex.slot)  # before the probe: a leg answered during it counts
        try:
            ok = (await self._get(ex, "/health"))[0] == 200
            if ok and (ex.server_info is None or loop.time() - ex.info_at > SERVER_INFO_REFRESH_S):
                info = await self._get_json(ex, "/server_info")
                models = await self._get_json(ex, "/v1/models")
                fresh = ex.server_info is None or not ex.healthy
                changed = ex.server_info is not None and info != ex.server_info
                ex.server_info, ex.info_at = info, loop.time()
                ex.models = [m["id"] for m in models.get("data", []) if isinstance(m, dict) and "id" in m]
                self._admit(ex, info, fresh)
                if changed and ex.healthy:
                    self._publish(ex)  # bumps servers_version: workers refresh their copy
            if ex.refused is not None:
                if ex.healthy:
                    self._set_unhealthy(ex, keep_info=True)
                return
        except (UpstreamConnectError, UpstreamTimeout) as err:
            if isinstance(err, UpstreamConnectError) and not isinstance(err.__cause__, TimeoutError):
                self._mark(ex, False, answered, refused=True)  # refused, or no route: nothing listens
                return
            # the connect or the probe took longer than health_check_timeout_s
            if loop.time() < self._late_until:
                return  # our loop was late, not necessarily the executor
            ok = False
        except (UpstreamError, OSError, ValueError, KeyError) as err:
            log.debug("health check of %s failed: %r", ex.addr, err)
            ok = False
        self._mark(ex, ok, answered)

    def _admit(self, ex: Executor, info: dict[str, Any], fresh: bool) -> None:
        """Ask the routing keys whether the router takes `ex` as `info` describes it."""
        reason = self.keys.admit(ex.slot, ex.role, ex.addr, info, fresh) if self.keys is not None else None
        if reason != ex.refused:
            if reason is not None:
                log.warning("%s server %s refused: %s", ROLE_NAMES[ex.role], ex.addr, reason)
            else:
                log.info("%s server %s is no longer refused", ROLE_NAMES[ex.role], ex.addr)
        ex.refused = reason

    def republish(self, slot: int) -> None:
        """Publish `slot` again (bumps servers_version, so fleet workers re-read `/cluster_info`,
        e.g. after its role's routing key changed)."""
        ex = self._by_slot.get(slot)
        if ex is not None and ex.healthy:
            self._publish(ex)

    def reprepare(self, slot: int) -> None:
        """Read `slot`'s `/server_info` again at its next health check (it restarted)."""
        ex = self._by_slot.get(slot)
        if ex is not None:
            ex.info_at = -math.inf

    def report(self, slot: int, kind: str) -> None:
        """A fleet worker's failed request to `slot` ("refused", "disconnected", "error")."""
        ex = self._by_slot.get(slot)
        if ex is None:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if kind == "refused" and self._pool is not None:
            asyncio.ensure_future(self._check(ex))  # confirm at once; a refusal marks it unhealthy
        ex.request_failures = [t for t in ex.request_failures if now - t < BREAKER_WINDOW_S] + [now]
        if len(ex.request_failures) >= self.breaker_failures and ex.healthy:
            ex.breaker_opens += 1
            ex.breaker_cooldown = min(max(ex.breaker_cooldown * 2, self.breaker_cooldown_s), BREAKER_MAX_COOLDOWN_S)
            ex.breaker_until = now + ex.breaker_cooldown
            ex.request_failures = []
            log.warning(
                "%s server %s: %d failed requests, breaker open for %.1f s",
                ROLE_NAMES[ex.role],
                ex.addr,
                self.breaker_failures,
                ex.breaker_cooldown,
            )
            self._set_unhealthy(ex)

    async def _get(self, ex: Executor, path: str) -> tuple[int, bytes]:
        """`GET path` of `ex`: (status, body), the whole exchange bounded by `timeout_s`.
        Raises `UpstreamError` (`UpstreamTimeout` past the bound)."""
        assert self._pool is not None
        r = await self._pool.request(ex.host, ex.port, "GET", path, timeout_s=self.timeout_s, whole=True)
        return r.status, r.body()

    async def _get_json(self, ex: Executor, path: str) -> dict[str, Any]:
        """`GET path` of `ex` as a JSON object. Raises `UpstreamError`, `ValueError` (not a 200
        JSON object)."""
        status, body = await self._get(ex, path)
        if status != 200:
            raise ValueError(f"{ex.base}{path} answered {status}")
        data = orjson.loads(body)  # orjson.JSONDecodeError is a ValueError
        if not isinstance(data, dict):
            raise ValueError(f"{ex.base}{path} did not return a JSON object")
        return data

    def _publish(self, ex: Executor) -> None:
        if self._by_slot.get(ex.slot) is not ex:
            return  # removed while a probe of it was in flight
        info = ex.server_info or {}
        self.table.publish_server(
            ex.slot,
            ex.addr,
            ex.role,
            ex.healthy,
            max_batch_size=int(info.get("max_batch_size") or 0),
            tokens_per_block=int(info.get("tokens_per_block") or 0),
            max_num_tokens=int(info.get("max_num_tokens") or 0),
        )

    def _set_unhealthy(self, ex: Executor, keep_info: bool = False) -> None:
        ex.healthy = False
        if self._by_slot.get(ex.slot) is not ex:
            return  # removed while a probe of it was in flight
        if not keep_info:
            ex.server_info = None  # prepare again when it comes back (it may have restarted)
        self.table.set_healthy(ex.slot, False)
        self.on_unhealthy(ex.slot)
        if self.keys is not None:
            self.keys.remove(ex.slot)  # set_healthy bumped servers_version: workers re-read the keys
        if ex.refused is None:
            log.warning("%s server %s is unhealthy", ROLE_NAMES[ex.role], ex.addr)

    def _mark(self, ex: Executor, ok: bool, answered: float, refused: bool = False) -> None:
        """One probe's outcome; `answered`: the server's answered legs when it was sent."""
        if ok:
            ex.failures, ex.spared = 0, False
            if asyncio.get_running_loop().time() < ex.breaker_until:
                return  # a probe sent before the breaker opened: no re-admission during the cool-down
            if not ex.healthy:
                ex.healthy = True
                self._publish(ex)
                log.info("%s server %s is healthy", ROLE_NAMES[ex.role], ex.addr)
            return
        if ex.failures == 0:
            ex.streak_answered = answered  # the window of this run of failed probes opens
        ex.failures += 1
        if not ex.healthy:
            return
        if refused:
            self._set_unhealthy(ex)  # nothing listens: the executor is gone
        elif ex.failures >= self.failures:
            now = self._answered(ex.slot)
            if now <= ex.streak_answered:
                self._set_unhealthy(ex)
                return
            # it answered legs since the first failed probe: alive; count from here again
            if not ex.spared:
                log.info(
                    "%s server %s: %d failed health checks, but it answered %d leg(s) meanwhile: kept",
                    ROLE_NAMES[ex.role],
                    ex.addr,
                    ex.failures,
                    now - ex.streak_answered,
                )
            ex.failures, ex.spared = 0, True

    def cluster_info(self) -> dict[str, Any]:
        return {
            "is_ready": self.ready(),
            "server_lists": {
                name: [e.addr for e in self.executors if e.role == role] for role, name in ROLE_NAMES.items()
            },
            "servers": [
                {
                    "slot": e.slot,
                    "addr": e.addr,
                    "role": ROLE_NAMES[e.role],
                    "healthy": e.healthy,
                    "server_info": e.server_info,
                    "breaker_opens": e.breaker_opens,
                    "refused": e.refused,
                }
                for e in self.executors
            ],
            "models": self.models(),
            "routing_key_configs": self.keys.configs() if self.keys is not None else {},
        }
