"""``triclip index build`` and ``triclip search`` through the CLI entry point."""

from __future__ import annotations

import json

import pytest

from triclip.app.cli import main


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def cli_index(tmp_path_factory, run_dir, shapes_dir):
    out = tmp_path_factory.mktemp("cli") / "index"
    code = main(["index", "build", "--run", str(run_dir), "--data", str(shapes_dir / "train.jsonl"),
                 "--out", str(out), "--dims", "8,16", "--factory", "Flat", "--batch-size", "32"])  # fmt: skip
    assert code == 0
    return out


def test_build_prints_a_summary(capsys, tmp_path, run_dir, shapes_dir):
    code, out, _ = _run(capsys, "index", "build", "--run", run_dir, "--data", shapes_dir / "val.jsonl",
                        "--out", tmp_path / "i", "--dims", "4")  # fmt: skip
    assert code == 0
    summary = json.loads(out)
    assert (summary["dims"], summary["factories"]["4"], summary["count"]) == ([4, 32], "Flat", 10)  # auto: Flat


def test_text_search_json(capsys, cli_index):
    code, out, _ = _run(capsys, "search", "--index", cli_index, "--text", "three large blue squares", "-k", "10", "--json")
    assert code == 0
    rows = json.loads(out)
    assert len(rows) == 10 and all(set(r) == {"id", "image", "caption", "score"} for r in rows)
    assert [r["score"] for r in rows] == sorted((r["score"] for r in rows), reverse=True)


def test_image_search_finds_itself(capsys, cli_index):
    first = json.loads((cli_index / "v000001" / "meta.jsonl").read_text().splitlines()[7])
    code, out, _ = _run(capsys, "search", "--index", cli_index, "--image", first["image"], "-k", "3", "--json")
    assert code == 0 and json.loads(out)[0]["id"] == first["id"]


def test_user_errors_exit_2_with_one_line(capsys, cli_index, other_run_dir, shapes_dir, tmp_path):
    cases = [
        (["search", "--index", cli_index, "--text", "x", "--run", other_run_dir], "fingerprint"),
        (["search", "--index", tmp_path / "nope", "--text", "x"], "not a triclip index"),
        (["search", "--index", cli_index, "--text", "x", "-k", "0"], "-k"),
        (["search", "--index", cli_index, "--image", tmp_path / "missing.png"], "cannot read query image"),
        (["index", "build", "--run", other_run_dir, "--data", shapes_dir / "val.jsonl", "--out", cli_index, "--add"],
         "fingerprint"),
        (["index", "build", "--run", other_run_dir, "--data", tmp_path / "missing.jsonl", "--out", tmp_path / "o"],
         "not found"),
        (["search", "--index", cli_index, "--text", "x", "--m", "12"], "m=12 is not indexed"),
        (["search", "--index", cli_index, "--text", "x", "--funnel", "64"], "funnel=64 is not indexed"),
        (["search", "--index", cli_index, "--text", ""], "empty text query"),
        (["search", "--index", cli_index], "give at least one"),
        (["search", "--index", cli_index, "--text-file", tmp_path / "none.txt"], "cannot read --text-file"),
        (["search", "--index", cli_index, "--text", "x", "--target", "text", "--factor", "0", "--funnel", "8"],
         "--factor"),
        (["index", "build", "--run", other_run_dir, "--data", shapes_dir / "val.jsonl", "--out", tmp_path / "o2",
          "--on-disk", "always"], "only IVF lists go on disk"),  # one builder: the same rule for both sources
    ]
    for argv, needle in cases:
        code, out, err = _run(capsys, *argv)
        assert code == 2, argv
        assert err.count("\n") == 1 and needle in err and "Traceback" not in err, err


def test_several_queries_one_model_load(capsys, cli_index, tmp_path):
    queries = tmp_path / "queries.txt"
    queries.write_text("a green star\n\none purple triangle\n")
    image = json.loads((cli_index / "v000001" / "meta.jsonl").read_text().splitlines()[3])
    code, out, err = _run(capsys, "search", "--index", cli_index, "--text", "three large blue squares",
                          "--text-file", queries, "--image", image["image"], "-k", "4", "--json", "--timing")  # fmt: skip
    assert code == 0
    results = json.loads(out)
    assert len(results) == 4 and all(len(hits) == 4 for hits in results)  # a list per query, in order
    assert results[3][0]["id"] == image["id"]
    timing = json.loads(err.strip().splitlines()[-1].split("timing: ", 1)[1])
    assert set(timing) == {"startup_s", "import_s", "index_load_s", "model_load_s", "text_encoder", "embed_s",
                           "search_s", "queries", "total_s"}  # fmt: skip
    assert timing["text_encoder"] == "torch"  # tiny has no exported text side
    assert timing["total_s"] >= timing["model_load_s"] + timing["embed_s"] > 0
    assert timing["queries"] == 4
    # the same queries one at a time give the same hits
    code, out, _ = _run(capsys, "search", "--index", cli_index, "--text", "a green star", "-k", "4", "--json")
    alone = json.loads(out)
    assert [h["id"] for h in alone] == [h["id"] for h in results[1]]
    assert [h["score"] for h in alone] == pytest.approx([h["score"] for h in results[1]], abs=1e-5)  # batch padding


def test_m_funnel_and_text_target(capsys, cli_index):
    base = ["search", "--index", cli_index, "--text", "three large blue squares", "-k", "5", "--json"]
    _, full, _ = _run(capsys, *base)
    _, funnel, _ = _run(capsys, *base, "--funnel", "8", "--factor", "20")  # 100 candidates of 90: exact at D
    _, small, _ = _run(capsys, *base, "--m", "8")
    full, funnel = json.loads(full), json.loads(funnel)
    assert [h["id"] for h in full] == [h["id"] for h in funnel]
    assert [h["score"] for h in full] == pytest.approx([h["score"] for h in funnel], abs=1e-5)  # FAISS vs numpy
    assert len(json.loads(small)) == 5
    code, out, _ = _run(capsys, *base, "--target", "text", "--m", "16")
    hits = json.loads(out)
    assert code == 0 and len(hits) == 5 and len({h["caption"] for h in hits}) >= 2


def test_index_build_options_come_from_the_config():
    """Every IndexBuildConfig field is an `index build` option (settings live in one place)."""
    import dataclasses

    from triclip.app.cli import build_parser
    from triclip.index.config import IndexBuildConfig

    sub = build_parser()._subparsers._group_actions[0].choices["index"]
    build = sub._subparsers._group_actions[0].choices["build"]
    dests = {a.dest for a in build._actions}
    flat = [f.name for f in dataclasses.fields(IndexBuildConfig) if f.name != "data_config"]
    assert set(flat) <= dests
    assert "sep" in dests and "image_key" in dests  # the nested DataConfig, flattened


def test_the_recipe_indexes_every_split_so_a_test_image_is_searchable(capsys, tmp_path, run_dir, shapes_dir):
    """``data split`` then ``index build --data DIR`` (the README's six commands) holds the
    test and validation images too; searching a test image's own caption can return it."""
    from triclip.index.store import load_contents
    from triclip.data import load_pairs

    data = tmp_path / "data"
    assert _run(capsys, "data", "split", shapes_dir / "train.jsonl", "--out", data)[0] == 0
    code, out, _ = _run(capsys, "index", "build", "--run", run_dir, "--data", data, "--out", tmp_path / "i", "--dims", "8")
    assert code == 0
    splits = {name: load_pairs(data / f"{name}.jsonl") for name in ("train", "val", "test")}
    assert json.loads(out)["count"] == sum(len(p) for p in splits.values())
    indexed = {row["image"] for row in load_contents(tmp_path / "i", indexes=False).meta}
    test_image = splits["test"].records[0]
    assert test_image.path in indexed and {r.path for r in splits["val"].records} <= indexed
    code, out, _ = _run(capsys, "search", "--index", tmp_path / "i", "--text", test_image.captions[0], "-k", "100", "--json")
    assert code == 0 and test_image.path in {hit["image"] for hit in json.loads(out)}
