"""The thread decision: start, resume or rotate the Codex thread, and whether to project.

Codex stores each turn's input in its native history and replays it on every later turn of
a resumed thread. Projecting an engine's full assembled context into every turn of one
thread therefore grows the request quadratically (OpenClaw #93762: ~96% wasted input;
#149689: a 108k-char projection surviving 38 native compactions). The fix is a decision,
made once per turn from facts, and it lives here as an ordered table of rules:

* Codex reported this turn's context window exceeded: retry it on a fresh thread (the turn
  table's ``turn_overflowed`` edge steps back once), which carries the conversation;
* a structured session (an engine projecting per turn whose context would go as items) runs
  every turn in a fork of one base from its first turn on, with context or without: one
  prompt-cache key for the session;
* no binding: start a thread (and project the engine's context into its first turn);
* Codex refused to resume the bound thread (it no longer exists): rotate to a fresh thread,
  which has no native history and therefore gets the projected context;
* a turn the runner asked to run apart from the session's thread: a *lightweight* run (a
  cron job, say: Codex must not load the project docs, AGENTS.md and friends, which a thread
  reads once, when it starts) or a *heartbeat* (its ``heartbeat_respond`` tool is a tool set
  of its own, which Codex freezes at thread/start): a *transient* thread for this turn only,
  before any other row; the binding keeps the session's thread;
* a turn that declares no dynamic tools while the bound thread has some (a heartbeat, say):
  a *transient* thread for this turn only; the binding keeps the tooled thread (OpenClaw);
* the conversation is never traded for a policy: when the bound thread was built with other
  dynamic tools (while an engine serves the turn), for another engine or engine policy
  (including "no engine" versus "engine"), or carries another thread-bootstrap epoch, but this
  turn has *no* projected context (assemble or projection failed, or there was nothing to
  frame), a fresh thread would run without the conversation. Resume the bound thread with the
  raw prompt instead, and leave the binding's engine record and tools fingerprint as they are
  (``rebind=False``), so the next turn that has context still rotates (OpenClaw's "continue
  with the original prompt" path). For that one turn the thread keeps its old tool set;
* a binding built with other dynamic tools: rotate to a fresh thread (Codex freezes a
  thread's tools at thread/start and silently ignores new ones on resume). Without an engine
  there is never context to carry over, and the rotation is OpenClaw's (#81223);
* a binding built for another engine or engine policy: rotate to a fresh thread (#81223);
* an engine projecting with mode ``thread_bootstrap``: project once per *epoch*. While the
  bound thread carries the same epoch, resume it with the raw prompt; a new epoch (after an
  engine compaction, say) rotates to a fresh thread that is projected again. A change of
  the projection *fingerprint* inside one epoch does not rotate (lossless #1169);
* an engine projecting per turn (the default, and any engine that does not declare a
  projection): every turn that carries projected context gets a fresh thread, so native
  history never accumulates projected context (lossless #1106);
* an engine projecting per turn whose assembly goes to Codex as Responses items (the
  structured form, below): the turn runs in an ephemeral *fork* of the session's *base*
  thread, a thread that never runs a turn of its own and holds nothing but an anchor; the
  items are injected into the idle fork before its turn/start and die with it, so nothing
  projected piles up anywhere, while every turn of the session shares the base's prompt
  cache key. A bound base is never resumed, and it holds no conversation: a turn without
  the engine's context (a failed assemble) forks it with the recent *transcript* as its
  context; when that cannot be (no engine any more, an app-server that cannot fork, a fork
  Codex refused) a fresh thread is seeded with the transcript as the text frame and becomes
  the session's thread. A refused fork that carried the engine's context rotates to a fresh
  thread with the text frame of that context;
* without an engine, a binding whose record of what its thread holds the transcript
  contradicts (the host compacted or rewrote it) rotates, and so does a bound thread whose
  native history fills more than ``native_history_share`` of the model's window (Codex's
  reported usage; a ``thread_bootstrap`` engine's thread is kept);
* otherwise resume the bound thread.

What goes *with* the prompt is a second question, asked of every decision
(:data:`CONTINUITY_RULES`, by :func:`decide_thread`): the engine's projected context when the
decision sends some; else, for a fresh thread of a session with history, the transcript
(bounded by the cap, newest kept); else, for a resumed thread the transcript outgrew (a
transient turn, a host's appends), what it lacks (the binding records how far the thread's
native history covers the transcript); else nothing. A session never silently restarts
empty, and nothing is both in native history and in what is projected.

The first rule whose guards hold decides. Like the turn table this module performs no I/O.
Every table here has one shape: a tuple of :class:`Rule` rows, each naming the facts that must
hold (``when``) and must not (``unless``) and the decision it gives, read by the one
:func:`decide`. Facts are read by name, in row order, and only as far as the first row that
holds: a fact that costs work (converting an assembly, rendering a frame) is computed only
when a row asks for it (the harness passes facts whose costly fields are computed on first
read). :func:`plan_thread` evaluates the tables a turn needs in one pass into a frozen
:class:`ThreadPlan`; the harness carries the plan out and reports what happened as a
past-tense trigger (``thread_started``/``thread_resumed``/``thread_rotated``/...).

A resume always sends ``thread/resume`` (it loads the thread and re-sends the developer
instructions and the runtime policy). Skipping it for a thread this process held unchanged
saved 0.2% of a turn with the model answering after 1.5 s (``benchmarks/bench_mechanisms.py``),
so it is not done.

Which base a ``fork`` uses is a second small table (:data:`BASE_RULES`): the bound base when
there is one built for this turn's tools, engine and workspace; a new base (started, anchored
and bound) otherwise. A base holds nothing a turn could lose, so replacing it costs only the
warm prompt cache.

Whether a fork is *continued* is a third (:data:`FORK_RULES`), and whether it is *kept*
after its turn a fourth (:data:`KEEP_RULES`: only when an exact record can be made). After a
turn that completed in a fork, the fork is kept (idle, loaded, in this app-server process)
with a record of what it holds in the engine's terms: the ids of the items injected into it
and of its turn's own messages, converted as the engine will hand them back. The next turn
of the session continues that fork, injecting only the items that follow what it holds, when
its own items *begin with* that record (the engine's assembly only grew: every earlier item
reaches the model once, in place), the fork was made with this turn's settings and
instructions, and Codex has not compacted it. Anything else (the engine summarised, dropped
or rewrote an earlier message, the cap cut elsewhere, an interrupted turn, a restarted
app-server) forks the base afresh, as every turn did before. The model of a continued fork
sees its earlier turns in Codex's native form (as a resumed thread shows them), and nothing
twice.

And in which *form* context goes to Codex is the fifth (:data:`FORM_RULES`), asked when
projecting (and for a transcript fork): Responses items (``thread/inject_items``, the
structured form) when the engine projects per turn, the app-server can inject, the turn keeps
its tools, the runner did not ask for the text frame, and the messages convert
(:mod:`codex_turn.projection.items`) and fit the cap; the text frame (one user message)
otherwise. The turn machine shows the branch: ``projected_as_items`` or ``projected``, and
``fork_failed`` back to ``reprojecting`` for the text frame.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import attrs

__all__ = [
    "BASE_RULES",
    "CONTINUITY_RULES",
    "FORK_RULES",
    "FORM_RULES",
    "KEEP_RULES",
    "THREAD_RULES",
    "BaseAction",
    "BaseFacts",
    "Choice",
    "ContextSource",
    "ContinuityFacts",
    "ContinuitySource",
    "ForkAction",
    "ForkFacts",
    "FormFacts",
    "KeepAction",
    "KeepFacts",
    "PlanFacts",
    "ProjectionForm",
    "Rule",
    "ThreadAction",
    "ThreadDecision",
    "ThreadFacts",
    "ThreadPlan",
    "decide",
    "decide_thread",
    "plan_thread",
]

D = TypeVar("D")
A = TypeVar("A", bound=enum.Enum)


# --------------------------------------------------------------------------------------------
# One shape for every table


@attrs.frozen
class Rule(Generic[D]):
    """One row of a rule table: when every ``when`` fact holds and no ``unless`` fact does,
    the table answers ``decision``."""

    decision: D
    when: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()

    def holds(self, facts: object) -> bool:
        # Short-circuits left to right: a costly fact is read only when the row needs it.
        return all(getattr(facts, name) for name in self.when) and not any(
            getattr(facts, name) for name in self.unless
        )


def decide(rules: Sequence[Rule[D]], facts: object) -> D:
    """The decision of the first row of ``rules`` that holds for ``facts`` (every table ends
    with an unconditional row)."""
    for rule in rules:
        if rule.holds(facts):
            return rule.decision
    raise AssertionError("a rule table ends with an unconditional rule")  # pragma: no cover


@attrs.frozen
class Choice(Generic[A]):
    """The answer of a small table: what to do, and why (a stable, loggable reason)."""

    action: A
    reason: str


# --------------------------------------------------------------------------------------------
# Start, resume, rotate, transient or fork


class ThreadAction(enum.Enum):
    START = "start"
    RESUME = "resume"
    ROTATE = "rotate"  # start a fresh thread and replace the binding
    TRANSIENT = "transient"  # start a fresh thread for this turn only; keep the binding
    FORK = "fork"  # run in an ephemeral fork of the session's base thread (BASE_RULES)


@attrs.frozen
class ThreadFacts:
    """What the decision may look at. Projection facts are about *this* turn's assembly."""

    bound: bool = False  # a binding with a thread id exists
    tools_match: bool = True  # dynamic-tools fingerprint compatible with the binding's
    tools_dropped: bool = False  # this turn has no tools, the bound thread has some
    engine_match: bool = True  # same engine id and policy (or no engine on both sides)
    thread_bootstrap: bool = False  # the engine asked for thread_bootstrap projection
    epoch_match: bool = False  # ... and the bound thread carries the same epoch
    per_turn: bool = False  # the engine assembled context with per-turn projection
    has_context: bool = False  # the projection framed some assembled history
    resume_failed: bool = False  # Codex refused to resume the bound thread this turn
    engine_active: bool = False  # a context engine serves this turn (context was wanted)
    items: bool = False  # this turn's context goes as Responses items (FORM_RULES said so)
    base_bound: bool = False  # the bound thread is a fork base (it never runs a turn)
    fork_failed: bool = False  # Codex refused this turn's fork or its items
    can_inject: bool = False  # the app-server can fork and inject
    #: The engine projects per turn and its context would go as items (the structured
    #: form's conditions but the conversion): the session's turns run in forks of one base.
    structured: bool = False
    #: The binding's record of what its thread holds contradicts the transcript.
    coverage_lost: bool = False
    #: The bound thread's native history fills more than its configured share of the
    #: model's context window (Codex's reported usage).
    oversized: bool = False
    #: Codex reported this turn's context window exceeded (the turn is retried once).
    overflowed: bool = False
    #: The runner asked for a thread of this turn's own: a lightweight run (no project docs)
    #: or a heartbeat (its own tool set).
    own_thread: bool = False
    # Read by the continuity table (CONTINUITY_RULES), after the thread decision.
    has_history: bool = False  # the transcript holds messages before this turn
    stale: bool = False  # ... some of which the bound thread's native history lacks


class ContextSource(enum.Enum):
    """What of the conversation goes with the turn's prompt (:data:`CONTINUITY_RULES`)."""

    NONE = "none"  # the thread holds the conversation, or there is none
    ENGINE = "engine"  # the engine's projected assembly
    TRANSCRIPT = "transcript"  # the transcript, bounded, newest kept: a fresh thread's
    UNCOVERED = "uncovered"  # what the transcript holds beyond the bound thread's coverage


@attrs.frozen
class ThreadDecision:
    action: ThreadAction
    project: bool  # send the projected prompt (else the raw prompt)
    reason: str
    #: The binding takes this turn's engine record and tools fingerprint (else the bound
    #: thread keeps its own, so the change still takes effect on the next turn with context).
    rebind: bool = True
    #: What goes with the prompt: the continuity table's answer (:func:`decide_thread`);
    #: ``None`` on a row of the table, before it was asked.
    context: Choice[ContextSource] | None = None

    @property
    def from_transcript(self) -> bool:
        """The turn's context is read from the transcript (no engine context stands for it)."""
        return self.context is not None and self.context.action in _FROM_TRANSCRIPT


_FROM_TRANSCRIPT: frozenset[ContextSource] = frozenset(
    {ContextSource.TRANSCRIPT, ContextSource.UNCOVERED}
)


def _thread(
    action: ThreadAction,
    project: bool,
    reason: str,
    *,
    when: tuple[str, ...] = (),
    unless: tuple[str, ...] = (),
    rebind: bool = True,
) -> Rule[ThreadDecision]:
    return Rule(ThreadDecision(action, project, reason, rebind), when, unless)


T = ThreadAction

THREAD_RULES: tuple[Rule[ThreadDecision], ...] = (
    _thread(T.TRANSIENT, True, "own-transient-thread", when=("own_thread",)),
    _thread(
        T.ROTATE, True, "context-window-exceeded", when=("overflowed",), unless=("tools_dropped",)
    ),
    _thread(
        T.FORK,
        True,
        "per-turn-projection-items",
        when=("items",),
        unless=("tools_dropped", "fork_failed", "overflowed"),
    ),
    _thread(
        T.FORK,
        True,
        "structured-session-without-context",
        when=("structured",),
        unless=("has_context", "tools_dropped", "fork_failed", "overflowed"),
    ),
    _thread(T.START, True, "missing-thread-binding", unless=("bound",)),
    _thread(T.ROTATE, True, "resume-failed", when=("resume_failed",)),
    _thread(T.TRANSIENT, True, "no-tools-transient-thread", when=("tools_dropped",)),
    _thread(
        T.FORK,
        True,
        "fork-base-without-context",
        when=("base_bound", "engine_active", "can_inject"),
        unless=("has_context", "fork_failed", "overflowed"),
    ),
    _thread(
        T.ROTATE,
        True,
        "fork-base-unusable-without-context",
        when=("base_bound",),
        unless=("has_context",),
    ),
    _thread(
        T.ROTATE,
        True,
        "transcript-coverage-lost",
        when=("coverage_lost",),
        unless=("engine_active",),
    ),
    _thread(
        T.ROTATE,
        True,
        "native-thread-oversized",
        when=("oversized",),
        unless=("base_bound", "thread_bootstrap"),
    ),
    _thread(T.ROTATE, True, "fork-base-refused", when=("base_bound", "fork_failed")),
    _thread(
        T.RESUME,
        False,
        "context-unavailable-keep-thread",
        when=("engine_active",),
        unless=("tools_match", "has_context"),
        rebind=False,
    ),
    _thread(T.ROTATE, True, "dynamic-tools-changed", unless=("tools_match",)),
    _thread(
        T.RESUME,
        False,
        "context-unavailable-keep-thread",
        unless=("engine_match", "has_context"),
        rebind=False,
    ),
    _thread(
        T.RESUME,
        False,
        "context-unavailable-keep-thread",
        when=("thread_bootstrap",),
        unless=("epoch_match", "has_context"),
        rebind=False,
    ),
    _thread(T.ROTATE, True, "context-engine-policy-changed", unless=("engine_match",)),
    _thread(
        T.RESUME,
        False,
        "matching-thread-bootstrap-binding",
        when=("thread_bootstrap", "epoch_match"),
    ),
    _thread(T.ROTATE, True, "thread-bootstrap-epoch-changed", when=("thread_bootstrap",)),
    _thread(T.ROTATE, True, "per-turn-projection-fresh-thread", when=("per_turn", "has_context")),
    _thread(T.RESUME, True, "compatible-thread-binding"),
)


# --------------------------------------------------------------------------------------------
# What of the conversation goes with the prompt


@attrs.frozen
class ContinuityFacts:
    """What the continuity table reads: the thread decision's kind of thread, and the
    transcript's state against it."""

    fresh: bool = (
        False  # the thread holds none of the conversation (start, rotate, transient, fork)
    )
    engine_context: bool = False  # the decision sends the engine's projected context
    has_history: bool = False  # the transcript holds messages before this turn
    stale: bool = False  # the bound thread's native history lacks some of them


C = ContextSource

#: A session never silently restarts empty: a fresh thread without the engine's context
#: carries the transcript (bounded, newest kept), a resumed thread what it lacks of it.
CONTINUITY_RULES: tuple[Rule[Choice[ContextSource]], ...] = (
    Rule(Choice(C.ENGINE, "engine-context"), when=("engine_context",)),
    Rule(Choice(C.NONE, "no-earlier-conversation"), unless=("has_history",)),
    Rule(Choice(C.TRANSCRIPT, "fresh-thread-carries-transcript"), when=("fresh",)),
    Rule(Choice(C.UNCOVERED, "binding-behind-transcript"), when=("stale",)),
    Rule(Choice(C.NONE, "thread-holds-conversation")),
)

_FRESH: frozenset[ThreadAction] = frozenset(
    {ThreadAction.START, ThreadAction.ROTATE, ThreadAction.TRANSIENT, ThreadAction.FORK}
)


class ContinuitySource(Protocol):
    """The thread facts the continuity table reads besides the decision."""

    @property
    def has_context(self) -> bool: ...

    @property
    def has_history(self) -> bool: ...

    @property
    def stale(self) -> bool: ...


def decide_thread(facts: ContinuitySource) -> ThreadDecision:
    """The thread table's decision for ``facts`` (a :class:`ThreadFacts`-shaped object), with
    the continuity table's answer for it: what goes with the prompt. A turn whose context is
    read from the transcript sends the projected prompt, whatever the row said."""
    decision = decide(THREAD_RULES, facts)
    continuity = decide(
        CONTINUITY_RULES,
        _ContinuityView(decision, facts),
    )
    project = decision.project or continuity.action in _FROM_TRANSCRIPT
    return attrs.evolve(decision, project=project, context=continuity)


class _ContinuityView:
    """The :class:`ContinuityFacts` of a decision, read from the thread facts on demand (a
    costly one, such as whether there is context, only when a row asks)."""

    def __init__(self, decision: ThreadDecision, facts: ContinuitySource) -> None:
        self._decision, self._facts = decision, facts
        self.fresh = decision.action in _FRESH

    @property
    def engine_context(self) -> bool:
        return self._decision.project and self._facts.has_context

    @property
    def has_history(self) -> bool:
        return self._facts.has_history

    @property
    def stale(self) -> bool:
        return self._facts.stale


# --------------------------------------------------------------------------------------------
# Which base thread a fork uses


class BaseAction(enum.Enum):
    BOUND = "bound"  # fork the bound base
    NEW = "new"  # start a base (anchored, bound), then fork it


@attrs.frozen
class BaseFacts:
    base_bound: bool = False  # the binding names a fork base
    tools_match: bool = True  # ... built with this turn's dynamic tools
    engine_match: bool = True  # ... for this turn's engine and policy
    cwd_match: bool = True  # ... in this turn's workspace (its environment context)


B = BaseAction

BASE_RULES: tuple[Rule[Choice[BaseAction]], ...] = (
    Rule(Choice(B.NEW, "no-fork-base-bound"), unless=("base_bound",)),
    Rule(Choice(B.NEW, "fork-base-tools-changed"), unless=("tools_match",)),
    Rule(Choice(B.NEW, "fork-base-engine-changed"), unless=("engine_match",)),
    Rule(Choice(B.NEW, "fork-base-workspace-changed"), unless=("cwd_match",)),
    Rule(Choice(B.BOUND, "fork-base-bound")),
)


# --------------------------------------------------------------------------------------------
# Whether a kept fork is continued


class ForkAction(enum.Enum):
    NEW = "new"  # fork the base afresh and inject the whole context (release a kept fork)
    CONTINUE = "continue"  # the kept fork holds a prefix of this turn's items: inject the rest


@attrs.frozen
class ForkFacts:
    """What this process knows about the fork it kept after the session's last turn."""

    kept: bool = False  # a fork of this turn's base is kept here, and Codex still holds it
    completed: bool = False  # ... its turn completed (an interrupted one may hold more)
    compacted: bool = False  # ... Codex compacted it (the items it held may be gone)
    settings_match: bool = False  # ... it was made with this turn's settings and instructions
    extends: bool = False  # this turn's items begin with everything it holds


K = ForkAction

FORK_RULES: tuple[Rule[Choice[ForkAction]], ...] = (
    Rule(Choice(K.NEW, "no-kept-fork"), unless=("kept",)),
    Rule(Choice(K.NEW, "kept-fork-turn-incomplete"), unless=("completed",)),
    Rule(Choice(K.NEW, "kept-fork-compacted"), when=("compacted",)),
    Rule(Choice(K.NEW, "kept-fork-settings-changed"), unless=("settings_match",)),
    Rule(Choice(K.NEW, "context-diverged-from-kept-fork"), unless=("extends",)),
    Rule(Choice(K.CONTINUE, "context-extends-kept-fork")),
)


# --------------------------------------------------------------------------------------------
# Whether a fork is kept after its turn


class KeepAction(enum.Enum):
    KEEP = "keep"  # keep the fork (idle, loaded) with an exact record of what it holds
    RELEASE = "release"  # release it: no exact record of it can be made


@attrs.frozen
class KeepFacts:
    """What the turn left in its fork, against what the engine will hand back next turn."""

    completed: bool = False  # the turn completed (an interrupted one may hold more)
    convertible: bool = False  # its own messages convert as the engine will hand them back
    #: A steer went to it whose fate stayed unknown: Codex may hold that message where no
    #: record or mirror does (a runner that sends it again would show it twice).
    steer_unconfirmed: bool = False
    #: Items the mirror keeps none of (tool calls and outputs, commentary besides the reply).
    unmirrored_items: bool = False
    #: The prompt sent (a hook changed or cut it) is not the prompt mirrored.
    prompt_differs: bool = False
    images_sent: bool = False  # images went with the prompt (the mirror keeps text)


E = KeepAction

#: Reasons in snake_case: the log of a released fork has always named them so.
KEEP_RULES: tuple[Rule[Choice[KeepAction]], ...] = (
    Rule(Choice(E.RELEASE, "turn-incomplete"), unless=("completed",)),
    Rule(Choice(E.RELEASE, "turn-unconvertible"), unless=("convertible",)),
    Rule(Choice(E.RELEASE, "steer_unconfirmed"), when=("steer_unconfirmed",)),
    Rule(Choice(E.RELEASE, "unmirrored_items"), when=("unmirrored_items",)),
    Rule(Choice(E.RELEASE, "prompt_differs"), when=("prompt_differs",)),
    Rule(Choice(E.RELEASE, "images_sent"), when=("images_sent",)),
    Rule(Choice(E.KEEP, "fork-record-exact")),
)


# --------------------------------------------------------------------------------------------
# In which form the engine's context goes to Codex


class ProjectionForm(enum.Enum):
    TEXT = "text"  # the text frame: one user message in turn/start
    ITEMS = "items"  # Responses items injected into a fork (the structured form)


@attrs.frozen
class FormFacts:
    text_requested: bool = False  # the runner asked for the text frame
    per_turn: bool = False  # the engine projects per turn (not thread_bootstrap)
    can_inject: bool = False  # the app-server can fork and inject
    tools_dropped: bool = False  # a turn without the bound thread's tools (a transient one)
    #: The runner asked for a thread of this turn's own (lightweight, heartbeat): transient.
    own_thread: bool = False
    # Read last (they cost a conversion): the messages convert, and some fit the cap.
    convertible: bool = True
    fits: bool = True
    #: The conversion yields some items (an empty assembly has nothing to inject).
    has_items: bool = True


F = ProjectionForm

FORM_RULES: tuple[Rule[Choice[ProjectionForm]], ...] = (
    Rule(Choice(F.TEXT, "text-frame-requested"), when=("text_requested",)),
    Rule(Choice(F.TEXT, "thread-bootstrap-projection"), unless=("per_turn",)),
    Rule(Choice(F.TEXT, "app-server-cannot-inject"), unless=("can_inject",)),
    Rule(Choice(F.TEXT, "no-tools-transient-thread"), when=("tools_dropped",)),
    Rule(Choice(F.TEXT, "own-transient-thread"), when=("own_thread",)),
    Rule(Choice(F.TEXT, "assembly-unconvertible"), unless=("convertible",)),
    Rule(Choice(F.TEXT, "nothing-to-project"), unless=("has_items",)),
    Rule(Choice(F.TEXT, "assembly-exceeds-cap"), unless=("fits",)),
    Rule(Choice(F.ITEMS, "structured-projection")),
)


# --------------------------------------------------------------------------------------------
# The plan: every table a turn needs, in one pass


class PlanFacts(Protocol):
    """Where a plan's facts come from (the harness gathers them for the turn, with the thread
    settings the prompt hooks left). Each is an object with its table's fact names as
    attributes."""

    @property
    def base(self) -> object: ...

    def fork(self, base: Choice[BaseAction]) -> object:
        """The kept fork's facts for the base the plan forks (a new base has none kept)."""
        ...


@attrs.frozen
class ThreadPlan:
    """How this turn obtains its thread: the thread decision, and for a fork which base and
    whether the kept fork is continued."""

    decision: ThreadDecision
    base: Choice[BaseAction] | None = None
    fork: Choice[ForkAction] | None = None

    @property
    def action(self) -> ThreadAction:
        return self.decision.action


def plan_thread(decision: ThreadDecision, facts: PlanFacts) -> ThreadPlan:
    """The tables ``decision``'s action needs, in one pass (no other action reads their
    facts: a start never looks at kept forks).

    The thread decision itself is taken earlier, once the assembly is known, because the
    prompt hooks run on the prompt it chose; how it is carried out reads the thread settings
    those hooks finalised (the instructions a kept fork must match)."""
    if decision.action is ThreadAction.FORK:
        base = decide(BASE_RULES, facts.base)
        return ThreadPlan(decision, base=base, fork=decide(FORK_RULES, facts.fork(base)))
    return ThreadPlan(decision)
