"""Exactly-once turns by a host's turn id: ``run_codex_turn(..., idempotency_key=K)`` decides
"already ran?" under the session hold, before any stage, and raises
:class:`TurnAlreadyCompleted` with the recorded reply (nothing sent to Codex, nothing written).

The bug this guards against: the check ran before the hold, so a re-run that started while the
original attempt was mid-turn saw no reply yet, waited for the hold, then ran the whole Codex
turn again (two model requests, two replies).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.fake_appserver import CodexScript, FakeAppServer
from support.turns import temporary_session_file, turn_params

from codex_turn import AppServer, AppServerConfig, TurnParams, TurnResult, run_codex_turn
from codex_turn.harness.appserver import TurnHandle
from codex_turn.harness.idempotency import (
    TurnAlreadyCompleted,
    completed_turn,
    stable_prompt_key,
)
from codex_turn.harness.session import mirror_prompt, mirror_turn
from codex_turn.testing import OfflineModel, Reply


def _messages(session_file: str | Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in Path(session_file).read_text().splitlines() if line]
    return [line["message"] for line in lines if line.get("type") == "message"]


class _GatedTurns(FakeAppServer):
    """The fake app-server whose turns wait for ``release`` (an attempt held mid-turn)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.entered = anyio.Event()
        self.release = anyio.Event()

    @contextlib.asynccontextmanager
    async def turn(self, *args: Any, **kwargs: Any) -> AsyncIterator[TurnHandle]:
        self.entered.set()
        await self.release.wait()
        async with super().turn(*args, **kwargs) as handle:
            yield handle


async def _attempt(
    params: TurnParams, server: Any, key: str, out: list[TurnResult | TurnAlreadyCompleted]
) -> None:
    try:
        out.append(await run_codex_turn(params, app_server=server, idempotency_key=key))
    except TurnAlreadyCompleted as done:
        out.append(done)


@pytest.mark.anyio
async def test_a_rerun_overlapping_the_running_attempt_finds_its_reply_under_the_hold() -> None:
    server = _GatedTurns(scripts=[CodexScript(reply="once"), CodexScript(reply="twice")])
    with temporary_session_file("exactly-once-") as session:
        params = turn_params(session, "do the thing once")
        out: list[TurnResult | TurnAlreadyCompleted] = []
        async with anyio.create_task_group() as group:
            group.start_soon(_attempt, params, server, "t-1", out)
            await server.entered.wait()  # the original attempt is mid-turn, holding the session
            group.start_soon(_attempt, params, server, "t-1", out)  # the recovered re-run
            await anyio.sleep(0.2)  # the re-run now waits for the hold
            server.release.set()
        first, second = out
        assert isinstance(first, TurnResult)
        assert first.assistant_text == "once"
        assert isinstance(second, TurnAlreadyCompleted)
        assert second.assistant_text == "once"
        assert second.thread_id == first.thread_id
        assert second.codex_turn_id == first.turn_id
        assert second.completed.prompt_key == stable_prompt_key("t-1")
        assert server.methods().count("turn") == 1
        assert [m["role"] for m in _messages(session)] == ["user", "assistant"]


@pytest.mark.anyio
async def test_a_completed_key_is_refused_before_anything_is_written_or_sent() -> None:
    server = FakeAppServer(scripts=[CodexScript(reply="first")])
    with temporary_session_file("exactly-once-") as session:
        params = turn_params(session, "hi")
        await run_codex_turn(params, app_server=server, idempotency_key="k")
        before = await anyio.Path(session).read_bytes()
        calls = server.methods()
        with pytest.raises(TurnAlreadyCompleted) as refused:
            await run_codex_turn(params, app_server=server, idempotency_key="k")
        assert refused.value.assistant_text == "first"
        assert await anyio.Path(session).read_bytes() == before
        assert server.methods() == calls
        # Another key (or none) is another turn.
        other = await run_codex_turn(params, app_server=server, idempotency_key="k2")
        assert other.outcome.value == "completed"


@pytest.mark.anyio
async def test_a_prompt_with_no_reply_runs_the_turn_and_writes_the_prompt_once() -> None:
    """The attempt died mid-turn (its prompt is durable, its reply is not): the turn runs."""
    server = FakeAppServer(scripts=[CodexScript(reply="now")])
    with temporary_session_file("exactly-once-") as session:
        params = turn_params(session, "ship it")
        mirror_prompt(
            session,
            {"role": "user", "content": "ship it", "idempotencyKey": stable_prompt_key("t-7")},
            scope="codex-app-server:dead-thread",
            identity="turn-t-7:prompt",
            session_id="s-1",
            cwd=str(Path(session).parent),
        )
        assert completed_turn(session, "t-7") is None
        result = await run_codex_turn(params, app_server=server, idempotency_key="t-7")
        assert result.assistant_text == "now"
        assert [m["role"] for m in _messages(session)] == ["user", "assistant"]
        done = completed_turn(session, "t-7")
        assert done is not None
        assert done.assistant_text == "now"


def _mirror(session: str, messages: Sequence[dict[str, Any]], identities: Sequence[str]) -> None:
    mirror_turn(
        session,
        messages,
        scope="codex-app-server:th-1",
        identities=identities,
        session_id="s-1",
        cwd=str(Path(session).parent),
    )


def test_completed_turn_reads_the_reply_after_the_turns_steered_messages() -> None:
    with temporary_session_file("exactly-once-") as session:
        assistant = {"role": "assistant", "content": [{"type": "text", "text": "answer"}]}
        _mirror(
            session,
            [
                {"role": "user", "content": "p", "idempotencyKey": stable_prompt_key("K")},
                {"role": "user", "content": "and also"},
                {**assistant, "content": [{"type": "text", "text": "[reasoning] hm"}]},
                assistant,
            ],
            ["turn-K:prompt", "turn-K:steer-0", "ct-1:reasoning", "ct-1:assistant"],
        )
        done = completed_turn(session, "K")
        assert done is not None
        assert (done.assistant_text, done.thread_id, done.codex_turn_id) == (
            "answer",
            "th-1",
            "ct-1",
        )
        assert completed_turn(session, "other") is None
        # The next turn's prompt ends the search: its reply is not this turn's.
        _mirror(session, [{"role": "user", "content": "q"}, assistant], ["x:prompt", "x:assistant"])
        again = completed_turn(session, "K")
        assert again is not None
        assert again.reply_entry_id == done.reply_entry_id


def test_completed_turn_of_an_unanswered_prompt_or_missing_file_is_none(tmp_path: Path) -> None:
    assert completed_turn(tmp_path / "missing.jsonl", "K") is None
    with temporary_session_file("exactly-once-") as session:
        _mirror(
            session,
            [
                {"role": "user", "content": "p", "idempotencyKey": stable_prompt_key("K")},
                {"role": "user", "content": "next"},
                {"role": "assistant", "content": "of the next turn"},
            ],
            ["turn-K:prompt", "y:prompt", "y:assistant"],
        )
        assert completed_turn(session, "K") is None


@pytest.mark.codex
@pytest.mark.anyio
async def test_two_overlapping_runs_of_one_turn_ask_the_real_codex_once(
    tmp_path: Path,
    offline_model: OfflineModel,
    make_appserver_config: Callable[..., AppServerConfig],
) -> None:
    """The reviewer's scenario: the same key 0.5 s apart against the real binary."""
    offline_model.script(Reply.fixed("reply", delay=2.0), times=5)
    params = TurnParams(
        session_id="s1",
        session_key="agent:main:s1",
        session_file=tmp_path / "s1.jsonl",
        workspace_dir=tmp_path,
        prompt="do the thing once",
    )
    out: list[TurnResult | TurnAlreadyCompleted] = []
    async with (
        AppServer.start(make_appserver_config()) as server,
        anyio.create_task_group() as group,
    ):
        group.start_soon(_attempt, params, server, "t-1", out)
        await anyio.sleep(0.5)  # the original attempt is mid-turn (session held)
        group.start_soon(_attempt, params, server, "t-1", out)
    roles = [m["role"] for m in _messages(tmp_path / "s1.jsonl")]
    assert roles == ["user", "assistant"], (out, roles)
    assert len(offline_model.requests) == 1
    first, second = out
    assert isinstance(first, TurnResult)
    assert first.assistant_text == "reply"
    assert isinstance(second, TurnAlreadyCompleted)
    assert second.assistant_text == "reply"
    assert second.thread_id == first.thread_id
