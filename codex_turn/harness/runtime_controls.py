"""Per-turn runtime controls: what a turn sends on ``turn/start`` and who answers Codex's
approval and user-input requests while it runs.

**Per-turn settings** (:class:`~codex_turn.harness.turn_api.TurnParams`): ``reasoning_effort``
(``effort``), ``output_schema`` (``outputSchema``), ``approval_policy`` (``approvalPolicy``)
and ``sandbox`` (``sandboxPolicy``) go on the ``turn/start`` of a turn that states them
(:func:`turn_start_overrides`); only ``turn/start`` can change them on a thread the process
already holds (``thread/resume`` of a loaded thread ignores a new approval policy or sandbox,
verified against the binary). ``None`` means **Codex's configured default**, for every turn:

* Codex 0.163 keeps ``turn/start``'s effort, approval policy and sandbox "for this turn and
  subsequent turns", and a thread it loads again (it unloads idle threads; an app-server or
  host process restart) comes back with what its rollout holds, an earlier turn's override
  included. So the client records, in the thread's ledger
  (:class:`~codex_turn.harness.appserver.LoadedThread`), the thread's defaults as Codex's
  *configuration* states them (``config/read`` with the thread's cwd, once per app-server
  process: ``approval_policy``, ``sandbox_mode`` with ``[sandbox_workspace_write]``,
  ``model_reasoning_effort``), never what a start or resume reported, and which fields the
  thread may hold otherwise (a turn changed them, or the load reported something else); the
  next turn that states none sends the configured default explicitly on its ``turn/start``.
  This holds in a new host process too: it has no memory of the thread, only the
  configuration.
* The approval policy and sandbox are not sent on ``thread/start``/``thread/resume``: sent
  there they would become the thread's defaults (a load that sends them takes what Codex
  reports for them as the default) and an auto-resume would re-send them.
* The reasoning effort resets only when one is configured (``model_reasoning_effort``; with none
  there is nothing to send back, so an earlier turn's effort stays on the thread until a turn states
  one). An approval policy or sandbox the configuration leaves unset is Codex's built-in default,
  known only from what the load reports: exact for a thread started by this host process, but a
  resume in a new one may report an earlier turn's value (set them in config.toml to be safe; a
  config.toml the harness writes always sets them). An app-server without ``config/read`` (an older
  binary) falls back, with a warning, to the values Codex reports when the thread is first loaded
  (by this pool; in a new host process, whatever the resume restored).

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
``CANCEL`` answer to a command or file change makes Codex interrupt the turn, which then
ends as any interrupted turn does: ``turn_aborted`` in the trace, outcome ``aborted``
(mirrored, finalized, no maintenance); for an MCP tool Codex 0.163 takes it as a decline.
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
