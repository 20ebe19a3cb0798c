"""Turn hooks: how a host adds context before the prompt is built and observes compactions.

Hooks are the host's extension points around one turn (OpenClaw's plugin hooks), kept apart
from the context engine on purpose: an engine decides *what the model remembers*, a hook
decorates *this* request. Three rules, all from OpenClaw's harness:

* ``before_prompt_build`` hooks run AFTER projection, so they see the projected prompt and
  the developer instructions with the engine's addition already in. Their results compose:
  ``prepend_context`` goes before the prompt, ``prepend_system_context`` and
  ``append_system_context`` around the instructions, and ``system_prompt`` *replaces* the
  instructions, the engine's addition included (the last hook that sets it wins).
* A hook that raises is logged (redacted) and ignored: a plugin never breaks a turn.
* ``on_transition`` sees every step of the turn machine as it is taken (a
  :class:`~codex_turn.fsm.TraceEntry`: source, trigger, destination), e.g. for a progress
  line; it runs synchronously between two stages, so it must be quick, and its errors are
  logged and ignored like a hook's.
* Compaction hooks fire for Codex's own in-turn compactions (``contextCompaction`` items);
  ``on_compaction_event`` receives the diagnostics stream (phase start/end, and for an engine
  that owns compaction an explicit ``{"backend": "codex-app-server", "ownsCompaction": true}``
  so nobody mistakes Codex's compaction for the engine's).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs

from codex_turn._log import format_error, get_logger
from codex_turn.fsm import TraceEntry
from codex_turn.harness.appserver.server_requests import ApprovalCallback, UserInputCallback
from codex_turn.harness.engine.contract import AgentMessage
from codex_turn.harness.observations import (
    LlmInputObserved,
    LlmOutputObserved,
    Observer,
    ToolCallObserved,
)

__all__ = [
    "CompactionHookEvent",
    "PromptBuildContext",
    "PromptBuildResult",
    "TurnHooks",
    "compose_prompt",
    "join_sections",
    "run_before_prompt_build",
]

_log = get_logger(__name__)


@attrs.frozen(kw_only=True)
class PromptBuildContext:
    """What a ``before_prompt_build`` hook sees (``messages`` is the mirrored history)."""

    session_id: str
    session_key: str | None
    prompt: str
    developer_instructions: str | None
    messages: Sequence[AgentMessage]


@attrs.frozen(kw_only=True)
class PromptBuildResult:
    prepend_context: str | None = None
    system_prompt: str | None = None
    prepend_system_context: str | None = None
    append_system_context: str | None = None


@attrs.frozen(kw_only=True)
class CompactionHookEvent:
    """One native compaction inside a turn (``phase`` is ``"start"`` or ``"end"``)."""

    phase: str
    thread_id: str
    turn_id: str | None
    item_id: str | None
    messages: Sequence[AgentMessage]
    #: ``-1``: Codex does not say how many messages it compacted (OpenClaw's convention).
    compacted_count: int = -1


PromptHook = Callable[[PromptBuildContext], Awaitable[PromptBuildResult | None]]
CompactionHook = Callable[[CompactionHookEvent], Awaitable[None]]
DiagnosticSink = Callable[[Mapping[str, Any]], Awaitable[None]]
TransitionObserver = Callable[[TraceEntry], None]


@attrs.frozen(kw_only=True)
class TurnHooks:
    before_prompt_build: Sequence[PromptHook] = ()
    before_compaction: Sequence[CompactionHook] = ()
    after_compaction: Sequence[CompactionHook] = ()
    on_compaction_event: DiagnosticSink | None = None
    on_transition: TransitionObserver | None = None
    #: The host's answer to Codex's approval requests (commands, file changes, MCP tools)
    #: during the turn, bounded by ``TurnParams.approval_timeout``; ``None``, a timeout or a
    #: failure: declined. See :mod:`codex_turn.harness.runtime_controls`.
    on_approval: ApprovalCallback | None = None
    #: The host's answers to the model's ``request_user_input`` questions, bounded by
    #: ``TurnParams.user_input_timeout``; ``None``, a timeout or a failure: no answers.
    on_user_input: UserInputCallback | None = None
    #: Observations (telemetry): they never block or change the turn; each call is bounded
    #: by ``TurnParams.observer_timeout`` and a failure is logged by type only. See
    #: :mod:`codex_turn.harness.observations`. Every tool call Codex completed:
    after_tool_call: Observer[ToolCallObserved] | None = None
    #: What the turn sends the model (before ``turn/start``) and what came back (its end).
    llm_input: Observer[LlmInputObserved] | None = None
    llm_output: Observer[LlmOutputObserved] | None = None


def join_sections(*sections: str | None) -> str | None:
    """Non-blank sections joined by a blank line (OpenClaw's ``joinPresentSections``)."""
    present = [s for s in sections if s is not None and s.strip()]
    return "\n\n".join(present) if present else None


def compose_prompt(
    prompt: str, developer_instructions: str | None, result: PromptBuildResult
) -> tuple[str, str | None]:
    """Apply one composed hook result: (final prompt, final developer instructions)."""
    final_prompt = join_sections(result.prepend_context, prompt) or ""
    base = result.system_prompt if result.system_prompt is not None else developer_instructions
    instructions = join_sections(result.prepend_system_context, base, result.append_system_context)
    return final_prompt, instructions


def _checked(result: object) -> PromptBuildResult | None:
    """A hook's result, or a ``TypeError`` (reported as that hook's failure) for anything
    but ``None`` or a :class:`PromptBuildResult` of strings: a plugin's mistake must not
    escape into the turn."""
    if result is None:
        return None
    if not isinstance(result, PromptBuildResult):
        raise TypeError(f"expected a PromptBuildResult or None, got {type(result).__name__}")
    for field in attrs.fields(PromptBuildResult):
        value = getattr(result, field.name)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{field.name} must be a string, got {type(value).__name__}")
    return result


async def run_before_prompt_build(
    hooks: Sequence[PromptHook], context: PromptBuildContext
) -> PromptBuildResult:
    """Run every hook in order and merge their results; failures are logged and skipped."""
    prepend: list[str | None] = []
    prepend_system: list[str | None] = []
    append_system: list[str | None] = []
    system_prompt: str | None = None
    for index, hook in enumerate(hooks):
        try:
            result = _checked(await hook(context))
        except Exception as error:
            _log.warning("before_prompt_build hook failed", hook=index, error=format_error(error))
            continue
        if result is None:
            continue
        prepend.append(result.prepend_context)
        prepend_system.append(result.prepend_system_context)
        append_system.append(result.append_system_context)
        if result.system_prompt is not None:
            system_prompt = result.system_prompt
    return PromptBuildResult(
        prepend_context=join_sections(*prepend),
        system_prompt=system_prompt,
        prepend_system_context=join_sections(*prepend_system),
        append_system_context=join_sections(*append_system),
    )
