"""A worker's cached view of the executors published in the shared table.

The table holds each server's address in a seqlocked record; reading and decoding it costs
microseconds, so workers cache `slot -> (host, port)` and re-read only when the table's
`servers_version` changes (one native load per lookup).
"""

from __future__ import annotations

from shmdisagg.hostport import authority
from shmdisagg.shm.table import ROLE_CONTEXT, ROLE_GENERATION, ControlTable, ServerInfo


def split_addr(addr: str) -> tuple[str, int]:
    """'host:port' (or '[v6]:port') -> (host, port)."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class ServerDirectory:
    """`slot -> (host, port)` for the servers in `table`, refreshed on `servers_version` change."""

    def __init__(self, table: ControlTable) -> None:
        self.table = table
        self._version = -1
        self._addr: dict[int, tuple[str, int]] = {}
        self._servers: list[ServerInfo] = []
        self._healthy = (0, 0)

    def _refresh(self) -> None:
        version = self.table.servers_version()
        if version != self._version:
            servers = self.table.servers()
            self._servers = servers
            self._addr = {s.slot: split_addr(s.addr) for s in servers}
            self._healthy = (
                sum(1 for s in servers if s.healthy and s.role == ROLE_CONTEXT),
                sum(1 for s in servers if s.healthy and s.role == ROLE_GENERATION),
            )
            self._version = version

    def address(self, slot: int) -> tuple[str, int]:
        """Address of `slot`. Raises KeyError if the slot holds no server."""
        self._refresh()
        return self._addr[slot]

    def label(self, slot: int) -> str:
        """`host:port` of `slot` for log lines (`slot N` if it holds no server now)."""
        self._refresh()
        addr = self._addr.get(slot)
        if addr is None:
            return f"slot {slot}"
        return authority(*addr)

    def servers(self) -> list[ServerInfo]:
        self._refresh()
        return self._servers

    def healthy_counts(self) -> tuple[int, int]:
        """(healthy context servers, healthy generation servers); counted once per
        `servers_version` (a health change bumps it), so a request can ask."""
        self._refresh()
        return self._healthy
