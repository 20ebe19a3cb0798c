"""Test kit for context-engine and runner authors: no network, no model, real contracts.

Everything here is public and meant for code that tests an engine or a runner (a host):

* :class:`OfflineModel` (:mod:`.offline_model`): a local, scriptable Responses-API server on
  ``127.0.0.1`` that the *real* ``codex app-server`` talks to instead of OpenAI (point
  ``AppServerConfig.offline(home, model.base_url)`` at it). It records every request Codex
  sends (:class:`RecordedRequest`), answers each from a FIFO script of :class:`Reply` values
  (echo by default), and traps any attempt to reach the internet through the proxy variables
  (:meth:`OfflineModel.proxy_env`, :attr:`OfflineModel.proxy_attempts`). It also serves the
  Images API that Codex's ``image_gen.imagegen`` tool calls (:class:`ImageReply`,
  :meth:`OfflineModel.script_images`), so a turn can produce a generated image offline.
* :class:`RecordingEngine` (:mod:`.recording_engine`): an engine that records every call
  (:class:`Call`), answers as scripted, omits methods and fails or stalls on demand: for
  testing what a host calls and how it copes.
* The engine conformance suite (:mod:`.conformance`): :func:`check_engine_conformance` runs
  :data:`CONFORMANCE_CHECKS` against engines made by your factory and returns a
  :class:`ConformanceReport`; each :class:`ConformanceCheck` also runs alone (one pytest test
  per check). What applies is decided by declared :data:`Storage` and the engine's own info,
  and stated in every :class:`CheckResult`.
* :func:`run_strict_turn` (:mod:`.strict`): a real turn with ``TurnParams.strict`` on.

The kit is *strict*: the conformance host checks an engine as every turn does before it
starts and fails a check at the engine's first contract violation, and
:func:`run_strict_turn` raises it (:class:`~codex_turn.harness.engine.EngineContractViolation`)
once the turn ended; nothing an engine gets wrong is left to a warning in a log.

Nothing in the product imports this package; it has no dependencies beyond the library's.

Usage sketch::

    with running_model() as model:
        model.script(Reply.fixed("hello"))
        async with AppServer.start(AppServerConfig.offline(home, model.base_url,
                                                           env=model.proxy_env())) as server:
            ...
        assert model.turn_requests()[-1].last_user_text == "hi"
        assert model.proxy_attempts == []

    report = await check_engine_conformance(MyEngine, workdir=tmp_path, storage="durable")
    report.assert_conforms()
"""

from __future__ import annotations

from .conformance import (
    CONFORMANCE_CHECKS,
    DURABLE_TURN_CHECKS,
    CheckResult,
    CheckStatus,
    ConformanceCheck,
    ConformanceFailure,
    ConformanceReport,
    EngineFactory,
    Storage,
    check_engine_conformance,
)
from .offline_model import (
    OFFLINE_PNG,
    ImageReply,
    OfflineModel,
    RecordedRequest,
    Reply,
    ReplyKind,
    running_model,
)
from .recording_engine import Call, RecordingEngine
from .strict import run_strict_turn

__all__ = [
    "CONFORMANCE_CHECKS",
    "DURABLE_TURN_CHECKS",
    "OFFLINE_PNG",
    "Call",
    "CheckResult",
    "CheckStatus",
    "ConformanceCheck",
    "ConformanceFailure",
    "ConformanceReport",
    "EngineFactory",
    "ImageReply",
    "OfflineModel",
    "RecordedRequest",
    "RecordingEngine",
    "Reply",
    "ReplyKind",
    "Storage",
    "check_engine_conformance",
    "run_strict_turn",
    "running_model",
]
