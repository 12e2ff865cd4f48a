"""``index build``'s table (``triclip.index.report.table``): why a candidate measuring as well as the kept code lost."""

from __future__ import annotations

from triclip.index import report


def _candidate(label: str, recall: float, ms: float, shortlist: int | None = None) -> dict:
    return {"label": label, "recall": recall, "latency_ms": ms, "latency": "measured", "shortlist": shortlist,
            "fidelity": None}


def _budget(ranked_by: str = "recall") -> dict:
    """An 8 B budget keeping int8 m=8 (recall .7188 = full D's) within a 0.017 ms bound, and its candidates."""
    return {"8": {"recall": 0.7188, "index_bytes": 80, "bytes_per_vector": 8, "latency": {"ms": 0.012, "how": "measured"},
                  "rescore": None, "note": "", "code": {"codec": "int8", "m": 8, "bytes_per_vector": 8, "params": {}},
                  "latency_bound_ms": 0.017, "full_recall": 0.7188, "ranked_by": ranked_by,
                  "candidates": [_candidate("int8 m=8", 0.7188, 0.012), _candidate("int8 m=4", 0.6875, 0.0137),
                                 _candidate("rq16x4fs m=256", 0.7917, 0.0258), _candidate("int8 m=16", 0.7656, 0.014),
                                 _candidate("int8 m=8", 0.7188, 0.0534, shortlist=100)]}}


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.strip().startswith(f"- {start}"))


def test_a_candidate_measuring_above_the_kept_code_says_why_it_lost():
    text = report.table(_budget())
    assert _line(text, "rq16x4fs m=256:").endswith("; over the 0.017 ms latency bound")
    assert "counted as full D's 0.7188 (more is the validation set's noise)" in _line(text, "int8 m=16:")
    assert _line(text, "int8 m=8 + float top 100:").endswith("over the 0.017 ms latency bound")
    assert ";" not in _line(text, "int8 m=8:") and ";" not in _line(text, "int8 m=4:")  # the kept one; a lower one


def test_at_scale_only_the_latency_bound_is_given_as_a_reason():
    text = report.table(_budget(ranked_by="fidelity"))  # ranked by the share of the exact top 10: recall says less
    assert _line(text, "rq16x4fs m=256:").endswith("; over the 0.017 ms latency bound")
    assert ";" not in _line(text, "int8 m=16:")


def test_a_summary_without_the_bound_prints_as_before():
    budgets = _budget()
    for key in ("latency_bound_ms", "full_recall", "ranked_by"):
        del budgets["8"][key]
    text = report.table(budgets)
    assert ";" not in _line(text, "rq16x4fs m=256:")
