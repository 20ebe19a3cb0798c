"""The streaming reader: a transcript's conversation in chunks, without keeping its graph.

Theory
------
:func:`load_session_context` keeps what it parses (the read cache), which is what makes a
turn's re-read O(new bytes), and costs a parsed object graph of ~4x the file: for a 30 MB
transcript ~134k objects the garbage collector traverses on every full collection (~130 ms
with the GIL held, whichever thread triggered it). A one-off consumer (an engine's cold
bootstrap importing a transcript into its own store) needs every message once, in order,
and nothing after: :func:`iter_session_messages` gives it exactly that.

It makes two passes over the bytes, read once. The first parses every line (the fold's
rules: ``_format.parse_line``) and keeps per entry only a tuple of atoms ``(id, parentId,
type, line)``, a shape CPython stops tracking at the first young collection, so the full
collections it provokes stay short. The path is walked over those records with
``_format.walk_to_root`` and the messages come from ``_format.path_messages`` (pi's
compaction rule) over lazy entries that parse their line again only when a field other than
the three kept ones is read: one implementation of the format, two representations. Cost:
about twice the parse CPU of a cached read; memory: the file's bytes plus ~150 bytes per
entry while it runs, then nothing. Messages are fresh dicts owned by the caller.

A transcript already in the read cache is served from it (O(new bytes), shared read-only
dicts), and a pre-v3 transcript goes through the cache's migration (rare: pi rewrites them).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Sequence
from typing import Any, Final, overload

from codex_turn._json import AgentMessage
from codex_turn._log import get_logger
from codex_turn.harness._fs import open_regular, pread_exact, session_path
from codex_turn.harness.session._cache import holds_context, load_session_context
from codex_turn.harness.session._format import (
    BAD,
    UTF8_BOM,
    Entry,
    SessionError,
    first_object_problem,
    header_version,
    parse_line,
    parse_tail,
    path_messages,
    split_complete,
    walk_to_root,
)

__all__ = ["DEFAULT_CHUNK", "iter_session_messages"]

_log = get_logger(__name__)

_ABSENT: Final = object()  # the key is not in the entry
_OTHER: Final = object()  # present, but not a string or null: parse the line to know
_FIELDS: Final = {"id": 0, "parentId": 1, "type": 2}
DEFAULT_CHUNK: Final = 1024

# (id, parentId, type, line bytes or the parsed tail): atoms only, so untracked by the GC
_Record = tuple[Any, Any, Any, Any]


def _field(entry: Entry, key: str) -> Any:
    value = entry.get(key, _ABSENT)
    return value if value is None or value is _ABSENT or isinstance(value, str) else _OTHER


def _record(entry: Entry, line: object) -> _Record:
    return (_field(entry, "id"), _field(entry, "parentId"), _field(entry, "type"), line)


def _parent_of(record: _Record) -> object:
    return record[1]


class _LazyEntry:
    """An entry read through its record; the line is parsed on the first other field."""

    __slots__ = ("_entry", "_record")

    def __init__(self, record: _Record) -> None:
        self._record = record
        self._entry: Entry | None = None

    def _full(self) -> Entry:
        if self._entry is None:
            line = self._record[3]
            value = line if isinstance(line, dict) else parse_line(line)
            assert isinstance(value, dict)  # it parsed to an object in the first pass
            self._entry = value
        return self._entry

    def get(self, key: str, default: Any = None) -> Any:
        slot = _FIELDS.get(key)
        if slot is not None:
            value = self._record[slot]
            if value is _ABSENT:
                return default
            if value is not _OTHER:
                return value
        return self._full().get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self._full()[key]

    def __contains__(self, key: object) -> bool:
        return key in self._full()


class _LazyPath(Sequence[_LazyEntry]):
    __slots__ = ("_records",)

    def __init__(self, records: list[_Record]) -> None:
        self._records = records

    def __len__(self) -> int:
        return len(self._records)

    @overload
    def __getitem__(self, index: int) -> _LazyEntry: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[_LazyEntry]: ...

    def __getitem__(self, index: int | slice) -> _LazyEntry | Sequence[_LazyEntry]:
        if isinstance(index, slice):
            return _LazyPath(self._records[index])
        return _LazyEntry(self._records[index])

    def __iter__(self) -> Iterator[_LazyEntry]:
        return map(_LazyEntry, self._records)


def _read_all(path: str) -> bytes | None:
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise SessionError(f"cannot read session transcript {path}: {error}") from error
    try:
        return pread_exact(fd, os.fstat(fd).st_size, 0)
    except OSError as error:
        raise SessionError(f"cannot read session transcript {path}: {error}") from error
    finally:
        os.close(fd)


def _chunks(messages: Iterator[AgentMessage], size: int) -> Iterator[list[AgentMessage]]:
    batch: list[AgentMessage] = []
    for message in messages:
        batch.append(message)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def iter_session_messages(
    path: str | os.PathLike[str], chunk: int = DEFAULT_CHUNK
) -> Iterator[list[AgentMessage]]:
    """The messages :func:`load_session_context` would return, in lists of at most ``chunk``.

    Same reading rules and failures (a missing, empty or foreign file gives nothing; an
    unreadable one raises :class:`SessionError` before the first chunk), but an uncached
    transcript is not cached and its parsed graph is never held whole: a chunk is the only
    thing alive once the caller drops the previous one. Synchronous: run each ``next`` in a
    worker thread (or the whole loop in one).
    """
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    key = session_path(path)
    if holds_context(key):
        return _chunks(iter(load_session_context(key).messages), chunk)
    data = _read_all(key)  # read now: an unreadable file fails the call, not a later next()
    if data is None:
        return iter(())
    return _stream(key, data, chunk)


def _stream(key: str, data: bytes, chunk: int) -> Iterator[list[AgentMessage]]:
    complete, tail = split_complete(data)
    del data
    at_start = not complete
    body = complete[:-1] if complete else b""
    if body.startswith(UTF8_BOM):
        body = body[len(UTF8_BOM) :]
    records: list[_Record] = []
    by_id: dict[str, _Record] = {}
    first: Entry | None = None
    malformed = 0
    # Line by line, not split(): one list of 40k lines more for each collection to traverse.
    for line in io.BytesIO(body) if complete else ():
        value = parse_line(line)
        if value is BAD:
            malformed += 1
        if not isinstance(value, dict):
            continue
        if first is None:
            first = value
        if value.get("type") == "session":
            continue
        record = _record(value, line)
        records.append(record)
        if isinstance(record[0], str):
            by_id[record[0]] = record  # a later duplicate wins, as in pi's Map
    del body, complete
    tentative, torn = parse_tail(tail, at_start=at_start)
    if torn and parse_line(tail) is BAD:
        malformed += 1
    if tentative is not None:
        if first is None:
            first = tentative
        if tentative is not first and tentative.get("type") != "session":
            record = _record(tentative, tentative)
            records.append(record)
            if isinstance(record[0], str):
                by_id[record[0]] = record
    problem = first_object_problem(first)
    if problem is not None:
        if problem != "empty":
            _log.warning("session transcript ignored", path=key, reason=problem)
        return
    assert first is not None
    if header_version(first) < 3:
        yield from _chunks(iter(load_session_context(key).messages), chunk)
        return
    if malformed:
        _log.warning("session transcript has malformed lines", path=key, malformed_lines=malformed)
    if not records:
        return
    path = walk_to_root(records[-1], by_id, _parent_of)
    del records, by_id
    yield from _chunks(path_messages(_LazyPath(path)), chunk)
