"""The fleet under fire: 3 ``codex-turn worker`` processes, 20 sessions x 5 turns on
the real Codex binary and the offline model, workers SIGKILLed at random moments (at least 10
kills, each while turns were running, whatever stage each turn is in; every other kill hits a
worker that runs a turn, and a restarted worker is up before it is killed again) and the whole
fleet killed and restarted once mid-run. The work is topped up (one more turn per session)
while kills are still due, so a faster machine or library cannot finish the turns before the
kills: how many kills land must not depend on how fast a turn is.

What must hold afterwards: every turn completed exactly once; each transcript holds each
prompt once and each reply once, in submission order, with no repeated idempotency key; no
two turns of one session overlapped (from the recorded spans of the attempts that ran); the
reference engine's store holds every prompt of every session once, in order, and no message
twice, right after the run: a turn whose worker died between the mirror and the engine's
finalize is finalized by its recovery (``codex_turn.scale._catch_up``), not left to the
session's next bootstrap (which a session's last turn never gets, and an engine without
``bootstrap`` never does: ``tests/test_scale_recovery_engine.py``). A bootstrap afterwards
then finds nothing to import.

Every request the workers' stand-in models received is recorded as it arrives
(``model-requests.jsonl``, :func:`model_requests`): what the model was asked for each turn,
on whichever worker it ran, before and after each move.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from test_engine_sqlite_processes import stored
from test_scale import _log_size, _messages, _params, _start_worker, _texts, _wait_log

from codex_turn.engines import SqliteContextEngine
from codex_turn.harness.lifecycle import call_bootstrap
from codex_turn.scale import QueuedTurn, TurnQueue, TurnRecord
from codex_turn.scale._cli import MODEL_LOG_ENV
from codex_turn.testing import RecordedRequest

pytestmark = pytest.mark.codex

SESSIONS, TURNS = 20, 5  # turns per session submitted up front
MAX_TURNS = 15  # the top-up's ceiling, per session
MIN_KILLS = 10


def model_requests(path: Path) -> list[tuple[str, RecordedRequest]]:
    """Every request the workers' stand-in models received, in arrival order per worker: the
    executor id and the request (its ``last_user_text`` names the turn's prompt)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(record.pop("executor_id"), RecordedRequest(**record)) for record in records]


def _text(message: dict[str, Any]) -> str:
    content = message["content"]
    parts = [content] if isinstance(content, str) else content
    return "".join(p if isinstance(p, str) else p.get("text", "") for p in parts)


class Fleet:
    """Three workers by executor id; a killed one is restarted under the same id."""

    def __init__(self, tmp_path: Path, db_url: str) -> None:
        self.tmp_path, self.db_url = tmp_path, db_url
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.starts: dict[str, int] = {}  # each worker's log size at its latest start
        self.kills = 0
        self.kills_mid_work = 0  # kills that landed while some turn was running

    def start(self, executor_id: str) -> None:
        """Start (or restart) a worker; :meth:`kill` waits for it to be up first."""
        log = self.tmp_path / f"{executor_id}.log"
        self.starts[executor_id] = _log_size(log)  # where this start's own lines begin
        self.procs[executor_id] = _start_worker(
            self.db_url,
            log,
            "--executor-id",
            executor_id,
            "--offline-delay",
            "0.4",  # each reply takes a while: kills land inside turns
            cwd=self.tmp_path,
            env={MODEL_LOG_ENV: str(self.tmp_path / "model-requests.jsonl")},
        )

    def wait_up(self, executor_id: str) -> None:
        log = self.tmp_path / f"{executor_id}.log"
        since = self.starts[executor_id]  # its own start line, not its predecessor's
        _wait_log(log, f"executor {executor_id}", timeout=60, since=since)

    def kill(self, executor_id: str, *, turns_running: bool) -> None:
        self.wait_up(executor_id)  # a kill hits a worker that started (and took its lock)
        proc = self.procs[executor_id]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)  # reaped: a zombie's pid would still hold the session lease
        self.kills += 1
        self.kills_mid_work += turns_running

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def test_random_kills_and_a_fleet_restart_lose_and_repeat_nothing(
    tmp_path: Path, db_url: str
) -> None:
    rng = random.Random(20261201)
    fleet = Fleet(tmp_path, db_url)
    ids = [f"w{i}" for i in range(3)]
    with TurnQueue(db_url) as queue:
        try:
            for executor_id in ids:
                fleet.start(executor_id)
            for executor_id in ids:
                fleet.wait_up(executor_id)
            submitted = dict.fromkeys(range(SESSIONS), 0)
            handles: list[QueuedTurn] = []

            def submit_round() -> None:  # one more turn for every session, in order
                for s in range(SESSIONS):
                    submitted[s] += 1
                    n = submitted[s]
                    handles.append(
                        queue.submit(
                            _params(tmp_path, f"s{s}", f"s{s} turn {n}"), turn_id=f"s{s}-{n}"
                        )
                    )

            for _ in range(TURNS):
                submit_round()

            def states() -> list[str]:
                return [h.status().state for h in handles]

            fleet_restarted = False
            while fleet.kills < MIN_KILLS + 3:
                pending = states()
                if pending.count("enqueued") < SESSIONS and submitted[0] < MAX_TURNS:
                    submit_round()  # the kills are not done: keep the workers busy
                time.sleep(rng.uniform(0.3, 1.0))
                now = [h.status() for h in handles]
                running = any(status.state == "running" for status in now)
                # Every other kill hits a worker that runs a turn: its sessions move mid-turn
                # (a kill at each step of a takeover: tests/test_scale_takeover.py).
                busy = sorted({s.executor_id for s in now if s.state == "running"} & set(ids))
                if fleet.kills >= 5 and not fleet_restarted:
                    for executor_id in ids:  # the whole fleet at once
                        fleet.kill(executor_id, turns_running=running)
                    for executor_id in ids:
                        fleet.start(executor_id)
                    fleet_restarted = True
                    continue
                victim = rng.choice(busy) if busy and fleet.kills % 2 else rng.choice(ids)
                fleet.kill(victim, turns_running=running)
                time.sleep(rng.uniform(0.0, 0.5))
                fleet.start(victim)
            assert fleet.kills_mid_work >= MIN_KILLS, (
                "too few kills landed while turns ran",
                fleet.kills_mid_work,
                submitted,
            )
            assert fleet_restarted
            records: dict[str, TurnRecord] = {h.turn_id: h.result(timeout=600) for h in handles}
        finally:
            fleet.stop()

    assert {r.outcome for r in records.values()} == {"completed"}
    # The request's last user text is the prompt, or ends with it (a fresh thread's frame
    # of the conversation so far, then "Current user request:").
    requests = model_requests(tmp_path / "model-requests.jsonl")
    asked = {request.last_user_text.rsplit("\n", 1)[-1] for _, request in requests}
    store = Path(SqliteContextEngine.store_next_to(tmp_path / "s0.jsonl"))
    for s in range(SESSIONS):
        session = tmp_path / f"s{s}.jsonl"
        turns = submitted[s]
        prompts = [f"s{s} turn {n}" for n in range(1, turns + 1)]
        assert _texts(session, "user") == prompts  # each once, in submission order
        replies = _texts(session, "assistant")
        assert len(replies) == turns, replies
        assert all(reply.endswith(p) for reply, p in zip(replies, prompts, strict=True))
        assert set(prompts) <= asked  # each turn's prompt reached a model
        # Wherever a turn ran (moved, recovered, on a fresh Codex home), the request that
        # answered it carried the session's previous turn: the conversation moved with it.
        for previous, prompt in itertools.pairwise(prompts):
            answering = [
                request
                for _, request in requests
                if request.last_user_text.rsplit("\n", 1)[-1] == prompt
            ]
            sent = "\n".join([*answering[-1].user_messages, *answering[-1].assistant_messages])
            assert re.search(rf"{re.escape(previous)}(?!\d)", sent), (prompt, previous)
        keys = [m.get("idempotencyKey") for m in _messages(session)]
        assert len(keys) == len(set(keys))
        ran = [records[f"s{s}-{n}"] for n in range(1, turns + 1)]
        spans = [r for r in ran if r.source == "ran"]
        for earlier, later in itertools.pairwise(spans):
            assert earlier.ended_at <= later.started_at  # never two turns of a session at once
        # Right after the run, with no bootstrap since: the engine's store holds every turn,
        # once, in order (a retried finalize adds nothing; a turn recovered after its mirror
        # was finalized by the recovery).
        kept = stored(store, f"agent:main:s{s}")
        assert len(kept) == len({repr(m) for m in kept})
        assert [_text(m) for m in kept if m.get("role") == "user"] == prompts
        assert [_text(m) for m in kept if m.get("role") == "assistant"] == replies
    # What a bootstrap would reconcile now: nothing is missing.
    engine = SqliteContextEngine(str(store))
    try:
        for s in range(SESSIONS):
            outcome = anyio.run(
                functools.partial(
                    call_bootstrap,
                    engine=engine,
                    session_id=f"s{s}",
                    session_key=f"agent:main:s{s}",
                    session_file=str(tmp_path / f"s{s}.jsonl"),
                )
            )
            assert outcome.status == "bootstrapped", outcome
            assert outcome.result is not None
            assert outcome.result.imported_messages == 0, (s, outcome)
    finally:
        engine.close()
