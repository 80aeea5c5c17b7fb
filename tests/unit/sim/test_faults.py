from __future__ import annotations

import pytest

from shmdisagg.executors.sim.errors import ConfigError
from shmdisagg.executors.sim.faults import FaultSpec, FaultState


class ExitCalled(Exception):
    pass


def exit_recorder(code: int) -> None:
    raise ExitCalled(code)


def test_cli_fault_syntax_parses_kind_and_typed_parameters():
    spec = FaultSpec.parse("error:status=503,rate=0.25,count=2")
    assert (spec.kind, spec.status, spec.rate, spec.count) == ("error", 503, 0.25, 2)
    assert FaultSpec.parse("hang") == FaultSpec(kind="hang")
    assert FaultSpec.parse("disconnect_mid_stream:after_chunks=3").after_chunks == 3


@pytest.mark.parametrize(
    "text",
    [
        "explode",
        "error:status=200",
        "error:rate=2",
        "slow:factor=0",
        "crash:after=-1",
        "error:count=0",
        "error:bogus=1",
        "error:status",
        "error:status=abc",
    ],
)
def test_bad_fault_specs_raise_config_error(text):
    with pytest.raises(ConfigError):
        FaultSpec.parse(text)


def test_json_fault_specs_reject_wrong_types():
    with pytest.raises(ConfigError):
        FaultSpec.from_dict({"kind": "error", "status": 5.5})
    with pytest.raises(ConfigError):
        FaultSpec.from_dict({"status": 500})


def test_crash_after_n_lets_n_requests_through_then_exits():
    state = FaultState(exit_fn=exit_recorder)
    state.add(FaultSpec(kind="crash", after=2))
    state.on_inference_request()
    state.on_inference_request()
    with pytest.raises(ExitCalled):
        state.on_inference_request()
    assert not FaultState(exit_fn=exit_recorder).crash_at_once
    at_once = FaultState(exit_fn=exit_recorder)
    at_once.add(FaultSpec(kind="crash"))
    assert at_once.crash_at_once


def test_hang_after_n_starts_after_the_nth_request_and_clearing_ends_it():
    state = FaultState()
    state.add(FaultSpec(kind="hang", after=1))
    assert not state.hanging
    state.on_inference_request()
    assert state.hanging
    state.clear("hang")
    assert not state.hanging and state.faults == []


def test_error_with_count_hits_exactly_count_requests_then_disappears():
    state = FaultState()
    state.add(FaultSpec(kind="error", status=503, count=2))
    verdicts = [state.on_inference_request().error for _ in range(4)]
    assert [v.status if v else None for v in verdicts] == [503, 503, None, None]
    assert state.faults == []


def test_error_rate_is_reproducible_with_the_seed():
    def run(seed: int) -> list[bool]:
        state = FaultState(seed=seed)
        state.add(FaultSpec(kind="error", rate=0.5))
        return [state.on_inference_request().error is not None for _ in range(50)]

    assert run(3) == run(3)
    assert 10 < sum(run(3)) < 40


def test_slow_factors_multiply_and_disconnect_reports_its_chunk_count():
    state = FaultState()
    state.add(FaultSpec(kind="slow", factor=2))
    state.add(FaultSpec(kind="slow", factor=3))
    state.add(FaultSpec(kind="disconnect_mid_stream", after_chunks=4))
    assert state.slow_factor == 6
    assert state.on_inference_request().disconnect_after_chunks == 4
    state.clear()
    assert state.slow_factor == 1 and state.on_inference_request().disconnect_after_chunks is None
