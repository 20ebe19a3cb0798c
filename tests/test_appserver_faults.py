"""App-server faults against in-process fakes (exact control, no binary).

* Liveness: a missed deadline asks once whether the process is alive; silence gets it killed
  and the connection closed (every pending call fails), and :class:`AppServer` replaces it
  and re-resumes its threads; a live process (an answered probe, or any line) is kept.
* Outgoing text: :func:`encode_message` replaces each lone surrogate by U+FFFD, keeps pairs.
* Resume failures: :class:`ThreadNotFound` only for Codex's "no such thread"; the fake
  raises both kinds.
* Tool arguments are validated against the tool's schema before the host function runs.
* Identifiers of any size are capped in logs and error messages.

The same faults against the real binary: test_appserver_faults_e2e.py.
"""

from __future__ import annotations

import http.server
import itertools
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs
from support.fake_appserver import CodexScript, FakeAppServer

from codex_turn.harness.appserver import (
    AppServer,
    AppServerClient,
    AppServerClosed,
    AppServerConfig,
    AppServerRpcError,
    AppServerTimeout,
    CodexTurnStatus,
    DynamicTool,
    ThreadNotFound,
    ThreadSettings,
    ToolRegistry,
)
from codex_turn.harness.appserver.client import LIVENESS_PROBE_METHOD, encode_message
from codex_turn.harness.appserver.defaults import MAX_LOGGED_ID_CHARS
from codex_turn.harness.appserver.errors import MAX_MESSAGE_CHARS

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

LIVENESS = 0.3
Message = dict[str, Any]


class StoppableCodex:
    """A :class:`~codex_turn.harness.appserver.LineTransport` playing Codex, which can be
    *stopped* like a SIGSTOPped process: from then on it reads nothing and says nothing."""

    def __init__(self) -> None:
        self._out, self._in = anyio.create_memory_object_stream[bytes](math.inf)
        self.sent: list[Message] = []
        self.stopped = False
        self.killed = False
        self.returncode: int | None = None
        self.handlers: dict[str, Callable[[Message], None]] = {}
        self._turns = itertools.count(1)

    async def send_line(self, line: bytes) -> None:
        if self.returncode is not None:
            raise AppServerClosed("fake codex is dead", returncode=self.returncode)
        message = json.loads(line)
        self.sent.append(message)
        if self.stopped:
            return
        method = message.get("method")
        if method in self.handlers:
            self.handlers[method](message)
        elif method == "initialize":
            self.reply(message, {"userAgent": "fake/1"})
        elif method == "config/read":  # the thread's configured turn defaults: none
            self.reply(message, {"config": {}, "origins": {}})
        elif method == "thread/start":
            self.reply(message, {"thread": {"id": "thread-1"}})
        elif method == "thread/resume":
            self.reply(message, {"thread": {"id": message["params"]["threadId"]}})
        elif method == "turn/start":
            thread, turn = message["params"]["threadId"], f"turn-{next(self._turns)}"
            self.reply(message, {"turn": {"id": turn, "status": "inProgress", "items": []}})
            self.notify("turn/started", threadId=thread, turn={"id": turn})
            self.notify(
                "turn/completed",
                threadId=thread,
                turn={"id": turn, "status": "completed", "items": [], "error": None},
            )
        elif method == LIVENESS_PROBE_METHOD:
            self.reply(message, {"data": [], "nextCursor": None})

    async def receive_line(self) -> bytes:
        try:
            return await self._in.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise AppServerClosed("fake codex exited", returncode=self.returncode) from None

    async def run_background(self) -> None:
        return

    async def aclose(self) -> None:
        self._out.close()

    def kill(self) -> None:
        self.killed = True
        self.returncode = -9
        self._out.close()

    def reply(self, request: Message, result: Any) -> None:
        self._out.send_nowait(json.dumps({"id": request["id"], "result": result}).encode())

    def refuse(self, request: Message, code: int, text: str) -> None:
        error = {"id": request["id"], "error": {"code": code, "message": text}}
        self._out.send_nowait(json.dumps(error).encode())

    def notify(self, method: str, **params: Any) -> None:
        self.emit({"method": method, "params": params})

    def emit(self, message: Message) -> None:
        self._out.send_nowait(json.dumps(message).encode())

    def requests(self, method: str) -> list[Message]:
        return [m for m in self.sent if m.get("method") == method and "id" in m]


@pytest.fixture
def config(tmp_path: Path) -> AppServerConfig:
    return AppServerConfig(
        codex_home=tmp_path / "home",
        write_config=False,
        interrupt_grace=0.2,
        liveness_timeout=LIVENESS,
        request_timeout=5.0,
    )


@pytest.fixture
def fake() -> StoppableCodex:
    return StoppableCodex()


# --- liveness ---------------------------------------------------------------------------------


async def test_a_request_timeout_on_a_live_process_keeps_the_connection(
    config: AppServerConfig, fake: StoppableCodex
) -> None:
    fake.handlers["slow/method"] = lambda request: None  # never answered, process fine
    async with AppServerClient.connect(config, transport=fake) as client:
        with pytest.raises(AppServerTimeout):
            await client.request("slow/method", timeout=0.05)
        assert not client.closed
        assert not fake.killed
        assert len(fake.requests(LIVENESS_PROBE_METHOD)) == 1
        assert (await client.start_thread()).thread_id == "thread-1"


async def test_any_line_during_the_probe_is_a_sign_of_life(
    config: AppServerConfig, fake: StoppableCodex
) -> None:
    fake.handlers["slow/method"] = lambda request: None
    # The probe itself is never answered, but the process is talking (a running turn).
    fake.handlers[LIVENESS_PROBE_METHOD] = lambda request: fake.notify("thread/status/changed")
    async with AppServerClient.connect(config, transport=fake) as client:
        with pytest.raises(AppServerTimeout):
            await client.request("slow/method", timeout=0.05)
        assert not client.closed
        assert not fake.killed


async def test_a_silent_process_is_killed_and_every_pending_call_fails_once(
    config: AppServerConfig, fake: StoppableCodex
) -> None:
    async with AppServerClient.connect(config, transport=fake) as client:
        fake.stopped = True
        timeouts: list[AppServerTimeout] = []
        closed: list[AppServerClosed] = []

        async def short(i: int) -> None:
            try:
                await client.request(f"short/{i}", timeout=0.1)
            except AppServerTimeout as exc:
                timeouts.append(exc)

        async def patient() -> None:
            try:
                await client.request("patient", timeout=60)
            except AppServerClosed as exc:
                closed.append(exc)

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(patient)
            for i in range(3):
                tg.start_soon(short, i)
        elapsed = time.monotonic() - started
        assert len(timeouts) == 3
        assert len(closed) == 1
        assert "declared dead" in str(closed[0])
        assert elapsed < 0.1 + LIVENESS + 1.0  # one missed deadline plus one probe
        assert len(fake.requests(LIVENESS_PROBE_METHOD)) == 1  # one probe for all callers
        assert fake.killed
        assert client.closed


async def test_a_turn_whose_process_goes_silent_times_out_and_the_process_is_killed(
    config: AppServerConfig, fake: StoppableCodex
) -> None:
    def start_then_stop(request: Message) -> None:
        thread = request["params"]["threadId"]
        fake.reply(request, {"turn": {"id": "turn-1", "status": "inProgress", "items": []}})
        fake.notify("turn/started", threadId=thread, turn={"id": "turn-1"})
        fake.stopped = True  # SIGSTOP mid-turn: no interrupt answer, no probe answer

    fake.handlers["turn/start"] = start_then_stop
    async with AppServerClient.connect(config, transport=fake) as client:
        tid = (await client.start_thread()).thread_id
        started = time.monotonic()
        result = await client.run_turn(tid, "hang", idle_timeout=0.1)
        elapsed = time.monotonic() - started
        assert result.outcome is CodexTurnStatus.TIMED_OUT
        assert client.closed
        assert fake.killed
        assert len(fake.requests("turn/interrupt")) == 1
        # idle 0.1 s + interrupt grace 0.2 s + liveness 0.3 s
        assert elapsed < 0.1 + 0.2 + LIVENESS + 1.0


async def test_the_manager_replaces_a_dead_process_and_re_resumes_its_thread(
    config: AppServerConfig,
) -> None:
    fakes: list[StoppableCodex] = []

    async def spawn(_: AppServerConfig) -> StoppableCodex:
        fakes.append(StoppableCodex())
        return fakes[-1]

    fast = attrs.evolve(config, request_timeout=0.1)
    async with AppServer.start(fast, transport_factory=spawn) as server:
        tid = (await server.start_thread(ThreadSettings(developer_instructions="dev"))).thread_id
        fakes[0].stopped = True
        with pytest.raises(AppServerTimeout):  # turn/start got no answer, nor did the probe
            await server.run_turn(tid, "into the void")
        assert fakes[0].killed
        assert server.restarts == 0
        result = await server.run_turn(tid, "on a fresh process")
        assert result.outcome is CodexTurnStatus.COMPLETED
        assert server.restarts == 1
    (resume,) = fakes[1].requests("thread/resume")
    assert resume["params"]["threadId"] == tid
    assert resume["params"]["developerInstructions"] == "dev"
    assert [m["method"] for m in fakes[1].sent if "id" in m][-2:] == ["thread/resume", "turn/start"]


async def test_a_compaction_whose_process_goes_silent_kills_it_instead_of_waiting(
    config: AppServerConfig, fake: StoppableCodex
) -> None:
    def compaction_then_stop(request: Message) -> None:
        thread = request["params"]["threadId"]
        fake.reply(request, {})
        fake.notify("turn/started", threadId=thread, turn={"id": "compaction-1"})
        fake.stopped = True

    fake.handlers["thread/compact/start"] = compaction_then_stop
    async with AppServerClient.connect(config, transport=fake) as client:
        tid = (await client.start_thread()).thread_id
        started = time.monotonic()
        result = await client.compact_thread(tid, timeout=0.1, interrupt_grace=0.1)
        elapsed = time.monotonic() - started
    assert (result.status, result.interrupted, result.retired) == ("timed_out", True, True)
    assert fake.killed  # not the graceful shutdown: a stopped process would ignore it
    assert elapsed < 0.1 + 0.1 + LIVENESS + 1.0


# --- lone surrogates --------------------------------------------------------------------------


def test_encode_message_replaces_lone_surrogates_and_keeps_pairs() -> None:
    line, repaired = encode_message(
        {"a": "x\ud800y", "b": ["\udfff", "\ud83d\ude00", "\ude00\ud83d"], "\udabc": 1}
    )
    assert repaired == 5
    assert json.loads(line.decode("utf-8")) == {
        "a": "x\ufffdy",
        "b": ["\ufffd", "\U0001f600", "\ufffd\ufffd"],
        "\ufffd": 1,
    }
    valid = {"text": "ünïcödé ✓ \U0001f600 \u2028", "n": 1}
    line, repaired = encode_message(valid)
    assert repaired == 0
    assert json.loads(line) == valid
    assert b"\n" not in line


_TEXT = st.lists(st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr)), max_size=30).map(
    "".join
)


@given(_TEXT)
def test_encode_message_is_always_valid_utf8_and_matches_utf16_replacement(text: str) -> None:
    line, _ = encode_message({"text": text})
    # An independent oracle: UTF-16 decoding joins pairs and replaces lone code units.
    expected = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    assert json.loads(line.decode("utf-8"))["text"] == expected


# --- definitive versus transient resume failures ---------------------------------------------


@pytest.mark.parametrize(
    ("code", "message", "definitive"),
    [
        (-32600, "no rollout found for thread id 0199aaaa-0000-7000-8000-000000000000", True),
        (-32600, "invalid session id: invalid character: expected ...", True),
        (-32603, "failed to read thread: thread-store internal error: ...", False),
        (-32600, "expected active turn id nope but found ...", False),
        (-32601, "no rollout found for thread id x", False),
    ],
)
def test_only_codexs_no_such_thread_is_thread_not_found(
    code: int, message: str, definitive: bool
) -> None:
    found = ThreadNotFound.match(AppServerRpcError(code, message, method="thread/resume"), "t")
    assert (found is not None) is definitive
    if found is not None:
        assert (found.thread_id, found.code, found.method) == ("t", code, "thread/resume")


async def test_the_client_maps_no_such_thread_on_resume_and_nothing_else(
    config: AppServerConfig, fake: StoppableCodex
) -> None:
    answers = iter(
        [
            (-32600, "no rollout found for thread id gone"),
            (-32603, "failed to read thread: thread-store internal error"),
        ]
    )
    fake.handlers["thread/resume"] = lambda request: fake.refuse(request, *next(answers))
    async with AppServerClient.connect(config, transport=fake) as client:
        with pytest.raises(ThreadNotFound) as found:
            await client.resume_thread("gone", ThreadSettings(developer_instructions=None))
        assert found.value.thread_id == "gone"
        with pytest.raises(AppServerRpcError) as other:
            await client.resume_thread("broken", ThreadSettings(developer_instructions=None))
        assert not isinstance(other.value, ThreadNotFound)
        fake.handlers["thread/resume"] = lambda request: None
        with pytest.raises(AppServerTimeout):
            await client.resume_thread(
                "slow", ThreadSettings(developer_instructions=None), timeout=0.05
            )
        assert not client.closed  # the probe was answered: a live process is kept


async def test_the_fake_raises_both_kinds_of_resume_failure() -> None:
    server = FakeAppServer()
    tid = (await server.start_thread()).thread_id
    with pytest.raises(ThreadNotFound):
        await server.resume_thread("thread-unknown", ThreadSettings(developer_instructions=None))
    server.resume_error = FakeAppServer.resume_timeout()
    with pytest.raises(AppServerTimeout):
        await server.resume_thread(tid, ThreadSettings(developer_instructions=None))
    server.resume_error = FakeAppServer.not_found(tid)
    with pytest.raises(ThreadNotFound) as found:
        await server.resume_thread(tid, ThreadSettings(developer_instructions=None))
    assert found.value.thread_id == tid
    server.resume_error = None
    assert (
        await server.resume_thread(tid, ThreadSettings(developer_instructions=None))
    ).thread_id == tid


# --- tool arguments are validated ------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
}
ARG_VALUE = "ARGVALUE_fake_only_2c7d"


@pytest.fixture
def private_texts() -> set[str]:
    return {ARG_VALUE}


def recording_tool(calls: list[Any], schema: Any = SCHEMA, name: str = "lookup") -> DynamicTool:
    async def fn(args: dict[str, Any]) -> str:
        calls.append(args)
        return "ran"

    return DynamicTool(name, "Look up.", schema, fn)


async def test_invalid_arguments_never_reach_the_host_function_through_the_fake() -> None:
    calls: list[Any] = []
    invalid = [
        {"city": 5},
        {},
        {"city": ARG_VALUE, "extra": ARG_VALUE},
        {"city": ARG_VALUE, "days": 0},
        [ARG_VALUE],
    ]
    server = FakeAppServer(
        scripts=[
            CodexScript(tool_calls=[*(("lookup", a) for a in invalid), ("lookup", {"city": "x"})])
        ]
    )
    tid = (await server.start_thread(ThreadSettings(tools=[recording_tool(calls)]))).thread_id
    with capture_logs() as records:
        async with server.turn(tid, "go") as handle:
            result = await handle.collect()
    assert result.outcome is CodexTurnStatus.COMPLETED
    assert calls == [{"city": "x"}]
    tool_calls = server.calls_to("tool_call")
    assert [c.args["success"] for c in tool_calls] == [False] * 5 + [True]
    texts = server.tool_outputs[:5]
    assert texts == [
        'invalid arguments for tool lookup: $.city: expected type "string"; it was not run',
        'invalid arguments for tool lookup: $: missing required ["city"]; it was not run',
        "invalid arguments for tool lookup: $: has properties the schema does not declare;"
        " it was not run",
        "invalid arguments for tool lookup: $.days: fails minimum 1; it was not run",
        'invalid arguments for tool lookup: $: expected type "object"; it was not run',
    ]
    invalid_logs = [r for r in records if r["event"] == "appserver.tool.invalid_arguments"]
    assert [r["keyword"] for r in invalid_logs] == [
        "type",
        "required",
        "additionalProperties",
        "minimum",
        "type",
    ]
    assert ARG_VALUE not in repr(records)


async def test_the_schema_dialect_it_declares_is_used() -> None:
    calls: list[Any] = []
    draft7 = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {
            "pair": {"type": "array", "items": [{"type": "string"}, {"type": "integer"}]}
        },
    }
    registry = ToolRegistry([recording_tool(calls, draft7)])
    refused = await registry.call("lookup", {"pair": ["a", "b"]})
    assert refused["success"] is False
    assert "$.pair[1]: expected type" in refused["contentItems"][0]["text"]
    assert (await registry.call("lookup", {"pair": ["a", 1]}))["success"] is True
    assert calls == [{"pair": ["a", 1]}]
    # The same schema is not valid Draft 2020-12 (array-form items): refused at declaration.
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        recording_tool(calls, {k: v for k, v in draft7.items() if k != "$schema"})


async def test_no_arguments_are_an_empty_object_and_an_invalid_schema_is_refused() -> None:
    calls: list[Any] = []
    registry = ToolRegistry([recording_tool(calls, {"type": "object", "properties": {}})])
    assert (await registry.call("lookup", None))["success"] is True
    assert calls == [{}]
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        recording_tool(calls, {"type": "no-such-type"})


@pytest.fixture
def schema_server() -> Iterator[tuple[str, list[str]]]:
    """A local HTTP server that would serve a schema, recording every fetch."""
    fetched: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            fetched.append(self.path)
            body = b'{"type": "string"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/city.json", fetched
    finally:
        httpd.shutdown()
        httpd.server_close()


async def test_a_remote_ref_is_never_fetched_and_its_calls_are_refused(
    schema_server: tuple[str, list[str]],
) -> None:
    url, fetched = schema_server
    calls: list[Any] = []
    schema = {"type": "object", "properties": {"city": {"$ref": url}}}
    registry = ToolRegistry([recording_tool(calls, schema)])
    refused = await registry.call("lookup", {"city": "Paris"})
    assert refused["success"] is False
    assert "cannot be applied" in refused["contentItems"][0]["text"]
    assert calls == []
    assert fetched == []


# --- identifiers of any size are capped -------------------------------------------------------


async def test_huge_identifiers_are_capped_in_logs_and_errors(
    config: AppServerConfig, fake: StoppableCodex
) -> None:
    huge = "t" * 1_000_000
    async with AppServerClient.connect(config, transport=fake) as client:
        with capture_logs() as records:
            await client.resume_thread(
                huge, ThreadSettings(developer_instructions=None)
            )  # echoed back
            fake.handlers["thread/resume"] = lambda request: fake.refuse(
                request, -32600, f"no rollout found for thread id {huge}"
            )
            with pytest.raises(ThreadNotFound) as found:
                await client.resume_thread(huge, ThreadSettings(developer_instructions=None))
            fake.notify("x", threadId=huge)
            fake.emit({"id": huge, "result": {}})
            await client.request(LIVENESS_PROBE_METHOD, {})  # the lines above were read
    assert len(found.value.message) < MAX_MESSAGE_CHARS + 30
    assert found.value.thread_id == huge  # the exception keeps it, for the caller
    longest = max(len(str(value)) for record in records for value in record.values())
    assert longest < MAX_LOGGED_ID_CHARS + 30
    events = {record["event"] for record in records}
    assert {"appserver.thread_resumed", "appserver.thread_not_found"} <= events
    assert "appserver.unexpected_response" in events
