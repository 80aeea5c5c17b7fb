"""KV poll hints: the worker's datagram sender and the coordinator's coalesced, hint-driven drains."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from shmdisagg.config import KvEventsSection
from shmdisagg.coordinator.health import Executor
from shmdisagg.coordinator.kv_events import KvEventIngestor, listen_for_hints
from shmdisagg.orchestrator.reporting import HINT_MAGIC, KvHints, hint_message


class RecordingIngestor(KvEventIngestor):
    """Drains nothing over HTTP: each drain is recorded and held until the test lets it go."""

    def __init__(self, slots: list[int], settings: KvEventsSection) -> None:
        super().__init__(None, [Executor(s, 0, "127.0.0.1", 1) for s in slots], lambda role: 0, settings)  # type: ignore[arg-type]
        self.drains: list[int] = []
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.hold = False

    async def _drain_once(self, pool, ex):  # type: ignore[no-untyped-def,override]
        self.drains.append(ex.slot)
        self.started.set()
        if self.hold:
            await self.release.wait()
        return 0


async def _until(predicate, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.001)


SLOW = KvEventsSection(busy_poll_s=3600, idle_poll_s=3600, hinted_poll_s=3600)


def test_hint_message_layout() -> None:
    assert hint_message(3) == HINT_MAGIC + b"\x03\x00\x00\x00"
    assert len(hint_message(2**32 - 1)) == 8


def test_a_hint_to_a_missing_socket_is_counted_never_raised(tmp_path: Path) -> None:
    hints = KvHints(str(tmp_path / "nobody.sock"))
    hints.hint(1)
    hints.hint(-1)  # not a slot: ignored
    assert (hints.sent, hints.failed) == (0, 1)
    hints.close()


def test_hints_drain_at_once_and_coalesce_while_a_drain_is_in_flight(tmp_path: Path) -> None:
    async def main() -> None:
        ing = RecordingIngestor([0, 1], SLOW)
        path = str(tmp_path / "hint.sock")
        transport = await listen_for_hints(path, ing)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        runner = asyncio.ensure_future(ing.run())
        hints = KvHints(path)
        try:
            await _until(lambda: len(ing.drains) == 2)  # the first drain of each server, at start
            ing.drains.clear()
            hints.hint(1)
            await _until(lambda: ing.drains == [1])  # at once: the fallback is an hour away
            # three hints while a drain is in flight: exactly one more drain after it
            ing.hold, ing.release = True, asyncio.Event()
            ing.started.clear()
            hints.hint(0)
            await ing.started.wait()
            for _ in range(3):
                hints.hint(0)
            await _until(lambda: ing.hints == 5)
            ing.hold = False
            ing.release.set()
            await _until(lambda: ing.drains == [1, 0, 0])
            for _ in range(50):  # and no third one
                await asyncio.sleep(0)
            assert ing.drains == [1, 0, 0]
            assert (ing.hinted_drains, ing.polled_drains, ing.bad_hints) == (3, 0, 0)
            assert (hints.sent, hints.failed) == (5, 0)
        finally:
            hints.close()
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            transport.close()
            os.unlink(path)

    asyncio.run(main())


def test_malformed_hints_are_counted_and_ignored(tmp_path: Path) -> None:
    import socket

    async def main() -> None:
        ing = RecordingIngestor([0], SLOW)
        path = str(tmp_path / "hint.sock")
        (tmp_path / "hint.sock").write_text("stale")  # a dead coordinator's file is replaced
        transport = await listen_for_hints(path, ing)
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            for bad in (b"", b"garbage", HINT_MAGIC, b"XXXX\x00\x00\x00\x00", hint_message(0) + b"!", hint_message(7)):
                sender.sendto(bad, path)
            await _until(lambda: ing.bad_hints == 6)
            assert ing.hints == 0
            sender.sendto(hint_message(0), path)
            await _until(lambda: ing.hints == 1)
        finally:
            sender.close()
            transport.close()
            os.unlink(path)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("got", "hinted", "recently_hinted", "expected"),
    [
        (0, False, False, 0.2),  # quiet, no hints: idle poll
        (5, False, False, 0.02),  # events without hints: busy poll
        (5, False, True, 0.02),  # events no hint announced, even while hints flow
        (5, True, True, 1.0),  # hints flow and announce the events: slow fallback
        (0, False, True, 1.0),
    ],
)
def test_fallback_poll_interval(got: int, hinted: bool, recently_hinted: bool, expected: float) -> None:
    ing = KvEventIngestor(None, [Executor(0, 0, "127.0.0.1", 1)], None, KvEventsSection())  # type: ignore[arg-type]
    if recently_hinted:
        assert ing.hint(0)
    assert ing._fallback_s(0, got, hinted) == expected


def test_a_launcher_that_started_no_coordinator_leaves_the_socket_paths_alone(tmp_path: Path, shm_prefix: str) -> None:
    # Whoever owns files at these paths (a live deployment sharing the socket path, say), this
    # launcher did not create them. Its removal of a hard-killed coordinator's sockets is
    # tested in tests/integration/test_launch_cleanup.py.
    from shmdisagg.config import parse_config
    from shmdisagg.launch import Deployment

    config = parse_config(
        {
            "context_servers": {"urls": ["127.0.0.1:2"]},
            "generation_servers": {"urls": ["127.0.0.1:1"]},
            "shmdisagg": {"shm": {"prefix": shm_prefix}, "coordinator_socket": str(tmp_path / "coord.sock")},
        }
    )
    assert config.kv_hint_socket == str(tmp_path / "coord.sock.kvhint")
    for path in (config.coordinator_socket, config.kv_hint_socket):
        Path(path).write_text("not this launcher's")
    Deployment(config, str(tmp_path / "cfg.yaml"), str(tmp_path / "logs")).stop()
    for path in (config.coordinator_socket, config.kv_hint_socket):
        assert Path(path).read_text() == "not this launcher's"
