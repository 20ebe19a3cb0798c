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

import attrs

from codex_turn._json import AgentMessage
from codex_turn.errors import CodexTurnError

__all__ = [
    "LEGACY_ENGINE_ID",
    "OPTIONAL_METHODS",
    "REQUIRED_METHODS",
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
    "EngineUnavailable",
    "IngestBatchParams",
    "IngestBatchResult",
    "IngestParams",
    "IngestResult",
    "InvalidEngineResult",
    "LegacyContextEngine",
    "MaintainParams",
    "MaintenanceResult",
    "RuntimeContext",
    "SupportsAfterTurn",
    "SupportsBootstrap",
    "SupportsDispose",
    "SupportsIngestBatch",
    "SupportsMaintain",
    "TranscriptRewriteReplacement",
    "TranscriptRewriteRequest",
    "TranscriptRewriteResult",
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


class EngineUnavailable(EngineError):
    """Raised *by an engine* to say that it failed for operational reasons (its store or a
    service it needs is down), not because of a bug: the harness falls back as for any
    engine failure, and a strict run does not count it as a contract violation."""


# --- Info, params and results ---------------------------------------------------------------


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


#: The methods every engine has (besides ``info``), and those it may lack.
REQUIRED_METHODS: Final = ("ingest", "assemble", "compact")
OPTIONAL_METHODS: Final = ("bootstrap", "ingest_batch", "after_turn", "maintain", "dispose")


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
