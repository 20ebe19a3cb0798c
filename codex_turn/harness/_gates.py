"""One gate per session file: turns and compactions of a session never overlap in-process.

A turn reads the binding, talks to Codex and writes the binding back; a compaction clears the
binding's projection and sends ``thread/compact/start`` on the same thread. Interleaved, a turn
could restore an epoch the compaction just cleared, and Codex would see a turn and a compaction
on one thread at once. Both therefore hold the session's gate. Across processes the transcript
lock (``session.py``) protects the file; the gate is for one process's tasks.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import AsyncIterator
from typing import Literal

import anyio

from codex_turn.fsm import TurnBusy

__all__ = ["hold_session"]

# Held by whoever waits for or holds a gate; dropped when nobody does.
_gates: weakref.WeakValueDictionary[str, anyio.Lock] = weakref.WeakValueDictionary()


def _gate_for(session_file: str) -> anyio.Lock:
    key = os.path.realpath(session_file)
    gate = _gates.get(key)
    if gate is None:
        gate = anyio.Lock()
        _gates[key] = gate
    return gate


@contextlib.asynccontextmanager
async def hold_session(
    session_file: str, *, wait: Literal["wait", "reject"] = "wait", wait_timeout: float = 30.0
) -> AsyncIterator[None]:
    """Hold the session's gate. ``reject``: raise :class:`TurnBusy` at once if it is held;
    ``wait``: wait up to ``wait_timeout`` seconds, then raise :class:`TurnBusy`."""
    gate = _gate_for(session_file)
    if wait == "reject" and gate.locked():
        raise TurnBusy("another turn or compaction is running on this session")
    with anyio.move_on_after(wait_timeout) as waiting:
        await gate.acquire()
    if waiting.cancelled_caught:
        raise TurnBusy("timed out waiting for the previous turn or compaction on this session")
    try:
        yield
    finally:
        gate.release()
