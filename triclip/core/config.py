"""Typed configs: a field's bounds are declared with the field and checked in one place.

    @dataclass
    class BuildConfig:
        dims: list[int] | None = bounded(None, low=1)  # m's to index
        batch_size: int = bounded(64, low=1)  # images per batch
        recall_target: float = bounded(0.95, above=0, high=1)  # IVF nprobe target

    check_fields(cfg)  # UserError "--batch-size must be >= 1, got 0" (one line)

A list field's bound holds for each item; a ``Literal[...]`` field must be one of its values. ``None`` is never out of bounds (it means "not
given"). :func:`carry` copies one config's fields into another config of the same names.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Callable

from triclip.core.errors import UserError

DEVICE = re.compile(r"cpu|mps|cuda(:\d+)?")  # the torch devices a --device may name


def bounded(default: Any = dataclasses.MISSING, *, low=None, above=None, high=None, why: str = "",
            default_factory: Any = dataclasses.MISSING, **metadata) -> Any:
    """A dataclass field whose value (each item of a list) must lie within the bounds; ``why`` ends the message.
    ``metadata``: more of the field's metadata (``help``, and what ``triclip.app.options`` reads)."""
    bounds = {"low": low, "above": above, "high": high, "why": why}
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={**{k: v for k, v in bounds.items() if v not in (None, "")}, **metadata})


def check_device(device: str | None, option: str = "--device") -> None:
    """UserError unless ``device`` names a torch device kind triclip runs on (None: the default)."""
    if device is not None and not DEVICE.fullmatch(device):
        raise UserError(f"{option} {device!r}: choose cpu, cuda or cuda:N")


def option_flag(name: str) -> str:
    """The command-line option of a field: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


def out_of_bounds(value, metadata) -> str | None:
    """What is wrong with ``value`` against a field's bounds (None: nothing), e.g. ``"must be >= 1"``."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    why = metadata.get("why", "")
    if metadata.get("low") is not None and value < metadata["low"]:
        return f"must be >= {metadata['low']}{why}"
    if metadata.get("above") is not None and value <= metadata["above"]:
        return f"must be > {metadata['above']}{why}"
    if metadata.get("high") is not None and value > metadata["high"]:
        return f"must be <= {metadata['high']}{why}"
    return None


def check_fields(cfg, flag: Callable[[str], str] = option_flag) -> None:
    """UserError (one line naming the option) for the first field of ``cfg`` (nested configs too) out of its
    bounds, or not one of its ``Literal`` choices."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            check_fields(value, flag)
            continue
        choices = literal_choices(hints.get(f.name))
        if choices and value is not None and value not in choices:
            raise UserError(f"{_named(f, flag)} must be one of {', '.join(map(str, choices))}, got {value!r}")
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            problem = out_of_bounds(item, f.metadata)
            if problem:
                shown = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
                raise UserError(f"{_named(f, flag)} {problem}, got {shown}")


def _named(f: dataclasses.Field, flag: Callable[[str], str]) -> str:
    """The option a field is typed as: its own ``flags`` (``-k``) where it has them."""
    return f.metadata.get("flags", [flag(f.name)])[0]


def literal_choices(hint) -> tuple:
    """The values of a ``Literal[...]`` annotation (``Literal[...] | None`` too); () for any other."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(v for arg in typing.get_args(hint) for v in literal_choices(arg))
    return ()


def carry(cls: type, source, **values):
    """An instance of the dataclass ``cls``: each of its fields that ``source`` has a field of that name
    takes ``source``'s value, the rest their defaults; ``values`` win over both (renamed fields)."""
    names = {f.name for f in dataclasses.fields(source)}
    shared = {f.name: getattr(source, f.name) for f in dataclasses.fields(cls) if f.init and f.name in names}
    return cls(**{**shared, **values})
