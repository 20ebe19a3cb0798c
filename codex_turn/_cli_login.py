"""``codex-turn login`` and ``codex-turn logout``: the pinned binary's own login, from here.

The pinned Codex binary (the ``codex`` extra) is not on ``PATH``, so ``codex login`` is not a
command a user of this package can type. These commands run that binary's ``login`` and
``logout`` (the binary :func:`~codex_turn._cli_support.codex_binary` finds, the one the
app-server runs) against the Codex home a turn uses (``--codex-home``, else
``$CODEX_HOME``, else ``~/.codex``), so what they store is what a turn finds:

* ``login``: ChatGPT by a device code (``codex login --device-auth``: a URL and a code to
  enter in a browser, on any machine); ``--with-api-key`` an API key, read from stdin (on a
  terminal, asked without echo) and handed to ``codex login --with-api-key`` on its stdin;
* ``logout``: ``codex logout`` (removes the stored credentials).

Codex writes ``auth.json`` into the home; the child runs under umask 077, so what it creates
is owner-only. The key is never printed or logged: it is registered as a sensitive value
(:func:`codex_turn._log.sensitive`) while the binary runs, and every line the binary prints
reaches the terminal through the scrubber every line of the command goes through
(:func:`~codex_turn._cli_support.stderr_note`). ``codex-turn doctor`` reports the login state
as a turn checks it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from codex_turn._cli_support import (
    EXIT_OK,
    CliError,
    UsageError,
    add_codex_bin_option,
    codex_binary,
    stderr_note,
    user_codex_home,
)

__all__ = ["LoginFailed", "add_login_parsers", "login_command", "logout_command"]

#: What the login child may create is owner-only (auth.json holds a credential).
_PRIVATE_UMASK = 0o077


class LoginFailed(CliError):
    """The binary's login did not complete (exit 4: Codex still needs a login)."""


def add_login_parsers(sub: Any) -> None:
    """The ``login`` and ``logout`` commands (``sub`` makes a command's parser)."""
    login = sub(
        "login",
        "log Codex in (the pinned binary's `codex login`): device code, or an API key",
        "Log the Codex home a turn uses in, with the pinned binary's own login: ChatGPT by a "
        "device code (open the URL it prints, enter the code), or with --with-api-key an "
        "OpenAI API key read from stdin (asked without echo on a terminal), e.g. `printenv "
        "OPENAI_API_KEY | codex-turn login --with-api-key`. Codex stores the credential in "
        "auth.json in that home (owner-only). `codex-turn doctor` shows the login state.",
    )
    _home_option(login)
    login.add_argument(
        "--with-api-key",
        action="store_true",
        help="read an OpenAI API key from stdin instead of the device-code login",
    )
    add_codex_bin_option(login)
    logout = sub(
        "logout",
        "remove the stored Codex credentials (the pinned binary's `codex logout`)",
        "Remove the credentials Codex stored in the Codex home a turn uses.",
    )
    _home_option(logout)
    add_codex_bin_option(logout)


def _home_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--codex-home",
        metavar="DIR",
        help="the Codex home, an existing directory (default: $CODEX_HOME, else ~/.codex, "
        "created by Codex when missing)",
    )


def login_command(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    binary = codex_binary(args.codex_bin)
    home = user_codex_home(args.codex_home)
    if not args.with_api_key:
        _run_codex(binary, ["login", "--device-auth"], home, args, err)
    else:
        key = _read_key()
        from codex_turn._log import sensitive

        with sensitive(key):  # masked in every line printed while the binary runs
            _run_codex(binary, ["login", "--with-api-key"], home, args, err, stdin=key + "\n")
    print(f"logged in: Codex home {home}", file=out)
    return EXIT_OK


def logout_command(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    binary = codex_binary(args.codex_bin)
    home = user_codex_home(args.codex_home)
    _run_codex(binary, ["logout"], home, args, err)
    print(f"logged out: Codex home {home}", file=out)
    return EXIT_OK


def _read_key() -> str:
    """The API key: from stdin, or asked without echo on a terminal. Never printed."""
    if sys.stdin.isatty():
        import getpass

        key = getpass.getpass("OpenAI API key (not shown): ")  # asks on the terminal itself
    else:
        key = sys.stdin.read()
    key = key.strip()
    if not key:
        raise UsageError("nothing on stdin (--with-api-key reads the API key from there)")
    if any(ch.isspace() or not ch.isprintable() for ch in key):
        raise UsageError("the API key on stdin is not one line of text (--with-api-key)")
    return key


def _run_codex(
    binary: Path,
    command: Sequence[str],
    home: Path,
    args: argparse.Namespace,
    err: IO[str],
    *,
    stdin: str | None = None,
) -> None:
    """Run ``binary COMMAND`` with ``CODEX_HOME=home``; each line it prints goes to stderr
    through the scrubber, as it comes (the device code must show while Codex waits). A
    non-zero exit raises :class:`LoginFailed` with Codex's last line."""
    json_lines = args.log_format == "json"
    env = {**os.environ, "CODEX_HOME": str(home)}
    with subprocess.Popen(  # noqa: S603 - our own pinned binary, no shell
        [str(binary), *command],
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        errors="replace",
        umask=_PRIVATE_UMASK,
    ) as child:
        last = ""
        try:
            if stdin is not None:
                assert child.stdin is not None
                child.stdin.write(stdin)
                child.stdin.close()
            assert child.stdout is not None
            for raw in child.stdout:
                line = raw.rstrip()
                if line:
                    last = line
                    stderr_note(err, f"codex: {line}", json_lines=json_lines, event="codex")
        except BaseException:
            child.kill()  # Ctrl-C: the login is abandoned, not left running
            raise
    if child.returncode != 0:
        what = " ".join(command[:1])
        raise LoginFailed(
            f"codex {what} failed (exit {child.returncode})" + (f": {last}" if last else "")
        )
