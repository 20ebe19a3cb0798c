"""The two forms of a projection, and the fork that carries one: the projecting stage's and
the fork decision's I/O-free helpers and the ``fork`` thread start (issue 15).

Theory. An engine's assembled context reaches Codex either as the *text frame* (one user
message in ``turn/start``, :mod:`codex_turn.projection.frame`) or as *Responses items*
(:mod:`codex_turn.projection.items`) injected into an ephemeral fork of the session's base
thread (:mod:`codex_turn.harness.structured`). Which form a turn uses is the form table's
(:data:`codex_turn.fsm.thread.FORM_RULES`); which base a fork uses is the base table's
(:data:`~codex_turn.fsm.thread.BASE_RULES`). This module asks them and does what they say;
like the stages (:mod:`codex_turn.harness.stages`, which call it), it fires nothing and
chooses no branch of its own. Errors are logged with typed reasons, never with content.

A session whose bound thread is a fork base holds no conversation in Codex: when the engine
gives no context, the recent transcript stands in (:func:`transcript_context`), as items for
a fork or as the text frame for a fresh thread, as the thread decision asks.
"""

from __future__ import annotations

import json
from typing import Any, Final

import attrs

from codex_turn._log import format_error
from codex_turn.fsm import TurnTrigger
from codex_turn.fsm.thread import (
    BaseAction,
    BaseFacts,
    ForkAction,
    ForkFacts,
    FormFacts,
    ProjectionForm,
    ThreadAction,
    ThreadDecision,
    decide_base,
    decide_fork,
    decide_form,
    decide_thread,
)
from codex_turn.harness.appserver import (
    AppServerError,
    CodexTurnResult,
    KeptFork,
    ThreadNotFound,
    ThreadResult,
    settings_key,
)
from codex_turn.harness.binding import ProjectionBinding
from codex_turn.harness.engine import AgentMessage
from codex_turn.harness.lifecycle import ASSEMBLE_FAILED_WARNING
from codex_turn.harness.structured import (
    ForkFailed,
    anchor_base,
    developer_item,
    drop_kept_fork,
    fork_failure,
    keep_fork,
    kept_fork,
    prepare_fork,
    release_fork,
    supports_structured,
    take_kept_fork,
)
from codex_turn.harness.turn_api import TURN_START_TEXT_MAX_CHARS
from codex_turn.harness.turn_context import (
    Projected,
    ThreadReady,
    TurnContext,
    engine_binding,
    save_binding,
    thread_facts,
)
from codex_turn.projection import (
    CodexContextProjection,
    frame_context,
    max_rendered_context_chars,
    project_context_engine_assembly,
    project_thread_bootstrap_assembly,
)
from codex_turn.projection.frame import unframed_projection
from codex_turn.projection.items import (
    ConversionCache,
    ConvertedItems,
    Unconvertible,
    canonical_json,
    check_items,
    convert_messages,
    newest_items,
)

__all__ = [
    "as_items",
    "fork_refused",
    "frame_may_be_sent",
    "release_kept_fork",
    "render_projection",
    "settle_fork",
    "start_fork",
    "transcript_context",
    "unframed",
]

T = TurnTrigger


def unframed(ctx: TurnContext, addition: str | None) -> CodexContextProjection:
    """The projection without a rendered frame: the trimmed prompt and the instruction
    addition (for items, or for a thread that already carries the context)."""
    return unframed_projection(
        original_history_messages=ctx.messages,
        prompt=ctx.params.prompt,
        system_prompt_addition=addition,
    )


def items_cap(ctx: TurnContext) -> int:
    """The cap on the items' canonical JSON: the text frame's (Codex checks no context
    window on injected items; a real model would refuse an oversized request)."""
    return max_rendered_context_chars(ctx.params.context_token_budget, ctx.params.reserve_tokens)


def convert(
    ctx: TurnContext,
    messages: list[AgentMessage],
    source: str,
    cache: ConversionCache | None = None,
) -> ConvertedItems | None:
    """``messages`` as Responses items, or ``None`` (logged with the typed reason; never the
    content) when they do not convert soundly."""
    params = ctx.params
    converted = convert_messages(
        messages, prompt=params.prompt, payload_policy=params.tool_payloads, cache=cache
    )
    if isinstance(converted, Unconvertible):
        ctx.log.warning(
            "codex structured projection unavailable; using the text frame",
            source=source,
            reason=converted.reason.value,
            message_index=converted.index,
        )
        return None
    if converted.items and check_items(converted.items, cache=cache) is not None:
        ctx.log.warning(
            "codex structured projection unavailable; using the text frame",
            source=source,
            reason="unsound_items",
        )
        return None
    return converted


def session_conversion(ctx: TurnContext) -> ConversionCache:
    """The conversion state of the session's last assembly, kept with the fork its turn ran
    in (an unchanged prefix is not converted again), or a fresh one."""
    bound = ctx.binding
    port = ctx.app_server
    if bound is not None and bound.fork_base and supports_structured(port):
        kept = kept_fork(port, bound.thread_id)
        if kept is not None and isinstance(kept.memo, ConversionCache):
            return kept.memo
    return ConversionCache()


def as_items(
    ctx: TurnContext,
    messages: list[AgentMessage],
    *,
    per_turn: bool,
    source: str,
    cache: ConversionCache | None = None,
) -> ConvertedItems | None:
    """``messages`` as the items to inject when the form table chooses the structured form
    (asked again with what the conversion found: unconvertible, or nothing fits the cap),
    else ``None``: the text form, or nothing to project."""
    params = ctx.params
    facts = FormFacts(
        text_requested=params.projection_format == "text",
        per_turn=per_turn,
        can_inject=supports_structured(ctx.app_server),
        tools_dropped=thread_facts(ctx).tools_dropped,
    )
    form = decide_form(facts)
    converted: ConvertedItems | None = None
    if form.form is ProjectionForm.ITEMS:
        converted = convert(ctx, messages, source, cache)
        if converted is None:
            form = decide_form(attrs.evolve(facts, convertible=False))
        elif converted.items:
            cut = newest_items(converted, items_cap(ctx))
            if not cut.items:
                ctx.log.warning(
                    "codex structured projection unavailable; using the text frame",
                    source=source,
                    reason="exceeds_cap",
                )
                form, converted = decide_form(attrs.evolve(facts, fits=False)), None
            else:
                converted = cut
    ctx.log.debug(
        "codex context projection form", form=form.form.value, reason=form.reason, source=source
    )
    if form.form is not ProjectionForm.ITEMS or converted is None or not converted.items:
        return None
    return converted


def frame_may_be_sent(ctx: TurnContext) -> bool:
    """Whether the thread table could send this turn's frame: it asks for it, or whether
    there is context to frame changes its decision (so the frame must be rendered to know)."""
    facts = thread_facts(ctx)
    with_context = decide_thread(attrs.evolve(facts, has_context=True))
    without_context = decide_thread(attrs.evolve(facts, has_context=False))
    return with_context.project or with_context != without_context


def render_projection(ctx: TurnContext) -> Projected | None:
    """The engine's assembly framed for Codex, or ``None`` (logged) when projection failed."""
    assembled = ctx.assembled
    assert assembled is not None
    return render_frame(
        ctx,
        assembled.result.messages,
        assembled.result.system_prompt_addition,
        bootstrap=assembled.bootstrap_epoch is not None,
    )


def render_frame(
    ctx: TurnContext, messages: list[AgentMessage], addition: str | None, *, bootstrap: bool
) -> Projected | None:
    params = ctx.params
    projector = project_thread_bootstrap_assembly if bootstrap else project_context_engine_assembly
    # The framed context must fit Codex's turn input next to the prompt: cap the context,
    # never cut the frame (its header and safety note are the prompt-injection guard).
    frame_and_prompt = len(frame_context("x", params.prompt.strip())) - 1
    try:
        projection = projector(
            assembled_messages=messages,
            original_history_messages=ctx.messages,
            prompt=params.prompt,
            system_prompt_addition=addition,
            token_budget=params.context_token_budget,
            reserve_tokens=params.reserve_tokens,
            max_context_chars=max(0, TURN_START_TEXT_MAX_CHARS - frame_and_prompt),
        )
    except Exception as error:
        ctx.log.warning(ASSEMBLE_FAILED_WARNING, error=format_error(error), stage="projection")
        return None
    return Projected(projection)


def recent_transcript(ctx: TurnContext) -> list[AgentMessage]:
    """The newest transcript messages worth converting: about twice the cap in JSON (the
    conversion cuts to the cap), starting at a message that is not a tool result."""
    messages, budget = ctx.messages, 2 * items_cap(ctx)
    start, used = len(messages), 0
    while start > 0 and used <= budget:
        start -= 1
        used += len(json.dumps(messages[start], ensure_ascii=False, default=str))
    while start < len(messages) and messages[start].get("role") == "toolResult":
        start += 1
    return list(messages[start:])


def transcript_context(ctx: TurnContext, decision: ThreadDecision) -> Projected | None:
    """The recent transcript as this turn's context, the stand-in for an engine context on a
    session whose bound thread (a fork base) holds no conversation: items for a fork when
    the form table allows, else the text frame of it."""
    addition = ctx.assembled.result.system_prompt_addition if ctx.assembled is not None else None
    recent = recent_transcript(ctx)
    if decision.action is ThreadAction.FORK:
        items = as_items(ctx, recent, per_turn=True, source="transcript")
        if items is not None:
            return Projected(unframed(ctx, addition), framed=False, items=items)
    return render_frame(ctx, recent, addition, bootstrap=False)


_FORK_BASE: Final = ProjectionBinding(mode="fork_base", epoch="fork-base")


async def start_fork(ctx: TurnContext, settings: dict[str, Any]) -> TurnTrigger:
    """The ``fork`` decision: fork the session's base thread (the base table says which:
    the bound one, or a new one started, anchored and bound), inject this turn's context and
    its instructions into the idle fork. Codex refusing the fork is ``fork_failed`` (the text
    frame follows); no answer (a timeout, a dead process) fails the turn like any thread
    start, the binding kept."""
    plan, bound = ctx.plan, ctx.binding
    assert plan is not None
    port = ctx.app_server
    if not supports_structured(port):  # pragma: no cover - the tables fork only when it can
        raise AssertionError("a fork was decided for an app-server that cannot fork")
    facts = thread_facts(ctx)
    base = decide_base(
        BaseFacts(
            base_bound=facts.base_bound,
            tools_match=facts.tools_match,
            engine_match=facts.engine_match,
            cwd_match=bound is not None and bound.cwd == settings["cwd"],
        )
    )
    binding = bound
    if base.action is BaseAction.NEW:
        try:
            # Neutral instructions: a fork inherits its base's initial context, so the
            # turn's instructions go into each fork instead (they may change every turn).
            started = await ctx.app_server.start_thread(
                **{**settings, "developer_instructions": None}
            )
        except AppServerError as error:
            ctx.log.warning("codex app-server thread start failed", error=format_error(error))
            ctx.start_error = format_error(error)
            return T.THREAD_START_FAILED
        try:
            # A rollout, so that this process and any later one can fork it.
            await anchor_base(port, started.thread_id)
        except AppServerError as error:
            ctx.app_server.forget_thread(started.thread_id)
            return fork_refused(ctx, fork_failure("anchor", error))
        # The base never runs a turn here: nothing of it is kept locally (tools, memo).
        ctx.app_server.forget_thread(started.thread_id)
        binding = await save_binding(
            ctx,
            started,
            previous=None,
            engine_record=engine_binding(ctx, _FORK_BASE),
            tools_fingerprint=ctx.tools_fingerprint,
        )
        if bound is not None and bound.thread_id != started.thread_id:
            ctx.app_server.forget_thread(bound.thread_id)  # it runs no more turns
            release_kept_fork(ctx, bound.thread_id)
        if ctx.history is not None and binding is not None:
            # The session's thread is now the new base (a refused fork retires it).
            ctx.history = attrs.evolve(ctx.history, binding=binding)
        base_id = started.thread_id
    else:
        assert bound is not None
        base_id = bound.thread_id
    projected = ctx.projected
    converted = projected.items if projected is not None else None
    context = list(converted.items) if converted is not None else []
    held = tuple(map(_item_key, context))
    record = KeptFork(
        base_thread_id=base_id,
        fork_thread_id="",
        holds=held,
        settings=settings_key(**settings),
        completed=False,
        memo=projected.conversion if projected is not None else None,
    )
    kept = take_kept_fork(port, base_id)
    loaded = ctx.app_server.loaded_thread(kept.fork_thread_id) if kept is not None else None
    fork_facts = ForkFacts(
        kept=loaded is not None,
        completed=kept is not None and kept.completed,
        compacted=loaded is not None and loaded.compacted,
        settings_match=kept is not None and kept.settings == record.settings,
        extends=kept is not None and held[: len(kept.holds)] == kept.holds,
    )
    how = decide_fork(fork_facts)
    continued: ThreadResult | None = None
    if how.action is ForkAction.CONTINUE:
        assert kept is not None
        assert loaded is not None
        outcome = await _continue_fork(ctx, kept, context[len(kept.holds) :])
        if isinstance(outcome, ForkFailed):
            return fork_refused(ctx, outcome)
        if outcome:
            continued, injected = loaded.result, len(context) - len(kept.holds)
        else:  # Codex no longer holds it (a new process): the table, told so, forks afresh
            kept, how = None, decide_fork(attrs.evolve(fork_facts, kept=False))
    if continued is not None:
        result = continued
    else:
        if kept is not None:
            release_fork(port, kept.fork_thread_id)  # it holds what this turn must not see
        if plan.instructions:
            context.append(developer_item(plan.instructions))
        prepared = await prepare_fork(
            port,
            base_id,
            context,
            developer_instructions=None,
            cwd=settings["cwd"],
            model=settings["model"],
            tools=ctx.tools,
            approvals_reviewer=settings["approvals_reviewer"],
            service_tier=settings["service_tier"],
        )
        if isinstance(prepared, ForkFailed):
            return fork_refused(ctx, prepared)
        result, injected = prepared.thread, prepared.injected
    record = attrs.evolve(record, fork_thread_id=result.thread_id)
    ctx.thread = ThreadReady(result=result, binding=binding, fork=record)
    ctx.log = ctx.log.bind(thread_id=result.thread_id)
    ctx.log.info(
        "codex app-server thread forked",
        reason=plan.decision.reason,
        base=base.reason,
        fork=how.reason,
        items=injected,
        source="transcript" if plan.decision.transcript else "assembly",
    )
    return T.THREAD_FORKED


async def _continue_fork(
    ctx: TurnContext, kept: KeptFork, tail: list[dict[str, Any]]
) -> ForkFailed | bool:
    """Inject what follows the kept fork's content (the turn's instructions are in it
    already: the fork table continues only a fork made with the same ones) and bind this
    turn's tool handlers to it: ``True``. ``False`` when Codex no longer knows the fork (its
    process was replaced meanwhile): an answer about the fork, not the base."""
    port = ctx.app_server
    assert supports_structured(port)
    try:
        if tail:
            await port.inject_items(kept.fork_thread_id, tail)
    except ThreadNotFound:
        release_fork(port, kept.fork_thread_id)
        return False
    except AppServerError as error:
        release_fork(port, kept.fork_thread_id)
        return fork_failure("inject", error, kept.fork_thread_id)
    except BaseException:
        release_fork(port, kept.fork_thread_id)  # cancelled: nobody will run this fork
        raise
    if ctx.tools:
        ctx.app_server.bind_tools(kept.fork_thread_id, ctx.tools)
    return True


def settle_fork(ctx: TurnContext, ran: CodexTurnResult | None) -> None:
    """A fork ran this turn (``ran``: its result when the turn completed): keep it for the
    session's next turn with what it now holds (the context, then the turn's own messages,
    converted as the engine will hand them back, numbered where they will follow the
    context), for the fork table to judge; or release it when no exact record can be made
    (:func:`_inexact`). An incomplete turn's fork is released at once: it is never continued,
    and its tool handlers must not outlive the turn (a Codex turn whose interrupt went
    unanswered could still call them)."""
    thread, port = ctx.thread, ctx.app_server
    assert thread is not None
    assert thread.fork is not None
    if not supports_structured(port):  # pragma: no cover - only a fork-capable port forks
        return
    record = thread.fork
    if ran is None:
        release_fork(port, record.fork_thread_id)
        return
    projected = ctx.projected
    start = projected.items.end if projected is not None and projected.items else 0
    own = convert_messages(
        ran.messages_snapshot, payload_policy=ctx.params.tool_payloads, first_index=start
    )
    why = own.reason.value if isinstance(own, Unconvertible) else _inexact(ctx, ran, own)
    if why is not None:
        ctx.log.debug("codex fork released", reason=why)
        release_fork(port, record.fork_thread_id)
        return
    assert isinstance(own, ConvertedItems)
    held = record.holds + tuple(map(_item_key, own.items))
    keep_fork(port, attrs.evolve(record, holds=held, completed=True))


#: What a turn may have left in the fork for its mirror to stand for it: the prompt, one
#: reply, and the reasoning and plan the mirror writes as text.
_MIRRORED_KINDS: Final = frozenset({"userMessage", "agentMessage", "reasoning", "plan"})


def _inexact(ctx: TurnContext, ran: CodexTurnResult, own: ConvertedItems) -> str | None:
    """Why the turn's own items, as the engine will hand them back, are not what the fork
    holds of the turn, or ``None``. The fork holds what was *sent*: a prompt a hook changed
    (``prepend_context``) or cut, or images, differ from the mirrored prompt. And it holds
    every item of the turn: tool calls and their outputs in full (the mirror keeps none of
    them, and the engine's form follows ``tool_payloads``), commentary besides the reply.
    Nor a fork a steer went to whose fate stayed unknown: Codex may hold it where no record
    or mirror does (a runner that sends it again would show it twice).
    Such a fork is not continued."""
    plan = ctx.plan
    assert plan is not None
    if ctx.live is not None and ctx.live.unconfirmed:
        return "steer_unconfirmed"
    kinds = ran.item_kinds
    if not _MIRRORED_KINDS.issuperset(kinds) or kinds.count("agentMessage") > 1:
        return "unmirrored_items"
    first = own.items[0] if own.items else None
    sent = [{"type": "input_text", "text": plan.prompt}]
    if first is None or first.get("role") != "user" or list(first.get("content", ())) != sent:
        return "prompt_differs"
    if ctx.params.images:
        return "images_sent"
    return None


def _item_key(item: dict[str, Any]) -> str:
    """What names an item in a fork's record: its id (content- and position-derived, see
    :mod:`codex_turn.projection.items`), else its canonical JSON."""
    key = item.get("id")
    return key if isinstance(key, str) else canonical_json(item)


def release_kept_fork(ctx: TurnContext, base_thread_id: str) -> None:
    """The session leaves ``base_thread_id``: release the fork kept for it, if any."""
    drop_kept_fork(ctx.app_server, base_thread_id)


def fork_refused(ctx: TurnContext, failed: ForkFailed) -> TurnTrigger:
    if not failed.definitive:
        # No answer says nothing about the base: keep the binding, fail this turn.
        ctx.log.warning(
            "codex structured projection fork failed; keeping the binding",
            step=failed.step,
            error=failed.error,
        )
        ctx.start_error = failed.error
        return T.THREAD_START_FAILED
    ctx.log.warning(
        "codex structured projection fork failed; using the text frame",
        step=failed.step,
        error=failed.error,
    )
    ctx.fork_refused = True
    return T.FORK_FAILED
