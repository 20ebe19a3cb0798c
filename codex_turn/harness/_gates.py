"""One hold per session file: turns and compactions of a session never overlap, in-process or
across processes.

A turn reads the binding, talks to Codex and writes the binding back; a compaction clears the
binding's projection and sends ``thread/compact/start`` on the same thread. Interleaved, a turn
could restore an epoch the compaction just cleared, Codex would see a turn and a compaction on
one thread at once, and two turns would both start a thread (one orphaned, neither seeing the
other's messages). Both therefore hold the session for their whole duration, in two layers
taken in this order:

1. the in-process *gate* (an :class:`anyio.Lock` per session), where this process's tasks
   queue;
2. the cross-process *lease* (:mod:`codex_turn.harness.session._lease`): OpenClaw's session
   lock file, held for the whole turn and renewed, so another process (ours or OpenClaw's)
   waits exactly as a second task does. The turn's own mirror writes under it without taking
   the file again.

Waiting is the same for both layers, one deadline for the two: ``reject`` raises
:class:`SessionBusy` at once if either is held (a stale lock file is still taken over);
``wait`` waits up to ``wait_timeout`` seconds in all, then raises :class:`SessionBusy`. A live
holder is never dispossessed on a timeout. The lock file is polled from a worker thread with
jittered backoff (:data:`_POLL_MIN` to :data:`_POLL_MAX`); the wait is cancellable. Gates and
leases are keyed by :func:`codex_turn.harness._fs.session_path`, the key of the lock file. The
lease is taken and given back in one worker-thread hop each
(:func:`codex_turn.harness._fs.run_in_worker`).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import secrets
import weakref
from collections.abc import AsyncIterator
from typing import Final, Literal

import anyio
from anyio.lowlevel import RunVar

from codex_turn._log import format_error, get_logger
from codex_turn.errors import CodexTurnError
from codex_turn.harness._fs import NotRegularFileError, run_in_worker, session_path
from codex_turn.harness.session._lease import LeaseBusy, release_lease, try_acquire_lease
from codex_turn.harness.session._lock import SessionLease

__all__ = ["SessionBusy", "hold_session", "session_lane_busy"]

_log = get_logger(__name__)

#: A lock file cannot be created here because nothing can be written here.
_UNWRITABLE: Final = frozenset(
    {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.ELOOP}
)
_POLL_MIN: Final = 0.005
_POLL_MAX: Final = 0.25
_POLL_GROWTH: Final = 1.5


class SessionBusy(CodexTurnError):
    """Another turn or compaction holds this session, in this process or another
    (``concurrency="reject"``, or the wait for it timed out). Not an FSM re-entrancy (that is
    :class:`~codex_turn.fsm.TurnBusy`): the turn that raised it never started.
    ``holder_pid``: the lock file's holder when another process has it, else ``None``."""

    def __init__(self, message: str, *, holder_pid: int | None = None) -> None:
        super().__init__(message)
        self.holder_pid = holder_pid


# Held by whoever waits for or holds a gate; dropped when nobody does. One table per event
# loop (an anyio lock belongs to one loop): turns of one session on two loops (threads) of
# one process are kept apart by the lease, as two processes are.
_gates: RunVar[weakref.WeakValueDictionary[str, anyio.Lock]] = RunVar("codex_turn_session_gates")
# Session lanes (session key, else id) with a turn or compaction in progress: deferred
# maintenance waits for its lane to be idle, as OpenClaw's does.
_busy_lanes: collections.Counter[str] = collections.Counter()


def session_lane_busy(lane: str) -> bool:
    """Whether a turn or compaction of the session ``lane`` is in progress in this process."""
    return _busy_lanes[lane] > 0


def _gate_for(session_file: str | os.PathLike[str]) -> anyio.Lock:
    try:
        gates = _gates.get()
    except LookupError:
        gates = weakref.WeakValueDictionary()
        _gates.set(gates)
    key = session_path(session_file)
    gate = gates.get(key)
    if gate is None:
        gate = anyio.Lock()
        gates[key] = gate
    return gate


def _held_by(busy: LeaseBusy) -> str:
    if busy.holder_pid is None:
        return "another holder"
    if busy.holder_pid == os.getpid():
        return "this process"
    return f"pid {busy.holder_pid}"


async def _take_lease(
    session_file: str | os.PathLike[str],
    *,
    wait: Literal["wait", "reject"],
    deadline: float,
    create_directory: bool,
) -> SessionLease | None:
    """The session's lease, polling until ``deadline``; ``None`` when no lock file can be
    created there at all (nothing can be written there either: the turn's preflight says
    why). Raises :class:`SessionBusy` for a live holder at the deadline (at once: ``reject``)."""
    pause = _POLL_MIN
    while True:
        outcome = await run_in_worker(
            lambda: try_acquire_lease(session_file, create_directory=create_directory)
        )
        if isinstance(outcome, SessionLease):
            return outcome
        if isinstance(outcome, OSError):
            # Nothing can be written there (the preflight refuses the turn and says why), or
            # a rare I/O fault: the turn goes on without a cross-process lease.
            quiet = isinstance(outcome, NotRegularFileError) or outcome.errno in _UNWRITABLE
            (_log.debug if quiet else _log.warning)(
                "session lease unavailable", error=format_error(outcome)
            )
            return None
        if wait == "reject":
            raise SessionBusy(
                f"another turn or compaction is running on this session ({_held_by(outcome)})",
                holder_pid=outcome.holder_pid,
            )
        left = deadline - anyio.current_time()
        if left <= 0:
            raise SessionBusy(
                "timed out waiting for the previous turn or compaction on this session "
                f"({_held_by(outcome)})",
                holder_pid=outcome.holder_pid,
            )
        await anyio.sleep(min(left, pause * (0.5 + secrets.randbelow(100) / 200)))
        pause = min(_POLL_MAX, pause * _POLL_GROWTH)


@contextlib.asynccontextmanager
async def hold_session(
    session_file: str | os.PathLike[str],
    *,
    lane: str | None = None,
    wait: Literal["wait", "reject"] = "wait",
    wait_timeout: float = 30.0,
    create_directory: bool = True,
) -> AsyncIterator[None]:
    """Hold the session: its in-process gate, then its cross-process lease (module docstring).

    ``reject``: raise :class:`SessionBusy` at once if either is held; ``wait``: wait up to
    ``wait_timeout`` seconds in all, then raise :class:`SessionBusy`. ``lane`` (the session
    key, else the id) is reported busy meanwhile (:func:`session_lane_busy`).
    ``create_directory``: create the session's directory for the lock file if missing (a turn
    creates its transcript there anyway; a compaction of a session that does not exist
    creates nothing, and holds no lease).
    """
    gate = _gate_for(session_file)
    if wait == "reject" and gate.locked():
        raise SessionBusy("another turn or compaction is running on this session")
    deadline = anyio.current_time() + wait_timeout
    with anyio.move_on_after(wait_timeout) as waiting:
        await gate.acquire()
    if waiting.cancelled_caught:
        raise SessionBusy("timed out waiting for the previous turn or compaction on this session")
    try:
        lease = await _take_lease(
            session_file, wait=wait, deadline=deadline, create_directory=create_directory
        )
    except BaseException:
        gate.release()
        raise
    if lane is not None:
        _busy_lanes[lane] += 1
    try:
        yield
    finally:
        if lane is not None:
            _busy_lanes[lane] -= 1
            if not _busy_lanes[lane]:
                del _busy_lanes[lane]
        try:
            if lease is not None:
                with anyio.CancelScope(shield=True):  # given back, even by a cancelled turn
                    await run_in_worker(release_lease, lease)
        finally:
            gate.release()
