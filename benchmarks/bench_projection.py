"""Benchmark: projecting 1k / 10k / 100k mixed assembled messages for one Codex turn.

Run: ``.venv/bin/python benchmarks/bench_projection.py`` (``--quick`` skips 100k).

The corpus is deterministic (a seeded ``random.Random``) and "typical": user text of a few
hundred characters, assistant turns with thinking, text and a tool call, tool results with a
few hundred characters of output, and an image every 25 messages. For each size it prints the
best-of-N wall time and the peak traced memory of one projection (``tracemalloc`` runs in a
separate pass, because tracing slows allocation down), for the default cap (no budget, 24,000
characters) and a large budget (1M tokens: 1,000,000 characters, nothing or little cut).
Finally it checks that the cost grows linearly: time per message at 100k within 2x of 1k.
"""

from __future__ import annotations

import gc
import random
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from codex_turn.projection import project_context_engine_assembly

WORDS = [
    "the",
    "context",
    "engine",
    "assembles",
    "history",
    "for",
    "codex",
    "and",
    "the",
    "harness",
    "projects",
    "it",
    "into",
    "one",
    "framed",
    "prompt",
    "with",
    "tool",
    "calls",
    "results",
    "images",
    "and",
    "plain",
    "text",
    "about",
    "files",
    "tests",
    "builds",
]


def _text(rng: random.Random, low: int, high: int) -> str:
    words = []
    size = 0
    target = rng.randint(low, high)
    while size < target:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def make_messages(count: int, seed: int = 7) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = []
    for i in range(count):
        kind = i % 4
        if i % 25 == 24:
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": _text(rng, 40, 120)},
                        {"type": "image", "data": "iVBORw0KGgo" * 20, "mimeType": "image/png"},
                    ],
                    "timestamp": 1_700_000_000_000 + i,
                }
            )
        elif kind == 0:
            messages.append(
                {"role": "user", "content": _text(rng, 80, 400), "timestamp": 1_700_000_000_000 + i}
            )
        elif kind == 1:
            messages.append(
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": _text(rng, 40, 200)},
                        {"type": "text", "text": _text(rng, 60, 300)},
                        {
                            "type": "toolCall",
                            "id": f"call-{i}",
                            "name": rng.choice(["exec", "read", "write", "search"]),
                            "arguments": {"command": _text(rng, 10, 60), "timeout": 30},
                        },
                    ],
                    "api": "openai-codex-responses",
                    "provider": "openai",
                    "model": "gpt-5.4-codex",
                    "usage": {"input": 100, "output": 20, "cacheRead": 0, "cacheWrite": 0},
                    "stopReason": "toolUse",
                    "timestamp": 1_700_000_000_000 + i,
                }
            )
        elif kind == 2:
            messages.append(
                {
                    "role": "toolResult",
                    "toolCallId": f"call-{i - 1}",
                    "toolName": "exec",
                    "content": [{"type": "text", "text": _text(rng, 100, 600)}],
                    "isError": False,
                    "timestamp": 1_700_000_000_000 + i,
                }
            )
        else:
            messages.append(
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": _text(rng, 60, 300)}],
                    "stopReason": "stop",
                    "timestamp": 1_700_000_000_000 + i,
                }
            )
    return messages


def _project(messages: list[dict[str, Any]], budget: int | None) -> str:
    return project_context_engine_assembly(
        assembled_messages=messages,
        original_history_messages=messages,
        prompt="what changed since yesterday?",
        system_prompt_addition="memory recall",
        token_budget=budget,
    ).prompt_text


def measure(
    messages: list[dict[str, Any]], budget: int | None, repeats: int
) -> tuple[float, float]:
    """(best wall ms, peak traced MiB) of one projection."""
    _project(messages, budget)  # warm up
    times = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            _project(messages, budget)
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    tracemalloc.start()
    _project(messages, budget)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return min(times) * 1000, peak / (1024 * 1024)


def main() -> None:
    sizes = (1_000, 10_000) if "--quick" in sys.argv else (1_000, 10_000, 100_000)
    print(f"python {sys.version.split()[0]}; best of N runs; peak = tracemalloc peak of one run")
    for label, budget in (("default cap (24,000 chars)", None), ("budget 1M tokens", 1_000_000)):
        print(f"\n{label}")
        print(f"{'messages':>9} {'input MiB':>10} {'ms':>9} {'us/msg':>8} {'peak MiB':>9}")
        per_message = {}
        for size in sizes:
            messages = make_messages(size)
            text_mib = sum(len(str(m.get("content"))) for m in messages) / (1024 * 1024)
            repeats = 20 if size <= 10_000 else 5
            ms, peak = measure(messages, budget, repeats)
            per_message[size] = ms * 1000 / size
            print(f"{size:>9} {text_mib:>10.1f} {ms:>9.2f} {per_message[size]:>8.2f} {peak:>9.2f}")
        ratio = per_message[sizes[-1]] / per_message[sizes[0]]
        verdict = "linear" if ratio <= 2.0 else "NOT linear"
        print(f"time per message {sizes[-1]} vs {sizes[0]}: x{ratio:.2f} -> {verdict}")
    print("\ntarget: <= 25 ms for 10k messages of typical size")


if __name__ == "__main__":
    main()
