"""Shared test configuration: Hypothesis profiles, the event loop of async tests, a turn's
session file, the log privacy guard, and the Codex end-to-end fixtures."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from structlog.testing import capture_logs
from support.turns import temporary_session_file

pytest_plugins = ["codex_fixtures", "scale_fixtures", "pytester"]

# CI=true activates Hypothesis' built-in "ci" profile (derandomized, no deadline, no database).
# Keep it, but explore more: the ordering proofs only mean something with enough examples.
settings.register_profile(
    "ci",
    settings.get_profile("ci"),
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


# --- the event loop of async tests ----------------------------------------------------------------
#
# An async test (``@pytest.mark.anyio``) runs on asyncio: most start a real process, or test code
# whose backend does not matter, and one backend suffices. A module whose subject is code that
# must work on every backend (the client, the lifecycle helpers, the engine contract...) marks
# itself ``pytest.mark.both_backends``: each of its async tests then runs on asyncio and on trio.

BOTH_BACKENDS = ("asyncio", "trio")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "both_backends: run each async test of the module on asyncio and on trio"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "anyio_backend" in metafunc.fixturenames and metafunc.definition.get_closest_marker(
        "both_backends"
    ):
        metafunc.parametrize("anyio_backend", BOTH_BACKENDS)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# --- a turn's session file ----------------------------------------------------------------------


@pytest.fixture
def session_file() -> Iterator[str]:
    """A transcript path in a fresh directory (the file itself does not exist yet); its read
    cache is dropped afterwards."""
    with temporary_session_file("codex-turn-session-") as path:
        yield path


# --- log privacy, for every test --------------------------------------------------------------
#
# Logs carry facts about turns, never their content. Every test runs under a structlog capture;
# at teardown no captured event may contain a text the test marked private (prompts, seeded
# transcript text: the ``private_texts`` fixture) or any message text of the real OpenClaw
# session fixtures. A test that captures logs itself (``capture_logs``) checks its own records.

_FIXTURE_SESSIONS = Path(__file__).parent / "fixtures" / "sessions"
_NEEDLE_CHARS = 48  # long enough to be distinctive, short enough to catch partial leaks
_MIN_PRIVATE_CHARS = 6  # shorter private texts ("one") occur inside ordinary log words


@functools.cache
def _fixture_needles() -> tuple[str, ...]:
    from codex_turn.harness.session import load_session_messages

    needles: set[str] = set()
    for path in sorted(_FIXTURE_SESSIONS.glob("*.jsonl")):
        for message in load_session_messages(path):
            content = message.get("content")
            parts = [content] if isinstance(content, str) else content or []
            for part in parts:
                text = (
                    part
                    if isinstance(part, str)
                    else part.get("text")
                    if isinstance(part, dict)
                    else None
                )
                if isinstance(text, str) and len(text.strip()) >= _NEEDLE_CHARS:
                    needles.add(text.strip()[:_NEEDLE_CHARS])
    return tuple(sorted(needles))


@pytest.fixture
def private_texts() -> set[str]:
    """Texts that must never appear in a log record of this test."""
    return set()


@pytest.fixture(autouse=True)
def _library_logging_restored() -> Iterator[None]:
    """A test that runs the CLI in-process configures the library's logger (a handler on the
    stream of that moment); the next test must not inherit it."""
    library = logging.getLogger("codex_turn")
    handlers, level = list(library.handlers), library.level
    yield
    library.handlers[:] = handlers
    library.setLevel(level)


@pytest.fixture(autouse=True)
def _log_privacy_guard(private_texts: set[str]) -> Iterator[None]:
    with capture_logs() as records:
        yield
    haystack = "\n".join(repr(record) for record in records)
    needles = [t for t in private_texts if len(t) >= _MIN_PRIVATE_CHARS] + list(_fixture_needles())
    leaks = [text for text in needles if text in haystack]
    assert not leaks, f"private text reached the logs: {leaks[:3]!r}"
