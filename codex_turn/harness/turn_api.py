"""The public records of a turn: what a runner passes in (:class:`TurnParams`) and gets back
(:class:`TurnResult`, :class:`MaintenanceReport`). No behaviour here; see
:mod:`codex_turn.harness.orchestrator` for the turn itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Final, Literal, get_args

import attrs

from codex_turn.fsm import TraceEntry, TurnOutcome
from codex_turn.fsm.thread import ThreadDecision
from codex_turn.harness.appserver.types import ApprovalsReviewer, SandboxMode
from codex_turn.harness.engine import AgentMessage
from codex_turn.harness.usage import Usage

__all__ = ["TURN_START_TEXT_MAX_CHARS", "MaintenanceReport", "TurnParams", "TurnResult"]

#: Codex refuses larger turn/start text; older context is cut first (OpenClaw's bound).
TURN_START_TEXT_MAX_CHARS: Final = 1 << 20

# The runtime policy values Codex's schema accepts (checked when the params are built).
_POLICY_VALUES: Final[dict[str, frozenset[str]]] = {
    "approval_policy": frozenset({"untrusted", "on-request", "never"}),
    "sandbox": frozenset(get_args(SandboxMode)),
    "approvals_reviewer": frozenset(get_args(ApprovalsReviewer)),
}


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
    #: The runtime policy, sent on thread/start *and* thread/resume (and recorded in the
    #: binding), so a change takes effect on a bound thread without rotating it. ``None``:
    #: Codex's configured default.
    approval_policy: Literal["untrusted", "on-request", "never"] | None = None
    sandbox: SandboxMode | None = None
    approvals_reviewer: ApprovalsReviewer | None = None
    service_tier: str | None = None
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
        if not isinstance(self.session_id, str) or not self.session_id.strip():
            raise ValueError("TurnParams.session_id must not be blank")
        if self.engine_timeout is not None and not self.engine_timeout > 0:
            raise ValueError("TurnParams.engine_timeout must be positive (or None)")
        for name in ("turn_timeout", "idle_timeout", "cleanup_timeout", "session_wait_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TurnParams.{name} must be positive")
        for name, allowed in _POLICY_VALUES.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"TurnParams.{name} must be one of {sorted(allowed)}")


@attrs.frozen(kw_only=True)
class MaintenanceReport:
    """What happened to turn maintenance: ``ran``, ``failed``, ``deferred``, ``skipped`` (with
    the reason) or ``cancelled`` (the caller left before it ran)."""

    status: Literal["ran", "failed", "deferred", "skipped", "cancelled"]
    skip_reason: str | None = None


@attrs.frozen(kw_only=True)
class TurnResult:
    """What one turn did: its outcome, Codex's reply and usage, the thread it ran on, what
    happened to maintenance, and the machine's trace."""

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
