"""The compaction machine: who compacts a session, in which order, and what is reported.

Two compaction systems exist and must never be silently conflated: the context engine's
``compact()`` and Codex's native ``thread/compact/start``. This table makes the ownership
decision explicit and terminal (OpenClaw bugs #82008, #85958, #115666 came from chaining
fallbacks across that boundary).

Rule 1: every decision about what happens next lives in ``COMPACTION_TABLE`` and the guards
of :class:`CompactionModel`. Rule 2: no I/O; facts arrive as :class:`CompactionFacts` (does
an active engine own compaction, is there a Codex thread binding) and as past-tense triggers.

Theory of operation:

* An owning engine compacts first and its result is primary. If it compacted, maintenance
  runs (reason "compaction"). Then, only when a thread binding exists, Codex native
  compaction runs as a best-effort secondary step. An engine failure still goes to native
  compaction; a native failure never turns a successful engine result into a failure (that
  is the result-building code's job, but the table guarantees native runs after either).
  An engine compaction the caller aborted (the host's abort signal) is reported at once:
  an abort is not a failure to fall back from.
* A non-owning engine, or none: a *manual* request (a user's ``/compact``) runs native
  compaction only, exactly as Codex does it. A budget request (``budget``/``overflow``/
  ``threshold``) is left to Codex's own automatic compaction (the runtime contract: automatic
  compaction belongs to Codex, #85958) and goes straight to ``reported``; so does any request
  without a binding (there is nothing to compact).
* compaction_maintenance follows only an engine that compacted: the binding's projection is
  cleared (the next turn re-projects the compacted context), then maintenance runs.
* What native compaction does is a small rule table of its own (:data:`NATIVE_RULES`), read
  from the binding as it is when the step begins (:class:`NativeFacts`): no binding fails it,
  a fork base holds no native history and skips it (``native_skipped``), a binding of another
  auth profile fails it closed, and only then is Codex asked.
* How each step's result leaves its state is data too: :data:`ENGINE_RESULT_TRIGGERS`,
  :data:`MAINTENANCE_TRIGGERS` and :data:`NATIVE_REPORT_TRIGGERS`. The runner
  (:mod:`codex_turn.harness.compaction`) awaits each step on the one driver every machine runs
  on and fires the trigger these say; it never chooses.

WARNING: ``diagrams/compaction.mmd`` is rendered from this table; a test fails when stale.
"""

from __future__ import annotations

import enum

import attrs

from codex_turn.fsm._machine import Edge, Model, TableMachine
from codex_turn.fsm.thread import Rule

__all__ = [
    "COMPACTION_TABLE",
    "ENGINE_RESULT_TRIGGERS",
    "MAINTENANCE_TRIGGERS",
    "NATIVE_REPORT_TRIGGERS",
    "NATIVE_RULES",
    "CompactionFacts",
    "CompactionModel",
    "CompactionState",
    "CompactionTrigger",
    "NativeAction",
    "NativeFacts",
]


class CompactionState(enum.Enum):
    IDLE = "idle"
    ENGINE_COMPACTING = "engine_compacting"
    COMPACTION_MAINTENANCE = "compaction_maintenance"
    NATIVE_COMPACTING = "native_compacting"
    REPORTED = "reported"


class CompactionTrigger(enum.StrEnum):
    STARTED = "started"
    ENGINE_COMPACTED = "engine_compacted"
    ENGINE_DECLINED = "engine_declined"  # ok, but nothing compacted (e.g. below threshold)
    ENGINE_FAILED = "engine_failed"
    ENGINE_ABORTED = "engine_aborted"  # the host's abort signal fired: no native either
    MAINTENANCE_RAN = "maintenance_ran"
    MAINTENANCE_FAILED = "maintenance_failed"
    NATIVE_COMPACTED = "native_compacted"
    NATIVE_FAILED = "native_failed"
    NATIVE_TIMED_OUT = "native_timed_out"
    NATIVE_SKIPPED = "native_skipped"  # a fork base: no native history to compact


@attrs.frozen
class CompactionFacts:
    engine_owns: bool = False  # an active (non-legacy) engine with info.owns_compaction
    has_binding: bool = False  # a Codex thread binding exists for the session
    manual: bool = True  # a user's explicit /compact (else a budget-triggered request)


S = CompactionState
T = CompactionTrigger

# After the engine's part: native compaction when there is a thread to compact, else report.
_THEN_NATIVE = ("has_binding",)

COMPACTION_TABLE: dict[CompactionState, tuple[Edge, ...]] = {
    # State: idle (the ownership decision, made once)
    S.IDLE: (
        Edge(T.STARTED, S.ENGINE_COMPACTING, when=("engine_owns",)),
        Edge(
            T.STARTED, S.NATIVE_COMPACTING, when=(*_THEN_NATIVE, "manual"), unless=("engine_owns",)
        ),
        Edge(T.STARTED, S.REPORTED, unless=("engine_owns", "has_binding")),
        # A budget request without an owning engine: Codex compacts automatically.
        Edge(T.STARTED, S.REPORTED, when=("left_to_codex",)),
    ),
    # State: engine_compacting (primary; failure still proceeds to native)
    S.ENGINE_COMPACTING: (
        Edge(T.ENGINE_COMPACTED, S.COMPACTION_MAINTENANCE),
        Edge(T.ENGINE_DECLINED, S.NATIVE_COMPACTING, when=_THEN_NATIVE),
        Edge(T.ENGINE_DECLINED, S.REPORTED, unless=_THEN_NATIVE),
        Edge(T.ENGINE_FAILED, S.NATIVE_COMPACTING, when=_THEN_NATIVE),
        Edge(T.ENGINE_FAILED, S.REPORTED, unless=_THEN_NATIVE),
        # The caller aborted the compaction: nothing more is done, native included.
        Edge(T.ENGINE_ABORTED, S.REPORTED),
    ),
    # State: compaction_maintenance (only after the engine compacted; never fatal)
    S.COMPACTION_MAINTENANCE: (
        Edge(T.MAINTENANCE_RAN, S.NATIVE_COMPACTING, when=_THEN_NATIVE),
        Edge(T.MAINTENANCE_RAN, S.REPORTED, unless=_THEN_NATIVE),
        Edge(T.MAINTENANCE_FAILED, S.NATIVE_COMPACTING, when=_THEN_NATIVE),
        Edge(T.MAINTENANCE_FAILED, S.REPORTED, unless=_THEN_NATIVE),
    ),
    # State: native_compacting (best effort; every ending is reported)
    S.NATIVE_COMPACTING: (
        Edge(T.NATIVE_COMPACTED, S.REPORTED),
        Edge(T.NATIVE_FAILED, S.REPORTED),
        Edge(T.NATIVE_TIMED_OUT, S.REPORTED),
        Edge(T.NATIVE_SKIPPED, S.REPORTED),
    ),
    # Final state.
    S.REPORTED: (),
}

#: How the engine's ``compact()`` result leaves engine_compacting, by ``(ok, compacted)``
#: (an engine that raised, timed out or returned no valid result: ``engine_failed``).
ENGINE_RESULT_TRIGGERS: dict[tuple[bool, bool], CompactionTrigger] = {
    (True, True): T.ENGINE_COMPACTED,
    (True, False): T.ENGINE_DECLINED,
    (False, True): T.ENGINE_FAILED,
    (False, False): T.ENGINE_FAILED,
}

#: How compaction maintenance's outcome status leaves compaction_maintenance: only a failure
#: is one (an engine without ``maintain`` has nothing to run: done all the same).
MAINTENANCE_TRIGGERS: dict[str, CompactionTrigger] = {
    "ran": T.MAINTENANCE_RAN,
    "skipped": T.MAINTENANCE_RAN,
    "deferred": T.MAINTENANCE_RAN,
    "failed": T.MAINTENANCE_FAILED,
}

#: How Codex's report of a native compaction leaves native_compacting, by ``(compacted,
#: timed_out)``: a compaction Codex reported stands even if its turn then had to be
#: interrupted (the summary already is the thread's history).
NATIVE_REPORT_TRIGGERS: dict[tuple[bool, bool], CompactionTrigger] = {
    (True, False): T.NATIVE_COMPACTED,
    (True, True): T.NATIVE_COMPACTED,
    (False, True): T.NATIVE_TIMED_OUT,
    (False, False): T.NATIVE_FAILED,
}


class NativeAction(enum.Enum):
    """What native_compacting does (:data:`NATIVE_RULES`)."""

    COMPACT = "compact"  # thread/compact/start on the bound thread
    NO_BINDING = "no_binding"  # nothing is bound: nothing to compact (native_failed)
    FORK_BASE = "fork_base"  # a fork base holds no native history (native_skipped)
    AUTH_MISMATCH = "auth_mismatch"  # bound under another auth profile: fail closed


@attrs.frozen
class NativeFacts:
    """The binding as native compaction finds it (read afresh when the step begins)."""

    bound: bool = False  # a thread binding exists
    fork_base: bool = False  # ... and names a fork base, which never holds a conversation
    auth_matches: bool = True  # ... and the request's auth profile (if any) is the binding's


N = NativeAction

#: The first rule whose guards hold decides (:func:`codex_turn.fsm.thread.decide`); nothing
#: reaches an app-server before ``COMPACT``.
NATIVE_RULES: tuple[Rule[NativeAction], ...] = (
    Rule(N.NO_BINDING, unless=("bound",)),
    Rule(N.FORK_BASE, when=("fork_base",)),
    Rule(N.AUTH_MISMATCH, unless=("auth_matches",)),
    Rule(N.COMPACT),
)


COMPACTION_MACHINE = TableMachine(
    name="compaction",
    states=CompactionState,
    table=COMPACTION_TABLE,
    initial=CompactionState.IDLE,
    final=(CompactionState.REPORTED,),
)


@attrs.define(eq=False, slots=False)
class CompactionModel(Model):
    """One compaction run through :data:`COMPACTION_TABLE`."""

    machine = COMPACTION_MACHINE

    facts: CompactionFacts = attrs.field(factory=CompactionFacts)

    @classmethod
    def begin(
        cls, facts: CompactionFacts | None = None, *, state: CompactionState = CompactionState.IDLE
    ) -> CompactionModel:
        model = cls(facts=facts or CompactionFacts())
        model._attach(state)
        return model

    @property
    def engine_owns(self) -> bool:
        return self.facts.engine_owns

    @property
    def has_binding(self) -> bool:
        return self.facts.has_binding

    @property
    def manual(self) -> bool:
        return self.facts.manual

    @property
    def left_to_codex(self) -> bool:
        """A budget request with a binding and no owning engine: Codex's automatic compaction
        handles it, and this run compacts nothing (#85958)."""
        facts = self.facts
        return facts.has_binding and not facts.manual and not facts.engine_owns

    @property
    def compacted_by_both(self) -> bool:
        """The engine compacted (primary) and so did Codex natively (secondary)."""
        fired = {entry.trigger for entry in self.trace}
        return T.ENGINE_COMPACTED in fired and T.NATIVE_COMPACTED in fired
