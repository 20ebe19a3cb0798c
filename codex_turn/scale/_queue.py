"""Submitting turns and reading their results: :class:`TurnQueue` and :class:`TurnHandle`.

The queue is a DBOS client: it talks to the system database only (a SQLite file, or
Postgres), runs no turn itself and needs no launched DBOS, so any process can submit a turn
or read one's result by its id. Workers (:class:`~codex_turn.scale.TurnWorker`,
``codex-turn worker``) run them.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any, Final, Literal

import anyio
import attrs
from dbos import DBOS, DBOSClient, EnqueueOptions, WorkflowHandleAsync

from codex_turn.harness.turn_api import TurnParams
from codex_turn.harness.turn_context import prompt_identity_for
from codex_turn.scale._wire import TurnRecord, params_to_wire
from codex_turn.scale._workflow import APP_NAME, QUEUE_NAME, WORKFLOW_NAME

__all__ = ["TurnFailed", "TurnHandle", "TurnQueue", "TurnState", "TurnStatus", "session_lane"]

TurnState = Literal["enqueued", "running", "completed", "failed", "cancelled"]

_STATES: Final[dict[str, TurnState]] = {
    "ENQUEUED": "enqueued",
    "DELAYED": "enqueued",
    "PENDING": "running",
    "SUCCESS": "completed",
    "ERROR": "failed",
    "CANCELLED": "cancelled",
    "MAX_RECOVERY_ATTEMPTS_EXCEEDED": "failed",
}

#: How often a waiting handle and an idle worker look at the database (seconds).
DEFAULT_POLL_S: Final = 0.005


class TurnFailed(RuntimeError):
    """The queued turn ended with an error (not a turn outcome: an exception such as
    ``SessionBusy`` or an engine that could not be loaded) or was cancelled."""


def session_lane(params: TurnParams) -> str:
    """The queue partition of a turn: its session (the key the session gate uses too), so
    the turns of one session run one at a time, in submission order, across all workers."""
    return params.session_key or params.session_id


@attrs.frozen
class TurnStatus:
    """Where a queued turn is: ``state``, and the executor that runs or ran it."""

    turn_id: str
    state: TurnState
    executor_id: str | None
    created_at_ms: int | None
    updated_at_ms: int | None


@attrs.define(eq=False)
class TurnHandle:
    """A submitted turn, by its id: its status and, once done, its :class:`TurnRecord`."""

    turn_id: str
    _client: DBOSClient

    def status(self) -> TurnStatus:
        raw = self._client.retrieve_workflow(self.turn_id).get_status()
        return TurnStatus(
            turn_id=self.turn_id,
            state=_STATES.get(raw.status, "failed"),
            executor_id=raw.executor_id,
            created_at_ms=raw.created_at,
            updated_at_ms=raw.updated_at,
        )

    def result(self, timeout: float | None = None, *, poll: float = DEFAULT_POLL_S) -> TurnRecord:
        """Wait for the turn (``TimeoutError`` after ``timeout`` s); its record. Raises
        :class:`TurnFailed` for a turn that raised or was cancelled."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.status().state
            if state not in ("enqueued", "running"):
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"turn {self.turn_id} is still {state}")
            time.sleep(poll)
        if state == "cancelled":
            raise TurnFailed(f"turn {self.turn_id} was cancelled")
        try:
            wire: Any = self._client.retrieve_workflow(self.turn_id).get_result()
        except Exception as error:
            raise TurnFailed(f"turn {self.turn_id} failed: {error}") from error
        return TurnRecord.from_wire(wire)

    async def result_async(self, *, poll: float = DEFAULT_POLL_S) -> TurnRecord:
        """:meth:`result` for async callers (asyncio): cancellable, bound it with
        ``anyio.fail_after``. Polls the result alone, every ``poll`` s."""
        handle: WorkflowHandleAsync[Any] = await self._client.retrieve_workflow_async(self.turn_id)
        try:
            wire: Any = await handle.get_result(polling_interval_sec=poll)
        except Exception as error:
            raise TurnFailed(f"turn {self.turn_id} failed or was cancelled: {error}") from error
        return TurnRecord.from_wire(wire)


class TurnQueue:
    """Turns to run, in a DBOS system database (``sqlite:///path`` or ``postgresql://...``).

    ``submit`` is idempotent by turn id (the workflow id): submitting an id again returns the
    turn already queued under it, whatever the params, and never runs it twice. The turns of
    one session (:func:`session_lane`) run one at a time in submission order: one DBOS queue,
    partitioned by session with ``partition_concurrency=1``, enforced in the database across
    every worker. ``migrate`` creates or upgrades the database's DBOS schema first (so a
    client may be the first to touch a new SQLite file).
    """

    def __init__(self, database_url: str, *, migrate: bool = True) -> None:
        self.database_url = database_url
        if migrate:
            DBOS.migrate(database_url)
            use_wal(database_url)
        self._client = DBOSClient(system_database_url=database_url, application_name=APP_NAME)
        register_queue(self._client)

    def submit(self, params: TurnParams, *, turn_id: str) -> TurnHandle:
        prompt_identity_for(turn_id)  # the turn id becomes the prompt's identity: check it now
        options: EnqueueOptions = {
            "workflow_name": WORKFLOW_NAME,
            "queue_name": QUEUE_NAME,
            "workflow_id": turn_id,
            "workflow_id_reuse_policy": "return-existing",
            "queue_partition_key": session_lane(params),
            "application_name": APP_NAME,
        }
        self._client.enqueue(options, turn_id, params_to_wire(params))
        return TurnHandle(turn_id, self._client)

    async def submit_async(self, params: TurnParams, *, turn_id: str) -> TurnHandle:
        return await anyio.to_thread.run_sync(lambda: self.submit(params, turn_id=turn_id))

    def handle(self, turn_id: str) -> TurnHandle:
        """The handle of a turn submitted earlier, by any process (``KeyError`` if none)."""
        try:
            self._client.retrieve_workflow(turn_id)
        except Exception as error:
            raise KeyError(turn_id) from error
        return TurnHandle(turn_id, self._client)

    def close(self) -> None:
        self._client.destroy()

    def __enter__(self) -> TurnQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def register_queue(client: DBOSClient, *, poll: float = DEFAULT_POLL_S) -> None:
    """The turns' queue: one partition per session, one turn of a partition at a time."""
    client.register_queue(
        QUEUE_NAME,
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
