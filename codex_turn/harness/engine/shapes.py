"""The contract's records as OpenClaw's camelCase JSON: one strict converter.

One module-level cattrs :data:`converter` maps every attrs class of :mod:`.contract` to and
from OpenClaw's camelCase JSON (``estimated_tokens`` <-> ``estimatedTokens``). Unstructuring
omits fields that still hold their default (OpenClaw's optional ``?`` fields are absent, not
``null``); structuring ignores unknown keys and is *strict* about primitives (``"5"`` is not an
integer, ``True`` is not a number), because silently coercing an engine's mistake would hide
it. An engine may return this JSON instead of the records (an engine ported from TypeScript,
or one behind an IPC bridge): :mod:`.validation` structures it with the same converter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

__all__ = ["converter", "from_json", "json_type_name", "strict_int", "to_json"]


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def json_type_name(value: object) -> str:
    """The JSON name of a value's type (``null``, ``array``, ``object`` ...), for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _strict_str(value: object, _: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string (got {json_type_name(value)})")
    return value


def _strict_bool(value: object, _: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected a boolean (got {json_type_name(value)})")
    return value


def strict_int(value: object, _: object) -> int:
    # Token counts from JavaScript engines arrive as floats; a finite float is floored.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number (got {json_type_name(value)})")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError("expected a finite number")
        return math.floor(value)
    return value


def _make_converter() -> cattrs.Converter:
    # A set of tool names is a JSON array, sorted so the shape is deterministic.
    conv = cattrs.Converter(
        forbid_extra_keys=False, unstruct_collection_overrides={frozenset: sorted}
    )
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(int, strict_int)

    def unstructure_factory(cls: type[Any]) -> Callable[[Any], dict[str, Any]]:
        renames: dict[str, Any] = {
            a.name: override(rename=_camel(a.name)) for a in attrs.fields(cls)
        }
        return make_dict_unstructure_fn(cls, conv, _cattrs_omit_if_default=True, **renames)

    def structure_factory(cls: type[Any]) -> Callable[[Any, Any], Any]:
        renames: dict[str, Any] = {
            a.name: override(rename=_camel(a.name)) for a in attrs.fields(cls)
        }
        return make_dict_structure_fn(cls, conv, **renames)

    conv.register_unstructure_hook_factory(attrs.has, unstructure_factory)
    conv.register_structure_hook_factory(attrs.has, structure_factory)
    return conv


#: The one converter between the contract's attrs classes and OpenClaw's camelCase JSON.
converter: Final = _make_converter()

T = TypeVar("T")


def to_json(value: object) -> Any:
    """An attrs params/result object as OpenClaw's camelCase JSON-compatible value."""
    return converter.unstructure(value)


def from_json(data: object, cls: type[T]) -> T:
    """Structure camelCase JSON into ``cls``; raises ``cattrs`` validation errors."""
    return converter.structure(data, cls)
