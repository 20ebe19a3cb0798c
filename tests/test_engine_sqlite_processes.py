"""SqliteContextEngine across processes: SIGKILLed writers, and concurrent writers.

* **Crash safety**: two processes fork short-lived writers that ingest (whole histories,
  retried from random cut points) and compact one store, and SIGKILL each after a random
  2-40 ms, over 200 times in all, so kills land before, inside and between transactions
  of ingestion and of compaction. Afterwards the retried work (every session delivered
  whole once more) adds exactly what is missing: each conversation holds its history once,
  in order; ``doctor`` finds nothing to repair; the store still compacts.
* **Concurrency**: 4 processes x 10 sessions (5 shared by all processes, 5 each its own),
  every turn an ``after_turn``, all at once into one store: no ``SQLITE_BUSY`` escapes (a
  writer that raised exits non-zero), no message lost, none twice.

Workers: ``tests/support/engine_sqlite_workload.py``.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from support.engine_sqlite_workload import (
    CRASH_SESSIONS,
    CRASH_TURNS,
    PHASES,
    SMALL,
    Message,
    history,
    writer_history,
    writer_sessions,
)

from codex_turn.engines import SqliteContextEngine, _store
from codex_turn.harness.engine import AfterTurnParams, CompactParams

WORKLOAD = Path(__file__).parent / "support" / "engine_sqlite_workload.py"
KILLS = 110  # per crasher process; two of them


def stored(store: Path, session: str) -> list[Message]:
    with sqlite3.connect(store) as conn:
        rows = conn.execute(
            "SELECT m.content FROM messages m JOIN conversations c ON c.id = m.conversation_id "
            "WHERE c.session_key=? ORDER BY m.seq",
            (session,),
        ).fetchall()
    return [json.loads(_store.decode_content(row[0])) for row in rows]


def test_sigkilled_writers_leave_a_consistent_store(tmp_path: Path) -> None:
    store = tmp_path / "crash.sqlite"
    crashers = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKLOAD),
                "crasher",
                str(store),
                str(KILLS),
                str(seed),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    landed = 0
    where = [0] * len(PHASES)
    for process in crashers:
        out, err = process.communicate(timeout=240)
        assert process.returncode == 0, err[-2000:]
        kills, failed, *phases = map(int, out.split("\n")[-2].split())
        assert failed == 0, err[-2000:]  # a child only ever stops by being killed
        landed += kills
        where = [a + b for a, b in zip(where, phases, strict=True)]
    assert landed >= 200
    print("kills by phase:", dict(zip(PHASES, where, strict=True)))

    async def retry_and_check() -> None:
        engine = SqliteContextEngine(store, settings=SMALL)
        report = await engine.doctor(repair=False)
        assert report.problems == (), report.problems
        assert report.summaries > 0  # the kills interrupted compactions too
        for index in range(CRASH_SESSIONS):
            session = f"crash-{index}"
            whole = history(session, CRASH_TURNS)
            await engine.after_turn(
                AfterTurnParams(
                    session_id=session,
                    session_file="",
                    messages=whole,
                    pre_prompt_message_count=0,
                    token_budget=2_000,
                )
            )
            assert stored(store, session) == whole
            result = await engine.compact(
                CompactParams(session_id=session, session_file="", token_budget=800, force=True)
            )
            assert result.ok
        final = await engine.doctor(repair=False)
        assert final.problems == ()
        engine.close()

    anyio.run(retry_and_check)


def test_four_processes_ten_sessions_each_concurrently(tmp_path: Path) -> None:
    store = tmp_path / "shared.sqlite"
    turns = 12
    writers = [
        subprocess.Popen(
            [sys.executable, str(WORKLOAD), "writer", str(store), str(p), "10", str(turns)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in range(4)
    ]
    for process in writers:
        out, err = process.communicate(timeout=240)
        assert process.returncode == 0, err[-3000:]
        assert out.strip() == "ok"
    sessions = sorted({s for p in range(4) for s in writer_sessions(p, 10)})
    assert len(sessions) == 5 + 4 * 5
    for session in sessions:
        assert stored(store, session) == writer_history(session, turns), session
    with sqlite3.connect(store) as conn:
        total = conn.execute("SELECT count(*) FROM messages").fetchone()[0]
    assert total == sum(len(writer_history(s, turns)) for s in sessions)

    async def check() -> None:
        engine = SqliteContextEngine(store, settings=SMALL)
        assert (await engine.doctor(repair=False)).problems == ()
        engine.close()

    anyio.run(check)


@pytest.fixture(autouse=True)
def _no_private_text_guard() -> None:
    """The workers log nothing here (their logs stay in their own processes)."""
