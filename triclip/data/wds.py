"""WebDataset ``.tar`` shards: members ``KEY.jpg`` (or png/jpeg/webp) + ``KEY.txt`` (+ ``KEY.cls``).

Accepted paths: one ``.tar`` file, a brace pattern such as ``shards-{000..009}.tar``,
or a directory of ``.tar`` files. Members are grouped into samples the way
WebDataset does (the key is the member path up to the first dot of its file
name). Images are not read here: a record keeps the shard path and the member's
byte offset, and reads just those bytes when decoded. Extensions are set with
``image_key`` (``;``-separated alternatives), ``caption_key`` and ``label_key``.
A caption or label member that is not UTF-8 makes its sample ``bad_encoding``.
"""

from __future__ import annotations

import glob
import io
import os
import re
import tarfile
from dataclasses import dataclass
from typing import BinaryIO, Iterator

from braceexpand import braceexpand

from triclip.data.images import open_regular
from triclip.data.reasons import BAD_ENCODING, BAD_ROW, EMPTY_CAPTION, MISSING_FILE, BadRecord
from triclip.data.records import DataConfig, Record
from triclip.data.sources import clean_captions, clean_label, register_source
from triclip.core.errors import UserError

IMAGE_EXTENSIONS = "jpg;jpeg;png;webp"  # default image extensions, first match wins
KEY_AND_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # WebDataset's split of "dir/key.ext.ext"


@dataclass(frozen=True)
class TarMember:
    """One member of a tar file, read by offset without opening the archive."""

    tar_path: str  # absolute path of the shard
    offset: int  # byte offset of the member's data
    size: int  # member size in bytes
    name: str  # member name, for reports

    @property
    def location(self) -> str:
        return f"{self.tar_path}#{self.name}"

    def open(self) -> BinaryIO:
        with open_regular(self.tar_path) as handle:
            handle.seek(self.offset)
            return io.BytesIO(handle.read(self.size))


def _is_shards(path: str) -> bool:
    if "{" in path:
        return path.endswith(".tar")
    if os.path.isdir(path):
        return any(os.path.isfile(p) for p in glob.glob(os.path.join(path, "*.tar")))
    return os.path.isfile(path) and path.endswith(".tar")


def list_shards(path: str) -> list[str]:
    """The shard files of a path, pattern or directory; every one must exist."""
    if os.path.isdir(path):  # regular files only: opening a FIFO named x.tar would block
        return sorted(p for p in glob.glob(os.path.join(path, "*.tar")) if os.path.isfile(p))
    shards = list(braceexpand(path))
    for shard in shards:
        if not os.path.isfile(shard):
            what = "not a regular file" if os.path.exists(shard) else "not found"
            raise UserError(f"shard {what}: {shard}")
    return shards


def _group_members(tar: tarfile.TarFile) -> dict[str, dict[str, tarfile.TarInfo]]:
    """key -> {extension -> member}, in archive order; stops quietly at a truncated end."""
    samples: dict[str, dict[str, tarfile.TarInfo]] = {}
    try:
        for member in tar:
            match = KEY_AND_EXT.match(member.name)
            if member.isfile() and match:
                samples.setdefault(match.group(1), {})[match.group(2).lower()] = member
    except tarfile.ReadError:
        samples.setdefault("", {})  # a damaged tail: one bad sample
    return samples


@register_source("webdataset", _is_shards, "WebDataset .tar shards (a file, a {000..009} pattern, or a directory)")
def read_shards(path: str, config: DataConfig) -> Iterator[Record | BadRecord]:
    """Yield one record per sample of every shard, in shard order."""
    image_exts = (config.image_key or IMAGE_EXTENSIONS).lower().split(";")
    caption_ext, label_ext = (config.caption_key or "txt").lower(), (config.label_key or "cls").lower()
    for shard in list_shards(path):
        shard = os.path.abspath(shard)
        try:
            tar = tarfile.open(shard, "r:")
        except (tarfile.TarError, OSError) as err:
            raise UserError(f"{shard}: not a readable (uncompressed) tar file: {err}") from None
        with tar:
            for key, members in _group_members(tar).items():
                yield _sample(tar, shard, key, members, image_exts, caption_ext, label_ext)


def _text(tar: tarfile.TarFile, member: tarfile.TarInfo | None) -> str | None:
    if member is None:
        return None
    handle = tar.extractfile(member)
    return handle.read().decode("utf-8-sig") if handle else None  # UnicodeDecodeError: bad_encoding


def _sample(
    tar: tarfile.TarFile, shard: str, key: str, members: dict, image_exts: list[str], caption_ext: str, label_ext: str
) -> Record | BadRecord:
    where = f"{shard}#{key}"
    if not key:
        return BadRecord(BAD_ROW, f"{shard}: damaged tar data")
    image = next((members[ext] for ext in image_exts if ext in members), None)
    if image is None:
        return BadRecord(MISSING_FILE, f"{where}: no {'/'.join(image_exts)} member")
    try:
        caption, label = _text(tar, members.get(caption_ext)), _text(tar, members.get(label_ext))
    except UnicodeDecodeError:
        return BadRecord(BAD_ENCODING, f"{where}: caption or label is not valid UTF-8")
    except (tarfile.TarError, OSError) as err:
        return BadRecord(BAD_ROW, f"{where}: {err}")
    captions = clean_captions(caption or "")
    if not captions:
        return BadRecord(EMPTY_CAPTION, where)
    label = label.strip() if label is not None else None
    label = int(label) if label is not None and label.lstrip("-").isdigit() else clean_label(label or None)
    member = TarMember(shard, image.offset_data, image.size, image.name)
    return Record(key=f"{os.path.basename(shard)}/{key}", captions=captions, label=label, image=member)
