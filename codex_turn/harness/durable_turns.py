"""Durable turns, the host's side: admit, settle with ``commit_turn``, recover after a crash.

An engine that declares transcript semantics (:mod:`codex_turn.harness.engine.durable`) is
told of each logical turn once, atomically, under the turn's *advancement key*: the host's
idempotency key of the turn (the scale layer's turn id when queued; the host's message id;
else a key unique to the run), the same for every retry of the turn. The host keeps a durable
outbox of turns next to the transcript (:mod:`codex_turn.harness.outbox`; the moves are the
table's, :mod:`codex_turn.fsm.outbox`):

1. *Admit* (:func:`admit_turn`): before the prompt is written to the transcript and Codex
   sees it, in the same worker-thread hop, the entry is written ``admitted`` with the
   prompt's transcript key.
2. *Settle* (:func:`settle_turn`): after the run, from the transcript as the mirror left it,
   the entry goes ``accepted`` (with how the turn ended), then the engine's ``commit_turn``
   gets the turn (its admission, its terminal and messages, the session through it), and the
   entry goes ``ready`` (``committed`` or ``duplicate``: both success) or ``blocked``.
3. *Recover* (:func:`recover_pending_turns`, and the public :func:`recover_turns` for a
   host's start): every entry not settled, but the current turn's own, is settled from the
   transcript: a host killed between the reply and the commit commits on its next start or
   turn, and the engine's idempotency per key makes a commit the dead host did make answer
   ``duplicate``. Exactly once in the engine, never lost.

Where the turn is found: its prompt entry carries the key it was admitted with; the turn is
that entry and what follows it up to the next user message that is not one of its own
steered messages (as :func:`~codex_turn.harness.idempotency.completed_turn` reads it).

Failure policy, as every lifecycle call: an engine fault is logged once
(:func:`~codex_turn.harness.violations.engine_fault`) and becomes the outcome ``failed``
(the entry is ``blocked`` and retried); an outbox that cannot be written is logged and the
turn goes on. Nothing here raises to the turn but cancellation. Logs carry the engine id,
the masked session key, the advancement key and states, never message text.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import anyio
import attrs

from codex_turn._log import format_error, get_logger
from codex_turn.fsm.errors import IllegalTransition
from codex_turn.fsm.outbox import (
    COMMIT_TRIGGERS,
    OutboxState,
    OutboxTrigger,
    needs_settling,
)
from codex_turn.harness._fs import run_in_worker
from codex_turn.harness._gates import hold_session
from codex_turn.harness.engine.contract import AgentMessage, RuntimeContext
from codex_turn.harness.engine.durable import (
    COMMIT_TURN_METHOD,
    CommitTurnParams,
    CommitTurnResult,
    SessionTarget,
    TurnAdmission,
    TurnTerminal,
    declares_durable_turns,
)
from codex_turn.harness.engine.loading import resolve_engine
from codex_turn.harness.engine.validation import (
    coerce_result,
    engine_id,
    engine_info,
    engine_log_fields,
    is_active_engine,
    optional_method,
)
from codex_turn.harness.outbox import OutboxEntry, TurnOutbox
from codex_turn.harness.runtime_context import strip_runtime_context_messages
from codex_turn.harness.turn.context import stripped_histories
from codex_turn.harness.violations import engine_fault

__all__ = [
    "CommitOutcome",
    "RecoveryReport",
    "admit_turn",
    "commit_context_engine_turn",
    "durable_engine",
    "fence_history",
    "recover_pending_turns",
    "recover_turns",
    "settle_turn",
    "turn_span",
]

_log = get_logger(__name__)
_COMMIT_FAILED = "context engine commitTurn failed"


@attrs.frozen
class CommitOutcome:
    """How one ``commit_turn`` went: ``committed``, ``duplicate`` (success too) or
    ``failed`` (with the redacted error; the entry is then ``blocked``)."""

    status: Literal["committed", "duplicate", "failed"]
    error: str | None = None

    @property
    def succeeded(self) -> bool:
        return self.status != "failed"


@attrs.frozen
class RecoveryReport:
    """What a recovery did: the advancement keys it settled (committed or duplicate), those
    still blocked, and those abandoned (their prompt never reached the transcript)."""

    settled: tuple[str, ...] = ()
    duplicates: tuple[str, ...] = ()
    blocked: tuple[str, ...] = ()
    abandoned: tuple[str, ...] = ()


def durable_engine(engine: object | None) -> bool:
    """Whether ``engine`` is settled with ``commit_turn`` (an active engine that declares
    transcript semantics; ``check_engine`` made sure it has the method)."""
    return is_active_engine(engine) and declares_durable_turns(engine_info(engine))


# --- where a turn is in the transcript -------------------------------------------------------


def _steer_marker(prompt_key: str) -> str:
    """``:<identity>:steer-``: the turn's own steered messages' key part."""
    parts = prompt_key.rsplit(":", 2)
    identity = parts[-2] if len(parts) == 3 else prompt_key
    return f":{identity}:steer-"


def turn_span(messages: Sequence[AgentMessage], prompt_key: str | None) -> tuple[int, int] | None:
    """``(start, end)`` of the turn whose prompt carries ``prompt_key`` in ``messages``: its
    prompt at ``start``, its messages up to the next user message that is not one of its own
    steered ones (``end``, exclusive); ``None`` when no message carries the key."""
    if prompt_key is None:
        return None
    start = next((i for i, m in enumerate(messages) if m.get("idempotencyKey") == prompt_key), None)
    if start is None:
        return None
    marker = _steer_marker(prompt_key)
    end = start + 1
    while end < len(messages):
        message = messages[end]
        key = message.get("idempotencyKey")
        if message.get("role") == "user" and not (isinstance(key, str) and marker in key):
            break
        end += 1
    return start, end


def fence_history(messages: Sequence[AgentMessage], prompt_key: str | None) -> list[AgentMessage]:
    """The current-turn fence (``before-current-turn-entry-v1``): history *before* the
    current turn's entry. A retry of a turn whose first attempt made its prompt durable finds
    the prompt in the transcript already; it is cut, with whatever followed it."""
    span = turn_span(messages, prompt_key)
    return list(messages) if span is None else list(messages[: span[0]])


def _completed_in(turn: Sequence[AgentMessage]) -> bool:
    """A final answer (``...:assistant``) follows the prompt: the turn completed."""
    return any(
        m.get("role") == "assistant"
        and isinstance(m.get("idempotencyKey"), str)
        and m["idempotencyKey"].endswith(":assistant")
        for m in turn[1:]
    )


# --- the engine call -------------------------------------------------------------------------


async def commit_context_engine_turn(
    *,
    engine: object,
    advancement_key: str,
    messages: Sequence[AgentMessage],
    start: int,
    end: int,
    terminal: str,
    error: str | None,
    session_id: str,
    session_key: str | None,
    session_file: str,
    runtime_context: RuntimeContext | None = None,
    token_budget: int | None = None,
    is_heartbeat: bool = False,
) -> CommitOutcome:
    """``engine.commit_turn`` for the turn at ``messages[start:end]`` (its prompt first):
    the session through the turn, the admission, the terminal. Never raises an engine fault:
    it is logged and becomes ``failed``."""
    through = list(messages[:end])
    params = CommitTurnParams(
        advancement_key=advancement_key,
        admission=TurnAdmission(
            message=through[start], entry_key=through[start].get("idempotencyKey")
        ),
        terminal=TurnTerminal(
            status=terminal,  # type: ignore[arg-type]  # TERMINAL_OF_OUTCOME's values
            messages=through[start + 1 :],
            error=error,
        ),
        messages=through,
        pre_prompt_message_count=start,
        session_target=SessionTarget(
            session_id=session_id, session_file=session_file, session_key=session_key
        ),
        runtime_context=runtime_context,
        token_budget=token_budget,
        is_heartbeat=is_heartbeat,
    )
    try:
        commit = optional_method(engine, COMMIT_TURN_METHOD)
        if commit is None:
            raise TypeError("the engine has no commit_turn")
        returned = await commit(params)
        result = coerce_result(
            returned, CommitTurnResult, engine_id=engine_id(engine), method=COMMIT_TURN_METHOD
        )
    except Exception as err:
        text = engine_fault(
            _log,
            _COMMIT_FAILED,
            engine=engine,
            method=COMMIT_TURN_METHOD,
            error=err,
            session_key=session_key,
            advancement_key=advancement_key,
        )
        return CommitOutcome(status="failed", error=text)
    return CommitOutcome(status=result.status)


async def _bounded(call: Any, engine_timeout: float | None) -> CommitOutcome:
    """``call`` within ``engine_timeout`` (a commit that ran out failed: its entry is
    ``blocked``, and the engine's idempotency covers a commit that landed meanwhile)."""
    if engine_timeout is None:
        outcome: CommitOutcome = await call
        return outcome
    with anyio.move_on_after(engine_timeout):
        outcome = await call
        return outcome
    return CommitOutcome(status="failed", error="commit_turn timed out")


async def _fire(
    outbox: TurnOutbox, key: str, trigger: OutboxTrigger, **changes: Any
) -> OutboxEntry | None:
    """One outbox move in a worker thread; a write that fails is logged (the turn goes on:
    the entry stays as it was and is settled again later)."""
    try:
        return await run_in_worker(lambda: outbox.fire(key, trigger, **changes))
    except (OSError, IllegalTransition) as error:
        _log.warning("turn outbox write failed", trigger=str(trigger), error=format_error(error))
        return None


# --- admit, settle, recover ------------------------------------------------------------------


def admit_turn(session_file: str, advancement_key: str, prompt_key: str) -> OSError | None:
    """Write the turn's entry ``admitted`` (synchronous: the prompt's worker hop calls it just
    before writing the prompt). A failed write is returned, for the turn to log and go on
    with: its commit after the run does not need the entry, only a crash recovery does."""
    try:
        TurnOutbox.of(session_file).fire(
            advancement_key, OutboxTrigger.ADMITTED, prompt_key=prompt_key
        )
    except OSError as error:
        return error
    return None


async def settle_turn(
    *,
    engine: object,
    advancement_key: str,
    prompt_key: str | None,
    messages: Sequence[AgentMessage],
    fallback_start: int,
    terminal: str,
    error: str | None,
    session_id: str,
    session_key: str | None,
    session_file: str,
    runtime_context: RuntimeContext | None = None,
    token_budget: int | None = None,
    is_heartbeat: bool = False,
) -> CommitOutcome:
    """Settle the turn that just ran: ``accepted`` with its terminal, then ``commit_turn``,
    then ``ready`` or ``blocked``. ``messages`` is the session after the turn (the transcript
    as the mirror left it, stripped; else history + the turn); the turn is found by its
    prompt key, else taken to start at ``fallback_start`` and run to the end. The caller
    bounds it (the turn's ``engine_timeout``): an entry cut short stays ``accepted``, and is
    recovered."""
    messages = strip_runtime_context_messages(messages)
    span = turn_span(messages, prompt_key)
    if span is None:
        span = (max(0, min(fallback_start, len(messages) - 1)), len(messages))
    outbox = TurnOutbox.of(session_file)
    # None: the admission could not be written; the commit goes ahead without the entry.
    entry = await _fire(
        outbox, advancement_key, OutboxTrigger.RUN_RETURNED, terminal=terminal, error=error
    )
    outcome = await commit_context_engine_turn(
        engine=engine,
        advancement_key=advancement_key,
        messages=messages,
        start=span[0],
        end=span[1],
        terminal=terminal,
        error=error,
        session_id=session_id,
        session_key=session_key,
        session_file=session_file,
        runtime_context=runtime_context,
        token_budget=token_budget,
        is_heartbeat=is_heartbeat,
    )
    if entry is not None:
        await _fire(
            outbox,
            advancement_key,
            COMMIT_TRIGGERS[outcome.status],
            attempts=entry.attempts + 1,
        )
    return outcome


async def recover_pending_turns(
    *,
    engine: object,
    session_file: str,
    session_id: str,
    session_key: str | None,
    current_key: str | None = None,
    runtime_context: RuntimeContext | None = None,
    token_budget: int | None = None,
    engine_timeout: float | None = None,
) -> RecoveryReport:
    """Settle every outbox entry that needs it (:func:`~codex_turn.fsm.outbox.needs_settling`)
    from the transcript. The caller holds the session. ``current_key``: the advancement key
    of the turn about to run, whose ``admitted`` entry is its own to settle."""
    outbox = TurnOutbox.of(session_file)
    pending = [
        e
        for e in await run_in_worker(outbox.entries)
        if needs_settling(e.state, current=e.advancement_key == current_key)
    ]
    if not pending:
        return RecoveryReport()
    try:
        history = strip_runtime_context_messages(
            await run_in_worker(stripped_histories.read, session_file)
        )
    except Exception as error:
        _log.warning("turn recovery could not read the transcript", error=format_error(error))
        return RecoveryReport(blocked=tuple(e.advancement_key for e in pending))
    settled: list[str] = []
    duplicates: list[str] = []
    blocked: list[str] = []
    abandoned: list[str] = []
    for entry in pending:
        key = entry.advancement_key
        span = turn_span(history, entry.prompt_key)
        if span is None:
            if entry.state is OutboxState.ADMITTED:
                await _fire(outbox, key, OutboxTrigger.PROMPT_MISSING)
                abandoned.append(key)
            else:
                blocked.append(key)  # its prompt is gone (compacted away?): kept for a look
            continue
        terminal = entry.terminal
        if entry.state is OutboxState.ADMITTED:
            # The host died during the run: the turn ended as the transcript shows it.
            terminal = "completed" if _completed_in(history[span[0] : span[1]]) else "interrupted"
            await _fire(outbox, key, OutboxTrigger.RECOVERED, terminal=terminal)
        outcome = await _bounded(
            commit_context_engine_turn(
                engine=engine,
                advancement_key=key,
                messages=history,
                start=span[0],
                end=span[1],
                terminal=terminal or "interrupted",
                error=entry.error,
                session_id=session_id,
                session_key=session_key,
                session_file=session_file,
                runtime_context=runtime_context,
                token_budget=token_budget,
            ),
            engine_timeout,
        )
        await _fire(outbox, key, COMMIT_TRIGGERS[outcome.status], attempts=entry.attempts + 1)
        {"committed": settled, "duplicate": duplicates, "failed": blocked}[outcome.status].append(
            key
        )
    report = RecoveryReport(
        settled=tuple(settled),
        duplicates=tuple(duplicates),
        blocked=tuple(blocked),
        abandoned=tuple(abandoned),
    )
    _log.info(
        "durable turns recovered",
        **engine_log_fields(
            engine,
            session_key,
            committed=len(settled),
            duplicate=len(duplicates),
            blocked=len(blocked),
            abandoned=len(abandoned),
        ),
    )
    return report


async def recover_turns(
    session_file: str | os.PathLike[str],
    *,
    engine: object,
    session_id: str,
    session_key: str | None = None,
    token_budget: int | None = None,
    engine_timeout: float | None = 60.0,
    session_wait_timeout: float = 30.0,
) -> RecoveryReport:
    """Settle the turns a previous host left in the session's outbox, now (a host's start).

    Every turn does this itself before it runs; a host calls it at start to settle at once.
    Takes the session hold (waiting up to ``session_wait_timeout``); ``engine`` is an engine
    or a spec, checked as a turn checks it. An engine without durable turns has no outbox to
    settle: an empty report.
    """
    path = os.fspath(session_file)
    resolved = resolve_engine(engine, session_dir=os.path.dirname(path) or os.curdir)
    if not durable_engine(resolved):
        return RecoveryReport()
    key = session_key or session_id  # the key a turn binds the engine to
    async with hold_session(path, lane=key, wait="wait", wait_timeout=session_wait_timeout):
        return await recover_pending_turns(
            engine=resolved,
            session_file=path,
            session_id=session_id,
            session_key=key,
            token_budget=token_budget,
            engine_timeout=engine_timeout,
        )
