"""A turn's stable identity: ``run_codex_turn(..., idempotency_key=...)`` (what a durable
queue passes when it re-runs a turn after a crash) makes the prompt's mirror key stable, so a
re-run of an attempt that died mid-turn writes the prompt once, and a re-run of a completed
turn is refused (:class:`TurnAlreadyCompleted`). Against the real binary and the offline
model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from codex_turn import (
    AppServer,
    AppServerConfig,
    InvalidTurnParams,
    TurnParams,
    reset_session,
    run_codex_turn,
)
from codex_turn.harness.idempotency import TurnAlreadyCompleted
from codex_turn.harness.session import clear_session_cache
from codex_turn.testing import OfflineModel, Reply

pytestmark = pytest.mark.codex


def _user_entries(session_file: Path) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in session_file.read_text().splitlines() if line.strip()]
    return [
        line["message"]
        for line in lines
        if line.get("type") == "message" and line["message"].get("role") == "user"
    ]


def _drop_reply(session_file: Path) -> None:
    """Keep the transcript up to its last prompt: what an attempt that died mid-turn left."""
    lines = session_file.read_text().splitlines(keepends=True)
    while lines and '"role":"assistant"' in lines[-1].replace(" ", ""):
        lines.pop()
    session_file.write_text("".join(lines))
    clear_session_cache(session_file)


def _params(tmp_path: Path, prompt: str) -> TurnParams:
    return TurnParams(
        session_id="s-identity",
        session_file=tmp_path / "s.jsonl",
        workspace_dir=tmp_path,
        prompt=prompt,
    )


@pytest.mark.anyio
async def test_two_runs_with_one_idempotency_key_mirror_the_prompt_once(
    tmp_path: Path,
    offline_model: OfflineModel,
    make_appserver_config: Callable[..., AppServerConfig],
) -> None:
    offline_model.script(Reply.fixed("first"), Reply.fixed("second"), Reply.fixed("third"))
    session = tmp_path / "s.jsonl"
    async with AppServer.start(make_appserver_config()) as server:
        result = await run_codex_turn(
            _params(tmp_path, "ship it"), app_server=server, idempotency_key="turn-42"
        )
        assert result.outcome.value == "completed"
        # The same turn again (a queue's retry after a crash): its reply is there, so it is
        # refused under the session hold, nothing written, Codex not asked.
        with pytest.raises(TurnAlreadyCompleted) as done:
            await run_codex_turn(
                _params(tmp_path, "ship it"), app_server=server, idempotency_key="turn-42"
            )
        assert done.value.assistant_text == "first"
        assert len(offline_model.requests) == 1
        _drop_reply(session)  # the attempt died after making its prompt durable: runs again
        result = await run_codex_turn(
            _params(tmp_path, "ship it"), app_server=server, idempotency_key="turn-42"
        )
        assert result.outcome.value == "completed"
        users = _user_entries(session)
        assert len(users) == 1, users
        assert str(users[0]["idempotencyKey"]).endswith(":turn-turn-42:prompt")
        # Without a key, every run is a new prompt (the default is unchanged).
        await run_codex_turn(_params(tmp_path, "ship it"), app_server=server)
        assert len(_user_entries(session)) == 2


@pytest.mark.anyio
@pytest.mark.parametrize("elsewhere", ["binding-cleared", "another-codex-home"])
async def test_a_run_retried_on_another_thread_mirrors_the_prompt_once(
    tmp_path: Path,
    offline_model: OfflineModel,
    make_appserver_config: Callable[..., AppServerConfig],
    elsewhere: str,
) -> None:
    """A queue retrying the turn on another worker: another thread, the same prompt key."""
    offline_model.script(Reply.fixed("first"), Reply.fixed("second"))
    session = tmp_path / "s.jsonl"
    params = _params(tmp_path, "ship it")
    async with AppServer.start(make_appserver_config()) as server:
        first = await run_codex_turn(params, app_server=server, idempotency_key="turn-7")
        _drop_reply(session)  # the attempt died before its reply was mirrored
        if elsewhere == "binding-cleared":
            assert reset_session(session)
            second = await run_codex_turn(params, app_server=server, idempotency_key="turn-7")
    if elsewhere == "another-codex-home":  # the bound thread is not in this worker's home
        async with AppServer.start(make_appserver_config()) as other:
            second = await run_codex_turn(params, app_server=other, idempotency_key="turn-7")
    assert (first.outcome.value, second.outcome.value) == ("completed", "completed")
    assert second.thread_id != first.thread_id
    users = _user_entries(session)
    assert len(users) == 1, users
    assert users[0]["idempotencyKey"] == "codex-turn:turn-turn-7:prompt"


@pytest.mark.anyio
@pytest.mark.parametrize("key", ["", "a:b", "x" * 129, "sp ace"])
async def test_a_malformed_idempotency_key_is_refused_before_any_io(
    tmp_path: Path, key: str
) -> None:
    class NoServer:  # never reached: the key is checked first
        pass

    with pytest.raises(InvalidTurnParams, match="idempotency_key"):
        await run_codex_turn(
            _params(tmp_path, "hi"),
            app_server=NoServer(),  # type: ignore[arg-type]
            idempotency_key=key,
        )
    assert not (tmp_path / "s.jsonl").exists()
