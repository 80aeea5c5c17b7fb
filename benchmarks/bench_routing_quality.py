#!/usr/bin/env python3
"""Routing quality side by side: KV cache hit rate, TTFT and per-server balance for each router at
several fleet sizes, replaying a Mooncake trace against simulated executors.

For every (router, fleet size) it launches the same deployment (4 context + 2 generation
simulated executors by default; the router under test on both roles), replays the first N
requests of the trace with `shmdisagg bench`, then reads from the shared table how many requests
each context server received. The infinite-cache ideal hit rate of the same slice is computed
from the trace itself (a request can reuse its leading `hash_ids` seen before, 512 tokens each).

    .venv/bin/python benchmarks/bench_routing_quality.py --trace $TRACES/conversation_trace.jsonl \\
        --num-requests 1000 --speedup 10 --routers round_robin load_balancing kv_cache_aware conversation \\
        --fleet 1 2 4 --json runs/routing_quality.json

Several `--sim-speedup` values sweep the offered load at a fixed arrival rate (a lower speed-up
means slower executors, so a more loaded deployment), and the TTFT ratio against round-robin is
printed for each load level. A router spec takes `+flag` and `+key=value` router arguments, for
example `kv_cache_aware+use_tokens+load_weight=1`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.benchkit import count, existing_file, positive_float  # noqa: E402
from shmdisagg.config import load_config  # noqa: E402
from shmdisagg.launch import Deployment  # noqa: E402
from shmdisagg.shm.table import ROLE_CONTEXT, ControlTable  # noqa: E402

ROUTERS = ("round_robin", "load_balancing", "kv_cache_aware", "conversation")
from tests.conftest import free_port  # noqa: E402


def ideal_hit_rate(trace: Path, n: int) -> float:
    """Share of prompt tokens an infinite cache shared by every server could serve."""
    seen: set[int] = set()
    hit = total = 0
    with trace.open() as f:
        for i, line in enumerate(f):
            if i >= n:
                break
            r = json.loads(line)
            ids = r["hash_ids"]
            k = 0
            while k < len(ids) and ids[k] in seen:
                k += 1
            hit += min(k * 512, r["input_length"] - 1)
            total += r["input_length"]
            seen.update(ids)
    return hit / total


def router_spec(router: str) -> dict:
    """'kv_cache_aware+use_tokens+load_weight=1' -> {"type": "kv_cache_aware", "use_tokens": True,
    "load_weight": 1.0}: a bare flag is True, `key=value` is parsed as YAML."""
    name, *flags = router.split("+")
    spec: dict = {"type": name}
    for f in flags:
        key, eq, value = f.partition("=")
        spec[key] = yaml.safe_load(value) if eq else True
    return spec


def config_for(router: str, fleet: int, sim_speedup: float, args: argparse.Namespace, tmp: Path) -> Path:
    port = free_port()
    ctx = [f"127.0.0.1:{free_port()}" for _ in range(args.ctx)]
    gen = [f"127.0.0.1:{free_port()}" for _ in range(args.gen)]
    cfg = {
        "hostname": "127.0.0.1",
        "port": port,
        "num_workers": fleet,
        "context_servers": {
            "urls": ctx,
            "router": router_spec(router),
            "max_batch_size": 16,
            "max_num_tokens": 16384,
            "enable_chunked_prefill": True,
        },
        "generation_servers": {"urls": gen, "router": router_spec(router), "max_batch_size": 64},
        "shmdisagg": {
            "shm": {"prefix": f"shmdisagg-rq{uuid.uuid4().hex[:8]}"},
            "coordinator_socket": str(tmp / f"{router}-{fleet}.sock"),
            "request_timeout_s": 600,
            "executors": {"backend": "sim", "sim": {"speedup": sim_speedup, "num_blocks": args.num_blocks}},
        },
    }
    path = tmp / f"{router}-{fleet}-{sim_speedup}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_one(router: str, fleet: int, sim_speedup: float, args: argparse.Namespace, tmp: Path) -> dict:
    path = config_for(router, fleet, sim_speedup, args, tmp)
    config = load_config(path)
    out = tmp / f"{router}-{fleet}-{sim_speedup}.json"
    with Deployment(config, str(path), str(tmp / f"logs-{router}-{fleet}-{sim_speedup}")) as dep:
        cmd = [
            sys.executable,
            "-m",
            "shmdisagg.bench",
            "--url",
            dep.url,
            "--trace",
            str(args.trace),
            "--num-requests",
            str(args.num_requests),
            "--speedup",
            str(args.speedup),
            "--json",
            str(out),
            "--no-progress",
        ]
        if args.max_output_tokens:
            cmd += ["--max-output-tokens", str(args.max_output_tokens)]
        out.unlink(missing_ok=True)  # exit 1 is also a failed run: never read an old one
        rc = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
        if rc not in (0, 1) or not out.exists():  # 1: some requests failed; they are counted in the JSON
            raise subprocess.CalledProcessError(rc, cmd)
        with ControlTable.attach(config.shm_prefix) as table:
            routed = [table.routed(s.slot) for s in table.servers() if s.role == ROLE_CONTEXT]
    summary = json.loads(out.read_text())
    return {
        "router": router,
        "fleet": fleet,
        "sim_speedup": sim_speedup,
        "hit_rate": summary["kv_cache_hit_rate"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "e2e_p50_ms": summary["e2e_ms"]["p50"],
        "errors": summary["errors"]["count"],
        "ctx_routed": routed,
        "load_max_min": max(routed) / max(min(routed), 1),
        "cpu_ms_per_request": summary.get("orchestrator_cpu_ms_per_request"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=existing_file, default=REPO / "data" / "mooncake_conversation_300.jsonl")
    p.add_argument("--num-requests", type=count, default=300)
    p.add_argument("--speedup", type=positive_float, default=10.0, help="trace arrival speed-up")
    p.add_argument(
        "--sim-speedup",
        type=positive_float,
        nargs="+",
        default=[20.0],
        help="executor timing speed-up; several values sweep the offered load (lower = more loaded)",
    )
    p.add_argument("--num-blocks", type=count, default=524288, help="KV blocks per simulated executor")
    p.add_argument("--max-output-tokens", type=count, default=32)
    p.add_argument("--ctx", type=count, default=4)
    p.add_argument("--gen", type=count, default=2)
    p.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    p.add_argument("--fleet", nargs="+", type=count, default=[1, 2, 4])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    ideal = ideal_hit_rate(args.trace, args.num_requests)
    rows = []
    with tempfile.TemporaryDirectory(prefix="shmdisagg-rq-") as d:
        for sim_speedup in args.sim_speedup:
            for router in args.routers:
                for fleet in args.fleet:
                    t0 = time.monotonic()
                    row = run_one(router, fleet, sim_speedup, args, Path(d))
                    row["seconds"] = round(time.monotonic() - t0, 1)
                    rows.append(row)
                    print(
                        f"{router:15s} fleet {fleet} sim x{sim_speedup:g}: hit {row['hit_rate']:.4f} "
                        f"({row['hit_rate'] / ideal:.2f}x ideal) "
                        f"TTFT p50/p99 {row['ttft_p50_ms']:.0f}/{row['ttft_p99_ms']:.0f} ms  ctx load max/min "
                        f"{row['load_max_min']:.2f} "
                        f"{row['ctx_routed']}  errors {row['errors']}",
                        flush=True,
                    )
    print(f"\ntrace {args.trace.name}, first {args.num_requests} requests, ideal (infinite cache) hit rate {ideal:.4f}")
    print(
        "| router | fleet | sim speed-up | KV hit rate | x ideal | TTFT p50 ms | TTFT p99 ms | ctx load max/min "
        "| errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['router']} | {r['fleet']} | {r['sim_speedup']:g} | {r['hit_rate']:.4f} | "
            f"{r['hit_rate'] / ideal:.2f} | {r['ttft_p50_ms']:.0f} "
            f"| {r['ttft_p99_ms']:.0f} | {r['load_max_min']:.2f} | {r['errors']} |"
        )
    rr = {(r["fleet"], r["sim_speedup"]): r for r in rows if r["router"] == "round_robin"}
    for r in rows:
        base = rr.get((r["fleet"], r["sim_speedup"]))
        if r["router"] != "round_robin" and base is not None:
            print(
                f"TTFT ratio round_robin / {r['router']} at fleet {r['fleet']}, sim x{r['sim_speedup']:g}: "
                f"p50 {base['ttft_p50_ms'] / max(r['ttft_p50_ms'], 1e-9):.2f}, p99 "
                f"{base['ttft_p99_ms'] / max(r['ttft_p99_ms'], 1e-9):.2f}"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"ideal_hit_rate": ideal, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
