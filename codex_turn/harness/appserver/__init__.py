"""Everything that crosses the Codex boundary: the real ``codex app-server`` over stdio.

Layers (bottom up), each mapping its own failures once into the :mod:`.errors` family:

* :mod:`.defaults`: the shared timing and memory defaults (interrupt grace, native
  compaction timeout, liveness timeout, remembered threads), used by every layer and by
  compaction; :mod:`.logsafe`: identifiers capped before they are logged;
* :mod:`.config`: CODEX_HOME (a private one owner-only), an offline-safe ``config.toml``,
  argv and environment;
* :mod:`.process`: the child process as a line transport (stderr drained, graceful shutdown,
  immediate death detection);
* :mod:`.connection`: JSON-RPC over the transport (correlation, timeouts, per-thread
  routing, liveness after a missed deadline, always-valid outgoing text);
* :mod:`.thread_settings`: :class:`ThreadSettings`, what a thread is started, resumed or
  forked with, as one value (its key, and what each request sends of it);
* its parts, each on the connection: :mod:`.threads` (thread start/resume/fork),
  :mod:`.turn_start` (turn start and interrupt), :mod:`.native_compaction`
  (``thread/compact/start``) and :mod:`.server_requests` (what Codex asks of us: dynamic
  tools, approvals, user input);
* :mod:`.client`: :class:`AppServerClient`, the connection with its parts composed;
* :mod:`.turn`: :class:`TurnHandle`, one Codex turn and the theory of its phases;
* :mod:`.projector`: a turn's notifications folded into a :class:`CodexTurnResult`;
* :mod:`.manager`: :class:`AppServer`, many threads over one process, replaced after a crash
  or once declared dead;
* :mod:`.port`: :class:`AppServerPort`, the part of :class:`AppServer` the orchestrator and
  compaction use (the tests' in-process fake implements it too).

Usage sketch::

    async with AppServer.start(AppServerConfig.offline(home, model.base_url)) as server:
        thread = await server.start_thread(ThreadSettings(cwd=str(workspace),
                                                          developer_instructions=instructions,
                                                          tools=[lookup_tool]))
        result = await server.run_turn(thread.thread_id, prompt_text, prompt=raw_prompt,
                                       idle_timeout=120)
        result.outcome, result.messages_snapshot, result.usage
"""

from __future__ import annotations

from .client import AppServerClient
from .config import AppServerConfig, ModelProviderConfig, bundled_codex_path, render_toml
from .defaults import (
    INTERRUPT_GRACE_S,
    LIVENESS_TIMEOUT_S,
    MAX_REMEMBERED_THREADS,
    NATIVE_COMPACTION_TIMEOUT_S,
)
from .errors import (
    AppServerClosed,
    AppServerError,
    AppServerRpcError,
    AppServerStartError,
    AppServerTimeout,
    CodexBinaryMissing,
    CodexHomeNotPrivate,
    CodexLoginRequired,
    InvalidAppServerConfig,
    NoActiveTurn,
    NoRollout,
    ThreadNotFound,
    TurnNotRunning,
)
from .manager import AppServer
from .native_compaction import CompactionResult
from .port import AppServerPort, TurnHandlePort
from .process import AppServerProcess, LineTransport
from .projector import CodexTurnResult, CodexTurnStatus, Notification, TurnProjector, Usage
from .server_requests import (
    ApprovalCallback,
    ApprovalDecision,
    ApprovalKind,
    ApprovalPolicy,
    ApprovalRequest,
    TurnRequestHandlers,
    UserInputAnswers,
    UserInputCallback,
    UserInputHandler,
    UserInputOption,
    UserInputQuestion,
    UserInputRequest,
    decline_all,
)
from .thread_settings import ThreadSettings
from .threads import KeptFork, LoadedThread
from .tools import DynamicTool, ToolRegistry, ToolResult, tool
from .turn import CodexTurnPhase, TurnHandle
from .types import (
    ApprovalsReviewer,
    AskForApproval,
    DynamicToolSpec,
    ImageInput,
    LocalImageInput,
    SandboxMode,
    TextInput,
    ThreadResult,
    UserInput,
)

__all__ = [
    "INTERRUPT_GRACE_S",
    "LIVENESS_TIMEOUT_S",
    "MAX_REMEMBERED_THREADS",
    "NATIVE_COMPACTION_TIMEOUT_S",
    "AppServer",
    "AppServerClient",
    "AppServerClosed",
    "AppServerConfig",
    "AppServerError",
    "AppServerPort",
    "AppServerProcess",
    "AppServerRpcError",
    "AppServerStartError",
    "AppServerTimeout",
    "ApprovalCallback",
    "ApprovalDecision",
    "ApprovalKind",
    "ApprovalPolicy",
    "ApprovalRequest",
    "ApprovalsReviewer",
    "AskForApproval",
    "CodexBinaryMissing",
    "CodexHomeNotPrivate",
    "CodexLoginRequired",
    "CodexTurnPhase",
    "CodexTurnResult",
    "CodexTurnStatus",
    "CompactionResult",
    "DynamicTool",
    "DynamicToolSpec",
    "ImageInput",
    "InvalidAppServerConfig",
    "KeptFork",
    "LineTransport",
    "LoadedThread",
    "LocalImageInput",
    "ModelProviderConfig",
    "NoActiveTurn",
    "NoRollout",
    "Notification",
    "SandboxMode",
    "TextInput",
    "ThreadNotFound",
    "ThreadResult",
    "ThreadSettings",
    "ToolRegistry",
    "ToolResult",
    "TurnHandle",
    "TurnHandlePort",
    "TurnNotRunning",
    "TurnProjector",
    "TurnRequestHandlers",
    "Usage",
    "UserInput",
    "UserInputAnswers",
    "UserInputCallback",
    "UserInputHandler",
    "UserInputOption",
    "UserInputQuestion",
    "UserInputRequest",
    "bundled_codex_path",
    "decline_all",
    "render_toml",
    "tool",
]
