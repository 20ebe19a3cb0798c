"""Benchmark: projecting 1k / 10k / 100k mixed assembled messages for one Codex turn.

Run: ``.venv/bin/python benchmarks/bench_projection.py`` (``--quick`` skips 100k).

The corpus is deterministic (a seeded ``random.Random``) and "typical": user text of a few
hundred characters, assistant turns with thinking, text and a tool call, tool results with a
few hundred characters of output, and an image every 25 messages. For each size it prints the
best-of-N wall time and the peak traced memory of one projection (``tracemalloc`` runs in a
separate pass, because tracing slows allocation down), for the default cap (no budget, 24,000
characters) and a large budget (1M tokens: 1,000,000 characters, nothing or little cut).
Finally it checks that the cost grows linearly: time per message at 100k within 2x of 1k.

The structured projection (``--items`` runs only this part) converts the same corpus (less
the tool results whose call an image replaced, as ``bench_inject.Conversation`` does) into
Responses items at 1k and 10k messages, plain dicts and deeply frozen ones (what the harness's
transcript cache and the SQLite engine hand over): best-of-N wall time of
``convert_messages`` + ``check_items`` from scratch, through a cold
:class:`~codex_turn.projection.items.ConversionCache`, and through a warm one after the
assembly grew by one turn (the prompt and the reply: 2 messages); then ``newest_items`` at the
default cap. Goal: a warm cached turn <= 2 ms at 1k messages.
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

from codex_turn.frozen import freeze
from codex_turn.projection import project_context_engine_assembly
from codex_turn.projection.budget import DEFAULT_MAX_RENDERED_CONTEXT_CHARS
from codex_turn.projection.items import (
    ConversionCache,
    ConvertedItems,
    check_items,
    convert_messages,
    newest_items,
)

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


def sound_messages(count: int) -> list[dict[str, Any]]:
    """:func:`make_messages` less the tool results whose call an image replaced."""
    messages = make_messages(count)
    calls = {
        part.get("id")
        for m in messages
        if m["role"] == "assistant" and isinstance(m["content"], list)
        for part in m["content"]
    }
    return [m for m in messages if m["role"] != "toolResult" or m["toolCallId"] in calls]


def _best_ms(run: Any, repeats: int) -> float:
    """Best wall time of ``run()`` (which times itself and returns seconds), GC off."""
    times = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            times.append(run())
    finally:
        gc.enable()
    return min(times) * 1000


def _timed(action: Any) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def measure_items(messages: list[Any], repeats: int) -> dict[str, float]:
    """ms per conversion (+ check) from scratch, through a cold cache, through a warm one
    after the assembly grew by a turn, and of the cut at the default cap."""
    prompt, policy = "what changed since yesterday?", "shape-only"
    turn = [
        {"role": "user", "content": "PROMPT_1"},
        {"role": "assistant", "content": [{"type": "text", "text": "ECHO: PROMPT_1"}]},
    ]
    if type(messages[0]) is not dict:
        turn = [freeze(m) for m in turn]
    grown = [*messages, *turn]

    def scratch() -> None:
        converted = convert_messages(grown, prompt=prompt, payload_policy=policy)
        assert isinstance(converted, ConvertedItems)
        assert check_items(converted.items) is None

    def through(cache: ConversionCache, assembly: list[Any]) -> None:
        converted = convert_messages(assembly, prompt=prompt, payload_policy=policy, cache=cache)
        assert isinstance(converted, ConvertedItems)
        assert check_items(converted.items, cache=cache) is None

    def warm() -> float:
        cache = ConversionCache()
        through(cache, messages)  # the previous turn, not timed
        return _timed(lambda: through(cache, grown))

    converted = convert_messages(grown, prompt=prompt, payload_policy=policy)
    assert isinstance(converted, ConvertedItems)
    return {
        "scratch": _best_ms(lambda: _timed(scratch), repeats),
        "cold": _best_ms(lambda: _timed(lambda: through(ConversionCache(), grown)), repeats),
        "warm": _best_ms(warm, repeats),
        "cut": _best_ms(
            lambda: _timed(lambda: newest_items(converted, DEFAULT_MAX_RENDERED_CONTEXT_CHARS)),
            repeats,
        ),
    }


def main_items() -> None:
    print("\nstructured projection: convert_messages + check_items (shape-only), best of N ms")
    header = ("messages", "form", "items", "scratch", "cold cache", "warm +2", "cut")
    print(f"{header[0]:>9} {header[1]:>7} {header[2]:>7} {header[3]:>9} {header[4]:>11}", end="")
    print(f" {header[5]:>9} {header[6]:>7}")
    for size in (1_000, 10_000):
        base = sound_messages(size)
        for form in ("plain", "frozen"):
            messages = base if form == "plain" else [freeze(m) for m in base]
            converted = convert_messages(messages, payload_policy="shape-only")
            assert isinstance(converted, ConvertedItems)
            ms = measure_items(messages, 20 if size <= 1_000 else 5)
            print(f"{len(messages):>9} {form:>7} {len(converted.items):>7}", end="")
            print(f" {ms['scratch']:>9.2f} {ms['cold']:>11.2f} {ms['warm']:>9.2f}", end="")
            print(f" {ms['cut']:>7.2f}")
    print("goal: a warm cached turn <= 2 ms at 1k messages")


def main() -> None:
    if "--items" in sys.argv:
        main_items()
        return
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
    main_items()


if __name__ == "__main__":
    main()
