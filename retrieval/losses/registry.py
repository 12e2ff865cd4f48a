"""The loss registry: ``@register_loss(name)`` on a class, ``build_loss(name, **options)`` to make one."""

from __future__ import annotations

import dataclasses
from typing import Callable, TypeVar

from torch import nn

from retrieval.errors import UserError

LOSSES: dict[str, type[nn.Module]] = {}  # name -> loss class (a PairLoss subclass)

L = TypeVar("L", bound=type)


class LossConfigError(UserError, ValueError):
    """A bad loss name or option: a ``ValueError`` for library callers, a one-line ``UserError`` for the CLI."""


def register_loss(name: str) -> Callable[[L], L]:
    """Class decorator: make the loss available to :func:`build_loss` under ``name``."""

    def deco(cls: L) -> L:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is registered twice")
        cls.name = name
        LOSSES[name] = cls
        return cls

    return deco


def available_losses() -> list[str]:
    """The registered loss names, sorted."""
    return sorted(LOSSES)


def loss_options(name: str) -> dict[str, object]:
    """The options of loss ``name`` with their defaults, then the nesting options every loss takes."""
    from retrieval.losses.nested import NestingConfig  # lazy: nested imports the losses, which import this

    cls = _lookup(name)
    fields = [*dataclasses.fields(cls.Config), *dataclasses.fields(NestingConfig)]
    return {**{f.name: f.default for f in fields}, **getattr(cls, "nesting_defaults", {})}


def _lookup(name: str) -> type[nn.Module]:
    if name not in LOSSES:
        raise LossConfigError(f"unknown loss {name!r}; choose from {', '.join(available_losses())}")
    return LOSSES[name]


def build_loss(name: str, **options) -> nn.Module:
    """Make the objective ``name`` with its options (SPEC, "Objectives").

    Args:
        name: a registered name, e.g. ``"infonce"``, ``"debiased"``, ``"tricl"``.
        **options: that loss's options, e.g. ``tau_plus=0.1``; see :func:`loss_options`. Every
            loss also takes ``nested``, ``nested_weight`` and ``nested_order``: with ``nested > 0``
            the loss is wrapped in :class:`retrieval.losses.nested.Nested` (Matryoshka nesting).

    Returns:
        A module called as ``loss(image_features, text_features, logit_scale, importance=None)``
        that returns ``{term_name_loss: scalar}``; the objective is the sum of the terms.

    Raises:
        LossConfigError: unknown name, unknown option or bad option value (one line).
    """
    from retrieval.losses.nested import NESTING_OPTIONS, Nested, NestingConfig  # lazy, see loss_options

    cls = _lookup(name)
    known = {f.name for f in dataclasses.fields(cls.Config)}
    unknown = sorted(set(options) - known - set(NESTING_OPTIONS))
    if unknown:
        accepted = ", ".join(sorted(known | set(NESTING_OPTIONS)))
        raise LossConfigError(f"loss {name!r} has no option {', '.join(unknown)} (its options: {accepted})")
    nesting = {**getattr(cls, "nesting_defaults", {}), **{k: options.pop(k) for k in NESTING_OPTIONS if k in options}}
    try:
        NestingConfig(**nesting)  # checked even when nested = 0
        loss = cls(**options)
        return Nested(loss, **nesting) if nesting.get("nested", 0) > 0 else loss
    except ValueError as err:
        raise LossConfigError(f"loss {name!r}: {err}") from None
