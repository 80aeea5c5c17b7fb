"""What a worker (`trtllm-serve --disagg_cluster_uri ...`) writes in the cluster store, byte for
byte as TensorRT-LLM writes and reads it (`tensorrt_llm/serve/disagg_auto_scaling.py`
@b3809755: `WorkerInfo`, `get_worker_key_prefix`, `get_worker_key`, `DisaggClusterWorker`).

Key: `/trtllm-disagg/{cluster_name}/workers/{worker_id}`, where `worker_id` is
`{ROLE}-{host}:{port}-{unix ms}-{pid}-{random 0..1000, 3 digits}` (ROLE the `ServerRole` name,
`CONTEXT` or `GENERATION`). Value: `json.dumps(asdict(WorkerInfo))`, i.e.
`{"worker_id": "...", "host": "...", "port": 8001, "role": 0}` with Python's default separators;
`role` is `ServerRole`'s integer (`llmapi/disagg_utils.py` @0228a712: CONTEXT 0, GENERATION 1,
MM_ENCODER 2, VISUAL_GEN 3, EMBEDDING 4). The value carries no TTL: the store's lease (etcd) or
`ttl` (the HTTP store) of `inactive_timeout_sec` does, refreshed every `heartbeat_interval_sec`.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass

from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION

# TensorRT-LLM's ServerRole values and names (llmapi/disagg_utils.py)
SERVER_ROLES = {0: "CONTEXT", 1: "GENERATION", 2: "MM_ENCODER", 3: "VISUAL_GEN", 4: "EMBEDDING"}
TABLE_ROLE = {0: ROLE_CONTEXT, 1: ROLE_GENERATION}  # the roles a disaggregated deployment routes to
ROLE_BY_NAME = {"context": 0, "generation": 1}


class BadWorker(ValueError):
    """A value in the store that is not a WorkerInfo this deployment can route to."""


@dataclass(frozen=True)
class WorkerInfo:
    """One registered worker. `role`: TensorRT-LLM's ServerRole integer."""

    worker_id: str
    host: str = ""
    port: int = 0
    role: int = 0

    @property
    def addr(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def encode(self) -> str:
        """The stored value, as `json.dumps(asdict(worker_info))` writes it."""
        return json.dumps({"worker_id": self.worker_id, "host": self.host, "port": self.port, "role": self.role})


def worker_key_prefix(cluster_name: str) -> str:
    """`/trtllm-disagg/{cluster_name}/workers` (no trailing slash, as upstream watches it)."""
    return f"/trtllm-disagg/{cluster_name}/workers"


def worker_key(cluster_name: str, worker_id: str) -> str:
    return f"{worker_key_prefix(cluster_name)}/{worker_id}"


def new_worker_id(role: int, host: str, port: int) -> str:
    """A fresh id as `DisaggClusterWorker.__init__` makes it."""
    return f"{SERVER_ROLES[role]}-{host}:{port}-{int(time.time() * 1000)}-{os.getpid()}-{random.randint(0, 1000):03}"


def parse_worker(value: str | bytes) -> WorkerInfo:
    """A stored value as the coordinator reads it (`DisaggClusterManager._parse_worker_info`:
    `WorkerInfo(**json.loads(value))`, role through `ServerRole`). Raises BadWorker for a value
    that is not such a record, or whose role is not context or generation."""
    try:
        data = json.loads(value)
    except (ValueError, UnicodeDecodeError) as err:
        raise BadWorker(f"not JSON: {err}") from None
    if not isinstance(data, dict) or set(data) - {"worker_id", "host", "port", "role"}:
        raise BadWorker("not a WorkerInfo record")
    worker_id, host, port, role = data.get("worker_id"), data.get("host", ""), data.get("port", 0), data.get("role", 0)
    if not isinstance(worker_id, str) or not isinstance(host, str) or not host:
        raise BadWorker("worker_id and host must be strings")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise BadWorker(f"port {port!r} is not a TCP port")
    if isinstance(role, bool) or not isinstance(role, int) or role not in SERVER_ROLES:
        raise BadWorker(f"role {role!r} is not a ServerRole")
    if role not in TABLE_ROLE:
        raise BadWorker(f"role {SERVER_ROLES[role]} is not routed by a disaggregated deployment")
    return WorkerInfo(worker_id, host, port, role)
