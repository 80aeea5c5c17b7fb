"""Config files a new user got wrong: each is refused before anything starts, with exit code 2
and one line naming the key (never a traceback), by check-config as by the commands that would
fail on it, and the checks against this machine (addresses, log directory) agree with launch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from shmdisagg.config import ConfigError, load_config, parse_config
from tests.conftest import free_port
from tests.fakes.trtllm_shim import REPO, small_config

NOT_HERE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never an address of this machine
NO_SUCH_HOST = "no-such-host.invalid"  # .invalid never resolves (RFC 6761)


def _config(tmp_path: Path, shm_prefix: str, **top: Any) -> dict[str, Any]:
    return {
        "hostname": "127.0.0.1",
        "port": free_port(),
        "num_workers": 2,
        "context_servers": {"urls": [f"127.0.0.1:{free_port()}"]},
        "generation_servers": {"urls": [f"127.0.0.1:{free_port()}"]},
        "shmdisagg": {
            "executors": {"backend": "sim", "startup_timeout_s": 30},
            "shm": {"prefix": shm_prefix},
            "coordinator_socket": str(tmp_path / "coord.sock"),
            "server_start_timeout_s": 5,
        },
        **top,
    }


def _write(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shmdisagg.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def _one_line(out: subprocess.CompletedProcess[str], code: int = 2) -> str:
    assert out.returncode == code, out
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def _refused_alike(path: Path, key_and_problem: str) -> None:
    """check-config and launch both refuse `path` in the one line naming `key_and_problem`."""
    for command in ("check-config", "launch"):
        line = _one_line(_run(command, "-c", str(path)))
        assert line == f"shmdisagg: config error: {path}: {key_and_problem}", (command, line)


# -- file encoding and duplicate keys -------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [["check-config"], ["launch"], ["launch", "--dry-run"], ["serve"], ["stats", "--once"], ["bench", "--launch"]],
    ids=lambda a: " ".join(a),
)
def test_a_config_that_is_not_utf8_is_one_line_and_exit_2_in_every_command(
    tmp_path: Path, shm_prefix: str, args: list[str]
) -> None:
    """A Latin-1 `# café` comment: before, a UnicodeDecodeError traceback in all of them."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes("# café\n".encode("latin-1") + yaml.safe_dump(_config(tmp_path, shm_prefix)).encode())
    line = _one_line(_run(*args, "-c", str(path)))
    assert (
        line
        == f"shmdisagg: config error: {path}: line 1 not UTF-8 text (byte 0xe9 at column 6); save the file as UTF-8"
    )


def test_utf8_with_or_without_a_byte_order_mark_loads(tmp_path: Path, shm_prefix: str) -> None:
    text = "# café, naïve\n" + yaml.safe_dump(_config(tmp_path, shm_prefix))
    for name, raw in (("plain.yaml", text.encode()), ("bom.yaml", b"\xef\xbb\xbf" + text.encode())):
        (tmp_path / name).write_bytes(raw)
        assert load_config(tmp_path / name).num_workers == 2


DUPLICATES = [
    ("port: 1\nport: 2\n", "port: listed twice (lines 1 and 2)"),
    (
        "generation_servers:\n  urls: ['a:1']\n  router: {type: load_balancing}\n  router: {type: round_robin}\n",
        "generation_servers.router: listed twice (lines 3 and 4)",
    ),
    (
        "context_servers:\n  urls: ['a:1']\n  kv_cache_config:\n    tokens_per_block: 32\n    tokens_per_block: 64\n",
        "context_servers.kv_cache_config.tokens_per_block: listed twice (lines 4 and 5)",
    ),
    (
        "shmdisagg:\n  executors:\n    trtllm:\n      env: {A: '1', A: '2'}\n",
        "shmdisagg.executors.trtllm.env.A: listed twice (lines 4 and 4)",
    ),
    ("x:\n  - {k: 1}\n  - {k: 1, k: 2}\n", "x.1.k: listed twice (lines 3 and 3)"),
]


@pytest.mark.parametrize(("text", "expected"), DUPLICATES)
def test_a_key_listed_twice_is_refused_naming_it(tmp_path: Path, text: str, expected: str) -> None:
    """PyYAML's safe_load (what TensorRT-LLM reads the file with) keeps the last of the two
    silently: a deployment then runs with a router or block size nobody meant."""
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: {expected}; keys must be unique") and "\n" not in msg, msg


def test_a_duplicate_key_stops_check_config_and_launch_in_one_line(tmp_path: Path, shm_prefix: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path, shm_prefix)) + "num_workers: 4\n")
    for command in ("check-config", "launch"):
        line = _one_line(_run(command, "-c", str(path)))
        assert line.startswith(f"shmdisagg: config error: {path}: num_workers: listed twice (lines "), line


def test_keys_merged_in_with_an_anchor_may_be_overridden(tmp_path: Path) -> None:
    """`<<: *common` then a key of its own is how YAML overrides a shared block: not a duplicate."""
    path = tmp_path / "anchors.yaml"
    path.write_text(
        "common: &common {max_batch_size: 8, kv_cache_config: {tokens_per_block: 32}}\n"
        "context_servers:\n  <<: *common\n  urls: ['127.0.0.1:9701']\n  max_batch_size: 16\n"
        "generation_servers:\n  <<: *common\n  urls: ['127.0.0.1:9702']\n"
    )
    cfg = load_config(path)
    assert (cfg.context_servers.max_batch_size, cfg.generation_servers.max_batch_size) == (16, 8)


# -- the model -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d["shmdisagg"]["executors"].update(model=""), "shmdisagg.executors.model: must not be empty"),
        (lambda d: d["shmdisagg"]["executors"].update(model="  "), "shmdisagg.executors.model: must not be empty"),
        (lambda d: d.update(model=""), "model: must be a non-empty string"),
        (lambda d: d.update(model=5), "model: must be a non-empty string"),
    ],
)
def test_an_empty_model_is_refused(tmp_path: Path, shm_prefix: str, edit, expected: str) -> None:
    """Before: `model: ""` loaded, and the simulator quietly served its profile's model name."""
    data = _config(tmp_path, shm_prefix)
    edit(data)
    with pytest.raises(ConfigError, match=f"^cfg.yaml: {expected}"):
        parse_config(data, "cfg.yaml")


# -- the log directory -----------------------------------------------------------------------------


def test_a_configured_log_dir_that_is_a_file_is_refused_by_check_config_and_launch(
    tmp_path: Path, shm_prefix: str
) -> None:
    """Before: check-config said ok, launch died with a FileExistsError traceback."""
    afile = tmp_path / "afile"
    afile.write_text("")
    cfg = _config(tmp_path, shm_prefix)
    cfg["shmdisagg"]["executors"]["log_dir"] = str(afile)
    path = _write(tmp_path, cfg)
    _refused_alike(path, f"shmdisagg.executors.log_dir: {afile} exists and is not a directory")


@pytest.mark.parametrize(
    ("command", "why"),
    [
        ("no-such-trtllm-serve-{uid}", "'no-such-trtllm-serve-{uid}' not found on PATH"),
        ("{tmp}/missing/trtllm-serve", "'{tmp}/missing/trtllm-serve' not found"),
        ("{tmp}/not-executable", "'{tmp}/not-executable' is not executable"),
        ("{tmp}", "'{tmp}' is a directory"),
    ],
)
def test_a_trtllm_command_that_cannot_run_here_is_refused_by_check_config_and_launch(
    tmp_path: Path, shm_prefix: str, command: str, why: str
) -> None:
    """Before: check-config said ok, and only launch found out (`context-0: cannot run ...`)."""
    (tmp_path / "not-executable").write_text("#!/bin/sh\n")
    subs = {"tmp": str(tmp_path), "uid": shm_prefix}
    cfg = small_config(executors={"trtllm": {"command": [command.format(**subs)]}})  # the trtllm plan takes it
    cfg["shmdisagg"].update(shm={"prefix": shm_prefix}, coordinator_socket=str(tmp_path / "coord.sock"))
    path = _write(tmp_path, cfg)
    _refused_alike(path, f"shmdisagg.executors.trtllm.command: {why.format(**subs)}; launch runs it on this machine")
    # serve starts no executor: the command is not its business
    assert "trtllm.command" not in _run("check-config", "--serve", "-c", str(path)).stderr


def test_a_log_dir_option_that_is_a_file_is_refused_before_anything_starts(tmp_path: Path, shm_prefix: str) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    path = _write(tmp_path, _config(tmp_path, shm_prefix))
    line = _one_line(_run("launch", "-c", str(path), "--log-dir", str(afile / "logs")))
    assert line == f"shmdisagg: --log-dir: cannot create {afile / 'logs'}: {afile} is not a directory"


def test_a_log_dir_the_kernel_will_not_create_is_refused_before_anything_starts(
    tmp_path: Path, shm_prefix: str
) -> None:
    """/proc refuses new directories even to root, whose access() checks pass: the check asks
    the kernel (a probe directory made and removed), so check-config refuses the configured one
    and launch the option, exit 2 and one line naming it, instead of 'ok' and a failure later."""
    path = _write(tmp_path, _config(tmp_path, shm_prefix))
    line = _one_line(_run("launch", "-c", str(path), "--log-dir", "/proc/nope"))
    assert (
        line
        == "shmdisagg: --log-dir: cannot create /proc/nope: /proc refuses new directories (No such file or directory)"
    )
    cfg = _config(tmp_path, shm_prefix)
    cfg["shmdisagg"]["executors"]["log_dir"] = "/proc/nope"
    path = _write(tmp_path, cfg)
    _refused_alike(
        path,
        "shmdisagg.executors.log_dir: cannot create /proc/nope: /proc refuses new directories "
        "(No such file or directory)",
    )


def test_the_launcher_names_an_unusable_log_directory_and_starts_nothing(tmp_path: Path, shm_prefix: str) -> None:
    """Through the library (bench --launch, tests): the default directory, taken by a file."""
    from shmdisagg.launch import Deployment, LaunchError

    afile = tmp_path / "afile"
    afile.write_text("")
    path = _write(tmp_path, _config(tmp_path, shm_prefix))
    dep = Deployment(load_config(path), str(path), str(afile))
    with pytest.raises(
        LaunchError, match=rf"^log directory {afile} \(--log-dir\): {afile} exists and is not a directory$"
    ):
        dep.start()
    assert dep.executors == [] and dep.coordinator is None


# -- addresses -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d.update(hostname=NO_SUCH_HOST), f"hostname: cannot resolve '{NO_SUCH_HOST}'"),
        (
            lambda d: d.update(hostname=NOT_HERE),
            f"hostname: '{NOT_HERE}' is not an address of this machine; the fleet listens there",
        ),
        (
            lambda d: d["context_servers"].update(urls=[f"{NO_SUCH_HOST}:9611"]),
            f"context_servers.urls: '{NO_SUCH_HOST}:9611': cannot resolve '{NO_SUCH_HOST}'",
        ),
        (
            lambda d: d["generation_servers"].update(urls=[f"{NOT_HERE}:9162"]),
            f"generation_servers.urls: '{NOT_HERE}:9162': '{NOT_HERE}' is not an address of this machine; "
            "shmdisagg launch starts its executors on this machine",
        ),
    ],
)
def test_check_config_and_launch_refuse_addresses_this_machine_cannot_use(
    tmp_path: Path, shm_prefix: str, edit, expected: str
) -> None:
    """Before: check-config said ok; launch failed with exit 1 ("cannot resolve", or for an
    address of another machine "already in use ... is another deployment running?")."""
    data = _config(tmp_path, shm_prefix)
    edit(data)
    path = _write(tmp_path, data)
    for command in ("check-config", "launch"):
        line = _one_line(_run(command, "-c", str(path)))
        assert line.startswith(f"shmdisagg: config error: {path}: {expected}"), (command, line)
    assert not (tmp_path / "coord.sock").exists()


def test_serve_refuses_unresolvable_hosts_but_takes_executors_on_other_machines(
    tmp_path: Path, shm_prefix: str
) -> None:
    data = _config(tmp_path, shm_prefix)
    del data["shmdisagg"]["executors"]
    data["context_servers"]["urls"] = [f"{NO_SUCH_HOST}:9611"]
    line = _one_line(_run("serve", "-c", str(_write(tmp_path, data))))
    assert line.startswith(
        f"shmdisagg: config error: {tmp_path / 'cfg.yaml'}: context_servers.urls: '{NO_SUCH_HOST}:9611': cannot resolve"
    ), line
    data["context_servers"]["urls"] = [f"{NOT_HERE}:9611"]  # serve runs no executor: elsewhere is fine
    out = _run("check-config", "-c", str(_write(tmp_path, data)))
    assert out.returncode == 0, out


def test_the_launcher_says_an_executor_address_is_not_on_this_machine(tmp_path: Path, shm_prefix: str) -> None:
    """Through the library: EADDRNOTAVAIL is not "already in use (is another deployment running?)"."""
    from shmdisagg.launch import Deployment, LaunchError

    data = _config(tmp_path, shm_prefix)
    data["context_servers"]["urls"] = [f"{NOT_HERE}:9611"]
    path = _write(tmp_path, data)
    dep = Deployment(load_config(path), str(path), str(tmp_path / "logs"))
    with pytest.raises(
        LaunchError, match=rf"^executor address not on this machine: {NOT_HERE}:9611 \(launch starts the executors here"
    ):
        dep.start()
    assert dep.executors == [] and not (tmp_path / "logs").exists()


# -- plurals ---------------------------------------------------------------------------------------


def test_check_config_counts_one_of_a_kind_in_the_singular(tmp_path: Path, shm_prefix: str) -> None:
    path = _write(tmp_path, _config(tmp_path, shm_prefix, num_workers=1))
    out = _run("check-config", "-c", str(path))
    assert out.returncode == 0, out
    assert "1 context and 1 generation server, 1 fleet worker, " in out.stdout, out.stdout
