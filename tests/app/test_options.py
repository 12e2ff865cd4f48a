"""triclip.app.options: argparse options from dataclasses (names, parsers, defaults, help, choices, given)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Literal

import pytest

from triclip.app.options import LazyChoices, add_options, field_help, given_fields, to_config


@dataclass
class Inner:
    sep: str | None = None  # column separator
    max_pixels: int = 100  # bigger images are skipped


@dataclass
class Outer:
    data: str  # where the data is
    batch_size: int = 64  # pairs per step
    lr: float | None = None  # peak learning rate (None: per preset)
    mode: Literal["fast", "slow"] = "fast"  # how to run
    dims: list[int] = field(default_factory=list)  # compact dims
    options: dict = field(default_factory=dict)  # objective options
    lock: bool = False  # freeze the tower
    cache: bool = True  # reuse cached outputs
    name: str = "x"
    weight_decay: float = 0.1  # AdamW decay, 10% of
    note: str = field(default="", metadata={"help": "from metadata"})  # the comment loses
    reader: Inner = field(default_factory=Inner)  # how to read


class _Raising(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def _parser(**kw) -> argparse.ArgumentParser:
    p = _Raising(prog="t")
    add_options(p, Outer, **kw)
    return p


def test_fields_become_typed_options_and_back():
    ns = _parser().parse_args(
        ["--data", "d.jsonl", "--batch-size", "8", "--lr", "0.5", "--mode", "slow", "--dims", "4, 8,16", "--options", "tau=0.1",
         "--options", "mining=hard", "--lock", "--no-cache", "--sep", ";", "--max-pixels", "7"]
    )  # fmt: skip
    cfg = to_config(Outer, ns)
    assert cfg == Outer(
        data="d.jsonl",
        batch_size=8,
        lr=0.5,
        mode="slow",
        dims=[4, 8, 16],
        options={"tau": 0.1, "mining": "hard"},
        lock=True,
        cache=False,
        reader=Inner(sep=";", max_pixels=7),
    )


def test_defaults_come_from_the_dataclass_and_are_not_shared():
    p = _parser()
    a, b = to_config(Outer, p.parse_args(["--data", "a"])), to_config(Outer, p.parse_args(["--data", "b", "--options", "k=1"]))
    assert a == Outer(data="a")
    assert b.options == {"k": 1} and a.options == {} and Outer(data="c").options == {}


def test_given_fields_name_only_what_was_typed_with_dotted_nested_paths():
    ns = _parser().parse_args(["--data", "a", "--batch-size", "64", "--sep", ",", "--lock"])
    assert given_fields(ns) == {"data", "batch_size", "reader.sep", "lock"}  # 64 is the default, still typed


def test_help_has_the_comments_defaults_and_choices():
    text = _parser().format_help()
    assert "pairs per step (default: 64)" in text
    assert "peak learning rate (None: per preset)" in text and "(default: None)" not in text
    assert "{fast,slow}" in text and "how to run (default: fast)" in text
    assert "AdamW decay, 10% of (default: 0.1)" in text  # a % in a comment survives argparse's formatting
    assert "from metadata" in text and "the comment loses" not in text
    assert "--no-cache" in text and "--max-pixels" in text
    assert field_help(Outer)["name"] == ""  # no comment, no help


def test_aliases_and_lazy_choices():
    loaded = []

    def names():
        loaded.append(1)
        return ["infonce", "tricl"]

    p = _parser(aliases={"weight_decay": ["--wd"]}, choices={"name": LazyChoices(names)})
    assert not loaded  # building the parser does not compute the choices
    assert to_config(Outer, p.parse_args(["--data", "a", "--wd", "0.5", "--name", "tricl"])).weight_decay == 0.5
    with pytest.raises(ValueError, match="invalid choice"):
        p.parse_args(["--data", "a", "--name", "nope"])
    assert "one of: infonce, tricl" in p.format_help()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "nan"], "finite"),
        (["--lr", "inf"], "finite"),
        (["--lr", "fast"], "expected a number"),
        (["--batch-size", "2.5"], "invalid int value"),
        (["--dims", "4,a"], "comma-separated integers"),
        (["--options", "novalue"], "K=V"),
        (["--mode", "medium"], "invalid choice"),
        ([], "required"),
    ],
)
def test_bad_values_are_argparse_errors(argv, message):
    base = [] if message == "required" else ["--data", "a"]
    with pytest.raises(ValueError, match=message):
        _parser().parse_args(base + argv)


def test_excluded_fields_keep_their_defaults():
    p = _Raising(prog="t")
    add_options(p, Outer, exclude={"lock", "reader.sep"})
    assert "--lock" not in p.format_help() and "--sep" not in p.format_help()
    assert to_config(Outer, p.parse_args(["--data", "a"])) == Outer(data="a")


def test_overrides_replace_the_derived_arguments_of_one_field():
    """What a command words its own way (``train``'s optional --train-data, ``index build``'s --no-text-index help)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_options(parser, Outer, overrides={"data": {"required": False}, "cache": {"help": "keep the tower cache"}})
    assert parser.parse_args([]).data is None  # no longer required
    assert "keep the tower cache" in parser.format_help()
    strict = argparse.ArgumentParser()
    add_options(strict, Outer)
    with pytest.raises(SystemExit):  # --data required (argparse exits on a missing one)
        strict.parse_args([])


@dataclass
class Command:
    src: str = field(metadata={"positional": True, "help": "where from"})
    text: list[str] | None = field(default=None, metadata={"repeat": True})  # a query
    k: int = field(default=10, metadata={"flags": ["-k"]})  # hits
    budget: int | None = field(default=None, metadata={"metavar": "B"})  # bytes


def test_positional_repeated_short_and_metavar_fields():
    p = _Raising(prog="t")
    add_options(p, Command)
    ns = p.parse_args(["here.jsonl", "--text", "a, b", "--text", "c", "-k", "3"])
    assert to_config(Command, ns) == Command(src="here.jsonl", text=["a, b", "c"], k=3)  # a comma stays in its query
    assert to_config(Command, p.parse_args(["x"])).text is None and Command("x").text is None
    text = p.format_help()
    assert "where from" in text and "-k K" in text and "--k" not in text and "--budget B" in text
    assert "a query (repeat the option for several)" in text
    with pytest.raises(ValueError, match="required"):
        p.parse_args([])


def test_no_option_is_abbreviated_in_a_parsed_config():
    from triclip.app.options import parse_config

    assert parse_config(Outer, ["--data", "a", "--batch-size", "3"]).batch_size == 3
    with pytest.raises(SystemExit):  # --batch would be --batch-size with abbreviations on
        parse_config(Outer, ["--data", "a", "--batch", "3"])
