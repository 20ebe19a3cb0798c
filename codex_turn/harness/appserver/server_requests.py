"""Requests Codex sends *us* (server requests), and how each is answered.

The connection core (:mod:`.client`) starts :func:`serve_request` in a task of its own for
every message with both an ``id`` and a ``method``; it answers exactly once:

* ``item/tool/call`` goes to the thread's :class:`~.tools.ToolRegistry` (an unknown thread or
  tool gets the registry's own "unknown tool" result, never an error);
* approvals (:data:`APPROVAL_METHODS`) go to an :data:`ApprovalPolicy`, by default
  :func:`decline_all` (the turn continues without what it asked for);
* ``item/tool/requestUserInput`` goes to an optional :data:`UserInputHandler` and is otherwise
  answered with no answers;
* unknown methods get JSON-RPC ``-32601``; a handler that raises gets ``-32000`` (logged with
  the method and the redacted error, never the params).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from codex_turn._log import format_error, get_logger

from .logsafe import capped
from .tools import ToolRegistry

if TYPE_CHECKING:
    from .client import _Connection

__all__ = [
    "APPROVAL_METHODS",
    "ApprovalPolicy",
    "UserInputHandler",
    "decline_all",
    "serve_request",
]

log = get_logger(__name__)

ApprovalPolicy = Callable[[str, Mapping[str, Any]], Awaitable[Mapping[str, Any]]]
"""``(method, params) -> response`` for approval server requests."""
UserInputHandler = Callable[[Mapping[str, Any]], Awaitable[Mapping[str, Any]]]
"""``params -> {"answers": {...}}`` for ``item/tool/requestUserInput``."""

APPROVAL_METHODS = frozenset(
    {
        "item/commandExecution/requestApproval",
        "item/fileChange/requestApproval",
        "item/permissions/requestApproval",
        "mcpServer/elicitation/request",
        "execCommandApproval",
        "applyPatchApproval",
    }
)


async def decline_all(method: str, params: Mapping[str, Any]) -> Mapping[str, Any]:
    """The default approval policy: decline everything (the turn continues without it)."""
    if method in ("execCommandApproval", "applyPatchApproval"):
        return {"decision": "denied"}
    if method == "mcpServer/elicitation/request":
        return {"action": "decline"}
    if method == "item/permissions/requestApproval":
        return {"permissions": {}}
    return {"decision": "decline"}


async def serve_request(client: _Connection, msg_id: Any, method: str, params: Any) -> None:
    """Answer one server request, exactly once (a failing handler gets ``-32000``)."""
    params = params if isinstance(params, dict) else {}
    try:
        if method == "item/tool/call":
            thread_id = str(params.get("threadId", ""))
            registry = client._tools.get(thread_id) or ToolRegistry()
            result = await registry.call(str(params.get("tool", "")), params.get("arguments"))
        elif method in APPROVAL_METHODS:
            log.info("appserver.approval_request", method=capped(method))
            result = dict(await client.approval_policy(method, params))
        elif method == "item/tool/requestUserInput":
            if client.user_input_handler is not None:
                result = dict(await client.user_input_handler(params))
            else:
                result = {"answers": {}}
        else:
            log.warning("appserver.unknown_server_request", method=capped(method))
            await client._respond(
                msg_id,
                error={"code": -32601, "message": f"method not supported: {capped(method)}"},
            )
            return
    except Exception as exc:
        log.warning(
            "appserver.server_request_failed", method=capped(method), error=format_error(exc)
        )
        await client._respond(msg_id, error={"code": -32000, "message": "client handler failed"})
        return
    await client._respond(msg_id, result=result)
