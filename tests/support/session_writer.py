"""Subprocess writer for the crash and concurrency tests: mirrors turns [start, end).

Prints ``ready`` once imported, optionally waits for a go-file (so several writers start
together), then prints ``done <turn>`` after each ``mirror_turn`` call has returned.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from session_turns import turn_messages

from codex_turn.harness.session import mirror_turn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--thread", required=True)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--end", type=int, required=True)
    parser.add_argument("--max-size", type=int, default=64)
    parser.add_argument("--go-file")
    args = parser.parse_args()
    print("ready", flush=True)
    if args.go_file:
        while not os.path.exists(args.go_file):
            time.sleep(0.001)
    for turn in range(args.start, args.end):
        messages, identities = turn_messages(args.thread, turn, max_size=args.max_size)
        mirror_turn(
            args.path,
            messages,
            scope=f"codex-app-server:{args.thread}",
            identities=identities,
            session_id="11111111-2222-4333-8444-555555555555",
            cwd="/work",
            lock_timeout=30.0,
        )
        print(f"done {turn}", flush=True)


if __name__ == "__main__":
    main()
