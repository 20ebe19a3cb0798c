"""A host SIGKILLed between the model's reply and the engine's commit, against the real binary:
the next turn commits what it left, exactly once, with the reference engine.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

from codex_turn import AppServer, TurnParams, run_codex_turn
from codex_turn._demo_durable import CRASH_KEY, CRASH_PROMPT, _run_child_until_commit
from codex_turn.engines import SqliteContextEngine
from codex_turn.fsm.outbox import OutboxState
from codex_turn.harness.durable_turns import recover_turns
from codex_turn.harness.engine import AssembleParams, CommitTurnParams, CommitTurnResult
from codex_turn.harness.idempotency import TurnAlreadyCompleted, completed_turn
from codex_turn.harness.outbox import TurnOutbox
from codex_turn.testing import OfflineModel, Reply

pytestmark = [pytest.mark.anyio, pytest.mark.codex]


class Watched:
    """The reference engine, with what it was asked to assemble and what it committed."""

    def __init__(self, inner: SqliteContextEngine) -> None:
        self.inner = inner
        self.assembled: list[list[str]] = []
        self.commits: list[tuple[str, str]] = []

    @property
    def info(self) -> Any:
        return self.inner.info

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def assemble(self, params: AssembleParams) -> Any:
        self.assembled.append([_text(m) for m in params.messages])
        return await self.inner.assemble(params)

    async def commit_turn(self, params: CommitTurnParams) -> CommitTurnResult:
        result = await self.inner.commit_turn(params)
        self.commits.append((params.advancement_key, result.status))
        return result


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


async def test_a_host_killed_between_the_reply_and_the_commit_is_recovered_exactly_once(
    tmp_path: Path, workspace: Path, appserver: AppServer, offline_model: OfflineModel
) -> None:
    session_file = tmp_path / "s.jsonl"
    engine = Watched(SqliteContextEngine.next_to(session_file))

    def params(prompt: str) -> TurnParams:
        return TurnParams(
            session_id="s-1",
            session_file=session_file,
            workspace_dir=workspace,
            prompt=prompt,
        )

    offline_model.script(Reply.fixed("A1"), user_contains="Lisbon in May")
    offline_model.script(Reply.fixed("A2"), user_contains=CRASH_PROMPT)
    offline_model.script(Reply.fixed("A3"), user_contains="and the trams")
    first = await run_codex_turn(
        params("Lisbon in May"), app_server=appserver, engine=engine, idempotency_key="k1"
    )
    assert first.assistant_text == "A1"

    # A second host (a child process, its own app-server) runs turn k2 and is SIGKILLed as
    # its engine is about to commit: Codex replied, the mirror wrote the reply.
    seen = await anyio.to_thread.run_sync(
        _run_child_until_commit,
        {
            "home": str(tmp_path / "second-host"),
            "baseUrl": offline_model.base_url,
            "env": offline_model.proxy_env(),
            "codexBin": str(appserver.config.codex_bin),
            "sessionFile": str(session_file),
            "sessionId": "s-1",
            "workspace": str(workspace),
        },
    )
    assert seen["commit"] == CRASH_KEY
    assert seen["signal"] == signal.SIGKILL
    replied = completed_turn(session_file, CRASH_KEY)
    assert replied is not None
    assert replied.assistant_text == "A2"
    entry = TurnOutbox.of(session_file).entry(CRASH_KEY)
    assert entry is not None
    assert (entry.state, entry.terminal) == (OutboxState.ACCEPTED, "completed")
    assert (await engine.doctor(repair=False)).messages == 2  # k1 only: k2 never committed

    # The next turn commits k2 first, then itself; its assembly saw k2, never its own prompt.
    third = await run_codex_turn(
        params("and the trams"), app_server=appserver, engine=engine, idempotency_key="k3"
    )
    assert third.assistant_text == "A3"
    assert engine.commits == [("k1", "committed"), (CRASH_KEY, "committed"), ("k3", "committed")]
    assert engine.assembled[-1] == ["Lisbon in May", "A1", CRASH_PROMPT, "A2"]
    # Exactly once: a retry of k2 is refused (its reply is there) and commits nothing more;
    # a later recovery has nothing to do; the store holds every message once.
    with pytest.raises(TurnAlreadyCompleted):
        await run_codex_turn(
            params(CRASH_PROMPT), app_server=appserver, engine=engine, idempotency_key=CRASH_KEY
        )
    report = await recover_turns(session_file, engine=engine, session_id="s-1")
    assert (report.settled, report.duplicates, report.blocked) == ((), (), ())
    assert len(engine.commits) == 3
    stored = await engine.inner.assemble(AssembleParams(session_id="s-1", messages=[]))
    assert [_text(m) for m in stored.messages] == [
        "Lisbon in May",
        "A1",
        CRASH_PROMPT,
        "A2",
        "and the trams",
        "A3",
    ]
    states = {e.advancement_key: e.state for e in TurnOutbox.of(session_file).entries()}
    assert states == dict.fromkeys(("k1", CRASH_KEY, "k3"), OutboxState.READY)
    await engine.inner.dispose()
