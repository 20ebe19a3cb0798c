"""The logging helpers keep secrets, prompts and session keys out of log records."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from codex_turn._log import format_error, get_logger, mask_session_key, redact_text, sensitive
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


# --- every secret shape of the review, through the logger ---------------------------------------

REVIEW_SHAPES = [
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


@pytest.mark.parametrize(("text", "secret"), REVIEW_SHAPES)
def test_review_shapes_never_reach_a_log_record(text: str, secret: str) -> None:
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
