"""The routing policy contract.

A policy chooses one server of one role for a request and records the load it adds in the
caller's own counter row, in a single native call against the shared table; the caller releases
that load exactly once, with the same token count, when the leg ends. A policy never sees
servers that are absent, unhealthy, of the other role, or excluded: the native pick filters them
before scoring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from shmdisagg.config import RouterConfig
from shmdisagg.shm.table import ControlTable


@dataclass(frozen=True, slots=True)
class RoutingKey:
    """What a policy may look at: the load the request adds (tokens) and, when known, its ids."""

    num_tokens: int
    token_ids: list[int] | None = None


class Policy(Protocol):
    name: ClassVar[str]

    def pick(self, key: RoutingKey, exclude_slot: int) -> int:
        """Slot of the chosen server with its load already added, or -1 when none is eligible."""
        ...

    def release(self, slot: int, key: RoutingKey) -> None:
        """Remove the load `pick` added for `key` on `slot`."""
        ...


class TablePolicy:
    """Shared plumbing: which table, row and role a policy works on."""

    name: ClassVar[str] = ""

    def __init__(self, table: ControlTable, row: int, role: int, args: RouterConfig) -> None:
        self.table = table
        self.row = row
        self.role = role
        self.args = args

    def release(self, slot: int, key: RoutingKey) -> None:
        self.table.release(self.row, slot, key.num_tokens)
