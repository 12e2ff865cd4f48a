"""``pq``: product quantisation of the top m dimensions, M sub-quantisers of nbits (FAISS ``IndexPQ``)."""

from __future__ import annotations

import faiss
import numpy as np

from triclip.codecs.base import METRIC
from triclip.codecs.faiss_codec import CodebookCodec
from triclip.codecs.registry import register_codec
from triclip.codecs.spec import CodecSpec

PQ_DIMS_PER_CODE = 4  # fewest dimensions per PQ sub-quantiser among the candidates


class PQBooks:
    """The codebook count and width of a FAISS index holding a ``pq`` (IndexPQ, IndexPQFastScan)."""

    @classmethod
    def codebooks(cls, inner):
        return inner.pq.M

    @classmethod
    def bits(cls, inner):
        return inner.pq.nbits


@register_codec("pq")
class PQCodec(PQBooks, CodebookCodec):
    """The leading m coordinates cut into M groups, each stored as its nearest centroid among 2^nbits."""

    title = "PQ"
    family = "PQ"
    words = ("{first} cut into {M} groups of {size}, each stored as the nearest entry of its own learnt codebook of"
             " {entries}; {note}")
    dims_per_code = PQ_DIMS_PER_CODE  # fewest dimensions per sub-quantiser among the candidates
    halves = True  # the candidates: on the largest multiple of M up to D, and half of it
    fit_cost = 1

    @classmethod
    def candidates(cls, budget, dim, n=None):
        """One byte per sub-quantiser (M = budget, 8 bits) on the largest multiple of M up to D (and half of it),
        with at least :attr:`dims_per_code` dimensions per sub-quantiser (finer codes cost minutes of k-means
        for what int8 / mixed give there)."""
        top = dim // budget * budget
        sizes = sorted({top, top // 2 // budget * budget} if cls.halves else {top}, reverse=True)
        return [CodecSpec(cls.name, m, budget, {"M": budget, "nbits": 8}) for m in sizes if m >= cls.dims_per_code * budget]

    @classmethod
    def faiss_parts(cls, spec, n):
        spec = cls.allowed(spec, n)
        inner = faiss.IndexPQ(spec.m, spec.params["M"], spec.params["nbits"], METRIC)
        inner.pq.cp.min_points_per_centroid = 1  # small collections: train anyway, without a warning per k-means
        return spec, inner, None

    @classmethod
    def probe(cls, spec, dim):
        """Random centroids (nothing trained); :mod:`.opq` adds a random rotation, as costly as its learnt one."""
        spec, inner, _ = PQCodec.faiss_parts(spec, 1 << 30)
        rng = np.random.default_rng(0)
        faiss.copy_array_to_vector(rng.standard_normal(inner.pq.centroids.size()).astype(np.float32), inner.pq.centroids)
        inner.is_trained = True
        rotation = None
        if cls.name == "opq":
            rotation = faiss.RandomRotationMatrix(spec.m, spec.m)
            rotation.init(0)
        return cls.twin(spec, dim, inner, rotation)

    @classmethod
    def owns_index(cls, inner, chain):
        return isinstance(inner, faiss.IndexPQ) and len(chain) == 1  # the dimension remap only: no rotation
