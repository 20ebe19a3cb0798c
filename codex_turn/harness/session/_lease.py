"""The whole-turn session lease: OpenClaw's session lock file, held for a turn and renewed.

Theory
------
A turn reads the thread binding, starts or resumes a Codex thread, writes the binding back
and mirrors the turn into the transcript. Two processes doing that on one session at once
both decide ``start`` and one thread is orphaned. So a turn (and a compaction) holds the
session for its whole duration, across processes, with the very file OpenClaw's own run
attempt holds for a whole turn: ``<realpath(dir)>/<name>.lock``
(:mod:`~codex_turn.harness.session._lockfile`). One mechanism, two holders of this process
(:class:`~codex_turn.harness.session._lock.PathLock`):

* a *write* (:func:`~codex_turn.harness.session._lock.session_write_lock`) takes the file for
  one append when nothing in this process holds it;
* a *lease* (:func:`try_acquire_lease`) takes it for a turn. While a lease holds it, writes of
  this process (the turn's own mirror among them) take only the in-process lock: the file is
  the process's, exactly like OpenClaw's re-entrant lock.

A lease records ``ttlMs`` (:data:`LEASE_TTL_SECONDS`) and ``host`` besides OpenClaw's
``{pid, createdAt, starttime}``. A daemon thread renews it every quarter ttl by writing a fresh
``createdAt`` over the lock with :func:`~codex_turn.harness._fs.atomic_write` (not durable: a
lease means nothing after a crash; readers never see a torn file), only while the file still
holds exactly the bytes this process last wrote. So a live holder never looks expired, to us
(ttl) or to OpenClaw (30 minutes), whatever the turn's length. Another process takes the lock
over only when it is stale (``_lockfile.py``): its holder is on this host and its pid is dead
or recycled (at once: a SIGKILLed turn frees its session for the next process immediately), or
its holder is on another host and it is older than its ttl (its renewals stopped), or it is
older than OpenClaw's 30 minutes. A live holder on this host is never judged by the ttl, and a
live holder's lease is never taken on a timeout: the waiter gives up with
:class:`~codex_turn.SessionBusy`. A lease found replaced at renewal is *lost*: logged, no
longer renewed, and the process's writes take the file again.

Everything here is synchronous and never waits: :func:`try_acquire_lease` makes one attempt
(breaking stale locks on the way) and the async caller (``_gates.hold_session``) polls with
backoff, cancellably, from a worker thread.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Final

import attrs

from codex_turn._log import format_error, get_logger
from codex_turn.harness._fs import atomic_write, make_private_dirs, session_path
from codex_turn.harness.session._lock import PathLock, SessionLease, path_lock
from codex_turn.harness.session._lockfile import (
    LOCK_STALE_SECONDS,
    lock_payload,
    read_lock,
    release_file_lock,
    sweep_stale_asides,
    take_file_lock_once,
)

__all__ = [
    "LEASE_TTL_SECONDS",
    "LeaseBusy",
    "release_lease",
    "try_acquire_lease",
]

_log = get_logger(__name__)

#: How long a lease stays valid without renewal; renewed every quarter of it. Short enough
#: that a holder on another host that died frees its session within a minute, long enough
#: that a stalled renewal thread has three chances. Read at each acquisition.
LEASE_TTL_SECONDS: float = 60.0
_RENEW_FRACTION: Final = 0.25
_RENEW_RETRY: Final = 0.05  # the path lock was busy (a write in progress): try again soon


@attrs.frozen
class LeaseBusy:
    """A live holder has the session: ``holder_pid`` (``None`` when unknown, or a write of
    this process in progress)."""

    holder_pid: int | None


def try_acquire_lease(
    path: str | os.PathLike[str],
    *,
    ttl: float | None = None,
    stale_after: float = LOCK_STALE_SECONDS,
    create_directory: bool = True,
) -> SessionLease | LeaseBusy | OSError:
    """One attempt at the session's lease, never waiting: the lease, :class:`LeaseBusy`, or
    the :class:`OSError` that keeps the lock file from being created at all (a missing or
    unwritable directory, a lock path that is not a file: nothing can be written there, and
    the turn's preflight says why). Stale locks are broken on the way, with a warning."""
    absolute = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(absolute)
    if create_directory and not os.path.isdir(directory):  # one stat when it exists
        try:
            make_private_dirs(directory)
        except OSError as error:
            return error
    target = session_path(absolute)
    lock = path_lock(target)
    if not lock.rlock.acquire(blocking=False):
        return LeaseBusy(None)  # a write of this process is in progress (or waiting)
    try:
        if lock.lease is not None or lock.depth:
            # Another holder in this process (a lease of another event loop, or a write of
            # this very thread): never two holders of one file in one process.
            return LeaseBusy(os.getpid())
        lease_ttl = LEASE_TTL_SECONDS if ttl is None else ttl
        if not lock.holds_file():
            try:
                if not lock.swept:
                    lock.swept = True
                    sweep_stale_asides(target + ".lock")
                written, holder, broke = take_file_lock_once(
                    target + ".lock", stale_after, lease_ttl
                )
            except OSError as error:
                return error
            if broke:
                sweep_stale_asides(target + ".lock")
            if written is None:
                return LeaseBusy(holder)
            lock.payload = written
        lease = SessionLease(
            target=target,
            ttl=lease_ttl,
            next_renewal=time.monotonic() + lease_ttl * _RENEW_FRACTION,
        )
        lock.lease = lease
    finally:
        lock.rlock.release()
    _renewer.add(lease)
    return lease


def release_lease(lease: SessionLease) -> None:
    """Give the lease up: the lock file is removed if it is still ours and no write of this
    process holds it. Waits for a write of this process in progress (a short append)."""
    _renewer.discard(lease)
    lock = path_lock(lease.target)
    with lock.rlock:
        if lock.lease is not lease:
            return
        lock.lease = None
        if lock.depth == 0 and lock.payload is not None:
            if not lease.lost:
                release_file_lock(lease.target + ".lock", lock.payload)
            lock.payload = None


def _renew(lease: SessionLease) -> None:
    """Rewrite the lock with a fresh ``createdAt``, if it still holds our bytes."""
    lock = path_lock(lease.target)
    if not lock.rlock.acquire(timeout=_RENEW_RETRY):
        lease.next_renewal = time.monotonic() + _RENEW_RETRY
        return
    try:
        if lock.lease is not lease or lease.lost:
            return
        lease.next_renewal = time.monotonic() + lease.ttl * _RENEW_FRACTION
        try:
            _replace_lock(lease, lock)
        except OSError as error:
            # Retried at the next renewal; the lease is still ours until its ttl runs out.
            _log.warning(
                "session lease renewal failed",
                lock=lease.target + ".lock",
                error=format_error(error),
            )
    finally:
        lock.rlock.release()


def _replace_lock(lease: SessionLease, lock: PathLock) -> None:
    lock_path = lease.target + ".lock"
    try:
        current: bytes | None = read_lock(lock_path)
    except FileNotFoundError:
        current = None
    if current is None or current != lock.payload:
        # Broken as stale by another process (our renewals stalled past the ttl) and maybe
        # taken: not ours any more. Writes of this process take the file again.
        lease.lost = True
        lock.payload = None
        _log.warning("session lease lost: the lock file was replaced", lock=lock_path)
        return
    data = lock_payload(lease.ttl)
    atomic_write(lock_path, data, durable=False)
    lock.payload = data
    lease.renewals += 1


#: How long the renewal thread outlives the last lease, waiting for the next one: a process
#: running turn after turn keeps one thread instead of starting one per turn.
_RENEWER_LINGER: Final = 30.0
#: While it lingers, the thread wakes this often: a lease taken meanwhile that is due later
#: than that (a default lease is due after a quarter of its ttl, 15 s) needs no wake-up.
_LINGER_SLICE: Final = 5.0


class _Renewer:
    """One daemon thread renewing every lease this process holds; it ends once none has been
    held for :data:`_RENEWER_LINGER` seconds (it may wake to notice that up to one renewal
    interval later).

    The thread sleeps until the earliest renewal it knows of (``_wake_at``) and is woken only
    when a new lease is due before that: a lease given up is simply not found when the thread
    next wakes. While it lingers it sleeps in slices of :data:`_LINGER_SLICE`, so a lease due
    later than the end of the slice wakes nothing either: a turn (one lease taken, one given
    up) wakes no thread, which would cost a thread switch on every turn.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """A fresh renewer: also the state of a forked child, which inherits neither the
        thread nor the leases (a fork copies only the calling thread, and the condition may
        have been held by the renewal thread at that moment)."""
        self._wake = threading.Condition()
        self._leases: set[SessionLease] = set()
        self._running = False
        self._wake_at = math.inf  # when the thread wakes next (monotonic); guarded by _wake

    def add(self, lease: SessionLease) -> None:
        with self._wake:
            self._leases.add(lease)
            if not self._running:
                self._running = True
                self._wake_at = math.inf
                threading.Thread(target=self._run, name="codex-turn-lease", daemon=True).start()
            elif lease.next_renewal < self._wake_at:
                self._wake.notify()

    def discard(self, lease: SessionLease) -> None:
        with self._wake:
            self._leases.discard(lease)  # not woken: it finds the lease gone when it wakes

    def _run(self) -> None:
        idle_since: float | None = None
        while True:
            with self._wake:
                now = time.monotonic()
                if not self._leases:
                    # Linger for the next lease (the next turn) instead of ending at once.
                    idle_since = now if idle_since is None else idle_since
                    if now - idle_since >= _RENEWER_LINGER:
                        self._running = False
                        self._wake_at = math.inf
                        return
                    self._wake_at = min(idle_since + _RENEWER_LINGER, now + _LINGER_SLICE)
                    self._wake.wait(self._wake_at - now)
                    continue
                idle_since = None
                due = [lease for lease in self._leases if lease.next_renewal <= now]
                if not due:
                    self._wake_at = min(lease.next_renewal for lease in self._leases)
                    self._wake.wait(self._wake_at - now)
                    continue
                self._wake_at = -math.inf  # renewing: it looks at every lease again after
            for lease in due:
                try:
                    _renew(lease)
                except Exception as error:  # never let the thread die with leases held
                    _log.warning("session lease renewal failed", error=format_error(error))
                    lease.next_renewal = time.monotonic() + lease.ttl * _RENEW_FRACTION


_renewer = _Renewer()
# The thread lingers after the last lease: a child forked meanwhile must start its own.
os.register_at_fork(after_in_child=_renewer._reset)
