"""The command line that starts one executor for the launcher.

Backend `sim`: the executor simulator (`python -m shmdisagg.executors.sim`), with the
`shmdisagg.executors.sim` settings of the config and the section's `max_batch_size`,
`max_num_tokens` and `kv_cache_config.tokens_per_block` when the section sets them (so the
simulator serves what a real executor with that config would).
"""

from __future__ import annotations

import sys

from shmdisagg.config import ExecutorsSection, ServerSection


def executor_command(
    spec: ExecutorsSection, role: str, section: ServerSection, host: str, port: int
) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) for one executor of `role` listening on host:port."""
    if spec.backend != "sim":
        raise NotImplementedError(f"executor backend {spec.backend!r} is not available in this version")
    sim = spec.sim
    tpb = section.kv_cache_config.get("tokens_per_block") or sim.tokens_per_block
    argv = [
        sys.executable, "-m", "shmdisagg.executors.sim",
        "--host", host,
        "--port", str(port),
        "--role", role,
        "--model", spec.model,
        "--profile", sim.profile,
        "--tokens-per-block", str(tpb),
        "--num-blocks", str(sim.num_blocks),
        "--max-batch-size", str(section.max_batch_size or sim.max_batch_size),
        "--max-num-tokens", str(section.max_num_tokens or sim.max_num_tokens),
        "--speedup", str(sim.speedup),
        *sim.extra_args,
    ]
    return argv, {}
