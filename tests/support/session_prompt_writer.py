"""Subprocess for the prompt-durability crash test: pre-mirrors a prompt, then "runs the turn".

Writes the user's prompt with :func:`mirror_prompt` (as the orchestrator does before
``turn/start``), prints ``prompted``, and then sleeps as if the model were answering, so the
parent can SIGKILL it mid-turn.
"""

from __future__ import annotations

import sys
import time

from codex_turn.harness.session import mirror_prompt


def main() -> None:
    path, thread_id, run_id, prompt = sys.argv[1:5]
    mirror_prompt(
        path,
        {"role": "user", "content": prompt, "timestamp": 1_774_000_000_000},
        scope=f"codex-app-server:{thread_id}",
        identity=f"{run_id}:prompt",
        session_id="session-a",
        cwd="/work",
    )
    print("prompted", flush=True)
    time.sleep(60)  # the model is thinking; the host dies here
    print("unreachable", flush=True)


if __name__ == "__main__":
    main()
