"""A turn's own sandbox / approval policy never outlives its host process.

Codex keeps ``turn/start``'s approval policy and sandbox on the thread and restores them from
the rollout when a later process resumes it. A new host process knows nothing of the earlier
one, so the thread's defaults come from Codex's configuration (``config/read``), not from what
the resume reported: its next turn without settings sends the configured default explicitly.

Each "host process" is a real Python subprocess with its own ``codex app-server`` on the same
``CODEX_HOME`` and session file; the offline model (in this process) scripts the tool calls.
What ran (files outside the workspace), whether the host was asked, and what ``turn/start``
carried are asserted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest
from structlog.testing import capture_logs

from codex_turn.harness.appserver import AppServerClient, AppServerConfig, ThreadSettings
from codex_turn.harness.appserver.errors import AppServerClosed
from codex_turn.harness.appserver.threads import _thread_defaults, configured_defaults
from codex_turn.testing import OfflineModel, Reply

ROOT = Path(__file__).parent.parent

# argv: a JSON spec. Runs one turn in its own app-server and prints one JSON line.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import anyio

    import codex_turn
    from codex_turn import AppServer, AppServerConfig, TurnHooks, TurnParams, run_codex_turn
    from codex_turn.harness.runtime_controls import ApprovalDecision

    spec = json.loads(sys.argv[1])
    codex_turn.configure_logging(level="WARNING", format="json")
    asked = []


    async def decline(request):
        asked.append(request.item_id)
        return ApprovalDecision.DECLINE


    async def main():
        config = AppServerConfig.offline(
            Path(spec["codex_home"]),
            spec["base_url"],
            env=spec["env"],
            codex_bin=Path(spec["codex_bin"]),
            home=Path(spec["home"]),
            request_timeout=30.0,
            approval_policy="on-request",  # sandbox: read-only
        )
        params = TurnParams(
            session_id="restart",
            session_file=Path(spec["session_file"]),
            workspace_dir=Path(spec["workspace"]),
            prompt=spec["prompt"],
            **spec["settings"],
        )
        async with AppServer.start(config, record_sent=True) as server:
            with anyio.fail_after(60):
                result = await run_codex_turn(
                    params, app_server=server, hooks=TurnHooks(on_approval=decline)
                )
            methods = [m.get("method") for m in server.sent if m.get("method")]
            starts = [m["params"] for m in server.sent if m.get("method") == "turn/start"]
        sticky = ("approvalPolicy", "sandboxPolicy", "effort")
        print(json.dumps({
            "outcome": result.outcome.value,
            "thread_id": result.thread_id,
            "methods": methods,
            "turn_start": {k: v for k, v in starts[-1].items() if k in sticky},
            "asked": asked,
        }), flush=True)


    anyio.run(main)
    """
)


def _host_turn(tmp_path: Path, spec: dict[str, Any]) -> dict[str, Any]:
    script = tmp_path / "host_turn.py"
    if not script.exists():
        script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, (proc.stdout, proc.stderr[-4000:])
    report: dict[str, Any] = json.loads(lines[0])
    return report


def _touch(call_id: str, path: Path, *, escalate: bool = False) -> Reply:
    arguments: dict[str, Any] = {"cmd": f"touch {path} && echo ok", "yield_time_ms": 2000}
    if escalate:
        arguments["sandbox_permissions"] = "require_escalated"
        arguments["justification"] = "Allow writing outside the workspace?"
    return Reply.function_call("exec_command", arguments, call_id=call_id)


@pytest.mark.codex
def test_a_turns_elevated_policy_does_not_outlive_its_host_process(
    tmp_path: Path, offline_model: OfflineModel, codex_binary: Path
) -> None:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "home").mkdir()
    base = {
        "codex_home": str(tmp_path / "codex_home"),
        "base_url": offline_model.base_url,
        "env": dict(offline_model.proxy_env()),
        "codex_bin": str(codex_binary),
        "home": str(tmp_path / "home"),
        "session_file": str(tmp_path / "session.jsonl"),
        "workspace": str(workspace),
    }
    offline_model.script(
        _touch("p1", outside / "first"),
        Reply.fixed("one"),
        _touch("p2", outside / "second"),
        _touch("e2", outside / "escalated", escalate=True),
        Reply.fixed("two"),
    )

    # Host process 1: one turn with full access and no approvals.
    first = _host_turn(
        tmp_path,
        {
            **base,
            "prompt": "elevated turn",
            "settings": {"sandbox": "danger-full-access", "approval_policy": "never"},
        },
    )
    assert first["outcome"] == "completed"
    assert first["turn_start"]["sandboxPolicy"] == {"type": "dangerFullAccess"}
    assert (outside / "first").exists()  # it really ran with full access

    # Host process 2, same CODEX_HOME and session: a turn that states nothing.
    second = _host_turn(tmp_path, {**base, "prompt": "plain turn", "settings": {}})
    assert second["outcome"] == "completed"
    assert second["thread_id"] == first["thread_id"]
    assert "thread/resume" in second["methods"]
    # The configured defaults go out explicitly: the rollout restored the elevated ones.
    assert second["turn_start"]["approvalPolicy"] == "on-request"
    assert second["turn_start"]["sandboxPolicy"]["type"] == "readOnly"
    assert not (outside / "second").exists()  # read-only again
    assert second["asked"] == ["e2"]  # the host is asked again
    assert not (outside / "escalated").exists()
    assert second["methods"].count("config/read") == 1  # once per app-server and cwd


# --- where the defaults come from ----------------------------------------------------------------


def test_the_configuration_gives_the_turn_start_fields() -> None:
    assert configured_defaults({}) == {}
    assert configured_defaults(
        {
            "approval_policy": "on-request",
            "sandbox_mode": "read-only",
            "model_reasoning_effort": None,
        }
    ) == {"approvalPolicy": "on-request", "sandboxPolicy": {"type": "readOnly"}}
    granular = {"granular": {"mcp_elicitations": True, "rules": False, "sandbox_approval": True}}
    assert configured_defaults(
        {
            "approval_policy": granular,
            "sandbox_mode": "workspace-write",
            "sandbox_workspace_write": {"writable_roots": ["/data"], "network_access": True},
            "model_reasoning_effort": "low",
        }
    ) == {
        "effort": "low",
        "approvalPolicy": granular,
        "sandboxPolicy": {
            "type": "workspaceWrite",
            "writableRoots": ["/data"],
            "networkAccess": True,
        },
    }
    assert configured_defaults({"sandbox_mode": "danger-full-access"}) == {
        "sandboxPolicy": {"type": "dangerFullAccess"}
    }


def test_a_load_reporting_other_values_than_the_configuration_is_marked_overridden() -> None:
    configured = {"approvalPolicy": "on-request", "sandboxPolicy": {"type": "readOnly"}}
    restored = {"approvalPolicy": "never", "sandboxPolicy": {"type": "dangerFullAccess"}}
    defaults, overridden = _thread_defaults(configured, restored)
    assert defaults == configured
    assert overridden == {"approvalPolicy", "sandboxPolicy"}
    # Codex's own rendering of the configured mode is kept (and is no override).
    rendered = {
        "approvalPolicy": "on-request",
        "sandboxPolicy": {"type": "readOnly", "networkAccess": False},
    }
    defaults, overridden = _thread_defaults(configured, rendered)
    assert defaults == rendered
    assert overridden == frozenset()
    # A field the configuration leaves unset: the load's report (Codex's built-in default).
    defaults, overridden = _thread_defaults({}, {"effort": "high", "approvalPolicy": "never"})
    assert defaults == {"effort": "high", "approvalPolicy": "never"}
    assert overridden == frozenset()
    # A field the load sent itself is the thread's default as Codex reports it.
    defaults, overridden = _thread_defaults(configured, restored, sent=("sandboxPolicy",))
    assert defaults["sandboxPolicy"] == {"type": "dangerFullAccess"}
    assert overridden == {"approvalPolicy"}
    # No configuration known (config/read refused): the report, as before.
    assert _thread_defaults(None, restored) == (restored, frozenset())


class ConfigCodex:
    """A transport playing Codex: ``config/read`` answers ``config`` (or is refused when it is
    ``None``); every thread load reports an elevated policy, as a resume restoring an earlier
    turn's override does."""

    RESTORED: ClassVar[dict[str, Any]] = {
        "approvalPolicy": "never",
        "sandbox": {"type": "dangerFullAccess"},
    }

    def __init__(self, config: dict[str, Any] | None) -> None:
        self.config = config
        self.methods: list[str] = []
        self.returncode: int | None = None
        self._out, self._in = anyio.create_memory_object_stream[bytes](math.inf)

    async def send_line(self, line: bytes) -> None:
        message = json.loads(line)
        if "id" not in message:
            return
        method = message["method"]
        self.methods.append(method)
        reply: dict[str, Any] = {"result": {}}
        if method == "initialize":
            reply = {"result": {"userAgent": "fake/1"}}
        elif method == "config/read":
            if self.config is None:
                reply = {"error": {"code": -32601, "message": "method not found"}}
            else:
                reply = {"result": {"config": self.config, "origins": {}}}
        elif method == "thread/resume":
            thread = {"id": message["params"]["threadId"]}
            reply = {"result": {"thread": thread, **self.RESTORED}}
        self._out.send_nowait(json.dumps({"id": message["id"], **reply}).encode())

    async def receive_line(self) -> bytes:
        try:
            return await self._in.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise AppServerClosed("fake codex exited") from None

    async def run_background(self) -> None:
        return

    async def aclose(self) -> None:
        self._out.close()

    def kill(self) -> None:
        self._out.close()


async def _resume_two(fake: ConfigCodex, tmp_path: Path) -> AppServerClient:
    config = AppServerConfig(codex_home=tmp_path / "home", write_config=False)
    async with AppServerClient.connect(config, transport=fake) as client:
        for thread_id in ("t1", "t2"):
            await client.resume_thread(
                thread_id, ThreadSettings(developer_instructions="x", cwd="/w")
            )
        return client


@pytest.mark.anyio
async def test_a_resume_takes_the_configured_defaults_once_per_cwd(tmp_path: Path) -> None:
    fake = ConfigCodex({"approval_policy": "on-request", "sandbox_mode": "read-only"})
    client = await _resume_two(fake, tmp_path)
    assert fake.methods.count("config/read") == 1
    for thread_id in ("t1", "t2"):
        loaded = client.loaded_thread(thread_id)
        assert loaded is not None
        assert loaded.defaults == {
            "approvalPolicy": "on-request",
            "sandboxPolicy": {"type": "readOnly"},
        }
        assert loaded.overridden == {"approvalPolicy", "sandboxPolicy"}  # sent on the next turn


@pytest.mark.anyio
async def test_without_config_read_the_defaults_fall_back_to_the_report(tmp_path: Path) -> None:
    fake = ConfigCodex(None)  # an older binary
    with capture_logs() as records:
        client = await _resume_two(fake, tmp_path)
    assert fake.methods.count("config/read") == 1  # refused once, not asked again
    assert [r["event"] for r in records].count("appserver.config_read_failed") == 1
    loaded = client.loaded_thread("t1")
    assert loaded is not None
    assert loaded.defaults == {
        "approvalPolicy": "never",
        "sandboxPolicy": {"type": "dangerFullAccess"},
    }
    assert loaded.overridden == frozenset()
