"""The reference engine's store when it cannot be used: the world's fault, refused unchanged.

* **Operational, never the engine's mistake**: a store that cannot be opened (not a database,
  a newer schema, another program's tables, a place where no file can be made) or whose pages
  are corrupt raises the ``EngineUnavailable`` family, so a strict turn takes its fallback
  and does not end in ``EngineContractViolation``.
* **Refused before it is changed**: a SQLite file that is not this engine's is checked
  read-only and refused byte for byte as it was, without a ``-wal``/``-shm``/``-journal``
  beside it (the switch to WAL is only made on a file the engine accepts).
* **``inspect`` changes nothing**: it previews on a private copy of the store, read-only.
* **Closed means closed**: after a refusal, and after ``close()``, no descriptor to the
  store or its ``-wal``/``-shm`` is open in this process.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from support.engine_sqlite_workload import SMALL, turn
from support.fake_appserver import FakeAppServer
from support.turns import turn_params

from codex_turn import TurnOutcome, run_codex_turn
from codex_turn.engines import SqliteContextEngine, StoreError, _schema
from codex_turn.harness.engine import AfterTurnParams, AssembleParams, EngineUnavailable
from codex_turn.testing import run_strict_turn

pytestmark = pytest.mark.anyio

SIDECARS = ("-wal", "-shm", "-journal")


def files_in(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def open_descriptors(store: Path) -> list[str]:
    """This process's descriptors on the store or any of its sidecars."""
    names = {str(store), *(str(store) + suffix for suffix in SIDECARS)}
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        if target in names:
            found.append(target)
    return found


async def seed(engine: SqliteContextEngine, session: str = "s") -> None:
    messages = turn(session, 0) + turn(session, 1)
    await engine.after_turn(
        AfterTurnParams(
            session_id=session, session_file="", messages=messages, pre_prompt_message_count=0
        )
    )


async def assemble(engine: SqliteContextEngine, session: str = "s") -> None:
    await engine.assemble(AssembleParams(session_id=session, messages=[], token_budget=10_000))


# --- the kinds of unusable store ------------------------------------------------------------


def not_a_database(path: Path) -> None:
    path.write_bytes(b"this is not a database, it is a text file" * 100)


def newer_schema(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version=99")
    conn.close()


def foreign_tables(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE invoices(id INTEGER PRIMARY KEY, amount REAL)")
        conn.execute("INSERT INTO invoices(amount) VALUES (12.5)")
    conn.close()


def no_place_for_it(path: Path) -> None:
    path.parent.rename(path.parent.with_name("moved"))
    path.parent.write_text("a file where the store's directory should be")


def damage_pages(path: Path) -> None:
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    assert len(data) > 3 * page
    data[page:] = b"\xa5" * (len(data) - page)  # the header and the schema page stay intact
    path.write_bytes(bytes(data))


async def corrupt_pages(path: Path) -> None:
    engine = SqliteContextEngine(path, settings=SMALL)
    for index in range(12):
        await seed(engine, f"s{index}")
    engine.close()
    damage_pages(path)


UNOPENABLE: dict[str, Callable[[Path], None]] = {
    "not-a-database": not_a_database,
    "newer-schema": newer_schema,
    "foreign-tables": foreign_tables,
    "no-place-for-it": no_place_for_it,
}


@pytest.fixture(params=[*UNOPENABLE, "corrupt-pages"])
async def broken_store(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    store = tmp_path / "sessions" / "context.sqlite"
    store.parent.mkdir()
    if request.param == "corrupt-pages":
        await corrupt_pages(store)
    else:
        UNOPENABLE[request.param](store)
    return store


async def test_a_broken_store_is_unavailable_not_a_contract_violation(broken_store: Path) -> None:
    engine = SqliteContextEngine(broken_store, settings=SMALL)
    with pytest.raises(EngineUnavailable):
        await assemble(engine)
    engine.close()
    assert issubclass(StoreError, EngineUnavailable)


async def test_a_strict_turn_takes_the_fallback_on_a_broken_store(
    broken_store: Path, session_file: str
) -> None:
    engine = SqliteContextEngine(broken_store, settings=SMALL)
    earlier = turn_params(session_file, "an earlier question")
    await run_codex_turn(earlier, app_server=FakeAppServer())
    result = await run_strict_turn(
        turn_params(session_file, "and now?"), app_server=FakeAppServer(), engine=engine
    )  # before: EngineContractViolation for a corrupt page (the CLI's exit 7)
    assert result.outcome is TurnOutcome.COMPLETED
    assert "assemble_failed" in [step.trigger for step in result.trace]
    engine.close()


# --- refused before it is changed ----------------------------------------------------------


@pytest.mark.parametrize("make", [newer_schema, foreign_tables, not_a_database])
async def test_a_file_that_is_not_this_engines_is_refused_unchanged(
    tmp_path: Path, make: Callable[[Path], None]
) -> None:
    store = tmp_path / "context.sqlite"
    make(store)
    before = files_in(tmp_path)
    engine = SqliteContextEngine(store, settings=SMALL)
    with pytest.raises(StoreError, match="unavailable"):
        await assemble(engine)
    with pytest.raises(StoreError, match="unavailable"):
        await engine.doctor()  # the operator's retry checks again, and changes nothing either
    assert files_in(tmp_path) == before  # before: switched to WAL first (header bytes 18-19)
    assert open_descriptors(store) == []  # before: the refused connection stayed open
    engine.close()
    assert open_descriptors(store) == []


KILLED_WRITER = """
import os, signal, sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("PRAGMA cache_size=10")  # spill to the file, so a journal is needed
conn.execute("BEGIN")
conn.execute("CREATE TABLE scratch(a)")
for _ in range(2000):
    conn.execute("INSERT INTO scratch VALUES (?)", ("x" * 200,))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_hot_journal_is_rolled_back_by_sqlite_then_judged(tmp_path: Path) -> None:
    # A writer died mid-transaction in an empty database: a read-only connection cannot roll
    # its journal back ("attempt to write a readonly database"); the writable open does, as
    # any SQLite reader would, and then judges what is left (here: nothing, a new store).
    store = tmp_path / "context.sqlite"
    subprocess.run([sys.executable, "-c", KILLED_WRITER, str(store)], check=False, timeout=60)
    assert (tmp_path / "context.sqlite-journal").exists()

    async def use() -> None:
        engine = SqliteContextEngine(store, settings=SMALL)
        await seed(engine)
        await assemble(engine)
        engine.close()

    anyio.run(use)


class _Rows:
    def __init__(self, rows: list[Any]) -> None:
        self._rows = rows

    def fetchone(self) -> Any:
        return self._rows[0] if self._rows else None


class _CreatedMeanwhile:
    """A connection after whose first statement another process creates the store."""

    def __init__(self, conn: sqlite3.Connection, create: Callable[[], None]) -> None:
        self._conn = conn
        self._create: Callable[[], None] | None = create

    def execute(self, sql: str, *args: Any) -> _Rows:
        rows = _Rows(self._conn.execute(sql, *args).fetchall())
        if self._create is not None:
            self._create, create = None, self._create
            create()
        return rows


def test_the_schema_check_reads_one_snapshot_while_another_process_creates_the_store(
    tmp_path: Path,
) -> None:
    # Four processes opening a new store at once: one creates the tables and sets the
    # version in one transaction; another's check, read in two statements, saw "version 0"
    # and then the new tables, and refused the store as another program's.
    store = tmp_path / "context.sqlite"
    store.write_bytes(b"")

    def create() -> None:
        _schema.Pool(str(store), busy_timeout_s=5.0).close()

    conn = sqlite3.connect(store, isolation_level=None)
    try:
        version = _schema._check_schema(cast(sqlite3.Connection, _CreatedMeanwhile(conn, create)))
        assert version in (0, _schema.SCHEMA_VERSION)
        assert _schema._check_schema(conn) == _schema.SCHEMA_VERSION
    finally:
        conn.close()


async def test_a_refusal_by_the_writable_open_keeps_nothing_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The file passed the read-only check, then another program made it its own: the
    # writable open checks again, refuses it, and closes what it opened.
    store = tmp_path / "context.sqlite"
    foreign_tables(store)
    monkeypatch.setattr(_schema, "_accept_file", lambda *args: None, raising=False)
    engine = SqliteContextEngine(store, settings=SMALL)
    with pytest.raises(StoreError, match="not this engine's") as refused:
        await assemble(engine)
    assert open_descriptors(store) == []  # before: kept open by the error's traceback
    assert refused.value.__cause__ is not None  # the host keeps the error, not the file
    engine.close()
    assert open_descriptors(store) == []


async def test_close_leaves_no_descriptor_on_the_store_or_its_sidecars(tmp_path: Path) -> None:
    store = tmp_path / "context.sqlite"
    engine = SqliteContextEngine(store, settings=SMALL)
    await seed(engine)
    await assemble(engine)
    assert open_descriptors(store) != []
    engine.close()
    assert open_descriptors(store) == []


# --- inspect reads a copy ------------------------------------------------------------------


def test_inspect_opens_the_store_read_only_and_changes_nothing(tmp_path: Path) -> None:
    header = {"type": "session", "version": 3, "id": "s", "timestamp": "2026-01-01T00:00:00Z"}
    message = {
        "type": "message",
        "id": "m0",
        "parentId": None,
        "timestamp": "2026-01-01T00:00:00.000Z",
        "message": {"role": "user", "content": "remember Lisbon", "timestamp": 1_000},
    }
    session = tmp_path / "s.jsonl"
    session.write_text(json.dumps({**header, "cwd": "."}) + "\n" + json.dumps(message) + "\n")
    store = tmp_path / "context.sqlite"

    async def older_store() -> None:  # a store that has not seen the transcript's message
        engine = SqliteContextEngine(store)
        await seed(engine, "s")
        engine.close()

    anyio.run(older_store)
    before = files_in(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "codex_turn", "inspect", str(session), "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["engine"].startswith("codex-turn.sqlite")
    assert "remember Lisbon" in report["prompt"]  # the preview caught up, in its own copy
    assert files_in(tmp_path) == before  # before: the store caught up with the transcript


async def copy_assembled(engine: SqliteContextEngine, session: str) -> list[object]:
    params = AssembleParams(session_id=session, messages=[], token_budget=10_000)
    return list((await engine.assemble(params)).messages)


async def test_a_private_copy_sees_what_is_committed_and_keeps_its_writes(tmp_path: Path) -> None:
    store = tmp_path / "context.sqlite"
    writer = SqliteContextEngine(store, settings=SMALL)
    await seed(writer, "a")  # committed, still in the -wal: the writer keeps the store open
    assert (tmp_path / "context.sqlite-wal").stat().st_size > 0
    copy = SqliteContextEngine.copy_of(store, settings=SMALL)
    assert (await copy_assembled(copy, "a")) == (await copy_assembled(writer, "a"))
    await seed(copy, "b")  # written to the copy alone
    copy.close()
    assert open_descriptors(store) != []  # the writer's
    assert (await copy_assembled(writer, "b")) == []
    writer.close()
    with pytest.raises(StoreError, match="no store"):
        await assemble(SqliteContextEngine.copy_of(tmp_path / "missing.sqlite"))
    assert not (tmp_path / "missing.sqlite").exists()
