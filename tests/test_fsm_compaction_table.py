"""The compaction machine against its hand-written oracle."""

from __future__ import annotations

import pytest
from fsm_checks import (
    COMPACTION_FLAG_COMBOS,
    compaction_facts,
    exhaustive_compaction_check,
    legal_compaction_paths,
)
from fsm_oracle import COMPACTION_STATES, COMPACTION_TRIGGERS

from codex_turn.fsm import (
    COMPACTION_TABLE,
    CompactionFacts,
    CompactionModel,
    CompactionState,
    CompactionTrigger,
    IllegalTransition,
)
from codex_turn.fsm.compaction import COMPACTION_MACHINE


def test_every_trigger_and_guard_combination_matches_the_oracle() -> None:
    assert exhaustive_compaction_check(CompactionModel) == []


def test_vocabulary_matches_the_oracle() -> None:
    assert [s.name for s in CompactionState] == list(COMPACTION_STATES)
    assert sorted(t.value for t in CompactionTrigger) == sorted(COMPACTION_TRIGGERS[:-1])
    assert set(COMPACTION_TABLE) == set(CompactionState)


def test_every_legal_path_is_accepted() -> None:
    count = 0
    for flags in COMPACTION_FLAG_COMBOS:
        for path in legal_compaction_paths(flags):
            run = CompactionModel.begin(compaction_facts(flags))
            for trigger in path:
                run.fire(trigger)
            assert run.state is CompactionState.REPORTED
            assert id(run) not in COMPACTION_MACHINE.live
            count += 1
    assert count >= 20


@pytest.mark.parametrize(
    ("facts", "triggers", "path"),
    [
        # Owning engine compacts, maintenance, then native as the secondary step.
        (
            CompactionFacts(engine_owns=True, has_binding=True),
            ["started", "engine_compacted", "maintenance_ran", "native_compacted"],
            [
                "IDLE",
                "ENGINE_COMPACTING",
                "COMPACTION_MAINTENANCE",
                "NATIVE_COMPACTING",
                "REPORTED",
            ],
        ),
        # Engine failure still goes to native compaction.
        (
            CompactionFacts(engine_owns=True, has_binding=True),
            ["started", "engine_failed", "native_failed"],
            ["IDLE", "ENGINE_COMPACTING", "NATIVE_COMPACTING", "REPORTED"],
        ),
        # No binding: the engine's result is all there is.
        (
            CompactionFacts(engine_owns=True, has_binding=False),
            ["started", "engine_compacted", "maintenance_failed"],
            ["IDLE", "ENGINE_COMPACTING", "COMPACTION_MAINTENANCE", "REPORTED"],
        ),
        # Not owning: native only.
        (
            CompactionFacts(engine_owns=False, has_binding=True),
            ["started", "native_timed_out"],
            ["IDLE", "NATIVE_COMPACTING", "REPORTED"],
        ),
        (CompactionFacts(), ["started"], ["IDLE", "REPORTED"]),
    ],
)
def test_design_paths(facts: CompactionFacts, triggers: list[str], path: list[str]) -> None:
    run = CompactionModel.begin(facts)
    for trigger in triggers:
        run.fire(trigger)
    assert run.path() == path


def test_a_non_owning_run_can_never_reach_the_engine() -> None:
    run = CompactionModel.begin(CompactionFacts(engine_owns=False, has_binding=True))
    run.fire(CompactionTrigger.STARTED)
    with pytest.raises(IllegalTransition):
        run.fire(CompactionTrigger.ENGINE_COMPACTED)
    assert run.state is CompactionState.NATIVE_COMPACTING
    run.close()
