"""Wake-ups on one machine: a worker that ends a turn tells the processes waiting for it.

DBOS on SQLite has no notifications: a handle waiting for a turn's result would read the
database every few milliseconds for the whole turn (a real Codex turn lasts seconds to
minutes), costing a read per poll and, on average, half a polling interval of latency. Here
a process that waits for results binds one Unix datagram socket in a directory that belongs
to the database (:func:`wake_directory`); a worker whose turn ends sends the turn id to every
socket there (:func:`announce`). A wake-up is a hint, never the result: the waiter then reads
the turn's durable status from the database (the worker announces just before DBOS writes the
outcome, so the waiter reads again for a few milliseconds until it is there). A lost wake-up
(another machine, a full socket buffer) costs latency only: the waiter still reads the
database every ``fallback`` seconds.

Sockets of processes that died are unlinked by the next sender (``ECONNREFUSED``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import secrets
import socket
import tempfile
import threading
import weakref
from collections.abc import Iterator
from typing import Final

from codex_turn._log import format_error, get_logger

__all__ = ["Wakes", "announce", "wake_directory"]

_log = get_logger(__name__)

#: A Unix socket's path must fit ``sun_path`` (108 bytes with its NUL on Linux).
_MAX_SOCKET_PATH: Final = 100
_SUFFIX: Final = ".sock"


def wake_directory(database_url: str) -> str | None:
    """Where the wake sockets of ``database_url`` live (``None``: no wake-ups, Postgres).

    ``<database>.wake/`` next to an SQLite file; when its sockets' paths would be too long for
    a Unix socket, a directory in the temporary directory named by the database's real path.
    """
    if not database_url.startswith("sqlite:///"):
        return None
    path = os.path.realpath(database_url.removeprefix("sqlite:///"))
    directory = path + ".wake"
    if len(directory) + 1 + 32 + len(_SUFFIX) <= _MAX_SOCKET_PATH:
        return directory
    digest = hashlib.sha256(path.encode()).hexdigest()[:24]
    return os.path.join(tempfile.gettempdir(), f"codex-turn-wake-{os.getuid()}", digest)


def announce(directory: str | None, turn_id: str) -> int:
    """Tell every process waiting on ``directory`` that ``turn_id`` ended; how many were told.

    Never blocks and never raises: a wake-up is an optimisation."""
    if directory is None:
        return 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    told = 0
    payload = turn_id.encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.setblocking(False)
        for name in names:
            if not name.endswith(_SUFFIX):
                continue
            path = os.path.join(directory, name)
            try:
                sender.sendto(payload, path)
                told += 1
            except OSError as error:
                if error.errno in (errno.ECONNREFUSED, errno.ENOTSOCK):
                    with contextlib.suppress(OSError):
                        os.unlink(path)  # nobody is bound there: a process that died
                # EAGAIN (its buffer is full), ENOENT (it just left): it reads the database.
    return told


class _Waiter:
    """One wait for one turn: set from the reader thread, waited on by a thread or a task."""

    def __init__(self) -> None:
        self.fired = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async: asyncio.Event | None = None

    def fire(self) -> None:
        self.fired.set()
        loop, event = self._loop, self._async
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                loop.call_soon_threadsafe(event.set)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` s; True when woken (the flag is cleared)."""
        woken = self.fired.wait(timeout)
        self.fired.clear()
        return woken

    async def wait_async(self, seconds: float) -> bool:
        """:meth:`wait` for asyncio callers."""
        if self._async is None:
            self._loop = asyncio.get_running_loop()
            self._async = asyncio.Event()
            if self.fired.is_set():
                self._async.set()
        try:
            await asyncio.wait_for(self._async.wait(), seconds)
            woken = True
        except TimeoutError:
            woken = False
        self._async.clear()
        self.fired.clear()
        return woken


class Wakes:
    """This process's wake socket in ``directory``, bound on first use, and its waiters."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._waiters: dict[str, set[_Waiter]] = {}
        self._socket: socket.socket | None = None
        self._path: str | None = None
        self._failed = False
        self._reader: threading.Thread | None = None
        self._finalizer: weakref.finalize[..., Wakes] | None = None

    @property
    def available(self) -> bool:
        """Whether wake-ups can arrive here (else waiting is polling alone)."""
        return self._bind() is not None

    def _bind(self) -> str | None:
        with self._lock:
            if self._path is not None or self._failed or self.directory is None:
                return self._path
            try:
                os.makedirs(self.directory, mode=0o700, exist_ok=True)
                path = os.path.join(
                    self.directory, f"{os.getpid()}-{secrets.token_hex(6)}{_SUFFIX}"
                )
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sock.bind(path)
            except OSError as error:
                self._failed = True
                _log.info("no result wake-ups: the database is polled", error=format_error(error))
                return None
            self._socket, self._path = sock, path
            self._reader = threading.Thread(
                target=self._read, args=(sock,), name="codex-turn-wakes", daemon=True
            )
            self._reader.start()
            self._finalizer = weakref.finalize(self, _unlink, path)
            return path

    def _read(self, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(4096)
            except OSError:
                return
            if not data:  # close() sends an empty datagram to stop this thread
                return
            with self._lock:
                waiters = list(self._waiters.get(data.decode(errors="replace"), ()))
            for waiter in waiters:
                waiter.fire()

    @contextlib.contextmanager
    def waiter(self, turn_id: str) -> Iterator[_Waiter]:
        """Wake-ups for ``turn_id`` while the block runs (registered before it starts, so a
        worker's announcement after the block's first database read is never missed)."""
        self._bind()
        waiter = _Waiter()
        with self._lock:
            self._waiters.setdefault(turn_id, set()).add(waiter)
        try:
            yield waiter
        finally:
            with self._lock:
                waiters = self._waiters.get(turn_id)
                if waiters is not None:
                    waiters.discard(waiter)
                    if not waiters:
                        del self._waiters[turn_id]

    def close(self) -> None:
        with self._lock:
            sock, path, self._socket, self._path = self._socket, self._path, None, None
            self._failed = True
        if sock is None or path is None:
            return
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"", path)  # the reader's stop
        _unlink(path)
        if self._reader is not None:
            self._reader.join(timeout=1.0)
        sock.close()
        if self._finalizer is not None:
            self._finalizer.detach()


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
