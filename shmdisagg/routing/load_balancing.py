"""`load_balancing`: the server with the fewest active requests (or tokens with `use_tokens`),
summed over every fleet worker's row, so load added by any worker counts at once. Ties go
round-robin over the tied servers (TensorRT-LLM `LoadBalancingMixin`)."""

from __future__ import annotations

from shmdisagg.routing.policy import RoutingKey, TablePolicy


class LoadBalancingPolicy(TablePolicy):
    name = "load_balancing"

    def pick(self, key: RoutingKey, exclude_slot: int) -> int:
        return self.table.pick_least_loaded(self.row, self.role, exclude_slot, key.num_tokens, self.args.use_tokens)
