"""OpenClaw's session write lock, this process's side: who here may append to a transcript.

Theory
------
Writers serialise on two locks, always taken in this order:

1. an in-process re-entrant :class:`threading.RLock` per transcript (:class:`PathLock`), so
   worker threads of one process queue cheaply and a thread that already holds
   :func:`session_write_lock` may mirror;
2. OpenClaw's advisory ``<realpath(dir)>/<name>.lock`` file
   (:mod:`~codex_turn.harness.session._lockfile`: its payload, staleness and breaking), which
   other processes, including OpenClaw itself, honour. The file belongs to the *process*: it
   is taken by the outermost in-process holder and released when the last one leaves, unless
   a whole-turn lease (:class:`SessionLease`, taken and renewed by
   :mod:`~codex_turn.harness.session._lease`) holds it, in which case writers take the
   in-process lock only (the lease's process already owns the file, as OpenClaw's run
   attempt owns it for a whole turn).

:class:`PathLock` records those holders (the writes, counted; the lease) and the bytes this
process wrote into the file; both the write lock here and the lease read and change it under
its ``rlock``. Both are keyed by :func:`codex_turn.harness._fs.session_path`, the same key as
the read cache, the binding and the in-process turn gates.

The locks are thread locks and waiting blocks: call from a worker thread
(``anyio.to_thread.run_sync``), never from an event loop thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

import attrs

from codex_turn.harness._fs import make_private_dirs, session_path
from codex_turn.harness.session._lockfile import (
    LOCK_STALE_SECONDS,
    SessionLockTimeout,
    acquire_file_lock,
    release_file_lock,
    sweep_stale_asides,
)

__all__ = ["DEFAULT_LOCK_TIMEOUT", "session_write_lock"]

DEFAULT_LOCK_TIMEOUT: Final = 10.0  # OpenClaw's default session write-lock timeout


@attrs.define(eq=False)
class SessionLease:
    """This process's whole-turn hold on a session's lock file
    (:func:`~codex_turn.harness.session._lease.try_acquire_lease`)."""

    target: str  #: the session file's :func:`~codex_turn.harness._fs.session_path`
    ttl: float
    next_renewal: float  #: ``time.monotonic()`` of the next renewal
    lost: bool = False
    renewals: int = 0


@attrs.define
class PathLock:
    """This process's side of one transcript's lock. ``rlock`` guards every other field."""

    rlock: threading.RLock = attrs.Factory(threading.RLock)
    depth: int = 0  # holders in this process (re-entrant, one thread at a time)
    swept: bool = False  # stale-lock leftovers looked for once per process
    #: The whole-turn lease holding the file, if any.
    lease: SessionLease | None = None
    #: The bytes this process wrote into the lock file while it holds it: released (or
    #: renewed) only while the file still holds exactly them.
    payload: bytes | None = None

    def holds_file(self) -> bool:
        return self.payload is not None


_path_locks: dict[str, PathLock] = {}
_path_locks_guard = threading.Lock()


def path_lock(target: str) -> PathLock:
    """This process's side of the lock on ``target`` (a :func:`session_path`)."""
    # Never evicted: one small object per transcript this process ever wrote.
    with _path_locks_guard:
        lock = _path_locks.get(target)
        if lock is None:
            lock = _path_locks[target] = PathLock()
        return lock


@contextmanager
def session_write_lock(
    path: str | os.PathLike[str],
    *,
    timeout: float = DEFAULT_LOCK_TIMEOUT,
    stale_after: float = LOCK_STALE_SECONDS,
) -> Iterator[str]:
    """Hold the transcript's write lock: in-process first, then OpenClaw's ``.lock`` file.

    Re-entrant within one thread (nested holders share the file lock). When this process
    holds the session's whole-turn lease, the lease owns the file and only the in-process
    lock is taken. Usable from any thread; never from an event loop thread, since waiting
    blocks. Yields the lock target, the transcript's
    :func:`~codex_turn.harness._fs.session_path`. Raises :class:`SessionLockTimeout` after
    ``timeout`` seconds.
    """
    target = session_path(path)
    deadline = time.monotonic() + timeout
    lock = path_lock(target)
    if not lock.rlock.acquire(timeout=max(0.0, timeout)):
        raise SessionLockTimeout(target, timeout)
    try:
        took_file = False
        if not lock.holds_file():
            make_private_dirs(os.path.dirname(target))
            if not lock.swept:
                lock.swept = True
                sweep_stale_asides(target + ".lock")
            lock.payload = acquire_file_lock(target + ".lock", deadline, timeout, stale_after)
            took_file = True
        lock.depth += 1
        try:
            yield target
        finally:
            lock.depth -= 1
            if took_file and lock.payload is not None:
                release_file_lock(target + ".lock", lock.payload)
                lock.payload = None
    finally:
        lock.rlock.release()
