"""A scripted OpenAI streaming server for bench tests, run in the test's own event loop.

Answers `POST /v1/completions` with deterministic SSE: an empty-text chunk first (TTFT must skip
it), one chunk of text per output token, an empty-text chunk carrying `finish_reason`, a usage
chunk with `prompt_tokens_details.cached_tokens`, then `[DONE]`. Cached tokens come from a prefix
cache over full 512-token blocks, filled in arrival order. `behaviour(n)` picks what the n-th
arriving request (0-based) gets: "ok", "http_500", "truncate" (closes before `[DONE]`),
"stream_error" or "hang" (sends headers, then nothing until the server stops). Records every
request body.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from array import array
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

BLOCK = 512


class FakeOpenAI:
    def __init__(
        self,
        port: int,
        behaviour: Callable[[int], str] = lambda n: "ok",
        cluster_info: bool = True,
        hold_until: int | None = None,
        model: str = "fake-model",
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.behaviour = behaviour
        self.cluster_info = cluster_info
        self.hold_until = hold_until
        self.model = model
        self.bodies: list[dict[str, Any]] = []
        self.cached: list[int] = []  # cached tokens answered, in arrival order
        self._seen: set[bytes] = set()
        self._all_arrived = asyncio.Event()
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> FakeOpenAI:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/cluster_info", self._cluster_info)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        self._closing.set()
        await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _cluster_info(self, request: web.Request) -> web.Response:
        if not self.cluster_info:
            raise web.HTTPNotFound()
        return web.json_response({"coordinator_pid": os.getpid(), "fleet_pids": []})

    def _cache(self, prompt: list[int]) -> int:
        """Longest cached run of full blocks, then remember every full block of this prompt."""
        h = hashlib.sha256()
        hit, missed = 0, False
        for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
            h.update(array("i", prompt[start : start + BLOCK]).tobytes())
            key = h.digest()
            if not missed and key in self._seen:
                hit += BLOCK
            else:
                missed = True
            self._seen.add(key)
        return hit

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        n = len(self.bodies)
        self.bodies.append(body)
        if self.hold_until is not None and len(self.bodies) >= self.hold_until:
            self._all_arrived.set()
        what = self.behaviour(n)
        if what == "http_500":
            return web.json_response(
                {"object": "error", "message": "scripted failure", "type": "InternalServerError", "code": 500},
                status=500,
            )
        prompt: list[int] = body["prompt"]
        cached = self._cache(prompt)
        self.cached.append(cached)
        if self.hold_until is not None:
            await self._all_arrived.wait()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-request-id": f"req-{n}"})
        await resp.prepare(request)

        def chunk(text: str, finish: str | None = None) -> bytes:
            return (
                b"data: "
                + orjson.dumps(
                    {
                        "id": f"cmpl-{n}",
                        "object": "text_completion",
                        "model": self.model,
                        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                        "usage": None,
                    }
                )
                + b"\n\n"
            )

        await resp.write(chunk(""))
        if what == "hang":
            await self._closing.wait()
            return resp
        max_tokens = int(body["max_tokens"])
        for i in range(max_tokens):
            if what == "truncate" and i == max_tokens // 2:
                return resp  # ends the body without [DONE]
            if what == "stream_error" and i == max_tokens // 2:
                await resp.write(b'data: {"object":"error","message":"scripted stream error","code":500}\n\n')
                await resp.write(b"data: [DONE]\n\n")
                return resp
            await resp.write(chunk(f" t{i}"))
        await resp.write(chunk("", finish="length"))
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": max_tokens,
            "total_tokens": len(prompt) + max_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        final = orjson.dumps({"id": f"cmpl-{n}", "choices": [], "usage": usage})
        await resp.write(b"data: " + final + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
