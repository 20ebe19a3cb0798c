"""OpenClaw's session write lock: who may append to a transcript, across threads and processes.

Theory
------
Writers serialise on two locks, always taken in this order:

1. an in-process re-entrant :class:`threading.RLock` per transcript, so worker threads of one
   process queue cheaply and a thread that already holds :func:`session_write_lock` may
   mirror;
2. OpenClaw's advisory ``<realpath(dir)>/<name>.lock`` file (exclusive create, JSON
   ``{pid, createdAt, starttime}``), which other processes, including OpenClaw itself,
   honour. Only the outermost in-process holder takes and releases it.

Both are keyed by :func:`codex_turn.harness._fs.session_path`, the same key as the read
cache, the binding and the in-process turn gates. A lock file is *stale*, and is broken,
when its pid is dead or recycled (``/proc`` start time), when it names this process (an
orphan of an earlier holder), when ``createdAt`` is invalid, or when it is older than
:data:`LOCK_STALE_SECONDS`. Breaking renames the file aside first and puts it back if it
changed meanwhile, so a fresh lock that replaced a stale one is never removed. A breaker
killed between its rename and its unlink leaves ``<name>.lock.stale.<pid>.<hex>`` behind:
the first acquisition of a path in a process, and every acquisition that broke a stale lock,
sweep those whose pid is dead (or is this process: it holds the path's lock, so none of its
own is in use). Every wait is bounded and ends in :class:`SessionLockTimeout`.

The locks are thread locks and waiting blocks: call from a worker thread
(``anyio.to_thread.run_sync``), never from an event loop thread.
"""

from __future__ import annotations

import json
import os
import secrets
import string
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, Final

import attrs

from codex_turn._log import get_logger
from codex_turn.harness._fs import open_regular, pid_alive, session_path
from codex_turn.harness.session._format import SessionError, _iso_to_ms, _utc_now_iso

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "LOCK_STALE_SECONDS",
    "SessionLockTimeout",
    "session_write_lock",
]

_log = get_logger(__name__)

DEFAULT_LOCK_TIMEOUT: Final = 10.0  # OpenClaw's default session write-lock timeout
LOCK_STALE_SECONDS: Final = 30 * 60.0  # OpenClaw's staleMs
# A lock file whose payload does not parse may be mid-write by a non-atomic writer (OpenClaw
# creates, then writes): only break it once it is this old.
_LOCK_UNPARSABLE_GRACE_SECONDS: Final = 2.0
_LOCK_POLL_MIN: Final = 0.002
_LOCK_POLL_MAX: Final = 0.05


class SessionLockTimeout(SessionError):
    """The session write lock could not be taken within the timeout."""

    def __init__(self, path: str, timeout: float, holder_pid: int | None = None) -> None:
        holder = f" (held by pid {holder_pid})" if holder_pid is not None else ""
        super().__init__(f"timed out after {timeout:.1f}s waiting for the lock on {path}{holder}")
        self.path = path
        self.timeout = timeout
        self.holder_pid = holder_pid


@attrs.define
class _PathLock:
    rlock: threading.RLock = attrs.Factory(threading.RLock)
    depth: int = 0  # holders in this process (re-entrant, one thread at a time)
    swept: bool = False  # stale-lock leftovers looked for once per process


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


def _read_lock(path: str) -> bytes:
    """A lock file's first 64 KiB; never blocks on a FIFO put at the lock's name."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)


def _lock_staleness(lock_path: str, stale_after: float) -> tuple[str | None, int | None]:
    """Why the lock file at ``lock_path`` is stale (or ``None``), and its holder pid."""
    try:
        raw = _read_lock(lock_path)
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


_STALE_ASIDE: Final = ".stale."


def _break_stale_lock(lock_path: str, reason: str, observed: bytes) -> None:
    """Remove a stale lock without removing a fresh one that replaced it meanwhile."""
    aside = f"{lock_path}{_STALE_ASIDE}{os.getpid()}.{secrets.token_hex(4)}"
    try:
        os.rename(lock_path, aside)
    except FileNotFoundError:
        return
    try:
        moved = _read_lock(aside)
        if moved != observed:
            # Someone replaced the stale lock between our check and the rename: put it back.
            with suppress(OSError):
                os.link(aside, lock_path)
            return
        _log.warning("session lock was stale; removed", lock=lock_path, reason=reason)
    finally:
        with suppress(OSError):
            os.unlink(aside)


def _sweep_stale_asides(lock_path: str) -> None:
    """Remove the ``<name>.lock.stale.<pid>.<hex>`` files of breakers that died mid-break.

    Called while holding the path's locks: an aside of this process is then never in use,
    and one of a live process may be (it is being compared): left alone.
    """
    directory, name = os.path.split(lock_path)
    prefix = name + _STALE_ASIDE
    try:
        candidates = [n for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:
        return
    removed = 0
    for candidate in candidates:
        pid_text, dot, token = candidate[len(prefix) :].partition(".")
        if not (dot and pid_text.isdigit() and len(token) == 8):
            continue
        if not all(c in string.hexdigits for c in token):
            continue
        pid = int(pid_text)
        if pid == os.getpid() or not pid_alive(pid):
            with suppress(OSError):
                os.unlink(os.path.join(directory, candidate))
                removed += 1
    if removed:
        _log.info("stale session lock leftovers removed", lock=lock_path, count=removed)


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


def _acquire_file_lock(lock_path: str, deadline: float, timeout: float, stale: float) -> bool:
    """Take the lock file; return whether a stale lock was broken on the way."""
    attempt = 0
    holder: int | None = None
    broke = False
    while True:
        if _try_create_lock(lock_path):
            return broke
        try:
            observed = _read_lock(lock_path)
        except FileNotFoundError:
            continue
        reason, holder = _lock_staleness(lock_path, stale)
        if reason is not None:
            _break_stale_lock(lock_path, reason, observed)
            broke = True
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
        payload = json.loads(_read_lock(lock_path))
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
    thread; never from an event loop thread, since waiting blocks. Yields the lock target,
    the transcript's :func:`~codex_turn.harness._fs.session_path`. Raises
    :class:`SessionLockTimeout` after ``timeout`` seconds.
    """
    target = session_path(path)
    deadline = time.monotonic() + timeout
    lock = _path_lock(target)
    if not lock.rlock.acquire(timeout=max(0.0, timeout)):
        raise SessionLockTimeout(target, timeout)
    try:
        if lock.depth == 0:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            broke = _acquire_file_lock(target + ".lock", deadline, timeout, stale_after)
            if broke or not lock.swept:
                lock.swept = True
                _sweep_stale_asides(target + ".lock")
        lock.depth += 1
        try:
            yield target
        finally:
            lock.depth -= 1
            if lock.depth == 0:
                _release_file_lock(target + ".lock")
    finally:
        lock.rlock.release()
