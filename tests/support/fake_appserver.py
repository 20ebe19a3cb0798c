"""An in-process fake of the Codex app-server, scriptable per turn, for orchestrator tests.

Test support, not product. :class:`FakeAppServer` implements
:class:`codex_turn.harness.appserver.AppServerPort`, the part of
:class:`~codex_turn.harness.appserver.AppServer` that :func:`codex_turn.run_codex_turn` and
native compaction use (mypy checks it, see the end of this module):

* ``await start_thread(*, cwd, developer_instructions, model, tools, <policy>) -> ThreadResult``
* ``await resume_thread(thread_id, *, developer_instructions, cwd, model, tools, <policy>)``,
  where ``<policy>`` is ``approval_policy``, ``sandbox``, ``approvals_reviewer`` and
  ``service_tier`` (recorded in the call's ``args``; the result reports them back, like
  Codex's effective values);
* ``forget_thread(thread_id)`` (noted in ``forgotten``);
* ``await compact_thread(thread_id, *, timeout, interrupt_grace, developer_instructions,
  cwd) -> CompactionResult``: ``compaction_result`` (a completed compaction by default), or
  ``compact_error`` raised;
* ``async with turn(thread_id, input, *, prompt, images, model, ...) as handle``, where
  ``handle`` is the REAL :class:`~codex_turn.harness.appserver.TurnHandle` (so ``collect``'s
  idle/turn timeouts, ``interrupt`` sent once, ``projector``, ``result`` and the
  end-of-stream -> :class:`AppServerClosed` mapping are the product's own code) reading
  notifications from a scripted in-memory stream, and folding them with the REAL
  :class:`~codex_turn.harness.appserver.TurnProjector` (snapshots, mirror identities and
  idempotency scope are therefore realistic). Like ``AppServerClient.turn``, leaving the
  block before ``turn/completed`` (cancellation, an exception) interrupts the turn, shielded,
  and waits for its end, unless the server is closed.

What Codex does in a turn is a :class:`CodexScript` (reply, reasoning, in-turn native
compaction, token usage, and how the turn ends). Endings:

``completed``  the reply as an ``agentMessage`` and ``turn/completed`` ``completed``;
``failed``     an ``error`` notification, then ``turn/completed`` ``failed`` with
               ``error.message`` = ``script.error_message`` (a prompt error);
``interrupted`` Codex ends the turn ``interrupted`` on its own (an abort from elsewhere);
``yield``      the model calls the dynamic tool ``sessions_yield`` (the orchestrator's, offered
               with ``TurnParams(yield_tool=True)``); the fake runs it through the thread's
               :class:`ToolRegistry` like Codex's ``item/tool/call``. The orchestrator's tool
               interrupts the turn, so it ends ``interrupted``; when the tool is not offered the
               model gets "unknown tool" and the turn completes normally with the reply;
``hang``       no more notifications until interrupted (an idle timeout or ``turn_timeout``
               fires in ``collect``, which interrupts; the fake then ends ``interrupted``);
``closed``     the process dies mid-turn: the stream ends and ``TurnHandle`` raises
               :class:`AppServerClosed` (the next call behaves like a restarted process);
``cancel``     calls ``server.cancel_caller()`` (set it to the caller's ``CancelScope.cancel``)
               and then hangs: the caller's cancellation interrupts the turn.

``partial`` streams an ``agentMessage`` delta that never completes before a non-completed
ending (a dangling item: never mirrored as the reply). ``tool_calls`` makes the model call
dynamic tools (``(name, arguments)`` each, in order, before the reply of any ending): each
runs through the thread's REAL :class:`ToolRegistry` (so arguments are checked against the
tool's schema exactly as in the product) and is recorded as a ``tool_call`` (``name``,
``success``), with the text it answered in ``server.tool_outputs``. ``turn_start_error``
makes ``turn/start`` itself fail. Thread-level failures are attributes, applied to every call
while set: ``start_error`` (``thread/start``) and ``resume_error`` (``thread/resume``). A
resume can fail two ways, as with the real client: definitively (:class:`ThreadNotFound`:
what resuming an unknown thread raises, as Codex reports a missing rollout; set
``resume_error = FakeAppServer.not_found(thread_id)`` to force it) or transiently (any other
:class:`AppServerError`, e.g. ``FakeAppServer.resume_timeout()``: the thread still exists).

Scripts are consumed one per ``turn()`` from ``server.scripts`` (``default`` when empty).
Everything is recorded in ``server.calls`` (:class:`FakeCall`: ``start_thread``,
``resume_thread``, ``turn``, ``interrupt``, ``tool_call``, ``compact_thread``), with helpers
:meth:`FakeAppServer.turn_inputs` and :meth:`FakeAppServer.methods`.

Example::

    server = FakeAppServer(scripts=[CodexScript(reply="hi", ending="hang")])
    result = await run_codex_turn(params_with_short_idle_timeout, app_server=server)
    assert result.outcome is TurnOutcome.TIMED_OUT
    assert server.methods() == ["start_thread", "turn", "interrupt"]
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.lowlevel
import attrs

from codex_turn.harness.appserver import (
    INTERRUPT_GRACE_S,
    NATIVE_COMPACTION_TIMEOUT_S,
    ApprovalsReviewer,
    AppServerClosed,
    AppServerError,
    AppServerPort,
    AppServerRpcError,
    AppServerTimeout,
    AskForApproval,
    CompactionResult,
    DynamicTool,
    LoadedThread,
    Notification,
    SandboxMode,
    ThreadNotFound,
    ThreadResult,
    ToolRegistry,
    TurnHandle,
    TurnProjector,
)
from codex_turn.harness.appserver.server_requests import TurnRequestHandlers
from codex_turn.harness.appserver.thread_settings import (
    DEFAULT_SETTINGS,
    RUNTIME_POLICY,
    ThreadSettings,
)
from codex_turn.harness.appserver.types import TextInput, ThreadInfo, UserInput

__all__ = ["ENDINGS", "CodexScript", "FakeAppServer", "FakeCall"]

Ending = Literal["completed", "failed", "interrupted", "yield", "hang", "closed", "cancel"]
ENDINGS: tuple[Ending, ...] = (
    "completed",
    "failed",
    "interrupted",
    "yield",
    "hang",
    "closed",
    "cancel",
)
Compaction = Literal["none", "completed", "started_only", "legacy"]

DEFAULT_USAGE: Mapping[str, int] = {
    "totalTokens": 150,
    "inputTokens": 120,
    "cachedInputTokens": 20,
    "cacheWriteInputTokens": 0,
    "outputTokens": 30,
    "reasoningOutputTokens": 0,
}


@attrs.frozen(kw_only=True)
class CodexScript:
    """What the fake Codex does in one turn (see the module docstring for the endings)."""

    reply: str | None = "Done."
    reasoning: str | None = None
    ending: Ending = "completed"
    error_message: str = "codex turn failed: model said no"
    compaction: Compaction = "none"
    partial: str | None = None
    usage: Mapping[str, int] | None = DEFAULT_USAGE
    turn_start_error: AppServerError | None = None
    yield_tool: str = "sessions_yield"
    tool_calls: Sequence[tuple[str, Any]] = ()


@attrs.define
class FakeCall:
    method: str
    args: dict[str, Any]


@attrs.frozen
class _Policy:
    """A thread's runtime policy (``None``: never set)."""

    approval_policy: AskForApproval | None = None
    sandbox: SandboxMode | None = None
    approvals_reviewer: ApprovalsReviewer | None = None
    service_tier: str | None = None

    @classmethod
    def of(cls, settings: ThreadSettings) -> _Policy:
        return cls(**{name: getattr(settings, name) for name in RUNTIME_POLICY})

    def updated(self, sent: _Policy) -> _Policy:
        return _Policy(
            sent.approval_policy if sent.approval_policy is not None else self.approval_policy,
            sent.sandbox if sent.sandbox is not None else self.sandbox,
            sent.approvals_reviewer
            if sent.approvals_reviewer is not None
            else self.approvals_reviewer,
            sent.service_tier if sent.service_tier is not None else self.service_tier,
        )


_SANDBOX_TYPES: Mapping[SandboxMode, str] = {
    "read-only": "readOnly",
    "workspace-write": "workspaceWrite",
    "danger-full-access": "dangerFullAccess",
}


# Script steps other than notifications.
@attrs.frozen
class _ToolCall:
    name: str
    arguments: Any


class _Hang:
    pass


class _Close:
    pass


class _CancelCaller:
    pass


Step = Notification | _ToolCall | _Hang | _Close | _CancelCaller


class _ScriptedStream:
    """The receive side of a turn's notification stream, pulled by the real TurnHandle."""

    def __init__(
        self, server: FakeAppServer, thread_id: str, turn_id: str, steps: Iterable[Step]
    ) -> None:
        self.server = server
        self.thread_id = thread_id
        self.turn_id = turn_id
        self.steps: collections.deque[Step] = collections.deque(steps)
        self.interrupted = anyio.Event()
        self.completed = False

    def _end(self, status: str, error: str | None = None) -> Notification:
        self.completed = True
        return Notification(
            "turn/completed",
            {
                "threadId": self.thread_id,
                "turn": {
                    "id": self.turn_id,
                    "items": [],
                    "status": status,
                    "error": None if error is None else {"message": error},
                    "durationMs": 7,
                },
            },
        )

    async def receive(self) -> Notification:
        await anyio.lowlevel.checkpoint()
        while True:
            if self.server.closed or self.completed:
                raise anyio.EndOfStream
            if self.interrupted.is_set():
                return self._end("interrupted")
            if not self.steps:
                await self.interrupted.wait()  # a script without an end hangs
                continue
            step = self.steps.popleft()
            if isinstance(step, Notification):
                if step.method == "turn/completed":
                    self.completed = True
                return step
            if isinstance(step, _ToolCall):
                await self.server._call_tool(self.thread_id, step.name, step.arguments)
            elif isinstance(step, _Hang):
                await self.interrupted.wait()
            elif isinstance(step, _Close):
                self.server._die()
                raise anyio.EndOfStream
            else:
                self.server.cancel_caller()


class FakeAppServer:
    """See the module docstring. All knobs are plain attributes; change them between turns."""

    def __init__(
        self,
        *,
        scripts: Iterable[CodexScript] = (),
        default: CodexScript | None = None,
        provider: str = "fake",
        model: str = "fake-model",
    ) -> None:
        self.scripts: collections.deque[CodexScript] = collections.deque(scripts)
        self.default = default or CodexScript()
        self.provider = provider
        self.model = model
        self.start_error: AppServerError | None = None
        self.forgotten: list[str] = []
        self.resume_error: AppServerError | None = None
        self.compact_error: AppServerError | None = None
        self.compaction_result: CompactionResult | None = None
        self.closed_error: AppServerClosed | None = None
        self.cancel_caller: Callable[[], None] = _no_caller
        self.calls: list[FakeCall] = []
        self.tool_outputs: list[str] = []  # what each tool call answered the model, in order
        self.turn_overrides: list[dict[str, Any]] = []  # each turn/start's per-turn overrides
        self.threads: dict[str, ToolRegistry] = {}
        self._active: dict[tuple[str, str], _ScriptedStream] = {}
        self._policies: dict[str, _Policy] = {}
        self._ids = itertools.count(1)
        # Off by default: like a Codex process that holds no thread between turns, so every
        # turn resumes (the call lists of most tests). On: the real client's ledger.
        self.keeps_threads_loaded = False
        self.loaded: dict[str, LoadedThread] = {}

    # --- failures ------------------------------------------------------------------------

    @staticmethod
    def not_found(thread_id: str) -> ThreadNotFound:
        """Codex's definitive answer: there is no such thread (as for a missing rollout)."""
        return ThreadNotFound(
            -32600, f"no rollout found for thread id {thread_id}", thread_id=thread_id
        )

    @staticmethod
    def resume_timeout(seconds: float = 60.0) -> AppServerTimeout:
        """A transient failure: ``thread/resume`` got no answer (the thread may well exist)."""
        return AppServerTimeout(
            f"thread/resume got no response within {seconds:g}s",
            method="thread/resume",
            seconds=seconds,
        )

    # --- inspection ----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.closed_error is not None

    def methods(self) -> list[str]:
        return [call.method for call in self.calls]

    def calls_to(self, method: str) -> list[FakeCall]:
        return [call for call in self.calls if call.method == method]

    def turn_inputs(self) -> list[str]:
        """The text of every ``turn/start`` (what the model was asked)."""
        return [call.args["text"] for call in self.calls_to("turn")]

    # --- the AppServer subset ------------------------------------------------------------

    def forget_thread(self, thread_id: str) -> None:
        """Like ``AppServer.forget_thread``: noted in ``forgotten``, not in ``calls``."""
        self.forgotten.append(thread_id)
        self.loaded.pop(thread_id, None)

    def loaded_thread(self, thread_id: str) -> LoadedThread | None:
        return self.loaded.get(thread_id) if self.keeps_threads_loaded else None

    def bind_tools(self, thread_id: str, tools: Iterable[DynamicTool]) -> None:
        registry = ToolRegistry(tools)
        self.calls.append(FakeCall("bind_tools", {"thread_id": thread_id, "tools": registry.names}))
        self.threads[thread_id] = registry

    def _recorded(self, settings: ThreadSettings, registry: ToolRegistry) -> dict[str, Any]:
        """The settings as a call records them (the tools by name)."""
        return {**attrs.asdict(settings, recurse=False), "tools": registry.names}

    async def start_thread(self, settings: ThreadSettings = DEFAULT_SETTINGS) -> ThreadResult:
        await anyio.lowlevel.checkpoint()
        registry = ToolRegistry(settings.tools or ())
        policy = _Policy.of(settings)
        self.calls.append(FakeCall("start_thread", self._recorded(settings, registry)))
        self._restart_if_dead()
        if self.start_error is not None:
            raise self.start_error
        thread_id = f"thread-{next(self._ids)}"
        self.threads[thread_id] = registry
        self._policies[thread_id] = policy
        result = self._thread_result(thread_id, settings.model, policy)
        self.loaded[result.thread_id] = LoadedThread(result, settings.key)
        return result

    async def resume_thread(self, thread_id: str, settings: ThreadSettings) -> ThreadResult:
        await anyio.lowlevel.checkpoint()
        registry = ToolRegistry(settings.tools or ())
        sent = _Policy.of(settings)
        self.calls.append(
            FakeCall(
                "resume_thread", {"thread_id": thread_id, **self._recorded(settings, registry)}
            )
        )
        self._restart_if_dead()
        if self.resume_error is not None:
            raise self.resume_error
        if thread_id not in self.threads:
            raise self.not_found(thread_id)
        # Codex froze the tool set at thread/start; the tools are bound locally only.
        self.threads[thread_id] = registry
        # What was sent replaces the thread's policy; what was not keeps it.
        policy = self._policies[thread_id].updated(sent)
        self._policies[thread_id] = policy
        result = self._thread_result(thread_id, settings.model, policy)
        self.loaded[result.thread_id] = LoadedThread(result, settings.key)
        return result

    async def compact_thread(
        self,
        thread_id: str,
        *,
        timeout: float = NATIVE_COMPACTION_TIMEOUT_S,  # noqa: ASYNC109
        interrupt_grace: float = INTERRUPT_GRACE_S,
        developer_instructions: str | None = None,
        cwd: str | None = None,
    ) -> CompactionResult:
        await anyio.lowlevel.checkpoint()
        self.calls.append(
            FakeCall(
                "compact_thread",
                {
                    "thread_id": thread_id,
                    "timeout": timeout,
                    "interrupt_grace": interrupt_grace,
                    "developer_instructions": developer_instructions,
                    "cwd": cwd,
                },
            )
        )
        self._restart_if_dead()
        if self.compact_error is not None:
            raise self.compact_error
        if thread_id not in self.threads:
            raise self.not_found(thread_id)  # the real AppServer resumes it first
        if self.compaction_result is not None:
            return self.compaction_result
        return CompactionResult(
            status="completed",
            thread_id=thread_id,
            turn_id=f"turn-{next(self._ids)}",
            signal="item/completed",
        )

    @contextlib.asynccontextmanager
    async def turn(
        self,
        thread_id: str,
        input: str | Sequence[UserInput],
        *,
        prompt: str | None = None,
        images: Sequence[str] = (),
        provider: str | None = None,
        model: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
        overrides: Mapping[str, Any] | None = None,
        handlers: TurnRequestHandlers | None = None,
    ) -> AsyncIterator[TurnHandle]:
        self.turn_overrides.append(dict(overrides or {}))
        await anyio.lowlevel.checkpoint()
        text = (
            input
            if isinstance(input, str)
            else "\n".join(i.text for i in input if isinstance(i, TextInput))
        )
        script = self.scripts.popleft() if self.scripts else self.default
        self.calls.append(
            FakeCall(
                "turn",
                {
                    "thread_id": thread_id,
                    "text": text,
                    "prompt": prompt,
                    "images": list(images),
                    "model": model,
                },
            )
        )
        self._restart_if_dead()
        if script.turn_start_error is not None:
            raise script.turn_start_error
        if thread_id not in self.threads:
            raise AppServerRpcError(-32600, f"thread not loaded: {thread_id}")
        turn_id = f"turn-{next(self._ids)}"
        stream = _ScriptedStream(self, thread_id, turn_id, _steps(script, thread_id, turn_id))
        self._active[(thread_id, turn_id)] = stream
        projector = TurnProjector(
            thread_id=thread_id,
            prompt=text if prompt is None else prompt,
            provider=provider or self.provider,
            model=model or self.model,
            turn_id=turn_id,
        )
        handle = TurnHandle(self, thread_id, turn_id, stream, projector)
        try:
            yield handle
        finally:
            await handle.aclose()  # like AppServerClient.turn: interrupt a turn left running
            self._active.pop((thread_id, turn_id), None)

    # --- what TurnHandle needs from its client ----------------------------------------------

    async def interrupt_turn(self, thread_id: str, turn_id: str, *, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        await anyio.lowlevel.checkpoint()
        self.calls.append(FakeCall("interrupt", {"thread_id": thread_id, "turn_id": turn_id}))
        if self.closed_error is not None:
            raise self.closed_error
        stream = self._active.get((thread_id, turn_id))
        if stream is None or stream.completed:
            raise AppServerRpcError(-32600, "no active turn to interrupt")
        stream.interrupted.set()

    # --- internals -----------------------------------------------------------------------

    def _thread_result(self, thread_id: str, model: str | None, policy: _Policy) -> ThreadResult:
        return ThreadResult(
            thread=ThreadInfo(id=thread_id, model=model or self.model),
            model=model or self.model,
            model_provider=self.provider,
            approval_policy=policy.approval_policy,
            sandbox=None if policy.sandbox is None else {"type": _SANDBOX_TYPES[policy.sandbox]},
            approvals_reviewer=policy.approvals_reviewer,
            service_tier=policy.service_tier,
        )

    def _restart_if_dead(self) -> None:
        # The real AppServer restarts a crashed process on the next call.
        self.closed_error = None

    def _die(self) -> None:
        self.closed_error = AppServerClosed("codex app-server exited", returncode=137)
        self.loaded.clear()  # a new process holds no thread

    async def _call_tool(self, thread_id: str, name: str, arguments: Any) -> None:
        registry = self.threads.get(thread_id, ToolRegistry())
        response = await registry.call(name, arguments)
        self.calls.append(FakeCall("tool_call", {"name": name, "success": response.get("success")}))
        texts = [str(i.get("text", "")) for i in response.get("contentItems", [])]
        self.tool_outputs.append("\n".join(texts))


def _no_caller() -> None:
    raise AssertionError("CodexScript(ending='cancel') needs server.cancel_caller")


def _steps(script: CodexScript, thread_id: str, turn_id: str) -> list[Step]:
    def note(method: str, **params: Any) -> Notification:
        return Notification(method, {"threadId": thread_id, "turnId": turn_id, **params})

    def item(method: str, kind: str, item_id: str, **fields: Any) -> Notification:
        return note(method, item={"type": kind, "id": item_id, **fields})

    steps: list[Step] = [
        Notification(
            "turn/started",
            {"threadId": thread_id, "turn": {"id": turn_id, "status": "inProgress", "items": []}},
        ),
        item("item/started", "userMessage", f"{turn_id}-user", content=[]),
        item("item/completed", "userMessage", f"{turn_id}-user", content=[]),
    ]
    if script.compaction != "none":
        compaction_id = f"{turn_id}-compaction"
        if script.compaction == "legacy":
            steps.append(note("thread/compacted"))
        else:
            steps.append(item("item/started", "contextCompaction", compaction_id))
            if script.compaction == "completed":
                steps.append(item("item/completed", "contextCompaction", compaction_id))
    if script.reasoning is not None:
        reasoning_id = f"{turn_id}-reasoning"
        steps += [
            item("item/started", "reasoning", reasoning_id, summary=[], content=[]),
            note(
                "item/reasoning/summaryTextDelta",
                itemId=reasoning_id,
                summaryIndex=0,
                delta=script.reasoning,
            ),
            item("item/completed", "reasoning", reasoning_id, summary=[], content=[]),
        ]

    def tool_calls() -> list[Step]:
        steps: list[Step] = []
        for index, (name, arguments) in enumerate(script.tool_calls):
            call_id = f"{turn_id}-call-{index}"
            steps += [
                item("item/started", "dynamicToolCall", call_id, tool=name),
                _ToolCall(name, arguments),
                item("item/completed", "dynamicToolCall", call_id, tool=name),
            ]
        return steps

    def reply() -> list[Step]:
        if script.reply is None:
            return []
        reply_id = f"{turn_id}-reply"
        return [
            item("item/started", "agentMessage", reply_id, text=""),
            note("item/agentMessage/delta", itemId=reply_id, delta=script.reply),
            item("item/completed", "agentMessage", reply_id, text=script.reply),
        ]

    def partial() -> list[Step]:
        if script.partial is None:
            return []
        partial_id = f"{turn_id}-partial"
        return [
            item("item/started", "agentMessage", partial_id, text=""),
            note("item/agentMessage/delta", itemId=partial_id, delta=script.partial),
        ]

    usage: list[Step] = (
        []
        if script.usage is None
        else [
            note(
                "thread/tokenUsage/updated",
                tokenUsage={"last": dict(script.usage), "modelContextWindow": 200_000},
            )
        ]
    )

    def completed(status: str, error: str | None = None) -> Notification:
        return Notification(
            "turn/completed",
            {
                "threadId": thread_id,
                "turn": {
                    "id": turn_id,
                    "items": [],
                    "status": status,
                    "error": None if error is None else {"message": error},
                    "durationMs": 5,
                },
            },
        )

    steps += tool_calls()
    ending = script.ending
    if ending == "completed":
        steps += [*reply(), *usage, completed("completed")]
    elif ending == "failed":
        steps += [
            *partial(),
            note("error", error={"message": script.error_message}, willRetry=False),
            completed("failed", script.error_message),
        ]
    elif ending == "interrupted":
        steps += [*partial(), *usage, completed("interrupted")]
    elif ending == "yield":
        call_id = f"{turn_id}-yield"
        steps += [
            *reply(),
            item("item/started", "dynamicToolCall", call_id, tool=script.yield_tool),
            _ToolCall(script.yield_tool, {}),
            item("item/completed", "dynamicToolCall", call_id, tool=script.yield_tool),
            *usage,
            completed("completed"),
        ]
    elif ending == "hang":
        steps += [*partial(), *usage, _Hang()]
    elif ending == "closed":
        steps += [*partial(), _Close()]
    else:  # cancel
        steps += [*partial(), _CancelCaller(), _Hang()]
    return steps


if TYPE_CHECKING:  # mypy proves the fake implements the port the orchestrator uses

    def _implements_port(server: FakeAppServer) -> AppServerPort:
        return server
