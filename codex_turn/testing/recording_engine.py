"""A context engine that records every call, answers as scripted and fails on demand.

For authors of runners (hosts) and of engine wrappers: it implements the whole contract of
:mod:`codex_turn.harness.engine` and can be shaped into any engine a host may meet, so a test
asserts what the host *called*, in which order, with which params, and how it coped with a
missing method, a bad answer, an exception or a slow engine.

Theory of operation
-------------------

* **Records.** Every call appends a :class:`Call` (sequence number, method, a snapshot of the
  params, monotonic start and end times, the result or the exception) to ``engine.calls``
  *before* it returns, so a test can inspect calls made by code that is still running.
  Snapshots deep-copy the messages (a host that mutates a list after the call cannot rewrite
  history) but not the runtime context, whose callables (``rewriteTranscriptEntries``) must
  stay the same objects.
* **Omits methods.** ``omit={"after_turn", "ingest_batch"}`` makes those attributes *absent*
  (``hasattr`` is false), exactly like an engine that never defined them: a host must detect
  capabilities, not call stubs. Required methods can be omitted too, to build broken engines.
* **Answers.** ``responses={"assemble": AssembleResult(...)}`` returns a fixed value; a
  callable ``(params) -> value`` (sync or async) computes one and may await, e.g. an
  ``anyio.Event`` that holds a call open. Defaults: ``assemble`` echoes a *new* list equal to
  its input (a reference-equality check catches "same object" shortcuts) with
  ``estimated_tokens`` = the number of messages, ``ingest`` ingests, ``ingest_batch`` counts,
  ``maintain`` reports no change, ``compact`` compacts nothing, ``bootstrap`` bootstraps.
* **Fails.** ``failures={"ingest": RuntimeError("boom")}`` raises on every call; a callable
  ``(params) -> BaseException | None`` decides per call (fail one message of a batch of
  ingests). Failures win over responses.
* **Delays.** ``delays={"after_turn": 0.5}`` sleeps (``anyio.sleep``) before answering.

With its defaults it stores nothing (its assembly is its input): run the conformance suite on
it with ``storage="none"`` (:mod:`codex_turn.testing.conformance`).

Helpers: :meth:`RecordingEngine.methods` (call order), :meth:`RecordingEngine.calls_to`,
:meth:`RecordingEngine.only_call` (asserts exactly one) and :meth:`RecordingEngine.reset`.

Example::

    engine = RecordingEngine(
        engine_id="lossless-claw",
        omit={"after_turn"},
        failures={"ingest_batch": RuntimeError("disk full")},
    )
    outcome = await finalize_context_engine_turn(engine=engine, ...)
    assert engine.methods() == ["ingest_batch"]
"""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, Literal

import anyio
import attrs

from codex_turn.harness.engine import contract
from codex_turn.harness.engine.contract import (
    AfterTurnParams,
    AssembleParams,
    AssembleResult,
    BootstrapParams,
    BootstrapResult,
    CompactParams,
    CompactResult,
    ContextEngineInfo,
    IngestBatchParams,
    IngestBatchResult,
    IngestParams,
    IngestResult,
    MaintainParams,
    MaintenanceResult,
)

__all__ = [
    "ALL_METHODS",
    "OPTIONAL_METHODS",
    "Call",
    "EngineMethod",
    "Failure",
    "RecordingEngine",
    "Response",
]

#: The name of a contract method.
EngineMethod = Literal[
    "bootstrap",
    "ingest",
    "ingest_batch",
    "after_turn",
    "assemble",
    "compact",
    "maintain",
    "dispose",
]

#: The methods an engine may lack (capabilities), and all methods of the contract.
OPTIONAL_METHODS: Final[frozenset[str]] = frozenset(contract.OPTIONAL_METHODS)
ALL_METHODS: Final[frozenset[str]] = OPTIONAL_METHODS | frozenset(contract.REQUIRED_METHODS)

#: A scripted answer: a value, or a callable ``(params) -> value | Awaitable[value]``.
Response = Any
#: A scripted failure: an exception raised on every call, or ``(params) -> exception | None``.
Failure = BaseException | Callable[[Any], BaseException | None]


@attrs.define
class Call:
    """One recorded call. ``result``, ``error``, ``ended_at`` are filled in when it ends."""

    seq: int
    method: str
    params: Any
    result: Any = None
    error: BaseException | None = None
    finished: bool = False
    #: ``time.monotonic()`` when the call started and when it ended.
    started_at: float = 0.0
    ended_at: float | None = None


def _snapshot(params: Any) -> Any:
    """The params as they were at call time: messages deep-copied, the rest shared."""
    if params is None or not attrs.has(type(params)):
        return params
    changes: dict[str, Any] = {}
    for name in ("messages", "message"):
        if hasattr(params, name):
            changes[name] = copy.deepcopy(getattr(params, name))
    if getattr(params, "runtime_context", None) is not None:
        changes["runtime_context"] = dict(params.runtime_context)
    return attrs.evolve(params, **changes)


class RecordingEngine:
    """See the module docstring. Every constructor argument is keyword-only.

    ``info`` overrides the info built from ``engine_id``, ``name``, ``version``,
    ``owns_compaction`` and ``turn_maintenance_mode``. Unknown method names in ``omit``,
    ``responses``, ``failures`` or ``delays`` raise :class:`ValueError`.
    """

    def __init__(
        self,
        *,
        engine_id: str = "recording",
        name: str = "Recording Engine",
        version: str | None = "0.0.0",
        owns_compaction: bool = False,
        turn_maintenance_mode: Literal["foreground", "background"] = "foreground",
        info: ContextEngineInfo | None = None,
        omit: Iterable[str] = (),
        responses: Mapping[str, Response] | None = None,
        failures: Mapping[str, Failure] | None = None,
        delays: Mapping[str, float] | None = None,
    ) -> None:
        omitted = frozenset(omit)
        named = omitted | set(responses or ()) | set(failures or ()) | set(delays or ())
        unknown = named - ALL_METHODS
        if unknown:
            raise ValueError(f"unknown engine methods: {sorted(unknown)}")
        self.info: ContextEngineInfo = info or ContextEngineInfo(
            id=engine_id,
            name=name,
            version=version,
            owns_compaction=owns_compaction,
            turn_maintenance_mode=turn_maintenance_mode,
        )
        self.omitted: frozenset[str] = omitted
        self.responses: dict[str, Response] = dict(responses or {})
        self.failures: dict[str, Failure] = dict(failures or {})
        self.delays: dict[str, float] = dict(delays or {})
        self.calls: list[Call] = []

    # Absent means absent: an omitted method raises AttributeError like a missing one.
    def __getattribute__(self, name: str) -> Any:
        if name in ALL_METHODS and name in object.__getattribute__(self, "omitted"):
            raise AttributeError(f"{type(self).__name__} has no {name!r} (omitted)")
        return object.__getattribute__(self, name)

    # --- Inspection -----------------------------------------------------------------------

    def methods(self) -> list[str]:
        """Method names in call order."""
        return [call.method for call in self.calls]

    def calls_to(self, method: str) -> list[Call]:
        """The calls to ``method``, in order."""
        return [call for call in self.calls if call.method == method]

    def only_call(self, method: str) -> Call:
        """The one call to ``method``; raises ``AssertionError`` for zero or several."""
        found = self.calls_to(method)
        if len(found) != 1:
            raise AssertionError(f"expected one {method} call, got {len(found)}: {self.methods()}")
        return found[0]

    def reset(self) -> None:
        """Forget the recorded calls (the script stays)."""
        self.calls.clear()

    # --- Machinery ------------------------------------------------------------------------

    async def _call(self, method: str, params: Any, default: Callable[[Any], Any]) -> Any:
        call = Call(
            seq=len(self.calls),
            method=method,
            params=_snapshot(params),
            started_at=time.monotonic(),
        )
        self.calls.append(call)
        try:
            if method in self.delays:
                await anyio.sleep(self.delays[method])
            failure = self.failures.get(method)
            if failure is not None:
                error = failure if isinstance(failure, BaseException) else failure(params)
                if error is not None:
                    raise error
            response = self.responses.get(method, default)
            if callable(response) and not isinstance(response, type):
                response = response(params)
                if inspect.isawaitable(response):
                    response = await response
            call.result = response
            return response
        except BaseException as err:
            call.error = err
            raise
        finally:
            call.finished = True
            call.ended_at = time.monotonic()

    # --- The contract ---------------------------------------------------------------------

    async def bootstrap(self, params: BootstrapParams) -> BootstrapResult:
        result: BootstrapResult = await self._call(
            "bootstrap", params, lambda _: BootstrapResult(bootstrapped=True, imported_messages=0)
        )
        return result

    async def ingest(self, params: IngestParams) -> IngestResult:
        result: IngestResult = await self._call(
            "ingest", params, lambda _: IngestResult(ingested=True)
        )
        return result

    async def ingest_batch(self, params: IngestBatchParams) -> IngestBatchResult:
        result: IngestBatchResult = await self._call(
            "ingest_batch", params, lambda p: IngestBatchResult(ingested_count=len(p.messages))
        )
        return result

    async def after_turn(self, params: AfterTurnParams) -> None:
        await self._call("after_turn", params, lambda _: None)

    async def assemble(self, params: AssembleParams) -> AssembleResult:
        result: AssembleResult = await self._call(
            "assemble",
            params,
            lambda p: AssembleResult(messages=list(p.messages), estimated_tokens=len(p.messages)),
        )
        return result

    async def compact(self, params: CompactParams) -> CompactResult:
        result: CompactResult = await self._call(
            "compact", params, lambda _: CompactResult(ok=True, compacted=False, reason="no-op")
        )
        return result

    async def maintain(self, params: MaintainParams) -> MaintenanceResult | None:
        result: MaintenanceResult | None = await self._call(
            "maintain",
            params,
            lambda _: MaintenanceResult(changed=False, bytes_freed=0, rewritten_entries=0),
        )
        return result

    async def dispose(self) -> None:
        await self._call("dispose", None, lambda _: None)
