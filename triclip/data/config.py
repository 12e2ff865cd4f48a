"""The settings of ``triclip data prepare / split / inspect``, one field each.

Torch-free on purpose: the command line builds its options from these classes
(``triclip.app.options``) and checks them (:func:`check_source_config`) before any data is read.
A field's comment is its ``--help`` text; how a source is read is :class:`DataConfig`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from triclip.core.config import bounded, check_fields
from triclip.data.hf import check_hub_name
from triclip.data.records import DataConfig
from triclip.data.sources import check_source
from triclip.data.split import SplitConfig

SOURCE_HELP = "a .jsonl manifest, .csv/.tsv, datasets.save_to_disk folder or hf:NAME, or WebDataset shards"


@dataclass
class PrepareConfig:
    """What ``triclip data prepare`` was asked to write."""

    name: str = field(metadata={"positional": True, "help": "the data set"})
    out: str  # output folder DIR: DIR/train.jsonl, val.jsonl (and test.jsonl), DIR/images/
    num: int | None = bounded(None, low=1)  # number of records (shapes: total; others: cap; None: all)
    seed: int = 0  # which records go where
    overwrite: bool = False  # replace a data set already in --out


@dataclass
class DataSplitConfig:
    """What ``triclip data split`` was asked to do."""

    src: str = field(metadata={"positional": True, "help": SOURCE_HELP})
    out: str  # output folder DIR: DIR/train.jsonl, val.jsonl, test.jsonl
    shares: SplitConfig = field(default_factory=SplitConfig)  # --val, --test, --seed (checked when made)
    overwrite: bool = False  # replace a data set already in --out
    data_config: DataConfig = field(default_factory=DataConfig)  # how to read the source (--sep, --image-key, ...)


@dataclass
class InspectConfig:
    """What ``triclip data inspect`` was asked to read."""

    path: str = field(metadata={"positional": True, "help": SOURCE_HELP})
    data_config: DataConfig = field(default_factory=DataConfig)  # how to read the source (--sep, --image-key, ...)


def check_source_config(cfg: PrepareConfig | DataSplitConfig | InspectConfig) -> None:
    """UserError (one line) for a value out of bounds or a source that is not there; reads no data."""
    check_fields(cfg)
    source = getattr(cfg, "src", None) or getattr(cfg, "path", None)
    if source is not None:
        check_data(source)


def check_data(path: str | None, option: str = "") -> None:
    """UserError (one line) unless the data source ``path`` can be looked at: a local one exists and may be
    searched, an ``hf:`` name is well formed (and cached when the hub is offline). None passes."""
    if path is None:
        return
    if path.startswith("hf:"):
        check_hub_name(path, option)
    check_source(path, option)
