"""End to end through `shmdisagg launch`'s path with simulated executors, for both schedule
styles: completions and chat, streaming and not, text and token-id prompts."""

from __future__ import annotations

import glob
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from shmdisagg.shm.table import ControlTable
from tests.conftest import free_port
from tests.integration.harness import deployment, post, request_json, stream_lines, write_config

MODEL = "sim-llama-3.1-8b"


@pytest.fixture(scope="module", params=["context_first", "generation_first"])
def sim_deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator:  # type: ignore[type-arg]
    prefix = f"shmdisagg-t{uuid.uuid4().hex[:10]}"
    tmp: Path = tmp_path_factory.mktemp("e2e")
    ctx = [f"127.0.0.1:{free_port()}"]
    gen = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    cfg = write_config(
        tmp,
        prefix,
        ctx,
        gen,
        schedule_style=request.param,
        routers=("load_balancing", "load_balancing"),
        shmdisagg={"executors": {"backend": "sim", "model": MODEL, "sim": {"speedup": 20.0, "num_blocks": 2048}}},
    )
    with deployment(cfg) as dep:
        yield dep
    assert glob.glob(f"/dev/shm/{prefix}*") == []


def _idle(dep) -> bool:  # type: ignore[no-untyped-def]
    with ControlTable.attach(dep.config.shm_prefix) as table:
        return all(table.load(s.slot) == (0, 0) for s in table.servers())


@pytest.mark.parametrize("prompt", ["The quick brown fox jumps over the lazy dog", list(range(1000, 1300))])
def test_completion_non_streaming(sim_deployment, prompt) -> None:  # type: ignore[no-untyped-def]
    dep = sim_deployment
    status, body = post(dep, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 12})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["prompt_tokens"] >= (300 if isinstance(prompt, list) else 5)
    assert _idle(dep)


def test_completion_streaming_with_usage_and_cached_tokens_on_repeat(sim_deployment) -> None:  # type: ignore[no-untyped-def]
    dep = sim_deployment
    prompt = list(range(5000, 5000 + 640))  # 20 blocks of 32 tokens
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usages = []
    for _ in range(3):  # the context leg may land on a different server: repeat until one hits
        status, events, headers = stream_lines(dep, "/v1/completions", body)
        assert status == 200 and events[-1] == b"[DONE]" and "x-disagg-request-id" in headers
        chunks = [orjson.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text
        usages.append(chunks[-1]["usage"])
    assert usages[0]["completion_tokens"] == 8 and usages[0]["prompt_tokens"] == 640
    assert max(u["prompt_tokens_details"]["cached_tokens"] for u in usages[1:]) > 0
    assert _idle(dep)


@pytest.mark.parametrize("stream", [False, True])
def test_chat(sim_deployment, stream: bool) -> None:  # type: ignore[no-untyped-def]
    dep = sim_deployment
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}],
        "max_tokens": 6,
        "stream": stream,
    }
    if stream:
        status, events, _ = stream_lines(dep, "/v1/chat/completions", body)
        assert status == 200 and events[-1] == b"[DONE]"
        content = "".join(
            (orjson.loads(e)["choices"][0]["delta"].get("content") or "")
            for e in events[:-1]
            if orjson.loads(e)["choices"]
        )
    else:
        status, resp = post(dep, "/v1/chat/completions", body)
        assert status == 200, resp
        content = resp["choices"][0]["message"]["content"]
    assert content
    assert _idle(dep)


def test_same_prompt_gives_the_same_text_whatever_server_serves_it(sim_deployment) -> None:  # type: ignore[no-untyped-def]
    dep = sim_deployment
    texts = {
        post(dep, "/v1/completions", {"model": MODEL, "prompt": "determinism please", "max_tokens": 10})[1]["choices"][
            0
        ]["text"]
        for _ in range(4)
    }
    assert len(texts) == 1


def test_server_info_names_the_schedule_style_and_servers(sim_deployment) -> None:  # type: ignore[no-untyped-def]
    dep = sim_deployment
    status, info = request_json("127.0.0.1", dep.config.port, "GET", "/server_info")
    assert status == 200
    assert info["schedule_style"] == dep.config.schedule_style
    assert info["models"] == [MODEL] and info["num_workers"] == 2
    assert info["roles"]["context"]["servers"] == dep.config.context_servers.urls
    assert info["roles"]["generation"]["servers"] == dep.config.generation_servers.urls


@pytest.mark.parametrize("stream", [False, True])
def test_an_echo_completion_and_an_empty_prompt_are_served_as_the_worker_serves_them(
    sim_deployment, stream: bool
) -> None:  # type: ignore[no-untyped-def]
    """The simulator follows TensorRT-LLM's worker (tests/conformance cmpl-echo*, cmpl-empty-*):
    echo prepends the prompt's text; an empty text is served with its BOS as the prompt."""
    dep = sim_deployment
    for prompt, echo in (("Once upon a time", True), ("", False)):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "echo": echo}
        if stream:
            status, events, _ = stream_lines(dep, "/v1/completions", {**body, "stream": True})
            assert status == 200 and events[-1] == b"[DONE]", events
            text = "".join(c["choices"][0]["text"] for c in map(orjson.loads, events[:-1]) if c["choices"])
        else:
            status, answer = post(dep, "/v1/completions", body)
            assert status == 200, answer
            text = answer["choices"][0]["text"]
        assert text.startswith(prompt) and len(text) > len(prompt), text
    assert _idle(dep)
