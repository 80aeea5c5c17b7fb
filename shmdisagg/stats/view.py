"""The live view of a stats snapshot (rich renderables); formats only, computes nothing."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text


def _n(value: Any, fmt: str = "{:,.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _age(seconds: float) -> Text:
    style = "red" if seconds > 2.0 else ("yellow" if seconds > 0.75 else "")
    return Text(f"{seconds:.2f} s", style=style)


def render(snap: dict[str, Any]) -> RenderableType:
    c = snap["coordinator"]
    head = Text()
    head.append("shmdisagg stats", style="bold")
    head.append(f"  {snap['prefix']}  {snap['time'][11:19]} UTC  every {_n(snap['interval_s'], '{:.1f}')} s\n")
    stale = snap.get("state") == "stale"
    head.append(f"coordinator  pid {c['pid']}  incarnation {c['incarnation']:#x}  ")
    head.append(
        c["state"].upper() if stale else c["state"],
        style="bold red" if stale else ("green" if c["state"] == "running" else "yellow"),
    )
    head.append("  heartbeat ")
    head.append_text(_age(c["heartbeat_age_s"]))
    head.append(f"  events {_rate(c['events_applied_per_s'])}/s  lag {_n(c['event_lag_ms'], '{:.2f}')} ms")
    if stale:
        head.append(f"\nSTALE        {snap.get('stale_reason') or 'the coordinator is gone'}", style="bold red")
        head.append(f"\n             (/dev/shm/{snap['prefix']}-*; everything below is its last word)", style="red")
    req = snap.get("requests")
    if req is not None:
        # the parts add up to the total: in flight + ok + cancelled + 4xx + failed + 429 (+ lost)
        lost = req.get("lost") or 0
        at_port = req.get("refused_at_port") or 0
        head.append(
            f"\nrequests     {_n(req['total_requests'])} total  {_rate(req['requests_per_s'])}/s  "
            f"{_n(req['in_flight'])} in flight  {_n(req['total_responses'])} ok  "
            f"{_n(req.get('cancelled', 0))} cancelled  "
            f"{_n(req['client_errors'])} 4xx  {_n(req['failed'])} failed  "
            f"{_n(req['shmdisagg_admission_rejections'])} 429  "
            + (f"{_n(lost)} lost  " if lost else "")
            + f"{_n(req['ctx_retry_requests'] + req['gen_retry_requests'])} retries  hit {_pct(req['hit_rate'])}"
            # not part of the total: shown only when not 0, as `lost`
            + (
                f"\n             + {_n(at_port)} refused at the public port (413, 431, 408, bad HTTP)"
                if at_port
                else ""
            )
        )
    else:
        head.append("\nrequests     - (no metrics segment)")

    slots = snap.get("server_slots")
    servers = Table(
        title=f"servers ({len(snap['servers'])} of {slots} slots)" if slots else "servers",
        title_justify="left",
        expand=False,
    )
    for col, just in (
        ("slot", "right"),
        ("role", "left"),
        ("server", "left"),
        ("health", "left"),
        ("active req", "right"),
        ("active tok", "right"),
        ("routed", "right"),
        ("routed/s", "right"),
        ("KV blocks", "right"),
        ("hit", "right"),
    ):
        servers.add_column(col, justify=just)  # type: ignore[arg-type]  # str, not rich's Literal
    for s in snap["servers"]:
        servers.add_row(
            str(s["slot"]),
            ("ctx" if s["role"] == "context" else "gen"),
            s["addr"],
            Text("stale", style="red")
            if stale
            else (Text("ok", style="green") if s["healthy"] else Text("DOWN", style="bold red")),
            _n(s["active_requests"]),
            _n(s["active_tokens"]),
            _n(s["routed"]),
            _rate(s["routed_per_s"]),
            _n(s["kv_blocks"]),
            _pct(s["hit_rate"]),
        )

    fleet = snap["fleet"]
    workers = Table(
        title=f"fleet workers ({fleet['workers']}; {_n(fleet['legs_in_flight'])} legs in flight, "
        f"{_rate(fleet['legs_per_s'])} legs/s)",
        title_justify="left",
    )
    # "worker" is the coordinator's fleet index ("fleet worker N" in its log, /cluster_info's
    # worker_index); "table row" the control table row that process claimed
    for col in (
        "worker",
        "table row",
        "pid",
        "heartbeat",
        "req in flight",
        "req/s",
        "requests",
        "legs in flight",
        "legs/s",
    ):
        workers.add_column(col, justify="right")
    for w in snap["workers"]:
        gone = w.get("alive") is False
        workers.add_row(
            _n(w.get("worker")),
            str(w["row"]),
            Text(str(w["pid"]), style="red") if gone else str(w["pid"]),
            Text("gone", style="red") if gone else _age(w["heartbeat_age_s"]),
            _n(w["requests_in_flight"]),
            _rate(w["requests_per_s"]),
            _n(w["requests"]),
            _n(w["legs_in_flight"]),
            _rate(w["legs_per_s"]),
        )

    ix = snap.get("index")
    if ix is None:
        index = Text("index        - (no block index published)")
    else:
        index = Text(
            f"index        generation {ix['generation']}  entries {_n(ix['entries'])}  "
            f"load factor {_n(ix['load_factor'], '{:.3f}')}  longest probe {_n(ix['max_probe'])}  "
            f"capacity {_n(ix['capacity'])}\n"
            f"             events {_n(ix['events_applied'])} ({_rate(ix['events_applied_per_s'])}/s, "
            f"{_n(ix['events_dropped'])} dropped)  lag {_n(ix['event_lag_ms'], '{:.2f}')} ms"
        )
    parts: list[RenderableType] = [head, servers, workers, index]
    for err in snap.get("errors", []):
        parts.append(Text(f"warning: {err}", style="yellow"))
    return Group(*parts)
