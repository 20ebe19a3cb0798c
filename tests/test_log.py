"""The logging helpers keep secrets, prompts and session keys out of log records."""

from __future__ import annotations

import ast
import io
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from structlog.testing import LogCapture, capture_logs

from codex_turn import _log
from codex_turn._log import (
    configure_logging,
    format_error,
    get_logger,
    mask_session_key,
    redact_text,
    sensitive,
)
from codex_turn._secrets import is_secret_key


def test_format_error_redacts_bearer_tokens_and_keys_and_names_the_type() -> None:
    error = RuntimeError("Authorization: Bearer sk-abcdefghijklmnopqrstuv failed")
    text = format_error(error)
    assert text.startswith("RuntimeError: ")
    assert "sk-abcdefghijklmnopqrstuv" not in text
    assert "abcdefghijklmnopqrstuv" not in text


def test_format_error_is_one_bounded_line() -> None:
    text = format_error(ValueError("x" * 5000 + "\nsecond line"))
    assert "\n" not in text
    assert text.startswith("ValueError: xxx")
    assert len(text.removeprefix("ValueError: ")) == 200
    assert text.endswith("…")


def test_assignments_of_secret_looking_names_are_masked() -> None:
    for line, expected in (
        ("OPENAI_API_KEY=abc123def", "OPENAI_API_KEY=[redacted]"),
        ("password: hunter2hunter2", "password: [redacted]"),
        ("token='zzz999'", "token='[redacted]'"),  # the quotes stay, only the value goes
    ):
        assert redact_text(line) == expected, line


# --- every secret shape, through the logger ------------------------------------------------------

SECRET_SHAPES = [
    ("Authorization: Basic dXNlcjpwYXNz", "dXNlcjpwYXNz"),
    ('Proxy-Authorization: Digest username="bob", response="6629fae4"', "6629fae4"),
    ("Cookie: sessionid=abc123xyz; csrftoken=def456uvw", "abc123xyz"),
    ("Cookie: sessionid=abc123xyz; csrftoken=def456uvw", "def456uvw"),
    ("Set-Cookie: sessionid=abc123xyz; Path=/; HttpOnly", "abc123xyz"),
    ("credential=Zq9xT4mW2pL7", "Zq9xT4mW2pL7"),
    ("private_key=Zq9xT4mW2pL7", "Zq9xT4mW2pL7"),
    ("access_key=Zq9xT4mW2pL7", "Zq9xT4mW2pL7"),
    ('{"apiKey": "abc123def456"}', "abc123def456"),
    ('"password":"hunter2"', "hunter2"),
    ("{'api_key': 'Zq9xT4mW2pL7'}", "Zq9xT4mW2pL7"),
    ("clone https://user:Zq9xT4mW2pL7@example.com/repo.git", "Zq9xT4mW2pL7"),
    ("GET /cb?access_token=abc123xyz&api_key=def456uvw&page=2", "def456uvw"),
]


@pytest.mark.parametrize(("text", "secret"), SECRET_SHAPES)
def test_secret_shapes_never_reach_a_log_record(text: str, secret: str) -> None:
    with capture_logs() as records:
        get_logger("test").warning(f"request failed: {text}", detail=text, nested={"raw": [text]})
        get_logger("test").warning("request failed", error=format_error(RuntimeError(text)))
    assert len(records) == 2
    assert secret not in repr(records)
    assert "[redacted]" in records[0]["detail"]


def test_a_header_split_across_lines_in_an_error_is_masked_whole() -> None:
    text = format_error(RuntimeError("upstream said:\nAuthorization:\n  Basic dXNlcjpwYXNz\n"))
    assert text == "RuntimeError: upstream said: Authorization: [redacted]"


# --- our own field names survive ----------------------------------------------------------------

OUR_FIELDS = {
    "tokens": 52,
    "estimated_tokens": 42,
    "input_tokens": 42,
    "cached_input_tokens": 7,
    "output_tokens": 3,
    "max_tokens": 100,
    "token_budget": 80_000,
    "reserve_tokens": 20_000,
    "session_key": "agent:…#1a2b3c4d",
    "keys": 3,
}


def test_our_counter_fields_survive_as_fields_and_as_text() -> None:
    as_text = " ".join(f"{name}={value}" for name, value in OUR_FIELDS.items())
    with capture_logs() as records:
        get_logger("test").info("turn finished", usage=as_text, **OUR_FIELDS)
    assert records[0]["usage"] == as_text
    assert {name: records[0][name] for name in OUR_FIELDS} == OUR_FIELDS
    assert redact_text("max_tokens: 100, author: bob") == "max_tokens: 100, author: bob"


def test_fields_named_like_credentials_are_masked_whole() -> None:
    with capture_logs() as records:
        get_logger("test").bind(api_key="abc123").info(
            "request",
            headers={"Authorization": "Basic dXNlcjpwYXNz", "Accept": "application/json"},
            token=12345678,
            has_token=True,
            estimated_tokens=42,
        )
    record = records[0]
    assert record["api_key"] == "[redacted]"
    assert record["headers"] == {"Authorization": "[redacted]", "Accept": "application/json"}
    assert record["token"] == "[redacted]"
    assert record["has_token"] is True  # a flag, not a credential
    assert record["estimated_tokens"] == 42


def _log_call_keywords() -> set[str]:
    """Every keyword argument passed to a log call (or bind) anywhere in codex_turn."""
    names: set[str] = set()
    for path in (Path(__file__).parents[1] / "codex_turn").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"debug", "info", "warning", "error", "bind"}
            ):
                names.update(k.arg for k in node.keywords if k.arg is not None)
    return names


def test_no_field_codex_turn_logs_is_named_like_a_credential() -> None:
    names = _log_call_keywords()
    assert {"estimated_tokens", "session_key", "error"} <= names  # the scan sees our calls
    assert sorted(name for name in names if is_secret_key(name)) == []


# --- format_error: the message, made safe ------------------------------------------------------


def test_format_error_redacts_before_it_cuts() -> None:
    """A secret straddling the cut is masked whole, never cut into an unrecognisable prefix."""
    for offset in range(150, 320):
        text = format_error(RuntimeError("x" * offset + " sk-abcdefghijklmnopqrstuv tail"))
        assert "sk-a" not in text, offset
        assert len(text.removeprefix("RuntimeError: ")) <= 200


def test_format_error_masks_a_registered_multi_line_prompt() -> None:
    prompt = "please summarise\nmy medical history"
    with sensitive(prompt):
        as_is = format_error(RuntimeError(f"engine failed on: {prompt}"))
        reflowed = format_error(
            RuntimeError("engine failed on: please summarise  my medical history")
        )
    assert as_is == "RuntimeError: engine failed on: [redacted]"
    assert reflowed == "RuntimeError: engine failed on: [redacted]"


def test_format_error_omits_quoted_prose_but_keeps_identifiers() -> None:
    text = format_error(
        ValueError("assistant said \"I think your diagnosis is fine\" in turn 'msg-42' at /tmp/x")
    )
    assert text == "ValueError: assistant said \"[30 chars]\" in turn 'msg-42' at /tmp/x"
    assert format_error(KeyError("messages")) == "KeyError: 'messages'"
    cut = format_error(RuntimeError("model output: \u201cwell, here is what we could do next"))
    assert cut == "RuntimeError: model output: \u201c[35 chars]"
    # Apostrophes are not quotes.
    assert format_error(RuntimeError("can't parse it, it's broken")).endswith("it's broken")


def test_session_keys_are_masked_but_stable() -> None:
    masked = mask_session_key("agent:main:telegram:default:direct:12345")
    assert masked is not None
    assert "12345" not in masked
    assert "telegram" not in masked
    assert masked.startswith("agent:")
    assert masked == mask_session_key("agent:main:telegram:default:direct:12345")
    assert masked != mask_session_key("agent:main:telegram:default:direct:12346")
    assert mask_session_key(None) is None


def test_registered_sensitive_values_never_reach_a_record_in_any_field() -> None:
    prompt = "please summarise my medical history"
    with capture_logs() as records, sensitive(prompt, None, "ab"):
        log = get_logger("test").bind(context={"nested": [f"echo {prompt}"]})
        log.warning(f"failed on {prompt}", detail=prompt, error=RuntimeError(prompt))
    assert len(records) == 1
    assert prompt not in repr(records)
    assert "[redacted]" in records[0]["detail"]
    # Outside the context the value is no longer special.
    assert redact_text(prompt) == prompt


def test_the_suite_wide_privacy_guard_fails_a_test_that_logs_a_private_text(
    pytester: pytest.Pytester,
) -> None:
    conftest = (Path(__file__).parent / "conftest.py").read_text(encoding="utf-8")
    pytester.makeconftest(conftest)
    (pytester.path / "fixtures").symlink_to(Path(__file__).parent / "fixtures")
    pytester.makepyfile(
        test_leaky="""
from codex_turn._log import get_logger

def test_clean(private_texts):
    private_texts.add("my very private prompt")
    get_logger("t").info("turn finished", chars=22)

def test_leaky(private_texts):
    private_texts.add("my very private prompt")
    get_logger("t").info("turn finished", note="echo my very private prompt")
"""
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    # The leaky test body passes; its teardown (the guard) errors.
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*private text reached the logs*"])


# --- where logs go and what a filtered event costs ---------------------------------------------

LIBRARY_LOGGER = "codex_turn"
RAW_SESSION_KEY = "agent:main:telegram:default:direct:987654321"
SECRET = "sk-abcdefghijklmnopqrstuv"


@pytest.fixture
def uncaptured() -> Iterator[None]:
    """Outside the suite's structlog capture, with the library logger restored afterwards.

    The suite-wide privacy guard (``conftest.py``) keeps ``capture_logs`` active in every test,
    and while it is active every codex-turn event goes to the capture. These tests look at what
    a process without a capture sees.
    """
    processors = structlog.get_config()["processors"]
    saved = list(processors)
    processors[:] = [p for p in processors if not isinstance(p, LogCapture)]
    library = logging.getLogger(LIBRARY_LOGGER)
    handlers, level = list(library.handlers), library.level
    # As a process that never configured logging has it (another test may have run the CLI).
    library.handlers[:] = [h for h in handlers if type(h) is logging.NullHandler]
    library.setLevel(logging.NOTSET)
    try:
        yield
    finally:
        processors[:] = saved
        library.handlers[:] = handlers
        library.setLevel(level)


def _a_turn_of_log_calls() -> None:
    """What one turn logs, roughly: bound context, every level, secrets in the fields."""
    log = get_logger("codex_turn.harness.turn.orchestrator").bind(
        session_id="s-1", session_key=mask_session_key(RAW_SESSION_KEY), engine="sqlite"
    )
    log.debug("codex turn stage", state="reading_history")
    log = log.bind(thread_id="thr_1")
    log.info("codex thread resumed", estimated_tokens=42)
    log.warning("codex app-server slow", detail=f"Authorization: Bearer {SECRET}")
    log.error("codex turn failed", error=RuntimeError(f"api_key={SECRET}"))
    log.info("codex turn finished", outcome="completed", duration_ms=812.4)


def test_an_unconfigured_library_prints_nothing(
    uncaptured: None, capfd: pytest.CaptureFixture[str]
) -> None:
    _a_turn_of_log_calls()
    assert capfd.readouterr() == ("", "")


_QUIET_SCRIPT = """
import codex_turn  # the whole package, as a host imports it
from codex_turn._log import get_logger, mask_session_key
log = get_logger("codex_turn.harness.turn.orchestrator").bind(session_key=mask_session_key("k:1"))
for method in ("debug", "info", "warning", "error"):
    getattr(log, method)("codex turn event", api_key="sk-abcdefghijklmnopqrstuv", n=1)
"""


def test_an_unconfigured_library_prints_nothing_in_a_fresh_process() -> None:
    """No handler anywhere: the standard library's last resort (stderr) must not fire."""
    done = subprocess.run(
        [sys.executable, "-c", _QUIET_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).parents[1],
    )
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


def test_configure_logging_json_emits_json_lines_at_the_level(uncaptured: None) -> None:
    stream = io.StringIO()
    configure_logging("INFO", "json", stream=stream)
    _a_turn_of_log_calls()
    lines = stream.getvalue().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["level"], r["event"]) for r in records] == [
        ("info", "codex thread resumed"),
        ("warning", "codex app-server slow"),
        ("error", "codex turn failed"),
        ("info", "codex turn finished"),
    ]
    first = records[0]
    assert list(first)[:4] == ["timestamp", "level", "logger", "event"]
    assert first["logger"] == "codex_turn.harness.turn.orchestrator"
    assert first["timestamp"].endswith("Z")
    # The structured fields, bound and per call, as fields.
    assert first["estimated_tokens"] == 42
    assert first["thread_id"] == "thr_1"
    assert first["session_key"] == mask_session_key(RAW_SESSION_KEY)
    assert records[3]["duration_ms"] == 812.4
    # Masked session key, scrubbed secrets.
    text = stream.getvalue()
    assert "987654321" not in text
    assert RAW_SESSION_KEY not in text
    assert SECRET not in text
    assert "abcdefghijklmnopqrstuv" not in text
    assert records[1]["detail"] == "Authorization: [redacted]"
    assert records[2]["error"] == "RuntimeError: api_key=[redacted]"


def test_configure_logging_console_and_a_second_call_replaces_the_first(
    uncaptured: None,
) -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("DEBUG", "json", stream=first)
    configure_logging(logging.WARNING, "console", stream=second)
    _a_turn_of_log_calls()
    assert first.getvalue() == ""
    lines = second.getvalue().splitlines()
    assert len(lines) == 2
    assert "codex app-server slow" in lines[0]
    assert "warning" in lines[0]
    assert "\x1b[" not in second.getvalue()  # no colours off a terminal
    assert SECRET not in second.getvalue()
    library = logging.getLogger(LIBRARY_LOGGER)
    assert sum(not isinstance(h, logging.NullHandler) for h in library.handlers) == 1


def test_configure_logging_rejects_unknown_levels_and_formats(uncaptured: None) -> None:
    with pytest.raises(ValueError, match="level"):
        configure_logging("LOUD")
    with pytest.raises(ValueError, match="format"):
        configure_logging("INFO", "xml")  # type: ignore[arg-type]


def test_a_host_with_stdlib_logging_gets_scrubbed_records(
    uncaptured: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LIBRARY_LOGGER)
    get_logger("codex_turn.harness.binding").info(
        "binding written", api_key=SECRET, note=f"token={SECRET}", n=2
    )
    (record,) = caplog.records
    assert record.name == "codex_turn.harness.binding"
    assert record.pathname == __file__  # the caller, not the logging helper
    assert record.getMessage() == (
        'binding written api_key="[redacted]" note="token=[redacted]" n=2'
    )
    # A structlog ProcessorFormatter reads the structured fields.
    formatter = structlog.stdlib.ProcessorFormatter(processor=structlog.processors.JSONRenderer())
    assert json.loads(formatter.format(record)) == {
        "event": "binding written",
        "api_key": "[redacted]",
        "note": "token=[redacted]",
        "n": 2,
    }


def test_filtered_events_are_neither_built_nor_scrubbed(
    uncaptured: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[object] = []

    def spy(value: object) -> object:
        calls.append(value)
        return value

    monkeypatch.setattr(_log, "redact_text", spy)
    monkeypatch.setattr(_log, "_scrub", spy)
    monkeypatch.setattr(_log, "format_error", spy)
    # Unconfigured: DEBUG and INFO are below the default level.
    log = get_logger("codex_turn.harness.turn.orchestrator").bind(prompt_chars=3, note=SECRET)
    log.debug("stage", note=SECRET)
    log.info("finished", error=RuntimeError(SECRET))
    assert calls == []
    # Configured at WARNING: still nothing for DEBUG/INFO, and bind scrubs nothing either.
    configure_logging("WARNING", "json", stream=io.StringIO())
    log.bind(thread_id="t").info("finished", note=SECRET)
    assert calls == []
    assert not log.is_enabled_for(logging.INFO)
    # An emitted event is scrubbed.
    log.warning("slow", note=SECRET)
    assert calls


def test_bound_fields_are_masked_with_values_registered_before_or_after_binding(
    uncaptured: None,
) -> None:
    stream = io.StringIO()
    configure_logging("INFO", "json", stream=stream)
    prompt = "please summarise my medical history"
    base = get_logger("codex_turn.test").bind(early=f"echo {prompt}")
    base.info("before registration")  # scrubbed (and cached) without the prompt registered
    with sensitive(prompt):
        late = base.bind(late=f"echo {prompt}")
        base.info("inside")
    late.info("after the context ended")  # the bind-time registration still counts
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert records[0]["early"] == f"echo {prompt}"
    assert records[1]["early"] == "echo [redacted]"
    assert records[2]["late"] == "echo [redacted]"
    assert records[2]["early"] == "echo [redacted]"


def test_the_capture_sees_every_level_and_no_line_is_printed(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with capture_logs() as records:
        _a_turn_of_log_calls()
    assert [r["log_level"] for r in records] == ["debug", "info", "warning", "error", "info"]
    assert records[0]["session_key"] == mask_session_key(RAW_SESSION_KEY)
    assert SECRET not in repr(records)
    assert capfd.readouterr() == ("", "")


@pytest.mark.parametrize("log_format", ["json", "console"])
def test_an_event_field_never_overwrites_the_reserved_keys(
    uncaptured: None, log_format: _log.LogFormat
) -> None:
    """A field (per call or bound) named like a key the formatter owns (timestamp, level,
    logger, event) keeps its value under a prefixed name: the line's level is the record's."""
    stream = io.StringIO()
    configure_logging("DEBUG", log_format, stream=stream)
    log = get_logger("codex_turn.harness.appserver.process").bind(event="bound", logger="mine")
    log.debug("appserver.stderr", level="WARN", timestamp="yesterday", field_level="taken")
    log.info("codex turn finished", level=None)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    if log_format == "console":
        head, _, tail = lines[0].partition(" appserver.stderr ")
        assert "[debug" in head
        assert "warn" not in head.lower()
        assert "[codex_turn.harness.appserver.process]" in tail
        for field in ("field_field_level=WARN", "field_level=taken", "field_event=bound"):
            assert field in tail.split(), field
        return
    first, second = (json.loads(line) for line in lines)
    assert list(first)[:4] == ["timestamp", "level", "logger", "event"]
    assert first["level"] == "debug"
    assert first["event"] == "appserver.stderr"
    assert first["logger"] == "codex_turn.harness.appserver.process"
    assert first["timestamp"].endswith("Z")
    # Every clashing value is kept, under a free prefixed name; nothing is overwritten.
    assert first["field_timestamp"] == "yesterday"
    assert first["field_event"] == "bound"
    assert first["field_logger"] == "mine"
    assert first["field_level"] == "taken"
    assert first["field_field_level"] == "WARN"
    assert second["level"] == "info"
    assert second["field_level"] is None
    assert second["event"] == "codex turn finished"


def test_the_appserver_stderr_event_reports_codex_level_as_codex_level() -> None:
    """Codex's own tracing level is a field of its own, never the record's ``level``."""
    source = Path(_log.__file__).parent / "harness" / "appserver" / "process.py"
    tree = ast.parse(source.read_text(encoding="utf-8"))
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "appserver.stderr"
    ]
    assert calls
    for call in calls:
        names = {keyword.arg for keyword in call.keywords}
        assert "codex_level" in names
        assert not names & {"timestamp", "level", "logger", "event"}
