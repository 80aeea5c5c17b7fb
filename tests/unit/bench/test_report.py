from __future__ import annotations

import asyncio
import io

import pytest
from rich.console import Console

from shmdisagg.bench.client import RequestRecord
from shmdisagg.bench.load import LoadCounters
from shmdisagg.bench.metrics import Slo, summarize
from shmdisagg.bench.progress import LiveProgress, NullProgress, progress_for
from shmdisagg.bench.report import aiperf_view, record_row, results_table


def done(index: int, send: float, chunks: list[float], end: float) -> RequestRecord:
    return RequestRecord(
        index=index,
        input_length=100,
        max_tokens=len(chunks),
        send=send,
        first_token=chunks[0],
        chunk_times=chunks,
        end=end,
        status=200,
        prompt_tokens=100,
        output_tokens=len(chunks),
        cached_tokens=50,
    )


RECORDS = [
    done(0, 0.0, [0.1, 0.2, 0.3], 0.3),
    done(1, 0.1, [0.15, 0.25], 0.3),
    RequestRecord(
        index=2,
        input_length=100,
        max_tokens=3,
        send=0.2,
        end=0.25,
        status=503,
        error_kind="http_503",
        error="overloaded",
    ),
]


def test_aiperf_view_uses_aiperf_names_and_units() -> None:
    summary = summarize(RECORDS, 1.0, Slo(ttft_ms=80))
    view = aiperf_view(summary)
    assert view["time_to_first_token"] == {
        "unit": "ms",
        "avg": summary["ttft_ms"]["mean"],
        "p50": summary["ttft_ms"]["p50"],
        "p90": summary["ttft_ms"]["p90"],
        "p95": summary["ttft_ms"]["p95"],
        "p99": summary["ttft_ms"]["p99"],
        "std": summary["ttft_ms"]["std"],
        "min": summary["ttft_ms"]["min"],
        "max": summary["ttft_ms"]["max"],
    }
    assert view["inter_token_latency"]["avg"] == summary["tpot_ms"]["mean"]
    assert view["inter_chunk_latency"]["avg"] == summary["itl_ms"]["mean"]
    assert view["request_latency"]["max"] == summary["e2e_ms"]["max"]
    assert view["request_throughput"] == {"unit": "requests/sec", "avg": 2.0}
    assert view["output_token_throughput"] == {"unit": "tokens/sec", "avg": 5.0}
    assert view["benchmark_duration"] == {"unit": "sec", "avg": 1.0}
    assert view["goodput"] == {"unit": "requests/sec", "avg": 1.0}  # only request 1 (TTFT 50 ms)
    assert view["good_request_count"] == {"unit": "requests", "avg": 1}
    assert view["error_summary"] == [
        {"error_details": {"code": 503, "type": "http_503", "message": "overloaded"}, "count": 1}
    ]


def test_record_rows_are_relative_to_the_run_and_to_the_send() -> None:
    row = record_row(RECORDS[1], origin=0.05)
    assert row["send_ms"] == 50.0 and row["ttft_ms"] == 50.0 and row["e2e_ms"] == 200.0
    assert row["chunk_ms"] == [50.0, 150.0]
    assert row["scheduled_ms"] is None


def test_table_names_the_error_kinds_and_lacking_pids() -> None:
    console = Console(file=io.StringIO(), width=120)
    summary = {**summarize(RECORDS, 1.0), "cpu": None, "orchestrator_cpu_ms_per_request": None}
    console.print(results_table(summary))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "http_503 x1" in text and "- (no pids)" in text and "50.0%" in text


def test_progress_bar_draws_counts_and_the_null_one_draws_nothing() -> None:
    counters = LoadCounters(total=4, sent=3, finished=2, errors=1)
    out = io.StringIO()

    async def show() -> None:
        async with LiveProgress(counters, Console(file=out, force_terminal=True, width=100)):
            await asyncio.sleep(0)

    asyncio.run(show())
    assert "2/4" in out.getvalue() and "sent 3" in out.getvalue() and "errors 1" in out.getvalue()
    assert type(progress_for(counters, enabled=False)) is NullProgress


def test_the_table_fits_80_columns_for_a_long_interrupted_run_with_every_row() -> None:
    """Before: latencies in the thousands of ms wrapped the TTFT and E2E rows (scripts/demo.sh's
    own output on an 80-column terminal)."""
    from rich.measure import Measurement

    from shmdisagg.bench.report import TABLE_COLUMNS

    def slow(index: int) -> RequestRecord:  # 15 s to the first token, 999 s to the end
        send = index * 0.1
        chunks = [send + 15.0 + k * 1.5 for k in range(600)]
        return RequestRecord(
            index=index,
            input_length=120_000,
            max_tokens=600,
            send=send,
            first_token=chunks[0],
            chunk_times=chunks,
            end=send + 999.0,
            status=200,
            prompt_tokens=120_000,
            output_tokens=600,
            cached_tokens=100_000,
            reusable_tokens=0,
            scheduled=send - 0.5,
        )

    records = [slow(i) for i in range(2000)] + [
        RequestRecord(
            index=2000, input_length=10, max_tokens=1, send=1.0, end=2.0, status=503, error_kind="http_503", error="x"
        ),
        RequestRecord(
            index=2001, input_length=10, max_tokens=1, send=1.0, end=2.0, error_kind="incomplete_stream", error="y"
        ),
    ]
    summary = {
        **summarize(records, 1234.5, Slo(ttft_ms=2000, tpot_ms=50, e2e_ms=30000), cancelled=17),
        "was_cancelled": True,
        "config": {"seed": 4_294_967_295, "seed_given": False},
        "cpu": {"pids": list(range(12)), "total_ms": 1.0e7, "vanished_pids": [4_194_304], "client_ms_per_request": 1.5},
        "orchestrator_cpu_ms_per_request": 26.6,
    }
    assert summary["e2e_ms"]["p99"] == pytest.approx(999_000.0) and summary["cache"]["warm_requests"] == 2000
    console = Console(file=io.StringIO(), width=200)
    table = results_table(summary)
    assert Measurement.get(console, console.options, table).maximum <= TABLE_COLUMNS == 80
    console = Console(file=io.StringIO(), width=80)
    console.print(table)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    e2e = next(line for line in text.splitlines() if line.startswith("│ E2E"))
    assert e2e.split("│")[2].split() == ["999,000"] * 4  # one line: mean, p50, p90, p99
    assert "yes: 2,000 req, 200,000,000 tok" in text and "4294967295 (fresh)" in text
