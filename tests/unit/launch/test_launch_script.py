"""`scripts/launch_single_node.sh` writes a config with its documented defaults and hands it to
`shmdisagg launch` (here with --dry-run, passed through)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from shmdisagg.config import load_config
from tests.fakes.trtllm_shim import REPO

SCRIPT = REPO / "scripts" / "launch_single_node.sh"


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(
        [str(SCRIPT), "--config-out", str(tmp_path / "node.yaml"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )


def test_defaults_are_4_context_at_tp1_and_2_generation_at_tp2_on_8_gpus(tmp_path: Path) -> None:
    proc = run(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    cfg = load_config(tmp_path / "node.yaml")
    raw = yaml.safe_load((tmp_path / "node.yaml").read_text())
    assert (cfg.context_servers.num_instances, cfg.generation_servers.num_instances) == (4, 2)
    assert (raw["context_servers"]["tensor_parallel_size"], raw["generation_servers"]["tensor_parallel_size"]) == (1, 2)
    assert cfg.port == 8000 and cfg.num_workers == 8
    assert [p for _, p in cfg.context_servers.addresses() + cfg.generation_servers.addresses()] == list(
        range(8001, 8007)
    )
    commands = [line.strip() for line in proc.stdout.splitlines() if line.strip().startswith("$ ")]
    assert [c.split()[1] for c in commands] == [f"CUDA_VISIBLE_DEVICES={g}" for g in ("0", "1", "2", "3", "4,5", "6,7")]
    assert "nothing started" in proc.stdout


def test_options_change_the_generated_config(tmp_path: Path) -> None:
    proc = run(
        tmp_path,
        "--dry-run",
        "--ctx",
        "2",
        "--gen",
        "1",
        "--gen-tp",
        "4",
        "--gpus",
        "7,6,5,4,3,2",
        "--transceiver",
        "UCX",
        "--port",
        "9000",
        "--model",
        "Qwen/Qwen2.5-7B-Instruct",
    )
    assert proc.returncode == 0, proc.stderr
    commands = [line.strip() for line in proc.stdout.splitlines() if line.strip().startswith("$ ")]
    assert [c.split()[1] for c in commands] == [
        "CUDA_VISIBLE_DEVICES=7",
        "CUDA_VISIBLE_DEVICES=6",
        "CUDA_VISIBLE_DEVICES=5,4,3,2",
    ]
    assert "Qwen/Qwen2.5-7B-Instruct --host 127.0.0.1 --port 9003" in commands[2]
    assert proc.stdout.count("backend: UCX") == 3


def test_gpus_that_do_not_add_up_stop_the_script_with_exit_2(tmp_path: Path) -> None:
    proc = run(tmp_path, "--dry-run", "--gpus", "0,1,2")
    assert proc.returncode == 2
    assert "shmdisagg.executors.gpus: lists 3 GPUs but the instances need 8" in proc.stderr


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    assert run(tmp_path, "--ctx", "x").returncode == 2
    assert run(tmp_path, "--frobnicate").returncode == 2


def test_a_dry_run_writes_nothing_and_shows_the_config_a_launch_would_write(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp))
    proc = subprocess.run(
        [str(SCRIPT), "--dry-run", "--port", "9123"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert list(tmp.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]  # nothing written
    would_be = f"{tmp}/shmdisagg-{os.getuid()}-single-node-9123.yaml"
    assert f"the config a launch writes to {would_be} (dry run: not written)" in proc.stdout
    assert "port: 9123" in proc.stdout and "backend: trtllm" in proc.stdout  # the config itself
    assert f"shmdisagg launch plan for {would_be} (dry run: nothing started, nothing written)" in proc.stdout
    assert f"-c {would_be}" in proc.stdout and "/dev/stdin" not in proc.stdout + proc.stderr
    assert "config written" not in proc.stderr


def test_a_dry_run_with_config_out_writes_that_file_and_says_so(tmp_path: Path) -> None:
    proc = run(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert f"dry run: config written to {tmp_path / 'node.yaml'} (--config-out); nothing else is written" in proc.stderr
    assert (tmp_path / "node.yaml").exists()


def test_a_failing_dry_run_names_the_config_a_launch_would_write(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [str(SCRIPT), "--dry-run", "--gpus", "0"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
    )
    assert proc.returncode == 2
    assert (
        f"config error: {tmp_path}/shmdisagg-{os.getuid()}-single-node-8000.yaml: shmdisagg.executors.gpus"
        in proc.stderr
    )
    assert list(tmp_path.iterdir()) == []


def test_help_names_the_real_default_log_directory() -> None:
    proc = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "new temporary directory" not in proc.stdout
    assert (
        "--log-dir DIR           executor logs and option files (default ${TMPDIR:-/tmp}/shmdisagg-<uid>-<port>-logs,"
        in proc.stdout
    )
