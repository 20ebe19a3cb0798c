"""The turn and compaction state machines: states, triggers, guards and tables as data.

No I/O and no async in this package. See :mod:`codex_turn.fsm.turn` for the theory.
"""

from codex_turn.fsm._machine import Edge, TraceEntry
from codex_turn.fsm.compaction import (
    COMPACTION_TABLE,
    CompactionFacts,
    CompactionModel,
    CompactionState,
    CompactionTrigger,
)
from codex_turn.fsm.errors import FsmError, IllegalTransition, TurnBusy
from codex_turn.fsm.turn import (
    TURN_TABLE,
    SkipReason,
    TurnFacts,
    TurnModel,
    TurnOutcome,
    TurnState,
    TurnTrigger,
    maintenance_skip_reason,
)

__all__ = [
    "COMPACTION_TABLE",
    "TURN_TABLE",
    "CompactionFacts",
    "CompactionModel",
    "CompactionState",
    "CompactionTrigger",
    "Edge",
    "FsmError",
    "IllegalTransition",
    "SkipReason",
    "TraceEntry",
    "TurnBusy",
    "TurnFacts",
    "TurnModel",
    "TurnOutcome",
    "TurnState",
    "TurnTrigger",
    "maintenance_skip_reason",
]
