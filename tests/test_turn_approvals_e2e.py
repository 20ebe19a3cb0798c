"""File-change and MCP-tool approvals, end to end against the real ``codex app-server``.

The command approvals are covered in ``test_turn_runtime_controls.py``; these are the other two
kinds the bridge (``TurnHooks.on_approval``) hands to the host. Each turn runs
``run_codex_turn`` against the pinned binary and the offline model, which scripts the model's
tool calls; what ran (a file in the workspace, a ``tools/call`` the MCP server received), what
the model was told (its ``function_call_output``) and what went over JSON-RPC are asserted,
not only what the callback saw.

How Codex 0.163 is made to ask, offline (found against the binary):

* **File change.** With the offline model (``mock-model``) Codex offers no ``apply_patch``
  tool (neither ``include_apply_patch_tool = true`` nor ``features.apply_patch_freeform`` adds
  one; the tool list is ``exec_command, write_stdin, request_user_input, view_image, ...``).
  But ``exec_command`` intercepts an ``apply_patch`` heredoc (``apply_patch <<'EOF' ...``)
  and runs it as a patch: under approval policy ``on-request`` and a read-only sandbox a patch
  that writes into the workspace is not runnable in the sandbox, so Codex sends
  ``item/fileChange/requestApproval`` (``{threadId, turnId, itemId, startedAtMs, reason:
  null, grantRoot: null}``; the item id is the model's ``call_id``) and applies the patch
  itself once approved. No ``sandbox_permissions`` escalation is needed, unlike commands.
* **MCP tool.** A stdio MCP server registered in config.toml (``[mcp_servers.notes]`` with
  ``command``/``args``) is offered to the model as a Responses-API namespace
  ``mcp__notes`` holding the server's tools by their own names; the model calls
  ``{"name": "record_note", "namespace": "mcp__notes"}``. A tool whose annotations do not
  say ``readOnlyHint: true`` (here ``destructiveHint: true``) makes Codex ask first with
  ``mcpServer/elicitation/request`` (``mode: "form"``, an empty ``requestedSchema``,
  ``message: 'Allow the notes MCP server to run tool "record_note"?'`` and ``_meta``
  ``{codex_approval_kind: "mcp_tool_call", persist: ["session", "always"],
  tool_description, tool_params, tool_params_display}``, plus ``tool_title`` only when the
  tool declares a ``title``); a read-only tool runs without asking. There is no
  ``_meta.tool_name``: the bridge reads the tool's name from that question. An ``accept``
  with ``_meta.persist: "session"`` covers the tool's later calls; ``cancel`` is only a
  decline here (the model is told "user cancelled MCP tool call" and the turn goes on),
  whereas a cancelled command or file change interrupts the turn.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from codex_turn import AppServer, AppServerConfig, TurnHooks, TurnOutcome, TurnParams, TurnResult
from codex_turn import run_codex_turn as _run_codex_turn
from codex_turn.harness.appserver.server_requests import approval_request
from codex_turn.harness.runtime_controls import ApprovalDecision, ApprovalKind, ApprovalRequest
from codex_turn.testing import OfflineModel, Reply

pytestmark = pytest.mark.anyio


# --- helpers ------------------------------------------------------------------------------------


class Approver:
    """Records every request and answers each with ``decision``."""

    def __init__(self, decision: ApprovalDecision) -> None:
        self.decision = decision
        self.requests: list[ApprovalRequest] = []

    async def __call__(self, request: ApprovalRequest) -> ApprovalDecision:
        self.requests.append(request)
        return self.decision


@pytest.fixture
def params(tmp_path: Path, workspace: Path) -> Callable[..., TurnParams]:
    def make(**overrides: Any) -> TurnParams:
        values: dict[str, Any] = {
            "session_id": "session-approvals",
            "session_file": tmp_path / "session-approvals.jsonl",
            "workspace_dir": workspace,
            "prompt": "please do it",
            "approval_policy": "on-request",
            "sandbox": "read-only",
        }
        values.update(overrides)
        return TurnParams(**values)

    return make


async def run_codex_turn(params: TurnParams, **kwargs: Any) -> TurnResult:
    with anyio.fail_after(60):  # never hangs
        return await _run_codex_turn(params, **kwargs)


def tool_output(model: OfflineModel, call_id: str) -> str:
    """The text the model got back for ``call_id`` (parts of a list output joined)."""
    for request in reversed(model.turn_requests()):
        for item in request.function_call_outputs:
            if item.get("call_id") == call_id:
                output = item.get("output")
                if isinstance(output, list):
                    return "\n".join(str(part.get("text", "")) for part in output)
                return output if isinstance(output, str) else json.dumps(output)
    raise AssertionError(f"the model never got the output of {call_id}")


def answers_sent(server: AppServer, method: str) -> list[dict[str, Any]]:
    """The results we sent to Codex's requests of ``method``, in order."""
    ids = {msg_id for msg_id, m in server.server_requests.items() if m == method}
    return [m["result"] for m in server.sent if m.get("id") in ids and "result" in m]


def triggers(result: TurnResult) -> list[str]:
    return [entry.trigger for entry in result.trace]


# --- file changes -------------------------------------------------------------------------------

FILE_CHANGE = "item/fileChange/requestApproval"
ADD = "*** Begin Patch\n*** Add File: notes.txt\n+first line\n*** End Patch\n"
UPDATE = (
    "*** Begin Patch\n*** Update File: notes.txt\n@@\n-first line\n+second line\n*** End Patch\n"
)


def patch(call_id: str, body: str = ADD) -> Reply:
    """The model runs ``apply_patch`` through ``exec_command``: Codex intercepts it as a patch."""
    command = f"apply_patch <<'EOF'\n{body}EOF\n"
    return Reply.function_call(
        "exec_command", {"cmd": command, "yield_time_ms": 2000}, call_id=call_id
    )


@pytest.mark.codex
async def test_no_apply_patch_tool_is_offered_exec_command_carries_the_patch(
    appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    """Why the patch goes through ``exec_command``: the offline model gets no patch tool."""
    offline_model.script(Reply.fixed("ok"))
    result = await run_codex_turn(params(), app_server=appserver)
    assert result.outcome is TurnOutcome.COMPLETED
    names = offline_model.turn_requests()[-1].tool_names
    assert "exec_command" in names
    assert "apply_patch" not in names


@pytest.mark.codex
async def test_an_approved_file_change_is_applied(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    workspace: Path,
) -> None:
    offline_model.script(patch("call_p1"), Reply.fixed("Patched."))
    approver = Approver(ApprovalDecision.APPROVE)
    result = await run_codex_turn(
        params(), app_server=appserver, hooks=TurnHooks(on_approval=approver)
    )
    assert result.outcome is TurnOutcome.COMPLETED
    assert result.assistant_text == "Patched."
    (request,) = approver.requests
    assert request.kind is ApprovalKind.FILE_CHANGE
    assert request.method == FILE_CHANGE
    assert request.thread_id == result.thread_id
    assert request.turn_id == result.turn_id
    assert request.item_id == "call_p1"
    assert request.session_approval_offered
    assert (workspace / "notes.txt").read_text() == "first line\n"
    assert "Success. Updated the following files:\nA notes.txt" in tool_output(
        offline_model, "call_p1"
    )
    assert answers_sent(appserver, FILE_CHANGE) == [{"decision": "accept"}]


@pytest.mark.codex
@pytest.mark.parametrize("with_callback", [True, False])
async def test_a_declined_file_change_is_not_applied_and_the_turn_continues(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    workspace: Path,
    with_callback: bool,
) -> None:
    offline_model.script(patch("call_p1"), Reply.fixed("Left it alone."))
    approver = Approver(ApprovalDecision.DECLINE)
    hooks = TurnHooks(on_approval=approver) if with_callback else TurnHooks()
    result = await run_codex_turn(params(), app_server=appserver, hooks=hooks)
    assert result.outcome is TurnOutcome.COMPLETED
    assert result.assistant_text == "Left it alone."  # the model was called again
    assert [r.kind for r in approver.requests] == ([ApprovalKind.FILE_CHANGE] * with_callback)
    assert not (workspace / "notes.txt").exists()
    assert "patch rejected by user" in tool_output(offline_model, "call_p1")
    assert answers_sent(appserver, FILE_CHANGE) == [{"decision": "decline"}]


@pytest.mark.codex
async def test_approve_for_session_covers_the_next_change_to_the_same_file(
    appserver: AppServer,
    codex_schema: Any,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    workspace: Path,
) -> None:
    offline_model.script(patch("call_p1"), patch("call_p2", UPDATE), Reply.fixed("Twice."))
    approver = Approver(ApprovalDecision.APPROVE_FOR_SESSION)
    result = await run_codex_turn(
        params(), app_server=appserver, hooks=TurnHooks(on_approval=approver)
    )
    assert result.outcome is TurnOutcome.COMPLETED
    # Codex's session cache covers the second patch to the same file: asked once.
    assert [r.item_id for r in approver.requests] == ["call_p1"]
    assert answers_sent(appserver, FILE_CHANGE) == [{"decision": "acceptForSession"}]
    assert (workspace / "notes.txt").read_text() == "second line\n"
    assert "A notes.txt" in tool_output(offline_model, "call_p1")
    assert "M notes.txt" in tool_output(offline_model, "call_p2")
    codex_schema.validate_sent(appserver.sent, appserver.server_requests)


@pytest.mark.codex
async def test_cancel_on_a_file_change_interrupts_the_turn(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    workspace: Path,
) -> None:
    offline_model.script(patch("call_p1"), Reply.fixed("never sent"))
    approver = Approver(ApprovalDecision.CANCEL)
    result = await run_codex_turn(
        params(), app_server=appserver, hooks=TurnHooks(on_approval=approver)
    )
    assert len(approver.requests) == 1
    # As for commands: declined, and Codex interrupts the turn (the model is not called again).
    assert result.outcome is TurnOutcome.ABORTED
    assert "turn_aborted" in triggers(result)
    assert len(offline_model.turn_requests()) == 1
    assert not (workspace / "notes.txt").exists()
    assert answers_sent(appserver, FILE_CHANGE) == [{"decision": "cancel"}]


# --- MCP tools ----------------------------------------------------------------------------------

ELICITATION = "mcpServer/elicitation/request"

#: A minimal stdio MCP server (newline-delimited JSON-RPC): ``initialize``, ``tools/list`` with
#: a tool that writes (``record_note``, destructive) and one that only reads (``read_notes``),
#: and ``tools/call``. Every message it receives is appended to the log file (argv[1]).
MCP_SERVER = textwrap.dedent(
    """
    import json
    import sys

    TOOLS = [
        {
            "name": "record_note",
            "description": "Record a note.",
            "inputSchema": {
                "type": "object",
                "properties": {"text": {"type": "string"}},
                "required": ["text"],
            },
            "annotations": {"readOnlyHint": False, "destructiveHint": True},
        },
        {
            "name": "read_notes",
            "description": "Read the notes.",
            "inputSchema": {"type": "object", "properties": {}},
            "annotations": {"readOnlyHint": True},
        },
    ]

    with open(sys.argv[1], "a", buffering=1) as log:
        for line in sys.stdin:
            message = json.loads(line)
            log.write(json.dumps(message) + "\\n")
            if "id" not in message:
                continue  # a notification
            method, params = message.get("method"), message.get("params") or {}
            if method == "initialize":
                result = {
                    "protocolVersion": params.get("protocolVersion", "2025-06-18"),
                    "capabilities": {"tools": {}},
                    "serverInfo": {"name": "notes", "version": "1.0"},
                }
            elif method == "tools/list":
                result = {"tools": TOOLS}
            elif method == "tools/call":
                text = params["name"] + " ran with " + json.dumps(params.get("arguments"))
                result = {"content": [{"type": "text", "text": text}], "isError": False}
            elif method == "ping":
                result = {}
            else:
                error = {"code": -32601, "message": "method not found"}
                reply = {"jsonrpc": "2.0", "id": message["id"], "error": error}
                print(json.dumps(reply), flush=True)
                continue
            print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}), flush=True)
    """
)


class NotesServer:
    """The MCP server's script and the log of what it received."""

    def __init__(self, root: Path) -> None:
        self.script = root / "notes_mcp_server.py"
        self.script.write_text(MCP_SERVER)
        self.log = root / "notes_mcp_server.log"

    def config(self) -> dict[str, Any]:
        return {"command": sys.executable, "args": [str(self.script), str(self.log)]}

    def calls(self) -> list[dict[str, Any]]:
        """The ``tools/call`` params the server received."""
        if not self.log.exists():
            return []
        messages = [json.loads(line) for line in self.log.read_text().splitlines() if line]
        return [m["params"] for m in messages if m.get("method") == "tools/call"]


@pytest.fixture
def notes(tmp_path: Path) -> NotesServer:
    return NotesServer(tmp_path)


@pytest.fixture
async def mcp_appserver(
    make_appserver_config: Callable[..., AppServerConfig], notes: NotesServer
) -> AsyncIterator[AppServer]:
    config = make_appserver_config(extra_config={"mcp_servers": {"notes": notes.config()}})
    async with AppServer.start(config, record_sent=True) as server:
        yield server


def mcp_call(call_id: str, tool: str = "record_note", **arguments: Any) -> Reply:
    return Reply.function_call(tool, arguments, call_id=call_id, namespace="mcp__notes")


@pytest.mark.codex
async def test_the_mcp_tools_are_offered_in_their_server_namespace(
    mcp_appserver: AppServer, offline_model: OfflineModel, params: Callable[..., TurnParams]
) -> None:
    offline_model.script(Reply.fixed("ok"))
    await run_codex_turn(params(), app_server=mcp_appserver)
    tools = offline_model.turn_requests()[-1].body["tools"]
    (namespace,) = [t for t in tools if t.get("name") == "mcp__notes"]
    assert namespace["type"] == "namespace"
    assert sorted(t["name"] for t in namespace["tools"]) == ["read_notes", "record_note"]


@pytest.mark.codex
async def test_an_approved_mcp_tool_call_reaches_the_server(
    mcp_appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    notes: NotesServer,
) -> None:
    offline_model.script(mcp_call("call_m1", text="buy milk"), Reply.fixed("Noted."))
    approver = Approver(ApprovalDecision.APPROVE)
    result = await run_codex_turn(
        params(), app_server=mcp_appserver, hooks=TurnHooks(on_approval=approver)
    )
    assert result.outcome is TurnOutcome.COMPLETED
    assert result.assistant_text == "Noted."
    (request,) = approver.requests
    assert request.kind is ApprovalKind.MCP_TOOL
    assert request.method == ELICITATION
    assert request.thread_id == result.thread_id
    assert request.turn_id == result.turn_id
    assert (request.server_name, request.tool_name) == ("notes", "record_note")
    assert request.message is not None
    assert '"record_note"' in request.message
    assert request.session_approval_offered  # persist: ["session", "always"]
    assert request.params["_meta"]["tool_params"] == {"text": "buy milk"}
    assert [(c["name"], c["arguments"]) for c in notes.calls()] == [
        ("record_note", {"text": "buy milk"})
    ]
    assert 'record_note ran with {"text": "buy milk"}' in tool_output(offline_model, "call_m1")
    assert answers_sent(mcp_appserver, ELICITATION) == [{"action": "accept", "content": {}}]


@pytest.mark.codex
@pytest.mark.parametrize("with_callback", [True, False])
async def test_a_declined_mcp_tool_call_never_reaches_the_server(
    mcp_appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    notes: NotesServer,
    with_callback: bool,
) -> None:
    offline_model.script(mcp_call("call_m1", text="buy milk"), Reply.fixed("Skipped."))
    approver = Approver(ApprovalDecision.DECLINE)
    hooks = TurnHooks(on_approval=approver) if with_callback else TurnHooks()
    result = await run_codex_turn(params(), app_server=mcp_appserver, hooks=hooks)
    assert result.outcome is TurnOutcome.COMPLETED
    assert result.assistant_text == "Skipped."  # the model was called again
    assert [r.kind for r in approver.requests] == ([ApprovalKind.MCP_TOOL] * with_callback)
    assert notes.calls() == []
    assert "user rejected MCP tool call" in tool_output(offline_model, "call_m1")
    assert answers_sent(mcp_appserver, ELICITATION) == [{"action": "decline"}]


@pytest.mark.codex
async def test_approve_for_session_covers_the_next_call_of_the_same_mcp_tool(
    mcp_appserver: AppServer,
    codex_schema: Any,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    notes: NotesServer,
) -> None:
    offline_model.script(
        mcp_call("call_m1", text="one"), mcp_call("call_m2", text="two"), Reply.fixed("Both.")
    )
    approver = Approver(ApprovalDecision.APPROVE_FOR_SESSION)
    result = await run_codex_turn(
        params(), app_server=mcp_appserver, hooks=TurnHooks(on_approval=approver)
    )
    assert result.outcome is TurnOutcome.COMPLETED
    # The answer carries ``_meta.persist: "session"``: Codex does not ask for the second call.
    assert len(approver.requests) == 1
    assert answers_sent(mcp_appserver, ELICITATION) == [
        {"action": "accept", "content": {}, "_meta": {"persist": "session"}}
    ]
    assert [c["arguments"] for c in notes.calls()] == [{"text": "one"}, {"text": "two"}]
    assert "record_note ran with" in tool_output(offline_model, "call_m2")
    codex_schema.validate_sent(mcp_appserver.sent, mcp_appserver.server_requests)


@pytest.mark.codex
async def test_cancel_on_an_mcp_tool_call_declines_it_but_the_turn_goes_on(
    mcp_appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    notes: NotesServer,
) -> None:
    offline_model.script(mcp_call("call_m1", text="x"), Reply.fixed("after cancel"))
    approver = Approver(ApprovalDecision.CANCEL)
    result = await run_codex_turn(
        params(), app_server=mcp_appserver, hooks=TurnHooks(on_approval=approver)
    )
    assert len(approver.requests) == 1
    assert notes.calls() == []
    assert answers_sent(mcp_appserver, ELICITATION) == [{"action": "cancel"}]
    # Unlike a command or a file change, Codex 0.163 does NOT interrupt the turn on a
    # cancelled MCP approval: the model is told and called again, and the turn completes.
    assert "user cancelled MCP tool call" in tool_output(offline_model, "call_m1")
    assert result.outcome is TurnOutcome.COMPLETED
    assert result.assistant_text == "after cancel"


@pytest.mark.codex
async def test_a_read_only_mcp_tool_runs_without_asking(
    mcp_appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    notes: NotesServer,
) -> None:
    offline_model.script(mcp_call("call_r1", tool="read_notes"), Reply.fixed("Read."))
    approver = Approver(ApprovalDecision.DECLINE)
    result = await run_codex_turn(
        params(), app_server=mcp_appserver, hooks=TurnHooks(on_approval=approver)
    )
    assert result.outcome is TurnOutcome.COMPLETED
    assert approver.requests == []
    assert [c["name"] for c in notes.calls()] == ["read_notes"]


def test_the_mcp_tool_name_is_read_from_codexs_question() -> None:
    """Codex 0.163 sends no ``_meta.tool_name``: the name is quoted in its ``message`` (the
    title, ``_meta.tool_title``, only when the tool declares one, and it is not the name)."""
    meta: dict[str, Any] = {
        "codex_approval_kind": "mcp_tool_call",
        "persist": ["session", "always"],
        "tool_title": "Record a note",
    }
    wire: dict[str, Any] = {
        "threadId": "t1",
        "turnId": "u1",
        "serverName": "notes",
        "mode": "form",
        "message": 'Allow the notes MCP server to run tool "record_note"?',
        "requestedSchema": {"type": "object", "properties": {}},
        "_meta": meta,
    }
    request = approval_request(ELICITATION, wire)
    assert request is not None
    assert (request.server_name, request.tool_name) == ("notes", "record_note")
    # An explicit name wins; without a quoted name (a connector's templated question) the
    # title is all there is.
    named = {**wire, "_meta": {**meta, "tool_name": "other"}}
    assert getattr(approval_request(ELICITATION, named), "tool_name", None) == "other"
    templated = {**wire, "message": "Allow Notes to record a note?"}
    assert getattr(approval_request(ELICITATION, templated), "tool_name", None) == "Record a note"
