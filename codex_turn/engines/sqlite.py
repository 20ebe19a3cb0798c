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
catch-up, they can only add what is missing. ``ingest``/``ingest_batch`` deliver messages
without their path: they are aligned with the stored conversation (``_store.deliver``), so a
re-delivery adds nothing while a genuinely repeated message gets the id a path would give it.
``after_turn`` also keeps a per-turn ledger keyed by the hash of the new messages'
identities, so a retried turn returns before touching the messages at all. A path sync is
checkpointed (``synced_len`` and the identity at that point): an appended transcript costs
O(new messages), a rewritten one is reconciled whole.
Bootstrap also checkpoints the transcript file (path, device, inode, size, mtime): an
unchanged file is not even read. A changed one is read in small batches
(``iter_session_messages``: from the harness read cache when a turn read it first, else
streamed, never cached nor held whole: a parsed 30 MB transcript is ~134k objects, and every
full garbage collection would traverse them with the GIL held, blocking the event loop); each
batch is identified at its offset (``PathScan``) and dropped once prepared, and the prepared
rows go in ``sync_chunk`` at a time. What the store synced is skipped when the path index
vouches for it, otherwise each batch is reconciled with what the store holds. The file
checkpoint is set after the last batch, so a crash midway means a re-read.

*Nothing blocks the event loop, nothing waits for a model in the foreground.* The
constructor does no I/O: the store is opened (and migrated) on first use, in a worker
thread. All database and file work runs in worker threads (``anyio.to_thread``), in short
transactions (``BEGIN IMMEDIATE``, never across a summariser call or file I/O). Each session
has two locks: an *ingest* lock (bootstrap, ingest, after_turn, assemble's catch-up) and a
*compact* lock (one sweep at a time); a lock is dropped from the table when its last holder
or waiter leaves, so the table holds only the sessions in flight. A sweep's passes read,
summarise outside any transaction, then commit optimistically (nothing is written if the
context changed meanwhile), so turns never wait for a sweep, and several processes can share
one store. ``after_turn`` only records compaction *debt* when stored context crosses
``threshold`` x budget; ``maintain`` drains it, with a model-calling summariser (the engine's
own, or with ``summarizer="auto"`` the model the host lends in the runtime context) only when
the host runs it in the background (``allowDeferredCompactionExecution``).

*Deterministic assembly.* ``assemble`` streams the context newest-first from one joined
query and keeps the fresh tail, then older items while they fit (``_plan.py``); the same
state and budget always give the same bytes, and the ``thread_bootstrap`` epoch changes only
when the summary layer does (or a reset starts a new conversation); it is derived from the
session key, its generation and the summary layer, so it is the same in any store fed alike.

*Recall.* The model can search the whole store of its session and expand any summary back
into the messages it replaced (``tools``/``call_tool``: ``_recall.py``).

*Honest compaction.* ``tokens_before`` is the stored context the sweep started from,
``tokens_after`` that minus what the sweep itself removed (turns ingested meanwhile are not
the sweep's; ``details.storedAfter`` has the measured end); ``compacted`` is ``tokens_after <
tokens_before``; a sweep that cannot reach its target says ``exhausted``.
``info.owns_compaction`` is true unless the store is known to be unusable: a store that
cannot be opened (every call then raises :class:`~codex_turn.engines.StoreError`), or fails
with a database error, hands compaction back to Codex; ``doctor`` tries again.

Logs carry ids, counts and durations only (never message text).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Final

import anyio
import anyio.lowlevel
import anyio.to_thread

from codex_turn._log import format_error, get_logger, mask_session_key
from codex_turn.engines import _commit, _doctor, _host_hooks, _store
from codex_turn.engines._compaction import Compactor
from codex_turn.engines._messages import (
    PathIndex,
    PathScan,
    TokenEstimator,
    analyze,
    encode,
    estimate_tokens,
    message_timestamp,
    search_text,
)
from codex_turn.engines._plan import (
    Item,
    join_ids,
    repair_pairs,
    select,
)
from codex_turn.engines._recall import Recall
from codex_turn.engines._schema import STORE_FILE, StoreAccess
from codex_turn.engines.settings import EngineSettings
from codex_turn.engines.summarizers import (
    ExtractiveSummarizer,
    Summarizer,
)
from codex_turn.frozen import freeze
from codex_turn.harness.engine.contract import (
    AbortSignal,
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
    ToolCallParams,
    ToolCallResult,
    ToolsParams,
    ToolsResult,
    TranscriptSemantics,
)
from codex_turn.harness.engine.durable import CommitTurnParams, CommitTurnResult
from codex_turn.harness.engine.host import (
    ControlCapabilities,
    ControlRequest,
    ControlResult,
    HostLlm,
    SessionEndParams,
    SessionResetParams,
    SessionResetResult,
    SubagentEndedParams,
    SubagentSpawnParams,
    SubagentSpawnPreparation,
    runtime_llm,
)
from codex_turn.harness.runtime_context import strip_runtime_context_messages
from codex_turn.harness.session import SessionError, iter_session_messages

__all__ = ["ENGINE_ID", "SqliteContextEngine"]

ENGINE_ID: Final = "codex-turn.sqlite"
ENGINE_VERSION: Final = "1"
_TRUNCATION_ID: Final = "truncate/1"

_log = get_logger(__name__)

Boot = tuple[str, int, int, int, int]


def _stat(path: str) -> Boot | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


#: Messages per read of a streamed transcript (inserts still go ``sync_chunk`` at a time).
_READ_BATCH: Final = 256


class _PathChanged(Exception):
    """The transcript's path is not the one the index knew: start over untrusted."""


def _next_batch(
    batches: Iterator[list[AgentMessage]], scan: PathScan
) -> tuple[list[AgentMessage], list[str], list[bytes | None]] | None:
    """The next non-empty batch of the path from its first message not vouched for, with
    their ids and stored forms; ``None`` at the end."""
    for batch in batches:
        kept = strip_runtime_context_messages(batch)
        if kept:
            fed = scan.feed(kept)
            if fed is None:
                raise _PathChanged
            skipped, ids, stored = fed
            return kept[skipped:], ids, stored
    return None


def _close(batches: Iterator[list[AgentMessage]]) -> None:
    close = getattr(batches, "close", None)  # a generator; an empty read is a plain iterator
    if close is not None:
        close()


def _aborted(signal: AbortSignal | None) -> Callable[[], bool] | None:
    """The sweep's stop condition for the host's abort signal (``None``: never stops)."""
    if signal is None:
        return None
    return lambda: signal.aborted


def _positive_int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    return int(value)


class SqliteContextEngine:
    """The reference context engine (see the module docstring).

    ``path`` is the SQLite file (created with its parent directories; an existing directory
    gets ``context.sqlite`` inside it). ``summarizer`` defaults to ``settings.summarizer``'s
    choice (the deterministic :class:`~codex_turn.engines.summarizers.ExtractiveSummarizer`,
    or with ``"auto"`` the host's model when a background compaction is lent one);
    ``token_estimator`` to the
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
            target = os.path.join(target, STORE_FILE)
        self.path = target
        self.settings = settings or EngineSettings()
        self._estimate = token_estimator
        self._fallback = ExtractiveSummarizer(token_estimator)
        self._summarizer: Summarizer = summarizer or self._fallback
        #: ``(kind, key) -> [lock, users]``: users hold or wait for the lock (see ``_hold``).
        self._locks: dict[tuple[str, str], list[Any]] = {}
        self._locks_loop: object = None
        self._paths: OrderedDict[str, PathIndex] = OrderedDict()
        self._decoded: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._decoded_lock = threading.Lock()
        # Nothing is opened here (see the module docstring): the first call opens the store.
        self._access = StoreAccess(target, self.settings.busy_timeout_s)
        self._db = self._access.run
        self._require_pool = self._access.require
        self._compactor = Compactor(
            settings=self.settings,
            estimator=token_estimator,
            summarizer=summarizer,
            fallback=self._fallback,
            db=self._access.run,
            pool=self._access.require,
        )
        #: The subagent results folded into each parent session (``_host_hooks``).
        self.subagents = _host_hooks.SubagentLedger(target)
        self._recall = Recall(self._access.run, self._access.require)

    @classmethod
    def next_to(cls, session_file: str | os.PathLike[str], **kwargs: Any) -> SqliteContextEngine:
        """The engine whose store sits next to ``session_file``: ``context.sqlite`` in the
        transcript's directory, shared by every session there (the embedded default)."""
        return cls(cls.store_next_to(session_file), **kwargs)

    @classmethod
    def copy_of(cls, path: str | os.PathLike[str], **kwargs: Any) -> SqliteContextEngine:
        """The engine on a private in-memory copy of the store at ``path``, for previews
        (``codex-turn inspect``): the file is opened read-only and never changed (when no
        process has it open, nothing is created beside it either); what this engine writes
        stays in the copy and is gone at :meth:`close`. A missing store is not created: the
        first call raises :class:`~codex_turn.engines.StoreError`, as for a store that is not
        this engine's. The copy holds the whole store in memory."""
        engine = cls(path, **kwargs)
        engine._access.copy = True  # nothing is opened before the first call
        engine.subagents.in_memory = True
        return engine

    @staticmethod
    def store_next_to(session_file: str | os.PathLike[str]) -> str:
        """Where :meth:`next_to` keeps the store for ``session_file`` (it may not exist yet)."""
        directory = os.path.dirname(os.path.abspath(os.fspath(session_file)))
        return os.path.join(directory, STORE_FILE)

    # -- info and health -----------------------------------------------------------------

    @property
    def info(self) -> ContextEngineInfo:
        return ContextEngineInfo(
            id=ENGINE_ID,
            name="codex-turn SQLite context engine",
            version=ENGINE_VERSION,
            owns_compaction=self.healthy,
            turn_maintenance_mode="background",
            transcript_semantics=TranscriptSemantics.v1(),
            host_requirements=_host_hooks.HOST_REQUIREMENTS,
        )

    @property
    def healthy(self) -> bool:
        """No failure is known: the store opened (or was not needed yet) and no database error
        has been seen since."""
        return self._access.error is None and not self._access.closed

    @property
    def summarizer(self) -> Summarizer:
        return self._summarizer

    @contextlib.asynccontextmanager
    async def _hold(self, kind: str, key: str) -> AsyncIterator[None]:
        """Hold the session's ``kind`` lock. The entry counts its users (holder and waiters),
        registered before the first await, and leaves the table when the last one leaves: so
        nobody can still be about to acquire a lock that was dropped, and a new lock is only
        ever made when no one holds or waits for the old one."""
        # Locks belong to an event loop: an engine reused by a later event loop (a host that
        # runs one loop per command) starts with fresh ones.
        token = anyio.lowlevel.current_token()
        if token != self._locks_loop:
            self._locks_loop, self._locks = token, {}
        table = self._locks
        entry = table.get((kind, key))
        if entry is None:
            entry = table[(kind, key)] = [anyio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0 and table.get((kind, key)) is entry:
                del table[(kind, key)]

    async def _ready(self) -> None:
        """Open the store on first use (in a worker thread); raises StoreError when it
        cannot be opened."""
        await self._access.ready()

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

    async def _conversation(self, key: str) -> _store.Conversation:
        """The session's active conversation, created when it has none."""
        conv = await self._db(_store.conversation, self._require_pool(), key, create=True)
        assert conv is not None
        return conv

    async def _existing(self, key: str) -> _store.Conversation | None:
        return await self._db(_store.conversation, self._require_pool(), key, create=False)

    # -- ingestion -----------------------------------------------------------------------

    def _prepare(
        self,
        source_ids: Sequence[str],
        messages: Sequence[AgentMessage],
        stored: Sequence[bytes | None],
    ) -> list[_store.Prepared]:
        compress = self.settings.compress_over_bytes
        estimator = self._estimate
        out = []
        for source, message, text in zip(source_ids, messages, stored, strict=True):
            role, tokens, calls, results = analyze(message, estimator)
            out.append(
                _store.Prepared(
                    source,
                    role,
                    tokens,
                    message_timestamp(message),
                    join_ids(calls),
                    join_ids(results),
                    _store.encode_content(
                        text if text is not None else encode(message)[1], compress
                    ),
                    search_text(message),
                )
            )
        return out

    def _insert_chunk(
        self,
        conversation_id: int,
        source_ids: Sequence[str],
        messages: Sequence[AgentMessage],
        stored: Sequence[bytes | None],
        synced: tuple[int, str | None] | None,
    ) -> int:
        pool = self._require_pool()
        held = _store.held_ids(pool, conversation_id, source_ids)
        fresh = [
            (s, m, t) for s, m, t in zip(source_ids, messages, stored, strict=True) if s not in held
        ]
        prepared = self._prepare(
            [s for s, _, _ in fresh], [m for _, m, _ in fresh], [t for _, _, t in fresh]
        )
        if not prepared and synced is None:
            return 0
        return _store.insert_messages(pool, conversation_id, prepared, synced=synced)

    async def _sync_path(
        self, key: str, conversation_id: int, messages: Sequence[AgentMessage]
    ) -> int:
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
                index.stored(start + offset, end),
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
        index = self._path_index(key)
        imported, complete = await self._stream_path(conv, session_file, index, trust=True)
        if not complete:  # the path is not the one the index knew: every message hashed
            conv = await self._conversation(key)  # the first pass may have moved its checkpoint
            more, complete = await self._stream_path(conv, session_file, index, trust=False)
            imported += more
            assert complete
        # Only now: a crash before this re-reads the transcript next time.
        await self._db(_store.set_checkpoint, self._require_pool(), conv.id, boot)
        return imported, None

    async def _stream_path(
        self, conv: _store.Conversation, session_file: str, index: PathIndex, *, trust: bool
    ) -> tuple[int, bool]:
        """:meth:`_sync_path` over a transcript read in batches (``iter_session_messages``):
        a cold read never holds the parsed transcript whole, whose size in objects would make
        every full garbage collection (which holds the GIL) block the event loop. Returns
        ``(imported, complete)``; not complete: start over untrusted (:class:`PathScan`)."""
        scan = await anyio.to_thread.run_sync(functools.partial(index.scan, trust=trust))
        synced = (conv.synced_len, conv.synced_anchor)
        # What the store synced is skipped unread when the index vouches for its anchor (as
        # in _sync_path); otherwise every batch is reconciled with what the store holds.
        await anyio.to_thread.run_sync(scan.vouch, *synced)
        imported = 0
        size = min(_READ_BATCH, self.settings.sync_chunk)
        batches = _commit.without_turn_in_flight(
            await anyio.to_thread.run_sync(iter_session_messages, session_file, size)
        )
        try:
            while True:
                try:
                    chunk = await self._db(self._read_chunk, batches, scan, conv)
                except _PathChanged:
                    return imported, False
                if chunk is None:
                    break
                end, last, prepared = chunk
                # A chunk below the stored checkpoint leaves it (lowering it would only make
                # the next sync re-check more); a shorter path gets its own after the loop.
                moved = (end, last) if end >= synced[0] and end > scan.vouched else None
                if prepared or moved:
                    imported += await self._db(
                        _store.insert_messages,
                        self._require_pool(),
                        conv.id,
                        prepared,
                        synced=moved,
                    )
                synced = moved or synced
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_close, batches)
        await anyio.to_thread.run_sync(scan.finish)
        tail = scan.last_id()
        if tail is not None and synced != (scan.offset, tail):
            await self._db(
                _store.insert_messages,
                self._require_pool(),
                conv.id,
                [],
                synced=(scan.offset, tail),
            )
        return imported, True

    def _read_chunk(
        self, batches: Iterator[list[AgentMessage]], scan: PathScan, conv: _store.Conversation
    ) -> tuple[int, str, list[_store.Prepared]] | None:
        """The next ``sync_chunk`` messages of the path (a worker thread): ``(end offset,
        last id, the messages the store lacks, prepared)``, ``None`` at the end. Read in small
        batches, each dropped once prepared: the messages of a batch are alive while it is
        handled, and whatever survives a young collection counts towards the next full one.
        An empty conversation (a first import) is not asked what it holds: the insert checks
        again in its transaction anyway."""
        pool = self._require_pool()
        check = conv.next_seq > 0
        prepared: list[_store.Prepared] = []
        start = scan.offset
        while scan.offset - start < self.settings.sync_chunk:
            fed = _next_batch(batches, scan)
            if fed is None:
                break
            batch, ids, stored = fed
            if ids:
                held = _store.held_ids(pool, conv.id, ids) if check else set()
                fresh = [
                    (s, m, t) for s, m, t in zip(ids, batch, stored, strict=True) if s not in held
                ]
                prepared += self._prepare(
                    [s for s, _, _ in fresh], [m for _, m, _ in fresh], [t for _, _, t in fresh]
                )
            del batch, stored, fed  # nothing of a batch outlives it
        last = scan.last_id()
        if scan.offset == start or last is None:
            return None
        return scan.offset, last, prepared

    async def bootstrap(self, params: BootstrapParams) -> BootstrapResult:
        key = params.session_key or params.session_id
        await self._ready()
        async with self._hold("ingest", key):
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

    def _deliver_sync(self, conversation_id: int, messages: Sequence[AgentMessage]) -> int:
        encoded = [encode(message) for message in messages]
        stamped = [message_timestamp(message) is not None for message in messages]
        prepared = self._prepare(
            [""] * len(messages), messages, [stored for _, stored in encoded]
        )  # source ids are given inside the transaction (_store.deliver)
        digests = [value for value, _ in encoded]
        return _store.deliver(self._require_pool(), conversation_id, digests, stamped, prepared)

    async def _deliver(self, key: str, messages: Sequence[AgentMessage]) -> int:
        await self._ready()
        if not messages:
            return 0
        async with self._hold("ingest", key):
            conv = await self._conversation(key)
            return await self._db(self._deliver_sync, conv.id, list(messages))

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
        await self._ready()
        async with self._hold("ingest", key):
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

    async def commit_turn(self, params: CommitTurnParams) -> CommitTurnResult:
        """Durable turns: the session through this turn, applied once per advancement key in
        one transaction (:mod:`codex_turn.engines._commit`); ``duplicate`` for a key seen."""
        target = params.session_target
        key = target.session_key or target.session_id
        messages = params.messages
        budget = self._budget(params.token_budget, params.runtime_context)
        await self._ready()
        async with self._hold("ingest", key):
            conv = await self._conversation(key)
            index = self._path_index(key)
            start, ids = await self._db(index.plan, messages, conv.synced_len, conv.synced_anchor)
            committed = await self._db(
                self._commit_sync, conv.id, params.advancement_key, messages, index, start, ids
            )
        if committed:
            await self._note_pressure(conv.id, budget)
        return CommitTurnResult(status="committed" if committed else "duplicate")

    def _commit_sync(
        self,
        conversation_id: int,
        advancement_key: str,
        messages: Sequence[AgentMessage],
        index: PathIndex,
        start: int,
        ids: Sequence[str],
    ) -> bool:
        """The commit's worker-thread part: prepare what the store lacks, then the one
        transaction (which checks again what it holds, and the key)."""
        held = _store.held_ids(self._require_pool(), conversation_id, ids)
        fresh = [(i, s) for i, s in enumerate(ids) if s not in held]
        stored = index.stored(start, len(messages))
        prepared = self._prepare(
            [s for _, s in fresh],
            [messages[start + i] for i, _ in fresh],
            [stored[i] for i, _ in fresh],
        )
        synced = (len(messages), ids[-1]) if ids else None
        return _commit.commit_turn(
            self._require_pool(), conversation_id, advancement_key, prepared, synced=synced
        )

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
        """The stored message, read-only, shared with the decode cache: message ids are never
        reused and messages never change, so an id always decodes to the same message."""
        assert isinstance(item.content, bytes)
        assert item.message_id is not None
        cache = self._decoded
        with self._decoded_lock:
            hit = cache.get(item.message_id)
            if hit is not None:
                cache.move_to_end(item.message_id)
                return hit
        decoded: dict[str, Any] = freeze(json.loads(_store.decode_content(item.content)))
        with self._decoded_lock:
            cache[item.message_id] = decoded
            while len(cache) > self.settings.decode_cache_messages:
                cache.popitem(last=False)
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
        await self._ready()
        conv = await self._conversation(key)
        if params.messages and len(params.messages) != conv.synced_len:
            # A safety net for runners without bootstrap (the harness bootstraps first, which
            # checks the transcript itself): a history of the synced length is taken as
            # synced, so assembly never hashes the history.
            async with self._hold("ingest", key):
                await self._sync_path(key, conv.id, params.messages)
        messages, tokens, epoch = await self._db(
            _store.stream_items,
            self._require_pool(),
            conv.id,
            functools.partial(self._assemble_from, budget),
        )
        result = AssembleResult(
            messages=messages,
            estimated_tokens=tokens,
            context_projection=ContextProjection(mode="thread_bootstrap", epoch=epoch),
            # The assembly is the whole context, fitted to the budget by the engine.
            prompt_authority="assembled",
        )
        return await anyio.to_thread.run_sync(
            _host_hooks.with_subagent_results, self.subagents, key, result
        )

    # -- compaction ----------------------------------------------------------------------

    async def compact(self, params: CompactParams) -> CompactResult:
        key = params.session_key or params.session_id
        budget = self._budget(params.token_budget, params.runtime_context)
        await self._ready()
        if params.session_file:
            try:
                async with self._hold("ingest", key):
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
        async with self._hold("compact", key):
            report = await self._compactor.sweep(
                conv.id,
                budget,
                force=params.force,
                allow_model=True,
                llm=runtime_llm(params.runtime_context),
                custom_instructions=params.custom_instructions,
                stop=_aborted(params.abort_signal),
            )
        (_log.info if report.passes else _log.debug)(
            "sqlite context engine compaction",
            session_key=mask_session_key(key),
            passes=report.passes,
            tokens_before=report.tokens_before,
            tokens_after=report.tokens_after,
            stored_after=report.stored_after,
            exhausted=report.exhausted,
            duration_ms=round((time.monotonic() - started) * 1000, 1),
        )
        # Debt is about what is stored now, turns ingested during the sweep included.
        paid = report.stored_after <= self.settings.threshold * budget or report.exhausted
        if paid:
            pool = self._require_pool()
            debt = await self._db(_store.debt, pool, conv.id)
            if debt is not None and debt.pending:
                await self._db(
                    _store.settle_debt, pool, conv.id, resolved=True, error=None, backoff_s=0.0
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
                    "storedAfter": report.stored_after,
                    "tokenBudget": budget,
                },
            ),
        )

    # -- recall tools (``_recall.py``) ---------------------------------------------------

    async def tools(self, params: ToolsParams) -> ToolsResult:
        """The recall tools the model gets (none when ``settings.recall_tools`` is off)."""
        if not self.settings.recall_tools:
            return ToolsResult(tools=[])
        return self._recall.offer(params)

    async def call_tool(self, params: ToolCallParams) -> ToolCallResult:
        await self._ready()
        return await self._recall.call(params)

    # -- maintenance, retention, diagnostics ---------------------------------------------

    async def maintain(self, params: MaintainParams) -> MaintenanceResult:
        key = params.session_key or params.session_id
        runtime = params.runtime_context or {}
        background = runtime.get("allowDeferredCompactionExecution") is True
        await self._ready()
        conv = await self._existing(key)
        reason: str | None = None
        if conv is not None:
            budget = _positive_int(runtime.get("tokenBudget"))
            if budget is not None:
                await self._note_pressure(conv.id, budget)
            reason = await self._drain(key, conv.id, budget, background, runtime_llm(runtime))
        freed = 0
        if background and self.settings.max_db_bytes is not None:
            report = await self.prune(max_bytes=self.settings.max_db_bytes)
            freed = report.bytes_freed
        return MaintenanceResult(
            changed=False, bytes_freed=freed, rewritten_entries=0, reason=reason
        )

    async def _drain(
        self,
        key: str,
        conversation_id: int,
        budget: int | None,
        background: bool,
        llm: HostLlm | None,
    ) -> str | None:
        pool = self._require_pool()
        debt = await self._db(_store.debt, pool, conversation_id)
        if debt is None or not debt.pending:
            return None
        if self._compactor.wants_model(llm) and not background:
            return "compaction deferred to background maintenance"
        if time.time() < debt.next_attempt_after:
            return "compaction backing off"
        budget = debt.budget or budget or self.settings.default_token_budget
        try:
            async with self._hold("compact", key):
                report = await self._compactor.sweep(
                    conversation_id, budget, force=False, allow_model=background, llm=llm
                )
        except Exception as error:
            await self._db(
                _store.settle_debt,
                pool,
                conversation_id,
                resolved=False,
                error=format_error(error),
                backoff_s=self.settings.debt_backoff_s,
            )
            raise
        resolved = report.stored_after <= self.settings.threshold * budget or report.exhausted
        await self._db(
            _store.settle_debt,
            pool,
            conversation_id,
            resolved=resolved,
            error=report.reason,
            backoff_s=self.settings.debt_backoff_s,
        )
        return f"compacted {report.tokens_before} -> {report.tokens_after} tokens"

    async def archive(self, session_key: str) -> bool:
        """Archive the active conversation of ``session_key`` (a reset): the next call for
        that key starts a new conversation; the archived one is kept until pruned."""
        await self._ready()
        async with self._hold("ingest", session_key):
            archived = await self._db(_doctor.archive, self._require_pool(), session_key)
        self._paths.pop(session_key, None)
        return archived

    async def prune(
        self, *, max_bytes: int | None = None, archived_before: float | None = None
    ) -> _doctor.RetentionReport:
        """Retention: delete archived conversations archived before ``archived_before``
        (epoch seconds); then, while the file exceeds ``max_bytes``, oldest first, shed what
        their summaries stand for (the summaries stay searchable), then delete them whole.
        Active conversations are never touched (``_doctor.py``)."""
        await self._ready()
        return await self._db(_doctor.prune, self._require_pool(), max_bytes, archived_before)

    async def doctor(self, *, repair: bool = True) -> _doctor.DoctorReport:
        """Check (and by default repair) the store: the DAG, the projection, the counters.

        A store that passes (or was repaired) is healthy again: the engine owns compaction
        once more after an operator ran this. A store that could not be opened is tried again
        (this is the operator's act); if it still cannot, :class:`StoreError` says why."""
        pool = await anyio.to_thread.run_sync(functools.partial(self._access.open, retry=True))
        report = await self._db(_doctor.doctor, pool, repair)
        if report.problems == report.repaired:
            self._access.error = None
        return report

    # -- reset, end, subagents, control (the hooks live in _host_hooks) --------------------

    async def before_session_reset(self, params: SessionResetParams) -> SessionResetResult:
        """Archive the session's conversation (see ``_host_hooks``)."""
        return await _host_hooks.before_session_reset(self, params)

    async def session_end(self, params: SessionEndParams) -> None:
        await _host_hooks.session_end(self, params)

    async def prepare_subagent_spawn(self, params: SubagentSpawnParams) -> SubagentSpawnPreparation:
        return await _host_hooks.prepare_subagent_spawn(self, params)

    async def on_subagent_ended(self, params: SubagentEndedParams) -> None:
        await _host_hooks.on_subagent_ended(self, params)

    def control_capabilities(self) -> ControlCapabilities:
        return _host_hooks.control_capabilities()

    async def control(self, request: ControlRequest) -> ControlResult:
        return await _host_hooks.control(self, request)

    def forget_session(self, session_key: str) -> None:
        """Drop what this instance caches for ``session_key`` (the store keeps it)."""
        self._paths.pop(session_key, None)

    async def has_session(self, session_key: str) -> bool:
        """Whether the store holds an active conversation for ``session_key``."""
        await self._ready()
        return await self._existing(session_key) is not None

    async def dispose(self) -> None:
        """Release pooled connections and cached path identities; the engine stays usable."""
        self._paths.clear()
        self.subagents.forget_all()
        with self._decoded_lock:
            self._decoded.clear()
        if self._access.pool is not None:
            await anyio.to_thread.run_sync(self._access.pool.release)

    def close(self) -> None:
        """Close the store for good (synchronous; for hosts that own the engine's lifetime).
        Later calls raise :class:`StoreError`; a store never opened is not opened by this."""
        self._access.close()
