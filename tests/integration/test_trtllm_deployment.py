"""The 8-GPU example end to end through the launcher's `trtllm` backend: the `trtllm-serve` shim
(the simulator's trtllm-serve mode) is first on PATH, so every instance is started, pinned and
configured exactly as on a GPU node, then the coordinator and fleet serve through it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from shmdisagg.executors.sim.testing import get_json
from shmdisagg.launch import Deployment
from tests.fakes.trtllm_shim import EXAMPLE_8GPU, MODEL, localize, put_shim_on_path, write
from tests.integration.harness import deployment, post, request_json, stream_lines, wait_until

COMPLETION = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog " * 8, "max_tokens": 6}
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me about foxes and dogs. " * 6}],
    "max_tokens": 6,
}


def _config(tmp_path: Path, shm_prefix: str, **top: Any) -> Path:
    cfg = localize(yaml.safe_load(EXAMPLE_8GPU.read_text()), tmp_path, shm_prefix)
    cfg.update(top)
    return write(cfg, tmp_path)


@pytest.fixture
def trtllm_deployment(
    tmp_path: Path, shm_prefix: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[Deployment]:
    put_shim_on_path(monkeypatch)
    style = getattr(request, "param", "context_first")
    with deployment(_config(tmp_path, shm_prefix, schedule_style=style)) as dep:
        pids = [c.proc.pid for c in dep.executors]
        yield dep
    assert not [p for p in pids if _alive(p)], "an executor outlived the deployment"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _serves_every_request_shape(dep: Deployment) -> None:
    for chat in (False, True):
        path, body = ("/v1/chat/completions", CHAT) if chat else ("/v1/completions", COMPLETION)
        status, resp = post(dep, path, body)
        assert status == 200, resp
        choice = resp["choices"][0]
        assert choice["message"]["content"] if chat else choice["text"]
        assert resp["usage"]["completion_tokens"] == 6
        assert "disaggregated_params" not in choice or choice["disaggregated_params"] is None
        status, events, headers = stream_lines(
            dep, path, {**body, "stream": True, "stream_options": {"include_usage": True}}
        )
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert events[-1] == b"[DONE]"
        chunks = [orjson.loads(e) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c], chunks
        assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_the_8gpu_example_comes_up_through_trtllm_serve_serves_every_request_shape_and_survives_a_killed_instance(
    trtllm_deployment: Deployment,
) -> None:
    dep = trtllm_deployment
    names = [c.name for c in dep.executors]
    assert names == ["context-0", "context-1", "context-2", "context-3", "generation-0", "generation-1"]
    # each instance runs with its own GPUs and its own option file
    gpus = [_environ(c.proc.pid)["CUDA_VISIBLE_DEVICES"] for c in dep.executors]
    assert gpus == ["0", "1", "2", "3", "4,5", "6,7"]
    cmdline = Path(f"/proc/{dep.executors[4].proc.pid}/cmdline").read_bytes().split(b"\0")
    assert b"serve" in cmdline and cmdline[cmdline.index(b"--tp_size") + 1] == b"2"
    ctx_opts = yaml.safe_load((dep.log_dir / "context-0.yaml").read_text())
    gen_opts = yaml.safe_load((dep.log_dir / "generation-1.yaml").read_text())
    assert ctx_opts["disable_overlap_scheduler"] is True and "disable_overlap_scheduler" not in gen_opts
    assert ctx_opts["cache_transceiver_config"] == gen_opts["cache_transceiver_config"] == {"backend": "NIXL"}
    assert (dep.log_dir / "generation-1.log").read_text().startswith("# ")  # headed by its command line
    # the executors serve what their option files say
    assert dep.plan is not None
    ctx_addr, gen_addr = dep.plan.instances[0].addr, dep.plan.instances[4].addr
    _, info = get_json(ctx_addr, "/server_info")
    assert (info["tokens_per_block"], info["max_batch_size"]) == (32, 16)
    assert info["disaggregated_params"] is not None  # the transceiver is on
    assert get_json(ctx_addr, "/sim/stats")[1]["max_num_tokens"] == 16384  # not in trtllm-serve's /server_info
    _, info = get_json(gen_addr, "/server_info")
    assert info["max_batch_size"] == 256 and get_json(gen_addr, "/sim/stats")[1]["max_num_tokens"] == 8192

    _serves_every_request_shape(dep)

    # KV events flow: the context executors recorded stored blocks (event_buffer_max_size > 0)
    produced = sum(
        get_json(i.addr, "/sim/stats")[1]["events"]["next_event_id"] for i in dep.plan.instances if i.role == "context"
    )
    assert produced > 0

    # killing an instance of each role is survived by the remaining ones
    _kill_one_of_each_role_and_keep_serving(dep)


def _generation_first_available() -> bool:
    try:
        from shmdisagg.orchestrator import flows
    except ImportError:
        return False
    return any(hasattr(v, "generation_first") for v in vars(flows).values() if isinstance(v, type))


# TODO(generation-first): the flow lands with the generation-first work (shmdisagg/orchestrator/flows.py);
# until that module serves it, this test is skipped rather than testing context-first twice.
@pytest.mark.skipif(
    not _generation_first_available(),
    reason="TODO: generation-first flow (shmdisagg/orchestrator/flows.py) not in this tree yet",
)
@pytest.mark.parametrize("trtllm_deployment", ["generation_first"], indirect=True)
def test_generation_first_serves_every_request_shape_through_trtllm_serve(trtllm_deployment: Deployment) -> None:
    _serves_every_request_shape(trtllm_deployment)


def _healthy(dep: Deployment) -> dict[str, bool]:
    status, info = request_json("127.0.0.1", dep.config.port, "GET", "/cluster_info")
    assert status == 200
    return dict(info["healthy"])


def _kill_one_of_each_role_and_keep_serving(dep: Deployment) -> None:
    assert dep.plan is not None
    for role in ("context", "generation"):
        victim = next(c for c in dep.executors if c.name == f"{role}-0")
        addr = next(i.addr for i in dep.plan.instances if i.name == victim.name)
        assert _healthy(dep)[addr] is True
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(timeout=10)
        killed_at = time.monotonic()
        # requests right after the kill are retried on the remaining instances
        for _ in range(4):
            status, resp = post(dep, "/v1/completions", COMPLETION)
            assert status == 200, resp
        # the coordinator notices the refused connections (health polled every 0.2 s here)
        wait_until(lambda: _healthy(dep)[addr] is False, timeout_s=3, what=f"{addr} marked unhealthy")  # noqa: B023 (wait_until polls it before the loop moves on)
        assert time.monotonic() - killed_at < 3
        _serves_every_request_shape(dep)
    healthy = _healthy(dep)
    assert sum(healthy.values()) == 4  # 3 context + 1 generation left
