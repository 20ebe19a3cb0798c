"""Appending the Codex mirror: header creation, parents, idempotency (both key schemes), one
append + fsync per turn, torn tails, refusal to touch foreign files, and the write lock."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from support.session_turns import expected_messages, turn_keys, turn_messages

from codex_turn.harness import session as session_mod
from codex_turn.harness.session import (
    MirrorInputError,
    SessionFormatError,
    SessionLockTimeout,
    load_session_messages,
    mirror_turn,
    read_session,
    session_write_lock,
)
from codex_turn.harness.session import _format as format_mod
from codex_turn.harness.session import _mirror as mirror_mod

SESSION_ID = "019d5c1e-0000-7000-8000-000000000001"


def _mirror(path: Path, thread: str, turn: int, **kwargs: Any) -> session_mod.MirrorResult:
    messages, identities = turn_messages(thread, turn)
    return mirror_turn(
        path,
        messages,
        scope=f"codex-app-server:{thread}",
        identities=identities,
        session_id=SESSION_ID,
        cwd="/work",
        **kwargs,
    )


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().decode().splitlines() if line.strip()]


def test_first_mirror_creates_the_header_exclusively_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "agents" / "main" / "sessions" / f"{SESSION_ID}.jsonl"
    result = _mirror(path, "thread-1", 0)
    assert result.created
    assert result.appended == 4
    assert result.skipped == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lines = _lines(path)
    header = lines[0]
    assert list(header) == ["type", "version", "id", "timestamp", "cwd"]
    assert header["id"] == SESSION_ID
    assert header["version"] == 3
    assert header["cwd"] == "/work"
    assert header["timestamp"].endswith("Z")
    assert len(header["timestamp"]) == 24
    entries = lines[1:]
    assert [list(e) for e in entries] == [["type", "id", "parentId", "timestamp", "message"]] * 4
    assert [e["parentId"] for e in entries] == [None, *[e["id"] for e in entries[:-1]]]
    assert [e["id"] for e in entries] == list(result.entry_ids)
    assert all(len(e["id"]) == 8 for e in entries)
    assert [list(e["message"])[-1] for e in entries] == ["idempotencyKey"] * 4
    assert load_session_messages(path) == expected_messages("thread-1", range(1))
    assert result.leaf_id == entries[-1]["id"]
    assert not [p for p in path.parent.iterdir() if p.name != path.name]  # no temp/lock left


def test_rerunning_a_turn_appends_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    _mirror(path, "t", 0)
    _mirror(path, "t", 1)
    size = path.stat().st_size
    again = _mirror(path, "t", 1)
    assert again.appended == 0
    assert again.skipped == 4
    assert again.bytes_written == 0
    assert again.skipped_keys == tuple(turn_keys("t", 1))
    assert path.stat().st_size == size
    assert load_session_messages(path) == expected_messages("t", range(2))


def test_pr_era_per_index_keys_are_recognised(tmp_path: Path) -> None:
    path = tmp_path / "legacy.jsonl"
    messages, identities = turn_messages("t", 0)
    # A PR-era mirror of a turn without a plan: keys user:0, assistant:1 (reasoning), :2 final.
    legacy = [messages[0], messages[1], messages[3]]
    legacy_keys = ["user:0", "assistant:1", "assistant:2"]
    header = {
        "type": "session",
        "version": 3,
        "id": SESSION_ID,
        "timestamp": "2026-04-24T00:00:00.000Z",
        "cwd": "/w",
    }
    rows = [header]
    parent = None
    for index, (message, suffix) in enumerate(zip(legacy, legacy_keys, strict=True)):
        entry_id = f"0000000{index}"
        key = f"codex-app-server:t:turn-0:{suffix}"
        rows.append(
            {
                "type": "message",
                "id": entry_id,
                "parentId": parent,
                "timestamp": header["timestamp"],
                "message": {**message, "idempotencyKey": key},
            }
        )
        parent = entry_id
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = mirror_turn(
        path,
        [messages[0], messages[1], messages[3]],
        scope="codex-app-server:t",
        identities=[identities[0], identities[1], identities[3]],
        session_id=SESSION_ID,
        cwd="/w",
    )
    assert result.appended == 0
    assert result.skipped == 3
    # A plan new in this snapshot shifts the final answer's index (2 -> 3), and the plan now
    # holds index 2: matching is by turn, role and content, so only the plan is appended.
    full = mirror_turn(
        path,
        messages,
        scope="codex-app-server:t",
        identities=identities,
        session_id=SESSION_ID,
        cwd="/w",
    )
    assert full.appended_keys == ("codex-app-server:t:turn-0:plan",)
    other_turn = mirror_turn(
        path,
        messages,
        scope="codex-app-server:t",
        identities=[i.replace("turn-0", "turn-1") for i in identities],
        session_id=SESSION_ID,
        cwd="/w",
    )
    assert other_turn.appended == 4  # same content in another turn is a new message
    assert (
        mirror_turn(
            path,
            messages,
            scope="codex-app-server:t",
            identities=identities,
            session_id=SESSION_ID,
            cwd="/w",
        ).appended
        == 0
    )


def test_a_message_with_its_own_key_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "own.jsonl"
    prompt = {
        "role": "user",
        "content": "hi",
        "timestamp": 1,
        "idempotencyKey": "client-run:user",
        "provenance": {"x": 1},
    }
    result = mirror_turn(
        path,
        [prompt],
        scope="codex-app-server:t",
        identities=["turn-0:prompt"],
        session_id=SESSION_ID,
        cwd="/",
    )
    assert result.appended_keys == ("client-run:user",)
    assert load_session_messages(path) == [prompt]
    again = mirror_turn(
        path,
        [dict(prompt)],
        scope="codex-app-server:t",
        identities=["turn-0:prompt"],
        session_id=SESSION_ID,
        cwd="/",
    )
    assert again.appended == 0


def test_duplicate_identities_in_one_call_are_written_once(tmp_path: Path) -> None:
    path = tmp_path / "dup.jsonl"
    message = {"role": "user", "content": "same", "timestamp": 1}
    result = mirror_turn(
        path,
        [message, message],
        scope="codex-app-server:t",
        identities=["turn-0:prompt"] * 2,
        session_id=SESSION_ID,
        cwd="/",
    )
    assert result.appended == 1
    assert result.skipped == 1


def test_parent_is_the_last_parent_linked_entry_and_users_skip_tool_results(tmp_path: Path) -> None:
    path = tmp_path / "tools.jsonl"
    ts = "2026-04-24T00:00:00.000Z"
    rows = [
        {"type": "session", "version": 3, "id": SESSION_ID, "timestamp": ts, "cwd": "/w"},
        {
            "type": "message",
            "id": "u0",
            "parentId": None,
            "timestamp": ts,
            "message": {"role": "user", "content": "go"},
        },
        {
            "type": "message",
            "id": "a0",
            "parentId": "u0",
            "timestamp": ts,
            "message": {
                "role": "assistant",
                "content": [{"type": "toolCall", "id": "c", "name": "x", "arguments": {}}],
            },
        },
        {
            "type": "message",
            "id": "r0",
            "parentId": "a0",
            "timestamp": ts,
            "message": {
                "role": "toolResult",
                "toolCallId": "c",
                "toolName": "x",
                "content": [],
                "isError": False,
            },
        },
        {
            "type": "message",
            "id": "r1",
            "parentId": "r0",
            "timestamp": ts,
            "message": {
                "role": "toolResult",
                "toolCallId": "c",
                "toolName": "x",
                "content": [],
                "isError": False,
            },
        },
        {
            "type": "message",
            "id": "raw",
            "timestamp": ts,
            "message": {"role": "assistant", "content": []},
        },
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = _mirror(path, "t", 0)
    entries = _lines(path)[len(rows) :]
    # The line without parentId is not parent-linked; the user prompt skips r1 and r0.
    assert entries[0]["parentId"] == "a0"
    assert [e["parentId"] for e in entries[1:]] == list(result.entry_ids[:-1])
    tool = {
        "role": "toolResult",
        "toolCallId": "c",
        "toolName": "x",
        "content": [],
        "isError": False,
    }
    tool_result = mirror_turn(
        path,
        [tool],
        scope="codex-app-server:t",
        identities=["turn-1:tool"],
        session_id=SESSION_ID,
        cwd="/",
    )
    follow = mirror_turn(
        path,
        [{"role": "user", "content": "next"}],
        scope="codex-app-server:t",
        identities=["turn-2:prompt"],
        session_id=SESSION_ID,
        cwd="/",
    )
    by_id = {e["id"]: e for e in _lines(path)[1:]}
    assert by_id[tool_result.entry_ids[0]]["parentId"] == result.leaf_id
    assert by_id[follow.entry_ids[0]]["parentId"] == result.leaf_id


def test_one_append_and_one_fsync_per_turn_and_existing_bytes_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.jsonl"
    _mirror(path, "t", 0)
    before = path.read_bytes()
    writes: list[int] = []
    fsyncs: list[int] = []
    real_write, real_fsync = os.write, os.fsync

    def counting_write(fd: int, data: Any) -> int:
        writes.append(len(data))
        return real_write(fd, data)

    def counting_fsync(fd: int) -> None:
        fsyncs.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "write", counting_write)
    monkeypatch.setattr(os, "fsync", counting_fsync)
    _mirror(path, "t", 1)
    monkeypatch.undo()
    after = path.read_bytes()
    assert after.startswith(before)
    lock_payload_writes = 1
    assert len(writes) == 1 + lock_payload_writes
    assert writes[-1] == len(after) - len(before)
    assert len(fsyncs) == 1


def test_torn_tail_is_isolated_by_a_newline(tmp_path: Path) -> None:
    path = tmp_path / "torn.jsonl"
    _mirror(path, "t", 0)
    with path.open("ab") as handle:
        handle.write(b'{"type":"message","id":"zz","parentId":null,"message":{"role":"user","cont')
    torn_size = path.stat().st_size
    result = _mirror(path, "t", 1)
    data = path.read_bytes()
    assert data[torn_size : torn_size + 1] == b"\n"
    assert result.appended == 4
    transcript = read_session(path)
    assert transcript.malformed_lines == 1
    assert not transcript.torn_tail
    assert load_session_messages(path) == expected_messages("t", range(2))


def test_an_unterminated_but_complete_last_line_is_respected(tmp_path: Path) -> None:
    path = tmp_path / "unterminated.jsonl"
    _mirror(path, "t", 0)
    data = path.read_bytes()
    path.write_bytes(data[:-1])  # drop only the final newline
    assert _mirror(path, "t", 0).appended == 0
    _mirror(path, "t", 1)
    assert load_session_messages(path) == expected_messages("t", range(2))
    assert read_session(path).malformed_lines == 0


def test_foreign_files_are_refused_and_left_alone(tmp_path: Path) -> None:
    for name, content in {
        "not-session.jsonl": b'{"type":"message","id":"1","parentId":null,"message":{}}\n',
        "torn-entry.jsonl": b'{"type":"message","id":"1","par',
        "prose.jsonl": b"notes, not a transcript",
        "no-id.jsonl": b'{"type":"session","version":3}\n',
        "torn-then-garbage.jsonl": b'{"type":"sess\nmore garbage\n',
        # A torn header or a blank file holds nothing: recovered, see test_session_preflight.
    }.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(SessionFormatError):
            _mirror(path, "t", 0)
        assert path.read_bytes() == content, name


def test_an_empty_existing_file_gets_a_header(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    result = _mirror(path, "t", 0)
    assert not result.created
    assert result.appended == 4
    assert _lines(path)[0]["id"] == SESSION_ID
    assert load_session_messages(path) == expected_messages("t", range(1))


def test_bad_input_is_rejected_before_any_io(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    with pytest.raises(MirrorInputError):
        mirror_turn(path, [{"role": "user"}], scope="s", identities=[], session_id="x", cwd="/")
    with pytest.raises(MirrorInputError):
        mirror_turn(
            path, [{"content": "no role"}], scope="s", identities=["a"], session_id="x", cwd="/"
        )
    with pytest.raises(MirrorInputError):
        mirror_turn(path, [{"role": "user"}], scope=" ", identities=["a"], session_id="x", cwd="/")
    with pytest.raises(ValueError, match="identity 0"):  # MirrorInputError is a ValueError
        mirror_turn(path, [{"role": "user"}], scope="s", identities=[""], session_id="x", cwd="/")
    assert not path.exists()


def test_non_ascii_and_lone_surrogates_serialise_like_json_stringify(tmp_path: Path) -> None:
    path = tmp_path / "u.jsonl"
    messages = [
        {"role": "user", "content": "héllo 🌍"},
        {"role": "user", "content": "bad \ud800 half"},
    ]
    mirror_turn(
        path,
        messages,
        scope="codex-app-server:t",
        identities=["a:prompt", "b:prompt"],
        session_id="x",
        cwd="/",
    )
    raw = path.read_bytes().decode("utf-8")
    assert "héllo 🌍" in raw
    assert "\\ud800" in raw
    assert [m["content"] for m in load_session_messages(path)] == ["héllo 🌍", "bad \ud800 half"]


# --------------------------------------------------------------------------------------------
# The write lock


def _lock_file(path: Path) -> Path:
    return Path(os.path.realpath(path.parent)) / (path.name + ".lock")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_locks_are_broken(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    lock = _lock_file(path)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        stale_payloads = [
            {"pid": _dead_pid(), "createdAt": "2026-04-24T00:00:00.000Z"},
            {"pid": sleeper.pid, "createdAt": "2000-01-01T00:00:00.000Z"},  # too old
            {"pid": sleeper.pid, "createdAt": "not a date"},
            {
                "pid": sleeper.pid,
                "createdAt": "2099-01-01T00:00:00.000Z",
                "starttime": 1,
            },  # recycled
        ]
        for turn, payload in enumerate(stale_payloads):
            lock.write_text(json.dumps(payload))
            with capture_logs() as logs:
                _mirror(path, "t", turn, lock_timeout=2.0)
            assert not lock.exists()
            assert any(log["event"] == "session lock was stale; removed" for log in logs), payload
        lock.write_text("{garbage")
        old = time.time() - 60
        os.utime(lock, (old, old))
        _mirror(path, "t", 9, lock_timeout=2.0)
        assert not lock.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


#: Pids no process can have: beyond ``pid_t`` (``os.kill`` raised OverflowError), negative.
IMPOSSIBLE_PIDS = [10**30, 2**63, 2**31, -5]


@pytest.mark.parametrize("pid", IMPOSSIBLE_PIDS)
def test_a_lock_naming_an_impossible_pid_is_stale(tmp_path: Path, pid: int) -> None:
    path = tmp_path / "s.jsonl"
    lock = _lock_file(path)
    lock.write_text(json.dumps({"pid": pid, "createdAt": format_mod.utc_now_iso()}))
    with capture_logs() as logs:
        _mirror(path, "t", 0, lock_timeout=2.0)  # before: OverflowError, every turn
    assert not lock.exists()
    broken = [log for log in logs if log["event"] == "session lock was stale; removed"]
    assert [log["reason"] for log in broken] == ["dead pid"]


def test_leftovers_naming_an_impossible_pid_are_swept(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    huge = str(10**30)
    aside = tmp_path / f"s.jsonl.lock.stale.{huge}.abcdef12"  # a breaker's, "dead"
    temp = tmp_path / f"s.jsonl.{huge}.abcdef12.tmp"  # a create_exclusive's, "dead"
    not_ours = tmp_path / "s.jsonl.lock.stale.\u00b2\u00b3.abcdef12"  # digits, but not ASCII
    for leftover in (aside, temp, not_ours):
        leftover.write_text("{}")
    _mirror(path, "t", 0)  # before: OverflowError (ValueError for the superscript digits)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["s.jsonl", not_ours.name])


def _doctor(session: Path) -> dict[str, Any]:
    """``codex-turn doctor SESSION --offline --json``'s session lock check; it must answer
    at once (``timeout``: a doctor that waits on the lock fails the test)."""
    done = subprocess.run(
        [sys.executable, "-m", "codex_turn", "doctor", str(session), "--offline", "--json"],
        cwd=session.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr  # before: 70 (an OverflowError)
    checks = {c["check"]: c for c in json.loads(done.stdout)["checks"]}
    lock: dict[str, Any] = checks["session lock"]
    return lock


def test_doctor_judges_the_lock_file_as_a_turn_does(tmp_path: Path) -> None:
    session = tmp_path / "s.jsonl"
    _mirror(session, "t", 0)
    lock = _lock_file(session)
    os.mkfifo(lock)  # a turn refuses it at once; doctor hung on it, forever
    refused = _doctor(session)
    assert refused["ok"] is False
    assert "a FIFO, not a regular file" in refused["detail"]
    with pytest.raises(session_mod.TranscriptUnwritable, match="a FIFO, not a regular file"):
        _mirror(session, "t", 1, lock_timeout=0.2)  # what a turn says
    lock.unlink()
    for pid in ("1e30", "Infinity", str(10**30)):
        lock.write_text(f'{{"pid": {pid}, "createdAt": "2026-01-01T00:00:00.000Z"}}')
        judged = _doctor(session)
        assert judged["ok"] is not False, (pid, judged)
        assert "stale" in judged["detail"] or "unreadable" in judged["detail"], (pid, judged)


def test_a_live_holder_times_out_with_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    lock = _lock_file(path)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        lock.write_text(json.dumps({"pid": sleeper.pid, "createdAt": format_mod.utc_now_iso()}))
        started = time.monotonic()
        with pytest.raises(SessionLockTimeout) as caught:
            _mirror(path, "t", 0, lock_timeout=0.3)
        assert 0.25 <= time.monotonic() - started < 2.0
        assert caught.value.holder_pid == sleeper.pid
        assert not path.exists()
        lock.write_text("{still being written")  # fresh and unparsable: treated as held
        with pytest.raises(SessionLockTimeout):
            _mirror(path, "t", 0, lock_timeout=0.2)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_lock_is_reentrant_and_excludes_other_threads(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    lock = _lock_file(path)
    with session_write_lock(path):
        payload = json.loads(lock.read_text())
        assert payload["pid"] == os.getpid()
        assert payload["createdAt"].endswith("Z")
        _mirror(path, "t", 0)  # nested in the same thread
        assert lock.exists()
        errors: list[BaseException] = []

        def other() -> None:
            try:
                _mirror(path, "t", 1, lock_timeout=0.2)
            except BaseException as error:
                errors.append(error)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert len(errors) == 1
        assert isinstance(errors[0], SessionLockTimeout)
    assert not lock.exists()
    _mirror(path, "t", 1)
    assert load_session_messages(path) == expected_messages("t", range(2))


def test_threads_mirroring_concurrently_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    path = tmp_path / "threads.jsonl"
    threads = [f"th{i}" for i in range(4)]
    turns = 10

    def work(thread: str) -> None:
        for turn in range(turns):
            _mirror(path, thread, turn)
            if turn % 3 == 0:
                load_session_messages(path)  # readers interleave with writers

    workers = [threading.Thread(target=work, args=(name,)) for name in threads]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    lines = _lines(path)[1:]
    keys = [line["message"]["idempotencyKey"] for line in lines]
    assert sorted(keys) == sorted(
        k for name in threads for t in range(turns) for k in turn_keys(name, t)
    )
    messages = load_session_messages(path)
    assert len(messages) == len(keys)  # one chain: every entry is on the path
    for name in threads:
        mine = [m for m in messages if m["idempotencyKey"].startswith(f"codex-app-server:{name}:")]
        assert mine == expected_messages(name, range(turns))


def test_mirroring_into_a_legacy_v1_file_reads_back_in_order(tmp_path: Path) -> None:
    path = tmp_path / "v1.jsonl"
    header = {"type": "session", "id": "old", "timestamp": "2025-12-01T00:00:00.000Z", "cwd": "/"}
    old = {
        "type": "message",
        "timestamp": header["timestamp"],
        "message": {"role": "user", "content": "v1"},
    }
    path.write_text(json.dumps(header) + "\n" + json.dumps(old) + "\n")
    before = path.read_bytes()
    _mirror(path, "t", 0)
    assert path.read_bytes().startswith(before)
    assert load_session_messages(path) == [old["message"], *expected_messages("t", range(1))]


def test_os_errors_are_mapped_to_session_errors(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(session_mod.SessionError, match="failed to mirror"):
        _mirror(blocker / "s.jsonl", "t", 0)


def test_a_file_created_by_a_lockless_writer_mid_mirror_is_appended_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "race.jsonl"
    real_create = mirror_mod.create_exclusive

    def racing_create(target: str, data: bytes) -> bool:
        header = {"type": "session", "version": 3, "id": "other", "timestamp": "x", "cwd": "/"}
        Path(target).write_text(json.dumps(header) + "\n")  # pi's lockless writer wins
        return real_create(target, data)

    monkeypatch.setattr(mirror_mod, "create_exclusive", racing_create)
    result = _mirror(path, "t", 0)
    assert not result.created
    assert result.appended == 4
    assert _lines(path)[0]["id"] == "other"
    assert load_session_messages(path) == expected_messages("t", range(1))
