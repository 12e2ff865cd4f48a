"""``triclip index build``: embed a data source, keep the top-m dimensions, index them in FAISS.

Steps: load the run and the data; embed every image (and every caption, for
image->text search) in batches; map the embeddings through the compact transform
of ``retrieval.compact`` (``importance`` ordering by default: the top-m dimensions
of ``sqrt(w) * z``, re-normalised, with the sign fix anchored on the first indexed
images); build the FAISS index (``index.faiss_index``; ``auto`` picks Flat / HNSW32 /
IVF-PQ by size and memory); write the directory atomically (``index.store``).

``add=True`` appends the records of ``data`` that are not indexed yet (same image
location and captions) to an existing index, with the run, transform and factory
recorded in its manifest; a different run or m is refused.

The manifest records what a query needs to be embedded the same way:

    format, run, fingerprint, model, ordering, m, dim, transform (CompactTransform.to_dict),
    factory, text_factory, factory_option, metric, count, text_count, sources, skipped, created
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from index import faiss_index as fi
from index.store import FORMAT, IMAGE_INDEX, IndexContents, is_index_dir, load_contents, write_contents
from retrieval.cache import locked_tower_outputs
from retrieval.compact import ORDERINGS, CompactTransform, make_transform
from retrieval.data import DataConfig, PairSet, load_pairs
from retrieval.embed import embed_pairs, pick_device
from retrieval.errors import UserError
from retrieval.run import load_run, run_fingerprint


@dataclass
class IndexBuildConfig:
    """What ``triclip index build`` was asked to do."""

    run: str  # run directory (triclip train --out)
    data: str  # data source to index (any format retrieval.data accepts)
    out: str  # index directory to write
    dims: int | None = None  # m: dimensions kept (None: all D; with add: the index's m)
    factory: str = "auto"  # FAISS index-factory string, or auto (index.faiss_index.auto_factory)
    add: bool = False  # append to the existing index at out instead of building a new one
    batch_size: int = 64  # images per embedding batch
    device: str | None = None  # torch device (None: cuda when available, else cpu)
    data_config: DataConfig | None = None  # how to read data (None: the format's defaults)
    text_index: bool = True  # also index every caption (image->text and text->text search)
    ordering: str = "importance"  # compact ordering (retrieval.compact.ORDERINGS); pca fits on this data
    seed: int = 0  # seed of the random ordering and of index training
    workers: int = 0  # DataLoader worker processes decoding images


def build_index(cfg: IndexBuildConfig) -> dict:
    """Build (or extend) the index directory ``cfg.out``; returns a JSON-able summary."""
    started = time.perf_counter()
    _validate(cfg)
    old = load_contents(cfg.out) if cfg.add else None
    pairs = load_pairs(cfg.data, cfg.data_config or DataConfig())  # bad data fails before the model loads
    device = pick_device(cfg.device)
    model, run_config = load_run(cfg.run, device)
    fingerprint = run_fingerprint(cfg.run)
    if old is not None:
        _check_same_run(old.manifest, cfg, fingerprint)
    else:
        _check_new_index(cfg, model.embed_dim)  # before the (long) embedding
    todo, already = _new_records(pairs, old)
    if not todo.records:
        return _summary(cfg, old.manifest, 0, already, pairs.skipped, started)

    # one embedding path (retrieval.embed); a locked tower's outputs come from the cache training wrote
    cache = locked_tower_outputs(model, todo, device, workers=cfg.workers)
    image_emb, text_emb, _, keep, bad = embed_pairs(model, todo, device, cfg.batch_size, cache, cfg.workers)  # (N, D)
    records = [todo.records[i] for i in keep.tolist()]
    captions = [(row, c, text) for row, r in enumerate(records) for c, text in enumerate(r.captions)]
    need_text = old.text_index is not None if old is not None else cfg.text_index
    text_emb = text_emb if need_text else None  # (T, D), rows in the order of ``captions``
    transform = (
        CompactTransform.from_dict(old.manifest["transform"])
        if old is not None
        else _new_transform(cfg, model, image_emb, text_emb)
    )
    vectors = transform(image_emb).numpy()  # (N, m)
    text_vectors = transform(text_emb).numpy() if text_emb is not None else None  # (T, m)
    meta = _meta_rows(records, old.meta if old is not None else [])
    contents = (
        _extend(old, vectors, text_vectors, captions, meta)
        if old is not None
        else _fresh(cfg, vectors, text_vectors, captions, meta)
    )
    skipped = pairs.skipped + bad
    contents.manifest = _manifest(cfg, contents, run_config, fingerprint, transform, pairs, len(records), skipped, old)
    write_contents(cfg.out, contents)
    return _summary(cfg, contents.manifest, len(records), already, skipped, started)


# ---------------------------------------------------------------------------- checks


def _validate(cfg: IndexBuildConfig) -> None:
    if cfg.dims is not None and cfg.dims < 1:
        raise UserError(f"--dims must be >= 1, got {cfg.dims}")
    if cfg.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {cfg.batch_size}")
    if cfg.ordering not in ORDERINGS:
        raise UserError(f"unknown ordering {cfg.ordering!r}; choose from {sorted(ORDERINGS)}")
    if not cfg.factory.strip():
        raise UserError("--factory must be a FAISS factory string or auto")
    out = Path(cfg.out)
    if cfg.add and not is_index_dir(out):
        raise UserError(f"--add needs an existing index at {out}")
    if out.exists() and not is_index_dir(out) and (out.is_file() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not a triclip index; refusing to overwrite it")


def _check_new_index(cfg: IndexBuildConfig, dim: int) -> None:
    m = dim if cfg.dims is None else cfg.dims
    if m > dim:
        raise UserError(f"--dims {m} exceeds the model's embedding dimension D={dim}")
    if cfg.factory != "auto":
        try:
            fi.new_index(m, cfg.factory)
        except ValueError as err:
            raise UserError(f"--factory: {err}") from None


def _check_same_run(manifest: dict, cfg: IndexBuildConfig, fingerprint: str) -> None:
    if manifest["fingerprint"] != fingerprint:
        raise UserError(
            f"--add: run {cfg.run} (fingerprint {fingerprint}) differs from the run the index was built with"
            f" ({manifest['run']}, fingerprint {manifest['fingerprint']})"
        )
    if cfg.dims is not None and cfg.dims != manifest["m"]:
        raise UserError(f"--add: the index keeps m={manifest['m']} dimensions, not --dims {cfg.dims}")
    if cfg.factory != "auto" and cfg.factory != manifest["factory"]:
        raise UserError(f"--add: the index was built with --factory {manifest['factory']}, not {cfg.factory}")


def _new_records(pairs: PairSet, old: IndexContents | None) -> tuple[PairSet, int]:
    """The records not indexed yet (same image location and captions), and how many were."""
    if old is None:
        return pairs, 0
    seen = {(row["image"], tuple(row["captions"])) for row in old.meta}
    fresh = [r for r in pairs.records if (r.path, tuple(r.captions)) not in seen]
    return PairSet(fresh, Counter(), pairs.source, pairs.max_pixels), len(pairs.records) - len(fresh)


# ---------------------------------------------------------------------------- parts


def _new_transform(
    cfg: IndexBuildConfig, model, image_emb: torch.Tensor, text_emb: torch.Tensor | None
) -> CompactTransform:
    dim = int(image_emb.shape[1])
    m = dim if cfg.dims is None else cfg.dims
    w = model.importance().detach().float().cpu()  # (D,)
    joint = image_emb if text_emb is None else torch.cat([image_emb, text_emb])  # PCA fit data
    if cfg.ordering == "pca" and len(joint) < 2:
        raise UserError("--ordering pca needs at least 2 embeddings to fit on")
    transform = make_transform(cfg.ordering, dim, m, w, cfg.seed, pca_feats=joint if cfg.ordering == "pca" else None)
    return transform.with_signs_from(image_emb)  # anchors: the indexed images, in data order


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
        rows.append({"id": rid, "image": r.path, "captions": list(r.captions), "label": r.label})
    return rows


def _text_rows(captions: list[tuple[int, int, str]], offset: int) -> np.ndarray:
    return np.array([(row + offset, c) for row, c, _ in captions], dtype=np.int64).reshape(-1, 2)  # (T, 2)


def _make(vectors: np.ndarray, factory: str, seed: int):
    try:
        return fi.build(vectors, factory, seed=seed, progress=True)
    except ValueError as err:
        raise UserError(f"--factory: {err}") from None


def _fresh(cfg: IndexBuildConfig, vectors: np.ndarray, text_vectors, captions, meta) -> IndexContents:
    m = vectors.shape[1]
    factory = fi.auto_factory(len(vectors), m) if cfg.factory == "auto" else cfg.factory
    contents = IndexContents({"factory": factory}, _make(vectors, factory, cfg.seed), meta)
    if text_vectors is not None:
        text_factory = fi.auto_factory(len(text_vectors), m) if cfg.factory == "auto" else cfg.factory
        contents.text_index = _make(text_vectors, text_factory, cfg.seed)
        contents.text_rows = _text_rows(captions, 0)
        contents.manifest["text_factory"] = text_factory
    return contents


def _extend(old: IndexContents, vectors: np.ndarray, text_vectors, captions, meta) -> IndexContents:
    offset = len(old.meta)
    fi.add_vectors(old.image_index, vectors, progress=True)
    old.meta = old.meta + meta
    if old.text_index is not None and text_vectors is not None:
        fi.add_vectors(old.text_index, text_vectors, progress=True)
        old.text_rows = np.concatenate([old.text_rows, _text_rows(captions, offset)])
    return old


def _manifest(cfg, contents, run_config, fingerprint, transform, pairs, added, skipped, old) -> dict:
    previous = old.manifest if old is not None else {}
    data = os.path.abspath(cfg.data) if os.path.exists(cfg.data) else cfg.data
    source = {"data": data, "fingerprint": pairs.fingerprint, "added": added}
    return {
        "format": FORMAT,
        "run": previous.get("run", os.path.abspath(cfg.run)),
        "fingerprint": fingerprint,
        "model": run_config.get("model"),
        "ordering": transform.ordering,
        "m": transform.m,
        "dim": transform.dim,
        "transform": transform.to_dict(),
        "factory": contents.manifest.get("factory", previous.get("factory")),
        "text_factory": contents.manifest.get("text_factory", previous.get("text_factory")),
        "factory_option": previous.get("factory_option", cfg.factory),
        "metric": "inner_product",
        "count": int(contents.image_index.ntotal),
        "text_count": None if contents.text_index is None else int(contents.text_index.ntotal),
        "sources": previous.get("sources", []) + [source],
        "skipped": dict(Counter(previous.get("skipped", {})) + Counter(dict(skipped))),
        "created": previous.get("created", time.strftime("%Y-%m-%dT%H:%M:%S")),
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _summary(cfg, manifest: dict, added: int, already: int, skipped: Counter, started: float) -> dict:
    size = os.path.getsize(os.path.join(cfg.out, IMAGE_INDEX))
    return {
        "index": os.path.abspath(cfg.out),
        "count": manifest["count"],
        "added": added,
        "already_indexed": already,
        "text_count": manifest["text_count"],
        "m": manifest["m"],
        "dim": manifest["dim"],
        "ordering": manifest["ordering"],
        "factory": manifest["factory"],
        "bytes_per_vector": round(size / max(1, manifest["count"]), 1),  # index file / vectors
        "fingerprint": manifest["fingerprint"],
        "skipped": dict(skipped),
        "seconds": round(time.perf_counter() - started, 2),
    }
