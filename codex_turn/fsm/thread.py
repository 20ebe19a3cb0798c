"""The thread decision: start, resume or rotate the Codex thread, and whether to project.

Codex stores each turn's input in its native history and replays it on every later turn of
a resumed thread. Projecting an engine's full assembled context into every turn of one
thread therefore grows the request quadratically (OpenClaw #93762: ~96% wasted input;
#149689: a 108k-char projection surviving 38 native compactions). The fix is a decision,
made once per turn from facts, and it lives here as an ordered table of rules:

* no binding: start a thread (and project the engine's context into its first turn);
* Codex refused to resume the bound thread (it no longer exists): rotate to a fresh thread,
  which has no native history and therefore gets the projected context;
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
* otherwise resume the bound thread.

The first rule whose guards hold decides. Like the turn table this module performs no I/O:
the orchestrator gathers :class:`ThreadFacts` from the binding and the engine's assembly,
asks :func:`decide_thread`, and fires ``thread_started``/``thread_resumed``/``thread_rotated``.

How a *resume* is carried out is a second, smaller table (:data:`RESUME_RULES`). A
``thread/resume`` loads the thread and re-sends the developer instructions and the runtime
policy; that is needed exactly when Codex may not hold them as this turn wants them. When
this app-server process started or resumed the thread itself, with the very settings this
turn sends, and Codex has not compacted it since (a compaction is the one event that can
drop re-sent instructions, see the app-server reference §6) nor unloaded it, the thread is
*reused*: ``turn/start`` goes straight to it. Otherwise it is resumed as before. The
client keeps the facts (what it sent, every compaction and unload it saw); the decision is
:func:`decide_resume`'s.
"""

from __future__ import annotations

import enum

import attrs

__all__ = [
    "RESUME_RULES",
    "THREAD_RULES",
    "ResumeAction",
    "ResumeDecision",
    "ResumeFacts",
    "ThreadAction",
    "ThreadDecision",
    "ThreadFacts",
    "decide_resume",
    "decide_thread",
]


class ThreadAction(enum.Enum):
    START = "start"
    RESUME = "resume"
    ROTATE = "rotate"  # start a fresh thread and replace the binding
    TRANSIENT = "transient"  # start a fresh thread for this turn only; keep the binding


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


@attrs.frozen
class ThreadRule:
    action: ThreadAction
    project: bool  # send the projected prompt (else the raw prompt)
    reason: str
    when: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()
    #: The binding takes this turn's engine record and tools fingerprint (else the bound
    #: thread keeps its own, so the change still takes effect on the next turn with context).
    rebind: bool = True

    def holds(self, facts: ThreadFacts) -> bool:
        return _holds(self.when, self.unless, facts)


def _holds(when: tuple[str, ...], unless: tuple[str, ...], facts: object) -> bool:
    return all(getattr(facts, name) for name in when) and not any(
        getattr(facts, name) for name in unless
    )


@attrs.frozen
class ThreadDecision:
    action: ThreadAction
    project: bool
    reason: str
    rebind: bool = True


A = ThreadAction

THREAD_RULES: tuple[ThreadRule, ...] = (
    ThreadRule(A.START, True, "missing-thread-binding", unless=("bound",)),
    ThreadRule(A.ROTATE, True, "resume-failed", when=("resume_failed",)),
    ThreadRule(A.TRANSIENT, True, "no-tools-transient-thread", when=("tools_dropped",)),
    ThreadRule(
        A.RESUME,
        False,
        "context-unavailable-keep-thread",
        when=("engine_active",),
        unless=("tools_match", "has_context"),
        rebind=False,
    ),
    ThreadRule(A.ROTATE, True, "dynamic-tools-changed", unless=("tools_match",)),
    ThreadRule(
        A.RESUME,
        False,
        "context-unavailable-keep-thread",
        unless=("engine_match", "has_context"),
        rebind=False,
    ),
    ThreadRule(
        A.RESUME,
        False,
        "context-unavailable-keep-thread",
        when=("thread_bootstrap",),
        unless=("epoch_match", "has_context"),
        rebind=False,
    ),
    ThreadRule(A.ROTATE, True, "context-engine-policy-changed", unless=("engine_match",)),
    ThreadRule(
        A.RESUME,
        False,
        "matching-thread-bootstrap-binding",
        when=("thread_bootstrap", "epoch_match"),
    ),
    ThreadRule(A.ROTATE, True, "thread-bootstrap-epoch-changed", when=("thread_bootstrap",)),
    ThreadRule(
        A.ROTATE, True, "per-turn-projection-fresh-thread", when=("per_turn", "has_context")
    ),
    ThreadRule(A.RESUME, True, "compatible-thread-binding"),
)


def decide_thread(facts: ThreadFacts) -> ThreadDecision:
    """The first rule of :data:`THREAD_RULES` that holds for ``facts``."""
    for rule in THREAD_RULES:
        if rule.holds(facts):
            return ThreadDecision(rule.action, rule.project, rule.reason, rule.rebind)
    raise AssertionError("THREAD_RULES ends with an unconditional rule")  # pragma: no cover


# --------------------------------------------------------------------------------------------
# How a resume is carried out (see the module header)


class ResumeAction(enum.Enum):
    RESUME = "resume"  # send thread/resume: load the thread, re-send instructions and policy
    REUSE = "reuse"  # the thread is loaded here exactly as wanted: turn/start goes straight on


@attrs.frozen
class ResumeFacts:
    """What this app-server process knows about the bound thread."""

    loaded: bool = False  # this process started or resumed it and Codex has not unloaded it
    settings_match: bool = False  # ... with exactly the settings this turn would send
    compacted: bool = False  # Codex compacted it since (re-sent instructions may be gone)


@attrs.frozen
class ResumeRule:
    action: ResumeAction
    reason: str
    when: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()

    def holds(self, facts: ResumeFacts) -> bool:
        return _holds(self.when, self.unless, facts)


@attrs.frozen
class ResumeDecision:
    action: ResumeAction
    reason: str


R = ResumeAction

RESUME_RULES: tuple[ResumeRule, ...] = (
    ResumeRule(R.RESUME, "thread-not-loaded-here", unless=("loaded",)),
    ResumeRule(R.RESUME, "compacted-since-loaded", when=("compacted",)),
    ResumeRule(R.RESUME, "thread-settings-changed", unless=("settings_match",)),
    ResumeRule(R.REUSE, "thread-loaded-unchanged"),
)


def decide_resume(facts: ResumeFacts) -> ResumeDecision:
    """The first rule of :data:`RESUME_RULES` that holds for ``facts``."""
    for rule in RESUME_RULES:
        if rule.holds(facts):
            return ResumeDecision(rule.action, rule.reason)
    raise AssertionError("RESUME_RULES ends with an unconditional rule")  # pragma: no cover
