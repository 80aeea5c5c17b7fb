"""The worker record in the cluster store, byte for byte as TensorRT-LLM writes and reads it
(`serve/disagg_auto_scaling.py` @b3809755)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from enum import IntEnum

import pytest

from shmdisagg.cluster.workers import BadWorker, WorkerInfo, new_worker_id, parse_worker, worker_key, worker_key_prefix


class ServerRole(IntEnum):  # TensorRT-LLM's, llmapi/disagg_utils.py
    CONTEXT = 0
    GENERATION = 1
    MM_ENCODER = 2


@dataclass
class UpstreamWorkerInfo:  # TensorRT-LLM's WorkerInfo, field for field
    worker_id: str
    host: str = ""
    port: int = 0
    role: ServerRole = ServerRole.CONTEXT


def test_the_value_is_the_bytes_upstream_writes() -> None:
    ours = WorkerInfo("GENERATION-10.0.0.7:8002-1-2-003", "10.0.0.7", 8002, 1).encode()
    theirs = json.dumps(asdict(UpstreamWorkerInfo("GENERATION-10.0.0.7:8002-1-2-003", "10.0.0.7", 8002, ServerRole(1))))
    assert (
        ours
        == theirs
        == '{"worker_id": "GENERATION-10.0.0.7:8002-1-2-003", "host": "10.0.0.7", "port": 8002, "role": 1}'
    )


def test_keys_live_under_the_cluster_name() -> None:
    assert worker_key_prefix("prod") == "/trtllm-disagg/prod/workers"
    assert worker_key("", "CONTEXT-h:1-2-3-004") == "/trtllm-disagg//workers/CONTEXT-h:1-2-3-004"


def test_a_worker_id_is_role_address_time_pid_and_three_random_digits() -> None:
    assert re.fullmatch(r"CONTEXT-127\.0\.0\.1:8001-\d{13}-\d+-\d{3,4}", new_worker_id(0, "127.0.0.1", 8001))


def test_an_upstream_value_parses_back() -> None:
    value = json.dumps(asdict(UpstreamWorkerInfo("x", "node-3", 8001, ServerRole.CONTEXT)))
    assert parse_worker(value) == WorkerInfo("x", "node-3", 8001, 0)


@pytest.mark.parametrize(
    "value",
    [
        "not json",
        "[]",
        '{"worker_id": "x", "host": "h", "port": 8001, "role": 0, "extra": 1}',
        '{"worker_id": "x", "host": "", "port": 8001, "role": 0}',
        '{"worker_id": "x", "host": "h", "port": 0, "role": 0}',
        '{"worker_id": "x", "host": "h", "port": 8001, "role": 9}',
        '{"worker_id": "x", "host": "h", "port": 8001, "role": 2}',  # an encoder: no such leg here
        '{"worker_id": "x", "host": "h", "port": true, "role": 0}',
    ],
)
def test_values_that_name_no_routable_worker_are_refused(value: str) -> None:
    with pytest.raises(BadWorker):
        parse_worker(value)
