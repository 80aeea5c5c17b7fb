"""`shmdisagg launch --dry-run` prints the whole plan and starts nothing; a plan that cannot work
stops `shmdisagg launch` with exit code 2 and one line naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shmdisagg.cli import main
from tests.fakes.trtllm_shim import EXAMPLE_8GPU, REPO, small_config


def test_the_8gpu_example_dry_run_prints_every_instance_and_writes_nothing(tmp_path: Path) -> None:
    log_dir = tmp_path / "never"
    proc = subprocess.run(
        [sys.executable, "-m", "shmdisagg.cli", "launch", "-c", str(EXAMPLE_8GPU), "--dry-run",
         "--log-dir", str(log_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    commands = [line.strip() for line in out.splitlines() if line.strip().startswith("$ ")]
    assert [c.split()[1] for c in commands] == [f"CUDA_VISIBLE_DEVICES={g}" for g in ("0", "1", "2", "3", "4,5", "6,7")]
    assert all(" trtllm-serve meta-llama/Llama-3.1-8B-Instruct --host 127.0.0.1 --port " in c for c in commands)
    assert f"--extra_llm_api_options {log_dir}/generation-1.yaml" in commands[5]
    assert "--tp_size 2" in commands[5] and "--tp_size 1" in commands[0]
    assert out.count("disable_overlap_scheduler: true") == 4  # context instances only
    assert out.count("event_buffer_max_size: 4096") == 6
    assert out.count("backend: NIXL") == 6
    assert "GPUs: 0, 1, 2, 3, 4, 5, 6, 7" in out
    assert "coordinator + 8 fleet workers on 0.0.0.0:8000" in out
    assert not log_dir.exists()


def _write(tmp_path: Path, cfg: dict) -> str:  # type: ignore[type-arg]
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_missing_transceiver_backend_exits_2_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dry_run: bool
) -> None:
    cfg = small_config()
    del cfg["generation_servers"]["cache_transceiver_config"]
    path = _write(tmp_path, cfg)
    assert main(["launch", "-c", path, *(["--dry-run"] if dry_run else [])]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith(
        f"shmdisagg: config error: {path}: generation_servers.cache_transceiver_config.backend: not set"
    )


def test_a_dry_run_refuses_the_routers_tokenizer_settings_as_launch_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A simulated deployment tokenizes with the simulator's tokenizer: a tokenizer_dir is refused
    by launch and check-config; --dry-run printed the plan and exited 0."""
    cfg = small_config(executors={"backend": "sim"})
    cfg["context_servers"]["router"] = {"type": "kv_cache_aware", "tokenizer_dir": "/nonexistent"}
    path = _write(tmp_path, cfg)
    assert main(["launch", "-c", path, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"shmdisagg: config error: {path}: context_servers.router.tokenizer_dir: the executors are")


def test_gpus_that_do_not_add_up_exit_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, small_config(executors={"gpus": [0, 1, 2]}))
    assert main(["launch", "-c", path, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "shmdisagg.executors.gpus: lists 3 GPUs but the instances need 2 (1 context x 1 + 1 generation x 1)" in err


def test_overlapping_gpus_exit_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, small_config(executors={"gpus": [3, 3]}))
    with pytest.raises(SystemExit) as info:
        main(["launch", "-c", path, "--dry-run"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "shmdisagg.executors.gpus: GPU 3 is listed twice" in err


def test_launch_help_names_the_log_dir_a_launch_really_uses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import os
    import tempfile

    from shmdisagg.config import load_config
    from shmdisagg.launch import Deployment

    with pytest.raises(SystemExit) as exit_:
        main(["launch", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "temporary directory" not in text
    assert "/tmp/shmdisagg-<uid>-<port>-logs, reused by every launch" in text

    cfg = small_config()
    cfg["port"] = 8123
    path = _write(tmp_path, cfg)
    dep = Deployment(load_config(path), path)  # not started: only where its logs would go
    assert dep.log_dir == Path(tempfile.gettempdir()) / f"shmdisagg-{os.getuid()}-8123-logs"
