#!/usr/bin/env python
"""Orchestrator CPU per request: shmdisagg at one or more fleet sizes against a TensorRT-LLM-style
stack and any other router, side by side in one run.

Every system runs at once against the same recording fake executors (`tests/fakes/executor.py`,
one process per server, zero latency: each answers as soon as it has read the request):

- **shmdisagg**, one deployment per `--fleet` size (`num_workers`), started through its own
  launcher and coordinator (`tests/integration/harness.py`: `write_config` + `deployment`); the
  fleet workers' pids come from `GET /cluster_info` (`fleet_pids`). Its proxy CPU is the sum of
  its workers'; the coordinator's is reported in its own column (it receives the workers'
  per-request records).
- **baseline**: `benchmarks/baseline_trtllm_orchestrator.py`, one process rebuilding TensorRT-LLM's
  `OpenAIDisaggServer` request path (FastAPI + pydantic models + aiohttp client, context-first).
- **direct**: the load sent to the generation fake itself, one hop and no router: the latency
  floor that the "p50 / p99 − direct's" column subtracts (a disaggregated request makes two such
  hops). At `--concurrency` c the load is a closed loop, so latency is about c / throughput and
  that difference is mostly queueing behind the slower system; `--concurrency 1` measures the
  latency each request adds.
- **--vs [NAME=]URL**: any other router on this machine, started beforehand (or within
  `--vs-wait` seconds of the fakes' line) against the fakes this run prints; its CPU is that of
  the process listening on URL's port (`procutil.listeners`).

A load generator runs in its own process (aiohttp on uvloop, bounded concurrency). A cell is one
system in one mode: a warm-up, then N measured requests. Every response is checked: status 200,
non-streaming JSON with `choices`, streams with exactly chunks+1 `data:` events ending in
`data: [DONE]`. CPU is utime+stime from `/proc/<pid>/stat` (10 ms ticks) before and after the
measured part, divided by N; the ns column sums `/proc/<pid>/task/*/schedstat` over threads.
Rounds cycle through every mode and alternate which system goes first, so drift hits all alike;
the tables show the median round (min-max in brackets).

Modes: `nonstream`; `stream16` (16 SSE chunks + [DONE], sent back to back); `stream16_paced5ms`
(the same, 5 ms apart, one write per chunk, as an engine paces tokens).

    .venv/bin/python benchmarks/bench_orchestrator_cpu.py [--n 2000] [--warmup 300] [--concurrency 32]
        [--rounds 3] [--modes nonstream,stream16,stream16_paced5ms] [--fleet 1,2,4]
        [--systems shmdisagg,baseline,direct] [--vs NAME=URL ...] [--prompt-tokens 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CLK_TCK = os.sysconf("SC_CLK_TCK")
MODES: dict[str, dict[str, Any]] = {
    "nonstream": {"stream": False, "chunks": 16, "chunk_interval_s": 0.0},
    "stream16": {"stream": True, "chunks": 16, "chunk_interval_s": 0.0},
    "stream16_paced5ms": {"stream": True, "chunks": 16, "chunk_interval_s": 0.005},
}
MODEL = "fake-model"


# -- load generator (its own process) -------------------------------------------------------


def _body(i: int, stream: bool, prompt_tokens: int) -> bytes:
    import orjson

    if prompt_tokens > 0:
        prompt: Any = [1000 + (i * 7 + k) % 30000 for k in range(prompt_tokens)]
    else:
        prompt = f"request {i}: " + "lorem ipsum " * 20
    return orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 16, "stream": stream})


def _check(status: int, raw: bytes, stream: bool, chunks: int) -> str | None:
    """None when the response is good, else a short reason."""
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
    if not events or events[-1].strip() != b"data: [DONE]":
        return f"stream does not end with [DONE]: {raw[-120:]!r}"
    if any(not e.startswith(b"data: ") for e in events):
        return f"non-data event: {raw[:120]!r}"
    if len(events) != chunks + 1:
        return f"{len(events)} events, expected {chunks + 1}"
    if any(b'"error"' in e for e in events):
        return f"error event: {raw[:160]!r}"
    return None


async def _run_cell(cmd: dict[str, Any], out: Any, inp: Any) -> None:
    import aiohttp

    url, n, warmup, conc = cmd["url"], cmd["n"], cmd["warmup"], cmd["concurrency"]
    mode = MODES[cmd["mode"]]
    stream, chunks, ptoks = mode["stream"], mode["chunks"], cmd["prompt_tokens"]
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)
    ) as session:

        async def phase(count: int, base: int) -> tuple[list[float], list[str], float, float]:
            lat: list[float] = []
            bad: list[str] = []
            nxt = 0

            async def worker() -> None:
                nonlocal nxt
                while nxt < count:
                    i = base + nxt
                    nxt += 1
                    body = _body(i, stream, ptoks)
                    t0 = time.perf_counter()
                    try:
                        async with session.post(url, data=body, headers=headers) as r:
                            raw = await r.read()
                            status = r.status
                    except Exception as err:  # a failed request is a bad response
                        bad.append(f"{type(err).__name__}: {err}")
                        continue
                    lat.append(time.perf_counter() - t0)
                    why = _check(status, raw, stream, chunks)
                    if why is not None:
                        bad.append(why)

            c0, t0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(conc)))
            return lat, bad, time.perf_counter() - t0, time.process_time() - c0

        _, wbad, _, _ = await phase(warmup, 10_000_000)
        out.write(json.dumps({"event": "warm", "bad": len(wbad), "bad_samples": wbad[:3]}) + "\n")
        out.flush()
        go = await asyncio.get_running_loop().run_in_executor(None, inp.readline)
        if not go.strip():
            return
        lat, bad, wall, cpu = await phase(n, 0)
    lat.sort()

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else float("nan")

    out.write(
        json.dumps(
            {
                "event": "done",
                "n": n,
                "ok": n - len(bad),
                "bad": len(bad),
                "bad_samples": bad[:5],
                "wall_s": wall,
                "client_cpu_s": cpu,
                "p50_ms": pct(0.50),
                "p99_ms": pct(0.99),
            }
        )
        + "\n"
    )
    out.flush()


def loadgen_main() -> None:
    import uvloop

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line.strip():
                return
            await _run_cell(json.loads(line), sys.stdout, sys.stdin)

    uvloop.run(serve())


# -- process CPU -------------------------------------------------------------------------------


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


# -- processes ---------------------------------------------------------------------------------


def http_json(method: str, url: str, body: Any = None, timeout: float = 5.0) -> tuple[int, Any]:
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"} if data else {}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as err:
        return err.code, None
    except (urllib.error.URLError, OSError):
        return 0, None


def wait_health(url: str, proc: subprocess.Popen[bytes] | None, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while http_json("GET", url, timeout=1.0)[0] != 200:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} during start-up")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not healthy after {timeout_s:g} s ({url})")
        time.sleep(0.1)


def stop_proc(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def median_row(rows: list[dict[str, Any]], key: str) -> tuple[float, float, float]:
    vals = [r[key] for r in rows]
    return statistics.median(vals), min(vals), max(vals)


# -- the run -----------------------------------------------------------------------------------


def listener_pid(url: str) -> int:
    """The pid of the process listening on `url`'s port on this machine (a `--vs` router's)."""
    import urllib.parse

    from shmdisagg.procutil import listeners

    port = urllib.parse.urlsplit(url).port
    pids = [x.pid for x in listeners(port or 0) if x.pid is not None]
    if not pids:
        raise RuntimeError(f"no process of this user listens on {url}'s port (--vs measures local routers)")
    return pids[0]


def parse_vs(specs: list[str]) -> dict[str, str]:
    """`NAME=URL` (or a bare URL, named vs1, vs2, ...) -> {name: base url}."""
    out = {}
    for k, spec in enumerate(specs, 1):
        name, _, url = spec.rpartition("=") if "=" in spec.split("://")[0] else ("", "", spec)
        out[name or f"vs{k}"] = url.rstrip("/")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="measured requests per cell")
    ap.add_argument("--warmup", type=int, default=300, help="unmeasured requests before each cell (default 300)")
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight, closed loop (default 32)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over every mode and system (default 3)")
    ap.add_argument("--modes", default="nonstream,stream16,stream16_paced5ms", help=f"of {', '.join(MODES)}")
    ap.add_argument("--fleet", default="1", help="fleet sizes (num_workers) to run side by side, e.g. 1,2,4")
    ap.add_argument(
        "--systems",
        default="shmdisagg,baseline",
        help="of shmdisagg (one per --fleet size), baseline, direct (the generation fake alone: one hop, no router)",
    )
    ap.add_argument(
        "--vs",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="another router on this machine, already serving against the fakes this run prints (repeatable); "
        "its CPU is the process listening on URL's port",
    )
    ap.add_argument("--vs-wait", type=float, default=0.0, help="seconds to wait after printing the fakes, for --vs")
    ap.add_argument("--ctx-servers", type=int, default=1)
    ap.add_argument("--gen-servers", type=int, default=1)
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="send a list of this many token ids as the prompt instead of the text prompt",
    )
    ap.add_argument("--baseline-log-level", default="warning")
    ap.add_argument("--json", default=None, help="write every cell's numbers here")
    ap.add_argument("--loadgen", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.loadgen:
        loadgen_main()
        return 0

    from tests.conftest import free_port
    from tests.integration.harness import deployment, write_config

    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m}")
    fleet_sizes = [int(f) for f in args.fleet.split(",") if f]
    kinds = [s for s in args.systems.split(",") if s]
    for kind in kinds:
        if kind not in ("shmdisagg", "baseline", "direct"):
            ap.error(f"unknown system {kind}")
    vs = parse_vs(args.vs)
    systems = [
        *(_shm_name(f, fleet_sizes) for f in fleet_sizes if "shmdisagg" in kinds),
        *(k for k in ("baseline", "direct") if k in kinds),
        *vs,
    ]
    py = sys.executable
    fakes: list[tuple[str, int, subprocess.Popen[bytes]]] = []
    baseline: subprocess.Popen[bytes] | None = None
    loadgen: subprocess.Popen[bytes] | None = None
    tmp = Path(tempfile.mkdtemp(prefix="bench-orch-"))
    shm_prefixes: list[str] = []
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    try:
        for role, count in (("ctx", args.ctx_servers), ("gen", args.gen_servers)):
            for k in range(count):
                port = free_port()
                proc = subprocess.Popen(
                    [py, "-m", "tests.fakes.executor", "--port", str(port), "--name", f"{role}{k}"],
                    cwd=REPO,
                    stdin=subprocess.DEVNULL,
                )
                fakes.append((role, port, proc))
        for role, port, proc in fakes:
            wait_health(f"http://127.0.0.1:{port}/health", proc, f"fake {role} :{port}")
        ctx_urls = [f"127.0.0.1:{p}" for r, p, _ in fakes if r == "ctx"]
        gen_urls = [f"127.0.0.1:{p}" for r, p, _ in fakes if r == "gen"]
        print(f"# fakes: context {' '.join(ctx_urls)}; generation {' '.join(gen_urls)}", flush=True)
        if vs and args.vs_wait > 0:
            time.sleep(args.vs_wait)  # for a --vs router started against the fakes just printed

        targets: dict[str, dict[str, Any]] = {}
        with contextlib.ExitStack() as stack:
            for size in fleet_sizes if "shmdisagg" in kinds else []:
                shm_prefix = f"shmdisagg-b{uuid.uuid4().hex[:10]}"
                shm_prefixes.append(shm_prefix)
                (tmp / f"f{size}").mkdir()
                cfg = write_config(
                    tmp / f"f{size}",
                    shm_prefix,
                    ctx_urls,
                    gen_urls,
                    num_workers=size,
                    shmdisagg={"health_check_interval_s": 0.5, "request_timeout_s": 180},
                )
                dep = stack.enter_context(deployment(cfg))
                status, info = http_json("GET", f"{dep.url}/cluster_info")
                if status != 200 or len(info.get("fleet_pids") or ()) != size:
                    raise RuntimeError(f"shmdisagg /cluster_info answered {status}: {info}")
                targets[_shm_name(size, fleet_sizes)] = {
                    "url": f"{dep.url}/v1/completions",
                    "pids": {"proxy": list(info["fleet_pids"]), "coord": [info["coordinator_pid"]]},
                }
            if "baseline" in kinds:
                base_port = free_port()
                argv = [
                    py,
                    str(REPO / "benchmarks" / "baseline_trtllm_orchestrator.py"),
                    "--port",
                    str(base_port),
                    "--log-level",
                    args.baseline_log_level,
                ]
                for u in ctx_urls:
                    argv += ["--ctx", u]
                for u in gen_urls:
                    argv += ["--gen", u]
                baseline = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL)
                base_url = f"http://127.0.0.1:{base_port}"
                wait_health(f"{base_url}/health", baseline, "baseline")
                targets["baseline"] = {"url": f"{base_url}/v1/completions", "pids": {"proxy": [baseline.pid]}}
            if "direct" in kinds:  # the generation fake answers a plain request itself: one hop
                targets["direct"] = {"url": f"http://{gen_urls[0]}/v1/completions", "pids": {}}
            for name, url in vs.items():
                wait_health(f"{url}/health", None, name)
                targets[name] = {"url": f"{url}/v1/completions", "pids": {"proxy": [listener_pid(url)]}}

            loadgen = subprocess.Popen(
                [py, str(Path(__file__).resolve()), "--loadgen"],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert loadgen.stdin is not None and loadgen.stdout is not None
            backend_pids = [p.pid for _, _, p in fakes]
            print(
                "# "
                + "; ".join(f"{name}: {t['url']} pids {t['pids']}" for name, t in targets.items())
                + f"; loadgen pid {loadgen.pid}",
                flush=True,
            )

            for rnd in range(args.rounds):
                for mode in modes:
                    for fk in fakes:
                        s, _ = http_json(
                            "POST",
                            f"http://127.0.0.1:{fk[1]}/_script",
                            {k: v for k, v in MODES[mode].items() if k != "stream"},
                        )
                        if s != 200:
                            raise RuntimeError(f"fake :{fk[1]} refused /_script ({s})")
                    order = systems if rnd % 2 == 0 else list(reversed(systems))
                    for system in order:
                        row = run_cell(loadgen, targets[system], system, mode, rnd, backend_pids, args)
                        results.setdefault((system, mode), []).append(row)
            loadgen.stdin.write("\n")
            loadgen.stdin.flush()
            loadgen.wait(timeout=30)
            stop_proc(baseline)
    finally:
        stop_proc(loadgen)
        stop_proc(baseline)
        for _, _, proc in fakes:
            stop_proc(proc)
        for prefix in shm_prefixes:
            for path in glob.glob(f"/dev/shm/{prefix}*"):
                with contextlib.suppress(OSError):
                    os.unlink(path)

    report(results, modes, systems, args)
    if args.json:
        Path(args.json).write_text(json.dumps([r for rows in results.values() for r in rows], indent=1))
    bad = sum(r["bad"] for rows in results.values() for r in rows)
    return 1 if bad else 0


def _shm_name(size: int, sizes: list[int]) -> str:
    return "shmdisagg" if sizes == [1] else f"shmdisagg-f{size}"


def run_cell(
    loadgen: subprocess.Popen[str],
    target: dict[str, Any],
    system: str,
    mode: str,
    rnd: int,
    backend_pids: list[int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One system in one mode: warm-up, then the measured requests with CPU sampled around them."""
    assert loadgen.stdin is not None and loadgen.stdout is not None
    pids = {**target["pids"], "backends": backend_pids, "client": [loadgen.pid]}
    cell = {
        "url": target["url"],
        "mode": mode,
        "n": args.n,
        "warmup": args.warmup,
        "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens,
    }
    loadgen.stdin.write(json.dumps(cell) + "\n")
    loadgen.stdin.flush()
    warm = json.loads(loadgen.stdout.readline())
    before = sample(pids)
    loadgen.stdin.write("go\n")
    loadgen.stdin.flush()
    done = json.loads(loadgen.stdout.readline())
    after = sample(pids)
    n = done["n"]
    row: dict[str, Any] = {
        "round": rnd,
        "system": system,
        "mode": mode,
        "n": n,
        "bad": done["bad"] + warm["bad"],
        "bad_samples": done["bad_samples"] + warm["bad_samples"],
        "req_s": n / done["wall_s"],
        "p50_ms": done["p50_ms"],
        "p99_ms": done["p99_ms"],
        "client_cpu_ms": done["client_cpu_s"] * 1000 / n,
    }
    for k in pids:
        row[f"{k}_ms"] = (after[k][0] - before[k][0]) * 1000 / CLK_TCK / n
        row[f"{k}_ns_ms"] = (after[k][1] - before[k][1]) / 1e6 / n
        row[f"{k}_sys_ms"] = (after[k][2] - before[k][2]) * 1000 / CLK_TCK / n
    proxy = (
        f"proxy {row['proxy_ms']:.3f} ms/req (ns {row['proxy_ns_ms']:.3f}, kernel {row['proxy_sys_ms']:.3f})"
        if "proxy_ms" in row
        else "no proxy"
    )
    print(
        f"round {rnd} {mode:<18} {system:<12}  {proxy}"
        + (f"  coord {row['coord_ms']:.3f}" if "coord_ms" in row else "")
        + f"  {row['req_s']:.0f} req/s  p50 {row['p50_ms']:.1f}  p99 {row['p99_ms']:.1f} ms  "
        f"bad {row['bad']}" + (f"  e.g. {row['bad_samples'][0]}" if row["bad_samples"] else ""),
        flush=True,
    )
    return row


def report(
    results: dict[tuple[str, str], list[dict[str, Any]]], modes: list[str], systems: list[str], args: argparse.Namespace
) -> None:
    print()
    print(
        f"N={args.n} per cell after {args.warmup} warm-up, c={args.concurrency}, {args.rounds} rounds (median, "
        "min-max); "
        f"prompt={f'{args.prompt_tokens} token ids' if args.prompt_tokens else 'text'}; {args.ctx_servers} ctx + "
        f"{args.gen_servers} gen fakes"
    )
    print()
    print(
        "| system | mode | proxy CPU ms/req (/proc ticks) | of which kernel | proxy CPU ms/req (ns) | "
        "coordinator ms/req | req/s | p50 ms | p99 ms | p50 / p99 − direct's, ms | backends CPU ms/req | "
        "client CPU ms/req | bad |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        direct = results.get(("direct", mode))
        for system in systems:
            rows = results.get((system, mode))
            if not rows:
                continue
            if "proxy_ms" in rows[0]:
                cpu, lo, hi = median_row(rows, "proxy_ms")
                ns, nlo, nhi = median_row(rows, "proxy_ns_ms")
                proxy = (
                    f"{cpu:.3f} ({lo:.3f}–{hi:.3f}) | {median_row(rows, 'proxy_sys_ms')[0]:.3f} | "
                    f"{ns:.3f} ({nlo:.3f}–{nhi:.3f})"
                )
            else:
                proxy = "– | – | –"
            coord = f"{median_row(rows, 'coord_ns_ms')[0]:.3f}" if "coord_ms" in rows[0] else "–"
            p50, p99 = median_row(rows, "p50_ms")[0], median_row(rows, "p99_ms")[0]
            added = (
                f"{p50 - median_row(direct, 'p50_ms')[0]:.1f} / {p99 - median_row(direct, 'p99_ms')[0]:.1f}"
                if direct and system != "direct"
                else "–"
            )
            print(
                f"| {system} | {mode} | {proxy} | {coord} | {median_row(rows, 'req_s')[0]:.0f} | {p50:.1f} | "
                f"{p99:.1f} | {added} | {median_row(rows, 'backends_ms')[0]:.3f} | "
                f"{median_row(rows, 'client_cpu_ms')[0]:.3f} | {sum(r['bad'] for r in rows)} |"
            )
    ours = [s for s in systems if s.startswith("shmdisagg")]
    others = [s for s in systems if s not in ours and s != "direct"]
    for other in others:
        print()
        print(
            f"| mode | shmdisagg | {other} / shmdisagg, proxy CPU (ns) | same, shmdisagg worker(s) + coordinator | "
            f"{other} / shmdisagg, req/s |"
        )
        print("|---|---|---|---|---|")
        for mode in modes:
            b = results.get((other, mode))
            for ours_name in ours:
                s = results.get((ours_name, mode))
                if not b or not s:
                    continue
                bc, sc = median_row(b, "proxy_ns_ms")[0], median_row(s, "proxy_ns_ms")[0]
                sct = statistics.median(r["proxy_ns_ms"] + r["coord_ns_ms"] for r in s)
                print(
                    f"| {mode} | {ours_name} | {bc / sc:.2f}× ({bc:.3f} / {sc:.3f}) | {bc / sct:.2f}× ({bc:.3f} / "
                    f"{sct:.3f}) | {median_row(b, 'req_s')[0] / median_row(s, 'req_s')[0]:.2f} |"
                )
    if len(ours) > 1:  # the fleet's scaling: CPU per request of each size against the first's
        print()
        print(f"| mode | fleet | proxy + coordinator CPU ms/req (ns) | / {ours[0]} |")
        print("|---|---|---|---|")
        for mode in modes:
            first = results.get((ours[0], mode))
            for name in ours:
                rows = results.get((name, mode))
                if not rows or not first:
                    continue
                total = statistics.median(r["proxy_ns_ms"] + r["coord_ns_ms"] for r in rows)
                base = statistics.median(r["proxy_ns_ms"] + r["coord_ns_ms"] for r in first)
                print(f"| {mode} | {name} | {total:.3f} | {total / base:.2f}× |")


if __name__ == "__main__":
    sys.exit(main())
