"""The thread decision: start, resume or rotate, and whether to project (the snowball fix)."""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import attrs
import pytest

from codex_turn.fsm import THREAD_RULES, ThreadAction, ThreadFacts, decide
from codex_turn.fsm.thread import ContextSource, decide_thread

#: The continuity table's facts: the thread table never reads them (checked below).
CONTINUITY = ("has_history", "stale")
FIELDS = [f.name for f in attrs.fields(ThreadFacts) if f.name not in CONTINUITY]


def _possible(f: ThreadFacts) -> bool:
    """Facts a turn can have: items are an engine's per-turn context (the form table says
    so), and only a binding can name a fork base (whose epoch is nobody's)."""
    items_ok = not f.items or (
        f.per_turn
        and f.has_context
        and f.engine_active
        and f.can_inject
        and not f.thread_bootstrap
        and not f.own_thread  # a thread of the turn's own takes the text frame
    )
    # A structured session: an engine projecting per turn, into forks (the harness gathers
    # it so).
    structured_ok = not f.structured or (
        f.per_turn
        and f.engine_active
        and f.can_inject
        and not f.tools_dropped
        and not f.own_thread
        and not f.thread_bootstrap
    )
    # A base's binding records the fork-base projection, never a thread_bootstrap epoch, and
    # a base is never resumed (so never refused a resume).
    base_ok = not f.base_bound or (f.bound and not f.epoch_match and not f.resume_failed)
    # A thread of the turn's own is started, never resumed or forked: neither can be refused.
    own_ok = not f.own_thread or not (f.resume_failed or f.fork_failed)
    return items_ok and structured_ok and base_ok and own_ok


def _all_facts() -> list[ThreadFacts]:
    return [
        facts
        for bits in itertools.product((False, True), repeat=len(FIELDS))
        if _possible(facts := ThreadFacts(**dict(zip(FIELDS, bits, strict=True))))
    ]


ALL_FACTS = _all_facts()


def oracle(f: ThreadFacts) -> tuple[ThreadAction, bool]:
    """Hand-written from the issues: where the decision must land, and whether it projects."""
    if f.own_thread:  # a lightweight run or a heartbeat: a thread of its own, whatever else
        return ThreadAction.TRANSIENT, True
    if f.overflowed and not f.tools_dropped:
        return ThreadAction.ROTATE, True  # retried once on a fresh thread with the conversation
    if f.items and not (f.tools_dropped or f.fork_failed or f.overflowed):
        return ThreadAction.FORK, True  # items go into a fork of the base
    if f.structured and not (f.has_context or f.fork_failed or f.overflowed):
        return ThreadAction.FORK, True  # one base (one cache key) from the first turn on
    if not f.bound:
        return ThreadAction.START, True
    if f.resume_failed:  # the bound thread is gone: a fresh one, with the context
        return ThreadAction.ROTATE, True
    if f.tools_dropped:
        return ThreadAction.TRANSIENT, True
    if f.base_bound and not f.has_context:
        # A base never runs a turn and holds no conversation: the transcript is the context,
        # in a fork when one can be made, else on a fresh thread that becomes the session's.
        if f.engine_active and f.can_inject and not (f.fork_failed or f.overflowed):
            return ThreadAction.FORK, True
        return ThreadAction.ROTATE, True
    if f.base_bound and f.fork_failed:  # Codex refused the fork: a fresh thread, text frame
        return ThreadAction.ROTATE, True
    if f.coverage_lost and not f.engine_active:
        # What the thread lacks cannot be told: a fresh thread with the transcript.
        return ThreadAction.ROTATE, True
    if f.oversized and not (f.base_bound or f.thread_bootstrap):
        return ThreadAction.ROTATE, True  # bootstrap threads are kept (OpenClaw)
    if not f.tools_match:
        # With an engine but nothing to project, keep the conversation for this turn.
        if f.engine_active and not f.has_context:
            return ThreadAction.RESUME, False
        return ThreadAction.ROTATE, True
    # Never trade the conversation for a policy: without context to project, a fresh thread
    # would run without it, so the bound thread is resumed with the raw prompt.
    policy_rotation = not f.engine_match or (f.thread_bootstrap and not f.epoch_match)
    if policy_rotation and not f.has_context:
        return ThreadAction.RESUME, False
    if not f.engine_match:
        return ThreadAction.ROTATE, True
    if f.thread_bootstrap:
        return (ThreadAction.RESUME, False) if f.epoch_match else (ThreadAction.ROTATE, True)
    if f.per_turn and f.has_context:
        return ThreadAction.ROTATE, True
    return ThreadAction.RESUME, True


def test_every_fact_combination_matches_the_oracle() -> None:
    wrong = [
        (facts, decision)
        for facts in ALL_FACTS
        if (decision := decide(THREAD_RULES, facts)) is not None
        and ((decision.action, decision.project) != oracle(facts) or not decision.reason)
    ]
    assert len(ALL_FACTS) > 30_000  # every combination a turn can have
    assert wrong == []


def test_the_thread_table_never_reads_the_continuity_facts() -> None:
    for rule in THREAD_RULES:
        assert not (set(rule.when) | set(rule.unless)) & set(CONTINUITY), rule


_FRESH = (ThreadAction.START, ThreadAction.ROTATE, ThreadAction.TRANSIENT, ThreadAction.FORK)


@pytest.mark.parametrize("has_history", [False, True])
@pytest.mark.parametrize("stale", [False, True])
def test_no_thread_runs_without_the_conversation_and_none_gets_it_twice(
    has_history: bool, stale: bool
) -> None:
    """What goes with the prompt (the continuity table), for every thread decision: a fresh
    thread of a session with history always carries the conversation (the engine's context,
    else the transcript); a resumed thread gets only what it lacks, and only when it lacks
    something; nothing is read from the transcript when the engine's context goes."""
    for base in ALL_FACTS[::7]:  # a spread of the thread facts, every row reached
        facts = attrs.evolve(base, has_history=has_history, stale=stale)
        decision = decide_thread(facts)
        row = decide(THREAD_RULES, facts)
        assert decision.action is row.action
        assert decision.context is not None
        source = decision.context.action
        engine_context = row.project and facts.has_context
        if engine_context:
            assert source is ContextSource.ENGINE, facts
        elif not has_history:
            assert source is ContextSource.NONE, facts
        elif row.action in _FRESH:
            assert source is ContextSource.TRANSCRIPT, facts
        else:
            assert source is (ContextSource.UNCOVERED if stale else ContextSource.NONE), facts
        # The transcript's stand-in is sent (the projected prompt), whatever the row said.
        assert decision.project == (row.project or decision.from_transcript)


def test_projected_context_is_never_sent_into_a_resumed_thread_that_already_has_it() -> None:
    # The quadratic snowball: resuming while projecting per turn.
    resumed_with_projection = [
        facts
        for facts in ALL_FACTS
        if decide(THREAD_RULES, facts).action is ThreadAction.RESUME
        and decide(THREAD_RULES, facts).project
        and facts.per_turn
        and facts.has_context
        and not facts.thread_bootstrap
    ]
    assert resumed_with_projection == []


def test_reasons_match_openclaw_log_vocabulary() -> None:
    assert decide(THREAD_RULES, ThreadFacts()).reason == "missing-thread-binding"
    matching = ThreadFacts(bound=True, thread_bootstrap=True, epoch_match=True, has_context=True)
    assert decide(THREAD_RULES, matching).reason == "matching-thread-bootstrap-binding"
    assert decide(THREAD_RULES, matching).project is False


def test_a_changed_projection_fingerprint_inside_an_epoch_does_not_rotate() -> None:
    # The fingerprint is not a fact at all: only the epoch, the policy and the tools count.
    assert "fingerprint" not in FIELDS
    same_epoch = ThreadFacts(bound=True, thread_bootstrap=True, epoch_match=True)
    assert decide(THREAD_RULES, same_epoch).action is ThreadAction.RESUME


def test_a_rotation_never_runs_a_fresh_thread_without_the_conversation() -> None:
    # A policy or epoch change with nothing to project resumes the bound thread
    # (raw prompt) and leaves the binding's engine record alone, so a later turn with context
    # still rotates and projects.
    for facts in ALL_FACTS:
        decision = decide(THREAD_RULES, facts)
        if (
            facts.bound
            and not facts.has_context
            and facts.tools_match
            and not (facts.resume_failed or facts.tools_dropped or facts.own_thread)
        ):
            if facts.base_bound:
                # The conversation lives in the transcript, not in the base: the transcript
                # goes with the turn, in a fork or on a fresh thread.
                with_history = decide_thread(attrs.evolve(facts, has_history=True))
                assert with_history.from_transcript, facts
                assert decision.action in (ThreadAction.FORK, ThreadAction.ROTATE), facts
            elif not (
                facts.overflowed
                or facts.structured
                or facts.coverage_lost
                or (facts.oversized and not facts.thread_bootstrap)
            ):
                assert decision.action is ThreadAction.RESUME, facts
        if decision.action is ThreadAction.RESUME and not decision.rebind:
            assert not facts.has_context
            assert decision.reason == "context-unavailable-keep-thread"


def test_a_refused_resume_rotates_with_the_projected_context() -> None:
    decision = decide(THREAD_RULES, ThreadFacts(bound=True, resume_failed=True, has_context=True))
    assert (decision.action, decision.project, decision.reason) == (
        ThreadAction.ROTATE,
        True,
        "resume-failed",
    )


def test_a_fork_base_is_never_resumed_and_items_never_reach_a_thread_that_keeps_them() -> None:
    # A base never runs a turn of its own (it would keep that turn for every later
    # fork), and items go nowhere but into a fork, where they die with it.
    for facts in ALL_FACTS:
        decision = decide(THREAD_RULES, facts)
        if facts.base_bound and (facts.has_context or facts.fork_failed):
            realistic = facts.per_turn or facts.thread_bootstrap or facts.fork_failed
            if realistic:
                assert decision.action is not ThreadAction.RESUME, facts
        if facts.items and decision.action is not ThreadAction.FORK:
            assert facts.tools_dropped or facts.fork_failed or facts.overflowed, facts


def test_base_table_keeps_the_bound_base_only_when_it_fits() -> None:
    from codex_turn.fsm.thread import BASE_RULES, BaseAction, BaseFacts

    for bits in itertools.product((False, True), repeat=4):
        facts = BaseFacts(*bits)
        bound = decide(BASE_RULES, facts).action is BaseAction.BOUND
        fits = facts.tools_match and facts.engine_match and facts.cwd_match
        assert bound == (facts.base_bound and fits), facts


def test_form_table_chooses_items_only_when_every_condition_holds() -> None:
    from codex_turn.fsm.thread import FORM_RULES, FormFacts, ProjectionForm

    for bits in itertools.product((False, True), repeat=len(attrs.fields(FormFacts))):
        facts = FormFacts(*bits)
        decision = decide(FORM_RULES, facts)
        items = (
            not facts.text_requested
            and facts.per_turn
            and facts.can_inject
            and not facts.tools_dropped
            and not facts.own_thread
            and facts.convertible
            and facts.fits
            and facts.has_items
        )
        assert (decision.action is ProjectionForm.ITEMS) == items, facts
        assert decision.reason


def test_fork_table_continues_a_kept_fork_only_when_every_condition_holds() -> None:
    from codex_turn.fsm.thread import FORK_RULES, ForkAction, ForkFacts

    reasons = set()
    for bits in itertools.product((False, True), repeat=5):
        facts = ForkFacts(*bits)
        decision = decide(FORK_RULES, facts)
        reasons.add(decision.reason)
        sound = (
            facts.kept
            and facts.completed
            and not facts.compacted
            and facts.settings_match
            and facts.extends
        )
        assert (decision.action is ForkAction.CONTINUE) == sound, facts
    # Every rule decides some combination: none is shadowed by an earlier one.
    assert reasons == {rule.decision.reason for rule in FORK_RULES}


def test_keep_table_keeps_a_fork_only_when_its_record_is_exact() -> None:
    from codex_turn.fsm.thread import KEEP_RULES, KeepAction, KeepFacts

    reasons = set()
    for bits in itertools.product((False, True), repeat=len(attrs.fields(KeepFacts))):
        facts = KeepFacts(*bits)
        decision = decide(KEEP_RULES, facts)
        reasons.add(decision.reason)
        exact = (
            facts.completed
            and facts.convertible
            and not facts.steer_unconfirmed
            and not facts.unmirrored_items
            and not facts.prompt_differs
            and not facts.images_sent
        )
        assert (decision.action is KeepAction.KEEP) == exact, facts
    assert reasons == {rule.decision.reason for rule in KEEP_RULES}


def _tables() -> list[tuple[str, tuple[Any, ...], type]]:
    from codex_turn.fsm import thread

    return [
        ("thread", thread.THREAD_RULES, thread.ThreadFacts),
        ("base", thread.BASE_RULES, thread.BaseFacts),
        ("fork", thread.FORK_RULES, thread.ForkFacts),
        ("form", thread.FORM_RULES, thread.FormFacts),
        ("keep", thread.KEEP_RULES, thread.KeepFacts),
    ]


@pytest.mark.parametrize(("name", "rules", "facts"), _tables(), ids=[t[0] for t in _tables()])
def test_every_table_names_only_its_own_facts_and_ends_unconditionally(
    name: str, rules: tuple[Any, ...], facts: type
) -> None:
    fields = {f.name for f in attrs.fields(facts)}
    for rule in rules:
        assert set(rule.when) | set(rule.unless) <= fields, (name, rule)
    assert rules[-1].when == ()
    assert rules[-1].unless == ()


def test_the_harness_gathers_every_fact_each_table_reads() -> None:
    """The harness's fact objects (costly facts computed on first read) carry every fact
    name of their table: a missing one would fail only on the turn that reaches its row."""
    from codex_turn.fsm import thread
    from codex_turn.harness.turn.forms import ConversionFacts, SettleFacts, TurnThreadFacts

    for facts, gathered in (
        (thread.ThreadFacts, TurnThreadFacts),
        (thread.FormFacts, ConversionFacts),
        (thread.KeepFacts, SettleFacts),
    ):
        names = {f.name for f in attrs.fields(facts)}
        # Instance attributes are set in __init__; the costly ones are properties.
        source = inspect.getsource(gathered)
        missing = {n for n in names if not hasattr(gathered, n) and f"self.{n} =" not in source}
        assert not missing, (gathered.__name__, missing)


def test_a_plan_reads_only_the_tables_its_action_needs() -> None:
    from codex_turn.fsm.thread import (
        BaseAction,
        BaseFacts,
        Choice,
        ForkAction,
        ForkFacts,
        plan_thread,
    )

    read: list[str] = []

    class Facts:
        @property
        def base(self) -> BaseFacts:
            read.append("base")
            return BaseFacts()

        def fork(self, base: Choice[BaseAction]) -> ForkFacts:
            read.append(f"fork:{base.action.value}")
            return ForkFacts()

    for row in THREAD_RULES:
        read.clear()
        plan = plan_thread(row.decision, Facts())
        assert plan.decision is row.decision
        if row.decision.action is ThreadAction.FORK:
            assert read == ["base", "fork:new"]  # no base bound: a new one, nothing kept
            assert plan.base is not None
            assert plan.base.action is BaseAction.NEW
            assert plan.fork is not None
            assert plan.fork.action is ForkAction.NEW
        else:
            assert read == []
            assert plan.base is None
            assert plan.fork is None
