"""The settings of :class:`~codex_turn.engines.SqliteContextEngine`: values, validated once.

Defaults follow lossless-claw's (reference section 5.1) where they exist: compaction starts
above ``threshold`` x budget and aims for ``compaction_target`` x budget (below the
threshold, so a forced compaction leaves headroom and a threshold compaction does not fire
again on the next turn), the fresh tail is 32 messages (at most half the budget, always back
to the newest user message), leaf chunks are 20k tokens, summaries aim for 2.4k (leaf) and 2k
(condensed) tokens, condensation needs 8 (depth 0) or 4 (deeper) consecutive summaries, and a
sweep is bounded by 64 passes and 120 s.
"""

from __future__ import annotations

import attrs
from attrs import validators as v

__all__ = ["EngineSettings"]


def _fraction(_instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"EngineSettings.{attribute.name} must be in (0, 1] (got {value})")


@attrs.frozen(kw_only=True)
class EngineSettings:
    #: Budget used when neither the call nor the runtime context gives one.
    default_token_budget: int = attrs.field(default=128_000, validator=v.gt(0))
    #: Compaction debt is recorded when stored context exceeds this fraction of the budget.
    threshold: float = attrs.field(default=0.75, validator=_fraction)
    #: A sweep aims for this fraction of the budget (must be below ``threshold``).
    compaction_target: float = attrs.field(default=0.5, validator=_fraction)
    fresh_tail_count: int = attrs.field(default=32, validator=v.ge(1))
    #: The fresh tail's token cap as a fraction of the budget (the newest user message is
    #: always kept in the tail, even beyond the cap, as long as it fits the budget).
    fresh_tail_max_fraction: float = attrs.field(default=0.5, validator=_fraction)
    leaf_chunk_tokens: int = attrs.field(default=20_000, validator=v.ge(1))
    #: Raw runs smaller than this are not worth a summary (they stay raw).
    min_leaf_chunk_tokens: int = attrs.field(default=400, validator=v.ge(1))
    leaf_target_tokens: int = attrs.field(default=2_400, validator=v.ge(8))
    condensed_target_tokens: int = attrs.field(default=2_000, validator=v.ge(8))
    leaf_fanout: int = attrs.field(default=8, validator=v.ge(2))
    condensed_fanout: int = attrs.field(default=4, validator=v.ge(2))
    max_depth: int = attrs.field(default=4, validator=v.ge(1))
    #: Cap of the deterministic truncation fallback, in tokens.
    fallback_summary_tokens: int = attrs.field(default=512, validator=v.ge(16))
    max_passes: int = attrs.field(default=64, validator=v.ge(1))
    sweep_deadline_s: float = attrs.field(default=120.0, validator=v.gt(0))
    summary_timeout_s: float = attrs.field(default=120.0, validator=v.gt(0))
    #: How long the circuit breaker stays open after a summariser auth error.
    breaker_cooldown_s: float = attrs.field(default=1800.0, validator=v.ge(0))
    #: First backoff after a failed debt drain (doubles per failure, at most an hour).
    debt_backoff_s: float = attrs.field(default=30.0, validator=v.ge(0))
    busy_timeout_s: float = attrs.field(default=30.0, validator=v.gt(0))
    #: Messages per transaction when syncing a long path (bootstrap of a big transcript).
    sync_chunk: int = attrs.field(default=2_000, validator=v.ge(1))
    #: Stored message JSON larger than this is zlib-compressed (``None``: never).
    compress_over_bytes: int | None = attrs.field(default=512)
    #: Retention: prune archived conversations (oldest first) while the file is larger.
    max_db_bytes: int | None = attrs.field(default=None)
    #: Decoded messages kept in memory for assembly (LRU, shared by all sessions).
    decode_cache_messages: int = attrs.field(default=20_000, validator=v.ge(0))
    #: Sessions whose path identities are cached in memory (LRU).
    path_cache_sessions: int = attrs.field(default=32, validator=v.ge(1))

    def __attrs_post_init__(self) -> None:
        if self.compaction_target >= self.threshold:
            raise ValueError("EngineSettings.compaction_target must be below threshold")
