"""``int8``: the top m dimensions, one byte each, per-dimension ranges trained on the collection (FAISS
``IndexScalarQuantizer`` with ``QT_8bit``), m bytes."""

from __future__ import annotations

import faiss

from triclip.codecs.base import METRIC, prefix_candidates
from triclip.codecs.faiss_codec import FaissCodec
from triclip.codecs.registry import register_codec
from triclip.codecs.spec import CodecSpec

QTYPE = faiss.ScalarQuantizer.QT_8bit


@register_codec("int8")
class Int8Codec(FaissCodec):
    """The leading m coordinates, re-normalised, each as one of 256 steps of its trained range."""

    title = "int8 top-m"
    family = "int8"
    words = ("{first}, one byte each (256 steps between a low and a high value learnt per dimension); {note}")

    @classmethod
    def candidates(cls, budget, dim, n=None):
        return prefix_candidates(cls.name, budget, dim, bits=8)

    @classmethod
    def faiss_parts(cls, spec: CodecSpec, n: int):
        return spec, faiss.IndexScalarQuantizer(spec.m, QTYPE, METRIC), None

    @classmethod
    def owns_index(cls, inner, chain):
        return isinstance(inner, faiss.IndexScalarQuantizer) and inner.sq.qtype == QTYPE
