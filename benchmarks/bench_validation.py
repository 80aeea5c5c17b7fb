#!/usr/bin/env python
"""What request validation (`orchestrator/validation.py`'s `validate`) costs a request, this tree
against another tree's, side by side, alternating, in one process: a streaming completion with
`stream_options` and a chat, each built fresh per call (the dict build is in both figures). Then
what the scan for integers past 64 bits (`_native.json_long_digits`, run on every body) costs
beside orjson's decode of the same body: a 128k-id token prompt and a 1k-word text.

    git archive <commit> shmdisagg/orchestrator/validation.py | tar -x -C /tmp/base
    .venv/bin/python benchmarks/bench_validation.py --base /tmp/base [--rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import random
import statistics
import sys
import timeit
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import orjson

from benchmarks.benchkit import checkout, count
from shmdisagg._native import json_long_digits
from shmdisagg.orchestrator import validation

N = 20_000


def completion() -> dict[str, Any]:
    return {
        "model": "m",
        "prompt": "hello there",
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def chat() -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "stream": False}


def _load(tree: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("base_validation", tree / "shmdisagg/orchestrator/validation.py")
    if spec is None or spec.loader is None:
        raise SystemExit(f"no shmdisagg/orchestrator/validation.py under {tree}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=checkout, required=True, help="a tree holding the other validation.py")
    parser.add_argument("--rounds", type=count, default=5)
    args = parser.parse_args()
    sides = {"base": _load(args.base), "this tree": validation}
    for name, make, is_chat in (("completion", completion, False), ("chat", chat, True)):
        us: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side, module in sides.items():
                call = lambda m=module, f=make, c=is_chat: m.validate(f(), c)  # noqa: E731
                best = min(timeit.repeat(call, number=N, repeat=5))
                us[side].append(best / N * 1e6)
        base, this = (statistics.median(us[s]) for s in sides)
        print(f"{name}: base {base:.2f} us, this tree {this:.2f} us: {this - base:+.2f} us ({this / base:.2f}x)")
    rng = random.Random(0)
    bodies = {
        "128k token ids": orjson.dumps({"model": "m", "prompt": [rng.randrange(128_000) for _ in range(131_072)]}),
        "1k-word text": orjson.dumps({"model": "m", "prompt": "hello world 12345 " * 333}),
    }
    for name, body in bodies.items():
        scan = min(timeit.repeat(functools.partial(json_long_digits, body), number=20, repeat=5)) / 20 * 1e6
        decode = min(timeit.repeat(functools.partial(orjson.loads, body), number=20, repeat=5)) / 20 * 1e6
        print(f"{name} ({len(body):,} bytes): json_long_digits {scan:.1f} us, orjson.loads {decode:.1f} us")


if __name__ == "__main__":
    main()
