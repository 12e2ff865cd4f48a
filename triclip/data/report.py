"""``triclip data inspect``: read a source, decode every image, count what is usable."""

from __future__ import annotations

import os
from collections import Counter

from triclip.core.progress import progress

from triclip.data.reasons import BadRecord, count_by_reason, merge_examples, note_example
from triclip.data.records import DataConfig
from triclip.data.sources import load_pairs
from triclip.core.errors import UserError


def inspect(path: str | os.PathLike, config: DataConfig | None = None) -> dict:
    """Load a source and fully decode each image; report usable records and skips by reason.

    Unlike :func:`load_pairs` (header checks only) this catches truncated and
    damaged image bodies too.

    Returns:
        ``{"records", "skipped": {reason: n}, "skipped_examples": {reason: [detail, ...]}, "source", "captions",
        "labels", "fingerprint"}``: ``skipped_examples`` names the first few skipped records of each reason (a
        missing image: its path as tried), ``captions`` counts the usable records' captions,
        ``labels`` the distinct labels (0 when there are none), ``fingerprint``
        that of the usable records.

    Raises:
        UserError: as :func:`load_pairs`, or when no image decodes.
    """
    pairs = load_pairs(path, config)
    decoded, usable, examples = Counter(), [], {}
    for record in progress(pairs.records, desc="decoding images", unit=" img", leave=False, disable=None):
        try:
            record.open_image(pairs.max_pixels).close()
            usable.append(record)
        except BadRecord as bad:
            decoded[bad.reason] += 1
            note_example(examples, bad)
    skipped = count_by_reason(pairs.skipped, decoded)
    if not usable:
        raise UserError(f"no usable records in {os.fspath(path)}; skipped: {skipped}")
    pairs.records, pairs.skipped = usable, Counter(skipped)
    return {
        "records": len(usable),
        "skipped": skipped,
        "skipped_examples": merge_examples(pairs.examples, examples),
        "source": pairs.source,
        "captions": sum(len(r.captions) for r in usable),
        "labels": len({r.label for r in usable if r.label is not None}),
        "fingerprint": pairs.fingerprint,
    }
