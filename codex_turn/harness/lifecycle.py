"""Harness-neutral lifecycle helpers: the engine calls of one turn, and nothing else.

A runner (the turn orchestrator, or any other harness) calls these in order; each one knows
*how* to make one lifecycle call and what to do when the engine misbehaves, and none of them
knows anything about Codex. The order and the branch decisions live in the turn machine
(``codex_turn.fsm.turn``); these helpers do the work of a stage and report what happened as an
*outcome* whose ``trigger`` is the turn machine's past-tense trigger for that stage.

    bootstrap_context_engine       only with a session file that existed before the turn;
                                   bootstrap() then maintenance(reason="bootstrap")
    assemble_context_engine        assemble(messages, budget, tool names, citations, model,
                                   prompt), hidden runtime-context messages stripped, result
                                   validated
    finalize_context_engine_turn   after_turn(full snapshot) > ingest_batch(new) > ingest(each
                                   new message, continuing past failures); then
                                   maintenance(reason="turn") when the turn earned it
    run_context_engine_maintenance maintain(), inline or scheduled on a BackgroundMaintenance
    build_runtime_context[_from_usage]  the open bag of host facts an engine receives

Semantics are OpenClaw's (reference/openclaw-contract.md 2.2, 2.3, 2.6, 2.9), with two choices
made on purpose: finalize runs for failed and aborted turns too (PR-era; only maintenance is
gated, so an engine sees every turn that ran, bug #121515), and Codex's input token count is
*not* added to its cached-token count (:class:`TokenUsage`).

Failure policy
--------------
An engine is a plugin and must never break a turn. Every engine exception (``Exception``, never
cancellation) is caught here, logged once as a warning with OpenClaw's message and a redacted
``error`` field (:func:`codex_turn._log.format_error`, never the exception object), and turned
into an outcome. Nothing is raised to the runner except cancellation and misuse of these
functions themselves. Log lines carry facts (engine id, masked session key, counts, reason),
never prompts, transcript text, tool arguments or the runtime context.

Each fallback point hands the caught fault to
:func:`~codex_turn.harness.violations.engine_fault`, the one place that decides whether it was
a *contract violation* (the engine's mistake) or an *operational fault* (the log line says so
in ``contract_violation``); results the lifecycle tolerates although the contract forbids them
(``bootstrap`` returning ``None``, ``after_turn`` returning a value, a malformed ``ingest`` or
``ingest_batch`` result) are reported by
:func:`~codex_turn.harness.violations.tolerated_violation` and change nothing here. Violations
are collected by the run's :func:`~codex_turn.harness.violations.watch_contract`; a strict run
raises the first one once it ended (``TurnParams.strict``). The helpers themselves never raise
for an engine fault, strict or not.

No engine
---------
``engine=None`` and the legacy engine (id ``"legacy"``) are *no engine*: every helper returns a
"skipped" outcome without touching the engine, so Codex sees exactly what it would without this
library.

Decisions
---------
None here. Whether a stage runs is the turn machine's (``codex_turn.fsm.turn``): the guards
``may_bootstrap`` and ``maintenance_allowed`` and the fact ``background_maintenance``. The
public helpers below are harness-neutral entry points for other runners; where they skip,
they ask the same functions the guards read (:func:`~codex_turn.fsm.turn.bootstrap_skip_reason`,
:func:`~codex_turn.fsm.turn.maintenance_skip_reason`), so there is one decider. Maintenance
and its scheduler live in :mod:`codex_turn.harness.maintenance` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final, Literal

import attrs

from codex_turn._log import get_logger
from codex_turn.fsm.turn import (
    ASSEMBLE_TRIGGERS,
    BOOTSTRAP_TRIGGERS,
    FINALIZE_TRIGGERS,
    SkipReason,
    TurnTrigger,
    bootstrap_skip_reason,
    maintenance_skip_reason,
)
from codex_turn.harness.engine.contract import (
    AfterTurnParams,
    AgentMessage,
    AssembleParams,
    AssembleResult,
    BootstrapParams,
    BootstrapResult,
    IngestBatchParams,
    IngestBatchResult,
    IngestParams,
    IngestResult,
    InvalidEngineResult,
    RuntimeContext,
    TranscriptReadFence,
)
from codex_turn.harness.engine.shapes import json_type_name
from codex_turn.harness.engine.validation import (
    coerce_result,
    engine_id,
    engine_log_fields,
    ensure_assemble_result,
    is_active_engine,
    optional_method,
)
from codex_turn.harness.maintenance import (
    BackgroundMaintenance,
    MaintenanceOutcome,
    MaintenanceReason,
    ScheduleResult,
    TranscriptRewriter,
    call_maintenance,
    run_context_engine_maintenance,
)
from codex_turn.harness.runtime_context import (
    RUNTIME_CONTEXT_CUSTOM_TYPE,
    RuntimeContextFree,
    build_runtime_context,
    build_runtime_context_from_usage,
    harness_runtime_context,
    strip_runtime_context_messages,
)
from codex_turn.harness.violations import engine_fault, tolerated_violation

__all__ = [
    "ASSEMBLE_FAILED_WARNING",
    "RUNTIME_CONTEXT_CUSTOM_TYPE",
    "AssembleFacts",
    "AssembleOutcome",
    "BackgroundMaintenance",
    "BootstrapOutcome",
    "FinalizeOutcome",
    "MaintenanceOutcome",
    "MaintenanceReason",
    "RuntimeContextFree",
    "ScheduleResult",
    "TranscriptRewriter",
    "assemble_context_engine",
    "bootstrap_context_engine",
    "build_runtime_context",
    "build_runtime_context_from_usage",
    "call_bootstrap",
    "dispose_context_engine",
    "finalize_context_engine_turn",
    "harness_runtime_context",
    "run_context_engine_maintenance",
    "strip_runtime_context_messages",
]

_log = get_logger("codex_turn.harness.lifecycle")


# OpenClaw's log messages (reference 2.1-2.9); variable parts go into fields.
ASSEMBLE_FAILED_WARNING: Final = "context engine assemble failed; using Codex baseline prompt"
_BOOTSTRAP_FAILED: Final = "context engine bootstrap failed"
_AFTER_TURN_FAILED: Final = "context engine afterTurn failed"
_INGEST_FAILED: Final = "context engine ingest failed"


# --- Outcomes -------------------------------------------------------------------------------


@attrs.frozen
class AssembleFacts:
    """The host's facts of a turn that :class:`AssembleParams` carries beyond the original
    contract (the same names; see there)."""

    model_id: str | None = None
    provider_id: str | None = None
    requested_model_id: str | None = None
    fallback_reason: str | None = None
    degraded_reason: str | None = None
    sandboxed: bool | None = None
    runtime_context: RuntimeContext | None = None
    transcript_read_fence: TranscriptReadFence | None = None


@attrs.frozen
class BootstrapOutcome:
    status: Literal["bootstrapped", "failed", "skipped"]
    result: BootstrapResult | None = None
    error: str | None = None
    maintenance: MaintenanceOutcome | None = None
    #: Why it was skipped: ``no_engine``, ``no_session_file`` or ``no_bootstrap_or_maintain``.
    skip_reason: str | None = None

    @property
    def trigger(self) -> TurnTrigger:
        """The turn machine's trigger for this outcome (``fsm.turn.BOOTSTRAP_TRIGGERS``)."""
        return BOOTSTRAP_TRIGGERS[self.status]


@attrs.frozen
class AssembleOutcome:
    status: Literal["assembled", "failed", "skipped"]
    result: AssembleResult | None = None
    error: str | None = None

    @property
    def trigger(self) -> TurnTrigger:
        """The turn machine's trigger for this outcome (``fsm.turn.ASSEMBLE_TRIGGERS``)."""
        return ASSEMBLE_TRIGGERS[self.status]


@attrs.frozen
class FinalizeOutcome:
    """OpenClaw's ``{postTurnFinalizationSucceeded}``, plus what was called and why not more."""

    succeeded: bool
    #: Which engine path ran: ``after_turn``, ``ingest_batch``, ``ingest``, ``nothing_new``
    #: (no new messages and no after_turn) or ``skipped`` (no engine).
    path: Literal["after_turn", "ingest_batch", "ingest", "nothing_new", "skipped"]
    #: New messages handed to the engine (after_turn: the messages after the pre-prompt count).
    new_message_count: int = 0
    #: Failed calls (after_turn / ingest_batch: 0 or 1; ingest: one per failed message).
    failures: int = 0
    #: Why turn maintenance did not run (``None`` when it ran, was deferred, or was not asked).
    maintenance_skip_reason: SkipReason | None = None
    maintenance: MaintenanceOutcome | None = None

    @property
    def trigger(self) -> TurnTrigger:
        """The turn machine's trigger for this outcome (``fsm.turn.FINALIZE_TRIGGERS``)."""
        return FINALIZE_TRIGGERS[self.succeeded]


# --- Bootstrap ------------------------------------------------------------------------------


async def bootstrap_context_engine(
    *,
    engine: object | None,
    session_id: str,
    session_key: str | None,
    session_file: str,
    had_session_file: bool,
    runtime_context: RuntimeContext | None = None,
    transcript_rewriter: TranscriptRewriter | None = None,
) -> BootstrapOutcome:
    """``bootstrap()`` then maintenance(reason="bootstrap"), for sessions that already existed.

    Skipped without an active engine, when the session file did not exist before this turn
    wrote anything (a brand-new session has nothing to reconcile), or when the engine has
    neither ``bootstrap`` nor ``maintain``. Maintenance runs even for a maintain-only engine.
    The runner re-reads history afterwards: bootstrap may have written to the transcript.
    """
    skip = bootstrap_skip_reason(
        engine_active=is_active_engine(engine),
        had_session_file=had_session_file,
        has_bootstrap=optional_method(engine, "bootstrap") is not None,
        has_maintain=optional_method(engine, "maintain") is not None,
    )
    if skip is not None:
        return BootstrapOutcome(status="skipped", skip_reason=skip)
    return await call_bootstrap(
        engine=engine,
        session_id=session_id,
        session_key=session_key,
        session_file=session_file,
        runtime_context=runtime_context,
        transcript_rewriter=transcript_rewriter,
    )


async def call_bootstrap(
    *,
    engine: object,
    session_id: str,
    session_key: str | None,
    session_file: str,
    runtime_context: RuntimeContext | None = None,
    transcript_rewriter: TranscriptRewriter | None = None,
) -> BootstrapOutcome:
    """``bootstrap()`` (when the engine has it) then maintenance(reason="bootstrap"), now.

    No decision here: the caller knows the engine may bootstrap (the guard ``may_bootstrap``).
    """
    bootstrap = optional_method(engine, "bootstrap")
    result: BootstrapResult | None = None
    try:
        if bootstrap is not None:
            raw = await bootstrap(
                BootstrapParams(
                    session_id=session_id, session_key=session_key, session_file=session_file
                )
            )
            if raw is None:
                # Tolerated as "bootstrapped, nothing to report"; the contract wants a result.
                tolerated_violation(
                    _log,
                    engine=engine,
                    method="bootstrap",
                    problem="expected a BootstrapResult (got null)",
                    session_key=session_key,
                )
            else:
                result = coerce_result(
                    raw, BootstrapResult, engine_id=engine_id(engine), method="bootstrap"
                )
    except Exception as err:
        error = engine_fault(
            _log,
            _BOOTSTRAP_FAILED,
            engine=engine,
            method="bootstrap",
            error=err,
            session_key=session_key,
        )
        return BootstrapOutcome(status="failed", error=error)
    maintenance = await call_maintenance(
        engine=engine,
        reason="bootstrap",
        session_id=session_id,
        session_key=session_key,
        session_file=session_file,
        runtime_context=runtime_context,
        transcript_rewriter=transcript_rewriter,
    )
    return BootstrapOutcome(status="bootstrapped", result=result, maintenance=maintenance)


# --- Assemble -------------------------------------------------------------------------------


async def assemble_context_engine(
    *,
    engine: object | None,
    session_id: str,
    session_key: str | None,
    messages: Sequence[AgentMessage],
    token_budget: int | None = None,
    available_tools: Iterable[str] | None = None,
    citations_mode: str | None = None,
    model: str | None = None,
    prompt: str | None = None,
    facts: AssembleFacts | None = None,
    is_heartbeat: bool = False,
) -> AssembleOutcome:
    """Ask the engine for this turn's context; a failure means "use the baseline prompt".

    ``messages`` is the mirrored history (hidden runtime-context messages are stripped here);
    ``available_tools`` the names of the dynamic tools built for this turn (pass an empty
    iterable when tools are disabled: the engine then knows there are none); ``prompt`` the raw
    user prompt; ``facts`` the host's further facts of the turn (model and provider ids,
    fallback and degraded reasons, sandbox, runtime context, transcript read fence). An
    exception or an invalid result (:class:`InvalidEngineResult`) is logged as OpenClaw's
    ``"context engine assemble failed; using Codex baseline prompt"``.
    """
    if not is_active_engine(engine):
        return AssembleOutcome(status="skipped")
    params = AssembleParams(
        session_id=session_id,
        session_key=session_key,
        messages=strip_runtime_context_messages(messages),
        token_budget=token_budget,
        available_tools=(
            None if available_tools is None else frozenset(n for n in available_tools if n)
        ),
        citations_mode=citations_mode or None,
        model=model,
        prompt=prompt,
        **(attrs.asdict(facts, recurse=False) if facts is not None else {}),
        is_heartbeat=is_heartbeat,
    )
    try:
        assemble = optional_method(engine, "assemble")
        if assemble is None:
            raise InvalidEngineResult(engine_id(engine), "assemble", "the engine has no assemble")
        returned = await assemble(params)
        result = ensure_assemble_result(returned, engine_id=engine_id(engine))
    except Exception as err:
        error = engine_fault(
            _log,
            ASSEMBLE_FAILED_WARNING,
            engine=engine,
            method="assemble",
            error=err,
            session_key=session_key,
        )
        return AssembleOutcome(status="failed", error=error)
    return AssembleOutcome(status="assembled", result=result)


# --- Finalize -------------------------------------------------------------------------------


async def finalize_context_engine_turn(
    *,
    engine: object | None,
    session_id: str,
    session_key: str | None,
    session_file: str,
    messages_snapshot: Sequence[AgentMessage],
    pre_prompt_message_count: int,
    prompt_error: bool,
    aborted: bool,
    yield_aborted: bool,
    token_budget: int | None = None,
    runtime_context: RuntimeContext | None = None,
    is_heartbeat: bool = False,
    run_maintenance: bool = True,
    scheduler: BackgroundMaintenance | None = None,
    transcript_rewriter: TranscriptRewriter | None = None,
    snapshot_is_fallback: bool = False,
) -> FinalizeOutcome:
    """Hand the finished turn to the engine, then maintain if the turn earned it.

    ``messages_snapshot`` is the whole session after the turn; its first
    ``pre_prompt_message_count`` messages existed before the turn. Hidden runtime-context
    messages are stripped from each side separately, so the count stays right. The engine
    gets, in order of preference: ``after_turn`` (full snapshot and count), ``ingest_batch``
    (the new messages), or ``ingest`` once per new message (a failure does not stop the loop).
    This runs for failed and aborted turns too; maintenance(reason="turn") then runs only
    when there was no prompt error, no abort, no yield abort and finalize succeeded.
    ``run_maintenance=False`` leaves that decision to the caller (a runner whose state machine
    decides; :attr:`FinalizeOutcome.maintenance_skip_reason` is still computed).
    ``snapshot_is_fallback`` says the mirror failed and the snapshot is history + this turn.
    """
    if not is_active_engine(engine):
        return FinalizeOutcome(
            succeeded=True, path="skipped", maintenance_skip_reason=SkipReason.NO_ENGINE
        )
    if snapshot_is_fallback:
        _log.info(
            "context engine finalizing from fallback snapshot (mirror failed)",
            **engine_log_fields(engine, session_key),
        )
    count = max(0, min(pre_prompt_message_count, len(messages_snapshot)))
    messages: list[AgentMessage]
    if isinstance(messages_snapshot, RuntimeContextFree):  # already stripped: no rescan
        # One copy (the engine's own list), not three: the split is only its count.
        messages, before_count = strip_runtime_context_messages(messages_snapshot), count
    else:
        before = strip_runtime_context_messages(messages_snapshot[:count])
        messages, before_count = (
            before + strip_runtime_context_messages(messages_snapshot[count:]),
            len(before),
        )
    new = messages[before_count:]

    succeeded = True
    failures = 0
    after_turn = optional_method(engine, "after_turn")
    ingest_batch = optional_method(engine, "ingest_batch")
    path: Literal["after_turn", "ingest_batch", "ingest", "nothing_new"]
    if after_turn is not None:
        path = "after_turn"
        try:
            returned = await after_turn(
                AfterTurnParams(
                    session_id=session_id,
                    session_key=session_key,
                    session_file=session_file,
                    messages=messages,
                    pre_prompt_message_count=before_count,
                    is_heartbeat=is_heartbeat,
                    token_budget=token_budget,
                    runtime_context=runtime_context,
                )
            )
        except Exception as err:
            succeeded, failures = False, 1
            engine_fault(
                _log,
                _AFTER_TURN_FAILED,
                engine=engine,
                method="after_turn",
                error=err,
                session_key=session_key,
            )
        else:
            if returned is not None:
                tolerated_violation(
                    _log,
                    engine=engine,
                    method="after_turn",
                    problem=f"expected null (got {json_type_name(returned)})",
                    session_key=session_key,
                )
    elif not new:
        path = "nothing_new"
    elif ingest_batch is not None:
        path = "ingest_batch"
        try:
            batch = await ingest_batch(
                IngestBatchParams(
                    session_id=session_id,
                    session_key=session_key,
                    messages=new,
                    is_heartbeat=is_heartbeat,
                )
            )
        except Exception as err:
            succeeded, failures = False, 1
            engine_fault(
                _log,
                _INGEST_FAILED,
                engine=engine,
                method="ingest_batch",
                error=err,
                session_key=session_key,
            )
        else:
            _check_tolerated(engine, "ingest_batch", batch, IngestBatchResult, session_key)
    else:
        path = "ingest"
        ingest = optional_method(engine, "ingest")
        for index, message in enumerate(new):
            try:
                if ingest is None:
                    raise InvalidEngineResult(
                        engine_id(engine), "ingest", "the engine has no ingest"
                    )
                ingested = await ingest(
                    IngestParams(
                        session_id=session_id,
                        session_key=session_key,
                        message=message,
                        is_heartbeat=is_heartbeat,
                    )
                )
            except Exception as err:
                succeeded = False
                failures += 1
                engine_fault(
                    _log,
                    _INGEST_FAILED,
                    engine=engine,
                    method="ingest",
                    error=err,
                    session_key=session_key,
                    message_index=index,
                )
            else:
                _check_tolerated(engine, "ingest", ingested, IngestResult, session_key)

    skip = maintenance_skip_reason(
        engine_active=is_active_engine(engine),
        engine_maintains=optional_method(engine, "maintain") is not None,
        prompt_error=prompt_error,
        aborted=aborted,
        yield_aborted=yield_aborted,
        finalize_failed=not succeeded,
    )
    maintenance: MaintenanceOutcome | None = None
    if skip is None and run_maintenance:
        maintenance = await run_context_engine_maintenance(
            engine=engine,
            reason="turn",
            session_id=session_id,
            session_key=session_key,
            session_file=session_file,
            runtime_context=runtime_context,
            transcript_rewriter=transcript_rewriter,
            scheduler=scheduler,
        )
    return FinalizeOutcome(
        succeeded=succeeded,
        path=path,
        new_message_count=len(new),
        failures=failures,
        maintenance_skip_reason=skip,
        maintenance=maintenance,
    )


# --- Dispose --------------------------------------------------------------------------------


async def dispose_context_engine(engine: object | None) -> bool:
    """Call ``engine.dispose()`` if it has one; log and swallow failures. True when it ran."""
    dispose = optional_method(engine, "dispose")
    if dispose is None:
        return False
    try:
        await dispose()
    except Exception as err:
        engine_fault(
            _log,
            "context engine dispose failed",
            engine=engine,
            method="dispose",
            error=err,
            session_key=None,
        )
        return False
    return True


def _check_tolerated(
    engine: object, method: str, value: object, cls: type[object], session_key: str | None
) -> None:
    """A result the lifecycle ignores, checked only to report a contract violation."""
    try:
        coerce_result(value, cls, engine_id=engine_id(engine), method=method)
    except InvalidEngineResult as err:
        tolerated_violation(
            _log, engine=engine, method=method, problem=err.problem, session_key=session_key
        )
