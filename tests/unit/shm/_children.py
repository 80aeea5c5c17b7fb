"""Child processes for the shared-memory tests, and the parent-side handle that drives them.

Run as `python -m tests.unit.shm._children ROLE PREFIX [ARGS]`. Children talk in lines on
stdout (and take commands on stdin); the parent asserts. Crash-prone steps (SIGKILL, a writer
dying mid-seqlock) therefore happen in a child and never take the test run down.

Roles:
  coordinator PREFIX      create the table + an extra "-idx-0001" segment, print "ready", wait
  worker PREFIX           attach, claim a row, print "row N", then obey commands:
      rr ROLE EXCL TOK | ll ROLE EXCL TOK USE_TOKENS   -> prints the slot
      burst N ROLE                                   -> N pick+release pairs, prints counts JSON
      loop K                                         -> pick/release forever keeping K in flight;
                                                        prints "looping" after 1000 picks
      poke_server SLOT | poke_config                  -> leave that seqlock odd, then SIGKILL self
      exit
  writer PREFIX SLOT SECONDS   rewrite server SLOT with self-consistent fields until SECONDS pass
"""

from __future__ import annotations

import json
import os
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def consistent_fields(inc: int) -> tuple[int, int, int, bytes]:
    """(max_batch_size, tokens_per_block, max_num_tokens, addr) that the torture writer pairs with `inc`."""
    return inc * 3, inc * 7 % 1_000_003, inc ^ 0x5A5A5A5A5A5A, f"host-{inc}:{inc % 65536}".encode()


# -- parent side ---------------------------------------------------------------------------------


class Child:
    """A running child: `line()` waits (bounded) for its next stdout line; `send()` writes a command."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.unit.shm._children", *args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.pid = self.proc.pid
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def line(self, timeout: float = 20.0) -> str:
        try:
            got = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"child {self.pid} said nothing for {timeout} s") from None
        if got is None:
            rc = self.proc.wait(timeout=timeout)
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"child {self.pid} exited (rc {rc}) without output: {err}")
        return got

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def ask(self, command: str) -> str:
        self.send(command)
        return self.line()

    def kill(self) -> int:
        """SIGKILL and reap; returns the exit status (-9)."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        return self.wait()

    def wait(self, timeout: float = 20.0) -> int:
        rc = self.proc.wait(timeout=timeout)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                try:
                    f.close()
                except (BrokenPipeError, OSError):
                    pass
        return rc

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


# -- child side ----------------------------------------------------------------------------------


def _say(*words: object) -> None:
    print(*words, flush=True)


def _coordinator(prefix: str) -> None:
    from shmdisagg.shm import ROLE_CONTEXT, ControlTable, Segment

    table = ControlTable.create(prefix)
    table.publish_server(0, "127.0.0.1:1", ROLE_CONTEXT, True)
    extra = Segment.create(f"/{prefix}-idx-0001", 4096)
    _say("ready")
    sys.stdin.read()  # until the parent kills us
    extra.close()
    table.close()


def _poke_odd(mm: object, offset: int) -> None:
    (seq,) = struct.unpack_from("<Q", mm, offset)  # type: ignore[arg-type]
    struct.pack_into("<Q", mm, offset, seq | 1)  # type: ignore[arg-type]
    os.kill(os.getpid(), signal.SIGKILL)  # a writer dying between its odd and even stores


def _worker(prefix: str) -> None:
    from shmdisagg.shm import ControlTable, layout, process_starttime

    table = ControlTable.attach(prefix)
    row = table.claim_row(os.getpid(), process_starttime(os.getpid()))
    _say("row", row)
    for line in sys.stdin:
        cmd, *a = line.split()
        args = [int(x) for x in a]
        if cmd == "rr":
            _say(table.pick_round_robin(row, args[0], args[1], args[2]))
        elif cmd == "ll":
            _say(table.pick_least_loaded(row, args[0], args[1], args[2], bool(args[3])))
        elif cmd == "burst":
            counts: dict[int, int] = {}
            for _ in range(args[0]):
                slot = table.pick_round_robin(row, args[1], -1, 1)
                counts[slot] = counts.get(slot, 0) + 1
                table.release(row, slot, 1)
            _say(json.dumps(counts))
        elif cmd == "loop":
            inflight: deque[tuple[int, int]] = deque()
            for i in range(1 << 62):
                tokens = 1 + i % 97
                inflight.append((table.pick_round_robin(row, 0, -1, tokens), tokens))
                if len(inflight) > args[0]:
                    table.release(row, *inflight.popleft())
                if i == 1000:
                    _say("looping")
        elif cmd == "poke_server":
            _poke_odd(table._segment.mm, layout.server_seq_offset(args[0]))
        elif cmd == "poke_config":
            _poke_odd(table._segment.mm, layout.CONFIG_SEQ_OFFSET)
        elif cmd == "exit":
            break
    table.close()


def _writer(prefix: str, slot: int, seconds: float) -> None:
    """Rewrites one record as fast as it can; only tests may write as a non-coordinator."""
    from shmdisagg import _native
    from shmdisagg.shm import Segment
    from shmdisagg.shm.layout import server_flags

    seg = Segment.attach(f"/{prefix}-ctl")
    region = _native.Region(seg.mm)
    assert region.check_control()
    inc = region.read_server(slot)[0]
    flags = server_flags(True, True, 0)
    deadline = time.monotonic() + seconds
    writes = 0
    while time.monotonic() < deadline:
        for _ in range(256):
            inc += 1
            mb, tpb, mnt, addr = consistent_fields(inc)
            assert region.write_server(slot, flags, mb, tpb, mnt, addr) == inc
        if writes == 0:
            _say("ready")  # only now does the record satisfy consistent_fields
        writes += 256
    _say("writes", writes)
    region.release()
    seg.close()


def main(argv: list[str]) -> None:
    role, prefix, *rest = argv
    if role == "coordinator":
        _coordinator(prefix)
    elif role == "worker":
        _worker(prefix)
    elif role == "writer":
        _writer(prefix, int(rest[0]), float(rest[1]))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
