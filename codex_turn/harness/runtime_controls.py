"""Per-turn runtime controls: what a turn sends on ``turn/start`` and who answers Codex's
approval and user-input requests while it runs.

**Per-turn settings** (:class:`~codex_turn.harness.turn_api.TurnParams`): ``reasoning_effort``
(``effort``), ``output_schema`` (``outputSchema``), ``approval_policy`` (``approvalPolicy``)
and ``sandbox`` (``sandboxPolicy``) go on the ``turn/start`` of a turn that states them
(:func:`turn_start_overrides`); only ``turn/start`` can change them on a thread the process
already holds (``thread/resume`` of a loaded thread ignores a new approval policy or sandbox,
verified against the binary). ``None`` means **Codex's configured default**, for every turn:

* Codex 0.163 keeps ``turn/start``'s effort, approval policy and sandbox "for this turn and
  subsequent turns". So the client records, in the thread's ledger
  (:class:`~codex_turn.harness.appserver.LoadedThread`), the effective values Codex reported
  when the thread was first loaded (its defaults: ``approvalPolicy``, ``sandbox``,
  ``reasoningEffort`` of the start/resume response) and which of them a turn changed; the next
  turn that states none sends the recorded default explicitly on its ``turn/start``.
* The approval policy and sandbox are not sent on ``thread/start``/``thread/resume``: sent
  there they would become the thread's defaults and an auto-resume would re-send them. A
  thread Codex loads again (it unloads idle threads; an app-server restart) comes back with
  what its rollout holds, an earlier turn's override included: the pool keeps the defaults
  of the thread's first load and its next turn without values sends them.
* The reasoning effort resets only when Codex reports a configured one (``reasoningEffort``
  is ``null`` when none is configured: nothing to send back, so an earlier turn's effort stays
  on the thread until a turn states one). A thread first loaded by a new host process (no
  memory of its first load) takes what Codex reports then as its defaults.

The sandbox mode becomes the policy object ``turn/start`` takes: the effective policy Codex
reported for the thread when it is of that mode (so ``[sandbox_workspace_write]`` settings from
config.toml are kept), else the mode's plain policy (``{"type": "workspaceWrite"}`` ...).

**Host callbacks** (:class:`~codex_turn.harness.hooks.TurnHooks`): ``on_approval`` and
``on_user_input`` are bound to the turn's thread while it runs
(:func:`turn_request_handlers`; the bridge itself is
:mod:`codex_turn.harness.appserver.server_requests`). Each wait is bounded by
``TurnParams.approval_timeout`` / ``user_input_timeout``, as given: Codex says nothing while
it waits, so the turn's idle timer does not run while a callback is pending (an unanswered
request is declined and the turn goes on; ``turn_timeout`` still bounds the whole turn).
Without a callback every approval is declined and every question gets no answer, as before.
Neither changes the turn's course by itself, so neither has an edge in the turn machine; a
``CANCEL`` answer makes Codex interrupt the turn, which then ends as any interrupted turn
does: ``turn_aborted`` in the trace, outcome ``aborted`` (mirrored, finalized, no maintenance).
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

#: Formerly the share of ``idle_timeout`` a host callback's wait was cut to; no longer applied
#: (the idle timer pauses while a callback is pending). Kept for compatibility.
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
    return TurnRequestHandlers(
        on_approval=hooks.on_approval,
        approval_timeout=params.approval_timeout,
        on_user_input=hooks.on_user_input,
        user_input_timeout=params.user_input_timeout,
    )
