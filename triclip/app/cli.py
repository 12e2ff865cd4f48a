"""The ``triclip`` command line: argument parsing only; the work lives in the library.

Each sub-command turns its arguments into typed values and calls one library
function. Heavy imports (torch, faiss, gradio) happen inside the handlers so
that ``triclip --help`` and user errors answer fast.

A :class:`triclip.core.errors.UserError` anywhere below becomes one line on stderr
and exit status 2, as do argparse's own errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Sequence

from triclip.core.errors import UserError

PROG = "triclip"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        raise UserError(message)


def _print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=None, default=float)
    sys.stdout.write("\n")


def _parse_dims(text: str | None, option: str = "--dims") -> list[int]:
    if not text:
        return []
    try:
        dims = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{option} expects comma-separated integers, got {text!r}") from None
    if any(d <= 0 for d in dims):
        raise UserError(f"{option} must be positive, got {text!r}")
    return dims


# ---------------------------------------------------------------------------- data


def _data_args(p: argparse.ArgumentParser) -> None:
    """Options that say how to read a data source (shared by every command that reads one)."""
    p.add_argument("--image-key", default=None, help="image column / field (CSV: filepath, HF: image)")
    p.add_argument("--caption-key", default=None, help="caption column / field (CSV: title, HF: text)")
    p.add_argument("--label-key", default=None, help="optional label column / field")
    p.add_argument("--sep", default=None, help="CSV/TSV separator (default: from the extension)")
    p.add_argument("--split", default=None, help="split of a Hugging Face dataset (default: train)")


def _data_config(ns: argparse.Namespace):
    from triclip.data import DataConfig

    return DataConfig(
        image_key=ns.image_key, caption_key=ns.caption_key, label_key=ns.label_key, sep=ns.sep, split=ns.split
    )


def cmd_data_prepare(ns: argparse.Namespace) -> int:
    from triclip.data.builtin import prepare

    summary = prepare(ns.name, ns.out, num=ns.num, seed=ns.seed, overwrite=ns.overwrite)
    _print_json(summary)
    return 0


def cmd_data_split(ns: argparse.Namespace) -> int:
    from triclip.data.split import SplitConfig, split_source

    config = SplitConfig(val=ns.val, test=ns.test, seed=ns.seed)  # checked before any work
    _print_json(split_source(ns.src, ns.out, _data_config(ns), config, overwrite=ns.overwrite))
    return 0


def cmd_data_inspect(ns: argparse.Namespace) -> int:
    from triclip.data import inspect

    report = inspect(ns.path, _data_config(ns))
    if ns.json:
        _print_json(report)
    else:
        print(f"{report['records']} usable records, skipped: {report['skipped'] or 'none'}")
    return 0


# ---------------------------------------------------------------------------- train / eval


def cmd_train(ns: argparse.Namespace) -> int:
    from triclip.app.options import given_fields, to_config
    from triclip.training.train import TrainConfig, train

    if ns.train_data is None:
        if not ns.resume:
            raise UserError("train needs --train-data (or --resume --out RUN, which continues with the run's own)")
        ns.train_data = ""  # the run's config.json says (triclip.training.train)
    train(to_config(TrainConfig, ns), given=given_fields(ns))
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    from triclip.app.options import to_config
    from triclip.training.config import EvalConfig
    from triclip.training.evaluate import evaluate_run

    result = evaluate_run(to_config(EvalConfig, ns))
    if ns.json:
        _print_json(result)
    else:
        print(format_eval(result))
    return 0


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
    from triclip.app.options import to_config
    from triclip.training.config import SolveConfig
    from triclip.training.solve import solve

    solve(to_config(SolveConfig, ns))
    return 0


def _solve_options(p: argparse.ArgumentParser) -> None:
    from triclip.app.options import add_options
    from triclip.training.config import SolveConfig

    add_options(p, SolveConfig)


def _train_options(p: argparse.ArgumentParser) -> None:
    """``train``'s options: every field of TrainConfig (and its DataConfig), old short names kept."""
    from triclip.app.options import LazyChoices, add_options
    from triclip.training.config import TrainConfig, recipe_table

    aliases = {
        "weight_decay": ["--wd"],
        "warmup_steps": ["--warmup"],
        "loss_options": ["--loss-opt"],
        "unlock_image_groups": ["--lock-image-unlocked-groups"],  # open_clip's names
        "unlock_text_layers": ["--lock-text-unlocked-layers"],
    }
    off = {"lock_image": ["--unlock-image"], "lock_text": ["--unlock-text"]}  # unlocking is explicit
    choices = {"loss": LazyChoices(_loss_names), "importance": LazyChoices(_importance_forms)}
    optional = {"train_data": {"required": False}}  # --resume reads it from the run (triclip.training.train)
    add_options(p, TrainConfig, aliases=aliases, choices=choices, off_aliases=off, exclude=["post_affine"],  # from --init
                overrides=optional)
    p.epilog = recipe_table()
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # the table keeps its lines


def _eval_options(p: argparse.ArgumentParser) -> None:
    from triclip.app.options import add_options
    from triclip.training.config import EvalConfig

    add_options(p, EvalConfig)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _index_build_options(p: argparse.ArgumentParser) -> None:
    """``index build``'s options: every field of IndexBuildConfig (and its DataConfig)."""
    from triclip.app.options import LazyChoices, add_options
    from triclip.index.config import IndexBuildConfig

    text = {"text_index": {"help": "index the images only: no caption vectors (no image->text search)"}}
    add_options(p, IndexBuildConfig, required=["out"], exclude=["memory_budget"], overrides=text,
                choices={"codec": LazyChoices(_codec_names)})
    p.add_argument("--memory-budget", default=None, help="bytes one index may take in memory, e.g. 8G (default: half the available)")


def _codec_names() -> tuple[str, ...]:
    from triclip.index.codecs import names

    return names()


def _loss_names() -> list[str]:
    from triclip.losses import available_losses

    return available_losses()


def _importance_forms() -> list[str]:
    from triclip.model.model import IMPORTANCE_FORMS

    return sorted(IMPORTANCE_FORMS)


# ---------------------------------------------------------------------------- index / search / app


def cmd_embed(ns: argparse.Namespace) -> int:
    from triclip.model.shards import EmbedConfig, embed_to_shards

    cfg = EmbedConfig(
        run=ns.run,
        data=ns.data,
        out=ns.out,
        shard_size=ns.shard_size,
        dtype=ns.dtype,
        text=not ns.no_text,
        batch_size=ns.batch_size,
        workers=ns.workers,
        device=ns.device,
        data_config=_data_config(ns),
        overwrite=ns.overwrite,
        verify=ns.verify,
    )
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


def cmd_index_build(ns: argparse.Namespace) -> int:
    from triclip.app.options import to_config
    from triclip.index.sources import build_index
    from triclip.index.config import IndexBuildConfig

    if ns.embeddings is None and (ns.run is None or ns.data is None):
        raise UserError("give --run RUN --data P, or --embeddings EMB (from triclip embed)")
    ns.memory_budget = _memory_budget(ns.memory_budget)
    summary = build_index(to_config(IndexBuildConfig, ns))
    if summary.get("rank", 0) == 0:  # under torchrun (--embeddings): one summary, from rank 0
        if summary.get("budgets"):  # the codes kept per budget, for a person (stdout stays one JSON object)
            from triclip.index.budgets import table

            print(table(summary["budgets"]), file=sys.stderr)
        _print_json(summary)
    return 0


def cmd_index_rollback(ns: argparse.Namespace) -> int:
    from triclip.index.store import rollback

    removed, live = rollback(ns.index)
    print(f"{ns.index}: {live} is live again ({removed} removed)")
    return 0


def _memory_budget(text: str | None) -> int | None:
    from triclip.index.config import parse_bytes

    return None if text is None else parse_bytes(text)


def _search_queries(ns: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The text and image queries of ``triclip search``, in the order given (texts, then file lines, then images)."""
    texts = list(ns.text or [])
    if ns.text_file is not None:
        try:
            with open(ns.text_file, encoding="utf-8") as fh:
                texts += [line.rstrip("\n") for line in fh if line.strip()]
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"cannot read --text-file {ns.text_file}: {err}") from None
    images = list(ns.image or [])
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

    started = time.perf_counter()
    startup = _process_age()  # interpreter start and the CLI's own imports
    texts, images = _search_queries(ns)
    from triclip.index.search import Searcher

    imported = time.perf_counter()
    searcher = Searcher.load(ns.index, run=ns.run, device=ns.device, text_only=not images)
    if ns.factor is not None:
        if ns.factor < 1:
            raise UserError(f"--factor must be >= 1, got {ns.factor}")
        searcher.shortlist_factor = ns.factor
    loaded = time.perf_counter()
    import numpy as np

    parts = ([searcher.embed_texts(texts)] if texts else []) + ([searcher.embed_images(images)] if images else [])
    queries = np.concatenate(parts)  # (Q, D)
    embedded = time.perf_counter()
    rescore = ns.rescore if ns.rescore in (None, "float", "none") else _int_option("--rescore", ns.rescore)
    results = searcher.search_vectors(queries, k=ns.k, m=ns.m, target=ns.target, funnel=ns.funnel, bytes=ns.bytes,
                                      rescore=rescore)
    searched = time.perf_counter()
    labels = texts + images
    if ns.json:
        _print_json(results[0] if len(results) == 1 else results)
    else:
        for label, hits in zip(labels, results):
            if len(results) > 1:
                print(f"# {label}")
            for rank, hit in enumerate(hits, 1):
                print(f"{rank:3d}  {hit['score']:.4f}  {hit['image']}  {hit['caption']}")
    if ns.timing:
        timing = {
            "startup_s": startup,
            "import_s": imported - started,
            "index_load_s": searcher.timings["index_load"],
            "model_load_s": searcher.timings["model_load"],
            "text_encoder": "onnx" if searcher.text_encoder is not None else "torch",
            "embed_s": embedded - loaded,
            "search_s": searched - embedded,
            "queries": len(labels),
            "total_s": startup + time.perf_counter() - started,
        }
        print("timing: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in timing.items()}), file=sys.stderr)
    return 0


def _int_option(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{name} takes float or a number of bytes, got {text!r}") from None


def cmd_app(ns: argparse.Namespace) -> int:
    """Serve until stopped, then leave without the interpreter's teardown (:func:`_leave_after_serving`)."""
    from triclip.app.gradio_app import serve

    code = 0
    try:
        serve(ns.index, host=ns.host, port=ns.port, run=ns.run, device=ns.device)
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
    from triclip.app.demo import DemoConfig, run_demo

    cfg = DemoConfig(workdir=ns.workdir, host=ns.host, port=ns.port, serve=not ns.no_serve, num=ns.num)
    if ns.epochs is not None:
        cfg.epochs = ns.epochs
    if ns.dims:
        cfg.dims = _parse_dims(ns.dims)
    if ns.bytes is not None:
        cfg.bytes = _parse_dims(ns.bytes, "--bytes") if ns.bytes.strip() else []
    run_demo(cfg)
    if cfg.serve:  # served until stopped
        _leave_after_serving(0)
    return 0


# ---------------------------------------------------------------------------- parser


def _needs_options(argv: Sequence[str] | None) -> Callable[[str], bool]:
    """``full(command)``: whether ``command``'s options must be built for ``argv`` (all of them when None)."""
    words = [a for a in (argv or []) if not a.startswith("-")]
    chosen = words[0] if argv is not None and words else None
    return lambda command: chosen is None or chosen == command


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``triclip`` parser. Given ``argv``, only its command's dataclass options are built
    (importing a command's config costs ~0.2 s: a text search must not pay for ``train``'s)."""
    from triclip.app.options import positive_int  # the one check of batch sizes (triclip.app.options.POSITIVE_SUFFIX)

    full = _needs_options(argv)
    parser = _Parser(prog=PROG, description="Train, prune and serve compact CLIP-style retrieval.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    data = sub.add_parser("data", help="prepare built-in datasets, split or inspect any data source")
    dsub = data.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    p = dsub.add_parser("prepare", help="write a built-in dataset as JSONL manifests")
    p.add_argument("name", choices=["shapes", "fashion-mnist", "openclipart"], help="the data set: %(choices)s")
    p.add_argument("--out", required=True, help="output folder DIR: DIR/train.jsonl, val.jsonl (and test.jsonl), DIR/images/")
    p.add_argument("--num", type=int, default=None, help="number of records (shapes: total; others: cap; default: all)")
    p.add_argument("--seed", type=int, default=0, help="which records go where (default: 0)")
    p.add_argument("--overwrite", action="store_true", help="replace a data set already in --out")
    p.set_defaults(func=cmd_data_prepare)
    p = dsub.add_parser(
        "split",
        help="split any data source into train/val/test manifests by image content",
        description="Split a data source into DIR/{train,val,test}.jsonl. Byte-identical images are merged into "
        "one record (the union of their captions) and never sit in two splits; shares are of distinct images.",
    )
    p.add_argument("src", help="a .jsonl manifest, .csv/.tsv, datasets.save_to_disk folder, or WebDataset shards")
    p.add_argument("--out", required=True, help="output folder DIR")
    p.add_argument("--val", type=float, default=0.1, help="share of distinct images in val.jsonl (default: 0.1)")
    p.add_argument("--test", type=float, default=0.1, help="share of distinct images in test.jsonl (default: 0.1)")
    p.add_argument("--seed", type=int, default=0, help="which images go where (default: 0)")
    p.add_argument("--overwrite", action="store_true", help="replace a data set already in --out")
    _data_args(p)
    p.set_defaults(func=cmd_data_split)
    p = dsub.add_parser("inspect", help="count usable and skipped records of a data source")
    p.add_argument("path", help="a .jsonl manifest, .csv/.tsv, datasets.save_to_disk folder, or WebDataset shards")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    _data_args(p)
    p.set_defaults(func=cmd_data_inspect)

    p = sub.add_parser("train", help="train a dual encoder", description="Train a dual encoder (options: triclip.training.config.TrainConfig).")
    if full("train"):
        _train_options(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="evaluate a trained run", description="Evaluate a run (options: triclip.training.config.EvalConfig).")
    if full("eval"):
        _eval_options(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "solve",
        help="the exact Eq. 6 optimum for locked towers (regularised CCA) as a run, in seconds",
        description="Solve for affine heads on locked towers by regularised CCA (options: triclip.training.config.SolveConfig).",
    )
    if full("solve"):
        _solve_options(p)
    p.set_defaults(func=cmd_solve)

    sub.add_parser("launch", add_help=False, help="torchrun for a triclip command: launch --nproc-per-node K embed --run RUN ...")
    p = sub.add_parser("embed", help="embed a data source into numbered shards (also under torchrun)")
    p.add_argument("--run", "--run-dir", dest="run", required=True, help="the run (under plain torchrun: --run-dir)")
    p.add_argument("--data", required=True, help="data source to embed (any format triclip.data accepts)")
    p.add_argument("--out", required=True, help="embeddings folder; a re-run resumes it")
    p.add_argument("--shard-size", type=int, default=200_000, help="records per shard (default: 200000)")
    p.add_argument("--dtype", choices=["float32", "float16"], default="float32", help="vectors on disk (default: float32)")
    p.add_argument("--no-text", action="store_true", help="embed the images only, not the captions")
    p.add_argument("--batch-size", type=positive_int, default=None, help="default: 256 on a GPU, 64 on the CPU")
    p.add_argument("--workers", type=int, default=None, help="image-decoding processes per rank")
    p.add_argument("--device", default=None, help="default: this rank's GPU, else the CPU")
    p.add_argument("--overwrite", action="store_true", help="start --out over when it holds other embeddings")
    p.add_argument("--verify", action="store_true", help="also check the sha256 of finished shards (sizes always are)")
    _data_args(p)
    p.set_defaults(func=cmd_embed)

    index = sub.add_parser("index", help="build FAISS indexes")
    isub = index.add_subparsers(dest="index_command", required=True, parser_class=_Parser)
    p = isub.add_parser(
        "build",
        help="embed a data source once and index it at several m in one folder",
        description="Build an index folder (options: triclip.index.config.IndexBuildConfig).",
    )
    if full("index"):
        _index_build_options(p)
    p.set_defaults(func=cmd_index_build)
    p = isub.add_parser("rollback", help="go back to the version an index build --overwrite replaced")
    p.add_argument("--index", required=True, help="index folder (index build --out)")
    p.set_defaults(func=cmd_index_rollback)

    p = sub.add_parser("search", help="query an index by text or image (model loaded once for all queries)")
    p.add_argument("--index", required=True, help="index folder (index build --out)")
    p.add_argument("--text", action="append", default=None, help="a text query (repeat for several)")
    p.add_argument("--text-file", default=None, help="a file of text queries, one per line")
    p.add_argument("--image", action="append", default=None, help="an image query file (repeat for several)")
    p.add_argument("--target", choices=["image", "text"], default="image", help="search images (default) or captions")
    p.add_argument("--m", type=int, default=None, help="search the index at m (default: D)")
    p.add_argument("--funnel", type=int, default=None, metavar="M", help="shortlist at m=M, re-rank at full D")
    p.add_argument("--bytes", type=int, default=None, metavar="B",
                   help="search the codes of B bytes per vector (index build --bytes): the image codes, the caption codes"
                        " with --target text (default: none, float at m)")
    p.add_argument("--rescore", default=None, metavar="float|B2|none",
                   help="with --bytes: re-rank the codes' shortlist with the float vectors or the codes of B2 bytes;"
                        " none: the codes alone (default: the stages index build chose for B)")
    p.add_argument("--factor", type=int, default=None, help="funnel candidates per hit (default: 20)")
    p.add_argument("-k", type=int, default=10, help="hits per query (default: 10)")
    p.add_argument("--run", default=None, help="run to embed queries with (default: the one the index records)")
    p.add_argument("--json", action="store_true", help="a list of hits (one query) or of hit lists (several)")
    p.add_argument("--timing", action="store_true", help="print where the time went on stderr")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 for the query model (default: cuda when available, else cpu)")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("app", help="serve a search app")
    p.add_argument("--index", required=True, help="index folder to serve (index build --out); the app follows its updates")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=7860, help="port to listen on (default: 7860)")
    p.add_argument("--run", default=None, help="run to embed queries with (default: the one the index records)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 for the query model (default: cuda when available, else cpu)")
    p.set_defaults(func=cmd_app)

    p = sub.add_parser(
        "demo", help="openclipart -> lite on locked, cached towers: MRL, Eq. 6 solved on it, tricl from there -> index at several m -> the app"
    )
    p.add_argument("--workdir", default="demo", help="where the data, runs and index go (default: demo)")
    p.add_argument("--host", default="127.0.0.1", help="the app's address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=7860, help="the app's port (default: 7860)")
    p.add_argument("--no-serve", action="store_true", help="build everything, do not start the app")
    p.add_argument("--num", type=int, default=None, help="use at most N openclipart records (a quick look)")
    p.add_argument("--epochs", type=int, default=None, help="training epochs (default: 40)")
    p.add_argument("--dims", default=None, help="m's of the index folder, e.g. 16,32,64,256 (the default)")
    p.add_argument("--bytes", default=None,
                   help="byte budgets of the index's codes (default 4,8,16,32: 95/97/100/99%% of full-D recall, docs/results_bytes.md); '' for none")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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
