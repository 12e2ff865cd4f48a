"""``index build --embeddings EMB --bytes B --val-embeddings VAL``: the codes chosen on a validation split.

A build from shards has no model to embed ``--val-data`` with, so without VAL its codes are measured on the
indexed shards' own first images (``triclip.index.budgets.indexed_evaluation``): when those are the images a
user will query (a test split hidden in a haystack), the choice has seen its own exam. VAL is the validation
split embedded by ``triclip embed --split val`` with the same run: the same model (fingerprint) and the same
compact transform but for the sign fix, which ``embed`` anchors on each source's first images, so VAL's vectors
are re-signed into EMB's (a sign per dimension: a row's inner products with EMB's rows keep their meaning).
Its first :data:`triclip.index.budgets.EVAL_MAX_IMAGES` images and their captions are the evaluation set.
"""

from __future__ import annotations

import os

import numpy as np

from triclip.core.errors import UserError
from triclip.index.budgets import EVAL_MAX_IMAGES, EvalSet
from triclip.model.shards import check_complete, load_shard


def validation_set(val: str, emb_manifest: dict, max_images: int = EVAL_MAX_IMAGES) -> EvalSet:
    """The evaluation set of ``val`` (``triclip embed`` output), in the vector space of the shards whose
    manifest is ``emb_manifest``. UserError when VAL is another run's, another transform's or holds no captions."""
    manifest = check_complete(val)
    if manifest["fingerprint"] != emb_manifest["fingerprint"]:
        raise UserError(f"--val-embeddings {val} was embedded with run {manifest['run']}, not the shards' run"
                        f" {emb_manifest['run']} (fingerprints differ): embed the validation split with the same run")
    if not manifest.get("text"):
        raise UserError(f"--val-embeddings {val} holds no caption vectors (embedded with --no-text): codes are"
                        " measured by caption queries; embed it again without --no-text")
    signs = sign_change(manifest["transform"], emb_manifest["transform"], val)  # (D,)
    images, texts, owners, captions, rows = [], [], [], [], 0
    for s in range(manifest["num_shards"]):
        if rows >= max_images:
            break
        shard = load_shard(val, s)
        take = min(len(shard["image"]), max_images - rows)
        keep = np.flatnonzero(shard["text_rows"][:, 0] < take)  # the captions of the images taken
        images.append(np.asarray(shard["image"][:take], np.float32))  # (n_s, D)
        texts.append(np.asarray(shard["text"][keep], np.float32))  # (t_s, D)
        owners.append(shard["text_rows"][keep, 0] + rows)
        captions += [shard["meta"][r]["captions"][c] for r, c in shard["text_rows"][keep].tolist()]
        rows += take
    if not captions:
        raise UserError(f"--val-embeddings {val} has no captioned image to measure codes with")
    image, text = np.concatenate(images) * signs, np.concatenate(texts) * signs
    return EvalSet.of(image, text, np.concatenate(owners), captions, "validation", os.path.abspath(val))


def sign_change(val_transform: dict, transform: dict, val: str = "VAL") -> np.ndarray:
    """(D,) float32 of +-1 taking vectors of ``val_transform`` into ``transform``'s space; UserError unless the two
    are the same transform up to the sign fix."""
    if {k: v for k, v in val_transform.items() if k != "signs"} != {k: v for k, v in transform.items() if k != "signs"}:
        raise UserError(f"--val-embeddings {val} holds another compact transform than the shards (ordering, dims or"
                        " importance differ): embed the validation split with the same run")
    dim = int(transform["m"])
    ones = [1.0] * dim
    return (np.asarray(val_transform.get("signs") or ones, np.float32)
            * np.asarray(transform.get("signs") or ones, np.float32))
