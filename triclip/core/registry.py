"""Name -> class tables filled by class decorators (the losses' and the codecs' registries)."""

from __future__ import annotations

from typing import Callable, TypeVar

C = TypeVar("C", bound=type)


def registrar(table: dict[str, type], kind: str) -> Callable[[str], Callable[[C], C]]:
    """A ``@register(name)`` decorator filling ``table``: it sets ``cls.name`` and refuses a name used twice.

    ``kind`` names the entries in that error (``"loss"``, ``"codec"``).
    """

    def register(name: str) -> Callable[[C], C]:
        def deco(cls: C) -> C:
            if name in table:
                raise ValueError(f"{kind} {name!r} is registered twice")
            cls.name = name
            table[name] = cls
            return cls

        return deco

    return register
