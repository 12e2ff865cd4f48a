"""``rq``: residual quantisation of the top m dimensions (FAISS ``IndexResidualQuantizer``, beam search).

M codebooks of 2^nbits centroids over the whole width, each encoding what the previous ones left (Chen et al.
2010, https://doi.org/10.3390/s101211259). Searched by lookup tables of the query against every codebook
(``ST_LUT_nonorm``: an inner product is linear in the sum of codewords, so this is exact, no norms stored).
"""

from __future__ import annotations

import faiss
import numpy as np

from triclip.core.errors import UserError
from triclip.codecs.base import METRIC, SLOW_FIT_ROWS
from triclip.codecs.faiss_codec import CodebookCodec
from triclip.codecs.registry import register_codec
from triclip.codecs.spec import CodecSpec

RQ_MEMORY = 256 << 20  # bytes of beam-search distance tables RQ encodes with at once (FAISS's default 5 GB:
# adding 300k vectors to an RQ16x8 peaked at 6.8 GB; with this cap 1.2 GB, the same codes, 1.6x faster)
RQ_MAX_CODES = 16  # most RQ codebooks among the candidates (RQ16x8 on 5k x 256: 14 s to train; RQ32x8 28 s for
# 99% of full-D recall, where mixed already keeps 99%)


class RQBooks:
    """The codebooks of a FAISS index holding an ``rq`` (IndexResidualQuantizer and its fast scan)."""

    def apply_settings(self):
        """Encode with :data:`RQ_MEMORY` of distance tables (a setting FAISS does not save in the file)."""
        faiss.downcast_index(self.index.index).rq.max_mem_distances = RQ_MEMORY

    @classmethod
    def codebooks(cls, inner):
        return inner.rq.M

    @classmethod
    def bits(cls, inner):
        return faiss.vector_to_array(inner.rq.nbits)[0]


@register_codec("rq")
class RQCodec(RQBooks, CodebookCodec):
    """M codebooks over all m dimensions, each coding the residual the ones before it left."""

    title = "RQ"
    family = "RQ"
    words = ("{M} codebooks of {entries}, over all {m} dimensions kept, each coding what the ones before it left;"
             " {note}")
    spans_all = True
    fit_cost = 2
    fit_rows = SLOW_FIT_ROWS

    @classmethod
    def candidates(cls, budget, dim, n=None):
        """One byte per codebook on the whole width, up to :data:`RQ_MAX_CODES` codebooks."""
        return [CodecSpec(cls.name, dim, budget, {"M": budget, "nbits": 8})] if budget <= RQ_MAX_CODES else []

    @classmethod
    def faiss_parts(cls, spec, n):
        spec = cls.allowed(spec, n)
        if n < spec.m:  # its progressive training starts from a PCA of the training vectors (FAISS asserts)
            raise UserError(f"{spec.label()} needs at least {spec.m} training vectors, got {n}")
        inner = faiss.IndexResidualQuantizer(spec.m, spec.params["M"], spec.params["nbits"], METRIC)
        inner.rq.search_type = faiss.AdditiveQuantizer.ST_LUT_nonorm  # exact for inner products, no norm bytes
        inner.rq.cp.min_points_per_centroid = 1
        inner.rq.max_mem_distances = RQ_MEMORY  # training encodes too
        return spec, inner, None

    @classmethod
    def probe(cls, spec, dim):
        """Random codebooks (its beam-search training takes 10-15 s even on 256 vectors)."""
        spec, inner, _ = cls.faiss_parts(spec, 1 << 30)
        rng = np.random.default_rng(0)
        books = rng.standard_normal(spec.params["M"] * (1 << spec.params["nbits"]) * spec.m).astype(np.float32)
        faiss.copy_array_to_vector(books, inner.rq.codebooks)
        inner.rq.is_trained = inner.is_trained = True
        return cls.twin(spec, dim, inner)

    @classmethod
    def owns_index(cls, inner, chain):
        return isinstance(inner, faiss.IndexResidualQuantizer)
