"""The connection: JSON-RPC over the app-server's line transport (works on asyncio and trio).

The bottom of the client (:mod:`.client` composes the method groups on top of it). One reader
(the reader task, or, when the transport hands lines over itself, its read callback:
:meth:`~.process.AppServerProcess.serve_lines`) parses each line and dispatches it
synchronously as a *response* (``id`` + ``result``/``error``: wakes the waiting request), a
*server request* (``id`` + ``method``: handed to :attr:`Connection.serve_request` in a task of
its own, which answers it exactly once with :meth:`Connection.respond`, see
:mod:`.server_requests`) or a *notification* (``method`` only: routed to the subscribers of its
``threadId``, and to the listeners). A line that is not JSON is logged (its length, never its
content) and skipped: one garbage line never kills the client. When the transport ends, *every*
pending request and every subscription fails with the same :class:`AppServerClosed`, at once.

Errors are mapped once, here: a JSON-RPC error object becomes :class:`AppServerRpcError`, a
missed deadline :class:`AppServerTimeout`.

Liveness. A deadline can pass for innocent reasons (a slow model, a long resume), so a missed
one never ends anything by itself; it only raises the question whether the process is still
there (a stopped or wedged process answers nothing, ever). The question is asked once at a
time (:meth:`Connection.deadline_missed`, awaited by every caller whose deadline passed,
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

Size (~760 lines): the connection and its liveness probe stay together because the reader (a
line is a sign of life), every request (a missed deadline asks the question) and retirement
share them. The per-turn notification queue (:class:`TurnNotifications`) is the one piece that
could move to a module of its own, were the file to grow further.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping
from typing import Any, Self, TypeVar

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from codex_turn._log import format_error, get_logger

from .defaults import LIVENESS_TIMEOUT_S
from .errors import (
    MAX_MESSAGE_CHARS,
    AppServerClosed,
    AppServerError,
    AppServerRpcError,
    AppServerTimeout,
)
from .logsafe import capped
from .process import LineTransport, running_asyncio_loop
from .projector import Notification
from .types import (
    ClientInfo,
    InitializeCapabilities,
    InitializeParams,
    InitializeResult,
    structure,
    unstructure,
)

__all__ = [
    "LIVENESS_PROBE_METHOD",
    "Connection",
    "NotificationListener",
    "Pending",
    "ServeRequest",
    "TurnNotifications",
    "encode_message",
    "unwrap_single_group",
]

log = get_logger(__name__)

NotificationListener = Callable[[Notification], None]
#: ``await serve(msg_id, method, params)``: answers one server request, exactly once
#: (:meth:`Connection.respond`); runs in a task of its own.
ServeRequest = Callable[[Any, str, Any], Coroutine[Any, Any, None]]

#: The liveness probe: cheap, in memory, no side effects, answered mid-turn (see the header).
LIVENESS_PROBE_METHOD = "thread/loaded/list"
_LIVENESS_PROBE_PARAMS = {"limit": 1}

# A surrogate pair (kept: it is one character), or a lone surrogate (repaired).
_SURROGATES = re.compile("[\ud800-\udbff][\udc00-\udfff]|[\ud800-\udfff]")


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


class Pending:
    """One request sent and not answered yet: :meth:`Connection.start_request` returns it,
    the reader sets ``result`` or ``error``, then ``event``."""

    __slots__ = ("error", "event", "method", "result")

    def __init__(self, method: str) -> None:
        self.method = method
        self.event = anyio.Event()
        self.result: Any = None
        self.error: AppServerError | None = None


class _Subscription:
    """A per-thread notification queue (unbounded: the reader must never block on a slow
    consumer; a turn's notifications are few), read as an anyio memory object stream
    (:meth:`Connection.subscribe`)."""

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
    """A turn's notification queue (:meth:`Connection.turn_queue`): what a memory object
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


class Connection:
    """One JSON-RPC session with one app-server process (see the module header): requests,
    notifications, server requests handed to :attr:`serve_request`, liveness, retirement.

    Run it inside :meth:`running` (the reader and the transport's background task live in
    its task group); :meth:`initialize` is the handshake."""

    def __init__(
        self,
        transport: LineTransport,
        *,
        request_timeout: float = 60.0,
        liveness_timeout: float = LIVENESS_TIMEOUT_S,
    ) -> None:
        self.transport = transport
        self.request_timeout = request_timeout
        self.liveness_timeout = liveness_timeout
        #: Answers each server request (in a task of its own); unset, every one is refused.
        self.serve_request: ServeRequest = self.refuse_request
        self.initialize_result: InitializeResult | None = None
        self.sent: list[dict[str, Any]] = []  # every message we sent, when ``record_sent``
        self.record_sent = False
        self.server_requests: dict[Any, str] = {}  # id -> method, when ``record_sent``
        self.garbage_lines = 0
        self.repaired_surrogates = 0
        self._next_id = 1
        self._pending: dict[int, Pending] = {}
        self._subs: dict[str, list[_Subscription | TurnNotifications]] = {}
        self._listeners: list[NotificationListener] = []
        self._closed_error: AppServerClosed | None = None
        self._probe: anyio.Event | None = None  # set when the running liveness probe is done
        self._life: anyio.Event | None = None  # set by the reader on any line, while probing
        self._closed = anyio.Event()
        self._stop = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None

    # -- lifecycle -----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run the reader and the transport's background task for the block; on exit the
        connection is closed (every pending call fails) and the transport shut down."""
        try:
            with unwrap_single_group():
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    tg.start_soon(self._read_loop)
                    tg.start_soon(self._background)
                    try:
                        yield
                    finally:
                        self._mark_closed(AppServerClosed("codex app-server client was closed"))
                        await self.transport.aclose()
                        tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.transport.aclose()

    @property
    def task_group(self) -> anyio.abc.TaskGroup | None:
        """The task group of :meth:`running` (``None`` before it ran): server requests
        start their host callbacks there."""
        return self._tg

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
                    self._tg.start_soon(self.serve_request, msg_id, method, message.get("params"))
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
        for listener in self._listeners:
            try:
                listener(n)
            except Exception as exc:
                log.warning("appserver.listener_failed", error=format_error(exc))
        thread_id = n.thread_id
        if thread_id is None:
            return
        for sub in self._subs.get(thread_id, ()):
            sub.push(n)  # unbounded buffer: never blocks; a closed receiver is skipped

    @contextlib.contextmanager
    def subscribe(self, thread_id: str) -> Iterator[MemoryObjectReceiveStream[Notification]]:
        """Receive every notification of ``thread_id`` from now on (buffered)."""
        with self._subscribed(_Subscription(thread_id)) as sub:
            yield sub.stream

    @contextlib.contextmanager
    def turn_queue(self, thread_id: str) -> Iterator[TurnNotifications]:
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
                msg_id, pending = await self.start_request(method, params)
                await pending.event.wait()
        except TimeoutError:
            await self.deadline_missed(method)
            raise AppServerTimeout(
                f"{capped(method)} got no response within {seconds:g}s",
                method=method,
                seconds=seconds,
            ) from None
        finally:
            if msg_id is not None:
                self.forget_request(msg_id)
        if pending.error is not None:
            raise pending.error
        log.debug(
            "appserver.request",
            method=capped(method),
            id=msg_id,
            ms=round((time.perf_counter() - started) * 1000, 1),
        )
        return pending.result

    async def start_request(
        self, method: str, params: Mapping[str, Any] | None
    ) -> tuple[int, Pending]:
        """Register a pending request and send it; the caller waits for its ``event`` itself
        and then drops it (:meth:`forget_request`), whatever happened."""
        if self._closed_error is not None:
            raise self._closed_error
        msg_id = self._next_id
        self._next_id += 1
        pending = Pending(method)
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

    def forget_request(self, msg_id: int) -> None:
        """Stop waiting for request ``msg_id`` (a late answer is then logged as unexpected)."""
        self._pending.pop(msg_id, None)

    async def notify(self, method: str, params: Mapping[str, Any] | None = None) -> None:
        if self._closed_error is not None:
            raise self._closed_error
        message: dict[str, Any] = {"method": method}
        if params is not None:
            message["params"] = dict(params)
        await self._send(message)

    async def respond(self, msg_id: Any, *, result: Any = None, error: Any = None) -> None:
        """Answer server request ``msg_id`` (once); a closed connection drops the answer."""
        message: dict[str, Any] = {"id": msg_id}
        if error is not None:
            message["error"] = error
        else:
            message["result"] = result
        try:
            await self._send(message)
        except AppServerClosed:
            log.info("appserver.response_dropped", id=str(msg_id))

    async def refuse_request(self, msg_id: Any, method: str, params: Any = None) -> None:
        """Answer a server request nobody serves: JSON-RPC ``-32601`` (the default
        :attr:`serve_request`)."""
        log.warning("appserver.unknown_server_request", method=capped(method))
        await self.respond(
            msg_id, error={"code": -32601, "message": f"method not supported: {capped(method)}"}
        )

    # -- the handshake -------------------------------------------------------------------

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

    async def deadline_missed(self, what: str) -> None:
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
                msg_id, _ = await self.start_request(LIVENESS_PROBE_METHOD, _LIVENESS_PROBE_PARAMS)
                await life.wait()
                return True
            return False
        except AppServerClosed:
            return False  # the caller sees the closed state
        finally:
            self._life = None
            if msg_id is not None:
                self.forget_request(msg_id)


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
