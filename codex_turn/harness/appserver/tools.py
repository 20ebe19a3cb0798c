"""Dynamic tools: Python async callables that the model can call through Codex.

A tool is declared on ``thread/start`` as ``dynamicTools`` (name, description, JSON input
schema) and frozen into the thread by Codex: ``thread/resume`` cannot change the set, so a
changed tool set needs a new thread. When the model calls one, the app-server sends the
server request ``item/tool/call`` with the *parsed* arguments; :meth:`ToolRegistry.call` runs
the callable and returns the response shape Codex 0.163 accepts::

    {"contentItems": [{"type": "inputText", "text": ...}], "success": bool}

A tool that raises never crashes the client or the turn: the exception becomes an error
result (``success: false``) whose text tells the model the tool failed. Codex executes
dynamic tool calls one at a time and has no timeout of its own, so ``timeout`` bounds each
call here.

Catalogs. By default (``catalog="flat"``) every tool is declared on its own, directly visible
to the model. In the ``"namespaced"`` catalog the host's tools live in the searchable
namespace :data:`SEARCHABLE_NAMESPACE` (``openclaw``), each with ``deferLoading``: Codex
leaves them out of the model's tool list and offers its ``tool_search`` tool, through which the
model finds them; a tool marked ``direct=True`` lives in :data:`DIRECT_NAMESPACE`
(``openclaw_direct``), always in the list. Verified against the binary: the model request then
holds ``openclaw_direct`` (a ``namespace`` tool) and ``tool_search``, not ``openclaw``; Codex
does so only for a model whose metadata declares ``supports_search_tool`` (every current
OpenAI model's does). For a model without it, deferred tools are simply absent: keep such a
model on the flat catalog. The model calls a namespaced tool with ``namespace`` and ``name``
apart, and ``item/tool/call`` names the tool alone (names are unique across both namespaces).

Return values: ``str`` (one text item), :class:`ToolResult`, a list of content-item dicts, or
anything JSON-serialisable (sent as JSON text).

Arguments are checked before the callable runs: Codex forwards whatever JSON the model wrote
(it checks only that it parses), so a callable could otherwise receive anything. Each tool
compiles its ``input_schema`` once, when it is declared, in the dialect its ``$schema`` names
(Draft 2020-12 when it names none); a schema that is not valid in that dialect is refused
there and then (``ValueError``). :meth:`ToolRegistry.call` answers arguments that do not
conform with an error result (``success: false``) that names the problem: where, which
keyword, and what the schema expects, never the offending value; the callable is not called.
The log gets the tool, the keyword and a count. References are resolved within the schema
and the bundled metaschemas only, never over the network: a schema that needs a remote
``$ref`` cannot be applied, and its calls are refused the same way.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, Literal

import anyio
import attrs
import jsonschema  # type: ignore[import-untyped]
import referencing  # jsonschema's own reference library (one of its dependencies)

from codex_turn._log import format_error, get_logger

from .logsafe import capped
from .types import DynamicToolNamespace, DynamicToolSpec, unstructure

__all__ = [
    "DIRECT_NAMESPACE",
    "SEARCHABLE_NAMESPACE",
    "DynamicTool",
    "ToolCatalog",
    "ToolRegistry",
    "ToolResult",
    "tool",
]

#: How a thread's dynamic tools are declared (see the module header).
ToolCatalog = Literal["flat", "namespaced"]
#: The namespaced catalog's two namespaces: searchable (deferred) and always visible.
SEARCHABLE_NAMESPACE: Final = "openclaw"
DIRECT_NAMESPACE: Final = "openclaw_direct"
_NAMESPACE_DESCRIPTIONS: Final[Mapping[str, str]] = {
    SEARCHABLE_NAMESPACE: "The host's tools: find the one you need with tool_search.",
    DIRECT_NAMESPACE: "The host's tools that are always available.",
}

log = get_logger(__name__)

ToolFunction = Callable[..., Awaitable[Any]]
_NAME = re.compile(r"^[a-zA-Z0-9_-]+$")
# Built-in Codex tools win over a dynamic tool of the same name; refuse to shadow them.
BUILTIN_TOOL_NAMES = frozenset(
    {
        "exec_command",
        "write_stdin",
        "request_user_input",
        "view_image",
        "multi_agent_v1",
        "get_goal",
        "create_goal",
        "update_goal",
        "web_search",
        "apply_patch",
        "shell",
    }
)
_MAX_COUNTED_PROBLEMS = 20
_MAX_EXPECTATION_CHARS = 80
_MAX_PATH_PART_CHARS = 40
# An empty registry: jsonschema adds the bundled metaschemas and never retrieves anything
# (its default registry would fetch a remote $ref over HTTP).
_NO_REMOTE_REFS: referencing.Registry[Any] = referencing.Registry()


def compile_schema(name: str, schema: Mapping[str, Any]) -> Any:
    """A validator for ``schema`` in the dialect it declares (Draft 2020-12 by default);
    ``ValueError`` when the schema is not valid in that dialect."""
    dialect = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        dialect.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(
            f"input_schema of dynamic tool {name!r} is not a valid JSON schema: "
            f"{capped(exc.message)}"
        ) from None
    return dialect(schema, registry=_NO_REMOTE_REFS)


def _expectation(value: Any) -> str:
    """The schema's side of a failed check, short (the schema is ours, the arguments are not)."""
    text = json.dumps(value, default=str, ensure_ascii=False)
    return capped(text, _MAX_EXPECTATION_CHARS) or ""


def _describe(error: Any) -> str:
    """One validation problem, without the instance's values."""
    where = "$" + "".join(
        f"[{part}]" if isinstance(part, int) else f".{capped(part, _MAX_PATH_PART_CHARS)}"
        for part in error.absolute_path
    )
    keyword, expected = error.validator, error.validator_value
    if keyword == "required" and isinstance(error.instance, Mapping):
        missing = [key for key in expected if key not in error.instance]
        return f"{where}: missing required {_expectation(missing)}"
    if keyword == "type":
        return f"{where}: expected type {_expectation(expected)}"
    if keyword in ("additionalProperties", "unevaluatedProperties") and expected is False:
        return f"{where}: has properties the schema does not declare"
    if keyword is None:  # the schema ``false``
        return f"{where}: no value is allowed here"
    return f"{where}: fails {keyword!s} {_expectation(expected)}"


@attrs.frozen
class ToolResult:
    """An explicit tool result: text (or content items) and a success flag."""

    content_items: Sequence[Mapping[str, Any]]
    success: bool = True

    @classmethod
    def text(cls, text: str, *, success: bool = True) -> ToolResult:
        return cls([{"type": "inputText", "text": text}], success=success)

    def wire(self) -> dict[str, Any]:
        return {"contentItems": [dict(i) for i in self.content_items], "success": self.success}


@attrs.frozen
class DynamicTool:
    """One tool: ``fn(arguments: dict) -> Awaitable[result]``."""

    name: str = attrs.field()
    description: str
    input_schema: Mapping[str, Any]
    fn: ToolFunction
    timeout: float | None = 300.0
    #: In the namespaced catalog: always visible to the model (``openclaw_direct``), never
    #: deferred behind tool search (OpenClaw's ``catalogMode: "direct-only"``).
    direct: bool = False
    _validator: Any = attrs.field(init=False, repr=False, eq=False)

    @_validator.default
    def _compile(self) -> Any:
        return compile_schema(self.name, self.input_schema)

    @name.validator
    def _check_name(self, _: attrs.Attribute[str], value: str) -> None:
        if not _NAME.match(value):
            raise ValueError(f"dynamic tool name must match {_NAME.pattern}: {value!r}")
        if value in BUILTIN_TOOL_NAMES:
            raise ValueError(f"dynamic tool name shadows a Codex built-in tool: {value!r}")

    def spec(self, *, defer_loading: bool | None = None) -> DynamicToolSpec:
        return DynamicToolSpec(
            self.name, self.description, dict(self.input_schema), defer_loading=defer_loading
        )

    def namespace(self, catalog: ToolCatalog) -> str | None:
        """The namespace it is declared in (``None``: the flat catalog)."""
        if catalog == "flat":
            return None
        return DIRECT_NAMESPACE if self.direct else SEARCHABLE_NAMESPACE

    def catalog_entry(self, catalog: ToolCatalog) -> dict[str, Any]:
        """What identifies it in ``catalog`` (its spec, and where it is declared): the input
        of the thread's tools fingerprint, which a catalog change must change."""
        entry = dict(unstructure(self.spec()))
        namespace = self.namespace(catalog)
        if namespace is not None:
            entry["namespace"] = namespace
        return entry

    def check_arguments(self, arguments: Any) -> str | None:
        """``None`` when ``arguments`` conform to :attr:`input_schema`; otherwise the message
        for the model (see the module header). Never raises."""
        try:
            problems = list(
                itertools.islice(self._validator.iter_errors(arguments), _MAX_COUNTED_PROBLEMS)
            )
        except Exception as exc:  # the schema cannot be applied: an unresolvable $ref, ...
            log.warning(
                "appserver.tool.schema_unusable",
                tool=capped(self.name),
                error_type=type(exc).__name__,
            )
            return f"the argument schema of tool {self.name} cannot be applied; it was not run"
        if not problems:
            return None
        best = jsonschema.exceptions.best_match(problems)
        log.warning(
            "appserver.tool.invalid_arguments",
            tool=capped(self.name),
            keyword=capped(best.validator),
            problems=len(problems),
        )
        more = ""
        if len(problems) > 1:
            plus = "+" if len(problems) == _MAX_COUNTED_PROBLEMS else ""
            more = f" (and {len(problems) - 1}{plus} more)"
        return f"invalid arguments for tool {self.name}: {_describe(best)}{more}; it was not run"


def tool(
    name: str,
    description: str,
    input_schema: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = 300.0,
) -> Callable[[ToolFunction], DynamicTool]:
    """Decorator: ``@tool("lookup", "Look things up", schema)`` over ``async def f(args)``."""
    schema = input_schema or {"type": "object", "properties": {}}

    def wrap(fn: ToolFunction) -> DynamicTool:
        return DynamicTool(name, description, schema, fn, timeout)

    return wrap


def _to_result(value: Any) -> ToolResult:
    if isinstance(value, ToolResult):
        return value
    if isinstance(value, str):
        return ToolResult.text(value)
    if isinstance(value, list) and all(isinstance(i, Mapping) and "type" in i for i in value):
        return ToolResult(value)
    return ToolResult.text(json.dumps(value, default=str))


class ToolRegistry:
    """The tools of one thread (or a shared set). Iteration order is declaration order;
    ``catalog`` is how they are declared (see the module header)."""

    def __init__(self, tools: Iterable[DynamicTool] = (), *, catalog: ToolCatalog = "flat") -> None:
        if catalog not in ("flat", "namespaced"):
            raise ValueError(f"tool catalog must be 'flat' or 'namespaced': {catalog!r}")
        self.catalog: ToolCatalog = catalog
        self._tools: dict[str, DynamicTool] = {}
        for t in tools:
            self.add(t)

    def add(self, t: DynamicTool) -> None:
        if t.name in self._tools:
            raise ValueError(f"duplicate dynamic tool name: {t.name}")
        self._tools[t.name] = t

    def __iter__(self) -> Iterator[DynamicTool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def specs(self) -> list[DynamicToolSpec | DynamicToolNamespace]:
        """What ``thread/start`` declares: each tool, or the namespaces that hold them."""
        if self.catalog == "flat":
            return [t.spec() for t in self._tools.values()]
        held: dict[str, list[DynamicToolSpec]] = {SEARCHABLE_NAMESPACE: [], DIRECT_NAMESPACE: []}
        for t in self._tools.values():
            namespace = t.namespace(self.catalog)
            assert namespace is not None
            held[namespace].append(
                t.spec(defer_loading=True if namespace == SEARCHABLE_NAMESPACE else None)
            )
        return [
            DynamicToolNamespace(name, _NAMESPACE_DESCRIPTIONS[name], specs)
            for name, specs in held.items()
            if specs
        ]

    async def call(self, name: str, arguments: Any) -> dict[str, Any]:
        """Run a tool for ``item/tool/call`` and return the wire response. Never raises
        (except cancellation): every failure becomes ``success: false`` for the model."""
        found = self._tools.get(name)
        if found is None:
            log.warning("appserver.tool.unknown", tool=capped(name))
            return ToolResult.text(f"unknown tool: {capped(name)}", success=False).wire()
        arguments = {} if arguments is None else arguments  # no arguments at all: none given
        refusal = found.check_arguments(arguments)
        if refusal is not None:
            return ToolResult.text(refusal, success=False).wire()
        args = arguments if isinstance(arguments, dict) else {"value": arguments}
        try:
            if found.timeout is None:
                value = await found.fn(args)
            else:
                with anyio.fail_after(found.timeout):
                    value = await found.fn(args)
            return _to_result(value).wire()
        except Exception as exc:
            # The model gets a short, redacted description; the log gets the type only.
            log.warning("appserver.tool.failed", tool=name, error_type=type(exc).__name__)
            return ToolResult.text(f"tool {name} failed: {format_error(exc)}", success=False).wire()


def as_registry(tools: ToolRegistry | Iterable[DynamicTool] | None) -> ToolRegistry | None:
    """``tools`` as a :class:`ToolRegistry` (the same object when it already is one)."""
    if tools is None or isinstance(tools, ToolRegistry):
        return tools
    return ToolRegistry(tools)
