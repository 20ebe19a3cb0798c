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
:class:`UnconvertibleReason`), as do a non-list assembly, a message that is not a mapping and
a role that cannot be injected (``system`` and ``developer`` would be dropped or gain
authority; unknown roles have no meaning).

Ids. Codex adds a random id to an injected item that has none (``msg_<uuidv7>``) and keeps an
id it is given. A thread whose injected history is rebuilt every turn would then send new ids
every turn and lose the prompt cache's prefix, so each item carries its own id: the item's
kind prefix (``msg_``, ``fc_``, ``fco_``) and a digest of its position and canonical content.
Equal assemblies give equal ids; an assembly that only grows keeps every earlier id.

Determinism: nothing reads a clock, a random source or hash order; messages and parts are
read by key, so key order is not part of the input; :attr:`ConvertedItems.canonical` is the
canonical JSON of the items (keys sorted, compact separators, non-ASCII kept), byte-stable for
identical input.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

import attrs

from codex_turn.projection.frame import _drop_duplicate_prompt, _trim
from codex_turn.projection.payload import input_shape, redact_secrets, redacted_payload

__all__ = [
    "ELIDED_ARGUMENTS",
    "ELIDED_OUTPUT",
    "SUMMARY_HEADER",
    "UNANSWERED_OUTPUT",
    "ConvertedItems",
    "PayloadPolicy",
    "Unconvertible",
    "UnconvertibleReason",
    "canonical_json",
    "check_items",
    "convert_messages",
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
    """The items to inject, in order, and their canonical JSON text."""

    items: tuple[dict[str, Any], ...]
    #: Canonical JSON of ``items``: equal assemblies give equal text, byte for byte.
    canonical: str
    #: The assembled messages converted (the duplicate trailing prompt removed).
    message_count: int
    #: Whether the last assembled message repeated the prompt and was dropped.
    dropped_prompt: bool

    @property
    def chars(self) -> int:
        return len(self.canonical)


def canonical_json(value: Any) -> str:
    """Compact canonical JSON: keys sorted at every depth, non-ASCII kept as is."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class _Refused(Exception):
    def __init__(self, reason: UnconvertibleReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _str_field(mapping: Mapping[str, Any], keys: Sequence[str]) -> str | None:
    for key in keys:
        value = mapping.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def _image_url(part: Mapping[str, Any]) -> str | None:
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
        except ValueError:
            value = raw
    if policy == "shape-only":
        return canonical_json(input_shape(value if value is not None else {}))
    return canonical_json(redacted_payload(value if value is not None else {}))


def _output_text(content: object, policy: PayloadPolicy) -> str:
    if policy != "full":
        return ELIDED_OUTPUT
    if isinstance(content, str):
        return redact_secrets(content)
    if content is None:
        return ""
    if not isinstance(content, list | tuple):
        return canonical_json(redacted_payload(content))
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
                texts.append(canonical_json(redacted_payload(part)))
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
            url = _image_url(part)
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
        if _trim(summary):
            builder.text(f"{SUMMARY_HEADER}\n{summary}")
        builder.flush()
    else:
        raise _Refused(UnconvertibleReason.ROLE_NOT_INJECTABLE, f"role {role!r}")


_ID_PREFIX: Final = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}


def _with_ids(items: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    out = []
    for index, item in enumerate(items):
        digest = hashlib.sha256(
            f"{index}\x00{canonical_json(item)}".encode("utf-8", "surrogatepass")
        )
        out.append({**item, "id": _ID_PREFIX[item["type"]] + digest.hexdigest()[:40]})
    return tuple(out)


def convert_messages(
    messages: Sequence[Mapping[str, Any]],
    *,
    prompt: str = "",
    payload_policy: PayloadPolicy = "elide",
) -> ConvertedItems | Unconvertible:
    """The Responses items for ``messages`` (see the module docstring), or why there are none.

    ``prompt`` is the raw prompt of the turn: a last user message repeating it is dropped.
    Never raises on odd messages; raises :class:`ValueError` only for an unknown policy.
    """
    if payload_policy not in PAYLOAD_POLICIES:
        raise ValueError(f"unknown payload policy {payload_policy!r}")
    if not isinstance(messages, list | tuple):
        return Unconvertible(UnconvertibleReason.NOT_A_LIST, None, type(messages).__name__)
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            return Unconvertible(
                UnconvertibleReason.MESSAGE_NOT_A_MAPPING, index, type(message).__name__
            )
    kept = _drop_duplicate_prompt(list(messages), _trim(prompt)) if prompt else list(messages)
    builder = _Builder(payload_policy)
    for index, message in enumerate(kept):
        try:
            _convert_one(builder, message)
        except _Refused as refused:
            return Unconvertible(refused.reason, index, refused.detail)
    builder.flush()
    builder.close_calls()
    items = _with_ids(builder.items)
    return ConvertedItems(
        items=items,
        canonical=canonical_json(list(items)),
        message_count=len(kept),
        dropped_prompt=len(kept) != len(messages),
    )


def newest_items(converted: ConvertedItems, max_chars: int | None) -> ConvertedItems:
    """The newest of ``converted``'s items whose canonical JSON fits ``max_chars`` (``None``:
    all of them), cut where a history may start: at a message, with no call before the cut
    whose output comes after it (Codex would drop the orphan output). The result may be
    empty (nothing fits): the caller then uses the text frame, which cuts inside a part.
    Ids are kept (they name each item's place in the whole assembly), so the cut is as
    deterministic as the conversion."""
    items = converted.items
    if max_chars is None or converted.chars <= max_chars:
        return converted
    start = len(items)
    used = 1  # the enclosing brackets, less the comma the first item does not need
    while start > 0:
        size = len(canonical_json(items[start - 1])) + 1  # the item and its comma
        if used + size > max_chars:
            break
        used += size
        start -= 1
    allowed = _history_starts(items)
    while start < len(items) and not allowed[start]:
        start += 1
    kept = items[start:]
    return attrs.evolve(converted, items=kept, canonical=canonical_json(list(kept)))


def _history_starts(items: Sequence[Mapping[str, Any]]) -> list[bool]:
    """For each position: may a history start there (a message, inside no call's span from
    the call to its output)?"""
    spans = [0] * (len(items) + 1)  # +1 where a span opens after a call, -1 at its output
    opened: dict[Any, int] = {}
    for index, item in enumerate(items):
        if item["type"] == "function_call":
            opened[item.get("call_id")] = index
        elif item["type"] == "function_call_output" and item.get("call_id") in opened:
            spans[opened.pop(item.get("call_id")) + 1] += 1
            spans[index + 1] -= 1
    allowed, depth = [], 0
    for index, item in enumerate(items):
        depth += spans[index]
        allowed.append(item["type"] == "message" and depth == 0)
    return allowed


# --- client-side validation (Codex accepts, then silently drops, some shapes) ----------------

_PART_TYPES: Final = {
    "user": frozenset({"input_text", "input_image"}),
    "assistant": frozenset({"output_text"}),
}


def check_items(items: Sequence[Mapping[str, Any]]) -> str | None:
    """Why ``items`` are not a sound injection, or ``None``.

    Sound: non-empty; only user/assistant messages with their part types and non-empty
    content, ``function_call`` (string ``arguments``) and ``function_call_output`` (string
    ``output``); every call answered exactly once, after it, and no output without its call.
    Codex would accept several unsound shapes and silently drop or synthesize items.
    """
    if not items:
        return "empty"
    open_calls: set[str] = set()
    seen: set[str] = set()
    for index, item in enumerate(items):
        kind = item.get("type")
        if kind == "message":
            allowed = _PART_TYPES.get(str(item.get("role")))
            content = item.get("content")
            if allowed is None or not isinstance(content, list) or not content:
                return f"items[{index}]: bad message"
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") not in allowed:
                    return f"items[{index}]: bad part"
        elif kind == "function_call":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id in seen:
                return f"items[{index}]: bad call id"
            if not isinstance(item.get("arguments"), str) or not item.get("name"):
                return f"items[{index}]: bad call"
            seen.add(call_id)
            open_calls.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in open_calls or not isinstance(item.get("output"), str):
                return f"items[{index}]: orphan output"
            open_calls.discard(str(call_id))
        else:
            return f"items[{index}]: type {kind!r}"
    return f"unanswered calls {sorted(open_calls)}" if open_calls else None
