"""The mirrored session transcript: an OpenClaw/pi JSONL v3 file, read exactly as pi reads it
and appended to exactly as OpenClaw appends, but crash-safe, idempotent and incremental.

Layout
------
One private module per concern; this package re-exports the public names of each.

* ``_format.py``: the transcript format itself: parsing lines into a fold, header
  validation, the in-memory v1/v2 -> v3 migration and pi's ``buildSessionContext``. Pure:
  no I/O, no locks, no state.
* ``_lockfile.py``: OpenClaw's ``<name>.lock`` file, as every process sees it: its payload,
  taking and releasing it, stale-lock recovery and :class:`SessionLockTimeout`.
* ``_lock.py``: this process's side of the lock: the in-process re-entrant lock per
  transcript and its holders (the writes, a whole-turn lease), and
  :func:`session_write_lock`.
* ``_lease.py``: the whole-turn lease (the lock file held for a turn, renewed by a thread),
  which the in-process turn gates take.
* ``budget.py``: the byte ceiling shared by the read cache and the stripped histories
  (:func:`set_session_cache_limit`), least recently used out.
* ``_cache.py``: the per-transcript incremental read cache and the readers on it
  (:func:`load_session_context`, :func:`load_session_messages`, :func:`read_session`).
* ``_stream.py``: :func:`iter_session_messages`, the conversation in chunks without keeping
  its parsed graph (an engine's cold import of a transcript).
* ``_writable.py``: :func:`ensure_transcript_writable`, the preflight made before anything
  reaches Codex (:class:`TranscriptUnwritable`), and the recovery of a transcript that holds
  only a torn header.
* ``_mirror.py``: :func:`mirror_prompt` (the user's prompt, written before ``turn/start``;
  :func:`sync_appended` fsyncs it next, in the same hop), :func:`mirror_turn` (one idempotent
  append per turn under the write lock) and :func:`reset_session`.

The dependency order is ``_format`` <- ``_lockfile`` <- ``_lock`` <- ``_lease`` and
``_format``, ``budget`` <- ``_cache`` <- ``_stream``, ``_writable`` (which also takes the
write lock) <- ``_mirror``; nothing imports upwards. Each module's ``__all__`` is what this
package re-exports; its other names without an underscore are the package's own vocabulary,
used by the sibling modules (and by nothing outside the harness), and no private name is
imported across modules. Every module keys a transcript by one name,
:func:`codex_turn.harness._fs.session_path`, as do the binding and the in-process turn gates.

Everything here is synchronous file I/O. An async caller runs it in a worker thread
(``anyio.to_thread.run_sync``); the locks are thread locks for exactly that reason, and must
never be awaited from the event loop thread.
"""

from __future__ import annotations

from codex_turn.harness.session._cache import (
    SessionTranscript,
    clear_session_cache,
    load_session_context,
    load_session_messages,
    read_session,
)
from codex_turn.harness.session._format import (
    CURRENT_SESSION_VERSION,
    MessageHistory,
    ModelRef,
    ParsedSession,
    SessionContext,
    SessionError,
    SessionFormatError,
    TranscriptUnwritable,
    build_session_context,
    migrate_session_entries,
    parse_session_bytes,
)
from codex_turn.harness.session._lock import DEFAULT_LOCK_TIMEOUT, session_write_lock
from codex_turn.harness.session._lockfile import LOCK_STALE_SECONDS, SessionLockTimeout
from codex_turn.harness.session._mirror import (
    MirrorInputError,
    MirrorResult,
    mirror_prompt,
    mirror_turn,
    reset_session,
    sync_appended,
)
from codex_turn.harness.session._stream import iter_session_messages
from codex_turn.harness.session._writable import ensure_transcript_writable
from codex_turn.harness.session.budget import (
    session_cache_limit,
    session_cache_usage,
    set_session_cache_limit,
)

__all__ = [
    "CURRENT_SESSION_VERSION",
    "DEFAULT_LOCK_TIMEOUT",
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
    "TranscriptUnwritable",
    "build_session_context",
    "clear_session_cache",
    "ensure_transcript_writable",
    "iter_session_messages",
    "load_session_context",
    "load_session_messages",
    "migrate_session_entries",
    "mirror_prompt",
    "mirror_turn",
    "parse_session_bytes",
    "read_session",
    "reset_session",
    "session_cache_limit",
    "session_cache_usage",
    "session_write_lock",
    "set_session_cache_limit",
    "sync_appended",
]
