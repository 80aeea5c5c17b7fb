"""Command lines of the simulator; the only place that turns exceptions into exit codes.

    python -m shmdisagg.executors.sim [--host H --port P --role R --profile NAME ...]
    python -m shmdisagg.executors.sim serve MODEL [trtllm-serve options]   (see trtllm_options.py)

The simulator's own flags are derived from `SimConfig`'s fields (`--tokens-per-block` for
`tokens_per_block`; booleans get `--x` / `--no-x`; `faults` is the repeatable `--fault`).
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from dataclasses import MISSING, fields
from typing import Any

from shmdisagg.executors.sim.config import SimConfig
from shmdisagg.executors.sim.errors import ConfigError, RaisingArgumentParser
from shmdisagg.executors.sim.trtllm_options import parse_serve_args

PROG = "python -m shmdisagg.executors.sim"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = RaisingArgumentParser(
        prog=prog,
        description="Executor simulator speaking the trtllm-serve HTTP protocol. "
        "Use 'serve MODEL [trtllm-serve options]' to stand in for trtllm-serve.",
    )
    hints = typing.get_type_hints(SimConfig)
    for f in fields(SimConfig):
        meta = f.metadata
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        kind = _base_type(hints[f.name])
        default = f.default if f.default is not MISSING else None
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta.get("help", "")}
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, **kwargs)
        elif kind is tuple:
            parser.add_argument(flag, action="append", default=[], **kwargs)
        else:
            parser.add_argument(flag, type=kind, default=default, **kwargs)
    return parser


def _base_type(hint: Any) -> type:
    """int | None -> int; tuple[str, ...] -> tuple."""
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    base: type = typing.get_origin(hint) or hint  # hints are Any to mypy; SimConfig's are classes
    return base


def parse_args(argv: list[str], prog: str = PROG) -> SimConfig:
    """`prog` names the command in usage and help (`shmdisagg sim` when run through the CLI)."""
    if argv and argv[0] == "serve":
        return parse_serve_args(argv[1:], prog=f"{prog} serve")
    try:
        ns = build_parser(prog).parse_args(argv)
    except argparse.ArgumentError as exc:
        raise ConfigError(str(exc)) from None
    values = vars(ns)
    values["faults"] = tuple(values["faults"])
    return SimConfig(**values)


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Parse `argv` (default sys.argv[1:]), serve until stopped; returns the exit status.
    `prog` is the command's name in usage, help and errors."""
    try:
        config = parse_args(sys.argv[1:] if argv is None else list(argv), prog)
    except ConfigError as exc:
        print(f"{prog.removeprefix('python -m ')}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help printed its text
        return int(exc.code or 0)
    from shmdisagg.executors.sim.server import serve  # uvicorn is imported only to serve

    return serve(config)
