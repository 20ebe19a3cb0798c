"""The `codex-turn` commands that drive the real Codex app-server binary, end to end.

Each command runs as a subprocess against the pinned binary and the offline stand-in model
(`--offline`: a private Codex home next to the session, one per test directory, so no two
processes ever start on one fresh home at once). Nothing reaches the internet.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.transcripts import transcript_texts
from test_cli import ENGINE_MODULE, one_line_error, run_cli, without_codex, write_session

pytestmark = pytest.mark.codex


def test_the_demo_shows_decisions_projection_compaction_and_where_it_all_is(
    tmp_path: Path, codex_binary: Path
) -> None:
    done = run_cli("demo", "--out", "demo", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert out.count("outcome=completed") == 4
    assert "thread decision: start (missing-thread-binding)" in out
    assert out.count("thread decision: resume (matching-thread-bootstrap-binding)") == 2
    # The compaction starts a new epoch: the next turn rotates and gets the context.
    assert "engine: ok=True compacted=True" in out
    assert "thread decision: rotate (thread-bootstrap-epoch-changed)" in out
    assert out.count("context projected: True") == 1
    assert out.count("context projected: False") == 3
    assert out.index("compaction:") < out.index("context projected: True")
    # Before its fix: turns 1-3 showed no memory at all ("context projected: False"), and
    # turn 3's reply was scripted to read as the model's summary. From turn 2 on the demo
    # shows what the model was sent of the conversation; the model pretends nothing.
    turn_two = out[out.index("turn 2: outcome=") : out.index("turn 3: outcome=")]
    assert "memory: with this prompt the model was sent 1 earlier prompt of this" in turn_two
    assert "'Lisbon is my favourite city, and I trav" in turn_two
    turn_three = out[out.index("turn 3: outcome=") : out.index("compaction:")]
    assert "the model was sent 2 earlier prompts of this conversation and 2 replies" in turn_three
    assert "assistant: (stand-in model, quoting its request) earlier you wrote: " in turn_three
    assert "We talked about" not in out
    assert "engine calls: bootstrap" in out
    assert "time per state (ms): reading_history" in out
    assert "internet attempts (proxy CONNECTs): 0" in out
    # A second host killed between the reply and the commit; the next start recovers it.
    durable = out[out.index("durable turn (a host killed between the reply and the commit)") :]
    assert "was killed with SIGKILL (9)" in durable
    assert "outbox entry: accepted; engine store: 8 messages (was 8)" in durable
    assert "committed ['demo-window-seat']; engine store: 10 messages" in durable
    assert "again: committed []; store: 10 messages; outbox entry: ready (exactly once: True)" in (
        durable
    )
    # Live progress: the state being executed, as plain lines (stderr is not a terminal).
    assert "progress: [turn 2] running_turn" in done.stderr
    assert "progress: [compaction] compacting (engine, then Codex native)" in done.stderr
    # Every state the turn machine entered is shown, in order (the observer hook).
    turn_two = [
        line.removeprefix("progress: [turn 2] ")
        for line in done.stderr.splitlines()
        if line.startswith("progress: [turn 2] ")
    ]
    assert turn_two[0] == "starting"
    assert turn_two[-1] == "done"
    assert turn_two.index("assembling") < turn_two.index("running_turn")
    demo = tmp_path / "demo"
    for name in (
        "session.jsonl",
        "context.sqlite",
        "diagrams/turn.mmd",
        "diagrams/turn-4-path.mmd",
    ):
        assert (demo / name).exists(), name
        assert str(demo / name.split("/")[0]) in out  # it says where everything is
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # nothing in the cwd
    again = run_cli("demo", "--out", "demo", cwd=tmp_path)
    one_line_error(again, 2, "already holds a demo")


def test_the_demo_shows_the_compacted_context_codex_received_and_chat_goes_on(
    tmp_path: Path, codex_binary: Path
) -> None:
    # Before its fix: turn 4 said "context projected: True" without showing it, its
    # reply was scripted, and the closing `chat ... --offline` hint took a transient thread
    # (the demo's thread had a dynamic tool, chat has none).
    done = run_cli("demo", "--out", "demo", "-q", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    turn_four = done.stdout[done.stdout.index("turn 4: outcome=") :]
    excerpt = turn_four[turn_four.index("Codex received") : turn_four.index("model requests")]
    assert "the engine's compacted context, framed before the prompt" in excerpt
    assert "| <conversation_context>" in excerpt
    assert '| <summary id="sum_' in excerpt  # the engine's summary, as Codex sent it
    assert "| user: Lisbon is my favourite city" in excerpt  # in the summary
    assert "| Which city did I say was my favourite, and when do I travel?" in excerpt
    assert len(excerpt.splitlines()) <= 20  # short
    # The last answer is computed from that request: the city is in the engine's summary.
    assert "assistant: (stand-in model, answering from its request: 1 engine summary, " in turn_four
    assert "Lisbon (in the engine summary)" in turn_four
    # The same from --json: what the model received on turn 4 holds the summary.
    report = json.loads(run_cli("demo", "--out", "again", "--json", "-q", cwd=tmp_path).stdout)
    from codex_turn.demo import PROMPTS

    assert report["turns"][1]["modelReceivedEarlier"] == [PROMPTS[0]]
    assert report["turns"][2]["modelReceivedEarlier"] == list(PROMPTS[:2])
    received = report["turns"][3]["modelReceived"]
    assert "<summary id=" in received
    assert "Lisbon is my favourite city" in received.split("<summary", 1)[1]
    assert report["turns"][3]["assistantText"].endswith(
        "Lisbon (in the engine summary), May (in the recent messages)"
    )
    # The closing hint, as printed, goes on with the same conversation on the same thread.
    hint = next(line for line in done.stdout.splitlines() if "go on:" in line)
    command = hint.split("go on:", 1)[1].split()
    assert command[:2] == ["codex-turn", "chat"]
    chat = run_cli(*command[1:], "-q", cwd=tmp_path, input="and one more\n")
    assert chat.returncode == 0, chat.stderr
    assert "thread decision: resume (matching-thread-bootstrap-binding)" in chat.stdout
    thread = turn_four.split("thread=", 1)[1].split()[0]
    assert f"turn 1: outcome=completed thread={thread}" in chat.stdout  # turn 4's thread
    assert "assistant: ECHO: and one more" in chat.stdout


def test_run_inspect_doctor_and_compact_on_one_offline_session(
    tmp_path: Path, codex_binary: Path
) -> None:
    session = str(tmp_path / "s.jsonl")
    first = run_cli("run", session, "--prompt", "remember Lisbon", "--offline", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "thread decision: start (missing-thread-binding)" in first.stdout
    assert "assistant: ECHO: remember Lisbon" in first.stdout
    assert "progress: [turn 1] running_turn" in first.stderr

    second = run_cli(
        "run", session, "--prompt", "and again", "--offline", "--json", "-q", cwd=tmp_path
    )
    assert second.returncode == 0, second.stderr
    assert second.stderr == ""  # -q: no progress, no warnings
    turn = json.loads(second.stdout)
    assert turn["outcome"] == "completed"
    assert turn["threadDecision"]["action"] == "resume"  # the same thread, another process
    assert [c["method"] for c in turn["engineCalls"]][:1] == ["bootstrap"]
    assert turn["trace"][-1]["dest"] == "DONE"
    (tmp_path / "turn.json").write_text(second.stdout)

    replay = run_cli("inspect", "--trace", "turn.json", "--json", cwd=tmp_path)
    assert replay.returncode == 0, replay.stderr
    assert json.loads(replay.stdout)["legal"] is True

    preview = run_cli("inspect", session, "--prompt", "what city?", cwd=tmp_path)
    assert preview.returncode == 0, preview.stderr
    assert "messages the engine would see: 4" in preview.stdout
    assert "next turn's thread decision: resume (matching-thread-bootstrap-binding)" in (
        preview.stdout
    )
    assert f"thread binding: {turn['threadId']}" in preview.stdout

    doctor = run_cli("doctor", session, "--offline", "--json", cwd=tmp_path)
    assert doctor.returncode == 0, doctor.stdout
    checks = {c["check"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert "codex-cli 0.163.0" in checks["codex binary"]["detail"]
    assert checks["engine store"]["ok"] is True
    assert checks["session lock"]["detail"] == "free"
    assert turn["threadId"] in checks["thread binding"]["detail"]

    compact = run_cli("compact", session, "--offline", cwd=tmp_path)
    assert compact.returncode == 0, compact.stderr
    result = json.loads(compact.stdout)
    assert result["ok"] is True
    assert result["result"]["details"]["codexNativeCompaction"]["ok"] is True
    # The top says what happened to the whole request: Codex compacted (before its fix the
    # engine's "compacted": false stood at the top).
    assert result["compacted"] is True
    assert result["parts"]["codexNative"]["compacted"] is True
    assert result["parts"]["engine"]["ran"] is True

    # Codex's compaction fails (its model is unreachable): before its fix compact still said
    # "ok": true and exited 0, the engine's part having succeeded.
    home = str(tmp_path / ".codex-turn-offline" / "codex-home")
    dead = ("--model-base-url", "http://127.0.0.1:9/v1", "--codex-home", home)
    failed = run_cli("compact", session, *dead, "--timeout", "60", "-q", cwd=tmp_path)
    assert failed.returncode == 1, failed.stderr
    result = json.loads(failed.stdout)
    assert result["ok"] is False
    assert result["parts"]["engine"]["ok"] is True
    assert result["parts"]["codexNative"]["ok"] is False
    assert result["reason"] == result["parts"]["codexNative"]["reason"]


def test_inspect_reads_a_session_a_custom_per_turn_engine_ran(
    tmp_path: Path, codex_binary: Path
) -> None:
    # Before its fix: inspect crashed (exit 70, "inspect never talks to Codex") on the
    # session of a per-turn engine of one's own, whose thread is a fork base.
    (tmp_path / "myengine.py").write_text(ENGINE_MODULE, encoding="utf-8")
    session = str(write_session(tmp_path / "s.jsonl", "one", "two", "three", "four"))
    engine = ("--engine", "myengine:window")
    ran = run_cli("run", session, "--prompt", "five", *engine, "--offline", "-q", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    done = run_cli("inspect", session, *engine, "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["binding"]["contextEngine"]["projection"]["mode"] == "fork_base"
    assert report["threadDecision"]["action"] == "fork"
    assert report["assembled"]["messages"] == 4
    assert report["developerInstructions"] == "Answer briefly."


def test_run_against_a_codex_home_without_login_says_how_to_log_in(
    tmp_path: Path, codex_binary: Path
) -> None:
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    # A user configuration that needs an OpenAI login, and none: refused at start (exit 4).
    # Any connection attempt goes to a closed local port, never to the internet.
    env = dict(os.environ, HOME=str(home), NO_PROXY="", no_proxy="")
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = "http://127.0.0.1:9"
    done = run_cli(
        "run",
        str(tmp_path / "s.jsonl"),
        "--prompt",
        "hi",
        "--codex-home",
        str(home / ".codex"),
        "-q",
        cwd=tmp_path,
        env=env,
    )
    one_line_error(done, 4, "codex login")


def test_a_broken_codex_configuration_is_reported_in_codexs_own_words(
    tmp_path: Path, codex_binary: Path
) -> None:
    # Before its fix: only "codex app-server exited (exit code 1)", even with -vv; and an
    # invalid config.toml (Codex falls back to its defaults, which need a login) was
    # reported as a missing login alone.
    env = _offline_env(tmp_path)
    home = tmp_path / "broken-home"
    home.mkdir()
    config = home / "config.toml"
    run = ("run", "s.jsonl", "--prompt", "hi", "--codex-home", str(home), "--engine", "none")
    config.write_text('sqlite_home = "/proc/nowhere"\n')
    done = run_cli(*run, "-q", cwd=tmp_path, env=env)
    one_line_error(done, 5, "exited (exit code 1); Codex said: Error: failed to initialize sqlite")
    config.write_text('model = "unterminated\n')
    done = run_cli(*run, "-q", cwd=tmp_path, env=env)
    one_line_error(done, 4, "(Codex said: Invalid configuration; using defaults. ")
    assert "config.toml:1:" in done.stderr


def _reader(stream: object, into: list[str]) -> threading.Thread:
    def pump() -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append(line)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_chat_ctrl_c_interrupts_the_turn_saves_it_and_a_second_one_leaves(
    tmp_path: Path, codex_binary: Path
) -> None:
    session = tmp_path / "chat.jsonl"
    # Every reply of the stand-in model stalls, so the first Ctrl-C lands during a turn.
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "codex_turn",
            "chat",
            str(session),
            "--offline",
            "--offline-delay",
            "60",
        ],
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out: list[str] = []
    err: list[str] = []
    readers = [_reader(process.stdout, out), _reader(process.stderr, err)]
    try:
        assert process.stdin is not None
        process.stdin.write("the first prompt\n")
        process.stdin.flush()
        _wait_for(lambda: any("running_turn" in line for line in err), "the turn to run")
        time.sleep(0.5)  # Codex is waiting for the (stalled) model
        process.send_signal(signal.SIGINT)
        _wait_for(lambda: any("interrupted and saved" in line for line in out), "the turn end")
        assert process.poll() is None  # the loop goes on
        text = "".join(out)
        assert "turn 1: outcome=aborted" in text
        assert "the first prompt" in transcript_texts(session)  # mirrored
        process.send_signal(signal.SIGINT)  # at the prompt: leave
        assert process.wait(timeout=30) == 130
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for reader in readers:
            reader.join(timeout=5)
    assert "(left)" in "".join(err)
    assert "Traceback" not in "".join(err)


def _visible_lines(raw: str) -> list[str]:
    """What a terminal shows of ``raw``, line by line: a carriage return starts the line over
    (the status line is redrawn that way), colours are dropped."""
    plain = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", raw.replace("\r\n", "\n"))
    return [line.rsplit("\r", 1)[-1] for line in plain.split("\n")]


def test_chat_in_a_terminal_ctrl_c_keeps_codex_and_warnings_keep_their_own_line(
    tmp_path: Path, codex_binary: Path
) -> None:
    # Before its fix: Ctrl-C in a terminal (SIGINT to the whole foreground process group)
    # killed the Codex process too, so the next turn restarted it; and a warning written
    # during a turn was glued onto the status line ("[turn 1] assembling2026-...warning").
    (tmp_path / "myengine.py").write_text(ENGINE_MODULE, encoding="utf-8")
    argv = [
        sys.executable,
        "-m",
        "codex_turn",
        "chat",
        "s.jsonl",
        "--offline",
        "--offline-delay",
        "3",
        "--engine",
        "myengine:bad_assemble",  # a contract violation: a warning during each turn
        "-v",
    ]
    pid, master = pty.fork()
    if pid == 0:  # the child: the terminal's session leader, as a shell would start it
        os.chdir(tmp_path)
        os.execv(sys.executable, argv)
    chunks: list[bytes] = []

    def pump() -> None:
        with contextlib.suppress(OSError):
            while data := os.read(master, 65536):
                chunks.append(data)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()

    def seen(text: str) -> bool:
        return text in b"".join(chunks).decode("utf-8", "replace")

    try:
        _wait_for(lambda: seen("chat with s.jsonl"), "the chat to start")
        os.write(master, b"the first prompt\r")
        _wait_for(lambda: seen("running_turn"), "the turn to run")
        time.sleep(0.5)  # Codex waits for the (stalled) model
        os.write(master, b"\x03")  # Ctrl-C, as the terminal sends it
        _wait_for(lambda: seen("interrupted and saved"), "the turn to end")
        os.write(master, b"the second prompt\r")
        _wait_for(lambda: seen("turn 2: outcome="), "the second turn", timeout=90)
        os.write(master, b"/quit\r")
        _, status = os.waitpid(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        reader.join(timeout=5)
        os.close(master)
    text = b"".join(chunks).decode("utf-8", "replace")
    assert os.waitstatus_to_exitcode(status) == 0, text[-3000:]
    assert "turn 1: outcome=aborted" in text
    assert "turn 2: outcome=completed" in text
    # One Codex process for both turns: the first Ctrl-C did not reach it.
    assert text.count("appserver.spawned") == 1, text[-3000:]
    assert "appserver.restart" not in text
    # Each warning on a line of its own, never after the status line's text.
    lines = _visible_lines(text)
    warnings = [line for line in lines if "context engine assemble failed" in line]
    assert len(warnings) >= 2, text[-3000:]
    assert not [line for line in warnings if "[turn " in line], warnings
    assert "Traceback" not in text


def test_chat_streams_the_reply_and_tool_calls_and_asks_you_to_approve(
    tmp_path: Path, codex_binary: Path
) -> None:
    # Before its fix: chat printed the reply only after the turn, showed no tool call, and
    # every approval Codex asked for was declined without asking; there were no flags for
    # the sandbox, the approval policy or the reasoning effort, and no way to change the
    # model or the effort between turns.
    from codex_turn.testing import OfflineModel, Reply

    workspace = tmp_path / "workspace"
    workspace.mkdir()
    arguments = {
        "cmd": "touch approved_file && echo wrote",
        "yield_time_ms": 2000,
        "sandbox_permissions": "require_escalated",
        "justification": "Allow writing approved_file?",
    }
    with OfflineModel() as model:
        model.script(
            Reply.function_call("exec_command", arguments, call_id="call_1"),
            Reply.fixed("Done: the file is there."),
            Reply.fixed("Thought harder."),
        )
        env = dict(os.environ, HOME=str(tmp_path), **model.proxy_env())
        done = run_cli(
            "chat",
            "s.jsonl",
            "--model-base-url",
            model.base_url,
            "--codex-home",
            str(tmp_path / "private-home"),
            "--workspace",
            str(workspace),
            "--engine",
            "none",
            "--approval-policy",
            "on-request",
            "--sandbox",
            "read-only",
            "-q",
            cwd=tmp_path,
            env=env,
            input="please write the file\ny\n/effort high\nand think\n",
        )
        requests = model.turn_requests()
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert (workspace / "approved_file").exists()  # approved, and run
    assert "Codex asks to run `" in out
    assert "touch approved_file && echo wrote" in out
    assert "(Allow writing approved_file?)" in out
    assert "approve? [y] yes, [s] yes for this session, [n] no (default)" in out
    assert "  (approve)" in out
    # The tool call and the reply as they happened, before the turn's summary.
    summary = out.index("turn 1: outcome=completed")
    assert -1 < out.index("  tool commandExecution: ") < out.index("  (approve)") < summary
    assert -1 < out.index("  assistant: Done: the file is there.") < summary
    assert out.count("Done: the file is there.") == 1  # shown once, as it streamed
    # /effort changes the next turn's request.
    assert "(reasoning effort for the next turns: high)" in out
    assert "turn 2: outcome=completed" in out
    assert requests[-1].body.get("reasoning", {}).get("effort") == "high"
    assert requests[0].body.get("reasoning", {}).get("effort") != "high"


def _offline_env(tmp_path: Path) -> dict[str, str]:
    """HOME in the test directory, every proxy at a closed local port: nothing leaves."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ, HOME=str(home), NO_PROXY="", no_proxy="")
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = "http://127.0.0.1:9"
    return env


def test_doctor_checks_the_login_as_the_runtime_does(tmp_path: Path, codex_binary: Path) -> None:
    # Before its fix: doctor ran `codex login status`, which says "Not logged in" for a
    # home whose custom provider needs no login, while a turn starts fine there. Doctor now
    # makes the runtime's own check (account/read on a started app-server).
    env = _offline_env(tmp_path)
    custom = tmp_path / "custom-home"
    custom.mkdir()
    (custom / "config.toml").write_text(
        'model = "local-model"\nmodel_provider = "local"\n\n[model_providers.local]\n'
        'name = "local"\nbase_url = "http://127.0.0.1:9/v1"\nwire_api = "responses"\n'
    )
    done = run_cli("doctor", "--codex-home", str(custom), "--json", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout
    login = {c["check"]: c for c in json.loads(done.stdout)["checks"]}["codex login"]
    assert login["ok"] is True
    assert "needs no OpenAI login" in login["detail"]
    empty = tmp_path / "empty-home"  # the OpenAI provider and no credentials
    empty.mkdir()
    done = run_cli("doctor", "--codex-home", str(empty), "--json", cwd=tmp_path, env=env)
    assert done.returncode == 1
    login = {c["check"]: c for c in json.loads(done.stdout)["checks"]}["codex login"]
    assert login["ok"] is False
    assert "run `codex login`" in login["detail"]
    # ... and a turn there is refused the same way (exit 4).
    one_line_error(
        run_cli(
            "run",
            "s.jsonl",
            "--prompt",
            "hi",
            "--codex-home",
            str(empty),
            "-q",
            cwd=tmp_path,
            env=env,
        ),
        4,
        "codex login",
    )


def _tree(root: Path) -> list[tuple[str, int, int]]:
    """Every path under ``root`` with its mode and size (what "changes nothing" compares)."""
    return sorted(
        (str(p.relative_to(root)), p.lstat().st_mode, p.lstat().st_size) for p in root.rglob("*")
    )


def test_doctor_changes_nothing(tmp_path: Path, codex_binary: Path) -> None:
    # Before its fix: doctor ran `codex --version` against the user's home, which created
    # ~/.codex (helper links), and then reported that home "ok". The binary makes them only
    # outside the temp dir: TMPDIR is moved away from HOME to see it.
    env = _offline_env(tmp_path)
    env["TMPDIR"] = str(tmp_path / "tmpdir")
    (tmp_path / "tmpdir").mkdir()
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    write_session(work / "s.jsonl", "hello")
    before = (_tree(home), _tree(work))
    done = run_cli("doctor", "--json", cwd=work, env=env)
    assert done.returncode == 1, done.stdout
    checks = {c["check"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["codex home"]["ok"] is False
    assert "does not exist" in checks["codex home"]["detail"]
    assert "codex-turn login" in checks["codex login"]["detail"]
    assert run_cli("doctor", "s.jsonl", cwd=work, env=env).returncode == 1
    assert (_tree(home), _tree(work)) == before
    assert not (home / ".codex").exists()
    # A home that exists: the login check starts Codex, which writes nothing into it.
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text('model = "gpt-5"\n')
    before = _tree(home)
    done = run_cli("doctor", "--json", cwd=work, env=env)
    login = {c["check"]: c for c in json.loads(done.stdout)["checks"]}["codex login"]
    assert login["ok"] is False
    assert "not logged in" in login["detail"]
    assert _tree(home) == before


def test_login_with_an_api_key_then_doctor_then_logout(tmp_path: Path, codex_binary: Path) -> None:
    # Before its fix: there was no way to log in (the pinned binary is not on PATH).
    env = _offline_env(tmp_path)
    home = tmp_path / "codex-home"
    home.mkdir()
    key = "sk-test-LOGIN0123456789abcdefgh"
    where = ("--codex-home", str(home))
    done = run_cli("login", *where, "--with-api-key", cwd=tmp_path, env=env, input=f"{key}\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"logged in: Codex home {home}"
    assert key not in done.stdout + done.stderr
    auth = home / "auth.json"
    assert auth.stat().st_mode & 0o777 == 0o600  # owner-only
    assert key in auth.read_text()  # where Codex keeps it, and where a turn finds it
    doctor = run_cli("doctor", *where, "--json", "-v", cwd=tmp_path, env=env)
    assert doctor.returncode == 0, doctor.stdout
    login = {c["check"]: c for c in json.loads(doctor.stdout)["checks"]}["codex login"]
    assert (login["ok"], login["detail"]) == (True, "logged in (apiKey)")
    assert key not in doctor.stdout + doctor.stderr
    done = run_cli("logout", *where, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert not auth.exists()
    doctor = run_cli("doctor", *where, "--json", cwd=tmp_path, env=env)
    login = {c["check"]: c for c in json.loads(doctor.stdout)["checks"]}["codex login"]
    assert login["ok"] is False
    assert f"codex-turn login --codex-home {home}" in login["detail"]
    # The device-code login needs the internet, which every proxy here refuses: it fails
    # at once, with Codex's own reason (exit 4: still no login).
    done = run_cli("login", *where, cwd=tmp_path, env=env)
    assert done.returncode == 4, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("codex-turn login: codex login failed (exit 1): Error logging in")


def test_a_contract_violation_is_named_and_strict_json_still_prints_the_turn(
    tmp_path: Path, codex_binary: Path
) -> None:
    (tmp_path / "myengine.py").write_text(ENGINE_MODULE, encoding="utf-8")
    session = str(write_session(tmp_path / "s.jsonl", "remember Lisbon", "noted: Lisbon"))
    engine = ("--engine", "myengine:bad_assemble", "--offline")
    # Before its fix: the note said "no earlier conversation to project" when the engine's
    # assemble() had failed (a contract violation, without --strict).
    lenient = run_cli("run", session, "--prompt", "which city?", *engine, cwd=tmp_path)
    assert lenient.returncode == 0, lenient.stderr
    assert "thread decision: start (missing-thread-binding)" in lenient.stdout
    assert (
        "context projected: False (no: the engine's assemble() failed (see the warning; "
        "--strict: exit 7); Codex got the prompt alone)"
    ) in lenient.stdout
    assert "no earlier conversation" not in lenient.stdout
    # Before its fix: `run --strict --json` printed nothing when the engine broke the
    # contract; the turn's JSON is printed, then the one-line error, exit 7.
    strict = run_cli(
        "run", session, "--prompt", "again", *engine, "--strict", "--json", "-q", cwd=tmp_path
    )
    assert strict.returncode == 7, strict.stderr
    turn = json.loads(strict.stdout)
    assert turn["outcome"] == "completed"
    assert turn["contractViolation"]["method"] == "assemble"
    assert turn["contractViolation"]["engineId"] == "bad-assemble"
    assert turn["trace"][-1]["dest"] == "DONE"
    (line,) = strict.stderr.strip().splitlines()
    assert 'codex-turn run: context engine "bad-assemble" broke the contract in assemble()' in line


def test_with_json_logs_stderr_is_json_lines_progress_included(
    tmp_path: Path, codex_binary: Path
) -> None:
    # Before its fix: with --log-format json and stderr not a terminal, plain
    # "progress: ..." lines were mixed into the JSON log lines.
    session = str(tmp_path / "s.jsonl")
    done = run_cli(
        "run", session, "--prompt", "hi", "--offline", "--log-format", "json", "-v", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]  # every line parses
    progress = [line for line in lines if line["event"] == "progress"]
    assert [p["state"] for p in progress if p["label"] == "turn 1"][-1] == "done"
    assert any(p["state"] == "running_turn" for p in progress)
    assert any(line["logger"].startswith("codex_turn.harness") for line in lines)  # -v logs
    assert "progress:" not in done.stderr


def test_a_codex_binary_of_ones_own_is_used(tmp_path: Path, codex_binary: Path) -> None:
    # Before its fix: without the pinned package a user's own binary could not be used.
    env = without_codex(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    own = ("--codex-bin", str(codex_binary))
    done = run_cli("run", "s.jsonl", "--prompt", "hi", "--offline", *own, cwd=work, env=env)
    assert done.returncode == 0, done.stderr
    assert "assistant: ECHO: hi" in done.stdout
    doctor = run_cli("doctor", "s.jsonl", "--offline", "--json", *own, cwd=work, env=env)
    assert doctor.returncode == 0, doctor.stdout
    binary = {c["check"]: c for c in json.loads(doctor.stdout)["checks"]}["codex binary"]
    assert binary["path"] == str(codex_binary)
    compact = run_cli("compact", "s.jsonl", "--offline", *own, cwd=work, env=env)
    assert compact.returncode == 0, compact.stderr
    # `codex` on PATH, when the pinned package is missing.
    on_path = tmp_path / "bin"
    on_path.mkdir()
    (on_path / "codex").symlink_to(codex_binary)
    env["PATH"] = f"{on_path}{os.pathsep}{env['PATH']}"
    doctor = run_cli("doctor", "--json", cwd=work, env=env)
    binary = {c["check"]: c for c in json.loads(doctor.stdout)["checks"]}["codex binary"]
    assert (binary["ok"], binary["path"]) == (True, str(on_path / "codex"))
    assert "codex-cli 0.163.0" in binary["detail"]
    bad = run_cli("run", "s.jsonl", "--prompt", "hi", "--offline", "--codex-bin", "nope", cwd=work)
    one_line_error(bad, 5, "--codex-bin: not an executable file: nope")
