"""Carrying out a thread plan: one executor per thread action, chosen by a table.

Theory. The thread decision (:data:`codex_turn.fsm.thread.THREAD_RULES`) says *what* this
turn's thread is; :func:`codex_turn.fsm.thread.plan_thread` adds *how*, from the facts
gathered here once the prompt hooks have finalised the thread settings
(:class:`TurnPlanFacts`: what this app-server process holds of the base and of the fork kept
after the session's last turn). The starting_thread stage then looks the executor up in
:data:`EXECUTORS` by the plan's action and awaits it. An executor does the I/O the plan
names and returns the past-tense trigger that says what happened; it never chooses.

Errors are mapped once per kind of request (:func:`resume_refused`, :func:`fork_refused`): a
definitive answer from a live Codex about the thread (it cannot resume it, it refused the
fork or its items) is the step back to reprojecting that the turn table allows once
(``thread_resume_failed``/``fork_failed``); no answer (a timeout, a dead process) says
nothing about the thread, so the binding (the conversation) is kept and the turn fails
(``thread_start_failed``).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import attrs

from codex_turn._log import format_error
from codex_turn.fsm import TurnTrigger
from codex_turn.fsm.thread import (
    FORK_RULES,
    BaseAction,
    BaseFacts,
    Choice,
    ForkAction,
    ForkFacts,
    ThreadAction,
    ThreadPlan,
    decide,
    plan_thread,
)
from codex_turn.fsm.turn import THREAD_TRIGGERS
from codex_turn.harness._fs import run_in_worker
from codex_turn.harness.appserver import (
    AppServerError,
    AppServerRpcError,
    KeptFork,
    ThreadNotFound,
    ThreadResult,
    ThreadSettings,
    ToolRegistry,
)
from codex_turn.harness.binding import (
    HistoryCoverage,
    ProjectionBinding,
    ThreadBinding,
    clear_binding,
)
from codex_turn.harness.turn.context import (
    ThreadReady,
    TurnContext,
    current_projection,
    engine_binding,
    save_binding,
)
from codex_turn.harness.turn.continuity import covered_through
from codex_turn.harness.turn.forms import (
    TurnThreadFacts,
    item_key,
    release_kept_fork,
)
from codex_turn.harness.turn.structured import (
    ForkFailed,
    anchor_base,
    developer_item,
    fork_failure,
    kept_fork,
    prepare_fork,
    release_fork,
    supports_structured,
    take_kept_fork,
)

__all__ = ["EXECUTORS", "Executor", "TurnPlanFacts", "start_thread", "thread_settings"]

T = TurnTrigger

Executor = Callable[[TurnContext, ThreadPlan, ThreadSettings], Awaitable[TurnTrigger]]


def thread_settings(ctx: TurnContext) -> ThreadSettings:
    """The settings the thread is started, resumed or forked with (the prompt plan's
    instructions, after the hooks)."""
    assert ctx.plan is not None
    params = ctx.params
    # A supervised binding locks the model: its thread keeps the model and provider it
    # persisted, so nothing of the turn's is sent (Codex restores the pair on resume).
    supervised = ctx.binding is not None and bool(ctx.binding.supervised)
    return ThreadSettings(
        developer_instructions=ctx.plan.instructions,
        cwd=os.fspath(params.workspace_dir),
        model=None if supervised else params.model,
        tools=ToolRegistry(ctx.tools, catalog=params.tool_catalog),
        # The approval policy and sandbox are this turn's (turn/start): sent here they would
        # become the thread's defaults and outlive the turn (an auto-resume re-sends them).
        approvals_reviewer=params.approvals_reviewer,
        service_tier=params.service_tier,
        # A lightweight run starts its own (transient) thread without the project docs.
        project_docs=not params.lightweight,
        config=params.native_hooks.thread_config(params.approval_policy)
        if params.native_hooks is not None
        else None,
    )


# --- the facts of the plan --------------------------------------------------------------------


class TurnPlanFacts:
    """The facts :func:`~codex_turn.fsm.thread.plan_thread` reads (what this process holds of
    the base and of the fork kept for it), for ``settings``."""

    def __init__(self, ctx: TurnContext, settings: ThreadSettings) -> None:
        self._ctx, self._settings = ctx, settings
        self._key = settings.key

    @property
    def base(self) -> BaseFacts:
        ctx, bound = self._ctx, self._ctx.binding
        facts = TurnThreadFacts(ctx)
        return BaseFacts(
            base_bound=facts.base_bound,
            tools_match=facts.tools_match,
            engine_match=facts.engine_match,
            cwd_match=bound is not None and bound.cwd == self._settings.cwd,
        )

    def fork(self, base: Choice[BaseAction]) -> ForkFacts:
        """What the port keeps for the base, looked at without taking it (``kept_fork``: a
        port that cannot look has no fork to continue, and forks afresh)."""
        ctx, bound, port = self._ctx, self._ctx.binding, self._ctx.app_server
        if base.action is BaseAction.NEW or bound is None or not supports_structured(port):
            return ForkFacts()  # a new base has no fork kept for it
        kept = kept_fork(port, bound.thread_id)
        if kept is None:
            return ForkFacts()
        loaded = ctx.app_server.loaded_thread(kept.fork_thread_id)
        held = fork_context_keys(ctx)
        return ForkFacts(
            kept=loaded is not None,
            completed=kept.completed,
            compacted=loaded is not None and loaded.compacted,
            settings_match=kept.settings == self._key,
            extends=held[: len(kept.holds)] == kept.holds,
        )


def fork_context(ctx: TurnContext) -> list[dict[str, Any]]:
    """The items this turn's fork holds before its turn (the context, without the turn's
    instructions)."""
    projected = ctx.projected
    converted = projected.items if projected is not None else None
    return list(converted.items) if converted is not None else []


def fork_context_keys(ctx: TurnContext) -> tuple[str, ...]:
    return tuple(map(item_key, fork_context(ctx)))


# --- the stage --------------------------------------------------------------------------------


async def start_thread(ctx: TurnContext) -> TurnTrigger:
    """The starting_thread stage: plan how to obtain the thread, then carry the plan out."""
    assert ctx.plan is not None
    settings = thread_settings(ctx)
    plan = plan_thread(ctx.plan.decision, TurnPlanFacts(ctx, settings))
    return await EXECUTORS[plan.action](ctx, plan, settings)


def start_failed(ctx: TurnContext, error: AppServerError) -> TurnTrigger:
    """Codex could not start a thread: nothing reached it, the turn fails (the binding, if
    any, is as it was)."""
    ctx.log.warning("codex app-server thread start failed", error=format_error(error))
    ctx.start_error = format_error(error)
    return T.THREAD_START_FAILED


def resume_refused(ctx: TurnContext, error: AppServerError) -> TurnTrigger:
    """A live Codex answered that it cannot resume the thread (no such thread, or a rollout
    it cannot read): asking again gets the same answer, so the binding is worthless and the
    turn rotates. Anything else (a timeout, a dead process) keeps the binding."""
    if isinstance(error, AppServerRpcError):
        ctx.log.warning(
            "codex app-server thread resume failed; starting a new thread",
            error=format_error(error),
            definitive=isinstance(error, ThreadNotFound),
        )
        return T.THREAD_RESUME_FAILED
    ctx.log.warning(
        "codex app-server thread resume failed; keeping the binding", error=format_error(error)
    )
    ctx.start_error = format_error(error)
    return T.THREAD_START_FAILED


# --- resume -----------------------------------------------------------------------------------


async def resume(ctx: TurnContext, plan: ThreadPlan, settings: ThreadSettings) -> TurnTrigger:
    """Resume the bound thread (``thread/resume``: Codex loads it if need be and takes the
    turn's instructions and tools)."""
    bound, decision = ctx.binding, plan.decision
    assert bound is not None
    try:
        result = await ctx.app_server.resume_thread(bound.thread_id, settings)
    except AppServerError as error:
        return resume_refused(ctx, error)
    # The thread keeps the projection it carries (a matching epoch, or none); a resume
    # that kept the thread for want of context keeps the binding's engine record and
    # tools fingerprint, so the change still takes effect on the next turn with context.
    kept = bound.context_engine
    record, tools = kept, bound.dynamic_tools_fingerprint
    if decision.rebind:
        record = engine_binding(ctx, kept.projection if kept is not None else None)
        tools = ctx.tools_fingerprint
    binding = await save_binding(
        ctx,
        result,
        previous=bound,
        engine_record=record,
        tools_fingerprint=tools,
        coverage=bound.history_covered_through,
    )
    # The thread holds the transcript once Codex accepted this turn, when the turn carries
    # what it lacked (or it lacked nothing and the record is due to move forward).
    pending = covered_through(ctx.messages) if ctx.coverage.advance else None
    ctx.thread = ThreadReady(result=result, binding=binding, pending_coverage=pending)
    ctx.log = ctx.log.bind(thread_id=result.thread_id)
    ctx.log.info(
        "codex app-server thread resumed",
        reason=decision.reason,
        uncovered=len(ctx.coverage.uncovered),
    )
    return T.THREAD_RESUMED


# --- start, rotate, transient -----------------------------------------------------------------


async def _fresh_thread(
    ctx: TurnContext,
    plan: ThreadPlan,
    settings: ThreadSettings,
    *,
    bind: bool,
    retired: str | None = None,
) -> TurnTrigger:
    """Start a thread for this turn; ``bind``: it becomes the session's thread, replacing
    ``retired`` (whose local state is released once the new thread exists)."""
    decision = plan.decision
    try:
        result = await ctx.app_server.start_thread(settings)
    except AppServerError as error:
        return start_failed(ctx, error)
    if retired is not None:
        # The old thread runs no more turns: release what the client keeps for it.
        ctx.app_server.forget_thread(retired)
    binding: ThreadBinding | None = None
    pending: ProjectionBinding | None = None
    coverage: HistoryCoverage | None = None
    if bind:
        # A bootstrap epoch is recorded only once Codex accepted the turn that carries its
        # context (run_turn): recorded earlier, a failed turn/start would make the next turn
        # resume a thread that never received it (OpenClaw #88355). And only when this turn
        # does carry it: a projection that failed sent the raw prompt.
        # Nor when the transcript stood in for the engine's context (a failed projection).
        if ctx.projected is not None and decision.project and not decision.from_transcript:
            pending = current_projection(ctx)
        binding = await save_binding(
            ctx,
            result,
            previous=None,
            engine_record=engine_binding(ctx, None),
            tools_fingerprint=ctx.tools_fingerprint,
            # It holds nothing until Codex accepted the turn that carries the conversation:
            # a turn/start that fails leaves a thread the next turn catches up in full.
            coverage=_NOTHING_COVERED,
        )
        if binding is not None and ctx.history is not None:
            # The session's thread is now this one (an overflow retry rotates it).
            ctx.history = attrs.evolve(ctx.history, binding=binding)
        coverage = covered_through(ctx.messages)
    ctx.thread = ThreadReady(
        result=result, binding=binding, pending_projection=pending, pending_coverage=coverage
    )
    ctx.log = ctx.log.bind(thread_id=result.thread_id)
    trigger = THREAD_TRIGGERS[decision.action]
    ctx.log.info(
        "codex app-server thread " + ("rotated" if trigger is T.THREAD_ROTATED else "started"),
        reason=decision.reason,
    )
    return trigger


async def start(ctx: TurnContext, plan: ThreadPlan, settings: ThreadSettings) -> TurnTrigger:
    """A session without a thread: start one and bind it."""
    return await _fresh_thread(ctx, plan, settings, bind=True)


async def transient(ctx: TurnContext, plan: ThreadPlan, settings: ThreadSettings) -> TurnTrigger:
    """A thread for this turn only: the binding keeps the tooled thread."""
    return await _fresh_thread(ctx, plan, settings, bind=False)


async def rotate(ctx: TurnContext, plan: ThreadPlan, settings: ThreadSettings) -> TurnTrigger:
    """Replace the bound thread with a fresh one."""
    bound = ctx.binding
    assert bound is not None  # the thread table rotates only a bound session
    await _clear_binding_quietly(ctx)
    release_kept_fork(ctx, bound.thread_id)  # no turn forks that base again
    return await _fresh_thread(ctx, plan, settings, bind=True, retired=bound.thread_id)


async def _clear_binding_quietly(ctx: TurnContext) -> None:
    """A binding is an optimisation: failing to remove one never fails a turn."""
    try:
        await run_in_worker(clear_binding, ctx.session_file)
    except Exception as error:
        ctx.log.warning("failed to clear codex app-server binding", error=format_error(error))


# --- fork ---------------------------------------------------------------------------------------

_FORK_BASE: Final = ProjectionBinding(mode="fork_base", epoch="fork-base")
_NOTHING_COVERED: Final = HistoryCoverage(messages=0)


async def _bound_base(ctx: TurnContext, settings: ThreadSettings) -> str | TurnTrigger:
    bound = ctx.binding
    assert bound is not None
    return bound.thread_id


async def _new_base(ctx: TurnContext, settings: ThreadSettings) -> str | TurnTrigger:
    """Start a base, anchor it and bind it: its id, or the trigger of the failure."""
    bound, port = ctx.binding, ctx.app_server
    assert supports_structured(port)
    try:
        # Neutral instructions: a fork inherits its base's initial context, so the
        # turn's instructions go into each fork instead (they may change every turn).
        neutral = attrs.evolve(settings, developer_instructions=None)
        started = await ctx.app_server.start_thread(neutral)
    except AppServerError as error:
        return start_failed(ctx, error)
    try:
        # A rollout, so that this process and any later one can fork it.
        await anchor_base(port, started.thread_id)
    except AppServerError as error:
        port.forget_thread(started.thread_id)
        return fork_refused(ctx, fork_failure("anchor", error))
    # The base never runs a turn here: nothing of it is kept locally (tools, memo).
    port.forget_thread(started.thread_id)
    binding = await save_binding(
        ctx,
        started,
        previous=None,
        engine_record=engine_binding(ctx, _FORK_BASE),
        tools_fingerprint=ctx.tools_fingerprint,
        coverage=None,  # a base holds no conversation: every turn's fork is given it
    )
    if bound is not None and bound.thread_id != started.thread_id:
        port.forget_thread(bound.thread_id)  # it runs no more turns
        release_kept_fork(ctx, bound.thread_id)
    if ctx.history is not None and binding is not None:
        # The session's thread is now the new base (a refused fork retires it).
        ctx.history = attrs.evolve(ctx.history, binding=binding)
    return started.thread_id


#: Where each base decision gets the base thread from.
BASES: Final[
    Mapping[BaseAction, Callable[[TurnContext, ThreadSettings], Awaitable[str | TurnTrigger]]]
] = {BaseAction.BOUND: _bound_base, BaseAction.NEW: _new_base}


@attrs.frozen
class Forked:
    """The fork the turn runs in, how many items went into it, and the fork table's reason."""

    thread: ThreadResult
    injected: int
    reason: str


async def _fresh_fork(
    ctx: TurnContext, how: Choice[ForkAction], base_id: str, settings: ThreadSettings
) -> Forked | TurnTrigger:
    """Fork ``base_id`` afresh and inject the whole context and the turn's instructions
    (a fork kept for it is released: it holds what this turn must not see)."""
    port = ctx.app_server
    assert supports_structured(port)
    kept = take_kept_fork(port, base_id)
    if kept is not None:
        release_fork(port, kept.fork_thread_id)
    context = fork_context(ctx)
    assert ctx.plan is not None
    if ctx.plan.instructions:
        context.append(developer_item(ctx.plan.instructions))
    # The turn's instructions are in the context (a developer item): the fork's are neutral.
    neutral = attrs.evolve(settings, developer_instructions=None)
    prepared = await prepare_fork(port, base_id, context, neutral)
    if isinstance(prepared, ForkFailed):
        return fork_refused(ctx, prepared)
    return Forked(prepared.thread, prepared.injected, how.reason)


async def _continued_fork(
    ctx: TurnContext, how: Choice[ForkAction], base_id: str, settings: ThreadSettings
) -> Forked | TurnTrigger:
    """Inject what follows the kept fork's content (the turn's instructions are in it
    already: the fork table continues only a fork made with the same ones) and bind this
    turn's tool handlers to it. A fork Codex no longer knows (its process was replaced
    meanwhile) is an answer about the fork, not the base: the fork table, told that no fork
    is kept, forks the base afresh."""
    port = ctx.app_server
    assert supports_structured(port)
    kept = take_kept_fork(port, base_id)
    assert kept is not None  # the fork table continues only a kept fork Codex still holds
    loaded = ctx.app_server.loaded_thread(kept.fork_thread_id)
    assert loaded is not None
    tail = fork_context(ctx)[len(kept.holds) :]
    try:
        if tail:
            await port.inject_items(kept.fork_thread_id, tail)
    except ThreadNotFound:
        release_fork(port, kept.fork_thread_id)
        lost = decide(FORK_RULES, ForkFacts())
        return await FORKS[lost.action](ctx, lost, base_id, settings)
    except AppServerError as error:
        release_fork(port, kept.fork_thread_id)
        return fork_refused(ctx, fork_failure("inject", error, kept.fork_thread_id))
    except BaseException:
        release_fork(port, kept.fork_thread_id)  # cancelled: nobody will run this fork
        raise
    if ctx.tools:
        ctx.app_server.bind_tools(kept.fork_thread_id, ctx.tools)
    return Forked(loaded.result, len(tail), how.reason)


#: How each fork decision obtains the fork.
FORKS: Final[
    Mapping[
        ForkAction,
        Callable[
            [TurnContext, Choice[ForkAction], str, ThreadSettings],
            Awaitable[Forked | TurnTrigger],
        ],
    ]
] = {ForkAction.NEW: _fresh_fork, ForkAction.CONTINUE: _continued_fork}


async def fork(ctx: TurnContext, plan: ThreadPlan, settings: ThreadSettings) -> TurnTrigger:
    """Run the turn in a fork of the session's base thread (the base table says which: the
    bound one, or a new one started, anchored and bound), this turn's context and
    instructions injected into the idle fork (or the kept fork continued, as the fork table
    says). Codex refusing the fork is ``fork_failed`` (the text frame follows); no answer
    (a timeout, a dead process) fails the turn like any thread start, the binding kept."""
    base, how = plan.base, plan.fork
    assert base is not None
    assert how is not None
    base_id = await BASES[base.action](ctx, settings)
    if isinstance(base_id, TurnTrigger):
        return base_id
    forked = await FORKS[how.action](ctx, how, base_id, settings)
    if isinstance(forked, TurnTrigger):
        return forked
    result = forked.thread
    projected = ctx.projected
    record = KeptFork(
        base_thread_id=base_id,
        fork_thread_id=result.thread_id,
        holds=fork_context_keys(ctx),
        settings=settings.key,
        completed=False,
        memo=projected.conversion if projected is not None else None,
    )
    ctx.thread = ThreadReady(result=result, binding=ctx.binding, fork=record)
    ctx.log = ctx.log.bind(thread_id=result.thread_id)
    ctx.log.info(
        "codex app-server thread forked",
        reason=plan.decision.reason,
        base=base.reason,
        fork=forked.reason,
        items=forked.injected,
        source="transcript" if plan.decision.from_transcript else "assembly",
    )
    return T.THREAD_FORKED


def fork_refused(ctx: TurnContext, failed: ForkFailed) -> TurnTrigger:
    if not failed.definitive:
        # No answer says nothing about the base: keep the binding, fail this turn.
        ctx.log.warning(
            "codex structured projection fork failed; keeping the binding",
            step=failed.step,
            error=failed.error,
        )
        ctx.start_error = failed.error
        return T.THREAD_START_FAILED
    ctx.log.warning(
        "codex structured projection fork failed; using the text frame",
        step=failed.step,
        error=failed.error,
    )
    return T.FORK_FAILED


#: The executor of every thread action.
EXECUTORS: Final[Mapping[ThreadAction, Executor]] = {
    ThreadAction.START: start,
    ThreadAction.ROTATE: rotate,
    ThreadAction.TRANSIENT: transient,
    ThreadAction.RESUME: resume,
    ThreadAction.FORK: fork,
}
