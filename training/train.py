"""``triclip train``: contrastive training of a dual encoder on paired data.

Top-down: ``train`` sets up data, model, objective and optimizer, then runs
epochs of ``_train_step``; every epoch it evaluates on the validation data,
appends to metrics.jsonl / TensorBoard and writes a checkpoint. Under torchrun
(``RANK``/``WORLD_SIZE`` set) it trains data-parallel: ``--batch-size`` is per
rank, the objectives see the global batch (``retrieval.distributed``).

Determinism for ``--resume``: the order of epoch e is a permutation drawn from
``(seed, e)``, the caption of record i in epoch e from ``(seed, e, i)``; a resumed
run skips the batches already done and continues the same sequence.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from retrieval.data import DataConfig, load_pairs
from retrieval.errors import UserError
from retrieval.losses import build_loss
from retrieval.model import DualEncoder, ModelConfig, build_model
from training import checkpoint as ckpt
from training.batches import BatchSource
from retrieval.cache import locked_tower_outputs
from training.evaluate import evaluate
from training.optim import AdamW


@dataclass
class TrainConfig:
    train_data: str  # training data source (any format of retrieval.data)
    out: str  # run directory
    val_data: str | None = None  # evaluated after every epoch
    model: str = "tiny"  # preset: tiny, lite, or an open_clip architecture
    pretrained: str | None = None  # open_clip pretrained tag
    embed_dim: int | None = None  # D (None: per preset)
    head: str | None = None  # projection heads: linear or mlp (None: DEFAULT_HEAD of the preset, else linear)
    text_max_length: int | None = None  # lite: caption tokens kept (None: 256; 64 bounds memory when the text tower trains)
    importance: str = "softplus_mean1"  # how the model makes w from theta (retrieval.model.IMPORTANCE_FORMS)
    importance_spread: float | None = None  # w starts as a ramp 1 ... 1/spread (None: DEFAULT_SPREAD if trained, else 1)
    importance_lr_scale: float = 1.0  # theta's learning rate = lr * this (Adam moves theta ~lr per step)
    tower_lr_scale: float = 1.0  # unlocked towers' learning rate = lr * this (pretrained towers: < 1)
    importance_block: bool = False  # one Adam second moment for all of theta (training.optim): steps keep relative sizes
    loss: str = "tricl"  # objective name (retrieval.losses)
    loss_options: dict = field(default_factory=dict)  # keyword options of the objective
    epochs: int = 1
    batch_size: int = 64  # per rank
    lr: float | None = None  # peak learning rate (None: per preset)
    weight_decay: float = 0.1  # AdamW, on weight matrices only
    warmup_steps: int | None = None  # linear warmup (None: 5% of all steps)
    grad_clip: float = 1.0  # max global grad norm (0: off)
    resume: bool = False  # continue from RUN/checkpoint
    lock_image: bool = False  # freeze the image tower, cache its outputs
    lock_text: bool = False  # freeze the text tower, cache its outputs
    seed: int = 0
    workers: int = 0  # DataLoader worker processes for image decoding
    save_every: int = 0  # also checkpoint every N steps (0: only per epoch)
    max_steps: int | None = None  # stop early after this many steps (benchmarks, smoke runs)
    device: str | None = None  # cpu, cuda, cuda:1 (None: cuda when available)
    data: DataConfig = field(default_factory=DataConfig)  # how to read the sources
    eval_batch_size: int = 256
    log_every: int = 10  # TensorBoard scalars every N steps


DEFAULT_LR = {"tiny": 1e-3, "lite": 1e-4}  # other (open_clip) models: 5e-4
DEFAULT_HEAD = {"lite": "mlp"}  # pretrained towers: MLP heads beat linear ones for every objective (README ablation)
DEFAULT_SPREAD = 100.0  # the start of w that lets tricl learn an ordering (README: the importance ablation)
# Objective options the trainer adds unless given: tricl trains its top-m scores too (README: the ablation).
DEFAULT_LOSS_OPTIONS = {"tricl": {"nested": 4}}


def train(cfg: TrainConfig) -> dict:
    """Train and return the last evaluation (or {} without validation data)."""
    _validate(cfg)
    rank, world = _init_distributed()
    device = _pick_device(cfg.device, rank)
    run = Path(cfg.out)
    _check_run_dir(run, cfg)
    torch.manual_seed(cfg.seed)

    train_pairs = load_pairs(cfg.train_data, cfg.data)
    val_pairs = load_pairs(cfg.val_data, cfg.data) if cfg.val_data else None
    cfg = replace(cfg, loss_options={**DEFAULT_LOSS_OPTIONS.get(cfg.loss, {}), **cfg.loss_options})  # to config.json
    try:
        loss_fn = build_loss(cfg.loss, **cfg.loss_options).to(device)
    except (KeyError, ValueError, TypeError) as err:
        raise UserError(f"--loss {cfg.loss} {cfg.loss_options}: {err}") from None
    trains_importance = getattr(loss_fn, "needs_importance", False)
    model_cfg = ModelConfig(
        preset=cfg.model,
        pretrained=cfg.pretrained,
        embed_dim=cfg.embed_dim,
        head=cfg.head or DEFAULT_HEAD.get(cfg.model, "linear"),
        importance=cfg.importance,
        importance_spread=_importance_spread(cfg.importance_spread, trains_importance),
        text_max_length=cfg.text_max_length,
    )
    model = build_model(model_cfg).to(device)
    model.lock(image=cfg.lock_image, text=cfg.lock_text)
    if not trains_importance:
        model.theta.requires_grad_(False)  # w stays as initialised: the objective does not see it

    source = BatchSource(model, train_pairs, cfg.seed, device, cfg.batch_size * world, cfg.workers)
    steps_per_epoch = source.batches_per_epoch()
    total_steps = min(steps_per_epoch * cfg.epochs, cfg.max_steps or math.inf)
    optimizer = _make_optimizer(
        model,
        loss_fn,
        cfg.lr or DEFAULT_LR.get(cfg.model, 5e-4),
        cfg.weight_decay,
        cfg.importance_lr_scale,
        cfg.importance_block,
        cfg.tower_lr_scale,
    )
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, int(0.05 * total_steps))
    base_lrs = [g["lr"] for g in optimizer.param_groups]

    state = {"step": 0, "epoch": 0, "batch": 0}
    if cfg.resume:
        state = ckpt.load_checkpoint(run, model, {"loss": loss_fn}, optimizer)
        _truncate_metrics(run, state["epoch"])
    elif rank == 0:
        run.mkdir(parents=True, exist_ok=True)
        ckpt.write_config(run, _run_config(cfg, model_cfg))

    step_module = _StepModule(model, loss_fn)
    if world > 1:
        step_module = torch.nn.parallel.DistributedDataParallel(
            step_module,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=True,  # e.g. the logit scale under triplet / contrastive
        )
    writer = _tensorboard(run) if rank == 0 else None
    last_eval: dict = {}
    step = state["step"]
    for epoch in range(state["epoch"], cfg.epochs):
        first_batch = state["batch"] if epoch == state["epoch"] else 0
        bar = tqdm(total=steps_per_epoch, initial=first_batch, desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=rank != 0)
        speed = _Throughput(window=20)
        model.train()
        done = first_batch  # batches of this epoch finished
        for b, batch in source.epoch(epoch, first_batch, rank, world):
            if step >= total_steps:
                break
            lr_scale = _lr_scale(step, warmup, total_steps)
            for group, base in zip(optimizer.param_groups, base_lrs):
                group["lr"] = base * lr_scale
            terms = _train_step(step_module, batch, optimizer, model, cfg.grad_clip, device)
            step += 1
            done = b + 1
            speed.add(batch.size * world)
            bar.update(1)
            bar.set_postfix(loss=f"{sum(terms.values()):.4f}", samples_s=f"{speed.rate():.0f}")
            if writer and step % cfg.log_every == 0:
                for name, value in terms.items():
                    writer.add_scalar(f"train/{name}", value, step)
                writer.add_scalar("train/logit_scale", model.logit_scale().item(), step)
                writer.add_scalar("train/lr", optimizer.param_groups[0]["lr"], step)
            if cfg.save_every and step % cfg.save_every == 0 and done < steps_per_epoch:
                _save(run, rank, model, loss_fn, optimizer, {"step": step, "epoch": epoch, "batch": done})
        bar.close()
        epoch_done = done >= steps_per_epoch
        if rank == 0 and val_pairs is not None:
            last_eval = evaluate(model, val_pairs, device, batch_size=cfg.eval_batch_size, cache=locked_tower_outputs(model, val_pairs, device, cfg.workers))
            record = {"epoch": epoch + 1, "step": step, **last_eval}
            ckpt.append_metrics(run, record)
            if writer:
                for name, value in last_eval.items():
                    if isinstance(value, (int, float)):
                        writer.add_scalar(f"val/{name}", value, step)
            print(_summary_line(record))
        next_state = {"step": step, "epoch": epoch + 1, "batch": 0} if epoch_done else {"step": step, "epoch": epoch, "batch": done}
        _save(run, rank, model, loss_fn, optimizer, next_state)
        if step >= total_steps:
            break
    if source.skipped and rank == 0:
        print(f"skipped records: {dict(source.skipped)}")
    if writer:
        writer.close()
    if world > 1:
        dist.barrier()
    return last_eval


# ---------------------------------------------------------------------------- one step


class _StepModule(torch.nn.Module):
    """Model + objective in one module, so DDP sees every trainable tensor in forward."""

    def __init__(self, model: DualEncoder, loss_fn: torch.nn.Module):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, image_input, text_input, image_is_features: bool, text_is_features: bool):
        m = self.model
        img_feats = image_input if image_is_features else m.image_features(image_input)
        txt_feats = text_input if text_is_features else m.text_features(text_input)
        image_z, text_z = m.project_image(img_feats), m.project_text(txt_feats)  # (B, D) each
        return self.loss_fn(image_z.float(), text_z.float(), m.logit_scale(), m.importance())


def _train_step(step_module, batch, optimizer, model: DualEncoder, grad_clip: float, device) -> dict[str, float]:
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    with autocast:
        terms = step_module(batch.image, batch.text, batch.image_is_features, batch.text_is_features)
    loss = sum(terms.values())
    if not torch.isfinite(loss):
        values = {k: float(v.detach()) for k, v in terms.items()}
        raise UserError(f"loss became {float(loss.detach())} ({values}); stopping without writing a checkpoint (lower --lr?)")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], grad_clip)
    optimizer.step()
    return {k: float(v.detach()) for k, v in terms.items()}


def _make_optimizer(
    model: DualEncoder,
    loss_fn: torch.nn.Module,
    lr: float,
    weight_decay: float,
    importance_lr_scale: float = 1.0,
    importance_block: bool = False,
    tower_lr_scale: float = 1.0,
) -> torch.optim.Optimizer:
    """AdamW; weight decay only on weight matrices (not the logit scale, importance, norms, biases);
    tower parameters at ``lr * tower_lr_scale``; the importance parameter theta in a group of its
    own (``lr * importance_lr_scale``, ``block``)."""
    split: dict[tuple[bool, bool], list] = {(d, t): [] for d in (True, False) for t in (False, True)}
    for module in (model, loss_fn):
        for name, p in module.named_parameters():
            if p.requires_grad and p is not model.theta:
                tower = module is model and name.startswith(("image_tower.", "text_tower."))
                split[(p.ndim >= 2, tower)].append(p)
    groups = [
        {"params": ps, "weight_decay": weight_decay if decay else 0.0, "lr": lr * (tower_lr_scale if tower else 1.0)}
        for (decay, tower), ps in split.items()
        if ps
    ]
    if model.theta.requires_grad:
        theta_group = {"params": [model.theta], "weight_decay": 0.0, "lr": lr * importance_lr_scale}
        groups.append({**theta_group, "block": importance_block})
    if not any(g.get("block") for g in groups):  # same math as ours, one fused kernel (benchmarks/bench_train.py)
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-6, fused=True)
    return AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-6)


def _lr_scale(step: int, warmup: int, total: float) -> float:
    """Linear warmup to 1, then cosine to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1.0, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class _Throughput:
    """Samples per second over the last ``window`` steps."""

    def __init__(self, window: int):
        self.events: deque = deque(maxlen=window + 1)
        self.events.append((time.perf_counter(), 0))

    def add(self, n: int) -> None:
        self.events.append((time.perf_counter(), self.events[-1][1] + n))

    def rate(self) -> float:
        (t0, n0), (t1, n1) = self.events[0], self.events[-1]
        return (n1 - n0) / max(t1 - t0, 1e-9)


# ---------------------------------------------------------------------------- setup helpers


def _validate(cfg: TrainConfig) -> None:
    if cfg.epochs < 1:
        raise UserError(f"--epochs must be >= 1, got {cfg.epochs}")
    if cfg.batch_size < 2:
        raise UserError(f"--batch-size must be >= 2 (contrastive losses need negatives), got {cfg.batch_size}")
    if cfg.lr is not None and cfg.lr <= 0:
        raise UserError(f"--lr must be > 0, got {cfg.lr}")
    if cfg.text_max_length is not None and cfg.text_max_length < 2:
        raise UserError(f"--text-max-length must be >= 2 ([CLS] and [SEP]), got {cfg.text_max_length}")
    for path in (cfg.train_data, cfg.val_data):
        if path and not path.startswith("hf:") and not _source_exists(path):
            raise UserError(f"no such data source: {path}")


def _importance_spread(spread: float | None, trains_importance: bool) -> float:
    """The initial ramp of w: a model whose objective ignores w keeps w = 1 (plain cosine)."""
    if spread is None:
        return DEFAULT_SPREAD if trains_importance else 1.0
    return spread


def _source_exists(path: str) -> bool:
    return Path(path).exists() or "{" in path


def _check_run_dir(run: Path, cfg: TrainConfig) -> None:
    has_run = (run / ckpt.CONFIG).exists()
    if cfg.resume and not has_run:
        raise UserError(f"--resume: {run} is not a run (no {ckpt.CONFIG})")
    if not cfg.resume and has_run:
        raise UserError(f"{run} already holds a run; pass --resume to continue it or choose another --out")
    if cfg.resume:
        saved = ckpt.read_config(run)["train"]
        for key in ("model", "loss", "batch_size", "seed", "lock_image", "lock_text"):
            if saved.get(key) != getattr(cfg, key):
                raise UserError(f"--resume: {key} differs from the run's ({getattr(cfg, key)!r} vs {saved.get(key)!r})")


def _run_config(cfg: TrainConfig, model_cfg: ModelConfig) -> dict:
    train_cfg = asdict(cfg)
    train_cfg["data"] = asdict(cfg.data)
    return {"model": model_cfg.to_dict(), "loss": cfg.loss, "loss_options": cfg.loss_options, "train": train_cfg}


def _truncate_metrics(run: Path, epochs_done: int) -> None:
    """Drop evaluations of epochs that the checkpoint does not cover (a crash between the two)."""
    import json

    path = run / ckpt.METRICS
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get("epoch", 0) <= epochs_done]
    if len(kept) != len(lines):
        from retrieval.io import write_text_atomic

        write_text_atomic(path, "".join(line + "\n" for line in kept))


def _save(run: Path, rank: int, model, loss_fn, optimizer, state: dict) -> None:
    if rank == 0:
        ckpt.save_checkpoint(run, model, {"loss": loss_fn}, optimizer, state)


def _init_distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def _pick_device(name: str | None, rank: int) -> torch.device:
    if name:
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"--device {name}: CUDA is not available")
        return torch.device(name)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _tensorboard(run: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional at run time
        return None
    return SummaryWriter(str(run / "tensorboard"))


def _summary_line(record: dict) -> str:
    keys = ("epoch", "i2t_r1", "i2t_r10", "t2i_r1", "t2i_r10", "align", "uniform")
    return "eval " + " ".join(f"{k}={record[k]:.4g}" if isinstance(record.get(k), float) else f"{k}={record.get(k)}" for k in keys if k in record)
