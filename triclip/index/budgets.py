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
refitted for N (:func:`sized_for_n`: nlist = ``lists_for`` N), filled, and its nprobe tuned at N against the exact
float top 10 among all N rows (:func:`tune_at_n`); the manifest records both (``sized_for_n``, ``at_n``). Every
candidate's recall goes to ``curves.json`` (``bytes``; ``text_bytes`` for the captions),
beside float pruning (the index ordering's curve at 4m bytes): the frontier the app draws.
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
from triclip.index.vectors import exact_topk, exact_topk_of

FIT_ROWS = 20_000  # collection vectors a code is fitted on (a seeded sample beyond)
EVAL_MAX_IMAGES = 5000  # without --val-data: the indexed data's first this many images
K = 10  # recall@K
TUNE_QUERIES = 200  # evaluation queries that tune nprobe and the shortlist, and time the codes
SHORTLISTS = (20, 50, 100, 200, 500, 1000, 2000, 5000)  # float re-rank shortlists tried on the sample
PROBE_SHARE = 0.25  # inverted lists scan at most this share of their lists (tune_nprobe); a re-rank's shortlist
# is likewise at most a quarter of the sample (tune_shortlist)
EXACT_ROWS = 65_536  # rows read at once for the exact float top 10 at N (tune_at_n): 64 MB at D = 256
FINALIST_MARGIN = 0.05  # at scale, another code within this share of the exact top 10 of the kept one on the
# sample is its rival, measured against it at N before one is stored (triclip.index.finalists)
COLD_HEADROOM = 0.1  # at N, a re-rank from disk is kept where its slower timing (end to end cold, or the parts
# summed) stays this share under the bound: cold reads vary, and at 1M, 4 B, 8 ms the benchmark's cold timing of the
# kept variant was up to 8.6% over the slower of the choice's two (8.62 against 7.94 ms, seed 1; docs/results_scale.md)
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
        return cls(np.ascontiguousarray(image, dtype=np.float32), queries, [positives[c] for c in first], split, data)

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
                       self.data, metric)


def recall_at_k(ids: np.ndarray, positives: list[set[int]], k: int = K) -> float:
    """Share of queries with a positive among their first k ids. ids: (Q, >= k), -1 for none."""
    hits = [bool(positives[q] & set(row[:k].tolist())) for q, row in enumerate(np.asarray(ids))]
    return float(np.mean(hits)) if hits else 0.0


def measure(codec: codecs.Codec, evaluation: EvalSet, shortlist: int | None = None) -> float:
    """Recall@10 of ``codec``'s trained code on the evaluation set (a copy holding its gallery), scanning every
    vector (inverted lists: all of them). ``shortlist``: its top ``shortlist`` re-ranked by the float vectors."""
    gallery = codec.empty_copy()
    gallery.add(evaluation.gallery)
    if shortlist is None:
        return recall_at_k(exhaustive_ids(gallery, evaluation.queries, K), evaluation.positives)
    return recall_at_k(_two_stage(gallery, evaluation.gallery, evaluation.queries, shortlist), evaluation.positives)


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
    vector_bytes: int = 4  # bytes per dimension of the stored float vectors a re-rank reads (2: kept as float16)

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
    codes are fitted last and left out unfitted when they cannot win: their probe's scan alone is slower than
    the bound, or a kept code already has full-D recall with no more bytes and a faster query. Each one left out
    is a "skipped" entry of ``tried`` with its reason (the build's table prints it).
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
    order = sorted(range(len(specs)), key=lambda i: (codecs.lookup(specs[i].codec).fit_cost, i))
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


def _left_out(spec, best: Variant | None, bound: float, ceiling: float, rules: Rules, tune) -> str:
    """Why a slow-to-fit candidate is not fitted ("" to fit it): it cannot win."""
    if codecs.lookup(spec.codec).fit_cost == 0:
        return ""
    full = best is not None and best.score >= ceiling and spec.bytes_per_vector >= best.codec.spec.bytes_per_vector
    probe = rules.model.probe(spec, tune.gallery.shape[1], rules.n, tune.queries)
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
    times the share kept at the tuned nprobe (``keeps``), with the shortlist the same share of its gallery as at N.
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
    for shortlist, keeps2, held in staged:
        at_n = shortlist if rules.n <= n_s else min(SHORTLIST_MAX, math.ceil(shortlist * rules.n / n_s))
        if out and out[-1].shortlist == at_n:  # a longer sample list past SHORTLIST_MAX: no longer read at N
            break
        recall = measure(codec, evaluation, max(K, min(n_eval, math.ceil(at_n * n_eval / max(rules.n, 1)))))
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
    what it holds of the exact top 10 is the shortlist's overlap with it: no re-rank is run here."""
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
                                 note=f"the {s} B budget's code ranks above every {b} B candidate: kept here too")
    return out


def fill(codec: codecs.Codec, vectors) -> codecs.Codec:
    """A copy of the trained ``codec`` holding every row of ``vectors`` (shards), in order."""
    full = codec.empty_copy()
    rows = progress(desc=f"encoding {codec.spec.label()}", total=vectors.count, unit="row", disable=None)
    for part in vectors.parts:
        if len(part):
            full.add(np.asarray(part, np.float32))
        rows.update(len(part))
    rows.close()
    return full


# ---------------------------------------------------------------------------- the kept code at the collection's N


def resized_for_n(codec: codecs.Codec, vectors) -> bool:
    """Whether :func:`sized_for_n` refits ``codec`` for the collection ``vectors``: inverted lists at N >=
    ``IVF_MIN_N``."""
    return hasattr(codec, "sized_for") and at_scale(vectors.count)


def sized_for_n(codec: codecs.Codec, vectors, seed: int = 0) -> tuple[codecs.Codec, dict | None]:
    """The kept ``codec`` as it is stored for the collection ``vectors`` (N rows): inverted lists at N >=
    ``IVF_MIN_N`` refitted for N (``IVFCodec.sized_for``: nlist = ``lists_for`` N, not the sample's capped one);
    any other code as it was fitted. Returns it and what was done (None: nothing)."""
    if not resized_for_n(codec, vectors):
        return codec, None
    started = time.perf_counter()
    sized, done = codec.sized_for(vectors, seed)
    return sized, {**done, "fitted_on_sample": codec.spec.label(), "seconds": round(time.perf_counter() - started, 1)}


def tune_at_n(stored: codecs.Codec, vectors, evaluation: EvalSet, choice: Choice, rules: Rules,
              whole: float | None = None) -> dict | None:
    """nprobe of the filled inverted lists ``stored`` (every row of ``vectors``), tuned at N on the evaluation
    queries against their exact float top 10 among all N rows (streamed: :data:`EXACT_ROWS` rows at a time).

    Codes alone: the smallest power of two nprobe whose top 10 holds ``rules.recall_target`` of what the lists
    scanned whole hold of the exact top 10 (a code alone cannot hold more than that); with a re-rank (the kept
    variant's shortlist): whose shortlist holds ``rules.recall_target`` of the exact top 10 itself. Each within the
    choice's latency bound (one query, one thread, at N; the re-rank's time added); where no nprobe reaches it,
    the smallest of those within the bound holding the most (``note`` says so): a shortlist that holds all it can
    at 32 lists holds no more at 256, and only costs the time of scanning them. Where the re-rank reads its rows
    from disk, the nprobe so kept is timed end to end cold and stepped down until that, and its parts summed, stay
    :data:`COLD_HEADROOM` under the bound (:func:`_cold_within`). Sets it on ``stored``; returns the manifest's
    ``at_n`` entry (nprobe, its curve, "tuned at N"); None for a code without lists. ``whole``: what every list
    holds, when known (the same lists tuned again for another shortlist: ``triclip.index.finalists``), else searched
    here."""
    if stored.exhaustive() is None:
        return None
    queries = np.ascontiguousarray(evaluation.queries, np.float32)  # (Q, D)
    truth = exact_at_n(vectors, evaluation)  # (Q, K)
    nlist, length = stored.exhaustive()["nprobe"], (choice.kept.shortlist if choice.kept is not None else None) or K
    timed = queries[:TUNE_QUERIES]
    extra = 0.0 if length == K else rules.rerank_ms(evaluation.gallery, timed, length)
    bound = choice.bound_ms or math.inf
    if whole is None:
        whole = overlap(exhaustive_ids(stored, queries, K), truth)
    goal = rules.recall_target * (whole if length == K else 1.0)
    curve, nprobe, reached = [], 0, False
    for p in _powers(nlist):
        held = overlap(stored.search(queries, length, params={"nprobe": p})[1], truth)
        ms = rules.model.search(stored, timed, length, len(stored), params={"nprobe": p}).ms + extra
        curve.append({"nprobe": p, "of_exact_top10": round(held, 4), "ms": round(ms, 4)})
        if ms > bound:
            break
        nprobe, reached = p, held >= goal
        if reached:
            break
    within = [c for c in curve if c["ms"] <= bound]
    if not reached and within:  # the fastest of those holding the most: past a plateau, more lists cost time only
        most = max(c["of_exact_top10"] for c in within)
        nprobe = min(c["nprobe"] for c in within if c["of_exact_top10"] == most)
    nprobe = nprobe or 1
    stored.set_nprobe(nprobe)
    note = "" if reached else (f"no nprobe within {bound:g} ms holds {goal:.3f} of the exact top 10 at N = "
                               f"{len(stored):,}: the fewest lists holding the most within it kept")
    cold = None
    if length != K and rules.reads_from:  # the re-rank reads from disk: timed end to end cold, stepped down
        kept, (nprobe, cold) = nprobe, _cold_within(stored, rules, timed, length, curve, nprobe, bound)
        if nprobe < kept:
            reached = next(c["of_exact_top10"] for c in curve if c["nprobe"] == nprobe) >= goal
            note = "; ".join(n for n in (note, f"nprobe {kept} stepped down to {nprobe}: end to end, cold, within "
                                               f"{1 - COLD_HEADROOM:.0%} of the bound") if n)
        slowest = max(cold, _curve_ms(curve, nprobe))
        if slowest > cold_limit(bound):
            over = "the bound" if slowest > bound else f"{1 - COLD_HEADROOM:.0%} of the bound"
            why = "" if nprobe < kept else ": scanning fewer lists would not save that"
            note = "; ".join(n for n in (note, f"end to end, cold: {cold:.3g} ms, over {over}{why}") if n)
    return {"how": "tuned at N", "n": len(stored), "queries": len(queries), "nlist": int(nlist), "nprobe": nprobe,
            "shortlist": None if length == K else length, "target": round(goal, 4),
            "whole_lists": round(whole, 4), "curve": curve, "reached": reached, "note": note,
            **({} if cold is None else {"cold_ms": round(cold, 4)})}


def _cold_within(stored: codecs.Codec, rules: Rules, queries: np.ndarray, shortlist: int, curve: list[dict],
                 nprobe: int, bound: float) -> tuple[int, float]:
    """``nprobe`` of the filled lists ``stored``, stepped down ``curve``'s powers of two until its slower timing, end
    to end cold (:func:`cold_ms`) or its parts summed (the curve's), is :data:`COLD_HEADROOM` under ``bound``. A step
    goes to the most lists whose scan, by the curve, saves what the last cold timing is over; where no step would
    save that (the re-rank's reads are the cost: at 10M, 8 B the parts summed 8.31 ms at 1 list and 8.55 at 16), it
    stays: fewer lists would lose answers for a cold timing's noise (one such build kept 4 lists, holding .720 of the
    exact top 10 where 16 held .808). Sets it on ``stored``; returns it and its cold milliseconds."""
    edge, summed = cold_limit(bound), {c["nprobe"]: c["ms"] for c in curve}
    stored.set_nprobe(nprobe)
    cold = cold_ms(stored, rules, queries, shortlist)
    while max(cold, summed.get(nprobe, 0.0)) > edge:
        saves = [p for p in sorted(summed, reverse=True) if p < nprobe
                 and max(cold - summed.get(nprobe, 0.0) + summed[p], summed[p]) <= edge]
        if not saves:
            break
        nprobe = saves[0]
        stored.set_nprobe(nprobe)
        cold = cold_ms(stored, rules, queries, shortlist)
    return nprobe, cold


def cold_limit(bound: float) -> float:
    """The most a search timed end to end cold may take under a latency ``bound``: :data:`COLD_HEADROOM` less."""
    return bound * (1 - COLD_HEADROOM)


def _curve_ms(curve: list[dict], nprobe: int) -> float:
    """The parts summed of ``nprobe`` on a ``tune_at_n`` curve (0: not on it)."""
    return next((c["ms"] for c in curve if c["nprobe"] == nprobe), 0.0)


def cold_ms(stored: codecs.Codec, rules: Rules, queries: np.ndarray, shortlist: int | None) -> float | None:
    """One query of the filled code ``stored`` at N (its nprobe set) with a re-rank of ``shortlist`` rows read
    from disk (``rules.reads_from``), timed end to end, cold (``LatencyModel.cold_search``): what it costs as
    stored, where the sum of its parts timed apart (the code's search, the re-rank, the rows' cold reads) says
    less. None without a re-rank from disk: the sum is then what it costs."""
    if not shortlist or not rules.reads_from:
        return None
    return rules.model.cold_search(stored, rules.reads_from, queries, shortlist)


_EXACT_AT_N: list = []  # the last two (vectors, evaluation, exact top 10) of exact_at_n: a side's budgets share one
# scan, and the finalists measured first on the first rows (triclip.index.finalists) does not push N's out


def exact_at_n(vectors, evaluation: EvalSet) -> np.ndarray:
    """(Q, K) the exact float top 10 of the evaluation queries among every row of ``vectors``, streamed
    (:data:`EXACT_ROWS` rows at a time); the last two are kept, so the budgets of one side read the rows once."""
    for seen, asked, truth in _EXACT_AT_N:
        if seen is vectors and asked is evaluation:
            return truth
    truth = exact_topk(vectors.chunked(EXACT_ROWS), np.ascontiguousarray(evaluation.queries, np.float32), K)
    _EXACT_AT_N[:] = [(vectors, evaluation, truth), *_EXACT_AT_N[:1]]  # and the one before: N's, over the first rows'
    return truth


def _powers(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit``, and ``limit`` itself."""
    out = [1]
    while out[-1] * 2 < limit:
        out.append(out[-1] * 2)
    return out + ([limit] if limit > 1 else [])


def indexed_evaluation(image, text, text_rows: np.ndarray, meta: list[dict], max_images: int, data: str) -> EvalSet:
    """The evaluation set from the indexed collection itself: its first ``max_images`` images and their captions."""
    n = min(image.count, max_images)
    keep = np.flatnonzero(text_rows[:, 0] < n)  # caption vectors of those images
    texts = [meta[int(r)]["captions"][int(c)] for r, c in text_rows[keep]]
    return EvalSet.of(image.rows(np.arange(n), image.dim), text.rows(keep, text.dim), text_rows[keep, 0], texts,
                      "indexed", data)


def manifest_entry(choice: Choice, stored: codecs.Codec, evaluation: EvalSet, file: str, sized: dict | None = None,
                   at_n: dict | None = None, vector_bytes: int = 4) -> dict:
    """The manifest's ``budgets[str(B)]``: the stored code, its measured recall, its size, its latency and stages.

    ``index_bytes``: the codes (bytes per vector x n; FAISS's files add a header); ``ram_bytes``: what the
    stored code holds in memory (inverted lists add 8-byte ids, fast scan pads to blocks of 32);
    ``rescore``: None (the codes alone) or the second stage, ``{"with": "float", "shortlist": L,
    "disk_bytes_per_query": b D L, "reads": "memory" | "disk"}`` (the shortlist's float vectors, ``vector_bytes``
    = b per dimension, memory-mapped: "disk" when they exceed the memory budget, their cold reads charged to the
    latency); ``lists``: the file of inverted lists kept on disk, when they are; ``sized``: the lists refitted for
    N (:func:`sized_for_n`);
    ``at_n``: nprobe tuned at N (:func:`tune_at_n`), whose latency at N replaces the sample's in ``latency``."""
    size = stored.spec.bytes_per_vector * len(stored)
    kept = choice.kept
    rescore = None if kept is None or kept.shortlist is None else {
        "with": "float", "shortlist": kept.shortlist, "shortlist_how": kept.shortlist_how,
        "disk_bytes_per_query": vector_bytes * stored.dim * kept.shortlist, "reads": kept.reads}
    return {"spec": stored.spec.to_json(), "file": file, "recall": choice.recall, "split": evaluation.split,
            "index_bytes": int(size), "bytes_per_vector": stored.spec.bytes_per_vector,
            "ram_bytes": int(stored.ram_bytes()), "rescore": rescore,
            "code_recall": None if kept is None else kept.code_recall, "keeps": None if kept is None else kept.keeps,
            "latency": None if kept is None else kept.latency.to_json(),
            "latency_bound_ms": round(choice.bound_ms, 4),
            "float_latency": None if choice.reference is None else choice.reference.to_json(), "note": choice.note,
            "full_recall": choice.full_recall, "ranked_by": choice.ranked_by,
            "fidelity": None if kept is None or kept.fidelity is None else round(kept.fidelity, 4),
            **({} if sized is None else {"sized_for_n": sized}),
            **({} if not choice.finalists else {"finalists_at_n": choice.finalists}),
            **({} if at_n is None else {"at_n": at_n, "latency_on_sample": None if kept is None else
                                        kept.latency.to_json(), "latency": at_n_latency(at_n)}),
            **({"lists": f"{file}.ivfdata"} if getattr(stored, "on_disk", lambda: False)() else {})}


def at_n_latency(at_n: dict) -> dict:
    """The latency (``Latency.to_json``) of the nprobe kept at N: from its curve (the parts summed), or where its
    re-rank reads from disk the slower of that and its time end to end cold (``cold_ms``): two timings of one
    search, and cold reads vary."""
    summed = _curve_ms(at_n["curve"], at_n["nprobe"])
    if at_n.get("cold_ms") is not None:
        return {"ms": max(at_n["cold_ms"], summed), "how": "measured cold"}
    return {"ms": summed, "how": "measured"}


def parse_budgets(values) -> list[int]:
    """``--bytes`` values as sorted unique positive ints."""
    budgets = sorted(set(int(b) for b in ([values] if isinstance(values, int) else values)))
    if not budgets or budgets[0] < 1:
        raise UserError(f"--bytes must be positive integers (bytes per vector), got {values}")
    return budgets


def frontier(choices: list[Choice], float_curve: dict[str, float] | None, evaluation: EvalSet) -> dict:
    """The ``bytes`` entry of ``curves.json`` (``text_bytes`` for the caption codes): recall against bytes
    per vector for the kept codes, every candidate (the peers: int8, binary, PQ, OPQ, RQ, float top-m) and
    float pruning (4m bytes per m; the t2i curve, so the image codes only)."""
    return {
        "metric": evaluation.metric,
        "split": evaluation.split,
        "data": evaluation.data,
        "gallery": int(len(evaluation.gallery)),
        "queries": int(len(evaluation.queries)),
        "chosen": {str(c.budget): {**_entry(c.codec.spec), "recall": c.recall,
                                   **({} if c.kept is None else {"latency_ms": round(c.kept.latency.ms, 4),
                                                                 "shortlist": c.kept.shortlist})}
                   for c in choices},
        "candidates": {str(c.budget): c.tried for c in choices},
        "float_pruning": {str(4 * int(m)): r for m, r in (float_curve or {}).items() if r is not None},
        "full_d": exact_recall(evaluation),  # the same metric by exact float search at full D: what the codes lose
    }


def exact_recall(evaluation: EvalSet) -> float:
    """Recall@10 of exact inner-product search at full D on the evaluation set (the codes' reference)."""
    scores = evaluation.queries @ evaluation.gallery.T  # (Q, n)
    k = min(K, scores.shape[1])
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # (Q, k)
    return recall_at_k(top, evaluation.positives)


def _entry(spec: codecs.CodecSpec) -> dict:
    return {"label": spec.label(), "codec": spec.codec, "m": spec.m, "bytes": spec.bytes_per_vector}


def table(budgets: dict) -> str:
    """The lines ``index build`` prints (summary["budgets"]; the caption codes under ``"text"``): per budget and
    side the kept code, the bytes it stores, its stages, recall, single-query latency at N (measured, or
    extrapolated from a sample), what it holds in memory and reads from disk per query, and its index size; under
    it every candidate tried (``candidates``), with its latency or why it was left out."""
    lines = [f"{'bytes':>6}  {'codes':<6} {'code':<26} {'m':>5} {'stored':>7}  {'stages':<24} {'recall@10':>9}"
             f"  {'latency':>20}  {'RAM':>9}  {'disk/query':>10}  {'index size':>11}"]
    for b, entry in sorted(budgets.items(), key=lambda kv: int(kv[0])):
        for side, e in (("image", entry), ("text", entry.get("text"))):
            if e is None:
                continue
            spec = codecs.CodecSpec.from_json(e["code"])
            rescore = e.get("rescore")
            stages = "codes" if not rescore else f"codes + float top {rescore['shortlist']}{_cold(rescore)}"
            disk = human_bytes(rescore["disk_bytes_per_query"]) if rescore else "0 B"
            lines.append(f"{b:>6}  {side:<6} {spec.label():<26} {spec.m:>5} {str(spec.bytes_per_vector) + ' B':>7}"
                         f"  {stages:<24} {_recall(e.get('recall')):>9}"
                         f"  {_latency(e.get('latency')):>20}  {human_bytes(e.get('ram_bytes', e['index_bytes'])):>9}"
                         f"  {disk:>10}  {human_bytes(e['index_bytes']):>11}")
            if e.get("at_n"):
                lines.append("        " + _at_n_line(e["at_n"], e.get("sized_for_n")))
            if e.get("finalists_at_n"):
                lines.append("        " + _finalists_line(e["finalists_at_n"]))
            for c in e.get("candidates") or []:
                lines.append("        - " + _candidate(c))
    if any(entry.get("text") for entry in budgets.values()):
        lines.append("recall@10: text->image for the image codes, image->text for the caption (text) codes")
    lines.append("stored: the bytes each vector's code holds (a code smaller than its budget can measure best)")
    if any(e.get("ranked_by") == "fidelity" for entry in budgets.values() for e in (entry, entry.get("text") or {})):
        lines.append("ranked at N >= 100,000 by the share of exact float search's top 10 each holds among the tuning"
                     " sample (counted up to the recall target), then fewer bytes, then faster; recall@10 is"
                     " measured on the evaluation set")
    lines.append("latency: one query, one thread, at the collection's size: measured there, or extrapolated from a"
                 " timed sample (time per code scanned x codes scanned)")
    if any((e.get("rescore") or {}).get("reads") == "disk" for entry in budgets.values()
           for e in (entry, entry.get("text") or {})):
        lines.append("(cold): the float vectors exceed --memory-budget; the re-rank's rows are read from disk, their"
                     " cold reads timed on this index's vectors file and counted in its latency")
    return "\n".join(lines)


def held_at_n(entry: dict) -> dict | None:
    """What a budget's answers hold at the collection's N, where its inverted lists were tuned there (the manifest
    entry's ``at_n``): ``{"n", "queries", "of_exact_top10"}``, the share of the exact float top 10 over all N rows
    found at the kept nprobe (after the re-rank, where there is one: a re-rank keeps every exact top-10 row its
    shortlist holds). None for an entry without (its ``recall`` is then the whole story)."""
    at_n = entry.get("at_n")
    if not at_n:
        return None
    held = next(c["of_exact_top10"] for c in at_n["curve"] if c["nprobe"] == at_n["nprobe"])
    return {"n": at_n["n"], "queries": at_n["queries"], "of_exact_top10": held}


def _at_n_line(at_n: dict, sized: dict | None) -> str:
    """How the kept inverted lists were sized and their nprobe tuned at N, under its row in :func:`table`."""
    held = held_at_n({"at_n": at_n})["of_exact_top10"]
    lists = "" if not sized else (f"{sized['nlist']} lists trained on {sized['coarse_rows']:,} rows"
                                  + (f" by {sized['large']}" if sized.get("large") else "")
                                  + f" (chosen as {sized['fitted_on_sample']}); ")
    return (f"at N = {at_n['n']:,}: {lists}nprobe {at_n['nprobe']} tuned at N, its top"
            f" {at_n['shortlist'] or K} holding {held:.3f} of the exact top 10 (target {at_n['target']:.3f};"
            f" all lists {at_n['whole_lists']:.3f}){'; ' + at_n['note'] if at_n['note'] else ''}"
            + ("" if at_n.get("cold_ms") is None else f"; end to end, cold: {at_n['cold_ms']:.3g} ms") + "; curve "
            + ", ".join(f"{c['nprobe']}: {c['of_exact_top10']:.3f} {c['ms']:.3g} ms" for c in at_n["curve"]))


def _finalists_line(finalists: dict) -> str:
    """The finalists measured as stored at N (``triclip.index.finalists``), under its budget's row in :func:`table`."""
    each = [f"{f['label']}{'' if not f['shortlist'] else ' + float top ' + str(f['shortlist'])}:"
            f" {f['of_exact_top10']:.3f} of the exact top 10, {f['ms']:.3g} ms"
            + ("" if f.get("fill_s") is None else f", filled in {f['fill_s']:,.0f} s") for f in
            [finalists["kept"], *finalists["others"]]]
    unfilled = "".join(f"; {f['label']} not filled: {f['not_filled']}" for f in finalists.get("not_filled", []))
    return f"finalists measured as stored at N = {finalists['n']:,}: " + "; ".join(each) + " (the first kept)" \
        + unfilled


def _recall(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def _latency(entry: dict | None) -> str:
    return "-" if not entry else f"{entry['ms']:.3g} ms ({entry['how']})"


def _candidate(c: dict) -> str:
    """One tried candidate's line under its budget in :func:`table`."""
    if c.get("recall") is None:
        return f"{c['label']}: {c.get('skipped') or 'not fitted: ' + str(c.get('error'))}"
    stages = "" if not c.get("shortlist") else f" + float top {c['shortlist']}{_cold(c)}"
    held = "" if c.get("fidelity") is None else f", {c['fidelity']:.3f} of the exact top 10 (sample)"
    return (f"{c['label']}{stages}: recall@10 {c['recall']:.4f}{held}, "
            f"{_latency({'ms': c['latency_ms'], 'how': c['latency']})}")


def _cold(stage: dict) -> str:
    """" (cold)" for a re-rank whose rows are read from disk, their cold reads in its latency."""
    return " (cold)" if stage.get("reads") == "disk" else ""


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KB`` (powers of 1024)."""
    unit = "B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
