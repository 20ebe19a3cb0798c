"""Mutation checks: a wrong edge injected into a copy of a table must be caught.

Each mutant is a real ``TableMachine`` built from a copied table with one edit, bound to a
subclass of the real model. The same checks that pass on the real tables must fail on it.
"""

from __future__ import annotations

import pytest
from fsm_checks import exhaustive_compaction_check, exhaustive_steer_check, exhaustive_turn_check
from fsm_oracle import INTERNAL, compaction_oracle, steer_oracle, turn_oracle
from fsm_stateful import (
    make_compaction_ordering_machine,
    make_steering_ordering_machine,
    make_turn_ordering_machine,
)
from hypothesis import Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from codex_turn.fsm import (
    COMPACTION_TABLE,
    STEER_FATES,
    STEERING_TABLE,
    TURN_TABLE,
    CompactionModel,
    CompactionState,
    Edge,
    SteerBatchModel,
    SteerState,
    TurnModel,
    TurnState,
)
from codex_turn.fsm._machine import TableMachine

S = TurnState

# Derandomized like CI, so detection must not depend on luck; no shrinking: we only need to
# know that the checks fail, not the smallest counterexample.
_DETECT_ONLY = settings(
    derandomize=True,
    # 400 found every mutant until the vocabulary grew by ``steered``; the fixed seed then
    # missed ``resume_retries_forever`` (random seeds find it 7 times in 8 at 400).
    max_examples=500,
    stateful_step_count=30,
    database=None,
    deadline=None,
    print_blob=False,
    phases=[Phase.explicit, Phase.generate],
)


def _mutant_turn_model(table: dict[TurnState, tuple[Edge, ...]]) -> type[TurnModel]:
    machine = TableMachine(
        name="turn-mutant",
        states=TurnState,
        table=table,
        initial=TurnState.IDLE,
        final=(S.DONE, S.FAILED),
    )

    class MutantTurn(TurnModel):
        pass

    MutantTurn.machine = machine
    return MutantTurn


def _edit(
    state: TurnState, *edges: Edge, drop: str | None = None
) -> dict[TurnState, tuple[Edge, ...]]:
    table = dict(TURN_TABLE)
    kept = tuple(edge for edge in table[state] if edge.trigger != drop)
    table[state] = edges + kept  # prepended: declaration order lets the mutant edge win
    return table


def static_table_check(table: dict[TurnState, tuple[Edge, ...]]) -> list[str]:
    """Every declared edge must be one the oracle allows for at least one guard setting."""
    problems = []
    for source, edges in table.items():
        for edge in edges:
            dests = {
                turn_oracle(
                    source.name,
                    edge.trigger,
                    engine=e,
                    session_file=f,
                    maintains=m,
                    background=b,
                    outcome=o,
                    overflowed=overflowed,
                )
                for e in (False, True)
                for f in (False, True)
                for m in (False, True)
                for b in (False, True)
                for o in (None, "completed", "failed")
                for overflowed in (False, True)
            }
            target = "<internal>" if edge.dest is None else edge.dest.name
            if target not in dests:
                problems.append(f"{source.name} --{edge.trigger}--> {target}")
    return problems


TURN_MUTANTS = {
    # The example: re-entering a finished turn.
    "done_restarts": _edit(S.DONE, Edge("started", S.READING_HISTORY)),
    # Skipping finalize: an engine would silently never see the turn (OpenClaw #121515).
    "mirror_skips_finalize": _edit(S.MIRRORING, Edge("mirrored", S.DONE)),
    # A dropped guard: bootstrap without a prior session file.
    "unguarded_bootstrap": _edit(
        S.BOOTSTRAPPING, Edge("bootstrapped", S.ASSEMBLING), drop="bootstrapped"
    ),
    # Maintenance after a failed turn.
    "maintain_after_failure": _edit(
        S.FINALIZING, Edge("finalized", S.MAINTAINING), drop="finalized"
    ),
    # A dropped guard: a refused resume steps back again and again (the turn never ends).
    "resume_retries_forever": _edit(
        S.STARTING_THREAD,
        Edge("thread_resume_failed", S.REPROJECTING),
        drop="thread_resume_failed",
    ),
}


def test_the_real_table_passes_the_static_check() -> None:
    assert static_table_check(TURN_TABLE) == []


@pytest.mark.parametrize("name", sorted(TURN_MUTANTS))
def test_the_static_and_exhaustive_checks_reject_each_turn_mutant(name: str) -> None:
    table = TURN_MUTANTS[name]
    assert static_table_check(table) != [] or exhaustive_turn_check(_mutant_turn_model(table))


@pytest.mark.parametrize(
    "name", ["mirror_skips_finalize", "unguarded_bootstrap", "maintain_after_failure"]
)
def test_the_exhaustive_check_rejects_behavioural_turn_mutants(name: str) -> None:
    assert exhaustive_turn_check(_mutant_turn_model(TURN_MUTANTS[name])) != []


@pytest.mark.parametrize(
    "name",
    [
        "mirror_skips_finalize",
        "unguarded_bootstrap",
        "maintain_after_failure",
        "resume_retries_forever",
    ],
)
def test_the_stateful_machine_rejects_behavioural_turn_mutants(name: str) -> None:
    machine = make_turn_ordering_machine(_mutant_turn_model(TURN_MUTANTS[name]))
    # Derandomized like CI: the split legal/illegal rules must find it without luck.
    with pytest.raises((AssertionError, Flaky)):
        run_state_machine_as_test(
            machine,
            settings=_DETECT_ONLY,
        )


def _mutant_compaction_model(table: dict[CompactionState, tuple[Edge, ...]]) -> type:
    machine = TableMachine(
        name="compaction-mutant",
        states=CompactionState,
        table=table,
        initial=CompactionState.IDLE,
        final=(CompactionState.REPORTED,),
    )

    class MutantCompaction(CompactionModel):
        pass

    MutantCompaction.machine = machine
    return MutantCompaction


def test_the_compaction_checks_reject_a_mutant() -> None:
    # The engine's failure ends the run even with a binding: native compaction is lost.
    table = dict(COMPACTION_TABLE)
    table[CompactionState.ENGINE_COMPACTING] = (
        Edge("engine_failed", CompactionState.REPORTED),
        *table[CompactionState.ENGINE_COMPACTING],
    )
    assert (
        compaction_oracle("ENGINE_COMPACTING", "engine_failed", owns=True, binding=True)
        == "NATIVE_COMPACTING"
    )
    model = _mutant_compaction_model(table)
    assert exhaustive_compaction_check(model) != []
    with pytest.raises((AssertionError, Flaky)):
        run_state_machine_as_test(
            make_compaction_ordering_machine(model),
            settings=_DETECT_ONLY,
        )


def _mutant_steering_model(table: dict[SteerState, tuple[Edge, ...]]) -> type[SteerBatchModel]:
    machine = TableMachine(
        name="steering-mutant",
        states=SteerState,
        table=table,
        initial=SteerState.COLLECTING,
        final=tuple(STEER_FATES),
    )

    class MutantBatch(SteerBatchModel):
        pass

    MutantBatch.machine = machine
    return MutantBatch


def _steering_edit(
    state: SteerState, *edges: Edge, drop: str | None = None
) -> dict[SteerState, tuple[Edge, ...]]:
    table = dict(STEERING_TABLE)
    kept = tuple(edge for edge in table[state] if edge.trigger != drop)
    table[state] = edges + kept
    return table


def static_steering_check(table: dict[SteerState, tuple[Edge, ...]]) -> list[str]:
    """Every declared row must be the oracle's (a row out of a final state is unreachable at
    run time, so only this check sees it)."""
    return [
        f"{source.name} --{edge.trigger}--> {edge.dest}"
        for source, edges in table.items()
        for edge in edges
        if steer_oracle(source.name, edge.trigger)
        != (INTERNAL if edge.dest is None else edge.dest.name)
    ]


B = SteerState

STEERING_MUTANTS = {
    # A stalled steer that never showed, declared held by Codex: the runner never resends it.
    "timed_out_ends_unanswered": _steering_edit(
        B.TIMED_OUT, Edge("steering_ended", B.UNANSWERED), drop="steering_ended"
    ),
    # The model's work before the batch's item landed, taken for an answer to it.
    "work_before_landing_steers": _steering_edit(B.ACCEPTED, Edge("model_worked", B.STEERED)),
    # A second answer to one request.
    "answered_twice": _steering_edit(B.ACCEPTED, Edge("refused", B.REFUSED)),
    # Codex took the batch (its item landed early), yet steering's end calls it unknown.
    "landed_early_ends_unknown": _steering_edit(
        B.LANDED_EARLY, Edge("steering_ended", B.UNKNOWN), drop="steering_ended"
    ),
}


def test_the_real_steering_table_passes_the_static_check() -> None:
    assert static_steering_check(STEERING_TABLE) == []


def test_the_static_check_sees_a_fate_that_moves_again() -> None:
    table = _steering_edit(B.QUEUED, Edge("batch_closed", B.SENT))
    assert static_steering_check(table) == ["QUEUED --batch_closed--> SteerState.SENT"]


@pytest.mark.parametrize("name", sorted(STEERING_MUTANTS))
def test_the_steering_checks_reject_each_mutant(name: str) -> None:
    table = STEERING_MUTANTS[name]
    assert static_steering_check(table) != []
    model = _mutant_steering_model(table)
    assert exhaustive_steer_check(model) != []
    # Derandomized like CI: the split legal/illegal rules must find it without luck.
    with pytest.raises((AssertionError, Flaky)):
        run_state_machine_as_test(make_steering_ordering_machine(model), settings=_DETECT_ONLY)
