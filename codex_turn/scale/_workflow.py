"""The turn as a DBOS workflow that runs :func:`run_codex_turn` once per attempt.

No step inside. A step would checkpoint the turn's record, then DBOS the workflow's output
(the same record) again: a commit and a read more per turn, for nothing. A worker that dies
before the outcome is written has the workflow run again from the start (at least once, as in
every durable engine), exactly as a step that died before its checkpoint would, and every
effect of a turn is idempotent by the turn id instead:

* the prompt is made durable before ``turn/start`` under an identity derived from the turn id
  (``run_codex_turn(..., idempotency_key=turn_id)``), keyed independently of the thread, so a
  re-run appends it once even on another worker's thread (the mirror skips a key it holds);
* a re-run finds the turn in the transcript: ``run_codex_turn`` looks, *under the session
  hold* and before any stage, for the reply of an earlier attempt (the worker died between the
  mirror and the outcome, or the attempt was still running when the re-run started: the
  re-run waits for its hold first) and raises
  :class:`~codex_turn.harness.idempotency.TurnAlreadyCompleted`; that reply is the result and
  Codex is not asked again (:func:`mirrored_turn` reads the same decision). The engine is
  brought up to date first: the turn's finalize (and maintenance) run for it under the
  session hold (:mod:`codex_turn.scale._catch_up`), since the attempt may have died before
  them, and a storing engine adds nothing for a turn it already holds;
* the thread binding and the engine's ``after_turn`` hold the whole session, so they converge.

The workflow reaches the process's app-server and engine through the worker's
:class:`WorkerRuntime` (installed by :class:`~codex_turn.scale.TurnWorker`): they are live
objects of this process, never stored in the database. It notes where the session's previous
turn ran (``locality``, :mod:`codex_turn.scale._routing`) alongside the turn, and announces
the turn's end to waiting handles once DBOS wrote it (:mod:`codex_turn.scale._wake`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import anyio
import attrs
from dbos import DBOS

from codex_turn._log import format_error, get_logger, mask_session_key
from codex_turn.harness._gates import SessionBusy
from codex_turn.harness.appserver import AppServerPort
from codex_turn.harness.idempotency import CompletedTurn, TurnAlreadyCompleted, completed_turn
from codex_turn.harness.turn.orchestrator import run_codex_turn
from codex_turn.harness.turn_api import TurnParams
from codex_turn.scale._catch_up import catch_up_engine
from codex_turn.scale._wake import announce
from codex_turn.scale._wire import TurnRecord, params_from_wire, record_of, session_lane

__all__ = [
    "APP_NAME",
    "APP_VERSION",
    "QUEUE_NAME",
    "WORKFLOW_NAME",
    "WorkerRuntime",
    "install_runtime",
    "mirrored_turn",
]

_log = get_logger(__name__)

#: The DBOS application every client and worker of codex-turn names.
APP_NAME = "codex-turn"
#: Fixed, so a restarted worker recovers the turns its predecessor left pending even when the
#: code changed in between (DBOS recovers only workflows of its own application version).
#: Bump it when the workflow's steps change incompatibly.
APP_VERSION = "codex-turn-scale-2"
WORKFLOW_NAME = "codex_turn.scale.turn"
QUEUE_NAME = "codex_turn_turns"


@attrs.define(eq=False)
class WorkerRuntime:
    """What this process's turns run on: one app-server and the engine of a turn."""

    app_server: AppServerPort
    engine_for: Callable[[TurnParams], object | None]
    executor_id: str
    #: Where this worker announces the end of each turn (:mod:`codex_turn.scale._wake`).
    wake_directory: str | None = None
    #: ``note_run(lane, executor_id)``: records that a turn of the lane starts here and says
    #: where its previous one ran (:meth:`codex_turn.scale._routing.Router.note_run`).
    note_run: Callable[[str, str], tuple[str, str | None]] | None = None
    #: Turns in flight in this process (the graceful drain waits for zero).
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
    """The reply an earlier attempt of ``turn_id`` left in the transcript, or ``None``.

    The decision ``run_codex_turn(..., idempotency_key=turn_id)`` makes under the session hold
    (:func:`~codex_turn.harness.idempotency.completed_turn`): the prompt keyed
    ``codex-turn:turn-<turn_id>:prompt`` followed by a reply of that run. A prompt with no
    reply after it (the attempt died mid-turn) is not a mirrored turn: the turn runs again.
    """
    completed = completed_turn(session_file, turn_id)
    return dict(completed.reply) if completed is not None else None


def _recorded(
    turn_id: str, completed: CompletedTurn, *, executor_id: str, started: float
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
        ended_at=time.time(),
    )


#: A turn that finds its session held by another process (a direct ``run_codex_turn``
#: elsewhere, :class:`SessionBusy`) is tried again this many times in all, this far apart.
BUSY_ATTEMPTS = 3
BUSY_RETRY_S = 1.0


async def _run_turn(turn_id: str, wire: dict[str, Any]) -> dict[str, Any]:
    """Run the turn once (or find it already mirrored); its record as JSON values."""
    runtime = _current()
    runtime.in_flight += 1
    started = time.time()
    try:
        params = params_from_wire(wire)
        where = _note_run(runtime, session_lane(params))
        record = await _attempts(turn_id, params, runtime, started)
        try:
            locality, previous = await where
        except Exception as error:  # e.g. the thread pool was shut down meanwhile
            _log.warning("could not note where the turn ran", error=format_error(error))
            locality, previous = None, None
        return attrs.evolve(
            record, locality=locality, previous_executor_id=previous, ended_at=time.time()
        ).to_wire()
    finally:
        runtime.in_flight -= 1


async def _attempts(
    turn_id: str, params: TurnParams, runtime: WorkerRuntime, started: float
) -> TurnRecord:
    for attempt in range(1, BUSY_ATTEMPTS + 1):
        engine = runtime.engine_for(params)
        try:
            # The library decides "already ran?" under the session hold (exactly once even
            # when this attempt overlaps an earlier one still running the turn).
            result = await run_codex_turn(
                params,
                app_server=runtime.app_server,
                engine=engine,
                idempotency_key=turn_id,
            )
        except TurnAlreadyCompleted as done:
            # The attempt that mirrored it may have died before the engine's finalize.
            await catch_up_engine(params, engine, done.completed)
            return _recorded(
                turn_id, done.completed, executor_id=runtime.executor_id, started=started
            )
        except SessionBusy:
            if attempt == BUSY_ATTEMPTS:
                raise
            await anyio.sleep(BUSY_RETRY_S)
            continue
        record = record_of(turn_id, result, executor_id=runtime.executor_id)
        return attrs.evolve(record, started_at=started)
    raise AssertionError("unreachable")  # pragma: no cover


def _note_run(runtime: WorkerRuntime, lane: str) -> asyncio.Future[tuple[str | None, str | None]]:
    """Note, in a thread while the turn runs, that a turn of ``lane`` runs here; resolves to
    the locality and the previous worker (``None``s if the database could not say)."""
    note = runtime.note_run

    def run() -> tuple[str | None, str | None]:
        if note is None:
            return None, None
        try:
            return note(lane, runtime.executor_id)
        except Exception as error:
            _log.warning(
                "could not note where the turn runs",
                lane=mask_session_key(lane),
                error=format_error(error),
            )
            return None, None

    return asyncio.ensure_future(asyncio.to_thread(run))


@DBOS.workflow(name=WORKFLOW_NAME)
async def turn_workflow(turn_id: str, wire: dict[str, Any]) -> dict[str, Any]:
    """One queued turn (workflow id = turn id).

    No step inside: a step would checkpoint the record once, then DBOS the workflow's output
    (the same record) again, two commits and a read per turn for nothing. A workflow that
    dies before its output is written runs again from the start, exactly as a step that died
    before its checkpoint did, and the turn is idempotent by its id either way.
    """
    _announce_when_recorded(turn_id)
    return await _run_turn(turn_id, wire)


def _announce_when_recorded(turn_id: str) -> None:
    """Announce the end of the turn to waiting handles once DBOS wrote its outcome.

    DBOS runs a dequeued async workflow and then writes its outcome in one asyncio task, the
    task this workflow runs in: its end is the moment the outcome is durable. (Were it ever
    not, the announcement would come early or late: a waiting handle reads the database
    either way, so it is only ever a matter of latency.)"""
    task = asyncio.current_task()
    directory = _current().wake_directory
    if task is None or directory is None:
        return
    task.add_done_callback(lambda _task: announce(directory, turn_id))
