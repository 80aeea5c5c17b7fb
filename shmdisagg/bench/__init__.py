"""`shmdisagg bench`: replays a request trace (or a fixed-concurrency load) against an
OpenAI-compatible server and reports latency, throughput, KV-cache hits and orchestrator CPU.

See README.md in this folder for the module map. Entry points: `cli.add_arguments`, `cli.run`,
`cli.main`.
"""

from __future__ import annotations


class BenchError(Exception):
    """A benchmark that cannot start: bad options, an unreadable trace, no model to ask for."""


class OutputError(Exception):
    """A finished run whose results could not all be written (`--json`, `--records`, `--plot`):
    the table was printed; the message names each output and why (exit status 1)."""
