"""Compaction of a Codex session: the engine's ``compact()`` first, Codex native second.

Two compaction systems exist and must never be silently conflated: the context engine's
``compact()`` (it rewrites the engine's own memory) and Codex's native
``thread/compact/start`` (it replaces the thread's history with a model-written summary).
:func:`compact_codex_session` runs one compaction request through the compaction machine
(:mod:`codex_turn.fsm.compaction`) on the driver the turn runs on too
(:func:`codex_turn.harness.driver.drive`): every non-final state has a stage (``_STAGES``)
that does the step's I/O and returns its past-tense trigger, read from the machine's result
maps; the native step carries out what the machine's native rule table decides for the
binding (``_NATIVE_ACTIONS``). Nothing here chooses a route; the trace of every run is a
legal path of the table.

Policy (OpenClaw PR #70809, ``maybeCompactCodexAppServerSession``; reference 2.10)
------------------------------------------------------------------------------------
* **An owning engine** (active, ``info.owns_compaction``) compacts first, with the token
  budget, the current token count, ``compaction_target`` ``"threshold"`` for a manual request
  and ``"budget"`` otherwise, ``force`` for a manual request, the custom instructions and the
  runtime context. Its result is *primary*. If it compacted, the binding's
  ``contextEngine.projection`` block is cleared (the thread id is kept), so the next turn
  sees a changed projection, rotates to a fresh thread and re-projects the compacted context
  (OpenClaw #88699, #91590); then maintenance runs with ``reason="compaction"``. Then, when a
  thread binding exists, Codex native compaction runs as a best-effort secondary step.
  Native status lands in ``details["codexNativeCompaction"]``; an engine failure lands in
  ``reason`` and ``details["contextEngineCompaction"]`` and native compaction still runs; a
  native failure never fails a successful engine compaction; when the engine returned no
  ``result`` payload, one is synthesised so the native diagnostics are not lost.
* **A non-owning engine, or none** (``None`` or the legacy engine): a manual request runs
  native compaction only, exactly as Codex does it; a budget-triggered request is left to
  Codex's own automatic compaction (the runtime contract, #85958) and reports ``ok`` with
  ``reason`` :data:`LEFT_TO_CODEX`, nothing compacted by this call. The engine is not called.
* **Native compaction** reads the session's thread binding: no binding means
  ``"no codex app-server thread binding"``. A fork base (structured projection) holds no
  native history: nothing is compacted (``native_skipped``, ``ok``) and the fork kept for
  the next turn is dropped. A request whose ``auth_profile_id`` disagrees
  with the binding's fails closed (``"auth profile mismatch for session binding"``) before
  any app-server is started or touched. Otherwise ``thread/compact/start`` runs with a
  timeout; on expiry the compaction turn is interrupted and, if the interrupt is not
  acknowledged within a grace period, the connection is retired
  (:meth:`codex_turn.harness.appserver.AppServer.compact_thread`). Nothing is retried.

``app_server`` is either an object with :meth:`compact_thread` (an
:class:`~codex_turn.harness.appserver.AppServer`) or a factory ``(auth_profile_id) -> async
context manager`` yielding one, called only when native compaction really runs (the CLI uses
that, so a session without a binding never spawns Codex).

Logging: ids, statuses, counts and durations; never summaries, prompts or transcript text.

Size (~700 lines): one compaction run, its three steps and OpenClaw's result shapes, kept
together because the result building reads every step's outcome.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Final, Literal, Protocol

import anyio
import attrs

from codex_turn._log import format_error, get_logger, mask_session_key, redact_text
from codex_turn.fsm import TraceEntry
from codex_turn.fsm.compaction import (
    ENGINE_RESULT_TRIGGERS,
    MAINTENANCE_TRIGGERS,
    NATIVE_REPORT_TRIGGERS,
    NATIVE_RULES,
    CompactionFacts,
    CompactionModel,
    CompactionState,
    CompactionTrigger,
    NativeAction,
    NativeFacts,
)
from codex_turn.fsm.steering import RunKind
from codex_turn.fsm.thread import decide
from codex_turn.harness._gates import hold_session
from codex_turn.harness.appserver.client import CompactionResult
from codex_turn.harness.appserver.defaults import INTERRUPT_GRACE_S, NATIVE_COMPACTION_TIMEOUT_S
from codex_turn.harness.appserver.errors import AppServerError
from codex_turn.harness.binding import BindingError, ThreadBinding, read_binding, write_binding
from codex_turn.harness.driver import Row, drive, stage_table
from codex_turn.harness.engine import (
    AbortSignal,
    CompactDetails,
    CompactParams,
    CompactResult,
    RuntimeContext,
    coerce_result,
    engine_id,
    engine_info,
    is_active_engine,
    resolve_engine,
)
from codex_turn.harness.lifecycle import (
    MaintenanceOutcome,
    TranscriptRewriter,
    harness_runtime_context,
    run_context_engine_maintenance,
)
from codex_turn.harness.turn.steering import refusing_steering
from codex_turn.harness.turn.structured import drop_kept_fork
from codex_turn.harness.violations import engine_fault, watch_contract

__all__ = [
    "AUTH_PROFILE_MISMATCH",
    "LEFT_TO_CODEX",
    "NATIVE_BACKEND",
    "NO_THREAD_BINDING",
    "AppServerFactory",
    "CompactSessionParams",
    "CompactionRun",
    "CompactionTriggerKind",
    "NativeCompactor",
    "compact_codex_session",
    "compact_codex_session_traced",
]

_log = get_logger(__name__)

NATIVE_BACKEND: Final = "codex-app-server"
NO_THREAD_BINDING: Final = "no codex app-server thread binding"
AUTH_PROFILE_MISMATCH: Final = "auth profile mismatch for session binding"
NOTHING_NATIVE_TO_COMPACT: Final = "structured projection: the fork base holds no history"
#: A budget request without an owning engine: Codex's automatic compaction handles it.
LEFT_TO_CODEX: Final = "left to codex app-server automatic compaction"
_ENGINE_FAILED: Final = "context engine compaction failed"
_ENGINE_FAILED_WARNING: Final = (
    "context engine compaction failed; attempting Codex native compaction"
)
_MAINTENANCE_FAILED_WARNING: Final = (
    "context engine compaction maintenance failed; continuing Codex native compaction"
)

#: ``"manual"`` is a user's explicit ``/compact``; anything else is a budget compaction.
CompactionTriggerKind = Literal["manual", "budget", "overflow", "threshold"]

S = CompactionState
T = CompactionTrigger


class NativeCompactor(Protocol):
    """What native compaction needs from an app-server (:class:`AppServer` has it)."""

    async def compact_thread(
        self,
        thread_id: str,
        *,
        timeout: float,  # noqa: ASYNC109
        interrupt_grace: float,
        developer_instructions: str | None,
        cwd: str | None,
    ) -> CompactionResult: ...


#: ``(auth_profile_id) -> async with ... as app_server``: started only when native runs.
AppServerFactory = Callable[[str | None], AbstractAsyncContextManager[NativeCompactor]]


@attrs.frozen(kw_only=True)
class CompactSessionParams:
    """One compaction request for one session.

    ``session_file`` is the transcript; its thread binding is the sidecar next to it.
    ``auth_profile_id`` is the runtime's auth profile: when set, it must equal the binding's.
    ``developer_instructions`` are re-sent if the thread must be resumed first (Codex drops
    instructions that were not re-sent from the compacted context). ``native_timeout``
    bounds native compaction (OpenClaw's default: 5 minutes); ``interrupt_grace`` is how long
    an interrupted compaction turn may take to acknowledge before the connection is retired.
    ``attempt`` holds further host facts for the runtime context (camelCase keys, as
    :func:`~codex_turn.harness.lifecycle.build_runtime_context` takes them).
    """

    session_id: str
    session_file: str = attrs.field(converter=os.fspath)
    workspace_dir: str | None = None
    session_key: str | None = None
    token_budget: int | None = None
    current_token_count: int | None = None
    custom_instructions: str | None = None
    auth_profile_id: str | None = None
    developer_instructions: str | None = None
    native_timeout: float = attrs.field(
        default=NATIVE_COMPACTION_TIMEOUT_S, converter=float, validator=attrs.validators.gt(0)
    )
    interrupt_grace: float = attrs.field(
        default=INTERRUPT_GRACE_S, converter=float, validator=attrs.validators.ge(0)
    )
    #: How long to wait for a turn (or another compaction) of this session to finish.
    session_wait_timeout: float = attrs.field(
        default=30.0, converter=float, validator=attrs.validators.gt(0)
    )
    #: Bound on the engine's ``compact`` and its compaction maintenance, as on every engine
    #: call of a turn: a hung engine fails its step (native compaction still follows) instead
    #: of holding the session. ``None``: unbounded.
    engine_timeout: float | None = attrs.field(default=300.0)

    @engine_timeout.validator
    def _check_engine_timeout(self, _attribute: object, value: float | None) -> None:
        if value is not None and not (isinstance(value, int | float) and value > 0):
            raise ValueError("CompactSessionParams.engine_timeout must be positive (or None)")

    provider: str | None = None
    model: str | None = None
    agent_dir: str | None = None
    prompt_cache: Mapping[str, Any] | None = None
    attempt: Mapping[str, Any] = attrs.field(factory=dict)
    transcript_rewriter: TranscriptRewriter | None = None
    #: Why the compaction is forced (``CompactParams.force_reason``; default: the trigger of
    #: a manual request), what made the host compact before a turn (a preflight), and the
    #: signal the caller sets to abort it (the engine's compact is cancelled, nothing more
    #: runs; the result says ``aborted``).
    force_reason: str | None = None
    preflight_trigger: str | None = None
    abort_signal: AbortSignal | None = attrs.field(default=None, eq=False)
    #: Raise the engine's first contract violation (see ``TurnParams.strict``) as
    #: :class:`~codex_turn.harness.engine.EngineContractViolation` once the compaction ran
    #: to its report (native compaction included); operational faults keep the fallback.
    strict: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def runtime_context(self) -> RuntimeContext:
        """The runtime context the engine's ``compact`` and ``maintain`` both receive (the
        same builder as a turn's: :func:`~codex_turn.harness.lifecycle.harness_runtime_context`)."""
        return harness_runtime_context(
            session_key=self.session_key,
            model=self.model,
            auth_profile_id=self.auth_profile_id,
            workspace_dir=self.workspace_dir,
            token_budget=self.token_budget,
            provider=self.provider,
            agent_dir=self.agent_dir,
            current_token_count=self.current_token_count,
            prompt_cache=self.prompt_cache,
            attempt=self.attempt,
        )


@attrs.frozen
class CompactionRun:
    """A finished compaction: the result, and how the machine got there.

    ``trace``/``path`` are the compaction machine's; ``native`` is what the app-server
    reported (``None`` when native compaction did not reach it); ``maintenance`` the
    compaction maintenance outcome; ``projection_cleared`` whether the binding's
    ``contextEngine.projection`` was cleared after the engine compacted.
    """

    result: CompactResult
    trace: tuple[TraceEntry, ...]
    path: tuple[str, ...]
    native: CompactionResult | None = None
    maintenance: MaintenanceOutcome | None = None
    projection_cleared: bool = False

    @property
    def triggers(self) -> tuple[str, ...]:
        return tuple(entry.trigger for entry in self.trace)


async def compact_codex_session(
    params: CompactSessionParams,
    *,
    app_server: NativeCompactor | AppServerFactory,
    engine: object | None = None,
    trigger: CompactionTriggerKind | str = "manual",
) -> CompactResult:
    """Compact one session as the module docstring describes; never raises for engine,
    binding or app-server failures (they are reported in the result), except: ``engine``
    (an object, a spec ``"package.module:attribute"``, or ``None``) is checked first, before
    any I/O (:class:`~codex_turn.harness.engine.EngineLoadError`,
    :class:`~codex_turn.harness.engine.EngineContractError`), and ``params.strict`` raises
    the engine's first contract violation once the run ended. Cancellation propagates."""
    run = await compact_codex_session_traced(
        params, app_server=app_server, engine=engine, trigger=trigger
    )
    return run.result


async def compact_codex_session_traced(
    params: CompactSessionParams,
    *,
    app_server: NativeCompactor | AppServerFactory,
    engine: object | None = None,
    trigger: CompactionTriggerKind | str = "manual",
) -> CompactionRun:
    """:func:`compact_codex_session`, returning the whole :class:`CompactionRun`."""
    # Before any I/O: a bad engine or spec is refused at once (a factory gets the directory).
    session_dir = os.path.dirname(os.fspath(params.session_file)) or os.curdir
    engine = resolve_engine(engine, session_dir=session_dir)
    with watch_contract(strict=params.strict) as contract:
        run = await _compact_session(params, app_server, engine, trigger)
    contract.raise_first(run)
    return run


async def _compact_session(
    params: CompactSessionParams,
    app_server: NativeCompactor | AppServerFactory,
    engine: object | None,
    trigger: str,
) -> CompactionRun:
    owns = _engine_owns_compaction(engine)
    # A turn of this session must not run meanwhile, in this process or another (the same
    # lease): it could restore a projection epoch the compaction clears, and Codex would see
    # a turn and a compaction on one thread at once.
    async with hold_session(
        params.session_file,
        lane=params.session_key or params.session_id,
        wait_timeout=params.session_wait_timeout,
        create_directory=False,
    ):
        binding = await anyio.to_thread.run_sync(
            lambda: read_binding(params.session_file, session_id=params.session_id)
        )
        facts = CompactionFacts(
            engine_owns=owns, has_binding=binding is not None, manual=trigger == "manual"
        )
        # A compaction refuses steering: a message meanwhile waits for it and runs next.
        with (
            refusing_steering(params.session_file, RunKind.COMPACTION),
            CompactionModel.begin(facts) as model,
        ):
            run = _Run(params, app_server, engine, trigger, owns, model)
            await drive(model, _STAGES, run)
            return run.report()


async def _unless_aborted(
    call: Awaitable[object], signal: AbortSignal | None
) -> tuple[object, bool]:
    """``await call``, cancelled when ``signal`` is aborted first: ``(result, aborted)``."""
    if signal is None:
        return await call, False
    if signal.aborted:
        close = getattr(call, "close", None)
        if callable(close):
            close()  # a coroutine never started: no "never awaited" warning
        return None, True
    box: list[object] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as group:

        async def run() -> None:
            try:
                box.append(await call)
            except Exception as error:  # re-raised below, as the call's own
                failure.append(error)
            group.cancel_scope.cancel()

        group.start_soon(run)
        await signal.wait()
        group.cancel_scope.cancel()
    if failure:
        raise failure[0]
    return (box[0], False) if box else (None, True)


def _engine_owns_compaction(engine: object | None) -> bool:
    # The engine (its info included) was checked before any I/O (resolve_engine).
    return is_active_engine(engine) and engine_info(engine).owns_compaction


def _server_factory(app_server: NativeCompactor | AppServerFactory) -> AppServerFactory:
    """``app_server`` as a factory: a started app-server is used as it is (not closed)."""
    if hasattr(app_server, "compact_thread"):
        server: NativeCompactor = app_server
        return lambda _auth_profile_id: contextlib.nullcontext(server)
    return app_server


@attrs.define
class _Native:
    """The native step's outcome, in OpenClaw's ``CompactResult`` shape, plus the raw report."""

    result: CompactResult
    trigger: CompactionTrigger
    report: CompactionResult | None = None


class _Run:
    """One compaction run: the context of its stages (each returns the trigger of its state,
    :data:`_STAGES`), and what each recorded for the report."""

    def __init__(
        self,
        params: CompactSessionParams,
        app_server: NativeCompactor | AppServerFactory,
        engine: Any,
        trigger: str,
        owns: bool,
        model: CompactionModel,
    ) -> None:
        self.params = params
        self.app_server = app_server
        self.open_server = _server_factory(app_server)
        self.engine = engine
        self.trigger = trigger
        self.owns = owns
        self.model = model
        self.runtime_context = params.runtime_context()
        self.primary: CompactResult | None = None
        self.primary_error: str | None = None
        self.native: _Native | None = None
        self.maintenance: MaintenanceOutcome | None = None
        self.projection_cleared = False

    def _fields(self, **extra: Any) -> dict[str, Any]:
        return {
            "engine": engine_id(self.engine) if self.engine is not None else None,
            "session_key": mask_session_key(self.params.session_key),
            **extra,
        }

    def report(self) -> CompactionRun:
        model = self.model
        if model.compacted_by_both:
            _log.info(
                "codex native compaction completed alongside context-engine compaction",
                **self._fields(),
            )
        return CompactionRun(
            result=self._build_result(),
            trace=tuple(model.trace),
            path=tuple(model.path()),
            native=self.native.report if self.native is not None else None,
            maintenance=self.maintenance,
            projection_cleared=self.projection_cleared,
        )

    # -- idle ----------------------------------------------------------------------------

    async def start(self) -> CompactionTrigger:
        """The ownership decision is the table's, from the facts the run began with."""
        return T.STARTED

    # -- the engine's part ---------------------------------------------------------------

    async def engine_compact(self) -> CompactionTrigger:
        p = self.params
        manual = self.trigger == "manual"
        compact_params = CompactParams(
            session_id=p.session_id,
            session_key=p.session_key,
            session_file=p.session_file,
            token_budget=p.token_budget,
            current_token_count=p.current_token_count,
            compaction_target="threshold" if manual else "budget",
            custom_instructions=p.custom_instructions,
            force=manual,
            runtime_context=self.runtime_context,
            force_reason=p.force_reason or (self.trigger if manual else None),
            preflight_trigger=p.preflight_trigger,
            abort_signal=p.abort_signal,
        )
        signal = p.abort_signal
        try:
            raw, aborted = None, False
            # compact() is required by the contract, checked before any I/O (resolve_engine).
            with anyio.move_on_after(_bound(p.engine_timeout)) as bounded:
                raw, aborted = await _unless_aborted(self.engine.compact(compact_params), signal)
            if aborted:
                assert signal is not None
                self.primary_error = f"{_ENGINE_FAILED}: aborted ({signal.reason})"
                _log.info("context engine compaction aborted", **self._fields())
                return T.ENGINE_ABORTED
            if bounded.cancelled_caught:
                raise TimeoutError(f"compact() exceeded {p.engine_timeout}s")
            primary = coerce_result(
                raw, CompactResult, engine_id=engine_id(self.engine), method="compact"
            )
        except Exception as err:
            message = redact_text(str(err).strip())
            self.primary_error = f"{_ENGINE_FAILED}: {message}" if message else _ENGINE_FAILED
            engine_fault(
                _log,
                _ENGINE_FAILED_WARNING,
                engine=self.engine,
                method="compact",
                error=err,
                session_key=p.session_key,
            )
            return T.ENGINE_FAILED
        self.primary = primary
        _log.info(
            "context engine compaction finished",
            **self._fields(ok=primary.ok, compacted=primary.compacted),
        )
        return ENGINE_RESULT_TRIGGERS[primary.ok, primary.compacted]

    async def maintain(self) -> CompactionTrigger:
        """After the engine compacted: clear the binding's projection, then maintenance."""
        await anyio.to_thread.run_sync(self._clear_projection)
        p = self.params
        self.maintenance = MaintenanceOutcome(
            status="failed", reason="compaction", error="maintain() timed out"
        )
        with anyio.move_on_after(_bound(p.engine_timeout)):
            self.maintenance = await run_context_engine_maintenance(
                engine=self.engine,
                reason="compaction",
                session_id=p.session_id,
                session_key=p.session_key,
                session_file=p.session_file,
                runtime_context=self.runtime_context,
                transcript_rewriter=p.transcript_rewriter,
            )
        trigger = MAINTENANCE_TRIGGERS[self.maintenance.status]
        if trigger is T.MAINTENANCE_FAILED:
            _log.warning(_MAINTENANCE_FAILED_WARNING, **self._fields())
        return trigger

    def _clear_projection(self) -> None:
        """Drop the binding's projection block so the next turn re-projects on a fresh thread.

        A fork base's block stays: it is no projection epoch (each turn re-projects anyway)
        but the mark that the thread is a base, which must never run a turn."""
        binding = read_binding(self.params.session_file, session_id=self.params.session_id)
        block = binding.context_engine if binding is not None else None
        if binding is None or block is None or block.projection is None or binding.fork_base:
            return
        try:
            write_binding(
                self.params.session_file,
                attrs.evolve(binding, context_engine=attrs.evolve(block, projection=None)),
            )
        except BindingError as err:
            _log.warning(
                "could not clear the thread binding's context projection after compaction",
                **self._fields(error=format_error(err)),
            )
            return
        self.projection_cleared = True
        _log.info(
            "cleared context projection after engine compaction",
            **self._fields(thread_id=binding.thread_id),
        )

    # -- Codex's part --------------------------------------------------------------------

    async def native_compact(self) -> CompactionTrigger:
        """What the native rule table decides for the binding as it is now (the engine's
        step may have taken long), carried out by :data:`_NATIVE_ACTIONS`."""
        p = self.params
        binding = await anyio.to_thread.run_sync(
            lambda: read_binding(p.session_file, session_id=p.session_id)
        )
        facts = NativeFacts(
            bound=binding is not None,
            fork_base=binding is not None and binding.fork_base,
            auth_matches=binding is None or p.auth_profile_id in (None, binding.auth_profile_id),
        )
        self.native = await _NATIVE_ACTIONS[decide(NATIVE_RULES, facts)](self, binding)
        return self.native.trigger

    async def _unbound(self, binding: ThreadBinding | None) -> _Native:
        return _Native(_failure(NO_THREAD_BINDING), T.NATIVE_FAILED)

    async def _fork_base(self, binding: ThreadBinding | None) -> _Native:
        # Each turn runs in a fork of this thread and re-projects the engine's context: there
        # is no native history to compact (compacting the base would put a summary of nothing
        # into every later fork). The fork kept for the next turn does hold some: it is
        # dropped, so that turn forks afresh with the engine's context.
        assert binding is not None
        drop_kept_fork(self.app_server, binding.thread_id)
        return _Native(
            CompactResult(ok=True, compacted=False, reason=NOTHING_NATIVE_TO_COMPACT),
            T.NATIVE_SKIPPED,
        )

    async def _auth_mismatch(self, binding: ThreadBinding | None) -> _Native:
        assert binding is not None
        _log.warning(
            "codex app-server compaction refused: auth profile mismatch",
            **self._fields(thread_id=binding.thread_id),
        )
        return _Native(_failure(AUTH_PROFILE_MISMATCH), T.NATIVE_FAILED)

    async def _compact(self, binding: ThreadBinding | None) -> _Native:
        assert binding is not None
        p = self.params
        _log.info(
            "started codex app-server compaction", **self._fields(thread_id=binding.thread_id)
        )
        try:
            async with self.open_server(binding.auth_profile_id) as server:
                report = await server.compact_thread(
                    binding.thread_id,
                    timeout=p.native_timeout,
                    interrupt_grace=p.interrupt_grace,
                    developer_instructions=p.developer_instructions,
                    cwd=binding.cwd or p.workspace_dir,
                )
        except (AppServerError, OSError) as err:
            _log.warning(
                "codex app-server compaction failed",
                **self._fields(thread_id=binding.thread_id, error=format_error(err)),
            )
            reason = redact_text(str(err).strip()) or "codex app-server compaction failed"
            return _Native(_failure(reason), T.NATIVE_FAILED)
        trigger = NATIVE_REPORT_TRIGGERS[report.compacted, report.status == "timed_out"]
        fields = self._fields(
            thread_id=binding.thread_id,
            status=report.status,
            duration_ms=report.duration_ms,
            interrupted=report.interrupted,
            retired=report.retired,
        )
        return _Native(_NATIVE_REPORTS[trigger](self, binding, report, fields), trigger, report)

    def _compacted(
        self, binding: ThreadBinding, report: CompactionResult, fields: dict[str, Any]
    ) -> CompactResult:
        # Codex reported the compaction itself; a compaction turn that then had to be
        # interrupted does not undo it (the summary is already the thread's history).
        _log.info("completed codex app-server compaction", **fields)
        details: dict[str, Any] = {
            "backend": NATIVE_BACKEND,
            "ownsCompaction": self.owns,
            "threadId": binding.thread_id,
            "signal": report.signal,
        }
        if report.turn_id is not None:
            details["turnId"] = report.turn_id
        if report.item_id is not None:
            details["itemId"] = report.item_id
        return CompactResult(
            ok=True,
            compacted=True,
            result=CompactDetails(
                summary="",
                first_kept_entry_id="",
                tokens_before=self.params.current_token_count or 0,
                details=details,
            ),
        )

    def _timed_out(
        self, binding: ThreadBinding, report: CompactionResult, fields: dict[str, Any]
    ) -> CompactResult:
        _log.warning("codex app-server compaction did not complete", **fields)
        return _failure(
            f"timed out waiting for codex app-server compaction for {binding.thread_id}"
        )

    def _not_completed(
        self, binding: ThreadBinding, report: CompactionResult, fields: dict[str, Any]
    ) -> CompactResult:
        _log.warning("codex app-server compaction did not complete", **fields)
        return _failure(report.error or f"codex app-server compaction {report.status}")

    # -- the report ----------------------------------------------------------------------

    def _native_for_report(self) -> CompactResult:
        """Native's result; a run that never reached native compaction had no binding, or was
        a budget request the table left to Codex's automatic compaction."""
        if self.native is not None:
            return self.native.result
        if self.model.left_to_codex:
            return CompactResult(ok=True, compacted=False, reason=LEFT_TO_CODEX)
        return _failure(NO_THREAD_BINDING)

    def _build_result(self) -> CompactResult:
        native = self._native_for_report()
        if not self.owns:
            return native
        native_details = native.result.details if native.result is not None else None
        if self.primary_error is not None:
            reason = self.primary_error
            return CompactResult(
                ok=False,
                compacted=native.compacted,
                reason=reason,
                result=CompactDetails(
                    summary=(native.result.summary if native.result else None) or "",
                    first_kept_entry_id=(
                        native.result.first_kept_entry_id if native.result else None
                    )
                    or "",
                    tokens_before=(
                        native.result.tokens_before
                        if native.result is not None
                        else self.params.current_token_count or 0
                    ),
                    tokens_after=native.result.tokens_after if native.result else None,
                    details=_merge_details(native_details, native, reason),
                ),
            )
        primary = self.primary
        assert primary is not None  # the engine ran and either failed or returned this
        if primary.result is not None:
            result = attrs.evolve(
                primary.result,
                summary=primary.result.summary or "",
                first_kept_entry_id=primary.result.first_kept_entry_id or "",
                details=_merge_details(primary.result.details, native, None),
            )
        else:
            # OpenClaw's review fix on #70809: synthesise a result so native status survives.
            result = CompactDetails(
                summary="",
                first_kept_entry_id="",
                tokens_before=(
                    native.result.tokens_before
                    if native.result is not None
                    else self.params.current_token_count or 0
                ),
                details=_merge_details(None, native, None),
            )
        return CompactResult(
            ok=primary.ok, compacted=primary.compacted, reason=primary.reason, result=result
        )


#: What native_compacting does, by the native rule table's action (:data:`NATIVE_RULES`).
_NATIVE_ACTIONS: Mapping[
    NativeAction, Callable[[_Run, ThreadBinding | None], Awaitable[_Native]]
] = {
    NativeAction.NO_BINDING: _Run._unbound,
    NativeAction.FORK_BASE: _Run._fork_base,
    NativeAction.AUTH_MISMATCH: _Run._auth_mismatch,
    NativeAction.COMPACT: _Run._compact,
}

#: Codex's report in OpenClaw's ``CompactResult`` shape, by the trigger it leaves with.
_NATIVE_REPORTS: Mapping[
    CompactionTrigger,
    Callable[[_Run, ThreadBinding, CompactionResult, dict[str, Any]], CompactResult],
] = {
    T.NATIVE_COMPACTED: _Run._compacted,
    T.NATIVE_TIMED_OUT: _Run._timed_out,
    T.NATIVE_FAILED: _Run._not_completed,
}

#: The stage of every non-final compaction state (none is sheltered: a caller's cancellation
#: propagates; native compaction bounds and interrupts itself).
_STAGES: Mapping[CompactionState, Row[_Run, CompactionTrigger]] = stage_table(
    CompactionModel,
    {
        S.IDLE: Row(_Run.start),
        S.ENGINE_COMPACTING: Row(_Run.engine_compact),
        S.COMPACTION_MAINTENANCE: Row(_Run.maintain),
        S.NATIVE_COMPACTING: Row(_Run.native_compact),
    },
)


def _failure(reason: str) -> CompactResult:
    return CompactResult(ok=False, compacted=False, reason=reason)


def _bound(seconds: float | None) -> float:
    return math.inf if seconds is None else seconds


def _native_status(native: CompactResult) -> dict[str, Any]:
    """``details["codexNativeCompaction"]``."""
    if native.ok and native.compacted:
        return {
            "ok": True,
            "compacted": True,
            "details": native.result.details if native.result is not None else None,
        }
    return {"ok": False, "compacted": False, "reason": native.reason}


def _merge_details(primary_details: Any, native: CompactResult, engine_failure: str | None) -> Any:
    """OpenClaw's merge: the primary's details plus the native status (and engine failure).

    A non-object ``primary_details`` is dropped in favour of the extras, as OpenClaw does.
    """
    extras: dict[str, Any] = {"codexNativeCompaction": _native_status(native)}
    if engine_failure is not None:
        extras["contextEngineCompaction"] = {"ok": False, "reason": engine_failure}
    if isinstance(primary_details, Mapping):
        return {**primary_details, **extras}
    return extras
