"""What a build records and prints of its budgets: the manifest entry, the frontier of ``curves.json``, the table.

Pure functions over :class:`~triclip.index.budgets.Choice` and the manifest's dicts; the app reads a budget's
entry through :func:`held_at_n` and prints sizes with :func:`human_bytes`.
"""

from __future__ import annotations

import numpy as np

from triclip import codecs
from triclip.index.scale import at_n_latency, served_at_n, shortlist_held
from triclip.index.budgets import K, Choice, EvalSet, recall_at_k

def manifest_entry(choice: Choice, stored: codecs.Codec, evaluation: EvalSet, file: str, sized: dict | None = None,
                   at_n: dict | None = None, vector_bytes: int = 4) -> dict:
    """The manifest's ``budgets[str(B)]``: the stored code, its measured recall, its size, its latency and stages.

    ``index_bytes``: the codes (bytes per vector x n; FAISS's files add a header); ``ram_bytes``: what the
    stored code holds in memory (inverted lists add 8-byte ids, fast scan pads to blocks of 32);
    ``rescore``: None (the codes alone) or the second stage, ``{"with": "float", "shortlist": L,
    "disk_bytes_per_query": b D L, "reads": "memory" | "disk"}`` (the shortlist's float vectors, ``vector_bytes``
    = b per dimension, memory-mapped: "disk" when they exceed the memory budget, their cold reads charged to the
    latency); ``lists``: the file of inverted lists kept on disk, when they are; ``sized``: the lists refitted for
    N (:func:`~triclip.index.scale.sized_for_n`); ``at_n``: nprobe tuned at N (:func:`~triclip.index.scale.tune_at_n`),
    whose latency at N replaces the sample's in ``latency``."""
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
                lines.append("        - " + _candidate(c) + _not_kept(c, e))
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
    found at the kept nprobe (after the re-rank, where there is one: by float32 rows it keeps every exact top-10 row
    its shortlist holds; by float16 or sq8 rows, what it was measured to keep, ``reranked``). None for an entry
    without (its ``recall`` is then the whole story)."""
    at_n = entry.get("at_n")
    if not at_n:
        return None
    return {"n": at_n["n"], "queries": at_n["queries"], "of_exact_top10": served_at_n(at_n)}


def _at_n_line(at_n: dict, sized: dict | None) -> str:
    """How the kept inverted lists were sized and their nprobe tuned at N, under its row in :func:`table`."""
    held = shortlist_held(at_n)
    lists = "" if not sized else (f"{sized['nlist']} lists trained on {sized['coarse_rows']:,} rows"
                                  + (f" by {sized['large']}" if sized.get("large") else "")
                                  + f" (chosen as {sized['fitted_on_sample']}); ")
    return (f"at N = {at_n['n']:,}: {lists}nprobe {at_n['nprobe']} tuned at N, its top"
            f" {at_n['shortlist'] or K} holding {held:.3f} of the exact top 10 (target {at_n['target']:.3f};"
            f" all lists {at_n['whole_lists']:.3f}){'; ' + at_n['note'] if at_n['note'] else ''}"
            + ("" if at_n.get("cold_ms") is None else f"; end to end, cold: {at_n['cold_ms']:.3g} ms")
            + ("" if at_n.get("reranked") is None else f"; re-ranked by the stored rows: {at_n['reranked']:.3f}")
            + "; curve "
            + ", ".join(f"{c['nprobe']}: {c['of_exact_top10']:.3f} {c['ms']:.3g} ms" for c in at_n["curve"]))


def _finalists_line(finalists: dict) -> str:
    """The finalists measured as stored at N (``triclip.index.finalists``), under its budget's row in :func:`table`."""
    each = [f"{f['label']}{'' if not f['shortlist'] else ' + float top ' + str(f['shortlist'])}:"
            f" {f['of_exact_top10']:.3f} of the exact top 10, {f['ms']:.3g} ms"
            + ("" if f.get("fill_s") is None else f", filled in {f['fill_s']:,.0f} s")
            + ("" if f.get("measured_for") is None else f", measured for the {f['measured_for']} B budget") for f in
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


def _not_kept(c: dict, kept: dict) -> str:
    """Why a measured candidate measuring at least the kept code's recall was not kept (``kept``: the budget's side
    as the summary has it): over the latency bound, or level with it once counted up to full D's recall."""
    bound, full = kept.get("latency_bound_ms"), kept.get("full_recall")
    if c.get("recall") is None or kept.get("recall") is None or c["recall"] < kept["recall"]:
        return ""
    shortlist = (kept.get("rescore") or {}).get("shortlist")
    if c["label"] == codecs.CodecSpec.from_json(kept["code"]).label() and c.get("shortlist") == shortlist:
        return ""  # the kept one
    if bound is not None and c["latency_ms"] > bound:
        return f"; over the {bound:.3g} ms latency bound"
    if kept.get("ranked_by", "recall") != "recall":
        return ""
    if c["recall"] <= kept["recall"] + 1e-9:
        return "; level with the kept code, which has fewer bytes or is faster"
    if full is not None and kept["recall"] >= full - 1e-9:
        return (f"; counted as full D's {full:.4f} (more is the validation set's noise), level with the kept code,"
                " which has fewer bytes or is faster")
    return ""


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
