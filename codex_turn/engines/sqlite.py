"""``SqliteContextEngine``: a lossless, deterministic, crash-safe context engine on SQLite.

Theory of operation
-------------------
*The store is the conversation.* Every message a session ever had is kept (``messages``),
and what the model sees is an ordered list of context items (raw messages and summaries,
``context_items``). Compaction replaces a run of items by one summary that links to its
sources, so summaries form a DAG over the raw messages and nothing is ever deleted by it
(``_schema.py``).

*Idempotent by construction.* A message's identity is a function of the session's path
(``_messages.py``), unique per conversation in the store, so whoever delivers it, however
often: ``after_turn`` (and its retries), ``bootstrap`` after a restart, ``assemble``'s
catch-up, they can only add what is missing. ``after_turn`` also keeps a per-turn ledger
keyed by the hash of the new messages' identities, so a retried turn returns before touching
the messages at all. A path sync is checkpointed (``synced_len`` and the identity at that
point): an appended transcript costs O(new messages), a rewritten one is reconciled whole.
Bootstrap also checkpoints the transcript file (path, device, inode, size, mtime): an
unchanged file is not even read.

*Nothing blocks the event loop, nothing waits for a model in the foreground.* All database
and file work runs in worker threads (``anyio.to_thread``), in short transactions
(``BEGIN IMMEDIATE``, never across a summariser call or file I/O). Each session has two
locks: an *ingest* lock (bootstrap, ingest, after_turn, assemble's catch-up) and a *compact*
lock (one sweep at a time). A sweep's passes read, summarise outside any transaction, then
commit optimistically (nothing is written if the context changed meanwhile), so turns never
wait for a sweep, and several processes can share one store. ``after_turn`` only records
compaction *debt* when stored context crosses ``threshold`` x budget; ``maintain`` drains it,
with a model-calling summariser only when the host runs it in the background
(``allowDeferredCompactionExecution``).

*Deterministic assembly.* ``assemble`` streams the context newest-first from one joined
query and keeps the fresh tail, then older items while they fit (``_plan.py``); the same
state and budget always give the same bytes, and the ``thread_bootstrap`` epoch changes only
when the summary layer does.

*Honest compaction.* ``tokens_before``/``tokens_after`` are the stored context before and
after; ``compacted`` is ``tokens_after < tokens_before``; a sweep that cannot reach its target
says ``exhausted``. ``info.owns_compaction`` is true only while the store is healthy: a store
that cannot be opened, or fails with a database error, hands compaction back to Codex.

Logs carry ids, counts and durations only (never message text).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NamedTuple, TypeVar

import anyio
import anyio.to_thread
import attrs

from codex_turn._log import format_error, get_logger, mask_session_key
from codex_turn.engines import _doctor, _store
from codex_turn.engines._messages import (
    PathIndex,
    TokenEstimator,
    delivery_identities,
    encode_message,
    estimate_tokens,
    message_text,
    message_timestamp,
    message_tokens,
    tool_call_ids,
    tool_result_ids,
)
from codex_turn.engines._plan import (
    Item,
    condensed_chunk,
    join_ids,
    leaf_chunks,
    repair_pairs,
    select,
    summary_id_for,
    summary_text,
    summary_tokens,
    tail_start,
)
from codex_turn.engines._schema import Pool, StoreError
from codex_turn.engines.settings import EngineSettings
from codex_turn.engines.summarizers import (
    ExtractiveSummarizer,
    Summarizer,
    SummarizerAuthError,
    SummaryRequest,
    SummarySource,
    checked,
    truncation_summary,
)
from codex_turn.harness.engine import (
    AfterTurnParams,
    AgentMessage,
    AssembleParams,
    AssembleResult,
    BootstrapParams,
    BootstrapResult,
    CompactDetails,
    CompactParams,
    CompactResult,
    ContextEngineInfo,
    ContextProjection,
    IngestBatchParams,
    IngestBatchResult,
    IngestParams,
    IngestResult,
    MaintainParams,
    MaintenanceResult,
)
from codex_turn.harness.runtime_context import strip_runtime_context_messages
from codex_turn.harness.session import SessionError, load_session_context

__all__ = ["ENGINE_ID", "SqliteContextEngine"]

ENGINE_ID: Final = "codex-turn.sqlite"
ENGINE_VERSION: Final = "1"
_TRUNCATION_ID: Final = "truncate/1"
_DEFAULT_FILE: Final = "context.sqlite"

_log = get_logger(__name__)
T = TypeVar("T")

Boot = tuple[str, int, int, int, int]


class SweepReport(NamedTuple):
    tokens_before: int
    tokens_after: int
    passes: int
    leaf_passes: int
    condensed_passes: int
    conflicts: int
    exhausted: bool
    reason: str | None

    @property
    def compacted(self) -> bool:
        return self.tokens_after < self.tokens_before


def _stat(path: str) -> Boot | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _read_path(path: str) -> list[AgentMessage]:
    # load_session_context raises on an unreadable file (load_session_messages would read as
    # empty, and the checkpoint would then skip a transcript it never read).
    messages = load_session_context(path).messages
    return strip_runtime_context_messages(messages)


def _positive_int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    return int(value)


class SqliteContextEngine:
    """The reference context engine (see the module docstring).

    ``path`` is the SQLite file (created with its parent directories; an existing directory
    gets ``context.sqlite`` inside it). ``summarizer`` defaults to the deterministic
    :class:`~codex_turn.engines.summarizers.ExtractiveSummarizer`; ``token_estimator`` to the
    character heuristic :func:`~codex_turn.engines.estimate_tokens`. One instance serves any
    number of sessions, from one event loop at a time; several processes may share a file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        summarizer: Summarizer | None = None,
        token_estimator: TokenEstimator = estimate_tokens,
        settings: EngineSettings | None = None,
    ) -> None:
        target = os.fspath(path)
        if os.path.isdir(target):
            target = os.path.join(target, _DEFAULT_FILE)
        self.path = target
        self.settings = settings or EngineSettings()
        self._estimate = token_estimator
        self._fallback = ExtractiveSummarizer(token_estimator)
        self._summarizer: Summarizer = summarizer or self._fallback
        self._locks: dict[tuple[str, str], anyio.Lock] = {}
        self._paths: OrderedDict[str, PathIndex] = OrderedDict()
        self._breaker_until = 0.0
        self._health_error: str | None = None
        self._pool: Pool | None = None
        try:
            self._pool = Pool(target, busy_timeout_s=self.settings.busy_timeout_s)
        except (sqlite3.Error, StoreError, OSError) as error:
            self._health_error = format_error(error)
            _log.warning("sqlite context store unavailable", error=self._health_error)

    # -- info and health -----------------------------------------------------------------

    @property
    def info(self) -> ContextEngineInfo:
        return ContextEngineInfo(
            id=ENGINE_ID,
            name="codex-turn SQLite context engine",
            version=ENGINE_VERSION,
            owns_compaction=self.healthy,
            turn_maintenance_mode="background",
        )

    @property
    def healthy(self) -> bool:
        """The store opened and no database error has been seen since."""
        return self._pool is not None and self._health_error is None

    @property
    def summarizer(self) -> Summarizer:
        return self._summarizer

    def _require_pool(self) -> Pool:
        if self._pool is None:
            raise StoreError(f"the context store is unavailable: {self._health_error}")
        return self._pool

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking store work in a worker thread; a database error marks the store
        unhealthy (lock contention does not)."""
        try:
            return await anyio.to_thread.run_sync(functools.partial(fn, *args))
        except sqlite3.OperationalError as error:
            text = str(error).lower()
            if "locked" not in text and "busy" not in text:
                self._mark_unhealthy(error)
            raise
        except sqlite3.DatabaseError as error:
            self._mark_unhealthy(error)
            raise

    def _mark_unhealthy(self, error: BaseException) -> None:
        if self._health_error is None:
            self._health_error = format_error(error)
            _log.warning("sqlite context store failed", error=self._health_error)

    def _lock(self, kind: str, key: str) -> anyio.Lock:
        lock = self._locks.get((kind, key))
        if lock is None:
            lock = self._locks[(kind, key)] = anyio.Lock()
        return lock

    def _path_index(self, key: str) -> PathIndex:
        index = self._paths.get(key)
        if index is None:
            index = self._paths[key] = PathIndex()
        self._paths.move_to_end(key)
        while len(self._paths) > self.settings.path_cache_sessions:
            self._paths.popitem(last=False)
        return index

    def _budget(self, explicit: int | None, runtime: Mapping[str, Any] | None = None) -> int:
        budget = _positive_int(explicit)
        if budget is None and runtime is not None:
            budget = _positive_int(runtime.get("tokenBudget"))
        return budget or self.settings.default_token_budget

    def _conversation(self, key: str, create: bool = True) -> Any:
        return self._db(_store.conversation, self._require_pool(), key, create=create)

    # -- ingestion -----------------------------------------------------------------------

    def _prepare(self, source_ids: Sequence[str], messages: Sequence[AgentMessage]) -> list[_store.Prepared]:
        compress = self.settings.compress_over_bytes
        out = []
        for source, message in zip(source_ids, messages, strict=True):
            role = message.get("role")
            out.append(
                _store.Prepared(
                    source_id=source,
                    role=role if isinstance(role, str) else "unknown",
                    tokens=message_tokens(message, self._estimate),
                    ts=message_timestamp(message),
                    calls=join_ids(tool_call_ids(message)),
                    results=join_ids(tool_result_ids(message)),
                    content=_store.encode_content(encode_message(message), compress),
                )
            )
        return out

    def _insert_chunk(
        self,
        conversation_id: int,
        source_ids: Sequence[str],
        messages: Sequence[AgentMessage],
        synced: tuple[int, str | None] | None,
    ) -> int:
        pool = self._require_pool()
        held = _store.held_ids(pool, conversation_id, source_ids)
        fresh = [(s, m) for s, m in zip(source_ids, messages, strict=True) if s not in held]
        prepared = self._prepare([s for s, _ in fresh], [m for _, m in fresh])
        if not prepared and synced is None:
            return 0
        return _store.insert_messages(pool, conversation_id, prepared, synced=synced)

    async def _sync_path(self, key: str, conversation_id: int, messages: Sequence[AgentMessage]) -> int:
        """Make the store hold every message of the session path ``messages``."""
        if not messages:
            return 0
        index = self._path_index(key)
        conv = await self._db(_store.conversation_by_id, self._require_pool(), conversation_id)
        start, ids = await self._db(index.plan, messages, conv.synced_len, conv.synced_anchor)
        if start == len(messages) and conv.synced_len == len(messages):
            return 0
        imported = 0
        chunk = self.settings.sync_chunk
        for offset in range(0, max(len(ids), 1), chunk):
            batch = ids[offset : offset + chunk]
            end = start + offset + len(batch)
            anchor = batch[-1] if batch else conv.synced_anchor
            imported += await self._db(
                self._insert_chunk,
                conversation_id,
                batch,
                messages[start + offset : end],
                (end, anchor),
            )
        return imported

    async def _catch_up_file(self, key: str, session_file: str) -> tuple[int, str | None]:
        """Bootstrap's work: sync the transcript unless its checkpoint is unchanged."""
        conv = await self._conversation(key)
        boot = await anyio.to_thread.run_sync(_stat, session_file)
        if boot is None:
            return 0, "no transcript"
        if conv.boot == boot:
            return 0, "checkpoint"
        messages = await anyio.to_thread.run_sync(_read_path, session_file)
        imported = await self._sync_path(key, conv.id, messages)
        await self._db(_store.set_checkpoint, self._require_pool(), conv.id, boot)
        return imported, None

    async def bootstrap(self, params: BootstrapParams) -> BootstrapResult:
        key = params.session_key or params.session_id
        async with self._lock("ingest", key):
            imported, reason = await self._catch_up_file(key, params.session_file)
        if reason == "no transcript":
            return BootstrapResult(bootstrapped=False, imported_messages=0, reason=reason)
        if imported:
            _log.info(
                "sqlite context engine bootstrapped",
                session_key=mask_session_key(key),
                imported=imported,
            )
        return BootstrapResult(bootstrapped=True, imported_messages=imported, reason=reason)

    async def _deliver(self, key: str, messages: Sequence[AgentMessage]) -> int:
        async with self._lock("ingest", key):
            conv = await self._conversation(key)
            ids = delivery_identities(messages)
            return await self._db(self._insert_chunk, conv.id, ids, list(messages), None)

    async def ingest(self, params: IngestParams) -> IngestResult:
        count = await self._deliver(params.session_key or params.session_id, [params.message])
        return IngestResult(ingested=count > 0)

    async def ingest_batch(self, params: IngestBatchParams) -> IngestBatchResult:
        count = await self._deliver(params.session_key or params.session_id, params.messages)
        return IngestBatchResult(ingested_count=count)

    async def after_turn(self, params: AfterTurnParams) -> None:
        key = params.session_key or params.session_id
        messages = params.messages
        pre = max(0, min(params.pre_prompt_message_count, len(messages)))
        budget = self._budget(params.token_budget, params.runtime_context)
        async with self._lock("ingest", key):
            conv = await self._conversation(key)
            if pre < len(messages):
                index = self._path_index(key)
                new_ids = await self._db(index.range, messages, pre)
                turn_key = hashlib.sha256("\0".join(["turn", *new_ids]).encode()).hexdigest()
                pool = self._require_pool()
                if not await self._db(_store.has_turn, pool, conv.id, turn_key):
                    imported = await self._sync_path(key, conv.id, messages)
                    await self._db(
                        _store.record_turn, pool, conv.id, turn_key, len(new_ids), imported
                    )
            else:
                await self._sync_path(key, conv.id, messages)
        await self._note_pressure(conv.id, budget)

    async def _note_pressure(self, conversation_id: int, budget: int) -> bool:
        """Record compaction debt when stored context exceeds the threshold."""
        pool = self._require_pool()
        tokens = await self._db(_store.context_tokens, pool, conversation_id)
        if tokens <= self.settings.threshold * budget:
            return False
        await self._db(_store.set_debt, pool, conversation_id, budget, "threshold")
        return True

    # -- assembly ------------------------------------------------------------------------

    def _decode(self, item: Item) -> dict[str, Any]:
        assert isinstance(item.content, bytes)
        decoded: dict[str, Any] = json.loads(_store.decode_content(item.content))
        return decoded

    def _assemble_from(
        self, budget: int, conv: _store.Conversation, items: Any
    ) -> tuple[list[AgentMessage], int, str]:
        s = self.settings
        chosen = select(items, budget, s.fresh_tail_count, int(budget * s.fresh_tail_max_fraction))
        rendered = repair_pairs(chosen.items, self._decode, self._estimate)
        return [m for m, _ in rendered], sum(t for _, t in rendered), conv.epoch

    async def assemble(self, params: AssembleParams) -> AssembleResult:
        key = params.session_key or params.session_id
        budget = self._budget(params.token_budget)
        conv = await self._conversation(key)
        if params.messages:
            index = self._path_index(key)
            start, _ = await self._db(index.plan, params.messages, conv.synced_len, conv.synced_anchor)
            if start < len(params.messages) or conv.synced_len != len(params.messages):
                async with self._lock("ingest", key):
                    await self._sync_path(key, conv.id, params.messages)
        messages, tokens, epoch = await self._db(
            _store.stream_items,
            self._require_pool(),
            conv.id,
            functools.partial(self._assemble_from, budget),
        )
        return AssembleResult(
            messages=messages,
            estimated_tokens=tokens,
            context_projection=ContextProjection(mode="thread_bootstrap", epoch=epoch),
        )

    # -- compaction ----------------------------------------------------------------------

    def _usable_summarizer(self, allow_model: bool) -> Summarizer:
        chosen = self._summarizer
        if time.monotonic() < self._breaker_until or (chosen.uses_model and not allow_model):
            return self._fallback
        return chosen

    def _request(
        self, chunk: Sequence[Item], kind: str, contents: Mapping[int | str, str], previous: str | None,
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
                continue
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
        pool = self._require_pool()
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
        keys = [i.source_id or "" for i in chunk] if kind == "leaf" else [i.summary_id or "" for i in chunk]
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
            rendered = summary_text(summary_id, request.kind, request.depth, count, earliest, latest, text)
            return summary_tokens(rendered, self._estimate)

        try:
            outcome = await self._summarize(request, render, summarizer)
        except SummarizerAuthError:
            self._breaker_until = time.monotonic() + self.settings.breaker_cooldown_s
            _log.warning("summariser auth failed; circuit breaker open", summarizer=summarizer.id)
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
        if not await self._db(_store.commit_summary, pool, conv.id, chunk, new):
            return False
        return Item(
            ordinal=chunk[0].ordinal,
            tokens=tokens,
            summary_id=summary_id,
            kind=request.kind,
            depth=request.depth,
            descendant_count=count,
            earliest=earliest,
            latest=latest,
        )

    async def _sweep(
        self,
        conversation_id: int,
        budget: int,
        *,
        force: bool,
        allow_model: bool,
        custom_instructions: str | None = None,
    ) -> SweepReport:
        s = self.settings
        pool = self._require_pool()
        threshold = int(budget * s.threshold)
        target = int(budget * s.compaction_target)
        tail_cap = int(budget * s.fresh_tail_max_fraction)
        condense_trigger = max(s.condensed_target_tokens, min(s.leaf_chunk_tokens, threshold // 2))
        deadline = time.monotonic() + s.sweep_deadline_s
        conv, items = await self._db(_store.planning_items, pool, conversation_id)
        before = current = conv.context_tokens
        if not force and before <= threshold:
            return SweepReport(before, before, 0, 0, 0, 0, False, "below threshold")
        passes = leaf = condensed = conflicts = 0
        exhausted = False
        reason: str | None = None

        def fanout(depth: int) -> int:
            return s.leaf_fanout if depth == 0 else s.condensed_fanout

        while True:
            if passes + conflicts >= s.max_passes:
                reason = "pass limit reached"
                break
            if time.monotonic() >= deadline:
                reason = "deadline reached"
                break
            end = tail_start(items, budget, s.fresh_tail_count, tail_cap)
            chunk: list[Item] | None = None
            kind = "leaf"
            if force or current > target:
                chunks = leaf_chunks(items, end, s.leaf_chunk_tokens, s.min_leaf_chunk_tokens)
                chunk = chunks[0] if chunks else None
            if chunk is None:
                kind = "condensed"
                layer = sum(i.tokens for i in items[:end] if i.is_summary)
                if current > target or layer > condense_trigger:
                    chunk = condensed_chunk(
                        items, end, fanout=fanout, max_depth=s.max_depth, chunk_tokens=s.leaf_chunk_tokens
                    )
                    if chunk is None and current > target:
                        chunk = condensed_chunk(
                            items, end, fanout=lambda _d: 2, max_depth=s.max_depth,
                            chunk_tokens=s.leaf_chunk_tokens,
                        )
            if chunk is None:
                exhausted = current > target
                if exhausted:
                    reason = "exhausted: nothing left to compact outside the fresh tail"
                break
            position = items.index(chunk[0])
            summarizer = self._usable_summarizer(allow_model)
            outcome = await self._pass(conv, items, position, chunk, kind, summarizer, custom_instructions)
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
            current -= sum(i.tokens for i in chunk) - outcome.tokens
            passes += 1
            if kind == "leaf":
                leaf += 1
            else:
                condensed += 1
        after = await self._db(_store.context_tokens, pool, conversation_id)
        return SweepReport(before, after, passes, leaf, condensed, conflicts, exhausted, reason)

    async def compact(self, params: CompactParams) -> CompactResult:
        key = params.session_key or params.session_id
        budget = self._budget(params.token_budget, params.runtime_context)
        if params.session_file:
            try:
                async with self._lock("ingest", key):
                    await self._catch_up_file(key, params.session_file)
            except SessionError as error:
                # Compact what the store holds; the transcript is caught up next time.
                _log.warning(
                    "sqlite context engine could not read the transcript before compacting",
                    session_key=mask_session_key(key),
                    error=format_error(error),
                )
        conv = await self._conversation(key)
        started = time.monotonic()
        async with self._lock("compact", key):
            report = await self._sweep(
                conv.id,
                budget,
                force=params.force,
                allow_model=True,
                custom_instructions=params.custom_instructions,
            )
        _log.info(
            "sqlite context engine compaction",
            session_key=mask_session_key(key),
            passes=report.passes,
            tokens_before=report.tokens_before,
            tokens_after=report.tokens_after,
            exhausted=report.exhausted,
            duration_ms=round((time.monotonic() - started) * 1000, 1),
        )
        if report.tokens_after <= self.settings.threshold * budget or report.exhausted:
            await self._db(
                _store.settle_debt, self._require_pool(), conv.id, resolved=True, error=None,
                backoff_s=0.0,
            )
        return CompactResult(
            ok=True,
            compacted=report.compacted,
            reason=report.reason,
            result=CompactDetails(
                tokens_before=report.tokens_before,
                tokens_after=report.tokens_after,
                details={
                    "engine": ENGINE_ID,
                    "passes": report.passes,
                    "leafPasses": report.leaf_passes,
                    "condensedPasses": report.condensed_passes,
                    "conflicts": report.conflicts,
                    "exhausted": report.exhausted,
                    "tokenBudget": budget,
                },
            ),
        )

    # -- maintenance, retention, diagnostics ---------------------------------------------

    async def maintain(self, params: MaintainParams) -> MaintenanceResult:
        key = params.session_key or params.session_id
        runtime = params.runtime_context or {}
        background = runtime.get("allowDeferredCompactionExecution") is True
        conv = await self._conversation(key, create=False)
        reason: str | None = None
        if conv is not None:
            budget = _positive_int(runtime.get("tokenBudget"))
            if budget is not None:
                await self._note_pressure(conv.id, budget)
            reason = await self._drain(key, conv.id, budget, background)
        freed = 0
        if background and self.settings.max_db_bytes is not None:
            report = await self.prune(max_bytes=self.settings.max_db_bytes)
            freed = report.bytes_freed
        return MaintenanceResult(changed=False, bytes_freed=freed, rewritten_entries=0, reason=reason)

    async def _drain(
        self, key: str, conversation_id: int, budget: int | None, background: bool
    ) -> str | None:
        pool = self._require_pool()
        debt = await self._db(_store.debt, pool, conversation_id)
        if debt is None or not debt.pending:
            return None
        if self._summarizer.uses_model and not background:
            return "compaction deferred to background maintenance"
        if time.time() < debt.next_attempt_after:
            return "compaction backing off"
        budget = debt.budget or budget or self.settings.default_token_budget
        try:
            async with self._lock("compact", key):
                report = await self._sweep(conversation_id, budget, force=False, allow_model=background)
        except Exception as error:
            await self._db(
                _store.settle_debt, pool, conversation_id, resolved=False,
                error=format_error(error), backoff_s=self.settings.debt_backoff_s,
            )
            raise
        resolved = report.tokens_after <= self.settings.threshold * budget or report.exhausted
        await self._db(
            _store.settle_debt, pool, conversation_id, resolved=resolved, error=report.reason,
            backoff_s=self.settings.debt_backoff_s,
        )
        return f"compacted {report.tokens_before} -> {report.tokens_after} tokens"

    async def archive(self, session_key: str) -> bool:
        """Archive the active conversation of ``session_key`` (a reset): the next call for
        that key starts a new conversation; the archived one is kept until pruned."""
        async with self._lock("ingest", session_key):
            archived = await self._db(_doctor.archive, self._require_pool(), session_key)
        self._paths.pop(session_key, None)
        return archived

    async def prune(self, *, max_bytes: int | None = None, archived_before: float | None = None) -> _doctor.RetentionReport:
        """Delete archived conversations: all archived before ``archived_before`` (epoch
        seconds), then oldest first while the file exceeds ``max_bytes``. Active
        conversations are never deleted."""
        return await self._db(_doctor.prune, self._require_pool(), max_bytes, archived_before)

    async def doctor(self, *, repair: bool = True) -> _doctor.DoctorReport:
        """Check (and by default repair) the store: the DAG, the projection, the counters."""
        return await self._db(_doctor.doctor, self._require_pool(), repair)

    async def dispose(self) -> None:
        """Release pooled connections and cached path identities; the engine stays usable."""
        self._paths.clear()
        if self._pool is not None:
            await anyio.to_thread.run_sync(self._pool.release)

    def close(self) -> None:
        """Close the store for good (synchronous; for hosts that own the engine's lifetime)."""
        if self._pool is not None:
            self._pool.close()
