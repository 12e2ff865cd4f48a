"""``python -m benchmarks.load_app`` against the test app: light clients, real query files, CPU per query."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.load_app import LoadConfig, check_local, main, queries, run_load


@pytest.mark.parametrize("client, api", [("async", "call"), ("threads", "call"), ("async", "json"), ("threads", "json")])
def test_a_short_load_run_answers_every_query(app_url, client, api):
    cfg = LoadConfig(app_url, clients=3, seconds=1.5, m=16, k=4, client=client, server_pid=os.getpid(), api=api)
    out = run_load(cfg)
    assert out["errors"] == 0 and out["queries"] > 0 and out["client"] == client and out["api"] == api
    assert out["p50_ms"] > 0 and out["p50_ms"] <= out["p95_ms"] <= out["p99_ms"] <= out["max_ms"]
    assert out["app_search_p50_ms"] is not None and out["m"] == 16
    assert out["server_cpu_ms_per_query"] > 0  # the app runs in this process: its CPU is counted


def test_max_requests_bounds_the_run_and_json_is_printed(app_url, capsys):
    code = main(["--url", app_url, "--clients", "2", "--seconds", "20", "--max-requests", "5", "--m", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["queries"] == 5 and out["errors"] == 0 and out["seconds"] < 20


def test_queries_from_a_manifest_are_its_distinct_titles(tmp_path):
    manifest = tmp_path / "val.jsonl"
    rows = [{"image": "a.png", "captions": ["Red apple", "a description"]}, {"image": "b.png", "captions": ["Red apple"]},
            {"image": "c.png", "captions": ["gramastar"]}]  # fmt: skip
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sorted(queries(0, str(manifest))) == ["Red apple", "gramastar"]
    lines = tmp_path / "q.txt"
    lines.write_text("a cat\n\na dog\na cat\n")
    assert sorted(queries(1, str(lines))) == ["a cat", "a dog"]
    assert len(queries(0)) == 2400 and queries(0) == queries(0) != queries(1)  # made-up ones, seeded order
    with pytest.raises(SystemExit, match="cannot read queries"):
        queries(0, str(tmp_path / "missing.txt"))


def test_only_this_machine_is_loaded():
    assert check_local("http://127.0.0.1:7860") == "http://127.0.0.1:7860/"
    with pytest.raises(SystemExit, match="only sends to 127.0.0.1"):
        check_local("http://example.com/")


def test_gradio_clients_only_use_the_queue(app_url):
    with pytest.raises(SystemExit, match="--client gradio"):
        run_load(LoadConfig(app_url, clients=1, seconds=1, client="gradio", api="json"))


def test_m_takes_an_m_or_a_byte_budget():
    import argparse

    from benchmarks.load_app import _m_choice

    assert _m_choice("64") == 64 and _m_choice("8B") == "8B" and _m_choice(" 16b") == "16B"
    with pytest.raises(argparse.ArgumentTypeError):
        _m_choice("eight")
