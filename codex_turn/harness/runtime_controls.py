"""Per-turn runtime controls: what a turn sends on ``turn/start`` and who answers Codex's
approval and user-input requests while it runs.

**Per-turn settings** (:class:`~codex_turn.harness.turn_api.TurnParams`): ``reasoning_effort``
(``effort``), ``output_schema`` (``outputSchema``), ``approval_policy`` (``approvalPolicy``)
and ``sandbox`` (``sandboxPolicy``) go on *every* ``turn/start`` that has them
(:func:`turn_start_overrides`). Codex 0.163 applies ``turn/start``'s effort, approval policy
and sandbox "for this turn and subsequent turns" (they stick to the thread), the output schema
to this turn only. Re-sending on every turn is the choice made here, rather than tracking what
each earlier turn left on the thread in the resume ledger
(:class:`~codex_turn.harness.appserver.LoadedThread`), because only ``turn/start`` can change
these on a thread the process already holds: ``thread/resume`` of a loaded thread ignores a
new approval policy or sandbox (verified against the binary). So:

* a turn that states a setting gets it, whatever earlier turns set, whether the thread was
  started, resumed or reused without a resume (the ledger's ``settings`` key keeps describing
  what start/resume sent, and a matching key still skips the resume: the turn re-sends the
  setting itself);
* ``None`` sends nothing: the thread keeps what it holds (Codex's configured default, or the
  value an earlier turn of this thread stated). To go back to a default, state it.

The approval policy and sandbox are still sent on ``thread/start`` and ``thread/resume`` too
(the binding records them, and an auto-resume after a crash re-sends them). The sandbox mode
becomes the policy object ``turn/start`` takes: the effective policy Codex reported for the
thread when it is of that mode (so ``[sandbox_workspace_write]`` settings from config.toml are
kept), else the mode's plain policy (``{"type": "workspaceWrite"}`` ...).

**Host callbacks** (:class:`~codex_turn.harness.hooks.TurnHooks`): ``on_approval`` and
``on_user_input`` are bound to the turn's thread while it runs
(:func:`turn_request_handlers`; the bridge itself is
:mod:`codex_turn.harness.appserver.server_requests`). Each wait is bounded by
``TurnParams.approval_timeout`` / ``user_input_timeout`` and, so that an unanswered request
is declined and the turn goes on rather than the turn timing out idle (Codex says nothing
while it waits), by :data:`IDLE_SHARE` of ``idle_timeout``. Without a callback every approval
is declined and every question gets no answer, as before. Neither changes the turn's course
by itself, so neither has an edge in the turn machine; a ``CANCEL`` answer makes Codex
interrupt the turn, which then ends as any interrupted turn does: ``turn_aborted`` in the
trace, outcome ``aborted`` (mirrored, finalized, no maintenance).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from codex_turn.harness.appserver.server_requests import (
    ApprovalCallback,
    ApprovalDecision,
    ApprovalKind,
    ApprovalRequest,
    TurnRequestHandlers,
    UserInputAnswers,
    UserInputCallback,
    UserInputOption,
    UserInputQuestion,
    UserInputRequest,
)
from codex_turn.harness.appserver.types import SandboxMode, ThreadResult
from codex_turn.harness.hooks import TurnHooks
from codex_turn.harness.turn_api import TurnParams

__all__ = [
    "IDLE_SHARE",
    "ApprovalCallback",
    "ApprovalDecision",
    "ApprovalKind",
    "ApprovalRequest",
    "TurnRequestHandlers",
    "UserInputAnswers",
    "UserInputCallback",
    "UserInputOption",
    "UserInputQuestion",
    "UserInputRequest",
    "sandbox_policy",
    "turn_request_handlers",
    "turn_start_overrides",
]

#: A host callback's wait never exceeds this share of the turn's ``idle_timeout``.
IDLE_SHARE: Final = 0.8

_POLICY_TYPES: Final[dict[str, str]] = {
    "read-only": "readOnly",
    "workspace-write": "workspaceWrite",
    "danger-full-access": "dangerFullAccess",
}


def sandbox_policy(mode: SandboxMode, thread: ThreadResult | None = None) -> dict[str, Any]:
    """The ``sandboxPolicy`` object that selects ``mode`` (see the module header)."""
    if thread is not None and thread.sandbox_mode == mode and isinstance(thread.sandbox, Mapping):
        return dict(thread.sandbox)
    return {"type": _POLICY_TYPES[mode]}


def turn_start_overrides(params: TurnParams, thread: ThreadResult | None) -> dict[str, Any]:
    """The per-turn ``turn/start`` fields for ``params`` (wire names; nothing for ``None``)."""
    overrides: dict[str, Any] = {}
    if params.reasoning_effort is not None:
        overrides["effort"] = params.reasoning_effort
    if params.output_schema is not None:
        overrides["outputSchema"] = params.output_schema
    if params.approval_policy is not None:
        overrides["approvalPolicy"] = params.approval_policy
    if params.sandbox is not None:
        overrides["sandboxPolicy"] = sandbox_policy(params.sandbox, thread)
    return overrides


def turn_request_handlers(params: TurnParams, hooks: TurnHooks) -> TurnRequestHandlers | None:
    """The host callbacks this turn binds to its thread, or ``None`` when it has none."""
    if hooks.on_approval is None and hooks.on_user_input is None:
        return None
    ceiling = IDLE_SHARE * params.idle_timeout
    return TurnRequestHandlers(
        on_approval=hooks.on_approval,
        approval_timeout=min(params.approval_timeout, ceiling),
        on_user_input=hooks.on_user_input,
        user_input_timeout=min(params.user_input_timeout, ceiling),
    )
