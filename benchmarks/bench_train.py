"""Training samples/s of triclip's step against open_clip_train's, and the locked-tower cache speed-up.

    .venv/bin/python -m benchmarks.bench_train [--presets tiny,lite] [--batch 64] [--steps N] [--warmup N]
        [--round-steps N] [--data DIR] [--workers N] [--threads N] [--cache-preset lite|none]

Defaults (a few minutes on 2 idle cores): tiny 30 timed steps per trainer in rounds of 3
after 5 warm-up steps; lite 6 steps in rounds of 1 after 1 (a lite step trains
EfficientNet-Lite0 at 224 px and MiniLM: ~8 s at batch 64); data: a temporary
``shapes`` set of 400 images.

For each preset one DualEncoder is built and copied, so both trainers start from the
same weights, and both train it on the same batches (same records, captions,
transform and tokenizer), with the same objective (symmetric InfoNCE), AdamW settings
(each side's optimizer built its own way: ``_make_optimizer``, ``open_clip_train.main``),
learning-rate warmup + cosine and gradient clipping; image decoding and tokenizing
are timed in both (``--workers`` DataLoader processes on both sides):

(A) triclip: ``triclip.training.batches.BatchSource`` batches into ``triclip.training.train._train_step``
    with ``build_loss("infonce")`` and ``_make_optimizer`` (what ``triclip train`` runs);
(B) open_clip: ``open_clip_train.train.train_one_epoch`` itself, over a DataLoader of
    ``(images, tokens)`` and ``open_clip.loss.ClipLoss``, the model wrapped so that
    ``forward(image, text)`` returns open_clip's output dict.

The two run interleaved in rounds (the order alternates every round) so that the drifts
of a shared machine hit both alike; the table gives the median samples/s over rounds,
their ratio, the median of the per-round ratios (each round against its neighbour in
time) and the ratio of the best rounds (the least disturbed, on a loaded machine).
Only ``train_one_epoch``'s scheduler step differs: open_clip derives it from the epoch and
batch number, triclip counts steps; the learning rate does not change the time of a step.

(C) the locked-tower cache (``--cache-preset``, default ``lite``): both towers locked,
training with the cached tower outputs against the same locked model running its
frozen towers on every batch, plus the one-time cost of building the cache (and of
reading it back on a later run).
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import statistics
import sys
import tempfile
import time
from argparse import Namespace
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from triclip.data import load_pairs
from triclip.data.dataset import pick_caption
from triclip.data.records import PairSet
from triclip.core.errors import UserError
from triclip.losses import build_loss
from triclip.model.model import DualEncoder, ModelConfig, build_model
from triclip.training.batches import BatchSource
from triclip.model.cache import cache_dir
from triclip.training.config import recipe_for
from triclip.training.train import _lr_scale, _make_optimizer, _StepModule, _train_step



@dataclass(frozen=True)
class Plan:
    """How much to time one pair of trainers."""

    steps: int  # timed steps per trainer
    round_steps: int  # steps per interleaved round (steps // round_steps rounds)
    warmup: int  # untimed steps per trainer first


# on 2 idle CPU cores a tiny step takes ~0.2 s, a lite step (224 px EfficientNet + MiniLM, both training) ~8 s
DEFAULT_PLANS = {"tiny": Plan(30, 3, 5), "lite": Plan(6, 1, 1)}
OTHER_PLAN = Plan(6, 1, 1)  # open_clip architectures
CACHE_PLAN = Plan(6, 1, 1)  # (C): cached steps take milliseconds, uncached ones run the towers forward


@dataclass
class BenchConfig:
    presets: list[str] = field(default_factory=lambda: ["tiny", "lite"])  # model presets, compared one by one
    batch: int = 64  # batch size of every trainer
    steps: int | None = None  # timed steps per trainer (None: per preset, DEFAULT_PLANS)
    round_steps: int | None = None  # steps per interleaved round (None: per preset)
    warmup: int | None = None  # untimed steps per trainer first (None: per preset)
    data: str | None = None  # training data (a manifest, or a folder with train.jsonl); None: prepare shapes
    num: int = 400  # shapes images to prepare when --data is not given (90% train)
    workers: int = 0  # DataLoader worker processes (both trainers)
    threads: int | None = None  # torch CPU threads (None: torch's default)
    cache_preset: str | None = "lite"  # preset of the locked-tower cache rows ("none": leave them out)
    cache_steps: int | None = None  # timed steps per cache trainer (None: CACHE_PLAN)
    seed: int = 0  # model init, batch order and caption choice

    def __post_init__(self) -> None:
        if self.cache_preset in ("none", ""):
            self.cache_preset = None
        if not self.presets and not self.cache_preset:
            raise ValueError("nothing to measure: give --presets or --cache-preset")
        if self.batch < 2:
            raise ValueError(f"--batch must be >= 2 (contrastive losses need negatives), got {self.batch}")
        for name in ("steps", "round_steps", "cache_steps", "threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if (self.warmup is not None and self.warmup < 0) or self.workers < 0 or self.num < 1:
            raise ValueError("--warmup and --workers must be >= 0, --num >= 1")

    def plan(self, preset: str) -> Plan:
        """The plan of the triclip/open_clip rows of ``preset``, overrides applied."""
        return self._override(DEFAULT_PLANS.get(preset, OTHER_PLAN), self.steps)

    def cache_plan(self) -> Plan:
        return self._override(CACHE_PLAN, self.cache_steps)

    def _override(self, plan: Plan, steps: int | None) -> Plan:
        round_steps = self.round_steps or plan.round_steps
        steps = max(steps or plan.steps, round_steps)
        warmup = plan.warmup if self.warmup is None else self.warmup
        return Plan(steps // round_steps * round_steps, round_steps, warmup)


# ---------------------------------------------------------------------------- (A) triclip


class TriclipTrainer:
    """``triclip train``'s inner loop: BatchSource batches, lr schedule, ``_train_step``."""

    def __init__(self, model: DualEncoder, pairs: PairSet, batch: int, seed: int, workers: int, total_steps: int):
        self.model = model
        self.loss_fn = build_loss("infonce")
        model.theta.requires_grad_(False)  # as train(): infonce does not see the importance
        self.source = BatchSource(model, pairs, seed, torch.device("cpu"), batch, workers)
        lr = recipe_for(model.config.preset).lr
        self.optimizer = _make_optimizer(model, self.loss_fn, lr, weight_decay=0.1)
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.step_module = _StepModule(model, self.loss_fn)
        self.total_steps, self.warmup_steps = total_steps, max(1, int(0.05 * total_steps))
        self.step = 0

    def run(self, epoch: int, steps: int) -> float:
        """Train ``steps`` batches of ``epoch``; return the seconds taken (data loading included)."""
        self.model.train()
        start = time.perf_counter()
        batches = self.source.epoch(epoch, 0, 0, 1)
        for _, batch in itertools.islice(batches, steps):
            scale = _lr_scale(self.step, self.warmup_steps, self.total_steps)
            for group, base in zip(self.optimizer.param_groups, self.base_lrs):
                group["lr"] = base * scale
            _train_step(self.step_module, batch, self.optimizer, self.model, 1.0, torch.device("cpu"))
            self.step += 1
        batches.close()
        return time.perf_counter() - start


# ---------------------------------------------------------------------------- (B) open_clip_train


class OpenClipModel(nn.Module):
    """A DualEncoder seen as an open_clip model: ``forward(image, text)`` returns
    ``{"image_features", "text_features", "logit_scale"}`` (features L2-normalised, (B, D)).

    ``text`` is a tensor, as open_clip's trainer moves it with ``.to(device)``: token ids
    (B, L), or the tokenizer's dict packed by :func:`pack_tokens` as (B, K, L).
    ``logit_scale`` is the model's log-scale parameter, which the trainer clamps in place.
    """

    def __init__(self, model: DualEncoder, token_keys: tuple[str, ...] = ()):
        super().__init__()
        self.model = model
        self.logit_scale = model.logit_scale_param  # the same Parameter (open_clip clamps it to ln 100)
        self.token_keys = token_keys

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens = unpack_tokens(text, self.token_keys)
        return {
            "image_features": self.model.encode_image(image),  # (B, D)
            "text_features": self.model.project_text(self.model.text_features(tokens)),  # (B, D)
            "logit_scale": self.model.logit_scale(),
        }


def pack_tokens(tokens) -> tuple[torch.Tensor, tuple[str, ...]]:
    """Tokenizer output -> one tensor: (B, L) ids as they are, a dict of (B, L) as (B, K, L) + its keys."""
    if isinstance(tokens, dict):
        keys = tuple(sorted(tokens))
        return torch.stack([tokens[k] for k in keys], dim=1), keys  # (B, K, L)
    return tokens, ()


def unpack_tokens(packed: torch.Tensor, keys: tuple[str, ...]):
    """Inverse of :func:`pack_tokens`."""
    if not keys:
        return packed  # (B, L)
    return {k: packed[:, i].contiguous() for i, k in enumerate(keys)}  # each (B, L)


class CaptionedImages(torch.utils.data.Dataset):
    """open_clip's CsvDataset over PairSet records: item = (transformed image, caption).

    The caption of record i is ``pick_caption(count, seed, epoch, i)``, the one triclip's
    PairDataset takes in the same epoch; tokenizing happens per batch in :class:`TokenizeCollate`.
    """

    def __init__(self, pairs: PairSet, transform: Callable, seed: int, epoch: int):
        self.pairs, self.transform, self.seed, self.epoch = pairs, transform, seed, epoch

    def __len__(self) -> int:
        return len(self.pairs.records)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, str]:
        record = self.pairs.records[index]
        caption = record.captions[pick_caption(len(record.captions), self.seed, self.epoch, index)]
        return self.transform(record.open_image(self.pairs.max_pixels)), caption


class TokenizeCollate:
    """Stack images (B, 3, H, W) and tokenize the captions with the model's tokenizer, packed."""

    def __init__(self, tokenize: Callable):
        self.tokenize = tokenize

    def __call__(self, items: list[tuple[torch.Tensor, str]]) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.stack([image for image, _ in items])  # (B, 3, H, W)
        tokens, _ = pack_tokens(self.tokenize([caption for _, caption in items]))
        return images, tokens


def open_clip_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW as ``open_clip_train.main`` builds it, with triclip's settings (betas 0.9/0.98, eps 1e-6, as
    open_clip's for ViTs): no weight decay on gains, biases, norms and the logit scale."""

    def exclude(name: str, p: torch.Tensor) -> bool:  # open_clip_train/main.py
        return p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
        {"params": [p for n, p in named if not exclude(n, p)], "weight_decay": weight_decay},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-6)


def epoch_plan(source: BatchSource, epoch: int, steps: int) -> list[list[int]]:
    """The record indices of the first ``steps`` batches that ``source.epoch(epoch, 0, 0, 1)`` yields.

    The same permutation as ``BatchSource.epoch`` (one process, ``world = 1``).
    """
    g = torch.Generator().manual_seed(source.seed * 1_000_003 + epoch)
    perm = source.indices[torch.randperm(len(source.indices), generator=g)]  # (N_valid,)
    b = source.global_batch
    return [perm[i * b : (i + 1) * b].tolist() for i in range(min(steps, source.batches_per_epoch()))]


class OpenClipTrainer:
    """``open_clip_train.train.train_one_epoch`` over the batches of :func:`epoch_plan`."""

    def __init__(self, model: DualEncoder, pairs: PairSet, batch: int, seed: int, workers: int, total_steps: int):
        from open_clip.loss import ClipLoss
        from open_clip_train.scheduler import cosine_lr

        self.model, self.pairs, self.seed, self.workers = model, pairs, seed, workers
        self.loss_fn = ClipLoss()
        model.theta.requires_grad_(False)  # unused by the objective, as in (A)
        _, keys = pack_tokens(model.tokenize(["a"]))
        self.wrapped = OpenClipModel(model, keys)
        lr = recipe_for(model.config.preset).lr
        self.optimizer = open_clip_optimizer(self.wrapped, lr, weight_decay=0.1)
        self.scheduler = cosine_lr(self.optimizer, lr, max(1, int(0.05 * total_steps)), total_steps)
        # the BatchSource of (A) gives the valid records and the batch order; it loads nothing itself
        self.plan_source = BatchSource(model, pairs, seed, torch.device("cpu"), batch, workers)
        self.args = Namespace(
            device="cpu",
            precision="fp32",
            accum_freq=1,
            distill=False,
            skip_scheduler=False,
            grad_clip_norm=1.0,  # triclip's default --grad-clip
            horovod=False,
            rank=0,
            local_rank=0,
            world_size=1,
            batch_size=batch,
            log_every_n_steps=100,
            wandb=False,
        )

    def loader(self, epoch: int, steps: int):
        """open_clip's DataInfo for the first ``steps`` batches of ``epoch``."""
        from open_clip_train.data import DataInfo

        plan = epoch_plan(self.plan_source, epoch, steps)
        dataset = CaptionedImages(self.pairs, self.model.image_transform(train=True), self.seed, epoch)
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=plan, num_workers=self.workers, collate_fn=TokenizeCollate(self.model.tokenize)
        )
        loader.num_batches, loader.num_samples = len(plan), sum(len(b) for b in plan)  # as open_clip's loaders
        return DataInfo(loader)

    def run(self, epoch: int, steps: int) -> float:
        """Train ``steps`` batches of ``epoch`` with open_clip's trainer; return the seconds taken."""
        from open_clip_train.train import train_one_epoch

        start = time.perf_counter()
        data = {"train": self.loader(epoch, steps)}
        train_one_epoch(self.wrapped, data, self.loss_fn, epoch, self.optimizer, None, self.scheduler, None, self.args)
        return time.perf_counter() - start


# ---------------------------------------------------------------------------- (C) locked-tower cache


class LockedTrainer(TriclipTrainer):
    """Triclip's step with both towers locked: cached tower outputs, or the frozen towers run per batch."""

    def __init__(self, model: DualEncoder, pairs: PairSet, batch: int, seed: int, workers: int, total_steps: int, cached: bool):
        if cached:
            model.lock(image=True, text=True)  # BatchSource sees the lock: builds / reads the caches
            start = time.perf_counter()
            super().__init__(model, pairs, batch, seed, workers, total_steps)
            self.setup_seconds = time.perf_counter() - start
        else:
            super().__init__(model, pairs, batch, seed, workers, total_steps)  # raw images and tokens
            model.lock(image=True, text=True)  # then frozen: the towers run forward only, every batch
            self.optimizer = _make_optimizer(model, self.loss_fn, self.optimizer.defaults["lr"], weight_decay=0.1)
            self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
            self.setup_seconds = 0.0


# ---------------------------------------------------------------------------- measuring


@dataclass
class Pair:
    """Interleaved measurement of two trainers: seconds per round, per trainer."""

    names: tuple[str, str]  # row labels
    seconds: tuple[list[float], list[float]]  # timed rounds of each
    round_steps: tuple[int, int]  # training steps in one round, per trainer
    batch: int  # samples per step

    def rate(self, which: int, best: bool = False) -> float:
        """Median (or best) samples/s over the rounds."""
        times = self.seconds[which]
        return self.round_steps[which] * self.batch / (min(times) if best else statistics.median(times))

    def step_seconds(self, which: int) -> float:
        """Median seconds per step."""
        return self.batch / self.rate(which)

    def ratio(self, best: bool = False) -> float:
        """First over second in samples/s: of the medians, or of the best rounds."""
        return self.rate(0, best) / self.rate(1, best)

    def paired_ratio(self) -> float:
        """Median over rounds of first over second in samples/s, each round against its neighbour in time."""
        steps_a, steps_b = self.round_steps
        return statistics.median((steps_a / a) / (steps_b / b) for a, b in zip(*self.seconds))


def interleave(trainers: tuple, names: tuple[str, str], plan: Plan, batch: int, first_round_steps: int | None = None) -> Pair:
    """Warm both up, then ``plan.steps // plan.round_steps`` rounds of each, the order alternating.

    A round is ``plan.round_steps`` steps (the first trainer: ``first_round_steps`` if given,
    for a trainer whose steps are too short to time one by one). Round r trains on the
    batches of epoch r + 1 (epoch 0 is the warm-up), the same for both.
    """
    steps = (first_round_steps or plan.round_steps, plan.round_steps)
    if plan.warmup:
        for trainer in trainers:
            trainer.run(0, plan.warmup)
    seconds: tuple[list[float], list[float]] = ([], [])
    for r in range(plan.steps // plan.round_steps):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for which in order:
            seconds[which].append(trainers[which].run(r + 1, steps[which]))
    return Pair(names, seconds, steps, batch)


def compare_trainers(preset: str, pairs: PairSet, cfg: BenchConfig) -> Pair:
    """(A) against (B) for one preset, from one set of initial weights."""
    torch.manual_seed(cfg.seed)
    model = build_model(ModelConfig(preset=preset))
    plan = cfg.plan(preset)
    total = plan.warmup + plan.steps
    triclip = TriclipTrainer(model, pairs, cfg.batch, cfg.seed, cfg.workers, total)
    open_clip = OpenClipTrainer(copy.deepcopy(model), pairs, cfg.batch, cfg.seed, cfg.workers, total)
    return interleave((triclip, open_clip), ("triclip", "open_clip"), plan, cfg.batch)


@dataclass
class CacheResult:
    pair: Pair  # cached vs uncached, interleaved
    build_seconds: float  # first BatchSource of a locked model: both tower caches computed and written
    load_seconds: float  # a later BatchSource of the same model and data: caches read back
    records: int  # training records cached
    rebuilt: list[str]  # caches (image, text) the later BatchSource computed again: a key that does not hold


def measure_cache(preset: str, pairs: PairSet, cfg: BenchConfig) -> CacheResult:
    """(C): locked towers with and without the cache, in a fresh cache folder."""
    torch.manual_seed(cfg.seed)
    base = build_model(ModelConfig(preset=preset))
    plan = cfg.cache_plan()
    total = plan.warmup + plan.steps
    old = os.environ.get("TRICLIP_CACHE")
    with tempfile.TemporaryDirectory(prefix="bench_train_cache_") as folder:
        os.environ["TRICLIP_CACHE"] = folder
        try:
            cached = LockedTrainer(copy.deepcopy(base), pairs, cfg.batch, cfg.seed, cfg.workers, total, cached=True)
            written = set(os.listdir(cache_dir()))
            again = LockedTrainer(copy.deepcopy(base), pairs, cfg.batch, cfg.seed, cfg.workers, total, cached=True)
            rebuilt = sorted(name.split("-")[0] for name in set(os.listdir(cache_dir())) - written)  # image / text
            uncached = LockedTrainer(base, pairs, cfg.batch, cfg.seed, cfg.workers, total, cached=False)
            epoch_steps = cached.source.batches_per_epoch()  # a whole epoch per round: cached steps take ms
            pair = interleave((cached, uncached), ("cached", "towers every step"), plan, cfg.batch, epoch_steps)
        finally:
            if old is None:
                os.environ.pop("TRICLIP_CACHE", None)
            else:
                os.environ["TRICLIP_CACHE"] = old
    return CacheResult(pair, cached.setup_seconds, again.setup_seconds, len(pairs.records), rebuilt)


# ---------------------------------------------------------------------------- report


def trainer_table(results: dict[str, Pair]) -> str:
    """Markdown: preset, samples/s of each trainer (median of rounds), ratio of medians, ratio of best rounds."""
    rows = [
        "| preset | triclip samples/s | open_clip_train samples/s | ratio triclip/open_clip "
        "| ratio, paired rounds | ratio, best rounds |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for preset, p in results.items():
        ratios = f"{p.ratio():.2f} | {p.paired_ratio():.2f} | {p.ratio(best=True):.2f}"
        rows.append(f"| {preset} | {p.rate(0):.1f} | {p.rate(1):.1f} | {ratios} |")
    return "\n".join(rows)


def cache_table(preset: str, result: CacheResult) -> str:
    """Markdown: locked-tower training with and without the cache, and the cache's one-time cost."""
    pair = result.pair
    saved = pair.step_seconds(1) - pair.step_seconds(0)  # seconds saved per step
    break_even = math.ceil(result.build_seconds / saved) if saved > 0 else "no"
    read_back = f"MISS: {' and '.join(result.rebuilt)} cache computed again (unstable key)" if result.rebuilt else "hit"
    return "\n".join(
        [
            f"| {preset}, both towers locked | samples/s | speed-up |",
            "|---|---:|---:|",
            f"| towers run every step (no cache) | {pair.rate(1):.1f} | 1.00 |",
            f"| cached tower outputs | {pair.rate(0):.1f} | {pair.ratio():.1f} "
            f"(paired rounds {pair.paired_ratio():.1f}, best rounds {pair.ratio(best=True):.1f}) |",
            f"| one-time cache build, {result.records} records | {result.build_seconds:.1f} s "
            f"({result.records / result.build_seconds:.1f} records/s) | pays off after {break_even} steps |",
            f"| cache read back (later run, same data) | {result.load_seconds:.2f} s | {read_back} |",
        ]
    )


# ---------------------------------------------------------------------------- entry point


def _describe(plan: Plan) -> str:
    rounds = plan.steps // plan.round_steps
    return (
        f"{plan.steps} timed steps per trainer in {rounds} interleaved rounds of {plan.round_steps}, "
        f"after {plan.warmup} warm-up steps"
    )


def load_training_pairs(cfg: BenchConfig, scratch: str) -> PairSet:
    """The training records: ``--data`` (a folder means its train.jsonl), or a fresh shapes set."""
    if cfg.data is None:
        from triclip.data.builtin import prepare

        path = prepare("shapes", scratch, num=cfg.num, seed=cfg.seed)["train_manifest"]
    else:
        path = str(Path(cfg.data) / "train.jsonl") if Path(cfg.data).is_dir() else cfg.data
        if not Path(path).exists():
            raise UserError(f"--data: no such file {path}")
    pairs = load_pairs(path)
    plans = [cfg.plan(p) for p in cfg.presets] + ([cfg.cache_plan()] if cfg.cache_preset else [])
    needed = max(max(plan.round_steps, plan.warmup) for plan in plans) * cfg.batch
    if len(pairs.records) < needed:
        raise UserError(
            f"{len(pairs.records)} training records, but a round or the warm-up needs {needed} (steps x batch); "
            "lower --round-steps/--warmup/--batch or give more data"
        )
    return pairs


def parse_args(argv: Sequence[str] | None) -> BenchConfig:
    """BenchConfig from the command line: one option per field (``triclip.app.options``), e.g. --presets tiny,lite."""
    from triclip.app.options import parse_config

    return parse_config(BenchConfig, argv, __doc__.splitlines()[0])


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        with tempfile.TemporaryDirectory(prefix="bench_train_data_") as scratch:
            pairs = load_training_pairs(cfg, scratch)
            load_before = os.getloadavg()[0]
            print(
                f"# training samples/s, CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, "
                f"batch {cfg.batch}, {len(pairs.records)} records ({pairs.source}), workers {cfg.workers}; "
                f"load average {load_before:.2f}",
                flush=True,
            )
            results = {}
            for preset in cfg.presets:
                results[preset] = compare_trainers(preset, pairs, cfg)
                print(f"# {preset}: {_describe(cfg.plan(preset))}", flush=True)
            cache = None
            if cfg.cache_preset:
                cache = measure_cache(cfg.cache_preset, pairs, cfg)
                print(
                    f"# {cfg.cache_preset} locked-tower cache: {_describe(cfg.cache_plan())} "
                    "(the cached trainer: a whole epoch per round)",
                    flush=True,
                )
    except UserError as err:
        print(f"bench_train: error: {err}", file=sys.stderr)
        return 2
    if results:
        print(trainer_table(results))
    if cache is not None:
        print()
        print(cache_table(cfg.cache_preset, cache))
    print(f"\n# load average: {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
