"""The `codex-turn` command: the offline demo (the README's main job) and the diagrams."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "codex_turn", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_offline_demo_runs_three_real_turns_without_touching_the_internet(
    tmp_path: Path,
) -> None:
    done = run_cli("demo", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert out.count("outcome=completed") == 3
    assert "thread decision: start (missing-thread-binding)" in out
    assert out.count("thread decision: resume (matching-thread-bootstrap-binding)") == 2
    assert "TOOL RESULT: Lisbon: 21 C, clear" in out  # the dynamic tool ran
    assert "internet attempts (proxy CONNECTs): 0" in out
    assert list(tmp_path.iterdir()) == []  # it leaves nothing behind


def test_the_diagrams_command_writes_mermaid_sources(tmp_path: Path) -> None:
    done = run_cli("diagrams", str(tmp_path / "out"), "--no-svg", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["compaction.mmd", "turn.mmd"]


def test_compact_uses_the_reference_engine_where_its_store_is(tmp_path: Path) -> None:
    # Issue 12: the embedded default. A session whose directory holds the reference engine's
    # store is compacted by that engine first (it owns compaction); `--engine none` opts out.
    import json

    import anyio

    from codex_turn.engines import SqliteContextEngine
    from codex_turn.harness.engine import IngestParams

    session = tmp_path / "s.jsonl"

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
    assert json.loads(opted_out.stdout)["reason"] == "no codex app-server thread binding"
    assert not home.exists()  # no session binding: Codex was never started
