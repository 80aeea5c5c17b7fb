"""The timing model's shape and the headline numbers README.md documents for each profile."""

from __future__ import annotations

import pytest

from shmdisagg.executors.sim.errors import ConfigError
from shmdisagg.executors.sim.profiles import PROFILES, get_profile, guess_profile
from shmdisagg.executors.sim.timing import iteration_seconds, itl_seconds, transfer_seconds, ttft_seconds

H100_8B = get_profile("h100-sxm-llama-3.1-8b")


@pytest.mark.parametrize("profile", list(PROFILES.values()), ids=list(PROFILES))
def test_prefill_time_grows_with_uncached_tokens_and_faster_than_linearly(profile):
    times = [ttft_seconds(profile, n) for n in (1, 64, 256, 1024, 4096, 16384, 65536)]
    assert times == sorted(times) and len(set(times)) == len(times)
    per_token_short = (ttft_seconds(profile, 2048) - ttft_seconds(profile, 1024)) / 1024
    per_token_long = (ttft_seconds(profile, 65536) - ttft_seconds(profile, 64512)) / 1024
    assert per_token_long > per_token_short  # the quadratic attention term


@pytest.mark.parametrize("profile", list(PROFILES.values()), ids=list(PROFILES))
def test_cached_tokens_shorten_prefill(profile):
    assert ttft_seconds(profile, 8192, cached_tokens=4096) < ttft_seconds(profile, 8192)
    assert ttft_seconds(profile, 8192, cached_tokens=8000) < ttft_seconds(profile, 8192, cached_tokens=4096)


@pytest.mark.parametrize("profile", list(PROFILES.values()), ids=list(PROFILES))
def test_decode_step_grows_with_batch_and_with_context(profile):
    assert itl_seconds(profile, 1, 1024) < itl_seconds(profile, 64, 1024) < itl_seconds(profile, 256, 1024)
    assert itl_seconds(profile, 32, 512) < itl_seconds(profile, 32, 4096) < itl_seconds(profile, 32, 32768)


def test_overlap_scheduler_hides_host_overhead():
    for n in (1, 32):
        with_overlap = itl_seconds(H100_8B, n, 1024, overlap_scheduler=True)
        without = itl_seconds(H100_8B, n, 1024, overlap_scheduler=False)
        assert without == pytest.approx(with_overlap + H100_8B.host_step_overhead_s)


def test_an_iteration_costs_at_least_its_prefill_and_its_decode_alone():
    both = iteration_seconds(H100_8B, [(512, 0)], 16, 16 * 1024)
    assert both >= iteration_seconds(H100_8B, [(512, 0)], 0, 0)
    assert both >= iteration_seconds(H100_8B, [], 16, 16 * 1024)


def test_h100_8b_lands_in_llm_d_inference_sim_reference_band():
    # llm-d-inference-sim's docs/latency-profiles.md: a 7-8B model on H100: TTFT 60-120 ms at
    # 256 prompt tokens, ITL 10-15 ms.
    for overlap in (True, False):
        assert 0.060 <= ttft_seconds(H100_8B, 256, overlap_scheduler=overlap) <= 0.120
        assert 0.010 <= itl_seconds(H100_8B, 1, 256, overlap_scheduler=overlap) <= 0.015


def test_documented_profile_numbers():
    # README.md "Profiles" table (8B on H100, overlap scheduler on).
    assert ttft_seconds(H100_8B, 256) * 1000 == pytest.approx(64.4, abs=0.1)
    assert ttft_seconds(H100_8B, 8192) * 1000 == pytest.approx(431.0, abs=0.5)
    assert itl_seconds(H100_8B, 1, 256) * 1000 == pytest.approx(10.9, abs=0.1)
    assert itl_seconds(H100_8B, 32, 2048) * 1000 == pytest.approx(14.5, abs=0.1)
    assert H100_8B.kv_bytes_per_token == 131072  # 2 * 32 layers * 8 kv heads * 128 * 2 bytes
    assert H100_8B.default_num_blocks(32) == 12798
    seventy = get_profile("h200-llama-3.1-70b-tp4")
    assert seventy.kv_bytes_per_token == 81920  # 2 * 80 * 8 * 128 * 2 / tp 4
    assert itl_seconds(seventy, 1, 256) * 1000 == pytest.approx(14.5, abs=0.1)
    assert transfer_seconds(H100_8B, 8192) * 1000 == pytest.approx(11.7, abs=0.1)


def test_more_hbm_bandwidth_means_faster_decode_not_faster_prefill():
    h200 = get_profile("h200-llama-3.1-8b")
    assert itl_seconds(h200, 8, 2048) < itl_seconds(H100_8B, 8, 2048)
    assert ttft_seconds(h200, 4096) == pytest.approx(ttft_seconds(H100_8B, 4096))


def test_kv_transfer_time_is_linear_in_tokens_after_a_fixed_latency():
    t1, t2 = transfer_seconds(H100_8B, 1000), transfer_seconds(H100_8B, 2000)
    assert transfer_seconds(H100_8B, 0) == 0.0
    assert t2 - t1 == pytest.approx(t1 - H100_8B.kv_transfer_latency_s)


def test_profile_lookup_and_guessing():
    with pytest.raises(ConfigError, match="unknown profile"):
        get_profile("a100-gpt2")
    assert guess_profile("/models/Llama-3.1-70B-Instruct", 4).endswith("70b-tp4")
    assert guess_profile("meta-llama/Meta-Llama-3.1-8B", 1) == "h100-sxm-llama-3.1-8b"
    assert H100_8B.with_tp(2).kv_bytes_per_token == 65536
    with pytest.raises(ConfigError):
        H100_8B.with_tp(0)
