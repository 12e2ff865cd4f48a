"""``triclip index build``: embed a data source once, index it at several m in one folder.

Steps: load the run and the data; embed every image (and every caption, for
image->text search) in batches, reusing the locked-tower cache; map the embeddings
through the compact transform of ``retrieval.compact`` at m = D (``importance``
ordering by default: ``sqrt(w) * z`` in importance order, re-normalised, with the
sign fix anchored on the first indexed images), so that the top-m embedding of any
m is the re-normalised prefix of the stored vector; build one FAISS index per m
(``index.faiss_index``; ``auto`` picks Flat / HNSW32 / IVF-PQ by size and memory);
write a new version of the folder under the writer lock (``index.store``).

``add=True`` appends the records of ``data`` that are not indexed yet (same image
location and captions) with the run, transform, dims and factories recorded in the
manifest; a different run, dims or factory is refused. The embedding runs without
the lock; only the append and the write hold it, against the version that is live
then, so concurrent ``--add`` writers all land.

The manifest records what a query needs to be embedded the same way, and what the
app shows:

    format, run, fingerprint, model, ordering, dim (D), dims (ascending, last = D),
    transform (CompactTransform.to_dict at m = D), importance (w in index order),
    recall ({str(m): t2i recall@10 or None}, from the run's last evaluation), recall_source,
    factories / text_factories ({str(m): factory}), factory_option, metric, count,
    text_count (None without a caption index), sources, skipped, created, updated

Each image row of ``meta.jsonl`` records its file's identity (``"file"``: device, inode,
size, mtime_ns; :func:`file_identity`), so the app serves only the files that were indexed.
Each version also holds ``curves.json`` (:func:`_curves`): t2i recall@10 against m for the
run's own ordering, first-m, random and PCA, on ``--val-data`` (else the indexed data);
the manifest's ``recall`` per m is the index ordering's curve.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from index import faiss_index as fi
from index.store import (
    FORMAT,
    TMP_PREFIX,
    IndexContents,
    current_version,
    image_index_name,
    is_index_dir,
    load_contents,
    write_version,
    writer_lock,
)
from retrieval.cache import locked_tower_outputs
from retrieval.compact import ORDERINGS, CompactTransform, compact_curve, make_transform
from retrieval.data import DataConfig, PairSet, load_pairs
from retrieval.data.split import load_collection, split_val
from retrieval.embed import embed_pairs, pick_device
from retrieval.errors import UserError
from retrieval.io import claim_output_dir
from index.config import IndexBuildConfig  # noqa: F401 (re-exported: callers import it from here)
from retrieval.run import METRICS, best_info, load_run, run_fingerprint

CURVES = "curves.json"  # in each version: recall@10 against m per ordering (written with the version)
CURVE_MAX_IMAGES = 5000  # curves on the indexed data (no --val-data) use at most its first this many images


def build_index(cfg: IndexBuildConfig) -> dict:
    """Build (or extend) the index folder ``cfg.out``; returns a JSON-able summary."""
    if cfg.embeddings is not None:
        from index.from_embeddings import build_from_embeddings, from_build_config

        return build_from_embeddings(from_build_config(cfg))
    started = time.perf_counter()
    if not cfg.run or not cfg.data or not cfg.out:
        raise UserError("index build needs --run, --data and --out (or --embeddings and --out)")
    if cfg.memory_budget is not None or cfg.on_disk != "auto":
        raise UserError("--memory-budget and --on-disk apply to builds from --embeddings only")
    dims = _validate(cfg)
    cfg = replace(cfg, val_data=cfg.val_data or split_val(cfg.data))  # a split folder's curves: on its validation split
    base = load_contents(cfg.out, indexes=False) if cfg.add else None  # a snapshot: transform, dims, seen records
    if base is not None and base.manifest.get("on_disk"):
        raise UserError(f"{cfg.out} keeps IVF lists on disk: --add is not supported; rebuild it with --embeddings")
    pairs = load_collection(cfg.data, cfg.data_config or DataConfig())  # a split folder: all its splits; bad data fails before the model loads
    device = pick_device(cfg.device)
    model, run_config = load_run(cfg.run, device, which=cfg.weights)
    fingerprint = run_fingerprint(cfg.run, which=cfg.weights)
    if base is not None:
        _check_same_run(base.manifest, cfg, dims, fingerprint)
    else:
        _check_new_index(cfg, dims, model.embed_dim, len(pairs.records))  # before the (long) embedding
    todo, already = _new_records(pairs, base.meta if base is not None else [])
    if not todo.records:
        return _summary(cfg, base.manifest, 0, already, pairs.skipped, started)

    # one embedding path (retrieval.embed); a locked tower's outputs come from the cache training wrote
    cache = locked_tower_outputs(model, todo, device, workers=cfg.workers)
    image_emb, text_emb, text_to_image, keep, bad = embed_pairs(model, todo, device, cfg.batch_size, cache, cfg.workers)  # (N, D)
    records = [todo.records[i] for i in keep.tolist()]
    need_text = base.manifest["text_count"] is not None if base is not None else cfg.text_index
    transform = (
        CompactTransform.from_dict(base.manifest["transform"])
        if base is not None
        else _new_transform(cfg, model, image_emb, text_emb if need_text else None)
    )
    vectors = transform(image_emb).numpy()  # (N, D) full-D compact vectors
    text_vectors = transform(text_emb).numpy() if need_text else None  # (T, D), record then caption order
    skipped = pairs.skipped + bad
    if base is None:
        fresh = _fresh(cfg, dims, vectors, text_vectors, records)  # FAISS training happens before the lock
        curves = _curves(cfg, model, device, fresh.dims, transform.ordering, (image_emb, text_emb, text_to_image, records))
        with writer_lock(cfg.out, cfg.lock_timeout):
            fresh.manifest = _manifest(cfg, fresh, run_config, fingerprint, transform, model, pairs, len(records), skipped, None)
            _attach_curves(cfg.out, fresh, curves)
            write_version(cfg.out, fresh, keep_previous=True)  # an --overwrite keeps one rollback
        return _summary(cfg, fresh.manifest, len(records), already, skipped, started)
    with writer_lock(cfg.out, cfg.lock_timeout):
        live = load_contents(cfg.out)  # the version that is live now: another writer may have added to it
        if live.manifest["transform"] != base.manifest["transform"] or live.manifest["dims"] != base.manifest["dims"]:
            raise UserError(f"the index {cfg.out} was rebuilt by another process during this --add; run it again")
        added = _extend(live, vectors, text_vectors, records)
        live.manifest = _manifest(cfg, live, run_config, fingerprint, transform, model, pairs, added, skipped, live.manifest)
        curves = read_curves(cfg.out, live.version)  # the same run and ordering: the curve carries over
        if curves is None and cfg.val_data:
            curves = _curves(cfg, model, device, live.dims, transform.ordering, None)
        _attach_curves(cfg.out, live, curves)
        write_version(cfg.out, live)
    return _summary(cfg, live.manifest, added, already + len(records) - added, skipped, started)


# ---------------------------------------------------------------------------- checks


def _validate(cfg: IndexBuildConfig) -> list[int] | None:
    """Checks that need no model; returns the requested m's (sorted, unique) or None."""
    dims = [cfg.dims] if isinstance(cfg.dims, int) else cfg.dims
    if dims is not None:
        dims = sorted(set(int(m) for m in dims))
        if not dims or dims[0] < 1:
            raise UserError(f"--dims must be positive integers, got {cfg.dims}")
    if cfg.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {cfg.batch_size}")
    if cfg.ordering not in ORDERINGS:
        raise UserError(f"unknown ordering {cfg.ordering!r}; choose from {sorted(ORDERINGS)}")
    if not cfg.factory.strip():
        raise UserError("--factory must be a FAISS factory string or auto")
    if cfg.lock_timeout < 0:
        raise UserError(f"--lock-timeout must be >= 0, got {cfg.lock_timeout}")
    claim_index_dir(cfg.out, cfg.add, cfg.overwrite)
    return dims


def claim_index_dir(out: str, add: bool, overwrite: bool) -> None:
    """The ``--out`` rule of ``retrieval.io.claim_output_dir`` for an index; ``--add`` needs one to extend."""
    if add and overwrite:
        raise UserError("--add extends the index and --overwrite replaces it: give one of them")
    if add and not is_index_dir(out):
        raise UserError(f"--add needs an existing index at {out}")
    claim_output_dir(out, "index", overwrite=overwrite, reuse=add)


def _check_new_index(cfg: IndexBuildConfig, dims: list[int] | None, dim: int, n: int) -> None:
    if dims and dims[-1] > dim:
        raise UserError(f"--dims {dims[-1]} exceeds the model's embedding dimension D={dim}")
    if cfg.factory != "auto":
        for m in _all_dims(dims, dim):
            try:
                need, why = fi.min_train_vectors(fi.new_index(m, cfg.factory))
            except ValueError as err:
                raise UserError(f"--factory: {err}") from None
            if n < need:  # n: records before decoding, so at least as many as will be embedded
                raise UserError(
                    f"--factory {cfg.factory} needs at least {need} training vectors ({why}), the data has {n} images;"
                    " use fewer lists / codes or Flat / HNSW32"
                )


def _all_dims(dims: list[int] | None, dim: int) -> list[int]:
    return sorted(set(dims or []) | {dim})


def _check_same_run(manifest: dict, cfg: IndexBuildConfig, dims: list[int] | None, fingerprint: str) -> None:
    if manifest["fingerprint"] != fingerprint:
        raise UserError(
            f"--add: run {cfg.run} (fingerprint {fingerprint}) differs from the run the index was built with"
            f" ({manifest['run']}, fingerprint {manifest['fingerprint']})"
        )
    if dims is not None and _all_dims(dims, manifest["dim"]) != manifest["dims"]:
        raise UserError(f"--add: the index holds m = {manifest['dims']}, not --dims {','.join(map(str, dims))}")
    if cfg.factory != "auto" and cfg.factory != manifest.get("factory_option"):
        raise UserError(f"--add: the index was built with --factory {manifest.get('factory_option')}, not {cfg.factory}")


def _key(image: str, captions) -> tuple:
    return image, tuple(captions)


def _new_records(pairs: PairSet, meta: list[dict]) -> tuple[PairSet, int]:
    """The records not indexed yet (same image location and captions), and how many were."""
    if not meta:
        return pairs, 0
    seen = {_key(row["image"], row["captions"]) for row in meta}
    fresh = [r for r in pairs.records if _key(r.path, r.captions) not in seen]
    return PairSet(fresh, Counter(), pairs.source, pairs.max_pixels), len(pairs.records) - len(fresh)


# ---------------------------------------------------------------------------- parts


def _new_transform(cfg: IndexBuildConfig, model, image_emb: torch.Tensor, text_emb: torch.Tensor | None):
    """The transform at m = D: every dimension, ordered and weighted; signs anchored on the images."""
    dim = int(image_emb.shape[1])
    w = model.importance().detach().float().cpu()  # (D,)
    joint = image_emb if text_emb is None else torch.cat([image_emb, text_emb])  # PCA fit data
    if cfg.ordering == "pca" and len(joint) < 2:
        raise UserError("--ordering pca needs at least 2 embeddings to fit on")
    transform = make_transform(cfg.ordering, dim, dim, w, cfg.seed, pca_feats=joint if cfg.ordering == "pca" else None)
    return transform.with_signs_from(image_emb)  # anchors: the indexed images, in data order


def prefix(vectors: np.ndarray, m: int) -> np.ndarray:
    """The top-m embedding from full-D compact vectors: the first m dims, re-normalised. (N, D) -> (N, m)."""
    part = np.ascontiguousarray(vectors[:, :m], dtype=np.float32)  # (N, m)
    norms = np.linalg.norm(part, axis=1, keepdims=True)  # (N, 1)
    return part / np.maximum(norms, 1e-12)


def _meta_rows(records: list, existing: list[dict]) -> list[dict]:
    """Meta lines of the new records; ids stay unique across the whole index (``key#2``...)."""
    taken = {row["id"] for row in existing}
    rows = []
    for r in records:
        rid, n = r.key, 1
        while rid in taken:
            n += 1
            rid = f"{r.key}#{n}"
        taken.add(rid)
        rows.append({"id": rid, "image": r.path, "captions": list(r.captions), "label": r.label, "file": file_identity(r.path)})
    return rows


def _text_rows(meta: list[dict], offset: int) -> np.ndarray:
    """(T, 2) image row and caption number of every caption of ``meta``, in order."""
    rows = [(offset + i, c) for i, row in enumerate(meta) for c in range(len(row["captions"]))]
    return np.array(rows, dtype=np.int64).reshape(-1, 2)


def _make(vectors: np.ndarray, factory: str, m: int, seed: int):
    try:
        return fi.build(prefix(vectors, m), factory, seed=seed, progress=True)
    except ValueError as err:
        raise UserError(f"--factory at m={m}: {err}") from None


def _factory(cfg: IndexBuildConfig, n: int, m: int) -> str:
    return fi.auto_factory(n, m) if cfg.factory == "auto" else cfg.factory


def _fresh(cfg: IndexBuildConfig, dims, vectors: np.ndarray, text_vectors, records) -> IndexContents:
    all_dims = _all_dims(dims, vectors.shape[1])
    meta = _meta_rows(records, [])
    factories = {m: _factory(cfg, len(vectors), m) for m in all_dims}
    contents = IndexContents({}, meta, vectors, {m: _make(vectors, factories[m], m, cfg.seed) for m in all_dims})
    contents.manifest = {"factories": {str(m): f for m, f in factories.items()}, "text_factories": None}
    if text_vectors is not None:
        text_factories = {m: _factory(cfg, len(text_vectors), m) for m in all_dims}
        contents.text_vectors = text_vectors
        contents.text_rows = _text_rows(meta, 0)
        contents.text_indexes = {m: _make(text_vectors, text_factories[m], m, cfg.seed) for m in all_dims}
        contents.manifest["text_factories"] = {str(m): f for m, f in text_factories.items()}
    return contents


def _extend(live: IndexContents, vectors: np.ndarray, text_vectors, records) -> int:
    """Append the records ``live`` lacks (another writer may have added some meanwhile); returns how many."""
    seen = {_key(row["image"], row["captions"]) for row in live.meta}
    rows = [i for i, r in enumerate(records) if _key(r.path, r.captions) not in seen]
    if not rows:
        return 0
    meta = _meta_rows([records[i] for i in rows], live.meta)
    vectors = vectors[rows]  # (n, D)
    for m, index in live.image_indexes.items():
        fi.add_vectors(index, prefix(vectors, m), progress=True)
    offset = len(live.meta)
    live.vectors = np.concatenate([live.vectors, vectors])
    live.meta = live.meta + meta
    if live.text_vectors is not None:
        starts = np.cumsum([0] + [len(r.captions) for r in records])  # caption rows of each record
        picked = text_vectors[np.concatenate([np.arange(starts[i], starts[i + 1]) for i in rows])]  # (t, D)
        for m, index in live.text_indexes.items():
            fi.add_vectors(index, prefix(picked, m), progress=True)
        live.text_vectors = np.concatenate([live.text_vectors, picked])
        live.text_rows = np.concatenate([live.text_rows, _text_rows(meta, offset)])
    return len(rows)


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


# ---------------------------------------------------------------------------- the recall-against-m curves


def curve_dims(dims: list[int], dim: int) -> list[int]:
    """The m's of the stored curves: the index's m's and every power of two from 2 up to D."""
    return sorted(set(dims) | {2**i for i in range(1, dim.bit_length()) if 2**i <= dim} | {dim})


def _curves(cfg, model, device, dims: list[int], ordering: str, indexed) -> dict | None:
    """t2i recall@10 (distinct texts) against m for the four orderings (``retrieval.compact.compact_curve``).

    On ``cfg.val_data`` when given, else on ``indexed`` = (image (N, D), text (T, D), text_to_image,
    records) just embedded, its first ``CURVE_MAX_IMAGES`` images. None when neither is usable.
    """
    started = time.perf_counter()
    if cfg.val_data:
        pairs = load_pairs(cfg.val_data, cfg.data_config or DataConfig())
        cache = locked_tower_outputs(model, pairs, device, workers=cfg.workers)
        image, text, owner, keep, _ = embed_pairs(model, pairs, device, cfg.batch_size, cache, cfg.workers)
        records = [pairs.records[i] for i in keep.tolist()]
        source, split = os.path.abspath(cfg.val_data), "validation"
    elif indexed is not None:
        image, text, owner, records = indexed
        source, split = os.path.abspath(cfg.data) if os.path.exists(cfg.data) else cfg.data, "indexed"
    else:
        return None
    n = min(len(records), CURVE_MAX_IMAGES)
    rows = (owner < n).nonzero().squeeze(1)  # the captions of the first n images
    texts = [c for r in records[:n] for c in r.captions]
    if n < 2 or len(rows) != len(texts):
        return None
    w = model.importance().detach().float().cpu()  # (D,)
    m_values = curve_dims(dims, int(image.shape[1]))
    curve = compact_curve(image[:n], text[rows], owner[rows], w, m_values, seed=cfg.seed, texts=texts)
    return {
        "metric": "t2i_r10",  # text->image recall@10 over distinct caption texts (retrieval.metrics)
        "split": split,  # validation: --val-data; indexed: the indexed data (no --val-data given)
        "data": source,
        "images": n,
        "queries": len(set(texts)),
        "ordering": ordering,  # the index's own ordering: its recall per m is curves[ordering]
        "dims": m_values,
        "curves": {name: {str(m): round(v, 4) for m, v in by_m.items()} for name, by_m in curve.items()},
        "seconds": round(time.perf_counter() - started, 2),
    }


def read_curves(index_dir, version: str | None) -> dict | None:
    """The curves file of a version of an index folder, or None (none recorded, or unreadable)."""
    if not version:
        return None
    try:
        data = json.loads((Path(index_dir) / version / CURVES).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("curves"), dict) else None


def _attach_curves(out, contents: IndexContents, curves: dict | None) -> None:
    """Put the curves file into the version being written (moved in by ``write_version``: atomic with it)
    and take the manifest's recall per m from it. Call while holding the writer lock."""
    if curves is None:
        return
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + "curves-", dir=out)  # removed by recovery if the write dies
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(curves, indent=1) + "\n")
    contents.files[CURVES] = Path(tmp)
    own = curves["curves"].get(curves["ordering"], {})
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
    record = None
    try:
        lines = (Path(run) / METRICS).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    epoch = _best_epoch(run) if weights == "best" else None
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
    try:
        info = best_info(run)
    except UserError:
        return None
    return None if info is None else info["epoch"]


def _manifest(cfg, contents, run_config, fingerprint, transform, model, pairs, added, skipped, previous) -> dict:
    previous = previous or {}
    data = os.path.abspath(cfg.data) if os.path.exists(cfg.data) else cfg.data
    source = {"data": data, "fingerprint": pairs.fingerprint, "added": added}
    dims = contents.dims
    w = model.importance().detach().float().cpu()  # (D,)
    importance = w[transform.keep] if transform.keep is not None else w.sort(descending=True).values
    run = previous.get("run", os.path.abspath(cfg.run))
    return {
        "format": FORMAT,
        "run": run,
        "fingerprint": fingerprint,
        "weights": previous.get("weights", cfg.weights),  # which of the run's weights (retrieval.run)
        "model": run_config.get("model"),
        "ordering": transform.ordering,
        "dim": transform.dim,
        "dims": dims,
        "transform": transform.to_dict(),
        "importance": [round(float(v), 6) for v in importance],
        "recall": run_recall(cfg.run, transform.ordering, dims, cfg.weights),
        "recall_source": os.path.join(os.path.abspath(cfg.run), METRICS),
        "factories": previous.get("factories", contents.manifest.get("factories")),
        "text_factories": previous.get("text_factories", contents.manifest.get("text_factories")),
        "factory_option": previous.get("factory_option", cfg.factory),
        "metric": "inner_product",
        "count": len(contents.meta),
        "text_count": None if contents.text_vectors is None else int(len(contents.text_vectors)),
        "sources": previous.get("sources", []) + [source],
        "skipped": dict(Counter(previous.get("skipped", {})) + Counter(dict(skipped))),
        "created": previous.get("created", time.strftime("%Y-%m-%dT%H:%M:%S")),
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _summary(cfg, manifest: dict, added: int, already: int, skipped: Counter, started: float) -> dict:
    out = Path(cfg.out)
    try:
        size = os.path.getsize(out / current_version(out) / image_index_name(manifest["dims"][0]))
    except (OSError, UserError):
        size = 0
    return {
        "index": os.path.abspath(cfg.out),
        "count": manifest["count"],
        "added": added,
        "already_indexed": already,
        "text_count": manifest["text_count"],
        "dims": manifest["dims"],
        "dim": manifest["dim"],
        "ordering": manifest["ordering"],
        "factories": manifest["factories"],
        "recall": manifest["recall"],
        f"bytes_per_vector_m{manifest['dims'][0]}": round(size / max(1, manifest["count"]), 1),
        "fingerprint": manifest["fingerprint"],
        "skipped": dict(skipped),
        "seconds": round(time.perf_counter() - started, 2),
    }
