"""``triclip embed``: a data source embedded into numbered shards, resumable, one rank per shard.

The folder (docs/CONTRACT.md "Embeddings")::

    EMB/manifest.json              run, fingerprint, data fingerprint, shard size, D, dtype, the
                                   compact transform (importance order, sqrt(w), sign fix)
    EMB/shard-00000/image.npy      (n, D) compact image vectors: sqrt(w)-weighted, importance order,
                                   sign fix, unit rows; the top-m embedding is a re-normalised prefix
    EMB/shard-00000/text.npy       (T, D) the same for every caption of those images
    EMB/shard-00000/text_rows.npy  (T, 2) int64: caption t is caption text_rows[t, 1] of image row text_rows[t, 0]
    EMB/shard-00000/meta.jsonl     one line per image row: {"id", "image", "captions", "label"}
    EMB/shard-00000/shard.json     counts, records covered, skipped images, and the size and sha256
                                   of every file above (written last)

Shard ``s`` holds records ``s * shard_size`` to ``(s + 1) * shard_size`` of the source, in
source order, minus the images that do not decode. A shard is built in a temporary folder
and renamed into place, so it is either complete or absent: a re-run skips the shards that
exist and a killed job resumes. Damage after the fact is caught, not reused: every read
checks each file's size against ``shard.json`` and the ``.npy`` headers against the counts
(cheap, always); ``embed --verify`` also checks the sha256. ``embed`` recomputes a damaged
shard; ``index build --embeddings`` refuses it with one line. (Shards written before the
sizes were recorded get the header checks.) Under ``torchrun`` rank ``r`` of ``W`` takes shards
``r, r + W, r + 2W, ...``; rank 0 writes the manifest first (the other ranks wait at a
barrier), so every rank applies the same transform. The sign fix is anchored on the first
``anchor_rows`` images of the source, the same for any number of ranks.

A run trained on locked towers reuses the tower outputs that training (or ``index build``)
cached for this very data (``triclip.model.cache``), sliced per shard; nothing new is cached:
at scale the tower outputs would dwarf the embeddings.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
from triclip.core.progress import progress

from triclip.core.config import bounded, check_fields, check_device
from triclip.core.errors import UserError, first_line
from triclip.core.io import claim_output_dir, file_sha256, read_json, temp_dir, write_errors, write_json_atomic, writing
from triclip.data.records import DataConfig

if TYPE_CHECKING:  # for the annotations only
    from triclip.data import PairSet

# torch and the model code load inside the embedding functions: reading shards (index build
# --embeddings, benchmarks) needs neither, and torch alone takes ~600 MB of resident memory.

FORMAT = "triclip-embeddings/1"  # manifest["format"]
MANIFEST = "manifest.json"
SHARD_INFO = "shard.json"
IMAGE, TEXT, TEXT_ROWS, META = "image.npy", "text.npy", "text_rows.npy", "meta.jsonl"
DTYPES = ("float32", "float16")


@dataclass
class EmbedConfig:
    """What ``triclip embed`` was asked to do."""

    run: str = field(metadata={"flags": ["--run", "--run-dir"]})  # run directory (triclip train --out; under plain torchrun: --run-dir)
    data: str  # data source to embed (any format triclip.data accepts)
    out: str  # embeddings folder (created; resumed when it holds this run's shards)
    shard_size: int = bounded(200_000, low=1)  # records per shard
    dtype: Literal["float32", "float16"] = "float32"  # vectors on disk: float32 or float16 (half the size)
    text: bool = True  # also embed every caption (image->text search, nprobe tuning; --no-text: the images only)
    batch_size: int | None = bounded(None, low=1)  # per forward pass (None: 256 on a GPU, 64 on the CPU)
    workers: int | None = bounded(None, low=0)  # image-decoding processes per rank (None: GPU: cores / local ranks, max 8; CPU: 0)
    device: str | None = None  # torch device (None: this rank's GPU when present, else the CPU)
    data_config: DataConfig = field(default_factory=DataConfig)  # how to read data (--sep, --image-key, ...)
    anchor_rows: int = bounded(64, low=1)  # the sign fix's anchors: the first images of the source (not an option)
    overwrite: bool = False  # start out over (otherwise a re-run resumes it, and other embeddings there are refused)
    verify: bool = False  # a re-run also checks the sha256 of finished shards (reads them all; sizes are always checked)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def embed_to_shards(cfg: EmbedConfig) -> dict:
    """Embed ``cfg.data`` into shards under ``cfg.out`` (this rank's share); returns a summary.

    Works alone or under ``torchrun`` (``WORLD_SIZE`` > 1 starts a process group: NCCL on
    GPUs, gloo on the CPU). Every rank returns the summary of the whole folder.
    """
    from triclip.model.cache import existing_locked_outputs
    from triclip.compact.features import CompactTransform
    from triclip.data import load_pairs
    from triclip.model.run import load_run, run_fingerprint

    started = time.perf_counter()
    _validate(cfg)
    rank, world, owned = init_distributed()
    together = False  # every rank stands at the same point, so leaving the group can wait for the others
    held = contextlib.ExitStack()  # rank 0: the folder's lock and mark (triclip.core.io.writing), for the whole run
    try:
        where = [Path(cfg.out)]  # alone, an --overwrite is written beside and swapped in at the end

        def claim() -> None:
            where[0] = held.enter_context(writing(cfg.out, "embeddings", overwrite=cfg.overwrite,
                                                  reuse=not cfg.overwrite, stage=world == 1))  # fmt: skip

        on_rank0(world, rank, claim)
        pairs = load_pairs(cfg.data, cfg.data_config or DataConfig())  # bad data fails before the model loads
        device = _device(cfg.device)
        model, run_config = load_run(cfg.run, device)
        fingerprint = run_fingerprint(cfg.run)
        cache = existing_locked_outputs(model, pairs)  # a locked tower's outputs, if training cached this data
        num_shards = math.ceil(len(pairs.records) / cfg.shard_size)
        out = where[0]
        on_rank0(world, rank, _prepare_folder, cfg, out, model, run_config, fingerprint, pairs, num_shards, device, cache)
        manifest = read_manifest(out)
        transform = CompactTransform.from_dict(manifest["transform"])
        batch = cfg.batch_size or (256 if device.type == "cuda" else 64)
        workers = _workers(cfg.workers, device)
        mine = list(range(rank, num_shards, world))
        todo = [
            s for s in mine if not (out / shard_name(s) / SHARD_INFO).is_file() or _damaged(out, s, manifest, cfg.verify)
        ]
        bar = progress(todo, desc=f"rank {rank}/{world} shards", unit="shard", position=rank, disable=None)
        for s in bar:
            _write_shard(out, s, pairs, cfg, model, transform, device, batch, workers, rank, cache)
        barrier(world)
        summary = summarize(out)
        summary.update(rank=rank, world=world, written=len(todo), reused=len(mine) - len(todo))
        summary["seconds"] = round(time.perf_counter() - started, 2)
        together = True
        held.close()  # every shard written: the mark says done (and a replacement is swapped in)
        summary["embeddings"] = str(Path(cfg.out).absolute())
        return summary
    except EveryRankError:
        together = True
        raise
    finally:
        stopped = UserError("embed stopped")  # after an error (or with none, after close): the mark stays unfinished
        held.__exit__(UserError, stopped, None)
        if owned:
            leave_group(together)


# ---------------------------------------------------------------------------- reading


def read_manifest(emb: str | os.PathLike) -> dict:
    """The manifest of an embeddings folder; UserError when missing or foreign."""
    path = Path(emb) / MANIFEST
    if not path.is_file():
        raise UserError(f"{emb} is not a triclip embeddings folder (no {MANIFEST})")
    manifest = read_json(path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"{path} has an unknown format (expected {FORMAT})")
    return manifest


def shard_problem(emb: str | os.PathLike, index: int, manifest: dict, verify: bool = False) -> str | None:
    """What is wrong with finished shard ``index`` (None: nothing found).

    Always: every file recorded in ``shard.json`` has its recorded size, and the ``.npy``
    headers give the manifest's dtype and the shard's counts, with the data all there.
    ``verify``: the sha256 of every recorded file too (reads the whole shard).
    """
    folder = Path(emb) / shard_name(index)
    try:
        info = json.loads((folder / SHARD_INFO).read_text(encoding="utf-8"))
        count, text_count = int(info["count"]), info.get("text_count")
        for name, record in (info.get("files") or {}).items():
            if Path(name).name != name or name in (".", ".."):
                return f"{SHARD_INFO} names a file outside the shard ({name!r})"
            size = (folder / name).stat().st_size
            if size != record["size"]:
                return f"{name} has {size} bytes, {record['size']} were written"
            if verify and file_sha256(folder / name) != record["sha256"]:
                return f"{name} does not match the sha256 recorded when it was written"
        dim, dtype = int(manifest["dim"]), np.dtype(manifest["dtype"])
        arrays = {IMAGE: ((count, dim), dtype)}
        if text_count is not None:
            arrays.update({TEXT: ((int(text_count), dim), dtype), TEXT_ROWS: ((int(text_count), 2), np.dtype(np.int64))})
        for name, (shape, want) in arrays.items():
            problem = _npy_problem(folder / name, shape, want)
            if problem:
                return f"{name} {problem}"
    except FileNotFoundError as err:
        return f"{Path(err.filename or '?').name} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:  # unreadable or garbled shard.json
        return f"{SHARD_INFO} is unreadable ({first_line(err, limit=None)})"
    return None


def _npy_problem(path: Path, shape: tuple, dtype: np.dtype) -> str | None:
    """Why the ``.npy`` file at ``path`` is not a whole ``dtype`` array of ``shape`` (header only), or None."""
    with open(path, "rb") as fh:
        try:
            version = np.lib.format.read_magic(fh)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            found, _, found_dtype = read(fh)
        except ValueError as err:
            return f"is not a .npy file ({str(err).splitlines()[0]})"
        data_at = fh.tell()
    if found_dtype != dtype or tuple(found) != tuple(shape):
        return f"holds {found_dtype} {tuple(found)}, expected {dtype} {tuple(shape)}"
    need = data_at + int(np.prod(shape)) * dtype.itemsize
    size = path.stat().st_size
    return f"is truncated ({size} of {need} bytes)" if size < need else None


def _damaged(out: Path, s: int, manifest: dict, verify: bool) -> bool:
    """Whether finished shard ``s`` is damaged; says so on stderr (it is then recomputed)."""
    problem = shard_problem(out, s, manifest, verify)
    if problem:
        print(f"triclip: {out / shard_name(s)} is damaged: {problem}; recomputing it", file=sys.stderr, flush=True)
    return problem is not None


def finished_shards(emb: str | os.PathLike) -> list[int]:
    """Numbers of the shards written completely, ascending."""
    manifest = read_manifest(emb)
    return [s for s in range(manifest["num_shards"]) if (Path(emb) / shard_name(s) / SHARD_INFO).is_file()]


def check_complete(emb: str | os.PathLike, verify: bool = False) -> dict:
    """The manifest, after checking every shard is there and whole (:func:`shard_problem`).

    Raises:
        UserError: naming the missing shards, or the first damaged one.
    """
    manifest = read_manifest(emb)
    done = set(finished_shards(emb))
    missing = [s for s in range(manifest["num_shards"]) if s not in done]
    if missing:
        listed = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise UserError(f"{emb} is incomplete: shards {listed} missing; run `triclip embed` again to finish them")
    for s in sorted(done):
        problem = shard_problem(emb, s, manifest, verify)
        if problem:
            raise UserError(
                f"{Path(emb) / shard_name(s)} is damaged: {problem}; run `triclip embed` again with the same"
                " options to recompute it"
            )
    return manifest


def load_shard(emb: str | os.PathLike, index: int, text: bool = True, mmap: bool = True, meta: bool = True) -> dict:
    """One shard: ``{"image" (n, D), "text" (T, D) | None, "text_rows" (T, 2) | None, "meta", "info"}``.

    Vectors are memory-mapped (``mmap``) in the dtype they were written in. ``meta=False``: ``"meta"`` is None
    (the rows are not read: ``triclip.index.metarows`` reads them when needed).
    """
    folder = Path(emb) / shard_name(index)
    info_path = folder / SHARD_INFO
    if not info_path.is_file():
        raise UserError(f"{folder} is missing or unfinished")
    mode = "r" if mmap else None
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
        rows = None
        if meta:
            with open(folder / META, encoding="utf-8") as fh:
                rows = [json.loads(line) for line in fh if line.strip()]
        has_text = text and info.get("text_count") is not None
        return {
            "image": np.load(folder / IMAGE, mmap_mode=mode, allow_pickle=False),
            "text": np.load(folder / TEXT, mmap_mode=mode, allow_pickle=False) if has_text else None,
            "text_rows": np.load(folder / TEXT_ROWS, allow_pickle=False) if has_text else None,
            "meta": rows,
            "info": info,
        }
    except (OSError, UnicodeDecodeError, ValueError, EOFError) as err:  # json.JSONDecodeError is a ValueError
        raise UserError(
            f"{folder} is damaged ({first_line(err, limit=None)}); run `triclip embed`"
            " again with the same options to recompute it"
        ) from None


def summarize(emb: str | os.PathLike) -> dict:
    """Counts over the finished shards of a folder."""
    manifest = read_manifest(emb)
    infos = [json.loads((Path(emb) / shard_name(s) / SHARD_INFO).read_text()) for s in finished_shards(emb)]
    skipped = Counter(manifest.get("skipped", {}))
    for info in infos:
        skipped.update(info.get("skipped", {}))
    text_counts = [i["text_count"] for i in infos if i.get("text_count") is not None]
    return {
        "embeddings": str(Path(emb).absolute()),
        "shards": manifest["num_shards"],
        "finished": len(infos),
        "count": sum(i["count"] for i in infos),
        "text_count": sum(text_counts) if manifest.get("text") else None,
        "dim": manifest["dim"],
        "dtype": manifest["dtype"],
        "fingerprint": manifest["fingerprint"],
        "skipped": dict(skipped),
    }


# ---------------------------------------------------------------------------- setup


def check_embed(cfg: EmbedConfig) -> None:
    """UserError (one line) for settings ``embed`` cannot use, found without torch or data: bounds, the
    dtype and device named, the run and the data being there."""
    from triclip.data.config import check_data
    from triclip.model.runfile import read_config

    check_fields(cfg)
    check_device(cfg.device)
    if cfg.dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    read_config(cfg.run)  # UserError: not a run
    check_data(cfg.data, "--data")


def _validate(cfg: EmbedConfig) -> None:
    check_embed(cfg)
    claim_output_dir(cfg.out, "embeddings", overwrite=cfg.overwrite, reuse=True)  # a re-run resumes its own


def init_distributed() -> tuple[int, int, bool]:
    """``(rank, world, owned)``: joins torchrun's process group when ``WORLD_SIZE`` > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, False
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size(), True


def on_rank0(world: int, rank: int, fn, *args) -> None:
    """Run ``fn(*args)`` on rank 0 while the others wait; a UserError there is raised on every rank."""
    error = None
    if rank == 0:
        try:
            fn(*args)
        except UserError as err:
            error = str(err)
    if world > 1:
        import torch.distributed as dist

        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise EveryRankError(error)


class EveryRankError(UserError):
    """A UserError that every rank raises at the same point (:func:`on_rank0`; see :func:`leave_group`)."""


def leave_group(together: bool) -> None:
    """Destroy the process group; first wait for every rank when they all got here together.

    Without the wait, a rank that leaves right after a broadcast can tear down gloo's
    connections while a peer still reads from them, and the process aborts
    ("terminate called without an active exception"). A rank that fails alone must not
    wait: the others would never arrive.
    """
    import torch.distributed as dist

    if together:
        dist.barrier()
    dist.destroy_process_group()


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _device(name: str | None):
    import torch

    from triclip.model.embed import pick_device

    if name is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())  # this rank's GPU (set in init_distributed)
    return pick_device(name)


def _workers(workers: int | None, device) -> int:
    if workers is not None:
        return workers
    if device.type != "cuda":
        return 0  # the CPU is busy with the model already
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(8, (os.cpu_count() or 1) // local_ranks))


def _prepare_folder(cfg, out: Path, model, run_config, fingerprint, pairs: PairSet, num_shards, device, cache) -> None:
    """Rank 0: check a folder being resumed, or write the manifest of a new one."""
    from triclip.compact.features import make_transform
    from triclip.data import PairSet

    for leftover in out.glob(".shard-*.tmp-*"):  # a killed run's half-written shards
        shutil.rmtree(leftover, ignore_errors=True)
    if cfg.overwrite and (out / MANIFEST).is_file():  # claim_output_dir made sure it holds embeddings
        (out / MANIFEST).unlink()
        for old_shard in out.glob("shard-*"):
            shutil.rmtree(old_shard)
    if (out / MANIFEST).is_file():
        old = read_manifest(out)
        mine = {"fingerprint": fingerprint, "data_fingerprint": pairs.fingerprint, "shard_size": cfg.shard_size,
                "dtype": cfg.dtype, "text": cfg.text}
        for key, value in mine.items():
            if old.get(key) != value:
                raise UserError(
                    f"{out} holds embeddings with {key}={old.get(key)!r}, not {value!r}; use a new --out, or"
                    " --overwrite to start over"
                )
        return
    # the source's skips ride along: the message when no anchor decodes names every reason
    anchors = PairSet(pairs.records[: cfg.anchor_rows], Counter(pairs.skipped), pairs.source, pairs.max_pixels)
    anchor_emb = embed_pairs(model, anchors, device, 64, cache_rows(cache, 0, len(anchors.records))).image  # (a, D)
    dim = int(anchor_emb.shape[1])
    importance = model.importance().detach().float().cpu()  # (D,)
    transform = make_transform("importance", dim, dim, importance).with_signs_from(anchor_emb)
    data = os.path.abspath(cfg.data) if os.path.exists(cfg.data) else cfg.data
    write_json_atomic(out / MANIFEST, {
        "format": FORMAT,
        "run": os.path.abspath(cfg.run),
        "fingerprint": fingerprint,
        "model": run_config.get("model"),
        "data": data,
        "data_fingerprint": pairs.fingerprint,
        "records": len(pairs.records),
        "shard_size": cfg.shard_size,
        "num_shards": num_shards,
        "dim": dim,
        "dtype": cfg.dtype,
        "text": cfg.text,
        "importance": importance[transform.keep].tolist(),  # w in index order (descending)
        "transform": transform.to_dict(),
        "anchor_rows": cfg.anchor_rows,
        "skipped": dict(pairs.skipped),  # records the source reader left out
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    })


# ---------------------------------------------------------------------------- one shard


def _write_shard(out: Path, s: int, pairs: PairSet, cfg, model, transform, device, batch: int, workers: int, rank, cache):
    """Embed records of shard ``s`` and rename the finished folder into place."""
    import torch

    from triclip.data import PairSet

    started = time.perf_counter()
    lo, hi = s * cfg.shard_size, min(len(pairs.records), (s + 1) * cfg.shard_size)
    part = PairSet(pairs.records[lo:hi], Counter(), pairs.source, pairs.max_pixels)
    try:
        part_cache = cache_rows(cache, lo, hi)
        if part_cache["image"] is not None and not part_cache["image"]["valid"].any():
            raise UserError("no image of this shard decodes")
        emb = embed_pairs(model, part, device, batch, part_cache, workers)
        image, text, text_to_image, keep, skipped = emb
    except UserError:  # no image of this shard decodes: an empty shard, counted
        image, text, text_to_image = torch.zeros(0, transform.dim), torch.zeros(0, transform.dim), torch.zeros(0)
        keep, skipped = torch.zeros(0, dtype=torch.long), Counter(_shard_reasons(part))
    records = [part.records[i] for i in keep.tolist()]
    caption_no = [c for r in records for c in range(len(r.captions))]
    text_rows = np.stack([text_to_image.long().numpy(), np.array(caption_no, dtype=np.int64)], 1).reshape(-1, 2)
    tmp = temp_dir(out, prefix=f".{shard_name(s)}.tmp-")  # the umask's mode, not mkdtemp's 0700
    try:
        with write_errors(out / shard_name(s)):
            np.save(tmp / IMAGE, transform(image).numpy().astype(cfg.dtype))  # (n, D)
            if cfg.text:
                np.save(tmp / TEXT, transform(text).numpy().astype(cfg.dtype))  # (T, D)
                np.save(tmp / TEXT_ROWS, text_rows.astype(np.int64))  # (T, 2)
            with open(tmp / META, "w", encoding="utf-8") as fh:
                for r in records:
                    row = {"id": r.key, "image": r.path, "captions": list(r.captions), "label": r.label}
                    fh.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
            info = {
                "shard": s,
                "records": [lo, hi],
                "count": len(records),
                "text_count": len(caption_no) if cfg.text else None,
                "skipped": dict(skipped),
                "rank": rank,
                "seconds": round(time.perf_counter() - started, 2),
            }
            info["files"] = {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in sorted(tmp.iterdir())}
            (tmp / SHARD_INFO).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
            if (out / shard_name(s)).exists():  # a folder without shard.json: not ours to keep
                shutil.rmtree(out / shard_name(s))
            os.replace(tmp, out / shard_name(s))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cache_rows(cache: dict, lo: int, hi: int) -> dict:
    """The locked-tower cache entries of records ``lo:hi`` (``triclip.model.cache`` layout, offsets re-based)."""
    out = {"image": None, "text": None}
    if cache.get("image") is not None:
        out["image"] = {k: v[lo:hi] for k, v in cache["image"].items()}  # features (n, F), valid, bad
    if cache.get("text") is not None:
        offsets = cache["text"]["offsets"]  # (N + 1,)
        first, last = int(offsets[lo]), int(offsets[hi])
        out["text"] = {"features": cache["text"]["features"][first:last], "offsets": offsets[lo : hi + 1] - first}
    return out


def embed_pairs(*args, **kwargs):
    """:func:`triclip.model.embed.embed_pairs`, imported on first use (a module attribute: tests count calls)."""
    from triclip.model.embed import embed_pairs as embed

    return embed(*args, **kwargs)


def _shard_reasons(part: PairSet) -> Counter:
    """Why each image of a shard with no decodable image failed."""
    from triclip.data import BadRecord

    reasons: Counter = Counter()
    for r in part.records:
        try:
            r.open_image(part.max_pixels)
        except BadRecord as bad:
            reasons[bad.reason] += 1
    return reasons
