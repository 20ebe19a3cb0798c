"""``run_turn``: one turn of a session from a plain script, one blocking call.

Against the pinned binary and the offline model (a private Codex home: nothing leaves the
machine). The defaults a script relies on are checked as it would meet them: the reference
engine next to the session, the session id from the file name, a second call going on with
the same conversation on the same thread.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from codex_turn import AppServerConfig, InvalidTurnParams, TurnOutcome, run_turn
from codex_turn.testing import OfflineModel, Reply


@pytest.mark.codex
def test_two_calls_run_two_turns_of_one_conversation(
    tmp_path: Path, offline_model: OfflineModel, codex_binary: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before its fix: a script needed an event loop, an app-server, an engine and a
    # TurnParams of its own to run one turn.
    monkeypatch.chdir(tmp_path)
    offline_model.script(Reply.fixed("Friday it is."), Reply.fixed("We said Friday."))
    config = AppServerConfig.offline(
        tmp_path / "codex-home", offline_model.base_url, env=offline_model.proxy_env()
    )
    first = run_turn("notes.jsonl", "Let's ship on Friday.", config=config)
    second = run_turn(tmp_path / "notes.jsonl", "What did we decide?", config=config)
    assert (first.outcome, first.assistant_text) == (TurnOutcome.COMPLETED, "Friday it is.")
    assert (second.outcome, second.assistant_text) == (TurnOutcome.COMPLETED, "We said Friday.")
    assert second.thread_id == first.thread_id  # the same conversation, on the same thread
    assert second.thread_decision is not None
    assert second.thread_decision.action.value == "resume"
    assert (tmp_path / "context.sqlite").exists()  # the reference engine's store, by default
    assert any(c.trigger == "bootstrapped" for c in second.trace)  # the engine ran
    assert "Let's ship on Friday." in offline_model.turn_requests()[-1].user_messages


def test_bad_params_are_refused_before_anything_starts(tmp_path: Path) -> None:
    config = AppServerConfig.offline(tmp_path / "never-created", "http://127.0.0.1:9/v1")
    with pytest.raises(InvalidTurnParams):
        run_turn(tmp_path / "s.jsonl", "   ", config=config)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
