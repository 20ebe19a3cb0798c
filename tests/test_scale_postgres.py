"""codex_turn.scale on Postgres with many worker processes.

The fixture starts a private Postgres cluster for this module (``pgserver``, Postgres built
for PyPI: no Docker, no system package) and gives each test a database of its own.
"""

from __future__ import annotations

import itertools
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_scale import _messages, _params, _start_worker, _texts, _wait_log

from codex_turn.scale import TurnQueue, TurnRecord

pytestmark = pytest.mark.codex


@pytest.fixture(scope="module")
def postgres_cluster() -> Iterator[Any]:
    """A running cluster for this module (``pgserver``: Postgres from PyPI, so a machine
    with only Python runs these tests; as root it runs the server as its own user)."""
    import pgserver

    root = tempfile.mkdtemp(prefix="codex-turn-pg-")
    with pytest.MonkeyPatch.context() as patch:
        # pgserver asks platformdirs for a runtime directory; without one it warns.
        patch.setenv("XDG_RUNTIME_DIR", root)
        server = pgserver.get_server(root, cleanup_mode="stop")
        try:
            yield server
        finally:
            server.cleanup()
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pg_url(postgres_cluster: Any) -> str:
    """A new database of the cluster, for one test."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_cluster.get_uri("postgres"), autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {name}")
    url: str = postgres_cluster.get_uri(name)
    return url


def _wait(predicate: object, timeout: float) -> None:
    start = time.monotonic()
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.05)


def test_three_workers_on_postgres_run_each_turn_once_in_session_order(
    tmp_path: Path, pg_url: str
) -> None:
    sessions, turns = 6, 4
    with TurnQueue(pg_url) as queue:
        logs = [tmp_path / f"w{i}.log" for i in range(3)]
        workers = [
            _start_worker(pg_url, log, "--executor-id", f"w{i}", cwd=tmp_path)
            for i, log in enumerate(logs)
        ]
        try:
            for i, log in enumerate(logs):
                _wait_log(log, f"executor w{i}")
            handles = [
                queue.submit(_params(tmp_path, f"s{s}", f"s{s} turn {n}"), turn_id=f"s{s}-{n}")
                for n in range(1, turns + 1)
                for s in range(sessions)
            ]
            records: dict[str, TurnRecord] = {h.turn_id: h.result(timeout=120) for h in handles}
        finally:
            for worker in workers:
                worker.send_signal(signal.SIGTERM)
            codes = [worker.wait(timeout=30) for worker in workers]
    assert codes == [0, 0, 0], [log.read_text() for log in logs]
    assert {r.outcome for r in records.values()} == {"completed"}
    assert {r.source for r in records.values()} == {"ran"}
    assert len({r.executor_id for r in records.values()}) >= 2  # the work was shared
    for s in range(sessions):
        session = tmp_path / f"s{s}.jsonl"
        prompts = [f"s{s} turn {n}" for n in range(1, turns + 1)]
        assert _texts(session, "user") == prompts  # each once, in order
        replies = _texts(session, "assistant")
        assert len(replies) == turns
        assert all(reply.endswith(prompt) for reply, prompt in zip(replies, prompts, strict=True))
        keys = [m.get("idempotencyKey") for m in _messages(session)]
        assert len(keys) == len(set(keys))
        spans = [records[f"s{s}-{n}"] for n in range(1, turns + 1)]
        for earlier, later in itertools.pairwise(spans):
            assert earlier.ended_at <= later.started_at  # never two turns of a session at once
        # Sticky: every turn of a session on the worker that ran its first one.
        assert [r.locality for r in spans] == ["first"] + ["sticky"] * (turns - 1)
        assert len({r.executor_id for r in spans}) == 1


def test_a_live_peer_on_postgres_recovers_a_sigkilled_workers_turn(
    tmp_path: Path, pg_url: str
) -> None:
    """A live peer's sweep on Postgres: w0's advisory lock goes with its connection."""
    session = tmp_path / "s1.jsonl"
    log0, log1 = tmp_path / "w0.log", tmp_path / "w1.log"
    with TurnQueue(pg_url) as queue:
        w0 = _start_worker(
            pg_url, log0, "--executor-id", "w0", "--offline-delay", "60", cwd=tmp_path
        )
        w1: subprocess.Popen[bytes] | None = None
        try:
            _wait_log(log0, "executor w0")
            handle = queue.submit(_params(tmp_path, "s1", "turn one"), turn_id="pg-1")
            _wait(lambda: session.exists() and "turn one" in session.read_text(), 30)
            w1 = _start_worker(pg_url, log1, "--executor-id", "w1", cwd=tmp_path)
            _wait_log(log1, "executor w1")
            w0.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            w0.wait(timeout=10)  # reaped: a zombie's pid would still hold the session lease
            _wait(lambda: handle.status().executor_id == "w1", 10)
            resumed = time.monotonic() - killed
            record = handle.result(timeout=60)
        finally:
            for worker in (w0, w1):
                if worker is not None and worker.poll() is None:
                    worker.send_signal(signal.SIGTERM)
            for worker in (w0, w1):
                if worker is not None:
                    worker.wait(timeout=30)
    print(f"recovery on Postgres: SIGKILL to the turn resuming on the peer in {resumed:.2f} s")
    assert resumed <= 2.0
    assert (record.outcome, record.executor_id) == ("completed", "w1")
    assert _texts(session, "user") == ["turn one"]
    assert len(_texts(session, "assistant")) == 1


def test_a_worker_that_loses_its_postgres_lock_stops_taking_turns_loudly(
    pg_url: str, postgres_cluster: Any
) -> None:
    """The session-level advisory lock dies with its connection: the sweeper notices."""
    import anyio
    import psycopg

    from codex_turn.scale import ExecutorLockLost, TurnWorker
    from codex_turn.scale._locks import liveness_for

    class NoServer:  # no turn is queued: the worker never uses it
        pass

    async def scenario() -> None:
        worker = TurnWorker(
            pg_url,
            app_server=NoServer(),  # type: ignore[arg-type]
            executor_id="w1",
            watchdog_interval=0.1,
        )
        async with worker:
            locks: Any = worker.liveness
            locks.verify()  # held, verified on its connection
            assert not worker.lock_lost.is_set()
            with psycopg.connect(pg_url, autocommit=True) as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(%s)", (locks.connection.info.backend_pid,)
                )
            with anyio.fail_after(10):
                while not worker.lock_lost.is_set():  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            with pytest.raises(ExecutorLockLost):
                locks.verify()
            # A peer can take the lock now: the worker took no turn since (its queue
            # threads were stopped when the loss was seen).
            peer = liveness_for(pg_url)
            try:
                with peer.claim("w1") as dead:
                    assert dead
            finally:
                peer.release()

    anyio.run(scenario, backend="asyncio")
