"""Compaction policy (OpenClaw ``compact.test.ts`` C1-C9 and more), against an in-process fake
Codex speaking the real wire protocol to the real client and :class:`AppServer` manager.

The fake is a :class:`LineTransport`: it answers ``initialize``, ``thread/resume``,
``thread/compact/start`` and ``turn/interrupt`` the way codex 0.163.0 does (a compaction is a
turn of its own that carries a ``contextCompaction`` item), or the legacy way
(``thread/compacted``), or misbehaves on purpose (hangs, ignores interrupts, fails, refuses).

Every case also checks the compaction machine's trace twice, independently of the table:
against a hand-written expected path, and step by step against the test oracle.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from fsm_oracle import compaction_oracle
from structlog.testing import capture_logs
from support.recording_engine import RecordingEngine

from codex_turn.harness.appserver import AppServer, AppServerClosed, AppServerConfig
from codex_turn.harness.appserver.client import AppServerClient
from codex_turn.harness.appserver.threads import KeptFork
from codex_turn.harness.binding import (
    ContextEngineBinding,
    ProjectionBinding,
    ThreadBinding,
    read_binding,
    write_binding,
)
from codex_turn.harness.compaction import (
    AUTH_PROFILE_MISMATCH,
    LEFT_TO_CODEX,
    NO_THREAD_BINDING,
    NOTHING_NATIVE_TO_COMPACT,
    CompactionRun,
    CompactSessionParams,
    compact_codex_session,
    compact_codex_session_traced,
)
from codex_turn.harness.engine import (
    CompactDetails,
    CompactResult,
    LegacyContextEngine,
    to_json,
)

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

THREAD = "thread-1"
DEV = "DEV_INSTRUCTIONS_MARKER"

# --- the fake Codex -------------------------------------------------------------------------


class FakeCodex:
    """One fake ``codex app-server`` process (a line transport). ``mode`` decides how a
    compaction goes; ``log`` (shared across processes) records ``method#generation`` and
    ``closed#generation`` in order."""

    def __init__(self, mode: str, log: list[str], generation: int) -> None:
        self.mode = mode
        self.log = log
        self.generation = generation
        self.requests: list[dict[str, Any]] = []
        self.closed = False
        self.compaction_started = anyio.Event()
        self._turns = 0
        self._held: list[str] = []
        send, receive = anyio.create_memory_object_stream[bytes](math.inf)
        self._send: MemoryObjectSendStream[bytes] = send
        self._receive: MemoryObjectReceiveStream[bytes] = receive

    # LineTransport
    async def send_line(self, line: bytes) -> None:
        if self.closed:
            raise AppServerClosed("fake codex is closed")
        message = json.loads(line)
        method = message.get("method")
        if method is None:
            return
        self.log.append(f"{method}#{self.generation}")
        if "id" not in message:
            return
        self.requests.append(message)
        self._handle(message["id"], method, message.get("params") or {})

    async def receive_line(self) -> bytes:
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise AppServerClosed("fake codex exited", returncode=0) from None

    async def run_background(self) -> None:
        await anyio.sleep_forever()

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.log.append(f"closed#{self.generation}")
            self._send.close()

    @property
    def returncode(self) -> int | None:
        return 0 if self.closed else None

    # protocol
    def _emit(self, message: dict[str, Any]) -> None:
        if not self.closed:
            self._send.send_nowait(json.dumps(message).encode())

    def _notify(self, method: str, **params: Any) -> None:
        self._emit({"method": method, "params": params})

    def _handle(self, msg_id: Any, method: str, params: dict[str, Any]) -> None:
        if method == "initialize":
            self._emit({"id": msg_id, "result": {"userAgent": "fake-codex/0.163.0"}})
        elif method == "thread/resume":
            self._emit({"id": msg_id, "result": {"thread": {"id": params["threadId"]}}})
        elif method == "thread/compact/start":
            self._compact(msg_id, params["threadId"])
        elif method == "turn/interrupt":
            self._emit({"id": msg_id, "result": {}})
            if self.mode == "hang_ack":
                self._turn_completed(params["threadId"], params["turnId"], "interrupted")
        else:
            self._emit({"id": msg_id, "error": {"code": -32601, "message": "unsupported"}})

    def _turn_completed(
        self, thread: str, turn: str, status: str, error: str | None = None
    ) -> None:
        self._notify(
            "turn/completed",
            threadId=thread,
            turn={
                "id": turn,
                "items": [],
                "status": status,
                "error": None if error is None else {"message": error},
            },
        )

    def _compact(self, msg_id: Any, thread: str) -> None:
        if self.mode == "refuse":
            self._emit({"id": msg_id, "error": {"code": -32600, "message": "thread not found"}})
            return
        if self.mode != "eager":  # eager: every notification first, then the response
            self._emit({"id": msg_id, "result": {}})
        self._turns += 1
        turn = f"turn-{self._turns}"
        if self.mode != "legacy_bare":
            self._notify("turn/started", threadId=thread, turn={"id": turn, "items": []})
        self.compaction_started.set()
        if self.mode in ("hold_legacy", "hold_item"):
            self._held.append(thread)
        elif self.mode in ("item", "legacy", "legacy_bare", "eager"):
            self.finish(thread)
            if self.mode == "eager":
                self._emit({"id": msg_id, "result": {}})
        elif self.mode == "fail":
            self._turn_completed(thread, turn, "failed", "compaction model call failed")
        # hang_ack / hang_noack: nothing until an interrupt

    def finish(self, thread: str | None = None) -> None:
        """Complete a (held) compaction the way ``mode`` says."""
        thread = thread or self._held.pop(0)
        turn = f"turn-{self._turns}"
        if self.mode in ("legacy", "hold_legacy"):
            self._notify("thread/compacted", threadId=thread, turnId=turn)
        elif self.mode == "legacy_bare":
            self._notify("thread/compacted", thread_id=thread)  # snake_case, no turn at all
            return
        else:
            item = {"type": "contextCompaction", "id": f"compact-{self._turns}"}
            self._notify("item/started", threadId=thread, turnId=turn, item=item)
            self._notify("item/completed", threadId=thread, turnId=turn, item=item)
        self._turn_completed(thread, turn, "completed")

    def sent(self, method: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["method"] == method]


@attrs.define
class Fakes:
    """Every fake process one :class:`AppServer` spawned, and their shared log."""

    mode: str
    log: list[str] = attrs.Factory(list)
    processes: list[FakeCodex] = attrs.Factory(list)

    async def spawn(self, config: AppServerConfig) -> FakeCodex:
        fake = FakeCodex(self.mode, self.log, len(self.processes) + 1)
        self.processes.append(fake)
        return fake

    @property
    def first(self) -> FakeCodex:
        return self.processes[0]

    def requests(self, method: str) -> list[dict[str, Any]]:
        return [r for p in self.processes for r in p.sent(method)]


@contextlib.asynccontextmanager
async def fake_server(tmp_path: Path, mode: str = "item") -> AsyncIterator[tuple[AppServer, Fakes]]:
    fakes = Fakes(mode)
    config = AppServerConfig(codex_home=tmp_path / "unused-codex-home", request_timeout=5.0)
    async with AppServer.start(config, transport_factory=fakes.spawn) as server:
        yield server, fakes


# --- helpers --------------------------------------------------------------------------------


def session_file(tmp_path: Path) -> str:
    return str(tmp_path / "session.jsonl")


def bind(tmp_path: Path, **fields: Any) -> ThreadBinding:
    fields.setdefault("cwd", str(tmp_path))
    return write_binding(session_file(tmp_path), ThreadBinding(thread_id=THREAD, **fields))


def params(tmp_path: Path, **overrides: Any) -> CompactSessionParams:
    values: dict[str, Any] = {
        "session_id": "session-1",
        "session_key": "agent:main:session-1",
        "session_file": session_file(tmp_path),
        "workspace_dir": str(tmp_path),
        "current_token_count": 123,
        "developer_instructions": DEV,
        "native_timeout": 5.0,
        "interrupt_grace": 1.0,
    }
    values.update(overrides)
    return CompactSessionParams(**values)


ENGINE_RESULT = CompactResult(
    ok=True,
    compacted=True,
    result=CompactDetails(
        summary="engine summary",
        first_kept_entry_id="entry-1",
        tokens_before=55,
        details={"engine": "lossless-claw"},
    ),
)


def owning_engine(**kwargs: Any) -> RecordingEngine:
    kwargs.setdefault("responses", {"compact": ENGINE_RESULT})
    return RecordingEngine(engine_id="lossless-claw", owns_compaction=True, **kwargs)


def assert_path(run: CompactionRun, expected: list[str], *, owns: bool, binding: bool) -> None:
    """The trace is the expected path, and each step is legal per the independent oracle."""
    assert list(run.path) == expected
    for entry in run.trace:
        assert compaction_oracle(entry.state, entry.trigger, owns=owns, binding=binding) == (
            entry.dest
        ), entry
    assert run.trace[-1].dest == "REPORTED"


NATIVE_ONLY = ["IDLE", "NATIVE_COMPACTING", "REPORTED"]
OWNING_FULL = [
    "IDLE",
    "ENGINE_COMPACTING",
    "COMPACTION_MAINTENANCE",
    "NATIVE_COMPACTING",
    "REPORTED",
]


# --- C1-C4: native compaction ---------------------------------------------------------------


async def test_c1_waits_for_native_compaction_before_reporting_success(tmp_path: Path) -> None:
    bind(tmp_path)
    runs: list[CompactionRun] = []
    async with (
        fake_server(tmp_path, "hold_legacy") as (server, fakes),
        anyio.create_task_group() as tg,
    ):

        async def compact() -> None:
            runs.append(await compact_codex_session_traced(params(tmp_path), app_server=server))

        tg.start_soon(compact)
        with anyio.fail_after(5):
            while not fakes.processes:  # noqa: ASYNC110
                await anyio.sleep(0.005)
            await fakes.first.compaction_started.wait()
        await anyio.sleep(0.05)
        assert runs == []  # not settled before the notification
        fakes.first.finish()
    (run,) = runs
    assert run.result == CompactResult(
        ok=True,
        compacted=True,
        result=CompactDetails(
            summary="",
            first_kept_entry_id="",
            tokens_before=123,
            details={
                "backend": "codex-app-server",
                "ownsCompaction": False,
                "threadId": THREAD,
                "signal": "thread/compacted",
                "turnId": "turn-1",
            },
        ),
    )
    assert_path(run, NATIVE_ONLY, owns=False, binding=True)
    assert run.triggers == ("started", "native_compacted")
    # The thread was not loaded in this process: resumed first, instructions re-sent.
    (resume,) = fakes.requests("thread/resume")
    assert resume["params"]["excludeTurns"] is True
    assert resume["params"]["developerInstructions"] == DEV
    assert resume["params"]["cwd"] == str(tmp_path)
    assert fakes.log.index("thread/resume#1") < fakes.log.index("thread/compact/start#1")


async def test_c2_accepts_context_compaction_item_completion_as_success(tmp_path: Path) -> None:
    bind(tmp_path)
    async with fake_server(tmp_path, "item") as (server, _):
        run = await compact_codex_session_traced(params(tmp_path), app_server=server)
    assert run.result.ok
    assert run.result.compacted
    assert run.result.result is not None
    details = run.result.result.details
    assert details["signal"] == "item/completed"
    assert details["itemId"] == "compact-1"
    assert details["turnId"] == "turn-1"
    assert run.native is not None
    assert run.native.completed
    assert_path(run, NATIVE_ONLY, owns=False, binding=True)


async def test_c3_reuses_the_bound_auth_profile_for_native_compaction(tmp_path: Path) -> None:
    bind(tmp_path, auth_profile_id="openai-codex:work")
    profiles: list[str | None] = []

    async with fake_server(tmp_path, "item") as (server, _):

        @contextlib.asynccontextmanager
        async def factory(profile: str | None) -> AsyncIterator[AppServer]:
            profiles.append(profile)
            yield server

        result = await compact_codex_session(
            params(tmp_path, auth_profile_id="openai-codex:work"), app_server=factory
        )
    assert profiles == ["openai-codex:work"]
    assert result.ok
    assert result.compacted


async def test_c4_fails_closed_on_auth_profile_mismatch_without_a_client(tmp_path: Path) -> None:
    bind(tmp_path, auth_profile_id="openai-codex:work")
    created: list[str | None] = []

    @contextlib.asynccontextmanager
    async def factory(profile: str | None) -> AsyncIterator[AppServer]:
        created.append(profile)
        raise AssertionError("no client may be created")
        yield  # pragma: no cover

    run = await compact_codex_session_traced(
        params(tmp_path, auth_profile_id="openai-codex:personal"), app_server=factory
    )
    assert run.result == CompactResult(ok=False, compacted=False, reason=AUTH_PROFILE_MISMATCH)
    assert created == []
    assert run.triggers == ("started", "native_failed")
    assert_path(run, NATIVE_ONLY, owns=False, binding=True)

    # A running app-server is not touched either.
    async with fake_server(tmp_path, "item") as (server, fakes):
        again = await compact_codex_session(
            params(tmp_path, auth_profile_id="openai-codex:personal"), app_server=server
        )
        assert again.reason == AUTH_PROFILE_MISMATCH
        assert [r["method"] for r in fakes.first.requests] == ["initialize"]


# --- C5-C9: an owning engine ----------------------------------------------------------------


async def test_c5_prefers_owning_engine_compaction_and_records_native_separately(
    tmp_path: Path,
) -> None:
    bind(tmp_path)
    events: list[str] = []

    def compact(_params: Any) -> CompactResult:
        events.append("engine.compact")
        return ENGINE_RESULT

    engine = owning_engine(responses={"compact": compact})
    async with fake_server(tmp_path, "item") as (server, fakes):
        run = await compact_codex_session_traced(
            params(tmp_path, token_budget=777, current_token_count=123, provider="codex"),
            app_server=server,
            engine=engine,
            trigger="manual",
        )
    result = run.result
    assert (result.ok, result.compacted, result.reason) == (True, True, None)
    assert result.result is not None
    assert result.result.summary == "engine summary"
    assert result.result.first_kept_entry_id == "entry-1"
    assert result.result.tokens_before == 55
    assert result.result.details == {
        "engine": "lossless-claw",
        "codexNativeCompaction": {
            "ok": True,
            "compacted": True,
            "details": {
                "backend": "codex-app-server",
                "ownsCompaction": True,
                "threadId": THREAD,
                "signal": "item/completed",
                "turnId": "turn-1",
                "itemId": "compact-1",
            },
        },
    }
    compact_call = engine.only_call("compact").params
    assert compact_call.token_budget == 777
    assert compact_call.current_token_count == 123
    assert compact_call.compaction_target == "threshold"
    assert compact_call.force is True
    assert compact_call.session_id == "session-1"
    assert compact_call.session_key == "agent:main:session-1"
    assert compact_call.runtime_context["workspaceDir"] == str(tmp_path)
    assert compact_call.runtime_context["provider"] == "codex"
    maintain = engine.only_call("maintain").params
    assert maintain.runtime_context == compact_call.runtime_context
    assert engine.methods() == ["compact", "maintain"]
    assert events == ["engine.compact"]
    assert len(fakes.requests("thread/compact/start")) == 1
    assert_path(run, OWNING_FULL, owns=True, binding=True)
    assert run.triggers == ("started", "engine_compacted", "maintenance_ran", "native_compacted")
    # The JSON a caller (or the CLI) sees is OpenClaw's camelCase shape.
    assert to_json(result)["result"]["firstKeptEntryId"] == "entry-1"


async def test_c6_still_runs_native_compaction_when_maintenance_fails(tmp_path: Path) -> None:
    bind(tmp_path)
    engine = owning_engine(failures={"maintain": RuntimeError("maintenance boom")})
    async with fake_server(tmp_path, "item") as (server, _):
        run = await compact_codex_session_traced(params(tmp_path), app_server=server, engine=engine)
    assert run.result.ok
    assert run.result.compacted
    assert run.result.result is not None
    native = run.result.result.details["codexNativeCompaction"]
    assert (native["ok"], native["compacted"]) == (True, True)
    assert run.maintenance is not None
    assert run.maintenance.status == "failed"
    assert run.triggers == ("started", "engine_compacted", "maintenance_failed", "native_compacted")
    assert_path(run, OWNING_FULL, owns=True, binding=True)


async def test_c7_records_native_status_when_primary_has_no_result_payload(tmp_path: Path) -> None:
    bind(tmp_path)
    engine = owning_engine(
        responses={"compact": CompactResult(ok=True, compacted=False, reason="below threshold")}
    )
    async with fake_server(tmp_path, "item") as (server, _):
        run = await compact_codex_session_traced(
            params(tmp_path, current_token_count=222), app_server=server, engine=engine
        )
    result = run.result
    assert (result.ok, result.compacted, result.reason) == (True, False, "below threshold")
    assert result.result is not None
    assert result.result.tokens_before == 222
    assert (result.result.summary, result.result.first_kept_entry_id) == ("", "")
    assert result.result.details["codexNativeCompaction"]["ok"] is True
    assert result.result.details["codexNativeCompaction"]["compacted"] is True
    assert set(result.result.details) == {"codexNativeCompaction"}
    assert engine.methods() == ["compact"]  # nothing compacted: no compaction maintenance
    assert run.triggers == ("started", "engine_declined", "native_compacted")
    assert_path(
        run, ["IDLE", "ENGINE_COMPACTING", "NATIVE_COMPACTING", "REPORTED"], owns=True, binding=True
    )


async def test_c8_reports_engine_errors_without_skipping_native_compaction(tmp_path: Path) -> None:
    bind(tmp_path)
    engine = owning_engine(failures={"compact": RuntimeError("engine boom")})
    async with fake_server(tmp_path, "item") as (server, fakes):
        run = await compact_codex_session_traced(params(tmp_path), app_server=server, engine=engine)
    result = run.result
    reason = "context engine compaction failed: engine boom"
    assert (result.ok, result.compacted, result.reason) == (False, True, reason)
    assert result.result is not None
    details = result.result.details
    assert details["contextEngineCompaction"] == {"ok": False, "reason": reason}
    assert details["codexNativeCompaction"]["ok"] is True
    assert details["codexNativeCompaction"]["compacted"] is True
    assert result.result.tokens_before == 123
    assert engine.methods() == ["compact"]
    assert len(fakes.requests("thread/compact/start")) == 1
    assert run.triggers == ("started", "engine_failed", "native_compacted")
    assert_path(
        run, ["IDLE", "ENGINE_COMPACTING", "NATIVE_COMPACTING", "REPORTED"], owns=True, binding=True
    )


async def test_c9_native_failure_never_fails_an_owning_engine_compaction(tmp_path: Path) -> None:
    # No binding file at all: native compaction cannot run, and no app-server is touched.
    async with fake_server(tmp_path, "item") as (server, fakes):
        run = await compact_codex_session_traced(
            params(tmp_path), app_server=server, engine=owning_engine()
        )
        assert [r["method"] for r in fakes.first.requests] == ["initialize"]
    result = run.result
    assert (result.ok, result.compacted) == (True, True)
    assert result.result is not None
    assert result.result.summary == "engine summary"
    assert result.result.details["codexNativeCompaction"] == {
        "ok": False,
        "compacted": False,
        "reason": NO_THREAD_BINDING,
    }
    assert run.native is None
    assert_path(
        run,
        ["IDLE", "ENGINE_COMPACTING", "COMPACTION_MAINTENANCE", "REPORTED"],
        owns=True,
        binding=False,
    )


# --- more policies --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "engine",
    [
        None,
        LegacyContextEngine(),
        RecordingEngine(engine_id="not-owning", owns_compaction=False),
    ],
    ids=["no-engine", "legacy", "non-owning"],
)
async def test_without_an_owning_engine_only_codex_compacts(
    tmp_path: Path, engine: object | None
) -> None:
    bind(tmp_path)
    async with fake_server(tmp_path, "item") as (server, _):
        run = await compact_codex_session_traced(params(tmp_path), app_server=server, engine=engine)
    assert run.result.ok
    assert run.result.compacted
    assert run.result.result is not None
    assert set(run.result.result.details) == {
        "backend",
        "ownsCompaction",
        "threadId",
        "signal",
        "turnId",
        "itemId",
    }
    assert run.result.result.details["ownsCompaction"] is False
    if isinstance(engine, RecordingEngine):
        assert engine.calls == []  # the engine is never asked
    assert_path(run, NATIVE_ONLY, owns=False, binding=True)


async def test_without_engine_and_binding_there_is_nothing_to_compact(tmp_path: Path) -> None:
    async with fake_server(tmp_path, "item") as (server, fakes):
        run = await compact_codex_session_traced(params(tmp_path), app_server=server)
        assert [r["method"] for r in fakes.first.requests] == ["initialize"]
    assert run.result == CompactResult(ok=False, compacted=False, reason=NO_THREAD_BINDING)
    assert run.triggers == ("started",)
    assert_path(run, ["IDLE", "REPORTED"], owns=False, binding=False)


async def test_budget_trigger_asks_for_the_budget_target_without_force(tmp_path: Path) -> None:
    engine = owning_engine()
    run = await compact_codex_session_traced(
        params(tmp_path, token_budget=1000),
        app_server=_unused_factory,
        engine=engine,
        trigger="budget",
    )
    call = engine.only_call("compact").params
    assert (call.compaction_target, call.force) == ("budget", False)
    assert call.runtime_context["tokenBudget"] == 1000
    assert run.result.ok


async def test_an_invalid_engine_result_is_an_engine_failure(tmp_path: Path) -> None:
    bind(tmp_path)
    engine = owning_engine(responses={"compact": {"ok": "yes"}})
    async with fake_server(tmp_path, "item") as (server, _):
        run = await compact_codex_session_traced(params(tmp_path), app_server=server, engine=engine)
    assert run.result.ok is False
    assert run.result.reason is not None
    assert run.result.reason.startswith("context engine compaction failed: context engine ")
    assert "compact() returned an invalid result" in run.result.reason
    assert run.result.compacted is True  # native compaction still ran and compacted
    assert run.triggers == ("started", "engine_failed", "native_compacted")


async def test_an_engine_reporting_not_ok_stays_primary(tmp_path: Path) -> None:
    bind(tmp_path)
    engine = owning_engine(
        responses={"compact": CompactResult(ok=False, compacted=False, reason="busy")}
    )
    async with fake_server(tmp_path, "item") as (server, _):
        run = await compact_codex_session_traced(params(tmp_path), app_server=server, engine=engine)
    assert (run.result.ok, run.result.compacted, run.result.reason) == (False, False, "busy")
    assert run.result.result is not None
    assert "contextEngineCompaction" not in run.result.result.details  # it did not throw
    assert run.triggers == ("started", "engine_failed", "native_compacted")


async def test_engine_compaction_clears_the_projection_but_keeps_the_thread(tmp_path: Path) -> None:
    block = ContextEngineBinding(
        engine_id="lossless-claw",
        policy_fingerprint='{"engineId":"lossless-claw"}',
        projection=ProjectionBinding(mode="thread_bootstrap", epoch="epoch-7", fingerprint="f"),
    )
    before = bind(tmp_path, context_engine=block, model="m")
    async with fake_server(tmp_path, "item") as (server, _):
        run = await compact_codex_session_traced(
            params(tmp_path), app_server=server, engine=owning_engine()
        )
    after = read_binding(session_file(tmp_path))
    assert run.projection_cleared is True
    assert after is not None
    assert after.context_engine is not None
    assert after.thread_id == before.thread_id == THREAD
    assert after.context_engine.projection is None
    assert attrs.evolve(after.context_engine, projection=None) == attrs.evolve(
        block, projection=None
    )
    assert after.model == "m"


async def test_a_declined_engine_compaction_keeps_the_projection(tmp_path: Path) -> None:
    block = ContextEngineBinding(
        engine_id="lossless-claw",
        policy_fingerprint="p",
        projection=ProjectionBinding(mode="thread_bootstrap", epoch="epoch-7"),
    )
    bind(tmp_path, context_engine=block)
    engine = owning_engine(responses={"compact": CompactResult(ok=True, compacted=False)})
    async with fake_server(tmp_path, "item") as (server, _):
        run = await compact_codex_session_traced(params(tmp_path), app_server=server, engine=engine)
    assert run.projection_cleared is False
    after = read_binding(session_file(tmp_path))
    assert after is not None
    assert after.context_engine == block


@attrs.define
class ForkKeeper:
    """A started app-server that keeps a fork of the base for the next turn, and must never be
    asked to compact (a fork base holds no native history)."""

    taken: list[str] = attrs.Factory(list)
    released: list[str] = attrs.Factory(list)

    def take_kept_fork(self, base_thread_id: str) -> KeptFork:
        self.taken.append(base_thread_id)
        return KeptFork(base_thread_id, "kept-fork", (), "settings", completed=True)

    def release_fork(self, fork_thread_id: str) -> None:
        self.released.append(fork_thread_id)

    async def compact_thread(self, thread_id: str, **_: Any) -> Any:
        raise AssertionError("a fork base is never compacted natively")


def fork_base_block() -> ContextEngineBinding:
    return ContextEngineBinding(
        engine_id="lossless-claw",
        policy_fingerprint="p",
        projection=ProjectionBinding(mode="fork_base", epoch="base"),
    )


async def test_a_fork_base_is_skipped_natively_and_its_kept_fork_dropped(tmp_path: Path) -> None:
    bind(tmp_path, context_engine=fork_base_block())
    server = ForkKeeper()
    run = await compact_codex_session_traced(params(tmp_path), app_server=server)
    assert run.triggers == ("started", "native_skipped")
    assert_path(run, NATIVE_ONLY, owns=False, binding=True)
    assert run.result == CompactResult(ok=True, compacted=False, reason=NOTHING_NATIVE_TO_COMPACT)
    assert run.native is None  # Codex was not asked
    assert (server.taken, server.released) == ([THREAD], ["kept-fork"])


async def test_an_engine_compaction_of_a_fork_base_is_not_reported_alongside_native(
    tmp_path: Path,
) -> None:
    bind(tmp_path, context_engine=fork_base_block())
    server = ForkKeeper()
    with capture_logs() as logs:
        run = await compact_codex_session_traced(
            params(tmp_path), app_server=server, engine=owning_engine()
        )
    assert run.triggers == ("started", "engine_compacted", "maintenance_ran", "native_skipped")
    assert_path(run, OWNING_FULL, owns=True, binding=True)
    assert (run.result.ok, run.result.compacted) == (True, True)
    assert run.result.result is not None
    assert run.result.result.details["codexNativeCompaction"] == {
        "ok": False,
        "compacted": False,
        "reason": NOTHING_NATIVE_TO_COMPACT,
    }
    assert not run.projection_cleared  # the base's mark stays
    assert server.released == ["kept-fork"]
    events = [e["event"] for e in logs]
    assert "codex native compaction completed alongside context-engine compaction" not in events


# --- native failures ------------------------------------------------------------------------


async def test_a_failed_compaction_turn_is_reported_and_never_retried(tmp_path: Path) -> None:
    bind(tmp_path)
    async with fake_server(tmp_path, "fail") as (server, fakes):
        run = await compact_codex_session_traced(
            params(tmp_path), app_server=server, engine=owning_engine()
        )
    # The engine's success stands; the native failure is a diagnostic.
    assert (run.result.ok, run.result.compacted) == (True, True)
    assert run.result.result is not None
    assert run.result.result.details["codexNativeCompaction"] == {
        "ok": False,
        "compacted": False,
        "reason": "compaction model call failed",
    }
    assert run.native is not None
    assert run.native.status == "failed"
    assert len(fakes.requests("thread/compact/start")) == 1
    assert fakes.requests("turn/start") == []  # never retried as a prompt
    assert run.triggers == ("started", "engine_compacted", "maintenance_ran", "native_failed")
    assert_path(run, OWNING_FULL, owns=True, binding=True)


async def test_a_refused_compaction_request_is_a_native_failure(tmp_path: Path) -> None:
    bind(tmp_path)
    async with fake_server(tmp_path, "refuse") as (server, fakes):
        run = await compact_codex_session_traced(params(tmp_path), app_server=server)
    assert run.result.ok is False
    assert run.result.compacted is False
    assert run.result.reason is not None
    assert "thread not found" in run.result.reason
    assert len(fakes.requests("thread/compact/start")) == 1
    assert run.triggers == ("started", "native_failed")


async def test_a_slow_compaction_times_out_and_is_interrupted(tmp_path: Path) -> None:
    bind(tmp_path)
    async with fake_server(tmp_path, "hang_ack") as (server, fakes):
        run = await compact_codex_session_traced(
            params(tmp_path, native_timeout=0.2, interrupt_grace=2.0), app_server=server
        )
        assert server.current is not None
        assert not server.current.closed
        assert fakes.first.closed is False
        assert server.restarts == 0
    assert run.result == CompactResult(
        ok=False,
        compacted=False,
        reason=f"timed out waiting for codex app-server compaction for {THREAD}",
    )
    assert run.native is not None
    assert (run.native.status, run.native.interrupted, run.native.retired) == (
        "timed_out",
        True,
        False,
    )
    (interrupt,) = fakes.requests("turn/interrupt")
    assert interrupt["params"] == {"threadId": THREAD, "turnId": "turn-1"}
    assert run.triggers == ("started", "native_timed_out")
    assert_path(run, NATIVE_ONLY, owns=False, binding=True)


async def test_an_unacknowledged_interrupt_retires_the_connection_before_the_lock_is_released(
    tmp_path: Path,
) -> None:
    bind(tmp_path)
    results: list[Any] = []
    async with fake_server(tmp_path, "hang_noack") as (server, fakes):

        async def compact() -> None:
            results.append(
                await server.compact_thread(THREAD, timeout=0.2, interrupt_grace=0.1, cwd="/w")
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(compact)
            await fakes_started(fakes)
            tg.start_soon(compact)  # waits on the per-thread compaction lock
        assert server.restarts == 1
    first, second = results
    assert first.status == second.status == "timed_out"
    assert first.retired
    assert first.interrupted
    assert fakes.processes[0].closed
    log = fakes.log
    # The first process got the interrupt, then was closed; only then did the second
    # compaction start, on a fresh process (which resumed the thread first).
    assert log.index("turn/interrupt#1") < log.index("closed#1") < log.index("thread/resume#2")
    assert log.index("closed#1") < log.index("thread/compact/start#2")
    assert log.count("thread/compact/start#1") == 1


async def fakes_started(fakes: Fakes) -> None:
    with anyio.fail_after(5):
        while not fakes.processes:  # noqa: ASYNC110
            await anyio.sleep(0.005)
        await fakes.first.compaction_started.wait()


async def test_a_dead_process_during_compaction_is_a_native_failure(tmp_path: Path) -> None:
    bind(tmp_path)
    runs: list[CompactionRun] = []
    async with (
        fake_server(tmp_path, "hang_noack") as (server, fakes),
        anyio.create_task_group() as tg,
    ):

        async def compact() -> None:
            runs.append(await compact_codex_session_traced(params(tmp_path), app_server=server))

        tg.start_soon(compact)
        await fakes_started(fakes)
        await fakes.first.aclose()  # the process dies mid-compaction
    (run,) = runs
    assert run.result.ok is False
    assert run.result.reason is not None
    assert "fake codex exited" in run.result.reason
    assert run.triggers == ("started", "native_failed")


# --- the client alone -----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def fake_client(
    tmp_path: Path, mode: str
) -> AsyncIterator[tuple[AppServerClient, FakeCodex]]:
    fake = FakeCodex(mode, [], 1)
    config = AppServerConfig(codex_home=tmp_path / "unused")
    async with AppServerClient.connect(config, transport=fake) as client:
        yield client, fake


async def test_a_legacy_server_without_a_compaction_turn_completes_on_the_signal(
    tmp_path: Path,
) -> None:
    async with fake_client(tmp_path, "legacy_bare") as (client, _):
        result = await client.compact_thread(THREAD, timeout=2.0)
    assert (result.status, result.signal, result.turn_id) == ("completed", "thread/compacted", None)


async def test_the_waiter_is_registered_before_the_request_is_sent(tmp_path: Path) -> None:
    # The fake emits the whole compaction turn before it even answers the request, so a
    # waiter registered after sending would miss every notification and time out.
    async with fake_client(tmp_path, "eager") as (client, fake):
        result = await client.compact_thread(THREAD, timeout=2.0)
        assert result.completed
        assert result.item_id == "compact-1"
        assert len(client.compactions._locks) == 0  # the per-thread lock is dropped after use
    assert fake.sent("thread/compact/start")[0]["params"] == {"threadId": THREAD}


def _unused_factory(profile: str | None) -> contextlib.AbstractAsyncContextManager[Any]:
    raise AssertionError("no app-server may be started without a binding")


def test_params_reject_nonsense_timeouts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        params(tmp_path, native_timeout=0)
    with pytest.raises(ValueError, match="must be >= 0"):
        params(tmp_path, interrupt_grace=-1)


Factory = Callable[[str | None], contextlib.AbstractAsyncContextManager[Any]]


# --- budget compaction belongs to Codex unless an engine owns it ---------------------------


@pytest.mark.parametrize("trigger", ["budget", "overflow", "threshold"])
async def test_a_budget_request_without_an_owning_engine_is_left_to_codex(
    tmp_path: Path, trigger: str
) -> None:
    bind(tmp_path)
    engine = RecordingEngine(engine_id="not-owning")
    async with fake_server(tmp_path, "item") as (server, fakes):
        run = await compact_codex_session_traced(
            params(tmp_path), app_server=server, engine=engine, trigger=trigger
        )
        assert fakes.requests("thread/compact/start") == []
    assert run.result == CompactResult(ok=True, compacted=False, reason=LEFT_TO_CODEX)
    assert engine.calls == []
    assert run.triggers == ("started",)
    for entry in run.trace:
        assert (
            compaction_oracle(entry.state, entry.trigger, owns=False, binding=True, manual=False)
            == entry.dest
        )


async def test_a_budget_request_still_asks_an_owning_engine_first_then_native(
    tmp_path: Path,
) -> None:
    bind(tmp_path)
    engine = owning_engine()
    async with fake_server(tmp_path, "item") as (server, fakes):
        with capture_logs() as logs:
            run = await compact_codex_session_traced(
                params(tmp_path), app_server=server, engine=engine, trigger="budget"
            )
        assert len(fakes.requests("thread/compact/start")) == 1
    assert engine.methods()[0] == "compact"
    assert run.triggers == ("started", "engine_compacted", "maintenance_ran", "native_compacted")
    events = [e["event"] for e in logs]
    assert "codex native compaction completed alongside context-engine compaction" in events
