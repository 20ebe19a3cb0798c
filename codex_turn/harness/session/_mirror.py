"""Mirroring a Codex turn into the transcript, and the harness ``reset``.

Theory
------
**Writing is one append per turn.** :func:`mirror_turn` serialises all entries of a turn into
one buffer, appends it with a single ``O_APPEND`` write and ``fsync``\\s. A crash can
therefore leave at most one torn *last* line, which the reader skips; the next append first
writes a newline so the torn fragment stays isolated, and idempotency keys
(``codex-app-server:<threadId>:<turnId>:<kind>``) make the retried turn append only what is
missing. Existing bytes are never rewritten or truncated, and a new file is created with its
header already complete (:func:`codex_turn.harness._fs.create_exclusive`: a temp file
``link``\\ed into place, an exclusive create that cannot be observed half-written).

A mirror holds the session write lock (``_lock.py``) and then the read cache's state lock
(``_cache.py``), and refreshes the cached fold under both: the idempotency keys, the PR-era
per-index keys and the append leaf all come from that fold, so deduplication costs
O(new bytes), not O(file). New entries chain from the last parent-linked entry, as OpenClaw
appends (a ``user`` message skips trailing ``toolResult`` entries).

Everything here is synchronous file I/O; an async caller runs it in a worker thread.
"""

from __future__ import annotations

import json
import os
import secrets
import uuid
from collections.abc import Mapping, Sequence
from typing import Final

import attrs

from codex_turn._log import format_error, get_logger, mask_session_key
from codex_turn.harness import binding as _binding
from codex_turn.harness._fs import create_exclusive, write_all
from codex_turn.harness.session._cache import (
    _header_problem,
    _refresh,
    _state_for,
    clear_session_cache,
)
from codex_turn.harness.session._format import (
    _MISSING,
    CURRENT_SESSION_VERSION,
    AgentMessage,
    SessionError,
    SessionFormatError,
    _Fold,
    _idempotency_key,
    _is_tool_result,
    _utc_now_iso,
)
from codex_turn.harness.session._lock import DEFAULT_LOCK_TIMEOUT, session_write_lock

__all__ = ["MirrorInputError", "MirrorResult", "mirror_turn", "reset_session"]

_log = get_logger(__name__)


class MirrorInputError(SessionError, ValueError):
    """The caller passed messages or identities that cannot be mirrored."""


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


def _append(path: str, data: bytes) -> int:
    """One ``O_APPEND`` write (plus a separating newline after a torn tail), then fsync."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        if size > 0 and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # isolate the torn line instead of gluing our entry onto it
        write_all(fd, data)
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
        state = _state_for(target)  # the lock target is the cache key: one session_path
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
                elif create_exclusive(target, payload):
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
