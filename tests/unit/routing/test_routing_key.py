"""RoutingKey's block hashes: hashed from the int32 ids that validation produced, through the
process's prefix hash cache, and always exactly the keys of the list (the pure-Python reference)."""

from __future__ import annotations

import random
from array import array

from hypothesis import given, settings, strategies as st

from shmdisagg import hashing
from shmdisagg.config import RouterConfig
from shmdisagg.routing.conversation import ConversationPolicy
from shmdisagg.routing.policy import RoutingKey


def _ids32(ids: list[int]) -> bytes:
    return array("i", ids).tobytes()


@settings(max_examples=60, deadline=None)
@given(
    turns=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 900), st.integers(0, 400)), min_size=1, max_size=12),
    tpb=st.sampled_from([1, 4, 16, 32]),
    salt=st.sampled_from([None, 7, 2**64 - 1]),
    from_validation=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_block_hashes_equal_the_list_hashes(
    turns: list[tuple[int, int, int]], tpb: int, salt: int | None, from_validation: bool, seed: int
) -> None:
    """Conversations (a prompt extending an earlier one), repeats and new prompts, whichever
    path the ids took (validation's int32 bytes, or a tokenizer's list)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, 2**31) for _ in range(300)]]
    for which, keep, extra in turns:
        prompt = prompts[which % len(prompts)][:keep] + [rng.randrange(0, 2**31) for _ in range(extra)]
        prompts.append(prompt)
        key = RoutingKey(len(prompt), prompt, salt_id=salt, ids32=_ids32(prompt) if from_validation else None)
        expected = hashing.block_hashes_bytes(prompt, tpb, salt)
        assert key.block_hashes(tpb) == expected
        assert key.block_hashes(tpb) == expected  # computed once per block size
        if len(prompt) < 200:
            raw = hashing.block_hashes_py(prompt, tpb, salt)
            assert expected == array("Q", raw).tobytes()


def test_keys_without_usable_int32_ids_hash_the_list() -> None:
    assert RoutingKey(5).block_hashes(32) == b""
    big = [2**31 + 5, 2**40, 3, 4, 5]  # no int32 form: the list path, same keys
    assert RoutingKey(len(big), big).ids_view() is None
    assert RoutingKey(len(big), big).block_hashes(2) == hashing.block_hashes_bytes(big, 2)


def test_process_caches_are_bounded_and_reused() -> None:
    prompt = list(range(1000, 1000 + 32 * 100 + 1))  # 100 blocks of 32
    for tpb in (3, 5, 7, 9, 11, 32):
        assert RoutingKey(len(prompt), prompt, ids32=_ids32(prompt)).block_hashes(tpb) == hashing.block_hashes_bytes(
            prompt, tpb
        )
    assert len(hashing._process_caches) <= hashing._PROCESS_CACHES_MAX
    cache = hashing._process_caches[32]
    before = cache.stats["blocks_reused"]
    RoutingKey(len(prompt), prompt, ids32=_ids32(prompt)).block_hashes(32)  # a repeat
    assert cache.stats["blocks_reused"] == before + 100
    short = prompt[: 32 * hashing.CACHE_MIN_BLOCKS]  # hashed directly, not recorded
    calls = cache.stats["calls"]
    assert RoutingKey(len(short), short, ids32=_ids32(short)).block_hashes(32) == hashing.block_hashes_bytes(short, 32)
    assert cache.stats["calls"] == calls


def test_conversation_hashes_from_int32_ids_equal_the_list_ones() -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(0, 2**31) for _ in range(3000)]  # 187 blocks of 16: through the cache
    policy = object.__new__(ConversationPolicy)
    for skip in (0, 5, 2000, 2999, 3000, 4000):
        policy.args = RouterConfig(type="conversation", use_token_ids=True, hash_skip_count=skip)
        policy.tpb = 16
        tail = prompt[skip:]
        expected = hashing.block_hashes_bytes(tail, 16) if len(tail) > 1 else b""
        assert policy._hashes(RoutingKey(len(prompt), prompt, ids32=_ids32(prompt))) == expected
        assert policy._hashes(RoutingKey(len(prompt), prompt)) == expected
