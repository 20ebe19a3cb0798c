"""codex_turn.scale's liveness locks (:mod:`codex_turn.scale._locks`): a worker's alive lock
held by the worker is never claimed, a dead worker's is claimed by one peer at a time (and a
worker restarted under its id waits for that claim); the serving probe takes nothing and says
whether a worker takes forwarded turns. Lock files (SQLite) and advisory locks (Postgres)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import pytest
from test_scale_postgres import pg_url, postgres_cluster  # noqa: F401 (fixtures)

from codex_turn.scale import ExecutorIdInUse
from codex_turn.scale._locks import FileLiveness, Liveness, PostgresLiveness


def _die(locks: FileLiveness) -> None:
    """As the OS does when the holder dies: its locks go, its files stay."""
    for fd in (locks._alive, locks._serving):
        assert fd is not None
        os.close(fd)
    locks._alive = locks._serving = None


def _check(home: Liveness, other: Liveness, peer: Liveness, prober: Liveness, die: Any) -> None:
    home.hold("w1", 1)
    other.hold("w2", 1)
    assert prober.serving("w1")
    assert prober.serving("w2")
    with peer.claim("w1") as dead:
        assert not dead  # its live worker holds it
    with home.claim("w1") as dead:
        assert not dead  # never its own
    other.stop_serving()  # w2 drains: alive, takes no forwarded turn
    assert not prober.serving("w2")
    with peer.claim("w2") as dead:
        assert not dead
    die(home)
    assert not prober.serving("w1")
    with peer.claim("w1") as dead:
        assert dead
        with prober.claim("w1") as also:
            assert not also  # one claimer at a time
        with pytest.raises(ExecutorIdInUse):
            prober.hold("w1", 0.2)  # a restart waits for the claim
    again = type(prober)(*_args(prober))
    again.hold("w1", 1)  # restarted
    assert prober.serving("w1")
    again.release()
    other.release()


def _args(liveness: Liveness) -> tuple[str]:
    if isinstance(liveness, FileLiveness):
        return (liveness.directory,)
    return (liveness.url,)


def test_lock_files(tmp_path: Path) -> None:
    directory = str(tmp_path / "turns.sqlite.executors")
    home, other, peer, prober = (FileLiveness(directory) for _ in range(4))
    _check(home, other, peer, prober, _die)
    assert not (tmp_path / "turns.sqlite.executors" / "w1.lock").exists()  # claimer unlinked


def test_advisory_locks(pg_url: str, postgres_cluster: Any) -> None:  # noqa: F811
    import uuid

    import psycopg

    elsewhere = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_cluster.get_uri("postgres"), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {elsewhere}")
    locks = [PostgresLiveness(pg_url) for _ in range(4)]
    foreign = PostgresLiveness(postgres_cluster.get_uri(elsewhere))
    try:
        foreign.hold("w3", 1)
        assert not locks[3].serving("w3")  # held in another database: not this one's worker

        def die(liveness: PostgresLiveness) -> None:
            liveness.release()  # its connection ends; the server drops its locks just after
            deadline = time.monotonic() + 10
            while locks[3].serving("w1"):
                assert time.monotonic() < deadline
                time.sleep(0.01)

        _check(*locks, die=die)
    finally:
        for liveness in [*locks, foreign]:
            with contextlib.suppress(Exception):
                liveness.release()
