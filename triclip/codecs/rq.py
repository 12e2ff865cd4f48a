"""``rq``: residual quantisation of the top m dimensions (FAISS ``IndexResidualQuantizer``, beam search).

M codebooks of 2^nbits centroids over the whole width, each encoding what the previous ones left (Chen et al.
2010, https://doi.org/10.3390/s101211259). Searched by lookup tables of the query against every codebook
(``ST_LUT_nonorm``: an inner product is linear in the sum of codewords, so this is exact, no norms stored).
"""

from __future__ import annotations

from collections import OrderedDict

import faiss
import numpy as np

from triclip.core.errors import UserError
from triclip.codecs.base import METRIC, SLOW_FIT_ROWS, rows_key, unit_prefix
from triclip.codecs.faiss_codec import CodebookCodec
from triclip.codecs.registry import register_codec
from triclip.codecs.spec import CodecSpec

RQ_MEMORY = 256 << 20  # bytes of beam-search distance tables RQ encodes with at once (FAISS's default 5 GB:
# adding 300k vectors to an RQ16x8 peaked at 6.8 GB; with this cap 1.2 GB, the same codes, 1.6x faster)
RQ_MAX_CODES = 16  # most RQ codebooks among the candidates (RQ16x8 on 5k x 256: 14 s to train; RQ32x8 28 s for
# 99% of full-D recall, where mixed already keeps 99%)
BOOKS_KEPT = 4  # fits whose codebooks are remembered for a later fit of fewer codebooks on the same rows (RQBooks.fit)
_BOOKS: "OrderedDict[tuple, tuple[int, np.ndarray]]" = OrderedDict()  # (codec, m, nbits, rows) -> (M, codebooks)


class RQBooks:
    """The codebooks of a FAISS index holding an ``rq`` (IndexResidualQuantizer and its fast scan).

    FAISS trains them one after another, each on what the ones before it left (beam search of the rows over the
    codebooks so far), so the first M codebooks of a fit of more on the same rows are the fit of M: :meth:`fit`
    keeps the last fits' codebooks and cuts a fit of fewer from them, the same code in the same file
    (tests/codecs/test_rq_books.py), where training them again took most of a budget's choice (RQ16x8 on 5,000
    caption vectors: ~25 s; its 8 and 4 codebooks then cost nothing). ``index build`` measures its budgets
    largest first for this (triclip.index.budgets.choose_all).
    """

    @classmethod
    def fit(cls, spec, train, importance=None):
        n, dim = train.shape
        small, inner, _ = cls.faiss_parts(spec, n)
        key = (cls.name, small.m, small.params["nbits"], rows_key(train))
        books = _BOOKS.get(key)
        if books is None or books[0] < small.params["M"]:
            codec = super().fit(spec, train, importance)
            _remember(key, small.params["M"], faiss.vector_to_array(codec.inner_rq().codebooks))
            return codec
        _BOOKS.move_to_end(key)
        _cut(inner.rq, books[1], unit_prefix(train, small.m))
        inner.is_trained = True
        return cls.twin(small, dim, inner)

    def inner_rq(self):
        """The fitted residual quantiser inside the pre-transform."""
        return faiss.downcast_index(self.index.index).rq

    def apply_settings(self):
        """Encode with :data:`RQ_MEMORY` of distance tables (a setting FAISS does not save in the file)."""
        self.inner_rq().max_mem_distances = RQ_MEMORY

    @classmethod
    def codebooks(cls, inner):
        return inner.rq.M

    @classmethod
    def bits(cls, inner):
        return faiss.vector_to_array(inner.rq.nbits)[0]


def _remember(key: tuple, codebooks: int, books: np.ndarray) -> None:
    _BOOKS[key] = (codebooks, books)
    _BOOKS.move_to_end(key)
    while len(_BOOKS) > BOOKS_KEPT:
        _BOOKS.popitem(last=False)


def _cut(rq, books: np.ndarray, x: np.ndarray) -> None:
    """Train ``rq`` (untrained, M codebooks) from the first M of ``books`` (a fit of more on the rows ``x``, (n, m)),
    as its own training would leave it: the codebooks, their lookup tables for encoding, and the smallest and
    largest squared norm of the rows' codes (``norm_min`` / ``norm_max``, computed as FAISS does: each row against
    its residual after the codebooks, one codebook subtracted at a time)."""
    size = rq.M * (1 << int(rq.nbits.at(0))) * rq.d
    faiss.copy_array_to_vector(np.ascontiguousarray(books[:size]), rq.codebooks)
    rq.is_trained = True
    rq.compute_codebook_tables()
    codes = rq.compute_codes(x)  # (n, code bytes): the beam search training ends with
    unpacked = _unpack(rq, codes)  # (n, M) entry per codebook
    table = books[:size].reshape(rq.M, -1, rq.d)
    residual = x.copy()
    for stage in range(rq.M):
        residual -= table[stage][unpacked[:, stage]]
    norms = np.array([faiss.fvec_L2sqr(faiss.swig_ptr(x[i]), faiss.swig_ptr(residual[i]), rq.d) for i in range(len(x))])
    rq.norm_min, rq.norm_max = float(norms.min()), float(norms.max())


def _unpack(rq, codes: np.ndarray) -> np.ndarray:
    """(n, M) codebook entries of FAISS's packed codes (nbits each, least significant bit first)."""
    bits = np.unpackbits(codes, axis=1, bitorder="little")[:, : rq.M * int(rq.nbits.at(0))]
    return (bits.reshape(len(codes), rq.M, -1) << np.arange(int(rq.nbits.at(0)))).sum(axis=2)


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
