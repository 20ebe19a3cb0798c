"""The context-engine contract: what an engine is, what it is called with, what it returns.

A *context engine* is a memory plugin (lossless-claw is the reference one) that decides what
context the model sees. The harness calls it at fixed points of every turn: ``bootstrap`` when
an existing session is opened, ``assemble`` before the model runs, ``after_turn`` (or
``ingest_batch``, or ``ingest`` per message) after it ran, ``maintain`` afterwards, and
``compact`` when the context must shrink. This module is the Python form of OpenClaw's
``ContextEngine`` interface (reference/openclaw-contract.md section 1); the lifecycle that calls
it lives in :mod:`codex_turn.harness.lifecycle`.

Theory of operation
-------------------

*An engine is a plugin, so the harness trusts nothing it returns.* Every method is async and
takes exactly one frozen attrs *params* object (so the contract can grow a field without
breaking every engine's signature) and returns an attrs *result* object. The harness never
assumes the engine honoured the types: :func:`ensure_assemble_result` and
:func:`coerce_result` check a returned value at the boundary and turn anything malformed into
one :class:`InvalidEngineResult` that names the engine, the method and what was wrong (OpenClaw
bug #75541: an engine returning ``None`` crashed the runner deep inside the projection). An
engine may also return the camelCase JSON object OpenClaw uses (an engine ported from
TypeScript, or one behind an IPC bridge); it is structured by the same strict converter.

*Optional methods are absent, not stubbed.* ``info``, ``ingest``, ``assemble`` and ``compact``
are required (:class:`ContextEngine`); ``bootstrap``, ``ingest_batch``, ``after_turn``,
``maintain`` and ``dispose`` are capabilities (:class:`SupportsBootstrap` ...) detected with
``getattr`` + ``callable`` by :func:`engine_capabilities`. An engine that does not maintain has
no ``maintain`` attribute at all, and the harness behaves as OpenClaw does for such engines.

*AgentMessages stay plain JSON dicts.* Messages (``user``, ``assistant``, ``toolResult``,
``custom`` and pi's synthetic summary roles, with ``text``/``image``/``thinking``/``toolCall``
blocks) are ``dict[str, Any]``, never attrs classes: engines and transcripts carry keys this
library does not know, and a round trip through the converter must keep them byte for byte.
The harness passes fresh lists but shares the message dicts with the transcript reader's
cache, so engines must treat received messages as read-only (copy before changing one).

*The legacy engine is "no engine".* :class:`LegacyContextEngine` (id ``"legacy"``) exists so
that code which always holds *some* engine can still say "none configured";
:func:`is_active_engine` is false for it, and the harness then makes no lifecycle calls.

JSON shapes
-----------

One module-level cattrs :data:`converter` maps every attrs class here to and from OpenClaw's
camelCase JSON (``estimated_tokens`` <-> ``estimatedTokens``). Unstructuring omits fields that
still hold their default (OpenClaw's optional ``?`` fields are absent, not ``null``);
structuring ignores unknown keys and is *strict* about primitives (``"5"`` is not an integer,
``True`` is not a number), because silently coercing an engine's mistake would hide it.

Checking and loading
--------------------

*An engine is checked before it is used, and a string is a spec, never "no engine".*
:func:`check_engine` is the static part of the contract (a valid ``info``, callable
required methods, optional methods absent or callable, an instance and not a class) and
raises :class:`EngineContractError`; :func:`load_engine` turns the one spec form
``"package.module:attribute"`` into an engine or raises :class:`EngineLoadError` (a
``ValueError``) naming the failed step; :func:`resolve_engine` applies the right one to
whatever a runner passed, and every turn and compaction calls it first, before any I/O.
What an engine does *while it runs* (a result of the wrong shape, an exception) is judged at
the lifecycle's fallback points by :mod:`codex_turn.harness.violations`.

Why one file of ~990 lines: it is the contract, and the contract is read as one text (the
params and results, the converter that defines their JSON, the validation at the boundary,
:class:`EngineHandle`, the static check and the loader); splitting it would scatter one
vocabulary across modules that every engine author would have to read together anyway.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, Literal, Protocol, TypeVar, runtime_checkable

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from codex_turn._log import mask_session_key
from codex_turn.errors import CodexTurnError

__all__ = [
    "LEGACY_ENGINE_ID",
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
    "EngineCapabilities",
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
    "check_engine",
    "coerce_result",
    "converter",
    "engine_capabilities",
    "engine_id",
    "engine_info",
    "ensure_assemble_result",
    "from_json",
    "is_active_engine",
    "json_type_name",
    "load_engine",
    "optional_method",
    "resolve_engine",
    "to_json",
]

#: One message of a transcript or an assembly: a JSON object, unknown keys preserved.
AgentMessage = dict[str, Any]

#: The open bag of host facts an engine receives (OpenClaw's ``ContextEngineRuntimeContext``).
#: Keys are OpenClaw's camelCase names (``tokenBudget``, ``currentTokenCount``, ``workspaceDir``,
#: ``promptCache``, ``rewriteTranscriptEntries`` ...); see ``lifecycle.build_runtime_context``.
RuntimeContext = dict[str, Any]

LEGACY_ENGINE_ID: Final = "legacy"

TurnMaintenanceMode = Literal["foreground", "background"]
ProjectionMode = Literal["per_turn", "thread_bootstrap"]
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

    mode: ProjectionMode
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


_REQUIRED_METHODS: Final = ("ingest", "assemble", "compact")
_OPTIONAL_METHODS: Final = ("bootstrap", "ingest_batch", "after_turn", "maintain", "dispose")


@attrs.frozen
class EngineCapabilities:
    """Which optional methods an engine has (detected, never required)."""

    bootstrap: bool
    ingest_batch: bool
    after_turn: bool
    maintain: bool
    dispose: bool


def optional_method(engine: object, name: str) -> Callable[..., Awaitable[Any]] | None:
    """``engine.<name>`` when it is present and callable, else ``None``."""
    method = getattr(engine, name, None)
    return method if callable(method) else None


def engine_capabilities(engine: object) -> EngineCapabilities:
    return EngineCapabilities(
        **{name: optional_method(engine, name) is not None for name in _OPTIONAL_METHODS}
    )


@attrs.frozen
class EngineHandle:
    """An active engine, validated once per turn: its info and capabilities, read once.

    The orchestrator and compaction hold one of these instead of a bare ``object`` that each
    step would re-validate; ``None`` in their place means "no engine" (none, or the legacy
    engine).
    """

    engine: Any
    info: ContextEngineInfo
    capabilities: EngineCapabilities

    @property
    def id(self) -> str:
        return self.info.id

    @classmethod
    def of(cls, engine: object | None) -> EngineHandle | None:
        """The handle of an active engine, ``None`` for no engine or the legacy engine.

        Raises :class:`InvalidEngineResult` when the engine's ``info`` is invalid.
        """
        if not is_active_engine(engine):
            return None
        return cls(engine, engine_info(engine), engine_capabilities(engine))

    @classmethod
    def unchecked(cls, engine: object) -> EngineHandle:
        """A handle for an engine whose ``info`` is invalid: foreground defaults, real id."""
        info = ContextEngineInfo(id=engine_id(engine), name=engine_id(engine))
        return cls(engine, info, engine_capabilities(engine))


def engine_log_fields(engine: object, session_key: str | None, **extra: Any) -> dict[str, Any]:
    """The fields every engine log line carries: the engine's id and the masked session key."""
    return {"engine": engine_id(engine), "session_key": mask_session_key(session_key), **extra}


def engine_info(engine: object) -> ContextEngineInfo:
    """The engine's validated :class:`ContextEngineInfo` (a camelCase mapping is accepted)."""
    info = getattr(engine, "info", None)
    if isinstance(info, ContextEngineInfo):
        if not isinstance(info.id, str) or not info.id:
            raise InvalidEngineResult("<unknown>", "info", "info.id must be a non-empty string")
        return info
    if isinstance(info, Mapping):
        parsed = coerce_result(info, ContextEngineInfo, engine_id="<unknown>", method="info")
        if not parsed.id:
            raise InvalidEngineResult("<unknown>", "info", "info.id must be a non-empty string")
        return parsed
    raise InvalidEngineResult(
        "<unknown>", "info", f"expected a ContextEngineInfo (got {json_type_name(info)})"
    )


def engine_id(engine: object) -> str:
    """The engine's id for log lines; never raises (``"<unknown>"`` for a broken ``info``)."""
    info = getattr(engine, "info", None)
    value = info.get("id") if isinstance(info, Mapping) else getattr(info, "id", None)
    return value if isinstance(value, str) and value else "<unknown>"


def is_active_engine(engine: object | None) -> bool:
    """True for a present, non-legacy engine: only such an engine gets lifecycle calls."""
    return engine is not None and engine_id(engine) != LEGACY_ENGINE_ID


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


# --- The converter --------------------------------------------------------------------------


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def json_type_name(value: object) -> str:
    """The JSON name of a value's type (``null``, ``array``, ``object`` ...), for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _strict_str(value: object, _: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string (got {json_type_name(value)})")
    return value


def _strict_bool(value: object, _: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected a boolean (got {json_type_name(value)})")
    return value


def _strict_int(value: object, _: object) -> int:
    # Token counts from JavaScript engines arrive as floats; a finite float is floored.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number (got {json_type_name(value)})")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError("expected a finite number")
        return math.floor(value)
    return value


def _make_converter() -> cattrs.Converter:
    # A set of tool names is a JSON array, sorted so the shape is deterministic.
    conv = cattrs.Converter(
        forbid_extra_keys=False, unstruct_collection_overrides={frozenset: sorted}
    )
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(int, _strict_int)

    def unstructure_factory(cls: type[Any]) -> Callable[[Any], dict[str, Any]]:
        renames: dict[str, Any] = {
            a.name: override(rename=_camel(a.name)) for a in attrs.fields(cls)
        }
        return make_dict_unstructure_fn(cls, conv, _cattrs_omit_if_default=True, **renames)

    def structure_factory(cls: type[Any]) -> Callable[[Any, Any], Any]:
        renames: dict[str, Any] = {
            a.name: override(rename=_camel(a.name)) for a in attrs.fields(cls)
        }
        return make_dict_structure_fn(cls, conv, **renames)

    conv.register_unstructure_hook_factory(attrs.has, unstructure_factory)
    conv.register_structure_hook_factory(attrs.has, structure_factory)
    return conv


#: The one converter between this module's attrs classes and OpenClaw's camelCase JSON.
converter: Final = _make_converter()

T = TypeVar("T")


def to_json(value: object) -> Any:
    """An attrs params/result object as OpenClaw's camelCase JSON-compatible value."""
    return converter.unstructure(value)


def from_json(data: object, cls: type[T]) -> T:
    """Structure camelCase JSON into ``cls``; raises ``cattrs`` validation errors."""
    return converter.structure(data, cls)


def _describe_structure_error(err: Exception) -> str:
    lines = cattrs.transform_error(err) if isinstance(err, cattrs.BaseValidationError) else []
    return "; ".join(lines) if lines else str(err)


def coerce_result(value: object, cls: type[T], *, engine_id: str, method: str) -> T:
    """``value`` as a checked ``cls``: an instance (re-validated) or its camelCase mapping.

    Everything else, and any field of the wrong type, raises :class:`InvalidEngineResult`.
    """
    if isinstance(value, cls):
        data = converter.unstructure(value)
    elif isinstance(value, Mapping):
        data = value
    else:
        raise InvalidEngineResult(
            engine_id, method, f"expected a {cls.__name__} (got {json_type_name(value)})"
        )
    try:
        return converter.structure(data, cls)
    except Exception as err:
        raise InvalidEngineResult(engine_id, method, _describe_structure_error(err)) from None


def ensure_assemble_result(
    value: object, *, engine_id: str, known_messages: object = None
) -> AssembleResult:
    """Check what ``assemble()`` returned, with OpenClaw's exact wording for a bad shape.

    Only ``messages`` (a list of objects) is mandatory, as in OpenClaw's
    ``ensureAssembleResultShape``; a missing ``estimatedTokens`` reads as 0, a present one
    must be a number, and ``systemPromptAddition`` must be a string when present.
    ``known_messages``: a list known to hold only objects (the harness's own history, as it
    handed it to the engine, unchanged); returned as ``messages``, it is not walked again.
    """
    if isinstance(value, AssembleResult):
        messages: object = value.messages
        estimated: object = value.estimated_tokens
        addition: object = value.system_prompt_addition
        projection: object = value.context_projection
    elif isinstance(value, Mapping):
        messages = value.get("messages")
        estimated = value.get("estimatedTokens", 0)
        addition = value.get("systemPromptAddition")
        projection = value.get("contextProjection")
    else:
        raise InvalidEngineResult(
            engine_id,
            "assemble",
            f'expected an object with a "messages" array (got {json_type_name(value)})',
        )
    if not isinstance(messages, list):
        raise InvalidEngineResult(
            engine_id,
            "assemble",
            f'expected an object with a "messages" array '
            f"(got messages of type {json_type_name(messages)})",
        )
    # One C-speed pass over the types (assemble is on every turn, with the whole history);
    # the per-message walk runs only when some type is not a dict, to name the index.
    if messages is not known_messages and not all(
        issubclass(kind, dict) for kind in set(map(type, messages))
    ):
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise InvalidEngineResult(
                    engine_id,
                    "assemble",
                    f"messages[{index}] must be an object (got {json_type_name(message)})",
                )
    try:
        tokens = _strict_int(estimated, None)
    except TypeError as err:
        raise InvalidEngineResult(engine_id, "assemble", f"estimatedTokens: {err}") from None
    if addition is not None and not isinstance(addition, str):
        raise InvalidEngineResult(
            engine_id,
            "assemble",
            f"systemPromptAddition must be a string (got {json_type_name(addition)})",
        )
    checked_projection: ContextProjection | None = None
    if projection is not None:
        checked_projection = coerce_result(
            projection, ContextProjection, engine_id=engine_id, method="assemble"
        )
    return AssembleResult(
        messages=messages,
        estimated_tokens=tokens,
        system_prompt_addition=addition,
        context_projection=checked_projection,
    )


# --- Checking and loading ------------------------------------------------------------------

_ABSENT: Final = object()


def check_engine(engine: object) -> ContextEngineInfo:
    """Check that ``engine`` is a context engine; return its validated info.

    The contract's static part, checked once before an engine is used: a valid ``info``
    (:func:`engine_info`), callable ``ingest``, ``assemble`` and ``compact``, and every
    optional method either absent (``None`` counts as absent) or callable. A class where an
    instance was meant is refused too. Raises :class:`EngineContractError` listing every
    problem found. Whether the methods are coroutine functions is not checked (a wrapper or a
    bridge may return awaitables from plain callables); a method that cannot be awaited fails
    when it is called, as a contract violation.
    """
    problems = _contract_problems(engine)
    if problems:
        raise EngineContractError(_describe(engine), problems)
    return engine_info(engine)


def resolve_engine(engine: object | None) -> object | None:
    """The engine a turn or a compaction runs with, checked before it starts.

    ``None`` stays ``None`` (no engine); a ``str`` is a spec, loaded by :func:`load_engine`
    (:class:`EngineLoadError` when it yields no engine); any other object must pass
    :func:`check_engine` (:class:`EngineContractError`). The legacy engine passes and is
    returned as it is: it is *no engine* for the lifecycle, but it is still an engine.
    """
    if engine is None:
        return None
    if isinstance(engine, str):
        return load_engine(engine)
    check_engine(engine)
    return engine


def _attribute(engine: object, name: str) -> tuple[object, str | None]:
    """``engine.<name>`` (``_ABSENT`` when missing), or the problem reading it raised."""
    try:
        return getattr(engine, name, _ABSENT), None
    except Exception as err:  # a property that raises
        return _ABSENT, f"reading {name} raised {type(err).__name__}"


def _contract_problems(engine: object) -> list[str]:
    if isinstance(engine, type):
        name = engine.__name__
        return [f"it is a class, not an instance (pass {name}(), or load a spec)"]
    if isinstance(engine, str | bytes):
        return ['it is a string; a spec "package.module:attribute" is loaded by load_engine']
    problems: list[str] = []
    missing: list[str] = []
    info, info_error = _attribute(engine, "info")
    if info_error is not None:
        problems.append(info_error)
    elif info is _ABSENT or info is None:
        missing.append("info")
    for name in _REQUIRED_METHODS:
        value, error = _attribute(engine, name)
        if error is not None:
            problems.append(error)
        elif value is _ABSENT or value is None:
            missing.append(name)
        elif not callable(value):
            problems.append(f"{name} is not callable (got {type(value).__name__})")
    if missing:
        problems.insert(0, f"missing {', '.join(missing)}")
    for name in _OPTIONAL_METHODS:
        value, error = _attribute(engine, name)
        if error is not None:
            problems.append(error)
        elif value is not _ABSENT and value is not None and not callable(value):
            problems.append(f"{name} is present but not callable (got {type(value).__name__})")
    if "info" not in missing and info_error is None:
        try:
            engine_info(engine)
        except InvalidEngineResult as err:
            problems.append(f"invalid info: {err.problem}")
    return problems


def _describe(engine: object) -> str:
    if isinstance(engine, type):
        return f"class {engine.__name__}"
    kind = f"{type(engine).__name__!r} object"
    try:
        known = engine_id(engine)
    except Exception:  # an info property that raises
        known = "<unknown>"
    return kind if known == "<unknown>" else f'{kind} (id "{known}")'


def load_engine(spec: str) -> ContextEngine:
    """Load an engine from its spec, ``"package.module:attribute"``.

    The one spec form (the CLI's ``--engine`` takes it too): the module's absolute dotted name,
    a colon, then the attribute's path in the module, which may be dotted
    (``"my_engines.memory:Holder.engine"``). There is no colon-less ``"module.attribute"``
    form: a spec without a colon is refused with a suggestion. The module is imported as
    Python's import finds it: on ``sys.path``, else in the current working directory (as
    ``python -m`` would), which is then appended to ``sys.path`` so that the module's own
    later imports resolve. The attribute may be

    * an engine instance: used as it is (every load of the spec shares it);
    * a class: instantiated with no arguments (a new engine per load);
    * any other callable (a factory): called with no arguments; it must return the engine
      itself, not an awaitable.

    What it yields must pass :func:`check_engine`. Every failure raises
    :class:`EngineLoadError` (a ``ValueError``) whose one-line message names the failed step.
    """
    if not isinstance(spec, str):
        raise EngineLoadError(repr(spec), f"a spec is a string (got {type(spec).__name__})")
    module_name, attr_path = _parse_spec(spec)
    module = _import_module(spec, module_name)

    target: Any = module
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise EngineLoadError(spec, f"{module_name!r} has no attribute {attr_path!r}") from None
        except Exception as err:
            raise EngineLoadError(
                spec, f"reading {attr_path!r} failed: {type(err).__name__}: {err}"
            ) from err

    if isinstance(target, type) or (callable(target) and not _looks_like_engine(target)):
        try:
            target = target()
        except Exception as err:
            raise EngineLoadError(
                spec, f"calling {attr_path!r} failed: {type(err).__name__}: {err}"
            ) from err
        if inspect.isawaitable(target):
            close = getattr(target, "close", None)
            if callable(close):
                close()  # a coroutine never awaited: no "never awaited" warning
            raise EngineLoadError(
                spec, f"calling {attr_path!r} returned an awaitable; a factory must be synchronous"
            )

    try:
        check_engine(target)
    except EngineContractError as err:
        raise EngineLoadError(
            spec, f"{type(target).__name__} is not a context engine: {'; '.join(err.problems)}"
        ) from None
    return target  # type: ignore[no-any-return]


def _parse_spec(spec: str) -> tuple[str, str]:
    module_name, sep, attr_path = (part.strip() for part in spec.partition(":"))
    expected = 'expected "package.module:attribute"'
    if not sep:
        head, dot, tail = spec.strip().rpartition(".")
        if dot and _dotted(head) and tail.isidentifier():
            expected += f' (did you mean "{head}:{tail}"?)'
        raise EngineLoadError(spec, expected)
    if module_name.startswith("."):
        raise EngineLoadError(spec, "relative module names are not supported; " + expected)
    if not _dotted(module_name) or not _dotted(attr_path):
        raise EngineLoadError(spec, expected)
    return module_name, attr_path


def _dotted(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def _import_module(spec: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if not _names_the_spec(err, module_name):
            # The module exists but imports something missing.
            raise EngineLoadError(spec, f"importing {module_name!r} failed: {err}") from err
        top = module_name.partition(".")[0]
        if err.name != top or _cwd_on_path():
            raise EngineLoadError(spec, f"no module named {module_name!r}") from err
    except Exception as err:
        raise EngineLoadError(
            spec, f"importing {module_name!r} failed: {type(err).__name__}: {err}"
        ) from err
    # Not on sys.path: the current directory, as ``python -m`` would search it.
    cwd = os.getcwd()
    sys.path.append(cwd)
    importlib.invalidate_caches()
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        sys.path.remove(cwd)
        if not _names_the_spec(err, module_name):
            raise EngineLoadError(spec, f"importing {module_name!r} failed: {err}") from err
        raise EngineLoadError(spec, f"no module named {module_name!r}") from err
    except Exception as err:
        sys.path.remove(cwd)
        raise EngineLoadError(
            spec, f"importing {module_name!r} failed: {type(err).__name__}: {err}"
        ) from err


def _names_the_spec(err: ModuleNotFoundError, module_name: str) -> bool:
    """True when the missing module is the spec's module or one of its packages."""
    return err.name is not None and (module_name + ".").startswith(err.name + ".")


def _cwd_on_path() -> bool:
    cwd = os.path.realpath(os.getcwd())
    return any(
        isinstance(entry, str) and os.path.realpath(entry or os.curdir) == cwd for entry in sys.path
    )


def _looks_like_engine(value: object) -> bool:
    return hasattr(value, "info") and optional_method(value, "assemble") is not None
