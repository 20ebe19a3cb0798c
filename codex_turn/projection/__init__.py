"""Pure functions from an engine's assembly to what Codex receives (no I/O, byte-stable).

* :mod:`.frame`: the OpenClaw frame, message rendering, duplicate-prompt rule, truncation;
  :func:`project_context_engine_assembly` (per turn) and
  :func:`project_thread_bootstrap_assembly` (once per engine epoch, tool shapes preserved).
* :mod:`.budget`: the rendered-context cap as a function of the token budget and reserve.
* :mod:`.payload`: tool-payload shapes and secret redaction for the bootstrap variant.
* :mod:`.fingerprint`: the dynamic-tools fingerprint that decides whether a thread resumes.

Nothing here performs I/O, reads a clock or depends on hash order: equal inputs give equal
bytes, in every interpreter (tests run it under different ``PYTHONHASHSEED`` values).
"""

from codex_turn.projection.budget import (
    DEFAULT_MAX_RENDERED_CONTEXT_CHARS,
    DEFAULT_RESERVE_TOKENS,
    MAX_RENDERED_CONTEXT_CHARS_CEILING,
    max_rendered_context_chars,
    prompt_budget_tokens,
    resolve_projection_reserve_tokens,
    text_part_max_chars,
)
from codex_turn.projection.fingerprint import dynamic_tools_fingerprint, fingerprints_compatible
from codex_turn.projection.frame import (
    CONTEXT_CLOSE_TAG,
    CONTEXT_HEADER,
    CONTEXT_OPEN_TAG,
    CONTEXT_SAFETY_NOTE,
    CURRENT_REQUEST_LABEL,
    CodexContextProjection,
    ProjectionError,
    ToolPayloadMode,
    frame_context,
    project_context_engine_assembly,
    project_thread_bootstrap_assembly,
    render_context,
    render_message,
    truncate_older,
)
from codex_turn.projection.payload import input_shape, redact_secrets

__all__ = [
    "CONTEXT_CLOSE_TAG",
    "CONTEXT_HEADER",
    "CONTEXT_OPEN_TAG",
    "CONTEXT_SAFETY_NOTE",
    "CURRENT_REQUEST_LABEL",
    "DEFAULT_MAX_RENDERED_CONTEXT_CHARS",
    "DEFAULT_RESERVE_TOKENS",
    "MAX_RENDERED_CONTEXT_CHARS_CEILING",
    "CodexContextProjection",
    "ProjectionError",
    "ToolPayloadMode",
    "dynamic_tools_fingerprint",
    "fingerprints_compatible",
    "frame_context",
    "input_shape",
    "max_rendered_context_chars",
    "project_context_engine_assembly",
    "project_thread_bootstrap_assembly",
    "prompt_budget_tokens",
    "redact_secrets",
    "render_context",
    "render_message",
    "resolve_projection_reserve_tokens",
    "text_part_max_chars",
    "truncate_older",
]
