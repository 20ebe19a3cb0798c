"""The context-engine contract: what an engine is, what it is called with, what it returns.

A *context engine* is a memory plugin (lossless-claw is the reference one) that decides what
context the model sees. The harness calls it at fixed points of every turn: ``bootstrap`` when
an existing session is opened, ``assemble`` before the model runs, ``after_turn`` (or
``ingest_batch``, or ``ingest`` per message) after it ran, ``maintain`` afterwards, and
``compact`` when the context must shrink. This module is the Python form of OpenClaw's
``ContextEngine`` interface (reference/openclaw-contract.md section 1): the params and results,
the protocols and the errors. How the records look as JSON is :mod:`.shapes`; how an engine
and what it returns are checked, :mod:`.validation`; how a spec becomes an engine,
:mod:`.loading`; the lifecycle that calls it lives in :mod:`codex_turn.harness.lifecycle`.

*Every method takes one params object and returns a result object.* Every method is async and
takes exactly one frozen attrs *params* object (so the contract can grow a field without
breaking every engine's signature) and returns an attrs *result* object. The harness never
assumes the engine honoured the types (:mod:`.validation` checks each result at the boundary).

*Optional methods are absent, not stubbed.* ``info``, ``ingest``, ``assemble`` and ``compact``
are required (:class:`ContextEngine`, :data:`REQUIRED_METHODS`); ``bootstrap``,
``ingest_batch``, ``after_turn``, ``maintain`` and ``dispose`` are capabilities
(:class:`SupportsBootstrap` ..., :data:`OPTIONAL_METHODS`), found with
:func:`~.validation.optional_method`. An engine that does not maintain has no ``maintain``
attribute at all, and the harness behaves as OpenClaw does for such engines.

*An engine may offer the model tools.* ``tools`` declares them for a session
(:class:`EngineTool`: name, description, JSON input schema) and ``call_tool`` answers a call;
the two come together or not at all (:data:`TOOL_METHODS`, :class:`SupportsTools`). The turn
registers them beside the host's dynamic tools and fills each call's session identity itself,
so a model can never ask an engine about another session
(:mod:`codex_turn.harness.turn.engine_tools`).

*AgentMessages stay plain JSON dicts.* Messages (``user``, ``assistant``, ``toolResult``,
``custom`` and pi's synthetic summary roles, with ``text``/``image``/``thinking``/``toolCall``
blocks) are ``dict[str, Any]``, never attrs classes: engines and transcripts carry keys this
library does not know, and a round trip through the converter must keep them byte for byte.
The harness passes fresh lists but shares the message dicts with the transcript reader's
cache, so engines must treat received messages as read-only (copy before changing one).

*The legacy engine is "no engine".* :class:`LegacyContextEngine` (id ``"legacy"``) exists so
that code which always holds *some* engine can still say "none configured";
:func:`~.validation.is_active_engine` is false for it, and the harness then makes no
lifecycle calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Literal, Protocol, runtime_checkable

import anyio
import attrs

from codex_turn._json import AgentMessage
from codex_turn.errors import CodexTurnError

__all__ = [
    "CURRENT_TURN_FENCE_V1",
    "KNOWN_CURRENT_TURN_FENCES",
    "KNOWN_TURN_ADVANCEMENT_IDEMPOTENCY",
    "LEGACY_ENGINE_ID",
    "OPTIONAL_METHODS",
    "PROMPT_AUTHORITIES",
    "REQUIRED_METHODS",
    "TOOL_METHODS",
    "TURN_ADVANCEMENT_IDEMPOTENCY_V1",
    "AbortSignal",
    "AfterTurnParams",
    "AgentMessage",
    "AssembleParams",
    "AssembleResult",
    "BootstrapParams",
    "BootstrapResult",
    "CompactDetails",
    "CompactParams",
    "CompactResult",
    "ContextEngine",
    "ContextEngineInfo",
    "ContextProjection",
    "EngineContractError",
    "EngineContractViolation",
    "EngineError",
    "EngineLoadError",
    "EngineTool",
    "EngineToolConflict",
    "EngineUnavailable",
    "IngestBatchParams",
    "IngestBatchResult",
    "IngestParams",
    "IngestResult",
    "InvalidEngineResult",
    "LegacyContextEngine",
    "MaintainParams",
    "MaintenanceResult",
    "PromptAuthority",
    "RuntimeContext",
    "SupportsAfterTurn",
    "SupportsBootstrap",
    "SupportsDispose",
    "SupportsIngestBatch",
    "SupportsMaintain",
    "SupportsTools",
    "ToolCallParams",
    "ToolCallResult",
    "ToolsParams",
    "ToolsResult",
    "TranscriptReadFence",
    "TranscriptRewriteReplacement",
    "TranscriptRewriteRequest",
    "TranscriptRewriteResult",
    "TranscriptSemantics",
]

#: The open bag of host facts an engine receives (OpenClaw's ``ContextEngineRuntimeContext``).
#: Keys are OpenClaw's camelCase names (``tokenBudget``, ``currentTokenCount``, ``workspaceDir``,
#: ``promptCache``, ``rewriteTranscriptEntries`` ...); see ``lifecycle.build_runtime_context``.
RuntimeContext = dict[str, Any]

LEGACY_ENGINE_ID: Final = "legacy"

TurnMaintenanceMode = Literal["foreground", "background"]
#: What an engine may ask of the projection (:class:`ContextProjection`); the thread binding
#: records one more way its thread was projected (``binding.ProjectionMode``: ``fork_base``).
ContextProjectionMode = Literal["per_turn", "thread_bootstrap"]
CompactionTarget = Literal["budget", "threshold"]
#: Whose word the assembly is (OpenClaw's ``promptAuthority``): ``"assembled"``, the engine's
#: assembly is the whole prompt context and the host sends it as it is (within Codex's own
#: input limit); ``"preassembly_may_overflow"``, the host may still have to fit it to the
#: turn's budget (what the harness always did, hence the default).
PromptAuthority = Literal["assembled", "preassembly_may_overflow"]
PROMPT_AUTHORITIES: Final = ("assembled", "preassembly_may_overflow")


# --- Errors ---------------------------------------------------------------------------------


class EngineError(CodexTurnError):
    """Base class of the errors about a context engine (loading it, or what it returned)."""


class InvalidEngineResult(EngineError, TypeError):
    """An engine method returned something that does not have the contract's shape.

    ``str(err)`` reads ``context engine "<id>" <method>() returned an invalid result: <problem>``
    (OpenClaw's wording for assemble, issue #75541), so the log line names the culprit.
    """

    def __init__(self, engine_id: str, method: str, problem: str) -> None:
        super().__init__(
            f'context engine "{engine_id}" {method}() returned an invalid result: {problem}'
        )
        self.engine_id = engine_id
        self.method = method
        self.problem = problem

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.engine_id, self.method, self.problem))


class EngineLoadError(EngineError, ValueError):
    """:func:`load_engine` could not produce an engine from its spec (a ``ValueError`` too).

    ``str(err)`` is one line: ``cannot load context engine '<spec>': <problem>``, where the
    problem names the step that failed (the spec's form, the import, the attribute, the call
    of a class or factory, or the contract check of what it produced).
    """

    def __init__(self, spec: str, problem: str) -> None:
        super().__init__(f"cannot load context engine {spec!r}: {problem}")
        self.spec = spec
        self.problem = problem

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.spec, self.problem))


class EngineContractError(EngineError, TypeError):
    """The object given as the engine is not a context engine (a ``TypeError`` too).

    Raised by :func:`check_engine` (and so at the start of every turn and compaction, before
    anything is read, written or sent) for an object without a valid ``info``, without a
    callable ``ingest``/``assemble``/``compact``, with an optional method that is present but
    not callable, or for a class where an instance was meant. ``problems`` lists each finding.
    """

    def __init__(self, engine: str, problems: Sequence[str]) -> None:
        super().__init__(f"{engine} is not a context engine: {'; '.join(problems)}")
        self.engine = engine
        self.problems = tuple(problems)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.engine, self.problems))


class EngineContractViolation(EngineError):
    """A strict turn (or compaction) saw the engine break the contract while it ran.

    Raised by ``run_codex_turn`` and ``compact_codex_session`` with ``strict=True``, *after*
    the turn ended on its usual fallback path (see :mod:`codex_turn.harness.violations`):
    the first violation of the run, with ``method`` (``assemble``, ``after_turn`` ...) and a
    redacted ``problem``; the original exception is its ``__cause__``. ``result`` is what
    the run returned (the :class:`~codex_turn.TurnResult`, or the compaction's run) and
    ``later`` counts the violations that followed the first one.
    """

    def __init__(self, engine_id: str, method: str, problem: str) -> None:
        super().__init__(
            f'context engine "{engine_id}" broke the contract in {method}(): {problem}'
        )
        self.engine_id = engine_id
        self.method = method
        self.problem = problem
        self.result: Any = None
        self.later = 0

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.engine_id, self.method, self.problem))


class EngineToolConflict(EngineError, ValueError):
    """An engine offers a tool whose name the host's own tools (or another of the engine's)
    already use: the turn is refused before anything is sent, since the model could not tell
    the two apart. ``names``: the clashing names."""

    def __init__(self, engine_id: str, names: Sequence[str]) -> None:
        super().__init__(
            f'context engine "{engine_id}" offers tools whose names are taken: '
            f"{', '.join(sorted(names))}"
        )
        self.engine_id = engine_id
        self.names = tuple(sorted(names))

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.engine_id, self.names))


class EngineUnavailable(EngineError):
    """Raised *by an engine* to say that it failed for operational reasons (its store or a
    service it needs is down), not because of a bug: the harness falls back as for any
    engine failure, and a strict run does not count it as a contract violation."""


# --- Host facts on the params --------------------------------------------------------------


@attrs.frozen
class TranscriptReadFence:
    """How far the host read the transcript for an assembly (OpenClaw's
    ``transcriptReadFence``): ``message_count`` messages, the last with ``last_entry_id``
    (its ``idempotencyKey`` when it has one). Entries past it are this turn's own (the
    current prompt and reply): an engine reading the transcript itself stops there."""

    message_count: int
    last_entry_id: str | None = None


class AbortSignal:
    """A one-way flag the host sets to abort an engine's call (OpenClaw's ``AbortSignal``).

    The engine polls :attr:`aborted` between its steps (or awaits :meth:`wait`); the host
    calls :meth:`abort`. Thread-safe to read; set once (the first reason is kept).
    """

    __slots__ = ("_reason", "_waiters")

    def __init__(self) -> None:
        self._reason: str | None = None
        self._waiters: list[anyio.Event] = []

    @property
    def aborted(self) -> bool:
        return self._reason is not None

    @property
    def reason(self) -> str | None:
        return self._reason

    def abort(self, reason: str = "aborted") -> None:
        if self._reason is None:
            self._reason = reason or "aborted"
            for event in self._waiters:
                event.set()
            self._waiters.clear()

    async def wait(self) -> None:
        """Return once the signal is aborted (at once when it is)."""
        if self._reason is not None:
            return
        event = anyio.Event()
        self._waiters.append(event)
        await event.wait()

    def __repr__(self) -> str:
        return f"AbortSignal(aborted={self.aborted!r}, reason={self._reason!r})"


# --- Info, params and results ---------------------------------------------------------------


# --- Transcript semantics (the durable-turn declaration) ----------------------------------

#: The transcript semantics an engine may declare (OpenClaw's ``info.transcriptSemantics``):
#: assemble sees history *before* the current turn's entry, and the engine applies each turn
#: once per advancement key, atomically. The host's side is :mod:`.durable`.
CURRENT_TURN_FENCE_V1: Final = "before-current-turn-entry-v1"
TURN_ADVANCEMENT_IDEMPOTENCY_V1: Final = "atomic-idempotent-v1"
KNOWN_CURRENT_TURN_FENCES: Final = frozenset({CURRENT_TURN_FENCE_V1})
KNOWN_TURN_ADVANCEMENT_IDEMPOTENCY: Final = frozenset({TURN_ADVANCEMENT_IDEMPOTENCY_V1})


@attrs.frozen
class TranscriptSemantics:
    """An engine's durable-turn declaration; an engine with it implements ``commit_turn``.

    Plain strings, checked at load against the known versions (:mod:`.validation`): an
    engine written for a later contract is refused with a clear error, never half-served.
    """

    current_turn_fence: str
    turn_advancement_idempotency: str

    @classmethod
    def v1(cls) -> TranscriptSemantics:
        """The semantics this host serves: the fence and atomic, idempotent advancement."""
        return cls(CURRENT_TURN_FENCE_V1, TURN_ADVANCEMENT_IDEMPOTENCY_V1)


@attrs.frozen
class ContextEngineInfo:
    """Who the engine is and which host policies it asks for."""

    id: str
    name: str
    version: str | None = None
    #: The engine runs its own compaction; Codex native compaction becomes secondary.
    owns_compaction: bool = False
    #: ``"background"`` defers turn maintenance to a scheduler instead of awaiting it inline.
    turn_maintenance_mode: TurnMaintenanceMode = "foreground"
    #: Declared: the host settles each turn with ``commit_turn`` (durable turns) instead of
    #: ``after_turn`` / ``ingest_batch`` / ``ingest``.
    transcript_semantics: TranscriptSemantics | None = None
    #: What the engine needs of its host (OpenClaw's ``hostRequirements``): capability names
    #: of :data:`~.host.HOST_CAPABILITIES`; a host that lacks one refuses the engine when it
    #: is loaded, before any turn (:class:`~.host.HostRequirementsUnmet`).
    host_requirements: frozenset[str] = frozenset()


@attrs.frozen
class ContextProjection:
    """How the engine wants its assembly projected (later OpenClaw addition, optional).

    Without it the harness uses the per-turn projection. ``thread_bootstrap`` asks for the
    context to be projected once per ``epoch`` into a fresh thread (reference section 4.1).
    """

    mode: ContextProjectionMode
    epoch: str | None = None
    fingerprint: str | None = None


@attrs.frozen
class BootstrapParams:
    session_id: str
    session_file: str
    session_key: str | None = None


@attrs.frozen
class BootstrapResult:
    bootstrapped: bool
    imported_messages: int | None = None
    reason: str | None = None


@attrs.frozen
class IngestParams:
    session_id: str
    message: AgentMessage
    session_key: str | None = None
    is_heartbeat: bool = False


@attrs.frozen
class IngestResult:
    #: False means a duplicate or a no-op, not a failure.
    ingested: bool


@attrs.frozen
class IngestBatchParams:
    session_id: str
    messages: list[AgentMessage]
    session_key: str | None = None
    is_heartbeat: bool = False


@attrs.frozen
class IngestBatchResult:
    ingested_count: int


@attrs.frozen
class AfterTurnParams:
    session_id: str
    session_file: str
    #: The whole session after the turn (history, then this turn's messages).
    messages: list[AgentMessage]
    #: ``messages[:pre_prompt_message_count]`` existed before the turn; the rest are new.
    pre_prompt_message_count: int
    session_key: str | None = None
    auto_compaction_summary: str | None = None
    is_heartbeat: bool = False
    token_budget: int | None = None
    runtime_context: RuntimeContext | None = None


@attrs.frozen
class AssembleParams:
    session_id: str
    #: The mirrored history without hidden runtime-context messages; never the current prompt.
    messages: list[AgentMessage]
    session_key: str | None = None
    token_budget: int | None = None
    #: Names of the tools the model will have this turn (empty when tools are disabled).
    available_tools: frozenset[str] | None = None
    citations_mode: str | None = None
    model: str | None = None
    #: The raw user prompt of this turn (not trimmed, not projected).
    prompt: str | None = None
    # Host facts added after the port (OpenClaw's camelCase names in brackets).
    #: The model the turn runs on, as its provider names it (``modelId``), and the provider
    #: (``providerId``); ``model`` above stays the host's model setting.
    model_id: str | None = None
    provider_id: str | None = None
    #: The model the user asked for (``requestedModelId``) when the host runs another one,
    #: and why (``fallbackReason``); ``degraded_reason``: the turn runs with less than usual
    #: (no tools, a refused resume ...), said in a word or two.
    requested_model_id: str | None = None
    fallback_reason: str | None = None
    degraded_reason: str | None = None
    #: The turn runs in a sandbox (Codex's sandbox policy is not ``danger-full-access``).
    sandboxed: bool | None = None
    #: The same runtime context as after_turn and maintain (``runtimeContext``).
    runtime_context: RuntimeContext | None = None
    #: How far the host read the transcript for ``messages`` (``transcriptReadFence``).
    transcript_read_fence: TranscriptReadFence | None = None
    #: This turn is a heartbeat (a scheduled wake, ``TurnParams.heartbeat``): OpenClaw's
    #: ``isHeartbeat``.
    is_heartbeat: bool = False


@attrs.frozen
class AssembleResult:
    messages: list[AgentMessage]
    estimated_tokens: int
    #: Appended (after a blank line) to Codex's developer instructions.
    system_prompt_addition: str | None = None
    context_projection: ContextProjection | None = None
    prompt_authority: PromptAuthority = "preassembly_may_overflow"


@attrs.frozen
class MaintainParams:
    session_id: str
    session_file: str
    session_key: str | None = None
    runtime_context: RuntimeContext | None = None


@attrs.frozen
class MaintenanceResult:
    """OpenClaw's ``TranscriptRewriteResult`` (alias ``ContextEngineMaintenanceResult``)."""

    changed: bool
    bytes_freed: int
    rewritten_entries: int
    reason: str | None = None


TranscriptRewriteResult = MaintenanceResult


@attrs.frozen
class TranscriptRewriteReplacement:
    entry_id: str
    message: AgentMessage


@attrs.frozen
class TranscriptRewriteRequest:
    """What ``runtime_context["rewriteTranscriptEntries"]`` accepts during maintenance."""

    replacements: list[TranscriptRewriteReplacement]
    allowed_rewrite_suffix_entry_ids: list[str] | None = None


@attrs.frozen
class CompactParams:
    session_id: str
    session_file: str
    session_key: str | None = None
    token_budget: int | None = None
    force: bool = False
    current_token_count: int | None = None
    compaction_target: CompactionTarget | None = None
    custom_instructions: str | None = None
    runtime_context: RuntimeContext | None = None
    #: Why the compaction is forced (``forceReason``: ``"manual"``, ``"overflow"`` ...).
    force_reason: str | None = None
    #: What made the host compact before a turn (``preflightCompactionTrigger``), when it did.
    preflight_trigger: str | None = None
    #: Set when the host no longer wants the compaction (OpenClaw's abort signal): an engine
    #: checks it between steps and stops there, reporting ``compacted`` honestly.
    abort_signal: AbortSignal | None = attrs.field(default=None, eq=False)


@attrs.frozen
class CompactDetails:
    """The ``result`` of a compaction: what was summarised and what it saved."""

    tokens_before: int
    summary: str | None = None
    first_kept_entry_id: str | None = None
    tokens_after: int | None = None
    details: Any = None
    #: Set when the engine rotated the transcript to a new session.
    session_id: str | None = None
    session_file: str | None = None


@attrs.frozen
class CompactResult:
    ok: bool
    compacted: bool
    reason: str | None = None
    result: CompactDetails | None = None


@attrs.frozen
class EngineTool:
    """A tool an engine offers the model (a Codex dynamic tool: the name matches
    ``[a-zA-Z0-9_-]+``, the schema is a JSON schema of the arguments object)."""

    name: str
    description: str
    input_schema: dict[str, Any]


@attrs.frozen
class ToolsParams:
    session_id: str
    session_key: str | None = None


@attrs.frozen
class ToolsResult:
    tools: list[EngineTool]


@attrs.frozen
class ToolCallParams:
    """One call of an engine tool. The session identity is the turn's, never the model's."""

    session_id: str
    name: str
    #: The model's arguments, already checked against the tool's input schema.
    arguments: dict[str, Any]
    session_key: str | None = None


@attrs.frozen
class ToolCallResult:
    text: str
    #: ``False``: the tool failed or refused; ``text`` says why, to the model.
    success: bool = True


# --- The protocol ---------------------------------------------------------------------------


@runtime_checkable
class ContextEngine(Protocol):
    """The required part of the contract. Optional methods are the ``Supports*`` protocols."""

    @property
    def info(self) -> ContextEngineInfo: ...

    async def ingest(self, params: IngestParams) -> IngestResult: ...

    async def assemble(self, params: AssembleParams) -> AssembleResult: ...

    async def compact(self, params: CompactParams) -> CompactResult: ...


class SupportsBootstrap(Protocol):
    async def bootstrap(self, params: BootstrapParams) -> BootstrapResult: ...


class SupportsIngestBatch(Protocol):
    async def ingest_batch(self, params: IngestBatchParams) -> IngestBatchResult: ...


class SupportsAfterTurn(Protocol):
    async def after_turn(self, params: AfterTurnParams) -> None: ...


class SupportsMaintain(Protocol):
    async def maintain(self, params: MaintainParams) -> MaintenanceResult | None: ...


class SupportsDispose(Protocol):
    async def dispose(self) -> None: ...


class SupportsTools(Protocol):
    async def tools(self, params: ToolsParams) -> ToolsResult: ...

    async def call_tool(self, params: ToolCallParams) -> ToolCallResult: ...


#: The methods every engine has (besides ``info``), and those it may lack.
REQUIRED_METHODS: Final = ("ingest", "assemble", "compact")
OPTIONAL_METHODS: Final = ("bootstrap", "ingest_batch", "after_turn", "maintain", "dispose")
#: The engine-tools capability: both methods, or neither.
TOOL_METHODS: Final = ("tools", "call_tool")


# --- The legacy engine ----------------------------------------------------------------------


class LegacyContextEngine:
    """OpenClaw's built-in default, which the harness treats as *no engine*.

    It has no ``bootstrap`` and no ``maintain``; ``ingest`` is a no-op, ``assemble`` passes the
    history through, ``after_turn`` and ``dispose`` do nothing. OpenClaw's legacy ``compact``
    delegates to a built-in summariser; here compaction belongs to Codex natively, so it
    reports that it compacted nothing and the harness's native path applies.
    """

    info: Final = ContextEngineInfo(
        id=LEGACY_ENGINE_ID, name="Legacy Context Engine", version="1.0.0"
    )

    async def ingest(self, params: IngestParams) -> IngestResult:
        return IngestResult(ingested=False)

    async def assemble(self, params: AssembleParams) -> AssembleResult:
        return AssembleResult(messages=list(params.messages), estimated_tokens=0)

    async def after_turn(self, params: AfterTurnParams) -> None:
        return None

    async def compact(self, params: CompactParams) -> CompactResult:
        return CompactResult(
            ok=True, compacted=False, reason="legacy engine delegates compaction to Codex"
        )

    async def dispose(self) -> None:
        return None
