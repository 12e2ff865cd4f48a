"""Two CPU processes (gloo) give the same losses and gradients as one process on the whole batch.

Each rank encodes its own slice (5 rows on rank 0, 3 on rank 1: unequal on purpose)
with a tiny linear dual encoder wrapped in DDP; every objective gathers the global
batch, so after DDP's gradient averaging the encoder, importance and logit-scale
gradients must equal those of one process on the concatenated batch.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from triclip.core.distributed import gather_features, gather_with_grad, world_size
from triclip.losses import build_loss

SPLIT = (5, 3)  # rows per rank
SCALE_FREE = {"align_uniform", "contrastive", "triplet", "spectral", "tricl_spectral"}  # un-nested: s unused
OBJECTIVES = [
    ("infonce", {}),
    ("debiased", {"tau_plus": 0.1}),
    ("tricl", {"dec_weight": 1.0}),
    ("tricl", {"dec_weight": 0.5, "tau_plus": 0.2}),
    ("align_uniform", {}),
    ("contrastive", {"margin": 1.5}),
    ("triplet", {"mining": "all"}),
    ("triplet", {"mining": "semihard"}),
    ("sigmoid", {}),
    ("hard_negative", {}),
    ("spectral", {}),
    ("tricl_spectral", {"dec_weight": 0.5}),
    ("tricl_spectral", {"nested": 1}),
]


class _TinyDualEncoder(nn.Module):
    """Linear towers, an importance parameter and a logit-scale parameter (float64)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image = nn.Linear(5, 4, dtype=torch.float64)
        self.text = nn.Linear(6, 4, dtype=torch.float64)
        self.theta = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.log_scale = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        image = F.normalize(self.image(x), dim=1)  # (b, 4)
        text = F.normalize(self.text(y), dim=1)  # (b, 4)
        return image, text, self.log_scale.exp(), F.softplus(self.theta)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(SPLIT), 5, generator=g, dtype=torch.float64)
    return x, x[:, :1].repeat(1, 6) + 0.5 * torch.randn(sum(SPLIT), 6, generator=g, dtype=torch.float64)


def _step(model: nn.Module, core: nn.Module, x, y, name: str, opts: dict) -> dict:
    loss = build_loss(name, **opts).double()
    image, text, s, w = model(x, y)
    terms = loss(image, text, s, w)
    sum(terms.values()).backward()
    grads = {n: p.grad.clone() for n, p in core.named_parameters() if p.grad is not None}
    grads.update({f"loss.{n}": p.grad.clone() for n, p in loss.named_parameters()})
    return {"terms": {k: v.detach() for k, v in terms.items()}, "grads": grads}


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=len(SPLIT))
    try:
        x, y = _batch()
        start = sum(SPLIT[:rank])
        part = slice(start, start + SPLIT[rank])
        results = {"world_size": world_size(), "runs": []}
        for name, opts in OBJECTIVES:
            core = _TinyDualEncoder()
            ddp = nn.parallel.DistributedDataParallel(core, find_unused_parameters=True)
            results["runs"].append(_step(ddp, core, x[part], y[part], name, opts))
        local = x[part].clone().requires_grad_(True)
        gathered = gather_with_grad(local)
        (gathered * torch.arange(1.0, len(gathered) + 1, dtype=torch.float64)[:, None]).sum().backward()
        results["gathered"], results["local_grad"] = gathered.detach(), local.grad
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_identity_without_torch_distributed():
    image, text = torch.randn(3, 2), torch.randn(3, 2)
    assert world_size() == 1
    got_image, got_text = gather_features(image, text)
    assert got_image is image and got_text is text
    assert gather_with_grad(image) is image


def test_two_gloo_ranks_equal_one_process_on_the_concatenated_batch(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=len(SPLIT), join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(len(SPLIT))]
    x, y = _batch()

    for rank, res in enumerate(ranks):  # the gather itself: rank order, grad = world_size * local slice
        assert res["world_size"] == 2
        torch.testing.assert_close(res["gathered"], x, rtol=0, atol=0)
        start = sum(SPLIT[:rank])
        weights = torch.arange(start + 1.0, start + SPLIT[rank] + 1, dtype=torch.float64)[:, None]
        torch.testing.assert_close(res["local_grad"], 2 * weights.expand(-1, 5))

    for (name, opts), *runs in zip(OBJECTIVES, *(r["runs"] for r in ranks)):
        core = _TinyDualEncoder()
        want = _step(core, core, x, y, name, opts)
        expected_params = {"image.weight", "image.bias", "text.weight", "text.bias"}
        expected_params |= {"log_scale"} if name not in SCALE_FREE or opts.get("nested") else set()
        expected_params |= {"theta"} if build_loss(name, **opts).needs_importance else set()
        assert expected_params <= set(want["grads"]), name
        for got in runs:
            assert got["terms"].keys() == want["terms"].keys(), name
            for key in want["terms"]:
                torch.testing.assert_close(got["terms"][key], want["terms"][key], rtol=1e-12, atol=1e-12)
            assert got["grads"].keys() == want["grads"].keys(), name
            for key in want["grads"]:
                torch.testing.assert_close(
                    got["grads"][key], want["grads"][key], rtol=1e-9, atol=1e-12, msg=f"{name} {key}"
                )
