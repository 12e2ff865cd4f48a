"""Codes kept by a FAISS index behind ``IndexPreTransform(RemapDimensionsTransform(D, m), ...)``.

:class:`FaissCodec`: such an index takes full-width queries and records D in its file; a codec says which inner
index (and rotation) it builds (:meth:`FaissCodec.faiss_parts`) and recognises its own in a file
(:meth:`FaissCodec.owns_index`). :class:`CodebookCodec`: those of M codebooks of 2^nbits entries (pq, opq, rq).
"""

from __future__ import annotations

import math
from dataclasses import replace

import faiss
import numpy as np

from triclip.core.errors import UserError
from triclip.core.io import atomic_path
from triclip.codecs import ondisk
from triclip.codecs.base import Codec, CodecFile, unit_prefix
from triclip.codecs.spec import CodecSpec

FILE_HEAD = b"IxPT"  # FAISS's four characters for an IndexPreTransform


class FaissCodec(Codec):
    """A FAISS index taking full-width vectors and keeping the top m (re-normalised to unit length).

    A code with search settings (an IVF code's nprobe) overrides :meth:`search_parameters` to return FAISS's
    ``SearchParameters`` (e.g. ``faiss.SearchParametersIVF(nprobe=16)``): ``IndexPreTransform`` hands them to
    the inner index for that call only, the index's own ``nprobe`` unchanged.
    """

    def __init__(self, spec: CodecSpec, index: faiss.IndexPreTransform, dim: int):
        self.spec, self.index, self.dim = spec, index, dim
        self.apply_settings()

    @classmethod
    def faiss_parts(cls, spec: CodecSpec, n: int) -> tuple[CodecSpec, faiss.Index, faiss.VectorTransform | None]:
        """(spec as the n training vectors allow, untrained inner index over m dimensions, rotation or None)."""
        raise NotImplementedError

    @classmethod
    def owns_index(cls, inner: faiss.Index, chain: list) -> bool:
        """Whether an IndexPreTransform with this inner index (downcast) and transforms is this codec's."""
        raise NotImplementedError

    @classmethod
    def spec_of(cls, inner: faiss.Index, chain: list) -> CodecSpec:
        """The spec of an index this codec owns (its inner index spans the m dimensions kept)."""
        return CodecSpec(cls.name, inner.d, inner.code_size)

    def apply_settings(self) -> None:
        """Settings FAISS does not keep in the file, set on every fitted, copied or loaded index (none here)."""

    @classmethod
    def fit(cls, spec, train, importance=None):
        n, dim = train.shape
        spec, inner, rotation = cls.faiss_parts(spec, n)
        index = faiss.IndexPreTransform(inner) if rotation is None else faiss.IndexPreTransform(rotation, inner)
        index.prepend_transform(faiss.RemapDimensionsTransform(dim, spec.m, False))
        index.train(unit_prefix(train, spec.m))
        index = faiss.deserialize_index(faiss.serialize_index(index))  # one object that owns all its parts
        return cls(spec, index, dim)

    @classmethod
    def owns(cls, file: CodecFile) -> bool:
        if not file.head.startswith(FILE_HEAD):
            return False
        return cls.owns_index(*_parts(file.faiss_index))

    @classmethod
    def read(cls, file, dim):
        inner, chain = _parts(file.faiss_index)
        return cls(cls.spec_of(inner, chain), file.faiss_index, chain[0].d_in)

    def add(self, x):
        self.index.add(unit_prefix(self._check(x, "vectors"), self.spec.m))

    def _search(self, q, k, params):
        return self.index.search(q, k) if params is None else self.index.search(q, k, params=params)

    def reconstruct(self, ids=None):
        ids = self._ids(ids)
        return self.index.reconstruct_batch(ids) if len(ids) else np.zeros((0, self.dim), np.float32)

    def add_random(self, n, rng):
        """Random codes straight into FAISS's array where it takes them (``add_sa_codes``), else random vectors."""
        inner = faiss.downcast_index(self.index.index)
        if isinstance(inner, faiss.IndexFlatCodes) and not isinstance(inner, faiss.IndexFastScan):
            inner.add_sa_codes(rng.integers(0, 256, (n, inner.sa_code_size()), dtype=np.uint8))
            self.index.ntotal = inner.ntotal
        else:
            super().add_random(n, rng)

    @classmethod
    def twin(cls, spec: CodecSpec, dim: int, inner: faiss.Index, rotation=None):
        """A codec of ``spec`` over an already trained (random) ``inner`` index: :meth:`probe`'s twins."""
        index = faiss.IndexPreTransform(inner) if rotation is None else faiss.IndexPreTransform(rotation, inner)
        index.prepend_transform(faiss.RemapDimensionsTransform(dim, spec.m, False))
        return cls(spec, faiss.deserialize_index(faiss.serialize_index(index)), dim)

    def __len__(self):
        return int(self.index.ntotal)

    def code_bytes(self) -> int:
        """The codes proper: n x FAISS's code size (a fast-scan code pads its array to blocks of 32 rows)."""
        inner = faiss.downcast_index(self.index.index)
        return int(inner.ntotal) * int(inner.code_size)

    def ram_bytes(self) -> int:
        """What the code holds in memory for its vectors: the code array (padding included) and any ids."""
        inner = faiss.downcast_index(self.index.index)
        return int(inner.codes.size()) if hasattr(inner, "codes") else self.code_bytes()

    def save(self, path):
        with atomic_path(path) as tmp:
            ondisk.write_index(self.index, tmp)  # a failed write raises (FAISS's own writer can truncate)

    def empty_copy(self):
        try:
            index = faiss.clone_index(self.index)
        except RuntimeError:  # FAISS 1.15.1 clones no IndexRaBitQFastScan: a copy through its file format
            index = faiss.deserialize_index(faiss.serialize_index(self.index))
        index.reset()
        return type(self)(self.spec, index, self.dim)


def _parts(index: faiss.IndexPreTransform) -> tuple[faiss.Index, list]:
    """(inner index, downcast; its transforms, first applied first)."""
    chain = [faiss.downcast_VectorTransform(index.chain.at(i)) for i in range(index.chain.size())]
    return faiss.downcast_index(index.index), chain


class CodebookCodec(FaissCodec):
    """M codebooks of 2^nbits entries, one code of nbits each per vector (``params``: ``{"M", "nbits"}``).

    k-means needs at least ``2**nbits`` training vectors: on a smaller collection the fitted spec lowers nbits
    to ``floor(log2(N))`` (its bytes per vector shrink with it); below 2 vectors it is refused.
    """

    spans_all: bool = False  # each codebook spans all m dimensions (rq), not m / M of them (pq)
    label_format = "{codec}{M}x{nbits} m={m}"

    @classmethod
    def spec_of(cls, inner, chain):
        return CodecSpec(cls.name, inner.d, inner.code_size, {"M": int(cls.codebooks(inner)), "nbits": int(cls.bits(inner))})

    @classmethod
    def codebooks(cls, inner) -> int:
        raise NotImplementedError

    @classmethod
    def bits(cls, inner) -> int:
        raise NotImplementedError

    @classmethod
    def allowed(cls, spec: CodecSpec, n: int) -> CodecSpec:
        """``spec`` with the nbits that n training vectors allow, and its bytes per vector; UserError when none."""
        sub, nbits = int(spec.params.get("M", spec.bytes_per_vector)), int(spec.params.get("nbits", 8))
        if spec.m % sub and not cls.spans_all:
            raise UserError(f"{spec.label()}: m must be a multiple of M = {sub}")
        nbits = min(nbits, int(math.log2(n)) if n >= 2 else 0)
        if nbits < 1:
            raise UserError(f"{spec.codec} needs at least 2 training vectors, got {n}")
        return replace(spec, bytes_per_vector=math.ceil(sub * nbits / 8), params={"M": sub, "nbits": nbits})

    @classmethod
    def fields(cls, spec: CodecSpec) -> dict:
        return {**super().fields(spec), "entries": cls.entries(spec)}

    @classmethod
    def entries(cls, spec: CodecSpec) -> str:
        """'256 entries, one byte each' (nbits < 8: 'of 32 entries, 5 bits each') for :meth:`describe`."""
        nbits = spec.params["nbits"]
        return f"{2 ** nbits} entries, " + ("one byte each" if nbits == 8 else f"{nbits} bits each")
