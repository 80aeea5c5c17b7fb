"""`python -m shmdisagg.coordinator -c CONFIG`: run the coordinator and its fleet."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import uvloop

from shmdisagg.config import ConfigError, env_tokens_per_block, load_config
from shmdisagg.coordinator.main import StartupError, StartupInterrupted, run_coordinator
from shmdisagg.shm.segment import ShmError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shmdisagg-coordinator")
    parser.add_argument("-c", "--config", required=True)
    parser.add_argument("-s", "--schedule_style", choices=["context_first", "generation_first"], help="overrides the config and TRTLLM_DISAGG_SCHEDULE_STYLE")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        style = os.environ.get("TRTLLM_DISAGG_SCHEDULE_STYLE")
        if style and style not in ("context_first", "generation_first"):
            raise ConfigError(f"TRTLLM_DISAGG_SCHEDULE_STYLE: {style!r} is not context_first or generation_first")
        env_tokens_per_block()
    except ConfigError as err:
        print(f"shmdisagg: config error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.shmdisagg.log_level.upper(), format="%(asctime)s coordinator %(levelname)s %(message)s")
    try:
        uvloop.run(run_coordinator(config, args.config, args.schedule_style))
    except StartupInterrupted as err:
        if not os.environ.get("SHMDISAGG_LAUNCHED"):  # else the launcher that stopped it says so
            print(f"shmdisagg: interrupted during start-up ({signal.Signals(err.signum).name}); stopped what had started", file=sys.stderr)
        return 128 + err.signum
    except (StartupError, ShmError, ConfigError, OSError) as err:
        print(f"shmdisagg: coordinator failed to start: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
