"""Search a collection that ``triclip index export`` wrote: the :class:`triclip.index.search.Searcher` interface.

    s = open_searcher("/data/triclip.db")                    # Milvus Lite; a folder path: a local index
    s = open_searcher("http://host:19530", collection="triclip")
    s.search_text(["a red circle"], k=10)                     # the same hits as Searcher: id, image, caption, score

Queries are embedded by the run the collection records (its folder and fingerprint: a missing run
or another fingerprint is refused with one line) and go through the compact transform stored with
the collection, then the re-normalised top-m prefix is searched in Milvus with the index and
parameters the export chose. A collection holds one m and one index: there is no funnel, no
``bytes`` and no re-scoring here (each is refused with one line). A hit also carries its ``row``.

For the app (``triclip.app.live``): :meth:`MilvusSearcher.view_parts` gives the image paths and file
identities by row and the id -> row map, each looked up in Milvus when asked (an index of a
billion rows is never read whole), and the curves stored with the collection.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from triclip.core.errors import UserError
from triclip.index import milvus as mv
from triclip.index.search import TARGETS, Searcher, _check_k
from triclip.index.store import IndexContents
from triclip.index.vectors import prefix

CACHE_ROWS = 4096  # rows whose path / file identity / id are kept after a lookup


def open_searcher(index: str, run=None, device: str | None = None, text_only: bool = False,
                  collection: str | None = None, timeout: float = 10.0):
    """A searcher over a Milvus URI (``PATH.db``, ``http://...``) or over a local index folder."""
    if mv.is_milvus_uri(index):
        return MilvusSearcher.open(index, collection, run=run, device=device, text_only=text_only, timeout=timeout)
    if collection is not None:
        raise UserError("--collection goes with a Milvus --index (PATH.db or http://HOST:19530), not an index folder")
    return Searcher.load(index, run=run, device=device, text_only=text_only)


@dataclass
class MilvusSearcher(Searcher):
    """A run's query side over an exported collection (build with :meth:`open`)."""

    client: Any = None  # pymilvus.MilvusClient
    uri: str = ""  # where the collection is
    collection: str = ""  # the image collection
    captions: str | None = None  # the caption collection, None when the export had none
    props: dict = field(default_factory=dict)  # the collection's triclip properties
    plans: list = field(default_factory=list)  # [image plan, caption plan] (milvus_export.Plan as dicts)
    lite: bool = False  # the server is Milvus Lite
    _row_cache: OrderedDict = field(default_factory=OrderedDict, repr=False)  # row -> (image, file)
    _id_cache: OrderedDict = field(default_factory=OrderedDict, repr=False)  # id -> row
    _cache_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # the app's threads share the caches

    remote = True  # the app reads rows through view_parts, not from contents.meta

    @classmethod
    def open(cls, uri: str, collection: str | None = None, run=None, device: str | None = None,
             text_only: bool = False, timeout: float = 10.0) -> "MilvusSearcher":
        """Connect, read the collection's record, load the run's query side.

        Raises:
            UserError: Milvus cannot be reached, no such collection, an export that did not finish, the run is
                missing or is not the one the collection records.
        """
        t0 = time.perf_counter()
        if not uri.startswith(mv.SERVER_SCHEMES) and not os.path.isdir(uri):  # searching makes no Lite file
            raise UserError(f"{uri}: no such Milvus Lite file (triclip index export --to {uri} writes one)")
        client = mv.connect(uri, timeout)
        try:
            name = mv.find_collection(client, uri, collection)
            props = mv.read_properties(client, name) or {}
            manifest, plans = _manifest(props, uri, name)
            captions = mv.captions_name(name) if len(plans) > 1 and client.has_collection(mv.captions_name(name)) else None
            for loaded in [name] + ([captions] if captions else []):
                _call(uri, client.load_collection, loaded)  # a Lite file reopens released; a server: no-op when loaded
            contents = IndexContents(manifest, [], np.zeros((0, int(manifest["dim"])), np.float32), {},
                                     version=props.get("version"))
            index_load = time.perf_counter() - t0
            searcher = cls.over(contents, f"{uri} (collection {name})", run, device, text_only, client=client, uri=uri,
                                collection=name, captions=captions, props=props, plans=plans,
                                lite=mv.is_lite(client))
        except BaseException:
            mv.close(client)
            raise
        searcher.timings["index_load"] = index_load
        return searcher

    def close(self) -> None:
        mv.close(self.client)

    # -- what the collection holds

    @property
    def m(self) -> int:
        return int(self.plans[0]["m"])

    @property
    def dims(self) -> list[int]:
        return [self.m]

    @property
    def has_text(self) -> bool:
        return self.captions is not None

    @property
    def budgets(self) -> list[int]:
        return []

    @property
    def text_budgets(self) -> list[int]:
        return []

    def __len__(self) -> int:
        return int(self.props.get("count") or 0)

    @property
    def served_from(self) -> str:
        """Where the hits come from, for people: the Milvus kind, the URI, the collection and its index."""
        kind = "Milvus Lite" if self.lite else "Milvus"
        budget = f", {self.props['bytes']} B budget" if self.props.get("bytes") else ""
        return f"{kind} {self.uri}, collection {self.collection} ({self.plans[0]['index_type']}, m = {self.m}{budget})"

    # -- searching

    def search_vectors(self, queries: np.ndarray, k: int = 10, m: int | None = None, target: str = "image",
                       funnel: int | None = None, *, bytes: int | None = None, rescore=None) -> list[list[dict]]:
        """Top-k hits for full-D compact query vectors (Q, D), searched at the collection's m."""
        k = self._check(k, m, target, funnel, bytes, rescore)
        queries = np.asarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise UserError(f"query vectors must have shape (Q, {self.dim}), got {queries.shape}")
        if len(queries) == 0:
            return []
        plan = self.plans[0] if target == "image" else self.plans[-1]  # captions may keep another m (their budget's)
        return self._search(prefix(queries, int(plan["m"])), k, target)

    def search_ids(self, ids, k: int = 10, m: int | None = None, target: str = "image", funnel: int | None = None,
                   *, bytes: int | None = None, rescore=None):
        """Top-k hits for images of the collection, by id (their stored vectors at m)."""
        k = self._check(k, m, target, funnel, bytes, rescore)
        if isinstance(ids, str) or not isinstance(ids, Sequence):
            raise UserError("search_ids expects a list of ids")
        if int(self.plans[-1]["m"]) != self.m and target == "text":
            raise UserError(f"the captions are kept at m = {self.plans[-1]['m']}, the images at {self.m}: search"
                            " captions by text or by an image, not by an image's stored vector")
        found = {row["id"]: row["vector"] for row in self._call(
            self.client.query, self.collection, filter=f"id in {json.dumps(list(ids))}", output_fields=["id", "vector"])}
        for rid in ids:
            if rid not in found:
                raise UserError(f"unknown id {rid!r}: no indexed image has it")
        return self._search(np.asarray([found[rid] for rid in ids], np.float32), k, target)

    def vectors_of(self, ids, target: str = "image") -> np.ndarray:
        raise UserError("a Milvus collection keeps the vectors at m only: search by id with search_ids")

    def _check(self, k, m, target, funnel, bytes, rescore) -> int:
        k = _check_k(k)
        if target not in TARGETS:
            raise UserError(f"unknown search target {target!r}; choose from {list(TARGETS)}")
        if target == "text" and not self.has_text:
            raise UserError("this collection has no caption vectors (exported without captions)")
        if funnel is not None or bytes is not None or rescore is not None:
            raise UserError(f"a Milvus collection holds one index ({self.plans[0]['index_type']} at m = {self.m}):"
                            " no --funnel, --bytes or --rescore")
        if m is not None and m not in (self.m, self.dim):
            raise UserError(f"m={m!r} is not in this collection; it holds m = {self.m}")
        return k

    def _search(self, queries: np.ndarray, k: int, target: str) -> list[list[dict]]:
        image = target == "image"
        name, plan = (self.collection, self.plans[0]) if image else (self.captions, self.plans[-1])
        fields = ["id", "image", "captions"] if image else ["id", "image_row", "caption"]
        answer = self._call(self.client.search, name, data=queries.tolist(), limit=k, anns_field="vector",
                            search_params={"metric_type": "IP", "params": dict(plan["search"])}, output_fields=fields)
        paths = {} if image else self._paths({h["entity"]["image_row"] for hits in answer for h in hits})
        out = []
        for hits in answer:
            found = []
            for hit in hits:
                e = hit["entity"]
                row = int(hit["row"]) if "row" in hit else int(e.get("row", -1))  # the primary key
                if image:
                    captions = json.loads(e.get("captions") or "[]")
                    found.append({"id": e["id"], "image": e["image"], "caption": captions[0] if captions else "",
                                  "score": float(hit["distance"]), "row": row})
                    self._remember(e["id"], row)
                else:
                    found.append({"id": e["id"], "image": paths.get(e["image_row"], ""), "caption": e["caption"],
                                  "score": float(hit["distance"]), "row": int(e["image_row"])})
                    self._remember(e["id"], int(e["image_row"]))
            out.append(found)
        return out

    def _paths(self, rows: set) -> dict:
        if not rows:
            return {}
        got = self._call(self.client.query, self.collection, ids=sorted(rows), output_fields=["row", "image"])
        return {r["row"]: r["image"] for r in got}

    def _call(self, fn, *args, **kwargs):
        return _call(self.uri, fn, *args, **kwargs)

    def _remember(self, image_id: str, row: int) -> None:
        with self._cache_lock:
            self._id_cache[image_id] = row
            self._id_cache.move_to_end(image_id)
            while len(self._id_cache) > CACHE_ROWS:
                self._id_cache.popitem(last=False)

    # -- for the app

    def view_parts(self) -> tuple:
        """``(paths, identities, rows, curves)``: row -> image path, row -> (dev, ino, size, mtime_ns) or None,
        id -> row (each looked up in Milvus on first use), and the curves stored with the collection."""
        return _RowField(self, "image"), _RowField(self, "file"), _IdRows(self), self.curves

    @property
    def curves(self) -> dict | None:
        try:
            return mv.decode_blob(self.props, "curves")
        except UserError:
            return None

    def row(self, row: int) -> tuple[str, tuple | None] | None:
        """``(image path, file identity)`` of an image row, or None when the collection has no such row."""
        with self._cache_lock:
            if row in self._row_cache:
                return self._row_cache[row]
        got = self._call(self.client.query, self.collection, ids=[int(row)], output_fields=["row", "image", "file"])
        if not got:
            return None
        ident = json.loads(got[0].get("file") or "null")
        ok = isinstance(ident, list) and len(ident) == 4 and all(isinstance(x, int) for x in ident)
        path = got[0]["image"]
        if os.path.isabs(path):
            folder, name = os.path.split(path)
            path = os.path.join(os.path.realpath(folder), name)
        value = (path if os.path.isabs(path) else "", tuple(ident) if ok else None)
        with self._cache_lock:
            self._row_cache[row] = value
            while len(self._row_cache) > CACHE_ROWS:
                self._row_cache.popitem(last=False)
        return value

    def row_of(self, image_id: str) -> int | None:
        with self._cache_lock:
            if image_id in self._id_cache:
                return self._id_cache[image_id]
        got = self._call(self.client.query, self.collection, filter=f"id == {json.dumps(image_id)}", output_fields=["row"])
        if not got:
            return None
        self._remember(image_id, int(got[0]["row"]))
        return int(got[0]["row"])


class _RowField(Sequence):
    """Row -> one field of the image collection (the path, or the file identity), looked up when asked."""

    def __init__(self, searcher: MilvusSearcher, which: str):
        self.searcher, self.which = searcher, which

    def __len__(self) -> int:
        return len(self.searcher)

    def __getitem__(self, row):
        found = self.searcher.row(int(row))
        if found is None:
            return "" if self.which == "image" else None
        return found[0] if self.which == "image" else found[1]


class _IdRows(Mapping):
    """Image id -> row (hits fill it; others are looked up)."""

    def __init__(self, searcher: MilvusSearcher):
        self.searcher = searcher

    def __getitem__(self, image_id: str) -> int:
        row = self.searcher.row_of(image_id)
        if row is None:
            raise KeyError(image_id)
        return row

    def __iter__(self):
        return iter(self.searcher._id_cache)

    def __len__(self) -> int:
        return len(self.searcher)


def _call(uri: str, fn, *args, **kwargs):
    """``fn(...)`` with pymilvus' and grpc's errors as one line."""
    try:
        return fn(*args, **kwargs)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 (pymilvus' and grpc's errors)
        raise UserError(f"Milvus at {uri} failed: {mv.milvus_message(err)}") from None


def _manifest(props: dict, uri: str, name: str) -> tuple[dict, list[dict]]:
    """The manifest a Searcher reads (the transform the queries go through, the panels' entries), and the plans."""
    if props.get("format") != mv.FORMAT:
        raise UserError(f"collection {name!r} at {uri} has triclip format {props.get('format')!r}, this triclip reads"
                        f" {mv.FORMAT}; export it again")
    if not props.get("complete") or props.get("complete") != props.get("manifest"):
        raise UserError(f"collection {name!r} at {uri} is not complete (its export stopped at row {props.get('done', 0)}"
                        f" of {props.get('count')}); run triclip index export again to finish it")
    manifest = mv.decode_blob(props, "manifest")
    manifest["transform"] = mv.decode_blob(props, "transform")
    try:
        plans = json.loads(props["plan"])
        m = int(plans[0]["m"])
    except (KeyError, ValueError, TypeError, IndexError):
        raise UserError(f"collection {name!r} at {uri}: its record of the Milvus index is damaged; export it again") from None
    recall = (manifest.get("recall") or {}).get(str(m)) if not props.get("bytes") else None
    manifest.update(dims=[m], budgets={}, recall={str(m): recall} if recall is not None else {}, nprobe={}, text_nprobe={})
    return manifest, plans
