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
from codex_turn.fsm.thread import (
    BASE_RULES,
    FORM_RULES,
    RESUME_RULES,
    THREAD_RULES,
    ProjectionForm,
    ResumeAction,
    ResumeDecision,
    ResumeFacts,
    ThreadAction,
    ThreadDecision,
    ThreadFacts,
    decide_base,
    decide_form,
    decide_resume,
    decide_thread,
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
    "BASE_RULES",
    "COMPACTION_TABLE",
    "FORM_RULES",
    "RESUME_RULES",
    "THREAD_RULES",
    "TURN_TABLE",
    "CompactionFacts",
    "CompactionModel",
    "CompactionState",
    "CompactionTrigger",
    "Edge",
    "FsmError",
    "IllegalTransition",
    "ProjectionForm",
    "ResumeAction",
    "ResumeDecision",
    "ResumeFacts",
    "SkipReason",
    "ThreadAction",
    "ThreadDecision",
    "ThreadFacts",
    "TraceEntry",
    "TurnBusy",
    "TurnFacts",
    "TurnModel",
    "TurnOutcome",
    "TurnState",
    "TurnTrigger",
    "decide_base",
    "decide_form",
    "decide_resume",
    "decide_thread",
    "maintenance_skip_reason",
]
