"""Settling a run's TrainConfig: one pure function of everything that decides it.

    cfg = resolve_config(cfg, given, resumed=(path, config_json), init_model=init_json["model"],
                         records=len(train_pairs.records), world=world_size)

In order: a resumed run's own settings (``config.json``; an option given must agree), the
preset's recipe (``triclip.training.config.RECIPES``) for every field left None, the batch fitted to
the data size (a recipe's batch shrinks to give two full batches an epoch), the objective's
own defaults (``triclip.losses``: nesting options, importance form), ``--init``'s D, heads,
importance form and caption length, and the start of ``w``. What the model fills (D of a
preset) and the warmup (5% of the steps the batch source makes) stay with ``train()``.
No I/O, nothing printed: ``tests/training/test_resolve.py`` checks it by a table.
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

from triclip.data import DataConfig
from triclip.core.errors import UserError
from triclip.losses import LOSSES, build_loss, with_defaults
from triclip.training.checkpoint import abs_source
from triclip.training.config import TrainConfig, flag, resolve_recipe

DEFAULT_SPREAD = 100.0  # the start of w that lets tricl learn an ordering (docs/results.md, "Earlier evidence": the importance ablation)
EXTENDABLE = ("epochs", "max_steps")  # --resume: taken from config.json unless given
RUNTIME = ("out", "resume", "overwrite", "workers", "device", "save_every", "log_every", "eval_batch_size", "cache_budget",
           "checkpoint_every", "select_factor", "patience")  # --resume: as given


def resolve_config(
    cfg: TrainConfig,
    given: set[str],
    resumed: tuple[Path, dict] | None = None,
    init_model: dict | None = None,
    records: int | None = None,
    world: int = 1,
) -> TrainConfig:
    """The settings a run trains with.

    Args:
        cfg: the options as given (fields left None take their defaults here).
        given: the fields the user set (dotted for nested ones: ``"data.sep"``).
        resumed: ``(path of config.json, its content)`` for ``--resume``: its settings win,
            except the runtime ones and ``epochs`` / ``max_steps`` when given; the objective's
            and ``--init``'s defaults were applied when it started.
        init_model: the ``model`` section of ``--init``'s config.json (None: no ``--init``).
        records: usable training records (None: not known yet; the batch is not fitted).
        world: ranks training together (the batch is per rank).

    Raises:
        UserError: an option disagrees with the resumed run or with ``--init``, a batch no
            epoch can fill, or a bad objective or objective option (one line each).
    """
    if resumed is not None:
        cfg = _resumed_config(*resumed, cfg, given)
    from_recipe = cfg.batch_size is None
    cfg = resolve_recipe(cfg)  # the preset's epochs, batch, lr, heads, locks (triclip.training.config.RECIPES)
    if records is not None:
        cfg = _fit_batch(cfg, records, world, from_recipe)
    cfg = replace(cfg, loss_options=with_defaults(cfg.loss, cfg.loss_options))  # to config.json
    try:
        trains_importance = build_loss(cfg.loss, **cfg.loss_options).needs_importance
    except (KeyError, ValueError, TypeError) as err:
        raise UserError(f"--loss {cfg.loss} {cfg.loss_options}: {err}") from None
    if resumed is None:  # a resumed run keeps what its config.json recorded
        cfg = _importance_defaults(cfg, given)
        if init_model is not None:
            cfg = _init_defaults(cfg, given, init_model)
    return replace(cfg, importance_spread=_importance_spread(cfg.importance_spread, trains_importance))


def _fit_batch(cfg: TrainConfig, records: int, world: int, from_recipe: bool) -> TrainConfig:
    """A recipe's batch shrinks so that a small training set still gives two full batches an epoch
    (train() says so in one line); a batch the user gave that no epoch can fill is refused."""
    if records // (cfg.batch_size * world) >= 2 or (not from_recipe and records // (cfg.batch_size * world) >= 1):
        return cfg
    if not from_recipe:
        raise UserError(
            f"--batch-size {cfg.batch_size}{f' x {world} ranks' if world > 1 else ''} is larger than the"
            f" {records} usable training records: no full batch; give a smaller --batch-size"
        )
    return replace(cfg, batch_size=max(2, records // (2 * world)))  # train() says so, in one line


def _importance_spread(spread: float | None, trains_importance: bool) -> float:
    """The initial ramp of w: a model whose objective ignores w keeps w = 1 (plain cosine)."""
    if spread is None:
        return DEFAULT_SPREAD if trains_importance else 1.0
    return spread


def _importance_defaults(cfg: TrainConfig, given: set[str]) -> TrainConfig:
    """The objective's own importance form and spread (its ``importance_defaults``) where the user gave none."""
    own = getattr(LOSSES.get(cfg.loss), "importance_defaults", {})
    return replace(cfg, **{name: value for name, value in own.items() if name not in given})


def _init_defaults(cfg: TrainConfig, given: set[str], model: dict) -> TrainConfig:
    """``--init RUN``: its preset must be ``--model``; D, head kind (with ``solve --run``'s affine maps after
    it), importance form and caption length come from it (D and head must agree when given: an MLP cannot
    start equal to an affine head, a residual one can). ``model``: the config.json ``model`` section of ``--init``."""
    head, dim = model.get("head", "linear"), model.get("embed_dim")
    if model.get("preset") != cfg.model:
        raise UserError(f"--init {cfg.init} is a {model.get('preset')} run; give --model {model.get('preset')}")
    if cfg.head is not None and cfg.head != head and (head, cfg.head) != ("affine", "residual"):
        raise UserError(
            f"--init {cfg.init} has {head} heads, --head {cfg.head} cannot start from them (the same head kind, or"
            " residual from affine: an MLP's last layer has no bias, so it cannot start equal to an affine head)"
        )
    if cfg.embed_dim is not None and cfg.embed_dim != dim:
        raise UserError(f"--init {cfg.init} has D={dim}, not --embed-dim {cfg.embed_dim}; leave --embed-dim out")
    taken = {k: getattr(cfg, k) if k in given else model.get(k, getattr(cfg, k)) for k in ("importance", "text_max_length")}
    return replace(cfg, head=cfg.head or head, embed_dim=dim, post_affine=bool(model.get("post_affine")), **taken)


def _resumed_config(where: Path, saved: dict, cfg: TrainConfig, given: set[str]) -> TrainConfig:
    """The run's own settings; UserError (one line) when an option in ``given`` disagrees with them."""
    section = saved.get("train")
    if not isinstance(section, dict):
        raise UserError(f"{where} is damaged (no train section)")
    try:
        old = TrainConfig(**{**section, "data": DataConfig(**(section.get("data") or {}))})
    except (TypeError, ValueError) as err:
        raise UserError(f"{where} is damaged (train section: {err})") from None
    conflicts = []
    for path in sorted(given):
        name = path.split(".")[0]
        if name in RUNTIME or name in EXTENDABLE:
            continue
        mine, theirs = _comparable(cfg, path), _comparable(old, path)
        if mine != theirs:
            conflicts.append(f"{flag(path.split('.')[-1])} {mine!r} (the run's: {theirs!r})")
    if conflicts:
        raise UserError(
            f"--resume: {', '.join(conflicts)} differ from {where}; leave them out to continue the run,"
            " or train into a new --out"
        )
    keep = {name: getattr(cfg, name) for name in RUNTIME}
    keep.update({name: getattr(cfg, name) for name in EXTENDABLE if name in given})
    return replace(old, **keep)


def _comparable(cfg: TrainConfig, path: str):
    """A setting as config.json records it, so that typed values compare with recorded ones."""
    if path.startswith("data."):
        return getattr(cfg.data, path.split(".", 1)[1])
    value = getattr(cfg, path)
    if path in ("train_data", "val_data"):
        return abs_source(value)
    if path == "loss_options":
        return with_defaults(cfg.loss, value)
    return value


def explicit_fields(cfg: TrainConfig) -> set[str]:
    """Fields that differ from their defaults (what a library caller set)."""
    blank = TrainConfig(train_data="", out="")
    out = {f.name for f in fields(cfg) if f.name != "data" and getattr(cfg, f.name) != getattr(blank, f.name)}
    out |= {f"data.{f.name}" for f in fields(cfg.data) if getattr(cfg.data, f.name) != getattr(blank.data, f.name)}
    return out
