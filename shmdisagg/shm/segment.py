"""Creates, attaches, locks and unlinks POSIX shared-memory segments (Linux `/dev/shm`).

Owns the lifecycle of every segment: `O_CREX` mode 0600, `os.posix_fallocate` (never a bare
`ftruncate`: a first touch on a full tmpfs is SIGBUS), the creator's `flock`, mapping, closing and
unlinking. Segments made with `huge=True` (the KV block index) are mapped at 2 MiB-aligned
addresses by `_native.SharedMapping`, and their creator puts them on tmpfs huge pages where the
kernel allows it (MADV_COLLAPSE, Linux >= 6.1; native/mapping.c says how and why). It never
reads or writes the words inside a segment; `shmdisagg._native` does. It uses posix_ipc, not
`multiprocessing.shared_memory`, whose resource tracker unlinks segments on 3.11 when an attacher
exits (CPython gh-82300).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from collections.abc import Iterable

import posix_ipc

from shmdisagg._native import LayoutMismatch, RetryExhausted, RowLost, SegmentFull, SharedMapping, ShmError, seed_huge

__all__ = [
    "SHM_DIR",
    "DeploymentRunning",
    "LayoutMismatch",
    "RetryExhausted",
    "RowLost",
    "Segment",
    "SegmentFull",
    "SegmentNotReady",
    "ShmError",
    "cleanup_stale",
    "segment_names",
]

SHM_DIR = "/dev/shm"


class DeploymentRunning(ShmError):
    """A live coordinator holds the control segment's flock for this prefix."""


class SegmentNotReady(ShmError):
    """The segment exists but its creator has not finished sizing or initialising it yet."""


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name.lstrip("/"))


def segment_names(prefix: str) -> tuple[str, ...]:
    """POSIX names ("/name") of the segments in /dev/shm whose name starts with `prefix`, sorted."""
    bare = prefix.lstrip("/")
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return ()
    return tuple(sorted("/" + e for e in entries if e.startswith(bare)))


def _lock_holder(inode: int) -> int | None:
    """Pid holding a flock on `inode` according to /proc/locks, or None if it cannot be told."""
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].rsplit(":", 1)[-1] == str(inode):
                    return int(parts[4])
    except (OSError, ValueError):
        pass
    return None


def _unlink_all(prefix: str) -> list[str]:
    removed = []
    for name in segment_names(prefix.lstrip("/") + "-"):
        try:
            posix_ipc.unlink_shared_memory(name)
            removed.append(name)
        except posix_ipc.ExistentialError:
            pass  # unlinked by someone else meanwhile
    return removed


def _locked(name: str, inode: int) -> str:
    """What a segment whose flock a live process holds says: its name and the holder's pid."""
    pid = _lock_holder(inode)
    return f"{name} is locked by a running coordinator (pid {pid if pid is not None else 'unknown'})"


def cleanup_stale(prefix: str, files: Iterable[str] = ()) -> list[str]:
    """Unlink every segment "/{prefix}-*" left by a dead deployment; returns their POSIX names.

    Raises DeploymentRunning (naming the lock holder's pid) when "/{prefix}-ctl" exists and its
    flock is held, i.e. a coordinator of this prefix is alive. The lock is held while unlinking.

    `files` (a dead coordinator's Unix sockets) are unlinked too, first, but only while holding
    the lock of an existing "/{prefix}-ctl": that is the one proof that they belong to a dead
    deployment. Without a control segment they are left alone (a coordinator removes its
    sockets before its segments, and replaces stale ones itself when it starts).
    """
    ctl = f"/{prefix.lstrip('/')}-ctl"
    try:
        shm = posix_ipc.SharedMemory(ctl)
    except posix_ipc.ExistentialError:
        return _unlink_all(prefix)
    try:
        try:
            fcntl.flock(shm.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DeploymentRunning(
                f"{_locked(ctl, os.fstat(shm.fd).st_ino)}: stop it first or use another port/prefix"
            ) from None
        for path in files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return _unlink_all(prefix)
    finally:
        shm.close_fd()


def _segment_full(name: str, size: int) -> SegmentFull:
    try:
        st = os.statvfs(SHM_DIR)
        room = f"{st.f_bavail * st.f_frsize} of {st.f_blocks * st.f_frsize} bytes free"
    except OSError:
        room = "free space unknown"
    return SegmentFull(
        f"cannot reserve {size} bytes for {name}: {SHM_DIR} is full ({room}). Enlarge {SHM_DIR}: "
        f"`docker run --shm-size=1g` (compose: shm_size), or in Kubernetes mount an emptyDir "
        f"with `medium: Memory` and a sizeLimit at {SHM_DIR}"
    )


class Segment:
    """One POSIX shared-memory object mapped into this process.

    Attributes:
        name: POSIX name with its leading slash, e.g. "/shmdisagg-1000-8000-ctl".
        size: mapped length in bytes (the file size; the creator allocates whole pages).
        mm: the shared, writable (or read-only) mapping; closed by `close()`. A `SharedMapping`
            (2 MiB-aligned) for segments made with `huge=True`, else an `mmap.mmap`.
        huge_bytes: in the creator of a `huge=True` segment, the bytes its collapse put on 2 MiB
            pages (0: the kernel would not; the segment works the same on 4 KiB pages); else 0.
        owner: True in the creator, which keeps the fd open because it holds the exclusive flock
            that makes it the single writer; the kernel drops the lock if the creator dies.
    """

    def __init__(
        self, name: str, mm: mmap.mmap | SharedMapping, shm: posix_ipc.SharedMemory | None, huge_bytes: int = 0
    ) -> None:
        self.name = name
        self.size = len(mm)
        self.mm = mm
        self._shm = shm
        self.owner = shm is not None
        self.huge_bytes = huge_bytes

    @classmethod
    def create(cls, name: str, size: int, *, huge: bool = False) -> Segment:
        """Create `name` exclusively (mode 0600), flock it, reserve `size` bytes and map them.

        With `huge`, the file is put on 2 MiB pages before anything is written where the kernel
        allows it (`seed_huge`, then `SharedMapping.collapse`, then the usual posix_fallocate of
        the whole: native/mapping.c), and mapped 2 MiB-aligned; `huge_bytes` says how much the
        collapse covered.

        Raises FileExistsError if the name exists, SegmentFull if /dev/shm has no room (ENOSPC
        from posix_fallocate), BlockingIOError if another process locked it first. On any failure
        the new name is unlinked again.
        """
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        except posix_ipc.ExistentialError as e:
            raise FileExistsError(errno.EEXIST, "shared-memory segment already exists", name) from e
        inode = os.fstat(shm.fd).st_ino
        mm: mmap.mmap | SharedMapping | None = None
        huge_bytes = 0
        try:
            fcntl.flock(shm.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(_path(name)).st_ino != inode:  # a concurrent cleanup_stale unlinked it
                raise FileNotFoundError(errno.ENOENT, "segment was unlinked while being created", name)
            try:
                if huge:
                    seed_huge(shm.fd, size)
                    mm = SharedMapping(shm.fd, size)
                    huge_bytes = mm.collapse()
                os.posix_fallocate(shm.fd, 0, size)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise _segment_full(name, size) from e
                raise
            if mm is None:
                mm = mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if mm is not None:
                mm.close()
            shm.close_fd()
            try:
                if os.stat(_path(name)).st_ino == inode:
                    posix_ipc.unlink_shared_memory(name)
            except (OSError, posix_ipc.ExistentialError):
                pass
            raise
        return cls(name, mm, shm, huge_bytes)

    @classmethod
    def attach(cls, name: str, *, read_only: bool = False, min_size: int = 1, huge: bool = False) -> Segment:
        """Map an existing segment of this uid with mode 0600, at its current size; with `huge`,
        2 MiB-aligned (`SharedMapping`), so the huge pages its creator made map whole.

        Never passes `size` to posix_ipc (that would ftruncate and could shrink a live segment).
        Raises FileNotFoundError if it does not exist, ShmError if its owner or mode is wrong,
        SegmentNotReady if it is smaller than `min_size` bytes (its creator is still sizing it).
        """
        try:
            shm = posix_ipc.SharedMemory(name, read_only=read_only)
        except posix_ipc.ExistentialError as e:
            raise FileNotFoundError(errno.ENOENT, "no such shared-memory segment", name) from e
        try:
            st = os.fstat(shm.fd)
            if st.st_uid != os.getuid():
                raise ShmError(f"{name} belongs to uid {st.st_uid}, not {os.getuid()}: refusing to attach")
            if st.st_mode & 0o077:
                raise ShmError(f"{name} has mode {st.st_mode & 0o777:04o}, expected 0600: refusing to attach")
            if st.st_size < min_size:
                raise SegmentNotReady(f"{name} is {st.st_size} bytes, expected at least {min_size}")
            mm: mmap.mmap | SharedMapping
            if huge:
                mm = SharedMapping(shm.fd, st.st_size, not read_only)
            else:
                prot = mmap.PROT_READ if read_only else mmap.PROT_READ | mmap.PROT_WRITE
                mm = mmap.mmap(shm.fd, st.st_size, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            shm.close_fd()  # the mapping outlives the fd; only the creator keeps its fd (flock)
        return cls(name, mm, None)

    @classmethod
    def adopt(cls, name: str) -> Segment:
        """Take over an existing segment whose creator died: flock it, check its owner and mode,
        map it writable at its current size. The new owner is the single writer, as its creator
        was (a restarted coordinator).

        Raises FileNotFoundError if it does not exist, DeploymentRunning if a live process holds
        its flock, ShmError if its owner or mode is wrong.
        """
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError as e:
            raise FileNotFoundError(errno.ENOENT, "no such shared-memory segment", name) from e
        try:
            st = os.fstat(shm.fd)
            try:
                fcntl.flock(shm.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DeploymentRunning(_locked(name, st.st_ino)) from None
            if st.st_uid != os.getuid():
                raise ShmError(f"{name} belongs to uid {st.st_uid}, not {os.getuid()}: refusing to adopt")
            if st.st_mode & 0o077:
                raise ShmError(f"{name} has mode {st.st_mode & 0o777:04o}, expected 0600: refusing to adopt")
            mm = mmap.mmap(shm.fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            shm.close_fd()
            raise
        return cls(name, mm, shm)

    def close(self) -> None:
        """Unmap and, in the creator, close the fd (dropping the flock). Idempotent.

        Raises BufferError while a `Region` still exports the mapping: release it first.
        """
        if not self.mm.closed:
            self.mm.close()
        if self._shm is not None:
            self._shm.close_fd()
            self._shm = None

    def unlink(self) -> None:
        """Remove the name; existing mappings stay valid until unmapped. Missing name: no-op."""
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass
