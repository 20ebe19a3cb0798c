"""The settings of :class:`~codex_turn.engines.SqliteContextEngine`: values, validated once.

Defaults follow lossless-claw's (reference section 5.1) where they exist: compaction starts
above ``threshold`` x budget and aims for ``compaction_target`` x budget (below the
threshold, so a forced compaction leaves headroom and a threshold compaction does not fire
again on the next turn), the fresh tail is 32 messages (at most half the budget, always back
to the newest user message), leaf chunks are 20k tokens, summaries aim for 2.4k (leaf) and 2k
(condensed) tokens, condensation needs 8 (depth 0) or 4 (deeper) consecutive summaries, and a
sweep is bounded by 64 passes and 120 s. ``summarizer`` says who writes summaries when no
summariser is given to the engine: ``"extractive"`` (the default: deterministic, no model) or
``"auto"`` (the model the host lends in the runtime context of a background compaction, else
extractive); the model is held off for ``breaker_cooldown_s`` after a refused login or
``breaker_failures`` consecutive failures. The store is bounded by default (1 GiB, see
``max_db_bytes``).

Every field is checked when the settings are built (``attrs.evolve`` included), by the table
:data:`_CHECKS` (:mod:`codex_turn._checks`): a wrong type or value raises
:class:`InvalidEngineSettings` naming each bad field, before a store is opened. Counts are
ints that fit SQLite's 64 bits; seconds are finite; ``busy_timeout_s`` fits SQLite's busy
timeout (an int of milliseconds), so a value that would make every later call raise is
refused here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Literal

import attrs

from codex_turn._checks import Check, at_least, finite, flag, one_of, seconds, validate
from codex_turn.errors import CodexTurnError

__all__ = ["EngineSettings", "InvalidEngineSettings"]

#: ``PRAGMA busy_timeout`` takes a 32-bit int of milliseconds.
_BUSY_TIMEOUT_MAX_S: Final = (2**31 - 1) / 1000


class InvalidEngineSettings(CodexTurnError, ValueError, TypeError):
    """An :class:`EngineSettings` field has a wrong type or value, refused when the settings
    are built. ``problems``: one message per bad field, ``EngineSettings.field: what it must
    be``. A ``ValueError`` and a ``TypeError`` too."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(self.problems))


def _fraction(value: Any) -> str | None:
    return None if finite(value) and 0 < value <= 1 else "must be a number in (0, 1]"


@attrs.frozen(kw_only=True)
class EngineSettings:
    #: Budget used when neither the call nor the runtime context gives one.
    default_token_budget: int = 128_000
    #: Compaction debt is recorded when stored context exceeds this fraction of the budget.
    threshold: float = 0.75
    #: A sweep aims for this fraction of the budget (must be below ``threshold``).
    compaction_target: float = 0.5
    fresh_tail_count: int = 32
    #: The fresh tail's token cap as a fraction of the budget (the newest user message is
    #: always kept in the tail, even beyond the cap, as long as it fits the budget).
    fresh_tail_max_fraction: float = 0.5
    leaf_chunk_tokens: int = 20_000
    #: Raw runs smaller than this are not worth a summary (they stay raw).
    min_leaf_chunk_tokens: int = 400
    leaf_target_tokens: int = 2_400
    condensed_target_tokens: int = 2_000
    leaf_fanout: int = 8
    condensed_fanout: int = 4
    max_depth: int = 4
    #: Cap of the deterministic truncation fallback, in tokens.
    fallback_summary_tokens: int = 512
    max_passes: int = 64
    sweep_deadline_s: float = 120.0
    summary_timeout_s: float = 120.0
    #: Who writes summaries when the engine is given no summariser: ``"auto"`` (the host's
    #: model when a compaction may call one and the host lends it, else extractive) or
    #: ``"extractive"`` (never a model). Not ``"auto"`` by default: with a model lent, debt
    #: waits for background maintenance (never a model in the foreground), so a host that
    #: maintains inline after each turn would stop compacting there.
    summarizer: Literal["auto", "extractive"] = "extractive"
    #: How long the circuit breaker stays open after a summariser auth error, or after
    #: ``breaker_failures`` consecutive model failures (errors or timeouts).
    breaker_cooldown_s: float = 1800.0
    breaker_failures: int = 3
    #: First backoff after a failed debt drain (doubles per failure, at most an hour).
    debt_backoff_s: float = 30.0
    busy_timeout_s: float = 30.0
    #: Messages per transaction when syncing a long path (bootstrap of a big transcript).
    sync_chunk: int = 2_000
    #: Stored message JSON larger than this is zlib-compressed (``None``: never).
    compress_over_bytes: int | None = 512
    #: Retention: background maintenance prunes archived conversations (oldest first) while
    #: the store is larger; active ones are never touched (``None``: no cap).
    max_db_bytes: int | None = 1 << 30
    #: Decoded messages kept in memory for assembly (LRU, shared by all sessions).
    decode_cache_messages: int = 20_000
    #: Sessions whose path identities are cached in memory (LRU).
    path_cache_sessions: int = 32
    #: Offer the model the recall tools (search, describe, expand the store).
    recall_tools: bool = True

    def __attrs_post_init__(self) -> None:
        validate(self, _CHECKS, InvalidEngineSettings)
        if self.compaction_target >= self.threshold:
            raise InvalidEngineSettings(
                ["EngineSettings.compaction_target: must be below threshold"]
            )


_CHECKS: Final[dict[str, Check]] = {
    "default_token_budget": at_least(1),
    "threshold": _fraction,
    "compaction_target": _fraction,
    "fresh_tail_count": at_least(1),
    "fresh_tail_max_fraction": _fraction,
    "leaf_chunk_tokens": at_least(1),
    "min_leaf_chunk_tokens": at_least(1),
    "leaf_target_tokens": at_least(8),
    "condensed_target_tokens": at_least(8),
    "leaf_fanout": at_least(2),
    "condensed_fanout": at_least(2),
    "max_depth": at_least(1),
    "fallback_summary_tokens": at_least(16),
    "max_passes": at_least(1),
    "sweep_deadline_s": seconds(),
    "summary_timeout_s": seconds(),
    "summarizer": one_of("auto", "extractive"),
    "breaker_cooldown_s": seconds(positive=False),
    "breaker_failures": at_least(1),
    "debt_backoff_s": seconds(positive=False),
    "busy_timeout_s": seconds(at_most=_BUSY_TIMEOUT_MAX_S),
    "sync_chunk": at_least(1),
    "compress_over_bytes": at_least(0, optional=True),
    "max_db_bytes": at_least(0, optional=True),
    "decode_cache_messages": at_least(0),
    "path_cache_sessions": at_least(1),
    "recall_tools": flag(),
}
