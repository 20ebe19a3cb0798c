"""Running queued turns: :class:`TurnWorker`, one per process (DBOS keeps one per process).

A worker is this process's DBOS executor, launched on the running event loop (the turns run
there, next to the app-server they use). It dequeues the queue of every turn and its own
queue of forwarded turns (:mod:`codex_turn.scale._workflow`), and holds its liveness locks
(:mod:`codex_turn.scale._locks`) while it lives.

Recovery is DBOS's: a worker restarted under the same executor id recovers the turns its
predecessor left pending. For a worker that does not come back, every live worker *sweeps*
(:func:`take_over`, every ``watchdog_interval`` s): a turn running under an executor whose
alive lock it can take is put back on the queue with DBOS's public ``resume_workflow``, under
that lock (so nothing else, a restart of that worker included, touches it meanwhile); the
queue's partition then runs it first among its session's turns, on any worker. A turn whose
worker died under it :data:`MAX_TAKEOVERS` times is cancelled instead: it is likely what kills
them (its count is an attribute of the workflow).

A drain (SIGTERM) is DBOS's ``destroy(workflow_completion_timeout_sec=...)``: no turn is
dequeued from then on, the turns in flight finish; the serving lock goes first, so no turn is
forwarded here any more. A turn still running at the end keeps the alive lock until it ends.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Final

import anyio
from dbos import DBOS, DBOSClient, DBOSConfig, DBOSPortableJSONSerializer

from codex_turn._log import format_error, get_logger
from codex_turn.harness.appserver import AppServerPort
from codex_turn.harness.engine import resolve_engine
from codex_turn.harness.turn_api import TurnParams
from codex_turn.scale._locks import Liveness, liveness_for
from codex_turn.scale._queue import (
    APP_NAME,
    APP_VERSION,
    DEFAULT_POLL_S,
    QUEUE,
    check_database_url,
    check_executor_id,
    dbos_client,
    prepare_database,
    worker_queue,
)
from codex_turn.scale._wake import Wakes, wake_directory
from codex_turn.scale._workflow import Homes, WorkerRuntime, install_runtime

__all__ = ["TurnWorker", "take_over"]

_log = get_logger(__name__)

#: How often a worker sweeps for the turns of dead workers (seconds).
DEFAULT_SWEEP_S: Final = 0.2
MAX_TAKEOVERS: Final = 5
#: The previous worker's DBOS shutdown in this process (the next waits for it).
_stopping: list[threading.Thread] = []


def take_over(client: DBOSClient, liveness: Liveness, me: str) -> int:
    """Put the turns that dead workers were running back on the queue; how many."""
    running = client.list_workflows(
        queue_name=QUEUE, status="PENDING", load_input=False, load_output=False
    )
    moved = 0
    for owner in sorted({t.executor_id for t in running if t.executor_id not in (None, me)}):
        with liveness.claim(str(owner)) as dead:
            if not dead:
                continue
            before = moved
            for turn in client.list_workflows(
                queue_name=QUEUE,
                status="PENDING",
                executor_id=owner,
                load_input=False,
                load_output=False,
            ):
                taken = (turn.attributes or {}).get("takeovers", 0)
                if not isinstance(taken, int) or taken >= MAX_TAKEOVERS:
                    client.cancel_workflow(turn.workflow_id)
                    _log.error(
                        "cancelled a turn whose worker died under it too often",
                        turn_id=turn.workflow_id,
                        takeovers=taken,
                    )
                    continue
                client.update_workflow_attributes(
                    turn.workflow_id, {"takeovers": taken + 1}, merge=True
                )
                client.resume_workflow(turn.workflow_id, queue_name=QUEUE)
                moved += 1
            _log.warning(
                "took over the turns of a dead worker", executor=owner, turns=moved - before
            )
    return moved


class TurnWorker:
    """Run the turns queued in ``database_url`` on ``app_server``, while the context lasts.

    ``engine`` is the engine of every turn (an engine object, a spec, or ``None``), or a
    callable giving a turn's engine from its params. ``executor_id`` names this worker (one
    live worker per id: a second one waits ``hold_timeout`` s, then ``ExecutorIdInUse``).
    ``watchdog_interval``: how often it sweeps for dead workers' turns (``None``: never).
    ``poll``: how often it reads the queue (seconds; each read costs DBOS about 2 ms of CPU).
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
        watchdog_interval: float | None = DEFAULT_SWEEP_S,
        hold_timeout: float = 10.0,
    ) -> None:
        self.database_url = check_database_url(database_url)
        self.executor_id = check_executor_id(executor_id)
        self.drain_timeout = drain_timeout
        self._app_server = app_server
        self._poll = poll
        self._sweep_interval = watchdog_interval
        self._hold_timeout = hold_timeout
        if callable(engine) and not hasattr(engine, "info"):
            self._engine_for: Callable[[TurnParams], object | None] = engine
        else:
            self._engine_for = functools.partial(_same, resolve_engine(engine))
        self.liveness: Liveness | None = None
        self.runtime: WorkerRuntime | None = None
        self._stopper: threading.Thread | None = None
        self._shut = False
        self._sweeping = threading.Event()
        #: Set once this worker's alive lock is released (never while a turn runs here).
        self.lock_released = threading.Event()
        #: Set when the alive lock was lost while the worker ran (its database connection
        #: dropped): the worker stopped taking turns and must be shut down.
        self.lock_lost = threading.Event()

    @property
    def in_flight(self) -> int:
        return self.runtime.in_flight if self.runtime is not None else 0

    async def __aenter__(self) -> TurnWorker:
        liveness = liveness_for(self.database_url)
        # Before DBOS starts (and recovers this id's turns): one live worker per executor id.
        await anyio.to_thread.run_sync(liveness.hold, self.executor_id, self._hold_timeout)
        self.liveness = liveness
        try:
            for previous in _stopping:  # one DBOS per process: the last one must be gone
                await anyio.to_thread.run_sync(previous.join, 30.0)
            self.runtime = await anyio.to_thread.run_sync(self._prepare, liveness)
            install_runtime(self.runtime)
            config: DBOSConfig = {
                "name": APP_NAME,
                "system_database_url": self.database_url,
                "executor_id": self.executor_id,
                "application_version": APP_VERSION,
                "serializer": DBOSPortableJSONSerializer(),
                "log_level": "WARNING",
            }
            DBOS(config=config)
            DBOS.listen_queues([QUEUE, worker_queue(self.executor_id)])
            DBOS.launch()  # on this thread, in the running loop: the turns run on this loop
            try:
                await anyio.to_thread.run_sync(self.sweep)  # dead peers' turns, at once
            except Exception as error:  # the sweeper looks again in a moment
                _log.warning("first sweep failed", error=format_error(error))
            if self._sweep_interval is not None:
                sweeper = threading.Thread(target=self._sweep_loop, name="codex-turn-sweeper")
                sweeper.daemon = True
                sweeper.start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.shutdown()
            raise
        return self

    def _prepare(self, liveness: Liveness) -> WorkerRuntime:
        prepare_database(self.database_url)
        client = dbos_client(self.database_url)
        # Forwards are rarer than turns: their queue is read half as often (each read of an
        # idle queue costs DBOS ~2 ms of CPU).
        for queue, partitioned in ((QUEUE, True), (worker_queue(self.executor_id), False)):
            client.register_queue(
                queue,
                partition_concurrency=1 if partitioned else None,
                polling_interval_sec=self._poll if partitioned else 2 * self._poll,
                application_name=APP_NAME,
            )
        return WorkerRuntime(
            app_server=self._app_server,
            engine_for=self._engine_for,
            executor_id=self.executor_id,
            client=client,
            liveness=liveness,
            homes=Homes(self.database_url),
            wakes=Wakes(wake_directory(self.database_url)),
            poll=self._poll,
        )

    def sweep(self) -> int:
        """One look for dead workers' turns; how many were put back on the queue."""
        if self.runtime is None:
            return 0
        return take_over(self.runtime.client, self.runtime.liveness, self.executor_id)

    def _sweep_loop(self) -> None:
        interval = self._sweep_interval or DEFAULT_SWEEP_S
        while not self._sweeping.wait(interval):
            try:
                if self.liveness is not None:
                    self.liveness.verify()
            except Exception as error:
                _log.error(
                    "executor lock lost: this worker takes no new turns and must shut down",
                    executor=self.executor_id,
                    in_flight=self.in_flight,
                    error=format_error(error),
                )
                self.lock_lost.set()
                self.stop_taking_turns()
                return
            try:
                self.sweep()
            except Exception as error:  # a database hiccup: look again next time
                _log.warning("sweep failed", error=format_error(error))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self.drain()

    def stop_taking_turns(self, grace: float | None = None) -> None:
        """No turn is forwarded here nor dequeued from now on; the ones in flight go on
        (DBOS waits ``grace`` s, default ``drain_timeout``, in whole seconds, then stops)."""
        self._sweeping.set()
        if self._stopper is not None:
            return
        if self.liveness is not None:
            self.liveness.stop_serving()
        wait = math.ceil(self.drain_timeout if grace is None else grace)
        self._stopper = threading.Thread(
            target=_destroy, args=(wait,), name="codex-turn-drain", daemon=True
        )
        _stopping[:] = [self._stopper]
        self._stopper.start()

    async def wait_idle(self, grace: float) -> bool:
        """Wait, at most ``grace`` s, for the drain; True when no turn runs here."""
        with anyio.move_on_after(grace):
            while self._stopper is not None and self._stopper.is_alive():  # noqa: ASYNC110 (a thread)
                await anyio.sleep(0.02)
        return self.in_flight == 0

    async def drain(self, grace: float | None = None) -> bool:
        """Stop taking turns, wait for the ones in flight (``grace`` s, default
        ``drain_timeout``), shut down. True when nothing was left running."""
        grace = self.drain_timeout if grace is None else grace
        self.stop_taking_turns(grace)
        await self.wait_idle(grace + 2.0)  # DBOS looks once a second
        return await self.shutdown()

    async def shutdown(self) -> bool:
        """Shut down now; True when no turn was still running (one that was keeps the alive
        lock until it ends: released, a peer would take it over and run it again)."""
        self.stop_taking_turns(0)
        drained = self.in_flight == 0
        runtime, liveness = self.runtime, self.liveness
        if self._shut:
            return drained
        self._shut = True
        if runtime is not None:
            runtime.wakes.close()
            await anyio.to_thread.run_sync(runtime.homes.close)
            await anyio.to_thread.run_sync(runtime.client.destroy)
        self.liveness = None
        if liveness is not None:
            if drained:
                await anyio.to_thread.run_sync(liveness.release)
                self.lock_released.set()
            else:
                _log.warning(
                    "turns still running at shutdown: executor lock kept until they end",
                    executor=self.executor_id,
                    in_flight=self.in_flight,
                )
                threading.Thread(
                    target=self._release_when_idle, args=(liveness,), daemon=True
                ).start()
        return drained

    def _release_when_idle(self, liveness: Liveness) -> None:
        while self.in_flight:
            time.sleep(0.02)
        liveness.release()
        self.lock_released.set()
        _log.info("executor lock released after the last turn ended", executor=self.executor_id)


def _destroy(wait: int) -> None:
    try:
        DBOS.destroy(workflow_completion_timeout_sec=wait)
    except Exception as error:
        _log.warning("DBOS shutdown failed", error=format_error(error))


def _same(engine: object | None, _params: TurnParams) -> object | None:
    return engine
