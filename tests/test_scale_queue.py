"""codex_turn.scale without a worker: what the queue refuses, and what it stores how.

The queue database holds every prompt and instruction of every queued turn: it is created
owner-only whatever the umask (SQLite gives its ``-wal`` and ``-shm`` the file's mode), a
wider one the user owns is narrowed, and the turns' params are stored as JSON (DBOS's portable
serializer), not pickled. Bad input is a typed error (the CLI's usage exit), not a crash.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from codex_turn import InvalidTurnParams, TurnParams, cli
from codex_turn.harness.appserver.native_hooks import HookRelay, NativeHooks
from codex_turn.scale import InvalidQueueConfig, TurnQueue, TurnWorker


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_queue_database_is_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    database = tmp_path / "turns.sqlite"
    old = os.umask(0)
    try:
        with TurnQueue(f"sqlite:///{database}") as queue:
            params = TurnParams(
                session_id="s1",
                session_file=tmp_path / "s1.jsonl",
                workspace_dir=tmp_path,
                prompt="the quarterly numbers",
            )
            queue.submit(params, turn_id="t-1")
            files = [database, Path(f"{database}-wal"), Path(f"{database}-shm")]
            assert [_mode(f) for f in files] == [0o600] * 3
            stored = b"".join(f.read_bytes() for f in files)
            assert b'"prompt":"the quarterly numbers"' in stored  # JSON, not a pickle
    finally:
        os.umask(old)
    database.chmod(0o644)  # made by an earlier version: narrowed when next opened
    TurnQueue(f"sqlite:///{database}").close()
    assert _mode(database) == 0o600


def test_bad_input_is_a_typed_error(tmp_path: Path) -> None:
    with TurnQueue(f"sqlite:///{tmp_path}/turns.sqlite") as queue:
        with pytest.raises(InvalidTurnParams, match="TurnParams"):
            queue.submit({}, turn_id="t-1")  # type: ignore[arg-type]
        with pytest.raises(InvalidTurnParams, match="idempotency_key"):
            queue.submit(
                TurnParams(session_id="s", session_file="s.jsonl", workspace_dir=".", prompt="x"),
                turn_id="a:b",
            )
        relay = HookRelay(NativeHooks(callbacks={}), str(tmp_path / "relay.sock"))
        with pytest.raises(InvalidTurnParams, match="native_hooks cannot be queued"):
            queue.submit(
                TurnParams(
                    session_id="s",
                    session_file="s.jsonl",
                    workspace_dir=".",
                    prompt="x",
                    native_hooks=relay,
                ),
                turn_id="t-2",
            )
    with pytest.raises(InvalidQueueConfig, match="database URL"):
        TurnQueue("mysql://x")
    for executor_id in ("x" * 300, "", "a/b", "w@1"):
        with pytest.raises(InvalidQueueConfig, match="executor id"):
            TurnWorker(f"sqlite:///{tmp_path}/t.sqlite", app_server=None, executor_id=executor_id)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--db", "mysql://x"], "database URL"), (["--executor-id", "x" * 300], "executor id")],
)
def test_the_worker_command_refuses_bad_flags_as_usage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    argv = ["worker", "--db", f"sqlite:///{tmp_path}/turns.sqlite", "--offline", *flags]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything was made
