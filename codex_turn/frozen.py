"""Read-only messages: what a context engine is handed cannot reach the harness's shared state.

The transcript's messages are read once per change of the file and kept (the read cache, the
per-session stripped history), so every turn can hand an engine the whole history at no cost
proportional to it. An engine that edited those dicts in place would edit the process-wide
copy, and its edits would compound on every later turn although the file never changed.

:func:`freeze` turns a JSON value into one that refuses every mutation (``FrozenDict``,
``FrozenList``: subclasses of ``dict`` and ``list``, so ``isinstance`` checks, ``json.dumps``
and reads behave as before) and is done once per *new* message. An engine that wants to edit
takes a copy: ``copy.deepcopy(message)``, ``copy.copy(message)`` and ``thaw(message)`` give
plain, mutable ``dict``/``list`` values. A mutation attempt raises :class:`TypeError`, which
the lifecycle maps to the stage's failure edge like any other engine error.

Both walks are iterative (an explicit stack, not recursion): a message nested deeper than
Python's recursion limit is copied like any other, so it cannot break the stage that freezes
the history on every later turn. A container met twice in one value (shared, or containing
itself) is copied once, as :func:`copy.deepcopy` does.
"""

from __future__ import annotations

from typing import Any, Final, NoReturn

__all__ = ["FrozenDict", "FrozenList", "freeze", "thaw"]

_MESSAGE = "messages handed to a context engine are read-only; copy one before changing it"


def _refuse(*_args: Any, **_kwargs: Any) -> NoReturn:
    raise TypeError(_MESSAGE)


class FrozenDict(dict[str, Any]):
    """A ``dict`` that refuses mutation (see the module docstring)."""

    __slots__ = ()
    __setitem__ = __delitem__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse
    __ior__ = _refuse

    def __copy__(self) -> dict[str, Any]:
        return dict(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        thawed: dict[str, Any] = thaw(self)
        return thawed

    def __reduce__(self) -> tuple[Any, ...]:
        return (freeze, (thaw(self),))


class FrozenList(list[Any]):
    """A ``list`` that refuses mutation (see the module docstring)."""

    __slots__ = ()
    __setitem__ = __delitem__ = _refuse
    append = extend = insert = pop = remove = reverse = sort = clear = _refuse
    __iadd__ = __imul__ = _refuse

    def __copy__(self) -> list[Any]:
        return list(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        thawed: list[Any] = thaw(self)
        return thawed

    def __reduce__(self) -> tuple[Any, ...]:
        return (freeze, (thaw(self),))


def freeze(value: Any) -> Any:
    """``value`` with every ``dict`` and ``list`` in it replaced by a read-only copy (a frozen
    one in it is kept as is). Iterative: no depth of nesting raises :class:`RecursionError`."""
    return _copy(value, frozen=True)


def thaw(value: Any) -> Any:
    """A plain, mutable deep copy of a (frozen or not) JSON value. Iterative, like
    :func:`freeze`."""
    return _copy(value, frozen=False)


_CONTAINERS: Final = (dict, list)


def _copy(value: Any, *, frozen: bool) -> Any:
    # Each container's copy is made empty, then filled through the base class (the frozen
    # classes refuse their own mutators), top-down from an explicit stack.
    root = _empty(value, frozen)
    if root is value:
        return value
    copies: dict[int, Any] = {id(value): root}
    pending: list[tuple[Any, Any]] = [(value, root)]
    while pending:
        source, target = pending.pop()
        if isinstance(source, dict):
            filled = {
                key: _child(item, frozen, copies, pending)
                if isinstance(item, _CONTAINERS)
                else item
                for key, item in source.items()
            }
            dict.update(target, filled)
        else:
            list.extend(
                target,
                [
                    _child(item, frozen, copies, pending) if isinstance(item, _CONTAINERS) else item
                    for item in source
                ],
            )
    return root


def _child(item: Any, frozen: bool, copies: dict[int, Any], pending: list[tuple[Any, Any]]) -> Any:
    copy = copies.get(id(item))
    if copy is None:
        copy = _empty(item, frozen)
        if copy is not item:
            copies[id(item)] = copy
            pending.append((item, copy))
    return copy


def _empty(value: Any, frozen: bool) -> Any:
    """An empty copy of a container ``value`` (``value`` itself when it is not one, or when it
    is frozen already and ``frozen`` copies are asked for)."""
    if frozen and isinstance(value, FrozenDict | FrozenList):
        return value
    if isinstance(value, dict):
        return FrozenDict() if frozen else {}
    if isinstance(value, list):
        return FrozenList() if frozen else []
    return value
