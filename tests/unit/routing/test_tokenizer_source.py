"""The routing tokenizer is the executors' tokenizer: the simulator's for simulator executors,
else the executors' Hugging Face tokenizer (router `tokenizer_dir`, `model_path`, the `model`
keys), loaded offline; every setting it cannot honour is refused by name, before anything starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from shmdisagg.config import ConfigError, parse_config
from shmdisagg.orchestrator.tokenization import HFTokenizer, SimTokenizer
from shmdisagg.tokenizer_source import load_routing_tokenizer, routing_source
from tests.conftest import free_port
from tests.fakes.trtllm_shim import REPO


def _config(
    ctx_router: dict[str, Any] | None = None, gen_router: dict[str, Any] | None = None, **top: Any
) -> dict[str, Any]:
    return {
        "context_servers": {"urls": ["127.0.0.1:9001"], "router": ctx_router or {"type": "kv_cache_aware"}},
        "generation_servers": {"urls": ["127.0.0.1:9002"], "router": gen_router or {"type": "round_robin"}},
        **top,
    }


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        load_routing_tokenizer(parse_config(data))
    assert "\n" not in str(info.value)
    return str(info.value)


def test_simulator_executors_route_with_the_simulators_tokenizer() -> None:
    cfg = parse_config(_config(shmdisagg={"executors": {"backend": "sim"}}))
    assert isinstance(load_routing_tokenizer(cfg), SimTokenizer)


def test_no_router_that_tokenizes_needs_no_tokenizer() -> None:
    cfg = parse_config(_config({"type": "load_balancing"}, {"type": "conversation"}))
    assert load_routing_tokenizer(cfg) is None


@pytest.mark.parametrize("ctx_router", [{"type": "kv_cache_aware"}, {"type": "conversation", "use_token_ids": True}])
def test_real_executors_without_a_tokenizer_are_refused_naming_the_key(ctx_router: dict[str, Any]) -> None:
    """Before: the simulator's tokenizer, whose ids no real model understands."""
    for extra in ({}, {"shmdisagg": {"executors": {"backend": "trtllm"}}}):
        msg = _error(_config(ctx_router, **extra))
        assert msg.startswith("context_servers.router.tokenizer_dir: ") and "not simulators" in msg
        assert "shmdisagg.executors.backend: sim" in msg  # the way out for `shmdisagg sim` executors


@pytest.mark.parametrize(
    "where", ["tokenizer_dir", "model_path", "section model", "executors model", "top-level model"]
)
def test_the_executors_tokenizer_comes_from_the_first_key_set(hf_tokenizer_dir: str, where: str) -> None:
    router: dict[str, Any] = {"type": "kv_cache_aware"}
    data = _config(router)
    if where in ("tokenizer_dir", "model_path"):
        router[where] = hf_tokenizer_dir
    elif where == "section model":
        data["context_servers"]["model"] = hf_tokenizer_dir
    elif where == "executors model":
        data["shmdisagg"] = {"executors": {"backend": "trtllm", "model": hf_tokenizer_dir}}
    else:
        data["model"] = hf_tokenizer_dir
    source = routing_source(parse_config(data))
    assert source is not None and source.path == hf_tokenizer_dir
    # TensorRT-LLM's router trusts remote code only in an operator-configured tokenizer_dir
    assert source.trust_remote_code == (where == "tokenizer_dir")
    tok = load_routing_tokenizer(parse_config(data))
    assert isinstance(tok, HFTokenizer) and tok.model_type == "llama"
    assert tok.encode_prompt("hello world", {}).ids[0] == tok.tokenizer.bos_token_id


def test_tokenizer_dir_wins_over_the_model(hf_tokenizer_dir: str, tmp_path: Path) -> None:
    data = _config({"type": "kv_cache_aware", "tokenizer_dir": hf_tokenizer_dir}, model=str(tmp_path / "elsewhere"))
    assert routing_source(parse_config(data)).key == "context_servers.router.tokenizer_dir"


@pytest.mark.parametrize(
    "router, expected",
    [
        ({"custom_tokenizer": "deepseek_v32"}, "context_servers.router.custom_tokenizer: "),
        ({"use_harmony": True}, "context_servers.router.use_harmony: "),
    ],
)
def test_settings_the_router_cannot_honour_are_refused_by_name(
    hf_tokenizer_dir: str, router: dict[str, Any], expected: str
) -> None:
    assert _error(_config({"type": "kv_cache_aware", "tokenizer_dir": hf_tokenizer_dir, **router})).startswith(expected)


def test_a_gpt_oss_checkpoint_renders_with_harmony_so_it_is_refused_unless_use_harmony_is_false(
    hf_tokenizer_dir: str, tmp_path: Path
) -> None:
    ckpt = tmp_path / "gpt-oss"
    shutil.copytree(hf_tokenizer_dir, ckpt)
    (ckpt / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    msg = _error(_config({"type": "kv_cache_aware", "tokenizer_dir": str(ckpt)}))
    assert msg.startswith("context_servers.router.use_harmony: ") and "gpt_oss" in msg
    tok = load_routing_tokenizer(
        parse_config(_config({"type": "kv_cache_aware", "tokenizer_dir": str(ckpt), "use_harmony": False}))
    )
    assert isinstance(tok, HFTokenizer) and tok.model_type == "gpt_oss"
    legacy = HFTokenizer(tok.tokenizer, tok.model_type, legacy=True)
    assert legacy.encode_chat({"messages": [{"role": "user", "content": "hi"}]}).write_back is False  # an estimate


def test_simulator_executors_refuse_a_tokenizer_they_would_not_use(hf_tokenizer_dir: str) -> None:
    msg = _error(
        _config(
            {"type": "kv_cache_aware", "tokenizer_dir": hf_tokenizer_dir}, shmdisagg={"executors": {"backend": "sim"}}
        )
    )
    assert msg.startswith("context_servers.router.tokenizer_dir: the executors are simulators")


def test_two_roles_on_different_tokenizers_are_refused(hf_tokenizer_dir: str, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(hf_tokenizer_dir, other)
    msg = _error(
        _config(
            {"type": "kv_cache_aware", "tokenizer_dir": hf_tokenizer_dir},
            {"type": "kv_cache_aware", "tokenizer_dir": str(other)},
        )
    )
    assert msg.startswith("generation_servers.router.tokenizer_dir: ")


@pytest.mark.parametrize("path", ["missing", "empty", "acme/not-in-the-cache"])
def test_a_tokenizer_that_does_not_load_is_a_config_error_naming_the_key(tmp_path: Path, path: str) -> None:
    (tmp_path / "empty").mkdir()
    value = path if "/" in path else str(tmp_path / path)
    msg = _error(_config({"type": "kv_cache_aware", "tokenizer_dir": value}))
    assert msg.startswith(f"context_servers.router.tokenizer_dir: cannot load a Hugging Face tokenizer from {value!r}")


# -- the commands ----------------------------------------------------------------------------------


def _cli_config(tmp_path: Path, shm_prefix: str, router: dict[str, Any], **top: Any) -> Path:
    cfg = {
        "hostname": "127.0.0.1",
        "port": free_port(),
        "context_servers": {"urls": [f"127.0.0.1:{free_port()}"], "router": router},
        "generation_servers": {"urls": [f"127.0.0.1:{free_port()}"]},
        "shmdisagg": {
            "shm": {"prefix": shm_prefix},
            "coordinator_socket": str(tmp_path / "coord.sock"),
            "server_start_timeout_s": 5,
        },
        **top,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shmdisagg.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_check_config_and_serve_refuse_a_bad_tokenizer_in_one_line_before_anything_starts(
    tmp_path: Path, shm_prefix: str
) -> None:
    """Before: check-config said ok, and every fleet worker crash-looped on the ConfigError."""
    path = _cli_config(tmp_path, shm_prefix, {"type": "kv_cache_aware", "tokenizer_dir": str(tmp_path / "nope")})
    for command in ("check-config", "serve"):
        out = _run(command, "-c", str(path))
        assert out.returncode == 2, (command, out)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
        assert lines[0].startswith(
            f"shmdisagg: config error: {path}: context_servers.router.tokenizer_dir: cannot load"
        ), lines
    assert not list(Path("/dev/shm").glob(f"{shm_prefix}*"))  # nothing started


def test_check_config_names_the_key_to_set_for_real_executors(tmp_path: Path, shm_prefix: str) -> None:
    out = _run("check-config", "-c", str(_cli_config(tmp_path, shm_prefix, {"type": "kv_cache_aware"})))
    assert out.returncode == 2 and "context_servers.router.tokenizer_dir: " in out.stderr, out


def test_a_hub_id_in_the_local_cache_loads_offline(tmp_path: Path, shm_prefix: str, hf_tokenizer_dir: str) -> None:
    """The Hugging Face cache layout (models--org--name/refs/main -> snapshots/<rev>/)."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tinytok"
    rev = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(hf_tokenizer_dir, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    path = _cli_config(tmp_path, shm_prefix, {"type": "kv_cache_aware"}, model="acme/tinytok")
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0"}
    out = _run("check-config", "-c", str(path), env=env)
    assert out.returncode == 0 and ": ok" in out.stdout, out
    out = _run("check-config", "-c", str(path), env={**env, "HF_HUB_CACHE": str(tmp_path / "empty-cache")})
    assert out.returncode == 2 and "model: cannot load a Hugging Face tokenizer from 'acme/tinytok'" in out.stderr, out
