"""One fleet worker process: serves one SO_REUSEPORT listener on the public port.

Owns this worker's counter row in the shared table (claimed at start, heart-beaten every
250 ms), and row 2 + index of the metrics segment (`shmdisagg/metrics/`). Never writes another
worker's row, the server records or the block index: the coordinator does. Started by the
coordinator's supervisor with the environment variables below; `python -m
shmdisagg.fleet.worker` is the entry point.

- `SHMDISAGG_CONFIG`: path of the deployment config file
- `SHMDISAGG_WORKER_INDEX`: this worker's index in the fleet (0..num_workers-1), also the
  `process_id` field of the request ids it mints (with `num_workers: 1`,
  `TRTLLM_DISAGG_WORKER_PROCESS_ID` when set, as TensorRT-LLM's standalone server reads it);
  `standby` for the supervisor's warm spare, which imports everything, then reads its index
  from stdin (EOF: exit quietly)
- set by the coordinator from the command line (`fleet/overrides.py`): `SHMDISAGG_PUBLIC_PORT` (the
  port it picked for `port: 0`), `SHMDISAGG_LEG_TIMEOUT_S` (`-r`, 0 for none),
  `SHMDISAGG_LOG_LEVEL` (`-l` / `TLLM_LOG_LEVEL`), `TRTLLM_DISAGG_SCHEDULE_STYLE` (`-s`)
- `SHMDISAGG_NODE_ID`, `SHMDISAGG_NODE_ID_FD`: the deployment's node id and its inherited
  host-wide lock (`node_ids.py`), the node field of the request ids it mints

TensorRT-LLM's other variables are read through `trtllm_env.read_env` (retries, garbage
collector), as in the coordinator.

SIGTERM or SIGINT stops it gracefully (`GracefulStop`): the listener and idle keep-alive
connections close at once, requests in flight run on for `timeout_graceful_shutdown_s`, then
every one still running ends with a 503 (`DisaggService.end_inflight`), its picks released on
the usual paths, so the row is back to zero before the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Mapping
from typing import TypeVar

import uvicorn
import uvloop

from shmdisagg.config import ConfigError, DisaggConfig, load_config
from shmdisagg.fleet.app import FleetApp, control_app
from shmdisagg.fleet.cluster import ClusterView, announce_listening, fetch_cluster_info
from shmdisagg.fleet.edge import EdgeLimits, edge_protocol
from shmdisagg.fleet.overrides import FleetOverrides
from shmdisagg.heap import keep_freed_heap
from shmdisagg.metrics.fleet import FleetMetrics
from shmdisagg.node_ids import LOCK_DIR, NodeIdClaim, claim_or_inherit
from shmdisagg.observe import Observability
from shmdisagg.orchestrator.directory import ServerDirectory
from shmdisagg.orchestrator.flows import FlowOptions, Flows
from shmdisagg.orchestrator.ids import DisaggIdGenerator
from shmdisagg.orchestrator.legs import LegRunner
from shmdisagg.orchestrator.reporting import FailureReporter, KvHints
from shmdisagg.orchestrator.service import DisaggService, KeyBuilder
from shmdisagg.orchestrator.wire import Wire
from shmdisagg.processes import CONFIG_ERROR_EXIT, supervisor_of
from shmdisagg.procutil import bind_reuseport
from shmdisagg.routing import USES_INDEX, make_policy
from shmdisagg.serving import EmbeddedServer, on_stop_signals
from shmdisagg.shm.index import BlockIndex
from shmdisagg.shm.segment import cleanup_stale
from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION, ControlTable, process_starttime
from shmdisagg.tokenizer_source import load_routing_tokenizer
from shmdisagg.trtllm_env import LOG_LEVELS, TrtllmEnv, apply_gc, read_env
from shmdisagg.upstream import UpstreamPool

log = logging.getLogger("shmdisagg.fleet")

HEARTBEAT_S = 0.25
T = TypeVar("T")
INFO_REFRESH_S = 1.0
# After the grace period, how long uvicorn still waits for the ended requests' last bytes before
# it cancels their tasks itself (a client that does not read); the supervisor waits longer.
END_MARGIN_S = 2.0


class GracefulStop:
    """The stop-signal handler of a worker. The first signal tells uvicorn to stop (it closes
    the listener and idle connections, then waits for the open ones) and arms a timer that ends
    the requests still running after `grace_s` seconds. A SIGINT once stopping (a second
    Ctrl-C: from the terminal under `serve`, passed on by the launcher under `launch`) ends them
    at once, as uvicorn's "(CTRL+C to force quit)" promises; SIGTERMs change nothing more (one
    Ctrl-C under `serve` reaches the worker first, then the coordinator's SIGTERM follows)."""

    def __init__(self, server: uvicorn.Server, service: DisaggService, grace_s: float) -> None:
        self.server = server
        self.service = service
        self.grace_s = grace_s
        self.timer: asyncio.TimerHandle | None = None
        self.forced = False

    def __call__(self, signum: int = signal.SIGTERM) -> None:
        if self.timer is None:
            self.server.should_exit = True
            self.timer = asyncio.get_running_loop().call_later(self.grace_s, self._end)
        elif signum == signal.SIGINT and not self.forced:
            self.forced = True
            self.timer.cancel()
            self._end("a second Ctrl-C")

    def _end(self, why: str = "") -> None:
        running = self.service.end_inflight()
        if running:
            why = why or f"grace period of {self.grace_s:g} s over"
            log.warning("%s: ending %d request(s) with 503", why, running)


async def _housekeeping(
    table: ControlTable, row: int, view: ClusterView, service: DisaggService, socket_path: str
) -> None:
    """Heartbeat this worker's row; refresh the cluster view when the server set changes."""
    next_info = 0.0
    loop = asyncio.get_running_loop()
    while True:
        table.heartbeat(row)
        version = table.servers_version()
        if version != view.version and loop.time() >= next_info:
            next_info = loop.time() + INFO_REFRESH_S
            try:
                view.apply(await fetch_cluster_info(socket_path, 1.0), version)
                service.models, service.routing_key_configs = view.models, view.routing_key_configs
            except TimeoutError:
                log.warning("coordinator did not answer /cluster_info; keeping the last view")
        await asyncio.sleep(HEARTBEAT_S)


def flow_options(config: DisaggConfig, env: TrtllmEnv) -> FlowOptions:
    """The config's and the environment's switches of the request flow (`flows.FlowOptions`)."""
    return FlowOptions(
        gen_tokids_ctxbytes=config.gen_tokids_ctxbytes,
        gen_strip_message_history=config.gen_strip_message_history,
        benchmark_gen_only=env.benchmark_gen_only,
    )


def wire_for(config: DisaggConfig, env: TrtllmEnv) -> Wire:
    """Leg encoding: msgpack with `TRTLLM_SERVE_ENABLE_MSGSPEC=1`, signed handoffs with
    `internal_request_auth_key` (`wire.py`)."""
    return Wire(msgpack=env.msgspec, auth_key=config.internal_request_auth_key)


async def _beating(table: ControlTable, row: int, work: Awaitable[T]) -> T:
    """`await work`, heart-beating the row every HEARTBEAT_S meanwhile."""
    task = asyncio.ensure_future(work)
    while not task.done():
        table.heartbeat(row)
        await asyncio.wait({task}, timeout=HEARTBEAT_S)
    return task.result()


def node_claim(config: DisaggConfig, environ: Mapping[str, str] = os.environ, directory: str = LOCK_DIR) -> NodeIdClaim:
    """The request id's node field, held: the deployment's host-wide claim the coordinator
    handed down (`SHMDISAGG_NODE_ID`, its lock fd inherited), else one claimed here from
    `node_id` or TensorRT-LLM's default `uuid.getnode() % 256` upward (`node_ids.py`).
    Raises NodeIdError."""
    return claim_or_inherit(config.node_id, directory, environ)


def process_id(config: DisaggConfig, env: TrtllmEnv, worker_index: int) -> int:
    """The request id's process field: `TRTLLM_DISAGG_WORKER_PROCESS_ID` for a fleet of one
    (TensorRT-LLM's standalone server reads it, `worker_local_process_id`), else the worker's
    index, as TensorRT-LLM's fleet launcher assigns it to each worker."""
    if config.num_workers == 1 and env.worker_process_id is not None:
        return env.worker_process_id
    return worker_index % 64


async def serve(
    config: DisaggConfig,
    worker_index: int,
    env: TrtllmEnv | None = None,
    overrides: FleetOverrides | None = None,
    supervisor_fd: int | None = None,
) -> None:
    """Serve until a stop signal, or until the deployment's supervisor exits (`supervisor_fd`,
    its pidfd: readable then), which stops it the same graceful way."""
    env = env or TrtllmEnv()
    overrides = overrides or FleetOverrides()
    table = ControlTable.attach(config.shm_prefix)
    row = table.claim_row(os.getpid(), process_starttime(os.getpid()), worker_index)
    upstream = UpstreamPool()
    reporter = FailureReporter(config.coordinator_socket)
    hints: KvHints | None = None
    index: BlockIndex | None = None
    metrics: FleetMetrics | None = None
    observe: Observability | None = None
    claim: NodeIdClaim | None = None
    try:
        metrics = FleetMetrics(config, worker_index, table)
        directory = ServerDirectory(table)
        view = ClusterView(directory)
        version = table.servers_version()
        view.apply(
            await fetch_cluster_info(config.coordinator_socket, config.shmdisagg.server_start_timeout_s), version
        )
        ctx_args, gen_args = config.context_servers.router_args(), config.generation_servers.router_args()
        if config.shmdisagg.kv_events.hints and "kv_cache_aware" in (ctx_args.type, gen_args.type):
            hints = KvHints(config.kv_hint_socket)  # the coordinator drains KV events only then
        if {ctx_args.type, gen_args.type} & USES_INDEX:
            index = BlockIndex.attach(table, timeout=config.shmdisagg.server_start_timeout_s)
        ctx_policy = make_policy(table, row, ROLE_CONTEXT, ctx_args, index, lambda: view.routing_keys.get(ROLE_CONTEXT))
        gen_policy = make_policy(
            table, row, ROLE_GENERATION, gen_args, index, lambda: view.routing_keys.get(ROLE_GENERATION)
        )
        ctx_policy, gen_policy = metrics.wrap_policy(ctx_policy, False), metrics.wrap_policy(gen_policy, True)
        claim = node_claim(config)
        ids = DisaggIdGenerator(claim.node_id, process_id(config, env, worker_index))
        retries = 0 if env.no_retry else config.max_retries  # TRTLLM_DISAGG_NO_RETRY=1
        legs = LegRunner(
            directory,
            upstream,
            reporter,
            retries,
            hints,
            leg_timeout_s=overrides.leg_timeout_s,
            answers=metrics.answered,
        )
        style = env.schedule_style or config.schedule_style  # the coordinator resolved -s into the variable
        local_prefill = (
            config.conditional_disagg_config.max_local_prefill_length if config.conditional_disagg_config else 0
        )
        flows = Flows(
            legs,
            ctx_policy,
            gen_policy,
            ids.next_id,
            view.ctx_server_info,
            style,
            local_prefill,
            flow_options(config, env),
            wire_for(config, env),
        )
        admission = metrics.admission(
            config.shmdisagg.max_inflight_requests, lambda: sum(table.load(s.slot)[0] for s in directory.servers())
        )
        service = DisaggService(config, flows, ids, admission, style)
        metrics.install(service)
        needs_tokens = ctx_policy.needs_tokens or gen_policy.needs_tokens
        conversations = "conversation" in (ctx_args.type, gen_args.type)
        if needs_tokens or conversations:
            # importing transformers and loading a tokenizer take seconds: beat meanwhile, so the
            # coordinator does not take the slow start for a stuck worker (worker_timeout_s)
            tokenizer = (
                await _beating(table, row, asyncio.to_thread(load_routing_tokenizer, config)) if needs_tokens else None
            )
            service.keys = KeyBuilder(tokenizer, conversations, "kv_cache_aware" in (ctx_args.type, gen_args.type))
        service.models, service.routing_key_configs = view.models, view.routing_key_configs
        # return_perf_metrics, perf_metrics_output_dir, otlp_config, TRTLLM_REQUEST_TRACE_DIR
        observe = Observability.from_config(config)
        observe.start()
        app = FleetApp(
            service,
            control_app(service, directory, table, worker_index, metrics),
            metrics.request,
            observe.wrap(service.handle),
        )
        sock = bind_reuseport(config.hostname, config.port)
        await announce_listening(
            config.coordinator_socket, os.getpid()
        )  # the kernel queues our connections from here on
        uv = uvicorn.Config(
            app,
            loop="none",
            # httptools with the public port's deadlines, body limit and connection cap; raises
            # RLIMIT_NOFILE (fleet/edge.py)
            http=edge_protocol(
                EdgeLimits.for_worker(config),
                app.hot_handler,
                metrics.request.edge_refused if metrics.request is not None else None,
            ),
            lifespan="off",
            access_log=False,
            log_level=LOG_LEVELS[overrides.log_level or config.shmdisagg.log_level],
            workers=1,  # else uvicorn reads WEB_CONCURRENCY (and fails on a non-integer)
            timeout_keep_alive=config.server_keep_alive_timeout,
            timeout_graceful_shutdown=config.shmdisagg.timeout_graceful_shutdown_s + END_MARGIN_S,  # type: ignore[arg-type]  # a float works
        )
        apply_gc(env)  # TRTLLM_DISAGG_SERVER_DISABLE_GC: off unless 0, as TensorRT-LLM's fleet workers
        reporter.start()
        metrics.start()
        house = asyncio.ensure_future(_housekeeping(table, row, view, service, config.coordinator_socket))
        server = EmbeddedServer(uv)
        stop = GracefulStop(server, service, config.shmdisagg.timeout_graceful_shutdown_s)
        on_stop_signals(stop, with_signal=True)
        if supervisor_fd is not None:
            asyncio.get_running_loop().add_reader(supervisor_fd, _supervisor_gone, supervisor_fd, stop)
        try:
            await server.serve(sockets=[sock])
        finally:
            house.cancel()
            if stop.timer is not None:
                stop.timer.cancel()
    finally:
        if observe is not None:
            observe.close()  # the JSONL and trace files flushed, the spans exported
        await reporter.stop()
        if hints is not None:
            hints.close()
        if metrics is not None:
            await metrics.stop()
            metrics.close()
        await upstream.close()
        if index is not None:
            index.close()
        if claim is not None:
            claim.close()  # an inherited one stays held by the coordinator and the other workers
        table.close()


def _supervisor_gone(fd: int, stop: GracefulStop) -> None:
    """The deployment's supervisor exited (SIGKILLed, or it stopped without reaching us): the
    deployment is over, whether or not a coordinator still runs."""
    asyncio.get_running_loop().remove_reader(fd)
    log.warning("the deployment's supervisor exited: stopping")
    stop()


def _last_out(config: DisaggConfig) -> None:
    """After a stop because the supervisor died: when no coordinator holds the table either,
    nobody else will remove the deployment's segments and sockets (`cleanup_stale` refuses while
    a live coordinator holds the lock, and any worker still stopping keeps its mappings)."""
    with contextlib.suppress(Exception):
        cleanup_stale(config.shm_prefix, (config.coordinator_socket, config.kv_hint_socket))


def main() -> int:
    keep_freed_heap()  # long prompts' buffers reuse mapped pages (heap.py)
    # the deployment's supervisor, watched from the start: when it dies, so does the deployment
    supervisor = supervisor_of(os.environ)
    supervisor_fd = supervisor.pidfd() if supervisor is not None else None
    if supervisor is not None and supervisor_fd is None:
        return 0  # gone before we started
    overrides = FleetOverrides.from_environ()
    try:
        config = overrides.apply(load_config(os.environ["SHMDISAGG_CONFIG"], metadata_server=overrides.metadata_server))
        env = read_env()  # the coordinator refused a bad one before it started the fleet
    except ConfigError as err:
        print(f"shmdisagg: config error: {err}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    given = os.environ.get("SHMDISAGG_WORKER_INDEX", "0")
    if given == "standby":
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        given = line
    index = int(given)
    logging.basicConfig(
        level=LOG_LEVELS[overrides.log_level or config.shmdisagg.log_level],
        format=f"%(asctime)s fleet[{index}:{os.getpid()}] %(levelname)s %(message)s",
    )
    try:
        uvloop.run(serve(config, index, env, overrides, supervisor_fd))
    except ConfigError as err:  # found at start-up (the routing tokenizer): every worker would find it
        print(f"shmdisagg: config error: {err}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    if supervisor is not None and not supervisor.alive():
        _last_out(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
