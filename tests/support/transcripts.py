"""Session transcripts in tests: the text of every message on its path, and real fixtures
with one hostile entry appended."""

from __future__ import annotations

import json
import os
from pathlib import Path

from codex_turn.harness.session import load_session_messages


def transcript_texts(session_file: str | os.PathLike[str]) -> list[str]:
    """Each message's text: a string content as is, text parts of a list content each."""
    texts: list[str] = []
    for message in load_session_messages(session_file):
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(p.get("text", "") for p in content if isinstance(p, dict))
    return texts


FIXTURES = Path(__file__).parent.parent / "fixtures" / "sessions"


def with_deep_entry(fixture: Path, path: Path, depth: int) -> Path:
    """``fixture`` (a real transcript) copied to ``path``, then one more entry of its own shape
    whose line nests ``depth`` levels: its last assistant message again, with a tool call
    whose arguments are nested objects (entry, message, content, part, arguments: 5 levels
    before them). The text is written directly: building the value would itself recurse."""
    lines = fixture.read_bytes().decode().splitlines()
    entries = [json.loads(line) for line in lines]
    assistant = next(
        e for e in reversed(entries) if (e.get("message") or {}).get("role") == "assistant"
    )
    call = {"type": "toolCall", "id": "call_deep", "name": "exec", "arguments": "DEEP"}
    entry = {
        **assistant,
        "id": "deep0001",
        "parentId": entries[-1]["id"],
        "message": {**assistant["message"], "content": [call]},
    }
    nested = depth - 5  # objects inside the arguments object
    arguments = '{"a":' * (nested + 1) + "1" + "}" * (nested + 1)
    line = json.dumps(entry, ensure_ascii=False).replace('"DEEP"', arguments)
    path.write_bytes("\n".join([*lines, line, ""]).encode())
    return path
