"""The incremental read cache and the readers built on it.

Theory
------
Because reading a transcript is a fold over its complete lines (``_format.py``, rule 1), the
fold of a file that only grew can be *continued* rather than redone. :class:`FileState`
caches, per transcript (keyed by :func:`codex_turn.harness._fs.session_path`), the fold over
the bytes up to the last newline, the file's identity ``(st_dev, st_ino)`` and a digest of
its first and last 4 KiB. A read checks identity and digests: an appended file costs
O(new bytes); a replaced, truncated or rewritten one is re-read from scratch. The bytes after
the last newline are never folded in; each read parses them afresh.

The derived conversation is cached as well (:class:`_Ctx`) and extended in O(new entries)
when the new entries continue the old leaf (:func:`_extension`); a new root, a branch from an
older entry, a re-used id or a compaction rebuilds it. Readers hand out a
:class:`~codex_turn.harness.session._format.MessageHistory`, an O(1) view of the cached list.

Each state has its own lock; readers, the preflight (``_writable.py``) and the mirror
(``_mirror.py``) refresh the state under it (:func:`state_for`, :func:`refresh`, a
:class:`View`), so the mirror sees exactly what a reader would. Only a regular file is ever opened
(:func:`codex_turn.harness._fs.open_regular`): a FIFO, a directory or a device at the path is
an error at once, never a read that blocks. Everything is synchronous file I/O: an async
caller runs it in a worker thread. Messages returned by the readers are shared with the
cache: treat them as read-only (``copy.deepcopy`` before mutating).

Memory is bounded by bytes, not by a count of files (``budget.py``): every refresh charges
the state ~4 bytes per committed file byte to the ledger shared with the stripped
histories, and the least recently used states are evicted (dropped from the cache whole,
their next read is a fresh parse) until the total is under the ceiling (256 MiB by default,
:func:`set_session_cache_limit`). A state that a reader holds is never evicted under it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import attrs

from codex_turn._json import AgentMessage
from codex_turn._log import format_error, get_logger
from codex_turn.harness._fs import open_regular, pread_exact, session_path
from codex_turn.harness.session import budget
from codex_turn.harness.session._format import (
    BAD,
    Entry,
    Fold,
    MessageHistory,
    ModelRef,
    SessionContext,
    SessionError,
    apply_settings,
    build_session_context,
    entry_message,
    feed_lines,
    first_object_problem,
    header_version,
    migrate_session_entries,
    parse_line,
    parse_tail,
    split_complete,
    valid_header,
)

__all__ = [
    "SessionTranscript",
    "clear_session_cache",
    "load_session_context",
    "load_session_messages",
    "read_session",
]

_log = get_logger(__name__)

_DIGEST_SPAN: Final = 4096


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


# --------------------------------------------------------------------------------------------
# The cached conversation, extended in place


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
        thinking, model = apply_settings(entry, thinking, model)
        message = entry_message(entry)
        if message is not None:
            added.append(message)
    return added, thinking, model


# --------------------------------------------------------------------------------------------
# The per-path read cache


@attrs.define
class FileState:
    """One transcript's cached read (:func:`state_for`); guarded by ``lock``."""

    path: str
    dev: int = -1
    ino: int = -1
    size: int = 0
    mtime_ns: int = 0
    head_digest: bytes = b""
    tail_digest: bytes = b""
    committed: int = 0  # offset just past the last newline folded into `fold`
    fold: Fold = attrs.Factory(Fold)
    ctx: _Ctx | None = None
    warned: bool = False
    lock: threading.Lock = attrs.Factory(threading.Lock)


@attrs.define
class View:
    """One consistent read: the cached fold plus the unterminated tail, if it parses."""

    state: FileState
    exists: bool
    size: int
    tentative: Entry | None
    torn: bool
    tail_bad: bool

    def header_problem(self) -> str | None:
        """:func:`~codex_turn.harness.session._format.first_object_problem` of the file."""
        fold = self.state.fold
        return first_object_problem(
            fold.first_object if fold.first_object is not None else self.tentative
        )


_cache: OrderedDict[str, FileState] = OrderedDict()
_cache_lock = threading.Lock()


def clear_session_cache(path: str | os.PathLike[str] | None = None) -> None:
    """Forget cached reads (of one path, or all: with every copy built on them, such as the
    turns' stripped histories). Only needed to reclaim memory."""
    with _cache_lock:
        if path is None:
            keys = list(_cache)
            _cache.clear()
        else:
            keys = [session_path(path)]
            _cache.pop(keys[0], None)
    for key in keys:
        budget.release(("read", key))
    if path is None:
        budget.evict_all()


def state_for(key: str) -> FileState:
    """The cached state of the transcript whose :func:`session_path` is ``key`` (created
    empty); read or change it only under its ``lock``, after :func:`refresh`."""
    with _cache_lock:
        state = _cache.get(key)
        if state is None:
            state = _cache[key] = FileState(key)
        return state


def holds_context(key: str) -> bool:
    """Whether the cache holds the conversation of ``key`` (a :func:`session_path`): its
    next read costs O(new bytes)."""
    with _cache_lock:
        cached = _cache.get(key)
    return cached is not None and cached.ctx is not None


def _charge(state: FileState) -> None:
    """Charge ``state``'s estimated bytes to the ledger (caller holds ``state.lock``)."""
    with _cache_lock:
        if _cache.get(state.path) is not state:
            return  # evicted or cleared while held: an orphan, dropped with its reader
    nbytes = budget.ENTRY_OVERHEAD + budget.READ_BYTES_PER_BYTE * state.committed
    budget.charge(("read", state.path), nbytes, lambda: _evict(state))


def _evict(state: FileState) -> object | None:
    """The ledger's evictor: drop ``state`` from the cache, unless a reader holds it."""
    if not state.lock.acquire(blocking=False):
        return None
    try:
        with _cache_lock:
            if _cache.get(state.path) is state:
                del _cache[state.path]
        detached = (state.fold, state.ctx)
        _reset_state(state)  # a thread still holding this orphan re-reads from scratch
        return detached
    finally:
        state.lock.release()


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _digests(fd: int, size: int) -> tuple[bytes, bytes]:
    """The digests of the first and of the last :data:`_DIGEST_SPAN` bytes of ``size``."""
    head = pread_exact(fd, min(size, _DIGEST_SPAN), 0)
    if size <= _DIGEST_SPAN:
        digest = _digest(head)  # head and tail are the same bytes
        return digest, digest
    start = size - _DIGEST_SPAN
    return _digest(head), _digest(pread_exact(fd, size - start, start))


def refresh(state: FileState) -> View:
    """Bring ``state`` up to date with the file; what it holds now (caller holds
    ``state.lock``). Raises :class:`OSError` when the file cannot be read."""
    try:
        return _refresh_uncharged(state)
    finally:
        _charge(state)


def _refresh_uncharged(state: FileState) -> View:
    try:
        # Never blocks (a FIFO at the path), never reads a directory or a device.
        fd = open_regular(state.path, os.O_RDONLY)
    except FileNotFoundError:
        _reset_state(state)
        return View(state, False, 0, None, False, False)
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
        # One read from the start of the new bytes or of the last _DIGEST_SPAN bytes,
        # whichever comes first: it holds the new bytes and the new tail to digest.
        read_from = min(start, max(0, st.st_size - _DIGEST_SPAN))
        chunk = pread_exact(fd, st.st_size - read_from, read_from)
        data = chunk[start - read_from :]
        size = start + len(data)
        complete, tail = split_complete(data)
        if complete:
            feed_lines(state.fold, complete[:-1], at_start=start == 0)
            state.committed = start + len(complete)
        head_digest = state.head_digest
        if len(chunk) != st.st_size - read_from:  # truncated under us: digest what is there
            head_digest, tail_digest = _digests(fd, size)
        elif size <= _DIGEST_SPAN:
            head_digest = tail_digest = _digest(chunk)  # read_from == 0: the whole file
        else:
            tail_digest = _digest(chunk[-_DIGEST_SPAN:])
            if not (reusable and state.size >= _DIGEST_SPAN):  # else the head was checked
                head_digest = _digest(
                    chunk[:_DIGEST_SPAN] if read_from == 0 else pread_exact(fd, _DIGEST_SPAN, 0)
                )
        state.size = size
        state.mtime_ns = st.st_mtime_ns
        state.head_digest, state.tail_digest = head_digest, tail_digest
    finally:
        os.close(fd)
    tentative, torn = parse_tail(tail, at_start=state.committed == 0)
    tail_bad = torn and parse_line(tail) is BAD
    return View(state, True, size, tentative, torn, tail_bad)


def _reset_state(state: FileState) -> None:
    state.dev = state.ino = -1
    state.size = state.committed = state.mtime_ns = 0
    state.head_digest = state.tail_digest = b""
    state.fold = Fold()
    state.ctx = None
    state.warned = False


def _context(view: View) -> SessionContext:
    """The context at the last line, extending the cached one when possible."""
    state, fold = view.state, view.state.fold
    header = fold.first_object if fold.first_object is not None else view.tentative
    assert header is not None
    if header_version(header) < 3:
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
        history = MessageHistory(ctx.messages, source_bytes=state.committed)
        return SessionContext(history, ctx.thinking, ctx.model)
    if ctx is not None and tentative.get("id") not in fold.missing_parents:
        ext = _extension(ctx, [tentative], fold.by_id)
        if ext is not None:
            added, thinking, model = ext
            return SessionContext([*ctx.messages, *added], thinking, model)
    by_id = dict(fold.by_id)
    tentative_id = tentative.get("id")
    if isinstance(tentative_id, str):
        by_id[tentative_id] = tentative
    return build_session_context([*entries, tentative], by_id=by_id)


def _extend_committed(state: FileState, ctx: _Ctx) -> _Ctx | None:
    """Extend ``ctx`` in place over the entries folded since it was built, if it continues."""
    fold = state.fold
    if max(fold.last_duplicate_at, fold.last_late_parent_at) >= ctx.count:
        # A re-used id, or an entry older entries already named as their parent: either
        # re-routes older paths, so rebuild.
        return None
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


def _warn_once(view: View, event: str, **fields: Any) -> None:
    if not view.state.warned:
        view.state.warned = True
        _log.warning(event, path=view.state.path, **fields)


def _refresh_or_raise(state: FileState) -> View:
    """:func:`refresh`, with a read failure mapped once to :class:`SessionError` (and the
    cache dropped, so the next read starts clean). Caller holds ``state.lock``."""
    try:
        return refresh(state)
    except OSError as error:
        _reset_state(state)
        raise SessionError(f"cannot read session transcript {state.path}: {error}") from error


def load_session_context(path: str | os.PathLike[str]) -> SessionContext:
    """The context at the transcript's last line, as OpenClaw's Codex history reader builds it.

    A missing or empty file, or one whose first object is not a valid session header, gives
    an empty context (the latter with a warning). Raises :class:`SessionError` when the file
    exists but cannot be read. Cost: O(new bytes) when the file only grew since the last read.
    """
    state = state_for(session_path(path))
    with state.lock:
        view = _refresh_or_raise(state)
        if not view.exists:
            return SessionContext([])
        problem = view.header_problem()
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
    state = state_for(session_path(path))
    with state.lock:
        view = _refresh_or_raise(state)
        fold = state.fold
        objects = [*fold.objects, view.tentative] if view.tentative else list(fold.objects)
        first = objects[0] if objects else None
        header = valid_header(first)
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
