"""Peers in the haystack: triclip's chosen codes against autofaiss, usearch and plain FAISS, at equal bytes.

    python -m benchmarks.haystack_peers INDEX --data DATA --work DIR [--n 1000000] [--seeds 0,1,2]
        [--bytes 4,8,16,32] [--latency-ms 10] [--methods triclip,faiss,autofaiss,usearch]

Per seed, the haystack of ``benchmarks.haystack`` (the real test captions and images among N - T distractors)
is written once under DIR (shards, and a folder of .npy links to them that autofaiss and the workers read); the
exact float top 10 of the test captions and of the val captions (the tuning queries) is streamed over it.
Then per byte budget B:

- **triclip**: ``triclip index build --embeddings H/embeddings --val-embeddings H/val-embeddings --bytes B,...
  --latency-ms L`` (one build for every budget, the float vectors kept on disk for the re-rank): the codes are
  chosen on the val split's real rows, the split the peers are tuned on;
- **faiss**: ``IVF{nlist},PQ{2B}x4fs`` + ``IndexRefineFlat`` (the float rows in memory), nprobe and k_factor
  tuned on the val captions to :data:`TARGET` of their exact top 10, FAISS of the main environment;
- **autofaiss**: ``autofaiss.build_index`` with ``max_index_memory_usage`` = :func:`memory_cap` (room for B-byte
  codes and their 8-byte ids, or what triclip's code holds if more) and ``max_index_query_time_ms`` = L, in a
  virtual environment of its own (made by :func:`ensure_venv` when missing: autofaiss needs numpy < 2);
- **usearch** (in the same environment): an HNSW index of ``dtype`` b1 / i8 / f16 where D x bits / 8 = B.

Each index is built by ``benchmarks/haystack_peer_worker.py`` in a process of its own, then loaded and timed in
a fresh one (RSS delta of the load, single-query p50 / p99 on 1 and 2 threads, batch queries/s on 2 threads).
Printed: one JSON line per (seed, method, budget), then a table of mean ± sd over seeds with t2i recall@10 of
the real captions and the share of the exact float top 10 found.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks import haystack as hs
from triclip.core.errors import UserError
from triclip.core.progress import progress
from triclip.index.budgets import recall_at_k

TARGET = 0.95  # share of the exact float top 10 that plain FAISS's nprobe and k_factor are tuned to (triclip's default)
WORKER = Path(__file__).with_name("haystack_peer_worker.py")
VENV_PACKAGES = ("autofaiss==2.18.0", "faiss-cpu==1.8.0", "numpy<2", "pyarrow<16", "usearch==2.26.6",
                 "packaging==26.4")  # the peers' own: autofaiss 2.18 fails on faiss-cpu 1.15 (OPQMatrix(M=...)),
# pyarrow 16+ needs numpy 2, faiss-cpu 1.8.0 imports packaging without requiring it
USEARCH_BITS = {"b1": 1, "i8": 8, "f16": 16}  # usearch dtype -> bits per dimension
METHODS = ("triclip", "faiss", "autofaiss", "usearch")


@dataclass
class PeersConfig:
    """What ``haystack_peers`` builds and measures."""

    index: str  # the triclip index the haystack is drawn from (benchmarks.haystack BuildConfig.index)
    data: str  # its split folder (train / val / test .jsonl)
    work: str  # where the haystacks, the .npy links and every index are written (reused when present)
    n: int = 1_000_000  # haystack rows
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # haystack seeds
    budgets: list[int] = field(default_factory=lambda: [4, 8, 16, 32])  # bytes per image
    latency_ms: float = 10.0  # the single-query bound given to triclip (--latency-ms) and autofaiss
    methods: list[str] = field(default_factory=lambda: list(METHODS))  # which to run
    venv: str = "/work/scratch/peers/venv-autofaiss"  # the peers' environment (made when missing)
    cores: int = 2  # threads the builds may use


# ---------------------------------------------------------------------------- small pure functions


def percentiles(ms: list[float]) -> tuple[float, float]:
    """p50 and p99 of per-query milliseconds."""
    p50, p99 = np.percentile(np.asarray(ms, float), [50, 99])
    return float(p50), float(p99)


def overlap(found: np.ndarray, truth: np.ndarray, k: int = 10) -> float:
    """Mean share of each query's exact top k (``truth`` (Q, >= k)) among its first k ``found`` (Q, >= k)."""
    return float(np.mean([len(set(f[:k].tolist()) & set(t[:k].tolist())) / k for f, t in zip(found, truth)]))


def usearch_dtype(budget: int, dim: int) -> str | None:
    """The usearch dtype whose vectors take ``budget`` bytes at ``dim`` (D x bits / 8), None when none does."""
    return next((d for d, bits in USEARCH_BITS.items() if dim * bits == 8 * budget), None)


def memory_cap(budget: int, n: int, triclip_ram: int | None = None) -> int:
    """Bytes autofaiss may use at ``budget``: n codes of ``budget`` bytes with an 8-byte id each (an inverted
    list's), or what triclip's index of that budget holds (``ram_bytes``) when more."""
    return max(n * (budget + 8), int(triclip_ram or 0))


def triclip_dir(budgets: list[int]) -> str:
    """The folder of triclip's build of ``budgets`` in a haystack (one build per set of budgets)."""
    return "triclip-b" + "-".join(map(str, budgets))


def nlist_for(n: int) -> int:
    """Plain FAISS's inverted lists: the power of two nearest sqrt(n), at least 16."""
    return max(16, 2 ** int(round(np.log2(np.sqrt(n)))))


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample sd (0 for a single value)."""
    v = np.asarray(values, float)
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def fmt(values: list[float], digits: int = 3) -> str:
    """``mean ± sd`` (the mean alone for one value)."""
    mean, sd = mean_sd(values)
    return f"{mean:.{digits}f}" if len(values) == 1 else f"{mean:.{digits}f} ± {sd:.{digits}f}"


# ---------------------------------------------------------------------------- the haystack of one seed


@dataclass
class Haystack:
    """One seed's haystack on disk and what it is measured against."""

    root: Path  # the haystack folder (benchmarks.haystack build --out)
    npy: Path  # a folder of NNNN.npy links to its shards' image rows, in row order
    queries: Path  # (Q, D) the distinct test captions
    positives: list[set[int]]  # per query: its target rows
    val: Path  # (V, D) the distinct val captions (tuning queries)
    truth: np.ndarray  # (Q, 10) exact float top 10 of the test captions
    val_truth: Path  # (V, 10) same, of the val captions


def haystack_of(cfg: PeersConfig, seed: int, split: hs.Split) -> Haystack:
    """The haystack of ``seed`` under cfg.work (built when missing), its links and exact answers."""
    root = Path(cfg.work) / f"n{cfg.n}-seed{seed}"
    if not (root / "haystack.json").is_file():
        hs.build(hs.BuildConfig(cfg.index, cfg.data, str(root), cfg.n, seed, text=True), split)  # captions: --bytes needs them
    npy = root / "npy"
    if not npy.is_dir():
        npy.mkdir()
        for i, shard in enumerate(sorted((root / "embeddings").glob("shard-*"))):
            os.symlink(shard / "image.npy", npy / f"{i:04d}.npy")
    val = root / "val_queries.npy"
    np.save(val, hs.t2i_set(split, split.rows["val"])[0])
    lines = (root / "queries.jsonl").read_text(encoding="utf-8").splitlines()
    positives = [set(json.loads(line)["targets"]) for line in lines]
    truth_path = root / "truth.npy"
    if not truth_path.is_file():
        test_q = np.load(root / "queries.npy")
        truth = exact_top10(npy, np.concatenate([test_q, np.load(val)]))
        np.save(truth_path, truth[: len(test_q)])
        np.save(root / "val_truth.npy", truth[len(test_q):])
    return Haystack(root, npy, root / "queries.npy", positives, val, np.load(truth_path), root / "val_truth.npy")


def exact_top10(npy: Path, queries: np.ndarray) -> np.ndarray:
    """Exact inner-product top 10 of ``queries`` over every row of the .npy folder, streamed. (Q, 10)"""
    top = hs.TopK(np.ascontiguousarray(queries, np.float32), 10)
    for path in progress(sorted(npy.glob("*.npy")), desc="exact top 10", unit="part"):
        top.add(np.asarray(np.load(path, mmap_mode="r"), np.float32))
    return top.i


# ---------------------------------------------------------------------------- the peers' environment and workers


def ensure_venv(venv: str) -> str:
    """The python of the peers' environment, made (venv + pip install :data:`VENV_PACKAGES`) when missing."""
    python = os.path.join(venv, "bin", "python")
    if os.path.isfile(python):
        return python
    subprocess.run(["python3", "-m", "venv", venv], check=True)
    done = subprocess.run([python, "-m", "pip", "install", "-q", *VENV_PACKAGES], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"pip could not install {' '.join(VENV_PACKAGES)} into {venv}: {last}")
    return python


def run_worker(python: str, step: str, spec: dict) -> dict:
    """Run the worker's ``step`` on ``spec`` (written beside the index) in a process of its own; its JSON line."""
    os.makedirs(spec["dir"], exist_ok=True)
    path = os.path.join(spec["dir"], f"{step}.spec.json")
    with open(path, "w") as fh:
        json.dump(spec, fh)
    env = {**os.environ, "PYTHONPATH": str(WORKER.parent.parent)}
    done = subprocess.run([python, str(WORKER), step, path], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def triclip_build(cfg: PeersConfig, h: Haystack, seed: int) -> dict:
    """``triclip index build`` of every budget over the haystack's shards (reused when built); its manifest."""
    out = h.root / triclip_dir(cfg.budgets)
    if not (out / "built.json").is_file():
        command = [sys.executable, "-m", "triclip", "index", "build", "--embeddings", str(h.root / "embeddings"),
                   "--val-embeddings", str(h.root / "val-embeddings"), "--out", str(out), "--bytes", ",".join(map(str, cfg.budgets)), "--latency-ms", str(cfg.latency_ms),
                   "--seed", str(seed), "--overwrite"]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise UserError(f"triclip index build failed: {(done.stderr.strip().splitlines() or [''])[-1]}")
        (out / "built.json").write_text(json.dumps({"build_s": round(time.perf_counter() - started, 1)}))
    from triclip.index.store import load_contents
    manifest = load_contents(str(out), indexes=False).manifest
    disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {"manifest": manifest, "disk_bytes": disk, **json.loads((out / "built.json").read_text())}


# ---------------------------------------------------------------------------- one seed, every budget


def specs_for(cfg: PeersConfig, h: Haystack, budget: int, dim: int, tri: dict) -> dict:
    """method -> (its worker spec at ``budget``, its bytes per vector), for the methods that can be sized to it."""
    base = {"npy": str(h.npy), "queries": str(h.queries), "cores": cfg.cores}
    entry = tri["manifest"].get("budgets", {}).get(str(budget), {}) if tri else {}
    out = {}
    if "triclip" in cfg.methods and entry:
        out["triclip"] = ({**base, "dir": str(h.root / triclip_dir(cfg.budgets)), "bytes": budget}, budget)
    if "faiss" in cfg.methods:
        nlist = nlist_for(cfg.n)
        out["faiss"] = ({**base, "M": 2 * budget, "nlist": nlist, "train_rows": min(cfg.n, 50 * nlist),
                         "tune_queries": str(h.val), "tune_truth": str(h.val_truth), "target": TARGET}, budget)
    if "autofaiss" in cfg.methods:
        cap = memory_cap(budget, cfg.n, entry.get("ram_bytes"))
        out["autofaiss"] = ({**base, "max_memory": f"{cap}B", "latency_ms": cfg.latency_ms,
                             "memory_available": "6G"}, None)
    dtype = usearch_dtype(budget, dim)
    if "usearch" in cfg.methods and dtype:
        out["usearch"] = ({**base, "dtype": dtype}, budget)
    return out


def run_budget(cfg: PeersConfig, h: Haystack, seed: int, budget: int, tri: dict, python: dict) -> list[dict]:
    """Build (unless built) and measure every method at ``budget`` for one seed's haystack: one record each."""
    dim = int(np.load(h.queries, mmap_mode="r").shape[1])
    records = []
    for method, (spec, code_bytes) in specs_for(cfg, h, budget, dim, tri).items():
        spec = {**spec, "method": method}
        spec.setdefault("dir", str(h.root / f"{method}-b{budget}"))
        spec["ids"] = os.path.join(spec["dir"], "ids.npy")
        built = tri_built(tri, budget) if method == "triclip" else built_once(python[method], spec)
        rec = {"seed": seed, "n": cfg.n, "method": method, "budget": budget, **built}
        if "error" not in built:
            rec.update(run_worker(python[method], "measure", spec))
        if "error" not in rec:
            ids = np.load(spec["ids"])
            rec["recall@10"] = recall_at_k(ids, h.positives)
            rec["of_exact_top10"] = overlap(ids, h.truth)
        rec.setdefault("code_bytes", code_bytes)
        records.append(rec)
        print(json.dumps(rec, default=str), flush=True)
    return records


def built_once(python: str, spec: dict) -> dict:
    """The worker's build record, reused from the index folder when it was built before."""
    path = os.path.join(spec["dir"], "built.json")
    if os.path.isfile(path):
        return json.loads(Path(path).read_text())
    rec = run_worker(python, "build", spec)
    if "error" not in rec:
        Path(path).write_text(json.dumps(rec))
    return rec


def tri_built(tri: dict, budget: int) -> dict:
    """triclip's build record at ``budget``: the code kept, its stages, what it holds in memory."""
    entry = tri["manifest"]["budgets"][str(budget)]
    rescore = entry.get("rescore") or {}
    return {"label": entry.get("label") or entry.get("spec", {}).get("codec"), "code_bytes": budget,
            "ram_bytes": entry.get("ram_bytes"), "shortlist": rescore.get("shortlist"),
            "build_s": tri["build_s"], "disk_bytes": tri["disk_bytes"], "note": entry.get("note", "")}


def run(cfg: PeersConfig) -> list[dict]:
    """Every seed, budget and method of ``cfg``: the records, then the summary rows."""
    bad = [m for m in cfg.methods if m not in METHODS]
    if bad:
        raise UserError(f"unknown methods {bad}; choose from {', '.join(METHODS)}")
    peers = ensure_venv(cfg.venv) if {"autofaiss", "usearch"} & set(cfg.methods) else sys.executable
    python = {"triclip": sys.executable, "faiss": sys.executable, "autofaiss": peers, "usearch": peers}
    split = hs.read_split(cfg.index, cfg.data)
    records = []
    for seed in cfg.seeds:
        h = haystack_of(cfg, seed, split)
        tri = triclip_build(cfg, h, seed) if "triclip" in cfg.methods else {}
        dim = int(np.load(h.queries, mmap_mode="r").shape[1])
        records.append({"seed": seed, "n": cfg.n, "method": "float exact", "budget": 4 * dim, "code_bytes": 4 * dim,
                        "recall@10": recall_at_k(h.truth, h.positives), "of_exact_top10": 1.0})
        for budget in cfg.budgets:
            records += run_budget(cfg, h, seed, budget, tri, python)
    return records


# ---------------------------------------------------------------------------- the table and the command


COLUMNS = [  # (header, record key, scale, digits)
    ("code B/vec", "code_bytes", 1, 0), ("RSS MB", "rss_bytes", 1e-6, 1), ("disk MB", "disk_bytes", 1e-6, 1),
    ("build s", "build_s", 1, 0), ("p50 ms 1t", "p50_ms_1t", 1, 2), ("p99 ms 1t", "p99_ms_1t", 1, 2),
    ("p50 ms 2t", "p50_ms_2t", 1, 2), ("p99 ms 2t", "p99_ms_2t", 1, 2), ("batch q/s 2t", "batch_qps_2t", 1, 0),
    ("t2i R@10", "recall@10", 1, 3), ("of exact top 10", "of_exact_top10", 1, 3),
]


def table(records: list[dict]) -> str:
    """A markdown row per (budget, method): mean ± sd over the seeds of each column; errors as their text."""
    keys = sorted({(r["budget"], r["method"]) for r in records}, key=lambda k: (k[0], METHODS.index(k[1])
                                                                                 if k[1] in METHODS else -1))
    lines = ["| B | method | what | seeds | " + " | ".join(c[0] for c in COLUMNS) + " |",
             "|---:|---|---|---:|" + "---:|" * len(COLUMNS)]
    for budget, method in keys:
        runs = [r for r in records if (r["budget"], r["method"]) == (budget, method)]
        ok = [r for r in runs if "error" not in r]
        what = ", ".join(sorted({str(r.get("label") or r.get("dtype") or "") for r in ok})) or runs[0].get("error", "")
        cells = [cell([r.get(key) for r in ok], scale, digits) for _, key, scale, digits in COLUMNS]
        lines.append(f"| {budget} | {method} | {what} | {len(ok)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cell(values: list, scale: float, digits: int) -> str:
    values = [v * scale for v in values if isinstance(v, (int, float))]
    return fmt(values, digits) if values else "–"


def parse(argv: list[str] | None) -> PeersConfig:
    p = hs.Parser(prog="python -m benchmarks.haystack_peers", description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("index")
    p.add_argument("--data", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--n", type=int, default=PeersConfig.n)
    p.add_argument("--seeds", type=hs.ints, default=[0, 1, 2])
    p.add_argument("--bytes", dest="budgets", type=hs.ints, default=[4, 8, 16, 32])
    p.add_argument("--latency-ms", type=float, default=PeersConfig.latency_ms)
    p.add_argument("--methods", type=lambda t: [m for m in t.split(",") if m], default=list(METHODS))
    p.add_argument("--venv", default=PeersConfig.venv)
    p.add_argument("--cores", type=int, default=PeersConfig.cores)
    return PeersConfig(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    try:
        records = run(parse(argv))
    except (UserError, OSError) as err:
        print(f"python -m benchmarks.haystack_peers: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(table(records))


if __name__ == "__main__":
    main()
