#!/usr/bin/env python
"""Orchestrator CPU per request and added latency: shmdisagg at one or more fleet sizes against a
TensorRT-LLM-style stack, vLLM's Rust router and any other router, side by side in one run.

Every system runs at once against the same executors, one process per server:

- `--executors fakes` (default): the recording fakes (`tests/fakes/executor.py`), zero latency
  (each answers as soon as it has read the request), scripted per mode through `/_script`;
- `--executors sim`: the simulator (`shmdisagg/executors/sim`, `--speedup 1e6`: zero latency up
  to its own CPU), paced by its `slow` fault;
- `--ctx URL --gen URL` (repeatable): executors already running, real or simulated; nothing is
  scripted, so a mode is only what the request asks (`stream`, `max_tokens` 16) and a stream's
  pace and length are the executor's own (`stream16_paced5ms` is then the same as `stream16`).

Systems:

- **shmdisagg**, one deployment per `--fleet` size (`num_workers`), started through its own
  launcher and coordinator (`tests/integration/harness.py`); the fleet workers' pids come from
  `GET /cluster_info` (`fleet_pids`). Its proxy CPU is the sum of its workers'; the coordinator's
  has its own column (it receives the workers' per-request records).
- **baseline**: `benchmarks/baseline_trtllm_orchestrator.py`, one process rebuilding TensorRT-LLM's
  `OpenAIDisaggServer` request path (FastAPI + pydantic models + aiohttp client, context-first).
- **direct**: the load sent to the generation executor itself, one hop and no router.
- **direct2**: the load generator doing both legs itself (context leg, then the generation leg
  with the context answer's handoff), no router: the two-hop floor of a disaggregated request.
  Against the fakes, which check no handoff, both legs carry the request's bytes with their
  `disaggregated_params` spliced in and the context answer is not parsed (no client-side JSON
  work in the floor); against other executors the client parses and relays the handoff.
- **vllm-router**, **vllm-router-1hop** (`--vllm-router auto|PATH`): vLLM's Rust router
  (`pip install vllm-router`; `benchmarks/peers/install_vllm_router.sh`), round-robin, started by
  this run against the same executors: in its prefill/decode mode (two hops: the prefill leg with
  `max_tokens` 1, non-streaming, then the decode leg) and in its regular mode (one hop to the
  generation executors).
- **--vs [NAME=]URL** (two hops) and **--vs-one-hop [NAME=]URL**: any other router on this
  machine, started beforehand (or within `--vs-wait` seconds of the executors' line) against the
  executors this run prints; its CPU is that of the process listening on URL's port.

A cell is one system in one mode (`benchkit.py`): a warm-up, N measured requests at
`--concurrency` (CPU per request, req/s, latency), then `--latency-n` requests one at a time
(the latency each request adds when nothing queues, and CPU per request without batching). CPU
is utime+stime from `/proc/<pid>/stat` (10 ms ticks) around the measured part, divided by N; the
ns columns sum `/proc/<pid>/task/*/schedstat` over threads. Rounds cycle through every mode and
alternate which system goes first, so drift hits all alike; the tables show the median round
(min-max in brackets). Added latency at concurrency 1 is a system's p50 / p99 minus its floor's
(direct2 for two-hop systems, direct for one-hop ones), over the requests of every round.

Modes: `nonstream`; `stream16` (16 SSE chunks + [DONE], sent back to back); `stream16_paced5ms`
(the same, 5 ms apart, one write per chunk, as an engine paces tokens; the simulator: one
decode step at batch 1 takes 5 ms).

    .venv/bin/python benchmarks/bench_orchestrator_cpu.py [--n 2000] [--warmup 300] [--concurrency 32]
        [--rounds 3] [--modes nonstream,stream16,stream16_paced5ms] [--fleet 1,2,4]
        [--systems shmdisagg,baseline,direct,direct2] [--vllm-router auto] [--vs NAME=URL ...]
        [--executors fakes|sim | --ctx URL --gen URL] [--latency-n 100] [--prompt-tokens 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchkit
from benchkit import MODES, REPO, median_min_max, pct

SYSTEM_KINDS = ("shmdisagg", "baseline", "direct", "direct2")


def parse_vs(ap: argparse.ArgumentParser, option: str, specs: list[str], prefix: str = "vs") -> dict[str, str]:
    """`NAME=URL` (or a bare URL, named vs1, vs2, ...) -> {name: base url}; `ap.error` naming
    `option` for a URL that is not http://HOST:PORT."""
    out = {}
    for k, spec in enumerate(specs, 1):
        name, _, url = spec.rpartition("=") if "=" in spec.split("://")[0] else ("", "", spec)
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except ValueError as err:
            ap.error(f"{option} {spec}: {err}")
        if parts.scheme != "http" or not parts.hostname or port is None:
            ap.error(f"{option} {spec}: give the router as http://HOST:PORT")
        out[name or f"{prefix}{k}"] = url.rstrip("/")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="measured requests per cell (default 2000)")
    ap.add_argument("--warmup", type=int, default=300, help="unmeasured requests before each cell (default 300)")
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight, closed loop (default 32)")
    ap.add_argument(
        "--latency-n",
        type=int,
        default=100,
        help="requests one at a time after each cell's measured part: latency added and CPU at concurrency 1 "
        "(default 100; 0: none)",
    )
    ap.add_argument(
        "--idle-s",
        type=float,
        default=5.0,
        help="seconds without requests at the end, to measure each process's idle CPU (default 5; 0: none)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds over every mode and system (default 3)")
    ap.add_argument("--modes", default="nonstream,stream16,stream16_paced5ms", help=f"of {', '.join(MODES)}")
    ap.add_argument("--fleet", default="1", help="fleet sizes (num_workers) to run side by side, e.g. 1,2,4")
    ap.add_argument(
        "--systems",
        default="shmdisagg,baseline",
        help="of shmdisagg (one per --fleet size), baseline, direct (the generation executor alone: one hop, no "
        "router), direct2 (the client sends both legs itself: two hops, no router)",
    )
    ap.add_argument(
        "--vllm-router",
        metavar="auto|PATH",
        help="also run vLLM's router (vllm-router: auto = .venv-peers/bin/vllm-router) against the same executors, "
        "in its prefill/decode mode (two hops) and its regular mode (one hop)",
    )
    ap.add_argument(
        "--vs",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="another disaggregating router on this machine, already serving against the executors this run prints "
        "(repeatable); its CPU is the process listening on URL's port",
    )
    ap.add_argument(
        "--vs-one-hop",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="as --vs, for a router that sends each request to one executor (its latency floor is direct's)",
    )
    ap.add_argument(
        "--vs-wait",
        type=benchkit.non_negative_float,
        default=0.0,
        help="seconds to wait after printing the executors, for --vs",
    )
    ap.add_argument(
        "--executors",
        choices=("fakes", "sim"),
        default="fakes",
        help="executors this run starts: recording fakes (default) or zero-latency simulators",
    )
    ap.add_argument("--ctx", action="append", default=[], metavar="URL", help="a running context executor instead")
    ap.add_argument("--gen", action="append", default=[], metavar="URL", help="a running generation executor instead")
    ap.add_argument("--ctx-servers", type=int, default=1)
    ap.add_argument("--gen-servers", type=int, default=1)
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="send a list of this many token ids as the prompt instead of the text prompt",
    )
    ap.add_argument(
        "--baseline-log-level", default="warning", choices=("critical", "error", "warning", "info", "debug", "trace")
    )
    ap.add_argument("--json", default=None, help="write every cell's numbers here")
    ap.add_argument("--loadgen", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.loadgen:
        benchkit.loadgen_main()
        return 0

    modes = benchkit.mode_list(ap, args.modes)
    fleet_sizes = benchkit.positive_ints(ap, "--fleet", args.fleet)
    benchkit.at_least_one(ap, args, "n", "concurrency", "rounds", "ctx_servers", "gen_servers")
    for name in ("warmup", "latency_n", "prompt_tokens"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be at least 0, got {getattr(args, name)}")
    if not 0 <= args.idle_s < float("inf"):
        ap.error(f"--idle-s must be a number of seconds >= 0, got {args.idle_s:g}")
    kinds = [s for s in args.systems.split(",") if s]
    for kind in kinds:
        if kind not in SYSTEM_KINDS:
            ap.error(f"unknown system {kind}")
    if not kinds and not (args.vllm_router or args.vs or args.vs_one_hop):
        ap.error(f"--systems: name at least one of {', '.join(SYSTEM_KINDS)} (or add --vllm-router / --vs)")
    benchkit.json_output(ap, args.json)
    if bool(args.ctx) != bool(args.gen):
        ap.error("--ctx and --gen go together")
    vs = parse_vs(ap, "--vs", args.vs)
    vs1 = parse_vs(ap, "--vs-one-hop", args.vs_one_hop, "vs1hop")
    if args.executors == "sim" and not args.ctx and ("baseline" in kinds or args.vllm_router):
        # Both are refused by the simulator's request validation (TensorRT-LLM's protocol models,
        # extra fields forbidden), as by the pinned trtllm-serve worker: the baseline sends
        # disaggregated_params.conversation_id / context_control_endpoint (a later upstream's
        # fields), vllm-router SGLang's sampling fields (no_stop_trim, ...).
        print("# --executors sim: without baseline and vllm-router (the simulator refuses their requests' fields)")
        kinds = [k for k in kinds if k != "baseline"]
        args.vllm_router = None
    try:
        vllm_bin = benchkit.vllm_router_bin(args.vllm_router) if args.vllm_router else None
    except RuntimeError as err:
        ap.error(f"--vllm-router: {err}")
    benchkit.exit_on_sigterm()
    systems = [
        *(_shm_name(f, fleet_sizes) for f in fleet_sizes if "shmdisagg" in kinds),
        *(k for k in ("baseline",) if k in kinds),
        *(["vllm-router", "vllm-router-1hop"] if vllm_bin else []),
        *vs,
        *vs1,
        *(k for k in ("direct", "direct2") if k in kinds),
    ]
    executor_kind = "external" if args.ctx else args.executors
    procs: list[subprocess.Popen[Any]] = []
    executors: benchkit.Executors | None = None
    tmp = Path(tempfile.mkdtemp(prefix="bench-orch-"))
    shm_prefixes: list[str] = []
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    idle: dict[str, dict[str, float]] = {}
    started = time.strftime("%Y-%m-%d %H:%M")
    load_before = benchkit.load_average()
    try:
        executors = benchkit.start_executors(executor_kind, args.ctx_servers, args.gen_servers, args.ctx, args.gen)
        ctx_urls, gen_urls = executors.ctx, executors.gen
        print(
            f"# executors ({executor_kind}): context {' '.join(ctx_urls)}; generation {' '.join(gen_urls)}", flush=True
        )
        if (vs or vs1) and args.vs_wait > 0:
            time.sleep(args.vs_wait)  # for a --vs router started against the executors just printed

        targets: dict[str, dict[str, Any]] = {}
        with contextlib.ExitStack() as stack:
            for size in fleet_sizes if "shmdisagg" in kinds else []:
                prefix = f"shmdisagg-b{uuid.uuid4().hex[:10]}"
                shm_prefixes.append(prefix)
                targets[_shm_name(size, fleet_sizes)] = benchkit.start_shmdisagg(
                    stack, tmp / f"f{size}", prefix, ctx_urls, gen_urls, size
                )
            if "baseline" in kinds:
                base_port = benchkit.free_port()
                argv = [
                    benchkit.PY,
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
                procs.append(baseline)
                base_url = f"http://127.0.0.1:{base_port}"
                benchkit.wait_health(f"{base_url}/health", baseline, "baseline")
                targets["baseline"] = {
                    "url": f"{base_url}/v1/completions",
                    "pids": {"proxy": [baseline.pid]},
                    "hops": 2,
                }
            if vllm_bin:
                for name, pd in (("vllm-router", True), ("vllm-router-1hop", False)):
                    proc, url = benchkit.start_vllm_router(vllm_bin, ctx_urls, gen_urls, pd)
                    procs.append(proc)
                    pids = {"proxy": [benchkit.listener_pid(url)]}
                    targets[name] = {"url": f"{url}/v1/completions", "pids": pids, "hops": 2 if pd else 1}
            for named, hops in ((vs, 2), (vs1, 1)):
                for name, url in named.items():
                    benchkit.wait_health(f"{url}/health", None, name)
                    pids = {"proxy": [benchkit.listener_pid(url)]}
                    targets[name] = {"url": f"{url}/v1/completions", "pids": pids, "hops": hops}
            if "direct" in kinds:  # the generation executor answers a plain request itself: one hop
                targets["direct"] = {"url": f"http://{gen_urls[0]}/v1/completions", "pids": {}, "hops": 1}
            if "direct2" in kinds:  # the client sends both legs: two hops
                targets["direct2"] = {
                    "url": f"http://{gen_urls[0]}/v1/completions",
                    "ctx_url": f"http://{ctx_urls[0]}/v1/completions",
                    # the fakes check no handoff: the client relays bytes, no JSON work of its own
                    "relay": "bytes" if executor_kind == "fakes" else "parse",
                    "pids": {},
                    "hops": 2,
                }

            loadgen = benchkit.LoadGen()
            stack.callback(
                loadgen.close
            )  # first on the way out: a cell cut short ends its requests before the deployments stop
            print(
                "# "
                + "; ".join(f"{name}: {t['url']} pids {t['pids']}" for name, t in targets.items())
                + f"; loadgen pid {loadgen.pid}",
                flush=True,
            )

            for rnd in range(args.rounds):
                for mode in modes:
                    executors.script(MODES[mode])
                    order = systems if rnd % 2 == 0 else list(reversed(systems))
                    for system in order:
                        row = run_cell(loadgen, targets[system], system, mode, rnd, executors, args)
                        results.setdefault((system, mode), []).append(row)
            if args.idle_s > 0:
                groups = {name: {**t["pids"], "executors": executors.pids} for name, t in targets.items()}
                idle = benchkit.idle_cpu(groups, args.idle_s)
    finally:
        for proc in procs:
            benchkit.stop_proc(proc)
        if executors is not None:
            executors.stop()
        benchkit.cleanup_shm(shm_prefixes)
        shutil.rmtree(tmp, ignore_errors=True)  # the deployments' configs and logs

    print()
    print(
        f"# run {started}, load average {load_before} before and {benchkit.load_average()} after "
        f"({os.cpu_count()} CPUs); executors: {executor_kind}"
    )
    hops = {name: t["hops"] for name, t in targets.items()}
    report(results, modes, systems, hops, idle, args)
    if args.json:
        Path(args.json).write_text(json.dumps([r for rows in results.values() for r in rows], indent=1))
    bad = sum(r["bad"] for rows in results.values() for r in rows)
    return 1 if bad else 0


def _shm_name(size: int, sizes: list[int]) -> str:
    return "shmdisagg" if sizes == [1] else f"shmdisagg-f{size}"


def run_cell(
    loadgen: benchkit.LoadGen,
    target: dict[str, Any],
    system: str,
    mode: str,
    rnd: int,
    executors: benchkit.Executors,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One system in one mode: warm-up, the measured requests, then the latency requests."""
    pids = {**target["pids"], "backends": executors.pids}
    spec = {
        "url": target["url"],
        "ctx_url": target.get("ctx_url"),
        "relay": target.get("relay"),
        **MODES[mode],
        "n": args.n,
        "warmup": args.warmup,
        "concurrency": args.concurrency,
        "latency_n": args.latency_n,
        "prompt_tokens": args.prompt_tokens,
        "exact_chunks": executors.scriptable,
    }
    row = loadgen.cell(spec, pids)
    row.update(round=rnd, system=system, mode=mode)
    proxy = (
        f"proxy {row['proxy_ms']:.3f} ms/req (ns {row['proxy_ns_ms']:.3f}, kernel {row['proxy_sys_ms']:.3f})"
        if "proxy_ms" in row
        else "no proxy"
    )
    c1 = (
        f"  c=1 p50 {pct(row['c1_lat_ms'], 0.5, 1):.2f} ms"
        + (f" proxy {row['proxy_c1_ns_ms']:.3f}" if "proxy_c1_ns_ms" in row else "")
        if "c1_lat_ms" in row
        else ""
    )
    print(
        f"round {rnd} {mode:<18} {system:<16}  {proxy}"
        + (f"  coord {row['coord_ms']:.3f}" if "coord_ms" in row else "")
        + f"  {row['req_s']:.0f} req/s  p50 {row['p50_ms']:.1f}  p99 {row['p99_ms']:.1f} ms{c1}  "
        f"bad {row['bad']}" + (f"  e.g. {row['bad_samples'][0]}" if row["bad_samples"] else ""),
        flush=True,
    )
    return row


def _med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(
    results: dict[tuple[str, str], list[dict[str, Any]]],
    modes: list[str],
    systems: list[str],
    hops: dict[str, int],
    idle: dict[str, dict[str, float]],
    args: argparse.Namespace,
) -> None:
    print(
        f"N={args.n} per cell after {args.warmup} warm-up, c={args.concurrency}, {args.rounds} rounds (median, "
        "min-max); "
        f"prompt={f'{args.prompt_tokens} token ids' if args.prompt_tokens else 'text'}; {args.ctx_servers} ctx + "
        f"{args.gen_servers} gen executors"
    )
    print()
    print(
        "| system | mode | proxy CPU ms/req (/proc ticks) | of which kernel | proxy CPU ms/req (ns) | "
        "coordinator ms/req | req/s | p50 ms | p99 ms | p50 / p99 − direct's, ms | executors CPU ms/req | "
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
                cpu, lo, hi = median_min_max([r["proxy_ms"] for r in rows])
                ns, nlo, nhi = median_min_max([r["proxy_ns_ms"] for r in rows])
                proxy = (
                    f"{cpu:.3f} ({lo:.3f}–{hi:.3f}) | {_med(rows, 'proxy_sys_ms'):.3f} | {ns:.3f} ({nlo:.3f}–{nhi:.3f})"
                )
            else:
                proxy = "– | – | –"
            coord = f"{_med(rows, 'coord_ns_ms'):.3f}" if "coord_ms" in rows[0] else "–"
            p50, p99 = _med(rows, "p50_ms"), _med(rows, "p99_ms")
            added = (
                f"{p50 - _med(direct, 'p50_ms'):.1f} / {p99 - _med(direct, 'p99_ms'):.1f}"
                if direct and system != "direct"
                else "–"
            )
            print(
                f"| {system} | {mode} | {proxy} | {coord} | {_med(rows, 'req_s'):.0f} | {p50:.1f} | "
                f"{p99:.1f} | {added} | {_med(rows, 'backends_ns_ms'):.3f} | "
                f"{_med(rows, 'client_cpu_ms'):.3f} | {sum(r['bad'] for r in rows)} |"
            )
    if idle:
        print()
        print(f"Idle CPU over {args.idle_s:g} s with no request, ms per second (ns):")
        print()
        print("| system | proxy | coordinator | executors (all systems share them) |")
        print("|---|---|---|---|")
        for system in systems:
            d = idle.get(system, {})
            cells = [f"{d[g]:.2f}" if g in d else "–" for g in ("proxy", "coord", "executors")]
            print(f"| {system} | {' | '.join(cells)} |")
    if args.latency_n > 0:
        report_latency(results, modes, systems, hops, idle, args)
    ours = [s for s in systems if s.startswith("shmdisagg")]
    others = [s for s in systems if s not in ours and not s.startswith("direct")]
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
                bc, sc = _med(b, "proxy_ns_ms"), _med(s, "proxy_ns_ms")
                sct = statistics.median(r["proxy_ns_ms"] + r["coord_ns_ms"] for r in s)
                print(
                    f"| {mode} | {ours_name} | {bc / sc:.2f}× ({bc:.3f} / {sc:.3f}) | {bc / sct:.2f}× ({bc:.3f} / "
                    f"{sct:.3f}) | {_med(b, 'req_s') / _med(s, 'req_s'):.2f} |"
                )
    if len(ours) > 1:  # the fleet's scaling: CPU per request of each size against the first's
        print()
        print(
            f"| mode | fleet | proxy + coordinator CPU ms/req (ns) | / {ours[0]} | same at concurrency 1 | "
            f"/ {ours[0]} |"
        )
        print("|---|---|---|---|---|---|")
        for mode in modes:
            first = results.get((ours[0], mode))
            for name in ours:
                rows = results.get((name, mode))
                if not rows or not first:
                    continue
                total = statistics.median(r["proxy_ns_ms"] + r["coord_ns_ms"] for r in rows)
                base = statistics.median(r["proxy_ns_ms"] + r["coord_ns_ms"] for r in first)
                c1 = "– | –"
                if "proxy_c1_ns_ms" in rows[0]:
                    t1 = statistics.median(r["proxy_c1_ns_ms"] + r["coord_c1_ns_ms"] for r in rows)
                    b1 = statistics.median(r["proxy_c1_ns_ms"] + r["coord_c1_ns_ms"] for r in first)
                    c1 = f"{t1:.3f} | {t1 / b1:.2f}×"
                print(f"| {mode} | {name} | {total:.3f} | {total / base:.2f}× | {c1} |")


def report_latency(
    results: dict[tuple[str, str], list[dict[str, Any]]],
    modes: list[str],
    systems: list[str],
    hops: dict[str, int],
    idle: dict[str, dict[str, float]],
    args: argparse.Namespace,
) -> None:
    """Latency at concurrency 1, pooled over the rounds, and what each system adds to its floor."""
    print()
    print(
        f"Concurrency 1: {args.latency_n} requests per cell and round, one at a time, pooled over the rounds; "
        "added = the system's percentile minus its floor's (direct2 for two hops, direct for one)"
    )
    print()
    print(
        "| system | mode | hops | p50 ms | p99 ms | added p50 / p99, ms | first byte p50 / p99 ms | "
        "first byte added p50 / p99, ms | proxy + coordinator CPU ms/req at c=1 (ns) | same less idle CPU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        for system in systems:
            rows = results.get((system, mode))
            if not rows or "c1_lat_ms" not in rows[0]:
                continue
            lat = [x for r in rows for x in r["c1_lat_ms"]]
            fb = [x for r in rows for x in r["c1_ttfb_ms"]]
            floor_name = {1: "direct", 2: "direct2"}.get(hops.get(system, 2))
            floor = results.get((floor_name, mode)) if floor_name and floor_name != system else None
            added = fb_added = "–"
            if floor:
                flat = [x for r in floor for x in r["c1_lat_ms"]]
                ffb = [x for r in floor for x in r["c1_ttfb_ms"]]
                added = f"{pct(lat, 0.5, 1) - pct(flat, 0.5, 1):.2f} / {pct(lat, 0.99, 1) - pct(flat, 0.99, 1):.2f}"
                fb_added = f"{pct(fb, 0.5, 1) - pct(ffb, 0.5, 1):.2f} / {pct(fb, 0.99, 1) - pct(ffb, 0.99, 1):.2f}"
            cpu = less_idle = "–"
            if "proxy_c1_ns_ms" in rows[0]:
                c1 = statistics.median(r["proxy_c1_ns_ms"] + r.get("coord_c1_ns_ms", 0.0) for r in rows)
                cpu = f"{c1:.3f}"
                if system in idle:  # idle ms/s x seconds per request
                    rate = idle[system].get("proxy", 0.0) + idle[system].get("coord", 0.0)
                    less_idle = f"{c1 - rate * statistics.median(r['c1_s_per_req'] for r in rows):.3f}"
            print(
                f"| {system} | {mode} | {hops.get(system, 2)} | {pct(lat, 0.5, 1):.2f} | {pct(lat, 0.99, 1):.2f} | "
                f"{added} | {pct(fb, 0.5, 1):.2f} / {pct(fb, 0.99, 1):.2f} | {fb_added} | {cpu} | {less_idle} |"
            )


if __name__ == "__main__":
    benchkit.run_main(main)
