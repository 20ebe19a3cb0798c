"""The memory ceiling of the transcript caches: one byte budget, least recently used out.

Theory
------
Two caches keep parsed transcripts between turns: the read cache (``_cache.py``: the fold
and the conversation of each transcript) and the stripped, frozen histories of
:mod:`codex_turn.harness.history_cache`. Bounding them by *count* gave a cliff (the 33rd
session re-parsed its whole file every turn) and no bound at all on memory (a count of
huge sessions). Both now charge one process-wide ledger with an *estimate of the bytes they
retain*, and the least recently used charges are evicted until the total is back under the
ceiling, whoever owns them. The estimate is proportional to the transcript bytes behind an
entry (measured on a 30 MB, 41k-message transcript with CPython 3.11: a read-cache state
retains 3.9 bytes per file byte, a frozen stripped copy 1.0; see :data:`READ_BYTES_PER_BYTE`).

The ceiling is :data:`DEFAULT_LIMIT` (an eighth of the machine's physical memory, at least
256 MiB and at most 4 GiB: 3 GiB on a 24 GiB machine), or ``$CODEX_TURN_SESSION_CACHE_BYTES``
read at import, or :func:`set_session_cache_limit`. A fixed 256 MiB held only about eleven
sessions of 10k messages, and one 100k-message session (a 72 MB transcript) did not fit at
all, so every other session was evicted on each of its turns. The total never exceeds it by
more than the entry being charged (an entry larger than the ceiling stays until the next
charge evicts it) and entries whose owner is busy (a read in progress holds its state; it is
skipped, never waited for). An evicted session keeps nothing: its next read parses its file
afresh, the cost it had before it was ever cached.

Eviction callbacks run with the ledger lock held and may only *try* to take other locks, so
no lock order can deadlock; what they detach is dropped after the lock is released.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Final

import attrs

from codex_turn._env import int_from_env
from codex_turn._log import get_logger

__all__ = [
    "DEFAULT_LIMIT",
    "ENV_LIMIT",
    "session_cache_limit",
    "session_cache_usage",
    "set_session_cache_limit",
]

_log = get_logger(__name__)

_MIN_DEFAULT: Final = 256 * 1024 * 1024
_MAX_DEFAULT: Final = 4 * 1024 * 1024 * 1024


def _default_limit() -> int:
    """An eighth of physical memory, clamped to [256 MiB, 4 GiB] (256 MiB when unknown)."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return _MIN_DEFAULT
    return max(_MIN_DEFAULT, min(_MAX_DEFAULT, physical // 8))


DEFAULT_LIMIT: Final = _default_limit()
ENV_LIMIT: Final = "CODEX_TURN_SESSION_CACHE_BYTES"
#: Bytes a read-cache state retains per committed transcript byte (entries, messages,
#: indexes); a frozen copy of the messages retains about one byte per transcript byte.
READ_BYTES_PER_BYTE: Final = 4
FROZEN_BYTES_PER_BYTE: Final = 1
#: The fixed part of any entry (state object, lock, small fields, list headers).
ENTRY_OVERHEAD: Final = 1024

#: Detaches an entry's heavy part and returns it (to be dropped outside the ledger lock),
#: or returns ``None`` when the entry is busy and must be skipped.
Evictor = Callable[[], object | None]


@attrs.define
class _Charge:
    nbytes: int
    evict: Evictor


def _limit_from_env() -> int:
    return int_from_env(ENV_LIMIT, default=DEFAULT_LIMIT, low=0, what="session cache limit")


class _Ledger:
    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._charges: OrderedDict[Hashable, _Charge] = OrderedDict()
        self.total = 0
        self.limit = limit

    def charge(self, key: Hashable, nbytes: int, evict: Evictor) -> None:
        """Set ``key``'s charge, make it the most recently used, and evict to the ceiling."""
        garbage: list[object] = []
        with self._lock:
            old = self._charges.pop(key, None)
            if old is not None:
                self.total -= old.nbytes
            self._charges[key] = _Charge(nbytes, evict)
            self.total += nbytes
            self._shrink(garbage, keep=key)
        del garbage  # the evicted graphs are freed here, without the lock

    def release(self, key: Hashable) -> None:
        with self._lock:
            old = self._charges.pop(key, None)
            if old is not None:
                self.total -= old.nbytes

    def set_limit(self, limit: int) -> None:
        garbage: list[object] = []
        with self._lock:
            self.limit = limit
            self._shrink(garbage, keep=None)
        del garbage

    def evict_all(self) -> None:
        """Evict every entry that is not busy (the ceiling stays as it is)."""
        garbage: list[object] = []
        with self._lock:
            limit, self.limit = self.limit, 0
            try:
                self._shrink(garbage, keep=None)
            finally:
                self.limit = limit
        del garbage

    def _shrink(self, garbage: list[object], keep: Hashable | None) -> None:
        if self.total <= self.limit:
            return
        for key in list(self._charges):
            if self.total <= self.limit:
                return
            if key == keep:
                continue
            charge = self._charges[key]
            detached = charge.evict()
            if detached is None:
                continue  # busy: a read holds it now; it is charged again when done
            garbage.append(detached)
            del self._charges[key]
            self.total -= charge.nbytes


_ledger: Final = _Ledger(_limit_from_env())


def set_session_cache_limit(max_bytes: int | None) -> None:
    """Set the ceiling of the transcript caches, in (estimated) retained bytes; ``None``
    restores the default (``$CODEX_TURN_SESSION_CACHE_BYTES``, else 256 MiB). ``0`` keeps
    only the entry in use. Shrinking evicts at once."""
    if max_bytes is not None and max_bytes < 0:
        raise ValueError("the session cache limit must be >= 0")
    _ledger.set_limit(_limit_from_env() if max_bytes is None else max_bytes)


def session_cache_limit() -> int:
    """The ceiling in bytes."""
    return _ledger.limit


def session_cache_usage() -> int:
    """The bytes currently accounted to the transcript caches (an estimate)."""
    return _ledger.total


def charge(key: Hashable, nbytes: int, evict: Evictor) -> None:
    _ledger.charge(key, nbytes, evict)


def release(key: Hashable) -> None:
    _ledger.release(key)


def evict_all() -> None:
    """Drop every cached copy the ledger accounts for (the read cache's and the stripped
    histories built on it), but those a read holds at this moment."""
    _ledger.evict_all()
