"""The turn orchestrator: :func:`run_codex_turn` drives one turn through the turn machine.

Theory of operation. A turn is the pipeline of ``codex_turn.fsm.turn``; this module is its
I/O half. For every stage it awaits the work (read the transcript, call the engine, talk to
the app-server, append the mirror), then fires the past-tense trigger that says what happened.
It never decides a branch itself: it asks the turn machine (``turn.allows(...)``) whether a
stage applies, and the thread table (``codex_turn.fsm.thread``) whether to start, resume or
rotate the Codex thread and whether to project. Errors from below are mapped once, here, into
stage outcomes: an engine or hook failure is a logged fallback, never a failed turn.

Order (OpenClaw's, reference 2.1): build the dynamic tools first so assemble sees their
names; decide ``had_session_file`` before anything is written; read history; bootstrap and
re-read; assemble; project (``system_prompt_addition`` appended to the base instructions);
before_prompt_build hooks on the projected prompt; start/resume/rotate with the final
developer instructions (re-sent on resume, ``personality: "none"``); run the turn; mirror the
RAW prompt and Codex's reply; finalize from the re-read transcript (or history + snapshot when
the mirror failed); maintain or skip, as the table says.

The snowball fix (reference 4.1-4.6) is the thread decision: projected context enters a thread
once, when the thread starts, and a resumed thread gets the raw prompt while the engine's
projection epoch holds; per-turn projections always get a fresh thread.

Cancellation: cancelling the caller's scope interrupts the Codex turn. Once a turn ran,
mirroring and finalizing always run to completion, shielded; only when the caller is gone do
they get a bound (``cleanup_timeout``), after which the stage cut short ends as failed.
Maintenance is skipped as aborted, ``on_turn_end`` (when given) receives the result, and the
cancellation then propagates. Each engine call is bounded by ``engine_timeout``: a hung engine
takes its stage's failure edge instead of holding the session.

Concurrency: a turn holds its session's gate (``_gates``, shared with compaction). A second turn
on the same session file waits (``concurrency="wait"``, bounded by ``session_wait_timeout``) or
is refused with :class:`~codex_turn.fsm.TurnBusy`; deferred maintenance waits for the gate too.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, Literal, TypeVar

import anyio
import attrs

from codex_turn._log import format_error, get_logger, mask_session_key, sensitive
from codex_turn.fsm import (
    TraceEntry,
    TurnFacts,
    TurnModel,
    TurnOutcome,
    TurnState,
    TurnTrigger,
)
from codex_turn.fsm.thread import ThreadAction, ThreadDecision, ThreadFacts, decide_thread
from codex_turn.harness._gates import hold_session
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
from codex_turn.harness.engine import (
    AgentMessage,
    AssembleResult,
    ContextEngineInfo,
    InvalidEngineResult,
    engine_id,
    engine_info,
    is_active_engine,
    optional_method,
)
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
    BootstrapOutcome,
    MaintenanceOutcome,
    RuntimeContextFree,
    ScheduleResult,
    assemble_context_engine,
    bootstrap_context_engine,
    build_runtime_context_from_usage,
    finalize_context_engine_turn,
    run_context_engine_maintenance,
    strip_runtime_context_messages,
)
from codex_turn.harness.session import MessageHistory, load_session_context, mirror_turn
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

__all__ = [
    "TURN_START_TEXT_MAX_CHARS",
    "MaintenanceReport",
    "TurnParams",
    "TurnResult",
    "run_codex_turn",
]

_log = get_logger(__name__)
_T = TypeVar("_T")

#: Codex refuses larger turn/start text; older context is cut first (OpenClaw's bound).
TURN_START_TEXT_MAX_CHARS: Final = 1 << 20
_YIELD_TOOL: Final = "sessions_yield"
_NO_TOOLS: Final = dynamic_tools_fingerprint(())


@attrs.frozen(kw_only=True)
class TurnParams:
    """Everything one turn needs from the runner. Only the first four are required."""

    session_id: str
    session_file: str | os.PathLike[str]
    workspace_dir: str | os.PathLike[str]
    prompt: str
    #: The run's session key: engines are bound to it (OpenClaw test A6).
    session_key: str | None = None
    #: The sandbox's session key when it differs: reaches the engine only as a runtime-context
    #: fact (``sandboxSessionKey``), never as the session key its calls are bound to.
    sandbox_session_key: str | None = None
    #: Image inputs as URLs (``data:<mime>;base64,...`` included).
    images: tuple[str, ...] = ()
    model: str | None = None
    context_token_budget: int | None = None
    reserve_tokens: int | None = None
    citations_mode: str | None = None
    #: The host's base developer instructions (OpenClaw's preamble, skills, overlays ...).
    base_developer_instructions: str | None = None
    extra_developer_instructions: str | None = None
    auth_profile_id: str | None = None
    #: Host facts for the engine's runtime context, OpenClaw's camelCase keys.
    runtime_attempt: Mapping[str, Any] = attrs.field(factory=dict)
    turn_timeout: float = 600.0
    idle_timeout: float = 120.0
    #: Bound on the shielded mirror + finalize after a cancellation or crash.
    cleanup_timeout: float = 30.0
    #: Bound on each engine lifecycle call (bootstrap, assemble, finalize, maintain); a call
    #: that takes longer takes its stage's failure edge. ``None``: unbounded.
    engine_timeout: float | None = 300.0
    concurrency: Literal["wait", "reject"] = "wait"
    session_wait_timeout: float = 30.0
    #: Offer the ``sessions_yield`` tool: the model may end the run early (yield-aborted).
    yield_tool: bool = False

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            raise TypeError("TurnParams.prompt must be a string")
        if not self.session_id.strip():
            raise ValueError("TurnParams.session_id must not be blank")
        if self.engine_timeout is not None and not self.engine_timeout > 0:
            raise ValueError("TurnParams.engine_timeout must be positive (or None)")
        for name in ("turn_timeout", "idle_timeout", "cleanup_timeout", "session_wait_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TurnParams.{name} must be positive")


@attrs.frozen(kw_only=True)
class MaintenanceReport:
    """What happened to turn maintenance: ``ran``, ``failed``, ``deferred``, ``skipped`` (with
    the reason) or ``cancelled`` (the caller left before it ran)."""

    status: Literal["ran", "failed", "deferred", "skipped", "cancelled"]
    skip_reason: str | None = None


@attrs.frozen(kw_only=True)
class TurnResult:
    outcome: TurnOutcome
    assistant_text: str | None
    prompt_error: str | None
    usage: Usage | None
    thread_id: str | None
    turn_id: str | None
    messages_snapshot: list[AgentMessage]
    maintenance: MaintenanceReport
    thread_decision: ThreadDecision | None
    projected: bool
    native_compactions: int
    trace: tuple[TraceEntry, ...]

    @property
    def durations_ms(self) -> dict[str, float]:
        """Time spent in each state, from the FSM trace (internal transitions included)."""
        spent: dict[str, float] = {}
        for entry, following in zip(self.trace, self.trace[1:], strict=False):
            spent[entry.dest] = (
                spent.get(entry.dest, 0.0) + (following.monotonic_ns - entry.monotonic_ns) / 1e6
            )
        return spent


# --- the turn ------------------------------------------------------------------------------


@attrs.define
class _Turn:
    """Mutable state of one run; the stage methods below each end by firing a trigger."""

    params: TurnParams
    app_server: AppServer
    engine: object | None
    hooks: TurnHooks
    scheduler: BackgroundMaintenance | None
    tools: list[DynamicTool]
    fsm: TurnModel
    log: Any
    session_file: str
    history: list[AgentMessage] = attrs.Factory(list)
    pre_prompt_count: int = 0
    assembly: AssembleResult | None = None
    projection: CodexContextProjection | None = None
    decision: ThreadDecision | None = None
    prompt_text: str = ""
    developer_instructions: str | None = None
    hook_result: PromptBuildResult = attrs.Factory(PromptBuildResult)
    binding: ThreadBinding | None = None
    thread_id: str | None = None
    codex: CodexTurnResult | None = None
    yield_requested: bool = False
    #: The live Codex turn (the yield tool interrupts it).
    live_handle: Any = None
    #: Why no Codex turn could be started (thread/start or turn/start failed).
    start_error: str | None = None
    #: The started or resumed thread, and a bootstrap projection to record once Codex
    #: accepted this turn's input (see stage_start_thread).
    thread_result: ThreadResult | None = None
    pending_projection: ProjectionBinding | None = None
    maintenance: MaintenanceReport = attrs.Factory(
        lambda: MaintenanceReport(status="skipped", skip_reason=None)
    )

    # -- helpers ------------------------------------------------------------------------

    def fire(self, trigger: TurnTrigger) -> None:
        self.fsm.fire(trigger)

    @property
    def engine_active(self) -> bool:
        return self.fsm.facts.engine_active

    @property
    def bootstrap_epoch(self) -> str | None:
        """The epoch of a ``thread_bootstrap`` assembly (non-blank), else ``None``."""
        mode = self.assembly.context_projection if self.assembly is not None else None
        if mode is None or mode.mode != "thread_bootstrap" or not mode.epoch:
            return None
        return mode.epoch if mode.epoch.strip() else None

    @property
    def has_projected_context(self) -> bool:
        """The projection framed assembled history (it is more than the prompt alone)."""
        return (
            self.projection is not None
            and self.projection.prompt_text != self.params.prompt.strip()
        )

    @property
    def projected(self) -> bool:
        """This turn sends the engine's framed context to Codex."""
        return self.decision is not None and self.decision.project and self.has_projected_context

    def runtime_context(self, *, usage: Usage | None = None) -> dict[str, Any]:
        attempt = {
            "sessionKey": self.params.session_key,
            "sandboxSessionKey": self.params.sandbox_session_key,
            "provider": "codex",
            "model": self.params.model,
            "authProfileId": self.params.auth_profile_id,
            "agentHarnessId": "codex-app-server",
            **self.params.runtime_attempt,
        }
        return build_runtime_context_from_usage(
            last_call_usage=usage,
            attempt=attempt,
            workspace_dir=os.fspath(self.params.workspace_dir),
            token_budget=self.params.context_token_budget,
        )

    async def engine_call(self, stage: str, call: Awaitable[_T]) -> _T | None:
        """Await one lifecycle call of the engine, bounded by ``engine_timeout``.

        ``None`` (logged) when it timed out: the caller takes the stage's failure edge, so a
        hung engine cannot hold the session forever.
        """
        limit = self.params.engine_timeout
        if limit is None:
            return await call
        with anyio.move_on_after(limit):
            return await call
        self.log.warning("context engine call timed out", stage=stage, seconds=limit)
        return None

    def read_history_sync(self) -> list[AgentMessage] | None:
        """The stripped history, or ``None`` (logged) when the transcript cannot be read.

        Runs in a worker thread. A read failure must stay a failure (OpenClaw's ``undefined``):
        finalizing from an empty "history" would hand the engine nothing (#121515).
        """
        try:
            return _stripped_histories.read(self.session_file)
        except Exception as error:
            self.log.warning(
                "failed to read mirrored session history for codex harness hooks",
                error=format_error(error),
            )
            return None

    async def read_history(self) -> list[AgentMessage] | None:
        return await anyio.to_thread.run_sync(self.read_history_sync)

    def base_instructions(self) -> str | None:
        return join_sections(
            self.params.base_developer_instructions, self.params.extra_developer_instructions
        )

    # -- stages -------------------------------------------------------------------------

    @property
    def needs_history(self) -> bool:
        """Only an engine and hooks read the mirrored history; plain Codex never needs it."""
        hooks = self.hooks
        return self.engine_active or bool(
            hooks.before_prompt_build or hooks.before_compaction or hooks.after_compaction
        )

    async def stage_read_history(self) -> None:
        wanted = self.needs_history

        # One worker-thread hop for both reads (read_binding never raises).
        def read_both() -> tuple[list[AgentMessage] | None, ThreadBinding | None]:
            history = self.read_history_sync() if wanted else []
            return history, read_binding(self.session_file)

        history, self.binding = await anyio.to_thread.run_sync(read_both)
        if history is None:
            self.fire(TurnTrigger.HISTORY_READ_FAILED)
        else:
            self.history = history
            self.fire(TurnTrigger.HISTORY_READ)

    async def stage_bootstrap(self) -> None:
        if not self.fsm.allows(TurnTrigger.BOOTSTRAPPED):
            self.fire(TurnTrigger.BOOTSTRAP_SKIPPED)
            return
        self.log.debug("codex context engine bootstrap started")
        outcome = await self.engine_call(
            "bootstrap",
            bootstrap_context_engine(
                engine=self.engine,
                session_id=self.params.session_id,
                session_key=self.params.session_key,
                session_file=self.session_file,
                had_session_file=self.fsm.facts.had_session_file,
                runtime_context=self.runtime_context(),
            ),
        )
        if outcome is None:
            outcome = BootstrapOutcome(status="failed", error="timed out")
        # Bootstrap may have written to the transcript (OpenClaw test A3): read it again,
        # keeping the previous history if the re-read fails. A skipped bootstrap called
        # nothing, so the history is unchanged.
        if outcome.status != "skipped":
            reread = await self.read_history()
            if reread is not None:
                self.history = reread
        self.log.info(
            "codex context engine bootstrap "
            + ("failed" if outcome.status == "failed" else "completed"),
            status=outcome.status,
            history_messages=len(self.history),
        )
        self.fire(
            TurnTrigger.BOOTSTRAP_FAILED if outcome.status == "failed" else TurnTrigger.BOOTSTRAPPED
        )

    async def stage_assemble(self) -> None:
        self.pre_prompt_count = len(self.history)
        if not self.fsm.allows(TurnTrigger.ASSEMBLED):
            self.fire(TurnTrigger.ASSEMBLE_SKIPPED)
            return
        outcome = await self.engine_call(
            "assemble",
            assemble_context_engine(
                engine=self.engine,
                session_id=self.params.session_id,
                session_key=self.params.session_key,
                messages=self.history,
                token_budget=self.params.context_token_budget,
                available_tools=[t.name for t in self.tools],
                citations_mode=self.params.citations_mode,
                model=self.params.model,
                prompt=self.params.prompt,
            ),
        )
        if outcome is None or outcome.status != "assembled" or outcome.result is None:
            self.fire(TurnTrigger.ASSEMBLE_FAILED)
            return
        self.assembly = outcome.result
        self.log.info(
            "codex context engine assemble applied",
            assembled_messages=len(outcome.result.messages),
            estimated_tokens=outcome.result.estimated_tokens,
            has_system_prompt_addition=bool(
                outcome.result.system_prompt_addition
                and outcome.result.system_prompt_addition.strip()
            ),
        )
        self.fire(TurnTrigger.ASSEMBLED)

    def tools_fingerprint(self) -> str:
        # From the very specs sent on thread/start, so the two can never drift apart.
        return dynamic_tools_fingerprint(unstructure(t.spec()) for t in self.tools)

    def current_projection(self) -> ProjectionBinding | None:
        """The projection block this turn's assembly asks for (thread_bootstrap only)."""
        epoch = self.bootstrap_epoch
        if epoch is None or self.assembly is None or self.assembly.context_projection is None:
            return None
        return ProjectionBinding(
            mode="thread_bootstrap",
            epoch=epoch,
            fingerprint=self.assembly.context_projection.fingerprint,
        )

    def engine_binding(self, projection: ProjectionBinding | None) -> ContextEngineBinding | None:
        if not self.engine_active:
            return None
        info = engine_info(self.engine)
        policy = context_engine_policy_fingerprint(
            engine_id=info.id,
            engine_version=info.version,
            owns_compaction=info.owns_compaction,
            turn_maintenance_mode=info.turn_maintenance_mode,
            citations_mode=self.params.citations_mode,
            context_token_budget=self.params.context_token_budget,
            projection_max_chars=max_rendered_context_chars(
                self.params.context_token_budget, self.params.reserve_tokens
            ),
        )
        return ContextEngineBinding(
            engine_id=info.id, policy_fingerprint=policy, projection=projection
        )

    def thread_facts(self) -> ThreadFacts:
        binding = self.binding
        wanted = self.engine_binding(None)
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
        epoch = self.bootstrap_epoch
        return ThreadFacts(
            bound=binding is not None,
            tools_match=binding is None
            or fingerprints_compatible(binding.dynamic_tools_fingerprint, self.tools_fingerprint()),
            tools_dropped=binding is not None
            and binding.dynamic_tools_fingerprint not in (None, "", _NO_TOOLS)
            and self.tools_fingerprint() == _NO_TOOLS,
            engine_match=engine_match,
            thread_bootstrap=epoch is not None,
            epoch_match=epoch is not None
            and bound_projection is not None
            and bound_projection.mode == "thread_bootstrap"
            and bound_projection.epoch == epoch,
            per_turn=self.assembly is not None and epoch is None,
            has_context=self.has_projected_context,
        )

    async def stage_project(self) -> None:
        """Projection (pure) and the thread decision it feeds; the decision is made for
        every turn, with or without an engine."""
        base = self.base_instructions()
        self.prompt_text = self.params.prompt
        self.developer_instructions = base
        if self.fsm.state is not TurnState.PROJECTING:
            self.decision = decide_thread(self.thread_facts())
            return
        assert self.assembly is not None
        project = (
            project_thread_bootstrap_assembly
            if self.bootstrap_epoch is not None
            else project_context_engine_assembly
        )
        # The framed context must fit Codex's turn input next to the prompt: cap the context,
        # never cut the frame (its header and safety note are the prompt-injection guard).
        frame_and_prompt = len(frame_context("x", self.params.prompt.strip())) - 1
        try:
            projection = project(
                assembled_messages=self.assembly.messages,
                original_history_messages=self.history,
                prompt=self.params.prompt,
                system_prompt_addition=self.assembly.system_prompt_addition,
                token_budget=self.params.context_token_budget,
                reserve_tokens=self.params.reserve_tokens,
                max_context_chars=max(0, TURN_START_TEXT_MAX_CHARS - frame_and_prompt),
            )
        except Exception as error:
            self.log.warning(ASSEMBLE_FAILED_WARNING, error=format_error(error), stage="projection")
            self.decision = decide_thread(self.thread_facts())
            self.fire(TurnTrigger.PROJECTION_FAILED)
            return
        self.projection = projection
        self.decision = decide_thread(self.thread_facts())
        self.apply_projection()
        self.pre_prompt_count = projection.pre_prompt_message_count
        self.log.info(
            "codex app-server context-engine projection decision",
            reason=self.decision.reason,
            action=self.decision.action.value,
            projected=self.projected,
            truncated_chars=projection.truncated_chars,
        )
        self.fire(TurnTrigger.PROJECTED)

    def apply_projection(self) -> None:
        assert self.projection is not None
        assert self.decision is not None
        # The engine's addition goes AFTER the base instructions (OpenClaw; PI prepends).
        self.developer_instructions = join_sections(
            self.base_instructions(), self.projection.developer_instruction_addition
        )
        self.prompt_text = (
            self.projection.prompt_text if self.decision.project else self.params.prompt.strip()
        )

    async def stage_build_prompt(self) -> None:
        if self.hooks.before_prompt_build:
            self.hook_result = await run_before_prompt_build(
                self.hooks.before_prompt_build,
                PromptBuildContext(
                    session_id=self.params.session_id,
                    session_key=self.params.session_key,
                    prompt=self.prompt_text,
                    developer_instructions=self.developer_instructions,
                    messages=tuple(self.history),
                ),
            )
        self.finish_prompt()
        self.fire(TurnTrigger.PROMPT_BUILT)

    def finish_prompt(self) -> None:
        prompt, instructions = compose_prompt(
            self.prompt_text, self.developer_instructions, self.hook_result
        )
        if len(prompt) > TURN_START_TEXT_MAX_CHARS:
            prompt, dropped = truncate_older(prompt, TURN_START_TEXT_MAX_CHARS)
            self.log.warning("codex turn input truncated", dropped_chars=dropped)
        self.prompt_text, self.developer_instructions = prompt, instructions

    async def clear_binding_quietly(self) -> None:
        """A binding is an optimisation: failing to remove one never fails a turn."""
        try:
            await anyio.to_thread.run_sync(clear_binding, self.session_file)
        except Exception as error:
            self.log.warning("failed to clear codex app-server binding", error=format_error(error))

    async def stage_start_thread(self) -> None:
        decision = self.decision
        assert decision is not None
        common: dict[str, Any] = {
            "developer_instructions": self.developer_instructions,
            "cwd": os.fspath(self.params.workspace_dir),
            "model": self.params.model,
            "tools": self.tools,
        }
        result: ThreadResult | None = None
        if decision.action is ThreadAction.RESUME:
            assert self.binding is not None
            try:
                result = await self.app_server.resume_thread(self.binding.thread_id, **common)
            except AppServerError as error:
                self.log.warning(
                    "codex app-server thread resume failed; starting a new thread",
                    thread_id=self.binding.thread_id,
                    error=format_error(error),
                )
                await self.clear_binding_quietly()
                # The fresh thread has no native history: it needs the projected context.
                self.decision = decision = ThreadDecision(
                    ThreadAction.ROTATE, True, "resume-failed"
                )
                if self.projection is not None:
                    self.apply_projection()
                    self.finish_prompt()
                    common["developer_instructions"] = self.developer_instructions
        if result is not None:
            trigger = TurnTrigger.THREAD_RESUMED
            # The thread keeps the projection it carries (a matching epoch, or none).
            bound = self.binding.context_engine if self.binding is not None else None
            kept = bound.projection if bound is not None else None
            await self.save_binding(result, resumed=True, projection=kept)
        else:
            trigger = TurnTrigger.THREAD_STARTED
            retired: str | None = None
            if decision.action is ThreadAction.ROTATE:
                trigger = TurnTrigger.THREAD_ROTATED
                if self.binding is not None:
                    retired = self.binding.thread_id
                    await self.clear_binding_quietly()
            try:
                result = await self.app_server.start_thread(**common)
            except AppServerError as error:
                self.log.warning("codex app-server thread start failed", error=format_error(error))
                self.start_error = format_error(error)
                self.fire(TurnTrigger.THREAD_START_FAILED)
                return
            # A transient thread serves this turn only: the binding keeps the tooled thread.
            if decision.action is not ThreadAction.TRANSIENT:
                # A bootstrap epoch is recorded only once Codex accepted the turn that carries
                # its context (stage_run_turn): recorded earlier, a failed turn/start would make
                # the next turn resume a thread that never received it (OpenClaw #88355).
                self.pending_projection = self.current_projection()
                await self.save_binding(result, resumed=False, projection=None)
            if retired is not None:
                # The old thread runs no more turns: release what the client keeps for it.
                self.app_server.forget_thread(retired)
        self.thread_result = result
        self.thread_id = result.thread_id
        self.log = self.log.bind(thread_id=self.thread_id)
        self.log.info(
            "codex app-server thread "
            + {
                TurnTrigger.THREAD_STARTED: "started",
                TurnTrigger.THREAD_RESUMED: "resumed",
                TurnTrigger.THREAD_ROTATED: "rotated",
            }[trigger],
            reason=decision.reason,
        )
        self.fire(trigger)

    async def save_binding(
        self, result: ThreadResult, *, resumed: bool, projection: ProjectionBinding | None
    ) -> None:
        """Write the binding for ``result``'s thread (skipped when nothing changed)."""
        previous = self.binding if resumed else None
        decision = self.decision
        fields: dict[str, Any] = {
            "thread_id": result.thread_id,
            "cwd": os.fspath(self.params.workspace_dir),
            "auth_profile_id": self.params.auth_profile_id
            or (self.binding.auth_profile_id if self.binding is not None else None),
            "model": result.model or self.params.model,
            "model_provider": result.model_provider,
            "dynamic_tools_fingerprint": self.tools_fingerprint(),
            "context_engine": self.engine_binding(projection),
            # Why this thread exists: the decision that started or rotated to it (a resume
            # keeps the record of the thread it resumed).
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
            return
        try:
            await anyio.to_thread.run_sync(write_binding, self.session_file, binding)
        except Exception as error:
            self.log.warning("failed to write codex app-server binding", error=format_error(error))
            return
        self.binding = binding

    async def stage_run_turn(self) -> None:
        assert self.thread_id is not None
        handle_box: list[Any] = []

        async def on_event(note: Notification) -> None:
            await self.on_codex_event(note)

        cancelled = anyio.get_cancelled_exc_class()
        try:
            async with self.app_server.turn(
                self.thread_id,
                self.prompt_text,
                prompt=self.params.prompt,
                images=self.params.images,
                model=self.params.model,
            ) as handle:
                handle_box.append(handle)
                self.live_handle = handle
                if self.pending_projection is not None and self.thread_result is not None:
                    # Codex accepted the input that carries the epoch's context: record it.
                    await self.save_binding(
                        self.thread_result, resumed=True, projection=self.pending_projection
                    )
                    self.pending_projection = None
                self.codex = await handle.collect(
                    on_event=on_event,
                    idle_timeout=self.params.idle_timeout,
                    timeout=self.params.turn_timeout,
                )
        except cancelled:
            # The client already sent turn/interrupt (once, shielded) on the way out.
            self.codex = self.partial_result(handle_box, CodexTurnStatus.INTERRUPTED, None)
            self.fire(
                TurnTrigger.TURN_YIELD_ABORTED if self.yield_requested else TurnTrigger.TURN_ABORTED
            )
            raise
        except AppServerError as error:
            closed = isinstance(error, AppServerClosed)
            message = "codex app-server closed" if closed else format_error(error)
            self.codex = self.partial_result(handle_box, CodexTurnStatus.FAILED, message)
            self.log.warning(
                "codex app-server closed during the turn"
                if closed
                else "codex app-server turn failed",
                error=format_error(error),
            )
            self.fire(TurnTrigger.TURN_FAILED)
            return
        except Exception as error:
            # Anything else (a protocol shape we cannot read, a failing event hook) is still
            # a turn that ran: it fails, and mirroring and finalizing follow.
            self.codex = self.partial_result(
                handle_box, CodexTurnStatus.FAILED, format_error(error)
            )
            self.log.warning("codex turn failed unexpectedly", error=format_error(error))
            self.fire(TurnTrigger.TURN_FAILED)
            return
        finally:
            self.live_handle = None
            if self.decision is not None and self.decision.action is ThreadAction.TRANSIENT:
                self.app_server.forget_thread(self.thread_id)  # it runs no other turn
        self.log = self.log.bind(turn_id=self.codex.turn_id)
        status = self.codex.outcome
        if status is CodexTurnStatus.COMPLETED:
            self.fire(TurnTrigger.TURN_COMPLETED)
        elif status is CodexTurnStatus.FAILED:
            self.fire(TurnTrigger.TURN_FAILED)
        elif status is CodexTurnStatus.TIMED_OUT:
            self.fire(TurnTrigger.TURN_TIMED_OUT)
        elif self.yield_requested:
            self.fire(TurnTrigger.TURN_YIELD_ABORTED)
        else:
            self.fire(TurnTrigger.TURN_ABORTED)

    async def on_codex_event(self, note: Notification) -> None:
        phase = note.compaction_phase
        if phase is None:
            return
        item = note.item
        item_id = item.get("id") if item is not None and isinstance(item.get("id"), str) else None
        turn_id = self.codex.turn_id if self.codex is not None else note.turn_id
        event = CompactionHookEvent(
            phase="start" if phase == "started" else "end",
            thread_id=self.thread_id or "",
            turn_id=turn_id,
            item_id=item_id,
            messages=tuple(self.history),
        )
        if phase == "started":
            self.fire(TurnTrigger.NATIVE_COMPACTION_STARTED)
            hooks = self.hooks.before_compaction
        else:
            self.fire(TurnTrigger.NATIVE_COMPACTION_COMPLETED)
            hooks = self.hooks.after_compaction
        self.log.info("codex native compaction during turn", phase=event.phase, item_id=item_id)
        for hook in hooks:
            try:
                await hook(event)
            except Exception as error:
                self.log.warning(
                    "compaction hook failed", phase=event.phase, error=format_error(error)
                )
        sink = self.hooks.on_compaction_event
        if sink is None:
            return
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
        if self.engine_active and engine_info(self.engine).owns_compaction:
            # Codex compacted natively although the engine owns compaction: say so, so that
            # this is never reported as an engine compaction.
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
        for diagnostic in diagnostics:
            try:
                await sink(diagnostic)
            except Exception as error:
                self.log.warning("compaction diagnostic sink failed", error=format_error(error))

    async def stage_mirror(self) -> None:
        codex = self.codex
        assert codex is not None
        try:
            await anyio.to_thread.run_sync(
                lambda: mirror_turn(
                    self.session_file,
                    codex.messages_snapshot,
                    scope=codex.idempotency_scope,
                    identities=codex.mirror_identities,
                    session_id=self.params.session_id,
                    cwd=os.fspath(self.params.workspace_dir),
                )
            )
        except Exception as error:
            self.log.warning(
                "failed to mirror codex app-server transcript", error=format_error(error)
            )
            self.fire(TurnTrigger.MIRROR_FAILED)
            return
        self.fire(TurnTrigger.MIRRORED)

    async def stage_finalize(self) -> None:
        if not self.engine_active:
            self.fire(TurnTrigger.FINALIZED)
            return
        codex = self.codex
        assert codex is not None
        mirrored = self.fsm.trace[-1].trigger == TurnTrigger.MIRRORED
        snapshot = await self.read_history() if mirrored else None
        fallback = snapshot is None
        if fallback:
            snapshot = [*self.history, *codex.messages_snapshot]
        outcome = await self.engine_call(
            "finalize",
            finalize_context_engine_turn(
                engine=self.engine,
                session_id=self.params.session_id,
                session_key=self.params.session_key,
                session_file=self.session_file,
                messages_snapshot=snapshot or [],
                pre_prompt_message_count=self.pre_prompt_count,
                prompt_error=self.fsm.outcome is not None and self.fsm.outcome.prompt_error,
                aborted=self.fsm.outcome is not None and self.fsm.outcome.aborted,
                yield_aborted=self.fsm.outcome is not None and self.fsm.outcome.yield_aborted,
                token_budget=self.params.context_token_budget,
                runtime_context=self.runtime_context(usage=codex.usage),
                run_maintenance=False,  # the turn machine decides; see stage_maintain
                snapshot_is_fallback=fallback,
            ),
        )
        if outcome is None:
            self.fire(TurnTrigger.FINALIZE_FAILED)
            return
        self.log.info(
            "codex context engine finalize " + ("completed" if outcome.succeeded else "failed"),
            path=outcome.path,
            new_messages=outcome.new_message_count,
            fallback_snapshot=fallback,
        )
        self.fire(outcome.trigger)

    async def stage_maintain(self) -> None:
        if self.fsm.state is not TurnState.MAINTAINING:
            reason = self.fsm.skip_reason.value if self.fsm.skip_reason else None
            self.maintenance = MaintenanceReport(status="skipped", skip_reason=reason)
            self.log.info("codex context engine turn maintenance skipped", reason=reason)
            return
        codex = self.codex
        timed: MaintenanceOutcome | None = await self.engine_call(
            "maintain",
            run_context_engine_maintenance(
                engine=self.engine,
                reason="turn",
                session_id=self.params.session_id,
                session_key=self.params.session_key,
                session_file=self.session_file,
                runtime_context=self.runtime_context(usage=codex.usage if codex else None),
                scheduler=self.scheduler,
            ),
        )
        outcome = timed or MaintenanceOutcome(status="failed", reason="turn", error="timed out")
        if outcome.status == "deferred" and outcome.schedule in (
            ScheduleResult.REJECTED,
            ScheduleResult.CLOSED,
        ):
            # Handed to the scheduler, which dropped it: nothing will run.
            reason = f"scheduler_{outcome.schedule.value}"
            self.maintenance = MaintenanceReport(status="skipped", skip_reason=reason)
        else:
            status = outcome.status if outcome.status != "skipped" else "failed"
            self.maintenance = MaintenanceReport(status=status)
        trigger = outcome.trigger or TurnTrigger.MAINTENANCE_FAILED
        if not self.fsm.allows(trigger):
            # The engine's maintenance mode disagreed with the turn's facts. Maintenance never
            # fails a turn: record what the table allows, loudly.
            allowed = next(
                t
                for t in (TurnTrigger.MAINTENANCE_DEFERRED, TurnTrigger.MAINTENANCE_FAILED)
                if self.fsm.allows(t)
            )
            self.log.warning(
                "turn maintenance outcome does not match the maintenance mode",
                outcome=outcome.status,
                recorded=allowed.value,
            )
            trigger = allowed
        self.fire(trigger)

    async def mirror_and_finalize(self) -> None:
        await self.stage_mirror()
        await self.stage_finalize()

    def end_cut_stage(self) -> None:
        """End a cleanup stage cut short (by the caller's cancellation or the cleanup
        deadline) as failed, so the trace is a complete path, the result is delivered, and
        nothing maintains after an interrupted finalize."""
        for state, trigger in (
            (TurnState.MIRRORING, TurnTrigger.MIRROR_FAILED),
            (TurnState.FINALIZING, TurnTrigger.FINALIZE_FAILED),
            (TurnState.MAINTAINING, TurnTrigger.MAINTENANCE_FAILED),
            (TurnState.MAINTAINING, TurnTrigger.MAINTENANCE_DEFERRED),
        ):
            if self.fsm.state is state and self.fsm.allows(trigger):
                self.log.warning("codex turn cleanup cut short", stage=state.value)
                if state is TurnState.MAINTAINING:
                    self.maintenance = MaintenanceReport(status="cancelled")
                self.fire(trigger)

    def partial_result(
        self, handle_box: list[Any], status: CodexTurnStatus, error: str | None
    ) -> CodexTurnResult:
        """What Codex produced before the turn was cut short: at least the user's prompt,
        which is mirrored like any other (a crash must not lose what the user said)."""
        if handle_box:
            handle = handle_box[0]
            if handle.result is not None and status is CodexTurnStatus.INTERRUPTED:
                finished: CodexTurnResult = handle.result
                return finished
            built: CodexTurnResult = handle.projector.build_result(outcome=status, error=error)
            return built
        # turn/start itself never answered: nothing but the prompt exists, and Codex gave the
        # turn no id. Run-unique identities keep the mirror's idempotency keys from matching
        # an earlier such turn on this thread (which would silently drop this prompt).
        projector = TurnProjector(
            thread_id=self.thread_id or "",
            prompt=self.params.prompt,
            provider="codex",
            model=self.params.model,
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

    def result(self) -> TurnResult:
        codex = self.codex
        outcome = self.fsm.outcome or TurnOutcome.CANCELLED
        prompt_error = codex.prompt_error if codex is not None else self.start_error
        if outcome is TurnOutcome.THREAD_START_FAILED and prompt_error is None:
            prompt_error = "codex app-server thread start failed"
        return TurnResult(
            outcome=outcome,
            assistant_text=codex.final_text if codex is not None else None,
            prompt_error=prompt_error,
            usage=codex.usage if codex is not None else None,
            thread_id=self.thread_id,
            turn_id=codex.turn_id if codex is not None else None,
            messages_snapshot=list(codex.messages_snapshot) if codex is not None else [],
            maintenance=self.maintenance,
            thread_decision=self.decision,
            projected=self.projected,
            native_compactions=self.fsm.native_compactions,
            trace=tuple(self.fsm.trace),
        )


class _StrippedHistories:
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


_stripped_histories = _StrippedHistories()


def _yield_tool(turn: _Turn) -> DynamicTool:
    async def request_yield(_arguments: dict[str, Any]) -> str:
        turn.yield_requested = True
        handle = turn.live_handle
        if handle is not None:
            # Interrupting while this tool call is unanswered is safe (Codex ends the turn).
            await handle.interrupt()
        return "yielding the turn"

    return DynamicTool(
        name=_YIELD_TOOL,
        description="End this run now and yield control back to the user.",
        input_schema={"type": "object", "properties": {}},
        fn=request_yield,
    )


async def run_codex_turn(
    params: TurnParams,
    *,
    app_server: AppServer,
    engine: object | None = None,
    tools: Sequence[DynamicTool] = (),
    hooks: TurnHooks | None = None,
    maintenance_scheduler: BackgroundMaintenance | None = None,
    on_turn_end: Callable[[TurnResult], Awaitable[None]] | None = None,
) -> TurnResult:
    """Run one turn of a Codex session through the turn machine (see the module docstring).

    Returns the :class:`TurnResult` for every outcome that reached a decision, including
    failed, aborted and timed-out turns. Raises :class:`~codex_turn.fsm.TurnBusy` when
    another turn holds the session file (``concurrency="reject"``, or the wait timed out).
    A cancellation of the caller propagates after the shielded cleanup; ``on_turn_end`` sees
    the result in that case too.
    """
    session_file = os.fspath(params.session_file)
    async with hold_session(
        session_file,
        lane=params.session_key or params.session_id,
        wait=params.concurrency,
        wait_timeout=params.session_wait_timeout,
    ):
        with sensitive(params.prompt):
            return await _run_locked(
                params,
                session_file=session_file,
                app_server=app_server,
                engine=engine,
                tools=tools,
                hooks=hooks or TurnHooks(),
                scheduler=maintenance_scheduler,
                on_turn_end=on_turn_end,
            )


async def _run_locked(
    params: TurnParams,
    *,
    session_file: str,
    app_server: AppServer,
    engine: object | None,
    tools: Sequence[DynamicTool],
    hooks: TurnHooks,
    scheduler: BackgroundMaintenance | None,
    on_turn_end: Callable[[TurnResult], Awaitable[None]] | None,
) -> TurnResult:
    active = is_active_engine(engine)
    info: ContextEngineInfo | None = None
    if active:
        try:
            info = engine_info(engine)
        except InvalidEngineResult as error:
            # An engine we cannot describe cannot be driven: the turn runs as plain Codex.
            _log.warning(
                "context engine has an invalid info; running the turn without it",
                engine=engine_id(engine),
                error=format_error(error),
            )
            active = False
    if engine is not None and not active:
        # OpenClaw bug #77185/#971: an engine silently not in use looks like "memory ignored".
        _log.warning(
            "context engine selected but not active for this turn", engine=engine_id(engine)
        )
    # Decide had_session_file before this turn writes anything (reference 2.1 step 4).
    try:
        had_session_file = (await anyio.Path(session_file).stat()) is not None
    except FileNotFoundError:
        had_session_file = False
    facts = TurnFacts(
        engine_active=active,
        had_session_file=had_session_file,
        engine_maintains=active and optional_method(engine, "maintain") is not None,
        # Deferring needs somewhere to run: without a scheduler the lifecycle runs background
        # maintenance inline (it reports "ran"/"failed", never "deferred").
        background_maintenance=info is not None
        and info.turn_maintenance_mode == "background"
        and scheduler is not None,
    )
    log = _log.bind(
        session_id=params.session_id,
        session_key=mask_session_key(params.session_key),
        engine=engine_id(engine) if active else None,
    )
    dynamic_tools = list(tools)
    turn = _Turn(
        params=params,
        app_server=app_server,
        engine=engine if active else None,
        hooks=hooks,
        scheduler=scheduler,
        tools=dynamic_tools,
        fsm=TurnModel.begin(facts),
        log=log,
        session_file=session_file,
    )
    if params.yield_tool:
        dynamic_tools.append(_yield_tool(turn))
    started = time.monotonic()
    cancelled = anyio.get_cancelled_exc_class()
    turn.fire(TurnTrigger.STARTED)
    try:
        try:
            await turn.stage_read_history()
            await turn.stage_bootstrap()
            await turn.stage_assemble()
            await turn.stage_project()
            await turn.stage_build_prompt()
            await turn.stage_start_thread()
        except cancelled:
            with anyio.CancelScope(shield=True):
                if turn.fsm.allows(TurnTrigger.CANCELLED):
                    turn.fire(TurnTrigger.CANCELLED)
                await _deliver(turn, on_turn_end)
            raise
        if turn.fsm.state is TurnState.FAILED:
            return await _deliver(turn, on_turn_end)
        cancelled_during_turn: BaseException | None = None
        try:
            await turn.stage_run_turn()
        except cancelled as error:
            cancelled_during_turn = error
        # Mirror and finalize always follow a turn that ran: a cancellation, before or during
        # them, cannot lose the user's prompt or the engine's view of the turn; it only bounds
        # them (cleanup_timeout), then propagates.
        cancellation = await _protected(
            turn.mirror_and_finalize,
            bound=params.cleanup_timeout,
            caller_gone=cancelled_during_turn is not None,
        )
        cancellation = cancelled_during_turn or cancellation
        if cancellation is None:
            try:
                await turn.stage_maintain()
            except cancelled as error:  # the caller left during foreground maintenance
                cancellation = error
        turn.end_cut_stage()
        if cancellation is not None:
            if not any(e.dest == TurnState.MAINTAINING.name for e in turn.fsm.trace):
                await turn.stage_maintain()  # an aborted turn never maintains: records the skip
            with anyio.CancelScope(shield=True):
                await _deliver(turn, on_turn_end)
            raise cancellation
        return await _deliver(turn, on_turn_end)
    finally:
        turn.fsm.close()
        turn.log.info(
            "codex turn finished",
            state=turn.fsm.state_name,
            outcome=turn.fsm.outcome.value if turn.fsm.outcome else None,
            skip_reason=turn.fsm.skip_reason.value if turn.fsm.skip_reason else None,
            native_compactions=turn.fsm.native_compactions,
            duration_ms=round((time.monotonic() - started) * 1000, 1),
            durations_ms={k: round(v, 2) for k, v in turn.result().durations_ms.items()},
        )


async def _protected(
    work: Callable[[], Awaitable[None]], *, bound: float, caller_gone: bool
) -> BaseException | None:
    """Run ``work`` to completion despite the caller's cancellation, within ``bound``.

    The work runs shielded in a child task. Unbounded while the caller waits (an engine's
    ``after_turn`` may legitimately take long); once the caller is gone, already or meanwhile,
    it gets ``bound`` more seconds and is then cut (the cut stage is ended as failed by the
    caller). Returns the caller's cancellation, to be re-raised after the result is delivered.
    """
    cancelled = anyio.get_cancelled_exc_class()
    scope = anyio.CancelScope(shield=True)
    if caller_gone:
        scope.deadline = anyio.current_time() + bound
    done = anyio.Event()
    caught: list[BaseException] = []
    failures: list[Exception] = []

    async def worker() -> None:
        with scope:
            try:
                await work()
            except Exception as error:  # re-raised below, outside the task group
                failures.append(error)
            finally:
                done.set()

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(worker)
            try:
                await done.wait()
            except cancelled as error:
                caught.append(error)
                scope.deadline = min(scope.deadline, anyio.current_time() + bound)
                with anyio.CancelScope(shield=True):
                    await done.wait()
                raise
    except cancelled as error:
        if not caught:
            caught.append(error)
    if failures:
        raise failures[0]
    return caught[0] if caught else None


async def _deliver(
    turn: _Turn, on_turn_end: Callable[[TurnResult], Awaitable[None]] | None
) -> TurnResult:
    result = turn.result()
    if on_turn_end is not None:
        try:
            await on_turn_end(result)
        except Exception as error:
            turn.log.warning("on_turn_end callback failed", error=format_error(error))
    return result
