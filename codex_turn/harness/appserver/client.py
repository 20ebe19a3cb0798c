"""The anyio JSON-RPC client for ``codex app-server`` (works on asyncio and trio).

Layering, bottom up:

1. **Transport** (:mod:`.process`): lines in, lines out; OS errors become
   :class:`AppServerClosed` there.
2. **Protocol** (this module, :class:`AppServerClient`): one reader task parses each line and
   dispatches it as a *response* (``id`` + ``result``/``error``: wakes the waiting request), a
   *server request* (``id`` + ``method``: handled in its own task, answered exactly once) or a
   *notification* (``method`` only: routed to the subscribers of its ``threadId``, and to
   global listeners). A line that is not JSON is logged (its length, never its content) and
   skipped: one garbage line never kills the client. When the transport ends, *every* pending
   request and every subscription fails with the same :class:`AppServerClosed`, at once.
3. **Methods**: ``initialize``/``initialized`` (with ``experimentalApi``, needed for dynamic
   tools), ``thread/start``, ``thread/resume`` (always ``excludeTurns`` and the developer
   instructions re-sent: Codex loses them after a compaction otherwise), ``turn/start``,
   ``turn/interrupt`` and ``thread/compact/start``, with typed params/results (:mod:`.types`).
4. **Turns**: :meth:`AppServerClient.turn` opens a :class:`TurnHandle` that yields the turn's
   notifications until ``turn/completed`` and folds them through the
   :class:`~.projector.TurnProjector`; :meth:`AppServerClient.run_turn` does it all and
   returns the :class:`~.projector.CodexTurnResult`. A cancelled or timed-out turn is interrupted
   (once: a second ``turn/interrupt`` for the same turn would hang in Codex; and only once the
   turn is active, after its ``turn/started``: Codex refuses an earlier one and the turn runs
   on). That holds from the moment ``turn/start`` is sent: a caller cancelled (or timed out)
   before its response still interrupts the turn Codex started. ``on_event`` callbacks run
   outside the idle/turn timeouts; each wait of an abandonment is bounded by the interrupt
   grace (:data:`~.defaults.INTERRUPT_GRACE_S`, or ``AppServerConfig.interrupt_grace``).
   :meth:`AppServerClient.forget_thread` releases a thread's local state (its tools).
5. **Compaction**: :meth:`AppServerClient.compact_thread` runs ``thread/compact/start`` (a turn
   of its own in Codex) to its end, serialised per thread; past its deadline it interrupts
   the compaction turn and, when the interrupt is not acknowledged within a grace period,
   :meth:`AppServerClient.retire` s the connection before returning.

Theory of a turn
----------------
A :class:`TurnHandle` tracks one Codex turn in a single :class:`CodexTurnPhase`, changed in
one place (:meth:`TurnHandle._fire`) by one table (:data:`_TURN_TABLE`)::

    STARTING --turn/started--> RUNNING --interrupt--> INTERRUPTING --abandon--> ABANDONED
        |                                                  ^
        +--interrupt--> INTERRUPT_QUEUED --turn/started or grace passed--+
    (any phase) --turn/completed--> COMPLETED

Three facts used to be three flags; they are one phase because they are not independent.
*Codex's side*: ``turn/start`` is answered before the turn is active, and Codex refuses a
``turn/interrupt`` until ``turn/started`` (the turn then runs on), so an interrupt asked for
while STARTING is queued until ``turn/started`` or the interrupt grace. *Ours*: the interrupt
is decided once (a second ``turn/interrupt`` for one turn hangs inside Codex), and only the
task that decided it sends it; giving up on a turn (a cancelled caller, a timed-out
:meth:`TurnHandle.collect`) always interrupts first and then waits at most one grace, so
ABANDONED comes after an interrupt decision and leaving the turn never waits twice. The two
notifications move the phase wherever they arrive (inside :meth:`TurnHandle._absorb`); our
decisions only in :meth:`TurnHandle.interrupt` and when giving up. An input the table does
not list is a bug in this module and raises ``RuntimeError``.

Errors are mapped once, here: a JSON-RPC error object becomes :class:`AppServerRpcError`, a
missed deadline :class:`AppServerTimeout`. Server requests: ``item/tool/call`` goes to the
thread's :class:`~.tools.ToolRegistry`; approvals go to an :data:`ApprovalPolicy` that declines
by default; ``item/tool/requestUserInput`` goes to an optional callback and is otherwise
answered with no answers; unknown methods get JSON-RPC ``-32601``.

Logging records ids, methods, counts and durations, never params (they carry prompts, tool
arguments and model text).

Methods take ``timeout=`` on purpose (``# noqa: ASYNC109``): the deadline must be applied here,
inside, so that missing it surfaces as the typed :class:`AppServerTimeout` (and, for turns, as an
interrupt plus a ``TIMED_OUT`` result) instead of a bare cancellation.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import json
import math
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, Final, Protocol, Self

import anyio
import anyio.abc
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from codex_turn._log import format_error, get_logger

from .config import AppServerConfig
from .defaults import INTERRUPT_GRACE_S, NATIVE_COMPACTION_TIMEOUT_S
from .errors import (
    AppServerClosed,
    AppServerError,
    AppServerRpcError,
    AppServerStartError,
    AppServerTimeout,
)
from .process import AppServerProcess, LineTransport
from .projector import CodexTurnResult, CodexTurnStatus, Notification, TurnProjector
from .tools import DynamicTool, ToolRegistry, as_registry
from .types import (
    ApprovalsReviewer,
    AskForApproval,
    ClientInfo,
    ImageInput,
    InitializeCapabilities,
    InitializeParams,
    InitializeResult,
    SandboxMode,
    TextInput,
    ThreadCompactStartParams,
    ThreadResult,
    ThreadResumeParams,
    ThreadStartParams,
    TurnInterruptParams,
    TurnStartParams,
    TurnStartResult,
    UserInput,
    structure,
    unstructure,
)

__all__ = [
    "AppServerClient",
    "ApprovalPolicy",
    "CodexTurnPhase",
    "CompactionResult",
    "TurnHandle",
    "UserInputHandler",
    "decline_all",
]

log = get_logger(__name__)

ApprovalPolicy = Callable[[str, Mapping[str, Any]], Awaitable[Mapping[str, Any]]]
"""``(method, params) -> response`` for approval server requests."""
UserInputHandler = Callable[[Mapping[str, Any]], Awaitable[Mapping[str, Any]]]
"""``params -> {"answers": {...}}`` for ``item/tool/requestUserInput``."""
NotificationListener = Callable[[Notification], None]

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


class _Pending:
    __slots__ = ("error", "event", "method", "result")

    def __init__(self, method: str) -> None:
        self.method = method
        self.event = anyio.Event()
        self.result: Any = None
        self.error: AppServerError | None = None


class _Subscription:
    """A per-thread notification queue (unbounded: the reader must never block on a slow
    consumer; a turn's notifications are few)."""

    def __init__(self, thread_id: str) -> None:
        self.thread_id = thread_id
        send, receive = anyio.create_memory_object_stream[Notification](math.inf)
        self.send: MemoryObjectSendStream[Notification] = send
        self.receive: MemoryObjectReceiveStream[Notification] = receive


class AppServerClient:
    """A JSON-RPC session with one app-server process. Create with :meth:`connect`."""

    def __init__(
        self,
        transport: LineTransport,
        *,
        request_timeout: float = 60.0,
        approval_policy: ApprovalPolicy = decline_all,
        user_input_handler: UserInputHandler | None = None,
        provider: str | None = None,
        model: str | None = None,
        interrupt_grace: float = INTERRUPT_GRACE_S,
    ) -> None:
        self.transport = transport
        self.request_timeout = request_timeout
        self.interrupt_grace = interrupt_grace
        self.approval_policy = approval_policy
        self.user_input_handler = user_input_handler
        self.provider = provider
        self.model = model
        self.initialize_result: InitializeResult | None = None
        self.sent: list[dict[str, Any]] = []  # every message we sent, when ``record_sent``
        self.record_sent = False
        self.server_requests: dict[Any, str] = {}  # id -> method, when ``record_sent``
        self.garbage_lines = 0
        self._next_id = 1
        self._pending: dict[int, _Pending] = {}
        self._subs: dict[str, list[_Subscription]] = {}
        self._listeners: list[NotificationListener] = []
        self._tools: dict[str, ToolRegistry] = {}
        self._loaded_threads: set[str] = set()
        self._compaction_locks = _KeyedLocks()
        self._closed_error: AppServerClosed | None = None
        self._closed = anyio.Event()
        self._stop = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None

    # -- lifecycle -----------------------------------------------------------------------

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls,
        config: AppServerConfig,
        *,
        approval_policy: ApprovalPolicy = decline_all,
        user_input_handler: UserInputHandler | None = None,
        transport: LineTransport | None = None,
        sent_log: list[dict[str, Any]] | None = None,
    ) -> AsyncIterator[Self]:
        """Spawn (unless ``transport`` is given), initialise, yield; shut down on exit.

        ``sent_log``: append every message sent (requests, notifications, responses) to this
        list; the conformance tests validate it against the binary's JSON schema."""
        if transport is None:
            transport = await AppServerProcess.spawn(config)
        client = cls(
            transport,
            request_timeout=config.request_timeout,
            approval_policy=approval_policy,
            user_input_handler=user_input_handler,
            provider=config.provider.id if config.provider else None,
            model=config.model,
            interrupt_grace=config.interrupt_grace,
        )
        if sent_log is not None:
            client.record_sent = True
            client.sent = sent_log
        try:
            with unwrap_single_group():
                async with anyio.create_task_group() as tg:
                    client._tg = tg
                    tg.start_soon(client._read_loop)
                    tg.start_soon(client._background)
                    try:
                        try:
                            await client.initialize(
                                ClientInfo(
                                    config.client_name, config.client_version, config.client_title
                                ),
                                experimental_api=config.experimental_api,
                                timeout=config.initialize_timeout,
                            )
                        except AppServerError as exc:
                            raise AppServerStartError(
                                f"codex app-server failed to initialize: {format_error(exc)}"
                            ) from exc
                        yield client
                    finally:
                        client._mark_closed(AppServerClosed("codex app-server client was closed"))
                        await transport.aclose()
                        tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await transport.aclose()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def closed_error(self) -> AppServerClosed | None:
        return self._closed_error

    async def wait_closed(self) -> None:
        """Return when the process died or :meth:`request_stop` was called."""
        async with anyio.create_task_group() as tg:

            async def watch(event: anyio.Event) -> None:
                await event.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(watch, self._closed)
            tg.start_soon(watch, self._stop)

    def request_stop(self) -> None:
        self._stop.set()

    def add_listener(self, listener: NotificationListener) -> None:
        """Called synchronously for every notification (all threads). Keep it cheap."""
        self._listeners.append(listener)

    def _mark_closed(self, error: AppServerClosed) -> None:
        if self._closed_error is not None:
            return
        self._closed_error = error
        for pending in self._pending.values():
            pending.error = error
            pending.event.set()
        self._pending.clear()
        for subs in self._subs.values():
            for sub in subs:
                sub.send.close()
        self._closed.set()

    async def _background(self) -> None:
        try:
            await self.transport.run_background()
        except Exception as exc:  # pragma: no cover - stderr draining must not kill us
            log.warning("appserver.background_failed", error=format_error(exc))

    async def _read_loop(self) -> None:
        try:
            while True:
                line = await self.transport.receive_line()
                self._dispatch(line)
        except AppServerClosed as exc:
            if self._closed_error is None:
                log.warning("appserver.closed", returncode=exc.returncode)
            self._mark_closed(exc)
        except Exception as exc:
            self._mark_closed(
                AppServerClosed(f"codex app-server reader failed: {format_error(exc)}")
            )

    def _dispatch(self, line: bytes) -> None:
        line = line.strip()
        if not line:
            return
        try:
            message = json.loads(line)
        except ValueError:
            self.garbage_lines += 1
            log.warning("appserver.garbage_line", length=len(line))
            return
        if not isinstance(message, dict):
            self.garbage_lines += 1
            log.warning("appserver.garbage_line", length=len(line))
            return
        method = message.get("method")
        msg_id = message.get("id")
        if isinstance(method, str):
            if msg_id is not None:
                if self.record_sent:
                    self.server_requests[msg_id] = method
                if self._tg is not None:
                    self._tg.start_soon(self._serve_request, msg_id, method, message.get("params"))
                return
            params = message.get("params")
            self._route(Notification(method, params if isinstance(params, dict) else {}))
            return
        if msg_id is not None and ("result" in message or "error" in message):
            pending = self._pending.pop(msg_id, None) if isinstance(msg_id, int) else None
            if pending is None:
                log.warning("appserver.unexpected_response", id=str(msg_id))
                return
            error = message.get("error")
            if error is not None:
                code = error.get("code", -32603) if isinstance(error, dict) else -32603
                text = error.get("message", "") if isinstance(error, dict) else str(error)
                pending.error = AppServerRpcError(int(code), str(text), method=pending.method)
            else:
                pending.result = message.get("result")
            pending.event.set()
            return
        self.garbage_lines += 1
        log.warning("appserver.garbage_message", keys=sorted(message)[:5])

    def _route(self, n: Notification) -> None:
        for listener in self._listeners:
            try:
                listener(n)
            except Exception as exc:
                log.warning("appserver.listener_failed", error=format_error(exc))
        thread_id = n.thread_id
        if thread_id is None:
            return
        for sub in self._subs.get(thread_id, ()):
            # Unbounded buffer: never blocks, and a closed receiver is simply skipped.
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                sub.send.send_nowait(n)

    @contextlib.contextmanager
    def subscribe(self, thread_id: str) -> Iterator[MemoryObjectReceiveStream[Notification]]:
        """Receive every notification of ``thread_id`` from now on (buffered)."""
        if self._closed_error is not None:
            raise self._closed_error
        sub = _Subscription(thread_id)
        self._subs.setdefault(thread_id, []).append(sub)
        try:
            yield sub.receive
        finally:
            subs = self._subs.get(thread_id, [])
            if sub in subs:
                subs.remove(sub)
            if not subs:
                self._subs.pop(thread_id, None)
            sub.send.close()
            sub.receive.close()

    # -- requests ------------------------------------------------------------------------

    async def _send(self, message: dict[str, Any]) -> None:
        if self.record_sent:
            self.sent.append(message)
        await self.transport.send_line(json.dumps(message, separators=(",", ":")).encode())

    async def request(
        self,
        method: str,
        params: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any:
        """Send a request and wait for its result (raw JSON)."""
        if self._closed_error is not None:
            raise self._closed_error
        seconds = self.request_timeout if timeout is None else timeout
        started = time.perf_counter()
        msg_id: int | None = None
        try:
            with anyio.fail_after(seconds):
                msg_id, pending = await self._start_request(method, params)
                await pending.event.wait()
        except TimeoutError:
            raise AppServerTimeout(
                f"{method} got no response within {seconds:g}s", method=method, seconds=seconds
            ) from None
        finally:
            if msg_id is not None:
                self._pending.pop(msg_id, None)
        if pending.error is not None:
            raise pending.error
        log.debug(
            "appserver.request",
            method=method,
            id=msg_id,
            ms=round((time.perf_counter() - started) * 1000, 1),
        )
        return pending.result

    async def _start_request(
        self, method: str, params: Mapping[str, Any] | None
    ) -> tuple[int, _Pending]:
        """Register a pending request and send it; the caller waits (and pops it) itself."""
        if self._closed_error is not None:
            raise self._closed_error
        msg_id = self._next_id
        self._next_id += 1
        pending = _Pending(method)
        self._pending[msg_id] = pending
        message: dict[str, Any] = {"id": msg_id, "method": method}
        if params is not None:
            message["params"] = dict(params)
        try:
            await self._send(message)
        except BaseException:
            self._pending.pop(msg_id, None)
            raise
        return msg_id, pending

    async def notify(self, method: str, params: Mapping[str, Any] | None = None) -> None:
        if self._closed_error is not None:
            raise self._closed_error
        message: dict[str, Any] = {"method": method}
        if params is not None:
            message["params"] = dict(params)
        await self._send(message)

    async def _respond(self, msg_id: Any, *, result: Any = None, error: Any = None) -> None:
        message: dict[str, Any] = {"id": msg_id}
        if error is not None:
            message["error"] = error
        else:
            message["result"] = result
        try:
            await self._send(message)
        except AppServerClosed:
            log.info("appserver.response_dropped", id=str(msg_id))

    async def _serve_request(self, msg_id: Any, method: str, params: Any) -> None:
        params = params if isinstance(params, dict) else {}
        try:
            if method == "item/tool/call":
                thread_id = str(params.get("threadId", ""))
                registry = self._tools.get(thread_id) or ToolRegistry()
                result = await registry.call(str(params.get("tool", "")), params.get("arguments"))
            elif method in APPROVAL_METHODS:
                log.info("appserver.approval_request", method=method)
                result = dict(await self.approval_policy(method, params))
            elif method == "item/tool/requestUserInput":
                if self.user_input_handler is not None:
                    result = dict(await self.user_input_handler(params))
                else:
                    result = {"answers": {}}
            else:
                log.warning("appserver.unknown_server_request", method=method)
                await self._respond(
                    msg_id, error={"code": -32601, "message": f"method not supported: {method}"}
                )
                return
        except Exception as exc:
            log.warning("appserver.server_request_failed", method=method, error=format_error(exc))
            await self._respond(msg_id, error={"code": -32000, "message": "client handler failed"})
            return
        await self._respond(msg_id, result=result)

    # -- methods -------------------------------------------------------------------------

    async def initialize(
        self,
        client_info: ClientInfo,
        *,
        experimental_api: bool = True,
        timeout: float = 30.0,  # noqa: ASYNC109
    ) -> InitializeResult:
        params = InitializeParams(client_info, InitializeCapabilities(experimental_api))
        raw = await self.request("initialize", unstructure(params), timeout=timeout)
        self.initialize_result = structure(raw or {}, InitializeResult)
        await self.notify("initialized")
        return self.initialize_result

    def register_tools(self, thread_id: str, tools: ToolRegistry | Iterable[DynamicTool]) -> None:
        """Bind Python tools to a thread (done by start/resume; also usable directly)."""
        registry = as_registry(tools)
        assert registry is not None
        self._tools[thread_id] = registry

    def is_loaded(self, thread_id: str) -> bool:
        """Whether this process started or resumed ``thread_id``."""
        return thread_id in self._loaded_threads

    def forget_thread(self, thread_id: str) -> None:
        """Drop this client's local state for ``thread_id``: its tool registry (and whatever
        the tools' closures keep alive) and its loaded mark.

        The thread is *not* unloaded in Codex. Call it once the thread will not run another
        turn here (e.g. when the engine rotated to a fresh thread): a later tool call for it
        would be answered as an unknown tool, and a later compaction would resume it first.
        Idempotent; unknown ids are ignored."""
        self._tools.pop(thread_id, None)
        self._loaded_threads.discard(thread_id)

    async def start_thread(
        self,
        *,
        cwd: str | None = None,
        developer_instructions: str | None = None,
        base_instructions: str | None = None,
        model: str | None = None,
        model_provider: str | None = None,
        tools: ToolRegistry | Iterable[DynamicTool] | None = None,
        personality: str | None = "none",
        approval_policy: AskForApproval | None = None,
        sandbox: SandboxMode | None = None,
        approvals_reviewer: ApprovalsReviewer | None = None,
        service_tier: str | None = None,
        config: Mapping[str, Any] | None = None,
        ephemeral: bool | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> ThreadResult:
        """Start a thread. The runtime policy (``approval_policy``, ``sandbox``,
        ``approvals_reviewer``, ``service_tier``) is sent only when given; the result reports
        the effective values."""
        registry = as_registry(tools)
        params = ThreadStartParams(
            cwd=cwd,
            model=model,
            model_provider=model_provider,
            developer_instructions=developer_instructions,
            base_instructions=base_instructions,
            personality=personality,
            dynamic_tools=registry.specs() if registry else None,
            approval_policy=approval_policy,
            sandbox=sandbox,
            approvals_reviewer=approvals_reviewer,
            service_tier=service_tier,
            config=config,
            ephemeral=ephemeral,
        )
        raw = await self.request("thread/start", unstructure(params), timeout=timeout)
        result = structure(raw, ThreadResult)
        if registry is not None:
            self.register_tools(result.thread_id, registry)
        self._loaded_threads.add(result.thread_id)
        log.info("appserver.thread_started", thread_id=result.thread_id, tools=len(registry or ()))
        return result

    async def resume_thread(
        self,
        thread_id: str,
        *,
        developer_instructions: str | None,
        cwd: str | None = None,
        base_instructions: str | None = None,
        model: str | None = None,
        model_provider: str | None = None,
        tools: ToolRegistry | Iterable[DynamicTool] | None = None,
        personality: str | None = "none",
        exclude_turns: bool = True,
        approval_policy: AskForApproval | None = None,
        sandbox: SandboxMode | None = None,
        approvals_reviewer: ApprovalsReviewer | None = None,
        service_tier: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> ThreadResult:
        """Resume (load) a thread. ``developer_instructions`` is required on purpose: Codex
        keeps only what is re-sent here across a later compaction. ``tools`` are bound
        locally only: Codex froze the thread's tool set at thread/start.

        The runtime policy is sent only when given. Codex 0.163 applies it when the resume
        loads the thread; a thread this process has loaded already keeps its current policy
        (the result reports the effective values either way). A resume that loads the thread
        without it does not restore all of it: the sandbox comes from the process's config
        and the service tier is dropped (approval policy and reviewer survive), so re-send
        it."""
        params = ThreadResumeParams(
            thread_id=thread_id,
            developer_instructions=developer_instructions,
            base_instructions=base_instructions,
            personality=personality,
            exclude_turns=exclude_turns,
            cwd=cwd,
            model=model,
            model_provider=model_provider,
            approval_policy=approval_policy,
            sandbox=sandbox,
            approvals_reviewer=approvals_reviewer,
            service_tier=service_tier,
        )
        raw = await self.request("thread/resume", unstructure(params), timeout=timeout)
        result = structure(raw, ThreadResult)
        if tools is not None:
            self.register_tools(result.thread_id, tools)
        self._loaded_threads.add(result.thread_id)
        log.info("appserver.thread_resumed", thread_id=result.thread_id)
        return result

    async def interrupt_turn(
        self,
        thread_id: str,
        turn_id: str,
        *,
        timeout: float = INTERRUPT_GRACE_S,  # noqa: ASYNC109
    ) -> None:
        params = TurnInterruptParams(thread_id=thread_id, turn_id=turn_id)
        await self.request("turn/interrupt", unstructure(params), timeout=timeout)

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
    ) -> AsyncIterator[TurnHandle]:
        """Start a turn; yield a :class:`TurnHandle` to iterate its notifications.

        ``input`` is the text (or explicit input items); ``images`` are image URLs
        (``data:`` URLs included). ``prompt`` is the *raw* user prompt mirrored into the
        snapshot (defaults to the text). Leaving the block before ``turn/completed``
        (cancellation, an exception) interrupts the turn and waits briefly for its end.

        A cancellation (or the ``timeout`` of ``turn/start`` itself) that hits *after* the
        request went out but before its response also interrupts the turn Codex may have
        started (see :meth:`_start_turn`) before it propagates.
        """
        if isinstance(input, str):
            items: list[UserInput] = [TextInput(input)]
            text = input
        else:
            items = list(input)
            text = "\n".join(i.text for i in items if isinstance(i, TextInput))
        items += [ImageInput(url) for url in images]
        with self.subscribe(thread_id) as stream:
            params = TurnStartParams(thread_id=thread_id, input=items)
            raw = await self._start_turn(thread_id, unstructure(params), stream, timeout)
            started = structure(raw, TurnStartResult)
            projector = TurnProjector(
                thread_id=thread_id,
                prompt=text if prompt is None else prompt,
                provider=provider or self.provider,
                model=model or self.model,
                turn_id=started.turn.id,
            )
            handle = TurnHandle(
                self,
                thread_id,
                started.turn.id,
                stream,
                projector,
                interrupt_grace=self.interrupt_grace,
            )
            log.info("appserver.turn_started", thread_id=thread_id, turn_id=started.turn.id)
            try:
                yield handle
            finally:
                await handle.aclose()

    async def _start_turn(
        self,
        thread_id: str,
        params: Mapping[str, Any],
        stream: MemoryObjectReceiveStream[Notification],
        timeout: float | None,  # noqa: ASYNC109
    ) -> Any:
        """``turn/start``, without orphaning the turn when the caller leaves early.

        Once the request is sent, Codex starts the turn whether or not we wait for the
        answer. So when the caller is cancelled, or ``timeout`` passes, between the send and
        the response, the turn is found (its response, and its ``turn/started`` on the
        already-subscribed ``stream``), interrupted once and given the interrupt grace to
        end, shielded, each wait bounded by that grace (:meth:`_abandon_turn_start`); then
        the cancellation (or :class:`AppServerTimeout`) propagates. Otherwise the orphan
        would keep running (tool calls included) and the thread's next ``turn/start`` would
        be steered into it (Codex 0.163 answers it with the orphan's turn id).
        """
        seconds = self.request_timeout if timeout is None else timeout
        msg_id: int | None = None
        pending: _Pending | None = None
        try:
            try:
                with anyio.fail_after(seconds):
                    msg_id, pending = await self._start_request("turn/start", params)
                    await pending.event.wait()
            except TimeoutError:
                raise AppServerTimeout(
                    f"turn/start got no response within {seconds:g}s",
                    method="turn/start",
                    seconds=seconds,
                ) from None
        except BaseException:
            if pending is not None:
                with anyio.CancelScope(shield=True):
                    await self._abandon_turn_start(thread_id, pending, stream)
            raise
        finally:
            # Only now: the abandonment above still needs the response routed to ``pending``.
            if msg_id is not None:
                self._pending.pop(msg_id, None)
        if pending.error is not None:
            raise pending.error
        return pending.result

    async def _abandon_turn_start(
        self,
        thread_id: str,
        pending: _Pending,
        stream: MemoryObjectReceiveStream[Notification],
    ) -> None:
        """Interrupt the turn an abandoned ``turn/start`` started (never raises).

        Waits up to the interrupt grace for the turn to be *active* (its ``turn/started``:
        Codex refuses an interrupt before that, see :class:`TurnHandle`), or to be refused;
        then interrupts it once (falling back to the id from the response when no
        ``turn/started`` came) and waits up to the grace again for its ``turn/completed``.
        """
        seen: list[Notification] = []
        response_id: list[str] = []
        started_id: str | None = None
        with anyio.move_on_after(self.interrupt_grace):
            started_id = await self._watch_turn_start(pending, stream, seen, response_id)
        turn_id = started_id or (response_id[0] if response_id else None)
        log.warning("appserver.turn_start_abandoned", thread_id=thread_id, turn_id=turn_id)
        if turn_id is None or self.closed:
            return  # refused, never answered within the grace, or the process is gone
        projector = TurnProjector(
            thread_id=thread_id,
            prompt="",
            provider=self.provider,
            model=self.model,
            turn_id=turn_id,
        )
        # Active, or waited for a whole grace already: it is interrupted at once.
        handle = TurnHandle(
            self,
            thread_id,
            turn_id,
            stream,
            projector,
            interrupt_grace=self.interrupt_grace,
            phase=CodexTurnPhase.RUNNING,
        )
        for n in seen:
            handle._absorb(n)
        await handle._abandon()

    async def _watch_turn_start(
        self,
        pending: _Pending,
        stream: MemoryObjectReceiveStream[Notification],
        seen: list[Notification],
        response_id: list[str],
    ) -> str | None:
        """Follow an abandoned ``turn/start``: the id of its turn once that turn is active
        (``turn/started``) or over (``turn/completed``); ``None`` as soon as the request was
        refused, or when the client closed. A successful response only records its turn id
        in ``response_id``: the stream is never cancelled mid-receive on its account (a
        notification being handed over would be lost). Notifications read are appended to
        ``seen``."""
        found: list[str | None] = []
        async with anyio.create_task_group() as tg:

            async def from_response() -> None:
                await pending.event.wait()
                if pending.error is None:
                    with contextlib.suppress(Exception):
                        response_id.append(structure(pending.result, TurnStartResult).turn.id)
                    return  # a turn exists: its turn/started is awaited on the stream
                found.append(None)  # refused (or closed): no turn to interrupt
                tg.cancel_scope.cancel()

            async def from_stream() -> None:
                with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError):
                    async for n in stream:
                        seen.append(n)
                        if n.turn_id and (
                            n.method == "turn/started"
                            # Over already (not a late one of an earlier turn): nothing to do.
                            or (n.method == "turn/completed" and n.turn_id in response_id)
                        ):
                            found.append(n.turn_id)
                            break
                if not found:
                    found.append(None)  # the stream ended: the client is closed
                tg.cancel_scope.cancel()

            tg.start_soon(from_response)
            tg.start_soon(from_stream)
        return found[0] if found else None

    async def run_turn(
        self,
        thread_id: str,
        input: str | Sequence[UserInput],
        *,
        prompt: str | None = None,
        images: Sequence[str] = (),
        provider: str | None = None,
        model: str | None = None,
        on_event: Callable[[Notification], Awaitable[None]] | None = None,
        idle_timeout: float | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> CodexTurnResult:
        """Run one turn to its end and return the projected :class:`CodexTurnResult`.

        ``on_event`` sees every notification of the turn (e.g. in-turn ``contextCompaction``
        items, see :attr:`Notification.compaction_phase`). ``idle_timeout``: no notification
        for that long interrupts the turn (outcome ``TIMED_OUT``); ``timeout`` bounds the
        whole turn the same way. Cancellation interrupts the turn, then propagates.
        """
        async with self.turn(
            thread_id, input, prompt=prompt, images=images, provider=provider, model=model
        ) as handle:
            return await handle.collect(
                on_event=on_event, idle_timeout=idle_timeout, timeout=timeout
            )

    async def compact_thread(
        self,
        thread_id: str,
        *,
        timeout: float = NATIVE_COMPACTION_TIMEOUT_S,  # noqa: ASYNC109
        interrupt_grace: float = INTERRUPT_GRACE_S,
    ) -> CompactionResult:
        """Native compaction of one thread: ``thread/compact/start``, then wait for its end.

        Codex runs a manual compaction as a turn of its own. The waiter (a subscription to the
        thread) exists *before* the request is sent, so no notification can be missed.
        Completion is the ``contextCompaction`` ``item/completed`` (0.163) or the legacy
        ``thread/compacted``, followed by the compaction turn's ``turn/completed`` (a legacy
        ``thread/compacted`` with no compaction turn in sight completes on its own).

        ``timeout`` bounds the whole run. When it passes, the compaction turn is interrupted
        (the ``turn/interrupt`` is always sent) and the turn's ``turn/completed`` is awaited
        for ``interrupt_grace`` seconds; when that acknowledgement does not come (or the turn
        never started, so there is nothing to interrupt), this connection is *retired*
        (:meth:`retire`) before the method returns, and therefore before the per-thread
        compaction lock is released. Compactions of one thread are serialised by that lock.
        Nothing is ever retried: a failed compaction is reported, never re-sent as a prompt.

        Raises :class:`AppServerRpcError` when Codex refuses the request and
        :class:`AppServerClosed` when the process dies meanwhile.
        """
        async with self._compaction_locks.hold(thread_id):
            return await self._compact_locked(thread_id, timeout, interrupt_grace)

    async def _compact_locked(
        self, thread_id: str, seconds: float, interrupt_grace: float
    ) -> CompactionResult:
        started = time.perf_counter()
        watch = _CompactionWatch(thread_id)
        with self.subscribe(thread_id) as stream:
            with anyio.move_on_after(seconds):
                try:
                    await self.request(
                        "thread/compact/start",
                        unstructure(ThreadCompactStartParams(thread_id=thread_id)),
                        timeout=seconds,
                    )
                except AppServerTimeout:
                    pass  # handled below as a compaction timeout
                else:
                    log.info("appserver.compaction_started", thread_id=thread_id)
                    async for n in _until_closed(self, stream):
                        if watch.feed(n):
                            return watch.result(started)
            # The deadline passed: interrupt, wait for the acknowledgement, else retire.
            log.warning(
                "appserver.compaction_timeout",
                thread_id=thread_id,
                turn_id=watch.turn_id,
                compacted=watch.signal is not None,
            )
            acknowledged = await self._interrupt_compaction(watch, stream, interrupt_grace)
            retired = False
            if not acknowledged and not self.closed:
                await self.retire("compaction interrupt not acknowledged")
                retired = True
            return watch.result(
                started,
                timed_out=True,
                retired=retired,
                error=f"timed out waiting for codex app-server compaction for {thread_id}",
            )

    async def _interrupt_compaction(
        self,
        watch: _CompactionWatch,
        stream: MemoryObjectReceiveStream[Notification],
        grace: float,
    ) -> bool:
        """Interrupt the compaction turn; True when its ``turn/completed`` came in time."""
        if self.closed:
            return False
        # Notifications already buffered may name the turn, or even end it.
        while watch.turn_id is None and not watch.done:
            try:
                n = stream.receive_nowait()
            except anyio.WouldBlock:
                break
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return False
            watch.feed(n)
        if watch.done:
            return True
        if watch.turn_id is None:
            return False  # nothing to interrupt: the turn never started
        watch.interrupted = True
        msg_id: int | None = None
        try:
            # Sending is not bounded by the grace (a zero grace still interrupts); a pipe
            # that does not take one line within the grace plus a second is itself a reason
            # to retire.
            with anyio.move_on_after(grace + 1.0):
                msg_id, pending = await self._start_request(
                    "turn/interrupt",
                    unstructure(
                        TurnInterruptParams(thread_id=watch.thread_id, turn_id=watch.turn_id)
                    ),
                )
            if msg_id is None:
                return False
            with anyio.move_on_after(grace):
                await pending.event.wait()
                if isinstance(pending.error, AppServerRpcError):
                    # "no active turn": it ended meanwhile; its turn/completed is coming.
                    log.info("appserver.interrupt_refused", code=pending.error.code)
                async for n in _until_closed(self, stream):
                    if watch.feed(n):
                        return True
            return False
        except AppServerClosed:
            return False
        finally:
            if msg_id is not None:
                self._pending.pop(msg_id, None)

    async def retire(self, reason: str) -> None:
        """Take this connection out of service for good and stop its process.

        Every pending request and subscription fails with :class:`AppServerClosed` at once;
        the process is shut down (stdin closed, then terminate, then kill, shielded) before
        this returns. :class:`~.manager.AppServer` starts a fresh process on its next call.
        """
        if self._closed_error is None:
            log.warning("appserver.retired", reason=reason)
        self._mark_closed(AppServerClosed(f"codex app-server connection retired: {reason}"))
        self.request_stop()
        with anyio.CancelScope(shield=True):
            await self.transport.aclose()


class _KeyedLocks:
    """One :class:`anyio.Lock` per key, dropped again when nobody holds or awaits it."""

    def __init__(self) -> None:
        self._locks: dict[str, anyio.Lock] = {}
        self._users: dict[str, int] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(key, anyio.Lock())
        self._users[key] = self._users.get(key, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._users[key] -= 1
            if not self._users[key]:
                del self._users[key]
                del self._locks[key]

    def __len__(self) -> int:
        return len(self._locks)


class _CompactionWatch:
    """Folds one thread's notifications into the state of a manual compaction."""

    def __init__(self, thread_id: str) -> None:
        self.thread_id = thread_id
        self.turn_id: str | None = None
        self.turn_started = False
        self.signal: str | None = None
        self.item_id: str | None = None
        self.turn_status: str | None = None
        self.turn_error: str | None = None
        self.interrupted = False
        self.done = False

    def feed(self, n: Notification) -> bool:
        """Take one notification; True once the compaction is over."""
        if n.method == "turn/started" and not self.turn_started:
            self.turn_started = True
            self.turn_id = self.turn_id or n.turn_id
        elif n.compaction_phase == "completed" and self.signal is None:
            self.signal = n.method
            if n.method == "item/completed":
                item = n.item or {}
                item_id = item.get("id")
                self.item_id = item_id if isinstance(item_id, str) else None
            self.turn_id = self.turn_id or n.turn_id
            if n.method == "thread/compacted" and not self.turn_started:
                self.done = True  # a legacy server: the signal is the whole story
        elif n.method == "turn/completed" and (self.turn_id is None or n.turn_id == self.turn_id):
            turn = n.params.get("turn")
            turn = turn if isinstance(turn, Mapping) else {}
            self.turn_id = self.turn_id or n.turn_id
            status = turn.get("status")
            self.turn_status = status if isinstance(status, str) else None
            error = turn.get("error")
            if isinstance(error, Mapping) and isinstance(error.get("message"), str):
                self.turn_error = str(error["message"])
            self.done = True
        return self.done

    def result(
        self,
        started: float,
        *,
        timed_out: bool = False,
        retired: bool = False,
        error: str | None = None,
    ) -> CompactionResult:
        if timed_out:
            status = "timed_out"
        elif self.signal is not None and self.turn_status in (None, "completed"):
            status = "completed"
        else:
            status = "failed"
            error = self.turn_error or (
                f"codex app-server compaction turn ended with status {self.turn_status}"
                f" without a compaction item"
                if self.signal is None
                else f"codex app-server compaction turn ended with status {self.turn_status}"
            )
        return CompactionResult(
            status=status,
            thread_id=self.thread_id,
            turn_id=self.turn_id,
            item_id=self.item_id,
            signal=self.signal,
            duration_ms=_ms_since(started),
            interrupted=self.interrupted,
            retired=retired,
            error=error,
        )


@contextlib.contextmanager
def unwrap_single_group() -> Iterator[None]:
    """Re-raise a lone exception out of an ``ExceptionGroup``.

    The client's own background tasks never raise (they map every failure into the closed
    state), so a group leaving its task group holds only what the *caller's* body raised:
    callers then catch ``AppServerClosed`` (or see their own error) unwrapped.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1 and not isinstance(group.exceptions[0], BaseExceptionGroup):
            raise group.exceptions[0] from None
        raise


def _ms_since(started: float) -> int:
    return int((time.perf_counter() - started) * 1000)


async def _until_closed(
    client: AppServerClient, stream: MemoryObjectReceiveStream[Notification]
) -> AsyncIterator[Notification]:
    """Iterate a subscription; a closed client raises its :class:`AppServerClosed`."""
    while True:
        try:
            yield await stream.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise client.closed_error or AppServerClosed() from None


@attrs.frozen(kw_only=True)
class CompactionResult:
    """Outcome of :meth:`AppServerClient.compact_thread`.

    ``status``: ``"completed"`` (the compaction signal came and the compaction turn completed),
    ``"failed"`` (the turn ended without the signal, or not ``completed``; ``error`` says
    how) or ``"timed_out"`` (the deadline passed; the turn was then interrupted, and
    ``retired`` says whether the connection had to be retired). ``signal`` is the
    notification that proved the compaction (``"item/completed"`` or ``"thread/compacted"``);
    it can be set on a timed-out run whose turn did not end in time.
    """

    status: str
    thread_id: str | None = None
    turn_id: str | None = None
    item_id: str | None = None
    signal: str | None = None
    duration_ms: int = 0
    interrupted: bool = False
    retired: bool = False
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.status == "completed"

    @property
    def compacted(self) -> bool:
        """Whether Codex reported the compaction itself (whatever happened to its turn)."""
        return self.signal is not None


class CodexTurnPhase(enum.Enum):
    """Where one Codex turn is, as its :class:`TurnHandle` knows it (see the module header,
    "Theory of a turn"). Changed only by :meth:`TurnHandle._fire`, by :data:`_TURN_TABLE`."""

    #: ``turn/start`` answered, ``turn/started`` not seen: Codex refuses ``turn/interrupt``.
    STARTING = "starting"
    #: ``turn/started`` seen: the turn is active and can be interrupted.
    RUNNING = "running"
    #: Interrupt asked for while STARTING; its ``turn/interrupt`` waits for ``turn/started``
    #: (at most the interrupt grace).
    INTERRUPT_QUEUED = "interrupt_queued"
    #: ``turn/interrupt`` sent, or being sent by the one task that asked: never a second one.
    INTERRUPTING = "interrupting"
    #: The caller gave up on the turn: interrupted it and waits at most one interrupt grace
    #: for its end; leaving the turn does not wait again.
    ABANDONED = "abandoned"
    #: ``turn/completed`` folded (terminal).
    COMPLETED = "completed"


class _TurnInput(enum.Enum):
    """What moves a :class:`CodexTurnPhase`: two notifications and three decisions of ours."""

    STARTED = "turn/started"
    COMPLETED = "turn/completed"
    INTERRUPT = "interrupt"  # the first TurnHandle.interrupt()
    GRACE_PASSED = "grace_passed"  # no turn/started within the grace: interrupt regardless
    ABANDON = "abandon"  # the caller stops waiting for the turn (after interrupting it)


_P = CodexTurnPhase
_I = _TurnInput

#: Every allowed ``(phase, input) -> phase``. Anything missing is a bug in this module (an
#: interrupt decision taken twice, an abandonment without an interrupt) and raises.
_TURN_TABLE: Final[Mapping[CodexTurnPhase, Mapping[_TurnInput, CodexTurnPhase]]] = {
    # State: STARTING
    _P.STARTING: {
        _I.STARTED: _P.RUNNING,
        _I.INTERRUPT: _P.INTERRUPT_QUEUED,
        _I.COMPLETED: _P.COMPLETED,
    },
    # State: RUNNING
    _P.RUNNING: {
        _I.STARTED: _P.RUNNING,
        _I.INTERRUPT: _P.INTERRUPTING,
        _I.COMPLETED: _P.COMPLETED,
    },
    # State: INTERRUPT_QUEUED (the asking task sends it once this phase is left for INTERRUPTING)
    _P.INTERRUPT_QUEUED: {
        _I.STARTED: _P.INTERRUPTING,
        _I.GRACE_PASSED: _P.INTERRUPTING,
        _I.ABANDON: _P.ABANDONED,
        _I.COMPLETED: _P.COMPLETED,
    },
    # State: INTERRUPTING
    _P.INTERRUPTING: {
        _I.STARTED: _P.INTERRUPTING,
        _I.ABANDON: _P.ABANDONED,
        _I.COMPLETED: _P.COMPLETED,
    },
    # State: ABANDONED
    _P.ABANDONED: {
        _I.STARTED: _P.ABANDONED,
        _I.ABANDON: _P.ABANDONED,
        _I.COMPLETED: _P.COMPLETED,
    },
    # State: COMPLETED (giving up on a finished turn changes nothing)
    _P.COMPLETED: {_I.ABANDON: _P.COMPLETED},
}


class _TurnClient(Protocol):
    """What a :class:`TurnHandle` needs from its client (tests' fakes provide the same)."""

    @property
    def closed_error(self) -> AppServerClosed | None: ...

    async def interrupt_turn(
        self,
        thread_id: str,
        turn_id: str,
        *,
        timeout: float = INTERRUPT_GRACE_S,  # noqa: ASYNC109
    ) -> None: ...


class _NotificationSource(Protocol):
    """The receive side of a turn's subscription (ends with ``EndOfStream``/``Closed...``)."""

    async def receive(self) -> Notification: ...


class TurnHandle:
    """One running turn: ``async for n in handle`` yields its notifications and stops after
    ``turn/completed``; :attr:`result` is then set. Obtain it from
    :meth:`AppServerClient.turn`.

    Codex answers ``turn/start`` *before* the turn is active, and refuses a ``turn/interrupt``
    sent in that window ("no active turn to interrupt") while the turn then runs on. So
    :meth:`interrupt` first waits (up to the interrupt grace) for the turn's ``turn/started``;
    notifications read meanwhile are still yielded by the iteration, in order. :attr:`phase`
    says where the turn is (:class:`CodexTurnPhase`).
    """

    def __init__(
        self,
        client: _TurnClient,
        thread_id: str,
        turn_id: str,
        stream: _NotificationSource,
        projector: TurnProjector,
        *,
        interrupt_grace: float = INTERRUPT_GRACE_S,
        phase: CodexTurnPhase = CodexTurnPhase.STARTING,
    ) -> None:
        self.client = client
        self.thread_id = thread_id
        self.turn_id = turn_id
        self.projector = projector
        self.interrupt_grace = interrupt_grace
        self.result: CodexTurnResult | None = None
        self._stream = stream
        self._phase = phase
        self._replay: collections.deque[Notification] = collections.deque()

    def __repr__(self) -> str:
        return (
            f"<TurnHandle thread_id={self.thread_id} turn_id={self.turn_id}"
            f" phase={self._phase.name}>"
        )

    @property
    def phase(self) -> CodexTurnPhase:
        return self._phase

    def _fire(self, event: _TurnInput) -> None:
        """The one place the phase changes."""
        try:
            self._phase = _TURN_TABLE[self._phase][event]
        except KeyError:
            raise RuntimeError(
                f"TurnHandle: {event.name} is not allowed in phase {self._phase.name}"
            ) from None

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Notification:
        if self._replay:
            return self._replay.popleft()
        if self._phase is CodexTurnPhase.COMPLETED:
            if self.result is None:
                self.result = self.projector.build_result()
            raise StopAsyncIteration
        return await self._receive_own()

    async def _receive_own(self) -> Notification:
        """The turn's next notification, folded into the projector."""
        while True:
            try:
                n = await self._stream.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                raise self.client.closed_error or AppServerClosed() from None
            if self._absorb(n):
                return n

    def _absorb(self, n: Notification) -> bool:
        """Fold one notification of the thread; whether it belonged to this turn."""
        if not self.projector.feed(n):
            return False
        if n.method == "turn/started":
            self._fire(_TurnInput.STARTED)
        if self.projector.done:
            self._fire(_TurnInput.COMPLETED)
        return True

    async def _await_active(self, seconds: float) -> None:
        """Read ahead (kept for the iteration) while an interrupt is queued for
        ``turn/started``: until it comes, the turn ends, or ``seconds`` pass."""
        with anyio.move_on_after(seconds):
            while self._phase is CodexTurnPhase.INTERRUPT_QUEUED:
                self._replay.append(await self._receive_own())

    def _queue_released(self) -> bool:
        """After waiting for ``turn/started``: whether the queued interrupt is to be sent
        (the turn is active, or the grace passed without it); False when the turn is over."""
        if self._phase is CodexTurnPhase.INTERRUPT_QUEUED:
            self._fire(_TurnInput.GRACE_PASSED)
        return self._phase is not CodexTurnPhase.COMPLETED

    async def interrupt(self) -> None:
        """Send ``turn/interrupt`` once (a second one would hang inside Codex), after the
        turn's ``turn/started`` (or the interrupt grace without it).

        Only the first call decides; a call while that first interrupt is still queued waits
        (at most the grace) like the first one does, any other call returns at once."""
        phase = self._phase
        if phase is CodexTurnPhase.RUNNING:
            self._fire(_TurnInput.INTERRUPT)
        elif phase is CodexTurnPhase.STARTING:
            self._fire(_TurnInput.INTERRUPT)
            await self._await_active(self.interrupt_grace)
            if not self._queue_released():
                return  # it ended on its own meanwhile
        else:
            if phase is CodexTurnPhase.INTERRUPT_QUEUED:
                await self._await_active(self.interrupt_grace)  # the first caller sends it
            return
        try:
            await self.client.interrupt_turn(
                self.thread_id, self.turn_id, timeout=self.interrupt_grace
            )
        except AppServerRpcError as exc:
            # "no active turn": it ended on its own meanwhile; its turn/completed is coming.
            log.info("appserver.interrupt_refused", code=exc.code)

    async def _drain(self, seconds: float) -> bool:
        with anyio.move_on_after(seconds):
            async for _ in self:
                pass
            return True
        return False

    async def _give_up(self) -> None:
        """Interrupt, then stop waiting for the turn beyond one grace (ABANDONED, even when
        the interrupt itself fails or is cancelled)."""
        try:
            await self.interrupt()
        finally:
            self._fire(_TurnInput.ABANDON)

    async def _abandon(self) -> None:
        """Interrupt and wait briefly for turn/completed (used on cancellation)."""
        with contextlib.suppress(AppServerError):
            await self._give_up()
            await self._drain(self.interrupt_grace)

    async def aclose(self) -> None:
        """Leave the turn: one that is still running (and not given up on already, nor on a
        closed client) is interrupted, shielded from cancellation, and given the interrupt
        grace to end. Called when the :meth:`AppServerClient.turn` block is left; idempotent.
        """
        if self._phase in (CodexTurnPhase.COMPLETED, CodexTurnPhase.ABANDONED):
            return
        if self.client.closed_error is not None:
            return
        with anyio.CancelScope(shield=True):
            await self._abandon()

    async def collect(
        self,
        *,
        on_event: Callable[[Notification], Awaitable[None]] | None = None,
        idle_timeout: float | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> CodexTurnResult:
        """Consume the turn to its end (see :meth:`AppServerClient.run_turn`).

        Only *receiving* is bounded by ``idle_timeout`` and ``timeout``: ``on_event`` runs
        outside those scopes, so a slow callback (a compaction hook, say) is neither cancelled
        nor counted as Codex being idle (the next wait starts after it returns; the overall
        deadline still bounds the waits). On a timeout the turn is interrupted (once) and
        given the interrupt grace to end; the result is ``TIMED_OUT`` even when that
        interrupt itself fails (times out, or the process died meanwhile).
        """
        deadline = math.inf if timeout is None else anyio.current_time() + timeout
        timed_out: str | None = None
        while self._replay or self._phase is not CodexTurnPhase.COMPLETED:
            wait = min(idle_timeout or math.inf, deadline - anyio.current_time())
            if wait <= 0:
                timed_out = f"codex app-server turn timed out after {timeout:g}s"
                break
            n: Notification | None = None
            with anyio.move_on_after(wait):
                try:
                    n = await self.__anext__()
                except StopAsyncIteration:
                    break
            if n is None:
                if anyio.current_time() >= deadline:
                    timed_out = f"codex app-server turn timed out after {timeout:g}s"
                else:
                    timed_out = f"codex app-server turn idle for {idle_timeout:g}s"
                break
            if on_event is not None:
                await on_event(n)
        if timed_out is not None:
            log.warning("appserver.turn_timeout", thread_id=self.thread_id, turn_id=self.turn_id)
            try:
                await self._give_up()
                await self._drain(self.interrupt_grace)
            except AppServerError as exc:
                # The timeout stays the story: the interrupt could not even be delivered.
                log.warning(
                    "appserver.turn_timeout_interrupt_failed",
                    thread_id=self.thread_id,
                    turn_id=self.turn_id,
                    error=format_error(exc),
                )
            self.result = self.projector.build_result(
                outcome=CodexTurnStatus.TIMED_OUT, error=timed_out
            )
        elif self.result is None:
            self.result = self.projector.build_result()
        log.info(
            "appserver.turn_completed",
            thread_id=self.thread_id,
            turn_id=self.turn_id,
            outcome=self.result.outcome.value,
        )
        return self.result
