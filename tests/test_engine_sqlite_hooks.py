"""The reference engine's later hooks, behaviour by behaviour: a reset archives, a session end
releases only, a subagent is seeded from its parent and folded back (the parent's addition and
epoch say so, durably), control answers status, doctor and rotate (also from the command
line), and an abort stops the compaction sweep before its first pass."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
from support.engine_sqlite_workload import SMALL, turn

from codex_turn.cli import main
from codex_turn.engines import SqliteContextEngine, StoreError
from codex_turn.engines._host_hooks import MAX_RESULTS, SubagentLedger
from codex_turn.harness.engine import (
    AbortSignal,
    AfterTurnParams,
    AssembleParams,
    AssembleResult,
    CompactParams,
    ControlRequest,
    SessionEndParams,
    SessionResetParams,
    SubagentEndedParams,
    SubagentSpawnParams,
)
from codex_turn.harness.session import mirror_turn
from codex_turn.harness.session_lifecycle import engine_control

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.anyio

HUGE = 10_000_000


def engine_at(tmp_path: Path) -> SqliteContextEngine:
    return SqliteContextEngine(tmp_path / "store" / "context.sqlite", settings=SMALL)


async def play(engine: SqliteContextEngine, session: str, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for index in range(turns):
        pre = len(messages)
        messages = [*messages, *turn(session, index, tools=int(index % 3 == 1))]
        await engine.after_turn(
            AfterTurnParams(
                session_id=session,
                session_file="",
                messages=messages,
                pre_prompt_message_count=pre,
                token_budget=HUGE,
            )
        )
    return messages


async def assemble(engine: SqliteContextEngine, session: str, budget: int = HUGE) -> AssembleResult:
    return await engine.assemble(
        AssembleParams(session_id=session, messages=[], token_budget=budget)
    )


async def test_a_reset_archives_the_conversation_and_the_key_starts_over(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    await play(engine, "s", 3)
    before = await assemble(engine, "s")
    assert before.messages
    assert before.prompt_authority == "assembled"
    result = await engine.before_session_reset(SessionResetParams(session_id="s", session_file=""))
    assert (result.action, result.reason) == ("archived", "conversation archived")
    after = await assemble(engine, "s")
    assert after.messages == []
    assert after.context_projection != before.context_projection  # a new epoch
    await engine.session_end(SessionEndParams(session_id="s", session_file=""))
    assert await engine.has_session("s")  # the end released nothing of the store


async def test_a_subagent_is_seeded_from_its_parent_and_its_answer_folded_back(
    tmp_path: Path,
) -> None:
    engine = engine_at(tmp_path)
    await play(engine, "parent", 3)
    before = await assemble(engine, "parent")
    spawn = SubagentSpawnParams(
        parent_session_id="parent",
        child_session_id="child",
        child_session_file="",
        task="check the numbers",
    )
    seed = await engine.prepare_subagent_spawn(spawn)
    assert seed.system_prompt_addition is not None
    assert seed.system_prompt_addition.startswith("Context from the parent session")
    assert "</parent_context>" in seed.system_prompt_addition
    assert (await assemble(engine, "child")).messages == []  # the seed is no child message
    ended = SubagentEndedParams(
        parent_session_id="parent",
        child_session_id="child",
        outcome="completed",
        result_text="ANSWER-42",
    )
    await engine.on_subagent_ended(ended)
    folded = await assemble(engine, "parent")
    assert folded.messages == before.messages
    assert folded.system_prompt_addition is not None
    assert "subagent child (completed): ANSWER-42" in folded.system_prompt_addition
    assert folded.context_projection is not None
    assert before.context_projection is not None
    assert folded.context_projection.epoch != before.context_projection.epoch  # re-projected
    # Durable: a new instance on the store folds it in as well; another session does not.
    again = engine_at(tmp_path)
    assert (await assemble(again, "parent")).system_prompt_addition == folded.system_prompt_addition
    assert (await assemble(again, "other")).system_prompt_addition is None
    # A child that never ran leaves nothing; a reset forgets the folded results.
    never_ran = attrs.evolve(ended, child_session_id="c2", outcome="spawn_failed")
    await engine.on_subagent_ended(never_ran)
    assert await assemble(engine, "parent") == folded
    await engine.before_session_reset(SessionResetParams(session_id="parent", session_file=""))
    assert (await assemble(engine, "parent")).system_prompt_addition is None


async def test_control_answers_status_doctor_and_rotate(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    await play(engine, "s", 2)
    assert engine.control_capabilities().actions == {"status", "doctor", "rotate"}
    status = await engine_control(engine, ControlRequest(action="status", session_key="s"))
    assert (status.ok, status.summary) == (True, "store healthy")
    assert status.details["sessionStored"] is True
    doctor = await engine_control(engine, ControlRequest(action="doctor"))
    assert doctor.ok
    assert doctor.summary.startswith("1 conversations, ")
    rotate = await engine_control(engine, ControlRequest(action="rotate", session_key="s"))
    assert (rotate.ok, rotate.details) == (True, {"archived": True})
    assert (await assemble(engine, "s")).messages == []
    keyless = await engine_control(engine, ControlRequest(action="rotate"))
    assert (keyless.ok, keyless.summary) == (False, "rotate needs a session key")


async def test_an_aborted_compaction_stops_before_its_first_pass(tmp_path: Path) -> None:
    engine = engine_at(tmp_path)
    await play(engine, "s", 12)
    before = await assemble(engine, "s")
    signal = AbortSignal()
    signal.abort()
    params = CompactParams(
        session_id="s", session_file="", token_budget=400, force=True, abort_signal=signal
    )
    result = await engine.compact(params)
    assert (result.compacted, result.reason) == (False, "aborted")
    assert await assemble(engine, "s") == before
    compacted = await engine.compact(
        CompactParams(session_id="s", session_file="", token_budget=400, force=True)
    )
    assert compacted.compacted


def test_the_command_line_runs_the_engines_control(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    session = tmp_path / "chat.jsonl"
    mirror_turn(
        session,
        [{"role": "user", "content": "hello", "timestamp": 1}],
        scope="t",
        identities=["p"],
        session_id="chat",
        cwd=str(tmp_path),
    )
    assert main(["engine", "status", str(session)]) == 2  # no store next to it: none created
    assert "no engine for" in capsys.readouterr().err
    assert not SqliteContextEngine.store_next_to(session).endswith("x")
    assert main(["engine", "status", str(session), "--engine", "sqlite", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["ok"], shown["action"]) == (True, "status")
    assert shown["details"]["sessionStored"] is False
    assert main(["engine", "rotate", str(session)]) == 0  # the store exists now
    assert capsys.readouterr().out.startswith("ok    rotate: ")
    assert main(["engine", "doctor", str(session), "--repair"]) == 0
    assert "doctor: " in capsys.readouterr().out
    spec = "codex_turn.testing:RecordingEngine"
    assert main(["engine", "status", str(session), "--engine", spec]) == 2
    assert "cannot status: it offers no control actions" in capsys.readouterr().err


_LEDGER_WRITER = """
import sys
from codex_turn.engines._host_hooks import SubagentLedger
store, parent, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
ledger = SubagentLedger(store)
ledger.results(parent)  # a stale cache: every write must re-read the file anyway
for n in range(count):
    ledger.record(f"{parent}-{n % 4}", {"child": f"c{n}", "answer": "a"})
"""


def test_processes_sharing_a_store_lose_none_of_each_others_subagent_results(
    tmp_path: Path,
) -> None:
    store = str(tmp_path / "context.sqlite")
    first, second = SubagentLedger(store), SubagentLedger(store)
    first.results("p1"), second.results("p2")  # both read the (missing) ledger once
    second.record("p2", {"child": "c", "answer": "two"})
    first.record("p1", {"child": "c", "answer": "one"})  # once wrote back its stale copy
    assert [e["answer"] for e in first.results("p2")] == ["two"]
    assert [e["answer"] for e in second.results("p1")] == ["one"]
    writers = [
        subprocess.Popen([sys.executable, "-c", _LEDGER_WRITER, store, name, "40"], cwd=ROOT)
        for name in ("x", "y")
    ]
    assert [w.wait(timeout=60) for w in writers] == [0, 0]
    fresh = SubagentLedger(store)
    for name in ("x", "y"):
        for slot in range(4):  # each parent keeps its newest MAX_RESULTS of 10 records
            assert len(fresh.results(f"{name}-{slot}")) == min(10, MAX_RESULTS)
    assert stat.S_IMODE(os.stat(store + ".subagents.json.lock").st_mode) == 0o600
    # An unreadable ledger is never rewritten from nothing: the change is refused.
    Path(fresh.path).write_text("{torn")
    with pytest.raises(StoreError, match="unreadable"):
        SubagentLedger(store).record("p1", {"child": "d", "answer": "x"})
    assert Path(fresh.path).read_text() == "{torn"
