"""What the metrics cost on the request path (BENCHMARKS.md, "Metrics on the request path").

    .venv/bin/python benchmarks/bench_metrics.py micro [--requests 200000]
    .venv/bin/python benchmarks/bench_metrics.py e2e [-c examples/demo.yaml] [--rounds 3] [...]

`micro`: CPU time per request of the fleet worker's request-path metrics, in one process, for a
completed disaggregated request (two picks, twelve counter adds and eight histogram
observations, the perf record): without metrics, with the shared-memory rows shmdisagg uses, and
with the same updates made through prometheus-client's multiprocess mode (values in mmap'd files
under PROMETHEUS_MULTIPROC_DIR; labelled children resolved once, up front). The request itself is
a stub (`Exchange` built, policies called, sinks run), so the difference is the metrics alone.

`e2e`: the same deployment launched with `SHMDISAGG_METRICS=off` and on, alternately, `--rounds`
times each, each round a closed-loop `shmdisagg bench` against it; reports the orchestrator's CPU
ms per request (coordinator + fleet workers, from /proc; also split: the fleet workers, where
the request path runs, and the coordinator, which joins perf records off it) and latencies.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.benchkit import count  # noqa: E402

# -- micro -----------------------------------------------------------------------------------


class StubPolicy:
    name = "load_balancing"
    needs_tokens = False

    def __init__(self, slot: int) -> None:
        self.slot = slot

    def pick(self, key: Any, exclude_slot: int) -> int:
        return self.slot

    def release(self, slot: int, key: Any) -> None:
        pass


class PromRow:
    """A stand-in for a metrics row that turns every `row[i] += x` of `RequestMetrics` into the
    prometheus-client call for word i: counters `inc(x)`, a histogram's sum word `observe(x)`
    (its bucket words are no-ops: `observe` updates the bucket itself)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Histogram

        from shmdisagg.metrics.schema import COUNTERS, HISTOGRAMS, LAYOUT, MAX_SERVERS, OUTCOMES, PER_SERVER, ROLES

        self.ops: dict[int, Any] = {}
        for c in COUNTERS:
            self.ops[LAYOUT.counter[c.name]] = Counter(c.name, c.help).inc
        routing = Counter("shmdisagg_routing_decisions", "x", ["role", "router", "outcome"])
        for role in ROLES:
            for outcome in OUTCOMES:
                self.ops[LAYOUT.routing[(role, outcome)]] = routing.labels(role, "load_balancing", outcome).inc
        for c in PER_SERVER:
            fam = Counter(c.name, c.help, ["server"])
            for slot in range(MAX_SERVERS):
                self.ops[LAYOUT.per_server[c.name] + slot] = fam.labels(f"127.0.0.1:{8000 + slot}").inc
        for h in HISTOGRAMS:
            hist = Histogram(h.name, h.help, buckets=h.buckets)
            base = LAYOUT.hist[h.name]
            for i in range(len(h.buckets) + 1):
                self.ops[base + i] = _noop
            self.ops[base + len(h.buckets) + 1] = hist.observe
        self.ops[LAYOUT.pid] = _noop

    def __getitem__(self, i: int) -> float:
        return 0.0

    def __setitem__(self, i: int, value: float) -> None:
        self.ops[i](value)


def _noop(value: float) -> None:
    pass


def micro(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as prom_dir:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = prom_dir  # before prometheus_client is imported
        import uvloop

        from shmdisagg.metrics.request import NOTE, CountingPolicy, RequestMetrics
        from shmdisagg.metrics.rows import MetricsSegment, worker_row
        from shmdisagg.orchestrator.exchange import Exchange

        class Records:
            def __init__(self) -> None:
                self.items: list[Any] = []

            def add(self, r: Any) -> None:
                self.items.append(r)
                if len(self.items) > 4096:
                    self.items.clear()

        async def send(message: Any) -> None:
            pass

        def make_handle(ctx: Any, gen: Any, sinks: list[Any]) -> Any:
            async def handle(scope: Any, receive: Any, send_: Any, chat: bool) -> None:
                ex = Exchange(send, 1, True, arrival=time.time())
                ex.ctx_dispatch = time.time()
                ex.ctx_slot = ctx.pick(None, -1)
                ex.ctx_done = time.time()
                ex.prompt_tokens, ex.cached_tokens = 300, 128
                ex.gen_slot = gen.pick(None, -1)
                ex.first_token = time.time()
                ex.last_token = time.time()
                ex.status = 200
                for sink in sinks:
                    sink(ex)

            return handle

        async def timed(label: str, call: Any) -> float:
            for _ in range(2000):  # warm-up
                await call()
            n = args.requests
            t0 = time.process_time()
            for _ in range(n):
                await call()
            us = (time.process_time() - t0) / n * 1e6
            print(f"  {label:<48} {us:7.2f} us/request")
            return us

        prefix = f"shmdisagg-benchmetrics-{os.getpid()}"
        segment = MetricsSegment.create(prefix, 1)
        try:
            results: dict[str, float] = {}

            async def main() -> None:
                plain = make_handle(StubPolicy(0), StubPolicy(2), [])
                results["off"] = await timed("no metrics (SHMDISAGG_METRICS=off)", lambda: plain({}, None, send, False))
                for name, row in (("shm", segment.row(worker_row(0))), ("prometheus", PromRow())):
                    m = RequestMetrics(row, Records())  # type: ignore[arg-type]
                    h = make_handle(CountingPolicy(StubPolicy(0), False), CountingPolicy(StubPolicy(2), True), [m.sink])
                    label = "shared-memory rows (shmdisagg)" if name == "shm" else "prometheus-client multiprocess"
                    results[name] = await timed(label, lambda h=h, m=m: m.serve(h, {}, None, send, False))

            print(f"request-path metrics, {args.requests} stub requests each (CPU time):")
            uvloop.run(main())
            assert NOTE.get() is None
            for name in ("shm", "prometheus"):
                print(f"  metrics cost, {name:<11}: {results[name] - results['off']:6.2f} us/request")
            print(orjson.dumps({k: round(v, 3) for k, v in results.items()}).decode())
        finally:
            segment.close()
            segment.unlink()


# -- e2e ---------------------------------------------------------------------------------------


def e2e(args: argparse.Namespace) -> None:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for rnd in range(args.rounds):
        for mode in ("off", "on"):
            path = out_dir / f"{mode}-{rnd}.json"
            env = {**os.environ, "SHMDISAGG_METRICS": mode}
            cmd = [
                str(REPO / ".venv/bin/shmdisagg"),
                "bench",
                "--launch",
                "-c",
                args.config,
                "--no-progress",
                "--input-len",
                str(args.input_len),
                "--output-len",
                str(args.output_len),
                "--concurrency",
                str(args.concurrency),
                "--num-requests",
                str(args.num_requests),
                "--json",
                str(path),
            ]
            path.unlink(missing_ok=True)  # exit 1 is also a failed launch: never read an old run
            rc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO).returncode
            if rc not in (0, 1) or not path.exists():  # 1: some requests failed; they are counted in the JSON
                raise subprocess.CalledProcessError(rc, cmd)
            s = orjson.loads(path.read_bytes())
            if not s["requests"]["completed"]:
                raise SystemExit(f"bench_metrics: no request completed in {path}")
            per_pid = {int(k): v for k, v in s["cpu"]["per_pid_ms"].items()}
            coordinator = min(per_pid)  # started before its fleet workers
            done = s["requests"]["completed"]
            rows[mode].append(
                {
                    "cpu_ms": s["orchestrator_cpu_ms_per_request"],
                    "workers_cpu_ms": sum(v for p, v in per_pid.items() if p != coordinator) / done,
                    "coordinator_cpu_ms": per_pid[coordinator] / done,
                    "rps": s["throughput"]["request_throughput"],
                    "ttft_p50": s["ttft_ms"]["p50"],
                    "e2e_p50": s["e2e_ms"]["p50"],
                    "e2e_p99": s["e2e_ms"]["p99"],
                    "completed": s["requests"]["completed"],
                }
            )
            print(
                f"round {rnd + 1} metrics {mode:>3}: " + ", ".join(f"{k} {v:.3f}" for k, v in rows[mode][-1].items()),
                flush=True,
            )
    print("median over rounds:")
    for mode in ("off", "on"):
        med = {k: statistics.median(r[k] for r in rows[mode]) for k in rows[mode][0]}
        print(f"  metrics {mode:>3}: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("micro")
    p.add_argument("--requests", type=count, default=200_000)
    p.set_defaults(func=micro)
    p = sub.add_parser("e2e")
    p.add_argument("-c", "--config", default="examples/demo.yaml")
    p.add_argument("--rounds", type=count, default=3)
    p.add_argument("--concurrency", type=count, default=16)
    p.add_argument("--num-requests", type=count, default=600)
    p.add_argument("--input-len", type=count, default=512)
    p.add_argument("--output-len", type=count, default=32)
    p.add_argument("--out", default="runs/metrics-overhead")
    p.set_defaults(func=e2e)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
