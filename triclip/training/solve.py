"""``triclip solve``: the exact optimum of Eq. 6 for locked towers with affine heads, as a run folder.

For locked towers the tri-factor spectral objective (Zhang et al. 2023, Eq. 6)
``-2 E[f(x)^T S g(y+)] + E E[(f(x)^T S g(y-))^2]`` under the decorrelation
constraint ``E[f f^T] = E[g g^T] = I`` is maximised by regularised CCA between
the two towers' outputs: the heads are the top-D canonical directions (centred,
hence affine heads) and ``S`` the canonical correlations, sorted. ``solve``
computes it in float64 with ``torch.linalg`` (Cholesky whitening of the
ridge-regularised covariances, SVD of the whitened cross-covariance), picks the
ridge on the validation split by distinct-text t2i R@10, and writes an ordinary
run folder (``config.json``, ``model.safetensors``, ``metrics.jsonl``) that
``eval``, ``index build``, ``app`` and ``train --init`` read unchanged.

``solve --run RUN`` solves the same problem one level up: on the embeddings a trained
run serves (its heads' L2-normalised output, weighted by its own ``sqrt(w)``) instead of
the tower outputs. The written run keeps RUN's towers and heads and appends the affine
maps (``triclip.model.model.PostAffineHead``), so any run on locked towers (MRL, infonce, ...)
gets the canonical correlations as its importance and its dimensions in their order.
Its ridge is picked by validation t2i R@10 averaged over the compact curve
(m = D/16, D/8, D/4 and D): a run solved on is already trained for full D, and what the
solve adds is the order its compact indexes serve.

The model's importance is ``w = softplus(theta) = rho`` (the paper's form, not
normalised); the served score weights dimension k by ``rho_k ** weighting``
(``weighting`` 1: the tri-factor score ``f^T S g``; the heads carry the extra
factor ``rho ** ((weighting - 1) / 2)`` so that ``importance()`` stays ``rho``).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from triclip.core.progress import progress

from triclip.model.cache import locked_tower_outputs
from triclip.compact.features import sign_flips, topm_embed
from triclip.data import load_pairs
from triclip.model.embed import _project_rows, pick_device
from triclip.core.errors import UserError
from triclip.core.io import write_json_atomic, writing
from triclip.compact.metrics import first_captions
from triclip.model.model import DualEncoder, ModelConfig, build_model
from triclip.model.run import build_seeded, load_run, weights_path, weights_reference
from triclip.training import checkpoint as ckpt
from triclip.training.config import SolveConfig, TrainConfig, check_solve
from triclip.training.evaluate import evaluate, model_score_embeddings

RIDGE_GRID = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)  # r of ``--ridge auto``: ridge = r * mean variance
RIDGE_EXTEND = 3  # --ridge auto: when the best r is at an end of the grid, up to this many more steps beyond it
LOGIT_SCALES = torch.logspace(0.0, 2.0, 41)  # candidates for the saved logit scale (1 ... 100)
MIN_RHO = 1e-6  # softplus^-1 needs rho > 0
DEFAULT_PRESET = "lite"  # --model left out (without --run)


@dataclass
class PairStats:
    """Means and covariances of paired tower outputs (float64), one row per (image, caption) pair."""

    mean_x: torch.Tensor  # (F_img,)
    mean_y: torch.Tensor  # (F_txt,)
    cxx: torch.Tensor  # (F_img, F_img) image covariance
    cyy: torch.Tensor  # (F_txt, F_txt) text covariance
    cxy: torch.Tensor  # (F_img, F_txt) cross-covariance
    pairs: int  # number of pairs


@dataclass
class CCA:
    """Regularised CCA: ``z_img = (x - mean_x) @ a``, ``z_txt = (y - mean_y) @ b``.

    Shape: ``a`` (F_img, D), ``b`` (F_txt, D), ``rho`` (D,) descending.
    """

    mean_x: torch.Tensor  # (F_img,)
    mean_y: torch.Tensor  # (F_txt,)
    a: torch.Tensor  # (F_img, D) image canonical directions, a^T (Cxx + ridge) a = I
    b: torch.Tensor  # (F_txt, D) text canonical directions, b^T (Cyy + ridge) b = I
    rho: torch.Tensor  # (D,) canonical correlations, descending
    ridge: float  # r: ridge = r * mean variance, per tower


# ---------------------------------------------------------------------------- the command


def solve(cfg: SolveConfig) -> dict:
    """Solve, pick the ridge on the validation data, write the run; return its validation metrics.

    Raises:
        UserError: bad settings or data (one line), before anything is written.
    """
    check_solve(cfg)
    hint = "pass --overwrite to replace it, or choose another --out"  # solve has no --resume
    with writing(cfg.out, "run", overwrite=cfg.overwrite, hint=hint) as folder:  # a replacement is built beside, then swapped in
        return _solve(cfg, folder)


def _solve(cfg: SolveConfig, folder: Path) -> dict:
    """:func:`solve` writing into ``folder`` (``--out``, or the folder that replaces it at the end)."""
    device = pick_device(cfg.device)
    start = time.perf_counter()
    model, base = _model_on_run(cfg, device) if cfg.run else (_model_on_towers(cfg, device), None)
    model_cfg = model.config
    train_pairs = load_pairs(cfg.train_data, cfg.data)
    val_pairs = load_pairs(cfg.val_data, cfg.data) if cfg.val_data else None
    x, y, owner = paired_features(locked_tower_outputs(model, train_pairs, device, cfg.workers))
    fx, fy = (x, y) if base is None else served_embeddings(base, x, y)  # what the CCA is fitted on
    dim = model.embed_dim
    if dim > min(fx.shape[1], fy.shape[1]):
        raise UserError(f"--embed-dim {dim} exceeds the smaller tower's width {min(fx.shape[1], fy.shape[1])} (CCA has no more directions)")
    stats = pair_stats(fx, fy, owner)
    ridges = RIDGE_GRID if cfg.ridge == "auto" else (float(cfg.ridge),)
    if val_pairs is None and len(ridges) > 1:
        raise UserError("--ridge auto picks the ridge on --val-data: give --val-data, or a number with --ridge")
    val_cache = locked_tower_outputs(model, val_pairs, device, cfg.workers) if val_pairs is not None else None
    grid: dict[str, float] = {}  # ridge -> validation t2i R@10 at full D
    curve_grid: dict[str, float] = {}  # --run: ridge -> validation t2i R@10 averaged over the compact curve
    best = None

    def attempt(r: float) -> bool:
        """Solve at ridge r, evaluate on val; True when it is the best so far."""
        nonlocal best
        solution = fit_cca(stats, dim, r, fx)
        set_heads(model, solution, cfg.weighting)
        if val_pairs is None:
            best = (solution, None)
            return True
        result = evaluate(model, val_pairs, device, batch_size=cfg.batch_size, cache=val_cache, workers=cfg.workers)
        score = _score(result, curve=bool(cfg.run))
        grid[f"{r:g}"] = result["t2i_r10"]
        if cfg.run:
            curve_grid[f"{r:g}"] = score[0]
        if best is None or score > best[2]:
            best = (solution, result, score)
            return True
        return False

    for r in progress(ridges, desc="solving CCA per ridge", disable=len(ridges) < 2):
        attempt(r)
    if len(ridges) > 1 and best[0].ridge in (min(ridges), max(ridges)):  # the best is at an end: look beyond it
        step = 1 / 3 if best[0].ridge == min(ridges) else 3.0
        r = best[0].ridge
        for _ in range(RIDGE_EXTEND):
            r *= step
            if not attempt(r):
                break
    solution, result = best[:2]
    set_heads(model, solution, cfg.weighting)
    _check_not_degenerate(model, solution)
    with torch.no_grad():
        model.logit_scale_param.fill_(math.log(fit_logit_scale(model, x, y, owner)))
    seconds = time.perf_counter() - start
    grids = {"ridge_grid_t2i_r10": grid, **({"ridge_grid_curve_t2i_r10": curve_grid} if cfg.run else {})}
    _write_run(cfg, folder, model, model_cfg, solution, grids, result, train_pairs, val_pairs, stats.pairs, seconds)
    print(_summary(cfg, solution, curve_grid if cfg.run else grid, result, seconds))
    return result or {}


def _score(result: dict, curve: bool = False) -> tuple[float, float]:
    """What picks the ridge: validation t2i R@10 (``curve``: its mean over the compact curve
    m = D/16, D/8, D/4 and full D), ties (a saturated R@10, e.g. few distinct captions)
    broken by t2i R@1."""
    if curve:
        values = [*result["compact"]["importance"].values(), result["t2i_r10"]]
        return sum(values) / len(values), result["t2i_r1"]
    return result["t2i_r10"], result["t2i_r1"]


def _model_on_towers(cfg: SolveConfig, device) -> DualEncoder:
    """The preset with locked towers and affine heads (what the CCA of the tower outputs fills)."""
    model_cfg = ModelConfig(
        preset=cfg.model or DEFAULT_PRESET, embed_dim=cfg.embed_dim, head="affine", importance="softplus",
        text_max_length=cfg.text_max_length,
    )  # fmt: skip
    model = build_model(model_cfg).to(device)
    model.lock(image=True, text=True)
    return model


def _model_on_run(cfg: SolveConfig, device) -> tuple[DualEncoder, DualEncoder]:
    """``(model, base)``: ``base`` is RUN as trained; ``model`` its towers and heads followed by
    affine maps (``post_affine``) with the ``softplus`` importance, towers locked.

    Raises:
        UserError: RUN is not a run on locked towers, was itself solved on a run, or the
            options name another preset or D.
    """
    base, config = load_run(cfg.run, device)
    train = config.get("train") or {}
    if not (train.get("lock_image") and train.get("lock_text")):
        raise UserError(f"--run {cfg.run}: its towers trained; solve needs a run on locked towers (train --lock-image --lock-text)")
    if base.config.post_affine:
        below = (config.get("solver") or {}).get("run") or train.get("init")  # solved on it, or trained from that
        raise UserError(f"--run {cfg.run} was itself solved on a run, or trained from one ({below}); solve on the run below it")
    for option, given, own in (("--model", cfg.model, base.config.preset), ("--embed-dim", cfg.embed_dim, base.embed_dim),
                               ("--text-max-length", cfg.text_max_length, base.config.text_max_length)):  # fmt: skip
        if given is not None and given != own:
            raise UserError(f"{option} {given}: --run {cfg.run} has {own} (a solve on a run keeps its model)")
    model_cfg = ModelConfig(**{**base.config.to_dict(), "post_affine": True, "importance": "softplus", "importance_spread": 1.0})
    seed = (weights_reference(weights_path(cfg.run)) or {}).get("seed", 0)
    model = build_seeded(model_cfg, seed).to(device)
    with torch.no_grad():
        model.image_tower.load_state_dict(base.image_tower.state_dict())
        model.text_tower.load_state_dict(base.text_tower.state_dict())
        for head, base_head in ((model.image_head, base.image_head), (model.text_head, base.text_head)):
            head.inner.load_state_dict(base_head.state_dict())
            head.scale.copy_(base.importance().detach().sqrt())
    model.lock(image=True, text=True)
    return model, base


@torch.no_grad()
def served_embeddings(base: DualEncoder, x: torch.Tensor, y: torch.Tensor, batch: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``base``'s full-dimension index serves for tower outputs ``x`` (N, F_img) and ``y``
    (M, F_txt): the L2-normalised ``sqrt(w) * z``. Shape: (N, D), (M, D)."""
    device = base.logit_scale_param.device
    w = base.importance().detach().float().cpu()
    return model_score_embeddings(_project_rows(base.project_image, x, device, batch), _project_rows(base.project_text, y, device, batch), w)


# ---------------------------------------------------------------------------- the maths


def paired_features(cache: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tower outputs of every decoded image and every caption of it.

    Returns:
        ``(x (N', F_img), y (M', F_txt), owner (M',))``: caption j belongs to image row ``owner[j]``.
    """
    keep = cache["image"]["valid"].nonzero().squeeze(1)  # (N',)
    offsets = cache["text"]["offsets"]
    counts = offsets[keep + 1] - offsets[keep]  # (N',)
    rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in keep.tolist()])  # (M',)
    owner = torch.repeat_interleave(torch.arange(len(keep)), counts)
    return cache["image"]["features"][keep], cache["text"]["features"][rows], owner


def pair_stats(x: torch.Tensor, y: torch.Tensor, owner: torch.Tensor) -> PairStats:
    """Means and covariances over the pairs ``(x[owner[j]], y[j])`` without repeating image rows.

    Shape: x (N, F_img), y (M, F_txt), owner (M,).
    """
    x, y = x.double(), y.double()
    counts = torch.bincount(owner, minlength=x.shape[0]).double()  # (N,) captions per image
    m = float(counts.sum())
    mean_x = (counts[:, None] * x).sum(0) / m  # (F_img,) each image weighted by its captions
    mean_y = y.mean(0)  # (F_txt,)
    xc, yc = x - mean_x, y - mean_y
    cxx = (xc * counts[:, None]).T @ xc / m  # (F_img, F_img)
    cyy = yc.T @ yc / m  # (F_txt, F_txt)
    per_image = torch.zeros(x.shape[0], y.shape[1], dtype=torch.float64).index_add_(0, owner, yc)  # (N, F_txt)
    cxy = xc.T @ per_image / m  # (F_img, F_txt)
    return PairStats(mean_x, mean_y, cxx, cyy, cxy, int(m))


def fit_cca(stats: PairStats, dim: int, ridge: float, anchor_x: torch.Tensor | None = None) -> CCA:
    """Top-``dim`` regularised canonical directions and correlations.

    ``C_xx + r * mean(diag C_xx) * I`` (same for y) are whitened by their Cholesky factors
    ``L``; the SVD of ``L_x^{-1} C_xy L_y^{-T}`` gives the correlations (singular values) and
    the directions ``L^{-T} U``. Signs: the robust sign fix of ``triclip.compact.features`` on the
    image features ``anchor_x`` (N, F_img) when given (so runs are comparable), else SVD's.
    """
    lx = _chol(stats.cxx, ridge)
    ly = _chol(stats.cyy, ridge)
    wx = torch.linalg.solve_triangular(lx, stats.cxy, upper=False)  # L_x^{-1} C_xy
    whitened = torch.linalg.solve_triangular(ly, wx.T, upper=False).T  # (F_img, F_txt) L_x^{-1} C_xy L_y^{-T}
    u, s, vh = torch.linalg.svd(whitened, full_matrices=False)
    a = torch.linalg.solve_triangular(lx.T, u[:, :dim], upper=True)  # (F_img, D)
    b = torch.linalg.solve_triangular(ly.T, vh[:dim].T, upper=True)  # (F_txt, D)
    if anchor_x is not None:
        flips = sign_flips((anchor_x.double() - stats.mean_x) @ a, rule="skew")  # (D,)
        a, b = a * flips, b * flips
    return CCA(stats.mean_x, stats.mean_y, a, b, s[:dim].clamp(0.0, 1.0), float(ridge))


def _chol(cov: torch.Tensor, ridge: float) -> torch.Tensor:
    scale = float(cov.diagonal().mean())
    eye = torch.eye(cov.shape[0], dtype=cov.dtype)
    reg = cov + max(ridge, 0.0) * scale * eye
    for jitter in (0.0, 1e-10, 1e-8, 1e-6):  # a rank-deficient covariance without ridge
        chol, info = torch.linalg.cholesky_ex(reg + jitter * scale * eye)
        if int(info) == 0:
            return chol
    raise UserError("the tower features' covariance is singular; use a larger --ridge")


def set_heads(model: DualEncoder, solution: CCA, weighting: float = 1.0) -> None:
    """Write the solution into the model's affine heads (``post_affine``: the maps after the
    run's heads) and ``theta`` (importance form ``softplus``).

    Heads: ``z = (x - mean) @ a * rho ** ((weighting - 1) / 2)``, so the served score
    ``sum_k w_k z_k z'_k`` weighs dimension k by ``rho_k ** weighting``; ``w = rho``.
    """
    if (model.config.head != "affine" and not model.config.post_affine) or model.config.importance != "softplus":
        raise ValueError("set_heads needs a model with affine heads (or post_affine) and the softplus importance form")
    rho = solution.rho.clamp_min(MIN_RHO)  # (D,)
    scale = rho ** ((weighting - 1.0) / 2.0)  # (D,)
    image, text = (model.image_head, model.text_head)
    if model.config.post_affine:  # solve --run: the maps after the run's own heads
        image, text = image.post, text.post
    with torch.no_grad():
        for head, mean, dirs in ((image, solution.mean_x, solution.a), (text, solution.mean_y, solution.b)):
            weight = (dirs * scale).T  # (D, F)
            head.weight.copy_(weight.to(head.weight))
            head.bias.copy_((-(weight @ mean)).to(head.bias))
        model.theta.copy_(torch.log(torch.expm1(rho)).to(model.theta))  # softplus(theta) = rho


@torch.no_grad()
def fit_logit_scale(model: DualEncoder, x: torch.Tensor, y: torch.Tensor, owner: torch.Tensor, batch: int = 256) -> float:
    """The logit scale (1-100) with the lowest symmetric InfoNCE of the served score on training
    batches of ``batch`` pairs (one caption per image): what ``train --init`` starts from."""
    gen = torch.Generator().manual_seed(0)
    first = first_captions(owner, x.shape[0])
    perm = torch.randperm(x.shape[0], generator=gen)[: 16 * batch]
    device = model.logit_scale_param.device
    img = model.project_image(x[perm].to(device)).float().cpu()
    txt = model.project_text(y[first[perm]].to(device)).float().cpu()
    w = model.importance().float().cpu()
    every = torch.arange(w.numel())
    img, txt = topm_embed(img, w, every, w.numel()), topm_embed(txt, w, every, w.numel())
    losses = []
    for s in LOGIT_SCALES.tolist():
        total = 0.0
        for i in range(0, len(img), batch):
            logits = s * img[i : i + batch] @ txt[i : i + batch].T  # (B, B)
            target = torch.arange(len(logits))
            total += float(torch.nn.functional.cross_entropy(logits, target) + torch.nn.functional.cross_entropy(logits.T, target))
        losses.append(total)
    return float(LOGIT_SCALES[int(torch.tensor(losses).argmin())])


def eq6_value(zx: torch.Tensor, zy: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Eq. 6 on paired features: ``-2 E[zx^T S zy] + E_x E_y[(zx^T S zy')^2]`` over all pairs (i, j).

    The second expectation is over independent draws; for finite samples it is
    ``tr(S Cx S Cy)`` with the second moments ``Cx = E[zx zx^T]``, ``Cy = E[zy zy^T]``.
    Shape: zx (N, D), zy (N, D), s (D,) -> scalar.
    """
    pos = (zx * s * zy).sum(1).mean()
    cx, cy = zx.T @ zx / len(zx), zy.T @ zy / len(zy)  # (D, D)
    neg = torch.trace(torch.diag(s) @ cx @ torch.diag(s) @ cy)
    return -2.0 * pos + neg


# ---------------------------------------------------------------------------- the run folder


def _write_run(cfg, run: Path, model, model_cfg, solution: CCA, grids, result, train_pairs, val_pairs, pairs: int,
               seconds: float) -> None:  # fmt: skip
    ckpt.start_over(run)  # what a killed solve left in place
    train_cfg = TrainConfig(
        train_data=ckpt.abs_source(cfg.train_data),
        out=cfg.out,
        val_data=ckpt.abs_source(cfg.val_data),
        model=model_cfg.preset,
        embed_dim=model.embed_dim,
        head=model_cfg.head,
        text_max_length=model_cfg.text_max_length,
        importance="softplus",
        importance_spread=1.0,
        loss="cca",
        loss_options={},
        epochs=1,
        lock_image=True,
        lock_text=True,
        device=str(model.logit_scale_param.device),
        data=cfg.data,
    )
    sources = {"train": {"path": ckpt.abs_source(cfg.train_data), "fingerprint": train_pairs.fingerprint, "records": len(train_pairs.records)}}
    if val_pairs is not None:
        sources["val"] = {"path": ckpt.abs_source(cfg.val_data), "fingerprint": val_pairs.fingerprint, "records": len(val_pairs.records)}
    solver = {
        "method": "regularised CCA (torch.linalg, float64)",
        "ridge": solution.ridge,
        **grids,
        **({"run": ckpt.abs_source(cfg.run)} if cfg.run else {}),
        "weighting": cfg.weighting,
        "canonical_correlations": [round(float(v), 6) for v in solution.rho],
        "pairs": pairs,
        "seconds": round(seconds, 3),
    }
    config = {"model": model_cfg.to_dict(), "loss": "cca", "loss_options": {}, "train": asdict(train_cfg), "sources": sources, "solver": solver}
    ckpt.save_weights(model, run / ckpt.MODEL)
    if result is not None:
        record = {"epoch": 0, "step": 0, "ridge": solution.ridge, **{k: v for k, v in result.items() if k != "skipped"}}
        ckpt.append_metrics(run, record)
    skipped = {"train": dict(train_pairs.skipped)}
    if val_pairs is not None:
        skipped["val"] = dict(val_pairs.skipped)
    write_json_atomic(run / ckpt.SKIPPED, skipped)
    ckpt.write_config(run, config)  # last: a folder with config.json is a whole run


def _check_not_degenerate(model: DualEncoder, solution: CCA) -> None:
    """UserError for a solution that serves nothing: canonical correlations all (about) 0, or heads
    that are all zero in the model's precision (a ridge that swamps the covariances)."""
    heads = (model.image_head, model.text_head)
    if model.config.post_affine:
        heads = (model.image_head.post, model.text_head.post)
    zero_head = any(not bool(head.weight.detach().abs().amax() > 0) for head in heads)
    if float(solution.rho.max()) <= MIN_RHO or zero_head:
        raise UserError(
            f"the solution at ridge {solution.ridge:g} x mean variance is degenerate (canonical correlations up to"
            f" {float(solution.rho.max()):.2g}{', heads all zero' if zero_head else ''}): the ridge swamps the"
            " covariances; choose a smaller --ridge (or auto)"
        )


def _criterion(result: dict, curve: bool) -> str:
    """The name of ``_score``'s first number, with the m it averages over."""
    if not curve:
        return "validation t2i_r10 at full D"
    dims = ", ".join(str(m) for m in result["compact"]["importance"])
    return f"validation t2i_r10 averaged over m = {dims} and full D"


def _summary(cfg: SolveConfig, solution: CCA, decided: dict, result: dict | None, seconds: float) -> str:
    """A paragraph: what was solved, the ridge and, per ridge tried, the number that picked it (``decided``)."""
    rho = solution.rho
    what = f"the embeddings of {cfg.run}" if cfg.run else f"{cfg.model or DEFAULT_PRESET} (locked towers, affine heads)"
    text = (
        f"Solved {what}, D={len(rho)}, by regularised CCA in {seconds:.1f} s"
        f" (ridge {solution.ridge:g} x mean variance); the run is in {cfg.out}."
        f" Canonical correlations (the importance): {float(rho[0]):.3f} ... {float(rho[-1]):.3f}."
    )
    if result is not None:
        text += f" Validation t2i_r10 at full D {result['t2i_r10']:.4f}."
        if len(decided) > 1:
            kept = f"{solution.ridge:g}"
            values = ", ".join(f"{k}: {v:.4f}{' (kept)' if k == kept else ''}" for k, v in decided.items())
            text += f" The ridge is picked by {_criterion(result, bool(cfg.run))} (ties: t2i_r1): {values}."
    return text

