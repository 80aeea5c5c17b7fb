"""Host-wide node ids: the `node_id` field of the `disagg_request_id`s a deployment mints,
distinct from every other live deployment's on this host, guaranteed.

TensorRT-LLM's default node id is `uuid.getnode() % 256` (`DisaggServerConfig.node_id`,
`tensorrt_llm/llmapi/disagg_utils.py` @0228a712, which assumes "only one disagg-server is
running on a machine"): two deployments on one host that share executors (a blue/green switch)
would mint the same ids (`ids.py`: node, process and counter fields) and an executor could
mistake one request for another. So a deployment claims its node id: id `n` is held by an
exclusive `flock` on `/dev/shm/shmdisagg_nodeid_<nnn>.lock` (mode 0600; tmpfs, so gone at
reboot). Without `node_id` in the config, the claim starts at `uuid.getnode() % 256` and probes
upward (mod 256) to the first id no live deployment holds; a configured `node_id` is claimed
too, and one held by another deployment stops the start with an error naming the key. A lock
file of another user cannot be opened and counts as held. Lock files are never unlinked (an
unlink between another claimer's open and flock would let two deployments hold one id).
Across hosts, ids are not coordinated: give each front-end host its own `node_id` (0..255).

The lock lives as long as its open file description: a claimer hands it to its children
(`NodeIdClaim.env()` plus `pass_fds=(claim.fd,)`), and a child that finds `SHMDISAGG_NODE_ID`
and `SHMDISAGG_NODE_ID_FD` in its environment uses that claim (`claim_or_inherit`) instead of
claiming one of its own. The id stays held while any process holding the inherited fd lives,
even after the claimer exited, and is free once every holder exited (the kernel drops the lock
with the last fd), so a crashed deployment never leaves an id taken.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from shmdisagg.shm.segment import _lock_holder

LOCK_DIR = "/dev/shm"
# no "-" in the name: no deployment prefix's stale-segment cleanup ("/<prefix>-*") can match it
LOCK_NAME = "shmdisagg_nodeid_{:03d}.lock"
ENV_NODE_ID = "SHMDISAGG_NODE_ID"
ENV_NODE_ID_FD = "SHMDISAGG_NODE_ID_FD"
NODE_IDS = 256  # the snowflake id's 8-bit node field (ids.py)


class NodeIdError(RuntimeError):
    """No node id could be claimed or inherited; the message names `node_id` and says why."""


@dataclass
class NodeIdClaim:
    """A held node id: `node_id` (0..255), `fd` (the locked lock file; the lock lasts while any
    process holds this open file description), `path` (the lock file)."""

    node_id: int
    fd: int
    path: str

    def env(self) -> dict[str, str]:
        """The variables that hand this claim to a child started with `pass_fds=(fd,)`."""
        return {ENV_NODE_ID: str(self.node_id), ENV_NODE_ID_FD: str(self.fd)}

    def close(self) -> None:
        """Drop this process's hold (the id is free once no child holds it either). Idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> NodeIdClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _holder(fd: int) -> str:
    """Who holds the lock on `fd`'s file, as far as /proc/locks tells."""
    pid = _lock_holder(os.fstat(fd).st_ino)
    if pid is None:
        return "another process"
    if os.path.exists(f"/proc/{pid}"):
        return f"pid {pid}"
    return f"a process that inherited it from pid {pid}"  # its claimer exited, a child holds it


def _try_claim(node_id: int, directory: str) -> NodeIdClaim | str:
    """The claim of `node_id`, or why not (who holds it)."""
    path = os.path.join(directory, LOCK_NAME.format(node_id))
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except PermissionError:
            return "another user (its lock file is not ours to open)"
        except OSError as err:
            raise NodeIdError(f"node_id: cannot open the node-id lock file {path}: {err.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            why = _holder(fd)
            os.close(fd)
            return why
        try:  # the file we locked must still be the one the path names
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            with contextlib.suppress(OSError):  # who holds it, for a reader without /proc/locks
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return NodeIdClaim(node_id, fd, path)
        os.close(fd)  # someone removed the file meanwhile: lock the one the path names now


def claim_node_id(preferred: int | None, directory: str = LOCK_DIR) -> NodeIdClaim:
    """Claim a node id on this host: `preferred` (a configured `node_id`) or, when None, the
    first free one from `uuid.getnode() % 256` upward (mod 256).

    Raises NodeIdError when `preferred` is held by another live deployment (naming the holder's
    pid when /proc/locks tells it), when all 256 are held, or when the lock directory is unusable.
    """
    if preferred is not None:
        if not 0 <= preferred < NODE_IDS:
            raise NodeIdError(f"node_id must be in [0, {NODE_IDS}), got {preferred}")
        got = _try_claim(preferred, directory)
        if isinstance(got, str):
            raise NodeIdError(
                f"node_id {preferred} is in use by another deployment on this host ({got} holds "
                f"{os.path.join(directory, LOCK_NAME.format(preferred))}): set another node_id (0..255), "
                f"or leave node_id out to get a free one"
            )
        return got
    start = uuid.getnode() % NODE_IDS
    for i in range(NODE_IDS):
        got = _try_claim((start + i) % NODE_IDS, directory)
        if isinstance(got, NodeIdClaim):
            return got
    raise NodeIdError(
        f"node_id: all {NODE_IDS} node ids are held by other deployments on this host "
        f"(lock files {os.path.join(directory, 'shmdisagg_nodeid_*.lock')}): stop one of them"
    )


def inherited_claim(environ: Mapping[str, str] = os.environ) -> NodeIdClaim | None:
    """The claim a parent handed down (`NodeIdClaim.env()`), or None when there is none.

    Raises NodeIdError when the variables are set but do not name a held node-id lock."""
    raw_id, raw_fd = environ.get(ENV_NODE_ID), environ.get(ENV_NODE_ID_FD)
    if raw_id is None and raw_fd is None:
        return None
    try:
        node_id, fd = int(raw_id or ""), int(raw_fd or "")
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.basename(path) != LOCK_NAME.format(node_id) or os.stat(path).st_ino != os.fstat(fd).st_ino:
            raise ValueError("not that node id's lock file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # succeeds on the very description that holds it
    except (ValueError, OSError) as err:
        raise NodeIdError(
            f"node_id: {ENV_NODE_ID}={raw_id!r} {ENV_NODE_ID_FD}={raw_fd!r} do not name a held node-id lock ({err}); "
            f"they are set by the process that starts this one, unset them to claim a node id here"
        ) from None
    return NodeIdClaim(node_id, fd, path)


def claim_or_inherit(
    preferred: int | None, directory: str = LOCK_DIR, environ: Mapping[str, str] = os.environ
) -> NodeIdClaim:
    """The claim handed down by the parent if there is one, else a new `claim_node_id`."""
    inherited = inherited_claim(environ)
    return inherited if inherited is not None else claim_node_id(preferred, directory)
