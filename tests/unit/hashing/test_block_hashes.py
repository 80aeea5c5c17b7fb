"""Block hashes: the native code (native/hash.c) against the pure-Python references, pinned values,
and the argument contract."""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Iterator

import pytest
from hypothesis import given, settings, strategies as st

from shmdisagg import _native, hashing

U64 = (1 << 64) - 1

tokens_st = st.lists(st.integers(min_value=0, max_value=(1 << 31) - 1), max_size=300)
any_int_tokens_st = st.lists(st.integers(min_value=-(1 << 70), max_value=1 << 70), max_size=80)
tpb_st = st.integers(min_value=1, max_value=70)
salt_st = st.none() | st.integers(min_value=0, max_value=U64)


def unpack(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 8}Q", raw))


@pytest.fixture(params=["shani", "portable"])
def sha_impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test with the SHA-NI transform (where the CPU has it) and with the portable one."""
    impl = _native._sha256_impl(request.param == "portable")
    yield impl
    _native._sha256_impl(False)


# -- v1_block_key ----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(tokens=tokens_st, tpb=tpb_st, salt=salt_st)
def test_native_v1_equals_the_reference_on_lists(tokens: list[int], tpb: int, salt: int | None) -> None:
    assert hashing.block_hashes(tokens, tpb, salt) == hashing.block_hashes_py(tokens, tpb, salt)


@settings(max_examples=150, deadline=None)
@given(tokens=tokens_st, tpb=tpb_st, salt=salt_st)
def test_native_v1_reads_int32_and_int64_buffers_like_lists(tokens: list[int], tpb: int, salt: int | None) -> None:
    want = hashing.block_hashes_bytes(tokens, tpb, salt)
    for typecode in ("i", "I", "l", "q", "Q"):
        assert hashing.block_hashes_bytes(array(typecode, tokens), tpb, salt) == want, typecode
    assert hashing.block_hashes_bytes(memoryview(array("i", tokens)), tpb, salt) == want


@settings(max_examples=150, deadline=None)
@given(tokens=any_int_tokens_st, tpb=tpb_st)
def test_native_v1_masks_negative_and_huge_ints_as_the_reference_does(tokens: list[int], tpb: int) -> None:
    assert hashing.block_hashes(tokens, tpb) == hashing.block_hashes_py(tokens, tpb)


@pytest.mark.parametrize("n", [0, 1, 2, 255, 256, 257, 511, 512, 513, 1000, 4097])
@pytest.mark.parametrize("tpb", [1, 16, 32, 64, 300])
def test_native_v1_matches_across_chunk_and_block_boundaries(n: int, tpb: int, v1_impl: str) -> None:
    # The native loop premixes tokens in chunks of 256 ahead of the chain; every alignment of
    # chunk ends against block ends must give the reference's values.
    tokens = [(i * 2654435761) % 200_003 for i in range(n)]
    assert hashing.block_hashes(tokens, tpb) == hashing.block_hashes_py(tokens, tpb)
    assert hashing.block_hashes(tokens, tpb, 99) == hashing.block_hashes_py(tokens, tpb, 99)


@pytest.mark.parametrize("n", [0, 1, 2, 8, 9, 17, 33, 100, 257, 1025, 4100])
@pytest.mark.parametrize("tpb", [8, 16, 24, 32, 64, 128])
@pytest.mark.parametrize("salt", [None, 7])
def test_int32_buffers_take_the_one_loop_path_and_agree_with_the_reference(
    n: int, tpb: int, salt: int | None, v1_impl: str
) -> None:
    # Block sizes that are multiples of 8 hash int32 buffers in one AVX2 loop (premix in the
    # chain's shadow, native/hash.c v1_run_u32); whole and partial last blocks, aligned or not.
    tokens = [(i * 2654435761) % 200_003 for i in range(n)]
    want = hashing.block_hashes_py(tokens, tpb, salt)
    raw = array("i", tokens).tobytes()
    unaligned = memoryview(bytearray(b"x") + raw)[1:].cast("i")
    for buf in (array("i", tokens), memoryview(raw).cast("i"), unaligned):
        assert hashing.block_hashes(buf, tpb, salt) == want


def test_v1_worked_values_are_pinned() -> None:
    # Computed once from the reference (TensorRT-LLM's hash_v1_block_key); any change to the
    # algorithm, the block boundaries or the salt handling changes them.
    tokens = list(range(1, 18))  # 17 tokens: the last is excluded, so 4 blocks of 4
    assert hashing.block_hashes(tokens, 4) == [
        924206229973855,
        2728178455351807326,
        10011707017105896989,
        12596687955593816051,
    ]
    assert hashing.block_hashes(tokens, 4, hashing.cache_salt_id("tenant-a")) == [
        8961321873627678067,
        10690226908068462878,
        12736046421681379436,
        4393812645555001672,
    ]
    assert hashing.block_hashes([0, 151643, 2**31 - 1, 7], 2) == [174159052286, 8813395606694926965]


def test_v1_first_block_follows_the_documented_formula() -> None:
    # seed = len ^ (0 * PARENT); per token: v = mix32 pre-step (u32), seed ^= v + (seed << 6) + (seed >> 2)
    def step(seed: int, token: int) -> int:
        v = token & 0xFFFFFFFF
        v = ((v >> 16) ^ v) * 0x45D9F3B & 0xFFFFFFFF
        v = ((v >> 16) ^ v) * 0x45D9F3B & 0xFFFFFFFF
        v = ((v >> 16) ^ v) + 0x9E3779B9 & 0xFFFFFFFF
        return seed ^ (v + (seed << 6) + (seed >> 2)) & U64

    seed = 3
    for token in (11, 22, 33):
        seed = step(seed, token)
    assert hashing.block_hashes([11, 22, 33, 44], 8) == [seed]


def test_the_last_token_is_excluded_and_a_final_partial_block_is_kept() -> None:
    assert hashing.block_hashes([], 4) == [] and hashing.block_hashes([5], 4) == []
    assert len(hashing.block_hashes(list(range(5)), 4)) == 1  # 4 usable tokens: one full block
    assert len(hashing.block_hashes(list(range(6)), 4)) == 2  # 5 usable: one full, one partial
    assert hashing.block_hashes(list(range(6)), 4)[0] == hashing.block_hashes(list(range(5)), 4)[0]


def test_salt_changes_only_what_it_should() -> None:
    tokens = list(range(100))
    plain, salted = hashing.block_hashes(tokens, 16), hashing.block_hashes(tokens, 16, 7)
    assert all(a != b for a, b in zip(plain, salted, strict=True))  # the salt reaches every block via the chain
    assert hashing.block_hashes(tokens, 16, 7) == salted


@pytest.mark.parametrize(
    ("tokens", "tpb", "salt", "error"),
    [
        ([1, "2", 3], 4, None, TypeError),
        ([1, 2.0, 3], 4, None, TypeError),
        ("abc", 4, None, TypeError),
        (b"\x01\x02\x03\x04", 4, None, TypeError),  # bytes are a buffer of 1-byte items
        (array("h", [1, 2, 3]), 4, None, TypeError),
        ([1, 2, 3], 0, None, ValueError),
        ([1, 2, 3], -1, None, ValueError),
        ([1, 2, 3], 4, -1, ValueError),
        ([1, 2, 3], 4, 1 << 64, ValueError),
        ([1, 2, 3], 4, "salt", TypeError),
    ],
)
def test_bad_arguments_raise(tokens: object, tpb: int, salt: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        _native.block_hashes_v1(tokens, tpb, salt)


def test_keyword_arguments_work() -> None:
    assert _native.block_hashes_v1(tokens=[1, 2, 3], tokens_per_block=2, salt_id=5) == _native.block_hashes_v1(
        [1, 2, 3], 2, 5
    )
    with pytest.raises(TypeError):
        _native.block_hashes_v1([1, 2, 3], 2, nope=1)


# -- v2 (SHA-256 block chain) ----------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(
    tokens=tokens_st,
    tpb=tpb_st,
    salt=salt_st,
    lora=st.none() | st.integers(min_value=0, max_value=U64),
    token_bytes=st.sampled_from([4, 8]),
)
def test_native_v2_equals_the_reference(
    tokens: list[int], tpb: int, salt: int | None, lora: int | None, token_bytes: int
) -> None:
    ref = hashing.block_keys_v2_py(tokens, tpb, salt, lora, token_bytes)
    assert hashing.block_keys_v2(tokens, tpb, salt, lora, token_bytes) == ref
    assert hashing.block_hashes_v2_64(tokens, tpb, salt, lora, token_bytes) == [
        int.from_bytes(k[:8], "big") for k in ref
    ]


@pytest.mark.parametrize("n", [0, 1, 2, 14, 15, 16, 17, 40, 1000])
def test_both_sha256_transforms_agree_with_hashlib(sha_impl: str, n: int) -> None:
    tokens = [(i * 7919) % 150_000 for i in range(n)]
    for tpb in (1, 13, 14, 16, 32):  # 32 + 4 * tpb bytes: every padding case of the last block
        assert hashing.block_keys_v2(tokens, tpb) == hashing.block_keys_v2_py(tokens, tpb), (sha_impl, tpb)


def test_v2_root_key_is_the_reuse_scope_digest() -> None:
    # ReuseScope(lora_id=None, salt=5): mask byte 0b10, then the salt as u64 little-endian.
    root = hashlib.sha256(bytes([2]) + (5).to_bytes(8, "little")).digest()
    first = hashlib.sha256(root + b"".join(t.to_bytes(4, "little") for t in (10, 20))).digest()
    assert hashing.block_keys_v2([10, 20, 30], 2, salt_id=5) == [first]
    assert hashing.v2_key_to_u64(first.hex()) == hashing.block_hashes_v2_64([10, 20, 30], 2, salt_id=5)[0]


def test_v2_worked_values_are_pinned() -> None:
    assert [k.hex() for k in hashing.block_keys_v2(list(range(1, 10)), 4)] == [
        "e432228522a304ab556d66e6e40979ad05575f28b19b554264dd3c6277aaf073",
        "756b1d258c63ccc0cbd6284ab33b043c81175086163f9d2821f5764079efb75c",
    ]
    assert hashing.block_hashes_v2_64(list(range(1, 18)), 4) == [
        16443243144690205867,
        8460888372051954880,
        13011690816579977038,
        16132492864216926403,
    ]
    assert hashing.block_hashes_v2_64(list(range(1, 10)), 4, token_bytes=8) == [
        15438395711626328209,
        13406813981758916444,
    ]


def test_v2_refuses_token_ids_that_do_not_fit_four_bytes() -> None:
    with pytest.raises(ValueError):
        hashing.block_keys_v2([1 << 32, 1, 2], 2)
    with pytest.raises(ValueError):
        hashing.block_keys_v2([-1, 1, 2], 2)
    assert len(hashing.block_keys_v2([1 << 32, 1, 2], 2, token_bytes=8)) == 1


# -- conversation keys -----------------------------------------------------------------------------


def test_conversation_key_is_stable_and_distinct() -> None:
    assert hashing.conversation_key("conv-1") == 12699295510116361625
    assert hashing.conversation_key("conv-1") != hashing.conversation_key("conv-2")
