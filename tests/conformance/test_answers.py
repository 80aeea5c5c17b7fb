"""Every answer a client gets through shmdisagg equals what TensorRT-LLM's worker returns for the
same request sent to it directly, without disaggregation.

Deployments: 2 context + 2 generation workers (TensorRT-LLM's worker server code over the fake
engine, `tests/conformance/README.md`) behind `shmdisagg serve`, once per router and schedule
style; a fifth worker outside every deployment is the direct reference. The fake engine is
deterministic, so a generation leg continuing from a context leg yields exactly the plain run's
text: everything but `id` and `created` must be equal, `usage` included (each prompt is new to
every worker, so `cached_tokens` is 0 on both sides, whichever leg reports it). No internal
field and no executor address may reach the client (`compare.leaks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conformance.cases import BY_NAME, CASES, CHAT, COMPLETIONS, CORE, FILLER, Case, Req, over_max_seq_len
from tests.conformance.compare import answer_diff, body_diff, leaks
from tests.conformance.conftest import Deployed, Pool, deployed
from tests.conformance.worker_copy import WorkerCopy
from tests.conformance.workers import Answer


def _kv(copy: WorkerCopy) -> dict[str, Any]:
    return {"type": "kv_cache_aware", "tokenizer_dir": str(copy.tokenizer)}


# name -> (top-level config keys for write_config, run every case?)
DEPLOYMENTS: dict[str, tuple[Callable[[WorkerCopy], dict[str, Any]], bool]] = {
    "round_robin": (lambda c: {"routers": ("round_robin", "round_robin")}, True),
    "round_robin-generation_first": (
        lambda c: {"routers": ("round_robin", "round_robin"), "schedule_style": "generation_first"},
        True,
    ),
    "load_balancing": (lambda c: {"routers": ("load_balancing", "load_balancing")}, False),
    "load_balancing-use_tokens": (lambda c: {"routers": ({"type": "load_balancing", "use_tokens": True},) * 2}, False),
    # two fleet workers: the block index and the round-robin tickets are shared between them
    "kv_cache_aware": (lambda c: {"routers": (_kv(c), _kv(c)), "num_workers": 2}, True),
    "kv_cache_aware-generation_first": (
        lambda c: {"routers": (_kv(c), _kv(c)), "schedule_style": "generation_first"},
        True,
    ),
    "conversation": (lambda c: {"routers": ("conversation", "conversation")}, False),
    "conditional_disagg": (
        lambda c: {"routers": ("round_robin", _kv(c)), "conditional_disagg_config": {"max_local_prefill_length": 64}},
        True,
    ),
}


def _deps(full: bool) -> list[Any]:
    return [
        pytest.param(name, marks=pytest.mark.xdist_group(f"conformance-{name}"))
        for name, (_, f) in DEPLOYMENTS.items()
        if f == full
    ]


@pytest.fixture(scope="module")
def dep(
    request: pytest.FixtureRequest, pool: Pool, worker_copy: WorkerCopy, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployed]:
    name = request.param
    top = DEPLOYMENTS[name][0](worker_copy)
    with deployed(name, tmp_path_factory.mktemp(f"dep-{name}"), pool.ctx, pool.gen, **top) as d:
        yield d


def _check(d: Deployed, direct: Answer, via: Answer) -> None:
    problems = leaks(via, d.executor_addrs) + answer_diff(direct, via)
    assert not problems, "via shmdisagg vs direct:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dep", _deps(full=True), indirect=True)
def test_answer_matches_direct(dep: Deployed, case: Case, pool: Pool, worker_copy: WorkerCopy) -> None:
    _run_case(dep, case, pool, worker_copy)


@pytest.mark.parametrize("case", [BY_NAME[n] for n in CORE], ids=lambda c: c.name)
@pytest.mark.parametrize("dep", _deps(full=False), indirect=True)
def test_core_answer_matches_direct(dep: Deployed, case: Case, pool: Pool, worker_copy: WorkerCopy) -> None:
    """The routers that neither tokenize nor change the flow: the cases a router could change."""
    _run_case(dep, case, pool, worker_copy)


def _run_case(dep: Deployed, case: Case, pool: Pool, worker_copy: WorkerCopy) -> None:
    body = case.build(Req(worker_copy.model, pool.probe))
    via = dep.post(case.path, body)
    if case.kind == "refused":
        _check_refused(dep, via, "n")
        return
    direct = pool.reference.post(case.path, body)
    if case.kind == "error":
        _check_relayed_error(dep, direct, via, case.field)
        return
    assert direct.status == 200, direct.raw
    _check(dep, direct, via)


def _check_refused(d: Deployed, via: Answer, param: str) -> None:
    """shmdisagg's documented refusal (README: `n`/`best_of` > 1 get a 400 before anything is
    routed), in TensorRT-LLM's `ErrorResponse` shape with the HTTP status as `code`."""
    assert not leaks(via, d.executor_addrs)
    assert via.status == 400, via.raw
    err = via.json
    assert set(err) == {"object", "message", "type", "param", "code"}, err
    assert (err["object"], err["type"], err["param"], err["code"]) == ("error", "BadRequestError", param, 400), err
    assert isinstance(err["message"], str) and param in err["message"], err


def _check_relayed_error(d: Deployed, direct: Answer, via: Answer, field: str = "bogus_field") -> None:
    """The worker's refusal reaches the client with the worker's status and message."""
    assert direct.status == 400, direct.raw
    problems = leaks(via, d.executor_addrs)
    assert not problems, problems
    assert via.status == direct.status, via.raw
    if direct.json.get("object") == "error":  # an ErrorResponse: relayed as it is
        assert not body_diff(direct.json, via.json), body_diff(direct.json, via.json)
    else:  # FastAPI's validation body {"error": "..."}: the message names the field
        assert field in direct.raw.decode() and field in via.raw.decode(), via.raw


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(
    "dep", [pytest.param("round_robin", marks=pytest.mark.xdist_group("conformance-round_robin"))], indirect=True
)
def test_stream_error_before_first_token(dep: Deployed, path: str, pool: Pool, worker_copy: WorkerCopy) -> None:
    """A streaming request the worker refuses (prompt + max_tokens one over max_seq_len).
    shmdisagg's context leg is not streamed, so the client gets the worker's 400 and message
    before any byte, as TensorRT-LLM's orchestrator relays a context worker's 4xx. (Sent to the
    worker directly, the fake engine raises it inside the stream: completions end with an SSE
    error event carrying the same message, chat streams are cut off, so only the completion is
    compared with the direct answer.)"""
    req = Req(worker_copy.model, pool.probe)
    if path == COMPLETIONS:
        make = lambda n: {"model": req.model, "prompt": req.text(" fox" * n)}  # noqa: E731
    else:
        make = lambda n: {"model": req.model, "messages": req.messages(req.text(" fox" * n))}  # noqa: E731
    body = over_max_seq_len(req, path, make, stream=True)
    via = dep.post(path, body)
    assert not leaks(via, dep.executor_addrs)
    assert via.status == 400, via.raw
    assert "should not exceed max_seq_len (4096)" in via.json["message"], via.raw
    if path == COMPLETIONS:
        direct = pool.reference.post(path, body)
        assert direct.status == 200 and direct.chunks and "error" in direct.chunks[0], direct.raw
        assert via.json["message"] == direct.chunks[0]["error"]["message"], via.raw


REPEATED = ["kv_cache_aware", "conversation", "conditional_disagg"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(
    "dep", [pytest.param(n, marks=pytest.mark.xdist_group(f"conformance-{n}")) for n in REPEATED], indirect=True
)
def test_repeated_prompt_reuses_the_kv_cache(dep: Deployed, path: str, pool: Pool, worker_copy: WorkerCopy) -> None:
    """The same request twice. kv_cache_aware (by its block index) and conversation (by its
    session) send the second one to the context server that holds the prompt, whose cached
    tokens the answer reports (TensorRT-LLM's ctx_usage rule); conditional disaggregation (context
    router round robin, so a second context leg would go to the other, cold, server) serves it
    as a plain request on the generation server that holds it. Either way both answers are the
    direct ones, the second one's `cached_tokens` included."""
    req = Req(worker_copy.model, pool.probe)
    if path == COMPLETIONS:
        body: dict[str, Any] = {"model": req.model, "prompt": req.text(FILLER * 6), "max_tokens": 4}
    else:
        body = {"model": req.model, "messages": req.messages(req.text(FILLER * 6)), "max_tokens": 4}
    direct = [pool.reference.post(path, body) for _ in range(2)]
    via = [dep.post(path, body) for _ in range(2)]
    assert direct[1].json["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, direct[1].raw
    for d, v in zip(direct, via, strict=True):  # the cache first: what this test is about
        assert v.status == 200, v.raw
        assert v.json["usage"] == d.json["usage"], (v.json["usage"], d.json["usage"])
    for d, v in zip(direct, via, strict=True):
        _check(dep, d, v)
