"""`python -m shmdisagg.coordinator -c CONFIG [-s STYLE] [-t S] [-r S] [-l LEVEL] [--report_addr PATH]`:
run the coordinator and its fleet (what `shmdisagg serve` and `shmdisagg launch` start)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

from shmdisagg.interrupts import exit_status_stands
from shmdisagg.processes import SUPERVISOR_ENV  # light: what a Ctrl-C during the imports below needs


def says_its_interrupts(environ: Mapping[str, str]) -> bool:
    """Whether this coordinator prints its own "interrupted during start-up" line: not when
    `shmdisagg launch` or `serve`'s keeper runs it (SHMDISAGG_LAUNCHED, SUPERVISOR_ENV), which
    say it once for the whole deployment, this process being stopped by them too."""
    return not (environ.get("SHMDISAGG_LAUNCHED") or environ.get(SUPERVISOR_ENV))


# A terminal's Ctrl-C reaches this process with its parent (`shmdisagg serve` keeps it in its
# process group): one that lands while the modules load ends it with 130, not a traceback
try:
    import uvloop

    from shmdisagg.cluster.metadata import MetadataConfigError, load_metadata_config
    from shmdisagg.config import ConfigError, DisaggConfig, env_tokens_per_block, load_config
    from shmdisagg.coordinator.main import (
        FleetStartFailed,
        StartOptions,
        StartupError,
        StartupInterrupted,
        run_coordinator,
    )
    from shmdisagg.fleet.overrides import DEFAULT_LEG_TIMEOUT_S
    from shmdisagg.processes import START_FAILED_EXIT, supervisor_of
    from shmdisagg.shm.segment import ShmError
    from shmdisagg.trtllm_env import LOG_LEVELS, TrtllmEnv, read_env, resolve_log_level
except KeyboardInterrupt:
    if says_its_interrupts(os.environ):
        print("shmdisagg: interrupted during start-up (SIGINT); nothing had started", file=sys.stderr)
    exit_status_stands()  # 130, not death by SIGINT (an extension module's init may have marked it)
    raise SystemExit(128 + signal.SIGINT) from None


def main(argv: list[str] | None = None, env: TrtllmEnv | None = None) -> int:
    """`env`: TensorRT-LLM's variables already read (and their warnings shown) by the caller."""
    if not wait_for_promotion(os.environ):
        return 0
    parser = argparse.ArgumentParser(prog="shmdisagg-coordinator")
    parser.add_argument("-c", "--config", required=True)
    parser.add_argument(
        "-s",
        "--schedule_style",
        choices=["context_first", "generation_first"],
        help="overrides the config and TRTLLM_DISAGG_SCHEDULE_STYLE",
    )
    parser.add_argument("-t", "--server_start_timeout", type=float, help="overrides shmdisagg.server_start_timeout_s")
    parser.add_argument(
        "-r",
        "--request_timeout",
        type=float,
        default=DEFAULT_LEG_TIMEOUT_S,
        help="each leg's timeout, seconds (0: none)",
    )
    parser.add_argument("-l", "--log_level", choices=list(LOG_LEVELS))
    parser.add_argument("--report_addr")
    parser.add_argument("-m", "--metadata_server_config_file")
    args = parser.parse_args(argv)
    try:
        metadata = load_metadata_config(args.metadata_server_config_file) if args.metadata_server_config_file else None
    except MetadataConfigError as err:
        print(f"shmdisagg: -m/--metadata_server_config_file: {err}", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config, metadata_server=metadata is not None)
        if env is None:
            env = read_env()
            if not (
                os.environ.get("SHMDISAGG_LAUNCHED") or os.environ.get("SHMDISAGG_ENV_SHOWN")
            ):  # else the launcher or serve showed them already
                for warning in env.warnings:
                    print(f"shmdisagg: warning: {warning}", file=sys.stderr)
        env_tokens_per_block()
    except ConfigError as err:
        for line in err.problems:
            print(f"shmdisagg: config error: {line}", file=sys.stderr)
        return 2
    config = with_start_timeout(config, args.server_start_timeout)
    level = resolve_log_level(env, args.log_level, config.shmdisagg.log_level)
    logging.basicConfig(level=LOG_LEVELS[level], format="%(asctime)s coordinator %(levelname)s %(message)s", force=True)
    options = StartOptions(
        args.schedule_style,
        args.request_timeout or None,
        level,
        args.report_addr,
        env,
        metadata_server=metadata,
        **supervised(os.environ),
    )
    try:
        uvloop.run(run_coordinator(config, args.config, options))
    except StartupInterrupted as err:
        if says_its_interrupts(os.environ):
            print(
                f"shmdisagg: interrupted during start-up ({signal.Signals(err.signum).name}); stopped what had started",
                file=sys.stderr,
            )
        return 128 + err.signum
    except FleetStartFailed as err:
        print(f"shmdisagg: coordinator failed to start: {err}", file=sys.stderr)
        return START_FAILED_EXIT  # not restarted (coordinator/keeper.py)
    except (StartupError, ShmError, ConfigError, OSError) as err:
        print(f"shmdisagg: coordinator failed to start: {err}", file=sys.stderr)
        return 1
    return 0


def wait_for_promotion(environ: Mapping[str, str]) -> bool:
    """A standby coordinator (SHMDISAGG_STANDBY_FD, `coordinator/keeper.py`), its imports done:
    block until the keeper makes it the coordinator (one byte: True) or goes away (EOF: False).
    A terminal's Ctrl-C is the running coordinator's business, not a waiting standby's."""
    fd = environ.get("SHMDISAGG_STANDBY_FD", "")
    if not fd.isdigit():
        return True
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        got = os.read(int(fd), 1)
    except OSError:
        got = b""
    finally:
        os.close(int(fd))
        signal.signal(signal.SIGINT, old)
    return bool(got)


def supervised(environ: Mapping[str, str]) -> dict[str, Any]:
    """What the deployment's supervisor (`coordinator/keeper.py`) tells this coordinator in its
    environment: `StartOptions.adopt`, `adopt_port`, `supervisor`, `ready_fd`."""
    ready = environ.get("SHMDISAGG_READY_FD", "")
    port = environ.get("SHMDISAGG_ADOPT_PORT", "")
    return {
        "adopt": environ.get("SHMDISAGG_ADOPT") == "1",
        "adopt_port": int(port) if port.isdigit() else None,
        "supervisor": supervisor_of(environ),
        "ready_fd": int(ready) if ready.isdigit() else None,
    }


def with_start_timeout(config: DisaggConfig, seconds: float | None) -> DisaggConfig:
    """The config with `-t/--server_start_timeout` as its `shmdisagg.server_start_timeout_s`
    (the flag wins over the file, as a command line does)."""
    if seconds is None:
        return config
    return config.model_copy(
        update={"shmdisagg": config.shmdisagg.model_copy(update={"server_start_timeout_s": float(seconds)})}
    )


if __name__ == "__main__":
    sys.exit(main())
