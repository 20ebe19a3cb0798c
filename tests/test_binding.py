"""The Codex thread binding sidecar: format, tolerant reads, atomic writes that survive a
kill between write and rename, clearing, and reset; a binding proves it belongs to its session
(session id and transcript identity) or is ignored with a warning, and an absurd sidecar value
is neither trusted nor logged verbatim."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
from structlog.testing import capture_logs

from codex_turn.harness._fs import session_path
from codex_turn.harness.binding import (
    BINDING_SUFFIX,
    LOG_ID_CHARS,
    MAX_THREAD_ID_CHARS,
    BindingError,
    ContextEngineBinding,
    ProjectionBinding,
    ThreadBinding,
    binding_path,
    binding_to_json,
    cap_identifier,
    clear_binding,
    context_engine_policy_fingerprint,
    read_binding,
    write_binding,
)
from codex_turn.harness.session import mirror_prompt, mirror_turn, read_session, reset_session

ROOT = Path(__file__).parent.parent
WRITER = Path(__file__).parent / "support" / "session_binding_writer.py"

ENGINE = ContextEngineBinding(
    engine_id="lossless-claw",
    policy_fingerprint=context_engine_policy_fingerprint(
        engine_id="lossless-claw",
        engine_version="1.2.0",
        owns_compaction=True,
        context_token_budget=100_000,
    ),
    projection=ProjectionBinding(mode="thread_bootstrap", epoch="e1", fingerprint="sha256:abc"),
)


def _full(session_file: Path) -> ThreadBinding:
    return ThreadBinding(
        thread_id="thread-1",
        cwd="/work",
        auth_profile_id="openai:default",
        model="gpt-5.5",
        model_provider="openai",
        approval_policy="never",
        sandbox="workspace-write",
        service_tier="flex",
        dynamic_tools_fingerprint="[]",
        context_engine=ENGINE,
        created_at="2026-04-24T10:00:00.000Z",
        updated_at="2026-04-24T10:00:00.000Z",
    )


def test_round_trip_and_exact_json_shape(tmp_path: Path) -> None:
    session_file = tmp_path / "s.jsonl"
    written = write_binding(session_file, _full(session_file))
    path = Path(binding_path(session_file))
    assert path.name == "s.jsonl.codex-app-server.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert text.endswith("}\n")
    assert text.startswith('{\n  "schemaVersion": 1,\n  "sessionFile"')
    raw = json.loads(text)
    assert list(raw) == [
        "schemaVersion",
        "sessionFile",
        "threadId",
        "cwd",
        "authProfileId",
        "model",
        "modelProvider",
        "approvalPolicy",
        "sandbox",
        "serviceTier",
        "dynamicToolsFingerprint",
        "contextEngine",
        "createdAt",
        "updatedAt",
    ]
    assert raw["sessionFile"] == str(session_file)
    assert raw["contextEngine"] == {
        "schemaVersion": 1,
        "engineId": "lossless-claw",
        "policyFingerprint": (
            '{"schemaVersion":1,"engineId":"lossless-claw","engineVersion":"1.2.0",'
            '"ownsCompaction":true,"contextTokenBudget":100000}'
        ),
        "projection": {
            "schemaVersion": 1,
            "mode": "thread_bootstrap",
            "epoch": "e1",
            "fingerprint": "sha256:abc",
        },
    }
    assert raw["createdAt"] == "2026-04-24T10:00:00.000Z"
    assert raw["updatedAt"] != raw["createdAt"]
    assert read_binding(session_file) == written
    minimal = write_binding(session_file, ThreadBinding(thread_id="t2"))
    assert list(json.loads(path.read_text())) == [
        "schemaVersion",
        "sessionFile",
        "threadId",
        "cwd",
        "createdAt",
        "updatedAt",
    ]
    assert read_binding(session_file) == minimal
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_session_file_comes_from_the_caller_not_the_sidecar(tmp_path: Path) -> None:
    session_file = tmp_path / "s.jsonl"
    Path(binding_path(session_file)).write_text(
        json.dumps({"schemaVersion": 1, "threadId": "t", "sessionFile": "/elsewhere"})
    )
    binding = read_binding(session_file)
    assert binding is not None
    assert binding.session_file == str(session_file)
    assert binding.cwd == ""
    assert binding.created_at.endswith("Z")


def test_bad_fields_become_unset_and_foreign_fields_are_ignored(tmp_path: Path) -> None:
    session_file = tmp_path / "s.jsonl"
    Path(binding_path(session_file)).write_text(
        json.dumps(
            {
                "schemaVersion": 1,
                "threadId": "t",
                "cwd": 5,
                "model": ["x"],
                "sandbox": "read-only",
                "mcpServersFingerprint": "later-era",
                "contextEngine": {
                    "schemaVersion": 1,
                    "engineId": "e",
                    "policyFingerprint": "p",
                    "projection": {"schemaVersion": 1, "mode": "per_turn", "epoch": " "},
                },
            }
        )
    )
    with capture_logs() as logs:
        binding = read_binding(session_file)
    assert binding is not None
    assert (binding.cwd, binding.model, binding.sandbox, binding.context_engine) == (
        "",
        None,
        "read-only",
        None,
    )
    assert [log["event"] for log in logs] == [
        "codex app-server binding has an invalid contextEngine"
    ]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"{not json", "failed to parse"),
        (b"\xff\xfe\x00", "failed to parse"),
        (b"[1, 2]", "not a JSON object"),
        (json.dumps({"schemaVersion": 2, "threadId": "t"}).encode(), "unsupported schemaVersion"),
        (
            json.dumps({"schemaVersion": True, "threadId": "t"}).encode(),
            "unsupported schemaVersion",
        ),
        (json.dumps({"schemaVersion": 1, "threadId": 7}).encode(), "missing threadId"),
        (json.dumps({"schemaVersion": 1}).encode(), "missing threadId"),
    ],
)
def test_corrupt_sidecars_are_ignored_with_a_warning(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    session_file = tmp_path / "s.jsonl"
    Path(binding_path(session_file)).write_bytes(content)
    with capture_logs() as logs:
        assert read_binding(session_file) is None
    assert [(log["event"], log["log_level"], log["reason"]) for log in logs] == [
        ("codex app-server binding ignored", "warning", reason)
    ]
    assert logs[0]["path"] == binding_path(session_file)


def test_missing_sidecar_is_silently_no_binding(tmp_path: Path) -> None:
    with capture_logs() as logs:
        assert read_binding(tmp_path / "none.jsonl") is None
    assert logs == []


def test_atomic_replace_survives_a_kill_between_write_and_rename(tmp_path: Path) -> None:
    session_file = tmp_path / "s.jsonl"
    old = write_binding(session_file, _full(session_file))
    old_text = Path(binding_path(session_file)).read_text()
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), str(session_file)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.startswith("renaming ")
    temp = Path(line.split(" ", 1)[1])
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    # The new binding was complete and fsynced in the temp file, but never renamed.
    assert json.loads(temp.read_text())["threadId"] == "thread-new"
    assert Path(binding_path(session_file)).read_text() == old_text
    assert read_binding(session_file) == old
    newer = write_binding(session_file, ThreadBinding(thread_id="thread-3"))
    assert not temp.exists()  # the dead writer's temp file is cleaned up
    assert read_binding(session_file) == newer


def test_failed_write_leaves_the_old_binding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    session_file = tmp_path / "s.jsonl"
    old = write_binding(session_file, ThreadBinding(thread_id="t1"))

    def broken_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(BindingError):
        write_binding(session_file, ThreadBinding(thread_id="t2"))
    monkeypatch.undo()
    assert read_binding(session_file) == old
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_clear_and_reset_remove_the_binding_but_not_the_transcript(tmp_path: Path) -> None:
    session_file = tmp_path / "s.jsonl"
    mirror_turn(
        session_file,
        [{"role": "user", "content": "hi"}],
        scope="codex-app-server:t",
        identities=["turn-1:prompt"],
        session_id="s",
        cwd="/",
    )
    write_binding(session_file, ThreadBinding(thread_id="t"))
    assert clear_binding(session_file) is True
    assert clear_binding(session_file) is False
    write_binding(session_file, ThreadBinding(thread_id="t"))
    transcript = session_file.read_bytes()
    with capture_logs() as logs:
        assert (
            reset_session(session_file, session_key="agent:main:telegram:12345", reason="new")
            is True
        )
    assert read_binding(session_file) is None
    assert session_file.read_bytes() == transcript
    assert "12345" not in repr(logs)
    assert logs[0]["binding_removed"] is True
    assert reset_session(session_file) is False


def test_reset_warns_instead_of_raising(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    session_file = tmp_path / "s.jsonl"
    write_binding(session_file, ThreadBinding(thread_id="t"))

    def denied(path: str) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "unlink", denied)
    with capture_logs() as logs:
        assert reset_session(session_file, reason="reset") is False
    assert logs[0]["event"] == "failed to clear codex app-server binding on reset"
    assert logs[0]["log_level"] == "warning"


def test_projection_binding_requires_an_epoch() -> None:
    with pytest.raises(ValueError, match="epoch"):
        ProjectionBinding(mode="per_turn", epoch="")


def test_per_turn_projection_round_trips(tmp_path: Path) -> None:
    session_file = tmp_path / "s.jsonl"
    engine = ContextEngineBinding(
        engine_id="e",
        policy_fingerprint="p",
        projection=ProjectionBinding(mode="per_turn", epoch="7"),
    )
    written = write_binding(
        session_file,
        ThreadBinding(thread_id="t", context_engine=engine, dynamic_tools_fingerprint="sha256:d"),
    )
    raw = json.loads(Path(binding_path(session_file)).read_text())
    assert raw["contextEngine"]["projection"] == {
        "schemaVersion": 1,
        "mode": "per_turn",
        "epoch": "7",
    }
    loaded = read_binding(session_file)
    assert loaded == written
    assert loaded is not None
    assert loaded.context_engine is not None
    assert loaded.context_engine == engine


def test_the_thread_decision_round_trips_and_a_malformed_one_is_dropped(tmp_path: Path) -> None:
    from codex_turn.harness.binding import ThreadDecisionRecord

    session_file = tmp_path / "s.jsonl"
    record = ThreadDecisionRecord(action="rotate", reason="dynamic-tools-changed")
    write_binding(session_file, ThreadBinding(thread_id="t-1", thread_decision=record))
    raw = json.loads(Path(binding_path(session_file)).read_text())
    assert raw["threadDecision"] == {"action": "rotate", "reason": "dynamic-tools-changed"}
    loaded = read_binding(session_file)
    assert loaded is not None
    assert loaded.thread_decision == record
    raw["threadDecision"] = {"action": 3}
    Path(binding_path(session_file)).write_text(json.dumps(raw))
    again = read_binding(session_file)
    assert again is not None
    assert again.thread_decision is None
    assert again.thread_id == "t-1"


def test_the_runtime_policy_round_trips_and_old_sidecars_read_without_it(tmp_path: Path) -> None:
    session_file = tmp_path / "s.jsonl"
    written = write_binding(
        session_file,
        ThreadBinding(
            thread_id="t",
            model="gpt-5.5",
            approval_policy="on-request",
            sandbox="workspace-write",
            approvals_reviewer="auto_review",
            service_tier="fast",
        ),
    )
    raw = json.loads(Path(binding_path(session_file)).read_text())
    assert list(raw)[4:9] == [
        "model",
        "approvalPolicy",
        "sandbox",
        "approvalsReviewer",
        "serviceTier",
    ]
    assert (raw["approvalPolicy"], raw["sandbox"], raw["approvalsReviewer"]) == (
        "on-request",
        "workspace-write",
        "auto_review",
    )
    assert raw["serviceTier"] == "fast"
    loaded = read_binding(session_file)
    assert loaded == written
    assert loaded is not None
    assert (
        loaded.approval_policy,
        loaded.sandbox,
        loaded.approvals_reviewer,
        loaded.service_tier,
    ) == ("on-request", "workspace-write", "auto_review", "fast")
    # A sidecar written before the policy was recorded (earliest era: model only).
    Path(binding_path(session_file)).write_text(
        json.dumps(
            {
                "schemaVersion": 1,
                "sessionFile": str(session_file),
                "threadId": "old",
                "cwd": "/w",
                "model": "gpt-5",
                "createdAt": "2026-01-01T00:00:00.000Z",
                "updatedAt": "2026-01-01T00:00:00.000Z",
            }
        )
    )
    with capture_logs() as logs:
        old = read_binding(session_file)
    assert logs == []
    assert old is not None
    assert (old.thread_id, old.model) == ("old", "gpt-5")
    assert (old.approval_policy, old.sandbox, old.approvals_reviewer, old.service_tier) == (
        None,
        None,
        None,
        None,
    )
    rewritten = json.loads(binding_to_json(old))
    assert not {"approvalPolicy", "sandbox", "approvalsReviewer", "serviceTier"} & set(rewritten)


def test_one_session_path_keys_the_sidecar_the_lock_and_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    via_link, via_real = link / "s.jsonl", real / "s.jsonl"
    canonical = os.path.join(os.path.realpath(real), "s.jsonl")
    assert session_path(via_link) == session_path(via_real) == canonical
    monkeypatch.chdir(real)
    assert session_path("s.jsonl") == canonical
    # A missing directory cannot be resolved: the absolute, normalised path stands in.
    assert session_path(tmp_path / "none" / ".." / "none" / "s.jsonl") == str(
        tmp_path / "none" / "s.jsonl"
    )
    assert binding_path(via_link) == binding_path(via_real) == canonical + BINDING_SUFFIX
    written = write_binding(via_link, ThreadBinding(thread_id="t"))
    assert written.session_file == str(via_link)  # the caller's path is what is recorded
    assert read_binding(via_real) == attrs.evolve(written, session_file=str(via_real))
    result = mirror_turn(
        via_link,
        [{"role": "user", "content": "hi"}],
        scope="codex-app-server:t",
        identities=["turn-1:prompt"],
        session_id="s",
        cwd="/",
    )
    assert result.path == canonical
    assert read_session(via_link).path == read_session(via_real).path == canonical
    assert clear_binding(via_real) is True
    assert not Path(binding_path(via_link)).exists()


# --- whose binding it is: session id and transcript identity ------------------------------------


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
