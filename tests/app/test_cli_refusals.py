"""Bad values and options that do not apply are refused before anything loads: one line, exit 2, nothing written.

Every case runs in one child process (``triclip.app.cli.main`` called once per case) that reports, after each,
whether torch, FAISS, Gradio or open_clip were imported: a refusal must come from the options and the small JSON
files they name (a run's config.json, an index's manifest), never from a loaded model, index or data set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "faiss", "gradio", "open_clip", "transformers")
CHILD = f"""
import contextlib, io, json, sys
from triclip.app.cli import main
report = []
for argv in json.loads(sys.argv[1]):
    out, err, before = io.StringIO(), io.StringIO(), set(sys.modules)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    report.append({{"code": code, "out": out.getvalue(), "err": err.getvalue(),
                   "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules and m not in before)}})
print(json.dumps(report))
"""

R, D, I, T = "{run}", "{data}", "{index}", "{tmp}"
BUILD = ["index", "build", "--run", R, "--data", D, "--out", f"{T}/i"]
SEARCH = ["search", "--index", I, "--text", "a red circle"]
CASES = [  # (argv, what the one line must say)
    (BUILD + ["--bytes", "0"], "--bytes must be >= 1, got 0"),
    (BUILD + ["--bytes", "1000000000000000000000"], "above the float vectors' size, 4 x D = 128 bytes at D=32"),
    (BUILD + ["--bytes", "1000000000", "--codec", "mixed"], "above the float vectors' size"),
    (BUILD + ["--bytes", "8,129"], "--bytes 129 is above the float vectors' size"),
    (BUILD + ["--bytes", "8,x"], "expected comma-separated integers"),
    (BUILD + ["--dims", "16,33"], "--dims 33 exceeds the model's embedding dimension D=32"),
    (BUILD + ["--dims", "0,16"], "--dims must be >= 1, got 0,16"),
    (BUILD + ["--codec", "pq"], "--codec pq picks the code of each --bytes budget: give --bytes too"),
    (BUILD + ["--val-dat", "x"], "unrecognized arguments: --val-dat x"),
    (BUILD + ["--memory-budget", "0"], "--memory-budget must be positive"),
    (BUILD + ["--batch-size", "0"], "--batch-size must be >= 1"),
    (BUILD + ["--recall-target", "1.5"], "--recall-target must be <= 1"),
    (BUILD + ["--device", "gpu"], "--device 'gpu': choose cpu, cuda or cuda:N"),
    (["index", "build", "--run", f"{T}/no-run", "--data", D, "--out", f"{T}/i"], "is not a triclip run"),
    (["index", "build", "--run", R, "--data", f"{T}/no-data.jsonl", "--out", f"{T}/i"], "data source not found"),
    (["index", "build", "--run", R, "--data", "hf:a//b", "--out", f"{T}/i"], "not a Hugging Face data set name"),
    (["index", "build", "--run", R, "--data", D, "--out", I, "--add", "--bytes", "8"],
     "--add extends the index's own byte budgets"),
    (["index", "build", "--run", R, "--data", D, "--out", I, "--add", "--codec", "pq"],
     "--add extends the index's own byte budgets"),
    (["index", "build", "--run", R, "--data", D, "--out", I, "--add", "--dims", "8"], "--add: the index holds m = [8, 16, 32]"),
    (["index", "build", "--run", R, "--data", D, "--out", I, "--add", "--ordering", "pca"], "--ordering do not apply"),
    (["index", "build", "--run", R, "--data", D, "--out", I, "--add", "--no-text-index", "--recall-target", "0.9"],
     "--recall-target, --no-text-index do not apply"),
    (["index", "build", "--embeddings", f"{T}/no-emb", "--out", f"{T}/i", "--val-data", D], "--val-data and --weights do not apply"),
    (["index", "build", "--embeddings", f"{T}/no-emb", "--out", f"{T}/i"], "is not a triclip embeddings folder"),
    (BUILD + ["--dims", ""], "--dims names no m"),
    (["train", "--train-data", D, "--out", f"{T}/r", "--val-dat", "x"], "unrecognized arguments: --val-dat x"),
    (["train", "--train-data", D, "--out", f"{T}/r", "--epochs", "0"], "--epochs must be >= 1"),
    (["train", "--train-data", D, "--out", f"{T}/r", "--batch-size", "1"], "(contrastive losses need negatives)"),
    (["train", "--train-data", D, "--out", f"{T}/r", "--wd", "-1"], "--wd must be >= 0"),
    (["train", "--train-data", D, "--out", f"{T}/r", "--fixed-logit-scale", "200"], "--fixed-logit-scale must be <= 100"),
    (["train", "--train-data", D, "--out", f"{T}/r", "--device", "tpu"], "choose cpu, cuda or cuda:N"),
    (["train", "--train-data", D, "--out", f"{T}/r", "--init", f"{T}/no-run"], "is not a triclip run"),
    (["train", "--train-data", f"{T}/no-data.jsonl", "--out", f"{T}/r"], "data source not found"),
    (["eval", "--run", R, "--data", D, "--dims", "8,33"], "--dims 33: larger than the run's embedding dimension D=32"),
    (["eval", "--run", R, "--data", D, "--batch-size", "0"], "--batch-size must be >= 1"),
    (["solve", "--train-data", D, "--out", f"{T}/s", "--ridge", "-1"], "--ridge must be auto or a number >= 0"),
    (["embed", "--run", R, "--data", f"{T}/no-data.jsonl", "--out", f"{T}/e"], "data source not found"),
    (["embed", "--run", R, "--data", D, "--out", f"{T}/e", "--shard-size", "0"], "--shard-size must be >= 1"),
    (SEARCH + ["--m", "8", "--bytes", "4"], "--bytes searches a budget's codes, --m an index at m: give one"),
    (SEARCH + ["--funnel", "8", "--bytes", "4"], "not with --funnel"),
    (SEARCH + ["--m", "8", "--funnel", "16"], "--funnel searches at its own m and re-ranks at D: not with --m"),
    (SEARCH + ["--rescore", "float"], "--rescore re-ranks the shortlist of --bytes B's codes: give --bytes"),
    (SEARCH + ["--factor", "3"], "--factor sets the shortlist of --funnel or --rescore"),
    (SEARCH + ["--bytes", "0"], "--bytes must be >= 1"),
    (SEARCH + ["--bytes", "129"], "--bytes 129 is above the float vectors' size"),
    (SEARCH + ["--bytes", "8"], "--bytes 8: no codes of that many bytes here"),
    (SEARCH + ["--bytes", "8", "--rescore", "many"], "--rescore takes float or a number of bytes"),
    (SEARCH + ["--m", "7"], "m=7 is not indexed here; choose from [8, 16, 32]"),
    (SEARCH + ["--funnel", "4"], "funnel=4 is not indexed here"),
    (SEARCH + ["-k", "0"], "-k must be >= 1"),
    (SEARCH + ["--image", f"{T}/no-image.png"], "cannot read query image"),
    (["search", "--index", I], "give at least one --text, --text-file or --image query"),
    (["search", "--index", f"{T}/no-index", "--text", "a"], "is not a triclip index"),
    (["demo", "--workdir", f"{T}/demo", "--bytes", "1e21"], "expected comma-separated integers, got '1e21'"),
    (["demo", "--workdir", f"{T}/demo", "--bytes", "1000000000000000000000"], "above the float vectors' size, 4 x D = 1024"),
    (["demo", "--workdir", f"{T}/demo", "--bytes", "0,8"], "--bytes must be >= 1"),
    (["demo", "--workdir", f"{T}/demo", "--dims", "300"], "--dims 300 exceeds the model's embedding dimension D=256"),
    (["demo", "--workdir", f"{T}/demo", "--port", "0"], "--port must be a whole number from 1 to 65535, got 0"),
    (["demo", "--workdir", f"{T}/demo", "--epochs", "0"], "--epochs must be >= 1"),
    (["demo", "--workdir", f"{T}/demo", "--no-serve", "--port", "8000"], "--host and --port do not apply"),
    (["demo", "--workdir", f"{T}/demo", "--dims", ""], "--dims names no m"),
    (["app", "--index", I, "--port", "70000"], "--port must be a whole number from 1 to 65535"),
    (["app", "--index", f"{T}/no-index"], "is not a triclip index"),
    (["data", "prepare", "shapes", "--out", f"{T}/d", "--num", "0"], "--num must be >= 1"),
    (["data", "split", f"{T}/no-data.jsonl", "--out", f"{T}/d"], "data source not found"),
    (["data", "split", D, "--out", f"{T}/d", "--val", "0.9", "--test", "0.2"], "--val"),
    (["data", "inspect", "hf:a b"], "not a Hugging Face data set name"),
]


@pytest.fixture(scope="module")
def refusals(app_index, tmp_path_factory):
    """Every case's (code, stdout, stderr, heavy modules after it), run once in one child process."""
    tmp = tmp_path_factory.mktemp("refused")
    values = {R: str(app_index.parent / "run"), D: str(app_index.parent / "data" / "train.jsonl"), I: str(app_index)}
    cases = [[values.get(a, a).replace(T, str(tmp)) for a in argv] for argv, _ in CASES]
    before = _tree(app_index)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), tmp, before == _tree(app_index)


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


@pytest.mark.parametrize("case", range(len(CASES)), ids=[" ".join(a[:2]) + ": " + n[:40] for a, n in CASES])
def test_refused_in_one_line_before_anything_loads(refusals, case):
    report, _, _ = refusals
    result, needle = report[case], CASES[case][1]
    lines = [line for line in result["err"].splitlines() if line.strip()]
    assert result["code"] == 2 and len(lines) == 1 and lines[0].startswith("triclip: error: "), result["err"]
    assert needle in lines[0]
    assert result["out"] == ""
    # no model, index or Gradio was loaded to find out; a --codec name is checked against the codec registry,
    # whose modules import the FAISS library (no index is read)
    allowed = {"faiss"} if "--codec" in CASES[case][0] else set()
    assert set(result["heavy"]) <= allowed, result["heavy"]


def test_nothing_was_written(refusals):
    _, tmp, index_untouched = refusals
    assert sorted(p.name for p in tmp.iterdir()) == []  # no --out, --workdir or cache was made
    assert index_untouched  # the index the --add cases named is as it was


def test_the_demo_builds_each_budget_and_m_once():
    """``--bytes 8,8`` is one budget (the demo printed "codes of 8,8 bytes" and rebuilt its index every run)."""
    from triclip.app.config import DemoConfig, check_demo

    cfg = check_demo(DemoConfig(bytes=[16, 8, 8], dims=[64, 16, 64], serve=False))
    assert cfg.bytes == [8, 16] and cfg.dims == [16, 64]


def test_the_library_refuses_what_the_command_line_does(app_index, tmp_path):
    """``build_index`` checks as ``index build`` does: ``--add`` with budgets, ``--codec`` alone, a budget over 4 x D."""
    from triclip.core.errors import UserError
    from triclip.index.sources import IndexBuildConfig, build_index

    run, data = str(app_index.parent / "run"), str(app_index.parent / "data" / "train.jsonl")
    before = _tree(app_index)
    for options, needle in (({"out": str(app_index), "add": True, "bytes": [8]}, "--add extends"),
                            ({"out": str(tmp_path / "i"), "codec": "pq"}, "give --bytes too"),
                            ({"out": str(tmp_path / "i"), "bytes": [129]}, "above the float vectors' size")):
        with pytest.raises(UserError, match=needle):
            build_index(IndexBuildConfig(run=run, data=data, **options))
    assert _tree(app_index) == before and not (tmp_path / "i").exists()
