#!/usr/bin/env python
"""Fleet CPU per request of two or more builds of shmdisagg, taking turns against the same fakes.

For a before/after figure of a change to the request path: each `--tree` is a checkout with its
own `.venv` (CONTRIBUTING.md, "compare two builds"). One pair of recording fakes
(`tests/fakes/executor.py` of this tree, recording off) serves every cell. A cell starts one
deployment of one tree (`<tree>/.venv/bin/shmdisagg serve`, `--fleet` workers), warms it, then
sends `--n` requests at concurrency `--concurrency` from this process (aiohttp on uvloop) and
reads the fleet workers' CPU (the run time of their threads, `/proc/<pid>/task/*/schedstat`),
their voluntary and involuntary context switches and their page faults around them, and the
largest worker's RSS after them; then it stops the deployment.
Trees take turns within every round (the order flips each round), so drift hits them alike. Each response is checked as
`bench_orchestrator_cpu.py` checks it. Prints a table of medians (min-max) and each tree's ratio
to the first.

    .venv/bin/python benchmarks/bench_trees.py --tree . --tree /tmp/base [--modes nonstream,stream16,stream16_paced5ms]
        [--fleet 1,4] [--n 3000] [--warmup 300] [--concurrency 32] [--rounds 3] [--prompt-tokens 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.benchkit import (  # noqa: E402
    MODES,
    check_response,
    checkout_with_venv,
    count,
    count_or_zero,
    cpu_ns,
    free_port,
    positive_ints,
    stop_proc,
    wait_health,
)

PROMPT_TOKENS = 0  # --prompt-tokens: a list of that many token ids as the prompt instead of text


def body(i: int, stream: bool) -> bytes:
    import orjson

    if PROMPT_TOKENS:
        prompt: object = [1000 + (i * 7 + k) % 30000 for k in range(PROMPT_TOKENS)]
    else:
        prompt = f"request {i}: " + "lorem ipsum " * 20
    return orjson.dumps({"model": "fake-model", "prompt": prompt, "max_tokens": 16, "stream": stream})


async def load(url: str, n: int, base: int, stream: bool, concurrency: int) -> int:
    """`n` requests, `concurrency` at a time; the number of bad responses."""
    import aiohttp

    bad = 0
    nxt = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            nonlocal nxt, bad
            while nxt < n:
                i = base + nxt
                nxt += 1
                async with session.post(url, data=body(i, stream), headers={"content-type": "application/json"}) as r:
                    raw = await r.read()
                    if check_response(r.status, raw, stream, 16) is not None:
                        bad += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return bad


def page_faults(pid: int) -> int:
    """Minor and major page faults of `pid` so far (/proc/<pid>/stat: minflt, majflt)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[7]) + int(fields[9])


def rss_mib(pid: int) -> float:
    """Resident memory of `pid` now, MiB (/proc/<pid>/status VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def switches(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return sum(int(line.split(":")[1]) for line in f if "ctxt_switches" in line)


@contextlib.contextmanager
def fakes_running() -> Iterator[list[int]]:
    """A context and a generation recording fake (`tests/fakes/executor.py`), healthy: their
    ports. Stopped on exit."""
    fakes: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    try:
        for role in ("ctx", "gen"):
            ports.append(free_port())
            cmd = [sys.executable, "-m", "tests.fakes.executor", "--port", str(ports[-1]), "--name", role]
            fakes.append(subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL))
        for port, proc in zip(ports, fakes, strict=True):
            wait_health(f"http://127.0.0.1:{port}/health", proc, f"fake :{port}")
        yield ports
    finally:
        for proc in fakes:
            stop_proc(proc)


def script_fakes(ports: list[int], mode: str) -> None:
    """Script the fakes for `mode` (`benchkit.MODES`): 16 chunks, paced or not, recording off."""
    for port in ports:
        script = {"chunks": 16, "chunk_interval_s": MODES[mode]["chunk_interval_s"], "record": False}
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/_script",
            data=json.dumps(script).encode(),
            headers={"content-type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(req).read()


@contextlib.contextmanager
def deployment(
    tree: Path, fakes: list[int], fleet: int, urls: tuple[list[str], list[str]] | None = None
) -> Iterator[tuple[str, list[int]]]:
    """`shmdisagg serve` of `tree` with `fleet` workers in front of the fakes (or of `urls`:
    context and generation `host:port`s), every worker's row claimed: (base URL, fleet worker
    pids). Stopped on exit."""
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="bench-trees-"))
    ctx, gen = urls if urls is not None else ([f"127.0.0.1:{fakes[0]}"], [f"127.0.0.1:{fakes[1]}"])
    (tmp / "config.yaml").write_text(
        f"hostname: 127.0.0.1\nport: {port}\nnum_workers: {fleet}\n"
        f"context_servers: {{num_instances: {len(ctx)}, urls: {ctx}}}\n"
        f"generation_servers: {{num_instances: {len(gen)}, urls: {gen}}}\n"
        f"shmdisagg: {{shm: {{prefix: shmdisagg-bt{port}}}, coordinator_socket: {tmp}/c.sock, "
        "request_timeout_s: 180, health_check_interval_s: 0.5}\n"
    )
    serve = subprocess.Popen(
        [str(tree / ".venv/bin/shmdisagg"), "serve", "-c", str(tmp / "config.yaml"), "-l", "warning"],
        cwd=tree,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_health(f"{base}/health", serve, f"{tree} serve")
        pids: list[int] = []
        for _ in range(100):  # every worker's row claimed (ready means listening; the claim is earlier still)
            with urllib.request.urlopen(f"{base}/cluster_info") as r:
                pids = json.loads(r.read())["fleet_pids"]
            if len(pids) == fleet:
                break
            time.sleep(0.1)
        if len(pids) != fleet:
            raise RuntimeError(f"{tree}: {len(pids)} fleet pids, expected {fleet}")
        yield base, pids
    finally:
        stop_proc(serve)


def cell(tree: Path, fakes: list[int], mode: str, fleet: int, args: argparse.Namespace) -> dict[str, float]:
    import uvloop

    with deployment(tree, fakes, fleet) as (base, pids):
        stream = MODES[mode]["stream"]
        url = f"{base}/v1/completions"
        uvloop.run(load(url, args.warmup, 10_000_000, stream, args.concurrency))
        t0 = [cpu_ns(p) for p in pids]
        s0 = [switches(p) for p in pids]
        f0 = [page_faults(p) for p in pids]
        bad = uvloop.run(load(url, args.n, 0, stream, args.concurrency))
        cpu_ns_total = sum(cpu_ns(p) - a for p, a in zip(pids, t0, strict=True))
        sw = sum(switches(p) - a for p, a in zip(pids, s0, strict=True))
        faults = sum(page_faults(p) - a for p, a in zip(pids, f0, strict=True))
        rss = max(rss_mib(p) for p in pids)
        return {
            "cpu_ms": cpu_ns_total / 1e6 / args.n,
            "switches": sw / args.n,
            "faults": faults / args.n,
            "rss_mib": rss,
            "bad": bad,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tree", action="append", type=checkout_with_venv, required=True, help="a checkout with its .venv (repeatable)"
    )
    ap.add_argument("--modes", default="nonstream,stream16,stream16_paced5ms")
    ap.add_argument("--fleet", default="1,4", help="fleet sizes (num_workers)")
    ap.add_argument("--n", type=count, default=3000)
    ap.add_argument("--warmup", type=count_or_zero, default=300)
    ap.add_argument("--concurrency", type=count, default=32)
    ap.add_argument("--rounds", type=count, default=3)
    ap.add_argument("--prompt-tokens", type=count_or_zero, default=0, help="token-id prompts of this length (0: text)")
    args = ap.parse_args()
    global PROMPT_TOKENS
    PROMPT_TOKENS = args.prompt_tokens
    trees = [Path(t).resolve() for t in args.tree]
    modes = args.modes.split(",")
    fleets = positive_ints(ap, "--fleet", args.fleet)
    results: dict[tuple[str, int, str], list[dict[str, float]]] = {}
    with fakes_running() as fakes:
        for rnd in range(args.rounds):
            for mode in modes:
                script_fakes(fakes, mode)
                for fleet in fleets:
                    for tree in trees if rnd % 2 == 0 else reversed(trees):
                        row = cell(tree, fakes, mode, fleet, args)
                        results.setdefault((str(tree), fleet, mode), []).append(row)
                        print(f"round {rnd} {mode:18} f{fleet} {tree}: {row}", flush=True)
    print(
        f"\n{time.strftime('%Y-%m-%d %H:%M')}, N={args.n} after {args.warmup} warm-up, c={args.concurrency}, "
        f"{args.rounds} rounds (median, min-max); load average {os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| mode | fleet | tree | fleet CPU ms/req | context switches/req | page faults/req "
        "| RSS after, MiB (largest worker) | / first tree | bad |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        for fleet in fleets:
            first = None
            for tree in trees:
                rows = results[(str(tree), fleet, mode)]
                cpu = [r["cpu_ms"] for r in rows]
                med = statistics.median(cpu)
                first = first or med
                sw = statistics.median(r["switches"] for r in rows)
                faults = statistics.median(r["faults"] for r in rows)
                rss = statistics.median(r["rss_mib"] for r in rows)
                print(
                    f"| {mode} | {fleet} | {tree} | {med:.3f} ({min(cpu):.3f}-{max(cpu):.3f}) | {sw:.2f} "
                    f"| {faults:.1f} | {rss:.0f} | {med / first:.2f}x | {sum(r['bad'] for r in rows):.0f} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
