"""codex-turn: each turn of a Codex agent session as an explicit finite-state machine.

A pluggable context engine controls context assembly, post-turn ingestion, maintenance and
compaction policy while the real Codex app-server runs the model loop. The public API is
re-exported here; everything else is reachable through the subpackages but may change.

    async with AppServer.start(AppServerConfig.offline(home, model_url)) as server:
        result = await run_codex_turn(TurnParams(...), app_server=server, engine=my_engine)
"""

from codex_turn._log import configure_logging
from codex_turn.errors import CodexTurnError
from codex_turn.fsm import (
    IllegalTransition,
    SkipReason,
    ThreadDecision,
    TraceEntry,
    TurnBusy,
    TurnOutcome,
    TurnState,
    TurnTrigger,
)
from codex_turn.harness._gates import SessionBusy
from codex_turn.harness.appserver import (
    AppServer,
    AppServerClosed,
    AppServerConfig,
    AppServerError,
    AppServerRpcError,
    AppServerStartError,
    AppServerTimeout,
    CodexBinaryMissing,
    CodexHomeNotPrivate,
    CodexLoginRequired,
    DynamicTool,
    ToolResult,
    tool,
)
from codex_turn.harness.binding import BindingError, ThreadBinding, read_binding
from codex_turn.harness.compaction import (
    CompactionRun,
    CompactSessionParams,
    compact_codex_session,
    compact_codex_session_traced,
)
from codex_turn.harness.engine import (
    AfterTurnParams,
    AssembleParams,
    AssembleResult,
    BootstrapParams,
    BootstrapResult,
    CompactParams,
    CompactResult,
    ContextEngine,
    ContextEngineInfo,
    ContextProjection,
    EngineContractError,
    EngineContractViolation,
    EngineError,
    EngineLoadError,
    EngineUnavailable,
    IngestBatchParams,
    IngestBatchResult,
    IngestParams,
    IngestResult,
    InvalidEngineResult,
    LegacyContextEngine,
    MaintainParams,
    MaintenanceResult,
    check_engine,
    load_engine,
    resolve_engine,
)
from codex_turn.harness.hooks import (
    CompactionHookEvent,
    PromptBuildContext,
    PromptBuildResult,
    TurnHooks,
)
from codex_turn.harness.maintenance import BackgroundMaintenance
from codex_turn.harness.orchestrator import (
    InvalidTurnParams,
    MaintenanceReport,
    TurnParams,
    TurnResult,
    run_codex_turn,
)
from codex_turn.harness.session import (
    SessionError,
    SessionFormatError,
    SessionLockTimeout,
    TranscriptUnwritable,
    load_session_messages,
    mirror_turn,
    reset_session,
)
from codex_turn.harness.usage import Usage
from codex_turn.projection import (
    CodexContextProjection,
    ProjectionError,
    dynamic_tools_fingerprint,
    project_context_engine_assembly,
)

__version__ = "0.1.0"

__all__ = [
    "AfterTurnParams",
    "AppServer",
    "AppServerClosed",
    "AppServerConfig",
    "AppServerError",
    "AppServerRpcError",
    "AppServerStartError",
    "AppServerTimeout",
    "AssembleParams",
    "AssembleResult",
    "BackgroundMaintenance",
    "BindingError",
    "BootstrapParams",
    "BootstrapResult",
    "CodexBinaryMissing",
    "CodexContextProjection",
    "CodexHomeNotPrivate",
    "CodexLoginRequired",
    "CodexTurnError",
    "CompactParams",
    "CompactResult",
    "CompactSessionParams",
    "CompactionHookEvent",
    "CompactionRun",
    "ContextEngine",
    "ContextEngineInfo",
    "ContextProjection",
    "DynamicTool",
    "EngineContractError",
    "EngineContractViolation",
    "EngineError",
    "EngineLoadError",
    "EngineUnavailable",
    "IllegalTransition",
    "IngestBatchParams",
    "IngestBatchResult",
    "IngestParams",
    "IngestResult",
    "InvalidEngineResult",
    "InvalidTurnParams",
    "LegacyContextEngine",
    "MaintainParams",
    "MaintenanceReport",
    "MaintenanceResult",
    "ProjectionError",
    "PromptBuildContext",
    "PromptBuildResult",
    "SessionBusy",
    "SessionError",
    "SessionFormatError",
    "SessionLockTimeout",
    "SkipReason",
    "ThreadBinding",
    "ThreadDecision",
    "ToolResult",
    "TraceEntry",
    "TranscriptUnwritable",
    "TurnBusy",
    "TurnHooks",
    "TurnOutcome",
    "TurnParams",
    "TurnResult",
    "TurnState",
    "TurnTrigger",
    "Usage",
    "__version__",
    "check_engine",
    "compact_codex_session",
    "compact_codex_session_traced",
    "configure_logging",
    "dynamic_tools_fingerprint",
    "load_engine",
    "load_session_messages",
    "mirror_turn",
    "project_context_engine_assembly",
    "read_binding",
    "reset_session",
    "resolve_engine",
    "run_codex_turn",
    "tool",
]
