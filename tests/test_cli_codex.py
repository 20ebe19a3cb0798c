"""The `codex-turn` commands that drive the real Codex app-server binary, end to end.

Each command runs as a subprocess against the pinned binary and the offline stand-in model
(`--offline`: a private Codex home next to the session, one per test directory, so no two
processes ever start on one fresh home at once). Nothing reaches the internet.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.transcripts import transcript_texts
from test_cli import one_line_error, run_cli

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
    assert "TOOL RESULT: Lisbon: 21 C, clear" in out  # the dynamic tool ran
    # The compaction starts a new epoch: the next turn rotates and gets the context.
    assert "engine: ok=True compacted=True" in out
    assert "thread decision: rotate (thread-bootstrap-epoch-changed)" in out
    assert out.count("context projected: True") == 1
    assert out.count("context projected: False") == 3
    assert out.index("compaction:") < out.index("context projected: True")
    assert "engine calls: bootstrap" in out
    assert "time per state (ms): reading_history" in out
    assert "internet attempts (proxy CONNECTs): 0" in out
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


def test_run_against_a_codex_home_without_login_says_how_to_log_in(
    tmp_path: Path, codex_binary: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir()
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
