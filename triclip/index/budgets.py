"""``index build --bytes 8,16,32``: for each budget, the code that retrieves best, measured; torch-free.

For each budget B (bytes per vector, codes only) every codec and m that fits
(``triclip.codecs.candidates``) is fitted on the collection's vectors (a sample of at most
``FIT_ROWS``; the slowest fits, RQ's and OPQ's, on ``triclip.codecs.base.SLOW_FIT_ROWS`` of it), then measured
on an evaluation set: the validation split's served vectors
(``--val-data``), else the indexed data's first images. The image codes are measured by
text->image recall@10 over distinct caption texts (a text's positives are every image
carrying it); the caption codes, when the index holds captions, by image->text recall@10
over the same distinct texts (:meth:`EvalSet.reverse`). Either is searched through the
code itself (float queries against the codes; binary codes binarise the query, as their
users do); inverted lists are measured scanning every list, answered by exact search over their decoded codes
where their scores are those (:func:`exhaustive_ids`: no per-list work for every query; the nprobe ladder and
the shortlist likewise, :func:`_probed_by_decoding`), and tuned to scan at most a quarter of their lists
(:func:`max_nprobe`). The best code is kept (``--codec`` forces the codec, the best m of it is kept);
the very codec that was measured is filled with the collection and stored, so the recall
the manifest records is the measured recall of the codes actually stored; except inverted lists at N >=
``IVF_MIN_N``: the choice ranks them as fitted on the sample (their nlist capped by its rows), then the kept one is
refitted for N, filled, and its nprobe tuned at N against the exact float top 10 among all N rows
(:mod:`triclip.index.scale`); the manifest records both (``sized_for_n``, ``at_n``). Every candidate's recall goes
to ``curves.json`` (``bytes``; ``text_bytes`` for the captions), beside float pruning (the index ordering's curve
at 4m bytes): the frontier the app draws (:mod:`triclip.index.report`, with the manifest entry and the table).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from triclip.core.errors import UserError
from triclip.core.progress import progress
from triclip import codecs
from triclip.index.latency import Latency, LatencyModel
from triclip.index.search import rerank
from triclip.index.vectors import SQ8Rows, exact_topk, exact_topk_of

FIT_ROWS = 20_000  # collection vectors a code is fitted on (a seeded sample beyond)
EVAL_MAX_IMAGES = 5000  # without --val-data: the indexed data's first this many images
K = 10  # recall@K
TUNE_QUERIES = 200  # evaluation queries that tune nprobe and the shortlist, and time the codes
SHORTLISTS = (20, 50, 100, 200, 500, 1000, 2000, 5000)  # float re-rank shortlists tried on the sample
PROBE_SHARE = 0.25  # inverted lists scan at most this share of their lists (tune_nprobe); a re-rank's shortlist
# is likewise at most a quarter of the sample (tune_shortlist)
FINALIST_MARGIN = 0.05  # at scale, another code within this share of the exact top 10 of the kept one on the
# sample is its rival, measured against it at N before one is stored (triclip.index.finalists)
OVERLAP_CELLS = 1 << 22  # comparisons :func:`overlap` holds at once (4 MB of bools)
SHORTLIST_MAX = 50_000  # longest shortlist at N (scaled from the sample): 200 MB of float vectors read per query


@dataclass
class EvalSet:
    """Served vectors to measure a code on: a gallery, queries and each query's positives.

    As :meth:`of` makes it, the gallery is images and the queries distinct caption texts
    (text->image); :meth:`reverse` swaps them (image->text, for the caption codes).
    """

    gallery: np.ndarray  # (n, D) float32 full-D compact vectors searched (images; texts when reversed)
    queries: np.ndarray  # (Q, D) float32: one vector per distinct caption text (per image when reversed)
    positives: list[set[int]]  # per query: the gallery rows that answer it
    split: str  # "validation" (--val-data) or "indexed" (the indexed data's first images)
    data: str  # where it came from
    metric: str = "t2i_r10"  # what recall@10 measures: t2i_r10 (image codes) or i2t_r10 (caption codes)
    texts: list[str] | None = None  # the caption string of each distinct text (queries; gallery rows when reversed)

    @classmethod
    def of(cls, image: np.ndarray, text: np.ndarray, owner: np.ndarray, texts: list[str], split: str, data: str):
        """From caption vectors (T, D), their image rows ``owner`` (T,) and strings ``texts`` (T)."""
        first: dict[str, int] = {}
        positives: dict[str, set[int]] = {}
        for t, (caption, row) in enumerate(zip(texts, np.asarray(owner).tolist())):
            first.setdefault(caption, t)
            positives.setdefault(caption, set()).add(int(row))
        rows = list(first.values())
        queries = np.ascontiguousarray(np.asarray(text, np.float32)[rows])
        return cls(np.ascontiguousarray(image, dtype=np.float32), queries, [positives[c] for c in first], split, data,
                   texts=list(first))

    def reverse(self) -> "EvalSet":
        """Image -> text over the same distinct texts: an image's positives are the texts it carries.
        Images carrying none of them are left out (they have no answer)."""
        answers: list[set[int]] = [set() for _ in range(len(self.gallery))]
        for text, rows in enumerate(self.positives):
            for row in rows:
                answers[row].add(text)
        keep = [row for row, texts in enumerate(answers) if texts]
        metric = "i2t_r10" if self.metric == "t2i_r10" else "t2i_r10"
        return EvalSet(self.queries, np.ascontiguousarray(self.gallery[keep]), [answers[r] for r in keep], self.split,
                       self.data, metric, self.texts)


def recall_at_k(ids: np.ndarray, positives: list[set[int]], k: int = K) -> float:
    """Share of queries with a positive among their first k ids. ids: (Q, >= k), -1 for none."""
    hits = [bool(positives[q] & set(row[:k].tolist())) for q, row in enumerate(np.asarray(ids))]
    return float(np.mean(hits)) if hits else 0.0


def measure(codec: codecs.Codec, evaluation: EvalSet, shortlist: int | None = None,
            rows: np.ndarray | None = None) -> float:
    """Recall@10 of ``codec``'s trained code on the evaluation set (a copy holding its gallery), scanning every
    vector (inverted lists: all of them). ``shortlist``: its top ``shortlist`` re-ranked by the gallery's full-D
    ``rows`` (n, D) as the stored vectors keep them (:meth:`Rules.kept`; None: the float32 gallery)."""
    gallery = codec.empty_copy()
    gallery.add(evaluation.gallery)
    if shortlist is None:
        return recall_at_k(exhaustive_ids(gallery, evaluation.queries, K), evaluation.positives)
    rows = evaluation.gallery if rows is None else rows
    return recall_at_k(_two_stage(gallery, rows, evaluation.queries, shortlist), evaluation.positives)


def exhaustive_ids(codes: codecs.Codec, queries: np.ndarray, k: int) -> np.ndarray:
    """Top-k ids of ``codes`` scanning every vector (inverted lists: every list). Shape: (Q, k), -1 for none.

    Lists that score the vectors they decode (:meth:`~triclip.codecs.Codec.scores_decoded`) are answered by exact
    search over their reconstruction: the same answers as FAISS with nprobe = nlist (tests/index/test_ivf.py),
    without FAISS's per-list work for every query and list (a residual code's lookup table per list)."""
    if codes.exhaustive() is None:
        return codes.search(queries, k)[1]
    if not codes.scores_decoded():
        return codes.search(queries, k, params=codes.exhaustive())[1]
    ids = np.full((len(queries), k), -1, np.int64)
    if len(codes):
        found = exact_topk_of(codes.decoded_lists(), queries, min(k, len(codes)))  # (Q, k'): a group at a time
        ids[:, : found.shape[1]] = found
    return ids


def latency_model() -> LatencyModel:
    """The latency model a build uses: timed on this machine (tests replace this function: nothing is timed)."""
    return LatencyModel()


@dataclass
class Rules:
    """What a budget's code must meet (``index build --bytes B [--latency-ms L]``)."""

    n: int  # the collection's size N the latencies are for
    latency_ms: float | None = None  # single-query bound, one thread (None: the float32 scan of N vectors at D)
    recall_target: float = 0.95  # nprobe: share of the code's own top 10 kept (at N: of what its lists scanned whole
    # hold of the exact float top 10); shortlist: of the exact float top 10
    rescore: bool = True  # also offer each code as the first of two stages (its shortlist re-ranked by float vectors)
    model: LatencyModel = field(default_factory=lambda: latency_model())  # how latencies are obtained
    reads_from: str | None = None  # the float vectors file a re-rank reads from disk (they exceed the memory
    # budget): its cold reads are timed and charged, and shorter shortlists offered; None: they stay in memory
    vector_bytes: int = 4  # bytes per dimension of the stored float vectors a re-rank reads (2: float16, 1: sq8)
    sq8: np.ndarray | None = None  # the ranges of vectors kept as sq8 codes (a re-rank decodes them); None: floats

    def kept(self, rows: np.ndarray) -> np.ndarray:
        """Full-D ``rows`` (n, D) float32 as the stored vectors a re-rank reads hold them: as they are (float32),
        rounded to float16, or coded as sq8 and decoded; what a re-rank's recall is measured with."""
        rows = np.asarray(rows, np.float32)
        if self.sq8 is not None:
            store = SQ8Rows(np.empty((0, rows.shape[1]), np.uint8), self.sq8)
            return store.decode(store.encode(rows))
        return rows.astype(np.float16).astype(np.float32) if self.vector_bytes == 2 else rows

    def rerank_ms(self, gallery: np.ndarray, queries: np.ndarray, count: int) -> float:
        """One query's re-rank of ``count`` candidates: scoring them, plus reading them cold from disk
        (``reads_from``)."""
        ms = self.model.rerank(gallery, queries, count)
        return ms + (self.model.cold_rows(self.reads_from, count) if self.reads_from else 0.0)


@dataclass
class Variant:
    """One way to search a fitted code: alone, or as the first stage before a float re-rank."""

    codec: codecs.Codec  # fitted, holding no vectors (inverted lists: with their tuned nprobe)
    recall: float  # recall@10 on the evaluation set, times ``keeps``
    latency: Latency  # one query at N
    shortlist: int | None = None  # candidates re-ranked by the float vectors at N (None: the codes alone)
    shortlist_how: str = "measured"  # measured at N, or extrapolated from the sample (N / n_sample times longer)
    reads: str = "memory"  # where the re-rank's float vectors come from: "memory" (the page cache), or "disk"
    keeps: float = 1.0  # inverted lists: share of the exhaustive answers kept at the tuned nprobe (on the sample)
    code_recall: float = 0.0  # the codes alone, scanned exhaustively, on the evaluation set
    fidelity: float | None = None  # share of the exact float top 10 on the tuning sample its answers hold (at the
    # tuned nprobe; re-ranked: what its shortlist holds, which the re-rank keeps)
    by_fidelity: bool = False  # ranked by fidelity (N >= IVF_MIN_N: see choose), else by recall
    encode_us: float | None = None  # microseconds to encode one row, timed filling the sample's copy (None: untimed)

    @property
    def score(self) -> float:
        """What the choice ranks it by: fidelity at scale, else recall."""
        return self.fidelity if self.by_fidelity else self.recall

    def entry(self, row_bytes: int) -> dict:
        """Its row in ``curves.json``'s candidates and in the build's table; ``row_bytes``: one stored float
        vector's (what a re-rank reads per candidate)."""
        spec = self.codec.spec
        return {"label": spec.label(), "codec": spec.codec, "m": spec.m, "bytes": spec.bytes_per_vector,
                "stages": "codes" if self.shortlist is None else "codes + float re-rank", "recall": self.recall,
                "code_recall": self.code_recall, "keeps": round(self.keeps, 4), "latency_ms": round(self.latency.ms, 4),
                "latency": self.latency.how, "shortlist": self.shortlist,
                "disk_bytes_per_query": row_bytes * (self.shortlist or 0), "reads": self.reads if self.shortlist else None,
                "fidelity": None if self.fidelity is None else round(self.fidelity, 4)}


@dataclass
class Choice:
    """The code kept for one budget, and what every candidate measured."""

    budget: int
    codec: codecs.Codec  # fitted, holding no vectors
    recall: float  # measured on the evaluation set, by this very codec (and its stages)
    tried: list[dict]  # per candidate (and stage), in the order of codecs.candidates: Variant.entry, or a
    # {"label", "codec", "m", "bytes", "recall": None, "error" | "skipped"} for one not measured; each with
    # "seconds" (the wall time the candidate took), a fitted one with "fit_seconds"
    kept: Variant | None = None  # the kept way to search it
    bound_ms: float = 0.0  # the latency bound it was kept within
    reference: Latency | None = None  # the float32 scan of N vectors at D
    note: str = ""  # why the kept code is outside the bound, when it is
    full_recall: float | None = None  # the float vectors' own recall@10 at D on the evaluation set (the ceiling)
    ranked_by: str = "recall"  # what the candidates were ranked by: "recall", or at scale "fidelity" (see choose)
    rival: Variant | None = None  # at scale: another code within FINALIST_MARGIN of the kept one (_rival)
    first_stage: Variant | None = None  # at scale, with a re-rank: the best first stage for a shortlist (_first_stage)
    finalists: dict | None = None  # what each finalist held at N, the kept one first (triclip.index.finalists.settle)
    sized_at_n: tuple | None = None  # (codec, what was done): the kept code as sized_for_n refitted it there
    filled_at_n: codecs.Codec | None = None  # the kept code filled with every row by the finalists: stored as it is
    tuned_at_n: dict | None = None  # tune_at_n of the kept variant on filled_at_n by the finalists: recorded as it is


def choose(budget: int, train: np.ndarray, evaluation: EvalSet, force: str | None = None, seed: int = 0,
           rules: Rules | None = None) -> Choice:
    """Fit the candidate codes of ``budget`` bytes on ``train`` (N, D), measure each, keep the best within the
    latency bound of ``rules`` (None: N = len(train), bound = the float32 scan of N vectors, with re-scoring).

    Best: the highest recall@10 on the evaluation set, counted up to the float vectors' own (more is noise of
    the evaluation set: a code cannot know more than the vectors it codes), then the fewer bytes, then the faster.
    At N >= ``IVF_MIN_N`` a few hundred validation images no longer tell codes apart that differ among N (they all
    measure near the float recall, within its noise): there the best holds the largest share of the exact float
    top 10 among the tuning sample (``fidelity``), counted up to ``rules.recall_target``, then fewer bytes, then
    faster; its recall is still measured and reported.
    Candidates the evidence puts below another candidate are not fitted (:func:`not_worth_trying`); slow-to-fit
    codes are fitted last, the quicker first (:func:`_fit_order`), and left out unfitted when they cannot win:
    their probe's scan alone is slower than the bound, or a kept code already has full-D recall with no more bytes
    and a faster query. Each one left out is a "skipped" entry of ``tried`` with its reason (the build's table
    prints it).
    ``force``: only that codec's candidates. Without any code within the default bound, the fastest is kept
    (``note`` says so); with ``rules.latency_ms`` given, that is a UserError.
    """
    dim = train.shape[1]
    rules = rules or Rules(n=len(train))
    specs = codecs.candidates(budget, dim, rules.n)
    specs = specs if force is None else [s for s in specs if s.codec == force]
    if not specs:
        raise UserError(f"--codec {force} has no code that fits {budget} bytes per vector at D={dim}")
    evidence = {} if force is not None else not_worth_trying(specs, budget, min(len(train), FIT_ROWS))
    tune = TuneSet.of(_sample(train, seed), evaluation)
    reference = rules.model.float_scan(tune.gallery, tune.queries, rules.n)
    bound = rules.latency_ms if rules.latency_ms is not None else reference.ms
    full = recall_at_k(exact_topk(evaluation.gallery, evaluation.queries, K), evaluation.positives)
    by_fidelity = at_scale(rules.n)
    ceiling = rules.recall_target if by_fidelity else full  # what a variant's score is counted up to
    tried: list[dict | None] = [None] * len(specs)
    found: list[Variant] = []
    order = sorted(range(len(specs)), key=lambda i: _fit_order(specs[i]) + (i,))
    for i in progress(order, desc=f"codes of {budget} B", unit="code", disable=None):
        started = time.perf_counter()
        why = evidence.get(i) or _left_out(specs[i], _best(found, bound, ceiling), bound, ceiling, rules, tune)
        tried[i] = [_unmeasured(specs[i], "skipped", why)] if why else _measure(specs[i], evaluation, tune, rules, found)
        for entry in tried[i]:  # wall seconds this candidate took (probe, fit, measures): where a choice's time goes
            entry["seconds"] = round(time.perf_counter() - started, 2)
    if not found and rules.latency_ms is None:  # the default bound left out every code unfitted: the fastest is kept
        for i in order:
            if tried[i][0].get("skipped") and i not in evidence:
                tried[i] = _measure(specs[i], evaluation, tune, rules, found)
    choice = _kept(budget, found, [e for entries in tried for e in entries], bound, ceiling, reference, rules)
    choice.full_recall, choice.ranked_by = full, "fidelity" if by_fidelity else "recall"
    choice.rival = _rival(found, choice.kept, bound, ceiling) if by_fidelity else None
    choice.first_stage = _first_stage(found, bound, choice.kept) if by_fidelity and rules.rescore else None
    return choice


def at_scale(n: int) -> bool:
    """Whether a collection of ``n`` rows is chosen for at scale (inverted lists offered, fidelity ranks)."""
    from triclip.codecs import ivf

    return n >= ivf.IVF_MIN_N


def _measure(spec, evaluation: EvalSet, tune: "TuneSet", rules: Rules, found: list) -> list[dict]:
    """Fit ``spec`` on the tuning sample and measure it (its variants appended to ``found``); the entries of
    what was tried (an "error" entry when the code cannot be fitted here, e.g. too few vectors)."""
    started = time.perf_counter()
    try:
        codec = codecs.fit(spec, fit_sample(tune.gallery, spec))
    except UserError as err:
        return [_unmeasured(spec, "error", str(err))]
    fitted = round(time.perf_counter() - started, 2)
    variants = evaluate(codec, evaluation, tune, rules)
    found.extend(variants)
    row_bytes = rules.vector_bytes * tune.gallery.shape[1]
    return [{**v.entry(row_bytes), "fit_seconds": fitted} for v in variants]


def fit_sample(gallery: np.ndarray, spec: codecs.CodecSpec) -> np.ndarray:
    """The rows of the tuning sample (n, D) that ``spec`` is fitted on: all, or a seeded subset of the codec's
    ``fit_rows`` (slow fits; the whole sample still tunes nprobe and the shortlist, and fills the timed copy)."""
    most = codecs.lookup(spec.codec).fit_rows_of(spec)
    if most is None or len(gallery) <= most:
        return gallery
    return gallery[np.sort(np.random.default_rng(0).choice(len(gallery), size=most, replace=False))]


def _kept(budget, found, tried, bound, ceiling, reference, rules) -> Choice:
    """The Choice of the best variant within ``bound``; without one, the fastest (or a UserError, see choose)."""
    if not found:
        raise UserError(f"no code of {budget} bytes per vector could be fitted: "
                        f"{next((t.get('error') or t.get('skipped')) for t in reversed(tried))}")
    best, note = _best(found, bound, ceiling), ""
    if best is None:
        fastest = min(found, key=lambda v: v.latency.ms)
        if rules.latency_ms is not None:
            raise UserError(f"no code of {budget} bytes per vector answers within {rules.latency_ms:g} ms at"
                            f" N = {rules.n:,}: the fastest, {_words(fastest)}, takes {fastest.latency.ms:.3g} ms")
        best, note = fastest, f"no code within the float scan's {bound:.3g} ms at N = {rules.n:,}: the fastest kept"
    return Choice(budget, best.codec, best.recall, tried, best, bound, reference, note)


def _rival(found: list[Variant], kept: Variant | None, bound: float, ceiling: float) -> Variant | None:
    """The best variant of another code than ``kept``'s within ``bound`` whose score (up to ``ceiling``) is within
    :data:`FINALIST_MARGIN` of the kept one's; None when there is none."""
    if kept is None:
        return None
    close = [v for v in found if v.codec is not kept.codec and v.latency.ms <= bound
             and min(v.score, ceiling) >= min(kept.score, ceiling) - FINALIST_MARGIN]
    return max(close, key=lambda v: _rank(v, ceiling), default=None)


def _first_stage(found: list[Variant], bound: float, kept: Variant | None = None) -> Variant | None:
    """A first stage that a shortlist measured at N may fit into the bound (``triclip.index.finalists``): among the
    codes whose codes alone answer within half of ``bound``, each one's shortest re-ranked variant on the sample
    (the nearest to the shortlists that fit at N, within the bound or not), the one holding the most, then the
    shorter; None when there is none. A long shortlist's share says little about a short one's: at 1M and 32 B,
    flat 4-bit PQ's top 25,000 held .987 of the sample's exact top 10 and lists of OPQ's nothing past .901, but
    their tops of 1,000 held .560 and .866, and 4-bit PQ's re-rank of 300 rows held .639 at N.
    Not ``kept``'s code: it is a finalist already, and every finalist's shortlists are measured at N. At 1M and
    16 B, lists of RQ were kept and were also the best first stage (their top 1,000 .844 on the sample, OPQ's
    .778), so lists of OPQ were never measured at N: RQ's slower scan left room for a top 100 there (.907)."""
    fast = {id(v.codec) for v in found if v.shortlist is None and v.latency.ms <= bound / 2
            and (kept is None or v.codec is not kept.codec)}
    shortest: dict[int, Variant] = {}
    for v in found:
        if v.shortlist is not None and id(v.codec) in fast:
            if id(v.codec) not in shortest or v.shortlist < shortest[id(v.codec)].shortlist:
                shortest[id(v.codec)] = v
    return max(shortest.values(), key=lambda v: (v.score, -v.shortlist), default=None)


def _best(found: list[Variant], bound: float, ceiling: float) -> Variant | None:
    """The best variant within ``bound`` (see :func:`choose`), None when none is."""
    return max((v for v in found if v.latency.ms <= bound), key=lambda v: _rank(v, ceiling), default=None)


def _rank(v: Variant, ceiling: float) -> tuple:
    """choose's order: the score counted up to ``ceiling``, then fewer bytes, then faster."""
    return min(v.score, ceiling), -v.codec.spec.bytes_per_vector, -v.latency.ms


def _fit_order(spec: codecs.CodecSpec) -> tuple[int, int]:
    """Where a candidate is fitted among a budget's: by its codec's ``fit_cost`` rank, then its ``fit_work``."""
    codec = codecs.lookup(spec.codec)
    return codec.fit_cost, codec.fit_work(spec)


def _left_out(spec, best: Variant | None, bound: float, ceiling: float, rules: Rules, tune) -> str:
    """Why a slow-to-fit candidate is not fitted ("" to fit it): it cannot win."""
    if codecs.lookup(spec.codec).fit_cost == 0:
        return ""
    full = best is not None and best.score >= ceiling and spec.bytes_per_vector >= best.codec.spec.bytes_per_vector
    probe = rules.model.probe(spec, tune.gallery, rules.n, tune.queries)
    if probe is not None and probe.ms > bound:
        return f"its scan alone takes {probe.ms:.3g} ms at N = {rules.n:,} ({probe.how}), over {bound:.3g} ms"
    if full and (probe is None or probe.ms >= best.latency.ms):
        what = f"{ceiling:g} of exact search's top 10" if best.by_fidelity else "full-D recall"
        return f"cannot win: {_words(best)} already keeps {what} in fewer or as many bytes, as fast"
    return ""


def _words(v: Variant) -> str:
    return v.codec.spec.label() + ("" if v.shortlist is None else f" + float re-rank of {v.shortlist}")


def _unmeasured(spec: codecs.CodecSpec, key: str, why: str) -> dict:
    return {"label": spec.label(), "codec": spec.codec, "m": spec.m, "bytes": spec.bytes_per_vector, "recall": None,
            key: why}


# ---------------------------------------------------------------------------- a fitted code's stages


@dataclass
class TuneSet:
    """What nprobe, the shortlist and the latencies are tuned on: a sample of the collection (the gallery) and
    the first evaluation queries, with their exact float32 top 10 among the sample."""

    gallery: np.ndarray  # (n_s, D) collection vectors (the codes' training sample)
    queries: np.ndarray  # (Q, D), Q <= TUNE_QUERIES
    truth: np.ndarray  # (Q, K) exact top-K rows of gallery

    @classmethod
    def of(cls, sample: np.ndarray, evaluation: EvalSet) -> "TuneSet":
        queries = np.ascontiguousarray(evaluation.queries[:TUNE_QUERIES], dtype=np.float32)
        return cls(sample, queries, exact_topk(sample, queries, K))


def evaluate(codec: codecs.Codec, evaluation: EvalSet, tune: TuneSet, rules: Rules) -> list[Variant]:
    """The ways to search a fitted ``codec``: alone, and (``rules.rescore``) as the first stage of a float
    re-rank, each with its recall on the evaluation set and its latency at N.

    Inverted lists get the fewest lists (a power of two) that keep ``rules.recall_target`` of their own
    exhaustive top 10 on the sample, at most :func:`max_nprobe` (:func:`tune_nprobe`; at the cap the share kept
    may be lower: ``keeps`` says it), set on ``codec``; the re-rank gets the shortest
    shortlist whose re-ranked top 10 holds that share of the exact float top 10 (:func:`tune_shortlist`),
    scaled to N when the sample is smaller. Recall on the evaluation set is measured scanning every list,
    times the share kept at the tuned nprobe (``keeps``), with the shortlist the same share of its gallery as at N,
    re-ranked by the gallery's rows as the stored vectors keep them (:meth:`Rules.kept`: float16 or sq8 cost
    recall there, as in the served re-rank).
    """
    copy = codec.empty_copy()
    started = time.perf_counter()
    copy.add(tune.gallery)
    encode_us = 1e6 * (time.perf_counter() - started) / max(len(tune.gallery), 1)  # weighs a finalist's fill at N
    keeps = 1.0
    if copy.exhaustive() is not None:
        nprobe, keeps = tune_nprobe(copy, tune.queries, rules.recall_target)
        codec.set_nprobe(nprobe)
        copy.set_nprobe(nprobe)
    code_recall = measure(codec, evaluation)
    fidelity = overlap(copy.search(tune.queries, K)[1], tune.truth)  # before a timing fills the copy at random
    staged = []
    if rules.rescore and not (codec.spec.codec == "float32" and codec.spec.m == codec.dim):  # exact already
        staged = tune_shortlist(copy, tune, rules.recall_target, shorter=rules.reads_from is not None)
    n_s, n_eval = len(tune.gallery), len(evaluation.gallery)
    scale, out = at_scale(rules.n), []
    rows = rules.kept(evaluation.gallery) if staged else None  # (n_eval, D) what the re-rank reads
    for shortlist, keeps2, held in staged:
        at_n = shortlist if rules.n <= n_s else min(SHORTLIST_MAX, math.ceil(shortlist * rules.n / n_s))
        if out and out[-1].shortlist == at_n:  # a longer sample list past SHORTLIST_MAX: no longer read at N
            break
        recall = measure(codec, evaluation, max(K, min(n_eval, math.ceil(at_n * n_eval / max(rules.n, 1)))), rows)
        first = rules.model.search(copy, tune.queries, min(at_n, len(copy)), rules.n)
        latency = first.plus(rules.rerank_ms(tune.gallery, tune.queries, at_n))
        out.append(Variant(codec, recall * keeps2, latency, at_n, "measured" if rules.n <= n_s else "extrapolated",
                           "disk" if rules.reads_from else "memory", keeps2, code_recall, held, scale, encode_us))
    alone = rules.model.search(copy, tune.queries, K, rules.n)
    return [Variant(codec, code_recall * keeps, alone, keeps=keeps, code_recall=code_recall, fidelity=fidelity,
                    by_fidelity=scale, encode_us=encode_us)] + out


def tune_nprobe(copy: codecs.Codec, queries: np.ndarray, target: float) -> tuple[int, float]:
    """The smallest power of two nprobe, up to :func:`max_nprobe`, whose top 10 keeps ``target`` of the
    exhaustive top 10 on ``copy`` (inverted lists holding the sample); and the share it keeps (below ``target``
    when even the cap does not keep it: that share is what the candidate's recall is multiplied by)."""
    nlist = copy.exhaustive()["nprobe"]
    search = _probed_by_decoding(copy, queries) if copy.scores_decoded() and len(copy) else (
        lambda p: copy.search(queries, K, params={"nprobe": p})[1])
    whole = search(nlist)
    cap, nprobe = max_nprobe(nlist), 1
    while True:
        kept = overlap(search(nprobe), whole)
        if kept >= target or nprobe >= cap:
            return nprobe, kept
        nprobe = min(2 * nprobe, cap)


def _probed_by_decoding(copy: codecs.Codec, queries: np.ndarray):
    """A function (nprobe, k=K) -> the top-k ids (Q, k) of ``copy``'s lists at that nprobe, by exact search over the
    decoded vectors of the lists a query scans (:meth:`~triclip.codecs.ivf.IVFCodec.list_ranks`): FAISS's answers
    without its per-list work for every query (tests/index/test_choice_scale.py), -1 where fewer are scanned."""
    scores = np.asarray(queries, np.float32) @ copy.reconstruct().T  # (Q, n)
    ranks, lists = copy.list_ranks(queries)
    rank = ranks[:, lists]  # (Q, n): where each vector's list ranks for each query

    def search(nprobe: int, k: int = K) -> np.ndarray:
        masked = np.where(rank < nprobe, scores, -np.inf)
        k = min(k, masked.shape[1])
        top = np.argpartition(-masked, k - 1, axis=1)[:, :k]
        top = np.take_along_axis(top, np.argsort(-np.take_along_axis(masked, top, 1), axis=1, kind="stable"), 1)
        return np.where(np.isfinite(np.take_along_axis(masked, top, 1)), top, -1)
    return search


def max_nprobe(nlist: int) -> int:
    """The most lists a tuned inverted code scans: a :data:`PROBE_SHARE` of ``nlist`` (at least one). Scanning
    more is no shortcut over the flat code: it reads most codes and pays the coarse search and the per-list work."""
    return max(1, int(nlist * PROBE_SHARE))


def tune_shortlist(copy: codecs.Codec, tune: TuneSet, target: float,
                   shorter: bool = False) -> list[tuple[int, float, float]]:
    """The shortest of :data:`SHORTLISTS` whose float re-rank holds ``target`` of the exact top 10 on the sample,
    as ``[(length, keeps, held)]``: (inverted lists) the share of the exhaustive lists' re-ranked answers kept at
    the code's nprobe, and what it holds of the exact top 10; [] when none up to a quarter of the sample does (a
    longer one is no shortcut over the float scan). ``shorter``: every shorter length tried too, before it (when
    the re-rank reads from disk a shorter list may be the best within the latency bound), and with none holding
    the target, every length tried.

    A re-rank by the exact scores keeps every true top-10 row its shortlist holds (they outscore the rest), so
    what it holds of the exact top 10 is the shortlist's overlap with it: no re-rank is run here. A re-rank by
    float16 or sq8 rows may swap near-ties, so for those this is what the shortlist offers, an upper bound."""
    lengths = [n for n in SHORTLISTS if n <= len(copy) // 4]
    search = lambda length: copy.search(tune.queries, length)[1]  # noqa: E731
    if copy.exhaustive() is not None and copy.scores_decoded() and lengths:  # lists: as FAISS at the code's nprobe
        probed = _probed_by_decoding(copy, tune.queries)
        search = lambda length: probed(copy.spec.params["nprobe"], length)  # noqa: E731
    start, tried = 0, []
    while start < len(lengths):  # search ever longer shortlists: long ones cost a heap per query
        end = min(len(lengths), start + 2)
        ids = search(lengths[end - 1])  # (Q, L) best first: shorter ones are prefixes
        for length in lengths[start:end]:
            tried.append((length, _held(ids[:, :length], tune.truth)))
            if tried[-1][1] >= target:
                return [(n, _kept_share(copy, tune, n, h), h) for n, h in (tried if shorter else tried[-1:])]
        start = end
    return [(n, _kept_share(copy, tune, n, h), h) for n, h in tried] if shorter else []


def _kept_share(copy: codecs.Codec, tune: TuneSet, length: int, held: float) -> float:
    """Inverted lists: the share of what the exhaustive lists' shortlist of ``length`` holds of the exact top 10
    that the probed one holds (``held``); 1 for a code without lists."""
    if copy.exhaustive() is None:
        return 1.0
    whole = exhaustive_ids(copy, tune.queries, length)
    return min(1.0, held / max(_held(whole, tune.truth), 1e-9))


def _held(shortlists: np.ndarray, truth: np.ndarray) -> float:
    """Mean share of each row of ``truth`` (Q, K) that the same row of ``shortlists`` (Q, L) holds."""
    return overlap(shortlists, truth)


def _two_stage(codes: codecs.Codec, vectors: np.ndarray, queries: np.ndarray, shortlist: int) -> np.ndarray:
    """Top-K ids: the codes' exhaustive top ``shortlist``, re-ranked by the float ``vectors`` (N, D). Shape: (Q, K)."""
    candidates = exhaustive_ids(codes, queries, min(shortlist, len(codes)))
    return rerank(vectors, queries, candidates, K)[1]


def overlap(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean share of each row of ``truth`` (Q, K) found in the same row of ``found`` (Q, >= K): per row, the
    distinct ids of ``truth`` that ``found`` holds, over K (a duplicate in ``truth`` counts once, as a set does)."""
    found, truth = np.asarray(found), np.asarray(truth)
    hit = np.zeros(truth.shape, bool)  # (Q, K): truth[q, k] is in found[q]
    step = max(1, OVERLAP_CELLS // max(truth.shape[1] * found.shape[1], 1))
    for start in range(0, len(truth), step):  # rows in blocks: a block's comparisons hold OVERLAP_CELLS bools
        rows = slice(start, start + step)
        hit[rows] = (truth[rows, :, None] == found[rows, None, :]).any(axis=2)
    again = np.tril(truth[:, :, None] == truth[:, None, :], -1).any(axis=2)  # (Q, K): an id seen earlier in its row
    return float(np.mean((hit & ~again).sum(axis=1) / truth.shape[1]))


def overlap_within(scores: np.ndarray, kth: np.ndarray, eps: float) -> float:
    """Mean share of the found whose exact score is within ``eps`` of the exact K-th: recall that counts a near-tie
    with the K-th as found, as ann-benchmarks' k-nn recall does (eps = 1e-3 there, on distances). At 100M rows the
    exact top 10 can lie closer together than any code's error; this separates codes that the plain overlap cannot.
    Shape: scores (Q, K) the exact scores of each query's found K (-inf for none), kth (Q,) the exact K-th score."""
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    return float(np.mean(np.asarray(scores) >= np.asarray(kth)[:, None] - eps))


NEVER_BEST_BELOW = {  # codec -> the budget (bytes per vector) below which it never measured best: not fitted there
    # docs/results_bytes.md, 8-32 B on openclipart, Tux Paint and fashion-mnist (3 seeds each): plain PQ below OPQ
    # (its rotated form, also a candidate) at every budget and data set, at both of its m's
    "pq": 64,
}
RQ_OVER_OPQ_ROWS = 5000  # fitted on at least this many vectors, RQ measured above OPQ at 4, 8 and 16 B (openclipart,
# 5,443 train vectors, every seed; on Tux Paint's 627 OPQ won): where RQ is a candidate, OPQ (the slowest fit,
# about 2x RQ's CPU time at 8 and 16 B) is not fitted. Not extended to inverted lists: at 1M rows of the haystack
# (docs/results_scale.md, "Peers at 1M") lists of OPQ measured best on the val split at 8 and 16 B, lists of RQ
# among the candidates
MIXED_OVER_OPQ_FROM = 32  # from this budget up, mixed (a fit of seconds) measured level with OPQ (docs/results_bytes.md,
# 32 B, 3 seeds: openclipart mixed - OPQ -0.001 +- .007, below the seed spread; Tux Paint: OPQ below int8, mixed
# above it; fashion-mnist saturated): where mixed is a candidate, OPQ (16 s per side on the demo's 5,000 rows,
# the slowest fit of 32 B) is not fitted


def worth_trying(specs: list[codecs.CodecSpec], budget: int, rows: int) -> list[codecs.CodecSpec]:
    """The candidates of ``budget`` that the evidence leaves a chance of measuring best, for a code fitted on
    ``rows`` vectors (:func:`not_worth_trying`); the cheap ones stay whatever they measured, as the frontier's
    peers. ``--codec`` bypasses this."""
    left_out = not_worth_trying(specs, budget, rows)
    return [s for i, s in enumerate(specs) if i not in left_out]


def not_worth_trying(specs: list[codecs.CodecSpec], budget: int, rows: int) -> dict[int, str]:
    """Index in ``specs`` -> why that candidate is not fitted: measured below another candidate of ``specs`` (or
    level with a far cheaper one) wherever the evidence has it (:data:`NEVER_BEST_BELOW`, :data:`RQ_OVER_OPQ_ROWS`,
    :data:`MIXED_OVER_OPQ_FROM`). Deterministic: the candidates, the budget and ``rows`` decide, nothing timed."""
    has_rq = any(s.codec == "rq" for s in specs)
    why = {}
    for i, spec in enumerate(specs):
        if budget < NEVER_BEST_BELOW.get(spec.codec, 0):
            why[i] = (f"not fitted below {NEVER_BEST_BELOW[spec.codec]} B: it measured below another candidate at"
                      " every budget and data set (docs/results_bytes.md)")
        elif rows >= RQ_OVER_OPQ_ROWS and spec.codec == "opq" and has_rq:
            why[i] = (f"not fitted: fitted on >= {RQ_OVER_OPQ_ROWS:,} vectors, RQ (a candidate here) measured above"
                      " OPQ at 4-16 B (docs/results_bytes.md)")
        elif spec.codec == "opq" and budget >= MIXED_OVER_OPQ_FROM and any(s.codec == "mixed" for s in specs):
            why[i] = (f"not fitted from {MIXED_OVER_OPQ_FROM} B: mixed (a candidate here, fitted in seconds) measured"
                      " level with OPQ there (docs/results_bytes.md)")
    return why


def _sample(train: np.ndarray, seed: int) -> np.ndarray:
    """At most ``FIT_ROWS`` rows of ``train`` (N, D), drawn by ``seed``, float32."""
    if len(train) <= FIT_ROWS:
        return np.ascontiguousarray(train, dtype=np.float32)
    rows = np.sort(np.random.default_rng(seed).choice(len(train), size=FIT_ROWS, replace=False))
    return np.ascontiguousarray(train[rows], dtype=np.float32)


def choose_all(budgets: list[int], vectors, evaluation: EvalSet, force: str | None = None,
               seed: int = 0, rules: Rules | None = None) -> list[Choice]:
    """:func:`choose` for every budget, fitted on a sample of ``vectors`` (``triclip.index.vectors.ShardVectors``: the
    image rows, or the caption rows with a reversed ``evaluation``); ``rules``: N is ``vectors.count`` whatever
    it says. The sample is the only part of the collection held in memory here. Budgets are measured largest
    first; each keeps a smaller budget's code that ranks above its own (:func:`no_worse_than_smaller`; below
    :func:`at_scale` only when no codec is forced); the choices come back in ``budgets``' order."""
    rows = np.arange(vectors.count)
    if len(rows) > FIT_ROWS:
        rows = np.sort(np.random.default_rng(seed).choice(vectors.count, size=FIT_ROWS, replace=False))
    train = vectors.rows(rows, vectors.dim)  # (n, D) unit rows, as stored
    rules = replace(rules, n=vectors.count) if rules is not None else Rules(n=vectors.count)
    # largest first: a smaller budget's RQ is then cut from a larger one's fit (triclip.codecs.rq.RQBooks)
    chosen = {b: choose(b, train, evaluation, force, seed, rules) for b in sorted(set(budgets), reverse=True)}
    if force is None or at_scale(rules.n):  # --codec C at a few thousand rows: C at each budget, as asked
        chosen = no_worse_than_smaller(chosen, rules.recall_target)
    return [chosen[b] for b in budgets]


def no_worse_than_smaller(chosen: dict[int, Choice], cap: float) -> dict[int, Choice]:
    """Each budget's choice, or a smaller budget's kept code where that ranks above it (choose's order: score up
    to ``cap``, fewer bytes, faster; within the budget's own latency bound): a code of fewer bytes is a code of
    this budget too, and the budgets' candidates differ (at 1M, RQ fast scan with a re-rank was measured at 8 B,
    not at 16 B; on the demo's 6,794 images the 16 B budget kept int8 m=16 alone, recall@10 .509, where the 4 B
    budget's rq8x4fs + a re-rank of 500 held .606 within the same bound). ``note`` says so; ``tried`` stays the
    budget's own."""
    out = dict(chosen)
    for b in sorted(out):
        for s in sorted(x for x in out if x < b):
            own, other = out[b], out[s]
            if (own.kept is not None and other.kept is not None and other.kept.latency.ms <= own.bound_ms
                    and _rank(other.kept, cap) > _rank(own.kept, cap)):
                out[b] = replace(own, codec=other.codec, recall=other.recall, kept=other.kept,
                                 note=f"the {s} B budget's code ranks above every {b} B candidate within the latency"
                                      " bound: kept here too")
    return out


def indexed_evaluation(image, text, text_rows: np.ndarray, meta: list[dict], max_images: int, data: str) -> EvalSet:
    """The evaluation set from the indexed collection itself: its first ``max_images`` images and their captions."""
    n = min(image.count, max_images)
    keep = np.flatnonzero(text_rows[:, 0] < n)  # caption vectors of those images
    texts = [meta[int(r)]["captions"][int(c)] for r, c in text_rows[keep]]
    return EvalSet.of(image.rows(np.arange(n), image.dim), text.rows(keep, text.dim), text_rows[keep, 0], texts,
                      "indexed", data)


def parse_budgets(values) -> list[int]:
    """``--bytes`` values as sorted unique positive ints."""
    budgets = sorted(set(int(b) for b in ([values] if isinstance(values, int) else values)))
    if not budgets or budgets[0] < 1:
        raise UserError(f"--bytes must be positive integers (bytes per vector), got {values}")
    return budgets
