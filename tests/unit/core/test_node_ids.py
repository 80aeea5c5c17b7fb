"""Host-wide node ids (`shmdisagg/node_ids.py`): two deployments never get the same one, a
configured one held elsewhere is refused by name, and a claim handed to a child lives as long as
any holder does. Lock files go to the test's own directory, not /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from shmdisagg.node_ids import (
    ENV_NODE_ID,
    ENV_NODE_ID_FD,
    NodeIdError,
    claim_node_id,
    claim_or_inherit,
    inherited_claim,
)

REPO = Path(__file__).resolve().parents[3]
CHILD = """
import sys
from shmdisagg.node_ids import claim_node_id, inherited_claim
claim = inherited_claim() if sys.argv[1] == "inherit" else claim_node_id(int(sys.argv[2]), sys.argv[3])
print(claim.node_id, flush=True)
sys.stdin.readline()  # hold it until the test closes stdin
"""


@contextmanager
def holder(
    *args: str, env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()
) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A process holding a node id (its own claim, or an inherited one) until the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, *args],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        pass_fds=pass_fds,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip(), "the child could not claim"
        yield proc, int(line)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_two_claims_on_one_host_get_different_ids_starting_at_tensorrt_llms_default(tmp_path: Path) -> None:
    first, second = claim_node_id(None, str(tmp_path)), claim_node_id(None, str(tmp_path))
    try:
        assert first.node_id == uuid.getnode() % 256  # TensorRT-LLM's default, when free
        assert second.node_id == (first.node_id + 1) % 256  # probing upward
        assert oct(os.stat(first.path).st_mode & 0o777) == "0o600"
    finally:
        first.close()
        second.close()
    with claim_node_id(None, str(tmp_path)) as again:  # both released: the default is free again
        assert again.node_id == first.node_id


def test_a_configured_node_id_held_by_another_deployment_is_refused_naming_the_key_and_holder(tmp_path: Path) -> None:
    with holder("claim", "77", str(tmp_path)) as (proc, got):
        assert got == 77
        with pytest.raises(NodeIdError) as err:
            claim_node_id(77, str(tmp_path))
        msg = str(err.value)
        assert msg.startswith("node_id 77 is in use by another deployment on this host") and f"pid {proc.pid}" in msg
        with claim_node_id(None, str(tmp_path)) as other:  # the default probes past it
            assert other.node_id != 77
    with claim_node_id(77, str(tmp_path)) as mine:  # free once its holder exited
        assert mine.node_id == 77


def test_when_every_id_is_held_the_start_fails_naming_node_id(tmp_path: Path) -> None:
    claims = [claim_node_id(n, str(tmp_path)) for n in range(256)]
    try:
        with pytest.raises(NodeIdError, match=r"^node_id: all 256 node ids are held by other deployments on this host"):
            claim_node_id(None, str(tmp_path))
    finally:
        for c in claims:
            c.close()


def test_an_inherited_claim_outlives_its_claimer_and_is_freed_when_every_holder_exits(tmp_path: Path) -> None:
    parent = claim_node_id(5, str(tmp_path))
    with holder("inherit", env=parent.env(), pass_fds=(parent.fd,)) as (_, got):
        assert got == 5
        parent.close()  # the claimer is done: its child still holds the id
        with pytest.raises(NodeIdError, match="node_id 5 is in use"):
            claim_node_id(5, str(tmp_path))
    with claim_node_id(5, str(tmp_path)) as again:  # the last holder exited: free
        assert again.node_id == 5


def test_a_child_uses_the_claim_it_was_handed_and_refuses_variables_that_name_none(tmp_path: Path) -> None:
    with claim_node_id(9, str(tmp_path)) as claim:
        inherited = claim_or_inherit(None, str(tmp_path), claim.env())
        assert (inherited.node_id, inherited.fd) == (9, claim.fd)  # the same lock, no second claim
        assert inherited_claim({}) is None
        with pytest.raises(NodeIdError, match=f"^node_id: {ENV_NODE_ID}='10'"):
            inherited_claim({ENV_NODE_ID: "10", ENV_NODE_ID_FD: str(claim.fd)})  # that fd locks id 9
        with pytest.raises(NodeIdError, match="do not name a held node-id lock"):
            inherited_claim({ENV_NODE_ID: "9", ENV_NODE_ID_FD: "987"})  # no such fd


def test_the_coordinator_refuses_to_start_on_a_node_id_another_deployment_holds(
    tmp_path: Path, shm_prefix: str
) -> None:
    from shmdisagg.config import parse_config
    from shmdisagg.coordinator.main import Coordinator, StartupError

    with claim_node_id(None) as held:  # another deployment on this host (here: this process)
        cfg = parse_config(
            {
                "context_servers": {"urls": ["127.0.0.1:1"]},
                "generation_servers": {"urls": ["127.0.0.1:2"]},
                "node_id": held.node_id,
                "shmdisagg": {"shm": {"prefix": shm_prefix}},
            }
        )
        with pytest.raises(StartupError, match=f"^node_id {held.node_id} is in use by another deployment on this host"):
            Coordinator(cfg, str(tmp_path / "config.yaml"))
