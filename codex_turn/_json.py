"""JSON as the package handles it: the one canonical encoding and the message alias.

*One byte identity.* :func:`canonical_json` is how every part of the package turns a JSON value
into the text it hashes, compares, measures or stores: keys sorted at every depth, compact
separators, non-ASCII kept as is (so equal values give equal text whatever the order of their
keys). Projection ids, the engine store's digests and the conformance suite's "identical
output" all mean these bytes.

*NaN is not JSON.* RFC 8259 has no NaN or infinity; Python's ``json`` writes them as the bare
words ``NaN`` / ``Infinity`` that strict parsers (and Codex) refuse. :func:`canonical_json`
refuses them too, with :class:`ValueError`, rather than write text that is not JSON. A caller
that encodes values it does not control (an engine's assembly is arbitrary Python) maps that
error at its own boundary: the structured projection reports the assembly unconvertible, the
conformance host fails the check, the engine store refuses the message.

*Depth is bounded.* Every stage after the transcript reader walks messages (a freeze, an
encoding, a projection, an engine's own code), and most walks recurse, so a value nested
deeply enough breaks all of them with :class:`RecursionError`, on every later turn of the
session. :data:`MAX_JSON_DEPTH` is the deepest nesting the package takes in from outside: the
transcript reader quarantines a deeper line as malformed, and a deeper output schema is an
invalid parameter. :func:`nested_deeper_than` measures it without recursing, and
:func:`canonical_json` reports a value it cannot encode for its depth as :class:`ValueError`,
like any other value it has no JSON for.

*Messages stay plain dicts.* :data:`AgentMessage` (one message of a transcript or an assembly)
is a JSON object with unknown keys preserved; it is defined here, below everything that passes
messages around, and re-exported by the engine contract.

A leaf module: it imports nothing of the package.
"""

from __future__ import annotations

import json
from typing import Any, Final

__all__ = ["MAX_JSON_DEPTH", "AgentMessage", "canonical_json", "nested_deeper_than"]

#: One message of a transcript or an assembly: a JSON object, unknown keys preserved.
AgentMessage = dict[str, Any]

#: The deepest nesting of objects and arrays taken in from outside (a transcript line, an
#: output schema). Twice serde_json's default limit (Codex's parser): whatever Codex wrote
#: fits with room for the transcript's own wrapping, and every walk of such a value stays far
#: below Python's recursion limit (see the module docstring).
MAX_JSON_DEPTH: Final = 256

_CONTAINERS: Final = (dict, list, tuple)


def nested_deeper_than(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` nests dicts, lists or tuples more than ``limit`` levels deep (a
    scalar is depth 0, ``{}`` and ``[]`` depth 1). Iterative, and visits containers only;
    a value that contains itself counts as too deep."""
    if not isinstance(value, _CONTAINERS):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        container, depth = stack.pop()
        if depth > limit:
            return True
        items = container.values() if isinstance(container, dict) else container
        stack.extend((item, depth + 1) for item in items if isinstance(item, _CONTAINERS))
    return False


def canonical_json(value: Any) -> str:
    """Canonical JSON of ``value``: keys sorted at every depth, compact separators,
    non-ASCII kept as is. Raises :class:`ValueError` for NaN or an infinity (not JSON) and
    for a value nested too deeply to encode, and :class:`TypeError` for a value JSON has no
    form for."""
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except RecursionError:
        raise ValueError("value nested too deeply to encode as JSON") from None
