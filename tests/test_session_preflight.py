"""What a transcript must be before a turn reaches Codex, and what the turn writes first: a
transcript that cannot take the turn's mirror is refused before anything reaches Codex, one
that holds only a torn header is recovered, hostile paths (a dangling symbolic link, a FIFO, a
directory) fail at once with a typed error, stale-lock leftovers are swept, and the user's
prompt is durable before the model sees it."""

from __future__ import annotations

import collections
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs
from support.session_turns import turn_messages

from codex_turn.harness.session import (
    MirrorInputError,
    SessionError,
    SessionFormatError,
    TranscriptUnwritable,
    ensure_transcript_writable,
    load_session_messages,
    mirror_prompt,
    mirror_turn,
    parse_session_bytes,
    read_session,
)
from codex_turn.harness.session import _lock as lock_mod

ROOT = Path(__file__).parent.parent
PROMPT_WRITER = Path(__file__).parent / "support" / "session_prompt_writer.py"
SESSION_ID = "019d5c1e-0000-7000-8000-0000000000aa"
FAST = 0.5  # seconds: "at once" (the dangling-link bug took ~0.8 s of retries)


def _check(path: Path) -> None:
    ensure_transcript_writable(path, session_id=SESSION_ID, cwd="/work")


def _mirror(path: Path, turn: int = 0) -> Any:
    messages, identities = turn_messages("t", turn)
    return mirror_turn(
        path,
        messages,
        scope="codex-app-server:t",
        identities=identities,
        session_id=SESSION_ID,
        cwd="/work",
    )


def _keys(path: Path) -> collections.Counter[str]:
    parsed = parse_session_bytes(path.read_bytes())
    return collections.Counter(
        e["message"]["idempotencyKey"] for e in parsed.entries if isinstance(e.get("message"), dict)
    )


def _header(session_id: str = SESSION_ID) -> bytes:
    header = {"type": "session", "version": 3, "id": session_id, "timestamp": "x", "cwd": "/"}
    return json.dumps(header).encode() + b"\n"


# --- the preflight: what may take a mirror ------------------------------------------------------


def test_a_writable_transcript_passes_quickly_and_is_not_touched(tmp_path: Path) -> None:
    missing = tmp_path / "deep" / "er" / "s.jsonl"
    _check(missing)
    assert not missing.exists()
    assert not missing.parent.exists()  # the preflight creates nothing
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    _check(empty)
    assert empty.read_bytes() == b""
    path = tmp_path / "s.jsonl"
    _mirror(path)
    before = path.read_bytes()
    started = time.monotonic()
    for _ in range(50):
        _check(path)
    assert (time.monotonic() - started) / 50 < 0.01
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "content",
    [
        b'{"type":"message","id":"1","parentId":null,"message":{}}\n',
        b'{"type":"session","version":3}\n',  # no id
        b"notes, not a transcript",
        b'{"type":"message","id":"1","par',  # a torn entry is not a torn header
    ],
)
def test_a_file_without_a_session_header_is_refused_and_left_alone(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(content)
    with pytest.raises(SessionFormatError) as caught:
        _check(path)
    assert isinstance(caught.value, TranscriptUnwritable)
    assert path.read_bytes() == content


def test_a_directory_at_the_path_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.mkdir()
    with pytest.raises(TranscriptUnwritable, match="a directory"):
        _check(path)
    with pytest.raises(TranscriptUnwritable, match="a directory"):
        _mirror(path)


def test_a_parent_that_is_a_file_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(TranscriptUnwritable):
        _check(blocker / "s.jsonl")


def test_a_lock_file_that_is_not_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    (tmp_path / "s.jsonl.lock").mkdir()
    with pytest.raises(TranscriptUnwritable, match="lock file"):
        _check(path)


def test_unwritable_files_and_directories_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.jsonl"
    _mirror(path)
    real_access = os.access
    denied: set[str] = set()

    def access(target: Any, mode: int, **kwargs: Any) -> bool:
        if os.fspath(target) in denied and mode & os.W_OK:
            return False
        return real_access(target, mode, **kwargs)

    # os.access, not chmod: the suite may run as root, for whom every mode bit is writable.
    monkeypatch.setattr(os, "access", access)
    denied.add(str(path))
    with pytest.raises(TranscriptUnwritable, match="not writable"):
        _check(path)
    denied.clear()
    denied.add(os.path.realpath(tmp_path))
    with pytest.raises(TranscriptUnwritable, match="directory is not writable"):
        _check(path)
    with pytest.raises(TranscriptUnwritable, match="directory is not writable"):
        _check(tmp_path / "new" / "s.jsonl")  # the nearest existing ancestor decides


# --- hostile paths: at once, typed, never a hang ------------------------------------------------


def test_a_dangling_symlink_is_refused_at_once_by_preflight_and_mirror(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.symlink_to(tmp_path / "gone.jsonl")
    for attempt in (_check, _mirror):
        started = time.monotonic()
        with pytest.raises(TranscriptUnwritable, match="dangling symbolic link"):
            attempt(path)
        assert time.monotonic() - started < FAST  # was a RecursionError after ~0.8 s
    assert not (tmp_path / "gone.jsonl").exists()  # nothing written through the link
    assert path.is_symlink()


def test_a_symlink_loop_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.symlink_to(path)
    with pytest.raises(TranscriptUnwritable, match="symbolic link loop"):
        _check(path)
    with pytest.raises(TranscriptUnwritable):
        _mirror(path)


def test_a_symlink_to_a_transcript_is_fine(tmp_path: Path) -> None:
    real = tmp_path / "real.jsonl"
    _mirror(real)
    link = tmp_path / "s.jsonl"
    link.symlink_to(real)
    _check(link)
    assert _mirror(link, 1).appended == 4
    assert link.is_symlink()


_FIFO_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import anyio
    from codex_turn.harness.binding import read_binding
    from codex_turn.harness.session import (
        TranscriptUnwritable, ensure_transcript_writable, load_session_messages, mirror_turn,
    )

    path = sys.argv[1]
    os.mkfifo(path)
    os.mkfifo(path + ".codex-app-server.json")
    started = time.monotonic()
    try:
        ensure_transcript_writable(path, session_id="s", cwd="/")
    except TranscriptUnwritable as error:
        print("preflight", error.why)

    async def mirror() -> None:
        with anyio.fail_after(5):  # the caller's cancellation must be able to reach it
            await anyio.to_thread.run_sync(
                lambda: mirror_turn(
                    path, [{"role": "user", "content": "x"}], scope="codex-app-server:t",
                    identities=["r:prompt"], session_id="s", cwd="/",
                )
            )

    try:
        anyio.run(mirror)
    except TranscriptUnwritable as error:
        print("mirror", error.why)
    print("read", len(load_session_messages(path)))
    print("binding", read_binding(path))
    print("elapsed", time.monotonic() - started)
    """
)


def test_a_fifo_at_the_path_fails_at_once_and_never_hangs(tmp_path: Path) -> None:
    """Run in a subprocess: before the fix, opening the FIFO blocked forever (and a worker
    thread stuck in open() cannot be cancelled), so a hang fails by timeout, not forever."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _FIFO_SCRIPT, str(tmp_path / "s.jsonl")],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a FIFO at the session path hung the preflight, the mirror or a read")
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert "a FIFO" in lines["preflight"]
    assert "a FIFO" in lines["mirror"]
    assert lines["read"] == "0"
    assert lines["binding"] == "None"
    assert float(lines["elapsed"]) < 5


# --- a transcript that holds nothing is recovered -----------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        b'{"type":"sess',
        b'{"type":"session","version":3,"id":"019d5c1e-0000-7000-8000-00',
        b'{"type": "session", "version": 3, "id": "x"',  # another writer's spacing
        b"{",
        b'\xef\xbb\xbf{"type":"session"',
        b'{"type":"sess\n',  # torn, then the newline of a later (failed) write
        b"\n\n  \n",
    ],
)
def test_the_preflight_replaces_a_torn_header_with_a_fresh_one(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(content)
    path.chmod(0o644)
    with capture_logs() as logs:
        _check(path)
    lines = path.read_bytes().split(b"\n")
    assert lines[1:] == [b""]
    header = json.loads(lines[0])
    assert header["type"] == "session"
    assert (header["id"], header["cwd"], header["version"]) == (SESSION_ID, "/work", 3)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [log["event"] for log in logs] == [
        "session transcript held only a torn header; replaced with a fresh header"
    ]
    assert logs[0]["log_level"] == "warning"
    assert logs[0]["bytes"] == len(content)
    assert "sess" not in repr(logs[0]).replace("session transcript", "")  # no content logged
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    # And the turn goes on as usual.
    assert _mirror(path).appended == 4
    assert len(load_session_messages(path)) == 4


def test_the_mirror_alone_recovers_a_torn_header(tmp_path: Path) -> None:
    """A torn header used to be refused forever (SessionFormatError on every turn)."""
    path = tmp_path / "s.jsonl"
    path.write_bytes(b'{"type":"session","version":3,"id":"0')
    result = _mirror(path)
    assert result.appended == 4
    transcript = read_session(path)
    assert transcript.header is not None
    assert transcript.header["id"] == SESSION_ID
    assert transcript.malformed_lines == 0
    assert len(transcript.entries) == 4


def test_a_torn_header_behind_a_symlink_is_recovered_in_place(tmp_path: Path) -> None:
    real = tmp_path / "real.jsonl"
    real.write_bytes(b'{"type":"sess')
    link = tmp_path / "s.jsonl"
    link.symlink_to(real)
    _check(link)
    assert link.is_symlink()
    assert json.loads(real.read_bytes())["id"] == SESSION_ID


# --- stale-lock leftovers -----------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_lock_leftovers_of_dead_breakers_are_swept(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    dead = tmp_path / f"s.jsonl.lock.stale.{_dead_pid()}.0badf00d"
    live = tmp_path / "s.jsonl.lock.stale.1.cafebabe"  # pid 1 is alive: maybe mid-break
    unrelated = tmp_path / "s.jsonl.lock.stale.notes"
    for leftover in (dead, live, unrelated):
        leftover.write_text('{"pid": 1}')
    _mirror(path)
    assert not dead.exists()
    assert live.exists()
    assert unrelated.exists()


def test_breaking_a_stale_lock_sweeps_what_an_earlier_breaker_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.jsonl"
    _mirror(path)  # the first acquisition in this process has swept already
    lock = tmp_path / "s.jsonl.lock"
    # A breaker killed between its rename and its unlink:
    leftover = tmp_path / f"s.jsonl.lock.stale.{_dead_pid()}.12345678"
    leftover.write_text(json.dumps({"pid": 1, "createdAt": "2000-01-01T00:00:00.000Z"}))
    lock.write_text(json.dumps({"pid": _dead_pid(), "createdAt": "2026-04-24T00:00:00.000Z"}))
    _mirror(path, 1)
    assert not lock.exists()
    assert not leftover.exists()
    assert not [p for p in tmp_path.iterdir() if ".stale." in p.name]
    assert lock_mod._path_locks  # one path lock per transcript, kept


# --- the user's words are durable before the model sees them ------------------------------------


def _prompt(text: str = "what did we decide yesterday?") -> dict[str, Any]:
    return {"role": "user", "content": text, "timestamp": 1_774_000_000_000}


def test_pre_mirror_then_turn_mirror_writes_the_prompt_once(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    run_id = "run-4f1c"
    first = mirror_prompt(
        path,
        _prompt(),
        scope="codex-app-server:thread-1",
        identity=f"{run_id}:prompt",
        session_id=SESSION_ID,
        cwd="/work",
    )
    assert first.created
    assert first.appended_keys == ("codex-app-server:thread-1:run-4f1c:prompt",)
    # A retried pre-mirror (the same run) appends nothing.
    again = mirror_prompt(
        path,
        _prompt(),
        scope="codex-app-server:thread-1",
        identity=f"{run_id}:prompt",
        session_id=SESSION_ID,
        cwd="/work",
    )
    assert (again.appended, again.skipped) == (0, 1)
    # The turn completes: the projector's snapshot, with the prompt's identity replaced by
    # the run identity the pre-mirror used (the projector's is `<turnId>:prompt`).
    messages, identities = turn_messages("t", 0)
    messages[0] = _prompt()
    identities[0] = f"{run_id}:prompt"
    done = mirror_turn(
        path,
        messages,
        scope="codex-app-server:thread-1",
        identities=identities,
        session_id=SESSION_ID,
        cwd="/work",
    )
    assert done.skipped_keys == ("codex-app-server:thread-1:run-4f1c:prompt",)
    assert done.appended == 3
    keys = _keys(path)
    assert set(keys.values()) == {1}
    history = load_session_messages(path)
    assert [m["role"] for m in history] == ["user", "assistant", "assistant", "assistant"]
    assert history[0]["content"] == _prompt()["content"]
    # The rest chains from the pre-mirrored prompt: one conversation, as one append would be.
    entries = read_session(path).entries
    assert [e["parentId"] for e in entries] == [None, *(e["id"] for e in entries[:-1])]


def test_the_prompt_survives_a_host_killed_mid_turn(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    prompt = "remember: the launch moved to friday"
    proc = subprocess.Popen(
        [sys.executable, str(PROMPT_WRITER), str(path), "thread-9", "run-77", prompt],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # structlog's default output shares stdout
        if line.strip() == "prompted":
            break
    else:
        pytest.fail("the writer ended before pre-mirroring the prompt")
    proc.send_signal(signal.SIGKILL)  # the host dies while the model is answering
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert [m["content"] for m in load_session_messages(path)] == [prompt]
    assert _keys(path) == {"codex-app-server:thread-9:run-77:prompt": 1}
    assert not Path(str(path) + ".lock").exists()
    # Had the turn completed in another process, its mirror would still write it once.
    messages, identities = turn_messages("t", 0)
    messages[0] = {"role": "user", "content": prompt, "timestamp": 1_774_000_000_000}
    identities[0] = "run-77:prompt"
    mirror_turn(
        path,
        messages,
        scope="codex-app-server:thread-9",
        identities=identities,
        session_id="session-a",
        cwd="/work",
    )
    assert set(_keys(path).values()) == {1}
    assert load_session_messages(path)[0]["content"] == prompt
    assert len(load_session_messages(path)) == 4


def test_only_a_user_message_can_be_pre_mirrored(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    with pytest.raises(MirrorInputError):
        mirror_prompt(
            path,
            {"role": "assistant", "content": []},
            scope="codex-app-server:t",
            identity="r:prompt",
            session_id=SESSION_ID,
            cwd="/",
        )
    with pytest.raises(MirrorInputError):
        mirror_prompt(
            path, _prompt(), scope="codex-app-server:t", identity=" ", session_id="s", cwd="/"
        )
    assert not path.exists()


def test_pre_mirror_appends_to_an_existing_transcript_and_refuses_what_the_mirror_refuses(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(_header("host-made") + b"\n")
    result = mirror_prompt(
        path, _prompt(), scope="codex-app-server:t", identity="r:prompt", session_id="s", cwd="/"
    )
    assert (result.created, result.appended) == (False, 1)
    assert read_session(path).header == json.loads(_header("host-made"))
    bad = tmp_path / "bad.jsonl"
    bad.mkdir()
    with pytest.raises(TranscriptUnwritable):
        mirror_prompt(
            bad, _prompt(), scope="codex-app-server:t", identity="r:prompt", session_id="s", cwd="/"
        )


async def _mirror_from_a_worker(path: Path) -> None:
    await anyio.to_thread.run_sync(lambda: _mirror(path))


def test_errors_stay_session_errors_for_existing_callers(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.mkdir()
    with pytest.raises(SessionError):
        anyio.run(_mirror_from_a_worker, path)
