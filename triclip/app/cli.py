"""The ``triclip`` command line: argument parsing only; the work lives in the library.

Every command's options come from its typed config (``triclip.app.options.add_options``: one
option per dataclass field, its ``# comment`` the help), and every command checks its config
(bounds, options that do not apply, paths, D from a run's or an index's JSON) before it imports
torch, FAISS or Gradio: a bad value is one line and exit 2 at once. Each command then calls one
library function. :data:`COMMANDS` lists them.

A :class:`triclip.core.errors.UserError` anywhere below becomes one line on stderr
and exit status 2, as do argparse's own errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from triclip.app.config import SERVE_ONLY
from triclip.app.options import LazyChoices
from triclip.core.errors import UserError
from triclip.core.memory import keep_freed_memory

PROG = "triclip"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block), exit status 2, and no abbreviated options."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # --val-dat is an unknown option, not --val-data
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        raise UserError(message)


def _print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=None, default=float)
    sys.stdout.write("\n")


def _config(cls: type, ns: argparse.Namespace, check: Callable | None = None):
    """The Namespace's values as ``cls`` (``triclip.app.options.to_config``), checked by ``check`` when given."""
    from triclip.app.options import to_config

    cfg = to_config(cls, ns)
    if check is not None:
        check(cfg)
    return cfg


def _options(*configs: str, **options) -> Callable[[argparse.ArgumentParser], None]:
    """What adds a command's options: ``add_options`` of each config (``"module:Class"``, imported only when
    the options are built), with ``options`` (``exclude``, ``choices``, ...) for each."""

    def build(parser: argparse.ArgumentParser) -> None:
        import importlib

        from triclip.app.options import add_options

        for name in configs:
            module, cls = name.split(":")
            add_options(parser, getattr(importlib.import_module(module), cls), **options)

    return build


def _builtin_names() -> list[str]:
    from triclip.data.builtin import BUILTINS

    return list(BUILTINS)


# ---------------------------------------------------------------------------- data


def cmd_data_prepare(ns: argparse.Namespace) -> int:
    from triclip.data.config import PrepareConfig, check_source_config

    cfg = _config(PrepareConfig, ns, check_source_config)
    from triclip.data.builtin import prepare

    _print_json(prepare(cfg.name, cfg.out, num=cfg.num, seed=cfg.seed, overwrite=cfg.overwrite))
    return 0


def cmd_data_split(ns: argparse.Namespace) -> int:
    from triclip.data.config import DataSplitConfig, check_source_config

    cfg = _config(DataSplitConfig, ns, check_source_config)  # the shares are checked when made
    from triclip.data.split import split_source

    _print_json(split_source(cfg.src, cfg.out, cfg.data_config, cfg.shares, overwrite=cfg.overwrite))
    return 0


def cmd_data_inspect(ns: argparse.Namespace) -> int:
    from triclip.data.config import InspectConfig, check_source_config

    cfg = _config(InspectConfig, ns, check_source_config)
    from triclip.data import inspect

    report = inspect(cfg.path, cfg.data_config)
    return _print_result(ns, report, _inspect_text)


def _inspect_text(report: dict) -> str:
    """``data inspect``'s lines: the counts, then per skip reason the first records it skipped (and how many more)."""
    lines = [f"{report['records']} usable records, skipped: {report['skipped'] or 'none'}"]
    for reason, named in report.get("skipped_examples", {}).items():
        more = report["skipped"].get(reason, 0) - len(named)
        lines.append(f"  {reason} ({report['skipped'].get(reason, 0)}): {'; '.join(named)}{f'; and {more} more' if more > 0 else ''}")
    return "\n".join(lines)


def _print_result(ns: argparse.Namespace, result: dict, text: Callable[[dict], str]) -> int:
    """One JSON object with ``--json`` (``triclip.app.config.JsonOutput``), else ``text(result)``."""
    from triclip.app.config import JsonOutput

    if _config(JsonOutput, ns).json:
        _print_json(result)
    else:
        print(text(result))
    return 0


# ---------------------------------------------------------------------------- train / eval / solve


def _train_options(p: argparse.ArgumentParser) -> None:
    """``train``'s options: every field of TrainConfig (and its DataConfig), old short names kept."""
    from triclip.app.options import LazyChoices, add_options
    from triclip.training.config import ALIASES, TrainConfig, recipe_table

    off = {"lock_image": ["--unlock-image"], "lock_text": ["--unlock-text"]}  # unlocking is explicit
    choices = {"loss": LazyChoices(_loss_names), "importance": LazyChoices(_importance_forms)}
    optional = {"train_data": {"required": False}}  # --resume reads it from the run (triclip.training.train)
    add_options(p, TrainConfig, aliases=ALIASES, choices=choices, off_aliases=off, exclude=["post_affine"],  # from --init
                overrides=optional)
    p.epilog = recipe_table()
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # the table keeps its lines


def cmd_train(ns: argparse.Namespace) -> int:
    from triclip.app.options import given_fields
    from triclip.training.config import TrainConfig, check_train

    if ns.train_data is None:
        if not ns.resume:
            raise UserError("train needs --train-data (or --resume --out RUN, which continues with the run's own)")
        ns.train_data = ""  # the run's config.json says (triclip.training.train)
    cfg = _config(TrainConfig, ns, check_train)
    from triclip.training.train import train

    train(cfg, given=given_fields(ns))
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    from triclip.training.config import EvalConfig, check_eval

    cfg = _config(EvalConfig, ns, check_eval)
    from triclip.training.evaluate import evaluate_run

    return _print_result(ns, evaluate_run(cfg), format_eval)


def format_eval(result: dict) -> str:
    """``eval``'s result as a few aligned tables: recall, the other metrics, the compact curve."""
    lines = ["         R@1     R@5     R@10"]
    for side in ("t2i", "i2t"):
        if f"{side}_r1" in result:
            lines.append(f"{side}    " + "".join(f"{result.get(f'{side}_r{k}', float('nan')):8.3f}" for k in (1, 5, 10)))
            if side == "t2i" and "t2i_queries" in result:
                lines[-1] += f"    ({result['t2i_queries']} distinct text queries)"
    shown = {f"{s}_r{k}" for s in ("t2i", "i2t") for k in (1, 5, 10)} | {"t2i_queries", "compact", "importance", "skipped"}
    others = [f"{key} {_short(value)}" for key, value in result.items() if key not in shown]
    if others:
        lines.append("")
        lines.append("   ".join(others))
    spectrum = result.get("importance")
    if isinstance(spectrum, dict) and spectrum.get("sorted"):
        w = spectrum["sorted"]
        lines.append(
            f"importance: effective dims {_short(spectrum.get('effective_dims'))} of {len(w)},"
            f" max/mean {_short(spectrum.get('max_over_mean'))}, largest w {_short(w[:3])}, smallest {_short(w[-2:])}"
        )
    compact = result.get("compact") or {}
    if compact:
        orderings = list(compact)
        dims = sorted({int(m) for curve in compact.values() for m in curve})
        lines += ["", "compact curve: t2i R@10 at m", "m     " + "".join(f"{name:>12}" for name in orderings)]
        for m in dims:
            cells = [compact[name].get(m, compact[name].get(str(m))) for name in orderings]
            lines.append(f"{m:<6}" + "".join(f"{c:12.3f}" if isinstance(c, (int, float)) else f"{'-':>12}" for c in cells))
    skipped = result.get("skipped")
    lines += ["", f"skipped records: {_short(skipped) if skipped else 'none'}"]
    return "\n".join(lines)


def _short(value) -> str:
    """A number with 3-4 significant digits, a short list in full, a long one as its length and ends."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        items = [_short(v) for v in value]
        return "[" + ", ".join(items if len(items) <= 6 else items[:3] + ["...", *items[-2:]]) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items()) + "}"
    return str(value)


def cmd_solve(ns: argparse.Namespace) -> int:
    from triclip.training.config import SolveConfig, check_solve

    cfg = _config(SolveConfig, ns, check_solve)
    from triclip.training.solve import solve

    solve(cfg)
    return 0


def _loss_names() -> list[str]:
    from triclip.losses import available_losses

    return available_losses()


def _importance_forms() -> list[str]:
    from triclip.model.model import IMPORTANCE_FORMS

    return sorted(IMPORTANCE_FORMS)


# ---------------------------------------------------------------------------- embed / index


def cmd_embed(ns: argparse.Namespace) -> int:
    from triclip.model.shards import EmbedConfig, check_embed

    cfg = _config(EmbedConfig, ns, check_embed)
    from triclip.model.shards import embed_to_shards

    summary = embed_to_shards(cfg)
    if summary["rank"] == 0:  # under torchrun: one summary, from rank 0
        _print_json(summary)
    return 0


def cmd_launch(argv: list[str]) -> int:
    """``triclip launch [torchrun options] [--] COMMAND ...``: torchrun running ``python -m triclip COMMAND ...``.

    ``torchrun ... -m triclip embed --run RUN`` fails before triclip starts: torchrun's argparse
    classifies every word of the command line, the script's arguments included, and ``--run``
    is an abbreviation of two of its own options (``--run-path`` and its alias ``--run_path``),
    which argparse refuses as ambiguous. Here torchrun parses only its own part; the triclip
    command's arguments go to the ranks untouched, so every option keeps its usual spelling.
    """
    from torch.distributed.run import get_args_parser, run

    commands = ("train", "embed", "index", "eval", "solve")
    split = argv.index("--") if "--" in argv else next((i for i, a in enumerate(argv) if a in commands), None)
    tail = argv[split + 1 :] if split is not None and argv[split] == "--" else argv[split:] if split is not None else []
    if not tail and any(a in ("-h", "--help") for a in argv):
        print(f"usage: {PROG} launch [torchrun options] [--] COMMAND [command options]\n\ntorchrun's options:")
        get_args_parser().print_help()
        return 0
    if not tail:
        raise UserError("give a triclip command after torchrun's options, e.g. triclip launch --nproc-per-node 2 embed --run RUN ...")
    args = get_args_parser().parse_args([*argv[:split], "-m", "triclip"])
    args.training_script_args = tail
    run(args)
    return 0


def _index_build_options(p: argparse.ArgumentParser) -> None:
    """``index build``'s options: every field of IndexBuildConfig (and its DataConfig)."""
    from triclip.app.options import add_options
    from triclip.index.config import IndexBuildConfig, parse_bytes

    words = {"text_index": {"help": "index the images only: no caption vectors (no image->text search)"},
             "memory_budget": {"type": parse_bytes, "metavar": "SIZE"}}
    add_options(p, IndexBuildConfig, required=["out"], overrides=words, choices={"codec": LazyChoices(_codec_names)})


def _codec_names() -> tuple[str, ...]:
    from triclip.codecs import names

    return names()


def cmd_index_build(ns: argparse.Namespace) -> int:
    from triclip.index.config import IndexBuildConfig, check_build

    cfg = _config(IndexBuildConfig, ns, check_build)
    from triclip.index.report import table
    from triclip.index.sources import build_index

    summary = build_index(cfg)
    if summary.get("rank", 0) == 0:  # under torchrun (--embeddings): one summary, from rank 0
        if summary.get("budgets"):  # the codes kept per budget, for a person (stdout stays one JSON object)
            print(table(summary["budgets"]), file=sys.stderr)
        _print_json(_without_candidates(summary))
    return 0


def _without_candidates(summary: dict) -> dict:
    """The build's summary less every budget's tried candidates: the table shows them, and the index's
    ``curves.json`` keeps them (``bytes`` / ``text_bytes``, ``candidates``)."""
    def entry(e: dict) -> dict:
        return {k: entry(v) if k == "text" else v for k, v in e.items() if k != "candidates"}

    if not summary.get("budgets"):
        return summary
    return {**summary, "budgets": {b: entry(e) for b, e in summary["budgets"].items()}}


def _index_export_options(p: argparse.ArgumentParser) -> None:
    """``index export``'s options: every field of ExportConfig."""
    from triclip.app.options import add_options
    from triclip.index.config import ExportConfig

    add_options(p, ExportConfig, overrides={"text": {"help": "export the image rows only, no caption vectors"}})


def cmd_index_export(ns: argparse.Namespace) -> int:
    from triclip.index.config import ExportConfig
    from triclip.index.milvus_export import export

    _print_json(export(_config(ExportConfig, ns)))
    return 0


def cmd_index_rollback(ns: argparse.Namespace) -> int:
    from triclip.index.config import RollbackConfig

    cfg = _config(RollbackConfig, ns)
    from triclip.index.store import rollback

    removed, live = rollback(cfg.index)
    print(f"{cfg.index}: {live} is live again ({removed} removed)")
    return 0


# ---------------------------------------------------------------------------- search / app / demo


def _search_queries(cfg) -> tuple[list[str], list[str]]:
    """The text and image queries of ``triclip search``, in the order given (texts, then file lines, then images)."""
    texts = list(cfg.text or [])
    if cfg.text_file is not None:
        try:
            with open(cfg.text_file, encoding="utf-8") as fh:
                texts += [line.rstrip("\n") for line in fh if line.strip()]
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"cannot read --text-file {cfg.text_file}: {err}") from None
    images = list(cfg.image or [])
    if not texts and not images:
        raise UserError("give at least one --text, --text-file or --image query")
    return texts, images


def _process_age() -> float:
    """Seconds since this process started (Linux /proc; 0 elsewhere)."""
    import os

    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def cmd_search(ns: argparse.Namespace) -> int:
    import time

    from triclip.index.config import SearchConfig, check_search, rescore_value

    started = time.perf_counter()
    startup = _process_age()  # interpreter start and the CLI's own imports
    cfg = _config(SearchConfig, ns, check_search)  # from the index's manifest: nothing loaded yet
    texts, images = _search_queries(cfg)
    from triclip.index.milvus_search import open_searcher

    imported = time.perf_counter()
    searcher = open_searcher(cfg.index, run=cfg.run, device=cfg.device, text_only=not images, collection=cfg.collection)
    if cfg.factor is not None:
        searcher.shortlist_factor = cfg.factor
    loaded = time.perf_counter()
    import numpy as np

    parts = ([searcher.embed_texts(texts)] if texts else []) + ([searcher.embed_images(images)] if images else [])
    queries = np.concatenate(parts)  # (Q, D)
    embedded = time.perf_counter()
    results = searcher.search_vectors(queries, k=cfg.k, m=cfg.m, target=cfg.target, funnel=cfg.funnel, bytes=cfg.bytes,
                                      rescore=rescore_value(cfg.rescore))
    searched = time.perf_counter()
    getattr(searcher, "close", lambda: None)()  # a Milvus client (and Milvus Lite's file) is let go
    _print_hits(texts + images, results, cfg.json)
    shortlist = _shortlist(cfg, searcher)
    if shortlist and shortlist["whole_gallery"]:
        print(f"note: {shortlist['note']}", file=sys.stderr)
    if cfg.timing:
        timing = {
            "startup_s": startup,
            "import_s": imported - started,
            "index_load_s": searcher.timings["index_load"],
            "model_load_s": searcher.timings["model_load"],
            "text_encoder": "onnx" if searcher.text_encoder is not None else "torch",
            "embed_s": embedded - loaded,
            "search_s": searched - embedded,
            "queries": len(texts) + len(images),
            "total_s": startup + time.perf_counter() - started,
            **({"shortlist": shortlist} if shortlist else {}),
        }
        print("timing: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in timing.items()}), file=sys.stderr)
    return 0


def _shortlist(cfg, searcher) -> dict | None:
    """With ``--rescore`` or ``--funnel``: the candidates re-ranked (k x factor), the vectors searched, and whether the
    shortlist held all of them (then the answer is the re-ranking's alone: exact full-D search with ``--rescore
    float`` or a funnel, the codes or the small m choosing nothing); None without a shortlist."""
    if cfg.rescore is None and cfg.funnel is None:
        return None
    total = len(searcher) if cfg.target == "image" else int((getattr(searcher, "manifest", None) or {}).get("text_count") or 0)
    wanted = cfg.k * max(1, int(searcher.shortlist_factor))
    whole = bool(total) and wanted >= total
    note = (f"the shortlist of k x factor = {cfg.k} x {searcher.shortlist_factor} = {wanted} candidates holds all"
            f" {total} {cfg.target} vectors: every one is re-ranked, so the answer is the re-ranking's alone"
            f" (with --rescore float or --funnel: exact full-D search); a smaller --factor shows the shortlist at work")
    return {"candidates": min(wanted, total) if total else wanted, "vectors": total, "whole_gallery": whole,
            **({"note": note} if whole else {})}


def _print_hits(labels: list[str], results: list[list[dict]], as_json: bool) -> None:
    """One JSON value (a hit list, or a list of them), or a line per hit under a ``# query`` line per query; a caption
    hit (``--target text``: each string once) says how many images carry it."""
    if as_json:
        _print_json(results[0] if len(results) == 1 else results)
        return
    for label, hits in zip(labels, results):
        if len(results) > 1:
            print(f"# {label}")
        for rank, hit in enumerate(hits, 1):
            shared = f"  ({hit['images']} images carry this caption)" if hit.get("images", 1) > 1 else ""
            print(f"{rank:3d}  {hit['score']:.4f}  {hit['image']}  {hit['caption']}{shared}")


def cmd_app(ns: argparse.Namespace) -> int:
    """Serve until stopped, then leave without the interpreter's teardown (:func:`_leave_after_serving`)."""
    from triclip.app.config import AppConfig, check_app

    cfg = _config(AppConfig, ns, check_app)  # the address, the index and the run: before anything loads
    from triclip.app.gradio_app import serve

    code = 0
    try:
        serve(cfg.index, host=cfg.host, port=cfg.port, run=cfg.run, device=cfg.device, collection=cfg.collection)
    except UserError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    _leave_after_serving(code)


def _leave_after_serving(code: int) -> None:
    """Exit with ``code`` once the output is flushed, skipping the interpreter's teardown: a served app has
    nothing left to write, and at teardown triton's nanobind module (imported with torch) prints ~27 "leaked" lines."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_demo(ns: argparse.Namespace) -> int:
    from triclip.app.config import DemoConfig, check_demo

    cfg = check_demo(_config(DemoConfig, ns))  # m's and budgets against D, the address: before any data or training
    from triclip.app.demo import run_demo

    run_demo(cfg)
    if cfg.serve:  # served until stopped
        _leave_after_serving(0)
    return 0


# ---------------------------------------------------------------------------- the parser


@dataclass(frozen=True)
class Command:
    """One command: its words, its help, what adds its options (from its configs) and what runs it."""

    words: tuple[str, ...]  # ("index", "build"): a group, then the command; or ("search",)
    help: str
    options: Callable[[argparse.ArgumentParser], None] | None  # None: parsed elsewhere (launch)
    run: Callable[[argparse.Namespace], int] | None
    description: str | None = None  # --help's first paragraph (default: the help)


JSON = "triclip.app.config:JsonOutput"  # --json
GROUPS = {"data": "prepare built-in datasets, split or inspect any data source", "index": "build FAISS indexes"}
COMMANDS = (
    Command(("data", "prepare"), "write a built-in dataset as JSONL manifests", _options("triclip.data.config:PrepareConfig", choices={"name": LazyChoices(_builtin_names)}), cmd_data_prepare),
    Command(("data", "split"), "split any data source into train/val/test manifests by image content",
            _options("triclip.data.config:DataSplitConfig"),
            cmd_data_split, "Split a data source into DIR/{train,val,test}.jsonl. Byte-identical images are merged into"
            " one record (the union of their captions) and never sit in two splits; shares are of distinct images."),
    Command(("data", "inspect"), "count usable and skipped records of a data source", _options("triclip.data.config:InspectConfig", JSON), cmd_data_inspect),
    Command(("train",), "train a dual encoder", _train_options, cmd_train,
            "Train a dual encoder (options: triclip.training.config.TrainConfig)."),
    Command(("eval",), "evaluate a trained run", _options("triclip.training.config:EvalConfig", JSON), cmd_eval,
            "Evaluate a run (options: triclip.training.config.EvalConfig)."),
    Command(("solve",), "the exact Eq. 6 optimum for locked towers (regularised CCA) as a run, in seconds",
            _options("triclip.training.config:SolveConfig"), cmd_solve, "Solve for affine heads on locked towers by regularised CCA (options: triclip.training.config.SolveConfig)."),
    Command(("launch",), "torchrun for a triclip command: launch --nproc-per-node K embed --run RUN ...", None, None),
    Command(("embed",), "embed a data source into numbered shards (also under torchrun)",
            _options("triclip.model.shards:EmbedConfig", exclude=["anchor_rows"]), cmd_embed),
    Command(("index", "build"), "embed a data source once and index it at several m in one folder", _index_build_options,
            cmd_index_build, "Build an index folder (options: triclip.index.config.IndexBuildConfig)."),
    Command(("index", "export"), "copy an index's live version into Milvus (a Milvus Lite PATH.db or a server"
            " http://HOST:19530)", _options("triclip.index.config:ExportConfig", overrides={
                "text": {"help": "export the image rows only, no caption vectors"}}), cmd_index_export,
            "Export an index folder to Milvus (options: triclip.index.config.ExportConfig; docs/scale_out.md)."),
    Command(("index", "rollback"), "go back to the version an index build --overwrite replaced",
            _options("triclip.index.config:RollbackConfig"), cmd_index_rollback),
    Command(("search",), "query an index by text or image (model loaded once for all queries)",
            _options("triclip.index.config:SearchConfig"), cmd_search),
    Command(("app",), "serve a search app", _options("triclip.app.config:AppConfig", exclude=SERVE_ONLY), cmd_app,
            "Serve a search app over an index until Ctrl-C or SIGTERM (`kill PID`): either stops it cleanly, exit 0."),
    Command(("demo",), "openclipart -> lite on locked, cached towers: MRL, Eq. 6 solved on it, tricl from there -> index at"
            " several m -> the app", _options("triclip.app.config:DemoConfig", exclude=["embed_dim"]), cmd_demo,
            "Build the demo (openclipart -> lite on locked, cached towers: MRL, Eq. 6 solved on it, tricl from there ->"
            " index at several m), then serve the app until Ctrl-C or SIGTERM (`kill PID`): either stops it cleanly,"
            " exit 0."),
)


def _needs_options(argv: Sequence[str] | None) -> Callable[[str], bool]:
    """``full(command)``: whether ``command``'s options must be built for ``argv`` (all of them when None)."""
    words = [a for a in (argv or []) if not a.startswith("-")]
    chosen = words[0] if argv is not None and words else None
    return lambda command: chosen is None or chosen == command


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``triclip`` parser. Given ``argv``, only its command's options are built (importing a
    command's configs costs tenths of a second: a text search must not pay for ``train``'s)."""
    full = _needs_options(argv)
    parser = _Parser(prog=PROG, description="Train, prune and serve compact CLIP-style retrieval.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    groups: dict[str, argparse._SubParsersAction] = {}
    for command in COMMANDS:
        where = sub
        if len(command.words) == 2:
            group = command.words[0]
            if group not in groups:
                groups[group] = sub.add_parser(group, help=GROUPS[group]).add_subparsers(
                    dest=f"{group}_command", required=True, parser_class=_Parser)
            where = groups[group]
        if command.options is None:
            where.add_parser(command.words[-1], add_help=False, help=command.help)
            continue
        p = where.add_parser(command.words[-1], help=command.help, description=command.description or command.help)
        if full(command.words[0]):
            command.options(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    keep_freed_memory()  # fewer page faults in every command (triclip.core.memory)
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        if argv[:1] == ["launch"]:  # torchrun's options, then a triclip command: torchrun parses its own part
            return cmd_launch(argv[1:])
        ns = build_parser(argv).parse_args(argv)
        func: Callable[[argparse.Namespace], int] = ns.func
        code = func(ns)
        sys.stdout.flush()  # a reader that went away (search --json | head) shows here, not at exit
        return code
    except UserError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output closed it: nothing left to say
        _silence_stdout()
        return 1
    except OSError as err:  # permissions, a full disk, a vanished file: one line, never a traceback
        print(f"{PROG}: error: {_os_error(err)}", file=sys.stderr)
        return 2


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again (Python's SIGPIPE recipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (captured output)
        pass


def _os_error(err: OSError) -> str:
    """``PATH: reason`` of an OS error (both paths of a rename)."""
    reason = err.strerror or str(err) or type(err).__name__
    paths = [str(p) for p in (err.filename, err.filename2) if p is not None]
    return f"{' -> '.join(paths)}: {reason}" if paths else reason


if __name__ == "__main__":
    sys.exit(main())
