"""`shmdisagg bench` options and the run that ties the parts together.

`add_arguments` declares the options; `run(args)` benchmarks an already-running server at
`args.url` and returns the summary dict (also printed, and written with `--json`); `run_cli(args)`
runs it under uvloop and turns failures into exit statuses; `main(argv)` parses and calls
`run_cli`. Only these last two turn exceptions into statuses; `run` raises `BenchError` for
anything the user must fix. Exit status: 0 all requests completed, 1 any failed (the summary is
still printed and written), 2 bad usage or unreachable server, 128 + the signal's number when
stopped by a signal: 130 for SIGINT (Ctrl-C), 143 for SIGTERM (`kill`, `timeout`). The first
SIGINT or SIGTERM cancels the requests in flight and still reports (`was_cancelled: true`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
import os
import resource
import secrets
import signal
import sys
import threading
import urllib.parse
from collections.abc import Callable, Coroutine, Sequence
from datetime import UTC, datetime
from typing import Any

import aiohttp
import uvloop

from shmdisagg.bench import BenchError, OutputError, procstat
from shmdisagg.bench.client import Client, RequestRecord, cluster_pids, first_model
from shmdisagg.bench.load import LoadCounters, LoadInterrupted, closed_loop, jobs, open_loop
from shmdisagg.bench.metrics import Slo, parse_slo, summarize
from shmdisagg.bench.plot import Plots, load_runs, plot_runs
from shmdisagg.bench.progress import progress_for
from shmdisagg.bench.report import aiperf_view, print_table, warm_note, write_json, write_records
from shmdisagg.bench.timeline import LoadSampler, timeline
from shmdisagg.bench.trace import (
    DEFAULT_VOCAB,
    SHIPPED_TRACE,
    PromptSynthesizer,
    TraceRequest,
    load_trace,
    synthetic_requests,
)
from shmdisagg.procutil import STOP_SIGNALS, unwritable

SCHEMA = "shmdisagg.bench/1"
SYNTHETIC_OUTPUT_LEN = 128  # --output-len unset, with --input-len
# Synthetic prompts are built in this process: their block ids for the whole run up front, each
# prompt's tokens when it is sent. Past these a run only exhausts memory (--input-len 1e11 took
# 16 GiB before it sent anything). 4M tokens is past any model's context window.
MAX_INPUT_LEN = 1 << 22
MAX_SYNTHETIC_TOKENS = 1 << 31
DEFAULT_URL = "http://127.0.0.1:8000"
# The slowest replay: 1000x the trace's own pace. Far smaller divisors scale the arrival times
# past any run's length (1e-300 made them ~1e300 s: the replay never sent its second request).
MIN_SPEEDUP = 1e-3


def _server_url(text: str) -> str:
    """--url's type: the server's base URL, http(s)://host[:port][/path]. An OpenAI client's base
    URL (ending in /v1, maybe with a slash) names the same server: the paths sent add /v1 themselves."""
    parts = urllib.parse.urlsplit(text)
    try:
        port_ok = parts.port is None or parts.port > 0  # .port raises for a non-number or one past 65535
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"needs http://host:port (e.g. {DEFAULT_URL}), not {text!r}")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/').removesuffix('/v1')}"


def _speedup(text: str) -> float:
    """--speedup's type: a finite divisor of the trace's timestamps, at least `MIN_SPEEDUP`."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= MIN_SPEEDUP):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least {MIN_SPEEDUP:g}, not {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench options, for `shmdisagg bench` or any parser that wants them."""
    target = parser.add_argument_group("target")
    target.add_argument(
        "--url",
        type=_server_url,
        help=f"server base URL, http://host:port (default: {DEFAULT_URL}); an OpenAI client's base URL, "
        "ending in /v1, names the same server",
    )
    target.add_argument("--model", help="model name to send (default: first id from GET /v1/models)")
    target.add_argument(
        "--timeout", type=float, default=600.0, help="per-request timeout in seconds (default: %(default)s)"
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--trace",
        metavar="PATH",
        help="Mooncake JSONL trace (default: the shipped 300-request conversation slice, unless --input-len is given)",
    )
    load.add_argument(
        "--num-requests",
        type=int,
        metavar="N",
        help="send the first N requests of the trace (synthetic: default 10 x concurrency)",
    )
    load.add_argument(
        "--speedup",
        type=_speedup,
        default=1.0,
        help=f"open loop: divide trace timestamps by this; at least {MIN_SPEEDUP:g}, 1000x slower than the "
        "trace (default: %(default)s)",
    )
    load.add_argument(
        "--concurrency",
        type=int,
        metavar="C",
        help="closed loop with C requests always in flight (ignores timestamps); "
        "without it the trace is replayed open-loop at its arrival times",
    )
    load.add_argument(
        "--input-len",
        type=int,
        metavar="TOKENS",
        help="closed loop with synthetic prompts of this many tokens (needs --concurrency)",
    )
    load.add_argument(
        "--output-len",
        type=int,
        metavar="TOKENS",
        help=f"output tokens per synthetic request, with --input-len (default: {SYNTHETIC_OUTPUT_LEN})",
    )
    load.add_argument("--max-output-tokens", type=int, metavar="TOKENS", help="cap every request's max_tokens at this")
    load.add_argument(
        "--seed",
        type=int,
        help="prompt synthesis seed (default: a fresh one per run, so a run never finds "
        "an earlier run's prompts cached; the summary records it: give it again to send the same prompts)",
    )
    load.add_argument(
        "--vocab-range",
        type=int,
        nargs=2,
        default=list(DEFAULT_VOCAB),
        metavar=("LOW", "HIGH"),
        help="token ids are drawn from [LOW, HIGH) (default: %(default)s)",
    )

    out = parser.add_argument_group("output")
    out.add_argument(
        "--goodput", nargs="+", metavar="METRIC:MS", help="SLOs for goodput, e.g. --goodput ttft:2000 tpot:50 e2e:30000"
    )
    out.add_argument(
        "--cpu-pids",
        nargs="+",
        metavar="PID",
        help="pids whose CPU time to charge to the orchestrator (comma or space "
        "separated; default: from GET <url>/cluster_info)",
    )
    out.add_argument("--json", metavar="PATH", help="write the summary JSON here")
    out.add_argument("--records", metavar="PATH", help="write one JSON line per request here")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    plots = parser.add_argument_group("plots")
    plots.add_argument(
        "--plot",
        metavar="DIR",
        help="write PNG plots to DIR (TTFT/E2E CDFs, throughput, hit rate and per-server "
        "load over time); also samples the servers' load into the --json timeline",
    )
    plots.add_argument(
        "--compare",
        nargs="+",
        metavar="RUN_JSON",
        default=[],
        help="earlier runs' --json summaries to draw beside this one (every --json summary "
        "records its timeline; the per-server load panel needs runs made with --plot)",
    )
    plots.add_argument(
        "--plot-only", action="store_true", help="send no load: just draw the --compare runs into --plot DIR"
    )
    plots.add_argument("--label", help="this run's name in the plots (default: the --json file name, else 'run')")


def workload(args: argparse.Namespace) -> tuple[list[TraceRequest], str]:
    """The requests to send and the source's description. Raises BenchError for a bad option
    or trace (`bench --launch` calls it before it starts anything)."""
    if not math.isfinite(args.timeout) or args.timeout <= 0:  # --speedup is checked at parsing (`_speedup`)
        raise BenchError(f"--timeout must be a finite number > 0, not {args.timeout}")
    for option in ("json", "records", "plot"):
        problem = unwritable(getattr(args, option, None), directory=option == "plot")
        if problem:
            raise BenchError(f"--{option} {getattr(args, option)}: {problem}")
    if args.num_requests is not None and args.num_requests < 1:
        raise BenchError("--num-requests must be >= 1")
    if args.concurrency is not None and args.concurrency < 1:
        raise BenchError("--concurrency must be >= 1")
    if args.max_output_tokens is not None and args.max_output_tokens < 1:
        raise BenchError("--max-output-tokens must be >= 1")
    if args.input_len is not None:
        if args.trace:
            raise BenchError("--input-len and --trace are alternatives; give one")
        if args.concurrency is None:
            raise BenchError("synthetic prompts (--input-len) need --concurrency")
        output_len = SYNTHETIC_OUTPUT_LEN if args.output_len is None else args.output_len
        if args.input_len < 1 or output_len < 1:
            raise BenchError("--input-len and --output-len must be >= 1")
        if args.input_len > MAX_INPUT_LEN:
            raise BenchError(f"--input-len {args.input_len:,}: at most {MAX_INPUT_LEN:,} tokens a prompt")
        count = args.num_requests or 10 * args.concurrency
        if count * args.input_len > MAX_SYNTHETIC_TOKENS:
            raise BenchError(
                f"{count:,} requests of {args.input_len:,} tokens: more than the {MAX_SYNTHETIC_TOKENS:,} "
                "prompt tokens one run builds (lower --num-requests or --input-len)"
            )
        return synthetic_requests(count, args.input_len, output_len), "synthetic"
    if args.output_len is not None:
        raise BenchError(
            "--output-len sets synthetic prompts' outputs (with --input-len); "
            "a trace's requests keep their own (cap them with --max-output-tokens)"
        )
    path = args.trace or SHIPPED_TRACE
    try:
        requests = load_trace(path, args.num_requests)
    except OSError as exc:
        raise BenchError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    if not requests:
        raise BenchError(f"trace {path} holds no requests")
    if args.num_requests is not None and len(requests) < args.num_requests:
        print(
            f"shmdisagg bench: the trace holds {len(requests):,} requests, fewer than --num-requests "
            f"{args.num_requests:,}: sending those {len(requests):,}",
            file=sys.stderr,
        )
    return requests, str(path)


def _parse_pids(items: Sequence[str]) -> list[int]:
    try:
        return sorted({int(p) for item in items for p in item.split(",") if p.strip()})
    except ValueError:
        raise BenchError(f"--cpu-pids takes integers, got {' '.join(items)!r}") from None


def _self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run(args: argparse.Namespace, stop: asyncio.Event | None = None) -> dict[str, Any]:
    """Benchmark the server at `args.url`; print the table, write `--json`/`--records`, and
    return the summary. Setting `stop` ends the run early: requests in flight are cancelled and
    the summary covers the finished ones (`was_cancelled: true`)."""
    args.url = args.url or DEFAULT_URL  # None unless given: --launch refuses one (it benches its own)
    compare = load_runs(args.compare) if getattr(args, "compare", None) else []
    slo = _slo(args.goodput or [])
    requests, source = workload(args)
    low, high = args.vocab_range
    # A fresh seed by default: the same prompts again would find the previous run's KV blocks
    # still cached in a long-running deployment and measure a warm cache (a fresh --launch
    # deployment is cold either way); the seed is in the summary for an exact re-run.
    seed = args.seed if args.seed is not None else secrets.randbits(32)
    try:
        synth = PromptSynthesizer(seed=seed, vocab=(low, high))
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    closed = args.concurrency is not None

    counters = LoadCounters(total=len(requests))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model = args.model or await first_model(session, args.url)
        pid_source: str | None = None
        if args.cpu_pids:
            pids, pid_source = _parse_pids(args.cpu_pids), "--cpu-pids"
        else:
            pids = await cluster_pids(session, args.url) or []
            pid_source = "cluster_info" if pids else None
        client = Client(session, args.url, args.timeout)
        work = jobs(requests, synth, model, args.speedup, args.max_output_tokens)

        before = procstat.sample(pids)
        client_cpu0 = _self_cpu_s()
        start_time = datetime.now(UTC)
        sampler = LoadSampler(session, args.url) if getattr(args, "plot", None) else None
        if sampler is not None:
            sampler.start()
        try:
            async with progress_for(counters, not args.no_progress):
                load = (
                    # never more request loops than requests (--concurrency 1e9 was a task each)
                    closed_loop(work, client.send, min(args.concurrency, len(requests)), counters)
                    if closed
                    else open_loop(work, client.send, counters)
                )
                records, interrupted = await _drive(load, stop)
        finally:
            if sampler is not None:
                await sampler.stop()
        client_cpu_s = _self_cpu_s() - client_cpu0
        end_time = datetime.now(UTC)
        after = procstat.sample(pids)
        if pid_source == "cluster_info":  # processes respawned during the run count in full
            now = await cluster_pids(session, args.url) or []
            after.update(procstat.sample(set(now) - set(pids)))

    # Open loop: the schedule's start; closed loop: the first send.
    origin = min((r.send if r.scheduled is None else r.scheduled for r in records), default=0.0)
    duration = max((r.end or r.send for r in records), default=origin) - origin
    summary: dict[str, Any] = {"schema": SCHEMA}
    summary.update(summarize(records, duration, slo, cancelled=counters.sent - len(records)))
    summary["cpu"] = _cpu_summary(procstat.usage_between(before, after, pids), pid_source, client_cpu_s, counters.sent)
    completed = summary["requests"]["completed"]
    orchestrator_ms = summary["cpu"]["total_ms"] if summary["cpu"]["pids"] else None
    summary["orchestrator_cpu_ms_per_request"] = (
        orchestrator_ms / completed if orchestrator_ms is not None and completed else None
    )
    summary.update(aiperf_view(summary))
    summary.update(
        start_time=start_time.isoformat(),
        end_time=end_time.isoformat(),
        was_cancelled=interrupted,
        config={
            "url": args.url,
            "model": model,
            "mode": "closed_loop" if closed else "open_loop",
            "source": source,
            "num_requests": len(requests),
            "concurrency": args.concurrency,
            "speedup": None if closed else args.speedup,
            "max_output_tokens": args.max_output_tokens,
            "seed": seed,
            "seed_given": args.seed is not None,
            "vocab_range": [low, high],
            "timeout_s": args.timeout,
        },
    )
    # Every summary carries its timeline, so any --json run can be drawn later (--compare); the
    # per-server load in it is sampled only with --plot (it scrapes /metrics during the run).
    summary["label"] = getattr(args, "label", None) or (
        os.path.splitext(os.path.basename(args.json))[0] if args.json else "run"
    )
    summary["timeline"] = timeline(records, origin, sampler)
    print_table(summary)
    note = warm_note(summary)
    if note:
        print(f"shmdisagg bench: {note}", file=sys.stderr)
    failed = _write_outputs(args, summary, records, origin, compare)
    if failed:
        raise OutputError("could not write " + "; ".join(failed))
    return summary


def _write_outputs(
    args: argparse.Namespace,
    summary: dict[str, Any],
    records: list[RequestRecord],
    origin: float,
    compare: list[tuple[str, dict[str, Any]]],
) -> list[str]:
    """Write --json, --records and --plot; what failed, one "option: why (path)" each. Their
    paths were checked before the run (`procutil.unwritable`), but a disk can fill or a folder vanish."""
    steps: list[tuple[str, Callable[[], object]]] = []
    if args.json:
        steps.append(("--json", functools.partial(write_json, args.json, summary)))
    if args.records:
        steps.append(("--records", functools.partial(write_records, args.records, records, origin)))
    if getattr(args, "plot", None):
        steps.append(("--plot", functools.partial(_plot, args, summary, compare)))
    failed = []
    for option, write in steps:
        try:
            write()
        except OSError as exc:
            where = f" ({exc.filename})" if exc.filename else ""
            failed.append(f"{option}: {exc.strerror or exc}{where}")
    return failed


def _plot(args: argparse.Namespace, summary: dict[str, Any], compare: list[tuple[str, dict[str, Any]]]) -> None:
    _report_plots(plot_runs([(summary["label"], summary), *compare], args.plot))


def plot_only(args: argparse.Namespace) -> list[str]:
    """`--plot-only`: draw the `--compare` runs into `--plot DIR`; returns the files."""
    if not args.plot or not args.compare:
        raise BenchError("--plot-only needs --plot DIR and --compare RUN_JSON [RUN_JSON ...]")
    problem = unwritable(args.plot, directory=True)  # as a run checks it (`workload`)
    if problem:
        raise BenchError(f"--plot {args.plot}: {problem}")
    plots = plot_runs(load_runs(args.compare), args.plot)
    _report_plots(plots)
    return [str(f) for f in plots.files]


def _report_plots(plots: Plots) -> None:
    print(f"plots: {', '.join(str(f) for f in plots.files)}", file=sys.stderr)
    for line in plots.not_drawn:
        print(f"plots: {line}", file=sys.stderr)


async def _drive(
    load: Coroutine[Any, Any, list[RequestRecord]], stop: asyncio.Event | None
) -> tuple[list[RequestRecord], bool]:
    """Run the load to the end, or until `stop` is set: (finished records, interrupted?).

    Cancelling the caller still cancels it: only `stop` turns into a partial result."""
    task = asyncio.ensure_future(load)
    waiter = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        if waiter is not None:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
        return await task, False
    except LoadInterrupted as exc:
        me = asyncio.current_task()
        if me is not None and me.cancelling():
            raise asyncio.CancelledError from None
        return exc.records, True
    finally:
        if waiter is not None:
            waiter.cancel()
        if not task.done():  # the caller was cancelled while waiting
            task.cancel()
            with contextlib.suppress(LoadInterrupted, asyncio.CancelledError):
                await task


def _cpu_summary(usage: procstat.CpuUsage, pid_source: str | None, client_cpu_s: float, sent: int) -> dict[str, Any]:
    return {
        "pid_source": pid_source,
        "pids": sorted(usage.per_pid_ms.keys() | set(usage.vanished)),
        "total_ms": usage.total_ms,
        "per_pid_ms": usage.per_pid_ms,
        "vanished_pids": usage.vanished,
        "appeared_pids": usage.appeared,
        "unreadable_pids": usage.unreadable,
        "client_ms": client_cpu_s * 1000.0,
        "client_ms_per_request": client_cpu_s * 1000.0 / sent if sent else None,
        "client_pid": os.getpid(),
    }


def _slo(items: Sequence[str]) -> Slo:
    try:
        return parse_slo(items)
    except ValueError as exc:
        raise BenchError(str(exc)) from None


# The signals that stop a run and still report it; the exit status is 128 + the number.


def interrupted_status(signum: int | None) -> int:
    """The shell's convention for a process ended by `signum`: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum if signum is not None else signal.SIGINT)


def exit_status(summary: dict[str, Any], signum: int | None = None) -> int:
    """128 + the signal for an interrupted run (130 SIGINT, the default; 143 SIGTERM), 1 when any
    request failed or none completed, else 0."""
    if summary.get("was_cancelled"):
        return interrupted_status(signum)
    req = summary["requests"]
    return 1 if req["failed"] or not req["completed"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 when every request completed, 1 when any failed (or none was sent), 2 on a
    usage error, 130 when interrupted by Ctrl-C, 143 by SIGTERM (the first signal stops the run
    and still reports; a second one quits at once)."""
    parser = argparse.ArgumentParser(
        prog="shmdisagg bench",
        description="Replay a Mooncake trace (or a fixed-concurrency load) against an "
        "OpenAI-compatible server and report latency, throughput, KV-cache hits and CPU.",
    )
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


def run_cli(args: argparse.Namespace) -> int:
    """`main` after parsing, for a parser that took `add_arguments` (the `shmdisagg bench`
    subcommand): runs `run` under uvloop; the first SIGINT or SIGTERM stops the run and still
    reports; returns the status."""
    signals: list[int] = []  # the stop signals received, in order
    try:
        if getattr(args, "plot_only", False):
            plot_only(args)
            return 0
        summary = uvloop.run(_main(args, signals))
    except BenchError as exc:
        print(f"shmdisagg bench: error: {exc}", file=sys.stderr)
        return 2
    except OutputError as exc:
        print(f"shmdisagg bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shmdisagg bench: interrupted", file=sys.stderr)
        return interrupted_status(signals[-1] if signals else None)
    req = summary["requests"]
    if summary.get("was_cancelled"):
        print(
            f"shmdisagg bench: interrupted: {req['sent']:,} of {summary['config']['num_requests']:,} "
            f"requests sent, {req['cancelled']:,} cancelled in flight",
            file=sys.stderr,
        )
    elif req["failed"]:
        print(f"shmdisagg bench: {req['failed']:,} of {req['sent']:,} requests failed", file=sys.stderr)
    return exit_status(summary, signals[0] if signals else None)


async def _main(args: argparse.Namespace, signals: list[int] | None = None) -> dict[str, Any]:
    """`run(args)`, stopped early by the first SIGINT or SIGTERM (appended to `signals`); a
    second one raises KeyboardInterrupt. The process's handlers are restored on return."""
    signals = signals if signals is not None else []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if threading.current_thread() is not threading.main_thread():
        return await run(args)  # signal handlers can only be set from the main thread

    def second_signal(signum: int, frame: object) -> None:
        signals.append(signum)
        raise KeyboardInterrupt

    def first_signal(signum: int) -> None:
        signals.append(signum)
        what = "interrupted" if signum == signal.SIGINT else f"{signal.Signals(signum).name} received"
        print(f"shmdisagg bench: {what}; cancelling requests in flight (Ctrl-C again to quit at once)", file=sys.stderr)
        stop.set()
        for s in STOP_SIGNALS:  # the next one quits at once, through the callers' clean-up
            loop.remove_signal_handler(s)
            signal.signal(s, second_signal)

    old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        loop.add_signal_handler(s, first_signal, s)
    try:
        return await run(args, stop)
    finally:
        for s in STOP_SIGNALS:
            loop.remove_signal_handler(s)
            signal.signal(s, old[s])
