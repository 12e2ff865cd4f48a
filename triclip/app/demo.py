"""``triclip demo``: from nothing to a search app over real clip art, on a CPU in minutes.

1. data: the Debian ``openclipart`` packages (installed with apt-get when run as root,
   else the command to run is printed), thumbnails and manifests in ``WORKDIR/data``
   (byte-identical copies merged; train / val / test split by content);
2. ``lite`` (offline EfficientNet-Lite0 + MiniLM) on locked towers, whose outputs are computed
   once and cached: MRL (``triclip train``'s default: InfoNCE nested on the first m of D,
   ``WORKDIR/mrl``); the exact optimum of triCL's Eq. 6 on the embeddings it serves
   (``triclip solve --run``: regularised CCA, ridge picked on val, ``WORKDIR/solved``), whose
   canonical correlations are the importance S; then 10 gentle epochs of ``tricl`` nested on S's
   order from that solution (``WORKDIR/run``); the three steps: ``triclip.training.config`` ``MRL_STEP``, ``TUNE_STEP``. Against MRL's prefix on the test splits it is
   level at m = 16 and above at m = 32 and full D on openclipart (10 seeds), above at m = 16 and
   32 on Tux Paint and fashion-mnist (docs/results.md, "Eq. 6 solved on a trained run's
   embeddings"); unlike MRL it has a spectrum to show;
3. evaluate on the held-out test split, with the compact curve (recall@10 against m);
4. index every image (train, val, test) at several m in one folder (``WORKDIR/index``),
   reusing the cached tower outputs, with the recall-against-m curves measured on val, and
   compact codes at 4, 8, 16 and 32 bytes per image (``index build --bytes``: per budget the code
   with the best recall measured on val). These budgets are where the evidence puts the knee
   (docs/results_bytes.md, openclipart, 3 seeds: 95% / 97% / 100% / 99% of full-D test recall at
   4 / 8 / 16 / 32 B; 4 B is 256x smaller than float32 and re-scores to full-D recall);
5. serve the search app (``triclip app``) until Ctrl-C.

Each step is skipped when its output is finished (its folder's mark says done; the data's, and
every image its manifests name is there), so a second run serves at once, and a killed one resumes. The demo writes only into a folder it made (marked
``kind: demo``); any other non-empty ``--workdir`` is refused in one line. A work folder from an
older triclip (data without a test split) is rebuilt.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from triclip.app.config import DemoConfig, check_demo
from triclip.data.builtin import data_complete, prepare
from triclip.core.errors import UserError
from triclip.core.io import folder_done, folder_kind, read_json, write_json_atomic, write_mark, writing
from triclip.model.run import METRICS, read_config
from triclip.training.config import DEMO_MRL_EPOCHS, MRL_STEP, TUNE_STEP

EVAL = "eval.json"  # the test metrics, kept beside data/, run/ and index/ (a second run prints them)
PREVIOUS_RUN = "previous-run"  # an older demo's run, moved aside when the recipe changed


def run_demo(cfg: DemoConfig) -> dict:
    """Run the steps above; returns what was built (paths and the test metrics).

    The work folder is the demo's own (``triclip.core.io.writing``, kind ``demo``): a new or empty
    folder is marked first, one the demo marked is resumed, any other is refused in one line
    (nothing of it read, moved or replaced); a second demo on the same folder is refused while
    the first one builds.
    """
    started = time.perf_counter()
    cfg = check_demo(cfg)  # before any data, training or index: bad values are one line, the lists sorted and unique
    work = Path(cfg.workdir).absolute()  # the index records the run's path: absolute, so it opens from anywhere
    finished = folder_done(work, "demo")  # the last build got to its end (before this one marks it unfinished)
    with writing(work, "demo", reuse=True, option="--workdir", stage=False):
        write_mark(work, "demo", done=False)  # until this build gets to its end (a kill: the next one checks)
        result = _build(cfg, work, finished)
    print(f"demo ready in {time.perf_counter() - started:.0f} s", flush=True)
    if cfg.serve:
        from triclip.app.gradio_app import serve

        _step(5, f"serving http://{cfg.host}:{cfg.port}/ (Ctrl-C stops)")
        serve(result["index"], host=cfg.host, port=cfg.port)
    return result


def _build(cfg: DemoConfig, work: Path, finished: bool) -> dict:
    """Steps 1-4 in the demo's folder ``work`` (locked); ``finished``: the last build got to its end."""
    data, mrl, solved, run, index = (work / name for name in ("data", "mrl", "solved", "run", "index"))
    _step(1, f"openclipart data in {data}")
    stale = folder_done(data, "data") and not (data / "test.jsonl").exists()  # an older demo's data
    if stale:
        print("the demo's data predates the deduplicated split: rebuilding data, run and index", flush=True)
    lost = not stale and folder_done(data, "data") and not data_complete(data)  # done, and images gone since
    if lost:
        print(f"images named by {data}'s manifests are missing: preparing the data again", flush=True)
    if stale or lost or not folder_done(data, "data"):  # an unfinished prepare is built again (triclip.core.io.writing)
        prepare("openclipart", str(data), num=cfg.num, overwrite=stale or lost)
    _step(2, f"lite (locked, cached towers): MRL in {mrl}, Eq. 6 solved on it in {solved}, tricl from there in {run}")
    mrl_epochs = cfg.epochs or DEMO_MRL_EPOCHS
    upstream = stale or not _trained(mrl, mrl_epochs)  # MRL, then the solve, anew
    if upstream:
        _train(cfg, data, mrl, overwrite=stale, epochs=mrl_epochs, **MRL_STEP)
    if upstream or not folder_done(solved, "run"):  # done: its last file, not its weights
        upstream = True
        _solve(data, mrl, solved, overwrite=folder_done(solved, "run"))
    older = folder_done(run, "run") and not _demo_recipe(run, solved)
    if older:  # kept, not replaced: the index's rollback version needs it (--run WORKDIR/previous-run)
        previous = work / PREVIOUS_RUN
        if previous.exists() and folder_kind(previous) != "run":
            raise UserError(f"{previous} is not a run the demo moved aside; move it out of {work} and run the demo again")
        shutil.rmtree(previous, ignore_errors=True)  # the demo's own copy of an even older run
        os.replace(run, previous)
        print(f"the demo's run was made with an older recipe: moved to {previous}, training again", flush=True)
    redo = upstream or not _trained(run, TUNE_STEP["epochs"])
    if redo:  # an unfinished run of the recipe resumes from its checkpoint
        _train(cfg, data, run, init=solved, overwrite=upstream and folder_kind(run) == "run", **TUNE_STEP)
    _step(3, "test recall@10 (t2i) against m")
    metrics = _evaluate(cfg, data, run, work / EVAL)
    _step(4, f"index folder at m = {','.join(map(str, cfg.dims))}, codes of {','.join(map(str, cfg.bytes)) or 'no'} bytes, in {index}")
    redo = redo or (folder_done(index, "index") and _budgets(index) != sorted(cfg.bytes))  # an older demo's index
    if redo or not folder_done(index, "index"):
        _index(cfg, data, run, index, overwrite=redo and folder_kind(index) == "index")  # keeps one rollback
    elif not finished:  # a build killed between the index's train split and its val / test additions
        _add_splits(data, run, index)
    return {"data": str(data), "run": str(run), "index": str(index), "metrics": metrics}


def _budgets(index: Path) -> list[int] | None:
    """The byte budgets the live version of the demo's index holds (None: unreadable)."""
    from triclip.index.store import read_manifest

    try:
        return sorted(int(b) for b in read_manifest(index).get("budgets") or {})
    except UserError:
        return None


def _step(n: int, text: str) -> None:
    print(f"[{n}/5] {text}", flush=True)


def _trained(run: Path, epochs: int) -> bool:
    path = run / METRICS
    return folder_done(run, "run") and path.exists() and len(path.read_text().splitlines()) >= epochs


def _demo_recipe(run: Path, solved: Path) -> bool:
    """Whether ``run`` was trained with TUNE_STEP from ``solved`` (older demos: MRL alone, or tricl from a tower solve)."""
    config = read_config(run)  # a damaged config.json is one line (UserError), not a traceback
    init = config.get("train", {}).get("init")
    from_solved = init is not None and Path(init) == solved
    return from_solved and config["model"].get("post_affine", False) and config.get("loss") == TUNE_STEP["loss"]


def _train(cfg: DemoConfig, data: Path, out: Path, init: Path | None = None, overwrite: bool = False, **recipe) -> None:
    from triclip.training.train import TrainConfig, train

    train(
        TrainConfig(
            train_data=str(data / "train.jsonl"),
            val_data=str(data / "val.jsonl"),
            out=str(out),
            model="lite",  # its recipe: locked, cached towers, batch 256, lr 1e-3, MRL (triclip.training.config)
            embed_dim=None if init else cfg.embed_dim,  # from --init: D, heads and S are the solved run's
            init=str(init) if init else None,
            epochs=recipe.pop("epochs", cfg.epochs),
            patience=0,  # the measured demo recipe trains all its epochs (its numbers in the README)
            resume=not overwrite and (out / "checkpoint").exists(),
            overwrite=overwrite,
            **recipe,
        )
    )


def _solve(data: Path, mrl: Path, solved: Path, overwrite: bool = False) -> None:
    from triclip.training.config import SolveConfig
    from triclip.training.solve import solve

    # D, towers and heads are MRL's; the ridge is picked on val (t2i R@10 over the compact curve)
    train, val = str(data / "train.jsonl"), str(data / "val.jsonl")
    solve(SolveConfig(train_data=train, val_data=val, out=str(solved), run=str(mrl), overwrite=overwrite))


def _evaluate(cfg: DemoConfig, data: Path, run: Path, saved: Path) -> dict:
    """The test metrics and compact curve; kept in ``saved`` for the run's weights and m's."""
    from triclip.model.run import run_fingerprint
    from triclip.training.evaluate import evaluate_run, format_table

    dims = [m for m in cfg.dims if m < cfg.embed_dim]
    key = {"fingerprint": run_fingerprint(run), "dims": dims}
    if saved.exists():
        previous = read_json(saved)  # UserError: not JSON
        if not (isinstance(previous, dict) and {"key", "result", "metrics"} <= previous.keys()):
            raise UserError(f"{saved} is not the demo's test metrics; move it out of {saved.parent} and run the demo again")
        if previous["key"] == key:
            print(format_table(previous["result"]))
            return previous["metrics"]
    result = json.loads(json.dumps(evaluate_run(str(run), str(data / "test.jsonl"), dims=dims), default=float))
    print(format_table(result))
    metrics = {k: result[k] for k in ("t2i_r1", "t2i_r10", "i2t_r1", "i2t_r10", "align", "uniform", "compact")}
    write_json_atomic(saved, {"key": key, "result": result, "metrics": metrics})
    return metrics


def _index(cfg: DemoConfig, data: Path, run: Path, index: Path, overwrite: bool = False) -> None:
    from triclip.index.sources import IndexBuildConfig, build_index

    # train first, then val and test added: their locked-tower outputs come from the caches that
    # training and evaluation filled; the recall-against-m curves are measured on val
    val = str(data / "val.jsonl")
    build_index(
        IndexBuildConfig(
            run=str(run), data=str(data / "train.jsonl"), val_data=val, out=str(index), dims=cfg.dims,
            bytes=cfg.bytes or None, overwrite=overwrite, in_index=False,  # measured once val and test are in
        )
    )
    _add_splits(data, run, index)


def _add_splits(data: Path, run: Path, index: Path) -> None:
    """Add the val and test images to the index (records already in it are skipped); the last add measures the
    validation captions' recall among all of them (``triclip.index.in_index``)."""
    from triclip.index.sources import IndexBuildConfig, build_index

    for split in ("val", "test"):
        val = str(data / "val.jsonl") if split == "test" else None
        build_index(IndexBuildConfig(run=str(run), data=str(data / f"{split}.jsonl"), out=str(index), add=True,
                                     val_data=val))
