"""Compact curve of a ``tricl`` run against an ``infonce`` run: table, goal checks and a PNG.

Evaluates both runs on the same validation data (t2i recall@10 for every ordering and m),
prints a Markdown table, checks the compact-retrieval goals (docs/CONTRACT.md) and draws one
plot (recall@10 against m, log-scaled m, one line per run and ordering):

    .venv/bin/python -m benchmarks.compact_curve --tricl runs/tiny-tricl --infonce runs/tiny-infonce \\
        --data data/shapes20k/val.jsonl --png docs/compact_tiny_shapes.png

Goals checked (D = the runs' embedding size; both runs must share it):

- the tri-factor importance order at m = D/8 keeps >= 90% of the run's full recall@10;
- at m = D/16 it beats the ``infonce`` run's first-m and random-m by >= 0.10;
- at m = D/8 and D/16 it matches or beats PCA-m of the ``infonce`` run.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from triclip.model.run import read_config
from triclip.training.evaluate import ORDERINGS, evaluate_run


@dataclass
class CurveConfig:
    tricl: str  # run directory of the tri-factor model
    infonce: str  # run directory of the InfoNCE model (same preset and data)
    data: str  # validation data
    dims: list[int] = field(default_factory=list)  # m values (empty: D/32 ... D/2 and D)
    png: str | None = None  # where to write the plot
    title: str = ""  # plot title (default: the data path)


def default_dims(dim: int) -> list[int]:
    """D/32, D/16, D/8, D/4, D/2 (those >= 1) and D."""
    return sorted({m for m in (dim // 32, dim // 16, dim // 8, dim // 4, dim // 2) if m >= 1} | {dim})


def curves(result: dict, dims: list[int]) -> dict[str, list[float]]:
    """``{ordering: [t2i R@10 at each m]}`` (m missing from the evaluation: the run's full recall)."""
    full = result["t2i_r10"]
    out = {}
    for ordering in ORDERINGS:
        curve = {int(m): v for m, v in result["compact"][ordering].items()}
        out[ordering] = [curve.get(m, full) for m in dims]
    return out


def goal_checks(tricl: dict, infonce: dict, dim: int) -> list[tuple[str, bool, str]]:
    """The compact-retrieval goals as (statement, met, measured values)."""
    imp = {int(m): v for m, v in tricl["compact"]["importance"].items()}
    base = {o: {int(m): v for m, v in infonce["compact"][o].items()} for o in ("first", "random", "pca")}
    d8, d16 = dim // 8, dim // 16
    full = tricl["t2i_r10"]
    checks = [(f"importance m={d8} keeps >= 90% of full", imp[d8] >= 0.9 * full, f"{imp[d8]:.3f} / {full:.3f}")]
    for o in ("first", "random"):
        met = imp[d16] >= base[o][d16] + 0.10
        checks.append((f"importance m={d16} >= infonce {o} + 0.10", met, f"{imp[d16]:.3f} vs {base[o][d16]:.3f}"))
    for m in (d8, d16):
        met = imp[m] >= base["pca"][m]
        checks.append((f"importance m={m} >= infonce pca", met, f"{imp[m]:.3f} vs {base['pca'][m]:.3f}"))
    return checks


def markdown(results: dict[str, dict], dims: list[int]) -> str:
    lines = ["| run | ordering | " + " | ".join(f"m={m}" for m in dims) + " |", "|---|---|" + "---|" * len(dims)]
    for name, result in results.items():
        for ordering, values in curves(result, dims).items():
            lines.append(f"| {name} | {ordering} | " + " | ".join(f"{v:.3f}" for v in values) + " |")
    return "\n".join(lines)


def plot(results: dict[str, dict], dims: list[int], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    styles = {"tricl": "-", "infonce": "--"}  # line style per run, colour per ordering
    colours = dict(zip(ORDERINGS, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for name, result in results.items():
        for ordering, values in curves(result, dims).items():
            style = styles.get(name, ":")
            ax.plot(dims, values, style, color=colours[ordering], marker="o", ms=3, label=f"{name} {ordering}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(dims, [str(m) for m in dims])
    ax.set_xlabel("m (dimensions kept)")
    ax.set_ylabel("t2i recall@10")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp)
    tmp.replace(out)  # atomic
    plt.close(fig)


def run(cfg: CurveConfig) -> dict:
    dim = read_config(Path(cfg.tricl))["model"]["embed_dim"]
    dims = cfg.dims or default_dims(dim)
    inner = sorted({*dims, dim // 8, dim // 16})  # m = D too: the baselines score the plain cosine there
    runs = {"tricl": cfg.tricl, "infonce": cfg.infonce}
    results = {name: evaluate_run(path, cfg.data, dims=inner) for name, path in runs.items()}
    if len(results["infonce"]["importance"]["sorted"]) != dim:
        raise SystemExit("the two runs must have the same embedding size D")
    print(markdown(results, dims))
    print()
    for statement, met, values in goal_checks(results["tricl"], results["infonce"], dim):
        print(f"{'MET ' if met else 'NOT MET'}  {statement}: {values}")
    if cfg.png:
        plot(results, dims, cfg.png, f"{cfg.title or cfg.data}: t2i recall@10, D = {dim}")
        print(f"plot: {cfg.png}")
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--tricl", required=True)
    p.add_argument("--infonce", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--dims", default="", help="comma-separated m values (default: D/32 ... D)")
    p.add_argument("--png", default=None)
    p.add_argument("--title", default="", help="plot title (default: the data path)")
    p.add_argument("--json", default=None, help="also write both evaluations here")
    ns = p.parse_args(argv)
    dims = [int(x) for x in ns.dims.split(",") if x.strip()]
    results = run(CurveConfig(tricl=ns.tricl, infonce=ns.infonce, data=ns.data, dims=dims, png=ns.png, title=ns.title))
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
