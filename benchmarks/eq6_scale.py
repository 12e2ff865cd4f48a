"""Eq. 6's free scale, measured on trained runs: is S at the scale the objective wants?

    .venv/bin/python -m benchmarks.eq6_scale --data DIR/train.jsonl --runs RUN [RUN ...]

``L_tri(cS) = -2cP + c^2 N`` (``P``: mean positive score ``u_i^T S v_i``, ``N``: mean squared
negative score, ``u = sqrt(D) z`` as in ``triclip.losses.spectral``) is least at ``c* = P/N``.
For each run, on the pairs (image, its first caption) of ``--data``: ``P``, ``N``, ``c*``, ``L_tri``
at the learned S and at ``c* S``, the mean of ``w``, Eq. 8 per tower and the largest eigenvalue of
``E[uu^T]`` (the trace is D: a large one is a collapsed direction). docs/results_archive.md, "Eq. 6".
"""

from __future__ import annotations

import argparse

import torch

from triclip.losses.spectral import decorrelation_eq8


def scale_stats(image: torch.Tensor, text: torch.Tensor, w: torch.Tensor) -> dict[str, float]:
    """The numbers of the module docstring for paired rows.

    Args:
        image: L2-normalised image embeddings. Shape: (N, D).
        text: L2-normalised text embeddings, row i paired with image i. Shape: (N, D).
        w: the importance (the diagonal of S). Shape: (D,).
    """
    image, text, w = image.double(), text.double(), w.double()
    n, dim = image.shape
    scores = dim * (image * w) @ text.t()  # (N, N)
    pos = float(scores.diagonal().mean())
    neg = float((scores.square().sum() - scores.diagonal().square().sum()) / (n * (n - 1)))
    u = dim**0.5 * image
    top = float(torch.linalg.eigvalsh(u.t() @ u / n)[-1])
    return {
        "P": pos,
        "N": neg,
        "c_star": pos / neg,
        "L_tri": -2 * pos + neg,  # Eq. 6 (triclip.losses.spectral.spectral_terms) from the same scores
        "L_tri_at_c_star": -pos * pos / neg,
        "mean_w": float(w.mean()),
        "L_dec_image": float(decorrelation_eq8(image)),
        "L_dec_text": float(decorrelation_eq8(text)),
        "top_eig_image": top,
    }


def run_stats(run: str, data: str) -> dict[str, float]:
    """:func:`scale_stats` of ``run`` (its best weights if kept, else the last) on ``data``."""
    from triclip.model.cache import locked_tower_outputs
    from triclip.data import load_pairs
    from triclip.model.embed import embed_pairs
    from triclip.compact.metrics import first_captions
    from triclip.model.run import load_run

    device = torch.device("cpu")
    model, _ = load_run(run, device)
    pairs = load_pairs(data)
    image, text, owner, _, _ = embed_pairs(model, pairs, device, 256, locked_tower_outputs(model, pairs, device))
    first = first_captions(owner)  # (N,)
    return scale_stats(image, text[first], model.importance().detach())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="pairs to measure on (e.g. DIR/train.jsonl)")
    p.add_argument("--runs", nargs="+", required=True)
    ns = p.parse_args(argv)
    keys = ["P", "N", "c_star", "L_tri", "L_tri_at_c_star", "mean_w", "L_dec_image", "L_dec_text", "top_eig_image"]
    print("| run | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for run in ns.runs:
        stats = run_stats(run, ns.data)
        print(f"| {run} | " + " | ".join(f"{stats[k]:.3f}" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
