"""A recording fake `trtllm-serve` executor for request-flow tests.

It answers the endpoints the orchestrator uses with scripted responses and records every
completion request it receives (`GET /_recorded`). `POST /_script` changes its behaviour:

- `finish_reason`: the context leg's finish reason (default "length")
- `status`: answer completions with this HTTP status and an OpenAI error body
- `chunks`: number of SSE chunks a streamed generation leg sends (default 4)
- `hold`: streamed generation legs wait after their first chunk until `POST /_release`
- `delay_s`: wait this long before answering a completion (bounded by the test's own timeout)
- `omit_ids`: the context answer carries no `ctx_request_id` / `disagg_request_id`
- `chunk_interval_s`: pause between streamed chunks (one chunk per socket write, as engines pace tokens)
- `stream_finish_reason`: the last streamed chunk's `finish_reason` (default "length"; null: none)
- `gen_choices`: choices in a non-streaming generation answer (default 1)
- `completion_tokens`: usage's completion tokens of a generation answer (default 1; streams send a usage chunk when set)
- `leak`: generation answers and chunks carry `disaggregated_params` (echoed), `prompt_token_ids`
  and a `kv_transfer_params` naming this executor, as a careless executor might
- `error_message`: the message of scripted error bodies (default "scripted <status>")
- `stream_error`: a streamed generation leg sends this SSE error event after its first chunk and ends
- `stream_as_json`: a streamed generation leg is answered as a non-streaming one (one JSON body,
  `application/json`), as a misbehaving executor might
- `auth_key`: verify the `x-trtllm-disagg-auth` signature of requests carrying protected handoff
  fields and refuse them with 400 when it is missing or wrong, as a worker holding
  `internal_request_auth_key` does (`validate_internal_disagg_request`, disagg_auth.py)
- `perf_metrics`: the worker's `return_perf_metrics` (default true): a request sent with
  `X-TRTLLM-return-metrics: 1` gets upstream's per-request metrics as TensorRT-LLM's worker
  sends them (`PerfMetricsMiddleware`, tensorrt_llm/serve/perf_metrics.py id 56757725682):
  `Server-Timing` / `X-TRTLLM-Start-End-Time` / `X-TRTLLM-Step-Metrics` response headers on a
  JSON answer, an `event: trtllm.perf_metrics` SSE event after `data: [DONE]` on a stream
  (phase `server`, CLOCK_MONOTONIC seconds); without the header, nothing
- `event_split`: write a stream's `[DONE]` and the start of its metrics event together and
  the rest of the event (from this byte offset) in a later write (0: the event in its own write)
- `server_info`: fields merged into its `/server_info` (None removes one)
- `health_delay_s`: `GET /health` waits this long before its 200 (a busy server's slow probe);
  completions are not slowed
- `record`: keep each completion request for `GET /_recorded` (default true); benchmarks turn it
  off, since kept bodies (a 128k-token prompt is megabytes of Python objects) grow the fake's
  memory and its garbage collector's work with every request

Each recorded body carries `_headers`: the request's `content-type`, `x-*` (such as
`x-trtllm-return-metrics`, `x-trtllm-disagg-auth`) and `traceparent` headers, when sent.

`POST /v1/messages/count_tokens` is recorded too and answers `{"input_tokens": N}`, or the scripted
`status` with `error_message` in Anthropic's error envelope.

`GET /_events` lists what happened to streams: "cancelled:<n>" when a client went away mid-stream.

Run: `python -m tests.fakes.executor --port P --name NAME`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import hmac
import json
import struct
import time
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def build_app(name: str, addr: str) -> Starlette:
    recorded: list[dict[str, Any]] = []
    script: dict[str, Any] = {
        "finish_reason": "length",
        "status": 200,
        "chunks": 4,
        "hold": False,
        "delay_s": 0.0,
        "omit_ids": False,
        "chunk_interval_s": 0.0,
        "stream_finish_reason": "length",
        "gen_choices": 1,
        "completion_tokens": None,
        "leak": False,
        "error_message": None,
        "stream_error": None,
        "stream_as_json": False,
        "auth_key": None,
        "perf_metrics": True,
        "event_split": 0,
        "health_delay_s": 0.0,
        "record": True,
    }
    events: list[str] = []
    release = asyncio.Event()
    counter = {"n": 0}

    async def health(_: Request) -> Response:
        if script["health_delay_s"]:
            await asyncio.sleep(script["health_delay_s"])
        return JSONResponse({"status": "ok"})

    async def server_info(_: Request) -> Response:
        info = {
            "disaggregated_params": {"ctx_info_endpoint": [addr], "encoded_opaque_state": "b3BhcXVl"},
            "max_batch_size": 8,
            "max_num_tokens": 4096,
            "kv_cache_hash_algo": "v1_block_key",
            "tokens_per_block": 32,
        }
        info.update(script.get("server_info") or {})  # a value of None removes the field
        return JSONResponse({k: v for k, v in info.items() if v is not None})

    async def models(_: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": "fake-model", "object": "model", "created": 0, "owned_by": "tensorrt_llm"}],
            }
        )

    async def recorded_ep(_: Request) -> Response:
        return Response(orjson.dumps(recorded), media_type="application/json")

    async def script_ep(request: Request) -> Response:
        script.update(await request.json())
        return JSONResponse(script)

    async def events_ep(_: Request) -> Response:
        return JSONResponse(events)

    async def release_ep(_: Request) -> Response:
        release.set()
        return JSONResponse({})

    async def completion(request: Request) -> Response:
        arrival = time.monotonic()
        raw = await request.body()
        if request.headers.get("x-trtllm-msgpack") == "1":
            import msgspec

            body = msgspec.msgpack.decode(raw)
        else:
            body = orjson.loads(raw)
        body["_path"] = request.url.path
        metrics = script["perf_metrics"] and request.headers.get("x-trtllm-return-metrics", "").strip() == "1"
        body["_server"] = name
        body["_headers"] = {
            k: v for k, v in request.headers.items() if k.startswith(("x-", "content-type", "traceparent"))
        }
        if script["record"]:
            recorded.append(body)
        refusal = _auth_refusal(
            script["auth_key"], body.get("disaggregated_params"), request.headers.get("x-trtllm-disagg-auth")
        )
        if refusal:
            return JSONResponse(
                {"object": "error", "message": refusal, "type": "BadRequestError", "param": None, "code": 400},
                status_code=400,
            )
        if script["delay_s"]:
            await asyncio.sleep(script["delay_s"])
        if script["status"] != 200:
            message = script["error_message"] or f"scripted {script['status']}"
            err = {
                "object": "error",
                "message": message,
                "type": "BadRequestError",
                "param": None,
                "code": script["status"],
            }
            return JSONResponse(err, status_code=script["status"])
        params = body.get("disaggregated_params") or {}
        chat = request.url.path.endswith("chat/completions")
        prompt_ids = body.get("prompt") if isinstance(body.get("prompt"), list) else [101, 102, 103]
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": 1,
            "total_tokens": len(prompt_ids) + 1,
            "prompt_tokens_details": {"cached_tokens": 7},
        }
        if params.get("request_type") == "context_only":
            counter["n"] += 1
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": script["finish_reason"],
                "disaggregated_params": {
                    "request_type": "context_only",
                    "first_gen_tokens": [42],
                    "ctx_request_id": None if script["omit_ids"] else params.get("disagg_request_id"),
                    "disagg_request_id": None if script["omit_ids"] else params.get("disagg_request_id"),
                    "encoded_opaque_state": "b3BhcXVl",
                    "draft_tokens": None,
                    "ctx_dp_rank": 0,
                    "ctx_info_endpoint": addr,
                },
            }
            if chat:
                choice["message"] = {"role": "assistant", "content": "A"}
            else:
                choice["text"] = "A"
            ids: dict[str, Any] = {"prompt_token_ids": prompt_ids}
            if params.get("return_prompt_token_ids_b64"):  # as the worker does (openai_server.py)
                ids = {
                    "prompt_token_ids": None,
                    "prompt_token_ids_b64": base64.b64encode(struct.pack(f"<{len(prompt_ids)}i", *prompt_ids)).decode(),
                }
            answer = {
                "id": f"cmpl-{name}-{counter['n']}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.get("model"),
                "choices": [choice],
                "usage": usage,
                **ids,
            }
            return JSONResponse(answer, headers=_metrics_headers(arrival) if metrics else None)
        leak = {"disaggregated_params": params, "kv_transfer_params": {"remote_host": addr}} if script["leak"] else {}
        if body.get("stream") and not script["stream_as_json"]:
            return StreamingResponse(
                _stream(script, release, name, events, leak, chat, arrival if metrics else None),
                media_type="text/event-stream",
            )
        text = {"message": {"role": "assistant", "content": "ABCD"}} if chat else {"text": "ABCD"}
        if script["completion_tokens"] is not None:
            usage = {**usage, "completion_tokens": script["completion_tokens"]}
        choices = [{"index": i, "finish_reason": "length", **text, **leak} for i in range(script["gen_choices"])]
        extra = {"prompt_token_ids": prompt_ids} if script["leak"] else {}
        answer = {
            "id": f"cmpl-{name}",
            "object": "text_completion",
            "model": body.get("model"),
            "choices": choices,
            "usage": usage,
            **extra,
        }
        return JSONResponse(answer, headers=_metrics_headers(arrival) if metrics else None)

    async def count_tokens(request: Request) -> Response:
        """`POST /v1/messages/count_tokens` as TensorRT-LLM's worker answers it: `{"input_tokens": N}`
        (here N is the characters of the messages' string contents), errors in Anthropic's envelope."""
        body = await request.json()
        body["_path"] = request.url.path
        body["_server"] = name
        recorded.append(body)
        if script["status"] != 200:
            message = script["error_message"] or f"scripted {script['status']}"
            return JSONResponse(
                {"type": "error", "error": {"type": "invalid_request_error", "message": message}},
                status_code=script["status"],
            )
        count = sum(len(m["content"]) for m in body.get("messages", []) if isinstance(m.get("content"), str))
        return JSONResponse({"input_tokens": count})

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/server_info", server_info),
            Route("/v1/models", models),
            Route("/v1/completions", completion, methods=["POST"]),
            Route("/v1/chat/completions", completion, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
            Route("/_recorded", recorded_ep),
            Route("/_script", script_ep, methods=["POST"]),
            Route("/_release", release_ep, methods=["POST"]),
            Route("/_events", events_ep),
        ]
    )


def _auth_refusal(key: str | None, params: Any, provided: str | None) -> str | None:
    """What a worker holding `key` says to a handoff whose signature is missing or wrong (None:
    accepted). The signature is computed here from disagg_auth.py's definition."""
    if (
        not key
        or not isinstance(params, dict)
        or all(params.get(f) is None for f in ("encoded_opaque_state", "ctx_info_endpoint"))
    ):
        return None
    endpoint = params.get("ctx_info_endpoint")
    endpoint = (endpoint[0] if endpoint else None) if isinstance(endpoint, list) else endpoint
    payload = json.dumps(
        {"ctx_info_endpoint": endpoint, "encoded_opaque_state": params.get("encoded_opaque_state")},
        sort_keys=True,
        separators=(",", ":"),
    )
    expected = "sha256=" + hmac.new(key.encode(), payload.encode(), hashlib.sha256).hexdigest()
    if provided is None or not hmac.compare_digest(provided, expected):
        return "Invalid internal disaggregated request authentication"
    return None


def _finish(script: dict[str, Any], i: int) -> str | None:
    """The last chunk of a stream says why it ended, as an engine's does (unless scripted not to)."""
    return script["stream_finish_reason"] if i == script["chunks"] - 1 else None


def _metrics_headers(arrival: float) -> dict[str, str]:
    """A worker's phase-`server` metric lists, as upstream's `build_metrics_headers` writes them:
    queue 1 ms, first token 2 ms after arrival, the end now, one decoding step of 0.5 ms."""
    end = time.monotonic()
    return {
        "Server-Timing": "server_queue;dur=1.000000, server_ttft;dur=2.000000, "
        f"server_e2e;dur={(end - arrival) * 1000:.6f}",
        "X-TRTLLM-Start-End-Time": f"server-start;ts={arrival:.9f}, server-end;ts={end:.9f}",
        "X-TRTLLM-Step-Metrics": "server-step-0-forward;dur=0.500000",
    }


async def _stream(
    script: dict[str, Any],
    release: asyncio.Event,
    name: str,
    events: list[str],
    leak: dict[str, Any],
    chat: bool,
    arrival: float | None = None,
):  # type: ignore[no-untyped-def]
    try:
        for i in range(script["chunks"]):
            # chat chunks carry a delta (ChatCompletionStreamResponse), completion chunks text
            part = {"delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}
            yield (
                b"data: "
                + orjson.dumps(
                    {
                        "id": f"cmpl-{name}",
                        "model": "fake-model",
                        "choices": [{"index": 0, **part, "finish_reason": _finish(script, i), **leak}],
                    }
                )
                + b"\n\n"
            )
            if i == 0 and script["stream_error"]:
                yield (
                    b"data: "
                    + orjson.dumps(
                        {
                            "error": {
                                "message": script["stream_error"],
                                "type": "server_error",
                                "code": None,
                                "param": None,
                            }
                        }
                    )
                    + b"\n\n"
                )
                yield b"data: [DONE]\n\n"
                return
            if i == 0 and script["hold"]:
                await release.wait()
            if script["chunk_interval_s"]:
                await asyncio.sleep(script["chunk_interval_s"])
        if script["completion_tokens"] is not None:
            usage = {
                "prompt_tokens": 3,
                "completion_tokens": script["completion_tokens"],
                "total_tokens": 3 + script["completion_tokens"],
            }
            yield b"data: " + orjson.dumps({"id": f"cmpl-{name}", "choices": [], "usage": usage}) + b"\n\n"
        done = b"data: [DONE]\n\n"
        if arrival is None:
            yield done
            return
        # upstream's middleware appends the event to the stream's final body message
        event = b"event: trtllm.perf_metrics\ndata: " + orjson.dumps(_metrics_headers(arrival)) + b"\n\n"
        split = script["event_split"]
        if split:
            yield done + event[:split]
            await asyncio.sleep(0.01)  # a separate write
            yield event[split:]
        else:
            yield done
            yield event
    except BaseException:
        events.append(f"cancelled:{len(events)}")
        raise


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="fake")
    args = parser.parse_args()
    addr = f"127.0.0.1:{args.port}"
    try:
        uvicorn.run(build_app(args.name, addr), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    except KeyboardInterrupt:  # uvicorn re-raises a Ctrl-C after its shutdown: the benchmark says it
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
