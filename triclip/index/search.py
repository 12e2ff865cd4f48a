"""``triclip search`` and its Python API: load the model and the index once, answer many queries.

    s = Searcher.load("INDEX")                         # the run recorded in the manifest
    s.search_text(["a red circle", ...], k=10)          # list (per query) of hit lists, at m = D
    s.search_text(["a red circle"], k=10, m=32)         # the pruned index at m = 32
    s.search_text(["a red circle"], k=10, funnel=32)    # shortlist at m = 32, re-rank at D
    s.search_text(["a red circle"], k=10, bytes=16)     # the codes of 16 bytes per image, and the stages the build chose
    s.search_text(["a red circle"], bytes=16, rescore="none")  # ... the codes alone
    s.search_text(["a red circle"], bytes=8, rescore="float")  # shortlist by the 8-byte codes, re-rank at full D
    s.search_text(["a red circle"], bytes=8, rescore=32)       # ... or with the decoded 32-byte codes
    s.search_image(["query.png"], target="text", bytes=16)       # image -> text by the 16-byte caption codes
    s.search_image(["query.png", pil_image], k=10)      # files or PIL images
    s.search_ids(["img_0007"], k=10)                    # "more like this": an indexed image's stored vector
    Searcher.load("INDEX", text_only=True)              # text queries without torch (lite runs, once exported)

A hit is ``{"id", "image", "caption", "score"}``, best first; ``score`` is the inner
product of the compact embeddings at the m searched (cosine; at D for a funnel).
Queries are embedded once at D with the transform stored in the manifest (same
ordering, weights and signs as the index); the query at m is the re-normalised
prefix. ``target="image"`` (default) searches the image vectors (text->image,
image->image); ``target="text"`` the caption vectors (image->text, text->text) when
the index has them, and lists distinct caption strings: each once, at its best-scoring
image, with ``"images"``, how many indexed images carry it.

Re-scoring generalises the funnel: a shortlist from a small code held in memory (``bytes``), re-ranked with
a larger code or with the float vectors, which an index with codes keeps memory-mapped from disk
(``triclip.index.store``), so only the candidates' rows are read. Funnel search is the adaptive retrieval of Matryoshka Representation Learning
(Kusupati et al. 2022, https://arxiv.org/abs/2205.13147): the m-dimensional index
returns ``k * shortlist_factor`` candidates, whose full-D stored vectors are then
scored exactly.

Thread safety: many threads may search one Searcher at once. FAISS CPU searches are
const and get their ``nprobe`` / ``efSearch`` per call (``faiss.SearchParameters*``);
the model (tokenizer included) runs under a lock, as do GPU indexes.

Loading a run costs seconds (torch, transformers, both towers); a text query needs only
the text side. With ``text_only=True`` a ``lite`` run's text side comes from its ONNX
export (:mod:`triclip.model.text_onnx`, written by the first such load), and this module
imports torch only when a model is actually loaded.
"""

from __future__ import annotations

import numbers
import os
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import faiss
import numpy as np

from triclip.index import faiss_index as fi
from triclip.index.diskrows import DiskRows
from triclip.index.config import SHORTLIST_FACTOR  # noqa: F401 (re-exported)
from triclip.index.metafile import id_rows, meta_rows
from triclip.index.store import IndexContents, load_contents
from triclip.codecs.threads import in_search_thread
from triclip.index.vectors import SQ8Rows, prefix
from triclip.core.errors import UserError
from triclip.model.text_onnx import TextEncoder, cached_text_encoder, export_for_run

if TYPE_CHECKING:
    from triclip.codecs import Codec
    from triclip.compact.features import CompactTransform

TARGETS = ("image", "text")
MAX_QUERY_CHARS = 10_000  # longer text queries are refused (the text tower truncates far earlier)
MATMUL_SHORTLIST_MAX = 50_000  # funnel: Flat indexes up to this size are shortlisted by matmul, larger by FAISS
SHORTLIST_CHUNK = 64  # queries scored at once by a Flat shortlist: (q, N) scores in the CPU cache at N ~ 10k
RERANK_CHUNK = 16  # queries re-ranked at once: their (q, C, D) gather stays in the CPU cache
DISTINCT_DEPTH = 4  # image -> text: caption rows searched per distinct caption wanted (deeper where too few)


@dataclass
class Searcher:
    """A loaded model + index folder version. Build with :meth:`load`."""

    contents: IndexContents  # the index version, in memory
    model: Any  # the run's dual encoder (torch, eval mode); None until an image query needs it (text_encoder set)
    transform: CompactTransform | None  # (N, D) -> (N, D) compact embedding, as the index was built; None with model
    device: Any  # the torch.device the model runs on; None with model
    batch_size: int = 64  # queries embedded per batch
    shortlist_factor: int = SHORTLIST_FACTOR  # funnel: candidates = k * shortlist_factor
    params: fi.SearchParams | None = None  # nprobe / efSearch overrides, passed per call (nprobe default: manifest's)
    timings: dict = field(default_factory=dict)  # seconds spent loading: index_load, model_load (, text_export)
    text_encoder: TextEncoder | None = None  # the run's exported text side (ONNX Runtime): text queries without torch
    _model_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _faiss_lock: threading.Lock | None = field(default=None, repr=False)  # set when an index is on a GPU
    _rows: Mapping = field(default_factory=dict, repr=False)  # id -> image row (metafile.id_rows: no dict of N ids)
    _source: tuple = field(default=(), repr=False)  # (run, weights, device, index_dir): to load the model later
    _text_transform: Any = field(default=None, repr=False)  # numpy compact transform for text_encoder's output
    _captions: tuple = field(default=(None, {}), repr=False)  # (id of the contents, caption string -> images carrying it)
    _rows_on_disk: dict = field(default_factory=dict, repr=False)  # vectors file -> its DiskRows (the last two)

    @classmethod
    def load(
        cls,
        index_dir: str | os.PathLike,
        run: str | os.PathLike | None = None,
        device: str | None = None,
        gpu: bool | None = None,
        text_only: bool = False,
    ) -> "Searcher":
        """Open the live version of ``index_dir`` with ``run`` (default: the run in its manifest).

        ``gpu``: search Flat / IVF indexes on the GPU (``None``: when faiss sees one).
        ``text_only``: the caller expects text queries (``triclip search --text``). Then a
        ``lite`` run's text side is taken from its ONNX export (``triclip.model.text_onnx``)
        when one is cached and still matches the run: torch is not imported, and the
        model is loaded only if an image query comes. Without a valid export the model
        is loaded and the export written, for the next load.

        Raises:
            UserError: no index there, a damaged index, the run is missing, or its
                fingerprint differs from the index's.
        """
        t0 = time.perf_counter()
        contents = load_contents(index_dir)
        index_load = time.perf_counter() - t0
        searcher = cls.over(contents, index_dir, run, device, text_only)
        searcher.timings["index_load"] = index_load
        searcher._rows = id_rows(contents.meta)
        searcher._to_device(gpu)
        return searcher

    @classmethod
    def over(cls, contents: IndexContents, where, run=None, device: str | None = None, text_only: bool = False, **fields):
        """A Searcher of ``contents`` with the query side of ``run`` (default: the manifest's; ``where`` names the
        index in messages): the model, or with ``text_only`` a lite run's exported text side (see :meth:`load`).

        Raises:
            UserError: the run is missing, or its fingerprint differs from the manifest's.
        """
        t1 = time.perf_counter()
        manifest = contents.manifest
        run = os.fspath(run) if run is not None else manifest.get("run", "")
        weights = manifest.get("weights", "best")  # the run's weights the index was built with
        source = (run, weights, device, where)
        encoder, text_transform = _text_export(manifest, run, weights, where) if text_only and device in (None, "cpu") \
            else (None, None)
        if encoder is not None:
            searcher = cls(contents, None, None, None, text_encoder=encoder, _source=source, _text_transform=text_transform,
                           **fields)
        else:
            if text_only and device in (None, "cpu") and (manifest.get("model") or {}).get("preset") == "lite" \
                    and sys.stderr.isatty():  # a first text search waits seconds: say why, as a progress line would
                print("loading the run's model and exporting its text side, once: the next text searches skip this",
                      file=sys.stderr)
            model, transform, dev = _load_model(*source, manifest)
            searcher = cls(contents, model, transform, dev, _source=source, **fields)
        searcher.timings = {"model_load": time.perf_counter() - t1}
        if text_only and encoder is None:  # for the next load (best effort: a failure is one line on stderr)
            searcher.timings["text_export"] = export_for_run(searcher.model, run, weights, manifest["fingerprint"])
        return searcher

    def use_text_export(self) -> bool:
        """Answer text queries through the run's exported text side (ONNX Runtime: a lite run on the CPU), keeping
        the loaded model for image queries; writes the export when none is cached. A served text query then costs
        less CPU (docs/benchmarks.md, "The search app under load"). True when text queries now take it."""
        if self.text_encoder is not None:
            return True
        if self.model is None or self.device.type != "cpu":
            return False
        run, weights, _, where = self._source
        encoder, transform = _text_export(self.manifest, run, weights, where)
        if encoder is None and export_for_run(self.model, run, weights, self.manifest["fingerprint"]) > 0:
            encoder, transform = _text_export(self.manifest, run, weights, where)
        if encoder is None:  # not a lite run, or no ONNX Runtime: the model embeds texts too
            return False
        self.text_encoder, self._text_transform = encoder, transform
        return True

    def _ensure_model(self) -> None:
        """Load the run's model now (a Searcher opened on the exported text side, asked an image query)."""
        if self.model is None:
            self.model, self.transform, self.device = _load_model(*self._source, self.manifest)

    def with_contents(self, contents: IndexContents, index_dir: str | os.PathLike = "") -> "Searcher":
        """This model over another version of the same index, built with the same run (an ``--add``,
        a rebuild): no model reload. Its transform is the version's own.

        Raises:
            UserError: the version was built with another run (use :meth:`load`), or its transform is damaged.
        """
        if contents.manifest.get("fingerprint") != self.manifest.get("fingerprint"):
            raise UserError(f"index {index_dir} version {contents.version} was built with another run")
        transform = _transform(contents.manifest, index_dir, self.dim)
        text_transform = None if self.text_encoder is None else _numpy_transform(contents.manifest, index_dir, self.text_encoder.dim)
        other = replace(
            self, contents=contents, transform=transform, timings={}, _faiss_lock=None, _text_transform=text_transform,
            _captions=(None, {}),
        )
        other._rows = id_rows(contents.meta)
        other._to_device(self._faiss_lock is not None)
        return other

    def _to_device(self, gpu: bool | None) -> None:
        for table in (self.contents.image_indexes, self.contents.text_indexes):
            for m, index in table.items():
                table[m] = fi.to_device(index, gpu)
                if table[m] is not index:
                    self._faiss_lock = threading.Lock()  # GPU indexes are not safe to search concurrently

    # -- what the index holds

    @property
    def manifest(self) -> dict:
        return self.contents.manifest

    @property
    def dims(self) -> list[int]:
        """The m's with an index, ascending; the last is D."""
        return list(self.contents.manifest["dims"])

    @property
    def dim(self) -> int:
        """D, the full dimension."""
        return int(self.contents.manifest["dim"])

    @property
    def has_text(self) -> bool:
        """True when the index holds caption vectors (image->text search)."""
        return self.contents.text_vectors is not None

    def __len__(self) -> int:
        return len(self.contents.meta)

    # -- embedding queries (full D)

    def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Full-D compact query embeddings of texts. Shape: (Q, D)."""
        if isinstance(texts, str) or not isinstance(texts, Sequence):
            raise UserError("search_text expects a list of strings")
        for text in texts:
            if not isinstance(text, str):
                raise UserError(f"a text query must be a string, got {type(text).__name__}")
            if not text.strip():
                raise UserError("empty text query")
            if len(text) > MAX_QUERY_CHARS:
                raise UserError(f"text query too long: {len(text)} characters (at most {MAX_QUERY_CHARS})")
        with self._model_lock:
            if self.text_encoder is not None:
                emb = self.text_encoder.encode(list(texts))  # (Q, D) numpy, unit rows
                return self._text_transform(emb)
            from triclip.model.embed import embed_texts

            emb = embed_texts(self.model, list(texts), self.device, self.batch_size)  # (Q, D)
        return self.transform(emb).numpy()

    def embed_images(self, images: Sequence) -> np.ndarray:
        """Full-D compact query embeddings of image files or PIL images. Shape: (Q, D)."""
        if isinstance(images, (str, os.PathLike)) or not isinstance(images, Sequence):
            raise UserError("search_image expects a list of image paths or PIL images")
        decoded = [_as_rgb(image) for image in images]
        with self._model_lock:
            self._ensure_model()
            from triclip.model.embed import embed_pil_images

            emb = embed_pil_images(self.model, decoded, self.device, self.batch_size)  # (Q, D)
        return self.transform(emb).numpy()

    def vectors_of(self, ids: Sequence[str], target: str = "image") -> np.ndarray:
        """Stored full-D vectors of indexed images, by id (no re-embedding). Shape: (Q, D)."""
        if isinstance(ids, str) or not isinstance(ids, Sequence):
            raise UserError("search_ids expects a list of ids")
        rows = []
        for rid in ids:
            if rid not in self._rows:
                raise UserError(f"unknown id {rid!r}: no indexed image has it")
            rows.append(self._rows[rid])
        return np.asarray(self.contents.vectors[rows], np.float32)

    # -- searching

    def search_text(self, texts, k: int = 10, m: int | None = None, target: str = "image", funnel: int | None = None,
                 *, bytes: int | None = None, rescore: int | str | None = None):
        """Top-k hits for each text query (text->image by default)."""
        return self.search_vectors(self.embed_texts(texts), k, m, target, funnel, bytes=bytes, rescore=rescore)

    def search_image(self, images, k: int = 10, m: int | None = None, target: str = "image", funnel: int | None = None,
                  *, bytes: int | None = None, rescore: int | str | None = None):
        """Top-k hits for each query image, a path or a PIL image (image->image; image->text with target="text")."""
        return self.search_vectors(self.embed_images(images), k, m, target, funnel, bytes=bytes, rescore=rescore)

    def search_ids(self, ids, k: int = 10, m: int | None = None, target: str = "image", funnel: int | None = None,
                *, bytes: int | None = None, rescore: int | str | None = None):
        """Top-k hits for indexed images given by id ("more like this"; the image itself ranks first)."""
        return self.search_vectors(self.vectors_of(ids), k, m, target, funnel, bytes=bytes, rescore=rescore)

    def search_vectors(
        self, queries: np.ndarray, k: int = 10, m: int | None = None, target: str = "image", funnel: int | None = None,
        *, bytes: int | None = None, rescore: int | str | None = None,
    ) -> list[list[dict]]:
        """Top-k hits for full-D compact query vectors.

        Args:
            queries: full-D compact vectors (as :meth:`embed_texts` returns). Shape: (Q, D).
            k: hits per query.
            m: the index searched (None: D); ignored with ``funnel``.
            target: ``image`` or ``text`` (the caption vectors).
            funnel: shortlist at m = ``funnel`` (``k * shortlist_factor`` candidates), re-rank at D.
            bytes: search the codes of this budget (``index build --bytes``) instead of an m: the image
                codes, or the caption codes with ``target="text"``.
            rescore: with ``bytes``: None, the stages the build chose and recorded (the codes alone, or their
                shortlist re-ranked by the float vectors); ``"none"``: the codes' own ranking; ``"float"``
                (the full-D vectors, memory-mapped from disk) or a larger budget (its decoded vectors): re-rank
                a shortlist of ``k * shortlist_factor`` from the codes with them.

        Returns:
            One list of hits per query, best first. With ``target="text"`` the hits are k distinct caption
            strings (:meth:`_distinct_captions`), each with ``images``: how many indexed images carry it.
        """
        k = _check_k(k)
        in_search_thread()  # this thread's OpenMP count is the serving count, whichever thread calls
        if target not in TARGETS:
            raise UserError(f"unknown search target {target!r}; choose from {list(TARGETS)}")
        if target == "text" and not self.has_text:
            raise UserError("this index has no caption vectors (built without the text index)")
        vectors = self.contents.vectors if target == "image" else self.contents.text_vectors
        queries = np.asarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise UserError(f"query vectors must have shape (Q, {self.dim}), got {queries.shape}")
        if len(queries) == 0 or len(vectors) == 0:
            return [[] for _ in queries]
        if rescore is not None and bytes is None:
            raise UserError("rescore re-ranks the shortlist of a budget's codes: give bytes too")
        if bytes is not None and funnel is not None:
            raise UserError("bytes searches a budget's codes: not with funnel (rescore re-ranks their shortlist)")
        rank = lambda q, count: self._ranked(q, count, m, target, funnel, bytes, rescore)  # noqa: E731
        if target == "text":
            return self._distinct_captions(queries, k, rank, len(vectors))
        scores, ids = rank(queries, k)
        return [self._hits(s, i, target) for s, i in zip(scores, ids)]

    def ranked(self, queries: np.ndarray, k: int, m: int | None = None, target: str = "image", *,
               bytes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Scores and row ids (of the images, or of the caption rows with ``target="text"``) of the top k, by the
        search :meth:`search_vectors` serves for m or the budget ``bytes`` (with its recorded stages), without the
        hits' dicts: for measuring many queries (``triclip.index.in_index``). Shapes: (Q, D) -> (Q, k), -1 for none."""
        in_search_thread()
        return self._ranked(np.asarray(queries, dtype=np.float32), k, m, target, None, bytes, None)

    def _ranked(self, queries: np.ndarray, k: int, m, target: str, funnel, bytes, rescore) -> tuple[np.ndarray, np.ndarray]:
        """Scores and row ids of the top k of ``target`` for checked queries, by the search asked for (see
        :meth:`search_vectors`). Shapes: (Q, D) -> (Q, k'), (Q, k'), -1 for none."""
        indexes = self.contents.image_indexes if target == "image" else self.contents.text_indexes
        vectors = self.contents.vectors if target == "image" else self.contents.text_vectors
        if bytes is not None:
            codes = self._check_bytes(bytes, "bytes", target)
            wanted = self._shortlist_length(bytes, target, rescore, k, len(vectors))
            if wanted is None:
                return self._search_codes(codes, queries, k)
            candidates = self._search_codes(codes, queries, wanted)[1]  # (Q, C)
            fine = vectors if rescore in (None, "float") else self._check_bytes(rescore, "rescore", target)
            if rescore is None and (self._stage(bytes, target) or {}).get("reads") == "disk":
                fine = self._disk_rows(vectors)
            return rerank_from(fine, queries, candidates, k)
        if funnel is not None:
            small = self._check_m(funnel, "funnel")
            wanted = min(len(vectors), k * max(1, int(self.shortlist_factor)))
            candidates = self._shortlist(indexes[small], prefix(queries, small), wanted, target, small)  # (Q, C)
            return rerank(vectors, queries, candidates, k)  # (Q, k), exact at D
        m = self.dim if m is None else self._check_m(m, "m")
        return self._search(indexes[m], prefix(queries, m), k, target, m)

    def _distinct_captions(self, queries: np.ndarray, k: int, rank, total: int) -> list[list[dict]]:
        """:func:`distinct_captions` over ``rank`` (scores and caption rows), with each string's image count."""
        counts = self._caption_counts()
        hits_of = lambda q, depth: [self._hits(s, i, "text") for s, i in zip(*rank(q, depth))]  # noqa: E731
        return distinct_captions(queries, k, total, hits_of, counts.get)

    def _caption_counts(self) -> dict[str, int]:
        """Caption string -> the number of indexed images carrying it (computed once per version)."""
        key = id(self.contents)
        if self._captions[0] != key:
            owners: dict[str, set[int]] = {}
            for row, text in _caption_texts(self.contents.meta, self.contents.text_rows):
                owners.setdefault(text, set()).add(row)
            self._captions = (key, {text: len(rows) for text, rows in owners.items()})
        return self._captions[1]

    @property
    def budgets(self) -> list[int]:
        """The byte budgets with image codes (``index build --bytes``), ascending."""
        return sorted(self.contents.codes)

    @property
    def text_budgets(self) -> list[int]:
        """The byte budgets with caption codes (image -> text by bytes), ascending."""
        return sorted(self.contents.text_codes)

    def _check_bytes(self, budget, what: str, target: str = "image") -> "Codec":
        codes = self.contents.codes if target == "image" else self.contents.text_codes
        if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or int(budget) not in codes:
            built = sorted(codes) or "none (index build --bytes builds some)"
            side = "" if target == "image" else " for the captions"
            raise UserError(f"{what}={budget!r}: no codes of that many bytes{side} here; choose from {built}")
        return codes[int(budget)]

    def _shortlist_length(self, budget: int, target: str, rescore, k: int, n: int) -> int | None:
        """How many candidates the codes of ``budget`` hand to the re-rank; None: the codes answer alone.

        ``rescore`` None: the stages the build recorded (``budgets[B]["rescore"]``, its shortlist for 10 hits
        scaled to k); "none": the codes alone; "float" or a budget: ``k * shortlist_factor``."""
        if rescore == "none":
            return None
        if rescore is None:
            stage = self._stage(budget, target)
            if not stage:
                return None
            return min(n, max(k, -(-int(stage["shortlist"]) * k // 10)))
        return min(n, k * max(1, int(self.shortlist_factor)))

    def _stage(self, budget: int, target: str) -> dict | None:
        """The second stage the build recorded for ``budget``'s codes (manifest ``budgets[B]["rescore"]``)."""
        entry = (self.manifest.get("budgets") or {}).get(str(int(budget))) or {}
        return (entry if target == "image" else entry.get("text") or {}).get("rescore")

    def _disk_rows(self, vectors):
        """The memory-mapped ``vectors`` read as a re-rank from disk reads them (``diskrows.DiskRows``: one page
        a row, gathered in parallel), opened once per file; the array itself when it is in memory."""
        key = getattr(vectors, "filename", None)
        if key not in self._rows_on_disk:
            if len(self._rows_on_disk) >= 2:  # images and captions of one version; a newer version replaces them
                self._rows_on_disk.clear()
            if isinstance(vectors, SQ8Rows):  # its codes read from disk, decoded
                rows = DiskRows.of(vectors.codes)
                self._rows_on_disk[key] = None if rows is None else vectors.with_codes(rows)
            else:
                self._rows_on_disk[key] = DiskRows.of(vectors)
        return self._rows_on_disk[key] if self._rows_on_disk[key] is not None else vectors

    def _search_codes(self, codes, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top k by the codes of one budget (``triclip.codecs``; FAISS-backed ones under the GPU lock if any)."""
        if self._faiss_lock is None:
            return codes.search(queries, k)
        with self._faiss_lock:
            return codes.search(queries, k)

    def _check_m(self, m, what: str) -> int:
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or int(m) not in self.contents.image_indexes:
            raise UserError(f"{what}={m!r} is not indexed here; choose from {self.dims}")
        return int(m)

    def _search(self, index, queries: np.ndarray, k: int, target: str, m: int) -> tuple[np.ndarray, np.ndarray]:
        params = self.params or fi.SearchParams()
        if params.nprobe is None:  # the nprobe tuned at build time, where the manifest records one
            tuned = self.manifest.get("nprobe" if target == "image" else "text_nprobe") or {}
            params = fi.SearchParams(nprobe=tuned.get(str(m)), ef_search=params.ef_search)
        if self._faiss_lock is None:
            return fi.search(index, queries, k, params)
        with self._faiss_lock:
            return fi.search(index, queries, k, params)

    def _shortlist(self, index, queries: np.ndarray, count: int, target: str, m: int) -> np.ndarray:
        """The funnel's candidates at m, unordered. Shape: (Q, count).

        A small CPU Flat index is scanned as one matmul per chunk of queries over its own
        vectors plus an ``argpartition`` (:func:`matmul_shortlist`); any other index (larger,
        IVF, HNSW, GPU, on disk) is searched by FAISS.
        """
        base = matmul_shortlist(index)
        if base is None:
            return self._search(index, queries, count, target, m)[1]
        return shortlist_flat(base, queries, count)

    def _hits(self, scores: np.ndarray, ids: np.ndarray, target: str) -> list[dict]:
        found = [(s, v) for s, v in zip(scores.tolist(), ids.tolist()) if v >= 0]  # an approximate index: maybe < k
        places = [(v, 0) if target == "image" else tuple(map(int, self.contents.text_rows[v])) for _, v in found]
        metas = meta_rows(self.contents.meta, [row for row, _ in places])  # (image row, caption) -> the image's row
        hits = []
        for (score, _), (_, caption), meta in zip(found, places, metas):
            text = meta["captions"][caption] if caption < len(meta["captions"]) else ""  # an image without captions
            hits.append({"id": meta["id"], "image": meta["image"], "caption": text, "score": score})
        return hits


def distinct_captions(queries: np.ndarray, k: int, total: int, hits_of, count=None) -> list[list[dict]]:
    """The top k distinct caption strings per query: each string once, at its best-scoring caption row (the image
    shown is that row's; equal scores: the smaller id), with ``images`` = ``count(caption)`` where ``count`` is given.

    Identical captions of different images (a clip-art set's "Dino" on ten pictures) would otherwise fill a top k
    with one string. ``hits_of(queries, depth)`` (a hit list per query, best first, of ``total`` caption rows) is
    searched ``DISTINCT_DEPTH`` times deeper than k, and deeper again (x4, up to every row) for the queries that
    still have fewer than k strings. Shared by the local index and a Milvus collection.
    """
    out: list[list[dict] | None] = [None] * len(queries)
    todo = np.arange(len(queries))
    depth = min(total, k * DISTINCT_DEPTH)
    while len(todo):
        short = []
        for q, hits in zip(todo.tolist(), hits_of(queries[todo], depth)):
            out[q] = _best_per_caption(hits, k, count)
            if len(out[q]) < k and depth < total:
                short.append(q)
        todo, depth = np.asarray(short, np.int64), min(total, depth * 4)
    return out


def _best_per_caption(hits: list[dict], k: int, count) -> list[dict]:
    """The best hit of each caption string (equal scores: the smaller id), the k best of those, best first."""
    best: dict[str, dict] = {}
    for hit in hits:
        kept = best.get(hit["caption"])
        if kept is None or (hit["score"], kept["id"]) > (kept["score"], hit["id"]):
            best[hit["caption"]] = hit
    ordered = sorted(best.values(), key=lambda h: (-h["score"], h["id"]))[:k]
    return [{**h, "images": count(h["caption"])} for h in ordered] if count else ordered


def rerank(vectors: np.ndarray, queries: np.ndarray, candidates: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k of each query among its candidates, on full-D vectors.

    Vectorised over queries: the candidates' vectors are gathered in chunks of
    ``RERANK_CHUNK`` queries, ``(q, C, D)``, small enough to stay in the CPU cache (a
    chunk of 16 queries x 200 candidates x 256 dims is 3 MB; chunks of 256 were 1.5x
    slower on openclipart, shared machine), and scored with one ``einsum``. Only the top k of each row are sorted.

    Args:
        vectors: the stored full-D vectors. Shape: (N, D).
        queries: full-D queries. Shape: (Q, D).
        candidates: row ids per query, -1 for none. Shape: (Q, C).
        k: hits kept.

    Returns:
        ``(scores (Q, k'), ids (Q, k'))`` best first, k' = min(k, C); missing ones are -inf / -1.
    """
    k = min(k, candidates.shape[1])
    if len(queries) == 1:  # one query (a served search): one gather and one product, 2-4x faster than the chunks
        return _rerank_one(vectors, queries[0], candidates[0], k)
    out_s = np.empty((len(queries), k), np.float32)
    out_i = np.empty((len(queries), k), np.int64)
    for s in range(0, len(queries), RERANK_CHUNK):
        cand = candidates[s : s + RERANK_CHUNK]  # (q, C)
        valid = cand >= 0
        scores = np.einsum("qcd,qd->qc", vectors[np.where(valid, cand, 0)], queries[s : s + RERANK_CHUNK])  # (q, C)
        scores[~valid] = -np.inf
        top = _top_k(scores, k)  # (q, k), best first
        out_s[s : s + len(cand)] = np.take_along_axis(scores, top, axis=1)
        out_i[s : s + len(cand)] = np.where(np.take_along_axis(valid, top, axis=1), np.take_along_axis(cand, top, axis=1), -1)
    return out_s, out_i


def _rerank_one(vectors: np.ndarray, query: np.ndarray, candidates: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`rerank` of one query: (D,), (C,) -> (1, k), (1, k); missing ones are -inf / -1, as there."""
    rows = candidates[candidates >= 0]  # (C',)
    scores = np.asarray(vectors[rows] @ query, dtype=np.float32)  # (C',)
    top = np.argpartition(-scores, k - 1)[:k] if k < len(rows) else np.arange(len(rows))
    top = top[np.argsort(-scores[top], kind="stable")]
    out_s, out_i = np.full((1, k), -np.inf, np.float32), np.full((1, k), -1, np.int64)
    out_s[0, : len(top)], out_i[0, : len(top)] = scores[top], rows[top]
    return out_s, out_i


def rerank_from(source, queries: np.ndarray, candidates: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`rerank` against ``source``: stored vectors (N, D), memory-mapped or not, sq8 codes
    (``triclip.index.vectors.SQ8Rows``), or a codec whose decoded vectors (``triclip.codecs.Codec.reconstruct``)
    are scored; only the candidates are read."""
    if isinstance(source, (np.ndarray, DiskRows)):
        return rerank(source, queries, candidates, k)
    valid = candidates >= 0
    rows, inverse = np.unique(np.where(valid, candidates, 0), return_inverse=True)
    if isinstance(source, SQ8Rows):  # scored where its codes live: the queries turned once, not every row back
        decoded, queries = source.scored(rows, queries)  # (U, D), (Q, D)
    else:
        decoded = source.reconstruct(rows)  # (U, D): each candidate decoded once
    local = np.where(valid, inverse.reshape(candidates.shape), -1)  # (Q, C) rows of decoded
    scores, ids = rerank(decoded, queries, local, k)
    return scores, np.where(ids >= 0, rows[np.maximum(ids, 0)], -1)


def matmul_shortlist(index) -> np.ndarray | None:
    """The vectors a funnel shortlists from by :func:`shortlist_flat`, or None for FAISS's own search.

    A CPU inner-product Flat index of at most ``MATMUL_SHORTLIST_MAX`` vectors. For a
    few hundred candidates FAISS keeps a heap per query: 1.7x slower than matmul +
    ``argpartition`` at 8k vectors (m = 32, 200 candidates, one thread, shared machine),
    even at 100k, and 1.4x faster at 1M, where ``argpartition`` over each row costs more.
    """
    if index.ntotal > MATMUL_SHORTLIST_MAX:
        return None
    return flat_vectors(index)


def flat_vectors(index) -> np.ndarray | None:
    """The stored vectors of a CPU inner-product Flat index, a read-only view (no copy); else None. Shape: (N, d)."""
    if not isinstance(index, faiss.IndexFlat) or index.metric_type != faiss.METRIC_INNER_PRODUCT or index.ntotal == 0:
        return None
    view = faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d).reshape(index.ntotal, index.d)
    view.flags.writeable = False
    return view


def shortlist_flat(base: np.ndarray, queries: np.ndarray, count: int) -> np.ndarray:
    """Ids of each query's ``count`` largest inner products with ``base``, unordered.

    One matmul per ``SHORTLIST_CHUNK`` queries (their scores stay in the CPU cache) and
    an ``argpartition``: the exact top-``count`` (up to ties), as a Flat index returns.
    Shapes: (N, m), (Q, m) -> (Q, min(count, N)).
    """
    count = min(count, len(base))
    out = np.empty((len(queries), count), np.int64)
    for s in range(0, len(queries), SHORTLIST_CHUNK):
        scores = queries[s : s + SHORTLIST_CHUNK] @ base.T  # (q, N)
        if count < len(base):
            out[s : s + len(scores)] = np.argpartition(-scores, count - 1, axis=1)[:, :count]
        else:
            out[s : s + len(scores)] = np.arange(len(base))
    return out


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Column indices of each row's k largest scores, best first. Shape: (q, C) -> (q, k)."""
    if k < scores.shape[1]:
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k]  # (q, k), unordered
        order = np.argsort(-np.take_along_axis(scores, part, axis=1), axis=1, kind="stable")
        return np.take_along_axis(part, order, axis=1)
    return np.argsort(-scores, axis=1, kind="stable")


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise UserError(f"-k must be a positive integer, got {k!r}")
    return int(k)


def _as_rgb(image):
    """A query image as RGB PIL: decoded from a path with the data layer's checks, or a PIL image checked here."""
    from PIL import Image

    from triclip.data import DEFAULT_MAX_PIXELS
    from triclip.data.images import to_rgb
    from triclip.model.embed import load_query_image

    if isinstance(image, (str, os.PathLike)):
        return load_query_image(image)
    if not isinstance(image, Image.Image):
        raise UserError(f"not an image: {type(image).__name__} (give a path or a PIL image)")
    width, height = image.size
    if width * height > DEFAULT_MAX_PIXELS:
        raise UserError(f"query image too large: {width}x{height} pixels (at most {DEFAULT_MAX_PIXELS})")
    if width < 1 or height < 1:
        raise UserError("empty query image")
    return to_rgb(image)


def _transform(manifest: dict, index_dir, dim: int) -> CompactTransform:
    from triclip.compact.features import CompactTransform

    try:
        transform = CompactTransform.from_dict(manifest["transform"])
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"index {index_dir} is damaged: bad transform in the manifest ({err})") from None
    if not transform.dim == transform.m == manifest["dim"] == dim:
        raise UserError(
            f"index {index_dir} is of dimension {manifest['dim']} (transform {transform.dim} -> {transform.m}),"
            f" the run embeds in {dim}; rebuild the index"
        )
    return transform


def _fingerprint(run: str, weights: str = "best") -> str:
    """The fingerprint of the run's ``weights``; UserError when the run (or its weights) is missing."""
    from triclip.model.run import read_config, run_fingerprint

    read_config(run)  # UserError: not a run
    return run_fingerprint(run, which=weights)  # UserError: no weights


def _load_model(run: str, weights: str, device: str | None, index_dir, manifest: dict) -> tuple:
    """``(model, transform, device)``: the run's model after checking its fingerprint against the index's.

    Raises:
        UserError: the run is missing or is not the one the index was built with.
    """
    from triclip.model.embed import pick_device
    from triclip.model.run import load_run

    fingerprint = _fingerprint(run, weights)
    if fingerprint != manifest["fingerprint"]:
        raise UserError(
            f"run {run} (fingerprint {fingerprint}) is not the run index {index_dir} was built with"
            f" ({manifest.get('run')}, fingerprint {manifest['fingerprint']}); rebuild the index or pass that --run"
        )
    dev = pick_device(device)
    model, _ = load_run(run, dev, which=weights)
    return model, _transform(manifest, index_dir, int(model.embed_dim)), dev


def _caption_texts(meta: Sequence[dict], text_rows: np.ndarray):
    """``(image row, caption string)`` of every caption row; the meta rows read once in order where the caption
    rows follow the image rows (as a build writes them: rows read when asked cost a read each), else by row."""
    rows = text_rows[:, 0]  # (T,)
    if len(rows) and (rows[1:] < rows[:-1]).any():
        for row, caption in text_rows.tolist():
            yield row, meta[row]["captions"][caption]
        return
    walk, at, current = iter(meta), -1, None
    for row, caption in text_rows.tolist():
        while at < row:
            at, current = at + 1, next(walk)
        yield row, current["captions"][caption]


def _text_export(manifest: dict, run: str, weights: str, index_dir) -> tuple:
    """``(TextEncoder, its numpy compact transform)`` of the run's cached export, or ``(None, None)`` on a miss.

    Raises:
        UserError: a damaged or foreign transform in the manifest.
    """
    encoder = cached_text_encoder(run, weights, manifest["fingerprint"])
    if encoder is None:
        return None, None
    return encoder, _numpy_transform(manifest, index_dir, encoder.dim)


def _numpy_transform(manifest: dict, index_dir, dim: int):
    """The manifest's compact transform in numpy (``CompactTransform`` without torch): (Q, D) -> (Q, D) float32.

    Same maths: selection (``keep``, ``weights``) or PCA (``basis``), L2 normalisation, ``signs``.
    """
    try:
        data = manifest["transform"]
        m = int(data["m"])
        keep = None if data.get("keep") is None else np.asarray(data["keep"], np.int64)
        weights = None if data.get("weights") is None else np.asarray(data["weights"], np.float32)
        signs = None if data.get("signs") is None else np.asarray(data["signs"], np.float32)
        basis = data.get("basis")
        mean = None if basis is None else np.asarray(basis["mean"], np.float32)
        components = None if basis is None else np.asarray(basis["components"], np.float32)[:m]
        if (keep is None) == (basis is None):
            raise ValueError("needs exactly one of keep or basis")
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"index {index_dir} is damaged: bad transform in the manifest ({err})") from None
    if not int(data["dim"]) == m == manifest["dim"] == dim:
        raise UserError(
            f"index {index_dir} is of dimension {manifest['dim']} (transform {data['dim']} -> {m}),"
            f" the run embeds in {dim}; rebuild the index"
        )

    def apply(z: np.ndarray) -> np.ndarray:
        if keep is not None:
            out = z[:, keep] * weights if weights is not None else z[:, keep]  # (Q, m)
        else:
            out = (z - mean) @ components.T  # (Q, m)
        out = out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(out * signs if signs is not None else out, dtype=np.float32)

    return apply
