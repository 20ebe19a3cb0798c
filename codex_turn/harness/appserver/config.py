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

A private home never takes over a user's configuration. The config.toml written here starts
with :data:`CONFIG_MARKER`, and only a file starting with it is ever rewritten. A config.toml
without it (someone's settings, an ``mcp_servers`` table, ...), a config.toml that is not a
regular file, or a home that holds files but no config.toml (say ``~/.codex`` with just
``auth.json``) is refused with :class:`~.errors.CodexHomeNotPrivate`, before anything in the
home is written or re-permissioned. Refusing, rather than merging, is deliberate: a merged
file would carry the user's MCP servers and providers into a home that promises to be offline,
and rewriting their file would lose its comments and layout. The error says what to do
instead: a new or empty directory, or :meth:`AppServerConfig.user` on that home.

TOML is written by ``tomli-w`` (a maintained writer; :func:`render_toml` for config.toml,
:func:`toml_value` for the single-line values of ``-c`` overrides, :func:`override_args` for
the arguments), so any Unicode text, including characters outside the BMP, round-trips.

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

Size (~710 lines): most of it is the field-by-field validation of the two config records
(each field checked at construction, one message per bad field; the checks other records
share are in :mod:`codex_turn._checks`); the configs' own checks stay beside the records they
check, since a validator that moved away from its field would drift from it. The TOML
writing (``render_toml``, ``toml_value``, ``override_args``) is the seam to split along
when the file grows further.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import stat
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, get_args

import attrs
import tomli_w

from codex_turn._checks import (
    INT64_MAX,
    Check,
    at_least,
    flag,
    integer,
    positive_rate,
    seconds,
    validate,
)
from codex_turn._text import has_lone_surrogate, is_os_string
from codex_turn.harness._fs import (
    PRIVATE_DIR_MODE,
    PRIVATE_FILE_MODE,
    atomic_write,
    create_exclusive,
    is_write_temp,
    make_private_dirs,
)

from .defaults import INTERRUPT_GRACE_S, LIVENESS_TIMEOUT_S
from .errors import CodexBinaryMissing, CodexHomeNotPrivate, InvalidAppServerConfig
from .types import AskForApproval, SandboxMode

__all__ = [
    "AppServerConfig",
    "ModelProviderConfig",
    "bundled_codex_path",
    "bundled_path_dirs",
    "override_args",
    "render_toml",
    "toml_value",
]

OFFLINE_PROVIDER_ID = "offline"
CONFIG_FILE = "config.toml"
CONFIG_MARKER = "# codex-turn private config (AppServerConfig.offline)"
"""The first line of every config.toml this library writes: the file is ours to rewrite."""
#: ``thread_unload_delay_secs`` in a private config.toml (see :meth:`AppServerConfig.config_data`).
FORK_UNLOAD_DELAY_S: Final = 30
CONFIG_NOTE = "# Rewritten at every start of codex-turn: edits here are lost."
#: The temp files of earlier versions' config writes (``harness._fs`` names them now): an
#: interrupted one may still lie in a home, and does not make it a user's.
_LEGACY_TEMP_PREFIX = ".config.toml.codex-turn-"
PRIVATE_UMASK = 0o077


def bundled_codex_path() -> Path:
    """The pinned binary from ``openai-codex-cli-bin``; a clear error when it is missing."""
    try:
        import codex_cli_bin
    except ImportError as exc:  # tests shadow the package to exercise it
        raise CodexBinaryMissing() from exc
    return Path(codex_cli_bin.bundled_codex_path())


def bundled_path_dirs() -> list[Path]:
    """Directories holding the bundled ``rg`` (codex-path) and ``bwrap`` (codex-resources)."""
    try:
        import codex_cli_bin
    except ImportError:  # pragma: no cover
        return []
    path_dir = Path(codex_cli_bin.bundled_path_dir())
    return [d for d in (path_dir, path_dir.parent / "codex-resources") if d.is_dir()]


# --- validation (at construction) ------------------------------------------------------------
#
# Every field of both configs is checked when the config is built (``attrs.evolve`` included),
# each by one check (:mod:`codex_turn._checks`: the shared ones there, the configs' own below)
# that returns what the value must be, or ``None``. All bad fields are reported at once, each
# as ``Class.field: must ...``, never quoting the value: a URL can carry credentials, an
# environment value a key. What only TOML can tell (the content of ``extra_config`` and
# ``config_overrides``) is still checked when the config is written.
#
# What cannot be spawned or written is refused here too (:mod:`codex_turn._text`): a path or
# argument the OS cannot take (NUL, an unencodable character), text with a lone surrogate
# (config.toml and Codex take UTF-8; so does Codex's environment), an integer beyond the 64
# bits of TOML and Codex, a number of seconds too large to be a float.


def _text(*, optional: bool = False, blank: bool = False) -> Check:
    what = "must be a string" if blank else "must be a non-blank string"
    what += " without a lone surrogate" + (" or None" if optional else "")

    def check(value: Any) -> str | None:
        if value is None and optional:
            return None
        if isinstance(value, str) and (blank or value.strip()) and not has_lone_surrogate(value):
            return None
        return what

    return check


def _one_of(allowed: tuple[str, ...]) -> Check:
    what = f"must be one of {', '.join(repr(v) for v in allowed)}"

    def check(value: Any) -> str | None:
        return None if isinstance(value, str) and value in allowed else what

    return check


def _os_path(value: Any) -> bool:
    """A non-empty ``str`` path (or path-like giving one) the OS can take."""
    return (
        isinstance(value, str | os.PathLike)
        and is_os_string(value)
        and isinstance(os.fspath(value), str)
        and bool(os.fspath(value))
    )


def _path_like(*, optional: bool = False) -> Check:
    what = "must be a non-empty path without NUL" + (" or None" if optional else "")

    def check(value: Any) -> str | None:
        if (value is None and optional) or _os_path(value):
            return None
        return what

    return check


def _mapping(value: Any) -> str | None:
    return None if isinstance(value, Mapping) else "must be a mapping"


def _command(value: Any) -> str | None:
    if value is None:
        return None
    if (
        isinstance(value, tuple | list)
        and value
        and _os_path(value[0])
        and all(isinstance(arg, str | os.PathLike) and is_os_string(arg) for arg in value)
    ):
        return None
    return "must be None or a non-empty tuple of arguments (strings or paths, without NUL)"


def _env_text(text: Any) -> bool:
    # Codex reads its environment as UTF-8: no lone surrogate, even one the OS could encode.
    return isinstance(text, str) and is_os_string(text) and not has_lone_surrogate(text)


def _env_name(name: Any) -> bool:
    return _env_text(name) and bool(name) and "=" not in name


def _env(value: Any) -> str | None:
    if isinstance(value, Mapping) and all(
        _env_name(name) and _env_text(text) for name, text in value.items()
    ):
        return None
    return (
        "must map variable names (non-empty, without '=') to strings, "
        "all without NUL or a lone surrogate"
    )


def _env_value(value: Any) -> str | None:
    if value is None or _env_text(value):
        return None
    return "must be None or a string without NUL or a lone surrogate"


def _umask(value: Any) -> str | None:
    if value is None or (integer(value) and 0 <= value <= 0o777):
        return None
    return "must be None or an int from 0 to 0o777"


def _provider(value: Any) -> str | None:
    return (
        None
        if value is None or isinstance(value, ModelProviderConfig)
        else "must be a ModelProviderConfig or None"
    )


def _http_url(value: Any) -> str | None:
    what = "must be an http:// or https:// URL with a host (and a valid port, no whitespace)"
    if not isinstance(value, str) or not value.isprintable() or any(c.isspace() for c in value):
        return what
    try:
        url = urllib.parse.urlsplit(value)
        _ = url.port  # a ValueError when out of range or not a number
    except ValueError:
        return what
    if url.scheme.lower() not in ("http", "https") or not url.hostname:
        return what
    return None


def _env_key(value: Any) -> str | None:
    if value is None or _env_name(value):
        return None
    return (
        "must be None or an environment variable name "
        "(non-empty, without '=', NUL or a lone surrogate)"
    )


#: What Codex 0.163 accepts (its generated schema; ``wire_api = "chat"`` is refused).
_APPROVAL_POLICIES: Final = tuple(get_args(get_args(AskForApproval)[0]))
_SANDBOX_MODES: Final = tuple(get_args(SandboxMode))
_WIRE_APIS: Final = ("responses",)


@attrs.frozen
class ModelProviderConfig:
    """A ``[model_providers.<id>]`` table. No ``env_key`` means no Authorization header.

    Checked when built (:class:`~.errors.InvalidAppServerConfig`): ``base_url`` an http(s)
    URL, ``wire_api`` ``"responses"`` (the only one Codex 0.163 accepts), ``env_key`` a
    variable name, retries ``>= 0``, ``stream_idle_timeout_ms`` ``> 0``."""

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

    def __attrs_post_init__(self) -> None:
        validate(self, _PROVIDER_CHECKS, InvalidAppServerConfig)


_PROVIDER_CHECKS: Final[dict[str, Check]] = {
    "base_url": _http_url,
    "id": _text(),
    "name": _text(),
    "wire_api": _one_of(_WIRE_APIS),
    "env_key": _env_key,
    "request_max_retries": at_least(0),
    "stream_max_retries": at_least(0),
    "stream_idle_timeout_ms": at_least(1, optional=True),
}


def _path(value: str | os.PathLike[str]) -> Path:
    # Anything else (None, an empty string, NUL) is left for the check to report, by name.
    if _os_path(value):
        return Path(value)
    return value  # type: ignore[return-value]


@attrs.frozen(kw_only=True)
class AppServerConfig:
    """Everything needed to spawn and talk to one app-server process.

    ``command`` replaces the whole argv (tests use it to run a tiny fake server script);
    otherwise the bundled binary (or ``codex_bin``) is run as ``codex app-server``.

    ``interrupt_grace``: how long an abandoned turn (cancelled, timed out) may take to be
    acknowledged after its ``turn/interrupt``. ``liveness_timeout``: how long a process that
    missed a deadline has to show a sign of life before it is declared dead and replaced
    (see :mod:`.connection`). ``umask``: the child's umask (``None``: the parent's; see the module
    header). ``log_stderr_text``: Codex's stderr is logged
    as counts and levels only (``appserver.stderr`` at debug, with ``codex_level`` and ``chars``);
    set this to also log each line's (secret-scrubbed, truncated) text. Off by default: with
    ``RUST_LOG`` set, Codex traces request and tool content there, outside any turn's
    redaction context.

    ``login_check``: ask the started process whether it needs an OpenAI login it lacks, and
    fail in seconds with :class:`~.errors.CodexLoginRequired` (see :mod:`.account`).
    ``None``: for every process spawned from the real binary, not for injected transports
    or a ``command`` replacement (test doubles).

    ``config_overrides`` become ``-c key=value`` arguments (:func:`override_args`);
    ``extra_config`` is merged into a private home's config.toml.

    Every field is checked when the config is built, :meth:`offline`, :meth:`user` and
    ``attrs.evolve`` included: a wrong type or value raises
    :class:`~.errors.InvalidAppServerConfig` (a ``ValueError``) naming each bad field, never
    its value. Timeouts are positive and finite, ``interrupt_grace`` non-negative and finite,
    ``umask`` ``0..0o777``, ``approval_policy`` and ``sandbox_mode`` values Codex accepts.
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
    login_check: bool | None = None

    def __attrs_post_init__(self) -> None:
        validate(self, _APPSERVER_CHECKS, InvalidAppServerConfig)

    @classmethod
    def offline(
        cls,
        codex_home: str | os.PathLike[str],
        base_url: str,
        **kwargs: Any,
    ) -> AppServerConfig:
        """A private, offline-safe home whose only model is ``base_url`` (the offline model).

        ``codex_home`` must be new, empty, or a home this library prepared before: a user's
        configuration there is refused, never overwritten (see :meth:`claim_home`)."""
        provider = kwargs.pop("provider", None) or ModelProviderConfig(base_url=base_url)
        return cls(codex_home=codex_home, provider=provider, **kwargs)

    @classmethod
    def user(
        cls, codex_home: str | os.PathLike[str] | None = None, **kwargs: Any
    ) -> AppServerConfig:
        """The user's own Codex configuration (``$CODEX_HOME`` or ``~/.codex``), unmodified."""
        home = codex_home or os.environ.get("CODEX_HOME") or Path.home() / ".codex"
        kwargs.setdefault("model", None)
        kwargs.setdefault("umask", None)  # the user's own conventions, not ours
        return cls(codex_home=home, write_config=False, **kwargs)

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
        # Codex unloads a thread this long after its last subscriber left. Structured turns
        # run in ephemeral forks (~1.5 MB each) that can only be released that way
        # (``thread/unsubscribe`` after the turn; see harness.structured): bound threads stay
        # subscribed and are not affected.
        data["thread_unload_delay_secs"] = FORK_UNLOAD_DELAY_S
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

    def config_text(self) -> str:
        """The private config.toml: :data:`CONFIG_MARKER` (how a later start recognises the
        file as its own), then :meth:`config_data` as TOML."""
        return f"{CONFIG_MARKER}\n{CONFIG_NOTE}\n\n{render_toml(self.config_data())}"

    def write(self) -> Path | None:
        """Create CODEX_HOME and write config.toml (private mode); return its path.

        A private home is claimed first (:meth:`claim_home`): a config.toml that codex-turn
        did not write is never overwritten, a home holding anything else is never written
        into (:class:`~.errors.CodexHomeNotPrivate`). Our own config.toml is replaced
        atomically (:func:`~codex_turn.harness._fs.atomic_write`); a new one is created
        exclusively (:func:`~codex_turn.harness._fs.create_exclusive`), so a file that appeared
        meanwhile is not clobbered. Then the home is made owner-only (see the module header); a user
        home is only created when missing (``0700``), never written or re-permissioned.
        Raises ``OSError``, and ``TypeError``/``ValueError`` for a value TOML cannot hold
        (before anything is written)."""
        if not self.write_config:
            make_private_dirs(self.codex_home)
            return None
        text = self.config_text()
        make_private_dirs(self.codex_home)
        ours = self.claim_home()
        self.restrict_home()
        path = self.codex_home / CONFIG_FILE
        # Written owner-only (never briefly readable) under a temporary name, then moved in.
        data = text.encode("utf-8")
        if not ours:
            if create_exclusive(os.fspath(path), data, mode=PRIVATE_FILE_MODE):
                return path
            ours = self.claim_home()  # created meanwhile: ours (a concurrent start) or refused
        if ours:
            atomic_write(path, data, mode=PRIVATE_FILE_MODE)
        return path

    def claim_home(self) -> bool:
        """Check that CODEX_HOME may hold this library's private config; ``True`` when its
        config.toml is already ours (to be rewritten), ``False`` when the home is new or
        empty (leftover temporary files of an interrupted write do not count).

        Refused with :class:`~.errors.CodexHomeNotPrivate`: a ``config.toml`` without
        :data:`CONFIG_MARKER` as its first line (a user's configuration: never overwritten,
        merged or re-permissioned), a ``config.toml`` that is not a regular file (a symlink
        could point anywhere), and a home that holds other files but no config.toml (a user
        home, e.g. with only ``auth.json``: writing a config there would change what their
        own ``codex`` runs). Only names are reported, never file content."""
        path = self.codex_home / CONFIG_FILE
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            others = sorted(
                name
                for name in os.listdir(self.codex_home)
                if not (name.startswith(_LEGACY_TEMP_PREFIX) or is_write_temp(name, CONFIG_FILE))
            )
            if others:
                shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
                raise CodexHomeNotPrivate(
                    self.codex_home, f"it holds files ({shown}) but no codex-turn config.toml"
                ) from None
            return False
        if not stat.S_ISREG(info.st_mode):
            raise CodexHomeNotPrivate(self.codex_home, "its config.toml is not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with open(fd, "rb") as file:
            head = file.read(len(CONFIG_MARKER) + 2)
        if head.splitlines()[:1] != [CONFIG_MARKER.encode()]:
            raise CodexHomeNotPrivate(
                self.codex_home, "it holds a config.toml that codex-turn did not write"
            )
        return True

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
        return [*argv, *override_args(self.config_overrides)]

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


_APPSERVER_CHECKS: Final[dict[str, Check]] = {
    "codex_home": _path_like(),
    "write_config": flag(),
    "provider": _provider,
    "model": _text(optional=True),
    "approval_policy": _one_of(_APPROVAL_POLICIES),
    "sandbox_mode": _one_of(_SANDBOX_MODES),
    "compact_prompt": _text(optional=True, blank=True),
    "auto_compact_token_limit": at_least(1, optional=True),
    "extra_config": _mapping,
    "config_overrides": _mapping,
    "codex_bin": _path_like(optional=True),
    "command": _command,
    "home": _path_like(optional=True),
    "env": _env,
    "inherit_env": flag(),
    "rust_log": _env_value,
    "client_name": _text(),
    "client_title": _text(),
    "client_version": _text(),
    "experimental_api": flag(),
    "request_timeout": seconds(),
    "initialize_timeout": seconds(),
    "shutdown_timeout": seconds(),
    "stderr_lines_per_second": positive_rate,
    "stderr_burst": at_least(1),
    "log_stderr_text": flag(),
    "interrupt_grace": seconds(positive=False),
    "liveness_timeout": seconds(),
    "umask": _umask,
    "login_check": flag(optional=True),
}


def _deep_merge(into: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value


# -- TOML ------------------------------------------------------------------------------
#
# tomli-w renders every scalar, string and key (the escaping is where a hand-written writer
# goes wrong: characters outside the BMP, control characters); the only structure built here
# is the inline form that ``-c`` needs, ``[a, b]`` and ``{k = v}``, around its output.

_INT64_MIN, _INT64_MAX = -(2**63), INT64_MAX  # TOML's integers, and Codex's
_SCALARS = (bool, int, float, str, datetime.date, datetime.time)


def _plain(value: Any, where: str) -> Any:
    """``value`` as the types tomli-w writes (dict, list, scalars), checked for what TOML
    (and Codex, whose integers are 64-bit) can hold. Raises ``TypeError``/``ValueError``
    naming ``where`` (a key path), never quoting the value."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, bytes | bytearray):
        raise TypeError(f"{where}: bytes cannot be written as TOML (decode them first)")
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"{where}: integer out of TOML's 64-bit range")
        return value
    if isinstance(value, str):
        _check_unicode(value, where)
        return value
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, Mapping):
        plain: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: TOML keys are strings, got {type(key).__name__}")
            _check_unicode(key, where)
            plain[key] = _plain(item, f"{where}.{key}" if where else key)
        return plain
    if isinstance(value, list | tuple):
        return [_plain(item, f"{where}[{index}]") for index, item in enumerate(value)]
    what = "None (TOML has no null)" if value is None else type(value).__name__
    raise TypeError(f"{where or 'value'}: cannot write {what} as TOML")


def _check_unicode(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"{where or 'value'}: text holds a lone surrogate, which is not valid Unicode"
        ) from None


def render_toml(data: Mapping[str, Any]) -> str:
    """``data`` as a TOML document (tomli-w): scalars first, then nested tables.

    Raises ``TypeError``/``ValueError`` for what TOML cannot hold (``None``, bytes, a lone
    surrogate, an integer beyond 64 bits)."""
    return tomli_w.dumps(_plain(data, ""))


def toml_value(value: Any) -> str:
    """``value`` as one single-line TOML value (inline tables and arrays), the form a
    ``-c key=value`` override needs: Codex parses it as ``_x_ = <value>``."""
    return _inline(_plain(value, "value"))


def _inline(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_inline(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    return tomli_w.dumps({"v": value}).removeprefix("v = ").removesuffix("\n")


def _toml_key(key: str) -> str:
    return tomli_w.dumps({key: 0}).removesuffix(" = 0\n")


_OVERRIDE_SEGMENT_BAD = re.compile(r"[=.\x00-\x1f\x7f]")


def override_args(overrides: Mapping[str, Any]) -> list[str]:
    """``-c key=value`` arguments for ``codex app-server``.

    Codex splits each at the first ``=``, splits the key on ``.`` (segments are taken
    literally: no TOML quoting), and parses the value as TOML; a value that does not parse is
    silently taken as a *string*, so every value here is rendered by :func:`toml_value`. A key
    is a dotted path whose segments are non-empty, hold no ``=``, ``.`` or control character
    and no surrounding whitespace; anything else raises ``ValueError``. A mapping value
    replaces the whole table at that key (as an inline table), like Codex's own ``-c``."""
    argv: list[str] = []
    for key, value in overrides.items():
        if not isinstance(key, str):
            raise TypeError(f"config override keys are strings, got {type(key).__name__}")
        _check_unicode(key, "config override key")
        for segment in key.split("."):
            if not segment or segment != segment.strip() or _OVERRIDE_SEGMENT_BAD.search(segment):
                raise ValueError(
                    f"config override key {key!r}: a dotted path of non-empty segments "
                    "without '=', control characters or surrounding whitespace"
                )
        argv += ["-c", f"{key}={_inline(_plain(value, key))}"]
    return argv
