"""What a code is, as the manifest records it: codec name, leading dimensions m, bytes per vector, parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

from triclip.core.errors import UserError
from triclip.index.codecs.registry import describe, lookup


@dataclass(frozen=True)
class CodecSpec:
    """One code: which codec, how many leading dimensions, its exact bytes per vector (codes only, no ids)."""

    codec: str  # a registered name (triclip.index.codecs.names())
    m: int
    bytes_per_vector: int
    params: dict = field(default_factory=dict)  # pq/opq/rq: {"M", "nbits"}; mixed: {"bits": [b_0..b_{m-1}]} once fitted

    def __post_init__(self) -> None:
        lookup(self.codec)  # UserError: unknown codec ...; choose from ...
        if self.m < 1 or self.bytes_per_vector < 1:
            raise UserError(f"a {self.codec} code needs m >= 1 and bytes >= 1, got m={self.m}, {self.bytes_per_vector} B")

    def label(self) -> str:
        """Short name, e.g. ``opq16x8 m=256``, ``int8 m=64``, ``mixed 16B m=48``."""
        return lookup(self.codec).label(self)

    def describe(self) -> str:
        """The code in plain words (:func:`triclip.index.codecs.registry.describe`)."""
        return describe(self)

    def to_json(self) -> dict:
        return {"codec": self.codec, "m": self.m, "bytes_per_vector": self.bytes_per_vector, "params": dict(self.params)}

    @classmethod
    def from_json(cls, d: dict) -> CodecSpec:
        try:
            return cls(str(d["codec"]), int(d["m"]), int(d["bytes_per_vector"]), dict(d.get("params") or {}))
        except (KeyError, TypeError, ValueError) as err:
            raise UserError(f"not a codec spec: {d!r} ({err})") from None
