"""Checking an engine and what it returns: the harness trusts nothing a plugin hands back.

*Results are checked at the boundary.* :func:`ensure_assemble_result` and
:func:`coerce_result` check a returned value and turn anything malformed into one
:class:`~.contract.InvalidEngineResult` that names the engine, the method and what was wrong
(OpenClaw bug #75541: an engine returning ``None`` crashed the runner deep inside the
projection). A camelCase JSON object (:mod:`.shapes`) is accepted and structured by the same
strict converter.

*An engine is checked before it is used.* :func:`check_engine` is the static part of the
contract (a valid ``info``, callable required methods, optional methods absent or callable, an
instance and not a class) and raises :class:`~.contract.EngineContractError`. What an engine
does *while it runs* (a result of the wrong shape, an exception) is judged at the lifecycle's
fallback points by :mod:`codex_turn.harness.violations`.

*One way to reach a method.* :func:`optional_method` is how the harness asks whether an engine
has a method and gets it (``None`` when it is absent or not callable); the capabilities of
:class:`EngineHandle` (:func:`engine_capabilities`) are what it found, read once, as a report.
:func:`engine_info` reads the validated ``info``, :func:`engine_id` the id for log lines
(never raising), and :func:`is_active_engine` says whether the harness calls the engine at
all (not for none, nor for the legacy engine).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeVar

import attrs
import cattrs

from codex_turn._log import mask_session_key

from .contract import (
    LEGACY_ENGINE_ID,
    OPTIONAL_METHODS,
    PROMPT_AUTHORITIES,
    REQUIRED_METHODS,
    TOOL_METHODS,
    AssembleResult,
    ContextEngineInfo,
    ContextProjection,
    EngineContractError,
    InvalidEngineResult,
    PromptAuthority,
    ToolsResult,
)
from .durable import durable_turn_problems
from .host import HOST_HOOK_METHODS
from .shapes import converter, json_type_name, strict_int

__all__ = [
    "EngineCapabilities",
    "EngineHandle",
    "check_engine",
    "coerce_result",
    "engine_capabilities",
    "engine_id",
    "engine_info",
    "engine_log_fields",
    "ensure_assemble_result",
    "ensure_tools_result",
    "is_active_engine",
    "optional_method",
]

T = TypeVar("T")


@attrs.frozen
class EngineCapabilities:
    """Which optional methods an engine has (detected, never required): what
    :func:`optional_method` finds, as a report."""

    bootstrap: bool
    ingest_batch: bool
    after_turn: bool
    maintain: bool
    dispose: bool


def optional_method(engine: object, name: str) -> Callable[..., Awaitable[Any]] | None:
    """``engine.<name>`` when it is present and callable, else ``None``: the one way the
    harness asks whether an engine has a method (required or optional) and gets it."""
    method = getattr(engine, name, None)
    return method if callable(method) else None


def engine_capabilities(engine: object) -> EngineCapabilities:
    """The :class:`EngineCapabilities` of ``engine`` now (one :func:`optional_method` each)."""
    return EngineCapabilities(
        **{name: optional_method(engine, name) is not None for name in OPTIONAL_METHODS}
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

    @property
    def offers_tools(self) -> bool:
        """The engine has ``tools`` and ``call_tool`` (:data:`~.contract.TOOL_METHODS`)."""
        return all(optional_method(self.engine, name) is not None for name in TOOL_METHODS)

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
        needs = info.host_requirements
        if not isinstance(needs, frozenset | set) or not all(isinstance(n, str) for n in needs):
            raise InvalidEngineResult(
                info.id, "info", "info.host_requirements must be a set of capability names"
            )
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


# --- Results -------------------------------------------------------------------------------


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


def ensure_assemble_result(value: object, *, engine_id: str) -> AssembleResult:
    """Check what ``assemble()`` returned, with OpenClaw's exact wording for a bad shape.

    Only ``messages`` (a list of objects) is mandatory, as in OpenClaw's
    ``ensureAssembleResultShape``; a missing ``estimatedTokens`` reads as 0, a present one
    must be a number, and ``systemPromptAddition`` must be a string when present.
    """
    if isinstance(value, AssembleResult):
        messages: object = value.messages
        estimated: object = value.estimated_tokens
        addition: object = value.system_prompt_addition
        projection: object = value.context_projection
        authority: object = value.prompt_authority
    elif isinstance(value, Mapping):
        messages = value.get("messages")
        estimated = value.get("estimatedTokens", 0)
        addition = value.get("systemPromptAddition")
        projection = value.get("contextProjection")
        authority = value.get("promptAuthority", "preassembly_may_overflow")
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
    if not all(issubclass(kind, dict) for kind in set(map(type, messages))):
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise InvalidEngineResult(
                    engine_id,
                    "assemble",
                    f"messages[{index}] must be an object (got {json_type_name(message)})",
                )
    try:
        tokens = strict_int(estimated, None)
    except TypeError as err:
        raise InvalidEngineResult(engine_id, "assemble", f"estimatedTokens: {err}") from None
    if addition is not None and not isinstance(addition, str):
        raise InvalidEngineResult(
            engine_id,
            "assemble",
            f"systemPromptAddition must be a string (got {json_type_name(addition)})",
        )
    if authority not in PROMPT_AUTHORITIES:
        raise InvalidEngineResult(
            engine_id,
            "assemble",
            f"promptAuthority must be one of {', '.join(PROMPT_AUTHORITIES)} (got {authority!r})",
        )
    checked_authority: PromptAuthority = authority
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
        prompt_authority=checked_authority,
    )


def ensure_tools_result(value: object, *, engine_id: str) -> ToolsResult:
    """Check what ``tools()`` returned: a :class:`ToolsResult` (or its camelCase mapping)
    whose tools have distinct names. Whether a name or a schema suits Codex is checked where
    the tool is built (:mod:`codex_turn.harness.turn.engine_tools`)."""
    result = coerce_result(value, ToolsResult, engine_id=engine_id, method="tools")
    names = [tool.name for tool in result.tools]
    if len(set(names)) != len(names):
        raise InvalidEngineResult(engine_id, "tools", "two tools have the same name")
    return result


# --- The static check ----------------------------------------------------------------------

_ABSENT: Final = object()


def check_engine(engine: object) -> ContextEngineInfo:
    """Check that ``engine`` is a context engine; return its validated info.

    The contract's static part, checked once before an engine is used: a valid ``info``
    (:func:`engine_info`), callable ``ingest``, ``assemble`` and ``compact``, and every
    optional method either absent (``None`` counts as absent) or callable, ``tools`` and
    ``call_tool`` both present or both absent. A class where an
    instance was meant is refused too. Raises :class:`EngineContractError` listing every
    problem found. Whether the methods are coroutine functions is not checked (a wrapper or a
    bridge may return awaitables from plain callables); a method that cannot be awaited fails
    when it is called, as a contract violation.
    """
    problems = _contract_problems(engine)
    if problems:
        raise EngineContractError(_describe(engine), problems)
    return engine_info(engine)


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
    for name in REQUIRED_METHODS:
        value, error = _attribute(engine, name)
        if error is not None:
            problems.append(error)
        elif value is _ABSENT or value is None:
            missing.append(name)
        elif not callable(value):
            problems.append(f"{name} is not callable (got {type(value).__name__})")
    if missing:
        problems.insert(0, f"missing {', '.join(missing)}")
    for name in (*OPTIONAL_METHODS, *HOST_HOOK_METHODS):
        value, error = _attribute(engine, name)
        if error is not None:
            problems.append(error)
        elif value is not _ABSENT and value is not None and not callable(value):
            problems.append(f"{name} is present but not callable (got {type(value).__name__})")
    offered: list[str] = []
    for name in TOOL_METHODS:
        value, error = _attribute(engine, name)
        if error is not None:
            problems.append(error)
        elif value is not _ABSENT and value is not None:
            offered.append(name)
            if not callable(value):
                problems.append(f"{name} is present but not callable (got {type(value).__name__})")
    if offered and len(offered) != len(TOOL_METHODS):
        lacking = [name for name in TOOL_METHODS if name not in offered]
        problems.append(f"{offered[0]} is present without {lacking[0]} (engine tools need both)")
    if "info" not in missing and info_error is None:
        try:
            checked = engine_info(engine)
        except InvalidEngineResult as err:
            problems.append(f"invalid info: {err.problem}")
        else:
            problems.extend(durable_turn_problems(engine, checked))
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
