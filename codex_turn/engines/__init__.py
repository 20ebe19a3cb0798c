"""Context engines shipped with codex-turn.

:class:`SqliteContextEngine` is the reference engine and the embedded default: a lossless
store of every message in one SQLite file, an ordered context of raw messages and summaries
(a DAG over the messages, nothing deleted by compaction), idempotent ingestion from every
path the harness uses, deterministic assembly with a ``thread_bootstrap`` projection, and
compaction it owns while its store is healthy::

    from codex_turn.engines import SqliteContextEngine

    engine = SqliteContextEngine("sessions/context.sqlite")
    result = await run_codex_turn(params, app_server=server, engine=engine)

The pieces an engine author or host may configure are public here: :class:`EngineSettings`
(refused with :class:`InvalidEngineSettings` when a field is wrong),
the :class:`Summarizer` protocol with its request types and the deterministic
:class:`ExtractiveSummarizer` (or :class:`CodexSummarizer`, which asks Codex through the
app-server), the :data:`TokenEstimator` type with the default
:func:`estimate_tokens`, and the reports of :meth:`SqliteContextEngine.doctor` and
:meth:`SqliteContextEngine.prune`. Module layout (each file has its own theory header):

``sqlite.py``       the engine: lifecycle methods, locks, the compaction sweep
``_messages.py``    message identity (the idempotency key), text, tokens, tool links
``_plan.py``        pure decisions: assembly selection, tool-pair repair, compaction chunks
``_schema.py``      the SQLite file: schema, pooled connections, transactions
``_store.py``       one short transaction per unit of work
``_doctor.py``      checks and repairs; retention
``summarizers.py``  the summariser contract, escalation checks, the extractive default
``codex_summarizer.py``  :class:`CodexSummarizer`: summaries written by Codex
``settings.py``     :class:`EngineSettings`
"""

from __future__ import annotations

from codex_turn.engines._doctor import DoctorReport, RetentionReport
from codex_turn.engines._messages import TokenEstimator, estimate_tokens
from codex_turn.engines._schema import StoreError
from codex_turn.engines.codex_summarizer import CodexSummarizer, CodexSummaryFailed
from codex_turn.engines.settings import EngineSettings, InvalidEngineSettings
from codex_turn.engines.sqlite import ENGINE_ID, SqliteContextEngine
from codex_turn.engines.summarizers import (
    ExtractiveSummarizer,
    HostModelSummarizer,
    Summarizer,
    SummarizerAuthError,
    SummaryRequest,
    SummarySource,
)

__all__ = [
    "ENGINE_ID",
    "CodexSummarizer",
    "CodexSummaryFailed",
    "DoctorReport",
    "EngineSettings",
    "ExtractiveSummarizer",
    "HostModelSummarizer",
    "InvalidEngineSettings",
    "RetentionReport",
    "SqliteContextEngine",
    "StoreError",
    "Summarizer",
    "SummarizerAuthError",
    "SummaryRequest",
    "SummarySource",
    "TokenEstimator",
    "estimate_tokens",
]
