"""What the host offers an engine, and the hooks an engine may add: the contract's later part.

OpenClaw's contract grew after the port (reference/openclaw-contract-2026.md section 2); this
module is that growth in Python, apart from :mod:`.contract` (the original contract), with the
same rules: one frozen attrs params object in, one result out, optional methods absent rather
than stubbed, camelCase JSON through :mod:`.shapes`, every answer checked at the boundary.

*Host capabilities, checked at load.* The host declares what it offers
(:data:`CODEX_HOST_CAPABILITIES` for this harness); an engine declares what it needs
(``ContextEngineInfo.host_requirements``). :func:`check_host_requirements` refuses an engine
whose needs are not all offered with :class:`HostRequirementsUnmet`, before any turn: an
engine that cannot work here says so once, instead of silently degrading every turn.

*Model access for engines.* ``runtime_context["llm"]`` is a :class:`HostLlm` when the host can
lend its model (capability ``runtime-llm-complete``): ``await llm.complete(LlmRequest(...))``
runs one bounded, cancellable completion on the host's own model path (here: an ephemeral
Codex thread on the session's app-server, :mod:`codex_turn.harness.host_llm`) and returns an
:class:`LlmCompletion`. Nothing of a request or an answer is logged. :func:`runtime_llm` reads
it from a runtime context (``None`` when the host lent none). Also in the runtime context:
``cwd`` (the turn's working directory) and ``promptCache`` (:class:`PromptCacheFacts`: the
retention the host's model path keeps a prompt cache, what the last call observed, and when
the cache is expected to lapse).

*Lifecycle hooks.* ``before_session_reset`` (the engine archives or keeps a session's state
when the host resets it), ``session_end``, ``prepare_subagent_spawn`` / ``on_subagent_ended``
(the engine seeds a child session and folds its result back; the host side is
:mod:`codex_turn.harness.session_lifecycle`) and ``control`` / ``control_capabilities`` (operator
actions: status, doctor, rotate). Each is optional (:data:`HOST_HOOK_METHODS`), found with
:func:`~.validation.optional_method` like the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal, Protocol, runtime_checkable

import attrs

from .contract import EngineError, RuntimeContext

__all__ = [
    "CODEX_HOST_CAPABILITIES",
    "CONTROL_ACTIONS",
    "HOST_CAPABILITIES",
    "HOST_HOOK_METHODS",
    "LLM_PURPOSES",
    "ControlAction",
    "ControlCapabilities",
    "ControlRequest",
    "ControlResult",
    "ControlUnsupported",
    "HostLlm",
    "HostRequirementsUnmet",
    "LlmCompleteError",
    "LlmCompleteFailed",
    "LlmCompleteTimedOut",
    "LlmCompletion",
    "LlmMessage",
    "LlmRequest",
    "LlmRequestInvalid",
    "PromptCacheFacts",
    "SessionEndParams",
    "SessionResetParams",
    "SessionResetResult",
    "SubagentEndedParams",
    "SubagentSpawnParams",
    "SubagentSpawnPreparation",
    "SupportsControl",
    "SupportsSessionEnd",
    "SupportsSessionReset",
    "SupportsSubagents",
    "check_host_requirements",
    "runtime_llm",
    "unmet_host_requirements",
]

# --- Host capabilities ----------------------------------------------------------------------

#: Every capability name a host may declare (OpenClaw's seven, then this harness's own).
HOST_CAPABILITIES: Final = (
    "bootstrap",
    "assemble-before-prompt",
    "after-turn",
    "maintain",
    "compact",
    "runtime-llm-complete",
    "thread-bootstrap-projection",
    # Ours: what else this harness really does for an engine.
    "per-turn-projection",
    "prompt-authority",
    "prompt-cache-observation",
    "compaction-abort",
    "session-reset",
    "session-end",
    "subagents",
    "control",
)

#: What the Codex harness offers. ``runtime-llm-complete`` needs an app-server that can run
#: an ephemeral thread (the real one can): :func:`codex_turn.harness.host_llm.host_capabilities`
#: drops it for a port that cannot.
CODEX_HOST_CAPABILITIES: Final = frozenset(HOST_CAPABILITIES)


class HostRequirementsUnmet(EngineError):
    """The engine needs what this host does not offer: refused at load, before any turn.

    ``missing`` names the capabilities (sorted); an unknown name is missing too (no host
    offers it), and ``unknown`` lists those, since they are usually a typo.
    """

    def __init__(self, engine_id: str, missing: tuple[str, ...], unknown: tuple[str, ...]) -> None:
        hint = f" (unknown: {', '.join(unknown)})" if unknown else ""
        super().__init__(
            f'context engine "{engine_id}" needs what this host does not offer: '
            f"{', '.join(missing)}{hint}"
        )
        self.engine_id = engine_id
        self.missing = missing
        self.unknown = unknown

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.engine_id, self.missing, self.unknown))


def unmet_host_requirements(required: frozenset[str], offered: frozenset[str]) -> tuple[str, ...]:
    """The required capabilities ``offered`` lacks, sorted (empty: the engine can run)."""
    return tuple(sorted(required - offered))


def check_host_requirements(
    engine_id: str, required: frozenset[str], offered: frozenset[str] = CODEX_HOST_CAPABILITIES
) -> None:
    """Raise :class:`HostRequirementsUnmet` unless ``offered`` covers ``required``."""
    missing = unmet_host_requirements(required, offered)
    if missing:
        unknown = tuple(name for name in missing if name not in HOST_CAPABILITIES)
        raise HostRequirementsUnmet(engine_id, missing, unknown)


# --- Model access: runtime_context["llm"] ---------------------------------------------------

#: What an engine may ask the model for (logged as the purpose, never the content).
LLM_PURPOSES: Final = ("summary", "classification", "extraction", "other")
LlmRole = Literal["user", "assistant"]


@attrs.frozen
class LlmMessage:
    role: LlmRole
    content: str


def _message_tuple(messages: Iterable[LlmMessage]) -> tuple[LlmMessage, ...]:
    # A typed converter: ``converter=tuple`` leaves the field's type unresolved for mypy.
    return tuple(messages)


@attrs.frozen
class LlmRequest:
    """One completion (OpenClaw's ``llm.complete({messages, systemPrompt, model?, maxTokens?,
    temperature?, purpose})``). ``messages`` are the conversation to complete, oldest first,
    ending with a user message; ``purpose`` is one of :data:`LLM_PURPOSES`."""

    messages: tuple[LlmMessage, ...] = attrs.field(converter=_message_tuple)
    purpose: str
    system_prompt: str | None = None
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None


@attrs.frozen
class LlmCompletion:
    """The model's answer: its final text (never its reasoning), and the model that wrote it
    when the host knows. ``truncated``: the host cut the text to ``max_tokens``."""

    text: str
    model: str | None = None
    truncated: bool = False


class LlmCompleteError(EngineError):
    """Base of what ``llm.complete`` raises: the engine decides what to do without a model."""


class LlmRequestInvalid(LlmCompleteError, ValueError):
    """The request is malformed or too large (``problem`` says which); nothing was sent."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"llm.complete request refused: {problem}")
        self.problem = problem

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.problem,))


class LlmCompleteFailed(LlmCompleteError):
    """The model did not answer (the turn failed, the app-server is gone, a login is
    missing); ``reason`` is a word (``failed``, ``unavailable``, ``unauthorized`` ...)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"llm.complete failed: {reason}")
        self.reason = reason

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.reason,))


class LlmCompleteTimedOut(LlmCompleteFailed):
    """The completion did not end within the host's bound (it was interrupted)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"timed out after {seconds:g}s")
        self.seconds = seconds

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.seconds,))


@runtime_checkable
class HostLlm(Protocol):
    """``runtime_context["llm"]``: the host's model, lent to the engine."""

    async def complete(self, request: LlmRequest) -> LlmCompletion:
        """One completion; raises :class:`LlmCompleteError` (never anything else, but
        cancellation). Bounded by the host in time and size; cancellable."""
        ...


def runtime_llm(runtime_context: RuntimeContext | Mapping[str, Any] | None) -> HostLlm | None:
    """The model the host lent in ``runtime_context`` (``None``: it lent none)."""
    llm = (runtime_context or {}).get("llm")
    return llm if isinstance(llm, HostLlm) else None


# --- Prompt cache ---------------------------------------------------------------------------

PromptCacheRetention = Literal["none", "short", "long"]
PromptCacheObservation = Literal["hit", "partial", "miss", "unknown"]


@attrs.frozen
class PromptCacheFacts:
    """``runtime_context["promptCache"]`` as a record (OpenClaw's ``promptCache``):
    ``retention`` how long the host's model path keeps a prompt cache (``short``: minutes),
    ``observation`` what the last call saw (cached input tokens: all, some or none of the
    prompt), ``expires_at`` (epoch milliseconds) when the cache is expected to lapse, and the
    last call's usage as Codex reported it."""

    retention: PromptCacheRetention = "short"
    observation: PromptCacheObservation = "unknown"
    expires_at: int | None = None
    last_call_usage: Mapping[str, int] | None = None


# --- Session reset and end ------------------------------------------------------------------


@attrs.frozen
class SessionResetParams:
    """``before_session_reset``: the host is about to reset the session (a new conversation
    on the same key, OpenClaw's ``/new``); ``reason`` says why (``"user"``, ``"idle"`` ...)."""

    session_id: str
    session_file: str
    session_key: str | None = None
    reason: str | None = None


@attrs.frozen
class SessionResetResult:
    """What the engine did with the session's state: ``archived`` (kept apart, no longer
    assembled) or ``kept`` (it outlives the reset on purpose)."""

    action: Literal["archived", "kept"]
    reason: str | None = None


@attrs.frozen
class SessionEndParams:
    """``session_end``: the host will run no more turns of this session (it may resume it
    later: the engine releases what it holds for it, it does not delete)."""

    session_id: str
    session_file: str
    session_key: str | None = None
    reason: str | None = None


# --- Subagents ------------------------------------------------------------------------------


@attrs.frozen
class SubagentSpawnParams:
    """``prepare_subagent_spawn``: a child session is about to run ``task`` for the parent."""

    parent_session_id: str
    child_session_id: str
    child_session_file: str
    task: str
    parent_session_key: str | None = None
    child_session_key: str | None = None
    parent_session_file: str | None = None


@attrs.frozen
class SubagentSpawnPreparation:
    """The engine's seed for the child: ``system_prompt_addition`` goes into the child's
    developer instructions on each of its turns; ``seeded`` says the engine also prepared the
    child's own context in its store (its assemble for the child key shows it)."""

    system_prompt_addition: str | None = None
    seeded: bool = False


SubagentOutcome = Literal["completed", "failed", "aborted", "spawn_failed"]


@attrs.frozen
class SubagentEndedParams:
    """``on_subagent_ended``: the child ended; ``result_text`` is its final answer (bounded
    by the host), ``outcome`` how it ended."""

    parent_session_id: str
    child_session_id: str
    outcome: SubagentOutcome
    parent_session_key: str | None = None
    child_session_key: str | None = None
    result_text: str | None = None


# --- Control --------------------------------------------------------------------------------

ControlAction = Literal["status", "doctor", "rotate"]
CONTROL_ACTIONS: Final = ("status", "doctor", "rotate")


@attrs.frozen
class ControlCapabilities:
    """What ``control`` accepts (OpenClaw's ``getControlCapabilities``)."""

    actions: frozenset[str]


@attrs.frozen
class ControlRequest:
    """One operator action: ``status`` (read-only facts), ``doctor`` (check; ``repair``
    also fixes), ``rotate`` (start a new conversation for ``session_key``, archiving the
    old one)."""

    action: ControlAction
    session_key: str | None = None
    repair: bool = False


@attrs.frozen
class ControlResult:
    """``ok``: the action succeeded and found nothing wrong; ``summary`` one line for an
    operator (no message text); ``details`` JSON-compatible facts."""

    ok: bool
    action: str
    summary: str
    details: Any = None


class ControlUnsupported(EngineError, ValueError):
    """The engine has no ``control``, or does not offer the action asked for."""

    def __init__(self, engine_id: str, action: str, offered: tuple[str, ...]) -> None:
        said = f"it offers {', '.join(offered)}" if offered else "it offers no control actions"
        super().__init__(f'context engine "{engine_id}" cannot {action}: {said}')
        self.engine_id = engine_id
        self.action = action
        self.offered = offered

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.engine_id, self.action, self.offered))


# --- The protocols --------------------------------------------------------------------------


class SupportsSessionReset(Protocol):
    async def before_session_reset(self, params: SessionResetParams) -> SessionResetResult: ...


class SupportsSessionEnd(Protocol):
    async def session_end(self, params: SessionEndParams) -> None: ...


class SupportsSubagents(Protocol):
    async def prepare_subagent_spawn(
        self, params: SubagentSpawnParams
    ) -> SubagentSpawnPreparation | None: ...

    async def on_subagent_ended(self, params: SubagentEndedParams) -> None: ...


class SupportsControl(Protocol):
    def control_capabilities(self) -> ControlCapabilities: ...

    async def control(self, request: ControlRequest) -> ControlResult: ...


#: The optional methods of this part of the contract (absent, or callable: check_engine).
HOST_HOOK_METHODS: Final = (
    "before_session_reset",
    "session_end",
    "prepare_subagent_spawn",
    "on_subagent_ended",
    "control_capabilities",
    "control",
)
