"""Submitting turns and reading their results: :class:`TurnQueue` and :class:`QueuedTurn`.

The queue is a DBOS client: it talks to the system database only (a SQLite file, or
Postgres), runs no turn itself and needs no launched DBOS, so any process can submit a turn
or read one's result by its id. A turn is a workflow (id = the turn id, so a second submit of
an id is the same turn) on one DBOS queue partitioned by session (``partition_concurrency=1``):
DBOS itself runs a session's turns one at a time, in submission order, whichever worker
dequeues them. A waiting handle reads the turn's status when a worker announces its end
(:mod:`codex_turn.scale._wake`), else polls. Everything stored is plain JSON (DBOS's portable
serializer), never a pickle.
"""

from __future__ import annotations

import os
import re
import sqlite3
from typing import Any, Final, Literal

import anyio
import attrs
from dbos import DBOS, DBOSClient, DBOSPortableJSONSerializer, EnqueueOptions, WorkflowStatus

from codex_turn.errors import CodexTurnError
from codex_turn.harness.turn.context import prompt_identity_for
from codex_turn.harness.turn_api import InvalidTurnParams, TurnParams
from codex_turn.scale._wake import Wakes, wake_directory
from codex_turn.scale._wire import TurnRecord, params_to_wire, session_lane

__all__ = [
    "InvalidQueueConfig",
    "QueuedTurn",
    "QueuedTurnState",
    "TurnFailed",
    "TurnQueue",
    "TurnStatus",
]

#: The DBOS application every client and worker of codex-turn names.
APP_NAME: Final = "codex-turn"
#: Fixed, so a restarted worker recovers the turns its predecessor left pending even when the
#: code changed in between (DBOS recovers only workflows of its own application version).
#: Bump it when the workflows change incompatibly.
APP_VERSION: Final = "codex-turn-scale-3"
WORKFLOW_NAME: Final = "codex_turn.scale.turn"
#: The queue of every turn, partitioned by session.
QUEUE: Final = "codex_turn_turns"
#: How often a worker reads the queue for new turns, and a waiting handle with no wake-ups a
#: turn's status at first (seconds; each read of the queue costs DBOS about 2 ms of CPU).
DEFAULT_POLL_S: Final = 0.005

QueuedTurnState = Literal["enqueued", "running", "completed", "failed", "cancelled"]
_STATES: Final[dict[str, QueuedTurnState]] = {
    "ENQUEUED": "enqueued",
    "DELAYED": "enqueued",
    "PENDING": "running",
    "SUCCESS": "completed",
    "CANCELLED": "cancelled",
}
#: DBOS states of a workflow that has not ended.
OPEN: Final = frozenset({"ENQUEUED", "DELAYED", "PENDING"})
#: Executor ids, as turn ids: they name lock files.
_EXECUTOR_ID: Final = re.compile(r"[A-Za-z0-9._-]{1,128}")


class InvalidQueueConfig(CodexTurnError, ValueError):
    """A database URL or executor id the queue cannot use."""


class TurnFailed(CodexTurnError, RuntimeError):
    """The queued turn ended with an error (not a turn outcome: an exception such as
    ``SessionBusy`` or an engine that could not be loaded) or was cancelled."""


def check_database_url(url: object) -> str:
    if not isinstance(url, str) or not url.startswith(
        ("sqlite:///", "postgresql://", "postgres://", "postgresql+psycopg://")
    ):
        raise InvalidQueueConfig(
            f"the database URL must be sqlite:///PATH or postgresql://..., not {str(url)[:40]!r}"
        )
    return url


def check_executor_id(executor_id: object) -> str:
    if not isinstance(executor_id, str) or not _EXECUTOR_ID.fullmatch(executor_id):
        raise InvalidQueueConfig("an executor id is 1-128 characters of [A-Za-z0-9._-]")
    return executor_id


def worker_queue(executor_id: str) -> str:
    """The queue only ``executor_id`` dequeues: the turns forwarded to it."""
    return f"{QUEUE}@{executor_id}"


def prepare_database(database_url: str) -> None:
    """Create or migrate DBOS's schema. An embedded SQLite file is created owner-only
    (whatever the umask; SQLite gives its ``-wal`` and ``-shm`` the file's mode) and in WAL
    mode (one fsync per commit, readers never block the writer; ``synchronous`` stays FULL)."""
    if database_url.startswith("sqlite:///"):
        path = database_url.removeprefix("sqlite:///")
        for name in (path, path + "-wal", path + "-shm"):
            try:
                fd = os.open(
                    name, os.O_RDONLY | os.O_CLOEXEC | (os.O_CREAT * (name == path)), 0o600
                )
            except FileNotFoundError:
                continue
            try:
                status = os.fstat(fd)
                if status.st_uid == os.geteuid() and status.st_mode & 0o177:
                    os.fchmod(fd, status.st_mode & 0o600)  # a new file, or an earlier one's
            finally:
                os.close(fd)
    DBOS.migrate(database_url)
    if database_url.startswith("sqlite:///"):
        connection = sqlite3.connect(database_url.removeprefix("sqlite:///"), timeout=30)
        try:
            connection.execute("PRAGMA journal_mode=WAL")
        finally:
            connection.close()


def dbos_client(database_url: str) -> DBOSClient:
    return DBOSClient(
        system_database_url=database_url,
        application_name=APP_NAME,
        serializer=DBOSPortableJSONSerializer(),
    )


def read_workflow(client: DBOSClient, workflow_id: str) -> WorkflowStatus | None:
    """A workflow's status and outcome (not its inputs), or None."""
    found = client.list_workflows(workflow_ids=[workflow_id], load_input=False)
    return found[0] if found else None


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
    """A submitted turn, by its id: its status and, once done, its :class:`TurnRecord`."""

    turn_id: str
    _client: DBOSClient
    _wakes: Wakes

    def _read(self) -> WorkflowStatus:
        found = read_workflow(self._client, self.turn_id)
        if found is None:
            raise KeyError(self.turn_id)
        return found

    def status(self) -> TurnStatus:
        raw = self._read()
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
        try:
            raw = self._wakes.until_sync(self.turn_id, self._read, _ended, poll, timeout)
        except TimeoutError:
            raise TimeoutError(f"turn {self.turn_id} is still {self.status().state}") from None
        return self._record(raw)

    async def result_async(self, *, poll: float = DEFAULT_POLL_S) -> TurnRecord:
        """:meth:`result` for async callers: cancellable, bound it with ``anyio.fail_after``."""
        return self._record(await self._wakes.until(self.turn_id, self._read, _ended, poll))

    def _record(self, raw: WorkflowStatus) -> TurnRecord:
        if raw.status == "SUCCESS":
            wire: Any = raw.output
            return TurnRecord.from_wire(wire)
        if raw.status == "CANCELLED":
            raise TurnFailed(f"turn {self.turn_id} was cancelled")
        raise TurnFailed(f"turn {self.turn_id} failed: {raw.error or raw.status}") from raw.error


def _ended(status: WorkflowStatus | None) -> bool:
    return status is None or status.status not in OPEN


class TurnQueue:
    """Turns to run, in a DBOS system database (``sqlite:///path`` or ``postgresql://...``).

    ``submit`` is idempotent by turn id: submitting an id again returns the turn queued under
    it, whatever the params, and never runs it twice. ``migrate`` creates or upgrades the
    database's DBOS schema first (so a client may be the first to touch a new SQLite file).
    """

    def __init__(self, database_url: str, *, migrate: bool = True) -> None:
        self.database_url = check_database_url(database_url)
        if migrate:
            prepare_database(database_url)
        self._client = dbos_client(database_url)
        self._wakes = Wakes(wake_directory(database_url))

    def submit(self, params: TurnParams, *, turn_id: str) -> QueuedTurn:
        if not isinstance(params, TurnParams):
            raise InvalidTurnParams(f"params must be TurnParams, not {type(params).__name__}")
        if params.native_hooks is not None:  # a live relay of this process: nothing to store
            raise InvalidTurnParams("native_hooks cannot be queued: run the turn in-process")
        prompt_identity_for(turn_id)  # the turn id becomes the prompt's identity: check it now
        options: EnqueueOptions = {
            "workflow_name": WORKFLOW_NAME,
            "queue_name": QUEUE,
            "workflow_id": turn_id,
            "queue_partition_key": session_lane(params),
            "application_name": APP_NAME,
        }
        # An id submitted before is that turn (DBOS's default reuse policy): nothing written.
        self._client.enqueue(options, turn_id, params_to_wire(params))
        return QueuedTurn(turn_id, self._client, self._wakes)

    async def submit_async(self, params: TurnParams, *, turn_id: str) -> QueuedTurn:
        return await anyio.to_thread.run_sync(lambda: self.submit(params, turn_id=turn_id))

    def handle(self, turn_id: str) -> QueuedTurn:
        """The handle of a turn submitted earlier, by any process (``KeyError`` if none)."""
        handle = QueuedTurn(turn_id, self._client, self._wakes)
        handle.status()
        return handle

    def close(self) -> None:
        self._wakes.close()
        self._client.destroy()

    def __enter__(self) -> TurnQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
