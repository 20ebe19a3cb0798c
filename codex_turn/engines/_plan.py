"""Pure decisions over context items: what to assemble, what to compact, how to render.

Theory
------
Nothing here touches the database or a clock: every function takes items (the rows of
``context_items`` joined with their message or summary) and returns a decision, so the same
state gives the same bytes and the rules are tested without SQLite.

*Assembly* walks the items **newest first** (the store streams them from one joined query
in descending ordinal order, so only what is kept, plus one item, is ever read):

1. the *fresh tail*: the newest raw messages, up to ``tail_count`` of them and
   ``tail_cap`` tokens, extended back to the newest user message (an assistant or tool
   suffix is never separated from its instruction) and to the calls whose results it holds;
2. a hard cap: the tail alone never exceeds the budget (its oldest items go first);
3. the older context, newest first, while it fits; the first item that does not fit ends
   the walk, so what is kept is one contiguous suffix of the context;
4. order is restored, and tool pairs are repaired *without fabricating anything*: a result
   whose call is not in the assembly is dropped, and a call whose result is not in it is
   removed from its message (a message left empty is dropped). The rule is the same for
   every position, so appending a turn never changes how an older message renders.

*Summaries* render from stored fields only, through one fixed template; the *epoch* is a
hash over the conversation's uid and the ``(ordinal, summary id)`` pairs of its summary
items: it changes exactly when the summary layer changes. The uid is itself a function of
the session key and its generation (:func:`conversation_uid`; a reset starts the next one),
so the same state gives the same epoch in any store, which is what a prompt cache wants,
while a reset, and every compaction, still gives a new one.

*Compaction* plans over the items **oldest first**, outside the fresh tail (computed by the
same function as assembly's): leaf chunks are the oldest runs of raw messages, cut at
``chunk_tokens`` but never between a call and its result; a condensed chunk is the oldest
run of at least ``fanout`` consecutive summaries of one depth (the shallowest depth first).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, NamedTuple

from codex_turn.engines._messages import (
    TokenEstimator,
    message_tokens,
    tool_call_ids,
    tool_result_ids,
)
from codex_turn.engines.summarizers import format_timestamp

__all__ = [
    "Item",
    "Selection",
    "compute_epoch",
    "condensed_chunk",
    "conversation_uid",
    "join_ids",
    "leaf_chunks",
    "repair_pairs",
    "select",
    "split_ids",
    "summary_id_for",
    "summary_message",
    "summary_text",
    "tail_start",
]

_ID_SEPARATOR: Final = "\x1f"
_SUMMARY_TEMPLATE: Final = (
    '<summary id="{id}" kind="{kind}" depth="{depth}" messages="{count}"'
    ' earliest="{earliest}" latest="{latest}">\n{content}\n</summary>'
)


class Item(NamedTuple):
    """One context item. Message fields are empty for a summary and vice versa."""

    ordinal: int
    tokens: int
    message_id: int | None = None
    role: str | None = None
    calls: tuple[str, ...] = ()
    results: tuple[str, ...] = ()
    content: bytes | str | None = None
    source_id: str | None = None
    ts: int | None = None
    summary_id: str | None = None
    kind: str | None = None
    depth: int = 0
    descendant_count: int = 0
    earliest: int | None = None
    latest: int | None = None

    @property
    def is_summary(self) -> bool:
        return self.summary_id is not None


def join_ids(ids: Sequence[str]) -> str | None:
    return _ID_SEPARATOR.join(ids) if ids else None


def split_ids(text: str | None) -> tuple[str, ...]:
    return tuple(text.split(_ID_SEPARATOR)) if text else ()


# --- rendering and identities -----------------------------------------------------------


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def summary_text(
    summary_id: str,
    kind: str,
    depth: int,
    count: int,
    earliest: int | None,
    latest: int | None,
    content: str,
) -> str:
    return _SUMMARY_TEMPLATE.format(
        id=summary_id,
        kind=kind,
        depth=depth,
        count=count,
        earliest=format_timestamp(earliest),
        latest=format_timestamp(latest),
        content=_escape(content.strip()),
    )


def summary_message(item: Item) -> dict[str, Any]:
    """A summary item as the user-role message the model reads (stored fields only)."""
    assert item.summary_id is not None
    assert item.kind is not None
    content = item.content if isinstance(item.content, str) else ""
    text = summary_text(
        item.summary_id,
        item.kind,
        item.depth,
        item.descendant_count,
        item.earliest,
        item.latest,
        content,
    )
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def summary_tokens(text: str, estimator: TokenEstimator) -> int:
    return message_tokens({"role": "user", "content": [{"type": "text", "text": text}]}, estimator)


def conversation_uid(session_key: str, generation: int) -> str:
    """The uid of the ``generation``-th conversation of ``session_key`` (deterministic)."""
    hasher = hashlib.sha256(
        f"conversation\0{generation}\0{session_key}".encode("utf-8", "surrogatepass")
    )
    return hasher.hexdigest()[:32]


def compute_epoch(uid: str, summaries: Iterable[tuple[int, str]]) -> str:
    """The projection epoch: a hash of the conversation and its summary layer."""
    hasher = hashlib.sha256(f"epoch\0{uid}".encode())
    for ordinal, summary_id in summaries:
        hasher.update(f"\0{ordinal}:{summary_id}".encode())
    return "lc-" + hasher.hexdigest()[:24]


def summary_id_for(uid: str, kind: str, depth: int, source_keys: Iterable[str]) -> str:
    """Deterministic: the same sources always make the same id."""
    hasher = hashlib.sha256(f"summary\0{uid}\0{kind}\0{depth}".encode())
    for key in source_keys:
        hasher.update(b"\0" + key.encode())
    return "sum_" + hasher.hexdigest()[:20]


# --- assembly ---------------------------------------------------------------------------


class _Peek:
    __slots__ = ("_buffer", "_source")

    def __init__(self, source: Iterator[Item]) -> None:
        self._source = source
        self._buffer: list[Item] = []

    def next(self) -> Item | None:
        if self._buffer:
            return self._buffer.pop()
        return next(self._source, None)

    def push(self, item: Item) -> None:
        self._buffer.append(item)


def _fresh_tail(source: _Peek, count: int, cap: int, budget: int) -> list[Item]:
    """The fresh tail, newest first (see the module docstring, step 1)."""
    tail: list[Item] = []
    tokens = 0
    have_user = False
    while (item := source.next()) is not None:
        if item.is_summary:
            source.push(item)
            break
        full = len(tail) >= count or tokens + item.tokens > cap
        if full and (have_user or tokens + item.tokens > budget):
            source.push(item)
            break
        tail.append(item)
        tokens += item.tokens
        have_user = have_user or item.role == "user"
    calls: set[str] = set()
    needed: set[str] = set()
    for item in tail:
        calls.update(item.calls)
        needed.update(item.results)
    needed -= calls
    extra = 0
    while needed and extra < max(count, 8):
        item = source.next()
        if item is None:
            break
        if item.is_summary:
            source.push(item)
            break
        tail.append(item)
        extra += 1
        needed.difference_update(item.calls)
    return tail


class Selection(NamedTuple):
    items: list[Item]  # oldest first
    tail_len: int
    #: Older context (or part of the tail) was left out to fit the budget.
    truncated: bool


def select(
    items_newest_first: Iterator[Item], budget: int, tail_count: int, tail_cap: int
) -> Selection:
    source = _Peek(items_newest_first)
    tail = _fresh_tail(source, tail_count, tail_cap, budget)
    tokens = sum(item.tokens for item in tail)
    truncated = False
    while tail and tokens > budget:
        tokens -= tail.pop().tokens
        truncated = True
    older: list[Item] = []
    if not truncated:
        remaining = budget - tokens
        while (item := source.next()) is not None:
            if item.tokens > remaining:
                truncated = True
                break
            older.append(item)
            remaining -= item.tokens
    else:
        truncated = True
    chosen = tail + older
    chosen.reverse()
    return Selection(chosen, len(tail), truncated)


def tail_start(items: Sequence[Item], budget: int, tail_count: int, tail_cap: int) -> int:
    """Index (in oldest-first ``items``) where the fresh tail begins."""
    tail = _fresh_tail(_Peek(reversed(items)), tail_count, tail_cap, budget)
    return len(items) - len(tail)


def _block_call_id(part: Mapping[str, Any]) -> str | None:
    ids = tool_call_ids({"role": "assistant", "content": [part]})
    return ids[0] if ids else None


def _block_result_id(part: Mapping[str, Any]) -> str | None:
    ids = tool_result_ids({"role": "user", "content": [part]})
    return ids[0] if ids else None


def repair_pairs(
    items: Sequence[Item],
    decode: Callable[[Item], dict[str, Any]],
    estimator: TokenEstimator,
) -> list[tuple[dict[str, Any], int]]:
    """Messages and their tokens for ``items`` (oldest first), tool pairs repaired."""
    calls: set[str] = set()
    results: set[str] = set()
    for item in items:
        calls.update(item.calls)
        results.update(item.results)
    out: list[tuple[dict[str, Any], int]] = []
    for item in items:
        if item.is_summary:
            out.append((summary_message(item), item.tokens))
            continue
        message = decode(item)
        orphan_results = [r for r in item.results if r not in calls]
        orphan_calls = [c for c in item.calls if c not in results]
        if not orphan_results and not orphan_calls:
            out.append((message, item.tokens))
            continue
        if orphan_results and message.get("role") == "toolResult":
            continue  # its call is not in this assembly: the pair goes together
        content = message.get("content")
        if isinstance(content, list):
            kept = []
            for part in content:
                if isinstance(part, Mapping):
                    call = _block_call_id(part)
                    result = _block_result_id(part)
                    if (call is not None and call not in results) or (
                        result is not None and result not in calls
                    ):
                        continue
                kept.append(part)
            if not kept:
                continue
            message = {**message, "content": kept}
        out.append((message, message_tokens(message, estimator)))
    return out


# --- compaction planning ----------------------------------------------------------------


def leaf_chunks(
    items: Sequence[Item], end: int, chunk_tokens: int, min_tokens: int
) -> Iterator[tuple[int, list[Item]]]:
    """``(index, chunk)`` for the chunks of raw messages in ``items[:end]``, oldest first
    (module docstring); chunks under ``min_tokens`` are not worth a summary and skipped."""
    index = 0
    while index < end:
        if items[index].is_summary:
            index += 1
            continue
        run_end = index
        while run_end < end and not items[run_end].is_summary:
            run_end += 1
        while index < run_end:
            start = index
            chunk: list[Item] = []
            tokens = 0
            pending: set[str] = set()
            while index < run_end:
                item = items[index]
                if chunk and not pending and tokens + item.tokens > chunk_tokens:
                    break
                chunk.append(item)
                tokens += item.tokens
                pending.difference_update(item.results)
                pending.update(c for c in item.calls if c not in item.results)
                index += 1
                if pending and tokens > 4 * chunk_tokens:
                    pending.clear()  # a call never answered must not swallow the run
            if tokens >= min_tokens:
                yield start, chunk


def condensed_chunk(
    items: Sequence[Item],
    end: int,
    *,
    fanout: Callable[[int], int],
    max_depth: int,
    chunk_tokens: int,
) -> tuple[int, list[Item]] | None:
    """``(index, chunk)``: the oldest run of >= ``fanout(depth)`` consecutive summaries of
    the shallowest depth that has one, in ``items[:end]``; beyond the fan-out, members are
    added while the chunk stays within ``chunk_tokens``."""
    depths = sorted({item.depth for item in items[:end] if item.is_summary})
    for depth in depths:
        if depth >= max_depth:
            break
        need = max(2, fanout(depth))
        run_start = 0
        run: list[Item] = []
        for index in range(end + 1):
            item = items[index] if index < end else None
            if item is not None and item.is_summary and item.depth == depth:
                if not run:
                    run_start = index
                run.append(item)
                continue
            if len(run) >= need:
                chunk: list[Item] = []
                tokens = 0
                for member in run:
                    if len(chunk) >= need and tokens + member.tokens > chunk_tokens:
                        break
                    chunk.append(member)
                    tokens += member.tokens
                return run_start, chunk
            run = []
    return None
