"""The `codex-turn` command without the Codex binary: flags, exit codes and every bad input.

Each command runs as a subprocess (``python -m codex_turn`` or the installed entry point),
as a user would run it. Every bad input must give one line on stderr, no traceback, and the
exit code of :data:`codex_turn._cli_support.EXIT_CODES`. The commands that drive the real
binary are in ``tests/test_cli_codex.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from codex_turn import __version__
from codex_turn._cli_support import EXIT_CODES, exit_code_for

ENTRY_POINT = Path(sys.executable).with_name("codex-turn")


def run_cli(
    *args: str, cwd: Path, entry_point: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    command = [str(ENTRY_POINT)] if entry_point else [sys.executable, "-m", "codex_turn"]
    return subprocess.run(
        [*command, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def one_line_error(done: subprocess.CompletedProcess[str], code: int, needle: str) -> None:
    """Exit ``code``, nothing on stdout, one line on stderr naming ``needle``."""
    assert done.returncode == code, (done.returncode, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in done.stderr


def write_session(path: Path, *texts: str) -> Path:
    """A small OpenClaw/pi JSONL v3 transcript: a header, then alternating user/assistant."""
    stamp = "2026-01-01T00:00:00.000Z"
    lines = [{"type": "session", "version": 3, "id": path.stem, "timestamp": stamp, "cwd": "."}]
    parent = None
    for index, text in enumerate(texts):
        entry_id = f"m{index}"
        role = "user" if index % 2 == 0 else "assistant"
        content: object = text if role == "user" else [{"type": "text", "text": text}]
        lines.append(
            {
                "type": "message",
                "id": entry_id,
                "parentId": parent,
                "timestamp": stamp,
                "message": {"role": role, "content": content, "timestamp": 1_000 + index},
            }
        )
        parent = entry_id
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


ENGINE_MODULE = """
from codex_turn.testing import RecordingEngine

engine = RecordingEngine(engine_id="my-local-engine")


class CloseFails(RecordingEngine):
    def close(self):
        raise RuntimeError("an unexpected defect")


broken = CloseFails(engine_id="broken-close")
"""


# --- the command line itself ----------------------------------------------------------------


def call(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    """``codex-turn ARGS`` in this process (for the cheap checks); logging left as it is."""
    from codex_turn import cli

    monkeypatch.setattr(cli, "configure_cli_logging", lambda *a: None)
    try:
        code = cli.main(list(args))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_version_and_help_list_every_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    version = run_cli("--version", cwd=tmp_path, entry_point=True)
    assert (version.returncode, version.stdout.strip()) == (0, f"codex-turn {__version__}")
    code, usage, _ = call(monkeypatch, capsys, "--help")
    assert code == 0
    assert "exit status" in usage  # the exit-code table is documented in --help
    for command in ("demo", "run", "chat", "inspect", "doctor", "compact", "diagrams"):
        assert command in usage
        assert call(monkeypatch, capsys, command, "--help")[0] == 0
    # -v/-q/--log-format work before and after the command
    assert call(monkeypatch, capsys, "-q", "diagrams", "--help")[0] == 0
    assert call(monkeypatch, capsys, "diagrams", "-v", "--log-format", "json", "--help")[0] == 0


def test_unknown_commands_and_missing_arguments_are_usage_errors(tmp_path: Path) -> None:
    one_line_error(run_cli("bogus", cwd=tmp_path), 2, "invalid choice: 'bogus'")
    one_line_error(run_cli("run", "s.jsonl", cwd=tmp_path), 2, "--prompt")


def test_the_exit_code_table_maps_library_errors_by_family() -> None:
    from codex_turn import (
        AppServerClosed,
        EngineLoadError,
        InvalidTurnParams,
        SessionBusy,
        SessionError,
        SessionLockTimeout,
    )
    from codex_turn.harness.appserver.errors import CodexLoginRequired

    assert exit_code_for(InvalidTurnParams("x")) == 2
    assert exit_code_for(EngineLoadError("m:a", "no")) == 2
    assert exit_code_for(SessionError("x")) == 3
    assert exit_code_for(CodexLoginRequired(Path("/h"))) == 4
    assert exit_code_for(AppServerClosed()) == 5
    assert exit_code_for(SessionBusy("x")) == 6
    assert exit_code_for(SessionLockTimeout("/s", 1.0)) == 6
    assert exit_code_for(RuntimeError("x")) == 70
    assert set(EXIT_CODES.values()) <= {1, 2, 3, 4, 5, 6, 7}


# --- bad inputs: one line, a non-zero exit --------------------------------------------------


def test_compact_on_a_missing_session_says_so(tmp_path: Path) -> None:
    done = run_cli("compact", str(tmp_path / "missing.jsonl"), cwd=tmp_path)
    one_line_error(done, 3, "no such session file")
    assert "binding" not in done.stderr


def test_a_bad_timeout_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 17: `--timeout -5` printed a traceback.
    session = write_session(tmp_path / "s.jsonl", "hello")
    one_line_error(run_cli("compact", str(session), "--timeout", "-5", cwd=tmp_path), 2, "-5")
    for value in ("0", "abc", "nan", "inf"):
        code, out, err = call(monkeypatch, capsys, "compact", str(session), f"--timeout={value}")
        assert (code, out, len(err.strip().splitlines())) == (2, "", 1), err
    code, _, err = call(monkeypatch, capsys, "run", "s", "--prompt", "x", "--turn-timeout", "-1")
    assert code == 2
    assert "--turn-timeout" in err


def test_bad_run_inputs_fail_before_codex_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    session = str(tmp_path / "s.jsonl")
    cases = [
        (("--prompt", "  ", "--offline"), 2, "--prompt must not be empty"),
        (("--prompt", "hi", "--offline-delay", "1"), 2, "--offline-delay needs --offline"),
        (("--prompt", "hi", "--offline", "--codex-home", "x"), 2, "not allowed with"),
        (("--prompt", "hi", "--offline", "--workspace", "nowhere"), 2, "not a directory"),
        (("--prompt", "hi", "--token-budget", "-3"), 2, "--token-budget"),
    ]
    for args, expected, needle in cases:
        code, out, err = call(monkeypatch, capsys, "run", session, *args)
        assert (code, out) == (expected, ""), (args, err)
        assert needle in err, (args, err)
        assert len(err.strip().splitlines()) == 1, err
    code, _, err = call(monkeypatch, capsys, "chat", str(tmp_path), "--offline")
    assert code == 3
    assert "a directory" in err
    done = run_cli("run", session, "--prompt", "hi", "--engine", "nomod:Thing", cwd=tmp_path)
    one_line_error(done, 2, "cannot load context engine 'nomod:Thing'")
    assert list(tmp_path.iterdir()) == []  # nothing was created


def test_engine_specs_load_from_the_current_directory(tmp_path: Path) -> None:
    # Issue 17: `--engine mod:Attr` ignored the current directory. The installed entry point
    # (whose sys.path does not hold the cwd) must find a module next to the user.
    (tmp_path / "myengine.py").write_text(ENGINE_MODULE, encoding="utf-8")
    session = write_session(tmp_path / "s.jsonl", "hello", "hi there")
    done = run_cli(
        "inspect", str(session), "--engine", "myengine:engine", cwd=tmp_path, entry_point=True
    )
    assert done.returncode == 0, done.stderr
    assert "engine: my-local-engine" in done.stdout


def test_unexpected_errors_are_one_line_and_a_traceback_only_with_v(tmp_path: Path) -> None:
    (tmp_path / "myengine.py").write_text(ENGINE_MODULE, encoding="utf-8")
    session = write_session(tmp_path / "s.jsonl", "hello")
    args = ("inspect", str(session), "--engine", "myengine:broken")
    one_line_error(run_cli(*args, cwd=tmp_path), 70, "unexpected error: RuntimeError")
    verbose = run_cli(*args, "-v", cwd=tmp_path)
    assert verbose.returncode == 70
    assert "Traceback" in verbose.stderr


def test_without_the_codex_extra_every_codex_command_is_one_typed_line(tmp_path: Path) -> None:
    # Issue 17: the demo printed a 60-line traceback and raised a bare FileNotFoundError.
    shadow = tmp_path / "shadow" / "codex_cli_bin"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: not installed')\n")
    env = dict(os.environ, PYTHONPATH=str(shadow.parent))
    work = tmp_path / "work"
    work.mkdir()
    for args in (("demo",), ("run", "s.jsonl", "--prompt", "hi", "--offline")):
        done = run_cli(*args, cwd=work, env=env)
        one_line_error(done, 5, "pip install 'codex-turn[codex]'")
    doctor = run_cli("doctor", "--json", cwd=work, env=env)
    assert doctor.returncode == 1
    checks = {c["check"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["codex binary"]["ok"] is False
    assert list(work.iterdir()) == []


# --- inspect --------------------------------------------------------------------------------


def test_inspect_shows_what_the_next_turn_would_see_and_decide(tmp_path: Path) -> None:
    session = write_session(tmp_path / "s.jsonl", "remember Lisbon", "noted: Lisbon")
    text = run_cli("inspect", str(session), cwd=tmp_path)  # no store next to it: no engine
    assert text.returncode == 0, text.stderr
    assert "engine: none (plain Codex)" in text.stdout
    assert "next turn's thread decision: start (missing-thread-binding)" in text.stdout
    assert not (tmp_path / "context.sqlite").exists()
    done = run_cli("inspect", str(session), "--engine", "sqlite", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [m["role"] for m in report["messages"]] == ["user", "assistant"]
    assert report["binding"] is None
    assert report["threadDecision"]["action"] == "start"
    assert report["threadDecision"]["reason"] == "missing-thread-binding"
    assert report["projected"] is True  # a fresh thread gets the conversation
    assert "remember Lisbon" in report["prompt"]
    assert report["path"][-1] == "STARTING_THREAD"  # stopped before anything reached Codex


def test_inspect_trace_checks_each_step_against_the_turn_table(tmp_path: Path) -> None:
    legal = [
        {"state": "IDLE", "trigger": "started", "dest": "READING_HISTORY"},
        {"state": "READING_HISTORY", "trigger": "history_read", "dest": "BOOTSTRAPPING"},
    ]
    (tmp_path / "legal.json").write_text(json.dumps({"trace": legal}))
    done = run_cli("inspect", "--trace", "legal.json", "--out", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "every step is an edge of the turn table" in done.stdout
    diagram = (tmp_path / "out" / "turn-path.mmd").read_text()
    assert "class BOOTSTRAPPING current" in diagram
    illegal = [{"state": "IDLE", "trigger": "turn_completed", "dest": "DONE"}]
    (tmp_path / "illegal.json").write_text(json.dumps(illegal))
    bad = run_cli("inspect", "--trace", "illegal.json", cwd=tmp_path)
    assert bad.returncode == 1
    assert "NOT AN EDGE OF THE TURN TABLE" in bad.stdout
    one_line_error(run_cli("inspect", "--trace", "nope.json", cwd=tmp_path), 3, "nope.json")
    (tmp_path / "junk.json").write_text("{not json")
    one_line_error(run_cli("inspect", "--trace", "junk.json", cwd=tmp_path), 2, "not JSON")
    (tmp_path / "other.json").write_text('{"a": 1}')
    one_line_error(run_cli("inspect", "--trace", "other.json", cwd=tmp_path), 2, "no trace")


# --- diagrams and compact -------------------------------------------------------------------


def test_diagrams_write_where_asked_never_into_the_current_directory(tmp_path: Path) -> None:
    done = run_cli("diagrams", "--out", "out", "--no-svg", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["compaction.mmd", "turn.mmd"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (tmp_path / "file").write_text("x")
    one_line_error(run_cli("diagrams", "--out", "file", cwd=tmp_path), 2, "not a directory")


def test_compact_uses_the_reference_engine_where_its_store_is(tmp_path: Path) -> None:
    # Issue 12: the embedded default. A session whose directory holds the reference engine's
    # store is compacted by that engine first (it owns compaction); `--engine none` opts out.
    import anyio

    from codex_turn.engines import SqliteContextEngine
    from codex_turn.harness.engine import IngestParams

    session = write_session(tmp_path / "s.jsonl", "hello")

    async def remember() -> None:
        engine = SqliteContextEngine.next_to(session)
        await engine.ingest(
            IngestParams(
                session_id="s",
                session_key=None,
                message={"role": "user", "content": "hello", "timestamp": 1},
            )
        )
        engine.close()

    anyio.run(remember)
    home = tmp_path / "never-created-codex-home"
    base = ["compact", str(session), "--codex-home", str(home), "--model-base-url", "http://x/v1"]
    default = run_cli(*base, cwd=tmp_path)
    assert json.loads(default.stdout)["ok"] is True  # the engine answered (nothing to compact)
    opted_out = run_cli(*base, "--engine", "none", cwd=tmp_path)
    assert opted_out.returncode == 1
    assert json.loads(opted_out.stdout)["reason"] == "no codex app-server thread binding"
    assert not home.exists()  # no session binding: Codex was never started
    one_line_error(
        run_cli("compact", str(session), "--model-base-url", "http://x", cwd=tmp_path),
        2,
        "--model-base-url needs --codex-home",
    )
