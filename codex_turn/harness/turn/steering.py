"""Messages for a session whose turn is running: steered into it, queued, or rejected.

A runner on a chat channel gets messages for a session at any time. While a turn of that
session runs (in this process, from :func:`~codex_turn.run_codex_turn`), a message is handed
to :func:`steer_codex_turn`, which finds the running turn by its session file and does what
the turn's ``TurnParams.steering`` mode says (or the ``mode`` given):

* ``steer`` (default): the message joins the running Codex turn. Messages are batched in
  arrival order until ``TurnParams.steer_quiet_interval`` passes without a new one (or, with
  steady arrivals, at most :data:`MAX_BATCH_INTERVALS` quiet intervals after the batch's first
  message), then sent as one ``turn/steer``; Codex 0.163 ends the model's current response
  early and samples again, in the same turn, with the new input. The call returns once it is
  known what became of the batch:

  - :attr:`SteerStatus.STEERED`: Codex took it (its ``userMessage`` item arrived) *and* the
    model worked after it in the same turn (an item or a delta after that item): the running
    turn's result answers it.
  - :attr:`SteerStatus.UNANSWERED`: Codex took it, but the turn ended before the model ran
    again (a steer that lands as the final reply completes: Codex accepts it, emits its
    ``userMessage`` item, then ``turn/completed`` without another model request). Codex holds
    the message in the thread's history, so the next turn's model request carries it: the
    runner must *not* resend it (it may start a turn so the model answers it). It is mirrored
    *after* the turn's reply, which is what happened.
  - :attr:`SteerStatus.QUEUED`: not delivered, run it as the next turn. ``reason``:
    ``"turn_ended"`` (the Codex turn was over, never started, or Codex answered "no active
    turn to steer"), ``"refused"`` (Codex refused the steer otherwise).
  - :attr:`SteerStatus.UNKNOWN` (``reason="timed_out"``): the ``turn/steer`` request got no
    answer in time (Codex stalled) and the turn ended without the message showing up. The
    request named the ended turn (``expectedTurnId``), so Codex cannot put it into a later
    turn; whether it reached the model is unknown (it is not mirrored): the runner decides.
    A timed-out steer whose ``userMessage`` item does show up later in the turn is reconciled
    as above (``STEERED`` or ``UNANSWERED``).
* ``queue``: :attr:`SteerStatus.QUEUED` at once: run it as the next turn
  (``run_codex_turn`` with ``concurrency="wait"`` waits for the running one).
* ``reject``: :attr:`SteerStatus.REJECTED` at once (tell the user the session is busy).
* ``followup``: :attr:`SteerStatus.QUEUED` at once (``reason="followup"``): each message its
  own next turn.
* ``collect``: :attr:`SteerStatus.COLLECTED` at once: the messages that arrive while the turn
  runs are gathered, in arrival order, into ``TurnResult.collected``: run them as one next
  turn. One that arrives once the result is made is queued (``reason="turn_ended"``).

A run that refuses steering holds the session instead of a turn (a compaction,
:func:`refusing_steering`; a review): a ``steer`` message is :attr:`SteerStatus.QUEUED` with
``reason="refuses_steering"``: wait for the run (``run_codex_turn`` with
``concurrency="wait"`` does) and run it next; the other modes keep their fate
(:data:`~codex_turn.fsm.steering.RUN_FATES`).

No turn of the session running in this process: :attr:`SteerStatus.NO_TURN` (start one).
Messages that arrive before the Codex turn started (while the engine assembles) wait for it;
after it ended (while the turn is mirrored and finalized) they are queued.

Who decides: the steering table (:mod:`codex_turn.fsm.steering`, its theory there). This
module sends the ``turn/steer``, fires the past-tense trigger each answer and notification is,
and does what the state the table chose calls for (:data:`_ON_ENTERING`); the runner is told
the table's fate. Codex's answers arrive typed from the client boundary: nothing here reads
their wording.

Each ``STEERED`` batch is an internal transition of the turn machine (``running_turn
--steered--> running_turn``, taken once the model worked after it), and its messages are
mirrored into the transcript in order, after the prompt and before Codex's reply, so the
engine's finalize sees them (the transcript is re-read, or the fallback snapshot carries
them). They are also reported in ``TurnResult.steered`` and, when the turn has an event
stream, as :class:`~codex_turn.harness.turn.streaming.MessagesSteered`. ``UNANSWERED`` messages
take no transition and are not in ``TurnResult.steered``: they are mirrored after the reply
(the user's words are never lost from the transcript) and logged (counts only).

:class:`LiveTurn` is one turn's link to the world while it runs: the steering inbox, the
event stream (:mod:`.streaming`) and the files Codex saved. The orchestrator registers it
for the whole turn (once it holds the session) and the running_turn stage delivers from it,
into a :class:`SteeringHost` (the turn context is one; steering needs only these few things
of it).

Size (~700 lines): the public API (modes, receipts, :func:`steer_codex_turn`), the inbox and
the batch's effects per state stay together: each effect reads the inbox and the live turn
handle, and split apart they would share them through private names.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import Any, Final, Protocol

import anyio
import attrs

from codex_turn._log import format_error, get_logger
from codex_turn.fsm import TraceEntry, TurnTrigger
from codex_turn.fsm.steering import (
    STEER_FATES,
    RunKind,
    SteerBatchModel,
    SteerFate,
    SteerMode,
    SteerState,
    SteerStatus,
    SteerTrigger,
    run_fate,
)
from codex_turn.harness._fs import session_path
from codex_turn.harness.appserver import (
    AppServerError,
    AppServerTimeout,
    CodexTurnResult,
    Notification,
    TextInput,
    TurnHandlePort,
    TurnNotRunning,
)
from codex_turn.harness.appserver.defaults import INTERRUPT_GRACE_S
from codex_turn.harness.hooks import TurnHooks
from codex_turn.harness.session import mirror_prompt
from codex_turn.harness.turn.streaming import (
    MessagesSteered,
    TurnEventStream,
    TurnFile,
    events_of,
    saved_file,
    state_changed,
)
from codex_turn.harness.turn_api import InvalidTurnParams, TurnParams, input_text_problem

__all__ = [
    "MAX_BATCH_INTERVALS",
    "LiveTurn",
    "SteerMode",
    "SteerReceipt",
    "SteerStatus",
    "SteeringHost",
    "codex_turn_running",
    "refusing_steering",
    "steer_codex_turn",
]

_log = get_logger(__name__)


@attrs.frozen(kw_only=True)
class SteerReceipt:
    status: SteerStatus
    #: The Codex turn the message was delivered to (``STEERED``, ``UNANSWERED``).
    turn_id: str | None = None
    #: Why a message in mode ``steer`` was queued instead: ``"turn_ended"`` (the Codex turn
    #: was over, or never started), ``"refused"`` (Codex refused the ``turn/steer``); the
    #: mode itself otherwise (``"queue"``, ``"reject"``); ``"timed_out"`` (``UNKNOWN``).
    reason: str | None = None


#: Unreachable (a refusing run steers nothing): the fate a steer would get after the turn.
_NEVER_STEERED: Final = STEER_FATES[SteerState.QUEUED]


def _receipt(fate: SteerFate, turn_id: str | None = None) -> SteerReceipt:
    return SteerReceipt(status=fate.status, reason=fate.reason, turn_id=turn_id)


class SteeringHost(Protocol):
    """What steering needs of the turn it delivers into (the turn context is one): where
    and under which identities to mirror, where to log, and the turn machine's edges."""

    @property
    def params(self) -> TurnParams: ...

    @property
    def session_file(self) -> str: ...

    @property
    def thread_id(self) -> str | None: ...

    @property
    def prompt_identity(self) -> str: ...

    @property
    def log(self) -> Any: ...

    @property
    def emit(self) -> Callable[[TurnTrigger], None]: ...


@attrs.define(eq=False)
class _Waiting:
    text: str
    arrived_at: float
    done: anyio.Event = attrs.Factory(anyio.Event)
    receipt: SteerReceipt | None = None

    def resolve(self, receipt: SteerReceipt) -> None:
        if self.receipt is None:
            self.receipt = receipt
            self.done.set()


@attrs.frozen
class SteeredMessage:
    """One message delivered to the running turn, as it is mirrored."""

    text: str
    message: dict[str, Any]
    identity: str


@attrs.define(eq=False)
class _Batch:
    """One batch of messages, collected, then sent as one ``turn/steer``; where it is, and so
    what became of it, is its model's state (the steering table's)."""

    fsm: SteerBatchModel = attrs.Factory(SteerBatchModel.begin)
    waiting: list[_Waiting] = attrs.Factory(list)
    arrived: anyio.Event = attrs.Factory(anyio.Event)
    #: Codex's answer: the turn it took the batch into; or its refusal (redacted).
    turn_id: str | None = None
    refusal: str = ""
    #: Its messages as mirrored (``STEERED``, ``UNANSWERED``).
    messages: list[SteeredMessage] = attrs.Factory(list)
    settled: anyio.Event = attrs.Factory(anyio.Event)

    @property
    def texts(self) -> tuple[str, ...]:
        return tuple(w.text for w in self.waiting)

    def closes(self, quiet_interval: float) -> float:
        """When it is sent: the quiet interval after its latest message, or at most
        :data:`MAX_BATCH_INTERVALS` of them after its first (steady arrivals still go out)."""
        first, last = self.waiting[0].arrived_at, self.waiting[-1].arrived_at
        return min(last + quiet_interval, first + MAX_BATCH_INTERVALS * quiet_interval)

    def is_shown_by(self, texts: tuple[str, ...]) -> bool:
        """Whether a ``userMessage`` item with ``texts`` is this batch's."""
        return texts == self.texts or "\n".join(texts) == "\n".join(self.texts)


#: With steady arrivals a batch still closes this many quiet intervals after its first message.
MAX_BATCH_INTERVALS: Final = 4

#: The running turns of this process, by session key (:func:`~._fs.session_path`).
_running: dict[str, LiveTurn] = {}
#: The runs of this process that hold a session and refuse steering, by session key.
_refusing: dict[str, RunKind] = {}


@contextlib.contextmanager
def refusing_steering(session_file: str | os.PathLike[str], kind: RunKind) -> Iterator[None]:
    """For the block, a run of ``kind`` that refuses steering holds the session: messages for
    it wait and run next (:data:`~codex_turn.fsm.steering.RUN_FATES`)."""
    key = session_path(session_file)
    _refusing[key] = kind
    try:
        yield
    finally:
        if _refusing.get(key) is kind:
            del _refusing[key]


_ITEM_EVENTS: Final = ("item/started", "item/completed")


def _user_texts(item: Mapping[str, Any]) -> tuple[str, ...]:
    content = item.get("content")
    if not isinstance(content, list):
        return ()
    return tuple(
        part["text"]
        for part in content
        if isinstance(part, Mapping)
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
    )


def _is_model_activity(note: Notification) -> bool:
    """An item or a delta of the model's (not a user message, not a token count)."""
    if note.method in _ITEM_EVENTS:
        return note.item is not None and note.item.get("type") != "userMessage"
    return note.method.startswith("item/") and note.method.endswith("elta")


class LiveTurn:
    """One turn while it runs: its steering inbox, event stream and saved files."""

    def __init__(
        self,
        *,
        mode: SteerMode | str = SteerMode.STEER,
        quiet_interval: float = 0.25,
        events: TurnEventStream | None = None,
    ) -> None:
        self.mode = SteerMode(mode)
        self.quiet_interval = quiet_interval
        self.events = events
        if events is not None:
            events._claim()
        self.files: list[TurnFile] = []
        #: Messages the turn answered (``STEERED``), in order.
        self.steered: list[SteeredMessage] = []
        #: Messages Codex took but the turn ended before answering (``UNANSWERED``).
        self.unanswered: list[SteeredMessage] = []
        #: How many messages went out in a steer whose fate stayed unknown (``UNKNOWN``): the
        #: thread may hold them although nothing mirrored them.
        self.unconfirmed = 0
        #: Messages collected for one next turn (mode ``collect``), in arrival order; ``None``
        #: once the turn's result took them.
        self._collected: list[str] | None = []
        #: The batch messages join; once steering ended, the last one (``queued``), whose
        #: fate a later message gets.
        self._open = _Batch()
        self._sent: list[_Batch] = []  # sent, their fate not known yet (in send order)
        self._host: SteeringHost | None = None
        self._log: Any = _log
        #: Starts the delivery task on the first arrival while the Codex turn runs (most
        #: turns get no message: they pay for no task); ``None`` outside ``delivering``.
        self._start_delivery: Callable[[], None] | None = None
        self._user_items: set[str] = set()
        self._numbered = 0
        self._turn_id: str | None = None

    # -- the turn's side ---------------------------------------------------------------------

    @contextlib.contextmanager
    def serving(self, session_file: str) -> Iterator[None]:
        """Registered as the session's running turn for the block (the caller holds the
        session, so there is one per session); at its end, steering ends."""
        key = session_path(session_file)
        _running[key] = self
        try:
            yield
        finally:
            if _running.get(key) is self:
                del _running[key]
            self._end()

    @contextlib.contextmanager
    def ending(self) -> Iterator[None]:
        """The whole call: at its end, however it ends (refused before the session was
        held, too), steering ends and the event stream closes."""
        try:
            yield
        finally:
            self._end()
            if self.events is not None:
                self.events.close()

    def observe(self, hooks: TurnHooks) -> TurnHooks:
        """``hooks`` with the event stream watching every step of the turn machine."""
        events = self.events
        if events is None:
            return hooks
        host = hooks.on_transition

        def on_transition(entry: TraceEntry) -> None:
            events.publish(state_changed(entry))
            if host is not None:
                host(entry)

        return attrs.evolve(hooks, on_transition=on_transition)

    def on_notification(self, note: Notification) -> None:
        """One Codex notification of the running turn: its events, any file it saved, and
        what it tells of the steers sent (their ``userMessage`` items, the model's work)."""
        if note.method == "item/completed" and note.item is not None:
            file = saved_file(note.item)
            if file is not None:
                self.files.append(file)
        if self.events is not None:
            for pending in events_of(note):
                self.events.publish(pending)
        self._track(note)

    def _track(self, note: Notification) -> None:
        if note.turn_id:
            self._turn_id = note.turn_id
        texts = self._steered_texts(note)
        if texts is not None:
            self._land(texts)
        elif _is_model_activity(note):
            self._offer(SteerTrigger.MODEL_WORKED, self._sent)
        elif note.method == "turn/completed":
            self._offer(SteerTrigger.TURN_COMPLETED, self._sent)

    def _steered_texts(self, note: Notification) -> tuple[str, ...] | None:
        """The texts of a ``userMessage`` item seen for the first time, except the turn's
        own input (the prompt, which comes first); ``None`` for anything else."""
        item = note.item
        if note.method not in _ITEM_EVENTS or item is None or item.get("type") != "userMessage":
            return None
        item_id = str(item.get("id") or "")
        if item_id in self._user_items:
            return None
        prompt = not self._user_items
        self._user_items.add(item_id)
        return None if prompt else _user_texts(item)

    def _land(self, texts: tuple[str, ...]) -> None:
        """The first sent batch that ``texts`` shows and that can land, lands."""
        for batch in self._sent:
            if batch.is_shown_by(texts) and batch.fsm.allows(SteerTrigger.LANDED):
                self._fire(batch, SteerTrigger.LANDED)
                return

    def _offer(self, trigger: SteerTrigger, batches: Iterable[_Batch]) -> None:
        """``trigger`` for every batch whose state takes it (the table says which)."""
        for batch in list(batches):
            if batch.fsm.allows(trigger):
                self._fire(batch, trigger)

    def _fire(self, batch: _Batch, trigger: SteerTrigger) -> None:
        """Step ``batch`` by the table, then do what the state it chose calls for
        (synchronously: a fate is told while the turn is still in running_turn)."""
        batch.fsm.fire(trigger)
        _ON_ENTERING[batch.fsm.state](self, batch)

    # What entering a state does (:data:`_ON_ENTERING`). The final states tell the waiting
    # callers their fate; the sent ones leave ``_sent``.

    def _nothing(self, batch: _Batch) -> None:
        """A state that only waits for what happens next."""

    def _timed_out(self, batch: _Batch) -> None:
        self._log.warning(
            "codex turn steer timed out; waiting for the turn to show it",
            messages=len(batch.waiting),
        )

    def _steered(self, batch: _Batch) -> None:
        first = self._number(batch)
        self.steered.extend(batch.messages)
        self._the_host().emit(TurnTrigger.STEERED)
        self._log.info("codex turn steered", messages=len(batch.waiting), batch=first)
        turn_id = self._delivered_to(batch)
        if self.events is not None:
            steered_into, said = turn_id or "", batch.texts
            self.events.publish(
                lambda seq, ns: MessagesSteered(
                    seq=seq, monotonic_ns=ns, turn_id=steered_into, texts=said
                )
            )
        self._settle(batch, turn_id)

    def _unanswered(self, batch: _Batch) -> None:
        self._number(batch)
        self.unanswered.extend(batch.messages)
        self._log.info(
            "codex turn steer taken but the turn ended before the model answered it;"
            " codex carries it into the next turn",
            messages=len(batch.waiting),
        )
        self._settle(batch, self._delivered_to(batch))

    def _unknown(self, batch: _Batch) -> None:
        self.unconfirmed += len(batch.waiting)
        self._log.warning(
            "codex turn steer unconfirmed; the turn ended without it",
            messages=len(batch.waiting),
        )
        self._settle(batch)

    def _too_late(self, batch: _Batch) -> None:
        self._log.info("codex turn steer too late; messages queued", messages=len(batch.waiting))
        self._settle(batch)

    def _refused(self, batch: _Batch) -> None:
        self._log.warning(
            "codex turn steer not delivered; messages queued",
            messages=len(batch.waiting),
            error=batch.refusal,
        )
        self._settle(batch)

    def _queued(self, batch: _Batch) -> None:
        """Steering ended while the batch collected: it was never sent."""
        self._tell(batch)

    def _settle(self, batch: _Batch, turn_id: str | None = None) -> None:
        self._sent.remove(batch)
        self._tell(batch, turn_id)

    def _tell(self, batch: _Batch, turn_id: str | None = None) -> None:
        """Every message of ``batch`` gets the fate of its final state."""
        receipt = _receipt(STEER_FATES[batch.fsm.state], turn_id)
        for waiting in batch.waiting:
            waiting.resolve(receipt)
        batch.settled.set()

    def _delivered_to(self, batch: _Batch) -> str | None:
        return batch.turn_id or self._turn_id

    def _number(self, batch: _Batch) -> int:
        """Give ``batch``'s messages their transcript form and identities; the first's index."""
        now = int(time.time() * 1000)
        base = self._the_host().prompt_identity.removesuffix(":prompt")
        first = self._numbered
        self._numbered += len(batch.waiting)
        batch.messages = [
            SteeredMessage(
                text=text,
                message={"role": "user", "content": text, "timestamp": now},
                identity=f"{base}:steer-{first + i}",
            )
            for i, text in enumerate(batch.texts)
        ]
        return first

    def _the_host(self) -> SteeringHost:
        host = self._host
        assert host is not None, "batches are sent only while delivering"
        return host

    def with_steered(self, codex: CodexTurnResult) -> CodexTurnResult:
        """Codex's result with the steered messages after the prompt, in order, and those the
        turn ended before answering after the reply (mirrored under their own identities, so
        a durable copy made during the turn is not doubled)."""
        if not (self.steered or self.unanswered) or not codex.messages_snapshot:
            return codex
        snapshot, identities = codex.messages_snapshot, codex.mirror_identities
        return attrs.evolve(
            codex,
            messages_snapshot=[
                snapshot[0],
                *(s.message for s in self.steered),
                *snapshot[1:],
                *(s.message for s in self.unanswered),
            ],
            mirror_identities=[
                identities[0],
                *(s.identity for s in self.steered),
                *identities[1:],
                *(s.identity for s in self.unanswered),
            ],
        )

    @contextlib.asynccontextmanager
    async def delivering(self, host: SteeringHost, handle: TurnHandlePort) -> AsyncIterator[None]:
        """While the block runs (the Codex turn), deliver what arrives into ``host``'s turn;
        after it, steering ends."""
        self._host, self._log = host, host.log
        try:
            async with anyio.create_task_group() as group:

                def start_delivery() -> None:
                    self._start_delivery = None  # once
                    group.start_soon(self._deliver, host, handle)

                self._start_delivery = start_delivery
                if self._open.waiting:  # arrived before the Codex turn started
                    start_delivery()
                try:
                    yield
                finally:
                    self._start_delivery = None
                    group.cancel_scope.cancel()
        except BaseExceptionGroup as grouped:
            # The delivery task never raises: a lone error is the block's own.
            if len(grouped.exceptions) == 1:
                raise grouped.exceptions[0] from None
            raise
        finally:
            self._end()

    async def _deliver(self, host: SteeringHost, handle: TurnHandlePort) -> None:
        async with anyio.create_task_group() as mirrors:
            while True:
                batch = self._open
                await batch.arrived.wait()
                while (left := batch.closes(self.quiet_interval) - anyio.current_time()) > 0:  # noqa: ASYNC110
                    await anyio.sleep(left)
                self._open = _Batch()
                self._fire(batch, SteerTrigger.BATCH_CLOSED)
                if await self._steer(handle, batch):
                    mirrors.start_soon(self._mirror_when_answered, host, batch)

    async def _steer(self, handle: TurnHandlePort, batch: _Batch) -> bool:
        """Send ``batch`` as one ``turn/steer`` and fire Codex's answer; whether its fate is
        still open (the turn's notifications will tell)."""
        # Sent before the request: its userMessage item may arrive before Codex's answer.
        self._sent.append(batch)
        answer = SteerTrigger.TIMED_OUT  # unless Codex answers in time
        # A steer sent is a steer answered: the end of the Codex turn does not cut it in half.
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + 2 * INTERRUPT_GRACE_S
            try:
                batch.turn_id = await handle.steer([TextInput(t) for t in batch.texts])
                answer = SteerTrigger.ACCEPTED
            except AppServerTimeout:
                pass
            except TurnNotRunning:
                answer = SteerTrigger.ARRIVED_TOO_LATE
            except AppServerError as refused:
                batch.refusal, answer = format_error(refused), SteerTrigger.REFUSED
        if batch.fsm.allows(answer):  # else the turn's notifications settled it already
            self._fire(batch, answer)
        return not batch.fsm.is_terminal

    async def _mirror_when_answered(self, host: SteeringHost, batch: _Batch) -> None:
        """Once the model answered ``batch``, mirror it at once (the turn's mirror would
        write it at its end; a host that dies meanwhile keeps it). A failure here is only
        logged: the turn's mirror retries."""
        await batch.settled.wait()
        if batch.fsm.state is not SteerState.STEERED:
            return
        try:
            await anyio.to_thread.run_sync(_mirror_steered, host, batch.messages)
        except Exception as failed:
            host.log.warning("failed to mirror steered messages early", error=format_error(failed))

    def _end(self) -> None:
        """No more steering (idempotent): the table decides the fate of every batch still
        open, the sent ones first, then the collecting one (and so of any later message)."""
        self._offer(SteerTrigger.STEERING_ENDED, [*self._sent, self._open])

    # -- the runner's side -------------------------------------------------------------------

    def take_collected(self) -> tuple[str, ...]:
        """The messages collected for one next turn; later ones are queued instead."""
        collected, self._collected = self._collected or [], None
        return tuple(collected)

    async def submit(self, text: str, mode: SteerMode) -> SteerReceipt:
        fate = run_fate(RunKind.TURN, mode)
        if fate is not None and fate.status is SteerStatus.COLLECTED:
            if self._collected is None:  # the result is made: it runs next on its own
                return _receipt(STEER_FATES[SteerState.QUEUED])
            self._collected.append(text)
        if fate is not None:  # decided at once, whatever the turn does
            return _receipt(fate)
        batch = self._open
        if not batch.fsm.allows(SteerTrigger.MESSAGE_ARRIVED):  # steering ended
            return _receipt(STEER_FATES[batch.fsm.state])
        waiting = _Waiting(text, arrived_at=anyio.current_time())
        self._fire(batch, SteerTrigger.MESSAGE_ARRIVED)
        batch.waiting.append(waiting)
        batch.arrived.set()
        if self._start_delivery is not None:
            self._start_delivery()
        await waiting.done.wait()
        assert waiting.receipt is not None
        return waiting.receipt


#: What steering does as a batch enters each state of the steering table.
_ON_ENTERING: Final[Mapping[SteerState, Callable[[LiveTurn, _Batch], None]]] = {
    SteerState.COLLECTING: LiveTurn._nothing,
    SteerState.SENT: LiveTurn._nothing,
    SteerState.LANDED_EARLY: LiveTurn._nothing,
    SteerState.ACCEPTED: LiveTurn._nothing,
    SteerState.TIMED_OUT: LiveTurn._timed_out,
    SteerState.LANDED: LiveTurn._nothing,
    SteerState.STEERED: LiveTurn._steered,
    SteerState.UNANSWERED: LiveTurn._unanswered,
    SteerState.QUEUED: LiveTurn._queued,
    SteerState.TOO_LATE: LiveTurn._too_late,
    SteerState.REFUSED: LiveTurn._refused,
    SteerState.UNKNOWN: LiveTurn._unknown,
}


def _mirror_steered(host: SteeringHost, delivered: list[SteeredMessage]) -> None:
    scope = f"codex-app-server:{host.thread_id or ''}"
    for steered in delivered:
        mirror_prompt(
            host.session_file,
            steered.message,
            scope=scope,
            identity=steered.identity,
            session_id=host.params.session_id,
            cwd=os.fspath(host.params.workspace_dir),
        )


def codex_turn_running(session_file: str | os.PathLike[str]) -> bool:
    """Whether a turn of this session runs in this process now."""
    return session_path(session_file) in _running


async def steer_codex_turn(
    session_file: str | os.PathLike[str],
    text: str,
    *,
    mode: SteerMode | str | None = None,
) -> SteerReceipt:
    """Hand a message for ``session_file`` to the turn running it (see the module docstring).

    ``mode``: the running turn's ``TurnParams.steering`` when ``None``. Returns at once unless
    the message is being steered; then once it was delivered (or queued instead). Raises
    :class:`~codex_turn.InvalidTurnParams` (a ``ValueError``), before anything is sent, for a
    text that could not be a prompt (empty, too long, holding a lone surrogate: the one check
    of a turn's input text, :func:`~codex_turn.harness.turn_api.input_text_problem`) and for
    an unknown mode.
    """
    if (problem := input_text_problem(text)) is not None:
        raise InvalidTurnParams(f"a steered message's text {problem}")
    allowed = [m.value for m in SteerMode]
    if mode is not None and not (isinstance(mode, str) and mode in allowed):
        got = repr(mode[:40]) if isinstance(mode, str) else type(mode).__name__
        raise InvalidTurnParams(f"steering mode must be one of {allowed} (got {got})")
    chosen = SteerMode(mode) if mode is not None else None
    key = session_path(session_file)
    live = _running.get(key)
    if live is None:
        refusing = _refusing.get(key)
        if refusing is not None:  # a run that refuses steering holds the session
            return _receipt(run_fate(refusing, chosen or SteerMode.STEER) or _NEVER_STEERED)
        return SteerReceipt(status=SteerStatus.NO_TURN)
    return await live.submit(text, chosen or live.mode)
