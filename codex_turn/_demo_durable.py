"""The demo's durable turn: a host SIGKILLed between the model's reply and the engine's commit.

A child process (:func:`main`, run by this interpreter) is a second host of the demo's
session: it starts its own ``codex app-server`` on the demo's private Codex home, and runs one
turn with the reference engine, under a stable advancement key. Its engine's ``commit_turn``
says it was reached and waits: the demo SIGKILLs the child there, after Codex replied and
the mirror wrote the reply, before the engine was told (the child's app-server goes down with
it). The turn's outbox entry is left ``accepted``.

Then the demo, as the next host's start, calls
:func:`~codex_turn.harness.durable_turns.recover_turns`: the turn is
committed (the engine's store gains its prompt and its reply), and a second recovery, or a
replayed commit, changes nothing (``duplicate``). Exactly once, never lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Final

import anyio

from codex_turn.harness.durable_turns import recover_turns
from codex_turn.harness.outbox import TurnOutbox

__all__ = ["CRASH_KEY", "CRASH_PROMPT", "crash_between_reply_and_commit", "describe"]

CRASH_PROMPT: Final = "One more thing: I prefer a window seat on the train."
CRASH_KEY: Final = "demo-window-seat"
#: Bounds of the child's run: its start and turn (a few seconds), and its app-server's end.
_CHILD_SECONDS: Final = 60.0
_CODEX_EXIT_SECONDS: Final = 10.0
_CHILD_CODE: Final = (
    "import sys; sys.path.insert(0, sys.argv[1]); from codex_turn._demo_durable import main; main()"
)


class _DiesAtCommit:
    """The reference engine, but the host is killed as it is about to commit the turn."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    @property
    def info(self) -> Any:
        return self._inner.info

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def commit_turn(self, params: Any) -> Any:
        print(json.dumps({"commit": params.advancement_key}), flush=True)
        await anyio.sleep_forever()  # the demo SIGKILLs this process now


async def _child(spec: dict[str, Any]) -> None:
    from codex_turn.engines import SqliteContextEngine
    from codex_turn.harness.appserver import AppServer, AppServerConfig, AppServerProcess
    from codex_turn.harness.turn.orchestrator import TurnParams, run_codex_turn

    home = Path(spec["home"])
    config = AppServerConfig.offline(
        home / "codex-home",
        spec["baseUrl"],
        env=spec["env"],
        home=home,
        codex_bin=spec["codexBin"],
    )
    engine = _DiesAtCommit(SqliteContextEngine.next_to(spec["sessionFile"]))
    async with AppServer.start(config) as server:
        process = (await server.client()).transport
        if isinstance(process, AppServerProcess):
            print(json.dumps({"codexPid": process.pid}), flush=True)
        await run_codex_turn(
            TurnParams(
                session_id=spec["sessionId"],
                session_file=spec["sessionFile"],
                workspace_dir=spec["workspace"],
                prompt=CRASH_PROMPT,
                base_developer_instructions="You are a concise assistant.",
            ),
            app_server=server,
            engine=engine,
            idempotency_key=CRASH_KEY,
        )


def _run_child_until_commit(spec: dict[str, Any]) -> dict[str, Any]:
    """Start the child host, wait until its turn reaches the commit, SIGKILL it there."""
    # This very package, whatever the working directory holds (``-m`` would search it first).
    package_root = str(Path(__file__).resolve().parent.parent)
    seen: dict[str, Any] = {}
    with (
        tempfile.TemporaryFile() as errors,  # the child's stderr, shown if it fails
        subprocess.Popen(  # noqa: S603 - this interpreter and this package, no shell
            [sys.executable, "-c", _CHILD_CODE, package_root],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        ) as child,
    ):
        # A child that never reaches the commit is killed at the deadline: its stdout ends.
        timer = threading.Timer(_CHILD_SECONDS, child.kill)
        timer.start()
        try:
            assert child.stdin is not None
            assert child.stdout is not None
            child.stdin.write(json.dumps(spec))
            child.stdin.close()
            while "commit" not in seen:
                line = child.stdout.readline()
                if not line:
                    child.wait()
                    errors.seek(0)
                    tail = errors.read().decode(errors="replace").strip().splitlines()[-3:]
                    raise RuntimeError(
                        "the demo's second host ended before the commit: " + " / ".join(tail)
                    )
                seen.update(json.loads(line))
            child.send_signal(signal.SIGKILL)  # between the reply and the commit
            seen["signal"] = -child.wait()
        finally:
            timer.cancel()
            if child.poll() is None:
                child.kill()
            _end_app_server(seen.get("codexPid"))
    return seen


def _end_app_server(pid: object) -> None:
    """The killed host's app-server would end on its stdin's EOF (about a second later):
    it goes down with its host at once, as in a machine's crash, and is waited for."""
    if not isinstance(pid, int):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # its own session (see AppServerProcess.spawn)
    deadline = time.monotonic() + _CODEX_EXIT_SECONDS
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.02)


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not yet reaped by init, does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().rpartition(")")[2].split()[:1] != ["Z"]
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel (a zombie then counts as running)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


async def crash_between_reply_and_commit(
    *,
    spec: dict[str, Any],
    engine: Any,
    store: Any,
) -> dict[str, Any]:
    """Run the child host, kill it at the commit, then recover as the next host's start.

    ``engine`` is the demo's (observed) reference engine on the same store; ``store`` the
    engine itself (its doctor counts the stored messages). Returns the report's section
    (:func:`describe` says it in words)."""
    from codex_turn.harness.idempotency import completed_turn

    session_file = spec["sessionFile"]
    before = (await store.doctor(repair=False)).messages
    seen = await anyio.to_thread.run_sync(_run_child_until_commit, spec)
    entry = TurnOutbox.of(session_file).entry(CRASH_KEY)
    replied = completed_turn(session_file, CRASH_KEY) is not None
    after_kill = (await store.doctor(repair=False)).messages
    first = await recover_turns(session_file, engine=engine, session_id=spec["sessionId"])
    recovered = (await store.doctor(repair=False)).messages
    second = await recover_turns(session_file, engine=engine, session_id=spec["sessionId"])
    settled = TurnOutbox.of(session_file).entry(CRASH_KEY)
    final = (await store.doctor(repair=False)).messages
    section = {
        "advancementKey": CRASH_KEY,
        "killedWith": f"SIGKILL ({seen.get('signal')})",
        "replyInTranscript": replied,
        "outboxAfterKill": entry.state.value if entry is not None else None,
        "storeMessages": [before, after_kill, recovered, final],
        "firstRecovery": list(first.settled),
        "secondRecovery": list(second.settled + second.duplicates),
        "outboxAfterRecovery": settled.state.value if settled is not None else None,
    }
    section["exactlyOnce"] = (
        replied
        and section["outboxAfterKill"] == "accepted"
        and after_kill == before
        and first.settled == (CRASH_KEY,)
        and recovered == before + 2
        and not (second.settled or second.duplicates or second.blocked)
        and final == recovered
        and section["outboxAfterRecovery"] == "ready"
    )
    return section


def describe(section: dict[str, Any]) -> list[str]:
    """The demo's lines for :func:`crash_between_reply_and_commit`'s section."""
    before, after_kill, recovered, final = section["storeMessages"]
    return [
        "",
        "durable turn (a host killed between the reply and the commit):",
        f"  a second host ran turn {section['advancementKey']!r} and was killed with "
        f"{section['killedWith']} as its engine was about to commit it",
        f"  after the kill: reply in the transcript: {section['replyInTranscript']}; outbox "
        f"entry: {section['outboxAfterKill']}; engine store: {after_kill} messages (was {before})",
        f"  next start, recover_turns: committed {section['firstRecovery']}; engine store: "
        f"{recovered} messages (+{recovered - before}: the turn's prompt and reply)",
        f"  again: committed {section['secondRecovery']}; store: {final} messages; outbox "
        f"entry: {section['outboxAfterRecovery']} (exactly once: {section['exactlyOnce']})",
    ]


def main() -> None:
    spec = json.loads(sys.stdin.read())
    anyio.run(_child, spec)
