"""Secret-shaped text, masked: the one redactor behind both logs and projections.

Pure and deterministic (the projection's byte stability depends on it): the same input
always gives the same output, whoever calls it. Logging adds its own per-task sensitive
values on top (``codex_turn._log.sensitive``); projections never do.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["REDACTED", "redact_secrets"]

REDACTED: Final = "[redacted]"

# The most specific shapes first, so a bearer token is masked as one unit.
_SECRET_PATTERNS: Final[tuple[re.Pattern[str], ...]] = (
    re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{6,}"),
    re.compile(r"\bsk-[A-Za-z0-9_-]{8,}"),
    re.compile(r"\b(?:ghp|gho|ghu|ghs|github_pat|xox[abpr])_[A-Za-z0-9_-]{8,}"),
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)"),
)
# KEY=value / key: value where the key names a credential; the key stays, the value goes.
_ASSIGNMENT: Final = re.compile(
    r"(?i)\b([A-Z0-9_]*(?:api[_-]?key|token|secret|password|passwd|auth)[A-Z0-9_]*)"
    r"(\s*[=:]\s*)(\"[^\"]*\"|'[^']*'|\S+)"
)


def redact_secrets(text: str) -> str:
    """Mask secret-shaped substrings: bearer tokens, ``sk-`` keys, ``KEY=value`` credentials."""
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(REDACTED, text)
    return _ASSIGNMENT.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
