"""`heap.keep_freed_heap`: a fleet worker's large buffers stop costing fresh pages every time."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a child process (the settings are per process): the page faults of reading a 128k-id
# prompt's ids 20 times, as a fleet worker does once a request (its int32 buffer is allocated
# for the worst case, then shrunk), each read's ids kept until the next is in (requests overlap),
# after one warm-up read; with or without keep_freed_heap.
CHILD = """
import resource, sys
from shmdisagg._native import json_token_ids
from shmdisagg.heap import keep_freed_heap
if sys.argv[1] == "kept":
    assert keep_freed_heap()
body = b'{"model":"m","prompt":[' + b",".join(b"%d" % (i % 100000) for i in range(131072)) + b"]}"
ids = json_token_ids(body, b"prompt")
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(20):
    ids = json_token_ids(body, b"prompt")
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_buffers_reuse_mapped_pages_once_the_heap_keeps_them() -> None:
    # glibc's default maps fresh pages for many of these reads (385 faults on the development VM;
    # a 512 KiB buffer is 128 pages), and how many depends on its adaptive threshold
    assert _faults("kept") < 20  # the same pages every time
