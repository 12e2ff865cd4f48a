"""``ivf``: inverted lists over a code (FAISS ``IndexIVF*``): k-means cuts the collection into ``nlist`` lists,
a query scans the codes of its ``nprobe`` nearest lists only.

One parameterised codec, not one module per inner code: the inverted lists (coarse k-means, ``nlist`` from the
collection's size, ``nprobe`` per call through ``faiss.SearchParametersIVF``, appending without retraining, lists
on disk) are the same whatever code they hold; only FAISS's factory string differs. The inner code is named by
``params["inner"]``, the flat codec whose candidates it mirrors:

- ``pq`` ``IVF{nlist},PQ{M}x{nbits}`` (``IndexIVFPQ``); ``opq``: the same after :mod:`.opq`'s rotation;
- ``rq`` ``IVF{nlist},RQ{M}x{nbits}`` (``IndexIVFResidualQuantizer``, lookup-table search as :mod:`.rq`);
- ``pqfs`` ``IVF{nlist},PQ{M}x4fs`` (``IndexIVFPQFastScan``, as :mod:`.pqfs`);
- ``int8`` ``IVF{nlist},SQ8`` (``IndexIVFScalarQuantizer``, as :mod:`.int8`).

Not offered: IVF over ``rqfs``: FAISS 1.15.1's ``IndexIVFAdditiveQuantizerFastScan`` refuses per-call search
parameters ("search params not supported for this index"), so its nprobe could only be set on the shared index,
a race between threads searching at once. IVF over RaBitQ. FAISS 1.15.1's ``IndexIVFRaBitQ`` (and its fast scan) with the inner product
reconstructs vectors up to 1.09 away from what it scores (unit vectors, D = 64), so it cannot be re-scored or
checked like the others, and on 3,000 random unit vectors its top 10 at nprobe = nlist overlapped exact search
by .12 / .13 against the flat RaBitQ's .26 / .25.

Written by hand: :meth:`IVFCodec.reconstruct`. FAISS 1.15.1 crashes (segmentation fault) reconstructing, or
``sa_decode``-ing, a fast-scan IVF index read back from a file; the codes are unpacked from the lists with
FAISS's own ``CodePacker`` and decoded by its quantiser instead (equal to FAISS's reconstruction before a save).

Lists on disk (:meth:`IVFCodec.filled_on_disk`): FAISS's ``OnDiskInvertedLists`` in a ``.ivfdata`` file beside the
code file, memory-mapped read-only (``index build`` beyond ``--memory-budget``; not for fast-scan lists, which FAISS
keeps in blocks that have no on-disk form).

Sized for N (:meth:`IVFCodec.sized_for`): ``index build --bytes`` chooses between candidates fitted on a sample
(their nlist capped by the sample's rows), then refits the kept one for the collection before filling it: nlist =
:func:`lists_for` N, the coarse quantiser trained on :func:`coarse_rows` rows read from the shards, the inner code
(and OPQ's rotation) on the residuals of the inner code's own ``fit_rows_at_n`` (else ``fit_rows``) of them, as
FAISS's ``IndexIVF.train`` trains it.

Many lists (:data:`LARGE_LISTS` and more, N of about 2.1M and up): the flat coarse quantiser's k-means and its
assignment of every row cost nlist x D per row, most of a build at 10M (16,384 lists: the refit 620 s, the fill
721 s on 2 cores). So the centroids are trained by FAISS's two-level k-means (``faiss.contrib.clustering.
two_level_clustering``: sqrt(nlist) groups, then each group's share of the lists within it), and rows are assigned
to lists through an IVF over the centroids (:func:`assigner`: FAISS's ``IndexIVFFlat``, :data:`ASSIGN_PROBE` of
its sqrt(nlist) groups scanned per row), swapped in as the quantiser while FAISS adds (:meth:`IVFCodec._added`).
Queries still rank every list exactly (the flat quantiser is the one stored). Measured on 3M haystack rows
(``benchmarks/bench_coarse.py``; docs/results_scale.md, "Many lists: the coarse quantiser"), 16,384 lists: the
two-level k-means took 21 s; assigning a row took 68.5 us flat, 14.1 us through 8 of 128 groups and 8.3 through 4
(2 threads), the same list for .9956 / .9863 of the rows, and the lists nearest the val captions held as much of
their exact top 10 (at nprobe 16: .965 flat, .964 and .963; at 32,768 lists 116, 27.4 and 16.7 us, the hold
within .002 at every nprobe): so 4 are scanned. At 10M rows the refit and fill of lists of OPQ took 389 s (8
scanned), against 1,341 s flat.

Each inverted list stores an 8-byte id per vector beside its code: a budget counts the code's bytes (as every
codec), :meth:`IVFCodec.ram_bytes` what is held (codes, fast scan's block padding, ids).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import faiss
import numpy as np
from faiss.contrib.clustering import two_level_clustering

from triclip.core.errors import UserError
from triclip.core.progress import progress
from triclip.codecs import ondisk
from triclip.codecs.base import METRIC, unit_prefix
from triclip.codecs.faiss_codec import FaissCodec
from triclip.codecs.registry import lookup, register_codec
from triclip.codecs.rq import RQ_MEMORY
from triclip.codecs.spec import CodecSpec

IVF_MIN_N = 100_000  # no inverted lists below this many vectors: a flat fast scan of them is already quick
# (benchmarks/bench_ivf.py: PQ32x4fs, D = 256, one thread, shared 2 cores: see docs/benchmarks.md)
TRAIN_PER_LIST = 39  # fewest training vectors per list (FAISS warns below it); fewer training vectors: fewer lists
LISTS_PER_ROOT = 4  # nlist ~ 4 sqrt(N), a power of two
MIN_LISTS, MAX_LISTS = 16, 65_536
INNER = ("pq", "opq", "rq", "pqfs", "int8")  # the flat codes offered inside lists, in the order tried
ROWS_PER_LIST_AT_N = 64  # a code sized for N (IVFCodec.sized_for): rows its coarse quantiser is trained on, per list
MOST_COARSE_ROWS = 1 << 20  # ... but at most this many (1 GiB of float32 at D = 256), or TRAIN_PER_LIST per list
# where that is more (32,768 lists at N = 100M: 1.28M rows)
LARGE_LISTS = 8192  # from this many lists on: two-level k-means, rows assigned through an IVF over the centroids
ASSIGN_PROBE = 4  # groups of centroids (of sqrt(nlist)) :func:`assigner` scans for a row (8: 1.7x the time, the
# same hold of the lists: docs/results_scale.md, "Many lists")


def lists_for(n: int) -> int:
    """nlist for n vectors: the power of two nearest 4 sqrt(n), within [16, 65536]."""
    return int(min(MAX_LISTS, max(MIN_LISTS, 2 ** round(math.log2(LISTS_PER_ROOT * math.sqrt(max(n, 1)))))))


def coarse_rows(n: int, nlist: int) -> int:
    """Rows the coarse quantiser of ``nlist`` lists is trained on at N = ``n``: :data:`ROWS_PER_LIST_AT_N` per list,
    at most :data:`MOST_COARSE_ROWS` unless :data:`TRAIN_PER_LIST` per list is more, at most n."""
    return int(min(n, ROWS_PER_LIST_AT_N * nlist, max(MOST_COARSE_ROWS, TRAIN_PER_LIST * nlist)))


def groups_for(nlist: int) -> int:
    """Groups of centroids for ``nlist`` lists: sqrt(nlist), both the two-level k-means' first level and
    :func:`assigner`'s lists."""
    return max(1, int(math.sqrt(nlist)))


def two_level_centroids(x: np.ndarray, nlist: int, niter: int, seed: int = 0) -> np.ndarray:
    """``nlist`` centroids of ``x`` (n, d) by FAISS's two-level k-means: sqrt(nlist) groups, then each group cut
    into lists in proportion to its rows. Shape: (nlist, d) float32."""
    centroids, _ = two_level_clustering(np.ascontiguousarray(x, np.float32), groups_for(nlist), nlist,
                                        clustering_niter=niter, seed=seed, min_points_per_centroid=1)
    return np.ascontiguousarray(centroids, np.float32)


def assigner(centroids: np.ndarray) -> faiss.Index:
    """An IVF over ``centroids`` (nlist, d): a row scans :data:`ASSIGN_PROBE` of their sqrt(nlist) groups, not all
    nlist. Searched as a quantiser: its labels are the centroids' rows (the lists); reconstructs them (a direct
    map) for codes stored by residual."""
    nlist, d = centroids.shape
    index = faiss.index_factory(d, f"IVF{groups_for(nlist)},Flat", METRIC)  # owns its quantiser
    index.cp.seed, index.cp.min_points_per_centroid = 0, 1
    index.train(centroids)
    index.add(centroids)
    index.nprobe = ASSIGN_PROBE
    index.make_direct_map()
    return index


def factory_piece(spec: CodecSpec) -> str:
    """The inner code's part of FAISS's factory string, e.g. ``PQ32x4fs``."""
    inner, p = spec.params["inner"], spec.params
    if inner in ("pq", "opq"):
        return f"PQ{p['M']}x{p['nbits']}"
    if inner == "rq":
        return f"RQ{p['M']}x{p['nbits']}"
    if inner == "pqfs":
        return f"PQ{p['M']}x4fs"
    if inner == "int8":
        return "SQ8"
    raise UserError(f"ivf: no inner code {inner!r}; choose from {', '.join(INNER)}")


@register_codec("ivf")
class IVFCodec(FaissCodec):
    """Inverted lists of a flat code; a query scans ``nprobe`` of ``nlist`` lists (``params``: ``inner``, the
    inner code's own, ``nlist``, ``nprobe``)."""

    title = "inverted lists (IVF)"
    family = "IVF"
    fit_cost = 1

    def __init__(self, spec, index, dim):
        super().__init__(spec, index, dim)
        self._rows = None  # (ntotal, (list, offset) per id), built on the first reconstruct after an add
        self._rows_lock = threading.Lock()
        self._assigner = None  # assigner() of the lists' centroids, built on the first add with LARGE_LISTS lists

    @classmethod
    def label(cls, spec):
        inner = CodecSpec(spec.params["inner"], spec.m, spec.bytes_per_vector, _inner_params(spec.params)).label()
        return f"ivf{spec.params['nlist']}/{spec.params.get('nprobe', '?')},{inner}"

    @classmethod
    def describe(cls, spec):
        inner = CodecSpec(spec.params["inner"], spec.m, spec.bytes_per_vector, _inner_params(spec.params))
        words = lookup(inner.codec).describe(inner).split(": ", 1)[1]
        return (f"{spec.label()}: the collection cut into {spec.params['nlist']} lists by k-means, a query scanning"
                f" the {spec.params.get('nprobe', '?')} lists nearest to it (plus an 8-byte id per vector); in the"
                f" lists, {words}")

    @classmethod
    def candidates(cls, budget, dim, n=None):
        """Each inner code's first candidate, in lists of :func:`lists_for` n; none below :data:`IVF_MIN_N`."""
        if n is None or n < IVF_MIN_N:
            return []
        nlist = lists_for(n)
        out = []
        for name in INNER:
            for spec in lookup(name).candidates(budget, dim, n)[:1]:
                params = {"inner": name, **spec.params, "nlist": nlist, "nprobe": max(1, nlist // 64)}
                out.append(CodecSpec(cls.name, spec.m, spec.bytes_per_vector, params))
        return out

    @classmethod
    def fit_rows_of(cls, spec):
        """The inner code's: inverted lists of RQ train it on the residuals of every row they are fitted on (the
        lists then number at most those rows / :data:`TRAIN_PER_LIST`)."""
        return lookup(spec.params["inner"]).fit_rows

    @classmethod
    def fit_rows_at_n_of(cls, spec):
        """Most rows :meth:`sized_for` refits the inner code (and OPQ's rotation) on: its ``fit_rows_at_n``, else
        :meth:`fit_rows_of` (None: every sampled row)."""
        inner = lookup(spec.params["inner"])
        return inner.fit_rows_at_n or inner.fit_rows

    @classmethod
    def faiss_parts(cls, spec, n):
        params = dict(spec.params)
        inner_spec, _, rotation = lookup(params["inner"]).faiss_parts(
            CodecSpec(params["inner"], spec.m, spec.bytes_per_vector, _inner_params(params)), n)  # checks, nbits
        nlist = max(1, min(int(params["nlist"]), n // TRAIN_PER_LIST))
        params.update(inner_spec.params, nlist=nlist, nprobe=max(1, min(int(params.get("nprobe", 1)), nlist)))
        spec = CodecSpec(cls.name, spec.m, inner_spec.bytes_per_vector, params)
        ivf = faiss.index_factory(spec.m, f"IVF{nlist},{factory_piece(spec)}", METRIC)  # downcast by faiss: keep this object
        ivf.cp.seed, ivf.cp.min_points_per_centroid = 0, 1
        ivf.nprobe = params["nprobe"]
        if params["inner"] == "rq":  # lookup tables, exact for inner products, no norm bytes (as triclip's rq)
            ivf.rq.search_type = faiss.AdditiveQuantizer.ST_LUT_nonorm
        if hasattr(ivf, "do_polysemous_training"):
            ivf.do_polysemous_training = False  # Hamming filtering is unused here, and slow to train
        return spec, ivf, rotation

    def sized_for(self, vectors, seed: int = 0) -> tuple["IVFCodec", dict]:
        """This code refitted for the collection ``vectors`` (``ShardVectors``, N rows): nlist = :func:`lists_for`
        N, the coarse quantiser trained by FAISS (``train_q1``) on :func:`coarse_rows` seeded rows read from the
        shards, the rotation and the inner code on the residuals of a seeded subset of :meth:`fit_rows_at_n_of` of
        them (all where it has none); nprobe is kept (tuned at N once filled). Holds the sampled rows twice while
        the chain applies to them (as read, and remapped / rotated): 2 x rows x D x 4 bytes, 537 MB at N = 1M
        (4,096 lists, 262,144 rows, D = 256), 2.6 GB at N = 100M (32,768 lists, 1.28M rows).
        Returns the empty trained code and what was done (``nlist``, ``coarse_rows``, ``inner_rows``)."""
        n = vectors.count
        nlist = lists_for(n)
        rng = np.random.default_rng(seed)
        rows = np.sort(rng.choice(n, size=coarse_rows(n, nlist), replace=False))
        sample = unit_prefix(np.asarray(vectors.rows(rows, vectors.dim), np.float32), self.spec.m)  # (n_c, D)
        few = self.fit_rows_at_n_of(self.spec)
        inner = sample if few is None or few >= len(sample) else sample[np.sort(rng.choice(len(sample), few, False))]
        spec = CodecSpec(self.spec.codec, self.spec.m, self.spec.bytes_per_vector, {**self.spec.params, "nlist": nlist})
        spec, ivf, rotation = self.faiss_parts(spec, len(sample))  # nlist <= rows / TRAIN_PER_LIST
        index = faiss.IndexPreTransform(ivf) if rotation is None else faiss.IndexPreTransform(rotation, ivf)
        index.prepend_transform(faiss.RemapDimensionsTransform(self.dim, spec.m, False))
        rows_read, same = len(sample), inner is sample
        coarse, fine = sample, inner  # through the chain: the remap to m, then the rotation trained on ``inner``
        del sample
        for i in range(index.chain.size()):
            step = index.chain.at(i)
            if not step.is_trained:
                step.train(fine)
            coarse = step.apply(coarse)
            fine = coarse if same else step.apply(fine)
        del fine
        if ivf.nlist >= LARGE_LISTS:
            ivf.quantizer.add(two_level_centroids(coarse, ivf.nlist, ivf.cp.niter, seed))
        else:
            ivf.train_q1(len(coarse), faiss.swig_ptr(np.ascontiguousarray(coarse)), False, METRIC)
        del coarse
        index.train(inner)  # the quantiser is trained (FAISS skips it): the inner code, on residuals
        index = faiss.deserialize_index(faiss.serialize_index(index))  # one object that owns all its parts
        done = {"nlist": int(spec.params["nlist"]), "coarse_rows": rows_read, "inner_rows": len(inner), "n": n,
                "seed": seed, **({"large": "two-level k-means, rows assigned through an IVF of"
                                  f" {groups_for(spec.params['nlist'])} groups of centroids, {ASSIGN_PROBE} scanned"}
                                 if spec.params["nlist"] >= LARGE_LISTS else {})}
        return IVFCodec(spec, index, self.dim), done

    def apply_settings(self):
        ivf = faiss.downcast_index(faiss.extract_index_ivf(self.index))
        if hasattr(ivf, "rq"):  # encode with capped distance tables (not saved in the file)
            ivf.rq.max_mem_distances = RQ_MEMORY

    @classmethod
    def owns_index(cls, inner, chain):
        return isinstance(inner, faiss.IndexIVF)

    @classmethod
    def spec_of(cls, inner, chain):
        kinds = ((faiss.IndexIVFPQFastScan, "pqfs"), (faiss.IndexIVFPQ, "pq"), (faiss.IndexIVFResidualQuantizer, "rq"),
                 (faiss.IndexIVFScalarQuantizer, "int8"))
        name = next(k for t, k in kinds if isinstance(inner, t))
        name = "opq" if name == "pq" and len(chain) > 1 else name
        params = {"inner": name}
        quantiser = getattr(inner, "pq", None) or getattr(inner, "rq", None)
        if quantiser is not None:
            nbits = quantiser.nbits if hasattr(inner, "pq") else faiss.vector_to_array(quantiser.nbits)[0]
            params.update(M=int(quantiser.M), nbits=int(nbits))
        params.update(nlist=int(inner.nlist), nprobe=int(inner.nprobe))
        return CodecSpec(cls.name, inner.d, int(inner.code_size), params)

    # ------------------------------------------------------------------ lists

    @property
    def ivf(self):
        """The FAISS IVF index inside the pre-transform."""
        return faiss.downcast_index(faiss.extract_index_ivf(self.index))

    def search_parameters(self, params):
        """``{"nprobe": n}``: lists scanned by this call only (``faiss.SearchParametersIVF``); None: the code's own."""
        if not params:
            return None
        unknown = set(params) - {"nprobe"}
        if unknown:
            raise UserError(f"{self.spec.label()} takes nprobe only, got {', '.join(sorted(unknown))}")
        nprobe = params["nprobe"]
        if isinstance(nprobe, bool) or not isinstance(nprobe, (int, np.integer)) or nprobe < 1:
            raise UserError(f"nprobe must be a positive integer, got {nprobe!r}")
        return faiss.SearchParametersIVF(nprobe=int(min(nprobe, self.ivf.nlist)))

    def exhaustive(self):
        return {"nprobe": int(self.ivf.nlist)}

    def add_random(self, n, rng):
        """Random codes straight into lists drawn at random (a timing's filling: a scan's cost depends on how many
        codes its lists hold, not on what they say), ids after the last; fast-scan lists take random vectors."""
        ivf = self.ivf
        if isinstance(faiss.downcast_InvertedLists(ivf.invlists), faiss.BlockInvertedLists) or not n:
            return super().add_random(n, rng)
        lists = rng.integers(0, ivf.nlist, n)  # (n,)
        codes = rng.integers(0, 256, (n, ivf.code_size), dtype=np.uint8)
        ids = np.arange(ivf.ntotal, ivf.ntotal + n, dtype=np.int64)
        order = np.argsort(lists, kind="stable")
        starts = np.searchsorted(lists[order], np.arange(ivf.nlist + 1))
        for lst in np.flatnonzero(np.diff(starts)):
            rows = order[starts[lst]:starts[lst + 1]]
            chunk, chunk_ids = np.ascontiguousarray(codes[rows]), np.ascontiguousarray(ids[rows])
            ivf.invlists.add_entries(int(lst), len(rows), faiss.swig_ptr(chunk_ids), faiss.swig_ptr(chunk))
        ivf.ntotal += n
        self.index.ntotal = ivf.ntotal
        self._rows = None

    def scores_decoded(self) -> bool:
        """Lists of pq, opq, rq and int8 codes score a query by its inner product with the list's centroid plus
        the decoded residual, i.e. with :meth:`reconstruct`'s vector; fast-scan lists estimate it."""
        return not isinstance(faiss.downcast_InvertedLists(self.ivf.invlists), faiss.BlockInvertedLists)

    def list_ranks(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where each query ranks each list (0: the first FAISS scans) and each stored vector's list: a search at
        nprobe p scans the vectors whose list ranks below p. Shapes: (Q, D) -> (Q, nlist) and (n,)."""
        order = self.ivf.quantizer.search(self.coarse_input(queries), self.ivf.nlist)[1]  # (Q, nlist)
        ranks = np.empty_like(order)
        np.put_along_axis(ranks, order, np.arange(order.shape[1])[None, :], axis=1)
        return ranks, self._where()[:, 0]

    def coarse_input(self, queries: np.ndarray) -> np.ndarray:
        """(Q, D) -> (Q, m) the queries as the coarse quantiser sees them: the remap to m (and OPQ's rotation), as a
        search applies them."""
        x = self._check(queries, "queries")
        for i in range(self.index.chain.size()):
            x = self.index.chain.at(i).apply(x)
        return np.ascontiguousarray(x, np.float32)

    def list_sizes(self) -> np.ndarray:
        """(nlist,) how many vectors each list holds."""
        lists = faiss.downcast_InvertedLists(self.ivf.invlists)
        return np.array([lists.list_size(i) for i in range(self.ivf.nlist)], np.int64)

    def set_nprobe(self, nprobe: int) -> None:
        """Make ``nprobe`` the code's own (saved with it; the spec records it). Before serving only."""
        self.ivf.nprobe = int(max(1, min(nprobe, self.ivf.nlist)))
        self.spec = CodecSpec(self.spec.codec, self.spec.m, self.spec.bytes_per_vector,
                              {**self.spec.params, "nprobe": int(self.ivf.nprobe)})

    def code_bytes(self) -> int:
        return int(self.ivf.ntotal) * int(self.ivf.code_size)

    def ram_bytes(self) -> int:
        """Codes as the lists hold them (fast scan: blocks of 32) and an 8-byte id per vector."""
        ivf, lists, sizes = self.ivf, faiss.downcast_InvertedLists(self.ivf.invlists), self.list_sizes()
        if isinstance(lists, faiss.BlockInvertedLists):
            codes = int((-(-sizes // lists.n_per_block)).sum()) * int(lists.block_size)
        else:
            codes = int(sizes.sum()) * int(ivf.code_size)
        return codes + 8 * int(sizes.sum())

    def decoded_lists(self, rows: int = 65_536):
        """Every stored vector decoded, lists in order, about ``rows`` at a time (whole lists): yields (ids (n,),
        vectors (n, D) float32); holds one group, never the collection. Lists stored flat (``scores_decoded``):
        what a search at nprobe = nlist scores, without FAISS's lookup tables for every query and list (at 10M
        rows, lists of RQ16x8 searched so by 322 queries took over 12 minutes)."""
        ivf, lists = self.ivf, self.ivf.invlists
        group, held = [], 0
        for lst in range(ivf.nlist):
            n = int(lists.list_size(lst))
            if n:
                codes = faiss.rev_swig_ptr(lists.get_codes(lst), n * ivf.code_size).copy().reshape(n, ivf.code_size)
                group.append((lst, faiss.rev_swig_ptr(lists.get_ids(lst), n).copy(), codes))
                held += n
            if group and (held >= rows or lst == ivf.nlist - 1):
                listno = np.concatenate([np.full(len(i), lst, "<i8") for lst, i, _ in group])
                listno = listno.view(np.uint8).reshape(-1, 8)[:, : ivf.coarse_code_size()]
                codes = np.hstack([listno, np.concatenate([c for _, _, c in group])])
                yield np.concatenate([i for _, i, _ in group]), self.index.sa_decode(np.ascontiguousarray(codes))
                group, held = [], 0

    def reconstruct(self, ids=None):
        """Decoded vectors (n, D), from the codes in the lists (written by hand: see the module docstring)."""
        ids = self._ids(ids)
        if not len(ids):
            return np.zeros((0, self.dim), np.float32)
        where = self._where()  # (ntotal, 2): list, offset
        if ids.min() < 0 or ids.max() >= len(where):
            raise UserError(f"reconstruct: ids must be in [0, {len(where)}), got {ids.min()}..{ids.max()}")
        ivf = self.ivf
        blocks = isinstance(faiss.downcast_InvertedLists(ivf.invlists), faiss.BlockInvertedLists)
        packer = ivf.get_CodePacker() if blocks else None
        codes = np.stack([self._code(ivf, packer, int(lst), int(off)) for lst, off in where[ids]])  # (n, code_size)
        if blocks:
            out = np.zeros((len(ids), self.dim), np.float32)
            out[:, : self.spec.m] = ivf.pq.decode(codes)  # fast-scan lists: not by residual, no rotation
            return out
        listno = where[ids, 0].astype("<i8").view(np.uint8).reshape(-1, 8)[:, : ivf.coarse_code_size()]
        return self.index.sa_decode(np.ascontiguousarray(np.hstack([listno, codes])))  # (n, D): through the chain

    def _where(self) -> np.ndarray:
        """(list, offset) of each id 0..n-1, from the lists' ids (kept until the next add)."""
        with self._rows_lock:
            if self._rows is None or self._rows[0] != len(self):
                ivf, lists = self.ivf, self.ivf.invlists
                where = np.zeros((len(self), 2), np.int64)
                for lst in range(ivf.nlist):
                    size = lists.list_size(lst)
                    if size:
                        rows = faiss.rev_swig_ptr(lists.get_ids(lst), size).copy()
                        where[rows, 0], where[rows, 1] = lst, np.arange(size)
                self._rows = (len(self), where)
            return self._rows[1]

    @staticmethod
    def _code(ivf, packer, lst: int, offset: int) -> np.ndarray:
        """The code at ``offset`` of list ``lst``, unpacked by ``packer`` (fast-scan blocks; None: stored flat).
        Shape: (code_size,) uint8."""
        lists = ivf.invlists
        if packer is not None:
            blocks = -(-lists.list_size(lst) // packer.nvec)
            packed = faiss.rev_swig_ptr(lists.get_codes(lst), blocks * packer.block_size)
            return packer.unpack_1(packed.reshape(blocks, packer.block_size), offset)
        return faiss.rev_swig_ptr(lists.get_single_code(lst, offset), ivf.code_size).copy()

    def add(self, x):
        if self.on_disk():  # FAISS would abort the process (an exception inside its threads), not raise
            raise UserError(f"{self.spec.label()} keeps its lists on disk, read-only: rebuild to add vectors")
        self._added(self, lambda: super(IVFCodec, self).add(x))
        self._rows = None

    def _added(self, target: "IVFCodec", add) -> None:
        """Run ``add`` (adding rows to ``target``, a copy of this code or this one) with, from :data:`LARGE_LISTS`
        lists on, :func:`assigner` of this code's centroids as ``target``'s quantiser, its flat one put back after.
        Every row gets a list: FAISS's k-means leaves no group of centroids empty (it splits empty clusters)."""
        ivf = target.ivf
        if ivf.nlist < LARGE_LISTS:
            add()
            return
        if self._assigner is None:
            self._assigner = assigner(faiss.downcast_index(self.ivf.quantizer).reconstruct_n(0, ivf.nlist))
        flat = ivf.quantizer
        ivf.quantizer = self._assigner  # owned by this code; the target's own_fields would free its flat one only
        try:
            add()
        finally:
            ivf.quantizer = flat

    def on_disk(self) -> bool:
        """Whether the lists are in a memory-mapped file (``faiss.OnDiskInvertedLists``)."""
        return ondisk.is_on_disk(self.index)

    def filled_on_disk(self, vectors, lists: Path) -> "IVFCodec":
        """A copy of this trained code holding every row of ``vectors`` (``ShardVectors``), its lists merged into
        the file ``lists`` (FAISS's on-disk lists, ``triclip.codecs.ondisk.merge_on_disk``; recorded by its bare
        name, read beside the code file). One shard in memory at a time; a shard's part already saved beside
        ``lists`` (by an earlier, killed run of the same build) is kept. Fast-scan lists (FAISS's blocked lists)
        have no on-disk form: UserError."""
        if isinstance(faiss.downcast_InvertedLists(self.ivf.invlists), faiss.BlockInvertedLists):
            raise UserError(f"{self.spec.label()}: fast-scan lists cannot be kept on disk")
        files, counts = [], []
        rows = progress(desc=f"encoding {self.spec.label()}", total=vectors.count, unit="row", disable=None)
        for s, part in enumerate(vectors.parts):
            rows.update(len(part))
            if not len(part):
                continue
            files.append(lists.parent / f"{lists.stem}.part{s:05d}.faiss")
            counts.append(len(part))
            if files[-1].exists():  # saved whole (atomic) by an earlier run of the same build: kept
                continue
            x = unit_prefix(self._check(np.asarray(part, np.float32), "vectors"), self.spec.m)
            copy = self.empty_copy()
            ids = np.arange(vectors.offsets[s], vectors.offsets[s] + len(x), dtype=np.int64)
            self._added(copy, lambda: copy.index.add_with_ids(x, ids))
            ondisk.save(copy.index, files[-1])
        rows.close()
        merged = ondisk.merge_on_disk(self.index, files, counts, lists)
        for file in files:
            file.unlink(missing_ok=True)
        ondisk.relocate_lists(merged, lists.name)
        return IVFCodec(self.spec, merged, self.dim)


def _inner_params(params: dict) -> dict:
    """The inner code's own parameters (M, nbits) from an IVF spec's."""
    return {k: v for k, v in params.items() if k in ("M", "nbits")}
