"""Fast CPU inference for the ``lite`` towers when they run without autograd.

Embedding openclipart with the EfficientNet-Lite0 image tower is the demo's
bottleneck. PyTorch's eager CPU path is slow for it (depthwise convolutions,
TensorFlow "SAME" padding computed per call, unfolded BatchNorm). This module
gives every embedding pass the fastest path available, measured by
``python -m benchmarks.bench_towers`` (docs/benchmarks.md, "Tower inference"):

1. ``onnxruntime``: the tower is exported to ONNX in memory (``torch.onnx``,
   which needs the ``onnx`` package) and run by ONNX Runtime's CPU provider,
   which folds BatchNorm into the convolutions and fuses the activations and
   attention. Both PyPI packages are optional (``pip install triclip[fast]``).
2. ``jit`` (image tower only; no extra package): ``torch.jit.trace`` in
   ``channels_last``, ``freeze`` and ``optimize_for_inference`` (BatchNorm
   folded, oneDNN convolutions).
3. ``eager``: the module itself.

``TRICLIP_ACCEL`` = ``auto`` (default: the first that works), ``onnxruntime``,
``jit`` or ``eager`` picks one. The fast path is used only where it cannot
change what is computed: the tower is in eval mode, on the CPU, gradients are
off and the input has the shape it was exported for; otherwise the eager module
runs. A prepared module is kept per tower (weakly) and rebuilt when any of its
parameters or buffers changes (PyTorch's in-place version counters), so a tower
that trains between evaluations is never read stale; a tower built again with the
same class and weights (its sha256) reuses the last ONNX Runtime session of its kind. An embedding pass calls a
single-threaded session from several threads at once (``pass_threads``), each on its own batch; other callers get
a session on torch's thread count. Outputs stay within cosine
0.999 of the eager fp32 reference (tests/model/test_accel.py). bf16 is never
used: this CPU has no fast bf16 path (docs/CONTRACT.md, "Environment").
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn as nn

from triclip.core.errors import UserError
from triclip.model.towers import ImageTower, TextTower

BACKENDS = ("auto", "onnxruntime", "jit", "eager")  # values of TRICLIP_ACCEL
SNAPSHOTS = ("onnxruntime",)  # backends whose prepared forward holds its own copy of the weights (a serialised graph)
ENV = "TRICLIP_ACCEL"  # environment variable that picks the backend
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # the text tower's token tensors, in ONNX order
# Images per image-tower call in an embedding pass. The outputs are the same bit for bit at any batch size
# (tests/model/test_accel.py); a batch of 64 holds ~1.6 GB of activations that a new session's memory touches
# page by page, and its 38 MB input is mapped and unmapped per batch. At 16 the demo's train pass ran 7% faster
# with 1.3 GB less peak memory (docs/benchmarks.md, "Page faults").
IMAGE_BATCH = 16
# Images per ONNX Runtime image-session call, whatever the batch: a session's memory grows to hold the activations
# of its largest call (two calls at once in a pass), and on these VMs a page a process touches for the first time
# is dear (~50 us: the host backs it anew). The demo's train pass in batches of 16, a new process each,
# alternating, twice: one call per batch 60.8 / 63.9 s, 4.2 / 6.6 s system time, 205k / 519k faults, peak 1.9 GB;
# calls of 4, 55.2 / 62.2 s, 0.8 / 1.0 s, 89k, 1.4 GB; the same features bit for bit (docs/benchmarks.md).
SESSION_IMAGES = 4


@dataclass
class Prepared:
    """A tower's fast forward and what it was prepared from."""

    backend: str  # "onnxruntime", "jit" or "eager"
    run: Callable  # same inputs and output as the tower's forward, no autograd
    stamp: tuple  # the tower's weight versions when prepared (see weights_stamp)


# tower -> {threads: its prepared forward}; threads 0 is torch's thread count, 1 a single-threaded session
_PREPARED: "weakref.WeakKeyDictionary[nn.Module, dict[int, Prepared]]" = weakref.WeakKeyDictionary()
# The last exported session of each kind of module, by content: a tower built again with the same weights
# (the demo's test pass builds its model anew after training) reuses it instead of exporting again.
# (class name, key, threads) -> (content key, Prepared); only sessions, which hold a copy of the weights, are kept here.
_SHARED: dict[tuple, tuple[tuple, Prepared]] = {}
_LOCK = threading.Lock()  # one preparation at a time (the app embeds from several threads)


# ---------------------------------------------------------------------------- public API


def image_features(model, images: torch.Tensor, single_thread: bool = False) -> torch.Tensor:
    """``model.image_features`` through the fast path where it applies. Shape: (B, 3, H, W) -> (B, F).

    ``single_thread``: an ONNX Runtime session runs the call on the calling thread alone, for passes that call the
    tower from several threads at once (:func:`pass_threads`). The outputs are the same bit for bit.
    """
    tower = model.image_tower
    size = getattr(tower, "image_size", None)  # the resolution the fast path is exported for
    if _fast_ok(tower) and images.device.type == "cpu" and tuple(images.shape[1:]) == (3, size, size):
        return _prepared(tower, None, size, threads=1 if single_thread else 0).run(images)
    return model.image_features(images)


def pass_threads(tower: nn.Module, device) -> int:
    """How many threads an embedding pass should run at once, each making a batch (decoding images,
    tokenizing captions) and calling the tower with ``single_thread``: torch's thread count where ``tower``
    (a model's ``image_tower`` or ``text_tower``) will run in ONNX Runtime on the CPU, else 1.

    Two threads each with a single-threaded session never wait for each other inside an operator, and leave no
    third thread to share the cores with: on 2 cores 1.1-1.4x the images per second of one decoding thread
    feeding a two-thread session (docs/benchmarks.md, "Tower inference"). Call it under ``no_grad``.
    """
    fast = isinstance(tower, (ImageTower, TextTower)) and module_pass_threads(tower, device) > 1
    return max(1, torch.get_num_threads()) if fast else 1


def module_pass_threads(module: nn.Module, device) -> int:
    """:func:`pass_threads` for a part of a tower (e.g. the frozen bottom of a partly unlocked one) that the caller
    knows the fast path takes (:func:`image_module_features`): torch's thread count where it runs in ONNX Runtime
    on the CPU, else 1."""
    fast = torch.device(device).type == "cpu" and _fast_ok(module)
    session = os.environ.get(ENV, "auto") in ("auto", "onnxruntime") and onnxruntime_available()
    return max(1, torch.get_num_threads()) if fast and session else 1


def text_features(model, texts, single_thread: bool = False) -> torch.Tensor:
    """``model.text_features`` of texts (list[str]) or tokens through the fast path. Shape: (B, F).

    ``single_thread``: as for :func:`image_features`.
    """
    tokens = model.tokenize(list(texts)) if isinstance(texts, (list, tuple)) else texts
    tower = model.text_tower
    if _fast_ok(tower) and isinstance(tokens, Mapping) and all(v.device.type == "cpu" for v in tokens.values()):
        return _prepared(tower, None, None, threads=1 if single_thread else 0).run(tokens)
    device = next(tower.parameters()).device
    if isinstance(tokens, Mapping):
        return model.text_features({k: v.to(device) for k, v in tokens.items()})
    return model.text_features(tokens.to(device))


MAX_TOKENS = 2048  # padded tokens in one text batch (rows x its longest): long captions go in small batches


def text_batches(model, texts: Sequence[str], batch_size: int) -> list[list[int]]:
    """Row numbers of ``texts`` in batches of similar token length, shortest first.

    A batch holds at most ``batch_size`` rows and, where the tokenizer pads to the longest
    text (an attention mask), at most :data:`MAX_TOKENS` padded tokens: a batch of 256
    captions of 256 tokens holds a 0.8 GB attention matrix per layer and runs 3x slower
    than the same captions in batches of 8 (docs/benchmarks.md, "Tower inference").
    Fixed-length tokenizers keep batches of ``batch_size`` in character-length order.
    """
    lengths = _token_lengths(model, texts)
    if lengths is None:
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    order = sorted(range(len(texts)), key=lambda i: lengths[i])
    batches, start = [], 0
    while start < len(order):
        stop = start + 1  # ascending: the row at stop - 1 is the batch's longest
        while stop < len(order) and stop - start < batch_size and lengths[order[stop]] * (stop - start + 1) <= MAX_TOKENS:
            stop += 1
        batches.append(order[start:stop])
        start = stop
    return batches


def distinct_texts(texts: Sequence[str]) -> tuple[list[str], torch.Tensor]:
    """``(distinct, inverse)``: each text once, in order of first appearance, and ``inverse`` (M,) long
    with ``texts[i] == distinct[inverse[i]]``, so a tower runs once per distinct text and
    ``features[inverse]`` gives every row back."""
    first: dict[str, int] = {}
    inverse = [first.setdefault(text, len(first)) for text in texts]
    return list(first), torch.tensor(inverse, dtype=torch.long)


def _token_lengths(model, texts: Sequence[str], chunk: int = 1024) -> list[int] | None:
    """Tokens of each text after truncation, or None when the tokenizer pads to a fixed length."""
    lengths = []
    for s in range(0, len(texts), chunk):
        tokens = model.tokenize(list(texts[s : s + chunk]))
        if not isinstance(tokens, Mapping) or "attention_mask" not in tokens:
            return None
        lengths += tokens["attention_mask"].sum(1).tolist()
    return lengths


def image_module_features(module: nn.Module, images: torch.Tensor, key: str | None = None,
                          single_thread: bool = False) -> torch.Tensor:
    """``module(images)`` (or its ``[key]`` where it returns a dict) through the fast path where it applies.

    For frozen parts of image towers, e.g. the bottom of a partly unlocked tower
    (``triclip.model.unlock``), whose one pass over a data set is the expensive part of unlocking.
    ``single_thread``: as for :func:`image_features`. Shape: (B, 3, S, S) -> (B, ...).
    """
    if _fast_ok(module) and images.device.type == "cpu" and images.dim() == 4 and images.shape[2] == images.shape[3]:
        return _prepared(module, None, int(images.shape[-1]), key, threads=1 if single_thread else 0).run(images)
    out = module(images)
    return out[key] if key is not None else out


def inference_module(tower: nn.Module, backend: str | None = None) -> Callable:
    """The fastest available forward of ``tower`` for CPU inference without autograd.

    Args:
        tower: an ``ImageTower`` or ``TextTower``; any other module is returned as is.
        backend: one of ``BACKENDS``; default ``$TRICLIP_ACCEL`` or ``auto``.

    Returns:
        A callable with the tower's inputs and output (float32 CPU tensors). The
        caller must keep the tower in eval mode and call it under ``no_grad``.
    """
    if not isinstance(tower, (ImageTower, TextTower)):
        return tower
    return _prepared(tower, backend, tower.image_size if isinstance(tower, ImageTower) else None).run


def _prepared(module: nn.Module, backend: str | None, size: int | None, key: str | None = None, threads: int = 0) -> Prepared:
    """The module's prepared forward, rebuilt when its weights, the backend or the input size changed.

    ``threads``: an ONNX Runtime session's threads (0: torch's thread count); the other backends use torch's.
    """
    backend = backend or os.environ.get(ENV, "auto")
    if backend not in BACKENDS:
        raise UserError(f"{ENV}={backend!r}: choose one of {', '.join(BACKENDS)}")
    stamp = (weights_stamp(module), size, key)
    with _LOCK:
        known = _PREPARED.setdefault(module, {})
        prepared = known.get(threads)
        if prepared is None or prepared.stamp != stamp or backend not in ("auto", prepared.backend):
            prepared = known[threads] = _shared(module, backend, stamp, size, key, threads)
    return prepared


def _shared(module: nn.Module, backend: str, stamp: tuple, size: int | None, key: str | None, threads: int) -> Prepared:
    """The session last prepared for a module of the same class, weights, input size and threads, else a new one."""
    slot = (type(module).__qualname__, key, threads)
    content = (repr(module), module_hash(module), backend, size)
    known = _SHARED.get(slot)
    if known is not None and known[0] == content:
        return Prepared(known[1].backend, known[1].run, stamp)
    prepared = _prepare(module if key is None else _Select(module, key), backend, stamp, size, threads)
    if prepared.backend in SNAPSHOTS:
        _SHARED[slot] = (content, prepared)
    return prepared


def active_backend(tower: nn.Module) -> str:
    """The backend last prepared for ``tower`` (``"eager"`` when none was)."""
    known = _PREPARED.get(tower)
    return list(known.values())[-1].backend if known else "eager"


def onnxruntime_available() -> bool:
    """True when both ``onnx`` (for the export) and ``onnxruntime`` import."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------- preparation


def _fast_ok(tower: nn.Module) -> bool:
    """The fast path computes the same thing: eval mode, no autograd, weights on the CPU."""
    if tower.training or torch.is_grad_enabled():
        return False
    first = next(tower.parameters(), None)
    return first is not None and first.device.type == "cpu"


def weights_stamp(tower: nn.Module) -> tuple:
    """Identity and in-place version of every parameter and buffer: changes whenever the weights do."""
    return tuple((t.data_ptr(), t._version) for t in (*tower.parameters(), *tower.buffers()))


# module -> (its weights' stamp, its hash): a tower's ~100 MB are hashed once per process, not at every
# epoch's evaluation (the cache paths of the validation data), while any change to the weights is seen
_HASHES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str]]" = weakref.WeakKeyDictionary()


def module_hash(module: torch.nn.Module) -> str:
    """sha256 over a module's parameter and buffer names, shapes and bytes (remembered while they stay the same)."""
    stamp = weights_stamp(module)
    known = _HASHES.get(module)
    if known is not None and known[0] == stamp:
        return known[1]
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    _HASHES[module] = (stamp, digest.hexdigest())
    return digest.hexdigest()


def _prepare(tower: nn.Module, backend: str, stamp: tuple, size: int | None, threads: int = 0) -> Prepared:
    """Build the forward for ``backend``; ``auto`` tries onnxruntime, then jit (images), then eager.

    ``size``: the side of the square images an image module is prepared for; None for the text tower.
    """
    order = {"auto": ["onnxruntime", "jit", "eager"]}.get(backend, [backend])
    if size is None:
        order = [b for b in order if b != "jit"] or ["eager"]  # jit does not help the text tower
    for name in order:
        if name == "onnxruntime" and not onnxruntime_available():
            if backend == name:
                raise UserError(f"{ENV}=onnxruntime needs the PyPI packages onnx and onnxruntime: pip install onnx onnxruntime")
            continue
        builder = {"onnxruntime": _onnxruntime_forward, "jit": _jit_forward, "eager": _eager_forward}[name]
        try:
            return Prepared(name, builder(tower, size, threads), stamp)
        except Exception as err:  # an exporter that cannot handle this torch version: next backend
            if backend == name:
                raise
            warnings.warn(f"fast {type(tower).__name__} path {name} failed ({str(err).splitlines()[0][:200]}); trying the next")
    return Prepared("eager", _eager_forward(tower, size, threads), stamp)


class _Select(nn.Module):
    """``module(x)[key]``: one tensor out of a module that returns a dict (exportable)."""

    def __init__(self, module: nn.Module, key: str):
        super().__init__()
        self.module, self.key = module, key

    def forward(self, x):
        return self.module(x)[self.key]


def _eager_forward(tower: nn.Module, size: int | None = None, threads: int = 0) -> Callable:
    return tower.forward


def _jit_forward(tower: nn.Module, size: int | None, threads: int = 0) -> Callable:
    """Traced, frozen, inference-optimised copy of an image module in channels_last (torch's threads)."""
    if size is None:
        raise ValueError("the jit path is for image modules")
    example = torch.zeros(2, 3, size, size).contiguous(memory_format=torch.channels_last)
    flags = [(p, p.requires_grad) for p in tower.parameters()]
    try:  # a tower part's forward may reach the tower's own weights: the trace keeps them as constants
        tower.requires_grad_(False)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            net = _clone(tower).to(memory_format=torch.channels_last)
            frozen = torch.jit.optimize_for_inference(torch.jit.freeze(torch.jit.trace(net, example)))
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)

    def run(images: torch.Tensor) -> torch.Tensor:  # (B, 3, S, S) -> (B, 1280)
        with torch.no_grad():
            return frozen(images.contiguous(memory_format=torch.channels_last))

    return run


def _clone(tower: nn.Module) -> nn.Module:
    """An eval-mode copy of the tower's network that shares nothing with it (tracing may fold weights)."""
    import copy

    return copy.deepcopy(tower).eval()


class _TextGraph(nn.Module):
    """The text tower with positional inputs, for export. Shape: 3 x (B, L) -> (B, 384)."""

    def __init__(self, tower: TextTower):
        super().__init__()
        self.tower = tower

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.tower({"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids})


def _onnx_bytes(tower: nn.Module, size: int | None) -> bytes:
    """The tower exported to ONNX (opset 17) in memory, batch (and text length) dynamic."""
    buffer = io.BytesIO()
    if size is not None:
        graph, args = tower, (torch.zeros(1, 3, size, size),)
        names, axes = ["images"], {"images": {0: "batch"}, "features": {0: "batch"}}
    else:
        graph = _TextGraph(tower)
        tokens = tower.tokenize(["an example caption", "a longer example caption of the export"])
        args = tuple(tokens[k] for k in TEXT_INPUTS)
        names = list(TEXT_INPUTS)
        axes = {**{k: {0: "batch", 1: "length"} for k in TEXT_INPUTS}, "features": {0: "batch"}}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            graph.eval(),
            args,
            buffer,
            input_names=names,
            output_names=["features"],
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )
    return buffer.getvalue()


def _onnxruntime_forward(tower: nn.Module, size: int | None, threads: int = 0) -> Callable:
    """ONNX Runtime CPU session of the exported tower, on ``threads`` threads (0: torch's thread count)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # idle threads sleep: faster on a shared CPU
    session = ort.InferenceSession(_onnx_bytes(tower, size), options, providers=["CPUExecutionProvider"])

    if size is not None:

        def run(images: torch.Tensor) -> torch.Tensor:  # (B, 3, S, S) -> (B, 1280)
            x = images.detach().float().contiguous().numpy()
            parts = [session.run(None, {"images": x[s : s + SESSION_IMAGES]})[0] for s in range(0, len(x), SESSION_IMAGES)]
            return torch.from_numpy(parts[0] if len(parts) == 1 else np.concatenate(parts))

        return run

    def run_text(tokens: Mapping[str, Any]) -> torch.Tensor:  # 3 x (B, L) -> (B, 384)
        ids = tokens["input_ids"]
        feed = {
            "input_ids": ids.long().numpy(),
            "attention_mask": tokens.get("attention_mask", torch.ones_like(ids)).long().numpy(),
            "token_type_ids": tokens.get("token_type_ids", torch.zeros_like(ids)).long().numpy(),
        }
        return torch.from_numpy(session.run(None, feed)[0])

    return run_text
