"""How one ``codex app-server`` process is configured: CODEX_HOME, config.toml, argv and env.

Codex reads its configuration from ``$CODEX_HOME/config.toml``. There are two modes:

* **Private home** (the default, and the only mode the tests and the demo use): this module
  writes a complete, offline-safe ``config.toml`` into a CODEX_HOME owned by this process.
  ``features.plugins = false`` is the key that matters: with plugins on, the app-server starts
  background ``git ls-remote``/GitHub/chatgpt.com calls at startup. Analytics, feedback and the
  update check are off too, and the model provider is explicit (with retries at 0, so a model
  failure costs exactly one HTTP call).
* **User home** (:meth:`AppServerConfig.user`): the user's own Codex config is used as is, for
  real runs; nothing is written, and ``config_overrides`` become ``-c key=value`` arguments.

A private home holds conversations (rollouts and sqlite state carry every prompt), so it is
owner-only: the directory is made ``0700`` (also when it already existed: the library owns
it), ``config.toml`` is ``0600``, and the child starts with ``umask 0o077``
(:attr:`AppServerConfig.umask`) so that everything Codex writes there is owner-only too.
Codex sets a few modes explicitly, which no umask prevents (``installation_id`` is made
``0644`` at every start), so :meth:`AppServerConfig.restrict_home` also strips group and
other bits from the entries directly in the home, before the spawn and again once the
process is initialised (:mod:`.client`); deeper files (rollouts, shell snapshots) follow the
umask. The umask is inherited by the tools Codex runs, so files they create in the workspace
are owner-only as well; set ``umask=None`` to keep the parent's. The user's own home is
never re-permissioned and its child keeps the parent's umask (``user()`` sets
``umask=None``); a user home the library has to create is created ``0700``.

The environment puts the bundled ``rg`` and ``bwrap`` directories first on ``PATH`` (without
``bwrap``, Codex warns on every start) and leaves ``RUST_LOG`` unset unless asked (stderr then
stays nearly silent).

Never start two processes at the same moment on one *fresh* CODEX_HOME: Codex initialises a
sqlite state database there, and concurrent first starts fail. One home per process, or a
home that one process has already initialised, is fine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from .defaults import INTERRUPT_GRACE_S, LIVENESS_TIMEOUT_S

__all__ = [
    "AppServerConfig",
    "ModelProviderConfig",
    "bundled_codex_path",
    "bundled_path_dirs",
    "render_toml",
]

OFFLINE_PROVIDER_ID = "offline"
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
PRIVATE_UMASK = 0o077


def bundled_codex_path() -> Path:
    """The pinned binary from ``openai-codex-cli-bin``; a clear error when it is missing."""
    try:
        import codex_cli_bin
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise FileNotFoundError(
            "the Codex binary is not installed: pip install 'codex-turn[codex]' "
            "(openai-codex-cli-bin==0.163.0)"
        ) from exc
    return Path(codex_cli_bin.bundled_codex_path())


def bundled_path_dirs() -> list[Path]:
    """Directories holding the bundled ``rg`` (codex-path) and ``bwrap`` (codex-resources)."""
    try:
        import codex_cli_bin
    except ImportError:  # pragma: no cover
        return []
    path_dir = Path(codex_cli_bin.bundled_path_dir())
    return [d for d in (path_dir, path_dir.parent / "codex-resources") if d.is_dir()]


@attrs.frozen
class ModelProviderConfig:
    """A ``[model_providers.<id>]`` table. No ``env_key`` means no Authorization header."""

    base_url: str
    id: str = OFFLINE_PROVIDER_ID
    name: str = "codex-turn offline model"
    wire_api: str = "responses"
    env_key: str | None = None
    request_max_retries: int = 0
    stream_max_retries: int = 0
    stream_idle_timeout_ms: int | None = None

    def table(self) -> dict[str, Any]:
        table: dict[str, Any] = {
            "name": self.name,
            "base_url": self.base_url,
            "wire_api": self.wire_api,
            "request_max_retries": self.request_max_retries,
            "stream_max_retries": self.stream_max_retries,
        }
        if self.env_key is not None:
            table["env_key"] = self.env_key
        if self.stream_idle_timeout_ms is not None:
            table["stream_idle_timeout_ms"] = self.stream_idle_timeout_ms
        return table


def _path(value: str | os.PathLike[str]) -> Path:
    return Path(value)


@attrs.frozen(kw_only=True)
class AppServerConfig:
    """Everything needed to spawn and talk to one app-server process.

    ``command`` replaces the whole argv (tests use it to run a tiny fake server script);
    otherwise the bundled binary (or ``codex_bin``) is run as ``codex app-server``.

    ``interrupt_grace``: how long an abandoned turn (cancelled, timed out) may take to be
    acknowledged after its ``turn/interrupt``. ``liveness_timeout``: how long a process that
    missed a deadline has to show a sign of life before it is declared dead and replaced
    (see :mod:`.client`). ``umask``: the child's umask (``None``: the parent's; see the module
    header). ``log_stderr_text``: Codex's stderr is logged
    as counts and levels only (``appserver.stderr`` at debug, with ``level`` and ``chars``);
    set this to also log each line's (secret-scrubbed, truncated) text. Off by default: with
    ``RUST_LOG`` set, Codex traces request and tool content there, outside any turn's
    redaction context.
    """

    codex_home: Path = attrs.field(converter=_path)
    write_config: bool = True
    provider: ModelProviderConfig | None = None
    model: str | None = "mock-model"
    approval_policy: str = "never"
    sandbox_mode: str = "read-only"
    compact_prompt: str | None = None
    auto_compact_token_limit: int | None = None
    extra_config: Mapping[str, Any] = attrs.field(factory=dict)
    config_overrides: Mapping[str, Any] = attrs.field(factory=dict)
    codex_bin: Path | None = None
    command: tuple[str, ...] | None = None
    home: Path | None = None
    env: Mapping[str, str] = attrs.field(factory=dict)
    inherit_env: bool = True
    rust_log: str | None = None
    client_name: str = "codex_turn"
    client_title: str = "codex-turn"
    client_version: str = "0.1.0"
    experimental_api: bool = True
    request_timeout: float = 60.0
    initialize_timeout: float = 30.0
    shutdown_timeout: float = 5.0
    stderr_lines_per_second: float = 20.0
    stderr_burst: int = 50
    log_stderr_text: bool = False
    interrupt_grace: float = INTERRUPT_GRACE_S
    liveness_timeout: float = LIVENESS_TIMEOUT_S
    umask: int | None = PRIVATE_UMASK

    @classmethod
    def offline(
        cls,
        codex_home: str | os.PathLike[str],
        base_url: str,
        **kwargs: Any,
    ) -> AppServerConfig:
        """A private, offline-safe home whose only model is ``base_url`` (the offline model)."""
        provider = kwargs.pop("provider", None) or ModelProviderConfig(base_url=base_url)
        return cls(codex_home=Path(codex_home), provider=provider, **kwargs)

    @classmethod
    def user(
        cls, codex_home: str | os.PathLike[str] | None = None, **kwargs: Any
    ) -> AppServerConfig:
        """The user's own Codex configuration (``$CODEX_HOME`` or ``~/.codex``), unmodified."""
        home = codex_home or os.environ.get("CODEX_HOME") or Path.home() / ".codex"
        kwargs.setdefault("model", None)
        kwargs.setdefault("umask", None)  # the user's own conventions, not ours
        return cls(codex_home=Path(home), write_config=False, **kwargs)

    # -- config.toml -------------------------------------------------------------------

    def config_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if self.model is not None:
            data["model"] = self.model
        if self.provider is not None:
            data["model_provider"] = self.provider.id
        data["approval_policy"] = self.approval_policy
        data["sandbox_mode"] = self.sandbox_mode
        data["check_for_update_on_startup"] = False
        data["web_search"] = "disabled"
        if self.compact_prompt is not None:
            data["compact_prompt"] = self.compact_prompt
        if self.auto_compact_token_limit is not None:
            data["model_auto_compact_token_limit"] = self.auto_compact_token_limit
        data["analytics"] = {"enabled": False}
        data["feedback"] = {"enabled": False}
        data["features"] = {
            "plugins": False,
            "remote_plugin": False,
            "apps": False,
            "tool_suggest": False,
        }
        if self.provider is not None:
            data["model_providers"] = {self.provider.id: self.provider.table()}
        _deep_merge(data, self.extra_config)
        # The offline guarantee is not negotiable in a private home.
        data["features"]["plugins"] = False
        return data

    def write(self) -> Path | None:
        """Create CODEX_HOME and write config.toml (private mode); return its path.

        A private home is made owner-only (see the module header); a user home is only
        created when missing (``0700``), never re-permissioned."""
        self.codex_home.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        if not self.write_config:
            return None
        self.restrict_home()
        path = self.codex_home / "config.toml"
        # Created owner-only (never briefly readable), and tightened if it existed.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
        with open(fd, "w", encoding="utf-8") as file:
            os.fchmod(file.fileno(), PRIVATE_FILE_MODE)
            file.write(render_toml(self.config_data()))
        return path

    def restrict_home(self) -> None:
        """Make a private home owner-only: the home ``0700``, and group and other bits
        stripped from each entry directly in it (see the module header). A user home is
        never touched. Raises ``OSError``."""
        if not self.write_config:
            return
        self.codex_home.chmod(PRIVATE_DIR_MODE)
        with os.scandir(self.codex_home) as entries:
            for entry in entries:
                with contextlib.suppress(FileNotFoundError):  # raced with Codex removing it
                    if entry.is_symlink():
                        continue  # chmod would follow it out of the home
                    mode = stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)
                    if mode & ~PRIVATE_DIR_MODE:
                        os.chmod(entry.path, mode & PRIVATE_DIR_MODE)

    # -- process -----------------------------------------------------------------------

    def argv(self) -> list[str]:
        if self.command is not None:
            return list(self.command)
        binary = self.codex_bin or bundled_codex_path()
        argv = [str(binary), "app-server"]
        for key, value in self.config_overrides.items():
            argv += ["-c", f"{key}={_toml_value(value)}"]
        return argv

    def environment(self) -> dict[str, str]:
        env = dict(os.environ) if self.inherit_env else {}
        env.pop("RUST_LOG", None)
        env["CODEX_HOME"] = str(self.codex_home)
        if self.home is not None:
            env["HOME"] = str(self.home)
        path = [str(d) for d in bundled_path_dirs()]
        existing = env.get("PATH") or os.defpath
        env["PATH"] = os.pathsep.join([*path, existing])
        if self.rust_log is not None:
            env["RUST_LOG"] = self.rust_log
        env.update(self.env)
        return env


def _deep_merge(into: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | os.PathLike):
        # JSON string escapes are a subset of TOML basic-string escapes.
        return json.dumps(os.fspath(value))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot render {type(value).__name__} as TOML")


def render_toml(data: Mapping[str, Any]) -> str:
    """A small TOML writer for config.toml: scalars first, then nested tables."""
    lines: list[str] = []
    _render_table(data, [], lines)
    return "\n".join(lines).strip() + "\n"


def _render_table(data: Mapping[str, Any], path: list[str], lines: list[str]) -> None:
    tables = []
    if path:
        lines.append("")
        lines.append("[" + ".".join(_key(p) for p in path) + "]")
    for key, value in data.items():
        if isinstance(value, Mapping):
            tables.append((key, value))
        else:
            lines.append(f"{_key(key)} = {_toml_value(value)}")
    for key, value in tables:
        _render_table(value, [*path, key], lines)
