"""Requests Codex sends *us* (server requests), and how each is answered.

The connection (:mod:`.connection`) starts :meth:`Responder.serve` in a task of its own for
every message with both an ``id`` and a ``method``; it answers exactly once:

* ``item/tool/call`` goes to the thread's :class:`~.tools.ToolRegistry` (an unknown thread or
  tool gets the registry's own "unknown tool" result, never an error);
* approvals (:data:`APPROVAL_METHODS`) go to the running turn's host callback when the turn
  bound one (:class:`TurnRequestHandlers`, see below), else to the connection's
  :data:`ApprovalPolicy`, by default :func:`decline_all` (the turn continues without what it
  asked for);
* ``item/tool/requestUserInput`` goes to the running turn's host callback, else to an optional
  connection-wide :data:`UserInputHandler`, else it is answered with no answers;
* unknown methods get JSON-RPC ``-32601``; a handler that raises gets ``-32000`` (logged with
  the method and the redacted error, never the params).

**The per-turn bridge.** A turn may bind :class:`TurnRequestHandlers` to its thread for as
long as it runs (:meth:`Responder.bind`, done by ``turn(..., handlers=...)``). Then:

* command execution (``item/commandExecution/requestApproval``), file change
  (``item/fileChange/requestApproval``) and MCP tool approvals (``mcpServer/elicitation/
  request`` whose ``_meta.codex_approval_kind`` is ``"mcp_tool_call"``; the legacy
  ``execCommandApproval``/``applyPatchApproval`` too) become a typed :class:`ApprovalRequest`
  for ``on_approval``, which answers an :class:`ApprovalDecision`: approve, approve for the
  session, decline (the turn continues without it) or cancel (declined, and Codex interrupts
  the turn: it ends ``interrupted``). Codex never times these requests out (it waits for
  ever), so the wait is bounded here by ``approval_timeout``; a callback that does not answer
  in time, raises, or answers something else is **declined**. Other requests keep the
  connection's policy (a permissions request, or an MCP elicitation that asks for form data,
  which a decision cannot fill in: declined by default);
* ``request_user_input`` becomes a :class:`UserInputRequest` for ``on_user_input``, which
  answers a mapping of question id to answer(s) or ``None``; unanswered (the
  ``user_input_timeout`` passed), cancelled (``None``), failed: the safe answer, *no answers*
  (``{"answers": {}}``: the model is told nothing was answered and goes on).

When the turn ends (completed, interrupted, timed out, cancelled), a callback still pending is
cancelled and its request answered with the safe default at once. Each callback runs in a task
of its own (the connection's): at its deadline or the turn's end the safe answer goes out at
once and the callback is cancelled and abandoned; one that ignores cancellation (a shielded
scope) finishes in the background, holding neither the request nor the turn (its late result
is dropped; a late failure is logged by type only).

**Privacy.** Commands, reasons, working directories, MCP messages, questions, options and
answers are never logged: the log says which method, which kind, how many questions, which
decision and how long it took. The records keep those texts out of their ``repr`` too, so a
host that logs a request object does not leak them; a question Codex marks ``isSecret`` is
also never copied anywhere beyond the request handed to the callback.

Size (~630 lines): every server-initiated request Codex sends, its safe default answer and
the host-callback bridge are one dispatch table read together; the typed records are the
seam to split along if it grows.
"""

from __future__ import annotations

import contextlib
import enum
import math
import re
import time
import types
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from typing import Any, Final, TypeVar

import anyio
import attrs

from codex_turn._log import format_error, get_logger

from .connection import Connection
from .logsafe import capped
from .tools import ToolRegistry

__all__ = [
    "APPROVAL_METHODS",
    "DEFAULT_APPROVAL_TIMEOUT_S",
    "DEFAULT_USER_INPUT_TIMEOUT_S",
    "ApprovalCallback",
    "ApprovalDecision",
    "ApprovalKind",
    "ApprovalPolicy",
    "ApprovalRequest",
    "Responder",
    "TurnBinding",
    "TurnRequestHandlers",
    "UserInputAnswers",
    "UserInputCallback",
    "UserInputHandler",
    "UserInputOption",
    "UserInputQuestion",
    "UserInputRequest",
    "decline_all",
]

log = get_logger(__name__)

T = TypeVar("T")

ApprovalPolicy = Callable[[str, Mapping[str, Any]], Awaitable[Mapping[str, Any]]]
"""``(method, params) -> response`` for approval server requests (connection-wide)."""
UserInputHandler = Callable[[Mapping[str, Any]], Awaitable[Mapping[str, Any]]]
"""``params -> {"answers": {...}}`` for ``item/tool/requestUserInput`` (connection-wide)."""

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
USER_INPUT_METHOD: Final = "item/tool/requestUserInput"

#: How long a host callback may take over an approval before it is declined (seconds).
DEFAULT_APPROVAL_TIMEOUT_S: Final = 60.0
#: How long a host callback may take over ``request_user_input`` before no answer is sent.
DEFAULT_USER_INPUT_TIMEOUT_S: Final = 60.0


async def decline_all(method: str, params: Mapping[str, Any]) -> Mapping[str, Any]:
    """The default approval policy: decline everything (the turn continues without it)."""
    if method in ("execCommandApproval", "applyPatchApproval"):
        return {"decision": "denied"}
    if method == "mcpServer/elicitation/request":
        return {"action": "decline"}
    if method == "item/permissions/requestApproval":
        return {"permissions": {}}
    return {"decision": "decline"}


# --- the typed API of the bridge --------------------------------------------------------------


class ApprovalDecision(enum.Enum):
    """A host's answer to an approval request."""

    #: Run it (this once).
    APPROVE = "approve"
    #: Run it, and let Codex run what its session-scoped approval cache then covers (the same
    #: command, the same files, the same MCP tool) without asking again in this thread.
    APPROVE_FOR_SESSION = "approve_for_session"
    #: Do not run it; the model is told it was rejected and the turn continues.
    DECLINE = "decline"
    #: Do not run it, and stop: for a command or a file change Codex interrupts the turn
    #: (outcome ``aborted``); for an MCP tool Codex 0.163 treats it like a decline (the model
    #: is told the call was cancelled and the turn continues).
    CANCEL = "cancel"


class ApprovalKind(enum.Enum):
    """What Codex asks approval for."""

    COMMAND = "command"  # a shell command (``item/commandExecution/requestApproval``)
    FILE_CHANGE = "file_change"  # a patch (``item/fileChange/requestApproval``)
    MCP_TOOL = "mcp_tool"  # an MCP tool call (an approval elicitation)


def _read_only(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return types.MappingProxyType(dict(value))


@attrs.frozen(kw_only=True)
class ApprovalRequest:
    """One approval request, as the host callback sees it. Texts that may be private (the
    command, the model's reason, the MCP message, the raw params) stay out of the ``repr``."""

    kind: ApprovalKind
    method: str
    thread_id: str
    turn_id: str | None
    item_id: str | None
    #: The command line (``COMMAND``), e.g. ``/bin/bash -lc 'touch f'``.
    command: str | None = attrs.field(default=None, repr=False)
    cwd: str | None = attrs.field(default=None, repr=False)
    #: The model's justification (``COMMAND``, ``FILE_CHANGE``).
    reason: str | None = attrs.field(default=None, repr=False)
    #: The MCP server and tool (``MCP_TOOL``), and Codex's question about it.
    server_name: str | None = None
    tool_name: str | None = None
    message: str | None = attrs.field(default=None, repr=False)
    #: Whether Codex offers a session-wide approval for this request (always for commands and
    #: file changes; for MCP tools when the elicitation advertises ``persist: "session"``).
    session_approval_offered: bool = True
    #: The request's params as Codex sent them (read-only).
    params: Mapping[str, Any] = attrs.field(factory=dict, converter=_read_only, repr=False)


@attrs.frozen(kw_only=True)
class UserInputOption:
    label: str = attrs.field(repr=False)
    description: str = attrs.field(default="", repr=False)


@attrs.frozen(kw_only=True)
class UserInputQuestion:
    """One ``request_user_input`` question. ``is_secret``: the answer is a secret (never
    logged, never kept); ``is_other``: a free-form answer besides the options is allowed."""

    id: str
    header: str = attrs.field(default="", repr=False)
    question: str = attrs.field(default="", repr=False)
    options: tuple[UserInputOption, ...] = attrs.field(default=(), repr=False)
    is_secret: bool = False
    is_other: bool = False


@attrs.frozen(kw_only=True)
class UserInputRequest:
    thread_id: str
    turn_id: str | None
    item_id: str | None
    questions: tuple[UserInputQuestion, ...]
    is_blocking: bool = False


#: Question id -> the answer (one string) or answers (several, e.g. options picked).
UserInputAnswers = Mapping[str, str | Sequence[str]]
#: ``await on_approval(request)`` -> the decision.
ApprovalCallback = Callable[[ApprovalRequest], Awaitable[ApprovalDecision]]
#: ``await on_user_input(request)`` -> the answers, or ``None`` to cancel (no answers).
UserInputCallback = Callable[[UserInputRequest], Awaitable[UserInputAnswers | None]]


def _positive(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{attribute.name} must be a positive number of seconds")


@attrs.frozen(kw_only=True)
class TurnRequestHandlers:
    """The host callbacks one turn binds to its thread (see the module header). A ``None``
    callback leaves that kind of request to the connection's default (declined / no answers).
    """

    on_approval: ApprovalCallback | None = None
    approval_timeout: float = attrs.field(default=DEFAULT_APPROVAL_TIMEOUT_S, validator=_positive)
    on_user_input: UserInputCallback | None = None
    user_input_timeout: float = attrs.field(
        default=DEFAULT_USER_INPUT_TIMEOUT_S, validator=_positive
    )


class TurnBinding:
    """The handlers bound to one thread while its turn runs, and the waits in flight."""

    def __init__(
        self,
        handlers: TurnRequestHandlers,
        spawn: Callable[[Callable[[], Coroutine[Any, Any, None]]], object] | None = None,
    ) -> None:
        self.handlers = handlers
        self.closed = False
        self._spawn = spawn
        self._waits: set[anyio.CancelScope] = set()
        #: Host callbacks being waited for: Codex is silent meanwhile, so the turn's idle
        #: timer does not run (:meth:`~.turn.TurnHandle.collect`).
        self.pending = 0
        #: When the last callback was answered (the idle timer restarts from there).
        self.answered_at = -math.inf

    async def bounded(self, call: Callable[[], Awaitable[T]], seconds: float) -> tuple[T, str]:
        """``(result, "host")``; raises ``TimeoutError`` when the wait ran out, or the turn
        ended meanwhile (the caller answers the safe default).

        The callback runs in a task of its own (the connection's): at the deadline it is
        asked to stop (cancelled) and abandoned, so one that ignores cancellation (a shielded
        scope) finishes in the background and never holds the answer or the turn's end."""
        if self.closed:
            raise TimeoutError("the turn has ended")
        self.pending += 1
        try:
            if self._spawn is None:
                return await self._inline(call, seconds)
            return await self._in_task(call, seconds)
        finally:
            self.pending -= 1
            self.answered_at = anyio.current_time()

    async def _in_task(self, call: Callable[[], Awaitable[T]], seconds: float) -> tuple[T, str]:
        done = anyio.Event()
        outcome: list[tuple[bool, Any]] = []
        callback_scope = anyio.CancelScope()
        abandoned = False

        async def run() -> None:
            with callback_scope:
                try:
                    outcome.append((True, await call()))
                except Exception as exc:
                    outcome.append((False, exc))
                    if abandoned:
                        # The type only: a host's message may quote private text.
                        log.info(
                            "appserver.abandoned_callback_failed", error_type=type(exc).__name__
                        )
                finally:
                    done.set()
            if abandoned:
                log.info("appserver.abandoned_callback_finished")

        assert self._spawn is not None
        self._spawn(run)
        with anyio.move_on_after(seconds) as waiting:
            self._waits.add(waiting)
            try:
                await done.wait()
            finally:
                self._waits.discard(waiting)
        if not outcome:
            abandoned = True
            callback_scope.cancel()
            raise TimeoutError("turn ended" if self.closed else "timed out")
        ok, value = outcome[0]
        if ok:
            return value, "host"
        raise value

    async def _inline(self, call: Callable[[], Awaitable[T]], seconds: float) -> tuple[T, str]:
        with anyio.CancelScope(deadline=anyio.current_time() + seconds) as scope:
            self._waits.add(scope)
            try:
                return await call(), "host"
            finally:
                self._waits.discard(scope)
        raise TimeoutError("turn ended" if self.closed else "timed out")

    def close(self) -> None:
        self.closed = True
        for scope in list(self._waits):
            scope.cancel()


# --- approvals ----------------------------------------------------------------------------------

_COMMAND_DECISIONS: Final = {
    ApprovalDecision.APPROVE: "accept",
    ApprovalDecision.APPROVE_FOR_SESSION: "acceptForSession",
    ApprovalDecision.DECLINE: "decline",
    ApprovalDecision.CANCEL: "cancel",
}
_LEGACY_DECISIONS: Final = {
    ApprovalDecision.APPROVE: "approved",
    ApprovalDecision.APPROVE_FOR_SESSION: "approved_for_session",
    ApprovalDecision.DECLINE: "denied",
    ApprovalDecision.CANCEL: "abort",
}
_KINDS: Final = {
    "item/commandExecution/requestApproval": ApprovalKind.COMMAND,
    "execCommandApproval": ApprovalKind.COMMAND,
    "item/fileChange/requestApproval": ApprovalKind.FILE_CHANGE,
    "applyPatchApproval": ApprovalKind.FILE_CHANGE,
    "mcpServer/elicitation/request": ApprovalKind.MCP_TOOL,
}


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _meta(params: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = params.get("_meta")
    return meta if isinstance(meta, Mapping) else {}


#: Codex 0.163 names the tool only in its question ("Allow the docs MCP server to run tool
#: \"search\"?"); ``_meta`` has ``tool_title`` only when the tool declares a title.
_MCP_TOOL_IN_MESSAGE: Final = re.compile(r'run tool "([^"]+)"')


def _mcp_tool_name(params: Mapping[str, Any], meta: Mapping[str, Any]) -> str | None:
    if isinstance(meta.get("tool_name"), str):
        return str(meta["tool_name"])
    found = _MCP_TOOL_IN_MESSAGE.search(_text(params.get("message")) or "")
    return found.group(1) if found else _text(meta.get("tool_title"))


def _offers_session(meta: Mapping[str, Any]) -> bool:
    persist = meta.get("persist")
    return persist == "session" or (isinstance(persist, list) and "session" in persist)


def approval_request(method: str, params: Mapping[str, Any]) -> ApprovalRequest | None:
    """The typed request for a host, or ``None`` when ``method`` is not one a decision can
    answer (a permissions request, an MCP elicitation that is not a tool approval)."""
    kind = _KINDS.get(method)
    if kind is None:
        return None
    meta = _meta(params)
    if kind is ApprovalKind.MCP_TOOL and meta.get("codex_approval_kind") != "mcp_tool_call":
        return None
    command = params.get("command")
    if isinstance(command, list):  # the legacy execCommandApproval sends argv
        command = " ".join(str(part) for part in command)
    return ApprovalRequest(
        kind=kind,
        method=method,
        thread_id=str(params.get("threadId") or params.get("conversationId") or ""),
        turn_id=_text(params.get("turnId")),
        item_id=_text(params.get("itemId") or params.get("callId")),
        command=_text(command),
        cwd=_text(params.get("cwd")),
        reason=_text(params.get("reason")),
        server_name=_text(params.get("serverName")),
        tool_name=_mcp_tool_name(params, meta) if kind is ApprovalKind.MCP_TOOL else None,
        message=_text(params.get("message")),
        session_approval_offered=kind is not ApprovalKind.MCP_TOOL or _offers_session(meta),
        params=params,
    )


def approval_response(request: ApprovalRequest, decision: ApprovalDecision) -> dict[str, Any]:
    """The wire answer to ``request`` for ``decision`` (each method has its own shape)."""
    if request.kind is ApprovalKind.MCP_TOOL:
        if decision is ApprovalDecision.DECLINE or decision is ApprovalDecision.CANCEL:
            return {"action": "decline" if decision is ApprovalDecision.DECLINE else "cancel"}
        answer: dict[str, Any] = {"action": "accept", "content": {}}
        if decision is ApprovalDecision.APPROVE_FOR_SESSION and request.session_approval_offered:
            answer["_meta"] = {"persist": "session"}
        return answer
    if request.method in ("execCommandApproval", "applyPatchApproval"):
        return {"decision": _LEGACY_DECISIONS[decision]}
    return {"decision": _COMMAND_DECISIONS[decision]}


async def _ask_host(binding: TurnBinding, request: ApprovalRequest) -> dict[str, Any]:
    handlers = binding.handlers
    assert handlers.on_approval is not None
    callback = handlers.on_approval
    started = time.perf_counter()
    decision = ApprovalDecision.DECLINE
    try:
        answer: object
        answer, source = await binding.bounded(lambda: callback(request), handlers.approval_timeout)
        if isinstance(answer, ApprovalDecision):
            decision = answer
        else:
            source = "invalid"
    except TimeoutError:
        source = "turn_ended" if binding.closed else "timeout"
    except Exception as exc:
        source = "error"
        # The type only: a host's message may quote the command.
        log.warning("appserver.approval_callback_failed", error_type=type(exc).__name__)
    log.info(
        "appserver.approval_answered",
        kind=request.kind.value,
        decision=decision.value,
        source=source,
        ms=round((time.perf_counter() - started) * 1000, 1),
    )
    return approval_response(request, decision)


# --- user input ---------------------------------------------------------------------------------


def _option(raw: Any) -> UserInputOption | None:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("label"), str):
        return None
    return UserInputOption(label=raw["label"], description=_text(raw.get("description")) or "")


def _question(raw: Any) -> UserInputQuestion | None:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("id"), str):
        return None
    options = raw.get("options")
    parsed = [_option(o) for o in options] if isinstance(options, list) else []
    return UserInputQuestion(
        id=raw["id"],
        header=_text(raw.get("header")) or "",
        question=_text(raw.get("question")) or "",
        options=tuple(o for o in parsed if o is not None),
        is_secret=raw.get("isSecret") is True,
        is_other=raw.get("isOther") is True,
    )


def user_input_request(params: Mapping[str, Any]) -> UserInputRequest:
    questions = params.get("questions")
    parsed = [_question(q) for q in questions] if isinstance(questions, list) else []
    return UserInputRequest(
        thread_id=str(params.get("threadId") or ""),
        turn_id=_text(params.get("turnId")),
        item_id=_text(params.get("itemId")),
        questions=tuple(q for q in parsed if q is not None),
        is_blocking=params.get("isBlocking") is True,
    )


def user_input_response(request: UserInputRequest, answers: Any) -> dict[str, Any]:
    """The wire answer: each asked question's answer(s) as a list of strings; anything else
    (an unknown question id, a non-string answer, not a mapping at all) is dropped."""
    result: dict[str, Any] = {}
    if isinstance(answers, Mapping):
        for question in request.questions:
            value = answers.get(question.id)
            if isinstance(value, str):
                result[question.id] = {"answers": [value]}
            elif (
                isinstance(value, Sequence)
                and not isinstance(value, bytes)
                and all(isinstance(v, str) for v in value)
            ):
                result[question.id] = {"answers": list(value)}
    return {"answers": result}


async def _ask_host_input(binding: TurnBinding, params: Mapping[str, Any]) -> dict[str, Any]:
    handlers = binding.handlers
    assert handlers.on_user_input is not None
    callback = handlers.on_user_input
    request = user_input_request(params)
    started = time.perf_counter()
    response: dict[str, Any] = {"answers": {}}
    try:
        answers: object
        answers, source = await binding.bounded(
            lambda: callback(request), handlers.user_input_timeout
        )
        if answers is None:
            source = "cancelled"
        else:
            response = user_input_response(request, answers)
            if not isinstance(answers, Mapping) or any(
                question.id in answers and question.id not in response["answers"]
                for question in request.questions
            ):
                source = "invalid"  # not a mapping, or an answer that is not text (dropped)
    except TimeoutError:
        source = "turn_ended" if binding.closed else "timeout"
    except Exception as exc:
        source = "error"
        # The type only: a host's message may quote a question or an answer.
        log.warning("appserver.user_input_callback_failed", error_type=type(exc).__name__)
    log.info(
        "appserver.user_input_answered",
        questions=len(request.questions),
        private_questions=sum(q.is_secret for q in request.questions),
        answered=len(response["answers"]),
        source=source,
        ms=round((time.perf_counter() - started) * 1000, 1),
    )
    return response


# --- dispatch -----------------------------------------------------------------------------------


class Responder:
    """Answers the requests Codex sends (see the module header): a part of
    :class:`~.client.AppServerClient`, its :attr:`~.connection.Connection.serve_request`.

    ``tools``: each thread's Python tools (:attr:`~.threads.Threads.tools`, shared);
    ``approval_policy`` and ``user_input_handler``: the connection-wide defaults."""

    def __init__(
        self,
        connection: Connection,
        tools: Mapping[str, ToolRegistry],
        *,
        approval_policy: ApprovalPolicy = decline_all,
        user_input_handler: UserInputHandler | None = None,
    ) -> None:
        self._connection = connection
        self._tools = tools
        self.approval_policy = approval_policy
        self.user_input_handler = user_input_handler
        #: The handlers each thread's running turn bound (:meth:`bind`).
        self.bindings: dict[str, TurnBinding] = {}

    @contextlib.contextmanager
    def bind(self, thread_id: str, handlers: TurnRequestHandlers | None) -> Iterator[None]:
        """Route ``thread_id``'s approvals and user-input requests to ``handlers`` for the
        block (nothing when ``None``); on exit, pending callbacks are cancelled (safe answers
        sent)."""
        if handlers is None:
            yield
            return
        group = self._connection.task_group
        binding = TurnBinding(handlers, group.start_soon if group is not None else None)
        self.bindings[thread_id] = binding
        try:
            yield
        finally:
            binding.close()
            if self.bindings.get(thread_id) is binding:
                del self.bindings[thread_id]

    async def serve(self, msg_id: Any, method: str, params: Any) -> None:
        """Answer one server request, exactly once (a failing handler gets ``-32000``)."""
        params = params if isinstance(params, dict) else {}
        thread_id = str(params.get("threadId", ""))
        binding = self.bindings.get(thread_id)
        respond = self._connection.respond
        try:
            if method == "item/tool/call":
                registry = self._tools.get(thread_id) or ToolRegistry()
                result = await registry.call(str(params.get("tool", "")), params.get("arguments"))
            elif method in APPROVAL_METHODS:
                log.info("appserver.approval_request", method=capped(method))
                request = approval_request(method, params)
                if (
                    binding is not None
                    and binding.handlers.on_approval is not None
                    and request is not None
                ):
                    result = await _ask_host(binding, request)
                else:
                    result = dict(await self.approval_policy(method, params))
            elif method == USER_INPUT_METHOD:
                if binding is not None and binding.handlers.on_user_input is not None:
                    result = await _ask_host_input(binding, params)
                elif self.user_input_handler is not None:
                    result = dict(await self.user_input_handler(params))
                else:
                    result = {"answers": {}}
            else:
                await self._connection.refuse_request(msg_id, method)
                return
        except Exception as exc:
            log.warning(
                "appserver.server_request_failed", method=capped(method), error=format_error(exc)
            )
            await respond(msg_id, error={"code": -32000, "message": "client handler failed"})
            return
        await respond(msg_id, result=result)
