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

No turn of the session running in this process: :attr:`SteerStatus.NO_TURN` (start one).
Messages that arrive before the Codex turn started (while the engine assembles) wait for it;
after it ended (while the turn is mirrored and finalized) they are queued.

Each ``STEERED`` batch is an internal transition of the turn machine (``running_turn
--steered--> running_turn``, taken once the model worked after it), and its messages are
mirrored into the transcript in order, after the prompt and before Codex's reply, so the
engine's finalize sees them (the transcript is re-read, or the fallback snapshot carries
them). They are also reported in ``TurnResult.steered`` and, when the turn has an event
stream, as :class:`~codex_turn.harness.streaming.MessagesSteered`. ``UNANSWERED`` messages
take no transition and are not in ``TurnResult.steered``: they are mirrored after the reply
(the user's words are never lost from the transcript) and logged (counts only).

:class:`LiveTurn` is one turn's link to the world while it runs: the steering inbox, the
event stream (:mod:`.streaming`) and the files Codex saved. The orchestrator registers it
for the whole turn (once it holds the session) and the running_turn stage delivers from it.

Size (~605 lines): the inbox, the delivery task and the reconciliation of each steer with
Codex's notifications share :class:`LiveTurn`'s state; the receipt types could move out.
"""

from __future__ import annotations

import contextlib
import enum
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

import anyio
import attrs

from codex_turn._log import format_error, get_logger
from codex_turn.fsm import TraceEntry, TurnTrigger
from codex_turn.harness._fs import session_path
from codex_turn.harness.appserver import (
    AppServerError,
    AppServerRpcError,
    AppServerTimeout,
    CodexTurnResult,
    Notification,
    TextInput,
    TurnHandlePort,
)
from codex_turn.harness.appserver.defaults import INTERRUPT_GRACE_S
from codex_turn.harness.hooks import TurnHooks
from codex_turn.harness.session import mirror_prompt
from codex_turn.harness.streaming import (
    MessagesSteered,
    TurnEventStream,
    TurnFile,
    events_of,
    saved_file,
    state_changed,
)

if TYPE_CHECKING:
    from codex_turn.harness.turn_context import TurnContext

__all__ = [
    "MAX_BATCH_INTERVALS",
    "LiveTurn",
    "SteerMode",
    "SteerReceipt",
    "SteerStatus",
    "codex_turn_running",
    "steer_codex_turn",
]

_log = get_logger(__name__)


class SteerMode(enum.StrEnum):
    """What a message for a session whose turn runs becomes (``TurnParams.steering``)."""

    STEER = "steer"
    QUEUE = "queue"
    REJECT = "reject"


class SteerStatus(enum.StrEnum):
    """What became of one message handed to :func:`steer_codex_turn`."""

    #: Delivered to the running Codex turn (``turn/steer``), and the model worked after it in
    #: that turn: the turn's result answers it.
    STEERED = "steered"
    #: Codex took it into the turn, but the turn ended before the model ran again: Codex holds
    #: it in the thread (the next turn's model request carries it); do not resend it.
    UNANSWERED = "unanswered"
    #: Not delivered: run it as the next turn (``SteerReceipt.reason`` says why).
    QUEUED = "queued"
    #: The ``turn/steer`` request timed out and the turn ended without it showing up: whether
    #: the model saw it is unknown (``reason="timed_out"``); it is not mirrored.
    UNKNOWN = "unknown"
    #: The running turn refuses messages (mode ``reject``).
    REJECTED = "rejected"
    #: No turn of this session runs in this process: start one.
    NO_TURN = "no_turn"


@attrs.frozen(kw_only=True)
class SteerReceipt:
    status: SteerStatus
    #: The Codex turn the message was delivered to (``STEERED``, ``UNANSWERED``).
    turn_id: str | None = None
    #: Why a message in mode ``steer`` was queued instead: ``"turn_ended"`` (the Codex turn
    #: was over, or never started), ``"refused"`` (Codex refused the ``turn/steer``); the
    #: mode itself otherwise (``"queue"``, ``"reject"``); ``"timed_out"`` (``UNKNOWN``).
    reason: str | None = None


@attrs.define(eq=False)
class _Waiting:
    text: str
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
    """One ``turn/steer`` sent, until it is known what became of it."""

    waiting: list[_Waiting]
    texts: tuple[str, ...]
    #: Codex answered the request (with this turn id).
    accepted: str | None = None
    #: The request got no answer in time: reconciled by the turn's ``userMessage`` items.
    timed_out: bool = False
    #: Its ``userMessage`` item arrived.
    landed: bool = False
    #: ``STEERED`` or ``UNANSWERED`` once known; its messages as mirrored.
    status: SteerStatus | None = None
    messages: list[SteeredMessage] = attrs.Factory(list)
    settled: anyio.Event = attrs.Factory(anyio.Event)


#: With steady arrivals a batch still closes this many quiet intervals after its first message.
MAX_BATCH_INTERVALS: Final = 4

#: Codex's answer to a ``turn/steer`` once the turn is over.
_NO_ACTIVE_TURN: Final = "no active turn"

#: The running turns of this process, by session key (:func:`~._fs.session_path`).
_running: dict[str, LiveTurn] = {}


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
    if note.method in ("item/started", "item/completed"):
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
        self._waiting: list[_Waiting] = []
        self._arrived = anyio.Event()
        self._first_arrival = 0.0
        self._last_arrival = 0.0
        self._over = False  # the Codex turn ended (or the whole turn did): no more steering
        self._ctx: TurnContext | None = None
        #: Starts the delivery task on the first arrival while the Codex turn runs (most
        #: turns get no message: they pay for no task); ``None`` outside ``delivering``.
        self._start_delivery: Callable[[], None] | None = None
        self._sent: list[_Batch] = []  # steers sent whose fate is not known yet
        self._user_items: set[str] = set()
        self._numbered = 0
        self._turn_id: str | None = None

    # -- the turn's side ---------------------------------------------------------------------

    @contextlib.contextmanager
    def serving(self, session_file: str) -> Iterator[None]:
        """Registered as the session's running turn for the block (the caller holds the
        session, so there is one per session); at its end, what waits is queued."""
        key = session_path(session_file)
        _running[key] = self
        try:
            yield
        finally:
            if _running.get(key) is self:
                del _running[key]
            self._end("turn_ended")

    @contextlib.contextmanager
    def ending(self) -> Iterator[None]:
        """The whole call: at its end, however it ends (refused before the session was
        held, too), nothing waits and the event stream closes."""
        try:
            yield
        finally:
            self._end("turn_ended")
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
        what became of the steers sent (their ``userMessage`` items, the model's work after)."""
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
        item = note.item
        if (
            note.method in ("item/started", "item/completed")
            and item is not None
            and item.get("type") == "userMessage"
        ):
            item_id = str(item.get("id") or "")
            if item_id in self._user_items:
                return
            first = not self._user_items
            self._user_items.add(item_id)
            if first:
                return  # the turn's own input (the prompt) comes first
            texts = _user_texts(item)
            for batch in self._sent:
                if not batch.landed and (
                    texts == batch.texts or "\n".join(texts) == "\n".join(batch.texts)
                ):
                    batch.landed = True
                    break
        elif _is_model_activity(note):
            for batch in [b for b in self._sent if b.landed]:
                self._settle(batch, SteerStatus.STEERED)
        elif note.method == "turn/completed":
            for batch in [b for b in self._sent if b.landed]:
                self._settle(batch, SteerStatus.UNANSWERED)

    def _settle(self, batch: _Batch, status: SteerStatus) -> None:
        """What became of ``batch`` is known: record, step, tell (synchronously, while the
        turn is still in running_turn)."""
        if batch.status is not None:
            return
        if batch in self._sent:
            self._sent.remove(batch)
        ctx = self._ctx
        turn_id = batch.accepted or self._turn_id
        if status is SteerStatus.UNKNOWN:
            self.unconfirmed += len(batch.texts)
            if ctx is not None:
                ctx.log.warning(
                    "codex turn steer unconfirmed; the turn ended without it",
                    messages=len(batch.texts),
                )
            batch.status = status
            for waiting in batch.waiting:
                waiting.resolve(SteerReceipt(status=status, reason="timed_out"))
            batch.settled.set()
            return
        now = int(time.time() * 1000)
        base = (ctx.prompt_identity if ctx is not None else "run:prompt").removesuffix(":prompt")
        first = self._numbered
        self._numbered += len(batch.texts)
        batch.messages = [
            SteeredMessage(
                text=text,
                message={"role": "user", "content": text, "timestamp": now},
                identity=f"{base}:steer-{first + i}",
            )
            for i, text in enumerate(batch.texts)
        ]
        batch.status = status
        if status is SteerStatus.STEERED:
            self.steered.extend(batch.messages)
            if ctx is not None:
                ctx.emit(TurnTrigger.STEERED)
                ctx.log.info("codex turn steered", messages=len(batch.texts), batch=first)
            if self.events is not None:
                steered_into, said = turn_id or "", batch.texts
                self.events.publish(
                    lambda seq, ns: MessagesSteered(
                        seq=seq, monotonic_ns=ns, turn_id=steered_into, texts=said
                    )
                )
        else:
            self.unanswered.extend(batch.messages)
            if ctx is not None:
                ctx.log.info(
                    "codex turn steer taken but the turn ended before the model answered it;"
                    " codex carries it into the next turn",
                    messages=len(batch.texts),
                )
        for waiting in batch.waiting:
            waiting.resolve(SteerReceipt(status=status, turn_id=turn_id))
        batch.settled.set()

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
    async def delivering(self, ctx: TurnContext, handle: TurnHandlePort) -> AsyncIterator[None]:
        """While the block runs (the Codex turn), deliver what arrives; after it, queue."""
        self._ctx = ctx
        try:
            async with anyio.create_task_group() as group:

                def start_delivery() -> None:
                    self._start_delivery = None  # once
                    group.start_soon(self._deliver, ctx, handle)

                self._start_delivery = start_delivery
                if self._waiting:  # arrived before the Codex turn started
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
            self._end("turn_ended")

    async def _deliver(self, ctx: TurnContext, handle: TurnHandlePort) -> None:
        async with anyio.create_task_group() as mirrors:
            while True:
                await self._arrived.wait()
                # The batch closes once the quiet interval passed since the latest arrival, or
                # MAX_BATCH_INTERVALS of them since its first (steady arrivals still go out).
                while (left := self._batch_closes() - anyio.current_time()) > 0:  # noqa: ASYNC110
                    await anyio.sleep(left)
                batch, self._waiting = self._waiting, []
                self._arrived = anyio.Event()
                if batch:
                    sent = await self._steer(ctx, handle, batch)
                    if sent is not None:
                        mirrors.start_soon(self._mirror_when_answered, ctx, sent)

    def _batch_closes(self) -> float:
        cap = self._first_arrival + MAX_BATCH_INTERVALS * self.quiet_interval
        return min(self._last_arrival + self.quiet_interval, cap)

    async def _steer(
        self, ctx: TurnContext, handle: TurnHandlePort, waiting: list[_Waiting]
    ) -> _Batch | None:
        batch = _Batch(waiting=waiting, texts=tuple(w.text for w in waiting))
        # Sent before the request: its userMessage item may arrive before Codex's answer.
        self._sent.append(batch)
        turn_id: str | None = None
        error: AppServerError | None = None
        # A steer sent is a steer answered: the end of the Codex turn does not cut it in half.
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + 2 * INTERRUPT_GRACE_S
            try:
                turn_id = await handle.steer([TextInput(t) for t in batch.texts])
            except AppServerTimeout:
                pass
            except AppServerError as refused:
                error = refused
        if batch.status is not None:
            return None  # settled by the turn's notifications already
        if turn_id is not None:
            batch.accepted = turn_id
            return batch
        if error is None:
            # No answer in time: Codex may still apply it. Its userMessage item tells.
            batch.timed_out = True
            ctx.log.warning(
                "codex turn steer timed out; waiting for the turn to show it",
                messages=len(batch.texts),
            )
            return batch
        self._sent.remove(batch)
        ended = (
            self._over
            or _NO_ACTIVE_TURN in error.message
            or (
                not isinstance(error, AppServerRpcError)
                and "cannot steer a turn that is" in error.message
            )
        )
        if ended:
            ctx.log.info("codex turn steer too late; messages queued", messages=len(batch.texts))
        else:
            ctx.log.warning(
                "codex turn steer not delivered; messages queued",
                messages=len(batch.texts),
                error=format_error(error),
            )
        for w in waiting:
            w.resolve(
                SteerReceipt(status=SteerStatus.QUEUED, reason="turn_ended" if ended else "refused")
            )
        return None

    async def _mirror_when_answered(self, ctx: TurnContext, batch: _Batch) -> None:
        """Once the model answered ``batch``, mirror it at once (the turn's mirror would
        write it at its end; a host that dies meanwhile keeps it). A failure here is only
        logged: the turn's mirror retries."""
        await batch.settled.wait()
        if batch.status is not SteerStatus.STEERED:
            return
        try:
            await anyio.to_thread.run_sync(_mirror_steered, ctx, batch.messages)
        except Exception as failed:
            ctx.log.warning("failed to mirror steered messages early", error=format_error(failed))

    def _end(self, reason: str) -> None:
        """No more steering: whatever waits is queued, whatever Codex took but the turn did
        not answer is ``UNANSWERED``, a timed-out steer that never showed up ``UNKNOWN``
        (idempotent)."""
        self._over = True
        for batch in list(self._sent):
            if batch.landed or batch.accepted is not None:
                self._settle(batch, SteerStatus.UNANSWERED)
            else:
                self._settle(batch, SteerStatus.UNKNOWN)
        waiting, self._waiting = self._waiting, []
        for w in waiting:
            w.resolve(SteerReceipt(status=SteerStatus.QUEUED, reason=reason))

    # -- the runner's side -------------------------------------------------------------------

    async def submit(self, text: str, mode: SteerMode) -> SteerReceipt:
        if mode is SteerMode.REJECT:
            return SteerReceipt(status=SteerStatus.REJECTED, reason="reject")
        if mode is SteerMode.QUEUE:
            return SteerReceipt(status=SteerStatus.QUEUED, reason="queue")
        if self._over:
            return SteerReceipt(status=SteerStatus.QUEUED, reason="turn_ended")
        waiting = _Waiting(text)
        if not self._waiting:
            self._first_arrival = anyio.current_time()
        self._waiting.append(waiting)
        self._last_arrival = anyio.current_time()
        self._arrived.set()
        if self._start_delivery is not None:
            self._start_delivery()
        await waiting.done.wait()
        assert waiting.receipt is not None
        return waiting.receipt


def _mirror_steered(ctx: TurnContext, delivered: list[SteeredMessage]) -> None:
    scope = f"codex-app-server:{ctx.thread_id or ''}"
    for steered in delivered:
        mirror_prompt(
            ctx.session_file,
            steered.message,
            scope=scope,
            identity=steered.identity,
            session_id=ctx.params.session_id,
            cwd=os.fspath(ctx.params.workspace_dir),
        )


#: Codex's bound on one turn input's text (``TURN_START_TEXT_MAX_CHARS``).
_MAX_TEXT: Final = 1 << 20


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
    ``ValueError`` for an empty text or an unknown mode.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("a steered message needs text")
    if len(text) > _MAX_TEXT:
        raise ValueError(f"a steered message is at most {_MAX_TEXT} characters")
    chosen = SteerMode(mode) if mode is not None else None
    live = _running.get(session_path(session_file))
    if live is None:
        return SteerReceipt(status=SteerStatus.NO_TURN)
    return await live.submit(text, chosen or live.mode)
