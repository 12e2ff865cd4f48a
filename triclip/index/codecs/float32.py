"""``float32``: the top m dimensions as they are (FAISS ``IndexFlatIP``), 4m bytes. Today's pruning."""

from __future__ import annotations

import faiss

from triclip.index.codecs.base import bytes_note, first, prefix_candidates
from triclip.index.codecs.faiss_codec import FaissCodec
from triclip.index.codecs.registry import register_codec
from triclip.index.codecs.spec import CodecSpec


@register_codec("float32")
class Float32Codec(FaissCodec):
    """The leading m coordinates, re-normalised, searched exactly."""

    title = "float32 top-m"
    family = "float32 (codec)"  # "float32 top-m (today)" is the uncoded row beside it

    @classmethod
    def describe(cls, spec):
        return f"{spec.label()}: {first(spec.m)} as 32-bit floats, 4 bytes each, searched exactly; {bytes_note(spec)}"

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
