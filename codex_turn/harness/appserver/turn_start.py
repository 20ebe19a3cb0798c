"""The client's turn methods: ``turn/start`` without orphaning the turn, ``turn/interrupt``.

:class:`Turns` is a part of :class:`~.client.AppServerClient` (which hands its methods on),
built on the :class:`~.connection.Connection`, the client's :class:`~.threads.Threads` (a
turn sends back the thread's sticky defaults) and its :class:`~.server_requests.Responder`
(a turn binds its host callbacks there). :meth:`Turns.turn` starts a turn and yields its
:class:`~.turn.TurnHandle` (the theory of a turn is in :mod:`.turn`); :meth:`Turns.run_turn`
does it all and returns the :class:`~.projector.CodexTurnResult`.

A cancelled or timed-out turn is interrupted (once: a second ``turn/interrupt`` for the same
turn would hang in Codex; and only once the turn is active, after its ``turn/started``: Codex
refuses an earlier one and the turn runs on). That holds from the moment ``turn/start`` is
sent: a caller cancelled (or timed out) before its response still interrupts the turn Codex
started (:meth:`Turns._start_turn`). Each wait of an abandonment is bounded by the
interrupt grace (:data:`~.defaults.INTERRUPT_GRACE_S`, or ``AppServerConfig.interrupt_grace``).
A ``turn/start`` that gets no answer in time also asks whether the process is still alive
(see "Liveness" in :mod:`.connection`) before its :class:`~.errors.AppServerTimeout` is raised.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio

from codex_turn._log import get_logger

from .connection import Connection, Pending, TurnNotifications
from .defaults import INTERRUPT_GRACE_S
from .errors import AppServerClosed, AppServerTimeout
from .logsafe import capped
from .projector import CodexTurnResult, Notification, TurnProjector
from .server_requests import Responder, TurnRequestHandlers
from .threads import Threads
from .turn import CodexTurnPhase, TurnHandle
from .types import (
    ImageInput,
    TextInput,
    TurnInterruptParams,
    TurnStartParams,
    TurnStartResult,
    TurnSteerParams,
    UserInput,
    structure,
    unstructure,
)

__all__ = ["Turns"]

log = get_logger(__name__)


class Turns:
    """Starting, interrupting and running turns (see the module header); the client each
    :class:`TurnHandle` it opens interrupts and steers through."""

    def __init__(
        self,
        connection: Connection,
        threads: Threads,
        responder: Responder,
        *,
        provider: str | None = None,
        model: str | None = None,
        interrupt_grace: float = INTERRUPT_GRACE_S,
    ) -> None:
        self._connection = connection
        self._threads = threads
        self._responder = responder
        self.provider = provider
        self.model = model
        self.interrupt_grace = interrupt_grace
        #: What a TurnHandle reads of its client by name, when the client has it: the host
        #: callbacks bound to its thread (a pending one holds its idle timer).
        self.turn_handlers = responder.bindings

    @property
    def closed_error(self) -> AppServerClosed | None:
        return self._connection.closed_error

    async def interrupt_turn(
        self,
        thread_id: str,
        turn_id: str,
        *,
        timeout: float = INTERRUPT_GRACE_S,  # noqa: ASYNC109
    ) -> None:
        params = TurnInterruptParams(thread_id=thread_id, turn_id=turn_id)
        await self._connection.request("turn/interrupt", unstructure(params), timeout=timeout)

    async def steer_turn(
        self,
        thread_id: str,
        turn_id: str,
        input: Sequence[UserInput],
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any:
        """``turn/steer`` for the active turn ``turn_id``: Codex's answer, as it came (its
        handle, :meth:`.turn.TurnHandle.steer`, reads it and types a refusal)."""
        params = TurnSteerParams(thread_id=thread_id, expected_turn_id=turn_id, input=list(input))
        return await self._connection.request("turn/steer", unstructure(params), timeout=timeout)

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
        """Start a turn; yield a :class:`TurnHandle` to iterate its notifications.

        ``overrides``: more ``turn/start`` fields, wire names (``effort``, ``outputSchema``,
        ``approvalPolicy``, ``sandboxPolicy`` ...; ``threadId`` and ``input`` are this
        method's own). A ``collaborationMode`` needs only its instructions: the model and
        reasoning effort are filled in, and the next turn without one goes back to the
        default mode (:meth:`.threads.Threads.collaboration`). ``handlers``: the host
        callbacks for this turn's approvals and user-input requests, bound to the thread
        while the turn runs (see :mod:`.server_requests`).

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
        with (
            self._connection.turn_queue(thread_id) as queue,
            self._responder.bind(thread_id, handlers),
        ):
            params = TurnStartParams(thread_id=thread_id, input=items)
            sticky = self._threads.sticky_defaults(thread_id, overrides or {})
            wire = {**sticky, **(overrides or {}), **unstructure(params)}  # its own fields win
            wire = self._threads.collaboration(
                thread_id, wire, model=model, default_model=self.model
            )
            raw = await self._start_turn(thread_id, wire, queue, timeout)
            started = structure(raw, TurnStartResult)
            self._threads.note_sticky(thread_id, wire)
            self._threads.note_collaboration(thread_id, wire)
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
                queue,
                projector,
                interrupt_grace=self.interrupt_grace,
            )
            log.info(
                "appserver.turn_started",
                thread_id=capped(thread_id),
                turn_id=capped(started.turn.id),
            )
            try:
                yield handle
            finally:
                await handle.aclose()

    async def _start_turn(
        self,
        thread_id: str,
        params: Mapping[str, Any],
        stream: TurnNotifications,
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
        seconds = self._connection.request_timeout if timeout is None else timeout
        msg_id: int | None = None
        pending: Pending | None = None
        try:
            try:
                with anyio.fail_after(seconds):
                    msg_id, pending = await self._connection.start_request("turn/start", params)
                    await pending.event.wait()
            except TimeoutError:
                await self._connection.deadline_missed("turn/start")  # alive? a dead one is retired
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
                self._connection.forget_request(msg_id)
        if pending.error is not None:
            raise pending.error
        return pending.result

    async def _abandon_turn_start(
        self,
        thread_id: str,
        pending: Pending,
        stream: TurnNotifications,
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
        log.warning(
            "appserver.turn_start_abandoned", thread_id=capped(thread_id), turn_id=capped(turn_id)
        )
        if turn_id is None or self._connection.closed:
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
            handle.absorb(n)
        await handle.abandon()

    async def _watch_turn_start(
        self,
        pending: Pending,
        stream: TurnNotifications,
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
