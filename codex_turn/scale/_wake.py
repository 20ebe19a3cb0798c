"""Waiting for a workflow to end: DBOS's status, polled, with wake-ups on one machine.

DBOS on SQLite has no notifications, and each read of a workflow's status costs ~0.7 ms of
CPU: polling every few milliseconds for a whole turn slows the turn itself when the waiter
shares the worker's process (and every worker that awaits a forwarded turn). So a waiting
process binds one Unix datagram socket in a directory of the database's
(:func:`wake_directory`), and a worker whose workflow ended sends the workflow's id to every
socket there (:func:`announce`) once DBOS wrote its outcome; the waiter then reads the
status. A wake-up is a hint, never the result: a lost one (another machine, a full buffer)
costs latency only, as the waiter also reads every :data:`FALLBACK_S` s. Without a socket
(Postgres) the waiter reads ``poll`` s apart at first, then ``1/20`` of the time it waited
(at most :data:`FALLBACK_S`). ``bench_scale.py`` measures what the wake-ups save. Sockets of
processes that died are unlinked by the next sender.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Final, TypeVar

import anyio

__all__ = ["Wakes", "announce", "wake_directory"]

#: With wake-ups, how often a waiter reads the status anyway; without, at most this far apart.
FALLBACK_S: Final = 0.05
_T = TypeVar("_T")


def wake_directory(database_url: str) -> str | None:
    """``<database>.wake/`` next to an SQLite file (a private one in the temporary directory
    when a socket's path would not fit), ``None`` for Postgres."""
    if not database_url.startswith("sqlite:///"):
        return None
    path = os.path.realpath(database_url.removeprefix("sqlite:///"))
    if len(path) <= 60:
        return path + ".wake"
    digest = hashlib.sha256(path.encode()).hexdigest()[:24]
    return os.path.join(tempfile.gettempdir(), f"codex-turn-wake-{os.getuid()}", digest)


def announce(directory: str | None, workflow_id: str) -> None:
    """Tell every process waiting on ``directory`` that ``workflow_id`` ended (never raises,
    never blocks)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as out:
        out.setblocking(False)
        for name in os.listdir(directory) if directory is not None else ():
            path = os.path.join(directory or "", name)
            try:
                out.sendto(workflow_id.encode(), path)
            except ConnectionRefusedError:
                os.unlink(path)  # nobody is bound there: a process that died
            except OSError:  # its buffer is full, or it just left: it reads the database
                pass


class Wakes:
    """This process's wake socket in ``directory`` (bound on first use) and its waiters."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self._usable = directory is not None
        self._lock = threading.Lock()
        self._waiters: dict[str, set[Callable[[], object]]] = {}
        self._socket: socket.socket | None = None

    def _bound(self) -> bool:
        with self._lock:
            if self._socket is None and self._usable and self.directory is not None:
                name = f"{os.getpid()}-{secrets.token_hex(6)}"
                try:
                    os.makedirs(self.directory, mode=0o700, exist_ok=True)
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    sock.bind(os.path.join(self.directory, name))
                except OSError:
                    self._usable = False  # cannot bind here: poll
                else:
                    self._socket = sock
                    threading.Thread(target=self._read, args=(sock,), daemon=True).start()
            return self._socket is not None

    def _read(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := sock.recv(4096):  # empty: close() stops this thread
                with self._lock:
                    wake = list(self._waiters.get(data.decode(errors="replace"), ()))
                for callback in wake:
                    with contextlib.suppress(RuntimeError):  # its loop is closed
                        callback()

    @contextlib.contextmanager
    def _waiting(self, workflow_id: str, callback: Callable[[], object]) -> Iterator[bool]:
        """Registered before the first read: no announcement after it is missed."""
        bound = self._bound()
        with self._lock:
            self._waiters.setdefault(workflow_id, set()).add(callback)
        try:
            yield bound
        finally:
            with self._lock:
                waiters = self._waiters[workflow_id]
                waiters.discard(callback)
                if not waiters:
                    del self._waiters[workflow_id]

    async def until(
        self,
        workflow_id: str,
        read: Callable[[], _T],
        ended: Callable[[_T], bool],
        poll: float,
        between: Callable[[], object] | None = None,
    ) -> _T:
        """``read()`` until ``ended`` says so, sleeping between reads until woken (or the
        pace above); ``between()`` runs in a thread between reads."""
        loop, woken = asyncio.get_running_loop(), asyncio.Event()
        with self._waiting(
            workflow_id, functools.partial(loop.call_soon_threadsafe, woken.set)
        ) as bound:
            started = time.monotonic()
            while not ended(value := await anyio.to_thread.run_sync(read)):
                if between is not None:
                    await anyio.to_thread.run_sync(between)
                with anyio.move_on_after(_pace(bound, time.monotonic() - started, poll)):
                    await woken.wait()
                woken.clear()
        return value

    def until_sync(
        self,
        workflow_id: str,
        read: Callable[[], _T],
        ended: Callable[[_T], bool],
        poll: float,
        timeout: float | None,
    ) -> _T:
        """:meth:`until` for threads; ``TimeoutError`` after ``timeout`` s."""
        woken = threading.Event()
        with self._waiting(workflow_id, woken.set) as bound:
            started = time.monotonic()
            while not ended(value := read()):
                waited = time.monotonic() - started
                if timeout is not None and waited >= timeout:
                    raise TimeoutError(workflow_id)
                pause = _pace(bound, waited, poll)
                woken.wait(pause if timeout is None else min(pause, timeout - waited))
                woken.clear()
        return value

    def announcer(self, workflow_id: str) -> None:
        """Announce the end of ``workflow_id`` when the running task ends: DBOS runs a
        dequeued async workflow and writes its outcome in that task."""
        task, directory = asyncio.current_task(), self.directory
        if task is not None and directory is not None:
            task.add_done_callback(lambda _task: announce(directory, workflow_id))

    def close(self) -> None:
        with self._lock:
            self._usable = False
            sock, self._socket = self._socket, None
        if sock is not None:
            path = sock.getsockname()
            with (
                contextlib.suppress(OSError),
                socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s,
            ):
                s.sendto(b"", path)  # the reader's stop
            with contextlib.suppress(OSError):
                os.unlink(path)
            sock.close()


def _pace(bound: bool, waited: float, poll: float) -> float:
    return FALLBACK_S if bound else max(poll, min(FALLBACK_S, waited / 20))
