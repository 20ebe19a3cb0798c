"""The turn as a DBOS workflow: one durable step that runs :func:`run_codex_turn`.

Why one step. DBOS checkpoints a step's result once it returns; a worker that dies inside a
step has the step run again (at least once, as in every durable engine). Every effect of a
turn is made idempotent by the turn id instead of being split into steps:

* the prompt is made durable before ``turn/start`` under an identity derived from the turn id
  (``run_codex_turn(..., idempotency_key=turn_id)``), keyed independently of the thread, so a
  re-run appends it once even on another worker's thread (the mirror skips a key it holds);
* a re-run finds the turn in the transcript: ``run_codex_turn`` looks, *under the session
  hold* and before any stage, for the reply of an earlier attempt (the worker died between the
  mirror and the checkpoint, or the attempt was still running when the re-run started: the
  re-run waits for its hold first) and raises
  :class:`~codex_turn.harness.idempotency.TurnAlreadyCompleted`; that reply is the result and
  Codex is not asked again (:func:`mirrored_turn` reads the same decision);
* the thread binding and the engine's ``after_turn`` hold the whole session, so they converge.

The workflow reaches the process's app-server and engine through the worker's
:class:`WorkerRuntime` (installed by :class:`~codex_turn.scale.TurnWorker`): they are live
objects of this process, never stored in the database.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import attrs
from dbos import DBOS

from codex_turn.harness._gates import SessionBusy
from codex_turn.harness.appserver import AppServerPort
from codex_turn.harness.idempotency import CompletedTurn, TurnAlreadyCompleted, completed_turn
from codex_turn.harness.orchestrator import run_codex_turn
from codex_turn.harness.turn_api import TurnParams
from codex_turn.scale._wire import TurnRecord, params_from_wire, record_of

__all__ = [
    "APP_NAME",
    "APP_VERSION",
    "QUEUE_NAME",
    "WORKFLOW_NAME",
    "WorkerRuntime",
    "install_runtime",
    "mirrored_turn",
]

#: The DBOS application every client and worker of codex-turn names.
APP_NAME = "codex-turn"
#: Fixed, so a restarted worker recovers the turns its predecessor left pending even when the
#: code changed in between (DBOS recovers only workflows of its own application version).
#: Bump it when the workflow's steps change incompatibly.
APP_VERSION = "codex-turn-scale-1"
WORKFLOW_NAME = "codex_turn.scale.turn"
QUEUE_NAME = "codex_turn_turns"


@attrs.define(eq=False)
class WorkerRuntime:
    """What this process's turns run on: one app-server and the engine of a turn."""

    app_server: AppServerPort
    engine_for: Callable[[TurnParams], object | None]
    executor_id: str
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


def _busy(error: BaseException) -> bool:
    # Another holder of the session (a direct run_codex_turn elsewhere): worth waiting again.
    return isinstance(error, SessionBusy)


@DBOS.step(
    name="codex_turn.scale.run_turn",
    retries_allowed=True,
    max_attempts=3,
    interval_seconds=1.0,
    should_retry=_busy,
)
async def run_turn_step(turn_id: str, wire: dict[str, Any]) -> dict[str, Any]:
    """Run the turn once (or find it already mirrored); its record as JSON values."""
    runtime = _current()
    runtime.in_flight += 1
    started = time.time()
    try:
        params = params_from_wire(wire)
        try:
            # The library decides "already ran?" under the session hold (exactly once even
            # when this attempt overlaps an earlier one still running the turn).
            result = await run_codex_turn(
                params,
                app_server=runtime.app_server,
                engine=runtime.engine_for(params),
                idempotency_key=turn_id,
            )
        except TurnAlreadyCompleted as done:
            return _recorded(
                turn_id, done.completed, executor_id=runtime.executor_id, started=started
            ).to_wire()
        record = record_of(turn_id, result, executor_id=runtime.executor_id)
        return attrs.evolve(record, started_at=started, ended_at=time.time()).to_wire()
    finally:
        runtime.in_flight -= 1


@DBOS.workflow(name=WORKFLOW_NAME)
async def turn_workflow(turn_id: str, wire: dict[str, Any]) -> dict[str, Any]:
    """One queued turn (workflow id = turn id): its one durable step."""
    return await run_turn_step(turn_id, wire)
