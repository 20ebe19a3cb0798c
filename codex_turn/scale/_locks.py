"""Liveness locks: one per live worker, named by its executor id, dropped when it dies.

Every worker holds an advisory lock named by its executor id for as long as it lives, and the
operating system (or Postgres) drops it the moment the process dies, even by SIGKILL. Whoever
can take a worker's lock knows that worker is dead (:meth:`ExecutorLocks.claim`), and holds it
while it cleans up after it, so a worker restarted under that id waits until it is done.

So a held lock is not a live worker: it may be a claim, a peer cleaning up after the dead one
(a watchdog holds it while it moves the dead worker's turns). A claim marks itself, and the
liveness probe (:meth:`ExecutorLocks.alive`, what routing asks) reads a lock held under that
mark as dead: else a turn submitted during a peer's cleanup went to the dead worker's queue.

* SQLite (one machine): a lock file per executor id in ``<database>.executors/``, held with
  ``flock`` and holding a record of who holds it (pid, host, pid namespace, and whether it is a
  claim); a taker of a dead executor's lock unlinks the file (a taker re-checks that the path
  still names the file it locked). The probe also reads a lock as dead when the pid it
  records is gone from this host's pid namespace (the instant before a claimer's record is
  written; a child forked without exec that kept the dead holder's open file).
* Postgres (many machines): a session-level ``pg_advisory_lock`` on a connection of its own,
  released by the server when the holder's connection ends; a claim's mark is a second
  advisory lock, and the probe reads ``pg_locks`` (taking nothing).

The same locks name things that are not executors (the inbox's mover,
:data:`codex_turn.scale._routing.INBOX_LOCK`): a claim is then a plain mutual exclusion.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any, Final, Protocol

from codex_turn._log import format_error

__all__ = [
    "ExecutorIdInUse",
    "ExecutorLockLost",
    "ExecutorLocks",
    "FileExecutorLocks",
    "PostgresExecutorLocks",
    "executor_locks_for",
]

#: The first key of every Postgres advisory lock of codex-turn (the second is the executor's).
_PG_LOCK_SPACE: Final = "codex-turn-executor"
#: The first key of a claim's mark (held with the executor's lock while a claim holds it).
_PG_CLAIM_SPACE: Final = "codex-turn-executor-claim"


class ExecutorIdInUse(RuntimeError):
    """Another live worker runs under this executor id (give each worker its own)."""


class ExecutorLockLost(RuntimeError):
    """This worker no longer holds its executor lock (its database connection dropped): a
    peer may recover its turns, so it must take no new turn and shut down."""


class ExecutorLocks(Protocol):
    """One worker's liveness lock and its probes of its peers' locks."""

    def hold(self, executor_id: str, timeout: float) -> None:
        """Take this worker's lock (waiting at most ``timeout`` s): ``ExecutorIdInUse``."""

    def release(self) -> None:
        """Let this worker's lock go."""

    def verify(self, executor_id: str) -> None:
        """Raise :class:`ExecutorLockLost` unless this worker still holds its lock."""

    def claim(self, executor_id: str) -> contextlib.AbstractContextManager[bool]:
        """While the block runs: True when ``executor_id``'s lock was free (its holder is
        dead) and is now held here (marked as a claim), False when another process holds it
        (its holder, or another claim)."""

    def alive(self, executor_id: str) -> bool:
        """Whether ``executor_id``'s holder lives: its lock is held, and not by a claim (a
        claim proves the holder dead). Takes the lock of a dead one only for an instant."""


# --- SQLite: lock files ------------------------------------------------------------------


class FileExecutorLocks:
    """Lock files in ``directory``, one per executor id, held with ``flock``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._fd: int | None = None
        self._path: str | None = None

    def _path_of(self, executor_id: str) -> str:
        return os.path.join(self.directory, urllib.parse.quote(executor_id, safe="") + ".lock")

    def _try_lock(self, path: str) -> int | None:
        """The fd of ``path``, locked exclusively, or None if a live process holds it."""
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    return None
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)  # unlinked by a watchdog meanwhile: lock the file there now

    def hold(self, executor_id: str, timeout: float) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        path = self._path_of(executor_id)
        deadline = time.monotonic() + timeout
        while (fd := self._try_lock(path)) is None:
            if time.monotonic() >= deadline:
                raise ExecutorIdInUse(
                    f"executor id {executor_id!r} is held by another live worker "
                    f"({_holder(path)}): give each worker its own executor id"
                )
            time.sleep(0.02)
        _write_record(fd, _record(executor_id, claim=False))
        self._fd, self._path = fd, path

    def release(self) -> None:
        fd, path, self._fd, self._path = self._fd, self._path, None, None
        if fd is None or path is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # while still locked: a taker of the old file sees it is gone
        os.close(fd)

    def verify(self, executor_id: str) -> None:
        fd, path = self._fd, self._path
        try:
            same = (
                fd is not None and path is not None and os.fstat(fd).st_ino == os.stat(path).st_ino
            )
        except OSError:
            same = False
        if not same:
            raise ExecutorLockLost(f"the lock file of executor {executor_id!r} is gone")

    @contextlib.contextmanager
    def claim(self, executor_id: str) -> Iterator[bool]:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        path = self._path_of(executor_id)
        fd = self._try_lock(path)
        if fd is None:
            yield False
            return
        try:
            # The mark: a probe that finds the lock held reads that its holder is dead.
            with contextlib.suppress(OSError):
                _write_record(fd, _record(executor_id, claim=True))
            yield True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.close(fd)

    def alive(self, executor_id: str) -> bool:
        path = self._path_of(executor_id)
        if path == self._path:
            return True  # this worker's own
        with self.claim(executor_id) as dead:
            if dead:
                return False
        return _holder_may_live(_read_record(path))


def _pid_namespace() -> str | None:
    """This process's pid namespace (Linux), so a pid is looked up only where it means the
    same process; ``None`` elsewhere."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _record(executor_id: str, *, claim: bool) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "pid_namespace": _pid_namespace(),
        "executor_id": executor_id,
        "claim": claim,
    }


def _write_record(fd: int, record: dict[str, Any]) -> None:
    """Replace the record of the lock file ``fd`` (locked here). Overwritten in place, then
    cut to length: a reader sees the old record or the new one as the file's leading JSON
    object, never an empty file."""
    data = json.dumps(record).encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def _read_record(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as file:  # a new open file: closing it drops no flock
            text = file.read(4096).decode()
        record, _ = json.JSONDecoder().raw_decode(text)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _holder_may_live(record: dict[str, Any] | None) -> bool:
    """Whether the process recorded in a lock file found locked may live: not when the record
    is a claim's, nor when its pid is gone from this host's pid namespace (the lock is then
    held by a claimer yet to write its record, or by a process that inherited the dead
    holder's open file). An unreadable record (being written) may live."""
    if record is None:
        return True
    if record.get("claim") is True:
        return False
    pid = record.get("pid")
    if (
        type(pid) is not int
        or pid <= 0
        or record.get("host") != socket.gethostname()
        or record.get("pid_namespace") != _pid_namespace()
    ):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists (another user's)
        return True
    return True


def _holder(path: str) -> str:
    record = _read_record(path)
    if record is None:
        return "unknown holder"
    claimer = "a peer cleaning up: " if record.get("claim") is True else ""
    return f"{claimer}pid {record.get('pid')} on {record.get('host')}"


# --- Postgres: advisory locks ---------------------------------------------------------------


class PostgresExecutorLocks:
    """Session-level advisory locks on one connection of this worker's own."""

    def __init__(self, database_url: str) -> None:
        import psycopg

        scheme, _, rest = database_url.partition("://")
        self._url = scheme.split("+", 1)[0] + "://" + rest
        self._connection: Any = psycopg.connect(self._url, autocommit=True)
        self._lock = threading.Lock()  # the worker's and the watchdog's uses of the connection
        self._held: str | None = None

    def _call(self, function: str, executor_id: str, space: str = _PG_LOCK_SPACE) -> bool:
        return self._select(f"SELECT {function}(hashtext(%s), hashtext(%s))", (space, executor_id))

    def _select(self, query: str, params: tuple[str, ...]) -> bool:
        with self._lock:
            row = self._connection.execute(query, params).fetchone()
        return bool(row[0])

    def hold(self, executor_id: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._call("pg_try_advisory_lock", executor_id):
            if time.monotonic() >= deadline:
                raise ExecutorIdInUse(
                    f"executor id {executor_id!r} is held by another live worker: "
                    "give each worker its own executor id"
                )
            time.sleep(0.02)
        self._held = executor_id

    def release(self) -> None:
        self._held = None
        with self._lock:
            self._connection.close()  # ends the session: every lock of it goes

    def verify(self, executor_id: str) -> None:
        """The session-level lock lives only as long as its connection: ask that connection
        whether it still holds it (a dropped connection raises, and has lost it)."""
        if self._held != executor_id:
            raise ExecutorLockLost(f"executor {executor_id!r} holds no lock here")
        try:
            with self._lock:
                row = self._connection.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                    " AND pid = pg_backend_pid() AND granted AND objsubid = 2"
                    " AND classid = hashtext(%s)::oid AND objid = hashtext(%s)::oid",
                    (_PG_LOCK_SPACE, executor_id),
                ).fetchone()
        except Exception as error:
            raise ExecutorLockLost(
                f"the database connection holding executor {executor_id!r}'s lock is gone: "
                f"{format_error(error)}"
            ) from error
        if not row or not row[0]:
            raise ExecutorLockLost(f"executor {executor_id!r}'s advisory lock is not held")

    @contextlib.contextmanager
    def claim(self, executor_id: str) -> Iterator[bool]:
        # The lock and its mark in one statement (the mark only with the lock: CASE does not
        # evaluate a branch it does not take; "IS NOT NULL", as "OR true" would be folded
        # away unevaluated), so that no probe finds the lock held unmarked between two round
        # trips. The mark is free whenever the lock is (dropped before it).
        if executor_id == self._held or not self._select(
            "SELECT CASE WHEN pg_try_advisory_lock(hashtext(%s), hashtext(%s))"
            " THEN pg_try_advisory_lock(hashtext(%s), hashtext(%s)) IS NOT NULL ELSE false END",
            (_PG_LOCK_SPACE, executor_id, _PG_CLAIM_SPACE, executor_id),
        ):
            yield False
            return
        try:
            yield True
        finally:
            self._select(  # both, the mark first (two columns: no short circuit)
                "SELECT pg_advisory_unlock(hashtext(%s), hashtext(%s)),"
                " pg_advisory_unlock(hashtext(%s), hashtext(%s))",
                (_PG_CLAIM_SPACE, executor_id, _PG_LOCK_SPACE, executor_id),
            )

    def alive(self, executor_id: str) -> bool:
        if executor_id == self._held:
            return True
        # Held, and not marked as a claim, in this database (advisory locks are per database).
        return self._select(
            "SELECT coalesce(bool_or(classid = hashtext(%s)::oid), false)"
            " AND NOT coalesce(bool_or(classid = hashtext(%s)::oid), false)"
            " FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2"
            " AND objid = hashtext(%s)::oid"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (_PG_LOCK_SPACE, _PG_CLAIM_SPACE, executor_id),
        )


def executor_locks_for(database_url: str) -> ExecutorLocks:
    """The liveness locks of the workers of ``database_url``."""
    if database_url.startswith("sqlite:///"):
        return FileExecutorLocks(database_url.removeprefix("sqlite:///") + ".executors")
    if database_url.startswith(("postgresql", "postgres")):
        return PostgresExecutorLocks(database_url)
    raise ValueError(f"no executor locks for this database URL scheme: {database_url!r}")
