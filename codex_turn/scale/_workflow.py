"""A turn as DBOS workflows: where it runs, and why a re-run writes nothing twice.

**Order.** Every turn is a workflow on one queue partitioned by session
(``partition_concurrency=1``): the worker that dequeued it holds the session until the
workflow ends, so a session's turns run one at a time, in submission order, on any worker.

**Locality, a hint.** A Codex thread lives in one worker's ``CODEX_HOME``; elsewhere the
harness starts a fresh thread. So each session has a *home* (:class:`Homes`, one small table
of ours: the worker that last ran it; a new session's is the serving worker of highest
rendezvous score). A turn dequeued by another worker while its home serves is *forwarded*:
enqueued as a second workflow, ``<turn id>:home``, on the home's own queue, and awaited (its
end announced, :mod:`codex_turn.scale._wake`); the first holds the session meanwhile. Should
the home die first, the forward is taken back under the home's alive lock
(:mod:`codex_turn.scale._locks`: dead, it dequeues nothing) by cancelling it, and the turn
runs where it waits. A re-run of a turn finds its forward by that id.
``TurnRecord.locality`` says which: ``sticky`` (on the home), ``moved`` (the home was dead or
draining), ``first``.

**Exactly once.** No step inside: a worker that dies before the outcome is written has the
workflow run again from the start, and every effect of a turn is idempotent by the turn id:

* the prompt is made durable before ``turn/start`` under an identity derived from the turn id
  (``run_codex_turn(..., idempotency_key=turn_id)``), keyed independently of the thread, so a
  re-run appends it once even on another worker's thread;
* a re-run finds the turn in the transcript: ``run_codex_turn`` looks, *under the session
  hold*, for the reply of an earlier attempt and raises
  :class:`~codex_turn.harness.idempotency.TurnAlreadyCompleted`; that reply is the result and
  Codex is not asked again. The engine is brought up to date first
  (:mod:`codex_turn.scale._catch_up`), since the attempt may have died before its finalize;
* the thread binding and the engine's ``after_turn`` hold the whole session, so they converge.

The workflows reach the process's app-server and engine through the worker's
:class:`WorkerRuntime`: live objects of this process, never stored in the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

import anyio
import attrs
import sqlalchemy as sa
from dbos import DBOS, DBOSClient, EnqueueOptions, WorkflowStatus
from sqlalchemy.dialects import postgresql, sqlite

from codex_turn._log import format_error, get_logger, mask_session_key
from codex_turn.harness._gates import SessionBusy
from codex_turn.harness.appserver import AppServerPort
from codex_turn.harness.idempotency import CompletedTurn, TurnAlreadyCompleted, completed_turn
from codex_turn.harness.turn.orchestrator import run_codex_turn
from codex_turn.harness.turn_api import TurnParams
from codex_turn.scale._catch_up import catch_up_engine
from codex_turn.scale._locks import Liveness
from codex_turn.scale._queue import (
    APP_NAME,
    OPEN,
    WORKFLOW_NAME,
    TurnFailed,
    read_workflow,
    worker_queue,
)
from codex_turn.scale._wake import Wakes
from codex_turn.scale._wire import TurnRecord, params_from_wire, record_of, session_lane

__all__ = ["Homes", "WorkerRuntime", "install_runtime", "mirrored_turn"]

_log = get_logger(__name__)

FORWARDED_NAME: Final = "codex_turn.scale.forwarded_turn"
#: How often a turn waiting for its forward checks that the home still lives (seconds).
TAKE_BACK_CHECK_S: Final = 0.2
#: A turn that finds its session held by another process (a direct ``run_codex_turn``
#: elsewhere, :class:`SessionBusy`) is tried again this many times in all, this far apart.
BUSY_ATTEMPTS: Final = 3
BUSY_RETRY_S: Final = 1.0


_HOMES: Final = sa.Table(
    "codex_turn_homes",
    sa.MetaData(schema="codex_turn"),  # none on SQLite
    sa.Column("lane", sa.Text, primary_key=True),
    sa.Column("executor_id", sa.Text, nullable=False),
)


class Homes:
    """Each session's home, in a table of ours (schema ``codex_turn`` on Postgres)."""

    def __init__(self, database_url: str) -> None:
        self.sqlite = database_url.startswith("sqlite:///")
        if self.sqlite:
            self.engine = sa.create_engine(
                database_url,
                connect_args={"timeout": 30},
                execution_options={"schema_translate_map": {"codex_turn": None}},
            )
        else:
            url = sa.make_url(database_url).set(drivername="postgresql+psycopg")
            self.engine = sa.create_engine(url, pool_pre_ping=True)
        for attempt in range(3):
            try:
                with self.engine.begin() as conn:
                    if not self.sqlite:
                        conn.execute(sa.schema.CreateSchema("codex_turn", if_not_exists=True))
                    _HOMES.create(conn, checkfirst=True)
                break
            except sa.exc.DBAPIError:  # two processes creating it at once
                if attempt == 2:
                    raise
                time.sleep(0.05)

    def get(self, lane: str) -> str | None:
        with self.engine.connect() as conn:
            query = sa.select(_HOMES.c.executor_id).where(_HOMES.c.lane == lane)
            value = conn.execute(query).scalar_one_or_none()
        return None if value is None else str(value)

    def set(self, lane: str, executor_id: str) -> None:
        insert = (sqlite.insert if self.sqlite else postgresql.insert)(_HOMES)
        with self.engine.begin() as conn:
            conn.execute(
                insert.values(lane=lane, executor_id=executor_id).on_conflict_do_update(
                    index_elements=[_HOMES.c.lane], set_={"executor_id": executor_id}
                )
            )

    def close(self) -> None:
        self.engine.dispose()


@attrs.define(eq=False)
class WorkerRuntime:
    """What this process's turns run on and reach."""

    app_server: AppServerPort
    engine_for: Callable[[TurnParams], object | None]
    executor_id: str
    client: DBOSClient
    liveness: Liveness
    homes: Homes
    wakes: Wakes
    poll: float
    #: Workflows running in this process (the alive lock is kept until none does).
    in_flight: int = 0


_runtime: list[WorkerRuntime] = []


def install_runtime(runtime: WorkerRuntime | None) -> None:
    """Install (or with ``None`` remove) this process's worker runtime."""
    _runtime.clear()
    if runtime is not None:
        _runtime.append(runtime)


def _current() -> WorkerRuntime:
    if not _runtime:
        raise RuntimeError("no TurnWorker is running in this process")
    return _runtime[0]


def mirrored_turn(session_file: str | os.PathLike[str], turn_id: str) -> dict[str, Any] | None:
    """The reply an earlier attempt of ``turn_id`` left in the transcript, or ``None``: the
    decision ``run_codex_turn(..., idempotency_key=turn_id)`` makes under the session hold."""
    completed = completed_turn(session_file, turn_id)
    return dict(completed.reply) if completed is not None else None


def forwarded_id(turn_id: str) -> str:
    """The id of a turn's forward (``:`` is never in a turn id)."""
    return f"{turn_id}:home"


@contextlib.contextmanager
def _running(workflow_id: str) -> Iterator[WorkerRuntime]:
    """This process's runtime, while one of its workflows runs (counted in flight); the
    workflow's end is announced (:mod:`codex_turn.scale._wake`)."""
    runtime = _current()
    runtime.wakes.announcer(workflow_id)
    runtime.in_flight += 1
    try:
        yield runtime
    finally:
        runtime.in_flight -= 1


@DBOS.workflow(name=WORKFLOW_NAME)
async def turn_workflow(turn_id: str, wire: dict[str, Any]) -> dict[str, Any]:
    """One queued turn (workflow id = turn id), holding its session's partition."""
    with _running(turn_id) as runtime:
        params = params_from_wire(wire)
        forward_id = forwarded_id(turn_id)
        forward, home, target = await asyncio.to_thread(_place, runtime, forward_id, params)
        if forward is None and target != runtime.executor_id:
            options: EnqueueOptions = {
                "workflow_name": FORWARDED_NAME,
                "queue_name": worker_queue(target),
                "workflow_id": forward_id,
                "application_name": APP_NAME,
            }
            await asyncio.to_thread(runtime.client.enqueue, options, turn_id, wire, home)
        forwarded = forward is not None or target != runtime.executor_id
        if forwarded and (record := await _await_forward(runtime, forward_id, target)):
            return record
        return await _run_here(turn_id, params, runtime, previous=home)


@DBOS.workflow(name=FORWARDED_NAME)
async def forwarded_workflow(
    turn_id: str, wire: dict[str, Any], previous: str | None
) -> dict[str, Any]:
    """A turn forwarded to its home (workflow id ``<turn id>:home``) by the turn that holds
    its session, which waits for this outcome."""
    with _running(forwarded_id(turn_id)) as runtime:
        return await _run_here(turn_id, params_from_wire(wire), runtime, previous=previous)


def _place(
    runtime: WorkerRuntime, forward_id: str, params: TurnParams
) -> tuple[WorkflowStatus | None, str | None, str]:
    """The turn's forward by an earlier attempt, its session's home, and where it runs: that
    forward's worker; else the home while it serves, here if it does not; a session with no
    home yet goes to the serving worker of highest rendezvous score (spread, and stable)."""
    me = runtime.executor_id
    forward = read_workflow(runtime.client, forward_id)
    home = runtime.homes.get(session_lane(params))
    if forward is not None:
        return forward, home, (forward.queue_name or me).rpartition("@")[2]
    if home is not None:
        return None, home, home if home != me and runtime.liveness.serving(home) else me
    prefix = worker_queue("")
    queues = [q.name for q in runtime.client.list_queues() if q.name.startswith(prefix)]
    serving = {me} | {
        q[len(prefix) :] for q in queues if runtime.liveness.serving(q[len(prefix) :])
    }
    lane = session_lane(params)
    return None, None, max(serving, key=lambda e: hashlib.blake2b(f"{lane}\0{e}".encode()).digest())


async def _await_forward(
    runtime: WorkerRuntime, forward_id: str, owner: str
) -> dict[str, Any] | None:
    """The forward's record; ``None`` once it was cancelled (taken back here, or by its home
    as it stopped): the turn runs here."""
    last_check = time.monotonic()

    def take_back() -> None:
        nonlocal last_check
        if time.monotonic() - last_check >= TAKE_BACK_CHECK_S:
            last_check = time.monotonic()
            _take_back(runtime, forward_id, owner)

    status = await runtime.wakes.until(
        forward_id,
        functools.partial(read_workflow, runtime.client, forward_id),
        lambda status: status is None or status.status not in OPEN,
        runtime.poll,
        between=take_back,
    )
    if status is not None and status.status == "SUCCESS":
        output: Any = status.output
        return dict(output)
    if status is None or status.status == "CANCELLED":
        return None
    raise TurnFailed(f"its forward failed: {status.error or status.status}")


def _take_back(runtime: WorkerRuntime, forward_id: str, owner: str) -> None:
    """Cancel the forward if its home is dead (its alive lock, held while cancelling, keeps
    a restart of it from recovering the forward meanwhile)."""
    with runtime.liveness.claim(owner) as dead:
        if dead:
            _log.warning("took a turn back from its dead home", executor=owner)
            runtime.client.cancel_workflow(forward_id)


async def _run_here(
    turn_id: str, params: TurnParams, runtime: WorkerRuntime, *, previous: str | None
) -> dict[str, Any]:
    """Run the turn in this process (or find it already mirrored); its record as JSON."""
    started = time.time()
    lane = session_lane(params)
    me = runtime.executor_id
    noted: asyncio.Future[None] | None = None
    if previous != me:  # the session's home is here from now on (while the turn runs)
        noted = asyncio.ensure_future(asyncio.to_thread(runtime.homes.set, lane, me))
    record = await _attempts(turn_id, params, runtime, started)
    locality: str | None = "sticky" if previous == me else "first" if previous is None else "moved"
    if noted is not None:
        try:
            await noted
        except Exception as error:
            _log.warning(
                "could not note the session's home",
                lane=mask_session_key(lane),
                error=format_error(error),
            )
            locality = None
    return attrs.evolve(
        record, locality=locality, previous_executor_id=previous, ended_at=time.time()
    ).to_wire()


async def _attempts(
    turn_id: str, params: TurnParams, runtime: WorkerRuntime, started: float
) -> TurnRecord:
    for attempt in range(1, BUSY_ATTEMPTS + 1):
        engine = runtime.engine_for(params)
        try:
            # The library decides "already ran?" under the session hold (exactly once even
            # when this attempt overlaps an earlier one still running the turn).
            result = await run_codex_turn(
                params, app_server=runtime.app_server, engine=engine, idempotency_key=turn_id
            )
        except TurnAlreadyCompleted as done:
            # The attempt that mirrored it may have died before the engine's finalize.
            await catch_up_engine(params, engine, done.completed)
            return _recorded(turn_id, done.completed, runtime.executor_id, started)
        except SessionBusy:
            if attempt == BUSY_ATTEMPTS:
                raise
            await anyio.sleep(BUSY_RETRY_S)
            continue
        record = record_of(turn_id, result, executor_id=runtime.executor_id)
        return attrs.evolve(record, started_at=started)
    raise AssertionError("unreachable")  # pragma: no cover


def _recorded(
    turn_id: str, completed: CompletedTurn, executor_id: str, started: float
) -> TurnRecord:
    return TurnRecord(
        turn_id=turn_id,
        outcome="completed",
        assistant_text=completed.assistant_text,
        prompt_error=None,
        thread_id=completed.thread_id,
        codex_turn_id=completed.codex_turn_id,
        thread_action=None,
        thread_reason=None,
        projected=False,
        mirror_error=None,
        trace=(),
        durations_ms={},
        executor_id=executor_id,
        source="already_mirrored",
        started_at=started,
    )
