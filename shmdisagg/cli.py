"""shmdisagg: disaggregated LLM serving on one machine, with the routers' state in shared memory.
A drop-in for `trtllm-serve disaggregated`: the same config file, the same executors.

    shmdisagg launch -c CONFIG      start executors, coordinator and fleet; stop on SIGINT/SIGTERM
                                    (--dry-run: print the plan, start nothing)
    shmdisagg serve -c CONFIG       coordinator and fleet only, for executors already running
                                    (what `trtllm-serve disaggregated -c CONFIG` does; alias
                                    `shmdisagg disaggregated`, with its flags -t -r -l -s
                                    --report_addr --metrics-log-interval)
    shmdisagg bench [...]           replay a trace or run a fixed-concurrency load
    shmdisagg check-config -c CONFIG [--serve]
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

import signal
import sys

from shmdisagg.interrupts import exit_status_stands, raise_if_interrupted, raise_interrupted

# Every SIGINT is recorded before it becomes a KeyboardInterrupt (`interrupts.raise_interrupted`):
# one raised while a library runs a finalizer or a bare `except:` is swallowed there, and the
# command would go on to start a deployment nobody wants (found under load: a Ctrl-C during the
# imports, then a coordinator waiting for its executors). `raise_if_interrupted` ends the command
# before it starts anything, and launch's start-up waits call it each turn.

# Running as the command (`shmdisagg`, `python -m shmdisagg.cli`), not imported by a program.
_AS_COMMAND = bool(sys.argv) and sys.argv[0].rsplit("/", 1)[-1] in ("shmdisagg", "cli.py")
# SIGINT, unless someone else handles it; also when it came ignored, as a script's background job
# starts: serve and launch take it over once they run anyway (as uvicorn does), and a SIGINT that
# came before that was lost (the start then waited out its whole timeout)
if signal.getsignal(signal.SIGINT) is signal.default_int_handler or (
    _AS_COMMAND and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
):
    signal.signal(signal.SIGINT, raise_interrupted)
# and SIGTERM, as the command: killed by it while loading, the command said nothing
if _AS_COMMAND and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
    signal.signal(signal.SIGTERM, raise_interrupted)

try:  # a Ctrl-C while the modules load (right after the command is typed) ends in one line
    import argparse
    import logging
    import os
    from typing import Any

    from shmdisagg.config import ConfigError, DisaggConfig, check_machine, config_warnings, load_config
    from shmdisagg.procutil import STOP_SIGNALS, unwritable
    from shmdisagg.trtllm_env import LOG_LEVELS, TrtllmEnv, read_env, resolve_log_level
except KeyboardInterrupt as _err:
    _signum = getattr(_err, "signum", signal.SIGINT)
    print(f"shmdisagg: interrupted ({signal.Signals(_signum).name})", file=sys.stderr)
    exit_status_stands()
    raise SystemExit(128 + _signum) from None


def _take_stop_signals() -> None:
    """From here a SIGINT or SIGTERM raises `Interrupted`; an earlier, swallowed one raises now."""
    for s in STOP_SIGNALS:
        signal.signal(s, raise_interrupted)
    raise_if_interrupted()


def _signal_name(err: BaseException) -> tuple[int, str]:
    signum = int(getattr(err, "signum", signal.SIGINT))
    return signum, signal.Signals(signum).name


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _refuse(err: ConfigError, prefix: str = "") -> None:
    """Exit 2 with one line per problem of `err`."""
    for line in err.problems:
        print(f"shmdisagg: config error: {prefix}{line}", file=sys.stderr)
    raise SystemExit(2) from None


def _load(path: str, *, metadata_server: bool = False) -> DisaggConfig:
    try:
        config = load_config(path, metadata_server=metadata_server)
    except ConfigError as err:
        _refuse(err)
    for warning in config_warnings(config):
        print(f"shmdisagg: warning: {path}: {warning}", file=sys.stderr)
    return config


def _check_env() -> TrtllmEnv:
    """TensorRT-LLM's environment variables (`trtllm_env`): exit 2 naming each one that cannot
    be honoured, warn about those that have no effect here."""
    try:
        env = read_env()
    except ConfigError as err:
        _refuse(err)
    for warning in env.warnings:
        print(f"shmdisagg: warning: {warning}", file=sys.stderr)
    return env


def _check_machine(config: DisaggConfig, path: str, executors_here: bool) -> None:
    """`config.check_machine`, exiting 2 with one line per problem naming the key."""
    try:
        check_machine(config, executors_here)
    except ConfigError as err:
        _refuse(err, f"{path}: ")


def _refuse_port_zero(config: DisaggConfig, path: str) -> None:
    """`launch` and `bench --launch` cannot run `port: 0`: only `serve --report_addr` reports
    the port the kernel picks."""
    if config.port == 0:
        print(
            f"shmdisagg: config error: {path}: port: 0 (a port the kernel picks) runs only under "
            "shmdisagg serve --report_addr PATH, which writes the bound host:port to PATH; set a port",
            file=sys.stderr,
        )
        raise SystemExit(2)


def _load_launchable(path: str) -> DisaggConfig:
    """`_load`, then the checks against this machine of a deployment started here."""
    config = _load(path)
    _refuse_port_zero(config, path)
    _check_env()
    _check_machine(config, path, executors_here=config.shmdisagg.executors is not None)
    return config


def cmd_launch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from shmdisagg.config import log_dir_problem
    from shmdisagg.executors.plan import build_plan, describe_plan
    from shmdisagg.launch import Deployment, LaunchError
    from shmdisagg.processes import become_subreaper
    from shmdisagg.tokenizer_source import routing_source

    # A SIGINT or SIGTERM during start-up stops what was started, then exits 128 + its number
    # (Deployment.wait() takes the signals over once the deployment serves).
    _take_stop_signals()
    config = _load(args.config)
    _refuse_port_zero(config, args.config)
    _check_env()
    spec = config.shmdisagg.executors
    log_dir = args.log_dir or (spec.log_dir if spec else None)
    try:
        plan = build_plan(config, Path(log_dir) if log_dir else None)
        routing_source(config)  # the routers' tokenizer settings, without loading one: a dry run checks them too
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
    # the launcher is the deployment's supervisor: the fleet workers a dead coordinator leaves
    # are re-parented here (and reaped by wait()), not to init
    become_subreaper()
    dep = Deployment(config, args.config, args.log_dir, request_timeout=args.request_timeout)
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
        where = f"context: {ctx}; generation: {gen}"
        if config.disagg_cluster is not None:
            where = f"executors register at {config.disagg_cluster.cluster_uri}"
        print(
            f"shmdisagg listening on {dep.url} ({_plural(config.num_workers, 'fleet worker')}; {where}; "
            f"executor logs: {dep.log_dir})",
            flush=True,
        )
        code = dep.wait(reap=True)
    except KeyboardInterrupt:  # SIGINT/SIGTERM that came before wait() took over the handlers
        code = 0
    finally:
        # A second signal must not cut the ordered, bounded stop short; a second SIGINT goes on to
        # the fleet (uvicorn's "CTRL+C to force quit"), from here on as during dep.stop()
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        signal.signal(signal.SIGINT, lambda signum, frame: dep.forward_sigint())
        dep.stop()
        print("shmdisagg stopped", flush=True)
    if code:  # the coordinator ended for good (its restarts kept failing): the launcher stopped the rest
        status = dep.coordinator_exit
        how = f"exit code {status}"
        if status is not None and status > 128 and status - 128 in signal.valid_signals():
            how = f"killed by {signal.Signals(status - 128).name}"
        print(
            f"shmdisagg: the coordinator ended ({how}) and could not be restarted; the deployment is stopped",
            file=sys.stderr,
        )
    return code


def cmd_serve(args: argparse.Namespace) -> int:
    """`shmdisagg serve` / `shmdisagg disaggregated`: TensorRT-LLM's `trtllm-serve disaggregated`
    command line (`tensorrt_llm/commands/serve.py` @fb31828e)."""
    from shmdisagg.coordinator.keeper import run_supervised

    metadata = args.metadata_server_config_file
    if metadata is not None:
        from shmdisagg.cluster.metadata import MetadataConfigError, load_metadata_config

        try:
            load_metadata_config(metadata)
        except MetadataConfigError as err:
            print(f"shmdisagg: -m/--metadata_server_config_file: {err}", file=sys.stderr)
            return 2
    config = _load(args.config, metadata_server=metadata is not None)
    env = _check_env()  # refuses a bad variable, shows the warnings (the coordinator does not repeat them)
    # this process supervises the coordinator (keeper.py): its own lines follow -l as the coordinator's do
    logging.getLogger("shmdisagg").setLevel(
        LOG_LEVELS[resolve_log_level(env, args.log_level, config.shmdisagg.log_level)]
    )
    if args.report_addr is not None and config.num_workers > 1:
        # the same refusal as TensorRT-LLM's (test_disaggregated_rejects_a_worker_fleet, test id 57374853910)
        print(
            "shmdisagg: --report_addr: TensorRT-LLM reports the address of a single self-contained "
            "disaggregated server only; "
            f"{args.config} has num_workers: {config.num_workers}: set num_workers: 1",
            file=sys.stderr,
        )
        return 2
    problem = unwritable(args.report_addr, make_parents=True, replaced=True)  # written once ready: check it now
    if problem:
        print(f"shmdisagg: --report_addr {args.report_addr}: {problem}", file=sys.stderr)
        return 2
    if config.port == 0 and args.report_addr is None:
        print(
            f"shmdisagg: config error: {args.config}: port: 0 (a port the kernel picks) needs --report_addr PATH, "
            "where the bound host:port is written; nothing else would learn the port",
            file=sys.stderr,
        )
        return 2
    _check_machine(config, args.config, executors_here=False)
    from shmdisagg.portuser import public_port_taken

    taken = public_port_taken(config, args.config)
    if taken:  # said as launch and check-config say it: who holds the port
        print(f"shmdisagg: serve failed: {taken}", file=sys.stderr)
        return 1
    argv = ["-c", args.config, "-r", str(args.request_timeout)]
    if args.schedule_style:
        argv += ["-s", args.schedule_style]
    if args.server_start_timeout is not None:
        argv += ["-t", str(args.server_start_timeout)]
    if args.log_level:
        argv += ["-l", args.log_level]
    if args.report_addr is not None:
        argv += ["--report_addr", args.report_addr]
    if metadata is not None:
        argv += ["-m", os.path.abspath(metadata)]
    # --metrics-log-interval: a deprecated no-op in TensorRT-LLM too; accepted, nothing to do
    # this process stays as the deployment's supervisor: it restarts a coordinator that dies
    raise_if_interrupted()  # a Ctrl-C swallowed while the modules loaded: start nothing
    return run_supervised(config, argv, args.report_addr)


def cmd_check_config(args: argparse.Namespace) -> int:
    from shmdisagg.executors.plan import build_plan

    config = _load(args.config)
    _check_env()  # the variables the commands that start a deployment would refuse
    try:  # the launch plan's own checks too (trtllm options, GPUs), as `launch` runs them here
        plan = build_plan(config, None)
    except ConfigError as err:
        print(f"shmdisagg: config error: {args.config}: {err}", file=sys.stderr)
        return 2
    # and the checks against this machine that launch and serve run (addresses, log directory)
    _check_machine(config, args.config, executors_here=config.shmdisagg.executors is not None and not args.serve)
    from shmdisagg.portuser import public_port_user, running_coordinator

    port = public_port_user(config, args.config)  # what launch and serve would refuse right now
    if port is not None and not port.ours:
        print(f"shmdisagg: {args.config}: {port.problem}; launch and serve need it free", file=sys.stderr)
        return 1
    held = running_coordinator(config.shm_prefix) if port is None else None
    if held is not None:  # another deployment (another port) on the same shared-memory prefix
        print(
            f"shmdisagg: {args.config}: shmdisagg.shm.prefix {config.shm_prefix!r} is in use: "
            f"/{config.shm_prefix}-ctl is locked by a running coordinator (pid {held}); launch and serve need it "
            "free (stop that deployment, or give this one another prefix)",
            file=sys.stderr,
        )
        return 1
    busy = []  # what launch, which starts the executors there, would refuse; not while this deployment runs
    if port is None and config.shmdisagg.executors is not None and not args.serve:
        from shmdisagg.launch import address_bind_error

        busy = [inst.addr for inst in plan.instances if address_bind_error(inst.addr) is not None]
    if busy:
        print(
            f"shmdisagg: {args.config}: executor address already in use: {', '.join(busy)}; launch starts the "
            "executors there and needs them free (for serve, with these executors running: check-config --serve)",
            file=sys.stderr,
        )
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

    try:
        prefix = resolve_prefix(args, _load)
    except ValueError as err:
        print(f"shmdisagg stats: {err}", file=sys.stderr)
        return 2
    return run(args, prefix)


def _whole_seconds(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seconds") from None


def _positive_int(text: str) -> int:
    value = _whole_seconds(text)
    if value < 1:  # 0 and a negative number alike: `-t 0` and `-t -1` were worded differently
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return value


def _non_negative_int(text: str) -> int:
    value = _whole_seconds(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return value


def _config_path(text: str) -> str:
    """-c's type: a path, not '' (which the loader read as '.', a directory, and named that)."""
    if not text:
        raise argparse.ArgumentTypeError("needs the path of a config file, not ''")
    return text


class _Parser(argparse.ArgumentParser):
    """The top-level parser: an argument no command knows is reported with that command's usage
    (argparse reports it with the top-level one, `{launch,serve,...}`, which says nothing of the
    command's flags), and a command typed by its alias is named so in its usage and errors
    (`shmdisagg disaggregated`, not `shmdisagg serve`)."""

    commands: dict[str, Any]  # the command parsers (add_subparsers().choices)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        words = list(sys.argv[1:] if args is None else args)
        typed = next((w for w in words if not w.startswith("-")), "")
        if typed in self.commands:  # an alias shares its command's parser: name what was typed
            self.commands[typed].prog = f"{self.prog} {typed}"
        ns, extra = self.parse_known_args(words, namespace)
        if extra:
            command = self.commands.get(getattr(ns, "command", None) or "", self)
            command.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="shmdisagg", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from shmdisagg import __version__

    parser.add_argument("--version", action="version", version=f"shmdisagg {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = sub.choices

    p = sub.add_parser("launch", help="start a single-node deployment")
    p.add_argument("-c", "--config", type=_config_path, required=True)
    p.add_argument(
        "--log-dir",
        help="where executor logs (appended to) and option files go (default: the config's "
        "shmdisagg.executors.log_dir, else the fixed <tmp>/<shm prefix>-logs, e.g. "
        "/tmp/shmdisagg-<uid>-<port>-logs, reused by every launch of that deployment)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (commands, environment, option files, ports, GPUs) and start nothing",
    )
    p.add_argument(
        "-r",
        "--request_timeout",
        type=_non_negative_int,
        default=180,
        metavar="SECONDS",
        help="timeout of each leg, a call to one executor, as serve's -r and TensorRT-LLM's; 0: none "
        "(default 180). The whole request's deadline is shmdisagg.request_timeout_s",
    )
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser(
        "serve",
        aliases=["disaggregated"],
        help="coordinator and fleet for executors already running (trtllm-serve disaggregated)",
        description="The coordinator and fleet for executors already running: TensorRT-LLM's `trtllm-serve "
        "disaggregated` "
        "with its flags. A flag wins over the config's own setting.",
    )
    p.add_argument(
        "-c",
        "--config",
        "--config_file",
        dest="config",
        type=_config_path,
        required=True,
        help="the disaggregated config YAML",
    )
    p.add_argument(
        "-t",
        "--server_start_timeout",
        type=_positive_int,
        metavar="SECONDS",
        help="wait up to this long for every executor's GET /health = 200, else fail (default: "
        "shmdisagg.server_start_timeout_s, 180)",
    )
    p.add_argument(
        "-r",
        "--request_timeout",
        type=_non_negative_int,
        default=180,
        metavar="SECONDS",
        help="timeout of each leg, a call to one executor, as in TensorRT-LLM; 0: none (default 180). "
        "The whole request's deadline is shmdisagg.request_timeout_s",
    )
    p.add_argument(
        "-l",
        "--log_level",
        choices=list(LOG_LEVELS),
        help="TensorRT-LLM's level names (default: shmdisagg.log_level, info; "
        "TLLM_LOG_LEVEL wins over both, as in TensorRT-LLM)",
    )
    p.add_argument(
        "-s",
        "--schedule_style",
        type=str.lower,  # click.Choice(..., case_sensitive=False) in TensorRT-LLM's commands/serve.py
        choices=["context_first", "generation_first"],
        help="overrides the config and TRTLLM_DISAGG_SCHEDULE_STYLE",
    )
    p.add_argument(
        "--metrics-log-interval",
        type=int,
        default=0,
        metavar="SECONDS",
        help="accepted and ignored (deprecated no-op in TensorRT-LLM)",
    )
    p.add_argument(
        "--report_addr",
        metavar="PATH",
        help="write the bound public host:port to PATH once the fleet starts "
        "(with port: 0 the kernel picks the port; num_workers: 1 only, as in TensorRT-LLM)",
    )
    p.add_argument(
        "-m",
        "--metadata_server_config_file",
        metavar="FILE",
        help="the etcd metadata server the executors register in (trtllm/* keys): a YAML of server_type (etcd), "
        "hostname, port, health_check_timeout, refresh_interval; the config then lists no urls",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("check-config", help="validate a config file here (keys, plan, addresses, public port)")
    p.add_argument("-c", "--config", type=_config_path, required=True)
    p.add_argument(
        "--serve",
        action="store_true",
        help="check it as `serve` runs it: its executors run already (a shmdisagg.executors section then only "
        "says what they are), so their addresses need not be free",
    )
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
    finally:
        exit_status_stands()  # the status returned is the command's (an interrupt was handled)


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
