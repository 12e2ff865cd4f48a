"""``pqfs``: product quantisation with 4-bit codes searched by fast scan (FAISS ``IndexPQFastScan``, ``PQ{M}x4fs``).

M sub-quantisers of 16 centroids, two per byte; a query's lookup tables are quantised to 8 bits and held in SIMD
registers, so a scan reads 32 codes per instruction (André et al. 2015, https://arxiv.org/abs/1812.09162). Its
scores are estimates (the tables' 8-bit rounding: within ~0.002 of the exact inner product with the decoded
vectors on unit vectors). At 1M vectors of D = 256, one query, one thread: 0.38 ms for PQ32x4fs against 16.8 ms
for PQ16x8 at the same 16 bytes (docs/benchmarks.md), and it trains in under a second.
"""

from __future__ import annotations

import faiss

from triclip.core.errors import UserError
from triclip.codecs.base import METRIC
from triclip.codecs.faiss_codec import CodebookCodec
from triclip.codecs.pq import PQBooks
from triclip.codecs.registry import register_codec
from triclip.codecs.spec import CodecSpec

FAST_BITS = 4  # fast scan's only width


@register_codec("pqfs")
class PQFastScanCodec(PQBooks, CodebookCodec):
    """The leading m coordinates cut into M groups, each stored as one of 16 centroids (4 bits), scanned by SIMD."""

    title = "PQ 4-bit fast scan"
    family = "PQ fast scan"
    words = ("{first} cut into {M} groups of {size}, each stored as the nearest of 16 learnt centroids (4 bits),"
             " scanned 32 codes at a time from 8-bit lookup tables; {note}")
    exact_scan = False
    label_format = "pq{M}x4fs m={m}"

    @classmethod
    def candidates(cls, budget, dim, n=None):
        """Two sub-quantisers per byte (M = 2 x budget) on the largest multiple of M up to D."""
        sub = 2 * budget
        m = dim // sub * sub
        return [CodecSpec(cls.name, m, budget, {"M": sub, "nbits": FAST_BITS})] if m >= sub else []

    @classmethod
    def faiss_parts(cls, spec, n):
        spec = cls.allowed(spec, n)
        if spec.params["nbits"] != FAST_BITS:  # fast scan has no narrower codes
            raise UserError(f"{spec.codec} needs at least {2 ** FAST_BITS} training vectors, got {n}")
        inner = faiss.index_factory(spec.m, f"PQ{spec.params['M']}x{FAST_BITS}fs", METRIC)
        faiss.downcast_index(inner).pq.cp.min_points_per_centroid = 1
        return spec, inner, None

    @classmethod
    def owns_index(cls, inner, chain):
        return isinstance(inner, faiss.IndexPQFastScan) and len(chain) == 1
