"""What every codec answers: :class:`Codec` (the class: a kind of code; an instance: a fitted code holding vectors)."""

from __future__ import annotations

import functools
import hashlib
from typing import ClassVar

import faiss
import numpy as np

from triclip.core.errors import UserError
from triclip.codecs.spec import CodecSpec
from triclip.codecs.threads import in_search_thread

METRIC = faiss.METRIC_INNER_PRODUCT


SLOW_FIT_ROWS = 5000  # vectors the slowest fits (RQ's beam search, OPQ's rotation) are fitted on when a budget measures
# them (their fit grows with the rows; RQ above OPQ from 5,000 rows: triclip.index.budgets.RQ_OVER_OPQ_ROWS)

class Codec:
    """A kind of code (the class, registered by name with ``@register_codec``) and a fitted code holding encoded
    vectors (an instance; ids 0..n-1 in the order added).

    The class answers what needs no vectors: its label and description, its candidates for a byte budget, its
    bytes per vector, whether a file is its own; :meth:`fit` trains an instance, :meth:`read` loads one.
    """

    name: ClassVar[str] = ""  # set by @register_codec
    title: ClassVar[str] = ""  # its words in a chart's legend (the app's recall-against-bytes chart)
    family: ClassVar[str] = ""  # the name of its row in tables of results (benchmarks/bench_bytes.py)
    symmetric: ClassVar[bool] = False  # the query is encoded as the vectors are (binary), not scored as floats
    exact_scan: ClassVar[bool] = True  # search ranks by the exact score against reconstruct()'s vectors (False:
    # scores are estimates: fast scan's 8-bit lookup tables, RaBitQ's estimator)
    fit_cost: ClassVar[int] = 0  # how long its training takes, in ranks (0: seconds at most; 1: k-means of 256
    # centroids per codebook; 2: residual quantisers' beam search): a budget fits cheaper candidates first
    fit_rows: ClassVar[int | None] = None  # most vectors ``index build --bytes`` fits it on (a seeded subset of its
    # sample; None: the whole sample): slow fits whose recall a larger sample does not raise
    fit_rows_at_n: ClassVar[int | None] = None  # most rows it is refitted on inside inverted lists sized for the
    # collection (``IVFCodec.sized_for``; None: :attr:`fit_rows`)
    spec: CodecSpec
    dim: int  # width D of the vectors it takes and reconstructs

    # ------------------------------------------------------------------ the kind of code

    label_format: str = "{codec} m={m}"  # the short name: a format of the fields of :meth:`fields`
    words: str = ""  # the code in plain words after its label: a format of the fields of :meth:`fields`

    @classmethod
    def label(cls, spec: CodecSpec) -> str:
        """Short name, e.g. ``int8 m=64`` (:attr:`label_format` filled in)."""
        return cls.label_format.format(**cls.fields(spec))

    @classmethod
    def describe(cls, spec: CodecSpec) -> str:
        """The code in plain words for a newcomer, starting with its label (:attr:`words` filled in)."""
        return f"{spec.label()}: " + cls.words.format(**cls.fields(spec))

    @classmethod
    def fields(cls, spec: CodecSpec) -> dict:
        """What :attr:`label_format` and :attr:`words` may name: the spec's params, codec, m, bytes, first ('the
        first 64 dimensions'), note ('8 bytes per vector'), size (m / M where M is a param) and nprobe ('?' where
        unset)."""
        groups = spec.params.get("M")
        return {"nprobe": "?", **spec.params, "codec": spec.codec, "m": spec.m, "bytes": spec.bytes_per_vector,
                "first": first(spec.m), "note": bytes_note(spec), "size": spec.m // groups if groups else None}

    @classmethod
    def candidates(cls, budget: int, dim: int, n: int | None = None) -> list[CodecSpec]:
        """Its codes that fit ``budget`` bytes per vector of width ``dim`` (``n``: the collection's size where
        known, for codes whose choices depend on it), in the order to try them; [] when none fits."""
        raise NotImplementedError

    @classmethod
    def fit(cls, spec: CodecSpec, train: np.ndarray, importance: np.ndarray | None = None) -> Codec:
        """Train a code on (N, D) float32 vectors, finite, m <= D (:func:`triclip.codecs.fit` checks); it
        holds no vectors. The returned codec's ``spec`` is the fitted one."""
        raise NotImplementedError

    @classmethod
    def probe(cls, spec: CodecSpec, dim: int) -> Codec | None:
        """A twin of ``spec``'s structure that searches as fast as the fitted code, made without training
        (random codebooks): ``triclip.index.latency`` times it to leave out, unfitted, a code too slow for a
        latency bound. None: no twin (the code is cheap to fit, and is timed once fitted)."""
        return None

    @classmethod
    def fit_work(cls, spec: CodecSpec) -> int:
        """Centroids its training finds: codebooks x entries (``M * 2**nbits``) where the spec has them, else 0.
        Within a :attr:`fit_cost` rank a budget fits the smaller first, so that a quick fit's recall can leave a
        slow one unfitted (5,000 caption vectors: RQ16x4fs, 256 centroids, 3 s; RQ8x8, 2,048, 14 s)."""
        params = spec.params
        return params["M"] << params["nbits"] if "M" in params and "nbits" in params else 0

    @classmethod
    def fit_rows_of(cls, spec: CodecSpec) -> int | None:
        """Most vectors ``index build --bytes`` fits ``spec`` on (:attr:`fit_rows`; inverted lists: their inner code's)."""
        return cls.fit_rows

    def add_random(self, n: int, rng: np.random.Generator) -> None:
        """Append ``n`` random unit vectors (a probe's filling: only their number matters), 65,536 at a time."""
        for start in range(0, n, 65_536):
            x = rng.standard_normal((min(65_536, n - start), self.dim), dtype=np.float32)
            self.add(x / np.linalg.norm(x, axis=1, keepdims=True))

    def exhaustive(self) -> dict | None:
        """Search parameters that scan every vector (inverted lists: nprobe = nlist); None: a search always does."""
        return None

    def scores_decoded(self) -> bool:
        """Whether a search scores every vector it scans by the query's inner product with that vector as
        :meth:`reconstruct` decodes it (so a search scanning every vector is exact search over the
        reconstruction): :attr:`exact_scan` of a code searched by float queries, unless a codec knows better."""
        return self.exact_scan and not self.symmetric

    @classmethod
    def owns(cls, file: CodecFile) -> bool:
        """Whether ``file`` is a file this codec wrote (:meth:`save`)."""
        raise NotImplementedError

    @classmethod
    def read(cls, file: CodecFile, dim: int | None) -> Codec:
        """The codec in ``file`` (one it owns). ``dim``: the width D of the vectors, for files that do not record it."""
        raise NotImplementedError

    # ------------------------------------------------------------------ a fitted code

    def add(self, x: np.ndarray) -> None:
        """Encode and append (n, D) float32 vectors."""
        raise NotImplementedError

    def search(self, q: np.ndarray, k: int, params: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Scores and ids of the top k, best first. Shapes: (Q, D) float32 -> (Q, k), (Q, k).

        ``params``: search settings of this call only, for codes that have some (e.g. an IVF code's
        ``{"nprobe": 16}``); the code itself is not changed, so threads may search with different settings at
        once. None: the code's own. A code without settings refuses any (UserError).
        """
        in_search_thread()  # OpenMP's thread count is per thread: the serving count here (triclip.codecs.threads)
        q = self._check(q, "queries")
        return self._search(q, max(1, min(k, len(self))), self.search_parameters(params))

    def search_parameters(self, params: dict | None):
        """``params`` as the object :meth:`_search` passes on (e.g. ``faiss.SearchParameters``); None for none."""
        if params:
            raise UserError(f"{self.spec.label()} takes no search parameters, got {', '.join(sorted(params))}")
        return None

    def _search(self, q: np.ndarray, k: int, params) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search` on checked (Q, D) queries, 1 <= k <= len(self) unless empty."""
        raise NotImplementedError

    def reconstruct(self, ids=None) -> np.ndarray:
        """Decoded vectors, zeros beyond m. Shape: (n, D) float32 (all vectors when ids is None)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def code_bytes(self) -> int:
        """Size of the stored code array (what bytes_per_vector promises, times n)."""
        raise NotImplementedError

    def ram_bytes(self) -> int:
        """Bytes the code holds in memory for its vectors: :meth:`code_bytes` plus what the structure adds
        (an inverted list's ids, a fast-scan block's padding)."""
        return self.code_bytes()

    def save(self, path) -> None:
        """Write the code atomically to ``path`` (:func:`triclip.codecs.load` reads it back)."""
        raise NotImplementedError

    def empty_copy(self) -> Codec:
        """The same trained code holding no vectors (e.g. measure on validation, then fill with the collection)."""
        raise NotImplementedError

    def _check(self, x: np.ndarray, name: str) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise UserError(f"{name} must be (n, {self.dim}) vectors, got shape {x.shape}")
        return x

    def _ids(self, ids) -> np.ndarray:
        return np.arange(len(self)) if ids is None else np.asarray(ids, dtype=np.int64).reshape(-1)


class CodecFile:
    """A file :func:`triclip.codecs.load` is reading: its first bytes, and the FAISS index in it read once,
    whichever codecs ask (several codecs share FAISS's ``IndexPreTransform`` file format)."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self.head = f.read(8)  # FAISS: the index type's four characters first; numpy .npz: a zip ("PK")

    @functools.cached_property
    def faiss_index(self) -> faiss.Index:
        """The index; inverted lists on disk are mapped read-only from the file beside it that it names."""
        from triclip.codecs.ondisk import quiet_stdout

        with quiet_stdout():  # FAISS prints a line when it maps on-disk lists
            return faiss.read_index(self.path, faiss.IO_FLAG_ONDISK_SAME_DIR | faiss.IO_FLAG_READ_ONLY)


def prefix_candidates(name: str, budget: int, dim: int, bits: int, step: int = 1) -> list[CodecSpec]:
    """Codes of the leading m dimensions at ``bits`` per dimension: the largest m that fits ``budget`` bytes
    (a multiple of ``step``, at most ``dim``) and half of it, largest first."""
    top = min(dim, int(budget / (bits / 8))) // step * step
    return [CodecSpec(name, m, -(-m * bits // 8)) for m in sorted({top, top // 2 // step * step}, reverse=True) if m >= 1]


def first(m: int) -> str:
    """'the first 64 dimensions' ('the first dimension' for 1) for a description."""
    return "the first dimension" if m == 1 else f"the first {m} dimensions"


def bytes_note(spec: CodecSpec) -> str:
    """'N bytes per vector' for the end of a description."""
    return f"{spec.bytes_per_vector} byte{'s' * (spec.bytes_per_vector != 1)} per vector"


def unit_prefix(x: np.ndarray, keep) -> np.ndarray:
    """``x`` scaled per row so the kept dimensions have unit length (zero rows stay zero).

    ``keep``: the number m of leading dimensions, or a boolean mask over the columns. Shape: (N, W) -> (N, W);
    only the kept columns are meaningful afterwards (the codes read no others).
    """
    part = x[:, :keep] if isinstance(keep, (int, np.integer)) else np.where(keep, x, np.float32(0))  # (N, m) or (N, W)
    norms = np.linalg.norm(part, axis=1, keepdims=True)  # (N, 1)
    return np.ascontiguousarray(x / np.maximum(norms, 1e-12), dtype=np.float32)


def rows_key(rows: np.ndarray) -> str:
    """A key for a fit's cache: the rows' shape, dtype and a blake2b of their bytes (equal rows, equal key)."""
    rows = np.ascontiguousarray(rows)
    return f"{rows.shape}:{rows.dtype}:{hashlib.blake2b(rows.data).hexdigest()}"
