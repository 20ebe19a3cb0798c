"""OpenClaw's session lock file, as every process sees it: ``<realpath(dir)>/<name>.lock``.

Theory
------
The file is created exclusively and holds OpenClaw's pretty JSON ``{pid, createdAt,
starttime}`` (:func:`lock_payload`); who holds it may append to the transcript, across
processes (OpenClaw itself included). This module is the file alone: taking it
(:func:`take_file_lock_once`, or waiting for it, :func:`acquire_file_lock`), releasing it only
while it still holds our bytes (:func:`release_file_lock`), and judging and breaking the
stale ones. Which holder of this process owns it (a write, a whole-turn lease) is
:mod:`~codex_turn.harness.session._lock`'s business.

A lock file is *stale*, and is broken, when its pid is dead or recycled (``/proc`` start
time) or names no process that can exist (negative, beyond ``pid_t``), when it names this
process (an orphan of an earlier holder: the file is only judged while this process does not
hold it), when ``createdAt`` is invalid, or when it is older than :data:`LOCK_STALE_SECONDS`
(another host's lease: its ``ttlMs``). Pid checks apply only to a holder on this host (no
``host`` field, as OpenClaw writes it, means this host). Breaking renames the file aside
first and puts it back if it changed meanwhile, so a fresh lock that replaced a stale one is
never removed. A breaker killed between its rename and its unlink leaves
``<name>.lock.stale.<pid>.<hex>`` behind: the first acquisition of a path in a process, and
every acquisition that broke a stale lock, sweep those whose pid is dead or impossible (or is
this process: it holds the path's lock, so none of its own is in use)
(:func:`sweep_stale_asides`). Every wait is bounded and ends in :class:`SessionLockTimeout`.

Our lock files add two fields OpenClaw ignores: ``host`` (the holder's host name, :data:`HOST`)
and, for a lease, ``ttlMs`` (the holder renews ``createdAt`` well within it). A holder on
another host is judged by age only, since its pid means nothing here: its lease expires
``ttlMs`` after its last renewal. A live holder on this host is never judged by its ttl, only
by OpenClaw's age rule (:data:`LOCK_STALE_SECONDS` since ``createdAt``, which a lease keeps
renewing).

Everything here is synchronous and some of it waits: call from a worker thread, never from an
event loop thread.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import stat
import string
import time
from contextlib import suppress
from typing import Any, Final

from codex_turn._log import get_logger
from codex_turn.harness._fs import (
    PRIVATE_FILE_MODE,
    NotRegularFileError,
    open_regular,
    pid_alive,
    pid_from_text,
)
from codex_turn.harness.session._format import SessionError, iso_to_ms, utc_now_iso

__all__ = ["LOCK_STALE_SECONDS", "SessionLockTimeout"]

_log = get_logger(__name__)

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


def read_lock(path: str) -> bytes:
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
        raw = read_lock(lock_path)
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
    created_ms = iso_to_ms(payload.get("createdAt"))
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
#: An earlier version's lease-renewal temp file (renewals are ``_fs.atomic_write`` now, whose
#: own leftovers the next renewal removes): still swept where a dead holder left one.
_LEGACY_RENEW_TEMP: Final = ".renew."


def _break_stale_lock(lock_path: str, reason: str, observed: bytes, pid: int | None) -> None:
    """Remove a stale lock without removing a fresh one that replaced it meanwhile."""
    aside = f"{lock_path}{_STALE_ASIDE}{os.getpid()}.{secrets.token_hex(4)}"
    try:
        # A move, not a write (so not _fs.atomic_write): the very file judged stale goes aside
        # to be compared; rename never replaces here (``aside`` is a fresh unique name).
        os.rename(lock_path, aside)
    except FileNotFoundError:
        return
    try:
        moved = read_lock(aside)
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


def sweep_stale_asides(lock_path: str) -> None:
    """Remove the ``<name>.lock.stale.<pid>.<hex>`` files of breakers that died mid-break, and
    the ``<name>.lock.renew.<pid>.<hex>`` temp files that lease holders of an earlier version
    left when they died mid-renewal.

    Called while holding the path's locks: an aside of this process is then never in use,
    and one of a live process may be (it is being compared): left alone.
    """
    directory, name = os.path.split(lock_path)
    prefixes = (name + _STALE_ASIDE, name + _LEGACY_RENEW_TEMP)
    try:
        candidates = [n for n in os.listdir(directory) if n.startswith(prefixes)]
    except OSError:
        return
    removed = 0
    for candidate in candidates:
        prefix = next(p for p in prefixes if candidate.startswith(p))
        pid_text, dot, token = candidate[len(prefix) :].partition(".")
        pid = pid_from_text(pid_text)
        if not (dot and pid is not None and len(token) == 8):
            continue
        if not all(c in string.hexdigits for c in token):
            continue
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
    payload: dict[str, Any] = {"pid": os.getpid(), "createdAt": utc_now_iso()}
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
        fd = os.open(lock_path, flags, PRIVATE_FILE_MODE)
    except FileExistsError:
        return None
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return data


def take_file_lock_once(
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
            observed = read_lock(lock_path)
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


def acquire_file_lock(lock_path: str, deadline: float, timeout: float, stale: float) -> bytes:
    """Take the lock file, waiting until ``deadline``; return the bytes written."""
    attempt = 0
    while True:
        written, holder, broke = take_file_lock_once(lock_path, stale)
        if broke:
            sweep_stale_asides(lock_path)
        if written is not None:
            return written
        now = time.monotonic()
        if now >= deadline:
            raise SessionLockTimeout(lock_path[: -len(".lock")], timeout, holder)
        attempt += 1
        # Short, jittered polls: OpenClaw's 50 ms x attempt would dominate a busy turn.
        pause = min(_LOCK_POLL_MAX, _LOCK_POLL_MIN * attempt) * (0.5 + secrets.randbelow(100) / 100)
        time.sleep(min(pause, max(0.0, deadline - now)))


def release_file_lock(lock_path: str, payload: bytes) -> None:
    """Remove the lock file if it still holds exactly ``payload`` (ours): a stale-breaker
    may already have replaced it."""
    try:
        current = read_lock(lock_path)
    except OSError:
        return
    if current == payload:
        with suppress(FileNotFoundError):
            os.unlink(lock_path)
