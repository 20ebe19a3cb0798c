"""What the engine needs to know about one message: its identity, its size, its tool links.

Theory
------
*Identity is a function of the conversation, not of who delivered it.* A message's
**source id** is ``<digest>.<n>``: ``digest`` is the first 16 bytes of SHA-256 over the
message's canonical JSON (keys sorted, fixed separators) *without* its ``idempotencyKey``
(the mirror adds that key; a fallback snapshot of the same turn does not have it, and both
must be the same message), and ``n`` counts the earlier messages of the same path with the
same digest. So the third ``"ok"`` of a session is ``<digest("ok")>.2`` whether it arrives
through ``after_turn``, a retried ``after_turn``, or a ``bootstrap`` that reads the
transcript after a restart; a unique index on ``(conversation, source_id)`` then makes a
second copy impossible. Real messages carry a millisecond ``timestamp``, so ``n`` is almost
always 0; it only matters for exact repeats. ``ingest``/``ingest_batch`` deliver messages
without their path; there the stored conversation stands in for it (``_store.deliver``), so
they get the same ids.

:class:`PathIndex` keeps, per session, the digests (and occurrence counts) of the path it saw
last time, and never a message: holding them would keep a whole transcript's parsed graph
alive, which every full garbage collection then traverses with the GIL held. A path changes
by appending, branching or compacting, so an unchanged message at position ``p`` (same digest)
stands for an unchanged prefix up to ``p``: a new path is checked at its first message and at
the last one the index knows, and the point where it left the known path is found by
bisection. A turn thus costs O(new messages) of hashing (plus O(log n) when the path
changed), whether the runner shares message dicts between turns or hands fresh copies. The
store's checkpoint rests on the same rule (``synced_len`` and the id there, below).
:class:`PathScan` is the index's streaming form, for a bootstrap that reads a transcript in
batches: the index's digests stand for the batches they cover once each batch's last covered
message is checked, and a pass that finds the path changed after batches it took on trust
says so, to be started over untrusted.

*Size is an estimate of what the model reads.* :func:`model_text` is the text a model is
shown for a message (text parts, tool-call names and canonical arguments, tool-result text,
pi's summary roles; reasoning is not shown), and :func:`estimate_tokens` the default
character heuristic over it: 4 characters per token, 1 per CJK character, 2 per astral
character (emoji). Deterministic by construction.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from codex_turn._json import canonical_json

__all__ = [
    "PathIndex",
    "PathScan",
    "TokenEstimator",
    "analyze",
    "digest",
    "encode",
    "estimate_tokens",
    "message_text",
    "message_timestamp",
    "message_tokens",
    "model_text",
    "search_text",
    "tool_call_ids",
    "tool_result_ids",
]

#: ``(text) -> tokens``: the engine's pluggable token estimator.
TokenEstimator = Callable[[str], int]

_CJK: Final = re.compile(
    "[\u2e80-\u2fdf\u3000-\u303f\u3040-\u30ff\u3100-\u31ff\u3400-\u4dbf\u4e00-\u9fff"
    "\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]"
)
_ASTRAL: Final = re.compile("[\U00010000-\U0010ffff]")
#: Fixed per-message overhead (role, separators) added to the text estimate.
MESSAGE_OVERHEAD_TOKENS: Final = 4
#: What an image costs in the estimate (it is rendered as a placeholder, but a model that
#: sees it pays far more; the estimate errs on the side of the budget).
IMAGE_TOKENS: Final = 256

_CALL_TYPES: Final = frozenset({"toolCall", "tool_use", "function_call"})
_RESULT_TYPES: Final = frozenset({"toolResult", "tool_result", "function_call_output"})
_RESULT_ID_KEYS: Final = ("toolCallId", "toolUseId", "tool_use_id", "callId", "call_id")
_SUMMARY_ROLES: Final = frozenset({"compactionSummary", "branchSummary"})
_NO_KEY: Final = object()


def estimate_tokens(text: str) -> int:
    """The default estimator: ~4 characters per token, CJK 1, astral (emoji) 2."""
    if text.isascii():
        return (len(text) + 3) // 4
    cjk = len(_CJK.findall(text))
    astral = len(_ASTRAL.findall(text))
    rest = len(text) - cjk - astral
    return (rest + 3) // 4 + cjk + 2 * astral


def encode(message: Mapping[str, Any]) -> tuple[bytes, bytes]:
    """``(digest, stored)`` for one message, with one JSON encoding.

    ``digest`` is 16 bytes of SHA-256 over the canonical JSON of the message without its
    ``idempotencyKey``; ``stored`` is that JSON with the key (when present) appended as the
    last member, so the stored message is the whole message."""
    body: Mapping[str, Any] = message
    key: object = _NO_KEY
    if "idempotencyKey" in message:
        key = message["idempotencyKey"]
        body = {k: v for k, v in message.items() if k != "idempotencyKey"}
    text = canonical_json(body).encode("utf-8", "surrogatepass")
    value = hashlib.sha256(text).digest()[:16]
    if key is _NO_KEY:
        return value, text
    member = b'"idempotencyKey":' + canonical_json(key).encode("utf-8", "surrogatepass")
    return value, text[:-1] + (b"," if len(text) > 2 else b"") + member + b"}"


def digest(message: Mapping[str, Any]) -> bytes:
    """16 bytes of SHA-256 over the canonical message without its ``idempotencyKey``."""
    return encode(message)[0]


def source_id(message_digest: bytes, occurrence: int) -> str:
    return f"{message_digest.hex()}.{occurrence}"


def _text_of(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    return ""


def _block_text(part: Mapping[str, Any]) -> str:
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        return text if isinstance(text, str) else ""
    if kind in _CALL_TYPES:
        name = part.get("name")
        arguments = part["arguments"] if "arguments" in part else part.get("input")
        try:
            # Not canonical: only the characters count, and their classes do not depend on
            # key order.
            shown = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError):
            shown = ""
        return f"tool call {name if isinstance(name, str) else ''} {shown}".rstrip()
    if kind in _RESULT_TYPES:
        return f"tool result {_text_of(part.get('content', part.get('output')))}".rstrip()
    return ""  # thinking, images and unknown blocks carry no text a model is shown


def model_text(message: Mapping[str, Any]) -> str:
    """The text a model is shown for ``message`` (used for token estimates)."""
    content = message.get("content")
    if type(content) is str:
        return content
    if content is None and message.get("role") in _SUMMARY_ROLES:
        summary = message.get("summary")
        return summary if isinstance(summary, str) else ""
    if not isinstance(content, list):
        return content if isinstance(content, str) else ""
    parts: list[str] = []
    for part in content:
        if type(part) is dict or isinstance(part, Mapping):
            if part.get("type") == "text":
                text = part.get("text")
                if type(text) is str:
                    parts.append(text)
                continue
            text = _block_text(part)
            if text:
                parts.append(text)
    return "\n".join(parts)


def search_text(message: Mapping[str, Any]) -> str:
    """What the full-text index holds for ``message``: its :func:`model_text`, as valid
    UTF-8 (a lone surrogate, which a transcript may carry, becomes ``?``)."""
    text = model_text(message)
    return text if text.isascii() else text.encode("utf-8", "replace").decode("utf-8")


def message_text(message: Mapping[str, Any]) -> str:
    """The prose of ``message`` for a summary: text parts and tool names, no reasoning,
    no tool payloads (results keep their text)."""
    role = message.get("role")
    if "content" not in message and role in _SUMMARY_ROLES:
        summary = message.get("summary")
        return summary if isinstance(summary, str) else ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    out: list[str] = []
    for part in content:
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind in _CALL_TYPES:
            name = part.get("name")
            out.append(f"(called tool {name if isinstance(name, str) else '?'})")
        elif kind in _RESULT_TYPES:
            out.append(_text_of(part.get("content", part.get("output"))))
    return "\n".join(text for text in out if text)


def message_tokens(message: Mapping[str, Any], estimator: TokenEstimator) -> int:
    images = 0
    content = message.get("content")
    if isinstance(content, list):
        images = sum(
            1 for part in content if isinstance(part, Mapping) and part.get("type") == "image"
        )
    return (
        max(0, int(estimator(model_text(message))))
        + MESSAGE_OVERHEAD_TOKENS
        + (IMAGE_TOKENS * images)
    )


def tool_call_ids(message: Mapping[str, Any]) -> tuple[str, ...]:
    """Ids of the tool calls an assistant message makes (pi ``toolCall``, ``tool_use``)."""
    if message.get("role") != "assistant":
        return ()
    content = message.get("content")
    if not isinstance(content, list):
        return ()
    ids: list[str] = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") in _CALL_TYPES:
            call_id = part.get("id", part.get("callId", part.get("call_id")))
            if isinstance(call_id, str) and call_id:
                ids.append(call_id)
    return tuple(ids)


def tool_result_ids(message: Mapping[str, Any]) -> tuple[str, ...]:
    """Ids of the calls a message answers (a pi ``toolResult`` message, or result blocks)."""
    ids: list[str] = []
    if message.get("role") == "toolResult":
        call_id = message.get("toolCallId", message.get("toolUseId"))
        if isinstance(call_id, str) and call_id:
            ids.append(call_id)
    content = message.get("content")
    if isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in _RESULT_TYPES:
                call_id = next(
                    (v for k in _RESULT_ID_KEYS if isinstance(v := part.get(k), str) and v), None
                )
                if call_id is not None:
                    ids.append(call_id)
    return tuple(ids)


def analyze(
    message: Mapping[str, Any], estimator: TokenEstimator
) -> tuple[str, int, tuple[str, ...], tuple[str, ...]]:
    """``(role, tokens, call ids, result ids)`` in one pass over the content (the hot path
    of ingestion; the same answers as :func:`message_tokens`, :func:`tool_call_ids` and
    :func:`tool_result_ids`)."""
    role = message.get("role")
    role = role if isinstance(role, str) else "unknown"
    content = message.get("content")
    if type(content) is str:
        return role, max(0, int(estimator(content))) + MESSAGE_OVERHEAD_TOKENS, (), ()
    if not isinstance(content, list):
        return role, message_tokens(message, estimator), (), tool_result_ids(message)
    parts: list[str] = []
    calls: list[str] = []
    results: list[str] = []
    images = 0
    if role == "toolResult":
        call_id = message.get("toolCallId", message.get("toolUseId"))
        if isinstance(call_id, str) and call_id:
            results.append(call_id)
    for part in content:
        if type(part) is not dict and not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if type(text) is str:
                parts.append(text)
            continue
        if kind == "image":
            images += 1
            continue
        text = _block_text(part)
        if text:
            parts.append(text)
        if kind in _CALL_TYPES and role == "assistant":
            call_id = part.get("id", part.get("callId", part.get("call_id")))
            if isinstance(call_id, str) and call_id:
                calls.append(call_id)
        elif kind in _RESULT_TYPES:
            found = next(
                (v for k in _RESULT_ID_KEYS if isinstance(v := part.get(k), str) and v), None
            )
            if found is not None:
                results.append(found)
    tokens = max(0, int(estimator("\n".join(parts)))) + MESSAGE_OVERHEAD_TOKENS
    return role, tokens + IMAGE_TOKENS * images, tuple(calls), tuple(results)


_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


def message_timestamp(message: Mapping[str, Any]) -> int | None:
    """The message's ``timestamp`` in epoch milliseconds (number or ISO string), else None."""
    value = message.get("timestamp")
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return int(value) if math.isfinite(value) else None
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            return None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        delta = parsed - _EPOCH
        return delta.days * 86_400_000 + delta.seconds * 1000 + delta.microseconds // 1000
    return None


class PathIndex:
    """The source ids of one session's path, kept incrementally (see the module docstring).

    Holds digests and counts only, never a message. Thread-safe: its methods (and a
    :class:`PathScan`'s) run in worker threads.
    """

    __slots__ = ("_counts", "_digests", "_fresh", "_lock", "_occurrences")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._digests: list[bytes] = []
        self._occurrences: list[int] = []
        self._counts: dict[bytes, int] = {}
        #: Stored forms of the messages the last refresh hashed (so a sync that inserts
        #: them does not encode them twice); dropped by the next refresh that hashes.
        self._fresh: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._digests)

    def _id(self, position: int) -> str:
        return source_id(self._digests[position], self._occurrences[position])

    def _holds(self, message: Mapping[str, Any], position: int) -> bool:
        return encode(message)[0] == self._digests[position]

    def _truncate(self, keep: int) -> None:
        if keep < len(self._digests):
            del self._digests[keep:], self._occurrences[keep:]
            counts: dict[bytes, int] = {}
            for value in self._digests:
                counts[value] = counts.get(value, 0) + 1
            self._counts = counts

    def _append(self, value: bytes) -> str:
        seen = self._counts.get(value, 0)
        self._counts[value] = seen + 1
        self._digests.append(value)
        self._occurrences.append(seen)
        return source_id(value, seen)

    def _known(self, messages: Sequence[Mapping[str, Any]]) -> int:
        """How many leading ``messages`` are those the index saw: the longest prefix whose
        first and last message have the digests held for their positions (a path changes
        by appending, branching or compacting, so an unchanged message at ``p`` means an
        unchanged prefix up to ``p``), found by bisection: O(log n) hashes, O(1) when only
        appended."""
        size = min(len(self._digests), len(messages))
        if size == 0 or not self._holds(messages[0], 0):
            return 0
        if self._holds(messages[size - 1], size - 1):
            return size
        good, bad = 0, size - 1  # messages[good] agrees, messages[bad] does not
        while bad - good > 1:
            middle = (good + bad) // 2
            if self._holds(messages[middle], middle):
                good = middle
            else:
                bad = middle
        return good + 1

    def _refresh(self, messages: Sequence[Mapping[str, Any]]) -> None:
        keep = self._known(messages)
        self._truncate(keep)
        if keep == len(messages):
            return  # nothing new: the stored forms of the last new messages stay available
        fresh: dict[int, bytes] = {}
        self._fresh = fresh
        for index in range(keep, len(messages)):
            value, fresh[index] = encode(messages[index])
            self._append(value)

    def plan(
        self, messages: Sequence[Mapping[str, Any]], synced_len: int, anchor: str | None
    ) -> tuple[int, list[str]]:
        """``(start, ids)``: where a sync of ``messages`` must start, and the source ids of
        ``messages[start:]``. ``start`` is ``synced_len`` when the path still holds the
        message the store last synced at ``synced_len - 1`` (its id is ``anchor``), else 0
        (the path was rewritten or branched: reconcile all of it)."""
        with self._lock:
            self._refresh(messages)
            start = 0
            known = 0 < synced_len <= len(self._digests)
            if known and anchor is not None and self._id(synced_len - 1) == anchor:
                start = synced_len
            return start, [self._id(i) for i in range(start, len(self._digests))]

    def stored(self, start: int, stop: int) -> list[bytes | None]:
        """The stored forms the last refresh computed for ``[start, stop)`` (``None`` where it
        did not hash the message: it was already known)."""
        with self._lock:
            return [self._fresh.get(i) for i in range(start, stop)]

    def range(self, messages: Sequence[Mapping[str, Any]], start: int) -> list[str]:
        """The source ids of ``messages[start:]`` (``messages`` being the whole path)."""
        with self._lock:
            self._refresh(messages)
            return [self._id(i) for i in range(start, len(self._digests))]

    def scan(self, *, trust: bool = True) -> PathScan:
        """A pass over the whole path in order, batch by batch (see :class:`PathScan`)."""
        return PathScan(self, trust=trust)


class PathScan:
    """One in-order pass over a session's path, batch by batch: the streaming form of
    :meth:`PathIndex.plan` (a bootstrap reading a transcript it never holds whole). No
    message is kept once its batch is fed.

    With ``trust``, the index's digests stand for the messages they cover (they are not
    hashed) as long as the pass agrees with them: the first message, and in each batch the
    last one they cover, are hashed and compared before the batch's ids are handed out, the
    rule :meth:`PathIndex.plan` applies to a whole path. A disagreement in the first batch
    drops them; a later one means earlier batches were taken on trust: :meth:`feed` returns
    ``None`` and the caller starts over with ``trust=False`` (which hashes everything).
    """

    __slots__ = ("_index", "known", "offset", "vouched")

    def __init__(self, index: PathIndex, *, trust: bool = True) -> None:
        self._index = index
        with index._lock:
            if not trust:
                index._truncate(0)
            #: Positions below this take the index's digests (checked as described above).
            self.known = len(index)
        #: Messages fed so far (the position of the next batch's first message).
        self.offset = 0
        #: Positions below this are synced in the store, as far as the index can tell (see
        #: :meth:`vouch`); 0 once the pass disagreed with the index.
        self.vouched = 0

    def vouch(self, synced_len: int, anchor: str | None) -> int:
        """Set and return :attr:`vouched`: ``synced_len`` when the index holds the store's
        checkpoint (``anchor`` at ``synced_len - 1``, :meth:`PathIndex.plan`'s rule), else 0."""
        with self._index._lock:
            known = 0 < synced_len <= self.known
            if known and anchor is not None and self._index._id(synced_len - 1) == anchor:
                self.vouched = synced_len
            else:
                self.vouched = 0
        return self.vouched

    def feed(
        self, batch: Sequence[Mapping[str, Any]]
    ) -> tuple[int, list[str], list[bytes | None]] | None:
        """``(skipped, ids, stored forms)`` for the next ``batch`` of the path: the ids of
        ``batch[skipped:]`` (the messages before are below :attr:`vouched`: no id is made for
        them), a stored form ``None`` where the message was not hashed; or ``None``: start
        over untrusted."""
        index = self._index
        start = self.offset
        with index._lock:
            trusted = max(0, min(start + len(batch), self.known) - start)
            if trusted:
                last = start + trusted - 1
                agrees = index._holds(batch[trusted - 1], last)
                if agrees and start == 0 and last > 0:
                    agrees = index._holds(batch[0], 0)
                if not agrees:
                    if start > 0:
                        return None
                    index._truncate(0)  # nothing was taken on trust yet: just forget it
                    self.known = self.vouched = trusted = 0
            skipped = min(len(batch), max(0, self.vouched - start))
            ids = [index._id(p) for p in range(start + skipped, start + trusted)]
            stored: list[bytes | None] = [None] * len(ids)
            for message in batch[trusted:]:  # (vouched <= known: skipped <= trusted)
                value, text = encode(message)
                ids.append(index._append(value))
                stored.append(text)
        self.offset = start + len(batch)
        return skipped, ids, stored

    def last_id(self) -> str | None:
        """The id of the last message fed (``None`` before the first)."""
        with self._index._lock:
            return self._index._id(self.offset - 1) if self.offset else None

    def finish(self) -> None:
        """The pass reached the end of the path: a path shorter than the index's ends the
        index there (its last message was checked with its batch)."""
        with self._index._lock:
            self._index._truncate(self.offset)
            self.known = min(self.known, self.offset)
