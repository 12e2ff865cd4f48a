"""``triclip demo``: from nothing to a search app over real clip art, on a CPU in minutes.

1. data: the Debian ``openclipart`` packages (installed with apt-get when run as root,
   else the command to run is printed), thumbnails and manifests in ``WORKDIR/data``
   (byte-identical copies merged; train / val / test split by content);
2. ``lite`` (offline EfficientNet-Lite0 + MiniLM) on locked towers, whose outputs are computed
   once and cached: first MRL (``triclip train``'s default: InfoNCE nested on the first m of
   D, ``WORKDIR/mrl``), then the exact optimum of triCL's Eq. 6 on the embeddings it serves
   (``triclip solve --run``: regularised CCA, ridge picked on val, ``WORKDIR/run``), whose
   canonical correlations are the importance S. On openclipart's test split (5 seeds) it is level
   with MRL's prefix at m = 16 and above it at m = 32 and full D; on Tux Paint above it at m = 16
   and 32 (docs/results.md, "Eq. 6 solved on a trained run's embeddings"); unlike MRL it has a
   spectrum to show;
3. evaluate on the held-out test split, with the compact curve (recall@10 against m);
4. index every image (train, val, test) at several m in one folder (``WORKDIR/index``),
   reusing the cached tower outputs, with the recall-against-m curves measured on val;
5. serve the search app (``triclip app``) until Ctrl-C.

Each step is skipped when its output is already there, so a second run serves at once. A
work folder from an older triclip (data without a test split) is rebuilt.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from index.store import CURRENT, MANIFEST
from retrieval.data.builtin import prepare
from retrieval.run import CONFIG, METRICS, MODEL, read_config
from training.config import recipe_for

EVAL = "eval.json"  # the test metrics, kept beside data/, run/ and index/ (a second run prints them)
PREVIOUS_RUN = "previous-run"  # an older demo's run, moved aside when the recipe changed


@dataclass
class DemoConfig:
    workdir: str = "demo"  # everything the demo writes lives here
    host: str = "127.0.0.1"  # the app's address (127.0.0.1: this machine only)
    port: int = 7860  # the app's port
    epochs: int | None = None  # heads-only epochs over the cached tower outputs (None: the lite recipe's, 40)
    embed_dim: int = 256  # D
    dims: list[int] = field(default_factory=lambda: [16, 32, 64, 256])  # the m's of the index folder (training
    # evaluates the compact curve at D/16, D/8, D/4, so the app shows the recall measured at each of these)
    serve: bool = True  # start the app at the end (False: build everything and return)
    num: int | None = None  # cap on openclipart records (None: all 8,121; tests use a few hundred)


def run_demo(cfg: DemoConfig) -> dict:
    """Run the steps above; returns what was built (paths and the test metrics)."""
    started = time.perf_counter()
    work = Path(cfg.workdir).absolute()  # the index records the run's path: absolute, so it opens from anywhere
    data, mrl, run, index = work / "data", work / "mrl", work / "run", work / "index"
    _step(1, f"openclipart data in {data}")
    stale = not (data / "test.jsonl").exists() and (data / "val.jsonl").exists()  # an older demo's data
    if stale:
        print("the demo's data predates the deduplicated split: rebuilding data, run and index", flush=True)
    if not (data / "test.jsonl").exists():  # written last: anything else in data/ is an unfinished or older prepare
        prepare("openclipart", str(data), num=cfg.num, overwrite=data.is_dir() and any(data.iterdir()))
    _step(2, f"training MRL on lite (locked, cached towers) in {mrl}, then solving Eq. 6 on its embeddings in {run}")
    trained = stale or not _trained(mrl, cfg.epochs or recipe_for("lite").epochs)
    if trained:
        _train(cfg, data, mrl, overwrite=stale)
    older = (run / CONFIG).exists() and not _demo_recipe(run, mrl)
    if older:  # kept, not replaced: the index's rollback version needs it (--run WORKDIR/previous-run)
        previous = work / PREVIOUS_RUN
        shutil.rmtree(previous, ignore_errors=True)  # the demo's own copy of an even older run
        os.replace(run, previous)
        print(f"the demo's run was made with an older recipe: moved to {previous}, solving again", flush=True)
    solved = trained or not (run / MODEL).exists()
    if solved:
        _solve(data, mrl, run, overwrite=run.exists())
    _step(3, "test recall@10 (t2i) against m")
    metrics = _evaluate(cfg, data, run, work / EVAL)
    _step(4, f"index folder at m = {','.join(map(str, cfg.dims))} in {index}")
    if solved or (not (index / CURRENT).exists() and not (index / MANIFEST).exists()):
        _index(cfg, data, run, index, overwrite=solved)  # an overwritten index keeps one rollback
    print(f"demo ready in {time.perf_counter() - started:.0f} s", flush=True)
    result = {"data": str(data), "run": str(run), "index": str(index), "metrics": metrics}
    if cfg.serve:
        from app.gradio_app import serve

        _step(5, f"serving http://{cfg.host}:{cfg.port}/ (Ctrl-C stops)")
        serve(str(index), host=cfg.host, port=cfg.port)
    return result


def _step(n: int, text: str) -> None:
    print(f"[{n}/5] {text}", flush=True)


def _trained(run: Path, epochs: int) -> bool:
    path = run / METRICS
    return (run / MODEL).exists() and path.exists() and len(path.read_text().splitlines()) >= epochs


def _demo_recipe(run: Path, mrl: Path) -> bool:
    """Whether ``run`` is Eq. 6 solved on ``mrl``'s embeddings (older demos trained MRL, or tricl from a tower solve)."""
    config = read_config(run)  # a damaged config.json is one line (UserError), not a traceback
    return config["model"].get("post_affine", False) and Path(config.get("solver", {}).get("run", "")) == mrl


def _train(cfg: DemoConfig, data: Path, mrl: Path, overwrite: bool = False) -> None:
    from training.train import TrainConfig, train

    train(
        TrainConfig(
            train_data=str(data / "train.jsonl"),
            val_data=str(data / "val.jsonl"),
            out=str(mrl),
            model="lite",  # its recipe: locked, cached towers, batch 256, lr 1e-3, MRL (training.config)
            embed_dim=cfg.embed_dim,
            epochs=cfg.epochs,
            resume=not overwrite and (mrl / "checkpoint").exists(),
            overwrite=overwrite,
        )
    )


def _solve(data: Path, mrl: Path, run: Path, overwrite: bool = False) -> None:
    from training.config import SolveConfig
    from training.solve import solve

    # D, towers and heads are MRL's; the ridge is picked on val (t2i R@10 over the compact curve)
    train, val = str(data / "train.jsonl"), str(data / "val.jsonl")
    solve(SolveConfig(train_data=train, val_data=val, out=str(run), run=str(mrl), overwrite=overwrite))


def _evaluate(cfg: DemoConfig, data: Path, run: Path, saved: Path) -> dict:
    """The test metrics and compact curve; kept in ``saved`` for the run's weights and m's."""
    from retrieval.io import write_json_atomic
    from retrieval.run import run_fingerprint
    from training.evaluate import evaluate_run, format_table

    dims = [m for m in cfg.dims if m < cfg.embed_dim]
    key = {"fingerprint": run_fingerprint(run), "dims": dims}
    if saved.exists():
        previous = json.loads(saved.read_text())
        if previous.get("key") == key:
            print(format_table(previous["result"]))
            return previous["metrics"]
    result = json.loads(json.dumps(evaluate_run(str(run), str(data / "test.jsonl"), dims=dims), default=float))
    print(format_table(result))
    metrics = {k: result[k] for k in ("t2i_r1", "t2i_r10", "i2t_r1", "i2t_r10", "align", "uniform", "compact")}
    write_json_atomic(saved, {"key": key, "result": result, "metrics": metrics})
    return metrics


def _index(cfg: DemoConfig, data: Path, run: Path, index: Path, overwrite: bool = False) -> None:
    from index.build import IndexBuildConfig, build_index

    # train first, then val and test added: their locked-tower outputs come from the caches that
    # training and evaluation filled; the recall-against-m curves are measured on val
    val = str(data / "val.jsonl")
    build_index(
        IndexBuildConfig(
            run=str(run), data=str(data / "train.jsonl"), val_data=val, out=str(index), dims=cfg.dims, overwrite=overwrite
        )
    )
    for split in ("val", "test"):
        build_index(IndexBuildConfig(run=str(run), data=str(data / f"{split}.jsonl"), out=str(index), add=True))
