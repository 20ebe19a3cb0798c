"""``codex-turn worker --db URL``: run queued turns until SIGTERM (or Ctrl-C), then drain.

One app-server per worker process (the user's Codex home, ``--codex-home``, or with
``--offline`` a private home per executor id next to the SQLite database and the local
stand-in model). The engine of a turn: ``--engine sqlite`` (the default) is the reference
engine whose store sits next to the turn's session, one per directory, kept open while the
worker runs; ``none`` runs plain Codex; ``module:attr`` one engine for every turn.

On SIGTERM or SIGINT the worker stops taking turns, lets the ones in flight finish (at most
``--drain-timeout`` seconds; a turn still running then is taken over by a live worker, or
recovered when a worker with the same ``--executor-id`` starts) and exits 0. A second signal
leaves at once. Each live worker needs its own ``--executor-id``; a worker that loses its
executor lock stops and exits 5.

With ``--offline`` and ``CODEX_TURN_WORKER_MODEL_LOG=FILE`` in its environment, the worker
appends every request its stand-in model receives to ``FILE`` as a JSON line (the executor id
and the fields of :class:`~codex_turn.testing.RecordedRequest`) as it arrives: a test's record
of what the model was asked, turn by turn, across workers and kills.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import IO, Any

import anyio

from codex_turn._cli_support import EXIT_CODEX, EXIT_OK, UsageError, close_engine, codex_config
from codex_turn.harness.turn_api import TurnParams
from codex_turn.scale._queue import InvalidQueueConfig, check_database_url, check_executor_id
from codex_turn.scale._worker import TurnWorker

__all__ = ["worker_command"]

MODEL_LOG_ENV = "CODEX_TURN_WORKER_MODEL_LOG"


class _Engines:
    """The engine of each turn, by the worker's ``--engine``."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self._by_store: dict[str, object | None] = {}
        self._single: object | None = None
        if spec not in ("sqlite", "none"):
            from codex_turn._cli_support import load_engine_spec

            self._single = load_engine_spec(spec)

    def __call__(self, params: TurnParams) -> object | None:
        if self.spec != "sqlite":
            return self._single
        from codex_turn.engines import SqliteContextEngine

        store = SqliteContextEngine.store_next_to(params.session_file)
        if store not in self._by_store:
            self._by_store[store] = SqliteContextEngine.next_to(params.session_file)
        return self._by_store[store]

    def close(self) -> None:
        for engine in [*self._by_store.values(), self._single]:
            close_engine(engine)


def _offline_anchor(database_url: str, executor_id: str) -> str:
    """``--offline`` keeps a private home per executor id next to the SQLite database (else
    in the cwd): each worker has a Codex home of its own, as workers on many machines do."""
    if database_url.startswith("sqlite:///"):
        base = os.path.dirname(os.path.abspath(database_url.removeprefix("sqlite:///")))
    else:
        base = os.getcwd()
    return os.path.join(base, f"codex-turn-worker-{executor_id}", "anchor")


def _record_requests(model: Any, path: str, executor_id: str) -> None:
    """Append each request ``model`` receives to ``path`` (a daemon thread, until exit)."""
    seen = 0
    with open(path, "a", encoding="utf-8") as log:
        while True:
            try:
                requests = model.wait_for_requests(seen + 1, timeout=3600)
            except TimeoutError:
                continue
            for request in requests[seen:]:
                fields = ("index", "method", "path", "headers", "body", "received_at")
                record = {name: getattr(request, name) for name in fields}
                log.write(json.dumps({"executor_id": executor_id, **record}, default=dict) + "\n")
            log.flush()
            seen = len(requests)


async def _serve(args: argparse.Namespace, err: IO[str]) -> int:
    from codex_turn.harness.appserver import AppServer

    engines = _Engines(args.engine or "sqlite")
    try:
        with codex_config(
            offline=args.offline,
            codex_home=args.codex_home,
            session_file=_offline_anchor(args.db, args.executor_id),
            model=args.model,
            offline_delay=args.offline_delay,
            codex_bin=args.codex_bin,
        ) as (config, model):
            if model is not None and os.environ.get(MODEL_LOG_ENV):
                threading.Thread(
                    target=_record_requests,
                    args=(model, os.environ[MODEL_LOG_ENV], args.executor_id),
                    daemon=True,
                ).start()
            async with AppServer.start(config) as server:
                worker = TurnWorker(
                    args.db,
                    app_server=server,
                    engine=engines,
                    executor_id=args.executor_id,
                    drain_timeout=args.drain_timeout,
                )
                await worker.__aenter__()
                try:
                    print(
                        f"codex-turn worker: executor {args.executor_id} on {args.db}",
                        file=err,
                        flush=True,
                    )
                    lost = await _until_signal_or_lock_lost(worker, err)
                    drained = await _drain_or_leave(worker)
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await worker.shutdown()
                    raise
                print(
                    "codex-turn worker: "
                    + ("drained" if drained else "left turns running (recovered on restart)"),
                    file=err,
                    flush=True,
                )
    finally:
        engines.close()
    # A worker whose executor lock was lost stops loudly: a peer may already be recovering
    # its turns, so a supervisor must not think it ended normally.
    return EXIT_CODEX if lost else EXIT_OK


async def _until_signal_or_lock_lost(worker: TurnWorker, err: IO[str]) -> bool:
    """Wait for SIGTERM/SIGINT (``False``) or the loss of the executor lock (``True``)."""
    lost = False
    async with anyio.create_task_group() as group:

        async def on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    print(
                        f"codex-turn worker: {signal.Signals(signum).name}, draining "
                        f"({worker.in_flight} in flight)",
                        file=err,
                        flush=True,
                    )
                    break
            group.cancel_scope.cancel()

        async def on_lock_lost() -> None:
            nonlocal lost
            # A threading.Event set by the sweeper thread: polling parks no worker thread.
            while not worker.lock_lost.is_set():  # noqa: ASYNC110
                await anyio.sleep(0.2)
            lost = True
            print(
                "codex-turn worker: the executor lock was lost; draining and stopping",
                file=err,
                flush=True,
            )
            group.cancel_scope.cancel()

        group.start_soon(on_signal)
        group.start_soon(on_lock_lost)
    return lost


async def _drain_or_leave(worker: TurnWorker) -> bool:
    """Drain; a second signal stops waiting for the turns in flight."""
    worker.stop_taking_turns()
    async with anyio.create_task_group() as group:

        async def wait_idle() -> None:
            await worker.wait_idle(worker.drain_timeout + 2.0)
            group.cancel_scope.cancel()

        async def second_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    group.cancel_scope.cancel()
                    return

        group.start_soon(second_signal)
        group.start_soon(wait_idle)
    return await worker.shutdown()


def worker_command(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    try:
        check_database_url(args.db)
        check_executor_id(args.executor_id)
    except InvalidQueueConfig as error:
        raise UsageError(str(error)) from error
    if args.offline and args.codex_home:
        raise UsageError("give --offline or --codex-home, not both")
    if args.offline_delay and not args.offline:
        raise UsageError("--offline-delay needs --offline")
    if args.offline:
        anchor = Path(_offline_anchor(args.db, args.executor_id)).parent
        anchor.mkdir(mode=0o700, parents=True, exist_ok=True)
    # DBOS runs its async workflows on asyncio's loop: the worker runs on asyncio.
    code: int = asyncio.run(_serve(args, err))
    sys.stdout.flush()
    return code
