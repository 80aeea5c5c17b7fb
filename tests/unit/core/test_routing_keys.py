"""The coordinator's routing key per kv_cache_aware role: block size and hash algorithm, decided
as TensorRT-LLM's KvCacheAwareRouter._prepare_server / routing_key_config decide them."""

from __future__ import annotations

import pytest

from shmdisagg.coordinator.routing_keys import RoutingKeys

CTX, GEN = 0, 1


def keys(tpb: int | None = None) -> RoutingKeys:
    return RoutingKeys({CTX: ("context", tpb)})


def info(algo: str | None = "v1_block_key", tpb: int | None = 32) -> dict[str, object]:
    out: dict[str, object] = {}
    if algo is not None:
        out["kv_cache_hash_algo"] = algo
    if tpb is not None:
        out["tokens_per_block"] = tpb
    return out


def test_unset_tokens_per_block_starts_at_32_and_adopts_the_first_executor_s_once() -> None:
    k = keys()
    assert k.configs()["context"]["tokens_per_block"] == 32
    assert k.admit(0, CTX, "a:1", info(tpb=64), fresh=True) is None
    assert k.configs()["context"] == {"tokens_per_block": 64, "kv_cache_hash_algo": "v1_block_key"}
    # adopted once: a later executor does not move it, and is judged against it
    assert k.admit(1, CTX, "b:1", info(tpb=32), fresh=True) is None
    assert k.configs()["context"]["tokens_per_block"] == 64
    assert k.aligned(0) and not k.aligned(1)


def test_a_block_size_neither_dividing_nor_divided_is_refused_a_divisible_one_is_admitted_but_not_drained() -> None:
    k = keys(32)
    assert k.admit(0, CTX, "a:1", info(tpb=32), fresh=True) is None and k.aligned(0)
    reason = k.admit(1, CTX, "b:1", info(tpb=48), fresh=True)
    assert reason is not None and "tokens_per_block 48" in reason and "do not divide" in reason
    assert k.admit(2, CTX, "c:1", info(tpb=128), fresh=True) is None and not k.aligned(2)
    assert k.admit(3, CTX, "d:1", info(tpb=16), fresh=True) is None and not k.aligned(3)
    assert k.admit(4, CTX, "e:1", info(tpb=None), fresh=True) is None and k.aligned(4)  # none reported: aligned
    assert k.configs()["context"]["tokens_per_block"] == 32  # configured: never adopted
    assert k.algo_of(1) is None  # a refused executor is not recorded


@pytest.mark.parametrize("algo", ["v1", "auto", "v3_sha512", ""])
def test_an_algorithm_the_router_cannot_compute_is_refused(algo: str) -> None:
    reason = keys().admit(0, CTX, "a:1", info(algo), fresh=True)
    assert reason is not None and repr(algo) in reason and "v1_block_key, v2_sha256, v2_sha256_64" in reason


def test_no_algorithm_in_server_info_is_v1_block_key() -> None:
    k = keys()
    assert k.admit(0, CTX, "a:1", info(None), fresh=True) is None
    assert k.configs()["context"]["kv_cache_hash_algo"] == "v1_block_key"


@pytest.mark.parametrize("algo", ["v2_sha256", "v2_sha256_64"])
def test_the_role_hashes_with_the_algorithm_its_executors_report(algo: str) -> None:
    k = RoutingKeys({CTX: ("context", None), GEN: ("generation", 16)})
    assert k.admit(0, CTX, "a:1", info(algo), fresh=True) is None
    assert k.admit(1, GEN, "b:1", info(tpb=16), fresh=True) is None
    assert k.configs() == {
        "context": {"tokens_per_block": 32, "kv_cache_hash_algo": algo},
        "generation": {"tokens_per_block": 16, "kv_cache_hash_algo": "v1_block_key"},
    }


def test_an_executor_disagreeing_with_the_role_s_algorithm_is_refused_one_per_role() -> None:
    k = keys()
    assert k.admit(0, CTX, "a:1", info("v2_sha256"), fresh=True) is None
    reason = k.admit(1, CTX, "b:1", info("v1_block_key"), fresh=True)
    assert reason is not None and "one hash algorithm per role" in reason
    assert k.admit(2, CTX, "c:1", info("v2_sha256_64"), fresh=True) is not None  # TensorRT-LLM tells them apart too
    # once the disagreeing one's role mates are gone, it is admitted (and decides the role)
    k.remove(0)
    assert k.admit(1, CTX, "b:1", info("v1_block_key"), fresh=True) is None
    assert k.configs()["context"]["kv_cache_hash_algo"] == "v1_block_key"


def test_events_override_server_info_and_move_role_mates_that_claim_the_same() -> None:
    # KV cache manager V2 with `auto` reports v1_block_key yet emits v2_sha256_64 keys
    k = keys()
    for slot in (0, 1):
        assert k.admit(slot, CTX, f"s{slot}:1", info("v1_block_key"), fresh=True) is None
    assert k.saw_algo(1, "v2_sha256_64") is True  # the role's key changed: republish
    assert k.configs()["context"]["kv_cache_hash_algo"] == "v2_sha256_64"
    assert k.algo_of(0) == "v2_sha256_64"  # presumed like its role mate until its own events tell
    assert k.saw_algo(0, "v2_sha256_64") is False
    # a new executor claiming v1_block_key is taken to behave the same, and admitted
    assert k.admit(2, CTX, "s2:1", info("v1_block_key"), fresh=True) is None
    # a refresh of a healthy executor's /server_info does not forget what its events said
    assert k.admit(1, CTX, "s1:1", info("v1_block_key"), fresh=False) is None
    assert k.configs()["context"]["kv_cache_hash_algo"] == "v2_sha256_64"


def test_executors_whose_events_disagree_leave_the_role_routing_by_load_only() -> None:
    k = keys()
    for slot in (0, 1):
        k.admit(slot, CTX, f"s{slot}:1", info("v1_block_key"), fresh=True)
    k.saw_algo(0, "v2_sha256_64")
    assert k.saw_algo(1, "v1_block_key") is True
    cfg = k.configs()["context"]
    assert cfg["kv_cache_hash_algo"] is None and "one hash algorithm per role" in cfg["error"]
    # the odd one restarts (its old events no longer hold) and is presumed like its mate again
    assert k.restarted(1) is True
    assert k.configs()["context"] == {"tokens_per_block": 32, "kv_cache_hash_algo": "v2_sha256_64"}


def test_roles_without_a_kv_cache_aware_router_admit_everything() -> None:
    k = keys()
    assert k.admit(5, GEN, "g:1", info("v9", tpb=7), fresh=True) is None
    assert k.aligned(5) and "generation" not in k.configs()
