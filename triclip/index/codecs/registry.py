"""The codec registry: ``@register_codec(name)`` on a :class:`~triclip.index.codecs.base.Codec` subclass names it;
:func:`lookup` finds it, :func:`names` lists every name. FAISS-free (the codecs themselves are not).

The order of registration is the order :func:`triclip.index.codecs.candidates` tries the codecs in (a tie in
measured recall goes to the earlier one): ``triclip/index/codecs/__init__.py`` imports the codec modules in
that order.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from triclip.core.errors import UserError

CODECS: dict[str, type] = {}  # name -> codec class (a Codec subclass), in the order registered

C = TypeVar("C", bound=type)


def register_codec(name: str) -> Callable[[C], C]:
    """Class decorator: make the codec available under ``name`` (the ``codec`` of a :class:`CodecSpec`)."""

    def deco(cls: C) -> C:
        if name in CODECS:
            raise ValueError(f"codec {name!r} is registered twice")
        cls.name = name
        CODECS[name] = cls
        return cls

    return deco


def names() -> tuple[str, ...]:
    """The registered codec names, in the order they are tried (``index build --codec``'s choices)."""
    return tuple(CODECS)


def lookup(name: str) -> type:
    """The class registered as ``name``; UserError (one line) naming the choices when there is none."""
    if name not in CODECS:
        raise UserError(f"unknown codec {name!r}; choose from {', '.join(CODECS)}")
    return CODECS[name]


def describe(spec) -> str:
    """A code in plain words for a newcomer, e.g. ``rq8x8 m=256: 8 codebooks of 256 entries over all 256
    dimensions, ...`` (the app's caption of a budget's code). ``spec``: a :class:`CodecSpec`."""
    return lookup(spec.codec).describe(spec)


def title(name: str) -> str:
    """The words for codec ``name`` in a chart's legend; the name itself for a codec this version does not know
    (an index folder written by another version)."""
    return CODECS[name].title if name in CODECS else name


def family(name: str) -> str:
    """The name of codec ``name``'s row in tables of results (``benchmarks/bench_bytes.py``)."""
    return lookup(name).family
