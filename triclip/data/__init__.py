"""Paired image-text data: every accepted source, bad-record skipping, a torch Dataset.

``load_pairs(path, config)`` reads a JSONL manifest, an open_clip CSV/TSV, a
Hugging Face ``datasets`` dataset (saved to disk, or ``hf:NAME``) or WebDataset
``.tar`` shards into a :class:`PairSet`; ``PairDataset`` decodes images lazily
for training and evaluation; ``inspect`` reports usable and skipped records;
``triclip.data.builtin.prepare`` writes the built-in datasets;
``triclip.data.split.split_source`` splits any source by image content.
"""

# Each module registers its source format; detection tries them in this order.
from triclip.data import jsonl, tabular, hf, wds  # noqa: F401, I001  isort: skip
from triclip.data.images import DEFAULT_MAX_PIXELS, BytesImage, FileImage, decode_image, probe_image
from triclip.data.reasons import REASONS, BadRecord
from triclip.data.records import DataConfig, PairSet, Record
from triclip.data.report import inspect
from triclip.data.sources import SOURCES, detect_source, load_pairs, register_source

_TORCH_NAMES = ("PairDataset", "collate_pairs", "pick_caption", "to_tensor")  # imported on first use


def __getattr__(name: str):
    """Import the torch-dependent names lazily, so reading and inspecting data never loads torch."""
    if name in _TORCH_NAMES:
        from triclip.data import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_MAX_PIXELS",
    "REASONS",
    "SOURCES",
    "BadRecord",
    "BytesImage",
    "DataConfig",
    "FileImage",
    "PairDataset",
    "PairSet",
    "Record",
    "collate_pairs",
    "decode_image",
    "detect_source",
    "inspect",
    "load_pairs",
    "pick_caption",
    "probe_image",
    "register_source",
    "to_tensor",
]
