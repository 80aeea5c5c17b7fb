"""`python -m shmdisagg.coordinator -c CONFIG`: run the coordinator and its fleet."""

from __future__ import annotations

import argparse
import logging
import sys

import uvloop

from shmdisagg.config import ConfigError, load_config
from shmdisagg.coordinator.main import StartupError, run_coordinator
from shmdisagg.shm.segment import ShmError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shmdisagg-coordinator")
    parser.add_argument("-c", "--config", required=True)
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(f"shmdisagg: config error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.shmdisagg.log_level.upper(), format="%(asctime)s coordinator %(levelname)s %(message)s")
    try:
        uvloop.run(run_coordinator(config, args.config))
    except (StartupError, ShmError, ConfigError, OSError) as err:
        print(f"shmdisagg: coordinator failed to start: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
