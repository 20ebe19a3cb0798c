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
* **A binding proves whose it is.** A sidecar copied next to another transcript, or left
  behind by an earlier session at a reused path, would make one session resume another
  session's thread (and send its prompt into that conversation). So a binding records the
  ``sessionId`` it was written for and the ``transcriptId`` of its transcript: the ``id`` of
  the transcript's session header, which our mirror writes as the session id and OpenClaw as
  its sessionId. The header is never rewritten, so the identity survives renames and copies
  of the transcript itself (a transcript copied together with its sidecar is the same
  conversation) and differs for every other session. When the transcript does not exist yet
  (a first turn binds its thread before the mirror creates the file), the identity is the
  session id the mirror will write. :func:`read_binding` ignores, with a warning, a binding
  whose ``sessionId`` differs from the caller's or whose ``transcriptId`` differs from the
  header now on disk; a missing, empty or unreadable transcript has nothing to contradict.
  Sidecars written before these fields existed (OpenClaw's among them) carry neither: they
  are accepted as they are, and the next write (every resume rewrites a binding whose fields
  changed) adds both, so an old sidecar is trusted at most until its session's next turn.
* **Nothing absurd is trusted or logged.** A sidecar over :data:`_MAX_SIDECAR_BYTES` is not
  parsed; a ``threadId`` over :data:`MAX_THREAD_ID_CHARS` (Codex's are 36-character UUIDs)
  or an identity field over :data:`_MAX_ID_CHARS` makes the binding invalid; identifiers in
  log fields are cut to :data:`LOG_ID_CHARS` (:func:`cap_identifier`).

The JSON is camelCase, pretty-printed with two spaces and a trailing newline, keys in
OpenClaw's writer order, unset optionals absent (``approvalsReviewer`` is an addition to
OpenClaw's fields, after ``sandbox``; OpenClaw's reader ignores it, and a binding written
without it reads as unset). ``sessionFile`` is always the caller's argument, never trusted
from the file. Structured via cattrs; types via attrs.

Size (~650 lines, the coverage record included): the record types, their JSON shape
(OpenClaw's field order and names) and
the one reader and writer of the sidecar, which check exactly those shapes: kept together so
that a field and its check cannot drift apart.
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
from codex_turn.harness._fs import atomic_write, atomic_write_lock, open_regular, session_path

__all__ = [
    "BINDING_SCHEMA_VERSION",
    "BINDING_SUFFIX",
    "LOG_ID_CHARS",
    "MAX_THREAD_ID_CHARS",
    "BindingError",
    "ContextEngineBinding",
    "HistoryCoverage",
    "ProjectionBinding",
    "ProjectionMode",
    "ThreadBinding",
    "ThreadDecisionRecord",
    "binding_path",
    "binding_to_json",
    "cap_identifier",
    "clear_binding",
    "context_engine_policy_fingerprint",
    "read_binding",
    "write_binding",
]

_log = get_logger(__name__)

BINDING_SUFFIX: Final = ".codex-app-server.json"
BINDING_SCHEMA_VERSION: Final = 1
#: ``fork_base``: the bound thread is a structured projection's base: it never
#: runs a turn; each turn runs in an ephemeral fork of it (``codex_turn.fsm.thread``).
ProjectionMode = Literal["per_turn", "thread_bootstrap", "fork_base"]
_PROJECTION_MODES: Final = frozenset(get_args(ProjectionMode))
MAX_THREAD_ID_CHARS: Final = 256  # Codex's thread ids are UUIDs; far beyond is not an id
_MAX_ID_CHARS: Final = 1024  # sessionId, transcriptId: hosts choose these, allow headroom
_MAX_SIDECAR_BYTES: Final = 8 << 20  # a dynamic-tools fingerprint can run to some KiB, no more
LOG_ID_CHARS: Final = 200  # identifiers in log fields are cut to this
_HEADER_PROBE_BYTES: Final = 64 * 1024  # a session header is one short line


def cap_identifier(value: str, limit: int = LOG_ID_CHARS) -> str:
    """``value`` safe for a log field: cut to ``limit`` characters, with the count of what
    was cut. For identifiers read from files (a 20 MB ``threadId`` must not become a 20 MB
    log record)."""
    if len(value) > limit:
        return f"{value[:limit]}…(+{len(value) - limit} chars)"
    return value


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
class HistoryCoverage:
    """How much of the transcript the bound thread's native history holds: the first
    ``messages`` messages of the (stripped) history, the last of them with the digest
    ``last_digest`` (``None`` when ``messages`` is 0), plus what the thread itself answered
    after them (its mirror's keys name it). See :mod:`codex_turn.harness.turn.continuity`.
    An addition to OpenClaw's fields (its ``historyCoveredThrough`` in our terms)."""

    messages: int = attrs.field(validator=attrs.validators.ge(0))
    last_digest: str | None = None


@attrs.frozen(kw_only=True)
class ThreadBinding:
    """One sidecar: the thread that continues ``session_file`` and what it was built with.

    Field order is the JSON writer order. ``session_file`` is overwritten with the caller's
    path on read and write. ``approval_policy``, ``sandbox``, ``approvals_reviewer`` and
    ``service_tier`` are the runtime policy the thread was started or resumed with (unset:
    not recorded, e.g. a binding written before the field existed). ``session_id`` and
    ``transcript_id`` prove whose binding it is (see the module header);
    :func:`write_binding` sets ``transcript_id`` from the transcript on disk.
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
    #: Unset: not recorded (a binding written before the field existed), read as covering
    #: the whole transcript, as such a binding always did.
    history_covered_through: HistoryCoverage | None = None
    session_id: str | None = None
    transcript_id: str | None = None
    #: A supervised binding (a branch of a native thread, :mod:`codex_turn.harness.supervision`):
    #: the model picker is locked, so its resumes send no model or provider and Codex restores
    #: the pair the thread persisted. Unset (absent from the JSON): an ordinary binding.
    supervised: bool | None = None
    created_at: str = attrs.Factory(_now_iso)
    updated_at: str = attrs.Factory(_now_iso)

    @property
    def fork_base(self) -> bool:
        """The thread is a structured projection's fork base: it never runs a turn (each turn
        runs in an ephemeral fork of it) and holds no conversation of its own."""
        engine = self.context_engine
        projection = engine.projection if engine is not None else None
        return projection is not None and projection.mode == "fork_base"


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


for _cls in (
    ProjectionBinding,
    ContextEngineBinding,
    ThreadDecisionRecord,
    HistoryCoverage,
    ThreadBinding,
):
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


def _clean_coverage(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        return None
    count, digest = value.get("messages"), value.get("lastDigest")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        return None
    if (count == 0) != (digest is None) or (digest is not None and not _is_str(digest)):
        return None
    return {"messages": count, **({"lastDigest": digest} if digest is not None else {})}


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


class _Unknown:
    """The transcript's identity cannot be told (unreadable, foreign, a huge first line)."""


_UNKNOWN: Final = _Unknown()


def _first_object(chunk: bytes, *, complete: bool) -> object:
    """The first JSON object among the lines of ``chunk`` (blank, malformed and non-object
    lines skipped, as the transcript reader does), ``None`` when there is none, or
    :data:`_UNKNOWN` when ``chunk`` is only a prefix of the file and ends before one."""
    lines = chunk.removeprefix(b"\xef\xbb\xbf").split(b"\n")
    last = len(lines) - 1
    for index, raw in enumerate(lines):
        if index == last and not complete:
            return _UNKNOWN  # a line cut by the probe, or a line still being written
        if not raw.strip():
            continue
        try:
            value = json.loads(raw.decode("utf-8", "replace"))
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict):
            return value
    return None


def _transcript_identity(session_file: str | os.PathLike[str]) -> str | _Unknown | None:
    """The ``id`` of the transcript's session header; ``None`` when the transcript is missing
    or empty (nothing written yet); :data:`_UNKNOWN` when it cannot be told. Never raises,
    never blocks (a FIFO at the path is not read)."""
    try:
        fd = open_regular(session_path(session_file), os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError:
        return _UNKNOWN
    try:
        size = os.fstat(fd).st_size
        chunk = os.pread(fd, min(size, _HEADER_PROBE_BYTES), 0)
    except OSError:
        return _UNKNOWN
    finally:
        os.close(fd)
    if not chunk.strip():
        return None
    first = _first_object(chunk, complete=len(chunk) >= size)
    if not isinstance(first, dict):
        return None if first is None else _UNKNOWN
    header_id = first.get("id")
    if first.get("type") != "session" or not isinstance(header_id, str):
        return _UNKNOWN  # not a transcript: the mirror refuses it, the binding cannot tell
    return header_id


def _identity_field(raw: dict[str, Any], key: str) -> str | _Unknown | None:
    """A recorded identity: absent is ``None``; a non-string or absurd value is invalid."""
    if key not in raw:
        return None
    value = raw[key]
    if not isinstance(value, str) or not value or len(value) > _MAX_ID_CHARS:
        return _UNKNOWN
    return value


_MAX_PATH_CHARS = 4096


def _foreign(
    path: str,
    session_file: str | os.PathLike[str],
    raw: dict[str, Any],
    session_id: str | None,
) -> bool:
    """Whether the binding belongs to another session (then warned and ignored)."""
    recorded_session = _identity_field(raw, "sessionId")
    recorded_transcript = _identity_field(raw, "transcriptId")
    if recorded_session is _UNKNOWN:
        _ignored(path, "invalid sessionId")
        return True
    if recorded_transcript is _UNKNOWN:
        _ignored(path, "invalid transcriptId")
        return True
    if (
        session_id is not None
        and isinstance(recorded_session, str)
        and recorded_session != session_id
    ):
        _ignored(
            path,
            "written for another session",
            bound_session_id=cap_identifier(recorded_session),
            session_id=cap_identifier(session_id),
        )
        return True
    if recorded_session is None and recorded_transcript is None:
        # A sidecar from before the ownership fields still names the transcript it was
        # written for. If that transcript is elsewhere *and still exists*, this is a copy made
        # next to another session's transcript; a session moved with its sidecar (the old
        # path gone) keeps its thread, as OpenClaw's reader would.
        recorded_file = raw.get("sessionFile")
        if (
            isinstance(recorded_file, str)
            and recorded_file
            and len(recorded_file) <= _MAX_PATH_CHARS
            and session_path(recorded_file) != session_path(session_file)
            and os.path.lexists(recorded_file)
        ):
            _ignored(path, "copied from another transcript that still exists")
            return True
    if isinstance(recorded_transcript, str):
        current = _transcript_identity(session_file)
        if isinstance(current, str) and current != recorded_transcript:
            _ignored(
                path,
                "written for another transcript",
                bound_transcript_id=cap_identifier(recorded_transcript),
                transcript_id=cap_identifier(current),
            )
            return True
    return False


def _read_sidecar(path: str) -> bytes | None:
    """The sidecar's bytes, or ``None`` (missing: silently; otherwise with a warning)."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as error:
        _ignored(path, "failed to read", error=format_error(error))
        return None
    try:
        size = os.fstat(fd).st_size
        if size > _MAX_SIDECAR_BYTES:
            _ignored(path, "too large", bytes=size)
            return None
        data = bytearray()
        while chunk := os.read(fd, 1 << 20):
            data += chunk
            if len(data) > _MAX_SIDECAR_BYTES:  # it grew after the fstat
                _ignored(path, "too large", bytes=len(data))
                return None
    except OSError as error:
        _ignored(path, "failed to read", error=format_error(error))
        return None
    finally:
        os.close(fd)
    return bytes(data)


def read_binding(
    session_file: str | os.PathLike[str], *, session_id: str | None = None
) -> ThreadBinding | None:
    """The binding of ``session_file``, or ``None`` when there is no usable one.

    Never raises: a missing sidecar is silently ``None``; an unreadable, oversized,
    unparsable or wrong-schema one (``schemaVersion != 1`` or no string ``threadId`` of at
    most :data:`MAX_THREAD_ID_CHARS`) is ``None`` with a warning, and so is a binding of
    another session: its ``sessionId`` differs from ``session_id`` (when given), or its
    ``transcriptId`` from the ``id`` of the transcript's header (module header). Fields of
    the wrong type are dropped; ``cwd`` defaults to ``""`` and the timestamps to now; a
    malformed ``contextEngine`` block reads as absent. Warnings carry reasons, sizes and
    identifiers cut to :data:`LOG_ID_CHARS`, never the sidecar's content.
    """
    path = binding_path(session_file)
    raw_bytes = _read_sidecar(path)
    if raw_bytes is None:
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
    if len(thread_id) > MAX_THREAD_ID_CHARS:
        _ignored(path, "invalid threadId", thread_id=cap_identifier(thread_id))
        return None
    if _foreign(path, session_file, raw, session_id):
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
    coverage = _clean_coverage(raw.get("historyCoveredThrough"))
    if coverage is not None:
        cleaned["historyCoveredThrough"] = coverage
    elif "historyCoveredThrough" in raw:
        # Another writer's shape, or a damaged one: unknown coverage reads as unset.
        _log.warning("codex app-server binding has an invalid historyCoveredThrough", path=path)
    for key in ("sessionId", "transcriptId"):
        if key in raw:
            cleaned[key] = raw[key]  # checked by _foreign
    if raw.get("supervised") is True:
        cleaned["supervised"] = True
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
    session_id: str | None = None,
) -> ThreadBinding:
    """Atomically replace the sidecar of ``session_file`` with ``binding``; return what was written.

    ``sessionFile`` is set to the caller's path and, with ``touch``, ``updatedAt`` to now
    (``createdAt`` is the caller's: new on ``thread/start``, kept on resume). ``sessionId``
    is ``session_id`` when given, else the binding's; ``transcriptId`` is the ``id`` of the
    transcript's header on disk, or the session id when the transcript has none yet (the
    mirror will write it there), or unset when it cannot be told. Raises
    :class:`BindingError` when the write fails; the previous sidecar is then unchanged.
    """
    path = binding_path(session_file)
    owner = session_id if session_id is not None else binding.session_id
    identity = _transcript_identity(session_file)
    changes: dict[str, Any] = {
        "session_file": os.fspath(session_file),
        "session_id": owner,
        "transcript_id": owner if identity is None else None if identity is _UNKNOWN else identity,
    }
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
