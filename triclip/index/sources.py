"""``triclip index build``: where the vectors come from; ``triclip.index.build`` builds and writes them.

Two sources, one builder (``triclip.index.build.build_and_write``):

- ``--run RUN --data P``: load the run and the data; embed every image (and every caption,
  for image->text search) in batches, reusing the locked-tower cache; map the embeddings
  through the compact transform of ``triclip.compact.features`` at m = D (``importance`` ordering
  by default: ``sqrt(w) * z`` in importance order, re-normalised, with the sign fix anchored
  on the first indexed images), so that the top-m embedding of any m is the re-normalised
  prefix of the stored vector. The vectors are one in-memory shard. The curves
  (``curves.json``: t2i recall@10 against m for the run's own ordering, first-m, random
  and PCA, on ``--val-data``, else the indexed data) are measured with the model here.
- ``--embeddings EMB``: the shards ``triclip embed`` wrote, memory-mapped (torchrun: the
  ranks share the work).

``add=True`` appends the records of ``data`` that are not indexed yet (same image location
and captions) with the run, transform, dims and factories recorded in the manifest; a
different run, dims or factory is refused. The embedding runs without the lock; only the
append and the write hold it, against the version that is live then, so concurrent
``--add`` writers all land. The manifest's keys are listed in ``triclip.index.manifest``.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch

from triclip import codecs
from triclip.index import faiss_index as fi
from triclip.index.build import Collection, build_and_write, measure_in_index
from triclip.index.config import IndexBuildConfig, check_build, listed  # noqa: F401 (IndexBuildConfig re-exported)
from triclip.index.manifest import (  # noqa: F401 (CURVES, file_identity, read_curves, run_recall: re-exported)
    CURVES,
    Origin,
    attach_curves,
    curve_dims,
    file_identity,
    make_manifest,
    read_curves,
    run_recall,
    summary,
    text_rows,
    unique_ids,
)
from triclip.index.val_embeddings import validation_set
from triclip.index.metarows import MetaRows, shard_meta_files
from triclip.index.lazy_codes import distinct
from triclip.index.store import IndexContents, is_index_dir, load_contents, write_version, writer_lock
from triclip.index.vectors import ShardVectors, appended, prefix
from triclip.model.cache import locked_tower_outputs
from triclip.compact.features import CompactTransform, compact_curve, make_transform
from triclip.data import DataConfig, PairSet, load_pairs
from triclip.data.split import load_collection, split_val
from triclip.model.embed import embed_pairs, pick_device
from triclip.core.errors import UserError
from triclip.core.io import claim_output_dir
from triclip.model.run import load_run, run_fingerprint
from triclip.model.shards import check_complete, load_shard, read_manifest

CURVE_MAX_IMAGES = 5000  # curves on the indexed data (no --val-data) use at most its first this many images


def build_index(cfg: IndexBuildConfig) -> dict:
    """Build (or extend) the index folder ``cfg.out``; returns a JSON-able summary."""
    started = time.perf_counter()
    dims = _validate(cfg)
    if cfg.embeddings is not None:
        coll = open_embeddings(cfg)
        all_dims = _check_new_index(cfg, dims, coll.image.dim, coll.image.count)
        evaluation = validation_set(cfg.val_embeddings, read_manifest(cfg.embeddings)) if cfg.val_embeddings else None
        return build_and_write(cfg, coll, all_dims, evaluation=evaluation, started=started)
    cfg = replace(cfg, val_data=cfg.val_data or split_val(cfg.data))  # a split folder's curves: on its validation split
    base = load_contents(cfg.out, indexes=False) if cfg.add else None  # a snapshot: transform, dims, seen records
    if base is not None and (base.manifest.get("on_disk") or _codes_on_disk(base.manifest)):
        raise UserError(f"{cfg.out} keeps IVF lists on disk: --add is not supported; rebuild it with --embeddings")
    pairs = load_collection(cfg.data, cfg.data_config or DataConfig())  # a split folder: all its splits; bad data fails before the model loads
    device = pick_device(cfg.device)
    model, run_config = load_run(cfg.run, device, which=cfg.weights)
    fingerprint = run_fingerprint(cfg.run, which=cfg.weights)
    if base is not None:
        _check_same_run(base.manifest, cfg, fingerprint)
        all_dims = base.manifest["dims"]
    else:
        all_dims = _check_new_index(cfg, dims, model.embed_dim, len(pairs.records))  # before the (long) embedding
    todo, already = _new_records(pairs, base.meta if base is not None else [])
    if not todo.records:
        return summary(base.manifest, cfg.out, started, added=0, already_indexed=already, skipped=dict(pairs.skipped))

    # one embedding path (triclip.model.embed); a locked tower's outputs come from the cache training wrote
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
    origin = _origin(cfg, model, run_config, fingerprint, transform, pairs, len(records), pairs.skipped + bad)
    if base is not None:
        held_out = _held_out(cfg, model, device, None) if cfg.val_data else None  # measured again among all rows
        evaluation = _evaluation(held_out, transform) if held_out is not None else None
        return _add(cfg, base, origin, vectors, text_vectors, records, already, started, evaluation)
    meta = _meta_rows(records, [])
    coll = Collection(
        ShardVectors.of([vectors]),
        ShardVectors.of([text_vectors]) if text_vectors is not None else None,
        meta,
        text_rows(meta) if text_vectors is not None else None,
        origin,
    )

    held_out = _held_out(cfg, model, device, Indexed(image=image_emb, text=text_emb, owner=text_to_image, records=records))

    def curves(m_values: list[int]) -> dict | None:
        return _curves(cfg, model, held_out, m_values, transform.ordering)

    evaluation = _evaluation(held_out, transform) if held_out and held_out.split == "validation" else None
    return {**build_and_write(cfg, coll, all_dims, curves, evaluation, started), "already_indexed": already}


def open_embeddings(cfg: IndexBuildConfig) -> Collection:
    """The shards of ``cfg.embeddings`` (``triclip embed``), their rows and origin, as a :class:`Collection`."""
    emb = check_complete(cfg.embeddings)
    image = ShardVectors.open(cfg.embeddings, emb["num_shards"], "image")
    text = ShardVectors.open(cfg.embeddings, emb["num_shards"], "text") if cfg.text_index and emb.get("text") else None
    counts, rows = [], []
    skipped = Counter(emb.get("skipped", {}))
    for s in range(emb["num_shards"]):
        shard = load_shard(cfg.embeddings, s, text=text is not None, meta=False)
        if text is not None:
            rows.append(shard["text_rows"] + np.array([image.offsets[s], 0]))
        counts.append(int(shard["info"]["count"]))
        skipped.update(shard["info"].get("skipped", {}))
    meta = MetaRows(shard_meta_files(cfg.embeddings, emb["num_shards"]), counts)  # read when needed, never whole
    source = {"embeddings": os.path.abspath(cfg.embeddings), "data": emb.get("data"),
              "fingerprint": emb.get("data_fingerprint"), "added": len(meta)}
    origin = Origin(emb["run"], emb["fingerprint"], emb.get("model"), emb["transform"], emb["importance"], source,
                    skipped, embeddings=os.path.abspath(cfg.embeddings))
    text_rows_all = np.concatenate(rows).astype(np.int64).reshape(-1, 2) if text is not None else None
    return Collection(image, text, meta, text_rows_all, origin, distributed=True)


# ---------------------------------------------------------------------------- checks


def _validate(cfg: IndexBuildConfig) -> list[int] | None:
    """Checks that need no model (``triclip.index.config.check_build``), then the ``--out`` rule; returns the
    requested m's (sorted, unique) or None."""
    if cfg.codec is not None:
        codecs.lookup(cfg.codec)  # UserError: unknown codec ...; choose from ... (the registry's names)
    check_build(cfg)
    claim_index_dir(cfg.out, cfg.add, cfg.overwrite)
    dims = listed(cfg.dims)
    return sorted(set(dims)) if dims is not None else None


def _codes_on_disk(manifest: dict) -> bool:
    """Whether a budget's codes (image or caption) keep their inverted lists on disk (read-only)."""
    entries = (manifest.get("budgets") or {}).values()
    return any(e.get("lists") or (e.get("text") or {}).get("lists") for e in entries)


def claim_index_dir(out: str, add: bool, overwrite: bool) -> None:
    """The ``--out`` rule of ``triclip.core.io.claim_output_dir`` for an index; ``--add`` needs one to extend."""
    if add and overwrite:
        raise UserError("--add extends the index and --overwrite replaces it: give one of them")
    if add and not is_index_dir(out):
        raise UserError(f"--add needs an existing index at {out}")
    claim_output_dir(out, "index", overwrite=overwrite, reuse=add)


def _check_new_index(cfg: IndexBuildConfig, dims: list[int] | None, dim: int, n: int) -> list[int]:
    """Every m to index (D included); a non-auto ``--factory`` checked at each, for ``n`` vectors."""
    if dims and dims[-1] > dim:
        raise UserError(f"--dims {dims[-1]} exceeds the model's embedding dimension D={dim}")
    all_dims = _all_dims(dims, dim)
    if cfg.factory != "auto":
        for m in all_dims:
            try:
                need, why = fi.min_train_vectors(fi.new_index(m, cfg.factory))
            except ValueError as err:
                raise UserError(f"--factory at m={m}: {err}") from None
            if n < need:  # n: records before decoding, so at least as many as will be embedded
                raise UserError(
                    f"--factory {cfg.factory} needs at least {need} training vectors ({why}), the data has {n} images;"
                    " use fewer lists / codes or Flat / HNSW32"
                )
    return all_dims


def _all_dims(dims: list[int] | None, dim: int) -> list[int]:
    return sorted(set(dims or []) | {dim})


def _check_same_run(manifest: dict, cfg: IndexBuildConfig, fingerprint: str) -> None:
    """``--add``: the run must be the index's own (its --dims and --factory: ``triclip.index.config.check_build``)."""
    if manifest["fingerprint"] != fingerprint:
        raise UserError(
            f"--add: run {cfg.run} (fingerprint {fingerprint}) differs from the run the index was built with"
            f" ({manifest['run']}, fingerprint {manifest['fingerprint']})"
        )


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


def _origin(cfg, model, run_config, fingerprint, transform, pairs, added: int, skipped: Counter) -> Origin:
    """What the manifest records of a build from ``--run --data``."""
    w = model.importance().detach().float().cpu()  # (D,)
    importance = w[transform.keep] if transform.keep is not None else w.sort(descending=True).values
    data = os.path.abspath(cfg.data) if os.path.exists(cfg.data) else cfg.data
    source = {"data": data, "fingerprint": pairs.fingerprint, "added": added}
    return Origin(os.path.abspath(cfg.run), fingerprint, run_config.get("model"), transform.to_dict(),
                  importance.tolist(), source, skipped, weights=cfg.weights)


def _meta_rows(records: list, existing: list[dict]) -> list[dict]:
    """Meta lines of the new records; ids stay unique across the whole index (``key#2``...)."""
    rows = [{"id": r.key, "image": r.path, "captions": list(r.captions), "label": r.label, "file": file_identity(r.path)}
            for r in records]
    return unique_ids(rows, existing)


def _add(cfg, base: IndexContents, origin: Origin, vectors, text_vectors, records, already: int, started: float,
         evaluation=None) -> dict:
    """Append the new records to the version that is live when the lock is taken (``--add``); with ``evaluation``
    (``--val-data``), the recall among everything the index then holds is measured again (else it is dropped: it
    was measured on fewer images)."""
    with writer_lock(cfg.out, cfg.lock_timeout):
        live = load_contents(cfg.out)  # the version that is live now: another writer may have added to it
        if live.manifest["transform"] != base.manifest["transform"] or live.manifest["dims"] != base.manifest["dims"]:
            raise UserError(f"the index {cfg.out} was rebuilt by another process during this --add; run it again")
        added = _extend(live, vectors, text_vectors, records)
        origin.source["added"] = added
        decided = {k: live.manifest.get(k) for k in ("factories", "text_factories", "memory_budget", "nprobe",
                                                     "text_nprobe", "nprobe_tuning", "budgets")}
        live.manifest = make_manifest(cfg, live, origin, decided, live.manifest)
        for budget, codec in live.codes.items():  # same code and measured recall; more rows
            live.manifest["budgets"][str(budget)]["index_bytes"] = codec.spec.bytes_per_vector * len(codec)
        for budget, codec in live.text_codes.items():
            live.manifest["budgets"][str(budget)]["text"]["index_bytes"] = codec.spec.bytes_per_vector * len(codec)
        curves = read_curves(cfg.out, live.version)  # the same run and ordering: the curve carries over
        if curves is None and cfg.val_data:
            device = pick_device(cfg.device)
            model, _ = load_run(cfg.run, device, which=cfg.weights)
            curves = _curves(cfg, model, _held_out(cfg, model, device, None), live.dims, origin.transform["ordering"])
        measure_in_index(live, evaluation)
        attach_curves(cfg.out, live, curves)
        write_version(cfg.out, live)
    return summary(live.manifest, cfg.out, started, added=added, already_indexed=already + len(records) - added)


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
    for codec in distinct(live.codes.values()):  # the codes of --bytes: same trained code, more rows
        codec.add(vectors)
    offset = len(live.meta)
    live.vectors = appended(live.vectors, vectors)  # the index's own precision
    live.meta = live.meta + meta
    if live.text_vectors is not None:
        starts = np.cumsum([0] + [len(r.captions) for r in records])  # caption rows of each record
        picked = text_vectors[np.concatenate([np.arange(starts[i], starts[i + 1]) for i in rows])]  # (t, D)
        for m, index in live.text_indexes.items():
            fi.add_vectors(index, prefix(picked, m), progress=True)
        for codec in distinct(live.text_codes.values()):
            codec.add(picked)
        live.text_vectors = appended(live.text_vectors, picked)
        live.text_rows = np.concatenate([live.text_rows, text_rows(meta, offset)])
    return len(rows)


# ---------------------------------------------------------------------------- the recall-against-m curves


class Indexed(NamedTuple):
    """What a build from ``--run --data`` just embedded: raw embeddings, in data order."""

    image: torch.Tensor  # (N, D)
    text: torch.Tensor  # (T, D) every caption, record then caption order
    owner: torch.Tensor  # (T,) the image row of each caption
    records: list  # the N records embedded


class HeldOut(NamedTuple):
    """What the curves (and the codes of ``--bytes``) are measured on: raw embeddings of held-out images."""

    image: torch.Tensor  # (n, D)
    text: torch.Tensor  # (T, D) their captions
    owner: torch.Tensor  # (T,) the image row of each caption
    texts: list[str]  # (T) the captions' strings
    split: str  # "validation" (--val-data) or "indexed" (the indexed data's first images)
    source: str  # where it came from


def _held_out(cfg, model, device, indexed: Indexed | None) -> HeldOut | None:
    """``cfg.val_data`` embedded when given, else ``indexed`` (what was just embedded for the
    index, cut to its first ``CURVE_MAX_IMAGES`` images); None when neither is usable.
    """
    if cfg.val_data:
        pairs = load_pairs(cfg.val_data, cfg.data_config or DataConfig())
        cache = locked_tower_outputs(model, pairs, device, workers=cfg.workers)
        image, text, owner, keep, _ = embed_pairs(model, pairs, device, cfg.batch_size, cache, cfg.workers)
        records = [pairs.records[i] for i in keep.tolist()]
        source, split = os.path.abspath(cfg.val_data), "validation"
    elif indexed is not None:
        image, text, owner, records = indexed.image, indexed.text, indexed.owner, indexed.records
        source, split = os.path.abspath(cfg.data) if os.path.exists(cfg.data) else cfg.data, "indexed"
    else:
        return None
    n = min(len(records), CURVE_MAX_IMAGES)
    rows = (owner < n).nonzero().squeeze(1)  # the captions of the first n images
    texts = [c for r in records[:n] for c in r.captions]
    if n < 2 or len(rows) != len(texts):
        return None
    return HeldOut(image=image[:n], text=text[rows], owner=owner[rows], texts=texts, split=split, source=source)


def _evaluation(held_out: HeldOut, transform: CompactTransform):
    """The held-out embeddings as served vectors: what ``triclip.index.budgets`` measures codes on."""
    from triclip.index.budgets import EvalSet

    h = held_out
    return EvalSet.of(transform(h.image).numpy(), transform(h.text).numpy(), h.owner.numpy(), h.texts, h.split, h.source)


def _curves(cfg, model, held_out: HeldOut | None, dims: list[int], ordering: str) -> dict | None:
    """t2i recall@10 (distinct texts) against m for the four orderings (``triclip.compact.features.compact_curve``),
    on the held-out embeddings of :func:`_held_out`; None without them."""
    if held_out is None:
        return None
    started = time.perf_counter()
    h = held_out
    w = model.importance().detach().float().cpu()  # (D,)
    m_values = curve_dims(dims, int(h.image.shape[1]))
    curve = compact_curve(h.image, h.text, h.owner, w, m_values, seed=cfg.seed, texts=h.texts)
    return {
        "metric": "t2i_r10",  # text->image recall@10 over distinct caption texts (triclip.compact.metrics)
        "split": h.split,  # validation: --val-data; indexed: the indexed data (no --val-data given)
        "data": h.source,
        "images": int(len(h.image)),
        "queries": len(set(h.texts)),
        "ordering": ordering,  # the index's own ordering: its recall per m is curves[ordering]
        "dims": m_values,
        "curves": {name: {str(m): round(v, 4) for m, v in by_m.items()} for name, by_m in curve.items()},
        "seconds": round(time.perf_counter() - started, 2),
    }
