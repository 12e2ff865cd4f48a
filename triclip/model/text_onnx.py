"""The text side of a ``lite`` run as a stand-alone ONNX file: text queries without torch.

A text query needs the MiniLM tower, the text head and the L2 normalisation, nothing
else; loading the whole run for it (torch, transformers, both towers) costs seconds.
:func:`export_text_encoder` writes that side once, under ``$TRICLIP_CACHE/text_encoder/``
(default ``~/.cache/triclip``), as::

    KEY/text.onnx        tokens (B, L) x 3 -> (B, D) unit rows: tower, head, normalisation
    KEY/tokenizer.json   the fast tokenizer the run was trained with (``tokenizers`` format)
    KEY/meta.json        version, the run's fingerprint, max_length, dim, file stamps

A new export of a run's weights replaces that run's older ones (other fingerprints).

:func:`cached_text_encoder` opens it with ``onnxruntime`` and ``tokenizers`` only
(neither torch nor transformers is imported) when it is still valid: same format
version, the fingerprint the caller expects, and the files the exporter named (the
run's config and every weights file that could be loaded) unchanged since the export,
by size and modification time. Anything else is a miss: the caller loads the run as
usual, checking its fingerprint, and may export again.

Presets whose text tower is not the Hugging Face MiniLM (``tiny``, open_clip models)
are not exported; they keep the torch path. ``TRICLIP_ACCEL=eager`` or ``jit`` turns
the ONNX path off, as for the towers (``triclip.model.accel``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np

from triclip.core.errors import first_line
from triclip.core.io import read_json, swap_dir, temp_dir, write_json_atomic

VERSION = 1  # format of an entry; bump when what is exported changes
ONNX_FILE = "text.onnx"
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"
INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # the graph's inputs, in order
BATCH = 64  # texts encoded per ONNX Runtime call (sorted by length: little padding)


def cache_root() -> Path:
    """``$TRICLIP_CACHE/text_encoder`` (the same root as the locked-tower cache)."""
    return Path(os.environ.get("TRICLIP_CACHE", Path.home() / ".cache" / "triclip")) / "text_encoder"


def entry_dir(run: str | os.PathLike, which: str, fingerprint: str) -> Path:
    """Where the export of ``run``'s ``which`` weights with ``fingerprint`` lives."""
    key = hashlib.sha256(f"{os.path.realpath(run)}\n{which}\n{fingerprint}".encode()).hexdigest()[:24]
    return cache_root() / f"{fingerprint}-{key}"


def enabled() -> bool:
    """False when ``TRICLIP_ACCEL`` asks for a torch backend, or onnxruntime / tokenizers are missing."""
    if os.environ.get("TRICLIP_ACCEL", "auto") in ("eager", "jit"):
        return False
    try:
        import onnxruntime  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------- reading (no torch)


class TextEncoder:
    """An exported text side: texts -> the run's L2-normalised text embedding, in numpy.

    Thread-safe: ONNX Runtime sessions and ``tokenizers`` tokenizers may be called from
    several threads at once.

    Args:
        path: an entry folder written by :func:`export_text_encoder`.
        threads: ONNX Runtime intra-op threads (None: ``OMP_NUM_THREADS``, else all cores).
    """

    def __init__(self, path: str | os.PathLike, threads: int | None = None):
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.path = Path(path)
        self.meta = read_json(self.path / META_FILE)
        self.dim = int(self.meta["dim"])
        self.tokenizer = Tokenizer.from_file(str(self.path / TOKENIZER_FILE))
        self.tokenizer.enable_truncation(max_length=int(self.meta["max_length"]))
        self.tokenizer.enable_padding(pad_id=int(self.meta["pad_id"]), pad_token=str(self.meta["pad_token"]))
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads or _default_threads()
        options.inter_op_num_threads = 1
        options.log_severity_level = 3  # errors only
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle threads sleep (shared CPU)
        self.session = ort.InferenceSession(str(self.path / ONNX_FILE), options, providers=["CPUExecutionProvider"])

    def tokenize(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """Texts -> ``{"input_ids", "attention_mask", "token_type_ids"}``, each (B, L) int64, padded to the longest."""
        encodings = self.tokenizer.encode_batch(list(texts))
        return {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """L2-normalised text embeddings, as ``DualEncoder.encode_text``. Shape: (B, D) float32."""
        texts = list(texts)
        out = np.zeros((len(texts), self.dim), np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # similar lengths: little padding
        for s in range(0, len(texts), BATCH):
            rows = order[s : s + BATCH]
            feed = self.tokenize([texts[i] for i in rows])
            out[rows] = self.session.run(None, feed)[0]  # (b, D)
        return out


def cached_text_encoder(run: str | os.PathLike, which: str, fingerprint: str) -> TextEncoder | None:
    """The valid export of ``run``'s ``which`` weights with ``fingerprint``, opened; None on a miss."""
    if not enabled():
        return None
    path = entry_dir(run, which, fingerprint)
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("version") != VERSION or meta.get("fingerprint") != fingerprint:
        return None
    if meta.get("stamps") != file_stamps(meta.get("stamps") or {}):
        return None  # the run changed since the export (retrained, replaced)
    try:
        return TextEncoder(path)
    except Exception:  # a damaged entry: the caller takes the torch path and exports again
        return None


def file_stamps(paths) -> dict[str, list[int] | None]:
    """``{path: [size, mtime_ns]}`` (None for a missing file) of each path."""
    stamps = {}
    for path in paths:
        try:
            st = os.stat(path)
            stamps[str(path)] = [st.st_size, st.st_mtime_ns]
        except OSError:
            stamps[str(path)] = None
    return stamps


def _default_threads() -> int:
    """``OMP_NUM_THREADS``, else torch's intra-op count where torch is loaded (a server sets it:
    ``triclip.app.server.set_threads``), else every core."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        torch = sys.modules.get("torch")
        return torch.get_num_threads() if torch is not None else max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------------------- export (torch)


def exportable(model) -> bool:
    """True when the model's text tower is the Hugging Face MiniLM (the ``lite`` presets)."""
    from triclip.model.towers import TextTower

    return isinstance(getattr(model, "text_tower", None), TextTower)


def export_for_run(model, run: str | os.PathLike, which: str, fingerprint: str) -> float:
    """Export a lite run's text side for later text searches; seconds spent (0 where nothing is exported).

    For ``index build`` and the first ``Searcher.load(text_only=True)``. Best effort: a model
    without the MiniLM tower or a missing ``onnx`` / ``onnxruntime`` exports nothing, and a
    failed export is one line on stderr, never an error.
    """
    from triclip.model.run import BEST, CONFIG, MODEL, SELECTION, weights_path

    if not (enabled() and exportable(model)):
        return 0.0
    t0 = time.perf_counter()
    # every file that decides which weights load: a change to any of them is a cache miss
    files = [os.path.join(run, f) for f in (CONFIG, SELECTION, os.path.join(BEST, MODEL), MODEL)]
    try:
        export_text_encoder(model, run, which, fingerprint, [*files, weights_path(run, which)])
    except Exception as err:  # noqa: BLE001 (a cache: the caller's work goes on)
        print(f"note: could not cache the text encoder for fast searches ({first_line(err)})", file=sys.stderr)
    return time.perf_counter() - t0


def export_text_encoder(
    model, run: str | os.PathLike, which: str, fingerprint: str, files: Sequence[str | os.PathLike]
) -> Path:
    """Write the text side of ``model`` (tower, head, normalisation) and its tokenizer as a cache entry.

    Args:
        model: the run's ``DualEncoder`` as :func:`triclip.model.run.load_run` returned it.
        run, which, fingerprint: what the entry is for (see :func:`entry_dir`).
        files: the files whose change invalidates the entry (the run's config and weights).

    Returns:
        The entry folder.

    Raises:
        ValueError: the model's text tower cannot be exported (see :func:`exportable`).
    """
    import copy

    import torch

    if not exportable(model):
        raise ValueError("only the lite presets' MiniLM text tower is exported")
    tower = model.text_tower
    graph = _graph(copy.deepcopy(tower).float().cpu().eval(), copy.deepcopy(model.text_head).float().cpu().eval())
    final = entry_dir(run, which, fingerprint)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(final.parent, f".{final.name}.tmp-")
    try:
        tokens = tower.tokenize(["an example caption", "a longer example caption for the export"])
        args = tuple(tokens[k].cpu() for k in INPUTS)
        axes = {**{k: {0: "batch", 1: "length"} for k in INPUTS}, "embedding": {0: "batch"}}
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer notes on transformers' shape checks (constant for this graph)
            torch.onnx.export(
                graph, args, str(tmp / ONNX_FILE), input_names=list(INPUTS), output_names=["embedding"],
                dynamic_axes=axes, opset_version=17, dynamo=False,
            )  # fmt: skip
        backend = tower.tokenizer.backend_tokenizer  # the Rust tokenizer transformers runs
        (tmp / TOKENIZER_FILE).write_text(backend.to_str(), encoding="utf-8")
        write_json_atomic(
            tmp / META_FILE,
            {
                "version": VERSION,
                "fingerprint": fingerprint,
                "run": os.path.realpath(run),
                "which": which,
                "dim": int(model.embed_dim),
                "max_length": int(tower.max_length),
                "pad_id": int(tower.tokenizer.pad_token_id),
                "pad_token": str(tower.tokenizer.pad_token),
                "stamps": file_stamps(os.path.realpath(f) for f in files),
            },
        )
        swap_dir(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _remove_superseded(final, os.path.realpath(run), which)
    return final


def _remove_superseded(entry: Path, run: str, which: str) -> None:
    """Remove the entries of the same ``run`` (its real path) and ``which`` weights other than ``entry``
    (a retrained run's old export), those of runs whose folder is gone (about 90 MB each for lite), and the
    staging folders of ``entry`` that an export killed mid-way left (``entry`` is whole now)."""
    for other in entry.parent.iterdir():
        if other == entry:
            continue
        if other.name.startswith(f".{entry.name}.tmp-"):
            shutil.rmtree(other, ignore_errors=True)
            continue
        try:
            old = json.loads((other / META_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):  # no meta (not an entry) or a damaged one
            continue
        if not isinstance(old, dict):
            continue
        same = (old.get("run"), old.get("which")) == (run, which)
        if same or not (isinstance(old.get("run"), str) and os.path.isdir(old["run"])):
            shutil.rmtree(other, ignore_errors=True)


def _graph(tower, head):
    """Tokens -> unit-norm text embedding: tower, head, L2 normalisation, as one module. Shape: 3 x (B, L) -> (B, D)."""
    import torch.nn as nn
    import torch.nn.functional as F

    class TextEncoderGraph(nn.Module):
        def __init__(self):
            super().__init__()
            self.tower, self.head = tower, head

        def forward(self, input_ids, attention_mask, token_type_ids):
            tokens = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
            feats = self.tower(tokens)  # (B, 384)
            return F.normalize(self.head(feats), dim=-1)  # (B, D)

    return TextEncoderGraph().eval()
