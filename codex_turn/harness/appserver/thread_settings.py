"""What a thread is started, resumed or forked with: one :class:`ThreadSettings` value.

Theory. ``thread/start``, ``thread/resume`` and ``thread/fork`` carry the same settings
(developer instructions, cwd, model, tools, runtime policy ...), and the harness compares what
a thread was loaded with against what the next turn wants (:attr:`ThreadSettings.key`: equal
keys, a resume would send Codex nothing new). So the list of settings is spelled here once:
the executors build one value per turn and hand it whole to the port, the manager remembers
it for an auto-resume, and the client turns it into each request's params.

The wire mapping is data: each field's wire name is its camelCase (``tools`` travels as
``dynamicTools``, the specs of the registry), and :data:`SENT` says which settings each
request carries (Codex froze the tool set at ``thread/start``; ``thread/fork`` takes the
subset the structured projection uses). A ``None`` setting is not sent (Codex treats an absent
field and ``null`` alike), except ``personality``, whose default is ``"none"``.

``project_docs=False`` travels as the thread's ``config`` override ``project_doc_max_bytes =
0`` (:data:`NO_PROJECT_DOCS`): Codex then reads no AGENTS.md (nor its fallbacks) into the
thread (it reads them once, when the thread starts: verified against the binary, whose
``thread/start`` answer lists no ``instructionSources`` then). Only ``thread/start`` sends
it: a lightweight turn runs on a transient thread of its own (``THREAD_RULES``).

The runtime policy (:data:`RUNTIME_POLICY`: approval policy, sandbox, approvals reviewer,
service tier) is what a resume that loads a thread must re-send for it to keep running as it
did (see :meth:`~.threads.Threads.resume_thread`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal

import attrs

from .tools import DynamicTool, ToolRegistry, as_registry
from .types import ApprovalsReviewer, AskForApproval, SandboxMode, unstructure, wire_name

__all__ = [
    "DEFAULT_SETTINGS",
    "NO_PROJECT_DOCS",
    "RUNTIME_POLICY",
    "SENT",
    "ThreadRequest",
    "ThreadSettings",
]

ThreadRequest = Literal["thread/start", "thread/resume", "thread/fork"]


def _registry(tools: ToolRegistry | Iterable[DynamicTool] | None) -> ToolRegistry | None:
    return as_registry(tools)


@attrs.frozen(kw_only=True)
class ThreadSettings:
    """The settings of a thread start, resume or fork (see the module header). ``tools``
    (a :class:`~.tools.ToolRegistry` or any iterable of tools) are declared to Codex at
    ``thread/start`` and bound locally (their handlers) by every request."""

    developer_instructions: str | None = None
    cwd: str | None = None
    model: str | None = None
    tools: ToolRegistry | None = attrs.field(
        default=None, converter=_registry, metadata={"wire": "dynamicTools"}
    )
    approval_policy: AskForApproval | None = None
    sandbox: SandboxMode | None = None
    approvals_reviewer: ApprovalsReviewer | None = None
    service_tier: str | None = None
    base_instructions: str | None = None
    model_provider: str | None = None
    personality: str | None = "none"
    #: Load the project docs (AGENTS.md ...) into the thread; ``False``: a lightweight run.
    project_docs: bool = attrs.field(default=True, metadata={"wire": "config"})
    #: Config overrides for the thread (Codex's session-flags layer), e.g. the per-thread
    #: hook config of :meth:`~.native_hooks.HookRelay.thread_config`.
    config: Mapping[str, Any] | None = None

    @property
    def key(self) -> str:
        """A digest of the settings (the tools by their specs): equal keys mean a resume
        would send Codex nothing new."""
        fields = attrs.asdict(self, recurse=False)
        fields["tools"] = self.tools.specs() if self.tools else None
        canonical = json.dumps(fields, sort_keys=True, default=repr, ensure_ascii=False)
        return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()

    def runtime_policy(self) -> ThreadSettings:
        """Only the runtime policy of these settings (:data:`RUNTIME_POLICY`)."""
        return ThreadSettings(**{name: getattr(self, name) for name in RUNTIME_POLICY})

    def wire(self, request: ThreadRequest) -> dict[str, Any]:
        """The params ``request`` carries for these settings (camelCase, ``None`` omitted)."""
        params: dict[str, Any] = {}
        for field in attrs.fields(ThreadSettings):
            if field.name not in SENT[request]:
                continue
            value = getattr(self, field.name)
            if isinstance(value, ToolRegistry):
                value = unstructure(value.specs()) if value else None
            if field.name == "project_docs":
                if not value:  # travels as the thread's config override (module header)
                    params.setdefault("config", {}).update(NO_PROJECT_DOCS)
                continue
            if field.name == "config":
                if value:  # one ``config`` object, whatever sets overrides in it
                    params.setdefault("config", {}).update(unstructure(value))
                continue
            if value is None and field.default is None:
                continue
            params[wire_name(field)] = unstructure(value)
        return params


#: The ``config`` override of a thread started without the project docs (AGENTS.md ...).
NO_PROJECT_DOCS: Final[Mapping[str, Any]] = {"project_doc_max_bytes": 0}

#: No settings of one's own: Codex's defaults (a start's default argument).
DEFAULT_SETTINGS: Final = ThreadSettings()

#: The runtime policy fields (sent only when given; see the module header).
RUNTIME_POLICY: Final = ("approval_policy", "sandbox", "approvals_reviewer", "service_tier")

_ALL: Final = frozenset(field.name for field in attrs.fields(ThreadSettings))

#: The settings each thread request sends.
SENT: Final[Mapping[ThreadRequest, frozenset[str]]] = {
    "thread/start": _ALL,
    # Codex froze the tool set (and read the project docs) at thread/start: a resume binds
    # the handlers locally only.
    "thread/resume": _ALL - {"tools", "project_docs"},
    # What the structured projection forks with (the fork inherits the rest from its base).
    "thread/fork": frozenset(
        {"developer_instructions", "cwd", "model", "approvals_reviewer", "service_tier"}
    ),
}
