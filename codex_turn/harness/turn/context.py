"""What a turn's stages share: the :class:`TurnContext`, the records that flow between the
stages, and the small pure helpers several stages use (the thread facts, the prompt plan, the
engine's binding record, the bounded engine call, the stripped-history reader).

Every record is frozen and set once by the stage that produces it (see
:mod:`codex_turn.harness.turn.stages`); the context's inputs are read-only. Nothing here fires a
trigger or decides a branch: the thread facts are gathered here (:class:`TurnThreadFacts`,
whose one costly fact renders the frame when the table first reads it) and the thread table
(:data:`codex_turn.fsm.thread.THREAD_RULES`) decides.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

import anyio
import attrs

from codex_turn._log import format_error
from codex_turn.fsm import TurnFacts, TurnOutcome, TurnTrigger
from codex_turn.fsm.thread import ThreadDecision
from codex_turn.harness._fs import run_in_worker
from codex_turn.harness.appserver import (
    AppServerPort,
    CodexTurnResult,
    CodexTurnStatus,
    DynamicTool,
    KeptFork,
    ThreadResult,
    TurnHandlePort,
    TurnProjector,
)
from codex_turn.harness.appserver.thread_settings import RUNTIME_POLICY
from codex_turn.harness.binding import (
    BINDING_SCHEMA_VERSION,
    ContextEngineBinding,
    HistoryCoverage,
    ProjectionBinding,
    ThreadBinding,
    ThreadDecisionRecord,
    context_engine_policy_fingerprint,
    write_binding,
)
from codex_turn.harness.collaboration import HeartbeatRecorder
from codex_turn.harness.engine import (
    AgentMessage,
    AssembleResult,
    EngineHandle,
    TranscriptReadFence,
    declares_durable_turns,
)
from codex_turn.harness.history_cache import StrippedHistories
from codex_turn.harness.hooks import (
    PromptBuildResult,
    TurnHooks,
    compose_prompt,
    join_sections,
)
from codex_turn.harness.host_llm import CodexHostLlm, host_capabilities
from codex_turn.harness.idempotency import STABLE_PROMPT_SCOPE, advancement_key_for
from codex_turn.harness.lifecycle import (
    AssembleFacts,
    BackgroundMaintenance,
    harness_runtime_context,
)
from codex_turn.harness.observations import Observations
from codex_turn.harness.turn.continuity import Coverage, coverage_of
from codex_turn.harness.turn_api import (
    TURN_START_TEXT_MAX_CHARS,
    InvalidTurnParams,
    MaintenanceReport,
    TurnParams,
)
from codex_turn.harness.usage import Usage

if TYPE_CHECKING:
    from codex_turn.harness.turn.steering import LiveTurn
from codex_turn.projection import (
    CodexContextProjection,
    dynamic_tools_fingerprint,
    max_rendered_context_chars,
    truncate_older,
)
from codex_turn.projection.items import ConversionCache, ConvertedItems

__all__ = [
    "Assembled",
    "CodexRan",
    "HistoryRead",
    "Mirrored",
    "Projected",
    "PromptPlan",
    "Stage",
    "StrippedHistories",
    "ThreadReady",
    "TurnContext",
    "YieldSwitch",
    "current_projection",
    "partial_result",
    "save_binding",
    "yield_tool",
]

_T = TypeVar("_T")
YIELD_TOOL: Final = "sessions_yield"


# --- what flows between stages --------------------------------------------------------------


@attrs.frozen
class HistoryRead:
    """The mirrored history (stripped of hidden runtime context), the thread binding, and
    what of that history the bound thread lacks (:mod:`codex_turn.harness.turn.continuity`)."""

    messages: list[AgentMessage]
    binding: ThreadBinding | None
    coverage: Coverage = attrs.Factory(Coverage)

    @classmethod
    def of(
        cls, messages: list[AgentMessage], binding: ThreadBinding | None, prompt_key: str | None
    ) -> HistoryRead:
        return cls(messages, binding, coverage_of(messages, binding, prompt_key=prompt_key))


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
    #: ``False``: no frame was rendered, because the thread decision could not send one, or
    #: the context goes as items (``projection`` holds the prompt and instruction addition
    #: only); see stages.project.
    framed: bool = True
    #: The structured form: the assembly as Responses items, for a fork (``None``: text).
    items: ConvertedItems | None = None
    #: The conversion state ``items`` came from, carried to the session's next turn with the
    #: fork kept after this one (an unchanged prefix is not converted again).
    conversion: ConversionCache | None = None
    #: Images of the transcript's messages the text frame stands for (it renders them as a
    #: placeholder): sent with the prompt, newest first, within a bound.
    images: tuple[str, ...] = ()


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
    #: How much of the transcript the thread holds once Codex accepted this turn's input
    #: (what the turn carries of it included), to record then.
    pending_coverage: HistoryCoverage | None = None
    #: The turn runs in a fork of the session's base: what it holds before the turn (kept
    #: for the next turn, with the turn's own items, once the turn ends; see forms.settle_fork).
    fork: KeptFork | None = None

    @property
    def thread_id(self) -> str:
        return self.result.thread_id


@attrs.frozen
class CodexRan:
    codex: CodexTurnResult


@attrs.frozen
class Mirrored:
    ok: bool
    #: Why the transcript could not take this turn (redacted), when it could not.
    error: str | None = None
    #: The stripped history as the mirror left it, read back in the mirror's own hop for the
    #: engine's finalize; ``None`` without an engine, or when that read failed (logged).
    snapshot: list[AgentMessage] | None = attrs.field(default=None, eq=False, repr=False)


_IDEMPOTENCY_KEY = re.compile(r"[A-Za-z0-9._-]{1,128}")


def prompt_identity_for(idempotency_key: str | None) -> str:
    """The prompt's mirror identity: stable for a host's turn id (a re-run of the turn after
    a crash mirrors its prompt once), else run-unique. Refuses a malformed key."""
    if idempotency_key is None:
        return f"run-{uuid.uuid4().hex}:prompt"
    if not isinstance(idempotency_key, str) or not _IDEMPOTENCY_KEY.fullmatch(idempotency_key):
        raise InvalidTurnParams(
            "idempotency_key must be 1-128 characters of [A-Za-z0-9._-] (or None)"
        )
    return f"turn-{idempotency_key}:prompt"


@attrs.define(eq=False)
class YieldSwitch:
    """The ``sessions_yield`` tool's link into the running turn (an event from Codex, so it
    is the one mutable piece: the tool sets it while the turn runs)."""

    requested: bool = False
    live_handle: TurnHandlePort | None = None


class TurnRecord(Protocol):
    """What the turn machine recorded that the thread facts read (one record of each fact:
    the machine's, set when the trigger fired)."""

    @property
    def resume_failed(self) -> bool: ...

    @property
    def fork_failed(self) -> bool: ...

    @property
    def overflowed(self) -> bool: ...


@attrs.define(eq=False)
class TurnContext:
    """One turn's inputs, read-only, and one slot per stage record."""

    params: TurnParams
    app_server: AppServerPort
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
    #: What the turn machine recorded (Codex refused this turn's resume or fork).
    turn: TurnRecord
    switch: YieldSwitch = attrs.Factory(YieldSwitch)
    #: The turn's observers (telemetry: scheduled, bounded, never awaited by the turn).
    observations: Observations = attrs.Factory(lambda: Observations(timeout=2.0))
    #: Where a heartbeat turn's ``heartbeat_respond`` records the model's answer.
    heartbeat: HeartbeatRecorder = attrs.Factory(HeartbeatRecorder)
    # Stage records, in the order the stages set them.
    history: HistoryRead | None = None
    assembled: Assembled | None = None
    projected: Projected | None = None
    #: The thread decision, taken once the assembly is projected (or, without one, when the
    #: prompt is built); taken again only after Codex refused the resume or the fork.
    decision: ThreadDecision | None = None
    plan: PromptPlan | None = None
    thread: ThreadReady | None = None
    ran: CodexRan | None = None
    mirror: Mirrored | None = None
    maintenance: MaintenanceReport | None = None
    #: Why no Codex thread or turn could be started.
    start_error: str | None = None
    #: The typed error that refused the turn before anything reached Codex (re-raised).
    refusal: BaseException | None = None
    #: The idempotency identity of this run's prompt in the transcript: run-unique, known
    #: before Codex names the turn (the prompt is made durable before turn/start).
    prompt_identity: str = attrs.Factory(lambda: f"run-{uuid.uuid4().hex}:prompt")
    #: The key the prompt was made durable under, once it was: a turn retried on another
    #: thread (after an overflow) mirrors it under the same key, never a second time.
    durable_prompt_key: str | None = None
    #: The caller's cancellation, re-raised once the turn is delivered; and the deadline the
    #: cleanup stages share once the caller is gone.
    cancellation: BaseException | None = None
    cleanup_deadline: float | None = None
    #: The turn's link to the runner while it runs: messages steered into it, its event
    #: stream, the files Codex saved (:mod:`codex_turn.harness.turn.steering`); ``None``: none.
    live: LiveTurn | None = None
    _tools_fingerprint: str | None = attrs.field(default=None, init=False)

    @property
    def tools_fingerprint(self) -> str:
        """The fingerprint of this turn's tool specs (the tools never change within a turn;
        the thread decision, the resume and the binding all ask for it)."""
        if self._tools_fingerprint is None:
            # From the very specs sent on thread/start, so the two can never drift apart.
            self._tools_fingerprint = dynamic_tools_fingerprint(
                t.catalog_entry(self.params.tool_catalog) for t in self.tools
            )
        return self._tools_fingerprint

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
    def coverage(self) -> Coverage:
        return self.history.coverage if self.history is not None else Coverage()

    @property
    def known_prompt_key(self) -> str | None:
        """This turn's prompt key when it is thread-independent (the host's turn id: an
        earlier attempt of the turn may have made the prompt durable already), else ``None``
        (a run-unique key, which no transcript can hold before this run writes it)."""
        if not self.prompt_identity.startswith("turn-"):
            return self.durable_prompt_key
        # = idempotency.stable_prompt_key(the host's key)
        return f"{STABLE_PROMPT_SCOPE}:{self.prompt_identity}"

    @property
    def durable_turns(self) -> bool:
        """The engine declared transcript semantics: it is settled with ``commit_turn``,
        from the outbox (:mod:`codex_turn.harness.durable_turns`), and assembles fenced."""
        return self.engine is not None and declares_durable_turns(self.engine.info)

    @property
    def advancement_key(self) -> str:
        """This logical turn's advancement key (stable across retries of the turn)."""
        return advancement_key_for(self.prompt_identity)

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
    workspace = os.fspath(params.workspace_dir)
    llm = None
    if "runtime-llm-complete" in host_capabilities(ctx.app_server):
        # The session's own app-server, on an ephemeral thread per call (host_llm).
        llm = CodexHostLlm(ctx.app_server, model=params.model, cwd=workspace)  # type: ignore[arg-type]
    return harness_runtime_context(
        cwd=workspace,
        llm=llm,
        session_key=ctx.session_key,
        sandbox_session_key=params.sandbox_session_key,
        model=params.model,
        auth_profile_id=params.auth_profile_id,
        workspace_dir=os.fspath(params.workspace_dir),
        token_budget=params.context_token_budget,
        usage=usage,
        attempt=params.runtime_attempt,
    )


def assemble_facts(ctx: TurnContext) -> AssembleFacts:
    """The host's facts of this turn for ``assemble`` (the model and provider ids, the
    host's fallback and degraded reasons from ``runtime_attempt``, the sandbox, the runtime
    context, and the read fence: how much of the transcript ``messages`` is)."""
    params = ctx.params
    attempt = params.runtime_attempt
    messages = ctx.messages
    last = messages[-1] if messages else None
    entry = last.get("idempotencyKey") if isinstance(last, dict) else None

    def text(key: str) -> str | None:
        value = attempt.get(key)
        return value if isinstance(value, str) and value else None

    return AssembleFacts(
        model_id=params.model,
        provider_id=text("provider") or "codex",
        requested_model_id=text("requestedModelId"),
        fallback_reason=text("fallbackReason"),
        degraded_reason=text("degradedReason"),
        sandboxed=None if params.sandbox is None else params.sandbox != "danger-full-access",
        runtime_context=runtime_context(ctx),
        transcript_read_fence=TranscriptReadFence(
            message_count=len(messages), last_entry_id=entry if isinstance(entry, str) else None
        ),
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
    """The projection carries assembled history: items, or a frame that is more than the
    prompt alone (a projection not framed carries none in its prompt)."""
    projected = ctx.projected
    if projected is None:
        return False
    if projected.items is not None:
        return bool(projected.items.items)
    return projected.projection.prompt_text != ctx.params.prompt.strip()


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
        context=plan.decision.context.action.value if plan.decision.context else None,
        truncated_chars=ctx.projected.projection.truncated_chars if ctx.projected else 0,
    )


def current_projection(ctx: TurnContext) -> ProjectionBinding | None:
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
    tools_fingerprint: str | None,
    coverage: HistoryCoverage | None,
) -> ThreadBinding | None:
    """Write the binding for ``result``'s thread (skipped when nothing changed); the binding
    now in force, or ``previous`` when the write failed. ``coverage``: how much of the
    transcript the thread holds (:mod:`codex_turn.harness.turn.continuity`)."""
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
        # The turn's runtime policy (approval policy, sandbox, reviewer, service tier).
        **{name: getattr(params, name) for name in RUNTIME_POLICY},
        "dynamic_tools_fingerprint": tools_fingerprint,
        "context_engine": engine_record,
        # Why this thread exists: the decision that started or rotated to it (a resume keeps
        # the record of the thread it resumed).
        "session_id": params.session_id,
        "transcript_id": previous.transcript_id if previous is not None else None,
        "thread_decision": previous.thread_decision
        if previous is not None
        else ThreadDecisionRecord(action=decision.action.value, reason=decision.reason)
        if decision is not None
        else None,
        "history_covered_through": coverage,
        # A supervised binding stays supervised (its model stays locked).
        "supervised": previous.supervised if previous is not None else None,
    }
    if previous is not None:
        fields["created_at"] = previous.created_at
        if previous.schema_version == BINDING_SCHEMA_VERSION and all(
            getattr(previous, name) == value for name, value in fields.items()
        ):
            # A resume that changed nothing: skip the atomic rewrite (two fsyncs) every turn,
            # and the binding that would be built only to be compared. ``updatedAt``
            # therefore says when the binding last changed; ``session_file`` is the caller's.
            return previous
    binding = ThreadBinding(**fields)
    try:
        await run_in_worker(write_binding, ctx.session_file, binding)
    except Exception as error:
        ctx.log.warning("failed to write codex app-server binding", error=format_error(error))
        return previous
    return binding


def partial_result(
    ctx: TurnContext, handle_box: list[TurnHandlePort], status: CodexTurnStatus, error: str | None
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
        direct=True,  # a control the model must always see
    )
