"""The turn orchestrator: :func:`run_codex_turn` drives one turn through the turn machine.

Theory of operation. The turn machine (:mod:`codex_turn.fsm.turn`) is the turn: its table
says where a turn goes after each stage, under which facts, and how a stage cut short ends.
This module runs it on the one driver every table machine runs on
(:func:`codex_turn.harness.driver.drive`)::

    while not turn.is_terminal:
        turn.fire(await STAGES[turn.state](ctx))

(each step is also shown to the host's ``TurnHooks.on_transition`` observer). ``STAGES``
gives every non-final state its row: the stage (:mod:`codex_turn.harness.turn.stages`), an
async function that does the I/O of that state and returns the past-tense trigger saying
what happened, and its *shelter*. Stages never fire, never read the trace and never choose the
next state; the loop never branches on a stage's result. The one thing a stage may report
besides its result is an *in-state* event (Codex's native compaction during running_turn)
through ``ctx.emit``, which accepts internal edges only (the state cannot change). The
shelter is the part of a stage's behaviour that depends on the caller rather than the turn,
declared per state in ``STAGES`` and applied by the driver:

* ``CANCELLABLE`` (the pre-Codex states): the caller's cancellation ends the stage with the
  trigger the table names for a stage cut short (``cancelled``), and the turn ends ``failed``;
* ``SELF`` (running_turn): the stage itself catches the cancellation (the client interrupts
  Codex on the way out) and ends the turn as aborted; the loop goes on;
* ``PROTECTED`` (mirroring, finalizing): once a turn ran, its mirror and finalize always run,
  shielded (in one child task for both: the driver shelters a stretch of consecutive states
  alike at once); unbounded while the caller waits, bounded by ``cleanup_timeout`` once the
  caller is gone (one deadline shared by both stages), then ended with the table's cut-short
  trigger (``mirror_failed``/``finalize_failed``). The user's words and the engine's view of
  the turn are never lost to a cancellation (OpenClaw #121515);
* ``UNLESS_GONE`` (maintaining): maintenance does not start, or is cut, once the caller is
  gone (and reports ``cancelled``); a deferral to the scheduler never blocks, so it is handed
  over all the same.

The caller's cancellation is re-raised after the result is delivered to ``on_turn_end``.
Each engine call is bounded by ``engine_timeout``: a hung engine takes its stage's failure
edge instead of holding the session.

Concurrency: a turn holds its session (``_gates``, shared with compaction) for its whole
duration: the in-process gate and the cross-process lease, OpenClaw's session lock file. A
second turn on the same session file, in this process or another, waits
(``concurrency="wait"``, bounded by ``session_wait_timeout``) or is refused with
:class:`~codex_turn.SessionBusy`; deferred maintenance waits too.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import anyio

from codex_turn._log import format_error, get_logger, mask_session_key, sensitive
from codex_turn.fsm import (
    IllegalTransition,
    TurnFacts,
    TurnModel,
    TurnOutcome,
    TurnState,
    TurnTrigger,
)
from codex_turn.harness._fs import pinned_session_path, run_in_worker
from codex_turn.harness._gates import hold_session
from codex_turn.harness.appserver import AppServerPort, DynamicTool
from codex_turn.harness.collaboration import HeartbeatRecorder, heartbeat_tool
from codex_turn.harness.driver import Caller, Row, Shelter, drive, stage_table, step
from codex_turn.harness.durable_turns import durable_engine, recover_pending_turns
from codex_turn.harness.engine import EngineHandle, engine_id, resolve_engine
from codex_turn.harness.hooks import TurnHooks
from codex_turn.harness.host_llm import host_capabilities
from codex_turn.harness.idempotency import (
    CompletedTurn,
    TurnAlreadyCompleted,
    advancement_key_for,
    completed_turn,
    message_turn_key,
)
from codex_turn.harness.maintenance import BackgroundMaintenance
from codex_turn.harness.observations import Observations
from codex_turn.harness.runtime_context import harness_runtime_context
from codex_turn.harness.turn import context as turn_context
from codex_turn.harness.turn import stages
from codex_turn.harness.turn.engine_tools import offered_tools
from codex_turn.harness.turn.stages import TurnContext
from codex_turn.harness.turn.steering import LiveTurn
from codex_turn.harness.turn.streaming import TurnEventStream
from codex_turn.harness.turn_api import (
    TURN_START_TEXT_MAX_CHARS,
    InvalidTurnParams,
    MaintenanceReport,
    TurnParams,
    TurnResult,
    state_durations_ms,
)
from codex_turn.harness.violations import watch_contract

__all__ = [
    "STAGES",
    "TURN_START_TEXT_MAX_CHARS",
    "InvalidTurnParams",
    "MaintenanceReport",
    "TurnParams",
    "TurnResult",
    "run_codex_turn",
]

_log = get_logger(__name__)

S = TurnState
T = TurnTrigger


# --- the stages -----------------------------------------------------------------------------

#: The stage of every non-final state, and its shelter (what the caller's leaving does to it,
#: applied by :func:`~codex_turn.harness.driver.drive`).
STAGES: Mapping[TurnState, Row[TurnContext, TurnTrigger]] = stage_table(
    TurnModel,
    {
        S.IDLE: Row(stages.begin),
        S.READING_HISTORY: Row(stages.read_history, Shelter.CANCELLABLE),
        S.BOOTSTRAPPING: Row(stages.bootstrap, Shelter.CANCELLABLE),
        S.ASSEMBLING: Row(stages.assemble, Shelter.CANCELLABLE),
        S.PROJECTING: Row(stages.project, Shelter.CANCELLABLE),
        S.BUILDING_PROMPT: Row(stages.build_prompt, Shelter.CANCELLABLE),
        S.STARTING_THREAD: Row(stages.start_thread, Shelter.CANCELLABLE),
        S.REPROJECTING: Row(stages.reproject, Shelter.CANCELLABLE),
        # The stage interrupts Codex itself and ends the turn as aborted.
        S.RUNNING_TURN: Row(stages.run_turn, Shelter.SELF),
        S.MIRRORING: Row(stages.mirror, Shelter.PROTECTED),
        S.FINALIZING: Row(stages.finalize, Shelter.PROTECTED),
        # A deferral to the scheduler never blocks: it is handed over all the same.
        S.MAINTAINING: Row(
            stages.maintain, Shelter.UNLESS_GONE, still_runs_if=T.MAINTENANCE_DEFERRED
        ),
    },
)

#: What the turn's records say of a stage cut short, beyond its trigger: a maintenance that
#: did not start, or was cut, reports ``cancelled``.
_CUT_SHORT_REPORTS: Mapping[TurnState, MaintenanceReport] = {
    S.MAINTAINING: MaintenanceReport(status="cancelled"),
}


def _caller(ctx: TurnContext, turn: TurnModel) -> Caller[TurnTrigger]:
    """The shelters' view of the turn's caller: its leaving is recorded on ``ctx`` (where
    running_turn records the cancellation it catches itself)."""

    def cut_short() -> TurnTrigger:
        trigger = ctx.cut_short()
        assert trigger is not None, "every sheltered state names its cut-short trigger"
        ctx.log.info("codex turn stage cut short", trigger=str(trigger))
        ctx.maintenance = _CUT_SHORT_REPORTS.get(turn.state, ctx.maintenance)
        return trigger

    return Caller(record=ctx, cleanup_timeout=ctx.params.cleanup_timeout, cut_short=cut_short)


# --- the turn -------------------------------------------------------------------------------


async def run_codex_turn(
    params: TurnParams,
    *,
    app_server: AppServerPort,
    engine: object | None = None,
    tools: Sequence[DynamicTool] = (),
    hooks: TurnHooks | None = None,
    maintenance_scheduler: BackgroundMaintenance | None = None,
    on_turn_end: Callable[[TurnResult], Awaitable[None]] | None = None,
    idempotency_key: str | None = None,
    events: TurnEventStream | None = None,
) -> TurnResult:
    """Run one turn of a Codex session through the turn machine (see the module docstring).

    ``engine`` is an engine object, a spec ``"package.module:attribute"`` (loaded by
    :func:`~codex_turn.harness.engine.load_engine`), or ``None``. Returns the
    :class:`TurnResult` for every outcome that reached a decision, including failed, aborted
    and timed-out turns. Raises, before anything is read, written or sent,
    :class:`~codex_turn.EngineLoadError` for a spec that yields no engine and
    :class:`~codex_turn.EngineContractError` for an object that is not an engine; raises
    :class:`~codex_turn.SessionBusy` when another turn holds the session file
    (``concurrency="reject"``, or the wait timed out), and, before anything is sent,
    :class:`~codex_turn.harness.engine.EngineToolConflict` when the engine offers a tool
    whose name one of ``tools`` has. With ``params.strict``, the engine's
    first contract violation is raised as :class:`~codex_turn.EngineContractViolation` after
    the turn ended and ``on_turn_end`` saw its result. A cancellation of the caller
    propagates after the shielded cleanup; ``on_turn_end`` sees the result in that case too.

    ``idempotency_key`` is the host's stable id of this turn (at most 128 characters of
    ``[A-Za-z0-9._-]``): a re-run of the same turn after a crash (a durable queue retrying it)
    passes the same key, and its prompt, already made durable by the first run on the same
    thread, is not written again. Once that turn's reply is in the transcript, a re-run with
    the key raises :class:`~codex_turn.harness.idempotency.TurnAlreadyCompleted` (carrying the
    recorded reply) after taking the session hold and before anything is written or sent to
    Codex. ``None``: derived from the host's message id (``runtime_attempt``'s
    ``currentMessageId``, see :func:`~codex_turn.harness.idempotency.message_turn_key`) when
    there is one, else a run-unique identity.

    ``events``: a :class:`~codex_turn.harness.turn.streaming.TurnEventStream` the runner iterates
    meanwhile (state changes, deltas, tool calls, plans, compactions, steered messages, saved
    files); it never slows the turn, and ends with it. While the turn runs, messages for its
    session go to :func:`~codex_turn.harness.turn.steering.steer_codex_turn`
    (``params.steering``).
    """
    session_file = os.fspath(params.session_file)
    live = LiveTurn(mode=params.steering, quiet_interval=params.steer_quiet_interval, events=events)
    # live.ending() closes the event stream however the call ends, a refusal included.
    if idempotency_key is None:
        # The host's message id decides that a message delivered twice is one turn.
        idempotency_key = message_turn_key(params.runtime_attempt)
    with watch_contract(strict=params.strict) as contract, live.ending():
        prompt_identity = turn_context.prompt_identity_for(idempotency_key)  # before any I/O
        # Before the gate and any I/O: refused at once (a factory gets the session's directory;
        # an engine that needs what this host cannot offer is refused here, before any turn).
        engine = resolve_engine(
            engine,
            session_dir=os.path.dirname(session_file) or os.curdir,
            host=host_capabilities(app_server),
        )
        # The session file's canonical name, resolved once: the gate, the lease, the
        # preflight, the binding and the mirror of this turn all key on it.
        with pinned_session_path(session_file):
            async with hold_session(
                session_file,
                lane=params.session_key or params.session_id,
                wait=params.concurrency,
                wait_timeout=params.session_wait_timeout,
            ):
                completed = None
                if idempotency_key is not None:
                    # Under the hold, before any stage: a re-run that overlapped the attempt that
                    # completed this turn waited for it above, and now finds its reply.
                    completed = await run_in_worker(completed_turn, session_file, idempotency_key)
                if durable_engine(engine):
                    # Turns an earlier host left unsettled are committed first (this one's own
                    # too when its reply is there already: it will not run again).
                    with sensitive(params.prompt):
                        await _recover(params, engine, session_file, prompt_identity, completed)
                if completed is not None:
                    raise TurnAlreadyCompleted(completed)
                with sensitive(params.prompt), live.serving(session_file):
                    ctx, turn = await prepare_turn(
                        params,
                        session_file=session_file,
                        app_server=app_server,
                        engine=engine,
                        tools=tools,
                        hooks=live.observe(hooks or TurnHooks()),
                        scheduler=maintenance_scheduler,
                    )
                    ctx.prompt_identity = prompt_identity
                    ctx.live = live
                    # Observers run beside the turn; its end waits for them (bounded).
                    async with ctx.observations.running():
                        result = await _drive(ctx, turn, on_turn_end)
        contract.raise_first(result)  # strict: the typed error, once the turn is delivered
        return result


async def _recover(
    params: TurnParams,
    engine: object,
    session_file: str,
    prompt_identity: str,
    completed: CompletedTurn | None,
) -> None:
    """Settle the outbox's pending turns before this one runs (durable turns)."""
    await recover_pending_turns(
        engine=engine,
        session_file=session_file,
        session_id=params.session_id,
        session_key=params.session_key or params.session_id,
        current_key=None if completed is not None else advancement_key_for(prompt_identity),
        runtime_context=harness_runtime_context(
            session_key=params.session_key or params.session_id,
            sandbox_session_key=params.sandbox_session_key,
            model=params.model,
            auth_profile_id=params.auth_profile_id,
            workspace_dir=os.fspath(params.workspace_dir),
            token_budget=params.context_token_budget,
            attempt=params.runtime_attempt,
        ),
        token_budget=params.context_token_budget,
        engine_timeout=params.engine_timeout,
    )


def _engine_handle(engine: object | None) -> EngineHandle | None:
    """The engine's handle for the turn (:func:`run_codex_turn` checked the engine, its
    ``info`` included, before any I/O); ``None`` runs the turn as plain Codex."""
    handle = EngineHandle.of(engine)
    if engine is not None and handle is None:
        # OpenClaw bug #77185/#971: an engine silently not in use looks like "memory ignored".
        _log.warning(
            "context engine selected but not active for this turn", engine=engine_id(engine)
        )
    return handle


async def prepare_turn(
    params: TurnParams,
    *,
    session_file: str,
    app_server: AppServerPort,
    engine: object | None,
    tools: Sequence[DynamicTool],
    hooks: TurnHooks,
    scheduler: BackgroundMaintenance | None,
) -> tuple[TurnContext, TurnModel]:
    handle = _engine_handle(engine)
    # had_session_file is decided before this turn writes anything (reference 2.1 step 4).
    # Only the bootstrap guard reads it, and only for an engine that bootstraps (or
    # maintains): for any other turn the worker-thread hop of the stat is not taken.
    had_session_file = False
    if handle is not None and (handle.capabilities.bootstrap or handle.capabilities.maintain):
        try:
            had_session_file = (await anyio.Path(session_file).stat()) is not None
        except FileNotFoundError:
            had_session_file = False
    facts = TurnFacts.gather(
        engine_active=handle is not None,
        had_session_file=had_session_file,
        has_bootstrap=handle is not None and handle.capabilities.bootstrap,
        has_maintain=handle is not None and handle.capabilities.maintain,
        maintenance_mode=handle.info.turn_maintenance_mode if handle is not None else "",
        has_scheduler=scheduler is not None,
    )
    turn = TurnModel.begin(facts)
    switch = turn_context.YieldSwitch()
    log = _log.bind(
        session_id=params.session_id,
        session_key=mask_session_key(params.session_key),
        engine=handle.id if handle is not None else None,
    )
    dynamic_tools = list(tools)
    if params.yield_tool:
        dynamic_tools.append(turn_context.yield_tool(switch))
    heartbeat = HeartbeatRecorder()
    if params.heartbeat:
        dynamic_tools.append(heartbeat_tool(heartbeat))
    # The engine's tools join the host's (and count in the tools fingerprint with them).
    dynamic_tools += await offered_tools(
        handle,
        session_id=params.session_id,
        session_key=params.session_key or params.session_id,
        host_names={t.name for t in dynamic_tools},
        timeout=params.engine_timeout,
        log=log,
    )
    context = TurnContext(
        params=params,
        app_server=app_server,
        engine=handle,
        hooks=hooks,
        scheduler=scheduler,
        tools=dynamic_tools,
        facts=facts,
        session_file=session_file,
        log=log,
        may=turn.allows,
        emit=_internal_only(turn, hooks),
        outcome=lambda: turn.outcome,
        cut_short=turn.cut_short_trigger,
        turn=turn,
        switch=switch,
        heartbeat=heartbeat,
    )
    context.observations = Observations(timeout=params.observer_timeout, log=context.log)
    return context, turn


def _internal_only(turn: TurnModel, hooks: TurnHooks) -> Callable[[TurnTrigger], None]:
    """``emit`` for the stages: in-state events only; a stage cannot move the turn."""

    def emit(trigger: TurnTrigger) -> None:
        if turn.machine.select(turn, str(trigger)).dest is not None:
            raise IllegalTransition(turn.state_name, str(trigger), why="not an in-state event")
        step(turn, trigger, hooks.on_transition)

    return emit


async def _drive(
    ctx: TurnContext,
    turn: TurnModel,
    on_turn_end: Callable[[TurnResult], Awaitable[None]] | None,
) -> TurnResult:
    started = time.monotonic()
    try:
        await drive(turn, STAGES, ctx, observe=ctx.hooks.on_transition, caller=_caller(ctx, turn))
        result = _result(ctx, turn)
        if result.maintenance.status == "skipped" and turn.state is S.DONE:
            ctx.log.info(
                "codex context engine maintenance skipped", reason=result.maintenance.skip_reason
            )
        if ctx.cancellation is None:
            await _deliver(ctx, result, on_turn_end)
            if ctx.refusal is not None:
                raise ctx.refusal  # the typed error (the runner's on_turn_end saw the result)
            return result
        # The caller is gone: the host's callback still sees the result, within the cleanup
        # bound (a hung callback must not hold the session).
        with anyio.CancelScope(shield=True) as delivery:
            delivery.deadline = anyio.current_time() + ctx.params.cleanup_timeout
            await _deliver(ctx, result, on_turn_end)
        if delivery.cancelled_caught:
            ctx.log.warning("on_turn_end callback cut short", seconds=ctx.params.cleanup_timeout)
        raise ctx.cancellation
    finally:
        turn.close()
        if ctx.log.is_enabled_for(logging.INFO):  # its fields cost a walk of the trace
            ctx.log.info(
                "codex turn finished",
                state=turn.state_name,
                outcome=turn.outcome.value if turn.outcome else None,
                skip_reason=turn.skip_reason.value if turn.skip_reason else None,
                native_compactions=turn.native_compactions,
                duration_ms=round((time.monotonic() - started) * 1000, 1),
                # From the trace, never a second result: that would take the collected
                # messages the turn's own result has to carry.
                durations_ms={k: round(v, 2) for k, v in state_durations_ms(turn.trace).items()},
            )


def _result(ctx: TurnContext, turn: TurnModel) -> TurnResult:
    codex = ctx.ran.codex if ctx.ran is not None else None
    outcome = turn.outcome or TurnOutcome.CANCELLED
    prompt_error = codex.prompt_error if codex is not None else ctx.start_error
    if outcome is TurnOutcome.THREAD_START_FAILED and prompt_error is None:
        prompt_error = "codex app-server thread start failed"
    maintenance = ctx.maintenance or MaintenanceReport(
        status="skipped", skip_reason=turn.skip_reason.value if turn.skip_reason else None
    )
    return TurnResult(
        outcome=outcome,
        assistant_text=codex.final_text if codex is not None else None,
        prompt_error=prompt_error,
        usage=codex.usage if codex is not None else None,
        thread_id=ctx.thread_id,
        turn_id=codex.turn_id if codex is not None else None,
        messages_snapshot=list(codex.messages_snapshot) if codex is not None else [],
        maintenance=maintenance,
        thread_decision=ctx.plan.decision if ctx.plan is not None else None,
        projected=ctx.plan is not None and ctx.plan.projected,
        native_compactions=turn.native_compactions,
        trace=tuple(turn.trace),
        mirror_error=ctx.mirror.error if ctx.mirror is not None else None,
        files=tuple(ctx.live.files) if ctx.live is not None else (),
        steered=tuple(m.text for m in ctx.live.steered) if ctx.live is not None else (),
        heartbeat=ctx.heartbeat.response,
        collected=ctx.live.take_collected() if ctx.live is not None else (),
    )


async def _deliver(
    ctx: TurnContext,
    result: TurnResult,
    on_turn_end: Callable[[TurnResult], Awaitable[None]] | None,
) -> TurnResult:
    if on_turn_end is not None:
        try:
            await on_turn_end(result)
        except Exception as error:
            ctx.log.warning("on_turn_end callback failed", error=format_error(error))
    return result
