"""Routing policies, one module each; `POLICIES` is the only name table."""

from __future__ import annotations

from shmdisagg.config import ConfigError, RouterConfig
from shmdisagg.routing.load_balancing import LoadBalancingPolicy
from shmdisagg.routing.policy import Policy, RoutingKey, TablePolicy
from shmdisagg.routing.round_robin import RoundRobinPolicy
from shmdisagg.shm.table import ControlTable

POLICIES: dict[str, type[TablePolicy]] = {p.name: p for p in (RoundRobinPolicy, LoadBalancingPolicy)}

__all__ = ["POLICIES", "Policy", "RoutingKey", "make_policy"]


def make_policy(table: ControlTable, row: int, role: int, args: RouterConfig) -> Policy:
    """The policy named by `args.type` for one role. Raises `ConfigError` for a type this
    version does not implement."""
    cls = POLICIES.get(args.type)
    if cls is None:
        raise ConfigError(f"router.type: {args.type!r} is not available in this version (have: {', '.join(POLICIES)})")
    return cls(table, row, role, args)
