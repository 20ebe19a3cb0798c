"""Deterministic Codex-mirror turns for the session tests and their subprocess writers.

A turn is the projector's snapshot: the raw prompt, optional "Codex reasoning:" and "Codex
plan:" mirrors and the final assistant message, with identities ``<turnId>:<kind>``. The same
(thread, turn, size) always yields the same messages, so a retried turn is byte-identical.
"""

from __future__ import annotations

import random
from typing import Any

KINDS = ("prompt", "reasoning", "plan", "assistant")


def _assistant(text: str, ts: int) -> dict[str, Any]:
    zero = {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "total": 0}
    return {
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "api": "openai-codex-responses",
        "provider": "openai",
        "model": "gpt-5.5",
        "usage": {
            "input": 0,
            "output": 0,
            "cacheRead": 0,
            "cacheWrite": 0,
            "totalTokens": 0,
            "cost": zero,
        },
        "stopReason": "stop",
        "timestamp": ts,
    }


def turn_messages(
    thread: str, turn: int, *, max_size: int = 64
) -> tuple[list[dict[str, Any]], list[str]]:
    """The four mirrored messages of ``turn`` and their identities."""
    rng = random.Random(f"{thread}/{turn}")
    ts = 1_774_000_000_000 + turn * 1000
    pad = [("·ü" * rng.randint(0, max_size))[: rng.randint(0, max_size)] for _ in KINDS]
    turn_id = f"turn-{turn}"
    messages = [
        {"role": "user", "content": f"prompt {thread}/{turn} {pad[0]}", "timestamp": ts},
        _assistant(f"Codex reasoning:\n{thread}/{turn} {pad[1]}", ts + 1),
        _assistant(f"Codex plan:\n{thread}/{turn} {pad[2]}", ts + 2),
        _assistant(f"answer {thread}/{turn} {pad[3]}", ts + 3),
    ]
    return messages, [f"{turn_id}:{kind}" for kind in KINDS]


def turn_keys(thread: str, turn: int) -> list[str]:
    return [f"codex-app-server:{thread}:turn-{turn}:{kind}" for kind in KINDS]


def expected_messages(thread: str, turns: range, *, max_size: int = 64) -> list[dict[str, Any]]:
    """What the transcript path should hold after mirroring ``turns`` of ``thread``."""
    out: list[dict[str, Any]] = []
    for turn in turns:
        messages, _ = turn_messages(thread, turn, max_size=max_size)
        for message, key in zip(messages, turn_keys(thread, turn), strict=True):
            out.append({**message, "idempotencyKey": key})
    return out
