"""The coordinator process: the only writer of the shared table.

Start-up, in order: with `port: 0`, reserve a port the kernel picks (`procutil.reserve_port`);
create the table (cleaning a dead deployment's stale segments; a live one holds the segment's
flock and makes this fail), register the executors of the config, wait until every configured
executor answers `GET /health` with 200 (up to `server_start_timeout_s` or `-t`, as TensorRT-LLM
waits for all its servers before it serves; with `disagg_cluster` or `-m` there are none: it
connects to the cluster store instead and registers the executors it lists, `Discovery` below,
and `/health` follows `minimal_instances`), serve the internal API on a Unix socket only this
user can connect to (mode 0600) and, with a `kv_cache_aware` router, listen for the fleet's KV
poll hints on a Unix datagram socket (`kv_events.py`), start the fleet, wait until every fleet
worker's socket on the public port listens (each says so on the internal API) and, with
`--report_addr PATH`, write the public host:port to PATH. Then it heart-beats the table, polls
executor health, drains KV events and supervises the fleet until SIGTERM/SIGINT, and shuts down
in a fixed, bounded order: stop the fleet (each worker gets `timeout_graceful_shutdown_s` for
its requests in flight, then STOP_MARGIN_S to end the rest and exit before a SIGKILL), stop the
API, unlink every segment and both sockets.

`python -m shmdisagg.coordinator -c CONFIG` (or `shmdisagg serve -c CONFIG`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
from dataclasses import dataclass, field

import uvicorn

from shmdisagg.cluster.drain_lease import DrainLease
from shmdisagg.cluster.etcd_store import EtcdWatcher
from shmdisagg.cluster.http_store import HttpClusterStore
from shmdisagg.cluster.metadata import MetadataPoller, MetadataServerConfig
from shmdisagg.config import DisaggConfig
from shmdisagg.coordinator.adoption import stop_stale_fleet, take_over
from shmdisagg.coordinator.api import internal_app
from shmdisagg.coordinator.health import ROLE_NAMES, Executor, HealthMonitor, executors_from_config
from shmdisagg.coordinator.kv_events import KvEventIngestor, listen_for_hints
from shmdisagg.coordinator.membership import Membership
from shmdisagg.coordinator.routing_keys import RoutingKeys
from shmdisagg.coordinator.supervisor import STOP_MARGIN_S, FleetSupervisor
from shmdisagg.fleet.overrides import DEFAULT_LEG_TIMEOUT_S, FleetOverrides
from shmdisagg.hostport import authority
from shmdisagg.metrics.answered import answered_reader
from shmdisagg.metrics.perf import PerfStore
from shmdisagg.metrics.rows import ROW_COORDINATOR, MetricsSegment, worker_row
from shmdisagg.node_ids import NodeIdError, claim_or_inherit
from shmdisagg.processes import ProcessId
from shmdisagg.procutil import listening, private_unix_socket, public_port_problem, publish_address, reserve_port
from shmdisagg.routing.affinity import ROUTE_AFFINITY_CACHE_SIZE
from shmdisagg.serving import EmbeddedServer, on_stop_signals
from shmdisagg.shm.index import BlockIndex, IndexSettings
from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION, ControlTable, process_starttime
from shmdisagg.trtllm_env import NOT_FOR_WORKERS, TrtllmEnv, apply_gc

log = logging.getLogger("shmdisagg.coordinator")

HEARTBEAT_S = 0.25  # as a fleet worker's; read by `shmdisagg stats` (yellow past 0.75 s) and as the loop's lag probe
INDEX_MAINTENANCE_S = 1.0
WAIT_NOTICE_S = 1.0  # executors not ready after this long at start-up: say what it waits for...
WAIT_REPORT_S = 10.0  # ...and again this often, naming the servers still not ready
COORD_RUNNING, COORD_STOPPING = 1, 2
# what the supervisor tells its coordinator alone (`StartOptions`): never a fleet worker's business
SUPERVISOR_ONLY = ("SHMDISAGG_ADOPT", "SHMDISAGG_ADOPT_PORT", "SHMDISAGG_READY_FD", "SHMDISAGG_STANDBY_FD")


class StartupError(RuntimeError):
    """The deployment could not start; the message says why."""


class FleetStartFailed(StartupError):
    """The fleet cannot start (a config error every worker meets, or no worker listened): a
    restarted coordinator would meet it again."""


class StartupInterrupted(StartupError):
    """SIGINT or SIGTERM (`signum`) came before the deployment was up; it stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__("interrupted during start-up")
        self.signum = signum


@dataclass(frozen=True)
class StartOptions:
    """What `trtllm-serve disaggregated`'s command line adds to the config (`shmdisagg serve`).

    `schedule_style`: `-s` (wins over TRTLLM_DISAGG_SCHEDULE_STYLE and the file);
    `leg_timeout_s`: `-r`, every fleet worker's per-leg timeout (None: no limit);
    `log_level`: resolved from TLLM_LOG_LEVEL, `-l` and the file (a trtllm_env.LOG_LEVELS name);
    `report_addr`: `--report_addr`, where the bound public host:port is written;
    `env`: TensorRT-LLM's environment variables, read once (`trtllm_env.read_env`).

    Set by the deployment's supervisor (`coordinator/keeper.py`), not by a user:
    `adopt`: this coordinator replaces one that died: take over its segments and fleet
    (`coordinator/adoption.py`); `adopt_port`: the public port the first one picked for `port: 0`;
    `supervisor`: the process whose death ends the deployment (None: this one);
    `ready_fd`: a pipe to write one byte to once the fleet serves.
    `metadata_server`: `-m`'s file, read: the executors come from that etcd's `trtllm/*` keys.
    """

    schedule_style: str | None = None
    leg_timeout_s: float | None = DEFAULT_LEG_TIMEOUT_S
    log_level: str | None = None
    report_addr: str | None = None
    env: TrtllmEnv = field(default_factory=TrtllmEnv)
    adopt: bool = False
    adopt_port: int | None = None
    supervisor: ProcessId | None = None
    ready_fd: int | None = None
    # `-m/--metadata_server_config_file`: executors listed in an etcd metadata server (cluster/metadata.py)
    metadata_server: MetadataServerConfig | None = None


class Coordinator:
    """State: the table it owns, the executor health monitor, the fleet supervisor."""

    def __init__(
        self,
        config: DisaggConfig,
        config_path: str,
        options: StartOptions | None = None,
        public_port: int | None = None,
    ) -> None:
        """`public_port`: the port reserved for `port: 0` (`config` carries it already)."""
        options = options or StartOptions()
        self.config = config
        self.options = options
        sd = config.shmdisagg
        try:  # the request ids' node field, held for the deployment's life (node_ids.py)
            self.node_claim = claim_or_inherit(config.node_id)
        except NodeIdError as err:
            raise StartupError(str(err)) from None
        try:
            takeover = (
                take_over(config.shm_prefix, sd.shm.max_workers, config.num_workers, config.max_servers)
                if options.adopt
                else None
            )
            if options.adopt and takeover is None:
                stop_stale_fleet(config.shm_prefix)
            self.adopted = takeover is not None  # the dead coordinator's segments and fleet go on
            self.table = (
                takeover.table
                if takeover is not None
                else ControlTable.create(config.shm_prefix, sd.shm.max_workers, config.max_servers)
            )
        except BaseException:
            self.node_claim.close()
            raise
        try:
            self.table.set_coordinator(os.getpid(), process_starttime(os.getpid()), secrets.randbits(63))
            # executors that register themselves: none to begin with, or those the dead
            # coordinator had registered (adopted with their slots, bound to their keys again
            # as the store lists them: `Membership`)
            dynamic = config.disagg_cluster is not None or options.metadata_server is not None
            settings = index_settings(config)
            self.index = (BlockIndex.adopt(self.table, settings) if self.adopted else None) or BlockIndex.create(
                self.table, settings
            )
            self.health = HealthMonitor(
                self.table,
                executors_from_config(config) if not dynamic else adopted_executors(self.table, self.adopted),
                sd.health_check_interval_s,
                sd.breaker_failures,
                sd.breaker_cooldown_s,
                timeout_s=sd.health_check_timeout_s,
                failures=sd.health_check_failures,
                adopt=self.adopted,
            )
            self.health.on_unhealthy = self.index.clear_server  # its cache may be gone: stop attracting traffic
            for slot in self.health.removed:
                self.index.clear_server(slot)
            ctx_args, gen_args = config.context_servers.router_args(), config.generation_servers.router_args()
            # Only a kv_cache_aware role routes on its executors' KV events (and only its legs
            # send poll hints): draining the others would cost CPU and fill the index for nothing.
            kv_roles = {
                role: (ROLE_NAMES[role], args.tokens_per_block)
                for role, args in ((ROLE_CONTEXT, ctx_args), (ROLE_GENERATION, gen_args))
                if args.type == "kv_cache_aware"
            }
            self.keys = RoutingKeys(kv_roles)
            self.health.keys = self.keys if kv_roles else None
            kv_executors = [ex for ex in self.health.executors if ex.role in kv_roles]
            self.kv_roles = set(kv_roles)
            # per-request metrics and perf records (shmdisagg/metrics/); a dead worker's counts
            # are folded into the retired row before its replacement starts
            self.metrics = (
                takeover.metrics
                if takeover is not None
                else MetricsSegment.create(config.shm_prefix, config.num_workers)
            )
            self.health.answered = answered_reader(self.metrics)  # the fleet's answered legs count as liveness
            self.kv_events = (
                KvEventIngestor(
                    self.index,
                    kv_executors,
                    self.keys,
                    sd.kv_events,
                    self.metrics.row(ROW_COORDINATOR),
                    on_key_change=self.health.republish,
                    on_restart=self.health.reprepare,
                )
                if kv_executors or (kv_roles and dynamic)  # executors may register later
                else None
            )
            # Fleet workers apply the style resolved here, as TensorRT-LLM's fleet does.
            self.schedule_style = options.schedule_style or options.env.schedule_style or config.schedule_style
            overrides = FleetOverrides(
                public_port, options.leg_timeout_s, options.log_level, options.metadata_server is not None
            )
            env = {
                "TRTLLM_DISAGG_SCHEDULE_STYLE": self.schedule_style,
                **overrides.to_environ(),
                **self.node_claim.env(),
            }
            self.supervisor = FleetSupervisor(
                self.table,
                config_path,
                config.num_workers,
                env,
                sd.worker_timeout_s,
                drop_env=NOT_FOR_WORKERS + SUPERVISOR_ONLY,
                supervisor=options.supervisor,
                pass_fds=(self.node_claim.fd,),
            )
            self.supervisor.on_exit = lambda index: self.metrics.fold(worker_row(index))
            self.perf = PerfStore(
                {e.slot: e.addr for e in self.health.executors},
                config.perf_metrics_max_requests,
                self.metrics.row(ROW_COORDINATOR),
            )
            self.discovery = Discovery(self) if dynamic else None
        except BaseException:
            if not self.adopted:  # an adopted table still serves a fleet: the next coordinator tries again
                self.table.unlink()
            self.table.close()
            self.node_claim.close()
            raise
        self._stop = asyncio.Event()
        self.stop_signal: int | None = None  # the signal that asked it to stop
        self.port_reserved = public_port is not None  # we hold the port: no need to probe it

    async def _maintain_index(self) -> None:
        """Sweep routed-bit TTLs and session LRU, resize/compact, retire old generations."""
        while True:
            await asyncio.sleep(INDEX_MAINTENANCE_S)
            try:
                self.index.maintain()
            except Exception:  # keep serving; the next round retries
                log.exception("index maintenance failed")

    def request_stop(self, signum: int | None = None) -> None:
        """The stop signal `signum` (None: asked by the API). A SIGINT once stopping is a second
        Ctrl-C: the fleet ends its requests at once, not after the grace period (uvicorn's "CTRL+C
        to force quit"); it reaches the coordinator alone when sent to `shmdisagg serve`'s pid or
        passed on by its supervisor, and the workers are told here."""
        if not self._stop.is_set():
            self.stop_signal = signum
        elif signum == signal.SIGINT:
            log.warning("a second Ctrl-C: the fleet ends the requests still running now")
            self.supervisor.force_quit()
        self._stop.set()

    async def _heartbeat(self) -> None:
        """The table's coordinator heartbeat every HEARTBEAT_S; each tick's lateness goes to the
        health checks (`HealthMonitor.note_lag`), so one timer serves both."""
        loop = asyncio.get_running_loop()
        while True:
            self.table.coord_heartbeat()
            before = loop.time()
            await asyncio.sleep(HEARTBEAT_S)
            self.health.note_lag(loop.time() - before - HEARTBEAT_S)

    async def _wait_fleet_listening(self) -> int:
        """Until every fleet worker's socket on the public port listens (each says so: `POST
        /listening`), so that ready means the whole fleet takes connections: with one worker
        listening, its death before the others listen would refuse connections. Workers that die
        meanwhile are restarted by the supervisor's watch. After `server_start_timeout_s` it logs
        which do not listen and reports ready with the others. Returns how many listen."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.shmdisagg.server_start_timeout_s
        while missing := self.supervisor.not_listening():
            if self.supervisor.config_errors:  # every worker reads the same config: none would start
                failed = ", ".join(map(str, sorted(self.supervisor.config_errors)))
                raise FleetStartFailed(
                    f"fleet worker(s) {failed} exited with a config error before listening (its line above)"
                )
            if self._stop.is_set():
                if self.stop_signal is not None:
                    raise StartupInterrupted(self.stop_signal)
                raise StartupError("stopped before the fleet listened")
            if loop.time() > deadline:
                if len(missing) == self.config.num_workers:
                    raise FleetStartFailed(
                        f"no fleet worker listened within {self.config.shmdisagg.server_start_timeout_s:g} s "
                        "(server_start_timeout_s); their lines above say why"
                    )
                log.warning(
                    "fleet worker(s) %s not listening after %g s (server_start_timeout_s): ready with the others",
                    ", ".join(map(str, missing)),
                    self.config.shmdisagg.server_start_timeout_s,
                )
                return self.config.num_workers - len(missing)
            await asyncio.sleep(0.02)  # polled, as _wait_ready polls the executors
        return self.config.num_workers

    async def _wait_ready(self) -> None:
        """Until every configured executor is healthy (TensorRT-LLM's orchestrator waits until
        all its servers' /health is 200, up to `--server_start_timeout`, else it fails:
        `_wait_for_all_servers_ready` in `tensorrt_llm/serve/openai_disagg_service.py`); after
        WAIT_NOTICE_S it logs what it waits for, then every WAIT_REPORT_S which servers are still
        not ready."""
        loop = asyncio.get_running_loop()
        timeout = self.config.shmdisagg.server_start_timeout_s
        start = loop.time()
        deadline, report_at, reported = start + timeout, start + WAIT_NOTICE_S, False
        # TRTLLM_DISAGG_BENCHMARK_GEN_ONLY: no context leg is ever sent, so upstream's wait skips
        # the context servers (`_wait_for_all_servers_ready`, serve/openai_disagg_service.py)
        awaited = [
            e for e in self.health.executors if not (self.options.env.benchmark_gen_only and e.role == ROLE_CONTEXT)
        ]
        # a refused executor answered /health but the router will not route to it (routing_keys):
        # waiting for it could only time out, so it is logged and the fleet starts without it
        while not all(e.healthy or e.refused is not None for e in awaited):
            if self._stop.is_set():
                if self.stop_signal is not None:
                    raise StartupInterrupted(self.stop_signal)
                raise StartupError("stopped before the executors were ready")
            now = loop.time()
            if now > deadline:
                raise StartupError(f"executors not healthy after {timeout:g} s: {not_ready(awaited)}")
            if now >= report_at:
                left = f"{deadline - now:.0f} s left"
                if not reported:
                    log.info(
                        "waiting for every executor to be healthy (GET /health = 200) before starting "
                        "the fleet, up to server_start_timeout_s or -t (%s); not ready: %s",
                        left,
                        not_ready(awaited),
                    )
                else:
                    log.info("still waiting for the executors (%s); not ready: %s", left, not_ready(awaited))
                report_at, reported = now + WAIT_REPORT_S, True
            await asyncio.sleep(0.05)

    async def run(self) -> None:
        # adopted: the fleet serves on the port already
        problem = (
            None if self.port_reserved or self.adopted else public_port_problem(self.config.hostname, self.config.port)
        )
        if problem:  # the fleet could only crash-loop on it
            raise StartupError(problem)
        on_stop_signals(self.request_stop, with_signal=True)
        sock_path = self.config.coordinator_socket
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock_path)  # a stale socket of a dead coordinator (we hold the table's lock)
        # Bound here, mode 0600 (uvicorn's own `uds=` binding makes it 0666): the API can mark
        # servers down and must not be reachable by other users.
        api_sock = bind_private_unix_socket(sock_path)
        hints: asyncio.BaseTransport | None = None
        try:
            if self.kv_events is not None and self.config.shmdisagg.kv_events.hints:
                try:  # before the fleet starts, so no worker's hint is lost to a missing socket
                    hints = await listen_for_hints(self.config.kv_hint_socket, self.kv_events)
                except OSError as err:
                    log.warning("no KV poll hints (%s: %s): KV events are only polled", self.config.kv_hint_socket, err)
            api = EmbeddedServer(
                uvicorn.Config(
                    internal_app(self), lifespan="off", access_log=False, log_level="warning", loop="none", workers=1
                )
            )  # else uvicorn reads WEB_CONCURRENCY
        except BaseException:  # cancelled or failed before the finally below owns the sockets
            api_sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sock_path)
            raise
        if self.discovery is not None:
            try:  # before the fleet starts: executors already registered are in the table when it serves
                await self.discovery.start()
            except BaseException:
                api_sock.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(sock_path)
                if hints is not None:
                    hints.close()
                raise
        tasks = [
            asyncio.ensure_future(self._heartbeat()),
            asyncio.ensure_future(self.health.run(watch_lag=False)),  # the heartbeat times the loop
            asyncio.ensure_future(self._maintain_index()),
            asyncio.ensure_future(self.supervisor.watch()),
        ]
        if self.kv_events is not None:
            tasks.append(asyncio.ensure_future(self.kv_events.run()))
        if self.discovery is not None:
            tasks.append(asyncio.ensure_future(self.discovery.run()))
        api_task = asyncio.ensure_future(api.serve(sockets=[api_sock]))
        self.perf.start()
        try:
            if self.adopted:  # the fleet serves meanwhile: health marks stay as they were, the polls resume
                self.supervisor.adopt()
            else:
                await self._wait_ready()
            self.table.set_coord_state(COORD_RUNNING)
            self.supervisor.start()
            notify_fleet_started(self.options.ready_fd)
            listening = self.config.num_workers if self.adopted else await self._wait_fleet_listening()
            if self.options.report_addr:  # the port is bound (or held) by now; readers poll /health next
                publish_address(self.options.report_addr, self.config.hostname, self.config.port)
            n = self.config.num_workers
            if self.adopted:
                log.info(
                    "coordinator restarted: adopted the table, the KV index and %d of %d fleet worker(s) on %s",
                    self.supervisor.adopted,
                    n,
                    authority(self.config.hostname, self.config.port),
                )
            else:
                log.info(
                    "coordinator ready: %d of %d fleet worker%s listening on %s",
                    listening,
                    n,
                    "" if n == 1 else "s",
                    authority(self.config.hostname, self.config.port),
                )
            notify_ready(self.options.ready_fd)
            await self._stop.wait()
        finally:
            self.table.set_coord_state(COORD_STOPPING)
            await self.supervisor.stop(self.config.shmdisagg.timeout_graceful_shutdown_s + STOP_MARGIN_S)
            api.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(api_task, 5.0)
            api_sock.close()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.discovery is not None:
                await self.discovery.close()
            await self.perf.stop()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sock_path)
            if hints is not None:
                hints.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.config.kv_hint_socket)

    def close(self) -> None:
        self.metrics.close()
        self.metrics.unlink()
        self.index.unlink()
        self.index.close()
        self.table.unlink()
        self.table.close()
        self.node_claim.close()  # free once the fleet workers holding it exited too


def adopted_executors(table: ControlTable, adopted: bool) -> list[Executor]:
    """With service discovery, a restarted coordinator keeps the executors the dead one had
    registered (same slots, health marks kept) until the store says otherwise."""
    if not adopted:
        return []
    out = []
    for s in table.servers():
        host, _, port = s.addr.rpartition(":")
        out.append(Executor(s.slot, s.role, host.strip("[]"), int(port)))
    return out


def notify_fleet_started(fd: int | None) -> None:
    """Tell the supervisor the fleet is started (b"F" on its pipe): every start-up check passed,
    so a coordinator that dies from here on is restarted, even before its fleet all listens and
    it reports ready (clients may be served by the workers that listen already)."""
    if fd is not None:
        with contextlib.suppress(OSError):
            os.write(fd, b"F")


def notify_ready(fd: int | None) -> None:
    """Tell the supervisor the fleet serves (one byte on its pipe, closed after): a coordinator
    that dies after this is restarted, one that dies before it failed to start."""
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.write(fd, b"R")
    with contextlib.suppress(OSError):
        os.close(fd)


def not_ready(executors: list[Executor]) -> str:
    """The executors not healthy, by role: `context 127.0.0.1:8001, ...; generation ...`, a
    refused one with its reason."""
    parts = []
    for role, name in ROLE_NAMES.items():
        addrs = [
            e.addr + (f" (refused: {e.refused})" if e.refused else "")
            for e in executors
            if e.role == role and not e.healthy
        ]
        if addrs:
            parts.append(f"{name} {', '.join(addrs)}")
    return "; ".join(parts) or "none"


def bind_private_unix_socket(path: str, backlog: int = 2048) -> socket.socket:
    """A listening Unix stream socket at `path` that only this user can connect to (mode 0600,
    `procutil.private_unix_socket`)."""
    return listening(private_unix_socket(path, socket.SOCK_STREAM), backlog)


def index_settings(config: DisaggConfig) -> IndexSettings:
    """Index sizing: `shmdisagg.index`, and sessions for each router that keeps them (LRU over
    them all): a conversation router's `max_sessions`, a kv_cache_aware router's
    `ROUTE_AFFINITY_CACHE_SIZE` chat pins."""
    sessions = [
        a.max_sessions if a.type == "conversation" else ROUTE_AFFINITY_CACHE_SIZE
        for a in (config.context_servers.router, config.generation_servers.router)
        if a.type in ("conversation", "kv_cache_aware")
    ]
    ix = config.shmdisagg.index
    return IndexSettings(
        capacity=ix.capacity,
        max_capacity=ix.max_capacity,
        routed_ttl_s=ix.routed_ttl_s,
        max_sessions=sum(sessions) if sessions else IndexSettings.max_sessions,
    )


async def run_coordinator(config: DisaggConfig, config_path: str, options: StartOptions | None = None) -> None:
    """Run the coordinator until a stop signal. With `port: 0` a port is reserved first and the
    whole deployment (shared-memory names, sockets, fleet) uses it."""
    options = options or StartOptions()
    if config.port == 0 and options.adopt and options.adopt_port:  # the port the first coordinator picked
        config = config.model_copy(update={"port": options.adopt_port})
        public_port: int | None = options.adopt_port
    else:
        public_port = None
    reserved = reserve_port(config.hostname) if config.port == 0 else None
    try:
        port = reserved.getsockname()[1] if reserved is not None else public_port
        if reserved is not None:
            config = config.model_copy(update={"port": port})
        coord = Coordinator(config, config_path, options, port)
        apply_gc(options.env)  # TRTLLM_DISAGG_SERVER_DISABLE_GC, as in the fleet workers
        try:
            await coord.run()
        finally:
            coord.close()
    finally:
        if reserved is not None:
            reserved.close()


class Discovery:
    """The coordinator's side of `disagg_cluster`: the store (etcd, or the HTTP store served on
    the internal API and, through the fleet, on the public port) feeding `Membership`, and what
    a join or leave changes besides the table (KV event drains, perf records, the index)."""

    def __init__(self, coord: Coordinator) -> None:
        from shmdisagg.cluster.workers import worker_key_prefix

        cluster = coord.config.disagg_cluster
        self.coord = coord
        self.cluster = cluster
        self.membership = Membership(coord.table, coord.health, on_join=self._joined, on_leave=self._left)
        self.watcher: EtcdWatcher | None = None
        self.store: HttpClusterStore | None = None
        self.poller: MetadataPoller | None = None
        self.drain_lease: DrainLease | None = None
        self._drop_at: float | None = None  # loop time to drop adopted executors no key claimed
        self.uri = ""
        if cluster is None:  # -m: the metadata server's trtllm/* keys, polled
            meta = coord.options.metadata_server
            assert meta is not None
            self.uri = meta.uri
            self.poller = MetadataPoller(meta, self.membership.sync)
            return
        self.uri = cluster.cluster_uri
        coord.health.minimal = (cluster.minimal_instances.context_servers, cluster.minimal_instances.generation_servers)
        self.prefix = worker_key_prefix(cluster.cluster_name)
        if cluster.is_etcd and coord.kv_events is not None:
            # several deployments may share these executors: only the lease holder drains
            self.drain_lease = DrainLease(
                cluster.endpoints(),
                cluster.cluster_uri,
                cluster.cluster_name,
                coord.config.shm_prefix,
                cluster.inactive_timeout_sec,
                cluster.heartbeat_interval_sec,
            )
            lease = self.drain_lease
            coord.kv_events.drains = lambda: lease.holder
        if cluster.is_etcd:
            m = self.membership
            self.watcher = EtcdWatcher(cluster.endpoints(), cluster.cluster_uri, self.prefix, m.sync, m.put, m.delete)
        else:
            self.store = HttpClusterStore()
            self.store.watch(self.prefix, self.membership.put, self.membership.delete)

    def _joined(self, ex: Executor) -> None:
        coord = self.coord
        coord.perf.servers[ex.slot] = ex.addr
        if coord.kv_events is not None and ex.role in coord.kv_roles:
            coord.kv_events.add(ex)

    def _left(self, ex: Executor) -> None:
        coord = self.coord
        if coord.kv_events is not None:
            coord.kv_events.remove(ex.slot)
        coord.index.clear_server(ex.slot)  # its blocks, routed bits and sessions: a new server starts empty

    async def start(self) -> None:
        """Connect to the store and register what it lists. Raises StartupError (one line)."""
        from shmdisagg.cluster.etcd_store import StoreUnreachable

        try:
            if self.watcher is not None:
                await self.watcher.start()
            elif self.poller is not None:
                await self.poller.start()
            else:
                # the HTTP store starts empty: adopted executors re-register at their next
                # heartbeat; those that have not within a TTL and a heartbeat are dropped
                cluster = self.cluster
                assert cluster is not None
                self._drop_at = asyncio.get_running_loop().time() + (
                    cluster.inactive_timeout_sec + cluster.heartbeat_interval_sec + 1
                )
                return
        except StoreUnreachable as err:
            await self.close()
            key = "disagg_cluster.cluster_uri" if self.cluster is not None else "-m/--metadata_server_config_file"
            raise StartupError(f"{key}: {err}") from None
        self.membership.drop_unclaimed()  # the store's list is whole: adopted executors it lacks are gone
        log.info("watching %s: %d executor(s) registered", self.uri, len(self.membership.by_key))

    async def run(self) -> None:
        tasks = [asyncio.ensure_future(self._tick())]
        if self.watcher is not None:
            tasks.append(asyncio.ensure_future(self.watcher.run()))
        if self.store is not None:
            tasks.append(asyncio.ensure_future(self.store.run()))
        if self.poller is not None:
            tasks.append(asyncio.ensure_future(self.poller.run()))
        if self.drain_lease is not None:
            tasks.append(asyncio.ensure_future(self.drain_lease.run()))
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(0.5)
            self.membership.tick()
            if self._drop_at is not None and loop.time() >= self._drop_at:
                self._drop_at = None
                self.membership.drop_unclaimed()

    async def close(self) -> None:
        if self.watcher is not None:
            await self.watcher.close()
        if self.poller is not None:
            await self.poller.close()

    def info(self) -> dict[str, object]:
        out: dict[str, object] = {"cluster_uri": self.uri, **self.membership.info()}
        if self.cluster is not None:
            out["cluster_name"] = self.cluster.cluster_name
            out["minimal_instances"] = {
                "context_servers": self.cluster.minimal_instances.context_servers,
                "generation_servers": self.cluster.minimal_instances.generation_servers,
            }
        if self.watcher is not None:
            out["store_connected"] = self.watcher.connected
            out["store_resyncs"] = self.watcher.resyncs
        if self.drain_lease is not None:
            out["kv_events_drain_lease"] = self.drain_lease.info()
        if self.poller is not None:
            out["store_connected"] = self.poller.connected
            out["metadata_polls"] = self.poller.polls
            out["metadata_dead_removed"] = self.poller.removed_dead
        return out
