"""Deterministic conversations for the SqliteContextEngine tests, and the subprocess workers.

Every message is a pi/OpenClaw message with a fixed timestamp and a marker ``[<session>:<n>]``
in its text, so a test can recognise each message in an assembly and count copies.

Run as a script, it is the worker of the multi-process and crash tests::

    python engine_sqlite_workload.py writer <store> <process> <sessions> <turns>
    python engine_sqlite_workload.py crasher <store> <kills> <seed>

``writer`` delivers ``<turns>`` turns of each of its sessions concurrently (half shared with
every other writer, half its own), each turn by ``after_turn`` with the whole history, then
prints ``ok``. ``crasher`` forks short-lived children that ingest and compact one store while
the parent SIGKILLs each after a random few milliseconds, ``<kills>`` times, then prints
how many kills landed.
"""

from __future__ import annotations

import mmap
import os
import random
import signal
import sys
import time
from typing import Any

import anyio

from codex_turn import configure_logging
from codex_turn.engines import EngineSettings, SqliteContextEngine
from codex_turn.harness.engine import AfterTurnParams, CompactParams

Message = dict[str, Any]

#: Small numbers so that a few dozen turns cross the thresholds.
SMALL = EngineSettings(
    fresh_tail_count=4,
    fresh_tail_max_fraction=0.3,
    leaf_chunk_tokens=300,
    min_leaf_chunk_tokens=40,
    leaf_target_tokens=60,
    condensed_target_tokens=60,
    leaf_fanout=3,
    condensed_fanout=2,
    busy_timeout_s=60.0,
)


def marker(session: str, n: int) -> str:
    return f"[{session}:{n}]"


def turn(session: str, index: int, *, tools: int = 0, words: int = 12) -> list[Message]:
    """One turn: a user prompt, ``tools`` tool calls each with its result, a reply."""
    base = 1_700_000_000_000 + index * 100
    filler = " ".join(f"w{(index * 7 + k) % 23}" for k in range(words))
    out: list[Message] = [
        {
            "role": "user",
            "content": f"{marker(session, index * 10)} question {filler}",
            "timestamp": base,
        }
    ]
    for k in range(tools):
        call = f"{session}-call-{index}-{k}"
        out.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": f"{marker(session, index * 10 + 1 + 2 * k)} run"},
                    {"type": "toolCall", "id": call, "name": "exec", "arguments": {"n": k}},
                ],
                "stopReason": "toolUse",
                "timestamp": base + 1 + 2 * k,
            }
        )
        out.append(
            {
                "role": "toolResult",
                "toolCallId": call,
                "toolName": "exec",
                "content": [
                    {"type": "text", "text": f"{marker(session, index * 10 + 2 + 2 * k)} ok"}
                ],
                "isError": False,
                "timestamp": base + 2 + 2 * k,
            }
        )
    out.append(
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": f"{marker(session, index * 10 + 9)} answer {filler}"}
            ],
            "stopReason": "stop",
            "timestamp": base + 9,
        }
    )
    return out


def history(session: str, turns: int, *, tools_every: int = 3) -> list[Message]:
    out: list[Message] = []
    for index in range(turns):
        out.extend(turn(session, index, tools=1 if tools_every and index % tools_every == 1 else 0))
    return out


def texts(messages: list[Message]) -> list[str]:
    """Each message's text (content string or text parts joined)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.append(
                "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and "text" in p)
            )
        else:
            out.append("")
    return out


# --- subprocess workers ---------------------------------------------------------------------


def writer_history(session: str, turns: int) -> list[Message]:
    """What a writer delivers for ``session`` (the expected store content)."""
    out: list[Message] = []
    for index in range(turns):
        out.extend(turn(session, index, tools=index % 2))
    return out


def writer_sessions(process: int, sessions: int) -> list[str]:
    shared = [f"shared-{i}" for i in range(sessions // 2)]
    return shared + [f"p{process}-{i}" for i in range(sessions - len(shared))]


async def _deliver(engine: SqliteContextEngine, session: str, turns: int) -> None:
    messages: list[Message] = []
    for index in range(turns):
        pre = len(messages)
        messages = messages + turn(session, index, tools=index % 2)
        await engine.after_turn(
            AfterTurnParams(
                session_id=session,
                session_file="",
                messages=messages,
                pre_prompt_message_count=pre,
                token_budget=100_000,
            )
        )


async def writer(store: str, process: int, sessions: int, turns: int) -> None:
    engine = SqliteContextEngine(store, settings=SMALL)
    async with anyio.create_task_group() as tg:
        for session in writer_sessions(process, sessions):
            tg.start_soon(_deliver, engine, session, turns)
    engine.close()


#: Where a crash child was when it died, in a byte shared with its parent (an anonymous
#: shared map created before the fork).
PHASES = ("outside writes", "ingest write", "compacting", "compaction write", "other write")
_OUTSIDE, _INGEST, _COMPACTING, _COMPACTION_WRITE, _OTHER_WRITE = range(len(PHASES))


def _track(phase: mmap.mmap, die_at: int | None, die_in: int) -> None:
    """In a crash child: report the phase of every SQL statement in ``phase``; with
    ``die_at``, SIGKILL this process at the ``die_at``-th statement run inside a write
    transaction of kind ``die_in`` (so the kill lands mid-transaction by construction)."""
    from codex_turn.engines import _compaction, _schema

    state = {"in_write": False, "sweeping": False, "statements": 0}

    def trace(sql: str) -> None:
        head = sql.lstrip()[:40].upper()
        if head.startswith("BEGIN IMMEDIATE"):
            state["in_write"] = True
            phase[0] = _OTHER_WRITE
            return
        if head.startswith(("COMMIT", "ROLLBACK")):
            state["in_write"] = False
            phase[0] = _COMPACTING if state["sweeping"] else _OUTSIDE
            return
        if not state["in_write"]:
            return
        upper = sql.upper()
        if "FROM MESSAGES WHERE" in upper or "INTO MESSAGES" in upper or "NEXT_SEQ," in upper:
            phase[0] = _INGEST
        elif "ORDINAL BETWEEN" in upper or "INTO SUMMAR" in upper:
            phase[0] = _COMPACTION_WRITE
        if phase[0] != die_in:
            return
        state["statements"] += 1
        if die_at is not None and state["statements"] >= die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    connect = _schema.Pool._connect

    def traced(self: _schema.Pool) -> Any:
        conn = connect(self)
        conn.set_trace_callback(trace)
        return conn

    _schema.Pool._connect = traced  # type: ignore[method-assign]
    sweep = _compaction.Compactor.sweep

    async def tracked_sweep(*args: Any, **kwargs: Any) -> Any:
        state["sweeping"] = True
        phase[0] = _COMPACTING
        try:
            return await sweep(*args, **kwargs)
        finally:
            state["sweeping"] = False
            phase[0] = _OUTSIDE

    _compaction.Compactor.sweep = tracked_sweep  # type: ignore[method-assign]


CRASH_SESSIONS = 12
CRASH_TURNS = 39  # the longest history a crash child delivers


async def crash_child(store: str, seed: int, compact_every: bool) -> None:
    """Ingest and compact until killed: whole histories of random sessions, retried from
    random cut points (so most deliveries repeat what is stored), compactions between."""
    rng = random.Random(seed)
    engine = SqliteContextEngine(store, settings=SMALL)
    while True:
        session = f"crash-{rng.randrange(CRASH_SESSIONS)}"
        full = history(session, rng.randrange(1, CRASH_TURNS + 1))
        cut = rng.randrange(len(full) + 1)
        await engine.after_turn(
            AfterTurnParams(
                session_id=session,
                session_file="",
                messages=full,
                pre_prompt_message_count=cut,
                token_budget=2_000,
            )
        )
        if compact_every or rng.random() < 0.5:
            budget = rng.choice((300, 600, 1_000, 2_000))
            await engine.compact(
                CompactParams(session_id=session, session_file="", token_budget=budget, force=True)
            )


def crasher(store: str, kills: int, seed: int) -> tuple[int, int, list[int]]:
    """``kills`` short-lived writers, each SIGKILLed: every other one by itself at a random
    statement inside an ingestion or a compaction write transaction, the others by this
    process after a random 2-40 ms.
    Returns ``(landed, failed, per phase)``: kills that hit a running child, children that
    exited on their own (an error: a child only ever stops by being killed), and where the
    kills landed."""
    rng = random.Random(seed)
    landed = failed = 0
    where = [0] * len(PHASES)
    phase = mmap.mmap(-1, 1)
    for attempt in range(kills):
        phase[0] = _OUTSIDE
        # Even attempts die by themselves, alternately inside an ingestion write and inside a
        # compaction write; odd ones are killed from here at a random time.
        die_in = _INGEST if attempt % 4 == 0 else _COMPACTION_WRITE
        die_at = rng.randrange(1, 60 if die_in == _INGEST else 20) if attempt % 2 == 0 else None
        delay = rng.uniform(0.002, 0.04) if die_at is None else 0.3
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 3
            try:
                _track(phase, die_at, die_in)
                eager = die_at is not None and die_in == _COMPACTION_WRITE
                anyio.run(crash_child, store, seed * 100_000 + attempt, eager)
            except BaseException as error:  # reported through the exit code
                print(f"child failed: {type(error).__name__}: {error}", file=sys.stderr)
            finally:
                os._exit(code)
        deadline = time.monotonic() + delay
        status: int | None = None
        while status is None and time.monotonic() < deadline:
            done, result = os.waitpid(pid, os.WNOHANG)
            if done:
                status = result
            else:
                time.sleep(0.001)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            landed += 1
            where[phase[0]] += 1
        else:
            failed += 1
    return landed, failed, where


if __name__ == "__main__":
    # stdout carries the result; logs (warnings and up) go to stderr.
    configure_logging("WARNING", "console", stream=sys.stderr)
    command, store = sys.argv[1], sys.argv[2]
    if command == "writer":
        anyio.run(writer, store, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        print("ok")
    elif command == "crasher":
        landed, failed, where = crasher(store, int(sys.argv[3]), int(sys.argv[4]))
        print(landed, failed, *where)
    else:
        raise SystemExit(f"unknown command {command!r}")
