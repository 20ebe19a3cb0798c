"""The context-engine contract, its JSON shapes, its checks and the loader.

* :mod:`.contract`: what an engine is, what it is called with and returns (the params and
  results, the :class:`ContextEngine` protocol and its optional ``Supports*`` methods, the
  errors, the legacy engine);
* :mod:`.shapes`: the records as OpenClaw's camelCase JSON (one strict converter);
* :mod:`.validation`: checking an engine before it is used and what it returns at the
  boundary, :func:`optional_method` (the one way to reach an engine's method) and
  :class:`EngineHandle`;
* :mod:`.loading`: a spec ``"package.module:attribute"`` made an engine
  (:func:`load_engine`), and :func:`resolve_engine`, which every turn and compaction calls
  first.

The dependency order is ``contract`` <- ``shapes`` <- ``validation`` <- ``loading``. This
package re-exports what callers import from it (``codex_turn.harness.engine``); modules of the
harness import from the submodule a name lives in.
"""

from __future__ import annotations

from .contract import (
    LEGACY_ENGINE_ID,
    OPTIONAL_METHODS,
    REQUIRED_METHODS,
    TOOL_METHODS,
    AfterTurnParams,
    AgentMessage,
    AssembleParams,
    AssembleResult,
    BootstrapParams,
    BootstrapResult,
    CompactDetails,
    CompactParams,
    CompactResult,
    ContextEngine,
    ContextEngineInfo,
    ContextProjection,
    EngineContractError,
    EngineContractViolation,
    EngineError,
    EngineLoadError,
    EngineTool,
    EngineToolConflict,
    EngineUnavailable,
    IngestBatchParams,
    IngestBatchResult,
    IngestParams,
    IngestResult,
    InvalidEngineResult,
    LegacyContextEngine,
    MaintainParams,
    MaintenanceResult,
    RuntimeContext,
    SupportsAfterTurn,
    SupportsBootstrap,
    SupportsDispose,
    SupportsIngestBatch,
    SupportsMaintain,
    SupportsTools,
    ToolCallParams,
    ToolCallResult,
    ToolsParams,
    ToolsResult,
    TranscriptRewriteReplacement,
    TranscriptRewriteRequest,
    TranscriptRewriteResult,
)
from .loading import load_engine, resolve_engine
from .shapes import converter, from_json, json_type_name, to_json
from .validation import (
    EngineCapabilities,
    EngineHandle,
    check_engine,
    coerce_result,
    engine_capabilities,
    engine_id,
    engine_info,
    engine_log_fields,
    ensure_assemble_result,
    ensure_tools_result,
    is_active_engine,
    optional_method,
)

__all__ = [
    "LEGACY_ENGINE_ID",
    "OPTIONAL_METHODS",
    "REQUIRED_METHODS",
    "TOOL_METHODS",
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
    "EngineHandle",
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
    "TranscriptRewriteReplacement",
    "TranscriptRewriteRequest",
    "TranscriptRewriteResult",
    "check_engine",
    "coerce_result",
    "converter",
    "engine_capabilities",
    "engine_id",
    "engine_info",
    "engine_log_fields",
    "ensure_assemble_result",
    "ensure_tools_result",
    "from_json",
    "is_active_engine",
    "json_type_name",
    "load_engine",
    "optional_method",
    "resolve_engine",
    "to_json",
]
