"""Running queued turns: :class:`TurnWorker`, one per process.

A worker is this process's DBOS executor: launched on the running event loop (the turns run
there, next to the app-server they use), it dequeues turns from the partitioned queue,
recovers the turns its executor id left pending when it last died, and drains on exit:
no new turn is taken, the turns in flight finish (bounded by ``drain_timeout``; a turn still
running then stays pending and is recovered by a live peer's watchdog once this worker is gone).

DBOS keeps one instance per process, so one :class:`TurnWorker` runs at a time in a process.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from types import TracebackType

import anyio
from dbos import DBOS, DBOSConfig

from codex_turn._log import format_error, get_logger
from codex_turn.harness.appserver import AppServerPort
from codex_turn.harness.engine import resolve_engine
from codex_turn.harness.turn_api import TurnParams
from codex_turn.scale._queue import DEFAULT_POLL_S
from codex_turn.scale._watchdog import (
    DEFAULT_WATCHDOG_INTERVAL_S,
    ExecutorLocks,
    Watchdog,
    executor_locks_for,
)
from codex_turn.scale._workflow import (
    APP_NAME,
    APP_VERSION,
    QUEUE_NAME,
    WorkerRuntime,
    install_runtime,
)

__all__ = ["TurnWorker"]

_log = get_logger(__name__)


class TurnWorker:
    """Run the turns queued in ``database_url`` on ``app_server``, while the context lasts.

    ``engine`` is the engine of every turn (an engine object, a spec, or ``None``), or a
    callable giving a turn's engine from its params (e.g. a store next to each session).
    ``executor_id`` names this worker in the database (one live worker per id: a second one
    waits ``hold_timeout`` s, then ``ExecutorIdInUse``): a worker restarted under the same id
    recovers the turns its predecessor left pending, and so does a live peer's watchdog
    (every ``watchdog_interval`` s, ``None`` for no watchdog) once the worker is dead.
    """

    def __init__(
        self,
        database_url: str,
        *,
        app_server: AppServerPort,
        engine: object | Callable[[TurnParams], object | None] | None = None,
        executor_id: str = "local",
        drain_timeout: float = 60.0,
        poll: float = DEFAULT_POLL_S,
        watchdog_interval: float | None = DEFAULT_WATCHDOG_INTERVAL_S,
        hold_timeout: float = 10.0,
    ) -> None:
        self.database_url = database_url
        self.executor_id = executor_id
        self.drain_timeout = drain_timeout
        self._poll = poll
        self._watchdog_interval = watchdog_interval
        self._hold_timeout = hold_timeout
        self._locks: ExecutorLocks | None = None
        self.watchdog: Watchdog | None = None
        engine_for: Callable[[TurnParams], object | None]
        if callable(engine) and not hasattr(engine, "info"):
            engine_for = engine
        else:
            resolved = resolve_engine(engine)
            engine_for = functools.partial(_same, resolved)
        self.runtime = WorkerRuntime(
            app_server=app_server, engine_for=engine_for, executor_id=executor_id
        )
        self._dbos: DBOS | None = None
        #: Set once this worker's executor lock is released (never while a turn runs here).
        self.lock_released = threading.Event()
        #: Set when the executor lock was lost while the worker ran (the database connection
        #: that held it dropped): the worker stopped taking turns and must be shut down.
        self.lock_lost = threading.Event()

    @property
    def in_flight(self) -> int:
        return self.runtime.in_flight

    async def __aenter__(self) -> TurnWorker:
        config: DBOSConfig = {
            "name": APP_NAME,
            "system_database_url": self.database_url,
            "executor_id": self.executor_id,
            "application_version": APP_VERSION,
            "log_level": "WARNING",
        }
        locks = executor_locks_for(self.database_url)
        # Before DBOS starts (and recovers this id's turns): one live worker per executor id.
        await anyio.to_thread.run_sync(
            functools.partial(locks.hold, self.executor_id, self._hold_timeout)
        )
        self._locks = locks
        try:
            install_runtime(self.runtime)
            self._dbos = DBOS(config=config)
            # On this thread, in the running loop: DBOS runs the async workflows on this loop.
            DBOS.launch()
            await DBOS.register_queue_async(
                QUEUE_NAME,
                partition_concurrency=1,
                polling_interval_sec=self._poll,
                on_conflict="always_update",
            )
            if self._watchdog_interval is not None:
                self.watchdog = Watchdog(
                    locks,
                    self.executor_id,
                    interval=self._watchdog_interval,
                    on_lock_lost=self._on_lock_lost,
                ).start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.shutdown()  # the lock goes too
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self.drain()

    async def drain(self, grace: float | None = None) -> bool:
        """Stop taking turns, wait for the ones in flight (``grace`` s, default
        ``drain_timeout``), shut DBOS down. True when nothing was left running."""
        self.stop_taking_turns()
        await self.wait_idle(self.drain_timeout if grace is None else grace)
        return await self.shutdown()

    def _on_lock_lost(self, error: BaseException) -> None:
        """The executor lock is gone (watchdog thread): a peer may now recover this worker's
        turns, so it takes no new one, loudly; the host shuts it down (``lock_lost``)."""
        _log.error(
            "executor lock lost: this worker takes no new turns and must shut down",
            executor=self.executor_id,
            in_flight=self.runtime.in_flight,
            error=format_error(error),
        )
        self.lock_lost.set()
        self.stop_taking_turns()

    def stop_taking_turns(self) -> None:
        """No new turn is dequeued from now on (the turns in flight go on)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self._dbos is not None:
            for event in self._dbos.background_thread_stop_events:  # the queue threads
                event.set()

    async def wait_idle(self, grace: float) -> bool:
        """Wait, at most ``grace`` s, until no turn runs here; True when none does."""
        with anyio.move_on_after(grace):
            while self._busy():  # noqa: ASYNC110 - counted by DBOS's tasks
                await anyio.sleep(0.01)
        return not self._busy()

    def _busy(self) -> bool:
        """A turn runs here, or a finished one's workflow outcome is not written yet (DBOS
        writes it after the step returned: its own shutdown drain waits on the same set)."""
        if self.runtime.in_flight:
            return True
        active = getattr(self._dbos, "_active_workflows_set", None)
        return active is not None and bool(active.activeList())

    async def shutdown(self) -> bool:
        """Shut DBOS down now; True when no turn was still running (one that was stays
        pending and is recovered by a live peer once this worker releases its lock)."""
        drained = not self._busy()
        dbos, self._dbos = self._dbos, None
        if dbos is not None:
            # In a thread: DBOS's shutdown blocks, and this loop must keep running meanwhile.
            await anyio.to_thread.run_sync(functools.partial(DBOS.destroy))
            install_runtime(None)
        if self.watchdog is not None:
            await anyio.to_thread.run_sync(self.watchdog.stop)
        locks, self._locks = self._locks, None
        if locks is not None:
            if self.runtime.in_flight:
                # DBOS's shutdown does not cancel a turn: it goes on in this live process.
                # Released now, a peer would recover it and run it again: the lock is kept
                # until the turn ends here (or this process dies, which releases it too).
                _log.warning(
                    "turns still running at shutdown: executor lock kept until they end",
                    executor=self.executor_id,
                    in_flight=self.runtime.in_flight,
                )
                self.lock_released.clear()
                threading.Thread(
                    target=self._release_when_idle,
                    args=(locks,),
                    name="codex-turn-lock-keeper",
                    daemon=True,
                ).start()
            else:
                await anyio.to_thread.run_sync(locks.release)
                self.lock_released.set()
        return drained

    def _release_when_idle(self, locks: ExecutorLocks) -> None:
        while self.runtime.in_flight:
            time.sleep(0.02)
        locks.release()
        self.lock_released.set()
        _log.info("executor lock released after the last turn ended", executor=self.executor_id)


def _same(engine: object | None, _params: TurnParams) -> object | None:
    return engine
