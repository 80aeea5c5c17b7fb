"""The router's ids against TensorRT-LLM's own worker: for each chat of the differential corpus
(and text completions), the ids shmdisagg's router writes into the request equal the
`prompt_token_ids` the worker copy (`shared/trtllm_worker`: upstream `openai_server.py` and
`openai_protocol.py`, a real Hugging Face tokenizer) computes itself for the same request sent
as a `context_only` leg."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from shmdisagg.config import parse_config
from shmdisagg.orchestrator.tokenization import HFTokenizer, prompt_token_ids
from shmdisagg.tokenizer_source import load_routing_tokenizer
from tests.conftest import free_port
from tests.integration.trtllm_worker import WORKER_DIR as WORKER, WORKER_VENV, missing
from tests.unit.routing.test_chat_render import CASES

pytestmark = pytest.mark.skipif(missing() is not None, reason=missing() or "")


@pytest.fixture(scope="module")
def worker(hf_tokenizer_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A context worker serving the test tokenizer (its model name is the directory's basename)."""
    port = free_port()
    env = {
        **os.environ,
        "RUN_DIR": str(tmp_path_factory.mktemp("worker-run")),
        "TOKENIZER_DIR": hf_tokenizer_dir,
        "DETACH": "1",
        "PY": str(WORKER_VENV / "bin" / "python"),
    }
    script = str(WORKER / "run_worker.sh")
    subprocess.run(
        [script, "--port", str(port), "--role", "context", "--allow-request-chat-template"],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        subprocess.run([script, "stop", str(port)], env=env, capture_output=True, timeout=60)


def _context_only(base: str, path: str, body: dict[str, Any]) -> list[int]:
    body = {
        **body,
        "model": "tinytok",
        "max_tokens": 2,
        "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 4242},
    }
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        answer = json.loads(resp.read())
    ids = answer.get("prompt_token_ids") or answer["choices"][0].get("prompt_token_ids")
    assert isinstance(ids, list) and ids, answer
    return ids


@pytest.fixture(scope="module")
def router(hf_tokenizer_dir: str) -> HFTokenizer:
    cfg = parse_config(
        {
            "context_servers": {
                "urls": ["127.0.0.1:9"],
                "router": {"type": "kv_cache_aware", "tokenizer_dir": hf_tokenizer_dir},
            },
            "generation_servers": {"urls": ["127.0.0.1:10"]},
        }
    )
    tok = load_routing_tokenizer(cfg)
    assert isinstance(tok, HFTokenizer)
    return HFTokenizer(tok.tokenizer, tok.model_type, legacy=True)  # TRTLLM_RENDER_LEGACY=1: chat ids are written


@pytest.mark.parametrize("name, req", [(c[0], c[1]) for c in CASES], ids=[c[0] for c in CASES])
def test_the_ids_the_router_writes_for_a_chat_are_the_workers(
    worker: str, router: HFTokenizer, name: str, req: dict[str, Any]
) -> None:
    sent = copy.deepcopy(req)
    ids = asyncio.run(prompt_token_ids(router, sent, True))
    assert sent["prompt_token_ids"] == ids
    assert ids == _context_only(worker, "/v1/chat/completions", req)


@pytest.mark.parametrize("extra", [{}, {"add_special_tokens": False}, {"add_special_tokens": True}])
def test_the_ids_the_router_writes_for_a_completion_are_the_workers(
    worker: str, router: HFTokenizer, extra: dict[str, Any]
) -> None:
    body = {"prompt": "Grüße aus München: the weather is sunny 🙂 today", **extra}
    sent = copy.deepcopy(body)
    ids = asyncio.run(prompt_token_ids(router, sent, False))
    assert sent["prompt"] == ids
    assert ids == _context_only(worker, "/v1/completions", body)


def test_an_echo_completion_is_routed_on_its_ids_and_sent_as_text_which_the_worker_echoes(
    worker: str, router: HFTokenizer
) -> None:
    """The worker echoes a text prompt; with the ids written back instead it answers 400 ("can
    only concatenate list (not "str") to list"), which upstream's router causes."""
    body = {"prompt": "hello world", "echo": True}
    sent = copy.deepcopy(body)
    ids = asyncio.run(prompt_token_ids(router, sent, False))
    assert sent == body and ids == _context_only(worker, "/v1/completions", {"prompt": "hello world"})
    answer = _complete(worker, {**sent, "model": "tinytok", "max_tokens": 2})
    assert answer[0] == 200 and answer[1]["choices"][0]["text"].startswith("hello world"), answer
    refused = _complete(worker, {**sent, "prompt": ids, "model": "tinytok", "max_tokens": 2})
    assert refused[0] == 400 and "concatenate" in refused[1]["message"], refused


def _complete(base: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
