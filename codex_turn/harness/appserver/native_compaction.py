"""Native compaction of one thread: ``thread/compact/start`` run to its end.

:class:`Compactions` is a part of :class:`~.client.AppServerClient` (which hands its method
on), built on the :class:`~.connection.Connection`. :meth:`Compactions.compact_thread` runs
``thread/compact/start`` (a turn of its own in Codex) to its end, serialised per thread
(:class:`KeyedLocks`, which :class:`~.manager.AppServer` uses too); :class:`_CompactionWatch`
folds the thread's
notifications into the compaction's state and its :class:`CompactionResult`. Past its deadline
it interrupts the compaction turn and, when the interrupt is not acknowledged within a grace
period, :meth:`~.connection.Connection.retire` s the connection before returning (after asking
whether the process is alive at all: a silent one is killed at once rather than shut down
gracefully, see "Liveness" in :mod:`.connection`). Nothing is ever retried.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Mapping

import anyio
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream

from codex_turn._log import get_logger

from .connection import Connection
from .defaults import INTERRUPT_GRACE_S, NATIVE_COMPACTION_TIMEOUT_S
from .errors import AppServerClosed, AppServerRpcError, AppServerTimeout
from .logsafe import capped
from .projector import Notification
from .types import ThreadCompactStartParams, TurnInterruptParams, unstructure

__all__ = ["CompactionResult", "Compactions", "KeyedLocks"]

log = get_logger(__name__)


@attrs.frozen(kw_only=True)
class CompactionResult:
    """Outcome of :meth:`AppServerClient.compact_thread`.

    ``status``: ``"completed"`` (the compaction signal came and the compaction turn completed),
    ``"failed"`` (the turn ended without the signal, or not ``completed``; ``error`` says
    how) or ``"timed_out"`` (the deadline passed; the turn was then interrupted, and
    ``retired`` says whether the connection had to be retired). ``signal`` is the
    notification that proved the compaction (``"item/completed"`` or ``"thread/compacted"``);
    it can be set on a timed-out run whose turn did not end in time.
    """

    status: str
    thread_id: str | None = None
    turn_id: str | None = None
    item_id: str | None = None
    signal: str | None = None
    duration_ms: int = 0
    interrupted: bool = False
    retired: bool = False
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.status == "completed"

    @property
    def compacted(self) -> bool:
        """Whether Codex reported the compaction itself (whatever happened to its turn)."""
        return self.signal is not None


class Compactions:
    """``thread/compact/start`` to its end (see the module header)."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._locks = KeyedLocks()  # compactions of one thread run one at a time

    async def compact_thread(
        self,
        thread_id: str,
        *,
        timeout: float = NATIVE_COMPACTION_TIMEOUT_S,  # noqa: ASYNC109
        interrupt_grace: float = INTERRUPT_GRACE_S,
    ) -> CompactionResult:
        """Native compaction of one thread: ``thread/compact/start``, then wait for its end.

        Codex runs a manual compaction as a turn of its own. The waiter (a subscription to the
        thread) exists *before* the request is sent, so no notification can be missed.
        Completion is the ``contextCompaction`` ``item/completed`` (0.163) or the legacy
        ``thread/compacted``, followed by the compaction turn's ``turn/completed`` (a legacy
        ``thread/compacted`` with no compaction turn in sight completes on its own).

        ``timeout`` bounds the whole run. When it passes, the compaction turn is interrupted
        (the ``turn/interrupt`` is always sent) and the turn's ``turn/completed`` is awaited
        for ``interrupt_grace`` seconds; when that acknowledgement does not come (or the turn
        never started, so there is nothing to interrupt), this connection is *retired*
        (:meth:`~.connection.Connection.retire`) before the method returns, and therefore
        before the per-thread compaction lock is released. Compactions of one thread are
        serialised by that lock. Nothing is ever retried: a failed compaction is reported,
        never re-sent as a prompt.

        Raises :class:`AppServerRpcError` when Codex refuses the request and
        :class:`AppServerClosed` when the process dies meanwhile.
        """
        async with self._locks.hold(thread_id):
            return await self._compact_locked(thread_id, timeout, interrupt_grace)

    async def _compact_locked(
        self, thread_id: str, seconds: float, interrupt_grace: float
    ) -> CompactionResult:
        connection = self._connection
        started = time.perf_counter()
        watch = _CompactionWatch(thread_id)
        with connection.subscribe(thread_id) as stream:
            with anyio.move_on_after(seconds):
                try:
                    await connection.request(
                        "thread/compact/start",
                        unstructure(ThreadCompactStartParams(thread_id=thread_id)),
                        timeout=seconds,
                    )
                except AppServerTimeout:
                    pass  # handled below as a compaction timeout
                else:
                    log.info("appserver.compaction_started", thread_id=capped(thread_id))
                    async for n in _until_closed(connection, stream):
                        if watch.feed(n):
                            return watch.result(started)
            # The deadline passed: interrupt, wait for the acknowledgement, else retire.
            log.warning(
                "appserver.compaction_timeout",
                thread_id=capped(thread_id),
                turn_id=capped(watch.turn_id),
                compacted=watch.signal is not None,
            )
            acknowledged = await self._interrupt_compaction(watch, stream, interrupt_grace)
            retired = False
            if not acknowledged and not connection.closed:
                # A silent process is killed at once (declared dead); a live one is retired.
                await connection.deadline_missed("turn/interrupt")
                if not connection.closed:
                    await connection.retire("compaction interrupt not acknowledged")
                retired = True
            return watch.result(
                started,
                timed_out=True,
                retired=retired,
                error=f"timed out waiting for codex app-server compaction for {thread_id}",
            )

    async def _interrupt_compaction(
        self,
        watch: _CompactionWatch,
        stream: MemoryObjectReceiveStream[Notification],
        grace: float,
    ) -> bool:
        """Interrupt the compaction turn; True when its ``turn/completed`` came in time."""
        connection = self._connection
        if connection.closed:
            return False
        # Notifications already buffered may name the turn, or even end it.
        while watch.turn_id is None and not watch.done:
            try:
                n = stream.receive_nowait()
            except anyio.WouldBlock:
                break
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return False
            watch.feed(n)
        if watch.done:
            return True
        if watch.turn_id is None:
            return False  # nothing to interrupt: the turn never started
        watch.interrupted = True
        msg_id: int | None = None
        try:
            # Sending is not bounded by the grace (a zero grace still interrupts); a pipe
            # that does not take one line within the grace plus a second is itself a reason
            # to retire.
            with anyio.move_on_after(grace + 1.0):
                msg_id, pending = await connection.start_request(
                    "turn/interrupt",
                    unstructure(
                        TurnInterruptParams(thread_id=watch.thread_id, turn_id=watch.turn_id)
                    ),
                )
            if msg_id is None:
                return False
            with anyio.move_on_after(grace):
                await pending.event.wait()
                if isinstance(pending.error, AppServerRpcError):
                    # "no active turn": it ended meanwhile; its turn/completed is coming.
                    log.info("appserver.interrupt_refused", code=pending.error.code)
                async for n in _until_closed(connection, stream):
                    if watch.feed(n):
                        return True
            return False
        except AppServerClosed:
            return False
        finally:
            if msg_id is not None:
                connection.forget_request(msg_id)


class KeyedLocks:
    """One :class:`anyio.Lock` per key, dropped again when nobody holds or awaits it."""

    def __init__(self) -> None:
        self._locks: dict[str, anyio.Lock] = {}
        self._users: dict[str, int] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(key, anyio.Lock())
        self._users[key] = self._users.get(key, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._users[key] -= 1
            if not self._users[key]:
                del self._users[key]
                del self._locks[key]

    def __len__(self) -> int:
        return len(self._locks)


class _CompactionWatch:
    """Folds one thread's notifications into the state of a manual compaction."""

    def __init__(self, thread_id: str) -> None:
        self.thread_id = thread_id
        self.turn_id: str | None = None
        self.turn_started = False
        self.signal: str | None = None
        self.item_id: str | None = None
        self.turn_status: str | None = None
        self.turn_error: str | None = None
        self.interrupted = False
        self.done = False

    def feed(self, n: Notification) -> bool:
        """Take one notification; True once the compaction is over."""
        if n.method == "turn/started" and not self.turn_started:
            self.turn_started = True
            self.turn_id = self.turn_id or n.turn_id
        elif n.compaction_phase == "completed" and self.signal is None:
            self.signal = n.method
            if n.method == "item/completed":
                item = n.item or {}
                item_id = item.get("id")
                self.item_id = item_id if isinstance(item_id, str) else None
            self.turn_id = self.turn_id or n.turn_id
            if n.method == "thread/compacted" and not self.turn_started:
                self.done = True  # a legacy server: the signal is the whole story
        elif n.method == "turn/completed" and (self.turn_id is None or n.turn_id == self.turn_id):
            turn = n.params.get("turn")
            turn = turn if isinstance(turn, Mapping) else {}
            self.turn_id = self.turn_id or n.turn_id
            status = turn.get("status")
            self.turn_status = status if isinstance(status, str) else None
            error = turn.get("error")
            if isinstance(error, Mapping) and isinstance(error.get("message"), str):
                self.turn_error = str(error["message"])
            self.done = True
        return self.done

    def result(
        self,
        started: float,
        *,
        timed_out: bool = False,
        retired: bool = False,
        error: str | None = None,
    ) -> CompactionResult:
        if timed_out:
            status = "timed_out"
        elif self.signal is not None and self.turn_status in (None, "completed"):
            status = "completed"
        else:
            status = "failed"
            error = self.turn_error or (
                f"codex app-server compaction turn ended with status {self.turn_status}"
                f" without a compaction item"
                if self.signal is None
                else f"codex app-server compaction turn ended with status {self.turn_status}"
            )
        return CompactionResult(
            status=status,
            thread_id=self.thread_id,
            turn_id=self.turn_id,
            item_id=self.item_id,
            signal=self.signal,
            duration_ms=_ms_since(started),
            interrupted=self.interrupted,
            retired=retired,
            error=error,
        )


def _ms_since(started: float) -> int:
    return int((time.perf_counter() - started) * 1000)


async def _until_closed(
    connection: Connection, stream: MemoryObjectReceiveStream[Notification]
) -> AsyncIterator[Notification]:
    """Iterate a subscription; a closed connection raises its :class:`AppServerClosed`."""
    while True:
        try:
            yield await stream.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise connection.closed_error or AppServerClosed() from None
