"""The stages of a turn: for each state of the turn machine, the I/O it does.

Theory of operation. :mod:`codex_turn.harness.orchestrator` drives a turn as a dispatch loop
over ``STAGES`` (h2's ``stream.py`` shape): every stage here is an async function of the
:class:`TurnContext` that does the work of *one* state and returns the past-tense trigger that
says what happened. A stage never fires a trigger, never reads the trace and never chooses
where the turn goes; the turn table (:mod:`codex_turn.fsm.turn`) and the thread table
(:mod:`codex_turn.fsm.thread`) do. Where a stage applies only under some facts (bootstrap,
assemble), it asks the table (``ctx.may(trigger)``), it does not re-derive the guard.

What flows between stages is one small frozen record per stage result, set once in its slot
of the context (:class:`HistoryRead`, :class:`Assembled`, :class:`Projected`,
:class:`PromptPlan`, :class:`ThreadReady`, :class:`CodexRan`, :class:`Mirrored`); reprojecting
replaces the prompt plan, and running the turn refines the thread record once Codex accepted
its input. Errors from below are mapped once, here, into triggers: an engine or hook failure
is a logged fallback, never a failed turn.

Order (OpenClaw's, reference 2.1): the dynamic tools are built first (assemble sees their
names); ``had_session_file`` is decided before anything is written (a fact of the turn); read
history; bootstrap and re-read; assemble; project (``system_prompt_addition`` appended to the
base instructions); the thread decision, then before_prompt_build hooks on the prompt it
chose; start/resume/rotate with the final developer instructions (re-sent on resume with the
runtime policy, ``personality: "none"``); run the turn; mirror the RAW prompt and Codex's
reply; finalize from the re-read transcript (or history + snapshot when the mirror failed);
maintain inline, defer, or skip, as the table says.
"""

from __future__ import annotations

import collections
import os
import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import anyio
import attrs

from codex_turn._log import format_error
from codex_turn.fsm import TurnFacts, TurnOutcome, TurnTrigger
from codex_turn.fsm.thread import ThreadAction, ThreadDecision, ThreadFacts, decide_thread
from codex_turn.fsm.turn import RunEnd, run_end_trigger
from codex_turn.harness.appserver import (
    AppServer,
    AppServerClosed,
    AppServerError,
    CodexTurnResult,
    CodexTurnStatus,
    DynamicTool,
    Notification,
    ThreadResult,
    TurnProjector,
)
from codex_turn.harness.appserver.types import unstructure
from codex_turn.harness.binding import (
    ContextEngineBinding,
    ProjectionBinding,
    ThreadBinding,
    ThreadDecisionRecord,
    clear_binding,
    context_engine_policy_fingerprint,
    read_binding,
    write_binding,
)
from codex_turn.harness.engine import AgentMessage, AssembleResult, EngineHandle
from codex_turn.harness.hooks import (
    CompactionHookEvent,
    PromptBuildContext,
    PromptBuildResult,
    TurnHooks,
    compose_prompt,
    join_sections,
    run_before_prompt_build,
)
from codex_turn.harness.lifecycle import (
    ASSEMBLE_FAILED_WARNING,
    BackgroundMaintenance,
    RuntimeContextFree,
    assemble_context_engine,
    call_bootstrap,
    finalize_context_engine_turn,
    harness_runtime_context,
    strip_runtime_context_messages,
)
from codex_turn.harness.maintenance import (
    MaintenanceOutcome,
    ScheduleResult,
    call_maintenance,
    defer_maintenance,
)
from codex_turn.harness.session import MessageHistory, load_session_context, mirror_turn
from codex_turn.harness.turn_api import TURN_START_TEXT_MAX_CHARS, MaintenanceReport, TurnParams
from codex_turn.harness.usage import Usage
from codex_turn.projection import (
    CodexContextProjection,
    dynamic_tools_fingerprint,
    fingerprints_compatible,
    frame_context,
    max_rendered_context_chars,
    project_context_engine_assembly,
    project_thread_bootstrap_assembly,
    truncate_older,
)

__all__ = ["Stage", "TurnContext"]

_T = TypeVar("_T")
_NO_TOOLS: Final = dynamic_tools_fingerprint(())
YIELD_TOOL: Final = "sessions_yield"

T = TurnTrigger


# --- what flows between stages --------------------------------------------------------------


@attrs.frozen
class HistoryRead:
    """The mirrored history (stripped of hidden runtime context) and the thread binding."""

    messages: list[AgentMessage]
    binding: ThreadBinding | None


@attrs.frozen
class Assembled:
    result: AssembleResult

    @property
    def bootstrap_epoch(self) -> str | None:
        """The epoch of a ``thread_bootstrap`` assembly (non-blank), else ``None``."""
        mode = self.result.context_projection
        if mode is None or mode.mode != "thread_bootstrap" or not mode.epoch:
            return None
        return mode.epoch if mode.epoch.strip() else None


@attrs.frozen
class Projected:
    projection: CodexContextProjection


@attrs.frozen
class PromptPlan:
    """The thread decision and the final prompt and instructions it was built for."""

    decision: ThreadDecision
    prompt: str
    instructions: str | None
    hook_result: PromptBuildResult
    projected: bool  # the prompt carries the engine's framed context


@attrs.frozen
class ThreadReady:
    result: ThreadResult
    binding: ThreadBinding | None
    #: A thread_bootstrap projection to record once Codex accepted this turn's input.
    pending_projection: ProjectionBinding | None = None

    @property
    def thread_id(self) -> str:
        return self.result.thread_id


@attrs.frozen
class CodexRan:
    codex: CodexTurnResult


@attrs.frozen
class Mirrored:
    ok: bool


@attrs.define(eq=False)
class YieldSwitch:
    """The ``sessions_yield`` tool's link into the running turn (an event from Codex, so it
    is the one mutable piece: the tool sets it while the turn runs)."""

    requested: bool = False
    live_handle: Any = None


@attrs.define(eq=False)
class TurnContext:
    """One turn's inputs, read-only, and one slot per stage record."""

    params: TurnParams
    app_server: AppServer
    engine: EngineHandle | None
    hooks: TurnHooks
    scheduler: BackgroundMaintenance | None
    tools: list[DynamicTool]
    facts: TurnFacts
    session_file: str
    log: Any
    #: The table's answer for the current state: does ``trigger``'s edge apply now.
    may: Callable[[TurnTrigger], bool]
    #: Report an in-state event (Codex's native compactions): internal edges only.
    emit: Callable[[TurnTrigger], None]
    #: The outcome the turn machine recorded (finalize tells the engine how the turn ended).
    outcome: Callable[[], TurnOutcome | None]
    #: The table's trigger for the current stage cut short by the caller (or ``None``).
    cut_short: Callable[[], TurnTrigger | None]
    switch: YieldSwitch = attrs.Factory(YieldSwitch)
    # Stage records, in the order the stages set them.
    history: HistoryRead | None = None
    assembled: Assembled | None = None
    projected: Projected | None = None
    plan: PromptPlan | None = None
    thread: ThreadReady | None = None
    ran: CodexRan | None = None
    mirror: Mirrored | None = None
    maintenance: MaintenanceReport | None = None
    #: Why no Codex thread or turn could be started.
    start_error: str | None = None
    #: The caller's cancellation, re-raised once the turn is delivered; and the deadline the
    #: cleanup stages share once the caller is gone.
    cancellation: BaseException | None = None
    cleanup_deadline: float | None = None

    @property
    def session_key(self) -> str:
        """The key engines are bound to: the runner's, else the session id."""
        return self.params.session_key or self.params.session_id

    @property
    def messages(self) -> list[AgentMessage]:
        return self.history.messages if self.history is not None else []

    @property
    def binding(self) -> ThreadBinding | None:
        return self.history.binding if self.history is not None else None

    @property
    def pre_prompt_count(self) -> int:
        if self.projected is not None:
            return self.projected.projection.pre_prompt_message_count
        return len(self.messages)

    @property
    def thread_id(self) -> str | None:
        return self.thread.thread_id if self.thread is not None else None


Stage = Callable[[TurnContext], Awaitable[TurnTrigger]]


# --- shared helpers -------------------------------------------------------------------------


def runtime_context(ctx: TurnContext, *, usage: Usage | None = None) -> dict[str, Any]:
    params = ctx.params
    return harness_runtime_context(
        session_key=ctx.session_key,
        sandbox_session_key=params.sandbox_session_key,
        model=params.model,
        auth_profile_id=params.auth_profile_id,
        workspace_dir=os.fspath(params.workspace_dir),
        token_budget=params.context_token_budget,
        usage=usage,
        attempt=params.runtime_attempt,
    )


async def engine_call(ctx: TurnContext, stage: str, call: Awaitable[_T]) -> _T | None:
    """Await one lifecycle call of the engine, bounded by ``engine_timeout``.

    ``None`` (logged) when it timed out: the stage takes its failure edge, so a hung engine
    cannot hold the session forever.
    """
    limit = ctx.params.engine_timeout
    if limit is None:
        return await call
    with anyio.move_on_after(limit):
        return await call
    ctx.log.warning("context engine call timed out", stage=stage, seconds=limit)
    return None


class StrippedHistories:
    """The stripped history of each session's last read, extended by what was appended since.

    A transcript read is O(new bytes) (the session cache), but stripping hidden runtime-context
    messages is a Python pass over the whole history; doing it per read made every turn
    O(history). Keyed by session file, bounded (least recently used dropped), thread-safe
    (reads run in worker threads).
    """

    def __init__(self, capacity: int = 64) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[str, tuple[MessageHistory, RuntimeContextFree]] = (
            collections.OrderedDict()
        )

    def read(self, session_file: str) -> list[AgentMessage]:
        """A fresh, stripped list of the session's messages."""
        # load_session_context raises SessionError on a read failure (load_session_messages
        # would return [] and hide it).
        history = load_session_context(session_file).messages
        if not isinstance(history, MessageHistory):
            return strip_runtime_context_messages(history)
        with self._lock:
            previous = self._entries.get(session_file)
        added = history.appended_since(previous[0]) if previous is not None else None
        if previous is not None and added is not None:
            stripped = RuntimeContextFree(previous[1] + strip_runtime_context_messages(added))
        else:
            stripped = strip_runtime_context_messages(history.to_list())
        with self._lock:
            self._entries[session_file] = (history, stripped)
            self._entries.move_to_end(session_file)
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
        return RuntimeContextFree(stripped)  # the caller's own copy


stripped_histories = StrippedHistories()


def read_history_sync(ctx: TurnContext) -> list[AgentMessage] | None:
    """The stripped history, or ``None`` (logged) when the transcript cannot be read.

    Runs in a worker thread. A read failure must stay a failure (OpenClaw's ``undefined``):
    finalizing from an empty "history" would hand the engine nothing (#121515).
    """
    try:
        return stripped_histories.read(ctx.session_file)
    except Exception as error:
        ctx.log.warning(
            "failed to read mirrored session history for codex harness hooks",
            error=format_error(error),
        )
        return None


def base_instructions(params: TurnParams) -> str | None:
    return join_sections(params.base_developer_instructions, params.extra_developer_instructions)


def tools_fingerprint(ctx: TurnContext) -> str:
    # From the very specs sent on thread/start, so the two can never drift apart.
    return dynamic_tools_fingerprint(unstructure(t.spec()) for t in ctx.tools)


def engine_binding(
    ctx: TurnContext, projection: ProjectionBinding | None
) -> ContextEngineBinding | None:
    engine = ctx.engine
    if engine is None:
        return None
    info = engine.info
    params = ctx.params
    policy = context_engine_policy_fingerprint(
        engine_id=info.id,
        engine_version=info.version,
        owns_compaction=info.owns_compaction,
        turn_maintenance_mode=info.turn_maintenance_mode,
        citations_mode=params.citations_mode,
        context_token_budget=params.context_token_budget,
        projection_max_chars=max_rendered_context_chars(
            params.context_token_budget, params.reserve_tokens
        ),
    )
    return ContextEngineBinding(engine_id=info.id, policy_fingerprint=policy, projection=projection)


def has_projected_context(ctx: TurnContext) -> bool:
    """The projection framed assembled history (it is more than the prompt alone)."""
    projected = ctx.projected
    return projected is not None and projected.projection.prompt_text != ctx.params.prompt.strip()


def thread_facts(ctx: TurnContext, *, resume_failed: bool) -> ThreadFacts:
    binding = ctx.binding
    wanted = engine_binding(ctx, None)
    bound_engine = binding.context_engine if binding is not None else None
    if wanted is None:
        engine_match = bound_engine is None
    else:
        engine_match = (
            bound_engine is not None
            and bound_engine.engine_id == wanted.engine_id
            and bound_engine.policy_fingerprint == wanted.policy_fingerprint
        )
    bound_projection = bound_engine.projection if bound_engine is not None else None
    epoch = ctx.assembled.bootstrap_epoch if ctx.assembled is not None else None
    fingerprint = tools_fingerprint(ctx)
    return ThreadFacts(
        bound=binding is not None,
        tools_match=binding is None
        or fingerprints_compatible(binding.dynamic_tools_fingerprint, fingerprint),
        tools_dropped=binding is not None
        and binding.dynamic_tools_fingerprint not in (None, "", _NO_TOOLS)
        and fingerprint == _NO_TOOLS,
        engine_match=engine_match,
        thread_bootstrap=epoch is not None,
        epoch_match=epoch is not None
        and bound_projection is not None
        and bound_projection.mode == "thread_bootstrap"
        and bound_projection.epoch == epoch,
        per_turn=ctx.assembled is not None and epoch is None,
        has_context=has_projected_context(ctx),
        resume_failed=resume_failed,
    )


def unhooked_prompt(ctx: TurnContext, decision: ThreadDecision) -> tuple[str, str | None]:
    """The prompt and instructions ``decision`` asks for, before the hooks: the projected
    prompt (or the raw one), and the base instructions with the engine's addition."""
    params = ctx.params
    base = base_instructions(params)
    projected = ctx.projected
    if projected is None:
        return params.prompt, base
    # The engine's addition goes AFTER the base instructions (OpenClaw; PI prepends).
    instructions = join_sections(base, projected.projection.developer_instruction_addition)
    prompt = projected.projection.prompt_text if decision.project else params.prompt.strip()
    return prompt, instructions


def plan_prompt(
    ctx: TurnContext, decision: ThreadDecision, hook_result: PromptBuildResult
) -> PromptPlan:
    """The final prompt and instructions for ``decision``, the hooks' result composed in."""
    prompt, instructions = compose_prompt(*unhooked_prompt(ctx, decision), hook_result)
    if len(prompt) > TURN_START_TEXT_MAX_CHARS:
        prompt, dropped = truncate_older(prompt, TURN_START_TEXT_MAX_CHARS)
        ctx.log.warning("codex turn input truncated", dropped_chars=dropped)
    return PromptPlan(
        decision=decision,
        prompt=prompt,
        instructions=instructions,
        hook_result=hook_result,
        projected=decision.project and has_projected_context(ctx),
    )


def log_decision(ctx: TurnContext, plan: PromptPlan) -> None:
    ctx.log.info(
        "codex app-server context-engine projection decision",
        reason=plan.decision.reason,
        action=plan.decision.action.value,
        projected=plan.projected,
        truncated_chars=ctx.projected.projection.truncated_chars if ctx.projected else 0,
    )


# --- the stages, in table order -------------------------------------------------------------


async def begin(ctx: TurnContext) -> TurnTrigger:
    return T.STARTED


async def read_history(ctx: TurnContext) -> TurnTrigger:
    hooks = ctx.hooks
    # Only an engine and hooks read the mirrored history; plain Codex never needs it.
    wanted = ctx.engine is not None or bool(
        hooks.before_prompt_build or hooks.before_compaction or hooks.after_compaction
    )

    # One worker-thread hop for both reads (read_binding never raises).
    def read_both() -> tuple[list[AgentMessage] | None, ThreadBinding | None]:
        history = read_history_sync(ctx) if wanted else []
        return history, read_binding(ctx.session_file)

    history, binding = await anyio.to_thread.run_sync(read_both)
    ctx.history = HistoryRead(messages=history or [], binding=binding)
    return T.HISTORY_READ_FAILED if history is None else T.HISTORY_READ


async def bootstrap(ctx: TurnContext) -> TurnTrigger:
    if not ctx.may(T.BOOTSTRAPPED):
        return T.BOOTSTRAP_SKIPPED
    assert ctx.engine is not None
    assert ctx.history is not None
    ctx.log.debug("codex context engine bootstrap started")
    outcome = await engine_call(
        ctx,
        "bootstrap",
        call_bootstrap(
            engine=ctx.engine.engine,
            session_id=ctx.params.session_id,
            session_key=ctx.session_key,
            session_file=ctx.session_file,
            runtime_context=runtime_context(ctx),
        ),
    )
    failed = outcome is None or outcome.status == "failed"
    # Bootstrap may have written to the transcript (OpenClaw test A3): read it again, keeping
    # the previous history if the re-read fails.
    reread = await anyio.to_thread.run_sync(read_history_sync, ctx)
    if reread is not None:
        ctx.history = attrs.evolve(ctx.history, messages=reread)
    ctx.log.info(
        "codex context engine bootstrap " + ("failed" if failed else "completed"),
        status="failed" if failed else "bootstrapped",
        history_messages=len(ctx.messages),
    )
    return T.BOOTSTRAP_FAILED if failed else T.BOOTSTRAPPED


async def assemble(ctx: TurnContext) -> TurnTrigger:
    if not ctx.may(T.ASSEMBLED):
        return T.ASSEMBLE_SKIPPED
    assert ctx.engine is not None
    params = ctx.params
    outcome = await engine_call(
        ctx,
        "assemble",
        assemble_context_engine(
            engine=ctx.engine.engine,
            session_id=params.session_id,
            session_key=ctx.session_key,
            messages=ctx.messages,
            token_budget=params.context_token_budget,
            available_tools=[t.name for t in ctx.tools],
            citations_mode=params.citations_mode,
            model=params.model,
            prompt=params.prompt,
        ),
    )
    if outcome is None or outcome.status != "assembled" or outcome.result is None:
        return T.ASSEMBLE_FAILED
    result = outcome.result
    ctx.assembled = Assembled(result)
    ctx.log.info(
        "codex context engine assemble applied",
        assembled_messages=len(result.messages),
        estimated_tokens=result.estimated_tokens,
        has_system_prompt_addition=bool(
            result.system_prompt_addition and result.system_prompt_addition.strip()
        ),
    )
    return T.ASSEMBLED


async def project(ctx: TurnContext) -> TurnTrigger:
    assembled = ctx.assembled
    assert assembled is not None
    params = ctx.params
    projector = (
        project_thread_bootstrap_assembly
        if assembled.bootstrap_epoch is not None
        else project_context_engine_assembly
    )
    # The framed context must fit Codex's turn input next to the prompt: cap the context,
    # never cut the frame (its header and safety note are the prompt-injection guard).
    frame_and_prompt = len(frame_context("x", params.prompt.strip())) - 1
    try:
        projection = projector(
            assembled_messages=assembled.result.messages,
            original_history_messages=ctx.messages,
            prompt=params.prompt,
            system_prompt_addition=assembled.result.system_prompt_addition,
            token_budget=params.context_token_budget,
            reserve_tokens=params.reserve_tokens,
            max_context_chars=max(0, TURN_START_TEXT_MAX_CHARS - frame_and_prompt),
        )
    except Exception as error:
        ctx.log.warning(ASSEMBLE_FAILED_WARNING, error=format_error(error), stage="projection")
        return T.PROJECTION_FAILED
    ctx.projected = Projected(projection)
    return T.PROJECTED


async def build_prompt(ctx: TurnContext) -> TurnTrigger:
    """The thread decision (the thread table's), then before_prompt_build hooks on the prompt
    and instructions it chose (the projected prompt, with the engine's addition)."""
    decision = decide_thread(thread_facts(ctx, resume_failed=False))
    hook_result = PromptBuildResult()
    if ctx.hooks.before_prompt_build:
        prompt, instructions = unhooked_prompt(ctx, decision)
        hook_result = await run_before_prompt_build(
            ctx.hooks.before_prompt_build,
            PromptBuildContext(
                session_id=ctx.params.session_id,
                session_key=ctx.params.session_key,
                prompt=prompt,
                developer_instructions=instructions,
                messages=tuple(ctx.messages),
            ),
        )
    ctx.plan = plan_prompt(ctx, decision, hook_result)
    if ctx.projected is not None:
        log_decision(ctx, ctx.plan)
    return T.PROMPT_BUILT


async def reproject(ctx: TurnContext) -> TurnTrigger:
    """Codex refused the resume: the thread table rotates, and the fresh thread (no native
    history) gets the projected context. The hooks' result is kept, not re-run."""
    assert ctx.plan is not None
    decision = decide_thread(thread_facts(ctx, resume_failed=True))
    ctx.plan = plan_prompt(ctx, decision, ctx.plan.hook_result)
    log_decision(ctx, ctx.plan)
    return T.REPROJECTED


async def _clear_binding_quietly(ctx: TurnContext) -> None:
    """A binding is an optimisation: failing to remove one never fails a turn."""
    try:
        await anyio.to_thread.run_sync(clear_binding, ctx.session_file)
    except Exception as error:
        ctx.log.warning("failed to clear codex app-server binding", error=format_error(error))


def _thread_settings(ctx: TurnContext) -> dict[str, Any]:
    assert ctx.plan is not None
    params = ctx.params
    return {
        "developer_instructions": ctx.plan.instructions,
        "cwd": os.fspath(params.workspace_dir),
        "model": params.model,
        "tools": ctx.tools,
        "approval_policy": params.approval_policy,
        "sandbox": params.sandbox,
        "approvals_reviewer": params.approvals_reviewer,
        "service_tier": params.service_tier,
    }


_STARTED_TRIGGER: Final = {
    ThreadAction.START: T.THREAD_STARTED,
    ThreadAction.TRANSIENT: T.THREAD_STARTED,
    ThreadAction.ROTATE: T.THREAD_ROTATED,
}


async def start_thread(ctx: TurnContext) -> TurnTrigger:
    plan = ctx.plan
    assert plan is not None
    decision = plan.decision
    bound = ctx.binding
    settings = _thread_settings(ctx)
    if decision.action is ThreadAction.RESUME:
        assert bound is not None
        try:
            result = await ctx.app_server.resume_thread(bound.thread_id, **settings)
        except AppServerError as error:
            ctx.log.warning(
                "codex app-server thread resume failed; starting a new thread",
                thread_id=bound.thread_id,
                error=format_error(error),
            )
            return T.THREAD_RESUME_FAILED
        # The thread keeps the projection it carries (a matching epoch, or none); a resume
        # that kept the thread for want of context keeps the binding's whole engine record.
        kept = bound.context_engine
        record = (
            engine_binding(ctx, kept.projection if kept is not None else None)
            if decision.rebind_engine
            else kept
        )
        binding = await save_binding(ctx, result, previous=bound, engine_record=record)
        ctx.thread = ThreadReady(result=result, binding=binding)
        ctx.log = ctx.log.bind(thread_id=result.thread_id)
        ctx.log.info("codex app-server thread resumed", reason=decision.reason)
        return T.THREAD_RESUMED
    retired: str | None = None
    if decision.action is ThreadAction.ROTATE and bound is not None:
        retired = bound.thread_id
        await _clear_binding_quietly(ctx)
    try:
        result = await ctx.app_server.start_thread(**settings)
    except AppServerError as error:
        ctx.log.warning("codex app-server thread start failed", error=format_error(error))
        ctx.start_error = format_error(error)
        return T.THREAD_START_FAILED
    new_binding: ThreadBinding | None = None
    pending: ProjectionBinding | None = None
    # A transient thread serves this turn only: the binding keeps the tooled thread.
    if decision.action is not ThreadAction.TRANSIENT:
        # A bootstrap epoch is recorded only once Codex accepted the turn that carries its
        # context (run_turn): recorded earlier, a failed turn/start would make the next turn
        # resume a thread that never received it (OpenClaw #88355).
        pending = _current_projection(ctx)
        new_binding = await save_binding(
            ctx, result, previous=None, engine_record=engine_binding(ctx, None)
        )
    if retired is not None:
        # The old thread runs no more turns: release what the client keeps for it.
        ctx.app_server.forget_thread(retired)
    ctx.thread = ThreadReady(result=result, binding=new_binding, pending_projection=pending)
    ctx.log = ctx.log.bind(thread_id=result.thread_id)
    trigger = _STARTED_TRIGGER[decision.action]
    ctx.log.info(
        "codex app-server thread " + ("rotated" if trigger is T.THREAD_ROTATED else "started"),
        reason=decision.reason,
    )
    return trigger


def _current_projection(ctx: TurnContext) -> ProjectionBinding | None:
    """The projection block this turn's assembly asks for (thread_bootstrap only)."""
    assembled = ctx.assembled
    epoch = assembled.bootstrap_epoch if assembled is not None else None
    if assembled is None or epoch is None or assembled.result.context_projection is None:
        return None
    return ProjectionBinding(
        mode="thread_bootstrap",
        epoch=epoch,
        fingerprint=assembled.result.context_projection.fingerprint,
    )


async def save_binding(
    ctx: TurnContext,
    result: ThreadResult,
    *,
    previous: ThreadBinding | None,
    engine_record: ContextEngineBinding | None,
) -> ThreadBinding | None:
    """Write the binding for ``result``'s thread (skipped when nothing changed); the binding
    now in force, or ``previous`` when the write failed."""
    params = ctx.params
    decision = ctx.plan.decision if ctx.plan is not None else None
    bound = ctx.binding
    fields: dict[str, Any] = {
        "thread_id": result.thread_id,
        "cwd": os.fspath(params.workspace_dir),
        "auth_profile_id": params.auth_profile_id
        or (bound.auth_profile_id if bound is not None else None),
        "model": result.model or params.model,
        "model_provider": result.model_provider,
        "approval_policy": params.approval_policy,
        "sandbox": params.sandbox,
        "approvals_reviewer": params.approvals_reviewer,
        "service_tier": params.service_tier,
        "dynamic_tools_fingerprint": tools_fingerprint(ctx),
        "context_engine": engine_record,
        # Why this thread exists: the decision that started or rotated to it (a resume keeps
        # the record of the thread it resumed).
        "thread_decision": previous.thread_decision
        if previous is not None
        else ThreadDecisionRecord(action=decision.action.value, reason=decision.reason)
        if decision is not None
        else None,
    }
    if previous is not None:
        fields["created_at"] = previous.created_at
    binding = ThreadBinding(**fields)
    if previous is not None and binding == attrs.evolve(
        previous, session_file=binding.session_file, updated_at=binding.updated_at
    ):
        # A resume that changed nothing: skip the atomic rewrite (two fsyncs) every turn.
        # ``updatedAt`` therefore says when the binding last changed.
        return previous
    try:
        await anyio.to_thread.run_sync(write_binding, ctx.session_file, binding)
    except Exception as error:
        ctx.log.warning("failed to write codex app-server binding", error=format_error(error))
        return previous
    return binding


def _partial_result(
    ctx: TurnContext, handle_box: list[Any], status: CodexTurnStatus, error: str | None
) -> CodexTurnResult:
    """What Codex produced before the turn was cut short: at least the user's prompt, which
    is mirrored like any other (a crash must not lose what the user said)."""
    if handle_box:
        handle = handle_box[0]
        if handle.result is not None and status is CodexTurnStatus.INTERRUPTED:
            finished: CodexTurnResult = handle.result
            return finished
        built: CodexTurnResult = handle.projector.build_result(outcome=status, error=error)
        return built
    # turn/start itself never answered: nothing but the prompt exists, and Codex gave the
    # turn no id. Run-unique identities keep the mirror's idempotency keys from matching an
    # earlier such turn on this thread (which would silently drop this prompt).
    projector = TurnProjector(
        thread_id=ctx.thread_id or "",
        prompt=ctx.params.prompt,
        provider="codex",
        model=ctx.params.model,
        turn_id=None,
    )
    prompt_only: CodexTurnResult = projector.build_result(outcome=status, error=error)
    run = f"unstarted-{uuid.uuid4().hex}"
    return attrs.evolve(
        prompt_only,
        mirror_identities=[
            f"{run}:{identity.rpartition(':')[2]}" for identity in prompt_only.mirror_identities
        ],
    )


async def run_turn(ctx: TurnContext) -> TurnTrigger:
    """Run the Codex turn. The caller's cancellation is caught here (the client interrupts
    Codex on the way out), recorded for the driver to re-raise, and ends the turn as aborted:
    what Codex produced is still mirrored and finalized."""
    thread, plan = ctx.thread, ctx.plan
    assert thread is not None
    assert plan is not None
    params = ctx.params
    handle_box: list[Any] = []
    cancelled = anyio.get_cancelled_exc_class()
    end = RunEnd.FAILED
    try:
        async with ctx.app_server.turn(
            thread.thread_id,
            plan.prompt,
            prompt=params.prompt,
            images=params.images,
            model=params.model,
        ) as handle:
            handle_box.append(handle)
            ctx.switch.live_handle = handle
            if thread.pending_projection is not None:
                # Codex accepted the input that carries the epoch's context: record it.
                record = engine_binding(ctx, thread.pending_projection)
                binding = await save_binding(
                    ctx, thread.result, previous=thread.binding, engine_record=record
                )
                ctx.thread = thread = attrs.evolve(thread, binding=binding, pending_projection=None)

            async def on_event(note: Notification) -> None:
                await on_codex_event(ctx, note)

            codex = await handle.collect(
                on_event=on_event, idle_timeout=params.idle_timeout, timeout=params.turn_timeout
            )
            end = RunEnd(codex.outcome.value)
    except cancelled as error:
        ctx.cancellation = error
        codex = _partial_result(ctx, handle_box, CodexTurnStatus.INTERRUPTED, None)
        end = RunEnd.INTERRUPTED
    except AppServerError as error:
        closed = isinstance(error, AppServerClosed)
        message = "codex app-server closed" if closed else format_error(error)
        codex = _partial_result(ctx, handle_box, CodexTurnStatus.FAILED, message)
        ctx.log.warning(
            "codex app-server closed during the turn" if closed else "codex app-server turn failed",
            error=format_error(error),
        )
    except Exception as error:
        # Anything else (a protocol shape we cannot read, a failing event hook) is still a
        # turn that ran: it fails, and mirroring and finalizing follow.
        codex = _partial_result(ctx, handle_box, CodexTurnStatus.FAILED, format_error(error))
        ctx.log.warning("codex turn failed unexpectedly", error=format_error(error))
    finally:
        ctx.switch.live_handle = None
        if plan.decision.action is ThreadAction.TRANSIENT:
            ctx.app_server.forget_thread(thread.thread_id)  # it runs no other turn
    ctx.ran = CodexRan(codex)
    ctx.log = ctx.log.bind(turn_id=codex.turn_id)
    return run_end_trigger(end, yield_requested=ctx.switch.requested)


async def on_codex_event(ctx: TurnContext, note: Notification) -> None:
    phase = note.compaction_phase
    if phase is None:
        return
    item = note.item
    item_id = item.get("id") if item is not None and isinstance(item.get("id"), str) else None
    turn_id = note.turn_id
    event = CompactionHookEvent(
        phase="start" if phase == "started" else "end",
        thread_id=ctx.thread_id or "",
        turn_id=turn_id,
        item_id=item_id,
        messages=tuple(ctx.messages),
    )
    if phase == "started":
        ctx.emit(T.NATIVE_COMPACTION_STARTED)
        hooks = ctx.hooks.before_compaction
    else:
        ctx.emit(T.NATIVE_COMPACTION_COMPLETED)
        hooks = ctx.hooks.after_compaction
    ctx.log.info("codex native compaction during turn", phase=event.phase, item_id=item_id)
    for hook in hooks:
        try:
            await hook(event)
        except Exception as error:
            ctx.log.warning("compaction hook failed", phase=event.phase, error=format_error(error))
    diagnostics: list[dict[str, Any]] = [
        {
            "stream": "compaction",
            "phase": event.phase,
            "backend": "codex-app-server",
            "threadId": event.thread_id,
            "turnId": turn_id,
            "itemId": item_id,
            **({"completed": True} if event.phase == "end" else {}),
        }
    ]
    if ctx.engine is not None and ctx.engine.info.owns_compaction:
        # Codex compacted natively although the engine owns compaction: say so (in the log by
        # default, and to the host's sink), so this is never reported as an engine compaction.
        ctx.log.info(
            "codex native compaction diagnostic",
            phase=event.phase,
            backend="codex-app-server",
            ownsCompaction=True,
        )
        diagnostics.append(
            {
                "stream": "compaction",
                "phase": event.phase,
                "backend": "codex-app-server",
                "ownsCompaction": True,
                "threadId": event.thread_id,
                "itemId": item_id,
            }
        )
    sink = ctx.hooks.on_compaction_event
    if sink is None:
        return
    for diagnostic in diagnostics:
        try:
            await sink(diagnostic)
        except Exception as error:
            ctx.log.warning("compaction diagnostic sink failed", error=format_error(error))


async def mirror(ctx: TurnContext) -> TurnTrigger:
    assert ctx.ran is not None
    codex = ctx.ran.codex
    params = ctx.params
    try:
        await anyio.to_thread.run_sync(
            lambda: mirror_turn(
                ctx.session_file,
                codex.messages_snapshot,
                scope=codex.idempotency_scope,
                identities=codex.mirror_identities,
                session_id=params.session_id,
                cwd=os.fspath(params.workspace_dir),
            )
        )
    except Exception as error:
        ctx.log.warning("failed to mirror codex app-server transcript", error=format_error(error))
        ctx.mirror = Mirrored(ok=False)
        return T.MIRROR_FAILED
    ctx.mirror = Mirrored(ok=True)
    return T.MIRRORED


async def finalize(ctx: TurnContext) -> TurnTrigger:
    """Hand the turn to the engine (after_turn, else ingest_batch, else ingest)."""
    engine = ctx.engine
    if engine is None:
        return T.FINALIZED
    assert ctx.ran is not None
    codex = ctx.ran.codex
    mirrored = ctx.mirror is not None and ctx.mirror.ok
    snapshot = await anyio.to_thread.run_sync(read_history_sync, ctx) if mirrored else None
    fallback = snapshot is None
    if snapshot is None:
        snapshot = [*ctx.messages, *codex.messages_snapshot]
    outcome = ctx.outcome()
    finalized = await engine_call(
        ctx,
        "finalize",
        finalize_context_engine_turn(
            engine=engine.engine,
            session_id=ctx.params.session_id,
            session_key=ctx.session_key,
            session_file=ctx.session_file,
            messages_snapshot=snapshot,
            pre_prompt_message_count=ctx.pre_prompt_count,
            prompt_error=outcome is not None and outcome.prompt_error,
            aborted=outcome is not None and outcome.aborted,
            yield_aborted=outcome is not None and outcome.yield_aborted,
            token_budget=ctx.params.context_token_budget,
            runtime_context=runtime_context(ctx, usage=codex.usage),
            run_maintenance=False,  # the turn machine decides; see maintain
            snapshot_is_fallback=fallback,
        ),
    )
    if finalized is None:
        return T.FINALIZE_FAILED
    ctx.log.info(
        "codex context engine finalize " + ("completed" if finalized.succeeded else "failed"),
        path=finalized.path,
        new_messages=finalized.new_message_count,
        fallback_snapshot=fallback,
    )
    return finalized.trigger


_DROPPED: Final = {ScheduleResult.REJECTED, ScheduleResult.CLOSED}


async def maintain(ctx: TurnContext) -> TurnTrigger:
    """Turn maintenance, as the facts say: deferred to the scheduler, or inline."""
    engine = ctx.engine
    assert engine is not None
    codex = ctx.ran.codex if ctx.ran is not None else None
    request: dict[str, Any] = {
        "engine": engine.engine,
        "session_id": ctx.params.session_id,
        "session_key": ctx.session_key,
        "session_file": ctx.session_file,
        "runtime_context": runtime_context(ctx, usage=codex.usage if codex else None),
    }
    if ctx.facts.background_maintenance:
        assert ctx.scheduler is not None
        deferred = defer_maintenance(ctx.scheduler, **request)
        if deferred.schedule in _DROPPED:
            assert deferred.schedule is not None
            # Handed to the scheduler, which dropped it: nothing will run.
            reason = f"scheduler_{deferred.schedule.value}"
            ctx.maintenance = MaintenanceReport(status="skipped", skip_reason=reason)
            return T.MAINTENANCE_DROPPED
        ctx.maintenance = MaintenanceReport(status="deferred")
        return T.MAINTENANCE_DEFERRED
    ran: MaintenanceOutcome | None = await engine_call(
        ctx, "maintain", call_maintenance(reason="turn", **request)
    )
    if ran is None or ran.status != "ran":
        ctx.maintenance = MaintenanceReport(status="failed")
        return T.MAINTENANCE_FAILED
    ctx.maintenance = MaintenanceReport(status="ran")
    return T.MAINTENANCE_RAN


def yield_tool(switch: YieldSwitch) -> DynamicTool:
    async def request_yield(_arguments: dict[str, Any]) -> str:
        switch.requested = True
        handle = switch.live_handle
        if handle is not None:
            # Interrupting while this tool call is unanswered is safe (Codex ends the turn).
            await handle.interrupt()
        return "yielding the turn"

    return DynamicTool(
        name=YIELD_TOOL,
        description="End this run now and yield control back to the user.",
        input_schema={"type": "object", "properties": {}},
        fn=request_yield,
    )
