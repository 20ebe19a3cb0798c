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

No engine
---------
``engine=None`` and the legacy engine (id ``"legacy"``) are *no engine*: every helper returns a
"skipped" outcome without touching the engine, so Codex sees exactly what it would without this
library.

Background maintenance
----------------------
An engine with ``info.turn_maintenance_mode == "background"`` asks not to be awaited after a
turn. :class:`BackgroundMaintenance` runs those maintenance calls in an anyio task group: one
run per session key at a time, requests that arrive meanwhile coalesced into one rerun with
the newest parameters, a bound on the number of sessions queued, a timeout per run, and
cancellation of everything on :meth:`BackgroundMaintenance.aclose`. A runner owns one scheduler
for its lifetime::

    async with BackgroundMaintenance() as maintenance:      # owns its task group
        while (turn := await next_turn()) is not None:
            ...
            await finalize_context_engine_turn(..., scheduler=maintenance)
        await maintenance.drain()        # optional: let queued maintenance finish first
    # leaving the block cancels what is still queued or running

or hands it a task group it already has: ``BackgroundMaintenance(task_group=tg)``, then
``await maintenance.aclose()`` before the group ends. Without a scheduler, background
maintenance runs inline (and says so at debug level): deferring needs somewhere to run.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Literal, Self

import anyio
import anyio.abc
import anyio.lowlevel
import attrs

from codex_turn._log import format_error, get_logger, mask_session_key
from codex_turn.fsm.turn import SkipReason, TurnTrigger, maintenance_skip_reason
from codex_turn.harness._gates import session_lane_busy
from codex_turn.harness.engine import (
    AfterTurnParams,
    AgentMessage,
    AssembleParams,
    AssembleResult,
    BootstrapParams,
    BootstrapResult,
    IngestBatchParams,
    IngestParams,
    InvalidEngineResult,
    MaintainParams,
    MaintenanceResult,
    RuntimeContext,
    TranscriptRewriteRequest,
    coerce_result,
    engine_id,
    engine_info,
    ensure_assemble_result,
    is_active_engine,
    optional_method,
)
from codex_turn.harness.usage import Usage

__all__ = [
    "ASSEMBLE_FAILED_WARNING",
    "RUNTIME_CONTEXT_CUSTOM_TYPE",
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
    "dispose_context_engine",
    "finalize_context_engine_turn",
    "run_context_engine_maintenance",
    "strip_runtime_context_messages",
]

_log = get_logger("codex_turn.harness.lifecycle")

#: The custom message type OpenClaw uses for hidden runtime context; never shown to engines.
RUNTIME_CONTEXT_CUSTOM_TYPE: Final = "openclaw.runtime-context"

# OpenClaw's log messages (reference 2.1-2.9); variable parts go into fields.
ASSEMBLE_FAILED_WARNING: Final = "context engine assemble failed; using Codex baseline prompt"
_BOOTSTRAP_FAILED: Final = "context engine bootstrap failed"
_AFTER_TURN_FAILED: Final = "context engine afterTurn failed"
_INGEST_FAILED: Final = "context engine ingest failed"
_MAINTAIN_FAILED: Final = "context engine maintain failed"
_MAINTENANCE_CHANGED: Final = "context engine maintenance changed transcript"

MaintenanceReason = Literal["bootstrap", "turn", "compaction"]
#: ``runtime_context["rewriteTranscriptEntries"]``: rewrites transcript entries for the engine.
TranscriptRewriter = Callable[[TranscriptRewriteRequest], Awaitable[MaintenanceResult]]


# --- Outcomes -------------------------------------------------------------------------------


@attrs.frozen
class MaintenanceOutcome:
    """What one maintenance request did. Maintenance never raises to the runner."""

    status: Literal["ran", "failed", "deferred", "skipped"]
    reason: MaintenanceReason
    result: MaintenanceResult | None = None
    #: Redacted error text when ``status == "failed"``.
    error: str | None = None
    #: For ``deferred``: how the scheduler took the request.
    schedule: ScheduleResult | None = None

    @property
    def trigger(self) -> TurnTrigger | None:
        """The turn machine's trigger for this outcome (``None`` when nothing was attempted)."""
        return {
            "ran": TurnTrigger.MAINTENANCE_RAN,
            "failed": TurnTrigger.MAINTENANCE_FAILED,
            "deferred": TurnTrigger.MAINTENANCE_DEFERRED,
        }.get(self.status)


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
        return {
            "bootstrapped": TurnTrigger.BOOTSTRAPPED,
            "failed": TurnTrigger.BOOTSTRAP_FAILED,
            "skipped": TurnTrigger.BOOTSTRAP_SKIPPED,
        }[self.status]


@attrs.frozen
class AssembleOutcome:
    status: Literal["assembled", "failed", "skipped"]
    result: AssembleResult | None = None
    error: str | None = None

    @property
    def trigger(self) -> TurnTrigger:
        return {
            "assembled": TurnTrigger.ASSEMBLED,
            "failed": TurnTrigger.ASSEMBLE_FAILED,
            "skipped": TurnTrigger.ASSEMBLE_SKIPPED,
        }[self.status]


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
        return TurnTrigger.FINALIZED if self.succeeded else TurnTrigger.FINALIZE_FAILED


# --- Helpers --------------------------------------------------------------------------------


class RuntimeContextFree(list[AgentMessage]):
    """A list known to hold no hidden runtime-context messages (the result of a strip).

    Passing one back in skips the scan: a runner that strips the history once per read
    saves two passes over a long transcript per turn. Still copied on the way through,
    so an engine that mutates its input cannot reach the runner's list.
    """


def strip_runtime_context_messages(messages: Iterable[AgentMessage]) -> RuntimeContextFree:
    """``messages`` without OpenClaw's hidden ``openclaw.runtime-context`` custom messages."""
    if isinstance(messages, RuntimeContextFree):
        return RuntimeContextFree(messages)
    # Test the exact type first (JSON messages are plain dicts): the abstract Mapping check
    # alone is ~3x slower per message, and this runs over the whole history.
    kept = [  # a list comprehension, then one C-level copy: faster than a generator
        m
        for m in messages
        if not (
            (type(m) is dict or isinstance(m, Mapping))
            and m.get("role") == "custom"
            and m.get("customType") == RUNTIME_CONTEXT_CUSTOM_TYPE
        )
    ]
    return RuntimeContextFree(kept)


def _fields(engine: object, session_key: str | None, **extra: Any) -> dict[str, Any]:
    return {"engine": engine_id(engine), "session_key": mask_session_key(session_key), **extra}


# --- Runtime context ------------------------------------------------------------------------


def _positive_floor(value: float | None) -> int | None:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    floored = math.floor(value)
    return floored if floored > 0 else None


def build_runtime_context(
    *,
    attempt: Mapping[str, Any] | None = None,
    workspace_dir: str | None = None,
    agent_dir: str | None = None,
    token_budget: float | None = None,
    current_token_count: float | None = None,
    prompt_cache: Mapping[str, Any] | None = None,
) -> RuntimeContext:
    """The runtime context an engine receives (OpenClaw's ``buildAfterTurnRuntimeContext``).

    ``attempt`` holds the host's facts about the run, under OpenClaw's camelCase keys
    (``sessionKey``, ``provider``, ``model``, ``messageChannel`` ...); ``None`` values are
    dropped. ``tokenBudget`` and ``currentTokenCount`` are added only when finite and > 0
    (floored); ``promptCache`` only when given: absent is not the same as zero.
    """
    context: RuntimeContext = {k: v for k, v in (attempt or {}).items() if v is not None}
    if workspace_dir is not None:
        context["workspaceDir"] = workspace_dir
    if agent_dir is not None:
        context["agentDir"] = agent_dir
    if (budget := _positive_floor(token_budget)) is not None:
        context["tokenBudget"] = budget
    if (count := _positive_floor(current_token_count)) is not None:
        context["currentTokenCount"] = count
    if prompt_cache is not None:
        context["promptCache"] = dict(prompt_cache)
    return context


def build_runtime_context_from_usage(
    *,
    last_call_usage: Usage | Mapping[str, Any] | None,
    attempt: Mapping[str, Any] | None = None,
    workspace_dir: str | None = None,
    agent_dir: str | None = None,
    token_budget: float | None = None,
    prompt_cache: Mapping[str, Any] | None = None,
) -> RuntimeContext:
    """:func:`build_runtime_context` with ``currentTokenCount`` from the last call's usage.

    ``last_call_usage`` is a :class:`~codex_turn.harness.usage.Usage` or Codex's breakdown
    (``tokenUsage.last``). The count is the prompt size, cached tokens counted once; a zero
    count leaves ``currentTokenCount`` out.
    """
    usage = (
        last_call_usage
        if isinstance(last_call_usage, Usage) or last_call_usage is None
        else Usage.from_codex(last_call_usage)
    )
    return build_runtime_context(
        attempt=attempt,
        workspace_dir=workspace_dir,
        agent_dir=agent_dir,
        token_budget=token_budget,
        current_token_count=usage.prompt_tokens if usage is not None else None,
        prompt_cache=prompt_cache,
    )


# --- Maintenance ----------------------------------------------------------------------------


async def run_context_engine_maintenance(
    *,
    engine: object | None,
    reason: MaintenanceReason,
    session_id: str,
    session_key: str | None,
    session_file: str,
    runtime_context: RuntimeContext | None = None,
    transcript_rewriter: TranscriptRewriter | None = None,
    scheduler: BackgroundMaintenance | None = None,
    background: bool = False,
) -> MaintenanceOutcome:
    """Run (or schedule) ``engine.maintain`` once; never raises an engine error.

    A ``reason="turn"`` request for an engine in background mode is handed to ``scheduler``
    and returns ``deferred``. ``background=True`` marks the call as the deferred run itself
    (the scheduler passes it): the engine then sees ``allowDeferredCompactionExecution``.
    ``transcript_rewriter`` becomes ``runtime_context["rewriteTranscriptEntries"]``.
    """
    maintain = optional_method(engine, "maintain") if is_active_engine(engine) else None
    if maintain is None:
        return MaintenanceOutcome(status="skipped", reason=reason)
    wants_background = _turn_maintenance_mode(engine) == "background"
    if reason == "turn" and wants_background and not background:
        if scheduler is not None:
            scheduled = scheduler.schedule(
                engine=engine,
                session_id=session_id,
                session_key=session_key,
                session_file=session_file,
                runtime_context=runtime_context,
                transcript_rewriter=transcript_rewriter,
            )
            return MaintenanceOutcome(status="deferred", reason=reason, schedule=scheduled)
        _log.debug(
            "context engine background maintenance has no scheduler; running inline",
            **_fields(engine, session_key, reason=reason),
        )

    context: RuntimeContext = dict(runtime_context or {})
    if transcript_rewriter is not None:
        context["rewriteTranscriptEntries"] = transcript_rewriter
    if background:
        context["allowDeferredCompactionExecution"] = True
    params = MaintainParams(
        session_id=session_id,
        session_key=session_key,
        session_file=session_file,
        runtime_context=context,
    )
    try:
        raw = await maintain(params)
        result = (
            None
            if raw is None
            else coerce_result(
                raw, MaintenanceResult, engine_id=engine_id(engine), method="maintain"
            )
        )
    except Exception as err:
        error = format_error(err)
        _log.warning(_MAINTAIN_FAILED, **_fields(engine, session_key, reason=reason, error=error))
        return MaintenanceOutcome(status="failed", reason=reason, error=error)
    if result is not None and result.changed:
        _log.info(
            _MAINTENANCE_CHANGED,
            **_fields(
                engine,
                session_key,
                reason=reason,
                rewritten_entries=result.rewritten_entries,
                bytes_freed=result.bytes_freed,
            ),
        )
    return MaintenanceOutcome(status="ran", reason=reason, result=result)


def _turn_maintenance_mode(engine: object) -> str:
    # engine_info, not getattr: an engine may describe itself with a camelCase mapping.
    try:
        return engine_info(engine).turn_maintenance_mode
    except InvalidEngineResult:
        return "foreground"


class ScheduleResult(enum.Enum):
    """How :meth:`BackgroundMaintenance.schedule` took a request."""

    STARTED = "started"  # a run for this session was started
    COALESCED = "coalesced"  # merged into the pending rerun of a session already scheduled
    REJECTED = "rejected"  # too many sessions queued; dropped (and logged)
    CLOSED = "closed"  # the scheduler is closed; dropped


@attrs.define
class _Request:
    engine: object
    session_id: str
    session_key: str | None
    session_file: str
    runtime_context: RuntimeContext | None
    transcript_rewriter: TranscriptRewriter | None


@attrs.define(eq=False)
class _Slot:
    """One session's work: the newest pending request, and the scope of its worker."""

    pending: _Request | None
    scope: anyio.CancelScope | None = None


class BackgroundMaintenance:
    """Deferred turn maintenance: per session one run at a time, reruns coalesced, bounded.

    * ``schedule`` never blocks. The first request for a session starts a worker; requests
      that arrive before the worker took the previous one replace it (the newest runtime
      context wins), so any number of requests during a run cause at most one rerun.
    * ``max_sessions`` bounds how many sessions may have work queued or running; beyond it a
      request is rejected and logged (the next turn asks again).
    * ``run_timeout`` bounds each run (``None``: no bound); a timed-out run is logged as a
      failed maintenance.
    * ``is_session_busy(key)`` (default: a turn or compaction of that session is running in
      this process) is polled every ``poll_interval`` seconds before a
      run starts, so maintenance waits for the session's lane to be idle (OpenClaw polls
      every 100 ms).
    * ``aclose`` cancels every queued and running run and refuses new ones; ``drain`` waits
      for the queue to empty.

    Use it as an async context manager (it then owns its task group), or pass a caller's
    ``task_group`` and call :meth:`aclose` before that group ends. See the module docstring.
    """

    def __init__(
        self,
        *,
        task_group: anyio.abc.TaskGroup | None = None,
        max_sessions: int = 64,
        run_timeout: float | None = 300.0,
        is_session_busy: Callable[[str], bool] | None = None,
        poll_interval: float = 0.1,
    ) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self._task_group = task_group
        self._exit_stack: contextlib.AsyncExitStack | None = None
        self._max_sessions = max_sessions
        self._run_timeout = run_timeout
        # By default a run waits until no turn or compaction of its session is in progress
        # in this process (OpenClaw waits for the session lane to be idle).
        self._is_session_busy = (
            is_session_busy if is_session_busy is not None else session_lane_busy
        )
        self._poll_interval = poll_interval
        self._slots: dict[str, _Slot] = {}
        self._idle: anyio.Event | None = None
        self._closed = False
        #: Counters for diagnostics and tests.
        self.runs = 0
        self.coalesced = 0
        self.rejected = 0

    async def __aenter__(self) -> Self:
        if self._task_group is None:
            stack = contextlib.AsyncExitStack()
            self._task_group = await stack.enter_async_context(anyio.create_task_group())
            self._exit_stack = stack
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        try:
            await self.aclose()
        finally:
            if self._exit_stack is not None:
                stack, self._exit_stack = self._exit_stack, None
                return await stack.__aexit__(exc_type, exc, tb)  # noqa: B012
        return None

    @property
    def closed(self) -> bool:
        return self._closed

    def pending_sessions(self) -> int:
        """Sessions with maintenance queued or running."""
        return len(self._slots)

    def schedule(
        self,
        *,
        engine: object,
        session_id: str,
        session_key: str | None,
        session_file: str,
        runtime_context: RuntimeContext | None = None,
        transcript_rewriter: TranscriptRewriter | None = None,
    ) -> ScheduleResult:
        """Queue turn maintenance for this session (see the class docstring)."""
        if self._closed:
            return ScheduleResult.CLOSED
        if self._task_group is None:
            raise RuntimeError(
                "BackgroundMaintenance is not running: use `async with` or pass task_group="
            )
        request = _Request(
            engine, session_id, session_key, session_file, runtime_context, transcript_rewriter
        )
        key = session_key or session_id
        slot = self._slots.get(key)
        if slot is not None:
            if slot.pending is not None:
                self.coalesced += 1
            slot.pending = request
            return ScheduleResult.COALESCED
        if len(self._slots) >= self._max_sessions:
            self.rejected += 1
            _log.warning(
                "context engine background maintenance rejected; too many sessions queued",
                **_fields(engine, session_key, max_sessions=self._max_sessions),
            )
            return ScheduleResult.REJECTED
        slot = _Slot(pending=request)
        self._slots[key] = slot
        if self._idle is None or self._idle.is_set():
            self._idle = anyio.Event()
        self._task_group.start_soon(self._worker, key, slot)
        return ScheduleResult.STARTED

    async def _worker(self, key: str, slot: _Slot) -> None:
        try:
            with anyio.CancelScope() as scope:
                slot.scope = scope
                while not self._closed and slot.pending is not None:
                    if self._is_session_busy is not None:
                        # The host's lane state is a plain predicate, so poll it (as OpenClaw
                        # does) rather than demand an event from every host.
                        while self._is_session_busy(key):  # noqa: ASYNC110
                            await anyio.sleep(self._poll_interval)
                    # Taken only now: requests that arrived while waiting are coalesced.
                    request = self._take(slot)
                    if request is None:
                        break
                    await self._run(request)
        except Exception as err:
            # Only host callbacks (is_session_busy) can get here; never crash the task group.
            _log.warning(
                "context engine background maintenance stopped",
                session_key=mask_session_key(key),
                error=format_error(err),
            )
        finally:
            if self._slots.get(key) is slot:
                del self._slots[key]
            if not self._slots and self._idle is not None:
                self._idle.set()

    def _take(self, slot: _Slot) -> _Request | None:
        """The newest pending request, unless the scheduler was closed meanwhile."""
        request, slot.pending = slot.pending, None
        return None if self._closed else request

    async def _run(self, request: _Request) -> None:
        self.runs += 1
        with anyio.move_on_after(self._run_timeout) as timeout:
            await run_context_engine_maintenance(
                engine=request.engine,
                reason="turn",
                session_id=request.session_id,
                session_key=request.session_key,
                session_file=request.session_file,
                runtime_context=request.runtime_context,
                transcript_rewriter=request.transcript_rewriter,
                background=True,
            )
        if timeout.cancelled_caught:
            _log.warning(
                _MAINTAIN_FAILED,
                **_fields(
                    request.engine,
                    request.session_key,
                    reason="turn",
                    error=f"TimeoutError: background maintenance exceeded {self._run_timeout}s",
                ),
            )

    async def drain(self) -> None:
        """Wait until no maintenance is queued or running."""
        while self._slots and self._idle is not None:
            await self._idle.wait()

    async def aclose(self) -> None:
        """Cancel queued and running maintenance and refuse new requests. Idempotent."""
        self._closed = True
        for slot in list(self._slots.values()):
            slot.pending = None
            if slot.scope is not None:
                slot.scope.cancel()
        # Workers not started yet see ``closed`` and return; the task group, ours or the
        # caller's, waits for every worker to unwind when it exits.
        await anyio.lowlevel.checkpoint()


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
    if not is_active_engine(engine):
        return BootstrapOutcome(status="skipped", skip_reason="no_engine")
    if not had_session_file:
        return BootstrapOutcome(status="skipped", skip_reason="no_session_file")
    bootstrap = optional_method(engine, "bootstrap")
    if bootstrap is None and optional_method(engine, "maintain") is None:
        return BootstrapOutcome(status="skipped", skip_reason="no_bootstrap_or_maintain")
    result: BootstrapResult | None = None
    try:
        if bootstrap is not None:
            raw = await bootstrap(
                BootstrapParams(
                    session_id=session_id, session_key=session_key, session_file=session_file
                )
            )
            if raw is not None:
                result = coerce_result(
                    raw, BootstrapResult, engine_id=engine_id(engine), method="bootstrap"
                )
    except Exception as err:
        error = format_error(err)
        _log.warning(_BOOTSTRAP_FAILED, **_fields(engine, session_key, error=error))
        return BootstrapOutcome(status="failed", error=error)
    maintenance = await run_context_engine_maintenance(
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
) -> AssembleOutcome:
    """Ask the engine for this turn's context; a failure means "use the baseline prompt".

    ``messages`` is the mirrored history (hidden runtime-context messages are stripped here);
    ``available_tools`` the names of the dynamic tools built for this turn (pass an empty
    iterable when tools are disabled: the engine then knows there are none); ``prompt`` the raw
    user prompt. An exception or an invalid result (:class:`InvalidEngineResult`) is logged as
    OpenClaw's ``"context engine assemble failed; using Codex baseline prompt"``.
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
    )
    try:
        assemble = optional_method(engine, "assemble")
        if assemble is None:
            raise InvalidEngineResult(engine_id(engine), "assemble", "the engine has no assemble")
        result = ensure_assemble_result(await assemble(params), engine_id=engine_id(engine))
    except Exception as err:
        error = format_error(err)
        _log.warning(ASSEMBLE_FAILED_WARNING, **_fields(engine, session_key, error=error))
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
            **_fields(engine, session_key),
        )
    count = max(0, min(pre_prompt_message_count, len(messages_snapshot)))
    before: list[AgentMessage]
    new: list[AgentMessage]
    if isinstance(messages_snapshot, RuntimeContextFree):  # already stripped: no rescan
        before, new = messages_snapshot[:count], messages_snapshot[count:]
    else:
        before = strip_runtime_context_messages(messages_snapshot[:count])
        new = strip_runtime_context_messages(messages_snapshot[count:])
    messages = before + new

    succeeded = True
    failures = 0
    after_turn = optional_method(engine, "after_turn")
    ingest_batch = optional_method(engine, "ingest_batch")
    path: Literal["after_turn", "ingest_batch", "ingest", "nothing_new"]
    if after_turn is not None:
        path = "after_turn"
        try:
            await after_turn(
                AfterTurnParams(
                    session_id=session_id,
                    session_key=session_key,
                    session_file=session_file,
                    messages=messages,
                    pre_prompt_message_count=len(before),
                    is_heartbeat=is_heartbeat,
                    token_budget=token_budget,
                    runtime_context=runtime_context,
                )
            )
        except Exception as err:
            succeeded, failures = False, 1
            _log.warning(
                _AFTER_TURN_FAILED, **_fields(engine, session_key, error=format_error(err))
            )
    elif not new:
        path = "nothing_new"
    elif ingest_batch is not None:
        path = "ingest_batch"
        try:
            await ingest_batch(
                IngestBatchParams(
                    session_id=session_id,
                    session_key=session_key,
                    messages=new,
                    is_heartbeat=is_heartbeat,
                )
            )
        except Exception as err:
            succeeded, failures = False, 1
            _log.warning(
                _INGEST_FAILED,
                **_fields(engine, session_key, method="ingest_batch", error=format_error(err)),
            )
    else:
        path = "ingest"
        ingest = optional_method(engine, "ingest")
        for index, message in enumerate(new):
            try:
                if ingest is None:
                    raise InvalidEngineResult(
                        engine_id(engine), "ingest", "the engine has no ingest"
                    )
                await ingest(
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
                _log.warning(
                    _INGEST_FAILED,
                    **_fields(
                        engine,
                        session_key,
                        method="ingest",
                        message_index=index,
                        error=format_error(err),
                    ),
                )

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
        _log.warning(
            "context engine dispose failed", engine=engine_id(engine), error=format_error(err)
        )
        return False
    return True
