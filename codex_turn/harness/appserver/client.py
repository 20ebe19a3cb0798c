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
   returns the :class:`~.projector.TurnResult`. A cancelled or timed-out turn is interrupted
   (once: a second ``turn/interrupt`` for the same turn would hang in Codex).

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

import contextlib
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
from typing import Any, Self

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from codex_turn._log import format_error, get_logger

from .config import AppServerConfig
from .errors import (
    AppServerClosed,
    AppServerError,
    AppServerRpcError,
    AppServerStartError,
    AppServerTimeout,
)
from .process import AppServerProcess, LineTransport
from .projector import Notification, TurnOutcome, TurnProjector, TurnResult
from .tools import DynamicTool, ToolRegistry
from .types import (
    ClientInfo,
    ImageInput,
    InitializeCapabilities,
    InitializeParams,
    InitializeResult,
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
_INTERRUPT_GRACE_S = 5.0


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
    ) -> None:
        self.transport = transport
        self.request_timeout = request_timeout
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
        msg_id = self._next_id
        self._next_id += 1
        pending = _Pending(method)
        self._pending[msg_id] = pending
        message: dict[str, Any] = {"id": msg_id, "method": method}
        if params is not None:
            message["params"] = dict(params)
        seconds = self.request_timeout if timeout is None else timeout
        started = time.perf_counter()
        try:
            await self._send(message)
            with anyio.fail_after(seconds):
                await pending.event.wait()
        except TimeoutError:
            raise AppServerTimeout(
                f"{method} got no response within {seconds:g}s", method=method, seconds=seconds
            ) from None
        finally:
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
        registry = tools if isinstance(tools, ToolRegistry) else ToolRegistry(tools)
        self._tools[thread_id] = registry

    def is_loaded(self, thread_id: str) -> bool:
        """Whether this process started or resumed ``thread_id``."""
        return thread_id in self._loaded_threads

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
        approval_policy: str | None = None,
        sandbox: str | None = None,
        config: Mapping[str, Any] | None = None,
        ephemeral: bool | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> ThreadResult:
        registry = (
            None
            if tools is None
            else tools
            if isinstance(tools, ToolRegistry)
            else ToolRegistry(tools)
        )
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
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> ThreadResult:
        """Resume (load) a thread. ``developer_instructions`` is required on purpose: Codex
        keeps only what is re-sent here across a later compaction. ``tools`` are bound
        locally only: Codex froze the thread's tool set at thread/start."""
        params = ThreadResumeParams(
            thread_id=thread_id,
            developer_instructions=developer_instructions,
            base_instructions=base_instructions,
            personality=personality,
            exclude_turns=exclude_turns,
            cwd=cwd,
            model=model,
            model_provider=model_provider,
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
        timeout: float = 5.0,  # noqa: ASYNC109
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
            raw = await self.request("turn/start", unstructure(params), timeout=timeout)
            started = structure(raw, TurnStartResult)
            projector = TurnProjector(
                thread_id=thread_id,
                prompt=text if prompt is None else prompt,
                provider=provider or self.provider,
                model=model or self.model,
                turn_id=started.turn.id,
            )
            handle = TurnHandle(self, thread_id, started.turn.id, stream, projector)
            log.info("appserver.turn_started", thread_id=thread_id, turn_id=started.turn.id)
            try:
                yield handle
            finally:
                if not projector.done and not self.closed:
                    with anyio.CancelScope(shield=True):
                        await handle._abandon()

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
    ) -> TurnResult:
        """Run one turn to its end and return the projected :class:`TurnResult`.

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
        timeout: float = 120.0,  # noqa: ASYNC109
    ) -> CompactionResult:
        """``thread/compact/start`` and wait for its completion: the ``contextCompaction``
        ``item/completed`` (or legacy ``thread/compacted``) and then the compaction turn's
        ``turn/completed``. On timeout the compaction turn is interrupted and the result says
        ``timed_out``; a dead process raises :class:`AppServerClosed`."""
        started = time.perf_counter()
        turn_id: str | None = None
        item_id: str | None = None
        compacted = False
        with self.subscribe(thread_id) as stream:
            await self.request(
                "thread/compact/start", unstructure(ThreadCompactStartParams(thread_id=thread_id))
            )
            with anyio.move_on_after(timeout) as scope:
                async for n in _until_closed(self, stream):
                    if n.method == "turn/started" and turn_id is None:
                        turn_id = n.turn_id
                    if n.compaction_phase == "completed":
                        compacted = True
                        item = n.item
                        item_id = str(item.get("id")) if item is not None else None
                    if n.method == "turn/completed" and (turn_id is None or n.turn_id == turn_id):
                        status = n.params.get("turn", {}).get("status")
                        ok = compacted and status == "completed"
                        return CompactionResult(
                            status="completed" if ok else "failed",
                            turn_id=n.turn_id,
                            item_id=item_id,
                            duration_ms=_ms_since(started),
                        )
        if scope.cancelled_caught:
            if turn_id is not None and not self.closed:
                with contextlib.suppress(AppServerError):
                    await self.interrupt_turn(thread_id, turn_id)
            return CompactionResult(
                status="completed" if compacted else "timed_out",
                turn_id=turn_id,
                item_id=item_id,
                duration_ms=_ms_since(started),
            )
        raise self._closed_error or AppServerClosed()


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


class CompactionResult:
    """Outcome of :meth:`AppServerClient.compact_thread`."""

    __slots__ = ("duration_ms", "item_id", "status", "turn_id")

    def __init__(
        self, *, status: str, turn_id: str | None, item_id: str | None, duration_ms: int
    ) -> None:
        self.status = status  # "completed" | "failed" | "timed_out"
        self.turn_id = turn_id
        self.item_id = item_id
        self.duration_ms = duration_ms

    @property
    def completed(self) -> bool:
        return self.status == "completed"

    def __repr__(self) -> str:
        return f"CompactionResult(status={self.status!r}, turn_id={self.turn_id!r})"


class TurnHandle:
    """One running turn: ``async for n in handle`` yields its notifications and stops after
    ``turn/completed``; :attr:`result` is then set. Obtain it from
    :meth:`AppServerClient.turn`."""

    def __init__(
        self,
        client: AppServerClient,
        thread_id: str,
        turn_id: str,
        stream: MemoryObjectReceiveStream[Notification],
        projector: TurnProjector,
    ) -> None:
        self.client = client
        self.thread_id = thread_id
        self.turn_id = turn_id
        self.projector = projector
        self.result: TurnResult | None = None
        self._stream = stream
        self._interrupted = False

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Notification:
        if self.projector.done:
            if self.result is None:
                self.result = self.projector.build_result()
            raise StopAsyncIteration
        while True:
            try:
                n = await self._stream.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                raise self.client.closed_error or AppServerClosed() from None
            if self.projector.feed(n):
                return n

    async def interrupt(self) -> None:
        """Send ``turn/interrupt`` once (a second one would hang inside Codex)."""
        if self._interrupted or self.projector.done:
            return
        self._interrupted = True
        try:
            await self.client.interrupt_turn(self.thread_id, self.turn_id)
        except AppServerRpcError as exc:
            # "no active turn": it ended on its own meanwhile; its turn/completed is coming.
            log.info("appserver.interrupt_refused", code=exc.code)

    async def _drain(self, seconds: float) -> bool:
        with anyio.move_on_after(seconds):
            async for _ in self:
                pass
            return True
        return False

    async def _abandon(self) -> None:
        """Interrupt and wait briefly for turn/completed (used on cancellation)."""
        with contextlib.suppress(AppServerError):
            await self.interrupt()
            await self._drain(_INTERRUPT_GRACE_S)

    async def collect(
        self,
        *,
        on_event: Callable[[Notification], Awaitable[None]] | None = None,
        idle_timeout: float | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> TurnResult:
        """Consume the turn to its end (see :meth:`AppServerClient.run_turn`)."""
        deadline = math.inf if timeout is None else anyio.current_time() + timeout
        timed_out: str | None = None
        while not self.projector.done:
            wait = min(idle_timeout or math.inf, deadline - anyio.current_time())
            if wait <= 0:
                timed_out = f"codex app-server turn timed out after {timeout:g}s"
                break
            with anyio.move_on_after(wait):
                try:
                    n = await self.__anext__()
                except StopAsyncIteration:
                    break
                if on_event is not None:
                    await on_event(n)
                continue
            if anyio.current_time() >= deadline:
                timed_out = f"codex app-server turn timed out after {timeout:g}s"
            else:
                timed_out = f"codex app-server turn idle for {idle_timeout:g}s"
            break
        if timed_out is not None:
            log.warning("appserver.turn_timeout", thread_id=self.thread_id, turn_id=self.turn_id)
            await self.interrupt()
            await self._drain(_INTERRUPT_GRACE_S)
            self.result = self.projector.build_result(
                outcome=TurnOutcome.TIMED_OUT, error=timed_out
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
