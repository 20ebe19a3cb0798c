"""Hypothesis state machines that drive several runs at once through a model class (turn,
compaction, steering batch).

Legal moves and illegal moves are separate rules (a single uniform rule misses injected
edges under the derandomized CI profile, see fsm-notes §3.4). The shadow of each run is kept
with the hand-written oracle; invariants are checked on the machine's own records, so they
also catch a bug the oracle and the table happen to share.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import attrs
from fsm_checks import RETRY_ENDINGS, TERMINAL_OUTCOMES, compaction_facts, turn_facts
from fsm_oracle import (
    COMPACTION_TERMINAL,
    COMPACTION_TRIGGERS,
    INTERNAL,
    OUTCOME_BY_EXIT,
    STEER_ANSWERS,
    STEER_STATES,
    STEER_TERMINAL,
    STEER_TRIGGERS,
    TURN_TERMINAL,
    TURN_TRIGGERS,
    compaction_oracle,
    steer_oracle,
    turn_oracle,
)
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from codex_turn.fsm import IllegalTransition

turn_flags = st.fixed_dictionaries(
    {
        name: st.booleans()
        for name in ("engine", "session_file", "maintains", "background", "bootstraps")
    }
)
compaction_flags = st.fixed_dictionaries(
    {"owns": st.booleans(), "binding": st.booleans(), "manual": st.booleans()}
)

MAX_LIVE = 4
DEPTHS = st.sampled_from(range(14))

_ALL_FLAGS = [
    {"engine": e, "session_file": f, "maintains": m, "background": b, "bootstraps": s}
    for e in (False, True)
    for f in (False, True)
    for m in (False, True)
    for b in (False, True)
    for s in (False, True)
]


@functools.cache
def _turn_triggers_ever_legal_in(state: str) -> frozenset[str]:
    return frozenset(
        trigger
        for trigger in TURN_TRIGGERS
        for flags in _ALL_FLAGS
        for outcome in (None, "completed", "failed", "aborted", "yield_aborted", "timed_out")
        if turn_oracle(state, trigger, outcome=outcome, **flags) is not None
    )


@attrs.define(eq=False)
class Shadow:
    model: Any
    flags: dict[str, bool]
    state: str = "IDLE"
    outcome: str | None = None
    retired: bool = False
    resume_failed: bool = False  # this run's resume was refused once (no second step back)
    fork_failed: bool = False  # this run's fork was refused once (likewise)
    overflowed: bool = False  # this run overflowed the context window once (retried once)


def make_turn_ordering_machine(model_cls: Any) -> type[RuleBasedStateMachine]:
    class TurnOrdering(RuleBasedStateMachine):
        turns = Bundle("turns")

        def __init__(self) -> None:
            super().__init__()
            self.shadows: list[Shadow] = []

        def _new(self, flags: dict[str, bool]) -> Shadow:
            shadow = Shadow(model_cls.begin(turn_facts(flags)), flags)
            self.shadows.append(shadow)
            return shadow

        def _legal(self, shadow: Shadow) -> list[str]:
            return [
                trigger
                for trigger in TURN_TRIGGERS
                if turn_oracle(
                    shadow.state,
                    trigger,
                    outcome=shadow.outcome,
                    resume_failed=shadow.resume_failed,
                    fork_failed=shadow.fork_failed,
                    overflowed=shadow.overflowed,
                    **shadow.flags,
                )
                is not None
            ]

        def _advance(self, turn: Shadow, data: st.DataObject, moves: int) -> None:
            for _ in range(moves):
                if turn.state in TURN_TERMINAL:
                    return
                legal = self._legal(turn)
                # Cancellation is legal in six states in a row; drawn as often as the rest it
                # would end nearly every run before Codex, so it gets one draw in ten.
                onward = [t for t in legal if t != "cancelled"] or legal
                pool = legal if data.draw(st.sampled_from(range(10))) == 0 else onward
                trigger = data.draw(st.sampled_from(pool), label="legal trigger")
                expected = turn_oracle(
                    turn.state,
                    trigger,
                    outcome=turn.outcome,
                    resume_failed=turn.resume_failed,
                    fork_failed=turn.fork_failed,
                    overflowed=turn.overflowed,
                    **turn.flags,
                )
                turn.model.fire(trigger)
                if trigger == "thread_resume_failed":
                    turn.resume_failed = True
                if trigger == "fork_failed":
                    turn.fork_failed = True
                retried = trigger == "turn_overflowed" and turn.overflowed
                retry_ended = turn.overflowed and trigger in RETRY_ENDINGS
                if trigger == "turn_overflowed":
                    turn.overflowed = True
                if expected != INTERNAL:
                    turn.state = str(expected)
                turn.outcome = TERMINAL_OUTCOMES.get(
                    trigger, OUTCOME_BY_EXIT.get(trigger, turn.outcome)
                )
                if trigger == "mirror_failed" and turn.outcome == "completed":
                    turn.outcome = "unsaved"  # the reply was never written
                if retried:
                    turn.outcome = "context_overflow"  # the retry overflowed too
                if retry_ended:
                    turn.outcome = RETRY_ENDINGS[trigger]
                assert turn.model.state.name == turn.state, (trigger, turn.model.trace)

        # New runs start at a random depth: Hypothesis keeps most generated programs short,
        # and under the derandomized CI profile runs would otherwise rarely leave IDLE.
        # (sampled_from, not integers(): integers are biased towards their lower bound.)
        @initialize(target=turns, flags=turn_flags, data=st.data(), depth=DEPTHS)
        def first_turn(self, flags: dict[str, bool], data: st.DataObject, depth: int) -> Shadow:
            shadow = self._new(flags)
            self._advance(shadow, data, depth)
            return shadow

        @precondition(lambda self: sum(not s.retired for s in self.shadows) < MAX_LIVE)
        @rule(target=turns, flags=turn_flags, data=st.data(), depth=DEPTHS)
        def another_turn(self, flags: dict[str, bool], data: st.DataObject, depth: int) -> Shadow:
            return self.first_turn(flags, data, depth)

        @rule(turn=turns, data=st.data(), moves=DEPTHS)
        def legal_moves(self, turn: Shadow, data: st.DataObject, moves: int) -> None:
            assume(not turn.retired and turn.state not in TURN_TERMINAL and moves > 0)
            self._advance(turn, data, moves)

        @rule(turn=turns, data=st.data())
        def illegal_move(self, turn: Shadow, data: st.DataObject) -> None:
            legal = set(self._legal(turn))
            illegal = [t for t in TURN_TRIGGERS if t not in legal]
            # Near misses first: triggers this state accepts under other facts or outcomes
            # (a dropped guard shows up only there), then anything else that is illegal.
            near = [t for t in illegal if t in _turn_triggers_ever_legal_in(turn.state)]
            choices = st.sampled_from(illegal)
            if near:
                choices = st.one_of(st.sampled_from(near), choices)
            trigger = data.draw(choices, label="illegal trigger")
            before = (turn.model.state, len(turn.model.trace))
            try:
                turn.model.fire(trigger)
            except IllegalTransition as error:
                assert error.trigger == trigger  # noqa: PT017 - inside a Hypothesis rule
            else:
                raise AssertionError(f"{trigger!r} accepted in {turn.state}")
            assert (turn.model.state, len(turn.model.trace)) == before

        @rule(turn=consumes(turns))
        def retire(self, turn: Shadow) -> None:
            turn.model.close()
            turn.retired = True

        @invariant()
        def runs_are_isolated_and_match_their_shadows(self) -> None:
            for shadow in self.shadows:
                assert shadow.model.state.name == shadow.state

        @invariant()
        def nothing_happens_after_a_terminal_state(self) -> None:
            for shadow in self.shadows:
                trace = shadow.model.trace
                for entry in trace[:-1]:
                    assert entry.dest not in TURN_TERMINAL, trace
                if shadow.state in TURN_TERMINAL:
                    assert id(shadow.model) not in shadow.model.machine.live

        @invariant()
        def the_trace_is_a_connected_path(self) -> None:
            for shadow in self.shadows:
                trace = shadow.model.trace
                if trace:
                    assert trace[0].state == "IDLE"
                for before, after in itertools.pairwise(trace):
                    assert before.dest == after.state

        @invariant()
        def finalize_follows_every_turn_that_ran(self) -> None:
            for shadow in self.shadows:
                path = shadow.model.path()
                if "RUNNING_TURN" in path and path[-1] in TURN_TERMINAL:
                    assert "FINALIZING" in path, path
                    assert path[-1] == "DONE", path

        @invariant()
        def maintenance_only_after_a_clean_finalized_turn(self) -> None:
            for shadow in self.shadows:
                triggers = [entry.trigger for entry in shadow.model.trace]
                if "MAINTAINING" in shadow.model.path():
                    assert "turn_completed" in triggers, triggers
                    assert "finalize_failed" not in triggers
                    assert shadow.flags["engine"]
                    assert shadow.flags["maintains"]

        @invariant()
        def bootstrap_only_with_a_prior_session_file(self) -> None:
            for shadow in self.shadows:
                triggers = {entry.trigger for entry in shadow.model.trace}
                if triggers & {"bootstrapped", "bootstrap_failed"}:
                    assert shadow.flags["session_file"]
                    assert shadow.flags["engine"]
                    assert shadow.flags["bootstraps"]

        @invariant()
        def a_refused_resume_steps_back_at_most_once(self) -> None:
            for shadow in self.shadows:
                triggers = [entry.trigger for entry in shadow.model.trace]
                assert triggers.count("thread_resume_failed") <= 1, triggers
                assert triggers.count("fork_failed") <= 1, triggers
                # Every step back follows a refusal: as many reprojections as refusals.
                assert triggers.count("turn_overflowed") <= 2, triggers
                steps_back = [
                    t for t in triggers if t in ("thread_resume_failed", "fork_failed")
                ] + [t for t in triggers if t == "turn_overflowed"][:1]
                assert triggers.count("reprojected") <= len(steps_back), triggers
                if "reprojected" in triggers:
                    first = min(triggers.index(t) for t in steps_back)
                    assert first < triggers.index("reprojected")

        def teardown(self) -> None:
            for shadow in self.shadows:
                shadow.model.close()

    return TurnOrdering


def make_compaction_ordering_machine(model_cls: Any) -> type[RuleBasedStateMachine]:
    class CompactionOrdering(RuleBasedStateMachine):
        runs = Bundle("runs")

        def __init__(self) -> None:
            super().__init__()
            self.shadows: list[Shadow] = []

        def _legal(self, shadow: Shadow) -> list[str]:
            return [
                t
                for t in COMPACTION_TRIGGERS
                if compaction_oracle(shadow.state, t, **shadow.flags) is not None
            ]

        @initialize(target=runs, flags=compaction_flags)
        def first_run(self, flags: dict[str, bool]) -> Shadow:
            shadow = Shadow(model_cls.begin(compaction_facts(flags)), flags)
            self.shadows.append(shadow)
            return shadow

        @precondition(lambda self: len(self.shadows) < MAX_LIVE)
        @rule(target=runs, flags=compaction_flags)
        def another_run(self, flags: dict[str, bool]) -> Shadow:
            return self.first_run(flags)

        @rule(run=runs, data=st.data())
        def legal_move(self, run: Shadow, data: st.DataObject) -> None:
            assume(run.state not in COMPACTION_TERMINAL)
            trigger = data.draw(st.sampled_from(self._legal(run)), label="legal trigger")
            run.model.fire(trigger)
            run.state = str(compaction_oracle(run.state, trigger, **run.flags))
            assert run.model.state.name == run.state

        @rule(run=runs, data=st.data())
        def illegal_move(self, run: Shadow, data: st.DataObject) -> None:
            legal = set(self._legal(run))
            illegal = [t for t in COMPACTION_TRIGGERS if t not in legal]
            near = [
                t
                for t in illegal
                if any(
                    compaction_oracle(run.state, t, owns=o, binding=b, manual=m) is not None
                    for o in (False, True)
                    for b in (False, True)
                    for m in (False, True)
                )
            ]
            choices = st.sampled_from(illegal)
            if near:
                choices = st.one_of(st.sampled_from(near), choices)
            trigger = data.draw(choices, label="illegal trigger")
            before = (run.model.state, len(run.model.trace))
            try:
                run.model.fire(trigger)
            except IllegalTransition:
                pass
            else:
                raise AssertionError(f"{trigger!r} accepted in {run.state}")
            assert (run.model.state, len(run.model.trace)) == before

        @invariant()
        def runs_match_their_shadows(self) -> None:
            for shadow in self.shadows:
                assert shadow.model.state.name == shadow.state

        @invariant()
        def ownership_is_decided_once_and_respected(self) -> None:
            for shadow in self.shadows:
                path = shadow.model.path()
                engine_ran = "ENGINE_COMPACTING" in path
                assert engine_ran == (shadow.flags["owns"] and len(path) > 1)
                if "NATIVE_COMPACTING" in path:
                    assert shadow.flags["binding"]
                if "COMPACTION_MAINTENANCE" in path:
                    triggers = [entry.trigger for entry in shadow.model.trace]
                    assert "engine_compacted" in triggers
                triggers = [entry.trigger for entry in shadow.model.trace]
                if "engine_aborted" in triggers:
                    # The caller aborted: nothing more runs, native neither.
                    assert "NATIVE_COMPACTING" not in path
                elif engine_ran and path[-1] == "REPORTED" and shadow.flags["binding"]:
                    assert "NATIVE_COMPACTING" in path  # engine first, then native, always

        def teardown(self) -> None:
            for shadow in self.shadows:
                shadow.model.close()

    return CompactionOrdering


@functools.cache
def _steer_triggers_ever_legal() -> frozenset[str]:
    return frozenset(
        trigger
        for state in STEER_STATES
        for trigger in STEER_TRIGGERS
        if steer_oracle(state, trigger) is not None
    )


def make_steering_ordering_machine(model_cls: Any) -> type[RuleBasedStateMachine]:
    """Several batches at once, as a turn steered more than once has them: legal moves
    follow the oracle, illegal ones must be refused, and every fate must be one the facts
    of its trace allow (Codex took what is steered or unanswered; nothing it took is unknown
    or queued)."""

    class SteeringOrdering(RuleBasedStateMachine):
        batches = Bundle("batches")

        def __init__(self) -> None:
            super().__init__()
            self.shadows: list[Shadow] = []

        def _legal(self, shadow: Shadow) -> list[str]:
            return [t for t in STEER_TRIGGERS if steer_oracle(shadow.state, t) is not None]

        def _advance(self, batch: Shadow, data: st.DataObject, moves: int) -> None:
            for _ in range(moves):
                if batch.state in STEER_TERMINAL:
                    return
                legal = self._legal(batch)
                # Either end of the list as likely: a search that favours early choices (a
                # derandomized one does) still reaches the triggers listed last.
                choice = st.sampled_from(legal) | st.sampled_from(legal[::-1])
                trigger = data.draw(choice, label="legal trigger")
                expected = steer_oracle(batch.state, trigger)
                batch.model.fire(trigger)
                if expected != INTERNAL:
                    batch.state = str(expected)
                assert batch.model.state.name == batch.state, (trigger, batch.model.trace)

        @initialize(target=batches, data=st.data(), depth=st.sampled_from(range(6)))
        def first_batch(self, data: st.DataObject, depth: int) -> Shadow:
            shadow = Shadow(model_cls.begin(), {}, state="COLLECTING")
            self.shadows.append(shadow)
            self._advance(shadow, data, depth)
            return shadow

        @precondition(lambda self: sum(not s.retired for s in self.shadows) < MAX_LIVE)
        @rule(target=batches, data=st.data(), depth=st.sampled_from(range(6)))
        def another_batch(self, data: st.DataObject, depth: int) -> Shadow:
            return self.first_batch(data, depth)

        @rule(batch=batches, data=st.data(), moves=st.sampled_from(range(1, 5)))
        def legal_moves(self, batch: Shadow, data: st.DataObject, moves: int) -> None:
            assume(not batch.retired and batch.state not in STEER_TERMINAL)
            self._advance(batch, data, moves)

        @rule(batch=batches, data=st.data())
        def illegal_move(self, batch: Shadow, data: st.DataObject) -> None:
            legal = set(self._legal(batch))
            illegal = [t for t in STEER_TRIGGERS if t not in legal]
            # Near misses first: triggers some other state takes (a misplaced row shows there).
            near = [t for t in illegal if t in _steer_triggers_ever_legal()]
            choices = st.sampled_from(illegal)
            if near:
                choices = st.one_of(st.sampled_from(near), choices)
            trigger = data.draw(choices, label="illegal trigger")
            before = (batch.model.state, len(batch.model.trace))
            try:
                batch.model.fire(trigger)
            except IllegalTransition as error:
                assert error.trigger == trigger  # noqa: PT017 - inside a Hypothesis rule
            else:
                raise AssertionError(f"{trigger!r} accepted in {batch.state}")
            assert (batch.model.state, len(batch.model.trace)) == before

        @rule(batch=consumes(batches))
        def retire(self, batch: Shadow) -> None:
            batch.model.close()
            batch.retired = True

        @invariant()
        def batches_are_isolated_and_match_their_shadows(self) -> None:
            for shadow in self.shadows:
                assert shadow.model.state.name == shadow.state

        @invariant()
        def the_trace_is_a_connected_path_and_a_fate_is_final(self) -> None:
            for shadow in self.shadows:
                trace = shadow.model.trace
                if trace:
                    assert trace[0].state == "COLLECTING"
                for before, after in itertools.pairwise(trace):
                    assert before.dest == after.state
                for entry in trace[:-1]:
                    assert entry.dest not in STEER_TERMINAL, trace
                if shadow.state in STEER_TERMINAL:
                    assert id(shadow.model) not in shadow.model.machine.live

        @invariant()
        def each_fate_is_one_the_facts_allow(self) -> None:
            for shadow in self.shadows:
                triggers = [entry.trigger for entry in shadow.model.trace]
                sent = "batch_closed" in triggers
                took = "landed" in triggers or "accepted" in triggers
                assert triggers.count("batch_closed") <= 1, triggers
                assert triggers.count("landed") <= 1, triggers
                assert sum(triggers.count(a) for a in STEER_ANSWERS) <= 1, triggers
                assert (
                    not sent or "message_arrived" not in triggers[triggers.index("batch_closed") :]
                )
                fate = shadow.state
                if fate == "STEERED":  # the model worked after its item
                    assert triggers[-1] == "model_worked", triggers
                    assert "landed" in triggers, triggers
                if fate == "UNANSWERED":
                    assert took, triggers
                if fate == "UNKNOWN":  # sent, not taken, and steering ended
                    assert sent, triggers
                    assert not took, triggers
                    assert triggers[-1] == "steering_ended", triggers
                if fate == "QUEUED":  # never sent
                    assert not sent, triggers
                if fate in ("TOO_LATE", "REFUSED"):  # Codex's one answer
                    assert sent, triggers
                    assert triggers[-1] in ("arrived_too_late", "refused"), triggers

        def teardown(self) -> None:
            for shadow in self.shadows:
                shadow.model.close()

    return SteeringOrdering
