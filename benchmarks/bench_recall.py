"""The reference engine's recall tools: grep latency over a large store, and the recall figure.

    .venv/bin/python benchmarks/bench_recall.py [--messages 100000] [--runs 50]

* **grep**: median and p95 of ``recall_grep`` over one session of ``--messages`` stored
  messages (varied words, a few rare ones), for a rare word (one hit), a common word (the
  newest 20 of tens of thousands), two words (AND) and any of three (OR); measured at the
  store (``_recall.grep``) and as the model calls it (``call_tool``: the worker-thread hop and
  the JSON answer included). Goal: <= 20 ms.
* **recall**: on the shared real transcripts (``tests/fixtures/sessions``) compacted to 10% of
  their size, the share of user messages (and of all messages with words) that recall_grep
  finds and recall_expand returns byte for byte. Goal: 100%.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from codex_turn.engines import EngineSettings, SqliteContextEngine, _recall
from codex_turn.engines._messages import encode, search_text
from codex_turn.harness.engine import (
    AfterTurnParams,
    BootstrapParams,
    CompactParams,
    ToolCallParams,
)
from codex_turn.harness.runtime_context import strip_runtime_context_messages
from codex_turn.harness.session import load_session_messages

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "sessions"
WORDS = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "at",
    "by",
    "this",
    "be",
    "from",
    "or",
    "have",
    "an",
    "are",
    "not",
    "file",
    "code",
    "test",
    "error",
    "value",
    "function",
    "return",
    "line",
    "data",
    "user",
    "model",
    "run",
    "build",
    "change",
    "fix",
    "check",
    "path",
    "import",
    "module",
    "class",
    "result",
    "list",
    "string",
    "number",
    "config",
]
SMALL = EngineSettings(
    fresh_tail_count=2,
    fresh_tail_max_fraction=0.1,
    leaf_chunk_tokens=1_000,
    min_leaf_chunk_tokens=10,
    leaf_fanout=2,
    condensed_fanout=2,
)


def message(index: int, rng: random.Random) -> dict[str, Any]:
    words = " ".join(rng.choice(WORDS) for _ in range(30))
    rare = f" rareword{index}" if index % 1000 == 7 else ""
    role = "user" if index % 2 == 0 else "assistant"
    text = f"{words} item{index}{rare}"
    content: Any = text if role == "user" else [{"type": "text", "text": text}]
    return {"role": role, "content": content, "timestamp": 1_000 * index}


async def timed(call: Callable[[], Awaitable[Any]], runs: int) -> tuple[float, float]:
    times: list[float] = []
    for _ in range(runs):
        start = time.perf_counter()
        await call()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.95) - 1]


async def bench_grep(count: int, runs: int) -> None:
    rng = random.Random(7)
    with tempfile.TemporaryDirectory() as directory:
        engine = SqliteContextEngine(Path(directory) / "c.sqlite")
        messages: list[dict[str, Any]] = []
        started = time.perf_counter()
        for index in range(count):
            messages.append(message(index, rng))
        await engine.after_turn(
            AfterTurnParams(
                session_id="s", session_file="", messages=messages, pre_prompt_message_count=0
            )
        )
        print(f"stored {count} messages in {time.perf_counter() - started:.1f} s")
        pool = engine._access.require()
        queries = {
            "rare word (1 hit)": ("rareword50007", False),
            "common word (newest 20)": ("function", False),
            "two words (AND)": ("function error", False),
            "any of three (OR)": ("rareword7 rareword1007 zzz", True),
        }
        print(f"grep over {count} stored messages, median / p95 of {runs} (goal <= 20 ms)")
        for label, (query, any_word) in queries.items():
            store = await timed(
                lambda q=query, a=any_word: anyio.to_thread.run_sync(
                    lambda: _recall.grep(pool, "s", q, any_word=a)
                ),
                runs,
            )
            tool = await timed(
                lambda q=query, a=any_word: engine.call_tool(
                    ToolCallParams(
                        session_id="s", name="recall_grep", arguments={"query": q, "any": a}
                    )
                ),
                runs,
            )
            hits = len(_recall.grep(pool, "s", query, any_word=any_word))
            print(
                f"  {label:<26} store {store[0]:6.2f} / {store[1]:6.2f} ms"
                f"   tool {tool[0]:6.2f} / {tool[1]:6.2f} ms   ({hits} hits)"
            )
        engine.close()


async def recall_figure() -> None:
    users = reached_users = every = reached = 0
    for transcript in sorted(FIXTURES.glob("*.jsonl")):
        with tempfile.TemporaryDirectory() as directory:
            engine = SqliteContextEngine(Path(directory) / "c.sqlite", settings=SMALL)
            await engine.bootstrap(BootstrapParams(session_id="s", session_file=str(transcript)))
            messages = strip_runtime_context_messages(load_session_messages(transcript))
            with sqlite3.connect(engine.path) as conn:
                (size,) = conn.execute("SELECT context_tokens FROM conversations").fetchone()
            budget = max(200, size // 10)
            await engine.compact(
                CompactParams(session_id="s", session_file="", token_budget=budget, force=True)
            )
            with sqlite3.connect(engine.path) as conn:
                (after,) = conn.execute("SELECT context_tokens FROM conversations").fetchone()
            found_here = 0
            searchable = 0
            for seq, stored in enumerate(messages):
                words = sorted(set(_recall._WORD.findall(search_text(stored))), key=len)[-8:]
                if not words:
                    continue
                searchable += 1
                answer = await engine.call_tool(
                    ToolCallParams(
                        session_id="s",
                        name="recall_grep",
                        arguments={"query": " ".join(words), "limit": 50},
                    )
                )
                hits = [h for h in json.loads(answer.text)["hits"] if h.get("seq") == seq]
                ok = False
                if hits:
                    behind = _recall.expand(engine._access.require(), "s", hits[0]["expand"])
                    ok = any(
                        m.seq == seq and m.raw == encode(stored)[1].decode() for m in behind or []
                    )
                found_here += ok
                if stored.get("role") == "user":
                    users += 1
                    reached_users += ok
            every += searchable
            reached += found_here
            print(
                f"  {transcript.name[-14:-6]}: {len(messages)} messages, context {size} -> "
                f"{after} tokens (budget {budget}); {found_here}/{searchable} reached"
            )
            engine.close()
    print(
        f"recall after compaction to 10%: user messages {reached_users}/{users} "
        f"({100 * reached_users / max(users, 1):.0f}%), all messages with words "
        f"{reached}/{every} ({100 * reached / max(every, 1):.0f}%)   goal 100%"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=50)
    options = parser.parse_args()
    await bench_grep(options.messages, options.runs)
    await recall_figure()


if __name__ == "__main__":
    anyio.run(main)
