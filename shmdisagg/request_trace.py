"""`TRTLLM_REQUEST_TRACE_DIR`: a replayable trace of what each client sent and received.

TensorRT-LLM's `tensorrt_llm/serve/request_trace.py` (ids 70121253331 and 70217114160), used by
its orchestrator (`openai_disagg_server.py`, id 70144234291). With the variable set to a
directory, each serving process appends two JSONL shards per UTC hour::

    $TRTLLM_REQUEST_TRACE_DIR/<YYYY-MM-DDTHH>/requests-<pid>.jsonl   one line per request
    $TRTLLM_REQUEST_TRACE_DIR/<YYYY-MM-DDTHH>/responses-<pid>.jsonl  one line when it ends

- request line: `{"event": "request", "trace_id": "tr_<hex>", "session", "recorded_at" (UTC
  ISO-8601), "server_arrival_time" (steady-clock seconds), "route", "status": "accepted",
  "headers": [[name, value], ...] (credential values `[redacted]`), "body"}` (the client's JSON;
  text plus `body_parse_error` when it did not parse). A request refused before it was routed
  (bad input, too large, overloaded) has `status: "rejected_<code>"` and
  `validation_errors: [{"loc", "type", "msg"}]`, and no response line, as upstream records a
  request its validation refused.
- response line: `{"event": "response", "trace_id", "session", "finished_at", "status"
  ("completed", "rejected_<code>" below 500, "error", "client_disconnected"), "client_id":
  null, "disagg_request_id", "ctx_request_id": null, "http_status" (error exits),
  "termination" (a stream cut short), "response": {"kind": "json" | "sse_text" | "text",
  "body"}}`: exactly what the client received.
- `session`: the request's conversation id (body `conversation_params.conversation_id`, the
  session headers, then `prompt_cache_key` / `client_metadata.session_id`) reduced to
  `[A-Za-z0-9._-]{1,128}`, else `_no_session`.
- the writer's accounting, `_writer/<generation>.json` (schema `trtllm-request-trace-writer/1`,
  the newer upstream's sidecar): records submitted / persisted / dropped by reason / pending,
  and per shard the byte range this writer's fsync()ed appends occupy. Written at start, at most
  every 10 s while records flow, and at close.

Writes happen in one thread (each batch appended per shard, flushed and fsync()ed); the event
loop only queues (1024 records; a full queue drops and counts). Upstream's Responses-API
outcome fields and tool-call-markup scan do not apply: shmdisagg serves no `/v1/responses`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import threading
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from shmdisagg.routing.conversation import conversation_id

log = logging.getLogger("shmdisagg.request_trace")

REQUEST_TRACE_DIR_ENV = "TRTLLM_REQUEST_TRACE_DIR"
QUEUE_SIZE = 1024
BATCH_SIZE = 32
SHUTDOWN_TIMEOUT_S = 5.0
SIDECAR_DIR = "_writer"
SIDECAR_SCHEMA = "trtllm-request-trace-writer/1"
SIDECAR_INTERVAL_S = 10.0
DURABILITY = (
    "a record is persisted once the append holding it, its terminating newline included, has been "
    "written, flushed and fsync()ed without an error"
)
_DROP_REASONS = ("queue_full", "unserializable", "write_error", "shutdown")
_NO_SESSION = "_no_session"
_SESSION_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_CREDENTIAL_HEADERS = frozenset(("authorization", "proxy-authorization", "cookie", "set-cookie"))
_CREDENTIAL_FRAGMENTS = ("api-key", "api_key", "apikey", "token", "secret", "password")
REDACTED = "[redacted]"


def trace_dir_from_env(environ: dict[str, str] | None = None) -> str | None:
    value = (environ if environ is not None else os.environ).get(REQUEST_TRACE_DIR_ENV)
    return value or None


def utc_now() -> str:
    return datetime.now(UTC).isoformat()


def hour_bucket(stamp: str) -> str:
    return stamp[:13]


def sanitize_session_key(value: str | None) -> str:
    if not value:
        return _NO_SESSION
    cleaned = _SESSION_UNSAFE.sub("_", str(value).strip())[:128]
    return _NO_SESSION if not cleaned or cleaned.startswith(".") else cleaned


def session_key(body: Any, headers: list[tuple[bytes, bytes]]) -> str:
    """The trace's session: the conversation id the router would key on (body, then session
    headers), then the client-native body fields upstream also reads."""
    if not isinstance(body, dict):
        return _NO_SESSION
    found = conversation_id(body, headers)
    if found is None and "conversation_params" not in body:
        key = body.get("prompt_cache_key")
        meta = body.get("client_metadata")
        found = (
            key
            if isinstance(key, str) and key.strip()
            else (meta.get("session_id") if isinstance(meta, dict) else None)
        )
    return sanitize_session_key(found if isinstance(found, str) else None)


def _is_credential(name: str) -> bool:
    lowered = name.lower()
    return lowered in _CREDENTIAL_HEADERS or any(f in lowered for f in _CREDENTIAL_FRAGMENTS)


def dump_headers(headers: list[tuple[bytes, bytes]]) -> list[list[str]]:
    """Ordered [name, value] pairs (repeats kept), credential values redacted."""
    out = []
    for raw_name, raw_value in headers:
        name = raw_name.decode("latin-1")
        out.append([name, REDACTED if _is_credential(name) else raw_value.decode("latin-1")])
    return out


def parse_body(raw: bytes) -> tuple[Any, str | None]:
    try:
        return orjson.loads(raw), None
    except orjson.JSONDecodeError as err:
        return raw.decode("utf-8", "replace"), f"JSONDecodeError: {err}"


class RequestTraceWriter:
    """Appends trace records to their hour's shard, in a thread. State: the accounting
    (`submitted`, `persisted`, `dropped` by reason), `generation` (this writer's lifetime)."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = Path(output_dir)
        self.suffix = f"-{os.getpid()}"
        self.generation = f"{os.getpid()}-{time.time_ns()}-{uuid.uuid4().hex[:8]}"
        self.started_at = utc_now()
        self.submitted = self.persisted = self.sanitized = 0
        self.dropped = dict.fromkeys(_DROP_REASONS, 0)
        self.write_errors = 0
        self.last_error: str | None = None
        self.last_write_at: str | None = None
        self._shards: dict[str, dict[str, Any]] = {}
        self._publications = 0
        self._last_published = float("-inf")
        self._queue: queue.Queue[tuple[str, str, dict[str, Any]] | None] = queue.Queue(maxsize=QUEUE_SIZE)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the accounting, read by `accounting()` from any thread

    @property
    def enabled(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Create the directory, publish the first sidecar, start the thread. Raises OSError."""
        if self._thread is not None:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._publish(force=True)
        self._thread = threading.Thread(target=self._run, name="request-trace", daemon=True)
        self._thread.start()

    def submit(self, kind: str, record: dict[str, Any], stamp: str) -> None:
        if self._thread is None:
            return
        with self._lock:
            self.submitted += 1
        try:
            self._queue.put_nowait((hour_bucket(stamp), kind, record))
        except queue.Full:
            with self._lock:
                self.dropped["queue_full"] += 1
                count = self.dropped["queue_full"]
            if count == 1 or count % 1000 == 0:
                log.warning("dropped %d request trace records: the writer queue is full", count)

    def close(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        thread.join(timeout_s)
        leftover = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            leftover += item is not None
        with self._lock:
            self.dropped["shutdown"] += leftover
        self._publish(force=True, closed=True)

    def _run(self) -> None:
        stop = False
        while not stop:
            try:
                item = self._queue.get(timeout=SIDECAR_INTERVAL_S)
            except queue.Empty:
                self._publish()
                continue
            if item is None:
                break
            batch = [item]
            while len(batch) < BATCH_SIZE:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            groups: dict[tuple[str, str], list[bytes]] = {}
            for bucket, kind, record in batch:
                line = self._encode(record)
                if line is not None:
                    groups.setdefault((bucket, kind), []).append(line)
            failed = False
            for (bucket, kind), lines in groups.items():
                failed |= not self._append(bucket, kind, lines)
            if groups and not failed:
                self.last_write_at = utc_now()
            self._publish(force=failed)

    def _encode(self, record: dict[str, Any]) -> bytes | None:
        try:
            line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        except (TypeError, ValueError, RecursionError) as err:  # RecursionError: a body ~1,000 levels deep
            with self._lock:
                self.dropped["unserializable"] += 1
            log.warning("dropped a malformed request trace record: %s", err)
            return None
        try:
            return line.encode("utf-8")
        except UnicodeEncodeError:  # unpaired surrogates in client text: write \u escapes instead
            with self._lock:
                self.sanitized += 1
            return (json.dumps(record, ensure_ascii=True, separators=(",", ":")) + "\n").encode()

    def _append(self, bucket: str, kind: str, lines: list[bytes]) -> bool:
        """One durable append of `lines` to its shard; the outcome is booked. Thread only."""
        rel = f"{bucket}/{kind}{self.suffix}.jsonl"
        path = self.output_dir / rel
        payload = b"".join(lines)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            size = path.stat().st_size if path.exists() else 0
            isolated = False
            with path.open("ab") as out:
                if size:
                    with path.open("rb") as tail:
                        tail.seek(-1, os.SEEK_END)
                        isolated = tail.read(1) != b"\n"
                if isolated:  # a fragment of a failed append: keep it a line of its own
                    out.write(b"\n")
                out.write(payload)
                out.flush()
                os.fsync(out.fileno())
                end = out.tell()
        except OSError as err:
            with self._lock:
                self.dropped["write_error"] += len(lines)
                self.write_errors += 1
                self.last_error = f"{type(err).__name__}: {err}"
            if self.write_errors == 1:
                log.warning("failed to write request trace JSONL: %s", err)
            return False
        with self._lock:
            self.persisted += len(lines)
            shard = self._shards.setdefault(rel, {
                "file": rel, "start_offset": size, "persisted_end": size, "persisted_records": 0,
                "fragments_isolated": 0, "unknown_extents": [],
            })  # fmt: skip
            shard["fragments_isolated"] += int(isolated)
            shard["persisted_end"] = end
            shard["persisted_records"] += len(lines)
        return True

    def accounting(self, closed: bool = False) -> dict[str, Any]:
        """The sidecar document: `submitted == persisted + sum(dropped) + unknown + pending`."""
        with self._lock:
            dropped = dict(self.dropped)
            pending = self.submitted - self.persisted - sum(dropped.values())
            return {
                "schema": SIDECAR_SCHEMA,
                "generation": self.generation,
                "pid": os.getpid(),
                "writer_suffix": self.suffix,
                "started_at": self.started_at,
                "published_at": utc_now(),
                "sequence": self._publications,
                "closed": closed,
                "durability": DURABILITY,
                "counts": {
                    "submitted": self.submitted,
                    "persisted": self.persisted,
                    "dropped": dropped,
                    "unknown": 0,
                    "pending": pending,
                },
                "attributes": {"sanitized": self.sanitized},
                "shards": [dict(s) for s in self._shards.values()],
                "errors": {"write_errors": self.write_errors, "last_error": self.last_error, "sidecar_errors": 0},
            }

    def _publish(self, force: bool = False, closed: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_published < SIDECAR_INTERVAL_S:
            return
        self._last_published = now
        document = self.accounting(closed)
        self._publications += 1
        directory = self.output_dir / SIDECAR_DIR
        try:
            directory.mkdir(parents=True, exist_ok=True)
            partial = directory / f".{self.generation}.json.partial"
            with partial.open("w", encoding="utf-8") as out:
                json.dump(document, out, separators=(",", ":"))
                out.write("\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(partial, directory / f"{self.generation}.json")
        except OSError as err:
            log.warning("failed to publish request trace writer accounting: %s", err)


class RequestTrace:
    """One client request's trace: its headers and body as they arrive, its answer as it leaves.
    `accepted()` writes the request line (once), `finish()` the response line (once)."""

    __slots__ = (
        "writer",
        "headers",
        "route",
        "arrival",
        "body",
        "response",
        "trace_id",
        "session",
        "request_written",
        "done",
    )

    def __init__(self, writer: RequestTraceWriter, scope: Mapping[str, Any], arrival: float) -> None:
        self.writer = writer
        self.headers: list[tuple[bytes, bytes]] = list(scope.get("headers", ()))
        self.route: str = scope.get("path", "")
        self.arrival = arrival
        self.body: list[bytes] = []
        self.response: list[bytes] = []
        self.trace_id = f"tr_{uuid.uuid4().hex}"
        self.session = _NO_SESSION
        self.request_written = False
        self.done = False

    def _request_record(self, status: str) -> dict[str, Any]:
        body, error = parse_body(b"".join(self.body))
        self.session = session_key(body, self.headers)
        stamp = utc_now()
        record: dict[str, Any] = {
            "event": "request", "trace_id": self.trace_id, "session": self.session, "recorded_at": stamp,
            "server_arrival_time": self.arrival, "route": self.route, "status": status,
            "headers": dump_headers(self.headers), "body": body,
        }  # fmt: skip
        if error is not None:
            record["body_parse_error"] = error
        return record

    def accepted(self) -> None:
        """The request passed its local checks (its first leg is about to go out)."""
        if not self.request_written:
            self.request_written = True
            record = self._request_record("accepted")
            self.writer.submit("requests", record, record["recorded_at"])

    def rejected(self, status: int, error_body: bytes) -> None:
        """Refused before routing: a request line with the reason, and no response line."""
        self.request_written = self.done = True
        record = self._request_record(f"rejected_{status}")
        try:
            err = orjson.loads(error_body)
        except orjson.JSONDecodeError:
            err = {}
        if isinstance(err, dict):
            param = err.get("param")
            record["validation_errors"] = [
                {
                    "loc": [str(param)] if param else [],
                    "type": str(err.get("type", "")),
                    "msg": str(err.get("message", "")),
                }
            ]
        self.writer.submit("requests", record, record["recorded_at"])

    def finish(
        self,
        status: str,
        http_status: int,
        stream: bool,
        disagg_request_id: int | None,
        termination: dict[str, str] | None = None,
    ) -> None:
        if self.done:
            return
        self.done = True
        self.accepted()
        raw = b"".join(self.response)
        stamp = utc_now()
        record: dict[str, Any] = {
            "event": "response", "trace_id": self.trace_id, "session": self.session, "finished_at": stamp,
            "status": status, "client_id": None, "disagg_request_id": disagg_request_id, "ctx_request_id": None,
        }  # fmt: skip
        if http_status != 200:
            record["http_status"] = http_status
        if termination is not None:
            record["termination"] = termination
        if stream:
            record["response"] = {"kind": "sse_text", "body": raw.decode("utf-8", "replace")}
        else:
            payload, error = parse_body(raw)
            record["response"] = {"kind": "text" if error is not None else "json", "body": payload}
        self.writer.submit("responses", record, stamp)
