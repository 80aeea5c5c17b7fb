"""`shmdisagg stats`: watch a running deployment from its shared memory, like `top`.

    shmdisagg stats -c CONFIG             live view, refreshed every --interval seconds (Ctrl-C quits;
                                          not a terminal: one frame printed per interval)
    shmdisagg stats --port 8000           the deployment on that port (default prefix shmdisagg-<uid>-<port>)
    shmdisagg stats --prefix NAME         by shared-memory prefix
    shmdisagg stats ... --once --json     one snapshot as JSON (two reads --interval apart, for the rates)

Not a terminal (piped, logged): printed at the view's full width, or $COLUMNS when set.

A deployment killed hard (SIGKILL) leaves its segments behind: the view then says "STALE"
(`"state": "stale"` in the JSON) rather than "running", since the coordinator's pid is gone (or
is another process now); the next `shmdisagg launch` or `serve` of that deployment removes them.

The live view ends, with one line on stderr saying why, when the deployment stops (its
coordinator was asked to stop and removed its segments; a new deployment replaced them) or dies.

Exit codes: 0 (the live view too when the deployment it watches stops), 1 when no deployment runs
under that prefix, the watched one dies, or what is there is stale (--once still prints the
snapshot), 2 bad usage/config (an invalid --prefix included).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from typing import Any

import orjson

from shmdisagg.config import ShmSection
from shmdisagg.stats.snapshot import NotRunning, StatsReader, snapshot, stale_reason, stopped_reason

# A prefix names files directly under /dev/shm ("/{prefix}-ctl", ...): what the config's
# shmdisagg.shm.prefix accepts, or the default a config without one gets (shmdisagg-<uid>-<port>,
# which a large uid can make longer than a configured prefix may be).
_CONFIG_PREFIX = re.compile(
    next(m.pattern for m in ShmSection.model_fields["prefix"].metadata if getattr(m, "pattern", None))
)
_DEFAULT_PREFIX = re.compile(r"^shmdisagg-[0-9]{1,10}-[0-9]{1,5}$")
MAX_PREFIX_CHARS = int(re.search(r"\{1,(\d+)\}", _CONFIG_PREFIX.pattern).group(1))  # type: ignore[union-attr]  # the pattern has {1,N}
# An hour: a view refreshed less often looks hung, and `--once` sleeps one interval before printing.
MAX_INTERVAL_S = 3600.0
MIN_INTERVAL_S = 0.05  # 20 frames a second; 1e-9 drew as fast as it could, a core's worth of CPU


def _interval(text: str) -> float:
    """--interval's type: seconds from `MIN_INTERVAL_S` to `MAX_INTERVAL_S` (nan, inf or 1e9
    would never refresh; 1e-9 spins)."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(seconds) and MIN_INTERVAL_S <= seconds <= MAX_INTERVAL_S):
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds from {MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:g}, not {text!r}"
        )
    return seconds


def _port(text: str) -> int:
    """--port's type: a TCP port, 1-65535 (a deployment of port 0 is named after the port it bound)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be 1-65535 (the port the deployment bound), not {port}")
    return port


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("-c", "--config", help="the deployment's config file (its port and shmdisagg.shm.prefix)")
    where.add_argument(
        "--port", type=_port, help="the deployment's public port (default prefix shmdisagg-<uid>-<port>)"
    )
    where.add_argument("--prefix", help="the deployment's shared-memory prefix")
    p.add_argument(
        "--interval",
        type=_interval,
        default=1.0,
        help=f"seconds between refreshes, and the window of the rates; {MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:g} "
        "(default: %(default)s)",
    )
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="with --once: JSON instead of the table")


def resolve_prefix(args: argparse.Namespace, load_config: Any) -> str:
    """The prefix named by -c/--port/--prefix (port 8000 when none is given). Raises ValueError
    for a config of `port: 0` without a prefix: its segments are named after the port the
    kernel picked, which the config does not hold."""
    if args.prefix is not None:  # '' too: prefix_error refuses it rather than using the default
        return str(args.prefix)
    if args.config:
        config = load_config(args.config)
        if config.port == 0 and not config.shmdisagg.shm.prefix:
            raise ValueError(
                f"{args.config} has port: 0, and its deployment's shared memory is named after the port it "
                "bound: give that port (--port, from the --report_addr file) or set shmdisagg.shm.prefix"
            )
        return str(config.shm_prefix)
    return f"shmdisagg-{os.getuid()}-{8000 if args.port is None else args.port}"


def prefix_error(prefix: str) -> str | None:
    """Why `prefix` cannot name a deployment's shared memory, or None when it can."""
    if _CONFIG_PREFIX.match(prefix) or _DEFAULT_PREFIX.match(prefix):
        return None
    shown = prefix if len(prefix) <= 60 else f"{prefix[:40]}... ({len(prefix)} characters)"
    return (
        f"invalid shared-memory prefix {shown!r}: use 1-{MAX_PREFIX_CHARS} letters, digits, "
        f"'_', '.' or '-' (as shmdisagg.shm.prefix), or the default shmdisagg-<uid>-<port>"
    )


def fit_width(console: Any, renderable: Any) -> None:
    """Not a terminal and no $COLUMNS: widen `console` to the renderable's natural width, so a piped
    or logged view is neither wrapped nor truncated (rich would otherwise assume 80 columns)."""
    from rich.measure import Measurement

    if console.is_terminal or os.environ.get("COLUMNS", "").strip().isdigit():
        return
    console.width = max(1, Measurement.get(console, console.options.update_width(100_000), renderable).maximum)


def take(reader: StatsReader, interval: float) -> dict[str, Any]:
    """One snapshot with rates over `interval` seconds."""
    first = reader.sample(scan_index=False)  # only the base of the rates
    time.sleep(interval)
    return snapshot(first, reader.sample(), reader.prefix)


def run(args: argparse.Namespace, prefix: str) -> int:
    if args.json and not args.once:
        print("shmdisagg stats: --json needs --once", file=sys.stderr)
        return 2
    bad = prefix_error(prefix)
    if bad is not None:
        print(f"shmdisagg stats: {bad}", file=sys.stderr)
        return 2
    try:
        reader = StatsReader(prefix)
    except NotRunning as err:
        print(f"shmdisagg stats: {err}", file=sys.stderr)
        return 1
    with reader:
        if args.once:
            snap = take(reader, args.interval)
            if args.json:
                sys.stdout.buffer.write(orjson.dumps(snap, option=orjson.OPT_INDENT_2) + b"\n")
            else:
                from rich.console import Console

                from shmdisagg.stats.view import render

                console, view = Console(), render(snap)
                fit_width(console, view)
                console.print(view)
            if snap["state"] == "stale":
                print(f"shmdisagg stats: {prefix}: {snap['stale_reason']}", file=sys.stderr)
                return 1
            return 0
        return _live(reader, args.interval)


def _live(reader: StatsReader, interval: float) -> int:
    """Refresh in place on a terminal (rich `Live`); print one frame per interval otherwise
    (like `top -b`), so the view can be piped or logged. Ends, with one line saying why, when the
    deployment stops (0) or dies (1)."""
    from rich.console import Console
    from rich.live import Live

    from shmdisagg.stats.view import render

    console = Console()
    prev = reader.sample()
    first = render(snapshot(None, prev, reader.prefix))
    if prev.coordinator_alive is False:  # a dead deployment's segments: one frame says so, then exit
        fit_width(console, first)
        console.print(first)
        print(f"shmdisagg stats: {reader.prefix}: {stale_reason(prev.coordinator)}", file=sys.stderr)
        return 1
    try:
        live = Live(first, console=console, auto_refresh=False) if console.is_terminal else None
        if live is None:
            fit_width(console, first)
            console.print(first)
            sys.stdout.flush()
        else:
            live.start(refresh=True)
        try:
            while True:
                time.sleep(interval)
                state = reader.segment_state()
                if state != "present":
                    code, why = 0, stopped_reason(reader.prefix, state, prev)
                    break
                cur = reader.sample()
                if cur.coordinator_alive is False:
                    state = reader.segment_state()
                    if state != "present":  # it removed its segments and exited between the two reads
                        code, why = 0, stopped_reason(reader.prefix, state, cur)
                    else:  # killed hard: the segments stay behind
                        code, why = 1, f"the deployment {reader.prefix} died: {stale_reason(cur.coordinator)}"
                    break
                frame = render(snapshot(prev, cur, reader.prefix))
                prev = cur
                if live is None:
                    fit_width(console, frame)
                    console.print(frame)
                    sys.stdout.flush()
                else:
                    live.update(frame, refresh=True)
        finally:
            if live is not None:
                live.stop()
    except KeyboardInterrupt:
        return 0
    print(f"shmdisagg stats: {why}", file=sys.stderr)  # after the last frame, not above it
    return code
