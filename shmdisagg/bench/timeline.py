"""What `--plot` records during a run: per-request times, and the servers' load over time.

`LoadSampler` scrapes the server's Prometheus `/metrics` every `interval_s` while the load runs
and keeps `shmdisagg_server_active_requests` per server (a shmdisagg deployment reports the
whole fleet's load from its shared table in every scrape). Against a server without that metric
(or without `/metrics`) it stops after the first scrape and the load plot is left out.

`timeline(records, origin, samples)` is the `timeline` object written into the summary JSON, so
a later `--plot-only --compare A.json B.json` can redraw and compare runs. Times are seconds
since the run's origin (the summary's `duration_s` clock).
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import aiohttp

from shmdisagg.bench.client import RequestRecord
from shmdisagg.bench.metrics import e2e_ms, ttft_ms
from shmdisagg.tasks import stop_task

_SAMPLE = re.compile(r"^(shmdisagg_server_active_requests)\{([^}]*)\} ([0-9.eE+\-]+|NaN)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_server_load(text: str) -> dict[str, tuple[str, float]]:
    """`server -> (role, active requests)` from a Prometheus text exposition."""
    out: dict[str, tuple[str, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = dict(_LABEL.findall(m.group(2)))
            out[labels.get("server", "?")] = (labels.get("role", ""), float(m.group(3)))
    return out


class LoadSampler:
    """State: `times` (perf_counter seconds), `loads` (server -> active requests per sample),
    `roles` (server -> role), `available` (False once the server showed no such metric)."""

    def __init__(self, session: aiohttp.ClientSession, url: str, interval_s: float = 0.5) -> None:
        self.session = session
        self.url = url.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self.times: list[float] = []
        self.loads: dict[str, list[float | None]] = {}
        self.roles: dict[str, str] = {}
        self.available = True
        self._task: asyncio.Task[None] | None = None

    async def sample_once(self) -> None:
        try:
            async with self.session.get(self.url, timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                text = await r.text() if r.status == 200 else ""
        except (TimeoutError, aiohttp.ClientError, OSError):
            return  # a missed sample; keep going
        loads = parse_server_load(text)
        if not loads:
            self.available = False
            return
        n = len(self.times)
        self.times.append(time.perf_counter())
        for server, (role, value) in loads.items():
            self.roles[server] = role
            self.loads.setdefault(server, [None] * n).append(value)
        for series in self.loads.values():
            if len(series) < n + 1:
                series.append(None)

    async def _run(self) -> None:
        while self.available:
            await self.sample_once()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None


def timeline(records: list[RequestRecord], origin: float, sampler: LoadSampler | None) -> dict[str, Any]:
    """The summary's `timeline`: per request (in send order) and the sampled server load."""
    recs = sorted(records, key=lambda r: r.send)
    out: dict[str, Any] = {
        "requests": {
            "send_s": [r.send - origin for r in recs],
            "end_s": [(r.end - origin) if r.end is not None else None for r in recs],
            "ok": [r.ok for r in recs],
            "ttft_ms": [ttft_ms(r) if r.ok else None for r in recs],
            "e2e_ms": [e2e_ms(r) if r.ok else None for r in recs],
            "output_tokens": [r.output_tokens for r in recs],
            "prompt_tokens": [r.prompt_tokens if r.prompt_tokens is not None else r.input_length for r in recs],
            "cached_tokens": [r.cached_tokens for r in recs],
        },
        "server_load": None,
    }
    if sampler is not None and sampler.times:
        out["server_load"] = {
            "t_s": [t - origin for t in sampler.times],
            "servers": {
                s: {"role": sampler.roles.get(s, ""), "active_requests": v} for s, v in sorted(sampler.loads.items())
            },
        }
    return out
