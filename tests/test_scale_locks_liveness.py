"""codex_turn.scale's liveness probe (``ExecutorLocks.alive``): a worker's lock held by a
peer's claim (its watchdog cleaning up after the dead worker) or only by a process that
inherited the dead worker's open lock file reads as dead; a lock its live worker holds reads
as alive. Lock files (SQLite) and advisory locks (Postgres)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from test_scale_postgres import pg_url, postgres_cluster  # noqa: F401 (fixtures)

from codex_turn.scale._locks import FileExecutorLocks, PostgresExecutorLocks


def _die(locks: FileExecutorLocks) -> None:
    """As the OS does when the holder dies: its lock goes, its file and record stay."""
    fd, locks._fd, locks._path = locks._fd, None, None
    assert fd is not None
    os.close(fd)


def test_a_claim_on_a_dead_workers_lock_file_reads_dead_to_the_probe(tmp_path: Path) -> None:
    directory = str(tmp_path / "turns.sqlite.executors")
    home, other, watchdog, prober = (FileExecutorLocks(directory) for _ in range(4))
    home.hold("w1", 1)
    other.hold("w2", 1)
    try:
        assert prober.alive("w1")  # held by their (live) holders
        assert prober.alive("w2")
        assert home.alive("w1")  # its own
        _die(home)  # its record still names a live pid: only the claim's mark tells
        with watchdog.claim("w1") as dead:
            assert dead
            assert not prober.alive("w1")  # the claim holds it: its holder is dead
            with prober.claim("w1") as also:
                assert not also  # the claim still excludes every other claim
        assert not prober.alive("w1")  # free
        with watchdog.claim("w2") as dead:
            assert not dead
        assert prober.alive("w2")  # a failed claim leaves the holder's record alone
    finally:
        other.release()


_HOLDER = """
import os, sys, time
from codex_turn.scale._locks import FileExecutorLocks
FileExecutorLocks(sys.argv[1]).hold("w1", 5)
child = os.fork()
if child == 0:  # forked without exec: keeps the open lock file, and with it the flock
    time.sleep(120)
    os._exit(0)
print(child, flush=True)
time.sleep(120)
"""


def test_a_lock_kept_only_by_a_forked_child_of_its_dead_holder_reads_dead(
    tmp_path: Path,
) -> None:
    directory = str(tmp_path / "turns.sqlite.executors")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, directory], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    child = int(holder.stdout.readline())
    prober = FileExecutorLocks(directory)
    try:
        assert prober.alive("w1")
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)  # reaped
        with prober.claim("w1") as dead:
            assert not dead  # the child's copy of the open file keeps the flock
        assert not prober.alive("w1")  # but the pid that took it is gone
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=10)
        holder.stdout.close()


def test_a_claim_on_a_dead_workers_postgres_lock_reads_dead_to_the_probe(
    pg_url: str,  # noqa: F811
    postgres_cluster: Any,  # noqa: F811
) -> None:
    import uuid

    import psycopg

    elsewhere = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_cluster.get_uri("postgres"), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {elsewhere}")
    home, other, watchdog, prober = (PostgresExecutorLocks(pg_url) for _ in range(4))
    foreign = PostgresExecutorLocks(postgres_cluster.get_uri(elsewhere))
    try:
        home.hold("w1", 1)
        other.hold("w2", 1)
        foreign.hold("w3", 1)
        assert prober.alive("w1")
        assert prober.alive("w2")
        assert home.alive("w1")
        assert not prober.alive("w3")  # held in another database: not this one's worker
        home.release()  # dies: its connection ends
        assert not prober.alive("w1")
        with watchdog.claim("w1") as dead:
            assert dead
            assert not prober.alive("w1")  # the claim holds it: its holder is dead
            with prober.claim("w1") as also:
                assert not also
        with watchdog.claim("w2") as dead:
            assert not dead
        assert prober.alive("w2")
        again = PostgresExecutorLocks(pg_url)
        try:
            again.hold("w1", 1)  # restarted: the claim's mark went with the claim
            assert prober.alive("w1")
        finally:
            again.release()
    finally:
        for locks in (home, other, watchdog, prober, foreign):
            with contextlib.suppress(Exception):
                locks.release()
