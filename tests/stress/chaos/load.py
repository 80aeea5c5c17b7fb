"""Sustained mixed load on the public port from an asyncio client on its own thread, plus the
scenarios' odd clients (leaving early, reading slowly, trickling, bursting).

The mix: completions and chat, streaming and not, text and token-id prompts, half of them on one
of a few shared prefixes (so kv_cache_aware and conversation routing have something to match),
some with a session header (conversation ids), small `max_tokens` so the short run stays light.
Each request has a client deadline; every outcome is recorded (`client.Outcome`).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

import orjson

from tests.stress.chaos.client import ABANDONED, CUT, REFUSED, Connection, Outcome, exchange, request_bytes

MODEL = "sim-llama-3.1-8b"
_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()
# a few long shared prefixes (~150 words each), fixed across runs
PREFIXES = [" ".join(random.Random(k).choice(_WORDS) for _ in range(150)) for k in range(4)]


def mixed_request(
    rng: random.Random, port: int, *, max_tokens: tuple[int, int] = (2, 12)
) -> tuple[str, bool, bytes, bytes]:
    """(path, stream, head, body) of one request of the mix."""
    stream = rng.random() < 0.5
    chat = rng.random() < 0.5
    suffix = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 30)))
    text = f"{rng.choice(PREFIXES)} {suffix}" if rng.random() < 0.6 else suffix
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(*max_tokens), "stream": stream}
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "system", "content": text}, {"role": "user", "content": suffix}]
    elif rng.random() < 0.2:
        body["prompt"] = [1000 + zlib.crc32(w.encode()) % 5000 for w in text.split()]
    else:
        body["prompt"] = text
    headers = {"x-session-id": f"conv-{rng.randint(0, 7)}"} if rng.random() < 0.3 else {}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    head, raw = request_bytes(port, path, orjson.dumps(body), headers)
    return path, stream, head, raw


class LoadDriver:
    """`users` closed-loop clients, each on its own keep-alive connection (reopened when the
    server closes it), with a short random think time; started by `start()`, ended by `stop()`,
    which waits for the requests in flight (each bounded by its deadline). `outcomes` are the
    requests owed an answer; `side` the odd clients' (submitted with `submit`)."""

    def __init__(self, port: int, *, users: int, deadline_s: float, seed: int, think_s: float = 0.05) -> None:
        self.port = port
        self.users = users
        self.deadline_s = deadline_s
        self.seed = seed
        self.think_s = think_s
        self.outcomes: list[Outcome] = []
        self.side: list[Outcome] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._users_done = threading.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.stopped_at = 0.0

    # -- the thread ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="chaos-load", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tasks = [asyncio.create_task(self._user(i)) for i in range(self.users)]
        self._ready.set()
        while not self._stopping.is_set() or any(not t.done() for t in self._tasks):
            await asyncio.sleep(0.05)
        self._users_done.set()
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if pending:  # odd clients still running: they are bounded by their own deadlines
            await asyncio.wait(pending)

    def stop_users(self) -> None:
        """Stop issuing requests and wait for the users' requests in flight (each bounded by
        its deadline); the odd clients run on."""
        if not self._stopping.is_set():
            self._stopping.set()
            self.stopped_at = time.monotonic()
        if not self._users_done.wait(self.deadline_s + 10):
            raise AssertionError(
                "the load client did not finish: a request outlived its deadline without the client noticing"
            )

    def stop(self, timeout_s: float | None = None) -> None:
        """`stop_users`, then wait for the odd clients too."""
        self.stop_users()
        assert self._thread is not None
        self._thread.join(timeout_s if timeout_s is not None else self.deadline_s * 2 + 30)
        if self._thread.is_alive():
            raise AssertionError("an odd client of the load did not finish within its bounds")

    def submit(self, make: Callable[[], Awaitable[Any]]) -> Future[Any]:
        """Run `make()` on the load's loop (thread-safe); its result through the future."""
        assert self._loop is not None

        async def run() -> Any:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self._loop)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # -- the closed-loop users -------------------------------------------------------------

    async def _user(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        conn: Connection | None = None
        while not self._stopping.is_set():
            path, stream, head, body = mixed_request(rng, self.port)
            if conn is not None and (not conn.reusable or conn.reader.at_eof()):
                conn.close()  # the server closed it between requests: an idle keep-alive close, not a cut
                conn = None
            started = time.monotonic()
            if conn is None:
                try:
                    conn = await Connection.open(self.port)
                except OSError as err:
                    self.outcomes.append(connect_failed(err, stream, path, started, f"u{i}"))
                    await asyncio.sleep(0.05)
                    continue
            out = await exchange(conn, head, body, stream, started + self.deadline_s)
            out.path, out.user = path, f"u{i}"
            self.outcomes.append(out)
            if not conn.reusable:
                conn.close()
                conn = None
            await asyncio.sleep(rng.random() * self.think_s)
        if conn is not None:
            conn.close()


def connect_failed(err: OSError, stream: bool, path: str, started: float, user: str) -> Outcome:
    """A connection that could not be made: refused (nothing listened on the port), or cut
    during the handshake (a listener that was dying, judged as any other cut)."""
    kind = REFUSED if isinstance(err, ConnectionRefusedError) else CUT
    return Outcome(
        kind,
        f"connect: {type(err).__name__}: {err}",
        stream=stream,
        path=path,
        started=started,
        ended=time.monotonic(),
        conn_opened=started,
        user=user,
    )


# -- odd clients (each a coroutine run on the load's loop through `LoadDriver.submit`) -----

LEAVE_POINTS = ("mid_head", "after_head", "mid_body", "after_request", "mid_stream")


async def leaving_client(port: int, rng: random.Random, point: str) -> Outcome:
    """A client that disconnects at `point` (one of LEAVE_POINTS): inside the request head,
    after the head without its body, inside the body, after the whole request before the
    answer, or after the first events of a stream. Nothing is owed to it: ABANDONED."""
    started = time.monotonic()
    stream = point == "mid_stream"
    path, _, head, body = mixed_request(rng, port, max_tokens=(40, 80) if stream else (2, 12))
    if stream:
        head, body = request_bytes(port, path, orjson.dumps({**orjson.loads(body), "stream": True}))
    conn = await Connection.open(port)
    try:
        if point == "mid_head":
            await conn.send(head[: rng.randint(1, len(head) - 2)])
        elif point == "after_head":
            await conn.send(head)
        elif point == "mid_body":
            await conn.send(head + body[: rng.randint(1, len(body) - 1)])
        else:
            await conn.send(head + body)
        await asyncio.sleep(rng.random() * 0.03)  # let the worker get to it
        if stream:
            from tests.stress.chaos.client import Exchange

            async with asyncio.timeout(10):
                await conn.read_response(Exchange(), until_events=2)
    except (OSError, TimeoutError):
        pass
    finally:
        conn.close(reset=rng.random() < 0.5)  # a reset or a plain close
    return Outcome(
        ABANDONED, point, stream=stream, started=started, ended=time.monotonic(), conn_opened=conn.opened, user="leaver"
    )


def _streaming_request(port: int, rng: random.Random, max_tokens: int) -> tuple[str, bytes, bytes]:
    """(path, head, body) of one of the load's mixed requests, made a stream of `max_tokens`."""
    _, _, _, body = mixed_request(rng, port)
    doc = orjson.loads(body)
    doc.update(stream=True, max_tokens=max_tokens)
    path = "/v1/chat/completions" if "messages" in doc else "/v1/completions"
    head, body = request_bytes(port, path, orjson.dumps(doc))
    return path, head, body


async def slow_reader(
    port: int, rng: random.Random, deadline_s: float, *, max_tokens: int, read_bytes: int, pause_s: float
) -> Outcome:
    """A streaming request read `read_bytes` at a time with `pause_s` between reads, through a
    small receive buffer: owed a complete stream or a clean error by its deadline."""
    started = time.monotonic()
    path, head, body = _streaming_request(port, rng, max_tokens)
    conn = await Connection.open(port, rcvbuf=4096)
    try:
        out = await exchange(conn, head, body, True, started + deadline_s, chunk=read_bytes, pause_s=pause_s)
    finally:
        conn.close()
    out.path, out.user = path, "slow_reader"
    return out


async def stalled_reader(port: int, rng: random.Random, release: asyncio.Event, *, max_tokens: int) -> Outcome:
    """A streaming request whose client reads the first bytes, then stops reading (its receive
    buffer small and full) until `release` is set (on the load's loop), then leaves. Nothing is
    owed to it; the scenario checks that the deployment's counters drain while it is still
    connected."""
    started = time.monotonic()
    path, head, body = _streaming_request(port, rng, max_tokens)
    conn = await Connection.open(port, rcvbuf=2048)
    try:
        await conn.send(head + body)
        await conn.reader.read(1024)
        await release.wait()
    except OSError:
        pass
    finally:
        conn.close()
    return Outcome(
        ABANDONED,
        "stalled reader",
        stream=True,
        path=path,
        started=started,
        ended=time.monotonic(),
        conn_opened=conn.opened,
        user="stalled",
    )


async def trickling_client(port: int, rng: random.Random, deadline_s: float, *, part: str, gap_s: float) -> Outcome:
    """A non-streaming request whose head (`part` "head") or body ("body") is sent one byte at
    a time, `gap_s` apart, while the answer is read concurrently (a server that answers early,
    e.g. a 408, is heard). Owed a complete answer or a clean error by its deadline."""
    from tests.stress.chaos.client import Exchange, classify

    started = time.monotonic()
    path = "/v1/completions"
    # a short body, so that trickling it takes as long as trickling a head
    doc = {"model": MODEL, "prompt": " ".join(rng.choice(_WORDS) for _ in range(4)), "max_tokens": 4}
    head, body = request_bytes(port, path, orjson.dumps(doc))
    conn = await Connection.open(port)
    ex = Exchange()
    out = Outcome("", stream=False, path=path, started=started, conn_opened=conn.opened, user=f"trickle_{part}")
    reading = asyncio.create_task(conn.read_response(ex))
    try:
        async with asyncio.timeout(deadline_s):
            slow, fast = (head, b"") if part == "head" else (body, head)
            if fast:
                await conn.send(fast)
            for i in range(len(slow)):
                if reading.done():
                    break  # answered (or closed) before the request was whole
                await conn.send(slow[i : i + 1])
                await asyncio.sleep(gap_s)
            if part == "head" and not reading.done():
                await conn.send(body)
            await reading
        out.kind, out.detail, out.status = classify(False, ex)
    except TimeoutError:
        out.kind, out.detail = "timeout", f"no answer within {deadline_s:g} s"
    except OSError as err:
        await asyncio.sleep(0.05)  # an answer may have arrived before the reset
        out.kind, out.detail, out.status = classify(False, ex)
        out.detail = f"{type(err).__name__} while trickling: {out.detail}"
    finally:
        reading.cancel()
        conn.close()
    out.ended = time.monotonic()
    return out


async def burst(port: int, seed: int, n: int, deadline_s: float) -> list[Outcome]:
    """`n` one-shot requests of the mix on fresh connections, all at once: each owed an answer
    (complete, or a clean 429 / 503) by its deadline."""

    async def one(k: int) -> Outcome:
        rng = random.Random(seed * 7919 + k)
        path, stream, head, body = mixed_request(rng, port)
        started = time.monotonic()
        try:
            conn = await Connection.open(port)
        except OSError as err:
            return connect_failed(err, stream, path, started, "burst")
        try:
            out = await exchange(conn, head, body, stream, started + deadline_s)
        finally:
            conn.close()
        out.path, out.user = path, "burst"
        return out

    return list(await asyncio.gather(*(one(k) for k in range(n))))
