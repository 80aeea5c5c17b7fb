"""`shmdisagg bench --launch -c CONFIG`: bring the deployment up, benchmark it, stop it.

The deployment runs in the background (`Deployment(background=True)`): its coordinator and fleet
log to `<log dir>/coordinator.log` rather than between the bench's lines, and run in their own
session, so a Ctrl-C or a SIGTERM to the terminal's process group (`timeout 60 shmdisagg bench
--launch ...`) reaches the bench alone. The bench then cancels its requests in flight, prints and
writes the summary, and only then stops the deployment (coordinator first, so requests still in
flight get `timeout_graceful_shutdown_s`, then the executors). A second signal quits the run at
once, but the deployment is still stopped in order. Exit status as for `shmdisagg bench`: 0, 1
(a request failed, or the launch did), 2 (bad usage or config), 130 (SIGINT), 143 (SIGTERM).

`--port P` moves the deployment: public port P and every executor port by the same offset, so
`examples/demo.yaml` runs beside another deployment without editing it (the moved config is
written to a temporary file for the coordinator and removed afterwards).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import yaml

from shmdisagg.bench.cli import interrupted_status, run_cli
from shmdisagg.procutil import STOP_SIGNALS

ROLES = ("context_servers", "generation_servers")


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The options `shmdisagg bench` adds to `cli.add_arguments` to run its own deployment."""
    group = parser.add_argument_group("launch")
    group.add_argument(
        "--launch",
        action="store_true",
        help="bring up the deployment of -c/--config around the run "
        "(its coordinator and fleet log to <log dir>/coordinator.log; Ctrl-C or SIGTERM reports, then stops it)",
    )
    group.add_argument("-c", "--config", help="deployment config (with --launch)")
    group.add_argument(
        "--port",
        type=int,
        metavar="P",
        help="with --launch: public port P instead of the config's, every executor port moved by the "
        "same offset (e.g. examples/demo.yaml with --port 9400: executors on 9501, 9502, 9601, 9602)",
    )


def shift_ports(raw: dict[str, Any], port: int) -> dict[str, Any]:
    """A copy of the config dict `raw` with its public port `port` and every executor url's port
    moved by the same offset. Raises ValueError when a moved port falls outside 1..65535 or a url
    has no port."""
    from shmdisagg.config import DisaggConfig

    offset = port - int(raw.get("port", DisaggConfig.model_fields["port"].default))  # the config's own default
    out = dict(raw, port=port)
    for role in ROLES:
        section = raw.get(role)
        if not isinstance(section, dict) or not isinstance(section.get("urls"), list):
            continue
        urls = []
        for url in section["urls"]:
            host, sep, p = str(url).rpartition(":")
            if not sep or not p.isdigit():
                raise ValueError(f"{role}.urls: {url!r} has no port to move")
            moved = int(p) + offset
            if not 1 <= moved <= 65535:
                raise ValueError(f"--port {port} moves {role} url {url} to port {moved}, outside 1..65535")
            urls.append(f"{host}:{moved}")
        out[role] = dict(section, urls=urls)
    if not 1 <= port <= 65535:
        raise ValueError(f"--port {port} is outside 1..65535")
    return out


@contextlib.contextmanager
def _moved_config(path: str, port: int | None) -> Iterator[str]:
    """`path`, or with `port` a temporary copy of it moved there (removed on exit)."""
    if port is None:
        yield path
        return
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"{path}: cannot read: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a config mapping")
    moved = shift_ports(raw, port)
    fd, tmp = tempfile.mkstemp(prefix=f"shmdisagg-{os.getuid()}-bench-{port}-", suffix=".yaml")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"# {path} moved to port {port} by shmdisagg bench --launch --port\n")
            yaml.safe_dump(moved, f, sort_keys=False)
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def run_bench(args: argparse.Namespace, load_config: Callable[[str], Any]) -> int:
    """`shmdisagg bench`: `run_cli` against --url, or with --launch around its own deployment."""
    if not args.launch:
        if args.config:
            print(
                "shmdisagg bench: -c/--config is the config of the deployment --launch starts; to bench a running "
                "one give --url",
                file=sys.stderr,
            )
            return 2
        if args.port is not None:
            print(
                "shmdisagg bench: --port moves a deployment started with --launch; to bench a running one give --url",
                file=sys.stderr,
            )
            return 2
        return run_cli(args)
    return run_launched(args, load_config)


def run_launched(args: argparse.Namespace, load_config: Callable[[str], Any]) -> int:
    """`shmdisagg bench --launch`: launch, `run_cli`, stop. `load_config(path)` loads and
    validates a config (exits 2 on a bad one)."""
    if not args.config:
        print("shmdisagg bench: --launch needs -c/--config", file=sys.stderr)
        return 2
    if args.url:
        print(
            "shmdisagg bench: --url and --launch are alternatives: --launch benches the deployment it starts",
            file=sys.stderr,
        )
        return 2
    if getattr(args, "plot_only", False):
        print(
            "shmdisagg bench: --plot-only draws earlier runs (--compare) and sends nothing: drop --launch",
            file=sys.stderr,
        )
        return 2
    from shmdisagg.bench import BenchError
    from shmdisagg.bench.cli import workload
    from shmdisagg.launch import Deployment

    try:  # the options and the trace first: a bad one must not cost a deployment's start and stop
        workload(args)
    except BenchError as err:
        print(f"shmdisagg bench: error: {err}", file=sys.stderr)
        return 2

    signals: list[int] = []

    def interrupt(signum: int, frame: object) -> None:
        signals.append(signum)
        raise KeyboardInterrupt

    # A signal while the deployment starts stops what was started (run_cli takes over in the run).
    old = {s: signal.signal(s, interrupt) for s in STOP_SIGNALS}
    try:
        config = load_config(args.config)  # the user's file: errors and warnings name it
        with _moved_config(args.config, args.port) as path:
            if path != args.config:
                from shmdisagg.config import ConfigError, load_config as load_moved

                try:
                    config = load_moved(path)
                except ConfigError as err:
                    raise ValueError(f"--port {args.port}: {err}") from None
            where = f" on port {config.port}" if args.port is not None else ""
            print(f"shmdisagg bench: launching {args.config}{where} ...", file=sys.stderr, flush=True)
            return _bench_deployment(Deployment(config, path, background=True), args)
    except ValueError as err:
        print(f"shmdisagg bench: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shmdisagg bench: interrupted", file=sys.stderr)
        return interrupted_status(signals[-1] if signals else None)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _bench_deployment(dep: Any, args: argparse.Namespace) -> int:
    from shmdisagg.launch import LaunchError

    started = False
    try:
        dep.start()
        started = True
        args.url = dep.url
        print(f"shmdisagg bench: deployment up at {dep.url} (logs: {dep.log_dir})", file=sys.stderr, flush=True)
        return run_cli(args)
    except LaunchError as err:
        print(f"shmdisagg: launch failed: {err}", file=sys.stderr)
        return err.exit_status
    finally:
        # Nothing may cut the ordered, bounded stop short: further signals are ignored.
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        dep.stop()
        if started:
            print("shmdisagg bench: deployment stopped", file=sys.stderr, flush=True)
