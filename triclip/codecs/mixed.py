"""``mixed``: the importance-aware mixed-precision code of :mod:`triclip.codecs.allocation`.

b_j bits of a uniform scalar quantiser on dimension j, allocated by minimising the modelled error of the
query-image score (0 bits prune a dimension; top-m pruning is the special case). Written by hand because FAISS
has no quantiser with a different bit width per dimension (``ScalarQuantizer`` uses one width for all). Its
packed bytes are searched by FAISS's ``IndexPQ`` lookup tables all the same (see :class:`MixedCodec`).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import replace

import faiss
import numpy as np

from triclip.core.errors import UserError
from triclip.core.io import atomic_path
from triclip.codecs import allocation
from triclip.codecs.base import METRIC, Codec, bytes_note, first, rows_key, unit_prefix
from triclip.codecs.registry import register_codec
from triclip.codecs.spec import CodecSpec

FILE_HEAD = b"PK"  # numpy's .npz (a zip)
TABLES_KEPT = 2  # error tables remembered (one per side of an index build: every budget's fit reads the same one)
_TABLES: "OrderedDict[str, np.ndarray]" = OrderedDict()  # hash of the rows -> their (m, MAX_BITS + 1) errors
_TABLES_LOCK = threading.Lock()  # fits in several threads share the tables


@register_codec("mixed")
class MixedCodec(Codec):
    """Per-dimension bit widths (:mod:`triclip.codecs.allocation`), bit-packed, searched by FAISS's PQ lookup tables.

    A decoded coordinate is linear in its cell index (``lo + (c + 0.5) * step``), so a score ``q . x_hat`` is a
    constant per query plus a weighted sum of the stored BITS, each bit weighing ``q_j * step_j * 2^shift``.
    Byte b of the packed code then adds ``LUT_b[byte]``: exactly FAISS ``IndexPQ``'s asymmetric distance with B
    sub-quantisers of 8 bits whose 256 centroids are the 256 bit patterns of a byte, searched with the per-bit
    weights as the query. The packed bytes are that index's codes (``add_sa_codes``; stored once, in FAISS), so
    a mixed code is searched as fast as PQ with as many bytes (no decoding); the constant is added back.
    """

    title = "mixed precision (S-aware)"
    family = "mixed"
    label_format = "mixed {bytes}B m={m}"

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

    @classmethod
    def describe(cls, spec):
        if "bits" not in spec.params:  # a candidate, before the allocation
            return (f"{spec.label()}: each of {first(spec.m)} gets its own number of bits (0 to {allocation.MAX_BITS}),"
                    f" more where it matters more to the score, {8 * spec.bytes_per_vector} bits in all; 0 bits"
                    f" drop a dimension; {bytes_note(spec)}")
        bits = np.asarray(spec.params["bits"])
        kept = bits[bits > 0]
        if not len(kept):  # no weight on any dimension
            return f"{spec.label()}: no dimension kept (every bit width 0); {bytes_note(spec)}"
        return (f"{spec.label()}: {len(kept)} of the first {spec.m} dimensions kept, with {kept.min()} to"
                f" {kept.max()} bits each ({bits.sum()} bits in all, more where a dimension matters more to the"
                f" score), the other {spec.m - len(kept)} dropped; {bytes_note(spec)}")

    @classmethod
    def candidates(cls, budget, dim, n=None):
        """The whole width: the allocation decides which dimensions get bits."""
        return [CodecSpec(cls.name, dim, budget, {})]

    @classmethod
    def fit(cls, spec, train, importance=None):
        """``importance`` (D,): the query side's weight per dimension, ``E[q_j^2]`` up to scale
        (``allocation.query_weights(text_embeddings)``; the run's S is a proxy). None: the collection's own second
        moment (served image and text vectors share the basis and its scaling)."""
        top = train[:, : spec.m]
        weights = allocation.query_weights(top) if importance is None else np.asarray(importance, np.float64)[: spec.m]
        if weights.shape != (spec.m,) or (weights < 0).any():
            raise UserError(f"importance must be {spec.m} non-negative weights, got shape {np.shape(importance)}")
        bits = allocation.allocate(weights[:, None] * _errors(top), 8 * spec.bytes_per_vector)
        m = int(np.flatnonzero(bits)[-1]) + 1 if bits.any() else 1
        bits = bits[:m]
        chosen = allocation.quantiser_ranges(unit_prefix(top[:, :m], bits > 0), bits)  # ranges of what is stored
        fitted = replace(spec, m=m, bytes_per_vector=max(1, math.ceil(bits.sum() / 8)), params={"bits": bits.tolist()})
        return cls(fitted, *chosen, dim=train.shape[1])

    @classmethod
    def owns(cls, file):
        return file.head.startswith(FILE_HEAD)

    @classmethod
    def read(cls, file, dim):
        with np.load(file.path) as z:
            bits, codes = z["bits"].astype(np.int64), z["codes"]
            spec = CodecSpec(cls.name, len(bits), codes.shape[1], {"bits": bits.tolist()})
            return cls(spec, z["lo"], z["hi"], int(z["dim"]), codes)

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

    def _search(self, q, k, params):
        q = np.where(self.bits > 0, q[:, : self.spec.m], np.float32(0))  # pruned dimensions score nothing
        step = np.maximum(self.hi - self.lo, 1e-12) / np.exp2(self.bits)  # (m,) as allocation.dequantise
        dims, shifts = allocation.bit_layout(self.bits)
        per_bit = np.zeros((len(q), 8 * self.spec.bytes_per_vector), np.float32)  # (Q, 8B), padding bits weigh 0
        per_bit[:, : len(dims)] = q[:, dims] * (step[dims] * np.exp2(shifts))
        constant = q @ (self.lo + 0.5 * step)  # (Q,)
        scores, ids = self.index.search(per_bit, k)
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


def _errors(rows: np.ndarray) -> np.ndarray:
    """``allocation.quantiser_table(rows)``'s errors, remembered for the last :data:`TABLES_KEPT` row sets: the
    budgets of an index build fit the code on the same rows, and the table took most of each fit (0.7 s of 0.9-2 s
    on the demo's 5,443 images and 11,987 captions). Shape: (N, m) -> (m, MAX_BITS + 1)."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    key = rows_key(rows)
    with _TABLES_LOCK:
        table = _TABLES.pop(key, None)
    if table is None:
        table = allocation.quantiser_table(rows)[2]
        table.flags.writeable = False  # shared by the fits that read it
    with _TABLES_LOCK:  # the last used at the end; the oldest dropped
        _TABLES[key] = table
        while len(_TABLES) > TABLES_KEPT:
            _TABLES.popitem(last=False)
    return table
