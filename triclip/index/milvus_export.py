"""``triclip index export``: the live version of an index folder into Milvus, resumable, in bounded memory.

    summary = export(ExportConfig(index="INDEX", to="/data/triclip.db"))           # Milvus Lite
    summary = export(ExportConfig(index="INDEX", to="http://host:19530", bytes=16)) # a server, 16-byte codes

The float vectors are read memory-mapped from the version folder and sent ``chunk`` rows at a
time (their re-normalised top-m prefix, ``triclip.index.vectors.prefix``), captions with the
images they belong to; rows are upserted by their row number, so a chunk sent twice changes
nothing. After each chunk the image collection's watermark (``triclip.done``) moves to the rows
written so far, with a hash of their ids: a rerun after a kill continues from there, and after
``index build --add`` only the new rows are sent (the version must extend the one exported: same
run, transform and first rows). The Milvus index is built once the rows are in, then the
collection is loaded and its counts checked against the manifest (one line when they differ).

The Milvus index follows the budget (:data:`INDEX_FOR_CODEC`; docs/scale_out.md). Milvus has no
OPQ, RQ or per-dimension bit allocation, and Milvus Lite has no IVF_PQ, IVF_RABITQ or binary
vectors: the index used instead is recorded and reported (``index_type``, ``note``).

Read only on the index folder: no lock is taken and nothing is written there. The files of the
version are opened once at the start, so a writer replacing the version meanwhile does not
change what is exported.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import numpy as np

from triclip.core.errors import UserError
from triclip.core.progress import progress
from triclip.index import filecheck
from triclip.index import milvus as mv
from triclip.index.config import ExportConfig
from triclip.index.store import MANIFEST, META, TEXT_ROWS, TEXT_VECTORS, VECTORS, read_live
from triclip.index.versions import VERSION_RE
from triclip.index.vectors import SQ8Rows, prefix, sq8_ranges

INDEX_FOR_CODEC = {  # the code of a budget -> (the Milvus index on a server, on Milvus Lite), same m
    "float32": ("HNSW", "FLAT"),  # float top-m
    "int8": ("IVF_SQ8", "IVF_SQ8"),  # one byte per dimension either way
    "binary": ("IVF_RABITQ", "IVF_SQ8"),  # 1 bit per dimension (RaBitQ: rotated, with a re-rank); Lite: 8 bits
    "pq": ("IVF_PQ", "IVF_SQ8"),  # same sub-quantisers and bits on a server; Lite has no IVF_PQ
    "opq": ("IVF_PQ", "IVF_SQ8"),  # Milvus has no OPQ rotation: PQ of the same size
    "rq": ("IVF_PQ", "IVF_SQ8"),  # Milvus has no residual quantiser: PQ of the same size
    "mixed": ("IVF_SQ8", "IVF_SQ8"),  # no per-dimension bits in Milvus: 8 bits everywhere
}
NO_BUDGET = ("HNSW", "FLAT")  # no --bytes: the float vectors at D
HNSW_PARAMS = {"M": 16, "efConstruction": 200}
LOAD_TRIES = 3  # Milvus Lite may still be writing a segment's index file when the collection loads


@dataclass
class Plan:
    """How one collection's vectors go into Milvus."""

    m: int  # dimensions stored: the budget's code's m, or D
    index_type: str  # the Milvus index
    params: dict  # its build parameters
    search: dict  # its search parameters (triclip search passes them)
    code: str | None = None  # the local code it stands for (CodecSpec.label), None without a budget
    bytes_per_vector: int = 0  # what the Milvus index keeps per vector (codes, without ids or graph links)

    def to_json(self) -> dict:
        return {"m": self.m, "index_type": self.index_type, "params": self.params, "search": self.search,
                "code": self.code, "bytes_per_vector": self.bytes_per_vector}


@dataclass
class Source:
    """The live version of an index folder, opened read-only (every file at once)."""

    root: Path
    version: str
    manifest: dict
    manifest_sha: str  # sha256 of manifest.json's bytes
    vectors: "Rows"  # (N, D) float32, read chunk by chunk
    meta_file: object  # meta.jsonl, open
    text_vectors: "Rows | None" = None  # (T, D) float32, read chunk by chunk; None without captions
    text_rows: np.ndarray | None = None  # (T, 2) int64 (image row, caption no.), memory-mapped
    files: list = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.vectors)

    @property
    def text_count(self) -> int:
        return 0 if self.text_vectors is None else len(self.text_vectors)

    @property
    def fingerprint(self) -> str:
        """The version and its manifest, as the collection records them."""
        return f"{self.version}:{self.manifest_sha[:16]}"


def export(cfg: ExportConfig) -> dict:
    """Export (or bring up to date) ``cfg.index``'s live version into ``cfg.to``; returns a JSON-able summary."""
    started = time.perf_counter()
    _check(cfg)
    src = open_source(cfg.index)
    client = mv.connect(cfg.to, cfg.timeout)
    try:
        lite = mv.is_lite(client)
        plans = plan(src, cfg, lite)
        names = [cfg.collection] + ([mv.captions_name(cfg.collection)] if cfg.text and src.text_count else [])
        start, plans = prepare(client, src, names, plans, cfg)
        written = write_rows(client, src, names, plans, cfg, start, lite)
        finish(client, src, names, plans, 1 if lite else cfg.replicas)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 (pymilvus' and grpc's errors, Milvus Lite's own)
        raise UserError(f"Milvus at {cfg.to} failed: {mv.milvus_message(err)}; run the export again to resume") from None
    finally:
        mv.close(client)
    image_plan = plans[0]
    return {
        "to": cfg.to, "collection": cfg.collection, "captions": names[1] if len(names) > 1 else None,
        "index": str(src.root), "version": src.version, "count": src.count,
        "text_count": src.text_count if len(names) > 1 else None, "resumed_from": start, **written,
        "m": image_plan.m, "index_type": image_plan.index_type, "params": image_plan.params, "code": image_plan.code,
        "note": substitute_note(image_plan, lite), "seconds": round(time.perf_counter() - started, 2),
    }


def _check(cfg: ExportConfig) -> None:
    mv.check_collection_name(cfg.collection)
    if cfg.chunk < 1:
        raise UserError(f"--chunk must be >= 1, got {cfg.chunk}")
    for name in ("nlist", "nprobe"):
        value = getattr(cfg, name)
        if value is not None and not 1 <= value <= 65536:
            raise UserError(f"--{name} must be from 1 to 65536, got {value}")
    if cfg.shards is not None and not 1 <= cfg.shards <= 64:
        raise UserError(f"--shards must be from 1 to 64, got {cfg.shards}")
    if not 1 <= cfg.replicas <= 64:
        raise UserError(f"--replicas must be from 1 to 64, got {cfg.replicas}")
    if not cfg.timeout > 0:
        raise UserError(f"--timeout must be positive, got {cfg.timeout}")


# ---------------------------------------------------------------------------- the source, read only


def open_source(index: str) -> Source:
    """The live version of ``index`` with its files open; UserError when there is none or a part is damaged."""
    return read_live(index, lambda folder: _open_version(folder.parent, folder.name))[1]


def _open_version(root: Path, version: str) -> Source:
    folder = root / version
    raw = (folder / MANIFEST).read_bytes()
    damaged = lambda what: UserError(f"index {folder} is damaged: {what}; rebuild it with triclip index build")  # noqa: E731
    try:
        manifest = json.loads(raw)
        count, dim, text_count = int(manifest["count"]), int(manifest["dim"]), manifest.get("text_count")
        manifest["transform"]["dim"], manifest["fingerprint"]  # noqa: B018 (present)
    except (ValueError, KeyError, TypeError) as err:
        raise damaged(f"{MANIFEST} is unreadable ({err})") from None
    records = filecheck.check_records(manifest.get(filecheck.FILES), folder, damaged)
    for name in (VECTORS, META) + ((TEXT_VECTORS, TEXT_ROWS) if text_count is not None else ()):
        why = filecheck.check_file(folder / name, folder, records)  # what the manifest vouches for is exported
        if why is not None:
            raise filecheck.refused(folder, why)
    vectors = _mapped(folder / VECTORS, (count, dim), damaged, _ranges(manifest, "image", dim, damaged))
    meta_file = open(folder / META, encoding="utf-8")  # noqa: SIM115 (kept open for the export)
    src = Source(root, version, manifest, hashlib.sha256(raw).hexdigest(), vectors, meta_file)
    if text_count is not None:
        src.text_vectors = _mapped(folder / TEXT_VECTORS, (int(text_count), dim), damaged,
                                   _ranges(manifest, "text", dim, damaged))
        rows = np.load(folder / TEXT_ROWS, mmap_mode="r", allow_pickle=False)
        if rows.shape != (int(text_count), 2):
            raise damaged(f"{TEXT_ROWS} holds {rows.shape}, expected ({text_count}, 2)")
        src.text_rows = rows
    return src


def _ranges(manifest: dict, kind: str, dim: int, damaged) -> np.ndarray | None:
    """The sq8 ranges of the ``kind`` vectors (``index build --vectors sq8``), None for float vectors."""
    if manifest.get("vectors_dtype") != "sq8":
        return None
    try:
        return sq8_ranges(manifest.get("vectors_sq8"), kind, dim)  # (2 * D,)
    except ValueError as err:
        raise damaged(f"{MANIFEST}'s {err}") from None


def _mapped(file: Path, shape: tuple, damaged, ranges: np.ndarray | None = None) -> "Rows | SQ8Rows":
    try:
        arr = np.load(file, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError) as err:
        raise damaged(f"cannot read {file.name} ({err})") from None
    wanted = (np.uint8,) if ranges is not None else (np.float32, np.float16)
    if arr.dtype not in wanted or arr.shape != shape or not arr.flags.c_contiguous:
        names = "sq8 (uint8)" if ranges is not None else "float32 or float16"
        raise damaged(f"{file.name} holds {arr.dtype} {arr.shape}, expected {names} {shape}")
    rows = Rows(open(file, "rb"), arr.offset, shape, arr.dtype)  # noqa: SIM115 (kept open for the export)
    if ranges is None:
        return rows
    try:
        return SQ8Rows(rows, ranges)
    except ValueError as err:
        raise damaged(f"{MANIFEST}'s vectors_sq8: {err}") from None


class Rows:
    """Rows of a float32 (or float16) ``.npy`` matrix read on demand with ``pread`` as float32, or of sq8 codes as
    uint8 (decoded by :class:`~triclip.index.vectors.SQ8Rows`): unlike a memory map, the rows read do not stay
    resident in this process, so its memory follows the chunk, not the file."""

    def __init__(self, fh, offset: int, shape: tuple, dtype=np.float32):
        self.fh, self.offset, self.shape, self.dtype = fh, offset, shape, np.dtype(dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, _ = rows.indices(self.shape[0])
        width = self.shape[1] * self.dtype.itemsize
        data = os.pread(self.fh.fileno(), max(0, stop - start) * width, self.offset + start * width)
        if len(data) != max(0, stop - start) * width:
            raise UserError(f"{self.fh.name} is truncated; rebuild the index")
        rows = np.frombuffer(data, self.dtype).reshape(-1, self.shape[1])  # (stop - start, D)
        return rows if self.dtype == np.uint8 else rows.astype(np.float32, copy=False)  # codes stay codes (SQ8Rows)


# ---------------------------------------------------------------------------- the Milvus index per budget


def plan(src: Source, cfg: ExportConfig, lite: bool) -> list[Plan]:
    """The image collection's plan, then the captions' (the budget's caption code, else the images')."""
    from triclip.codecs import CodecSpec

    dim = int(src.manifest["dim"])
    if cfg.bytes is None:
        specs = [None, None]
    else:
        budgets = src.manifest.get("budgets") or {}
        entry = budgets.get(str(cfg.bytes))
        if entry is None:
            built = sorted(int(b) for b in budgets) or "none (index build --bytes builds some)"
            raise UserError(f"--bytes {cfg.bytes}: the index has no codes of that many bytes; choose from {built}")
        text = entry.get("text") or entry
        specs = [CodecSpec.from_json(entry["spec"]), CodecSpec.from_json(text["spec"])]
    return [_plan_one(spec, dim, count, cfg, lite) for spec, count in zip(specs, (src.count, src.text_count))]


def _plan_one(spec, dim: int, count: int, cfg: ExportConfig, lite: bool) -> Plan:
    server, on_lite = NO_BUDGET if spec is None else INDEX_FOR_CODEC[spec.codec]
    index_type = on_lite if lite else server
    m = dim if spec is None else spec.m
    nlist = cfg.nlist or max(1, min(65536, int(4 * math.sqrt(max(count, 1)))))
    nprobe = min(nlist, cfg.nprobe or max(16, nlist // 4))
    params, search, size = {}, {}, 4 * m
    if index_type == "HNSW":
        params, search = dict(HNSW_PARAMS), {"ef": 128}
    elif index_type != "FLAT":
        params, search = {"nlist": nlist}, {"nprobe": nprobe}
        size = m
        if index_type == "IVF_PQ":
            sub, nbits = int(spec.params.get("M", spec.bytes_per_vector)), int(spec.params.get("nbits", 8))
            if m % sub:
                raise UserError(f"IVF_PQ needs m ({m}) to be a multiple of its sub-quantisers ({sub})")
            params.update(m=sub, nbits=nbits)
            size = sub * nbits // 8
        elif index_type == "IVF_RABITQ":
            size = m // 8 + 8  # one bit per dimension and its corrections
            search["refine_k"] = 2
    return Plan(m, index_type, params, search, None if spec is None else spec.label(), size)


def substitute_note(p: Plan, lite: bool) -> str | None:
    """What the Milvus index stands in for, when it is not the local code itself."""
    if p.code is None:
        return None
    codec = p.code.split()[0].rstrip("0123456789x")
    exact = {"int8": "IVF_SQ8", "float32": "FLAT" if lite else "HNSW"}
    if exact.get(codec) == p.index_type:
        return None
    where = "Milvus Lite" if lite else "Milvus"
    return f"{where} has no index for {p.code}: {p.index_type} at m={p.m} ({p.bytes_per_vector} B per vector) stands in"


# ---------------------------------------------------------------------------- the collections and their record


def prepare(client, src: Source, names: list[str], plans: list[Plan], cfg: ExportConfig) -> tuple[int, list[Plan]]:
    """Make the collections (or check the ones there) and record this version; returns the first row to send
    and the plans in force (a collection keeps the index it was built with, its nlist included)."""
    old = mv.read_properties(client, names[0])
    if old is not None and old.get("format") is None and not cfg.overwrite:
        raise UserError(f"collection {names[0]!r} at {cfg.to} was not written by triclip index export; choose another"
                        " --collection (or --overwrite to replace it)")
    if old is not None and cfg.overwrite:
        for name in {*names, mv.captions_name(cfg.collection)}:
            if client.has_collection(name):
                client.drop_collection(name)
        old = None
    if old is None:
        for name in names:
            if name != names[0] and (mv.read_properties(client, name) or {}).get("captions_of") == names[0]:
                client.drop_collection(name)  # made by an export stopped before its image collection: ours, empty
            if client.has_collection(name):
                raise UserError(f"collection {name!r} at {cfg.to} was not written by triclip index export; choose"
                                " another --collection (or --overwrite to replace it)")
        for name, p in reversed(list(zip(names, plans))):  # the images' last, with the record: a run stopped
            # before it (a full disk) left nothing that a rerun takes for someone else's collection
            _clear_lite_leftover(client, cfg.to, name)
            own = mv.properties(record(src, plans, cfg) if name == names[0] else {"captions_of": names[0]})
            shards = {"num_shards": cfg.shards} if cfg.shards else {}
            client.create_collection(name, schema=_schema(client, p.m, caption=name != names[0]), properties=own, **shards)
        start = 0
    else:
        start, plans = resume_point(src, old, plans, cfg)
        if len(names) > 1 and not client.has_collection(names[1]):
            client.create_collection(names[1], schema=_schema(client, plans[1].m, caption=True),
                                     properties=mv.properties({"captions_of": names[0]}))
    mv.write_properties(client, names[0], record(src, plans, cfg))
    return start, plans


def _clear_lite_leftover(client, uri: str, name: str) -> None:
    """Milvus Lite 3.2 makes a collection's folder before writing its schema and leaves the folder when that
    write fails (a full disk): the name is then neither listed nor creatable. In a local ``.db`` such a folder,
    of a collection Lite does not know, is removed before the collection is made."""
    if uri.startswith(mv.SERVER_SCHEMES) or client.has_collection(name):
        return
    folder = Path(uri) / "collections" / name
    if folder.is_dir():
        shutil.rmtree(folder)


def resume_point(src: Source, old: dict, plans: list[Plan], cfg: ExportConfig) -> tuple[int, list[Plan]]:
    """The rows already in the collection that this version keeps (0 < start: send the rest) and the plans it
    was made with; UserError when the collection holds rows this version does not extend."""
    hint = f"export to another --collection, or add --overwrite to replace {cfg.collection!r}"
    m = src.manifest
    if old.get("fingerprint") != m["fingerprint"] or old.get("run") != m.get("run"):
        raise UserError(f"collection {cfg.collection!r} holds vectors of run {old.get('run')} (fingerprint"
                        f" {old.get('fingerprint')}), not of this index's run {m.get('run')} ({m['fingerprint']}); {hint}")
    if str(old.get("dim")) != str(m["dim"]) or str(old.get("m")) != str(plans[0].m):
        raise UserError(f"collection {cfg.collection!r} holds vectors of dimension {old.get('m')} (D = {old.get('dim')}),"
                        f" this export writes {plans[0].m} (D = {m['dim']}); {hint}")
    kept = _plans_of(old)
    if [(p.m, p.index_type, p.code) for p in kept] != [(p.m, p.index_type, p.code) for p in plans][: len(kept)]:
        raise UserError(f"collection {cfg.collection!r} was exported with another budget or Milvus index"
                        f" ({old.get('index_type')}, --bytes {old.get('bytes') or 'none'}); {hint}")
    if old.get("index") != str(src.root.absolute()):
        raise UserError(f"collection {cfg.collection!r} holds the rows of index {old.get('index')}, not {src.root}; {hint}")
    if _version_no(old.get("version")) > _version_no(src.version):
        raise UserError(f"collection {cfg.collection!r} holds version {old.get('version')} of {src.root}, newer than its"
                        f" live version {src.version} (rolled back?): refused; {hint}")
    done = int(old.get("done") or 0)
    if done > src.count or old.get("transform_sha") != _transform_sha(src):
        raise UserError(f"version {src.version} of {src.root} does not extend the {old.get('version')} in the collection"
                        f" (not an index build --add of it); {hint}")
    return done, kept + plans[len(kept):]


def _plans_of(old: dict) -> list[Plan]:
    try:
        return [Plan(**p) for p in json.loads(old.get("plan") or "[]")]
    except (ValueError, TypeError):
        raise UserError("the collection's record of its Milvus index is damaged; export with --overwrite") from None


def _version_no(name) -> int:
    return int(name[1:]) if isinstance(name, str) and VERSION_RE.match(name) else -1


def _transform_sha(src: Source) -> str:
    return hashlib.sha256(json.dumps(src.manifest["transform"], sort_keys=True).encode()).hexdigest()


def record(src: Source, plans: list[Plan], cfg: ExportConfig) -> dict:
    """The properties written before any row: what the rows are and how a searcher reads them."""
    from triclip.index.manifest import read_curves

    m = src.manifest
    transform = m["transform"]
    panel = {k: v for k, v in m.items() if k != "transform"}
    curves = read_curves(src.root, src.version)
    return {
        "format": mv.FORMAT, "index": str(src.root.absolute()), "version": src.version, "manifest": src.fingerprint,
        "run": m.get("run", ""), "fingerprint": m["fingerprint"], "weights": m.get("weights", "best"),
        "dim": str(m["dim"]), "m": str(plans[0].m), "count": str(src.count), "text_count": str(src.text_count),
        "bytes": "" if cfg.bytes is None else str(cfg.bytes), "code": plans[0].code or "",
        "index_type": plans[0].index_type, "metric": "IP", "plan": json.dumps([p.to_json() for p in plans]),
        "order": json.dumps(transform.get("keep")), "importance": json.dumps(m.get("importance") or []),
        "transform_sha": _transform_sha(src), "complete": "",
        **mv.encode_blob("transform", transform), **mv.encode_blob("manifest", panel), **mv.encode_blob("curves", curves),
    }


def _schema(client, m: int, caption: bool):
    from pymilvus import DataType

    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("row", DataType.INT64, is_primary=True)
    if caption:
        schema.add_field("image_row", DataType.INT64)
        schema.add_field("caption_no", DataType.INT64)
        schema.add_field("id", DataType.VARCHAR, max_length=mv.ID_CHARS)
        schema.add_field("caption", DataType.VARCHAR, max_length=mv.CAPTION_CHARS * 4)
    else:
        schema.add_field("id", DataType.VARCHAR, max_length=mv.ID_CHARS)
        schema.add_field("image", DataType.VARCHAR, max_length=mv.PATH_CHARS * 4)
        schema.add_field("captions", DataType.VARCHAR, max_length=65535)
        schema.add_field("label", DataType.VARCHAR, max_length=mv.ID_CHARS * 4)
        schema.add_field("file", DataType.VARCHAR, max_length=256)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=m)
    return schema


# ---------------------------------------------------------------------------- the rows


def write_rows(client, src: Source, names: list[str], plans: list[Plan], cfg: ExportConfig, start: int, lite: bool) -> dict:
    """Upsert rows ``start:`` chunk by chunk, moving the watermark after each; returns the rows written."""
    old = mv.read_properties(client, names[0]) or {}
    lines = iter(src.meta_file)
    ids_sha = hashlib.sha256()
    for n, line in enumerate(islice(lines, start)):  # the rows already there: their ids must be this version's
        ids_sha.update(_row(line, n)["id"].encode("utf-8") + b"\n")
    text_rows = _sorted_text_rows(src) if len(names) > 1 else None
    tstart = int(np.searchsorted(text_rows, start, "left")) if text_rows is not None else 0
    text_sha = _text_sha(src, tstart)
    if start and (ids_sha.hexdigest() != old.get("ids_sha256") or text_sha.hexdigest() != old.get("text_sha256", text_sha.hexdigest())):
        raise UserError(f"version {src.version} of {src.root} does not extend the {old.get('version')} in collection"
                        f" {names[0]!r} (its first {start} rows differ); export to another --collection, or --overwrite")
    if lite and start < src.count:
        for name in names:
            client.release_collection(name)  # Lite: no index build racing the rows below (one process serves it)
    written = {"rows_written": 0, "text_rows_written": 0}
    with progress(total=src.count - start, desc=f"export to {names[0]}", unit="image") as bar, \
            ThreadPoolExecutor(1, thread_name_prefix="triclip-export") as pool:
        for a in range(start, src.count, cfg.chunk):
            rows = [_row(line, a + i) for i, line in enumerate(islice(lines, min(cfg.chunk, src.count - a)))]
            b = a + len(rows)
            if b != min(a + cfg.chunk, src.count):
                raise UserError(f"index {src.root / src.version} is damaged: {META} has fewer rows than its manifest says")
            captions = None
            if text_rows is not None:
                t0, t1 = int(np.searchsorted(text_rows, a, "left")), int(np.searchsorted(text_rows, b, "left"))
                if t1 > t0:  # sent beside the images' request (its own thread), both done before the watermark moves
                    captions = pool.submit(client.upsert, names[1], _caption_rows(src, rows, a, t0, t1, plans[1].m))
                written["text_rows_written"] += t1 - t0
                text_sha.update(np.ascontiguousarray(src.text_rows[t0:t1]).tobytes())
            client.upsert(names[0], _image_rows(src, rows, a, plans[0].m))
            if captions is not None:
                captions.result()
            written["rows_written"] += len(rows)
            for row in rows:
                ids_sha.update(row["id"].encode("utf-8") + b"\n")
            mv.write_properties(client, names[0], {"done": str(b), "ids_sha256": ids_sha.hexdigest(),
                                                   "text_sha256": text_sha.hexdigest()})
            bar.update(len(rows))
    return written


def _row(line: str, n: int) -> dict:
    try:
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("id"), str):
            raise ValueError("not an image row")
    except ValueError as err:
        raise UserError(f"{META} line {n + 1} is damaged ({err}); rebuild the index") from None
    return row


def _sorted_text_rows(src: Source) -> np.ndarray:
    """The image row of each caption row, checked ascending (captions follow their images). Shape: (T,)."""
    rows = np.asarray(src.text_rows[:, 0])
    if len(rows) and np.any(np.diff(rows) < 0):
        raise UserError(f"index {src.root / src.version}: caption rows are not in image order; rebuild the index")
    return rows


def _text_sha(src: Source, upto: int):
    sha = hashlib.sha256()
    if src.text_rows is not None:
        for s in range(0, upto, 1 << 16):
            sha.update(np.ascontiguousarray(src.text_rows[s : min(upto, s + (1 << 16))]).tobytes())
    return sha


def _image_rows(src: Source, rows: list[dict], a: int, m: int) -> list[dict]:
    vectors = prefix(src.vectors[a : a + len(rows)], m)  # (n, m)
    out = []
    for i, (row, vector) in enumerate(zip(rows, vectors)):
        _check_length(row["id"], mv.ID_CHARS, "id", a + i)
        image = str(row.get("image") or "")
        _check_length(image, mv.PATH_CHARS, "image path", a + i)
        captions = [str(c)[: mv.CAPTION_CHARS] for c in row.get("captions") or []]
        text = json.dumps(captions, ensure_ascii=False)
        while len(text) > 65535 // 4 and captions:  # a VARCHAR's limit counts bytes (4 per character at most)
            captions.pop()
            text = json.dumps(captions, ensure_ascii=False)
        out.append({"row": a + i, "id": row["id"], "image": image, "captions": text,
                    "label": json.dumps(row.get("label"), ensure_ascii=False, default=str)[: mv.ID_CHARS],
                    "file": json.dumps(row.get("file")), "vector": vector})
    return out


def _caption_rows(src: Source, rows: list[dict], a: int, t0: int, t1: int, m: int) -> list[dict]:
    vectors = prefix(src.text_vectors[t0:t1], m)  # (t, m)
    pairs = np.asarray(src.text_rows[t0:t1])  # (t, 2)
    out = []
    for t, ((image_row, caption_no), vector) in enumerate(zip(pairs.tolist(), vectors)):
        row = rows[image_row - a]
        captions = row.get("captions") or []
        caption = str(captions[caption_no]) if 0 <= caption_no < len(captions) else ""
        out.append({"row": t0 + t, "image_row": image_row, "caption_no": caption_no, "id": row["id"],
                    "caption": caption[: mv.CAPTION_CHARS], "vector": vector})
    return out


def _check_length(text: str, limit: int, what: str, row: int) -> None:
    if len(text) > limit:
        raise UserError(f"row {row}'s {what} has {len(text)} characters; Milvus keeps at most {limit}")


# ---------------------------------------------------------------------------- the index, the load, the counts


def finish(client, src: Source, names: list[str], plans: list[Plan], replicas: int = 1) -> None:
    """Flush, build the Milvus index where there is none, load (``replicas`` copies), and check the counts against
    the manifest."""
    for name, p, want in zip(names, plans, (src.count, src.text_count)):
        client.flush(name)
        if not client.list_indexes(name):
            client.create_index(name, _index_params(client, p))
        _load(client, name, p, replicas)
        got = count_rows(client, name)
        if got != want:
            raise UserError(f"collection {name!r} holds {got} rows after the export, the index has {want};"
                            " run the export again")
    mv.write_properties(client, names[0], {"complete": src.fingerprint})


def _index_params(client, p: Plan):
    """The index request. pymilvus 3 sends each build parameter as its own key; Milvus Lite 3.2 reads them
    from one JSON-encoded ``params`` key only (and ignores the others, so nlist fell back to its 128): both
    are sent, with the same values (a server reads either)."""
    params = client.prepare_index_params()
    nested = {"params": dict(p.params)} if p.params else {}
    params.add_index("vector", index_type=p.index_type, metric_type="IP", params={**p.params, **nested})
    return params


def _load(client, name: str, p: Plan, replicas: int = 1) -> None:
    """Load ``name``; Milvus Lite may find an index file half-written (by its own background worker, or a
    killed export): then wait and try again, and at last drop the index and build it anew."""
    copies = {"replica_number": replicas} if replicas > 1 else {}
    for attempt in range(LOAD_TRIES):
        try:
            client.load_collection(name, **copies)
            return
        except Exception:  # noqa: BLE001 (Lite's message varies with what it found)
            time.sleep(0.5 * (attempt + 1))
    client.release_collection(name)
    client.drop_index(name, "vector")
    client.create_index(name, _index_params(client, p))
    client.load_collection(name)


def count_rows(client, name: str) -> int:
    """The rows of a loaded collection (``count(*)``: upserted rows counted once)."""
    answer = client.query(name, filter="", output_fields=["count(*)"], consistency_level="Strong")  # every write seen
    return int(answer[0]["count(*)"])
