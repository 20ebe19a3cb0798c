"""Per-turn runtime controls: the approvals bridge, user input, and per-turn settings.

The unit part checks the typed API (validation, wire shapes, privacy of the records) and that
a turn hands its settings to ``turn/start`` (the in-process fake app-server). The ``codex``
part runs whole turns (``run_codex_turn``) against the real ``codex app-server`` and the
offline model, which scripts the model's tool calls: an escalated ``exec_command`` makes
Codex ask for approval (approval policy ``on-request``, read-only sandbox), a
``request_user_input`` call asks the host a question (that tool needs
``features.default_mode_request_user_input`` outside Plan mode). What the model then received
(its ``function_call_output``), what ran (a file in the workspace) and what was sent over
JSON-RPC is asserted, never just what the callbacks saw.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.fake_appserver import FakeAppServer
from support.turns import temporary_session_file, turn_params

from codex_turn import AppServer, AppServerConfig, TurnHooks, TurnOutcome, TurnParams, TurnResult
from codex_turn import run_codex_turn as _run_codex_turn
from codex_turn.harness.appserver.server_requests import (
    approval_request,
    approval_response,
    user_input_request,
    user_input_response,
)
from codex_turn.harness.appserver.types import ThreadInfo, ThreadResult
from codex_turn.harness.runtime_controls import (
    ApprovalDecision,
    ApprovalKind,
    ApprovalRequest,
    TurnRequestHandlers,
    UserInputAnswers,
    UserInputRequest,
    sandbox_policy,
    turn_request_handlers,
    turn_start_overrides,
)
from codex_turn.harness.turn_api import InvalidTurnParams
from codex_turn.testing import OfflineModel, Reply

pytestmark = pytest.mark.anyio

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}


# --- the typed API ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reasoning_effort", ""),
        ("reasoning_effort", "   "),
        ("reasoning_effort", " high"),
        ("reasoning_effort", 3),
        ("output_schema", "not a schema"),
        ("output_schema", ["type", "object"]),
        ("output_schema", {"type": "object", "default": object()}),
        ("output_schema", {"type": "number", "maximum": math.inf}),
        ("approval_timeout", 0),
        ("approval_timeout", -1.0),
        ("approval_timeout", True),
        ("approval_timeout", math.nan),
        ("user_input_timeout", 0),
        ("user_input_timeout", "60"),
    ],
)
def test_bad_runtime_settings_are_refused_when_the_params_are_built(field: str, value: Any) -> None:
    with temporary_session_file("rc-") as path, pytest.raises(InvalidTurnParams, match=field):
        turn_params(path, "hi", **{field: value})


def test_runtime_settings_default_to_sending_nothing() -> None:
    with temporary_session_file("rc-") as path:
        params = turn_params(path, "hi")
    assert (params.reasoning_effort, params.output_schema) == (None, None)
    assert (params.approval_timeout, params.user_input_timeout) == (60.0, 60.0)
    assert turn_start_overrides(params, None) == {}
    assert turn_request_handlers(params, TurnHooks()) is None


def _thread(sandbox: Any) -> ThreadResult:
    return ThreadResult(thread=ThreadInfo(id="t"), sandbox=sandbox)


def test_turn_start_overrides_carry_every_stated_setting() -> None:
    with temporary_session_file("rc-") as path:
        params = turn_params(
            path,
            "hi",
            reasoning_effort="high",
            output_schema=SCHEMA,
            approval_policy="on-request",
            sandbox="workspace-write",
        )
    assert turn_start_overrides(params, None) == {
        "effort": "high",
        "outputSchema": SCHEMA,
        "approvalPolicy": "on-request",
        "sandboxPolicy": {"type": "workspaceWrite"},
    }
    # The thread's effective policy of that mode is kept (its config.toml details included).
    effective = {"type": "workspaceWrite", "networkAccess": True, "writableRoots": ["/x"]}
    assert turn_start_overrides(params, _thread(effective))["sandboxPolicy"] == effective
    # ... but never one of another mode.
    assert sandbox_policy("read-only", _thread(effective)) == {"type": "readOnly"}
    assert sandbox_policy("danger-full-access") == {"type": "dangerFullAccess"}


def test_callback_waits_are_bounded_by_their_own_timeouts() -> None:
    async def approve(request: ApprovalRequest) -> ApprovalDecision:
        return ApprovalDecision.APPROVE

    with temporary_session_file("rc-") as path:
        params = turn_params(path, "hi", idle_timeout=10.0, approval_timeout=30.0)
    handlers = turn_request_handlers(params, TurnHooks(on_approval=approve))
    assert handlers is not None
    assert handlers.on_approval is approve
    assert handlers.on_user_input is None
    assert handlers.approval_timeout == pytest.approx(30.0)  # as given, never cut silently
    assert handlers.user_input_timeout == pytest.approx(60.0)
    with pytest.raises(ValueError, match="approval_timeout"):
        TurnRequestHandlers(approval_timeout=0)


COMMAND_PARAMS = {
    "threadId": "t1",
    "turnId": "u1",
    "itemId": "call_1",
    "command": "/bin/bash -lc 'touch secret-file'",
    "cwd": "/work",
    "reason": "Allow writing secret-file?",
}
MCP_PARAMS = {
    "threadId": "t1",
    "turnId": "u1",
    "serverName": "docs",
    "mode": "form",
    "message": 'Allow the docs MCP server to run tool "search"?',
    "requestedSchema": {"type": "object", "properties": {}},
    "_meta": {"codex_approval_kind": "mcp_tool_call", "tool_name": "search", "persist": "session"},
}


@pytest.mark.parametrize(
    ("decision", "wire"),
    [
        (ApprovalDecision.APPROVE, "accept"),
        (ApprovalDecision.APPROVE_FOR_SESSION, "acceptForSession"),
        (ApprovalDecision.DECLINE, "decline"),
        (ApprovalDecision.CANCEL, "cancel"),
    ],
)
@pytest.mark.parametrize(
    "method", ["item/commandExecution/requestApproval", "item/fileChange/requestApproval"]
)
def test_command_and_file_change_decisions_on_the_wire(
    method: str, decision: ApprovalDecision, wire: str
) -> None:
    request = approval_request(method, COMMAND_PARAMS)
    assert request is not None
    assert approval_response(request, decision) == {"decision": wire}


def test_approval_requests_are_typed() -> None:
    command = approval_request("item/commandExecution/requestApproval", COMMAND_PARAMS)
    assert command is not None
    assert command.kind is ApprovalKind.COMMAND
    assert (command.thread_id, command.turn_id, command.item_id) == ("t1", "u1", "call_1")
    assert (command.command, command.cwd) == ("/bin/bash -lc 'touch secret-file'", "/work")
    assert command.reason == "Allow writing secret-file?"
    assert command.session_approval_offered
    with pytest.raises(TypeError):
        command.params["command"] = "rm -rf /"  # type: ignore[index]
    legacy = approval_request(
        "execCommandApproval", {"conversationId": "t1", "callId": "c", "command": ["ls", "-l"]}
    )
    assert legacy is not None
    assert legacy.command == "ls -l"
    assert legacy.thread_id == "t1"
    assert approval_response(legacy, ApprovalDecision.APPROVE_FOR_SESSION) == {
        "decision": "approved_for_session"
    }
    assert approval_response(legacy, ApprovalDecision.CANCEL) == {"decision": "abort"}


def test_mcp_tool_approvals_and_other_elicitations() -> None:
    mcp = approval_request("mcpServer/elicitation/request", MCP_PARAMS)
    assert mcp is not None
    assert mcp.kind is ApprovalKind.MCP_TOOL
    assert (mcp.server_name, mcp.tool_name) == ("docs", "search")
    assert approval_response(mcp, ApprovalDecision.APPROVE) == {"action": "accept", "content": {}}
    assert approval_response(mcp, ApprovalDecision.APPROVE_FOR_SESSION) == {
        "action": "accept",
        "content": {},
        "_meta": {"persist": "session"},
    }
    assert approval_response(mcp, ApprovalDecision.DECLINE) == {"action": "decline"}
    assert approval_response(mcp, ApprovalDecision.CANCEL) == {"action": "cancel"}
    # Session approval not offered: a plain accept (Codex would not know the persistence).
    once = approval_request(
        "mcpServer/elicitation/request",
        {**MCP_PARAMS, "_meta": {"codex_approval_kind": "mcp_tool_call"}},
    )
    assert once is not None
    assert not once.session_approval_offered
    assert approval_response(once, ApprovalDecision.APPROVE_FOR_SESSION) == {
        "action": "accept",
        "content": {},
    }
    # A genuine form elicitation, and a permissions request: not a decision's to answer.
    assert approval_request("mcpServer/elicitation/request", {**MCP_PARAMS, "_meta": {}}) is None
    assert approval_request("item/permissions/requestApproval", COMMAND_PARAMS) is None


QUESTION_PARAMS = {
    "threadId": "t1",
    "turnId": "u1",
    "itemId": "call_q",
    "isBlocking": False,
    "questions": [
        {
            "id": "color",
            "header": "Colour",
            "question": "Which colour do you prefer?",
            "isOther": True,
            "options": [{"label": "blue", "description": "calm"}, {"label": "red"}],
        },
        {"id": "pin", "header": "PIN", "question": "What is your PIN?", "isSecret": True},
        {"header": "no id"},
    ],
}


def test_user_input_requests_and_answers() -> None:
    request = user_input_request(QUESTION_PARAMS)
    assert [q.id for q in request.questions] == ["color", "pin"]
    color, pin = request.questions
    assert color.question == "Which colour do you prefer?"
    assert color.is_other
    assert [o.label for o in color.options] == ["blue", "red"]
    assert pin.is_secret
    assert not color.is_secret
    answers = {"color": "blue", "pin": ["1234"], "unknown": "x"}
    assert user_input_response(request, answers) == {
        "answers": {"color": {"answers": ["blue"]}, "pin": {"answers": ["1234"]}}
    }
    assert user_input_response(request, {"color": 3, "pin": [1]}) == {"answers": {}}
    assert user_input_response(request, "blue") == {"answers": {}}


def test_records_keep_private_text_out_of_their_repr() -> None:
    command = approval_request("item/commandExecution/requestApproval", COMMAND_PARAMS)
    question = user_input_request(QUESTION_PARAMS)
    shown = repr(command) + repr(question)
    for private in ("secret-file", "/work", "colour do you prefer", "PIN", "calm"):
        assert private not in shown
    assert "call_1" in shown
    assert "color" in shown


async def test_a_turn_sends_its_settings_on_turn_start() -> None:
    server = FakeAppServer()
    with temporary_session_file("rc-") as path:
        await _run_codex_turn(
            turn_params(path, "one", reasoning_effort="low", output_schema=SCHEMA),
            app_server=server,
        )
        await _run_codex_turn(
            turn_params(path, "two", approval_policy="never", sandbox="read-only"),
            app_server=server,
        )
    assert server.turn_overrides[0] == {"effort": "low", "outputSchema": SCHEMA}
    assert server.turn_overrides[1]["approvalPolicy"] == "never"
    assert server.turn_overrides[1]["sandboxPolicy"]["type"] == "readOnly"


# --- against the real binary --------------------------------------------------------------------

WRITE = "touch approved_file && echo wrote"
JUSTIFICATION = "Allow writing approved_file for the release notes?"


def escalated(call_id: str, cmd: str = WRITE) -> Reply:
    """An exec_command that asks to leave the read-only sandbox: Codex asks for approval."""
    arguments = {
        "cmd": cmd,
        "yield_time_ms": 2000,
        "sandbox_permissions": "require_escalated",
        "justification": JUSTIFICATION,
    }
    return Reply.function_call("exec_command", arguments, call_id=call_id)


def ask(call_id: str = "call_q") -> Reply:
    question = {
        "id": "color",
        "header": "Colour",
        "question": "Which colour should the banner be?",
        "options": [
            {"label": "blue", "description": "calm"},
            {"label": "red", "description": "loud"},
        ],
    }
    return Reply.function_call("request_user_input", {"questions": [question]}, call_id=call_id)


@pytest.fixture
def params(tmp_path: Path, workspace: Path) -> Callable[..., TurnParams]:
    def make(**overrides: Any) -> TurnParams:
        values: dict[str, Any] = {
            "session_id": "session-rc",
            "session_file": tmp_path / "session-rc.jsonl",
            "workspace_dir": workspace,
            "prompt": "please write the file",
            "approval_policy": "on-request",
            "sandbox": "read-only",
        }
        values.update(overrides)
        return TurnParams(**values)

    return make


def tool_output(model: OfflineModel, call_id: str) -> str:
    for request in reversed(model.turn_requests()):
        for item in request.function_call_outputs:
            if item.get("call_id") == call_id:
                output = item.get("output")
                return output if isinstance(output, str) else json.dumps(output)
    raise AssertionError(f"the model never got the output of {call_id}")


def triggers(result: TurnResult) -> list[str]:
    return [entry.trigger for entry in result.trace]


async def run_codex_turn(params: TurnParams, **kwargs: Any) -> TurnResult:
    with anyio.fail_after(60):  # never hangs
        return await _run_codex_turn(params, **kwargs)


class Approver:
    def __init__(self, decision: ApprovalDecision | None) -> None:
        self.decision = decision
        self.requests: list[ApprovalRequest] = []

    async def __call__(self, request: ApprovalRequest) -> ApprovalDecision:
        self.requests.append(request)
        if self.decision is None:
            await anyio.sleep_forever()
        assert self.decision is not None
        return self.decision


@pytest.mark.codex
async def test_an_approved_command_runs(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    workspace: Path,
) -> None:
    offline_model.script(escalated("call_1"), Reply.fixed("Done."))
    approver = Approver(ApprovalDecision.APPROVE)
    result = await run_codex_turn(
        params(), app_server=appserver, hooks=TurnHooks(on_approval=approver)
    )
    assert result.outcome is TurnOutcome.COMPLETED
    assert result.assistant_text == "Done."
    (request,) = approver.requests
    assert request.kind is ApprovalKind.COMMAND
    assert request.thread_id == result.thread_id
    assert request.turn_id == result.turn_id
    assert request.item_id == "call_1"
    assert request.reason == JUSTIFICATION
    assert request.command is not None
    assert WRITE in request.command
    assert (workspace / "approved_file").exists()
    assert "Process exited with code 0" in tool_output(offline_model, "call_1")
    answers = [m for m in appserver.sent if "result" in m and "decision" in m["result"]]
    assert [m["result"] for m in answers] == [{"decision": "accept"}]


@pytest.mark.codex
@pytest.mark.parametrize("with_callback", [True, False])
async def test_a_declined_command_does_not_run_and_the_turn_continues(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    workspace: Path,
    with_callback: bool,
) -> None:
    offline_model.script(escalated("call_1"), Reply.fixed("Understood."))
    approver = Approver(ApprovalDecision.DECLINE)
    hooks = TurnHooks(on_approval=approver) if with_callback else TurnHooks()
    result = await run_codex_turn(params(), app_server=appserver, hooks=hooks)
    assert result.outcome is TurnOutcome.COMPLETED
    assert result.assistant_text == "Understood."  # the model was called again
    assert len(approver.requests) == (1 if with_callback else 0)
    assert not (workspace / "approved_file").exists()
    assert "rejected by user" in tool_output(offline_model, "call_1")


@pytest.mark.codex
@pytest.mark.parametrize(
    ("overrides", "bound"),
    [
        ({"approval_timeout": 0.5}, 0.5),
        # An approval_timeout above the idle timeout is kept (before its fix it was cut to 80% of
        # it): the idle timer pauses while the host is asked; declined, the turn goes on.
        ({"approval_timeout": 2.0, "idle_timeout": 1.0}, 2.0),
    ],
)
async def test_an_unanswered_approval_is_declined_in_time(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    workspace: Path,
    overrides: dict[str, Any],
    bound: float,
) -> None:
    offline_model.script(escalated("call_1"), Reply.fixed("Moving on."))
    approver = Approver(None)  # never answers
    started = time.monotonic()
    result = await run_codex_turn(
        params(**overrides), app_server=appserver, hooks=TurnHooks(on_approval=approver)
    )
    elapsed = time.monotonic() - started
    assert result.outcome is TurnOutcome.COMPLETED
    assert result.assistant_text == "Moving on."
    assert len(approver.requests) == 1
    assert bound <= elapsed < bound + 15
    assert not (workspace / "approved_file").exists()
    assert "rejected by user" in tool_output(offline_model, "call_1")


@pytest.mark.codex
async def test_approve_for_session_is_asked_once(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    workspace: Path,
) -> None:
    offline_model.script(escalated("call_1"), escalated("call_2"), Reply.fixed("Twice."))
    approver = Approver(ApprovalDecision.APPROVE_FOR_SESSION)
    result = await run_codex_turn(
        params(), app_server=appserver, hooks=TurnHooks(on_approval=approver)
    )
    assert result.outcome is TurnOutcome.COMPLETED
    assert len(approver.requests) == 1  # Codex's session cache covered the second run
    assert (workspace / "approved_file").exists()
    for call_id in ("call_1", "call_2"):
        assert "Process exited with code 0" in tool_output(offline_model, call_id)


@pytest.mark.codex
async def test_cancel_declines_and_interrupts_the_turn(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    workspace: Path,
) -> None:
    offline_model.script(escalated("call_1"), Reply.fixed("never sent"))
    approver = Approver(ApprovalDecision.CANCEL)
    result = await run_codex_turn(
        params(), app_server=appserver, hooks=TurnHooks(on_approval=approver)
    )
    # Codex interrupts the turn itself: an interrupted turn, as the trace says.
    assert result.outcome is TurnOutcome.ABORTED
    assert "turn_aborted" in triggers(result)
    assert "maintenance_ran" not in triggers(result)
    assert not (workspace / "approved_file").exists()
    assert len(offline_model.turn_requests()) == 1  # the model was not called again


@pytest.fixture
def input_server_config(make_appserver_config: Callable[..., AppServerConfig]) -> AppServerConfig:
    # Outside Plan mode Codex 0.163 answers request_user_input itself ("unavailable in
    # Default mode") unless this feature is on.
    return make_appserver_config(
        extra_config={"features": {"default_mode_request_user_input": True}}
    )


@pytest.mark.codex
async def test_user_input_is_answered_by_the_host(
    input_server_config: AppServerConfig,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
) -> None:
    seen: list[UserInputRequest] = []

    async def answer(request: UserInputRequest) -> UserInputAnswers:
        seen.append(request)
        return {"color": "blue"}

    offline_model.script(ask(), Reply.fixed("Blue it is."))
    async with AppServer.start(input_server_config, record_sent=True) as server:
        result = await run_codex_turn(
            params(prompt="ask me"), app_server=server, hooks=TurnHooks(on_user_input=answer)
        )
    assert result.outcome is TurnOutcome.COMPLETED
    (request,) = seen
    (question,) = request.questions
    assert (question.id, question.question) == ("color", "Which colour should the banner be?")
    assert [o.label for o in question.options] == ["blue", "red"]
    assert request.turn_id == result.turn_id
    assert json.loads(tool_output(offline_model, "call_q")) == {
        "answers": {"color": {"answers": ["blue"]}}
    }


@pytest.mark.codex
@pytest.mark.parametrize("how", ["timeout", "cancelled", "no-callback"])
async def test_unanswered_user_input_gets_the_safe_answer(
    input_server_config: AppServerConfig,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    how: str,
) -> None:
    async def never(request: UserInputRequest) -> UserInputAnswers:
        await anyio.sleep_forever()
        raise AssertionError

    async def cancel(request: UserInputRequest) -> UserInputAnswers | None:
        return None

    hooks = {
        "timeout": TurnHooks(on_user_input=never),
        "cancelled": TurnHooks(on_user_input=cancel),
        "no-callback": TurnHooks(),
    }[how]
    offline_model.script(ask(), Reply.fixed("No answer, fine."))
    started = time.monotonic()
    async with AppServer.start(input_server_config) as server:
        result = await run_codex_turn(
            params(prompt="ask me", user_input_timeout=0.5), app_server=server, hooks=hooks
        )
    assert result.outcome is TurnOutcome.COMPLETED
    assert result.assistant_text == "No answer, fine."
    assert time.monotonic() - started < 30
    assert json.loads(tool_output(offline_model, "call_q")) == {"answers": {}}


@pytest.mark.codex
async def test_per_turn_settings_reach_codex_and_the_model(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    codex_schema: Any,
) -> None:
    offline_model.script(Reply.fixed('{"answer": "42"}'), Reply.fixed("plain"))
    first = await run_codex_turn(
        params(reasoning_effort="high", output_schema=SCHEMA), app_server=appserver
    )
    second = await run_codex_turn(
        params(prompt="again", reasoning_effort="low"), app_server=appserver
    )
    assert first.outcome is second.outcome is TurnOutcome.COMPLETED
    one, two = offline_model.turn_requests()
    assert one.body["reasoning"]["effort"] == "high"
    assert one.body["text"]["format"]["schema"] == SCHEMA
    assert one.body["text"]["format"]["type"] == "json_schema"
    assert two.body["reasoning"]["effort"] == "low"
    assert not (two.body.get("text") or {}).get("format")  # the schema was this turn's only
    starts = [m["params"] for m in appserver.sent if m.get("method") == "turn/start"]
    assert starts[0]["effort"] == "high"
    assert starts[0]["outputSchema"] == SCHEMA
    assert "outputSchema" not in starts[1]
    assert starts[1]["effort"] == "low"
    for start in starts:
        assert start["approvalPolicy"] == "on-request"
        assert start["sandboxPolicy"]["type"] == "readOnly"
    codex_schema.validate_sent(appserver.sent, appserver.server_requests)


@pytest.mark.codex
async def test_a_sandbox_change_takes_effect_on_a_thread_codex_holds(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    workspace: Path,
) -> None:
    # thread/resume of a loaded thread ignores a new sandbox: only turn/start changes it.
    plain = {"cmd": "touch plain_file && echo ok", "yield_time_ms": 2000}
    offline_model.script(
        Reply.function_call("exec_command", plain, call_id="ro"),
        Reply.fixed("one"),
        Reply.function_call("exec_command", plain, call_id="ww"),
        Reply.fixed("two"),
    )
    first = await run_codex_turn(params(approval_policy="never"), app_server=appserver)
    assert not (workspace / "plain_file").exists()
    assert "Read-only file system" in tool_output(offline_model, "ro")
    second = await run_codex_turn(
        params(approval_policy="never", sandbox="workspace-write"), app_server=appserver
    )
    assert second.thread_id == first.thread_id
    assert second.outcome is TurnOutcome.COMPLETED
    assert (workspace / "plain_file").exists()
    assert "Process exited with code 0" in tool_output(offline_model, "ww")


@pytest.mark.codex
async def test_commands_questions_and_answers_never_reach_the_logs(
    input_server_config: AppServerConfig,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    private_texts: set[str],
) -> None:
    secret_cmd = "touch approved_file && echo s3cr3t-payload-9f2c"
    private_texts.update(
        {
            "s3cr3t-payload-9f2c",
            JUSTIFICATION,
            "Which colour should the banner be?",
            "ultramarine-answer-77",
        }
    )

    async def approve(request: ApprovalRequest) -> ApprovalDecision:
        return ApprovalDecision.DECLINE

    async def answer(request: UserInputRequest) -> UserInputAnswers:
        return {"color": "ultramarine-answer-77"}

    offline_model.script(escalated("call_1", secret_cmd), ask(), Reply.fixed("ok"))
    async with AppServer.start(input_server_config) as server:
        result = await run_codex_turn(
            params(),
            app_server=server,
            hooks=TurnHooks(on_approval=approve, on_user_input=answer),
        )
    assert result.outcome is TurnOutcome.COMPLETED
    assert "ultramarine-answer-77" in tool_output(offline_model, "call_q")
    # The autouse guard fails this test if any registered text reached a log record.


@pytest.mark.codex
async def test_a_turn_without_settings_runs_with_the_configured_defaults_even_after_overrides(
    make_appserver_config: Callable[..., AppServerConfig],
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    workspace: Path,
) -> None:
    # Before its fix: one turn's sandbox / approval policy leaked into later turns that stated
    # none (Codex keeps turn/start's values on the thread), and an app-server restart kept
    # the approval policy but lost the sandbox. None means the configured default, always.
    from codex_turn.harness.appserver.process import AppServerProcess

    def plain(n: int) -> Reply:
        cmd = f"touch plain_{n} && echo ok"
        return Reply.function_call(
            "exec_command", {"cmd": cmd, "yield_time_ms": 2000}, call_id=f"p{n}"
        )

    approver = Approver(ApprovalDecision.DECLINE)
    hooks = TurnHooks(on_approval=approver)
    config = make_appserver_config(approval_policy="on-request")  # sandbox: read-only
    async with AppServer.start(config, record_sent=True) as server:

        async def turn(n: int, **settings: Any) -> TurnResult:
            offline_model.clear_script()
            offline_model.script(
                plain(n), escalated(f"e{n}", f"touch escalated_{n}"), Reply.fixed("ok")
            )
            values: dict[str, Any] = {"approval_policy": None, "sandbox": None, **settings}
            return await run_codex_turn(
                params(prompt=f"turn {n}", **values), app_server=server, hooks=hooks
            )

        def asked(n: int) -> bool:
            return f"e{n}" in [r.item_id for r in approver.requests]

        first = await turn(1, sandbox="workspace-write", approval_policy="never")
        assert (workspace / "plain_1").exists()
        assert not asked(1)
        second = await turn(2)
        assert second.thread_id == first.thread_id
        assert not (workspace / "plain_2").exists()  # read-only again
        assert asked(2)  # the host is asked again
        client = server.current
        assert client is not None
        process = client.transport
        assert isinstance(process, AppServerProcess)
        process.kill()
        await anyio.sleep(0.3)
        third = await turn(3)
        assert third.thread_id == first.thread_id
        assert not (workspace / "plain_3").exists()
        assert asked(3)
        for n in (2, 3):
            assert not (workspace / f"escalated_{n}").exists()


@pytest.mark.codex
async def test_a_callback_that_ignores_cancellation_is_answered_at_the_deadline(
    appserver: AppServer,
    offline_model: OfflineModel,
    params: Callable[..., TurnParams],
    workspace: Path,
) -> None:
    # Before its fix: a callback sleeping in a shielded scope held the request (and the turn) past
    # approval_timeout. The safe answer goes out at the deadline; the callback is abandoned.
    finished = anyio.Event()

    async def stubborn(request: ApprovalRequest) -> ApprovalDecision:
        with anyio.CancelScope(shield=True):
            await anyio.sleep(4.0)
        finished.set()
        return ApprovalDecision.APPROVE

    offline_model.script(escalated("call_1"), Reply.fixed("Moving on."))
    started = time.monotonic()
    result = await run_codex_turn(
        params(approval_timeout=0.5), app_server=appserver, hooks=TurnHooks(on_approval=stubborn)
    )
    elapsed = time.monotonic() - started
    assert result.outcome is TurnOutcome.COMPLETED
    assert elapsed < 3.5  # not held by the 4 s callback
    assert not finished.is_set()
    assert not (workspace / "approved_file").exists()
    assert "rejected by user" in tool_output(offline_model, "call_1")


async def test_a_non_text_user_input_answer_is_logged_invalid() -> None:
    from structlog.testing import capture_logs

    from codex_turn.harness.appserver.server_requests import TurnBinding, _ask_host_input

    async def answers(request: UserInputRequest) -> Any:
        return {"color": 5}

    binding = TurnBinding(TurnRequestHandlers(on_user_input=answers))
    params = {"threadId": "t", "questions": [{"id": "color", "question": "Which?"}]}
    with capture_logs() as logs:
        response = await _ask_host_input(binding, params)
    assert response == {"answers": {}}
    (answered,) = [r for r in logs if r["event"] == "appserver.user_input_answered"]
    assert answered["source"] == "invalid"
