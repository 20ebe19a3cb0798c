"""Whether a transcript can take a turn's mirror: the preflight, and the recovery of a
transcript that holds nothing.

Theory
------
A turn must not reach Codex when its reply cannot be saved: the model would answer, the reply
would be lost, and the caller would hear ``completed``. :func:`ensure_transcript_writable` is
the check made before anything reaches Codex. It never waits and never retries:

* ``lstat``/``stat`` decide what the path *is* before anything is opened: a directory, a
  FIFO, a socket, a device or a dangling symbolic link is refused at once (a FIFO is never
  opened, so it cannot hang a worker thread that no cancellation reaches);
* ``os.access`` decides whether the file and its directory take writes (the lock file is
  created in the directory, so a read-only directory refuses even an existing transcript);
* the read cache (``_cache.py``, O(new bytes) per turn) decides whether the first object is
  a session header, exactly as the mirror will.

Every refusal is :class:`TranscriptUnwritable` (a missing header: its subclass
:class:`SessionFormatError`), naming the problem, never the content.

A transcript that **holds nothing**, only whitespace or only a *torn header* (one partial
line that begins like pi's ``{"type":"session"`` header and never became a JSON object), is
not refused: pi and every reader see an empty session in it, so nothing is lost by replacing
it, and refusing it would refuse the session forever. It is replaced, under the session write
lock, by a fresh header through :func:`codex_turn.harness._fs.atomic_write` (a reader sees the
torn bytes or the new header, never a mix), with a warning that names the path and the byte
count only. The mirror (``_mirror.py``) recovers the same way, so a caller that skipped the
preflight still recovers. Anything else that is not a transcript (a foreign first object, a
long file of garbage) is refused and left alone.

The preflight is a snapshot: a host that swaps files under a running turn can still make the
mirror fail, which it then does with the same typed errors.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Final

from codex_turn._log import get_logger
from codex_turn.harness._fs import (
    NotRegularFileError,
    atomic_write,
    file_kind,
    open_regular,
    pread_exact,
    session_path,
)
from codex_turn.harness.binding import BINDING_SUFFIX
from codex_turn.harness.session._cache import View, refresh, state_for
from codex_turn.harness.session._format import (
    UTF8_BOM,
    SessionFormatError,
    TranscriptUnwritable,
    header_line,
)
from codex_turn.harness.session._lock import DEFAULT_LOCK_TIMEOUT, session_write_lock

__all__ = ["check_session_format", "ensure_transcript_writable"]

_log = get_logger(__name__)

# A torn header is one partial line; anything longer is not "nothing" and is left alone.
_TORN_HEADER_MAX: Final = 64 * 1024
_HEADER_START: Final = b'{"type":"session"'
_WHITESPACE: Final = b" \t\r\n"


def _holds_nothing(view: View) -> bool:
    """Whether the (non-empty) file holds no entry and no header: only whitespace, or one
    torn line that begins like a session header. Caller holds the state lock."""
    fold = view.state.fold
    if fold.objects or fold.non_objects or view.tentative is not None:
        return False
    if view.size > _TORN_HEADER_MAX or fold.malformed + int(view.tail_bad) > 1:
        return False
    fd = open_regular(view.state.path, os.O_RDONLY)
    try:
        raw = pread_exact(fd, view.size, 0)
    finally:
        os.close(fd)
    text = raw.removeprefix(UTF8_BOM).strip(_WHITESPACE)
    if not text:
        return True
    if b"\n" in text or not text.startswith(b"{"):
        return False
    compact = text.translate(None, _WHITESPACE)  # other writers may put spaces after ':'
    if _HEADER_START.startswith(compact):
        return True
    # A torn header, and only that: one object opened, never closed, naming itself a session
    # header. A second object glued on (an entry appended without a newline) holds content.
    return (
        compact.count(b"{") == 1
        and b"}" not in compact
        and compact.startswith(b'{"type":"session"')
    )


def settle_header(view: View, *, session_id: str, cwd: str) -> View:
    """Refuse a file the mirror may not append to; replace one that holds nothing by a fresh
    header. Returns the view to append against. Caller holds the session write lock and the
    state lock (in that order), and ``view`` is fresh."""
    target = view.state.path
    if not view.exists:
        if os.path.lexists(target):
            # open() found nothing, yet a name is there: a symbolic link to nowhere. Creating
            # "exclusively" would fail forever; writing through it would create its target.
            raise TranscriptUnwritable(target, "a dangling symbolic link")
        return view
    if view.size == 0:
        return view
    problem = view.header_problem()
    if problem is None:
        return view
    if not _holds_nothing(view):
        raise SessionFormatError(target, _refusal(problem))
    state = view.state
    current = os.stat(target)
    if (current.st_dev, current.st_ino, current.st_size) != (state.dev, state.ino, view.size):
        raise SessionFormatError(target, "changed while it was being recovered")
    # Through a symbolic link, replace what it points at, not the link.
    atomic_write(os.path.realpath(target), header_line(session_id, cwd))
    _log.warning(
        "session transcript held only a torn header; replaced with a fresh header",
        path=target,
        bytes=view.size,
    )
    return refresh(state)


def _refusal(problem: str) -> str:
    """Why a non-empty file that does not hold nothing is refused: the read cache's
    ``"empty"`` (no JSON object at all) is, for a file with content, a missing header."""
    if problem == "empty":
        return "no session header (no line of it is a JSON object)"
    return problem


def check_session_format(path: str | os.PathLike[str]) -> None:
    """Raise :class:`SessionFormatError` when ``path`` exists and is not a session transcript
    the preflight would accept (with the same reason); read-only: nothing is repaired, and
    a file that holds nothing (empty, whitespace, a torn header) passes. A missing path
    passes; one that cannot be read is :class:`TranscriptUnwritable`."""
    target = session_path(path)
    try:
        state = state_for(target)
        with state.lock:
            view = refresh(state)
            if not view.exists or view.size == 0:
                return
            problem = view.header_problem()
            if problem is None or _holds_nothing(view):
                return
    except OSError as error:
        why = unwritable_reason(error) or os.strerror(error.errno or errno.EIO)
        raise TranscriptUnwritable(target, why) from error
    raise SessionFormatError(target, _refusal(problem))


def _nearest_existing(directory: str) -> str:
    """``directory`` or its nearest existing ancestor (what ``makedirs`` would write in)."""
    while not os.path.lexists(directory):
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    return directory


def _check_path(target: str) -> None:
    """The stat-only part of the preflight: what the path is and whether it takes writes."""
    try:
        st: os.stat_result | None = os.lstat(target)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(target)
        except FileNotFoundError:
            raise TranscriptUnwritable(target, "a dangling symbolic link") from None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise TranscriptUnwritable(target, f"{file_kind(st.st_mode)}, not a regular file")
        if not os.access(target, os.W_OK):
            raise TranscriptUnwritable(target, "the file is not writable")
    directory = _nearest_existing(os.path.dirname(target))
    if not os.path.isdir(directory):
        raise TranscriptUnwritable(target, "a parent of the path is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise TranscriptUnwritable(target, "its directory is not writable")
    for suffix, what in ((".lock", "lock file"), (BINDING_SUFFIX, "thread binding sidecar")):
        try:
            beside = os.lstat(target + suffix)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(beside.st_mode):
            # A sidecar that cannot be written would make every turn forget its thread.
            raise TranscriptUnwritable(target, f"its {what} is {file_kind(beside.st_mode)}")


_OS_REASONS: Final = {
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EISDIR: "a directory",
    errno.ENOTDIR: "a parent of the path is not a directory",
    errno.ELOOP: "a symbolic link loop",
    errno.EROFS: "on a read-only file system",
}


def unwritable_reason(error: OSError) -> str | None:
    """Why ``error`` means the transcript cannot be written at all (what the path *is* or
    *allows*), or ``None`` for a failure that may pass (a full disk, an I/O error)."""
    if isinstance(error, NotRegularFileError):
        return error.strerror or "not a regular file"
    return _OS_REASONS.get(error.errno or 0)


def ensure_transcript_writable(
    path: str | os.PathLike[str],
    *,
    session_id: str,
    cwd: str,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> None:
    """Check, before anything reaches Codex, that the transcript can take this turn's mirror.

    Returns when the path is missing (under a directory that takes writes), empty, or a
    regular, writable file whose first object is a session header; a file that holds only a
    torn header (or only whitespace) is first replaced by a fresh header carrying
    ``session_id`` and ``cwd`` (under the write lock, waiting at most ``lock_timeout``: only
    then). Raises :class:`TranscriptUnwritable` otherwise (:class:`SessionFormatError` when
    the file is not a session transcript), at once: nothing here retries or blocks on the
    file. Synchronous; call from a worker thread.
    """
    target = session_path(path)
    try:
        _check_path(target)
        state = state_for(target)
        with state.lock:
            view = refresh(state)
            if not view.exists or view.size == 0 or view.header_problem() is None:
                return
        # Rare: recover (or refuse) under the write lock, as the mirror would.
        with session_write_lock(target, timeout=lock_timeout), state.lock:
            settle_header(refresh(state), session_id=session_id, cwd=cwd)
    except OSError as error:  # mapped once, here; the preflight cannot vouch for the file
        why = unwritable_reason(error) or os.strerror(error.errno or errno.EIO)
        raise TranscriptUnwritable(target, why) from error
