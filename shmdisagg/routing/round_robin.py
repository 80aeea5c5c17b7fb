"""`round_robin`: one ticket counter per role for the whole fleet, so servers are cycled
globally (TensorRT-LLM's fleet keeps one counter per worker process instead)."""

from __future__ import annotations

from shmdisagg.routing.policy import RoutingKey, TablePolicy


class RoundRobinPolicy(TablePolicy):
    name = "round_robin"

    def pick(self, key: RoutingKey, exclude_slot: int) -> int:
        return self.table.pick_round_robin(self.row, self.role, exclude_slot, key.num_tokens)
