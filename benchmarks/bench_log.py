"""Cost of a log call: filtered out, and emitted.

    python benchmarks/bench_log.py [--events 20000]

A turn logs ~28 events (83 lines for 3 turns). Every emitted event is scrubbed
(about ten secret patterns and an assignment scan per string field); a filtered-out event must
cost (almost) nothing: the level check comes before the event is built or scrubbed.

Before/after, measured interleaved in one process (the logger and redactor of the
previous commit against these), best of 7, on a 2-core machine under heavy load (absolute
figures vary 2-3x from run to run; the ratios hold), the ``turn finished`` event below with its
five bound fields, microseconds per call:

=====================================  ===========  ==========
case                                   before       after
=====================================  ===========  ==========
filtered out (DEBUG, level INFO)       19 - 78      0.7
unconfigured library, DEBUG event      52 - 172     0.7
                                       (on stdout)  (quiet)
emitted as a JSON line                 32 - 40      27 - 32
bind of five fields                    30 - 52      2.3
=====================================  ===========  ==========

Before, every call scrubbed its fields (about ten regex scans per string) and bind scrubbed
its fields eagerly; the level filter ran afterwards. After, the level check runs first, bound
fields are scrubbed once at the first emitted event, and the redactor skips a string holding
none of its trigger words after a few substring checks.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from codex_turn._log import configure_logging, get_logger, mask_session_key

CONTEXT: dict[str, Any] = {
    "session_id": "s-1",
    "session_key": mask_session_key("agent:main:telegram:default:direct:12345"),
    "engine": "lossless-claw",
    "thread_id": "thr_0193a6c2c7e47d2b9b1f6b7c",
    "turn_id": "turn_0193a6c2c7e47d2b9b1f6b7d",
}
FIELDS: dict[str, Any] = {
    "state": "done",
    "outcome": "completed",
    "skip_reason": None,
    "native_compactions": 0,
    "duration_ms": 812.4,
    "durations_ms": {
        "reading_history": 1.02,
        "bootstrapping": 0.41,
        "assembling": 2.73,
        "projecting": 0.88,
        "running_turn": 790.1,
        "mirroring": 3.2,
        "finalizing": 1.9,
        "maintaining": 11.5,
    },
}


def per_event_us(call: Callable[[], None], events: int, rounds: int = 5) -> float:
    """Best-of-``rounds`` mean cost of one ``call``, in microseconds."""
    call()  # warm caches (is_secret_key, compiled patterns, logger lookups)
    samples = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(events):
            call()
        samples.append((time.perf_counter_ns() - start) / events / 1000)
    return min(samples)


def bench(events: int) -> dict[str, float]:
    library = logging.getLogger("codex_turn")
    log = get_logger("codex_turn.harness.turn.orchestrator").bind(**CONTEXT)

    def debug() -> None:
        log.debug("codex turn finished", **FIELDS)

    def info() -> None:
        log.info("codex turn finished", **FIELDS)

    figures = {"filtered out, unconfigured library (quiet)": per_event_us(debug, events)}
    with open(os.devnull, "w", encoding="utf-8") as sink:
        configure_logging("INFO", "json", stream=sink)
        figures["filtered out (DEBUG at level INFO)"] = per_event_us(debug, events)
        figures["emitted as a JSON line"] = per_event_us(info, events // 10)
        configure_logging("INFO", "console", stream=sink)
        figures["emitted as a console line"] = per_event_us(info, events // 10)
        for handler in list(library.handlers):
            if not isinstance(handler, logging.NullHandler):
                library.removeHandler(handler)
        library.setLevel(logging.NOTSET)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    args = parser.parse_args()
    figures = bench(args.events)
    width = max(map(len, figures))
    for name, cost in figures.items():
        print(f"{name:<{width}}  {cost:8.2f} us/event")
    emitted = statistics.mean(
        cost for name, cost in figures.items() if name.startswith("emitted as a JSON")
    )
    print(f"a turn of ~28 events, all filtered out: {28 * figures[next(iter(figures))]:.1f} us")
    print(f"a turn of ~28 events, all emitted as JSON: {28 * emitted / 1000:.2f} ms")


if __name__ == "__main__":
    main()
