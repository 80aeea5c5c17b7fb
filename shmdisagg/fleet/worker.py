"""One fleet worker process: serves one SO_REUSEPORT listener on the public port.

Owns this worker's counter row in the shared table (claimed at start, heart-beaten every
250 ms), and row 2 + index of the metrics segment (`shmdisagg/metrics/`). Never writes another
worker's row, the server records or the block index: the coordinator does. Started by the coordinator's supervisor with the environment variables below;
`python -m shmdisagg.fleet.worker` is the entry point.

- `SHMDISAGG_CONFIG`: path of the deployment config file
- `SHMDISAGG_WORKER_INDEX`: this worker's index in the fleet (0..num_workers-1), also the
  `process_id` field of the request ids it mints; `standby` for the supervisor's warm spare,
  which imports everything, then reads its index from stdin (EOF: exit quietly)

SIGTERM or SIGINT stops it gracefully (`GracefulStop`): the listener and idle keep-alive
connections close at once, requests in flight run on for `timeout_graceful_shutdown_s`, then
every one still running ends with a 503 (`DisaggService.end_inflight`), its picks released on
the usual paths, so the row is back to zero before the process exits.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import uuid

import uvicorn
import uvloop

from shmdisagg.config import ConfigError, DisaggConfig, load_config
from shmdisagg.directory import ServerDirectory
from shmdisagg.fleet.app import FleetApp, control_app
from shmdisagg.ids import DisaggIdGenerator
from shmdisagg.procutil import bind_reuseport
from shmdisagg.routing import USES_INDEX, make_policy
from shmdisagg.shm.index import BlockIndex
from shmdisagg.tokenization import load_tokenizer
from shmdisagg.fleet.cluster import ClusterView, fetch_cluster_info
from shmdisagg.flows import SCHEDULE_STYLE, Flows
from shmdisagg.legs import LegRunner
from shmdisagg.metrics.fleet import FleetMetrics
from shmdisagg.reporting import FailureReporter, KvHints
from shmdisagg.service import DisaggService, KeyBuilder
from shmdisagg.serving import EmbeddedServer, on_stop_signals
from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION, ControlTable, process_starttime
from shmdisagg.upstream import UpstreamPool

log = logging.getLogger("shmdisagg.fleet")

HEARTBEAT_S = 0.25
INFO_REFRESH_S = 1.0
# After the grace period, how long uvicorn still waits for the ended requests' last bytes before
# it cancels their tasks itself (a client that does not read); the supervisor waits longer.
END_MARGIN_S = 2.0


class GracefulStop:
    """The stop-signal handler of a worker. The first signal tells uvicorn to stop (it closes
    the listener and idle connections, then waits for the open ones) and arms a timer that ends
    the requests still running after `grace_s` seconds; later signals change nothing (a Ctrl-C
    reaches the worker and the coordinator's SIGTERM follows)."""

    def __init__(self, server: uvicorn.Server, service: DisaggService, grace_s: float) -> None:
        self.server = server
        self.service = service
        self.grace_s = grace_s
        self.timer: asyncio.TimerHandle | None = None

    def __call__(self) -> None:
        if self.timer is None:
            self.server.should_exit = True
            self.timer = asyncio.get_running_loop().call_later(self.grace_s, self._end)

    def _end(self) -> None:
        running = self.service.end_inflight()
        if running:
            log.warning("grace period of %g s over: ending %d request(s) with 503", self.grace_s, running)


async def _housekeeping(table: ControlTable, row: int, view: ClusterView, service: DisaggService, socket_path: str) -> None:
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
                service.models = view.models
            except TimeoutError:
                log.warning("coordinator did not answer /cluster_info; keeping the last view")
        await asyncio.sleep(HEARTBEAT_S)


def resolve_schedule_style(config: DisaggConfig) -> str:
    """`TRTLLM_DISAGG_SCHEDULE_STYLE` overrides the file's `schedule_style`, as TensorRT-LLM's
    fleet workers apply the style their launcher resolved. Raises ConfigError for a bad value."""
    value = os.environ.get("TRTLLM_DISAGG_SCHEDULE_STYLE")
    if not value:
        return config.schedule_style
    if value not in SCHEDULE_STYLE:
        raise ConfigError(f"TRTLLM_DISAGG_SCHEDULE_STYLE: {value!r} is not one of {', '.join(SCHEDULE_STYLE)}")
    return value


def _node_id(config: DisaggConfig) -> int:
    return config.node_id if config.node_id is not None else uuid.getnode() % 256


async def serve(config: DisaggConfig, worker_index: int) -> None:
    table = ControlTable.attach(config.shm_prefix)
    row = table.claim_row(os.getpid(), process_starttime(os.getpid()))
    upstream = UpstreamPool()
    reporter = FailureReporter(config.coordinator_socket)
    hints: KvHints | None = None
    index: BlockIndex | None = None
    metrics: FleetMetrics | None = None
    try:
        metrics = FleetMetrics(config, worker_index, table)
        directory = ServerDirectory(table)
        view = ClusterView(directory)
        version = table.servers_version()
        view.apply(await fetch_cluster_info(config.coordinator_socket, config.shmdisagg.server_start_timeout_s), version)
        ctx_args, gen_args = config.context_servers.router_args(), config.generation_servers.router_args()
        if config.shmdisagg.kv_events.hints and "kv_cache_aware" in (ctx_args.type, gen_args.type):
            hints = KvHints(config.kv_hint_socket)  # the coordinator drains KV events only then
        if {ctx_args.type, gen_args.type} & USES_INDEX:
            index = BlockIndex.attach(table, timeout=config.shmdisagg.server_start_timeout_s)
        ctx_policy = make_policy(table, row, ROLE_CONTEXT, ctx_args, index, lambda: view.routing_keys.get(ROLE_CONTEXT))
        gen_policy = make_policy(table, row, ROLE_GENERATION, gen_args, index, lambda: view.routing_keys.get(ROLE_GENERATION))
        ctx_policy, gen_policy = metrics.wrap_policy(ctx_policy, False), metrics.wrap_policy(gen_policy, True)
        ids = DisaggIdGenerator(_node_id(config), worker_index % 64)
        legs = LegRunner(directory, upstream, reporter, config.max_retries, hints)
        style = resolve_schedule_style(config)
        local_prefill = config.conditional_disagg_config.max_local_prefill_length if config.conditional_disagg_config else 0
        flows = Flows(legs, ctx_policy, gen_policy, ids.next_id, view.ctx_server_info, style, local_prefill)
        admission = metrics.admission(config.shmdisagg.max_inflight_requests, lambda: sum(table.load(s.slot)[0] for s in directory.servers()))
        service = DisaggService(config, flows, ids, admission, style)
        metrics.install(service)
        needs_tokens = ctx_policy.needs_tokens or gen_policy.needs_tokens
        conversations = "conversation" in (ctx_args.type, gen_args.type)
        if needs_tokens or conversations:
            tokenizer = load_tokenizer(gen_args.tokenizer_dir or ctx_args.tokenizer_dir) if needs_tokens else None
            service.keys = KeyBuilder(tokenizer, conversations)
        service.models = view.models
        app = FleetApp(service, control_app(service, directory, table, worker_index, metrics), metrics.request)
        sock = bind_reuseport(config.hostname, config.port)
        uv = uvicorn.Config(
            app,
            loop="none",
            http="httptools",
            lifespan="off",
            access_log=False,
            log_level=config.shmdisagg.log_level,
            timeout_keep_alive=config.server_keep_alive_timeout,
            timeout_graceful_shutdown=config.shmdisagg.timeout_graceful_shutdown_s + END_MARGIN_S,  # type: ignore[arg-type]  # a float works
        )
        gc.freeze()  # start-up objects are permanent: keep them out of every collection
        reporter.start()
        metrics.start()
        house = asyncio.ensure_future(_housekeeping(table, row, view, service, config.coordinator_socket))
        server = EmbeddedServer(uv)
        stop = GracefulStop(server, service, config.shmdisagg.timeout_graceful_shutdown_s)
        on_stop_signals(stop)
        try:
            await server.serve(sockets=[sock])
        finally:
            house.cancel()
            if stop.timer is not None:
                stop.timer.cancel()
    finally:
        await reporter.stop()
        if hints is not None:
            hints.close()
        if metrics is not None:
            await metrics.stop()
            metrics.close()
        await upstream.close()
        if index is not None:
            index.close()
        table.close()


def main() -> None:
    config = load_config(os.environ["SHMDISAGG_CONFIG"])
    given = os.environ.get("SHMDISAGG_WORKER_INDEX", "0")
    if given == "standby":
        line = sys.stdin.readline()
        if not line.strip():
            return
        given = line
    index = int(given)
    logging.basicConfig(
        level=config.shmdisagg.log_level.upper(),
        format=f"%(asctime)s fleet[{index}:{os.getpid()}] %(levelname)s %(message)s",
    )
    uvloop.run(serve(config, index))


if __name__ == "__main__":
    sys.exit(main())
