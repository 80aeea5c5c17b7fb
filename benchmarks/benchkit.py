"""Shared parts of the orchestrator-overhead benchmarks (`bench_orchestrator_cpu.py`,
`bench_scaling.py`): the load generator, process CPU and memory from `/proc`, the executors
(recording fakes, the simulator, or any URL), shmdisagg deployments and the vLLM router.

The load generator runs in its own process (`python benchmarks/benchkit.py loadgen`: aiohttp on
uvloop) and takes one cell at a time on stdin as a JSON line; `LoadGen.cell` drives it and samples
the CPU of every process group around each phase:

1. warm-up: `warmup` requests at `concurrency`, unmeasured;
2. measured: `n` requests at `concurrency` (closed loop), CPU sampled before and after; with
   `stagger_s`, the k-th of the `concurrency` request loops starts k/concurrency of it late
   (in both phases), so long paced streams arrive spread out rather than in one wave;
3. latency (when `latency_n` > 0): `latency_n` requests one at a time (concurrency 1), CPU
   sampled again, each request's full latency and time to its first body byte returned: what a
   request costs and adds when nothing queues.

With `steady: true` (no latency phase) the request loops never stop between 1 and 2: once every
loop has started and `warmup` requests have finished, the CPU is sampled, the next `n` requests
to finish are the measured ones, the CPU is sampled again, and only then do the loops drain. A
barrier between the phases would let every connection idle out while staggered loops wait to
start again, so a long stagger would measure connection set-up (an accept and an executor
connect per loop) as well as the open streams.

Every response is checked: status 200, non-streaming JSON with `choices`, streams ending with
`data: [DONE]` without an error event and (`exact_chunks`) exactly chunks + 1 `data:` events. A
cell with `ctx_url` is the client doing both legs itself (the two-hop floor, "direct2"): the
context leg to `ctx_url` (`context_only`, non-streaming), then the generation leg to `url` with
the context answer's `disaggregated_params` (`generation_only`) and `prompt_token_ids`, as the
orchestrator would send it; with `relay: bytes` (the recording fakes, which check no handoff)
both legs carry the request's own bytes with their `disaggregated_params` spliced in and the
context answer is not parsed, so the floor holds no client-side JSON work that grows with the
prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CLK_TCK = os.sysconf("SC_CLK_TCK")
MODEL = "fake-model"
MODES: dict[str, dict[str, Any]] = {
    "nonstream": {"stream": False, "chunks": 16, "chunk_interval_s": 0.0},
    "stream16": {"stream": True, "chunks": 16, "chunk_interval_s": 0.0},
    "stream16_paced5ms": {"stream": True, "chunks": 16, "chunk_interval_s": 0.005},
}
PY = sys.executable


# -- load generator (its own process) -------------------------------------------------------


class Bodies:
    """Request bodies: the text prompt `"request i: " + "lorem ipsum "*20`, or `prompt_tokens`
    token ids whose first id is the request's number (so no two prompts share a block). A long
    prompt's JSON is built once; each request only splices its first id in."""

    def __init__(self, stream: bool, prompt_tokens: int, max_tokens: int) -> None:
        import orjson

        self.stream, self.prompt_tokens, self.max_tokens = stream, prompt_tokens, max_tokens
        tail = [1000 + (k * 7) % 30000 for k in range(1, prompt_tokens)]
        self._tail = orjson.dumps(tail)[1:-1]
        self._end = orjson.dumps({"max_tokens": max_tokens, "stream": stream})[1:]

    def raw(self, i: int) -> bytes:
        import orjson

        if self.prompt_tokens <= 0:
            return orjson.dumps(
                {
                    "model": MODEL,
                    "prompt": f"request {i}: " + "lorem ipsum " * 20,
                    "max_tokens": self.max_tokens,
                    "stream": self.stream,
                }
            )
        head = b'{"model":"' + MODEL.encode() + b'","prompt":[' + str(1000 + i % 100_000).encode()
        return head + (b"," + self._tail if self._tail else b"") + b"]," + self._end


def check_response(status: int, raw: bytes, stream: bool, chunks: int | None) -> str | None:
    """None when the response is good, else a short reason. `chunks`: the exact number of data
    events before `[DONE]` a stream must carry (None: any)."""
    import orjson

    if status != 200:
        return f"status {status}: {raw[:120]!r}"
    if not stream:
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return f"bad json: {raw[:120]!r}"
        if not isinstance(doc, dict) or not doc.get("choices"):
            return f"no choices: {raw[:120]!r}"
        return None
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    # an executor's perf-metrics event may follow [DONE] (`event: trtllm.perf_metrics`)
    data = [e for e in events if not e.startswith(b"event:")]
    if not data or data[-1].strip() != b"data: [DONE]":
        return f"stream does not end with [DONE]: {raw[-120:]!r}"
    if any(not e.startswith(b"data: ") for e in data):
        return f"non-data event: {raw[:120]!r}"
    if chunks is not None and len(data) != chunks + 1:
        return f"{len(data)} events, expected {chunks + 1}"
    if any(b'"error"' in e for e in data):
        return f"error event: {raw[:160]!r}"
    return None


async def _run_cell(cmd: dict[str, Any], out: Any, inp: Any) -> None:
    import aiohttp
    import orjson

    url, n, warmup, conc = cmd["url"], cmd["n"], cmd["warmup"], cmd["concurrency"]
    ctx_url = cmd.get("ctx_url")
    stream, ptoks = cmd["stream"], cmd["prompt_tokens"]
    chunks = cmd["chunks"] if cmd.get("exact_chunks", True) else None
    bodies = Bodies(stream, ptoks, cmd.get("max_tokens", 16))
    headers = {"content-type": "application/json"}
    loop = asyncio.get_running_loop()

    async with aiohttp.ClientSession(
        # idle pooled connections close before a server's keep-alive timeout (uvicorn's 5 s) can
        # close them under a request being written (seen with 2,048 staggered streams)
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
        timeout=aiohttp.ClientTimeout(total=cmd.get("timeout_s", 300)),
    ) as session:
        ctx_params = b'{"disaggregated_params":{"request_type":"context_only"},'
        gen_params = b'{"disaggregated_params":{"request_type":"generation_only","ctx_request_id":1},'

        async def two_legs(body: bytes) -> bytes:
            """The context leg, done by the client; returns the generation leg's body."""
            if cmd.get("relay") == "bytes":
                # the least client work (recording fakes only): the request's bytes with the leg's
                # disaggregated_params put first, the context answer read but not parsed. A fake
                # answers a context_only leg with JSON whatever its stream and max_tokens, and
                # takes any generation_only handoff.
                async with session.post(ctx_url, data=ctx_params + body[1:], headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"context leg {r.status}")
                return gen_params + body[1:]
            req = orjson.loads(body)
            ctx_req = {
                **req,
                "max_tokens": 1,
                "stream": False,
                "disaggregated_params": {"request_type": "context_only"},
            }
            async with session.post(ctx_url, data=orjson.dumps(ctx_req), headers=headers) as r:
                ctx = orjson.loads(await r.read())
                if r.status != 200:
                    raise RuntimeError(f"context leg {r.status}: {str(ctx)[:120]}")
            params = {**ctx["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
            gen = {**req, "disaggregated_params": params}
            if ctx.get("prompt_token_ids"):
                gen["prompt"] = ctx["prompt_token_ids"]
            return orjson.dumps(gen)

        async def one(i: int) -> tuple[float, float, str | None]:
            """Request i: (latency s, time to the first body byte s, why it is bad or None)."""
            body = bodies.raw(i)
            t0 = time.perf_counter()
            try:
                if ctx_url:
                    body = await two_legs(body)
                async with session.post(url, data=body, headers=headers) as r:
                    first = await r.content.readany()
                    t1 = time.perf_counter()
                    raw = first + await r.content.read()
                    status = r.status
            except Exception as err:  # a failed request is a bad response
                return 0.0, 0.0, f"{type(err).__name__}: {err}"
            return time.perf_counter() - t0, t1 - t0, check_response(status, raw, stream, chunks)

        async def phase(count: int, base: int, workers: int, stagger_s: float = 0.0) -> dict[str, Any]:
            lat: list[float] = []
            ttfb: list[float] = []
            bad: list[str] = []
            nxt = 0

            async def worker(k: int) -> None:
                nonlocal nxt
                if stagger_s > 0:  # spread the first requests, so long streams do not all tick together
                    await asyncio.sleep(k * stagger_s / workers)
                while nxt < count:
                    i = base + nxt
                    nxt += 1
                    took, first, why = await one(i)
                    if why is not None:
                        bad.append(why)
                    if took:
                        lat.append(took)
                        ttfb.append(first)

            c0, t0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(worker(k) for k in range(workers)))
            return {
                "lat": lat,
                "ttfb": ttfb,
                "bad": bad,
                "wall_s": time.perf_counter() - t0,
                "client_cpu_s": time.process_time() - c0,
            }

        def emit(doc: dict[str, Any]) -> None:
            out.write(json.dumps(doc) + "\n")
            out.flush()

        async def steady(stagger_s: float) -> None:
            """The steady protocol (`steady: true`): the request loops never pause between the
            warm-up and the measured window, so connections stay open and streams stay spread."""
            lat: list[float] = []
            ttfb: list[float] = []
            bad: list[str] = []
            warm_bad: list[str] = []
            warm, full = asyncio.Event(), asyncio.Event()
            state = {"next": 0, "done": 0, "started": 0, "counted": -1, "stop": False}

            async def worker(k: int) -> None:
                if stagger_s > 0:
                    await asyncio.sleep(k * stagger_s / conc)
                state["started"] += 1
                while not state["stop"]:
                    state["next"] += 1
                    took, first, why = await one(10_000_000 + state["next"])
                    state["done"] += 1
                    if state["started"] == conc and state["done"] >= warmup:
                        warm.set()
                    if state["counted"] < 0 and why is not None:
                        warm_bad.append(why)
                    if 0 <= state["counted"] < n:  # a completion inside the measured window
                        state["counted"] += 1
                        if why is not None:
                            bad.append(why)
                        if took:
                            lat.append(took)
                            ttfb.append(first)
                        if state["counted"] == n:
                            full.set()

            loops = [asyncio.ensure_future(worker(k)) for k in range(conc)]
            await warm.wait()
            emit({"event": "warm", "bad": len(warm_bad), "bad_samples": warm_bad[:3]})
            go = await loop.run_in_executor(None, inp.readline)
            if go.strip():
                c0, t0 = time.process_time(), time.perf_counter()
                state["counted"] = 0
                await full.wait()
                emit(
                    {
                        "event": "done",
                        "n": n,
                        "ok": n - len(bad),
                        "bad": len(bad),
                        "bad_samples": bad[:5],
                        "wall_s": time.perf_counter() - t0,
                        "client_cpu_s": time.process_time() - c0,
                        "p50_ms": pct(lat, 0.50),
                        "p99_ms": pct(lat, 0.99),
                        "ttfb_p50_ms": pct(ttfb, 0.50),
                        "ttfb_p99_ms": pct(ttfb, 0.99),
                    }
                )
                await loop.run_in_executor(None, inp.readline)  # "end": the CPU sampled
            state["stop"] = True  # the open requests finish; no new one starts
            await asyncio.gather(*loops)

        stagger = cmd.get("stagger_s", 0.0)
        if cmd.get("steady"):
            await steady(stagger)
            return
        w = await phase(warmup, 10_000_000, conc, stagger)
        emit({"event": "warm", "bad": len(w["bad"]), "bad_samples": w["bad"][:3]})
        go = await loop.run_in_executor(None, inp.readline)
        if not go.strip():
            return
        m = await phase(n, 0, conc, stagger)
        emit(
            {
                "event": "done",
                "n": n,
                "ok": n - len(m["bad"]),
                "bad": len(m["bad"]),
                "bad_samples": m["bad"][:5],
                "wall_s": m["wall_s"],
                "client_cpu_s": m["client_cpu_s"],
                "p50_ms": pct(m["lat"], 0.50),
                "p99_ms": pct(m["lat"], 0.99),
                "ttfb_p50_ms": pct(m["ttfb"], 0.50),
                "ttfb_p99_ms": pct(m["ttfb"], 0.99),
            }
        )
        if cmd.get("latency_n", 0) > 0:
            go = await loop.run_in_executor(None, inp.readline)
            if not go.strip():
                return
            s = await phase(cmd["latency_n"], 20_000_000, 1)
            emit(
                {
                    "event": "lat",
                    "n": cmd["latency_n"],
                    "bad": len(s["bad"]),
                    "bad_samples": s["bad"][:5],
                    "wall_s": s["wall_s"],
                    "lat_ms": [x * 1000 for x in s["lat"]],
                    "ttfb_ms": [x * 1000 for x in s["ttfb"]],
                }
            )


def pct(values: list[float], p: float, scale: float = 1000.0) -> float:
    """The p-quantile (nearest rank, no interpolation) of `values` times `scale`; NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(p * len(s)))] * scale


def loadgen_main() -> None:
    import uvloop

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line.strip():
                return
            await _run_cell(json.loads(line), sys.stdout, sys.stdin)

    try:
        uvloop.run(serve())
    except KeyboardInterrupt:  # the terminal's Ctrl-C reaches the whole group: the parent says it
        sys.exit(130)


# -- process CPU and memory ----------------------------------------------------------------------


def cpu_ticks(pid: int) -> tuple[int, int]:
    """(utime, stime) in clock ticks: fields 14 and 15 of /proc/<pid>/stat, all threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def cpu_ns(pid: int) -> int:
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        with contextlib.suppress(OSError):
            with open(path) as f:
                total += int(f.read().split()[0])
    return total


def sample(pids: dict[str, list[int]]) -> dict[str, tuple[int, int, int]]:
    """Per group: (utime + stime ticks, ns on CPU, stime ticks)."""
    out = {}
    for k, v in pids.items():
        ticks = [cpu_ticks(p) for p in v]
        out[k] = (sum(u + s for u, s in ticks), sum(cpu_ns(p) for p in v), sum(s for _, s in ticks))
    return out


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of a process in KiB (/proc/<pid>/status)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0])
    return out


# -- processes -----------------------------------------------------------------------------------


def http_json(method: str, url: str, body: Any = None, timeout: float = 5.0) -> tuple[int, Any]:
    """(status, parsed JSON or the raw text, None when empty); status 0 when unreachable."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"} if data else {}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as err:
        return err.code, None
    except (urllib.error.URLError, OSError):
        return 0, None
    if not raw:
        return status, None
    try:
        return status, json.loads(raw)
    except ValueError:  # a router's /health may answer plain text ("All servers healthy")
        return status, raw.decode(errors="replace")


class StartError(RuntimeError):
    """A process the benchmark starts (an executor, a router, a deployment) did not come up: the
    scripts print it in one line, after stopping what they had started."""


def wait_health(url: str, proc: subprocess.Popen[Any] | None, what: str, timeout_s: float = 60.0) -> None:
    """Poll `url` until it answers 200. Raises StartError when `proc` exits first or `timeout_s`
    passes."""
    deadline = time.monotonic() + timeout_s
    while http_json("GET", url, timeout=1.0)[0] != 200:
        if proc is not None and proc.poll() is not None:
            raise StartError(f"{what} exited with {proc.returncode} during start-up")
        if time.monotonic() > deadline:
            raise StartError(f"{what} not healthy after {timeout_s:g} s ({url})")
        time.sleep(0.1)


def stop_proc(proc: subprocess.Popen[Any] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def listener_pid(url: str) -> int:
    """The pid of the process listening on `url`'s port on this machine."""
    from shmdisagg.procutil import listeners

    port = urllib.parse.urlsplit(url if "://" in url else f"http://{url}").port
    pids = [x.pid for x in listeners(port or 0) if x.pid is not None]
    if not pids:
        raise StartError(f"no process of this user listens on {url}'s port (only local processes are measured)")
    return pids[0]


def free_port() -> int:
    from tests.conftest import free_port as take

    return take()


def median_min_max(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


# -- executors -------------------------------------------------------------------------------------


@dataclass
class Executors:
    """The context and generation executors every system of a run shares.

    kind: `fakes` (one recording fake process per executor), `multiport` (one fake process per
    role serving every port of that role), `sim` (one simulator process per executor, zero
    latency), `external` (URLs given; nothing started, nothing scripted)."""

    kind: str
    ctx: list[str]  # host:port
    gen: list[str]
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)  # whose CPU the "executors" columns sum
    sim_speedup: float = 1e6
    _itl_ms: float = 0.0

    @property
    def all(self) -> list[str]:
        return [*self.ctx, *self.gen]

    @property
    def scriptable(self) -> bool:
        return self.kind in ("fakes", "multiport", "sim")

    def script(self, mode: dict[str, Any]) -> None:
        """Make the executors answer as `mode` says: `chunks` per stream (fakes; the simulator
        streams `max_tokens`), `chunk_interval_s` between chunks (the simulator: its timing model
        slowed so one decode step at batch 1 takes that long; 0: zero latency), any other fake
        `/_script` key as given."""
        if self.kind in ("fakes", "multiport"):
            doc = {"record": False, **{k: v for k, v in mode.items() if k != "stream"}}
            for addr in self.all:
                s, _ = http_json("POST", f"http://{addr}/_script", doc)
                if s != 200:
                    raise RuntimeError(f"fake {addr} refused /_script ({s})")
        elif self.kind == "sim":
            interval = mode.get("chunk_interval_s", 0.0)
            for addr in self.all:
                http_json("POST", f"http://{addr}/sim/fault", {"kind": "clear"})
                if interval > 0:
                    factor = interval * 1000.0 * self.sim_speedup / self._itl_ms
                    s, _ = http_json("POST", f"http://{addr}/sim/fault", {"kind": "slow", "factor": factor})
                    if s != 200:
                        raise RuntimeError(f"simulator {addr} refused the slow fault ({s})")

    def stop(self) -> None:
        for proc in self.procs:
            stop_proc(proc)


def start_executors(
    kind: str, n_ctx: int, n_gen: int, ctx_urls: list[str] | None = None, gen_urls: list[str] | None = None
) -> Executors:
    """Start (or, for `external`, adopt) the executors; every one answers /health on return."""
    if kind == "external":
        ctx = [u.split("://")[-1].rstrip("/") for u in ctx_urls or []]
        gen = [u.split("://")[-1].rstrip("/") for u in gen_urls or []]
        if not ctx or not gen:
            raise StartError("external executors need at least one context and one generation URL")
        ex = Executors("external", ctx, gen)
        for addr in ex.all:
            wait_health(f"http://{addr}/health", None, f"executor {addr}", timeout_s=10)
            with contextlib.suppress(StartError):
                ex.pids.append(listener_pid(addr))  # a remote executor's CPU is not measured
        return ex
    ex = Executors(kind, [], [])
    try:
        if kind == "multiport":
            for role, count in (("ctx", n_ctx), ("gen", n_gen)):
                ports = [free_port() for _ in range(count)]
                proc = subprocess.Popen(
                    [PY, "-m", "tests.fakes.multiport", "--ports", ",".join(map(str, ports)), "--name", role],
                    cwd=REPO,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                )
                ex.procs.append(proc)
                (ex.ctx if role == "ctx" else ex.gen).extend(f"127.0.0.1:{p}" for p in ports)
        else:
            for role, count in (("ctx", n_ctx), ("gen", n_gen)):
                for k in range(count):
                    port = free_port()
                    if kind == "fakes":
                        argv = [PY, "-m", "tests.fakes.executor", "--port", str(port), "--name", f"{role}{k}"]
                    elif kind == "sim":
                        argv = [
                            PY,
                            "-m",
                            "shmdisagg.executors.sim",
                            "--port",
                            str(port),
                            "--role",
                            "context" if role == "ctx" else "generation",
                            "--speedup",
                            str(ex.sim_speedup),
                            "--model",
                            MODEL,
                        ]
                    else:
                        raise ValueError(f"unknown executors kind {kind}")
                    ex.procs.append(subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL))
                    (ex.ctx if role == "ctx" else ex.gen).append(f"127.0.0.1:{port}")
        owners = dict(zip(ex.all, ex.procs, strict=False)) if kind != "multiport" else {}
        for addr in ex.all:
            wait_health(f"http://{addr}/health", owners.get(addr), f"{kind} executor {addr}")
        ex.pids = [p.pid for p in ex.procs]
        if kind == "sim":
            _, stats = http_json("GET", f"http://{ex.gen[0]}/sim/stats")
            ex._itl_ms = float(stats["estimates_ms"]["itl_batch_1"])
    except BaseException:
        ex.stop()
        raise
    return ex


# -- systems -------------------------------------------------------------------------------------


def start_shmdisagg(
    stack: contextlib.ExitStack,
    tmp: Path,
    shm_prefix: str,
    ctx: list[str],
    gen: list[str],
    num_workers: int,
    routers: tuple[Any, Any] = ("round_robin", "round_robin"),
    **shmdisagg: Any,
) -> dict[str, Any]:
    """A deployment (launcher, coordinator, fleet) on `stack`; its target: completions URL, base
    URL, pids of the fleet (`proxy`) and of the coordinator (`coord`)."""
    from tests.integration.harness import deployment, write_config

    tmp.mkdir(parents=True, exist_ok=True)
    cfg = write_config(
        tmp,
        shm_prefix,
        ctx,
        gen,
        num_workers=num_workers,
        routers=routers,
        shmdisagg={"health_check_interval_s": 0.5, "request_timeout_s": 180, **shmdisagg},
    )
    dep = stack.enter_context(deployment(cfg))
    status, info = http_json("GET", f"{dep.url}/cluster_info")
    if status != 200 or len(info.get("fleet_pids") or ()) != num_workers:
        raise RuntimeError(f"shmdisagg /cluster_info answered {status}: {info}")
    return {
        "url": f"{dep.url}/v1/completions",
        "base": dep.url,
        "pids": {"proxy": list(info["fleet_pids"]), "coord": [info["coordinator_pid"]]},
        "hops": 2,
    }


def vllm_router_bin(spec: str) -> str:
    """`auto`: the vllm-router of `.venv-peers` (benchmarks/peers/install_vllm_router.sh puts it
    there); else the path given."""
    path = REPO / ".venv-peers" / "bin" / "vllm-router" if spec == "auto" else Path(spec)
    if not path.exists():
        raise RuntimeError(f"{path} not found: run benchmarks/peers/install_vllm_router.sh")
    if not path.is_file() or not os.access(path, os.X_OK):
        raise RuntimeError(f"{path} is not an executable file")
    return str(path)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as Ctrl-C's KeyboardInterrupt is (`exit_on_sigterm`)."""

    signum = signal.SIGTERM


def exit_on_sigterm() -> None:
    """SIGTERM ends the run as Ctrl-C does: the `with` blocks stop every process it started (a
    benchmark killed by `timeout` or `kill` would otherwise leave its executors running)."""

    def _exit(signum: int, frame: Any) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, _exit)


def run_main(main: Callable[[], int]) -> None:
    """Exit with `main()`'s status; a `StartError` is one `error:` line (exit 1), Ctrl-C or
    SIGTERM one `interrupted` line (exit 130 / 143), each after the `with` blocks and `finally`
    clauses stopped what the run had started."""
    prog = Path(sys.argv[0]).name
    try:
        code = main()
    except StartError as err:
        sys.exit(f"{prog}: error: {err}")
    except KeyboardInterrupt as err:
        signum = getattr(err, "signum", signal.SIGINT)
        print(f"{prog}: interrupted ({signal.Signals(signum).name}); stopped what it had started", file=sys.stderr)
        sys.exit(128 + signum)
    sys.exit(code)


def positive_ints(ap: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    """A comma-separated list of positive integers, or `ap.error` naming `option`."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        ap.error(f"{option}: a comma-separated list of positive integers, got {text!r}")
    return values


def json_output(ap: argparse.ArgumentParser, path: str | None) -> None:
    """`ap.error` for a `--json` file that could not be written at the end of the run (its
    directory missing or not writable), before anything starts."""
    if path is None:
        return
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        ap.error(f"--json: no directory {parent}")
    if not os.access(parent, os.W_OK) or Path(path).is_dir():
        ap.error(f"--json: cannot write {path}")


def name_list(ap: argparse.ArgumentParser, option: str, text: str, allowed: Iterable[str]) -> list[str]:
    """A comma-separated list of names from `allowed`, at least one, or `ap.error` naming `option`."""
    allowed = list(allowed)
    names = [n for n in text.split(",") if n]
    for name in names:
        if name not in allowed:
            ap.error(f"{option}: unknown name {name!r}, of {', '.join(allowed)}")
    if not names:
        ap.error(f"{option}: name at least one of {', '.join(allowed)}")
    return names


def mode_list(ap: argparse.ArgumentParser, text: str) -> list[str]:
    """`--modes`: a comma-separated list of `MODES` names, at least one, or `ap.error`."""
    return name_list(ap, "--modes", text, MODES)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer of at least {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"an integer of at least {low}, got {value}")
    return value


def count(text: str) -> int:
    """An argparse `type` for a count option: an integer of at least 1, else argparse's one-line
    `error: argument --x: ...` (exit 2) instead of a traceback or a run of nothing."""
    return _int_at_least(text, 1)


def count_or_zero(text: str) -> int:
    """As `count`, with 0 allowed (an option where 0 means "skip")."""
    return _int_at_least(text, 0)


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse `type` for a duration or rate option: a finite number above 0."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a number above 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """As `positive_float`, with 0 allowed."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a number of at least 0, got {text!r}")
    return value


def checkout(text: str) -> Path:
    """An argparse `type` for a `--tree`: a directory holding a shmdisagg checkout (its path,
    resolved)."""
    path = Path(text).resolve()
    if not (path / "shmdisagg").is_dir():
        raise argparse.ArgumentTypeError(f"not a shmdisagg checkout (no shmdisagg/ in it): {text!r}")
    return path


def checkout_with_venv(text: str) -> Path:
    """As `checkout`, with the checkout's own `.venv` installed (`.venv/bin/shmdisagg`)."""
    path = checkout(text)
    if not (path / ".venv/bin/shmdisagg").exists():
        raise argparse.ArgumentTypeError(f"{text!r} has no .venv/bin/shmdisagg (CONTRIBUTING.md, compare two builds)")
    return path


def existing_file(text: str) -> Path:
    """An argparse `type` for an input file that must be there."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return path


def at_least_one(ap: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """`ap.error` naming the first of the integer options `names` (attribute names) below 1."""
    for name in names:
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


def start_vllm_router(binary: str, ctx: list[str], gen: list[str], pd: bool) -> tuple[subprocess.Popen[Any], str]:
    """vLLM's Rust router (`vllm-router`, a fork of SGLang's model gateway), round-robin, logging
    errors only. `pd`: its prefill/decode mode, two hops per request (the prefill leg with
    `max_tokens` 1, non-streaming; then the decode leg), against the context and generation
    executors; else its regular mode, one hop to the generation executors."""
    port, prom = free_port(), free_port()
    argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(prom)]
    argv += ["--policy", "round_robin", "--log-level", "error"]
    if pd:
        argv += ["--vllm-pd-disaggregation"]
        for u in ctx:
            argv += ["--prefill", f"http://{u}"]
        for u in gen:
            argv += ["--decode", f"http://{u}"]
    else:
        argv += ["--worker-urls", *(f"http://{u}" for u in gen)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(f"{url}/health", proc, "vllm-router")
    except BaseException:
        stop_proc(proc)
        raise
    return proc, url


# -- driving the load generator ------------------------------------------------------------------


class LoadGen:
    """The load generator process and one cell at a time through it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [PY, str(Path(__file__).resolve()), "loadgen"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.busy = False  # a cell is running: close() stops the process at once

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the load generator exited ({self.proc.poll()})")
        doc: dict[str, Any] = json.loads(line)
        return doc

    def cell(self, spec: dict[str, Any], pids: dict[str, list[int]], during: Any = None) -> dict[str, Any]:
        """Run one cell (`_cell`); an exception or a signal inside it leaves it `busy`."""
        self.busy = True
        row = self._cell(spec, pids, during)
        self.busy = False
        return row

    def _cell(self, spec: dict[str, Any], pids: dict[str, list[int]], during: Any = None) -> dict[str, Any]:
        """Run one cell; per pid group `<group>_ms` (ticks), `<group>_ns_ms`, `<group>_sys_ms` per
        request of the measured phase and `<group>_c1_ns_ms` of the latency phase. `during`, if
        given, is called with no argument while the measured phase runs (in this thread, after
        `spec["sample_after_s"]` seconds) and its result stored as `during`."""
        pids = {**pids, "client": [self.pid]}
        self._send(json.dumps(spec))
        warm = self._read()
        before = sample(pids)
        self._send("go")
        mid = None
        if during is not None:
            time.sleep(spec.get("sample_after_s", 0.0))
            mid = during()
        done = self._read()
        after = sample(pids)
        n = done["n"]
        row: dict[str, Any] = {
            "n": n,
            "bad": done["bad"] + warm["bad"],
            "bad_samples": done["bad_samples"] + warm["bad_samples"],
            "req_s": n / done["wall_s"],
            "p50_ms": done["p50_ms"],
            "p99_ms": done["p99_ms"],
            "ttfb_p50_ms": done["ttfb_p50_ms"],
            "ttfb_p99_ms": done["ttfb_p99_ms"],
            "client_cpu_ms": done["client_cpu_s"] * 1000 / n,
            "during": mid,
        }
        if spec.get("steady"):
            self._send("end")  # the load generator drains its open requests
        for k in pids:
            row[f"{k}_ms"] = (after[k][0] - before[k][0]) * 1000 / CLK_TCK / n
            row[f"{k}_ns_ms"] = (after[k][1] - before[k][1]) / 1e6 / n
            row[f"{k}_sys_ms"] = (after[k][2] - before[k][2]) * 1000 / CLK_TCK / n
        if spec.get("latency_n", 0) > 0:
            self._send("lat")
            lat = self._read()
            end = sample(pids)
            row["bad"] += lat["bad"]
            row["bad_samples"] += lat["bad_samples"]
            row["c1_lat_ms"], row["c1_ttfb_ms"] = lat["lat_ms"], lat["ttfb_ms"]
            row["c1_s_per_req"] = lat["wall_s"] / max(1, lat["n"])
            for k in pids:
                row[f"{k}_c1_ns_ms"] = (end[k][1] - after[k][1]) / 1e6 / max(1, lat["n"])
        return row

    def close(self) -> None:
        """End the load generator: between cells, let it exit; inside one (an error, Ctrl-C,
        SIGTERM), stop it at once, so that its open requests end before the deployments stop."""
        if not self.busy and self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._send("")
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        stop_proc(self.proc)


def idle_cpu(pids: dict[str, dict[str, list[int]]], seconds: float) -> dict[str, dict[str, float]]:
    """CPU ms per second of every system's process groups while no request runs: the heartbeats,
    health checks and timers a process pays for with no load (`{system: {group: ms/s}}`)."""
    before = {name: sample(groups) for name, groups in pids.items()}
    time.sleep(seconds)
    out = {}
    for name, groups in pids.items():
        after = sample(groups)
        out[name] = {g: (after[g][1] - before[name][g][1]) / 1e6 / seconds for g in groups}
    return out


def cleanup_shm(prefixes: list[str]) -> None:
    for prefix in prefixes:
        for path in glob.glob(f"/dev/shm/{prefix}*"):
            with contextlib.suppress(OSError):
                os.unlink(path)


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


if __name__ == "__main__":
    if sys.argv[1:] == ["loadgen"]:
        loadgen_main()
    else:
        sys.exit("usage: benchkit.py loadgen (the load generator process; the benchmarks start it)")
