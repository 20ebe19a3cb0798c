"""How many characters of assembled context one Codex turn may carry.

The projection renders an engine's assembly as text inside the turn prompt, so its size must
follow the model's context window: a fixed 24,000-character cap hid large assemblies and made
context look "lost" (OpenClaw #80760), while an unbounded one lets a runaway assembly eat the
whole window. OpenClaw's answer (#80761), ported here number for number, derives the cap from
the token budget after setting aside a *reserve* for the model's own output and tools:

    protected = min(8_000, max(1, budget // 2))
    prompt_budget_tokens = max(1, budget - min(reserve, max(0, budget - protected)))
    max_rendered_context_chars = clamp(24_000, 1_000_000, prompt_budget_tokens * 4)
    text_part_max_chars = clamp(6_000, 128_000, max_rendered_context_chars // 4)

``protected`` shields small models: the reserve can never eat the
first half of a small window (or the first 8,000 tokens of a large one). Four characters per
token is the usual conservative estimate for English text and code. Without a known budget
(``None``, zero, negative or not finite) the cap stays at the historical 24,000 characters,
and ``1_000_000`` is the hard ceiling whatever the budget says.
"""

from __future__ import annotations

import math
from typing import Final

__all__ = [
    "DEFAULT_MAX_RENDERED_CONTEXT_CHARS",
    "DEFAULT_RESERVE_TOKENS",
    "MAX_RENDERED_CONTEXT_CHARS_CEILING",
    "max_rendered_context_chars",
    "prompt_budget_tokens",
    "resolve_projection_reserve_tokens",
    "text_part_max_chars",
]

DEFAULT_MAX_RENDERED_CONTEXT_CHARS: Final = 24_000
MAX_RENDERED_CONTEXT_CHARS_CEILING: Final = 1_000_000
DEFAULT_RESERVE_TOKENS: Final = 20_000
_CHARS_PER_TOKEN: Final = 4
_SMALL_MODEL_PROTECTED_TOKENS: Final = 8_000
_TEXT_PART_MIN: Final = 6_000
_TEXT_PART_MAX: Final = 128_000


def _clamp(low: int, high: int, value: int) -> int:
    return max(low, min(high, value))


def _known_budget(token_budget: float | None) -> int | None:
    if token_budget is None or isinstance(token_budget, bool):
        return None
    if not math.isfinite(token_budget) or token_budget <= 0:
        return None
    budget = math.floor(token_budget)
    return budget if budget > 0 else None


def prompt_budget_tokens(token_budget: float, reserve_tokens: float | None = None) -> int:
    """Tokens left for the prompt once the reserve is set aside (at least 1)."""
    budget = math.floor(token_budget)
    reserve = (
        DEFAULT_RESERVE_TOKENS if reserve_tokens is None else max(0, math.floor(reserve_tokens))
    )
    protected = min(_SMALL_MODEL_PROTECTED_TOKENS, max(1, budget // 2))
    return max(1, budget - min(reserve, max(0, budget - protected)))


def max_rendered_context_chars(
    token_budget: float | None = None, reserve_tokens: float | None = None
) -> int:
    """The cap on the rendered ``<conversation_context>`` for this budget and reserve."""
    budget = _known_budget(token_budget)
    if budget is None:
        return DEFAULT_MAX_RENDERED_CONTEXT_CHARS
    return _clamp(
        DEFAULT_MAX_RENDERED_CONTEXT_CHARS,
        MAX_RENDERED_CONTEXT_CHARS_CEILING,
        prompt_budget_tokens(budget, reserve_tokens) * _CHARS_PER_TOKEN,
    )


def text_part_max_chars(max_context_chars: int) -> int:
    """The cap on one text part or string body (its head is kept)."""
    return _clamp(_TEXT_PART_MIN, _TEXT_PART_MAX, max_context_chars // 4)


def resolve_projection_reserve_tokens(
    *, reserve_tokens: int | None = None, reserve_tokens_floor: int | None = None
) -> int | None:
    """The projection reserve from OpenClaw's compaction config.

    ``reserveTokens`` alone is raised to the floor (default 20,000); a floor alone is the
    reserve; neither gives ``None``, which means the 20,000 default.
    """
    if reserve_tokens is not None:
        floor = DEFAULT_RESERVE_TOKENS if reserve_tokens_floor is None else reserve_tokens_floor
        return max(reserve_tokens, floor)
    return reserve_tokens_floor
