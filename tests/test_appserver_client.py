"""The JSON-RPC client against a tiny fake app-server script (no Codex binary), on both
anyio backends: garbage lines, correlation, typed errors, timeouts, dead-process detection,
server requests (tools, approvals, user input, unknown methods) and per-thread routing."""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from codex_turn.harness.appserver import (
    AppServerClient,
    AppServerClosed,
    AppServerConfig,
    AppServerError,
    AppServerRpcError,
    AppServerStartError,
    AppServerTimeout,
    DynamicTool,
    ToolRegistry,
    ToolResult,
)

FAKE_SERVER = r"""
import json, os, sys

def send(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()

for line in sys.stdin:
    line = line.strip()
    if not line:
        continue
    msg = json.loads(line)
    method, mid = msg.get("method"), msg.get("id")
    if method == "initialize":
        sys.stdout.write("this is not json at all\n")
        sys.stdout.write("[1, 2, 3]\n")
        sys.stdout.write('{"neither": "request nor response"}\n')
        send({"id": mid, "result": {"userAgent": "fake/1", "codexHome": "/x", "extra": 1}})
    elif method == "initialized":
        send({"method": "fake/initialized", "params": {"threadId": "t1"}})
    elif method == "echo":
        sys.stdout.write("garbage {{{\n")
        send({"id": mid, "result": msg.get("params")})
    elif method == "fail":
        send({"id": mid, "error": {"code": -32600, "message": "Not allowed"}})
    elif method == "hang":
        pass
    elif method == "thread/loaded/list":  # the liveness probe after a missed deadline
        send({"id": mid, "result": {"data": [], "nextCursor": None}})
    elif method == "die":
        os._exit(3)
    elif method == "notify":
        for thread in ("t1", "t2", "t1"):
            send({"method": "thing/happened", "params": {"threadId": thread}})
        send({"id": mid, "result": {}})
    elif method == "server_requests":
        t = {"threadId": "t1", "turnId": "u1"}
        send({"id": 0, "method": "item/commandExecution/requestApproval",
              "params": dict(t, itemId="i", command="rm -rf /")})
        send({"id": 1, "method": "item/tool/requestUserInput",
              "params": dict(t, itemId="i", questions=[])})
        send({"id": 2, "method": "some/unknownRequest", "params": {}})
        send({"id": 3, "method": "item/tool/call",
              "params": dict(t, callId="c1", tool="adder", arguments={"a": 2, "b": 3})})
        send({"id": 4, "method": "item/tool/call",
              "params": dict(t, callId="c2", tool="boom", arguments={})})
        send({"id": 5, "method": "item/tool/call",
              "params": dict(t, callId="c3", tool="missing", arguments={})})
        send({"id": 6, "method": "execCommandApproval", "params": {}})
        send({"id": mid, "result": {}})
    elif mid is not None and ("result" in msg or "error" in msg):
        send({"method": "test/answer", "params": {"threadId": "t1", "answer": msg}})
"""


pytestmark = pytest.mark.both_backends


@pytest.fixture
def fake_config(tmp_path: Path) -> AppServerConfig:
    script = tmp_path / "fake_app_server.py"
    script.write_text(FAKE_SERVER)
    return AppServerConfig(
        codex_home=tmp_path / "home",
        write_config=False,
        command=(sys.executable, "-u", str(script)),
        request_timeout=5.0,
        shutdown_timeout=2.0,
    )


@pytest.fixture
async def client(fake_config: AppServerConfig) -> AsyncIterator[AppServerClient]:
    async with AppServerClient.connect(fake_config, sent_log=[]) as c:
        yield c


@pytest.mark.anyio
async def test_garbage_lines_do_not_kill_the_client(client: AppServerClient) -> None:
    assert client.initialize_result is not None
    assert client.initialize_result.user_agent == "fake/1"
    assert client.garbage_lines == 3
    assert await client.request("echo", {"x": 1}) == {"x": 1}
    assert client.garbage_lines == 4
    # Concurrent requests are correlated by id.
    results: dict[int, Any] = {}

    async def one(i: int) -> None:
        results[i] = await client.request("echo", {"i": i})

    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(one, i)
    assert results == {i: {"i": i} for i in range(20)}
    assert [m["method"] for m in client.sent[:2]] == ["initialize", "initialized"]
    assert client.sent[0]["params"]["capabilities"] == {"experimentalApi": True}


@pytest.mark.anyio
async def test_rpc_error_and_timeout_are_typed(client: AppServerClient) -> None:
    with pytest.raises(AppServerRpcError) as info:
        await client.request("fail")
    assert info.value.code == -32600
    assert info.value.message == "Not allowed"
    assert isinstance(info.value, AppServerError)
    with pytest.raises(AppServerTimeout):
        await client.request("hang", timeout=0.2)
    assert await client.request("echo", {"still": "alive"}) == {"still": "alive"}


@pytest.mark.anyio
async def test_dead_process_fails_every_pending_request_at_once(client: AppServerClient) -> None:
    failures: list[BaseException] = []

    async def hang() -> None:
        try:
            await client.request("hang", timeout=30)
        except AppServerClosed as exc:
            failures.append(exc)

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(hang)
        await anyio.sleep(0.05)
        with pytest.raises(AppServerClosed) as info:
            await client.request("die", timeout=30)
    assert time.monotonic() - started < 1.0
    assert len(failures) == 3
    assert info.value.returncode == 3
    assert client.closed
    with pytest.raises(AppServerClosed):
        await client.request("echo", {})
    with pytest.raises(AppServerClosed), client.subscribe("t1"):
        pass


@pytest.mark.anyio
async def test_notifications_are_routed_per_thread(client: AppServerClient) -> None:
    seen_all: list[str] = []
    client.add_listener(
        lambda n: seen_all.append(str(n.thread_id)) if n.method == "thing/happened" else None
    )
    with client.subscribe("t1") as t1, client.subscribe("t2") as t2:
        await client.request("notify")
        got1: list[Any] = []
        with anyio.fail_after(5):
            while len(got1) < 2:
                n = await t1.receive()
                if n.method == "thing/happened":
                    got1.append(n)
            got2 = [await t2.receive()]
    assert [n.thread_id for n in got1] == ["t1", "t1"]
    assert [n.thread_id for n in got2] == ["t2"]
    assert seen_all == ["t1", "t2", "t1"]


@pytest.mark.anyio
async def test_server_requests_tools_approvals_and_unknown(client: AppServerClient) -> None:
    calls: list[dict[str, Any]] = []

    async def adder(args: dict[str, Any]) -> str:
        calls.append(args)
        return str(args["a"] + args["b"])

    async def boom(args: dict[str, Any]) -> ToolResult:
        raise ValueError("kaboom")

    schema = {"type": "object", "properties": {}}
    client.register_tools(
        "t1",
        ToolRegistry(
            [DynamicTool("adder", "add", schema, adder), DynamicTool("boom", "fails", schema, boom)]
        ),
    )
    answers: dict[int, dict[str, Any]] = {}
    with client.subscribe("t1") as stream:
        await client.request("server_requests")
        with anyio.fail_after(5):
            while len(answers) < 7:
                n = await stream.receive()
                if n.method == "test/answer":
                    answers[n.params["answer"]["id"]] = n.params["answer"]
    assert answers[0]["result"] == {"decision": "decline"}
    assert answers[1]["result"] == {"answers": {}}
    assert answers[2]["error"]["code"] == -32601
    assert answers[3]["result"] == {
        "contentItems": [{"type": "inputText", "text": "5"}],
        "success": True,
    }
    assert calls == [{"a": 2, "b": 3}]
    assert answers[4]["result"]["success"] is False
    assert "kaboom" in answers[4]["result"]["contentItems"][0]["text"]
    assert answers[5]["result"]["success"] is False
    assert answers[6]["result"] == {"decision": "denied"}
    assert client.server_requests[3] == "item/tool/call"


@pytest.mark.anyio
async def test_start_errors_are_typed(tmp_path: Path) -> None:
    missing = AppServerConfig(
        codex_home=tmp_path / "h", write_config=False, command=(str(tmp_path / "nope"),)
    )
    with pytest.raises(AppServerStartError):
        async with AppServerClient.connect(missing):
            pass
    exits = AppServerConfig(
        codex_home=tmp_path / "h",
        write_config=False,
        command=(sys.executable, "-c", "import sys; sys.exit(7)"),
    )
    with pytest.raises(AppServerStartError):
        async with AppServerClient.connect(exits):
            pass


def test_config_toml_is_offline_safe(tmp_path: Path) -> None:
    import tomllib

    cfg = AppServerConfig.offline(
        tmp_path / "home",
        "http://127.0.0.1:9/v1",
        compact_prompt='say "hi"\n',
        extra_config={"features": {"plugins": True, "goals": False}, "history": {"x": 1}},
    )
    path = cfg.write()
    assert path is not None
    data = tomllib.loads(path.read_text())
    assert data["features"]["plugins"] is False  # not negotiable
    assert data["features"]["goals"] is False
    assert data["analytics"]["enabled"] is False
    assert data["feedback"]["enabled"] is False
    assert data["check_for_update_on_startup"] is False
    assert data["model_provider"] == "offline"
    provider = data["model_providers"]["offline"]
    assert provider["base_url"] == "http://127.0.0.1:9/v1"
    assert provider["request_max_retries"] == 0
    assert provider["stream_max_retries"] == 0
    assert data["compact_prompt"] == 'say "hi"\n'
    env = cfg.environment()
    assert env["CODEX_HOME"] == str(tmp_path / "home")
    assert "RUST_LOG" not in env
    assert env["PATH"].split(":")[0].endswith("codex-path")
