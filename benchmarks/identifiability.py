"""Eq. 6's closed form (CCA) on locked towers: identifiability, sign rules, weighting and suggest_m.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.identifiability --data DIR [--model lite] \
        [--embed-dim 256] [--seeds 0,1,2] [--ridge R] [--sklearn 16] [--runs RUN,RUN,...] [--on-run RUN]

``DIR`` holds ``train.jsonl``, ``val.jsonl`` and (for the held-out checks) ``test.jsonl``.
Tower outputs come from the locked-tower cache, so every fit below is seconds. With ``--on-run RUN``
the CCA is fitted on what RUN serves instead (``triclip solve --run``: its heads' L2-normalised
``sqrt(w) * z``), and tables 1-4 are about that solve. Tables:

1. Weighting of the served score (``rho ** p``, p = 0, 0.5, 1, 2): full-D and m = D/16, D/8
   distinct-text t2i R@10 on val and test (the ridge is ``--ridge``, else picked on val).
2. Identifiability per canonical dimension: the CCA fitted on two disjoint random halves of
   the training images (one split per seed), val images mapped through both; ``|corr|`` of
   dimension k of half A with dimension k of half B, and the signed corr after each half's own
   sign fix (rules ``anchor``, ``majority``, ``skew`` of ``triclip.compact.features.sign_flips``,
   anchored on that half's training images), beside ``rho_k`` and the spectral gap
   ``g_k = min(rho_{k-1} - rho_k, rho_k - rho_{k+1})`` (the theorem: dimension k is identified
   when its correlation is separated from its neighbours'). Spearman of g_k with |corr|.
3. Sign rules: for the full-data solution, the share of dimensions whose flip agrees when the
   rule is anchored on one half of the training images or the other.
4. ``suggest_m``: the importance spectrum's cumulative share (of rho, and of rho^2) against
   the test recall curve relative to full D; for share x in 0.8 / 0.9 / 0.95, the suggested m
   and the test recall reached there.
5. (``--sklearn K``) scikit-learn's ``CCA(n_components=K)`` against the torch.linalg solver:
   seconds and the top-K correlations on train and val.
6. (``--runs``, alone) trained runs of one objective and several seeds: per-dimension signed
   corr of ``DIR/val.jsonl`` image features between seeds (own order, skew sign fix), with
   their own S gaps.
7. (``--map-runs``, alone) class mAP (text -> image, first caption per image) of runs on a
   labelled ``DIR/val.jsonl`` at full D and per ordering at m = 16 / 32: for data whose
   distinct-text recall is saturated (``fashion-mnist``: 70 class sentences).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from triclip.compact.features import SIGN_RULES, compact_curve, sign_flips, suggest_m
from triclip.compact.metrics import first_captions, retrieval_recall

SHARES = (0.8, 0.9, 0.95)
WEIGHTINGS = (0.0, 0.5, 1.0, 2.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="folder with train.jsonl, val.jsonl, test.jsonl")
    p.add_argument("--model", default="lite")
    p.add_argument("--embed-dim", type=int, default=None)
    p.add_argument("--seeds", default="0,1,2", help="one random half split per seed")
    p.add_argument("--ridge", type=float, default=None, help="r (default: the best on val of triclip.training.solve.RIDGE_GRID)")
    p.add_argument("--sklearn", type=int, default=0, help="also fit scikit-learn CCA with this many components")
    p.add_argument("--runs", default="", help="comma-separated trained runs (seeds of one objective) to compare")
    p.add_argument("--map-runs", default="", help="only the class mAP table of these runs (mean ± sd) on DIR/val.jsonl")
    p.add_argument("--on-run", default=None, help="fit on this run's served embeddings (solve --run), not the towers'")
    ns = p.parse_args(argv)
    if ns.map_runs:
        class_map_table(str(Path(ns.data) / "val.jsonl"), [r for r in ns.map_runs.split(",") if r.strip()])
        return 0
    if ns.runs:
        runs_table([r for r in ns.runs.split(",") if r.strip()], str(Path(ns.data) / "val.jsonl"))
        return 0
    torch.manual_seed(0)
    data = Feats.load(ns.data, ns.model, ns.embed_dim, ns.on_run)
    seeds = [int(s) for s in ns.seeds.split(",") if s.strip()]
    ridge = ns.ridge if ns.ridge is not None else pick_ridge(data)
    print(f"data {ns.data}: {data.x.shape[0]} train images, {data.y.shape[0]} train captions, D={data.dim}, ridge {ridge:g}")
    weighting_table(data, ridge)
    full = data.fit(torch.arange(data.x.shape[0]), ridge)
    identifiability_table(data, ridge, seeds, full)
    sign_table(data, full, seeds)
    if data.test is not None:
        suggest_table(data, full)
    if ns.sklearn:
        sklearn_table(data, ridge, ns.sklearn)
    return 0


# ---------------------------------------------------------------------------- data


class Split:
    """Tower outputs of one evaluation split: images, captions, owners, caption strings."""

    def __init__(self, x, y, owner, texts):
        self.x, self.y, self.owner, self.texts = x, y, owner, texts  # (N, F), (M, F'), (M,), list[str]


class Feats:
    """Locked-tower outputs of train / val / test, and CCA fits on subsets of the training images."""

    def __init__(self, x, y, owner, val: Split, test: Split | None, dim: int):
        self.x, self.y, self.owner, self.val, self.test, self.dim = x, y, owner, val, test, dim

    @classmethod
    def load(cls, folder: str, preset: str, embed_dim: int | None, run: str | None = None) -> "Feats":
        """Tower outputs per split; with ``run``, that run's served embeddings of them (D = its D)."""
        from triclip.model.cache import locked_tower_outputs
        from triclip.data import load_pairs
        from triclip.model.model import ModelConfig, build_model
        from triclip.model.run import load_run
        from triclip.training.solve import paired_features, served_embeddings

        if run:
            model = load_run(run)[0]
        else:
            model = build_model(ModelConfig(preset=preset, embed_dim=embed_dim, head="affine", importance="softplus"))
        model.lock(image=True, text=True)
        splits = {}
        for name in ("train", "val", "test"):
            path = Path(folder) / f"{name}.jsonl"
            if not path.exists():
                splits[name] = None
                continue
            pairs = load_pairs(str(path))
            cache = locked_tower_outputs(model, pairs, torch.device("cpu"))
            x, y, owner = paired_features(cache)
            if run:
                with torch.no_grad():
                    x, y = served_embeddings(model, x, y)  # (N, D), (M, D)
            keep = cache["image"]["valid"].nonzero().squeeze(1).tolist()
            texts = [c for i in keep for c in pairs.records[i].captions]
            splits[name] = Split(x, y, owner, texts)
        tr = splits["train"]
        return cls(tr.x, tr.y, tr.owner, splits["val"], splits["test"], model.embed_dim)

    def fit(self, images: torch.Tensor, ridge: float):
        """CCA on the training images ``images`` (row indices) and all their captions."""
        from triclip.training.solve import fit_cca, pair_stats

        keep = torch.zeros(self.x.shape[0], dtype=torch.bool)
        keep[images] = True
        rows = keep[self.owner].nonzero().squeeze(1)  # captions of the kept images
        new_index = torch.full((self.x.shape[0],), -1, dtype=torch.long)
        new_index[images.sort().values] = torch.arange(len(images))
        x = self.x[images.sort().values]
        return fit_cca(pair_stats(x, self.y[rows], new_index[self.owner[rows]]), self.dim, ridge, x)


def embed(solution, split: Split, weighting: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The served embeddings of a split: ``sqrt(rho ** weighting) * z``, L2-normalised. (N, D), (M, D)."""
    scale = solution.rho.clamp_min(1e-6) ** (weighting / 2.0)  # (D,)
    img = ((split.x.double() - solution.mean_x) @ solution.a * scale).float()
    txt = ((split.y.double() - solution.mean_y) @ solution.b * scale).float()
    return F.normalize(img, dim=-1), F.normalize(txt, dim=-1)


def recall(solution, split: Split, weighting: float = 1.0) -> float:
    img, txt = embed(solution, split, weighting)
    return float(retrieval_recall(img, txt, split.owner, texts=split.texts)["t2i_r10"])


def pick_ridge(data: Feats) -> float:
    from triclip.training.solve import RIDGE_GRID

    scores = {r: recall(data.fit(torch.arange(data.x.shape[0]), r), data.val) for r in RIDGE_GRID}
    print("\nRidge grid (val t2i R@10): " + ", ".join(f"{r:g}: {v:.3f}" for r, v in scores.items()))
    if data.test is not None:
        tests = {r: recall(data.fit(torch.arange(data.x.shape[0]), r), data.test) for r in RIDGE_GRID}
        print("Ridge grid (test t2i R@10): " + ", ".join(f"{r:g}: {v:.3f}" for r, v in tests.items()))
    return max(scores, key=scores.get)


# ---------------------------------------------------------------------------- tables


def weighting_table(data: Feats, ridge: float) -> None:
    t0 = time.perf_counter()
    solution = data.fit(torch.arange(data.x.shape[0]), ridge)
    seconds = time.perf_counter() - t0
    print(f"\nSolve (covariances + Cholesky + SVD, float64, 1 thread): {seconds:.2f} s")
    dims = [data.dim // 16, data.dim // 8, data.dim]
    splits = [("val", data.val)] + ([("test", data.test)] if data.test is not None else [])
    print("\n| weighting of dim k | " + " | ".join(f"{n} m={m}" for n, _ in splits for m in dims) + " |")
    print("|---|" + "---:|" * (len(dims) * len(splits)))
    for p in WEIGHTINGS:
        cells = []
        for _, split in splits:
            img, txt = embed(solution, split, p)
            curve = compact_curve(img, txt, split.owner, None, dims, orderings=("first",), texts=split.texts)["first"]
            cells += [f"{curve[m]:.3f}" for m in dims]
        label = {0.0: "none (cosine)", 0.5: "sqrt(rho)", 1.0: "rho (f^T S g)", 2.0: "rho^2"}[p]
        print(f"| {label} | " + " | ".join(cells) + " |")


def _gaps(rho: torch.Tensor) -> torch.Tensor:
    """``min(rho_{k-1} - rho_k, rho_k - rho_{k+1})`` (one side at the ends). Shape: (D,)."""
    diff = rho[:-1] - rho[1:]  # (D-1,)
    left = torch.cat([torch.tensor([math.inf], dtype=rho.dtype), diff])
    right = torch.cat([diff, torch.tensor([math.inf], dtype=rho.dtype)])
    return torch.minimum(left, right)


def _column_corr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Correlation of column k of a with column k of b. Shapes: (N, D), (N, D) -> (D,)."""
    a, b = a - a.mean(0), b - b.mean(0)
    return (a * b).sum(0) / (a.norm(dim=0) * b.norm(dim=0)).clamp_min(1e-12)


def _raw(solution, x: torch.Tensor) -> torch.Tensor:
    return (x.double() - solution.mean_x) @ solution.a  # (N, D) canonical variates


def identifiability_table(data: Feats, ridge: float, seeds: list[int], full) -> None:
    n = data.x.shape[0]
    per_seed = {name: [] for name in ("abs",) + SIGN_RULES}
    for seed in seeds:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        halves = perm[: n // 2], perm[n // 2 :]
        fits = [data.fit(h, ridge) for h in halves]
        val = [_raw(f, data.val.x) for f in fits]  # (N_val, D) each
        own = [_raw(f, data.x[h.sort().values]) for f, h in zip(fits, halves)]  # each half's own training images
        per_seed["abs"].append(_column_corr(*val).abs())
        for rule in SIGN_RULES:  # a sign fix gives the same result whatever sign the solver left
            per_seed[rule].append(_column_corr(*(v * sign_flips(o, rule) for v, o in zip(val, own))))
    mean = {k: torch.stack(v).mean(0) for k, v in per_seed.items()}  # (D,)
    rho, gaps = full.rho, _gaps(full.rho)
    print(f"\nIdentifiability across disjoint halves of the training images ({len(seeds)} random splits, val images):")
    print("\n| dims k | rho_k | gap g_k | abs corr | signed, anchor | signed, majority | signed, skew |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    blocks = [(k, k + 1) for k in range(8)] + [(8, 16), (16, 32), (32, 64), (64, 128), (128, data.dim)]
    for lo, hi in blocks:
        if lo >= data.dim:
            break
        hi = min(hi, data.dim)
        label = f"{lo + 1}" if hi == lo + 1 else f"{lo + 1}-{hi}"
        cells = [rho[lo:hi].mean(), gaps[lo:hi].clamp_max(1).mean(), mean["abs"][lo:hi].mean()]
        cells += [mean[r][lo:hi].mean() for r in SIGN_RULES]
        print(f"| {label} | " + " | ".join(f"{float(c):.3f}" for c in cells) + " |")
    from scipy.stats import spearmanr

    finite = torch.isfinite(gaps)
    rs = spearmanr(gaps[finite].numpy(), mean["abs"][finite].numpy()).statistic
    big = gaps >= torch.quantile(gaps[finite], 0.75)
    small = gaps <= torch.quantile(gaps[finite], 0.25)
    print(
        f"\nSpearman(gap, abs corr) over {int(finite.sum())} dims: {rs:+.2f}; mean abs corr of the quarter with the"
        f" largest gaps {float(mean['abs'][big].mean()):.3f}, of the smallest {float(mean['abs'][small].mean()):.3f}."
        f" Dims with abs corr > 0.9: {int((mean['abs'] > 0.9).sum())} of {data.dim}."
    )


def sign_table(data: Feats, full, seeds: list[int]) -> None:
    n = data.x.shape[0]
    print("\nSign rules: share of the D dims whose flip agrees between the two halves of the training images")
    print("(the same full-data solution; each rule anchored on one half, then on the other)\n")
    print("| rule | agreement (mean over splits) | min |")
    print("|---|---:|---:|")
    z = _raw(full, data.x)
    for rule in SIGN_RULES:
        agree = []
        for seed in seeds:
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
            a, b = perm[: n // 2].sort().values, perm[n // 2 :].sort().values
            agree.append(float((sign_flips(z[a], rule) == sign_flips(z[b], rule)).double().mean()))
        print(f"| {rule} | {statistics.mean(agree):.3f} | {min(agree):.3f} |")


def suggest_table(data: Feats, full) -> None:
    img, txt = embed(full, data.test)
    dims = sorted({m for m in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, data.dim) if m <= data.dim})
    w = full.rho.float()
    curve = compact_curve(img, txt, data.test.owner, None, dims, orderings=("first",), texts=data.test.texts)["first"]
    full_r = curve[data.dim]
    cum1 = (w.cumsum(0) / w.sum()).tolist()
    cum2 = ((w**2).cumsum(0) / (w**2).sum()).tolist()
    print("\nsuggest_m: the importance spectrum against the test recall curve (own order = rho order)\n")
    print("| m | test t2i R@10 | share of full D | cum share of rho | cum share of rho^2 |")
    print("|---:|---:|---:|---:|---:|")
    for m in dims:
        print(f"| {m} | {curve[m]:.3f} | {curve[m] / full_r:.3f} | {cum1[m - 1]:.3f} | {cum2[m - 1]:.3f} |")
    err1 = statistics.mean(abs(curve[m] / full_r - cum1[m - 1]) for m in dims)
    err2 = statistics.mean(abs(curve[m] / full_r - cum2[m - 1]) for m in dims)
    print(f"\nmean |relative recall - predicted| over those m: share of rho {err1:.3f}, of rho^2 {err2:.3f}")
    print("\n| share x | power 1 (rho): m | test R@10 there | / full D | power 2 (rho^2, the default): m | R@10 | / full D | within x? |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for share in SHARES:
        row = []
        for power in (1.0, 2.0):
            m = suggest_m(w, share=share, power=power)
            r = compact_curve(img, txt, data.test.owner, None, [m], orderings=("first",), texts=data.test.texts)["first"][m]
            row.append((m, r))
        (m1, r1), (m2, r2) = row
        ok = "yes" if r2 >= share * full_r else "no"
        print(f"| {share} | {m1} | {r1:.3f} | {r1 / full_r:.3f} | {m2} | {r2:.3f} | {r2 / full_r:.3f} | {ok} |")


def sklearn_table(data: Feats, ridge: float, k: int) -> None:
    from sklearn.cross_decomposition import CCA as SkCCA

    x, y = data.x[data.owner].double().numpy(), data.y.double().numpy()
    t0 = time.perf_counter()
    sk = SkCCA(n_components=k, scale=False, max_iter=500).fit(x, y)
    sk_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = data.fit(torch.arange(data.x.shape[0]), ridge)
    ours_s = time.perf_counter() - t0

    def corr_sk(split_x, split_y):
        a, b = sk.transform(split_x, split_y)
        return _column_corr(torch.from_numpy(a), torch.from_numpy(b))

    ours0 = data.fit(torch.arange(data.x.shape[0]), 0.0)
    rows = [
        ("scikit-learn CCA (NIPALS, no ridge)", sk_s, corr_sk(x, y), corr_sk(data.val.x[data.val.owner].double().numpy(), data.val.y.double().numpy())),
    ]
    for label, sol, secs in ((f"torch.linalg, ridge {ridge:g}", ours, ours_s), ("torch.linalg, ridge 0", ours0, float("nan"))):
        tr = _column_corr(_raw(sol, data.x[data.owner]), (data.y.double() - sol.mean_y) @ sol.b)[:k]
        va = _column_corr(_raw(sol, data.val.x[data.val.owner]), (data.val.y.double() - sol.mean_y) @ sol.b)[:k]
        rows.append((label, secs, tr, va))
    print(f"\nscikit-learn CCA against the torch.linalg solver (top {k} components; seconds on 1 thread):\n")
    print("| solver | seconds | train corr 1 / k | mean train corr | val corr 1 / k | mean val corr | val t2i R@10 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, secs, tr, va in rows:
        if label.startswith("scikit"):
            img = torch.from_numpy(sk.transform(data.val.x.double().numpy()))
            _, txt = sk.transform(data.val.x[:1].double().numpy(), data.val.y.double().numpy())
            r = float(retrieval_recall(F.normalize(img.float(), dim=-1), F.normalize(torch.from_numpy(txt).float(), dim=-1), data.val.owner, texts=data.val.texts)["t2i_r10"])
        else:
            sol = ours if "ridge 0" not in label or ridge == 0 else ours0
            img, txt = embed(sol, data.val, 0.0)
            img, txt = img[:, :k], txt[:, :k]
            r = float(retrieval_recall(F.normalize(img, dim=-1), F.normalize(txt, dim=-1), data.val.owner, texts=data.val.texts)["t2i_r10"])
        print(f"| {label} | {secs:.2f} | {float(tr[0]):.3f} / {float(tr[-1]):.3f} | {float(tr.mean()):.3f} | "
              f"{float(va[0]):.3f} / {float(va[-1]):.3f} | {float(va.mean()):.3f} | {r:.3f} |")  # fmt: skip


def runs_table(runs: list[str], val: str) -> None:
    """Seeds of a trained objective: per-dimension signed corr (own order, skew rule) of val image features."""
    from triclip.model.cache import locked_tower_outputs
    from triclip.data import load_pairs
    from triclip.model.embed import embed_pairs
    from triclip.model.run import load_run

    feats, ws = [], []
    pairs = load_pairs(val)
    for run in runs:
        model, _ = load_run(run)
        with torch.no_grad():
            z = embed_pairs(model, pairs, "cpu", 256, locked_tower_outputs(model, pairs, "cpu")).image
            w = model.importance().detach().float()
        order = torch.argsort(w, descending=True, stable=True)
        z = z[:, order] * w[order].sqrt()
        feats.append(z * sign_flips(z, "skew"))
        ws.append(w[order] / w.mean())
    pairs_corr = [_column_corr(feats[i], feats[j]) for i in range(len(runs)) for j in range(i + 1, len(runs))]
    corr = torch.stack(pairs_corr).mean(0)  # (D,) signed, mean over seed pairs
    abs_corr = torch.stack(pairs_corr).abs().mean(0)  # (D,) sign-free
    gaps = _gaps(torch.stack(ws).mean(0).double())
    print(f"\nTrained runs ({len(runs)} seeds, {len(pairs_corr)} pairs): signed corr of val image features per dim, own order\n")
    print("| dims k | mean w_k (mean 1) | gap | signed corr | abs corr |")
    print("|---|---:|---:|---:|---:|")
    w = torch.stack(ws).mean(0)
    for lo, hi in [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64), (64, len(w))]:
        if lo >= len(w):
            break
        print(f"| {lo + 1}-{hi} | {float(w[lo:hi].mean()):.3f} | {float(gaps[lo:hi].clamp_max(1).mean()):.3f} | "
              f"{float(corr[lo:hi].mean()):.3f} | {float(abs_corr[lo:hi].mean()):.3f} |")  # fmt: skip


def class_map_table(val: str, runs: list[str]) -> None:
    """Class mAP of each ordering at m = 16 / 32 and full D, mean ± sd over ``runs``."""
    from triclip.model.cache import locked_tower_outputs
    from triclip.compact.features import compact_embeddings, fit_pca
    from triclip.data import load_pairs
    from triclip.model.embed import embed_pairs
    from triclip.compact.metrics import class_map
    from triclip.model.run import load_run

    pairs = load_pairs(val)
    cells = [("own", "importance", 256), ("own", "importance", 16), ("own", "importance", 32), ("PCA", "pca", 16),
             ("PCA", "pca", 32), ("first", "first", 16), ("first", "first", 32), ("random", "random", 16), ("random", "random", 32)]  # fmt: skip
    values: dict[int, list[float]] = {}
    for run in runs:
        model, _ = load_run(run)
        e = embed_pairs(model, pairs, "cpu", 256, locked_tower_outputs(model, pairs, "cpu"))
        w = model.importance().detach().float()
        first = first_captions(e.text_to_image)
        labels = [str(pairs.records[i].label) for i in e.keep.tolist()]  # class_map maps them to ids
        basis = fit_pca(torch.cat([e.image, e.text]))
        for i, (_, name, m) in enumerate(cells):
            m = min(m, model.embed_dim)
            img, txt = compact_embeddings(e.image, e.text, name, m, w, 0, basis)
            values.setdefault(i, []).append(float(class_map(txt[first], img, labels, labels)))

    def ms(v: list[float]) -> str:
        return f"{statistics.mean(v):.3f} ± {statistics.stdev(v):.3f}" if len(v) > 1 else f"{v[0]:.3f}"

    print("| runs | full D | " + " | ".join(f"{o} m={m}" for o, _, m in cells[1:]) + " |")
    print("|---|" + "---:|" * len(cells))
    print(f"| {', '.join(runs)} | " + " | ".join(ms(values[i]) for i in range(len(cells))) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
