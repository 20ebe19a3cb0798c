"""config.toml and ``-c`` overrides: valid TOML for any text, and a user's Codex
configuration is never overwritten by a private home.

* TOML: everything written (config.toml through :func:`render_toml`, each ``-c`` value through
  :func:`toml_value`) survives :mod:`tomllib`, for any string (characters outside the BMP
  included: the old hand-written writer turned them into surrogate escapes) and nested
  tables, arrays, integers, floats and booleans; the real binary reads both back.
* Ownership: ``AppServerConfig.offline()`` rewrites only a config.toml it wrote (marked by
  :data:`CONFIG_MARKER`); anything else is refused with :class:`CodexHomeNotPrivate` and left
  byte-for-byte (and mode-for-mode) as it was.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from codex_turn.errors import CodexTurnError
from codex_turn.harness.appserver import AppServer, AppServerConfig, ModelProviderConfig
from codex_turn.harness.appserver.config import (
    CONFIG_MARKER,
    override_args,
    render_toml,
    toml_value,
)
from codex_turn.harness.appserver.errors import (
    AppServerError,
    AppServerStartError,
    CodexHomeNotPrivate,
    InvalidAppServerConfig,
)

pytestmark = pytest.mark.both_backends

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
SCALARS = st.one_of(st.text(), INT64, st.booleans(), st.floats(allow_nan=False))
VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=8), children, max_size=4),
    ),
    max_leaves=12,
)
EMOJI = "emoji 😀"
USER_CONFIG = b"""# my own Codex settings
model = "gpt-5"

[mcp_servers.docs]
command = "npx"
args = ["-y", "docs-mcp"]   # keep me
env = { TOKEN_FILE = "/home/me/.docs" }
"""


def parse_value(rendered: str) -> Any:
    """How Codex parses the value of ``-c key=value``: as ``_x_ = <value>``."""
    return tomllib.loads(f"_x_ = {rendered}")["_x_"]


# --- TOML -----------------------------------------------------------------------------------


@given(st.dictionaries(st.text(), VALUES, max_size=5))
@example({"prompt": EMOJI})
@example({EMOJI: {"nested 😀": [EMOJI, 1, True, {"k": '\x00\x7f\n\t"\\'}]}})
def test_config_toml_round_trips_through_tomllib(data: dict[str, Any]) -> None:
    assert tomllib.loads(render_toml(data)) == data


@given(VALUES)
@example(EMOJI)
@example({"a.b": {"": [EMOJI]}, "x y": []})
@example({})
def test_override_values_are_single_line_toml(value: Any) -> None:
    rendered = toml_value(value)
    assert "\n" not in rendered  # one argv element; TOML inline tables are single-line
    assert parse_value(rendered) == value


@given(
    st.dictionaries(st.from_regex(r"[a-z_]{1,8}(\.[a-z_0-9-]{1,8}){0,2}", fullmatch=True), VALUES)
)
def test_override_args_split_like_codex(overrides: dict[str, Any]) -> None:
    argv = override_args(overrides)
    assert argv[::2] == ["-c"] * len(overrides)
    parsed = {}
    for arg in argv[1::2]:
        key, _, raw = arg.partition("=")  # Codex splits at the first "="
        parsed[key] = parse_value(raw)
    assert parsed == overrides


@given(st.text(), VALUES)
@example(EMOJI, {"k": EMOJI})
def test_private_config_text_is_valid_toml(prompt: str, extra: Any) -> None:
    config = AppServerConfig.offline(
        "/nonexistent", "http://127.0.0.1:1/v1", compact_prompt=prompt, extra_config={"x": extra}
    )
    text = config.config_text()
    assert text.splitlines()[0] == CONFIG_MARKER
    assert tomllib.loads(text) == config.config_data()


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (None, TypeError),
        ({"a": [1, None]}, TypeError),
        (b"bytes", TypeError),
        (object(), TypeError),
        ("lone \ud800 surrogate", ValueError),
        (2**63, ValueError),
        ({1: "non-str key"}, TypeError),
    ],
)
def test_values_toml_cannot_hold_are_refused(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        toml_value(value)
    with pytest.raises(error):
        render_toml({"k": value})


def test_paths_and_tuples_are_written_as_strings_and_arrays() -> None:
    assert parse_value(toml_value((Path("/a b"), 1))) == ["/a b", 1]


@pytest.mark.parametrize("key", ["", "a..b", ".a", "a.", "a=b", " a", "a. b", "a\nb", "a\x00"])
def test_override_keys_codex_cannot_split_are_refused(key: str) -> None:
    with pytest.raises(ValueError, match="config override key"):
        override_args({key: 1})


def test_override_keys_are_literal_dotted_paths() -> None:
    argv = override_args({"features.plugins": False, "model_providers.my-p.name": EMOJI})
    assert argv == [
        "-c",
        "features.plugins=false",
        "-c",
        f'model_providers.my-p.name="{EMOJI}"',
    ]


def test_invalid_config_fails_before_anything_is_written(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = AppServerConfig.offline(home, "http://127.0.0.1:1/v1", extra_config={"x": None})
    with pytest.raises(TypeError):
        config.write()
    assert not home.exists()


@pytest.mark.anyio
async def test_a_config_toml_cannot_hold_is_a_typed_start_error(tmp_path: Path) -> None:
    config = AppServerConfig.offline(
        tmp_path / "home", "http://127.0.0.1:1/v1", extra_config={"x": None}, command=("true",)
    )
    with pytest.raises(AppServerStartError, match="x: cannot write None"):
        async with AppServer.start(config):
            pass
    bad_key = AppServerConfig.user(tmp_path / "user", config_overrides={"a=b": 1})
    with pytest.raises(AppServerStartError, match="config override key"):
        async with AppServer.start(bad_key):
            pass


@pytest.mark.anyio
async def test_the_real_binary_reads_unicode_from_config_toml_and_overrides(
    make_appserver_config: Callable[..., AppServerConfig], offline_model: Any
) -> None:
    """config.toml: the model and provider id (a quoted table key); ``-c``: the model."""
    weird = f'{EMOJI} "q" \\ \t end'
    provider = ModelProviderConfig(base_url=offline_model.base_url, id=f"prov {EMOJI}")
    config = make_appserver_config(model=weird, provider=provider)
    async with AppServer.start(config) as server:
        started = await server.start_thread()
    assert (started.model, started.model_provider) == (weird, provider.id)

    other = f"override {EMOJI} 𝄞"
    config = make_appserver_config(config_overrides={"model": other})
    async with AppServer.start(config) as server:
        started = await server.start_thread()
    assert started.model == other


# --- ownership of CODEX_HOME -------------------------------------------------------------


def offline(home: Path, **kwargs: Any) -> AppServerConfig:
    return AppServerConfig.offline(home, "http://127.0.0.1:1/v1", **kwargs)


def snapshot(home: Path) -> dict[str, tuple[bytes | str, int]]:
    """Every entry of ``home``: content (or link target) and mode."""
    state: dict[str, tuple[bytes | str, int]] = {"": (b"", stat.S_IMODE(home.lstat().st_mode))}
    for path in sorted(home.rglob("*")):
        info = path.lstat()
        body: bytes | str = (
            os.readlink(path) if path.is_symlink() else path.read_bytes() if path.is_file() else b""
        )
        state[str(path.relative_to(home))] = (body, stat.S_IMODE(info.st_mode))
    return state


def user_home(tmp_path: Path, files: dict[str, bytes]) -> Path:
    home = tmp_path / "dot-codex"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    for name, body in files.items():
        (home / name).write_bytes(body)
        (home / name).chmod(0o644)
    return home


def test_a_user_config_with_mcp_servers_is_refused_and_kept_byte_for_byte(tmp_path: Path) -> None:
    home = user_home(tmp_path, {"config.toml": USER_CONFIG})
    before = snapshot(home)
    with pytest.raises(CodexHomeNotPrivate) as caught:
        offline(home).write()
    assert snapshot(home) == before  # not overwritten, merged, or re-permissioned
    error = caught.value
    assert isinstance(error, AppServerStartError)
    assert isinstance(error, CodexTurnError)
    assert error.codex_home == home
    text = str(error)
    assert str(home) in text
    assert "did not write" in text
    assert "AppServerConfig.user(" in text
    assert "new or empty directory" in text
    assert "docs-mcp" not in text  # names only, never content


@pytest.mark.anyio
async def test_appserver_start_refuses_a_user_home_before_spawning(tmp_path: Path) -> None:
    home = user_home(tmp_path, {"config.toml": USER_CONFIG})
    before = snapshot(home)
    marker = tmp_path / "spawned"
    command = (sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    with pytest.raises(CodexHomeNotPrivate):
        async with AppServer.start(offline(home, command=command)):
            pass
    assert snapshot(home) == before
    assert not marker.exists()


@pytest.mark.parametrize(
    ("files", "reason"),
    [
        ({"auth.json": b'{"OPENAI_API_KEY": "sk-not-real"}'}, "holds files (auth.json)"),
        ({"config.toml": b""}, "did not write"),
        ({"config.toml": (CONFIG_MARKER + " and more\n").encode()}, "did not write"),
        ({"config.toml": b"\n" + CONFIG_MARKER.encode() + b"\n"}, "did not write"),
        ({"sessions": b"x", "history.jsonl": b"{}"}, "holds files (history.jsonl, sessions)"),
    ],
)
def test_other_user_homes_are_refused_untouched(
    tmp_path: Path, files: dict[str, bytes], reason: str
) -> None:
    home = user_home(tmp_path, files)
    before = snapshot(home)
    with pytest.raises(CodexHomeNotPrivate, match=re.escape(reason)):
        offline(home).write()
    assert snapshot(home) == before


def test_a_symlinked_config_toml_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.toml"
    target.write_bytes(CONFIG_MARKER.encode() + b"\n" + USER_CONFIG)
    home = user_home(tmp_path, {})
    (home / "config.toml").symlink_to(target)
    before = snapshot(home)
    with pytest.raises(CodexHomeNotPrivate, match="not a regular file"):
        offline(home).write()
    assert snapshot(home) == before
    assert target.read_bytes() == CONFIG_MARKER.encode() + b"\n" + USER_CONFIG


@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
@example(USER_CONFIG)
def test_any_config_toml_without_the_marker_is_preserved(body: bytes) -> None:
    if body.startswith(CONFIG_MARKER.encode()):
        body = b"#" + body
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        (home / "config.toml").write_bytes(body)
        with pytest.raises(CodexHomeNotPrivate):
            offline(home).write()
        assert (home / "config.toml").read_bytes() == body


@pytest.mark.parametrize("existing", ["missing", "empty", "leftover temp file"])
def test_a_new_or_empty_home_gets_the_private_config(tmp_path: Path, existing: str) -> None:
    home = tmp_path / "home"
    if existing != "missing":
        home.mkdir()
    if existing == "leftover temp file":
        (home / ".config.toml.codex-turn-abc123").write_text("interrupted")
    path = offline(home, compact_prompt=EMOJI).write()
    assert path == home / "config.toml"
    text = path.read_text(encoding="utf-8")
    assert text.splitlines()[0] == CONFIG_MARKER
    assert tomllib.loads(text)["compact_prompt"] == EMOJI
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    temporary = [p.name for p in home.iterdir() if p.name.startswith(".config.toml.codex-turn-")]
    assert temporary == (
        [".config.toml.codex-turn-abc123"] if existing.startswith("leftover") else []
    )


def test_a_write_killed_before_its_rename_leaves_a_home_that_is_still_ours(
    tmp_path: Path,
) -> None:
    # The config is written through harness._fs (a temp beside it, then link or replace): the
    # temp of a writer that died is no user file, and the next write removes it.
    home = tmp_path / "home"
    home.mkdir()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    (home / f"config.toml.{child.pid}.0badf00d.tmp").write_text("interrupted")
    path = offline(home).write()
    assert path == home / "config.toml"
    offline(home, model="second").write()
    assert sorted(p.name for p in home.iterdir()) == ["config.toml"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_our_own_config_is_rewritten_in_a_used_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    offline(home, model="first").write()
    (home / "state_5.sqlite").write_bytes(b"codex state")  # what a started Codex leaves
    (home / "sessions").mkdir()
    offline(home, model="second").write()
    assert tomllib.loads((home / "config.toml").read_text())["model"] == "second"
    assert sorted(p.name for p in home.iterdir()) == ["config.toml", "sessions", "state_5.sqlite"]


def test_a_user_home_is_never_written(tmp_path: Path) -> None:
    home = user_home(tmp_path, {"config.toml": USER_CONFIG})
    before = snapshot(home)
    config = AppServerConfig.user(home, config_overrides={"features.plugins": False})
    assert config.write() is None
    assert snapshot(home) == before


@pytest.mark.parametrize("appeared", ["foreign", "ours"])
def test_a_config_toml_appearing_during_the_write_is_not_clobbered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, appeared: str
) -> None:
    """Between the claim and the move into place, another writer creates config.toml: a
    user's file is kept (and the start refused), a concurrent start's own file is replaced."""
    home = tmp_path / "home"
    body = USER_CONFIG if appeared == "foreign" else CONFIG_MARKER.encode() + b"\nmodel = 'x'\n"
    real_link = os.link

    def racing_link(src: str, dst: str) -> None:
        Path(dst).write_bytes(body)
        real_link(src, dst)

    monkeypatch.setattr(os, "link", racing_link)
    config = offline(home, model="mine")
    if appeared == "foreign":
        with pytest.raises(CodexHomeNotPrivate):
            config.write()
        assert (home / "config.toml").read_bytes() == USER_CONFIG
    else:
        config.write()
        assert tomllib.loads((home / "config.toml").read_text())["model"] == "mine"
    assert [p.name for p in home.iterdir()] == ["config.toml"]  # no temporary file left


# --- validation at construction ---------------------------------------------------------------

SECRET_URL = "https://user:sk-secretsecretsecret@example.com/v1"
BAD_APPSERVER_VALUES: list[tuple[str, Any]] = [
    ("codex_home", None),
    ("codex_home", ""),
    ("write_config", "yes"),
    ("provider", {"base_url": "http://127.0.0.1:1/v1"}),
    ("model", ""),
    ("model", 3),
    ("approval_policy", "sometimes"),
    ("sandbox_mode", "readonly"),
    ("compact_prompt", 1),
    ("auto_compact_token_limit", 0),
    ("auto_compact_token_limit", True),
    ("extra_config", [("x", 1)]),
    ("config_overrides", None),
    ("codex_bin", ""),
    ("codex_bin", 1),
    ("command", ()),
    ("command", "codex app-server"),
    ("command", ("codex", None)),
    ("home", 1),
    ("env", {"TOKEN": 1}),
    ("env", {"A=B": "x"}),
    ("env", ["TOKEN"]),
    ("inherit_env", None),
    ("rust_log", 1),
    ("client_name", ""),
    ("client_title", None),
    ("client_version", " "),
    ("experimental_api", 1),
    ("request_timeout", -1),
    ("request_timeout", 0),
    ("request_timeout", float("inf")),
    ("request_timeout", float("nan")),
    ("request_timeout", "60"),
    ("request_timeout", True),
    ("initialize_timeout", 0),
    ("shutdown_timeout", -5.0),
    ("stderr_lines_per_second", 0),
    ("stderr_burst", 0),
    ("stderr_burst", 2.5),
    ("log_stderr_text", "no"),
    ("interrupt_grace", -1),
    ("interrupt_grace", float("inf")),
    ("liveness_timeout", 0),
    ("umask", -1),
    ("umask", 0o1000),
    ("umask", "077"),
    ("login_check", "auto"),
    # Values that cannot be spawned or written: NUL where the OS takes the value, a lone
    # surrogate in text Codex reads, integers beyond 64 bits, seconds beyond a float.
    ("codex_home", "/tmp/codex\x00home"),
    ("home", "/tmp/\x00"),
    ("home", "/tmp/\ud800"),
    ("codex_bin", "/usr/bin/codex\x00"),
    ("command", ("codex", "app-\x00server")),
    ("command", ("codex\x00",)),
    ("rust_log", "info\x00"),
    ("rust_log", "info,\ud800"),
    ("env", {"TOKEN": "a\ud800"}),
    ("env", {"T\udc80": "x"}),
    ("model", "gpt-\ud800"),
    ("compact_prompt", "summarise \udfff"),
    ("auto_compact_token_limit", 2**70),
    ("stderr_burst", 2**63),
    ("request_timeout", 10**400),
    ("interrupt_grace", 10**400),
]


def appserver_config(**kwargs: Any) -> AppServerConfig:
    return AppServerConfig(**{"codex_home": "/nonexistent/home", **kwargs})


@pytest.mark.parametrize(("field", "value"), BAD_APPSERVER_VALUES)
def test_a_bad_appserver_config_field_is_refused_at_construction(field: str, value: Any) -> None:
    with pytest.raises(InvalidAppServerConfig) as raised:
        appserver_config(**{field: value})
    error = raised.value
    assert isinstance(error, ValueError)
    assert isinstance(error, AppServerError)
    assert isinstance(error, CodexTurnError)
    assert len(error.problems) == 1
    assert error.problems[0].startswith(f"AppServerConfig.{field}: "), error.problems


def test_every_appserver_config_field_is_checked() -> None:
    assert {field for field, _ in BAD_APPSERVER_VALUES} == set(attrs.fields_dict(AppServerConfig))
    assert {field for field, _ in BAD_PROVIDER_VALUES} == set(
        attrs.fields_dict(ModelProviderConfig)
    )


def test_a_negative_request_timeout_is_refused_by_every_constructor(tmp_path: Path) -> None:
    makers: list[Callable[[], AppServerConfig]] = [
        lambda: appserver_config(request_timeout=-1),
        lambda: AppServerConfig.offline(tmp_path, "http://127.0.0.1:1/v1", request_timeout=-1),
        lambda: AppServerConfig.user(tmp_path, request_timeout=-1),
        lambda: attrs.evolve(appserver_config(), request_timeout=-1),
    ]
    for make in makers:
        with pytest.raises(InvalidAppServerConfig, match=r"AppServerConfig\.request_timeout"):
            make()
    assert not any(tmp_path.iterdir())


def test_every_bad_field_has_one_message_and_no_value_is_echoed() -> None:
    secret = "sk-" + "s3cret" * 6
    with pytest.raises(InvalidAppServerConfig) as raised:
        appserver_config(
            request_timeout=-1,
            interrupt_grace=-1,
            env={"OPENAI_API_KEY": secret.encode()},
            rust_log=object(),
            client_name=secret[:0],
        )
    problems = raised.value.problems
    assert [problem.split(":")[0] for problem in problems] == [
        "AppServerConfig.env",
        "AppServerConfig.rust_log",
        "AppServerConfig.client_name",
        "AppServerConfig.request_timeout",
        "AppServerConfig.interrupt_grace",
    ]
    assert str(raised.value) == "; ".join(problems)
    assert "s3cret" not in str(raised.value)
    assert "-1" not in str(raised.value)


BAD_PROVIDER_VALUES: list[tuple[str, Any]] = [
    ("base_url", "not a url"),
    ("base_url", "ftp://example.com/v1"),
    ("base_url", "http://"),
    ("base_url", "http://[::1/v1"),
    ("base_url", "http://example.com:99999/v1"),
    ("base_url", "http://exa mple.com/v1"),
    ("base_url", None),
    ("id", ""),
    ("id", None),
    ("name", 1),
    ("wire_api", "chat"),
    ("env_key", ""),
    ("env_key", "A=B"),
    ("request_max_retries", -1),
    ("request_max_retries", 1.5),
    ("stream_max_retries", -1),
    ("stream_max_retries", False),
    ("stream_idle_timeout_ms", 0),
    ("stream_idle_timeout_ms", 1.5),
    ("id", "offline-\ud800"),
    ("name", "\ud800"),
    ("env_key", "KEY\ud800"),
    ("request_max_retries", 2**70),
    ("stream_idle_timeout_ms", 2**63),
]


@pytest.mark.parametrize(("field", "value"), BAD_PROVIDER_VALUES)
def test_a_bad_model_provider_field_is_refused_at_construction(field: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"base_url": "http://127.0.0.1:1/v1", field: value}
    with pytest.raises(InvalidAppServerConfig) as raised:
        ModelProviderConfig(**kwargs)
    assert isinstance(raised.value, ValueError)
    assert raised.value.problems == (raised.value.problems[0],)
    assert raised.value.problems[0].startswith(f"ModelProviderConfig.{field}: ")


def test_a_base_url_with_credentials_is_never_echoed() -> None:
    with pytest.raises(InvalidAppServerConfig) as raised:
        ModelProviderConfig(base_url=SECRET_URL.replace("https", "gopher"))
    assert "secret" not in str(raised.value)
    assert "example.com" not in str(raised.value)
    with pytest.raises(InvalidAppServerConfig, match="base_url"):
        AppServerConfig.offline("/nonexistent/home", "not a url")


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"request_timeout": 0.001, "initialize_timeout": 1, "shutdown_timeout": 0.5},
        {"interrupt_grace": 0, "liveness_timeout": 0.3, "stderr_burst": 1},
        {"umask": None, "login_check": True, "model": None, "command": ("python3", "-u")},
        {"umask": 0, "codex_bin": "/usr/bin/codex", "home": Path("/h"), "env": {"A": ""}},
        {"approval_policy": "on-request", "sandbox_mode": "workspace-write"},
        {"auto_compact_token_limit": 1000, "rust_log": "debug", "compact_prompt": ""},
    ],
)
def test_good_appserver_configs_are_accepted(kwargs: dict[str, Any]) -> None:
    config = appserver_config(**kwargs)
    for name, value in kwargs.items():
        assert getattr(config, name) == value


def test_good_model_providers_are_accepted() -> None:
    for url in ("http://127.0.0.1:1/v1", "https://api.example.com", "HTTPS://[::1]:8080/v1"):
        assert ModelProviderConfig(base_url=url).base_url == url
    provider = ModelProviderConfig(
        base_url="https://x.example/v1",
        id=f"prov {EMOJI}",
        env_key="MY_KEY",
        request_max_retries=3,
        stream_max_retries=0,
        stream_idle_timeout_ms=1,
    )
    assert provider.table()["env_key"] == "MY_KEY"
