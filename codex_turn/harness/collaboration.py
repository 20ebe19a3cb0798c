"""Turn-scoped collaboration-mode instructions, and heartbeat turns.

Theory. Codex 0.163 takes a *collaboration mode* on ``turn/start`` (``collaborationMode``:
``{mode, settings: {model, reasoning_effort, developer_instructions}}``) and renders its
developer instructions as one developer message, ``<collaboration_mode>...</collaboration_mode>``,
in that turn's model request. Verified against the binary: the mode is sticky (a turn that
sends none keeps the last one), Codex writes the message only when the mode changes (sending
the same mode again, or the default mode to a thread in it, adds nothing), the message stays
in the thread's history, and ``developer_instructions: null`` selects the mode's built-in
instructions (for ``default``: "# Collaboration Mode: Default ..."). The settings' model and
reasoning effort take precedence over the turn's own (a ``null`` effort clears it), so the
client fills them with what the turn would run with
(:meth:`~codex_turn.harness.appserver.turn_start.Turns.turn`).

So instructions that belong to one turn (a skills catalog, tool-routed MEMORY.md pointers,
heartbeat guidance) go as that turn's collaboration mode (mode ``default``, the instructions
given), and the next turn without any goes back to Codex's default mode: the client
remembers, per thread, that it sent instructions of its own and sends the default mode (its
built-in instructions) once. Ordinary turns that never had any send nothing.

Memory. Pointers into MEMORY.md are only useful with the tools that read it
(:attr:`CollaborationInstructions.memory_tools`, looked up among the turn's dynamic tools).
Without them the pointers are dropped, and the plain-text memory (active BOOTSTRAP.md and all
of MEMORY.md, :attr:`CollaborationInstructions.memory_context`) goes as input context of that
turn instead: a text item before the prompt in ``turn/start`` (never mirrored as the user's
words).

Heartbeats (``TurnParams.heartbeat``). A heartbeat turn runs on a transient thread of its own
(its tool set differs: the thread table's ``own-transient-thread`` row), with the
``heartbeat_respond`` tool (:func:`heartbeat_tool`) through which the model records whether the
wake stays silent or notifies, with the text (:class:`HeartbeatResponse`, in
``TurnResult.heartbeat``); the guidance (:data:`HEARTBEAT_GUIDANCE`) goes as its
collaboration-mode instructions, and a non-empty heartbeat file is named by its path, never
inlined. Engines see ``is_heartbeat`` on assemble and after the turn.

Nothing here does I/O (the heartbeat file's size is looked up by the stage).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Final, Literal

import attrs

from codex_turn.harness.appserver import DynamicTool, ToolResult
from codex_turn.harness.hooks import join_sections

__all__ = [
    "DEFAULT_MEMORY_TOOLS",
    "HEARTBEAT_GUIDANCE",
    "HEARTBEAT_TOOL",
    "CollaborationInstructions",
    "CollaborationPlan",
    "HeartbeatRecorder",
    "HeartbeatResponse",
    "collaboration_mode",
    "collaboration_plan",
    "heartbeat_tool",
]

HEARTBEAT_TOOL: Final = "heartbeat_respond"

#: The tools through which the model reads MEMORY.md (OpenClaw's memory tools).
DEFAULT_MEMORY_TOOLS: Final = ("memory_search", "memory_get")

#: What a heartbeat turn's collaboration-mode instructions tell the model.
HEARTBEAT_GUIDANCE: Final = (
    "This turn is a heartbeat: a scheduled wake, not a message from the user. Check whether "
    "anything needs the user's attention now. Then call the heartbeat_respond tool once: "
    'decision "silent" when nothing does (nothing is sent), or "notify" with the text to '
    "send to the user."
)


def _optional_text(value: Any) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


@attrs.frozen(kw_only=True)
class CollaborationInstructions:
    """What a turn carries as turn-scoped collaboration-mode developer instructions (see the
    module header). Blank texts count as absent."""

    #: The skills catalog (names, descriptions, where each skill's file is).
    skills_catalog: str | None = None
    #: Tool-routed MEMORY.md pointers: sent only when a memory tool is available this turn.
    memory_pointers: str | None = None
    #: The plain-text fallback: active BOOTSTRAP.md and all of MEMORY.md, sent as input
    #: context of the turn when no memory tool is available (else dropped).
    memory_context: str | None = None
    #: The dynamic tools that read memory; one of them among the turn's tools: the pointers.
    memory_tools: tuple[str, ...] = DEFAULT_MEMORY_TOOLS


@attrs.frozen
class CollaborationPlan:
    """This turn's collaboration-mode instructions and plain-text input context (either
    ``None``)."""

    instructions: str | None = None
    input_context: str | None = None


def collaboration_plan(
    instructions: CollaborationInstructions | None,
    *,
    tool_names: Iterable[str],
    heartbeat: bool = False,
    heartbeat_file: str | os.PathLike[str] | None = None,
    heartbeat_guidance: str = HEARTBEAT_GUIDANCE,
) -> CollaborationPlan:
    """The plan for a turn: which instructions go as its collaboration mode and which text
    goes as its input context. ``heartbeat_file`` is named only when the caller found it
    non-empty (pass ``None`` otherwise)."""
    given = instructions or CollaborationInstructions()
    names = set(tool_names)
    memory_tools = any(name in names for name in given.memory_tools)
    pointers = _optional_text(given.memory_pointers) if memory_tools else None
    context = None if memory_tools else _optional_text(given.memory_context)
    beat: str | None = None
    if heartbeat:
        named = (
            f"The heartbeat checklist is the file {os.fspath(heartbeat_file)}: read it from "
            "there (it is not included here)."
            if heartbeat_file is not None
            else None
        )
        beat = join_sections(heartbeat_guidance, named)
    text = join_sections(beat, _optional_text(given.skills_catalog), pointers)
    return CollaborationPlan(instructions=text, input_context=context)


def collaboration_mode(instructions: str | None) -> dict[str, Any]:
    """The ``collaborationMode`` of a ``turn/start`` carrying ``instructions`` (``None``:
    Codex's default mode with its built-in instructions). The client fills in the model and
    the reasoning effort (see the module header)."""
    return {"mode": "default", "settings": {"developer_instructions": instructions}}


# --- heartbeats ------------------------------------------------------------------------------


@attrs.frozen
class HeartbeatResponse:
    """What the model recorded with ``heartbeat_respond``: stay ``silent`` or ``notify`` the
    user with ``text``."""

    decision: Literal["silent", "notify"]
    text: str | None = None

    @property
    def notify(self) -> bool:
        return self.decision == "notify"


@attrs.define(eq=False)
class HeartbeatRecorder:
    """Where the ``heartbeat_respond`` tool records the model's answer (the last one wins)."""

    response: HeartbeatResponse | None = None


_HEARTBEAT_SCHEMA: Final = {
    "type": "object",
    "properties": {
        "decision": {
            "type": "string",
            "enum": ["silent", "notify"],
            "description": '"silent": nothing needs the user now; "notify": send them text.',
        },
        "text": {"type": "string", "description": "What to send (decision notify)."},
    },
    "required": ["decision"],
    "additionalProperties": False,
}


def heartbeat_tool(recorder: HeartbeatRecorder) -> DynamicTool:
    """``heartbeat_respond``: records the model's decision in ``recorder``."""

    async def respond(arguments: dict[str, Any]) -> ToolResult:
        decision = arguments["decision"]
        text = _optional_text(arguments.get("text"))
        if decision == "notify" and text is None:
            return ToolResult.text("decision notify needs the text to send", success=False)
        recorder.response = HeartbeatResponse(decision, text if decision == "notify" else None)
        return ToolResult.text(f"recorded: {decision}")

    return DynamicTool(
        name=HEARTBEAT_TOOL,
        description=(
            "Record the outcome of this heartbeat: stay silent, or notify the user with text."
        ),
        input_schema=_HEARTBEAT_SCHEMA,
        fn=respond,
    )
