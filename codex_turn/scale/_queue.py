"""Submitting turns and reading their results: :class:`TurnQueue` and :class:`QueuedTurn`.

The queue is a DBOS client: it talks to the system database only (a SQLite file, or
Postgres), runs no turn itself and needs no launched DBOS, so any process can submit a turn
or read one's result by its id. Workers (:class:`~codex_turn.scale.TurnWorker`,
``codex-turn worker``) run them.
"""

from __future__ import annotations

import functools
import sqlite3
import time
from typing import Any, Final, Literal

import anyio
import attrs
import sqlalchemy as sa
from dbos import (
    DBOS,
    DBOSClient,
    EnqueueOptions,
    WorkflowStatus,
)
from dbos import error as dbos_error

from codex_turn.harness.turn.context import prompt_identity_for
from codex_turn.harness.turn_api import TurnParams
from codex_turn.scale._routing import INBOX, OPEN_STATUSES, Router, statuses_of
from codex_turn.scale._wake import Wakes, wake_directory
from codex_turn.scale._wire import TurnRecord, params_to_wire, session_lane
from codex_turn.scale._workflow import APP_NAME, WORKFLOW_NAME

__all__ = ["QueuedTurn", "QueuedTurnState", "TurnFailed", "TurnQueue", "TurnStatus", "session_lane"]

QueuedTurnState = Literal["enqueued", "running", "completed", "failed", "cancelled"]

_STATES: Final[dict[str, QueuedTurnState]] = {
    "ENQUEUED": "enqueued",
    "DELAYED": "enqueued",
    "PENDING": "running",
    "SUCCESS": "completed",
    "ERROR": "failed",
    "CANCELLED": "cancelled",
    "MAX_RECOVERY_ATTEMPTS_EXCEEDED": "failed",
}

#: How often an idle worker reads its queue, and a waiting handle the turn's status when no
#: wake-up can reach it (seconds).
DEFAULT_POLL_S: Final = 0.005


class TurnFailed(RuntimeError):
    """The queued turn ended with an error (not a turn outcome: an exception such as
    ``SessionBusy`` or an engine that could not be loaded) or was cancelled."""


@attrs.frozen
class TurnStatus:
    """Where a queued turn is: ``state``, and the executor that runs or ran it."""

    turn_id: str
    state: QueuedTurnState
    executor_id: str | None
    created_at_ms: int | None
    updated_at_ms: int | None


@attrs.define(eq=False)
class QueuedTurn:
    """A submitted turn, by its id: its status and, once done, its :class:`TurnRecord`.

    Waiting for the result reads the turn's durable status in the database: on SQLite when a
    worker announces the end of the turn (:mod:`codex_turn.scale._wake`), and every
    ``poll`` s otherwise (every :data:`WAKE_FALLBACK_S` s at most while wake-ups can come)."""

    turn_id: str
    _client: DBOSClient
    _wakes: Wakes = attrs.field(factory=lambda: Wakes(None))
    #: How the submit that returned this handle placed the turn
    #: (:class:`~codex_turn.scale._routing.Placement`'s reason), ``"existing"`` when the turn id
    #: was submitted before; ``None`` for a handle looked up by id.
    routed: str | None = attrs.field(default=None, init=False)

    def _read(self) -> WorkflowStatus:
        """The turn's status row, its outcome included (not its params)."""
        found = self._client.list_workflows(workflow_ids=[self.turn_id], load_input=False)
        if not found:
            raise KeyError(self.turn_id)
        return found[0]

    async def _read_async(self) -> WorkflowStatus:
        found = await self._client.list_workflows_async(
            workflow_ids=[self.turn_id], load_input=False
        )
        if not found:
            raise KeyError(self.turn_id)
        return found[0]

    def status(self) -> TurnStatus:
        return _status_of(self.turn_id, self._read())

    def result(self, timeout: float | None = None, *, poll: float = DEFAULT_POLL_S) -> TurnRecord:
        """Wait for the turn (``TimeoutError`` after ``timeout`` s); its record. Raises
        :class:`TurnFailed` for a turn that raised or was cancelled."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wakes.waiter(self.turn_id) as waiter:
            pace = _Pace(poll, self._wakes.available)
            while (raw := self._read()).status in OPEN_STATUSES:
                wait = pace.next()
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        state = _STATES.get(raw.status, "failed")
                        raise TimeoutError(f"turn {self.turn_id} is still {state}")
                    wait = min(wait, left)
                pace.woken(waiter.wait(wait))
        return self._record(raw)

    async def result_async(self, *, poll: float = DEFAULT_POLL_S) -> TurnRecord:
        """:meth:`result` for async callers (asyncio): cancellable, bound it with
        ``anyio.fail_after``."""
        with self._wakes.waiter(self.turn_id) as waiter:
            pace = _Pace(poll, self._wakes.available)
            while (raw := await self._read_async()).status in OPEN_STATUSES:
                pace.woken(await waiter.wait_async(pace.next()))
        return self._record(raw)

    def _record(self, raw: WorkflowStatus) -> TurnRecord:
        """The record of an ended turn from its status (which holds the outcome)."""
        if raw.status == "SUCCESS":
            wire: Any = raw.output
            return TurnRecord.from_wire(wire)
        if raw.status == "CANCELLED":
            raise TurnFailed(f"turn {self.turn_id} was cancelled")
        raise TurnFailed(f"turn {self.turn_id} failed: {raw.error or raw.status}") from raw.error


#: With wake-ups, how often a waiting handle reads the database anyway (a lost wake-up).
WAKE_FALLBACK_S: Final = 0.05
#: After a wake-up: the worker announced the end of the turn just before DBOS writes its
#: outcome, so the handle reads every :data:`WAKE_HOT_POLL_S` s for this long.
WAKE_HOT_S: Final = 0.2
WAKE_HOT_POLL_S: Final = 0.001


class _Pace:
    """How long a waiting handle sleeps before its next read of the database."""

    def __init__(self, poll: float, wakes: bool) -> None:
        self.poll = poll
        self.idle = max(poll, WAKE_FALLBACK_S) if wakes else poll
        self.hot_until = 0.0

    def next(self) -> float:
        if time.monotonic() < self.hot_until:
            return min(self.poll, WAKE_HOT_POLL_S)
        return self.idle

    def woken(self, woken: bool) -> None:
        if woken:
            self.hot_until = time.monotonic() + WAKE_HOT_S


def _status_of(turn_id: str, raw: WorkflowStatus) -> TurnStatus:
    return TurnStatus(
        turn_id=turn_id,
        state=_STATES.get(raw.status, "failed"),
        executor_id=raw.executor_id,
        created_at_ms=raw.created_at,
        updated_at_ms=raw.updated_at,
    )


class TurnQueue:
    """Turns to run, in a DBOS system database (``sqlite:///path`` or ``postgresql://...``).

    ``submit`` is idempotent by turn id (the workflow id): submitting an id again returns the
    turn already queued under it, whatever the params, and never runs it twice. The turns of
    one session (:func:`session_lane`) run one at a time in submission order, on the worker
    that holds the session's Codex thread while it is alive and serving, elsewhere otherwise
    (:mod:`codex_turn.scale._routing`: a DBOS queue per worker, partitioned by session with
    ``partition_concurrency=1``, and a route per session in the same database). ``migrate``
    creates or upgrades the database's DBOS schema first (so a client may be the first to
    touch a new SQLite file).
    """

    def __init__(self, database_url: str, *, migrate: bool = True) -> None:
        self.database_url = database_url
        if migrate:
            DBOS.migrate(database_url)
            use_wal(database_url)
        self._client = DBOSClient(system_database_url=database_url, application_name=APP_NAME)
        register_queue(self._client)
        self._router = Router(database_url, statuses=functools.partial(statuses_of, self._client))
        self._wakes = Wakes(wake_directory(database_url))

    def submit(self, params: TurnParams, *, turn_id: str) -> QueuedTurn:
        prompt_identity_for(turn_id)  # the turn id becomes the prompt's identity: check it now
        lane = session_lane(params)
        wire = params_to_wire(params)

        def enqueue(connection: sa.Connection, queue: str) -> None:
            options: EnqueueOptions = {
                "workflow_name": WORKFLOW_NAME,
                "queue_name": queue,
                "workflow_id": turn_id,
                "workflow_id_reuse_policy": "reject",
                "queue_partition_key": lane,
                "application_name": APP_NAME,
            }
            self._client.enqueue_in_transaction(connection, options, turn_id, wire)

        try:
            placement = self._router.submit(lane, turn_id, enqueue)
        except dbos_error.DBOSWorkflowIDInUseError:  # submitted before (nothing was written)
            placement = None
        handle = QueuedTurn(turn_id, self._client, self._wakes)
        handle.routed = placement.reason if placement is not None else "existing"
        return handle

    async def submit_async(self, params: TurnParams, *, turn_id: str) -> QueuedTurn:
        return await anyio.to_thread.run_sync(lambda: self.submit(params, turn_id=turn_id))

    def handle(self, turn_id: str) -> QueuedTurn:
        """The handle of a turn submitted earlier, by any process (``KeyError`` if none)."""
        if not self._client.list_workflows(
            workflow_ids=[turn_id], load_input=False, load_output=False
        ):
            raise KeyError(turn_id)
        return QueuedTurn(turn_id, self._client, self._wakes)

    def close(self) -> None:
        self._wakes.close()
        self._router.close()
        self._client.destroy()

    def __enter__(self) -> TurnQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def register_queue(client: DBOSClient, *, name: str = INBOX, poll: float = DEFAULT_POLL_S) -> None:
    """A queue of turns: one partition per session, one turn of a partition at a time (the
    inbox, by default, or a worker's queue)."""
    client.register_queue(
        name,
        partition_concurrency=1,
        polling_interval_sec=poll,
        on_conflict="always_update",
        application_name=APP_NAME,
    )


def use_wal(database_url: str) -> None:
    """An embedded SQLite database in WAL mode (persistent in the file): one fsync per commit
    instead of the rollback journal's several, and readers never block the writer. Still
    durable (``synchronous`` stays FULL). Nothing for Postgres."""
    if not database_url.startswith("sqlite:///"):
        return
    connection = sqlite3.connect(database_url.removeprefix("sqlite:///"), timeout=30)
    try:
        connection.execute("PRAGMA journal_mode=WAL")
    finally:
        connection.close()
