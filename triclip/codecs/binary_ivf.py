"""``binary_ivf``: the sign bits of :mod:`.binary` in inverted lists (FAISS ``IndexBinaryIVF``): k-means in
Hamming space cuts the collection into ``nlist`` lists, a binarised query scans its ``nprobe`` nearest.

The lists, ``nlist`` and ``nprobe`` follow :mod:`.ivf` (same sizes, same per-call ``SearchParametersIVF``); binary
codes live in FAISS's ``IndexBinary`` family, so this is its own small codec rather than an inner code of ``ivf``.
"""

from __future__ import annotations

import faiss
import numpy as np

from triclip.core.errors import UserError
from triclip.codecs.binary import BinaryCodec
from triclip.codecs import ivf
from triclip.codecs.ivf import TRAIN_PER_LIST, lists_for
from triclip.codecs.registry import register_codec
from triclip.codecs.spec import CodecSpec

FILE_HEAD = b"IBwF"  # FAISS's four characters for an IndexBinaryIVF


@register_codec("binary_ivf")
class BinaryIVFCodec(BinaryCodec):
    """Sign bits of the top m dimensions in Hamming-space inverted lists (``params``: ``nlist``, ``nprobe``)."""

    title = "binary top-m, inverted lists"
    family = "binary IVF"
    file_head = FILE_HEAD
    label_format = "binary_ivf{nlist}/{nprobe} m={m}"
    words = ("the sign of each of the first {m} dimensions, one bit each, in {nlist} lists by Hamming k-means; a"
             " binarised query scans the {nprobe} nearest lists (plus an 8-byte id per vector); {bytes} bytes per vector")

    @classmethod
    def candidates(cls, budget, dim, n=None):
        """:mod:`.binary`'s largest m in lists of :func:`~triclip.codecs.ivf.lists_for` n; none below
        :data:`~triclip.codecs.ivf.IVF_MIN_N`."""
        if n is None or n < ivf.IVF_MIN_N:  # read here: tests lower it
            return []
        nlist = lists_for(n)
        return [CodecSpec(cls.name, s.m, s.bytes_per_vector, {"nlist": nlist, "nprobe": max(1, nlist // 64)})
                for s in BinaryCodec.candidates(budget, dim, n)[:1]]

    @classmethod
    def fit(cls, spec, train, importance=None):
        if spec.m % 8:
            raise UserError(f"binary codes need m a multiple of 8, got {spec.m}")
        nlist = max(1, min(int(spec.params["nlist"]), len(train) // TRAIN_PER_LIST))
        quantizer = faiss.IndexBinaryFlat(spec.m)  # alive until the copy below, which owns its own
        index = faiss.IndexBinaryIVF(quantizer, spec.m, nlist)
        index.cp.seed, index.cp.min_points_per_centroid = 0, 1
        index.nprobe = max(1, min(int(spec.params.get("nprobe", 1)), nlist))
        index.train(np.packbits(train[:, : spec.m] > 0, axis=1))
        spec = CodecSpec(cls.name, spec.m, spec.m // 8, {"nlist": nlist, "nprobe": int(index.nprobe)})
        return cls(spec, faiss.deserialize_index_binary(faiss.serialize_index_binary(index)), train.shape[1])

    @classmethod
    def read(cls, file, dim):
        index = faiss.read_index_binary(file.path)
        spec = CodecSpec(cls.name, index.d, index.code_size, {"nlist": int(index.nlist), "nprobe": int(index.nprobe)})
        return cls(spec, index, dim or index.d)

    def search_parameters(self, params):
        """``{"nprobe": n}`` for this call only; None: the code's own."""
        if not params:
            return None
        if set(params) != {"nprobe"} or isinstance(params["nprobe"], bool) or int(params["nprobe"]) < 1:
            raise UserError(f"{self.spec.label()} takes a positive nprobe only, got {params!r}")
        return faiss.SearchParametersIVF(nprobe=int(min(params["nprobe"], self.index.nlist)))

    def exhaustive(self):
        return {"nprobe": int(self.index.nlist)}

    def set_nprobe(self, nprobe: int) -> None:
        """Make ``nprobe`` the code's own (saved with it). Before serving only."""
        self.index.nprobe = int(max(1, min(nprobe, self.index.nlist)))
        self.spec = CodecSpec(self.spec.codec, self.spec.m, self.spec.bytes_per_vector,
                              {**self.spec.params, "nprobe": int(self.index.nprobe)})

    def _search(self, q, k, params):
        dist, ids = self.index.search(self.encode(q), k, params=params) if params else self.index.search(self.encode(q), k)
        return (self.spec.m - 2 * dist).astype(np.float32), ids

    def reconstruct(self, ids=None):
        ids = self._ids(ids)
        if len(ids) and not self.index.direct_map.type:
            self.index.make_direct_map()  # an id -> (list, offset) table, 8 bytes per vector, kept from then on
        return super().reconstruct(ids)

    def code_bytes(self) -> int:
        return int(self.index.ntotal) * int(self.index.code_size)

    def ram_bytes(self) -> int:
        return self.code_bytes() + 8 * int(self.index.ntotal)

    def empty_copy(self):
        index = faiss.deserialize_index_binary(faiss.serialize_index_binary(self.index))
        index.reset()
        return BinaryIVFCodec(self.spec, index, self.dim)
