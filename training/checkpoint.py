"""Run directories: the model, its config and what ``--resume`` needs, written atomically.

    RUN/config.json          model config, loss, training config (JSON)
    RUN/model.safetensors    the latest model weights (what eval / index use)
    RUN/metrics.jsonl        one JSON object per evaluation
    RUN/checkpoint/          model.safetensors, optim.safetensors, state.json (resume)

Nothing here unpickles: tensors go through safetensors, everything else is JSON.
The checkpoint folder is written beside the old one and swapped in, so a crash
mid-write leaves the previous checkpoint whole.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from retrieval.errors import UserError
from retrieval.io import atomic_path, write_json_atomic
from retrieval.model import DualEncoder
from retrieval.run import CONFIG, METRICS, MODEL, load_run, read_config, run_fingerprint  # noqa: F401 (re-exported)

CHECKPOINT = "checkpoint"


def save_weights(module: torch.nn.Module, path: Path) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))


def save_checkpoint(run: Path, model: DualEncoder, extra: dict[str, torch.nn.Module], optimizer, state: dict) -> None:
    """Write the model for users and a full checkpoint for ``--resume``.

    Args:
        extra: other modules with trainable state (e.g. a loss with a learnable bias).
        state: JSON-serialisable trainer state (step, epoch, ...).
    """
    save_weights(model, run / MODEL)
    tmp = run / f".{CHECKPOINT}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copyfile(run / MODEL, tmp / MODEL)  # the same weights, not serialised twice
    opt_tensors, opt_meta = _flatten_optimizer(optimizer.state_dict())
    for name, module in extra.items():
        opt_tensors.update({f"extra.{name}.{k}": v.detach().contiguous().cpu() for k, v in module.state_dict().items()})
    save_file(opt_tensors, str(tmp / "optim.safetensors"))
    (tmp / "state.json").write_text(json.dumps({**state, "optimizer": opt_meta}, indent=2))
    final, old = run / CHECKPOINT, run / f".{CHECKPOINT}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(run: Path, model: DualEncoder, extra: dict[str, torch.nn.Module], optimizer) -> dict:
    """Restore model, extra modules and optimizer in place; return the trainer state."""
    ckpt = run / CHECKPOINT
    if not (ckpt / "state.json").exists():
        old = run / f".{CHECKPOINT}.old"  # a crash between the two renames of save_checkpoint
        ckpt = old if (old / "state.json").exists() else ckpt
    if not (ckpt / "state.json").exists():
        raise UserError(f"--resume: no checkpoint in {run}")
    model.load_state_dict(load_file(str(ckpt / MODEL)))
    state = json.loads((ckpt / "state.json").read_text())
    tensors = load_file(str(ckpt / "optim.safetensors"))
    for name, module in extra.items():
        prefix = f"extra.{name}."
        module.load_state_dict({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})
    optimizer.load_state_dict(_unflatten_optimizer(tensors, state.pop("optimizer")))
    return state


def _flatten_optimizer(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for idx, per_param in sd["state"].items():
        for key, value in per_param.items():
            if torch.is_tensor(value):
                tensors[f"state.{idx}.{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{idx}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("state."):
            _, idx, key = name.split(".", 2)
            state.setdefault(int(idx), {})[key] = value
    for name, value in meta["scalars"].items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def append_metrics(run: Path, record: dict) -> None:
    """Append one evaluation to metrics.jsonl (rewritten atomically, so a crash loses nothing)."""
    path = run / METRICS
    old = path.read_text() if path.exists() else ""
    with atomic_path(path) as tmp:
        tmp.write_text(old + json.dumps(record, sort_keys=True) + "\n")


def write_config(run: Path, config: dict) -> None:
    write_json_atomic(run / CONFIG, config)
