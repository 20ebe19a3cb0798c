"""The executor watchdog: a live worker takes over the turns a dead peer left behind.

Open-source DBOS recovers an executor's pending workflows only when an executor with the same
id starts again. Here every worker holds a lock named by its executor id for as long as it
lives (:mod:`codex_turn.scale._locks`). Each worker's watchdog looks, every ``interval``
seconds, at the registered workers (:mod:`codex_turn.scale._routing`): a worker whose lock it
can take is dead, and while holding that lock the watchdog moves every turn on the dead
worker's queue, the one it was running included, to the worker each session goes to now
(:func:`~codex_turn.scale._routing.evacuate`), then forgets the worker once nothing can reach
its queue. The new worker runs the interrupted turn again, idempotent by the turn id (see
:mod:`codex_turn.scale._workflow`); it does not hold the session's thread, so the harness
starts a fresh one with the engine's context re-projected (``locality`` ``"moved"``).

The watchdog also moves the turns of the inbox (submitted while no worker was alive) to a
worker, holding the inbox's lock, and notices the loss of its own worker's lock.

A move is one transaction of the routing's
(:meth:`~codex_turn.scale._routing.Router.move_lane`): all of a session's turns and its route
together, writing what DBOS's public ``resume_workflows(queue_name=...)`` writes. Its guard is
the lock: a dead executor's turns change only under its lock, so no executor predicate is
needed (DBOS's internal ``_recover_pending_workflows`` has one, but it can only put a turn
back on its own queue, which nobody dequeues once its worker is dead).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from dbos import DBOSClient

from codex_turn._log import format_error, get_logger
from codex_turn.scale._locks import (
    ExecutorIdInUse,
    ExecutorLockLost,
    ExecutorLocks,
    executor_locks_for,
)
from codex_turn.scale._routing import (
    INBOX,
    INBOX_LOCK,
    MOVABLE_STATUSES,
    Router,
    evacuate,
    statuses_of,
    worker_queue,
)

__all__ = [
    "DEFAULT_WATCHDOG_INTERVAL_S",
    "DbosMoves",
    "ExecutorIdInUse",
    "ExecutorLockLost",
    "ExecutorLocks",
    "Watchdog",
    "executor_locks_for",
]

_log = get_logger(__name__)

#: How often a watchdog looks for dead executors (seconds).
DEFAULT_WATCHDOG_INTERVAL_S: Final = 0.2


class DbosMoves:
    """:class:`~codex_turn.scale._routing.TurnMoves` through a DBOS client."""

    def __init__(self, client: DBOSClient) -> None:
        self.client = client

    def unfinished(self, queue: str) -> Sequence[Any]:
        return self.client.list_workflows(
            queue_name=queue,
            status=list(MOVABLE_STATUSES),
            load_input=False,
            load_output=False,
        )

    def cancel(self, turn_id: str) -> None:
        self.client.cancel_workflow(turn_id)

    def statuses(self, turn_ids: Sequence[str]) -> dict[str, str]:
        return statuses_of(self.client, turn_ids)


class Watchdog:
    """A thread that takes over the turns of dead workers and of the inbox."""

    def __init__(
        self,
        router: Router,
        moves: DbosMoves,
        executor_id: str,
        *,
        interval: float = DEFAULT_WATCHDOG_INTERVAL_S,
        on_lock_lost: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.router = router
        self.locks = router.locks
        self.moves = moves
        #: Called once (from the watchdog's thread) when this worker's own lock is found lost.
        self.on_lock_lost = on_lock_lost
        self.lock_lost: BaseException | None = None
        self.executor_id = executor_id
        self.interval = interval
        #: ``(executor id, turns moved, monotonic time)`` of every recovery made here.
        self.recoveries: list[tuple[str, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="codex-turn-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not self.check_own_lock():
                return  # lost: taking over others' turns is no longer this worker's business
            try:
                self.sweep()
            except Exception as error:  # a database hiccup: look again next time
                _log.warning("executor watchdog sweep failed", error=format_error(error))

    def check_own_lock(self) -> bool:
        """Verify this worker still holds its executor lock; on loss, report it once
        (``on_lock_lost``) and say False."""
        try:
            self.locks.verify(self.executor_id)
        except Exception as error:
            if self.lock_lost is None:
                self.lock_lost = error
                _log.error(
                    "executor lock lost", executor=self.executor_id, error=format_error(error)
                )
                if self.on_lock_lost is not None:
                    self.on_lock_lost(error)
            return False
        return True

    def sweep(self) -> int:
        """One look: take over the turns of every dead worker, then the inbox's; how many
        turns were moved."""
        moved = 0
        for owner in sorted(self.router.workers()):
            if owner == self.executor_id or self._stop.is_set():
                continue
            with self.locks.claim(owner) as dead:
                if not dead:
                    continue
                count = evacuate(self.router, self.moves, worker_queue(owner))
                closed = self.router.close_worker(owner, self.moves)
                moved += count
                if count:
                    self.recoveries.append((owner, count, time.monotonic()))
                    _log.warning(
                        "took over the turns of a dead worker",
                        executor=owner,
                        turns=count,
                        by=self.executor_id,
                        forgotten=closed,
                    )
        if self._stop.is_set() or not self.moves.client.list_workflows(
            queue_name=INBOX, status="ENQUEUED", limit=1, load_input=False, load_output=False
        ):
            return moved
        with self.locks.claim(INBOX_LOCK) as mine:
            if mine:
                moved += evacuate(self.router, self.moves, INBOX, busy_lanes=_running)
        return moved


def _running(turns: Sequence[Any]) -> set[str]:
    """Lanes with a turn running from the inbox: only a worker of an earlier version, which
    dequeued this queue, can have one; its session stays until that turn ends."""
    return {t.queue_partition_key for t in turns if t.status == "PENDING" and t.queue_partition_key}
