"""The live view shows every number of a snapshot, and "-" for what the deployment lacks."""

from __future__ import annotations

from rich.console import Console

from shmdisagg.stats.view import render

SNAP = {
    "schema": "shmdisagg.stats/1",
    "prefix": "shmdisagg-1000-8000",
    "time": "2026-01-01T12:00:00+00:00",
    "interval_s": 1.0,
    "coordinator": {
        "pid": 10,
        "incarnation": 255,
        "state": "running",
        "heartbeat_age_s": 0.05,
        "events_applied_per_s": None,
        "event_lag_ms": None,
    },
    "servers": [
        {
            "slot": 0,
            "addr": "127.0.0.1:8101",
            "role": "context",
            "healthy": True,
            "incarnation": 1,
            "active_requests": 3,
            "active_tokens": 4096,
            "routed": 120,
            "routed_per_s": 4.5,
            "kv_blocks": None,
            "prompt_tokens": 10.0,
            "cached_tokens": 5.0,
            "hit_rate": 0.5,
        },
        {
            "slot": 2,
            "addr": "127.0.0.1:8201",
            "role": "generation",
            "healthy": False,
            "incarnation": 1,
            "active_requests": 0,
            "active_tokens": 0,
            "routed": 7,
            "routed_per_s": None,
            "kv_blocks": None,
            "prompt_tokens": None,
            "cached_tokens": None,
            "hit_rate": None,
        },
    ],
    "workers": [
        {
            "worker": 1,
            "row": 0,
            "pid": 11,
            "heartbeat_age_s": 0.1,
            "legs_in_flight": 2,
            "legs_dispatched": 9,
            "legs_per_s": 1.5,
            "requests": 5.0,
            "requests_in_flight": 1.0,
            "requests_per_s": 0.75,
        }
    ],
    "fleet": {"workers": 1, "legs_in_flight": 2, "legs_dispatched": 9, "legs_per_s": 1.5},
    "requests": {
        "total_requests": 5.0,
        "total_responses": 4.0,
        "validation_exceptions": 0.0,
        "http_exceptions": 0.0,
        "internal_errors": 0.0,
        "shmdisagg_admission_rejections": 0.0,
        "ctx_retry_requests": 1.0,
        "gen_retry_requests": 0.0,
        "in_flight": 1.0,
        "requests_per_s": 0.75,
        "hit_rate": 0.5,
        "shmdisagg_client_disconnects": 3.0,
        "shmdisagg_worker_lost_requests": 0.0,
        "shmdisagg_routed_client_errors": 0.0,
        "cancelled": 3.0,
        "client_errors": 0.0,
        "failed": 0.0,
        "lost": 0.0,
    },
    "index": None,
}


def text_of(snap: dict) -> str:  # type: ignore[type-arg]
    console = Console(record=True, width=160)
    console.print(render(snap))
    return console.export_text()


def test_the_view_shows_servers_workers_and_the_coordinator() -> None:
    out = text_of(SNAP)
    for expected in (
        "127.0.0.1:8101",
        "DOWN",
        "4,096",
        "50.0 %",
        "0.8",
        "incarnation 0xff",
        "running",
        "no block index published",
        "1 retries",
    ):
        assert expected in out, expected


def test_missing_numbers_show_as_a_dash() -> None:
    out = text_of(
        {
            **SNAP,
            "requests": None,
            "index": {
                "generation": 2,
                "capacity": 1024,
                "entries": 10,
                "used": 12,
                "load_factor": 12 / 1024,
                "max_probe": 3,
                "events_applied": 40,
                "events_dropped": 0,
                "events_applied_per_s": 4.0,
                "event_lag_ms": None,
            },
        }
    )
    assert "requests     - (no metrics segment)" in out
    assert "generation 2" in out and "longest probe 3" in out and "lag - ms" in out


def test_the_view_shows_cancelled_requests_and_the_coordinators_worker_numbers() -> None:
    out = text_of(SNAP)
    assert "3 cancelled" in out and "lost" not in out
    header = next(line for line in out.splitlines() if "┃" in line and "heartbeat" in line)
    assert "worker" in header and "table row" in header
    row = next(line for line in out.splitlines() if " 11 " in line and "0.10 s" in line)
    assert [c.strip() for c in row.split("│")[1:4]] == ["1", "0", "11"]  # fleet worker 1, in table row 0


def test_requests_the_public_port_refused_show_below_the_total_only_when_there_are_some() -> None:
    assert "refused at the public port" not in text_of(SNAP)
    out = text_of({**SNAP, "requests": {**SNAP["requests"], "refused_at_port": 7.0}})
    assert "+ 7 refused at the public port" in out
    assert "5 total" in out  # not added to the total: no route saw them


def test_a_stale_deployment_says_so_and_shows_no_server_as_ok() -> None:
    reason = (
        "coordinator pid 10 is gone: stale segments; the next `shmdisagg launch` or `shmdisagg serve` of "
        "this deployment removes them"
    )
    snap = {
        **SNAP,
        "state": "stale",
        "stale_reason": reason,
        "coordinator": {**SNAP["coordinator"], "state": "stale", "alive": False},
        "servers": [{**s, "healthy": True} for s in SNAP["servers"]],
        "workers": [{**SNAP["workers"][0], "alive": False}],
    }
    out = text_of(snap)
    assert "STALE" in out and reason in out
    servers = [line for line in out.splitlines() if "127.0.0.1:8" in line]
    assert len(servers) == 2 and all("stale" in line and " ok " not in line for line in servers)
    assert "running" not in out and "gone" in out


def test_every_cell_is_padded_on_both_sides() -> None:
    out = text_of(SNAP)
    rows = [line for line in out.splitlines() if line[:1] in ("┃", "│")]
    assert len(rows) == 5  # two headers, two servers, one worker
    for line in rows:  # the edge cells too: "│ 0 │ ... │ 50.0 % │", not "│0 │ ... │50.0 %│"
        assert line[1] == " " and line[-2] == " ", line
