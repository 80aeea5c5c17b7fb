"""Metric formulas on hand-made records; expected values are written out or computed with the
standard library, never with the code under test."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, strategies as st

from shmdisagg.bench.client import RequestRecord
from shmdisagg.bench.metrics import Slo, parse_slo, percentile, summarize


def rec(
    index: int,
    send: float,
    chunks: list[float],
    end: float,
    out: int,
    prompt: int,
    cached: int | None,
    error_kind: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        input_length=prompt,
        max_tokens=out,
        send=send,
        first_token=chunks[0] if chunks else None,
        chunk_times=chunks,
        end=end,
        status=200 if error_kind is None else 500,
        prompt_tokens=prompt if error_kind is None else None,
        output_tokens=out if error_kind is None else None,
        cached_tokens=cached,
        error_kind=error_kind,
    )


RECORDS = [
    rec(0, 0.00, [0.10, 0.12, 0.15, 0.19], 0.20, out=4, prompt=1000, cached=512),
    rec(1, 0.05, [0.35, 0.36], 0.40, out=2, prompt=2000, cached=0),
    rec(2, 0.10, [0.30], 0.30, out=1, prompt=500, cached=None),  # server did not report cached
    rec(3, 0.20, [], 0.21, out=0, prompt=700, cached=None, error_kind="http_500"),
    rec(4, 0.30, [0.32, 0.42, 0.52, 0.62, 0.72], 0.75, out=6, prompt=100, cached=100),
]
TTFT = [100.0, 300.0, 200.0, 20.0]
E2E = [200.0, 350.0, 200.0, 450.0]
TPOT = [(200 - 100) / 3, (350 - 300) / 1, (450 - 20) / 5]  # request 2 has one token: no TPOT
ITL = [20.0, 30.0, 40.0, 10.0, 100.0, 100.0, 100.0, 100.0]  # pooled over requests


def expected(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values),
        "min": min(values),
        "max": max(values),
        "p50": q[49],
        "p90": q[89],
        "p95": q[94],
        "p99": q[98],
    }


@pytest.mark.parametrize("key, values", [("ttft_ms", TTFT), ("e2e_ms", E2E), ("tpot_ms", TPOT), ("itl_ms", ITL)])
def test_latency_distributions_follow_the_vllm_definitions(key: str, values: list[float]) -> None:
    dist = summarize(RECORDS, duration_s=1.0)[key]
    assert dist["count"] == len(values)
    for stat, value in expected(values).items():
        assert dist[stat] == pytest.approx(value), stat


def test_throughputs_count_completed_requests_over_the_duration() -> None:
    s = summarize(RECORDS, duration_s=2.0)
    assert s["requests"] == {"sent": 5, "completed": 4, "failed": 1, "cancelled": 0, "without_usage": 0}
    thr = s["throughput"]
    assert thr["request_throughput"] == pytest.approx(4 / 2.0)
    assert thr["output_token_throughput"] == pytest.approx((4 + 2 + 1 + 6) / 2.0)
    assert thr["total_token_throughput"] == pytest.approx((1000 + 2000 + 500 + 100 + 13) / 2.0)


def test_hit_rate_is_cached_over_prompt_tokens_of_requests_that_report_it() -> None:
    s = summarize(RECORDS, duration_s=1.0)
    assert s["kv_cache_hit_rate"] == pytest.approx((512 + 0 + 100) / (1000 + 2000 + 100))
    # these records say no earlier request of the run shared their prompts (reusable_tokens 0),
    # so every cached token is one the cache held from before the run
    assert s["cache"] == {
        "prompt_tokens": 3100,
        "cached_tokens": 612,
        "requests_reporting": 3,
        "warm_requests": 2,
        "warm_cached_tokens": 612,
    }
    assert summarize(RECORDS[2:4], duration_s=1.0)["kv_cache_hit_rate"] is None


def test_only_hits_beyond_what_the_run_itself_sent_make_the_cache_warm() -> None:
    shared = [
        rec(0, 0.0, [0.1], 0.2, out=1, prompt=1000, cached=0),
        rec(1, 0.3, [0.4], 0.5, out=1, prompt=1000, cached=512),  # request 0 sent that block
        rec(2, 0.6, [0.7], 0.8, out=1, prompt=1000, cached=600),
    ]  # 88 tokens more than request 0 sent
    shared[1].reusable_tokens = shared[2].reusable_tokens = 512
    cache = summarize(shared, duration_s=1.0)["cache"]
    assert (cache["warm_requests"], cache["warm_cached_tokens"]) == (1, 88)


def test_goodput_counts_completed_requests_meeting_every_slo() -> None:
    # ttft <= 250 and tpot <= 60: requests 0 (100, 33.3) and 2 (200, one token) pass;
    # 1 fails TTFT (300), 4 fails TPOT (86), 3 failed outright.
    s = summarize(RECORDS, duration_s=4.0, slo=Slo(ttft_ms=250, tpot_ms=60))
    assert s["goodput_slo"] == {
        "limits_ms": {"ttft_ms": 250, "tpot_ms": 60},
        "good_requests": 2,
        "request_goodput": pytest.approx(2 / 4.0),
    }
    with_e2e = summarize(RECORDS, 4.0, Slo(ttft_ms=250, tpot_ms=60, e2e_ms=200))
    assert with_e2e["goodput_slo"]["good_requests"] == 2
    assert summarize(RECORDS, 4.0, Slo(e2e_ms=199))["goodput_slo"]["good_requests"] == 0
    assert summarize(RECORDS, 4.0)["goodput_slo"] is None


def test_errors_are_counted_by_kind() -> None:
    records = [
        *RECORDS,
        rec(5, 0.0, [], 0.1, 0, 10, None, error_kind="timeout"),
        rec(6, 0.0, [], 0.1, 0, 10, None, error_kind="http_500"),
    ]
    errors = summarize(records, 1.0)["errors"]
    assert errors["count"] == 3
    assert errors["kinds"] == {"http_500": 2, "timeout": 1}


def test_an_all_failed_run_has_empty_distributions_not_errors() -> None:
    s = summarize(RECORDS[3:4], duration_s=0.5)
    assert s["ttft_ms"]["count"] == 0 and s["ttft_ms"]["p99"] is None
    assert s["throughput"]["request_throughput"] == 0


def test_parse_slo_accepts_vllm_and_aiperf_names() -> None:
    assert parse_slo(["ttft:500", "tpot:50", "e2e:20000"]) == Slo(500, 50, 20000)
    assert parse_slo(["time_to_first_token:1", "inter_token_latency:2", "e2el:3"]) == Slo(1, 2, 3)
    assert not parse_slo([]).is_set
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_slo(bad)


@given(st.lists(st.floats(0, 1e6), min_size=2, max_size=50), st.integers(1, 99))
def test_percentile_matches_the_inclusive_method(values: list[float], q: int) -> None:
    got = percentile(sorted(values), q)
    assert got == pytest.approx(statistics.quantiles(values, n=100, method="inclusive")[q - 1], abs=1e-6)
