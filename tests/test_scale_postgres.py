"""codex_turn.scale on Postgres with many worker processes.

The fixture starts a private Postgres cluster (the Debian ``postgresql`` binaries, no Docker)
on a free port for this module and gives each test a database of its own. The binaries must
be there: a machine without them fails these tests loudly rather than skipping them.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_scale import _messages, _params, _start_worker, _texts, _wait_log

from codex_turn.scale import TurnQueue, TurnRecord

pytestmark = pytest.mark.codex

_PG_BIN_DIRS = ("/usr/local/bin", "/usr/lib/postgresql/15/bin")


def _pg_binary(name: str) -> str:
    for directory in _PG_BIN_DIRS:
        path = os.path.join(directory, name)
        if os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"Postgres binary {name!r} not found in {_PG_BIN_DIRS} or PATH")
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _as_postgres_user(command: list[str]) -> list[str]:
    """Postgres refuses to run as root: as root, run it as the ``postgres`` user."""
    if os.geteuid() != 0:
        return command
    return ["runuser", "-u", "postgres", "--", *command]


@pytest.fixture(scope="module")
def postgres_cluster() -> Iterator[str]:
    """A running cluster for this module: its base URL (no database name)."""
    initdb, pg_ctl = _pg_binary("initdb"), _pg_binary("pg_ctl")
    root = tempfile.mkdtemp(prefix="codex-turn-pg-")
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    data, port = os.path.join(root, "data"), _free_port()
    subprocess.run(
        _as_postgres_user([initdb, "-D", data, "-U", "postgres", "-A", "trust", "--no-sync"]),
        check=True,
        capture_output=True,
    )
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run(
        _as_postgres_user(
            [pg_ctl, "-D", data, "-l", os.path.join(root, "log"), "-o", options, "-w", "start"]
        ),
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        subprocess.run(
            _as_postgres_user([pg_ctl, "-D", data, "-m", "immediate", "-w", "stop"]),
            check=False,
            capture_output=True,
        )
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pg_url(postgres_cluster: str) -> str:
    """A new database of the cluster, for one test."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{postgres_cluster}/postgres", autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {name}")
    return f"{postgres_cluster}/{name}"


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


def test_a_live_peer_on_postgres_recovers_a_sigkilled_workers_turn(
    tmp_path: Path, pg_url: str
) -> None:
    """The watchdog on Postgres: w0's advisory lock goes with its connection."""
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
