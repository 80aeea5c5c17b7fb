"""The context executor's `/sim/kv_transfer` route when its puller leaves in the same loop
iteration as the context request fails: nobody is answered and nothing is raised into the ASGI
server (the chaos suite's disconnecting clients saw "Exception in ASGI application" from it)."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import orjson

from shmdisagg.executors.sim.app import SimApp
from shmdisagg.executors.sim.config import SimConfig
from shmdisagg.executors.sim.errors import SimError
from shmdisagg.executors.sim.transfer import TransferTable


async def _pull_left_as_the_context_request_failed() -> list[dict[str, Any]]:
    app = SimApp(SimConfig(role="context"))
    table = TransferTable(timeout_s=5.0, release=lambda seq: None)
    app.engine.transfers = table
    seq = types.SimpleNamespace(ctx_request_id=7)  # registered, prefill not done
    table._entry(7).seq = seq  # type: ignore[assignment]
    gone = asyncio.Event()
    body = orjson.dumps({"ctx_request_id": 7, "hold_s": 0.0})
    messages = iter([{"type": "http.request", "body": body, "more_body": False}])

    async def receive() -> dict[str, Any]:
        message = next(messages, None)
        if message is not None:
            return message
        await gone.wait()
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    route = asyncio.ensure_future(app._sim_kv_transfer({"type": "http"}, receive, send))
    while not table.entries[7].pulled:
        await asyncio.sleep(0)  # until the route waits on the context request
    gone.set()  # the puller leaves ...
    table.failed(seq, SimError("context request aborted"))  # ... as its context request is aborted
    await asyncio.wait_for(route, 5.0)  # raises what the route raised
    return sent


def test_a_pull_whose_puller_left_as_the_context_request_failed_answers_nobody_and_raises_nothing() -> None:
    assert asyncio.run(_pull_left_as_the_context_request_failed()) == []
