"""Routing policies, one module each; `POLICIES` is the only name table."""

from __future__ import annotations

from collections.abc import Callable

from shmdisagg.config import ConfigError, RouterConfig
from shmdisagg.routing.conversation import ConversationPolicy
from shmdisagg.routing.kv_cache_aware import KvCacheAwarePolicy, RoutingKeyConfig
from shmdisagg.routing.load_balancing import LoadBalancingPolicy
from shmdisagg.routing.policy import Policy, RoutingKey, TablePolicy
from shmdisagg.routing.round_robin import RoundRobinPolicy
from shmdisagg.shm.index import BlockIndex
from shmdisagg.shm.table import ControlTable

POLICIES: dict[str, type[TablePolicy]] = {
    p.name: p for p in (RoundRobinPolicy, LoadBalancingPolicy, KvCacheAwarePolicy, ConversationPolicy)
}
USES_INDEX = frozenset({KvCacheAwarePolicy.name, ConversationPolicy.name})

__all__ = ["POLICIES", "USES_INDEX", "Policy", "RoutingKey", "RoutingKeyConfig", "make_policy"]


def make_policy(
    table: ControlTable,
    row: int,
    role: int,
    args: RouterConfig,
    index: BlockIndex | None = None,
    key_config: Callable[[], RoutingKeyConfig | None] | None = None,
) -> Policy:
    """The policy named by `args.type` for one role. The index-backed policies need `index`
    (and `kv_cache_aware` the role's routing key, as the coordinator gives it: `key_config`,
    None until known). Raises `ConfigError`."""
    if args.type not in POLICIES:
        raise ConfigError(f"router.type: {args.type!r} is not one of {', '.join(POLICIES)}")
    if args.type in USES_INDEX and index is None:
        raise ConfigError(f"router.type: {args.type!r} needs the shared block index")
    if index is not None:
        if args.type == KvCacheAwarePolicy.name:
            return KvCacheAwarePolicy(table, row, role, args, index, key_config or (lambda: None))
        if args.type == ConversationPolicy.name:
            return ConversationPolicy(table, row, role, args, index)
    return POLICIES[args.type](table, row, role, args)
