"""codex_turn.scale on DBOS, embedded SQLite: the queue, the worker, a crash.

Every turn here runs through the real ``codex app-server`` against the offline model. The
in-process worker runs on asyncio (DBOS runs async workflows on asyncio's loop); the crash
tests run ``codex-turn worker`` processes and SIGKILL them.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from codex_turn import (
    AppServer,
    AppServerConfig,
    CollaborationInstructions,
    TurnParams,
    run_codex_turn,
)
from codex_turn.scale import (
    TurnQueue,
    TurnRecord,
    TurnWorker,
    mirrored_turn,
    params_from_wire,
    params_to_wire,
    session_lane,
)
from codex_turn.testing import OfflineModel, Reply

pytestmark = pytest.mark.codex

CLI = Path(sys.executable).parent / "codex-turn"


def _params(tmp_path: Path, session: str, prompt: str) -> TurnParams:
    return TurnParams(
        session_id=session,
        session_key=f"agent:main:{session}",
        session_file=tmp_path / f"{session}.jsonl",
        workspace_dir=tmp_path,
        prompt=prompt,
    )


def _messages(session_file: Path) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in session_file.read_text().splitlines() if line.strip()]
    return [line["message"] for line in lines if line.get("type") == "message"]


def _texts(session_file: Path, role: str) -> list[str]:
    texts = []
    for message in _messages(session_file):
        if message.get("role") != role:
            continue
        content = message["content"]
        parts = [content] if isinstance(content, str) else content
        texts.append("".join(p if isinstance(p, str) else p.get("text", "") for p in parts))  # type: ignore[union-attr]
    return texts


def test_params_cross_the_queue_as_json_values(tmp_path: Path) -> None:
    params = TurnParams(
        session_id="s",
        session_file=tmp_path / "s.jsonl",
        workspace_dir=tmp_path,
        prompt="hi",
        images=["data:image/png;base64,AAAA"],
        runtime_attempt={"attempt": 1, "nested": {"a": [1, 2]}},
        output_schema={"type": "object"},
        heartbeat=True,
        heartbeat_file=tmp_path / "HEARTBEAT.md",
        collaboration=CollaborationInstructions(skills_catalog="skills", memory_tools=("m",)),
        steering="collect",
        tool_catalog="namespaced",
    )
    wire = params_to_wire(params)
    assert json.loads(json.dumps(wire)) == wire
    again = params_from_wire(wire)
    assert params_to_wire(again) == wire
    assert again.collaboration == params.collaboration
    assert session_lane(params) == "s"


@pytest.mark.anyio
async def test_submit_is_idempotent_and_the_result_is_read_by_turn_id_from_another_process(
    tmp_path: Path,
    db_url: str,
    queue: TurnQueue,
    offline_model: OfflineModel,
    make_appserver_config: Callable[..., AppServerConfig],
) -> None:
    offline_model.script(Reply.fixed("Friday it is."))
    first = await queue.submit_async(_params(tmp_path, "s1", "ship on Friday?"), turn_id="t-1")
    # The same turn id again (other params even): the same turn, never a second run.
    again = await queue.submit_async(_params(tmp_path, "s1", "something else"), turn_id="t-1")
    assert again.turn_id == first.turn_id
    assert first.status().state == "enqueued"
    async with (
        AppServer.start(make_appserver_config()) as server,
        TurnWorker(db_url, app_server=server),
    ):
        record = await first.result_async()
        assert (await again.result_async()) == record
    assert record.outcome == "completed"
    assert record.assistant_text == "Friday it is."
    assert record.source == "ran"
    assert record.trace[0] == "started"
    assert record.trace[-1] in ("finalized", "maintenance_ran", "maintenance_skipped")
    assert _texts(tmp_path / "s1.jsonl", "user") == ["ship on Friday?"]
    assert len(offline_model.requests) == 1
    assert queue.submit(_params(tmp_path, "s1", "x"), turn_id="t-1").result() == record
    # Another process, by the turn id alone.
    script = (
        "import json, sys; from codex_turn.scale import TurnQueue; "
        "q = TurnQueue(sys.argv[1]); h = q.handle('t-1'); "
        "print(json.dumps([h.status().state, h.result(timeout=5).to_wire()]))"
    )
    done = await anyio.run_process([sys.executable, "-c", script, db_url], check=False)
    assert done.returncode == 0, done.stderr.decode()
    state, wire = json.loads(done.stdout)
    assert state == "completed"
    assert TurnRecord.from_wire(wire) == record
    with pytest.raises(KeyError):
        queue.handle("t-never")


@pytest.mark.anyio
async def test_turns_of_one_session_run_in_order_two_sessions_interleaved(
    tmp_path: Path,
    db_url: str,
    queue: TurnQueue,
    offline_model: OfflineModel,
    make_appserver_config: Callable[..., AppServerConfig],
) -> None:
    offline_model.script(Reply.echo(delay=0.05), times=100)
    order = [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3), ("b", 3)]
    handles = [
        await queue.submit_async(_params(tmp_path, s, f"{s} turn {n}"), turn_id=f"{s}-{n}")
        for s, n in order
    ]
    async with (
        AppServer.start(make_appserver_config()) as server,
        TurnWorker(db_url, app_server=server),
    ):
        records = {h.turn_id: await h.result_async() for h in handles}
    assert {r.outcome for r in records.values()} == {"completed"}
    for session in ("a", "b"):
        prompts = [f"{session} turn {n}" for n in (1, 2, 3)]
        assert _texts(tmp_path / f"{session}.jsonl", "user") == prompts
        assert _texts(tmp_path / f"{session}.jsonl", "assistant") == [f"ECHO: {p}" for p in prompts]
        spans = [records[f"{session}-{n}"] for n in (1, 2, 3)]
        for earlier, later in itertools.pairwise(spans):
            assert earlier.ended_at <= later.started_at  # never two turns of a session at once


@pytest.mark.anyio
async def test_a_turn_already_in_the_transcript_is_not_run_again(
    tmp_path: Path,
    db_url: str,
    queue: TurnQueue,
    offline_model: OfflineModel,
    make_appserver_config: Callable[..., AppServerConfig],
) -> None:
    """The crash window between the mirror and DBOS's checkpoint: the reply is there."""
    offline_model.script(Reply.fixed("done once"))
    params = _params(tmp_path, "s1", "do it")
    session = tmp_path / "s1.jsonl"
    async with AppServer.start(make_appserver_config()) as server:
        # What the attempt that died did: the whole turn, under the turn id's identity.
        await run_codex_turn(params, app_server=server, idempotency_key="t-9")
        assert mirrored_turn(session, "t-9") is not None
        assert mirrored_turn(session, "t-other") is None
        before = session.read_bytes()
        async with TurnWorker(db_url, app_server=server):
            record = await (await queue.submit_async(params, turn_id="t-9")).result_async()
    assert record.source == "already_mirrored"
    assert record.assistant_text == "done once"
    assert record.thread_id is not None
    assert record.codex_turn_id is not None
    assert session.read_bytes() == before
    assert len(offline_model.requests) == 1


def _start_worker(
    db_url: str, log: Path, *extra: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(CLI), "worker", "--db", db_url, "--offline", "--engine", "sqlite", *extra],
        stdout=subprocess.DEVNULL,
        stderr=log.open("ab"),
        cwd=cwd,
        env=None if env is None else {**os.environ, **env},
    )


def _wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_worker_sigkilled_mid_turn_completes_the_turn_exactly_once_after_restart(
    tmp_path: Path, db_url: str, queue: TurnQueue
) -> None:
    log = tmp_path / "worker.log"
    session = tmp_path / "s1.jsonl"
    worker = _start_worker(db_url, log, "--offline-delay", "60")  # stuck in the model
    try:
        queue.submit(_params(tmp_path, "s1", "turn one"), turn_id="k-1")
        second = queue.submit(_params(tmp_path, "s1", "turn two"), turn_id="k-2")
        # The prompt is durable before turn/start: the turn is in Codex's hands.
        _wait_for(lambda: session.exists() and "turn one" in session.read_text())
        assert queue.handle("k-1").status().state == "running"
        assert second.status().state == "enqueued"  # its session is busy
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
        worker = _start_worker(db_url, log)  # the same executor id: it recovers k-1
        first = queue.handle("k-1").result(timeout=60)
        last = second.result(timeout=60)
    finally:
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=30)
    assert code == 0, log.read_text()
    assert (first.outcome, last.outcome) == ("completed", "completed")
    assert first.thread_action == "resume"  # the binding the dead attempt wrote
    assert _texts(session, "user") == ["turn one", "turn two"]
    replies = _texts(session, "assistant")  # the echo model: each reply ends with its prompt
    assert len(replies) == 2
    assert replies[0].endswith("turn one")
    assert replies[1].endswith("turn two")
    keys = [m.get("idempotencyKey") for m in _messages(session)]
    assert len(keys) == len(set(keys))
    assert "drained" in log.read_text()


def test_sigterm_drains_the_turn_in_flight_then_exits(
    tmp_path: Path, db_url: str, queue: TurnQueue
) -> None:
    log = tmp_path / "worker.log"
    session = tmp_path / "s1.jsonl"
    worker = _start_worker(db_url, log, "--offline-delay", "1.5")
    try:
        handle = queue.submit(_params(tmp_path, "s1", "finish me"), turn_id="d-1")
        waiting = queue.submit(_params(tmp_path, "s1", "not taken"), turn_id="d-2")
        _wait_for(lambda: session.exists() and "finish me" in session.read_text())
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGKILL)
    assert code == 0, log.read_text()
    assert handle.status().state == "completed"
    assert handle.result().assistant_text == "ECHO: finish me"
    assert waiting.status().state == "enqueued"  # left in the queue for the next worker
    assert "drained" in log.read_text()


def _log_size(log: Path) -> int:
    """Where a (re)started process's lines begin in its append-mode log."""
    return log.stat().st_size if log.exists() else 0


def _wait_log(log: Path, text: str, timeout: float = 30.0, *, since: int = 0) -> None:
    """Wait for ``text`` in ``log`` after its first ``since`` bytes (a restarted process's
    own lines, not the ones its predecessor left)."""
    needle = text.encode()
    _wait_for(lambda: log.exists() and needle in log.read_bytes()[since:], timeout)


def test_a_live_peer_recovers_the_turn_of_a_sigkilled_worker_exactly_once(
    tmp_path: Path, db_url: str, queue: TurnQueue
) -> None:
    """The executor watchdog: w1 dies mid-turn and never comes back; w2 finishes its turn."""
    log1, log2 = tmp_path / "w1.log", tmp_path / "w2.log"
    session = tmp_path / "s1.jsonl"
    w1 = _start_worker(db_url, log1, "--executor-id", "w1", "--offline-delay", "60")
    w2: subprocess.Popen[bytes] | None = None
    try:
        _wait_log(log1, "executor w1")
        first = queue.submit(_params(tmp_path, "s1", "turn one"), turn_id="p-1")
        second = queue.submit(_params(tmp_path, "s1", "turn two"), turn_id="p-2")
        _wait_for(lambda: session.exists() and "turn one" in session.read_text())
        assert first.status().executor_id == "w1"
        w2 = _start_worker(db_url, log2, "--executor-id", "w2")
        _wait_log(log2, "executor w2")
        assert (first.status().state, second.status().state) == ("running", "enqueued")
        w1.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        w1.wait(timeout=10)
        # Recovered: the turn runs again, on the live peer.
        took = _wait_for(lambda: first.status().executor_id == "w2", timeout=10)
        resumed = time.monotonic() - killed
        records = [first.result(timeout=60), second.result(timeout=60)]
    finally:
        for worker in (w1, w2):
            if worker is not None and worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
        codes = [w.wait(timeout=30) for w in (w1, w2) if w is not None]
    assert codes[-1] == 0, log2.read_text()
    print(f"recovery: SIGKILL to the turn resuming on the peer in {resumed:.2f} s")
    assert took <= resumed <= 2.0
    assert [r.outcome for r in records] == ["completed", "completed"]
    assert [r.executor_id for r in records] == ["w2", "w2"]
    assert _texts(session, "user") == ["turn one", "turn two"]
    replies = _texts(session, "assistant")
    assert len(replies) == 2
    assert replies[0].endswith("turn one")
    assert replies[1].endswith("turn two")
    keys = [m.get("idempotencyKey") for m in _messages(session)]
    assert len(keys) == len(set(keys))
    # w2's Codex home never held w1's thread: a fresh thread, the context re-projected.
    assert records[0].thread_action == "rotate", records[0].thread_reason
    assert not (tmp_path / "turns.sqlite.executors" / "w1.lock").exists()


def test_one_live_worker_per_executor_id(tmp_path: Path, db_url: str) -> None:
    log = tmp_path / "w.log"
    worker = _start_worker(db_url, log, "--executor-id", "same")
    try:
        _wait_log(log, "executor same")
        script = (
            "import anyio, sys\n"
            "from codex_turn.scale import TurnWorker\n"
            "from codex_turn.scale import ExecutorIdInUse\n"
            "async def main():\n"
            "    try:\n"
            "        async with TurnWorker(sys.argv[1], app_server=None, executor_id='same',"
            " hold_timeout=0.2):\n"
            "            pass\n"
            "    except ExecutorIdInUse as error:\n"
            "        print(error)\n"
            "anyio.run(main, backend='asyncio')\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script, db_url], capture_output=True, timeout=60, check=False
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
    assert f"pid {worker.pid}" in done.stdout.decode(), done.stderr.decode()


@pytest.mark.anyio
async def test_a_drain_that_times_out_keeps_the_executor_lock_until_the_turn_ends(
    tmp_path: Path,
    db_url: str,
    queue: TurnQueue,
    offline_model: OfflineModel,
    make_appserver_config: Callable[..., AppServerConfig],
) -> None:
    """DBOS's shutdown does not cancel a turn: released then, a peer would re-run it."""
    from codex_turn.scale._locks import liveness_for

    offline_model.script(Reply.fixed("late reply", delay=3.0))
    await queue.submit_async(_params(tmp_path, "s1", "long one"), turn_id="t-1")
    peer = liveness_for(db_url)
    async with AppServer.start(make_appserver_config()) as server:
        worker = TurnWorker(db_url, app_server=server, executor_id="w1", watchdog_interval=None)
        await worker.__aenter__()
        while worker.in_flight == 0:  # noqa: ASYNC110
            await anyio.sleep(0.05)
        assert not await worker.drain(grace=0.5)  # the turn is still running
        assert worker.in_flight == 1
        with peer.claim("w1") as dead:
            assert not dead  # the lock is kept: no peer may recover the running turn
        assert not worker.lock_released.is_set()
        with anyio.fail_after(30):
            while not worker.lock_released.is_set():  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert worker.in_flight == 0
    with peer.claim("w1") as dead:
        assert dead  # released once the turn ended
    assert _texts(tmp_path / "s1.jsonl", "assistant") == ["late reply"]
    assert len(offline_model.requests) == 1
