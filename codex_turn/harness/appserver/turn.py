"""One Codex turn as the client follows it: :class:`TurnHandle` and its :class:`CodexTurnPhase`.

:meth:`~.client.AppServerClient.turn` (:mod:`.turn_start`) opens a :class:`TurnHandle` that
yields the turn's notifications until ``turn/completed`` and folds them through the
:class:`~.projector.TurnProjector`. A cancelled or timed-out turn is interrupted once and each
wait of its abandonment is bounded by the interrupt grace (:data:`~.defaults.INTERRUPT_GRACE_S`,
or ``AppServerConfig.interrupt_grace``); ``on_event`` callbacks of :meth:`TurnHandle.collect`
run outside the idle/turn timeouts.

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
notifications move the phase wherever they arrive (inside :meth:`TurnHandle.absorb`); our
decisions only in :meth:`TurnHandle.interrupt` and when giving up. An input the table does
not list is a bug in this module and raises ``RuntimeError``.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, Protocol, Self

import anyio

from codex_turn._log import format_error, get_logger

from .defaults import INTERRUPT_GRACE_S
from .errors import (
    AppServerClosed,
    AppServerError,
    AppServerRpcError,
    NoActiveTurn,
    TurnNotRunning,
)
from .logsafe import capped
from .process import running_asyncio_loop
from .projector import CodexTurnResult, CodexTurnStatus, Notification, TurnProjector
from .types import UserInput

__all__ = ["CodexTurnPhase", "TurnHandle"]

log = get_logger(__name__)


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
    """The receive side of a turn's subscription (ends with ``EndOfStream``/``Closed...``;
    the client's is a :class:`~.client.TurnNotifications`). :meth:`TurnHandle.collect` takes
    what one with ``receive_nowait`` (raising ``WouldBlock`` when empty) has buffered without
    waiting, and one that also has ``wait(deadline) -> bool`` (see
    :meth:`~.client.TurnNotifications.wait`) bounds its own waits; any other is received
    from inside a cancel scope per wait."""

    async def receive(self) -> Notification: ...


def _loop_clock() -> Callable[[], float]:
    """``anyio.current_time``; on asyncio the running loop's ``time`` (the same clock,
    without a lookup of the async backend per call)."""
    loop = running_asyncio_loop()
    return anyio.current_time if loop is None else loop.time


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
        self._receive_nowait: Callable[[], Notification] | None = getattr(
            stream, "receive_nowait", None
        )
        self._wait: Callable[[float], Awaitable[bool]] | None = (
            getattr(stream, "wait", None) if self._receive_nowait is not None else None
        )
        self._phase = phase
        self._replay: collections.deque[Notification] = collections.deque()
        #: Set once the turn is active (``turn/started``) or over: ``turn/steer`` waits for it.
        self._active = anyio.Event()
        if phase is not CodexTurnPhase.STARTING:
            self._active.set()

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
            if self.absorb(n):
                return n

    def _buffered_own(self) -> Notification | None:
        """The turn's next notification if one is already buffered (folded), else ``None``."""
        receive_nowait = self._receive_nowait
        if receive_nowait is None:
            return None
        while True:
            try:
                n = receive_nowait()
            except anyio.WouldBlock:
                return None
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                raise self.client.closed_error or AppServerClosed() from None
            if self.absorb(n):
                return n

    def _ready(self) -> Notification | None:
        """What :meth:`__anext__` would return without waiting, or ``None``: a replayed
        notification, else a buffered one of the turn (``None`` too once the turn is over)."""
        if self._replay:
            return self._replay.popleft()
        if self._phase is CodexTurnPhase.COMPLETED:
            return None
        return self._buffered_own()

    def absorb(self, n: Notification) -> bool:
        """Fold one notification of the thread; whether it belonged to this turn (the client
        replays through it what it read before the handle existed)."""
        if not self.projector.feed(n):
            return False
        if n.method == "turn/started":
            self._fire(_TurnInput.STARTED)
        if self.projector.done:
            self._fire(_TurnInput.COMPLETED)
        if self._phase is not CodexTurnPhase.STARTING and not self._active.is_set():
            self._active.set()
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

    async def steer(
        self,
        input: Sequence[UserInput],
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> str:
        """``turn/steer``: deliver more user input to this running turn; Codex's turn id.

        Codex refuses a steer before the turn is active (like an interrupt), so this first
        waits for the turn's ``turn/started`` (at most the interrupt grace; the iteration reads
        it). Codex 0.163 answers at once and ends the model's current response early, then
        samples again with the new input in the same turn.

        Raises :class:`~.errors.TurnNotRunning` when the turn is not running: this handle
        knows it (not started within the grace, interrupted, given up on, over: nothing is
        sent), or Codex answers so (:class:`~.errors.NoActiveTurn`, classified here, where
        the answer comes back). Any other refusal is an :class:`~.errors.AppServerRpcError`
        (an ``expectedTurnId`` that is not the active turn, a turn Codex does not let be
        steered), and a client that cannot steer an :class:`~.errors.AppServerError`.
        """
        with anyio.move_on_after(self.interrupt_grace):
            await self._active.wait()
        if self._phase is not CodexTurnPhase.RUNNING:
            phase = self._phase.value
            raise TurnNotRunning(f"cannot steer a turn that is {phase}", phase=phase)
        steer_turn: Any = getattr(self.client, "steer_turn", None)
        if not callable(steer_turn):
            raise AppServerError("this app-server client cannot steer a turn")
        try:
            raw = await steer_turn(self.thread_id, self.turn_id, input, timeout=timeout)
        except AppServerRpcError as exc:
            over = NoActiveTurn.match(exc)
            if over is None:
                raise
            raise over from exc
        turn_id = raw.get("turnId") if isinstance(raw, Mapping) else None
        return turn_id if isinstance(turn_id, str) and turn_id else self.turn_id

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

    async def abandon(self) -> None:
        """Interrupt and wait briefly for turn/completed (on cancellation, and by the client
        for a turn whose ``turn/start`` it gave up on)."""
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
            await self.abandon()

    def _host_answering(self, idle_timeout: float) -> bool:
        """A host callback (approval, user input) of this turn's thread is pending, or was
        answered less than ``idle_timeout`` ago (Codex goes on from there)."""
        # Optional for a client (tests' fakes have none): read by name, not in _TurnClient.
        bindings = getattr(self.client, "turn_handlers", None)
        binding = bindings.get(self.thread_id) if isinstance(bindings, dict) else None
        if binding is None:
            return False
        recent = anyio.current_time() - binding.answered_at < idle_timeout
        return bool(binding.pending > 0 or recent)

    async def _wait_until(self, until: float) -> bool:
        """Wait until more of the turn may be ready (:meth:`_ready`): ``False`` once the clock
        reached ``until`` first. A source with its own bounded wait uses it (nothing is taken
        from it); any other is received from inside a cancel scope with that deadline, and
        what arrives is kept for :meth:`_ready` (also when it came in the same loop round as
        the deadline: Codex was not idle)."""
        wait = self._wait
        if wait is not None:
            return await wait(until)
        with anyio.CancelScope(deadline=until):
            self._replay.append(await self._receive_own())
            return True
        return False

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
        deadline still bounds the waits). Neither is a host callback answering an approval or
        a user-input request of this thread (Codex is silent while it waits): the idle
        timeout does not fire while one is pending, which its own timeout bounds (its window
        restarts once the host answered). On a timeout the turn is interrupted (once) and
        given the interrupt grace to end; the result is ``TIMED_OUT`` even when that
        interrupt itself fails (times out, or the process died meanwhile).
        """
        clock = _loop_clock()
        deadline = math.inf if timeout is None else clock() + timeout
        idle = idle_timeout or math.inf
        timed_out: str | None = None
        # The deadline of the running wait: kept while only other turns' notifications come
        # (they are no sign of this turn), a fresh idle window after each of its own.
        until: float | None = None
        while self._replay or self._phase is not CodexTurnPhase.COMPLETED:
            now = clock()
            if now >= deadline:
                timed_out = f"codex app-server turn timed out after {timeout:g}s"
                break
            n = self._ready()
            if n is None:
                # Only a wait is bounded (what is already buffered is taken without one),
                # and nothing bounds on_event: no cancel scope is left open around it.
                if until is None:
                    until = min(now + idle, deadline)
                if await self._wait_until(until):
                    continue
                until = None
                if clock() >= deadline:
                    timed_out = f"codex app-server turn timed out after {timeout:g}s"
                elif self._host_answering(idle_timeout or math.inf):
                    continue  # Codex waits for the host's answer: not idle
                else:
                    timed_out = f"codex app-server turn idle for {idle_timeout:g}s"
                break
            until = None
            if on_event is not None:
                await on_event(n)
        if timed_out is not None:
            log.warning(
                "appserver.turn_timeout",
                thread_id=capped(self.thread_id),
                turn_id=capped(self.turn_id),
            )
            try:
                await self._give_up()
                await self._drain(self.interrupt_grace)
            except AppServerError as exc:
                # The timeout stays the story: the interrupt could not even be delivered.
                log.warning(
                    "appserver.turn_timeout_interrupt_failed",
                    thread_id=capped(self.thread_id),
                    turn_id=capped(self.turn_id),
                    error=format_error(exc),
                )
            self.result = self.projector.build_result(
                outcome=CodexTurnStatus.TIMED_OUT, error=timed_out
            )
        elif self.result is None:
            self.result = self.projector.build_result()
        log.info(
            "appserver.turn_completed",
            thread_id=capped(self.thread_id),
            turn_id=capped(self.turn_id),
            outcome=self.result.outcome.value,
        )
        return self.result
