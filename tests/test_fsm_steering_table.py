"""The steering machine (one batch of steered messages) against its hand-written oracle."""

from __future__ import annotations

import pytest
from fsm_checks import exhaustive_steer_check, legal_steer_paths
from fsm_oracle import STEER_RECEIPTS, STEER_STATES, STEER_TERMINAL, STEER_TRIGGERS, steer_oracle

from codex_turn.fsm import (
    STEER_FATES,
    STEERING_TABLE,
    IllegalTransition,
    SteerBatchModel,
    SteerState,
    SteerTrigger,
)
from codex_turn.fsm.steering import MODE_FATES, STEERING_MACHINE, SteerMode, SteerStatus


def test_every_state_and_trigger_matches_the_oracle() -> None:
    assert exhaustive_steer_check(SteerBatchModel) == []


def test_vocabulary_matches_the_oracle() -> None:
    assert [s.name for s in SteerState] == list(STEER_STATES)
    assert sorted(t.value for t in SteerTrigger) == sorted(STEER_TRIGGERS[:-1])
    assert set(STEERING_TABLE) == set(SteerState)
    assert STEERING_MACHINE.final_states == STEER_TERMINAL


def test_every_final_state_tells_the_fate_the_oracle_expects() -> None:
    told = {state.name: (fate.status.value, fate.reason) for state, fate in STEER_FATES.items()}
    assert told == STEER_RECEIPTS


def test_queue_and_reject_modes_decide_at_once_and_steer_defers_to_the_batch() -> None:
    assert {mode: fate and (fate.status, fate.reason) for mode, fate in MODE_FATES.items()} == {
        SteerMode.STEER: None,
        SteerMode.QUEUE: (SteerStatus.QUEUED, "queue"),
        SteerMode.REJECT: (SteerStatus.REJECTED, "reject"),
        SteerMode.FOLLOWUP: (SteerStatus.QUEUED, "followup"),
        SteerMode.COLLECT: (SteerStatus.COLLECTED, "collect"),
    }


def test_every_legal_path_is_accepted_and_ends_detached() -> None:
    count = 0
    for path in legal_steer_paths():
        batch = SteerBatchModel.begin()
        for trigger in path:
            batch.fire(trigger)
        assert batch.state_name in STEER_TERMINAL, path
        assert id(batch) not in STEERING_MACHINE.live
        count += 1
    assert count >= 20


def test_steering_ending_decides_every_open_batch() -> None:
    """Nothing outlives the turn: ``steering_ended`` is legal in every state but a fate."""
    for state in SteerState:
        batch = SteerBatchModel.begin(state=state)
        expected = steer_oracle(state.name, "steering_ended")
        assert batch.allows(SteerTrigger.STEERING_ENDED) is (state.name not in STEER_TERMINAL)
        if expected is not None:
            batch.fire(SteerTrigger.STEERING_ENDED)
            assert batch.state_name == expected
            assert batch.state_name in STEER_TERMINAL
        batch.close()


@pytest.mark.parametrize(
    ("triggers", "fate"),
    [
        # Codex answers, its item lands, the model works after it.
        (["batch_closed", "accepted", "landed", "model_worked"], "STEERED"),
        # The item arrives before the answer.
        (["batch_closed", "landed", "accepted", "model_worked"], "STEERED"),
        # A steer that lands as the final reply completes.
        (["batch_closed", "accepted", "landed", "turn_completed"], "UNANSWERED"),
        # Accepted, but the item never showed before steering ended: Codex took it.
        (["batch_closed", "accepted", "steering_ended"], "UNANSWERED"),
        # Codex stalled; its item shows later and the model answers it.
        (["batch_closed", "timed_out", "landed", "model_worked"], "STEERED"),
        # Codex stalled and nothing showed: nobody knows.
        (["batch_closed", "timed_out", "steering_ended"], "UNKNOWN"),
        (["batch_closed", "arrived_too_late"], "TOO_LATE"),
        (["batch_closed", "refused"], "REFUSED"),
        # Messages that arrive before the Codex turn ends and are never sent.
        (["message_arrived", "message_arrived", "steering_ended"], "QUEUED"),
    ],
)
def test_design_paths(triggers: list[str], fate: str) -> None:
    batch = SteerBatchModel.begin()
    for trigger in triggers:
        batch.fire(trigger)
    assert batch.state_name == fate
    assert [entry.trigger for entry in batch.trace] == triggers


def test_a_batch_whose_fate_is_known_refuses_everything_and_keeps_its_fate() -> None:
    batch = SteerBatchModel.begin()
    for trigger in ("batch_closed", "accepted", "landed", "model_worked"):
        batch.fire(trigger)
    for trigger in SteerTrigger:
        assert not batch.allows(trigger)
        with pytest.raises(IllegalTransition):
            batch.fire(trigger)
    assert batch.state is SteerState.STEERED
    assert STEER_FATES[batch.state].status is SteerStatus.STEERED


def test_model_work_before_the_batch_landed_is_not_an_answer_to_it() -> None:
    batch = SteerBatchModel.begin(state=SteerState.ACCEPTED)
    assert not batch.allows(SteerTrigger.MODEL_WORKED)
    assert not batch.allows(SteerTrigger.TURN_COMPLETED)
    batch.close()
