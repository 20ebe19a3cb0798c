"""The structured projection: an engine's assembled messages -> Responses input items.

The text frame (:mod:`.frame`) renders the whole assembly into one user message. Codex
0.163.0 can do better: ``thread/inject_items`` appends raw Responses items to a thread's
model-visible history (``shared/reference/codex-inject-items.md``). This module is the pure
half of that: it converts the assembly into the items to inject, deterministically, or says
why it cannot (the caller then falls back to the text frame for that turn).

Mapping
-------

* ``user`` and ``custom`` messages -> ``{"type":"message","role":"user"}``, text parts as
  ``input_text``, images as ``input_image`` (a ``data:`` URL), any other block as the text
  frame's placeholder (``[<kind> content omitted]``).
* ``assistant`` messages -> ``{"type":"message","role":"assistant"}`` with ``output_text``
  parts; thinking blocks are dropped (a reasoning item needs the model's own encrypted blob);
  an image becomes ``[image omitted]``. Each tool-call block (``toolCall`` / ``tool_use``)
  ends the message so far and becomes a ``function_call`` in place.
* ``toolResult`` messages and ``tool_result`` blocks -> ``function_call_output``.
* ``compactionSummary`` / ``branchSummary`` -> a user message, :data:`SUMMARY_HEADER` then the
  summary.
* The trailing user message that repeats the prompt is dropped (the frame's rule 1): the raw
  prompt follows the injected items in ``turn/start``.

Tool payloads follow a :data:`PayloadPolicy`: ``elide`` (arguments :data:`ELIDED_ARGUMENTS`,
output :data:`ELIDED_OUTPUT`), ``shape-only`` (arguments as their ``inputShape``, every leaf
replaced by its type; output elided) or ``full`` (arguments and output kept). Secrets are
redacted in every policy (:func:`~.payload.redacted_payload`, :func:`~.payload.redact_secrets`):
a ``full`` argument value under a secret-looking key is replaced whole.

Pairing is the converter's, not Codex's: Codex would synthesize an ``"aborted"`` output for an
unanswered call and silently drop an orphan output. Here every ``function_call`` is followed
by exactly one ``function_call_output`` with its ``call_id``: a call still unanswered when the
next user or assistant message starts (or at the end) gets :data:`UNANSWERED_OUTPUT` right
there. A result whose call is unknown or already answered, a call without an id, or two calls
sharing an id make the assembly unconvertible (:class:`Unconvertible`, with a typed
:class:`UnconvertibleReason`), as do a non-list assembly, a message that is not a mapping,
a role that cannot be injected (``system`` and ``developer`` would be dropped or gain
authority; unknown roles have no meaning) and a tool payload kept as JSON (``full``) that
holds NaN or an infinity (not JSON: :func:`~codex_turn._json.canonical_json` refuses it).

Ids. Codex adds a random id to an injected item that has none (``msg_<uuidv7>``) and keeps an
id it is given. A thread whose injected history is rebuilt every turn would then send new ids
every turn and lose the prompt cache's prefix, so each item carries its own id: the item's
kind prefix (``msg_``, ``fc_``, ``fco_``) and a digest of its position and canonical content.
Equal assemblies give equal ids; an assembly that only grows keeps every earlier id. Positions
count from ``first_index`` (default 0): a turn's own messages converted alone with
``first_index`` = the assembly's :attr:`ConvertedItems.end` get the ids they will have once
appended to it (when none of them answers a call the assembly left open).

Determinism: nothing reads a clock, a random source or hash order; messages and parts are
read by key, so key order is not part of the input; :attr:`ConvertedItems.canonical` is the
canonical JSON of the items (keys sorted, compact separators, non-ASCII kept), byte-stable for
identical input. It is computed on first use; :attr:`~ConvertedItems.chars` and
:func:`newest_items` add up the per-item lengths the conversion measured
(:attr:`~ConvertedItems.sizes`) instead.

Incremental conversion (:class:`ConversionCache`). The conversion is a left fold over the
kept messages whose state between two messages is the items emitted so far (later messages
and the end only append), the calls still open (in order) and the call ids seen: every
message flushes its own parts and sets its own role. A cache records that state after each
message; the next call reuses the items of the longest prefix of kept messages that are the
previous call's and converts the rest from the state there, which is the conversion from
scratch, ids included. What depends on what follows lies after a boundary, so it is always
converted afresh: the outputs closing the calls still open (emitted when the next user,
assistant or summary message starts, unless that user message answers calls, or at the end).
The trailing prompt is dropped before the comparison, which is on the messages kept. "The
previous call's" means the very same :class:`~codex_turn.frozen.FrozenDict` (deeply
read-only by contract), or a message whose pickle (taken before its conversion: immutable,
never loaded) is the same as then: exact about types where ``==`` is not (``True == 1 ==
1.0`` and ``0.0 == -0.0`` convert differently); a message without one ends the prefix. A new
policy or ``first_index`` starts afresh; a refusal keeps the record up to the refused
message; a cache's items are frozen (they are also the next call's). :func:`check_items`
resumes the same way from a prefix it accepted (only the calls made and open there matter).
``FrozenDict`` comes from :mod:`codex_turn.frozen`, a leaf module shared with the harness
(projection stays pure: it imports nothing of the harness).
"""

from __future__ import annotations

import enum
import hashlib
import json
import operator
import pickle
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

import attrs

from codex_turn._json import canonical_json
from codex_turn.frozen import FrozenDict, FrozenList
from codex_turn.projection.frame import drop_duplicate_prompt, js_trim
from codex_turn.projection.payload import input_shape, redact_secrets, redacted_payload

__all__ = [
    "ELIDED_ARGUMENTS",
    "ELIDED_OUTPUT",
    "SUMMARY_HEADER",
    "UNANSWERED_OUTPUT",
    "ConversionCache",
    "ConvertedItems",
    "PayloadPolicy",
    "Unconvertible",
    "UnconvertibleReason",
    "canonical_json",  # codex_turn._json's, where the structured turn path imports it
    "check_items",
    "convert_messages",
    "image_url",
    "newest_items",
]

PayloadPolicy = Literal["elide", "shape-only", "full"]
PAYLOAD_POLICIES: Final = ("elide", "shape-only", "full")

ELIDED_ARGUMENTS: Final = '{"omitted":"[input omitted]"}'
ELIDED_OUTPUT: Final = "[content omitted]"
UNANSWERED_OUTPUT: Final = "[no tool result recorded]"
SUMMARY_HEADER: Final = "Summary of the earlier conversation:"
_IMAGE: Final = "[image omitted]"
_NON_TEXT: Final = "[non-text content omitted]"

_USER_ROLES: Final = frozenset({"user", "custom"})
_SUMMARY_ROLES: Final = frozenset({"compactionSummary", "branchSummary"})
_CALL_ID_KEYS: Final = ("id", "callId", "toolCallId", "toolUseId")
_RESULT_ID_KEYS: Final = ("toolCallId", "toolUseId", "tool_use_id", "callId")
_RESULT_BLOCKS: Final = frozenset({"tool_result", "toolResult"})
_DROPPED_BLOCKS: Final = frozenset({"thinking", "redacted_thinking", "reasoning"})


class UnconvertibleReason(enum.Enum):
    """Why an assembly cannot be injected as items (the turn then uses the text frame)."""

    NOT_A_LIST = "not_a_list"
    MESSAGE_NOT_A_MAPPING = "message_not_a_mapping"
    ROLE_NOT_INJECTABLE = "role_not_injectable"
    MISSING_CALL_ID = "missing_call_id"
    MISSING_TOOL_NAME = "missing_tool_name"
    DUPLICATE_CALL_ID = "duplicate_call_id"
    ORPHAN_TOOL_RESULT = "orphan_tool_result"
    INVALID_CONTENT = "invalid_content"
    #: A tool payload kept as JSON holds NaN or an infinity, which JSON has no form for.
    NON_JSON_NUMBER = "non_json_number"


@attrs.frozen
class Unconvertible:
    """The typed refusal: what was wrong, and at which assembled message."""

    reason: UnconvertibleReason
    index: int | None
    detail: str

    def __str__(self) -> str:
        where = f" at message {self.index}" if self.index is not None else ""
        return f"{self.reason.value}{where}: {self.detail}"


@attrs.frozen
class ConvertedItems:
    """The items to inject, in order; their canonical JSON and its size on demand.

    ``canonical`` may be given (``ConvertedItems(..., canonical=text)``, ``attrs.evolve``);
    otherwise it is computed on first use, and :attr:`chars` needs no encoding at all: it
    adds up :attr:`sizes`, the canonical length of each item, known from the conversion.
    """

    items: tuple[dict[str, Any], ...]
    #: The assembled messages converted (the duplicate trailing prompt removed).
    message_count: int
    #: Whether the last assembled message repeated the prompt and was dropped.
    dropped_prompt: bool
    #: ``first_index`` plus the number of items of the whole conversion: the position (in
    #: the ids) of an item appended after them. A cut (:func:`newest_items`) keeps it.
    end: int = attrs.field(default=attrs.Factory(lambda self: len(self.items), takes_self=True))
    _given: str | None = attrs.field(default=None, alias="canonical", eq=False, repr=False)
    _sizes: tuple[int, ...] | None = attrs.field(default=None, init=False, eq=False, repr=False)
    _text: str | None = attrs.field(default=None, init=False, eq=False, repr=False)

    @property
    def canonical(self) -> str:
        """Canonical JSON of ``items``: equal assemblies give equal text, byte for byte."""
        if self._given is not None:
            return self._given
        text = self._text
        if text is None:
            text = canonical_json(list(self.items))
            object.__setattr__(self, "_text", text)
        return text

    @property
    def sizes(self) -> tuple[int, ...]:
        """The length of each item's canonical JSON (``canonical`` is ``[``, the items'
        texts joined by ``,``, then ``]``)."""
        sizes = self._sizes
        if sizes is None:
            sizes = tuple(len(canonical_json(item)) for item in self.items)
            object.__setattr__(self, "_sizes", sizes)
        return sizes

    @property
    def chars(self) -> int:
        """``len(self.canonical)``, without encoding anything when it is not known yet."""
        if self._given is not None:
            return len(self._given)
        if self._text is not None:
            return len(self._text)
        return _joined_length(self.sizes)


def _joined_length(sizes: Sequence[int]) -> int:
    return sum(sizes) + len(sizes) + 1 if sizes else 2


def _converted(
    items: tuple[dict[str, Any], ...],
    sizes: tuple[int, ...],
    *,
    message_count: int,
    dropped_prompt: bool,
    end: int,
) -> ConvertedItems:
    converted = ConvertedItems(
        items=items, message_count=message_count, dropped_prompt=dropped_prompt, end=end
    )
    object.__setattr__(converted, "_sizes", sizes)
    return converted


class _Refused(Exception):
    def __init__(self, reason: UnconvertibleReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _payload_json(value: object, what: str) -> str:
    """:func:`canonical_json` of a tool payload already redacted or shaped (every leaf JSON but
    a float NaN or infinity, which an engine's Python may hold): a refusal, not an error."""
    try:
        return canonical_json(value)
    except ValueError:
        raise _Refused(
            UnconvertibleReason.NON_JSON_NUMBER, f"{what} holds NaN or an infinity"
        ) from None


def _str_field(mapping: Mapping[str, Any], keys: Sequence[str]) -> str | None:
    for key in keys:
        value = mapping.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def image_url(part: Mapping[str, Any]) -> str | None:
    """The URL of an image block (a ``data:`` URL of its bytes, or its own URL), else ``None``."""
    data, mime = part.get("data"), part.get("mimeType", part.get("mime_type"))
    if isinstance(data, str) and data and isinstance(mime, str) and mime.startswith("image/"):
        return f"data:{mime};base64,{data}"
    url = part.get("image_url", part.get("url"))
    if isinstance(url, str) and url.startswith(("data:image/", "https://")):
        return url
    return None


def _placeholder(kind: object) -> str:
    return f"[{kind} content omitted]" if isinstance(kind, str) and kind else _NON_TEXT


def _arguments(raw: object, policy: PayloadPolicy) -> str:
    if policy == "elide":
        return ELIDED_ARGUMENTS
    value = raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, or nested past what json parses
            value = raw
    if policy == "shape-only":
        return canonical_json(input_shape(value if value is not None else {}))
    return _payload_json(redacted_payload(value if value is not None else {}), "tool arguments")


def _output_text(content: object, policy: PayloadPolicy) -> str:
    if policy != "full":
        return ELIDED_OUTPUT
    if isinstance(content, str):
        return redact_secrets(content)
    if content is None:
        return ""
    if not isinstance(content, list | tuple):
        return _payload_json(redacted_payload(content), "a tool result")
    texts: list[str] = []
    for part in content:
        if isinstance(part, Mapping):
            kind = part.get("type")
            text = part.get("text")
            if kind == "text" and isinstance(text, str):
                texts.append(redact_secrets(text))
            elif kind == "image":
                texts.append(_IMAGE)
            else:
                texts.append(_payload_json(redacted_payload(part), "a tool result part"))
        elif isinstance(part, str):
            texts.append(redact_secrets(part))
    return "\n".join(texts)


class _Builder:
    """Accumulates items; tracks call pairing."""

    def __init__(self, policy: PayloadPolicy) -> None:
        self.policy = policy
        self.items: list[dict[str, Any]] = []
        self.parts: list[dict[str, Any]] = []
        self.role: str | None = None
        self.open_calls: list[str] = []  # answered later, in this order
        self.seen_calls: set[str] = set()
        self.calls: list[str] = []  # seen_calls in the order they were made

    def flush(self) -> None:
        if self.parts and self.role is not None:
            self.items.append({"type": "message", "role": self.role, "content": self.parts})
        self.parts = []

    def start(self, role: str, *, close: bool = True) -> None:
        """A new user/assistant message: close the previous one and (unless it answers
        calls itself) the calls still unanswered."""
        self.flush()
        if close:
            self.close_calls()
        self.role = role

    def close_calls(self) -> None:
        for call_id in self.open_calls:
            self.items.append(
                {"type": "function_call_output", "call_id": call_id, "output": UNANSWERED_OUTPUT}
            )
        self.open_calls = []

    def text(self, text: str) -> None:
        if text:
            kind = "output_text" if self.role == "assistant" else "input_text"
            self.parts.append({"type": kind, "text": text})

    def call(self, part: Mapping[str, Any]) -> None:
        call_id = _str_field(part, _CALL_ID_KEYS)
        if call_id is None:
            raise _Refused(UnconvertibleReason.MISSING_CALL_ID, "tool call without an id")
        name = part.get("name")
        if not isinstance(name, str) or not name:
            raise _Refused(UnconvertibleReason.MISSING_TOOL_NAME, f"tool call {call_id!r}")
        if call_id in self.seen_calls:
            raise _Refused(UnconvertibleReason.DUPLICATE_CALL_ID, f"call id {call_id!r}")
        self.flush()
        self.seen_calls.add(call_id)
        self.calls.append(call_id)
        self.open_calls.append(call_id)
        raw = part["arguments"] if "arguments" in part else part.get("input")
        self.items.append(
            {
                "type": "function_call",
                "call_id": call_id,
                "name": name,
                "arguments": _arguments(raw, self.policy),
            }
        )

    def result(self, call_id: str | None, content: object, is_error: bool) -> None:
        if call_id is None or call_id not in self.open_calls:
            raise _Refused(
                UnconvertibleReason.ORPHAN_TOOL_RESULT,
                f"tool result for {call_id!r} has no open call",
            )
        self.flush()
        self.open_calls.remove(call_id)
        output = _output_text(content, self.policy)
        if is_error and self.policy == "full":
            output = f"[tool error]\n{output}"
        self.items.append({"type": "function_call_output", "call_id": call_id, "output": output})


def _content_parts(message: Mapping[str, Any]) -> list[object]:
    content = message.get("content")
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list | tuple):
        return list(content)
    raise _Refused(UnconvertibleReason.INVALID_CONTENT, f"content is {type(content).__name__}")


def _user_message(builder: _Builder, message: Mapping[str, Any]) -> None:
    parts = _content_parts(message)
    answers = any(isinstance(p, Mapping) and p.get("type") in _RESULT_BLOCKS for p in parts)
    builder.start("user", close=not answers)
    for part in parts:
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            builder.text(text if isinstance(text, str) else "")
        elif kind == "image":
            url = image_url(part)
            if url is None:
                builder.text(_IMAGE)
            else:
                builder.parts.append({"type": "input_image", "image_url": url})
        elif kind in _RESULT_BLOCKS:
            # Anthropic-style: the result rides in the user message; it answers a call.
            is_error = part.get("is_error", part.get("isError")) is True
            builder.result(_str_field(part, _RESULT_ID_KEYS), part.get("content"), is_error)
            builder.role = "user"
        elif kind not in _DROPPED_BLOCKS:
            builder.text(_placeholder(kind))
    builder.flush()


def _assistant_message(builder: _Builder, message: Mapping[str, Any]) -> None:
    builder.start("assistant")
    for part in _content_parts(message):
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            builder.text(text if isinstance(text, str) else "")
        elif kind in ("toolCall", "tool_use", "function_call"):
            builder.call(part)
        elif kind == "image":
            builder.text(_IMAGE)
        elif kind not in _DROPPED_BLOCKS:
            builder.text(_placeholder(kind))
    builder.flush()


def _convert_one(builder: _Builder, message: Mapping[str, Any]) -> None:
    role = message.get("role")
    if role in _USER_ROLES:
        _user_message(builder, message)
    elif role == "assistant":
        _assistant_message(builder, message)
    elif role == "toolResult":
        call_id = _str_field(message, _RESULT_ID_KEYS)
        builder.result(call_id, message.get("content"), message.get("isError") is True)
    elif role in _SUMMARY_ROLES:
        summary = message.get("summary")
        if not isinstance(summary, str):
            summary = "\n".join(
                t
                for p in _content_parts(message)
                if isinstance(p, Mapping) and isinstance(t := p.get("text"), str)
            )
        builder.start("user")
        if js_trim(summary):
            builder.text(f"{SUMMARY_HEADER}\n{summary}")
        builder.flush()
    else:
        raise _Refused(UnconvertibleReason.ROLE_NOT_INJECTABLE, f"role {role!r}")


_DICTS: Final[frozenset[type]] = frozenset((dict, FrozenDict))
_ID_PREFIX: Final = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}


def _with_ids(
    items: Sequence[dict[str, Any]], first_index: int, *, frozen: bool = False
) -> tuple[tuple[dict[str, Any], ...], tuple[int, ...]]:
    """``items`` with their ids (positions from ``first_index``), and each one's canonical
    length: the text without the id, plus ``,"id":"<id>"`` (``len(id) + 8``)."""
    out: list[dict[str, Any]] = []
    sizes: list[int] = []
    for index, item in enumerate(items, first_index):
        text = canonical_json(item)
        digest = hashlib.sha256(f"{index}\x00{text}".encode("utf-8", "surrogatepass"))
        item_id = _ID_PREFIX[item["type"]] + digest.hexdigest()[:40]
        with_id = {**item, "id": item_id}
        out.append(_frozen_item(with_id) if frozen else with_id)
        sizes.append(len(text) + len(item_id) + 8)
    return tuple(out), tuple(sizes)


def _frozen_item(item: dict[str, Any]) -> dict[str, Any]:
    """``freeze(item)``, knowing the shape: flat but for a message's list of flat parts."""
    content = item.get("content")
    if content is not None:
        item = {**item, "content": FrozenList([FrozenDict(part) for part in content])}
    return FrozenDict(item)


def convert_messages(
    messages: Sequence[Mapping[str, Any]],
    *,
    prompt: str = "",
    payload_policy: PayloadPolicy = "elide",
    first_index: int = 0,
    cache: ConversionCache | None = None,
    prompt_key: str | None = None,
) -> ConvertedItems | Unconvertible:
    """The Responses items for ``messages`` (see the module docstring), or why there are none.

    ``prompt`` is the raw prompt of the turn: a last user message that is it is dropped (by
    its key ``prompt_key`` when it has one, else by its text: rule 1 of the frame).
    Ids are numbered from ``first_index``: messages converted on their own, with
    ``first_index`` set to an earlier conversion's :attr:`~ConvertedItems.end`, get the ids
    they have when converted after that conversion's messages (when no call is open there).
    ``cache`` (:class:`ConversionCache`) reuses the previous conversion's items for the
    messages it shares with this one; the result is the same, byte for byte.
    Never raises on odd messages; raises :class:`ValueError` only for an unknown policy or a
    negative ``first_index``.
    """
    if payload_policy not in PAYLOAD_POLICIES:
        raise ValueError(f"unknown payload policy {payload_policy!r}")
    if not isinstance(first_index, int) or first_index < 0:
        raise ValueError(f"first_index must be a non-negative int, not {first_index!r}")
    if not isinstance(messages, list | tuple):
        return Unconvertible(UnconvertibleReason.NOT_A_LIST, None, type(messages).__name__)
    if not set(map(type, messages)) <= _DICTS:
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping):
                return Unconvertible(
                    UnconvertibleReason.MESSAGE_NOT_A_MAPPING, index, type(message).__name__
                )
    kept = drop_duplicate_prompt(list(messages), js_trim(prompt), prompt_key=prompt_key)
    dropped = len(kept) != len(messages)
    if cache is not None:
        return cache._convert(kept, payload_policy, first_index, dropped)
    builder = _Builder(payload_policy)
    for index, message in enumerate(kept):
        try:
            _convert_one(builder, message)
        except _Refused as refused:
            return Unconvertible(refused.reason, index, refused.detail)
    builder.flush()
    builder.close_calls()
    items, sizes = _with_ids(builder.items, first_index)
    return _converted(
        items,
        sizes,
        message_count=len(kept),
        dropped_prompt=dropped,
        end=first_index + len(items),
    )


def _snapshot(message: object) -> bytes | None:
    """An immutable, type-exact snapshot of ``message`` (its pickle; never loaded), or
    ``None`` when it has none. Equal snapshots mean values of the same types with the same
    content (``True``, ``1`` and ``1.0`` differ; ``==`` would not tell them apart, and the
    conversion does)."""
    try:
        return pickle.dumps(message, protocol=5)
    except Exception:  # unpicklable (a lock, a lambda, a cycle too deep ...): never reused
        return None


class ConversionCache:
    """The previous conversion, kept so that the next one converts only what is new.

    Pass it as ``convert_messages(..., cache=cache)`` and ``check_items(items,
    cache=cache)``. One per conversation (a harness session); not thread-safe. A change of
    policy or ``first_index`` starts it afresh. The items it returns are read-only
    (``FrozenDict``, their parts too): they are also the next conversion's.
    """

    __slots__ = (
        "_calls",
        "_checked",
        "_checked_state",
        "_ends",
        "_first_index",
        "_held",
        "_items",
        "_ncalls",
        "_opens",
        "_policy",
        "_sizes",
        "_snapshots",
    )

    def __init__(self) -> None:
        self._reset(None, 0)

    def _reset(self, policy: str | None, first_index: int) -> None:
        self._policy = policy
        self._first_index = first_index
        # Per message converted (and reusable), in order:
        self._held: list[FrozenDict | None] = []  # the message itself, if deeply frozen
        self._snapshots: list[bytes | None] = []  # its snapshot (a frozen one's: when asked)
        self._ends: list[int] = []  # how many items precede the next message's
        self._opens: list[tuple[str, ...]] = []  # the calls still open after it
        self._ncalls: list[int] = []  # how many calls were made up to it (of _calls)
        self._calls: list[str] = []
        self._items: tuple[dict[str, Any], ...] = ()  # the whole previous conversion
        self._sizes: tuple[int, ...] = ()
        self._checked = 0  # leading _items that check_items found sound
        # Where the last conversion started converting (its first new item), the calls open
        # there and how many were made before: check_items' state at that item.
        self._checked_state: tuple[int, tuple[str, ...], int] = (0, (), 0)

    def _reusable(self, kept: Sequence[Mapping[str, Any]]) -> int:
        """How many leading messages of ``kept`` are the ones converted last time."""
        held, snapshots = self._held, self._snapshots
        limit = min(len(kept), len(snapshots))
        # Deeply frozen and the very message converted last time: the same (held[i] is
        # None for the others).
        same = list(map(operator.is_, kept, held))
        try:
            first = same.index(False)
        except ValueError:
            return limit
        for index in range(first, limit):
            if same[index]:
                continue
            message, known = kept[index], held[index]
            frozen = message if type(message) is FrozenDict else None
            if known is not None and frozen is not None and frozen != known:
                return index
            before = snapshots[index]
            if before is None:
                assert known is not None
                before = snapshots[index] = _snapshot(known)
            if before is None or _snapshot(message) != before:
                return index
            if frozen is not None:
                held[index] = frozen  # next time: identity
        return limit

    def _convert(
        self,
        kept: Sequence[Mapping[str, Any]],
        policy: PayloadPolicy,
        first_index: int,
        dropped: bool,
    ) -> ConvertedItems | Unconvertible:
        if policy != self._policy or first_index != self._first_index:
            self._reset(policy, first_index)
        try:
            return self._convert_from(self._reusable(kept), kept, policy, first_index, dropped)
        except BaseException:
            self._reset(None, 0)  # an error halfway: what is recorded may not hold
            raise

    def _convert_from(
        self,
        reuse: int,
        kept: Sequence[Mapping[str, Any]],
        policy: PayloadPolicy,
        first_index: int,
        dropped: bool,
    ) -> ConvertedItems | Unconvertible:
        builder = _Builder(policy)
        base = 0
        state: tuple[int, tuple[str, ...], int] = (0, (), 0)
        if reuse:
            base = self._ends[reuse - 1]
            builder.calls = self._calls[: self._ncalls[reuse - 1]]
            builder.seen_calls = set(builder.calls)
            builder.open_calls = list(self._opens[reuse - 1])
            state = (base, self._opens[reuse - 1], self._ncalls[reuse - 1])
        held, snapshots = self._held, self._snapshots
        ends, opens, ncalls = self._ends, self._opens, self._ncalls
        for record in (held, snapshots, ends, opens, ncalls):
            del record[reuse:]
        recording = True
        refusal: Unconvertible | None = None
        for index in range(reuse, len(kept)):
            message = kept[index]
            if recording:
                frozen = message if type(message) is FrozenDict else None
                snapshot = None if frozen is not None else _snapshot(message)
                recording = frozen is not None or snapshot is not None
            try:
                _convert_one(builder, message)
            except _Refused as refused:
                refusal = Unconvertible(refused.reason, index, refused.detail)
                break
            if recording:
                held.append(frozen)
                snapshots.append(snapshot)
                ends.append(base + len(builder.items))
                opens.append(tuple(builder.open_calls))
                ncalls.append(len(builder.calls))
        if refusal is None:
            builder.flush()
            builder.close_calls()
            fresh = builder.items
        else:  # keep what the next conversion may reuse
            fresh = builder.items[: ends[-1] - base] if len(ends) > reuse else []
        new_items, new_sizes = _with_ids(fresh, first_index + base, frozen=True)
        items, sizes = self._items[:base] + new_items, self._sizes[:base] + new_sizes
        self._calls, self._items, self._sizes = builder.calls, items, sizes
        self._checked, self._checked_state = min(self._checked, base), state
        if refusal is not None:
            return refusal
        return _converted(
            items,
            sizes,
            message_count=len(kept),
            dropped_prompt=dropped,
            end=first_index + len(items),
        )


def newest_items(converted: ConvertedItems, max_chars: int | None) -> ConvertedItems:
    """The newest of ``converted``'s items whose canonical JSON fits ``max_chars`` (``None``:
    all of them), cut where a history may start: at a message, with no call before the cut
    whose output comes after it (Codex would drop the orphan output). The result may be
    empty (nothing fits): the caller then uses the text frame, which cuts inside a part.
    Ids are kept (they name each item's place in the whole assembly), so the cut is as
    deterministic as the conversion; so is :attr:`~ConvertedItems.end`."""
    items = converted.items
    if max_chars is None or converted.chars <= max_chars:
        return converted
    sizes = converted.sizes
    start = len(items)
    used = 1  # the enclosing brackets, less the comma the first item does not need
    while start > 0:
        size = sizes[start - 1] + 1  # the item and its comma
        if used + size > max_chars:
            break
        used += size
        start -= 1
    start = _history_start(items, start)
    return _converted(
        items[start:],
        sizes[start:],
        message_count=converted.message_count,
        dropped_prompt=converted.dropped_prompt,
        end=converted.end,
    )


def _history_start(items: Sequence[Mapping[str, Any]], start: int) -> int:
    """The first position from ``start`` where a history may start (a message, inside no
    call's span from the call to its output), or ``len(items)``."""
    spans = [0] * (len(items) + 1)  # +1 where a span opens after a call, -1 at its output
    opened: dict[Any, int] = {}
    for index, item in enumerate(items):
        kind = item["type"]
        if kind == "function_call":
            opened[item.get("call_id")] = index
        elif kind == "function_call_output" and item.get("call_id") in opened:
            spans[opened.pop(item.get("call_id")) + 1] += 1
            spans[index + 1] -= 1
    depth = sum(spans[:start])
    for index in range(start, len(items)):
        depth += spans[index]
        if depth == 0 and items[index]["type"] == "message":
            return index
    return len(items)


# --- client-side validation (Codex accepts, then silently drops, some shapes) ----------------

_PART_TYPES: Final = {
    "user": frozenset({"input_text", "input_image"}),
    "assistant": frozenset({"output_text"}),
}


def check_items(
    items: Sequence[Mapping[str, Any]],
    *,
    checked: int = 0,
    cache: ConversionCache | None = None,
) -> str | None:
    """Why ``items`` are not a sound injection, or ``None``.

    Sound: non-empty; only user/assistant messages with their part types and non-empty
    content, ``function_call`` (string ``arguments``) and ``function_call_output`` (string
    ``output``); every call answered exactly once, after it, and no output without its call.
    Codex would accept several unsound shapes and silently drop or synthesize items.

    Only the items after a prefix known sound are examined item by item (the prefix only
    for which calls it makes and answers): the first ``checked`` items (the caller's word:
    they are a prefix of items this function accepted, or whose only fault was unanswered
    calls), or, when ``items`` are ``cache``'s last conversion, as many leading items as
    earlier checks through the same cache examined and found sound (this check then records
    its own finding for the next conversion). The answer is the same as without either.
    """
    if not items:
        return "empty"
    own = cache if cache is not None and items is cache._items else None
    skip = min(max(checked, own._checked if own is not None else 0), len(items))
    open_calls: set[str] = set()
    seen: set[str] = set()
    if own is not None and skip and skip == own._checked_state[0]:
        _, still_open, made = own._checked_state
        open_calls, seen = set(still_open), set(own._calls[:made])
    else:
        for index in range(skip):  # sound: only the calls made and answered matter
            item = items[index]
            kind = item.get("type")
            if kind == "function_call":
                call_id = str(item.get("call_id"))
                seen.add(call_id)
                open_calls.add(call_id)
            elif kind == "function_call_output":
                open_calls.discard(str(item.get("call_id")))
    problem, sound = _check_from(items, skip, open_calls, seen)
    if own is not None:
        own._checked = sound
    return problem


def _check_from(
    items: Sequence[Mapping[str, Any]], start: int, open_calls: set[str], seen: set[str]
) -> tuple[str | None, int]:
    """:func:`check_items` from ``start`` (the calls made and still open before it given),
    and how many leading items are sound as a prefix."""
    for index in range(start, len(items)):
        item = items[index]
        kind = item.get("type")
        if kind == "message":
            allowed = _PART_TYPES.get(str(item.get("role")))
            content = item.get("content")
            if allowed is None or not isinstance(content, list) or not content:
                return f"items[{index}]: bad message", index
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") not in allowed:
                    return f"items[{index}]: bad part", index
        elif kind == "function_call":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id in seen:
                return f"items[{index}]: bad call id", index
            if not isinstance(item.get("arguments"), str) or not item.get("name"):
                return f"items[{index}]: bad call", index
            seen.add(call_id)
            open_calls.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in open_calls or not isinstance(item.get("output"), str):
                return f"items[{index}]: orphan output", index
            open_calls.discard(str(call_id))
        else:
            return f"items[{index}]: type {kind!r}", index
    return (f"unanswered calls {sorted(open_calls)}" if open_calls else None), len(items)
