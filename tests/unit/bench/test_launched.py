"""`shmdisagg bench --launch` options: --port moves a deployment, and needs --launch."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shmdisagg.bench.launched import shift_ports
from shmdisagg.cli import main

REPO = Path(__file__).resolve().parents[3]


def test_port_moves_the_public_port_and_every_executor_by_the_same_offset() -> None:
    raw = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    moved = shift_ports(raw, 9400)
    assert moved["port"] == 9400
    assert moved["context_servers"]["urls"] == ["127.0.0.1:9501", "127.0.0.1:9502"]
    assert moved["generation_servers"]["urls"] == ["127.0.0.1:9601", "127.0.0.1:9602"]
    assert (
        moved["shmdisagg"] == raw["shmdisagg"]
        and moved["context_servers"]["router"] == raw["context_servers"]["router"]
    )
    assert raw["port"] == 8000 and raw["context_servers"]["urls"][0] == "127.0.0.1:8101"  # the original is untouched


def test_port_that_pushes_an_executor_past_65535_is_refused() -> None:
    raw = {
        "port": 8000,
        "context_servers": {"urls": ["127.0.0.1:8101"]},
        "generation_servers": {"urls": ["[::1]:8201"]},
    }
    assert shift_ports(raw, 9000)["generation_servers"]["urls"] == ["[::1]:9201"]
    with pytest.raises(ValueError, match="outside 1..65535"):
        shift_ports(raw, 65500)


def test_port_without_launch_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--port", "9400", "--num-requests", "1"]) == 2
    assert "--port moves a deployment started with --launch" in capsys.readouterr().err


def test_a_moved_config_that_does_not_fit_exits_2_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--launch", "-c", str(REPO / "examples" / "demo.yaml"), "--port", "65500"]) == 2
    err = capsys.readouterr().err
    assert "--port 65500 moves context_servers url 127.0.0.1:8101 to port 65601" in err and "Traceback" not in err


def test_a_bad_option_with_launch_exits_2_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad --num-requests is refused before the deployment starts (it was refused after a
    whole start and stop), so the config's executors are never started: nothing is logged."""
    raw = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    raw["shmdisagg"]["executors"]["log_dir"] = str(tmp_path / "logs")
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["bench", "--launch", "-c", str(path), "--num-requests", "0"]) == 2
    err = capsys.readouterr().err
    assert "error: --num-requests must be >= 1" in err and "launching" not in err
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["-c", "examples/demo.yaml"], "-c/--config is the config of the deployment --launch starts"),
        (
            ["--launch", "-c", "examples/demo.yaml", "--url", "http://127.0.0.1:9"],
            "--url and --launch are alternatives",
        ),
        (["--launch", "-c", "examples/demo.yaml", "--plot-only", "--plot", "/tmp"], "--plot-only draws earlier runs"),
    ],
)
def test_an_option_the_mode_would_ignore_is_a_usage_error(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`-c` without `--launch` benched --url's server, and `--url` with `--launch` the launched
    deployment, each silently ignoring the other option."""
    assert main(["bench", *argv, "--num-requests", "1"]) == 2
    err = capsys.readouterr().err
    assert says in err and "launching" not in err and "Traceback" not in err
