"""Crash safety and cross-process concurrency, for real: SIGKILLed writer subprocesses,
simulated torn appends at every cut point, and several processes mirroring into one file."""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from support.session_turns import expected_messages, turn_keys, turn_messages

from codex_turn.harness.session import (
    load_session_messages,
    mirror_turn,
    parse_session_bytes,
    read_session,
)

WRITER = Path(__file__).parent / "support" / "session_writer.py"
ROOT = Path(__file__).parent.parent


def _spawn(
    path: Path, thread: str, start: int, end: int, *, max_size: int, go_file: Path | None = None
) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        str(WRITER),
        str(path),
        "--thread",
        thread,
        "--start",
        str(start),
        "--end",
        str(end),
        "--max-size",
        str(max_size),
    ]
    if go_file is not None:
        command += ["--go-file", str(go_file)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _raw_keys(path: Path) -> collections.Counter[str]:
    parsed = parse_session_bytes(path.read_bytes())
    return collections.Counter(
        e["message"]["idempotencyKey"] for e in parsed.entries if isinstance(e.get("message"), dict)
    )


def test_sigkilled_writer_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "crash.jsonl"
    rng = random.Random(20260424)
    max_size = 40_000  # large appends (up to ~300 KiB a turn) make torn writes possible
    confirmed = -1  # the last turn whose mirror_turn returned
    kills = 0
    torn_seen = 0
    while kills < 40:
        proc = _spawn(path, "t", confirmed + 1, confirmed + 1000, max_size=max_size)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.06))
        proc.send_signal(signal.SIGKILL)
        output, _ = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        kills += 1
        done = [int(line.split()[1]) for line in output.splitlines() if line.startswith("done ")]
        confirmed = max([confirmed, *done])
        if not path.exists():
            assert confirmed == -1
            continue
        transcript = read_session(path)
        torn_seen += int(transcript.torn_tail)
        keys = _raw_keys(path)
        assert all(count == 1 for count in keys.values()), "a key was written twice"
        messages = load_session_messages(path)
        assert messages[: 4 * (confirmed + 1)] == expected_messages(
            "t", range(confirmed + 1), max_size=max_size
        )
    # A final, uninterrupted run retries the interrupted turn with the same keys and goes on.
    end = confirmed + 3
    proc = _spawn(path, "t", confirmed + 1, end, max_size=max_size)
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    keys = _raw_keys(path)
    assert keys == collections.Counter(k for turn in range(end) for k in turn_keys("t", turn))
    assert load_session_messages(path) == expected_messages("t", range(end), max_size=max_size)
    transcript = read_session(path)
    assert transcript.header is not None
    assert not transcript.torn_tail
    assert transcript.malformed_lines <= torn_seen + kills  # only isolated torn fragments
    assert not Path(str(path) + ".lock").exists()
    print(f"kills={kills} turns={end} torn={torn_seen} malformed={transcript.malformed_lines}")


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_torn_append_is_repaired_by_retrying_the_turn(data: st.DataObject) -> None:
    """Any cut point of an interrupted append: the retry completes the turn exactly once."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "torn.jsonl"
        for turn in range(2):
            messages, identities = turn_messages("t", turn)
            mirror_turn(
                path,
                messages,
                scope="codex-app-server:t",
                identities=identities,
                session_id="s",
                cwd="/",
            )
        before = path.read_bytes()
        messages, identities = turn_messages("t", 2)
        mirror_turn(
            path,
            messages,
            scope="codex-app-server:t",
            identities=identities,
            session_id="s",
            cwd="/",
        )
        appended = path.read_bytes()[len(before) :]
        cut = data.draw(st.integers(0, len(appended) - 1), label="cut")
        path.write_bytes(before + appended[:cut])  # the writer died mid-append
        survivors = sum(1 for k in _raw_keys(path) if k.startswith("codex-app-server:t:turn-2:"))
        result = mirror_turn(
            path,
            messages,
            scope="codex-app-server:t",
            identities=identities,
            session_id="s",
            cwd="/",
        )
        assert path.read_bytes().startswith(before + appended[:cut])  # nothing rewritten
        assert (result.skipped, result.appended) == (survivors, 4 - survivors)
        keys = _raw_keys(path)
        assert keys == collections.Counter(k for turn in range(3) for k in turn_keys("t", turn))
        assert load_session_messages(path) == expected_messages("t", range(3))


def test_processes_mirroring_concurrently_interleave_nothing(tmp_path: Path) -> None:
    path = tmp_path / "shared.jsonl"
    go = tmp_path / "go"
    threads = [f"p{i}" for i in range(4)]
    turns = 12
    procs = [_spawn(path, name, 0, turns, max_size=2000, go_file=go) for name in threads]
    for proc in procs:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
    go.touch()
    for proc in procs:
        proc.communicate(timeout=120)
        assert proc.returncode == 0
    data = path.read_bytes()
    lines = data.split(b"\n")
    assert lines[-1] == b""  # ends in a newline
    parsed = [json.loads(line) for line in lines[:-1]]  # every line is whole JSON: no tearing
    assert [p["type"] for p in parsed].count("session") == 1
    assert parsed[0]["type"] == "session"
    keys = collections.Counter(p["message"]["idempotencyKey"] for p in parsed[1:])
    assert keys == collections.Counter(
        k for name in threads for t in range(turns) for k in turn_keys(name, t)
    )
    # Each turn's four entries are contiguous (one append each) and chained to the previous line.
    for index in range(1, len(parsed)):
        parent = parsed[index]["parentId"]
        assert parent == (parsed[index - 1]["id"] if index > 1 else None)
    for start in range(1, len(parsed), 4):
        block = {
            p["message"]["idempotencyKey"].rsplit(":", 1)[0] for p in parsed[start : start + 4]
        }
        assert len(block) == 1
    messages = load_session_messages(path)
    assert len(messages) == len(threads) * turns * 4
    for name in threads:
        mine = [m for m in messages if m["idempotencyKey"].startswith(f"codex-app-server:{name}:")]
        assert mine == expected_messages(name, range(turns), max_size=2000)
