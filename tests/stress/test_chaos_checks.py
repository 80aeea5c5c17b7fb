"""The chaos suite's judges on their own (no deployment): each way an answer can break is
classified as such, and a cut is forgiven only on a connection a killed process may have held."""

from __future__ import annotations

import httptools
import orjson
import pytest

from tests.stress.chaos.checks import Rules, judge
from tests.stress.chaos.client import COMPLETE, CUT, ERROR, MALFORMED, Exchange, Outcome, classify
from tests.stress.chaos.deploy import Fault

pytestmark = pytest.mark.chaos

ERR = {
    "object": "error",
    "message": "no healthy generation server",
    "type": "ServiceUnavailableError",
    "param": None,
    "code": 503,
}


def _feed(raw: bytes) -> Exchange:
    ex = Exchange()
    parser = httptools.HttpResponseParser(ex)
    ex.received = len(raw)
    parser.feed_data(raw)
    if ex.head:
        ex.status = parser.get_status_code()
    return ex


def _http(status: int, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (status, ctype, len(body), body)


def _sse(*events: bytes, done: bool = True) -> bytes:
    body = b"".join(b"data: " + e + b"\n\n" for e in events) + (b"data: [DONE]\n\n" if done else b"")
    chunked = b"%x\r\n%s\r\n" % (len(body), body) + (b"0\r\n\r\n" if done else b"")
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + chunked


CHUNK = orjson.dumps({"choices": [{"index": 0, "text": " hi"}]})


@pytest.mark.parametrize(("stream", "raw", "kind"), [
    (False, _http(200, orjson.dumps({"choices": [{"text": "x"}]})), COMPLETE),
    (False, _http(503, orjson.dumps(ERR)), ERROR),
    (False, _http(200, b"{not json"), MALFORMED),
    (False, _http(200, orjson.dumps({"choices": []})), MALFORMED),
    (False, _http(500, b"Internal Server Error", b"text/plain"), MALFORMED),  # not the OpenAI error body
    (False, _http(502, orjson.dumps({**ERR, "code": 503})), MALFORMED),  # code is not the status
    # the fleet's catch-all
    (False, _http(500, orjson.dumps({**ERR, "code": 500, "message": "internal error"})), MALFORMED),
    (True, _sse(CHUNK, CHUNK), COMPLETE),
    (True, _sse(CHUNK, orjson.dumps({"error": {**ERR, "code": 504}})), ERROR),
    (True, _sse(orjson.dumps({"error": ERR}), CHUNK), MALFORMED),  # chunks after the error event
    (True, _sse(CHUNK, done=False), CUT),  # no [DONE], no error event
    (True, _sse(CHUNK, b"[DONE]"), MALFORMED),  # [DONE] twice
    (True, _http(200, orjson.dumps({"choices": [{"text": "x"}]})), MALFORMED),  # a stream answered as JSON
    (False, b"HTTP/1.1 200 OK\r\ncontent-le", CUT),
    (False, b"", CUT),
])  # fmt: skip
def test_each_way_an_answer_ends_is_classified(stream: bool, raw: bytes, kind: str) -> None:
    assert classify(stream, _feed(raw))[0] == kind


def test_a_cut_is_forgiven_only_on_a_connection_the_killed_process_may_have_held() -> None:
    kill = Fault("worker SIGKILL", "1", at=10.0, done=10.01)

    def cut(opened: float, ended: float) -> Outcome:
        return Outcome(CUT, conn_opened=opened, started=opened, ended=ended)

    rules = Rules(cut_by=("worker SIGKILL",))
    tally = judge([cut(9.0, 10.005), cut(10.005, 10.02), cut(10.5, 10.6), cut(5.0, 9.5), cut(9.0, 20.0)], [kill], rules)
    assert tally.forgiven_cuts == 2 and len(tally.violations) == 3
    assert judge([cut(9.0, 10.005)], [kill], Rules()).violations  # no kill forgives it elsewhere


def test_an_error_status_is_clean_only_where_the_scenario_allows_it() -> None:
    out = Outcome(ERROR, status=504, user="u0")
    assert judge([out], [], Rules()).violations
    assert not judge([out], [], Rules(statuses=frozenset({504}))).violations
    slow = Outcome(ERROR, status=504, user="slow_reader")
    rules = Rules(client_statuses=(("slow_reader", frozenset({504})),))
    assert not judge([slow], [], rules).violations and judge([out], [], rules).violations
