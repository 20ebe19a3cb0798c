"""The Codex thread binding: which app-server thread continues a session transcript.

Theory
------
A transcript and a Codex thread hold two copies of one conversation. The binding records the
pairing, in a sidecar next to the transcript, ``<session file>.codex-app-server.json`` (the
session file's :func:`~codex_turn.harness._fs.session_path` plus the suffix: the file
OpenClaw's plain string append names, under the key the transcript lock and the turn gates
use). It says which thread to resume and under which *conditions* that thread was built:
model, the runtime policy the thread was started or resumed with (approval policy, sandbox,
approvals reviewer, service tier), the dynamic tools fingerprint and, for context engines,
the ``contextEngine`` block (engine id, policy fingerprint and the projection that seeded the
thread: mode, epoch, fingerprint). When the conditions change, the thread's context is stale
and the caller rotates to a new thread. So a binding is only ever an *optimisation*, and that
decides how it fails:

* **Reading is forgiving.** A missing, unreadable, unparsable or wrong-schema sidecar means
  "no binding" (with a warning), and a field of the wrong type becomes unset. The worst
  outcome is a fresh thread, never an error surfacing in a turn.
* **Writing is atomic** (:func:`codex_turn.harness._fs.atomic_write`). The JSON goes to a
  temp file in the same directory, which is fsynced and then renamed over the sidecar
  (``os.replace``), and the directory is fsynced. A reader sees the old binding or the new
  one, never a torn mix; a process killed between write and rename leaves the old binding
  intact plus a temp file, which the next write of the same sidecar removes once its writer
  pid is dead.
* **Clearing is an unlink.** ``/new``, ``/reset``, a fingerprint change or a failed resume
  remove the sidecar; the next turn starts a new thread.

The JSON is camelCase, pretty-printed with two spaces and a trailing newline, keys in
OpenClaw's writer order, unset optionals absent (``approvalsReviewer`` is an addition to
OpenClaw's fields, after ``sandbox``; OpenClaw's reader ignores it, and a binding written
without it reads as unset). ``sessionFile`` is always the caller's argument, never trusted
from the file. Structured via cattrs; types via attrs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final, Literal, cast, get_args

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from codex_turn._log import format_error, get_logger
from codex_turn.errors import CodexTurnError
from codex_turn.harness._fs import atomic_write, atomic_write_lock, session_path

__all__ = [
    "BINDING_SCHEMA_VERSION",
    "BINDING_SUFFIX",
    "BindingError",
    "ContextEngineBinding",
    "ProjectionBinding",
    "ProjectionMode",
    "ThreadBinding",
    "ThreadDecisionRecord",
    "binding_path",
    "binding_to_json",
    "clear_binding",
    "context_engine_policy_fingerprint",
    "read_binding",
    "write_binding",
]

_log = get_logger(__name__)

BINDING_SUFFIX: Final = ".codex-app-server.json"
BINDING_SCHEMA_VERSION: Final = 1
ProjectionMode = Literal["per_turn", "thread_bootstrap"]
_PROJECTION_MODES: Final = frozenset(get_args(ProjectionMode))


class BindingError(CodexTurnError):
    """The binding sidecar could not be written or removed (reading never raises)."""


def _now_iso() -> str:
    now = datetime.now(UTC)
    return now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"


@attrs.frozen(kw_only=True)
class ProjectionBinding:
    """How the engine's context was projected into the thread: mode, epoch, fingerprint."""

    schema_version: int = 1
    mode: ProjectionMode
    epoch: str = attrs.field(validator=attrs.validators.min_len(1))
    fingerprint: str | None = None


@attrs.frozen(kw_only=True)
class ContextEngineBinding:
    """The context engine a thread was built for (the thread decision compares engine id,
    policy fingerprint and projection epoch: ``codex_turn.fsm.thread``)."""

    schema_version: int = 1
    engine_id: str
    policy_fingerprint: str
    projection: ProjectionBinding | None = None


@attrs.frozen(kw_only=True)
class ThreadDecisionRecord:
    """Why the bound thread is the one it is: the thread decision that produced or kept it
    (``start``/``resume``/``rotate`` and the reason, e.g. ``thread-bootstrap-epoch-changed``).
    An addition to OpenClaw's fields; OpenClaw's reader ignores it."""

    action: str
    reason: str


@attrs.frozen(kw_only=True)
class ThreadBinding:
    """One sidecar: the thread that continues ``session_file`` and what it was built with.

    Field order is the JSON writer order. ``session_file`` is overwritten with the caller's
    path on read and write. ``approval_policy``, ``sandbox``, ``approvals_reviewer`` and
    ``service_tier`` are the runtime policy the thread was started or resumed with (unset:
    not recorded, e.g. a binding written before the field existed).
    """

    schema_version: int = BINDING_SCHEMA_VERSION
    session_file: str = ""
    thread_id: str
    cwd: str = ""
    auth_profile_id: str | None = None
    model: str | None = None
    model_provider: str | None = None
    approval_policy: str | None = None
    sandbox: str | None = None
    approvals_reviewer: str | None = None
    service_tier: str | None = None
    dynamic_tools_fingerprint: str | None = None
    context_engine: ContextEngineBinding | None = None
    thread_decision: ThreadDecisionRecord | None = None
    created_at: str = attrs.Factory(_now_iso)
    updated_at: str = attrs.Factory(_now_iso)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


_converter = cattrs.Converter()


def _register(cls: type[Any]) -> None:
    fields = attrs.fields(cls)
    order = [_camel(f.name) for f in fields]
    unstructure = {
        f.name: override(rename=_camel(f.name), omit_if_default=f.default is None) for f in fields
    }
    structure = {f.name: override(rename=_camel(f.name)) for f in fields}
    generated = make_dict_unstructure_fn(cls, _converter, **cast(dict[str, Any], unstructure))

    def unstructure_in_order(obj: Any) -> dict[str, Any]:
        # cattrs emits omittable fields last; OpenClaw's writer order is the declaration order.
        raw = generated(obj)
        return {key: raw[key] for key in order if key in raw}

    _converter.register_unstructure_hook(cls, unstructure_in_order)
    _converter.register_structure_hook(
        cls, make_dict_structure_fn(cls, _converter, **cast(dict[str, Any], structure))
    )


for _cls in (ProjectionBinding, ContextEngineBinding, ThreadDecisionRecord, ThreadBinding):
    _register(_cls)


def binding_path(session_file: str | os.PathLike[str]) -> str:
    """``<session_path(session file)>.codex-app-server.json``: OpenClaw's suffix, appended to
    the session file's canonical name."""
    return session_path(session_file) + BINDING_SUFFIX


def context_engine_policy_fingerprint(
    *,
    engine_id: str,
    engine_version: str | None = None,
    owns_compaction: bool = False,
    turn_maintenance_mode: str | None = None,
    citations_mode: str | None = None,
    context_token_budget: int | None = None,
    projection_max_chars: int | None = None,
) -> str:
    """OpenClaw's ``policyFingerprint``: compact JSON in a fixed key order, unset keys dropped."""
    policy: dict[str, Any] = {
        "schemaVersion": 1,
        "engineId": engine_id,
        "engineVersion": engine_version,
        "ownsCompaction": owns_compaction,
        "turnMaintenanceMode": turn_maintenance_mode,
        "citationsMode": citations_mode,
        "contextTokenBudget": context_token_budget,
        "projectionMaxChars": projection_max_chars,
    }
    return json.dumps(
        {k: v for k, v in policy.items() if v is not None},
        separators=(",", ":"),
        ensure_ascii=False,
    )


# --------------------------------------------------------------------------------------------
# Reading


def _clean(raw: dict[str, Any], spec: dict[str, Callable[[Any], bool]]) -> dict[str, Any]:
    """Keep the known keys whose values pass their check; a bad value becomes unset."""
    return {key: raw[key] for key, check in spec.items() if key in raw and check(raw[key])}


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_schema_1(value: Any) -> bool:
    return value == 1 and not isinstance(value, bool)


def _clean_projection(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict) or not _is_schema_1(value.get("schemaVersion")):
        return None
    epoch = value.get("epoch")
    if (
        value.get("mode") not in _PROJECTION_MODES
        or not isinstance(epoch, str)
        or not epoch.strip()
    ):
        return None
    return _clean(
        value,
        {"schemaVersion": _is_schema_1, "mode": _is_str, "epoch": _is_str, "fingerprint": _is_str},
    )


def _clean_context_engine(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict) or not _is_schema_1(value.get("schemaVersion")):
        return None
    if not isinstance(value.get("engineId"), str) or not isinstance(
        value.get("policyFingerprint"), str
    ):
        return None
    cleaned = _clean(
        value, {"schemaVersion": _is_schema_1, "engineId": _is_str, "policyFingerprint": _is_str}
    )
    if "projection" in value:
        projection = _clean_projection(value["projection"])
        if projection is None:
            return None  # an unknown projection cannot be proven compatible: rotate
        cleaned["projection"] = projection
    return cleaned


_STRING_FIELDS: Final = (
    "cwd",
    "authProfileId",
    "model",
    "modelProvider",
    "approvalPolicy",
    "sandbox",
    "approvalsReviewer",
    "serviceTier",
    "dynamicToolsFingerprint",
    "createdAt",
    "updatedAt",
)


def _ignored(path: str, reason: str, **fields: Any) -> None:
    _log.warning("codex app-server binding ignored", path=path, reason=reason, **fields)


def read_binding(session_file: str | os.PathLike[str]) -> ThreadBinding | None:
    """The binding of ``session_file``, or ``None`` when there is no usable one.

    Never raises: a missing sidecar is silently ``None``; an unreadable, unparsable or
    wrong-schema one (``schemaVersion != 1`` or no string ``threadId``) is ``None`` with a
    warning. Fields of the wrong type are dropped; ``cwd`` defaults to ``""`` and the
    timestamps to now; a malformed ``contextEngine`` block reads as absent.
    """
    path = binding_path(session_file)
    try:
        with open(path, "rb") as handle:
            raw_bytes = handle.read()
    except FileNotFoundError:
        return None
    except OSError as error:
        _ignored(path, "failed to read", error=format_error(error))
        return None
    try:
        raw = json.loads(raw_bytes.decode("utf-8"))
    except (ValueError, RecursionError) as error:
        _ignored(path, "failed to parse", error=format_error(error))
        return None
    if not isinstance(raw, dict):
        _ignored(path, "not a JSON object")
        return None
    if not _is_schema_1(raw.get("schemaVersion")):
        _ignored(path, "unsupported schemaVersion")
        return None
    thread_id = raw.get("threadId")
    if not isinstance(thread_id, str) or not thread_id:
        _ignored(path, "missing threadId")
        return None
    cleaned = {key: raw[key] for key in _STRING_FIELDS if _is_str(raw.get(key))}
    engine = _clean_context_engine(raw.get("contextEngine"))
    if engine is not None:
        cleaned["contextEngine"] = engine
    elif "contextEngine" in raw:
        _log.warning("codex app-server binding has an invalid contextEngine", path=path)
    decision = raw.get("threadDecision")
    if (
        isinstance(decision, dict)
        and _is_str(decision.get("action"))
        and _is_str(decision.get("reason"))
    ):
        cleaned["threadDecision"] = {"action": decision["action"], "reason": decision["reason"]}
    cleaned.update(schemaVersion=1, threadId=thread_id, sessionFile=os.fspath(session_file))
    try:
        return _converter.structure(cleaned, ThreadBinding)
    except (cattrs.BaseValidationError, ValueError, TypeError) as error:
        _ignored(path, "invalid fields", error=format_error(error))
        return None


# --------------------------------------------------------------------------------------------
# Writing


def binding_to_json(binding: ThreadBinding) -> str:
    """The sidecar text: pretty JSON (2 spaces), writer key order, trailing newline."""
    return json.dumps(_converter.unstructure(binding), indent=2, ensure_ascii=False) + "\n"


def write_binding(
    session_file: str | os.PathLike[str],
    binding: ThreadBinding,
    *,
    touch: bool = True,
) -> ThreadBinding:
    """Atomically replace the sidecar of ``session_file`` with ``binding``; return what was written.

    ``sessionFile`` is set to the caller's path and, with ``touch``, ``updatedAt`` to now
    (``createdAt`` is the caller's: new on ``thread/start``, kept on resume). Raises
    :class:`BindingError` when the write fails; the previous sidecar is then unchanged.
    """
    path = binding_path(session_file)
    changes: dict[str, Any] = {"session_file": os.fspath(session_file)}
    if touch:
        changes["updated_at"] = _now_iso()
    binding = attrs.evolve(binding, **changes)
    data = binding_to_json(binding).encode("utf-8")
    try:
        atomic_write(path, data)
    except OSError as error:
        raise BindingError(f"failed to write codex app-server binding {path}: {error}") from error
    return binding


def clear_binding(session_file: str | os.PathLike[str]) -> bool:
    """Remove the sidecar of ``session_file``. Returns whether one existed.

    Raises :class:`BindingError` when it exists but cannot be removed.
    """
    path = binding_path(session_file)
    with atomic_write_lock(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as error:
            raise BindingError(
                f"failed to clear codex app-server binding {path}: {error}"
            ) from error
    return True
