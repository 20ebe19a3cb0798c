"""Typed params and results of the app-server methods we use, and their camelCase converter.

The wire format is camelCase JSON. Python code uses snake_case attrs classes; :data:`converter`
maps between them once, at the client boundary:

* **Unstructuring** (what we send) renames each field to camelCase, or to the exact wire name
  in its ``wire`` metadata (a few fields are snake_case on the wire, e.g. ``text_elements``),
  and omits optional fields that are ``None``: Codex treats an absent field and ``null`` alike,
  and omitting keeps requests minimal and schema-valid.
* **Structuring** (what we receive) renames back and **ignores unknown keys**: a newer binary
  may add fields at any time. Opaque sub-objects stay ``dict``/``Any``.

Only the fields the library uses are modelled; :meth:`AppServerClient.request` remains
available for anything else, with raw dicts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final, Literal, TypeVar

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

__all__ = [
    "CONTEXT_WINDOW_EXCEEDED",
    "ApprovalsReviewer",
    "AskForApproval",
    "ClientInfo",
    "DynamicToolNamespace",
    "DynamicToolSpec",
    "ImageInput",
    "InitializeCapabilities",
    "InitializeParams",
    "InitializeResult",
    "LocalImageInput",
    "SandboxMode",
    "TextInput",
    "ThreadCompactStartParams",
    "ThreadForkParams",
    "ThreadInfo",
    "ThreadResult",
    "ThreadResumeParams",
    "ThreadStartParams",
    "TurnError",
    "TurnInfo",
    "TurnInterruptParams",
    "TurnStartParams",
    "TurnStartResult",
    "TurnSteerParams",
    "UserInput",
    "converter",
    "structure",
    "unstructure",
    "wire_name",
]

T = TypeVar("T")

_CAMEL = re.compile(r"_([a-z0-9])")


def camel(name: str) -> str:
    return _CAMEL.sub(lambda m: m.group(1).upper(), name)


def _wire(name: str, wire: str | None = None) -> dict[str, str]:
    return {"wire": wire or name}


# --- initialize ------------------------------------------------------------------------


@attrs.frozen
class ClientInfo:
    name: str
    version: str
    title: str | None = None


@attrs.frozen
class InitializeCapabilities:
    experimental_api: bool = True


@attrs.frozen
class InitializeParams:
    client_info: ClientInfo
    capabilities: InitializeCapabilities | None = None


@attrs.frozen
class InitializeResult:
    user_agent: str | None = None
    codex_home: str | None = None
    platform_family: str | None = None
    platform_os: str | None = None


# --- inputs -----------------------------------------------------------------------------


@attrs.frozen
class TextInput:
    text: str
    type: Literal["text"] = "text"
    text_elements: list[Any] = attrs.field(factory=list, metadata=_wire("text_elements"))


@attrs.frozen
class ImageInput:
    """An image by URL; OpenClaw passes ``data:<mime>;base64,<data>`` URLs."""

    url: str
    type: Literal["image"] = "image"


@attrs.frozen
class LocalImageInput:
    path: str
    type: Literal["localImage"] = "localImage"


UserInput = TextInput | ImageInput | LocalImageInput


# --- dynamic tools ----------------------------------------------------------------------


@attrs.frozen
class DynamicToolSpec:
    """``{type:"function", name, description, inputSchema}`` as declared on thread/start;
    ``deferLoading`` (in a namespace only): left out of the model's tool list, found through
    Codex's ``tool_search`` instead."""

    name: str
    description: str
    input_schema: Mapping[str, Any]
    type: Literal["function"] = "function"
    defer_loading: bool | None = None


@attrs.frozen
class DynamicToolNamespace:
    """``{type:"namespace", name, description, tools}``: dynamic tools under one namespace
    (the model calls them with ``namespace`` and ``name`` apart)."""

    name: str
    description: str
    tools: list[DynamicToolSpec]
    type: Literal["namespace"] = "namespace"


# --- threads ----------------------------------------------------------------------------

# The runtime policy of a thread, as the binary's generated schema spells it. Codex keeps it
# per loaded thread, but a ``thread/resume`` that loads a thread without it does not restore
# all of it (0.163: the sandbox falls back to the config's, the service tier is dropped).

AskForApproval = Literal["untrusted", "on-request", "never"] | Mapping[str, Any]
"""``approvalPolicy``: when Codex asks before acting; a mapping is the schema's granular
form, ``{"granular": {"sandbox_approval": ..., "rules": ..., "mcp_elicitations": ...}}``."""

SandboxMode = Literal["read-only", "workspace-write", "danger-full-access"]
"""``sandbox`` as sent in ``thread/start``/``thread/resume`` (the response carries the
resulting policy object instead, see :attr:`ThreadResult.sandbox_mode`)."""

ApprovalsReviewer = Literal["user", "auto_review", "guardian_subagent"]
"""``approvalsReviewer``: who reviews approval requests (Codex's default is ``user``)."""

_SANDBOX_MODES: Mapping[str, SandboxMode] = {
    "readOnly": "read-only",
    "workspaceWrite": "workspace-write",
    "dangerFullAccess": "danger-full-access",
}


# The thread settings themselves (developer instructions, cwd, model, tools, runtime
# policy ...) are one value, :class:`~.thread_settings.ThreadSettings`, with its own wire
# mapping; these are the rest of each request.


@attrs.frozen(kw_only=True)
class ThreadStartParams:
    config: Mapping[str, Any] | None = None
    ephemeral: bool | None = None


@attrs.frozen(kw_only=True)
class ThreadResumeParams:
    thread_id: str
    exclude_turns: bool | None = True
    config: Mapping[str, Any] | None = None


@attrs.frozen(kw_only=True)
class ThreadForkParams:
    """``thread/fork`` as the structured projection sends it: always ephemeral, turns
    excluded."""

    thread_id: str
    ephemeral: bool = True
    exclude_turns: bool = True


@attrs.frozen(kw_only=True)
class ThreadInfo:
    id: str
    model: str | None = None
    model_provider: str | None = None
    path: str | None = None
    status: Any = None
    turns: list[Any] | None = None


@attrs.frozen(kw_only=True)
class ThreadResult:
    """The result of ``thread/start`` and ``thread/resume`` (same shape for what we use).

    The runtime policy fields are the *effective* values Codex reports for the thread (``None``
    when the response lacks them): ``approval_policy`` is the wire value (a mode string or the
    granular mapping), ``sandbox`` the resulting policy object (``{"type": "readOnly", ...}``;
    :attr:`sandbox_mode` maps it back to the :data:`SandboxMode` that selects it)."""

    thread: ThreadInfo
    model: str | None = None
    model_provider: str | None = None
    cwd: str | None = None
    approval_policy: Any = None
    sandbox: Any = None
    approvals_reviewer: str | None = None
    service_tier: str | None = None

    @property
    def thread_id(self) -> str:
        return self.thread.id

    @property
    def sandbox_mode(self) -> SandboxMode | None:
        """The sandbox mode the effective policy corresponds to (``None`` for an external
        sandbox, or when the response carried no policy)."""
        kind = self.sandbox.get("type") if isinstance(self.sandbox, Mapping) else None
        return _SANDBOX_MODES.get(kind) if isinstance(kind, str) else None


# --- turns ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TurnStartParams:
    thread_id: str
    input: list[UserInput]
    cwd: str | None = None
    model: str | None = None
    effort: str | None = None
    summary: str | None = None
    client_user_message_id: str | None = None


CONTEXT_WINDOW_EXCEEDED: Final = "contextWindowExceeded"
"""``codexErrorInfo`` of a turn whose prompt does not fit the model's context window: Codex
0.163 reports it (on ``error`` and ``turn/completed``; not retried, whatever the provider's
retries) when the Responses stream ends with ``response.failed`` whose ``response.error.code``
is ``context_length_exceeded``. An HTTP 400 carrying that code is ``"other"``, like any 400.
Checked against the real binary by tests/test_appserver_overflow_probe.py."""


@attrs.frozen(kw_only=True)
class TurnError:
    """A failed turn's ``error``. ``codex_error_info`` is a string (``"other"``,
    :data:`CONTEXT_WINDOW_EXCEEDED`, ...) or a one-key object
    (``{"responseStreamDisconnected": {"httpStatusCode": null}}``)."""

    message: str
    codex_error_info: Any = None
    additional_details: str | None = None


@attrs.frozen(kw_only=True)
class TurnInfo:
    id: str
    status: str | None = None
    error: TurnError | None = None
    items: list[Any] = attrs.field(factory=list)
    duration_ms: int | None = None


@attrs.frozen(kw_only=True)
class TurnStartResult:
    turn: TurnInfo


@attrs.frozen(kw_only=True)
class TurnInterruptParams:
    thread_id: str
    turn_id: str


@attrs.frozen(kw_only=True)
class TurnSteerParams:
    """``turn/steer``: more user input for the thread's active turn, which must be
    ``expected_turn_id`` (Codex refuses it otherwise, and when no turn is active)."""

    thread_id: str
    expected_turn_id: str
    input: list[UserInput]


@attrs.frozen(kw_only=True)
class ThreadCompactStartParams:
    thread_id: str


# --- converter --------------------------------------------------------------------------

converter = cattrs.Converter(forbid_extra_keys=False)


def wire_name(field: attrs.Attribute[Any]) -> str:
    """A field's wire name: its ``wire`` metadata, else its name in camelCase."""
    wire = field.metadata.get("wire")
    return str(wire) if wire else camel(field.name)


def _unstructure_factory(cl: type[Any]) -> Any:
    overrides: dict[str, Any] = {
        f.name: override(rename=wire_name(f), omit_if_default=f.default is None)
        for f in attrs.fields(cl)
    }
    return make_dict_unstructure_fn(cl, converter, **overrides)


def _structure_factory(cl: type[Any]) -> Any:
    overrides: dict[str, Any] = {f.name: override(rename=wire_name(f)) for f in attrs.fields(cl)}
    return make_dict_structure_fn(cl, converter, **overrides)


def _structure_user_input(value: Any, _: Any) -> UserInput:
    kind = value.get("type") if isinstance(value, Mapping) else None
    targets: dict[str, type[TextInput | ImageInput | LocalImageInput]] = {
        "text": TextInput,
        "image": ImageInput,
        "localImage": LocalImageInput,
    }
    return converter.structure(value, targets.get(kind or "", TextInput))


converter.register_unstructure_hook_factory(attrs.has, _unstructure_factory)
converter.register_structure_hook_factory(attrs.has, _structure_factory)
converter.register_structure_hook(UserInput, _structure_user_input)


def unstructure(value: Any) -> Any:
    """attrs object -> wire JSON (camelCase, ``None`` optionals omitted)."""
    return converter.unstructure(value)


def structure(value: Any, cl: type[T]) -> T:
    """wire JSON -> attrs object (unknown keys ignored)."""
    return converter.structure(value, cl)
