#!/usr/bin/env python3
"""Set up the project's virtual environment (once) and run the demo or the whole test suite.

    python3 dev.py demo    # the offline demo (real Codex binary, local stand-in model)
    python3 dev.py test    # ruff, mypy --strict, then pytest over the whole suite

Needs only Python 3.11+ with venv and pip. The environment lives in ``.venv`` and is reused:
it is (re)installed only when pyproject.toml changed since the last install.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / "python"
STAMP = VENV / ".codex-turn-installed"
EXTRAS = "codex,diagrams,test,dev"


def _run(*command: str | Path) -> int:
    print("+", " ".join(str(part) for part in command), flush=True)
    return subprocess.call([str(part) for part in command], cwd=ROOT)


def ensure_environment() -> None:
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest() + EXTRAS
    if PYTHON.exists() and STAMP.exists() and STAMP.read_text() == wanted:
        return
    if not PYTHON.exists():
        print(f"+ creating {VENV.name}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=False).create(VENV)
    pip = (PYTHON, "-m", "pip", "install", "--disable-pip-version-check", "-q")
    if _run(*pip, "-e", f".[{EXTRAS}]") != 0:
        sys.exit("installing the project failed")
    STAMP.write_text(wanted)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in {"demo", "test"}:
        print(__doc__, file=sys.stderr)
        return 2
    ensure_environment()
    if argv[0] == "demo":
        return _run(PYTHON, "-m", "codex_turn", "diagrams") or _run(
            PYTHON, "-m", "codex_turn", "demo"
        )
    for check in (
        (PYTHON, "-m", "ruff", "check", "."),
        (PYTHON, "-m", "mypy"),
    ):
        if _run(*check) != 0:
            return 1
    code = _run(PYTHON, "-m", "pytest")
    if code == 5:  # pytest ran no test: a defect, never a pass
        print("pytest collected no tests", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
