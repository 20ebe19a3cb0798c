"""The mirrored session transcript: an OpenClaw/pi JSONL v3 file, read exactly as pi reads it
and appended to exactly as OpenClaw appends, but crash-safe, idempotent and incremental.

Theory
------
A transcript is a *tree written as a log*. Line 1 is a ``type: "session"`` header; every later
line is an entry with an ``id`` and a ``parentId``. Nothing is ever edited in place: a branch,
a rewrite or a compaction is expressed by appending entries whose parents point back into the
tree, and the conversation the model sees is the *path* from the last line up to the root
(:func:`build_session_context`, a port of pi's ``buildSessionContext``). Two consequences
shape this module:

* **Reading is a fold over lines.** Each complete line either parses to a JSON object or is
  skipped and counted, so the state after ``N`` bytes only depends on those bytes. That makes
  the reader incremental: :class:`_FileState` caches the fold per path, keyed by the file's
  identity ``(st_dev, st_ino)`` and validated by a digest of its first and last 4 KiB; an
  appended file costs O(new bytes), a replaced or truncated one is re-read from scratch. The
  bytes after the last newline (a torn write, or a line still being written) are never folded
  into the cache: they are re-parsed on every read, and included only if they already form a
  JSON object, as pi's parser does. The derived conversation is cached as well and extended
  in O(new entries) when the new entries continue the old leaf.
* **Writing is one append per turn.** :func:`mirror_turn` serialises all entries of a turn
  into one buffer, appends it with a single ``O_APPEND`` write and ``fsync``\\s. A crash can
  therefore leave at most one torn *last* line, which the reader skips; the next append first
  writes a newline so the torn fragment stays isolated, and idempotency keys
  (``codex-app-server:<threadId>:<turnId>:<kind>``) make the retried turn append only what is
  missing. Existing bytes are never rewritten or truncated, and a new file is created with its
  header already complete (written to a private temp file, then ``link``\\ed into place, which
  fails if the name exists: an exclusive create that cannot be observed half-written).

Writers serialise on two locks, taken in this order: an in-process re-entrant
:class:`threading.RLock` per real path (so worker threads of one process queue cheaply and a
thread that already holds :func:`session_write_lock` may mirror), then OpenClaw's advisory
``<realpath(dir)>/<name>.lock`` file (exclusive create, JSON ``{pid, createdAt, starttime}``),
which other processes, including OpenClaw itself, honour. A lock file is *stale*, and is
broken, when its pid is dead or recycled, when ``createdAt`` is invalid, or when it is older
than :data:`LOCK_STALE_SECONDS`. Every wait is bounded and ends in :class:`SessionLockTimeout`.

Everything here is synchronous file I/O. An async caller runs it in a worker thread
(``anyio.to_thread.run_sync``); the locks are thread locks for exactly that reason, and must
never be awaited from the event loop thread. Messages are plain JSON dicts and are never
interpreted beyond ``role`` and ``idempotencyKey``, so unknown keys round-trip untouched.
Messages returned by the readers are shared with the cache: treat them as read-only
(``copy.deepcopy`` before mutating).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from typing import Any, Final, overload

import attrs

from codex_turn._log import format_error, get_logger, mask_session_key
from codex_turn.errors import CodexTurnError
from codex_turn.harness import binding as _binding
from codex_turn.harness._fs import fsync_directory, pid_alive

__all__ = [
    "CURRENT_SESSION_VERSION",
    "LOCK_STALE_SECONDS",
    "MessageHistory",
    "MirrorInputError",
    "MirrorResult",
    "ModelRef",
    "ParsedSession",
    "SessionContext",
    "SessionError",
    "SessionFormatError",
    "SessionLockTimeout",
    "SessionTranscript",
    "build_session_context",
    "clear_session_cache",
    "load_session_context",
    "load_session_messages",
    "migrate_session_entries",
    "mirror_turn",
    "parse_session_bytes",
    "read_session",
    "reset_session",
    "session_write_lock",
]

_log = get_logger(__name__)

Entry = dict[str, Any]
AgentMessage = dict[str, Any]

CURRENT_SESSION_VERSION: Final = 3
DEFAULT_LOCK_TIMEOUT: Final = 10.0  # OpenClaw's default session write-lock timeout
LOCK_STALE_SECONDS: Final = 30 * 60.0  # OpenClaw's staleMs
# A lock file whose payload does not parse may be mid-write by a non-atomic writer (OpenClaw
# creates, then writes): only break it once it is this old.
_LOCK_UNPARSABLE_GRACE_SECONDS: Final = 2.0
_LOCK_POLL_MIN: Final = 0.002
_LOCK_POLL_MAX: Final = 0.05
_DIGEST_SPAN: Final = 4096
_CACHE_MAX_FILES: Final = 32
_READ_CHUNK: Final = 1 << 20
_UTF8_BOM: Final = b"\xef\xbb\xbf"
_MISSING: Final = object()


# --------------------------------------------------------------------------------------------
# Errors


class SessionError(CodexTurnError):
    """Base class of the session transcript errors."""


class SessionLockTimeout(SessionError):
    """The session write lock could not be taken within the timeout."""

    def __init__(self, path: str, timeout: float, holder_pid: int | None = None) -> None:
        holder = f" (held by pid {holder_pid})" if holder_pid is not None else ""
        super().__init__(f"timed out after {timeout:.1f}s waiting for the lock on {path}{holder}")
        self.path = path
        self.timeout = timeout
        self.holder_pid = holder_pid


class SessionFormatError(SessionError):
    """The file exists but is not a session transcript this module may append to."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path} is not a session transcript: {why}")
        self.path = path
        self.why = why


class MirrorInputError(SessionError, ValueError):
    """The caller passed messages or identities that cannot be mirrored."""


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

    __slots__ = ("_items", "_length")

    def __init__(self, items: list[AgentMessage], length: int | None = None) -> None:
        self._items = items
        self._length = len(items) if length is None else length

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


@attrs.frozen
class SessionTranscript:
    """A whole transcript as read now: header, migrated entries and parse statistics."""

    path: str
    exists: bool
    header: Entry | None
    version: int | None
    entries: tuple[Entry, ...]
    malformed_lines: int
    non_object_lines: int
    torn_tail: bool
    size: int


@attrs.frozen
class MirrorResult:
    """What one :func:`mirror_turn` call did. ``appended_keys``/``entry_ids`` are parallel."""

    path: str
    created: bool
    appended_keys: tuple[str, ...]
    entry_ids: tuple[str, ...]
    skipped_keys: tuple[str, ...]
    leaf_id: str | None
    bytes_written: int

    @property
    def appended(self) -> int:
        return len(self.appended_keys)

    @property
    def skipped(self) -> int:
        return len(self.skipped_keys)


# --------------------------------------------------------------------------------------------
# Parsing: a fold over complete lines


def _reject_constant(name: str) -> Any:
    # JSON.parse rejects NaN/Infinity; so must we, or a line pi skips would enter the context.
    raise ValueError(f"non-JSON constant {name}")


_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant)
_BLANK: Final = object()
_BAD: Final = object()


def _parse_line(raw: bytes) -> object:
    # Invalid UTF-8 becomes U+FFFD, as Node's utf8 decoding does; "\r" before "\n" is JSON
    # whitespace, so CRLF files parse unchanged.
    text = raw.decode("utf-8", "replace")
    if not text.strip():
        return _BLANK
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError):
        return _BAD


def _idempotency_key(entry: Entry) -> str | None:
    message = entry.get("message")
    if isinstance(message, dict):
        key = message.get("idempotencyKey")
        if isinstance(key, str) and key.strip():
            return key.strip()
    return None


_LEGACY_KEY: Final = re.compile(r"^(codex-app-server:.+):(user|assistant):\d+$")


def _is_tool_result(entry: Entry) -> bool:
    message = entry.get("message")
    return (
        entry.get("type") == "message"
        and isinstance(message, dict)
        and message.get("role") == "toolResult"
    )


@attrs.define
class _Fold:
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

    @property
    def header(self) -> Entry | None:
        first = self.first_object
        if first is not None and first.get("type") == "session":
            return first
        return None

    def feed(self, raw: bytes) -> None:
        value = _parse_line(raw)
        if value is _BLANK:
            return
        if value is _BAD:
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
        key = _idempotency_key(obj)
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
            self.by_id[entry_id] = obj
            if entry_id and "parentId" in obj:
                self.last_linked_id = entry_id
                if not _is_tool_result(obj):
                    self.last_linked_non_tool_id = entry_id


def _feed_lines(fold: _Fold, data: bytes, *, at_start: bool) -> None:
    if at_start and data.startswith(_UTF8_BOM):
        data = data[len(_UTF8_BOM) :]  # JS trim() drops a leading BOM
    for raw in data.split(b"\n"):
        fold.feed(raw)


def _split_complete(data: bytes) -> tuple[bytes, bytes]:
    """Split ``data`` into complete lines (ending in a newline) and the unterminated rest."""
    cut = data.rfind(b"\n") + 1
    return data[:cut], data[cut:]


def _parse_tail(tail: bytes, *, at_start: bool) -> tuple[Entry | None, bool]:
    """Parse the unterminated last line: (object or None, torn?)."""
    if at_start and tail.startswith(_UTF8_BOM):
        tail = tail[len(_UTF8_BOM) :]
    value = _parse_line(tail)
    if value is _BLANK:
        return None, False
    if isinstance(value, dict):
        return value, False
    return None, True


def parse_session_bytes(data: bytes) -> ParsedSession:
    """Parse transcript bytes the way pi does, minus its crashes.

    Blank lines are skipped; lines that are not JSON are skipped and counted; JSON values that
    are not objects are dropped and counted; a last line without a newline is kept only if it
    already parses to an object (otherwise it is a torn write and ``torn_tail`` is set).
    """
    complete, tail = _split_complete(data)
    fold = _Fold()
    _feed_lines(fold, complete[:-1] if complete else b"", at_start=True)
    tentative, torn = _parse_tail(tail, at_start=not complete)
    if tentative is not None:
        fold.add(tentative)
    tail_bad = torn and _parse_line(tail) is _BAD
    first = fold.first_object
    return ParsedSession(
        header=_valid_header(first),
        entries=tuple(fold.entries),
        malformed_lines=fold.malformed + int(tail_bad),
        non_object_lines=fold.non_objects + int(torn and not tail_bad),
        first_object=first,
        torn_tail=torn,
    )


def _valid_header(first: Entry | None) -> Entry | None:
    if first is not None and first.get("type") == "session" and isinstance(first.get("id"), str):
        return first
    return None


# --------------------------------------------------------------------------------------------
# Migration (in memory only)


def _header_version(header: Mapping[str, Any]) -> float:
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
    version = _header_version(header)
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


def _iso_to_ms(value: object) -> int | None:
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


def _copy_present(target: dict[str, Any], source: Mapping[str, Any], *keys: str) -> None:
    for key in keys:
        if key in source:  # JSON.stringify drops undefined: absent stays absent
            target[key] = source[key]


def _entry_message(entry: Entry) -> AgentMessage | None:
    kind = entry.get("type")
    if kind == "message":
        message = entry.get("message")
        return message if isinstance(message, dict) else None
    if kind == "custom_message":
        out: AgentMessage = {"role": "custom"}
        _copy_present(out, entry, "customType", "content", "display", "details")
        out["timestamp"] = _iso_to_ms(entry.get("timestamp"))
        return out
    if kind == "branch_summary" and _js_truthy(entry.get("summary")):
        out = {"role": "branchSummary"}
        _copy_present(out, entry, "summary", "fromId")
        out["timestamp"] = _iso_to_ms(entry.get("timestamp"))
        return out
    return None


def _apply_settings(
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


def _walk_to_root(leaf: Entry, by_id: Mapping[str, Entry]) -> list[Entry]:
    path: list[Entry] = []
    seen: set[int] = set()  # pi has no cycle guard and loops forever; we stop
    current: Entry | None = leaf
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        path.append(current)
        parent = current.get("parentId")
        current = by_id.get(parent) if isinstance(parent, str) and parent else None
    path.reverse()
    return path


def _context_from_path(path: Sequence[Entry]) -> SessionContext:
    thinking = "off"
    model: ModelRef | None = None
    compaction_at = -1
    for index, entry in enumerate(path):
        thinking, model = _apply_settings(entry, thinking, model)
        if entry.get("type") == "compaction":
            compaction_at = index  # only the last compaction on the path counts
    messages: list[AgentMessage] = []
    if compaction_at < 0:
        for entry in path:
            message = _entry_message(entry)
            if message is not None:
                messages.append(message)
        return SessionContext(messages, thinking, model)
    compaction = path[compaction_at]
    summary: AgentMessage = {"role": "compactionSummary"}
    _copy_present(summary, compaction, "summary", "tokensBefore")
    summary["timestamp"] = _iso_to_ms(compaction.get("timestamp"))
    messages.append(summary)
    first_kept = compaction.get("firstKeptEntryId", _MISSING)
    keeping = False
    for entry in path[:compaction_at]:
        if not keeping and entry.get("id", _MISSING) == first_kept:
            keeping = True
        if keeping:
            message = _entry_message(entry)
            if message is not None:
                messages.append(message)
    for entry in path[compaction_at + 1 :]:
        message = _entry_message(entry)
        if message is not None:
            messages.append(message)
    return SessionContext(messages, thinking, model)


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
    return _context_from_path(_walk_to_root(leaf, index))


@attrs.define
class _Ctx:
    """A context for the committed entries, extended in place when the leaf grows."""

    leaf: Entry
    count: int  # len(fold.entries) when last brought up to date
    messages: list[AgentMessage]
    thinking: str
    model: ModelRef | None


def _extension(
    ctx: _Ctx, new: Sequence[Entry], old_by_id: Mapping[str, Entry]
) -> tuple[list[AgentMessage], str, ModelRef | None] | None:
    """Messages and settings the ``new`` entries add when their leaf continues ``ctx.leaf``.

    ``None`` means "not a plain continuation" (a new root, a branch from an older entry, a
    duplicate id that would re-route old paths, or a compaction): rebuild from scratch.
    """
    segment: dict[str, Entry] = {}
    members: set[int] = set()
    for entry in new:
        entry_id = entry.get("id")
        if isinstance(entry_id, str):
            if entry_id in old_by_id or entry_id in segment:
                return None
            segment[entry_id] = entry
        members.add(id(entry))
    path: list[Entry] = []
    current: Entry | None = new[-1]
    while current is not ctx.leaf:
        if current is None or id(current) not in members or len(path) > len(new):
            return None
        path.append(current)
        parent = current.get("parentId")
        if not (isinstance(parent, str) and parent):
            return None
        current = segment.get(parent) or old_by_id.get(parent)
    path.reverse()
    thinking, model = ctx.thinking, ctx.model
    added: list[AgentMessage] = []
    for entry in path:
        if entry.get("type") == "compaction":
            return None
        thinking, model = _apply_settings(entry, thinking, model)
        message = _entry_message(entry)
        if message is not None:
            added.append(message)
    return added, thinking, model


# --------------------------------------------------------------------------------------------
# The per-path read cache


@attrs.define
class _FileState:
    path: str
    dev: int = -1
    ino: int = -1
    size: int = 0
    mtime_ns: int = 0
    head_digest: bytes = b""
    tail_digest: bytes = b""
    committed: int = 0  # offset just past the last newline folded into `fold`
    fold: _Fold = attrs.Factory(_Fold)
    ctx: _Ctx | None = None
    warned: bool = False
    lock: threading.Lock = attrs.Factory(threading.Lock)


@attrs.define
class _View:
    """One consistent read: the cached fold plus the unterminated tail, if it parses."""

    state: _FileState
    exists: bool
    size: int
    tentative: Entry | None
    torn: bool
    tail_bad: bool


_cache: OrderedDict[str, _FileState] = OrderedDict()
_cache_lock = threading.Lock()


def _cache_key(path: str | os.PathLike[str]) -> str:
    return os.path.abspath(os.fspath(path))


def clear_session_cache(path: str | os.PathLike[str] | None = None) -> None:
    """Forget cached reads (of one path, or all). Only needed to reclaim memory."""
    with _cache_lock:
        if path is None:
            _cache.clear()
        else:
            _cache.pop(_cache_key(path), None)


def _state_for(key: str) -> _FileState:
    with _cache_lock:
        state = _cache.get(key)
        if state is None:
            state = _cache[key] = _FileState(key)
            while len(_cache) > _CACHE_MAX_FILES:
                _cache.popitem(last=False)
        else:
            _cache.move_to_end(key)
        return state


def _pread_exact(fd: int, length: int, offset: int) -> bytes:
    chunks: list[bytes] = []
    while length > 0:
        chunk = os.pread(fd, min(length, _READ_CHUNK * 16), offset)
        if not chunk:
            break  # truncated under us; the next read's digest check notices
        chunks.append(chunk)
        length -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _digests(fd: int, size: int) -> tuple[bytes, bytes]:
    head = _pread_exact(fd, min(size, _DIGEST_SPAN), 0)
    start = max(0, size - _DIGEST_SPAN)
    tail = head[start:] if size <= _DIGEST_SPAN else _pread_exact(fd, size - start, start)
    return hashlib.blake2b(head, digest_size=16).digest(), hashlib.blake2b(
        tail, digest_size=16
    ).digest()


def _refresh(state: _FileState) -> _View:
    """Bring ``state`` up to date with the file (caller holds ``state.lock``)."""
    try:
        fd = os.open(state.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        _reset_state(state)
        return _View(state, False, 0, None, False, False)
    try:
        st = os.fstat(fd)
        reusable = (
            (st.st_dev, st.st_ino) == (state.dev, state.ino)
            and st.st_size >= state.size
            and _digests(fd, state.size) == (state.head_digest, state.tail_digest)
        )
        if not reusable:
            _reset_state(state)
            state.dev, state.ino = st.st_dev, st.st_ino
        start = state.committed
        data = _pread_exact(fd, st.st_size - start, start)
        size = start + len(data)
        complete, tail = _split_complete(data)
        if complete:
            _feed_lines(state.fold, complete[:-1], at_start=start == 0)
            state.committed = start + len(complete)
        state.size = size
        state.mtime_ns = st.st_mtime_ns
        state.head_digest, state.tail_digest = _digests(fd, size)
    finally:
        os.close(fd)
    tentative, torn = _parse_tail(tail, at_start=state.committed == 0)
    tail_bad = torn and _parse_line(tail) is _BAD
    return _View(state, True, size, tentative, torn, tail_bad)


def _reset_state(state: _FileState) -> None:
    state.dev = state.ino = -1
    state.size = state.committed = state.mtime_ns = 0
    state.head_digest = state.tail_digest = b""
    state.fold = _Fold()
    state.ctx = None
    state.warned = False


def _header_problem(view: _View) -> str | None:
    fold = view.state.fold
    first = fold.first_object if fold.first_object is not None else view.tentative
    if first is None:
        return "empty"
    if first.get("type") != "session":
        return "first object is not a session header"
    if not isinstance(first.get("id"), str):
        return "session header has no string id"
    return None


def _context(view: _View) -> SessionContext:
    """The context at the last line, extending the cached one when possible."""
    state, fold = view.state, view.state.fold
    header = fold.first_object if fold.first_object is not None else view.tentative
    assert header is not None
    if _header_version(header) < 3:
        # Legacy files are migrated afresh on each read (O(file)); pi rewrites them on open.
        objects = [*fold.objects, view.tentative] if view.tentative else fold.objects
        _, migrated, _ = migrate_session_entries(header, objects)
        return build_session_context(migrated)
    entries = fold.entries
    ctx: _Ctx | None = None
    if entries:
        ctx = state.ctx
        if ctx is not None and ctx.count != len(entries):
            ctx = _extend_committed(state, ctx)
        if ctx is None:
            full = build_session_context(entries, by_id=fold.by_id)
            ctx = _Ctx(
                entries[-1], len(entries), list(full.messages), full.thinking_level, full.model
            )
        state.ctx = ctx
    tentative = view.tentative
    if tentative is None or tentative is header or tentative.get("type") == "session":
        if ctx is None:
            return SessionContext([])
        return SessionContext(MessageHistory(ctx.messages), ctx.thinking, ctx.model)
    if ctx is not None:
        ext = _extension(ctx, [tentative], fold.by_id)
        if ext is not None:
            added, thinking, model = ext
            return SessionContext([*ctx.messages, *added], thinking, model)
    by_id = dict(fold.by_id)
    tentative_id = tentative.get("id")
    if isinstance(tentative_id, str):
        by_id[tentative_id] = tentative
    return build_session_context([*entries, tentative], by_id=by_id)


def _extend_committed(state: _FileState, ctx: _Ctx) -> _Ctx | None:
    """Extend ``ctx`` in place over the entries folded since it was built, if it continues."""
    fold = state.fold
    if fold.last_duplicate_at >= ctx.count:
        return None  # a re-used id re-routes older paths: rebuild
    new = fold.entries[ctx.count :]
    new_ids = {e["id"] for e in new if isinstance(e.get("id"), str)}
    ext = _extension(ctx, new, _ExcludingView(fold.by_id, new_ids))
    if ext is None:
        return None
    added, ctx.thinking, ctx.model = ext
    ctx.messages.extend(added)
    ctx.leaf = new[-1]
    ctx.count = len(fold.entries)
    return ctx


class _ExcludingView(Mapping[str, Entry]):
    """``by_id`` minus a few keys, without copying a 100k-entry dict."""

    __slots__ = ("_base", "_excluded")

    def __init__(self, base: Mapping[str, Entry], excluded: set[Any]) -> None:
        self._base = base
        self._excluded = excluded

    def __getitem__(self, key: str) -> Entry:
        if key in self._excluded:
            raise KeyError(key)
        return self._base[key]

    def __iter__(self) -> Iterator[str]:
        return (k for k in self._base if k not in self._excluded)

    def __len__(self) -> int:
        return len(self._base) - len(self._excluded)

    def __contains__(self, key: object) -> bool:
        return key not in self._excluded and key in self._base


def _warn_once(view: _View, event: str, **fields: Any) -> None:
    if not view.state.warned:
        view.state.warned = True
        _log.warning(event, path=view.state.path, **fields)


def _refresh_or_raise(state: _FileState) -> _View:
    """:func:`_refresh`, with a read failure mapped once to :class:`SessionError` (and the
    cache dropped, so the next read starts clean). Caller holds ``state.lock``."""
    try:
        return _refresh(state)
    except OSError as error:
        _reset_state(state)
        raise SessionError(f"cannot read session transcript {state.path}: {error}") from error


def load_session_context(path: str | os.PathLike[str]) -> SessionContext:
    """The context at the transcript's last line, as OpenClaw's Codex history reader builds it.

    A missing or empty file, or one whose first object is not a valid session header, gives
    an empty context (the latter with a warning). Raises :class:`SessionError` when the file
    exists but cannot be read. Cost: O(new bytes) when the file only grew since the last read.
    """
    state = _state_for(_cache_key(path))
    with state.lock:
        view = _refresh_or_raise(state)
        if not view.exists:
            return SessionContext([])
        problem = _header_problem(view)
        if problem == "empty":
            return SessionContext([])
        if problem is not None:
            _warn_once(view, "session transcript ignored", reason=problem)
            return SessionContext([])
        if view.state.fold.malformed or view.tail_bad:
            _warn_once(
                view,
                "session transcript has malformed lines",
                malformed_lines=view.state.fold.malformed + int(view.tail_bad),
            )
        return _context(view)


def load_session_messages(path: str | os.PathLike[str]) -> Sequence[AgentMessage]:
    """The AgentMessages on the transcript's current path (empty when there is none).

    Never raises for file problems: an unreadable file logs a warning and reads as empty,
    which is what OpenClaw's caller substitutes. Usually a :class:`MessageHistory` (O(1),
    immutable); its dicts are shared with the read cache, so copy before mutating.
    """
    try:
        return load_session_context(path).messages
    except SessionError as error:
        _log.warning(
            "session transcript read failed", path=os.fspath(path), error=format_error(error)
        )
        return []


def read_session(path: str | os.PathLike[str]) -> SessionTranscript:
    """The whole transcript: header, migrated entries (copies where migrated), statistics.

    O(entries) per call; for the conversation itself use :func:`load_session_context`.
    """
    state = _state_for(_cache_key(path))
    with state.lock:
        view = _refresh_or_raise(state)
        fold = state.fold
        objects = [*fold.objects, view.tentative] if view.tentative else list(fold.objects)
        first = objects[0] if objects else None
        header = _valid_header(first)
        version: int | None = None
        if header is not None:
            header, entries, version = migrate_session_entries(header, objects)
        else:
            entries = [obj for obj in objects if obj.get("type") != "session"]
        return SessionTranscript(
            path=state.path,
            exists=view.exists,
            header=header,
            version=version,
            entries=tuple(entries),
            malformed_lines=fold.malformed + int(view.tail_bad),
            non_object_lines=fold.non_objects + int(view.torn and not view.tail_bad),
            torn_tail=view.torn,
            size=view.size,
        )


# --------------------------------------------------------------------------------------------
# Locking


def _lock_target(path: str | os.PathLike[str]) -> str:
    """``<realpath(dir)>/<basename>``: the key of both locks, as OpenClaw computes it."""
    absolute = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(absolute)
    with suppress(OSError):
        directory = os.path.realpath(directory, strict=True)
    return os.path.join(directory, name)


@attrs.define
class _PathLock:
    rlock: threading.RLock = attrs.Factory(threading.RLock)
    depth: int = 0  # holders in this process (re-entrant, one thread at a time)


_path_locks: dict[str, _PathLock] = {}
_path_locks_guard = threading.Lock()


def _path_lock(target: str) -> _PathLock:
    # Never evicted: one small object per transcript this process ever wrote.
    with _path_locks_guard:
        lock = _path_locks.get(target)
        if lock is None:
            lock = _path_locks[target] = _PathLock()
        return lock


def _process_starttime(pid: int) -> int | None:
    """Linux ``/proc/<pid>/stat`` start time (clock ticks since boot), to spot recycled pids."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    try:
        return int(raw[raw.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def _utc_now_iso() -> str:
    now = datetime.now(UTC)
    return now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"


def _lock_staleness(lock_path: str, stale_after: float) -> tuple[str | None, int | None]:
    """Why the lock file at ``lock_path`` is stale (or ``None``), and its holder pid."""
    try:
        with open(lock_path, "rb") as handle:
            raw = handle.read(65536)
        mtime = os.stat(lock_path).st_mtime
    except FileNotFoundError:
        return None, None
    try:
        payload = json.loads(raw)
    except (ValueError, RecursionError):
        payload = None
    if not isinstance(payload, dict):
        if time.time() - mtime > _LOCK_UNPARSABLE_GRACE_SECONDS:
            return "unparsable", None
        return None, None
    pid = payload.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int):
        return "missing pid", None
    if not pid_alive(pid):
        return "dead pid", pid
    if pid == os.getpid():
        # We only look at the file while holding this path's in-process lock at depth 0, so
        # a lock naming our own pid is an orphan of an earlier holder in this process.
        return "orphaned by this process", pid
    starttime = payload.get("starttime")
    if isinstance(starttime, int) and not isinstance(starttime, bool):
        current = _process_starttime(pid)
        if current is not None and current != starttime:
            return "recycled pid", pid
    created_ms = _iso_to_ms(payload.get("createdAt"))
    if created_ms is None:
        return "invalid createdAt", pid
    if time.time() * 1000 - created_ms > stale_after * 1000:
        return "too old", pid
    return None, pid


def _break_stale_lock(lock_path: str, reason: str, observed: bytes) -> None:
    """Remove a stale lock without removing a fresh one that replaced it meanwhile."""
    aside = f"{lock_path}.stale.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        os.rename(lock_path, aside)
    except FileNotFoundError:
        return
    try:
        with open(aside, "rb") as handle:
            moved = handle.read(65536)
        if moved != observed:
            # Someone replaced the stale lock between our check and the rename: put it back.
            with suppress(OSError):
                os.link(aside, lock_path)
            return
        _log.warning("session lock was stale; removed", lock=lock_path, reason=reason)
    finally:
        with suppress(OSError):
            os.unlink(aside)


def _try_create_lock(lock_path: str) -> bool:
    payload: dict[str, Any] = {"pid": os.getpid(), "createdAt": _utc_now_iso()}
    starttime = _process_starttime(os.getpid())
    if starttime is not None:
        payload["starttime"] = starttime
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(lock_path, flags, 0o600)
    except FileExistsError:
        return False
    try:
        os.write(fd, (json.dumps(payload, indent=2) + "\n").encode())
    finally:
        os.close(fd)
    return True


def _acquire_file_lock(lock_path: str, deadline: float, timeout: float, stale: float) -> None:
    attempt = 0
    holder: int | None = None
    while True:
        if _try_create_lock(lock_path):
            return
        try:
            with open(lock_path, "rb") as handle:
                observed = handle.read(65536)
        except FileNotFoundError:
            continue
        reason, holder = _lock_staleness(lock_path, stale)
        if reason is not None:
            _break_stale_lock(lock_path, reason, observed)
            continue
        now = time.monotonic()
        if now >= deadline:
            raise SessionLockTimeout(lock_path[: -len(".lock")], timeout, holder)
        attempt += 1
        # Short, jittered polls: OpenClaw's 50 ms x attempt would dominate a busy turn.
        pause = min(_LOCK_POLL_MAX, _LOCK_POLL_MIN * attempt) * (0.5 + secrets.randbelow(100) / 100)
        time.sleep(min(pause, max(0.0, deadline - now)))


def _release_file_lock(lock_path: str) -> None:
    try:
        with open(lock_path, "rb") as handle:
            payload = json.loads(handle.read(65536))
    except (OSError, ValueError):
        return
    # Only remove our own lock: a stale-breaker may already have replaced it.
    if isinstance(payload, dict) and payload.get("pid") == os.getpid():
        with suppress(FileNotFoundError):
            os.unlink(lock_path)


@contextmanager
def session_write_lock(
    path: str | os.PathLike[str],
    *,
    timeout: float = DEFAULT_LOCK_TIMEOUT,
    stale_after: float = LOCK_STALE_SECONDS,
) -> Iterator[str]:
    """Hold the transcript's write lock: in-process first, then OpenClaw's ``.lock`` file.

    Re-entrant within one thread (nested holders share the file lock). Usable from any
    thread; never from an event loop thread, since waiting blocks. Yields the lock target
    (``realpath(dir)/name``). Raises :class:`SessionLockTimeout` after ``timeout`` seconds.
    """
    target = _lock_target(path)
    deadline = time.monotonic() + timeout
    lock = _path_lock(target)
    if not lock.rlock.acquire(timeout=max(0.0, timeout)):
        raise SessionLockTimeout(target, timeout)
    try:
        if lock.depth == 0:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            _acquire_file_lock(target + ".lock", deadline, timeout, stale_after)
        lock.depth += 1
        try:
            yield target
        finally:
            lock.depth -= 1
            if lock.depth == 0:
                _release_file_lock(target + ".lock")
    finally:
        lock.rlock.release()


# --------------------------------------------------------------------------------------------
# Writing


def _dumps(obj: object) -> bytes:
    """``JSON.stringify`` bytes: compact, raw non-ASCII, no NaN; lone surrogates escaped."""
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode()


def _new_entry_id(existing: Mapping[str, object], fresh: set[str]) -> str:
    """pi's id: 8 hex chars, unique in the file, with up to 100 tries, then a full UUID."""
    for _ in range(100):
        candidate = secrets.token_hex(4)
        if candidate not in existing and candidate not in fresh:
            fresh.add(candidate)
            return candidate
    candidate = str(uuid.uuid4())
    fresh.add(candidate)
    return candidate


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _create_exclusive(path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` (mode 0600) iff it does not exist, never half-written.

    The bytes go to a private temp file that is fsynced and then hard-linked to ``path``;
    ``link`` fails when the name exists, so this is an exclusive create whose result is
    complete or absent. Falls back to ``O_EXCL`` + write where hard links are unsupported.
    Returns ``False`` when the file already existed.
    """
    directory, name = os.path.split(path)
    temp = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(temp, flags, 0o600)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, path)
        except FileExistsError:
            return False
        except OSError:
            return _create_exclusive_plain(path, data)
    finally:
        with suppress(OSError):
            os.unlink(temp)
    fsync_directory(directory)
    return True


def _create_exclusive_plain(path: str, data: bytes) -> bool:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        return False
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_directory(os.path.dirname(path))
    return True


def _append(path: str, data: bytes) -> int:
    """One ``O_APPEND`` write (plus a separating newline after a torn tail), then fsync."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        if size > 0 and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # isolate the torn line instead of gluing our entry onto it
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(data)


_IDENTITY_KINDS: Final = frozenset({"prompt", "reasoning", "plan", "assistant"})


def _legacy_match(
    legacy: Mapping[tuple[str, str], list[AgentMessage]],
    scope: str,
    identity: str,
    message: AgentMessage,
) -> bool:
    """Whether a PR-era per-index key already mirrored ``message``.

    PR-era keys were ``<scope>:<turnId>:<role>:<i>``, with ``i`` counting the turn's
    user/assistant messages, so the same message gets a different index whenever an optional
    reasoning or plan mirror is present in one snapshot and not the other. Matching on the
    index alone could drop a different message; instead a message counts as present when the
    same turn already holds a message with the same role and content.
    """
    turn_id, sep, kind = identity.rpartition(":")
    role = message.get("role")
    if not sep or kind not in _IDENTITY_KINDS or not isinstance(role, str):
        return False
    candidates = legacy.get((f"{scope}:{turn_id}", role), ())
    content = message.get("content", _MISSING)
    return any(candidate.get("content", _MISSING) == content for candidate in candidates)


def _validate_mirror_input(
    messages: Sequence[AgentMessage], scope: str, identities: Sequence[str]
) -> None:
    if not isinstance(scope, str) or not scope.strip():
        raise MirrorInputError("scope must be a non-empty string")
    if len(messages) != len(identities):
        raise MirrorInputError(
            f"{len(messages)} messages but {len(identities)} identities: one identity per message"
        )
    for index, (message, identity) in enumerate(zip(messages, identities, strict=True)):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise MirrorInputError(f"message {index} is not a dict with a string role")
        if not isinstance(identity, str) or not identity.strip():
            raise MirrorInputError(f"identity {index} must be a non-empty string")


def mirror_turn(
    path: str | os.PathLike[str],
    messages: Sequence[AgentMessage],
    *,
    scope: str,
    identities: Sequence[str],
    session_id: str,
    cwd: str,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> MirrorResult:
    """Append one turn's messages to the transcript, idempotently and crash-safely.

    Each message is keyed ``<scope>:<identity>`` (a message that already carries an
    ``idempotencyKey`` keeps it) and skipped when any line of the file already has that key,
    or a PR-era per-index key of the same turn names an equal message. The rest are
    appended as ``message`` entries in one write + fsync, chained from the last parent-linked
    entry (a ``user`` message skips trailing ``toolResult`` entries, as OpenClaw does). A
    missing file is created with a v3 header carrying ``session_id`` and ``cwd``. Existing
    content is never rewritten; a file whose first object is not a valid session header is
    refused with :class:`SessionFormatError`.
    """
    _validate_mirror_input(messages, scope, identities)
    try:
        return _mirror_locked(path, messages, scope, identities, session_id, cwd, lock_timeout)
    except OSError as error:  # mapped once, here, at the boundary
        raise SessionError(f"failed to mirror into {os.fspath(path)}: {error}") from error


def _mirror_locked(
    path: str | os.PathLike[str],
    messages: Sequence[AgentMessage],
    scope: str,
    identities: Sequence[str],
    session_id: str,
    cwd: str,
    lock_timeout: float,
) -> MirrorResult:
    with session_write_lock(path, timeout=lock_timeout) as target:
        state = _state_for(_cache_key(path))
        with state.lock:
            view = _refresh(state)
            created = not view.exists
            needs_header = not view.exists or view.size == 0
            if not needs_header:
                problem = _header_problem(view)
                if problem is not None:
                    raise SessionFormatError(target, problem)
            fold = state.fold
            written_keys: set[str] = set()  # keys of this call and of the unterminated tail
            last_linked = fold.last_linked_id
            last_non_tool = fold.last_linked_non_tool_id
            legacy_index: Mapping[tuple[str, str], list[AgentMessage]] = fold.legacy
            fresh: set[str] = set()
            if view.tentative is not None:
                tentative_key = _idempotency_key(view.tentative)
                if tentative_key is not None:
                    written_keys.add(tentative_key)
                    scratch = _Fold()  # rare: a complete last line missing only its newline
                    scratch.add(view.tentative)
                    for slot, found in scratch.legacy.items():
                        legacy_index = {**legacy_index, slot: [*legacy_index.get(slot, ()), *found]}
                tentative_id = view.tentative.get("id")
                if isinstance(tentative_id, str) and view.tentative.get("type") != "session":
                    fresh.add(tentative_id)
                    if tentative_id and "parentId" in view.tentative:
                        last_linked = tentative_id
                        if not _is_tool_result(view.tentative):
                            last_non_tool = tentative_id
            lines: list[bytes] = []
            if needs_header:
                header = {
                    "type": "session",
                    "version": CURRENT_SESSION_VERSION,
                    "id": session_id,
                    "timestamp": _utc_now_iso(),
                    "cwd": cwd,
                }
                lines.append(_dumps(header) + b"\n")
            appended: list[str] = []
            entry_ids: list[str] = []
            skipped: list[str] = []
            for message, identity in zip(messages, identities, strict=True):
                own = message.get("idempotencyKey")
                key = own.strip() if isinstance(own, str) and own.strip() else f"{scope}:{identity}"
                present = key in fold.keys or key in written_keys
                if present or _legacy_match(legacy_index, scope, identity, message):
                    skipped.append(key)
                    continue
                written_keys.add(key)
                entry_id = _new_entry_id(fold.by_id, fresh)
                is_tool_result = message.get("role") == "toolResult"
                parent = last_linked
                if message.get("role") == "user" and last_non_tool is not None:
                    parent = last_non_tool
                body = {k: v for k, v in message.items() if k != "idempotencyKey"}
                body["idempotencyKey"] = key  # last key, as OpenClaw forces it
                entry = {
                    "type": "message",
                    "id": entry_id,
                    "parentId": parent,
                    "timestamp": _utc_now_iso(),
                    "message": body,
                }
                lines.append(_dumps(entry) + b"\n")
                appended.append(key)
                entry_ids.append(entry_id)
                last_linked = entry_id
                if not is_tool_result:
                    last_non_tool = entry_id
            written = 0
            raced = False
            if appended:
                payload = b"".join(lines)
                if view.exists:
                    written = _append(target, payload)
                elif _create_exclusive(target, payload):
                    written = len(payload)
                else:
                    raced = True  # created meanwhile by a writer that ignores the lock
        if raced:
            # Nothing was written; the file now exists, so the retry appends (the RLock is
            # re-entrant) and dedupes against whatever the other writer put there.
            return _mirror_locked(path, messages, scope, identities, session_id, cwd, lock_timeout)
    _log.debug(
        "session turn mirrored",
        path=target,
        appended=len(appended),
        skipped=len(skipped),
        created=created,
        bytes=written,
    )
    return MirrorResult(
        path=target,
        created=created and written > 0,
        appended_keys=tuple(appended),
        entry_ids=tuple(entry_ids),
        skipped_keys=tuple(skipped),
        leaf_id=last_linked,
        bytes_written=written,
    )


# --------------------------------------------------------------------------------------------
# Reset


def reset_session(
    session_file: str | os.PathLike[str],
    *,
    session_key: str | None = None,
    reason: str | None = None,
) -> bool:
    """The Codex harness ``reset``: forget the thread binding of ``session_file``.

    Archiving the transcript (``<file>.reset.<ts>``) is the host's job, as in OpenClaw; this
    only removes ``<file>.codex-app-server.json`` so the next turn starts a fresh thread, and
    drops the cached read. A failure is logged, never raised. Returns whether a binding was
    removed.
    """
    clear_session_cache(session_file)
    try:
        removed = _binding.clear_binding(session_file)
    except _binding.BindingError as error:
        _log.warning(
            "failed to clear codex app-server binding on reset",
            path=os.fspath(session_file),
            session=mask_session_key(session_key),
            reason=reason,
            error=format_error(error),
        )
        return False
    _log.info(
        "codex app-server session reset",
        path=os.fspath(session_file),
        session=mask_session_key(session_key),
        reason=reason,
        binding_removed=removed,
    )
    return removed
