#!/usr/bin/env python
"""Orchestrator CPU per request with each observability setting (shmdisagg/observe.py), off and on.

One process runs a fleet worker's request path (`tests/integration/inprocess.py`: the real
`DisaggService`, flows, legs and upstream pool over a shared-memory table, on uvloop) and drives
it as ASGI, `--concurrency` requests at a time, against two fake executors in their own processes
(`tests/fakes/executor.py`, which answer `X-TRTLLM-return-metrics: 1` as TensorRT-LLM's worker
does). CPU is this process's `time.process_time()` (every thread: the JSONL and trace writers'
included) over `--n` requests, divided by n; the fakes' CPU is not in it. Rounds cycle through
the variants, so drift hits them alike; the table shows the median round and each variant's
ratio to `before`.

Variants:
- `before`: legs call the upstream pool directly, as before this feature (no context-variable
  read): the baseline;
- `off`: none of the settings (what every deployment without them runs);
- `expose_unasked`: `return_perf_metrics: true`, clients that do not send the header;
- `expose_asked`: the same, every client sends `X-TRTLLM-return-metrics: 1` (legs asked,
  executors' metrics parsed and stripped, headers / SSE event built);
- `jsonl`: `perf_metrics_output_dir` (every request measured, one JSONL line each);
- `otlp`: `otlp_config` (a batch span processor around an exporter that drops the spans);
- `trace_dir`: `TRTLLM_REQUEST_TRACE_DIR` (two trace lines per request, fsync()ed per batch).

    .venv/bin/python benchmarks/bench_observe_cpu.py [--n 1500] [--rounds 3] [--concurrency 16]
        [--modes nonstream,stream16]

`--micro`: instead, the exact code the `off` and `expose_unasked` paths add, timed alone (ns per
call, median of 5 runs of 200,000): `send_leg` against a direct call of the pool (per leg), and
the client-header scan of a request with 6 headers (per request).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.benchkit import count, name_list  # noqa: E402

VARIANTS = ("before", "off", "expose_unasked", "expose_asked", "jsonl", "otlp", "trace_dir")
ASK = [(b"x-trtllm-return-metrics", b"1")]


def _observability(variant: str, tmp: str) -> Any:
    from shmdisagg.metrics.jsonl import PerfMetricsJsonlWriter
    from shmdisagg.observe import Observability
    from shmdisagg.request_trace import RequestTraceWriter

    if variant in ("before", "off"):
        return Observability()
    if variant.startswith("expose"):
        return Observability(expose=True)
    if variant == "jsonl":
        return Observability(writer=PerfMetricsJsonlWriter(f"{tmp}/perf-{uuid.uuid4().hex[:6]}"))
    if variant == "trace_dir":
        return Observability(trace_writer=RequestTraceWriter(f"{tmp}/trace-{uuid.uuid4().hex[:6]}"))
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from shmdisagg.tracing import Tracing

    class Dropping(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropping()))
    return Observability(tracing=Tracing(provider))


async def _cell(stack: Any, pool: Any, variant: str, mode: str, n: int, concurrency: int, tmp: str) -> float:
    import shmdisagg.orchestrator.legs as legs_module
    from shmdisagg import observe
    from tests.integration.inprocess import call

    def direct(
        upstream: Any,
        role: str,
        host: str,
        port: int,
        path: str,
        body: Any,
        headers: Any = (),
        timeout_s: float | None = None,
        whole: bool = False,
        total: bool = False,
    ) -> Any:  # send_leg's signature, the pool called with no observation at all
        return upstream.request(
            host, port, "POST", path, body, headers=headers, timeout_s=timeout_s, whole=whole, total=total
        )

    legs_module.send_leg = direct if variant == "before" else observe.send_leg  # type: ignore[assignment]
    obs = _observability(variant, tmp)
    obs.start()
    handler = obs.wrap(stack.service(pool).handle)
    body = {
        "model": "fake-model",
        "prompt": "request: " + "lorem ipsum " * 20,
        "max_tokens": 16,
        "stream": mode != "nonstream",
    }
    headers = ASK if variant == "expose_asked" else []
    todo = iter(range(n))

    async def worker() -> None:
        for _ in todo:
            answer = await call(handler, "/v1/completions", body, headers)
            assert answer.status == 200, answer.body[:200]

    for _ in range(50):  # warm-up
        await call(handler, "/v1/completions", body, headers)
    t0 = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    obs.close()  # the writers' remaining work counts too
    return (time.process_time() - t0) / n * 1e6


def micro() -> None:
    from shmdisagg import observe

    class Pool:
        async def request(self, host: str, port: int, method: str, path: str, body: bytes = b"", **kw: Any) -> None:
            return None

    pool, n = Pool(), 200_000
    scope = {"headers": [(b"host", b"x"), (b"user-agent", b"bench"), (b"accept", b"*/*"),
                         (b"content-type", b"application/json"), (b"content-length", b"120"),
                         (b"x-request-id", b"abc")]}  # fmt: skip

    async def direct() -> None:
        for _ in range(n):
            await pool.request("127.0.0.1", 1, "POST", "/v1/completions", b"{}")

    async def via_send_leg() -> None:
        for _ in range(n):
            await observe.send_leg(pool, "context", "127.0.0.1", 1, "/v1/completions", b"{}")  # type: ignore[arg-type]

    def scan() -> None:
        for _ in range(n):
            observe._asked(scope)

    def empty() -> None:
        for _ in range(n):
            pass

    timings: dict[str, list[float]] = {}
    for _ in range(5):
        for name, fn in (("direct", direct), ("send_leg", via_send_leg)):
            t0 = time.perf_counter()
            asyncio.run(fn())
            timings.setdefault(name, []).append((time.perf_counter() - t0) / n * 1e9)
        for name, fn in (("empty", empty), ("scan", scan)):
            t0 = time.perf_counter()
            fn()
            timings.setdefault(name, []).append((time.perf_counter() - t0) / n * 1e9)
    med = {k: statistics.median(v) for k, v in timings.items()}
    print(
        f"pool.request called directly: {med['direct']:.0f} ns per leg; through send_leg (off): "
        f"{med['send_leg']:.0f} ns "
        f"(+{med['send_leg'] - med['direct']:.0f} ns per leg)"
    )
    print(
        "X-TRTLLM-return-metrics scan of 6 headers (return_perf_metrics, client not asking): "
        f"{med['scan'] - med['empty']:.0f} ns per request"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=count, default=1500)
    parser.add_argument("--rounds", type=count, default=3)
    parser.add_argument("--concurrency", type=count, default=16)
    parser.add_argument("--modes", default="nonstream,stream16")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--micro", action="store_true")
    args = parser.parse_args()
    if args.micro:
        micro()
        return
    import uvloop

    from shmdisagg.upstream import UpstreamPool
    from tests.integration.harness import fake_executors
    from tests.integration.inprocess import Stack

    modes = name_list(parser, "--modes", args.modes, ("nonstream", "stream16"))
    variants = name_list(parser, "--variants", args.variants, VARIANTS)
    results: dict[tuple[str, str], list[float]] = {}
    with fake_executors(["ctx", "gen"]) as (ctx, gen), tempfile.TemporaryDirectory() as tmp:
        for f in (ctx, gen):
            f.script(chunks=16)
        stack = Stack(f"shmdisagg-b{uuid.uuid4().hex[:8]}", ctx.addr, gen.addr, tmp)
        try:

            async def run_all() -> None:
                pool = UpstreamPool()
                try:
                    for r in range(args.rounds):
                        for mode in modes:
                            for variant in variants if r % 2 == 0 else reversed(variants):
                                us = await _cell(stack, pool, variant, mode, args.n, args.concurrency, tmp)
                                results.setdefault((mode, variant), []).append(us)
                                print(f"round {r} {mode:10s} {variant:15s} {us:8.1f} us/request", file=sys.stderr)
                finally:
                    await pool.close()

            uvloop.run(run_all())
        finally:
            stack.close()
    print(
        f"\norchestrator CPU per request (median of {args.rounds} rounds, min-max), n={args.n}, concurrency "
        f"{args.concurrency}\n"
    )
    print("| variant | " + " | ".join(f"{m} us/request | {m} vs before" for m in modes) + " |")
    print("|---|" + "---|---|" * len(modes))
    for variant in variants:
        cells = []
        for mode in modes:
            values = results[(mode, variant)]
            base = statistics.median(results[(mode, "before")]) if (mode, "before") in results else None
            med = statistics.median(values)
            cells.append(f"{med:.1f} [{min(values):.1f}-{max(values):.1f}]")
            cells.append(f"{med / base:.3f}" if base else "-")
        print(f"| `{variant}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
