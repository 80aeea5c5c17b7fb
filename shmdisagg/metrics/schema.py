"""What a metrics row holds: every counter and histogram, and its word offset in the row.

One row is a flat array of float64 words. Counters are one word each; a histogram is one word
per bucket (plain counts, not cumulative; the last bucket is +Inf) followed by its sum. Per-server
counters take `MAX_SERVERS` words (the widest control table's slots, whatever the deployment's
`max_servers`), indexed by the server's slot in the control table. The layout
is the same in every process of a deployment (it is a constant of this module), and
`LAYOUT_HASH` in the segment header makes a process of another version refuse the segment.

Names: TensorRT-LLM's disaggregated-server names where it has one
(`tensorrt_llm/serve/perf_metrics.py`; prometheus-client renders a counter `x` as `x_total`, as
TensorRT-LLM's own exposition does), `shmdisagg_*` for ours.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

MAX_SERVERS = 256  # server slots of the widest control table (shm.layout.MAX_SERVERS_LIMIT)

# TensorRT-LLM's bucket sets (SHORT: 1 ms ... 2560 s, LONG: 0.1 s ... 1920 s), and one for the
# orchestrator's own time per request, which is microseconds to milliseconds.
SHORT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
LONG_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)
OVERHEAD_BUCKETS = (
    25e-6,
    50e-6,
    100e-6,
    200e-6,
    300e-6,
    500e-6,
    750e-6,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)

ROLES = ("context", "generation")
OUTCOMES = ("routed", "retry", "no_server")


@dataclass(frozen=True)
class Counter:
    name: str
    help: str


@dataclass(frozen=True)
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]


COUNTERS = (
    Counter("total_requests", "Requests received on the completion routes (including rejected ones)"),
    Counter("stream_requests", "Routed requests with stream=true"),
    Counter("nonstream_requests", "Routed requests with stream=false"),
    Counter("validation_exceptions", "Requests refused with a 4xx before routing (bad body, too large, content type)"),
    Counter("http_exceptions", "Routed requests that ended with an error answer (executor error, timeout, no server)"),
    Counter("internal_errors", "Routed requests that failed inside the orchestrator (HTTP 500)"),
    Counter("total_responses", "Requests answered completely"),
    Counter("ctx_total_requests", "Context legs sent"),
    Counter("ctx_error_requests", "Context legs that failed"),
    Counter("ctx_retry_requests", "Context legs re-sent to another server"),
    Counter("ctx_completed_requests", "Context legs answered"),
    Counter("gen_total_requests", "Generation legs sent"),
    Counter("gen_error_requests", "Generation legs that failed"),
    Counter("gen_retry_requests", "Generation legs re-sent to another server"),
    Counter("gen_completed_requests", "Generation legs streamed to the end"),
    Counter("shmdisagg_admission_rejections", "Requests refused with 429 at max_inflight_requests"),
    Counter("shmdisagg_client_disconnects", "Routed requests whose client went away before the end"),
    Counter(
        "shmdisagg_routed_client_errors",
        "Routed requests answered with a 4xx, most by an executor refusing a parameter (also in http_exceptions)",
    ),
    Counter(
        "shmdisagg_edge_refusals",
        "Requests the public port refused before any route saw them: 413 over max_request_body_bytes, 431, "
        "408, malformed HTTP 400 (not in total_requests)",
    ),
    Counter("shmdisagg_perf_records_dropped", "Per-request records a fleet worker could not hand to the coordinator"),
    Counter(
        "shmdisagg_worker_lost_requests", "Requests in flight on a fleet worker that died (counted when it is reaped)"
    ),
)

# Counters that end a received request; total_requests minus their sum is what is in flight.
FINISHED = (
    "stream_requests",
    "nonstream_requests",
    "validation_exceptions",
    "shmdisagg_admission_rejections",
    "shmdisagg_worker_lost_requests",
)

HISTOGRAMS = (
    Histogram("queue_latency_seconds", "Arrival to context dispatch in the fleet worker", SHORT_BUCKETS),
    Histogram("ctx_first_token_latency_seconds", "Context dispatch to the context answer", SHORT_BUCKETS),
    Histogram("ctx_complete_latency_seconds", "Context dispatch to the context answer (complete)", LONG_BUCKETS),
    Histogram("gen_first_token_latency_seconds", "Generation dispatch to its first token", SHORT_BUCKETS),
    Histogram("gen_complete_latency_seconds", "Generation dispatch to its last token", LONG_BUCKETS),
    Histogram(
        "gen_per_token_latency_seconds",
        "Time per output token after the first, from the generation executor's perf record",
        SHORT_BUCKETS,
    ),
    Histogram("shmdisagg_time_to_first_token_seconds", "Arrival to the first token sent to the client", SHORT_BUCKETS),
    Histogram(
        "shmdisagg_e2e_request_latency_seconds",
        "Arrival to the last byte sent to the client (completed requests)",
        LONG_BUCKETS,
    ),
    Histogram(
        "shmdisagg_orchestrator_overhead_seconds",
        "Time a request spent in the fleet worker outside executor waits: arrival to context dispatch plus "
        "context answer to generation dispatch",
        OVERHEAD_BUCKETS,
    ),
)

# per server slot: the context executors' reported prompt and cached (reused) tokens (fleet
# workers); the breaks in a kv_cache_aware executor's KV event stream (the coordinator); the
# legs each server answered (fleet workers, metrics/answered.py)
PER_SERVER = (
    Counter("shmdisagg_server_prompt_tokens", "Prompt tokens of requests prefilled on the server (its usage)"),
    Counter(
        "shmdisagg_server_cached_tokens",
        "Prompt tokens the server reported as cached (prompt_tokens_details.cached_tokens)",
    ),
    Counter(
        "shmdisagg_server_kv_event_gaps",
        "KV event-id gaps (the executor's event buffer dropped events) that cleared the server's index entries",
    ),
    Counter(
        "shmdisagg_server_kv_cache_restarts",
        "Executor restarts seen in its KV events (event_id went back, or a created event) that cleared its index "
        "entries",
    ),
    Counter(
        "shmdisagg_server_answered_legs",
        "Legs the server answered (response head with a status below 500): the coordinator's liveness evidence "
        "besides /health",
    ),
)


class Layout:
    """Word offsets in a row. Attributes: `pid` (the writer's process id, not a counter; 0 in
    the retired row), `counter[name]`, `routing[(role, outcome)]`, `hist[name]` (first bucket
    word; the sum follows the +Inf bucket), `per_server[name]` (word of slot 0), `words`."""

    def __init__(self) -> None:
        self.pid = 0
        at = 1
        self.counter: dict[str, int] = {}
        for c in COUNTERS:
            self.counter[c.name] = at
            at += 1
        self.routing: dict[tuple[str, str], int] = {}
        for role in ROLES:
            for outcome in OUTCOMES:
                self.routing[(role, outcome)] = at
                at += 1
        self.per_server: dict[str, int] = {}
        for c in PER_SERVER:
            self.per_server[c.name] = at
            at += MAX_SERVERS
        self.hist: dict[str, int] = {}
        self.bounds: dict[str, tuple[float, ...]] = {}
        for h in HISTOGRAMS:
            self.hist[h.name] = at
            self.bounds[h.name] = h.buckets
            at += len(h.buckets) + 2  # buckets, +Inf, sum
        self.words = at


LAYOUT = Layout()
LAYOUT_HASH = zlib.crc32(repr((COUNTERS, ROLES, OUTCOMES, PER_SERVER, MAX_SERVERS, HISTOGRAMS)).encode())
