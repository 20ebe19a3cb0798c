"""A session's life around its turns, with the engine told: reset, end, subagents, control.

A host calls these outside any turn (OpenClaw's ``/new``, a session closed, a subagent run,
an operator's command); each one makes the engine's hook call of
:mod:`codex_turn.harness.engine.host`, checks what it returned at the boundary, and does the
host's own part:

    reset_codex_session   before_session_reset (the engine archives or keeps the session's
                          state), then the Codex reset (the thread binding is forgotten)
    end_codex_session     session_end (the engine releases what it holds for the session)
    run_subagent          prepare_subagent_spawn (the engine seeds a child session), one turn
                          of the child on the same app-server and engine, then
                          on_subagent_ended (the engine folds the child's result back)
    engine_control        control() with one of the engine's declared actions (status,
                          doctor, rotate), for an operator (the CLI's ``engine`` command)

Failure policy: as in the lifecycle, an engine is a plugin. A hook that raises or returns
the wrong shape is logged (never its content) and reported in the outcome as ``failed``; the
host's own part still runs (a reset still forgets the binding; a subagent still runs without
a seed, and its end is still reported). Only :func:`engine_control` raises: an operator asked
for that action and must hear why it did not happen (:class:`~.engine.host.ControlUnsupported`,
:class:`~.engine.contract.InvalidEngineResult`).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any, Final, Literal

import attrs

from codex_turn._log import format_error, get_logger, mask_session_key
from codex_turn.harness.appserver import AppServerPort, DynamicTool
from codex_turn.harness.engine.contract import InvalidEngineResult
from codex_turn.harness.engine.host import (
    ControlCapabilities,
    ControlRequest,
    ControlResult,
    ControlUnsupported,
    SessionEndParams,
    SessionResetParams,
    SessionResetResult,
    SubagentEndedParams,
    SubagentOutcome,
    SubagentSpawnParams,
    SubagentSpawnPreparation,
)
from codex_turn.harness.engine.validation import (
    coerce_result,
    engine_id,
    engine_log_fields,
    is_active_engine,
    optional_method,
)
from codex_turn.harness.hooks import join_sections
from codex_turn.harness.session import reset_session
from codex_turn.harness.turn_api import TurnParams, TurnResult
from codex_turn.harness.violations import engine_fault

__all__ = [
    "MAX_SUBAGENT_RESULT_CHARS",
    "SessionResetReport",
    "SubagentRun",
    "control_capabilities",
    "end_codex_session",
    "engine_control",
    "reset_codex_session",
    "run_subagent",
]

_log = get_logger("codex_turn.harness.session_lifecycle")

#: The child's answer handed back to the engine is cut to this many characters.
MAX_SUBAGENT_RESULT_CHARS: Final = 20_000

HookStatus = Literal["archived", "kept", "ended", "failed", "not_supported", "no_engine"]


async def _hook(
    engine: object | None,
    method: str,
    params: object,
    session_key: str | None,
    result_type: type[Any] | None = None,
) -> tuple[Literal["ran", "failed", "not_supported", "no_engine"], Any]:
    """Call ``engine.<method>(params)`` when it has it; ``(status, checked result)``."""
    if not is_active_engine(engine):
        return "no_engine", None
    hook = optional_method(engine, method)
    if hook is None:
        return "not_supported", None
    try:
        raw = await hook(params)
        if result_type is None or raw is None:
            return "ran", raw
        return "ran", coerce_result(raw, result_type, engine_id=engine_id(engine), method=method)
    except Exception as error:
        engine_fault(
            _log,
            f"context engine {method} failed",
            engine=engine,
            method=method,
            error=error,
            session_key=session_key,
        )
        return "failed", None


# --- Reset and end --------------------------------------------------------------------------


@attrs.frozen
class SessionResetReport:
    """What a reset did: the engine's part (``archived``, ``kept``, ``failed``,
    ``not_supported`` without the hook, ``no_engine``) and whether a binding was removed."""

    engine: HookStatus
    binding_removed: bool
    reason: str | None = None


async def reset_codex_session(
    session_file: str | os.PathLike[str],
    *,
    session_id: str,
    session_key: str | None = None,
    engine: object | None = None,
    reason: str | None = None,
) -> SessionResetReport:
    """Reset a session: the engine first (``before_session_reset``: it archives the session's
    state or keeps it, and says which), then the Codex reset
    (:func:`~codex_turn.harness.session.reset_session`: the thread binding is forgotten, so
    the next turn starts a fresh thread). The transcript is the host's to archive."""
    params = SessionResetParams(
        session_id=session_id,
        session_file=os.fspath(session_file),
        session_key=session_key,
        reason=reason,
    )
    status, result = await _hook(
        engine, "before_session_reset", params, session_key, SessionResetResult
    )
    engine_status: HookStatus
    said: str | None = None
    if status == "ran":
        if result is None:
            engine_status = "failed"
            _log.warning(
                "context engine before_session_reset returned nothing",
                **engine_log_fields(engine, session_key, contract_violation=True),
            )
        else:
            engine_status, said = result.action, result.reason
    else:
        engine_status = status
    removed = reset_session(session_file, session_key=session_key, reason=reason)
    _log.info(
        "codex session reset with its engine",
        session_key=mask_session_key(session_key),
        engine_action=engine_status,
        binding_removed=removed,
    )
    return SessionResetReport(engine=engine_status, binding_removed=removed, reason=said)


async def end_codex_session(
    session_file: str | os.PathLike[str],
    *,
    session_id: str,
    session_key: str | None = None,
    engine: object | None = None,
    reason: str | None = None,
) -> HookStatus:
    """Tell the engine the host runs no more turns of this session (``session_end``);
    ``ended``, ``failed``, ``not_supported`` or ``no_engine``."""
    params = SessionEndParams(
        session_id=session_id,
        session_file=os.fspath(session_file),
        session_key=session_key,
        reason=reason,
    )
    status, _ = await _hook(engine, "session_end", params, session_key)
    return "ended" if status == "ran" else status


# --- Subagents ------------------------------------------------------------------------------


@attrs.frozen
class SubagentRun:
    """A child session's run: what the engine seeded (``preparation``; ``None`` without the
    hook or when it failed), the child's turn (``None`` when it could not start:
    ``error`` says why), how it ended, and whether the engine took the result back."""

    child_session_id: str
    child_session_file: str
    outcome: SubagentOutcome
    preparation: SubagentSpawnPreparation | None
    turn: TurnResult | None
    folded: bool
    error: str | None = None

    @property
    def result_text(self) -> str | None:
        return self.turn.assistant_text if self.turn is not None else None


#: Runs one turn: ``run_codex_turn`` (the default) or a test's stand-in.
TurnRunner = Callable[..., Awaitable[TurnResult]]


async def run_subagent(
    parent: TurnParams,
    *,
    task: str,
    child_session_id: str,
    child_session_file: str | os.PathLike[str],
    app_server: AppServerPort,
    engine: object | None = None,
    child_session_key: str | None = None,
    tools: list[DynamicTool] | None = None,
    run_turn: TurnRunner | None = None,
) -> SubagentRun:
    """Run ``task`` as one turn of a child session seeded by the engine, and fold the
    result back (see the module docstring).

    The child runs on the parent's app-server and engine with the parent's settings (model,
    workspace, budget, policy), its own transcript ``child_session_file`` and key (default:
    ``"<parent key>:subagent:<child id>"``), and the engine's seed appended to its developer
    instructions. ``on_subagent_ended`` gets the child's final answer (cut to
    :data:`MAX_SUBAGENT_RESULT_CHARS`) and how it ended; a child that could not start ends
    ``spawn_failed`` (the engine undoes what it prepared). Cancellation propagates, after the
    engine was told (``aborted``).
    """
    if run_turn is None:
        from codex_turn.harness.turn.orchestrator import run_codex_turn

        run_turn = run_codex_turn
    parent_key = parent.session_key or parent.session_id
    child_key = child_session_key or f"{parent_key}:subagent:{child_session_id}"
    child_file = os.fspath(child_session_file)
    spawn = SubagentSpawnParams(
        parent_session_id=parent.session_id,
        parent_session_key=parent_key,
        parent_session_file=os.fspath(parent.session_file),
        child_session_id=child_session_id,
        child_session_key=child_key,
        child_session_file=child_file,
        task=task,
    )
    _, preparation = await _hook(
        engine, "prepare_subagent_spawn", spawn, parent_key, SubagentSpawnPreparation
    )
    child = attrs.evolve(
        parent,
        session_id=child_session_id,
        session_file=child_file,
        session_key=child_key,
        prompt=task,
        images=(),
        extra_developer_instructions=join_sections(
            parent.extra_developer_instructions,
            preparation.system_prompt_addition if preparation is not None else None,
        ),
    )
    turn: TurnResult | None = None
    error: str | None = None
    outcome: SubagentOutcome = "spawn_failed"
    try:
        turn = await run_turn(child, app_server=app_server, engine=engine, tools=tools or [])
        outcome = "completed" if turn.outcome.value == "completed" else "failed"
        if turn.outcome.value in ("aborted", "cancelled", "timed_out", "yield_aborted"):
            outcome = "aborted"
    except Exception as exc:
        error = format_error(exc)
        _log.warning("subagent could not run", session_key=mask_session_key(child_key), error=error)
    except BaseException:
        await _ended(engine, spawn, "aborted", None)
        raise
    text = turn.assistant_text if turn is not None else None
    folded = await _ended(engine, spawn, outcome, text)
    return SubagentRun(
        child_session_id=child_session_id,
        child_session_file=child_file,
        outcome=outcome,
        preparation=preparation,
        turn=turn,
        folded=folded,
        error=error,
    )


async def _ended(
    engine: object | None, spawn: SubagentSpawnParams, outcome: SubagentOutcome, text: str | None
) -> bool:
    params = SubagentEndedParams(
        parent_session_id=spawn.parent_session_id,
        parent_session_key=spawn.parent_session_key,
        child_session_id=spawn.child_session_id,
        child_session_key=spawn.child_session_key,
        outcome=outcome,
        result_text=text[:MAX_SUBAGENT_RESULT_CHARS] if text is not None else None,
    )
    import anyio

    with anyio.CancelScope(shield=True):  # the engine hears of the end, cancelled or not
        status, _ = await _hook(engine, "on_subagent_ended", params, spawn.parent_session_key)
    return status == "ran"


# --- Control --------------------------------------------------------------------------------


def control_capabilities(engine: object) -> ControlCapabilities:
    """The engine's declared control actions (none without ``control``); raises
    :class:`~.engine.contract.InvalidEngineResult` for a malformed declaration."""
    declare = getattr(engine, "control_capabilities", None)
    if optional_method(engine, "control") is None or not callable(declare):
        return ControlCapabilities(actions=frozenset())
    try:
        raw = declare()
    except Exception as error:
        raise InvalidEngineResult(
            engine_id(engine), "control_capabilities", f"raised {type(error).__name__}"
        ) from error
    return coerce_result(
        raw, ControlCapabilities, engine_id=engine_id(engine), method="control_capabilities"
    )


async def engine_control(engine: object, request: ControlRequest) -> ControlResult:
    """One operator action on the engine: refused with :class:`ControlUnsupported` unless the
    engine declares it; the result checked at the boundary."""
    offered = control_capabilities(engine)
    if request.action not in offered.actions:
        raise ControlUnsupported(engine_id(engine), request.action, tuple(sorted(offered.actions)))
    control = optional_method(engine, "control")
    assert control is not None
    raw = await control(request)
    return coerce_result(raw, ControlResult, engine_id=engine_id(engine), method="control")
