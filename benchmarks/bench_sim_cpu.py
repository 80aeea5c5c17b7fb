#!/usr/bin/env python
"""Simulator CPU per request and per token: one simulated executor under a closed-loop load.

The simulator (`python -m shmdisagg.executors.sim`, speed-up 1, the default profile) runs in its
own process; a load generator (aiohttp on uvloop, in this process) keeps `--concurrency`
requests of `--prompt-tokens` random token ids in flight. A cell is one (source tree, output
length, stream or not): a warm-up, then `--n` measured requests; every answer is checked
(status 200, `completion_tokens` equal to `max_tokens`, streams ending in `data: [DONE]`). CPU
is the simulator's utime+stime from `/proc/<pid>/stat` (10 ms ticks) over the measured part,
divided by the requests. Two output lengths give the marginal cost of a token (the slope) and
of a request (the intercept). `--tree DIR` (repeatable) runs the simulator from another checkout
(e.g. `git worktree add /tmp/base HEAD~3`), so an old and a new tree are measured side by side
in one run; rounds alternate the order of the trees.

    .venv/bin/python benchmarks/bench_sim_cpu.py [--tree .] [--tree /tmp/base] [--n 400]
        [--concurrency 64] [--prompt-tokens 256] [--outputs 16,128] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchkit import checkout, count, count_or_zero, positive_ints  # this script's directory, sys.path[0]

REPO = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


async def wait_healthy(session: Any, base: str, proc: subprocess.Popen[bytes], deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"simulator exited with {proc.returncode}")
        try:
            async with session.get(f"{base}/health") as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.05)
    raise TimeoutError("simulator not healthy")


async def one(session: Any, base: str, body: dict[str, Any]) -> None:
    async with session.post(f"{base}/v1/completions", json=body) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {raw[:300]!r}")
        if body["stream"]:
            if not raw.rstrip().endswith(b"data: [DONE]"):
                raise RuntimeError("stream did not end with [DONE]")
        elif json.loads(raw)["usage"]["completion_tokens"] != body["max_tokens"]:
            raise RuntimeError(f"wrong completion length: {raw[:300]!r}")


async def load(
    session: Any, base: str, n: int, concurrency: int, prompt_tokens: int, out: int, stream: bool, rng: random.Random
) -> None:
    queue = list(range(n))

    async def worker() -> None:
        while queue:
            queue.pop()
            prompt = [rng.randrange(1000, 120000) for _ in range(prompt_tokens)]
            await one(session, base, {"model": "sim", "prompt": prompt, "max_tokens": out, "stream": stream})

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def cell(tree: Path, args: argparse.Namespace, out: int, stream: bool, seed: int) -> float:
    import aiohttp

    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmdisagg.executors.sim", "--port", str(port), "--num-blocks", "65536",
         "--max-batch-size", "512", "--log-level", "error"],
        env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    rng = random.Random(seed)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await wait_healthy(session, base, proc)
            await load(session, base, args.warmup, args.concurrency, args.prompt_tokens, out, stream, rng)
            before = cpu_seconds(proc.pid)
            await load(session, base, args.n, args.concurrency, args.prompt_tokens, out, stream, rng)
            return (cpu_seconds(proc.pid) - before) / args.n
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", type=checkout, help="source tree to run the simulator from (repeatable)")
    p.add_argument("--n", type=count, default=400)
    p.add_argument("--warmup", type=count_or_zero, default=100)
    p.add_argument("--concurrency", type=count, default=64)
    p.add_argument("--prompt-tokens", type=count, default=256)
    p.add_argument("--outputs", default="16,128")
    p.add_argument("--rounds", type=count, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    trees = [t.resolve() for t in (args.tree or [REPO])]
    outputs = positive_ints(p, "--outputs", args.outputs)
    samples: dict[tuple[str, bool, int], list[float]] = {}
    for r in range(args.rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        for stream in (False, True):
            for out in outputs:
                for tree in order:
                    ms = 1000 * asyncio.run(cell(tree, args, out, stream, seed=r))
                    samples.setdefault((str(tree), stream, out), []).append(ms)
                    print(f"round {r} {tree} stream={stream} out={out}: {ms:.3f} ms/request", flush=True)
    rows = []
    for tree in trees:
        for stream in (False, True):
            med = {out: statistics.median(samples[(str(tree), stream, out)]) for out in outputs}
            lo, hi = outputs[0], outputs[-1]
            per_token_us = 1000 * (med[hi] - med[lo]) / (hi - lo)
            per_request_ms = med[lo] - per_token_us * lo / 1000
            rows.append(
                {
                    "tree": str(tree),
                    "stream": stream,
                    "ms_per_request": med,
                    "us_per_token": round(per_token_us, 2),
                    "ms_per_request_intercept": round(per_request_ms, 3),
                }
            )
            print(
                f"{tree} stream={stream}: "
                + ", ".join(f"{o} tokens {m:.3f} ms" for o, m in med.items())
                + f"; {per_token_us:.1f} us/token, {per_request_ms:.3f} ms/request"
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"tree": [str(t) for t in trees], "json": str(args.json)}, "rows": rows}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
