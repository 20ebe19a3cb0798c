"""Ordering checks shared by the real-table tests and the mutation tests (turn, compaction,
steering).

Each check takes the model class to exercise (the real one, or one bound to a mutant table)
and returns a list of human-readable disagreements with the hand-written oracle; an empty
list means the machine behaves exactly as the oracle says.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from fsm_oracle import (
    COMPACTION_STATES,
    COMPACTION_TERMINAL,
    COMPACTION_TRIGGERS,
    INTERNAL,
    OUTCOME_BY_EXIT,
    STEER_STATES,
    STEER_TERMINAL,
    STEER_TRIGGERS,
    TURN_OUTCOMES,
    TURN_STATES,
    TURN_TERMINAL,
    TURN_TRIGGERS,
    compaction_oracle,
    steer_oracle,
    turn_oracle,
    turn_skip_reason,
)

from codex_turn.fsm import (
    CompactionFacts,
    CompactionState,
    IllegalTransition,
    SteerState,
    TurnFacts,
    TurnOutcome,
    TurnState,
)

TURN_FLAG_COMBOS = [
    dict(
        zip(("engine", "session_file", "maintains", "background", "bootstraps"), bits, strict=True)
    )
    for bits in itertools.product((False, True), repeat=5)
]
COMPACTION_FLAG_COMBOS = [
    {"owns": owns, "binding": binding, "manual": manual}
    for owns, binding, manual in itertools.product((False, True), repeat=3)
]


def turn_facts(flags: dict[str, bool]) -> TurnFacts:
    return TurnFacts(
        engine_active=flags["engine"],
        had_session_file=flags["session_file"],
        engine_maintains=flags["maintains"],
        background_maintenance=flags["background"],
        engine_bootstraps=flags.get("bootstraps", True),
    )


def compaction_facts(flags: dict[str, bool]) -> CompactionFacts:
    return CompactionFacts(
        engine_owns=flags["owns"], has_binding=flags["binding"], manual=flags.get("manual", True)
    )


def _fire_one(model: Any, trigger: str) -> tuple[str | None, str | None]:
    """Fire and report (destination, error) where exactly one is set."""
    try:
        model.fire(trigger)
    except IllegalTransition as error:
        if error.state != model.state.name or error.trigger != trigger:
            return None, f"IllegalTransition carries state={error.state} trigger={error.trigger}"
        return None, None
    return model.state.name, None


def exhaustive_turn_check(model_cls: Any, states: tuple[str, ...] = TURN_STATES) -> list[str]:
    """Every state x trigger x guard facts x recorded outcome x "a resume was already
    refused" against the oracle."""
    problems: list[str] = []
    refusals = (
        (False, False, False),
        (True, False, False),
        (False, True, False),
        (True, True, False),
        (False, False, True),
    )
    for state, flags, outcome, refused, trigger in itertools.product(
        states, TURN_FLAG_COMBOS, TURN_OUTCOMES, refusals, TURN_TRIGGERS
    ):
        resume_failed, fork_failed, overflowed = refused
        if (resume_failed or fork_failed) and state != "STARTING_THREAD":
            continue  # the facts are read by the starting_thread edges only
        if overflowed and state not in ("RUNNING_TURN", "STARTING_THREAD", "REPROJECTING"):
            continue  # ... and this one by the running_turn edges and the retry's
        model = model_cls.begin(
            turn_facts(flags),
            state=TurnState[state],
            outcome=TurnOutcome(outcome) if outcome else None,
        )
        model.resume_failed = resume_failed
        model.fork_failed = fork_failed
        model.overflowed = overflowed
        expected = turn_oracle(
            state,
            trigger,
            outcome=outcome,
            resume_failed=resume_failed,
            fork_failed=fork_failed,
            overflowed=overflowed,
            **flags,
        )
        if model.allows(trigger) != (expected is not None):
            problems.append(f"{state} allows({trigger}) disagrees with the oracle ({flags})")
        trace_before = len(model.trace)
        dest, error = _fire_one(model, trigger)
        label = (
            f"{state} --{trigger}--> ? with {flags} outcome={outcome}"
            f" rf={resume_failed} ff={fork_failed} of={overflowed}"
        )
        if error:
            problems.append(f"{label}: {error}")
        elif expected is None and dest is not None:
            problems.append(f"{label}: accepted (to {dest}), oracle says illegal")
        elif expected is None and model.state.name != state:
            problems.append(f"{label}: rejected but state changed to {model.state.name}")
        elif expected is None and len(model.trace) != trace_before:
            problems.append(f"{label}: rejected but the trace grew")
        elif expected is not None and dest is None:
            problems.append(f"{label}: rejected, oracle says {expected}")
        elif expected is not None and dest != (state if expected == INTERNAL else expected):
            problems.append(f"{label}: went to {dest}, oracle says {expected}")
        model.close()
    return problems


def exhaustive_compaction_check(model_cls: Any) -> list[str]:
    problems: list[str] = []
    for state, flags, trigger in itertools.product(
        COMPACTION_STATES, COMPACTION_FLAG_COMBOS, COMPACTION_TRIGGERS
    ):
        model = model_cls.begin(compaction_facts(flags), state=CompactionState[state])
        expected = compaction_oracle(state, trigger, **flags)
        if model.allows(trigger) != (expected is not None):
            problems.append(f"{state} allows({trigger}) disagrees with the oracle ({flags})")
        dest, error = _fire_one(model, trigger)
        label = f"{state} --{trigger}--> ? with {flags}"
        if error:
            problems.append(f"{label}: {error}")
        elif expected != dest:
            problems.append(f"{label}: machine says {dest}, oracle says {expected}")
        elif expected is None and model.state.name != state:
            problems.append(f"{label}: rejected but state changed")
        model.close()
    return problems


# Pre-Codex endings: the run is over, and the outcome says why.
TERMINAL_OUTCOMES = {
    "thread_start_failed": "thread_start_failed",
    "cancelled": "cancelled",
    "transcript_unwritable": "transcript_unwritable",
}


# How the retry of an overflowed turn ends before Codex (the turn ran once: it is mirrored).
RETRY_ENDINGS = {"thread_start_failed": "context_overflow", "cancelled": "aborted"}


# What an overflow's retry may do that the first attempt already covers in every combination:
# left out of the retry's enumeration (the exhaustive per-state check still covers them).
_COVERED_BEFORE_A_RETRY = frozenset(
    {
        "thread_resume_failed",
        "fork_failed",
        "native_compaction_started",
        "steered",
        # The thread table rotates after an overflow: the other thread starts are the
        # first attempt's, and so are its ways to end short of a reply.
        "thread_started",
        "thread_resumed",
        "thread_forked",
        "turn_aborted",
        "turn_yield_aborted",
        "turn_timed_out",
    }
)


def legal_turn_paths(flags: dict[str, bool]) -> Iterator[tuple[list[str], str, str | None]]:
    """Every legal trigger sequence from IDLE to a terminal state under ``flags``, by the
    oracle, with at most one native compaction pair; yields (triggers, final state, outcome).
    """

    # The oracle's answers for one node depend on these facts alone: asked once per facts,
    # not once per path through them (hundreds of thousands of paths share a few hundred).
    moves: dict[tuple[str, str | None, bool, bool, bool], list[tuple[str, str]]] = {}

    def legal_moves(
        state: str, outcome: str | None, resume_failed: bool, fork_failed: bool, overflowed: bool
    ) -> list[tuple[str, str]]:
        key = (state, outcome, resume_failed, fork_failed, overflowed)
        if key not in moves:
            found = []
            for trigger in TURN_TRIGGERS:
                if overflowed and trigger in _COVERED_BEFORE_A_RETRY:
                    continue  # the same steps as before the overflow: paths would multiply
                dest = turn_oracle(
                    state,
                    trigger,
                    outcome=outcome,
                    resume_failed=resume_failed,
                    fork_failed=fork_failed,
                    overflowed=overflowed,
                    **flags,
                )
                if dest is not None:
                    found.append((trigger, dest))
            moves[key] = found
        return moves[key]

    def walk(
        state: str, path: list[str], outcome: str | None, compactions: int
    ) -> Iterator[tuple[list[str], str, str | None]]:
        if state in TURN_TERMINAL:
            yield path, state, outcome
            return
        resume_failed = "thread_resume_failed" in path
        fork_failed = "fork_failed" in path
        overflowed = "turn_overflowed" in path
        for trigger, dest in legal_moves(state, outcome, resume_failed, fork_failed, overflowed):
            if dest == INTERNAL:
                # Only the ordered pair, once: started then completed.
                if compactions >= 1 or trigger != "native_compaction_started":
                    continue
                yield from walk(
                    state, [*path, trigger, "native_compaction_completed"], outcome, compactions + 1
                )
                continue
            next_outcome = TERMINAL_OUTCOMES.get(trigger, OUTCOME_BY_EXIT.get(trigger, outcome))
            if trigger == "turn_overflowed" and overflowed:
                next_outcome = "context_overflow"  # the retry overflowed too
            if overflowed and trigger in RETRY_ENDINGS:
                next_outcome = RETRY_ENDINGS[trigger]
            if trigger == "mirror_failed" and outcome == "completed":
                next_outcome = "unsaved"  # the reply was never written
            yield from walk(dest, [*path, trigger], next_outcome, compactions)

    yield from walk("IDLE", [], None, 0)


def expected_skip_reason(
    flags: dict[str, bool], path: list[str], outcome: str | None
) -> str | None:
    if "finalized" not in path and "finalize_failed" not in path:
        return None
    return turn_skip_reason(
        engine=flags["engine"],
        maintains=flags["maintains"],
        outcome=outcome,
        finalize_failed="finalize_failed" in path,
    )


def legal_compaction_paths(flags: dict[str, bool]) -> Iterator[list[str]]:
    def walk(state: str, path: list[str]) -> Iterator[list[str]]:
        if state in COMPACTION_TERMINAL:
            yield path
            return
        for trigger in COMPACTION_TRIGGERS:
            dest = compaction_oracle(state, trigger, **flags)
            if dest is not None:
                yield from walk(dest, [*path, trigger])

    yield from walk("IDLE", [])


def exhaustive_steer_check(model_cls: Any) -> list[str]:
    """Every state x trigger of the steering machine against the oracle."""
    problems: list[str] = []
    for state, trigger in itertools.product(STEER_STATES, STEER_TRIGGERS):
        model = model_cls.begin(state=SteerState[state])
        expected = steer_oracle(state, trigger)
        if model.allows(trigger) != (expected is not None):
            problems.append(f"{state} allows({trigger}) disagrees with the oracle")
        trace_before = len(model.trace)
        dest, error = _fire_one(model, trigger)
        label = f"{state} --{trigger}--> ?"
        if error:
            problems.append(f"{label}: {error}")
        elif expected is None and dest is not None:
            problems.append(f"{label}: accepted (to {dest}), oracle says illegal")
        elif expected is None and (model.state.name, len(model.trace)) != (state, trace_before):
            problems.append(f"{label}: rejected but the state or the trace changed")
        elif expected is not None and dest != (state if expected == INTERNAL else expected):
            problems.append(f"{label}: went to {dest}, oracle says {expected}")
        model.close()
    return problems


def legal_steer_paths() -> Iterator[list[str]]:
    """Every legal trigger sequence of one batch from COLLECTING to its fate, by the oracle,
    with at most one message_arrived (internal: it could repeat forever)."""

    def walk(state: str, path: list[str]) -> Iterator[list[str]]:
        if state in STEER_TERMINAL:
            yield path
            return
        for trigger in STEER_TRIGGERS:
            dest = steer_oracle(state, trigger)
            if dest is None or (dest == INTERNAL and trigger in path):
                continue
            yield from walk(state if dest == INTERNAL else dest, [*path, trigger])

    yield from walk("COLLECTING", [])
