"""The coordinator's internal API, served on a Unix socket (never on the request path).

`GET /health`: 200 when every role has a healthy server, else 503.
`GET /cluster_info`: servers with their `/server_info` (and, with a kv_cache_aware router, why
one is `refused` and its KV event stream: `kv_events`), model names, `routing_key_configs` (each
kv_cache_aware role's block size and hash algorithm, which the fleet hashes prompts with), fleet
pids, restarts, KV event and poll-hint counters.
`POST /set`, `GET /get`, `DELETE /delete`, `GET /expire`, `GET /get_prefix`: the HTTP cluster
store, with `disagg_cluster.cluster_uri: http://...` (`shmdisagg/cluster/http_store.py`).
`POST /perf_records`: fleet workers' per-request records (`shmdisagg/metrics/shipper.py`).
`GET /perf_metrics`: those records joined with the executors' (`shmdisagg/metrics/perf.py`);
drained on read unless `?keep=1`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

if TYPE_CHECKING:
    from shmdisagg.coordinator.main import Coordinator


def internal_app(coord: Coordinator) -> FastAPI:
    api = FastAPI(title="shmdisagg coordinator", docs_url=None, redoc_url=None, openapi_url=None)

    @api.get("/health")
    def health() -> JSONResponse:
        ready = coord.health.ready()
        return JSONResponse({"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503)

    @api.get("/cluster_info")
    async def cluster_info() -> dict[str, Any]:  # async: on the loop that mutates what it reads
        info = coord.health.cluster_info()
        if coord.kv_events is not None:
            for server in info["servers"]:
                server["kv_events"] = coord.kv_events.server_state(server["slot"])
        return {
            **info,
            "coordinator_pid": os.getpid(),
            "fleet_pids": coord.supervisor.pids(),
            "num_workers": coord.config.num_workers,
            "fleet_restarts": coord.supervisor.restarts,
            "fleet_stuck_kills": coord.supervisor.stuck_kills,
            "schedule_style": coord.schedule_style,
            "shm_prefix": coord.config.shm_prefix,
            "kv_events": coord.kv_events.counters() if coord.kv_events is not None else None,
            # TensorRT-LLM's cluster-manager fields (current_workers, minimal_instances) and ours
            **({"disagg_cluster": coord.discovery.info()} if coord.discovery is not None else {}),
        }

    @api.post("/report")
    async def report(items: list[dict[str, Any]]) -> dict[str, int]:  # async: runs on the loop the monitor uses
        """Failure reports from fleet workers: `[{"slot": int, "kind": str}, ...]`."""
        n = 0
        for item in items:
            slot, kind = item.get("slot"), item.get("kind")
            if isinstance(slot, int) and kind in ("refused", "disconnected", "error"):
                coord.health.report(slot, kind)
                n += 1
        return {"accepted": n}

    @api.post("/listening")
    async def listening(item: dict[str, Any]) -> dict[str, bool]:  # async: on the loop the supervisor uses
        """A fleet worker's socket on the public port listens: `{"pid": int}`."""
        pid = item.get("pid")
        return {"known": isinstance(pid, int) and coord.supervisor.mark_listening(pid)}

    @api.post("/perf_records")
    async def perf_records(request: Request) -> dict[str, int]:
        # async: the store lives on the coordinator's event loop (FastAPI runs `def` in threads)
        try:
            payload = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return {"accepted": 0}
        return {"accepted": coord.perf.add_batch(payload) if isinstance(payload, dict) else 0}

    @api.get("/perf_metrics")
    async def perf_metrics(keep: bool = False) -> Response:
        return Response(orjson.dumps(await coord.perf.read(drain=not keep)), media_type="application/json")

    if coord.discovery is not None and coord.discovery.store is not None:
        from shmdisagg.cluster.http_store import mount

        mount(api, coord.discovery.store)  # the HTTP cluster store; the fleet relays the public port's
    return api
