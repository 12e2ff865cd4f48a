"""Making a loss: ``build_loss(name, **options)``, and ``loss_options(name)``, what it takes."""

from __future__ import annotations

import dataclasses

from torch import nn

from triclip.losses.nested import NESTING_OPTIONS, Nested, NestingConfig
from triclip.losses.registry import LOSSES, LossConfigError, lookup


def loss_options(name: str) -> dict[str, object]:
    """The options of loss ``name`` with their defaults, then the nesting options every loss takes."""
    cls = lookup(name)
    fields = [*dataclasses.fields(cls.Config), *dataclasses.fields(NestingConfig)]
    return {**{f.name: f.default for f in fields}, **getattr(cls, "nesting_defaults", {})}


def with_defaults(name: str, options: dict) -> dict:
    """``options`` with the loss's own nesting defaults filled in: what ``build_loss(name, **options)`` builds,
    spelled out (what ``config.json`` records). An unknown name gets none (``build_loss`` refuses it)."""
    return {**getattr(LOSSES.get(name), "nesting_defaults", {}), **options}


def build_loss(name: str, **options) -> nn.Module:
    """Make the objective ``name`` with its options (docs/CONTRACT.md, "Objectives").

    Args:
        name: a registered name, e.g. ``"infonce"``, ``"debiased"``, ``"tricl"``.
        **options: that loss's options, e.g. ``tau_plus=0.1``; see :func:`loss_options`. Every
            loss also takes ``nested``, ``nested_weight`` and ``nested_order``: with ``nested > 0``
            the loss is wrapped in :class:`triclip.losses.nested.Nested` (Matryoshka nesting).

    Returns:
        A module called as ``loss(image_features, text_features, logit_scale, importance=None)``
        that returns ``{term_name_loss: scalar}``; the objective is the sum of the terms.

    Raises:
        LossConfigError: unknown name, unknown option or bad option value (one line).
    """
    cls = lookup(name)
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
