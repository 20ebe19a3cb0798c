"""The two forms of a projection: the facts the form and thread tables read, the frame and
the items they lead to, and what a fork keeps after its turn.

Theory. An engine's assembled context reaches Codex either as the *text frame* (one user
message in ``turn/start``, :mod:`codex_turn.projection.frame`) or as *Responses items*
(:mod:`codex_turn.projection.items`) injected into an ephemeral fork of the session's base
thread (:mod:`codex_turn.harness.turn.structured`). Which form a turn uses is the form table's
(:data:`codex_turn.fsm.thread.FORM_RULES`), whether the frame is sent the thread table's.
Both read their facts from here, and the costly ones are computed when a row first reads
them: the conversion (:class:`ConversionFacts`) and the rendered frame
(:class:`TurnThreadFacts`), so a frame the thread decision would not send is never rendered
and nothing is asked twice. Like the stages (:mod:`codex_turn.harness.turn.stages`, which call
it), this module fires nothing and chooses no branch of its own. Errors are logged with
typed reasons, never with content.

A session whose bound thread is a fork base holds no conversation in Codex: when the engine
gives no context, the recent transcript stands in (:func:`transcript_context`), as items for
a fork or as the text frame for a fresh thread, as the thread decision asks.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from codex_turn.fsm import thread as thread_tables
from codex_turn.fsm.thread import (
    FORM_RULES,
    KEEP_RULES,
    Choice,
    ContextSource,
    KeepAction,
    ProjectionForm,
    ThreadAction,
    ThreadDecision,
    decide,
)
from codex_turn.harness.appserver import CodexTurnResult
from codex_turn.harness.engine import AgentMessage
from codex_turn.harness.turn.context import (
    Projected,
    TurnContext,
    engine_binding,
    has_projected_context,
)
from codex_turn.harness.turn.continuity import without_prompt
from codex_turn.harness.turn.structured import (
    drop_kept_fork,
    keep_fork,
    kept_fork,
    release_fork,
    supports_structured,
)
from codex_turn.harness.turn_api import TURN_START_TEXT_MAX_CHARS
from codex_turn.projection import (
    CodexContextProjection,
    dynamic_tools_fingerprint,
    fingerprints_compatible,
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
    image_url,
    newest_items,
)

__all__ = [
    "ConversionFacts",
    "TurnThreadFacts",
    "as_items",
    "decide_thread",
    "frame_projection",
    "item_key",
    "release_kept_fork",
    "render_frame",
    "session_conversion",
    "settle_fork",
    "transcript_context",
    "unframed",
]


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
    return max_rendered_context_chars(fitting_budget(ctx), ctx.params.reserve_tokens)


#: A budget so large that the frame's cap is its ceiling: an ``assembled`` assembly is not
#: fitted to the turn's budget (only Codex's own input limit still applies).
_UNFITTED_BUDGET: Final = 10**12


def fitting_budget(ctx: TurnContext) -> int | None:
    """The budget the host fits the engine's assembly to: the turn's, unless the engine
    took the prompt's authority (``prompt_authority="assembled"``: its assembly is the whole
    prompt context, sent as it is within Codex's input limit)."""
    assembled = ctx.assembled
    if assembled is not None and assembled.result.prompt_authority == "assembled":
        return _UNFITTED_BUDGET
    return ctx.params.context_token_budget


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


# --- the facts of the form table ------------------------------------------------------------

_NO_TOOLS: Final = dynamic_tools_fingerprint(())


def own_thread(ctx: TurnContext) -> bool:
    """The runner asked for this turn on a transient thread of its own (a lightweight run, a
    heartbeat: ``THREAD_RULES``' first row)."""
    return ctx.params.lightweight or ctx.params.heartbeat


def tools_dropped(ctx: TurnContext) -> bool:
    """This turn declares no dynamic tools while the bound thread has some."""
    binding = ctx.binding
    return (
        binding is not None
        and binding.dynamic_tools_fingerprint not in (None, "", _NO_TOOLS)
        and ctx.tools_fingerprint == _NO_TOOLS
    )


class ConversionFacts:
    """The :class:`~codex_turn.fsm.thread.FormFacts` of ``messages`` for this turn. The
    conversion behind ``convertible``, ``has_items`` and ``fits`` runs when the table first
    reads one of them (its earlier rows may choose the text frame without it); what it
    produced is :attr:`items`. Why it failed is logged with its typed reason, never the
    content."""

    def __init__(
        self,
        ctx: TurnContext,
        messages: list[AgentMessage],
        *,
        per_turn: bool,
        source: str,
        cache: ConversionCache | None = None,
    ) -> None:
        self._ctx, self._messages, self._source, self._cache = ctx, messages, source, cache
        self.text_requested = ctx.params.projection_format == "text"
        self.per_turn = per_turn
        self.can_inject = supports_structured(ctx.app_server)
        self.tools_dropped = tools_dropped(ctx)
        self.own_thread = own_thread(ctx)
        #: The items to inject, once the table read ``fits`` and they fit (else ``None``).
        self.items: ConvertedItems | None = None

    @functools.cached_property
    def _converted(self) -> ConvertedItems | None:
        params = self._ctx.params
        converted = convert_messages(
            self._messages,
            prompt=params.prompt,
            payload_policy=params.tool_payloads,
            cache=self._cache,
            prompt_key=self._ctx.known_prompt_key,
        )
        if isinstance(converted, Unconvertible):
            self._unavailable(converted.reason.value, message_index=converted.index)
            return None
        if converted.items and check_items(converted.items, cache=self._cache) is not None:
            self._unavailable("unsound_items")
            return None
        return converted

    def _unavailable(self, reason: str, **fields: Any) -> None:
        self._ctx.log.warning(
            "codex structured projection unavailable; using the text frame",
            source=self._source,
            reason=reason,
            **fields,
        )

    @property
    def convertible(self) -> bool:
        return self._converted is not None

    @property
    def has_items(self) -> bool:
        converted = self._converted
        return converted is not None and bool(converted.items)

    @functools.cached_property
    def fits(self) -> bool:
        converted = self._converted
        assert converted is not None  # the table reads fits only after convertible
        cut = newest_items(converted, items_cap(self._ctx))
        if not cut.items:
            self._unavailable("exceeds_cap")
            return False
        self.items = cut
        return True


def as_items(
    ctx: TurnContext,
    messages: list[AgentMessage],
    *,
    per_turn: bool,
    source: str,
    cache: ConversionCache | None = None,
) -> tuple[Choice[ProjectionForm], ConvertedItems | None]:
    """The form table's choice for ``messages``, and the items to inject when it chose them."""
    facts = ConversionFacts(ctx, messages, per_turn=per_turn, source=source, cache=cache)
    form = decide(FORM_RULES, facts)
    ctx.log.debug(
        "codex context projection form", form=form.action.value, reason=form.reason, source=source
    )
    return form, facts.items if form.action is ProjectionForm.ITEMS else None


# --- the facts of the thread table ----------------------------------------------------------


class TurnThreadFacts:
    """The :class:`~codex_turn.fsm.thread.ThreadFacts` of this turn, gathered once; the
    table reads them by name. ``has_context`` (and ``items``, which needs it) is computed on
    first read, because it may render the frame (kept in the context for the prompt); a
    render that fails raises from that read."""

    def __init__(self, ctx: TurnContext) -> None:
        self._ctx = ctx
        binding = ctx.binding
        wanted = engine_binding(ctx, None)
        bound_engine = binding.context_engine if binding is not None else None
        self.engine_match = (
            bound_engine is None
            if wanted is None
            else bound_engine is not None
            and bound_engine.engine_id == wanted.engine_id
            and bound_engine.policy_fingerprint == wanted.policy_fingerprint
        )
        bound_projection = bound_engine.projection if bound_engine is not None else None
        epoch = ctx.assembled.bootstrap_epoch if ctx.assembled is not None else None
        self.bound = binding is not None
        self.tools_match = binding is None or fingerprints_compatible(
            binding.dynamic_tools_fingerprint, ctx.tools_fingerprint
        )
        self.tools_dropped = tools_dropped(ctx)
        self.own_thread = own_thread(ctx)
        self.thread_bootstrap = epoch is not None
        self.epoch_match = (
            epoch is not None
            and bound_projection is not None
            and bound_projection.mode == "thread_bootstrap"
            and bound_projection.epoch == epoch
        )
        self.per_turn = ctx.assembled is not None and epoch is None
        self.resume_failed = ctx.turn.resume_failed
        self.fork_failed = ctx.turn.fork_failed
        self.engine_active = ctx.engine is not None
        self.base_bound = binding is not None and binding.fork_base
        self.can_inject = supports_structured(ctx.app_server)
        self.structured = (
            self.per_turn
            and self.can_inject
            and ctx.params.projection_format != "text"
            and not self.tools_dropped
            and not self.own_thread
        )
        coverage = ctx.coverage
        self.coverage_lost = coverage.lost
        self.stale = coverage.stale
        self.overflowed = ctx.turn.overflowed
        share = ctx.params.native_history_share
        loaded = (
            ctx.app_server.loaded_thread(binding.thread_id)
            if binding is not None and share is not None
            else None
        )
        self.oversized = loaded is not None and share is not None and loaded.fills(share)
        prompt_key = ctx.known_prompt_key
        self.has_history = any(m.get("idempotencyKey") != prompt_key for m in ctx.messages)

    @functools.cached_property
    def has_context(self) -> bool:
        ctx = self._ctx
        projected = ctx.projected
        if projected is not None and projected.items is None and not projected.framed:
            ctx.projected = frame_projection(ctx)
        return has_projected_context(ctx)

    @property
    def items(self) -> bool:
        projected = self._ctx.projected
        return projected is not None and projected.items is not None and self.has_context


def decide_thread(ctx: TurnContext) -> ThreadDecision:
    """The thread table's decision for this turn, with what of the conversation goes with it
    (it may render the frame: see :class:`TurnThreadFacts`; a render that fails raises)."""
    return thread_tables.decide_thread(TurnThreadFacts(ctx))


# --- the frame --------------------------------------------------------------------------------


def frame_projection(ctx: TurnContext) -> Projected:
    """The engine's assembly framed for Codex (raises what the projector raised)."""
    assembled = ctx.assembled
    assert assembled is not None
    return render_frame(
        ctx,
        assembled.result.messages,
        assembled.result.system_prompt_addition,
        bootstrap=assembled.bootstrap_epoch is not None,
        budget=fitting_budget(ctx),
    )


def render_frame(
    ctx: TurnContext,
    messages: list[AgentMessage],
    addition: str | None,
    *,
    bootstrap: bool,
    budget: int | None = None,
) -> Projected:
    """``messages`` framed as this turn's context, fitted to ``budget`` (default: the
    turn's); raises what the projector raised."""
    params = ctx.params
    projector = project_thread_bootstrap_assembly if bootstrap else project_context_engine_assembly
    # The framed context must fit Codex's turn input next to the prompt: cap the context,
    # never cut the frame (its header and safety note are the prompt-injection guard).
    frame_and_prompt = len(frame_context("x", params.prompt.strip())) - 1
    projection = projector(
        assembled_messages=messages,
        original_history_messages=ctx.messages,
        prompt=params.prompt,
        system_prompt_addition=addition,
        token_budget=params.context_token_budget if budget is None else budget,
        reserve_tokens=params.reserve_tokens,
        max_context_chars=max(0, TURN_START_TEXT_MAX_CHARS - frame_and_prompt),
        prompt_key=ctx.known_prompt_key,
    )
    return Projected(projection)


# --- the transcript as context ----------------------------------------------------------------


def transcript_messages(ctx: TurnContext, source: ContextSource) -> list[AgentMessage]:
    """What of the transcript goes with the prompt: the newest messages (a fresh thread's), or
    those the bound thread lacks; this turn's own prompt never (it is the turn's input)."""
    if source is ContextSource.UNCOVERED:
        return newest_worth_converting(ctx, ctx.coverage.uncovered)
    return newest_worth_converting(ctx, without_prompt(ctx.messages, ctx.known_prompt_key))


def newest_worth_converting(
    ctx: TurnContext, messages: Sequence[AgentMessage]
) -> list[AgentMessage]:
    """The newest of ``messages`` worth converting: about twice the cap in JSON (the
    conversion and the frame cut to the cap), starting at a message that is not a tool
    result."""
    budget = 2 * items_cap(ctx)
    start, used = len(messages), 0
    while start > 0 and used <= budget:
        start -= 1
        used += len(json.dumps(messages[start], ensure_ascii=False, default=str))
    while start < len(messages) and messages[start].get("role") == "toolResult":
        start += 1
    return list(messages[start:])


def transcript_context(ctx: TurnContext, decision: ThreadDecision) -> Projected:
    """What of the transcript ``decision`` carries (:func:`transcript_messages`), standing
    in for an engine context no thread holds: items for a fork when the form table allows,
    else the text frame of it (raises what the projector raised)."""
    addition = ctx.assembled.result.system_prompt_addition if ctx.assembled is not None else None
    assert decision.context is not None
    recent = transcript_messages(ctx, decision.context.action)
    if decision.action is ThreadAction.FORK:  # only a fork can take items
        _, items = as_items(ctx, recent, per_turn=True, source="transcript")
        if items is not None:
            return Projected(unframed(ctx, addition), framed=False, items=items)
    framed = render_frame(ctx, recent, addition, bootstrap=False)
    return attrs.evolve(framed, images=restored_images(recent))


#: The bound on images restored with a text frame: how many, and their URLs' total size.
RESTORED_IMAGES_MAX: Final = 4
RESTORED_IMAGE_CHARS_MAX: Final = 8 << 20


def restored_images(messages: Sequence[AgentMessage]) -> tuple[str, ...]:
    """The images of the user messages the text frame stands for, newest first, within
    :data:`RESTORED_IMAGES_MAX` and :data:`RESTORED_IMAGE_CHARS_MAX` (an image that does not
    fit is left out; the frame keeps its placeholder)."""
    found: list[str] = []
    room = RESTORED_IMAGE_CHARS_MAX
    for message in reversed(messages):
        content = message.get("content") if message.get("role") == "user" else None
        if isinstance(content, str) or not isinstance(content, Sequence):
            continue
        for part in reversed(content):
            url = (
                image_url(part)
                if isinstance(part, Mapping) and part.get("type") == "image"
                else None
            )
            if url is None or len(url) > room or len(found) >= RESTORED_IMAGES_MAX:
                continue
            found.append(url)
            room -= len(url)
    return tuple(reversed(found))


class SettleFacts:
    """The :class:`~codex_turn.fsm.thread.KeepFacts` of a fork whose turn ended (``ran``:
    its result when the turn completed). The turn's own messages are converted as the
    engine will hand them back (numbered where they will follow the context) when the table
    first asks; :attr:`own` is what that produced."""

    def __init__(self, ctx: TurnContext, ran: CodexTurnResult | None) -> None:
        self._ctx, self._ran = ctx, ran
        self.completed = ran is not None
        live = ctx.live
        self.steer_unconfirmed = live is not None and bool(live.unconfirmed)
        self.images_sent = bool(ctx.params.images)

    @functools.cached_property
    def own(self) -> ConvertedItems | Unconvertible:
        ctx, ran = self._ctx, self._ran
        assert ran is not None  # read only for a completed turn
        projected = ctx.projected
        start = projected.items.end if projected is not None and projected.items else 0
        return convert_messages(
            ran.messages_snapshot, payload_policy=ctx.params.tool_payloads, first_index=start
        )

    @property
    def convertible(self) -> bool:
        return isinstance(self.own, ConvertedItems)

    @property
    def unmirrored_items(self) -> bool:
        assert self._ran is not None
        kinds = self._ran.item_kinds
        return not _MIRRORED_KINDS.issuperset(kinds) or kinds.count("agentMessage") > 1

    @property
    def prompt_differs(self) -> bool:
        plan, own = self._ctx.plan, self.own
        assert plan is not None
        assert isinstance(own, ConvertedItems)
        first = own.items[0] if own.items else None
        sent = [{"type": "input_text", "text": plan.prompt}]
        return (
            first is None or first.get("role") != "user" or list(first.get("content", ())) != sent
        )


#: What a turn may have left in the fork for its mirror to stand for it: the prompt, one
#: reply, and the reasoning and plan the mirror writes as text.
_MIRRORED_KINDS: Final = frozenset({"userMessage", "agentMessage", "reasoning", "plan"})


def settle_fork(ctx: TurnContext, ran: CodexTurnResult | None) -> None:
    """A fork ran this turn (``ran``: its result when the turn completed): keep it for the
    session's next turn with what it now holds (the context, then the turn's own messages
    as the engine will hand them back), for the fork table to judge; or release it when the
    keep table finds no exact record can be made (:data:`~codex_turn.fsm.thread.KEEP_RULES`).
    An incomplete turn's fork is released at once: it is never continued, and its tool
    handlers must not outlive the turn (a Codex turn whose interrupt went unanswered could
    still call them)."""
    thread, port = ctx.thread, ctx.app_server
    assert thread is not None
    assert thread.fork is not None
    if not supports_structured(port):  # pragma: no cover - only a fork-capable port forks
        return
    record = thread.fork
    facts = SettleFacts(ctx, ran)
    settled = decide(KEEP_RULES, facts)
    if settled.action is KeepAction.RELEASE:
        own = facts.own if facts.completed else None  # converted once the turn completed
        ctx.log.debug(
            "codex fork released",
            reason=settled.reason,
            conversion=own.reason.value if isinstance(own, Unconvertible) else None,
        )
        release_fork(port, record.fork_thread_id)
        return
    own = facts.own
    assert isinstance(own, ConvertedItems)
    held = record.holds + tuple(map(item_key, own.items))
    keep_fork(port, attrs.evolve(record, holds=held, completed=True))


def item_key(item: dict[str, Any]) -> str:
    """What names an item in a fork's record: its id (content- and position-derived, see
    :mod:`codex_turn.projection.items`), else its canonical JSON."""
    key = item.get("id")
    return key if isinstance(key, str) else canonical_json(item)


def release_kept_fork(ctx: TurnContext, base_thread_id: str) -> None:
    """The session leaves ``base_thread_id``: release the fork kept for it, if any."""
    drop_kept_fork(ctx.app_server, base_thread_id)
