"""Importance-aware bit allocation and the packed per-dimension scalar code it drives (numpy only).

The mixed-precision code (``triclip.codecs``, codec ``"mixed"``) gives dimension ``j`` of the served
vector ``b_j`` bits of a uniform scalar quantiser, ``0 <= b_j <= MAX_BITS``; ``b_j = 0`` prunes it.
Keeping all bits on the top m dimensions and none on the rest is today's top-m pruning, a special
case of the allocation below.

Derivation (what the allocation minimises)
------------------------------------------
A query ``q`` scores an image ``x`` by ``s = sum_j q_j x_j``; the code stores ``x_hat``, so the
score is off by ``sum_j q_j e_j`` with ``e_j = x_hat_j - x_j``. For errors of zero mean, independent
of each other and of the query, its expected square is

    E[(s_hat - s)^2] = sum_j E[q_j^2] * E[e_j^2] = sum_j w_j * d_j(b_j),

where ``w_j = E[q_j^2]`` is the query's second moment on dimension ``j`` and ``d_j(b)`` the mean
squared error of dimension ``j`` quantised with ``b`` bits. A pruned dimension (``b = 0``) is
decoded as a constant, and a constant adds the same amount to every image's score for a query, so it
costs only the dimension's variance: ``d_j(0) = sigma_j^2``. In the high-resolution regime a
uniform quantiser of range ``r_j`` gives ``d_j(b) = r_j^2 / 12 * 2^(-2b)``, i.e.
``c_j * sigma_j^2 * 2^(-2b)``. Minimising ``sum_j w_j c_j sigma_j^2 2^(-2 b_j)`` subject to
``sum_j b_j <= B`` over real ``b_j >= 0`` (Lagrange) gives reverse water-filling:

    b_j = max(0, 1/2 * log2(w_j c_j sigma_j^2 / theta)),

with the level ``theta`` set so the bits add up to ``B``: a dimension whose weighted variance is
below the water level gets no bits (it is pruned), every other one gets half a bit more per
doubling of ``w_j sigma_j^2``. Two things make the real problem differ from that relaxation: bits
are integers, and ``d_j`` is not convex at 0 (one bit of a uniform quantiser removes less error than
the second, since its cells are wide and clipped), so a greedy bit-by-bit water-filling can miss
the optimum. :func:`allocate` therefore solves the integer problem exactly, by dynamic programming
over (dimension, bits used) - a multiple-choice knapsack of at most ``D * B * (MAX_BITS + 1)``
steps - on ``d_j(b)`` MEASURED on the training collection (:func:`quantiser_table`, of which the
high-resolution formula is the asymptote), not on the formula. ``tests/codecs/test_codecs.py``
checks it against brute force over every integer allocation on small cases.

The quantiser: for each dimension and bit width, the range ``[lo, hi]`` is the collection's
``(p, 1-p)`` quantiles, with the clipping ``p`` in :data:`CLIP_QUANTILES` that gives the smallest
measured error (clipping rare extremes makes the cells of a few-bit quantiser narrower); codes are
cell indices, decoded to cell centres. Codes are bit-packed, dimension after dimension, most
significant bit first, ``ceil(sum_j b_j / 8)`` bytes per vector.
"""

from __future__ import annotations

import numpy as np

MAX_BITS = 8  # most bits one dimension can take
CLIP_QUANTILES = (0.0, 0.001, 0.005, 0.02)  # candidate clipping of each quantiser's range
TABLE_SAMPLE = 20_000  # vectors the error tables are measured on (a seeded sample of larger collections)


def query_weights(queries: np.ndarray) -> np.ndarray:
    """``w_j = E[q_j^2]``, the queries' second moment per dimension. Shape: (Q, D) -> (D,)."""
    return np.mean(np.square(queries, dtype=np.float64), axis=0)


def quantiser_table(x: np.ndarray, max_bits: int = MAX_BITS, seed: int = 0):
    """Ranges and measured errors of every dimension's quantiser at 0..max_bits bits.

    Args:
        x: (N, D) float32 collection.
    Returns:
        lo, hi: (D, max_bits + 1) range of the b-bit quantiser of each dimension (column 0 unused);
        mse: (D, max_bits + 1) its mean squared error on ``x``, ``mse[:, 0]`` the variance.
    """
    x = _table_rows(x, seed)
    d = x.shape[1]
    lo = np.zeros((d, max_bits + 1), np.float32)
    hi = np.zeros((d, max_bits + 1), np.float32)
    mse = np.full((d, max_bits + 1), np.inf)
    mse[:, 0] = x.var(axis=0, dtype=np.float64)
    for p in CLIP_QUANTILES:
        qlo, qhi = np.quantile(x, [p, 1 - p], axis=0).astype(np.float32)  # (D,) each
        for b in range(1, max_bits + 1):
            err = _errors_at(x, qlo, qhi, b)
            better = err < mse[:, b]
            mse[better, b], lo[better, b], hi[better, b] = err[better], qlo[better], qhi[better]
    return lo, hi, mse


def quantiser_ranges(x: np.ndarray, bits: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The range :func:`quantiser_table` picks for each dimension at its own bit width, measured at those widths only.

    Equal to ``lo[j, bits[j]]`` and ``hi[j, bits[j]]`` of ``quantiser_table(x)`` (0 where ``bits[j]`` is 0): each
    column is computed from the same array with the same operations (tests/codecs/test_codecs.py), at
    ``len(CLIP_QUANTILES)`` passes over ``x`` instead of ``MAX_BITS`` times as many.

    Shapes: x (N, m) float32, bits (m,) int -> lo, hi (m,) float32 each.
    """
    x = _table_rows(x, seed)
    bits = np.asarray(bits, dtype=np.int64)
    widths = np.maximum(bits, 1)  # a pruned dimension's range is unused (0): measured at 1 bit, then zeroed
    lo = np.zeros(x.shape[1], np.float32)
    hi = np.zeros(x.shape[1], np.float32)
    best = np.full(x.shape[1], np.inf)
    for p in CLIP_QUANTILES:
        qlo, qhi = np.quantile(x, [p, 1 - p], axis=0).astype(np.float32)  # (m,) each
        err = _errors_at(x, qlo, qhi, widths)
        better = err < best
        best[better], lo[better], hi[better] = err[better], qlo[better], qhi[better]
    off = bits == 0
    lo[off], hi[off] = 0.0, 0.0
    return lo, hi


def _errors_at(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, bits) -> np.ndarray:
    """Mean squared error of each column of ``x`` quantised in ``[lo, hi]`` with ``bits``. Shape: (N, m) -> (m,)."""
    return np.mean(np.square(dequantise(quantise(x, lo, hi, bits), lo, hi, bits) - x, dtype=np.float64), axis=0)


def _table_rows(x: np.ndarray, seed: int) -> np.ndarray:
    """The rows the error tables are measured on: all of ``x``, or a seeded sample of :data:`TABLE_SAMPLE`."""
    if len(x) > TABLE_SAMPLE:
        x = x[np.sort(np.random.default_rng(seed).choice(len(x), TABLE_SAMPLE, replace=False))]
    return np.asarray(x, dtype=np.float32)


def _step(lo: np.ndarray, hi: np.ndarray, bits) -> np.ndarray:
    return np.maximum(hi - lo, 1e-12) / np.exp2(bits)


def quantise(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, bits) -> np.ndarray:
    """Cell index of each value. Shapes: (N, m), (m,), (m,), int or (m,) -> (N, m) int32."""
    cells = np.floor((x - lo) / _step(lo, hi, bits))
    return np.clip(cells, 0, np.exp2(bits) - 1).astype(np.int32)


def dequantise(codes: np.ndarray, lo: np.ndarray, hi: np.ndarray, bits) -> np.ndarray:
    """Cell centres. Shapes: (N, m) -> (N, m) float32."""
    return (lo + (codes + 0.5) * _step(lo, hi, bits)).astype(np.float32)


def allocate(cost: np.ndarray, budget_bits: int) -> np.ndarray:
    """Integer bits per dimension minimising ``sum_j cost[j, b_j]`` with ``sum_j b_j <= budget_bits``.

    Exact dynamic programme (see the module docstring). Args: cost (D, K), the modelled distortion of
    dimension j at b = 0..K-1 bits (``w_j * d_j(b)``). Returns (D,) int bits; ties keep fewer bits.
    """
    d, k = cost.shape
    budget_bits = max(0, int(budget_bits))
    best = np.zeros(budget_bits + 1)  # best[c]: least cost of the dimensions so far using <= c bits
    choice = np.zeros((d, budget_bits + 1), np.int16)
    for j in range(d):
        new = np.full(budget_bits + 1, np.inf)
        for b in range(min(k, budget_bits + 1)):
            cand = np.full(budget_bits + 1, np.inf)
            cand[b:] = best[: budget_bits + 1 - b] + cost[j, b]
            better = cand < new
            new[better], choice[j, better] = cand[better], b
        best = new
    bits = np.zeros(d, np.int64)
    c = budget_bits
    for j in range(d - 1, -1, -1):
        bits[j] = choice[j, c]
        c -= bits[j]
    return bits


def modelled_distortion(cost: np.ndarray, bits: np.ndarray) -> float:
    """``sum_j cost[j, bits_j]``, what :func:`allocate` minimises."""
    return float(cost[np.arange(len(bits)), bits].sum())


# ---------------------------------------------------------------------------- packed codes


def bit_layout(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each stored bit, its dimension and its shift (MSB first). Shapes: (m,) -> (T,), (T,)."""
    dims = np.repeat(np.arange(len(bits)), bits)
    starts = np.cumsum(bits) - bits
    shifts = bits[dims] - 1 - (np.arange(len(dims)) - starts[dims])
    return dims, shifts


def pack(codes: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """Bit-pack cell indices. Shapes: (N, m) int, (m,) -> (N, ceil(sum(bits) / 8)) uint8."""
    dims, shifts = bit_layout(bits)
    return np.packbits(((codes[:, dims] >> shifts) & 1).astype(np.uint8), axis=1)


def unpack(packed: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack`. Shapes: (N, bytes) uint8, (m,) -> (N, m) int32 (0 where bits is 0)."""
    flat = np.unpackbits(packed, axis=1, count=int(bits.sum())).astype(np.int32)  # (N, T)
    starts = np.cumsum(bits) - bits
    codes = np.zeros((len(packed), len(bits)), np.int32)
    for k in range(int(bits.max(initial=0))):
        cols = np.flatnonzero(bits > k)  # dimensions with a (k+1)-th bit
        codes[:, cols] = (codes[:, cols] << 1) | flat[:, starts[cols] + k]
    return codes
