"""The anyio JSON-RPC client for ``codex app-server`` (works on asyncio and trio).

Layering, bottom up:

1. **Transport** (:mod:`.process`): lines in, lines out; OS errors become
   :class:`AppServerClosed` there.
2. **Protocol** (this module, the connection core of :class:`AppServerClient`): one reader
   (the reader task, or, when the transport hands lines over itself, its read callback:
   :meth:`~.process.AppServerProcess.serve_lines`) parses each line and dispatches it
   synchronously as a *response* (``id`` + ``result``/``error``: wakes the
   waiting request), a *server request* (``id`` + ``method``: handled in its own task, answered
   exactly once, see :mod:`.server_requests`) or a *notification* (``method`` only: routed to
   the subscribers of its ``threadId``, and to global listeners). A line that is not JSON is
   logged (its length, never its content) and skipped: one garbage line never kills the
   client. When the transport ends, *every* pending request and every subscription fails with
   the same :class:`AppServerClosed`, at once.
3. **Methods**: ``initialize``/``initialized`` (here, with ``experimentalApi``, needed for
   dynamic tools); ``thread/start`` and ``thread/resume`` (:mod:`.threads`); ``turn/start``
   and ``turn/interrupt`` (:mod:`.turn_start`); ``thread/compact/start``
   (:mod:`.native_compaction`), with typed params/results (:mod:`.types`).
4. **Turns**: :meth:`AppServerClient.turn` opens a :class:`~.turn.TurnHandle` (the theory of a
   turn is in :mod:`.turn`; starting one without orphaning it in :mod:`.turn_start`).
5. **Compaction**: :meth:`AppServerClient.compact_thread` (:mod:`.native_compaction`); it may
   :meth:`AppServerClient.retire` the connection.

:class:`AppServerClient` is this module's connection core (:class:`_Connection`: lifecycle,
reading, dispatch, requests, the handshake, retirement) plus one mixin per group of methods
above (:mod:`.threads`, :mod:`.turn_start`, :mod:`.native_compaction`). The mixins are typed
against :class:`_Connection` (their base class for mypy only) and add no state of their own:
everything lives in :meth:`_Connection.__init__`.

Errors are mapped once, here: a JSON-RPC error object becomes :class:`AppServerRpcError`, a
missed deadline :class:`AppServerTimeout`.

Liveness. A deadline can pass for innocent reasons (a slow model, a long resume), so a missed
one never ends anything by itself; it only raises the question whether the process is still
there (a stopped or wedged process answers nothing, ever). The question is asked once at a
time (:meth:`_Connection._deadline_missed`, awaited by every caller whose deadline passed,
before its :class:`AppServerTimeout` is raised: ``turn/start``, any request, and so the
``turn/interrupt`` of a turn whose idle or turn timeout passed): a cheap probe
(``thread/loaded/list``, answered in well under a millisecond, mid-turn too) is sent, and any
line read from the process within ``liveness_timeout`` (the probe's answer or anything else)
proves it alive. Silence proves it dead: it is killed (SIGKILL, which also ends a stopped
process) and the connection retired, exactly like a crash, so every pending call fails with
:class:`AppServerClosed` and :class:`~.manager.AppServer` starts a fresh process on the same
CODEX_HOME on its next call and re-resumes its threads. Nothing on disk is touched: threads,
rollouts and bindings survive; a wedged process costs the turns in flight, never a thread.
Worst case to replacement: the missed deadline plus ``liveness_timeout``.

Outgoing text is always valid Unicode. Codex rejects a line holding a lone UTF-16 surrogate
(on stderr only: the request is never answered), so :func:`encode_message`, the one place a
message is serialised, replaces each unpaired surrogate by U+FFFD (a well-formed pair in a
Python string becomes its character, as Codex would have read it). Prompts, instructions,
tool results and injected context all pass through it.

Logging records ids, methods, counts and durations, never params (they carry prompts, tool
arguments and model text).

Methods take ``timeout=`` on purpose (``# noqa: ASYNC109``): the deadline must be applied here,
inside, so that missing it surfaces as the typed :class:`AppServerTimeout` (and, for turns, as an
interrupt plus a ``TIMED_OUT`` result) instead of a bare cancellation.

Size (~875 lines): the connection core and its liveness probe stay together because the reader
(a line is a sign of life), every request (a missed deadline asks the question) and
retirement share them; the groups of methods are already mixins in their own modules. The
per-turn notification queue (:class:`TurnNotifications`) is the one piece that could move to a
module of its own, were the file to grow further.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any, Self, TypeVar

import anyio
import anyio.abc
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from codex_turn._log import format_error, get_logger

from .config import AppServerConfig
from .defaults import INTERRUPT_GRACE_S, LIVENESS_TIMEOUT_S
from .errors import (
    MAX_MESSAGE_CHARS,
    AppServerClosed,
    AppServerError,
    AppServerRpcError,
    AppServerStartError,
    AppServerTimeout,
)
from .logsafe import capped
from .native_compaction import CompactionResult, _CompactionMethods, _KeyedLocks
from .process import AppServerProcess, LineTransport, running_asyncio_loop
from .projector import Notification
from .server_requests import (
    ApprovalPolicy,
    UserInputHandler,
    _TurnBinding,
    decline_all,
    serve_request,
)
from .threads import LoadedThread, _ThreadMethods
from .tools import ToolRegistry
from .turn import CodexTurnPhase, TurnHandle
from .turn_start import _TurnMethods
from .types import (
    ClientInfo,
    InitializeCapabilities,
    InitializeParams,
    InitializeResult,
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
    "encode_message",
]

log = get_logger(__name__)

NotificationListener = Callable[[Notification], None]

#: The liveness probe: cheap, in memory, no side effects, answered mid-turn (see the header).
LIVENESS_PROBE_METHOD = "thread/loaded/list"
_LIVENESS_PROBE_PARAMS = {"limit": 1}
# Notifications after which Codex may no longer hold a thread as this process loaded it.
_UNLOADING = frozenset(
    {
        "thread/closed",
        "thread/archived",
        "thread/deleted",
        "thread/reverted",
        "thread/settings/updated",
    }
)
_UNLOADED_STATUSES = frozenset({"notLoaded", "systemError"})
# Every method that can change what a loaded thread holds: the unloading ones, a status
# change, and those that can carry a compaction (Notification.compaction_phase). Others
# (deltas, token usage...) skip the check.
_THREAD_CHANGES = _UNLOADING | {
    "thread/status/changed",
    "thread/compacted",
    "item/started",
    "item/completed",
}

# A surrogate pair (kept: it is one character), or a lone surrogate (repaired).
_SURROGATES = re.compile("[\ud800-\udbff][\udc00-\udfff]|[\ud800-\udfff]")


def _status_type(params: Mapping[str, Any]) -> object:
    status = params.get("status")
    return status.get("type") if isinstance(status, Mapping) else None


def _repair_surrogate(match: re.Match[str]) -> str:
    found = match.group()
    if len(found) == 2:
        high, low = ord(found[0]), ord(found[1])
        return chr(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))
    return "\ufffd"


def encode_message(message: Mapping[str, Any]) -> tuple[bytes, int]:
    """One JSON line (without the newline) as UTF-8, and how many lone surrogates in it were
    replaced by U+FFFD (see the module header). Valid text costs one encode, nothing more."""
    text = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8"), 0
    except UnicodeEncodeError:
        pass
    lone = 0

    def repair(match: re.Match[str]) -> str:
        nonlocal lone
        fixed = _repair_surrogate(match)
        lone += fixed == "\ufffd"
        return fixed

    # Surrogates can only occur inside JSON strings, so this cannot change the structure.
    return _SURROGATES.sub(repair, text).encode("utf-8"), lone


class _Pending:
    __slots__ = ("error", "event", "method", "result")

    def __init__(self, method: str) -> None:
        self.method = method
        self.event = anyio.Event()
        self.result: Any = None
        self.error: AppServerError | None = None


class _Subscription:
    """A per-thread notification queue (unbounded: the reader must never block on a slow
    consumer; a turn's notifications are few), read as an anyio memory object stream
    (:meth:`_Connection.subscribe`)."""

    __slots__ = ("send", "stream", "thread_id")

    def __init__(self, thread_id: str) -> None:
        self.thread_id = thread_id
        send, receive = anyio.create_memory_object_stream[Notification](math.inf)
        self.send: MemoryObjectSendStream[Notification] = send
        self.stream: MemoryObjectReceiveStream[Notification] = receive

    def push(self, n: Notification) -> None:
        """Queue ``n`` (the reader; never blocks); a closed receiver is simply skipped."""
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.send.send_nowait(n)

    def close_send(self) -> None:
        """No more notifications: the receiver ends with ``EndOfStream``."""
        self.send.close()

    def close(self) -> None:
        self.send.close()
        self.stream.close()


class TurnNotifications:
    """A turn's notification queue (:meth:`_Connection._turn_queue`): what a memory object
    stream does for one reader, without its costs per notification.

    A notification is always queued, never handed to a waiting receiver, so a receiver that
    is cancelled loses nothing; :meth:`receive` takes a queued one at once (no checkpoint:
    the reader queued it already, and a turn's notifications are finite) and otherwise waits
    for the reader's next :meth:`push`, one wake-up. Ends as a memory stream does:
    ``EndOfStream`` once the client closed and the queue is drained, ``ClosedResourceError``
    once the subscription ended; :meth:`receive_nowait` raises ``WouldBlock`` when empty.

    :meth:`wait` is the one place a receiver waits, optionally until a deadline (what
    :meth:`~.turn.TurnHandle.collect` bounds its waits with). On asyncio a wait is one bare
    future of the loop, expired by one timer of the loop: no event object nor cancel scope
    per wait (an ``anyio.Event`` is an asyncio ``Event`` holding such a future anyway, and
    cancelling the waiting task cancels the future alike). Elsewhere (trio) it is an
    ``anyio.Event`` inside a cancel scope with that deadline."""

    __slots__ = (
        "_closed",
        "_ended",
        "_items",
        "_loop",
        "_probed",
        "_pushed",
        "_waiters",
        "thread_id",
    )

    def __init__(self, thread_id: str) -> None:
        self.thread_id = thread_id
        self._items: collections.deque[Notification] = collections.deque()
        self._ended = False  # no more notifications (the client closed)
        self._closed = False  # the subscription ended: nothing is queued any more
        # On asyncio: the futures of the receivers waiting for the next push (or close).
        self._waiters: list[asyncio.Future[bool]] = []
        self._pushed: anyio.Event | None = None  # elsewhere: set by the next push (or close)
        self._loop: asyncio.AbstractEventLoop | None = None  # the receivers' asyncio loop
        self._probed = False  # whether the receivers' backend is known (the first wait)

    def push(self, n: Notification) -> None:
        """Queue ``n`` (the reader; never blocks); once the client closed (:meth:`close_send`)
        or the subscription ended it is dropped, as a closed memory stream would."""
        if not self._ended:
            self._items.append(n)
            self._wake()

    def _wake(self) -> None:
        waiters = self._waiters
        if waiters:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(True)
            waiters.clear()
        pushed = self._pushed
        if pushed is not None:
            self._pushed = None
            pushed.set()

    def close_send(self) -> None:
        self._ended = True
        self._wake()

    def close(self) -> None:
        self._closed = self._ended = True
        self._items.clear()
        self._wake()

    def receive_nowait(self) -> Notification:
        if self._closed:
            raise anyio.ClosedResourceError
        if self._items:
            return self._items.popleft()
        if self._ended:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    async def receive(self) -> Notification:
        while not (self._items or self._ended):
            await self.wait()
        return self.receive_nowait()

    async def wait(self, deadline: float = math.inf) -> bool:
        """Return once a notification is queued or the queue ended (at once if so already):
        ``True``; ``False`` when the event loop's clock (``anyio.current_time()``) reached
        ``deadline`` first. Takes nothing from the queue; a cancelled wait loses nothing."""
        if self._items or self._ended:
            return True
        if not self._probed:
            self._probed = True
            self._loop = running_asyncio_loop()
        loop = self._loop
        if loop is None:
            return await self._wait_event(deadline)
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiters.append(waiter)
        timer = None if deadline == math.inf else loop.call_at(deadline, _expire, waiter)
        try:
            if await waiter:
                return True
        finally:
            if timer is not None:
                timer.cancel()
            if self._waiters:  # not woken by a push (expired, or cancelled): forget it
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        if self._items or self._ended:
            return True  # came in the same loop round as the deadline: not idle after all
        # Expired. The loop runs a timer up to its clock resolution early; a cancel scope
        # waits for the deadline itself, and so does this (it decides "idle" or "timed out").
        if loop.time() >= deadline:
            return False
        return await self.wait(deadline)

    async def _wait_event(self, deadline: float) -> bool:
        pushed = self._pushed
        if pushed is None:
            pushed = self._pushed = anyio.Event()
        if deadline == math.inf:
            await pushed.wait()
            return True
        with anyio.CancelScope(deadline=deadline):
            await pushed.wait()
            return True
        return bool(self._items or self._ended)  # came in the deadline's round: not idle

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Notification:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None


def _expire(waiter: asyncio.Future[bool]) -> None:
    """A :meth:`TurnNotifications.wait` reached its deadline (unless a push came first)."""
    if not waiter.done():
        waiter.set_result(False)


_S = TypeVar("_S", _Subscription, TurnNotifications)


class _Connection:
    """The connection core of :class:`AppServerClient` (see the module header)."""

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
        liveness_timeout: float = LIVENESS_TIMEOUT_S,
    ) -> None:
        self.transport = transport
        self.request_timeout = request_timeout
        self.interrupt_grace = interrupt_grace
        self.liveness_timeout = liveness_timeout
        self.approval_policy = approval_policy
        self.user_input_handler = user_input_handler
        self.provider = provider
        self.model = model
        self.initialize_result: InitializeResult | None = None
        self.sent: list[dict[str, Any]] = []  # every message we sent, when ``record_sent``
        self.record_sent = False
        self.server_requests: dict[Any, str] = {}  # id -> method, when ``record_sent``
        self.garbage_lines = 0
        self.repaired_surrogates = 0
        self._next_id = 1
        self._pending: dict[int, _Pending] = {}
        self._subs: dict[str, list[_Subscription | TurnNotifications]] = {}
        self._listeners: list[NotificationListener] = []
        self._tools: dict[str, ToolRegistry] = {}
        self._turn_handlers: dict[str, _TurnBinding] = {}  # see server_requests.py
        self._loaded: dict[str, LoadedThread] = {}  # see threads.py
        #: Per cwd, the sticky turn defaults of Codex's configuration (``config/read``), or
        #: ``None`` when this app-server cannot tell (see threads.py).
        self._configured: dict[str | None, Mapping[str, Any] | None] = {}
        self._compaction_locks = _KeyedLocks()
        self._closed_error: AppServerClosed | None = None
        self._probe: anyio.Event | None = None  # set when the running liveness probe is done
        self._life: anyio.Event | None = None  # set by the reader on any line, while probing
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
        spawned = transport is None
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
            liveness_timeout=config.liveness_timeout,
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
                        if spawned:
                            try:
                                config.restrict_home()  # Codex re-opens a few modes at startup
                            except OSError as exc:
                                log.warning(
                                    "appserver.home_not_restricted", error=format_error(exc)
                                )
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
        """Called synchronously for every notification (all threads), by the reader (on
        asyncio, from the event loop's read callback: not inside a task). Keep it cheap."""
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
                sub.close_send()
        self._closed.set()

    async def _background(self) -> None:
        try:
            await self.transport.run_background()
        except Exception as exc:  # pragma: no cover - stderr draining must not kill us
            log.warning("appserver.background_failed", error=format_error(exc))

    async def _read_loop(self) -> None:
        try:
            serve_lines = getattr(self.transport, "serve_lines", None)
            if serve_lines is not None:
                # The process hands each line over as it is read (on asyncio, from the event
                # loop's read callback: no reader-task round per line).
                await serve_lines(self._on_line)
            while True:
                self._on_line(await self.transport.receive_line())
        except AppServerClosed as exc:
            if self._closed_error is None:
                log.warning("appserver.closed", returncode=exc.returncode)
            self._mark_closed(exc)
        except Exception as exc:
            self._mark_closed(
                AppServerClosed(f"codex app-server reader failed: {format_error(exc)}")
            )

    def _on_line(self, line: bytes) -> None:
        if self._life is not None:
            self._life.set()  # a sign of life for the running probe
        self._dispatch(line)

    def _dispatch(self, line: bytes) -> None:
        line = line.strip()
        if not line:
            return
        try:
            # Decoded here: json.loads would first sniff the encoding of bytes (in Python),
            # and Codex writes UTF-8 (surrogatepass: as json.loads decodes bytes).
            message = json.loads(line.decode("utf-8", "surrogatepass"))
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
                    self._tg.start_soon(serve_request, self, msg_id, method, message.get("params"))
                return
            params = message.get("params")
            self._route(Notification(method, params if isinstance(params, dict) else {}))
            return
        if msg_id is not None and ("result" in message or "error" in message):
            pending = self._pending.pop(msg_id, None) if isinstance(msg_id, int) else None
            if pending is None:
                log.warning("appserver.unexpected_response", id=capped(msg_id))
                return
            error = message.get("error")
            if error is not None:
                code = error.get("code") if isinstance(error, dict) else None
                if not isinstance(code, int) or isinstance(code, bool):
                    code = -32603  # malformed: an internal error, never a crashed reader
                text = error.get("message", "") if isinstance(error, dict) else error
                if not isinstance(text, str):
                    text = capped(text, MAX_MESSAGE_CHARS) or ""
                pending.error = AppServerRpcError(code, text, method=pending.method)
            else:
                pending.result = message.get("result")
            pending.event.set()
            return
        self.garbage_lines += 1
        log.warning("appserver.garbage_message", keys=sorted(message)[:5])

    def _route(self, n: Notification) -> None:
        thread_id = n.thread_id
        if thread_id is not None and n.method in _THREAD_CHANGES and thread_id in self._loaded:
            self._note_thread_change(n, thread_id)
        for listener in self._listeners:
            try:
                listener(n)
            except Exception as exc:
                log.warning("appserver.listener_failed", error=format_error(exc))
        if thread_id is None:
            return
        for sub in self._subs.get(thread_id, ()):
            sub.push(n)  # unbounded buffer: never blocks; a closed receiver is skipped

    def _note_thread_change(self, n: Notification, thread_id: str) -> None:
        """Keep :class:`~.threads.LoadedThread` true: a compaction may drop the instructions
        a resume re-sent, an unload drops the thread (both make the next turn resume)."""
        loaded = self._loaded.get(thread_id)
        if loaded is None:
            return
        if n.compaction_phase is not None:
            if not loaded.compacted:
                self._loaded[thread_id] = attrs.evolve(loaded, compacted=True)
        elif n.method in _UNLOADING or (
            n.method == "thread/status/changed" and _status_type(n.params) in _UNLOADED_STATUSES
        ):
            del self._loaded[thread_id]

    @contextlib.contextmanager
    def subscribe(self, thread_id: str) -> Iterator[MemoryObjectReceiveStream[Notification]]:
        """Receive every notification of ``thread_id`` from now on (buffered)."""
        with self._subscribed(_Subscription(thread_id)) as sub:
            yield sub.stream

    @contextlib.contextmanager
    def _turn_queue(self, thread_id: str) -> Iterator[TurnNotifications]:
        """:meth:`subscribe`, as a :class:`TurnNotifications` (what a turn reads)."""
        with self._subscribed(TurnNotifications(thread_id)) as queue:
            yield queue

    @contextlib.contextmanager
    def _subscribed(self, sub: _S) -> Iterator[_S]:
        if self._closed_error is not None:
            raise self._closed_error
        thread_id = sub.thread_id
        self._subs.setdefault(thread_id, []).append(sub)
        try:
            yield sub
        finally:
            subs = self._subs.get(thread_id, [])
            if sub in subs:
                subs.remove(sub)
            if not subs:
                self._subs.pop(thread_id, None)
            sub.close()

    # -- requests ------------------------------------------------------------------------

    async def _send(self, message: dict[str, Any]) -> None:
        if self.record_sent:
            self.sent.append(message)
        line, repaired = encode_message(message)
        if repaired:
            self.repaired_surrogates += repaired
            log.warning(
                "appserver.lone_surrogates_replaced",
                method=capped(message.get("method")),
                count=repaired,
            )
        await self.transport.send_line(line)

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
            await self._deadline_missed(method)
            raise AppServerTimeout(
                f"{capped(method)} got no response within {seconds:g}s",
                method=method,
                seconds=seconds,
            ) from None
        finally:
            if msg_id is not None:
                self._pending.pop(msg_id, None)
        if pending.error is not None:
            raise pending.error
        log.debug(
            "appserver.request",
            method=capped(method),
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

    async def retire(self, reason: str, *, dead: bool = False) -> None:
        """Take this connection out of service for good and stop its process.

        Every pending request and subscription fails with :class:`AppServerClosed` at once;
        the process is shut down (stdin closed, then terminate, then kill, shielded) before
        this returns; a ``dead`` one (it stopped answering) is killed first, as it would act
        on neither. :class:`~.manager.AppServer` starts a fresh process on its next call.
        """
        if self._closed_error is None:
            log.warning("appserver.retired", reason=reason, dead=dead)
        what = "declared dead" if dead else "connection retired"
        self._mark_closed(AppServerClosed(f"codex app-server {what}: {reason}"))
        self.request_stop()
        if dead:
            self.transport.kill()
        with anyio.CancelScope(shield=True):
            await self.transport.aclose()

    # -- liveness ------------------------------------------------------------------------

    async def _deadline_missed(self, what: str) -> None:
        """``what`` got no answer in time: return once it is known whether the process is
        alive; a dead one is retired by then (see "Liveness" in the module header). One probe
        at a time: concurrent callers wait for the same verdict. Never raises."""
        if self._closed_error is not None or self._tg is None:
            return
        done = self._probe
        if done is None:
            done = self._probe = anyio.Event()
            self._tg.start_soon(self._probe_liveness, what, done)
        await done.wait()

    async def _probe_liveness(self, what: str, done: anyio.Event) -> None:
        started = time.perf_counter()
        try:
            alive = await self._probe_once()
            if self._closed_error is not None:
                return  # closed meanwhile (a crash, a shutdown): nothing left to declare
            if alive:
                log.info(
                    "appserver.liveness_probe",
                    after=capped(what),
                    alive=True,
                    ms=round((time.perf_counter() - started) * 1000, 1),
                )
                return
            log.error(
                "appserver.liveness_probe",
                after=capped(what),
                alive=False,
                seconds=self.liveness_timeout,
            )
            await self.retire(
                f"no sign of life within {self.liveness_timeout:g}s after"
                f" {capped(what)} missed its deadline",
                dead=True,
            )
        finally:
            self._probe = None
            done.set()

    async def _probe_once(self) -> bool:
        """Send the probe; whether any line was read within ``liveness_timeout``."""
        life = self._life = anyio.Event()
        msg_id: int | None = None
        try:
            with anyio.move_on_after(self.liveness_timeout):
                # Sending is bounded too: a stopped process stops draining its stdin.
                msg_id, _ = await self._start_request(LIVENESS_PROBE_METHOD, _LIVENESS_PROBE_PARAMS)
                await life.wait()
                return True
            return False
        except AppServerClosed:
            return False  # the caller sees the closed state
        finally:
            self._life = None
            if msg_id is not None:
                self._pending.pop(msg_id, None)


class AppServerClient(_ThreadMethods, _TurnMethods, _CompactionMethods, _Connection):
    """A JSON-RPC session with one app-server process. Create with :meth:`connect`."""


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
