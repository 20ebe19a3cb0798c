"""A turn recovered as already mirrored brings the engine up to date before it returns.

The crash window: a worker dies after the turn's mirror and before the engine's finalize. The
recovered workflow finds the reply in the transcript (``source="already_mirrored"``) and must
not ask Codex again, but the engine never saw the turn: an engine without ``bootstrap`` (no
reconciliation on the session's next turn) would lose it. The recovery runs the turn's
finalize for it, under the session hold, and a second recovery adds nothing.

The turns run through the in-process fake app-server (nothing here needs the real Codex):
the crash point is the state it leaves (the reply mirrored, the engine without the turn),
made by the attempt that ran the turn with no engine; the second recovery is the workflow run
again from the start (as DBOS does when the worker dies before it wrote the outcome), on a
fresh database.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from support.fake_appserver import CodexScript, FakeAppServer
from test_engine_sqlite_processes import stored

from codex_turn import TurnParams, run_codex_turn
from codex_turn.engines import SqliteContextEngine
from codex_turn.scale import TurnQueue, TurnRecord, TurnWorker
from codex_turn.testing import RecordingEngine

SESSION_KEY = "agent:main:recover-1"


@pytest.fixture
def private_texts() -> set[str]:
    return {"first question here", "second question here", "second answer there", SESSION_KEY}


class _Without:
    """The reference engine with some optional methods absent (``hasattr`` is false), as an
    engine that never defined them."""

    def __init__(self, engine: SqliteContextEngine, omit: Iterable[str]) -> None:
        self._engine, self._omit = engine, frozenset(omit)

    def __getattr__(self, name: str) -> Any:
        if name in self._omit:
            raise AttributeError(name)
        return getattr(self._engine, name)


def _params(tmp_path: Path, prompt: str) -> TurnParams:
    return TurnParams(
        session_id="recover-1",
        session_key=SESSION_KEY,
        session_file=tmp_path / "recover-1.jsonl",
        workspace_dir=tmp_path,
        prompt=prompt,
    )


def _held(store: Path) -> list[tuple[str, str]]:
    """The engine's store for the session: (role, text) of each message, in order."""
    held = []
    for message in stored(store, SESSION_KEY):
        content = message["content"]
        parts = [content] if isinstance(content, str) else content
        text = "".join(p if isinstance(p, str) else p.get("text", "") for p in parts)
        held.append((message["role"], text))
    return held


async def _recover(
    db_url: str, server: FakeAppServer, engine: object, params: TurnParams
) -> TurnRecord:
    with TurnQueue(db_url) as queue:
        async with TurnWorker(db_url, app_server=server, engine=engine, watchdog_interval=None):
            return await (await queue.submit_async(params, turn_id="t-2")).result_async()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "omit",
    [{"bootstrap"}, {"bootstrap", "after_turn"}, {"bootstrap", "after_turn", "ingest_batch"}],
    ids=["after_turn", "ingest_batch", "ingest"],
)
async def test_a_turn_recovered_after_its_mirror_reaches_an_engine_without_bootstrap_once(
    tmp_path: Path, db_url: str, omit: set[str]
) -> None:
    server = FakeAppServer(
        scripts=[CodexScript(reply="first answer"), CodexScript(reply="second answer there")]
    )
    store = tmp_path / "engine.sqlite"
    sqlite = SqliteContextEngine(str(store))
    engine = _Without(sqlite, omit)
    try:
        with TurnQueue(db_url) as queue:
            async with TurnWorker(db_url, app_server=server, engine=engine, watchdog_interval=None):
                first = await (
                    await queue.submit_async(
                        _params(tmp_path, "first question here"), turn_id="t-1"
                    )
                ).result_async()
        assert first.source == "ran"
        assert _held(store) == [("user", "first question here"), ("assistant", "first answer")]

        # The attempt of t-2 that died between the mirror and the engine's finalize: the
        # reply is in the transcript, the engine does not have the turn.
        params = _params(tmp_path, "second question here")
        await run_codex_turn(params, app_server=server, engine=None, idempotency_key="t-2")
        assert len(_held(store)) == 2

        expected = [
            ("user", "first question here"),
            ("assistant", "first answer"),
            ("user", "second question here"),
            ("assistant", "second answer there"),
        ]
        recovered = await _recover(db_url, server, engine, params)
        assert (recovered.source, recovered.assistant_text) == (
            "already_mirrored",
            "second answer there",
        )
        assert _held(store) == expected  # the turn, once, in order

        # Recovered again (the worker died before DBOS wrote the outcome): nothing twice.
        again = await _recover(f"sqlite:///{tmp_path}/again.sqlite", server, engine, params)
        assert again.source == "already_mirrored"
        assert _held(store) == expected
        assert server.methods().count("turn") == 2  # Codex was never asked again
    finally:
        sqlite.close()


@pytest.mark.anyio
async def test_an_engine_failing_to_catch_up_does_not_fail_the_recovered_turn(
    tmp_path: Path, db_url: str
) -> None:
    server = FakeAppServer(scripts=[CodexScript(reply="second answer there")])
    engine = RecordingEngine(omit={"bootstrap"}, failures={"after_turn": RuntimeError("disk full")})
    params = _params(tmp_path, "second question here")
    await run_codex_turn(params, app_server=server, engine=None, idempotency_key="t-2")
    with capture_logs() as records:
        record = await _recover(db_url, server, engine, params)
    assert (record.outcome, record.source) == ("completed", "already_mirrored")
    assert record.assistant_text == "second answer there"
    (call,) = engine.calls_to("after_turn")
    assert call.params.pre_prompt_message_count == 0
    assert [m["role"] for m in call.params.messages] == ["user", "assistant"]
    reasons = [r.get("reason") for r in records if "not brought up to date" in r["event"]]
    assert reasons == ["finalize_failed"]
    haystack = repr(records)
    assert "second question here" not in haystack
    assert SESSION_KEY not in haystack
