"""Independent oracles for the turn, compaction and steering machines.

Written by hand from DESIGN.md and the issue text, NOT derived from the tables in
``codex_turn.fsm``: a mistyped edge in a table disagrees with these functions. Each oracle
answers "where does ``trigger`` take a run in ``state`` under these facts", with ``None``
meaning the trigger must be rejected. ``INTERNAL`` marks a legal trigger that stays put.
"""

from __future__ import annotations

from typing import Final

INTERNAL: Final = "<internal>"

TURN_STATES = (
    "IDLE",
    "READING_HISTORY",
    "BOOTSTRAPPING",
    "ASSEMBLING",
    "PROJECTING",
    "BUILDING_PROMPT",
    "STARTING_THREAD",
    "REPROJECTING",
    "RUNNING_TURN",
    "MIRRORING",
    "FINALIZING",
    "MAINTAINING",
    "DONE",
    "FAILED",
)
TURN_TERMINAL = frozenset({"DONE", "FAILED"})
TURN_TRIGGERS = (
    "started",
    "history_read",
    "history_read_failed",
    "transcript_unwritable",
    "bootstrapped",
    "bootstrap_failed",
    "bootstrap_skipped",
    "assembled",
    "assemble_failed",
    "assemble_skipped",
    "projected",
    "projected_as_items",  # the structured form: Responses items for a fork
    "projection_failed",
    "prompt_built",
    "thread_started",
    "thread_resumed",
    "thread_rotated",
    "thread_forked",
    "thread_start_failed",
    "thread_resume_failed",
    "fork_failed",
    "reprojected",
    "cancelled",
    "native_compaction_started",
    "native_compaction_completed",
    "steered",  # messages delivered to the running turn (turn/steer): stays in running_turn
    "turn_completed",
    "turn_failed",
    "turn_aborted",
    "turn_yield_aborted",
    "turn_timed_out",
    "turn_overflowed",  # the context window exceeded: retried once, then a failed turn
    "mirrored",
    "mirror_failed",
    "finalized",
    "finalize_failed",
    "maintenance_ran",
    "maintenance_failed",
    "maintenance_deferred",
    "maintenance_dropped",
    "no_such_trigger",  # unknown triggers are illegal everywhere
)
TURN_OUTCOMES = (
    None,
    "completed",
    "failed",
    "aborted",
    "yield_aborted",
    "timed_out",
    "unsaved",
    "context_overflow",
)

# Outcome each running_turn exit establishes, and which of them forbid maintenance.
OUTCOME_BY_EXIT = {
    "turn_completed": "completed",
    "turn_failed": "failed",
    "turn_aborted": "aborted",
    "turn_yield_aborted": "yield_aborted",
    "turn_timed_out": "timed_out",
}


def turn_oracle(
    state: str,
    trigger: str,
    *,
    engine: bool,
    session_file: bool,
    maintains: bool,
    background: bool,
    outcome: str | None,
    bootstraps: bool = True,
    resume_failed: bool = False,
    fork_failed: bool = False,
    overflowed: bool = False,
) -> str | None:
    # ``bootstraps``: the engine has bootstrap() or maintain(); ``resume_failed``: this turn's
    # resume was already refused once (a second refusal is not a step back but illegal);
    # ``fork_failed``: the same for a refused fork; ``overflowed``: this turn already overflowed
    # the context window once (a second overflow ends the turn instead of retrying it).
    can_bootstrap = engine and session_file and bootstraps
    if (
        state
        in (
            "READING_HISTORY",
            "BOOTSTRAPPING",
            "ASSEMBLING",
            "PROJECTING",
            "BUILDING_PROMPT",
            "STARTING_THREAD",
            "REPROJECTING",
        )
        and trigger == "cancelled"
    ):
        # An overflowed turn ran once: whatever ends its retry, it is mirrored and finalized.
        retrying = overflowed and state in ("STARTING_THREAD", "REPROJECTING")
        return "MIRRORING" if retrying else "FAILED"
    if state == "IDLE":
        return "READING_HISTORY" if trigger == "started" else None
    if state == "READING_HISTORY":
        if trigger == "transcript_unwritable":
            return "FAILED"  # nothing reached Codex, nothing to mirror
        return "BOOTSTRAPPING" if trigger in ("history_read", "history_read_failed") else None
    if state == "BOOTSTRAPPING":
        if trigger in ("bootstrapped", "bootstrap_failed"):
            return "ASSEMBLING" if can_bootstrap else None
        if trigger == "bootstrap_skipped":
            return None if can_bootstrap else "ASSEMBLING"
        return None
    if state == "ASSEMBLING":
        if trigger == "assembled":
            return "PROJECTING" if engine else None
        if trigger == "assemble_failed":
            return "BUILDING_PROMPT" if engine else None
        if trigger == "assemble_skipped":
            return None if engine else "BUILDING_PROMPT"
        return None
    if state == "PROJECTING":
        projected = ("projected", "projected_as_items", "projection_failed")
        return "BUILDING_PROMPT" if trigger in projected else None
    if state == "BUILDING_PROMPT":
        return "STARTING_THREAD" if trigger == "prompt_built" else None
    if state == "STARTING_THREAD":
        if trigger in ("thread_started", "thread_resumed", "thread_rotated", "thread_forked"):
            return "RUNNING_TURN"
        if trigger == "thread_resume_failed":
            return None if resume_failed else "REPROJECTING"
        if trigger == "fork_failed":
            return None if fork_failed else "REPROJECTING"
        if trigger == "thread_start_failed":
            return "MIRRORING" if overflowed else "FAILED"
        return None
    if state == "REPROJECTING":
        return "STARTING_THREAD" if trigger == "reprojected" else None
    if state == "RUNNING_TURN":
        if trigger in ("native_compaction_started", "native_compaction_completed", "steered"):
            return INTERNAL
        if trigger == "turn_overflowed":
            return "MIRRORING" if overflowed else "REPROJECTING"
        return "MIRRORING" if trigger in OUTCOME_BY_EXIT else None
    if state == "MIRRORING":
        return "FINALIZING" if trigger in ("mirrored", "mirror_failed") else None
    if state == "FINALIZING":
        if trigger == "finalize_failed":
            return "DONE"
        if trigger == "finalized":
            # A completed turn whose mirror failed is "unsaved": finalize ran from the fallback
            # snapshot, and maintenance is not gated by the mirror.
            allowed = engine and maintains and outcome in ("completed", "unsaved")
            return "MAINTAINING" if allowed else "DONE"
        return None
    if state == "MAINTAINING":
        if trigger in ("maintenance_ran", "maintenance_failed"):
            return None if background else "DONE"
        if trigger in ("maintenance_deferred", "maintenance_dropped"):
            return "DONE" if background else None
        return None
    return None  # DONE, FAILED: nothing happens after a terminal state


def turn_skip_reason(
    *, engine: bool, maintains: bool, outcome: str | None, finalize_failed: bool
) -> str | None:
    """The skip reason the oracle expects on reaching DONE from FINALIZING."""
    if not engine:
        return "no_engine"
    if not maintains:
        return "no_maintain"
    if outcome in (None, "failed", "timed_out", "context_overflow"):
        return "prompt_error"
    if outcome == "yield_aborted":
        return "yield_aborted"
    if outcome == "aborted":
        return "aborted"
    return "finalize_failed" if finalize_failed else None


COMPACTION_STATES = (
    "IDLE",
    "ENGINE_COMPACTING",
    "COMPACTION_MAINTENANCE",
    "NATIVE_COMPACTING",
    "REPORTED",
)
COMPACTION_TERMINAL = frozenset({"REPORTED"})
COMPACTION_TRIGGERS = (
    "started",
    "engine_compacted",
    "engine_declined",
    "engine_failed",
    "engine_aborted",
    "maintenance_ran",
    "maintenance_failed",
    "native_compacted",
    "native_failed",
    "native_timed_out",
    "native_skipped",
    "no_such_trigger",
)


def compaction_oracle(
    state: str, trigger: str, *, owns: bool, binding: bool, manual: bool = True
) -> str | None:
    after_engine = "NATIVE_COMPACTING" if binding else "REPORTED"
    if state == "IDLE" and trigger == "started":
        if owns:
            return "ENGINE_COMPACTING"
        # Without an owning engine only a manual /compact runs native compaction; a budget
        # request is Codex's own automatic compaction's business.
        return after_engine if manual else "REPORTED"
    if state == "ENGINE_COMPACTING":
        if trigger == "engine_compacted":
            return "COMPACTION_MAINTENANCE"
        if trigger in ("engine_declined", "engine_failed"):
            return after_engine
        if trigger == "engine_aborted":  # the caller aborted: nothing more, native neither
            return "REPORTED"
    if state == "COMPACTION_MAINTENANCE" and trigger in ("maintenance_ran", "maintenance_failed"):
        return after_engine
    if state == "NATIVE_COMPACTING" and trigger in (
        "native_compacted",
        "native_failed",
        "native_timed_out",
        "native_skipped",  # a fork base: nothing native to compact
    ):
        return "REPORTED"
    return None


STEER_STATES = (
    "COLLECTING",
    "SENT",
    "LANDED_EARLY",
    "ACCEPTED",
    "TIMED_OUT",
    "LANDED",
    "STEERED",
    "UNANSWERED",
    "QUEUED",
    "TOO_LATE",
    "REFUSED",
    "UNKNOWN",
)
STEER_TERMINAL = frozenset({"STEERED", "UNANSWERED", "QUEUED", "TOO_LATE", "REFUSED", "UNKNOWN"})
STEER_ANSWERS = ("accepted", "timed_out", "arrived_too_late", "refused")
STEER_TRIGGERS = (
    "message_arrived",
    "batch_closed",
    *STEER_ANSWERS,
    "landed",
    "model_worked",
    "turn_completed",
    "steering_ended",
    "no_such_trigger",
)
#: What the runner is told about a batch that ended in each final state: (status, reason).
STEER_RECEIPTS = {
    "STEERED": ("steered", None),
    "UNANSWERED": ("unanswered", None),
    "QUEUED": ("queued", "turn_ended"),  # never sent: the turn ended while it collected
    "TOO_LATE": ("queued", "turn_ended"),  # Codex (or the handle): no turn running
    "REFUSED": ("queued", "refused"),
    "UNKNOWN": ("unknown", "timed_out"),
}

# A live sent batch as the facts the steering docstring reasons with: Codex's answer so far
# (None: still due) and whether its userMessage item arrived.
_SENT_FACTS: dict[str, tuple[str | None, bool]] = {
    "SENT": (None, False),
    "LANDED_EARLY": (None, True),
    "ACCEPTED": ("accepted", False),
    "TIMED_OUT": ("timed_out", False),
    "LANDED": ("accepted or timed_out", True),  # which one no longer matters
}


def _sent_state(answer: str | None, landed: bool) -> str:
    if landed:
        return "LANDED_EARLY" if answer is None else "LANDED"
    return {None: "SENT", "accepted": "ACCEPTED", "timed_out": "TIMED_OUT"}[answer]


def steer_oracle(state: str, trigger: str) -> str | None:
    """Where ``trigger`` takes a batch in ``state`` (``INTERNAL``: stays; ``None``: illegal).

    Written from the steering module's docstring, by facts (sent? answered how? landed?),
    not from the table's rows."""
    if state in STEER_TERMINAL:
        return None  # a fate, once known, never changes
    if state == "COLLECTING":
        return {
            "message_arrived": INTERNAL,
            "batch_closed": "SENT",
            "steering_ended": "QUEUED",  # never sent: run it as the next turn
        }.get(trigger)
    answer, landed = _SENT_FACTS[state]
    if trigger in STEER_ANSWERS:
        if answer is not None:
            return None  # one answer per request
        # Not running, or refused: queued, even when its item already showed.
        if trigger == "arrived_too_late":
            return "TOO_LATE"
        if trigger == "refused":
            return "REFUSED"
        return _sent_state(trigger, landed)
    if trigger == "landed":
        return None if landed else _sent_state(answer, True)
    if trigger == "model_worked":
        return "STEERED" if landed else None  # only work after its item answers it
    if trigger == "turn_completed":
        return "UNANSWERED" if landed else None
    if trigger == "steering_ended":
        # Codex took it (its item showed, or it answered): the thread holds it. Else unknown.
        return "UNANSWERED" if landed or answer == "accepted" else "UNKNOWN"
    return None
