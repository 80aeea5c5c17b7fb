"""The routing key of each `kv_cache_aware` role: the block size and hash algorithm its prompts
are hashed with, decided in the coordinator from the executors' `/server_info` and KV events,
and given to the fleet workers as `routing_key_configs` in `/cluster_info`.

TensorRT-LLM's `KvCacheAwareRouter` (`serve/router.py`, primary id 54957247436:
`_prepare_server`, `routing_key_config`; `serve/router_utils.py` @00d403d7 `_init_block_hashing`) is matched as follows.

Block size (`tokens_per_block`): the router's value is
`TRTLLM_KVCACHE_AWARE_ROUTER_HASH_TOKENS_PER_BLOCK` if set, else the router arg, else the
section's `kv_cache_config.tokens_per_block` (`RouterConfig` via `ServerSection.router_args`).
Unset, it starts at 32 and adopts the first prepared executor's `/server_info.tokens_per_block`,
once. An executor reporting another block size is refused when neither size divides the other;
when one does, it is admitted but its KV events are not drained (they cannot align with the
router's hashes), and routed-block tracking alone finds its prefixes.

Hash algorithm: an executor's is its `/server_info.kv_cache_hash_algo` (absent: v1_block_key,
with one warning, as TensorRT-LLM assumes); one the router cannot compute (not in
`hashing.KV_CACHE_HASH_ALGOS`) refuses the executor. Its KV events' `hash_algo`, when they carry
one (an event without one counts as v1_block_key, as there), then overrides it
(`KvCacheAwareServerState.update_with_events` does the same: KV cache manager V2 configured with
`auto` reports v1_block_key but emits v2_sha256_64 keys). Executors
of a role that claim the same algorithm in `/server_info` are taken to emit the same events, so
the first one whose events reveal the real algorithm moves the role; one whose own events then
disagree with the role's leaves it with two algorithms.

One algorithm per role (TensorRT-LLM's `routing_key_config` raises "requires one hash algorithm
per role"): an executor whose algorithm differs from the one the role's admitted executors use
is refused at admission, named in one log line and in `/cluster_info` (`refused`), and gets no
traffic; the role's other executors route normally. If events later show two algorithms in one
role, that role routes by load alone (its `routing_key_configs` entry has `kv_cache_hash_algo:
null` and an `error`) until its executors agree again; logged once per disagreement.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from shmdisagg.hashing import KV_CACHE_HASH_ALGO_V1, KV_CACHE_HASH_ALGOS

log = logging.getLogger("shmdisagg.coordinator")

DEFAULT_TOKENS_PER_BLOCK = 32  # TensorRT-LLM's router default until an executor reports its own


@dataclass
class RoleKeys:
    """One kv_cache_aware role. `tokens_per_block` is the router's block size (`auto` until it
    adopted an executor's); per admitted executor slot: `claimed` (its `/server_info` algorithm),
    `seen` (the algorithm its events carry, once they did); `misaligned`: slots whose events are
    not drained; `algo`: the role's algorithm as last decided (kept while no executor is
    admitted), None while its executors disagree."""

    name: str
    tokens_per_block: int
    auto: bool
    claimed: dict[int, str] = field(default_factory=dict)
    seen: dict[int, str] = field(default_factory=dict)
    misaligned: set[int] = field(default_factory=set)
    algo: str | None = KV_CACHE_HASH_ALGO_V1
    error: str | None = None
    _warned: set[tuple[int, str]] = field(default_factory=set)

    def effective(self, slot: int, claim: str | None = None) -> str:
        """The algorithm `slot` emits: its events' if they told, else what an executor of the
        role claiming the same in `/server_info` emits, else its claim."""
        if slot in self.seen:
            return self.seen[slot]
        claim = claim if claim is not None else self.claimed[slot]
        for other in sorted(self.seen):
            if self.claimed.get(other) == claim:
                return self.seen[other]
        return claim

    def algos(self, skip: int = -1) -> set[str]:
        return {self.effective(s) for s in self.claimed if s != skip}

    def decide(self) -> bool:
        """Recompute `algo` / `error`; True if the role's routing key changed."""
        before = (self.algo, self.error)
        algos = self.algos()
        if len(algos) == 1:
            self.algo, self.error = algos.pop(), None
        elif len(algos) > 1:
            who = ", ".join(f"slot {s}: {self.effective(s)}" for s in sorted(self.claimed))
            self.algo, self.error = (
                None,
                f"one hash algorithm per role; the {self.name} executors' KV events use several ({who}): routing "
                "by load only",
            )
            if before[1] != self.error:
                log.error("%s role: %s", self.name, self.error)
        return (self.algo, self.error) != before

    def config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens_per_block": self.tokens_per_block, "kv_cache_hash_algo": self.algo}
        if self.error:
            out["error"] = self.error
        return out


class RoutingKeys:
    """The routing keys of the `kv_cache_aware` roles. `roles`: role number -> (name, the
    router's tokens_per_block or None for auto). Other roles are not tracked: every executor of
    theirs is admitted."""

    def __init__(self, roles: dict[int, tuple[str, int | None]]) -> None:
        self.roles = {
            role: RoleKeys(name, tpb or DEFAULT_TOKENS_PER_BLOCK, tpb is None) for role, (name, tpb) in roles.items()
        }

    def admit(self, slot: int, role: int, addr: str, info: dict[str, Any], fresh: bool) -> str | None:
        """Check a prepared executor's `/server_info`; None admits it (recording its block size
        and algorithm), else the one-line reason it is refused (nothing recorded). `fresh`: a new
        preparation (first, or after it was unhealthy), whose events are to be learnt anew."""
        rk = self.roles.get(role)
        if rk is None:
            return None
        claim = info.get("kv_cache_hash_algo")
        if claim is None:
            claim = KV_CACHE_HASH_ALGO_V1
            if (slot, "no-algo") not in rk._warned:
                rk._warned.add((slot, "no-algo"))
                log.warning("%s did not expose kv_cache_hash_algo in /server_info; assuming %s", addr, claim)
        if claim not in KV_CACHE_HASH_ALGOS:
            return f"kv_cache_hash_algo {claim!r} is not one the router computes ({', '.join(KV_CACHE_HASH_ALGOS)})"
        if fresh:
            rk.seen.pop(slot, None)
        mine = rk.effective(slot, claim)
        others = rk.algos(skip=slot)
        if len(others) == 1 and mine not in others:
            return (
                f"kv_cache_hash_algo {mine} differs from {others.pop()} of the role's other executors: "
                "one hash algorithm per role"
            )
        worker_tpb = info.get("tokens_per_block")
        if worker_tpb is not None and (
            isinstance(worker_tpb, bool) or not isinstance(worker_tpb, int) or worker_tpb < 1
        ):
            return f"tokens_per_block {worker_tpb!r} in /server_info is not a positive integer"
        if worker_tpb is not None and not rk.auto and worker_tpb != rk.tokens_per_block:
            big, small = max(worker_tpb, rk.tokens_per_block), min(worker_tpb, rk.tokens_per_block)
            if big % small:
                return (
                    f"tokens_per_block {worker_tpb} and the router's {rk.tokens_per_block} do not divide each other; "
                    "align kv_cache_config.tokens_per_block so that one evenly divides the other"
                )
        # admitted: record it
        if worker_tpb is not None and rk.auto:
            if worker_tpb != rk.tokens_per_block:
                log.info("%s router tokens_per_block unset: adopting %d from %s", rk.name, worker_tpb, addr)
            rk.tokens_per_block, rk.auto = worker_tpb, False
        if worker_tpb is not None and worker_tpb != rk.tokens_per_block:
            if slot not in rk.misaligned:
                log.warning(
                    "%s reports tokens_per_block %d, the router uses %d: its KV events cannot align with the router's "
                    "block hashes and are not drained; routed-block tracking alone finds its prefixes",
                    addr,
                    worker_tpb,
                    rk.tokens_per_block,
                )
            rk.misaligned.add(slot)
        else:
            rk.misaligned.discard(slot)
        rk.claimed[slot] = claim
        rk.decide()
        return None

    def remove(self, slot: int) -> bool:
        """The executor left (unhealthy, refused). True if its role's routing key changed."""
        for rk in self.roles.values():
            if rk.claimed.pop(slot, None) is not None:
                rk.seen.pop(slot, None)
                return rk.decide()
        return False

    def restarted(self, slot: int) -> bool:
        """Its KV events show a new incarnation: what its old events said no longer holds."""
        for rk in self.roles.values():
            if rk.seen.pop(slot, None) is not None:
                return rk.decide()
        return False

    def saw_algo(self, slot: int, algo: str) -> bool:
        """An event of `slot` carries `hash_algo` `algo` (one of KV_CACHE_HASH_ALGOS). True if
        its role's routing key changed (the caller republishes, so workers re-read it)."""
        for rk in self.roles.values():
            if slot in rk.claimed:
                if rk.seen.get(slot) == algo:
                    return False
                if rk.effective(slot) != algo:
                    log.warning(
                        "slot %d: its KV events carry hash_algo %s, its /server_info said %s; following the events "
                        "(as TensorRT-LLM's router does)",
                        slot,
                        algo,
                        rk.claimed[slot],
                    )
                rk.seen[slot] = algo
                return rk.decide()
        return False

    def aligned(self, slot: int) -> bool:
        """Whether `slot`'s KV events are drained (its block size is the router's)."""
        return not any(slot in rk.misaligned for rk in self.roles.values())

    def algo_of(self, slot: int) -> str | None:
        """The algorithm an admitted executor's prompts are hashed with, or None."""
        for rk in self.roles.values():
            if slot in rk.claimed:
                return rk.effective(slot)
        return None

    def configs(self) -> dict[str, dict[str, Any]]:
        """`routing_key_configs` of `/cluster_info`: role name -> {tokens_per_block,
        kv_cache_hash_algo (None: route by load only), error (only when set)}."""
        return {rk.name: rk.config() for rk in self.roles.values()}
