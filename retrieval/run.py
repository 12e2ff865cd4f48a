"""Reading a run folder (what ``triclip train --out RUN`` wrote): config, weights, fingerprint.

    RUN/config.json          model config, loss, training config (JSON)
    RUN/model.safetensors    the model weights that eval / index / app use
    RUN/metrics.jsonl        one JSON object per evaluation

Training writes these (``training.checkpoint``); everything else only reads them,
through this module, so the index and the app never import ``training``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from retrieval.errors import UserError
from retrieval.model import DualEncoder, ModelConfig, build_model

CONFIG = "config.json"
MODEL = "model.safetensors"
METRICS = "metrics.jsonl"


def read_config(run: str | os.PathLike) -> dict:
    """The run's ``config.json``; UserError when it is missing or damaged."""
    path = Path(run) / CONFIG
    if not path.is_file():
        raise UserError(f"{run} is not a triclip run (no {CONFIG})")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {path}: {err}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise UserError(f"{path} is damaged (no model section)")
    return config


def load_run(run: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[DualEncoder, dict]:
    """Rebuild the model of a run from its config and weights, towers locked as trained; eval mode."""
    config = read_config(run)
    weights = Path(run) / MODEL
    if not weights.is_file():
        raise UserError(f"{run} has no {MODEL} yet")
    try:
        model = build_model(ModelConfig(**config["model"]))
    except TypeError as err:
        raise UserError(f"{Path(run) / CONFIG}: bad model section ({err})") from None
    try:
        state = load_file(str(weights))
        model.load_state_dict(state)
    except Exception as err:  # safetensors raises its own error types for truncated / foreign files
        raise UserError(f"cannot load {weights}: {str(err).splitlines()[0][:200]}") from None
    train_cfg = config.get("train", {}) or {}
    model.lock(image=bool(train_cfg.get("lock_image")), text=bool(train_cfg.get("lock_text")))
    return model.to(device).eval(), config


def run_fingerprint(run: str | os.PathLike) -> str:
    """A short hash of the run's weights: two runs with the same fingerprint embed identically."""
    digest = hashlib.sha256()
    path = Path(run) / MODEL
    if not path.is_file():
        raise UserError(f"{run} has no {MODEL} yet")
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]
