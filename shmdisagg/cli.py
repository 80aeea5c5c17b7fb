"""shmdisagg: disaggregated LLM serving on one machine, with the routers' state in shared memory.
A drop-in for `trtllm-serve disaggregated`: the same config file, the same executors.

    shmdisagg launch -c CONFIG      start executors, coordinator and fleet; stop on SIGINT/SIGTERM
                                    (--dry-run: print the plan, start nothing)
    shmdisagg serve -c CONFIG       coordinator and fleet only, for executors already running
                                    (what `trtllm-serve disaggregated -c CONFIG` does)
    shmdisagg bench [...]           replay a trace or run a fixed-concurrency load
    shmdisagg check-config -c CONFIG
                                    validate a config, its plan and its addresses here (and is
                                    its public port free?)
    shmdisagg stats -c CONFIG       live view of a running deployment's shared table (--once --json)
    shmdisagg sim [...]             one executor simulator (see `shmdisagg sim --help`)

Exit codes: 0 success, 1 runtime failure, 2 bad config or usage, 128 + the signal's number
when interrupted before the command finished starting (130 SIGINT, 143 SIGTERM; `launch` and
`serve` stopped by one once they serve exit 0).
"""

# (This docstring is `shmdisagg --help`'s description.) Only this module turns exceptions into
# exit codes.

from __future__ import annotations

import sys

try:  # a Ctrl-C while the modules load (right after the command is typed) ends in one line
    import argparse
    import logging
    import os
    import signal

    from shmdisagg.config import ConfigError, DisaggConfig, check_machine, config_warnings, load_config
    from shmdisagg.procutil import STOP_SIGNALS
except KeyboardInterrupt:
    print("shmdisagg: interrupted (SIGINT)", file=sys.stderr)
    raise SystemExit(130) from None


class Interrupted(KeyboardInterrupt):
    """A stop signal (SIGINT or SIGTERM) turned into an exception; `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def _signal_name(err: BaseException) -> tuple[int, str]:
    signum = int(getattr(err, "signum", signal.SIGINT))
    return signum, signal.Signals(signum).name


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _load(path: str) -> DisaggConfig:
    try:
        config = load_config(path)
    except ConfigError as err:
        print(f"shmdisagg: config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    for warning in config_warnings(config):
        print(f"shmdisagg: warning: {path}: {warning}", file=sys.stderr)
    return config


def _check_machine(config: DisaggConfig, path: str, executors_here: bool) -> None:
    """`config.check_machine`, exiting 2 with one line naming the key."""
    try:
        check_machine(config, executors_here)
    except ConfigError as err:
        print(f"shmdisagg: config error: {path}: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _load_launchable(path: str) -> DisaggConfig:
    """`_load`, then the checks against this machine of a deployment started here."""
    config = _load(path)
    _check_machine(config, path, executors_here=config.shmdisagg.executors is not None)
    return config


def cmd_launch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from shmdisagg.config import log_dir_problem
    from shmdisagg.executors.plan import build_plan, describe_plan
    from shmdisagg.launch import Deployment, LaunchError

    # A SIGINT or SIGTERM during start-up stops what was started, then exits 128 + its number
    # (Deployment.wait() takes the signals over once the deployment serves).
    for s in STOP_SIGNALS:
        signal.signal(s, _interrupt)
    config = _load(args.config)
    spec = config.shmdisagg.executors
    log_dir = args.log_dir or (spec.log_dir if spec else None)
    try:
        plan = build_plan(config, Path(log_dir) if log_dir else None)
    except ConfigError as err:
        print(f"shmdisagg: config error: {args.config}: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(describe_plan(plan, config, args.config))
        return 0
    _check_machine(config, args.config, executors_here=spec is not None)
    problem = log_dir_problem(args.log_dir) if args.log_dir and spec is not None else None
    if problem:
        print(f"shmdisagg: --log-dir: {problem}", file=sys.stderr)
        return 2
    dep = Deployment(config, args.config, args.log_dir)
    try:
        dep.start()
    except LaunchError as err:
        print(f"shmdisagg: launch failed: {err}", file=sys.stderr)
        return err.exit_status
    except KeyboardInterrupt as err:  # start() stopped what it had started before it re-raised
        signum, name = _signal_name(err)
        print(f"shmdisagg: interrupted during start-up ({name}); stopped what had started", file=sys.stderr)
        return 128 + signum
    try:
        ctx = ", ".join(config.context_servers.urls)
        gen = ", ".join(config.generation_servers.urls)
        print(f"shmdisagg listening on {dep.url} ({_plural(config.num_workers, 'fleet worker')}; context: {ctx}; generation: {gen}; executor logs: {dep.log_dir})", flush=True)
        code = dep.wait()
    except KeyboardInterrupt:  # SIGINT/SIGTERM that came before wait() took over the handlers
        code = 0
    finally:
        # A second signal must not cut the ordered, bounded stop short.
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        dep.stop()
        print("shmdisagg stopped", flush=True)
    if code:  # the coordinator died: its fleet went with it, and the launcher stopped the executors
        status = dep.coordinator_exit
        how = f"exit code {status}"
        if status is not None and status < 0:
            how = f"killed by {signal.Signals(-status).name}" if -status in signal.valid_signals() else f"killed by signal {-status}"
        print(f"shmdisagg: the coordinator exited ({how}); the deployment is stopped (launch does not restart it)", file=sys.stderr)
    return code


def cmd_serve(args: argparse.Namespace) -> int:
    from shmdisagg.coordinator.__main__ import main as coordinator_main

    config = _load(args.config)
    _check_machine(config, args.config, executors_here=False)
    return coordinator_main(["-c", args.config] + (["-s", args.schedule_style] if args.schedule_style else []))


def cmd_check_config(args: argparse.Namespace) -> int:
    from shmdisagg.executors.plan import build_plan

    config = _load(args.config)
    try:  # the launch plan's own checks too (trtllm options, GPUs), as `launch` runs them here
        build_plan(config, None)
    except ConfigError as err:
        print(f"shmdisagg: config error: {args.config}: {err}", file=sys.stderr)
        return 2
    # and the checks against this machine that launch and serve run (addresses, log directory)
    _check_machine(config, args.config, executors_here=config.shmdisagg.executors is not None)
    from shmdisagg.portuser import public_port_user

    port = public_port_user(config, args.config)  # what launch and serve would refuse right now
    if port is not None and not port.ours:
        print(f"shmdisagg: {args.config}: {port.problem}; launch and serve need it free", file=sys.stderr)
        return 1
    n_ctx, n_gen = len(config.context_servers.urls), len(config.generation_servers.urls)
    print(
        f"{args.config}: ok — {n_ctx} context and {n_gen} generation server{'' if n_gen == 1 else 's'}, "
        f"{_plural(config.num_workers, 'fleet worker')}, "
        f"routers {config.context_servers.router.type}/{config.generation_servers.router.type}, "
        f"shared memory /dev/shm/{config.shm_prefix}-*"
    )
    if port is not None:
        print(f"{args.config}: {port.problem}; launch and serve refuse a second one while it runs")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from shmdisagg.bench.launched import run_bench

    return run_bench(args, _load_launchable)


def cmd_stats(args: argparse.Namespace) -> int:
    from shmdisagg.stats.cli import resolve_prefix, run

    return run(args, resolve_prefix(args, _load))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shmdisagg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("launch", help="start a single-node deployment")
    p.add_argument("-c", "--config", required=True)
    p.add_argument("--log-dir", help="where executor logs (appended to) and option files go (default: the config's "
                   "shmdisagg.executors.log_dir, else the fixed <tmp>/<shm prefix>-logs, e.g. "
                   "/tmp/shmdisagg-<uid>-<port>-logs, reused by every launch of that deployment)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (commands, environment, option files, ports, GPUs) and start nothing")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("serve", help="coordinator and fleet for executors already running")
    p.add_argument("-c", "--config", required=True)
    p.add_argument("-s", "--schedule_style", choices=["context_first", "generation_first"], help="overrides the config and TRTLLM_DISAGG_SCHEDULE_STYLE")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("check-config", help="validate a config file here (keys, plan, addresses, public port)")
    p.add_argument("-c", "--config", required=True)
    p.set_defaults(func=cmd_check_config)

    from shmdisagg.bench.cli import add_arguments

    p = sub.add_parser("bench", help="replay a trace or run a fixed-concurrency load")
    add_arguments(p)
    from shmdisagg.bench.launched import add_launch_arguments

    add_launch_arguments(p)  # --launch, -c, --port
    p.set_defaults(func=cmd_bench)

    from shmdisagg.stats.cli import add_arguments as stats_arguments

    p = sub.add_parser("stats", help="watch a running deployment (read-only, from shared memory)")
    stats_arguments(p)
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("sim", help="run one executor simulator", add_help=False)
    p.set_defaults(func=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt as err:  # a command that did not handle it: nothing of it runs on
        signum, name = _signal_name(err)
        print(f"shmdisagg: interrupted ({name})", file=sys.stderr)
        return 128 + signum


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:
        from shmdisagg.executors.sim.__main__ import main as sim_main

        return int(sim_main(argv[1:], prog="shmdisagg sim") or 0)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # e.g. `shmdisagg launch --dry-run | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
