"""The loss registry: ``@register_loss(name)`` on a class names it; ``lookup(name)`` finds it.

Making a loss from a name and options is :func:`triclip.losses.build.build_loss` (it wraps
the loss for nesting, which needs the losses: kept out of this module, which every loss imports).
"""

from __future__ import annotations

from torch import nn

from triclip.core.errors import UserError
from triclip.core.registry import registrar

LOSSES: dict[str, type[nn.Module]] = {}  # name -> loss class (a PairLoss subclass)


class LossConfigError(UserError, ValueError):
    """A bad loss name or option: a ``ValueError`` for library callers, a one-line ``UserError`` for the CLI."""


# @register_loss(name): make the loss class available under name (triclip.losses.build.build_loss)
register_loss = registrar(LOSSES, "loss")


def available_losses() -> list[str]:
    """The registered loss names, sorted."""
    return sorted(LOSSES)


def lookup(name: str) -> type[nn.Module]:
    """The class registered as ``name``.

    Raises:
        LossConfigError: no loss of that name.
    """
    if name not in LOSSES:
        raise LossConfigError(f"unknown loss {name!r}; choose from {', '.join(available_losses())}")
    return LOSSES[name]
