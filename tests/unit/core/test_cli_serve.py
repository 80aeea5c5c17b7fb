"""`shmdisagg serve` / `shmdisagg disaggregated` take `trtllm-serve disaggregated`'s flags
(`tensorrt_llm/commands/serve.py`): each has its meaning here, or stops with exit 2 naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shmdisagg.cli import build_parser
from tests.conftest import free_port


def _write(tmp_path: Path, **top: object) -> Path:
    cfg = {
        "hostname": "127.0.0.1",
        "port": free_port(),
        "context_servers": {"urls": [f"127.0.0.1:{free_port()}"]},
        "generation_servers": {"urls": [f"127.0.0.1:{free_port()}"]},
        **top,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmdisagg.cli", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("command", ["serve", "disaggregated"])
def test_the_upstream_command_line_parses_with_its_meaning(command: str) -> None:
    args = build_parser().parse_args(
        [
            command,
            "-c",
            "cfg.yaml",
            "-t",
            "7200",
            "-r",
            "7200",
            "-l",
            "verbose",
            "-s",
            "generation_first",
            "--metrics-log-interval",
            "5",
            "--report_addr",
            "/tmp/a.addr",
        ]
    )
    assert (
        args.config,
        args.server_start_timeout,
        args.request_timeout,
        args.log_level,
        args.schedule_style,
        args.report_addr,
    ) == ("cfg.yaml", 7200, 7200, "verbose", "generation_first", "/tmp/a.addr")
    long = build_parser().parse_args(
        [
            command,
            "--config_file",
            "cfg.yaml",
            "--server_start_timeout",
            "5",
            "--request_timeout",
            "0",
            "--log_level",
            "internal_error",
            "--schedule_style",
            "context_first",
        ]
    )
    assert (long.config, long.server_start_timeout, long.request_timeout, long.log_level) == (
        "cfg.yaml",
        5,
        0,
        "internal_error",
    )
    defaults = build_parser().parse_args([command, "-c", "cfg.yaml"])
    # -r defaults to TensorRT-LLM's 180; -t and -l to the config's own settings
    assert (
        defaults.request_timeout,
        defaults.server_start_timeout,
        defaults.log_level,
        defaults.metadata_server_config_file,
    ) == (180, None, None, None)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["-t", "0"], "argument -t/--server_start_timeout: must be a positive number of seconds"),
        (["-r", "-1"], "argument -r/--request_timeout: must not be negative"),
        (["-r", "1.5"], "argument -r/--request_timeout: '1.5' is not a whole number of seconds"),
        (
            ["-l", "INFO"],
            "argument -l/--log_level: invalid choice: 'INFO'",
        ),  # TensorRT-LLM's click.Choice is case-sensitive too
    ],
)
def test_bad_flag_values_are_usage_errors(tmp_path: Path, flags: list[str], expected: str) -> None:
    out = _serve("disaggregated", "-c", str(_write(tmp_path)), *flags)
    assert out.returncode == 2 and expected in out.stderr, out


def test_a_metadata_server_file_it_cannot_read_or_use_is_one_line(tmp_path: Path) -> None:
    out = _serve("disaggregated", "-c", str(_write(tmp_path)), "-m", str(tmp_path / "etcd.yaml"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"shmdisagg: -m/--metadata_server_config_file: {tmp_path / 'etcd.yaml'}: cannot read: No such file or directory"
    ]
    meta = tmp_path / "meta.yaml"
    meta.write_text("server_type: etcd\nhostname: localhost\nport: 2379\nrefresh: 3\n")
    out = _serve("disaggregated", "-c", str(_write(tmp_path)), "-m", str(meta))
    assert out.returncode == 2
    assert (
        out.stderr.strip().splitlines()[0].startswith(f"shmdisagg: -m/--metadata_server_config_file: {meta}: refresh:")
    )


def test_with_a_metadata_server_the_config_lists_no_urls(tmp_path: Path) -> None:
    meta = tmp_path / "meta.yaml"
    meta.write_text("server_type: etcd\n")
    out = _serve("disaggregated", "-c", str(_write(tmp_path)), "-m", str(meta))
    assert out.returncode == 2
    assert "context_servers.urls: not used with -m/--metadata_server_config_file" in out.stderr


def test_report_addr_is_refused_with_a_fleet_and_port_0_needs_it(tmp_path: Path) -> None:
    path = _write(tmp_path, num_workers=2)
    out = _serve("disaggregated", "-c", str(path), "--report_addr", str(tmp_path / "a.addr"))
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines() == [
        "shmdisagg: --report_addr: TensorRT-LLM reports the address of a single self-contained disaggregated "
        f"server only; {path} has "
        "num_workers: 2: set num_workers: 1"
    ]
    path = _write(tmp_path, port=0)
    out = _serve("disaggregated", "-c", str(path))
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
        f"shmdisagg: config error: {path}: port: 0 (a port the kernel picks) needs --report_addr PATH, where the "
        "bound host:port is "
        "written; nothing else would learn the port"
    ), out
    for command in (["launch"], ["bench", "--launch"]):
        out = _serve(*command, "-c", str(path))
        assert (
            out.returncode == 2
            and "port: 0 (a port the kernel picks) runs only under shmdisagg serve --report_addr PATH" in out.stderr
        ), out
    assert not (tmp_path / "a.addr").exists()


@pytest.mark.parametrize("where", ["a folder", "under a file", "a link", "in /proc", "under /proc", "empty"])
def test_a_report_addr_that_cannot_be_written_is_refused_before_anything_starts(tmp_path: Path, where: str) -> None:
    """It was written once the deployment was ready, and a failure there went unsaid: serve ran,
    and whoever waited for the file waited forever (or, in /proc, where root passes every access
    check, the coordinator failed five times over). A link (or a device) was replaced by the
    address file, since it is written to a temporary file renamed over the path."""
    path = _write(tmp_path, num_workers=1)
    link = tmp_path / "addr.link"
    link.symlink_to(tmp_path / "elsewhere")
    target, why = {
        "a folder": (str(tmp_path), "is a directory"),
        "under a file": (str(path / "server.addr"), f"{path} is not a directory"),
        "a link": (str(link), "is not a regular file (a link or a device would be replaced, not written through)"),
        "in /proc": ("/proc/shmdisagg-test.addr", "cannot write in /proc ("),
        "under /proc": ("/proc/shmdisagg-x/y.addr", "cannot create /proc/shmdisagg-x ("),  # not "in /proc"
        "empty": ("", "an empty path"),
    }[where]
    out = _serve("disaggregated", "-c", str(path), "--report_addr", target)
    assert out.returncode == 2, out
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"shmdisagg: --report_addr {target}: {why}"), line


@pytest.mark.parametrize("command", ["serve", "disaggregated", "launch", "check-config", "stats"])
def test_an_unknown_flag_is_reported_with_the_commands_usage(command: str, tmp_path: Path) -> None:
    """argparse reported it with the top-level usage, `{launch,serve,...}`, not the command's flags."""
    out = _serve(command, "-c", str(_write(tmp_path, num_workers=1)), "--bogus")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == f"shmdisagg {command}: error: unrecognized arguments: --bogus"
    assert f"usage: shmdisagg {command} " in out.stderr


def test_a_bad_flag_value_of_the_alias_names_the_alias(tmp_path: Path) -> None:
    """`shmdisagg disaggregated` (trtllm-serve's word) shares serve's parser: its errors said `shmdisagg serve`."""
    out = _serve("disaggregated", "-c", str(_write(tmp_path, num_workers=1)), "-r", "abc")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "shmdisagg disaggregated: error: argument -r/--request_timeout: 'abc' is not a whole number of seconds"
    )
