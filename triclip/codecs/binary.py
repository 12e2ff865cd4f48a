"""``binary``: the signs of the top m dimensions (m a multiple of 8), m/8 bytes, searched by Hamming distance
(FAISS ``IndexBinaryFlat``).

The query is binarised too, as sentence-transformers' and FAISS's binary search do; the score returned is
``m - 2 * hamming``, the inner product of the two sign vectors.
"""

from __future__ import annotations

import math

import faiss
import numpy as np

from triclip.core.errors import UserError
from triclip.core.io import atomic_path
from triclip.codecs import ondisk
from triclip.codecs.base import Codec, prefix_candidates
from triclip.codecs.registry import register_codec
from triclip.codecs.spec import CodecSpec

FILE_HEAD = b"IBxF"  # FAISS's four characters for an IndexBinaryFlat


@register_codec("binary")
class BinaryCodec(Codec):
    """Sign bits of the top m dimensions in a FAISS ``IndexBinaryFlat`` (Hamming; the query is binarised)."""

    title = "binary top-m"
    family = "binary"
    file_head = FILE_HEAD  # how its FAISS file starts
    words = ("the sign of each of {first}, one bit each; the query's signs are compared with them (Hamming"
             " distance); {note}")
    symmetric = True

    def __init__(self, spec: CodecSpec, index: faiss.IndexBinaryFlat, dim: int):
        self.spec, self.index, self.dim = spec, index, dim

    @classmethod
    def candidates(cls, budget, dim, n=None):
        return prefix_candidates(cls.name, budget, dim, bits=1, step=8)

    @classmethod
    def fit(cls, spec, train, importance=None):
        if spec.m % 8:
            raise UserError(f"binary codes need m a multiple of 8, got {spec.m}")
        return cls(spec, faiss.IndexBinaryFlat(spec.m), train.shape[1])

    @classmethod
    def owns(cls, file):
        return file.head.startswith(cls.file_head)

    @classmethod
    def read(cls, file, dim):
        """A FAISS binary file records only m: ``dim`` gives D (None: D = m)."""
        index = faiss.read_index_binary(file.path)
        return cls(CodecSpec(cls.name, index.d, index.code_size), index, dim or index.d)

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Packed sign bits, as ``np.packbits(x > 0)``. Shape: (N, D) -> (N, m / 8) uint8."""
        return np.packbits(x[:, : self.spec.m] > 0, axis=1)

    def add(self, x):
        self.index.add(self.encode(self._check(x, "vectors")))

    def _search(self, q, k, params):
        dist, ids = self.index.search(self.encode(q), k)
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
            ondisk.write_index(self.index, tmp, binary=True)  # a failed write raises (FAISS's own can truncate)

    def empty_copy(self):
        return BinaryCodec(self.spec, faiss.IndexBinaryFlat(self.spec.m), self.dim)
