"""The per-session stripped, frozen history a turn hands to engines and hooks.

A transcript read is O(new bytes) (the session read cache), but stripping hidden
runtime-context messages is a pass over the whole history; doing it per read made every
turn O(history). :class:`StrippedHistories` keeps, per session file, the stripped history of
the last read and extends it by what was appended since (``MessageHistory.appended_since``).
Its messages are frozen (:mod:`codex_turn.frozen`) as they enter, once each, so
engines and hooks cannot edit this shared copy (nor the read cache's) in place; the list
itself is a read-only :class:`~codex_turn.harness.runtime_context.FrozenHistory` handed to
every reader as it is (a copy of a 100k-message history costs ~0.3 ms, and a turn read it
twice and copied each read). An engine is handed a copy of its own
(:class:`~codex_turn.harness.runtime_context.RuntimeContextFree`).

Memory: each entry is charged to the byte ledger shared with the read cache
(``codex_turn.harness.session.budget``, one ceiling for both, least recently used out): a
frozen copy retains ~1 byte per transcript byte behind it (its containers are new; the
strings are shared with the read cache). ``capacity`` additionally bounds the count.
"""

from __future__ import annotations

import collections
import threading
import weakref

from codex_turn.frozen import freeze
from codex_turn.harness.engine.contract import AgentMessage
from codex_turn.harness.runtime_context import (
    FrozenHistory,
    RuntimeContextFree,
    strip_runtime_context_messages,
)
from codex_turn.harness.session import MessageHistory, budget, load_session_context

__all__ = ["StrippedHistories"]


class StrippedHistories:
    """The stripped history of each session's last read, extended by what was appended since.

    Keyed by session file, bounded by the shared byte ceiling and by ``capacity`` entries
    (least recently used dropped), thread-safe (reads run in worker threads).
    """

    def __init__(self, capacity: int = 4096) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[str, tuple[MessageHistory, FrozenHistory]] = (
            collections.OrderedDict()
        )

    def read(self, session_file: str) -> list[AgentMessage]:
        """The session's stripped messages: a read-only :class:`FrozenHistory`, shared with
        every other read of the same transcript state (``list(...)`` gives a mutable copy)."""
        # load_session_context raises SessionError on a read failure (load_session_messages
        # would return [] and hide it).
        history = load_session_context(session_file).messages
        if not isinstance(history, MessageHistory):
            return RuntimeContextFree(map(freeze, strip_runtime_context_messages(history)))
        with self._lock:
            previous = self._entries.get(session_file)
        added = history.appended_since(previous[0]) if previous is not None else None
        if previous is not None and added is not None:
            # One copy of the kept list per change, none when nothing was appended (the
            # history is long; what was appended is short).
            if added:
                stripped = FrozenHistory(previous[1])
                list.extend(stripped, map(freeze, strip_runtime_context_messages(added)))
            else:
                stripped = previous[1]
        else:
            stripped = FrozenHistory(map(freeze, strip_runtime_context_messages(history.to_list())))
        dropped: list[str] = []
        with self._lock:
            self._entries[session_file] = (history, stripped)
            self._entries.move_to_end(session_file)
            while len(self._entries) > self._capacity:
                dropped.append(self._entries.popitem(last=False)[0])
        for name in dropped:
            budget.release((id(self), name))
        nbytes = (
            budget.ENTRY_OVERHEAD
            + budget.FROZEN_BYTES_PER_BYTE * history.source_bytes
            + 8 * len(stripped)
        )
        budget.charge((id(self), session_file), nbytes, _evictor(self, session_file, stripped))
        return stripped  # shared, read-only: no copy per read

    def _evict(self, session_file: str, stripped: FrozenHistory) -> object | None:
        if not self._lock.acquire(blocking=False):
            return None
        try:
            entry = self._entries.get(session_file)
            if entry is not None and entry[1] is stripped:
                del self._entries[session_file]
            return entry if entry is not None else ()
        finally:
            self._lock.release()


def _evictor(
    owner: StrippedHistories, session_file: str, stripped: FrozenHistory
) -> budget.Evictor:
    ref = weakref.ref(owner)  # the ledger must not keep a dropped cache alive

    def evict() -> object | None:
        live = ref()
        return () if live is None else live._evict(session_file, stripped)

    return evict
