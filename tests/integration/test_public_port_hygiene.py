"""The public port of a real fleet worker (`fleet/worker.py` wires `fleet/edge.py` in): a slow
head gets a 408, an oversized declared body a 413 before it is sent, bytes that are not HTTP a
400, each in TensorRT-LLM's ErrorResponse shape and followed by the close, while a request
between them is served as before. The protocol's cases one by one: tests/unit/fleet/test_edge.py."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import orjson
import pytest

from shmdisagg.launch import Deployment
from shmdisagg.stats.snapshot import StatsReader, snapshot
from tests.integration.harness import deployment, fake_executors, post, write_config

HEAD_TIMEOUT_S = 0.5


def _exchange(dep: Deployment, data: bytes, every_s: float = 0.0) -> bytes:
    """Send `data` on a fresh connection (a byte every `every_s` seconds if > 0, from a thread)
    and return all the server sends until it closes (bounded: 20 s)."""
    sock = socket.create_connection(("127.0.0.1", dep.config.port), timeout=20)
    try:
        if every_s:

            def drip() -> None:
                try:
                    for i in range(len(data)):
                        sock.send(data[i : i + 1])
                        time.sleep(every_s)  # the slow client's pace, not a synchronisation
                except OSError:
                    pass  # the server closed: what the test reads

            threading.Thread(target=drip, daemon=True).start()
        else:
            sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        sock.close()


def _error(raw: bytes, status: int) -> dict:  # type: ignore[type-arg]
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    assert lines[0].startswith(f"HTTP/1.1 {status} "), raw
    assert headers["connection"] == "close" and headers["content-type"] == "application/json", headers
    err = orjson.loads(body)
    assert (
        set(err) == {"object", "message", "type", "param", "code"}
        and err["object"] == "error"
        and err["code"] == status
    ), err
    return err  # type: ignore[no-any-return]


def test_the_public_port_refuses_slow_oversized_and_garbage_requests_in_the_openai_shape(
    tmp_path: Path, shm_prefix: str, capfd: pytest.CaptureFixture[str]
) -> None:
    with fake_executors(["c0", "g0"]) as (ctx, gen):
        cfg = write_config(
            tmp_path,
            shm_prefix,
            [ctx.addr],
            [gen.addr],
            num_workers=1,
            shmdisagg={"client_header_timeout_s": HEAD_TIMEOUT_S},
        )
        with deployment(cfg) as dep:
            completion = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}
            assert post(dep, "/v1/completions", completion)[0] == 200

            slow = _exchange(
                dep,
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: "
                b"2\r\n\r\n{}",
                every_s=0.05,
            )
            assert _error(slow, 408)["type"] == "RequestTimeoutError"

            limit = dep.config.shmdisagg.max_request_body_bytes
            big = _exchange(
                dep,
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: "
                b"%d\r\n\r\n" % (limit + 1),
            )
            assert _error(big, 413)["message"] == f"request body is larger than {limit} bytes"

            garbage = _error(_exchange(dep, b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 64), 400)
            assert garbage["type"] == "BadRequestError" and garbage["message"].startswith("invalid HTTP request: TLS")

            # `shmdisagg stats` counts them apart: no route saw them, so they are not in the total
            with StatsReader(dep.config.shm_prefix) as reader:
                req = snapshot(None, reader.sample(), dep.config.shm_prefix)["requests"]
            assert (req["refused_at_port"], req["total_requests"], req["client_errors"]) == (3, 1, 0), req

            assert post(dep, "/v1/completions", completion)[0] == 200
    assert "RLIMIT_NOFILE: soft limit" in capfd.readouterr().err  # the worker says what it can open
