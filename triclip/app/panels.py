"""The page's panels: each a function from the live view (:class:`triclip.app.live.IndexView`) to its components.

    with gr.Blocks() as blocks:
        header(view)
        q = query_panel(view); r = results_panel(); kn = knobs_panel(view, k=12); feature_selection_panel(view)

Each is called inside the Blocks (and the row or column) where its components go, and
returns them for the event wiring (``triclip.app.gradio_app.build_app``). The feature-selection
panel plots the importance spectrum (S sorted, its cumulative share, the suggested m),
the recall-against-m curves the index build stored (run's order, first-m, random, PCA)
and the frontier: recall against bytes per image for the run's codes (``index build
--bytes``), every code measured beside them (the peers: int8, binary, PQ, OPQ, RQ) and float
pruning. What depends on the index version (the header, the m / bytes choices, the panel)
comes from :func:`live_values`, redrawn when ``--add`` or ``--overwrite`` swaps the version.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np

from triclip.app.endpoints import empty_rows
from triclip.app.gradio_patches import loose, query_image, result_gallery
from triclip.app.live import IndexView

SUGGEST_SHARE = 0.9  # the suggested m keeps this share of the total importance
SYSTEM_FONTS = ["ui-sans-serif", "system-ui", "sans-serif"]  # no web fonts: nothing fetched from outside
MONO_FONTS = ["ui-monospace", "SFMono-Regular", "Menlo", "monospace"]
CSS = """
#results .grid-container, #full-results .grid-container { grid-auto-rows: auto !important; }
#results button.thumbnail-item, #full-results button.thumbnail-item { height: auto !important; aspect-ratio: auto !important;
  overflow: visible !important; display: flex; flex-direction: column; }
#results button.thumbnail-item img, #full-results button.thumbnail-item img { aspect-ratio: 1 / 1; height: auto !important;
  width: 100% !important; object-fit: contain !important; }
#results .caption-label, #full-results .caption-label { position: static !important; white-space: normal !important;
  overflow: visible !important; text-overflow: clip !important; max-width: 100% !important; width: 100% !important;
  font-size: 0.8em; line-height: 1.25; }
#frontier-text table { display: block; overflow-x: auto; }
#frontier-text th, #frontier-text td { word-break: normal !important; overflow-wrap: normal !important;
  hyphens: none !important; padding: 4px 6px !important; font-size: 0.9em; }
"""  # gallery thumbnails whole (not cropped), captions wrapped instead of cut at one line; the budgets' table
# wrapped at spaces only (Gradio's markdown broke "recall@10" and "rq8x4fs" mid-word), scrolled when too wide


def theme() -> gr.themes.Base:
    """Gradio's default look with system fonts (the default theme loads Google fonts)."""
    return gr.themes.Default(font=SYSTEM_FONTS, font_mono=MONO_FONTS)


# ---------------------------------------------------------------------------- the panels


@dataclass
class QueryPanel:
    """The query inputs: a text box, an uploaded image, and the captions image -> text finds."""

    query: gr.Textbox
    search: gr.Button
    image: gr.Image
    image_search: gr.Button
    image_to_text: gr.Button
    captions: gr.Dataframe
    caption_status: gr.Markdown  # what the caption table answers: the image, the codes or m, the time


@dataclass
class ResultsPanel:
    """The results at m, the same query at full D, and what the two share."""

    status: gr.Markdown
    gallery: gr.Gallery
    overlap: gr.Markdown
    full: gr.Gallery
    clicked: gr.Textbox  # the clicked result's id (hidden)


@dataclass
class FeaturePanel:
    """The feature-selection panel's components (redrawn for each version), named as :class:`PanelValues`."""

    spectrum: gr.Markdown
    spectrum_plot: gr.Plot
    recall: gr.Markdown
    recall_plot: gr.Plot
    frontier: gr.Markdown
    frontier_plot: gr.Plot

    def by_name(self) -> dict:
        """Component by field name, in the panel's order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class PanelValues:
    """What the feature-selection panel shows for a version: three texts, each with its plot (None: no plot)."""

    spectrum: str  # the importance spectrum in words
    spectrum_plot: Any
    recall: str  # recall against m in words
    recall_plot: Any
    frontier: str  # recall against bytes per image in words
    frontier_plot: Any

    def updates(self) -> dict:
        """Gradio updates by field name: a text as it is, a plot with its visibility (hidden without one)."""
        return {f.name: gr.update(value=getattr(self, f.name), visible=getattr(self, f.name) is not None)
                if f.name.endswith("_plot") else getattr(self, f.name) for f in fields(self)}


@dataclass
class Knobs:
    """m (the dimensions searched), the funnel, k."""

    m: gr.Radio
    funnel: gr.Checkbox
    k: gr.Slider
    explained: gr.Markdown | None = None  # what each choice costs and keeps (:func:`choices_panel`, its own row)


def header(view: IndexView) -> gr.Markdown:
    """The title line: how many images, D, the run."""
    return gr.Markdown(header_text(view), elem_id="header")


def header_text(view: IndexView) -> str:
    searcher = view.searcher
    run = Path(searcher.manifest.get("run", "") or "?")
    run_name = f"{run.parent.name}/{run.name}" if run.parent.name else run.name  # "demo/run", not "run run"
    where = getattr(searcher, "served_from", None)  # a Milvus collection (triclip.index.milvus_search)
    served = f" · served from {where}" if where else ""
    return (
        f"## triclip search · {len(searcher):,} images · D = {searcher.dim} · model from `{run_name}` · version {view.version}"
        f"{served}\n"
        "Search by text or by image; click a result for more like it. Pick m (a pruned index) or a byte budget"
        " (compact codes): each choice shows its bytes per image, the index size and its measured text→image recall@10."
    )


def query_panel(view: IndexView) -> QueryPanel:
    """Text -> image and image -> image / text tabs (captions only when the index holds them)."""
    has_text = bool(view.searcher.has_text)
    with gr.Tab("Text → image"):
        with gr.Row():
            query = gr.Textbox(label="query", placeholder="e.g. a red apple", scale=5, max_lines=2, elem_id="query")
            search = gr.Button("Search", variant="primary", scale=1, elem_id="search")
    with gr.Tab("Image → image / text"):
        with gr.Row():
            image = query_image(label="query image", sources=["upload", "clipboard"], height=180, elem_id="query-image")
            with gr.Column():
                image_search = gr.Button("Similar images", variant="primary", elem_id="image-search")
                image_to_text = gr.Button("Captions (image → text)", visible=has_text, elem_id="image-to-text")
        caption_status = gr.Markdown("", elem_id="caption-status", visible=has_text)
        captions = gr.Dataframe(
            value=empty_rows(), label="nearest captions (each distinct caption once, with how many images carry it)",
            visible=has_text, interactive=False, elem_id="captions",
        )
    return QueryPanel(query, search, image, image_search, image_to_text, captions, caption_status)


def results_panel() -> ResultsPanel:
    """The status line, the results at m, the overlap note, the results at full D."""
    status = gr.Markdown("Results appear below.", elem_id="status")
    gallery = result_gallery(
        label="results (click one: more like this; the status line names the m or codes)", columns=6, height="auto", allow_preview=False,
        object_fit="contain", elem_id="results",
    )
    overlap = gr.Markdown("", elem_id="overlap")
    full = result_gallery(
        label="the same query at full D", columns=6, height="auto", allow_preview=False,
        object_fit="contain", elem_id="full-results", visible=False,
    )
    clicked = gr.Textbox(visible=False, label="image id", elem_id="clicked-id")  # the clicked result's id
    return ResultsPanel(status, gallery, overlap, full, clicked)


def knobs_panel(view: IndexView, k: int) -> Knobs:
    """m among the index's pruned sizes (each with its measured recall), the funnel, and k."""
    m = loose(gr.Radio(m_choices(view), value=view.dim, label="search: m dimensions, or a byte budget's codes",
                       elem_id="m"))
    funnel = gr.Checkbox(False, label="funnel: shortlist at m (or by the codes), re-rank at full D", elem_id="funnel")
    k = loose(gr.Slider(1, 100, value=k, step=1, label="results k", elem_id="k"))
    return Knobs(m, funnel, k)


def choices_panel(view: IndexView) -> gr.Markdown:
    """The table of what each m / budget choice costs and keeps, and each code in plain words (a row of its own)."""
    return gr.Markdown(choices_text(view), elem_id="choices-explained")


CHOICE_COLUMNS = {  # the table under the choices, by name: (header, the cell of one row's facts)
    "choice": ("choice", lambda r: r["choice"]),
    "stored": ("stored per image", lambda r: f"{r['bytes']} B"),
    "size": ("index size", lambda r: r["size"]),
    "t2i": ("text→image R@10", lambda r: _figures(r.get("t2i"), r.get("t2i_all"))),
    "i2t": ("image→text R@10", lambda r: _figures(r.get("i2t"), r.get("i2t_all"))),
    "latency": ("ms / query", lambda r: _figure(r.get("latency_ms"), ".3g")),  # recorded by the build where measured
}


def choices_text(view: IndexView) -> str:
    """What each choice costs (bytes stored, index size, latency where recorded) and keeps (recall@10), and each
    code in plain words (``triclip.codecs.describe``), with the noise of the measured recall."""
    from triclip.app.endpoints import float_latency_ms, text_recall
    from triclip.index.report import held_at_n, human_bytes
    from triclip.codecs import CodecSpec, describe

    if getattr(view.searcher, "served_from", None):
        return ""
    n = len(view.searcher)
    full_ms = float_latency_ms(view.budgets)  # the float scan the codes were held to
    rows = [{"choice": f"m = {m}" + (" (full D)" if m == view.dim else ""), "m": m, "bytes": 4 * m,
             "size": human_bytes(4 * m * n), "t2i": view.recall.get(m), "i2t": text_recall(view, m),
             "latency_ms": full_ms if m == view.dim else None} for m in view.dims]
    words = []
    for budget, entry in sorted(view.budgets.items()):
        spec = CodecSpec.from_json(entry["spec"])
        rows.append({**entry, "choice": f"{budget} B budget", "budget": budget, "bytes": entry.get("bytes_per_vector", budget),
                     "latency_ms": (entry.get("latency") or {}).get("ms"),
                     "size": human_bytes(entry["index_bytes"]), "t2i": entry.get("recall"),
                     "i2t": (entry.get("text") or {}).get("recall")})
        at_n, twin = held_at_n(entry), same_code_as(view.budgets, budget)
        words.append(f"- **{budget} B budget**: {describe(spec)}." + ("" if twin is None else (
            f" The same code as the {twin} B budget: no code of up to {budget} B measured better within the"
            " latency bound, so the larger budget stores the smaller code.")) + ("" if at_n is None else (
            f" Among all {at_n['n']:,} images its answers hold {at_n['of_exact_top10']:.3f} of exact full-D search's"
            f" top 10 ({at_n['queries']} queries); the recall@10 beside it is measured on the"
            f" {entry.get('split') or 'validation'} images alone.")))
    whole = in_whole_index(view, rows)
    head = [header + (" (validation / all)" if whole and name in ("t2i", "i2t") else "")
            for name, (header, _) in CHOICE_COLUMNS.items()]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(r) for _, cell in CHOICE_COLUMNS.values()) + " |" for r in rows]
    lines += ["", whole] if whole else []
    m_words = (f"- **m** ({', '.join(str(m) for m in view.dims)}): the first m of the {view.dim} dimensions in the"
               " run's importance order, as 4-byte floats (exact search).")
    missing = ("– : not measured (image→text recall is measured for the byte budgets' caption codes, and at full D"
               " by index builds that record it; latency where the build records it: for each budget's codes, and at"
               " full D the exact float scan that the codes were held to, one query on one thread).")
    return "\n".join(lines + ["", m_words] + words + ["", noise_note(view) + " " + missing])


def noise_note(view: IndexView) -> str:
    """How far the measured recall figures are to be trusted: their standard error on the queries measured."""
    front = (view.curves or {}).get("bytes") or (view.curves or {})
    queries, recall = front.get("queries"), view.recall.get(view.dim)
    if not isinstance(queries, int) or not queries or recall is None:
        return "Recall figures are measured on a sample of queries: small differences between them are noise."
    se = (recall * (1 - recall) / queries) ** 0.5
    where = "validation" if front.get("split") == "validation" else "indexed"
    return (f"Recall figures are measured on {queries} {where} queries, ± about {se:.2f} each (one standard error):"
            " a code can measure above full D by chance.")


def same_code_as(budgets: dict, budget: int) -> int | None:
    """The smallest smaller budget whose image code is the one ``budget`` stores (``index build`` keeps a smaller
    budget's code where it ranks above every candidate of the larger one), None when its code is its own."""
    spec = budgets[budget]["spec"]
    return min((b for b, e in budgets.items() if b < budget and e["spec"] == spec), default=None)


def in_whole_index(view: IndexView, rows: list[dict]) -> str:
    """Put the build's recall among everything the index holds (manifest ``in_index``, ``triclip.index.in_index``)
    into ``rows`` (``t2i_all``, ``i2t_all``) and return the line that says what the two figures are; "" without it."""
    whole = view.searcher.manifest.get("in_index") or {}
    if not whole or whole.get("images") != len(view.searcher):  # none recorded, or the index has grown since
        return ""
    for row in rows:
        kind, key = ("bytes", row["budget"]) if "budget" in row else ("m", row["m"])
        for side in ("t2i", "i2t"):
            row[f"{side}_all"] = ((whole.get(side) or {}).get(kind) or {}).get(str(key))
    return (f"*validation*: the validation captions searched among the validation images alone, as the curves and the"
            f" choice of codes measure; *all*: the same captions ({whole['queries']}) searched among all"
            f" {whole['images']:,} images this index holds, every other one a distractor: what a search here finds"
            " (image→text: " + f"{(whole.get('i2t') or {}).get('queries', 0)} validation images asked for their captions).")


def _figures(value, whole) -> str:
    return _figure(value) if whole is None else f"{_figure(value)} / {_figure(whole)}"


def _figure(value, fmt: str = ".3f") -> str:
    return "–" if value is None else format(value, fmt)


def m_choices(view: IndexView) -> list[tuple[str, int | str]]:
    """Radio choices: (label with bytes per image, index size and measured recall, m) for each m the index
    holds (float32: 4m bytes), then (the same, ``"{B}B"``) for each byte budget's codes."""
    from triclip.app.endpoints import code_label, float_latency_ms
    from triclip.index.report import human_bytes

    n = len(view.searcher)
    out: list[tuple[str, int | str]] = []
    if getattr(view.searcher, "served_from", None):  # a Milvus collection: its one m and index
        plan = view.searcher.plans[0]
        label = f"{view.dim} · Milvus {plan['index_type']} · {plan['bytes_per_vector']} B/image"
        label += f" · {human_bytes(plan['bytes_per_vector'] * n)}"
        if view.recall.get(view.dim) is not None:
            label += f" · R@10 {view.recall[view.dim]:.3f}"
        return [(label, view.dim)]
    full_ms = float_latency_ms(view.budgets)  # timed by index build --bytes: the float scan the codes are held to
    for m in view.dims:
        label = f"m = {m} = D" if m == view.dim else f"m = {m}"  # m, the choice's own word: k counts results
        label += f" · {4 * m} B/image · {human_bytes(4 * m * n)}"
        if view.recall.get(m) is not None:
            label += f" · R@10 {view.recall[m]:.3f}"
        if m == view.dim and full_ms is not None:
            label += f" · {full_ms:.3g} ms"
        out.append((label, m))
    for budget, entry in sorted(view.budgets.items()):
        used = entry.get("bytes_per_vector", budget)  # a smaller code may measure best within the budget
        twin = same_code_as(view.budgets, budget)
        label = f"{budget} B budget: {code_label(entry)}, {used} B/image stored"
        label += "" if twin is None else f" (same code as {twin} B)"
        label += f" · {human_bytes(entry['index_bytes'])}"
        if entry.get("recall") is not None:
            label += f" · R@10 {entry['recall']:.3f}"
        if entry.get("latency"):
            label += f" · {entry['latency']['ms']:.3g} ms"
        out.append((label, f"{budget}B"))
    return out


def feature_selection_panel(view: IndexView) -> FeaturePanel:
    """The importance spectrum (words and plot), the recall-against-m chart and the bytes frontier."""
    values = panel_values(view)
    drawn = {}
    for name, text_id, plot_id in (("spectrum", "spectrum", "spectrum-plot"), ("recall", "recall-text", "recall-chart"),
                                   ("frontier", "frontier-text", "frontier-chart")):
        plot = getattr(values, f"{name}_plot")
        with gr.Column(scale=2 if name == "frontier" else 1):  # two charts side by side
            drawn[name] = gr.Markdown(getattr(values, name), elem_id=text_id)
            drawn[f"{name}_plot"] = gr.Plot(plot, show_label=False, elem_id=plot_id, visible=plot is not None)
    return FeaturePanel(**drawn)


def panel_values(view: IndexView) -> PanelValues:
    """The panel's contents for a version."""
    importance = list(view.searcher.manifest.get("importance") or [])
    words, suggested, power = spectrum_text(importance, view.curves)
    return PanelValues(
        spectrum=words, spectrum_plot=spectrum_figure(importance, suggested, power),
        recall=recall_text(view.curves, view.dims), recall_plot=recall_figure(view.curves, view.dims),
        frontier=frontier_text(view), frontier_plot=frontier_figure(view),
    )


def live_values(view: IndexView, m_value) -> dict:
    """Updates of everything drawn from the version, by name (``header``, ``m``, the panel's fields), for
    :func:`triclip.app.gradio_app.redraw`."""
    choices = m_choices(view)
    keep = m_value if m_value in [value for _, value in choices] else view.dim  # a choice gone: back to D
    return {"header": header_text(view), "m": gr.update(choices=choices, value=keep), "explained": choices_text(view),
            **panel_values(view).updates()}


# ---------------------------------------------------------------------------- the feature-selection panel's content


def spectrum_text(importance: list[float], curves: dict | None = None) -> tuple[str, int | None, float]:
    """The words beside the spectrum plot, the suggested m (None when there is nothing to suggest),
    and the power p of S whose cumulative share ``triclip.compact.features.suggest_m`` reads (the plot draws it)."""
    w = np.sort(np.asarray(importance, dtype=np.float64))[::-1]  # S, sorted (D,)
    if len(w) == 0:
        return "This index records no importance spectrum.", None, 1.0
    if w[0] - w[-1] <= 1e-6 * max(abs(w[0]), 1e-12):
        return (
            f"**No learned importance**: this run's importance is the same for all {len(w)} dimensions"
            f" (w = {w[0]:.3g}; objectives such as `mrl` and `infonce` learn none), so there is no spectrum to"
            " read and no m to suggest from it. Its order is the embedding's own; the recall chart shows what"
            " each ordering keeps at each m.",
            None,
            1.0,
        )
    suggested, power, why = _suggest(w)
    held = "importance" if power == 1 else f"importance raised to the power {power:g}"  # one total for the paragraph
    half = int(np.searchsorted(np.cumsum(w**power) / (w**power).sum(), 0.5) + 1)
    words = (
        f"**Importance S** of {len(w)} dimensions, sorted: {w[0]:.3g} down to {w[-1]:.3g}; the top {half} hold"
        f" half of the total {held}."
    )
    if suggested is None:
        return words + f" No suggested m: {why}.", None, power
    words += (
        f" **Suggested m = {suggested}** (advice: the m choices are the m's this index holds; the nearest one at or"
        f" above it keeps what it predicts): predicted to keep {SUGGEST_SHARE:.0%} of full-D recall, since the top"
        f" {suggested} dimensions hold {SUGGEST_SHARE:.0%} of the total {held}."
    )
    own = (curves or {}).get("curves", {}).get((curves or {}).get("ordering"), {})
    full = own.get(str(len(w)))
    measured = sorted(int(m) for m, v in own.items() if v is not None and int(m) >= suggested)
    if measured and full:
        at = own[str(measured[0])]
        where = "there" if measured[0] == suggested else f"at m = {measured[0]}, the nearest measured m above it"
        words += f" Measured {where}: recall@10 {at:.3f}, {at / full:.0%} of full D's {full:.3f}."
    return words, suggested, power


def _suggest(w: np.ndarray) -> tuple[int | None, float, str]:
    """``triclip.compact.features.suggest_m`` on the spectrum: (m, the power of S it reads, "") or (None, power, why not)."""
    import torch

    from triclip.compact import features as compact

    power = compact.SUGGEST_POWER
    suggest_m = compact.suggest_m  # looked up at call time (a test replaces it)
    try:
        m = suggest_m(torch.as_tensor(w.copy(), dtype=torch.float32), share=SUGGEST_SHARE)
    except Exception as err:  # noqa: BLE001 (the panel shows the rest)
        return None, power, f"suggest_m failed ({type(err).__name__}: {err})"
    return int(m), power, ""


def spectrum_figure(importance: list[float], suggested: int | None, power: float = 1.0):
    """S sorted (left axis) and the cumulative share of S^power (right axis) against rank (log 2); None when flat."""
    from matplotlib.figure import Figure

    w = np.sort(np.asarray(importance, dtype=np.float64))[::-1]
    if len(w) == 0 or w[0] - w[-1] <= 1e-6 * max(abs(w[0]), 1e-12):
        return None
    ranks = np.arange(1, len(w) + 1)
    fig = Figure(figsize=(4.6, 2.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.plot(ranks, w, color="tab:blue", label="S (sorted)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rank (dimensions kept, m)")
    ax.set_ylabel("importance S", color="tab:blue")
    share = ax.twinx()
    held = "S" if power == 1 else f"S$^{{{power:g}}}$"
    share.plot(ranks, np.cumsum(w**power) / (w**power).sum(), color="tab:orange", label=f"cumulative share of {held}")
    share.set_ylim(0, 1.02)
    share.set_ylabel(f"cumulative share of {held}", color="tab:orange")
    if suggested is not None:
        ax.axvline(suggested, color="tab:green", linestyle="--", label=f"suggested m = {suggested}")
        ax.legend(loc="lower left", fontsize=7)
    ax.set_title("importance spectrum", fontsize=9)
    return fig


ORDERING_LABELS = {"importance": "run's own order", "first": "first-m", "random": "random-m", "pca": "PCA-m"}


def recall_text(curves: dict | None, dims: list[int]) -> str:
    """The words under the recall chart."""
    if not curves:
        return (
            "This index records no recall-against-m curves (built before they were stored, or from embeddings):"
            " rebuild it with `triclip index build ... --val-data VAL` to see them."
        )
    where = "the validation data" if curves.get("split") == "validation" else "the indexed data"
    return (
        f"Text→image recall@10 against m on {where} ({curves.get('queries', '?')} distinct captions,"
        f" {curves.get('images', '?')} images); the index holds m = {', '.join(map(str, dims))}."
    )


def recall_figure(curves: dict | None, dims: list[int]):
    """t2i recall@10 against m for each ordering (log-2 m), the index's m's marked; None without curves."""
    from matplotlib.figure import Figure

    if not curves or not isinstance(curves.get("curves"), dict):
        return None
    fig = Figure(figsize=(4.6, 2.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for name, by_m in curves["curves"].items():
        points = sorted((int(m), v) for m, v in by_m.items() if v is not None)
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3, label=ORDERING_LABELS.get(name, name))
    for m in dims:
        ax.axvline(m, color="0.85", linewidth=0.8, zorder=0)
    return _recall_axes(fig, ax, "m (dimensions kept)", "recall against m", 7)


def _recall_axes(fig, ax, xlabel: str, title: str, legend_size: int, ylabel: str = "t2i recall@10"):
    """Label a recall chart: log-2 x axis, recall@10 up, the legend and the title; returns the figure."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=legend_size)
    ax.set_title(title, fontsize=9)
    return fig

# ---------------------------------------------------------------------------- the bytes frontier


def frontier_text(view: IndexView) -> str:
    """The words above the frontier chart: what each line is, in the page's units."""
    front = (view.curves or {}).get("bytes")
    if not front:
        return ("No byte budgets in this index: `triclip index build ... --bytes 8,16,32 --val-data VAL` stores"
                " compact codes chosen by measured recall, and this panel plots recall against bytes per image.")
    where = "validation" if front.get("split") == "validation" else "indexed"
    chosen = ", ".join(f"{b} B → {c['label']} ({c['recall']:.3f})" for b, c in sorted(front["chosen"].items(), key=lambda kv: int(kv[0])))
    words = (f"**Recall against bytes per image (B/image)**, measured on {front.get('queries', '?')} {where} captions."
             f" Left: text→image recall@10 of the image codes; black: the codes this index stores ({chosen});"
             " coloured: the best of every other kind of code tried at each budget (int8: one byte per dimension;"
             " binary: one bit; PQ / OPQ / RQ: each byte names one of 256 learned pieces of the vector; mixed:"
             " 1 to 6 bits per dimension); dashed grey: float pruning, the first m dimensions kept as 4-byte floats"
             " (4m B/image), what the m choices store.")
    text = (view.curves or {}).get("text_bytes")
    if text:
        captions = ", ".join(f"{b} B → {c['label']} ({c['recall']:.3f})"
                             for b, c in sorted(text["chosen"].items(), key=lambda kv: int(kv[0])))
        words += (f" Right: image→text recall@10 of the caption codes the same budgets store ({captions}), the"
                  " search behind the \"Captions (image → text)\" button of the Image → image / text tab.")
    return words + budgets_table(view)


def budgets_table(view: IndexView) -> str:
    """The stored image codes as a table: bytes, code, stages, recall, single-query latency at this index's size
    (measured, or extrapolated from a sample, by the build), memory held, and the float rows a re-rank reads per
    query (from memory, or from disk when they exceed the build's memory budget); short headers, for the page's
    side column."""
    from triclip.app.endpoints import code_label
    from triclip.index.report import human_bytes

    if not view.budgets:
        return ""
    rows = ["", "", "| bytes | code | stages | recall@10 | ms per query | RAM | re-rank reads per query |",
            "|---:|---|---|---:|---:|---:|---:|"]
    for budget, e in sorted(view.budgets.items()):
        stage, latency = e.get("rescore"), e.get("latency")
        stages = f"codes, float top {stage['shortlist']}" if stage else "codes"
        took = f"{latency['ms']:.3g} ({latency['how']})" if latency else "-"
        disk = f"{human_bytes(stage['disk_bytes_per_query'])} from {stage.get('reads') or 'memory'}" if stage else "–"
        rows.append(f"| {budget} B | {code_label(e)} | {stages} | {e['recall']:.3f} | {took}"
                    f" | {human_bytes(e.get('ram_bytes', e['index_bytes']))} | {disk} |")
    return "\n".join(rows)


def frontier_figure(view: IndexView):
    """Recall@10 against bytes per image (log 2): text->image on the left (the stored image codes, the best of
    each codec per budget, float pruning), image->text on the right (the stored caption codes and theirs), one
    legend below both; None without a frontier in the curves."""
    from matplotlib.figure import Figure

    front = (view.curves or {}).get("bytes")
    if not front:
        return None
    text = (view.curves or {}).get("text_bytes")
    fig = Figure(figsize=(9.2, 3.6) if text else (4.6, 3.6), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2 if text else 1, sharex=True, squeeze=False)[0]
    sides = [(axes[0], front, "text→image: the image codes")]
    if text:
        sides.append((axes[1], text, "image→text: the caption codes"))
    for ax, side, title in sides:
        _frontier_lines(ax, side)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("B/image (bytes stored per image)")
        ax.set_ylabel("recall@10")
        ax.set_title(title, fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=9, frameon=False)
    return fig


def _frontier_lines(ax, front: dict) -> None:
    """One side's lines: the best of each codec per budget, float pruning, and the stored codes."""
    from triclip.codecs import title

    best: dict[str, dict[int, float]] = {}
    for tried in front["candidates"].values():
        for c in tried:
            if c.get("recall") is not None and c.get("stages", "codes") == "codes":  # bytes in memory: codes alone
                by = best.setdefault(c["codec"], {})
                by[c["bytes"]] = max(by.get(c["bytes"], 0.0), c["recall"])
    for codec, points in sorted(best.items()):
        ax.plot(*zip(*sorted(points.items())), marker=".", markersize=5, linewidth=1, alpha=0.7, label=title(codec))
    pruning = sorted((int(b), r) for b, r in front.get("float_pruning", {}).items())
    if pruning:
        ax.plot(*zip(*pruning), color="0.5", linestyle="--", linewidth=1, label="float pruning (first m, 4m B)")
    ax.plot(*zip(*_chosen_points(front)), color="black", marker="o", linewidth=2, label="stored in this index")


def _chosen_points(front: dict | None) -> list[tuple[int, float]]:
    """(bytes, recall) of a frontier's stored codes, by bytes; [] without one."""
    return sorted((int(c["bytes"]), c["recall"]) for c in ((front or {}).get("chosen") or {}).values())
