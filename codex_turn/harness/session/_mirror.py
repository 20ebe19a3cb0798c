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

**The prompt is written first.** :func:`mirror_prompt` appends the user's prompt before
``turn/start`` under the key the turn's mirror will use for it (a run-unique identity, since
Codex's turn id is not known yet), so a host killed mid-turn still has the user's words, and
the completed turn's :func:`mirror_turn` skips the prompt and appends the rest, exactly once.
Once ``write`` returned, the bytes are the kernel's and survive the death of the host
process; the ``fsync`` (which only an OS crash needs) follows in the same worker hop, before
``turn/start``. The turn calls ``mirror_prompt(sync=False)`` and then :func:`sync_appended`,
so that a failed ``fsync`` is told apart from a failed write: the one is said and the turn
goes on (the mirror's own ``fsync`` of the same file follows), the other fails the turn. An
``fsync`` of a small append costs ~0.1-0.3 ms on this project's CI machine and milliseconds
on slower disks; letting it overlap ``turn/start`` saved +0.3 % of a turn whose model answers
after 1.5 s, and was removed (``benchmarks/bench_mechanisms.py``).

**What cannot take a mirror is refused, what holds nothing is recovered** (``_writable.py``):
a directory, a FIFO or a dangling symbolic link at the path is :class:`TranscriptUnwritable`
at once (nothing is opened that could block, nothing loops), a foreign first object is
:class:`SessionFormatError`, and a file holding only a torn header is replaced by a fresh
header before the append.

A mirror holds the session write lock (``_lock.py``) and then the read cache's state lock
(``_cache.py``), and refreshes the cached fold under both: the idempotency keys, the PR-era
per-index keys and the append leaf all come from that fold, so deduplication costs
O(new bytes), not O(file). New entries chain from the last parent-linked entry, as OpenClaw
appends (a ``user`` message skips trailing ``toolResult`` entries).

Everything here is synchronous file I/O; an async caller runs it in a worker thread.
"""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import Mapping, Sequence
from typing import Final

import attrs

from codex_turn._json import AgentMessage
from codex_turn._log import format_error, get_logger, mask_session_key
from codex_turn.harness import binding as _binding
from codex_turn.harness._fs import create_exclusive, open_regular, session_path, write_all
from codex_turn.harness.session._cache import clear_session_cache, refresh, state_for
from codex_turn.harness.session._format import (
    Fold,
    SessionError,
    TranscriptUnwritable,
    dumps,
    header_line,
    idempotency_key,
    is_tool_result,
    utc_now_iso,
)
from codex_turn.harness.session._lock import DEFAULT_LOCK_TIMEOUT, session_write_lock
from codex_turn.harness.session._writable import settle_header, unwritable_reason

__all__ = [
    "MirrorInputError",
    "MirrorResult",
    "mirror_prompt",
    "mirror_turn",
    "reset_session",
    "sync_appended",
]

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


def _append(path: str, data: bytes, *, sync: bool) -> int:
    """One ``O_APPEND`` write (plus a separating newline after a torn tail), then fsync
    (``sync``; else the caller's :func:`sync_appended`)."""
    fd = open_regular(path, os.O_RDWR | os.O_APPEND)
    try:
        size = os.fstat(fd).st_size
        if size > 0 and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # isolate the torn line instead of gluing our entry onto it
        write_all(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return len(data)


def sync_appended(mirrored: MirrorResult) -> None:
    """``fsync`` what a ``sync=False`` mirror appended (nothing to do when it appended nothing,
    or created the file: a new file is made durable as it is created). Raises
    :class:`OSError`; the turn's own mirror, which fsyncs the same file, follows anyway."""
    if mirrored.bytes_written == 0 or mirrored.created:
        return
    fd = open_regular(mirrored.path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_IDENTITY_KINDS: Final = frozenset({"prompt", "reasoning", "plan", "assistant"})
_MISSING: Final = object()  # a message without content: equal only to another one


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
    sync: bool = True,
) -> MirrorResult:
    """Append one turn's messages to the transcript, idempotently and crash-safely.

    Each message is keyed ``<scope>:<identity>`` (a message that already carries an
    ``idempotencyKey`` keeps it) and skipped when any line of the file already has that key,
    or a PR-era per-index key of the same turn names an equal message. The rest are
    appended as ``message`` entries in one write + fsync, chained from the last parent-linked
    entry (a ``user`` message skips trailing ``toolResult`` entries, as OpenClaw does). A
    missing file is created with a v3 header carrying ``session_id`` and ``cwd``. Existing
    content is never rewritten (a file that holds only a torn header holds nothing, and is
    replaced by a fresh header first); a file whose first object is not a valid session
    header is refused with :class:`SessionFormatError`, a path that cannot take writes
    (a directory, a FIFO, a dangling symbolic link, no permission) with
    :class:`TranscriptUnwritable`, other failures with :class:`SessionError`. ``sync=False``
    leaves the append's ``fsync`` to the caller (:func:`sync_appended`).
    """
    _validate_mirror_input(messages, scope, identities)
    try:
        return _mirror_locked(
            path, messages, scope, identities, session_id, cwd, lock_timeout, sync=sync
        )
    except OSError as error:  # mapped once, here, at the boundary
        where = os.fspath(path)
        why = unwritable_reason(error)
        if why is not None:
            raise TranscriptUnwritable(
                session_path(path), why, message=f"failed to mirror into {where}: {why}"
            ) from error
        raise SessionError(f"failed to mirror into {where}: {error}") from error


def mirror_prompt(
    path: str | os.PathLike[str],
    prompt_message: AgentMessage,
    *,
    scope: str,
    identity: str,
    session_id: str,
    cwd: str,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    sync: bool = True,
) -> MirrorResult:
    """Make the user's prompt durable before the model sees it (one append + fsync).

    The prompt is appended exactly as :func:`mirror_turn` would append it, keyed
    ``<scope>:<identity>`` (or by its own ``idempotencyKey``), so the turn's mirror later
    skips it when given the *same* scope and identity for the prompt, and appends only the
    rest. Codex's turn id is not known before ``turn/start``, so ``identity`` is a run-unique
    one the caller keeps for the turn's mirror (``<runId>:prompt``), in place of the
    projector's ``<turnId>:prompt``. A host that dies mid-turn leaves the prompt in the
    transcript; a retried pre-mirror appends nothing. Raises as :func:`mirror_turn` does, and
    :class:`MirrorInputError` unless ``prompt_message`` is a ``user`` message. ``sync=False``:
    written, not yet fsynced; the caller runs :func:`sync_appended` next (module header).
    """
    if not isinstance(prompt_message, dict) or prompt_message.get("role") != "user":
        raise MirrorInputError("the prompt message must be a dict with role 'user'")
    return mirror_turn(
        path,
        [prompt_message],
        scope=scope,
        identities=[identity],
        session_id=session_id,
        cwd=cwd,
        lock_timeout=lock_timeout,
        sync=sync,
    )


def _mirror_locked(
    path: str | os.PathLike[str],
    messages: Sequence[AgentMessage],
    scope: str,
    identities: Sequence[str],
    session_id: str,
    cwd: str,
    lock_timeout: float,
    *,
    sync: bool = True,
    may_retry: bool = True,
) -> MirrorResult:
    with session_write_lock(path, timeout=lock_timeout) as target:
        state = state_for(target)  # the lock target is the cache key: one session_path
        with state.lock:
            view = settle_header(refresh(state), session_id=session_id, cwd=cwd)
            created = not view.exists
            needs_header = not view.exists or view.size == 0
            fold = state.fold
            written_keys: set[str] = set()  # keys of this call and of the unterminated tail
            last_linked = fold.last_linked_id
            last_non_tool = fold.last_linked_non_tool_id
            legacy_index: Mapping[tuple[str, str], list[AgentMessage]] = fold.legacy
            fresh: set[str] = set()
            if view.tentative is not None:
                tentative_key = idempotency_key(view.tentative)
                if tentative_key is not None:
                    written_keys.add(tentative_key)
                    scratch = Fold()  # rare: a complete last line missing only its newline
                    scratch.add(view.tentative)
                    for slot, found in scratch.legacy.items():
                        legacy_index = {**legacy_index, slot: [*legacy_index.get(slot, ()), *found]}
                tentative_id = view.tentative.get("id")
                if isinstance(tentative_id, str) and view.tentative.get("type") != "session":
                    fresh.add(tentative_id)
                    if tentative_id and "parentId" in view.tentative:
                        last_linked = tentative_id
                        if not is_tool_result(view.tentative):
                            last_non_tool = tentative_id
            lines: list[bytes] = []
            if needs_header:
                lines.append(header_line(session_id, cwd))
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
                tool_result = message.get("role") == "toolResult"
                parent = last_linked
                if message.get("role") == "user" and last_non_tool is not None:
                    parent = last_non_tool
                body = {k: v for k, v in message.items() if k != "idempotencyKey"}
                body["idempotencyKey"] = key  # last key, as OpenClaw forces it
                entry = {
                    "type": "message",
                    "id": entry_id,
                    "parentId": parent,
                    "timestamp": utc_now_iso(),
                    "message": body,
                }
                lines.append(dumps(entry) + b"\n")
                appended.append(key)
                entry_ids.append(entry_id)
                last_linked = entry_id
                if not tool_result:
                    last_non_tool = entry_id
            written = 0
            raced = False
            if appended:
                payload = b"".join(lines)
                if view.exists:
                    written = _append(target, payload, sync=sync)
                elif create_exclusive(target, payload):
                    written = len(payload)
                else:
                    raced = True  # created meanwhile by a writer that ignores the lock
        if raced:
            if not may_retry:
                raise SessionError(f"failed to mirror into {target}: the file keeps changing")
            # Nothing was written; the file now exists, so the retry appends (the RLock is
            # re-entrant) and dedupes against whatever the other writer put there. Once: a
            # name that exists yet cannot be opened is refused by the retry's header check.
            return _mirror_locked(
                path,
                messages,
                scope,
                identities,
                session_id,
                cwd,
                lock_timeout,
                sync=sync,
                may_retry=False,
            )
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
