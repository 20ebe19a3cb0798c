"""Session transcript figures: cold read, incremental re-read, mirror append latency.

    .venv/bin/python benchmarks/bench_session.py [--entries 100000] [--turns 30]

* cold read: parse + context of an N-entry transcript (cache cleared first);
* re-read after appending one turn: must not grow with the file, so it is shown for 10k and
  100k entries;
* mirror append: one ``mirror_turn`` of four messages, including both locks and the fsync;
* many sessions: the re-read of a 10k-entry session after appending one turn when 1, 32 or
  1,000 other sessions were read in between (the byte ceiling, not a count, decides what
  stays cached), with the bytes accounted and the ceiling;
* cold read of a ``--stream-mb`` transcript in a worker thread, longest event-loop block
  seen by a 1 ms ticker: the cached read (``load_session_context``) against the streaming
  read (``iter_session_messages``, chunks consumed and dropped as an engine's import would).
* the whole-turn session lease (what every turn and compaction pays on top of its work):
  take + release of an uncontended lease from the event loop (two worker-thread hops, the
  lock file created and removed), one background renewal, and a ``mirror_turn`` under a held
  lease against one that takes the lock file itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.to_thread
import structlog

from codex_turn.harness.session import (
    clear_session_cache,
    iter_session_messages,
    load_session_context,
    load_session_messages,
    mirror_turn,
    session_cache_limit,
    session_cache_usage,
)

SCOPE = "codex-app-server:bench-thread"


def _turn(index: int) -> tuple[list[dict[str, object]], list[str]]:
    ts = 1_774_000_000_000 + index
    usage = {"input": 1200, "output": 300, "cacheRead": 0, "cacheWrite": 0, "totalTokens": 1500}
    assistant = {
        "api": "openai-codex-responses",
        "provider": "openai",
        "model": "gpt-5.5",
        "usage": usage,
        "stopReason": "stop",
        "timestamp": ts,
    }
    messages: list[dict[str, object]] = [
        {"role": "user", "content": f"please look at item {index} " + "x" * 120, "timestamp": ts},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Codex reasoning:\n" + "r" * 200}],
            **assistant,
        },
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Codex plan:\n" + "p" * 80}],
            **assistant,
        },
        {
            "role": "assistant",
            "content": [{"type": "text", "text": f"done with {index} " + "a" * 300}],
            **assistant,
        },
    ]
    kinds = ("prompt", "reasoning", "plan", "assistant")
    return messages, [f"turn-{index}:{kind}" for kind in kinds]


def _build(path: Path, entries: int) -> None:
    """Write a transcript of ``entries`` message entries, chained, as the mirror would."""
    header = {
        "type": "session",
        "version": 3,
        "id": "bench",
        "timestamp": "2026-04-24T00:00:00.000Z",
        "cwd": "/",
    }
    with path.open("w", encoding="utf-8") as handle:
        handle.write(json.dumps(header, separators=(",", ":")) + "\n")
        parent = None
        for index in range(entries // 4):
            messages, identities = _turn(index)
            for message, identity in zip(messages, identities, strict=True):
                entry_id = f"{index:06x}{identity[-2:]}"
                body = {**message, "idempotencyKey": f"{SCOPE}:{identity}"}
                entry = {
                    "type": "message",
                    "id": entry_id,
                    "parentId": parent,
                    "timestamp": "2026-04-24T00:00:01.000Z",
                    "message": body,
                }
                handle.write(json.dumps(entry, separators=(",", ":"), ensure_ascii=False) + "\n")
                parent = entry_id


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:8.2f} ms"


def bench_many(directory: Path, turns: int, others_entries: int) -> None:
    target = directory / "target.jsonl"
    _build(target, 10_000)
    others = []
    for n in range(1000):
        other = directory / f"other{n}.jsonl"
        _build(other, others_entries)
        others.append(other)
    print(
        f"\nmany sessions: re-read of a 10k-entry session after one turn, others of "
        f"{others_entries} entries read in between "
        f"(ceiling {session_cache_limit() / 2**20:.0f} MiB)"
    )
    base = 10_000 // 4 + 10_000
    for count in (1, 32, 1000):
        clear_session_cache()
        gc.collect()
        load_session_messages(target)
        samples = []
        for _ in range(turns):
            for other in others[:count]:
                load_session_messages(other)
            messages, identities = _turn(base)
            base += 1
            mirror_turn(
                target, messages, scope=SCOPE, identities=identities, session_id="b", cwd="/"
            )
            samples.append(_time(lambda: load_session_messages(target)))
        print(
            f"  {count:>5} others: re-read {_ms(statistics.median(samples))} (median), "
            f"accounted {session_cache_usage() / 2**20:6.1f} MiB"
        )


async def _watched(fn: Callable[[], object]) -> tuple[float, float]:
    worst = 0.0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal worst
        while not done.is_set():
            started = time.perf_counter()
            await anyio.sleep(0.001)
            worst = max(worst, time.perf_counter() - started - 0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        started = time.perf_counter()
        await anyio.to_thread.run_sync(fn)
        elapsed = time.perf_counter() - started
        done.set()
    return elapsed, worst


def bench_stream(directory: Path, megabytes: float) -> None:
    from bench_engine import write_transcript  # the engine benchmark's realistic transcript

    path = directory / "big.jsonl"
    count = write_transcript(path, int(megabytes * 1e6))
    print(f"\ncold read of a {megabytes:.0f} MB transcript ({count:,} messages) in a worker")

    def cached() -> None:
        messages = load_session_context(path).messages
        for message in messages:  # what an import does with each: encode it
            json.dumps(message)

    def streamed() -> None:
        for chunk in iter_session_messages(path, 1024):
            for message in chunk:
                json.dumps(message)

    for name, fn in (
        ("load_session_context (cached)", cached),
        ("iter_session_messages", streamed),
    ):
        clear_session_cache()
        gc.collect()
        before = len(gc.get_objects())
        elapsed, worst = anyio.run(_watched, fn)
        gc.collect()
        retained = len(gc.get_objects()) - before
        print(
            f"  {name:<31} {_ms(elapsed)}  longest loop block {_ms(worst).strip()}  "
            f"GC-tracked objects retained {retained:,}"
        )
    clear_session_cache()


def bench_lease(directory: Path, turns: int) -> None:
    from codex_turn.harness._gates import hold_session
    from codex_turn.harness.session import _lease

    path = directory / "lease.jsonl"
    rounds = max(turns, 50)

    async def take_release() -> list[float]:
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            async with hold_session(path):
                pass
            times.append(time.perf_counter() - start)
        return times

    held = sorted(anyio.run(take_release))
    lease = _lease.try_acquire_lease(path)
    assert isinstance(lease, _lease.SessionLease)
    renewals = []
    under_lease = []
    for turn in range(rounds):
        start = time.perf_counter()
        _lease._renew(lease)
        renewals.append(time.perf_counter() - start)
        messages, identities = _turn(turn)
        under_lease.append(
            _time(
                lambda m=messages, i=identities: mirror_turn(
                    path, m, scope=SCOPE, identities=i, session_id="bench", cwd="/"
                )
            )
        )
    _lease.release_lease(lease)
    alone = []
    for turn in range(rounds, 2 * rounds):
        messages, identities = _turn(turn)
        alone.append(
            _time(
                lambda m=messages, i=identities: mirror_turn(
                    path, m, scope=SCOPE, identities=i, session_id="bench", cwd="/"
                )
            )
        )
    print(f"\nsession lease ({rounds} rounds, medians)")
    print(
        f"  take + release, from the loop     {_ms(statistics.median(held))}   "
        f"(p90 {_ms(held[int(len(held) * 0.9)]).strip()})"
    )
    print(f"  one renewal (background thread)   {_ms(statistics.median(renewals))}")
    print(f"  mirror_turn under the lease       {_ms(statistics.median(under_lease))}")
    print(f"  mirror_turn taking the lock file  {_ms(statistics.median(alone))}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--others-entries", type=int, default=40)
    parser.add_argument("--stream-mb", type=float, default=30.0)
    parser.add_argument("--only", choices=("basic", "many", "stream", "lease"), default=None)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as directory:
        if args.only in (None, "many"):
            bench_many(Path(directory), min(args.turns, 10), args.others_entries)
        if args.only in (None, "stream"):
            bench_stream(Path(directory), args.stream_mb)
        if args.only in (None, "lease"):
            bench_lease(Path(directory), args.turns)
        if args.only in ("many", "stream", "lease"):
            return
        print(f"session transcript benchmark (python, {args.turns} turns per figure)")
        for entries in sorted({10_000, args.entries}):
            path = Path(directory) / f"s{entries}.jsonl"
            _build(path, entries)
            size_mb = path.stat().st_size / 1e6
            colds = []
            for _ in range(3):
                clear_session_cache()
                colds.append(_time(lambda p=path: load_session_messages(p)))
            cold = statistics.median(colds)
            unchanged = statistics.median(
                _time(lambda p=path: load_session_messages(p)) for _ in range(args.turns)
            )
            appends: list[float] = []
            rereads: list[float] = []
            base = entries // 4
            for turn in range(args.turns):
                messages, identities = _turn(base + turn)
                appends.append(
                    _time(
                        lambda m=messages, i=identities, p=path: mirror_turn(
                            p, m, scope=SCOPE, identities=i, session_id="bench", cwd="/"
                        )
                    )
                )
                rereads.append(_time(lambda p=path: load_session_messages(p)))
            count = len(load_session_messages(path))
            assert count == entries + 4 * args.turns, count
            appends.sort()
            print(f"\n{entries:>7} entries ({size_mb:.1f} MB)")
            print(f"  cold read (parse + context)       {_ms(cold)}   ({size_mb / cold:.0f} MB/s)")
            print(f"  re-read, file unchanged           {_ms(unchanged)}   (median)")
            print(
                f"  re-read after appending one turn  {_ms(statistics.median(rereads))}   (median)"
            )
            print(
                f"  mirror_turn (4 msgs, locks+fsync) {_ms(statistics.median(appends))}   "
                f"(median; p90 {_ms(appends[int(len(appends) * 0.9)]).strip()})"
            )


if __name__ == "__main__":
    main()
