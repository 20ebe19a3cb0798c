"""Hostile values for the public records built from user input: one typed error, or a value
every later stage can use.

Hypothesis hands each record (:class:`TurnParams`, :class:`AppServerConfig` and its
``offline``/``user`` constructors, :class:`ModelProviderConfig`, :class:`EngineSettings`) and
:func:`steer_codex_turn` values no caller should send: text with NUL and lone surrogates,
absurd integers and floats (``inf``, ``nan``, ``2**70``, a 400-digit int, ``-1``), containers
nested thousands deep, and the wrong types. The record either refuses them with its documented
error (a ``CodexTurnError`` that is also a ``ValueError``) or holds only values the stages can
use: text that encodes as UTF-8, paths and environment entries the OS takes, integers within
64 bits. No other exception may escape. No binary is started; examples are bounded.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codex_turn import (
    AppServerConfig,
    InvalidAppServerConfig,
    InvalidTurnParams,
    SteerReceipt,
    SteerStatus,
    TurnParams,
    steer_codex_turn,
)
from codex_turn._checks import INT64_MAX
from codex_turn._json import MAX_JSON_DEPTH, nested_deeper_than
from codex_turn.engines import EngineSettings, InvalidEngineSettings
from codex_turn.errors import CodexTurnError
from codex_turn.harness.appserver.config import ModelProviderConfig

EXAMPLES = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _deep(depth: int, as_list: bool) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value] if as_list else {"k": value}
    return value


surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"])
hostile_text = st.one_of(
    st.sampled_from(["", " ", "\x00", "a\x00b", "\ud800", "x\udc80y", "\udbff\udfff", "=", "."]),
    st.text(st.one_of(st.characters(), surrogates, st.just("\x00")), max_size=12),
)
absurd_integers = [-1, 0, 1, 2**31, 2**63 - 1, 2**63, 2**70, 10**400, -(10**400), True, False]
absurd_floats = [math.inf, -math.inf, math.nan, 1e300, -0.0, 5e-324, 0.5, 1.5]
absurd_numbers = st.sampled_from([*absurd_integers, *absurd_floats])
deep = st.builds(_deep, st.sampled_from([MAX_JSON_DEPTH + 1, 600, 5000]), st.booleans())
wrong_types = st.sampled_from(
    [None, b"bytes", b"\x00", object(), [], (), {}, set(), Path("/tmp/a\x00b"), ["x", None]]
)
hostile = st.one_of(
    hostile_text,
    absurd_numbers,
    st.integers(),
    st.floats(),
    deep,
    wrong_types,
    st.lists(hostile_text, max_size=3).map(tuple),
    st.dictionaries(hostile_text, hostile_text, max_size=3),
)


def _overrides(fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(fields), hostile, min_size=1, max_size=3)


def _refused_as(error: BaseException, kind: type[Exception]) -> None:
    assert isinstance(error, kind), f"{type(error).__name__}: {error}"
    assert isinstance(error, CodexTurnError)
    assert isinstance(error, ValueError)
    assert getattr(error, "problems", (str(error),))  # one message per bad field


def _utf8(text: object) -> bool:
    if not isinstance(text, str):
        return False
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _os_text(value: object) -> bool:
    encoded = os.fsencode(value)  # type: ignore[arg-type]
    return b"\x00" not in encoded


# --- TurnParams ------------------------------------------------------------------------------

TURN_BASE: dict[str, Any] = {
    "session_id": "s-1",
    "session_file": "/tmp/s.jsonl",
    "workspace_dir": "/tmp",
    "prompt": "hello",
}
TURN_FIELDS = [field.name for field in attrs.fields(TurnParams)]
TURN_TEXT = (
    "session_id",
    "prompt",
    "session_key",
    "sandbox_session_key",
    "model",
    "citations_mode",
    "base_developer_instructions",
    "extra_developer_instructions",
    "auth_profile_id",
    "service_tier",
    "reasoning_effort",
)


@EXAMPLES
@given(_overrides(TURN_FIELDS))
def test_turn_params_refuse_hostile_values_with_invalid_turn_params(
    overrides: dict[str, Any],
) -> None:
    try:
        params = TurnParams(**{**TURN_BASE, **overrides})
    except InvalidTurnParams as error:
        _refused_as(error, InvalidTurnParams)
        return
    except Exception as error:  # the assertion names it
        pytest.fail(f"{type(error).__name__} escaped TurnParams: {error}")
    for name in TURN_TEXT:
        value = getattr(params, name)
        assert value is None or _utf8(value), name
    assert all(_utf8(image) for image in params.images)
    assert _os_text(params.session_file)
    assert _os_text(params.workspace_dir)
    for name in ("context_token_budget", "reserve_tokens"):
        value = getattr(params, name)
        assert value is None or 0 <= value <= INT64_MAX
    assert params.output_schema is None or not nested_deeper_than(dict(params.output_schema))


# --- steered messages ------------------------------------------------------------------------


@EXAMPLES
@given(text=hostile, mode=st.one_of(st.none(), hostile))
def test_a_steered_message_is_refused_with_invalid_turn_params_or_finds_no_turn(
    tmp_path_factory: pytest.TempPathFactory, text: Any, mode: Any
) -> None:
    session = tmp_path_factory.getbasetemp() / "no-turn.jsonl"
    try:
        receipt = anyio.run(functools.partial(steer_codex_turn, session, text, mode=mode))
    except InvalidTurnParams as error:
        _refused_as(error, InvalidTurnParams)
        return
    except Exception as error:
        pytest.fail(f"{type(error).__name__} escaped steer_codex_turn: {error}")
    assert receipt == SteerReceipt(status=SteerStatus.NO_TURN)
    assert _utf8(text)
    assert text.strip()


# --- AppServerConfig and ModelProviderConfig -------------------------------------------------

APPSERVER_FIELDS = [field.name for field in attrs.fields(AppServerConfig)]
PROVIDER_FIELDS = [field.name for field in attrs.fields(ModelProviderConfig)]
URL = "http://127.0.0.1:1/v1"


def _usable_appserver_config(config: AppServerConfig) -> None:
    """What a built config hands the OS and Codex can be handed."""
    assert _os_text(config.codex_home)
    for path in (config.home, config.codex_bin):
        assert path is None or _os_text(path)
    if config.command is not None:
        assert all(_os_text(arg) for arg in config.command)
    for name, value in config.env.items():
        assert _os_text(name)
        assert _os_text(value)
        assert _utf8(name)
        assert _utf8(value)
    for text in (config.model, config.compact_prompt, config.rust_log):
        assert text is None or _utf8(text)
    limit = config.auto_compact_token_limit
    assert limit is None or 1 <= limit <= INT64_MAX
    if not config.extra_config and not config.config_overrides:
        config.config_text()  # config.toml renders: no value TOML cannot hold


@EXAMPLES
@given(_overrides(APPSERVER_FIELDS))
def test_appserver_config_refuses_hostile_values_with_invalid_appserver_config(
    overrides: dict[str, Any],
) -> None:
    try:
        config = AppServerConfig(**{"codex_home": "/nonexistent/home", **overrides})
    except InvalidAppServerConfig as error:
        _refused_as(error, InvalidAppServerConfig)
        return
    except Exception as error:
        pytest.fail(f"{type(error).__name__} escaped AppServerConfig: {error}")
    _usable_appserver_config(config)


@EXAMPLES
@given(
    home=hostile,
    base_url=st.one_of(st.just(URL), hostile),
    overrides=st.dictionaries(st.sampled_from(APPSERVER_FIELDS[1:]), hostile, max_size=2),
    user=st.booleans(),
)
def test_the_offline_and_user_configs_refuse_hostile_values_the_same_way(
    home: Any, base_url: Any, overrides: dict[str, Any], user: bool
) -> None:
    overrides.pop("provider", None)
    overrides.pop("write_config", None)
    try:
        if user:
            config = AppServerConfig.user(home, **overrides)
        else:
            config = AppServerConfig.offline(home, base_url, **overrides)
    except InvalidAppServerConfig as error:
        _refused_as(error, InvalidAppServerConfig)
        return
    except Exception as error:
        pytest.fail(f"{type(error).__name__} escaped AppServerConfig.offline/user: {error}")
    _usable_appserver_config(config)


@EXAMPLES
@given(_overrides(PROVIDER_FIELDS))
def test_model_provider_config_refuses_hostile_values_with_invalid_appserver_config(
    overrides: dict[str, Any],
) -> None:
    try:
        provider = ModelProviderConfig(**{"base_url": URL, **overrides})
    except InvalidAppServerConfig as error:
        _refused_as(error, InvalidAppServerConfig)
        return
    except Exception as error:
        pytest.fail(f"{type(error).__name__} escaped ModelProviderConfig: {error}")
    assert _utf8(provider.id)
    AppServerConfig(codex_home="/nonexistent/home", provider=provider).config_text()


# --- EngineSettings --------------------------------------------------------------------------

SETTINGS_FIELDS = [field.name for field in attrs.fields(EngineSettings)]


@EXAMPLES
@given(_overrides(SETTINGS_FIELDS))
def test_engine_settings_refuse_hostile_values_with_invalid_engine_settings(
    overrides: dict[str, Any],
) -> None:
    try:
        built = EngineSettings(**overrides)
    except InvalidEngineSettings as error:
        _refused_as(error, InvalidEngineSettings)
        return
    except Exception as error:
        pytest.fail(f"{type(error).__name__} escaped EngineSettings: {error}")
    for field in attrs.fields(EngineSettings):
        value = getattr(built, field.name)
        if field.type == "float":  # seconds and fractions: finite (an int may stand for one)
            assert type(value) in (int, float), field.name
            assert math.isfinite(value), field.name
        elif field.type == "bool":  # switches
            assert type(value) is bool, field.name
        elif str(field.type).startswith("Literal["):  # a choice: one of the names it lists
            assert type(value) is str, field.name
            assert repr(value) in str(field.type), field.name
        elif value is not None:  # counts
            assert type(value) is int, field.name
            assert 0 <= value <= INT64_MAX, field.name
    assert int(built.busy_timeout_s * 1000) < 2**31  # PRAGMA busy_timeout's int
