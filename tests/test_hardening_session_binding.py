"""Issue 11, the binding side: a binding proves it belongs to its session (session id and
transcript identity) or is ignored with a warning, and an absurd sidecar value is neither
trusted nor logged verbatim."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from structlog.testing import capture_logs

from codex_turn.harness.binding import (
    LOG_ID_CHARS,
    MAX_THREAD_ID_CHARS,
    ThreadBinding,
    binding_path,
    cap_identifier,
    read_binding,
    write_binding,
)
from codex_turn.harness.session import mirror_prompt

A, B = "019d5c1e-0000-7000-8000-00000000000a", "019d5c1e-0000-7000-8000-00000000000b"


def _session(directory: Path, session_id: str) -> Path:
    """A session as a turn leaves it: transcript with a prompt, thread bound to it."""
    path = directory / f"{session_id}.jsonl"
    mirror_prompt(
        path,
        {"role": "user", "content": f"private words of {session_id}", "timestamp": 1},
        scope=f"codex-app-server:thread-{session_id}",
        identity="run-1:prompt",
        session_id=session_id,
        cwd="/work",
    )
    write_binding(path, ThreadBinding(thread_id=f"thread-{session_id}"), session_id=session_id)
    return path


def _sidecar(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(Path(binding_path(path)).read_text())
    return loaded


def test_a_binding_records_whose_it_is_and_reads_back(tmp_path: Path) -> None:
    a = _session(tmp_path, A)
    raw = _sidecar(a)
    assert (raw["sessionId"], raw["transcriptId"]) == (A, A)
    assert list(raw)[-4:] == ["sessionId", "transcriptId", "createdAt", "updatedAt"]
    with capture_logs() as logs:
        bound = read_binding(a, session_id=A)
        assert read_binding(a) == bound  # the old signature still works
    assert logs == []
    assert bound is not None
    assert (bound.thread_id, bound.session_id, bound.transcript_id) == (f"thread-{A}", A, A)


def test_a_sidecar_copied_next_to_another_session_is_ignored(tmp_path: Path) -> None:
    """The observed bug: B's turn resumed A's thread (and sent B's prompt into it)."""
    a = _session(tmp_path, A)
    b = tmp_path / f"{B}.jsonl"
    mirror_prompt(
        b,
        {"role": "user", "content": "b's first words", "timestamp": 1},
        scope="codex-app-server:thread-x",
        identity="run-1:prompt",
        session_id=B,
        cwd="/work",
    )
    shutil.copyfile(binding_path(a), binding_path(b))
    for kwargs in ({}, {"session_id": B}):
        with capture_logs() as logs:
            assert read_binding(b, **kwargs) is None, kwargs
        assert [(log["event"], log["log_level"]) for log in logs] == [
            ("codex app-server binding ignored", "warning")
        ]
        assert logs[0]["reason"] in {
            "written for another transcript",
            "written for another session",
        }
        assert "private words" not in repr(logs)
        assert "first words" not in repr(logs)
    # A's own binding is untouched and still good.
    assert read_binding(a, session_id=A) is not None


def test_a_copied_sidecar_before_the_transcript_exists_is_caught_by_the_session_id(
    tmp_path: Path,
) -> None:
    a = _session(tmp_path, A)
    b = tmp_path / f"{B}.jsonl"  # B's first turn: no transcript yet
    shutil.copyfile(binding_path(a), binding_path(b))
    with capture_logs() as logs:
        assert read_binding(b, session_id=B) is None
    assert logs[0]["reason"] == "written for another session"
    assert (logs[0]["bound_session_id"], logs[0]["session_id"]) == (A, B)


def test_a_stale_sidecar_of_an_earlier_session_at_a_reused_path_is_ignored(
    tmp_path: Path,
) -> None:
    path = _session(tmp_path, A)
    # The host archives A's transcript and starts session B at the same file name, but the
    # sidecar was left behind (a reset whose unlink failed).
    path.rename(tmp_path / "archived.jsonl.reset.2026-04-24T10-00-00.000Z")
    mirror_prompt(
        path,
        {"role": "user", "content": "new session", "timestamp": 1},
        scope="codex-app-server:thread-b",
        identity="run-1:prompt",
        session_id=B,
        cwd="/work",
    )
    with capture_logs() as logs:
        assert read_binding(path) is None
    assert logs[0]["reason"] == "written for another transcript"
    assert (logs[0]["bound_transcript_id"], logs[0]["transcript_id"]) == (A, B)


def test_a_session_moved_with_its_sidecar_keeps_its_thread(tmp_path: Path) -> None:
    a = _session(tmp_path, A)
    moved = tmp_path / "elsewhere" / "renamed.jsonl"
    moved.parent.mkdir()
    shutil.copyfile(a, moved)
    shutil.copyfile(binding_path(a), binding_path(moved))
    bound = read_binding(moved, session_id=A)
    assert bound is not None
    assert bound.thread_id == f"thread-{A}"


def test_a_first_turn_binds_before_the_transcript_exists(tmp_path: Path) -> None:
    """Thread start writes the binding before the mirror creates the file: the identity is
    the session id the mirror will put in the header, so the next turn matches."""
    path = tmp_path / "s.jsonl"
    write_binding(path, ThreadBinding(thread_id="thread-1"), session_id=A)
    assert _sidecar(path)["transcriptId"] == A
    mirror_prompt(
        path,
        {"role": "user", "content": "hello", "timestamp": 1},
        scope="codex-app-server:thread-1",
        identity="run-1:prompt",
        session_id=A,
        cwd="/",
    )
    bound = read_binding(path, session_id=A)
    assert bound is not None
    assert bound.thread_id == "thread-1"


def test_a_host_made_transcript_is_identified_by_its_own_header(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    header = {"type": "session", "version": 3, "id": "pi-uuid-v7", "timestamp": "x", "cwd": "/"}
    path.write_text(json.dumps(header) + "\n")
    write_binding(path, ThreadBinding(thread_id="thread-1"), session_id="host-session")
    raw = _sidecar(path)
    assert (raw["sessionId"], raw["transcriptId"]) == ("host-session", "pi-uuid-v7")
    assert read_binding(path, session_id="host-session") is not None


def test_an_old_sidecar_is_accepted_once_and_the_next_write_adds_the_proof(
    tmp_path: Path,
) -> None:
    a = _session(tmp_path, A)
    Path(binding_path(a)).write_text(
        json.dumps({"schemaVersion": 1, "threadId": "old-thread", "cwd": "/work"})
    )
    with capture_logs() as logs:
        old = read_binding(a, session_id=A)
    assert logs == []
    assert old is not None
    assert (old.session_id, old.transcript_id) == (None, None)
    # The turn resumes and rewrites the binding: the fields arrive.
    write_binding(a, old, session_id=A)
    raw = _sidecar(a)
    assert (raw["sessionId"], raw["transcriptId"]) == (A, A)
    # A later copy of that sidecar is now caught.
    b = tmp_path / "b.jsonl"
    shutil.copyfile(binding_path(a), binding_path(b))
    assert read_binding(b, session_id=B) is None


def test_invalid_identity_fields_make_the_binding_invalid(tmp_path: Path) -> None:
    a = _session(tmp_path, A)
    good = _sidecar(a)
    for field, value, reason in (
        ("sessionId", 7, "invalid sessionId"),
        ("sessionId", "", "invalid sessionId"),
        ("transcriptId", "x" * 5000, "invalid transcriptId"),
    ):
        raw = good | {field: value}
        Path(binding_path(a)).write_text(json.dumps(raw))
        with capture_logs() as logs:
            assert read_binding(a) is None
        assert logs[0]["reason"] == reason
        assert len(repr(logs)) < 1000


# --- absurd values ------------------------------------------------------------------------------


def test_a_20_mb_thread_id_is_rejected_and_never_logged_verbatim(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    Path(binding_path(path)).write_text(
        json.dumps({"schemaVersion": 1, "threadId": "t" * (20 << 20)})
    )
    with capture_logs() as logs:
        assert read_binding(path) is None
    assert [(log["event"], log["reason"]) for log in logs] == [
        ("codex app-server binding ignored", "too large")
    ]
    assert len(repr(logs)) < 1000  # was one 20 MB log record


def test_a_long_thread_id_under_the_size_cap_is_rejected_with_a_capped_log(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    long_id = "0123456789" * 50_000  # 500 KB: a small sidecar, an absurd id
    Path(binding_path(path)).write_text(json.dumps({"schemaVersion": 1, "threadId": long_id}))
    with capture_logs() as logs:
        assert read_binding(path) is None
    assert logs[0]["reason"] == "invalid threadId"
    assert len(logs[0]["thread_id"]) < LOG_ID_CHARS + 40
    assert len(repr(logs)) < 1000
    just_right = "t" * MAX_THREAD_ID_CHARS
    Path(binding_path(path)).write_text(json.dumps({"schemaVersion": 1, "threadId": just_right}))
    bound = read_binding(path)
    assert bound is not None
    assert bound.thread_id == just_right


def test_cap_identifier() -> None:
    assert cap_identifier("thread-1") == "thread-1"
    capped = cap_identifier("x" * 1000)
    assert capped.startswith("x" * LOG_ID_CHARS)
    assert capped.endswith("…(+800 chars)")
    assert cap_identifier("abc", 2) == "ab…(+1 chars)"
