#!/usr/bin/env python3
"""Routing decision cost with a real Hugging Face tokenizer: tokenize + hash + pick.

Usage: .venv/bin/python benchmarks/bench_tokenize.py [--reps 100] [--sizes 1024,8192,32768] [--vocab 32000]

The tokenizer is built offline first (`tests/hf_tokenizer.py`'s builder: byte-level BPE with
Llama-3's special tokens and chat template) with a `--vocab`-entry vocabulary trained on
pseudo-text over a few thousand made-up words (Zipf-distributed, with punctuation and numbers),
so prompts of that text tokenize at a realistic ~4 characters per token into ids across the
whole vocabulary. Prompts of each size (in tokens of this tokenizer) are then routed on one
`BlockIndex.pick_kv` (the same deployment as `benchmarks/bench_routing.py`: 8 context servers, 16
claimed worker rows, routed-block tracking on, an index holding 400k cached blocks), three ways
taking turns on every round:
- **token ids**: the same prompt already as ids (`RoutingKey.block_hashes` + pick), for scale;
- **text**: a `/v1/completions` text prompt (`HFTokenizer.encode_prompt`, then hash + pick);
- **chat**: a `/v1/chat/completions` system prompt + user turn of that size, content given as
  two text parts (`HFTokenizer.encode_chat`: the conversation, the chat template, encode).
Each also runs through `KeyBuilder.build` on an event loop (the fleet's own call, which moves
texts of `INLINE_CHARS` or more to a worker thread). Every round is a next turn of one of 8
conversations, each path with its own new tail, so all three find the conversation's earlier
blocks in the process's prefix hash cache alike. Costs are CPU time of this process
(time.process_time_ns(), the worker thread included), not wall time: the cost of a decision is
the CPU it takes from a fleet worker, and CPU time stays meaningful on a shared, loaded host
where wall time mostly measures waiting for a core. p50/p99/min in µs over `--reps` rounds after
5 unrecorded ones.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_routing import Deployment, pct  # noqa: E402

from benchmarks.benchkit import count, positive_ints  # noqa: E402
from shmdisagg.orchestrator.service import KeyBuilder  # noqa: E402
from shmdisagg.orchestrator.tokenization import HFTokenizer  # noqa: E402
from shmdisagg.routing.policy import RoutingKey  # noqa: E402
from shmdisagg.shm import ROLE_CONTEXT  # noqa: E402
from tests import hf_tokenizer  # noqa: E402

WARMUP = 5
SYLLABLES = "ka lo mi ra ten ver sol an de qui por tes mun bra ex ul fin gor ha zel tri pe nu oc vam dis er li".split()


def words(n: int, rng: random.Random) -> list[str]:
    """n made-up words of 1-4 syllables."""
    out: set[str] = set()
    while len(out) < n:
        out.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))))
    return sorted(out)


def text(vocab: list[str], n_words: int, rng: random.Random) -> str:
    """Zipf-ish pseudo-text: sentences of vocabulary words, punctuation and numbers."""
    weights = [1 / (i + 1) for i in range(len(vocab))]
    out = []
    for w in rng.choices(vocab, weights, k=n_words):
        out.append(w)
        r = rng.random()
        if r < 0.08:
            out[-1] += rng.choice([",", ".", ";", ":", "?", "!"])
        elif r < 0.1:
            out.append(str(rng.randrange(10_000)))
    return " ".join(out)


def build(vocab_size: int, rng: random.Random, out_dir: str) -> Any:
    vocab = words(20_000, rng)
    training = [text(vocab, 50, rng) for _ in range(10_000)] + hf_tokenizer.corpus(2000)
    path = hf_tokenizer.build_tokenizer(out_dir, vocab_size=vocab_size, training_text=training)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True), vocab


def sized_text(tok: Any, vocab: list[str], tokens: int, rng: random.Random) -> str:
    """Pseudo-text of about `tokens` tokens."""
    s = text(vocab, tokens // 2, rng)
    n = len(tok.encode(s, add_special_tokens=False))
    while n < tokens:
        s += " " + text(vocab, max(8, (tokens - n) // 2), rng)
        n = len(tok.encode(s, add_special_tokens=False))
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=count, default=100)
    ap.add_argument("--sizes", default="1024,8192,32768")
    ap.add_argument("--vocab", type=count, default=32000)
    ap.add_argument("--tpb", type=count, default=32)
    ap.add_argument("--capacity", type=count, default=1 << 22)
    args = ap.parse_args()
    sizes = positive_ints(ap, "--sizes", args.sizes)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    rng = random.Random(20261201)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        tok, vocab = build(args.vocab, rng, tmp)
        built = time.perf_counter() - t0
        hf = HFTokenizer(tok)
        sample = text(vocab, 2000, rng)
        chars_per_token = len(sample) / len(tok.encode(sample, add_special_tokens=False))
        import transformers

        print(
            f"host: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, transformers "
            f"{transformers.__version__}, load average "
            f"{os.getloadavg()[0]:.2f}; BPE of {len(tok)} entries built offline in {built:.1f} s, "
            f"{chars_per_token:.2f} characters per token; {args.reps} rounds per size\n"
        )
        dep = Deployment(args, [])
        keys = KeyBuilder(hf, conversations=False)
        loop = asyncio.new_event_loop()
        try:
            for size in sizes:
                run_size(args, tok, hf, keys, loop, dep, vocab, size, rng)
        finally:
            loop.close()
            dep.close()


def run_size(
    args: argparse.Namespace,
    tok: Any,
    hf: HFTokenizer,
    keys: KeyBuilder,
    loop: asyncio.AbstractEventLoop,
    dep: Deployment,
    vocab: list[str],
    size: int,
    rng: random.Random,
) -> None:
    clock = time.process_time_ns
    rows: dict[str, list[int]] = {
        k: []
        for k in (
            "token ids: hash + pick",
            "text: tokenize",
            "text: hash + pick",
            "text: tokenize + hash + pick",
            "text: KeyBuilder.build + pick",
            "chat: render + tokenize",
            "chat: hash + pick",
            "chat: render + tokenize + hash + pick",
            "chat: KeyBuilder.build + pick",
        )
    }
    bases = [sized_text(tok, vocab, size, rng) for _ in range(8)]
    chat_tokens = 0
    scope: dict[str, Any] = {"headers": []}

    def hash_pick(key: RoutingKey) -> int:
        t = clock()
        slot, _ = dep.wix.pick_kv(dep.row, ROLE_CONTEXT, -1, key.block_hashes(args.tpb), key.num_tokens)
        dt = clock() - t
        dep.worker.release(dep.row, slot, key.num_tokens)
        return dt

    def chat_of(prompt: str) -> dict[str, Any]:
        half = len(prompt) // 2
        return {
            "model": "m",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": prompt[:half]}, {"type": "text", "text": prompt[half:]}],
                },
            ],
        }

    for n in range(args.reps + WARMUP):
        base = bases[n % len(bases)]  # each path its own new tail: a next turn of one of 8 conversations
        ids_prompt = hf.encode_prompt(f"{base} ids {n}", {}).ids  # the token-id request, tokenized untimed
        id_cost = hash_pick(RoutingKey(len(ids_prompt), ids_prompt))
        t0 = clock()
        ids = hf.encode_prompt(f"{base} text {n}", {}).ids
        t1 = clock()
        text_cost = hash_pick(RoutingKey(len(ids), ids))
        t2 = clock()
        chat_ids = hf.encode_chat(chat_of(f"{base} chat {n}")).ids
        t3 = clock()
        chat_cost = hash_pick(RoutingKey(len(chat_ids), chat_ids))
        chat_tokens = len(chat_ids)
        text_req = {"model": "m", "prompt": f"{base} build {n}"}
        chat_req = chat_of(f"{base} build chat {n}")
        t4 = clock()
        hash_pick(loop.run_until_complete(keys.build(text_req, False, scope)))
        t5 = clock()
        hash_pick(loop.run_until_complete(keys.build(chat_req, True, scope)))
        t6 = clock()
        if n >= WARMUP:
            for name, value in (
                ("token ids: hash + pick", id_cost),
                ("text: tokenize", t1 - t0),
                ("text: hash + pick", text_cost),
                ("text: tokenize + hash + pick", t1 - t0 + text_cost),
                ("text: KeyBuilder.build + pick", t5 - t4),
                ("chat: render + tokenize", t3 - t2),
                ("chat: hash + pick", chat_cost),
                ("chat: render + tokenize + hash + pick", t3 - t2 + chat_cost),
                ("chat: KeyBuilder.build + pick", t6 - t5),
            ):
                rows[name].append(value)
    print(f"{size} tokens (text {len(bases[0])} characters; the chat renders to {chat_tokens} tokens), CPU time:")
    print(f"    {'':40} {'p50':>10} {'p99':>10} {'min':>10}")
    for name, values in rows.items():
        print(f"    {name:40} {pct(values, 0.5):>8.1f}us {pct(values, 0.99):>8.1f}us {min(values) / 1000:>8.1f}us")
    base_p50 = pct(rows["token ids: hash + pick"], 0.5)
    print(
        f"    p50 ratios to token ids: text {pct(rows['text: tokenize + hash + pick'], 0.5) / base_p50:.1f}x, "
        f"chat {pct(rows['chat: render + tokenize + hash + pick'], 0.5) / base_p50:.1f}x\n"
    )


if __name__ == "__main__":
    main()
