"""One gate per session file: turns and compactions of a session never overlap in-process.

A turn reads the binding, talks to Codex and writes the binding back; a compaction clears the
binding's projection and sends ``thread/compact/start`` on the same thread. Interleaved, a turn
could restore an epoch the compaction just cleared, and Codex would see a turn and a compaction
on one thread at once. Both therefore hold the session's gate. Across processes the transcript
lock (``session/_lock.py``) protects the file; the gate is for one process's tasks. Gates are
keyed by :func:`codex_turn.harness._fs.session_path`, the key of that lock.
"""

from __future__ import annotations

import collections
import contextlib
import os
import weakref
from collections.abc import AsyncIterator
from typing import Literal

import anyio

from codex_turn.errors import CodexTurnError
from codex_turn.harness._fs import session_path

__all__ = ["SessionBusy", "hold_session", "session_lane_busy"]


class SessionBusy(CodexTurnError):
    """Another turn or compaction holds this session (``concurrency="reject"``, or the wait
    for it timed out). Not an FSM re-entrancy (that is :class:`~codex_turn.fsm.TurnBusy`):
    the turn that raised it never started."""


# Held by whoever waits for or holds a gate; dropped when nobody does.
_gates: weakref.WeakValueDictionary[str, anyio.Lock] = weakref.WeakValueDictionary()
# Session lanes (session key, else id) with a turn or compaction in progress: deferred
# maintenance waits for its lane to be idle, as OpenClaw's does.
_busy_lanes: collections.Counter[str] = collections.Counter()


def session_lane_busy(lane: str) -> bool:
    """Whether a turn or compaction of the session ``lane`` is in progress in this process."""
    return _busy_lanes[lane] > 0


def _gate_for(session_file: str | os.PathLike[str]) -> anyio.Lock:
    key = session_path(session_file)
    gate = _gates.get(key)
    if gate is None:
        gate = anyio.Lock()
        _gates[key] = gate
    return gate


@contextlib.asynccontextmanager
async def hold_session(
    session_file: str | os.PathLike[str],
    *,
    lane: str | None = None,
    wait: Literal["wait", "reject"] = "wait",
    wait_timeout: float = 30.0,
) -> AsyncIterator[None]:
    """Hold the session's gate. ``reject``: raise :class:`SessionBusy` at once if it is held;
    ``wait``: wait up to ``wait_timeout`` seconds, then raise :class:`SessionBusy`. ``lane``
    (the session key, else the id) is reported busy meanwhile (:func:`session_lane_busy`)."""
    gate = _gate_for(session_file)
    if wait == "reject" and gate.locked():
        raise SessionBusy("another turn or compaction is running on this session")
    with anyio.move_on_after(wait_timeout) as waiting:
        await gate.acquire()
    if waiting.cancelled_caught:
        raise SessionBusy("timed out waiting for the previous turn or compaction on this session")
    if lane is not None:
        _busy_lanes[lane] += 1
    try:
        yield
    finally:
        if lane is not None:
            _busy_lanes[lane] -= 1
            if not _busy_lanes[lane]:
                del _busy_lanes[lane]
        gate.release()
