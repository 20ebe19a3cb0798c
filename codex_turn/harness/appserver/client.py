"""The anyio JSON-RPC client for ``codex app-server`` (works on asyncio and trio).

Layering, bottom up:

1. **Transport** (:mod:`.process`): lines in, lines out; OS errors become
   :class:`AppServerClosed` there.
2. **Protocol** (:mod:`.connection`): requests and their answers, notifications routed per
   thread, server requests handed on, liveness after a missed deadline, retirement, and the
   ``initialize``/``initialized`` handshake (with ``experimentalApi``, needed for dynamic
   tools). Errors are mapped once there.
3. **Parts**, each a class built on the connection, none importing another's module back:
   :class:`~.threads.Threads` (``thread/start``, ``thread/resume``, ``thread/fork``,
   ``thread/inject_items`` and what this process knows of each thread),
   :class:`~.server_requests.Responder` (what Codex asks of us: dynamic tools, approvals,
   user input), :class:`~.turn_start.Turns` (``turn/start`` without orphaning the turn,
   ``turn/interrupt``; the theory of a turn is in :mod:`.turn`) and
   :class:`~.native_compaction.Compactions` (``thread/compact/start``, which may
   :meth:`~.connection.Connection.retire` the connection).
4. **The client** (this module): :class:`AppServerClient` is a connection that composes the
   parts and offers their methods as its own (:class:`_PartMethod`: each method is defined
   once, in its part), and :meth:`AppServerClient.connect` spawns the process, runs the
   connection and shakes hands.

Methods take ``timeout=`` on purpose (``# noqa: ASYNC109``): the deadline must be applied
inside, so that missing it surfaces as the typed :class:`AppServerTimeout` (and, for turns, as
an interrupt plus a ``TIMED_OUT`` result) instead of a bare cancellation.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import AsyncIterator, Callable
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

from codex_turn._log import format_error, get_logger

from .config import AppServerConfig
from .connection import (
    LIVENESS_PROBE_METHOD,
    Connection,
    NotificationListener,
    TurnNotifications,
    encode_message,
    unwrap_single_group,
)
from .defaults import INTERRUPT_GRACE_S, LIVENESS_TIMEOUT_S
from .errors import AppServerError, AppServerStartError
from .native_compaction import CompactionResult, Compactions
from .process import AppServerProcess, LineTransport
from .server_requests import ApprovalPolicy, Responder, UserInputHandler, decline_all
from .threads import Threads
from .turn import CodexTurnPhase, TurnHandle
from .turn_start import Turns
from .types import ClientInfo

__all__ = [
    "LIVENESS_PROBE_METHOD",
    "AppServerClient",
    "ApprovalPolicy",
    "CodexTurnPhase",
    "CompactionResult",
    "NotificationListener",
    "TurnHandle",
    "TurnNotifications",
    "UserInputHandler",
    "decline_all",
    "encode_message",
    "unwrap_single_group",
]

log = get_logger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


class _PartMethod(Generic[P, R]):
    """A method of one of the client's parts, offered as the client's own: read on a client,
    the method bound to that client's part; read on the class, the part's function (its
    signature, for introspection)."""

    def __init__(self, part: str, function: Callable[Concatenate[Any, P], R]) -> None:
        self._part = part
        self._function = function
        self.__doc__ = function.__doc__

    @overload
    def __get__(self, client: None, owner: type[Any]) -> Callable[Concatenate[Any, P], R]: ...

    @overload
    def __get__(self, client: object, owner: type[Any]) -> Callable[P, R]: ...

    def __get__(
        self, client: object | None, owner: type[Any]
    ) -> Callable[Concatenate[Any, P], R] | Callable[P, R]:
        if client is None:
            return self._function
        bound: Callable[P, R] = types.MethodType(self._function, getattr(client, self._part))
        return bound


class AppServerClient(Connection):
    """A JSON-RPC session with one app-server process. Create with :meth:`connect`.

    The connection (requests, notifications, liveness, retirement) plus its parts, whose
    methods it offers as its own: :attr:`threads` (``start_thread``, ``resume_thread``,
    ``fork_thread``, ``inject_items``, ``register_tools``, ``forget_thread``,
    ``loaded_thread``, ``is_loaded``, ``adopt_defaults``, ``knows_configured_defaults``),
    :attr:`turns` (``turn``, ``run_turn``, ``interrupt_turn``), :attr:`compactions`
    (``compact_thread``) and :attr:`responder`, which answers what Codex asks."""

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
        super().__init__(
            transport, request_timeout=request_timeout, liveness_timeout=liveness_timeout
        )
        self.threads = Threads(self)
        self.add_listener(self.threads.note)  # first: a loaded thread is kept true at once
        self.responder = Responder(
            self,
            self.threads.tools,
            approval_policy=approval_policy,
            user_input_handler=user_input_handler,
        )
        self.serve_request = self.responder.serve
        self.turns = Turns(
            self,
            self.threads,
            self.responder,
            provider=provider,
            model=model,
            interrupt_grace=interrupt_grace,
        )
        self.compactions = Compactions(self)

    # The parts' methods, as the client's own.
    register_tools = _PartMethod("threads", Threads.register_tools)
    is_loaded = _PartMethod("threads", Threads.is_loaded)
    loaded_thread = _PartMethod("threads", Threads.loaded_thread)
    adopt_defaults = _PartMethod("threads", Threads.adopt_defaults)
    knows_configured_defaults = _PartMethod("threads", Threads.knows_configured_defaults)
    forget_thread = _PartMethod("threads", Threads.forget_thread)
    start_thread = _PartMethod("threads", Threads.start_thread)
    resume_thread = _PartMethod("threads", Threads.resume_thread)
    fork_thread = _PartMethod("threads", Threads.fork_thread)
    inject_items = _PartMethod("threads", Threads.inject_items)
    interrupt_turn = _PartMethod("turns", Turns.interrupt_turn)
    turn = _PartMethod("turns", Turns.turn)
    run_turn = _PartMethod("turns", Turns.run_turn)
    compact_thread = _PartMethod("compactions", Compactions.compact_thread)

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
        async with client.running():
            try:
                await client.initialize(
                    ClientInfo(config.client_name, config.client_version, config.client_title),
                    experimental_api=config.experimental_api,
                    timeout=config.initialize_timeout,
                )
            except AppServerError as exc:
                said = getattr(transport, "startup_reason", None)
                reason = await said() if callable(said) else None
                raise AppServerStartError(
                    f"codex app-server failed to initialize: {format_error(exc)}"
                    + (f"; Codex said: {reason}" if reason else "")
                ) from exc
            if spawned:
                try:
                    config.restrict_home()  # Codex re-opens a few modes at startup
                except OSError as exc:
                    log.warning("appserver.home_not_restricted", error=format_error(exc))
            yield client
