"""``float32``: the top m dimensions as they are (FAISS ``IndexFlatIP``), 4m bytes. Today's pruning."""

from __future__ import annotations

import faiss

from triclip.codecs.base import prefix_candidates
from triclip.codecs.faiss_codec import FaissCodec
from triclip.codecs.registry import register_codec
from triclip.codecs.spec import CodecSpec


@register_codec("float32")
class Float32Codec(FaissCodec):
    """The leading m coordinates, re-normalised, searched exactly."""

    title = "float32 top-m"
    family = "float32 (codec)"  # "float32 top-m (today)" is the uncoded row beside it
    words = ("{first} as 32-bit floats, 4 bytes each, searched exactly; {note}")

    @classmethod
    def candidates(cls, budget, dim, n=None):
        return prefix_candidates(cls.name, budget, dim, bits=32)

    @classmethod
    def faiss_parts(cls, spec: CodecSpec, n: int):
        return spec, faiss.IndexFlatIP(spec.m), None

    @classmethod
    def owns_index(cls, inner, chain):
        return isinstance(inner, faiss.IndexFlat)

    @classmethod
    def spec_of(cls, inner, chain):
        return CodecSpec(cls.name, inner.d, 4 * inner.d)
