"""Compaction: the sweep, its passes, and the summariser escalation.

Theory
------
A *sweep* (:meth:`Compactor.sweep`) brings one conversation's stored context from above the
threshold down to ``compaction_target`` x budget (a target *below* the threshold, so a
forced compaction leaves headroom and the next turn does not trigger another), in bounded
*passes* (at most ``max_passes``, within ``sweep_deadline_s``):

* **leaf passes** first: the oldest chunk of raw messages outside the fresh tail becomes a
  depth-0 summary (``_plan.leaf_chunks``); a forced sweep takes every such chunk;
* **condensed passes** when no leaf chunk is left and the context is still over target, or
  the summary layer itself is large: the oldest run of ``fanout`` consecutive summaries of
  the shallowest depth becomes one summary a level deeper; under pressure a fan-out of 2.

Each pass reads its sources, summarises *outside any transaction* (a model call may take
seconds), then commits optimistically (``_store.commit_summary``): if the planned items
changed meanwhile (another process compacted) nothing is written and the sweep re-plans.
The summariser escalation is the engine's: normal, aggressive, then deterministic
truncation, each output checked (non-empty, rendered smaller than its sources, capped at
3x the target). The deterministic
:class:`~codex_turn.engines.summarizers.ExtractiveSummarizer` stands in whenever a model may
not be called (the foreground).

*Which model.* The engine's own summariser when it was given one; else, with
``summarizer="auto"``, the model the host lends in the call's runtime context
(:class:`~codex_turn.engines.summarizers.HostModelSummarizer`, made per pass); else the
extractive one.

*Circuit breaker.* A refused login (an auth error: that pass writes nothing) or
``breaker_failures`` consecutive model failures (errors or timeouts; any answer resets the
count) open the breaker for ``breaker_cooldown_s``: the extractive summariser stands in,
mid-pass too, until it closes. Opening and closing are logged (the reason and counts, never
content).

The report is the sweep's own accounting, not a second reading: ``tokens_before`` is the
stored context the sweep started from, ``tokens_after`` that minus what the sweep's own
commits removed (each commit returns the tokens it applied), ``compacted`` is
``after < before``, i.e. the sweep committed a summary that saved tokens. Turns ingested
while the sweep ran (or another process's compaction) are not the sweep's: they are in
``stored_after``, the stored context measured at the end, which decides whether compaction
debt is paid. ``exhausted`` says the target was not reached because nothing outside the
fresh tail was left to compact.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, ParamSpec, Protocol, TypeVar

import anyio
import attrs

from codex_turn._log import format_error, get_logger
from codex_turn.engines import _store
from codex_turn.engines._messages import TokenEstimator, message_text
from codex_turn.engines._plan import (
    Item,
    condensed_chunk,
    leaf_chunks,
    summary_id_for,
    summary_text,
    summary_tokens,
    tail_start,
)
from codex_turn.engines._schema import Pool
from codex_turn.engines.settings import EngineSettings
from codex_turn.engines.summarizers import (
    ExtractiveSummarizer,
    HostModelSummarizer,
    Summarizer,
    SummarizerAuthError,
    SummaryRequest,
    SummarySource,
    checked,
    truncation_summary,
)
from codex_turn.harness.engine.host import HostLlm

__all__ = ["Compactor", "SweepReport"]

_log = get_logger("codex_turn.engines.sqlite")
_TRUNCATION_ID = "truncate/1"
T = TypeVar("T")
P = ParamSpec("P")


class DbRunner(Protocol):
    """Runs blocking store work in a worker thread (the engine's ``_db``)."""

    async def __call__(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T: ...


class SweepReport(NamedTuple):
    tokens_before: int
    tokens_after: int
    passes: int
    leaf_passes: int
    condensed_passes: int
    conflicts: int
    exhausted: bool
    reason: str | None
    #: The stored context measured after the sweep (includes turns ingested meanwhile).
    stored_after: int

    @property
    def compacted(self) -> bool:
        return self.tokens_after < self.tokens_before


class Compactor:
    """One engine's compaction: settings, summarisers and the circuit breaker."""

    def __init__(
        self,
        *,
        settings: EngineSettings,
        estimator: TokenEstimator,
        summarizer: Summarizer | None,
        fallback: ExtractiveSummarizer,
        db: DbRunner,
        pool: Callable[[], Pool],
    ) -> None:
        """``summarizer``: the engine's own, or ``None`` (``settings.summarizer`` decides)."""
        self.settings = settings
        self._estimate = estimator
        self._summarizer = summarizer
        self._fallback = fallback
        self._db = db
        self._pool = pool
        self._breaker_until = 0.0  # 0.0: closed (and logged so)
        self._failures = 0  # consecutive model failures

    @property
    def breaker_open(self) -> bool:
        return time.monotonic() < self._breaker_until

    def wants_model(self, llm: HostLlm | None) -> bool:
        """Whether a compaction with model access ``llm`` would call a model."""
        if self._summarizer is not None:
            return self._summarizer.uses_model
        return llm is not None and self.settings.summarizer == "auto"

    def usable_summarizer(self, allow_model: bool, llm: HostLlm | None = None) -> Summarizer:
        if self._breaker_until and not self.breaker_open:
            self._breaker_until, self._failures = 0.0, 0
            _log.info("summariser circuit breaker closed")
        chosen: Summarizer = self._summarizer or self._fallback
        if self._summarizer is None and llm is not None and self.settings.summarizer == "auto":
            chosen = HostModelSummarizer(llm)
        if chosen.uses_model and (self.breaker_open or not allow_model):
            return self._fallback
        return chosen

    def _open_breaker(self, summarizer: Summarizer, reason: str) -> None:
        self._breaker_until = time.monotonic() + self.settings.breaker_cooldown_s
        _log.warning(
            "summariser circuit breaker open",
            summarizer=summarizer.id,
            reason=reason,
            failures=self._failures,
            cooldown_s=self.settings.breaker_cooldown_s,
        )

    def _model_answered(self, summarizer: Summarizer) -> None:
        if summarizer.uses_model:
            self._failures = 0

    def _model_failed(self, summarizer: Summarizer) -> None:
        if not summarizer.uses_model:
            return
        self._failures += 1
        if self._failures >= self.settings.breaker_failures and not self.breaker_open:
            self._open_breaker(summarizer, "consecutive failures")

    def _request(
        self,
        chunk: Sequence[Item],
        kind: str,
        contents: Mapping[int | str, str],
        previous: str | None,
        custom_instructions: str | None,
    ) -> SummaryRequest:
        s = self.settings
        sources: list[SummarySource] = []
        for item in chunk:
            if item.summary_id is not None:
                text = contents.get(item.summary_id, "")
                sources.append(SummarySource("summary", text, item.tokens, item.latest))
            else:
                assert item.message_id is not None
                message = json.loads(contents.get(item.message_id, "{}"))
                role = item.role or "unknown"
                sources.append(SummarySource(role, message_text(message), item.tokens, item.ts))
        source_tokens = sum(item.tokens for item in chunk)
        goal = s.leaf_target_tokens if kind == "leaf" else s.condensed_target_tokens
        return SummaryRequest(
            kind="leaf" if kind == "leaf" else "condensed",
            depth=0 if kind == "leaf" else chunk[0].depth + 1,
            sources=tuple(sources),
            source_tokens=source_tokens,
            target_tokens=max(16, min(goal, source_tokens // 4)),
            previous_summary=previous,
            custom_instructions=custom_instructions,
        )

    async def _summarize(
        self, request: SummaryRequest, render: Callable[[str], int], summarizer: Summarizer
    ) -> tuple[str, str] | None:
        """Escalation: normal -> aggressive -> deterministic truncation. ``None`` when no
        output is smaller than the sources (the pass writes nothing)."""
        for aggressive in (False, True):
            if summarizer.uses_model and self.breaker_open:
                summarizer = self._fallback  # opened by the previous attempt
            attempt = attrs.evolve(request, aggressive=aggressive)
            try:
                with anyio.fail_after(self.settings.summary_timeout_s):
                    raw = await summarizer.summarize(attempt)
            except SummarizerAuthError:
                raise
            except Exception as error:
                _log.warning(
                    "summariser failed; escalating",
                    summarizer=summarizer.id,
                    aggressive=aggressive,
                    error=format_error(error),
                )
                self._model_failed(summarizer)
                continue
            self._model_answered(summarizer)
            text = checked(raw, attempt, self._estimate)
            if text is not None and render(text) < request.source_tokens:
                return text, summarizer.id
        cap = min(self.settings.fallback_summary_tokens, max(16, request.source_tokens // 2))
        text = checked(truncation_summary(request, cap, self._estimate), request, self._estimate)
        if text is not None and render(text) < request.source_tokens:
            return text, _TRUNCATION_ID
        return None

    async def _pass(
        self,
        conv: _store.Conversation,
        items: list[Item],
        position: int,
        chunk: list[Item],
        kind: str,
        summarizer: Summarizer,
        custom_instructions: str | None,
    ) -> Item | bool | None:
        """One compaction pass: the new summary item, ``False`` on a conflict (nothing
        written), ``None`` when no acceptable summary exists."""
        pool = self._pool()
        previous_item = items[position - 1] if position > 0 else None
        wanted = list(chunk)
        if previous_item is not None and previous_item.is_summary:
            wanted.append(previous_item)
        contents = await self._db(_store.chunk_contents, pool, wanted)
        previous = (
            contents.get(previous_item.summary_id)
            if previous_item is not None and previous_item.summary_id is not None
            else None
        )
        request = self._request(chunk, kind, contents, previous, custom_instructions)
        keys = (
            [i.source_id or "" for i in chunk]
            if kind == "leaf"
            else [i.summary_id or "" for i in chunk]
        )
        summary_id = summary_id_for(conv.uid, request.kind, request.depth, keys)
        if kind == "leaf":
            count = len(chunk)
            stamps = [i.ts for i in chunk if i.ts is not None]
            earliest, latest = (min(stamps), max(stamps)) if stamps else (None, None)
        else:
            count = sum(i.descendant_count for i in chunk)
            lows = [i.earliest for i in chunk if i.earliest is not None]
            highs = [i.latest for i in chunk if i.latest is not None]
            earliest, latest = (min(lows) if lows else None, max(highs) if highs else None)

        def render(text: str) -> int:
            rendered = summary_text(
                summary_id, request.kind, request.depth, count, earliest, latest, text
            )
            return summary_tokens(rendered, self._estimate)

        try:
            outcome = await self._summarize(request, render, summarizer)
        except SummarizerAuthError:
            self._open_breaker(summarizer, "auth")
            return False
        if outcome is None:
            return None
        text, used = outcome
        tokens = render(text)
        new = _store.NewSummary(
            id=summary_id,
            kind=request.kind,
            depth=request.depth,
            content=text,
            tokens=tokens,
            source_tokens=request.source_tokens,
            descendant_count=count,
            earliest=earliest,
            latest=latest,
            summarizer=used,
        )
        applied = await self._db(_store.commit_summary, pool, conv.id, chunk, new)
        if applied is None:
            return False
        return Item(
            ordinal=chunk[0].ordinal,
            tokens=applied,  # the stored row's (an identical summary may already exist)
            summary_id=summary_id,
            kind=request.kind,
            depth=request.depth,
            descendant_count=count,
            earliest=earliest,
            latest=latest,
        )

    async def sweep(
        self,
        conversation_id: int,
        budget: int,
        *,
        force: bool,
        allow_model: bool,
        llm: HostLlm | None = None,
        custom_instructions: str | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> SweepReport:
        """Compact ``conversation_id`` toward ``budget`` in passes; ``llm`` is the model the
        host lent this call (if any); ``stop`` (the host's abort signal) is asked before each
        pass: once it says so, the sweep ends there with what it committed (``reason``
        "aborted")."""
        s = self.settings
        pool = self._pool()
        threshold = int(budget * s.threshold)
        target = int(budget * s.compaction_target)
        tail_cap = int(budget * s.fresh_tail_max_fraction)
        condense_trigger = max(s.condensed_target_tokens, min(s.leaf_chunk_tokens, threshold // 2))
        deadline = time.monotonic() + s.sweep_deadline_s
        conv, items = await self._db(_store.planning_items, pool, conversation_id)
        before = current = conv.context_tokens
        if not force and before <= threshold:
            return SweepReport(before, before, 0, 0, 0, 0, False, "below threshold", before)
        saved = 0  # what this sweep's own commits removed
        passes = leaf = condensed = conflicts = 0
        exhausted = False
        reason: str | None = None

        def fanout(depth: int) -> int:
            return s.leaf_fanout if depth == 0 else s.condensed_fanout

        while True:
            if stop is not None and stop():
                reason = "aborted"
                break
            if passes + conflicts >= s.max_passes:
                reason = "pass limit reached"
                break
            if time.monotonic() >= deadline:
                reason = "deadline reached"
                break
            end = tail_start(items, budget, s.fresh_tail_count, tail_cap)
            found: tuple[int, list[Item]] | None = None
            kind = "leaf"
            if force or current > target:
                chunks = leaf_chunks(items, end, s.leaf_chunk_tokens, s.min_leaf_chunk_tokens)
                found = next(chunks, None)
            if found is None:
                kind = "condensed"
                layer = sum(i.tokens for i in items[:end] if i.is_summary)
                if current > target or layer > condense_trigger:
                    found = condensed_chunk(
                        items,
                        end,
                        fanout=fanout,
                        max_depth=s.max_depth,
                        chunk_tokens=s.leaf_chunk_tokens,
                    )
                    if found is None and current > target:
                        found = condensed_chunk(
                            items,
                            end,
                            fanout=lambda _d: 2,
                            max_depth=s.max_depth,
                            chunk_tokens=s.leaf_chunk_tokens,
                        )
            if found is None:
                exhausted = current > target
                if exhausted:
                    reason = "exhausted: nothing left to compact outside the fresh tail"
                elif passes == 0:
                    reason = "nothing to compact outside the fresh tail"
                break
            position, chunk = found
            summarizer = self.usable_summarizer(allow_model, llm)
            outcome = await self._pass(
                conv, items, position, chunk, kind, summarizer, custom_instructions
            )
            if outcome is None:
                reason = "no summary smaller than its sources"
                exhausted = current > target
                break
            if outcome is False:
                conflicts += 1
                conv, items = await self._db(_store.planning_items, pool, conversation_id)
                current = conv.context_tokens
                continue
            assert isinstance(outcome, Item)
            items[position : position + len(chunk)] = [outcome]
            gain = sum(i.tokens for i in chunk) - outcome.tokens
            current -= gain
            saved += gain
            passes += 1
            if kind == "leaf":
                leaf += 1
            else:
                condensed += 1
        stored = await self._db(_store.context_tokens, pool, conversation_id)
        return SweepReport(
            before, before - saved, passes, leaf, condensed, conflicts, exhausted, reason, stored
        )
