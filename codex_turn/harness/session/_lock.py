"""OpenClaw's session write lock: who may append to a transcript, across threads and processes.

Theory
------
Writers serialise on two locks, always taken in this order:

1. an in-process re-entrant :class:`threading.RLock` per transcript, so worker threads of one
   process queue cheaply and a thread that already holds :func:`session_write_lock` may
   mirror;
2. OpenClaw's advisory ``<realpath(dir)>/<name>.lock`` file (exclusive create, JSON
   ``{pid, createdAt, starttime}``), which other processes, including OpenClaw itself,
   honour. The file belongs to the *process*: it is taken by the outermost in-process holder
   and released when the last one leaves, unless a whole-turn lease
   (:mod:`~codex_turn.harness.session._lease`) holds it, in which case writers take the
   in-process lock only (the lease's process already owns the file, as OpenClaw's run
   attempt owns it for a whole turn).

Both are keyed by :func:`codex_turn.harness._fs.session_path`, the same key as the read
cache, the binding and the in-process turn gates. A lock file is *stale*, and is broken,
when its pid is dead or recycled (``/proc`` start time), when it names this process (an
orphan of an earlier holder), when ``createdAt`` is invalid, or when it is older than
:data:`LOCK_STALE_SECONDS` (another host's lease: its ``ttlMs``). Pid checks apply only to a
holder on this host (no ``host`` field, as OpenClaw writes it, means this host). Breaking
renames the file aside first and puts it back if it changed meanwhile, so a fresh lock that
replaced a stale one is never removed. A breaker killed between its rename and its unlink
leaves ``<name>.lock.stale.<pid>.<hex>`` behind: the first acquisition of a path in a
process, and every acquisition that broke a stale lock, sweep those whose pid is dead (or is
this process: it holds the path's lock, so none of its own is in use). Every wait is bounded
and ends in :class:`SessionLockTimeout`.

Our lock files add two fields OpenClaw ignores: ``host`` (the holder's host name) and, for a
lease, ``ttlMs`` (the holder renews ``createdAt`` well within it). A holder on another host is
judged by age only, since its pid means nothing here: its lease expires ``ttlMs`` after its
last renewal. A live holder on this host is never judged by its ttl, only by OpenClaw's age
rule (:data:`LOCK_STALE_SECONDS` since ``createdAt``, which a lease keeps renewing).

The locks are thread locks and waiting blocks: call from a worker thread
(``anyio.to_thread.run_sync``), never from an event loop thread.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import stat
import string
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any, Final

import attrs

from codex_turn._log import get_logger
from codex_turn.harness._fs import NotRegularFileError, open_regular, pid_alive, session_path
from codex_turn.harness.session._format import SessionError, _iso_to_ms, _utc_now_iso

if TYPE_CHECKING:
    from codex_turn.harness.session._lease import SessionLease

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
#: This host, as recorded in our lock files (``host``).
HOST: Final = socket.gethostname()


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
    """This process's side of one transcript's lock. ``rlock`` guards every other field."""

    rlock: threading.RLock = attrs.Factory(threading.RLock)
    depth: int = 0  # holders in this process (re-entrant, one thread at a time)
    swept: bool = False  # stale-lock leftovers looked for once per process
    #: The whole-turn lease holding the file, if any (:mod:`._lease`).
    lease: SessionLease | None = None
    #: The bytes this process wrote into the lock file while it holds it: released (or
    #: renewed) only while the file still holds exactly them.
    payload: bytes | None = None

    def holds_file(self) -> bool:
        return self.payload is not None


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
    """Why the lock file at ``lock_path`` is stale (or ``None``), and its holder pid.

    Called only while this process does not hold the file (its path lock held, no lease).
    """
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
    host = payload.get("host")
    same_host = not isinstance(host, str) or not host or host == HOST
    if same_host:
        # A holder on this host (OpenClaw writes no host): its pid can be checked here.
        if not pid_alive(pid):
            return "dead pid", pid
        if pid == os.getpid():
            # We only look at the file while this process does not hold it (path lock held,
            # no lease), so a lock naming our own pid is an orphan of an earlier holder.
            return "orphaned by this process", pid
        starttime = payload.get("starttime")
        if isinstance(starttime, int) and not isinstance(starttime, bool):
            current = _process_starttime(pid)
            if current is not None and current != starttime:
                return "recycled pid", pid
    created_ms = _iso_to_ms(payload.get("createdAt"))
    if created_ms is None:
        return "invalid createdAt", pid
    age_ms = time.time() * 1000 - created_ms
    ttl_ms = payload.get("ttlMs")
    if not same_host and isinstance(ttl_ms, int) and not isinstance(ttl_ms, bool) and ttl_ms > 0:
        # Another host's lease: its liveness is its renewals. (A live holder on this host is
        # only ever judged by OpenClaw's age rule, renewed or not.)
        if age_ms > min(ttl_ms, stale_after * 1000):
            return "lease expired", pid
    elif age_ms > stale_after * 1000:
        return "too old", pid
    return None, pid


_STALE_ASIDE: Final = ".stale."
_RENEW_TEMP: Final = ".renew."  # a lease renewal's temp file, renamed over the lock


def _break_stale_lock(lock_path: str, reason: str, observed: bytes, pid: int | None) -> None:
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
        _log.warning(
            "session lock was stale; removed", lock=lock_path, reason=reason, holder_pid=pid
        )
    finally:
        with suppress(OSError):
            os.unlink(aside)


def _sweep_stale_asides(lock_path: str) -> None:
    """Remove the ``<name>.lock.stale.<pid>.<hex>`` files of breakers that died mid-break, and
    the ``<name>.lock.renew.<pid>.<hex>`` temp files of lease holders that died mid-renewal.

    Called while holding the path's locks: an aside of this process is then never in use,
    and one of a live process may be (it is being compared): left alone.
    """
    directory, name = os.path.split(lock_path)
    prefixes = (name + _STALE_ASIDE, name + _RENEW_TEMP)
    try:
        candidates = [n for n in os.listdir(directory) if n.startswith(prefixes)]
    except OSError:
        return
    removed = 0
    for candidate in candidates:
        prefix = next(p for p in prefixes if candidate.startswith(p))
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


#: This process's ``/proc`` start time, read once per pid (a forked child reads its own).
_own_starttime: tuple[int, int] | None = None


def _own_process_starttime() -> int | None:
    global _own_starttime
    pid = os.getpid()
    cached = _own_starttime
    if cached is not None and cached[0] == pid:
        return cached[1]
    starttime = _process_starttime(pid)
    if starttime is not None:  # a passing failure to read it is asked again next time
        _own_starttime = (pid, starttime)
    return starttime


def lock_payload(ttl: float | None = None) -> bytes:
    """The lock file's bytes for this process now: OpenClaw's pretty JSON ``{pid, createdAt,
    starttime?}`` plus ``host`` and, for a lease, ``ttlMs``.

    Exactly ``json.dumps(payload, indent=2) + "\\n"`` (``JSON.stringify(payload, null, 2)``),
    written out field by field: with ``indent`` the standard library encodes in pure Python,
    ten times slower, and every turn writes one."""
    payload: dict[str, Any] = {"pid": os.getpid(), "createdAt": _utc_now_iso()}
    starttime = _own_process_starttime()
    if starttime is not None:
        payload["starttime"] = starttime
    payload["host"] = HOST
    if ttl is not None:
        payload["ttlMs"] = max(1, round(ttl * 1000))
    fields = ",\n".join(
        f"  {_json_str(key)}: {_json_str(value) if isinstance(value, str) else int(value)}"
        for key, value in payload.items()
    )
    return f"{{\n{fields}\n}}\n".encode()


#: ``json.dumps`` of a string (ASCII-escaped), without its per-call encoder setup.
_json_str: Final = json.encoder.encode_basestring_ascii


def _try_create_lock(lock_path: str, ttl: float | None = None) -> bytes | None:
    """Create the lock file (exclusive); return the bytes written, or ``None`` if it exists."""
    data = lock_payload(ttl)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(lock_path, flags, 0o600)
    except FileExistsError:
        return None
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return data


def _take_file_lock_once(
    lock_path: str, stale: float, ttl: float | None = None
) -> tuple[bytes | None, int | None, bool]:
    """One attempt at the lock file, breaking stale locks on the way: ``(the bytes written or
    None if a live holder has it, that holder's pid, whether a stale lock was broken)``.
    Raises :class:`OSError` when the file cannot be created or read at all."""
    broke = False
    holder: int | None = None
    for _ in range(16):  # a stale lock replaced by another stale one, again and again: busy
        written = _try_create_lock(lock_path, ttl)
        if written is not None:
            return written, None, broke
        try:
            observed = _read_lock(lock_path)
        except FileNotFoundError:
            with suppress(FileNotFoundError):  # released meanwhile: try again
                if stat.S_ISLNK(os.lstat(lock_path).st_mode):  # a dangling link: never ours
                    raise NotRegularFileError(errno.EINVAL, "a symbolic link", lock_path) from None
            continue
        reason, holder = _lock_staleness(lock_path, stale)
        if reason is None:
            return None, holder, broke
        _break_stale_lock(lock_path, reason, observed, holder)
        broke = True
    return None, holder, broke


def _acquire_file_lock(lock_path: str, deadline: float, timeout: float, stale: float) -> bytes:
    """Take the lock file, waiting until ``deadline``; return the bytes written."""
    attempt = 0
    while True:
        written, holder, broke = _take_file_lock_once(lock_path, stale)
        if broke:
            _sweep_stale_asides(lock_path)
        if written is not None:
            return written
        now = time.monotonic()
        if now >= deadline:
            raise SessionLockTimeout(lock_path[: -len(".lock")], timeout, holder)
        attempt += 1
        # Short, jittered polls: OpenClaw's 50 ms x attempt would dominate a busy turn.
        pause = min(_LOCK_POLL_MAX, _LOCK_POLL_MIN * attempt) * (0.5 + secrets.randbelow(100) / 100)
        time.sleep(min(pause, max(0.0, deadline - now)))


def _release_file_lock(lock_path: str, payload: bytes) -> None:
    """Remove the lock file if it still holds exactly ``payload`` (ours): a stale-breaker
    may already have replaced it."""
    try:
        current = _read_lock(lock_path)
    except OSError:
        return
    if current == payload:
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

    Re-entrant within one thread (nested holders share the file lock). When this process
    holds the session's whole-turn lease, the lease owns the file and only the in-process
    lock is taken. Usable from any thread; never from an event loop thread, since waiting
    blocks. Yields the lock target, the transcript's
    :func:`~codex_turn.harness._fs.session_path`. Raises :class:`SessionLockTimeout` after
    ``timeout`` seconds.
    """
    target = session_path(path)
    deadline = time.monotonic() + timeout
    lock = _path_lock(target)
    if not lock.rlock.acquire(timeout=max(0.0, timeout)):
        raise SessionLockTimeout(target, timeout)
    try:
        took_file = False
        if not lock.holds_file():
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if not lock.swept:
                lock.swept = True
                _sweep_stale_asides(target + ".lock")
            lock.payload = _acquire_file_lock(target + ".lock", deadline, timeout, stale_after)
            took_file = True
        lock.depth += 1
        try:
            yield target
        finally:
            lock.depth -= 1
            if took_file and lock.payload is not None:
                _release_file_lock(target + ".lock", lock.payload)
                lock.payload = None
    finally:
        lock.rlock.release()
