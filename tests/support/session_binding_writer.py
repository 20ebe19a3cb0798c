"""Subprocess for the binding crash test: writes a binding and stops between fsync and rename.

``os.replace`` is swapped for a function that reports ``renaming`` and then sleeps, so the
parent can SIGKILL this process at exactly the moment the temp file is complete but not yet
in place.
"""

from __future__ import annotations

import os
import sys
import time

from codex_turn.harness import binding


def _stall(src: str, dst: str) -> None:
    print(f"renaming {src}", flush=True)
    time.sleep(60)


def main() -> None:
    session_file = sys.argv[1]
    # Stall the rename under the writer: the binding's atomic write calls os.replace.
    vars(os)["replace"] = _stall
    binding.write_binding(
        session_file,
        binding.ThreadBinding(thread_id="thread-new", cwd="/new", model="gpt-new"),
    )
    print("unreachable", flush=True)
    os._exit(3)


if __name__ == "__main__":
    main()
