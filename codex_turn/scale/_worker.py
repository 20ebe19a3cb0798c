"""Running queued turns: :class:`TurnWorker`, one per process.

A worker is this process's DBOS executor: launched on the running event loop (the turns run
there, next to the app-server they use), it dequeues the turns of its own queue
(:func:`~codex_turn.scale._routing.worker_queue`: the sessions whose thread it holds, see
:mod:`codex_turn.scale._routing`), recovers the turns its executor id left pending when it
last died, and takes over a dead peer's turns and the inbox's (its watchdog). It drains on
exit: no new turn is taken or routed here, the queued turns of sessions with nothing running
here move to live workers at once, the turns in flight finish (bounded by ``drain_timeout``)
and then their sessions' queued turns move too. A turn still running at the end stays pending
and is taken over by a live peer's watchdog once this worker is gone.

DBOS keeps one instance per process, so one :class:`TurnWorker` runs at a time in a process.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Final

import anyio
from dbos import DBOS, DBOSClient, DBOSConfig

from codex_turn._log import format_error, get_logger
from codex_turn.harness.appserver import AppServerPort
from codex_turn.harness.engine import resolve_engine
from codex_turn.harness.turn_api import TurnParams
from codex_turn.scale._locks import ExecutorLocks, executor_locks_for
from codex_turn.scale._queue import DEFAULT_POLL_S, register_queue, use_wal
from codex_turn.scale._routing import INBOX_LOCK, Router, evacuate, statuses_of, worker_queue
from codex_turn.scale._wake import wake_directory
from codex_turn.scale._watchdog import (
    DEFAULT_WATCHDOG_INTERVAL_S,
    DbosMoves,
    Watchdog,
)
from codex_turn.scale._workflow import APP_NAME, APP_VERSION, WorkerRuntime, install_runtime

__all__ = ["TurnWorker", "dequeuers_of"]

_log = get_logger(__name__)

#: While draining, how often the queued turns of idle sessions are moved away (seconds).
_DRAIN_MOVE_S: Final = 0.05


def dequeuers_of(queue: str) -> list[threading.Thread]:
    """The live threads of this process that dequeue ``queue``.

    DBOS 3.x runs one thread per listened queue, named ``queue-worker-<queue>``; a draining
    worker moves its queued turns away while turns still run here only once that thread has
    exited (else it could dequeue a turn being moved), and only if it saw that thread run
    (a DBOS that names it otherwise: the queued turns move after DBOS's shutdown instead,
    which joins its threads). ``tests/test_scale_routing.py`` pins the name."""
    name = f"queue-worker-{queue}"
    return [thread for thread in threading.enumerate() if thread.name == name]


class TurnWorker:
    """Run the turns queued in ``database_url`` on ``app_server``, while the context lasts.

    ``engine`` is the engine of every turn (an engine object, a spec, or ``None``), or a
    callable giving a turn's engine from its params (e.g. a store next to each session).
    ``executor_id`` names this worker in the database (one live worker per id: a second one
    waits ``hold_timeout`` s, then ``ExecutorIdInUse``): a worker restarted under the same id
    recovers the turns its predecessor left pending, and so does a live peer's watchdog
    (every ``watchdog_interval`` s, ``None`` for no watchdog) once the worker is dead.
    ``poll``: how often the worker's queue is read for new turns (seconds; each read costs
    DBOS about 2 ms of CPU).
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
        if executor_id == INBOX_LOCK:
            raise ValueError(f"{INBOX_LOCK!r} is reserved: give the worker another executor id")
        self.database_url = database_url
        self.executor_id = executor_id
        self.queue = worker_queue(executor_id)
        self.drain_timeout = drain_timeout
        self._poll = poll
        self._watchdog_interval = watchdog_interval
        self._hold_timeout = hold_timeout
        self._locks: ExecutorLocks | None = None
        self._client: DBOSClient | None = None
        self._router: Router | None = None
        self._draining = False
        self._said_draining = False
        #: This worker saw its queue's dequeuing thread by name (:func:`dequeuers_of`).
        self._dequeuer_seen = False
        self.watchdog: Watchdog | None = None
        engine_for: Callable[[TurnParams], object | None]
        if callable(engine) and not hasattr(engine, "info"):
            engine_for = engine
        else:
            resolved = resolve_engine(engine)
            engine_for = functools.partial(_same, resolved)
        self.runtime = WorkerRuntime(
            app_server=app_server,
            engine_for=engine_for,
            executor_id=executor_id,
            wake_directory=wake_directory(database_url),
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

    @property
    def router(self) -> Router:
        if self._router is None:
            raise RuntimeError("the worker is not running")
        return self._router

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
            await anyio.to_thread.run_sync(self._prepare, locks)
            install_runtime(self.runtime)
            self._dbos = DBOS(config=config)
            DBOS.listen_queues([self.queue])  # this worker's queue, and no other
            # On this thread, in the running loop: DBOS runs the async workflows on this loop.
            DBOS.launch()
            self._dequeuer_seen = await anyio.to_thread.run_sync(self._see_dequeuer)
            watchdog = Watchdog(
                self.router,
                DbosMoves(self._dbos_client()),
                self.executor_id,
                interval=self._watchdog_interval or DEFAULT_WATCHDOG_INTERVAL_S,
                on_lock_lost=self._on_lock_lost,
            )
            # Once now (the inbox's turns, dead peers' turns), then every interval.
            try:
                await anyio.to_thread.run_sync(watchdog.sweep)
            except Exception as error:  # the watchdog looks again in a moment
                _log.warning("first sweep failed", error=format_error(error))
            if self._watchdog_interval is not None:
                self.watchdog = watchdog.start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.shutdown()  # the lock goes too
            raise
        return self

    def _prepare(self, locks: ExecutorLocks) -> None:
        """The database, this worker's queue (registered before DBOS starts, so its queue
        thread reads it from the first poll on) and its row: serving."""
        DBOS.migrate(self.database_url)
        use_wal(self.database_url)
        client = DBOSClient(system_database_url=self.database_url, application_name=APP_NAME)
        self._client = client
        register_queue(client)
        register_queue(client, name=self.queue, poll=self._poll)
        router = Router(
            self.database_url, statuses=functools.partial(statuses_of, client), locks=locks
        )
        self._router = router
        router.set_worker(self.executor_id, "serving")
        self.runtime.note_run = router.note_run

    def _see_dequeuer(self) -> bool:
        deadline = time.monotonic() + 2.0
        while not dequeuers_of(self.queue):
            if time.monotonic() > deadline:
                _log.warning(
                    "no DBOS thread named for this worker's queue: a drain moves its queued "
                    "turns only after DBOS's shutdown",
                    queue=self.queue,
                )
                return False
            time.sleep(0.005)
        return True

    def _dbos_client(self) -> DBOSClient:
        if self._client is None:
            raise RuntimeError("the worker is not running")
        return self._client

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
        """The executor lock is gone (watchdog thread): a peer may now take over this worker's
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
        """No new turn is dequeued from now on (the turns in flight go on); the queued ones
        move away while :meth:`wait_idle` waits."""
        self._draining = True
        if self.watchdog is not None:
            self.watchdog.stop()
        if self._dbos is not None:
            for event in self._dbos.background_thread_stop_events:  # the queue threads
                event.set()

    async def wait_idle(self, grace: float) -> bool:
        """Wait, at most ``grace`` s, until no turn runs here; True when none does. While
        draining, the queued turns of sessions with nothing running here move to live
        workers (those of the others once their turn ended)."""
        next_move = 0.0
        with anyio.move_on_after(grace):
            while self._busy() or (self._draining and next_move == 0.0):
                if self._draining and time.monotonic() >= next_move:
                    await anyio.to_thread.run_sync(self._move_queued, True)
                    next_move = time.monotonic() + _DRAIN_MOVE_S
                await anyio.sleep(0.01)
        return not self._busy()

    def _move_queued(self, keep_running: bool) -> int:
        """Move this worker's queued turns away (draining): announce the drain first, so no
        submit routes a session here from now on; only once this worker's queue thread has
        stopped; never once its lock is lost (a peer may be moving them); with
        ``keep_running``, not the sessions of the turns running here."""
        router, client = self._router, self._client
        if router is None or client is None or self.lock_lost.is_set():
            return 0
        if self._dbos is not None and not self._dequeuer_seen:
            return 0  # cannot tell when its queue thread stopped: after DBOS's shutdown
        try:
            if not self._said_draining:
                router.set_worker(self.executor_id, "draining")
                self._said_draining = True
            deadline = time.monotonic() + 1.0
            while dequeuers_of(self.queue):  # stopping: it ends within its current poll
                if time.monotonic() > deadline:
                    return 0  # next time
                time.sleep(0.005)
            router.locks.verify(self.executor_id)
            return evacuate(
                router,
                DbosMoves(client),
                self.queue,
                busy_lanes=_running_lanes if keep_running else None,
            )
        except Exception as error:
            _log.warning("could not move the queued turns", error=format_error(error))
            return 0

    def _busy(self) -> bool:
        """A turn runs here, or a finished one's workflow outcome is not written yet (DBOS
        writes it after the workflow returned: its own shutdown drain waits on the same set)."""
        if self.runtime.in_flight:
            return True
        active = getattr(self._dbos, "_active_workflows_set", None)
        return active is not None and bool(active.activeList())

    async def shutdown(self) -> bool:
        """Shut DBOS down now; True when no turn was still running (one that was stays
        pending and is taken over by a live peer once this worker releases its lock)."""
        drained = not self._busy()
        dbos, self._dbos = self._dbos, None
        if dbos is not None:
            self.stop_taking_turns()
            # In a thread: DBOS's shutdown blocks, and this loop must keep running meanwhile.
            # It joins its queue threads: nothing dequeues this worker's queue after it.
            await anyio.to_thread.run_sync(functools.partial(DBOS.destroy))
            install_runtime(None)
            if drained:  # every queued turn can go now, none runs here
                await anyio.to_thread.run_sync(self._move_queued, False)
        if self.watchdog is not None:
            await anyio.to_thread.run_sync(self.watchdog.stop)
        router, client, self._router, self._client = self._router, self._client, None, None
        if router is not None:
            await anyio.to_thread.run_sync(router.close)
        if client is not None:
            await anyio.to_thread.run_sync(client.destroy)
        locks, self._locks = self._locks, None
        if locks is not None:
            if self.runtime.in_flight:
                # DBOS's shutdown does not cancel a turn: it goes on in this live process.
                # Released now, a peer would take it over and run it again: the lock is kept
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


def _running_lanes(turns: Sequence[Any]) -> set[str]:
    """Sessions with a turn running on this (draining) worker: they stay until it ends."""
    return {t.queue_partition_key for t in turns if t.status == "PENDING" and t.queue_partition_key}


def _same(engine: object | None, _params: TurnParams) -> object | None:
    return engine
