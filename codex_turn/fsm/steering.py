"""The steering machine: what becomes of one batch of messages steered into a running turn.

Rule 1: every decision about a batch's fate lives here, in ``STEERING_TABLE`` (where a batch
goes on what happened) and :data:`STEER_FATES` (what each final state tells the runner).
:mod:`codex_turn.harness.turn.steering` sends the ``turn/steer``, reads Codex's notifications and
fires the past-tense trigger that describes what happened; it asks the table (``allows``, the
state), never its own flags. Rule 2: no I/O, nothing of Codex's wording: the client boundary
types Codex's answers (:class:`~codex_turn.harness.appserver.TurnNotRunning`), the harness
turns them into triggers.

Theory of operation. Messages that arrive while a turn runs join the *collecting* batch
(``message_arrived``, in arrival order) until the quiet interval passes (``batch_closed``);
the batch is then sent as one ``turn/steer`` and a new batch collects. Two things tell what
became of a sent batch, in either order: Codex's answer to the request and the batch's own
``userMessage`` item in the turn (``landed``). Codex 0.163 answers at once, but the item can
arrive first (``landed_early``), and a stalled Codex may not answer in time (``timed_out``)
yet apply the steer later:

    collecting --batch_closed--> sent --accepted--> accepted --landed--> landed
        --model_worked--> steered

* The model worked after the item (an item or a delta of its own): ``steered``, the running
  turn's result answers the messages (the turn machine's internal ``steered`` edge).
* The item landed but the turn completed before the model ran again (a steer that lands as
  the final reply completes): ``unanswered``. Codex holds the messages in the thread, the
  next turn carries them: the runner must not resend them. So does a batch Codex accepted
  whose item never showed before steering ended: Codex took it.
* Codex said the turn is not running (``arrived_too_late``): ``too_late``, queued for the
  next turn; any other refusal: ``refused``, queued too.
* Steering ends (the Codex turn, or the whole turn, is over: ``steering_ended``) and decides
  every batch still open: a collecting one is ``queued`` (it was never sent), a sent one
  whose request got no answer and whose item never showed is ``unknown`` (the request named
  the ended turn, so Codex cannot put it into a later one; whether the model saw it is not
  known: the runner decides).

Queue modes (:data:`MODE_FATES`, then :data:`RUN_FATES`). Only ``steer`` hands a message to
a batch; every other mode decides at once: ``queue`` and ``followup`` queue it (each message
its own next turn), ``collect`` gathers it with the others that arrive while the turn runs
into one next turn (``TurnResult.collected``), ``reject`` refuses it. A run that refuses
steering (a review, a compaction: :class:`RunKind`) turns ``steer`` into "wait for the run,
then run the message next" (``queued``, reason ``refuses_steering``); the other modes keep
their fate.

A batch in a final state is over: it never moves again, and the runner's receipt is
:data:`STEER_FATES` of that state. Once steering ended, the last collecting batch stays in
``queued``: a message that arrives later is refused by the table (``message_arrived`` is not
legal there) and gets that batch's fate.

WARNING: ``diagrams/steering.mmd`` is rendered from this table; a test fails when stale.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

import attrs

from codex_turn.fsm._machine import Edge, Model, TableMachine

__all__ = [
    "MODE_FATES",
    "RUN_FATES",
    "STEERING_TABLE",
    "STEER_FATES",
    "RunKind",
    "SteerBatchModel",
    "SteerFate",
    "SteerMode",
    "SteerState",
    "SteerStatus",
    "SteerTrigger",
    "run_fate",
]


class SteerMode(enum.StrEnum):
    """What a message for a session whose turn runs becomes (``TurnParams.steering``)."""

    STEER = "steer"
    QUEUE = "queue"
    REJECT = "reject"
    #: Queued: each message its own next turn.
    FOLLOWUP = "followup"
    #: Collected: the messages that arrive while the turn runs, one next turn.
    COLLECT = "collect"


class RunKind(enum.StrEnum):
    """What holds the session while a message arrives: a turn takes steering, a review or a
    compaction refuses it (the message waits for it and runs next)."""

    TURN = "turn"
    REVIEW = "review"
    COMPACTION = "compaction"


class SteerStatus(enum.StrEnum):
    """What became of one message handed to :func:`~codex_turn.steer_codex_turn`."""

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
    #: Gathered with the other messages that arrive while the turn runs (mode ``collect``):
    #: run them as one next turn (``TurnResult.collected``, in arrival order).
    COLLECTED = "collected"
    #: No turn of this session runs in this process: start one.
    NO_TURN = "no_turn"


class SteerState(enum.Enum):
    #: Messages join it until the quiet interval passes.
    COLLECTING = "collecting"
    #: ``turn/steer`` sent: no answer yet, no item yet.
    SENT = "sent"
    #: Its ``userMessage`` item arrived before Codex answered the request.
    LANDED_EARLY = "landed_early"
    #: Codex answered the request; its item has not arrived yet.
    ACCEPTED = "accepted"
    #: No answer in time (Codex stalled); its item may still arrive.
    TIMED_OUT = "timed_out"
    #: Codex took it (its item arrived): waiting for the model to work after it.
    LANDED = "landed"
    # Final states: the batch's fate (:data:`STEER_FATES`).
    STEERED = "steered"
    UNANSWERED = "unanswered"
    QUEUED = "queued"
    TOO_LATE = "too_late"
    REFUSED = "refused"
    UNKNOWN = "unknown"


class SteerTrigger(enum.StrEnum):
    MESSAGE_ARRIVED = "message_arrived"
    #: The quiet interval passed (or the batch's longest wait): sent as one ``turn/steer``.
    BATCH_CLOSED = "batch_closed"
    #: Codex answered the ``turn/steer``.
    ACCEPTED = "accepted"
    #: The ``turn/steer`` got no answer in time.
    TIMED_OUT = "timed_out"
    #: The turn was not running (any more): the turn handle or Codex said so.
    ARRIVED_TOO_LATE = "arrived_too_late"
    #: Codex refused the ``turn/steer`` otherwise.
    REFUSED = "refused"
    #: The batch's ``userMessage`` item arrived in the turn.
    LANDED = "landed"
    #: An item or a delta of the model's arrived (after the batch landed: it answers it).
    MODEL_WORKED = "model_worked"
    #: Codex's ``turn/completed`` arrived.
    TURN_COMPLETED = "turn_completed"
    #: No more steering: the Codex turn (or the whole turn) is over.
    STEERING_ENDED = "steering_ended"


@attrs.frozen
class SteerFate:
    """What the runner is told about a message: its status and why."""

    status: SteerStatus
    reason: str | None = None


S = SteerState
T = SteerTrigger

STEERING_TABLE: dict[SteerState, tuple[Edge, ...]] = {
    # State: collecting (a batch that steering's end finds here was never sent)
    S.COLLECTING: (
        Edge(T.BATCH_CLOSED, S.SENT),
        Edge(T.MESSAGE_ARRIVED, None),
        Edge(T.STEERING_ENDED, S.QUEUED),
    ),
    # State: sent (Codex's answer and the batch's item may come in either order)
    S.SENT: (
        Edge(T.ACCEPTED, S.ACCEPTED),
        Edge(T.LANDED, S.LANDED_EARLY),
        Edge(T.TIMED_OUT, S.TIMED_OUT),
        Edge(T.ARRIVED_TOO_LATE, S.TOO_LATE),
        Edge(T.REFUSED, S.REFUSED),
        Edge(T.STEERING_ENDED, S.UNKNOWN),
    ),
    # State: landed_early (Codex took it, but its answer is still due: a refusal queues it
    # like any refused batch)
    S.LANDED_EARLY: (
        Edge(T.ACCEPTED, S.LANDED),
        Edge(T.TIMED_OUT, S.LANDED),
        Edge(T.MODEL_WORKED, S.STEERED),
        Edge(T.TURN_COMPLETED, S.UNANSWERED),
        Edge(T.ARRIVED_TOO_LATE, S.TOO_LATE),
        Edge(T.REFUSED, S.REFUSED),
        Edge(T.STEERING_ENDED, S.UNANSWERED),
    ),
    # State: accepted (Codex took it: never unknown, unanswered at worst)
    S.ACCEPTED: (
        Edge(T.LANDED, S.LANDED),
        Edge(T.STEERING_ENDED, S.UNANSWERED),
    ),
    # State: timed_out (only its item tells whether Codex applied it)
    S.TIMED_OUT: (
        Edge(T.LANDED, S.LANDED),
        Edge(T.STEERING_ENDED, S.UNKNOWN),
    ),
    # State: landed (the model's next work answers it; the turn's end leaves it unanswered)
    S.LANDED: (
        Edge(T.MODEL_WORKED, S.STEERED),
        Edge(T.TURN_COMPLETED, S.UNANSWERED),
        Edge(T.STEERING_ENDED, S.UNANSWERED),
    ),
    # Final states: the batch's fate is known.
    S.STEERED: (),
    S.UNANSWERED: (),
    S.QUEUED: (),
    S.TOO_LATE: (),
    S.REFUSED: (),
    S.UNKNOWN: (),
}

#: What the runner is told about each message of a batch in a final state.
STEER_FATES: Final[Mapping[SteerState, SteerFate]] = {
    S.STEERED: SteerFate(SteerStatus.STEERED),
    S.UNANSWERED: SteerFate(SteerStatus.UNANSWERED),
    S.QUEUED: SteerFate(SteerStatus.QUEUED, "turn_ended"),
    S.TOO_LATE: SteerFate(SteerStatus.QUEUED, "turn_ended"),
    S.REFUSED: SteerFate(SteerStatus.QUEUED, "refused"),
    S.UNKNOWN: SteerFate(SteerStatus.UNKNOWN, "timed_out"),
}

#: The fate of a message in each mode, whatever the running turn does; ``None``: steer it.
MODE_FATES: Final[Mapping[SteerMode, SteerFate | None]] = {
    SteerMode.STEER: None,
    SteerMode.QUEUE: SteerFate(SteerStatus.QUEUED, "queue"),
    SteerMode.REJECT: SteerFate(SteerStatus.REJECTED, "reject"),
    SteerMode.FOLLOWUP: SteerFate(SteerStatus.QUEUED, "followup"),
    SteerMode.COLLECT: SteerFate(SteerStatus.COLLECTED, "collect"),
}

#: A message's fate by what holds the session and the mode (``None``: steer it). A run that
#: refuses steering makes the runner wait for it and run the message next; so does one that
#: cannot collect (no turn result would carry the collected message back).
_WAITS: Final = SteerFate(SteerStatus.QUEUED, "refuses_steering")
RUN_FATES: Final[Mapping[tuple[RunKind, SteerMode], SteerFate | None]] = {
    **{(RunKind.TURN, mode): fate for mode, fate in MODE_FATES.items()},
    **{
        (kind, mode): _WAITS if fate is None or fate.status is SteerStatus.COLLECTED else fate
        for kind in (RunKind.REVIEW, RunKind.COMPACTION)
        for mode, fate in MODE_FATES.items()
    },
}


def run_fate(kind: RunKind, mode: SteerMode) -> SteerFate | None:
    """The fate of a message in ``mode`` while a run of ``kind`` holds the session
    (:data:`RUN_FATES`); ``None``: steer it into the running turn."""
    return RUN_FATES[(kind, mode)]


STEERING_MACHINE = TableMachine(
    name="steering",
    states=SteerState,
    table=STEERING_TABLE,
    initial=SteerState.COLLECTING,
    final=tuple(STEER_FATES),
)


@attrs.define(eq=False, slots=False)
class SteerBatchModel(Model):
    """One batch's run through :data:`STEERING_TABLE`; detached once its fate is known."""

    machine = STEERING_MACHINE

    @classmethod
    def begin(cls, *, state: SteerState = SteerState.COLLECTING) -> SteerBatchModel:
        """A new batch in ``state`` (tests start mid-table; steering always starts collecting)."""
        model = cls()
        model._attach(state)
        return model

    @property
    def fate(self) -> SteerFate | None:
        """What the runner is told, once the batch is in a final state (else ``None``)."""
        return STEER_FATES.get(self.state)
