"""What an index version records about itself: the manifest, the meta rows and the curves.

Torch-free (the app and ``search --text`` read it). One manifest for every build, whatever
its source (``--run --data`` embedded here, or ``--embeddings`` shards):

    format, run, fingerprint, weights, model, ordering, dim (D), dims (ascending, last = D),
    transform (CompactTransform.to_dict at m = D), importance (w in index order),
    recall ({str(m): t2i recall@10 or None}), recall_source, factories / text_factories
    ({str(m): factory}), factory_option, metric, count, text_count (None without a caption
    index), sources, skipped, embeddings (the shards' folder, or None), memory_budget,
    on_disk_option, nprobe / text_nprobe ({str(m): nprobe} of IVF indexes), nprobe_tuning,
    budgets ({str(B): {"spec" (triclip.codecs.CodecSpec.to_json), "file" (its codes: ``image.b{B}.codec``, or a
    smaller budget's file when it keeps that budget's very code: one file per code), "recall" (measured, of the
    stored codes), "split", "index_bytes", "bytes_per_vector", "ram_bytes", "rescore" (None, or the float
    re-rank: "with", "shortlist", "shortlist_how", "disk_bytes_per_query"), "code_recall", "keeps",
    "latency" ({"ms", "how"}), "latency_bound_ms", "float_latency", "note", "full_recall" (the float vectors'
    own recall on the same evaluation), "ranked_by" ("recall", or at N >= 100,000 "fidelity": the share of the
    exact float top 10 held on the tuning sample, "fidelity" the kept code's), "text" (the caption codes, the
    same keys, recall = i2t; absent without captions)}}: ``--bytes``, ``triclip.index.budgets``; an inverted
    lists code's nlist and nprobe are in its spec's params),
    created, updated (and on_disk and files, written by ``triclip.index.store``: files maps each file of the
    version to its size and sampled sha256, and the codes to their codec, count and width;
    ``triclip.index.filecheck``)

Each image row of ``meta.jsonl`` records its file's identity (``"file"``: device, inode,
size, mtime_ns; :func:`file_identity`), so the app serves only the files that were indexed.
Each version may hold ``curves.json`` (:func:`attach_curves`): t2i recall@10 against m per
ordering; the manifest's ``recall`` per m is the index ordering's curve.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from triclip.index.store import FORMAT, TMP_PREFIX, IndexContents
from triclip.index.vectors import SQ8_ROTATION_SEED, SQ8Rows, stored_name
from triclip.core.errors import UserError
from triclip.core.io import write_errors

CURVES = "curves.json"  # in each version: recall@10 against m per ordering (written with the version)


@dataclass
class Origin:
    """Where a build's vectors came from: what the manifest says about the run and the source."""

    run: str  # the run folder (absolute)
    fingerprint: str  # of the run's weights that embedded the vectors
    model: str | None  # the run's model name
    transform: dict  # CompactTransform.to_dict at m = D
    importance: list[float]  # w in index order
    source: dict  # one entry of the manifest's "sources"
    skipped: Counter = field(default_factory=Counter)  # records left out, by reason
    weights: str = "best"  # which of the run's weights (triclip.model.run)
    embeddings: str | None = None  # the shards' folder (index build --embeddings)


def make_manifest(cfg, contents: IndexContents, origin: Origin, build: dict, previous: dict | None = None) -> dict:
    """The manifest of a new version (``previous``: the version an ``--add`` extends).

    ``build``: what the builder decided (factories, text_factories, nprobe, text_nprobe,
    nprobe_tuning, memory_budget); an ``--add`` keeps the previous version's.
    """
    from triclip.model.run import METRICS  # torch: manifests are made at build time only

    previous = previous or {}
    dims = contents.dims
    kept = {k: previous.get(k, v) for k, v in build.items()}
    return {
        "format": FORMAT,
        "run": previous.get("run", origin.run),
        "fingerprint": origin.fingerprint,
        "weights": previous.get("weights", origin.weights),
        "model": origin.model,
        "ordering": origin.transform["ordering"],
        "dim": int(origin.transform["dim"]),
        "dims": dims,
        "transform": origin.transform,
        "importance": [round(float(v), 6) for v in origin.importance],
        "recall": run_recall(origin.run, origin.transform["ordering"], dims, origin.weights),
        "recall_source": os.path.join(origin.run, METRICS),
        **kept,
        "factory_option": previous.get("factory_option", cfg.factory),
        "on_disk_option": previous.get("on_disk_option", cfg.on_disk),
        "metric": "inner_product",
        "count": len(contents.meta),
        "text_count": None if contents.text_vectors is None else int(len(contents.text_vectors)),
        "vectors_dtype": stored_name(contents.vectors),  # index build --vectors
        **_sq8_entry(contents),
        "sources": previous.get("sources", []) + [origin.source],
        "skipped": dict(Counter(previous.get("skipped", {})) + Counter(dict(origin.skipped))),
        "embeddings": previous.get("embeddings", origin.embeddings),
        "created": previous.get("created", time.strftime("%Y-%m-%dT%H:%M:%S")),
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _sq8_entry(contents: IndexContents) -> dict:
    """``{"vectors_sq8": {"image": ranges, "text": ranges, "rotation_seed": seed}}`` for vectors kept as sq8 codes
    (cut after the rotation of that seed, ``vectors.rotation``), else {}."""
    if not isinstance(contents.vectors, SQ8Rows):
        return {}
    kinds = {"image": contents.vectors, "text": contents.text_vectors}
    ranges = {k: [float(v) for v in rows.params] for k, rows in kinds.items() if rows is not None}
    return {"vectors_sq8": {**ranges, "rotation_seed": SQ8_ROTATION_SEED}}


def summary(manifest: dict, index: str, started: float, **extra) -> dict:
    """The JSON summary ``index build`` prints."""
    keys = ("count", "text_count", "dims", "dim", "ordering", "factories", "nprobe", "on_disk", "recall", "fingerprint",
            "skipped", "embeddings")
    out = {"index": os.path.abspath(index), **{k: manifest.get(k) for k in keys}}
    out["on_disk"] = out["on_disk"] or {}
    if manifest.get("budgets"):
        out["budgets"] = {b: _budget_summary(e) | ({"text": _budget_summary(e["text"])} if e.get("text") else {})
                          for b, e in manifest["budgets"].items()}
    return {**out, **extra, "seconds": round(time.perf_counter() - started, 2)}


def _budget_summary(entry: dict) -> dict:
    """One side's codes of a budget, as the summary shows them: recall, sizes, the code, its latency and stages."""
    keys = ("recall", "index_bytes", "bytes_per_vector", "ram_bytes", "latency", "rescore", "note", "sized_for_n", "at_n",
            "finalists_at_n", "latency_bound_ms", "full_recall", "ranked_by")
    return {k: entry[k] for k in keys if k in entry} | {"code": entry["spec"]}


# ---------------------------------------------------------------------------- meta rows


def file_identity(path: str) -> list[int] | None:
    """``[device, inode, size, mtime_ns]`` of a regular file, not following a link; None for anything else.

    Recorded per image row (meta ``"file"``) at build time; the app serves a row's file only
    while an open of it without following links finds this same identity.
    """
    try:
        st = os.lstat(path)
    except (OSError, ValueError):
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns] if stat.S_ISREG(st.st_mode) else None


def unique_ids(rows: list[dict], existing: list[dict] = ()) -> list[dict]:
    """``rows`` with ids unique across ``existing`` + ``rows`` (``key#2``, ``key#3``...), changed in place."""
    taken = {row["id"] for row in existing}
    for row in rows:
        rid, base, n = row["id"], row["id"], 1
        while rid in taken:
            n += 1
            rid = f"{base}#{n}"
        taken.add(rid)
        row["id"] = rid
    return rows


def text_rows(meta: list[dict], offset: int = 0) -> np.ndarray:
    """(T, 2) image row and caption number of every caption of ``meta``, in order."""
    rows = [(offset + i, c) for i, row in enumerate(meta) for c in range(len(row["captions"]))]
    return np.array(rows, dtype=np.int64).reshape(-1, 2)


# ---------------------------------------------------------------------------- curves


def curve_dims(dims: list[int], dim: int) -> list[int]:
    """The m's of the stored curves: the index's m's and every power of two from 2 up to D."""
    return sorted(set(dims) | {2**i for i in range(1, dim.bit_length()) if 2**i <= dim} | {dim})


def read_curves(index_dir, version: str | None, records: dict | None = None) -> dict | None:
    """The curves file of a version of an index folder, or None (none recorded, unreadable, or not the file
    ``records``, the version's manifest ``files``, vouches for: ``triclip.index.filecheck``)."""
    from triclip.index import filecheck

    if not version:
        return None
    path = Path(index_dir) / version / CURVES
    try:
        if records is not None and filecheck.check_file(path, path.parent, records) is not None:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, UserError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("curves"), dict) else None


def attach_curves(out, contents: IndexContents, curves: dict | None) -> None:
    """Put the curves file into the version being written (moved in by ``write_version``: atomic with it)
    and take the manifest's recall per m from it. Call while holding the writer lock."""
    if curves is None:
        return
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + "curves-", dir=out)  # removed by recovery if the write dies
    with write_errors(out), os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(curves, indent=1) + "\n")
    contents.files[CURVES] = Path(tmp)
    own = curves["curves"].get(curves["ordering"], {})
    if own:  # curves of a build by --bytes alone may hold only the codes' frontier
        contents.manifest["recall"] = {str(m): own.get(str(m)) for m in contents.dims}
        contents.manifest["recall_source"] = f"{CURVES} ({curves['split']} data {curves['data']})"


def run_recall(run: str, ordering: str, dims: list[int], weights: str = "best") -> dict[str, float | None]:
    """t2i recall@10 per m from the run's evaluation of the indexed weights (None where absent):
    the kept best epoch's for ``weights="best"`` (when the run keeps one), else the last one
    with a compact curve.

    The curve of the index's ordering gives m < D; at m = D the ``importance`` ordering's
    score is the model's own score, i.e. the evaluation's ``t2i_r10``. A missing or damaged
    ``metrics.jsonl`` gives None everywhere (the recall is informative, not needed to search).
    """
    from triclip.model.run import METRICS

    record = None
    try:
        lines = (Path(run) / METRICS).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    epoch = _best_epoch(run) if weights == "best" and lines else None
    for line in reversed(lines):
        try:
            candidate = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(candidate, dict) or not isinstance(candidate.get("compact"), dict):
            continue
        if epoch is None or candidate.get("epoch") == epoch:
            record = candidate
            break
    out: dict[str, float | None] = {str(m): None for m in dims}
    if record is None:
        return out
    curve = record["compact"].get(ordering) or {}
    for m in dims:
        value = curve.get(str(m)) if isinstance(curve, dict) else None
        if value is None and m == dims[-1] and ordering == "importance":
            value = record.get("t2i_r10")
        out[str(m)] = float(value) if isinstance(value, (int, float)) else None
    return out


def _best_epoch(run: str) -> int | None:
    """The epoch ``RUN/best`` holds, or None (no best kept, or its record unreadable)."""
    from triclip.model.run import best_info  # torch: only at build time, with a metrics file to read

    try:
        info = best_info(run)
    except UserError:
        return None
    return None if info is None else info["epoch"]
