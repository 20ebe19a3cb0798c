"""Hypothesis proves, for random interleavings of several runs, that illegal orderings are
rejected and the machines' invariants hold (see fsm_stateful for the rules)."""

from __future__ import annotations

from fsm_stateful import (
    make_compaction_ordering_machine,
    make_steering_ordering_machine,
    make_turn_ordering_machine,
)
from hypothesis import settings

from codex_turn.fsm import CompactionModel, SteerBatchModel, TurnModel

TestTurnOrdering = make_turn_ordering_machine(TurnModel).TestCase
TestTurnOrdering.settings = settings(settings.default, stateful_step_count=60)

TestCompactionOrdering = make_compaction_ordering_machine(CompactionModel).TestCase
TestCompactionOrdering.settings = settings(settings.default, stateful_step_count=30)

TestSteeringOrdering = make_steering_ordering_machine(SteerBatchModel).TestCase
TestSteeringOrdering.settings = settings(settings.default, stateful_step_count=30)
