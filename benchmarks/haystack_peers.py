"""Peers in the haystack: triclip's chosen codes against autofaiss, usearch and plain FAISS, at equal bytes.

    python -m benchmarks.haystack_peers INDEX --data DATA --work DIR [--n 1000000] [--seeds 0,1,2]
        [--bytes 4,8,16,32] [--latency-ms 10] [--methods triclip,faiss,autofaiss,usearch] [--venv DIR] [--factory F]
        [--no-text-codes] [--equal-memory] [--vectors auto|float32|float16|sq8]

Per seed, the haystack of ``benchmarks.haystack`` (the real test captions and images among N - T distractors) is
written once under DIR, with a folder of .npy links to its shards that the peers read, and the exact float top 10
of the test captions and of the val captions (the peers' tuning queries). Per byte budget B:

- **triclip**: ``triclip index build --embeddings H/embeddings --val-embeddings H/val-embeddings --bytes B,...
  --latency-ms L [--factory F]`` (one build for every budget; its progress lines kept in H/triclip-b....log): the
  codes are chosen on the val split, like the peers' tuning. ``--equal-memory``: one build per budget, with
  ``--memory-budget`` = :func:`memory_cap` (autofaiss's): its float vectors then exceed it, so the choice charges
  a re-rank its cold reads from disk. ``--vectors``: the precision of the rows it re-ranks with (a build of its own);
- **faiss**: ``IVF{nlist},PQ{2B}x4fs`` in ``IndexRefineFlat`` (the float rows in memory), nprobe and k_factor
  tuned on the val captions to :data:`TARGET` of their exact top 10, FAISS of the main environment;
- **autofaiss**: ``build_index`` with ``max_index_memory_usage`` = :func:`memory_cap` and
  ``max_index_query_time_ms`` = L, in an environment of its own (:data:`VENV_PACKAGES`, made when missing);
- **usearch** (same environment): HNSW of ``dtype`` b1 / i8 / f16 where D x bits / 8 = B.

Each peer index is built by ``scripts/peer_worker.py`` in a process of its own and every index is measured in a
fresh one, warm and cold (its files evicted from the page cache before each query; triclip also cold for the row
ids alone, as the peers answer, without reading the hits' meta rows). Prints a JSON line per (seed, method, budget), then a table of mean ± sd over seeds.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks import haystack as hs
from triclip.core.errors import UserError
from triclip.core.progress import progress
from triclip.index.budgets import overlap, recall_at_k

TARGET = 0.95  # share of the exact float top 10 that plain FAISS's nprobe and k_factor are tuned to (triclip's default)
WORKER = Path(__file__).parent.parent / "scripts" / "peer_worker.py"
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
    text_codes: bool = True  # caption distractors in the haystack, and triclip builds their codes (--bytes's
    # image->text side; no row reads them)
    methods: list[str] = field(default_factory=lambda: list(METHODS))  # which to run
    venv: str = "/work/scratch/peers/venv-autofaiss"  # the peers' environment (made when missing)
    cores: int = 2  # threads the peers' builds may use
    factory: str = "auto"  # triclip's float index at D (index build --factory): auto (HNSW32 from 100k rows) or e.g.
    # Flat (built at once; search --bytes reads the codes and the float vectors file, not this index)
    equal_memory: bool = False  # triclip built per budget within autofaiss's memory (--memory-budget memory_cap)
    vectors: str = "auto"  # triclip's full-D rows for its re-ranks (index build --vectors): auto, float32, float16, sq8


def usearch_dtype(budget: int, dim: int) -> str | None:
    """The usearch dtype whose vectors take ``budget`` bytes at ``dim`` (D x bits / 8), None when none does."""
    return next((d for d, bits in USEARCH_BITS.items() if dim * bits == 8 * budget), None)


def memory_cap(budget: int, n: int, triclip_ram: int | None = None) -> int:
    """Bytes autofaiss may use at ``budget``: n codes of ``budget`` bytes with an 8-byte id each (an inverted
    list's), or what triclip's index of that budget holds (``ram_bytes``) when more."""
    return max(n * (budget + 8), int(triclip_ram or 0))


def nlist_for(n: int) -> int:
    """Plain FAISS's inverted lists: the power of two nearest sqrt(n), at least 16."""
    return max(16, 2 ** int(round(np.log2(np.sqrt(n)))))


def triclip_dir(budgets: list[int], factory: str = "auto", memory: int | None = None,
                latency_ms: float = PeersConfig.latency_ms, vectors: str = "auto") -> str:
    """The folder of triclip's build of ``budgets`` in a haystack (one build per set of budgets, factory, memory
    budget, latency bound and precision of the rows it re-ranks with)."""
    return ("triclip-b" + "-".join(map(str, budgets)) + ("" if factory == "auto" else "-" + factory.lower())
            + ("" if memory is None else f"-mem{memory}") + bound_suffix(latency_ms)
            + ("" if vectors == "auto" else f"-{vectors}"))


def bound_suffix(latency_ms: float) -> str:
    """What a folder built for a latency bound other than the default adds to its name."""
    return "" if latency_ms == PeersConfig.latency_ms else f"-{latency_ms:g}ms"


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
    """The haystack of ``seed`` under cfg.work (built when missing, its rows drawn again when deleted), its links
    and exact answers."""
    root = Path(cfg.work) / f"n{cfg.n}-seed{seed}"
    if not (root / "haystack.json").is_file():
        hs.build(hs.BuildConfig(cfg.index, cfg.data, str(root), cfg.n, seed, text=cfg.text_codes), split)
    elif not (root / "embeddings" / "manifest.json").is_file():  # its rows deleted for the disk: drawn again
        rows = root.parent / f".{root.name}.rows"  # (they depend on the seed only), the rest of the folder kept
        shutil.rmtree(rows, ignore_errors=True)
        hs.build(hs.BuildConfig(cfg.index, cfg.data, str(rows), cfg.n, seed, text=cfg.text_codes), split)
        shutil.rmtree(root / "embeddings", ignore_errors=True)
        os.replace(rows / "embeddings", root / "embeddings")
        shutil.rmtree(rows)
    npy, val = root / "npy", root / "val_queries.npy"
    npy.mkdir(exist_ok=True)
    for i, shard in enumerate(sorted((root / "embeddings").glob("shard-*"))):
        if not (npy / f"{i:04d}.npy").is_symlink():
            os.symlink(shard / "image.npy", npy / f"{i:04d}.npy")
    np.save(val, hs.t2i_set(split, split.rows["val"])[0])
    if not (root / "truth.npy").is_file():
        test_q = np.load(root / "queries.npy")
        top = hs.TopK(np.concatenate([test_q, np.load(val)]).astype(np.float32), 10)
        for path in progress(sorted(npy.glob("*.npy")), desc="exact top 10", unit="part"):
            top.add(np.asarray(np.load(path, mmap_mode="r"), np.float32))
        np.save(root / "truth.npy", top.i[: len(test_q)])
        np.save(root / "val_truth.npy", top.i[len(test_q):])
    lines = (root / "queries.jsonl").read_text(encoding="utf-8").splitlines()
    positives = [set(json.loads(line)["targets"]) for line in lines]
    truth = np.load(root / "truth.npy")
    return Haystack(root, npy, root / "queries.npy", positives, val, truth, root / "val_truth.npy")


# ---------------------------------------------------------------------------- builds, each in a process of its own


def ensure_venv(venv: str) -> str:
    """The python of the peers' environment, made (venv + pip install :data:`VENV_PACKAGES`) when missing."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.isfile(python):
        subprocess.run(["python3", "-m", "venv", venv], check=True)
        done = subprocess.run([python, "-m", "pip", "install", "-q", *VENV_PACKAGES], capture_output=True, text=True)
        if done.returncode != 0:
            raise UserError(f"pip could not install {' '.join(VENV_PACKAGES)} into {venv}: {last_line(done.stderr)}")
    return python


def last_line(text: str) -> str:
    return (text.strip().splitlines() or ["no output"])[-1][:300]


def run_worker(python: str, step: str, spec: dict) -> dict:
    """The worker's ``step`` on ``spec`` (written into spec["dir"]) in a process of its own: its JSON line."""
    os.makedirs(spec["dir"], exist_ok=True)
    path = os.path.join(spec["dir"], f"{step}.spec.json")
    Path(path).write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(WORKER.parent.parent)}
    done = subprocess.run([python, str(WORKER), step, path], capture_output=True, text=True, env=env)
    return json.loads(last_line(done.stdout)) if done.returncode == 0 else {"error": last_line(done.stderr)}


def built_once(python: str, spec: dict) -> dict:
    """The worker's build record, reused from the index folder when it was built before."""
    path = Path(spec["dir"]) / "built.json"
    if not path.is_file():
        rec = run_worker(python, "build", spec)
        if "error" in rec:
            return rec
        path.write_text(json.dumps(rec))
    return json.loads(path.read_text())


def triclip_builds(cfg: PeersConfig, h: Haystack, seed: int) -> dict:
    """budget -> triclip's build record: one build of every budget, or with ``equal_memory`` one per budget
    within :func:`memory_cap`."""
    if not cfg.equal_memory:
        return triclip_build(cfg, h, seed, cfg.budgets)
    return {b: rec for budget in cfg.budgets
            for b, rec in triclip_build(cfg, h, seed, [budget], memory_cap(budget, cfg.n)).items()}


def triclip_build(cfg: PeersConfig, h: Haystack, seed: int, budgets: list[int], memory: int | None = None) -> dict:
    """``triclip index build`` of ``budgets`` over the haystack's shards (reused when built), within ``memory``
    bytes (None: triclip's default); budget -> its record from the manifest."""
    out = h.root / triclip_dir(budgets, cfg.factory, memory, cfg.latency_ms, cfg.vectors)
    if not (out / "built.json").is_file():
        command = [sys.executable, "-m", "triclip", "index", "build", "--embeddings", str(h.root / "embeddings"),
                   "--val-embeddings", str(h.root / "val-embeddings"), "--out", str(out),
                   "--bytes", ",".join(map(str, budgets)), "--latency-ms", str(cfg.latency_ms),
                   "--seed", str(seed), "--factory", cfg.factory, "--vectors", cfg.vectors, "--overwrite",
                   *([] if cfg.text_codes else ["--no-text-index"]),
                   *([] if memory is None else ["--memory-budget", str(memory)])]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        (h.root / f"{out.name}.log").write_text(done.stderr)  # its progress lines: where the build's time went
        if done.returncode != 0:
            raise UserError(f"triclip index build failed: {last_line(done.stderr)}")
        (out / "built.json").write_text(json.dumps({"build_s": round(time.perf_counter() - started, 1)}))
    from triclip.index.store import load_contents
    manifest = load_contents(str(out), indexes=False).manifest
    budgets, rows = manifest.get("budgets", {}), manifest.get("vectors_dtype", "float32")
    common = {**json.loads((out / "built.json").read_text()),
              "disk_bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file())}
    from triclip.codecs import CodecSpec
    return {int(b): {"label": (e.get("label") or CodecSpec.from_json(e["spec"]).label())
                     + ("" if rows == "float32" else f", {rows} rows"), "code_bytes": int(b),
                     "ram_bytes": e.get("ram_bytes"), "shortlist": (e.get("rescore") or {}).get("shortlist"),
                     "reads": (e.get("rescore") or {}).get("reads"), "note": e.get("note", ""), "dir": str(out),
                     **common} for b, e in budgets.items()}


# ---------------------------------------------------------------------------- one seed, every budget


def specs_for(cfg: PeersConfig, h: Haystack, budget: int, dim: int, tri: dict) -> dict:
    """method -> (its spec at ``budget``, its build record or None to build), for the methods sized to it."""
    base = {"npy": str(h.npy), "queries": str(h.queries), "cores": cfg.cores}
    out, dtype, nlist = {}, usearch_dtype(budget, dim), nlist_for(cfg.n)
    if "triclip" in cfg.methods and budget in tri:
        out["triclip"] = ({**base, "dir": tri[budget]["dir"], "bytes": budget}, tri[budget])
    if "faiss" in cfg.methods:
        out["faiss"] = ({**base, "M": 2 * budget, "nlist": nlist, "train_rows": min(cfg.n, 50 * nlist),
                         "tune_queries": str(h.val), "tune_truth": str(h.val_truth), "target": TARGET}, None)
    if "autofaiss" in cfg.methods:
        cap = memory_cap(budget, cfg.n, tri.get(budget, {}).get("ram_bytes"))
        out["autofaiss"] = ({**base, "max_memory": f"{cap}B", "latency_ms": cfg.latency_ms,
                             "memory_available": "6G"}, None)
    if "usearch" in cfg.methods and dtype:
        out["usearch"] = ({**base, "dtype": dtype, "code_bytes": budget}, None)
    return out


def run_budget(cfg: PeersConfig, h: Haystack, seed: int, budget: int, tri: dict, python: dict) -> list[dict]:
    """Build (unless built) and measure every method at ``budget`` for one seed's haystack: one record each."""
    records, dim = [], int(np.load(h.queries, mmap_mode="r").shape[1])
    for method, (spec, built) in specs_for(cfg, h, budget, dim, tri).items():
        bound = bound_suffix(cfg.latency_ms) if method in ("triclip", "autofaiss") else ""  # built to the bound
        bound += f"-{cfg.vectors}" if method == "triclip" and cfg.vectors != "auto" else ""
        spec = {"dir": str(h.root / f"{method}-b{budget}{bound}"), **spec, "method": method}
        spec["ids"], spec["times"] = os.path.join(spec["dir"], "ids.npy"), os.path.join(spec["dir"], "query_ms.npz")
        rec = {"seed": seed, "n": cfg.n, "method": method, "budget": budget,
               "code_bytes": spec.get("code_bytes", budget), **(built or built_once(python[method], spec))}
        if "error" not in rec:
            rec.update(run_worker(python[method], "measure", spec))
        if "error" not in rec:
            ids = np.load(spec["ids"])
            rec.update({"recall@10": recall_at_k(ids, h.positives), "of_exact_top10": overlap(ids, h.truth)})
        records.append(rec)
        print(json.dumps(rec, default=str), flush=True)
    return records


def run(cfg: PeersConfig) -> list[dict]:
    """Every seed, budget and method of ``cfg``: one record each, and the exact float search's per seed."""
    if set(cfg.methods) - set(METHODS):
        raise UserError(f"unknown methods {sorted(set(cfg.methods) - set(METHODS))}; choose from {', '.join(METHODS)}")
    peers = ensure_venv(cfg.venv) if {"autofaiss", "usearch"} & set(cfg.methods) else sys.executable
    python = {"triclip": sys.executable, "faiss": sys.executable, "autofaiss": peers, "usearch": peers}
    split, records = hs.read_split(cfg.index, cfg.data), []
    for seed in cfg.seeds:
        h = haystack_of(cfg, seed, split)
        tri = triclip_builds(cfg, h, seed) if "triclip" in cfg.methods else {}
        full = 4 * int(np.load(h.queries, mmap_mode="r").shape[1])
        records.append({"seed": seed, "n": cfg.n, "method": "float exact", "budget": full, "code_bytes": full,
                        "recall@10": recall_at_k(h.truth, h.positives), "of_exact_top10": 1.0})
        for budget in cfg.budgets:
            records += run_budget(cfg, h, seed, budget, tri, python)
    return records


# ---------------------------------------------------------------------------- the table and the command


COLUMNS = [  # (header, record key, scale, digits)
    ("code B/vec", "code_bytes", 1, 0), ("RSS MB", "rss_bytes", 1e-6, 1), ("RSS after MB", "rss_after_bytes", 1e-6, 1),
    ("disk MB", "disk_bytes", 1e-6, 1),
    ("build s", "build_s", 1, 0), ("p50 ms 1t", "p50_ms_1t", 1, 2), ("p99 ms 1t", "p99_ms_1t", 1, 2),
    ("p50 ms 2t", "p50_ms_2t", 1, 2), ("p99 ms 2t", "p99_ms_2t", 1, 2), ("p50 ms cold", "p50_ms_cold", 1, 2),
    ("p99 ms cold", "p99_ms_cold", 1, 2), ("p50 ms cold, ids only", "p50_ms_cold_rows", 1, 2),
    ("batch q/s 2t", "batch_qps_2t", 1, 0),
    ("t2i R@10", "recall@10", 1, 3), ("of exact top 10", "of_exact_top10", 1, 3),
]


def cell(values: list, scale: float, digits: int) -> str:
    """``mean ± sd`` of the numbers among ``values`` times ``scale`` (the mean alone for one, – for none)."""
    v = [x * scale for x in values if isinstance(x, (int, float))]
    sd = f" ± {statistics.stdev(v):.{digits}f}" if len(v) > 1 else ""
    return f"{statistics.mean(v):.{digits}f}{sd}" if v else "–"


def table(records: list[dict]) -> str:
    """A markdown row per (budget, method), mean ± sd over the seeds of each column; a failed method's error."""
    order = {m: i for i, m in enumerate(METHODS)}
    lines = ["| B | method | what | seeds | " + " | ".join(c[0] for c in COLUMNS) + " |",
             "|---:|---|---|---:|" + "---:|" * len(COLUMNS)]
    keys = sorted({(r["budget"], r["method"]) for r in records}, key=lambda k: (k[0], order.get(k[1], -1)))
    for budget, method in keys:
        runs = [r for r in records if (r["budget"], r["method"]) == (budget, method)]
        ok = [r for r in runs if "error" not in r]
        what = ", ".join(sorted({str(r.get("label") or r.get("dtype") or "") for r in ok})) or runs[0].get("error", "")
        cells = [cell([r.get(key) for r in ok], scale, digits) for _, key, scale, digits in COLUMNS]
        lines.append(f"| {budget} | {method} | {what} | {len(ok)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    p.add_argument("--factory", default=PeersConfig.factory)
    p.add_argument("--no-text-codes", dest="text_codes", action="store_false",
                   help="a haystack without caption distractors and triclip's image codes only (the rows measure "
                        "text->image search)")
    p.add_argument("--equal-memory", action="store_true",
                   help="triclip built per budget with --memory-budget = autofaiss's memory cap")
    p.add_argument("--vectors", choices=("auto", "float32", "float16", "sq8"), default=PeersConfig.vectors,
                   help="triclip's full-D rows for its re-ranks (index build --vectors)")
    return PeersConfig(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    try:
        print(table(run(parse(argv))))
    except (UserError, OSError) as err:
        print(f"python -m benchmarks.haystack_peers: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
