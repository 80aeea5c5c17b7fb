"""Fault injection: parse fault specs (`--fault`, `POST /sim/fault`) and decide, per request,
what an active fault does to it. Never touches sockets; `app.py` acts on the verdicts.

Kinds and their parameters (CLI form `kind:key=value,key=value`; JSON form `{"kind": ..., key: value}`):

| kind                  | parameters                                  | effect |
|-----------------------|---------------------------------------------|--------|
| crash                 | after=N (default: at once)                  | `os._exit(1)` when inference request N+1 arrives; without `after`, right away |
| hang                  | after=N (default 0)                         | once N inference requests have arrived, every request except `/sim/*` is accepted and never answered (until the fault is cleared) |
| slow                  | factor=X                                    | every modelled time (iteration, overhead, KV transfer) is multiplied by X |
| error                 | status=500, rate=1.0, count=N, message=...  | an inference request is answered with `status` and an OpenAI error body, with probability `rate`, for the next `count` requests only if set |
| disconnect_mid_stream | after_chunks=1, rate=1.0, count=N           | a streamed response is cut (connection closed, no `[DONE]`) after `after_chunks` data chunks |

`{"kind": "clear"}` (or `clear` on the CLI) removes every fault; `{"kind": "clear", "target": k}`
removes faults of kind k. Randomness (`rate`) uses the executor's `--seed`, so runs repeat.
"""  # noqa: E501 (a markdown table above: its rows cannot wrap)

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

from shmdisagg.executors.sim.errors import ConfigError

FAULT_KINDS = ("crash", "hang", "slow", "error", "disconnect_mid_stream")


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    after: int | None = None
    factor: float = 1.0
    status: int = 500
    rate: float = 1.0
    count: int | None = None
    after_chunks: int = 1
    message: str = "injected fault"

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ConfigError(f"unknown fault kind {self.kind!r}; known: {', '.join(FAULT_KINDS)}")
        if self.after is not None and self.after < 0:
            raise ConfigError("fault 'after' must be >= 0")
        if self.factor <= 0:
            raise ConfigError("fault 'factor' must be > 0")
        if not 400 <= self.status <= 599:
            raise ConfigError("fault 'status' must be an HTTP error status (400-599)")
        if not 0.0 <= self.rate <= 1.0:
            raise ConfigError("fault 'rate' must be within [0, 1]")
        if self.count is not None and self.count < 1:
            raise ConfigError("fault 'count' must be >= 1")
        if self.after_chunks < 0:
            raise ConfigError("fault 'after_chunks' must be >= 0")

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """`kind` or `kind:key=value,key=value` (the `--fault` syntax)."""
        kind, _, rest = text.strip().partition(":")
        params: dict[str, Any] = {}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise ConfigError(f"fault parameter {item!r} is not key=value")
            params[key.strip()] = value.strip()
        return cls.from_dict({"kind": kind.strip(), **params})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FaultSpec:
        known = {f.name: f for f in fields(cls)}
        unknown = set(data) - set(known)
        if unknown:
            raise ConfigError(f"unknown fault parameter(s): {', '.join(sorted(unknown))}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            kwargs[key] = _coerce(key, value)
        if "kind" not in kwargs:
            raise ConfigError("a fault needs a 'kind'")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _coerce(key: str, value: Any) -> Any:
    try:
        if key in ("kind", "message"):
            if not isinstance(value, str):
                raise TypeError
            return value
        if key in ("after", "count", "status", "after_chunks"):
            if value is None and key in ("after", "count"):
                return None
            if isinstance(value, bool) or isinstance(value, float):
                raise TypeError
            return int(value)
        if key in ("factor", "rate"):
            if isinstance(value, bool):
                raise TypeError
            return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"bad value for fault parameter {key!r}: {value!r}") from None
    raise ConfigError(f"unknown fault parameter {key!r}")  # pragma: no cover - from_dict checks names


@dataclass(frozen=True)
class Verdict:
    """What to do with one inference request: answer with an error, or cut its stream."""

    error: FaultSpec | None = None
    disconnect_after_chunks: int | None = None


class FaultState:
    """Active faults of this executor. Fields: `faults` (active specs in arrival order),
    `requests_seen` (inference requests counted so far), `_counts` (remaining hits of a spec
    with `count`), `_unhung` (set while no hang is active)."""

    def __init__(self, seed: int = 0, exit_fn: Callable[[int], Any] = os._exit) -> None:
        self.faults: list[FaultSpec] = []
        self.requests_seen = 0
        self._counts: dict[int, int] = {}
        self._rng = random.Random(seed)
        self._exit = exit_fn
        self._unhung = asyncio.Event()
        self._unhung.set()

    # -- configuration ----------------------------------------------------------------------
    def add(self, spec: FaultSpec) -> None:
        self.faults.append(spec)
        if spec.count is not None:
            self._counts[id(spec)] = spec.count
        self._refresh_hang()

    def clear(self, kind: str | None = None) -> None:
        self.faults = [f for f in self.faults if kind is not None and f.kind != kind]
        self._counts = {k: v for k, v in self._counts.items() if any(id(f) == k for f in self.faults)}
        self._refresh_hang()

    def describe(self) -> list[dict[str, Any]]:
        return [f.to_dict() for f in self.faults]

    @property
    def crash_at_once(self) -> bool:
        return any(f.kind == "crash" and f.after is None for f in self.faults)

    @property
    def slow_factor(self) -> float:
        factor = 1.0
        for f in self.faults:
            if f.kind == "slow":
                factor *= f.factor
        return factor

    # -- per request ---------------------------------------------------------------------------
    @property
    def hanging(self) -> bool:
        return not self._unhung.is_set()

    async def wait_unhung(self) -> None:
        await self._unhung.wait()

    def on_inference_request(self) -> Verdict:
        """Count one inference request and decide its fate (may exit the process)."""
        self.requests_seen += 1
        for f in self.faults:
            if f.kind == "crash" and f.after is not None and self.requests_seen > f.after:
                self._exit(1)
        self._refresh_hang()
        error = self._pick("error")
        cut = self._pick("disconnect_mid_stream")
        return Verdict(error=error, disconnect_after_chunks=None if cut is None else cut.after_chunks)

    def _pick(self, kind: str) -> FaultSpec | None:
        for f in self.faults:
            if f.kind != kind:
                continue
            if f.rate < 1.0 and self._rng.random() >= f.rate:
                continue
            if f.count is not None:
                left = self._counts.get(id(f), 0)
                if left <= 0:
                    continue
                self._counts[id(f)] = left - 1
                if left == 1:
                    self.faults.remove(f)
            return f
        return None

    def _refresh_hang(self) -> None:
        hang = any(f.kind == "hang" and self.requests_seen >= (f.after or 0) for f in self.faults)
        if hang:
            self._unhung.clear()
        else:
            self._unhung.set()
