"""``rqfs``: residual quantisation with 4-bit codebooks searched by fast scan (FAISS
``IndexResidualQuantizerFastScan``, ``RQ{M}x4fs``).

M codebooks of 16 centroids over the whole width, each coding what the ones before it left (as :mod:`.rq`), two
codes per byte, scanned from 8-bit lookup tables in SIMD registers (as :mod:`.pqfs`). On the demo's vectors at 8 B
its top 10 overlap exact float32 search by .36 (RQ8x8 .48, PQ8x8 .29) and it scans 10-30x faster than RQ8x8
(docs/benchmarks.md). Trains by beam search like RQ: the slowest of the fast codes to fit.
"""

from __future__ import annotations

import faiss

from triclip.core.errors import UserError
from triclip.codecs.base import METRIC, SLOW_FIT_ROWS
from triclip.codecs.faiss_codec import CodebookCodec
from triclip.codecs.pqfs import FAST_BITS
from triclip.codecs.registry import register_codec
from triclip.codecs.rq import RQ_MEMORY, RQBooks
from triclip.codecs.spec import CodecSpec

RQFS_MAX_CODES = 16  # most codebooks among the candidates (RQ16x4fs on 5k x 256: ~20 s to train on a shared
# machine; RQ32x4fs twice that, at 16 B where PQ32x4fs trains in a second)


@register_codec("rqfs")
class RQFastScanCodec(RQBooks, CodebookCodec):
    """M codebooks of 16 centroids over all m dimensions, each coding the residual the ones before it left."""

    title = "RQ 4-bit fast scan"
    family = "RQ fast scan"
    words = ("{M} codebooks of 16 entries (4 bits each) over all {m} dimensions, each coding what the ones before"
             " it left, scanned 32 codes at a time from 8-bit lookup tables; {note}")
    spans_all = True
    exact_scan = False
    fit_cost = 2
    fit_rows = SLOW_FIT_ROWS
    label_format = "rq{M}x4fs m={m}"

    @classmethod
    def candidates(cls, budget, dim, n=None):
        """Two codebooks per byte on the whole width, up to :data:`RQFS_MAX_CODES` codebooks."""
        sub = 2 * budget
        return [CodecSpec(cls.name, dim, budget, {"M": sub, "nbits": FAST_BITS})] if sub <= RQFS_MAX_CODES else []

    @classmethod
    def faiss_parts(cls, spec, n):
        spec = cls.allowed(spec, n)
        if spec.params["nbits"] != FAST_BITS:
            raise UserError(f"{spec.codec} needs at least {2 ** FAST_BITS} training vectors, got {n}")
        if n < spec.m:  # its progressive training starts from a PCA of the training vectors (FAISS asserts)
            raise UserError(f"{spec.label()} needs at least {spec.m} training vectors, got {n}")
        inner = faiss.index_factory(spec.m, f"RQ{spec.params['M']}x{FAST_BITS}fs", METRIC)  # downcast by faiss
        inner.rq.cp.min_points_per_centroid = 1
        inner.rq.max_mem_distances = RQ_MEMORY
        return spec, inner, None

    @classmethod
    def owns_index(cls, inner, chain):
        return isinstance(inner, faiss.IndexResidualQuantizerFastScan)
