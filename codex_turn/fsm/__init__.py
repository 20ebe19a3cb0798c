"""The turn, compaction, steering and supervision machines: states, triggers, guards and
tables as data.

No I/O and no async in this package. See :mod:`codex_turn.fsm.turn` for the theory.
"""

from codex_turn.fsm._machine import Edge, TableMachine, TraceEntry
from codex_turn.fsm.compaction import (
    COMPACTION_TABLE,
    CompactionFacts,
    CompactionModel,
    CompactionState,
    CompactionTrigger,
)
from codex_turn.fsm.errors import FsmError, IllegalTransition, TurnBusy
from codex_turn.fsm.steering import (
    STEER_FATES,
    STEERING_TABLE,
    SteerBatchModel,
    SteerState,
    SteerTrigger,
)
from codex_turn.fsm.supervision import (
    ARCHIVE_TABLE,
    BRANCH_TABLE,
    DIAGNOSTICS_TABLE,
    ArchiveState,
    BranchState,
    DiagnosticsState,
    NativeStatus,
)
from codex_turn.fsm.thread import (
    BASE_RULES,
    FORK_RULES,
    FORM_RULES,
    THREAD_RULES,
    Choice,
    ForkAction,
    ForkFacts,
    ProjectionForm,
    Rule,
    ThreadAction,
    ThreadDecision,
    ThreadFacts,
    ThreadPlan,
    decide,
    plan_thread,
)
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
    "ARCHIVE_TABLE",
    "BASE_RULES",
    "BRANCH_TABLE",
    "COMPACTION_TABLE",
    "DIAGNOSTICS_TABLE",
    "FORK_RULES",
    "FORM_RULES",
    "STEERING_TABLE",
    "STEER_FATES",
    "THREAD_RULES",
    "TURN_TABLE",
    "ArchiveState",
    "BranchState",
    "Choice",
    "CompactionFacts",
    "CompactionModel",
    "CompactionState",
    "CompactionTrigger",
    "DiagnosticsState",
    "Edge",
    "ForkAction",
    "ForkFacts",
    "FsmError",
    "IllegalTransition",
    "NativeStatus",
    "ProjectionForm",
    "Rule",
    "SkipReason",
    "SteerBatchModel",
    "SteerState",
    "SteerTrigger",
    "TableMachine",
    "ThreadAction",
    "ThreadDecision",
    "ThreadFacts",
    "ThreadPlan",
    "TraceEntry",
    "TurnBusy",
    "TurnFacts",
    "TurnModel",
    "TurnOutcome",
    "TurnState",
    "TurnTrigger",
    "decide",
    "maintenance_skip_reason",
    "plan_thread",
]
