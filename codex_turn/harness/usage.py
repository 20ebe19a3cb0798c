"""Token usage as Codex reports it, normalised once: the one usage type of the library.

Codex's ``inputTokens`` is *every* prompt token, cached ones included; ``cachedInputTokens``
(and ``cacheWriteInputTokens``) are subsets of it, not additions. A pi-style
``input + cacheRead + cacheWrite`` over the raw numbers counts cached tokens twice and makes
compaction trigger early (reference 2.5 and 4.13; the binary confirms: 1200 in with 1000
cached reports ``inputTokens: 1200``). :class:`Usage` therefore stores ``input`` *uncached*,
so that its parts add up, and :attr:`Usage.prompt_tokens` is the prompt size counted once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["Usage"]


def _count(data: Mapping[str, Any], *names: str) -> int:
    """The first usable count among ``names``: finite numbers floored at 0; bools, strings
    and junk read as absent."""
    for name in names:
        value = data.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return max(0, math.floor(value))
    return 0


@attrs.frozen
class Usage:
    """Normalised token usage of one model call: ``input`` excludes cached and cache-write."""

    input: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0
    reasoning_output: int = 0
    #: Codex reported its cached-input count (``promptCache`` is filled only then; absent is
    #: not zero). Not part of equality: two usages with the same counts are the same usage.
    cache_reported: bool = attrs.field(default=False, eq=False, repr=False)

    @property
    def prompt_tokens(self) -> int:
        """The prompt the model saw, cached tokens counted once (``currentTokenCount``)."""
        return self.input + self.cache_read + self.cache_write

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output

    @classmethod
    def from_codex(cls, breakdown: Mapping[str, Any]) -> Usage:
        """From a Codex ``TokenUsageBreakdown`` (camelCase; snake_case and pi aliases accepted)."""
        raw_input = _count(breakdown, "inputTokens", "input_tokens", "input", "promptTokens")
        cache_keys = ("cachedInputTokens", "cached_input_tokens", "cacheRead")
        cached = _count(breakdown, *cache_keys)
        written = _count(
            breakdown, "cacheWriteInputTokens", "cache_write_input_tokens", "cacheWrite"
        )
        # Inconsistent reports (cached > input) are read as "at least what was cached".
        cached = min(cached, max(raw_input, cached))
        written = min(written, max(0, raw_input - cached))
        return cls(
            input=max(0, raw_input - cached - written),
            output=_count(breakdown, "outputTokens", "output_tokens", "output"),
            cache_read=cached,
            cache_write=written,
            reasoning_output=_count(breakdown, "reasoningOutputTokens", "reasoning_output_tokens"),
            cache_reported=any(key in breakdown for key in cache_keys),
        )

    def to_agent_usage(self) -> dict[str, Any]:
        """OpenClaw/pi ``usage`` of an assistant message (cost unknown offline: zeros)."""
        return {
            "input": self.input,
            "output": self.output,
            "cacheRead": self.cache_read,
            "cacheWrite": self.cache_write,
            "totalTokens": self.total_tokens,
            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "total": 0},
        }
