"""Queue modes beside steer: ``followup`` and ``collect``, and runs that refuse steering (a
compaction, a review) making a message wait and run next. The table against a hand-written
oracle, a property over any arrival sequence on a running turn, and a compaction through the
real compaction runner (on the fake app-server) that a message arrives during.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.fake_appserver import FakeAppServer
from support.turns import turn_params

from codex_turn import CompactSessionParams, TurnOutcome, run_codex_turn
from codex_turn.fsm.steering import (
    MODE_FATES,
    RUN_FATES,
    RunKind,
    SteerMode,
    SteerStatus,
    run_fate,
)
from codex_turn.harness.compaction import compact_codex_session
from codex_turn.harness.turn.steering import (
    LiveTurn,
    SteerReceipt,
    refusing_steering,
    steer_codex_turn,
)


def fate_oracle(kind: str, mode: str) -> tuple[str, str] | None:
    """Hand-written from the runtime contract: only steer into a turn that takes it, and
    only collect into a turn whose result carries the collected messages back."""
    if mode in ("steer", "collect") and kind != "turn":
        return ("queued", "refuses_steering")
    if mode == "steer":
        return None
    return {
        "queue": ("queued", "queue"),
        "followup": ("queued", "followup"),
        "collect": ("collected", "collect"),
        "reject": ("rejected", "reject"),
    }[mode]


def test_every_run_and_mode_matches_the_oracle() -> None:
    assert set(RUN_FATES) == set(itertools.product(RunKind, SteerMode))
    for kind, mode in itertools.product(RunKind, SteerMode):
        fate = run_fate(kind, mode)
        told = None if fate is None else (fate.status.value, fate.reason)
        assert told == fate_oracle(kind.value, mode.value), (kind, mode)
    # A turn's fates are the mode table's.
    assert {mode: run_fate(RunKind.TURN, mode) for mode in SteerMode} == dict(MODE_FATES)


MODES_DECIDED_AT_ONCE = [m for m in SteerMode if m is not SteerMode.STEER]


@given(
    arrivals=st.lists(
        st.tuples(st.sampled_from(MODES_DECIDED_AT_ONCE), st.booleans()), max_size=12
    ),
)
def test_any_arrivals_are_decided_at_once_and_collected_in_order(
    arrivals: list[tuple[SteerMode, bool]],
) -> None:
    """Whatever arrives in which mode, before or after the result took the collected ones:
    nothing waits, ``collect`` keeps arrival order, and nothing is collected twice or late."""

    async def scenario() -> None:
        live = LiveTurn(mode=SteerMode.COLLECT)
        expected: list[str] = []
        taken: tuple[str, ...] | None = None
        for index, (mode, result_made) in enumerate(arrivals):
            if result_made and taken is None:
                taken = live.take_collected()
                assert taken == tuple(expected)
            text = f"message {index}"
            with anyio.fail_after(1):  # decided at once: never waits for a delivery
                receipt = await live.submit(text, mode)
            fate = MODE_FATES[mode]
            assert fate is not None
            if mode is SteerMode.COLLECT and taken is not None:
                assert receipt == SteerReceipt(status=SteerStatus.QUEUED, reason="turn_ended")
            else:
                assert (receipt.status, receipt.reason) == (fate.status, fate.reason)
                if mode is SteerMode.COLLECT:
                    expected.append(text)
        if taken is None:
            assert live.take_collected() == tuple(expected)
        assert live.take_collected() == ()  # taken once

    anyio.run(scenario)


@pytest.mark.anyio
async def test_a_refusing_run_makes_steer_wait_and_keeps_the_other_modes(tmp_path: Path) -> None:
    session = tmp_path / "s.jsonl"
    assert (await steer_codex_turn(session, "hi")).status is SteerStatus.NO_TURN
    with refusing_steering(session, RunKind.REVIEW):
        receipts = [await steer_codex_turn(session, "hi", mode=mode) for mode in SteerMode]
    assert [(r.status, r.reason) for r in receipts] == [
        (SteerStatus.QUEUED, "refuses_steering"),
        (SteerStatus.QUEUED, "queue"),
        (SteerStatus.REJECTED, "reject"),
        (SteerStatus.QUEUED, "followup"),
        # No turn result would carry a collected message back: it waits and runs next.
        (SteerStatus.QUEUED, "refuses_steering"),
    ]
    assert (await steer_codex_turn(session, "hi")).status is SteerStatus.NO_TURN


class _SteeredDuringCompaction(FakeAppServer):
    """Hands a message to the session while Codex compacts its thread."""

    def __init__(self, session_file: str) -> None:
        super().__init__()
        self.session_file = session_file
        self.receipts: list[SteerReceipt] = []

    async def compact_thread(self, thread_id: str, **kwargs: Any) -> Any:
        self.receipts.append(await steer_codex_turn(self.session_file, "meanwhile"))
        return await super().compact_thread(thread_id, **kwargs)


@pytest.mark.anyio
async def test_a_message_during_a_compaction_waits_for_it_and_runs_next(session_file: str) -> None:
    server = _SteeredDuringCompaction(session_file)
    first = await run_codex_turn(turn_params(session_file, "hello"), app_server=server)
    assert first.outcome is TurnOutcome.COMPLETED
    compaction = CompactSessionParams(
        session_id="s-1",
        session_key="agent:main:s-1",
        session_file=session_file,
        workspace_dir=os.path.dirname(session_file),
        current_token_count=1,
    )
    result = await compact_codex_session(compaction, app_server=server)
    assert result.ok
    assert server.receipts == [SteerReceipt(status=SteerStatus.QUEUED, reason="refuses_steering")]
    # The runner runs it next: the compaction released the session.
    nxt = await run_codex_turn(turn_params(session_file, "meanwhile"), app_server=server)
    assert nxt.outcome is TurnOutcome.COMPLETED
    assert (await steer_codex_turn(session_file, "later")).status is SteerStatus.NO_TURN
