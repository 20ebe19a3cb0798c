"""codex-turn: each turn of a Codex agent session as an explicit finite-state machine.

A pluggable context engine controls context assembly, post-turn ingestion, maintenance and
compaction policy while the real Codex app-server runs the model loop. The public API is
re-exported here; everything else is internal.
"""

from codex_turn.errors import CodexTurnError
from codex_turn.fsm import (
    CompactionFacts,
    CompactionModel,
    CompactionState,
    CompactionTrigger,
    FsmError,
    IllegalTransition,
    SkipReason,
    TraceEntry,
    TurnBusy,
    TurnFacts,
    TurnModel,
    TurnOutcome,
    TurnState,
    TurnTrigger,
)

__version__ = "0.1.0"

__all__ = [
    "CodexTurnError",
    "CompactionFacts",
    "CompactionModel",
    "CompactionState",
    "CompactionTrigger",
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
    "__version__",
]
