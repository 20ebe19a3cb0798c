"""The recall tools: what the model can ask of the store, so that "lossless" holds for what the
model can reach and not only for what the store keeps.

Theory
------
Compaction replaces old messages by summaries in what the model sees; the messages stay in
the store (``_schema.py``). Four tools, offered through the engine-tools contract
(``tools``/``call_tool``, :mod:`codex_turn.harness.engine.contract`), lead the model back:

``recall_grep``          full-text search (SQLite FTS5) over every message and summary the
                         session ever had, its conversations before a reset included; each
                         hit names the summary that stands for it (or says it is in context).
``recall_describe``      what a summary covers: its span (sequence numbers, times), its
                         sources (messages or child summaries), its size, whether it is live.
``recall_expand``        a summary back into the messages it replaced, each message's stored
                         JSON byte for byte, in order, paged (``cursor``).
``recall_expand_query``  the messages that best match a question (BM25), expanded from the
                         summaries that stand for them, within a token budget.

*Scope is the session key's.* Every query is limited to the conversations of the key the
harness gave (``ToolCallParams.session_key``; the model never names it): the active one and
the archived ones of earlier resets. A reference the model invents to another session's
summary or message is simply not found.

*The index is the store's.* ``messages_fts`` and ``summaries_fts`` are written in the
transactions that write the rows (``_store.py``), so search never lags ingestion or
compaction. The indexes are contentless (the text is not stored twice); a hit's snippet is cut
from the stored row. Searches are newest first (an FTS5 rowid walk that stops at the limit: fast on
any store size); the question of ``recall_expand_query`` is ranked by BM25 instead.

*What retention shed* (the messages an archived conversation's summaries stand for, once the
store is over its size cap) is not searchable any more; its summaries are, and an expansion
lists each shed message as ``pruned`` in its place.

*Bounded output.* Every answer is compact JSON within :data:`PAGE_CHARS` characters of message
text: an expansion continues with the ``cursor`` it returns (a message longer than a page is
sent in parts, ``part: [offset, total]``, whose texts concatenate to the stored JSON). The
harness redacts secrets from what it passes on and cuts anything longer than its own bound.

Synchronous store functions (worker threads) first, then :class:`Recall`, the async face
the engine delegates to. Logs: none here (the harness logs the tool and the error type).
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from codex_turn.engines._messages import search_text
from codex_turn.engines._schema import PRUNED_CONTENT, Pool, decode_content
from codex_turn.harness.engine.contract import (
    EngineTool,
    ToolCallParams,
    ToolCallResult,
    ToolsParams,
    ToolsResult,
)

__all__ = [
    "PAGE_CHARS",
    "RECALL_TOOLS",
    "Expanded",
    "Hit",
    "Recall",
    "describe",
    "expand",
    "expand_query",
    "grep",
]

#: Characters of message text per answer (the harness cuts at 32k: a page stays below).
PAGE_CHARS: Final = 12_000
_MAX_TERMS: Final = 16
_MAX_HITS: Final = 50
_DEFAULT_HITS: Final = 20
_SNIPPET_CHARS: Final = 120
_SUMMARY_HITS: Final = 5
_QUERY_HITS: Final = 50
_DEFAULT_BUDGET: Final = 2_000
_MAX_BUDGET: Final = 6_000
_WORD: Final = re.compile(r"\w+")
_MESSAGE_REF: Final = re.compile(r"m([0-9]{1,18})")
_SUMMARY_REF: Final = re.compile(r"sum_[0-9a-f]{1,64}")
_IN_BATCH: Final = 400

GREP: Final = "recall_grep"
DESCRIBE: Final = "recall_describe"
EXPAND: Final = "recall_expand"
EXPAND_QUERY: Final = "recall_expand_query"

RECALL_TOOLS: Final = (
    EngineTool(
        name=GREP,
        description=(
            "Search everything this session ever said, including what was compacted into "
            "summaries and conversations before a reset. Returns the newest matching "
            "messages (ref, role, a snippet) and summaries; `expand` names what to pass to "
            "recall_expand to read a match in full."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1, "maxLength": 500},
                "any": {
                    "type": "boolean",
                    "description": "match any word (default: all words)",
                },
                "limit": {"type": "integer", "minimum": 1, "maximum": _MAX_HITS},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    ),
    EngineTool(
        name=DESCRIBE,
        description=(
            "Describe a summary (an id like sum_...): the messages it covers (span, times), "
            "its sources, its size, and whether it is in the current context."
        ),
        input_schema={
            "type": "object",
            "properties": {"id": {"type": "string", "minLength": 1, "maxLength": 100}},
            "required": ["id"],
            "additionalProperties": False,
        },
    ),
    EngineTool(
        name=EXPAND,
        description=(
            "Expand a summary (sum_...) back into the original messages it replaced, or show "
            "one message (m<number>), exactly as stored (JSON). Long expansions come in "
            "pages: pass the returned cursor to continue."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "id": {"type": "string", "minLength": 1, "maxLength": 100},
                "cursor": {"type": "string", "maxLength": 40},
            },
            "required": ["id"],
            "additionalProperties": False,
        },
    ),
    EngineTool(
        name=EXPAND_QUERY,
        description=(
            "Answer-oriented recall: finds the stored messages that best match a question "
            "and returns them in full, expanded from their summaries, within a token budget."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "question": {"type": "string", "minLength": 1, "maxLength": 1000},
                "budget_tokens": {"type": "integer", "minimum": 100, "maximum": _MAX_BUDGET},
            },
            "required": ["question"],
            "additionalProperties": False,
        },
    ),
)


class Hit(NamedTuple):
    """One grep match: a message (``ref`` ``m<id>``) or a summary (``ref`` its id)."""

    ref: str
    kind: str  # "message" | "summary"
    current: bool  # in the active conversation (else one archived by a reset)
    seq: int | None
    role: str | None
    at: int | None
    snippet: str
    #: The leaf summary standing for the message (``None``: it is raw in its context).
    covered_by: str | None

    @property
    def expand(self) -> str:
        """What to pass to ``recall_expand`` to read this match in full."""
        return self.covered_by or self.ref


class Expanded(NamedTuple):
    """One stored message: its reference, place, size and exact stored JSON (``None``: shed
    by retention, see ``_doctor.prune``)."""

    ref: str
    seq: int
    role: str
    tokens: int
    raw: str | None


def _expanded(mid: int, seq: int, role: str, tokens: int, content: bytes) -> Expanded:
    raw = None if content == PRUNED_CONTENT else decode_content(content)
    return Expanded(f"m{mid}", seq, role, tokens, raw)


# --- the store side (worker threads) --------------------------------------------------------


def _scope(conn: sqlite3.Connection, session_key: str) -> dict[int, bool]:
    """The conversations of ``session_key``: id -> active."""
    return {
        cid: archived is None
        for cid, archived in conn.execute(
            "SELECT id, archived_at FROM conversations WHERE session_key=?", (session_key,)
        )
    }


def _marks(count: int) -> str:
    return "(" + ",".join("?" * count) + ")"


def fts_query(text: str, *, any_word: bool) -> str | None:
    """``text`` as an FTS5 query: its words, each quoted (so no word is syntax), all of them
    required, or any (``any_word``); ``None`` when it has no word."""
    words = _WORD.findall(text)[:_MAX_TERMS]
    if not words:
        return None
    return (" OR " if any_word else " AND ").join(f'"{word}"' for word in words)


def snippet(text: str, words: Sequence[str], width: int = _SNIPPET_CHARS) -> str:
    """Up to ``width`` characters of ``text`` around the first of ``words`` it holds (any
    case), that word marked ``[...]``; the start of ``text`` when none is found as such."""
    found = None
    for word in words:
        hit = re.search(re.escape(word), text, re.IGNORECASE)
        if hit is not None and (found is None or hit.start() < found.start()):
            found = hit
    if found is None:
        return text[:width] + ("..." if len(text) > width else "")
    start = max(0, found.start() - width // 2)
    end = min(len(text), start + width)
    head = "..." if start else ""
    tail = "..." if end < len(text) else ""
    return (
        f"{head}{text[start : found.start()]}[{found.group(0)}]{text[found.end() : end]}{tail}"
    ).replace("\n", " ")


def _covering(conn: sqlite3.Connection, message_ids: Sequence[int]) -> dict[int, str]:
    out: dict[int, str] = {}
    for start in range(0, len(message_ids), _IN_BATCH):
        batch = message_ids[start : start + _IN_BATCH]
        sql = "SELECT message_id, summary_id FROM summary_sources WHERE message_id IN "
        out.update(conn.execute(sql + _marks(len(batch)), batch).fetchall())
    return out


_GREP_MESSAGES: Final = """
SELECT m.id, m.conversation_id, m.seq, m.role, m.ts, m.content
FROM messages_fts JOIN messages AS m ON m.id = messages_fts.rowid
WHERE messages_fts MATCH ? AND m.conversation_id IN {scope}
ORDER BY {order} LIMIT ?
"""
_GREP_SUMMARIES: Final = """
SELECT s.id, s.conversation_id, s.latest_ts, s.content
FROM summaries_fts JOIN summaries AS s ON s.rowid = summaries_fts.rowid
WHERE summaries_fts MATCH ? AND s.conversation_id IN {scope}
ORDER BY summaries_fts.rowid DESC LIMIT ?
"""


def grep(
    pool: Pool,
    session_key: str,
    query: str,
    *,
    limit: int = _DEFAULT_HITS,
    any_word: bool = False,
    ranked: bool = False,
    summaries: int = _SUMMARY_HITS,
) -> list[Hit]:
    """The messages (newest first, or by BM25 when ``ranked``) and then the summaries of
    ``session_key`` that match ``query``."""
    match = fts_query(query, any_word=any_word)
    if match is None:
        return []
    with pool.connection() as conn, pool.read(conn):
        scope = _scope(conn, session_key)
        if not scope:
            return []
        ids = list(scope)
        order = "messages_fts.rank" if ranked else "messages_fts.rowid DESC"
        sql = _GREP_MESSAGES.format(scope=_marks(len(ids)), order=order)
        rows = conn.execute(sql, (match, *ids, limit)).fetchall()
        covered = _covering(conn, [row[0] for row in rows])
        words = _WORD.findall(query)[:_MAX_TERMS]
        hits = [
            Hit(
                f"m{mid}",
                "message",
                scope[cid],
                seq,
                role,
                ts,
                snippet(search_text(json.loads(decode_content(content))), words),
                covered.get(mid),
            )
            for mid, cid, seq, role, ts, content in rows
        ]
        if summaries:
            sql = _GREP_SUMMARIES.format(scope=_marks(len(ids)))
            hits += [
                Hit(sid, "summary", scope[cid], None, None, ts, snippet(text, words), None)
                for sid, cid, ts, text in conn.execute(sql, (match, *ids, summaries))
            ]
        return hits


_BELOW: Final = """
WITH RECURSIVE below(id) AS (
    SELECT ?
    UNION ALL
    SELECT ss.child_id FROM summary_sources AS ss JOIN below ON ss.summary_id = below.id
    WHERE ss.child_id IS NOT NULL)
SELECT m.id, m.seq, m.role, m.tokens, m.ts, {content}
FROM below JOIN summary_sources AS ss ON ss.summary_id = below.id
JOIN messages AS m ON m.id = ss.message_id
ORDER BY m.seq
"""


def _summary_in_scope(
    conn: sqlite3.Connection, scope: Mapping[int, bool], summary_id: str
) -> tuple[Any, ...] | None:
    row = conn.execute(
        "SELECT conversation_id, kind, depth, tokens, source_tokens, descendant_count, "
        "earliest_ts, latest_ts, summarizer FROM summaries WHERE id=?",
        (summary_id,),
    ).fetchone()
    return tuple(row) if row is not None and row[0] in scope else None


def describe(pool: Pool, session_key: str, summary_id: str) -> dict[str, Any] | None:
    """What the summary ``summary_id`` of ``session_key`` covers (``None``: no such summary)."""
    with pool.connection() as conn, pool.read(conn):
        scope = _scope(conn, session_key)
        row = _summary_in_scope(conn, scope, summary_id)
        if row is None:
            return None
        cid, kind, depth, tokens, source_tokens, count, earliest, latest, summarizer = row
        below = conn.execute(_BELOW.format(content="length(m.content)"), (summary_id,)).fetchall()
        sources = [
            {"message": f"m{mid}", "seq": seq, "role": role}
            if mid is not None
            else {"summary": child, "kind": child_kind, "depth": child_depth}
            for mid, child, seq, role, child_kind, child_depth in conn.execute(
                "SELECT ss.message_id, ss.child_id, m.seq, m.role, s.kind, s.depth "
                "FROM summary_sources AS ss LEFT JOIN messages AS m ON m.id = ss.message_id "
                "LEFT JOIN summaries AS s ON s.id = ss.child_id "
                "WHERE ss.summary_id=? ORDER BY ss.position",
                (summary_id,),
            )
        ]
        parent = conn.execute(
            "SELECT summary_id FROM summary_sources WHERE child_id=?", (summary_id,)
        ).fetchone()
        live = conn.execute(
            "SELECT 1 FROM context_items WHERE conversation_id=? AND summary_id=?",
            (cid, summary_id),
        ).fetchone()
    seqs = [r[1] for r in below]
    return {
        "id": summary_id,
        "kind": kind,
        "depth": depth,
        "conversation": "current" if scope[cid] else "archived",
        "in_context": live is not None,
        "parent": parent[0] if parent is not None else None,
        "span": {
            "messages": count,
            "first_seq": min(seqs) if seqs else None,
            "last_seq": max(seqs) if seqs else None,
            "earliest": earliest,
            "latest": latest,
        },
        "size": {
            "summary_tokens": tokens,
            "source_tokens": source_tokens,
            "message_tokens": sum(r[3] for r in below),
            "stored_bytes": sum(r[5] for r in below),
        },
        # Shed by retention (the size cap): the summary is what remains of them.
        "pruned_messages": sum(1 for r in below if r[5] == len(PRUNED_CONTENT)),
        "summarizer": summarizer,
        "sources": sources,
    }


def expand(pool: Pool, session_key: str, ref: str) -> list[Expanded] | None:
    """The messages behind ``ref`` (a summary id: every message below it, in order; ``m<id>``:
    that message), each as stored; ``None`` when ``session_key`` has no such thing."""
    with pool.connection() as conn, pool.read(conn):
        scope = _scope(conn, session_key)
        message = _MESSAGE_REF.fullmatch(ref)
        if message is not None:
            row = conn.execute(
                "SELECT id, seq, role, tokens, conversation_id, content FROM messages WHERE id=?",
                (int(message.group(1)),),
            ).fetchone()
            if row is None or row[4] not in scope:
                return None
            return [_expanded(row[0], row[1], row[2], row[3], row[5])]
        if _SUMMARY_REF.fullmatch(ref) is None or _summary_in_scope(conn, scope, ref) is None:
            return None
        return [
            _expanded(mid, seq, role, tokens, content)
            for mid, seq, role, tokens, _ts, content in conn.execute(
                _BELOW.format(content="m.content"), (ref,)
            )
        ]


def expand_query(
    pool: Pool, session_key: str, question: str, budget_tokens: int
) -> tuple[list[tuple[str, list[Expanded]]], bool]:
    """The best matches of ``question`` (BM25 over any of its words), each expanded from the
    summary that stands for it (or alone, when it is raw), best first, until the messages'
    tokens reach ``budget_tokens``. Returns the groups and whether the budget cut any."""
    hits = grep(
        pool, session_key, question, limit=_QUERY_HITS, any_word=True, ranked=True, summaries=0
    )
    groups: list[tuple[str, list[Expanded]]] = []
    seen: set[str] = set()
    spent = 0
    cut = False
    for hit in hits:
        target = hit.expand
        if target in seen:
            continue
        seen.add(target)
        messages = expand(pool, session_key, target) or []
        size = sum(m.tokens for m in messages)
        if spent + size > budget_tokens:
            # A summary too big for what is left: only the matching message itself.
            messages = [m for m in messages if m.ref == hit.ref]
            size = sum(m.tokens for m in messages)
            cut = True
            if not messages or spent + size > budget_tokens:
                continue
        groups.append((target, messages))
        spent += size
    return groups, cut


# --- the answers ------------------------------------------------------------------------------


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _message_entries(
    messages: Sequence[Expanded], start: int, offset: int, room: int
) -> tuple[list[dict[str, Any]], str | None]:
    """Entries for ``messages[start:]`` (the first from character ``offset``) within ``room``
    characters of message text; the cursor to continue from, or ``None`` at the end."""
    entries: list[dict[str, Any]] = []
    index = start
    while index < len(messages):
        message = messages[index]
        if message.raw is None:
            entries.append(
                {"ref": message.ref, "seq": message.seq, "role": message.role, "pruned": True}
            )
            index += 1
            continue
        left = len(message.raw) - offset
        if entries and left > room:
            break
        entry: dict[str, Any] = {"ref": message.ref, "seq": message.seq, "role": message.role}
        take = max(room, 1)
        if offset or left > take:
            entry["part"] = [offset, len(message.raw)]
            entry["json"] = message.raw[offset : offset + take]
            entries.append(entry)
            if offset + take < len(message.raw):
                return entries, f"{index}:{offset + take}"
        else:
            entry["json"] = message.raw
            entries.append(entry)
        room -= min(left, take)
        offset = 0
        index += 1
    return entries, (f"{index}:0" if index < len(messages) else None)


def _cursor(text: object) -> tuple[int, int] | None:
    if text is None:
        return 0, 0
    if not isinstance(text, str):
        return None
    found = re.fullmatch(r"([0-9]{1,9}):([0-9]{1,12})", text)
    return (int(found.group(1)), int(found.group(2))) if found else None


class _Refused(Exception):
    """A call the tool answers with a failure (the text is for the model)."""


Runner = Callable[..., Awaitable[Any]]


class Recall:
    """The recall tools of one engine: ``tools``/``call_tool`` of the contract (see the
    module docstring). ``db`` runs store work in a worker thread; ``pool`` is the open pool."""

    def __init__(self, db: Runner, pool: Callable[[], Pool]) -> None:
        self._db = db
        self._pool = pool
        self._handlers: Mapping[str, Callable[[str, Mapping[str, Any]], Awaitable[str]]] = {
            GREP: self._grep,
            DESCRIBE: self._describe,
            EXPAND: self._expand,
            EXPAND_QUERY: self._expand_query,
        }

    @staticmethod
    def offer(params: ToolsParams) -> ToolsResult:
        return ToolsResult(tools=list(RECALL_TOOLS))

    async def call(self, params: ToolCallParams) -> ToolCallResult:
        handler = self._handlers.get(params.name)
        if handler is None:
            return ToolCallResult(text=f"unknown tool: {params.name}", success=False)
        try:
            text = await handler(params.session_key or params.session_id, params.arguments)
        except _Refused as refusal:
            return ToolCallResult(text=str(refusal), success=False)
        return ToolCallResult(text=text)

    async def _grep(self, key: str, args: Mapping[str, Any]) -> str:
        query = str(args["query"])
        limit = int(args.get("limit", _DEFAULT_HITS))
        hits = await self._db(
            grep, self._pool(), key, query, limit=limit, any_word=bool(args.get("any", False))
        )
        return _dumps(
            {
                "query": query,
                "hits": [
                    {
                        "ref": hit.ref,
                        "kind": hit.kind,
                        **({"seq": hit.seq, "role": hit.role} if hit.kind == "message" else {}),
                        "conversation": "current" if hit.current else "archived",
                        "snippet": hit.snippet,
                        "expand": hit.expand,
                    }
                    for hit in hits
                ],
            }
        )

    async def _describe(self, key: str, args: Mapping[str, Any]) -> str:
        summary_id = str(args["id"])
        found = await self._db(describe, self._pool(), key, summary_id)
        if found is None:
            raise _Refused(f"no summary {summary_id} in this session")
        return _dumps(found)

    async def _expand(self, key: str, args: Mapping[str, Any]) -> str:
        ref = str(args["id"])
        cursor = _cursor(args.get("cursor"))
        if cursor is None:
            raise _Refused("cursor must be the one a previous recall_expand returned")
        messages = await self._db(expand, self._pool(), key, ref)
        if messages is None:
            raise _Refused(f"nothing named {ref} in this session")
        entries, following = _message_entries(messages, *cursor, room=PAGE_CHARS)
        return _dumps({"id": ref, "count": len(messages), "messages": entries, "cursor": following})

    async def _expand_query(self, key: str, args: Mapping[str, Any]) -> str:
        question = str(args["question"])
        budget = int(args.get("budget_tokens", _DEFAULT_BUDGET))
        groups, cut = await self._db(expand_query, self._pool(), key, question, budget)
        room = PAGE_CHARS
        shown: list[dict[str, Any]] = []
        for target, messages in groups:
            entries, following = _message_entries(messages, 0, 0, room)
            room -= sum(len(entry.get("json", "")) for entry in entries)
            shown.append({"id": target, "messages": entries, "complete": following is None})
            if following is not None or room <= 0:
                cut = True
                break
        return _dumps({"question": question, "matches": shown, "budget_cut": cut})
