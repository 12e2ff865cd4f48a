"""``triclip index export`` at scale: peak memory against rows and chunk size, and rows per second.

    python benchmarks/bench_milvus.py --work /tmp/bench_milvus --rows 1000000,100000 --chunks 2000,20000

Writes random unit vectors as ``triclip embed`` shards (:func:`write_shards`: the embeddings folder
format of ``triclip.model.shards``), builds an index folder from them with ``triclip index build
--embeddings`` (a Flat index at D, no captions), starts Milvus Lite as its own server process
(``python -m milvus_lite.cmdline server``) and exports the index to it over gRPC
(``--to http://127.0.0.1:PORT``) in a child process per (rows, chunk). Prints, per export: rows,
chunk, seconds, rows per second, the exporter's peak resident memory (``ru_maxrss``), and the
Milvus Lite server's (its ``VmHWM``: Lite keeps loaded collections in memory). The vectors are
memory-mapped by the exporter, so its peak follows the chunk, not the rows.

Exports of the demo's index (its ``--bytes`` budgets) and their recall are in
``benchmarks/bench_milvus_recall.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EXPORTER = (  # the child that exports and then reports its own peak memory
    "import json, resource, sys\n"
    "from triclip.app.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print('peak_rss_mb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def write_shards(out: Path, rows: int, dim: int, shard_size: int = 200_000, seed: int = 0, text: bool = True,
                 dtype: str = "float16", run: str = "random-vectors") -> Path:
    """An embeddings folder of ``rows`` random unit vectors (and one caption vector each with ``text``)
    in ``triclip embed``'s format, without a model: run and fingerprint are names only."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards = max(1, -(-rows // shard_size))
    manifest = {
        "format": "triclip-embeddings/1", "run": run, "fingerprint": f"random-{seed}", "model": None,
        "data": "random", "data_fingerprint": f"random-{rows}-{seed}", "records": rows, "shard_size": shard_size,
        "num_shards": shards, "dim": dim, "dtype": dtype, "text": text, "importance": [1.0] * dim,
        "transform": {"ordering": "importance", "dim": dim, "m": dim, "keep": list(range(dim)), "weights": None,
                      "signs": None},
        "anchor_rows": 0, "skipped": {}, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    for s in range(shards):
        folder = out / f"shard-{s:05d}"
        if (folder / "shard.json").is_file():
            continue
        folder.mkdir(exist_ok=True)
        lo, hi = s * shard_size, min(rows, (s + 1) * shard_size)
        _write_shard(folder, rng, lo, hi, dim, dtype, text)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return out


def _unit(rng, n: int, dim: int, dtype: str) -> np.ndarray:
    x = rng.standard_normal((n, dim), dtype=np.float32)  # (n, D)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(dtype)


def _write_shard(folder: Path, rng, lo: int, hi: int, dim: int, dtype: str, text: bool) -> None:
    np.save(folder / "image.npy", _unit(rng, hi - lo, dim, dtype))
    with open(folder / "meta.jsonl", "w", encoding="utf-8") as fh:
        for i in range(lo, hi):
            fh.write(json.dumps({"id": f"r{i:09d}", "image": f"/random/{i:09d}.png", "captions": [f"random {i}"],
                                 "label": None}) + "\n")
    if text:
        np.save(folder / "text.npy", _unit(rng, hi - lo, dim, dtype))
        np.save(folder / "text_rows.npy", np.stack([np.arange(hi - lo), np.zeros(hi - lo, np.int64)], 1).astype(np.int64))
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(folder.iterdir())}
    info = {"shard": int(folder.name.split("-")[1]), "records": [lo, hi], "count": hi - lo,
            "text_count": hi - lo if text else None, "skipped": {}, "rank": 0, "seconds": 0.0, "files": files}
    (folder / "shard.json").write_text(json.dumps(info, indent=1) + "\n")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def triclip(*args, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run([sys.executable, "-m", "triclip", *map(str, args)], env=env, text=True, capture_output=True,
                          **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lite_server(data: Path) -> tuple[subprocess.Popen, str]:
    """Milvus Lite as its own process on a free port of 127.0.0.1; returns it and its URI once it answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "milvus_lite.cmdline", "server", "--data-dir", str(data),
                             "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("Milvus Lite's server did not start")


def peak_of(pid: int) -> float:
    """A running process's peak resident memory (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def export_once(index: Path, work: Path, chunk: int) -> dict:
    """Export ``index`` to a fresh Milvus Lite server; returns the timings and peaks."""
    data = work / f"lite-{index.name}-{chunk}.db"
    subprocess.run(["rm", "-rf", str(data)], check=True)
    server, uri = lite_server(data)
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", EXPORTER, "index", "export", "--index", str(index), "--to", uri,
                               "--chunk", str(chunk), "--no-text", "--timeout", "60"], env=env, text=True,
                              capture_output=True)  # fmt: skip
        seconds = time.perf_counter() - started
        if proc.returncode != 0:
            raise SystemExit(f"export failed: {proc.stderr[-2000:]}")
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        exporter = float(proc.stderr.rsplit("peak_rss_mb", 1)[1].split()[0])
        return {"rows": summary["count"], "chunk": chunk, "seconds": round(seconds, 1),
                "rows_per_s": round(summary["count"] / seconds), "exporter_peak_mb": round(exporter),
                "lite_server_peak_mb": round(peak_of(server.pid)), "index_type": summary["index_type"]}
    finally:
        server.terminate()
        server.wait(timeout=60)
        subprocess.run(["rm", "-rf", str(data)], check=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True, help="scratch folder (shards, indexes, Milvus Lite data)")
    p.add_argument("--rows", default="1000000,100000", help="index sizes, comma-separated")
    p.add_argument("--chunks", default="2000", help="export chunk sizes, comma-separated (each size: the first rows only)")
    p.add_argument("--dim", type=int, default=256, help="D of the random vectors (the demo's)")
    args = p.parse_args(argv)
    work = Path(args.work)
    rows_list = [int(x) for x in args.rows.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]
    for rows in rows_list:
        index = work / f"index-{rows}"
        if not (index / "CURRENT").is_file():
            emb = write_shards(work / f"emb-{rows}", rows, args.dim, text=False)
            built = triclip("index", "build", "--embeddings", emb, "--out", index, "--factory", "Flat", "--no-text-index")
            if built.returncode != 0:
                raise SystemExit(f"index build failed: {built.stderr[-2000:]}")
        for chunk in chunks if rows == min(rows_list) else chunks[:1]:
            print(json.dumps(export_once(index, work, chunk)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
