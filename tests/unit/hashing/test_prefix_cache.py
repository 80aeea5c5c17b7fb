"""PrefixHashCache (native/hashcache.c): always the same keys as block_hashes_v1, whatever it has
cached, and it reuses what it cached for repeats and extensions."""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from shmdisagg import _native, hashing
from shmdisagg.hashing import PrefixHashCache

ops_st = st.lists(
    st.tuples(
        st.integers(0, 5),  # which earlier prompt to start from
        st.integers(0, 1200),  # keep this many of its tokens
        st.integers(0, 300),  # then append this many new tokens
        st.sampled_from([None, 1, 1 << 63]),  # salt
        st.sampled_from(["list", "int32", "int64", "unaligned int32"]),  # how the tokens come
    ),
    min_size=1,
    max_size=25,
)


def _as(form: str, prompt: list[int]) -> object:
    """The tokens as a list, an int32 buffer (hashed in place), an int64 buffer or an int32
    view at an odd address (both copied first)."""
    if form == "list":
        return prompt
    if form == "int64":
        return array("q", prompt)
    raw = array("i", prompt).tobytes()
    if form == "int32":
        return memoryview(raw).cast("i")
    return memoryview(bytearray(b"x") + raw)[1:].cast("i")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=ops_st,
    tpb=st.sampled_from([1, 3, 16, 32]),
    max_blocks=st.sampled_from([16, 64, 1 << 12]),
    seed=st.integers(0, 2**64 - 1),
)
def test_cached_keys_always_equal_the_direct_ones(
    ops: list[tuple[int, int, int, int | None, str]], tpb: int, max_blocks: int, seed: int, v1_impl: str
) -> None:
    rng = random.Random(seed)
    cache = PrefixHashCache(tpb, max_blocks=max_blocks, seed=seed)
    prompts: list[list[int]] = [[rng.randrange(0, 1 << 31) for _ in range(700)]]
    for which, keep, extra, salt, form in ops:
        base = prompts[which % len(prompts)]
        prompt = base[:keep] + [rng.randrange(0, 1 << 31) for _ in range(extra)]
        prompts.append(prompt)
        tokens = _as(form, prompt)
        assert cache.block_hashes(tokens, salt) == _native.block_hashes_v1(prompt, tpb, salt)


def test_repeats_and_extensions_reuse_cached_blocks() -> None:
    cache = PrefixHashCache(32, seed=7)
    prompt = list(range(100, 100 + 32 * 100 + 1))  # 100 blocks
    cache.block_hashes(prompt)
    assert cache.stats["blocks_reused"] == 0
    cache.block_hashes(prompt)
    assert cache.stats["full_hits"] == 1 and cache.stats["blocks_reused"] == 100
    longer = prompt + list(range(5000, 5000 + 32 * 20))
    assert cache.block_hashes(longer) == hashing.block_hashes_bytes(longer, 32)
    # the deepest checkpoint (every 16 blocks) of the cached prompt is block 95: 96 reused
    assert cache.stats["blocks_reused"] == 100 + 96
    assert cache.block_hashes(longer, 5) == hashing.block_hashes_bytes(longer, 32, 5)  # another salt
    assert cache.stats["blocks_reused"] == 196


@pytest.mark.parametrize("tpb", [8, 16, 32, 12])
@pytest.mark.parametrize("first", ["list", "int32", "unaligned int32", "int64"])
@pytest.mark.parametrize("then", ["list", "int32"])
@pytest.mark.parametrize("salt", [None, 3])
def test_a_prompt_recorded_in_any_form_is_found_in_any_form(
    tpb: int, first: str, then: str, salt: int | None, v1_impl: str
) -> None:
    # An int32 miss fingerprints its blocks inside the v1 loop (native/hash.c v1_run_u32), other
    # forms in a pass of their own: both must record the fingerprints every lookup computes, or a
    # next turn would chain its whole prompt again.
    rng = random.Random(tpb)
    prompt = [rng.randrange(0, 1 << 31) for _ in range(tpb * 70 + 5)]  # 70 blocks and a partial one
    cache = PrefixHashCache(tpb, seed=11)
    assert cache.block_hashes(_as(first, prompt), salt) == _native.block_hashes_v1(prompt, tpb, salt)
    longer = prompt + [rng.randrange(0, 1 << 31) for _ in range(tpb * 20)]
    assert cache.block_hashes(_as(then, longer), salt) == _native.block_hashes_v1(longer, tpb, salt)
    assert cache.stats["blocks_reused"] == 64  # the deepest checkpoint of the first prompt (block 63)
    assert cache.block_hashes(_as(then, prompt), salt) == _native.block_hashes_v1(prompt, tpb, salt)
    assert cache.stats["full_hits"] == 1


@pytest.mark.parametrize("tpb", [3, 8, 32])
def test_the_avx2_and_portable_fingerprints_are_the_same(tpb: int) -> None:
    # The portable code (aarch64, CPUs without AVX2) must compute the very fingerprints of the AVX2
    # code: one process records with one and looks up with the other here.
    rng = random.Random(tpb)
    prompts = [[rng.randrange(0, 1 << 31) for _ in range(tpb * 40 + k)] for k in (1, 2, 9)]
    for record, lookup in ((True, False), (False, True)):
        cache = PrefixHashCache(tpb, seed=5)
        try:
            _native._v1_impl(record)
            for p in prompts:
                cache.block_hashes(array("i", p) if tpb % 8 == 0 else p)  # int32: the one-loop path
            _native._v1_impl(lookup)
            for p in prompts:
                assert cache.block_hashes(p) == _native.block_hashes_v1(p, tpb)
        finally:
            _native._v1_impl(False)
        assert cache.stats["full_hits"] == len(prompts)


def test_a_wrapped_ring_forgets_old_prompts_but_stays_correct() -> None:
    cache = PrefixHashCache(4, max_blocks=64, seed=1)
    a = list(range(1, 4 * 40 + 2))
    b = list(range(1000, 1000 + 4 * 40 + 1))
    cache.block_hashes(a)
    cache.block_hashes(b)  # 80 blocks > 64: a's record is overwritten
    assert cache.block_hashes(a) == hashing.block_hashes_bytes(a, 4)
    assert cache.stats["full_hits"] == 0
    cache.clear()
    assert cache.block_hashes(a) == hashing.block_hashes_bytes(a, 4)


@pytest.mark.parametrize(("args", "error"), [((0,), ValueError), ((32, 8), ValueError), (("x",), TypeError)])
def test_bad_construction_raises(args: tuple[object, ...], error: type[Exception]) -> None:
    with pytest.raises(error):
        PrefixHashCache(*args)  # type: ignore[arg-type]


def test_bad_calls_raise() -> None:
    cache = PrefixHashCache(4)
    with pytest.raises(TypeError):
        cache.block_hashes([1, "2", 3])
    with pytest.raises(TypeError):
        cache.block_hashes([1, 2, 3], nope=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        cache.block_hashes([1, 2, 3], -1)
    assert cache.block_hashes([]) == b"" and cache.block_hashes([9]) == b""
    assert cache.tokens_per_block == 4
