"""Presenting a finished run: the rich results table, the summary JSON and the records JSONL.

The summary JSON carries our keys (`ttft_ms`, `tpot_ms`, `itl_ms`, `e2e_ms`, `kv_cache_hit_rate`,
`orchestrator_cpu_ms_per_request`, `errors`, ...) and, beside them, AIPerf's
`profile_export_aiperf.json` names (`time_to_first_token: {unit, avg, p50, ...}`,
`inter_token_latency`, `request_throughput`, ...), so tools written for AIPerf can read it.
Formats only; computes no metric.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from shmdisagg.bench.client import RequestRecord

_STAT_KEYS = ("mean", "p50", "p90", "p95", "p99", "std", "min", "max")

# AIPerf name -> (our key, unit)
_AIPERF_DISTRIBUTIONS = {
    "time_to_first_token": ("ttft_ms", "ms"),
    "inter_token_latency": ("tpot_ms", "ms"),
    "inter_chunk_latency": ("itl_ms", "ms"),
    "request_latency": ("e2e_ms", "ms"),
    "input_sequence_length": ("input_tokens", "tokens"),
    "output_sequence_length": ("output_tokens", "tokens"),
}


def _aiperf_stats(dist: dict[str, Any], unit: str) -> dict[str, Any] | None:
    if not dist.get("count"):
        return None
    out: dict[str, Any] = {"unit": unit, "avg": dist["mean"]}
    out.update({k: dist[k] for k in _STAT_KEYS if k != "mean"})
    return out


def _scalar(value: float | int | None, unit: str) -> dict[str, Any] | None:
    return None if value is None else {"unit": unit, "avg": value}


def aiperf_view(summary: dict[str, Any]) -> dict[str, Any]:
    """The AIPerf-named keys for a summary produced by `metrics.summarize` (+ run info)."""
    thr = summary["throughput"]
    req = summary["requests"]
    goodput = summary.get("goodput_slo")
    examples = summary["errors"]["examples"]
    out: dict[str, Any] = {
        name: _aiperf_stats(summary[ours], unit) for name, (ours, unit) in _AIPERF_DISTRIBUTIONS.items()
    }
    out.update(
        request_throughput=_scalar(thr["request_throughput"], "requests/sec"),
        output_token_throughput=_scalar(thr["output_token_throughput"], "tokens/sec"),
        total_token_throughput=_scalar(thr["total_token_throughput"], "tokens/sec"),
        benchmark_duration=_scalar(summary["duration_s"], "sec"),
        request_count=_scalar(req["completed"], "requests"),
        error_request_count=_scalar(req["failed"], "requests") if req["failed"] else None,
        total_isl=_scalar(thr["total_input_tokens"], "tokens"),
        total_osl=_scalar(thr["total_output_tokens"], "tokens"),
        goodput=None if goodput is None else _scalar(goodput["request_goodput"], "requests/sec"),
        good_request_count=None if goodput is None else _scalar(goodput["good_requests"], "requests"),
        error_summary=[
            {"error_details": {"code": _code(kind), "type": kind, "message": examples.get(kind, "")}, "count": count}
            for kind, count in summary["errors"]["kinds"].items()
        ],
    )
    return out


def _reason(example: str) -> str:
    """An error example as a reader wants it: an OpenAI error body's message, else the text."""
    try:
        body = orjson.loads(example)
    except orjson.JSONDecodeError:
        return example
    if isinstance(body, dict):
        inner = body.get("error")
        message = inner.get("message") if isinstance(inner, dict) else body.get("message")
        if isinstance(message, str) and message:
            return message
    return example


def _code(kind: str) -> int | None:
    if kind.startswith("http_") and kind[5:].isdigit():
        return int(kind[5:])
    return None


def write_json(path: str | Path, summary: dict[str, Any]) -> None:
    Path(path).write_bytes(
        orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS | orjson.OPT_SORT_KEYS) + b"\n"
    )


def record_row(rec: RequestRecord, origin: float) -> dict[str, Any]:
    """One JSONL line: times in ms from `origin` (run start) or from the request's send."""

    def rel(t: float | None, base: float) -> float | None:
        return None if t is None else round((t - base) * 1000.0, 3)

    return {
        "index": rec.index,
        "scheduled_ms": rel(rec.scheduled, origin),
        "send_ms": rel(rec.send, origin),
        "ttft_ms": rel(rec.first_token, rec.send),
        "e2e_ms": rel(rec.end, rec.send),
        "chunk_ms": [rel(t, rec.send) for t in rec.chunk_times],
        "input_length": rec.input_length,
        "reusable_tokens": rec.reusable_tokens,
        "max_tokens": rec.max_tokens,
        "prompt_tokens": rec.prompt_tokens,
        "output_tokens": rec.output_tokens,
        "cached_tokens": rec.cached_tokens,
        "usage_missing": rec.usage_missing,
        "status": rec.status,
        "request_id": rec.request_id,
        "error_kind": rec.error_kind,
        "error": rec.error,
    }


def write_records(path: str | Path, records: Iterable[RequestRecord], origin: float) -> None:
    with open(path, "wb") as f:
        for rec in records:
            f.write(orjson.dumps(record_row(rec, origin)) + b"\n")


# --- the table ---------------------------------------------------------------------------


def _fmt(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def _ms(value: float | int | None) -> str:
    """A latency in ms, to 3-4 significant digits and at most 7 characters below 1,000 s."""
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 100 else f"{value:.2f}"


TABLE_COLUMNS = 80  # the table fits a default terminal (and rich's width when not a terminal)
_LATENCY = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))
_LATENCY_STATS = ("mean", "p50", "p90", "p99")


def _latency_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows: a header, then one row per metric, its columns aligned."""
    cells = [[_ms(summary[key][k]) for k in _LATENCY_STATS] for _, key in _LATENCY]
    width = max(len(c) for row in [list(_LATENCY_STATS), *cells] for c in row)

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(width) for c in row)

    return [("[cyan]Latency (ms)", line(_LATENCY_STATS))] + [
        (label, line(row)) for (label, _), row in zip(_LATENCY, cells, strict=True)
    ]


def warm_note(summary: dict[str, Any]) -> str | None:
    """One line when requests found their prompts cached from before the run, else None."""
    cache, req = summary["cache"], summary["requests"]
    if not cache.get("warm_requests"):
        return None
    config = summary.get("config") or {}
    earlier = (
        f"an earlier run with --seed {config['seed']}"
        if config.get("seed_given")
        else "an earlier run with the same --seed"
    )
    return (
        f"the KV cache was warm: {cache['warm_requests']:,} of {req['completed']:,} requests found "
        f"{cache['warm_cached_tokens']:,} prompt tokens cached that no earlier request of this run had sent "
        f"({earlier}, or other traffic with these prompts); their latencies are a warm cache's"
    )


def results_table(summary: dict[str, Any]) -> Table:
    """One two-column table in sections: requests, latency, throughput, cache, CPU; at most
    `TABLE_COLUMNS` wide for any run of up to 1,000 s latencies and 9-digit counts."""
    req, thr, cache, cpu = summary["requests"], summary["throughput"], summary["cache"], summary.get("cpu")
    config = summary.get("config") or {}
    interrupted = summary.get("was_cancelled")
    table = Table(
        title="shmdisagg bench (interrupted)" if interrupted else "shmdisagg bench",
        show_header=False,
        title_justify="left",
    )
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")

    table.add_row("[cyan]Requests", "")
    if req.get("cancelled") or interrupted:
        table.add_row(
            "sent / completed / failed / cancelled",
            f"{req['sent']:,} / {req['completed']:,} / {req['failed']:,} / {req.get('cancelled', 0):,}",
        )
    else:
        table.add_row("sent / completed / failed", f"{req['sent']:,} / {req['completed']:,} / {req['failed']:,}")
    if summary["errors"]["kinds"]:
        kinds = ", ".join(f"{k} x{n}" for k, n in summary["errors"]["kinds"].items())
        table.add_row("errors", kinds)
        for kind, example in summary["errors"].get("examples", {}).items():
            reason = _reason(example)
            if reason:  # the reason, not only the status (the rest is in --json / --records)
                table.add_row(f"  {kind}, e.g.", reason if len(reason) <= 120 else reason[:117] + "...")
    table.add_row("duration (s)", _fmt(summary["duration_s"]))
    lag = summary["send_lag_ms"]
    if lag["count"]:
        table.add_row("send lag p99 / max (ms)", f"{_fmt(lag['p99'])} / {_fmt(lag['max'])}")
    if config.get("seed") is not None:
        table.add_row("prompt seed", f"{config['seed']} ({'--seed' if config.get('seed_given') else 'fresh'})")

    table.add_section()
    for label, value in _latency_rows(summary):
        table.add_row(label, value)

    table.add_section()
    table.add_row("[cyan]Throughput", "")
    table.add_row("requests/s", _fmt(thr["request_throughput"], 3))
    table.add_row("output tokens/s", _fmt(thr["output_token_throughput"], 1))
    table.add_row("total tokens/s", _fmt(thr["total_token_throughput"], 1))
    table.add_row("input / output tokens", f"{thr['total_input_tokens']:,} / {thr['total_output_tokens']:,}")
    goodput = summary.get("goodput_slo")
    if goodput is not None:
        table.add_row("goodput req/s", f"{_fmt(goodput['request_goodput'], 3)} ({goodput['good_requests']:,} good)")
        table.add_row(
            "goodput SLO (ms)", " ".join(f"{k.removesuffix('_ms')}<={v:g}" for k, v in goodput["limits_ms"].items())
        )

    table.add_section()
    table.add_row("[cyan]Cache", "")
    rate = summary["kv_cache_hit_rate"]
    table.add_row("KV cache hit rate", "-" if rate is None else f"{rate:.1%}")
    table.add_row("cached / prompt tokens", f"{cache['cached_tokens']:,} / {cache['prompt_tokens']:,}")
    if cache.get("warm_requests") is not None and cache["requests_reporting"]:
        warm = cache["warm_requests"]
        table.add_row(
            "warm from before the run",
            f"[bold yellow]yes: {warm:,} req, {cache['warm_cached_tokens']:,} tok" if warm else "no",
        )

    table.add_section()
    table.add_row("[cyan]CPU", "")
    if cpu is None or not cpu.get("pids"):
        table.add_row("orchestrator CPU ms/request", "- (no pids)")
    else:
        table.add_row(
            f"orchestrator CPU ms/request ({len(cpu['pids'])} pids)", _fmt(summary["orchestrator_cpu_ms_per_request"])
        )
        table.add_row("orchestrator CPU total (ms)", _fmt(cpu["total_ms"], 0))
        if cpu["vanished_pids"]:
            table.add_row("vanished pids (not counted)", ", ".join(map(str, cpu["vanished_pids"])))
    if cpu is not None:
        table.add_row("client CPU ms/request", _fmt(cpu.get("client_ms_per_request")))
    return table


def print_table(summary: dict[str, Any], console: Console | None = None) -> None:
    (console or Console()).print(results_table(summary))
