"""SqliteContextEngine's bootstrap: a transcript streamed in batches, nothing of it kept.

* **Same store**: a bootstrap in batches of 1, 3, 7 or 2000 messages gives exactly the store the
  whole-path sync gives (ids, order, contents, tokens, context items, checkpoint), and the
  ids are the path's (digest and occurrence), for transcripts with branches, a compaction,
  a branch summary, tool calls, runtime-context messages and repeated timestamp-less
  messages, and for the real transcripts in ``tests/fixtures/sessions``; the same
  through a sequence of appends, a branch, a compaction and a shorter rewrite, cold or
  with the transcript in the read cache.
* **Nothing kept**: after a cold bootstrap of a few-MB transcript the process holds no more
  GC-tracked objects than before (the parsed transcript is not cached nor referenced), and
  the engine reaches no message; an appended transcript hashes only the new messages.
* **Crash safety**: a bootstrap SIGKILLed at random points, then retried, leaves exactly the
  store of an uninterrupted one.
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.engine_sqlite_workload import SMALL, Message

from codex_turn.engines import EngineSettings, SqliteContextEngine, _messages, _store
from codex_turn.engines._messages import digest, encode
from codex_turn.harness.engine import AfterTurnParams, BootstrapParams
from codex_turn.harness.runtime_context import (
    RUNTIME_CONTEXT_CUSTOM_TYPE,
    strip_runtime_context_messages,
)
from codex_turn.harness.session import (
    clear_session_cache,
    load_session_context,
    session_cache_usage,
)

pytestmark = pytest.mark.anyio

HUGE = 10_000_000
# The project's copy of the real OpenClaw transcripts (a missing copy fails, never skips).
FIXTURES = Path(__file__).parent / "fixtures" / "sessions"
REAL = sorted(FIXTURES.glob("*.jsonl"))
assert REAL, f"no session fixtures in {FIXTURES}"


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    clear_session_cache()
    yield
    clear_session_cache()


# --- transcripts ---------------------------------------------------------------------------


class Tree:
    """A pi v3 transcript built entry by entry; the last entry written is the leaf."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: list[dict[str, Any]] = [
            {
                "type": "session",
                "version": 3,
                "id": "tree",
                "timestamp": "2026-01-01T00:00:00.000Z",
                "cwd": "/t",
            }
        ]
        self.leaf: str | None = None
        self.count = 0

    def add(self, kind: str, parent: str | None = None, **fields: Any) -> str:
        self.count += 1
        entry_id = f"e{self.count:05d}"
        seconds = self.count % 60
        entry = {
            "type": kind,
            "id": entry_id,
            "parentId": self.leaf if parent is None else parent,
            "timestamp": f"2026-01-01T00:{self.count // 60 % 60:02d}:{seconds:02d}.000Z",
            **fields,
        }
        self.entries.append(entry)
        self.leaf = entry_id
        return entry_id

    def message(self, message: Message, parent: str | None = None) -> str:
        return self.add("message", parent, message=message)

    def turn(self, n: int, *, tools: bool = False, words: int = 8) -> str:
        text = " ".join(f"w{(n * 5 + k) % 17}" for k in range(words))
        self.message({"role": "user", "content": f"q{n} {text}", "timestamp": 1_000 + n * 10})
        if tools:
            call = f"call-{n}"
            self.message(
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": f"run {n}"},
                        {"type": "toolCall", "id": call, "name": "exec", "arguments": {"n": n}},
                    ],
                    "stopReason": "toolUse",
                    "timestamp": 1_001 + n * 10,
                }
            )
            self.message(
                {
                    "role": "toolResult",
                    "toolCallId": call,
                    "toolName": "exec",
                    "content": [{"type": "text", "text": f"out {n} {text}"}],
                    "isError": False,
                    "timestamp": 1_002 + n * 10,
                }
            )
        return self.message(
            {
                "role": "assistant",
                "content": [{"type": "text", "text": f"a{n} {text}"}],
                "stopReason": "stop",
                "timestamp": 1_009 + n * 10,
            }
        )

    def repeats(self, times: int) -> None:
        """Timestamp-less exact repeats (their ids differ only by occurrence)."""
        for _ in range(times):
            self.message({"role": "user", "content": "ok"})
            self.message({"role": "assistant", "content": [{"type": "text", "text": "ok"}]})

    def runtime_context(self) -> None:
        self.add(
            "custom_message",
            customType=RUNTIME_CONTEXT_CUSTOM_TYPE,
            content="runtime context",
            display=False,
        )

    def write(self) -> None:
        with self.path.open("w", encoding="utf-8") as out:
            for entry in self.entries:
                out.write(json.dumps(entry, separators=(",", ":")) + "\n")


def rich_tree(path: Path, turns: int = 24) -> Tree:
    """Tool calls, runtime-context messages, repeats, an abandoned branch, a branch
    summary and a compaction on the active path, then more turns after it."""
    tree = Tree(path)
    fork = kept = ""
    for n in range(turns):
        end = tree.turn(n, tools=n % 3 == 1)
        if n % 4 == 2:
            tree.runtime_context()
            tree.repeats(2)
        if n == turns // 3:
            fork = end
        if n == turns // 2:
            kept = end
    main = tree.leaf
    tree.leaf = fork  # a branch from an earlier turn, then back to where we were
    for n in range(100, 104):
        tree.turn(n, tools=n == 100, words=3)
    tree.add("branch_summary", parent=main, fromId=tree.leaf, summary="tried something else")
    tree.add("compaction", summary="earlier turns", firstKeptEntryId=kept, tokensBefore=999)
    for n in range(turns, turns + 6):
        tree.turn(n, tools=n % 2 == 0)
        tree.repeats(1)
    tree.write()
    return tree


# --- the two stores ------------------------------------------------------------------------


def path_of(transcript: Path) -> list[Message]:
    """The stripped path a bootstrap imports, read whole (the reference)."""
    messages = load_session_context(transcript).messages
    path = [dict(m) for m in strip_runtime_context_messages(messages)]
    clear_session_cache()
    return path


def expected_ids(path: list[Message]) -> list[str]:
    counts: dict[bytes, int] = {}
    out = []
    for message in path:
        value = digest(message)
        out.append(f"{value.hex()}.{counts.get(value, 0)}")
        counts[value] = counts.get(value, 0) + 1
    return out


def dump(store: SqliteContextEngine | Path, session: str = "s") -> dict[str, Any]:
    """Everything a sync writes for ``session`` (ids, order, contents, items, counters)."""
    with sqlite3.connect(store.path if isinstance(store, SqliteContextEngine) else store) as conn:
        conv = conn.execute(
            "SELECT id, uid, next_seq, next_ordinal, context_tokens, epoch, synced_len, "
            "synced_anchor FROM conversations WHERE session_key=? AND archived_at IS NULL",
            (session,),
        ).fetchone()
        rows = conn.execute(
            "SELECT seq, source_id, role, tokens, ts, calls, results, content FROM messages "
            "WHERE conversation_id=? ORDER BY seq",
            (conv[0],),
        ).fetchall()
        items = conn.execute(
            "SELECT ci.ordinal, m.source_id, ci.tokens FROM context_items ci "
            "JOIN messages m ON m.id = ci.message_id WHERE ci.conversation_id=? "
            "ORDER BY ci.ordinal",
            (conv[0],),
        ).fetchall()
    return {
        "conversation": conv[1:],
        "messages": [(*row[:7], _store.decode_content(row[7])) for row in rows],
        "items": items,
    }


async def bootstrap(engine: SqliteContextEngine, transcript: Path, *, warm: bool = False) -> int:
    clear_session_cache()
    if warm:
        load_session_context(transcript)
    params = BootstrapParams(session_id="s", session_file=str(transcript))
    return (await engine.bootstrap(params)).imported_messages


async def sync_whole(engine: SqliteContextEngine, path: list[Message]) -> None:
    """The whole-path sync (``_sync_path`` through ``after_turn``), the reference."""
    await engine.after_turn(
        AfterTurnParams(
            session_id="s",
            session_file="",
            messages=path,
            pre_prompt_message_count=len(path),
            token_budget=HUGE,
        )
    )


def chunked(tmp_path: Path, name: str, chunk: int) -> SqliteContextEngine:
    settings = EngineSettings(sync_chunk=chunk, busy_timeout_s=SMALL.busy_timeout_s)
    return SqliteContextEngine(tmp_path / f"{name}.sqlite", settings=settings)


# --- same store ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 7, 2_000])
async def test_streamed_bootstrap_gives_the_whole_path_store(tmp_path: Path, chunk: int) -> None:
    transcript = tmp_path / "t.jsonl"
    rich_tree(transcript)
    path = path_of(transcript)
    roles = {m["role"] for m in path}
    assert {"compactionSummary", "branchSummary", "toolResult"} <= roles
    assert all(m.get("customType") != RUNTIME_CONTEXT_CUSTOM_TYPE for m in path)
    reference = chunked(tmp_path, "reference", 2_000)
    await sync_whole(reference, path)
    streamed = chunked(tmp_path, "streamed", chunk)
    assert await bootstrap(streamed, transcript) == len(path)
    assert dump(streamed) == dump(reference)
    assert [row[1] for row in dump(streamed)["messages"]] == expected_ids(path)
    # Again over an unchanged path (checkpoint dropped): nothing added, nothing moved.
    with sqlite3.connect(streamed.path) as conn:
        conn.execute("UPDATE conversations SET boot_size=-1")
    assert await bootstrap(streamed, transcript) == 0
    assert dump(streamed) == dump(reference)


@pytest.mark.skipif(not REAL, reason="no session fixtures on this machine")
@pytest.mark.parametrize("transcript", REAL, ids=lambda p: p.name[-14:-6])
async def test_real_transcripts_stream_to_the_same_store(tmp_path: Path, transcript: Path) -> None:
    path = path_of(transcript)
    reference = chunked(tmp_path, "reference", 2_000)
    await sync_whole(reference, path)
    streamed = chunked(tmp_path, "streamed", 5)
    assert await bootstrap(streamed, transcript) == len(path)
    assert dump(streamed) == dump(reference)
    assert [row[1] for row in dump(streamed)["messages"]] == expected_ids(path)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "cached"])
async def test_a_changing_transcript_streams_to_the_same_store(
    tmp_path: Path, warm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Append, branch (diverging after a few batches), compact, rewrite shorter, append:
    after each version the streamed store (one engine, its index kept) equals the store of
    whole-path syncs, and a restarted engine (no index) adds nothing."""
    passes: list[tuple[bool, int]] = []  # (trusted, messages the index vouched for)
    scan = _messages.PathIndex.scan

    def spy(self: _messages.PathIndex, *, trust: bool = True) -> _messages.PathScan:
        made = scan(self, trust=trust)
        passes.append((trust, made.known))
        return made

    monkeypatch.setattr(_messages.PathIndex, "scan", spy)
    transcript = tmp_path / "t.jsonl"
    tree = Tree(tmp_path / "tree.jsonl")
    for n in range(6):
        tree.turn(n, tools=n == 2)
    tree.repeats(2)
    versions: list[Path] = []

    def snapshot() -> None:
        tree.path = tmp_path / f"v{len(versions)}.jsonl"
        tree.write()
        versions.append(tree.path)

    snapshot()
    for n in range(6, 9):  # appended
        tree.turn(n)
    snapshot()
    fork = tree.entries[12]["id"]  # a branch from entry 12: the path diverges there
    tree.message({"role": "user", "content": "other way", "timestamp": 5_000}, parent=fork)
    for n in range(20, 30):
        tree.turn(n, tools=n % 4 == 0)
    snapshot()
    first_kept = tree.entries[-6]["id"]
    tree.add("compaction", summary="so far", firstKeptEntryId=first_kept, tokensBefore=10)
    tree.turn(40)
    snapshot()
    tree.leaf = tree.entries[5]["id"]  # a short branch that keeps only the first messages
    tree.repeats(1)
    snapshot()
    tree.turn(41)
    snapshot()
    paths = [path_of(version) for version in versions]
    assert len(paths[4]) < len(paths[3]) < len(paths[2])
    assert paths[3][0]["role"] == "compactionSummary"

    streamed = chunked(tmp_path, "streamed", 3)
    reference = chunked(tmp_path, "reference", 3)
    for number, (version, path) in enumerate(zip(versions, paths, strict=True)):
        transcript.write_bytes(version.read_bytes())
        await sync_whole(reference, path)
        before = len(dump(streamed)["messages"]) if number else 0
        passes.clear()
        imported = await bootstrap(streamed, transcript, warm=warm)
        # The branch diverges after batches taken on trust: a second, untrusted pass.
        assert [trust for trust, _ in passes] == ([True, False] if number == 2 else [True])
        assert (passes[0][1] > 0) == (number > 0)
        after = dump(streamed)
        assert after == dump(reference), number
        assert imported == len(after["messages"]) - before
        held = {row[1] for row in after["messages"]}
        assert set(expected_ids(path)) <= held
    restarted = chunked(tmp_path, "streamed", 3)
    with sqlite3.connect(restarted.path) as conn:
        conn.execute("UPDATE conversations SET boot_size=-1")
    assert await bootstrap(restarted, transcript) == 0
    assert dump(restarted) == dump(reference)


# --- the path index ------------------------------------------------------------------------


def messages(count: int, tag: str = "m") -> list[Message]:
    return [{"role": "user", "content": f"{tag}{n}", "timestamp": n} for n in range(count)]


def counting_encode(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    encode = _messages.encode

    def spy(message: Any) -> tuple[bytes, bytes]:
        calls[0] += 1
        return encode(message)

    monkeypatch.setattr(_messages, "encode", spy)
    return calls


def test_path_index_keeps_no_message_and_hashes_only_what_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    index = _messages.PathIndex()
    path = messages(100)
    assert index.plan(path, 0, None) == (0, expected_ids(path))
    referents = gc.get_referents(*(getattr(index, slot) for slot in index.__slots__))
    assert not any(isinstance(value, dict) and "role" in value for value in referents)
    calls = counting_encode(monkeypatch)
    # Fresh copies of the same path plus two messages: the first and last known messages
    # are checked, the two new ones hashed; nothing else.
    longer = [dict(m) for m in path] + messages(2, "new")
    changed = longer[:61] + messages(50, "other")
    want = {name: expected_ids(p) for name, p in [("longer", longer), ("changed", changed)]}
    calls[0] = 0
    start, ids = index.plan(longer, 100, want["longer"][99])
    assert (start, ids, calls[0]) == (100, want["longer"][100:], 4)
    # A path that changed after message 60: found by bisection, the rest re-hashed.
    calls[0] = 0
    assert index.range(changed, 0) == want["changed"]
    assert calls[0] < 2 + 8 + 50
    # Shorter, and a prefix of what it knew: nothing to hash beyond the two checks.
    calls[0] = 0
    assert index.range(changed[:30], 0) == want["changed"][:30]
    assert (len(index), calls[0]) == (30, 2)


def test_path_scan_vouches_checks_and_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    index = _messages.PathIndex()
    path = messages(20) + [{"role": "user", "content": "ok"}] * 3
    want = expected_ids(path)
    scan = index.scan()
    assert scan.known == 0
    got = [scan.feed(path[i : i + 4]) for i in range(0, len(path), 4)]
    scan.finish()
    assert [i for fed in got if fed for i in fed[1]] == want
    other = messages(9, "x")
    changed = other[:3] + messages(6, "y")
    want_other, want_changed = expected_ids(other), expected_ids(changed)
    calls = counting_encode(monkeypatch)
    # The same path again: one check per batch (and the first message), nothing else; the
    # ids the store's checkpoint covers are not even made.
    scan = index.scan()
    assert (scan.known, scan.vouch(23, "elsewhere"), scan.vouch(21, want[20])) == (23, 0, 21)
    fed = [scan.feed(path[i : i + 5]) for i in range(0, len(path), 5)]
    assert [f[0] if f else None for f in fed] == [5, 5, 5, 5, 1]
    assert [i for f in fed if f for i in f[1]] == want[21:]
    assert (scan.last_id(), calls[0]) == (want[22], 5 + 1)
    scan = index.scan()
    fed = [scan.feed(path[i : i + 5]) for i in range(0, len(path), 5)]
    assert [i for f in fed if f for i in f[1]] == want
    assert all(stored == [None] * len(ids) for _, ids, stored in filter(None, fed))
    # A shorter path that agrees: the index ends where it ended.
    scan = index.scan()
    assert scan.feed(path[:7]) is not None
    scan.finish()
    assert len(index) == 7
    # The first batch disagrees: nothing was vouched for yet, the index is dropped.
    scan = index.scan()
    assert scan.vouch(7, want[6]) == 7
    fed = scan.feed(other[:3])
    assert fed is not None
    assert (fed[:2], scan.known, scan.vouched) == ((0, want_other[:3]), 0, 0)
    assert scan.feed(other[3:]) is not None
    scan.finish()
    # A later batch disagrees: earlier ones were taken on trust, start over untrusted.
    scan = index.scan()
    assert scan.feed(other[:3]) is not None
    assert scan.feed(changed[3:6]) is None
    scan = index.scan(trust=False)
    assert scan.known == 0
    parts = (changed[:5], changed[5:])
    assert [i for part in parts for i in (scan.feed(part) or (0, [], []))[1]] == want_changed


# --- nothing kept --------------------------------------------------------------------------


def big_tree(path: Path, turns: int) -> Tree:
    tree = Tree(path)
    for n in range(turns):
        tree.turn(n, tools=n % 3 == 1, words=120)
    tree.write()
    return tree


def message_dicts() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, dict) and "role" in o)


async def test_a_cold_bootstrap_keeps_nothing_of_the_transcript(tmp_path: Path) -> None:
    transcript = tmp_path / "big.jsonl"
    big_tree(transcript, 1_500)
    assert transcript.stat().st_size > 2_000_000
    engine = chunked(tmp_path, "store", 500)
    # Open the store and run every code path once, so what is measured is the big one.
    small = Tree(tmp_path / "small.jsonl")
    small.turn(0, tools=True)
    small.write()
    await engine.bootstrap(BootstrapParams(session_id="warm-up", session_file=str(small.path)))
    clear_session_cache()
    gc.collect()
    before, dicts = len(gc.get_objects()), message_dicts()
    imported = await bootstrap(engine, transcript)
    gc.collect()
    assert imported == 4_000
    # The parsed transcript would be tens of thousands of objects (> 4 per message).
    assert len(gc.get_objects()) - before < 500
    assert message_dicts() == dicts
    assert session_cache_usage() == 0  # and the read cache was not filled either
    assert len(engine._paths["s"]) == imported  # its ids are known, by digest only


async def test_an_appended_transcript_hashes_only_what_is_new(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = Tree(tmp_path / "t.jsonl")
    for n in range(300):
        tree.turn(n, tools=n % 5 == 0)
    tree.write()
    engine = chunked(tmp_path, "store", 50)
    assert await bootstrap(engine, tree.path) == 720
    tree.turn(300)
    tree.turn(301, tools=True)
    tree.write()
    reference = chunked(tmp_path, "reference", 50)
    await sync_whole(reference, path_of(tree.path))
    calls = counting_encode(monkeypatch)
    assert await bootstrap(engine, tree.path) == 6
    # The six new messages, one check per batch of the known path and the first message.
    assert calls[0] <= 6 + 726 // 50 + 1 + 1
    assert dump(engine) == dump(reference)


# --- crash safety --------------------------------------------------------------------------

CHILD = """
import sys, anyio
from codex_turn.engines import EngineSettings, SqliteContextEngine
from codex_turn.harness.engine import BootstrapParams
engine = SqliteContextEngine(sys.argv[1], settings=EngineSettings(sync_chunk=int(sys.argv[3])))
print("ready", flush=True)
anyio.run(engine.bootstrap, BootstrapParams(session_id="s", session_file=sys.argv[2]))
print("done", flush=True)
"""


def held(store: Path) -> int:
    try:
        with sqlite3.connect(store) as conn:
            return int(conn.execute("SELECT count(*) FROM messages").fetchone()[0])
    except sqlite3.OperationalError:
        return 0  # not created yet


def run_child(store: Path, transcript: Path, kill: random.Random | None) -> bool:
    """A bootstrap in a child process; with ``kill``, SIGKILLed a random few ms after its
    first transaction. Returns whether it finished."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(store), str(transcript), "40"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    if kill is not None:
        start = held(store)
        deadline = time.monotonic() + 60
        while child.poll() is None and held(store) == start and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(kill.uniform(0.0, 0.03))
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
    return "done" in child.communicate(timeout=120)[0]


def test_a_sigkilled_bootstrap_then_a_retry_gives_the_uninterrupted_store(tmp_path: Path) -> None:
    transcript = tmp_path / "t.jsonl"
    big_tree(transcript, 1_200)
    reference = tmp_path / "reference.sqlite"
    assert run_child(reference, transcript, None)
    store = tmp_path / "crash.sqlite"
    rng = random.Random(12)
    inside = 0
    for _ in range(6):
        if run_child(store, transcript, rng):
            break
        with sqlite3.connect(store) as conn:
            booted = conn.execute("SELECT boot_path FROM conversations").fetchone()[0]
        inside += booted is None  # killed between its first and its last batch
    assert inside >= 1
    assert run_child(store, transcript, None)
    assert dump(store) == dump(reference)
    with sqlite3.connect(store) as conn:
        doubles = conn.execute(
            "SELECT count(*) FROM (SELECT source_id FROM messages GROUP BY conversation_id, "
            "source_id HAVING count(*) > 1)"
        ).fetchone()[0]
    assert doubles == 0


def test_the_store_encoding_refuses_a_non_json_number() -> None:
    # A stored message is its canonical JSON; NaN and the infinities have none.
    for number in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="not JSON compliant"):
            encode({"role": "user", "content": "x", "score": number})
        with pytest.raises(ValueError, match="not JSON compliant"):
            encode({"role": "user", "content": "x", "idempotencyKey": number})
