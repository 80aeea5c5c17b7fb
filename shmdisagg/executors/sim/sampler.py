"""Deterministic output tokens: a pure function of (prompt token ids, position, seed).

`output_token(prompt, k)` is the k-th generated token (k = 0 is the first token, the one a
context-only request returns in `first_gen_tokens`). A prompt is reduced once to a 64-bit
`prompt_seed` (BLAKE2b of its int64 ids, mixed with the executor's `--seed`); each position is
then one splitmix64 step, mapped into `tokenizer.GEN_VOCAB`. The sampler never draws an EOS or
other special id, so a request ends on `max_tokens` unless the client lists one of these words'
ids in `stop_token_ids`. A context and a generation executor with the same `--seed` therefore
produce exactly the tokens one aggregated executor would.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from shmdisagg.executors.sim.tokenizer import GEN_VOCAB

_U64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def prompt_seed(prompt: Sequence[int], seed: int = 0) -> int:
    """64-bit digest of the prompt ids; raises TypeError/OverflowError on non-int64 ids."""
    digest = hashlib.blake2b(array("q", prompt).tobytes(), digest_size=8, key=seed.to_bytes(8, "little", signed=True))
    return int.from_bytes(digest.digest(), "little")


def token_at(pseed: int, position: int) -> int:
    """The generated token at `position` for a prompt whose `prompt_seed` is `pseed` (splitmix64)."""
    z = (pseed + (position + 1) * _GOLDEN) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    z ^= z >> 31
    return GEN_VOCAB[z % len(GEN_VOCAB)]


def output_token(prompt: Sequence[int], position: int, seed: int = 0) -> int:
    return token_at(prompt_seed(prompt, seed), position)


def output_tokens(prompt: Sequence[int], count: int, seed: int = 0) -> list[int]:
    pseed = prompt_seed(prompt, seed)
    return [token_at(pseed, k) for k in range(count)]
