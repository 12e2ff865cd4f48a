"""A run folder's ``config.json``, read without torch: the command line checks options against
it (D, the preset) before anything loads. ``triclip.model.run`` reads the rest of a run."""

from __future__ import annotations

import os
from pathlib import Path

from triclip.core.errors import UserError
from triclip.core.io import read_json

CONFIG = "config.json"


def read_config(run: str | os.PathLike) -> dict:
    """The run's ``config.json``; UserError when it is missing or damaged."""
    path = Path(run) / CONFIG
    if not path.is_file():
        raise UserError(f"{run} is not a triclip run (no {CONFIG})")
    config = read_json(path)
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise UserError(f"{path} is damaged (no model section)")
    return config


def run_dim(run: str | os.PathLike) -> int | None:
    """D of the run (its ``config.json``'s ``model.embed_dim``; None when it does not say); UserError: not a run."""
    dim = read_config(run)["model"].get("embed_dim")
    return dim if isinstance(dim, int) and not isinstance(dim, bool) and dim >= 1 else None
