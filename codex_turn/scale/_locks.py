"""Liveness: two locks per live worker, dropped by the OS (or Postgres) the moment it dies.

A worker holds, named by its executor id, an *alive* lock for its whole life and a *serving*
lock until it starts draining. Both go when the process dies, even by SIGKILL. So whoever
takes a worker's alive lock (:meth:`FileLiveness.claim`) knows that worker is dead, and holds
the lock while it recovers the worker's turns: a worker restarted under that id waits until
it is done, and one live worker runs per id. Whether a worker takes forwarded turns is a probe
of its serving lock (:meth:`FileLiveness.serving`), which takes nothing.

* SQLite (one machine): ``flock`` on ``<id>.lock`` and ``<id>.serving`` in
  ``<database>.executors/`` (owner-only). The alive file names its holder (pid, host) for the
  error a second worker under the id gets; it is unlinked by its holder on release and by a
  claimer that found it dead (a taker re-checks that the path still names the file it locked).
* Postgres (many machines): session-level advisory locks on a connection of the worker's own,
  released by the server when that connection ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, Final

from codex_turn.errors import CodexTurnError

__all__ = ["ExecutorIdInUse", "ExecutorLockLost", "Liveness", "liveness_for"]

_PG_ALIVE: Final = "codex-turn-executor"
_PG_SERVING: Final = "codex-turn-serving"
_PG_HELD: Final = (
    "SELECT count(*) > 0 FROM pg_locks WHERE locktype = 'advisory' AND granted"
    " AND objsubid = 2 AND classid = hashtext(%s)::oid AND objid = hashtext(%s)::oid"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


class ExecutorIdInUse(CodexTurnError, RuntimeError):
    """Another live worker runs under this executor id (give each worker its own)."""


class ExecutorLockLost(CodexTurnError, RuntimeError):
    """This worker no longer holds its alive lock (its database connection dropped): a peer
    may take its turns over, so it must take no new turn and shut down."""


class FileLiveness:
    """``flock`` on files in ``directory``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.executor_id: str | None = None
        self._alive: int | None = None
        self._serving: int | None = None

    def _path(self, executor_id: str, kind: str) -> str:
        return os.path.join(self.directory, f"{executor_id}.{kind}")

    def _take(self, path: str) -> int | None:
        """``path``'s fd, locked, or None when another open file holds it."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            with contextlib.suppress(FileNotFoundError):
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    return fd
            os.close(fd)  # unlinked meanwhile by a releaser or a claimer: lock the new file

    def hold(self, executor_id: str, timeout: float) -> None:
        """Take this worker's locks, waiting at most ``timeout`` s (``ExecutorIdInUse``)."""
        path = self._path(executor_id, "lock")
        deadline = time.monotonic() + timeout
        while (fd := self._take(path)) is None:
            if time.monotonic() >= deadline:
                raise ExecutorIdInUse(
                    f"executor id {executor_id!r} is held by another live worker "
                    f"({_holder(path)}): give each worker its own executor id"
                )
            time.sleep(0.02)
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
        os.pwrite(fd, record, 0)
        os.ftruncate(fd, len(record))
        self.executor_id, self._alive = executor_id, fd
        while (serving := self._take(self._path(executor_id, "serving"))) is None:
            time.sleep(0.005)  # a prober holds it for an instant
        self._serving = serving

    def stop_serving(self) -> None:
        """Drain: no turn is forwarded here any more."""
        fd, self._serving = self._serving, None
        if fd is not None and self.executor_id is not None:
            _unlink_and_close(self._path(self.executor_id, "serving"), fd)

    def release(self) -> None:
        self.stop_serving()
        fd, self._alive = self._alive, None
        if fd is not None and self.executor_id is not None:
            _unlink_and_close(self._path(self.executor_id, "lock"), fd)

    def verify(self) -> None:
        """``ExecutorLockLost`` unless this worker still holds its alive lock."""
        fd, path = self._alive, self._path(str(self.executor_id), "lock")
        with contextlib.suppress(OSError):
            if fd is not None and os.fstat(fd).st_ino == os.stat(path).st_ino:
                return
        raise ExecutorLockLost(f"the lock file of executor {self.executor_id!r} is gone")

    @contextlib.contextmanager
    def claim(self, executor_id: str) -> Iterator[bool]:
        """While the block runs: True when ``executor_id`` was dead (its alive lock free, now
        held here); False when it lives (or another peer claims it, or it is this worker)."""
        path = self._path(executor_id, "lock")
        fd = None if executor_id == self.executor_id else self._take(path)
        if fd is None:
            yield False
            return
        try:
            yield True
        finally:
            with contextlib.suppress(OSError):
                os.unlink(self._path(executor_id, "serving"))
            _unlink_and_close(path, fd)

    def serving(self, executor_id: str) -> bool:
        """Whether ``executor_id`` holds its serving lock (probed shared: takes nothing)."""
        try:
            fd = os.open(self._path(executor_id, "serving"), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False


def _unlink_and_close(path: str, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # while still locked: a taker of the old file sees it is gone
    os.close(fd)


def _holder(path: str) -> str:
    try:
        with open(path, "rb") as file:  # a new open file: closing it drops no flock
            record = json.loads(file.read(4096))
        return f"pid {record['pid']} on {record['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown holder"


class PostgresLiveness:
    """The same, as session-level advisory locks on one connection of this worker's own."""

    def __init__(self, database_url: str) -> None:
        import psycopg

        self.url = database_url
        scheme, _, rest = database_url.partition("://")
        self.connection: Any = psycopg.connect(scheme.split("+")[0] + "://" + rest, autocommit=True)
        self.executor_id: str | None = None
        self._lock = threading.Lock()  # the worker's and its sweeper's uses of the connection

    def _select(self, query: str, space: str, executor_id: str) -> bool:
        with self._lock:
            return bool(self.connection.execute(query, (space, executor_id)).fetchone()[0])

    def _try(self, space: str, executor_id: str, function: str = "pg_try_advisory_lock") -> bool:
        return self._select(f"SELECT {function}(hashtext(%s), hashtext(%s))", space, executor_id)

    def hold(self, executor_id: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._try(_PG_ALIVE, executor_id):
            if time.monotonic() >= deadline:
                raise ExecutorIdInUse(
                    f"executor id {executor_id!r} is held by another live worker: "
                    "give each worker its own executor id"
                )
            time.sleep(0.02)
        self.executor_id = executor_id
        self._try(_PG_SERVING, executor_id)  # free while the alive lock is held here

    def stop_serving(self) -> None:
        if self.executor_id is not None:
            with contextlib.suppress(Exception):
                self._try(_PG_SERVING, self.executor_id, "pg_advisory_unlock")

    def release(self) -> None:
        with self._lock:
            self.connection.close()  # ends the session: every lock of it goes

    def verify(self) -> None:
        mine = _PG_HELD + " AND pid = pg_backend_pid()"
        try:
            if self._select(mine, _PG_ALIVE, str(self.executor_id)):
                return
        except Exception as error:
            raise ExecutorLockLost(f"executor {self.executor_id!r}'s connection is gone") from error
        raise ExecutorLockLost(f"executor {self.executor_id!r}'s advisory lock is not held")

    @contextlib.contextmanager
    def claim(self, executor_id: str) -> Iterator[bool]:
        # Session locks are re-entrant: this worker's own id is never claimed here.
        if executor_id == self.executor_id or not self._try(_PG_ALIVE, executor_id):
            yield False
            return
        try:
            yield True
        finally:
            self._try(_PG_ALIVE, executor_id, "pg_advisory_unlock")

    def serving(self, executor_id: str) -> bool:
        return self._select(_PG_HELD, _PG_SERVING, executor_id)


Liveness = FileLiveness | PostgresLiveness


def liveness_for(database_url: str) -> Liveness:
    """The liveness locks of the workers of ``database_url``."""
    if database_url.startswith("sqlite:///"):
        return FileLiveness(database_url.removeprefix("sqlite:///") + ".executors")
    return PostgresLiveness(database_url)
