"""``pq``: product quantisation of the top m dimensions, M sub-quantisers of nbits (FAISS ``IndexPQ``)."""

from __future__ import annotations

import faiss

from triclip.index.codecs.base import METRIC, bytes_note, first
from triclip.index.codecs.faiss_codec import CodebookCodec
from triclip.index.codecs.registry import register_codec
from triclip.index.codecs.spec import CodecSpec

PQ_DIMS_PER_CODE = 4  # fewest dimensions per PQ sub-quantiser among the candidates


@register_codec("pq")
class PQCodec(CodebookCodec):
    """The leading m coordinates cut into M groups, each stored as its nearest centroid among 2^nbits."""

    title = "PQ"
    family = "PQ"
    dims_per_code = PQ_DIMS_PER_CODE  # fewest dimensions per sub-quantiser among the candidates
    halves = True  # the candidates: on the largest multiple of M up to D, and half of it

    @classmethod
    def describe(cls, spec):
        groups = spec.params["M"]
        return (f"{spec.label()}: {first(spec.m)} cut into {groups} groups of {spec.m // groups}, each"
                f" stored as the nearest entry of its own learnt codebook of {cls.entries(spec)}; {bytes_note(spec)}")

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
    def owns_index(cls, inner, chain):
        return isinstance(inner, faiss.IndexPQ) and len(chain) == 1  # the dimension remap only: no rotation

    @classmethod
    def codebooks(cls, inner):
        return inner.pq.M

    @classmethod
    def bits(cls, inner):
        return inner.pq.nbits
