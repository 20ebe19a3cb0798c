"""The turn outbox machine: what becomes of one logical turn on its way into the engine.

An engine that declares transcript semantics (durable turns) is settled with ``commit_turn``
from a durable outbox next to the transcript (:mod:`codex_turn.harness.durable_turns` does
the I/O and fires the past-tense triggers; this table decides where an entry goes). One entry
per advancement key:

    admitted --run_returned--> accepted --committed | duplicate--> ready
                                        --commit_failed--> blocked --committed--> ready

* ``admitted``: the host admitted the turn; the entry is durable before its prompt is
  written to the transcript and before Codex sees it.
* ``accepted``: the run returned and the turn's messages are in the transcript; its terminal
  (how it ended) is recorded. A host killed here (between the reply and the commit) finds
  the entry on its next start or turn, and commits it then.
* ``ready``: the engine committed the turn (``duplicate`` is success: the key was committed
  before, by an attempt that died before it could say so).
* ``blocked``: the commit failed (the engine raised, timed out or answered out of contract);
  retried on every start and turn until it succeeds. The next turn still runs: an engine
  must never break a turn.
* A host that died during the run leaves the entry ``admitted``: recovery reads the
  transcript, and the turn is accepted as it ended there (``recovered``), or, when its prompt
  never reached the transcript, is ``abandoned`` (nothing ran; nothing to commit).

No I/O here. WARNING: :data:`OUTBOX_TABLE` is the whole behaviour; change it with its test.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

from codex_turn.fsm._machine import Edge
from codex_turn.fsm.errors import IllegalTransition
from codex_turn.fsm.turn import TurnOutcome

__all__ = [
    "COMMIT_TRIGGERS",
    "OUTBOX_TABLE",
    "SETTLED_STATES",
    "TERMINAL_OF_OUTCOME",
    "OutboxState",
    "OutboxTrigger",
    "needs_settling",
    "next_outbox_state",
]


class OutboxState(enum.Enum):
    ADMITTED = "admitted"
    ACCEPTED = "accepted"
    READY = "ready"
    BLOCKED = "blocked"
    #: Its prompt never reached the transcript: the turn never ran.
    ABANDONED = "abandoned"


class OutboxTrigger(enum.StrEnum):
    #: The host admitted the turn (again, for a retry of the same key).
    ADMITTED = "admitted"
    #: The run returned; the turn's messages are in the transcript.
    RUN_RETURNED = "run_returned"
    #: Recovery found the turn of a host that died during the run, in the transcript.
    RECOVERED = "recovered"
    #: Recovery found no prompt of the turn in the transcript.
    PROMPT_MISSING = "prompt_missing"
    COMMITTED = "committed"
    DUPLICATE = "duplicate"
    COMMIT_FAILED = "commit_failed"


S = OutboxState
T = OutboxTrigger

# A key admitted again (the host re-runs the turn: a queue's retry) starts over from
# ``admitted``; the re-run's own commit then settles it (``duplicate`` when an earlier
# attempt committed it).
_RETRIED = Edge(T.ADMITTED, S.ADMITTED)

OUTBOX_TABLE: Mapping[OutboxState, tuple[Edge, ...]] = {
    S.ADMITTED: (
        Edge(T.ADMITTED, None),
        Edge(T.RUN_RETURNED, S.ACCEPTED),
        Edge(T.RECOVERED, S.ACCEPTED),
        Edge(T.PROMPT_MISSING, S.ABANDONED),
    ),
    S.ACCEPTED: (
        Edge(T.COMMITTED, S.READY),
        Edge(T.DUPLICATE, S.READY),
        Edge(T.COMMIT_FAILED, S.BLOCKED),
        _RETRIED,
    ),
    S.BLOCKED: (
        Edge(T.COMMITTED, S.READY),
        Edge(T.DUPLICATE, S.READY),
        Edge(T.COMMIT_FAILED, None),
        _RETRIED,
    ),
    S.READY: (_RETRIED,),
    S.ABANDONED: (_RETRIED,),
}

#: States in which the engine has nothing more to be told of the turn.
SETTLED_STATES: Final = frozenset({S.READY, S.ABANDONED})

#: The outbox trigger for each way a commit went (``CommitTurnResult.status``, or a failure).
COMMIT_TRIGGERS: Mapping[str, OutboxTrigger] = {
    "committed": T.COMMITTED,
    "duplicate": T.DUPLICATE,
    "failed": T.COMMIT_FAILED,
}

#: The terminal status the engine is told (``TurnTerminal.status``) for each turn outcome.
#: An unsaved turn completed (its reply could not be mirrored, the engine gets it anyway);
#: a cancelled or aborted one was interrupted; a context overflow failed.
TERMINAL_OF_OUTCOME: Mapping[TurnOutcome, str] = {
    TurnOutcome.COMPLETED: "completed",
    TurnOutcome.UNSAVED: "completed",
    TurnOutcome.FAILED: "failed",
    TurnOutcome.CONTEXT_OVERFLOW: "failed",
    TurnOutcome.THREAD_START_FAILED: "failed",
    TurnOutcome.TRANSCRIPT_UNWRITABLE: "failed",
    TurnOutcome.TIMED_OUT: "timed_out",
    TurnOutcome.ABORTED: "interrupted",
    TurnOutcome.YIELD_ABORTED: "interrupted",
    TurnOutcome.CANCELLED: "interrupted",
}


def next_outbox_state(state: OutboxState, trigger: OutboxTrigger) -> OutboxState:
    """Where an entry in ``state`` goes on ``trigger``; :class:`IllegalTransition` if nowhere."""
    for edge in OUTBOX_TABLE.get(state, ()):
        if edge.trigger == trigger:
            return state if edge.dest is None else OutboxState(edge.dest.value)
    raise IllegalTransition(state.name, str(trigger), why="no edge from this state")


def needs_settling(state: OutboxState, *, current: bool) -> bool:
    """Whether recovery settles an entry now. The current turn's own entry is left to the
    run that holds it (a retry of the same key continues it); a turn still ``admitted``
    under another key was cut short by a crash and is recovered from the transcript."""
    if state in SETTLED_STATES:
        return False
    return not (current and state is S.ADMITTED)
