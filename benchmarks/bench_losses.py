"""Forward+backward time of every objective, as a ratio to ``infonce`` measured in the same run.

    .venv/bin/python benchmarks/bench_losses.py --batch 256 1024 --dim 512 --repeats 30 [--threads 1 --clock cpu]

For each batch size the objectives run interleaved (one step of each per repeat, the
order rotated every repeat) on the same features, so slow drifts of a shared machine
hit them alike; the table shows the median milliseconds, the ratio of medians to
``infonce`` and the ratio of minimums (the least disturbed step, on a loaded machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from triclip.losses import build_loss

# (row label, loss name, options)
OBJECTIVES: list[tuple[str, str, dict]] = [
    ("infonce", "infonce", {}),
    ("debiased (tau_plus=0.1)", "debiased", {}),
    ("tricl (dec_weight=1)", "tricl", {"dec_weight": 1.0}),
    ("tricl (dec_weight=0)", "tricl", {"dec_weight": 0.0}),
    ("tricl (dec_weight=1, tau_plus=0.1)", "tricl", {"dec_weight": 1.0, "tau_plus": 0.1}),
    ("hard_negative", "hard_negative", {}),
    ("align_uniform", "align_uniform", {}),
    ("contrastive", "contrastive", {}),
    ("triplet (semihard)", "triplet", {}),
    ("sigmoid", "sigmoid", {}),
]


def _open_clip_step() -> tuple[str, Callable] | None:
    """open_clip's own ClipLoss as an outside reference point for ``infonce`` (if installed)."""
    try:
        from open_clip.loss import ClipLoss
    except Exception:  # noqa: BLE001 - optional reference row
        return None
    clip = ClipLoss()
    return "open_clip ClipLoss (reference)", lambda i, t, s, w: {"loss": clip(i, t, s)}


def _plain_ce_step() -> tuple[str, Callable]:
    """The textbook symmetric InfoNCE (two F.cross_entropy through autograd): what the fused head replaces."""

    def step(image, text, scale, w):
        logits = (image * scale) @ text.t()  # (B, B)
        labels = torch.arange(logits.shape[0], device=logits.device)
        return {"loss": 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))}

    return "F.cross_entropy x2 (reference)", step


def _inputs(batch: int, dim: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(batch)
    image = F.normalize(torch.randn(batch, dim, generator=g), dim=1)
    text = F.normalize(image + torch.randn(batch, dim, generator=g), dim=1)
    w = F.softplus(torch.randn(dim, generator=g))
    scale = torch.tensor(1 / 0.07)
    return [x.to(device).requires_grad_(True) for x in (image, text, scale, w)]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: this process's CPU time, not waits


def _time_step(fn: Callable, inputs: list[torch.Tensor], device: str, clock: Callable[[], float]) -> float:
    for x in inputs:
        x.grad = None
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = clock()
    sum(fn(*inputs).values()).backward()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (clock() - start) * 1e3


def measure(
    batch: int,
    dim: int,
    repeats: int,
    warmup: int,
    device: str,
    steps: list[tuple[str, Callable]],
    clock: str = "wall",
) -> dict[str, list[float]]:
    """Timed ms of forward+backward per row label, objectives interleaved."""
    inputs = _inputs(batch, dim, device)
    times: dict[str, list[float]] = {label: [] for label, _ in steps}
    for rep in range(warmup + repeats):
        shift = rep % len(steps)
        for label, fn in steps[shift:] + steps[:shift]:
            ms = _time_step(fn, inputs, device, CLOCKS[clock])
            if rep >= warmup:
                times[label].append(ms)
    return times


def table(results: dict[int, dict[str, list[float]]], labels: Sequence[str]) -> str:
    """Markdown table per batch size: median ms, ratio of medians to infonce, ratio of minimums."""
    batches = list(results)
    head = "| objective | " + " | ".join(f"B={b} ms | x infonce | x infonce (min)" for b in batches) + " |"
    rule = "|---|" + "---:|---:|---:|" * len(batches)
    rows = [head, rule]
    for label in labels:
        cells = []
        for b in batches:
            med = {k: statistics.median(v) for k, v in results[b].items()}
            low = {k: min(v) for k, v in results[b].items()}
            cells.append(f"{med[label]:.2f} | {med[label] / med['infonce']:.2f} | {low[label] / low['infonce']:.2f}")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[256, 1024], help="batch sizes")
    p.add_argument("--dim", type=int, default=512, help="embedding width")
    p.add_argument("--repeats", type=int, default=30, help="timed steps per objective")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per objective first")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's; 1 on a shared CPU)")
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall time, or process CPU time (steadier on a shared, loaded CPU; not for CUDA)",
    )
    p.add_argument("--no-open-clip", action="store_true", help="leave out open_clip's ClipLoss row")
    args = p.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            p.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and args.device.startswith("cuda"):
        p.error("--clock cpu does not measure GPU work; use --clock wall on CUDA")

    steps: list[tuple[str, Callable]] = []
    for label, name, opts in OBJECTIVES:
        steps.append((label, build_loss(name, **opts).to(args.device)))
    steps.append(_plain_ce_step())
    reference = None if args.no_open_clip else _open_clip_step()
    if reference is not None:
        steps.append(reference)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"# losses, forward+backward, dim {args.dim}, device {args.device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.clock} clock, {args.repeats} repeats (median), "
        f"load average {load:.2f}"
    )
    results = {b: measure(b, args.dim, args.repeats, args.warmup, args.device, steps, args.clock) for b in args.batch}
    print(table(results, [label for label, _ in steps]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
