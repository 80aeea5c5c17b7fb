"""Request-path counting: what one request adds to the worker's row, for every way it ends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shmdisagg.metrics.request import NOTE, RECORD_FIELDS, CountingAdmission, CountingPolicy, RequestMetrics
from shmdisagg.metrics.schema import LAYOUT
from shmdisagg.orchestrator.exchange import Exchange

C = LAYOUT.counter


class FakePolicy:
    name = "round_robin"
    needs_tokens = False

    def __init__(self, slots: list[int]) -> None:
        self.slots = list(slots)
        self.released: list[int] = []

    def pick(self, key: Any, exclude_slot: int) -> int:
        return self.slots.pop(0)

    def release(self, slot: int, key: Any) -> None:
        self.released.append(slot)


class Records:
    def __init__(self) -> None:
        self.items: list[tuple[Any, ...]] = []

    def add(self, record: tuple[Any, ...]) -> None:
        self.items.append(record)


def new_row() -> memoryview:
    return memoryview(bytearray(8 * LAYOUT.words)).cast("d")


def hist_count(row: memoryview, name: str) -> float:
    base = LAYOUT.hist[name]
    return sum(row[base : base + len(LAYOUT.bounds[name]) + 1].tolist())


def hist_sum(row: memoryview, name: str) -> float:
    return row[LAYOUT.hist[name] + len(LAYOUT.bounds[name]) + 1]


async def _noop_send(message: Any) -> None:
    pass


def run_one(metrics: RequestMetrics, handle: Any) -> None:
    asyncio.run(metrics.serve(handle, {}, None, _noop_send, False))  # type: ignore[arg-type]


def disagg_handle(
    metrics: RequestMetrics,
    ctx: CountingPolicy,
    gen: CountingPolicy,
    *,
    ctx_picks: int = 1,
    code: str = "",
    stream: bool = False,
    status: int = 200,
) -> Any:
    """A context-first request: arrival 100.0, context 100.001-100.021, generation picked at
    100.0215, first token 100.05, last 100.25 (wall-clock seconds)."""

    async def handle(scope: Any, receive: Any, send: Any, chat: bool) -> None:
        ex = Exchange(send, 1234, stream, arrival=100.0)
        ex.ctx_dispatch = 100.001
        for _ in range(ctx_picks):
            ex.ctx_slot = ctx.pick(None, -1)
        ex.ctx_done = 100.021
        ex.prompt_tokens, ex.cached_tokens = 300, 128
        ex.gen_slot = gen.pick(None, -1)
        NOTE.get().gen_dispatch = 100.0215  # type: ignore[union-attr]
        ex.first_token, ex.last_token = 100.05, 100.25
        ex.status, ex.error_code = status, code
        metrics.sink(ex)

    return handle


def test_a_completed_disaggregated_request_counts_every_leg_and_latency() -> None:
    row, records = new_row(), Records()
    m = RequestMetrics(row, records)
    ctx, gen = CountingPolicy(FakePolicy([0]), False), CountingPolicy(FakePolicy([2]), True)
    run_one(m, disagg_handle(m, ctx, gen))
    for name in (
        "total_requests",
        "nonstream_requests",
        "total_responses",
        "ctx_total_requests",
        "ctx_completed_requests",
        "gen_total_requests",
        "gen_completed_requests",
    ):
        assert row[C[name]] == 1, name
    for name in (
        "stream_requests",
        "validation_exceptions",
        "http_exceptions",
        "internal_errors",
        "ctx_error_requests",
        "gen_error_requests",
        "ctx_retry_requests",
        "shmdisagg_admission_rejections",
    ):
        assert row[C[name]] == 0, name
    assert row[LAYOUT.routing[("context", "routed")]] == 1 and row[LAYOUT.routing[("generation", "routed")]] == 1
    assert hist_sum(row, "queue_latency_seconds") == pytest.approx(0.001)
    assert hist_sum(row, "ctx_complete_latency_seconds") == pytest.approx(0.020)
    assert hist_sum(row, "gen_first_token_latency_seconds") == pytest.approx(0.0285)
    assert hist_sum(row, "gen_complete_latency_seconds") == pytest.approx(0.2285)
    assert hist_sum(row, "shmdisagg_time_to_first_token_seconds") == pytest.approx(0.05)
    assert hist_sum(row, "shmdisagg_e2e_request_latency_seconds") == pytest.approx(0.25)
    # the worker's own time: before the context dispatch and between context answer and generation pick
    assert hist_sum(row, "shmdisagg_orchestrator_overhead_seconds") == pytest.approx(0.001 + 0.0005)
    assert hist_count(row, "shmdisagg_orchestrator_overhead_seconds") == 1
    assert row[LAYOUT.per_server["shmdisagg_server_prompt_tokens"] + 0] == 300
    assert row[LAYOUT.per_server["shmdisagg_server_cached_tokens"] + 0] == 128
    (rec,) = records.items
    fields = dict(zip(RECORD_FIELDS, rec, strict=True))
    assert fields["disagg_request_id"] == 1234 and fields["ctx_slot"] == 0 and fields["gen_slot"] == 2
    assert fields["gen_dispatch"] == 100.0215 and fields["retries"] == 0 and fields["error_code"] == ""


def test_histogram_buckets_follow_prometheus_le() -> None:
    row = new_row()
    m = RequestMetrics(row)
    m._observe("queue_latency_seconds", 0.001)  # le="0.001" includes the bound itself
    base = LAYOUT.hist["queue_latency_seconds"]
    assert row[base] == 1


def test_a_context_retry_is_counted_as_a_retry_decision() -> None:
    row, records = new_row(), Records()
    m = RequestMetrics(row, records)
    ctx, gen = CountingPolicy(FakePolicy([0, 1]), False), CountingPolicy(FakePolicy([2]), True)
    run_one(m, disagg_handle(m, ctx, gen, ctx_picks=2))
    assert row[C["ctx_total_requests"]] == 2 and row[C["ctx_retry_requests"]] == 1
    assert row[LAYOUT.routing[("context", "routed")]] == 1 and row[LAYOUT.routing[("context", "retry")]] == 1
    assert dict(zip(RECORD_FIELDS, records.items[0], strict=True))["retries"] == 1


def test_no_eligible_server_counts_a_no_server_decision_and_an_http_exception() -> None:
    row = new_row()
    m = RequestMetrics(row)
    ctx = CountingPolicy(FakePolicy([-1]), False)

    async def handle(scope: Any, receive: Any, send: Any, chat: bool) -> None:
        ex = Exchange(send, 1, False, arrival=1.0)
        ex.ctx_dispatch = 1.001
        ex.ctx_slot = ctx.pick(None, -1)
        ex.status, ex.error_code = 503, "no_context_servers"
        m.sink(ex)

    run_one(m, handle)
    assert row[LAYOUT.routing[("context", "no_server")]] == 1
    assert row[C["http_exceptions"]] == 1 and row[C["ctx_total_requests"]] == 0 and row[C["ctx_error_requests"]] == 0


def test_a_refused_request_is_a_validation_exception() -> None:
    row = new_row()
    m = RequestMetrics(row)

    async def refused(scope: Any, receive: Any, send: Any, chat: bool) -> None:
        pass  # a 400 before routing: no Exchange, no sink call

    run_one(m, refused)
    assert row[C["total_requests"]] == 1 and row[C["validation_exceptions"]] == 1
    assert row[C["stream_requests"]] + row[C["nonstream_requests"]] == 0


def test_an_admission_rejection_is_counted_apart_from_validation() -> None:
    row = new_row()
    m = RequestMetrics(row)
    admission = CountingAdmission(1, lambda: 1)

    async def at_limit(scope: Any, receive: Any, send: Any, chat: bool) -> None:
        assert not admission.admit()

    run_one(m, at_limit)
    assert row[C["shmdisagg_admission_rejections"]] == 1 and row[C["validation_exceptions"]] == 0
    assert admission.rejected == 1


def test_a_client_disconnect_is_neither_an_error_nor_a_response() -> None:
    row = new_row()
    m = RequestMetrics(row)
    ctx, gen = CountingPolicy(FakePolicy([0]), False), CountingPolicy(FakePolicy([2]), True)
    run_one(m, disagg_handle(m, ctx, gen, code="client_disconnected", stream=True))
    assert row[C["shmdisagg_client_disconnects"]] == 1 and row[C["stream_requests"]] == 1
    for name in ("total_responses", "http_exceptions", "gen_error_requests", "gen_completed_requests"):
        assert row[C[name]] == 0, name
    assert hist_count(row, "shmdisagg_e2e_request_latency_seconds") == 0


def test_a_failed_generation_leg_is_a_gen_error_and_internal_errors_are_apart() -> None:
    row = new_row()
    m = RequestMetrics(row)
    for code in ("upstream_error", "internal_error"):
        ctx, gen = CountingPolicy(FakePolicy([0]), False), CountingPolicy(FakePolicy([2]), True)
        run_one(m, disagg_handle(m, ctx, gen, code=code))
    assert row[C["gen_error_requests"]] == 2 and row[C["http_exceptions"]] == 1 and row[C["internal_errors"]] == 1
    assert row[C["ctx_completed_requests"]] == 2 and row[C["total_responses"]] == 0


def test_an_executors_4xx_is_an_http_exception_and_a_routed_client_error_and_a_5xx_only_the_first() -> None:
    row = new_row()
    m = RequestMetrics(row)
    for status in (400, 422, 502):
        ctx, gen = CountingPolicy(FakePolicy([0]), False), CountingPolicy(FakePolicy([2]), True)
        run_one(m, disagg_handle(m, ctx, gen, code=f"http_{status}", status=status))
    assert row[C["http_exceptions"]] == 3 and row[C["shmdisagg_routed_client_errors"]] == 2
    assert row[C["internal_errors"]] == 0 and row[C["total_responses"]] == 0


def test_counting_policy_passes_everything_else_through() -> None:
    inner = FakePolicy([3])
    inner.needs_tokens = True
    wrapped = CountingPolicy(inner, True)
    assert wrapped.name == "round_robin" and wrapped.needs_tokens is True
    assert wrapped.pick(None, -1) == 3  # outside a request (no note): just the pick
    wrapped.release(3, None)
    assert inner.released == [3]


def test_sink_without_serve_derives_legs_from_the_exchange() -> None:
    row = new_row()
    m = RequestMetrics(row)
    ex = Exchange(_noop_send, 9, False, arrival=1.0)
    ex.ctx_slot, ex.gen_slot = 0, 1
    ex.ctx_dispatch, ex.ctx_done, ex.first_token, ex.last_token = 1.1, 1.2, 1.3, 1.4
    m.sink(ex)
    assert row[C["ctx_total_requests"]] == 1 and row[C["gen_total_requests"]] == 1 and row[C["total_responses"]] == 1
