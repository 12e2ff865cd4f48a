"""Run directories: the model, its config and what ``--resume`` needs, written atomically.

    RUN/config.json          model config, loss, training config (JSON)
    RUN/model.safetensors    the latest model weights: what trained, plus a reference to the frozen towers
    RUN/best/                the best epoch by validation t2i_r10 (eval / index use it when it was kept)
    RUN/selection.json       whether the best epoch or the last weights were kept (triclip.training.selection)
    RUN/metrics.jsonl        one JSON object per evaluation
    RUN/skipped.json         records left out, by source and reason
    RUN/checkpoint/          model.safetensors (a hard link to the run's), optim.safetensors, state.json (resume)

Small runs: a weights file leaves out the tower tensors that did not train and are what the
model was built with (from the towers' packages, or from the seed), and carries a reference
to them (``triclip.model.run``: seed, packages, hashes). A locked ``lite`` run is its heads. A
finished run drops its optimizer state (resuming it to train longer restarts Adam's moments).

Nothing here unpickles: tensors go through safetensors, everything else is JSON.
The checkpoint and best folders are written beside the old ones and swapped in
(``triclip.core.io.swap_dir``), so a crash mid-write leaves the previous one whole.
Every file gets the user's umask.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterable

import torch

from triclip.core.errors import UserError
from triclip.core.io import atomic_path, load_safetensors, recover_dir, save_safetensors, swap_dir, write_json_atomic
from triclip.model.model import DualEncoder
from triclip.model.model import LITE_PRESETS
from triclip.model.run import (  # noqa: F401 (re-exported)
    BEST,
    BEST_INFO,
    CONFIG,
    METRICS,
    MODEL,
    SELECTION,
    SKIPPED,
    TOWER_REFERENCE,
    TOWERS,
    tensors_hash,
    best_info,
    frozen_tower_keys,
    load_run,
    load_weights,
    read_config,
    read_metrics,
    run_fingerprint,
    tower_reference,
)

CHECKPOINT = "checkpoint"


# ---------------------------------------------------------------------------- the weights format


def mark_built(model: DualEncoder, seed: int) -> None:
    """Remember the tower tensors as built (``build_model`` right after ``torch.manual_seed(seed)``):
    frozen tensors still equal to these are left out of weights files and rebuilt on loading."""
    state = model.state_dict()
    keys = [k for k in state if k.startswith(tuple(t + "." for t in TOWERS))]
    model.__dict__["_as_built"] = {"seed": int(seed), "hashes": {k: tensors_hash(state, [k]) for k in keys}}


def weights_snapshot(model: DualEncoder, trained: Iterable[str] | None = None) -> "WeightsSnapshot":
    """CPU copies of what a weights file of ``model`` holds, with the tower reference.

    Args:
        trained: state-dict keys that trained (None: from ``requires_grad``). Tower tensors
            outside it are left out when they are as built: from the towers' packages (lite
            presets, open_clip pretrained tags), or from the seed given to :func:`mark_built`.
    """
    left_out, seed = _left_out(model, trained)
    state = model.state_dict()
    tensors = {k: v.detach().contiguous().cpu().clone() for k, v in state.items() if k not in left_out}
    metadata = {TOWER_REFERENCE: json.dumps(tower_reference(model, left_out, seed))} if left_out else None
    return WeightsSnapshot(tensors, metadata)


class WeightsSnapshot:
    """Tensors and safetensors metadata of one weights file, held until written."""

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None):
        self.tensors, self.metadata = tensors, metadata

    def write(self, path: Path) -> None:
        save_safetensors(self.tensors, path, self.metadata)  # atomic, umask, sha256 checked on loading


def save_weights(model: torch.nn.Module, path: Path, trained: Iterable[str] | None = None) -> None:
    """Write ``model``'s weights file: what trained, plus the reference to its frozen towers
    (see :func:`weights_snapshot`); any other module: all of its tensors."""
    if isinstance(model, DualEncoder):
        weights_snapshot(model, trained).write(path)
        return
    WeightsSnapshot({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, None).write(path)


def _left_out(model: DualEncoder, trained: Iterable[str] | None) -> tuple[frozenset, int]:
    """(tower keys a weights file leaves out, the seed they are rebuilt with)."""
    if trained is None:
        frozen = frozen_tower_keys(model)
    else:
        trained = set(trained)
        frozen = [k for k in model.state_dict() if k.startswith(tuple(t + "." for t in TOWERS)) and k not in trained]
    built = model.__dict__.get("_as_built")
    if built is None:  # not marked: only package towers are known to be rebuilt alike
        packaged = model.config.preset in LITE_PRESETS or bool(model.config.pretrained)
        return (frozenset(frozen) if packaged else frozenset()), 0
    cache = model.__dict__.setdefault("_left_out", {})
    key = tuple(frozen)
    if key not in cache:  # frozen tensors do not change: compared once
        state = model.state_dict()
        cache[key] = frozenset(k for k in frozen if built["hashes"].get(k) == tensors_hash(state, [k]))
    return cache[key], built["seed"]


# ---------------------------------------------------------------------------- checkpoints


def save_checkpoint(
    run: Path,
    model: DualEncoder,
    extra: dict[str, torch.nn.Module],
    optimizer,
    state: dict,
    keep_optimizer: bool = True,
) -> None:
    """Write the model for users and a checkpoint for ``--resume``.

    Args:
        extra: other modules with trainable state (e.g. a loss with a learnable bias).
        state: JSON-serialisable trainer state (step, epoch, ...).
        keep_optimizer: False for the end of a finished run: no optimizer state is written.
    """
    save_weights(model, run / MODEL)
    tmp = _fresh_dir(run / f".{CHECKPOINT}.tmp")
    _link_or_copy(run / MODEL, tmp / MODEL)  # the same weights, neither serialised nor stored twice
    opt_meta = None
    if keep_optimizer:
        opt_tensors, opt_meta = _flatten_optimizer(optimizer.state_dict())
        for name, module in extra.items():
            opt_tensors.update({f"extra.{name}.{k}": v.detach().contiguous().cpu() for k, v in module.state_dict().items()})
        save_safetensors(opt_tensors, tmp / "optim.safetensors")
    (tmp / "state.json").write_text(json.dumps({**state, "optimizer": opt_meta}, indent=2))
    swap_dir(tmp, run / CHECKPOINT)


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link (no bytes written; a later atomic rewrite of ``source`` leaves it whole), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


_ORPHAN = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")  # triclip.core.io.atomic_path's temp files: .NAME.XXXXXXXX.tmp


def start_over(run: Path) -> None:
    """Make the folder of a new run; clear what a run killed before its first checkpoint left."""
    run.mkdir(parents=True, exist_ok=True)
    for name in (MODEL, METRICS, SKIPPED, SELECTION):
        (run / name).unlink(missing_ok=True)
    for name in (BEST, f".{BEST}.old", f".{BEST}.tmp", CHECKPOINT, f".{CHECKPOINT}.old", f".{CHECKPOINT}.tmp", "tensorboard"):
        shutil.rmtree(run / name, ignore_errors=True)


def abs_source(path: str | None) -> str | None:
    """A local source as an absolute path (a run can be resumed from another folder); hf: names as given."""
    return path if path is None or path.startswith("hf:") else os.path.abspath(path)


def remove_orphans(run: Path) -> list[Path]:
    """Remove what writes killed mid-way left in ``run``; returns what was removed.

    That is the temporary files of atomic writes (``.model.safetensors.k2x8a1qz.tmp``), the
    staging folders of the checkpoint and of the best epoch, and a ``.NAME.old`` whose
    ``NAME`` is back in place (a kill between the last two steps of ``swap_dir``; while
    ``NAME`` is missing it is the copy :func:`recover_dir` reads, and stays). Call it before
    this process writes to ``run``: a second live writer of one run is not supported.
    """
    removed: list[Path] = []
    if not run.is_dir():
        return removed
    for path in run.iterdir():
        stale = (
            _ORPHAN.match(path.name) and path.is_file()
            or path.name in (f".{CHECKPOINT}.tmp", f".{BEST}.tmp")
            or path.name in (f".{CHECKPOINT}.old", f".{BEST}.old") and (run / path.name[1:-4]).exists()
        )  # fmt: skip
        if stale:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def has_checkpoint(run: Path) -> bool:
    """Whether ``run`` holds a checkpoint to resume from (also one a crash left mid-swap)."""
    return (recover_dir(run / CHECKPOINT) / "state.json").exists()


def save_best(run: Path, model: "DualEncoder | WeightsSnapshot", info: dict) -> None:
    """Keep ``model``'s weights (or a snapshot of them) as the run's best (``RUN/best``), with ``info``."""
    tmp = _fresh_dir(run / f".{BEST}.tmp")
    (model if isinstance(model, WeightsSnapshot) else weights_snapshot(model)).write(tmp / MODEL)
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
    try:
        load_weights(model, ckpt / MODEL)
    except UserError as err:
        raise UserError(f"--resume: {err}") from None
    if meta is None:  # a finished run keeps no optimizer state
        print("--resume: the run had finished and kept no optimizer state; Adam's moments start again from zero")
        return state
    try:
        _load_optim(ckpt, extra, optimizer, meta)
    except Exception as err:  # safetensors / load_state_dict raise many types for damaged or foreign files
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise UserError(f"--resume: cannot load {ckpt / 'optim.safetensors'}: {first}") from None
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
