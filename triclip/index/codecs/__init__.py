"""Codes for served vectors, chosen by bytes per vector (torch-free: numpy and FAISS only).

Vectors are a run's served embeddings in importance order (column 0 the most important, L2-normalised),
shape (N, D) float32; a code covers the leading ``m`` dimensions. One module per codec, each a class registered
by name (:mod:`triclip.index.codecs.registry`, ``@register_codec``) that holds its label and plain-words
description, its candidates for a byte budget, fit, add, search, reconstruct, save and how it recognises and
reads its own file (FAISS: https://github.com/facebookresearch/faiss):

- ``float32`` (:mod:`.float32`): the top m dimensions as they are, 4m bytes. Today's pruning.
- ``int8`` (:mod:`.int8`): the top m dimensions, one byte each, per-dimension ranges trained on the collection.
- ``binary`` (:mod:`.binary`): the signs of the top m dimensions, m/8 bytes, searched by Hamming distance on a
  binarised query.
- ``pq`` (:mod:`.pq`): product quantisation of the top m dimensions, M sub-quantisers of nbits.
- ``opq`` (:mod:`.opq`): an OPQ rotation learnt on the top m dimensions, then PQ.
- ``rq`` (:mod:`.rq`): residual quantisation, M codebooks of 2^nbits centroids over the whole width.
- ``mixed`` (:mod:`.mixed`): the importance-aware mixed-precision code of :mod:`triclip.index.allocation`.

A code that keeps fewer than D dimensions stores them re-normalised to unit length (as today's top-m index
does, ``triclip.index.sources.prefix``), so scores are cosines over what is kept (on synthetic data at 8 B, float32 at
m = 2 finds 2.7x more of the true top 10 than without). Every codec but ``binary`` scores float queries against
the decoded codes (asymmetric distance). FAISS codecs (:mod:`.faiss_codec`) are wrapped in
``IndexPreTransform(RemapDimensionsTransform(D, m), ...)``, so they take full-width queries and record D in
their file; :meth:`Codec.reconstruct` returns (n, D) with zeros beyond m.

A new codec is one module here (a registered :class:`Codec` subclass), imported below; the codec tests run
over every registered name.
"""

from __future__ import annotations

import os

import numpy as np

from triclip.core.errors import UserError
from triclip.index.codecs.base import METRIC, Codec, CodecFile, unit_prefix
from triclip.index.codecs.registry import CODECS, describe, family, lookup, names, register_codec, title
from triclip.index.codecs.spec import CodecSpec

# one module per codec; importing them registers them, in this order: the order candidates are tried in
from triclip.index.codecs import float32  # noqa: E402,F401  isort: skip
from triclip.index.codecs import int8  # noqa: E402,F401  isort: skip
from triclip.index.codecs import binary  # noqa: E402,F401  isort: skip
from triclip.index.codecs import pq  # noqa: E402,F401  isort: skip
from triclip.index.codecs import opq  # noqa: E402,F401  isort: skip
from triclip.index.codecs import rq  # noqa: E402,F401  isort: skip
from triclip.index.codecs import mixed  # noqa: E402,F401  isort: skip
from triclip.index.codecs.opq import OPQ_DIMS_PER_CODE, OPQ_ITERATIONS  # noqa: E402
from triclip.index.codecs.pq import PQ_DIMS_PER_CODE  # noqa: E402
from triclip.index.codecs.rq import RQ_MAX_CODES, RQ_MEMORY  # noqa: E402

__all__ = [
    "CODECS", "METRIC", "OPQ_DIMS_PER_CODE", "OPQ_ITERATIONS", "PQ_DIMS_PER_CODE", "RQ_MAX_CODES", "RQ_MEMORY",
    "Codec", "CodecFile", "CodecSpec", "candidates", "describe", "family", "fit", "load", "lookup", "names",
    "register_codec", "title", "unit_prefix",
]  # fmt: skip


def candidates(budget: int, dim: int, n: int | None = None) -> list[CodecSpec]:
    """Every codec and m that fits in ``budget`` bytes per vector (what ``index build --bytes`` tries), codec by
    codec in the registry's order, each codec's in its own order (:meth:`Codec.candidates`; ``n``: the
    collection's size where known). Codes that cannot fit are left out.
    """
    if budget < 1 or dim < 1:
        raise UserError(f"a budget needs >= 1 byte and a width >= 1, got {budget} B, D={dim}")
    return [spec for cls in CODECS.values() for spec in cls.candidates(budget, dim, n)]


def fit(spec: CodecSpec, train: np.ndarray, importance: np.ndarray | None = None) -> Codec:
    """Train a code on (N, D) float32 vectors (the train split's served embeddings); it holds no vectors yet.

    ``importance`` (D,): the query side's weight per dimension for the mixed code, ``E[q_j^2]`` up to
    scale (``allocation.query_weights(text_embeddings)``; the run's S is a proxy). None: the
    collection's own second moment (served image and text vectors share the basis and its scaling).
    Other codecs ignore it. The returned codec's ``spec`` is the fitted one (mixed: its bits and m;
    PQ on a small collection: its nbits).
    """
    train = np.ascontiguousarray(train, dtype=np.float32)
    if train.ndim != 2 or len(train) < 1 or not np.isfinite(train).all():
        raise UserError(f"training vectors must be a finite non-empty (N, D) array, got shape {train.shape}")
    if spec.m > train.shape[1]:
        raise UserError(f"{spec.label()} needs m <= D = {train.shape[1]}")
    return lookup(spec.codec).fit(spec, train, importance)


def load(path, dim: int | None = None) -> Codec:
    """Read a codec written by :meth:`Codec.save`: the registered codec that owns the file reads it; UserError
    (one line) when none does.

    ``dim``: the width D of a binary code's vectors (a FAISS binary file records only m); others record D.
    """
    path = os.fspath(path)
    try:
        file = CodecFile(path)
    except OSError as err:
        raise UserError(f"cannot read codec {path}: {err.strerror}") from None
    try:
        owner = next((cls for cls in CODECS.values() if cls.owns(file)), None)
        if owner is None:
            raise ValueError(f"no codec reads a file that starts with {file.head[:4]!r}")
        return owner.read(file, dim)
    except (RuntimeError, ValueError, KeyError) as err:
        raise UserError(f"{path} is not a codec file ({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
