"""Loading an engine: a string is a spec, never "no engine".

:func:`load_engine` turns the one spec form ``"package.module:attribute"`` into an engine or
raises :class:`~.contract.EngineLoadError` (a ``ValueError``) naming the failed step;
:func:`resolve_engine` applies the right one to whatever a runner passed (a spec is loaded, an
object is checked by :func:`~.validation.check_engine`), and every turn and compaction calls it
first, before any I/O.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path
from typing import Any

from .contract import ContextEngine, EngineContractError, EngineLoadError
from .host import CODEX_HOST_CAPABILITIES, check_host_requirements
from .validation import check_engine, engine_info, is_active_engine, optional_method

__all__ = ["load_engine", "resolve_engine"]


def resolve_engine(
    engine: object | None,
    *,
    session_dir: str | os.PathLike[str] | None = None,
    host: frozenset[str] = CODEX_HOST_CAPABILITIES,
) -> object | None:
    """The engine a turn or a compaction runs with, checked before it starts.

    ``None`` stays ``None`` (no engine); a ``str`` is a spec, loaded by :func:`load_engine`
    (:class:`EngineLoadError` when it yields no engine); any other object must pass
    :func:`check_engine` (:class:`EngineContractError`). The legacy engine passes and is
    returned as it is: it is *no engine* for the lifecycle, but it is still an engine.
    ``session_dir``: the directory of the session a spec's factory is built for.
    An active engine whose ``info.host_requirements`` are not all in ``host`` (the host's
    capabilities) is refused with :class:`~.host.HostRequirementsUnmet`.
    """
    if engine is None:
        return None
    if isinstance(engine, str):
        engine = load_engine(engine, session_dir=session_dir)
    else:
        check_engine(engine)
    if is_active_engine(engine):
        info = engine_info(engine)
        check_host_requirements(info.id, info.host_requirements, host)
    return engine


def load_engine(spec: str, *, session_dir: str | os.PathLike[str] | None = None) -> ContextEngine:
    """Load an engine from its spec, ``"package.module:attribute"``.

    The one spec form (the CLI's ``--engine`` takes it too): the module's absolute dotted name,
    a colon, then the attribute's path in the module, which may be dotted
    (``"my_engines.memory:Holder.engine"``). There is no colon-less ``"module.attribute"``
    form: a spec without a colon is refused with a suggestion. The module is imported as
    Python's import finds it: on ``sys.path``, else in the current working directory (as
    ``python -m`` would), which is then appended to ``sys.path`` so that the module's own
    later imports resolve. The attribute may be

    * an engine instance: used as it is (every load of the spec shares it);
    * a class: instantiated (a new engine per load);
    * any other callable (a factory): called; it must return the engine itself, not an
      awaitable.

    A class or factory whose first parameter is a required positional one is called with
    ``session_dir``, the directory of the session it will serve, as a
    :class:`~pathlib.Path` (so that a durable engine can keep its store there, as the
    reference engine does); any other is called with no arguments. With such a parameter
    and no ``session_dir`` (a spec loaded for no session), loading fails.

    What it yields must pass :func:`check_engine`. Every failure raises
    :class:`EngineLoadError` (a ``ValueError``) whose one-line message names the failed step.
    """
    if not isinstance(spec, str):
        raise EngineLoadError(repr(spec), f"a spec is a string (got {type(spec).__name__})")
    module_name, attr_path = _parse_spec(spec)
    module = _import_module(spec, module_name)

    target: Any = module
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise EngineLoadError(spec, f"{module_name!r} has no attribute {attr_path!r}") from None
        except Exception as err:
            raise EngineLoadError(
                spec, f"reading {attr_path!r} failed: {type(err).__name__}: {err}"
            ) from err

    if isinstance(target, type) or (callable(target) and not _looks_like_engine(target)):
        args: tuple[Any, ...] = ()
        if _wants_a_directory(target):
            if session_dir is None:
                raise EngineLoadError(
                    spec, f"{attr_path!r} takes the session's directory, and there is no session"
                )
            args = (Path(session_dir),)
        try:
            target = target(*args)
        except Exception as err:
            raise EngineLoadError(
                spec, f"calling {attr_path!r} failed: {type(err).__name__}: {err}"
            ) from err
        if inspect.isawaitable(target):
            close = getattr(target, "close", None)
            if callable(close):
                close()  # a coroutine never awaited: no "never awaited" warning
            raise EngineLoadError(
                spec, f"calling {attr_path!r} returned an awaitable; a factory must be synchronous"
            )

    try:
        check_engine(target)
    except EngineContractError as err:
        raise EngineLoadError(
            spec, f"{type(target).__name__} is not a context engine: {'; '.join(err.problems)}"
        ) from None
    return target  # type: ignore[no-any-return]


def _parse_spec(spec: str) -> tuple[str, str]:
    module_name, sep, attr_path = (part.strip() for part in spec.partition(":"))
    expected = 'expected "package.module:attribute"'
    if not sep:
        head, dot, tail = spec.strip().rpartition(".")
        if dot and _dotted(head) and tail.isidentifier():
            expected += f' (did you mean "{head}:{tail}"?)'
        raise EngineLoadError(spec, expected)
    if module_name.startswith("."):
        raise EngineLoadError(spec, "relative module names are not supported; " + expected)
    if not _dotted(module_name) or not _dotted(attr_path):
        raise EngineLoadError(spec, expected)
    return module_name, attr_path


def _dotted(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def _import_module(spec: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if not _names_the_spec(err, module_name):
            # The module exists but imports something missing.
            raise EngineLoadError(spec, f"importing {module_name!r} failed: {err}") from err
        top = module_name.partition(".")[0]
        if err.name != top or _cwd_on_path():
            raise EngineLoadError(spec, f"no module named {module_name!r}") from err
    except Exception as err:
        raise EngineLoadError(
            spec, f"importing {module_name!r} failed: {type(err).__name__}: {err}"
        ) from err
    # Not on sys.path: the current directory, as ``python -m`` would search it.
    cwd = os.getcwd()
    sys.path.append(cwd)
    importlib.invalidate_caches()
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        sys.path.remove(cwd)
        if not _names_the_spec(err, module_name):
            raise EngineLoadError(spec, f"importing {module_name!r} failed: {err}") from err
        raise EngineLoadError(spec, f"no module named {module_name!r}") from err
    except Exception as err:
        sys.path.remove(cwd)
        raise EngineLoadError(
            spec, f"importing {module_name!r} failed: {type(err).__name__}: {err}"
        ) from err


def _names_the_spec(err: ModuleNotFoundError, module_name: str) -> bool:
    """True when the missing module is the spec's module or one of its packages."""
    return err.name is not None and (module_name + ".").startswith(err.name + ".")


def _cwd_on_path() -> bool:
    cwd = os.path.realpath(os.getcwd())
    return any(
        isinstance(entry, str) and os.path.realpath(entry or os.curdir) == cwd for entry in sys.path
    )


def _wants_a_directory(factory: Any) -> bool:
    """Whether ``factory`` (a class or a callable) has a required first positional
    parameter: then it is handed the session's directory."""
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: called with nothing
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return bool(parameters) and (
        parameters[0].kind in positional and parameters[0].default is inspect.Parameter.empty
    )


def _looks_like_engine(value: object) -> bool:
    return hasattr(value, "info") and optional_method(value, "assemble") is not None
