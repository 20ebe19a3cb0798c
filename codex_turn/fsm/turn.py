"""The turn machine: one Codex turn driven through a context engine, as a table.

Rule 1: every decision about what happens next in a turn lives in this file, in
``TURN_TABLE`` and the guard properties of :class:`TurnModel`. The orchestrator never
branches on its own: it awaits a stage's work, then fires the past-tense trigger that
describes what happened (``history_read``, ``assemble_failed``, ``turn_aborted`` ...), and the
table decides where the turn goes.

Rule 2: this file performs no I/O and knows nothing of Codex, engines or files. Facts about
the world arrive in two ways only: :class:`TurnFacts`, fixed when the turn begins (is a
non-legacy engine active, did the session file exist before this turn wrote anything, can the
engine maintain, does it want maintenance in the background), and the triggers themselves,
from which the model records the turn's outcome.

Theory of operation. A turn is a pipeline of stages with a fallback at every stage, because a
context engine is a plugin and must never be able to break a turn:

    idle -> reading_history -> bootstrapping -> assembling -> projecting -> building_prompt
         -> starting_thread -> running_turn -> mirroring -> finalizing -> maintaining -> done

* reading_history first checks that the transcript can take this turn's mirror (a directory,
  a FIFO, a foreign file, no permission): if not, the turn ends ``failed`` with the outcome
  ``transcript_unwritable`` before anything reached Codex, and the runner gets a typed error.
* bootstrapping is entered on every turn and either bootstraps (only with an active engine and
  a session file that existed before the turn) or is skipped; a failed bootstrap continues.
* assembling without an active engine is skipped straight to building_prompt (the turn is
  plain Codex); a failed assemble also skips projection and keeps the baseline prompt.
* projecting falls back to the baseline prompt on failure. It exits in one of two forms,
  as the form table (``codex_turn.fsm.thread.FORM_RULES``) chooses: ``projected`` (the text
  frame, one user message) or ``projected_as_items`` (Responses items, injected into an
  ephemeral fork of the session's base thread: the thread decision ``fork``).
* A fork Codex refused (the fork or its items) steps back to reprojecting like a refused
  resume, once per turn (``may_retry_fork``): the thread table then rotates to a fresh thread
  with the text frame.
* starting_thread starts, resumes or rotates the Codex thread, as the thread table
  (``codex_turn.fsm.thread``) decides; failing to start one is the only in-flight failure that
  is terminal (``failed``), because nothing reached Codex and there is nothing to mirror.
  ``cancelled`` ends any pre-Codex stage the same way.
* A resume that Codex refuses goes to reprojecting (once per turn: the guard
  ``may_retry_resume``): the thread table then rotates to a fresh thread, which has no native
  history and therefore gets the projected context; reprojecting rebuilds the prompt for it and
  returns to starting_thread. A step back made visible, never a loop inside a stage.
* running_turn ends in exactly one of five outcomes; how Codex's own turn status maps to them
  is :data:`RUN_END_TRIGGERS`. A failed turn Codex typed as the context window exceeded
  (``turn_overflowed``, ``may_retry_overflow``) steps back once to reprojecting: the thread
  table rotates to a fresh thread that carries the conversation, and the turn runs again; a
  second overflow ends it ``context_overflow``. Once the turn ran, its retry's pre-Codex
  endings (a failed thread start, a cancellation) go to mirroring like any turn that ran.
  Codex's in-turn compactions are internal transitions, counted
  but not leaving the state; so is each batch of messages steered into the running turn
  (``steered``, one per ``turn/steer``, counted in ``steers``).
* Once running_turn was reached, mirroring and finalizing always follow (an engine must see
  every turn that ran, OpenClaw bug #121515); a failed mirror finalizes from the fallback
  snapshot, and turns a completed outcome into ``unsaved`` (maintenance is not gated by it).
  An engine with durable turns is settled in finalizing by ``commit_turn``, from the outbox
  whose own table is :mod:`codex_turn.fsm.outbox`: the same two exits (``duplicate`` is
  ``finalized``; a commit that fails, ``finalize_failed``), so the course is the same.
* After finalizing the table, not the orchestrator, chooses between maintaining and skipping;
  a skip records one :class:`SkipReason`. Whether maintenance runs inline or is deferred to a
  scheduler is a fact fixed when the turn begins (:meth:`TurnFacts.gather`); a scheduler that
  drops the request ends the turn with ``maintenance_dropped``. Maintenance never fails a turn.
* A stage cut short (the caller left; for mirroring and finalizing, once the cleanup bound
  expired too) ends with the trigger :data:`CUT_SHORT_TRIGGERS` names for its state.

Guards are tried in declaration order; the first edge whose guards hold wins. A trigger
whose edges are all closed is illegal like any other (see ``_machine``).

WARNING: ``diagrams/turn.mmd`` is rendered from this table by ``python -m codex_turn
diagrams`` (:mod:`codex_turn.diagrams`); a test fails when the committed diagram is stale.
"""

from __future__ import annotations

import enum

import attrs

from codex_turn.fsm._machine import Edge, Model, TableMachine
from codex_turn.fsm.thread import ProjectionForm, ThreadAction

__all__ = [
    "ASSEMBLE_TRIGGERS",
    "BOOTSTRAP_TRIGGERS",
    "CUT_SHORT_TRIGGERS",
    "FINALIZE_TRIGGERS",
    "FORM_TRIGGERS",
    "MAINTENANCE_TRIGGERS",
    "RUN_END_TRIGGERS",
    "THREAD_TRIGGERS",
    "TURN_TABLE",
    "RunEnd",
    "SkipReason",
    "TurnFacts",
    "TurnModel",
    "TurnOutcome",
    "TurnState",
    "TurnTrigger",
    "bootstrap_skip_reason",
    "defers_maintenance",
    "maintenance_skip_reason",
    "run_end_trigger",
]


class TurnState(enum.Enum):
    IDLE = "idle"
    READING_HISTORY = "reading_history"
    BOOTSTRAPPING = "bootstrapping"
    ASSEMBLING = "assembling"
    PROJECTING = "projecting"
    BUILDING_PROMPT = "building_prompt"
    STARTING_THREAD = "starting_thread"
    REPROJECTING = "reprojecting"
    RUNNING_TURN = "running_turn"
    MIRRORING = "mirroring"
    FINALIZING = "finalizing"
    MAINTAINING = "maintaining"
    DONE = "done"
    FAILED = "failed"


class TurnTrigger(enum.StrEnum):
    STARTED = "started"
    HISTORY_READ = "history_read"
    HISTORY_READ_FAILED = "history_read_failed"
    TRANSCRIPT_UNWRITABLE = "transcript_unwritable"
    BOOTSTRAPPED = "bootstrapped"
    BOOTSTRAP_FAILED = "bootstrap_failed"
    BOOTSTRAP_SKIPPED = "bootstrap_skipped"
    ASSEMBLED = "assembled"
    ASSEMBLE_FAILED = "assemble_failed"
    ASSEMBLE_SKIPPED = "assemble_skipped"
    PROJECTED = "projected"
    #: The assembly converted to Responses items (the structured form).
    PROJECTED_AS_ITEMS = "projected_as_items"
    PROJECTION_FAILED = "projection_failed"
    PROMPT_BUILT = "prompt_built"
    THREAD_STARTED = "thread_started"
    THREAD_RESUMED = "thread_resumed"
    THREAD_ROTATED = "thread_rotated"
    #: The turn runs in an ephemeral fork of the base thread, the items injected.
    THREAD_FORKED = "thread_forked"
    #: Codex refused the fork or its items (the turn falls back to the text frame).
    FORK_FAILED = "fork_failed"
    THREAD_START_FAILED = "thread_start_failed"
    THREAD_RESUME_FAILED = "thread_resume_failed"
    REPROJECTED = "reprojected"
    CANCELLED = "cancelled"
    NATIVE_COMPACTION_STARTED = "native_compaction_started"
    NATIVE_COMPACTION_COMPLETED = "native_compaction_completed"
    #: Messages that arrived while the turn ran were delivered to it (one ``turn/steer``).
    STEERED = "steered"
    TURN_COMPLETED = "turn_completed"
    TURN_FAILED = "turn_failed"
    TURN_ABORTED = "turn_aborted"
    TURN_YIELD_ABORTED = "turn_yield_aborted"
    TURN_TIMED_OUT = "turn_timed_out"
    #: Codex reported the model's context window exceeded (it never retries that itself).
    TURN_OVERFLOWED = "turn_overflowed"
    MIRRORED = "mirrored"
    MIRROR_FAILED = "mirror_failed"
    FINALIZED = "finalized"
    FINALIZE_FAILED = "finalize_failed"
    MAINTENANCE_RAN = "maintenance_ran"
    MAINTENANCE_FAILED = "maintenance_failed"
    MAINTENANCE_DEFERRED = "maintenance_deferred"
    MAINTENANCE_DROPPED = "maintenance_dropped"


class TurnOutcome(enum.Enum):
    """How the turn ended. The first five come from running_turn; the last two are terminal."""

    COMPLETED = "completed"
    FAILED = "failed"  # Codex reported a prompt error
    ABORTED = "aborted"
    YIELD_ABORTED = "yield_aborted"
    TIMED_OUT = "timed_out"
    THREAD_START_FAILED = "thread_start_failed"
    CANCELLED = "cancelled"
    #: Codex completed the turn but its reply could not be written to the transcript (the
    #: mirror failed): the user has an answer the session does not remember.
    UNSAVED = "unsaved"
    #: The transcript cannot take this turn (checked before anything reached Codex).
    TRANSCRIPT_UNWRITABLE = "transcript_unwritable"
    #: The model's context window was exceeded again on the fresh thread the turn was
    #: retried on (the prompt is in the transcript; the model never answered it).
    CONTEXT_OVERFLOW = "context_overflow"

    @property
    def prompt_error(self) -> bool:
        return self in (TurnOutcome.FAILED, TurnOutcome.TIMED_OUT, TurnOutcome.CONTEXT_OVERFLOW)

    @property
    def aborted(self) -> bool:
        # A timeout interrupts the turn and a yield aborts the run: both count as aborted.
        return self in (TurnOutcome.ABORTED, TurnOutcome.YIELD_ABORTED, TurnOutcome.TIMED_OUT)

    @property
    def yield_aborted(self) -> bool:
        return self is TurnOutcome.YIELD_ABORTED


class SkipReason(enum.Enum):
    """Why turn maintenance did not run. Structural reasons first, then the turn's fate."""

    NO_ENGINE = "no_engine"
    NO_MAINTAIN = "no_maintain"
    PROMPT_ERROR = "prompt_error"
    YIELD_ABORTED = "yield_aborted"
    ABORTED = "aborted"
    FINALIZE_FAILED = "finalize_failed"


class RunEnd(enum.Enum):
    """How the Codex turn itself ended, as the app-server reported it (the harness's words for
    Codex's turn status; the first four values equal the client's ``CodexTurnStatus`` values,
    the last is a failed turn whose error Codex typed as the context window exceeded)."""

    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    TIMED_OUT = "timed_out"
    OVERFLOWED = "overflowed"


#: The running_turn exit for each way the Codex turn can end, and whether the model asked to
#: yield (``sessions_yield``): an interrupt after a yield request is the yield, anything else
#: keeps its own meaning (a turn that completed although a yield was asked did complete).
RUN_END_TRIGGERS: dict[tuple[RunEnd, bool], TurnTrigger] = {
    (RunEnd.COMPLETED, False): TurnTrigger.TURN_COMPLETED,
    (RunEnd.COMPLETED, True): TurnTrigger.TURN_COMPLETED,
    (RunEnd.FAILED, False): TurnTrigger.TURN_FAILED,
    (RunEnd.FAILED, True): TurnTrigger.TURN_FAILED,
    (RunEnd.TIMED_OUT, False): TurnTrigger.TURN_TIMED_OUT,
    (RunEnd.TIMED_OUT, True): TurnTrigger.TURN_TIMED_OUT,
    (RunEnd.INTERRUPTED, False): TurnTrigger.TURN_ABORTED,
    (RunEnd.INTERRUPTED, True): TurnTrigger.TURN_YIELD_ABORTED,
    (RunEnd.OVERFLOWED, False): TurnTrigger.TURN_OVERFLOWED,
    (RunEnd.OVERFLOWED, True): TurnTrigger.TURN_OVERFLOWED,
}


#: The starting_thread exit for each thread decision that Codex carried out.
THREAD_TRIGGERS: dict[ThreadAction, TurnTrigger] = {
    ThreadAction.START: TurnTrigger.THREAD_STARTED,
    ThreadAction.TRANSIENT: TurnTrigger.THREAD_STARTED,
    ThreadAction.ROTATE: TurnTrigger.THREAD_ROTATED,
    ThreadAction.RESUME: TurnTrigger.THREAD_RESUMED,
    ThreadAction.FORK: TurnTrigger.THREAD_FORKED,
}


#: The projecting exit for each form the form table chose (``FORM_RULES``).
FORM_TRIGGERS: dict[ProjectionForm, TurnTrigger] = {
    ProjectionForm.TEXT: TurnTrigger.PROJECTED,
    ProjectionForm.ITEMS: TurnTrigger.PROJECTED_AS_ITEMS,
}


#: The engine stages' exits, by how the engine call went: the ``status`` of the harness's
#: lifecycle outcome (``harness.lifecycle``, ``harness.maintenance``), read by the stages and by
#: the outcomes' own ``trigger``. An engine call that timed out is ``failed``.
BOOTSTRAP_TRIGGERS: dict[str, TurnTrigger] = {
    "bootstrapped": TurnTrigger.BOOTSTRAPPED,
    "failed": TurnTrigger.BOOTSTRAP_FAILED,
    "skipped": TurnTrigger.BOOTSTRAP_SKIPPED,
}
ASSEMBLE_TRIGGERS: dict[str, TurnTrigger] = {
    "assembled": TurnTrigger.ASSEMBLED,
    "failed": TurnTrigger.ASSEMBLE_FAILED,
    "skipped": TurnTrigger.ASSEMBLE_SKIPPED,
}
#: The finalizing exit by whether the engine took the turn (``FinalizeOutcome.succeeded``).
FINALIZE_TRIGGERS: dict[bool, TurnTrigger] = {
    True: TurnTrigger.FINALIZED,
    False: TurnTrigger.FINALIZE_FAILED,
}
#: The maintaining exit: run inline (``ran``, ``failed``) or handed to a scheduler that took
#: the request (``deferred``) or dropped it (``dropped``: rejected, or the scheduler closed).
#: A request that attempted nothing (``skipped``) has no exit: the table skips maintaining.
MAINTENANCE_TRIGGERS: dict[str, TurnTrigger] = {
    "ran": TurnTrigger.MAINTENANCE_RAN,
    "failed": TurnTrigger.MAINTENANCE_FAILED,
    "deferred": TurnTrigger.MAINTENANCE_DEFERRED,
    "dropped": TurnTrigger.MAINTENANCE_DROPPED,
}


def run_end_trigger(end: RunEnd | str, *, yield_requested: bool) -> TurnTrigger:
    """The running_turn exit for a Codex turn that ended as ``end`` (:data:`RUN_END_TRIGGERS`)."""
    return RUN_END_TRIGGERS[(RunEnd(end), yield_requested)]


# Which outcome each terminal-for-the-stage trigger establishes.
OUTCOME_OF_TRIGGER: dict[str, TurnOutcome] = {
    TurnTrigger.TURN_COMPLETED: TurnOutcome.COMPLETED,
    TurnTrigger.TURN_FAILED: TurnOutcome.FAILED,
    TurnTrigger.TURN_ABORTED: TurnOutcome.ABORTED,
    TurnTrigger.TURN_YIELD_ABORTED: TurnOutcome.YIELD_ABORTED,
    TurnTrigger.TURN_TIMED_OUT: TurnOutcome.TIMED_OUT,
    TurnTrigger.THREAD_START_FAILED: TurnOutcome.THREAD_START_FAILED,
    TurnTrigger.CANCELLED: TurnOutcome.CANCELLED,
    TurnTrigger.TRANSCRIPT_UNWRITABLE: TurnOutcome.TRANSCRIPT_UNWRITABLE,
}


#: The outcome of a pre-Codex ending of an overflowed turn's retry (the turn ran once: it
#: is mirrored and finalized like any turn that ran, and the engine is told it failed).
OUTCOME_AFTER_OVERFLOW: dict[str, TurnOutcome] = {
    TurnTrigger.THREAD_START_FAILED: TurnOutcome.CONTEXT_OVERFLOW,
    TurnTrigger.CANCELLED: TurnOutcome.ABORTED,
}


@attrs.frozen
class TurnFacts:
    """What is known about the world when the turn begins; the guards read only these."""

    engine_active: bool = False  # a non-legacy engine is configured
    #: The transcript existed before this turn wrote anything (gathered only when an engine
    #: bootstraps or maintains: only the bootstrap guard reads it; ``False`` otherwise).
    had_session_file: bool = False
    engine_maintains: bool = False  # the engine implements maintain()
    background_maintenance: bool = False  # maintenance is deferred to a scheduler
    engine_bootstraps: bool = True  # the engine implements bootstrap() or maintain()

    @classmethod
    def gather(
        cls,
        *,
        engine_active: bool,
        had_session_file: bool,
        has_bootstrap: bool,
        has_maintain: bool,
        maintenance_mode: str,
        has_scheduler: bool,
    ) -> TurnFacts:
        """The facts of a turn from what the runner observed (the one place they are derived).

        Deferring needs somewhere to run: an engine in background mode without a scheduler
        maintains inline.
        """
        return cls(
            engine_active=engine_active,
            had_session_file=had_session_file,
            engine_maintains=engine_active and has_maintain,
            background_maintenance=engine_active
            and defers_maintenance(maintenance_mode=maintenance_mode, has_scheduler=has_scheduler),
            engine_bootstraps=engine_active and (has_bootstrap or has_maintain),
        )


def defers_maintenance(*, maintenance_mode: str, has_scheduler: bool) -> bool:
    """Whether turn maintenance is deferred to a scheduler (the fact ``background_maintenance``).

    An engine in ``background`` mode asks not to be awaited; deferring needs somewhere to run,
    so without a scheduler its maintenance runs inline.
    """
    return maintenance_mode == "background" and has_scheduler


def bootstrap_skip_reason(
    *, engine_active: bool, had_session_file: bool, has_bootstrap: bool, has_maintain: bool
) -> str | None:
    """Why bootstrap must not run, or ``None`` when it may (the guard ``may_bootstrap``).

    A brand-new session (no file before this turn) has nothing to reconcile; an engine with
    neither ``bootstrap`` nor ``maintain`` has nothing to call.
    """
    if not engine_active:
        return "no_engine"
    if not had_session_file:
        return "no_session_file"
    if not (has_bootstrap or has_maintain):
        return "no_bootstrap_or_maintain"
    return None


def maintenance_skip_reason(
    *,
    engine_active: bool,
    engine_maintains: bool,
    prompt_error: bool,
    aborted: bool,
    yield_aborted: bool,
    finalize_failed: bool,
) -> SkipReason | None:
    """Why turn maintenance must not run after a turn, or ``None`` when it may.

    The one implementation of the rule (the guard ``maintenance_allowed`` and the lifecycle
    helpers both ask it). Structural reasons first, then the turn's fate.
    """
    if not engine_active:
        return SkipReason.NO_ENGINE
    if not engine_maintains:
        return SkipReason.NO_MAINTAIN
    if prompt_error:
        return SkipReason.PROMPT_ERROR
    if yield_aborted:
        return SkipReason.YIELD_ABORTED
    if aborted:
        return SkipReason.ABORTED
    if finalize_failed:
        return SkipReason.FINALIZE_FAILED
    return None


S = TurnState
T = TurnTrigger


_CANCEL = Edge(T.CANCELLED, S.FAILED)
# Once the turn ran (an overflow retry is on its way), every ending mirrors and finalizes it.
_CANCEL_RETRY = (
    Edge(T.CANCELLED, S.MIRRORING, when=("overflowed",)),
    Edge(T.CANCELLED, S.FAILED, unless=("overflowed",)),
)

TURN_TABLE: dict[TurnState, tuple[Edge, ...]] = {
    # State: idle
    S.IDLE: (Edge(T.STARTED, S.READING_HISTORY),),
    # State: reading_history (a failed read continues with empty history; a transcript that
    # cannot take this turn ends it before anything reaches Codex)
    S.READING_HISTORY: (
        Edge(T.HISTORY_READ, S.BOOTSTRAPPING),
        Edge(T.HISTORY_READ_FAILED, S.BOOTSTRAPPING),
        Edge(T.TRANSCRIPT_UNWRITABLE, S.FAILED),
        _CANCEL,
    ),
    # State: bootstrapping (only with an engine and a pre-existing transcript; failure continues)
    S.BOOTSTRAPPING: (
        Edge(T.BOOTSTRAPPED, S.ASSEMBLING, when=("may_bootstrap",)),
        Edge(T.BOOTSTRAP_FAILED, S.ASSEMBLING, when=("may_bootstrap",)),
        Edge(T.BOOTSTRAP_SKIPPED, S.ASSEMBLING, unless=("may_bootstrap",)),
        _CANCEL,
    ),
    # State: assembling (no engine: plain Codex; failure: baseline prompt, no projection)
    S.ASSEMBLING: (
        Edge(T.ASSEMBLED, S.PROJECTING, when=("engine_active",)),
        Edge(T.ASSEMBLE_FAILED, S.BUILDING_PROMPT, when=("engine_active",)),
        Edge(T.ASSEMBLE_SKIPPED, S.BUILDING_PROMPT, unless=("engine_active",)),
        _CANCEL,
    ),
    # State: projecting (failure: baseline prompt and instructions)
    S.PROJECTING: (
        Edge(T.PROJECTED, S.BUILDING_PROMPT),
        Edge(T.PROJECTED_AS_ITEMS, S.BUILDING_PROMPT),
        Edge(T.PROJECTION_FAILED, S.BUILDING_PROMPT),
        _CANCEL,
    ),
    # State: building_prompt (before_prompt_build hooks; their errors are ignored)
    S.BUILDING_PROMPT: (
        Edge(T.PROMPT_BUILT, S.STARTING_THREAD),
        _CANCEL,
    ),
    # State: starting_thread (the only terminal failure: nothing reached Codex; a refused
    # resume steps back once, to rebuild the prompt for a fresh thread)
    S.STARTING_THREAD: (
        Edge(T.THREAD_STARTED, S.RUNNING_TURN),
        Edge(T.THREAD_RESUMED, S.RUNNING_TURN),
        Edge(T.THREAD_ROTATED, S.RUNNING_TURN),
        Edge(T.THREAD_FORKED, S.RUNNING_TURN),
        Edge(T.THREAD_RESUME_FAILED, S.REPROJECTING, when=("may_retry_resume",)),
        Edge(T.FORK_FAILED, S.REPROJECTING, when=("may_retry_fork",)),
        Edge(T.THREAD_START_FAILED, S.MIRRORING, when=("overflowed",)),
        Edge(T.THREAD_START_FAILED, S.FAILED, unless=("overflowed",)),
        *_CANCEL_RETRY,
    ),
    # State: reprojecting (the fresh thread gets the projected context, not the raw prompt;
    # after an overflow, the conversation it carries)
    S.REPROJECTING: (
        Edge(T.REPROJECTED, S.STARTING_THREAD),
        *_CANCEL_RETRY,
    ),
    # State: running_turn (native compactions are internal; five ways out, all to mirroring)
    S.RUNNING_TURN: (
        Edge(T.NATIVE_COMPACTION_STARTED, None),
        Edge(T.NATIVE_COMPACTION_COMPLETED, None),
        Edge(T.TURN_COMPLETED, S.MIRRORING),
        Edge(T.TURN_FAILED, S.MIRRORING),
        Edge(T.TURN_ABORTED, S.MIRRORING),
        Edge(T.TURN_YIELD_ABORTED, S.MIRRORING),
        Edge(T.TURN_TIMED_OUT, S.MIRRORING),
        # An overflow is retried once, on a fresh thread that carries the conversation (the
        # thread table rotates); a second one fails the turn like a prompt error.
        Edge(T.TURN_OVERFLOWED, S.REPROJECTING, when=("may_retry_overflow",)),
        Edge(T.TURN_OVERFLOWED, S.MIRRORING, unless=("may_retry_overflow",)),
        # Messages that arrived meanwhile, delivered to the running turn (``turn/steer``).
        Edge(T.STEERED, None),
    ),
    # State: mirroring (a failed mirror still finalizes, from history + snapshot)
    S.MIRRORING: (
        Edge(T.MIRRORED, S.FINALIZING),
        Edge(T.MIRROR_FAILED, S.FINALIZING),
    ),
    # State: finalizing (the table decides: maintain, or skip with a recorded reason)
    S.FINALIZING: (
        Edge(T.FINALIZED, S.MAINTAINING, when=("maintenance_allowed",)),
        Edge(T.FINALIZED, S.DONE, unless=("maintenance_allowed",)),
        Edge(T.FINALIZE_FAILED, S.DONE),
    ),
    # State: maintaining (never fails the turn; background mode defers it, and a scheduler
    # that refuses the request drops it)
    S.MAINTAINING: (
        Edge(T.MAINTENANCE_RAN, S.DONE, unless=("background_maintenance",)),
        Edge(T.MAINTENANCE_FAILED, S.DONE, unless=("background_maintenance",)),
        Edge(T.MAINTENANCE_DEFERRED, S.DONE, when=("background_maintenance",)),
        Edge(T.MAINTENANCE_DROPPED, S.DONE, when=("background_maintenance",)),
    ),
    # Final states: nothing happens after them.
    S.DONE: (),
    S.FAILED: (),
}

#: What a stage cut short by the caller's cancellation (or, for the cleanup stages, by the
#: cleanup deadline once the caller is gone) reports: the first of its triggers that the table
#: allows. Before Codex the turn is cancelled; a cut foreground maintenance failed; a
#: deferral that could not be handed over is dropped (deferring never blocks, so the
#: orchestrator still defers when the caller has left). running_turn is absent: an
#: interrupted Codex turn is an ending of its own (:data:`RUN_END_TRIGGERS`).
CUT_SHORT_TRIGGERS: dict[TurnState, tuple[TurnTrigger, ...]] = {
    S.READING_HISTORY: (T.CANCELLED,),
    S.BOOTSTRAPPING: (T.CANCELLED,),
    S.ASSEMBLING: (T.CANCELLED,),
    S.PROJECTING: (T.CANCELLED,),
    S.BUILDING_PROMPT: (T.CANCELLED,),
    S.STARTING_THREAD: (T.CANCELLED,),
    S.REPROJECTING: (T.CANCELLED,),
    S.MIRRORING: (T.MIRROR_FAILED,),
    S.FINALIZING: (T.FINALIZE_FAILED,),
    S.MAINTAINING: (T.MAINTENANCE_FAILED, T.MAINTENANCE_DROPPED),
}

TURN_MACHINE = TableMachine(
    name="turn",
    states=TurnState,
    table=TURN_TABLE,
    initial=TurnState.IDLE,
    final=(TurnState.DONE, TurnState.FAILED),
)


@attrs.define(eq=False, slots=False)
class TurnModel(Model):
    """One turn's run through :data:`TURN_TABLE`: state, trace, outcome and skip reason.

    Create one per turn with :meth:`begin`; it attaches to the process-wide machine and
    detaches itself when it reaches ``done`` or ``failed``.
    """

    machine = TURN_MACHINE

    facts: TurnFacts = attrs.field(factory=TurnFacts)
    outcome: TurnOutcome | None = attrs.field(init=False, default=None)
    skip_reason: SkipReason | None = attrs.field(init=False, default=None)
    native_compactions: int = attrs.field(init=False, default=0)
    #: Batches of messages steered into the running Codex turn (one ``turn/steer`` each).
    steers: int = attrs.field(init=False, default=0)
    #: Codex refused this turn's resume (the thread table then rotates).
    resume_failed: bool = attrs.field(init=False, default=False)
    #: Codex refused this turn's fork or its items (the text frame follows).
    fork_failed: bool = attrs.field(init=False, default=False)
    #: Codex reported this turn's context window exceeded (the turn was retried).
    overflowed: bool = attrs.field(init=False, default=False)

    @classmethod
    def begin(
        cls,
        facts: TurnFacts | None = None,
        *,
        state: TurnState = TurnState.IDLE,
        outcome: TurnOutcome | None = None,
    ) -> TurnModel:
        """A new turn in ``state`` (tests start mid-table; runners always start idle)."""
        model = cls(facts=facts or TurnFacts())
        model.outcome = outcome
        model._attach(state)
        return model

    # Guards (read by the table by name).
    @property
    def engine_active(self) -> bool:
        return self.facts.engine_active

    @property
    def may_bootstrap(self) -> bool:
        facts = self.facts
        return facts.engine_active and facts.had_session_file and facts.engine_bootstraps

    @property
    def may_retry_resume(self) -> bool:
        return not self.resume_failed

    @property
    def may_retry_fork(self) -> bool:
        return not self.fork_failed

    @property
    def may_retry_overflow(self) -> bool:
        return not self.overflowed

    def _skip_reason(self, *, finalize_failed: bool) -> SkipReason | None:
        outcome = self.outcome
        return maintenance_skip_reason(
            engine_active=self.facts.engine_active,
            engine_maintains=self.facts.engine_maintains,
            # No recorded outcome means the turn never ran cleanly: treat as a prompt error.
            prompt_error=outcome is None or outcome.prompt_error,
            aborted=outcome is not None and outcome.aborted,
            yield_aborted=outcome is not None and outcome.yield_aborted,
            finalize_failed=finalize_failed,
        )

    @property
    def maintenance_allowed(self) -> bool:
        return self._skip_reason(finalize_failed=False) is None

    @property
    def background_maintenance(self) -> bool:
        return self.facts.background_maintenance

    def cut_short_trigger(self) -> TurnTrigger | None:
        """How the current cleanup stage ends when it is cut short (:data:`CUT_SHORT_TRIGGERS`);
        ``None`` outside the cleanup stages."""
        for trigger in CUT_SHORT_TRIGGERS.get(self.state, ()):
            if self.allows(trigger):
                return trigger
        return None

    def _on_fired(self, trigger: str) -> None:
        if trigger == TurnTrigger.THREAD_RESUME_FAILED:
            self.resume_failed = True
        elif trigger == TurnTrigger.FORK_FAILED:
            self.fork_failed = True
        elif trigger == TurnTrigger.TURN_OVERFLOWED:
            if self.overflowed:  # the retry overflowed too: the turn ends with it
                self.outcome = TurnOutcome.CONTEXT_OVERFLOW
            self.overflowed = True
        elif trigger == TurnTrigger.MIRROR_FAILED and self.outcome is TurnOutcome.COMPLETED:
            self.outcome = TurnOutcome.UNSAVED
        elif trigger in OUTCOME_OF_TRIGGER:
            self.outcome = OUTCOME_OF_TRIGGER[trigger]
            if self.overflowed and self.state_name == "MIRRORING":
                # The retry of an overflowed turn never ran: the turn ends as what happened.
                self.outcome = OUTCOME_AFTER_OVERFLOW.get(trigger, self.outcome)
        elif trigger == TurnTrigger.NATIVE_COMPACTION_COMPLETED:
            self.native_compactions += 1
        elif trigger == TurnTrigger.STEERED:
            self.steers += 1
        elif trigger == TurnTrigger.FINALIZE_FAILED or (
            trigger == TurnTrigger.FINALIZED and self.state_name == "DONE"
        ):
            self.skip_reason = self._skip_reason(
                finalize_failed=trigger == TurnTrigger.FINALIZE_FAILED
            )
