"""The turn machine against its hand-written oracle: every cell, every legal path."""

from __future__ import annotations

import threading
from typing import Any

import attrs
import pytest
from fsm_checks import (
    TURN_FLAG_COMBOS,
    exhaustive_turn_check,
    expected_skip_reason,
    legal_turn_paths,
    turn_facts,
)
from fsm_oracle import TURN_STATES, TURN_TRIGGERS, turn_oracle
from transitions.core import MachineError

from codex_turn.fsm import (
    TURN_TABLE,
    IllegalTransition,
    SkipReason,
    TurnBusy,
    TurnFacts,
    TurnModel,
    TurnOutcome,
    TurnState,
    TurnTrigger,
)
from codex_turn.fsm.turn import (
    ASSEMBLE_TRIGGERS,
    BOOTSTRAP_TRIGGERS,
    FINALIZE_TRIGGERS,
    MAINTENANCE_TRIGGERS,
    TURN_MACHINE,
)
from codex_turn.harness.maintenance import MaintenanceOutcome, ScheduleResult


@pytest.mark.parametrize("state", TURN_STATES)
def test_every_trigger_and_guard_combination_matches_the_oracle(state: str) -> None:
    assert exhaustive_turn_check(TurnModel, (state,)) == []


def test_vocabulary_matches_the_oracle() -> None:
    assert [s.name for s in TurnState] == list(TURN_STATES)
    assert sorted(t.value for t in TurnTrigger) == sorted(TURN_TRIGGERS[:-1])
    # Every state is listed in the table, terminal ones as empty rows.
    assert set(TURN_TABLE) == set(TurnState)
    assert TURN_TABLE[TurnState.DONE] == ()
    assert TURN_TABLE[TurnState.FAILED] == ()


def _fork(turn: TurnModel) -> TurnModel:
    """A second model in ``turn``'s state, with its attributes and trace: so the paths that
    share a prefix fire it once (a walk of their trie) instead of once per path."""
    twin = TurnModel.begin(turn.facts, state=turn.state, outcome=turn.outcome)
    for field in attrs.fields(TurnModel):
        if field.name not in ("facts", "outcome"):
            value = getattr(turn, field.name)
            setattr(twin, field.name, list(value) if isinstance(value, list) else value)
    return twin


def test_every_legal_path_from_idle_to_a_terminal_state_is_accepted() -> None:
    seen_paths = 0
    terminal_states = set()
    for flags in TURN_FLAG_COMBOS:
        # The legal paths as a trie: node -> {trigger: child}, a leaf keeps its path's end.
        trie: dict[Any, Any] = {}
        for path, final_state, outcome in legal_turn_paths(flags):
            node = trie
            for trigger in path:
                node = node.setdefault(trigger, {})
            node[None] = (path, final_state, outcome)

        def walk(turn: TurnModel, node: dict[Any, Any], flags: dict[str, bool]) -> None:
            nonlocal seen_paths
            if None in node:
                path, final_state, outcome = node[None]
                assert turn.state.name == final_state, path
                assert [entry.trigger for entry in turn.trace] == path
                assert (turn.outcome.value if turn.outcome else None) == outcome
                expected = expected_skip_reason(flags, path, outcome)
                assert (turn.skip_reason.value if turn.skip_reason else None) == expected, path
                assert id(turn) not in TURN_MACHINE.live  # detached at the end
                seen_paths += 1
                terminal_states.add(final_state)
            children = [(trigger, child) for trigger, child in node.items() if trigger is not None]
            for index, (trigger, child) in enumerate(children):
                # The last child goes on with this model; the others each with a twin.
                branch = turn if index == len(children) - 1 else _fork(turn)
                branch.fire(trigger)
                walk(branch, child, flags)

        walk(TurnModel.begin(turn_facts(flags)), trie, flags)
    assert terminal_states == {"DONE", "FAILED"}
    assert seen_paths > 500  # the enumeration really walked the branches


def test_illegal_transition_is_a_typed_machine_error_and_changes_nothing() -> None:
    turn = TurnModel.begin()
    turn.fire(TurnTrigger.STARTED)
    with pytest.raises(IllegalTransition) as caught:
        turn.fire(TurnTrigger.MIRRORED)
    assert isinstance(caught.value, MachineError)
    assert (caught.value.state, caught.value.trigger) == ("READING_HISTORY", "mirrored")
    assert turn.state is TurnState.READING_HISTORY
    assert len(turn.trace) == 1


def test_guard_closed_trigger_is_illegal_not_silently_false() -> None:
    turn = TurnModel.begin(
        TurnFacts(engine_active=True, had_session_file=False), state=TurnState.BOOTSTRAPPING
    )
    with pytest.raises(IllegalTransition, match="guards are closed"):
        turn.fire(TurnTrigger.BOOTSTRAPPED)
    turn.fire(TurnTrigger.BOOTSTRAP_SKIPPED)
    assert turn.state is TurnState.ASSEMBLING


def test_unknown_trigger_is_illegal() -> None:
    turn = TurnModel.begin()
    with pytest.raises(IllegalTransition, match="unknown trigger"):
        turn.fire("to_DONE")
    assert turn.state is TurnState.IDLE


def test_no_escape_hatches_are_bound_to_models() -> None:
    turn = TurnModel.begin()
    assert not hasattr(turn, "to_DONE")
    assert not hasattr(turn, "started")
    assert TURN_MACHINE.auto_transitions is False


def test_a_trigger_fired_while_another_is_in_progress_raises_turn_busy() -> None:
    entered = threading.Event()
    release = threading.Event()

    class SlowTurn(TurnModel):
        def _on_fired(self, trigger: str) -> None:  # runs while the trigger is in progress
            entered.set()
            release.wait(5)
            super()._on_fired(trigger)

    turn = SlowTurn.begin()
    worker = threading.Thread(target=turn.fire, args=(TurnTrigger.STARTED,))
    worker.start()
    assert entered.wait(5)
    with pytest.raises(TurnBusy):
        turn.fire(TurnTrigger.HISTORY_READ)
    release.set()
    worker.join(5)
    assert turn.state is TurnState.READING_HISTORY  # the first trigger completed, alone
    assert [entry.trigger for entry in turn.trace] == ["started"]
    turn.close()


def test_a_trigger_fired_from_inside_another_raises_turn_busy() -> None:
    class ReentrantTurn(TurnModel):
        def _on_fired(self, trigger: str) -> None:
            if trigger == TurnTrigger.STARTED:
                self.fire(TurnTrigger.HISTORY_READ)

    with ReentrantTurn.begin() as turn, pytest.raises(TurnBusy):
        turn.fire(TurnTrigger.STARTED)
    assert [entry.trigger for entry in turn.trace] == ["started"]


def test_closing_an_abandoned_turn_detaches_it() -> None:
    with TurnModel.begin() as turn:
        turn.fire(TurnTrigger.STARTED)
        assert id(turn) in TURN_MACHINE.live
    assert id(turn) not in TURN_MACHINE.live
    with pytest.raises(IllegalTransition, match="has ended"):
        turn.fire(TurnTrigger.HISTORY_READ)


def test_trace_records_state_trigger_destination_and_monotonic_time() -> None:
    turn = TurnModel.begin(TurnFacts())
    for trigger in (
        "started",
        "history_read",
        "bootstrap_skipped",
        "assemble_skipped",
        "prompt_built",
        "thread_resumed",
        "turn_completed",
        "mirrored",
        "finalized",
    ):
        turn.fire(trigger)
    assert turn.path() == [
        "IDLE",
        "READING_HISTORY",
        "BOOTSTRAPPING",
        "ASSEMBLING",
        "BUILDING_PROMPT",
        "STARTING_THREAD",
        "RUNNING_TURN",
        "MIRRORING",
        "FINALIZING",
        "DONE",
    ]
    times = [entry.monotonic_ns for entry in turn.trace]
    assert times == sorted(times)
    assert all(a.dest == b.state for a, b in zip(turn.trace, turn.trace[1:], strict=False))
    assert turn.outcome is TurnOutcome.COMPLETED
    assert turn.skip_reason is SkipReason.NO_ENGINE


def test_native_compactions_inside_the_turn_are_counted_and_stay_in_running_turn() -> None:
    turn = TurnModel.begin(state=TurnState.RUNNING_TURN)
    for _ in range(3):
        turn.fire(TurnTrigger.NATIVE_COMPACTION_STARTED)
        turn.fire(TurnTrigger.NATIVE_COMPACTION_COMPLETED)
    assert turn.native_compactions == 3
    assert turn.state is TurnState.RUNNING_TURN


def test_turns_attach_and_detach_from_the_one_shared_machine() -> None:
    before = len(TURN_MACHINE.live)
    turns = [TurnModel.begin() for _ in range(5)]
    assert len(TURN_MACHINE.live) == before + 5
    for turn in turns:
        turn.fire(TurnTrigger.STARTED)
        turn.fire(TurnTrigger.CANCELLED)
    assert len(TURN_MACHINE.live) == before
    assert all(turn.outcome is TurnOutcome.CANCELLED for turn in turns)


@pytest.mark.parametrize(
    ("outcome", "reason"),
    [
        (TurnOutcome.FAILED, SkipReason.PROMPT_ERROR),
        (TurnOutcome.TIMED_OUT, SkipReason.PROMPT_ERROR),
        (TurnOutcome.ABORTED, SkipReason.ABORTED),
        (TurnOutcome.YIELD_ABORTED, SkipReason.YIELD_ABORTED),
    ],
)
def test_maintenance_is_skipped_after_a_bad_turn(outcome: TurnOutcome, reason: SkipReason) -> None:
    facts = TurnFacts(engine_active=True, engine_maintains=True)
    turn = TurnModel.begin(facts, state=TurnState.FINALIZING, outcome=outcome)
    turn.fire(TurnTrigger.FINALIZED)
    assert turn.state is TurnState.DONE
    assert turn.skip_reason is reason


def test_finalize_failure_skips_maintenance_with_its_own_reason() -> None:
    facts = TurnFacts(engine_active=True, engine_maintains=True)
    turn = TurnModel.begin(facts, state=TurnState.FINALIZING, outcome=TurnOutcome.COMPLETED)
    turn.fire(TurnTrigger.FINALIZE_FAILED)
    assert turn.skip_reason is SkipReason.FINALIZE_FAILED


# --- the non-edge decision tables: hand-written expectations ------------------------------

_RUN_END_ORACLE = {
    ("completed", False): "turn_completed",
    ("completed", True): "turn_completed",
    ("failed", False): "turn_failed",
    ("failed", True): "turn_failed",
    ("timed_out", False): "turn_timed_out",
    ("timed_out", True): "turn_timed_out",
    ("interrupted", False): "turn_aborted",
    ("interrupted", True): "turn_yield_aborted",
    # A failed turn Codex typed as the context window exceeded (retried once).
    ("overflowed", False): "turn_overflowed",
    ("overflowed", True): "turn_overflowed",
}


def test_codex_status_mapping_matches_the_oracle_and_is_legal() -> None:
    from codex_turn.fsm.turn import RUN_END_TRIGGERS, RunEnd, run_end_trigger

    table = {
        (end.value, yielded): trigger.value for (end, yielded), trigger in RUN_END_TRIGGERS.items()
    }
    assert table == _RUN_END_ORACLE
    for (end, yielded), expected in _RUN_END_ORACLE.items():
        trigger = run_end_trigger(end, yield_requested=yielded)
        assert trigger == expected
        assert (
            turn_oracle(
                "RUNNING_TURN",
                trigger,
                engine=True,
                session_file=True,
                maintains=True,
                background=False,
                outcome=None,
                overflowed=True,  # a first overflow steps back to a retry, the second ends
            )
            == "MIRRORING"
        )
    assert {end.value for end in RunEnd} == {end for end, _ in _RUN_END_ORACLE}


def _cut_short_oracle(state: str, background: bool) -> str | None:
    if state in (
        "READING_HISTORY",
        "BOOTSTRAPPING",
        "ASSEMBLING",
        "PROJECTING",
        "BUILDING_PROMPT",
        "STARTING_THREAD",
        "REPROJECTING",
    ):
        return "cancelled"
    if state == "MIRRORING":
        return "mirror_failed"
    if state == "FINALIZING":
        return "finalize_failed"
    if state == "MAINTAINING":
        return "maintenance_dropped" if background else "maintenance_failed"
    return None  # idle, running_turn (its own ending) and the final states


@pytest.mark.parametrize("flags", TURN_FLAG_COMBOS, ids=str)
def test_a_stage_cut_short_ends_as_the_oracle_says(flags: dict[str, bool]) -> None:
    for state in TurnState:
        turn = TurnModel.begin(turn_facts(flags), state=state, outcome=TurnOutcome.COMPLETED)
        trigger = turn.cut_short_trigger()
        expected = _cut_short_oracle(state.name, flags["background"])
        assert (trigger.value if trigger else None) == expected, state
        if trigger is not None:
            dest = turn_oracle(state.name, trigger, outcome="completed", **flags)
            assert dest is not None, (state, trigger)
            turn.fire(trigger)
            assert turn.state.name == dest
        turn.close()


@pytest.mark.parametrize(
    ("state", "triggers"),
    [
        (TurnState.BOOTSTRAPPING, BOOTSTRAP_TRIGGERS),
        (TurnState.ASSEMBLING, ASSEMBLE_TRIGGERS),
        (TurnState.FINALIZING, FINALIZE_TRIGGERS),
        (TurnState.MAINTAINING, MAINTENANCE_TRIGGERS),
    ],
)
def test_each_engine_stage_map_names_exactly_the_exits_of_its_state(
    state: TurnState, triggers: dict[Any, TurnTrigger]
) -> None:
    exits = {edge.trigger for edge in TURN_TABLE[state]} - {TurnTrigger.CANCELLED}
    assert set(triggers.values()) == exits
    assert len(set(triggers.values())) == len(triggers)  # one status, one exit


def test_a_maintenance_request_the_scheduler_dropped_ends_as_dropped() -> None:
    for schedule, ending in [
        (ScheduleResult.STARTED, "deferred"),
        (ScheduleResult.COALESCED, "deferred"),
        (ScheduleResult.REJECTED, "dropped"),
        (ScheduleResult.CLOSED, "dropped"),
    ]:
        outcome = MaintenanceOutcome(status="deferred", reason="turn", schedule=schedule)
        assert outcome.ending == ending
        assert outcome.trigger is MAINTENANCE_TRIGGERS[ending]
    skipped = MaintenanceOutcome(status="skipped", reason="turn")
    assert (skipped.ending, skipped.trigger) == ("skipped", None)
