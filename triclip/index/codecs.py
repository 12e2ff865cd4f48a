"""Codes for served vectors, chosen by bytes per vector (torch-free: numpy and FAISS only).

Vectors are a run's served embeddings in importance order (column 0 the most important, L2-normalised),
shape (N, D) float32; a code covers the leading ``m`` dimensions. Codecs (FAISS: https://github.com/facebookresearch/faiss):

- ``float32``: the top m dimensions as they are (``IndexFlatIP``), 4m bytes. Today's pruning.
- ``int8``: the top m dimensions, one byte each, per-dimension ranges trained on the collection
  (``IndexScalarQuantizer`` with ``QT_8bit``), m bytes.
- ``binary``: the signs of the top m dimensions (m a multiple of 8), m/8 bytes, searched by Hamming distance
  (``IndexBinaryFlat``). The query is binarised too, as sentence-transformers' and FAISS's binary search
  do; the score returned is ``m - 2 * hamming``, the inner product of the two sign vectors.
- ``pq``: product quantisation of the top m dimensions, M sub-quantisers of nbits (``IndexPQ``).
- ``opq``: an OPQ rotation (``OPQMatrix``) learnt on the top m dimensions, then PQ.
- ``rq``: residual quantisation of the top m dimensions, M codebooks of 2^nbits centroids over the whole
  width, each encoding what the previous ones left (``IndexResidualQuantizer``, beam search; Chen et al. 2010,
  https://doi.org/10.3390/s101211259). Searched by lookup tables of the query against every codebook
  (``ST_LUT_nonorm``: an inner product is linear in the sum of codewords, so this is exact, no norms stored).
- ``mixed``: the importance-aware mixed-precision code of :mod:`triclip.index.allocation`: b_j bits of a uniform
  scalar quantiser on dimension j, allocated by minimising the modelled error of the query-image score
  (0 bits prune a dimension; top-m pruning is the special case). Written by hand because FAISS has no
  quantiser with a different bit width per dimension (``ScalarQuantizer`` uses one width for all). Its packed
  bytes are searched by FAISS's ``IndexPQ`` lookup tables all the same (see :class:`MixedCodec`).

A code that keeps fewer than D dimensions stores them re-normalised to unit length (as today's top-m index
does, ``triclip.index.sources.prefix``), so scores are cosines over what is kept (on synthetic data at 8 B, float32 at
m = 2 finds 2.7x more of the true top 10 than without). Every codec but ``binary`` scores float queries against
the decoded codes (asymmetric distance).
Float FAISS codecs are wrapped in ``IndexPreTransform(RemapDimensionsTransform(D, m), ...)``, so they take
full-width queries and record D in their file; :meth:`Codec.reconstruct` returns (n, D) with zeros beyond m.

PQ's k-means needs at least ``2**nbits`` training vectors: on a smaller collection :func:`fit` lowers nbits to
``floor(log2(N))`` (the fitted spec says so, and its bytes per vector shrink with it) and refuses below 2 vectors.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

import faiss
import numpy as np
from triclip.index import allocation
from triclip.core.errors import UserError
from triclip.core.io import atomic_path

CODECS: tuple[str, ...] = ("float32", "int8", "binary", "pq", "opq", "rq", "mixed")
METRIC = faiss.METRIC_INNER_PRODUCT
PQ_DIMS_PER_CODE = 4  # fewest dimensions per PQ sub-quantiser among the candidates
OPQ_DIMS_PER_CODE = 8  # and per OPQ sub-quantiser (OPQ64 on 5k x 256 vectors: 3.5 min of training at D/4)
OPQ_ITERATIONS = 20  # OPQMatrix.niter (FAISS's default 50 trains 2.5x longer)
RQ_MEMORY = 256 << 20  # bytes of beam-search distance tables RQ encodes with at once (FAISS's default 5 GB:
# adding 300k vectors to an RQ16x8 peaked at 6.8 GB; with this cap 1.2 GB, the same codes, 1.6x faster)
RQ_MAX_CODES = 16  # most RQ codebooks among the candidates (RQ16x8 on 5k x 256: 14 s to train; RQ32x8 28 s for
# 99% of full-D recall, where mixed already keeps 99%)


@dataclass(frozen=True)
class CodecSpec:
    """One code: which codec, how many leading dimensions, its exact bytes per vector (codes only, no ids)."""

    codec: str
    m: int
    bytes_per_vector: int
    params: dict = field(default_factory=dict)  # pq/opq/rq: {"M", "nbits"}; mixed: {"bits": [b_0..b_{m-1}]} once fitted

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise UserError(f"unknown codec {self.codec!r}; choose from {', '.join(CODECS)}")
        if self.m < 1 or self.bytes_per_vector < 1:
            raise UserError(f"a {self.codec} code needs m >= 1 and bytes >= 1, got m={self.m}, {self.bytes_per_vector} B")

    def label(self) -> str:
        """Short name, e.g. ``opq16x8 m=256``, ``int8 m=64``, ``mixed 16B m=48``."""
        if self.codec in ("pq", "opq", "rq"):
            return f"{self.codec}{self.params['M']}x{self.params['nbits']} m={self.m}"
        if self.codec == "mixed":
            return f"mixed {self.bytes_per_vector}B m={self.m}"
        return f"{self.codec} m={self.m}"

    def to_json(self) -> dict:
        return {"codec": self.codec, "m": self.m, "bytes_per_vector": self.bytes_per_vector, "params": dict(self.params)}

    @classmethod
    def from_json(cls, d: dict) -> CodecSpec:
        try:
            return cls(str(d["codec"]), int(d["m"]), int(d["bytes_per_vector"]), dict(d.get("params") or {}))
        except (KeyError, TypeError, ValueError) as err:
            raise UserError(f"not a codec spec: {d!r} ({err})") from None


# ---------------------------------------------------------------------------- which codes fit a budget


def candidates(budget: int, dim: int) -> list[CodecSpec]:
    """Every codec and m that fits in ``budget`` bytes per vector (what ``index build --bytes`` tries).

    For float32 / int8 / binary the largest m that fits and half of it; for PQ / OPQ one byte per
    sub-quantiser (M = budget, 8 bits) on the largest multiple of M up to D (PQ: and half of it), with at
    least :data:`PQ_DIMS_PER_CODE` (OPQ: :data:`OPQ_DIMS_PER_CODE`) dimensions per sub-quantiser (PQ as
    ``faiss_index.pq_subquantizers``; finer codes cost minutes of k-means for what int8 / mixed give there);
    for RQ one byte per codebook on the whole width, up to :data:`RQ_MAX_CODES` codebooks; for mixed the whole
    width (the allocation decides which dimensions get bits). Codes that cannot fit are left out.
    """
    if budget < 1 or dim < 1:
        raise UserError(f"a budget needs >= 1 byte and a width >= 1, got {budget} B, D={dim}")
    specs = []
    for codec, per_dim, step in (("float32", 4, 1), ("int8", 1, 1), ("binary", 1 / 8, 8)):
        top = min(dim, int(budget / per_dim)) // step * step
        for m in sorted({top, top // 2 // step * step}, reverse=True):
            if m >= 1:
                specs.append(CodecSpec(codec, m, math.ceil(m * per_dim)))
    top = dim // budget * budget
    for codec in ("pq", "opq"):
        for m in sorted({top, top // 2 // budget * budget} if codec == "pq" else {top}, reverse=True):
            if m >= (PQ_DIMS_PER_CODE if codec == "pq" else OPQ_DIMS_PER_CODE) * budget:
                specs.append(CodecSpec(codec, m, budget, {"M": budget, "nbits": 8}))
    if budget <= RQ_MAX_CODES:
        specs.append(CodecSpec("rq", dim, budget, {"M": budget, "nbits": 8}))
    specs.append(CodecSpec("mixed", dim, budget, {}))
    return specs


# ---------------------------------------------------------------------------- the codes


class Codec:
    """A fitted code holding encoded vectors (ids 0..n-1 in the order added)."""

    spec: CodecSpec
    dim: int  # width D of the vectors it takes and reconstructs

    def add(self, x: np.ndarray) -> None:
        raise NotImplementedError

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Scores and ids of the top k, best first. Shapes: (Q, D) float32 -> (Q, k), (Q, k)."""
        raise NotImplementedError

    def reconstruct(self, ids=None) -> np.ndarray:
        """Decoded vectors, zeros beyond m. Shape: (n, D) float32 (all vectors when ids is None)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def save(self, path) -> None:
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


class FaissCodec(Codec):
    """float32, int8, pq, opq and rq: a FAISS index taking full-width vectors and keeping the top m."""

    def __init__(self, spec: CodecSpec, index: faiss.IndexPreTransform, dim: int):
        self.spec, self.index, self.dim = spec, index, dim

    def add(self, x):
        self.index.add(unit_prefix(self._check(x, "vectors"), self.spec.m))

    def search(self, q, k):
        q = self._check(q, "queries")
        scores, ids = self.index.search(q, max(1, min(k, len(self))))
        return scores, ids

    def reconstruct(self, ids=None):
        ids = self._ids(ids)
        return self.index.reconstruct_batch(ids) if len(ids) else np.zeros((0, self.dim), np.float32)

    def __len__(self):
        return int(self.index.ntotal)

    def code_bytes(self) -> int:
        """Size of the stored code array (what bytes_per_vector promises, times n)."""
        return faiss.vector_to_array(faiss.downcast_index(self.index.index).codes).size

    def save(self, path):
        with atomic_path(path) as tmp:
            faiss.write_index(self.index, os.fspath(tmp))

    def empty_copy(self):
        index = faiss.clone_index(self.index)
        index.reset()
        return FaissCodec(self.spec, index, self.dim)


class BinaryCodec(Codec):
    """Sign bits of the top m dimensions in a FAISS ``IndexBinaryFlat`` (Hamming; the query is binarised)."""

    def __init__(self, spec: CodecSpec, index: faiss.IndexBinaryFlat, dim: int):
        self.spec, self.index, self.dim = spec, index, dim

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Packed sign bits, as ``np.packbits(x > 0)``. Shape: (N, D) -> (N, m / 8) uint8."""
        return np.packbits(x[:, : self.spec.m] > 0, axis=1)

    def add(self, x):
        self.index.add(self.encode(self._check(x, "vectors")))

    def search(self, q, k):
        dist, ids = self.index.search(self.encode(self._check(q, "queries")), max(1, min(k, len(self))))
        return (self.spec.m - 2 * dist).astype(np.float32), ids

    def reconstruct(self, ids=None):
        ids = self._ids(ids)
        codes = np.stack([self.index.reconstruct(int(i)) for i in ids]) if len(ids) else np.zeros((0, self.spec.m // 8), np.uint8)
        out = np.zeros((len(ids), self.dim), np.float32)
        out[:, : self.spec.m] = (np.unpackbits(codes, axis=1).astype(np.float32) * 2 - 1) / math.sqrt(self.spec.m)
        return out

    def __len__(self):
        return int(self.index.ntotal)

    def code_bytes(self) -> int:
        return faiss.vector_to_array(self.index.xb).size

    def save(self, path):
        with atomic_path(path) as tmp:
            faiss.write_index_binary(self.index, os.fspath(tmp))

    def empty_copy(self):
        return BinaryCodec(self.spec, faiss.IndexBinaryFlat(self.spec.m), self.dim)


class MixedCodec(Codec):
    """Per-dimension bit widths (:mod:`triclip.index.allocation`), bit-packed, searched by FAISS's PQ lookup tables.

    A decoded coordinate is linear in its cell index (``lo + (c + 0.5) * step``), so a score ``q . x_hat`` is a
    constant per query plus a weighted sum of the stored BITS, each bit weighing ``q_j * step_j * 2^shift``.
    Byte b of the packed code then adds ``LUT_b[byte]``: exactly FAISS ``IndexPQ``'s asymmetric distance with B
    sub-quantisers of 8 bits whose 256 centroids are the 256 bit patterns of a byte, searched with the per-bit
    weights as the query. The packed bytes are that index's codes (``add_sa_codes``; stored once, in FAISS), so
    a mixed code is searched as fast as PQ with as many bytes (no decoding); the constant is added back.
    """

    def __init__(self, spec: CodecSpec, lo: np.ndarray, hi: np.ndarray, dim: int, codes: np.ndarray | None = None):
        self.spec, self.dim = spec, dim
        self.bits = np.asarray(spec.params["bits"], dtype=np.int64)  # (m,)
        self.lo, self.hi = lo.astype(np.float32), hi.astype(np.float32)  # (m,) each
        nbytes = spec.bytes_per_vector
        self.index = faiss.IndexPQ(8 * nbytes, nbytes, 8, METRIC)
        patterns = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.float32)  # (256, 8)
        faiss.copy_array_to_vector(np.tile(patterns, (nbytes, 1)).ravel(), self.index.pq.centroids)
        self.index.is_trained = True
        if codes is not None and len(codes):
            self.index.add_sa_codes(np.ascontiguousarray(codes, dtype=np.uint8))

    @property
    def codes(self) -> np.ndarray:
        """The packed codes, a view of FAISS's array (valid until the next add). Shape: (n, bytes_per_vector) uint8."""
        if not len(self):
            return np.zeros((0, self.spec.bytes_per_vector), np.uint8)
        flat = faiss.rev_swig_ptr(self.index.codes.data(), self.index.codes.size())
        return flat.reshape(len(self), self.spec.bytes_per_vector)

    def add(self, x):
        x = unit_prefix(self._check(x, "vectors")[:, : self.spec.m], self.bits > 0)
        cells = allocation.quantise(x, self.lo, self.hi, self.bits)
        self.index.add_sa_codes(allocation.pack(cells, self.bits))

    def _decode(self, rows: np.ndarray) -> np.ndarray:
        """(n, m) float32, 0 on pruned dimensions."""
        values = allocation.dequantise(allocation.unpack(rows, self.bits), self.lo, self.hi, self.bits)
        return np.where(self.bits > 0, values, np.float32(0))

    def search(self, q, k):
        q = self._check(q, "queries")[:, : self.spec.m]
        q = np.where(self.bits > 0, q, np.float32(0))  # pruned dimensions score nothing
        step = np.maximum(self.hi - self.lo, 1e-12) / np.exp2(self.bits)  # (m,) as allocation.dequantise
        dims, shifts = allocation.bit_layout(self.bits)
        per_bit = np.zeros((len(q), 8 * self.spec.bytes_per_vector), np.float32)  # (Q, 8B), padding bits weigh 0
        per_bit[:, : len(dims)] = q[:, dims] * (step[dims] * np.exp2(shifts))
        constant = q @ (self.lo + 0.5 * step)  # (Q,)
        scores, ids = self.index.search(per_bit, max(1, min(k, len(self))))
        return scores + constant[:, None].astype(np.float32), ids

    def reconstruct(self, ids=None):
        ids = self._ids(ids)
        rows = self.codes[ids]
        out = np.zeros((len(rows), self.dim), np.float32)
        out[:, : self.spec.m] = self._decode(rows)
        return out

    def __len__(self):
        return int(self.index.ntotal)

    def code_bytes(self) -> int:
        return int(self.index.codes.size())

    def save(self, path):
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, codes=self.codes, bits=self.bits, lo=self.lo, hi=self.hi, dim=self.dim)

    def empty_copy(self):
        return MixedCodec(self.spec, self.lo, self.hi, self.dim)


def unit_prefix(x: np.ndarray, keep) -> np.ndarray:
    """``x`` scaled per row so the kept dimensions have unit length (zero rows stay zero).

    ``keep``: the number m of leading dimensions, or a boolean mask over the columns. Shape: (N, W) -> (N, W);
    only the kept columns are meaningful afterwards (the codes read no others).
    """
    part = x[:, :keep] if isinstance(keep, (int, np.integer)) else np.where(keep, x, np.float32(0))  # (N, m) or (N, W)
    norms = np.linalg.norm(part, axis=1, keepdims=True)  # (N, 1)
    return np.ascontiguousarray(x / np.maximum(norms, 1e-12), dtype=np.float32)


# ---------------------------------------------------------------------------- fit and load


def fit(spec: CodecSpec, train: np.ndarray, importance: np.ndarray | None = None) -> Codec:
    """Train a code on (N, D) float32 vectors (the train split's served embeddings); it holds no vectors yet.

    ``importance`` (D,): the query side's weight per dimension for the mixed code, ``E[q_j^2]`` up to
    scale (``allocation.query_weights(text_embeddings)``; the run's S is a proxy). None: the
    collection's own second moment (served image and text vectors share the basis and its scaling).
    Other codecs ignore it. The returned codec's ``spec`` is the fitted one (mixed: its bits and m;
    PQ on a small collection: its nbits).
    """
    train = np.ascontiguousarray(train, dtype=np.float32)
    if train.ndim != 2 or len(train) < 1 or not np.isfinite(train).all():
        raise UserError(f"training vectors must be a finite non-empty (N, D) array, got shape {train.shape}")
    n, dim = train.shape
    if spec.m > dim:
        raise UserError(f"{spec.label()} needs m <= D = {dim}")
    if spec.codec == "binary":
        if spec.m % 8:
            raise UserError(f"binary codes need m a multiple of 8, got {spec.m}")
        return BinaryCodec(spec, faiss.IndexBinaryFlat(spec.m), dim)
    if spec.codec == "mixed":
        return _fit_mixed(spec, train, importance)
    spec, inner, rotation = _faiss_parts(spec, n)
    index = faiss.IndexPreTransform(inner) if rotation is None else faiss.IndexPreTransform(rotation, inner)
    index.prepend_transform(faiss.RemapDimensionsTransform(dim, spec.m, False))
    index.train(unit_prefix(train, spec.m))
    index = faiss.deserialize_index(faiss.serialize_index(index))  # one object that owns all its parts
    return FaissCodec(spec, _cap_memory(index), dim)


def _cap_memory(index: faiss.IndexPreTransform) -> faiss.IndexPreTransform:
    """An RQ code encodes with :data:`RQ_MEMORY` of distance tables (a setting FAISS does not save in the file)."""
    inner = faiss.downcast_index(index.index)
    if isinstance(inner, faiss.IndexResidualQuantizer):
        inner.rq.max_mem_distances = RQ_MEMORY
    return index


def _faiss_parts(spec: CodecSpec, n: int):
    """(spec with the nbits the collection allows, inner index, OPQ rotation or None)."""
    if spec.codec == "float32":
        return spec, faiss.IndexFlatIP(spec.m), None
    if spec.codec == "int8":
        return spec, faiss.IndexScalarQuantizer(spec.m, faiss.ScalarQuantizer.QT_8bit, METRIC), None
    sub, nbits = int(spec.params.get("M", spec.bytes_per_vector)), int(spec.params.get("nbits", 8))
    if spec.m % sub and spec.codec != "rq":  # RQ's codebooks each span all m dimensions
        raise UserError(f"{spec.label()}: m must be a multiple of M = {sub}")
    nbits = min(nbits, int(math.log2(n)) if n >= 2 else 0)
    if nbits < 1:
        raise UserError(f"{spec.codec} needs at least 2 training vectors, got {n}")
    spec = replace(spec, bytes_per_vector=math.ceil(sub * nbits / 8), params={"M": sub, "nbits": nbits})
    if spec.codec == "rq":
        if n < spec.m:  # its progressive training starts from a PCA of the training vectors (FAISS asserts)
            raise UserError(f"{spec.label()} needs at least {spec.m} training vectors, got {n}")
        inner = faiss.IndexResidualQuantizer(spec.m, sub, nbits, METRIC)
        inner.rq.search_type = faiss.AdditiveQuantizer.ST_LUT_nonorm  # exact for inner products, no norm bytes
        inner.rq.cp.min_points_per_centroid = 1
        inner.rq.max_mem_distances = RQ_MEMORY  # training encodes too
        return spec, inner, None
    inner = faiss.IndexPQ(spec.m, sub, nbits, METRIC)
    inner.pq.cp.min_points_per_centroid = 1  # small collections: train anyway, without a warning per k-means
    if spec.codec == "pq":
        return spec, inner, None
    if nbits < 8:  # FAISS 1.15's OPQMatrix corrupts the heap (the process aborts) training codes under 8 bits
        raise UserError(f"{spec.label()} needs at least 256 training vectors (8-bit codes), got {n}")
    rotation = faiss.OPQMatrix(spec.m, sub)
    rotation.niter = OPQ_ITERATIONS
    own_pq = faiss.ProductQuantizer(spec.m, sub, nbits)  # OPQ's own k-means at the nbits the data allows
    own_pq.cp.min_points_per_centroid = 1
    rotation.pq, rotation.referenced_objects = own_pq, [own_pq]  # keep it alive while the rotation trains
    return spec, inner, rotation


def _fit_mixed(spec: CodecSpec, train: np.ndarray, importance: np.ndarray | None) -> MixedCodec:
    top = train[:, : spec.m]
    weights = allocation.query_weights(top) if importance is None else np.asarray(importance, np.float64)[: spec.m]
    if weights.shape != (spec.m,) or (weights < 0).any():
        raise UserError(f"importance must be {spec.m} non-negative weights, got shape {np.shape(importance)}")
    mse = allocation.quantiser_table(top)[2]
    bits = allocation.allocate(weights[:, None] * mse, 8 * spec.bytes_per_vector)
    m = int(np.flatnonzero(bits)[-1]) + 1 if bits.any() else 1
    bits = bits[:m]
    lo, hi, _ = allocation.quantiser_table(unit_prefix(top[:, :m], bits > 0))  # ranges of what is stored
    chosen = lo[np.arange(m), bits], hi[np.arange(m), bits]
    fitted = replace(spec, m=m, bytes_per_vector=max(1, math.ceil(bits.sum() / 8)), params={"bits": bits.tolist()})
    return MixedCodec(fitted, *chosen, dim=train.shape[1])


def load(path, dim: int | None = None) -> Codec:
    """Read a codec written by :meth:`Codec.save`; UserError (one line) when it is not one.

    ``dim``: the width D of a binary code's vectors (a FAISS binary file records only m); others record D.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as err:
        raise UserError(f"cannot read codec {path}: {err.strerror}") from None
    try:
        if head.startswith(b"PK"):
            return _load_mixed(path)
        if head.startswith(b"IB"):
            index = faiss.read_index_binary(path)
            return BinaryCodec(CodecSpec("binary", index.d, index.code_size), index, dim or index.d)
        return _load_faiss(faiss.read_index(path))
    except (RuntimeError, ValueError, KeyError) as err:
        raise UserError(f"{path} is not a codec file ({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None


def _load_faiss(index: faiss.IndexPreTransform) -> FaissCodec:
    if not isinstance(index, faiss.IndexPreTransform):
        raise ValueError(f"a {type(index).__name__}, not a codec's IndexPreTransform")
    chain = [faiss.downcast_VectorTransform(index.chain.at(i)) for i in range(index.chain.size())]
    inner = faiss.downcast_index(index.index)
    m = inner.d
    if isinstance(inner, faiss.IndexFlat):
        spec = CodecSpec("float32", m, 4 * m)
    elif isinstance(inner, faiss.IndexScalarQuantizer):
        spec = CodecSpec("int8", m, inner.code_size)
    elif isinstance(inner, faiss.IndexResidualQuantizer):
        nbits = int(faiss.vector_to_array(inner.rq.nbits)[0])
        spec = CodecSpec("rq", m, inner.code_size, {"M": int(inner.rq.M), "nbits": nbits})
    else:
        codec = "opq" if len(chain) > 1 else "pq"  # the rotation is read back as a plain LinearTransform
        spec = CodecSpec(codec, m, inner.code_size, {"M": inner.pq.M, "nbits": inner.pq.nbits})
    return FaissCodec(spec, _cap_memory(index), chain[0].d_in)


def _load_mixed(path: str) -> MixedCodec:
    with np.load(path) as z:
        bits, codes = z["bits"].astype(np.int64), z["codes"]
        spec = CodecSpec("mixed", len(bits), codes.shape[1], {"bits": bits.tolist()})
        return MixedCodec(spec, z["lo"], z["hi"], int(z["dim"]), codes)
