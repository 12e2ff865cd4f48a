"""Reading a run folder (what ``triclip train --out RUN`` wrote): config, weights, fingerprint.

    RUN/config.json          model config, loss, training config (the values used, JSON)
    RUN/model.safetensors    the last weights
    RUN/best/                the best epoch by validation t2i_r10: model.safetensors, best.json
    RUN/selection.json       which of the two training kept (triclip.training.selection): "best" or "last"
    RUN/metrics.jsonl        one JSON object per evaluation
    RUN/skipped.json         records left out, by data source and reason

Training writes these (``triclip.training.checkpoint``); everything else only reads them,
through this module, so the index and the app never import ``training``.

Which weights: ``which="best"`` (the default of :func:`load_run` and
:func:`run_fingerprint`) takes the weights training kept: ``RUN/best`` when the
run keeps one (it had validation data and its best epoch beat the last beyond
noise, ``RUN/selection.json``) and the last weights otherwise; ``which="last"``
always takes the last. The fingerprint hashes the same file that is loaded, so an
index built from a run's best weights refuses its last ones and the other way round.

Weights files: a run stores what trained. Tower tensors that stayed frozen (locked
pretrained or seeded towers) are left out of the file; its safetensors metadata
(``triclip.towers``) holds the reference to rebuild them: the seed the model was built
with, the packages and versions the towers come from, and per tower the count and a
sha256 of the left-out tensors. Loading builds the model (seeded), checks the hashes
and loads the file over it. A file without that metadata (older runs) holds everything.
"""

from __future__ import annotations

import json
import os
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open

from triclip.core.errors import UserError, first_line
from triclip.core.io import check_readable, file_sha256, load_safetensors, read_json, recover_dir, tensors_sha256
from triclip.model.model import DualEncoder, ModelConfig, build_model
from triclip.model.runfile import CONFIG, read_config  # noqa: F401 (re-exported: the run folder's config.json)

MODEL = "model.safetensors"
METRICS = "metrics.jsonl"
BEST = "best"  # folder: model.safetensors + best.json ({"epoch", "step", "metric", "value"})
BEST_INFO = "best.json"
SKIPPED = "skipped.json"
SELECTION = "selection.json"  # {"kept": "best"|"last", "kept_epoch", ...}: written at the end of training
WHICH = ("best", "last")
TOWERS = ("image_tower", "text_tower")
TOWER_REFERENCE = "triclip.towers"  # safetensors metadata key: how to rebuild the tower tensors left out


def weights_path(run: str | os.PathLike, which: str = "best") -> Path:
    """The weights file that ``which`` names (see the module docstring); UserError when there is none."""
    if which not in WHICH:
        raise UserError(f"--weights must be one of {', '.join(WHICH)}, got {which!r}")
    if which == "best" and _kept(run) != "last":
        best = recover_dir(Path(run) / BEST) / MODEL
        if best.is_file():
            return best
    path = Path(run) / MODEL
    if not path.is_file():
        raise UserError(f"{run} has no {MODEL} yet")
    return path


def _kept(run: str | os.PathLike) -> str | None:
    """``"best"`` or ``"last"`` as training decided (RUN/selection.json), None before it has."""
    path = Path(run) / SELECTION
    if not path.is_file():
        return None
    saved = read_json(path)
    kept = saved.get("kept") if isinstance(saved, dict) else None
    if kept not in WHICH:
        raise UserError(f"{path} is damaged (no kept: best or last)")
    return kept


def best_info(run: str | os.PathLike, held: bool = False) -> dict | None:
    """``{"epoch", "step", "metric", "value"}`` of the kept best epoch, or None when the run keeps none
    (no validation data, or the selection kept the last weights). ``held``: the one in RUN/best
    whether or not it was kept (what training continues from)."""
    if not held and _kept(run) == "last":
        return None
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
    reference = weights_reference(weights)
    try:
        model = build_seeded(ModelConfig(**config["model"]), (reference or {}).get("seed", 0))
    except (TypeError, ValueError, KeyError) as err:
        raise UserError(f"{Path(run) / CONFIG}: bad model section ({err})") from None
    load_weights(model, weights, reference)
    train_cfg = config.get("train", {}) or {}
    if not isinstance(train_cfg, dict):
        raise UserError(f"{Path(run) / CONFIG} is damaged (train section)")
    model.lock(image=bool(train_cfg.get("lock_image")), text=bool(train_cfg.get("lock_text")))
    return model.to(device).eval(), config


def run_fingerprint(run: str | os.PathLike, which: str = "best") -> str:
    """A short hash of the weights :func:`load_run` loads with the same ``which``: two runs with
    the same fingerprint embed identically."""
    return file_sha256(weights_path(run, which))[:16]


# ---------------------------------------------------------------------------- weights files


def build_seeded(cfg: ModelConfig, seed: int) -> DualEncoder:
    """``build_model(cfg)`` with torch's generator seeded as training seeds it (random towers are
    then the same tensors); the caller's generator state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(cfg)


def frozen_tower_keys(model: torch.nn.Module) -> list[str]:
    """State-dict keys of tower tensors that do not train: frozen parameters, and the buffers of
    modules whose parameters are all frozen (a locked tower runs in eval mode: its BatchNorm
    statistics stay). These are what a run leaves out of its weights file."""
    keys = []
    for tower in TOWERS:
        root = getattr(model, tower, None)
        if root is None:
            continue
        tower_trains = any(p.requires_grad for p in root.parameters())
        for name, module in root.named_modules():
            prefix = f"{tower}.{name}." if name else f"{tower}."
            keys += [prefix + n for n, p in module.named_parameters(recurse=False) if not p.requires_grad]
            below = list(module.parameters())
            if not any(p.requires_grad for p in below) if below else not tower_trains:
                keys += [prefix + n for n, _ in module.named_buffers(recurse=False)]
    present = set(model.state_dict(keep_vars=True))  # drops non-persistent buffers (never saved)
    return sorted(k for k in dict.fromkeys(keys) if k in present)


def tower_reference(model: DualEncoder, frozen: Iterable[str], seed: int) -> dict:
    """What rebuilds the ``frozen`` tower tensors: the seed, the towers' packages, per tower a hash.

    Cached on the model (frozen tensors never change)."""
    frozen = tuple(sorted(frozen))
    cache = model.__dict__.setdefault("_tower_reference", {})
    if frozen not in cache:
        state = model.state_dict()
        towers = {}
        for tower in TOWERS:
            keys = [k for k in frozen if k.startswith(tower + ".")]
            if keys:
                towers[tower] = {"tensors": len(keys), "sha256": tensors_hash(state, keys)}
        cache[frozen] = {"format": 1, "towers": towers, "packages": tower_packages(model.config.preset), "preset": model.config.preset}
    return {**cache[frozen], "seed": int(seed)}


def tower_packages(preset: str) -> dict[str, str]:
    """The installed distributions a preset's towers come from, with their versions."""
    from triclip.model.model import LITE_PRESETS

    if preset in LITE_PRESETS:
        from triclip.model.towers import LITE_VARIANTS, MINILM_PYPI

        variant = 0 if preset == "lite" else int(preset[-1])
        names = [LITE_VARIANTS[variant].pypi, MINILM_PYPI, "timm", "transformers"]
    else:
        names = ["open_clip_torch", "torch"]
    return {name: _version(name) for name in names}


def weights_reference(path: str | os.PathLike) -> dict | None:
    """The tower reference a weights file carries (None: the file holds every tensor)."""
    check_readable(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as err:  # safetensors raises its own error types for truncated / foreign files
        raise UserError(f"cannot load {path}: {str(err).splitlines()[0][:200]}") from None
    if TOWER_REFERENCE not in meta:
        return None
    try:
        reference = json.loads(meta[TOWER_REFERENCE])
        if not isinstance(reference.get("towers"), dict):
            raise ValueError("no towers")
    except (ValueError, AttributeError) as err:
        raise UserError(f"{path}: damaged tower reference ({err})") from None
    return reference


def load_weights(model: DualEncoder, path: str | os.PathLike, reference: dict | None = None) -> None:
    """Load a weights file into ``model`` (built for it, e.g. by :func:`build_seeded`).

    A file with a tower reference holds only what trained: the model's own tower tensors stand
    for the rest after their hashes are checked against the reference.

    Raises:
        UserError: a damaged or foreign file, or towers that differ from the run's (one line).
    """
    reference = weights_reference(path) if reference is None else reference
    state = load_safetensors(path)  # checked against the sha256 recorded when it was saved
    own = model.state_dict()
    towers = (reference or {}).get("towers", {})
    mismatch = state_mismatch(own, state, left_out=tuple(t + "." for t in towers))
    if mismatch:
        theirs = (reference or {}).get("preset") or "not recorded in the file"
        raise UserError(
            f"cannot load {path}: {mismatch}; another model's weights? (the run's config.json: {describe_model(model.config)};"
            f" the file's preset: {theirs})"
        )
    if reference is None:
        try:
            model.load_state_dict(state)
        except Exception as err:  # load_state_dict raises many types for foreign files
            raise UserError(f"cannot load {path}: {first_line(err)}") from None
        return
    left_out = sorted(set(own) - set(state))
    for tower, ref in towers.items():
        keys = [k for k in left_out if k.startswith(tower + ".")]
        digest = tensors_hash(own, keys)
        if len(keys) != ref.get("tensors") or digest != ref.get("sha256"):
            installed = tower_packages(model.config.preset)
            trained = reference.get("packages", {})
            differ = ", ".join(f"{n} {trained.get(n)} (installed: {installed.get(n)})" for n in trained if trained.get(n) != installed.get(n))
            raise UserError(
                f"{path}: the {tower.replace('_', ' ')} built here differs from the one the run was trained with"
                f" (sha256 {digest[:12]}, the run's {str(ref.get('sha256'))[:12]}; "
                f"{'trained with ' + differ if differ else 'same package versions'}); install the run's versions"
            )
    try:
        model.load_state_dict(state, strict=False)
    except Exception as err:
        raise UserError(f"cannot load {path}: {first_line(err)}") from None


def state_mismatch(own: dict, state: dict, left_out: tuple[str, ...] = ()) -> str | None:
    """The first tensor that keeps ``state`` from loading into a model whose state dict is ``own``: missing
    (not counting keys under the ``left_out`` prefixes: towers a run rebuilds), unexpected, or of another
    shape; None when it loads."""
    missing = sorted(k for k in set(own) - set(state) if not k.startswith(left_out))
    unexpected = sorted(set(state) - set(own))
    shaped = [k for k in own if k in state and tuple(own[k].shape) != tuple(state[k].shape)]
    counts = f" ({len(missing)} missing, {len(unexpected)} unexpected, {len(shaped)} of another shape)"
    if missing:
        return f"missing tensor {missing[0]}{counts}"
    if unexpected:
        return f"unexpected tensor {unexpected[0]}{counts}"
    if shaped:
        k = shaped[0]
        return f"tensor {k} is {tuple(state[k].shape)} in the weights, {tuple(own[k].shape)} in the model{counts}"
    return None


def describe_model(config) -> str:
    """A model by what decides its tensors: preset, D and head kind (a ModelConfig or its dict)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    return f"preset {get('preset')}, D={get('embed_dim')}, {get('head') or 'linear'} heads"


def tensors_hash(state: dict, keys: Iterable[str]) -> str:
    """sha256 over the named tensors of ``state`` (:func:`triclip.core.io.tensors_sha256`: in name order)."""
    return tensors_sha256({key: state[key] for key in keys})


def _version(name: str) -> str | None:
    try:
        return package_metadata.version(name)
    except package_metadata.PackageNotFoundError:
        return None


