"""``opq``: an OPQ rotation (FAISS ``OPQMatrix``) learnt on the top m dimensions, then PQ."""

from __future__ import annotations

import faiss

from triclip.core.errors import UserError
from triclip.codecs.pq import PQCodec
from triclip.codecs.base import SLOW_FIT_ROWS
from triclip.codecs.registry import register_codec

OPQ_DIMS_PER_CODE = 8  # fewest dimensions per OPQ sub-quantiser (OPQ64 on 5k x 256 vectors: 3.5 min of training at D/4)
OPQ_ROWS_AT_N = 65_536  # rows the rotation and codebooks are refitted on inside lists sized for N: at 8 B in 4,096
# lists (200k rows of the 1M haystack) 50,000 rows held .417 of the exact top 10 scanning every list, 5,000 .370
OPQ_ITERATIONS = 20  # OPQMatrix.niter (FAISS's default 50 trains 2.5x longer)


@register_codec("opq")
class OPQCodec(PQCodec):
    """PQ after a learnt rotation of the leading m coordinates (the rotation is stored with the code)."""

    title = "OPQ + PQ"
    family = "OPQ+PQ"
    words = ("{first} turned by a learnt rotation, then cut into {M} groups of {size}, each stored as the nearest"
             " entry of its own learnt codebook of {entries}; {note}")
    dims_per_code = OPQ_DIMS_PER_CODE
    halves = False  # the largest m only
    fit_rows = SLOW_FIT_ROWS
    fit_rows_at_n = OPQ_ROWS_AT_N  # at N the build's one fit: a rotation fitted on 5,000 rows loses recall there

    @classmethod
    def faiss_parts(cls, spec, n):
        spec, inner, _ = super().faiss_parts(spec, n)
        sub, nbits = spec.params["M"], spec.params["nbits"]
        if nbits < 8:  # FAISS 1.15's OPQMatrix corrupts the heap (the process aborts) training codes under 8 bits
            raise UserError(f"{spec.label()} needs at least 256 training vectors (8-bit codes), got {n}")
        rotation = faiss.OPQMatrix(spec.m, sub)
        rotation.niter = OPQ_ITERATIONS
        own_pq = faiss.ProductQuantizer(spec.m, sub, nbits)  # OPQ's own k-means at the nbits the data allows
        own_pq.cp.min_points_per_centroid = 1
        rotation.pq, rotation.referenced_objects = own_pq, [own_pq]  # keep it alive while the rotation trains
        return spec, inner, rotation

    @classmethod
    def owns_index(cls, inner, chain):
        return isinstance(inner, faiss.IndexPQ) and len(chain) > 1  # the rotation is read back as a LinearTransform
