"""The stages of a turn: for each state of the turn machine, the I/O it does.

Theory of operation. :mod:`codex_turn.harness.turn.orchestrator` drives a turn as a dispatch loop
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

Size: one function per state, in table order, and the running_turn stage with its event
handling (~670 lines, one seam: a state's I/O, with the record of what Codex accepted); the
shared records and helpers live in
:mod:`codex_turn.harness.turn.context`, the facts of the form and thread tables and the frame
in :mod:`codex_turn.harness.turn.forms`, the thread plan's executors (start, resume, rotate,
fork) in :mod:`codex_turn.harness.turn.executors`.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
import attrs

from codex_turn._log import format_error
from codex_turn.fsm import TurnTrigger
from codex_turn.fsm.outbox import TERMINAL_OF_OUTCOME
from codex_turn.fsm.thread import ThreadAction, ThreadDecision
from codex_turn.fsm.turn import (
    ASSEMBLE_TRIGGERS,
    BOOTSTRAP_TRIGGERS,
    FINALIZE_TRIGGERS,
    FORM_TRIGGERS,
    MAINTENANCE_TRIGGERS,
    RunEnd,
    run_end_trigger,
)
from codex_turn.harness._fs import run_in_worker
from codex_turn.harness.appserver import (
    AppServerClosed,
    AppServerError,
    CodexTurnResult,
    CodexTurnStatus,
    Notification,
    TurnHandlePort,
)
from codex_turn.harness.appserver.types import TextInput, UserInput
from codex_turn.harness.binding import ContextEngineBinding, ThreadBinding, read_binding
from codex_turn.harness.collaboration import (
    CollaborationPlan,
    collaboration_mode,
    collaboration_plan,
)
from codex_turn.harness.durable_turns import admit_turn, fence_history, settle_turn
from codex_turn.harness.engine import AgentMessage
from codex_turn.harness.hooks import (
    CompactionHookEvent,
    PromptBuildContext,
    PromptBuildResult,
    run_before_prompt_build,
)
from codex_turn.harness.lifecycle import (
    ASSEMBLE_FAILED_WARNING,
    assemble_context_engine,
    call_bootstrap,
    finalize_context_engine_turn,
)
from codex_turn.harness.maintenance import (
    MaintenanceOutcome,
    call_maintenance,
    defer_maintenance,
)
from codex_turn.harness.observations import (
    LlmInputObserved,
    LlmOutputObserved,
    tool_call_observed,
)
from codex_turn.harness.runtime_controls import turn_request_handlers, turn_start_overrides
from codex_turn.harness.session import (
    SessionError,
    ensure_transcript_writable,
    mirror_prompt,
    mirror_turn,
    sync_appended,
)
from codex_turn.harness.turn.context import (
    Assembled,
    CodexRan,
    HistoryRead,
    Mirrored,
    Projected,
    Stage,
    ThreadReady,
    TurnContext,
    assemble_facts,
    engine_binding,
    engine_call,
    log_decision,
    partial_result,
    plan_prompt,
    read_history_sync,
    runtime_context,
    save_binding,
    unhooked_prompt,
)
from codex_turn.harness.turn.executors import start_thread
from codex_turn.harness.turn.forms import (
    as_items,
    decide_thread,
    frame_projection,
    session_conversion,
    settle_fork,
    transcript_context,
    unframed,
)
from codex_turn.harness.turn_api import MaintenanceReport

__all__ = [
    "Stage",
    "TurnContext",
    "assemble",
    "begin",
    "bootstrap",
    "build_prompt",
    "finalize",
    "maintain",
    "mirror",
    "project",
    "read_history",
    "reproject",
    "run_turn",
    "start_thread",
]


T = TurnTrigger


# --- the stages, in table order -------------------------------------------------------------


async def begin(ctx: TurnContext) -> TurnTrigger:
    return T.STARTED


async def read_history(ctx: TurnContext) -> TurnTrigger:
    """Check that the transcript can take this turn, then read the history and the binding,
    and what of the history the bound thread lacks. Plain Codex reads the history too: a
    thread Codex lost, or a binding the transcript outgrew, is caught up from it
    (:mod:`codex_turn.harness.turn.continuity`)."""
    params = ctx.params

    # One worker-thread hop for the check and both reads (read_binding never raises).
    def read_all() -> tuple[HistoryRead, bool]:
        ensure_transcript_writable(
            ctx.session_file, session_id=params.session_id, cwd=os.fspath(params.workspace_dir)
        )
        binding = read_binding(ctx.session_file, session_id=params.session_id)
        history = read_history_sync(ctx)
        return HistoryRead.of(history or [], binding, ctx.known_prompt_key), history is None

    try:
        ctx.history, failed = await run_in_worker(read_all)
    except SessionError as error:
        # Nothing has reached Codex: refuse now rather than run a turn nobody can keep.
        ctx.log.warning("codex turn refused: transcript unwritable", error=format_error(error))
        ctx.refusal = error
        ctx.start_error = format_error(error)
        return T.TRANSCRIPT_UNWRITABLE
    return T.HISTORY_READ_FAILED if failed else T.HISTORY_READ


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
    status = outcome.status if outcome is not None else "failed"  # None: it timed out
    failed = status == "failed"
    # Bootstrap may have written to the transcript (OpenClaw test A3): read it again, keeping
    # the previous history if the re-read fails.
    reread = await run_in_worker(read_history_sync, ctx)
    if reread is not None:
        ctx.history = HistoryRead.of(reread, ctx.history.binding, ctx.known_prompt_key)
    ctx.log.info(
        "codex context engine bootstrap " + ("failed" if failed else "completed"),
        status=status,
        history_messages=len(ctx.messages),
    )
    return BOOTSTRAP_TRIGGERS[status]


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
            # The current-turn fence, for an engine that declared it: history before this
            # turn's entry (a retried turn's prompt may be in the transcript already).
            messages=(
                fence_history(ctx.messages, ctx.known_prompt_key)
                if ctx.durable_turns
                else ctx.messages
            ),
            token_budget=params.context_token_budget,
            available_tools=[t.name for t in ctx.tools],
            citations_mode=params.citations_mode,
            model=params.model,
            prompt=params.prompt,
            facts=assemble_facts(ctx),
            is_heartbeat=params.heartbeat,
        ),
    )
    if outcome is None or outcome.status != "assembled" or outcome.result is None:
        # Timed out (None), failed, or nothing to apply: the baseline prompt.
        return ASSEMBLE_TRIGGERS["failed"]
    result = outcome.result
    ctx.assembled = Assembled(result)
    ctx.log.info(
        "codex context engine assemble applied",
        assembled_messages=len(result.messages),
        estimated_tokens=result.estimated_tokens,
        has_system_prompt_addition=bool(
            result.system_prompt_addition and result.system_prompt_addition.strip()
        ),
        prompt_authority=result.prompt_authority,
    )
    budget = params.context_token_budget
    if result.prompt_authority == "assembled" and budget and result.estimated_tokens > budget:
        # The engine took the prompt's authority: its assembly is sent as it is (within
        # Codex's input limit), and an operator hears that it does not fit the budget.
        ctx.log.warning(
            "context engine assembly exceeds the budget it vouched for",
            estimated_tokens=result.estimated_tokens,
            token_budget=budget,
        )
    return ASSEMBLE_TRIGGERS[outcome.status]


async def project(ctx: TurnContext) -> TurnTrigger:
    """The form table's form for the assembly, and the thread decision on it: the frame is
    rendered when the decision reads whether there is context, or sends it (a resumed thread
    that carries this epoch's context gets the raw prompt, and no frame is rendered for it).
    A render that fails falls back to the baseline prompt (``projection_failed``)."""
    assembled = ctx.assembled
    assert assembled is not None
    addition = assembled.result.system_prompt_addition
    conversion = session_conversion(ctx)
    form, items = as_items(
        ctx,
        assembled.result.messages,
        per_turn=assembled.bootstrap_epoch is None,
        source="assembly",
        cache=conversion,
    )
    try:
        # The structured form carries its items; the text form is framed when needed.
        ctx.projected = Projected(
            unframed(ctx, addition), framed=False, items=items, conversion=conversion
        )
        ctx.decision = decide_thread(ctx)
        _frame_if_sent(ctx, ctx.decision)
    except Exception as error:
        ctx.log.warning(ASSEMBLE_FAILED_WARNING, error=format_error(error), stage="projection")
        ctx.projected = ctx.decision = None
        return T.PROJECTION_FAILED
    return FORM_TRIGGERS[form.action]


def _frame_if_sent(ctx: TurnContext, decision: ThreadDecision) -> None:
    """Render the frame ``decision`` sends, unless it is rendered already or the context
    goes as items (raises what the projector raised)."""
    projected = ctx.projected
    if not decision.project or decision.from_transcript or projected is None or projected.framed:
        return
    if projected.items is None or decision.action is not ThreadAction.FORK:
        ctx.projected = frame_projection(ctx)


async def build_prompt(ctx: TurnContext) -> TurnTrigger:
    """The thread decision (taken when projecting; else now, from the facts without a
    projection), then before_prompt_build hooks on the prompt and instructions it chose."""
    decision = ctx.decision or decide_thread(ctx)
    ctx.plan = plan_prompt(ctx, decision, await _prepare_prompt(ctx, decision))
    if ctx.projected is not None:
        log_decision(ctx, ctx.plan)
    return T.PROMPT_BUILT


async def reproject(ctx: TurnContext) -> TurnTrigger:
    """Codex refused the resume or the fork, or the turn overflowed the model's context
    window: the thread table decides again with that fact (it rotates), and the fresh thread
    (no native history) gets the projected context, or the conversation from the transcript,
    as the text frame; the hooks run again on the prompt now sent. A frame that fails to render
    here leaves the raw prompt, as a failed projection does."""
    stand_in = ctx.plan is not None and ctx.plan.decision.from_transcript
    if ctx.assembled is None or stand_in:
        ctx.projected = None  # the transcript's stand-in is chosen anew for the new decision
    try:
        if ctx.projected is not None and ctx.projected.items is not None:
            # Codex refused the fork: its items can go nowhere now, the fresh thread gets
            # the text frame, and whether there is context is the frame's to say.
            ctx.projected = frame_projection(ctx)
        decision = decide_thread(ctx)
        _frame_if_sent(ctx, decision)
    except Exception as error:
        ctx.log.warning(ASSEMBLE_FAILED_WARNING, error=format_error(error), stage="projection")
        ctx.projected = None
        decision = decide_thread(ctx)
    ctx.decision = decision
    ctx.plan = plan_prompt(ctx, decision, await _prepare_prompt(ctx, decision))
    log_decision(ctx, ctx.plan)
    return T.REPROJECTED


async def _prepare_prompt(ctx: TurnContext, decision: ThreadDecision) -> PromptBuildResult:
    """The transcript's stand-in when ``decision`` asks for it (a fork base holds no
    conversation), then before_prompt_build on the prompt and instructions it asks for."""
    if decision.from_transcript:
        try:
            ctx.projected = transcript_context(ctx, decision)
        except Exception as error:
            ctx.log.warning(ASSEMBLE_FAILED_WARNING, error=format_error(error), stage="projection")
            ctx.projected = None
    if not ctx.hooks.before_prompt_build:
        return PromptBuildResult()
    prompt, instructions = unhooked_prompt(ctx, decision)
    return await run_before_prompt_build(
        ctx.hooks.before_prompt_build,
        PromptBuildContext(
            session_id=ctx.params.session_id,
            session_key=ctx.params.session_key,
            prompt=prompt,
            developer_instructions=instructions,
            messages=tuple(ctx.messages),
        ),
    )


async def _collaboration(ctx: TurnContext) -> CollaborationPlan:
    """This turn's collaboration-mode instructions and input context (collaboration.py); a
    heartbeat file is named only when it is non-empty (its size looked up, never read)."""
    params = ctx.params
    named = None
    if params.heartbeat and params.heartbeat_file is not None:
        # A relative path is the workspace's (Codex's cwd, where the model reads it).
        path = os.path.join(os.fspath(params.workspace_dir), os.fspath(params.heartbeat_file))
        try:
            if (await anyio.Path(path).stat()).st_size > 0:
                named = params.heartbeat_file
        except OSError:
            named = None  # absent or unreadable: nothing to point at
    return collaboration_plan(
        params.collaboration,
        tool_names=[t.name for t in ctx.tools],
        heartbeat=params.heartbeat,
        heartbeat_file=named,
    )


async def run_turn(ctx: TurnContext) -> TurnTrigger:
    """Run the Codex turn. The caller's cancellation is caught here (the client interrupts
    Codex on the way out), recorded for the driver to re-raise, and ends the turn as aborted:
    what Codex produced is still mirrored and finalized."""
    thread, plan = ctx.thread, ctx.plan
    assert thread is not None
    assert plan is not None
    params = ctx.params
    handle_box: list[TurnHandlePort] = []
    cancelled = anyio.get_cancelled_exc_class()
    end = RunEnd.FAILED
    completed: CodexTurnResult | None = None  # the turn's result, when it completed
    try:
        # The user's words are in the transcript, written and fsynced in one hop, before the
        # model sees them: a host that dies during the turn still leaves the prompt there (the
        # mirror dedups it later). A hop is never abandoned: a caller cancelled meanwhile
        # gets its cancellation at turn/start, and the turn is mirrored as aborted.
        unsynced = await run_in_worker(_mirror_prompt, ctx, thread.thread_id)
        if unsynced is not None:
            # The mirror's own fsync, of the same file, follows; an error it meets is reported.
            ctx.log.warning(
                "failed to sync the prompt to the transcript", error=format_error(unsynced)
            )
        collaboration = await _collaboration(ctx)
        overrides = turn_start_overrides(params, thread.result)
        if collaboration.instructions is not None:
            overrides["collaborationMode"] = collaboration_mode(collaboration.instructions)
        text: str | list[UserInput] = plan.prompt
        if collaboration.input_context is not None:
            # The plain-text memory: input context of this turn, before the prompt.
            text = [TextInput(collaboration.input_context), TextInput(plan.prompt)]
        ctx.observations.emit(
            "llm_input",
            ctx.hooks.llm_input,
            LlmInputObserved(
                session_id=params.session_id,
                thread_id=thread.thread_id,
                model=params.model or thread.result.model,
                prompt=plan.prompt,
                developer_instructions=plan.instructions,
                collaboration_instructions=collaboration.instructions,
                images=len(params.images) + len(_restored_images(ctx)),
                tools=tuple(t.name for t in ctx.tools),
                history_messages=len(ctx.messages),
            ),
        )
        async with ctx.app_server.turn(
            thread.thread_id,
            text,
            prompt=params.prompt,
            images=(*params.images, *_restored_images(ctx)),
            model=params.model,
            overrides=overrides,
            handlers=turn_request_handlers(params, ctx.hooks),
        ) as handle:
            handle_box.append(handle)
            ctx.switch.live_handle = handle
            if thread.binding is not None and (
                thread.pending_projection is not None or thread.pending_coverage is not None
            ):
                ctx.thread = thread = await _record_accepted(ctx, thread, thread.binding)

            async def on_event(note: Notification) -> None:
                await on_codex_event(ctx, note)

            # Messages for this session that arrive meanwhile are steered into it (steering).
            async with _delivering(ctx, handle):
                codex = await handle.collect(
                    on_event=on_event, idle_timeout=params.idle_timeout, timeout=params.turn_timeout
                )
            end = RunEnd(codex.outcome.value)
            if end is RunEnd.FAILED and codex.context_window_exceeded:
                end = RunEnd.OVERFLOWED  # the turn table retries it once on a fresh thread
            if end is RunEnd.COMPLETED:
                completed = codex
    except cancelled as error:
        ctx.cancellation = error
        codex = partial_result(ctx, handle_box, CodexTurnStatus.INTERRUPTED, None)
        end = RunEnd.INTERRUPTED
    except AppServerError as error:
        closed = isinstance(error, AppServerClosed)
        message = "codex app-server closed" if closed else format_error(error)
        codex = partial_result(ctx, handle_box, CodexTurnStatus.FAILED, message)
        ctx.log.warning(
            "codex app-server closed during the turn" if closed else "codex app-server turn failed",
            error=format_error(error),
        )
    except Exception as error:
        # Anything else (a protocol shape we cannot read, a failing event hook) is still a
        # turn that ran: it fails, and mirroring and finalizing follow.
        codex = partial_result(ctx, handle_box, CodexTurnStatus.FAILED, format_error(error))
        ctx.log.warning("codex turn failed unexpectedly", error=format_error(error))
    finally:
        ctx.switch.live_handle = None
        if thread.fork is not None and completed is None:
            settle_fork(ctx, None)  # kept as incomplete: the fork table will not continue it
        elif plan.decision.action is ThreadAction.TRANSIENT:
            ctx.app_server.forget_thread(thread.thread_id)  # it runs no other turn
    # Steered messages are mirrored after the prompt, in order (the engine's finalize sees them).
    ctx.ran = CodexRan(ctx.live.with_steered(codex) if ctx.live is not None else codex)
    if thread.fork is not None and completed is not None:
        # Kept with what it now holds (steered messages included, as mirrored).
        settle_fork(ctx, ctx.ran.codex)
    ctx.log = ctx.log.bind(turn_id=codex.turn_id)
    ran = ctx.ran.codex
    ctx.observations.emit(
        "llm_output",
        ctx.hooks.llm_output,
        LlmOutputObserved(
            session_id=params.session_id,
            thread_id=thread.thread_id,
            turn_id=ran.turn_id,
            model=params.model or thread.result.model,
            status=end.value if end is not RunEnd.OVERFLOWED else RunEnd.FAILED.value,
            assistant_text=ran.final_text,
            usage=ran.usage,
            error=ran.prompt_error,
        ),
    )
    return run_end_trigger(end, yield_requested=ctx.switch.requested)


async def _record_accepted(
    ctx: TurnContext, thread: ThreadReady, previous: ThreadBinding
) -> ThreadReady:
    """Codex accepted the input that carries the epoch's context, or the conversation the
    thread lacked: record it in the binding (one write, skipped when nothing changed)."""
    projection = thread.pending_projection
    record: ContextEngineBinding | None = previous.context_engine
    tools: str | None = previous.dynamic_tools_fingerprint
    if projection is not None:
        record, tools = engine_binding(ctx, projection), ctx.tools_fingerprint
    coverage = thread.pending_coverage or previous.history_covered_through
    binding = await save_binding(
        ctx,
        thread.result,
        previous=previous,
        engine_record=record,
        tools_fingerprint=tools,
        coverage=coverage,
    )
    return attrs.evolve(thread, binding=binding, pending_projection=None, pending_coverage=None)


def _restored_images(ctx: TurnContext) -> tuple[str, ...]:
    """The transcript's images that go with a text frame standing for it (none otherwise)."""
    projected, plan = ctx.projected, ctx.plan
    if projected is None or plan is None or not plan.projected:
        return ()
    return projected.images


def _mirror_prompt(ctx: TurnContext, thread_id: str) -> OSError | None:
    """Append the prompt, then fsync it (the worker's one hop). A failed write raises (the
    turn fails); a failed fsync is returned, for the turn to say and go on with (the bytes
    are the kernel's: only an OS crash could lose them, and the mirror fsyncs them again)."""
    prompt = partial_result(ctx, [], CodexTurnStatus.INTERRUPTED, None).messages_snapshot[0]
    scope = f"codex-app-server:{thread_id}"
    if ctx.durable_prompt_key is None and ctx.known_prompt_key is None:
        ctx.durable_prompt_key = f"{scope}:{ctx.prompt_identity}"  # as mirror_prompt keys it
    if ctx.durable_turns and ctx.known_prompt_key is not None:
        # Admitted before the prompt is written: a crash from here on is recovered.
        unadmitted = admit_turn(ctx.session_file, ctx.advancement_key, ctx.known_prompt_key)
        if unadmitted is not None:
            ctx.log.warning("turn outbox admission failed", error=format_error(unadmitted))
    written = mirror_prompt(
        ctx.session_file,
        _with_prompt_key(ctx, [prompt])[0],
        scope=scope,
        identity=ctx.prompt_identity,
        session_id=ctx.params.session_id,
        cwd=os.fspath(ctx.params.workspace_dir),
        sync=False,  # synced below, so that its failure is told apart from the write's
    )
    try:
        sync_appended(written)
    except OSError as error:
        return error
    return None


def _with_prompt_key(ctx: TurnContext, messages: list[AgentMessage]) -> list[AgentMessage]:
    """``messages`` (the prompt first) with a thread-independent key on the prompt when its
    identity is the host's turn id; unchanged (thread-scoped) for a run-unique identity."""
    key = ctx.known_prompt_key
    if not messages or key is None:
        return messages
    return [{**messages[0], "idempotencyKey": key}, *messages[1:]]


def _delivering(ctx: TurnContext, handle: TurnHandlePort) -> AbstractAsyncContextManager[None]:
    live = ctx.live
    return live.delivering(ctx, handle) if live is not None else contextlib.nullcontext()


async def on_codex_event(ctx: TurnContext, note: Notification) -> None:
    if ctx.live is not None:
        ctx.live.on_notification(note)  # the runner's event stream, the files Codex saved
    if note.method == "item/completed" and note.item is not None:
        observed = tool_call_observed(note.item, thread_id=note.thread_id, turn_id=note.turn_id)
        if observed is not None:
            ctx.observations.emit("after_tool_call", ctx.hooks.after_tool_call, observed)
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
    """Mirror the turn into the transcript; for an engine, read back what the transcript then
    holds in the same worker-thread hop (the engine's finalize gets it: one hop, not two).
    The read-back is the session read cache's (O(new bytes)); like the mirror, it runs to
    its end even past the cleanup deadline (a hop is never abandoned)."""
    assert ctx.ran is not None
    codex = ctx.ran.codex
    params = ctx.params
    read_back = ctx.engine is not None

    def mirror_then_read() -> list[AgentMessage] | None:
        mirror_turn(
            ctx.session_file,
            _with_prompt_key(ctx, codex.messages_snapshot),
            scope=codex.idempotency_scope,
            # The prompt under the identity it was made durable with before the turn.
            identities=[ctx.prompt_identity, *codex.mirror_identities[1:]],
            session_id=params.session_id,
            cwd=os.fspath(params.workspace_dir),
        )
        return read_history_sync(ctx) if read_back else None  # never raises: None, logged

    try:
        snapshot = await run_in_worker(mirror_then_read)
    except Exception as error:
        ctx.log.warning("failed to mirror codex app-server transcript", error=format_error(error))
        ctx.mirror = Mirrored(ok=False, error=format_error(error))
        return T.MIRROR_FAILED
    ctx.mirror = Mirrored(ok=True, snapshot=snapshot)
    return T.MIRRORED


async def finalize(ctx: TurnContext) -> TurnTrigger:
    """Hand the turn to the engine: ``commit_turn`` from the outbox for an engine with
    durable turns (:func:`_settle`), else after_turn, else ingest_batch, else ingest."""
    engine = ctx.engine
    if engine is None:
        return T.FINALIZED
    assert ctx.ran is not None
    codex = ctx.ran.codex
    # The transcript as the mirror left it (read back in its hop); else history + this turn.
    snapshot = ctx.mirror.snapshot if ctx.mirror is not None else None
    fallback = snapshot is None
    if snapshot is None:
        snapshot = [*ctx.messages, *codex.messages_snapshot]
    outcome = ctx.outcome()
    if ctx.durable_turns:
        return await _settle(ctx, snapshot, fallback)
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
            is_heartbeat=ctx.params.heartbeat,
        ),
    )
    if finalized is None:  # it timed out
        return FINALIZE_TRIGGERS[False]
    ctx.log.info(
        "codex context engine finalize " + ("completed" if finalized.succeeded else "failed"),
        path=finalized.path,
        new_messages=finalized.new_message_count,
        fallback_snapshot=fallback,
    )
    return FINALIZE_TRIGGERS[finalized.succeeded]


async def _settle(ctx: TurnContext, snapshot: list[AgentMessage], fallback: bool) -> TurnTrigger:
    """Finalize for an engine with durable turns: settle the turn from the outbox with
    ``commit_turn`` (``duplicate`` is success); a commit that fails or times out leaves the
    entry for recovery, and the turn takes the finalize failure edge."""
    assert ctx.engine is not None
    assert ctx.ran is not None
    codex = ctx.ran.codex
    outcome = ctx.outcome()
    settled = await engine_call(
        ctx,
        "finalize",
        settle_turn(
            engine=ctx.engine.engine,
            advancement_key=ctx.advancement_key,
            prompt_key=ctx.known_prompt_key,
            messages=snapshot,
            fallback_start=len(ctx.messages) if fallback else ctx.pre_prompt_count,
            terminal=TERMINAL_OF_OUTCOME[outcome] if outcome is not None else "interrupted",
            error=codex.prompt_error,
            session_id=ctx.params.session_id,
            session_key=ctx.session_key,
            session_file=ctx.session_file,
            runtime_context=runtime_context(ctx, usage=codex.usage),
            token_budget=ctx.params.context_token_budget,
            is_heartbeat=ctx.params.heartbeat,
        ),
    )
    succeeded = settled is not None and settled.succeeded
    ctx.log.info(
        "codex context engine turn " + ("committed" if succeeded else "not committed"),
        status=settled.status if settled is not None else "timed_out",
        advancement_key=ctx.advancement_key,
        fallback_snapshot=fallback,
    )
    return FINALIZE_TRIGGERS[succeeded]


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
    if ctx.may(T.MAINTENANCE_DEFERRED):  # the table's fact: deferred to a scheduler
        assert ctx.scheduler is not None
        deferred = defer_maintenance(ctx.scheduler, **request)
        ending = deferred.ending  # deferred, or dropped by the scheduler
        if ending == "dropped":
            assert deferred.schedule is not None
            # Handed to the scheduler, which dropped it: nothing will run.
            reason = f"scheduler_{deferred.schedule.value}"
            ctx.maintenance = MaintenanceReport(status="skipped", skip_reason=reason)
        else:
            ctx.maintenance = MaintenanceReport(status="deferred")
        return MAINTENANCE_TRIGGERS[ending]
    ran: MaintenanceOutcome | None = await engine_call(
        ctx, "maintain", call_maintenance(reason="turn", **request)
    )
    # None: it timed out. ``skipped`` (no maintain to call, though the turn began with one:
    # the facts said it maintains) did not run either.
    status = ran.status if ran is not None and ran.status != "skipped" else "failed"
    ctx.maintenance = MaintenanceReport(status="ran" if status == "ran" else "failed")
    return MAINTENANCE_TRIGGERS[status]
