"""Reading a session transcript back in tests: the text of every message on its path."""

from __future__ import annotations

import os

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
