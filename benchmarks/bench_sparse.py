"""Sparse codes, CSR-style: a post-hoc top-k sparse autoencoder on a run's served embeddings, recall against bytes.

Usage::

    .venv/bin/python -m benchmarks.bench_sparse --runs RUNS/oc/mrl_solved_tricl --seeds 0,1,2 \\
        [--ks 2,4,8,16,32] [--hidden 1024] [--steps 2000] [--contrastive 0.0] \\
        [--bytes-json bytes_oc.json] --json sparse_oc.json

CSR (Contrastive Sparse Representation, Wen et al., ICML 2025) keeps k active entries of an overcomplete code and
is reported to beat MRL at equal active dimensions. Here, on each run's served vectors (``RUN/served.npz``, as
``benchmarks.bench_bytes`` caches them):

- **Autoencoder**: ``z = TopK_k(ReLU(W_enc (x - b_dec) + b_enc))`` with ``W_enc`` D -> H (H = 4D by default),
  ``x_hat = W_dec z + b_dec`` (tied: ``W_dec = W_enc^T``, or untied), trained on the **train** split's image and
  text vectors (paired rows) with the reconstruction loss ``|x - x_hat|^2`` of both; ``--contrastive L`` adds
  ``L`` times CSR's contrastive term, InfoNCE between the sparse codes of the paired image and text in a batch
  (cosine of the codes, temperature ``TAU``). Adam, fixed seed, a fixed number of steps.
- **Bytes**: k active entries, each a uint16 index and a float16 value: ``4k`` bytes per image
  (:func:`bytes_per_vector`); the gallery's values are rounded to float16 before scoring.
- **Scoring** (test split, distinct texts as queries, t2i R@1 / R@10 by ``bench_bytes.recall``):
  ``CSR sparse.sparse`` = the query text's sparse code against the image's (CSR's usage);
  ``CSR float.decoded`` = the query's float vector against the decoded image (asymmetric).
- **MRL at equal active dimensions**: ``float32 top-m (today)`` with m = k (``bench_bytes.today``: the first k
  coordinates re-normalised), which costs 4k bytes too, so equal active dimensions are equal bytes here.
- ``--bytes-json``: the ``bench_bytes measure`` JSON of the same runs; its rows (OPQ+PQ, mixed, the val-chosen
  code, ...) are compared seed by seed at equal bytes.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_bytes import K, mean_sd, queries, recall, served, today  # noqa: E402

TAU = 0.07  # InfoNCE temperature of the contrastive term
COMPARED = ["float32 top-m (today)", "int8", "OPQ+PQ", "mixed", "triclip (chosen on val)"]  # rows of bench_bytes


def bytes_per_vector(k: int) -> int:
    """k active entries, each a uint16 index (2 B) and a float16 value (2 B)."""
    return 4 * k


class SparseAutoencoder:
    """Top-k sparse autoencoder D -> H -> D (torch), encoder and decoder as in CSR / top-k SAEs."""

    def __init__(self, dim: int, hidden: int, k: int, tied: bool = False, seed: int = 0):
        import torch

        if not 1 <= k <= hidden:
            raise ValueError(f"k must be in 1..{hidden}, got {k}")
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(hidden, dim, generator=gen)
        w = w / w.norm(dim=1, keepdim=True)  # unit-norm atoms
        self.k, self.tied = k, tied
        self.w_enc = w.clone().requires_grad_()
        self.b_enc = torch.zeros(hidden, requires_grad=True)
        self.b_dec = torch.zeros(dim, requires_grad=True)
        self.w_dec = None if tied else w.clone().requires_grad_()

    def parameters(self) -> list:
        return [p for p in (self.w_enc, self.b_enc, self.b_dec, self.w_dec) if p is not None]

    def encode(self, x):
        """(N, D) -> (N, H) with exactly k entries kept (ReLU, then the k largest; a kept entry may be 0)."""
        import torch

        pre = torch.relu((x - self.b_dec) @ self.w_enc.T + self.b_enc)
        top = pre.topk(self.k, dim=1)
        return torch.zeros_like(pre).scatter(1, top.indices, top.values)

    def decode(self, z):
        return z @ (self.w_enc if self.tied else self.w_dec) + self.b_dec


def fit(image: np.ndarray, text: np.ndarray, owner: np.ndarray, k: int, hidden: int, steps: int = 2000,
        batch: int = 256, lr: float = 1e-3, contrastive: float = 0.0, tied: bool = False,
        seed: int = 0) -> SparseAutoencoder:  # fmt: skip
    """Train on paired rows (``text[i]`` describes ``image[owner[i]]``): reconstruction of both, plus
    ``contrastive`` times InfoNCE between the paired sparse codes."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    img = torch.from_numpy(np.ascontiguousarray(image, np.float32))
    txt = torch.from_numpy(np.ascontiguousarray(text, np.float32))
    own = torch.from_numpy(np.asarray(owner, np.int64))
    model = SparseAutoencoder(image.shape[1], hidden, k, tied, seed)
    with torch.no_grad():  # start the decoder bias at the mean (as top-k SAEs do)
        model.b_dec.copy_(torch.cat([img, txt]).mean(0))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        rows = torch.from_numpy(rng.choice(len(txt), min(batch, len(txt)), replace=False))
        x_img, x_txt = img[own[rows]], txt[rows]
        z = model.encode(torch.cat([x_img, x_txt]))
        loss = F.mse_loss(model.decode(z), torch.cat([x_img, x_txt]), reduction="sum") / len(z)
        if contrastive:
            z_img, z_txt = F.normalize(z[: len(rows)], dim=1), F.normalize(z[len(rows) :], dim=1)
            logits = z_txt @ z_img.T / TAU
            same = own[rows][:, None] == own[rows][None, :]  # other captions of the same image are not negatives
            logits = logits.masked_fill(same & ~torch.eye(len(rows), dtype=torch.bool), float("-inf"))
            target = torch.arange(len(rows))
            loss = loss + contrastive * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
        if model.w_dec is not None:
            with torch.no_grad():
                model.w_dec /= model.w_dec.norm(dim=1, keepdim=True).clamp_min(1e-8)  # unit-norm atoms
    return model


def codes(model: SparseAutoencoder, x: np.ndarray, half: bool = False) -> np.ndarray:
    """Sparse codes (N, H) as numpy, values rounded to float16 when ``half`` (what is stored)."""
    import torch

    with torch.no_grad():
        z = model.encode(torch.from_numpy(np.ascontiguousarray(x, np.float32))).numpy()
    return z.astype(np.float16).astype(np.float32) if half else z


def decoded(model: SparseAutoencoder, z: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model.decode(torch.from_numpy(z)).numpy()


def _top(scores: np.ndarray) -> np.ndarray:
    return np.argsort(-scores, axis=1, kind="stable")[:, :K]


def measure_run(splits: dict, ks: list[int], hidden: int, steps: int, contrastive: float, tied: bool, seed: int,
                log=print) -> dict:  # fmt: skip
    """``{method: {bytes: {"r1", "r10", ...}}}`` on test for one run."""
    train, test = splits["train"], splits["test"]
    q, rel = queries(test)
    gallery = test["image"]
    out: dict = {"float32 full D": {4 * gallery.shape[1]: recall(_top(q @ gallery.T), rel)}}
    for k in ks:
        b = bytes_per_vector(k)
        start = time.perf_counter()
        model = fit(train["image"], train["text"], train["owner"], k, hidden, steps, contrastive=contrastive,
                    tied=tied, seed=seed)  # fmt: skip
        seconds = time.perf_counter() - start
        g = codes(model, gallery, half=True)
        g_hat = decoded(model, g)
        err = float(((g_hat - gallery) ** 2).sum(1).mean())  # relative to |x|^2 = 1
        alive = float((codes(model, train["image"]) > 0).any(0).mean())
        info = {"k": k, "fit_s": round(seconds, 1), "test_image_mse": err, "alive_atoms": alive}
        out.setdefault("CSR sparse.sparse", {})[b] = {**recall(_top(codes(model, q) @ g.T), rel), **info}
        out.setdefault("CSR float.decoded", {})[b] = {**recall(_top(q @ g_hat.T), rel), **info}
        out.setdefault("float32 top-m (today)", {})[b] = recall(today(None, gallery, q, b), rel)
        log(f"  k={k:>3} ({b:>3} B) fit {seconds:5.1f} s  mse {err:.3f}  alive {alive:.2f}  "
            f"sparse {out['CSR sparse.sparse'][b]['r10']:.3f}  decoded {out['CSR float.decoded'][b]['r10']:.3f}  "
            f"top-m {out['float32 top-m (today)'][b]['r10']:.3f}")  # fmt: skip
    return out


def report(per_seed: list[dict], bytes_runs: list[dict] | None) -> str:
    """Rows: the sparse codes, MRL's top-m at m = k, and (when given) bench_bytes' rows at equal bytes; then the
    paired differences of the better sparse row against top-m and against the best code of bench_bytes."""
    budgets = sorted({int(b) for b in per_seed[0]["CSR sparse.sparse"]})
    ours = ("CSR sparse.sparse", "CSR float.decoded", "float32 top-m (today)")
    rows = {name: [r[name] for r in per_seed] for name in ours}
    if bytes_runs:
        rows.update({f"{name} (bench_bytes)": [r.get(name, {}) for r in bytes_runs] for name in COMPARED[1:]})
    head = "| method | " + " | ".join(f"{b} B (k = {b // 4})" for b in budgets) + " |"
    lines = [head, "|---|" + "---:|" * len(budgets)]
    for name, runs in rows.items():
        cells = [mean_sd([r[str(b)]["r10"] for r in runs]) if all(str(b) in r for r in runs) else "–"
                 for b in budgets]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    full = [next(iter(r["float32 full D"].values()))["r10"] for r in per_seed]
    lines.append(f"\nfloat32 full D: {mean_sd(full)}\n")
    lines += ["| B | k | CSR sparse − top-m (m = k) | CSR decoded − top-m (m = k) | best CSR − best code of "
              "bench_bytes |", "|---:|---:|---:|---:|---|"]  # fmt: skip
    for b in budgets:
        s, d, t = ([r[n][str(b)]["r10"] for r in per_seed] for n in ours)
        best = max((s, d), key=statistics.mean)
        cell = "–"
        if bytes_runs:
            peers = [n for n in COMPARED[1:] if all(str(b) in r.get(n, {}) for r in bytes_runs)]
            if peers:
                top = max(peers, key=lambda n: statistics.mean(r[n][str(b)]["r10"] for r in bytes_runs))
                diff = [x - r[top][str(b)]["r10"] for x, r in zip(best, bytes_runs)]
                cell = f"{mean_sd(diff)} (vs {top})"
        lines.append(f"| {b} | {b // 4} | {mean_sd([a - c for a, c in zip(s, t)])} | "
                     f"{mean_sd([a - c for a, c in zip(d, t)])} | {cell} |")  # fmt: skip
    return "\n".join(lines)


@dataclass
class SparseConfig:
    runs: str  # RUNS/VARIANT: seedN/served.npz under it (bench_bytes')
    json: str  # write every number here
    data: str | None = None  # the data folder, only if served.npz must be embedded
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # the runs' seeds
    ks: list[int] = field(default_factory=lambda: [2, 4, 8, 16, 32])  # active atoms per vector
    hidden: int = 0  # atoms H (0: 4D)
    steps: int = 2000  # training steps of the sparse code
    contrastive: float = 0.0  # weight of the InfoNCE term on the codes
    tied: bool = False  # decoder = encoder transposed
    bytes_json: str | None = None  # bench_bytes measure JSON of the same runs and seeds


def main(argv=None) -> int:
    from triclip.app.options import parse_config

    ns = parse_config(SparseConfig, argv, __doc__.split("\n")[0])
    import torch

    from triclip.core.io import write_json_atomic

    torch.set_num_threads(1)
    seeds, ks = ns.seeds, ns.ks
    bytes_runs = None
    if ns.bytes_json:
        saved = json.loads(Path(ns.bytes_json).read_text())
        bytes_runs = [saved["per_seed"][s] for s in seeds]  # bench_bytes' default seeds 0, 1, 2, in order
    per_seed = []
    for seed in seeds:
        run = Path(ns.runs) / f"seed{seed}"
        splits = served(run, Path(ns.data) if ns.data else run)
        hidden = ns.hidden or 4 * splits["train"]["image"].shape[1]
        print(f"{run}: H = {hidden}, {ns.steps} steps, contrastive {ns.contrastive}", flush=True)
        per_seed.append(json.loads(json.dumps(
            measure_run(splits, ks, hidden, ns.steps, ns.contrastive, ns.tied, seed, lambda s: print(s, flush=True)))))
        write_json_atomic(ns.json, {"runs": ns.runs, "seeds": seeds[: len(per_seed)], "hidden": hidden,
                                    "steps": ns.steps, "contrastive": ns.contrastive, "tied": ns.tied,
                                    "per_seed": per_seed})  # fmt: skip
    print("\ntest t2i R@10, mean ± sd over seeds " + ", ".join(map(str, seeds)) + ":\n")
    print(report(per_seed, bytes_runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
