"""Bad option values: each is one line and exit 2, before any work, whatever the command.

A representative sweep over the commands (hostile use sent about 100 such values); the
per-command suites hold more (tests/training/test_train.py, tests/index/test_versions.py,
tests/app/test_options.py, tests/app/test_cli_data.py).
"""

from __future__ import annotations

import pytest

from tests.hostile.conftest import one_line_error

D, I, R = "{data}", "{index}", "{run}"
CASES = [
    (["train", "--train-data", D, "--out", "{tmp}/r", "--model", "tiny", "--loss", "infonce", "--epochs", "0"], "epochs"),
    (["train", "--train-data", D, "--out", "{tmp}/r", "--model", "tiny", "--loss", "infonce", "--batch-size", "-4"], "batch"),
    (["train", "--train-data", D, "--out", "{tmp}/r", "--model", "tiny", "--loss", "infonce", "--lr", "nan"], "lr"),
    (["train", "--train-data", D, "--out", "{tmp}/r", "--model", "tiny", "--loss", "no-such-loss"], "loss"),
    (["train", "--train-data", D, "--out", "{tmp}/r", "--model", "no-such-model", "--loss", "infonce"], "model"),
    (["train", "--train-data", "{tmp}/missing.jsonl", "--out", "{tmp}/r", "--model", "tiny", "--loss", "infonce"], "missing"),
    (["eval", "--run", R, "--data", D, "--dims", "0", "--json"], "dims"),
    (["eval", "--run", "{tmp}", "--data", D, "--json"], "config.json"),
    (["index", "build", "--run", R, "--data", D, "--out", "{tmp}/i", "--dims", "0"], "dims"),
    (["index", "build", "--run", R, "--data", D, "--out", "{tmp}/i", "--factory", "Bogus99"], "factory"),
    (["index", "build", "--run", R, "--data", D, "--out", "{tmp}/i", "--batch-size", "0"], "batch"),
    (["index", "build", "--embeddings", "{tmp}", "--out", "{tmp}/i"], "embeddings"),
    (["index", "rollback", "--index", "{tmp}"], "not a triclip index"),
    (["search", "--index", I, "--text", "red", "-k", "0"], "-k"),
    (["search", "--index", I, "--text", "red", "--m", "7"], "m=7"),
    (["search", "--index", I, "--text", "red", "--funnel", "8", "--factor", "0"], "factor"),
    (["search", "--index", I], "query"),
    (["search", "--index", "{tmp}", "--text", "red"], "not a triclip index"),
    (["embed", "--run", R, "--data", D, "--out", "{tmp}/e", "--shard-size", "0"], "shard-size"),
    (["embed", "--run", R, "--data", D, "--out", "{tmp}/e", "--dtype", "int8"], "dtype"),
    (["data", "prepare", "shapes", "--out", "{tmp}/d", "--num", "0"], "num"),
    (["data", "prepare", "shapes", "--out", "{tmp}/d", "--num", "many"], "num"),
    (["data", "prepare", "no-such-set", "--out", "{tmp}/d"], "no-such-set"),
    (["data", "inspect", "{tmp}/missing.jsonl"], "missing"),
]


@pytest.mark.parametrize("argv, needle", CASES, ids=[" ".join(a[:2]) + f" {n}" for a, n in CASES])
def test_bad_value_is_one_line(cli, tmp_path, shapes, tiny_run, built_index, argv, needle):
    values = {"{data}": str(shapes / "val.jsonl"), "{index}": str(built_index), "{run}": str(tiny_run)}
    args = [values.get(a, a).replace("{tmp}", str(tmp_path)) for a in argv]
    before = sorted(p.name for p in tmp_path.iterdir())
    status, _, err = cli(*args)
    assert needle.lower() in one_line_error(status, err).lower()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == [n for n in before if n != "cache"]
