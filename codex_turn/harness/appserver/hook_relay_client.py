"""The command Codex runs for a native hook: hand the hook's input to the host, print its answer.

Run as a file, never imported by the package (``python -I THIS_FILE SOCKET TIMEOUT``): a
hook runs on every tool call, so it starts with the standard library alone. It reads the
hook's JSON from stdin (at most :data:`MAX_BYTES`), sends it as one line to the host's relay
(:mod:`codex_turn.harness.appserver.native_hooks`) on the Unix socket ``SOCKET``, waits at
most ``TIMEOUT`` seconds for one line back and prints it: Codex reads the hook's answer
from stdout. When the host cannot be reached or answers nothing usable, a PreToolUse is
blocked (fail closed: a tool must not run unchecked) and any other hook gives no decision.
It prints nothing else, and never the hook's input.
"""

from __future__ import annotations

import json
import socket
import sys

MAX_BYTES = 4 * 1024 * 1024
UNREACHABLE = "the host's hook relay did not answer"


def fallback(event: object) -> str:
    if event == "PreToolUse":
        return json.dumps(
            {
                "hookSpecificOutput": {
                    "hookEventName": "PreToolUse",
                    "permissionDecision": "deny",
                    "permissionDecisionReason": UNREACHABLE,
                }
            }
        )
    return "{}"


def relay(socket_path: str, timeout: float, payload: dict[str, object]) -> str:
    line = json.dumps(payload, separators=(",", ":")).encode("utf-8", "surrogatepass") + b"\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(socket_path)
        conn.sendall(line)
        conn.shutdown(socket.SHUT_WR)
        chunks: list[bytes] = []
        size = 0
        while chunk := conn.recv(65536):
            size += len(chunk)
            if size > MAX_BYTES:
                raise ValueError("answer too large")
            chunks.append(chunk)
    answer = json.loads(b"".join(chunks))
    if not isinstance(answer, dict):
        raise ValueError("not an object")
    return json.dumps(answer)


def main(argv: list[str]) -> int:
    event: object = None
    try:
        socket_path, timeout = argv[1], float(argv[2])
        data = sys.stdin.buffer.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            raise ValueError("input too large")
        payload = json.loads(data)
        if not isinstance(payload, dict):
            raise ValueError("not an object")
        event = payload.get("hook_event_name")
        out = relay(socket_path, timeout, payload)
    except Exception:  # any failure: the safe answer for this event, nothing else said
        out = fallback(event)
    sys.stdout.write(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
