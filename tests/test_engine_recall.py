"""The reference engine's recall tools, called as the model calls them (``call_tool``, JSON
answers): on the shared real transcripts compacted to 10% of their size every message is
reached through grep then expand, byte for byte; expansion pages stay exact; describe says what
a summary covers; the scope is the session key's (archived conversations of a reset included,
other sessions never); the full-text index follows every ingestion path in the store's own
transactions, and a version-2 store is indexed when it is migrated."""

from __future__ import annotations

import json
import random
import sqlite3
from pathlib import Path
from typing import Any

import attrs
import pytest
from support.transcripts import FIXTURES

from codex_turn.engines import EngineSettings, SqliteContextEngine
from codex_turn.engines._messages import encode, search_text
from codex_turn.engines._recall import _WORD, PAGE_CHARS
from codex_turn.harness.engine import (
    AfterTurnParams,
    BootstrapParams,
    CompactParams,
    IngestBatchParams,
    IngestParams,
    MaintainParams,
    ToolCallParams,
    ToolsParams,
)
from codex_turn.harness.runtime_context import strip_runtime_context_messages
from codex_turn.harness.session import load_session_messages

pytestmark = pytest.mark.anyio

REAL = sorted(FIXTURES.glob("*.jsonl"))
SMALL = EngineSettings(
    fresh_tail_count=2,
    fresh_tail_max_fraction=0.1,
    leaf_chunk_tokens=1_000,
    min_leaf_chunk_tokens=10,
    leaf_fanout=2,
    condensed_fanout=2,
)


async def call(engine: SqliteContextEngine, name: str, key: str = "s", **args: Any) -> Any:
    answer = await engine.call_tool(ToolCallParams(session_id=key, name=name, arguments=args))
    assert answer.success, answer.text
    return json.loads(answer.text)


async def expanded(engine: SqliteContextEngine, ref: str, key: str = "s") -> dict[int, str]:
    """Every message behind ``ref``, by seq, its pages and parts put together."""
    out: dict[int, str] = {}
    cursor: str | None = None
    while True:
        args: dict[str, Any] = {"id": ref} if cursor is None else {"id": ref, "cursor": cursor}
        page = await call(engine, "recall_expand", key, **args)
        for entry in page["messages"]:
            out[entry["seq"]] = out.get(entry["seq"], "") + entry["json"]
        cursor = page["cursor"]
        if cursor is None:
            return out


def turns(count: int, *, start: int = 0, word: str = "zebra") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(start, start + count):
        out.append({"role": "user", "content": f"ask {i} about {word}{i}", "timestamp": i * 10})
        out.append(
            {
                "role": "assistant",
                "content": [{"type": "text", "text": f"reply {i}: stripes{i} " + "la " * 40}],
                "timestamp": i * 10 + 1,
            }
        )
    return out


async def stored(engine: SqliteContextEngine, key: str, messages: list[dict[str, Any]]) -> None:
    await engine.after_turn(
        AfterTurnParams(
            session_id=key, session_file="", messages=messages, pre_prompt_message_count=0
        )
    )


@pytest.mark.parametrize("transcript", REAL, ids=lambda p: p.name[-14:-6])
async def test_every_message_of_a_real_transcript_is_reached_by_grep_then_expand(
    tmp_path: Path, transcript: Path
) -> None:
    engine = SqliteContextEngine(tmp_path / "c.sqlite", settings=SMALL)
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
        summaries = conn.execute("SELECT count(*) FROM summaries").fetchone()[0]
    assert size < budget or (after < size and summaries > 0)
    reached = 0
    searchable = [(seq, m) for seq, m in enumerate(messages) if _WORD.search(search_text(m))]
    for seq, message in searchable:
        words = sorted(set(_WORD.findall(search_text(message))), key=len, reverse=True)[:8]
        hits = (await call(engine, "recall_grep", query=" ".join(words), limit=50))["hits"]
        target = next(hit["expand"] for hit in hits if hit.get("seq") == seq)
        # The original bytes: the message as the store holds it, whole.
        assert (await expanded(engine, target))[seq] == encode(message)[1].decode()
        reached += 1
    assert reached == len(searchable)
    users = [m for m in messages if m.get("role") == "user"]
    assert users
    assert all(any(m is s for _, s in searchable) for m in users)


async def test_expansion_pages_put_together_are_the_stored_bytes(tmp_path: Path) -> None:
    engine = SqliteContextEngine(tmp_path / "c.sqlite", settings=SMALL)
    long = {
        "role": "user",
        "content": "needle " + "\u00e9x\U0001f600 " * PAGE_CHARS,
        "timestamp": 1,
    }
    messages = [*turns(5), long, *turns(20, start=5)]
    await stored(engine, "s", messages)
    await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=400, force=True)
    )
    hits = (await call(engine, "recall_grep", query="needle"))["hits"]
    (hit,) = [h for h in hits if h["kind"] == "message"]
    assert {h["kind"] for h in hits} == {"message", "summary"}  # the summaries quote it
    assert hit["expand"].startswith("sum_")
    behind = await expanded(engine, hit["expand"])
    assert behind[10] == encode(long)[1].decode()
    several = (await call(engine, "recall_grep", query="zebra3"))["hits"][0]["expand"]
    behind = await expanded(engine, several)
    assert len(behind) > 1
    for seq, text in behind.items():
        assert text == encode(messages[seq])[1].decode()
    raw = await call(engine, "recall_expand", id=hit["ref"])
    assert raw["messages"][0]["part"] == [0, len(encode(long)[1].decode())]


async def test_describe_says_what_a_summary_covers(tmp_path: Path) -> None:
    engine = SqliteContextEngine(tmp_path / "c.sqlite", settings=SMALL)
    messages = turns(30)
    await stored(engine, "s", messages)
    await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=600, force=True)
    )
    (hit,) = [h for h in (await call(engine, "recall_grep", query="zebra3"))["hits"][:1]]
    about = await call(engine, "recall_describe", id=hit["expand"])
    span = about["span"]
    assert (about["kind"], about["conversation"]) == ("leaf", "current")
    assert span["first_seq"] <= hit["seq"] <= span["last_seq"]
    assert span["messages"] == len(about["sources"]) == span["last_seq"] - span["first_seq"] + 1
    assert about["size"]["message_tokens"] == about["size"]["source_tokens"]
    assert about["in_context"] or about["parent"] is not None
    question = await call(engine, "recall_expand_query", question="what about zebra7?")
    shown = [m["json"] for match in question["matches"] for m in match["messages"]]
    assert encode(messages[14])[1].decode() in shown


async def test_recall_is_the_session_keys_archived_included_never_anothers(
    tmp_path: Path,
) -> None:
    engine = SqliteContextEngine(tmp_path / "c.sqlite", settings=SMALL)
    await stored(engine, "s", turns(12))
    await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=300, force=True)
    )
    await stored(engine, "other", turns(3, word="okapi"))
    (before,) = (await call(engine, "recall_grep", query="zebra2"))["hits"][:1]
    assert await engine.archive("s")  # a reset
    await stored(engine, "s", turns(2, start=50, word="giraffe"))
    hits = (await call(engine, "recall_grep", query="zebra2"))["hits"]
    assert [(h["ref"], h["conversation"]) for h in hits[:1]] == [(before["ref"], "archived")]
    summary = await call(engine, "recall_describe", id=before["expand"])
    assert summary["conversation"] == "archived"
    assert (await call(engine, "recall_grep", query="okapi1"))["hits"] == []
    assert (await call(engine, "recall_grep", "other", query="zebra2"))["hits"] == []
    for name, args in [
        ("recall_expand", {"id": before["expand"]}),
        ("recall_expand", {"id": before["ref"]}),
        ("recall_describe", {"id": before["expand"]}),
    ]:
        refused = await engine.call_tool(
            ToolCallParams(session_id="other", name=name, arguments=args)
        )
        assert not refused.success
    offer = await engine.tools(ToolsParams(session_id="s"))
    assert [t.name for t in offer.tools] == [
        "recall_grep",
        "recall_describe",
        "recall_expand",
        "recall_expand_query",
    ]
    quiet = SqliteContextEngine(tmp_path / "q.sqlite", settings=EngineSettings(recall_tools=False))
    assert (await quiet.tools(ToolsParams(session_id="s"))).tools == []


def index_counts(path: str) -> tuple[int, int, int, int]:
    with sqlite3.connect(path) as conn:
        return tuple(  # type: ignore[return-value]
            conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            for table in ("messages", "messages_fts", "summaries", "summaries_fts")
        )


async def test_the_index_follows_every_ingestion_path_and_a_migration(tmp_path: Path) -> None:
    engine = SqliteContextEngine(tmp_path / "c.sqlite", settings=SMALL)
    await stored(engine, "a", turns(10))
    await engine.ingest(IngestParams(session_id="b", message=turns(1, word="lynx")[0]))
    await engine.ingest_batch(IngestBatchParams(session_id="b", messages=turns(3, start=7)))
    await stored(engine, "a", turns(10))  # again: nothing new, nothing indexed twice
    await engine.compact(
        CompactParams(session_id="a", session_file="", token_budget=300, force=True)
    )
    counts = index_counts(engine.path)
    assert counts[0] == counts[1] == 27
    assert counts[2] == counts[3] > 0
    engine.close()
    with sqlite3.connect(engine.path) as conn:  # what version 2 had
        for table in ("messages_fts", "summaries_fts"):
            conn.execute(f"DROP TABLE {table}")
        for index in ("summary_sources_message", "summary_sources_child"):
            conn.execute(f"DROP INDEX {index}")
        conn.execute("PRAGMA user_version=2")
    reopened = SqliteContextEngine(tmp_path / "c.sqlite", settings=SMALL)
    assert (await call(reopened, "recall_grep", "b", query="lynx0"))["hits"][0]["role"] == "user"
    assert index_counts(engine.path) == counts
    assert (await reopened.doctor(repair=False)).ok
    reopened.close()


async def test_retention_takes_a_pruned_conversation_out_of_the_index(tmp_path: Path) -> None:
    engine = SqliteContextEngine(tmp_path / "c.sqlite", settings=SMALL)
    await stored(engine, "s", turns(12))
    await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=300, force=True)
    )
    await stored(engine, "t", turns(3, word="okapi"))
    assert await engine.archive("s")
    report = await engine.prune(archived_before=float("inf"))
    assert report.deleted_conversations == 1
    assert index_counts(engine.path) == (6, 6, 0, 0)
    assert (await call(engine, "recall_grep", query="zebra2"))["hits"] == []
    assert len((await call(engine, "recall_grep", "t", query="okapi1"))["hits"]) == 1
    assert (await engine.doctor(repair=False)).ok


async def test_the_size_cap_never_takes_the_active_conversation(tmp_path: Path) -> None:
    """Over the cap, background maintenance prunes archived conversations only: the active
    conversation's latest turns and everything its summaries stand for stay reachable."""
    settings = attrs.evolve(SMALL, max_db_bytes=1)
    engine = SqliteContextEngine(tmp_path / "c.sqlite", settings=settings)
    await stored(engine, "s", turns(6, word="old"))
    assert await engine.archive("s")
    messages = turns(12)
    await stored(engine, "s", messages)
    await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=300, force=True)
    )
    assert (await call(engine, "recall_grep", query="old1"))["hits"]  # archived: reachable
    done = await engine.maintain(
        MaintainParams(
            session_id="s",
            session_file="",
            runtime_context={"allowDeferredCompactionExecution": True},
        )
    )
    assert done.bytes_freed >= 0
    assert (await call(engine, "recall_grep", query="old1"))["hits"] == []
    for seq, message in enumerate(messages):
        word = f"zebra{seq // 2}" if seq % 2 == 0 else f"stripes{seq // 2}"
        (hit,) = (await call(engine, "recall_grep", query=word))["hits"][:1]
        assert (await expanded(engine, hit["expand"]))[seq] == encode(message)[1].decode()
    assert (await engine.doctor(repair=False)).ok


def used_bytes(path: str) -> int:
    with sqlite3.connect(path) as conn:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        size = conn.execute("PRAGMA page_size").fetchone()[0]
    return int((pages - free) * size)


async def test_over_the_cap_an_old_conversation_sheds_what_its_summaries_stand_for(
    tmp_path: Path,
) -> None:
    """Retention's first step keeps an archived conversation's summaries (searchable,
    describable) and what its context showed raw, and drops only the summarised messages;
    its second step, when that is not enough, deletes it whole."""
    settings = attrs.evolve(SMALL, compress_over_bytes=None)
    engine = SqliteContextEngine(tmp_path / "c.sqlite", settings=settings)
    rng = random.Random(3)
    old = [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": f"old{i} " + " ".join(f"w{rng.randrange(10**6)}" for _ in range(300)),
            "timestamp": i,
        }
        for i in range(40)
    ]
    await stored(engine, "s", old)
    await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=2_000, force=True)
    )
    assert await engine.archive("s")  # a reset
    await stored(engine, "s", turns(3))
    raw_tail = [
        seq
        for seq in range(40)
        if not (await call(engine, "recall_grep", query=f"old{seq}"))["hits"][0][
            "expand"
        ].startswith("sum_")
    ]
    assert raw_tail
    report = await engine.prune(max_bytes=used_bytes(engine.path) - 20_000)
    assert (report.shed_conversations, report.deleted_conversations) == (1, 0)
    assert not report.over_ceiling
    assert (await engine.doctor(repair=False)).ok
    hits = (await call(engine, "recall_grep", query="old3"))["hits"]
    assert [h["kind"] for h in hits] == ["summary"] * len(hits)  # the messages left the index
    assert hits
    about = await call(engine, "recall_describe", id=hits[0]["ref"])
    assert about["conversation"] == "archived"
    assert about["pruned_messages"] == about["span"]["messages"] > 0
    page = await call(engine, "recall_expand", id=hits[0]["ref"])
    assert all(entry.get("pruned") for entry in page["messages"])
    for seq in raw_tail:  # what the old context showed raw is whole
        (hit,) = (await call(engine, "recall_grep", query=f"old{seq}"))["hits"][:1]
        assert (await expanded(engine, hit["expand"]))[seq] == encode(old[seq])[1].decode()
    assert (await call(engine, "recall_grep", query="zebra1"))["hits"]  # the active one
    last = await engine.prune(max_bytes=1)
    assert (last.shed_conversations, last.deleted_conversations) == (0, 1)
    assert (await call(engine, "recall_grep", query="old3"))["hits"] == []
    assert (await engine.doctor(repair=False)).ok
