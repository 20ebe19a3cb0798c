"""Tool payloads for the thread-bootstrap projection: shapes, never values.

A thread-bootstrap projection hands a fresh Codex thread the context it needs to continue a
conversation, once per engine epoch. The per-turn projection simply elides tool payloads
(``tool call: exec [input omitted]``), but a fresh thread then cannot tell *what kind* of call
was made. OpenClaw's ``toolPayloadMode: "preserve"`` keeps that structure without leaking data:

* a tool call keeps its metadata (``type, name, id, callId, toolCallId, toolUseId``) plus an
  ``inputShape`` in which every leaf of the arguments is replaced by its type (``"[string]"``,
  ``"[number]"``, ``"[boolean]"``, ``"[null]"``), so ``{"command": "cat .env"}`` becomes
  ``{"command": "[string]"}``;
* a tool result keeps its values, but every string goes through :func:`redact_secrets` and
  every scalar value under a secret-looking key (``apiKey``, ``token``, ``password`` ...:
  :func:`codex_turn._secrets.is_secret_key`, the same vocabulary the logs use) is replaced
  whole.

Both are pure functions of their input. Secrets are masked by the one pure redactor,
``codex_turn._secrets.redact_secrets``, never by the logging redactor, which also masks values
registered per task: a projection must not depend on who calls it (byte stability).
Self-references, possible in Python dicts though not in JSON, render as ``"[Circular]"``.

Key order is not part of the input. Codex's prompt cache keys on bytes, and the same logical
tool call can reach us with its keys in any order, so :func:`render_json` writes canonical JSON:
keys sorted in code-point order at every depth, two-space indent, the fixed separators ``","``
and ``": "``, non-ASCII kept as is. Two keys can collide once redacted
(two different pasted tokens both become ``[redacted]``; ``1`` and ``"1"`` both become ``"1"``);
the entry kept is then chosen from the entries themselves, never from which came first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from codex_turn._secrets import REDACTED, is_secret_key, redact_secrets

__all__ = ["REDACTED", "input_shape", "redact_secrets", "redacted_payload", "render_json"]

_CIRCULAR: Final = "[Circular]"
_TOO_DEEP: Final = "[MaxDepth]"
_MAX_DEPTH: Final = 64


def _leaf_type(value: object) -> str:
    if value is None:
        return "[null]"
    if isinstance(value, bool):
        return "[boolean]"
    if isinstance(value, int | float):
        return "[number]"
    if isinstance(value, str):
        return "[string]"
    return f"[{type(value).__name__}]"


def input_shape(value: object) -> Any:
    """``value`` with the structure kept and every leaf replaced by its type name."""
    return _shape(value, (), 0)


def _shape(value: object, stack: tuple[int, ...], depth: int) -> Any:
    if isinstance(value, Mapping | list | tuple):
        if id(value) in stack:
            return _CIRCULAR
        if depth >= _MAX_DEPTH:
            return _TOO_DEEP
        inner = (*stack, id(value))
        if isinstance(value, Mapping):
            # Keys are structure, but a key can itself be a pasted secret: redact it too.
            out: dict[str, Any] = {}
            origins: dict[str, object] = {}
            for k, v in value.items():
                _put(out, origins, redact_secrets(str(k)), k, _shape(v, inner, depth + 1))
            return out
        return [_shape(v, inner, depth + 1) for v in value]
    return _leaf_type(value)


def redacted_payload(value: object) -> Any:
    """A JSON-compatible copy of ``value`` with secrets masked (for tool results)."""
    return _redact(value, (), 0)


def _redact(value: object, stack: tuple[int, ...], depth: int) -> Any:
    if isinstance(value, str):
        return redact_secrets(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, Mapping | list | tuple):
        if id(value) in stack:
            return _CIRCULAR
        if depth >= _MAX_DEPTH:
            return _TOO_DEEP
        inner = (*stack, id(value))
        if isinstance(value, Mapping):
            if value.get("type") == "image":
                # Never inline base64 image data into text; keep what it was.
                return {
                    "type": "image",
                    **(
                        {"mimeType": value["mimeType"]}
                        if isinstance(value.get("mimeType"), str)
                        else {}
                    ),
                    "data": "[image omitted]",
                }
            out: dict[str, Any] = {}
            origins: dict[str, object] = {}
            for k, v in value.items():
                key = redact_secrets(str(k))
                secret = is_secret_key(key) and isinstance(v, str | int | float)
                _put(out, origins, key, k, REDACTED if secret else _redact(v, inner, depth + 1))
            return out
        return [_redact(v, inner, depth + 1) for v in value]
    return _leaf_type(value)


def _put(
    out: dict[str, Any], origins: dict[str, object], key: str, origin: object, shown: Any
) -> None:
    """``out[key] = shown``, unless ``key`` is taken by an entry that wins over this one.

    Distinct keys can redact to the same text; the winner is the greatest by original key text,
    key type and rendering, so it does not depend on the mapping's order. (The original key is
    only compared, never shown.)
    """
    if key in out:
        previous = origins[key]
        if _rank(origin, shown) <= _rank(previous, out[key]):
            return
    out[key] = shown
    origins[key] = origin


def _rank(origin: object, shown: Any) -> tuple[str, str, str]:
    return (str(origin), type(origin).__qualname__, render_json(shown))


def render_json(value: Any) -> str:
    """Canonical indented JSON: keys sorted at every depth, fixed separators, non-ASCII kept.

    Equal values give equal text whatever the order of their keys (the prompt cache keys on
    these bytes). ``value`` has string keys only (:func:`input_shape` and
    :func:`redacted_payload` outputs do).
    """
    return json.dumps(
        value,
        indent=2,
        separators=(",", ": "),
        sort_keys=True,
        ensure_ascii=False,
        default=_leaf_type,
    )
