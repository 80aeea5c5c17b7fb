#!/usr/bin/env python
"""Does the orchestrator's cost grow with scale? Issue 14's sweep: CPU per request, added latency
and memory of shmdisagg along three axes, each axis side by side in one run.

- **executors** (`--executor-counts 4,8,16,32,64`, half context, half generation, the odd one a
  generation executor): one deployment
  per count, all up at once, `load_balancing` on both roles (each pick reads every server's load;
  `--routers` changes it); `nonstream` and `stream16` at `--concurrency` 32, then `--latency-n`
  requests one at a time. The executors are recording fakes, one process per role serving every
  port of that role (`tests/fakes/multiport.py`), so only the number of executors changes, not
  the number of processes competing for the cores.
- **streams** (`--streams 32,128,512,2048` concurrent streams): one deployment per level, all up
  at once. The request rate is held at `--stream-rate` (100 req/s) by pacing each stream's 16
  chunks `C / (16 × rate)` apart (20 ms at 32 streams, 1.28 s at 2,048), and the k-th of the C
  request loops starts k/C of a stream late, so the streams arrive spread out: more open streams,
  the same work per second. Each cell measures `--waves` × C requests (at least `--stream-min-n`,
  1,000) after C warm-up requests, with no pause in between (`--stream-phases steady`,
  benchkit's steady protocol), so the measured window holds C open streams and no connection
  set-up. Reports CPU per request, time
  to first byte (added: minus the two-hop floor at the same concurrency), memory per open stream
  (the fleet workers' anonymous RSS sampled once every stream is open, less the same before the
  first cell, divided by C) and per-worker RSS.
  `--vllm-router auto|PATH` adds vLLM's Rust router (prefill/decode mode, two hops; one process
  for every level) to every level's rounds, and a table of both systems' CPU per request, each
  against its own at the first level.
- **prompt** (`--prompt-sizes 1024,8192,32768,131072` token ids): `round_robin` (no hashing) and
  `kv_cache_aware` (hashes every block of the prompt; the tokenizer it needs is built offline,
  `tests/hf_tokenizer.py`) side by side at `--prompt-concurrency` 8, non-streaming. Requests per
  cell: `--prompt-token-budget` / size, within 30..600. The context fake echoes the prompt's ids
  (`prompt_token_ids`), so the generation leg carries them again, as with a real executor. The
  block hashing itself (`shmdisagg.hashing.block_hashes_bytes`, what `kv_cache_aware` runs per
  request) and parsing the request's JSON are timed in this process for each size, to tell them
  from the rest.

Every axis has **direct2** (the load generator sending both legs itself: the two-hop floor) in
the same run; added latency is a system's percentile minus direct2's. CPU is /proc, per process
group, around the measured requests (`benchkit.py`); the fleet column sums the fleet workers
(the warm standby is not counted), the coordinator has its own column. Rounds alternate the
order of the cells; tables show the median round (min-max).

    .venv/bin/python benchmarks/bench_scaling.py [--axes executors,streams,prompt] [--fleet 2]
        [--rounds 2] [--vllm-router auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import timeit
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchkit
from benchkit import MODES, median_min_max, pct

from shmdisagg.config import ROUTER_TYPES

AXES = ("executors", "streams", "prompt")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--axes", default=",".join(AXES), help=f"of {', '.join(AXES)} (default all three)")
    ap.add_argument("--fleet", type=int, default=2, help="fleet workers of every deployment (default 2)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over every cell of an axis (default 2)")
    ap.add_argument("--json", default=None, help="write every cell's numbers here")
    g = ap.add_argument_group("executors axis")
    g.add_argument(
        "--executor-counts",
        default="4,8,16,32,64",
        help="executors per deployment, half of each role (an odd count: one more generation executor)",
    )
    g.add_argument("--routers", default="load_balancing,load_balancing", help="context,generation router types")
    g.add_argument("--modes", default="nonstream,stream16", help=f"of {', '.join(MODES)}")
    g.add_argument("--n", type=int, default=1000, help="measured requests per cell (default 1000)")
    g.add_argument("--warmup", type=benchkit.count_or_zero, default=200)
    g.add_argument("--concurrency", type=int, default=32)
    g.add_argument(
        "--latency-n",
        type=benchkit.count_or_zero,
        default=100,
        help="requests one at a time after each cell (default 100)",
    )
    g = ap.add_argument_group("streams axis")
    g.add_argument(
        "--streams", default="32,128,512,2048", help="concurrent streams, one deployment each (default 32,128,512,2048)"
    )
    g.add_argument("--stream-rate", type=float, default=100.0, help="requests per second held at every level")
    g.add_argument("--waves", type=int, default=2, help="measured requests per cell = waves x streams (default 2)")
    g.add_argument(
        "--stream-min-n",
        type=int,
        default=1000,
        help="but at least this many (default 1000: 64 requests at 32 streams is a 0.6 s window, too short)",
    )
    g.add_argument(
        "--stream-phases",
        choices=("steady", "barrier"),
        default="steady",
        help="steady (default): the measured requests follow the warm-up with no pause, every "
        "connection kept open; barrier: all loops stop after the warm-up and start again staggered "
        "(this axis' protocol before 2026-12-07, which let idle connections close in between)",
    )
    g.add_argument("--stream-executors", type=int, default=4, help="executors, half of each role (default 4)")
    g.add_argument(
        "--vllm-router",
        default=None,
        metavar="auto|PATH",
        help="also run vLLM's Rust router (prefill/decode mode, two hops) at every level "
        "(auto: .venv-peers/bin/vllm-router)",
    )
    g = ap.add_argument_group("prompt axis")
    g.add_argument("--prompt-sizes", default="1024,8192,32768,131072", help="prompt lengths in token ids")
    g.add_argument("--prompt-concurrency", type=int, default=8)
    g.add_argument("--prompt-token-budget", type=float, default=8e6, help="prompt tokens per cell (default 8e6)")
    g.add_argument(
        "--prompt-latency-n",
        type=benchkit.count_or_zero,
        default=20,
        help="requests one at a time per cell (default 20)",
    )
    args = ap.parse_args()
    axes = [a for a in args.axes.split(",") if a]
    if not axes:
        ap.error(f"--axes: name at least one of {', '.join(AXES)}")
    for a in axes:
        if a not in AXES:
            ap.error(f"unknown axis {a}")
    for option in ("executor_counts", "streams", "prompt_sizes"):
        setattr(args, option, benchkit.positive_ints(ap, "--" + option.replace("_", "-"), getattr(args, option)))
    benchkit.at_least_one(
        ap, args, "fleet", "rounds", "n", "concurrency", "waves", "stream_min_n", "prompt_concurrency"
    )
    args.modes = benchkit.mode_list(ap, args.modes)
    if min(args.executor_counts) < 2:
        ap.error("--executor-counts: each count must be at least 2 (one executor of each role)")
    routers = args.routers.split(",")
    if len(routers) != 2:
        ap.error(f"--routers: the context and the generation router type, comma-separated, got {args.routers!r}")
    for kind in routers:
        if kind not in ROUTER_TYPES:
            ap.error(f"--routers: unknown router type {kind!r}, of {', '.join(ROUTER_TYPES)}")
    benchkit.json_output(ap, args.json)
    if not 0 < args.stream_rate < float("inf"):
        ap.error(f"--stream-rate must be a finite number above 0, got {args.stream_rate:g}")
    if not 0 < args.prompt_token_budget < float("inf"):
        ap.error(f"--prompt-token-budget must be a finite number above 0, got {args.prompt_token_budget:g}")
    if args.stream_executors < 2:
        ap.error("--stream-executors must be at least 2 (one of each role)")
    if args.vllm_router:
        try:
            args.vllm_router = benchkit.vllm_router_bin(args.vllm_router)
        except RuntimeError as err:
            ap.error(f"--vllm-router: {err}")
    benchkit.exit_on_sigterm()

    print(f"# run {time.strftime('%Y-%m-%d %H:%M')}, load average {benchkit.load_average()} ({os.cpu_count()} CPUs)")
    out: dict[str, Any] = {}
    tmp = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    try:
        for axis in axes:
            t0 = time.monotonic()
            run_axis = {"executors": axis_executors, "streams": axis_streams, "prompt": axis_prompt}[axis]
            out[axis] = run_axis(args, tmp / axis)
            load = benchkit.load_average()
            print(f"# axis {axis}: {time.monotonic() - t0:.0f} s, load average now {load}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the deployments' configs and logs
    for axis in axes:
        {"executors": report_executors, "streams": report_streams, "prompt": report_prompt}[axis](out[axis], args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    bad = sum(r.get("bad", 0) for rows in out.values() for r in rows.get("cells", []))
    return 1 if bad else 0


# -- helpers -----------------------------------------------------------------------------------


@contextlib.contextmanager
def session() -> Any:
    """An ExitStack for deployments and executors, the load generator, and the segments to remove."""
    prefixes: list[str] = []
    stack = contextlib.ExitStack()
    loadgen = benchkit.LoadGen()
    try:
        with stack:
            try:
                yield stack, loadgen, prefixes
            except BaseException:
                loadgen.close()  # mid-cell: its streams end before the deployments stop
                raise
    finally:
        loadgen.close()
        benchkit.cleanup_shm(prefixes)


def new_prefix(prefixes: list[str]) -> str:
    prefix = f"shmdisagg-s{uuid.uuid4().hex[:10]}"
    prefixes.append(prefix)
    return prefix


def memory(pids: list[int]) -> list[dict[str, int]]:
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):
            out.append(benchkit.memory_kib(pid))
    return out


def run(loadgen: benchkit.LoadGen, target: dict[str, Any], spec: dict[str, Any], pids: list[int], **extra: Any) -> Any:
    """One cell; its row with `extra` and the memory of the target's processes after it."""
    groups = {**target["pids"], "executors": pids}
    during = None
    if spec.get("sample_after_s"):
        fleet = target["pids"].get("proxy", [])

        def during() -> list[dict[str, int]]:
            return memory(fleet)

    spec = {"ctx_url": target.get("ctx_url"), "relay": target.get("relay"), "url": target["url"], **spec}
    row = loadgen.cell(spec, groups, during)
    row.update(extra)
    row["fleet_mem_after"] = memory(target["pids"].get("proxy", []))
    row["coord_mem_after"] = memory(target["pids"].get("coord", []))
    bad = f"  bad {row['bad']}" + (f" e.g. {row['bad_samples'][0]}" if row["bad_samples"] else "")
    cpu = f"fleet {row['proxy_ns_ms']:.3f} " if "proxy_ns_ms" in row else ""
    cpu += f"coord {row['coord_ns_ms']:.3f} " if "coord_ns_ms" in row else ""
    cpu += "ms/req  " if cpu else ""
    c1 = f"  c=1 p50 {pct(row['c1_lat_ms'], 0.5, 1):.2f} ms" if "c1_lat_ms" in row else ""
    print(
        f"{' '.join(f'{k}={v}' for k, v in extra.items())}: {cpu}{row['req_s']:.0f} req/s  "
        f"p99 {row['p99_ms']:.1f}  first byte p99 {row['ttfb_p99_ms']:.1f} ms{c1}{bad}",
        flush=True,
    )
    return row


def direct2(executors: benchkit.Executors) -> dict[str, Any]:
    return {
        "url": f"http://{executors.gen[0]}/v1/completions",
        "ctx_url": f"http://{executors.ctx[0]}/v1/completions",
        "relay": "bytes",  # the fakes: no client-side JSON work in the floor
        "pids": {},
    }


def mib(kib: float) -> str:
    return f"{kib / 1024:.1f}"


def cells(rows: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def spread(rows: list[dict[str, Any]], key: str) -> str:
    m, lo, hi = median_min_max([r[key] for r in rows])
    return f"{m:.3f} ({lo:.3f}–{hi:.3f})"


def c1(rows: list[dict[str, Any]], key: str = "c1_lat_ms") -> list[float]:
    return [x for r in rows for x in r.get(key, [])]


# -- executors axis ------------------------------------------------------------------------------


def axis_executors(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    counts: list[int] = args.executor_counts
    modes: list[str] = args.modes
    ctx_router, gen_router = args.routers.split(",")
    rows: list[dict[str, Any]] = []
    idle: dict[str, dict[str, float]] = {}
    with session() as (stack, loadgen, prefixes):
        executors: dict[int, benchkit.Executors] = {}
        targets: dict[int, dict[str, Any]] = {}
        for n in counts:
            ex = benchkit.start_executors("multiport", n // 2, n - n // 2)
            stack.callback(ex.stop)
            executors[n] = ex
        for n in counts:
            targets[n] = benchkit.start_shmdisagg(
                stack,
                tmp / f"n{n}",
                new_prefix(prefixes),
                executors[n].ctx,
                executors[n].gen,
                args.fleet,
                routers=(ctx_router, gen_router),
            )
        print(f"# executors axis: deployments of {counts} executors up, load average {benchkit.load_average()}")
        floor = direct2(executors[counts[0]])
        for rnd in range(args.rounds):
            for mode in modes:
                for ex in executors.values():
                    ex.script(MODES[mode])
                spec = {
                    **MODES[mode],
                    "n": args.n,
                    "warmup": args.warmup,
                    "concurrency": args.concurrency,
                    "latency_n": args.latency_n,
                    "prompt_tokens": 0,
                }
                order: list[Any] = [*counts, "direct2"]
                for n in order if rnd % 2 == 0 else reversed(order):
                    if n == "direct2":
                        rows.append(
                            run(loadgen, floor, spec, executors[counts[0]].pids, round=rnd, mode=mode, n="direct2")
                        )
                    else:
                        rows.append(run(loadgen, targets[n], spec, executors[n].pids, round=rnd, mode=mode, n=n))
        groups = {str(n): {**targets[n]["pids"]} for n in counts}
        idle = benchkit.idle_cpu(groups, 5.0)
    return {"cells": rows, "idle": idle, "counts": counts, "modes": modes}


def report_executors(data: dict[str, Any], args: argparse.Namespace) -> None:
    rows, idle, counts, modes = data["cells"], data["idle"], data["counts"], data["modes"]
    print()
    print(
        f"Executors axis: fleet {args.fleet}, routers {args.routers}, c={args.concurrency}, N={args.n} per cell after "
        f"{args.warmup} warm-up, {args.rounds} rounds (median, min-max); concurrency 1: {args.latency_n} requests "
        "per cell and round, pooled; added = minus direct2's"
    )
    print()
    print(
        "| executors | mode | fleet CPU ms/req (ns) | / at first | coordinator ms/req | req/s | p99 ms (c=32) | "
        "c=1 added p50 / p99 ms | p99 added / at first | fleet RSS per worker MiB | coordinator RSS MiB | "
        "coordinator idle ms/s | bad |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        floor = c1(cells(rows, mode=mode, n="direct2"))
        first = cells(rows, mode=mode, n=counts[0])
        first_added = pct(c1(first), 0.99, 1) - pct(floor, 0.99, 1)
        for n in counts:
            rs = cells(rows, mode=mode, n=n)
            lat = c1(rs)
            a50, a99 = pct(lat, 0.5, 1) - pct(floor, 0.5, 1), pct(lat, 0.99, 1) - pct(floor, 0.99, 1)
            rss = statistics.median(m["VmRSS"] for r in rs for m in r["fleet_mem_after"])
            crss = statistics.median(m["VmRSS"] for r in rs for m in r["coord_mem_after"])
            print(
                f"| {n} | {mode} | {spread(rs, 'proxy_ns_ms')} | "
                f"{med(rs, 'proxy_ns_ms') / med(first, 'proxy_ns_ms'):.2f}× | "
                f"{med(rs, 'coord_ns_ms'):.3f} | {med(rs, 'req_s'):.0f} | {med(rs, 'p99_ms'):.1f} | "
                f"{a50:.2f} / {a99:.2f} | {f'{a99 / first_added:.2f}×' if first_added > 0 else '–'} | "
                f"{mib(rss)} | {mib(crss)} | {idle.get(str(n), {}).get('coord', float('nan')):.1f} | "
                f"{sum(r['bad'] for r in rs)} |"
            )
        fl = cells(rows, mode=mode, n="direct2")
        print(
            f"| direct2 | {mode} | – | – | – | {med(fl, 'req_s'):.0f} | {med(fl, 'p99_ms'):.1f} | "
            f"c=1 p50 {pct(floor, 0.5, 1):.2f} / p99 {pct(floor, 0.99, 1):.2f} | – | – | – | – | "
            f"{sum(r['bad'] for r in fl)} |"
        )


# -- streams axis --------------------------------------------------------------------------------


def axis_streams(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    levels: list[int] = args.streams
    rows: list[dict[str, Any]] = []
    base_mem: dict[int, list[dict[str, int]]] = {}
    with session() as (stack, loadgen, prefixes):
        k = args.stream_executors
        ex = benchkit.start_executors("multiport", k // 2, k - k // 2)
        stack.callback(ex.stop)
        targets = {
            c: benchkit.start_shmdisagg(stack, tmp / f"c{c}", new_prefix(prefixes), ex.ctx, ex.gen, args.fleet)
            for c in levels
        }
        floor = direct2(ex)
        others: dict[str, dict[str, Any]] = {"direct2": floor}
        if args.vllm_router:  # one router for every level: it holds no state per level
            proc, url = benchkit.start_vllm_router(args.vllm_router, ex.ctx, ex.gen, True)
            stack.callback(benchkit.stop_proc, proc)
            others["vllm-router"] = {"url": f"{url}/v1/completions", "pids": {"proxy": [proc.pid]}}
        systems = ["shmdisagg", *others]
        ex.script({"chunks": 16, "chunk_interval_s": 0.0})
        for c, target in targets.items():  # the code paths loaded, the pools not yet grown
            warm = {**MODES["stream16"], "n": 64, "warmup": 64, "concurrency": 8, "latency_n": 0, "prompt_tokens": 0}
            loadgen.cell({**warm, "url": target["url"]}, {})
            base_mem[c] = memory(target["pids"]["proxy"])
        print(f"# streams axis: deployments for {levels} streams up, load average {benchkit.load_average()}")
        for rnd in range(args.rounds):
            for c in levels if rnd % 2 == 0 else reversed(levels):
                interval = c / (16 * args.stream_rate)
                ex.script({"chunks": 16, "chunk_interval_s": interval})
                duration = 16 * interval
                spec = {
                    **MODES["stream16"],
                    "chunk_interval_s": interval,
                    "n": max(args.waves * c, args.stream_min_n),
                    "warmup": c,
                    "concurrency": c,
                    "latency_n": 0,
                    "prompt_tokens": 0,
                    "stagger_s": duration,
                    "steady": args.stream_phases == "steady",
                    # every loop started and its stream open (steady: at once; barrier: staggered again)
                    "sample_after_s": (0.5 if args.stream_phases == "steady" else 1.5) * duration,
                    "timeout_s": 60 + 4 * duration,
                }
                for name in systems if rnd % 2 == 0 else reversed(systems):
                    target = targets[c] if name == "shmdisagg" else others[name]
                    rows.append(run(loadgen, target, spec, ex.pids, round=rnd, streams=c, system=name))
    return {"cells": rows, "levels": levels, "base_mem": base_mem}


def report_streams(data: dict[str, Any], args: argparse.Namespace) -> None:
    rows, levels, base_mem = data["cells"], data["levels"], data["base_mem"]
    print()
    print(
        f"Streams axis: fleet {args.fleet}, {args.stream_executors} executors, 16 chunks per stream paced to hold "
        f"{args.stream_rate:g} req/s, {args.waves} x streams measured requests (at least {args.stream_min_n}) after "
        f"as many warm-up as streams ({args.stream_phases}), "
        f"{args.rounds} rounds (median, min-max); added = minus direct2's at the same concurrency"
    )
    print()
    print(
        "| streams | chunk interval ms | req/s | fleet CPU ms/req (ns) | / at first | coordinator ms/req | "
        "first byte p50 / p99 ms | first byte added p50 / p99 ms | full p99 added ms | memory per open stream KiB "
        "(fleet anon RSS) | fleet RSS per worker MiB (all open) | bad |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    first = cells(rows, streams=levels[0], system="shmdisagg")
    for c in levels:
        rs = cells(rows, streams=c, system="shmdisagg")
        fl = cells(rows, streams=c, system="direct2")
        if not rs or not fl:
            continue
        base_anon = sum(m["RssAnon"] for m in base_mem[c])
        per_stream = statistics.median(sum(m["RssAnon"] for m in r["during"]) - base_anon for r in rs) / c
        rss = statistics.median(m["VmRSS"] for r in rs for m in r["during"])
        fb = f"{med(rs, 'ttfb_p50_ms'):.2f} / {med(rs, 'ttfb_p99_ms'):.2f}"
        added50 = med(rs, "ttfb_p50_ms") - med(fl, "ttfb_p50_ms")
        fb_added = f"{added50:.2f} / {med(rs, 'ttfb_p99_ms') - med(fl, 'ttfb_p99_ms'):.2f}"
        print(
            f"| {c} | {1000 * c / (16 * args.stream_rate):.0f} | {med(rs, 'req_s'):.0f} | "
            f"{spread(rs, 'proxy_ns_ms')} | "
            f"{med(rs, 'proxy_ns_ms') / med(first, 'proxy_ns_ms'):.2f}× | {med(rs, 'coord_ns_ms'):.3f} | {fb} | "
            f"{fb_added} | {med(rs, 'p99_ms') - med(fl, 'p99_ms'):.1f} | {per_stream:.1f} | {mib(rss)} | "
            f"{sum(r['bad'] for r in rs + fl)} |"
        )
    if cells(rows, system="vllm-router"):
        report_streams_peer(rows, levels)


def ttfb_added(rs: list[dict[str, Any]], floor: list[dict[str, Any]]) -> str:
    """First-byte latency over the floor's, p50 / p99 ms (medians of rounds)."""
    p50 = med(rs, "ttfb_p50_ms") - med(floor, "ttfb_p50_ms")
    return f"{p50:.2f} / {med(rs, 'ttfb_p99_ms') - med(floor, 'ttfb_p99_ms'):.2f}"


def grown(rs: list[dict[str, Any]], first: list[dict[str, Any]]) -> str:
    return f"{med(rs, 'proxy_ns_ms') / med(first, 'proxy_ns_ms'):.2f}×"


def report_streams_peer(rows: list[dict[str, Any]], levels: list[int]) -> None:
    """shmdisagg's fleet beside vLLM's Rust router at every level: CPU per request, each against its
    own figure at the first level, and first-byte latency over direct2's."""
    print()
    print(
        "| streams | shmdisagg fleet CPU ms/req | / at first | vllm-router CPU ms/req | / at first | "
        "shmdisagg / vllm-router | first byte added p50 / p99 ms, shmdisagg | the same, vllm-router | "
        "vllm-router RSS MiB (all open) | bad |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    firsts = {name: cells(rows, streams=levels[0], system=name) for name in ("shmdisagg", "vllm-router")}
    for c in levels:
        ours, peer, fl = (cells(rows, streams=c, system=n) for n in ("shmdisagg", "vllm-router", "direct2"))
        if not ours or not peer or not fl:
            continue

        rss = statistics.median(m["VmRSS"] for r in peer for m in r["during"])
        print(
            f"| {c} | {spread(ours, 'proxy_ns_ms')} | {grown(ours, firsts['shmdisagg'])} | "
            f"{spread(peer, 'proxy_ns_ms')} | "
            f"{grown(peer, firsts['vllm-router'])} | {med(ours, 'proxy_ns_ms') / med(peer, 'proxy_ns_ms'):.2f}× | "
            f"{ttfb_added(ours, fl)} | {ttfb_added(peer, fl)} | {mib(rss)} | {sum(r['bad'] for r in peer)} |"
        )


# -- prompt axis ---------------------------------------------------------------------------------


def axis_prompt(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from tests.hf_tokenizer import build_tokenizer

    sizes: list[int] = args.prompt_sizes
    tok = str(build_tokenizer(tmp / "tokenizer"))
    rows: list[dict[str, Any]] = []
    with session() as (stack, loadgen, prefixes):
        ex = benchkit.start_executors("multiport", 1, 1)
        stack.callback(ex.stop)
        ex.script({"chunks": 16, "chunk_interval_s": 0.0})
        routers: dict[str, tuple[Any, Any]] = {
            "round_robin": ("round_robin", "round_robin"),
            "kv_cache_aware": ({"type": "kv_cache_aware", "tokenizer_dir": tok}, "round_robin"),
        }
        targets = {
            name: benchkit.start_shmdisagg(
                stack, tmp / name, new_prefix(prefixes), ex.ctx, ex.gen, args.fleet, routers=r
            )
            for name, r in routers.items()
        }
        targets["direct2"] = direct2(ex)
        print(f"# prompt axis: deployments up, load average {benchkit.load_average()}")
        for rnd in range(args.rounds):
            for size in sizes if rnd % 2 == 0 else reversed(sizes):
                n = int(max(30, min(600, args.prompt_token_budget / size)))
                spec = {
                    **MODES["nonstream"],
                    "n": n,
                    "warmup": max(8, n // 5),
                    "concurrency": args.prompt_concurrency,
                    "latency_n": args.prompt_latency_n,
                    "prompt_tokens": size,
                    "timeout_s": 300,
                }
                names = list(targets) if rnd % 2 == 0 else list(reversed(targets))
                for name in names:
                    rows.append(run(loadgen, targets[name], spec, ex.pids, round=rnd, tokens=size, system=name))
    return {"cells": rows, "sizes": sizes, "in_process": in_process_costs(sizes)}


def in_process_costs(sizes: list[int]) -> dict[int, dict[str, float]]:
    """Per prompt size, microseconds in this process for what `kv_cache_aware` adds (the block
    hashes, on the native extension) and for parsing the request body's JSON (orjson)."""
    import orjson

    from shmdisagg.hashing import block_hashes_bytes

    out = {}
    for size in sizes:
        tokens = [1000 + (k * 7) % 30000 for k in range(size)]
        body = orjson.dumps({"model": benchkit.MODEL, "prompt": tokens, "max_tokens": 16})
        reps = max(5, 200_000 // size)
        h = min(timeit.repeat(lambda t=tokens: block_hashes_bytes(t, 32), number=reps, repeat=5)) / reps
        p = min(timeit.repeat(lambda b=body: orjson.loads(b), number=reps, repeat=5)) / reps
        out[size] = {"hash_us": h * 1e6, "parse_us": p * 1e6, "body_bytes": len(body)}
    return out


def report_prompt(data: dict[str, Any], args: argparse.Namespace) -> None:
    rows, sizes, costs = data["cells"], data["sizes"], data["in_process"]
    print()
    print(
        f"Prompt axis: fleet {args.fleet}, 1 + 1 executors, non-streaming, c={args.prompt_concurrency}, "
        f"{args.rounds} rounds (median, min-max); concurrency 1: {args.prompt_latency_n} requests per cell and "
        "round, pooled; added = minus direct2's"
    )
    print()
    print(
        "| prompt tokens | router | fleet CPU ms/req (ns) | µs per 1k tokens | kv_cache_aware − round_robin ms | "
        "coordinator ms/req | req/s | c=1 added p50 / p99 ms | fleet peak RSS per worker MiB | executors CPU ms/req | "
        "bad |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        floor = c1(cells(rows, tokens=size, system="direct2"))
        rr = cells(rows, tokens=size, system="round_robin")
        for name in ("round_robin", "kv_cache_aware"):
            rs = cells(rows, tokens=size, system=name)
            if not rs:
                continue
            lat = c1(rs)
            a = f"{pct(lat, 0.5, 1) - pct(floor, 0.5, 1):.2f} / {pct(lat, 0.99, 1) - pct(floor, 0.99, 1):.2f}"
            diff = f"{med(rs, 'proxy_ns_ms') - med(rr, 'proxy_ns_ms'):.3f}" if name != "round_robin" and rr else "–"
            hwm = statistics.median(m["VmHWM"] for r in rs for m in r["fleet_mem_after"])
            print(
                f"| {size} | {name} | {spread(rs, 'proxy_ns_ms')} | {1e6 * med(rs, 'proxy_ns_ms') / size:.1f} | "
                f"{diff} | "
                f"{med(rs, 'coord_ns_ms'):.3f} | {med(rs, 'req_s'):.0f} | {a} | {mib(hwm)} | "
                f"{med(rs, 'executors_ns_ms'):.3f} | {sum(r['bad'] for r in rs)} |"
            )
    print()
    print("In this process, per request (best of 5):")
    print()
    print(
        "| prompt tokens | request body bytes | block hashes (native, tokens_per_block 32) µs | "
        "orjson.loads of the body µs |"
    )
    print("|---|---|---|---|")
    for size in sizes:
        c = costs[size]
        print(f"| {size} | {c['body_bytes']} | {c['hash_us']:.1f} | {c['parse_us']:.1f} |")


if __name__ == "__main__":
    benchkit.run_main(main)
