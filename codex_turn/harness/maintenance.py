"""Engine maintenance: one call, a deferral, and the scheduler that runs deferred calls.

:func:`call_maintenance` calls ``engine.maintain`` once and maps its errors into a
:class:`MaintenanceOutcome` (``ran``/``failed``); it decides nothing. Whether turn maintenance
runs at all is the turn machine's guard ``maintenance_allowed``; whether it runs inline or is
deferred is the fact ``background_maintenance`` (:meth:`codex_turn.fsm.TurnFacts.gather`).
:func:`run_context_engine_maintenance` is the harness-neutral entry point for other runners:
it asks the same fact, then calls or defers.

An engine with ``info.turn_maintenance_mode == "background"`` asks not to be awaited after a
turn. :class:`BackgroundMaintenance` runs those calls in an anyio task group: one run per
session key at a time, requests that arrive meanwhile coalesced into one rerun with the
newest parameters, a bound on the number of sessions queued, a timeout per run, and
cancellation of everything on :meth:`BackgroundMaintenance.aclose`. A runner owns one
scheduler for its lifetime::

    async with BackgroundMaintenance() as maintenance:      # owns its task group
        while (turn := await next_turn()) is not None:
            await run_codex_turn(..., maintenance_scheduler=maintenance)
        await maintenance.drain()        # optional: let queued maintenance finish first
    # leaving the block cancels what is still queued or running

or hands it a task group it already has: ``BackgroundMaintenance(task_group=tg)``, then
``await maintenance.aclose()`` before the group ends. Without a scheduler, background
maintenance runs inline: deferring needs somewhere to run.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Final, Literal, Self

import anyio
import anyio.abc
import anyio.lowlevel
import attrs

from codex_turn._log import format_error, get_logger, mask_session_key
from codex_turn.fsm.turn import MAINTENANCE_TRIGGERS, TurnTrigger, defers_maintenance
from codex_turn.harness._gates import session_lane_busy
from codex_turn.harness.engine.contract import (
    InvalidEngineResult,
    MaintainParams,
    MaintenanceResult,
    RuntimeContext,
    TranscriptRewriteRequest,
)
from codex_turn.harness.engine.validation import (
    EngineHandle,
    coerce_result,
    engine_id,
    engine_log_fields,
    is_active_engine,
    optional_method,
)
from codex_turn.harness.violations import engine_fault, unwatched

__all__ = [
    "BackgroundMaintenance",
    "MaintenanceOutcome",
    "MaintenanceReason",
    "ScheduleResult",
    "TranscriptRewriter",
    "call_maintenance",
    "defer_maintenance",
    "run_context_engine_maintenance",
]

_log = get_logger("codex_turn.harness.lifecycle")

_MAINTAIN_FAILED: Final = "context engine maintain failed"
_MAINTENANCE_CHANGED: Final = "context engine maintenance changed transcript"

MaintenanceReason = Literal["bootstrap", "turn", "compaction"]
#: ``runtime_context["rewriteTranscriptEntries"]``: rewrites transcript entries for the engine.
TranscriptRewriter = Callable[[TranscriptRewriteRequest], Awaitable[MaintenanceResult]]


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
    def ending(self) -> Literal["ran", "failed", "deferred", "dropped", "skipped"]:
        """``status``, with a deferral the scheduler dropped (rejected, or closed) told apart:
        how the request ended, in the words of ``fsm.turn.MAINTENANCE_TRIGGERS``."""
        if self.status == "deferred" and self.schedule in _DROPPED_SCHEDULES:
            return "dropped"
        return self.status

    @property
    def trigger(self) -> TurnTrigger | None:
        """The turn machine's trigger for this outcome (``fsm.turn.MAINTENANCE_TRIGGERS``;
        ``None`` when nothing was attempted)."""
        return MAINTENANCE_TRIGGERS.get(self.ending)


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
    and returns ``deferred`` (the turn machine's rule,
    :func:`~codex_turn.fsm.turn.defers_maintenance`).
    ``background=True`` marks the call as the deferred run itself (the scheduler passes it):
    the engine then sees ``allowDeferredCompactionExecution``. ``transcript_rewriter``
    becomes ``runtime_context["rewriteTranscriptEntries"]``.
    """
    handle = _handle_or_none(engine)
    if handle is None or optional_method(engine, "maintain") is None:
        return MaintenanceOutcome(status="skipped", reason=reason)
    defer = (
        reason == "turn"
        and not background
        and defers_maintenance(
            maintenance_mode=handle.info.turn_maintenance_mode,
            has_scheduler=scheduler is not None,
        )
    )
    if defer:
        assert scheduler is not None
        return defer_maintenance(
            scheduler,
            engine=engine,
            session_id=session_id,
            session_key=session_key,
            session_file=session_file,
            runtime_context=runtime_context,
            transcript_rewriter=transcript_rewriter,
        )
    return await call_maintenance(
        engine=engine,
        reason=reason,
        session_id=session_id,
        session_key=session_key,
        session_file=session_file,
        runtime_context=runtime_context,
        transcript_rewriter=transcript_rewriter,
        background=background,
    )


def defer_maintenance(
    scheduler: BackgroundMaintenance,
    *,
    engine: object,
    session_id: str,
    session_key: str | None,
    session_file: str,
    runtime_context: RuntimeContext | None = None,
    transcript_rewriter: TranscriptRewriter | None = None,
) -> MaintenanceOutcome:
    """Hand turn maintenance to ``scheduler``: ``deferred``, with how the scheduler took it."""
    scheduled = scheduler.schedule(
        engine=engine,
        session_id=session_id,
        session_key=session_key,
        session_file=session_file,
        runtime_context=runtime_context,
        transcript_rewriter=transcript_rewriter,
    )
    return MaintenanceOutcome(status="deferred", reason="turn", schedule=scheduled)


async def call_maintenance(
    *,
    engine: object,
    reason: MaintenanceReason,
    session_id: str,
    session_key: str | None,
    session_file: str,
    runtime_context: RuntimeContext | None = None,
    transcript_rewriter: TranscriptRewriter | None = None,
    background: bool = False,
) -> MaintenanceOutcome:
    """Call ``engine.maintain`` now: ``ran`` or ``failed`` (``skipped`` only for an engine
    without ``maintain``). No decision here: whether to maintain, and when, is the caller's."""
    maintain = optional_method(engine, "maintain")
    if maintain is None:
        return MaintenanceOutcome(status="skipped", reason=reason)
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
        error = engine_fault(
            _log,
            _MAINTAIN_FAILED,
            engine=engine,
            method="maintain",
            error=err,
            session_key=session_key,
            reason=reason,
        )
        return MaintenanceOutcome(status="failed", reason=reason, error=error)
    if result is not None and result.changed:
        _log.info(
            _MAINTENANCE_CHANGED,
            **engine_log_fields(
                engine,
                session_key,
                reason=reason,
                rewritten_entries=result.rewritten_entries,
                bytes_freed=result.bytes_freed,
            ),
        )
    return MaintenanceOutcome(status="ran", reason=reason, result=result)


def _handle_or_none(engine: object | None) -> EngineHandle | None:
    # A broken info reads as foreground (the engine is still maintained, inline).
    if not is_active_engine(engine):
        return None
    try:
        return EngineHandle.of(engine)
    except InvalidEngineResult:
        return EngineHandle.unchecked(engine)


class ScheduleResult(enum.Enum):
    """How :meth:`BackgroundMaintenance.schedule` took a request."""

    STARTED = "started"  # a run for this session was started
    COALESCED = "coalesced"  # merged into the pending rerun of a session already scheduled
    REJECTED = "rejected"  # too many sessions queued; dropped (and logged)
    CLOSED = "closed"  # the scheduler is closed; dropped


#: How a scheduler takes a request it drops: nothing will run.
_DROPPED_SCHEDULES: Final = frozenset({ScheduleResult.REJECTED, ScheduleResult.CLOSED})


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
                **engine_log_fields(engine, session_key, max_sessions=self._max_sessions),
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
        # Deferred: outside the turn that asked for it, so outside its contract watch.
        with unwatched(), anyio.move_on_after(self._run_timeout) as timeout:
            await call_maintenance(
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
                **engine_log_fields(
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
