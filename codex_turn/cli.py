"""The ``codex-turn`` command: ``diagrams`` and ``demo`` (later also ``compact``)."""

from __future__ import annotations

import argparse
import sys

from codex_turn.fsm import TurnFacts, TurnModel, TurnTrigger
from codex_turn.fsm.diagrams import DEFAULT_DIR, write_diagrams
from codex_turn.fsm.diagrams import main as diagrams_main

__all__ = ["main"]

# One representative turn: an engine that bootstraps, assembles and maintains, and a Codex
# turn during which Codex compacted natively once.
_SIMULATED_TURN = (
    TurnTrigger.STARTED,
    TurnTrigger.HISTORY_READ,
    TurnTrigger.BOOTSTRAPPED,
    TurnTrigger.ASSEMBLED,
    TurnTrigger.PROJECTED,
    TurnTrigger.PROMPT_BUILT,
    TurnTrigger.THREAD_STARTED,
    TurnTrigger.NATIVE_COMPACTION_STARTED,
    TurnTrigger.NATIVE_COMPACTION_COMPLETED,
    TurnTrigger.TURN_COMPLETED,
    TurnTrigger.MIRRORED,
    TurnTrigger.FINALIZED,
    TurnTrigger.MAINTENANCE_RAN,
)


def _simulate() -> int:
    turn = TurnModel.begin(
        TurnFacts(engine_active=True, had_session_file=True, engine_maintains=True)
    )
    for trigger in _SIMULATED_TURN:
        turn.fire(trigger)
    start = turn.trace[0].monotonic_ns
    print("simulated turn (FSM only, no Codex):")
    for entry in turn.trace:
        elapsed_us = (entry.monotonic_ns - start) / 1000
        print(f"  {elapsed_us:9.1f} us  {entry.state:<16} --{entry.trigger}--> {entry.dest}")
    reason = turn.skip_reason.value if turn.skip_reason else "none (maintenance ran)"
    outcome = turn.outcome.value if turn.outcome else None
    print(f"outcome={outcome} skip_reason={reason} native_compactions={turn.native_compactions}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["diagrams"]:  # one implementation: the diagrams module's own command
        return diagrams_main(argv[1:])
    parser = argparse.ArgumentParser(prog="codex-turn")
    commands = parser.add_subparsers(dest="command", required=True)
    diagrams = commands.add_parser(
        "diagrams", help="render the state diagrams from the tables", add_help=False
    )
    diagrams.add_argument("args", nargs=argparse.REMAINDER)
    commands.add_parser("demo", help="render the diagrams and run the offline demo")
    parser.parse_args(argv)

    for path in write_diagrams(DEFAULT_DIR):
        print(f"wrote {path}")
    return _simulate()


if __name__ == "__main__":
    sys.exit(main())
