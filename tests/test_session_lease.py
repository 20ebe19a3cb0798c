"""The whole-turn session lease across real OS processes (without any engine).

Each process runs :func:`codex_turn.run_codex_turn` against its own in-process fake app-server
(``tests/support/fake_appserver.py``) on ONE session file. The fakes share a "Codex home": a
thread started by one process can be resumed by the other (as two app-servers on one
``CODEX_HOME`` would), and thread and turn ids are unique per process. What is checked:

* two processes in ``wait`` mode run one after the other (the second's first step comes after
  the first's last), both turns are in the transcript, and the binding names the one thread
  both used (the second resumed it: nothing orphaned);
* ``reject`` mode refuses the second process with :class:`SessionBusy` at once;
* a SIGKILLed holder's lease is taken over by the next process at once (dead pid), with a
  warning;
* a lock file in OpenClaw's own format, held by a live process, is respected (wait, then
  :class:`SessionBusy`; taken as soon as it is released);
* a turn longer than the lease's ttl is not stolen: its lease is renewed (the holder poses as
  another host, so the waiter judges it by its ttl alone), while an unrenewed lease of
  another host is taken over once expired;
* the turn's own mirror writes under the lease without taking the lock file again, and the
  lease is released when the turn ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs
from support.fake_appserver import FakeAppServer
from support.transcripts import transcript_texts

from codex_turn import (
    SessionBusy,
    TurnHooks,
    TurnOutcome,
    TurnParams,
    read_binding,
    run_codex_turn,
)
from codex_turn.harness import _gates
from codex_turn.harness.session import _lease, _lock, _lockfile
from codex_turn.harness.session._format import utc_now_iso

ROOT = Path(__file__).parent.parent

# One turn in one process. argv: session file, label, concurrency, wait timeout, delay (seconds
# the fake Codex takes to start or resume the thread), ttl ("" for the default), host ("" for
# this host). Prints "began <time>" before the turn, "holding <time>" at its first step, then
# one JSON line. With LEASE_TEST_GATE set, the fake Codex also waits for that file to exist
# (a test opens the gate once another process is known to be waiting: no race on load).
SCRIPT = textwrap.dedent(
    """
    import itertools, json, os, sys, time

    import anyio
    from support.fake_appserver import CodexScript, FakeAppServer, ToolRegistry, _Policy

    import codex_turn
    from codex_turn import SessionBusy, TurnHooks, TurnParams, run_codex_turn
    from codex_turn.harness.session import _lease, _lockfile

    path, label, concurrency, wait_timeout, delay, ttl, host = sys.argv[1:8]
    if ttl:
        _lease.LEASE_TTL_SECONDS = float(ttl)
    if host:
        _lockfile.HOST = host  # poses as another host: judged by its ttl alone
    codex_turn.configure_logging(level="WARNING", format="json")


    gate = os.environ.get("LEASE_TEST_GATE")


    async def hold():
        await anyio.sleep(float(delay))
        while gate and not os.path.exists(gate):
            await anyio.sleep(0.02)


    class SharedHomeCodex(FakeAppServer):
        # Two app-servers on one Codex home: any thread of the home can be resumed.
        async def start_thread(self, settings):
            await hold()
            return await super().start_thread(settings)

        async def resume_thread(self, thread_id, settings):
            await hold()
            if thread_id not in self.threads:
                self.threads[thread_id] = ToolRegistry(())
                self._policies[thread_id] = _Policy()
            return await super().resume_thread(thread_id, settings)


    server = SharedHomeCodex(default=CodexScript(reply=f"reply from {label}"))
    server._ids = itertools.count(os.getpid() * 1000)  # ids unique per process
    steps = []

    def on_transition(entry):
        if not steps:
            print(f"holding {time.time()!r}", flush=True)
        steps.append(time.time())


    async def main():
        params = TurnParams(
            session_id="lease-session",
            session_file=path,
            workspace_dir=os.path.dirname(path),
            prompt=f"prompt from {label}",
            concurrency=concurrency,
            session_wait_timeout=float(wait_timeout),
        )
        began = time.time()
        print(f"began {began!r}", flush=True)
        try:
            result = await run_codex_turn(
                params, app_server=server, hooks=TurnHooks(on_transition=on_transition)
            )
        except SessionBusy as error:
            report = {"busy": True, "holder_pid": error.holder_pid}
        else:
            report = {
                "busy": False,
                "outcome": result.outcome.value,
                "thread_id": result.thread_id,
                "decision": result.thread_decision.reason if result.thread_decision else None,
                "first_step": steps[0],
                "last_step": steps[-1],
                "resumed": [c.args["thread_id"] for c in server.calls_to("resume_thread")],
                "started": len(server.calls_to("start_thread")),
            }
        report["began"] = began
        report["elapsed"] = time.time() - began
        print(json.dumps(report), flush=True)


    anyio.run(main)
    """
)


def _spawn(
    tmp_path: Path,
    session: Path,
    label: str,
    *,
    concurrency: str = "wait",
    wait_timeout: float = 30.0,
    delay: float = 0.0,
    ttl: float | None = None,
    host: str = "",
    gate: Path | None = None,
) -> subprocess.Popen[str]:
    script = tmp_path / "lease_turn.py"
    if not script.exists():
        script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    if gate is not None:
        env["LEASE_TEST_GATE"] = str(gate)
    args = [str(session), label, concurrency, str(wait_timeout), str(delay)]
    args += ["" if ttl is None else str(ttl), host]
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _wait_holding(proc: subprocess.Popen[str]) -> float:
    """Block until the process reports its turn's first step (it holds the lease)."""
    return _wait_for(proc, "holding ")


def _wait_for(proc: subprocess.Popen[str], prefix: str) -> float:
    """Block until the process prints the line ``prefix <time>``; that time."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    while line.startswith("began ") and prefix != "began ":
        line = proc.stdout.readline()
    assert line.startswith(prefix), (line, proc.stderr.read() if proc.stderr else "")
    return float(line.split()[1])


def _finish(proc: subprocess.Popen[str], timeout: float = 60.0) -> tuple[dict[str, Any], str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, (out, err)
    return json.loads(lines[0]), err


def _lock_file(session: Path) -> Path:
    return Path(os.path.realpath(session.parent)) / (session.name + ".lock")


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


# --- two processes, one session ----------------------------------------------------------------


def test_two_processes_take_turns_and_share_one_thread(tmp_path: Path) -> None:
    session = tmp_path / "s.jsonl"
    gate = tmp_path / "gate"
    first = _spawn(tmp_path, session, "A", gate=gate)
    try:
        _wait_holding(first)
        second = _spawn(tmp_path, session, "B")
        _wait_for(second, "began ")  # B is under way while A holds the session ...
        time.sleep(0.2)
        gate.touch()  # ... and only then may A go on
        a, _ = _finish(first)
        b, b_err = _finish(second)
    finally:
        _kill(first)
    assert a["outcome"] == b["outcome"] == "completed"
    # Serialized: B's first step came after A's last (A's lease is released after it).
    assert b["first_step"] > a["last_step"]
    assert b["began"] < a["last_step"]  # ... and B was waiting meanwhile
    # One thread: A started it, B resumed it (no second start, nothing orphaned).
    assert a["decision"] == "missing-thread-binding"
    assert a["started"] == 1
    assert b["started"] == 0
    assert b["resumed"] == [a["thread_id"]]
    assert b["thread_id"] == a["thread_id"]
    binding = read_binding(session, session_id="lease-session")
    assert binding is not None
    assert binding.thread_id == a["thread_id"]
    # Both turns are in the transcript, in order.
    assert transcript_texts(session) == [
        "prompt from A",
        "reply from A",
        "prompt from B",
        "reply from B",
    ]
    assert not _lock_file(session).exists()
    assert "stale" not in b_err  # nothing was taken over


def test_reject_mode_refuses_the_second_process_at_once(tmp_path: Path) -> None:
    session = tmp_path / "s.jsonl"
    first = _spawn(tmp_path, session, "A", delay=3.0)
    try:
        _wait_holding(first)
        refused, _ = _finish(_spawn(tmp_path, session, "B", concurrency="reject"))
        assert refused["busy"] is True
        assert refused["holder_pid"] == first.pid
        assert refused["elapsed"] < 1.0
        a, _ = _finish(first)
    finally:
        _kill(first)
    assert a["outcome"] == "completed"
    assert transcript_texts(session) == ["prompt from A", "reply from A"]


def test_a_wait_that_times_out_on_a_live_holder_is_busy_and_steals_nothing(
    tmp_path: Path,
) -> None:
    session = tmp_path / "s.jsonl"
    first = _spawn(tmp_path, session, "A", delay=3.0)
    try:
        _wait_holding(first)
        timed_out, _ = _finish(_spawn(tmp_path, session, "B", wait_timeout=0.5))
        assert timed_out["busy"] is True
        assert timed_out["holder_pid"] == first.pid
        assert 0.5 <= timed_out["elapsed"] < 2.5
        assert json.loads(_lock_file(session).read_text())["pid"] == first.pid
        a, _ = _finish(first)
    finally:
        _kill(first)
    assert a["outcome"] == "completed"


def test_a_sigkilled_holder_is_recovered_at_once(tmp_path: Path) -> None:
    session = tmp_path / "s.jsonl"
    holder = _spawn(tmp_path, session, "A", delay=60.0)
    try:
        _wait_holding(holder)
        lock = _lock_file(session)
        assert json.loads(lock.read_text())["pid"] == holder.pid
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    finally:
        _kill(holder)
    assert lock.exists()  # the dead holder's lease is left behind
    b, b_err = _finish(_spawn(tmp_path, session, "B", wait_timeout=10.0))
    assert b["outcome"] == "completed"
    assert b["first_step"] - b["began"] < 2.0  # taken over, not waited out
    warnings = [json.loads(line) for line in b_err.splitlines() if line.startswith("{")]
    stale = [w for w in warnings if w["event"] == "session lock was stale; removed"]
    assert len(stale) == 1
    assert stale[0]["reason"] == "dead pid"
    assert stale[0]["holder_pid"] == holder.pid
    assert "prompt from" not in b_err  # the warning carries no private data
    assert transcript_texts(session)[-2:] == ["prompt from B", "reply from B"]
    assert not lock.exists()


def test_a_long_turn_renews_its_lease_and_is_not_stolen(tmp_path: Path) -> None:
    """The holder poses as another host with a 0.6 s ttl: the waiter can judge it by its ttl
    only. Its turn takes 2.5 s; without renewal the waiter would take it over after 0.6 s."""
    session = tmp_path / "s.jsonl"
    first = _spawn(tmp_path, session, "A", delay=2.5, ttl=0.6, host="elsewhere.invalid")
    try:
        _wait_holding(first)
        lock = _lock_file(session)
        payload = json.loads(lock.read_text())
        assert payload["host"] == "elsewhere.invalid"
        assert payload["ttlMs"] == 600
        second = _spawn(tmp_path, session, "B")
        seen = {payload["createdAt"]}
        while first.poll() is None:
            with contextlib.suppress(FileNotFoundError, ValueError):  # released, or B's
                seen.add(json.loads(lock.read_text())["createdAt"])
            time.sleep(0.1)
        a, _ = _finish(first)
        b, b_err = _finish(second)
    finally:
        _kill(first)
    assert len(seen) >= 3  # renewed, every quarter ttl
    assert a["outcome"] == b["outcome"] == "completed"
    assert b["first_step"] > a["last_step"]  # not stolen
    assert "stale" not in b_err
    assert b["thread_id"] == a["thread_id"]


# --- foreign holders, in this process ---------------------------------------------------------


def _params(session: Path, **overrides: Any) -> TurnParams:
    base: dict[str, Any] = {
        "session_id": "lease-session",
        "session_file": session,
        "workspace_dir": session.parent,
        "prompt": "prompt here",
    }
    return TurnParams(**(base | overrides))


@pytest.fixture
def sleeper() -> Any:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _openclaw_lock(pid: int, created_at: str | None = None) -> str:
    """A lock file exactly as OpenClaw writes it: ``JSON.stringify(payload, null, 2)``."""
    payload: dict[str, Any] = {"pid": pid, "createdAt": created_at or utc_now_iso()}
    starttime = _lockfile._process_starttime(pid)
    if starttime is not None:
        payload["starttime"] = starttime
    return json.dumps(payload, indent=2)


@pytest.mark.anyio
async def test_an_openclaw_holder_is_respected_then_followed(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    session = tmp_path / "s.jsonl"
    lock = _lock_file(session)
    lock.write_text(_openclaw_lock(sleeper.pid))
    server = FakeAppServer()
    with pytest.raises(SessionBusy) as refused:
        await run_codex_turn(_params(session, concurrency="reject"), app_server=server)
    assert refused.value.holder_pid == sleeper.pid
    started = time.monotonic()
    with pytest.raises(SessionBusy, match="timed out"):
        await run_codex_turn(_params(session, session_wait_timeout=0.4), app_server=server)
    assert 0.4 <= time.monotonic() - started < 2.0
    assert server.calls == []  # nothing reached Codex
    assert lock.read_text() == _openclaw_lock(
        sleeper.pid, json.loads(lock.read_text())["createdAt"]
    )

    async def openclaw_releases() -> None:
        await anyio.sleep(0.3)
        lock.unlink()

    async with anyio.create_task_group() as group:
        group.start_soon(openclaw_releases)
        started = time.monotonic()
        result = await run_codex_turn(_params(session), app_server=server)
    assert result.outcome is TurnOutcome.COMPLETED
    assert 0.3 <= time.monotonic() - started < 3.0
    assert not lock.exists()


@pytest.mark.anyio
async def test_stale_foreign_leases_are_taken_over(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    session = tmp_path / "s.jsonl"
    lock = _lock_file(session)
    old = "2020-01-01T00:00:00.000Z"
    stale = {
        # another host's lease, not renewed within its ttl: its pid means nothing here
        "lease expired": {"pid": sleeper.pid, "createdAt": old, "host": "x.invalid", "ttlMs": 5},
        # an OpenClaw lock of a live pid, 30 minutes old
        "too old": json.loads(_openclaw_lock(sleeper.pid, old)),
    }
    for reason, payload in stale.items():
        lock.write_text(json.dumps(payload))
        with capture_logs() as logs:
            result = await run_codex_turn(_params(session), app_server=FakeAppServer())
        assert result.outcome is TurnOutcome.COMPLETED
        taken = [log for log in logs if log["event"] == "session lock was stale; removed"]
        assert [log["reason"] for log in taken] == [reason]
        assert not lock.exists()
    # A fresh lease of another host, within its ttl, is respected (its pid is not checked).
    lock.write_text(
        json.dumps(
            {"pid": 999_999_999, "createdAt": utc_now_iso(), "host": "x.invalid", "ttlMs": 60_000}
        )
    )
    with pytest.raises(SessionBusy):
        await run_codex_turn(_params(session, concurrency="reject"), app_server=FakeAppServer())
    # A live holder on this host is never judged by its ttl (only by OpenClaw's 30 minutes).
    lock.write_text(json.dumps({"pid": sleeper.pid, "createdAt": utc_now_iso(), "ttlMs": 1}))
    await anyio.sleep(0.01)
    with pytest.raises(SessionBusy):
        await run_codex_turn(_params(session, concurrency="reject"), app_server=FakeAppServer())


# --- the turn's own writes, and the lease's life ----------------------------------------------


@pytest.mark.anyio
async def test_the_turn_holds_the_lock_file_for_its_whole_duration(tmp_path: Path) -> None:
    session = tmp_path / "s.jsonl"
    lock = _lock_file(session)
    seen: list[dict[str, Any]] = []

    def on_transition(entry: Any) -> None:
        seen.append(json.loads(lock.read_text()))

    result = await run_codex_turn(
        _params(session), app_server=FakeAppServer(), hooks=TurnHooks(on_transition=on_transition)
    )
    assert result.outcome is TurnOutcome.COMPLETED
    assert len(seen) == len(result.trace)
    assert len(seen) > 5
    # One lease, held from the first step to the last, the mirror included: never re-taken.
    assert all(p == seen[0] for p in seen)
    assert seen[0]["pid"] == os.getpid()
    assert seen[0]["host"] == _lockfile.HOST
    assert seen[0]["ttlMs"] == round(_lease.LEASE_TTL_SECONDS * 1000)
    assert not lock.exists()
    assert not _lock._path_locks[str(lock)[: -len(".lock")]].holds_file()
    assert transcript_texts(session) == ["prompt here", "Done."]


@pytest.mark.anyio
async def test_cancellation_while_waiting_for_the_lease_leaves_nothing_held(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    session = tmp_path / "s.jsonl"
    lock = _lock_file(session)
    lock.write_text(_openclaw_lock(sleeper.pid))
    with anyio.move_on_after(0.3) as scope:
        await run_codex_turn(_params(session), app_server=FakeAppServer())
    assert scope.cancelled_caught
    assert not _gates._gate_for(session).locked()
    lock.unlink()
    result = await run_codex_turn(
        _params(session, concurrency="reject"), app_server=FakeAppServer()
    )
    assert result.outcome is TurnOutcome.COMPLETED


# --- compaction, and lock paths that cannot be used --------------------------------------------


@pytest.mark.anyio
async def test_compaction_takes_the_same_lease(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    from codex_turn import CompactSessionParams, compact_codex_session

    session = tmp_path / "s.jsonl"
    server = FakeAppServer()
    first = await run_codex_turn(_params(session), app_server=server)
    assert first.outcome is TurnOutcome.COMPLETED
    lock = _lock_file(session)
    lock.write_text(_openclaw_lock(sleeper.pid))  # a turn of another process
    params = CompactSessionParams(
        session_id="lease-session", session_file=str(session), session_wait_timeout=0.3
    )
    with pytest.raises(SessionBusy) as busy:
        await compact_codex_session(params, app_server=server)
    assert busy.value.holder_pid == sleeper.pid
    assert "compact_thread" not in server.methods()
    lock.unlink()
    seen: list[bool] = []
    original = server.compact_thread

    async def compact_thread(*args: Any, **kwargs: Any) -> Any:
        seen.append(json.loads(lock.read_text())["pid"] == os.getpid())
        return await original(*args, **kwargs)

    server.compact_thread = compact_thread  # type: ignore[method-assign]
    result = await compact_codex_session(params, app_server=server)
    assert seen == [True]  # native compaction ran under this process's lease
    assert result.ok
    assert not lock.exists()
    # A session that does not exist: compaction creates no directory for a lock file.
    missing = tmp_path / "nowhere" / "s.jsonl"
    await compact_codex_session(
        CompactSessionParams(session_id="lease-session", session_file=str(missing)),
        app_server=FakeAppServer(),
    )
    assert not missing.parent.exists()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["directory", "dangling symlink"])
async def test_an_unusable_lock_path_is_refused_by_the_preflight(tmp_path: Path, kind: str) -> None:
    from codex_turn import TranscriptUnwritable

    session = tmp_path / "s.jsonl"
    lock = _lock_file(session)
    if kind == "directory":
        lock.mkdir()
    else:
        lock.symlink_to(tmp_path / "gone")
    server = FakeAppServer()
    started = time.monotonic()
    with pytest.raises(TranscriptUnwritable, match="lock file"):
        await run_codex_turn(_params(session), app_server=server)
    assert time.monotonic() - started < 2.0  # refused, not waited out
    assert server.calls == []


def test_two_event_loops_of_one_process_take_turns_on_a_session(tmp_path: Path) -> None:
    """Before its fix, the in-process gate was one anyio lock per session for the whole
    process, so a second event loop (another thread) was not woken when the first released it
    (it waited out its timeout), and a trio loop failed on the asyncio loop's lock. The gate is
    now per event loop; the lease keeps the loops apart, as it keeps processes apart."""
    import threading

    path = str(tmp_path / "s.jsonl")
    events: list[tuple[str, float]] = []
    errors: list[BaseException] = []
    started = time.monotonic()

    def first() -> None:
        async def main() -> None:
            async with _gates.hold_session(path, wait_timeout=10):
                events.append(("first in", time.monotonic() - started))
                await anyio.sleep(0.5)
            events.append(("first out", time.monotonic() - started))

        anyio.run(main, backend="asyncio")

    def second(backend: str) -> None:
        async def main() -> None:
            await anyio.sleep(0.1)
            async with _gates.hold_session(path, wait_timeout=10):
                events.append(("second in", time.monotonic() - started))

        try:
            anyio.run(main, backend=backend)
        except BaseException as error:  # reported below
            errors.append(error)

    for backend in ("asyncio", "trio"):
        events.clear()
        started = time.monotonic()
        threads = [threading.Thread(target=first), threading.Thread(target=second, args=(backend,))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
        assert errors == []
        order = [name for name, _ in events]
        assert order == ["first in", "first out", "second in"], (backend, events)
        second_in = dict(events)["second in"]
        assert second_in < 0.5 + 2.0  # woken by the release (polling), not by a 10 s timeout


def test_a_child_forked_while_the_renewal_thread_lingers_renews_its_own_leases(
    tmp_path: Path,
) -> None:
    # The renewal thread outlives the last lease (for the next turn); a forked child inherits
    # its "running" mark but not the thread, and must start its own.
    session = tmp_path / "s.jsonl"
    session.write_text("")
    lease = _lease.try_acquire_lease(str(session), ttl=0.4)
    assert isinstance(lease, _lease.SessionLease)
    _lease.release_lease(lease)
    assert _lease._renewer._running  # lingering
    pid = os.fork()
    if pid == 0:  # the child: take a lease and see it renewed
        code = 1
        try:
            mine = _lease.try_acquire_lease(str(session), ttl=0.4)
            if isinstance(mine, _lease.SessionLease):
                time.sleep(0.5)
                code = 0 if mine.renewals >= 1 else 2
                _lease.release_lease(mine)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
