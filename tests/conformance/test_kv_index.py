"""The KV block index says exactly what TensorRT-LLM's workers say they hold.

A `kv_cache_aware` context router over 2 context workers with a small KV pool (10 blocks of 8
tokens, so later prompts evict earlier blocks), generation on round robin. The coordinator drains
the context workers' `/kv_cache_events`, so their events cannot be read a second time; each
context worker has a twin instead (same engine, same options, outside the deployment) that gets
the same requests in the same order, directly, and whose events the test drains itself. The
twin's state is the worker's: the test checks it on every request through `cached_tokens`
(the disaggregated answer carries the context worker's own count, TensorRT-LLM's `ctx_usage`
rule, which must equal the twin's). Then, per server, the blocks the index confirms by events
(`shm.index.server_blocks` and `shm.index.event_masks`, both read-only; at the end also
`shmdisagg stats --once --json`) must be exactly the blocks the twin's `stored` minus `removed`
events leave, and the block hashes the router computes for each prompt must be the ones the
worker stored.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from shmdisagg.orchestrator.tokenization import HFTokenizer
from shmdisagg.routing import RoutingKey
from shmdisagg.shm import ControlTable
from shmdisagg.shm.index import event_masks, server_blocks
from tests.conformance.cases import COMPLETIONS, Req
from tests.conformance.conftest import FAST, Deployed, deployed, worker_set
from tests.conformance.worker_copy import WorkerCopy
from tests.conformance.workers import ForkServer, Worker
from tests.integration.harness import wait_until

TOKENS_PER_BLOCK = 8
NUM_BLOCKS = 10
SMALL_POOL = ("--tokens-per-block", str(TOKENS_PER_BLOCK), "--num-blocks", str(NUM_BLOCKS), *FAST)

pytestmark = pytest.mark.xdist_group("conformance-kv-index")


@dataclass
class KvSetup:
    d: Deployed
    twins: dict[str, Worker]  # context worker address -> its twin
    copy: WorkerCopy


@pytest.fixture(scope="module")
def kv(forks: ForkServer, worker_copy: WorkerCopy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvSetup]:
    with worker_set(forks, worker_copy, tmp_path_factory.mktemp("kv-workers")) as workers:
        ctx0, ctx1, twin0, twin1, gen0, gen1 = workers.start(["context"] * 4 + ["generation"] * 2, *SMALL_POOL)
        for twin in (twin0, twin1):
            twin.drain_events()  # the "created" event: from here on, what requests do
        router = {"type": "kv_cache_aware", "tokenizer_dir": str(worker_copy.tokenizer)}
        top: dict[str, Any] = {"routers": (router, "round_robin"), "num_workers": 2}
        with deployed("kv-index", tmp_path_factory.mktemp("kv-dep"), [ctx0, ctx1], [gen0, gen1], **top) as d:
            yield KvSetup(d, {ctx0.addr: twin0, ctx1.addr: twin1}, worker_copy)


def _apply(events: list[dict[str, Any]], held: set[int]) -> tuple[list[int], list[int]]:
    """Apply a worker's events, in order, to the set of blocks it holds; return the hashes it
    stored and removed."""
    stored, removed = [], []
    for e in events:
        data = e["data"]
        if data["type"] == "stored":
            new = [b["block_hash"] for b in data["blocks"]]
            stored.extend(new)
            held.update(new)
        elif data["type"] == "removed":
            removed.extend(data["block_hashes"])
            held.difference_update(data["block_hashes"])
        elif data["type"] == "all_cleared":
            held.clear()
    return stored, removed


def _prompts(req: Req) -> list[str]:
    """Prompts sharing prefixes (so the router has something to match) and each ending in words
    no earlier prompt has (so its last block is new and names the server that took it)."""
    a = req.text("Alpha foxes run through the tall grass of the northern fields every morning.")
    b = f"{req.nonce}-b Beta dogs sleep under the old oak tree near the river bank all day long."
    return [
        a,
        b,
        a + " Then they rest by the stream and drink the cold clear water.",
        b + " At night they wake and bark at the moon over the hills.",
        a + " Then they rest by the stream and drink the cold clear water. Later they hunt mice.",
        f"{req.nonce}-c Gamma birds sing songs in spring and summer from dawn until dusk.",
        b + " At night they wake and bark at the moon over the hills. The owls answer them.",
        a + " Finally the pack returns to its den before the winter storm arrives.",
    ]


def test_index_holds_what_each_worker_stored(kv: KvSetup) -> None:
    req = Req(kv.copy.model, next(iter(kv.twins.values())))
    from transformers import AutoTokenizer

    # the router's own tokenizer (as tokenizer_source loads it) and hashes
    tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(str(kv.copy.tokenizer), local_files_only=True))
    table = ControlTable.attach(kv.d.dep.config.shm_prefix, read_only=True)
    try:
        slots = {s.addr: s.slot for s in table.servers()}
        held: dict[str, set[int]] = {addr: set() for addr in kv.twins}
        evicted = 0
        for prompt in _prompts(req):
            body = {"model": kv.copy.model, "prompt": prompt, "max_tokens": 2}
            via = kv.d.post(COMPLETIONS, body)
            assert via.status == 200, via.raw
            encoded = tokenizer.encode_prompt(prompt, body)
            assert encoded is not None
            ids = encoded.ids
            raw = RoutingKey(len(ids), ids).block_hashes(TOKENS_PER_BLOCK)
            hashes = list(struct.unpack(f"<{len(raw) // 8}Q", raw))
            # The server that took it: the only one whose events hold the prompt's new last block.
            owner: list[str] = []

            def reported() -> bool:
                masks = event_masks(table, hashes[-1:]) or {}  # noqa: B023 (wait_until polls it before the loop moves on)
                owner[:] = [a for a in kv.twins if masks.get(hashes[-1], 0) >> slots[a] & 1]  # noqa: B023 (wait_until polls it before the loop moves on)
                return len(owner) == 1  # noqa: B023 (wait_until polls it before the loop moves on)

            wait_until(reported, what=f"one context server's events to hold the last block of {prompt!r}")
            twin = kv.twins[owner[0]]
            direct = twin.post(COMPLETIONS, body).json
            # The answer's usage is the context worker's (ctx_usage): its cached tokens are the twin's.
            assert (via.json["usage"], via.json["choices"][0]["text"]) == (
                direct["usage"],
                direct["choices"][0]["text"],
            )
            stored, removed = _apply(twin.drain_events(), held[owner[0]])
            evicted += len(removed)
            assert set(stored) <= set(hashes), "the worker stored blocks the router did not hash"
            assert set(hashes) <= held[owner[0]], "the router's hashes are not the worker's block keys"

            def index_matches() -> bool:
                counts = server_blocks(table) or {}
                for addr, blocks in held.items():
                    if counts.get(slots[addr], 0) != len(blocks):
                        return False
                    masks = event_masks(table, sorted(blocks)) or {}
                    if any(not masks.get(h, 0) >> slots[addr] & 1 for h in blocks):
                        return False
                return True

            wait_until(index_matches, what="the index to hold exactly the blocks each worker's events left")
        assert evicted, "no block was evicted: the removed events were not exercised"
        # What an operator sees: `shmdisagg stats --once --json` counts the same blocks per server.
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "shmdisagg.cli",
                "stats",
                "--prefix",
                kv.d.dep.config.shm_prefix,
                "--once",
                "--json",
                "--interval",
                "0.1",
            ],
            capture_output=True,
            check=True,
            timeout=60,
        )
        shown = {s["addr"]: s["kv_blocks"] for s in orjson.loads(out.stdout)["servers"] if s["addr"] in held}
        assert shown == {addr: len(blocks) for addr, blocks in held.items()}, shown
    finally:
        table.close()
