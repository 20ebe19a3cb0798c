"""What the library creates beside a session is owner-only, whatever the umask.

* **Created private**: under ``umask 022`` a turn with the reference engine in a directory
  that does not exist yet leaves only ``0600`` files (the transcript, the binding sidecar,
  the store and the ``-wal``/``-shm`` SQLite makes beside it) in ``0700`` directories; the
  lock file and the files of :func:`~codex_turn.harness._fs.atomic_write` are ``0600`` too.
* **Wider ones are reported, not changed**: a store, sidecar or lock file others may read
  is a finding of :func:`~codex_turn.engines._doctor.private_file_findings` (a typed record),
  which ``codex-turn doctor`` prints, failing; its mode is left as it was.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fake_appserver import FakeAppServer
from support.turns import turn_params

from codex_turn import TurnOutcome, run_codex_turn
from codex_turn.engines import SqliteContextEngine
from codex_turn.engines._doctor import private_file_findings
from codex_turn.harness._fs import PermissionFinding, atomic_write
from codex_turn.harness.session import clear_session_cache, session_write_lock


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The common default umask, which leaves new files readable by everyone."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def modes(root: Path) -> dict[str, int]:
    """Every file and directory under ``root`` (relative name -> permission bits)."""
    found = {}
    for directory, names, files in os.walk(root):
        for name in [*names, *files]:
            path = Path(directory, name)
            found[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return found


@pytest.mark.anyio
async def test_a_turn_leaves_only_owner_only_files_whatever_the_umask(
    tmp_path: Path, umask_022: None
) -> None:
    session = tmp_path / "agents" / "main" / "s.jsonl"  # its directories do not exist yet
    engine = SqliteContextEngine.next_to(session)
    try:
        result = await run_codex_turn(
            turn_params(str(session), "hello"), app_server=FakeAppServer(), engine=engine
        )
        assert result.outcome is TurnOutcome.COMPLETED
        found = modes(tmp_path)  # while the store is open: its -wal and -shm are there
    finally:
        engine.close()
        clear_session_cache(str(session))
    names = {Path(name).name for name in found}
    assert {"s.jsonl", "s.jsonl.codex-app-server.json", "context.sqlite"} <= names
    assert {"context.sqlite-wal", "context.sqlite-shm"} <= names
    wider = {
        name: f"{mode:o}"
        for name, mode in found.items()
        if mode != (0o700 if (tmp_path / name).is_dir() else 0o600)
    }
    assert wider == {}  # before: the store and its sidecars 644, the directories 755
    assert private_file_findings(session) == ()


def test_lock_files_and_replaced_files_are_owner_only(tmp_path: Path, umask_022: None) -> None:
    session = tmp_path / "deep" / "s.jsonl"
    with session_write_lock(session):
        lock = tmp_path / "deep" / "s.jsonl.lock"
        assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "deep").stat().st_mode) == 0o700
    atomic_write(tmp_path / "a" / "b" / "f.json", b"{}")
    assert stat.S_IMODE((tmp_path / "a" / "b" / "f.json").stat().st_mode) == 0o600
    assert {name: f"{mode:o}" for name, mode in modes(tmp_path / "a").items()} == {
        "b": "700",
        "b/f.json": "600",
    }


def test_a_wider_store_is_reported_by_doctor_and_left_as_it_is(tmp_path: Path) -> None:
    session = tmp_path / "s.jsonl"
    header = {"type": "session", "version": 3, "id": "s", "timestamp": "2026-01-01T00:00:00Z"}
    session.write_text(json.dumps({**header, "cwd": "."}) + "\n")
    store = tmp_path / "context.sqlite"
    store.write_bytes(b"")  # an empty store, as an earlier version made it
    store.chmod(0o644)
    lock = tmp_path / "s.jsonl.lock"
    lock.write_text(json.dumps({"pid": 0, "createdAt": "2026-01-01T00:00:00.000Z"}))
    lock.chmod(0o640)
    assert private_file_findings(session) == (
        PermissionFinding(str(store), 0o644, 0o600),
        PermissionFinding(str(lock), 0o640, 0o600),
    )
    done = subprocess.run(
        [sys.executable, "-m", "codex_turn", "doctor", str(session), "--offline", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    checks = {c["check"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["private files"]["ok"] is False
    assert f"{store} is 0644, wider than 0600" in checks["private files"]["detail"]
    assert f"{lock} is 0640" in checks["private files"]["detail"]
    assert done.returncode == 1
    assert stat.S_IMODE(store.stat().st_mode) == 0o644  # reported, not changed


def test_a_private_codex_home_and_the_directories_made_for_it_are_owner_only(
    tmp_path: Path, umask_022: None
) -> None:
    from codex_turn.harness.appserver import AppServerConfig

    home = tmp_path / "offline" / "state" / "codex-home"
    AppServerConfig.offline(home, "http://127.0.0.1:9/v1").write()
    assert {name: f"{mode:o}" for name, mode in modes(tmp_path).items()} == {
        "offline": "700",  # before: 755, only the home itself was made 700
        "offline/state": "700",
        "offline/state/codex-home": "700",
        "offline/state/codex-home/config.toml": "600",
    }
