"""The compaction machine against its hand-written oracle."""

from __future__ import annotations

from typing import get_args, get_type_hints

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
from codex_turn.fsm.compaction import (
    COMPACTION_MACHINE,
    ENGINE_RESULT_TRIGGERS,
    MAINTENANCE_TRIGGERS,
    NATIVE_REPORT_TRIGGERS,
    NATIVE_RULES,
    NativeAction,
    NativeFacts,
)
from codex_turn.fsm.thread import decide


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


# --- what each step's result and the native rules decide --------------------------------------


def _native_oracle(*, bound: bool, fork_base: bool, auth_matches: bool) -> NativeAction:
    """The native step's checks in the order the runner made them before they were a table."""
    if not bound:
        return NativeAction.NO_BINDING
    if fork_base:
        return NativeAction.FORK_BASE
    if not auth_matches:
        return NativeAction.AUTH_MISMATCH
    return NativeAction.COMPACT


@pytest.mark.parametrize("bound", [False, True])
@pytest.mark.parametrize("fork_base", [False, True])
@pytest.mark.parametrize("auth_matches", [False, True])
def test_the_native_rules_match_their_oracle(
    bound: bool, fork_base: bool, auth_matches: bool
) -> None:
    facts = NativeFacts(bound=bound, fork_base=fork_base, auth_matches=auth_matches)
    expected = _native_oracle(bound=bound, fork_base=fork_base, auth_matches=auth_matches)
    assert decide(NATIVE_RULES, facts) is expected


def test_the_native_rules_end_with_an_unconditional_compact() -> None:
    last = NATIVE_RULES[-1]
    assert (last.decision, last.when, last.unless) == (NativeAction.COMPACT, (), ())
    assert {rule.decision for rule in NATIVE_RULES} == set(NativeAction)


def _exits(state: CompactionState) -> set[str]:
    return {edge.trigger for edge in COMPACTION_TABLE[state]}


def test_every_result_map_is_total_and_leaves_its_own_state() -> None:
    pairs = {(a, b) for a in (False, True) for b in (False, True)}
    assert set(ENGINE_RESULT_TRIGGERS) == pairs
    assert set(NATIVE_REPORT_TRIGGERS) == pairs
    assert set(MAINTENANCE_TRIGGERS) == set(get_args(_maintenance_statuses()))
    assert set(ENGINE_RESULT_TRIGGERS.values()) <= _exits(CompactionState.ENGINE_COMPACTING)
    assert set(MAINTENANCE_TRIGGERS.values()) <= _exits(CompactionState.COMPACTION_MAINTENANCE)
    assert set(NATIVE_REPORT_TRIGGERS.values()) <= _exits(CompactionState.NATIVE_COMPACTING)
    # Only an engine that reported ok and compacted leads to compaction maintenance; a
    # compaction Codex reported stands even when its turn then timed out.
    assert ENGINE_RESULT_TRIGGERS[True, True] is CompactionTrigger.ENGINE_COMPACTED
    assert ENGINE_RESULT_TRIGGERS[False, True] is CompactionTrigger.ENGINE_FAILED
    assert NATIVE_REPORT_TRIGGERS[True, True] is CompactionTrigger.NATIVE_COMPACTED
    assert NATIVE_REPORT_TRIGGERS[False, True] is CompactionTrigger.NATIVE_TIMED_OUT
    assert MAINTENANCE_TRIGGERS["failed"] is CompactionTrigger.MAINTENANCE_FAILED


def _maintenance_statuses() -> object:
    from codex_turn.harness.maintenance import MaintenanceOutcome

    return get_type_hints(MaintenanceOutcome)["status"]


@pytest.mark.parametrize("flags", COMPACTION_FLAG_COMBOS)
def test_left_to_codex_is_the_budget_edge(flags: dict[str, bool]) -> None:
    run = CompactionModel.begin(compaction_facts(flags))
    expected = flags["binding"] and not flags["manual"] and not flags["owns"]
    assert run.left_to_codex is expected
    run.fire(CompactionTrigger.STARTED)
    if expected:
        assert run.state is CompactionState.REPORTED
    run.close()


def test_compacted_by_both_needs_both_compactions() -> None:
    facts = CompactionFacts(engine_owns=True, has_binding=True)
    paths = {
        ("started", "engine_compacted", "maintenance_ran", "native_compacted"): True,
        ("started", "engine_compacted", "maintenance_ran", "native_skipped"): False,
        ("started", "engine_declined", "native_compacted"): False,
        ("started", "engine_compacted", "maintenance_failed", "native_failed"): False,
    }
    for triggers, both in paths.items():
        run = CompactionModel.begin(facts)
        for trigger in triggers:
            run.fire(trigger)
        assert run.compacted_by_both is both, triggers
