"""Engine-offered tools: the tools a context engine offers the model, made dynamic tools of
one turn.

Theory of operation. An engine with the tools capability (``tools`` and ``call_tool``, see
:mod:`codex_turn.harness.engine.contract`) is asked once per turn, before the thread is
chosen, which tools it offers this session (:func:`offered_tools`). Each becomes a
:class:`~codex_turn.harness.appserver.DynamicTool` beside the host's, so it is declared on
``thread/start`` with them and counts in the tools fingerprint (a changed offer starts a new
thread, as a changed host tool does). The declaration is checked at the boundary: the result's
shape (:func:`~codex_turn.harness.engine.ensure_tools_result`), then each name and schema as
Codex needs them (a name that shadows a Codex built-in, or a schema that is not one, is the
engine's invalid result). A name the host's tools already use is :class:`EngineToolConflict`:
the turn is refused before anything is sent, because the model could not tell the two tools
apart and either choice would be silent.

*The session is the turn's.* A call reaches ``call_tool`` with the turn's ``session_id`` and
session key, filled in here: the model chooses the arguments, never whose store they read.

*Bounded and redacted.* Each call is bounded by the turn's ``engine_timeout`` (a hung engine
answers the model with a failure); what the engine answers is passed through the one secrets
redactor (:func:`codex_turn._secrets.redact_secrets`) and cut at :data:`MAX_OUTPUT_CHARS`, with
a note saying so (an engine that pages its answers, as the reference engine's recall tools do,
stays below the cut).

*An engine's fault never breaks the turn.* ``tools()`` failing (an exception, an invalid
result, the timeout) is an engine fault like any other
(:func:`~codex_turn.harness.violations.engine_fault`: logged, and a contract violation unless
operational) and the turn runs with the host's tools
alone; a call that fails or returns an invalid result answers the model with a failure.
Logs carry the engine, the tool's name and the error type, never arguments or answers.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Final

import anyio

from codex_turn._secrets import redact_secrets
from codex_turn.harness.appserver import DynamicTool
from codex_turn.harness.appserver.tools import ToolResult
from codex_turn.harness.engine.contract import (
    EngineTool,
    EngineToolConflict,
    InvalidEngineResult,
    ToolCallParams,
    ToolCallResult,
    ToolsParams,
)
from codex_turn.harness.engine.validation import (
    EngineHandle,
    coerce_result,
    ensure_tools_result,
    optional_method,
)
from codex_turn.harness.violations import engine_fault

__all__ = ["MAX_OUTPUT_CHARS", "offered_tools"]

#: The most an engine tool's answer may be, in characters, after redaction.
MAX_OUTPUT_CHARS: Final = 32_000
_CUT_NOTE: Final = "\n[output cut at {limit} characters]"


def bounded_output(text: str, limit: int = MAX_OUTPUT_CHARS) -> str:
    """``text`` redacted, then cut at ``limit`` characters with a note saying so."""
    shown = redact_secrets(text)
    if len(shown) <= limit:
        return shown
    note = _CUT_NOTE.format(limit=limit)
    return shown[: max(0, limit - len(note))] + note


async def offered_tools(
    handle: EngineHandle | None,
    *,
    session_id: str,
    session_key: str | None,
    host_names: Collection[str],
    timeout: float | None,  # noqa: ASYNC109 - it bounds each call too, not only this one
    log: Any,
) -> list[DynamicTool]:
    """The engine's tools for this session as dynamic tools (none when it offers none, or
    ``tools()`` failed: logged). Raises :class:`EngineToolConflict` when a name is the
    host's."""
    if handle is None or not handle.offers_tools:
        return []
    declare = optional_method(handle.engine, "tools")
    assert declare is not None  # the capability says so
    try:
        with anyio.fail_after(timeout):
            raw = await declare(ToolsParams(session_id=session_id, session_key=session_key))
        offer = ensure_tools_result(raw, engine_id=handle.id)
        clash = [tool.name for tool in offer.tools if tool.name in host_names]
        if clash:
            raise EngineToolConflict(handle.id, clash)
        return [
            _dynamic(handle, tool, session_id, session_key, timeout, log) for tool in offer.tools
        ]
    except EngineToolConflict:
        raise
    except Exception as error:
        engine_fault(
            log,
            "context engine tools unavailable for this turn",
            engine=handle.engine,
            method="tools",
            error=error,
            session_key=session_key,
        )
        return []


def _dynamic(
    handle: EngineHandle,
    tool: EngineTool,
    session_id: str,
    session_key: str | None,
    timeout: float | None,
    log: Any,
) -> DynamicTool:
    call = optional_method(handle.engine, "call_tool")
    assert call is not None

    async def run(arguments: dict[str, Any]) -> ToolResult:
        params = ToolCallParams(
            session_id=session_id, name=tool.name, arguments=arguments, session_key=session_key
        )
        try:
            raw = await call(params)
            answer = coerce_result(raw, ToolCallResult, engine_id=handle.id, method="call_tool")
        except Exception as error:
            text = engine_fault(
                log,
                "context engine tool failed",
                engine=handle.engine,
                method="call_tool",
                error=error,
                session_key=session_key,
                tool=tool.name,
            )
            return ToolResult.text(f"tool {tool.name} failed: {text}", success=False)
        return ToolResult.text(bounded_output(answer.text), success=answer.success)

    try:
        return DynamicTool(
            name=tool.name,
            description=tool.description,
            input_schema=tool.input_schema,
            fn=run,
            timeout=timeout,
        )
    except ValueError as error:  # a name Codex refuses, or not a schema
        raise InvalidEngineResult(handle.id, "tools", str(error)) from None
