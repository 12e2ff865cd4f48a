"""What the command line prints for people: eval's tables and help texts that say the truth."""

from __future__ import annotations

import pytest

from triclip.app.cli import build_parser, format_eval, main
from triclip.index.search import SHORTLIST_FACTOR

RESULT = {
    "i2t_r1": 0.4333, "i2t_r5": 0.7667, "i2t_r10": 0.85, "t2i_r1": 0.4545, "t2i_r5": 0.8377, "t2i_r10": 0.9481,
    "t2i_queries": 154, "align": 1.3387, "uniform": -2.0688, "class_map": 0.6781,
    "importance": {"sorted": [2.0 - i / 256 for i in range(256)], "effective_dims": 250.3, "max_over_mean": 1.33},
    "logit_scale": 14.28,
    "compact": {"importance": {8: 0.72, 16: 0.93}, "first": {8: 0.70, 16: 0.91}, "pca": {"8": 0.90, "16": 0.95}},
    "skipped": {},
}  # fmt: skip


def test_eval_prints_tables_not_lists():
    text = format_eval(RESULT)
    lines = text.splitlines()
    assert lines[1].split()[:4] == ["t2i", "0.455", "0.838", "0.948"] and "154 distinct text queries" in lines[1]
    assert lines[2].split() == ["i2t", "0.433", "0.767", "0.850"]
    assert "align 1.339" in text and "class_map 0.6781" in text and "logit_scale 14.28" in text
    assert "effective dims 250.3 of 256" in text
    curve = lines.index("compact curve: t2i R@10 at m")
    assert lines[curve + 1].split() == ["m", "importance", "first", "pca"]
    assert lines[curve + 2].split() == ["8", "0.720", "0.700", "0.900"]  # int and str keys alike
    assert lines[-1] == "skipped records: none"
    assert max(len(line) for line in lines) < 120  # no 256-number list
    assert format_eval({**RESULT, "skipped": {"corrupt_image": 2}}).endswith("skipped records: {corrupt_image: 2}")


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_help_states_the_real_defaults(capsys):
    assert f"funnel / rescore candidates per hit, with --funnel or --rescore (default: {SHORTLIST_FACTOR})" in _help(capsys, "search")
    text = _help(capsys, "index", "build")
    assert "--no-text-index index the images only: no caption vectors" in text


def test_parser_builds_only_the_command_asked_for():
    def options(parser, command):
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]
        return {s for a in sub._actions for s in a.option_strings}

    search_only = build_parser(["search", "--index", "I", "--text", "t"])
    assert "--epochs" not in options(search_only, "train") and "--k" not in options(search_only, "search")
    assert "--epochs" in options(build_parser(), "train") and "--epochs" in options(build_parser(["train"]), "train")
