"""``rabitq`` and ``rabitqfs``: RaBitQ (Gao and Long 2024, https://arxiv.org/abs/2405.12497) of the top m
dimensions: one bit per dimension after a random rotation about the collection's centre, plus two float factors
per vector (FAISS ``IndexRaBitQ``; ``rabitqfs``: ``IndexRaBitQFastScan``, the same code scanned 32 at a time).

Its scores are the estimator's, not the inner product with the decoded vectors. A code of m dimensions takes
m/8 + 8 bytes: at D = 256, 40 B; within 32 B it keeps the first 192 dimensions. On the demo's vectors at 40 B
its top 10 overlap exact float32 search by .54 / .56 (fast scan), where PQ64x4fs at 32 B keeps .61.
"""

from __future__ import annotations

import faiss

from triclip.codecs.base import METRIC
from triclip.codecs.faiss_codec import FaissCodec
from triclip.codecs.registry import register_codec
from triclip.codecs.spec import CodecSpec

FACTOR_BYTES = 8  # per vector: the estimator's two float32 factors


@register_codec("rabitq")
class RaBitQCodec(FaissCodec):
    """Sign bits of the rotated, centred top m dimensions and two factors per vector; estimated inner products."""

    title = "RaBitQ"
    family = "RaBitQ"
    scan = ""  # how its codes are scanned, in words (the fast-scan twin says)
    words = ("{first} centred and randomly rotated, one bit each, and two numbers per vector from which the"
             " inner product is estimated{scan}; {note}")
    exact_scan = False
    factory = "RaBitQ"  # FAISS's factory string
    kind = faiss.IndexRaBitQ  # the FAISS index it builds

    @classmethod
    def fields(cls, spec):
        return {**super().fields(spec), "scan": cls.scan}

    @classmethod
    def candidates(cls, budget, dim, n=None):
        """The most leading dimensions (a multiple of 8) whose bits and factors fit the budget."""
        m = min(dim // 8 * 8, 8 * (budget - FACTOR_BYTES))
        return [CodecSpec(cls.name, m, m // 8 + FACTOR_BYTES)] if m >= 8 else []

    @classmethod
    def faiss_parts(cls, spec, n):
        return spec, faiss.index_factory(spec.m, cls.factory, METRIC), None

    @classmethod
    def owns_index(cls, inner, chain):
        return type(inner) is cls.kind

    @classmethod
    def spec_of(cls, inner, chain):
        return CodecSpec(cls.name, inner.d, inner.code_size)


@register_codec("rabitqfs")
class RaBitQFastScanCodec(RaBitQCodec):
    """RaBitQ's code, scanned 32 vectors at a time (FAISS ``IndexRaBitQFastScan``)."""

    title = "RaBitQ fast scan"
    family = "RaBitQ fast scan"
    scan = ", scanned 32 codes at a time"
    factory = "RaBitQfs"
    kind = faiss.IndexRaBitQFastScan

