"""The logging helpers keep secrets, prompts and session keys out of log records."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from codex_turn._log import format_error, get_logger, mask_session_key, redact_text, sensitive


def test_format_error_redacts_bearer_tokens_and_keys_and_names_the_type() -> None:
    error = RuntimeError("Authorization: Bearer sk-abcdefghijklmnopqrstuv failed")
    text = format_error(error)
    assert text.startswith("RuntimeError: ")
    assert "sk-abcdefghijklmnopqrstuv" not in text
    assert "abcdefghijklmnopqrstuv" not in text


def test_format_error_is_one_bounded_line() -> None:
    text = format_error(ValueError("x" * 5000 + "\nsecond line"))
    assert "\n" not in text
    assert len(text) < 400


def test_assignments_of_secret_looking_names_are_masked() -> None:
    for line in ("OPENAI_API_KEY=abc123def", "password: hunter2hunter2", "token='zzz999'"):
        assert redact_text(line).endswith("[redacted]"), line


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
