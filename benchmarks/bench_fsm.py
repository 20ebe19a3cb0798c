"""Cost of the turn machine: per trigger, per turn, and memory retained.

    python benchmarks/bench_fsm.py [--turns 100000]

Targets: <= 10 us per trigger, <= 150 us per turn (attach, full legal path,
detach), and no memory growth over 100k turns.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc

from codex_turn.fsm import TurnFacts, TurnModel, TurnTrigger
from codex_turn.fsm.turn import TURN_MACHINE

FACTS = TurnFacts(engine_active=True, had_session_file=True, engine_maintains=True)
PATH = (
    TurnTrigger.STARTED,
    TurnTrigger.HISTORY_READ,
    TurnTrigger.BOOTSTRAPPED,
    TurnTrigger.ASSEMBLED,
    TurnTrigger.PROJECTED,
    TurnTrigger.PROMPT_BUILT,
    TurnTrigger.THREAD_RESUMED,
    TurnTrigger.TURN_COMPLETED,
    TurnTrigger.MIRRORED,
    TurnTrigger.FINALIZED,
    TurnTrigger.MAINTENANCE_RAN,
)


def one_turn() -> None:
    turn = TurnModel.begin(FACTS)
    for trigger in PATH:
        turn.fire(trigger)


def bench_turns(turns: int) -> list[float]:
    samples = []
    batch = 1000
    for _ in range(turns // batch):
        start = time.perf_counter_ns()
        for _ in range(batch):
            one_turn()
        samples.append((time.perf_counter_ns() - start) / batch / 1000)
    return samples


def bench_triggers(count: int) -> float:
    # Internal transitions isolate the cost of one fire() from attach/detach.
    from codex_turn.fsm import TurnState

    turn = TurnModel.begin(FACTS, state=TurnState.RUNNING_TURN)
    start = time.perf_counter_ns()
    for _ in range(count // 2):
        turn.fire(TurnTrigger.NATIVE_COMPACTION_STARTED)
        turn.fire(TurnTrigger.NATIVE_COMPACTION_COMPLETED)
    elapsed = (time.perf_counter_ns() - start) / count / 1000
    turn.close()
    return elapsed


def bench_memory(turns: int) -> tuple[int, int, int]:
    gc.collect()
    tracemalloc.start()
    for _ in range(1000):  # warm caches so they are not counted as growth
        one_turn()
    gc.collect()
    base, _ = tracemalloc.get_traced_memory()
    for _ in range(turns):
        one_turn()
    gc.collect()
    after, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return base, after, peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=100_000)
    args = parser.parse_args()

    bench_turns(5000)  # warm-up
    per_trigger = bench_triggers(200_000)
    samples = bench_turns(args.turns)
    per_turn = statistics.median(samples)
    base, after, peak = bench_memory(args.turns)

    print(f"turns: {args.turns}, triggers per turn: {len(PATH)}")
    print(f"per trigger (fire, internal transition): {per_trigger:.2f} us  (target <= 10)")
    print(
        f"per turn (attach + {len(PATH)} triggers + detach): median {per_turn:.1f} us, "
        f"p95 {sorted(samples)[int(len(samples) * 0.95)]:.1f} us  (target <= 150)"
    )
    print(f"per trigger within a full turn: {per_turn / len(PATH):.2f} us")
    print(
        f"memory after {args.turns} turns: retained {after - base:+d} B "
        f"({(after - base) / args.turns:.3f} B/turn), peak {peak - base} B above base; "
        f"live models {len(TURN_MACHINE.live)}"
    )


if __name__ == "__main__":
    main()
