"""``triclip search`` and its Python API: load the model and the index once, answer many queries.

    searcher = Searcher.load("INDEX")                       # the run recorded in the manifest
    hits = searcher.search_text(["a red circle", ...], k=10)  # list (per query) of hit lists
    hits = searcher.search_image(["query.png"], k=10)

A hit is ``{"id", "image", "caption", "score"}``, best first; ``score`` is the inner
product of the compact embeddings (cosine). Queries are embedded in batches with
the transform stored in the manifest (same ordering, weights and signs as the
index). ``target="image"`` (default) searches the image vectors (text->image,
image->image); ``target="text"`` searches the caption vectors (image->text,
text->text) when the index has them. A run whose weights differ from the ones
the index was built with (its fingerprint) is refused.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from index import faiss_index as fi
from index.store import IndexContents, load_contents, read_manifest
from retrieval.compact import CompactTransform
from retrieval.embed import embed_image_files, embed_texts, pick_device
from retrieval.errors import UserError
from retrieval.run import load_run, read_config, run_fingerprint

TARGETS = ("image", "text")


@dataclass
class Searcher:
    """A loaded model + index pair. Build with :meth:`load`."""

    contents: IndexContents  # the index files, in memory
    model: torch.nn.Module  # the run's dual encoder, eval mode
    transform: CompactTransform  # (N, D) -> (N, m), as the index was built
    device: torch.device  # where the model runs
    batch_size: int = 64  # queries embedded per batch
    params: fi.SearchParams | None = None  # nprobe / efSearch overrides

    @classmethod
    def load(
        cls,
        index_dir: str | os.PathLike,
        run: str | os.PathLike | None = None,
        device: str | None = None,
        gpu: bool | None = None,
    ) -> "Searcher":
        """Open ``index_dir`` with ``run`` (default: the run recorded in its manifest).

        ``gpu``: search Flat / IVF indexes on the GPU (``None``: when faiss sees one).

        Raises:
            UserError: no index there, the run is missing, or its fingerprint differs
                from the index's.
        """
        manifest = read_manifest(index_dir)
        run = os.fspath(run) if run is not None else manifest["run"]
        fingerprint = _fingerprint(run)
        if fingerprint != manifest["fingerprint"]:
            raise UserError(
                f"run {run} (fingerprint {fingerprint}) is not the run index {index_dir} was built with"
                f" ({manifest['run']}, fingerprint {manifest['fingerprint']}); rebuild the index or pass that --run"
            )
        dev = pick_device(device)
        model, _ = load_run(run, dev)
        contents = load_contents(index_dir)
        contents.image_index = fi.to_device(contents.image_index, gpu)
        if contents.text_index is not None:
            contents.text_index = fi.to_device(contents.text_index, gpu)
        return cls(contents, model, CompactTransform.from_dict(manifest["transform"]), dev)

    def __len__(self) -> int:
        return int(self.contents.image_index.ntotal)

    # -- embedding queries

    def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Compact query embeddings of texts. Shape: (Q, m)."""
        if isinstance(texts, str):
            raise UserError("search_text expects a list of strings")
        return self.transform(embed_texts(self.model, list(texts), self.device, self.batch_size)).numpy()

    def embed_images(self, paths: Sequence[str | os.PathLike]) -> np.ndarray:
        """Compact query embeddings of image files. Shape: (Q, m)."""
        if isinstance(paths, (str, os.PathLike)):
            raise UserError("search_image expects a list of paths")
        return self.transform(embed_image_files(self.model, paths, self.device, self.batch_size)).numpy()

    # -- searching

    def search_text(self, texts: Sequence[str], k: int = 10, target: str = "image") -> list[list[dict]]:
        """Top-k hits for each text query (text->image by default)."""
        return self.search_vectors(self.embed_texts(texts), k, target)

    def search_image(self, paths: Sequence[str | os.PathLike], k: int = 10, target: str = "image") -> list[list[dict]]:
        """Top-k hits for each query image file (image->image by default, image->text with target="text")."""
        return self.search_vectors(self.embed_images(paths), k, target)

    def search_vectors(self, queries: np.ndarray, k: int = 10, target: str = "image") -> list[list[dict]]:
        """Top-k hits for compact query vectors (Q, m)."""
        if not isinstance(k, numbers.Integral) or isinstance(k, bool) or k < 1:
            raise UserError(f"-k must be a positive integer, got {k!r}")
        if target not in TARGETS:
            raise UserError(f"unknown search target {target!r}; choose from {TARGETS}")
        index = self.contents.image_index if target == "image" else self.contents.text_index
        if index is None:
            raise UserError("this index has no caption vectors (built without the text index)")
        if len(queries) == 0:
            return []
        scores, ids = fi.search(index, queries, int(k), self.params)  # (Q, k'), (Q, k')
        return [self._hits(s, i, target) for s, i in zip(scores, ids)]

    def _hits(self, scores: np.ndarray, ids: np.ndarray, target: str) -> list[dict]:
        hits = []
        for score, vid in zip(scores.tolist(), ids.tolist()):
            if vid < 0:  # approximate index found fewer than k
                continue
            row, caption = (vid, 0) if target == "image" else map(int, self.contents.text_rows[vid])
            meta = self.contents.meta[row]
            hits.append({"id": meta["id"], "image": meta["image"], "caption": meta["captions"][caption], "score": score})
        return hits


def _fingerprint(run: str) -> str:
    """The run's fingerprint; UserError when the run (or its weights) is missing."""
    read_config(run)  # UserError: not a run
    return run_fingerprint(run)  # UserError: no weights
