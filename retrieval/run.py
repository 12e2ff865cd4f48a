"""Reading a run folder (what ``triclip train --out RUN`` wrote): config, weights, fingerprint.

    RUN/config.json          model config, loss, training config (the values used, JSON)
    RUN/model.safetensors    the last weights
    RUN/best/                the best epoch by validation t2i_r10: model.safetensors, best.json
    RUN/metrics.jsonl        one JSON object per evaluation
    RUN/skipped.json         records left out, by data source and reason

Training writes these (``training.checkpoint``); everything else only reads them,
through this module, so the index and the app never import ``training``.

Which weights: ``which="best"`` (the default of :func:`load_run` and
:func:`run_fingerprint`) takes ``RUN/best`` when the run keeps one (it had
validation data) and the last weights otherwise; ``which="last"`` always takes
the last. The fingerprint hashes the same file that is loaded, so an index built
from a run's best weights refuses its last ones and the other way round.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from retrieval.errors import UserError
from retrieval.io import load_safetensors, read_json, recover_dir
from retrieval.model import DualEncoder, ModelConfig, build_model

CONFIG = "config.json"
MODEL = "model.safetensors"
METRICS = "metrics.jsonl"
BEST = "best"  # folder: model.safetensors + best.json ({"epoch", "step", "metric", "value"})
BEST_INFO = "best.json"
SKIPPED = "skipped.json"
WHICH = ("best", "last")


def read_config(run: str | os.PathLike) -> dict:
    """The run's ``config.json``; UserError when it is missing or damaged."""
    path = Path(run) / CONFIG
    if not path.is_file():
        raise UserError(f"{run} is not a triclip run (no {CONFIG})")
    config = read_json(path)
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise UserError(f"{path} is damaged (no model section)")
    return config


def weights_path(run: str | os.PathLike, which: str = "best") -> Path:
    """The weights file that ``which`` names (see the module docstring); UserError when there is none."""
    if which not in WHICH:
        raise UserError(f"--weights must be one of {', '.join(WHICH)}, got {which!r}")
    if which == "best":
        best = recover_dir(Path(run) / BEST) / MODEL
        if best.is_file():
            return best
    path = Path(run) / MODEL
    if not path.is_file():
        raise UserError(f"{run} has no {MODEL} yet")
    return path


def best_info(run: str | os.PathLike) -> dict | None:
    """``{"epoch", "step", "metric", "value"}`` of the kept best epoch, or None when the run keeps none."""
    path = recover_dir(Path(run) / BEST) / BEST_INFO
    if not path.is_file():
        return None
    info = read_json(path)
    if not isinstance(info, dict) or not isinstance(info.get("epoch"), int):
        raise UserError(f"{path} is damaged (no epoch)")
    return info


def read_metrics(run: str | os.PathLike) -> list[dict]:
    """The evaluations in ``RUN/metrics.jsonl`` (empty when there are none); UserError when damaged."""
    path = Path(run) / METRICS
    if not path.is_file():
        return []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read {path}: {err}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path} is damaged at line {number}: {err}") from None
        if not isinstance(record, dict):
            raise UserError(f"{path} is damaged at line {number}: not a JSON object")
        records.append(record)
    return records


def load_run(
    run: str | os.PathLike, device: str | torch.device = "cpu", which: str = "best"
) -> tuple[DualEncoder, dict]:
    """Rebuild the model of a run from its config and weights, towers locked as trained; eval mode.

    Args:
        which: ``"best"`` (the kept best epoch, else the last weights) or ``"last"``.
    """
    config = read_config(run)
    weights = weights_path(run, which)
    try:
        model = build_model(ModelConfig(**config["model"]))
    except (TypeError, ValueError, KeyError) as err:
        raise UserError(f"{Path(run) / CONFIG}: bad model section ({err})") from None
    state = load_safetensors(weights)  # checked against the sha256 recorded when it was saved
    try:
        model.load_state_dict(state)
    except Exception as err:  # safetensors raises its own error types for truncated / foreign files
        raise UserError(f"cannot load {weights}: {str(err).splitlines()[0][:200]}") from None
    train_cfg = config.get("train", {}) or {}
    if not isinstance(train_cfg, dict):
        raise UserError(f"{Path(run) / CONFIG} is damaged (train section)")
    model.lock(image=bool(train_cfg.get("lock_image")), text=bool(train_cfg.get("lock_text")))
    return model.to(device).eval(), config


def run_fingerprint(run: str | os.PathLike, which: str = "best") -> str:
    """A short hash of the weights :func:`load_run` loads with the same ``which``: two runs with
    the same fingerprint embed identically."""
    digest = hashlib.sha256()
    with open(weights_path(run, which), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]
