"""The pi transcript format: parsing, migration and the conversation on a path. No I/O.

A transcript is an OpenClaw/pi JSONL v3 file, and a *tree written as a log*. Line 1 is a
``type: "session"`` header; every later line is an entry with an ``id`` and a ``parentId``.
Nothing is ever edited in place: a branch, a rewrite or a compaction is expressed by
appending entries whose parents point back into the tree, and the conversation the model
sees is the *path* from the last line up to the root (:func:`build_session_context`, a port
of pi's ``buildSessionContext``).

Rules of this module
--------------------
1. **Reading is a fold over lines.** Each complete line either parses to a JSON object or is
   skipped and counted (:class:`Fold`), so the state after ``N`` bytes only depends on those
   bytes; that is what lets the read cache (``_cache.py``) fold only appended bytes. The bytes
   after the last newline (a torn write, or a line still being written) are never folded:
   they are parsed on their own (:func:`parse_tail`) and count only if they already form a
   JSON object, as pi's parser does.
2. **Everything is in memory.** v1/v2 files are migrated to v3 on each read
   (:func:`migrate_session_entries`) without touching the inputs or the file; pi rewrites them
   on open, we never do. Functions here take bytes or entries and return values; they open no
   files, take no locks and keep no state.
3. **pi's semantics, minus its crashes.** Non-object JSON lines are dropped (pi keeps them and
   then fails), cyclic parent chains stop the walk (pi loops forever), ``NaN``/``Infinity``
   are rejected as ``JSON.parse`` does, and invalid UTF-8 becomes U+FFFD as in Node.
4. **A line nested too deeply is quarantined.** A line whose value nests objects and arrays
   deeper than :data:`~codex_turn._json.MAX_JSON_DEPTH` is skipped and counted as malformed,
   like a line that is not JSON: every later stage walks messages, and one such entry would
   otherwise break a stage of every later turn of the session. The bound is applied here,
   once, so nothing after the reader meets a deeper message.

Messages are plain JSON dicts, never interpreted beyond ``role`` and ``idempotencyKey``, so
unknown keys round-trip untouched.

Size (~680 lines): the format is one vocabulary (parsing, header checks, migration and the
path to the root), pure and read as a whole; the I/O around it already lives in the sibling
modules.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final, Protocol, TypeVar, overload

import attrs

from codex_turn._json import MAX_JSON_DEPTH, AgentMessage, nested_deeper_than
from codex_turn.errors import CodexTurnError

__all__ = [
    "CURRENT_SESSION_VERSION",
    "MessageHistory",
    "ModelRef",
    "ParsedSession",
    "SessionContext",
    "SessionError",
    "SessionFormatError",
    "TranscriptUnwritable",
    "build_session_context",
    "migrate_session_entries",
    "parse_session_bytes",
]

Entry = dict[str, Any]

_E = TypeVar("_E")


class _EntryLike(Protocol):
    """What the path rules read of an entry: a dict, or the streaming reader's lazy entry."""

    def get(self, key: str, default: Any = ..., /) -> Any: ...
    def __getitem__(self, key: str, /) -> Any: ...
    def __contains__(self, key: object, /) -> bool: ...


CURRENT_SESSION_VERSION: Final = 3
UTF8_BOM: Final = b"\xef\xbb\xbf"
_MISSING: Final = object()


# --------------------------------------------------------------------------------------------
# Errors


class SessionError(CodexTurnError):
    """Base class of the session transcript errors."""


class TranscriptUnwritable(SessionError):
    """The transcript cannot take this turn's mirror: the path is a directory, a FIFO or
    another non-regular file, a dangling symbolic link, not writable, or a file that is not
    a session transcript (:class:`SessionFormatError`). ``why`` names the problem, never the
    file's content."""

    def __init__(self, path: str, why: str, *, message: str | None = None) -> None:
        super().__init__(message or f"session transcript {path} cannot be written: {why}")
        self.path = path
        self.why = why


class SessionFormatError(TranscriptUnwritable):
    """The file exists but is not a session transcript the mirror may append to."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(path, why, message=f"{path} is not a session transcript: {why}")


# --------------------------------------------------------------------------------------------
# Public value types


@attrs.frozen
class ModelRef:
    """The model in force at the leaf: the last ``model_change`` or assistant message."""

    provider: str | None
    model_id: str | None


class MessageHistory(Sequence[AgentMessage]):
    """An immutable view of the first ``n`` messages of an append-only list.

    The read cache extends its message list in place when a transcript grows, so handing out
    a view of the current prefix costs O(1) where a copy would cost O(messages): re-reads stay
    independent of the transcript's size. Later appends are invisible to an existing view;
    slices and :meth:`to_list` return fresh lists. The message dicts are shared with the
    cache: treat them as read-only.
    """

    __slots__ = ("_items", "_length", "source_bytes")

    def __init__(
        self, items: list[AgentMessage], length: int | None = None, *, source_bytes: int = 0
    ) -> None:
        self._items = items
        self._length = len(items) if length is None else length
        #: The transcript bytes behind this view (what a cache of it is charged for).
        self.source_bytes = source_bytes

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> AgentMessage: ...

    @overload
    def __getitem__(self, index: slice) -> list[AgentMessage]: ...

    def __getitem__(self, index: int | slice) -> AgentMessage | list[AgentMessage]:
        if isinstance(index, slice):
            return self._items[slice(*index.indices(self._length))]
        position = index + self._length if index < 0 else index
        if not 0 <= position < self._length:
            raise IndexError("message index out of range")
        return self._items[position]

    def __iter__(self) -> Iterator[AgentMessage]:
        return itertools.islice(self._items, self._length)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MessageHistory | list | tuple):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable contents, like list

    def __repr__(self) -> str:
        return f"MessageHistory({self.to_list()!r})"

    def to_list(self) -> list[AgentMessage]:
        """A fresh list of the messages (O(n)); the dicts themselves are still shared."""
        return self._items[: self._length]

    def appended_since(self, earlier: MessageHistory) -> list[AgentMessage] | None:
        """The messages this view adds to ``earlier`` when it extends it (a later read of the
        same, only appended-to transcript), else ``None`` (the history was rebuilt).

        Lets a caller keep work it derived from an earlier read and do O(new) more.
        """
        if earlier._items is not self._items or earlier._length > self._length:
            return None
        return self._items[earlier._length : self._length]


@attrs.frozen
class SessionContext:
    """What pi's ``buildSessionContext`` returns: the path's AgentMessages and settings."""

    messages: Sequence[AgentMessage]
    thinking_level: str = "off"
    model: ModelRef | None = None


@attrs.frozen
class ParsedSession:
    """The result of parsing transcript bytes (no migration, no tree walk).

    ``header`` is the first JSON object when it is a valid session header, else ``None``.
    ``entries`` are every later object line except extra ``session`` lines, in file order.
    """

    header: Entry | None
    entries: tuple[Entry, ...]
    malformed_lines: int
    non_object_lines: int
    first_object: Entry | None
    torn_tail: bool


# --------------------------------------------------------------------------------------------
# Parsing: a fold over complete lines


def _reject_constant(name: str) -> Any:
    # JSON.parse rejects NaN/Infinity; so must we, or a line pi skips would enter the context.
    raise ValueError(f"non-JSON constant {name}")


_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant)
_BLANK: Final = object()
BAD: Final = object()


def parse_line(raw: bytes) -> object:
    # Invalid UTF-8 becomes U+FFFD, as Node's utf8 decoding does; "\r" before "\n" is JSON
    # whitespace, so CRLF files parse unchanged.
    text = raw.decode("utf-8", "replace")
    if not text.strip():
        return _BLANK
    try:
        value = _DECODER.decode(text)
    except (ValueError, RecursionError):
        return BAD
    # Rule 4. Counting brackets (in C) bounds the depth from above, so the walk only runs
    # for the rare line with that many of them.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and nested_deeper_than(value):
        return BAD
    return value


def idempotency_key(entry: Entry) -> str | None:
    message = entry.get("message")
    if isinstance(message, dict):
        key = message.get("idempotencyKey")
        if isinstance(key, str) and key.strip():
            return key.strip()
    return None


_LEGACY_KEY: Final = re.compile(r"^(codex-app-server:.+):(user|assistant):\d+$")


def is_tool_result(entry: Entry) -> bool:
    message = entry.get("message")
    return (
        entry.get("type") == "message"
        and isinstance(message, dict)
        and message.get("role") == "toolResult"
    )


@attrs.define
class Fold:
    """The state after folding a prefix of complete lines. Mutated only under its file lock."""

    objects: list[Entry] = attrs.Factory(list)  # every object line, header included
    entries: list[Entry] = attrs.Factory(list)  # object lines except `session` ones
    first_object: Entry | None = None
    malformed: int = 0
    non_objects: int = 0
    by_id: dict[str, Entry] = attrs.Factory(dict)
    keys: set[str] = attrs.Factory(set)
    # PR-era keys `<scope>:<turnId>:<role>:<i>`, indexed by (`<scope>:<turnId>`, role).
    legacy: dict[tuple[str, str], list[AgentMessage]] = attrs.Factory(dict)
    last_linked_id: str | None = None  # the last parent-linked entry (OpenClaw's append leaf)
    last_linked_non_tool_id: str | None = None
    last_duplicate_at: int = -1  # index in `entries` of the last entry re-using an id
    # Parent ids named before any entry had them; an entry that arrives with one of them
    # re-routes the older paths that stopped there (index of the last such entry).
    missing_parents: set[str] = attrs.Factory(set)
    last_late_parent_at: int = -1

    @property
    def header(self) -> Entry | None:
        first = self.first_object
        if first is not None and first.get("type") == "session":
            return first
        return None

    def feed(self, raw: bytes) -> None:
        value = parse_line(raw)
        if value is _BLANK:
            return
        if value is BAD:
            self.malformed += 1
        elif isinstance(value, dict):
            self.add(value)
        else:
            # pi keeps these and then crashes or loses the context; OpenClaw's later reader
            # drops them, and so do we.
            self.non_objects += 1

    def add(self, obj: Entry) -> None:
        self.objects.append(obj)
        if self.first_object is None:
            self.first_object = obj
        key = idempotency_key(obj)
        if key is not None:
            self.keys.add(key)
            legacy = _LEGACY_KEY.match(key)
            if legacy is not None:
                self.legacy.setdefault((legacy[1], legacy[2]), []).append(obj["message"])
        if obj.get("type") == "session":
            return
        self.entries.append(obj)
        entry_id = obj.get("id")
        if isinstance(entry_id, str):
            if entry_id in self.by_id:
                self.last_duplicate_at = len(self.entries) - 1
            if entry_id in self.missing_parents:
                self.missing_parents.discard(entry_id)
                self.last_late_parent_at = len(self.entries) - 1
            self.by_id[entry_id] = obj
            if entry_id and "parentId" in obj:
                self.last_linked_id = entry_id
                if not is_tool_result(obj):
                    self.last_linked_non_tool_id = entry_id
        parent = obj.get("parentId")
        if isinstance(parent, str) and parent and parent not in self.by_id:
            self.missing_parents.add(parent)


def feed_lines(fold: Fold, data: bytes, *, at_start: bool) -> None:
    if at_start and data.startswith(UTF8_BOM):
        data = data[len(UTF8_BOM) :]  # JS trim() drops a leading BOM
    for raw in data.split(b"\n"):
        fold.feed(raw)


def split_complete(data: bytes) -> tuple[bytes, bytes]:
    """Split ``data`` into complete lines (ending in a newline) and the unterminated rest."""
    cut = data.rfind(b"\n") + 1
    return data[:cut], data[cut:]


def parse_tail(tail: bytes, *, at_start: bool) -> tuple[Entry | None, bool]:
    """Parse the unterminated last line: (object or None, torn?)."""
    if at_start and tail.startswith(UTF8_BOM):
        tail = tail[len(UTF8_BOM) :]
    value = parse_line(tail)
    if value is _BLANK:
        return None, False
    if isinstance(value, dict):
        return value, False
    return None, True


def parse_session_bytes(data: bytes) -> ParsedSession:
    """Parse transcript bytes the way pi does, minus its crashes.

    Blank lines are skipped; lines that are not JSON, or nest deeper than
    :data:`~codex_turn._json.MAX_JSON_DEPTH`, are skipped and counted; JSON values that
    are not objects are dropped and counted; a last line without a newline is kept only if it
    already parses to an object (otherwise it is a torn write and ``torn_tail`` is set).
    """
    complete, tail = split_complete(data)
    fold = Fold()
    feed_lines(fold, complete[:-1] if complete else b"", at_start=True)
    tentative, torn = parse_tail(tail, at_start=not complete)
    if tentative is not None:
        fold.add(tentative)
    tail_bad = torn and parse_line(tail) is BAD
    first = fold.first_object
    return ParsedSession(
        header=valid_header(first),
        entries=tuple(fold.entries),
        malformed_lines=fold.malformed + int(tail_bad),
        non_object_lines=fold.non_objects + int(torn and not tail_bad),
        first_object=first,
        torn_tail=torn,
    )


def valid_header(first: Entry | None) -> Entry | None:
    if first is not None and first.get("type") == "session" and isinstance(first.get("id"), str):
        return first
    return None


def first_object_problem(first: Entry | None) -> str | None:
    """Why a transcript whose first object is ``first`` reads as empty (``"empty"``: quietly;
    anything else: with a warning), or ``None`` when it has a valid session header."""
    if first is None:
        return "empty"
    if first.get("type") != "session":
        return "first object is not a session header"
    if not isinstance(first.get("id"), str):
        return "session header has no string id"
    return None


# --------------------------------------------------------------------------------------------
# Migration (in memory only)


def header_version(header: Mapping[str, Any]) -> float:
    """``header.version ?? 1`` with JS number coercion (NaN compares false both ways)."""
    value = header.get("version")
    if value is None:
        return 1.0
    if isinstance(value, bool | int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip() or "0")
        except ValueError:
            return math.nan
    return math.nan


def _legacy_id(seed: str, ordinal: int, taken: set[str]) -> str:
    # pi draws random ids; deterministic ones keep repeated reads of one v1 file consistent.
    counter = 0
    while True:
        digest = hashlib.sha256(f"{seed}\0{ordinal}\0{counter}".encode()).hexdigest()[:8]
        if digest not in taken:
            taken.add(digest)
            return digest
        counter += 1


def migrate_session_entries(
    header: Entry, objects: Sequence[Entry]
) -> tuple[Entry, list[Entry], int | None]:
    """Migrate a v1/v2 transcript to v3 **in memory**, never touching the inputs.

    ``objects`` is every object line in file order, the header included (v1 compaction
    indices count from it). Returns ``(header, non-session entries, version)``; for a v3 file
    the entries are the inputs themselves. Changed entries are shallow copies.
    """
    version = header_version(header)
    entries_in = [obj for obj in objects if obj.get("type") != "session"]
    if not version < 3:  # also true for NaN, as in pi
        return header, entries_in, int(version) if math.isfinite(version) else None
    new_header = dict(header)
    copies: dict[int, Entry] = {id(obj): dict(obj) for obj in objects if obj is not header}
    if version < 2:
        new_header["version"] = 2
        taken: set[str] = set()
        seed = str(header.get("id"))
        new_ids: dict[int, str] = {}
        previous: str | None = None
        for ordinal, obj in enumerate(objects):
            if obj is header or obj.get("type") == "session":
                continue
            copy = copies[id(obj)]
            entry_id = _legacy_id(seed, ordinal, taken)
            copy["id"] = entry_id
            copy["parentId"] = previous
            new_ids[id(obj)] = entry_id
            previous = entry_id
        for obj in objects:
            if obj.get("type") != "compaction" or obj is header:
                continue
            copy = copies[id(obj)]
            index = copy.pop("firstKeptEntryIndex", None)
            if isinstance(index, bool) or not isinstance(index, int | float):
                continue
            if math.isfinite(index) and index == int(index) and 0 <= int(index) < len(objects):
                target = objects[int(index)]
                if target is not header and id(target) in new_ids:
                    copy["firstKeptEntryId"] = new_ids[id(target)]
    if version < 3:
        new_header["version"] = 3
        for obj in objects:
            migrated = copies.get(id(obj))
            if migrated is None or migrated.get("type") != "message":
                continue
            message = migrated.get("message")
            if isinstance(message, dict) and message.get("role") == "hookMessage":
                migrated["message"] = {**message, "role": "custom"}
    entries = [copies[id(obj)] for obj in entries_in]
    return new_header, entries, CURRENT_SESSION_VERSION


# --------------------------------------------------------------------------------------------
# buildSessionContext


def _js_truthy(value: object) -> bool:
    if value is None or value is False:
        return False
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value != 0 and not math.isnan(value)
    if isinstance(value, str):
        return value != ""
    return True  # objects and arrays, even empty ones, are truthy in JS


def iso_to_ms(value: object) -> int | None:
    """``new Date(iso).getTime()`` for the ISO strings writers emit; ``None`` when invalid."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    delta = parsed - _EPOCH  # integer arithmetic: float timestamps drift by a millisecond
    return delta.days * 86_400_000 + delta.seconds * 1000 + delta.microseconds // 1000


_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


def utc_now_iso() -> str:
    """``new Date().toISOString()``: UTC, millisecond precision, ``Z``."""
    now = datetime.now(UTC)
    return now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"


def dumps(obj: object) -> bytes:
    """``JSON.stringify`` bytes: compact, raw non-ASCII, no NaN; lone surrogates escaped."""
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode()


def header_line(session_id: str, cwd: str) -> bytes:
    """A new v3 header line, in pi's writer key order, newline included."""
    header = {
        "type": "session",
        "version": CURRENT_SESSION_VERSION,
        "id": session_id,
        "timestamp": utc_now_iso(),
        "cwd": cwd,
    }
    return dumps(header) + b"\n"


def _copy_present(target: dict[str, Any], source: _EntryLike, *keys: str) -> None:
    for key in keys:
        if key in source:  # JSON.stringify drops undefined: absent stays absent
            target[key] = source[key]


def entry_message(entry: _EntryLike) -> AgentMessage | None:
    kind = entry.get("type")
    if kind == "message":
        message = entry.get("message")
        return message if isinstance(message, dict) else None
    if kind == "custom_message":
        out: AgentMessage = {"role": "custom"}
        _copy_present(out, entry, "customType", "content", "display", "details")
        out["timestamp"] = iso_to_ms(entry.get("timestamp"))
        return out
    if kind == "branch_summary" and _js_truthy(entry.get("summary")):
        out = {"role": "branchSummary"}
        _copy_present(out, entry, "summary", "fromId")
        out["timestamp"] = iso_to_ms(entry.get("timestamp"))
        return out
    return None


def apply_settings(
    entry: Entry, thinking: str, model: ModelRef | None
) -> tuple[str, ModelRef | None]:
    kind = entry.get("type")
    if kind == "thinking_level_change":
        level = entry.get("thinkingLevel")
        if isinstance(level, str):
            thinking = level
    elif kind == "model_change":
        model = ModelRef(_str_or_none(entry.get("provider")), _str_or_none(entry.get("modelId")))
    elif kind == "message":
        message = entry.get("message")
        if isinstance(message, dict) and message.get("role") == "assistant":
            model = ModelRef(
                _str_or_none(message.get("provider")), _str_or_none(message.get("model"))
            )
    return thinking, model


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _parent_id(entry: Mapping[str, Any]) -> object:
    return entry.get("parentId")


def walk_to_root(leaf: _E, by_id: Mapping[str, _E], parent_of: Callable[[_E], object]) -> list[_E]:
    """The path from the root to ``leaf``; ``parent_of`` reads an entry's ``parentId`` (the
    streaming reader walks compact records, not dicts)."""
    path: list[_E] = []
    seen: set[int] = set()  # pi has no cycle guard and loops forever; we stop
    current: _E | None = leaf
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        path.append(current)
        parent = parent_of(current)
        current = by_id.get(parent) if isinstance(parent, str) and parent else None
    path.reverse()
    return path


def _context_from_path(path: Sequence[Entry]) -> SessionContext:
    thinking = "off"
    model: ModelRef | None = None
    for entry in path:
        thinking, model = apply_settings(entry, thinking, model)
    return SessionContext(list(path_messages(path)), thinking, model)


def path_messages(path: Sequence[_EntryLike]) -> Iterator[AgentMessage]:
    """The AgentMessages of a root-to-leaf path, in order: pi's compaction rule.

    A generator, so the streaming reader (``_stream.py``) can hand them on in chunks. Only
    ``type`` and ``id`` are read from entries that yield no message.
    """
    compaction_at = -1
    for index, entry in enumerate(path):
        if entry.get("type") == "compaction":
            compaction_at = index  # only the last compaction on the path counts
    if compaction_at < 0:
        for entry in path:
            message = entry_message(entry)
            if message is not None:
                yield message
        return
    compaction = path[compaction_at]
    summary: AgentMessage = {"role": "compactionSummary"}
    _copy_present(summary, compaction, "summary", "tokensBefore")
    summary["timestamp"] = iso_to_ms(compaction.get("timestamp"))
    yield summary
    first_kept = compaction.get("firstKeptEntryId", _MISSING)
    keeping = False
    for entry in itertools.islice(path, compaction_at):
        if not keeping and entry.get("id", _MISSING) == first_kept:
            keeping = True
        if keeping:
            message = entry_message(entry)
            if message is not None:
                yield message
    for entry in itertools.islice(path, compaction_at + 1, None):
        message = entry_message(entry)
        if message is not None:
            yield message


def _index(entries: Sequence[Entry]) -> dict[str, Entry]:
    by_id: dict[str, Entry] = {}
    for entry in entries:
        entry_id = entry.get("id")
        if isinstance(entry_id, str):
            by_id[entry_id] = entry  # a later duplicate wins, as in pi's Map
    return by_id


def build_session_context(
    entries: Sequence[Entry],
    leaf_id: str | None = None,
    *,
    by_id: Mapping[str, Entry] | None = None,
) -> SessionContext:
    """pi's ``buildSessionContext`` over migrated, non-header entries.

    The leaf is ``leaf_id`` when given and present, else the last entry (the last line). The
    path runs root to leaf; the walk stops at a missing or dangling parent and at a repeated
    entry. Settings come from the path (a later assistant message overrides a
    ``model_change``); only the last compaction counts, keeping the path entries from its
    ``firstKeptEntryId`` (none if that id is off the path).
    """
    index = _index(entries) if by_id is None else by_id
    leaf = index.get(leaf_id) if leaf_id is not None else None
    if leaf is None:
        if not entries:
            return SessionContext([])
        leaf = entries[-1]
    return _context_from_path(walk_to_root(leaf, index, _parent_id))
