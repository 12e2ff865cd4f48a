"""Run directories: the model, its config and what ``--resume`` needs, written atomically.

    RUN/config.json          model config, loss, training config (JSON)
    RUN/model.safetensors    the latest model weights
    RUN/best/                the best epoch by validation t2i_r10 (eval / index use it by default)
    RUN/metrics.jsonl        one JSON object per evaluation
    RUN/skipped.json         records left out, by source and reason
    RUN/checkpoint/          model.safetensors, optim.safetensors, state.json (resume)

Nothing here unpickles: tensors go through safetensors, everything else is JSON.
The checkpoint and best folders are written beside the old ones and swapped in
(``retrieval.io.swap_dir``), so a crash mid-write leaves the previous one whole.
Every file gets the user's umask.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from retrieval.errors import UserError
from retrieval.io import atomic_path, load_safetensors, recover_dir, save_safetensors, swap_dir, write_json_atomic
from retrieval.model import DualEncoder
from retrieval.run import (  # noqa: F401 (re-exported)
    BEST,
    BEST_INFO,
    CONFIG,
    METRICS,
    MODEL,
    SKIPPED,
    best_info,
    load_run,
    read_config,
    read_metrics,
    run_fingerprint,
)

CHECKPOINT = "checkpoint"


def save_weights(module: torch.nn.Module, path: Path) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    save_safetensors(tensors, path)  # atomic, umask, sha256 checked on loading


def save_checkpoint(run: Path, model: DualEncoder, extra: dict[str, torch.nn.Module], optimizer, state: dict) -> None:
    """Write the model for users and a full checkpoint for ``--resume``.

    Args:
        extra: other modules with trainable state (e.g. a loss with a learnable bias).
        state: JSON-serialisable trainer state (step, epoch, ...).
    """
    save_weights(model, run / MODEL)
    tmp = _fresh_dir(run / f".{CHECKPOINT}.tmp")
    shutil.copyfile(run / MODEL, tmp / MODEL)  # the same weights, not serialised twice
    opt_tensors, opt_meta = _flatten_optimizer(optimizer.state_dict())
    for name, module in extra.items():
        opt_tensors.update({f"extra.{name}.{k}": v.detach().contiguous().cpu() for k, v in module.state_dict().items()})
    save_safetensors(opt_tensors, tmp / "optim.safetensors")
    (tmp / "state.json").write_text(json.dumps({**state, "optimizer": opt_meta}, indent=2))
    swap_dir(tmp, run / CHECKPOINT)


def has_checkpoint(run: Path) -> bool:
    """Whether ``run`` holds a checkpoint to resume from (also one a crash left mid-swap)."""
    return (recover_dir(run / CHECKPOINT) / "state.json").exists()


def save_best(run: Path, model: DualEncoder, info: dict) -> None:
    """Keep ``model``'s weights as the run's best (``RUN/best``), with ``info`` (epoch, metric, ...)."""
    tmp = _fresh_dir(run / f".{BEST}.tmp")
    save_weights(model, tmp / MODEL)
    write_json_atomic(tmp / BEST_INFO, info)
    swap_dir(tmp, run / BEST)


def load_checkpoint(run: Path, model: DualEncoder, extra: dict[str, torch.nn.Module], optimizer) -> dict:
    """Restore model, extra modules and optimizer in place; return the trainer state.

    Raises:
        UserError: no checkpoint, or a damaged one (one line; nothing is changed on disk).
    """
    ckpt = recover_dir(run / CHECKPOINT)  # a crash between the two renames of save_checkpoint
    if not (ckpt / "state.json").exists():
        raise UserError(f"--resume: no checkpoint in {run}")
    try:
        state = json.loads((ckpt / "state.json").read_text(encoding="utf-8"))
        meta = state.pop("optimizer")
        for key in ("step", "epoch", "batch"):
            if not isinstance(state.get(key), int):
                raise ValueError(f"no integer {key!r}")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, KeyError, TypeError) as err:
        raise UserError(f"--resume: {ckpt / 'state.json'} is damaged ({err})") from None
    for name, load in (
        (MODEL, lambda: model.load_state_dict(load_safetensors(ckpt / MODEL))),
        ("optim.safetensors", lambda: _load_optim(ckpt, extra, optimizer, meta)),
    ):
        try:
            load()
        except Exception as err:  # safetensors / load_state_dict raise many types for damaged or foreign files
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            raise UserError(f"--resume: cannot load {ckpt / name}: {first}") from None
    return state


def _load_optim(ckpt: Path, extra: dict[str, torch.nn.Module], optimizer, meta: dict) -> None:
    tensors = load_safetensors(ckpt / "optim.safetensors")
    for name, module in extra.items():
        prefix = f"extra.{name}."
        module.load_state_dict({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})
    optimizer.load_state_dict(_unflatten_optimizer(tensors, meta))


def _fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)  # a plain mkdir: the user's umask
    return path


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
