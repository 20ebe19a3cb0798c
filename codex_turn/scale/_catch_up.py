"""The engine's view of a turn recovered as already mirrored: :func:`catch_up_engine`.

A worker that dies after the turn's mirror and before the engine's finalize leaves a turn
whose reply is in the transcript but not in the engine. Its workflow, recovered, finds the
reply (:class:`~codex_turn.harness.idempotency.TurnAlreadyCompleted`) and returns it without
asking Codex again; before it does, this module runs what the orchestrator runs after the
mirror, for that turn: the finalize (``after_turn`` with the session up to the turn's reply
and the count of messages before its prompt, else ``ingest_batch``/``ingest`` of the turn's
messages) and then turn maintenance when the turn earned it, through the same lifecycle
helpers (:func:`~codex_turn.harness.lifecycle.finalize_context_engine_turn`), each call bounded
by ``engine_timeout``, under the session hold the turn takes (gate and lease). An engine
without ``bootstrap`` would otherwise never see that turn.

At least once, never twice in the engine: the finalize is handed exactly what the turn's own
finalize got (the transcript up to the turn's reply, the count of messages before its prompt),
so the turn has the same identity in the engine either way, and a storing engine adds
nothing for a turn it holds (the conformance checks ``reingest_adds_nothing`` and
``retried_after_turn_adds_nothing``; the reference engine keys ``after_turn`` by the turn's
messages' identities). That covers the turn finalized before the worker died (it died before
DBOS wrote the outcome), an attempt overlapping the recovered one, and a recovery recovered
in its turn. The turn's span is found by the transcript keys
:func:`~codex_turn.harness.idempotency.completed_turn` read (its prompt's and its reply's).

Never fails the turn: its reply is the result either way. What went wrong is logged as a
typed ``reason`` (``session_busy``, ``history_unreadable``, ``turn_not_in_history``,
``timed_out``, ``finalize_failed``, ``error``) with the engine id and the masked session key,
never content; the engine's own faults are logged by the lifecycle helpers.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Sequence
from typing import Any, Final, Literal, TypeVar

import anyio

from codex_turn._log import format_error, get_logger, sensitive
from codex_turn.harness._gates import SessionBusy, hold_session
from codex_turn.harness.durable_turns import commit_context_engine_turn, durable_engine
from codex_turn.harness.engine import (
    AgentMessage,
    engine_log_fields,
    is_active_engine,
    resolve_engine,
)
from codex_turn.harness.idempotency import CompletedTurn
from codex_turn.harness.lifecycle import (
    finalize_context_engine_turn,
    harness_runtime_context,
    run_context_engine_maintenance,
)
from codex_turn.harness.turn.context import stripped_histories
from codex_turn.harness.turn_api import TurnParams

__all__ = ["CatchUp", "catch_up_engine", "turn_span"]

_log = get_logger(__name__)

_T = TypeVar("_T")

#: What :func:`catch_up_engine` did: ``finalized`` (the engine has the turn), ``no_engine``,
#: or why not (logged as ``reason``).
CatchUp = Literal[
    "finalized",
    "no_engine",
    "session_busy",
    "history_unreadable",
    "turn_not_in_history",
    "timed_out",
    "finalize_failed",
    "error",
]

_NOT_CAUGHT_UP: Final = "recovered turn: context engine not brought up to date"


def turn_span(messages: Sequence[AgentMessage], completed: CompletedTurn) -> tuple[int, int] | None:
    """``(start, end)``: ``messages[start]`` is the turn's prompt, ``messages[end - 1]`` its
    reply (found by their transcript keys), or ``None`` when the history lacks either."""
    start = next(
        (i for i, m in enumerate(messages) if m.get("idempotencyKey") == completed.prompt_key),
        None,
    )
    if start is None:
        return None
    for index in range(start + 1, len(messages)):
        message = messages[index]
        if completed.reply_key is not None:
            if message.get("idempotencyKey") == completed.reply_key:
                return start, index + 1
        elif message == completed.reply:
            return start, index + 1
    return None


async def catch_up_engine(
    params: TurnParams, engine: object | None, completed: CompletedTurn
) -> CatchUp:
    """Hand the engine the recovered turn ``completed``, as the turn's finalize would have
    (module docstring). Never raises but for cancellation."""
    session_key = params.session_key or params.session_id
    fields = engine_log_fields(None, session_key)
    try:
        engine = resolve_engine(engine)  # the turn resolved it already: this only checks
        if not is_active_engine(engine):
            return "no_engine"
        fields = engine_log_fields(engine, session_key)
        with sensitive(params.prompt):  # an engine's error echoing the prompt is masked
            status = await _finalize(params, engine, completed)
    except SessionBusy:
        status = "session_busy"
    except Exception as error:
        _log.warning(_NOT_CAUGHT_UP, reason="error", error=format_error(error), **fields)
        return "error"
    if status == "finalized":
        _log.info("recovered turn: context engine brought up to date", **fields)
    else:
        _log.warning(_NOT_CAUGHT_UP, reason=status, **fields)
    return status


async def _finalize(params: TurnParams, engine: object, completed: CompletedTurn) -> CatchUp:
    session_file = os.fspath(params.session_file)
    session_key = params.session_key or params.session_id
    async with hold_session(
        session_file,
        lane=session_key,
        wait=params.concurrency,
        wait_timeout=params.session_wait_timeout,
    ):
        try:
            history = await anyio.to_thread.run_sync(stripped_histories.read, session_file)
        except Exception:
            return "history_unreadable"
        span = turn_span(history, completed)
        if span is None:  # e.g. compacted away since: nothing the turn's finalize would see
            return "turn_not_in_history"
        start, end = span
        context = harness_runtime_context(
            session_key=session_key,
            sandbox_session_key=params.sandbox_session_key,
            model=params.model,
            auth_profile_id=params.auth_profile_id,
            workspace_dir=os.fspath(params.workspace_dir),
            token_budget=params.context_token_budget,
            attempt=params.runtime_attempt,
        )
        if durable_engine(engine):
            # Durable turns: the turn's own commit, under its advancement key (the turn id);
            # ``duplicate`` when the turn's run, or its recovery, committed it already.
            committed = await _bounded(
                params,
                commit_context_engine_turn(
                    engine=engine,
                    advancement_key=completed.idempotency_key,
                    messages=history,
                    start=start,
                    end=end,
                    terminal="completed",
                    error=None,
                    session_id=params.session_id,
                    session_key=session_key,
                    session_file=session_file,
                    runtime_context=context,
                    token_budget=params.context_token_budget,
                ),
            )
            if committed is None:
                return "timed_out"
            if not committed.succeeded:
                return "finalize_failed"
            await _maintain(params, engine, session_file, session_key, context)
            return "finalized"
        finalized = await _bounded(
            params,
            finalize_context_engine_turn(
                engine=engine,
                session_id=params.session_id,
                session_key=session_key,
                session_file=session_file,
                messages_snapshot=history[:end],
                pre_prompt_message_count=start,
                prompt_error=False,  # the turn left a reply: it completed
                aborted=False,
                yield_aborted=False,
                token_budget=params.context_token_budget,
                runtime_context=context,
                run_maintenance=False,  # bounded on its own, as the turn's maintain stage
                is_heartbeat=params.heartbeat,
            ),
        )
        if finalized is None:
            return "timed_out"
        if not finalized.succeeded:
            return "finalize_failed"
        if finalized.maintenance_skip_reason is None:
            await _maintain(params, engine, session_file, session_key, context)
        return "finalized"


async def _maintain(
    params: TurnParams,
    engine: object,
    session_file: str,
    session_key: str,
    context: dict[str, Any],
) -> None:
    """Turn maintenance, bounded. No scheduler here: inline, as a worker's turn maintains
    (never fails the turn)."""
    await _bounded(
        params,
        run_context_engine_maintenance(
            engine=engine,
            reason="turn",
            session_id=params.session_id,
            session_key=session_key,
            session_file=session_file,
            runtime_context=context,
        ),
    )


async def _bounded(params: TurnParams, call: Awaitable[_T]) -> _T | None:
    """``call`` within ``engine_timeout`` (``None`` when it ran out), as the turn bounds it."""
    if params.engine_timeout is None:
        return await call
    with anyio.move_on_after(params.engine_timeout):
        return await call
    return None
