"""``triclip train``: contrastive training of a dual encoder on paired data.

Top-down: ``train`` settles the settings (a resumed run takes its own from
``config.json``), sets up data, model, objective and optimizer, then runs epochs
of ``_train_step``; every epoch it evaluates on the validation data, appends to
metrics.jsonl / TensorBoard, keeps the best epoch (validation t2i_r10) in
``RUN/best`` and writes a checkpoint; it ends with a summary paragraph. Under
torchrun (``RANK``/``WORLD_SIZE`` set) it trains data-parallel: ``--batch-size``
is per rank, the objectives see the global batch (``triclip.core.distributed``).

Run folders (``triclip.training.checkpoint``): ``config.json`` records the values used
(the learning rate, warmup, heads, spread, objective options after the defaults
are filled in). ``--resume`` rebuilds everything from it: an option typed again
must agree with it (``epochs`` and ``max_steps`` may grow the run; ``workers``,
``device``, ``save_every``, ``log_every`` and ``eval_batch_size`` are free). A
folder killed before its first checkpoint holds no trained weights: training
into it again starts over, with or without ``--resume``.

Determinism for ``--resume``: the order of epoch e is a permutation drawn from
``(seed, e)``, the caption of record i in epoch e from ``(seed, e, i)``; a resumed
run skips the batches already done and continues the same sequence.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist
from triclip.core.progress import progress

from triclip.model.unlock import eval_caches, partly_lock
from triclip.core.config import carry
from triclip.data import PairSet, load_pairs
from triclip.core.errors import UserError, first_line
from triclip.core.io import claim_output_dir, write_json_atomic, writing
from triclip.losses import build_loss
from triclip.model.model import DualEncoder, ModelConfig, build_model
from triclip.training import checkpoint as ckpt
from triclip.training.batches import BatchSource
from triclip.training.config import TrainConfig, check_train, flag
from triclip.training.evaluate import evaluate, format_table
from triclip.training.selection import STOP_RULE, EarlyStop, Selection, early_stop, select
from triclip.training.optim import AdamW
from triclip.training.resolve import explicit_fields, resolve_config

__all__ = ["TrainConfig", "train"]

BEST_METRIC = "t2i_r10"  # the validation metric that picks RUN/best


def train(cfg: TrainConfig, given: set[str] | None = None) -> dict:
    """Train and return the last evaluation (or {} without validation data).

    Args:
        cfg: the settings.
        given: the fields the user set (dotted for nested ones: ``"data.sep"``), as
            ``triclip.app.options.given_fields`` reports them; None: every field that differs
            from its default. With ``cfg.resume`` these must agree with the run's
            config.json and every other setting is taken from it.
    """
    rank, world = _init_distributed()
    reuse = _check_out(Path(cfg.out), cfg.resume, cfg.overwrite)
    if rank != 0:  # rank 0 holds the folder (its mark, lock, a replacement's staging folder)
        return _train(cfg, given, Path(cfg.out), rank, world)
    with writing(cfg.out, "run", overwrite=cfg.overwrite, reuse=reuse, stage=world == 1) as run:
        return _train(cfg, given, run, rank, world)


def _train(cfg: TrainConfig, given: set[str] | None, run: Path, rank: int, world: int) -> dict:
    """:func:`train` writing into ``run`` (``--out``, or the folder that replaces it at the end)."""
    if rank == 0:
        ckpt.remove_orphans(run)  # temp files of writes a kill cut short (a run or a --resume of this folder)
    settled = _settle(cfg, given, run, rank, world)
    cfg, model, model_cfg, loss_fn, init_source = _build(settled.cfg, run, settled.saved, settled.device)
    loop = _Loop(cfg, run, rank, world, settled.device, model, loss_fn, settled.train, settled.val)
    loop.resume_or_start()
    if rank == 0:
        (run / ckpt.SELECTION).unlink(missing_ok=True)  # undecided until the end (eval / index: RUN/best meanwhile)
        ckpt.write_config(run, _run_config(loop.cfg, model_cfg, str(settled.device), settled.train, settled.val,
                                           init_source))
    return loop.run()


@dataclass
class _Settled:
    """A run's settings and data, before anything is built."""

    cfg: TrainConfig  # every field decided (a preset's recipe, a resumed run's config.json, the data size)
    saved: dict | None  # the config.json resumed from (None: a new run)
    device: torch.device
    train: PairSet
    val: PairSet | None


def _settle(cfg: TrainConfig, given: set[str] | None, run: Path, rank: int, world: int) -> _Settled:
    """The settings (``triclip.training.resolve``), checked, and the data they read."""
    saved = _saved_run(run, cfg.resume, cfg.overwrite)
    explicit = explicit_fields(cfg) if given is None else set(given)  # before any default fills a field
    resumed = (run / ckpt.CONFIG, saved) if saved is not None else None
    init_model = ckpt.read_config(cfg.init)["model"] if cfg.init and saved is None else None
    settled = resolve_config(cfg, explicit, resumed, init_model, world=world)  # all but what the data size says
    _validate(settled)
    device = _pick_device(settled.device, rank)
    torch.manual_seed(settled.seed)

    train_pairs = load_pairs(settled.train_data, settled.data)
    val_pairs = load_pairs(settled.val_data, settled.data) if settled.val_data else None
    if saved is not None:
        _check_same_data(saved, train_pairs, val_pairs)
    cfg = resolve_config(cfg, explicit, resumed, init_model, len(train_pairs.records), world)
    if cfg.batch_size != settled.batch_size:
        print(f"{len(train_pairs.records)} training records: batch {cfg.batch_size} instead of the {cfg.model}"
              f" recipe's {settled.batch_size}, so that an epoch holds two full batches (--batch-size sets it)",
              flush=True)
    return _Settled(cfg, saved, device, train_pairs, val_pairs)


def _build(cfg: TrainConfig, run: Path, saved: dict | None, device: torch.device):
    """The objective and the model (its ``--init`` weights loaded, towers locked as asked); returns
    ``(cfg with D filled in, model, its ModelConfig, objective, the init as config.json records it)``."""
    loss_fn = build_loss(cfg.loss, **cfg.loss_options).to(device)  # what build_loss(cfg.loss) alone makes, spelled out
    trains_importance = getattr(loss_fn, "needs_importance", False)
    model_cfg = carry(ModelConfig, cfg, preset=cfg.model)  # the model fields of the settings
    torch.manual_seed(cfg.seed)  # the towers as the seed makes them: a run leaves frozen ones out (triclip.training.checkpoint)
    model = build_model(model_cfg).to(device)  # fills model_cfg.embed_dim
    ckpt.mark_built(model, cfg.seed)
    init_source = _init_source(cfg.init, saved)  # what config.json records of the init
    if cfg.init and not (cfg.resume and ckpt.has_checkpoint(run)):  # a checkpoint holds what the init started
        _load_init(model, cfg.init, init_source)
    cfg = replace(cfg, embed_dim=model_cfg.embed_dim)
    model.lock(image=cfg.lock_image and not cfg.unlock_image_groups, text=cfg.lock_text and not cfg.unlock_text_layers)
    partly_lock(model, cfg.unlock_image_groups, cfg.unlock_text_layers)  # frozen bottoms, cached (triclip.model.unlock)
    if not trains_importance:
        model.theta.requires_grad_(False)  # w stays as initialised: the objective does not see it
    if cfg.fixed_logit_scale is not None:  # held, not trained (docs/results.md, "Earlier evidence")
        with torch.no_grad():
            model.logit_scale_param.fill_(math.log(cfg.fixed_logit_scale))
        model.logit_scale_param.requires_grad_(False)
    return cfg, model, model_cfg, loss_fn, init_source


class _Loop:
    """The epochs of one run: batches, evaluation, the best epoch, checkpoints, early stopping, the end."""

    def __init__(self, cfg: TrainConfig, run: Path, rank: int, world: int, device, model: DualEncoder, loss_fn,
                 train_pairs: PairSet, val_pairs: PairSet | None):
        self.run_dir, self.rank, self.world, self.device = run, rank, world, device
        self.model, self.loss_fn, self.train_pairs, self.val_pairs = model, loss_fn, train_pairs, val_pairs
        self.source = BatchSource(
            model, train_pairs, cfg.seed, device, cfg.batch_size * world, cfg.workers, cfg.cached_views, cfg.cache_budget
        )
        self.steps_per_epoch = self.source.batches_per_epoch()
        self.total_steps = min(self.steps_per_epoch * cfg.epochs, cfg.max_steps or math.inf)
        if cfg.warmup_steps is None:
            cfg = replace(cfg, warmup_steps=max(1, int(0.05 * self.total_steps)))
        self.cfg = cfg
        self.optimizer = _make_optimizer(model, loss_fn, cfg.lr, cfg.weight_decay, cfg.importance_lr_scale,
                                         cfg.importance_block, cfg.tower_lr_scale)
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.state, self.best = {"step": 0, "epoch": 0, "batch": 0}, _HeldBest(None)
        self.last_eval: dict = {}
        self.leftover_checked = False

    def resume_or_start(self) -> None:
        """The checkpoint's state (``--resume``), or a run started over (rank 0 clears what a killed one left)."""
        run = self.run_dir
        if self.cfg.resume and ckpt.has_checkpoint(run):
            self.state = ckpt.load_checkpoint(run, self.model, {"loss": self.loss_fn}, self.optimizer)
            _truncate_metrics(run, self.state["epoch"])
            self.best = _HeldBest(ckpt.best_info(run, held=True))
        elif self.rank == 0:
            ckpt.start_over(run)  # a new run, or one killed before its first checkpoint

    def run(self) -> dict:
        """Every epoch left, then the selection and the summary; returns the last evaluation ({} without val data)."""
        cfg, run = self.cfg, self.run_dir
        self.step_module = _StepModule(self.model, self.loss_fn)
        if self.world > 1:
            self.step_module = torch.nn.parallel.DistributedDataParallel(
                self.step_module,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=True,  # e.g. the logit scale under triplet / contrastive
            )
        self.writer = _tensorboard(run) if self.rank == 0 else None
        self.skipped = _Skipped(self.train_pairs, self.val_pairs, _previous_skipped(run) if cfg.resume else {})
        self.step = self.state["step"]
        self.stop = _early_stop(run, cfg) if cfg.resume else None  # a resumed run that had stopped stays stopped
        for epoch in range(self.state["epoch"], cfg.epochs if self.stop is None else self.state["epoch"]):
            if self.epoch(epoch):
                break
        return self.finish()

    def epoch(self, epoch: int) -> bool:
        """Train one epoch (the rest of it when resumed mid-epoch), evaluate, checkpoint; True when the run is over."""
        first_batch = self.state["batch"] if epoch == self.state["epoch"] else 0
        epoch_start_step = self.step
        done, stopped = self.batches(epoch, first_batch)
        if not stopped:
            done = self.steps_per_epoch  # also when the last batches had no decodable image
        epoch_done = done >= self.steps_per_epoch
        if self.rank == 0 and epoch_done and first_batch == 0 and not self.leftover_checked:
            self.source.check_leftover(epoch)  # then every training image has been decoded once
            self.leftover_checked = True
        self.skipped.train.update_from(self.source)
        if self.step == epoch_start_step and first_batch < self.steps_per_epoch and self.step < self.total_steps:
            self.no_batch_used()
        if self.rank == 0 and self.val_pairs is not None:
            self.evaluate(epoch, epoch_done)
        if self.world > 1:
            self.stop = _broadcast(self.stop)
        if self.rank == 0:
            self.skipped.write(self.run_dir)
        next_state = {"step": self.step, "epoch": epoch + 1, "batch": 0} if epoch_done else {
            "step": self.step, "epoch": epoch, "batch": done}
        finished = self.step >= self.total_steps or epoch + 1 >= self.cfg.epochs or self.stop is not None
        if finished or (epoch + 1) % self.cfg.checkpoint_every == 0:  # a finished run keeps no optimizer state
            self.save(next_state, keep_optimizer=not finished)
        return self.step >= self.total_steps or self.stop is not None

    def batches(self, epoch: int, first_batch: int) -> tuple[int, bool]:
        """The epoch's training steps from ``first_batch``; returns (batches done, stopped by the step limit)."""
        cfg, optimizer = self.cfg, self.optimizer
        bar = progress(total=self.steps_per_epoch, initial=first_batch, desc=f"epoch {epoch + 1}/{cfg.epochs}",
                       disable=self.rank != 0)
        speed = _Throughput(window=20)
        self.model.train()
        done, stopped = first_batch, False
        for b, batch in self.source.epoch(epoch, first_batch, self.rank, self.world):
            if self.step >= self.total_steps:
                stopped = True
                break
            lr_scale = _lr_scale(self.step, cfg.warmup_steps, self.total_steps)
            for group, base in zip(optimizer.param_groups, self.base_lrs):
                group["lr"] = base * lr_scale
            terms = _train_step(self.step_module, batch, optimizer, self.model, cfg.grad_clip, self.device)
            self.step += 1
            done = b + 1
            speed.add(batch.size * self.world)
            bar.update(1)
            bar.set_postfix(loss=f"{sum(terms.values()):.4f}", samples_s=f"{speed.rate():.0f}")
            if self.writer and self.step % cfg.log_every == 0:
                self.log_step(terms)
            if cfg.save_every and self.step % cfg.save_every == 0 and done < self.steps_per_epoch:
                self.save({"step": self.step, "epoch": epoch, "batch": done})
        bar.close()
        return done, stopped

    def log_step(self, terms: dict[str, float]) -> None:
        for name, value in terms.items():
            self.writer.add_scalar(f"train/{name}", value, self.step)
        self.writer.add_scalar("train/logit_scale", self.model.logit_scale().item(), self.step)
        self.writer.add_scalar("train/lr", self.optimizer.param_groups[0]["lr"], self.step)

    def no_batch_used(self) -> None:
        """UserError: an epoch trained no step (no image decoded, or too few for a negative)."""
        if self.rank == 0:
            self.skipped.write(self.run_dir)
        records = len(self.train_pairs.records)
        decoded = records - sum(self.skipped.train.decoded.values())  # images that did decode
        why = "no image decoded" if decoded <= 0 else (
            f"only {decoded} of {records} images decoded, and a batch needs 2 to have a negative"
        )
        first = self.source.dataset.first_failure()  # the images decoded in the epochs: why the first one did not
        raise UserError(
            f"no training batch of {self.cfg.train_data} could be used ({why});"
            f" skipped: {self.skipped.train.text() or 'none'}; no weights were saved"
            + (f"; the first that failed: {first}" if first else "")
        )

    def evaluate(self, epoch: int, epoch_done: bool) -> None:
        """Validation metrics after an epoch: metrics.jsonl, TensorBoard, the best epoch, early stopping."""
        cfg, model, device = self.cfg, self.model, self.device
        self.last_eval = evaluate(
            model, self.val_pairs, device, batch_size=cfg.eval_batch_size,
            cache=eval_caches(model, self.val_pairs, device, cfg.workers, cfg.cache_budget), workers=cfg.workers,
        )
        self.skipped.val.decoded = Counter(self.last_eval.pop("skipped", {}))
        record = {"epoch": epoch + 1, "step": self.step, **self.last_eval}
        ckpt.append_metrics(self.run_dir, record)
        if self.writer:
            for name, value in self.last_eval.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(f"val/{name}", value, self.step)
        print(_summary_line(record))
        self.best.offer(model, epoch + 1, self.step, self.last_eval[BEST_METRIC])  # written with the next checkpoint
        self.stop = _early_stop(self.run_dir, cfg) if epoch_done else None

    def save(self, state: dict, keep_optimizer: bool = True) -> None:
        _save(self.run_dir, self.rank, self.model, self.loss_fn, self.optimizer, state, self.best, keep_optimizer)

    def finish(self) -> dict:
        """Close the log; rank 0 keeps the best or the last weights and prints the summary."""
        if self.writer:
            self.writer.close()
        if self.rank == 0:
            self.skipped.train.update_from(self.source)
            self.skipped.write(self.run_dir)
            selection = _select(self.run_dir, self.cfg, self.best.info, self.val_pairs, self.stop)
            # named as --out: with --overwrite the run is written beside it and takes its place when done
            print(_final_summary(Path(self.cfg.out), self.cfg, self.step, selection, self.skipped, self.stop))
        if self.world > 1:
            dist.barrier()
        return self.last_eval


# ---------------------------------------------------------------------------- skipped records


class _Counts:
    """Records of one source left out: when it was read, when images were decoded, and (resumed
    runs) what earlier processes counted: each reason's count is the largest seen, as a process
    that resumes mid-epoch meets fewer records."""

    def __init__(self, pairs, previous: dict):
        self.read = Counter(pairs.skipped) if pairs is not None else Counter()
        self.decoded: Counter = Counter()
        self.previous = Counter({k: v for k, v in previous.items() if isinstance(v, int)})

    def update_from(self, source: BatchSource) -> None:
        self.decoded = Counter(source.skipped)

    def total(self) -> Counter:
        return (self.read + self.decoded) | self.previous

    def text(self) -> str:
        return ", ".join(f"{reason} {n}" for reason, n in sorted(self.total().items()))


class _Skipped:
    """Skipped records of the training and validation sources, by reason (RUN/skipped.json)."""

    def __init__(self, train_pairs, val_pairs, previous: dict):
        self.train = _Counts(train_pairs, previous.get("train") or {})
        self.val = _Counts(val_pairs, previous.get("val") or {})
        self.has_val = val_pairs is not None

    def as_dict(self) -> dict:
        out = {"train": dict(sorted(self.train.total().items()))}
        if self.has_val:
            out["val"] = dict(sorted(self.val.total().items()))
        return out

    def write(self, run: Path) -> None:
        write_json_atomic(run / ckpt.SKIPPED, self.as_dict())

    def text(self) -> str:
        parts = [f"{name}: {counts.text() or 'none'}" for name, counts in (("train", self.train), ("val", self.val))]
        return "; ".join(parts if self.has_val else parts[:1])


def _previous_skipped(run: Path) -> dict:
    """RUN/skipped.json of the run being resumed ({} when missing or unreadable: it is only a report)."""
    import json

    try:
        previous = json.loads((run / ckpt.SKIPPED).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(previous, dict):
        return {}
    return {k: v for k, v in previous.items() if isinstance(v, dict)}


def _scored(run: Path) -> list[dict]:
    """metrics.jsonl's evaluations that carry the selection metric, in epoch order."""
    return [r for r in ckpt.read_metrics(run) if isinstance(r.get(BEST_METRIC), (int, float))]


def _queries(record: dict, val_pairs=None) -> int:
    """The distinct validation queries ``record``'s t2i recall averages over (older records: counted)."""
    if record.get("t2i_queries") or val_pairs is None:
        return int(record.get("t2i_queries") or 1)
    return len({c for r in val_pairs.records for c in r.captions})


def _early_stop(run: Path, cfg: TrainConfig) -> EarlyStop | None:
    """Whether the evaluations so far say stop (``triclip.training.selection.early_stop``; None: go on)."""
    records = _scored(run)
    if not records or not cfg.patience:
        return None
    values = [r[BEST_METRIC] for r in records]
    return early_stop(values, _queries(records[-1]), cfg.patience, cfg.epochs, cfg.select_factor, BEST_METRIC)


def _broadcast(stop: EarlyStop | None) -> EarlyStop | None:
    """Rank 0's decision on every rank (only rank 0 evaluates)."""
    box = [stop]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _select(run: Path, cfg: TrainConfig, best: dict | None, val_pairs, stop: EarlyStop | None = None) -> tuple[Selection, dict] | None:
    """Keep RUN/best or the last weights (``triclip.training.selection``), write RUN/selection.json (with the
    early-stopping rule and whether it stopped); returns the decision and the kept epoch's evaluation
    (None without validation)."""
    records = _scored(run)
    if best is None or not records:
        return None
    last = records[-1]
    queries = _queries(last, val_pairs)
    selection = select((best["epoch"], best["value"]), (last["epoch"], last[BEST_METRIC]), queries, cfg.select_factor, BEST_METRIC)
    stopping = {"patience": cfg.patience, "rule": STOP_RULE.format(metric=BEST_METRIC), "stopped": stop is not None}
    if stop is not None:
        stopping.update(asdict(stop))
    write_json_atomic(run / ckpt.SELECTION, {**selection.to_dict(), "early_stopping": stopping})
    kept = next((r for r in records if r.get("epoch") == selection.kept_epoch), last)
    return selection, kept


def _final_summary(
    run: Path, cfg: TrainConfig, step: int, selection: tuple[Selection, dict] | None, skipped: _Skipped, stop: EarlyStop | None = None
) -> str:
    """A paragraph: where the run is, why it stopped early (if it did), which weights it keeps and why,
    what was skipped; then the kept epoch's validation table (recall at full D and against m, as the demo prints it)."""
    text = f"Trained {cfg.model} with {cfg.loss} for {step} steps; the run is in {run}."
    if stop is not None:
        text += " " + stop.reason()
    if selection is not None:
        decision, record = selection
        where = run / (ckpt.BEST if decision.kept == "best" else ckpt.MODEL)
        which = "unless given --weights last" if decision.kept == "best" else "the last weights"
        text += f" {decision.reason()} Eval and index use {where} ({which}; {run / ckpt.SELECTION})."
    else:
        text += " Without validation data there is no best epoch: eval and index use the last weights."
    total = sum(skipped.train.total().values()) + sum(skipped.val.total().values())
    text += f" Skipped records: {skipped.text() if total else 'none'} (in {run / ckpt.SKIPPED})."
    if selection is not None and "compact" in selection[1]:
        text += f"\nValidation, epoch {selection[1].get('epoch')} (kept):\n" + format_table(selection[1])
    return text


# ---------------------------------------------------------------------------- one step


class _StepModule(torch.nn.Module):
    """Model + objective in one module, so DDP sees every trainable tensor in forward."""

    def __init__(self, model: DualEncoder, loss_fn: torch.nn.Module):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, image_input, text_input, image_is_features: bool, text_is_features: bool,
                image_is_bottom: bool = False, text_is_bottom: bool = False):
        m = self.model
        parts = getattr(m, "_split", {})
        img_feats = image_input if image_is_features else (
            parts["image"][1](image_input) if image_is_bottom else m.image_features(image_input)
        )
        txt_feats = text_input if text_is_features else (
            parts["text"][1](text_input) if text_is_bottom else m.text_features(text_input)
        )
        image_z, text_z = m.project_image(img_feats), m.project_text(txt_feats)  # (B, D) each
        return self.loss_fn(image_z.float(), text_z.float(), m.logit_scale(), m.importance())


def _train_step(step_module, batch, optimizer, model: DualEncoder, grad_clip: float, device) -> dict[str, float]:
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    with autocast:
        terms = step_module(
            batch.image, batch.text, batch.image_is_features, batch.text_is_features, batch.image_is_bottom, batch.text_is_bottom
        )
    loss = sum(terms.values())
    if not torch.isfinite(loss):
        values = {k: float(v.detach()) for k, v in terms.items()}
        raise UserError(f"loss became {float(loss.detach())} ({values}); stopping without writing a checkpoint (lower --lr?)")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], grad_clip)
    optimizer.step()
    model.clamp_logit_scale_()  # on the parameter, after the step (open_clip): its gradient stays alive
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
    """Refuse settings that cannot work, each with one line naming the option (the settled ones: a preset's
    recipe and a resumed run's config.json filled in)."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{flag(f.name)} must be a finite number, got {value}")
    check_train(cfg)  # bounds and choices (--head ...), the device, the sources


def _init_source(init: str | None, saved: dict | None) -> dict | None:
    """``{"path", "fingerprint"}`` of the ``--init`` run: as the run's config.json recorded it when
    it started (a resume), else read now."""
    if not init:
        return None
    recorded = ((saved or {}).get("sources") or {}).get("init")
    if saved is not None:
        return recorded if isinstance(recorded, dict) else None  # None: a run from before the record
    return {"path": ckpt.abs_source(init), "fingerprint": _fingerprint(init)}


def _fingerprint(init: str) -> str:
    from triclip.model.run import run_fingerprint

    try:
        return run_fingerprint(init)
    except OSError as err:
        raise UserError(f"--init {init}: cannot read its weights ({err.strerror or err})") from None


def _load_init(model: DualEncoder, init: str, recorded: dict | None = None) -> None:
    """Every weight of ``init``'s model (its best epoch, else its last): heads, towers, theta, logit scale.

    ``recorded``: the init as the run recorded it when it started; a resume that starts again from
    the init (killed before its first checkpoint) refuses an init that is gone or changed since.
    """
    if recorded is not None:
        if not (Path(init) / ckpt.CONFIG).is_file():
            raise UserError(
                f"--resume: this run starts from --init {init}, which is gone; restore it, or start the run again"
                " with --overwrite"
            )
        now = _fingerprint(init)
        if now != recorded.get("fingerprint"):
            raise UserError(
                f"--resume: --init {init} changed since this run started (weights {now}, the run recorded"
                f" {recorded.get('fingerprint')}); restore it, or start the run again with --overwrite"
            )
    from triclip.model.run import describe_model, load_run, state_mismatch

    try:
        source, _ = load_run(init, "cpu")  # its frozen towers rebuilt from their reference when left out
        state = source.state_dict()
        if source.config.head == "affine" and model.config.head == "residual":
            state = _affine_to_residual(model, state)
        mismatch = state_mismatch(model.state_dict(), state)
        if mismatch:
            raise UserError(
                f"cannot load {init}'s weights into this model: {mismatch}; {init}: {describe_model(source.config)},"
                f" this run: {describe_model(model.config)}"
            )
        model.load_state_dict(state)
    except UserError as err:
        raise UserError(f"--init: {err}") from None
    except Exception as err:  # load_state_dict raises many types for another model's tensors
        raise UserError(f"--init: cannot load {init}'s weights into this model: {first_line(err)}") from None


def _affine_to_residual(model: DualEncoder, state: dict) -> dict:
    """An affine run's weights for ``model``'s residual heads: the affine maps go to the skips and the
    branches' output layers start at zero, so the model starts as exactly the affine run."""
    state = dict(state)
    for side in ("image_head", "text_head"):
        head = getattr(model, side)
        head.load_affine(state.pop(f"{side}.weight"), state.pop(f"{side}.bias"))
        state.update({f"{side}.{k}": v for k, v in head.state_dict().items()})
    return state


def _check_out(run: Path, resume: bool, overwrite: bool) -> bool:
    """``--out`` must be a writable folder that is new, empty or a run (``triclip.core.io.claim_output_dir``).

    A run killed before it trained anything (no weights, metrics or checkpoint) is taken as it is.
    Returns whether the run is written in place (``triclip.core.io.writing``'s ``reuse``).
    """
    if resume and overwrite:
        raise UserError("--resume continues the run in --out and --overwrite replaces it: give one of them")
    trained = any((run / name).exists() for name in (ckpt.MODEL, ckpt.METRICS, ckpt.BEST)) or (
        run.is_dir() and ckpt.has_checkpoint(run)
    )
    claim_output_dir(run, "run", overwrite=overwrite, reuse=resume or not trained)
    if run.is_dir() and ckpt.has_checkpoint(run) and not (resume or overwrite):  # unfinished, yet worth keeping
        raise UserError(f"{run} already holds a run; pass --resume to continue it, or --overwrite to replace it")
    return resume or not trained


def _saved_run(run: Path, resume: bool, overwrite: bool = False) -> dict | None:
    """The config.json to resume from (None: a new run). Refuses to overwrite a run with a checkpoint."""
    has_config = (run / ckpt.CONFIG).exists()
    if resume and not has_config:
        raise UserError(f"--resume: {run} is not a run (no {ckpt.CONFIG})")
    if not resume:
        if has_config and ckpt.has_checkpoint(run) and not overwrite:
            raise UserError(f"{run} already holds a run; pass --resume to continue it or choose another --out")
        return None  # new, or killed before its first checkpoint: nothing trained to lose
    return ckpt.read_config(run)


def _check_same_data(saved: dict, train_pairs, val_pairs) -> None:
    """A resumed run reads the data it started with (same records and captions)."""
    sources = saved.get("sources") if isinstance(saved.get("sources"), dict) else {}
    for name, pairs in (("train", train_pairs), ("val", val_pairs)):
        recorded = (sources.get(name) or {}).get("fingerprint") if isinstance(sources.get(name), dict) else None
        if recorded and pairs is not None and pairs.fingerprint != recorded:
            raise UserError(
                f"--resume: the {name} data changed since the run started (fingerprint {pairs.fingerprint},"
                f" the run's {recorded}); train into a new --out"
            )


def _run_config(cfg: TrainConfig, model_cfg: ModelConfig, device: str, train_pairs, val_pairs, init: dict | None) -> dict:
    """What config.json records: the values used, and the data (and ``--init`` run) they were used on."""
    train_cfg = asdict(replace(cfg, train_data=ckpt.abs_source(cfg.train_data), val_data=ckpt.abs_source(cfg.val_data), device=device))
    sources = {"train": _source(cfg.train_data, train_pairs)}
    if val_pairs is not None:
        sources["val"] = _source(cfg.val_data, val_pairs)
    if init is not None:
        sources["init"] = init
    return {
        "model": model_cfg.to_dict(),
        "loss": cfg.loss,
        "loss_options": cfg.loss_options,
        "train": train_cfg,
        "sources": sources,
    }


def _source(path: str, pairs) -> dict:
    return {"path": ckpt.abs_source(path), "fingerprint": pairs.fingerprint, "records": len(pairs.records)}


def _truncate_metrics(run: Path, epochs_done: int) -> None:
    """Drop evaluations of epochs that the checkpoint does not cover (a crash between the two)."""
    import json

    records = ckpt.read_metrics(run)  # UserError when damaged
    kept = [r for r in records if isinstance(r.get("epoch"), int) and r["epoch"] <= epochs_done]
    if len(kept) != len(records):
        from triclip.core.io import write_text_atomic

        write_text_atomic(run / ckpt.METRICS, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))


def _save(run: Path, rank: int, model, loss_fn, optimizer, state: dict, best: "_HeldBest", keep_optimizer: bool = True) -> None:
    if rank == 0:
        best.flush(run)  # before the checkpoint: a resume redoes the epochs after it alike
        ckpt.save_checkpoint(run, model, {"loss": loss_fn}, optimizer, state, keep_optimizer=keep_optimizer)


class _HeldBest:
    """The best epoch so far (``RUN/best``): its info, and its weights until the next checkpoint writes them.

    Written with checkpoints, not when found, so a run with cheap epochs writes it a few times, not every epoch.
    """

    def __init__(self, info: dict | None):
        self.info, self.pending = info, None

    def offer(self, model: DualEncoder, epoch: int, step: int, value: float) -> None:
        if self.info is None or value > self.info["value"]:
            self.info = {"epoch": epoch, "step": step, "metric": BEST_METRIC, "value": value}
            self.pending = ckpt.weights_snapshot(model)

    def flush(self, run: Path) -> None:
        if self.pending is not None:
            ckpt.save_best(run, self.pending, self.info)
            self.pending = None


def _init_distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def _pick_device(name: str | None, rank: int) -> torch.device:
    """``name`` (None: CUDA when available, else the CPU); plain "cuda" is this rank's GPU (LOCAL_RANK)."""
    if name and name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available")
    if not name and not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device(name or "cuda")
    if device.type != "cuda":
        return device
    index = device.index if device.index is not None else int(os.environ.get("LOCAL_RANK", rank))
    if index >= torch.cuda.device_count():  # under torchrun every rank says "cuda"
        rank_gpu = " (this process's LOCAL_RANK)" if device.index is None else ""
        raise UserError(f"--device {name or 'cuda'}: GPU {index}{rank_gpu} asked for, {torch.cuda.device_count()} present")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _tensorboard(run: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional at run time
        return None
    return SummaryWriter(str(run / "tensorboard"))


def _summary_line(record: dict) -> str:
    keys = ("epoch", "i2t_r1", "i2t_r10", "t2i_r1", "t2i_r10", "align", "uniform")
    return "eval " + " ".join(f"{k}={record[k]:.4g}" if isinstance(record.get(k), float) else f"{k}={record.get(k)}" for k in keys if k in record)
