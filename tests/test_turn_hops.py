"""A turn's worker-thread hops: each costs two thread wake-ups and four event-loop rounds
(~0.2 ms of wall time and of CPU on this project's 2-vCPU machine), so a turn takes only the
ones it needs.

Five for a turn with or without an engine (that does not bootstrap): the session lease, the
preflight with the reads, the prompt (written and fsynced in one hop), the mirror, and the
lease given back. The engine's finalize reads the transcript as the mirror left it in the
mirror's own hop, and that read-back is what it is handed; when it fails, the finalize falls
back to the history read before the turn plus the turn, as before. Run against the in-process
fake app-server on asyncio; every ``anyio.to_thread.run_sync`` is counted, the hops of
:func:`~codex_turn.harness._fs.run_in_worker` and any other.
"""

from __future__ import annotations

from typing import Any

import anyio.to_thread
import pytest
from structlog.testing import capture_logs
from support.engine_sqlite_workload import texts
from support.fake_appserver import FakeAppServer
from support.recording_engine import RecordingEngine
from support.turns import turn_params

from codex_turn import AssembleResult, ContextProjection, TurnOutcome, run_codex_turn
from codex_turn.harness import history_cache
from codex_turn.harness.session import SessionError

pytestmark = pytest.mark.anyio


@pytest.fixture
def hops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of each function handed to a worker thread, in order."""
    names: list[str] = []
    run_sync = anyio.to_thread.run_sync

    async def counted(func: Any, *args: Any, **kwargs: Any) -> Any:
        names.append(getattr(func, "__qualname__", repr(func)))
        return await run_sync(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    return names


def _pass_through() -> RecordingEngine:
    """A thread_bootstrap engine that hands the history back: its thread is kept."""
    return RecordingEngine(
        engine_id="memory",
        omit={"bootstrap", "maintain"},
        responses={
            "assemble": lambda p: AssembleResult(
                messages=p.messages,
                estimated_tokens=0,
                context_projection=ContextProjection(mode="thread_bootstrap", epoch="e1"),
            )
        },
    )


def _server() -> FakeAppServer:
    server = FakeAppServer()
    server.keeps_threads_loaded = True  # as the real client
    return server


def _finalized(logs: list[dict[str, Any]]) -> dict[str, Any]:
    [event] = [e for e in logs if e["event"].startswith("codex context engine finalize ")]
    return {"path": event["path"], "fallback_snapshot": event["fallback_snapshot"]}


async def test_a_turn_without_an_engine_takes_five_hops(session_file: str, hops: list[str]) -> None:
    server = _server()
    await run_codex_turn(turn_params(session_file, "warm up"), app_server=server)
    hops.clear()
    result = await run_codex_turn(turn_params(session_file, "hello"), app_server=server)
    assert result.outcome is TurnOutcome.COMPLETED
    assert len(hops) == 5, hops


async def test_an_engine_turn_takes_five_hops_and_finalizes_what_the_mirror_wrote(
    session_file: str, hops: list[str]
) -> None:
    engine = _pass_through()
    server = _server()
    await run_codex_turn(turn_params(session_file, "warm up"), app_server=server, engine=engine)
    hops.clear()
    engine.reset()
    with capture_logs() as logs:
        result = await run_codex_turn(
            turn_params(session_file, "remember this"), app_server=server, engine=engine
        )
    assert result.outcome is TurnOutcome.COMPLETED
    assert len(hops) == 5, hops  # the finalize's read rode in the mirror's hop
    after_turn = engine.only_call("after_turn").params
    said = texts(after_turn.messages)
    assert "warm up" in said
    assert said[after_turn.pre_prompt_message_count] == "remember this"
    assert len(said) > after_turn.pre_prompt_message_count + 1  # the reply, as mirrored
    assert _finalized(logs) == {"path": "after_turn", "fallback_snapshot": False}


async def test_a_failed_read_back_finalizes_from_the_history_and_the_turn(
    session_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _pass_through()
    server = _server()
    await run_codex_turn(turn_params(session_file, "warm up"), app_server=server, engine=engine)
    engine.reset()
    reads = 0
    real = history_cache.load_session_context

    def read_once(path: str) -> Any:
        nonlocal reads
        reads += 1
        if reads > 1:  # the turn's first read works; the read-back after the mirror fails
            raise SessionError("transcript unreadable")
        return real(path)

    monkeypatch.setattr(history_cache, "load_session_context", read_once)
    with capture_logs() as logs:
        result = await run_codex_turn(
            turn_params(session_file, "remember this"), app_server=server, engine=engine
        )
    assert reads == 2
    assert result.outcome is TurnOutcome.COMPLETED
    after_turn = engine.only_call("after_turn").params
    said = texts(after_turn.messages)
    assert "warm up" in said
    assert said[after_turn.pre_prompt_message_count] == "remember this"
    assert _finalized(logs) == {"path": "after_turn", "fallback_snapshot": True}
