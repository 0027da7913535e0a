"""Value objects hashed into node keys: frozen dataclasses whose key is their fields.

A node's key (:attr:`tierflow.engine.graph.nodes.Node.key`) is made of its parameters,
and most parameters are a value object: a spec (:mod:`.specs`), an elementwise
operation (:class:`~tierflow.engine.graph.nodes.ElemOp`), a sort's description. Each is
a :class:`Keyed`: a frozen dataclass whose key text, :meth:`Keyed.params`, is derived
from its fields by :func:`key_parts`, here and nowhere else, so a field added to a
class reaches the key without anyone listing it.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

from ...storage import identity

__all__ = ["NOT_KEY", "Keyed", "key_parts"]

# ``field(metadata=NOT_KEY)``: a field that says how or where an operator runs, not
# what it computes (MapSpec's device), or what lives for one compute (a sort's files).
NOT_KEY = MappingProxyType({"key": False})


@dataclasses.dataclass(frozen=True, eq=False)
class Keyed:
    """Base of the value objects hashed into node keys.

    The key is :func:`key_parts`: the class's name, then every field by name and
    value, in declaration order, except

    * a field declared ``field(metadata=NOT_KEY)``: the result is the same whatever it
      holds (MapSpec's ``device``: the same wherever it runs);
    * a field at its default value: a field added later with a default leaves the keys
      made before it as they were (ReduceOptions' ``initial``, when not given).

    A field that holds a dataclass enters by the same rule, field by field. A subclass
    that holds arrays, functions or dicts is declared ``eq=False``: it compares by
    identity and is never hashed (its key is :meth:`params`, not ``hash``).
    """

    def params(self) -> str:
        """The canonical text of the key parts (:func:`tierflow.storage.identity.token`)."""
        return identity.token(key_parts(self))


def key_parts(obj: Any) -> tuple[Any, ...]:
    """``(class name, ((field, value), ...))`` of a dataclass instance, by the rule of
    :class:`Keyed`."""
    items = []
    for f in dataclasses.fields(obj):
        if not f.metadata.get("key", True):
            continue
        value = getattr(obj, f.name)
        if _at_default(f, value):
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = key_parts(value)
        items.append((f.name, value))
    return (type(obj).__qualname__, tuple(items))


def _at_default(f: dataclasses.Field[Any], value: Any) -> bool:
    """Whether ``value`` is ``f``'s default: the same object, or an equal one of the
    same type (``0`` is not ``False``, nor ``0.0``: keys tell them apart)."""
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        return False
    if value is default:
        return True
    if type(value) is not type(default):
        return False
    try:
        return bool(value == default)
    except (TypeError, ValueError):  # an array against an array: not a plain default
        return False
