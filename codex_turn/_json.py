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

*Messages stay plain dicts.* :data:`AgentMessage` (one message of a transcript or an assembly)
is a JSON object with unknown keys preserved; it is defined here, below everything that passes
messages around, and re-exported by the engine contract.

A leaf module: it imports nothing of the package.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["AgentMessage", "canonical_json"]

#: One message of a transcript or an assembly: a JSON object, unknown keys preserved.
AgentMessage = dict[str, Any]


def canonical_json(value: Any) -> str:
    """Canonical JSON of ``value``: keys sorted at every depth, compact separators,
    non-ASCII kept as is. Raises :class:`ValueError` for NaN or an infinity (not JSON) and
    :class:`TypeError` for a value JSON has no form for."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )
