"""The supervision machines: branching a native thread, archiving one, uploading diagnostics.

Rule 1: every decision about the course of these runtime operations lives here, as tables.
:mod:`codex_turn.harness.supervision` and :mod:`codex_turn.harness.diagnostics` do the I/O
(``thread/read``, ``thread/list``, ``thread/fork``, ``thread/start``, ``thread/inject_items``,
``thread/archive``, ``feedback/upload``, the host's approval callback), set the facts they
learned on the model and fire the past-tense trigger that says what happened; they ask the
table (:meth:`~codex_turn.fsm._machine.Model.allows`, the state), never their own flags.
Rule 2: no I/O here, nothing of Codex's wording.

Theory of operation.

**Branch** ("continue as branch", :data:`BRANCH_TABLE`). A native thread of a Codex home
(one a person runs in their own Codex, say) is continued in a *new* thread, never by
resuming it: the source is read passively, its visible history up to its last terminal turn
is taken, a temporary native fork pins that snapshot (and says which model and provider the
thread runs on), the canonical thread starts with exactly that model and provider, the
bounded user/assistant history is injected, and the temporary fork is archived::

    reading_source --source_read--> forking --forked--> starting --thread_started-->
        injecting --history_injected--> archiving_fork --fork_archived--> branched

A source Codex reports active is refused (``source_read [source_active]``): its history is
still moving and its owner may be mid-turn. A source without a terminal turn has nothing to
continue from (refused). A failure after the fork still archives the fork (the ``failed``
guard carries the failure across ``archiving_fork``), so no temporary thread is left behind
by a failed branch either.

**Archive** (:data:`ARCHIVE_TABLE`). Archiving hides a thread and cannot be undone by this
library, so every doubt refuses: an active target never; an idle, not-loaded (``notLoaded``
means *unknown*, not idle) or errored target only with an explicit confirmation; then every
unarchived descendant (Codex's paginated ``ancestorThreadId`` query) is checked and a
known-active one blocks it. An enumeration error, a cycle (a thread met twice) or an
exhausted safety limit fails closed (``failed``: nothing archived)::

    reading_target --target_read--> checking_descendants --descendants_checked-->
        archiving --archived--> archived

**Diagnostics** (:data:`DIAGNOSTICS_TABLE`). ``feedback/upload`` sends logs to OpenAI; it runs
only on an *explicit* approval from the host. A denied request and an ignored one (no answer
within the bound, a callback that failed) both end ``withheld``: nothing uploaded, and the
result shows no ids::

    listing --threads_listed--> asking --approved--> uploading --uploads_done--> uploaded

WARNING: ``diagrams/branch.mmd``, ``diagrams/archive.mmd`` and ``diagrams/diagnostics.mmd``
are rendered from these tables; a test fails when stale.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

import attrs

from codex_turn.fsm._machine import Edge, Model, TableMachine

__all__ = [
    "ARCHIVE_MACHINE",
    "ARCHIVE_TABLE",
    "BRANCH_MACHINE",
    "BRANCH_TABLE",
    "DIAGNOSTICS_MACHINE",
    "DIAGNOSTICS_TABLE",
    "ArchiveModel",
    "ArchiveState",
    "ArchiveTrigger",
    "BranchModel",
    "BranchState",
    "BranchTrigger",
    "DiagnosticsModel",
    "DiagnosticsState",
    "DiagnosticsTrigger",
    "NativeStatus",
    "native_status",
]


class NativeStatus(enum.Enum):
    """A native thread's runtime status as Codex reports it (``thread.status.type``)."""

    IDLE = "idle"
    ACTIVE = "active"
    #: Not loaded in the app-server asked: *unknown*, another process may run it.
    NOT_LOADED = "notLoaded"
    SYSTEM_ERROR = "systemError"
    #: A status this library does not know: treated as unknown (never as idle).
    UNKNOWN = "unknown"


def native_status(wire: object) -> NativeStatus:
    """The :class:`NativeStatus` of a ``thread.status`` object (anything else: unknown)."""
    kind = wire.get("type") if isinstance(wire, Mapping) else None
    for status in NativeStatus:
        if status.value == kind:
            return status
    return NativeStatus.UNKNOWN


# --------------------------------------------------------------------------------------------
# Branch
# --------------------------------------------------------------------------------------------


class BranchState(enum.Enum):
    READING_SOURCE = "reading_source"
    FORKING = "forking"
    STARTING = "starting"
    INJECTING = "injecting"
    ARCHIVING_FORK = "archiving_fork"
    # Final states.
    BRANCHED = "branched"
    REFUSED = "refused"
    FAILED = "failed"


class BranchTrigger(enum.StrEnum):
    #: ``thread/read`` and the turn pages answered: the source's status and history are known.
    SOURCE_READ = "source_read"
    SOURCE_UNREADABLE = "source_unreadable"
    #: The temporary fork exists (its model and provider are known).
    FORKED = "forked"
    FORK_FAILED = "fork_failed"
    THREAD_STARTED = "thread_started"
    START_FAILED = "start_failed"
    HISTORY_INJECTED = "history_injected"
    INJECT_FAILED = "inject_failed"
    FORK_ARCHIVED = "fork_archived"
    FORK_ARCHIVE_FAILED = "fork_archive_failed"


_B = BranchState
_BT = BranchTrigger

BRANCH_TABLE: dict[BranchState, tuple[Edge, ...]] = {
    _B.READING_SOURCE: (
        Edge(_BT.SOURCE_READ, _B.FORKING, unless=("source_active", "no_terminal_turn")),
        Edge(_BT.SOURCE_READ, _B.REFUSED, when=("source_active",)),
        Edge(_BT.SOURCE_READ, _B.REFUSED, when=("no_terminal_turn",)),
        Edge(_BT.SOURCE_UNREADABLE, _B.FAILED),
    ),
    _B.FORKING: (
        Edge(_BT.FORKED, _B.STARTING),
        Edge(_BT.FORK_FAILED, _B.FAILED),
    ),
    # From here on the temporary fork exists: every ending goes through archiving_fork.
    _B.STARTING: (
        Edge(_BT.THREAD_STARTED, _B.INJECTING),
        Edge(_BT.START_FAILED, _B.ARCHIVING_FORK),
    ),
    _B.INJECTING: (
        Edge(_BT.HISTORY_INJECTED, _B.ARCHIVING_FORK),
        Edge(_BT.INJECT_FAILED, _B.ARCHIVING_FORK),
    ),
    _B.ARCHIVING_FORK: (
        Edge(_BT.FORK_ARCHIVED, _B.BRANCHED, unless=("failed",)),
        Edge(_BT.FORK_ARCHIVED, _B.FAILED, when=("failed",)),
        Edge(_BT.FORK_ARCHIVE_FAILED, _B.FAILED),
    ),
    _B.BRANCHED: (),
    _B.REFUSED: (),
    _B.FAILED: (),
}

#: The triggers after which the branch has failed, whatever comes next (the fork is still
#: archived: the ``failed`` guard).
BRANCH_FAILURES: Final = frozenset({_BT.START_FAILED, _BT.INJECT_FAILED})

BRANCH_MACHINE = TableMachine(
    name="branch",
    states=BranchState,
    table=BRANCH_TABLE,
    initial=BranchState.READING_SOURCE,
    final=(BranchState.BRANCHED, BranchState.REFUSED, BranchState.FAILED),
)


@attrs.define(eq=False, slots=False)
class BranchModel(Model):
    """One branch run through :data:`BRANCH_TABLE`; the executor sets the facts it learned
    (``source_active``, ``no_terminal_turn``) before firing ``source_read``."""

    machine = BRANCH_MACHINE

    source_active: bool = False
    no_terminal_turn: bool = False

    @classmethod
    def begin(cls) -> BranchModel:
        model = cls()
        model._attach(None)
        return model

    @property
    def failed(self) -> bool:
        return any(entry.trigger in BRANCH_FAILURES for entry in self.trace)


# --------------------------------------------------------------------------------------------
# Archive
# --------------------------------------------------------------------------------------------


class ArchiveState(enum.Enum):
    READING_TARGET = "reading_target"
    CHECKING_DESCENDANTS = "checking_descendants"
    ARCHIVING = "archiving"
    # Final states.
    ARCHIVED = "archived"
    REFUSED = "refused"
    FAILED = "failed"


class ArchiveTrigger(enum.StrEnum):
    TARGET_READ = "target_read"
    TARGET_UNREADABLE = "target_unreadable"
    #: Every page of unarchived descendants was read, no thread met twice, within the limit.
    DESCENDANTS_CHECKED = "descendants_checked"
    #: A page could not be read, a thread came twice (a cycle) or the safety limit ran out.
    ENUMERATION_FAILED = "enumeration_failed"
    ARCHIVED = "archived"
    ARCHIVE_FAILED = "archive_failed"


_A = ArchiveState
_AT = ArchiveTrigger

ARCHIVE_TABLE: dict[ArchiveState, tuple[Edge, ...]] = {
    _A.READING_TARGET: (
        Edge(_AT.TARGET_READ, _A.CHECKING_DESCENDANTS, when=("confirmed",), unless=("active",)),
        Edge(_AT.TARGET_READ, _A.REFUSED, when=("active",)),
        Edge(_AT.TARGET_READ, _A.REFUSED, unless=("confirmed",)),
        Edge(_AT.TARGET_UNREADABLE, _A.FAILED),
    ),
    _A.CHECKING_DESCENDANTS: (
        Edge(_AT.DESCENDANTS_CHECKED, _A.ARCHIVING, unless=("descendant_active",)),
        Edge(_AT.DESCENDANTS_CHECKED, _A.REFUSED, when=("descendant_active",)),
        Edge(_AT.ENUMERATION_FAILED, _A.FAILED),
    ),
    _A.ARCHIVING: (
        Edge(_AT.ARCHIVED, _A.ARCHIVED),
        Edge(_AT.ARCHIVE_FAILED, _A.FAILED),
    ),
    _A.ARCHIVED: (),
    _A.REFUSED: (),
    _A.FAILED: (),
}

ARCHIVE_MACHINE = TableMachine(
    name="archive",
    states=ArchiveState,
    table=ARCHIVE_TABLE,
    initial=ArchiveState.READING_TARGET,
    final=(ArchiveState.ARCHIVED, ArchiveState.REFUSED, ArchiveState.FAILED),
)


@attrs.define(eq=False, slots=False)
class ArchiveModel(Model):
    """One archive run through :data:`ARCHIVE_TABLE`. ``confirmed`` is the caller's explicit
    confirmation; ``target_status`` and ``descendant_active`` are set by the executor before
    it fires ``target_read`` / ``descendants_checked``."""

    machine = ARCHIVE_MACHINE

    confirmed: bool = False
    target_status: NativeStatus = NativeStatus.UNKNOWN
    descendant_active: bool = False

    @classmethod
    def begin(cls, *, confirmed: bool) -> ArchiveModel:
        model = cls(confirmed=confirmed)
        model._attach(None)
        return model

    @property
    def active(self) -> bool:
        return self.target_status is NativeStatus.ACTIVE


# --------------------------------------------------------------------------------------------
# Diagnostics
# --------------------------------------------------------------------------------------------


class DiagnosticsState(enum.Enum):
    LISTING = "listing"
    ASKING = "asking"
    UPLOADING = "uploading"
    # Final states.
    UPLOADED = "uploaded"
    WITHHELD = "withheld"
    FAILED = "failed"


class DiagnosticsTrigger(enum.StrEnum):
    #: The threads to upload are known (the listed ones and their spawned sub-threads).
    THREADS_LISTED = "threads_listed"
    LIST_FAILED = "list_failed"
    #: The host's approval callback answered "upload".
    APPROVED = "approved"
    DENIED = "denied"
    #: No answer within the bound, or the callback failed: never an approval.
    IGNORED = "ignored"
    THREAD_UPLOADED = "thread_uploaded"
    UPLOADS_DONE = "uploads_done"
    #: Codex refused an upload (feedback disabled by configuration, no network ...).
    UPLOAD_FAILED = "upload_failed"


_D = DiagnosticsState
_DT = DiagnosticsTrigger

DIAGNOSTICS_TABLE: dict[DiagnosticsState, tuple[Edge, ...]] = {
    _D.LISTING: (
        Edge(_DT.THREADS_LISTED, _D.ASKING),
        Edge(_DT.LIST_FAILED, _D.FAILED),
    ),
    _D.ASKING: (
        Edge(_DT.APPROVED, _D.UPLOADING),
        Edge(_DT.DENIED, _D.WITHHELD),
        Edge(_DT.IGNORED, _D.WITHHELD),
    ),
    _D.UPLOADING: (
        Edge(_DT.UPLOADS_DONE, _D.UPLOADED),
        Edge(_DT.THREAD_UPLOADED, None),
        Edge(_DT.UPLOAD_FAILED, _D.FAILED),
    ),
    _D.UPLOADED: (),
    _D.WITHHELD: (),
    _D.FAILED: (),
}

DIAGNOSTICS_MACHINE = TableMachine(
    name="diagnostics",
    states=DiagnosticsState,
    table=DIAGNOSTICS_TABLE,
    initial=DiagnosticsState.LISTING,
    final=(DiagnosticsState.UPLOADED, DiagnosticsState.WITHHELD, DiagnosticsState.FAILED),
)


@attrs.define(eq=False, slots=False)
class DiagnosticsModel(Model):
    """One diagnostics request through :data:`DIAGNOSTICS_TABLE`."""

    machine = DIAGNOSTICS_MACHINE

    @classmethod
    def begin(cls) -> DiagnosticsModel:
        model = cls()
        model._attach(None)
        return model
