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
    *args: str,
    cwd: Path,
    entry_point: bool = False,
    env: dict[str, str] | None = None,
    input: str = "",
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
        input=input,
    )


def without_codex(tmp_path: Path) -> dict[str, str]:
    """An environment with no Codex binary: the pinned package shadowed by one that fails to
    import, and no `codex` on PATH."""
    shadow = tmp_path / "shadow" / "codex_cli_bin"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: not installed')\n")
    path = os.pathsep.join(
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not (Path(d) / "codex").exists()
    )
    return dict(os.environ, PYTHONPATH=str(shadow.parent), PATH=path)


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


def remember_in_store(session: Path) -> None:
    """One message in the reference engine's store next to ``session`` (creating it)."""
    import anyio

    from codex_turn.engines import SqliteContextEngine
    from codex_turn.harness.engine import IngestParams

    async def remember() -> None:
        engine = SqliteContextEngine.next_to(session)
        await engine.ingest(
            IngestParams(
                session_id=session.stem,
                session_key=None,
                message={"role": "user", "content": "hello", "timestamp": 1},
            )
        )
        engine.close()

    anyio.run(remember)


ENGINE_MODULE = """
import copy
import json

from codex_turn import AssembleResult, CompactResult, ContextEngineInfo, IngestResult
from codex_turn.testing import RecordingEngine

engine = RecordingEngine(engine_id="my-local-engine")


class CloseFails(RecordingEngine):
    def close(self):
        raise RuntimeError("an unexpected defect")


broken = CloseFails(engine_id="broken-close")

# assemble() returns None: a contract violation (a logged fallback; --strict: exit 7).
bad_assemble = RecordingEngine(engine_id="bad-assemble", responses={"assemble": lambda p: None})


# A per-turn engine of someone else's: the last four messages and an instruction.
class Window:
    info = ContextEngineInfo(id="window-4", name="window", version="1")

    async def ingest(self, params):
        return IngestResult(ingested=False)

    async def assemble(self, params):
        return AssembleResult(
            messages=copy.deepcopy(list(params.messages)[-4:]),
            estimated_tokens=len(json.dumps(list(params.messages)[-4:])) // 4,
            system_prompt_addition="Answer briefly.",
        )

    async def compact(self, params):
        return CompactResult(ok=True, compacted=False, reason="a window never compacts")


window = Window()


# A durable engine of one's own: its factory gets the session's directory (--engine).
class Durable(Window):
    def __init__(self, directory):
        self.path = str(directory / "my-store.json")


def durable(directory):
    return Durable(directory)
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


def test_an_unknown_flag_points_to_the_help_of_its_command(tmp_path: Path) -> None:
    # Before its fix: it pointed to `codex-turn --help`, which does not list the flag.
    done = run_cli("run", "s.jsonl", "--prompt", "hi", "--bogus", cwd=tmp_path)
    one_line_error(done, 2, "unrecognized arguments: --bogus (see codex-turn run --help)")
    done = run_cli("inspect", "--trace", "t.json", "--nope", cwd=tmp_path)
    one_line_error(done, 2, "(see codex-turn inspect --help)")
    assert list(tmp_path.iterdir()) == []


def test_with_json_logs_the_commands_own_stderr_lines_are_json_too(tmp_path: Path) -> None:
    done = run_cli("inspect", "missing.jsonl", "--log-format", "json", cwd=tmp_path)
    assert (done.returncode, done.stdout) == (3, "")
    (line,) = done.stderr.splitlines()
    error = json.loads(line)
    assert (error["event"], error["level"], error["exitCode"]) == ("error", "error", 3)
    assert "no such session file" in error["message"]


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


#: A key an engine's error message quotes: the CLI must never print it.
LEAKED_KEY = "sk-proj-CLILEAK0123456789abcdef"

SECRET_ENGINE_MODULE = f"""
raise ImportError("engine config rejected: api_key={LEAKED_KEY} (check OPENAI_API_KEY)")
"""

SECRET_DEFECT_MODULE = f"""
from codex_turn.testing import RecordingEngine


class Leaky(RecordingEngine):
    def close(self):
        raise RuntimeError("lost connection with Authorization: Bearer {LEAKED_KEY}")


engine = Leaky(engine_id="leaky")
"""


def test_every_line_the_cli_prints_on_stderr_is_scrubbed_of_secrets(tmp_path: Path) -> None:
    # Before its fix: an engine whose import error quoted a key had the key printed verbatim
    # in the error line, in console and JSON format, and in the -v traceback.
    (tmp_path / "secretengine.py").write_text(SECRET_ENGINE_MODULE, encoding="utf-8")
    (tmp_path / "leakyengine.py").write_text(SECRET_DEFECT_MODULE, encoding="utf-8")
    session = str(write_session(tmp_path / "s.jsonl", "hello"))
    runs = {
        "load error": ("inspect", session, "--engine", "secretengine:engine"),
        "defect": ("inspect", session, "--engine", "leakyengine:engine"),
    }
    for what, args in runs.items():
        for extra in ((), ("--log-format", "json"), ("-vv",), ("-vv", "--log-format", "json")):
            done = run_cli(*args, *extra, cwd=tmp_path)
            assert done.returncode in (2, 70), (what, extra, done.stderr)
            assert LEAKED_KEY not in done.stderr + done.stdout, (what, extra)
            assert "[redacted]" in done.stderr, (what, extra, done.stderr)
            if "json" in extra and "-vv" not in extra:
                (line,) = done.stderr.splitlines()
                assert json.loads(line)["exitCode"] == done.returncode


def test_with_json_logs_usage_errors_are_json_lines_too(tmp_path: Path) -> None:
    # Before its fix: argparse's usage errors were plain text under --log-format json.
    cases = [
        (("run", "s.jsonl", "--log-format", "json"), "--prompt"),
        (("--log-format=json", "bogus"), "invalid choice: 'bogus'"),
        (("run", "s.jsonl", "--prompt", "hi", "--bogus", "--log-format", "json"), "--bogus"),
        (("inspect", "s.jsonl", "--log-f", "json", "--token-budget", "-3"), "--token-budget"),
    ]
    for args, needle in cases:
        done = run_cli(*args, cwd=tmp_path)
        assert (done.returncode, done.stdout) == (2, ""), (args, done.stderr)
        (line,) = done.stderr.splitlines()
        error = json.loads(line)
        assert (error["level"], error["exitCode"], error["event"]) == ("error", 2, "usage")
        assert needle in error["message"], (args, error)
    plain = run_cli("run", "s.jsonl", cwd=tmp_path)
    one_line_error(plain, 2, "the following arguments are required: --prompt")
    assert not plain.stderr.startswith("{")


def test_absurd_numbers_and_unusable_text_are_usage_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before its fix: a 400-digit --token-budget ended in OverflowError (exit 70); a NUL in
    # a path in ValueError (exit 70); a non-UTF-8 argument in UnicodeEncodeError.
    monkeypatch.chdir(tmp_path)
    session = str(write_session(tmp_path / "s.jsonl", "hello"))
    cases = [
        (("compact", session, "--token-budget", "9" * 400), "--token-budget: must be at most"),
        (("inspect", session, "--token-budget", str(2**70)), "must be at most 9007199254740992"),
        (("run", session, "--prompt", "hi", "--turn-timeout", "1e300"), "must be at most 1e+09"),
        (("compact", session, "--interrupt-grace", "1e12"), "--interrupt-grace"),
        (("inspect", "a\0b.jsonl"), "SESSION_FILE: contains a NUL byte"),
        (("inspect", session, "--trace", "t\0"), "--trace: contains a NUL byte"),
        (("doctor", "--codex-home", "x" * 300), "--codex-home: file name too long"),
        (("diagrams", "--out", "d/" * 2100), "--out: file name too long"),
        (("run", session, "--prompt", "a\0b"), "--prompt: contains a NUL byte"),
        (("run", session, "--prompt", os.fsdecode(b"caf\xe9")), "--prompt: is not UTF-8 text"),
        (("inspect", session, "--session-key", "k\udc80"), "--session-key: is not UTF-8 text"),
    ]
    for args, needle in cases:
        code, out, err = call(monkeypatch, capsys, *args)
        assert (code, out) == (2, ""), (args, err)
        assert needle in err, (args, err)
        assert len(err.strip().splitlines()) == 1, err
    # An unusable output directory, or a trace file one cannot read as a file: typed too.
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    code, _, err = call(monkeypatch, capsys, "diagrams", "--out", "file/sub", "--no-svg")
    assert (code, "--out: cannot create") == (2, err[err.index("--out") :][:20]), err
    code, _, err = call(monkeypatch, capsys, "inspect", "--trace", "fifo")  # never blocks
    assert (code, "is not a regular file" in err) == (3, True), err
    code, _, err = call(monkeypatch, capsys, "doctor", "--codex-home", "~nosuchuser0/x")
    assert code == 1, err  # reported (no such home), not RuntimeError from ~user


# --- bad inputs: one line, a non-zero exit --------------------------------------------------


def test_compact_on_a_missing_session_says_so(tmp_path: Path) -> None:
    done = run_cli("compact", str(tmp_path / "missing.jsonl"), cwd=tmp_path)
    one_line_error(done, 3, "no such session file")
    assert "binding" not in done.stderr


def test_a_bad_timeout_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before its fix: `--timeout -5` printed a traceback.
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
    # Before its fix: `--engine mod:Attr` ignored the current directory. The installed entry point
    # (whose sys.path does not hold the cwd) must find a module next to the user.
    (tmp_path / "myengine.py").write_text(ENGINE_MODULE, encoding="utf-8")
    session = write_session(tmp_path / "s.jsonl", "hello", "hi there")
    done = run_cli(
        "inspect", str(session), "--engine", "myengine:engine", cwd=tmp_path, entry_point=True
    )
    assert done.returncode == 0, done.stderr
    assert "engine: my-local-engine" in done.stdout


def test_an_engine_factory_gets_the_directory_of_the_session(tmp_path: Path) -> None:
    # Before its fix: --engine called a factory with nothing, so a durable engine could not
    # find its store next to the session.
    (tmp_path / "myengine.py").write_text(ENGINE_MODULE, encoding="utf-8")
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    session = write_session(sessions / "s.jsonl", "hello", "hi there")
    for spec in ("myengine:durable", "myengine:Durable"):
        done = run_cli("inspect", str(session), "--engine", spec, "--json", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        store = sessions / "my-store.json"
        assert json.loads(done.stdout)["engine"] == f"window-4 (store {store})"


def test_unexpected_errors_are_one_line_and_a_traceback_only_with_v(tmp_path: Path) -> None:
    (tmp_path / "myengine.py").write_text(ENGINE_MODULE, encoding="utf-8")
    session = write_session(tmp_path / "s.jsonl", "hello")
    args = ("inspect", str(session), "--engine", "myengine:broken")
    one_line_error(run_cli(*args, cwd=tmp_path), 70, "unexpected error: RuntimeError")
    verbose = run_cli(*args, "-v", cwd=tmp_path)
    assert verbose.returncode == 70
    assert "Traceback" in verbose.stderr


def test_without_the_codex_extra_every_codex_command_is_one_typed_line(tmp_path: Path) -> None:
    # Before its fix: the demo printed a 60-line traceback and raised a bare FileNotFoundError.
    env = without_codex(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    for args in (("demo",), ("run", "s.jsonl", "--prompt", "hi", "--offline")):
        done = run_cli(*args, cwd=work, env=env)
        one_line_error(done, 5, "pip install 'codex-turn[codex]'")
        assert "--codex-bin PATH" in done.stderr  # and how to use one's own binary
    doctor = run_cli("doctor", "--json", cwd=work, env=env)
    assert doctor.returncode == 1
    checks = {c["check"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["codex binary"]["ok"] is False
    assert list(work.iterdir()) == []


def test_doctor_reports_a_binary_of_another_version_than_the_pinned_protocol(
    tmp_path: Path,
) -> None:
    # Before its fix: doctor said "ok" for any binary, whatever version it claimed.
    from codex_turn.harness.appserver.defaults import CODEX_VERSION

    fake = tmp_path / "codex"
    fake.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && echo "codex-cli 0.999.0" && exit 0\nexit 1\n'
    )
    fake.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    done = run_cli(
        "doctor", "--codex-bin", str(fake), "--codex-home", str(home), "--json", cwd=tmp_path
    )
    assert done.returncode == 1, done.stdout
    binary = {c["check"]: c for c in json.loads(done.stdout)["checks"]}["codex binary"]
    assert binary["ok"] is False
    assert binary["version"] == "codex-cli 0.999.0"
    assert f"version 0.999.0, not {CODEX_VERSION}" in binary["detail"]
    assert sorted(p.name for p in home.iterdir()) == []


def test_the_pinned_codex_version_is_the_one_the_package_pins() -> None:
    import tomllib

    from codex_turn.harness.appserver.defaults import CODEX_VERSION

    root = Path(__file__).resolve().parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert f"openai-codex-cli-bin=={CODEX_VERSION}" in extras["optional-dependencies"]["codex"]


def test_login_refuses_what_it_cannot_use_before_running_codex(tmp_path: Path) -> None:
    fake = tmp_path / "codex"  # never run: every case stops before it
    fake.write_text("#!/bin/sh\ntouch ran\nexit 0\n")
    fake.chmod(0o755)
    bin_ = ("--codex-bin", str(fake))
    one_line_error(
        run_cli("login", "--with-api-key", *bin_, cwd=tmp_path, input=" \n"),
        2,
        "nothing on stdin (--with-api-key reads the API key from there)",
    )
    one_line_error(
        run_cli("login", "--with-api-key", *bin_, cwd=tmp_path, input="sk-a b\n"),
        2,
        "not one line of text",
    )
    missing = tmp_path / "nowhere"
    for command in ("login", "logout"):
        done = run_cli(command, "--codex-home", str(missing), *bin_, cwd=tmp_path)
        one_line_error(done, 3, f"--codex-home: no such directory: {missing}")
    assert not (tmp_path / "ran").exists()


# --- inspect --------------------------------------------------------------------------------


def test_inspect_shows_what_the_next_turn_would_see_and_decide(tmp_path: Path) -> None:
    session = write_session(tmp_path / "s.jsonl", "remember Lisbon", "noted: Lisbon")
    text = run_cli("inspect", str(session), cwd=tmp_path)  # no store next to it: no engine
    assert text.returncode == 0, text.stderr
    assert "engine: none (plain Codex)" in text.stdout
    assert "next turn's thread decision: start (missing-thread-binding)" in text.stdout
    assert not (tmp_path / "context.sqlite").exists()
    remember_in_store(session)  # the store a first turn would create
    done = run_cli("inspect", str(session), "--engine", "sqlite", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["engine"].startswith("codex-turn.sqlite")
    assert [m["role"] for m in report["messages"]] == ["user", "assistant"]
    assert report["binding"] is None
    assert report["threadDecision"]["action"] == "start"
    assert report["threadDecision"]["reason"] == "missing-thread-binding"
    assert report["projected"] is True  # a fresh thread gets the conversation
    assert "remember Lisbon" in report["prompt"]
    assert report["path"][-1] == "STARTING_THREAD"  # stopped before anything reached Codex


def test_inspect_with_engine_sqlite_never_creates_a_store(tmp_path: Path) -> None:
    # Before its fix: `inspect --engine sqlite` created context.sqlite and loaded the
    # transcript into it. It uses an existing store only, and says when there is none.
    session = write_session(tmp_path / "s.jsonl", "remember Lisbon", "noted: Lisbon")
    done = run_cli("inspect", str(session), "--engine", "sqlite", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "engine: none (plain Codex)" in done.stdout
    assert f"(no engine store at {tmp_path / 'context.sqlite'} (inspect creates none" in (
        done.stdout
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.jsonl"]
    usage = run_cli("inspect", "--help", cwd=tmp_path).stdout
    assert "inspect never creates one" in " ".join(usage.split())


def test_inspect_reads_a_session_whose_thread_is_a_custom_engines_fork_base(
    tmp_path: Path,
) -> None:
    # Before its fix: a session a per-turn engine of one's own had run (its thread a fork
    # base) crashed inspect: "unexpected error: RuntimeError: inspect never talks to Codex",
    # exit 70, when the stages asked the stand-in app-server for the fork it keeps.
    from codex_turn.harness.binding import (
        ContextEngineBinding,
        ProjectionBinding,
        ThreadBinding,
        write_binding,
    )

    (tmp_path / "myengine.py").write_text(ENGINE_MODULE, encoding="utf-8")
    session = write_session(tmp_path / "s.jsonl", "one", "two", "three", "four", "five", "six")
    projection = ProjectionBinding(mode="fork_base", epoch="fork-base")
    engine = ContextEngineBinding(
        engine_id="window-4", policy_fingerprint="p", projection=projection
    )
    base = ThreadBinding(thread_id="base-1", session_id="s", context_engine=engine)
    write_binding(str(session), base)
    done = run_cli("inspect", str(session), "--engine", "myengine:window", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["engine"] == "window-4"
    assert report["assembled"]["messages"] == 4
    assert report["threadDecision"]["action"] == "fork"
    assert report["projectedItems"] == 4
    assert report["developerInstructions"] == "Answer briefly."
    assert report["path"][-1] == "STARTING_THREAD"


#: A complete turn, as `run --json` records it: the happy path of the turn table.
HAPPY_PATH = [
    ("IDLE", "started", "READING_HISTORY"),
    ("READING_HISTORY", "history_read", "BOOTSTRAPPING"),
    ("BOOTSTRAPPING", "bootstrapped", "ASSEMBLING"),
    ("ASSEMBLING", "assembled", "PROJECTING"),
    ("PROJECTING", "projected", "BUILDING_PROMPT"),
    ("BUILDING_PROMPT", "prompt_built", "STARTING_THREAD"),
    ("STARTING_THREAD", "thread_started", "RUNNING_TURN"),
    ("RUNNING_TURN", "turn_completed", "MIRRORING"),
    ("MIRRORING", "mirrored", "FINALIZING"),
    ("FINALIZING", "finalized", "MAINTAINING"),
    ("MAINTAINING", "maintenance_ran", "DONE"),
]


def _trace(path: Path, steps: list[tuple[str, str, str]], *, wrap: bool = True) -> str:
    entries = [{"state": a, "trigger": t, "dest": b} for a, t, b in steps]
    path.write_text(json.dumps({"trace": entries} if wrap else entries))
    return path.name


def _bad_steps(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stdout.splitlines() if "   <- " in line]


def test_inspect_trace_checks_each_step_against_the_turn_table(tmp_path: Path) -> None:
    legal = _trace(tmp_path / "legal.json", HAPPY_PATH)
    done = run_cli("inspect", "--trace", legal, "--out", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "a complete path of the turn table" in done.stdout
    assert _bad_steps(done) == []
    diagram = (tmp_path / "out" / "turn-path.mmd").read_text()
    assert "class DONE current" in diagram
    illegal = _trace(tmp_path / "illegal.json", [("IDLE", "turn_completed", "DONE")], wrap=False)
    bad = run_cli("inspect", "--trace", illegal, cwd=tmp_path)
    assert bad.returncode == 1
    assert "NOT AN EDGE OF THE TURN TABLE" in bad.stdout
    one_line_error(run_cli("inspect", "--trace", "nope.json", cwd=tmp_path), 3, "nope.json")


def test_inspect_trace_checks_the_whole_path_and_flags_every_bad_step(tmp_path: Path) -> None:
    # Before its fix: steps were checked one at a time, so a path with a gap, one that
    # did not start at idle or did not end, and an empty one passed.
    cases = {
        # the turn stopped half-way: the last step does not reach a final state
        "partial": (HAPPY_PATH[:2], ["ends at BOOTSTRAPPING, not a final state"]),
        # a step is missing: the next one does not start where the previous ended
        "gap": (
            HAPPY_PATH[:3] + HAPPY_PATH[4:],
            ["starts at PROJECTING, the previous step ended at ASSEMBLING"],
        ),
        # not from the initial state
        "headless": (HAPPY_PATH[1:], ["does not start at IDLE"]),
        # two bad steps, both flagged: a gap and an illegal edge
        "two": (
            [
                *HAPPY_PATH[:5],
                ("MIRRORING", "mirrored", "FINALIZING"),
                *HAPPY_PATH[9:],
                ("DONE", "started", "READING_HISTORY"),
            ],
            ["the previous step ended at BUILDING_PROMPT", "NOT AN EDGE OF THE TURN TABLE"],
        ),
    }
    for name, (steps, problems) in cases.items():
        done = run_cli("inspect", "--trace", _trace(tmp_path / f"{name}.json", steps), cwd=tmp_path)
        assert done.returncode == 1, (name, done.stdout)
        flagged = _bad_steps(done)
        assert len(flagged) == len(problems), (name, flagged)
        for line, problem in zip(flagged, problems, strict=True):
            assert problem.upper() in line, (name, line)
        assert f"ILLEGAL: {len(problems)} bad steps" in done.stdout
        report = json.loads(
            run_cli("inspect", "--trace", f"{name}.json", "--json", cwd=tmp_path).stdout
        )
        assert report["legal"] is False
        assert sum(1 for step in report["steps"] if step["problems"]) == len(problems)
    # Malformed trace files are unreadable inputs: exit 3, as the help says.
    for name, content, needle in (
        ("empty.json", '{"trace": []}', "empty trace"),
        ("empty-list.json", "[]", "empty trace"),
        ("junk.json", "{not json", "not JSON"),
        ("other.json", '{"a": 1}', "no trace"),
    ):
        (tmp_path / name).write_text(content)
        one_line_error(run_cli("inspect", "--trace", name, cwd=tmp_path), 3, needle)


def test_a_file_that_is_not_a_transcript_is_refused_alike_by_every_command(
    tmp_path: Path,
) -> None:
    # Before its fix: inspect showed 0 messages, run said "empty", compact spoke of a
    # binding. All refuse with the library's SessionFormatError and its reason, exit 3.
    from codex_turn.harness.session import SessionFormatError, ensure_transcript_writable

    bad = tmp_path / "bad.jsonl"
    bad.write_text("garbage\n")
    with pytest.raises(SessionFormatError) as refused:
        ensure_transcript_writable(bad, session_id="s", cwd=str(tmp_path))
    why = "no session header (no line of it is a JSON object)"
    assert refused.value.why == why
    needle = f"{bad} is not a session transcript: {why}"
    for args in (
        ("inspect", str(bad)),
        ("run", str(bad), "--prompt", "hi", "--offline"),
        ("chat", str(bad), "--offline"),
        ("compact", str(bad)),
    ):
        one_line_error(run_cli(*args, cwd=tmp_path), 3, needle)
    doctor = run_cli("doctor", str(bad), "--offline", "--json", cwd=tmp_path)
    assert doctor.returncode == 1
    checks = {c["check"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["session file"]["ok"] is False
    assert needle in checks["session file"]["detail"]
    assert bad.read_text() == "garbage\n"  # left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_typos_in_paths_create_nothing(tmp_path: Path) -> None:
    # Before its fix: a session in a missing directory, a mistyped --codex-home, and a
    # chat that ran no turn left directories, a store and a private home behind.
    work = tmp_path / "work"
    work.mkdir()
    fake = tmp_path / "bin" / "codex"  # never started: every case stops before Codex
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    bin_ = ("--codex-bin", str(fake))
    missing = work / "no-such-dir" / "s.jsonl"
    for command in (("run", "--prompt", "hi"), ("chat",)):
        for where in (("--offline",), ()):
            done = run_cli(command[0], str(missing), *command[1:], *where, *bin_, cwd=work)
            one_line_error(done, 3, f"no such directory: {missing.parent}")
    typo = work / "typo-home"
    for command in (("run", "--prompt", "hi"), ("chat",), ("compact",)):
        session = write_session(work / "s.jsonl", "hello")
        done = run_cli(
            command[0], str(session), *command[1:], "--codex-home", str(typo), *bin_, cwd=work
        )
        one_line_error(done, 3, f"--codex-home: no such directory: {typo}")
        session.unlink()
    # A chat whose input ends before any prompt starts nothing and creates nothing.
    for where in (("--offline",), ()):
        done = run_cli("chat", "s.jsonl", *where, *bin_, cwd=work, input="\n/quit\n")
        assert done.returncode == 0, done.stderr
        assert "chat with s.jsonl" in done.stdout
    assert list(work.iterdir()) == []


# --- diagrams and compact -------------------------------------------------------------------


def test_diagrams_write_where_asked_never_into_the_current_directory(tmp_path: Path) -> None:
    done = run_cli("diagrams", "--out", "out", "--no-svg", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "answer_rules.mmd",
        "archive.mmd",
        "base_rules.mmd",
        "branch.mmd",
        "compaction.mmd",
        "continuity_rules.mmd",
        "diagnostics.mmd",
        "fork_rules.mmd",
        "form_rules.mmd",
        "inject_rules.mmd",
        "keep_rules.mmd",
        "native_rules.mmd",
        "run_fates.mmd",
        "steering.mmd",
        "thread_rules.mmd",
        "turn.mmd",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (tmp_path / "file").write_text("x")
    one_line_error(run_cli("diagrams", "--out", "file", cwd=tmp_path), 2, "not a directory")


def test_compact_uses_the_reference_engine_where_its_store_is(tmp_path: Path) -> None:
    # The embedded default. A session whose directory holds the reference engine's
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
    opted_out = run_cli(*base, "--engine", "none", "--json", cwd=tmp_path)  # --json: accepted
    assert opted_out.returncode == 1
    assert json.loads(opted_out.stdout)["reason"] == "no codex app-server thread binding"
    # No Codex thread: native compaction did not run, which fails no request the engine owns.
    parts = json.loads(default.stdout)["parts"]
    assert parts["engine"]["ran"] is True
    assert parts["codexNative"]["ran"] is False
    assert not home.exists()  # no session binding: Codex was never started
    one_line_error(
        run_cli("compact", str(session), "--model-base-url", "http://x", cwd=tmp_path),
        2,
        "--model-base-url needs --codex-home",
    )


def test_compact_without_codex_fails_when_native_compaction_was_needed(tmp_path: Path) -> None:
    # Before its fix: with the engine's part ok and no Codex binary for the native part,
    # compact printed "ok": true and exited 0. The result is printed, and the command fails.
    from codex_turn.harness.binding import ThreadBinding, write_binding

    session = write_session(tmp_path / "s.jsonl", "hello")
    remember_in_store(session)  # the reference engine owns compaction: its part succeeds
    write_binding(str(session), ThreadBinding(thread_id="thread-1", session_id="s"))
    done = run_cli("compact", str(session), "--json", cwd=tmp_path, env=without_codex(tmp_path))
    assert done.returncode == 5, done.stderr
    result = json.loads(done.stdout)
    native = result["result"]["details"]["codexNativeCompaction"]
    assert native["ok"] is False
    assert "pip install 'codex-turn[codex]'" in native["reason"]
    last = done.stderr.strip().splitlines()[-1]  # after the library's warning
    assert last.startswith("codex-turn compact: the Codex binary is not installed")
    assert "Traceback" not in done.stderr


class _Native:
    """A started app-server as native compaction sees it: answers or fails as told."""

    def __init__(self, answer: object) -> None:
        self.answer = answer

    async def compact_thread(self, thread_id: str, **kwargs: object) -> object:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def _compaction(tmp_path: Path, *, engine_compacts: bool, native: object) -> dict[str, object]:
    import anyio

    from codex_turn import CompactResult
    from codex_turn.cli import compaction_report
    from codex_turn.harness.binding import ThreadBinding, write_binding
    from codex_turn.harness.compaction import CompactSessionParams, compact_codex_session_traced
    from codex_turn.harness.engine.contract import CompactDetails
    from codex_turn.testing import RecordingEngine

    session = write_session(tmp_path / f"s-{engine_compacts}.jsonl", "hello")
    write_binding(str(session), ThreadBinding(thread_id="thread-1", session_id="s"))
    answer = (
        CompactResult(
            ok=True, compacted=True, result=CompactDetails(tokens_before=100, tokens_after=10)
        )
        if engine_compacts
        else CompactResult(ok=True, compacted=False, reason="nothing to compact")
    )
    engine = RecordingEngine(owns_compaction=True, responses={"compact": answer})
    params = CompactSessionParams(
        session_id="s", session_file=str(session), workspace_dir=str(tmp_path)
    )

    async def run() -> object:
        return await compact_codex_session_traced(params, app_server=_Native(native), engine=engine)

    return compaction_report(anyio.run(run))  # type: ignore[arg-type]


def test_compact_says_what_happened_to_the_whole_request(tmp_path: Path) -> None:
    # Before its fix: the owning engine's result was the whole answer: "ok": true (exit 0)
    # when Codex's compaction failed, and "compacted": false at the top while Codex's own
    # part said it compacted.
    from codex_turn.harness.appserver import AppServerClosed
    from codex_turn.harness.appserver.native_compaction import CompactionResult

    failed = _compaction(
        tmp_path, engine_compacts=True, native=AppServerClosed("codex app-server exited")
    )
    assert (failed["ok"], failed["compacted"]) == (False, True)
    assert failed["reason"] == "codex app-server exited"
    parts = failed["parts"]
    assert parts["engine"] == {"ran": True, "ok": True, "compacted": True, "reason": None}
    assert parts["codexNative"]["ok"] is False
    assert parts["codexNative"]["reason"] == "codex app-server exited"
    native = CompactionResult(status="completed", thread_id="thread-1", signal="thread/compacted")
    codex_only = _compaction(tmp_path, engine_compacts=False, native=native)
    assert (codex_only["ok"], codex_only["compacted"]) == (True, True)
    assert codex_only["parts"]["engine"]["compacted"] is False
    assert codex_only["parts"]["codexNative"] == {
        "ran": True,
        "ok": True,
        "compacted": True,
        "reason": None,
    }
    assert codex_only["result"]["details"]["codexNativeCompaction"]["compacted"] is True


def test_chat_commands_change_the_next_turns_model_and_effort() -> None:
    from codex_turn._cli_turns import _Settings, chat_command_line

    settings = _Settings(model="m1", effort=None)
    assert (
        chat_command_line("/effort high", settings) == "reasoning effort for the next turns: high"
    )
    assert chat_command_line("/model  gpt-x ", settings) == "model for the next turns: gpt-x"
    assert (settings.model, settings.effort) == ("gpt-x", "high")
    assert "unknown effort 'huge'" in chat_command_line("/effort huge", settings)
    assert settings.effort == "high"
    chat_command_line("/model", settings)
    chat_command_line("/effort", settings)
    assert (settings.model, settings.effort) == (None, None)
    assert "/model NAME" in chat_command_line("/help", settings)


def test_run_and_chat_take_the_runtime_settings_of_a_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from codex_turn._cli_turns import _Turns
    from codex_turn.cli import build_parser

    flags = ["--effort", "low", "--sandbox", "workspace-write", "--approval-policy", "on-request"]
    args = build_parser().parse_args(["chat", "s.jsonl", *flags, "--model", "m"])
    turns = _Turns(args, "s.jsonl", "s", str(tmp_path), None, None, None)  # type: ignore[arg-type]
    params = turns.params("hi")
    assert (params.reasoning_effort, params.sandbox, params.approval_policy, params.model) == (
        "low",
        "workspace-write",
        "on-request",
        "m",
    )
    monkeypatch.chdir(tmp_path)
    code, _, err = call(monkeypatch, capsys, "run", "s.jsonl", "--prompt", "x", "--effort", "max")
    assert code == 2
    assert "invalid choice: 'max'" in err
    code, _, err = call(
        monkeypatch, capsys, "chat", "s.jsonl", "--model-base-url", "http://127.0.0.1:9/v1"
    )
    assert (code, "--model-base-url needs --codex-home" in err) == (2, True), err


def test_run_chooses_the_projection_form() -> None:
    # `--projection text` keeps OpenClaw's text frame; the default is structured.
    from codex_turn.cli import build_parser

    parser = build_parser()
    default = parser.parse_args(["run", "s.jsonl", "--prompt", "p"])
    text = parser.parse_args(["run", "s.jsonl", "--prompt", "p", "--projection", "text"])
    assert default.projection == "structured"
    assert text.projection == "text"
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "s.jsonl", "--prompt", "p", "--projection", "frames"])
