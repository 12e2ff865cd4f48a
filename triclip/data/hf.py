"""Hugging Face ``datasets``: a directory written by ``save_to_disk``, or ``hf:NAME`` on the hub.

The image column may hold ``datasets.Image`` values (bytes, or a path) or plain
path strings; it is read with ``decode=False`` so nothing is decoded while the
source is read. The caption column may hold a string or a list of strings. A
``ClassLabel`` label column gives class names. Defaults: split ``train``, image
column ``image`` (else ``img``, ``jpg``), caption column ``text`` (else
``caption``, ``captions``, ``sentences``), label column ``label`` when present.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterator

from triclip.data.images import open_regular
from triclip.data.reasons import BAD_ROW, EMPTY_CAPTION, BadRecord
from triclip.data.records import DataConfig, Record
from triclip.data.sources import clean_captions, clean_label, register_source, resolve_path
from triclip.core.errors import UserError

IMAGE_COLUMNS = ("image", "img", "jpg")  # tried in order when no image key is given
CAPTION_COLUMNS = ("text", "caption", "captions", "sentences")  # tried in order when no caption key is given
HUB_LOGGERS = ("huggingface_hub", "datasets", "fsspec", "httpx")  # their own lines about a failed request
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # a hub data set id: NAME or OWNER/NAME


@dataclass(frozen=True, eq=False)
class DatasetCell:
    """The image of one row of a dataset whose image column is read with ``decode=False``."""

    dataset: Any  # datasets.Dataset holding only the image column (memory-mapped, picklable)
    row: int  # row index
    column: str  # image column name
    base_dir: str  # folder that relative paths in the column are relative to
    name: str  # readable name of the dataset

    @property
    def location(self) -> str:
        return f"{self.name}[{self.row}]"

    def open(self) -> BinaryIO:
        value = self.dataset[self.row][self.column]
        if isinstance(value, dict) and value.get("bytes"):
            return io.BytesIO(value["bytes"])
        path = value.get("path") if isinstance(value, dict) else value
        if not isinstance(path, str) or not path:
            raise FileNotFoundError(2, "no image in this row")
        return open_regular(resolve_path(self.base_dir, path))


def _is_saved_dataset(path: str) -> bool:
    if path.startswith("hf:"):
        return True
    markers = ("dataset_dict.json", "state.json")
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in markers)


def hub_offline() -> bool:
    """True when the environment says the Hugging Face hub must not be reached (read now, not at import)."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _cached(name: str) -> bool:
    """Whether the hub data set ``name`` has a copy in the local caches (hub snapshots, or datasets' own)."""
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub")
    own = os.environ.get("HF_DATASETS_CACHE") or os.path.join(home, "datasets")
    return os.path.isdir(os.path.join(hub, "datasets--" + name.replace("/", "--"))) or os.path.isdir(
        os.path.join(own, name.replace("/", "___"))
    )


def check_hub_name(path: str, option: str = "") -> None:
    """UserError (one line) unless ``hf:NAME`` names a hub data set that can be reached: ``NAME`` or
    ``OWNER/NAME``, and in the local cache when the hub is offline. Reads nothing but the cache's folders."""
    name = path[3:]
    where = f"{option}: " if option else ""
    if not HUB_NAME.fullmatch(name):
        raise UserError(f"{where}{path!r} is not a Hugging Face data set name (hf:NAME or hf:OWNER/NAME)")
    if hub_offline() and not _cached(name):  # offline means offline: not even a HEAD request
        raise UserError(
            f"{where}cannot load {name!r}: it is not in the local Hugging Face cache and the hub is offline"
            " (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); fetch it where there is a network, or give a save_to_disk folder"
        )


def _load(path: str, split: str):
    """The ``datasets.Dataset`` for one split, or a :class:`UserError` in one line."""
    import datasets

    if path.startswith("hf:"):
        name = path[3:]
        check_hub_name(path)
        try:
            with _quiet(HUB_LOGGERS):
                return datasets.load_dataset(name, split=split)
        except Exception as err:  # offline, unknown name, no such split: all the user's to fix
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise UserError(f"cannot load {name!r} from the Hugging Face hub: {first}") from None
    try:
        data = datasets.load_from_disk(path)
    except Exception as err:  # noqa: BLE001  damaged or foreign folder: datasets raises many types
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"{path}: not a readable datasets.save_to_disk folder: {type(err).__name__}: {first}") from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise UserError(f"{path}: no split {split!r} (splits: {', '.join(data)}); choose one with --split")
        data = data[split]
    return data


@contextlib.contextmanager
def _quiet(names: tuple[str, ...]):
    """The loggers ``names`` silenced meanwhile: the hub client logs every failed request and retry itself
    (``'[Errno -2] ...' thrown while requesting HEAD ...``), where our one line says why the load failed."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _pick_column(columns: list[str], wanted: str | None, defaults: tuple[str, ...], option: str, path: str) -> str:
    names = (wanted,) if wanted else defaults
    for name in names:
        if name in columns:
            return name
    wanted_names = " or ".join(map(repr, names))
    raise UserError(f"{path}: no column {wanted_names} (columns: {', '.join(columns)}); choose one with {option}")


def _label_names(data, column: str | None):
    """A function from stored label to label: class names for a ClassLabel column."""
    feature = data.features.get(column) if column else None
    if feature is not None and hasattr(feature, "int2str"):
        return lambda value: feature.int2str(value) if isinstance(value, int) and value >= 0 else None
    return clean_label


@register_source("hf", _is_saved_dataset, "a datasets.save_to_disk directory or hf:NAME")
def read_hf(path: str, config: DataConfig) -> Iterator[Record | BadRecord]:
    """Yield one record per row of the chosen split."""
    import datasets

    data = _load(path, config.split or "train")
    columns = list(data.column_names)
    image_col = _pick_column(columns, config.image_key, IMAGE_COLUMNS, "--image-key", path)
    caption_col = _pick_column(columns, config.caption_key, CAPTION_COLUMNS, "--caption-key", path)
    label_col = config.label_key or ("label" if "label" in columns else None)
    if label_col is not None:
        _pick_column(columns, label_col, (), "--label-key", path)
    if isinstance(data.features[image_col], datasets.Image):
        data = data.cast_column(image_col, datasets.Image(decode=False))
    images = data.select_columns([image_col])
    label_of = _label_names(data, label_col)
    base = path if os.path.isdir(path) else os.getcwd()
    text_columns = [caption_col] + ([label_col] if label_col else [])
    for row, values in enumerate(data.select_columns(text_columns)):
        yield _record(row, values, caption_col, label_col, label_of, DatasetCell(images, row, image_col, base, path))


def _record(
    row: int, values: dict, caption_col: str, label_col: str | None, label_of, cell: DatasetCell
) -> Record | BadRecord:
    captions = clean_captions(values[caption_col])
    if captions is None:
        if values[caption_col] is None:
            return BadRecord(EMPTY_CAPTION, f"row {row}")
        return BadRecord(BAD_ROW, f"row {row}: {caption_col!r} must be a string or a list of strings")
    if not captions:
        return BadRecord(EMPTY_CAPTION, f"row {row}")
    label = label_of(values[label_col]) if label_col else None
    return Record(key=f"{row}", captions=captions, label=label, image=cell)
